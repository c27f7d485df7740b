import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DERIVATIONS = ROOT / "derivations"
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def derivations():
    return DERIVATIONS

import sys
from pathlib import Path

import pytest

from aimsym.derive.files import derivations_dir

# the bundled models, located the way the package itself locates them (checkout or wheel); tests
# needing the folder at import time (parametrize) call derivations_dir() themselves
DERIVATIONS = derivations_dir()
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def derivations():
    return DERIVATIONS

"""The hand-written integration drivers, written once here and appended at load time to a
model's generated module (which holds only model-specific constants and kernels).

The assembled text is imported from a file in the user cache named by its hash, so numba's
on-disk cache serves it; editing a driver changes the hash (one recompilation), not generated/.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

_HERE = Path(__file__).resolve().parent
MARKER = "# ---- template begins ----\n"
# name in a generated module's DRIVERS tuple -> file in this folder
FILES = {"driver": "driver_template.py", "hardmax": "hardmax_template.py"}


def _body(name: str) -> str:
    return (_HERE / FILES[name]).read_text().split(MARKER, 1)[1]


def drivers_of(model_text: str) -> tuple[str, ...]:
    m = re.search(r"^DRIVERS = (.*)$", model_text, re.M)
    return tuple(ast.literal_eval(m.group(1))) if m else ()


def assemble(model_text: str) -> str:
    """A generated module's text followed by the drivers it names in ``DRIVERS``."""
    names = drivers_of(model_text)
    text = model_text.rstrip("\n")
    for i, name in enumerate(names):
        text += ("\n\n\n" if i == 0 else "\n\n") + _body(name)
    return text if names else text + "\n"

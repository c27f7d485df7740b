"""The package's own imports follow the pipeline: read every module with ``ast`` (imports inside
functions included: a lazy import is still an arrow), then check that no module imports a later
stage, that the module graph has no circle, and that no ``_private`` name crosses a module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import aimsym

PACKAGE = Path(aimsym.__file__).parent

# Stages from the bottom up: a module may import its own stage or an earlier one, never a later.
# (aimsym/__init__.py, the facade, sits above them all and is imported by nobody inside.)
ORDER = (
    ("aimsym.errors", "aimsym.provenance", "aimsym.results", "aimsym.blas", "aimsym.moved",
     "aimsym.numerics"),  # base: errors, records, JSON, BLAS, shared numeric kernels
    ("aimsym.derive",),   # model file -> spec -> SymPy -> LaTeX, generated kernels
    ("aimsym.bundled",),  # where the bundled model files and generated modules live
    ("aimsym.denoise",),  # the denoiser over the generated kernels
    ("aimsym.model",),    # a loaded model: spec + values + kernels + denoiser
    ("aimsym.smi",),      # SMI solvers: data, SE, thresholds, GAMP, GD
    ("aimsym.aim",),      # attention-indexed models at extensive width
    ("aimsym.erm",),      # ERM in tied attention (uses aim's spectral tools)
    ("aimsym.studies",),  # sweeps, the result store, AIM finite-size series
    ("aimsym.plot",),     # figures
    ("aimsym.bench",),    # benchmarks (and the figure code of docs/amp.md)
    ("aimsym.reproduce",),  # the papers' figures: a registry over plot, bench and the solvers
    ("aimsym.cli",),      # every command-line verb
)
FACADE = "aimsym"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        if "__pycache__" not in p.parts:
            out[_module_name(p)] = p
    return out


MODULES = _modules()


def _resolve(name: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = name.split(".") if is_package else name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str, path: Path):
    """(imported module, imported name or None, line) for every aimsym import in a module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "aimsym":
                    yield a.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(name, is_package, node)
            if target.split(".")[0] != "aimsym":
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in MODULES:  # "from pkg import module"
                    yield sub, None, node.lineno
                else:
                    yield target, a.name, node.lineno


def _stage(module: str) -> int | None:
    for i, group in enumerate(ORDER):
        for g in group:
            if module == g or module.startswith(g + "."):
                return i
    return None


def test_every_module_has_a_stage():
    missing = [m for m in MODULES if m != FACADE and _stage(m) is None]
    assert not missing, f"modules outside the declared order (add them to ORDER): {missing}"


def test_no_upward_import():
    bad = []
    for name, path in MODULES.items():
        if name == FACADE:
            continue
        here = _stage(name)
        for target, _, line in _imports(name, path):
            if target == FACADE:
                bad.append(f"{name}:{line} imports the package facade")
                continue
            there = _stage(target)
            if there is not None and there > here:
                bad.append(f"{name}:{line} imports {target} (a later stage)")
    assert not bad, "\n".join(bad)


def test_no_private_name_across_modules():
    bad = []
    for name, path in MODULES.items():
        for target, imported, line in _imports(name, path):
            leaf = imported if imported is not None else target.rsplit(".", 1)[-1]
            if leaf.startswith("_") and not leaf.startswith("__") and target != name:
                bad.append(f"{name}:{line} imports {leaf} from {target}")
    assert not bad, "\n".join(bad)


def test_no_import_circle():
    graph = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for target, _, _ in _imports(name, path):
            while target not in MODULES and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in MODULES and target != name:
                graph[name].add(target)
    # a package's __init__ importing its own submodules is its job, not a circle
    for name in graph:
        graph[name] = {t for t in graph[name] if not t.startswith(name + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for t in sorted(graph[n]):
            if state.get(t) == 1:
                cycle = stack[stack.index(t):] + [t]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)


def test_sympy_only_in_derive():
    bad = []
    for name, path in MODULES.items():
        if _stage(name) == _stage("aimsym.derive"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(m.split(".")[0] == "sympy" for m in mods):
                bad.append(f"{name}:{node.lineno}")
    assert not bad, "SymPy imported outside aimsym.derive: " + ", ".join(bad)


def test_blas_limit_is_scoped():
    """BLAS thread pinning is a context: the previous count comes back, even after an error."""
    from aimsym.blas import _library, blas_threads

    setter, getter = _library()
    if getter is None:
        pytest.skip("numpy is not linked to a bundled OpenBLAS")
    before = int(getter())
    with blas_threads(1):
        assert int(getter()) == 1
    assert int(getter()) == before
    with pytest.raises(RuntimeError), blas_threads(1):
        raise RuntimeError
    assert int(getter()) == before


def test_old_module_paths_still_import():
    """Code written against the flat layout keeps working (aimsym.moved): same module objects."""
    import importlib
    import warnings

    from aimsym.moved import MOVED

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for old, new in MOVED.items():
            assert importlib.import_module(old) is importlib.import_module(new), old
        from aimsym import se as old_se
        from aimsym.codegen import REPO_ROOT  # noqa: F401
    from aimsym.smi import se
    assert old_se is se

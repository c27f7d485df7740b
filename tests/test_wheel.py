"""The wheel works outside the checkout: build it, install it into a fresh venv, run the README's
main job from a temporary folder with a bundled model name, and check that nothing was written
into site-packages (numba cache and generated-module copies go to the user cache)."""

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_installs_and_runs_from_anywhere(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(wheels)],
                   check=True, capture_output=True)
    (wheel,) = wheels.glob("aimsym-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # the dependencies come from this interpreter's site-packages (a path entry, after the venv's
    # own site-packages, so the wheel's aimsym wins over any editable checkout)
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (site / "_aimsym_test_deps.pth").write_text("\n".join(deps) + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True, capture_output=True)
    before = sorted(str(p) for p in (site / "aimsym").rglob("*"))
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {**os.environ, "AIMSYM_CACHE": str(tmp_path / "cache"), "PYTHONDONTWRITEBYTECODE": "1"}
    for var in ("NUMBA_CACHE_DIR", "PYTHONPATH"):
        env.pop(var, None)
    r = subprocess.run([str(py), "-m", "aimsym.cli", "se", "attention_L2_T2", "--set", "skip=1", "--alpha", "0.5",
                        "--samples", "256", "--json"], cwd=work, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert 0 <= out["Q"][0][0] <= 1
    loc = subprocess.run([str(py), "-c", "import aimsym; print(aimsym.__file__)"], cwd=work, env=env,
                         capture_output=True, text=True).stdout.strip()
    assert loc.startswith(str(site)), loc
    after = sorted(str(p) for p in (site / "aimsym").rglob("*"))
    assert after == before, set(after) ^ set(before)
    assert list((tmp_path / "cache" / "kernels").glob("attention_L2_T2_*.py"))

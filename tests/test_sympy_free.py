"""Solving needs no SymPy: load a bundled model by name, denoise, run SE and GAMP (tiny) in a fresh
process and check that SymPy was never imported (everything comes from the generated module)."""

import subprocess
import sys

SCRIPT = """
import sys, warnings
import numpy as np
import aimsym
from aimsym.smi.amp import run_amp
from aimsym.smi.se import state_evolution

warnings.simplefilter("ignore")
m = aimsym.load("attention_L2_T2", skip=1.0)
Z, y = m.sample(8, np.random.default_rng(0))
out = m.denoiser()(y, 0.5 * Z, 0.75 * np.eye(2))
assert np.all(np.isfinite(out.g_out))
assert np.all(np.isfinite(m.observation(Z)))
state_evolution(m, alpha=0.5, samples=64, replicas=2, seed=0, max_iter=3)
run_amp(m, d=40, alpha=1.2, seeds=1, seed=0, max_iter=2)
print(sorted(k for k in sys.modules if k == "sympy" or k.startswith("sympy."))[:5])
"""


def test_load_denoise_se_amp_without_sympy():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout


def test_observation_equals_the_symbolic_map():
    """The generated numpy observation map is the one SymPy prints (bit for bit)."""
    import numpy as np

    import aimsym
    from aimsym.derive.symbolic import numeric_function

    for name, values in (("attention_L2_T2", {"skip": 1.0}), ("attention_L3_T2", {"skip": 0.7})):
        m = aimsym.load(name, **values)
        red = m.derivation.reduction
        Z = np.random.default_rng(1).standard_normal((50, m.p, m.tokens)) * 3
        f = numeric_function(m.derivation, red.obs_from_Z, (len(red.obs_from_Z),))
        assert np.array_equal(m.observation(Z), f(Z, m.params_array()))
        assert [lb.text() for lb in m.labels] == m.derivation.summary()["index_labels"]
        assert m.symmetries == m.derivation.symmetries
        assert m.counting == m.derivation.counting

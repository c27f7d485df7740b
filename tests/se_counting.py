"""SE runs that count their work: two layers at skip 1 with some of aimsym.smi.se's settings
patched, counting the maps and the in-iteration Newton attempts (the tests of the iteration's
shortcuts compare the same run with and without one)."""

import warnings

import pytest

import aimsym
import aimsym.smi.se as se
from aimsym.derive.files import derivations_dir


def counted_se(alpha: float, samples: int, **settings):
    """(SE result, {"maps": n, "jumps": n}) at alpha, with ``settings`` (names of module
    constants of aimsym.smi.se) patched for the run."""
    calls = {"maps": 0, "jumps": 0}
    orig_map, orig_jump = se.se_map, se._newton_jump

    def counted(*a, **k):
        calls["maps"] += 1
        return orig_map(*a, **k)

    def jump(*a, **k):
        calls["jumps"] += 1
        return orig_jump(*a, **k)

    m = aimsym.load(derivations_dir() / "attention_L2_T2.toml", c=1.0)
    ch = se.make_channel(m, samples=samples, replicas=8, seed=0)
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        for name, value in settings.items():
            mp.setattr(se, name, value)
        mp.setattr(se, "se_map", counted)
        mp.setattr(se, "_newton_jump", jump)
        warnings.simplefilter("ignore")
        r = se.state_evolution(m, alpha, channel=ch, errors=False, tol=1e-3)
    return r, calls

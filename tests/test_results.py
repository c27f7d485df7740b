"""The typed result objects: JSON keys in field order, optional keys left out while None, the
dict-style reads old callers use, and the JSON shapes the command line printed as dicts."""

import json
from dataclasses import dataclass

import numpy as np

from aimsym.cli.common import dumps
from aimsym.results import Result
from aimsym.smi.perfect import AlgorithmicThreshold, LocalStability, PerfectRecovery


@dataclass
class Point(Result):
    b: float
    a: np.ndarray
    note: str | None = None
    OPTIONAL = ("note",)


def test_fields_in_order_optional_left_out_and_dict_reads():
    p = Point(b=2.0, a=np.arange(2))
    assert list(p.to_json()) == ["b", "a"]
    assert json.loads(dumps(p)) == {"b": 2.0, "a": [0, 1]}
    assert p["b"] == 2.0 and "note" not in p and p.get("note", "x") == "x"
    p.note = "n"
    assert list(p.keys()) == ["b", "a", "note"] and dict(p.items())["note"] == "n"


def test_nested_results_dump_through_the_emitter():
    outer = Point(b=1.0, a=np.zeros(1), note=None)
    assert json.loads(dumps({"x": outer, "y": [outer]})) == {"x": {"b": 1.0, "a": [0.0]}, "y": [{"b": 1.0, "a": [0.0]}]}


def test_perfect_recovery_json_keeps_the_old_shapes():
    noisy = PerfectRecovery(counting_alpha=None, m=None, note="noisy link: no perfect recovery")
    assert list(noisy.to_json()) == ["counting_alpha", "m", "note", "alpha", "stderr", "kind", "local_alpha"]
    assert noisy.alpha is None and noisy["local_alpha"] is None
    alg = AlgorithmicThreshold(alpha=0.5, kind="jump", bracket=[0.49, 0.51], error_below=0.1, runs=3)
    assert "unconverged_runs" not in alg
    loc = LocalStability(local_alpha=0.5, local_alpha_stderr=0.01, Pi=[[1.0]], Pi_stderr=[[0.0]], trace_Pi=1.0,
                         trace_Pi_stderr=0.0, shape=[[1.0]], shape_iterations=1, shape_converged=True,
                         shape_at_floor=False, scale=1e-5)
    pr = PerfectRecovery(counting_alpha=0.5, m=2, note="", local=loc, algorithmic=alg, stderr=0.01,
                         group_alphas=[0.5], accuracy={}, seconds=1.0)
    keys = list(pr.to_json())
    assert keys[:4] == ["counting_alpha", "m", "note", "local_alpha"] and keys[-2:] == ["accuracy", "seconds"]
    assert keys[keys.index("scale") + 1:-2] == ["local_alpha_nishimori", "local_alpha_nishimori_stderr",
                                                "trace_Pi_nishimori", "trace_Pi_nishimori_stderr",
                                                "alpha", "stderr", "kind", "bracket", "error_below", "group_alphas",
                                                "se_runs", "unconverged_runs"]
    assert pr.alpha == 0.5 and pr["unconverged_runs"] == 0

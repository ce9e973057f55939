"""core/rungs.py: the ladder protocol. A Ladder lists its rungs in order, finds one by
name, leaves out the GPU-only ones under the simulator (keeping them in ``declared``),
runs a rung and collects its result for the comparison with the reference."""
import numpy as np
import pytest

from numba_sc.core.device import simulating
from numba_sc.core.rungs import Ladder, Rung


def toy_ladder(**kw):
    rungs = (Rung("v1", lambda w: w["x"] + 1, "plain"),
             Rung("v2", lambda w: w["x"] + 1, "+ faster"),
             Rung("v3", lambda w: w["x"] + 1, "+ tensor cores", gpu_only=True))
    return Ladder("toy", rungs, workload=lambda ctx: {"x": np.arange(4)}, reference=lambda w: w["x"] + 1, **kw)


def test_names_adds_and_operation():
    lad = toy_ladder()
    here = ("v1", "v2") if simulating() else ("v1", "v2", "v3")
    assert lad.names == here
    assert [r.name for r in lad.declared] == ["v1", "v2", "v3"]
    assert lad.adds["v2"] == "+ faster"
    assert lad.operation == "toy" and toy_ladder(operation="batch_norm").operation == "batch_norm"


def test_run_and_result_match_the_reference():
    lad = toy_ladder()
    w = lad.workload(None)
    for name in lad.names:
        np.testing.assert_array_equal(lad.result(name, w), lad.reference(w))


def test_collect_turns_a_result_into_the_compared_array():
    lad = toy_ladder(collect=lambda res: np.asarray(res) * 0)
    assert not np.array_equal(lad.result("v1", lad.workload(None)), lad.reference(lad.workload(None)))


def test_unknown_and_gpu_only_rungs_are_refused_by_name():
    lad = toy_ladder()
    with pytest.raises(ValueError, match="rung must be one of"):
        lad.rung("v9")
    if simulating():
        with pytest.raises(RuntimeError, match="runs on a GPU only"):
            lad.rung("v3")

"""choose_dataflow's measured choice, remembered for ``dataflow="auto"`` (numba_sc.conv.tuning).

Kernels run under the simulator on small clouds and are compared with the gmas
reference (itself checked against a float64 oracle in conv/test_layer.py).
"""
import numpy as np
import pytest

import numba_sc as ns
from numba_sc.conv import choice as ch
from numba_sc.conv import tuning

from flows import layer_weight, small_tensor, spy_dataflows


@pytest.fixture(autouse=True)
def _fresh_choices():
    ns.clear_caches()
    yield
    ns.clear_caches()


def test_measured_choice_is_cached_and_used(rng, monkeypatch):
    x = small_tensor(rng, 120, 4)
    w = layer_weight(rng, 27, 4, 4, np.float32)
    monkeypatch.setattr(tuning, "measure", lambda cands, timer, rounds: {"gmas": 3.0, "fetch": 1.0, "implicit": 2.0})
    choice = ns.choose_dataflow(x, w, backend="cuda", timer=lambda fn: 0.0)
    assert (choice.value, choice.source) == ("fetch", "measured")
    ran = spy_dataflows(monkeypatch)
    ns.sparse_conv3d(x, w, backend="cuda")
    assert ran == ["fetch"]
    ns.sparse_conv3d(x, w.astype(np.float64).astype(np.float32)[:, :, :3], backend="cuda")  # another shape
    assert ran == ["fetch"]  # ... follows the rule


def test_named_layer_choice(rng, monkeypatch):
    x = small_tensor(rng, 100, 4)
    w = layer_weight(rng, 27, 4, 4, np.float32)
    monkeypatch.setattr(tuning, "measure", lambda cands, timer, rounds: {"gmas": 3.0, "fetch": 2.0, "implicit": 1.0})
    ns.choose_dataflow(x, w, backend="cuda", timer=lambda fn: 0.0, layer="enc1")
    assert ch.cached_dataflow(("layer", "enc1")).value == "implicit"
    assert ch.cached_dataflow(ch.dataflow_key(None, 4, 4, 27, np.float32, False, len(x))) is None

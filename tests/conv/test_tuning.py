"""choose_dataflow's measured choice, remembered for ``dataflow="auto"`` (numba_sc.conv.tuning).

Kernels run under the simulator on small clouds and are compared with the gmas
reference (itself checked against a float64 oracle in conv/test_layer.py).
"""
import numpy as np
import pytest

import numba_sc as ns
from numba_sc.conv import choice as ch
from numba_sc.conv import layer, tuning

from helpers import random_coords

FLOWS = ("gmas", "fetch", "implicit")


@pytest.fixture(autouse=True)
def _fresh_choices():
    ns.clear_caches()
    yield
    ns.clear_caches()


def _tensor(rng, n, c, dtype=np.float32, span=5):
    coords = np.unique(random_coords(rng, n, span=span), axis=0)
    return ns.SparseTensor(coords, rng.standard_normal((len(coords), c)).astype(dtype))


def _weight(rng, k, cin, cout, dtype):
    return (rng.standard_normal((k, cin, cout)) / 3).astype(dtype)


def _close(got, want, dtype):
    scale = max(float(np.abs(want.astype(np.float32)).max()), 1.0)
    tol = 2e-5 if np.dtype(dtype) == np.float32 else 4e-3
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=tol * scale, rtol=0)


def _layers(x, ws, backend, flow):
    """A submanifold 3x3x3, a strided 2x2x2, the transposed layer that inverts it, a 1x1x1."""
    w3, w2, wt, w1 = ws
    sub = ns.sparse_conv3d(x, w3, backend=backend, dataflow=flow)
    down = ns.sparse_conv3d(x, w2, kernel_size=2, stride=2, backend=backend, dataflow=flow)
    up = ns.sparse_conv3d(down, wt, transposed=True, kernel_map=down.kernel_map, backend=backend, dataflow=flow)
    one = ns.sparse_conv3d(x, w1, kernel_size=1, backend=backend, dataflow=flow)
    return sub, down, up, one


def _spy(monkeypatch):
    """The dataflows other than gmas that run, in order (gmas runs when none does)."""
    ran = []
    real = layer.fetch_or_implicit
    monkeypatch.setattr(layer, "fetch_or_implicit", lambda flow, *a: ran.append(flow) or real(flow, *a))
    return ran


def test_measured_choice_is_cached_and_used(rng, monkeypatch):
    x = _tensor(rng, 120, 4)
    w = _weight(rng, 27, 4, 4, np.float32)
    monkeypatch.setattr(tuning, "measure", lambda cands, timer, rounds: {"gmas": 3.0, "fetch": 1.0, "implicit": 2.0})
    choice = ns.choose_dataflow(x, w, backend="cuda", timer=lambda fn: 0.0)
    assert (choice.value, choice.source) == ("fetch", "measured")
    ran = _spy(monkeypatch)
    ns.sparse_conv3d(x, w, backend="cuda")
    assert ran == ["fetch"]
    ns.sparse_conv3d(x, w.astype(np.float64).astype(np.float32)[:, :, :3], backend="cuda")  # another shape
    assert ran == ["fetch"]  # ... follows the rule


def test_named_layer_choice(rng, monkeypatch):
    x = _tensor(rng, 100, 4)
    w = _weight(rng, 27, 4, 4, np.float32)
    monkeypatch.setattr(tuning, "measure", lambda cands, timer, rounds: {"gmas": 3.0, "fetch": 2.0, "implicit": 1.0})
    ns.choose_dataflow(x, w, backend="cuda", timer=lambda fn: 0.0, layer="enc1")
    assert ch.cached_dataflow(("layer", "enc1")).value == "implicit"
    assert ch.cached_dataflow(ch.dataflow_key(None, 4, 4, 27, np.float32, False, len(x))) is None

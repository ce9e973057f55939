"""The per-layer choice of dataflow (``"auto"``): the rule of thumb, and what it runs.

Kernels run under the simulator on small clouds and are compared with the gmas
reference (itself checked against a float64 oracle in conv/test_layer.py).
"""
import numpy as np
import pytest

import numba_sc as ns
from numba_sc.conv import choice as ch
from numba_sc.conv import layer

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


def test_auto_without_measurements_follows_the_rule(rng, monkeypatch):
    x = _tensor(rng, 120, 4)
    w = _weight(rng, 27, 4, 4, np.float32)
    ran = _spy(monkeypatch)
    assert ch.rule_dataflow(4, 4, np.float32, len(x)) == "gmas"
    ns.sparse_conv3d(x, w, backend="cuda")  # dataflow="auto" is the default
    assert ran == []  # gmas: no other dataflow ran
    if ns.simulating():  # no GPU, no timer: the rule, not cached (on a GPU it measures)
        choice = ns.choose_dataflow(x, w, backend="cuda")
        assert choice.source == "rule" and choice.value == "gmas"


def test_rule_runs_implicit_on_a_given_map_with_few_channels(rng, monkeypatch):
    x = _tensor(rng, 120, 4)
    w = _weight(rng, 27, 4, 16, np.float32)
    ran = _spy(monkeypatch)
    y = ns.sparse_conv3d(x, w, backend="cuda")  # builds its map: gmas
    assert ran == []
    got = ns.sparse_conv3d(x, w, kernel_map=y.kernel_map, backend="cuda")  # given the map: implicit
    assert ran == ["implicit"]
    _close(got.features, y.features, np.float32)
    ns.sparse_conv3d(y, _weight(rng, 27, 16, 32, np.float32), kernel_map=y.kernel_map, backend="cuda")
    assert ran == ["implicit"]  # 32 output channels: gmas
    assert [ch.rule_dataflow(a, b, np.float32, 1000, True) for a, b in ((16, 16), (17, 16), (4, 32))] == \
        ["implicit", "gmas", "gmas"]


def test_rule_by_cloud_density_and_size():
    """The measured table's boundaries: a large sparse cloud runs gmas even when given its
    map; a large dense one runs implicit up to 16 channels, and up to 64 in fp32, or in
    fp16 where the implicit GEMM has its tensor-core rung (v4: a GPU, not the simulator)."""
    from numba_sc.dataflows.implicit_driver import library_rung

    big, dense, sparse = 600_000, 16.0, 0.4
    assert ch.rule_dataflow(4, 16, np.float32, big, True, sparse) == "gmas"
    assert ch.rule_dataflow(4, 16, np.float16, big, False, dense) == "implicit"
    fp16_mid = "implicit" if library_rung(np.float16, 32, 32) == "v4" else "gmas"
    assert ch.rule_dataflow(32, 32, np.float16, big, False, dense) == fp16_mid
    assert ch.rule_dataflow(64, 64, np.float16, big, False, dense) == fp16_mid
    assert ch.rule_dataflow(128, 128, np.float16, big, False, dense) == "gmas"
    assert ch.rule_dataflow(64, 64, np.float32, big, False, dense) == "implicit"
    assert ch.rule_dataflow(128, 128, np.float32, big, False, dense) == "gmas"
    assert ch.rule_dataflow(4, 16, np.float32, 50_000, False, dense) == "gmas"  # small: the plan's sort costs


def test_training_runs_gmas(rng):
    x = _tensor(rng, 100, 4)
    w = _weight(rng, 27, 4, 4, np.float32)
    with pytest.raises(ValueError, match="no backward pass"):
        layer.convolve(x, w, backend="cuda", keep_buffer=[], dataflow="fetch")
    assert ch.pick_dataflow("auto", None, x.features, w, None, False, True, False, -1) == "gmas"


def test_bad_dataflow(rng):
    x = _tensor(rng, 50, 4)
    with pytest.raises(ValueError, match="dataflow must be one of"):
        ns.sparse_conv3d(x, _weight(rng, 27, 4, 4, np.float32), backend="reference", dataflow="winograd")

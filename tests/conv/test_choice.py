"""The per-layer choice of dataflow (``"auto"``): the rule of thumb, and what it runs.

Kernels run under the simulator on small clouds and are compared with the gmas
reference (itself checked against a float64 oracle in conv/test_layer.py).
"""
import numpy as np
import pytest

import numba_sc as ns
from numba_sc.conv import choice as ch
from numba_sc.conv import layer

from flows import assert_flow_close, layer_weight, small_tensor, spy_dataflows


@pytest.fixture(autouse=True)
def _fresh_choices():
    ns.clear_caches()
    yield
    ns.clear_caches()


def test_auto_without_measurements_follows_the_rule(rng, monkeypatch):
    x = small_tensor(rng, 120, 4)
    w = layer_weight(rng, 27, 4, 4, np.float32)
    ran = spy_dataflows(monkeypatch)
    assert ch.rule_dataflow(4, 4, np.float32, len(x)) == "gmas"
    ns.sparse_conv3d(x, w, backend="cuda")  # dataflow="auto" is the default
    assert ran == []  # gmas: no other dataflow ran
    if ns.simulating():  # no GPU, no timer: the rule, not cached (on a GPU it measures)
        choice = ns.choose_dataflow(x, w, backend="cuda")
        assert choice.source == "rule" and choice.value == "gmas"


def test_rule_runs_implicit_on_a_given_map_with_few_channels(rng, monkeypatch):
    x = small_tensor(rng, 120, 4)
    w = layer_weight(rng, 27, 4, 16, np.float32)
    ran = spy_dataflows(monkeypatch)
    y = ns.sparse_conv3d(x, w, backend="cuda")  # builds its map: gmas
    assert ran == []
    got = ns.sparse_conv3d(x, w, kernel_map=y.kernel_map, backend="cuda")  # given the map: implicit
    assert ran == ["implicit"]
    assert_flow_close(got.features, y.features, np.float32)
    ns.sparse_conv3d(y, layer_weight(rng, 27, 16, 32, np.float32), kernel_map=y.kernel_map, backend="cuda")
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
    x = small_tensor(rng, 100, 4)
    w = layer_weight(rng, 27, 4, 4, np.float32)
    with pytest.raises(ValueError, match="no backward pass"):
        layer.convolve(x, w, backend="cuda", keep_buffer=[], dataflow="fetch")
    assert ch.pick_dataflow("auto", None, x.features, w, None, False, True, False, -1) == "gmas"


def test_bad_dataflow(rng):
    x = small_tensor(rng, 50, 4)
    with pytest.raises(ValueError, match="dataflow must be one of"):
        ns.sparse_conv3d(x, layer_weight(rng, 27, 4, 4, np.float32), backend="reference", dataflow="winograd")

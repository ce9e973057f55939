"""The three dataflows through sparse_conv3d (numba_sc.conv.dataflow), each on every kind of layer.

Kernels run under the simulator on small clouds and are compared with the gmas
reference (itself checked against a float64 oracle in conv/test_layer.py).
"""
import numpy as np
import pytest

import numba_sc as ns
from numba_sc.conv.dataflow import gather_gemm_scatter, weight_order_table
from numba_sc.conv.prepare import prepare_layer

from flows import FLOWS, assert_flow_close, four_layers, layer_weight, small_tensor


@pytest.fixture(autouse=True)
def _fresh_choices():
    ns.clear_caches()
    yield
    ns.clear_caches()


def four_layers(x, ws, backend, flow):
    """A submanifold 3x3x3, a strided 2x2x2, the transposed layer that inverts it, a 1x1x1."""
    w3, w2, wt, w1 = ws
    sub = ns.sparse_conv3d(x, w3, backend=backend, dataflow=flow)
    down = ns.sparse_conv3d(x, w2, kernel_size=2, stride=2, backend=backend, dataflow=flow)
    up = ns.sparse_conv3d(down, wt, transposed=True, kernel_map=down.kernel_map, backend=backend, dataflow=flow)
    one = ns.sparse_conv3d(x, w1, kernel_size=1, backend=backend, dataflow=flow)
    return sub, down, up, one


@pytest.mark.parametrize("flow", FLOWS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_every_layer_kind_through_every_dataflow(rng, flow, dtype):
    x = small_tensor(rng, 180, 5, dtype)
    ws = (layer_weight(rng, 27, 5, 6, dtype), layer_weight(rng, 8, 5, 6, dtype), layer_weight(rng, 8, 6, 3, dtype),
          layer_weight(rng, 1, 5, 4, dtype))
    want = four_layers(x, ws, "reference", "gmas")
    for backend in ("reference", "cuda"):
        got = four_layers(x, ws, backend, flow)
        for g, r in zip(got, want):
            assert np.array_equal(g.coords, r.coords)
            assert_flow_close(g.features, r.features, dtype)


def test_comparison_catches_an_off_by_one(rng):
    """The tolerance above is sharp enough: one weight offset shifted by one changes the answer."""
    x = small_tensor(rng, 150, 4)
    w = layer_weight(rng, 27, 4, 5, np.float32)
    want = ns.sparse_conv3d(x, w, backend="reference", dataflow="gmas").features
    for flow in ("fetch", "implicit"):
        got = ns.sparse_conv3d(x, np.roll(w, 1, axis=0), backend="cuda", dataflow=flow).features
        with pytest.raises(AssertionError):
            assert_flow_close(got, want, np.float32)


def test_layers_sharing_a_map_share_each_dataflows_plan(rng):
    x = small_tensor(rng, 150, 4)
    w = layer_weight(rng, 27, 4, 4, np.float32)
    y = ns.sparse_conv3d(x, w, backend="cuda", dataflow="fetch")
    km = y.kernel_map
    for flow in ("fetch", "implicit"):
        ns.sparse_conv3d(y, w, kernel_map=km, backend="cuda", dataflow=flow)
        plan = next(v for k, v in km.kept_plans.items() if k[0] == flow)
        ns.sparse_conv3d(y, w, kernel_map=km, backend="cuda", dataflow=flow)
        assert next(v for k, v in km.kept_plans.items() if k[0] == flow) is plan  # built once


def test_gather_gemm_scatter_on_a_prepared_layer(rng):
    """The GMaS dataflow alone, on the arrays and plan prepare_layer makes, against the
    reference layer; a weight shifted by one offset is caught."""
    x = small_tensor(rng, 150, 4)
    w = layer_weight(rng, 27, 4, 5, np.float32)
    want = ns.sparse_conv3d(x, w, backend="reference", dataflow="gmas").features
    f, wd, km, plan = prepare_layer(x, w, 3, 1, 1, False, None, "cuda")
    got = ns.core.backend.to_host(gather_gemm_scatter(f, wd, plan, (1, 1), "cuda"))
    assert_flow_close(got, want, np.float32)
    bad = ns.core.backend.to_host(gather_gemm_scatter(f, np.roll(wd, 1, axis=0), plan, (1, 1), "cuda"))
    with pytest.raises(AssertionError):
        assert_flow_close(bad, want, np.float32)


def test_weight_order_table_of_a_transposed_layer(rng):
    """A transposed layer's table pairs its output j with input i through W[k] exactly when
    the strided map's table[k, i] = j."""
    x = small_tensor(rng, 150, 4)
    down = ns.sparse_conv3d(x, layer_weight(rng, 8, 4, 4, np.float32), kernel_size=2, stride=2, backend="reference")
    km = down.kernel_map
    once, _ = weight_order_table(km, True, keep=False)  # (the ranges of a layer past the workspace)
    assert "transposed table" not in km.kept_plans
    table, _ = weight_order_table(km, True)
    assert np.array_equal(np.asarray(once), np.asarray(table))
    fwd = np.asarray(km.table)
    t = np.asarray(table)
    for k in range(fwd.shape[0]):
        for i in np.nonzero(fwd[k] >= 0)[0]:
            assert t[k, fwd[k, i]] == i
    assert weight_order_table(km, True)[0] is table  # made once, kept on the map

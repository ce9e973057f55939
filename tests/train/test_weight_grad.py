"""The weight gradient's memory: what it zeroes, what it overwrites, what it reuses.

:func:`numba_sc.conv.gradient.weight_grad_cuda` allocates its products and the
gradient without a memset, reads the forward's input buffer and the input gradient's
gathered buffer instead of gathering again, and relies on both buffers' padding rows
being zero. Under the simulator a fresh NumPy array is often all zeros, which would hide
a value never written; so here the device allocations of the weight gradient and of the
gather hand out NaNs (or huge numbers), as a GPU's memory pool may, and the gather
allocates as on a GPU (zeroed only where asked). The layer kernels' agreement with the
reference, on every kind of layer, is in tests/conv/test_gradient.py.
"""
import numpy as np
import pytest

import numba_sc as ns
from numba_sc.core.backend import to_device, to_host
from numba_sc.core.device import device_xp
from numba_sc.conv import dataflow as conv_module
from numba_sc.gmas import gather as gather_module
from numba_sc.conv import gradient as cg


class _PoolMemory:
    """The device's array module (NumPy under the simulator, CuPy on a GPU), except that
    ``empty`` returns memory whose every byte is ``fill``, as a GPU pool hands back what
    was there: 0xFF makes every fp32 or fp16 value NaN (a -1 index array left in the pool
    reads so), 0x7F every fp32 value about 3.4e38. Any value read before it is written
    shows."""

    def __init__(self, fill):
        self.fill, self.xp = fill, device_xp()
        self.handed = 0  # arrays handed out: the patch is shown to be in the path

    def __getattr__(self, name):
        return getattr(self.xp, name)

    def empty(self, shape, dtype=float):
        self.handed += 1
        dt = np.dtype(dtype)
        return self.xp.full(int(np.prod(shape)) * dt.itemsize, self.fill, np.uint8).view(dt).reshape(shape)


def _pool_memory(monkeypatch, fill=0xFF):
    mem = _PoolMemory(fill)
    monkeypatch.setattr(cg, "device_xp", lambda: mem)
    monkeypatch.setattr(gather_module, "device_xp", lambda: mem)
    # The gather zeroes every buffer under the simulator; as on a GPU, only where asked.
    monkeypatch.setattr(gather_module, "simulating", lambda: False)
    return mem


def _plane(side=6):
    """A flat patch (z = 0) with a few holes: a 3x3x3 layer finds no pair through the
    18 offsets that leave the plane, and pads the 8 in the plane (their pair counts
    differ) into one group."""
    x, y = np.meshgrid(np.arange(side), np.arange(side), indexing="ij")
    c = np.stack([x.ravel(), y.ravel(), np.zeros(side * side, int)], 1).astype(np.int32)
    return c[np.arange(len(c)) % 7 != 3]


@pytest.fixture(scope="module")
def layer():
    """A 3x3x3 submanifold layer on the plane, as during a Tape: x, w, its map and
    plan, a gradient g, and the input buffer its forward kept (padding rows zeroed)."""
    rng = np.random.default_rng(0)
    coords = _plane()
    x = ns.SparseTensor(coords, rng.standard_normal((len(coords), 3)).astype(np.float32))
    w = rng.standard_normal((27, 3, 5)).astype(np.float32)
    km = ns.sparse_conv3d(x, w, 3, backend="reference").kernel_map
    g = rng.standard_normal((len(coords), 5)).astype(np.float32)
    _, want = cg.sparse_conv3d_backward(x, w, g, km, backend="reference")
    x, w, g = x.to(device="cuda"), to_device(w), to_device(g)  # (NumPy still, under the simulator)
    plan = cg._forward_plan(km, w, False, "cuda")
    kept = []
    with pytest.MonkeyPatch.context() as mp:  # the forward's buffer zeroes its padding rows itself
        _pool_memory(mp)
        conv_module.gather_gemm_scatter(x.features, w, plan, (1, 1), "cuda", keep_buffer=kept)
    return dict(x=x, w=w, km=km, plan=plan, g=g, kept=kept[0], want=want)


def _dw(layer, input_buffer="kept"):
    """The kernels' weight gradient of ``layer``, on the host."""
    ib = layer["kept"] if input_buffer == "kept" else input_buffer
    _, dw = cg.sparse_conv3d_backward(layer["x"], layer["w"], layer["g"], layer["km"], backend="cuda",
                                      input_buffer=ib)
    return to_host(dw)


def _close(dw, want):
    return np.abs(dw - want).max() < 2e-5 * max(1.0, np.abs(want).max())


def test_offsets_without_pairs_get_exact_zeros_from_garbage_memory(monkeypatch, layer):
    mem = _pool_memory(monkeypatch)
    dw = _dw(layer)
    empty = np.flatnonzero(layer["plan"].counts == 0)
    assert len(empty) == 18 and mem.handed > 0  # offsets to catch, and garbage handed out
    assert np.all(dw[empty].view(np.uint32) == 0)  # +0.0 exactly, not garbage or NaN
    assert _close(dw, layer["want"])


def test_padded_group_from_garbage_memory_equals_the_reference_bit_for_bit_twice(monkeypatch, layer):
    """The layer pads its group; runs on memory of NaNs and of huge numbers agree bit for
    bit, so nothing unwritten (a padding row, a product slot) was read."""
    plan = layer["plan"]
    padding = sum(grp.padded_rows for grp in plan.groups) - int(plan.counts[plan.order].sum())
    assert padding > 0 and plan.centre >= 0
    _pool_memory(monkeypatch)
    dw = _dw(layer)
    assert np.isfinite(dw).all() and _close(dw, layer["want"])
    _pool_memory(monkeypatch, 0x7F)
    np.testing.assert_array_equal(_dw(layer).view(np.uint32), dw.view(np.uint32))


def test_an_unzeroed_padding_row_would_show(layer):
    """Why the gather of G zeroes its padding although the input buffer's is zero: with
    the gradient buffer's padding rows NaN, exactly the padded offsets come out NaN
    (so the tests above can see a missing zero)."""
    plan = layer["plan"]
    gbuf = gather_module.gather_cuda(to_device(layer["g"]), plan.out_lists, plan.rows, 1, zero_padding=True)
    gbuf[to_device(np.asarray(plan.row_offset) < 0)] = np.nan
    dw = to_host(cg.weight_grad_cuda(layer["x"].features, layer["g"], plan, 27, layer["kept"], gbuf))
    padded = {k for grp in plan.groups for k in grp.members if plan.counts[k] < grp.rows}
    assert padded and {k for k in range(27) if np.isnan(dw[k]).any()} == padded


def test_the_weight_gradient_gathers_g_once_with_the_input_gradient(monkeypatch, layer):
    """The input gradient's gather of G is the weight gradient's: one gather of G per
    backward, and none of the inputs when the forward's buffer is given."""
    seen = []

    def counting(name, real):
        def gather(features, lists, rows, tile, zero_padding=False, window=None):
            seen.append((name, zero_padding))
            return real(features, lists, rows, tile, zero_padding, window)
        return gather

    monkeypatch.setattr(conv_module, "gather_cuda", counting("input gradient", conv_module.gather_cuda))
    monkeypatch.setattr(cg, "gather_cuda", counting("weight gradient", cg.gather_cuda))
    assert _close(_dw(layer), layer["want"])
    assert seen == [("input gradient", True)]  # kept for the weight gradient, so zero-padded
    seen.clear()
    assert _close(_dw(layer, None), layer["want"])
    assert seen == [("input gradient", True), ("weight gradient", True)]  # the inputs, gathered here


@pytest.mark.parametrize("dtype,c_in,c_out", [(np.float32, 3, 5), (np.float32, 2, 4), (np.float16, 3, 5),
                                              (np.float16, 2, 2)])
def test_place_products_puts_every_slot_and_zeroes_the_rest(monkeypatch, dtype, c_in, c_out):
    """The placing kernel on every word size it picks (4-, 8-, 2- and 8-byte words here):
    ``dw[k] = products[slots[k]]`` bit for bit, zero bits where ``slots[k] = -1``, every
    value of ``dw`` written although it is allocated with garbage."""
    _pool_memory(monkeypatch)
    rng = np.random.default_rng(7)
    products = rng.standard_normal((4, c_in, c_out)).astype(dtype)
    slots = np.array([2, -1, 0, 3, -1, 1], np.int64)
    dw = to_host(cg.place_products_cuda(to_device(products), to_device(slots), len(slots)))
    bits = np.uint16 if dtype == np.float16 else np.uint32
    want = np.where((slots >= 0)[:, None, None], products[np.maximum(slots, 0)], 0).astype(dtype)
    np.testing.assert_array_equal(dw.view(bits), want.view(bits))
    assert not np.array_equal(dw[0], products[0])  # a slot read from the wrong place shows

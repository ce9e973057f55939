"""The gather (stage 8): every tile size, fp32 and fp16, equals the reference.

The test also runs the scatter at every tile and the layer end to end on a few
tile pairs: the two kernels are checked side by side on one plan.
"""
import numpy as np
import pytest

from numba_sc import kernel_offsets, sparse_conv3d
from numba_sc.core.backend import to_host
from numba_sc.gmas.gather import divisors, gather_cuda, gather_reference
from numba_sc.map.map_step import build_kernel_map
from numba_sc.gmas.plan import build_plan
from numba_sc.gmas.scatter import scatter, scatter_cuda, scatter_reference

from helpers import assert_close, oracle, tensor, weights


@pytest.mark.parametrize("c_in,c_out", [(12, 6)])
def test_every_tile_size(rng, c_in, c_out):
    """Gather with every divisor of C_in and scatter with every divisor of C_out."""
    x = tensor(rng, 60, c_in, extent=5)
    km = build_kernel_map(x.coords, 3)
    plan = build_plan(km, backend="cuda")
    in_table, out_table = to_host(plan.in_table), to_host(plan.out_table)
    ref_buf = gather_reference(x.features, in_table, plan.rows)
    real = np.zeros(plan.rows, bool)
    real[in_table[in_table >= 0]] = True  # padding rows are never written
    for t in divisors(c_in):
        buf = to_host(gather_cuda(x.features, plan.in_table, plan.rows, t))
        np.testing.assert_array_equal(buf[real], ref_buf[real])
    # fp16: tiles of 2, 6 (4-byte words), 4, 12 (8-byte words) and 1, 3 (channels)
    half = x.features.astype(np.float16)
    half[0, 0] = np.nan  # stays a NaN (its payload may not: fp16 -> fp32 -> fp16 on the channel path)
    ref_half = gather_reference(half, in_table, plan.rows)
    for t in divisors(c_in):
        buf = to_host(gather_cuda(half, plan.in_lists, plan.rows, t))
        assert buf.dtype == np.float16
        np.testing.assert_array_equal(buf[real], ref_half[real])  # (NaN equals NaN here)
    obuf = rng.standard_normal((plan.rows, c_out)).astype(np.float32)
    want = scatter_reference(obuf, out_table)
    for t in divisors(c_out):
        got = to_host(scatter_cuda(obuf, plan.out_table, tile=t))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # The scatter reads words and unpacks them (numba_sc.core.words). With a centre
    # product to start from, fp32 and fp16, every tile of 12 channels: fp16 tiles
    # 4 and 12 are 8-byte words, 2 and 6 4-byte words, 1 and 3 channel by channel;
    # fp32 tiles 2, 4, 6, 12 are 8-byte words, 1 and 3 4-byte ones. Negative,
    # subnormal and infinite values check the bits of every lane: the kernel sums in
    # fp32 in offset order and rounds once, as the reference does, so the results
    # must be equal to the bit.
    for dt in (np.float16, np.float32):
        ob = (rng.standard_normal((plan.rows, 12)) * 100).astype(dt)
        ob[:, 5] = -ob[:, 5] * 1e-7  # fp16 subnormals (and tiny fp32 values)
        ob[plan.rows // 2, 7] = np.inf
        init = rng.standard_normal((len(x), 12)).astype(dt)
        want = scatter_reference(ob, out_table, init)
        for t in divisors(12):
            got = to_host(scatter(ob, out_table, init, tile=t, backend="cuda"))
            assert got.dtype == dt
            np.testing.assert_array_equal(got, want, err_msg=f"{np.dtype(dt).name} tile {t}")
    # and end to end, for a few pairs
    w = weights(rng, 27, c_in, c_out)
    want = oracle(x.coords, x.features, x.coords, w, kernel_offsets(3))
    for tiles in [(1, 1), (4, 3), (12, 6), 2, 3]:
        got = sparse_conv3d(x, w, backend="cuda", tile_size=tiles)
        assert_close(got.features, want)

"""dataflows/tensor_cores.py: the CUDA C++ mma linked into Numba kernels, the top rung of
the implicit GEMM's ladder. The result layout and the probe are checked everywhere: on a
GPU the probe runs the linked C++, under the simulator its Python stand-in
(emulated_warp_mma), whose refusals are checked here too."""
import numpy as np
import pytest
from numba import cuda

from numba_sc.core.backend import to_device, to_host
from numba_sc.core.device import simulating
from numba_sc.dataflows import tensor_cores as tc

SIM_ONLY = pytest.mark.skipif(not simulating(), reason="the simulator's stand-in for the linked C++")


def test_the_mma_result_layout():
    """The C fragment of m16n8k16: lane 5 holds D[1, 2:4] and D[9, 2:4] (the module's
    example); the 32 lanes' four results cover the 16x8 tile once; the device
    functions the epilogue uses (c_row, c_col) agree with the table."""
    table = tc.c_layout_reference()
    assert table[5].tolist() == [[1, 2], [1, 3], [9, 2], [9, 3]]
    cover = np.zeros((16, 8), int)
    np.add.at(cover, (table[..., 0].ravel(), table[..., 1].ravel()), 1)
    assert (cover == 1).all()

    @cuda.jit
    def where(out):
        lane = cuda.threadIdx.x
        for r in range(4):
            out[lane, r, 0] = tc.c_row(lane, r)
            out[lane, r, 1] = tc.c_col(lane, r)

    got_d = to_device(np.zeros((32, 4, 2), np.int32))
    where[1, 32](got_d)
    np.testing.assert_array_equal(to_host(got_d), table)


def test_a_wrong_layout_is_caught():
    """The comparison above can fail: a table with one lane's rows swapped differs."""
    table = tc.c_layout_reference().copy()
    table[5, [0, 2]] = table[5, [2, 0]]
    assert not np.array_equal(table, tc.c_layout_reference())


def test_warp_tiles_outside_mma_cu_are_refused():
    with pytest.raises(ValueError, match="warp tiles mma.cu defines"):
        tc.warp_mma(3, 3)
    assert tc.MMA_SOURCE.is_file()  # shipped beside the module (package data)


def test_mma_probe_equals_numpy(rng):
    """One warp, two mma (the linked C++ on a GPU, its stand-in under the simulator): a
    16x16 @ 16x16 fp16 product to fp32 rounding (the products of fp16 values are exact
    in fp32), each result where c_row/c_col put it; on small integers, exactly."""
    a = rng.standard_normal((16, 16)).astype(np.float16)
    b = rng.standard_normal((16, 16)).astype(np.float16)
    want = a.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(tc.mma_probe(a, b) - want).max() <= 1e-6 * np.abs(want).max()
    a, b = (rng.integers(-3, 4, (16, 16)).astype(np.float16) for _ in range(2))
    np.testing.assert_array_equal(tc.mma_probe(a, b), a.astype(np.float32) @ b.astype(np.float32))


def _call_stand_in(mi, ni, a_tile, b_tile, a_pitch, b_pitch, row0, col0, k_steps, threads=32):
    """One block calls the stand-in with these arguments; returns lane 0's accumulators."""
    mma = tc.emulated_warp_mma(mi, ni)

    @cuda.jit
    def call(a, b, out):
        acc = cuda.local.array(64, np.float32)
        for q in range(64):
            acc[q] = 0.0
        mma(tc.data_pointer(acc), tc.data_pointer(a), tc.data_pointer(b), a_pitch, b_pitch, row0, col0, k_steps)
        if cuda.threadIdx.x == 0:
            for q in range(64):
                out[q] = acc[q]

    out = np.zeros(64, np.float32)
    call[1, threads](a_tile, b_tile, out)
    return out


@SIM_ONLY
def test_the_stand_in_adds_each_lanes_share_and_refuses_what_a_gpu_would_get_wrong(rng):
    """Lane 0 of a 2 x 2 warp tile (32 rows, 16 columns) at row 16, column 8, over 32
    channels: its 16 results are rows 16, 24, 32, 40 by columns 8, 9, 16, 17, in the
    C layout's order. Then the refusals: unaligned rows, a tile past its shared array,
    tiles that are not fp16 bits, a block that is not whole warps."""
    pitch_a, pitch_b = 40, 40  # 32 channels + 8; 32 columns + 8
    a = rng.integers(-3, 4, (48, pitch_a)).astype(np.float16)
    b = rng.integers(-3, 4, (32, pitch_b)).astype(np.float16)
    got = _call_stand_in(2, 2, a.ravel(), b.ravel(), pitch_a, pitch_b, 16, 8, 2)
    product = a[:, :32].astype(np.float32) @ b[:, :].astype(np.float32)
    want = [product[16 + 16 * i + 8 * (r // 2), 8 + 8 * j + r % 2] for i in range(2) for j in range(2) for r in range(4)]
    np.testing.assert_array_equal(got[:16], want)
    assert not got[16:].any()
    # (the words v4 keeps its tiles in read as the same fp16 values)
    np.testing.assert_array_equal(_call_stand_in(2, 2, a.ravel().view(np.uint64), b.ravel().view(np.uint32),
                                                 pitch_a, pitch_b, 16, 8, 2), got)
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        _call_stand_in(2, 2, a.ravel(), b.ravel(), 36, pitch_b, 0, 0, 2)
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        _call_stand_in(2, 2, a.ravel(), b.ravel(), pitch_a, pitch_b, 0, 4, 2)
    with pytest.raises(ValueError, match="reaches past its shared tiles"):
        _call_stand_in(2, 2, a.ravel(), b.ravel(), pitch_a, pitch_b, 32, 0, 2)  # rows 32..63 of 48
    with pytest.raises(ValueError, match="reaches past its shared tiles"):
        _call_stand_in(2, 2, a.ravel(), b.ravel(), pitch_a, pitch_b, 0, 32, 2)  # columns 32..47 of 40
    with pytest.raises(ValueError, match="reaches past its shared tiles"):
        _call_stand_in(2, 2, a.ravel(), b.ravel(), pitch_a, pitch_b, 0, 0, 3)  # 48 channels of 40
    with pytest.raises(TypeError, match="a_tile must hold fp16 values"):
        _call_stand_in(2, 2, a.ravel().astype(np.float32), b.ravel(), pitch_a, pitch_b, 0, 0, 2)
    with pytest.raises(ValueError, match="whole warps"):
        _call_stand_in(2, 2, a.ravel(), b.ravel(), pitch_a, pitch_b, 0, 0, 2, threads=48)


def test_kernel_options_cap_registers_on_a_gpu_and_refuse_bad_caps():
    """``max_registers`` reaches cuda.jit on a GPU; the simulator has no registers, so
    there the options are empty; a cap outside 16..255 or not an int is refused
    everywhere, naming the argument."""
    assert tc.kernel_options() == {} and tc.kernel_options(None) == {}
    assert tc.kernel_options(128) == ({} if simulating() else {"max_registers": 128})
    assert tc.kernel_options(np.int64(96)) == ({} if simulating() else {"max_registers": 96})
    for bad in (8, 256, 0, -1, 1.5, True, "128"):
        with pytest.raises(ValueError, match="max_registers must be an int from 16 to 255"):
            tc.kernel_options(bad)


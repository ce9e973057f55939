"""dataflows/tensor_cores.py: the CUDA C++ mma linked into Numba kernels, the top rung of
the implicit GEMM's ladder. The result layout is checked everywhere (its device
functions run under the simulator); the linked C++ itself only on a GPU."""
import numpy as np
import pytest
from numba import cuda

from numba_sc.core.backend import to_device, to_host
from numba_sc.core.device import simulating
from numba_sc.dataflows import tensor_cores as tc

GPU_ONLY = pytest.mark.skipif(simulating(), reason="linked CUDA C++ runs on a GPU only")


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
    if simulating():
        with pytest.raises(RuntimeError, match="runs on a GPU only"):
            tc.warp_mma(1, 2)
    else:
        with pytest.raises(ValueError, match="warp tiles mma.cu defines"):
            tc.warp_mma(3, 3)
    assert tc.MMA_SOURCE.is_file()  # shipped beside the module (package data)


@pytest.mark.skipif(not simulating(), reason="the simulator's refusal")
def test_the_probe_refuses_the_simulator():
    with pytest.raises(RuntimeError, match="NUMBA_ENABLE_CUDASIM=0"):
        tc.mma_probe(np.zeros((16, 16), np.float16), np.zeros((16, 16), np.float16))


@GPU_ONLY
def test_mma_probe_equals_numpy(rng):
    """One warp, two mma of the linked C++: a 16x16 @ 16x16 fp16 product to fp32
    rounding (the products of fp16 values are exact in fp32)."""
    a = rng.standard_normal((16, 16)).astype(np.float16)
    b = rng.standard_normal((16, 16)).astype(np.float16)
    want = a.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(tc.mma_probe(a, b) - want).max() <= 1e-6 * np.abs(want).max()

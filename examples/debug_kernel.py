"""A kernel to practise debugging on: stops inside thread 0 of block 1 under the simulator.

    NUMBA_ENABLE_CUDASIM=1 python examples/debug_kernel.py

See docs/debugging.md for a session walk-through.
"""
import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402


@cuda.jit
def block_sum(x, out):
    """Each block of 8 threads loads 8 values into shared memory; thread 0 adds them up."""
    tile = cuda.shared.array(8, np.float32)
    i = cuda.grid(1)
    tile[cuda.threadIdx.x] = x[i]
    cuda.syncthreads()  # every thread of the block has written its slot
    if cuda.threadIdx.x == 0:
        if cuda.blockIdx.x == 1 and os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
            breakpoint()  # only one thread stops; the others wait at their next barrier
        s = 0.0
        for j in range(8):
            s += tile[j]
        out[cuda.blockIdx.x] = s


if __name__ == "__main__":
    x = np.arange(16, dtype=np.float32)
    out = np.zeros(2, np.float32)
    block_sum[2, 8](x, out)
    print("block sums:", out)

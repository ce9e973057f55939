"""Host cost of one Numba kernel launch, by how the arguments are passed.

Every stage is a few launches, so on small clouds the host time of a launch, not
the kernel, sets the wall time. This measures a trivial 3-array kernel launched

- with CuPy arrays (Numba reads ``__cuda_array_interface__`` each call),
- with ``cuda.as_cuda_array`` views made per call,
- with Numba device arrays made once,
- through ``numba_sc.core.launch.launch`` (what the package does: ``cuLaunchKernel``
  from prepared parameter slots), and the same with ``cuda.core.launch``.

Median host microseconds over 2000 launches (no synchronisation inside the loop).
Run on a GPU machine; never in CI.
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main():
    import cupy
    from numba import cuda

    from numba_sc.core import launch as launching
    from numba_sc.core.launch import launch

    @cuda.jit
    def axpy(x, y, out):
        i = cuda.grid(1)
        if i < out.shape[0]:
            out[i] = 2.0 * x[i] + y[i]

    def through_core():  # the fast path with cuda.core.launch instead of cuLaunchKernel
        launching._FAST.raw = False
        try:
            launch(axpy, n, x, y, out)
        finally:
            launching._FAST.raw = True

    n = 1 << 16
    x, y, out = (cupy.ones(n, cupy.float32) for _ in range(3))
    nx, ny, nout = (cuda.as_cuda_array(a) for a in (x, y, out))

    def per_launch(fn, reps=2000):
        for _ in range(50):
            fn()
        cupy.cuda.Device().synchronize()
        samples = []
        for _ in range(reps // 100):
            t0 = time.perf_counter()
            for _ in range(100):
                fn()
            samples.append((time.perf_counter() - t0) * 1e4)  # us per launch
        cupy.cuda.Device().synchronize()
        return statistics.median(samples)

    variants = {
        "cupy arrays": lambda: axpy[256, 256](x, y, out),
        "as_cuda_array per call": lambda: axpy[256, 256](cuda.as_cuda_array(x), cuda.as_cuda_array(y),
                                                         cuda.as_cuda_array(out)),
        "numba device arrays": lambda: axpy[256, 256](nx, ny, nout),
        "numba_sc.core.launch.launch": lambda: launch(axpy, n, x, y, out),
        "  ... via cuda.core.launch": through_core,
        "cupy elementwise (peer)": lambda: cupy.add(x, y, out=out),
    }
    print(f"{'how the arguments are passed':30s} {'host us / launch':>16s}")
    for name, fn in variants.items():
        print(f"{name:30s} {per_launch(fn):16.1f}")


if __name__ == "__main__":
    main()

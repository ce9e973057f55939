"""Host cost of one Numba kernel launch, by how the arguments are passed.

Every stage is a few launches, so on small clouds the host time of a launch, not
the kernel, sets the wall time. This measures a trivial 3-array kernel launched

- with CuPy arrays (Numba reads ``__cuda_array_interface__`` each call),
- with ``cuda.as_cuda_array`` views made per call,
- with Numba device arrays made once,
- through ``numba_sc.core.launch.launch`` (what the package does: ``cuLaunchKernel``
  from prepared parameter slots), and the same with ``cuda.core.launch``.

Median host microseconds per launch: 20 samples of 100 launches each, after 50
untimed launches (no synchronisation inside a sample). Run on a GPU machine; never in CI::

    python3 benchmarks/bench_launch.py --out results/launch.json
"""
import argparse
import statistics
import time

from common import recorded, sync, write_json


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the medians as JSON here")
    ap.add_argument("--note", default="", help="what code this run measured (goes into 'recorded')")
    args = ap.parse_args()

    import cupy
    from numba import cuda

    from numba_sc.core import fast_launch
    from numba_sc.core.launch import launch

    @cuda.jit
    def axpy(x, y, out):
        i = cuda.grid(1)
        if i < out.shape[0]:
            out[i] = 2.0 * x[i] + y[i]

    def through_core():  # the fast path with cuda.core.launch instead of cuLaunchKernel
        fast_launch.FAST.raw = False
        try:
            launch(axpy, n, x, y, out)
        finally:
            fast_launch.FAST.raw = True

    n = 1 << 16
    x, y, out = (cupy.ones(n, cupy.float32) for _ in range(3))
    nx, ny, nout = (cuda.as_cuda_array(a) for a in (x, y, out))

    def per_launch(fn, reps=2000):
        for _ in range(50):
            fn()
        sync()
        samples = []
        for _ in range(reps // 100):
            t0 = time.perf_counter()
            for _ in range(100):
                fn()
            samples.append((time.perf_counter() - t0) * 1e4)  # us per launch
        sync()
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
    rows = {}
    for name, fn in variants.items():
        rows[name.strip(" .")] = per_launch(fn)
        print(f"{name:30s} {rows[name.strip(' .')]:16.1f}")
    if args.out:
        write_json(args.out, {"recorded": recorded(args.note), "host_us_per_launch": rows})


if __name__ == "__main__":
    main()

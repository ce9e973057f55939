"""Host and GPU cost of the building blocks a layer is made of, on a CUDA GPU.

    . benchmarks/gpu_env.sh; python3 benchmarks/probe_host_costs.py [--out FILE.json]

A layer of ours is a few Numba kernels and a few library calls on ~100k points,
so it is the *host* time of each piece that sets the speed. Before choosing how
to launch kernels, sort, scan and multiply, this measures the candidates:

* a Numba kernel launched by the dispatcher, by ``cuda.core`` with the argument
  structs flattened by hand (numba_sc's first fast path), and by the CUDA driver
  with all arguments packed into one buffer (``cuLaunchKernel``'s ``extra``);
* CuPy's argsort (Thrust, merge sort with a comparator) against its sort
  (radix), a 1-D and a 2-D cumsum, a fill and a small device->host read;
* ``cupy.matmul`` on a batch against one direct ``cublasSgemmStridedBatched``.

Each number is the median host microseconds per call over many calls (``host``),
and for the library calls also the host time with a synchronize after every call
(``sync``). Never runs in CI.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def per_call(fn, reps=400, sync_each=False):
    import cupy

    for _ in range(20):
        fn()
    cupy.cuda.Device().synchronize()
    samples = []
    for _ in range(reps // 20):
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
            if sync_each:
                cupy.cuda.Device().synchronize()
        samples.append((time.perf_counter() - t0) / 20 * 1e6)
    cupy.cuda.Device().synchronize()
    return round(statistics.median(samples), 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import cupy
    from numba import cuda

    from numba_sc import backend

    res = {}

    @cuda.jit
    def axpy(x, y, out):
        i = cuda.grid(1)
        if i < out.shape[0]:
            out[i] = 2.0 * x[i] + y[i]

    n = 1 << 16
    x, y, out = (cupy.ones(n, cupy.float32) for _ in range(3))
    backend.launch(axpy, n, x, y, out)  # compiles, and teaches the fast path
    res["launch_dispatcher_cupy_args"] = per_call(lambda: axpy[256, 256](x, y, out))
    res["launch_numba_sc_cuda_core"] = per_call(lambda: backend.launch(axpy, n, x, y, out))
    res["cupy_elementwise"] = per_call(lambda: cupy.add(x, y, out=out))

    # the same compiled kernel, loaded by CuPy's driver module, launched with one packed buffer
    from cupy.cuda import driver
    from numba.cuda import types as nbtypes

    compiled = next(iter(axpy.overloads.values()))
    lib = compiled._codelibrary
    res["setup_functions"] = len(getattr(lib, "_setup_functions", []) or [])
    image = lib.get_cubin()
    for attr in ("code", "_module"):  # cuda.core's ObjectCode keeps the bytes here
        if isinstance(getattr(image, attr, None), (bytes, bytearray)):
            image = getattr(image, attr)
    res["image_type"] = type(image).__name__
    try:
        module = driver.moduleLoadData(bytes(image))
        func = driver.moduleGetFunction(module, lib._entry_name)
    except Exception as e:
        res["module_load_error"] = repr(e)
        func = int(lib.get_cufunc().kernel.handle)  # a CUkernel, accepted by cuLaunchKernel
    import struct

    def packed(*arrays):
        vals, fmt = [], "@"
        for a in arrays:
            fmt += "qqqqq" + "q" * a.ndim * 2
            vals += [0, 0, a.size, a.itemsize, a.data.ptr, *a.shape, *a.strides]
        return fmt, vals

    size = ctypes.c_size_t()

    def launch_packed():
        fmt, vals = packed(x, y, out)
        raw = struct.pack(fmt, *vals)
        buf = ctypes.create_string_buffer(raw, len(raw))  # no trailing NUL: the size must be exact
        size.value = len(raw)
        extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(buf), 2, ctypes.addressof(size), 0)
        driver.launchKernel(func, 256, 1, 1, 256, 1, 1, 0, 0, 0, ctypes.addressof(extra))

    try:
        out.fill(0)
        launch_packed()
        cupy.cuda.Device().synchronize()
        res["packed_launch_correct"] = bool((out == 3).all())
        res["launch_driver_packed_buffer"] = per_call(launch_packed)
    except Exception as e:
        res["packed_launch_error"] = repr(e)

    # library pieces
    rng = np.random.default_rng(0)
    for label, m in (("94k", 94_444), ("1M", 1_000_000)):
        keys = cupy.asarray(rng.integers(0, 1 << 40, m, dtype=np.int64))
        res[f"argsort_{label}_host"] = per_call(lambda: cupy.argsort(keys), 100)
        res[f"argsort_{label}_sync"] = per_call(lambda: cupy.argsort(keys), 100, True)
        res[f"sort_{label}_sync"] = per_call(lambda: cupy.sort(keys), 100, True)
        res[f"take_{label}_host"] = per_call(lambda: keys[keys[:100].astype(np.int64)], 100)
        table = cupy.asarray(rng.integers(-1, 2, (27, m), dtype=np.int32))
        res[f"cumsum_flat_{label}x27_sync"] = per_call(
            lambda: cupy.cumsum((table >= 0).ravel(), dtype=np.int32), 60, True)
        res[f"cumsum_axis1_{label}x27_sync"] = per_call(
            lambda: cupy.cumsum(table >= 0, axis=1, dtype=np.int32), 60, True)
        res[f"full_{label}x27_host"] = per_call(lambda: cupy.full((27, m), -1, np.int32), 100)
    small = cupy.zeros(32, np.int64)
    res["get_32_int64_sync"] = per_call(lambda: small.get(), 200, True)
    res["zeros_32_host"] = per_call(lambda: cupy.zeros(32, np.int64), 200)

    # batched GEMM: cupy.matmul against a direct cuBLAS call
    a = cupy.asarray(rng.normal(size=(4, 5000, 64)).astype(np.float32))
    w = cupy.asarray(rng.normal(size=(4, 64, 64)).astype(np.float32))
    o = cupy.empty((4, 5000, 64), np.float32)
    res["cupy_matmul_batched_host"] = per_call(lambda: cupy.matmul(a, w, out=o))
    try:
        from cupy_backends.cuda.libs import cublas

        handle = cupy.cuda.device.get_cublas_handle()
        one = np.array(1, np.float32)
        zero = np.array(0, np.float32)

        def direct():
            cublas.setStream(handle, cupy.cuda.get_current_stream().ptr)
            # row-major C = A @ W is column-major C^T = W^T A^T
            cublas.sgemmStridedBatched(handle, 0, 0, 64, 5000, 64, one.ctypes.data,
                                       w.data.ptr, 64, 64 * 64, a.data.ptr, 64, 5000 * 64,
                                       zero.ctypes.data, o.data.ptr, 64, 5000 * 64, 4)

        ref = cupy.matmul(a, w)
        o.fill(0)
        direct()
        res["direct_cublas_max_err"] = float(cupy.abs(o - ref).max())
        res["direct_cublas_batched_host"] = per_call(direct)
    except Exception as e:  # record and go on
        res["direct_cublas_error"] = repr(e)
    s1 = cupy.cuda.Stream(non_blocking=True)
    res["event_record_wait_host"] = per_call(lambda: s1.wait_event(cupy.cuda.get_current_stream().record()))
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                                              "command": "python3 benchmarks/probe_host_costs.py",
                                              "results": res}, indent=1))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Where one Map step and one layer spend host and GPU time, call by call.

    . benchmarks/gpu_env.sh; python3 benchmarks/probe_timeline.py [--out timeline.json]

CUDA events around a whole call cannot tell a slow kernel from a slow host: when
the host is the bottleneck the GPU idles between kernels and the events measure
the host. This probe wraps every kernel launch (``numba_sc.backend.launch``), the
cuBLAS calls, the CuPy calls the pipeline makes and every device->host read,
and records for each, in call order, the host microseconds it took and (for
kernels and GEMMs) the GPU microseconds between events recorded just before and
just after it. The wrappers add about a microsecond each. Never runs in CI.
"""
import argparse
import cProfile
import functools
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CUPY_CALLS = ("zeros", "empty", "full", "arange", "cumsum", "take", "asarray", "ascontiguousarray",
              "argsort", "concatenate")


class Recorder:
    def __init__(self):
        self.on = False
        self.rows = []  # (name, host_us, gpu event pair or None)

    def wrap(self, name, fn, gpu=False):
        import cupy

        @functools.wraps(fn)
        def inner(*a, **kw):
            if not self.on:
                return fn(*a, **kw)
            ev = None
            if gpu:
                ev = (cupy.cuda.Event(), cupy.cuda.Event())
                ev[0].record()
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                t1 = time.perf_counter()
                if gpu:
                    ev[1].record()
                self.rows.append([name(a) if callable(name) else name, (t1 - t0) * 1e6, ev])
        return inner


def install(rec):
    import cupy

    import numba_sc.backend as be
    import numba_sc.gemm_grouping as gg

    def kname(a):
        k = a[0]
        return "launch " + getattr(getattr(k, "py_func", k), "__name__", str(k))

    be.launch = rec.wrap(kname, be.launch, gpu=True)
    for mod in list(sys.modules.values()):  # modules that imported launch by name
        if getattr(mod, "__name__", "").startswith("numba_sc") and getattr(mod, "launch", None) is not None:
            if mod is not be:
                mod.launch = be.launch
    gg.grouped_gemm_cuda = rec.wrap("grouped_gemm_cuda", gg.grouped_gemm_cuda, gpu=True)
    gg.centre_product_cuda = rec.wrap("centre_product_cuda", gg.centre_product_cuda, gpu=True)
    import numba_sc.conv as conv
    conv.gg = gg
    for n in CUPY_CALLS:
        setattr(cupy, n, rec.wrap("cupy." + n, getattr(cupy, n)))
    be.to_host = rec.wrap("to_host (read)", be.to_host)
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("numba_sc") and getattr(mod, "to_host", None) is not None:
            if mod is not be:
                mod.to_host = be.to_host


def one_call(rec, fn):
    import cupy

    cupy.cuda.Device().synchronize()
    rec.rows = []
    rec.on = True
    t0 = time.perf_counter()
    fn()
    cupy.cuda.Device().synchronize()
    total = (time.perf_counter() - t0) * 1e6
    rec.on = False
    rows = []
    for name, host, ev in rec.rows:
        gpu = cupy.cuda.get_elapsed_time(ev[0], ev[1]) * 1e3 if ev else None
        rows.append({"op": name, "host_us": round(host, 1), "gpu_us": None if gpu is None else round(gpu, 1)})
    return total, rows


def summarize(label, calls):
    """calls: list of (total, rows) of repeated identical calls -> medians per position."""
    n = len(calls[0][1])
    med = []
    for i in range(n):
        host = statistics.median(c[1][i]["host_us"] for c in calls)
        g = [c[1][i]["gpu_us"] for c in calls if c[1][i]["gpu_us"] is not None]
        med.append({"op": calls[0][1][i]["op"], "host_us": round(host, 1),
                    "gpu_us": round(statistics.median(g), 1) if g else None})
    total = statistics.median(c[0] for c in calls)
    print(f"== {label}: total host {total:.0f} us; wrapped ops host {sum(m['host_us'] for m in med):.0f} us, "
          f"kernels/GEMMs gpu {sum(m['gpu_us'] or 0 for m in med):.0f} us")
    for m in med:
        g = "" if m["gpu_us"] is None else f"{m['gpu_us']:8.1f}"
        print(f"   {m['op']:34s} {m['host_us']:8.1f} {g}")
    return {"total_host_us": total, "ops": med}


def random_coords(n=1_000_000, box=400, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.unique(rng.integers(0, box ** 3, size=int(n * 1.1)))
    ids = rng.permutation(ids)[:n]
    return np.stack([ids // (box * box), (ids // box) % box, ids % box], 1).astype(np.int32)


def ncu_pass(ns, clouds, channels, dtype=np.float32):
    import cupy

    rng = np.random.default_rng(0)
    for cname, coords in clouds.items():
        for ch in channels:
            x = ns.SparseTensor(cupy.asarray(coords), cupy.asarray(rng.normal(size=(len(coords), ch)).astype(dtype)))
            w = cupy.asarray((rng.normal(size=(27, ch, ch)) / np.sqrt(ch)).astype(dtype))
            for _ in range(2):
                ns.sparse_conv3d(x, w, 3, tile_size=(8, 8))
            cupy.cuda.Device().synchronize()
            cupy.cuda.runtime.profilerStart()
            ns.sparse_conv3d(x, w, 3, tile_size=(8, 8))
            cupy.cuda.Device().synchronize()
            cupy.cuda.runtime.profilerStop()
            print(f"profiled {cname} {ch}->{ch}")


def forward_variants(ns, clouds):
    """GPU time of the forward kernel alone under register caps, on the rows of a real run."""
    import cupy
    from numba import cuda

    from numba_sc import backend as be
    from numba_sc.backward_search import backward_search_cuda, max_balanced_blocks
    from numba_sc.forward_search import forward_search_kernel
    from numba_sc.kernel_map import _device_deltas

    B, C = 512, 1024
    variants = {}  # (name, threads per block) -> kernel compiled for that block size
    for threads in (128, 256):
        base = forward_search_kernel(B, False, threads)
        variants[("default", threads)] = base
        for regs in (32, 48, 64):
            variants[(f"max_registers={regs}", threads)] = cuda.jit(max_registers=regs)(base.py_func)
    for cname, coords in clouds.items():
        keys = cupy.asarray(ns.conventions.pack_keys(coords[np.lexsort(coords.T[::-1])], (-1, -1, -1), (1, 1, 1)))
        d = _device_deltas((3, 3, 3), (1, 1, 1), (1, 1, 1))
        P = keys.shape[0]
        upper = max_balanced_blocks(27, P, P, B, C)
        n_rows = cupy.zeros(1, cupy.int64)
        bounds, rows, n_rows = backward_search_cuda(keys, keys, d, B, C, upper, n_rows)
        for (vname, threads), kern in variants.items():
            table = cupy.full((27, P), -1, cupy.int32)
            counts = cupy.zeros(27, cupy.int64)
            times = []
            for rep in range(25):
                table.fill(-1)
                counts.fill(0)
                a, b = cupy.cuda.Event(), cupy.cuda.Event()
                a.record()
                cc = cupy.zeros((27, -(-P // 1024)), cupy.int32)
                no_masks = cupy.zeros((1, 1), cupy.int64)  # the kernel without masks never reads them
                be.launch(kern, upper, keys, keys, d, rows, n_rows, table, counts, 10, cc,  # chunk 2**10
                          no_masks, no_masks, threads=threads, blocks=upper)
                b.record()
                b.synchronize()
                if rep >= 5:
                    times.append(cupy.cuda.get_elapsed_time(a, b) * 1e3)
            ok = int(counts.sum())
            print(f"{cname:9s} forward {vname:18s} threads {threads}: {statistics.median(times):7.1f} us  pairs {ok}")


def micro(ns, clouds):
    """Host us per launch of one 3-array kernel by path; grouped GEMMs on 1 vs 4 streams."""
    import cupy

    from numba_sc import backend as be
    from numba_sc import gemm_grouping as gg
    from numba_sc.conv import _prepare_layer
    from numba_sc.gather import gather_cuda, gather_kernel

    def per_call_us(fn, n=300):
        for _ in range(20):
            fn()
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        cupy.cuda.Device().synchronize()
        return (t1 - t0) / n * 1e6

    f = cupy.ones((1000, 8), cupy.float32)
    masks = cupy.zeros((1, 1000), cupy.int64)  # no pairs: every thread leaves after its mask
    bits = cupy.zeros(1, cupy.int64)
    slots = cupy.zeros((27, 1000), cupy.int32)
    buf = cupy.empty((10, 8), cupy.float32)
    args = (f, masks, bits, slots, buf)
    k = gather_kernel(8, 1)  # 8 fp32 channels a thread, one tile per row
    be.launch(k, 1000, *args)
    print(f"launch, fast path: {per_call_us(lambda: be.launch(k, 1000, *args)):.1f} us")
    print(f"launch, Numba dispatcher: {per_call_us(lambda: k[4, 256](*args)):.1f} us")
    print(f"cupy.empty: {per_call_us(lambda: cupy.empty((1000, 8), cupy.float32)):.1f} us; "
          f"cupy.take: {per_call_us(lambda: cupy.take(f, cupy.arange(3), axis=0)):.1f} us")
    rng = np.random.default_rng(0)
    for cname, coords in clouds.items():
        for ch in (64, 256):
            x = ns.SparseTensor(cupy.asarray(coords), cupy.asarray(rng.normal(size=(len(coords), ch)).astype(np.float32)))
            w = cupy.asarray(rng.normal(size=(27, ch, ch)).astype(np.float32))
            km = ns.build_kernel_map(x.coords, 3, assume_sorted=True)
            fd, wd, km2, plan = _prepare_layer(x, w, 3, 1, 1, False, km, "cuda")
            ibuf = gather_cuda(fd, plan.in_lists, plan.rows, 8)
            obuf = cupy.empty((plan.rows, ch), cupy.float32)
            for streams in (1, 4):
                fn = lambda: gg.grouped_gemm_cuda(ibuf, wd, plan.groups, obuf, streams=streams)  # noqa: E731
                host = per_call_us(fn, 50)
                gpu = []
                for _ in range(20):
                    a, b = cupy.cuda.Event(), cupy.cuda.Event()
                    a.record()
                    fn()
                    b.record()
                    b.synchronize()
                    gpu.append(cupy.cuda.get_elapsed_time(a, b) * 1e3)
                print(f"{cname:9s} {ch}->{ch} GEMMs ({len(plan.groups)} groups) on {streams} stream(s): "
                      f"host {host:7.1f} us/call, events {statistics.median(gpu):7.1f} us")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=".devdata")
    ap.add_argument("--out", default="timeline.json")
    ap.add_argument("--channels", default="64,256")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--ncu", action="store_true", help="one Map step and one layer per cloud between "
                    "profilerStart/Stop, for ncu --profile-from-start off")
    ap.add_argument("--variants", action="store_true", help="time forward-kernel register variants")
    ap.add_argument("--micro", action="store_true", help="launch paths; GEMM stream pool 1 vs 4")
    ap.add_argument("--clouds", default="kitti,random1M", help="which of kitti, random1M")
    ap.add_argument("--dtype", default="float32", help="features for --ncu: float32 or float16")
    args = ap.parse_args()
    import cupy

    import numba_sc as ns

    scan = np.fromfile(Path(args.data) / "semantickitti_000000.bin", np.float32).reshape(-1, 4)
    makers = {"kitti": lambda: ns.voxelize(np.ascontiguousarray(scan[:, :3]), 0.05, backend="reference").coords,
              "random1M": random_coords}
    clouds = {name: makers[name]() for name in args.clouds.split(",")}
    if args.ncu:
        return ncu_pass(ns, clouds, [int(c) for c in args.channels.split(",")], np.dtype(args.dtype))
    if args.variants:
        return forward_variants(ns, clouds)
    if args.micro:
        return micro(ns, clouds)
    rec = Recorder()
    install(rec)
    out = {"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
           "date": time.strftime("%Y-%m-%d"), "runs": {}}
    for cname, coords in clouds.items():
        rng = np.random.default_rng(0)
        for ch in [int(c) for c in args.channels.split(",")]:
            x = ns.SparseTensor(cupy.asarray(coords), cupy.asarray(rng.normal(size=(len(coords), ch)).astype(np.float32)))
            w = cupy.asarray((rng.normal(size=(27, ch, ch)) / np.sqrt(ch)).astype(np.float32))
            km = ns.build_kernel_map(x.coords, 3, assume_sorted=True)
            tiles = (min(ch, 8), min(ch, 8))
            work = {"map": lambda: ns.build_kernel_map(x.coords, 3, assume_sorted=True),
                    "layer": lambda: ns.sparse_conv3d(x, w, 3, tile_size=tiles),
                    "gmas": lambda: ns.sparse_conv3d(x, w, kernel_map=km, tile_size=tiles)}
            for wname, fn in work.items():
                if wname == "map" and ch != int(args.channels.split(",")[0]):
                    continue
                for _ in range(3):
                    fn()
                calls = [one_call(rec, fn) for _ in range(args.reps)]
                label = f"{cname} {wname}" + ("" if wname == "map" else f" {ch}->{ch}")
                out["runs"][label] = summarize(label, calls)
            if ch == int(args.channels.split(",")[0]):
                prof = cProfile.Profile()
                cupy.cuda.Device().synchronize()
                prof.enable()
                for _ in range(20):
                    ns.sparse_conv3d(x, w, 3, tile_size=tiles)
                cupy.cuda.Device().synchronize()
                prof.disable()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
                print(f"== cProfile {cname} layer {ch}->{ch}, 20 calls (tottime)")
                lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
                print("\n".join(lines[-16:]))
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

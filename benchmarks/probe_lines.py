#!/usr/bin/env python
"""Host microseconds per source line of the Map step (and a layer), on the GPU.

    . benchmarks/gpu_env.sh; python3 benchmarks/probe_lines.py [--layer] [--top 30]

cProfile charges time to functions and inflates every Python call; this probe
charges it to *lines* of a few chosen functions, with a line tracer that is
active only inside them (``sys.settrace`` returns a local tracer for those code
objects alone). Each line costs the tracer ~0.3-0.5 us, the same for every
line, so compare lines with each other, not with the untraced total printed
beside them. Never runs in CI.
"""
import argparse
import linecache
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class LineTimer:
    def __init__(self, functions):
        self.codes = {f.__code__ for f in functions}
        self.samples = defaultdict(list)  # (file, line) -> [us per call]
        self._acc = None

    def _local(self, frame, event, arg):
        # Charge the time since this frame's previous event to its previous line.
        now = time.perf_counter()
        prev = self._last.get(frame)
        if prev is not None:
            self._acc[(frame.f_code.co_filename, prev)] += now - self._t[frame]
        self._last[frame] = frame.f_lineno if event == "line" else None
        self._t[frame] = time.perf_counter()
        return self._local

    def _global(self, frame, event, arg):
        if event == "call" and frame.f_code in self.codes:
            return self._local
        return None

    def run(self, fn, reps):
        for _ in range(reps):
            self._acc, self._last, self._t = defaultdict(float), {}, {}
            sys.settrace(self._global)
            try:
                fn()
            finally:
                sys.settrace(None)
            for k, v in self._acc.items():
                self.samples[k].append(v * 1e6)

    def report(self, label, top):
        rows = sorted(((statistics.median(v), k) for k, v in self.samples.items()), reverse=True)
        print(f"== {label}: traced lines sum {sum(r[0] for r in rows):.0f} us (median per line)")
        for us, (fname, line) in rows[:top]:
            src = linecache.getline(fname, line).strip()[:70]
            print(f"  {us:7.1f}  {Path(fname).name}:{line:<4d} {src}")


def wrapped_costs(fn, targets, reps, sync):
    """Median host us per call of each (module, name) in ``targets`` while ``fn`` runs,
    measured by plain wrappers (~0.3 us each, no tracer): real numbers, not relative."""
    spent = defaultdict(float)
    originals = []
    for mod, name in targets:
        orig = getattr(mod, name)
        originals.append((mod, name, orig))

        def timed(*a, _orig=orig, _label=f"{mod.__name__.split('.')[-1]}.{name}", **kw):
            t0 = time.perf_counter()
            try:
                return _orig(*a, **kw)
            finally:
                spent[_label] += time.perf_counter() - t0
        setattr(mod, name, timed)
    samples, totals = defaultdict(list), []
    try:
        for _ in range(reps):
            spent.clear()
            t0 = time.perf_counter()
            fn()
            sync()
            totals.append((time.perf_counter() - t0) * 1e6)
            for k, v in spent.items():
                samples[k].append(v * 1e6)
    finally:
        for mod, name, orig in originals:
            setattr(mod, name, orig)
    return statistics.median(totals), {k: statistics.median(v) for k, v in samples.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=".devdata")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--layer", action="store_true", help="also a 64->64 layer")
    ap.add_argument("--strided", action="store_true", help="also a strided layer (kernel 2, stride 2, 32->32)")
    ap.add_argument("--wrap", action="store_true", help="per-function wrappers instead of the line tracer")
    ap.add_argument("--points", type=int, default=0, help="first N voxels only (for a simulator try-out)")
    args = ap.parse_args()

    import numba_sc as ns
    from numba_sc import backend, conventions, forward_search, backward_search, kernel_map, conv, metadata, \
        gemm_grouping, gather, scatter
    xp = backend.device_xp()

    scan = np.fromfile(Path(args.data) / "semantickitti_000000.bin", np.float32).reshape(-1, 4)
    coords = xp.asarray(ns.voxelize(np.ascontiguousarray(scan[:, :3]), 0.05, backend="reference").coords[:args.points or None])
    sync = (lambda: xp.cuda.Device().synchronize()) if xp is not np else (lambda: None)

    map_fns = [kernel_map.build_kernel_map, kernel_map.build_kernel_map_cuda, kernel_map._Work.__init__,
               kernel_map._search_cuda, kernel_map._layer, kernel_map._check_report, kernel_map._finish_cuda,
               forward_search.forward_search_cuda, backward_search.backward_search_cuda,
               conventions.launch_pack, conventions.validate_coords, backend.launch, backend.FastLauncher.launch,
               backend.filled, backend.to_host]
    work = {"map (default)": lambda: ns.build_kernel_map(coords, 3),
            "map (assume_sorted)": lambda: ns.build_kernel_map(coords, 3, assume_sorted=True)}
    fns = list(map_fns)
    if args.layer:
        rng = np.random.default_rng(0)
        x = ns.SparseTensor(coords, xp.asarray(rng.normal(size=(len(coords), 64)).astype(np.float32)))
        w = xp.asarray(rng.normal(size=(27, 64, 64)).astype(np.float32) / 8)
        work["layer 64->64"] = lambda: ns.sparse_conv3d(x, w, 3, tile_size=(8, 8))
        for mod in (conv, metadata, gemm_grouping, gather, scatter):
            fns += [f for f in vars(mod).values() if callable(f) and getattr(f, "__module__", "") == mod.__name__
                    and hasattr(f, "__code__")]
        fns += [metadata.GmasPlan.__init__] if hasattr(metadata, "GmasPlan") else []
    if args.strided:
        from numba_sc import output_coords, sorting
        rng = np.random.default_rng(0)
        xs = ns.SparseTensor(coords, xp.asarray(rng.normal(size=(len(coords), 32)).astype(np.float32)))
        ws = xp.asarray(rng.normal(size=(8, 32, 32)).astype(np.float32) / 8)
        work["strided k2 s2 32->32"] = lambda: ns.sparse_conv3d(xs, ws, 2, stride=2)
        fns += [output_coords.output_coordinates, output_coords.output_coordinates_cuda,
                sorting.sort_unique_keys_cuda, conv._conv, conv._map_layer, conv._layer_plan, conv.gmas,
                metadata.build_plan_cuda, metadata._layout, metadata._device_layout]
    if args.wrap:
        import numba_sc.conv as conv_mod
        targets = [(kernel_map, n) for n in ("_layer", "_Work", "_search_cuda", "_check_report", "_finish_cuda",
                                             "_device_deltas", "_search_plan")]
        targets += [(kernel_map, "backward_search_cuda"), (kernel_map, "forward_search_cuda"),
                    (kernel_map, "to_host"), (conventions, "launch_pack"), (conventions, "validate_coords"),
                    (forward_search, "filled"), (backend, "launch"), (conv_mod, "build_kernel_map"),
                    (conv_mod, "build_plan"), (conv_mod, "gmas"), (conv_mod, "resolve_tiles")]
        targets += [(metadata, n) for n in ("_layout", "_device_layout")]
        targets += [(m, "launch") for m in (metadata, forward_search, backward_search, gather, scatter, gemm_grouping)]
        targets += [(gemm_grouping, n) for n in ("take_weights_cuda", "_device_order", "_stream_pool", "_gpu")]
        targets += [(conv_mod.gg, n) for n in ("centre_product_cuda", "grouped_gemm_cuda")]
        targets += [(conv_mod, n) for n in ("gather_cuda", "scatter_cuda")]
        for label, fn in work.items():
            for _ in range(10):
                fn()
            sync()
            total, costs = wrapped_costs(fn, targets, args.reps, sync)
            print(f"== {label}: {total:.0f} us host (with wrappers)")
            for k, v in sorted(costs.items(), key=lambda kv: -kv[1]):
                print(f"  {v:7.1f}  {k}")
        return
    for label, fn in work.items():
        for _ in range(10):
            fn()
        sync()
        t = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            fn()
            sync()
            t.append((time.perf_counter() - t0) * 1e6)
        timer = LineTimer(fns)
        timer.run(lambda: (fn(), sync()), args.reps)
        print(f"{label}: untraced host {statistics.median(t):.0f} us")
        timer.report(label, args.top)


if __name__ == "__main__":
    main()

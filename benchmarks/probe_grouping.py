#!/usr/bin/env python
"""What pricing a GEMM launch buys: one layer with ``launch_rows=0`` (the paper's
padding policy alone) against the default (launches priced by the channels,
:func:`numba_sc.gemm_grouping.launch_rows`), beside spconv's MaskImplicitGemm,
interleaved call by call on SemanticKITTI at 0.05 m.

    . benchmarks/gpu_env.sh; python3 benchmarks/probe_grouping.py --out grouping.json

Never runs in CI.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import recorded  # noqa: E402
from ab_compare import one_gpu, one_host, spconv_calls, sync  # noqa: E402
from bench_conv import kitti_coords  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=".devdata")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default="grouping.json")
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    import cupy

    import numba_sc as ns
    from numba_sc import gemm_grouping as gg

    coords = kitti_coords(Path(args.data))
    out = {"recorded": recorded(args.note), "rows": []}
    for cin, cout, dtype, tiles in ((4, 16, np.float32, (2, 8)), (64, 64, np.float16, (8, 8)),
                                    (32, 32, np.float16, (8, 8)), (256, 256, np.float32, (4, 4))):
        rng = np.random.default_rng(0)
        x = ns.SparseTensor(cupy.asarray(coords),
                            cupy.asarray(rng.standard_normal((len(coords), cin)).astype(dtype)))
        w = cupy.asarray((rng.standard_normal((27, cin, cout)) / np.sqrt(cin)).astype(dtype))
        priced = gg.launch_rows(cin, cout, np.dtype(dtype).itemsize)
        fns = {"launch_rows=0": lambda: ns.sparse_conv3d(x, w, 3, tile_size=tiles, launch_rows=0),
               f"launch_rows={priced} (default)": lambda: ns.sparse_conv3d(x, w, 3, tile_size=tiles)}
        launches = {name: len(fn().kernel_map._plan[1].groups) for name, fn in fns.items()}
        for (wname, who), fn in spconv_calls(coords, cin, dtype, cout).items():
            if wname.startswith("layer") and "MaskImplicitGemm" in who:
                fns[who] = fn
        for fn in fns.values():
            for _ in range(10):
                fn()
        sync()
        samples = {name: {"host": [], "gpu": []} for name in fns}
        names = list(fns)
        for _ in range(args.rounds):
            for name in [names[i] for i in rng.permutation(len(names))]:
                fn = fns[name]
                fn()
                sync()
                for _ in range(4):
                    samples[name]["host"].append(one_host(fn))
                for _ in range(4):
                    samples[name]["gpu"].append(one_gpu(fn))
        row = {"layer": f"{cin}->{cout}", "dtype": np.dtype(dtype).name, "tiles": tiles, "launches": launches,
               "ms": {name: {"host": statistics.median(s["host"]), "gpu": statistics.median(s["gpu"]),
                             "host_all": s["host"], "gpu_all": s["gpu"]} for name, s in samples.items()}}
        out["rows"].append(row)
        print(f"{cin}->{cout} {np.dtype(dtype).name} (GEMMs {launches}): " + "  ".join(
            f"{name} {v['host']:.3f}/{v['gpu']:.3f}" for name, v in row["ms"].items()) + "  (host/GPU ms)")
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

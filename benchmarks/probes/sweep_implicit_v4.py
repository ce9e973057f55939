"""The implicit GEMM's rungs in fp16, channel count by channel count, on the ladder's layer
(one 3x3x3 submanifold layer, C -> C): by default v3 (CUDA cores) against v4 (tensor
cores) on the SemanticKITTI scan, what the threshold ``TENSOR_CORE_MIN_CHANNELS`` in
``numba_sc/dataflows/implicit_driver.py`` was read from::

    python3 benchmarks/probes/sweep_implicit_v4.py --channels 4,8,16,24,32,64,96,128 \\
        --out benchmarks/results/implicit_v4_channels.json

and v4 against v5 (double-buffered, loads running ahead across offsets, wider blocks) on
the scan and on the dense level of a network on 1M random voxels (``--cloud dense``:
those voxels at stride 4, about 16 pairs a voxel)::

    python3 benchmarks/probes/sweep_implicit_v4.py --rungs v4,v5 --cloud dense \\
        --channels 32,64,128,256 --out implicit_v5_dense.json

CUDA events, median of ``--rounds`` rounds in which the rungs alternate (the ladder's
own timing, :func:`numba_sc.tools.ladder.time_rungs`); each rung's error against the
reference is recorded beside its time.
"""
import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py

from common import dense_coords, find_data, recorded, scan_coords, write_json  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=None, help="folder with the scans (default: see common.find_data)")
    ap.add_argument("--channels", default="4,8,16,24,32,64,96,128")
    ap.add_argument("--rungs", default="v3,v4", help="rungs of the implicit GEMM's ladder, timed in turn")
    ap.add_argument("--cloud", default="kitti", choices=("kitti", "dense"),
                    help="the SemanticKITTI scan, or 1M random voxels at stride 4")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default="implicit_v4_channels.json")
    ap.add_argument("--note", default="", help="what code this run measures (recorded)")
    args = ap.parse_args()

    from numba_sc.tools.ladder import Context
    from numba_sc.dataflows import implicit_gemm as ig
    from numba_sc.tools.ladder import agreement, time_rungs

    names = tuple(args.rungs.split(","))
    unknown = set(names) - set(ig.LADDER.names)
    if unknown or len(names) < 2:
        ap.error(f"--rungs must name two or more of {ig.LADDER.names}, got {args.rungs!r}")
    if args.cloud == "kitti":
        coords = scan_coords(find_data(args.data), "kitti")
    else:  # a network's level after two stride-2 layers (bench_alternatives.py's "dense")
        coords = dense_coords()
    base = Context(coords, 64)
    some = dataclasses.replace(ig.LADDER, rungs=tuple(r for r in ig.LADDER.rungs if r.name in names))
    rows = []
    for c in (int(x) for x in args.channels.split(",")):
        work = some.workload(dataclasses.replace(base, channels=c, dtype="float16"))
        times = time_rungs(some, work, rounds=args.rounds)
        for r in names:
            rows.append(dict(channels=c, dtype="float16", rung=r, gpu_us=times[r], error=agreement(some, r, work)))
        print(f"C={c:4d} fp16: " + "  ".join(f"{r} {times[r]:8.1f} us" for r in names)
              + f"  {names[0]}/{names[-1]} {times[names[0]] / times[names[-1]]:.2f}"
              + "  (errors " + ", ".join(f"{x['error']:.1e}" for x in rows[-len(names):]) + ")", flush=True)
    rec = {"points": int(len(coords)), "cloud": args.cloud, "rows": rows, "rounds": args.rounds,
           "recorded": recorded(args.note)}
    write_json(args.out, rec)
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()

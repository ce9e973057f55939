"""The implicit GEMM's v3 (CUDA cores) against v4 (tensor cores) in fp16, channel count by
channel count, on the ladder's layer (one 3x3x3 submanifold layer on the SemanticKITTI
scan, C -> C). What the threshold ``TENSOR_CORE_MIN_CHANNELS`` in
``numba_sc/dataflows/implicit_gemm.py`` was read from.

    python3 benchmarks/probes/sweep_implicit_v4.py --channels 4,8,16,24,32,64,96,128 \\
        --out benchmarks/results/implicit_v4_channels.json

CUDA events, median of ``--rounds`` rounds in which the two rungs alternate (the
ladder's own timing, :func:`numba_sc.tools.ladder.time_rungs`); each rung's error
against the reference is recorded beside its time.
"""
import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py

from common import find_data, recorded, scan_coords, write_json  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=None, help="folder with the scans (default: see common.find_data)")
    ap.add_argument("--channels", default="4,8,16,24,32,64,96,128")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default="implicit_v4_channels.json")
    ap.add_argument("--note", default="", help="what code this run measures (recorded)")
    args = ap.parse_args()

    from numba_sc.tools.ladder import Context
    from numba_sc.dataflows import implicit_gemm as ig
    from numba_sc.tools.ladder import agreement, time_rungs

    coords = scan_coords(find_data(args.data), "kitti")
    base = Context(coords, 64)
    two = dataclasses.replace(ig.LADDER, rungs=tuple(r for r in ig.LADDER.rungs if r.name in ("v3", "v4")))
    rows = []
    for c in (int(x) for x in args.channels.split(",")):
        work = two.workload(dataclasses.replace(base, channels=c, dtype="float16"))
        times = time_rungs(two, work, rounds=args.rounds)
        for r in ("v3", "v4"):
            rows.append(dict(channels=c, dtype="float16", rung=r, gpu_us=times[r], error=agreement(two, r, work)))
        print(f"C={c:4d} fp16: v3 {times['v3']:8.1f} us  v4 {times['v4']:8.1f} us  v3/v4 "
              f"{times['v3'] / times['v4']:.2f}  (v4 error {rows[-1]['error']:.1e})", flush=True)
    rec = {"points": int(len(coords)), "rows": rows, "rounds": args.rounds, "recorded": recorded(args.note)}
    write_json(args.out, rec)
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()

"""Command line: ``python -m numba_sc demo`` and ``python -m numba_sc check``.

``demo`` runs every stage on a scan and times kernels beside references;
``check`` compares each stage's kernel with its reference and locates mismatches.
"""
from __future__ import annotations

import argparse
import os
import sys


def _ensure_kernels_can_run():
    """Without a GPU, restart this command under Numba's CUDA simulator.

    The simulator can only be chosen before numba is imported, and importing
    ``numba_sc`` imports numba, so the command re-executes itself once with
    ``NUMBA_ENABLE_CUDASIM=1`` in the environment.
    """
    from .backend import gpu_present, simulating

    if simulating() or gpu_present() or os.environ.get("NUMBA_ENABLE_CUDASIM") == "0":
        return
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "numba_sc", *sys.argv[1:]], env)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m numba_sc", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run every stage on a scan, kernels against references")
    d.add_argument("--points", help="KITTI-style float32 .bin file (default: a synthetic LiDAR scene)")
    d.add_argument("--columns", type=int, default=4, help="float32 columns per point in --points (default 4)")
    d.add_argument("--voxel-size", type=float, default=0.05, help="voxel edge in metres (default 0.05)")
    d.add_argument("--crop", type=int, default=1500, help="points the simulated kernels run on (default 1500)")
    c = sub.add_parser("check", help="compare every stage's kernel with its reference, locate mismatches")
    c.add_argument("--points", help="KITTI-style float32 .bin file (default: a synthetic LiDAR scene)")
    c.add_argument("--columns", type=int, default=4, help="float32 columns per point in --points (default 4)")
    c.add_argument("--voxel-size", type=float, default=0.05, help="voxel edge in metres (default 0.05)")
    c.add_argument("--stage", help="only the stages whose name contains this text")
    c.add_argument("--crop", type=int, default=1500, help="points the simulated kernels run on (default 1500)")
    args = parser.parse_args(argv)

    if argv is None:
        _ensure_kernels_can_run()
    if args.command == "demo":
        from .demo import demo

        return demo(args.points, args.columns, args.voxel_size, args.crop)
    if args.command == "check":
        from .check import run_check
        from .demo import load_points
        from .synthetic import lidar_scene

        if args.points:
            points, feats = load_points(args.points, args.columns)
        else:
            points, intensity = lidar_scene()
            feats = intensity[:, None]
        results = run_check(points, feats, args.voxel_size, args.stage, args.crop)
        return 0 if all(ok for _, ok, _ in results) else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())

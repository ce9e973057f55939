"""Command line: ``python -m numba_sc demo`` (and ``numba-sc demo`` once installed)."""
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
    args = parser.parse_args(argv)

    if argv is None:
        _ensure_kernels_can_run()
    if args.command == "demo":
        from .demo import demo

        return demo(args.points, args.columns, args.voxel_size, args.crop)
    return 2


if __name__ == "__main__":
    sys.exit(main())

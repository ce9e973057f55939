"""Registers, spills and shared memory of the tensor-core rungs, read without a GPU.

On a GPU, Nsight Compute reports what a kernel uses (``ncu_implicit_v4_v5.json``: v4 at
158 registers a thread, so 3 of its 128-thread blocks an SM). Those numbers are fixed
when the kernel is linked, before it runs, so this machine can produce them too, doing
what numba-cuda does when it first launches v4 or v5:

1. Numba compiles the kernel's Python to LTO-IR for the target (``cuda.compile(...,
   output="ltoir")``: NVVM, no GPU needed);
2. ``nvcc -dc -dlto`` compiles ``dataflows/mma.cu`` to LTO-IR (numba-cuda uses NVRTC
   for this; the IR is the same kind);
3. nvJitLink links both with link-time optimization (the mma inlined into the
   kernel) and runs ptxas, whose report (``-verbose``) gives the registers, the
   spills and the shared memory. ``-maxrregcount=N`` is the option numba-cuda passes
   for ``cuda.jit(max_registers=N)`` (:func:`numba_sc.dataflows.tensor_cores.kernel_options`).

Each rung at each channel count (the library's tiles for it, 64-row tiles), v4 also
without its prefetch (``prefetch=False``) and with its rows' only (``prefetch="rows"``),
and each register cap; the blocks an SM from registers and from shared memory follow from the
figures (an SM has 65,536 registers, given out to a warp 256 at a time, and, on compute
capability 9.0, 227 KB of shared memory its blocks may use). Run from the checkout's root on a machine with the CUDA
toolkit (``nvcc``) and ``cuda-bindings`` (NVVM and nvJitLink)::

    python3 benchmarks/probes/kernel_resources.py --out benchmarks/results/kernel_resources.json

Never runs in CI (it needs nvcc). Whether a cap pays is timed on a GPU
(``benchmarks/probes/v4_registers.py``).
"""
import argparse
import functools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"  # before numba is imported: compile for a GPU

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py

from common import recorded, write_json  # noqa: E402

REGISTERS_AN_SM = 65536
REGISTER_UNIT = 8  # a warp's registers are allocated 8 a thread at a time (256 a warp)
SHARED_AN_SM = {(8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 9): 99 * 1024, (9, 0): 227 * 1024}
MAX_BLOCKS_AN_SM, MAX_WARPS_AN_SM = 32, 64


def blocks_by_registers(registers: int, threads: int) -> int:
    """Blocks of ``threads`` an SM holds at ``registers`` a thread: whole warps' worth of
    registers, rounded up to the allocation unit, then whole blocks of those warps."""
    per_warp = -(-registers // REGISTER_UNIT) * REGISTER_UNIT * 32
    return (REGISTERS_AN_SM // per_warp) // (threads // 32)


def ptxas_report(log: str) -> dict:
    """Registers, spill bytes, stack and shared bytes of the one kernel in ptxas's report."""
    def grab(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0
    regs = re.search(r"Used (\d+) registers", log)
    if not regs:
        raise RuntimeError(f"no register count in the linker's report:\n{log}")
    return {"registers": int(regs.group(1)), "spill_stores": grab(r"(\d+) bytes spill stores"),
            "spill_loads": grab(r"(\d+) bytes spill loads"), "stack": grab(r"(\d+) bytes stack frame"),
            "shared": grab(r"(\d+) bytes smem")}


def lto_link(ltoir: bytes, mma_object: bytes, arch: str, cap) -> str:
    """nvJitLink's report of linking the kernel's LTO-IR with mma.cu's."""
    from cuda.bindings import nvjitlink

    opts = [f"-arch={arch}", "-lto", "-verbose"] + ([f"-maxrregcount={cap}"] if cap else [])
    handle = nvjitlink.create(len(opts), opts)
    try:
        nvjitlink.add_data(handle, nvjitlink.InputType.LTOIR, ltoir, len(ltoir), "kernel")
        nvjitlink.add_data(handle, nvjitlink.InputType.OBJECT, mma_object, len(mma_object), "mma")
        nvjitlink.complete(handle)
        log = bytearray(nvjitlink.get_info_log_size(handle))
        nvjitlink.get_info_log(handle, log)
        return bytes(log).decode(errors="replace")
    finally:
        nvjitlink.destroy(handle)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cc", default="9.0", help="compute capability to compile for (the lent GPUs: 9.0)")
    ap.add_argument("--channels", default="16,32,64,128,256", help="C -> C layers")
    ap.add_argument("--caps", default="none,128,112,96", help="register caps (none: the compiler's choice)")
    ap.add_argument("--tile-m", type=int, default=64, help="the plan's row tile")
    ap.add_argument("--out", default="kernel_resources.json")
    args = ap.parse_args()

    from numba import cuda

    from numba_sc.dataflows import implicit_gemm as ig
    from numba_sc.dataflows import implicit_shapes as ish
    from numba_sc.dataflows.tensor_cores import MMA_SOURCE

    if not re.fullmatch(r"\d+\.\d", args.cc):
        ap.error(f"--cc must be a compute capability such as 9.0, got {args.cc!r}")
    cc = tuple(int(x) for x in args.cc.split("."))
    arch = f"sm_{cc[0]}{cc[1]}"
    if not re.fullmatch(r"(none|\d+)(,(none|\d+))*", args.caps):
        ap.error(f"--caps must be register counts or none, comma-separated (none,128), got {args.caps!r}")
    caps = [None if c == "none" else int(c) for c in args.caps.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        obj = Path(tmp) / "mma.o"
        subprocess.run(["nvcc", f"-arch={arch}", "-dc", "-dlto", str(MMA_SOURCE), "-o", str(obj)], check=True)
        mma_object = obj.read_bytes()
    rows = []
    late_v4 = functools.partial(ig.implicit_gemm_v4, prefetch=False)  # each chunk loaded after the last one's math
    rows_v4 = functools.partial(ig.implicit_gemm_v4, prefetch="rows")  # only the gathered rows loaded early
    for rung, maker, tiles_for, shape in (("v4", ig.implicit_gemm_v4, ish.tensor_tiles, ish.v4_shape),
                                          ("v4 prefetch=False", late_v4, ish.tensor_tiles, ish.v4_shape),
                                          ("v4 prefetch='rows'", rows_v4, ish.tensor_tiles, ish.v4_shape),
                                          ("v5", ig.implicit_gemm_v5, ish.v5_tiles, ish.v5_shape)):
        for c in (int(x) for x in args.channels.split(",")):
            tiles = tiles_for(c, c)
            warps_m, warps_n, _, _ = shape(args.tile_m, tiles.tile_n)
            threads = 32 * warps_m * warps_n
            kernel = maker(args.tile_m, *tiles).py_func
            ltoir, _ = cuda.compile(kernel, ish.tensor_core_signature(tiles), device=False, abi="numba", cc=cc,
                                    output="ltoir")
            for cap in caps:
                r = ptxas_report(lto_link(ltoir, mma_object, arch, cap))
                by_regs = blocks_by_registers(r["registers"], threads)
                by_shared = SHARED_AN_SM.get(cc, 99 * 1024) // max(r["shared"], 1)
                blocks = min(by_regs, by_shared, MAX_BLOCKS_AN_SM, MAX_WARPS_AN_SM // (threads // 32))
                r.update(rung=rung, channels=c, tiles=list(tiles), tile_m=args.tile_m, threads=threads, cap=cap,
                         blocks_by_registers=by_regs, blocks_by_shared=by_shared, blocks_an_sm=blocks,
                         warps_an_sm=blocks * threads // 32)
                rows.append(r)
                print(f"{rung:18s} C={c:4d} tiles {tuple(tiles)} {threads} threads, cap {str(cap):>4s}: "
                      f"{r['registers']:3d} registers, spills {r['spill_stores']:4d}/{r['spill_loads']:4d} B, "
                      f"shared {r['shared']:6d} B -> {r['blocks_an_sm']} blocks, {r['warps_an_sm']} warps an SM "
                      f"(registers {by_regs}, shared {by_shared})", flush=True)
    rec = recorded("tensor-core rungs linked as numba-cuda links them, ptxas's report; no GPU")
    rec["device"] = f"none: nvJitLink LTO link for {arch}"
    write_json(args.out, {"rows": rows, "cc": list(cc), "recorded": rec})
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()

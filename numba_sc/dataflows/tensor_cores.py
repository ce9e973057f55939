"""Tensor cores from a Numba kernel: a warp-level ``mma`` in linked CUDA C++.

What tensor cores do. A CUDA core does one fused multiply-add (FMA) per lane per
instruction: 32 FMAs for a warp. A tensor core multiplies small matrices: one
``mma.sync.aligned.m16n8k16`` instruction, issued by a whole warp, computes
``D = A B + C`` with ``A`` 16x16 and ``B`` 16x8 in fp16 and ``C``, ``D`` 16x8 in
fp32, 16 * 8 * 16 = 2048 FMAs, the work of 64 warp-wide FFMA instructions. By
NVIDIA's figures for the H100, an SM's tensor cores do 2048 dense fp16 FMAs a
clock, 16 times the 128 fp32 FMAs of its CUDA cores (Hopper's full rate needs
its warpgroup-wide ``wgmma``; the warp-wide ``mma`` used here, which runs on
every GPU since Ampere, gets a part of it).

Numba-CUDA has no intrinsic for ``mma`` (nor for ``ldmatrix``, the matching
shared-memory load), but a ``@cuda.jit`` kernel can call a device function
written in CUDA C++: ``cuda.declare_device(name, signature, link="mma.cu")``
declares it, numba-cuda compiles the file with NVRTC and links it into every
kernel that calls it (with link-time optimization the call is inlined). The
C++ here is the multiply-accumulate and nothing else (``mma.cu``, beside this
file); the implicit GEMM's gathers, shared-memory tiles, barriers and output
stay Python (:func:`numba_sc.dataflows.implicit_gemm.implicit_gemm_v4`).

Arrays cross into C++ as pointers. Numba passes an array as a struct (its data
pointer, shape, strides, ...); the C++ side wants the data pointer alone, which
:func:`data_pointer`, a four-line ``numba.core.extending.intrinsic``, takes out
of the struct. It works for global, shared and local (register) arrays alike:
the C++ reads the shared tiles through it and adds onto the warp's accumulators
through it.

**The fragment layouts** (PTX ISA, "Matrix fragments for mma.m16n8k16"). Each
of the warp's 32 lanes holds a fixed part of each matrix, in 32-bit registers of
two fp16 values. With ``g = lane // 4`` (the lane's *group*, 0..7) and ``t =
lane % 4`` (its place in the group, 0..3)::

    A (16 x 16, row-major): four registers a0..a3, two fp16 each
        a0: row g,     columns 2t, 2t+1        a2: row g,     columns 2t+8, 2t+9
        a1: row g + 8, columns 2t, 2t+1        a3: row g + 8, columns 2t+8, 2t+9
    B (16 x 8, "col": the two values of a register are neighbours down a column)
        b0: rows 2t, 2t+1,   column g          b1: rows 2t+8, 2t+9, column g
    C, D (16 x 8, fp32): four floats c0..c3
        c0, c1: row g,     columns 2t, 2t+1    c2, c3: row g + 8, columns 2t, 2t+1

So lane 5 (g = 1, t = 1) holds ``A[1, 2:4]``, ``A[9, 2:4]``, ``A[1, 10:12]``,
``A[9, 10:12]``, ``B[2:4, 1]``, ``B[10:12, 1]`` and the results ``D[1, 2:4]``,
``D[9, 2:4]``. Nobody holds a whole row: the warp computes the tile together,
and the four lanes of a group hold one row's eight results. :func:`c_row` and
:func:`c_col` say where a lane's result ``r`` belongs; the implicit GEMM's
epilogue writes the outputs with them.

``ldmatrix`` loads these fragments from shared memory: ``.x4`` reads four 8x8
fp16 matrices, lane ``l`` giving the address of row ``l % 8`` of matrix ``l //
8`` (16 bytes, 16-byte aligned), and leaves each lane exactly the ``A`` layout
above; ``.trans`` transposes each matrix on the way, which turns a row-major
``B`` (input channels down, output channels across, the layout of ``W[k]``) into
the ``B`` layout. One instruction replaces eight 2-byte loads per lane.

Napkin math, a warp tile of 32 x 32 outputs (two 16-row by four 8-column mma
tiles, :func:`numba_sc.dataflows.implicit_shapes.v4_shape`) over 16 input
channels: 8 ``mma`` (16,384 FMAs); its fragments are 2 ``ldmatrix.x4`` of ``A``
and 2 of ``B``, 2 KB of shared memory. An SM reads about 128 bytes of shared
memory per clock, so four such warps read for 64 clocks for 64K FMAs, which
its tensor cores do in 32 clocks: the warp tile is bound by
shared memory, not by the tensor cores (a larger warp tile reads less per FMA,
at the cost of registers). The same 64K FMAs on CUDA cores are 2048 warp-wide
FFMA instructions, 512 clocks of the SM's four schedulers. And the sparse
layer itself is bound by its gathers from global memory (the module docstring
of :mod:`numba_sc.dataflows.implicit_gemm`): tensor cores remove the
arithmetic, what the gathers cost remains. What it bought, measured per
channel count: ``benchmarks/results/ladder_implicit_gemm.json`` and
``benchmarks/results/implicit_v4_channels.json``.

**Under Numba's CUDA simulator** the linked C++ cannot run (the simulator runs
Python, one thread at a time), so :func:`warp_mma` hands the kernel a Python stand-in,
:func:`emulated_warp_mma`, that computes what the C++ computes: each lane adds its own
results (its places in the C layout above) from the shared tiles, in float32. No lane
needs another lane's registers for that, because the tiles it reads sit in shared
memory, unchanged between the kernel's barriers. So v4's Python half (the gathers, the
shared tiles, the barriers, the epilogue) runs and can be stepped through on a machine
without a GPU; what the stand-in cannot check is ``mma.cu`` itself (its ``ldmatrix``
addresses and fragments), which :func:`mma_probe` and the GPU tests check on a GPU, and
:mod:`numba_sc.tools.mma_model` models lane by lane in NumPy. The stand-in refuses what
the hardware would get wrong silently: rows not 16-byte aligned, a warp tile reaching
past its shared tile, tiles that are not fp16 bits.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from numba import cuda, float32, types
from numba.core.extending import intrinsic

from ..core.device import simulating
from ..core.state import cached

MMA_SOURCE = Path(__file__).with_name("mma.cu")  # shipped with the package (pyproject: package-data)
MMA_SHAPES = ((1, 2), (1, 4), (2, 2), (2, 4), (4, 2), (4, 4))  # warp tiles mma.cu defines: (16-row, 8-column) tiles


@intrinsic
def _data_pointer(typingctx, arr):
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(arr)(context, builder, args[0]).data  # the struct's data field
        return builder.bitcast(data, context.get_value_type(types.voidptr))

    return types.voidptr(arr), codegen


def _the_array(arr):
    """``data_pointer`` under the simulator: the array itself (a NumPy array), which the
    C++'s stand-in, :func:`emulated_warp_mma`, takes as it is."""
    return arr


# data_pointer(arr): the address of an array's first element as a ``void*`` (device code
# only), how an array, global, shared or local, is handed to a C++ device function. Under
# the simulator an array is a NumPy array, and the C++'s stand-in takes it as it is.
data_pointer = _the_array if simulating() else _data_pointer


@cached
def warp_mma(mi: int, ni: int):
    """The C++ device function ``implicit_mma_m<mi>n<ni>`` of ``mma.cu``, declared for
    Numba: a warp adds ``A[row0 : row0 + 16 mi] @ B[:, col0 : col0 + 8 ni]`` over
    ``16 k_steps`` channels onto its accumulators. Called from a kernel as::

        warp_mma(mi, ni)(data_pointer(acc), data_pointer(a_tile), data_pointer(b_tile),
                         a_pitch, b_pitch, row0, col0, k_steps)

    ``acc``: the lane's ``4 mi ni`` float32 results, ``acc[(i ni + j) 4 + r]`` for
    16x8 tile ``(i, j)`` of the warp's and result ``r`` (:func:`c_row`, :func:`c_col`);
    ``a_tile``, ``b_tile``: row-major fp16 shared arrays with ``a_pitch``,
    ``b_pitch`` fp16 values a row (a multiple of 8: rows 16-byte aligned). The
    return value (an int32 the C++ sets to 0) means nothing. Under the simulator:
    :func:`emulated_warp_mma`, called the same way.
    """
    if (mi, ni) not in MMA_SHAPES:
        raise ValueError(f"(mi, ni) must be one of {MMA_SHAPES} (the warp tiles mma.cu defines), got {(mi, ni)}")
    if simulating():
        return emulated_warp_mma(mi, ni)
    return cuda.declare_device(f"implicit_mma_m{mi}n{ni}",
                               "int32(voidptr, voidptr, voidptr, int32, int32, int32, int32, int32)",
                               link=str(MMA_SOURCE))


def kernel_options(max_registers: int | None = None) -> dict:
    """``cuda.jit``'s options for a tensor-core kernel: ``max_registers``, a cap on the
    registers a thread (None: the compiler's choice; the simulator has no registers,
    so it gets none).

    Why a cap can pay: an SM has 65,536 32-bit registers (compute capability 8.0
    to 9.0) shared by the threads of its resident blocks, so a kernel of 128-thread
    blocks at 158 registers a thread fits 3 blocks an SM, at 128 registers 4. More
    resident warps hide more of the gathers' latency; what does not fit the cap is
    spilled to local memory (cached in L1), which costs loads. Whether the trade pays
    is measured, not assumed (``benchmarks/probes/kernel_resources.py`` reads registers
    and spills without a GPU; a GPU run times the caps)."""
    if max_registers is None:
        return {}
    if isinstance(max_registers, bool) or not isinstance(max_registers, (int, np.integer)) \
            or not 16 <= max_registers <= 255:
        raise ValueError(f"max_registers must be an int from 16 to 255 (a thread's registers), or None; "
                         f"got {max_registers!r}")
    return {} if simulating() else {"max_registers": int(max_registers)}


FP16_BITS = (np.float16, np.uint16, np.uint32, np.uint64)  # a shared tile's dtypes: fp16 values, or words of them


def emulated_warp_mma(mi: int, ni: int):
    """The simulator's stand-in for ``implicit_mma_m<mi>n<ni>``: the same call, the same
    sums, in Python (see the module docstring); a device function, which under the
    simulator each lane's thread runs as plain Python.

    Lane ``lane`` adds, onto its accumulators ``acc[(i ni + j) 4 + r]``, row
    ``row0 + 16 i + c_row(lane, r)`` of ``A`` times column ``col0 + 8 j + c_col(lane, r)``
    of ``B`` over the first ``16 k_steps`` channels: its share of the warp's tile, no
    more. Products of fp16 values are exact in float32; the sum is float32, in NumPy's
    order (the tensor cores' own order and internal rounding are not documented, so
    the GPU agrees to float32 rounding, not bit for bit).
    """
    rows_w, cols_w = 16 * mi, 8 * ni  # the warp tile

    @cuda.jit(device=True)
    def mma(acc, a_tile, b_tile, a_pitch, b_pitch, row0, col0, k_steps):
        block = cuda.blockDim.x * cuda.blockDim.y * cuda.blockDim.z
        if block % 32:
            raise ValueError(f"mma.sync is a whole warp's instruction: the block's {block} threads must be "
                             "whole warps (a multiple of 32)")
        for name, tile in (("a_tile", a_tile), ("b_tile", b_tile)):
            if tile.dtype not in FP16_BITS:
                raise TypeError(f"{name} must hold fp16 values (float16, or uint16/32/64 words of them), "
                                f"got {tile.dtype}")
        if a_pitch % 8 or b_pitch % 8 or col0 % 8:
            raise ValueError("ldmatrix reads 16-byte aligned rows: a_pitch, b_pitch and col0 must be multiples "
                             f"of 8 fp16 values, got a_pitch={a_pitch}, b_pitch={b_pitch}, col0={col0}")
        a = a_tile.view(np.float16)
        b = b_tile.view(np.float16)
        depth = 16 * k_steps  # channels summed
        if (depth > a_pitch or row0 < 0 or (row0 + rows_w) * a_pitch > a.size
                or col0 < 0 or col0 + cols_w > b_pitch or depth * b_pitch > b.size):
            raise ValueError(f"the warp tile (rows {row0}..{row0 + rows_w - 1}, columns {col0}.."
                             f"{col0 + cols_w - 1}, {depth} channels) reaches past its shared tiles: A holds "
                             f"{a.size // a_pitch} rows of {a_pitch}, B {b.size // b_pitch} rows of {b_pitch}")
        lane = cuda.threadIdx.x % 32  # (mma.cu: threadIdx.x & 31)
        g, t = lane // 4, lane % 4
        rows = (row0 + 16 * np.arange(mi)[:, None] + np.array([g, g + 8])).ravel()  # (i, half)
        cols = (col0 + 8 * np.arange(ni)[:, None] + np.array([2 * t, 2 * t + 1])).ravel()  # (j, column)
        k = np.arange(depth)
        mine = a[rows[:, None] * a_pitch + k].astype(np.float32) @ b[k[:, None] * b_pitch + cols].astype(np.float32)
        # mine[2 i + half, 2 j + column] is result r = 2 half + column of tile (i, j)
        acc[:4 * mi * ni] += mine.reshape(mi, 2, ni, 2).transpose(0, 2, 1, 3).ravel()
        return 0

    return mma


@cuda.jit(device=True, inline=True)
def c_row(lane, r):
    """Row of a 16x8 mma tile that result ``r`` (0..3) of ``lane`` belongs to."""
    return lane // 4 + (r // 2) * 8


@cuda.jit(device=True, inline=True)
def c_col(lane, r):
    """Column of a 16x8 mma tile that result ``r`` (0..3) of ``lane`` belongs to."""
    return (lane % 4) * 2 + r % 2


def c_layout_reference() -> np.ndarray:
    """NumPy: int (32, 4, 2), the (row, column) of result ``r`` of each lane: the C
    layout table above, which :func:`c_row` and :func:`c_col` compute."""
    lane, r = np.meshgrid(np.arange(32), np.arange(4), indexing="ij")
    return np.stack([lane // 4 + (r // 2) * 8, (lane % 4) * 2 + r % 2], axis=-1)


@cached
def _probe_kernel():
    mma = warp_mma(1, 2)
    pitch = 24  # 16 columns + 8: 48-byte rows, 16-byte aligned
    size = 16 * pitch  # (a shared array's size must be a constant, not an expression)
    align = None if simulating() else 16  # (ldmatrix's rows; the simulator takes no alignment)

    @cuda.jit
    def probe(a, b, out):
        """One warp: A (16x16) and B (16x16) into shared memory, one call of the
        C++, the 16x16 fp32 product written from each lane's results."""
        lane = cuda.threadIdx.x
        a_s = cuda.shared.array(size, types.float16, alignment=align)
        b_s = cuda.shared.array(size, types.float16, alignment=align)
        for e in range(lane, 256, 32):
            a_s[(e // 16) * pitch + e % 16] = a[e // 16, e % 16]
            b_s[(e // 16) * pitch + e % 16] = b[e // 16, e % 16]
        acc = cuda.local.array(8, float32)
        for q in range(8):
            acc[q] = float32(0.0)
        cuda.syncthreads()  # (the block is one warp; the simulator has no syncwarp)
        mma(data_pointer(acc), data_pointer(a_s), data_pointer(b_s), pitch, pitch, 0, 0, 1)
        for j in range(2):
            for r in range(4):
                out[c_row(lane, r), j * 8 + c_col(lane, r)] = acc[j * 4 + r]

    return probe


def mma_probe(a, b) -> np.ndarray:
    """``a @ b`` for two 16x16 fp16 matrices by one warp's two ``mma``: on a GPU the
    smallest check that the C++ links, the fragments are where the layout above
    says, and the products are right (to fp32 rounding); under the simulator, the
    same kernel on :func:`emulated_warp_mma`. Returns float32."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != (16, 16) or b.shape != (16, 16) or a.dtype != np.float16 or b.dtype != np.float16:
        raise ValueError(f"a and b must be float16 (16, 16) arrays, got {a.dtype} {a.shape} and "
                         f"{b.dtype} {b.shape}")
    out = cuda.device_array((16, 16), np.float32)
    _probe_kernel()[1, 32](cuda.to_device(np.ascontiguousarray(a)), cuda.to_device(np.ascontiguousarray(b)), out)
    return out.copy_to_host()

"""A NumPy model of a warp on the tensor cores: what v4's C++ (``dataflows/mma.cu``) does, lane by lane.

The top rung of the implicit GEMM, :func:`numba_sc.dataflows.implicit_gemm.implicit_gemm_v4`,
hands each warp's tile product to CUDA C++ (``mma.sync`` and ``ldmatrix``) that Numba's
simulator cannot run (there, a Python stand-in computes each lane's results straight from
the shared tiles, :func:`numba_sc.dataflows.tensor_cores.emulated_warp_mma`, which says
nothing of how the C++ gets them). This module says in NumPy what each of those
instructions does, so that a reader without a GPU can run the rung's arithmetic and check
it (notebook 12):

* the **fragment layouts** of ``mma.m16n8k16`` (PTX ISA, "Matrix fragments for
  mma.m16n8k16"): which of the warp's 32 lanes holds which elements of ``A`` (16 x 16),
  ``B`` (16 x 8) and ``C``/``D`` (16 x 8), :func:`a_fragment`, :func:`b_fragment`,
  :func:`c_fragment` (the library's own table,
  :func:`numba_sc.dataflows.tensor_cores.c_layout_reference`);
* :func:`mma_m16n8k16`, the instruction: the warp's fragments in, ``D``'s fragments out;
* :func:`ldmatrix_x4`, the shared-memory load that fills the fragments, and the
  addresses ``mma.cu``'s lanes give it (:func:`a_addresses`, :func:`b_addresses`);
  :func:`row_conflicts`, the shared-memory bank conflicts of its rows for a row pitch;
* :func:`warp_tile`, ``mma.cu``'s ``implicit_mma_m<MI>n<NI>``, step by step;
* :func:`implicit_gemm_v4_model`, v4's tile loop for a whole layer (the plan's order,
  the tile masks, the chunks in shared memory, the warps), its products through the
  functions above.

Every lane of a fragment is one row of an array: a fragment of ``A`` is ``(32, 8)``,
lane ``l``'s eight fp16 values, in the order of its four 32-bit registers (two values
each). With ``g = l // 4`` (the lane's *group*) and ``t = l % 4`` (its place in the
group), lane ``l`` holds rows ``g`` and ``g + 8`` and columns around ``2 t``.

The model's sums are float32 in NumPy's order; the tensor cores add in an order (and
with internal roundings) of their own, which NVIDIA does not document, so the model
equals the GPU to float32 rounding, not bit for bit, and exactly where every sum is
exact (small integers). The word-wide global loads of v4 (``a_vec``, ``b_vec``) move
the same bits as single values would, so the model leaves them out.
"""
from __future__ import annotations

import numpy as np

from ..core.conventions import MASK_BITS
from ..dataflows.implicit_gemm import ImplicitPlan, check_plan
from ..dataflows.implicit_shapes import TensorTiles, cdiv, check_inputs, check_rows, tensor_tiles, v4_shape
from ..dataflows.tensor_cores import MMA_SHAPES, c_layout_reference

__all__ = ["LANES", "a_addresses", "a_fragment", "b_addresses", "b_fragment", "c_fragment", "fragments",
           "implicit_gemm_v4_model", "ldmatrix_x4", "mma_m16n8k16", "row_conflicts", "unfragment", "warp_tile"]

LANES = np.arange(32)


# ----------------------------------------------------------------- the fragments
def a_fragment() -> np.ndarray:
    """int (32, 8, 2): the (row, column) of ``A`` (16 x 16, fp16) that value ``e`` of lane
    ``l`` holds. Values ``2q`` and ``2q + 1`` are register ``a_q``: two neighbours of a row.

    ``a0``: row g, columns 2t, 2t+1;  ``a1``: row g+8, the same columns;
    ``a2``: row g, columns 2t+8, 2t+9;  ``a3``: row g+8, the same columns.
    """
    lane, e = np.meshgrid(LANES, np.arange(8), indexing="ij")
    g, t, q = lane // 4, lane % 4, e // 2  # q: the register
    return np.stack([g + 8 * (q % 2), 2 * t + e % 2 + 8 * (q // 2)], axis=-1)


def b_fragment() -> np.ndarray:
    """int (32, 4, 2): the (row, column) of ``B`` (16 x 8, fp16) that value ``e`` of lane
    ``l`` holds. Values ``2q`` and ``2q + 1`` are register ``b_q``: two neighbours down a
    column (the ``.col`` of ``mma...row.col``).

    ``b0``: rows 2t, 2t+1 of column g;  ``b1``: rows 2t+8, 2t+9 of column g.
    """
    lane, e = np.meshgrid(LANES, np.arange(4), indexing="ij")
    g, t, q = lane // 4, lane % 4, e // 2
    return np.stack([2 * t + e % 2 + 8 * q, g], axis=-1)


def c_fragment() -> np.ndarray:
    """int (32, 4, 2): the (row, column) of ``C`` and ``D`` (16 x 8, fp32) that float ``r``
    of lane ``l`` holds: ``c0, c1``: row g, columns 2t, 2t+1; ``c2, c3``: row g+8, the
    same columns. The library's table (:func:`numba_sc.dataflows.tensor_cores.c_layout_reference`,
    whose ``c_row``/``c_col`` place v4's results)."""
    return c_layout_reference()


def fragments(matrix, layout) -> np.ndarray:
    """The values each lane holds of ``matrix`` under ``layout`` (:func:`a_fragment` ...):
    ``(32, values)``, in ``matrix``'s dtype."""
    matrix = np.asarray(matrix)
    return matrix[layout[..., 0], layout[..., 1]]


def unfragment(values, layout, shape) -> np.ndarray:
    """The matrix of ``shape`` whose fragments under ``layout`` are ``values`` (32, n):
    every element put back where its lane's layout says; raises if an element is missing."""
    values = np.asarray(values)
    out = np.zeros(shape, values.dtype)
    seen = np.zeros(shape, int)
    np.add.at(seen, (layout[..., 0].ravel(), layout[..., 1].ravel()), 1)
    if not (seen == 1).all():
        raise ValueError(f"layout covers the {shape} matrix {seen.min()}..{seen.max()} times an element; "
                         "a fragment layout holds every element exactly once")
    out[layout[..., 0], layout[..., 1]] = values
    return out


# ------------------------------------------------------------------ the instruction
def mma_m16n8k16(a, b, c) -> np.ndarray:
    """``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32``: ``D = A B + C``, fragments
    in and out. ``a`` (32, 8) and ``b`` (32, 4) fp16, ``c`` (32, 4) float32; returns
    ``d`` (32, 4) float32.

    No lane holds a whole row of ``A`` or column of ``B``: the instruction is the warp's,
    and the tensor core reads every lane's registers. So the model first puts ``A`` and
    ``B`` together from all 32 lanes, then gives each lane its four results: result ``r``
    of lane ``l`` is row ``i`` of ``A`` times column ``j`` of ``B``, plus ``c[l, r]``, where
    ``(i, j)`` is its place in the ``C`` layout. The fp16 products are exact in float32
    (11 by 11 significant bits); the sum is float32.
    """
    a, b, c = np.asarray(a), np.asarray(b), np.asarray(c)
    if a.shape != (32, 8) or b.shape != (32, 4) or c.shape != (32, 4):
        raise ValueError(f"fragments must be a (32, 8), b (32, 4), c (32, 4): one row a lane; got "
                         f"{a.shape}, {b.shape}, {c.shape}")
    if a.dtype != np.float16 or b.dtype != np.float16 or c.dtype != np.float32:
        raise TypeError(f"mma.m16n8k16 here multiplies fp16 into fp32: a and b float16, c float32; got "
                        f"{a.dtype}, {b.dtype}, {c.dtype}")
    A = unfragment(a, a_fragment(), (16, 16)).astype(np.float32)
    B = unfragment(b, b_fragment(), (16, 8)).astype(np.float32)
    where = c_fragment()
    rows, cols = where[..., 0], where[..., 1]  # (32, 4) each: each result's place
    products = A[rows] * B.T[cols]  # (32, 4, 16): row i of A times column j of B, element by element
    return (c + products.sum(axis=-1, dtype=np.float32)).astype(np.float32)


# ---------------------------------------------------------------------- ldmatrix
def ldmatrix_x4(shared, rows, cols, trans: bool = False) -> np.ndarray:
    """``ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16``: four 8 x 8 fp16 matrices from
    shared memory into every lane's four registers. Returns (32, 4, 2): lane ``l``'s
    register ``m``, two fp16 values.

    ``shared``: the shared tile as a 2-D fp16 array (row-major, its width the row pitch);
    ``rows``, ``cols``: int (32,), the address lane ``l`` gives, ``shared[rows[l],
    cols[l]]``: the start of row ``l % 8`` of matrix ``l // 8``, eight values (16 bytes,
    which must be 16-byte aligned). Afterwards lane ``l`` holds, in register ``m``, row
    ``l // 4`` of matrix ``m``, columns ``2 (l % 4)`` and ``2 (l % 4) + 1``; with ``trans``,
    the same of the matrix transposed: column ``l // 4``, rows ``2 (l % 4)`` and ``+ 1``.
    The lane that gives a row's address is not the lane that receives its values.
    """
    shared = np.asarray(shared)
    rows, cols = np.asarray(rows), np.asarray(cols)
    if shared.ndim != 2 or shared.dtype != np.float16:
        raise TypeError(f"shared must be a 2-D float16 array (the shared tile), got {shared.dtype} {shared.shape}")
    if rows.shape != (32,) or cols.shape != (32,):
        raise ValueError(f"rows and cols must give one address a lane, (32,); got {rows.shape}, {cols.shape}")
    if shared.shape[1] % 8 or (cols % 8).any():
        bad = int(np.flatnonzero(cols % 8)[0]) if (cols % 8).any() else None
        raise ValueError("ldmatrix reads 16-byte aligned rows: the pitch and every column address must be a "
                         f"multiple of 8 fp16 values (pitch {shared.shape[1]}"
                         + (f", lane {bad} gives column {int(cols[bad])})" if bad is not None else ")"))
    if (rows < 0).any() or (rows >= shared.shape[0]).any() or (cols < 0).any() or (cols + 8 > shared.shape[1]).any():
        raise ValueError(f"an address falls outside the {shared.shape} tile (rows {rows.min()}..{rows.max()}, "
                         f"columns {cols.min()}..{cols.max() + 7})")
    mats = shared[rows[:, None], cols[:, None] + np.arange(8)].reshape(4, 8, 8)  # [matrix][row][column]
    if trans:
        mats = mats.transpose(0, 2, 1)
    g, t = LANES // 4, LANES % 4
    # out[l, m, h] = mats[m, g(l), 2 t(l) + h]
    return mats[:, g[:, None], 2 * t[:, None] + np.arange(2)].transpose(1, 0, 2)


def a_addresses(row0: int, ks: int):
    """The address each lane gives ``ldmatrix_x4`` for ``A`` in ``mma.cu`` (rows, columns):
    lanes 0-15 point at rows ``row0 .. row0 + 15``, channels ``16 ks .. 16 ks + 7``;
    lanes 16-31 at the same rows, the next 8 channels. The four matrices then come back
    as registers ``a0 .. a3`` of the mma."""
    return row0 + (LANES & 15), ks * 16 + (LANES >> 4) * 8


def b_addresses(col0: int, ks: int):
    """The address each lane gives ``ldmatrix_x4(..., trans=True)`` for ``B`` in ``mma.cu``:
    lanes 0-7 point at channels ``16 ks + 0..7``, lanes 8-15 at ``16 ks + 8..15`` (both at
    columns ``col0 ..``), lanes 16-31 likewise at columns ``col0 + 8 ..``. Registers 0, 1
    are then ``b0, b1`` of the column tile at ``col0``; 2, 3 those of the tile at ``col0 + 8``."""
    return ks * 16 + (LANES & 7) + ((LANES >> 3) & 1) * 8, col0 + (LANES >> 4) * 8


def row_conflicts(pitch: int) -> int:
    """The shared-memory bank conflict of one 8 x 8 ``ldmatrix`` matrix whose rows are
    ``pitch`` fp16 values apart: the most rows that read one of the 32 four-byte banks
    (1: none, the eight 16-byte rows are read at once; 2: two passes; ...)."""
    if pitch % 8:
        raise ValueError(f"pitch must be a multiple of 8 fp16 values (16-byte aligned rows), got {pitch}")
    start = np.arange(8) * pitch * 2 // 4  # each row's first 4-byte word
    banks = (start[:, None] + np.arange(4)) % 32  # a row's 16 bytes: 4 banks
    return int(np.bincount(banks.ravel(), minlength=32).max())


# ------------------------------------------------------------ the warp's tile
def warp_tile(acc, a_tile, b_tile, row0: int, col0: int, k_steps: int) -> np.ndarray:
    """``implicit_mma_m<MI>n<NI>`` of ``mma.cu``: the warp adds ``A[row0 : row0 + 16 MI]``
    times ``B[:, col0 : col0 + 8 NI]`` over ``16 k_steps`` channels onto ``acc``.

    ``acc``: float32 (32, MI, NI, 4), each lane's results of each 16 x 8 tile, in the ``C``
    layout (v4 keeps them as ``acc[(i NI + j) 4 + r]``); ``a_tile``, ``b_tile``: the
    shared tiles, 2-D fp16 arrays with padded rows. Returns the new ``acc``. Per step of
    16 channels: one ``ldmatrix.x4`` per 16-row tile of ``A``, one ``ldmatrix.x4.trans``
    per pair of 8-column tiles of ``B``, then ``MI x NI`` mma, as in the C++.
    """
    acc = np.array(acc, dtype=np.float32)
    _, mi, ni, _ = acc.shape
    if (mi, ni) not in MMA_SHAPES:
        raise ValueError(f"(MI, NI) must be one of {MMA_SHAPES} (the warp tiles mma.cu defines), got {(mi, ni)}")
    for ks in range(k_steps):
        a = [ldmatrix_x4(a_tile, *a_addresses(row0 + 16 * i, ks)).reshape(32, 8) for i in range(mi)]
        b = []
        for j in range(0, ni, 2):
            r = ldmatrix_x4(b_tile, *b_addresses(col0 + 8 * j, ks), trans=True)
            b += [r[:, 0:2].reshape(32, 4), r[:, 2:4].reshape(32, 4)]
        for i in range(mi):
            for j in range(ni):
                acc[:, i, j] = mma_m16n8k16(a[i], b[j], acc[:, i, j])
    return acc


# ------------------------------------------------------------- v4's whole layer
def implicit_gemm_v4_model(features, weight, table, plan: ImplicitPlan, init=None,
                           tiles: TensorTiles | None = None) -> np.ndarray:
    """v4's tile loop in NumPy (host arrays): the output of
    :func:`numba_sc.dataflows.implicit_gemm.implicit_gemm_v4` on ``plan``, fp16.

    For every block (a tile of ``plan.tile_m`` row slots in the plan's order, a tile of
    ``tiles.tile_n`` output channels) and every offset of each split whose bit is set in
    the tile's mask: the neighbour rows through that offset, ``tile_k`` channels at a
    time, are copied into a shared tile (zeros where there is no neighbour, ``A``), the
    matching piece of ``W[k]`` into another (``B``), each padded by 8 values a row as
    v4's are, and every warp of the block (:func:`numba_sc.dataflows.implicit_shapes.v4_shape`)
    runs :func:`warp_tile` on them. The epilogue adds ``init`` (or, after the first
    split, the running float32 sum) and rounds once to fp16, as v4 and
    :func:`numba_sc.dataflows.implicit_shapes.run_splits` do.
    """
    K, n_out, c_in, c_out = check_inputs(features, weight, table, init, backend="reference")
    check_plan(plan, K, n_out)
    features, weight, table = np.asarray(features), np.asarray(weight), np.asarray(table)
    if features.dtype != np.float16:
        raise TypeError(f"the tensor cores multiply fp16; features are {features.dtype}: pass "
                        "features.astype(np.float16) and weight.astype(np.float16)")
    check_rows(table, features.shape[0])
    plan = plan.host()
    tiles = tiles or tensor_tiles(c_in, c_out)
    tile_m, tile_n, tile_k = plan.tile_m, tiles.tile_n, tiles.tile_k
    if tile_k % 16:
        raise ValueError(f"tiles.tile_k must be a multiple of 16 (one mma step), got {tile_k}")
    warps_m, warps_n, mi, ni = v4_shape(tile_m, tile_n)
    c_in_pad = cdiv(c_in, tile_k) * tile_k  # zero channels past the last, as v4's loads give
    f = np.zeros((features.shape[0] + 1, c_in_pad), np.float16)  # + a row of zeros for "no neighbour"
    f[:-1, :c_in] = features
    none = features.shape[0]
    w = np.zeros((K, c_in_pad, cdiv(c_out, tile_n) * tile_n), np.float16)
    w[:, :c_in, :c_out] = weight
    running = None if init is None else np.asarray(init).astype(np.float32)
    for s, (k0, k1) in enumerate(plan.bounds):
        order, masks = plan.order[s], plan.tile_masks[s]
        total = np.zeros((n_out, c_out), np.float32)
        for tm in range(plan.n_tiles):
            slots = np.arange(tm * tile_m, (tm + 1) * tile_m)
            outs = np.where(slots < n_out, order[np.minimum(slots, n_out - 1)], -1)
            for n0 in range(0, c_out, tile_n):
                acc = np.zeros((warps_m * warps_n, 32, mi, ni, 4), np.float32)
                for k in range(k0, k1):
                    if not (int(masks[k // MASK_BITS, tm]) >> (k % MASK_BITS)) & 1:
                        continue  # no row of this tile has a pair through k: the block skips it
                    src = np.where(outs >= 0, table[k, np.maximum(outs, 0)], -1)
                    src = np.where(src >= 0, src, none)
                    for c0 in range(0, c_in_pad, tile_k):
                        a_s = np.zeros((tile_m, tile_k + 8), np.float16)  # +8: the padding of v4's rows
                        a_s[:, :tile_k] = f[src, c0:c0 + tile_k]
                        b_s = np.zeros((tile_k, tile_n + 8), np.float16)
                        b_s[:, :tile_n] = w[k, c0:c0 + tile_k, n0:n0 + tile_n]
                        for warp in range(warps_m * warps_n):
                            row0, col0 = (warp // warps_n) * 16 * mi, (warp % warps_n) * 8 * ni
                            acc[warp] = warp_tile(acc[warp], a_s, b_s, row0, col0, tile_k // 16)
                # the epilogue: lane l's result r of mma tile (i, j) is row c_row, column c_col of it
                where = c_fragment()
                for warp in range(warps_m * warps_n):
                    row0, col0 = (warp // warps_n) * 16 * mi, (warp % warps_n) * 8 * ni
                    for i in range(mi):
                        for j in range(ni):
                            slot = row0 + 16 * i + where[..., 0]  # (32, 4): within the tile
                            col = n0 + col0 + 8 * j + where[..., 1]
                            keep = (outs[slot] >= 0) & (col < c_out)
                            total[outs[slot][keep], col[keep]] = acc[warp, :, i, j][keep]
        running = total if running is None else running + total
    return running.astype(np.float16)

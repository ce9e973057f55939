"""The conventions every stage shares: coordinates, packed keys, kernel offsets.

This is the one place that defines them; every stage imports from here.

Coordinates
    int32, shape ``(N, 3)`` for one cloud (x, y, z) or ``(N, 4)`` with the batch
    index in column 0 (b, x, y, z). Everything sorted is sorted lexicographically
    on (batch, x, y, z).

Packed keys
    A coordinate is packed into one signed 64-bit integer so that the library sort
    (NumPy / CuPy) can sort coordinates and a binary search can compare them with a
    single integer comparison::

        bit  63   62 ........ 54   53 ....... 36   35 ....... 18   17 ........ 0
             0    batch (9 bits)   x + 2^17       y + 2^17        z + 2^17

    Each spatial field holds the coordinate plus a bias of 2^17, so the field is
    never negative and ``-131072 <= x <= 131071``. Because the fields are laid out
    from most to least significant in (batch, x, y, z) order, integer order of keys
    *is* lexicographic order of coordinates.

    The second property is what lets Minuet build a query segment on the fly
    (paper Section 5.1.1): for a kernel offset ``d = (dx, dy, dz)``::

        key(q + d) == key(q) + key_delta(d),   key_delta(d) = dx*2^36 + dy*2^18 + dz

    as long as every field of ``q + d`` stays inside its range (no carry from one
    field into the next). A carry would silently turn a query into a *different*
    coordinate, possibly one of another cloud in the batch, so :func:`pack_keys`
    checks the range *including the kernel's reach* and raises instead of wrapping.

    Worked example: ``q = (0, 1, 2)`` packs to ``(2^17 << 36) + ((2^17 + 1) << 18)
    + (2^17 + 2)``; adding ``key_delta((0, 0, -1)) = -1`` gives the key of
    ``(0, 1, 1)``.

Kernel offsets
    Per axis, an odd size K gives ``-(K-1)/2 .. (K-1)/2`` and an even K gives
    ``-K/2+1 .. K/2``; the values are multiplied by the dilation and the input
    tensor stride and listed lexicographically in (dx, dy, dz). Anisotropic kernels
    such as ``(1, 3, 1)`` are allowed. Weights are ``(K, C_in, C_out)`` in this order.

The rule
    Output ``q`` receives input ``p`` through offset ``delta_k`` when
    ``p = q + delta_k``: ``out[q] = sum_k in[q + delta_k] @ W[k]``.

What the forward search (stage 6) leaves for the metadata (stage 7)
    Per point, a bit mask of the offsets it has a pair through: bit ``k % 32`` of
    word ``k // 32`` (``MASK_BITS``, :func:`mask_words`); and the pairs of each
    offset counted per *chunk* of :func:`chunk_size` consecutive outputs, the
    outputs one metadata block handles (``ITEMS_PER_THREAD`` a thread). Both
    stages read these layouts from here, so the search never imports the stage
    after it.
"""
from __future__ import annotations

from typing import Any, Tuple, Union

import numpy as np
from numba import cuda

from .device import array_module, is_cupy, simulating
from .launch import launch

# ---------------------------------------------------------------- key layout
COORD_BITS = 18
BATCH_BITS = 9
COORD_BIAS = 1 << (COORD_BITS - 1)  # 131072
COORD_MIN = -COORD_BIAS  # -131072
COORD_MAX = COORD_BIAS - 1  # 131071
BATCH_MAX = (1 << BATCH_BITS) - 1  # 511
SHIFT_Z = 0
SHIFT_Y = COORD_BITS  # 18
SHIFT_X = 2 * COORD_BITS  # 36
SHIFT_B = 3 * COORD_BITS  # 54
FIELD_MASK = (1 << COORD_BITS) - 1


# ------------------------------------ masks and chunks (stages 6 and 7 share them)
MASK_BITS = 32  # offsets per word of a point's mask


def mask_words(K: int) -> int:
    """Words of a point's mask for K offsets: ceil(K / MASK_BITS)."""
    return -(-K // MASK_BITS)


METADATA_THREADS = 128  # threads per metadata block on the GPU: chunks of 1024 outputs
# Under the simulator every CUDA thread is a Python thread: 16 threads a block (for the
# metadata, chunks of 128) keep the tests fast and put chunk boundaries inside clouds of
# a few hundred points. The forward search uses it too.
SIMULATOR_THREADS = 16
# Tried on the H100: 32 outputs per thread (fewer blocks, so fewer of the one-thread
# scans) made the tables kernel more than twice as slow on 1M points: a warp's
# runs then lie 128 bytes apart and every load instruction touches 32 cache lines.
ITEMS_PER_THREAD = 8


def metadata_threads() -> int:
    """Threads per block of the metadata kernels: 128 on the GPU, 16 simulated."""
    return SIMULATOR_THREADS if simulating() else METADATA_THREADS


def chunk_size(threads: int | None = None) -> int:
    """Outputs per chunk for blocks of ``threads`` threads (default: this machine's)."""
    return (threads or metadata_threads()) * ITEMS_PER_THREAD


# The types of the public signatures: an array is a NumPy or a CuPy array (CuPy is
# optional, so it is named here, not imported); a size is one int or one per axis.
Array = Any  # numpy.ndarray | cupy.ndarray
IntOr3 = Union[int, Tuple[int, int, int]]


# ------------------------------------------------------------ argument checks
FEATURE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))  # what features (and weights) may be on the GPU
# The oracle's dtype: float64 runs on backend="reference" only (NumPy), computing in
# float64 throughout, as the truth that the float32/float16 paths are measured against
# (numba_sc.check_gradients). The kernels have no float64 path.
ORACLE_DTYPE = np.dtype(np.float64)
REFERENCE_DTYPES = FEATURE_DTYPES + (ORACLE_DTYPE,)


def compute_dtype(dtype) -> np.dtype:
    """The dtype a reference computes in for features of ``dtype``: float32 for float32 and
    float16 (half precision is widened, as the kernels do), float64 for float64 (the
    oracle: no float32 step anywhere on its path). The one place this rule is written."""
    return ORACLE_DTYPE if np.dtype(dtype) == ORACLE_DTYPE else np.dtype(np.float32)


def check_backend_dtype(dtype, backend: str, name: str = "features"):
    """float64 runs on ``backend="reference"`` only: refuse it, up front, anywhere else."""
    if np.dtype(dtype) == ORACLE_DTYPE and backend != "reference":
        raise TypeError(f"{name} are float64, which runs only on backend='reference' (the float64 oracle, "
                        f"see numba_sc.check_gradients), not on backend={backend!r}: pass "
                        "backend='reference', or convert to float32 (model.float(), x.to(np.float32))")


def is_array(a) -> bool:
    """A NumPy or CuPy array (or anything with a shape and a dtype)."""
    return hasattr(a, "shape") and hasattr(a, "dtype")


def check_features(features, name: str = "features", backend: str | None = None):
    """``features`` (N, C) float32 or float16, or float64 (the oracle's, reference backend
    only): the rows of a layer's input. ``backend``: the resolved backend, when known."""
    if not is_array(features):
        raise TypeError(f"{name} must be a NumPy or CuPy array, got {type(features).__name__}")
    if features.ndim != 2:
        raise ValueError(f"{name} must have shape (N, C), one row per point, got {tuple(features.shape)}")
    if np.dtype(features.dtype) not in REFERENCE_DTYPES:
        raise TypeError(f"{name} must be float32 or float16 (or float64 on backend='reference'), got "
                        f"{features.dtype}; convert with {name}.astype(np.float32)")
    if backend is not None:
        check_backend_dtype(features.dtype, backend, name)


def check_weight(weight, K: int, c_in: int, dtype, why: str = "", where: str = ""):
    """A convolution's ``weight``: (K, C_in, C_out), one (C_in, C_out) matrix per offset, of
    the features' ``dtype``. ``why`` says where K comes from; ``where`` names the layer."""
    if not is_array(weight):
        raise TypeError(f"{where}weight must be a NumPy or CuPy array, got {type(weight).__name__}")
    if weight.ndim != 3 or weight.shape[0] != K or weight.shape[1] != c_in:
        raise ValueError(f"{where}weight must have shape (K, C_in, C_out) = ({K}, {c_in}, C_out){why}, got "
                         f"{tuple(weight.shape)}")
    if np.dtype(weight.dtype) != np.dtype(dtype):
        raise TypeError(f"{where}weight is {weight.dtype} but features are {np.dtype(dtype)}: they must match, "
                        f"e.g. weight.astype(np.{np.dtype(dtype).name})")


def check_init(init, n_out: int, c_out: int, dtype=None):
    """What a layer's outputs start from (the centre product): None, or (n_out, C_out) floats
    (of ``dtype`` when given)."""
    if init is None:
        return
    if not is_array(init):
        raise TypeError(f"init must be a NumPy or CuPy array or None, got {type(init).__name__}")
    if tuple(init.shape) != (n_out, c_out):
        raise ValueError(f"init must have shape (n_out, C_out) = ({n_out}, {c_out}), one row per output, "
                         f"got {tuple(init.shape)}")
    if dtype is not None and np.dtype(init.dtype) != np.dtype(dtype):
        raise TypeError(f"init is {init.dtype} but features are {np.dtype(dtype)}: convert init, e.g. "
                        f"init.astype(np.{np.dtype(dtype).name})")
    if not np.issubdtype(np.dtype(init.dtype), np.floating):
        raise TypeError(f"init must be a float array, got {init.dtype}")


def check_finite_points(points, name: str = "points"):
    """Refuse float ``points`` (N, D) holding NaN or inf, naming the first bad row and the fix.

    Every entry point that takes float points (voxelization, the augmentations, the
    checkerboard split, the scan loader) calls this one check: a NaN point has no voxel
    and no square, so anything done with it is a guess; dropping it quietly would lose
    data the caller may not know was damaged."""
    bad = ~np.isfinite(points).all(axis=1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"{name} has {int(bad.sum())} rows with NaN or inf (first: row {i}, {points[i].tolist()}); "
            "drop them first, e.g. points[np.isfinite(points).all(axis=1)]")


def is_int(value) -> bool:
    """A whole number given as one: a Python or NumPy int, not a bool (``True`` is an
    int to Python, never a count here), not a float (``2.0``), not an array. The test
    behind every count, index, seed and size argument."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def positive_int(value, name: str) -> int:
    """A size argument (channels, features): a positive int, not a float, a bool or an array."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def whole_number(value, name: str, minimum: int = 0) -> int:
    """A count, an index or a seed: an int >= ``minimum``. A bool, a float (even 2.0) or an
    array is refused rather than read as a number: each is a guess at what was meant."""
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum} (an int, not a bool or a float), "
                         f"got {value!r}")
    return int(value)


def as_int_tuple(value, name: str, *, minimum: int = 1) -> tuple[int, int, int]:
    """``3`` -> ``(3, 3, 3)``; ``(1, 3, 1)`` stays; anything else raises."""
    if is_int(value):
        vals = (int(value),) * 3
    else:
        try:
            vals = tuple(int(v) for v in value)
        except TypeError:
            raise TypeError(f"{name} must be an int or a sequence of 3 ints, got {value!r}") from None
        if len(vals) != 3:
            raise ValueError(f"{name} must be an int or a sequence of 3 ints, got {value!r}")
        if not all(is_int(v) for v in value):
            # 3.0 and True are not sizes: a float or a bool here is a mistake somewhere upstream
            raise TypeError(f"{name} must be an int or a sequence of 3 ints, got {value!r}")
    if any(v < minimum for v in vals):
        raise ValueError(f"{name} must be >= {minimum} on every axis, got {value!r}")
    return vals


def validate_coords(coords, name: str = "coords", check_range: bool = True) -> np.ndarray:
    """Check an integer coordinate array and return it as int32 (same array kind).

    Accepts any integer dtype whose values fit the packable range; floats are
    refused (quantize them with :func:`numba_sc.voxelize` first). With
    ``check_range=False`` only the shape and dtype are checked: for device arrays
    whose range the pack kernel checks anyway (per-axis min/max reductions on the
    GPU cost milliseconds).
    """
    if (not check_range and is_cupy(coords) and coords.dtype == np.int32 and coords.ndim == 2
            and coords.shape[1] in (3, 4) and coords.shape[0] > 0):
        return coords  # what every stage hands over on the GPU: nothing to check or convert
    xp = array_module(coords)
    if not hasattr(coords, "dtype") or not hasattr(coords, "shape"):
        raise TypeError(f"{name} must be a NumPy or CuPy array, got {type(coords).__name__}")
    if coords.ndim != 2 or coords.shape[1] not in (3, 4):
        raise ValueError(
            f"{name} must have shape (N, 3) or (N, 4) with the batch index in column 0, "
            f"got {tuple(coords.shape)}")
    if not np.issubdtype(np.dtype(coords.dtype), np.integer):
        raise TypeError(
            f"{name} must be an integer array (int32), got dtype {coords.dtype}; "
            "quantize float points with numba_sc.voxelize first")
    if coords.shape[0] == 0:
        raise ValueError(f"{name} is empty: a sparse tensor needs at least one coordinate")
    info = np.iinfo(np.dtype(coords.dtype))
    if not check_range and info.min >= np.iinfo(np.int32).min and info.max <= np.iinfo(np.int32).max:
        return coords.astype(xp.int32, copy=False)  # fits int32: the packing checks the range
    # Checked in the caller's own dtype, before any cast: uint32 4294967295 would
    # otherwise become -1 and int64 2**32 + 5 become 5, silently other voxels.
    lo = xp.min(coords, axis=0)
    hi = xp.max(coords, axis=0)
    lo, hi = (np.asarray(lo.get() if is_cupy(lo) else lo), np.asarray(hi.get() if is_cupy(hi) else hi))
    if coords.shape[1] == 4 and (lo[0] < 0 or hi[0] > BATCH_MAX):
        raise ValueError(
            f"{name}: batch indices (column 0) must lie in 0..{BATCH_MAX}, got {lo[0]}..{hi[0]}")
    s = coords.shape[1] - 3
    if lo[s:].min() < COORD_MIN or hi[s:].max() > COORD_MAX:
        raise ValueError(
            f"{name}: spatial coordinates must lie in the packable range {COORD_MIN}..{COORD_MAX} of "
            f"64-bit keys, got {lo[s:].min()}..{hi[s:].max()}; use a larger voxel size or "
            "re-centre the cloud")
    return coords.astype(xp.int32, copy=False)


# ------------------------------------------------------------------- packing
def check_packable(lo, hi, reach_lo=(0, 0, 0), reach_hi=(0, 0, 0), name="coords"):
    """Raise unless ``[lo + reach_lo, hi + reach_hi]`` fits every spatial field.

    ``lo``/``hi`` are per-axis (x, y, z) extremes of the coordinates, ``reach_*``
    the most negative / most positive kernel offset per axis (all zero when only
    the coordinates themselves are packed).
    """
    for axis, (l, h, rl, rh) in enumerate(zip(lo, hi, reach_lo, reach_hi)):
        if int(l) + int(rl) < COORD_MIN or int(h) + int(rh) > COORD_MAX:
            raise ValueError(
                f"{name}: axis {'xyz'[axis]} spans {int(l)}..{int(h)}; with the kernel's reach "
                f"{int(rl)}..{int(rh)} this leaves the packable range {COORD_MIN}..{COORD_MAX} "
                "(the key would wrap into the neighbouring field). Use a larger voxel size or "
                "re-centre the cloud")


def pack_keys(coords, reach_lo=(0, 0, 0), reach_hi=(0, 0, 0), name="coords"):
    """Pack int coordinates (N, 3) or (N, 4) into int64 keys (N,).

    NumPy arrays are packed with vectorized NumPy; device arrays (CuPy, or NumPy
    under the simulator when called from a kernel path) with :func:`pack_keys_device`.
    Raises if a coordinate, moved by any kernel offset in ``[reach_lo, reach_hi]``,
    would leave its field.
    """
    if is_cupy(coords):
        return pack_keys_device(coords, reach_lo, reach_hi, name)
    return pack_keys_reference(coords, reach_lo, reach_hi, name)


def pack_keys_reference(coords, reach_lo=(0, 0, 0), reach_hi=(0, 0, 0), name="coords"):
    """NumPy packing: the reference of :func:`pack_kernel` (host arrays)."""
    coords = validate_coords(coords, name)
    xp = array_module(coords)
    s = coords.shape[1] - 3
    lo = xp.min(coords[:, s:], axis=0)
    hi = xp.max(coords[:, s:], axis=0)
    check_packable(lo, hi, reach_lo, reach_hi, name)
    c = coords.astype(xp.int64)
    key = ((c[:, s] + COORD_BIAS) << SHIFT_X) | ((c[:, s + 1] + COORD_BIAS) << SHIFT_Y) | (
        c[:, s + 2] + COORD_BIAS)
    if s:
        key |= c[:, 0] << SHIFT_B
    return key


def unpack_keys(keys, with_batch: bool):
    """Inverse of :func:`pack_keys`: int64 keys (N,) -> int32 coordinates."""
    xp = array_module(keys)
    k = keys.astype(xp.int64, copy=False)
    cols = [((k >> SHIFT_X) & FIELD_MASK) - COORD_BIAS,
            ((k >> SHIFT_Y) & FIELD_MASK) - COORD_BIAS,
            (k & FIELD_MASK) - COORD_BIAS]
    if with_batch:
        cols.insert(0, k >> SHIFT_B)
    return xp.stack(cols, axis=1).astype(xp.int32)


def key_delta(offsets):
    """Signed int64 key difference of each offset (K, 3): ``dx<<36 + dy<<18 + dz``.

    Sorted offsets give sorted deltas (the same lexicographic argument as for keys).
    """
    d = np.asarray(offsets, dtype=np.int64)
    return d[:, 0] * (1 << SHIFT_X) + d[:, 1] * (1 << SHIFT_Y) + d[:, 2]


# The same packing as a device function, for kernels. Kept next to the NumPy
# version so that the two can never drift apart; tests check they agree.
@cuda.jit(device=True, inline=True)
def pack_key_device(b, x, y, z):
    # Widen first: an int32 shifted left by 54 would overflow (on the device and,
    # with NumPy scalars, under the simulator too).
    b, x, y, z = np.int64(b), np.int64(x), np.int64(y), np.int64(z)
    return ((b << SHIFT_B) | ((x + COORD_BIAS) << SHIFT_X)
            | ((y + COORD_BIAS) << SHIFT_Y) | (z + COORD_BIAS))


@cuda.jit(device=True, inline=True)
def unpack_field_device(key, shift):
    return ((key >> shift) & FIELD_MASK) - COORD_BIAS


# ------------------------------------------------------------- kernel offsets
def axis_offsets(k: int) -> np.ndarray:
    """Offsets of one axis: odd k -> -(k-1)/2..(k-1)/2, even k -> -k/2+1..k/2."""
    if k % 2:
        return np.arange(-(k - 1) // 2, (k - 1) // 2 + 1)
    return np.arange(-k // 2 + 1, k // 2 + 1)


def kernel_offsets(kernel_size=3, dilation=1, tensor_stride=1) -> np.ndarray:
    """The weight offsets of a kernel, int32 (K, 3), in lexicographic (dx, dy, dz) order.

    >>> kernel_offsets(2).tolist()[:3]
    [[0, 0, 0], [0, 0, 1], [0, 1, 0]]
    >>> kernel_offsets((1, 3, 1)).tolist()
    [[0, -1, 0], [0, 0, 0], [0, 1, 0]]
    """
    ks = as_int_tuple(kernel_size, "kernel_size")
    dil = as_int_tuple(dilation, "dilation")
    ts = as_int_tuple(tensor_stride, "tensor_stride")
    axes = [axis_offsets(k) * d * t for k, d, t in zip(ks, dil, ts)]
    grid = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, 3)
    # meshgrid with indexing="ij" already enumerates dx slowest, dz fastest, and
    # each axis is increasing, so the list is lexicographically sorted.
    return np.ascontiguousarray(grid, dtype=np.int32)


# ----------------------------------------------------- packing on the device
@cuda.jit(device=True, inline=True)
def fits_device(b, x, y, z, rlx, rly, rlz, rhx, rhy, rhz):
    """True when (b, x, y, z), moved by any offset in [reach_lo, reach_hi], stays packable."""
    return (0 <= b <= BATCH_MAX
            and COORD_MIN <= x + rlx and x + rhx <= COORD_MAX
            and COORD_MIN <= y + rly and y + rhy <= COORD_MAX
            and COORD_MIN <= z + rlz and z + rhz <= COORD_MAX)


@cuda.jit(device=True, inline=True)
def row_key_device(coords, s, i):
    """Key of row i of an (N, 3) (s = 0) or (N, 4) (s = 1) coordinate array."""
    b = np.int64(coords[i, 0]) if s == 1 else np.int64(0)
    return pack_key_device(b, coords[i, s], coords[i, s + 1], coords[i, s + 2])


FLAG_RANGE = 0  # flags[FLAG_RANGE] = 1: a coordinate (plus the kernel's reach) leaves a field
FLAG_UNSORTED = 1  # flags[FLAG_UNSORTED] = 1: some key is <= the key before it


@cuda.jit
def pack_kernel(coords, s, rlx, rly, rlz, rhx, rhy, rhz, keys, flags):
    """One thread per coordinate: its key, and two flags about the whole array.

    ``flags[FLAG_RANGE] = 1`` if some coordinate (plus reach) leaves a field:
    checking inside the kernel costs one comparison per field; the alternative,
    per-axis min/max reductions before packing, costs several library launches
    and host round trips (measured: milliseconds on an H100 for 94k voxels).

    ``flags[FLAG_UNSORTED] = 1`` if some key is not larger than the key of the
    row before it. When the flag stays 0 the array is sorted *and* unique, and
    the Map step needs no sort at all - the usual case, since
    :func:`numba_sc.voxelize`, :func:`numba_sc.output_coordinates` and
    :class:`numba_sc.SparseTensor` all hand out sorted coordinates. Each thread
    re-packs its left neighbour's row rather than waiting for that thread's key.

    Offending threads all store the same value 1 (a benign race, and no atomic
    contention when, say, every row is out of order).
    """
    i = cuda.grid(1)
    if i < coords.shape[0]:
        b = np.int64(coords[i, 0]) if s == 1 else np.int64(0)
        x = np.int64(coords[i, s])
        y = np.int64(coords[i, s + 1])
        z = np.int64(coords[i, s + 2])
        if fits_device(b, x, y, z, rlx, rly, rlz, rhx, rhy, rhz):
            key = pack_key_device(b, x, y, z)
        else:
            key = np.int64(0)
            flags[FLAG_RANGE] = 1
        keys[i] = key
        if i > 0 and row_key_device(coords, s, i - 1) >= key:
            flags[FLAG_UNSORTED] = 1


def launch_pack(coords, reach_lo, reach_hi, keys, flags):
    """Launch :func:`pack_kernel` on validated device coordinates; reads nothing back."""
    rl = [int(v) for v in reach_lo]
    rh = [int(v) for v in reach_hi]
    launch(pack_kernel, coords.shape[0], coords, coords.shape[1] - 3, *rl, *rh, keys, flags)


def pack_keys_device(coords, reach_lo=(0, 0, 0), reach_hi=(0, 0, 0), name="coords"):
    """Device version of :func:`pack_keys`: one kernel, one small read of its flags.

    Works on CuPy arrays on a GPU and on NumPy arrays under the simulator. On a
    flagged coordinate the host version re-checks the array to raise the precise
    error (the slow path runs only when the input is bad).
    """
    from .device import device_xp
    from .backend import to_device

    coords = validate_coords(coords, name, check_range=False)  # shape, dtype; range: in the kernel
    xp = device_xp()
    c = to_device(coords)
    keys = xp.empty(c.shape[0], dtype=np.int64)
    flags = xp.zeros(2, dtype=np.int64)
    launch_pack(c, reach_lo, reach_hi, keys, flags)
    if int(flags[FLAG_RANGE]):
        raise_range_error(c, reach_lo, reach_hi, name)
    return keys


def raise_range_error(coords, reach_lo, reach_hi, name):
    """After the pack kernel flagged a coordinate: re-check on the host to raise the
    precise error (this slow path only runs when the input is bad)."""
    from .backend import to_host

    pack_keys_reference(to_host(coords), reach_lo, reach_hi, name)  # raises with the details
    raise AssertionError("pack_kernel flagged a coordinate the host check accepts")

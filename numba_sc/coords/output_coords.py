"""Stage 2, output coordinates: where a strided convolution puts its outputs.

Paper Eq. 1: a convolution of stride ``s`` on a tensor of stride ``t`` keeps its
coordinates at the finest voxel scale and snaps them to multiples of ``s*t``::

    Q = { floor(p / (s*t)) * (s*t)  for p in P },  duplicates removed, sorted.

For ``s = 1`` this is ``Q = P``. Worked example, ``s*t = 2``, one axis shown::

    P:  -3  -2  -1   0   1   2   3
    Q:  -4  -2  -2   0   0   2   2   ->  unique  [-4, -2, 0, 2]

Note ``floor``, not truncation: ``-1`` goes to ``-2``, keeping every output cell
the same size on both sides of the origin. Strides may differ per axis; the batch
column is carried unchanged, so clouds of a batch never merge.

GPU pipeline: ``downsample_pack_kernel`` (one thread per input coordinate), then
the library sort of the keys and the unique passes of :mod:`numba_sc.core.unique`
(:func:`~numba_sc.core.unique.sort_unique_keys_cuda`: no order, no inverse: only the
keys are needed; each unique key is unpacked where it is written). Bytes for N
inputs: 12-16N read, 8N written, then the sort/unique traffic (~40N). One
device->host read, of the unique count (with the range flag): the outputs are the
first rows of an array of N, and the host cuts them by it.
That is v2 of a two-rung ladder (``python -m numba_sc ladder output_coords``); v1,
:func:`output_coords_v1`, de-duplicates as voxelization does, with two reads.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ..core import conventions as cv
from ..core.device import device_xp
from ..core.backend import filled, like, resolve_backend, to_device, to_host
from ..core.launch import THREADS, blocks_for, launch
from ..core.rungs import Ladder, Rung
from ..core.state import cached
from ..core.unique import sort_unique_cuda, sort_unique_keys_cuda, sort_unique_reference, unpack_kernel


def _total_stride(stride, tensor_stride):
    """``s * t`` per axis, int64 (3,)."""
    return np.array(cv.as_int_tuple(stride, "stride"), dtype=np.int64) * np.array(
        cv.as_int_tuple(tensor_stride, "tensor_stride"), dtype=np.int64)


def _prepare(coords, stride, tensor_stride):
    """Host-side checks: the coordinates, and the range of the snapped coordinates."""
    coords = cv.validate_coords(coords, "coords")
    st = _total_stride(stride, tensor_stride)
    # The snapped coordinates may step below the smallest input (floor), so check
    # their range, not only the input's.
    s = coords.shape[1] - 3
    lo = coords[:, s:].min(axis=0).astype(np.int64)
    hi = coords[:, s:].max(axis=0).astype(np.int64)
    cv.check_packable((lo // st) * st, (hi // st) * st, name="output coordinates")
    return coords, st


def output_coordinates_reference(coords, stride, tensor_stride=1):
    """NumPy reference of :func:`output_coordinates`."""
    coords, st = _prepare(np.asarray(coords), stride, tensor_stride)
    s = coords.shape[1] - 3
    q = coords.astype(np.int64)
    q[:, s:] = (q[:, s:] // st) * st  # NumPy's // is floor division, like Python's
    su = sort_unique_reference(cv.pack_keys(q.astype(np.int32)))
    return cv.unpack_keys(su.keys, with_batch=bool(s))


@cuda.jit
def downsample_pack_kernel(coords, s, sx, sy, sz, rlx, rly, rlz, rhx, rhy, rhz, keys, flags):
    """One thread per input coordinate: key of floor(c / stride) * stride.

    Numba's integer ``//`` follows Python: it floors, also for negatives. A
    coordinate whose snapped value (or batch index) leaves the packable range,
    or would leave it when moved by an offset in [reach_lo, reach_hi] (the
    kernel's reach, when a Map step searches these outputs; zero otherwise), sets
    ``flags[0]`` instead of wrapping; the host then explains the error.
    """
    i = cuda.grid(1)
    if i < coords.shape[0]:
        b = np.int64(coords[i, 0]) if s == 1 else np.int64(0)
        x = (np.int64(coords[i, s]) // sx) * sx
        y = (np.int64(coords[i, s + 1]) // sy) * sy
        z = (np.int64(coords[i, s + 2]) // sz) * sz
        if cv.fits_device(b, x, y, z, rlx, rly, rlz, rhx, rhy, rhz):
            keys[i] = cv.pack_key_device(b, x, y, z)
        else:
            keys[i] = 0
            flags[0] = 1


NO_REACH = ((0, 0, 0), (0, 0, 0))


def _pack(coords, stride, tensor_stride, report=None, reach=NO_REACH):
    """What both rungs start with: the snapped keys on the device, and the report
    ``[out of range, unique keys]`` whose first entry the pack kernel sets (zeroed
    int64 (2,); a caller may hand in a view of a larger one, read once for many).
    ``reach``: the (lo, hi) offsets a search will add to the outputs.
    Returns ``(coords on the device, batch column 0/1, keys, report)``."""
    # Shape and dtype here; the range inside the kernel (no min/max reductions).
    coords = cv.validate_coords(coords, "coords", check_range=False)
    sx, sy, sz = _strides(stride, tensor_stride)
    c = to_device(coords)
    n, s = c.shape[0], c.shape[1] - 3
    keys = device_xp().empty(n, dtype=np.int64)
    report = filled(2, np.int64, 0) if report is None else report
    launch(downsample_pack_kernel, n, c, s, sx, sy, sz, *reach[0], *reach[1], keys, report)
    return c, s, keys, report


def output_coords_v1(coords, stride, tensor_stride=1):
    """v1: Eq. 1 with voxelization's own de-duplication (:func:`~numba_sc.core.unique.sort_unique_cuda`).

    Pack, argsort, gather the keys in that order, mark and compact the runs (which
    also yields the order, the run starts and every input's output index, the
    things voxelization needs for its features), unpack. Two device->host reads:
    the range flag, then the unique count.
    """
    coords = cv.validate_coords(coords, "coords", check_range=False)
    sx, sy, sz = _strides(stride, tensor_stride)
    c = to_device(coords)
    n, s = c.shape[0], c.shape[1] - 3
    xp = device_xp()
    keys = xp.empty(n, dtype=np.int64)
    report = filled(2, np.int64, 0)
    downsample_pack_kernel[blocks_for(n), THREADS](c, s, sx, sy, sz, *NO_REACH[0], *NO_REACH[1], keys, report)
    if int(to_host(report)[0]):  # read 1
        _prepare(to_host(c), stride, tensor_stride)
    su = sort_unique_cuda(keys)  # read 2, inside: the unique count
    out = xp.empty((su.keys.shape[0], 3 + s), dtype=np.int32)
    unpack_kernel[blocks_for(out.shape[0]), THREADS](su.keys, s, out)
    return out


def output_coords_v2(coords, stride, tensor_stride=1):
    """v2 (the library's, as :func:`output_coordinates_cuda`): pack the snapped
    coordinates, sort and de-duplicate the keys alone, unpack.

    What changed from v1: a strided layer needs the unique keys and nothing else,
    so the library sorts the keys themselves (no argsort, no gather of the keys
    in the sorted order, no order, starts or inverse), and the range flag rides
    with the unique count in one two-number report: one device->host read
    instead of two. Each read is a host-device round trip that stalls the
    launch queue (``docs/performance.md``).

    What it bought on the SemanticKITTI scan at stride 2 is recorded in
    ``benchmarks/results/ladder_all_kitti.json``
    (``numba_sc.tools.lesson.bought("output_coords")``; host-bound, so the times
    include the host's waits; more in ``docs/performance.md``,
    "coords/output_coords.py").
    """
    pending = start_output_coords(coords, stride, tensor_stride)
    return finish_output_coords(pending, to_host(pending.report))  # the one read


class PendingCoords:
    """Output coordinates sorted and de-duplicated on the device, the count not yet
    read (:func:`start_output_coords`): ``outputs``' first rows."""

    __slots__ = ("coords", "outputs", "report", "stride", "tensor_stride")

    def __init__(self, coords, outputs, report, stride, tensor_stride):
        self.coords, self.outputs, self.report = coords, outputs, report
        self.stride, self.tensor_stride = stride, tensor_stride


def start_output_coords(coords, stride, tensor_stride=1, report=None) -> PendingCoords:
    """v2's first half: pack, sort, de-duplicate, nothing read. ``report``: an optional
    zeroed int64 (2,) view to count into, so that a caller making the coordinates of
    several layers reads all their counts at once (:mod:`numba_sc.nn.maps_up_front`)."""
    c, s, keys, report = _pack(coords, stride, tensor_stride, report)
    _, outputs = sort_unique_keys_cuda(keys, report, 1, s)
    return PendingCoords(c, outputs, report, stride, tensor_stride)


def start_output_keys(coords, stride, tensor_stride, flags, count, slot, reach, out):
    """The output keys alone, for a Map step that searches them at once
    (:mod:`numba_sc.map.kernel_map`, a strided layer): pack with the kernel's
    ``reach`` checked (``flags[0]``), sort, de-duplicate into ``out`` (as long as
    ``coords``; the first M entries are the keys), M into ``count[slot]``. Nothing
    is read here. Returns the (len(coords), 3|4) coordinates whose first M rows are
    the outputs."""
    c, s, keys, _ = _pack(coords, stride, tensor_stride, flags, tuple(tuple(int(v) for v in r) for r in reach))
    return sort_unique_keys_cuda(keys, count, slot, s, out)[1]


def finish_output_coords(pending: PendingCoords, report) -> cv.Array:
    """v2's second half, given the report read to the host: the range error if the
    pack kernel flagged one, else the unpacked coordinates (M, 3|4)."""
    flagged, m = (int(v) for v in report)
    if flagged:
        _prepare(to_host(pending.coords), pending.stride, pending.tensor_stride)  # raises the precise error
        raise AssertionError("downsample_pack_kernel flagged a coordinate the host check accepts")
    return pending.outputs[:m]


output_coordinates_cuda = output_coords_v2  # the library's device path: the last rung


def _strides(stride, tensor_stride):
    """``s * t`` per axis as three Python ints, remembered per argument pair (every call
    of a layer asks the same; an unhashable argument is worked out afresh)."""
    try:
        return _strides_of(stride, tensor_stride)
    except TypeError:
        return tuple(int(v) for v in _total_stride(stride, tensor_stride))


@cached(maxsize=256)
def _strides_of(stride, tensor_stride):
    return tuple(int(v) for v in _total_stride(stride, tensor_stride))


def output_coordinates(coords: cv.Array, stride: cv.IntOr3, tensor_stride: cv.IntOr3 = 1,
                       backend: str | None = None) -> cv.Array:
    """Output coordinates of a convolution with ``stride`` on a tensor of ``tensor_stride``.

    ``floor(c / (s*t)) * (s*t)``, de-duplicated and sorted lexicographically;
    int32 (M, 3) or (M, 4) with the batch column kept. Strides may be per-axis.
    """
    if resolve_backend(backend) == "reference":
        out = output_coordinates_reference(to_host(coords), stride, tensor_stride)
    else:
        out = output_coordinates_cuda(coords, stride, tensor_stride)
    return like(out, coords)


# -------------------------------------------------------------------- the ladder
LADDER = Ladder(
    "output_coords",
    (Rung("v1", lambda w: output_coords_v1(w["coords"], 2),
          "Eq. 1 through voxelization's de-duplication (argsort, order, inverse); two reads"),
     Rung("v2", lambda w: output_coords_v2(w["coords"], 2),
          "+ the keys alone sorted, the range flag read with the count: one read (the library's)")),
    workload=lambda ctx: {"coords": ctx.device_coords()},  # a stride-2 layer's outputs
    reference=lambda w: output_coordinates_reference(to_host(w["coords"]), 2),
    # at least: the input coordinates read once, the output coordinates written once (int32 x, y, z)
    bytes_moved=lambda w: w["coords"].nbytes + 3 * 4 * len(output_coordinates_reference(to_host(w["coords"]), 2)),
)

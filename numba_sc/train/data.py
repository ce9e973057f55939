"""Data for training: reading scans from disk, batching them, and preparing batches ahead.

Three pieces, each usable alone:

:class:`ScanFolder`
    The scans of a folder, read one at a time: SemanticKITTI's layout
    ``root/sequences/NN/velodyne/*.bin`` with ``root/sequences/NN/labels/*.label``
    (choose sequences, or a standard split), or any folder of ``name.bin`` /
    ``name.label`` pairs. ``folder[i]`` is ``(points, labels)``.
:func:`sparse_collate` and :func:`split_batch`
    Several voxelized scans as one :class:`~numba_sc.core.tensor.SparseTensor`, and back.
:class:`Loader`
    Batches prepared in background threads while the GPU trains on the current one.

Batching sparse scans
---------------------
Dense images are batched by stacking: a new leading axis. Sparse scans have
different numbers of voxels, so they are batched by *concatenating* their rows
and telling the rows apart by a fourth coordinate, the batch index, in column 0
of (N, 4) coordinates. Two voxels of different scans never meet: their keys
differ in the batch field (:mod:`numba_sc.core.conventions`), so no kernel map
links them, and one network call processes the whole batch as if it were one
sparse scene made of separate islands. Worked example, two scans::

    scan 0: coords (0,0,0) (0,0,1)      features a0 a1
    scan 1: coords (0,0,0)              features b0
    batch:  coords (0,0,0,0) (0,0,0,1) (1,0,0,0)   features a0 a1 b0   offsets [0, 2, 3]

Because the batch index is the most significant part of the sort key, each
scan's rows stay together and in order; ``offsets[i]:offsets[i+1]`` are scan
``i``'s rows, and :func:`split_batch` cuts per-row results (the network's
predictions) back into scans with them. The batch field holds 9 bits: at most
512 scans in one batch (``conventions.BATCH_MAX + 1``).

Why a loader with threads
-------------------------
Reading a scan, augmenting it (:mod:`numba_sc.train.augment`) and voxelizing it
take milliseconds to tens of milliseconds of host time; a training step of a
MinkUNet on a GPU takes about as long. Done one after the other, the GPU idles
while the host prepares. The :class:`Loader` prepares batches ``i + 1 ..
i + prefetch`` in worker threads while the caller trains on batch ``i``, and
records how long the caller still had to wait (``loader.waited``; see
:func:`loader_wait_fraction`). Threads rather than processes: NumPy's file
reads, sorts and arithmetic release the GIL, nothing has to be pickled between
processes, and CuPy arrays can be made in a worker thread directly. The
limit: the parts of ``prepare`` written in Python, and the training step's own
Python (launching kernels), take turns on the GIL; measured on the CPU, one
full scan's ``prepare`` (123k points, augmentation + ``scan_tensor``, 0.12 s)
beside a 0.25 s step cut the loop's waiting from 41 % of the time to 17 % when
the step sleeps (as a GPU step that waits on the device does) and to 28 % when
the step is pure Python. Measure yours with :func:`loader_wait_fraction`.

Device arrays made in the threads. On a GPU, ``prepare`` usually ends on the
device (``prepare_scan(..., device=True)``), and the threads then take memory
from CuPy's pool, which every thread of the process shares. The pool keeps its
free blocks per stream, and every thread's default stream is the same legacy
stream: a block the training thread has just freed can go straight to a loader
thread, even while GPU work on another stream still reads it (the grouped
GEMMs of :mod:`numba_sc.gmas.gemm_grouping` run on side streams). A loader
thread that writes into such a block corrupts the step: non-finite logits, or
silently different losses (``benchmarks/bench_loader.py``'s stress check
reproduced both, ``benchmarks/results/loader.json``). So the worker and
collate threads prepare on a stream of their own (:func:`loader_stream`), and
wait for it before a batch is handed over: the pool gives them only blocks of
that stream, and the training thread receives arrays whose copies are done.

Reproducibility: item ``index`` of epoch ``epoch`` is prepared with its own
generator, ``np.random.default_rng([seed, epoch, index])``, and batches are
assembled in the planned order whatever thread finished first, so the batches
are the same for any number of workers (and for ``workers=0``, no threads).

Example::

    from numba_sc.train import augment as A, data, scan_tensor, train_step

    folder = data.ScanFolder("/data/semantickitti", split="train")
    aug = A.compose(A.rotate_z, A.flip, A.scale, A.jitter)

    def prepare(points, labels, rng):            # runs in a worker thread
        return scan_tensor(aug(points, rng), labels, voxel_size=0.05)

    loader = data.Loader(folder, batch_size=4, prepare=prepare, seed=0)
    for batch in loader:                          # one epoch
        loss = train_step(model, batch.tensor, batch.concat(0), optimizer)
    print(f"waited {loader.waited:.1f} s on data")
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..core import conventions as cv
from ..core.backend import like, to_host
from ..core.device import array_module, gpu_present, simulating
from ..core.state import remember
from ..core.tensor import SparseTensor
from .labels import load_semantickitti_labels

# SemanticKITTI's standard split (semantic-kitti.yaml): sequences 11-21 come without labels.
SPLITS = {
    "train": (0, 1, 2, 3, 4, 5, 6, 7, 9, 10),
    "valid": (8,),
    "test": tuple(range(11, 22)),
}

MAX_BATCH = cv.BATCH_MAX + 1  # scans in one batch: the batch field's range, 0 .. 511

POINT_BYTES = 16  # a .bin point: x, y, z, remission as little-endian float32
LABEL_BYTES = 4  # a .label word: uint32


# ------------------------------------------------------------------ reading
class ScanFolder:
    """The labelled scans of a folder, read from disk one at a time.

    Parameters
    ----------
    root : path
        Either SemanticKITTI's layout, ``root/sequences/NN/velodyne/XXXXXX.bin`` with
        labels in ``root/sequences/NN/labels/XXXXXX.label``; or one sequence's folder
        (``velodyne/`` and ``labels/`` inside); or any flat folder of ``name.bin`` files
        with their ``name.label`` beside them. The layout is found from what is there.
    sequences : ints or strings, optional
        Which sequences to read (``[0, 8]`` or ``["00", "08"]``); all by default.
        SemanticKITTI layout only.
    split : "train", "valid" or "test", optional
        SemanticKITTI's standard split (:data:`SPLITS`): train 00-07 and 09-10, valid
        08, test 11-21. The sequences of the split that are present are read.
    require_labels : bool, optional
        True: every scan must have its ``.label`` (an error names the first without).
        False: labels are not read (``folder[i]`` gives ``None``). None (default):
        required for the "train" and "valid" splits, not read for "test"; otherwise
        all or none within each sequence (or the flat folder): a sequence without a
        ``labels/`` folder gives ``None`` labels (SemanticKITTI's 11-21), one where only
        some scans have their label is an error.

    ``folder[i]`` is ``(points, labels)``: float32 (N, 4) x, y, z, remission and the
    raw uint32 label words (N,) (:mod:`numba_sc.train.labels` maps them to classes), or
    None. ``folder.paths[i]`` is the ``.bin`` file, ``folder.label_paths[i]`` its
    ``.label`` (or None), ``folder.names[i]`` a short name such as ``"08/000123"``.

    Sizes are checked when the folder is opened, from the files' sizes alone
    (nothing is read): a ``.bin`` must hold whole points of 16 bytes and a
    ``.label`` one word per point of its ``.bin``.

    >>> folder = ScanFolder("/data/semantickitti", split="valid")   # doctest: +SKIP
    >>> len(folder), folder.names[0]                                 # doctest: +SKIP
    (4071, '08/000000')
    >>> points, labels = folder[0]                                   # doctest: +SKIP
    """

    def __init__(self, root, sequences=None, split=None, require_labels=None):
        root = Path(root)
        if not root.is_dir():
            raise FileNotFoundError(f"no folder at {root}")
        self.root = root
        self.split = split
        if (root / "sequences").is_dir():
            self.layout = "semantickitti"
            self.sequences = self._choose_sequences(root / "sequences", sequences, split)
            pairs = []
            for s in self.sequences:
                seq = root / "sequences" / s
                pairs += [(f"{s}/{b.stem}", b, seq / "labels" / f"{b.stem}.label")
                          for b in sorted((seq / "velodyne").glob("*.bin"))]
        else:
            if sequences is not None or split is not None:
                raise ValueError(f"sequences= and split= need SemanticKITTI's layout root/sequences/NN/velodyne/, "
                                 f"but {root} has no sequences/ folder; open it without them to read its "
                                 ".bin/.label pairs")
            self.sequences = None
            if (root / "velodyne").is_dir():  # one sequence's folder
                self.layout = "sequence"
                scans, label_dir = root / "velodyne", root / "labels"
            else:
                self.layout = "flat"
                scans = label_dir = root
            pairs = [(b.stem, b, label_dir / f"{b.stem}.label") for b in sorted(scans.glob("*.bin"))]
            stems = {name for name, _, _ in pairs}
            orphans = sorted(p.name for p in label_dir.glob("*.label") if p.stem not in stems) \
                if label_dir.is_dir() else []
            if orphans:
                raise ValueError(f"{label_dir} has .label files without a .bin scan beside them: "
                                 f"{', '.join(orphans[:5])}{' ...' if len(orphans) > 5 else ''}")
        if not pairs:
            where = (f"sequences {', '.join(self.sequences)} of {root}" if self.sequences is not None
                     else str(root))
            raise FileNotFoundError(f"no scans (.bin files) in {where}; expected SemanticKITTI's "
                                    "sequences/NN/velodyne/*.bin or a folder of name.bin / name.label pairs")
        self.names = [n for n, _, _ in pairs]
        self.paths = [b for _, b, _ in pairs]
        self.label_paths = self._find_labels(pairs, require_labels, split)
        self.counts = [self._check_sizes(b, lab) for b, lab in zip(self.paths, self.label_paths)]

    @staticmethod
    def _choose_sequences(seq_root, sequences, split):
        present = sorted(d.name for d in seq_root.iterdir() if d.is_dir() and (d / "velodyne").is_dir())
        if sequences is not None and split is not None:
            raise ValueError(f"give sequences= or split=, not both (got {sequences!r} and {split!r})")
        if split is not None:
            if split not in SPLITS:
                raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
            chosen = [s for s in present if int(s) in SPLITS[split]]
            if not chosen:
                raise FileNotFoundError(
                    f"none of the {split!r} split's sequences ({', '.join(f'{s:02d}' for s in SPLITS[split])}) "
                    f"is in {seq_root}; present: {', '.join(present) or 'none'}")
            return chosen
        if sequences is None:
            return present
        if isinstance(sequences, (int, np.integer, str)):
            sequences = [sequences]
        wanted = []
        for s in sequences:
            # 8.0 and True are not sequence numbers: refused, not read as 08 and 01
            if not (cv.is_int(s) and s >= 0 or isinstance(s, str) and s.strip().isdigit()):
                raise ValueError(f"sequences must be whole numbers such as 8 or '08', got {s!r}")
            wanted.append(f"{int(s):02d}")
        missing = [s for s in wanted if s not in present]
        if missing:
            raise FileNotFoundError(f"sequence(s) {', '.join(missing)} not in {seq_root} (no velodyne/ folder); "
                                    f"present: {', '.join(present) or 'none'}")
        return sorted(set(wanted))

    @staticmethod
    def _find_labels(pairs, require_labels, split):
        if require_labels is None:
            require_labels = {"train": True, "valid": True, "test": False}.get(split)
        if require_labels is False:
            return [None] * len(pairs)
        found = [lab if lab.is_file() else None for _, _, lab in pairs]
        # all or none per sequence (per folder): SemanticKITTI's 11-21 have no labels at all
        group = [name.rpartition("/")[0] for name, _, _ in pairs]
        for g in dict.fromkeys(group):
            members = [k for k, gk in enumerate(group) if gk == g]
            missing = [k for k in members if found[k] is None]
            if missing and (require_labels or len(missing) < len(members)):
                _, b, lab = pairs[missing[0]]
                where = f"sequence {g}" if g else "the folder"
                why = ("labels are required" if require_labels else
                       f"the other {len(members) - len(missing)} scans of {where} have theirs")
                raise FileNotFoundError(f"{b} has no label file {lab} ({len(missing)} of {len(members)} scans of "
                                        f"{where} have none; {why}); pass require_labels=False to read the "
                                        "points alone")
        return found

    @staticmethod
    def _check_sizes(bin_path, label_path):
        size = bin_path.stat().st_size
        if size == 0 or size % POINT_BYTES:
            raise ValueError(f"{bin_path} has {size} bytes, not a positive multiple of {POINT_BYTES}: a .bin "
                             "scan is x, y, z, remission as float32, 16 bytes a point")
        n = size // POINT_BYTES
        if label_path is not None:
            lsize = label_path.stat().st_size
            if lsize != n * LABEL_BYTES:
                raise ValueError(f"{label_path} holds {lsize / LABEL_BYTES:g} labels but {bin_path} holds {n} "
                                 f"points: a .label file has one uint32 per point of its .bin")
        return n

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"index a ScanFolder with an int, got {type(i).__name__}")
        if not -len(self) <= i < len(self):
            raise IndexError(f"scan {i} of a folder of {len(self)}")
        i = int(i) % len(self)
        raw = np.fromfile(self.paths[i], dtype="<f4")
        if raw.size % 4:
            raise ValueError(f"{self.paths[i]} holds {raw.size} floats, not whole points of 4 (x, y, z, remission)")
        points = raw.astype(np.float32, copy=False).reshape(-1, 4)
        cv.check_finite_points(points, str(self.paths[i]))  # a damaged scan is named, not trained on
        if self.label_paths[i] is None:
            return points, None
        labels = load_semantickitti_labels(self.label_paths[i])
        if len(labels) != len(points):
            raise ValueError(f"{self.label_paths[i]} holds {len(labels)} labels but {self.paths[i]} holds "
                             f"{len(points)} points")
        return points, labels

    def __repr__(self):
        which = f", sequences {', '.join(self.sequences)}" if self.sequences is not None else ""
        labelled = sum(p is not None for p in self.label_paths)
        return (f"ScanFolder({str(self.root)!r}: {len(self)} scans, {self.layout} layout{which}, "
                f"{labelled} labelled)")


# ----------------------------------------------------------------- batching
def _as_scan(item, i):
    """(coords, features, stride) of one scan handed to sparse_collate."""
    if hasattr(item, "coords") and hasattr(item, "features"):  # SparseTensor, Voxelization
        c, f, stride = item.coords, item.features, tuple(getattr(item, "stride", (1, 1, 1)))
    elif isinstance(item, (tuple, list)) and len(item) == 2:
        (c, f), stride = item, (1, 1, 1)
    else:
        raise TypeError(f"scan {i}: sparse_collate takes SparseTensors, voxelize() results or (coords, features) "
                        f"pairs, got {type(item).__name__}")
    if f is None:
        raise ValueError(f"scan {i} has no features: voxelize it with features=...")
    if not cv.is_array(c) or c.ndim != 2 or c.shape[1] != 3:
        raise ValueError(f"scan {i}: coords must be (N, 3) voxel coordinates of one scan (the batch index is "
                         f"added here), got {getattr(c, 'shape', type(c).__name__)}")
    cv.check_features(f, f"scan {i}'s features")
    if f.shape[0] != c.shape[0]:
        raise ValueError(f"scan {i}: {f.shape[0]} feature rows for {c.shape[0]} coordinates")
    return c, f, stride


def sparse_collate(scans):
    """Batch several voxelized scans into one tensor: ``(tensor, offsets)``.

    ``scans``: a sequence of :class:`~numba_sc.core.tensor.SparseTensor` (N, 3),
    :func:`numba_sc.voxelize` results (with features) or ``(coords, features)``
    pairs, all with the same number of feature channels, dtype and stride, all
    NumPy or all CuPy. At most 512 scans (the batch field's range).

    The returned tensor has (sum N, 4) coordinates, scan ``i``'s batch index ``i``
    in column 0, and the scans' features concatenated; ``offsets`` (NumPy int64,
    ``len(scans) + 1``) bounds each scan's rows: scan ``i`` is
    ``offsets[i]:offsets[i + 1]``, its rows in the order they were given.
    :func:`split_batch` uses it to cut the rows back apart.

    Each scan's coordinates must be sorted (as :func:`numba_sc.voxelize` and
    :class:`SparseTensor` give them): the batched tensor keeps every scan's rows
    where they were, so that per-row arrays (targets, the ``inverse`` of the
    voxelization) still line up. Unsorted rows are refused; wrap them in a
    ``SparseTensor`` first, which sorts.

    >>> a = (np.array([[0, 0, 0], [0, 0, 1]], np.int32), np.ones((2, 1), np.float32))
    >>> b = (np.array([[0, 0, 0]], np.int32), np.zeros((1, 1), np.float32))
    >>> x, offsets = sparse_collate([a, b])
    >>> x.coords.tolist(), offsets.tolist()
    ([[0, 0, 0, 0], [0, 0, 0, 1], [1, 0, 0, 0]], [0, 2, 3])
    """
    scans = list(scans)
    if not scans:
        raise ValueError("sparse_collate needs at least one scan")
    if len(scans) > MAX_BATCH:
        raise ValueError(f"{len(scans)} scans in one batch: the batch index has {cv.BATCH_BITS} bits, so a batch "
                         f"holds at most {MAX_BATCH} scans (batch indices 0..{cv.BATCH_MAX}); use smaller batches")
    parts = [_as_scan(s, i) for i, s in enumerate(scans)]
    c0, f0, stride = parts[0]
    xp = array_module(f0)
    for i, (c, f, st) in enumerate(parts):
        if array_module(f) is not xp:
            raise TypeError(f"scan {i}'s features are {type(f).__module__} arrays, scan 0's "
                            f"{type(f0).__module__}: batch scans of one kind (all NumPy or all CuPy)")
        if f.shape[1] != f0.shape[1] or f.dtype != f0.dtype:
            raise ValueError(f"scan {i} has {f.shape[1]} {f.dtype} channels, scan 0 {f0.shape[1]} {f0.dtype}: "
                             "all scans of a batch need the same features")
        if st != stride:
            raise ValueError(f"scan {i} has tensor stride {st}, scan 0 {stride}: batch scans of one stride")
    sizes = [int(c.shape[0]) for c, _, _ in parts]
    offsets = np.zeros(len(parts) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    spatial = xp.concatenate([like(cv.validate_coords(c, f"scan {i}'s coords"), f0)
                              for i, (c, _, _) in enumerate(parts)])
    batch = xp.repeat(xp.arange(len(parts), dtype=xp.int32), sizes)
    coords = xp.concatenate([batch[:, None], spatial], axis=1)
    features = xp.concatenate([f for _, f, _ in parts])
    tensor = SparseTensor(coords, features, stride)
    moved = to_host(tensor.order != xp.arange(len(coords)))
    if moved.any():
        r = int(np.flatnonzero(moved)[0])
        i = int(np.searchsorted(offsets, r, side="right") - 1)
        raise ValueError(f"scan {i}'s coordinates are not sorted (row {r - offsets[i]} is out of order): "
                         "its rows would move and per-row arrays no longer line up; pass voxelize()'s output "
                         "or a SparseTensor (which sorts; its .order says how)")
    return tensor, offsets


def batch_offsets(coords, num_scans=None) -> np.ndarray:
    """Row offsets of each scan in batched (N, 4) coordinates sorted by batch index.

    What :func:`sparse_collate` returns, recomputed from the batch column: for a
    network's output on other coordinates than its input (a strided level),
    whose rows are still sorted by batch index. ``num_scans`` defaults to the
    largest batch index + 1 (give it when the last scans may have no rows).

    >>> batch_offsets(np.array([[0, 5, 5, 5], [0, 6, 5, 5], [2, 0, 0, 0]], np.int32)).tolist()
    [0, 2, 2, 3]
    """
    b = np.asarray(to_host(coords[:, 0])) if cv.is_array(coords) and coords.ndim == 2 and coords.shape[1] == 4 \
        else None
    if b is None:
        raise ValueError(f"coords must be batched (N, 4) coordinates, got {getattr(coords, 'shape', coords)!r}")
    if len(b) and (np.diff(b) < 0).any():
        raise ValueError("coords are not sorted by batch index (column 0): a SparseTensor's coordinates are")
    n = (int(b.max()) + 1 if len(b) else 0) if num_scans is None else int(num_scans)
    if len(b) and (b[0] < 0 or b[-1] >= n):
        raise ValueError(f"batch indices run {b[0]}..{b[-1]}, outside 0..{n - 1} for num_scans={n}")
    return np.searchsorted(b, np.arange(n + 1), side="left").astype(np.int64)


def _check_offsets(offsets):
    o = np.asarray(to_host(offsets))
    if o.ndim != 1 or len(o) < 2 or not np.issubdtype(o.dtype, np.integer):
        raise ValueError(f"offsets must be the 1-D integer array sparse_collate returned, got {o.dtype} {o.shape}")
    if o[0] != 0 or (np.diff(o) < 0).any():
        raise ValueError(f"offsets must start at 0 and never decrease, got {o[:8].tolist()}...")
    return o.astype(np.int64)


def split_batch(x, offsets):
    """Cut a batch's rows back into scans: the inverse of :func:`sparse_collate`.

    ``x`` is an array with one row per row of the batched tensor (the network's
    output features, its predictions, the voxel targets), or a batched
    :class:`SparseTensor`. Returns a list, one entry per scan: ``x[offsets[i]:offsets[i + 1]]``,
    or for a tensor a :class:`SparseTensor` with the scan's (N, 3) coordinates and
    features (checked against the batch column: scan ``i``'s rows must carry index ``i``).

    For a network whose output lies on other coordinates than its input (a strided
    level), take the offsets from the output: :func:`batch_offsets`.

    >>> split_batch(np.arange(3), [0, 2, 3])
    [array([0, 1]), array([2])]
    """
    o = _check_offsets(offsets)
    if hasattr(x, "coords") and hasattr(x, "features"):
        c = x.coords
        if c.ndim != 2 or c.shape[1] != 4:
            raise ValueError(f"a batched tensor has (N, 4) coordinates, this one {tuple(c.shape)}")
        if c.shape[0] != o[-1]:
            raise ValueError(f"the tensor has {c.shape[0]} rows but offsets cover {o[-1]}: offsets of other "
                             "coordinates? for a strided output use batch_offsets(tensor.coords, num_scans)")
        expected = np.repeat(np.arange(len(o) - 1), np.diff(o))
        if not np.array_equal(np.asarray(to_host(c[:, 0])), expected):
            raise ValueError("the tensor's batch column does not match the offsets: scan i's rows must carry "
                             "batch index i (use batch_offsets(tensor.coords, num_scans))")
        xp = array_module(c)
        return [SparseTensor.from_layer(xp.ascontiguousarray(c[a:b, 1:]), x.features[a:b], x.stride, None)
                for a, b in zip(o[:-1], o[1:])]
    if not cv.is_array(x):
        raise TypeError(f"split_batch takes an array or a batched SparseTensor, got {type(x).__name__}")
    if x.shape[0] != o[-1]:
        raise ValueError(f"x has {x.shape[0]} rows but offsets cover {o[-1]}: one row per row of the batched "
                         "tensor (per-point arrays are split by the scans' point counts instead)")
    return [x[a:b] for a, b in zip(o[:-1], o[1:])]


@dataclass
class Batch:
    """What a :class:`Loader` yields by default: the batched tensor and what came with it.

    ``prepare`` returns, for each scan, either a tensor alone (a SparseTensor, a
    voxelize() result, a (coords, features) pair) or a tuple ``(tensor, *extras)``,
    such as :func:`numba_sc.train.scan_tensor`'s ``(x, voxel_target, inverse,
    point_target)``. Then:

    ``tensor``, ``offsets``
        :func:`sparse_collate` of the scans' tensors.
    ``extras``
        ``extras[k][i]`` is extra ``k`` of scan ``i`` (``extras[0][i]``: scan ``i``'s
        voxel targets with ``scan_tensor``). Per-row extras are joined by
        :meth:`concat`; per-point ones (``inverse``) stay per scan.
    ``indices``
        The dataset indices of the scans, in batch order.
    """

    tensor: SparseTensor
    offsets: np.ndarray
    extras: tuple = ()
    indices: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def __len__(self):
        return len(self.offsets) - 1

    def concat(self, k):
        """Extra ``k`` of every scan, concatenated: per-row arrays (voxel targets) for the batch."""
        parts = self.extras[k]
        return array_module(parts[0]).concatenate(parts)

    def split(self, x):
        """:func:`split_batch` with this batch's offsets."""
        return split_batch(x, self.offsets)


def collate_items(items, indices=None) -> Batch:
    """The loader's default collate: ``prepare``'s results for one batch -> :class:`Batch`."""
    tensors, extras = [], []
    for i, item in enumerate(items):
        if hasattr(item, "coords"):
            x, rest = item, ()
        elif isinstance(item, (tuple, list)) and item and cv.is_array(item[0]):
            if len(item) != 2:
                raise TypeError(f"item {i}: a tuple that starts with an array must be a (coords, features) pair; "
                                "return (tensor, *extras) with a SparseTensor first to pass extras along")
            x, rest = tuple(item), ()
        elif isinstance(item, (tuple, list)) and item:
            x, rest = item[0], tuple(item[1:])
        else:
            raise TypeError(f"item {i}: prepare must return a tensor or a tuple (tensor, *extras), got "
                            f"{type(item).__name__}")
        if extras and len(rest) != len(extras[0]):
            raise ValueError(f"item {i} has {len(rest)} extras, item 0 {len(extras[0])}: prepare must return the "
                             "same kind of tuple for every scan")
        tensors.append(x)
        extras.append(rest)
    tensor, offsets = sparse_collate(tensors)
    by_kind = tuple(tuple(e[k] for e in extras) for k in range(len(extras[0])))
    idx = np.arange(len(items)) if indices is None else np.asarray(indices, np.int64)
    return Batch(tensor, offsets, by_kind, idx)


# ------------------------------------------------------------------ loading
_IN_LOADER = threading.local()  # .thread is True in a Loader's own worker and collate threads
_STREAMS = remember({})  # device id -> the stream the loader threads of this process prepare on
_STREAMS_LOCK = threading.Lock()


def _mark_loader_thread():
    """ThreadPoolExecutor's initializer for the loader's threads."""
    _IN_LOADER.thread = True


def loader_stream():
    """The CuPy stream the loader's threads use on the current device (made on first use).

    One stream per device, shared by all loader threads: it gives them blocks of
    their own in CuPy's pool (module docstring, "Device arrays made in the
    threads"). It is a *blocking* stream (``non_blocking=False``): its work waits
    for the work queued before it on the legacy default stream, where the training
    step runs (CuPy's default stream, which the layers use unless the caller makes
    another current). That matters because a batch's arrays go back to this stream's
    blocks when the training thread drops them, right after queueing the kernels
    that read them; a loader thread that gets such a block again writes into it
    only after those kernels.
    """
    import cupy

    device = cupy.cuda.runtime.getDevice()
    with _STREAMS_LOCK:
        stream = _STREAMS.get(device)
        if stream is None:
            stream = _STREAMS[device] = cupy.cuda.Stream(non_blocking=False)
    return stream


@contextmanager
def _on_loader_stream():
    """In a loader thread on a GPU: run the block on :func:`loader_stream`, then wait
    for that stream, so what the block made is complete when it is handed over.
    Anywhere else (the calling thread with ``workers=0``, the CPU, the simulator)
    nothing changes."""
    if not getattr(_IN_LOADER, "thread", False) or simulating() or not gpu_present():
        yield
        return
    stream = loader_stream()
    with stream:
        yield
    stream.synchronize()


class Loader:
    """Batches of a dataset, prepared in background threads, in a reproducible order.

    Parameters
    ----------
    dataset
        Anything with ``len()`` and ``dataset[i] -> (points, labels)``: a :class:`ScanFolder`.
    batch_size : int
        Scans per batch, 1 .. 512.
    prepare : callable ``(points, labels, rng) -> item``
        Turns one scan into training data: augmentation (with ``rng``), voxelization,
        features. Runs in a worker thread. ``item`` is a tensor or ``(tensor, *extras)``
        (see :class:`Batch`).
    shuffle : bool
        A new order every epoch (from ``seed`` and the epoch); else the dataset's order.
    seed : int
        Everything random comes from it: the order, and each item's generator
        ``np.random.default_rng([seed, epoch, index])`` (:meth:`item_rng`).
    workers : int
        Threads that prepare items; 0 prepares in the calling thread (no overlap:
        the baseline to measure against).
    prefetch : int
        Batches prepared ahead: while the caller holds batch ``i``, batches
        ``i + 1 .. i + prefetch`` are being prepared.
    drop_last : bool
        Drop the last batch of an epoch when it has fewer than ``batch_size`` scans.
    collate : callable ``(items) -> batch``, optional
        Default :func:`collate_items` (which yields :class:`Batch`).

    Iterating runs one epoch (``loader.epoch``, then incremented: set it to resume).
    ``loader.waits`` holds, for every batch handed out, the seconds the caller
    waited for it; ``loader.waited`` their sum. A pipeline that keeps up shows
    only the first batch's wait (nothing was ready yet).

    >>> loader = Loader(list_of_scans, 2, prepare, workers=2)    # doctest: +SKIP
    >>> for batch in loader: ...                                # doctest: +SKIP
    >>> loader.waited                                           # doctest: +SKIP
    """

    def __init__(self, dataset, batch_size, prepare, shuffle=True, seed=0, workers=2, prefetch=2,
                 drop_last=False, collate=None):
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
                or not 1 <= batch_size <= MAX_BATCH:
            raise ValueError(f"batch_size must be an int in 1..{MAX_BATCH} (the batch index range), got {batch_size!r}")
        if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 0:
            raise ValueError(f"workers must be an int >= 0 (0: prepare in the calling thread), got {workers!r}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, (int, np.integer)) or prefetch < 1:
            raise ValueError(f"prefetch must be an int >= 1, got {prefetch!r}")
        if not callable(prepare):
            raise TypeError("prepare must be a function (points, labels, rng) -> item")
        if len(dataset) == 0:
            raise ValueError("the dataset is empty")
        self.dataset, self.batch_size, self.prepare = dataset, int(batch_size), prepare
        self.shuffle, self.workers, self.prefetch = shuffle, int(workers), int(prefetch)
        self.seed = cv.whole_number(seed, "seed")
        self.drop_last, self.collate = drop_last, collate
        self.epoch = 0
        self.waits = []

    @property
    def waited(self) -> float:
        """Seconds the caller waited for batches, in all (every epoch so far)."""
        return float(sum(self.waits))

    def __len__(self):
        n, b = len(self.dataset), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def plan(self, epoch):
        """The dataset indices of each batch of ``epoch``: a list of int64 arrays."""
        n = len(self.dataset)
        # a seed no item uses (an item's is [seed, epoch, index], index < n < 2**32 - 1)
        order = (np.random.default_rng([self.seed, epoch, 2**32 - 1]).permutation(n) if self.shuffle
                 else np.arange(n))
        return [order[i:i + self.batch_size] for i in range(0, len(self) * self.batch_size, self.batch_size)
                if len(order[i:i + self.batch_size])]

    def item_rng(self, epoch, index):
        """The generator item ``index`` of ``epoch`` is prepared with."""
        return np.random.default_rng([self.seed, int(epoch), int(index)])

    def prepare_item(self, epoch, index):
        """Read and prepare one item, as a worker does."""
        index = int(index)
        try:
            points, labels = self.dataset[index]
            with _on_loader_stream():
                return self.prepare(points, labels, self.item_rng(epoch, index))
        except Exception as e:
            e.add_note(f"(while preparing item {index} of epoch {epoch})")
            raise

    def make_batch(self, items, indices):
        """One batch from its prepared items: ``collate(items)``, or :func:`collate_items`."""
        with _on_loader_stream():
            return collate_items(items, indices) if self.collate is None else self.collate(items)

    def __iter__(self):
        epoch = self.epoch
        self.epoch += 1
        return self._epoch(epoch)

    def _epoch(self, epoch):
        plan = self.plan(epoch)
        if self.workers == 0:
            for idx in plan:
                t0 = time.perf_counter()
                batch = self.make_batch([self.prepare_item(epoch, i) for i in idx], idx)
                self.waits.append(time.perf_counter() - t0)
                yield batch
            return
        items_pool = ThreadPoolExecutor(self.workers, thread_name_prefix="numba-sc-prepare",
                                        initializer=_mark_loader_thread)
        batch_pool = ThreadPoolExecutor(1, thread_name_prefix="numba-sc-collate", initializer=_mark_loader_thread)
        pending = deque()

        def collate_when_ready(futures, idx):
            return self.make_batch([f.result() for f in futures], idx)

        def submit(k):
            futures = [items_pool.submit(self.prepare_item, epoch, i) for i in plan[k]]
            pending.append(batch_pool.submit(collate_when_ready, futures, plan[k]))

        try:
            for k in range(min(self.prefetch, len(plan))):
                submit(k)
            for k in range(len(plan)):
                t0 = time.perf_counter()
                batch = pending.popleft().result()
                self.waits.append(time.perf_counter() - t0)
                if k + self.prefetch < len(plan):
                    submit(k + self.prefetch)
                yield batch
        finally:  # also when the caller stops early: drop what is queued, let running items finish
            items_pool.shutdown(wait=False, cancel_futures=True)
            batch_pool.shutdown(wait=True, cancel_futures=True)
            items_pool.shutdown(wait=True)


def loader_wait_fraction(loader, step, epochs=1):
    """Run ``epochs`` epochs of ``loader``, calling ``step(batch)`` on each batch, and
    measure how much of the time went to waiting for data.

    Returns a dict: ``seconds`` (wall time), ``waited`` (seconds the loop waited
    for batches), ``fraction`` (``waited / seconds``), ``first_wait`` (the first
    batch's wait: the pipeline filling, paid once an epoch) and ``batches``. A
    fraction near 0 means the step never waited on data: the loader keeps up. Near 1,
    data preparation is the bottleneck: more workers, or cheaper ``prepare``.

    >>> loader_wait_fraction(loader, lambda b: train_step(model, b.tensor, b.concat(0), opt))  # doctest: +SKIP
    {'seconds': 12.3, 'waited': 0.4, 'fraction': 0.03, 'first_wait': 0.3, 'batches': 40}
    """
    start = len(loader.waits)
    t0 = time.perf_counter()
    for _ in range(epochs):
        for batch in loader:
            step(batch)
    seconds = time.perf_counter() - t0
    waits = loader.waits[start:]
    waited = float(sum(waits))
    return {"seconds": seconds, "waited": waited, "fraction": waited / seconds if seconds > 0 else 0.0,
            "first_wait": float(waits[0]) if waits else 0.0, "batches": len(waits)}

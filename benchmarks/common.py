"""What the maintained benchmarks share: where the scans are, how a call is timed, what a
result file records about the run.

Importable without a GPU (CI imports every script): CuPy, PyTorch and spconv are imported
inside the functions that need them. Importing this module puts the checkout's root on
``sys.path``, so the scripts run from a checkout without installing the package.

Timing. The lent GPU machine has slow minutes (the same call then takes up to 2x longer),
so contenders are never timed one block after the other: :func:`interleaved` gives every
contender, in an order shuffled afresh each round, one untimed call (its caches warm again
after another contender ran) and then a short block of timed calls; medians over all rounds.
A slow minute then hits every contender of a row alike. Wall time is taken between two
device-wide synchronizes, so work left on any stream (CuPy's, PyTorch's, cuBLAS's) counts.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# ------------------------------------------------------------------- the data
KITTI = "semantickitti_000000.bin"
SCANS = {  # name -> (file, columns per point, voxel size in metres)
    "kitti": (KITTI, 4, 0.05),
    "scannet": ("scannet_scene0000_00.bin", 6, 0.02),
    "sunrgbd": ("sunrgbd_000017.bin", 6, 0.02),
}


def find_data(arg=None, required=True):
    """The folder holding the real scans: ``arg``, else ``$NUMBA_SC_DATA`` (set by
    ``gpu_env.sh``), ``../shared/data`` beside the checkout, ``.devdata/`` in it.
    ``required=False`` returns None when none holds them instead of raising."""
    candidates = [arg, os.environ.get("NUMBA_SC_DATA"), ROOT.parent / "shared" / "data",
                  ROOT / ".devdata", Path(".devdata")]
    for d in candidates:
        if d and (Path(d) / KITTI).exists():
            return Path(d)
    if required:
        raise FileNotFoundError(f"{KITTI} not found in --data, $NUMBA_SC_DATA, ../shared/data or .devdata")
    return None


# Small scans: issue #27's targets name scans of 15-25k voxels, the size of a sparse outdoor
# sweep or a room crop, where the host's work (launches, reads) weighs most. Each is a
# crop of one of SCANS: its voxels nearest the scan's centre in plan view (the sensor for
# SemanticKITTI, the median for the indoor scans), about N of them, with their points.
CROPS = {"kitti_20k": ("kitti", 20_000), "scannet_20k": ("scannet", 20_000),
         "sunrgbd_20k": ("sunrgbd", 20_000)}


def _crop(points, voxel, n, centre):
    """The points of the ``n`` voxels nearest ``centre`` (x, y) (ties at the radius kept)."""
    v = np.floor(points[:, :3] / voxel).astype(np.int64)
    _, first, inverse = np.unique(v, axis=0, return_index=True, return_inverse=True)
    d = np.hypot(*(points[first, :2] - centre).T)
    if n >= len(d):
        return points
    radius = np.partition(d, n - 1)[n - 1]
    return points[(d <= radius)[inverse.reshape(-1)]]


def scan_points(data, name):
    """(points float32 (N, columns), voxel size) of one of :data:`SCANS` or :data:`CROPS`."""
    if name in CROPS:
        base, n = CROPS[name]
        pts, voxel = scan_points(data, base)
        centre = np.zeros(2, np.float32) if base == "kitti" else np.median(pts[:, :2], axis=0)
        return np.ascontiguousarray(_crop(pts, voxel, n, centre)), voxel
    fname, cols, voxel = SCANS[name]
    return np.fromfile(Path(data) / fname, np.float32).reshape(-1, cols), voxel


def scan_crops(data, n, size, seed=0):
    """``n`` square crops (``size`` metres, ``numba_sc.train.augment.crop``) of the labelled
    SemanticKITTI scan: (points float32 (M, 4), raw labels) each, the same for a seed."""
    from numba_sc.train import augment, labels

    points = np.fromfile(Path(data) / KITTI, np.float32).reshape(-1, 4)
    raw = labels.load_semantickitti_labels(Path(data) / KITTI.replace(".bin", ".label"))
    rng = np.random.default_rng(seed)
    return [augment.crop(points, raw, rng, size) for _ in range(n)]


class CyclingScans:
    """A dataset of ``length`` scans cycling through ``crops`` (a loader gives each index
    its own augmentation), for the training benchmarks' loaders."""

    def __init__(self, crops, length):
        self.crops, self.length = crops, length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return self.crops[i % len(self.crops)]


def scan_coords(data, name):
    """Sorted unique int32 voxel coordinates (N, 3) of a scan, voxelized by the NumPy reference."""
    import numba_sc

    pts, voxel = scan_points(data, name)
    return numba_sc.voxelize(np.ascontiguousarray(pts[:, :3]), voxel, backend="reference").coords


def random_coords(n=1_000_000, box=400, seed=0):
    """n unique voxels drawn uniformly from a box^3 grid (int32 (n, 3), unsorted)."""
    rng = np.random.default_rng(seed)
    ids = np.unique(rng.integers(0, box ** 3, size=int(n * 1.1)))
    while len(ids) < n:
        ids = np.unique(np.concatenate([ids, rng.integers(0, box ** 3, size=n)]))
    ids = rng.permutation(ids)[:n]
    return np.stack([ids // (box * box), (ids // box) % box, ids % box], 1).astype(np.int32)


def dense_coords():
    """The dense level of a network on :func:`random_coords`: after two stride-2 layers
    that cloud has ~635k voxels and ~17 pairs per voxel in a 3x3x3 layer (README,
    session 8), the layers where gather-GEMM-scatter lost to spconv's implicit GEMM.
    Sorted unique int32 (N, 3)."""
    return np.unique(random_coords() // 4, axis=0)


# ------------------------------------------------------------------- timing
def sync():
    """Wait for all work on the device, on every stream."""
    import cupy

    cupy.cuda.runtime.deviceSynchronize()


def wall_ms(fn):
    """Milliseconds of one fn() call, wall clock between two device-wide synchronizes."""
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - t0) * 1e3


def gpu_ms(fn):
    """GPU milliseconds of one fn() call: CUDA events recorded around it on CuPy's current stream."""
    import cupy

    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop)


def host_and_gpu_ms(fn, events=None):
    """(host, GPU) milliseconds of one fn() call: wall clock from before the start event to
    the end event's completion, and the time between the two events. ``events`` is
    ``(make, elapsed)`` of another library (see :func:`torch_events`); default CuPy's."""
    import cupy

    make, elapsed = events or (lambda: (cupy.cuda.Event(), cupy.cuda.Event()), cupy.cuda.get_elapsed_time)
    start, stop = make()
    t0 = time.perf_counter()
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    return (time.perf_counter() - t0) * 1e3, elapsed(start, stop)


def torch_events():
    """``events`` for :func:`host_and_gpu_ms` that time PyTorch's current stream."""
    import torch

    return (lambda: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)),
            lambda a, b: a.elapsed_time(b))


HOST_AND_GPU = {("host_ms", "gpu_ms"): host_and_gpu_ms}  # both from the same call
HOST_THEN_GPU = {"host_ms": wall_ms, "gpu_ms": gpu_ms}  # a block of each


def _take(timers, fn, samples):
    for names, timer in timers.items():
        got = timer(fn)
        if isinstance(names, tuple):
            for name, v in zip(names, got):
                samples[name].append(v)
        else:
            samples[names].append(got)


def _names(timers):
    return [n for names in timers for n in (names if isinstance(names, tuple) else (names,))]


def _summary(samples):
    out = {name: statistics.median(s) for name, s in samples.items()}
    out.update({name + "_all": s for name, s in samples.items()})
    return out


def repeated(fn, reps, warmup, timers=None):
    """Median milliseconds of fn() alone: ``warmup`` untimed calls, then ``reps`` timed ones.

    ``timers``: name -> timer(fn) -> ms (a tuple of names for a timer that returns several
    from one call, as :data:`HOST_AND_GPU`); default wall clock, ``{"ms": wall_ms}``.
    Returns {name: median, name + "_all": every sample}."""
    timers = timers or {"ms": wall_ms}
    for _ in range(warmup):
        fn()
    sync()
    samples = {name: [] for name in _names(timers)}
    for _ in range(reps):
        _take(timers, fn, samples)
    return _summary(samples)


def interleaved(contenders, rounds, block=4, warmup=5, timers=None, seed=0):
    """Median milliseconds of each contender, the contenders timed call by call.

    ``contenders``: key -> fn, or key -> (fn, timers) for one timed its own way (e.g. with
    its own library's CUDA events). After ``warmup`` untimed calls of each, every round
    takes the contenders in an order shuffled afresh (seeded, so a rerun repeats it) and
    gives each one untimed call, then ``block`` timed calls per timer. ``timers`` as in
    :func:`repeated`. Returns key -> {name: median, name + "_all": every sample}.
    """
    timers = timers or {"ms": wall_ms}
    plan = {k: (v if isinstance(v, tuple) else (v, timers)) for k, v in contenders.items()}
    for fn, _ in plan.values():
        for _ in range(warmup):
            fn()
    sync()
    samples = {k: {name: [] for name in _names(t)} for k, (_, t) in plan.items()}
    keys = list(plan)
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        for key in [keys[i] for i in rng.permutation(len(keys))]:
            fn, own = plan[key]
            fn()
            sync()
            for names, timer in own.items():
                for _ in range(block):
                    _take({names: timer}, fn, samples[key])
    return {k: _summary(s) for k, s in samples.items()}


def rounds_for(reps, block):
    """Rounds of ``block`` timed calls that give every contender at least ``reps`` samples."""
    return -(-reps // block)


# ------------------------------------------------------------------- result files
def write_json(path, obj, indent=1, default=None, name="--out"):
    """``obj`` as JSON at ``path``, written atomically (a reader, or a run killed midway,
    never sees half a file; see :func:`numba_sc.core.files.atomic_write`). ``default``:
    as :func:`json.dumps`'s, for values JSON has no type for; ``name``: the option that
    gave ``path``, for the error when it cannot be written."""
    import json

    from numba_sc.core.files import atomic_write

    text = json.dumps(obj, indent=indent, default=default) + "\n"
    atomic_write(path, lambda f: f.write(text), mode="w", name=name)


# ------------------------------------------------------------------- older copies
def package_copies(base, names=None):
    """This checkout's ``numba_sc`` as ``"new"``, then older copies of the package kept in
    ``base`` as ``<name>_sc/`` (``cp -r <worktree>/numba_sc .ab/<name>_sc``), imported
    under those names: ``{"new": numba_sc, name: module, ...}``. ``names``: which copies
    (an iterable, or a comma-separated string); None: every ``*_sc`` folder in ``base``,
    none when ``base`` is missing. The package imports itself relatively, so each copy is
    self-contained."""
    import importlib

    import numba_sc

    packages = {"new": numba_sc}
    folder = Path(base).resolve()
    if names is None:
        names = sorted(p.name[:-3] for p in folder.glob("*_sc")) if folder.is_dir() else []
    elif isinstance(names, str):
        names = [n for n in names.split(",") if n]
    missing = [n for n in names if not (folder / f"{n}_sc").is_dir()]
    if missing:
        raise SystemExit(f"no copy {', '.join(f'{n}_sc/' for n in missing)} in {folder}: copy an older "
                         f"tree's numba_sc/ there first (see ab_compare.py)")
    if names and str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    for name in names:
        packages[name] = importlib.import_module(f"{name}_sc")
    return packages


# ------------------------------------------------------------------- peak memory
def cupy_peak(fn):
    """The device memory ``fn()`` holds at most from CuPy's default memory pool: a dict
    with ``peak_bytes`` (the high-water mark of the bytes *allocated* from the pool, i.e.
    handed out to arrays, during the call), ``before_bytes`` (allocated before it),
    ``extra_bytes`` (peak - before) and ``after_bytes`` (allocated once it returned, its
    result still alive; the result is dropped after that).

    Allocated, not reserved: the pool keeps freed blocks cached for reuse (its
    ``total_bytes()``), and how much it caches depends on what ran before; the bytes in
    use are what the call needs. That is also what PyTorch's
    ``torch.cuda.max_memory_allocated()`` counts (not ``max_memory_reserved()``), so
    :func:`torch_peak` measures spconv the same way. Whatever is alive before the call
    (the model's weights, the input tensor, maps or plans a library keeps between
    calls) counts in ``before_bytes`` and so in the peak.

    How: a ``cupy.cuda.memory_hook.MemoryHook`` whose ``malloc_postprocess`` adds each
    block's ``mem_size`` (the rounded size the pool hands out, the size its
    ``used_bytes()`` sums) to a running count started at ``used_bytes()``, and whose
    ``free_postprocess`` subtracts it; the count's maximum is the peak. The hooks are
    called on every pool allocation and release (CuPy's ``SingleDeviceMemoryPool.malloc``
    and ``PooledMemory.free``), so no short-lived block is missed, as a sampler would.
    Memory outside the pool (cuBLAS workspaces, the CUDA context, Numba's own
    allocations, if any) is not counted. The device is synchronized before and after.
    """
    import cupy
    from cupy.cuda import memory_hook

    pool = cupy.get_default_memory_pool()
    device = cupy.cuda.runtime.getDevice()

    class Peak(memory_hook.MemoryHook):
        name = "numba_sc_benchmark_peak"

        def __init__(self, start):
            self.used = self.peak = start

        def malloc_postprocess(self, **kw):
            if kw["device_id"] == device and kw["mem_ptr"]:
                self.used += kw["mem_size"]
                self.peak = max(self.peak, self.used)

        def free_postprocess(self, **kw):
            if kw["device_id"] == device:
                self.used -= kw["mem_size"]

    sync()
    before = int(pool.used_bytes())
    hook = Peak(before)
    with hook:
        result = fn()
        sync()
    after = int(pool.used_bytes())
    del result
    peak = max(hook.peak, after)
    return {"peak_bytes": peak, "before_bytes": before, "extra_bytes": peak - before, "after_bytes": after,
            "allocator": "cupy default memory pool"}


def torch_peak(fn):
    """:func:`cupy_peak` for PyTorch's caching allocator (spconv's tensors): ``peak_bytes``
    is ``torch.cuda.max_memory_allocated()`` after ``torch.cuda.reset_peak_memory_stats()``
    (bytes allocated to tensors, not the allocator's reserved cache), ``before_bytes``
    ``torch.cuda.memory_allocated()`` before the call (weights, inputs: counted in the
    peak), ``extra_bytes`` peak - before and ``after_bytes`` as there."""
    import torch

    sync()
    torch.cuda.synchronize()
    before = int(torch.cuda.memory_allocated())
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    sync()
    torch.cuda.synchronize()
    peak = int(torch.cuda.max_memory_allocated())
    after = int(torch.cuda.memory_allocated())
    del result
    return {"peak_bytes": peak, "before_bytes": before, "extra_bytes": peak - before, "after_bytes": after,
            "allocator": "torch caching allocator"}


# ------------------------------------------------------------------- the record
def _without_note(argv):
    """The command line less its --note (the note is recorded on its own)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--note":
            skip = True
        elif not a.startswith("--note="):
            out.append(a)
    return out


def _version(module):
    try:
        m = __import__(module)
    except Exception:  # noqa: BLE001 - not installed, or broken: the record says so
        return None
    return getattr(m, "__version__", "?")


def _cuda_version(v):
    """12080 -> '12.8' (the CUDA API's integer versions)."""
    return f"{v // 1000}.{v % 1000 // 10}"


def device_name():
    try:
        from numba_sc.core.device import device_name as name

        return name()
    except Exception:  # noqa: BLE001 - an older package layout: ask CuPy
        import cupy

        return cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()


def git_commit():
    """(short hash of HEAD, whether tracked files differ from it); (None, None) outside git.

    ``$NUMBA_SC_COMMIT``, when set, names the commit instead (dirty then unknown): the lent GPU
    machine runs on a copy of the working tree whose git HEAD was seen to be an older commit
    than the checkout's, so a run there should say which code it measures."""
    if os.environ.get("NUMBA_SC_COMMIT"):
        return os.environ["NUMBA_SC_COMMIT"], None

    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        return git("rev-parse", "--short", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    except Exception:  # noqa: BLE001 - no git, or not a checkout (a copied tree)
        return None, None


def recorded(note=""):
    """The ``recorded`` entry of a result file: the device, the driver, the CUDA runtime, the
    library versions, the git commit (and whether the tree was dirty), the date, the
    command that made these numbers, and ``note`` (what code they measure, in words).
    PyTorch and spconv are listed when the run imported them."""
    rec = {"device": device_name(), "driver": None, "cuda_runtime": None}
    try:
        import cupy

        rec["driver"] = _cuda_version(cupy.cuda.runtime.driverGetVersion())
        rec["cuda_runtime"] = _cuda_version(cupy.cuda.runtime.runtimeGetVersion())
    except Exception:  # noqa: BLE001
        pass
    rec["versions"] = {m: _version(m) for m in ("numba", "numba_cuda", "cupy", "numpy")}
    rec["versions"]["python"] = sys.version.split()[0]
    for peer in ("torch", "spconv"):
        if peer in sys.modules:
            rec["versions"][peer] = getattr(sys.modules[peer], "__version__", "?")
    rec["commit"], rec["dirty"] = git_commit()
    rec["date"] = time.strftime("%Y-%m-%d")
    rec["time"] = time.strftime("%H:%M:%S")
    rec["command"] = "python3 " + " ".join(_without_note(sys.argv))
    rec["code"] = note
    return rec

"""Data (numba_sc.train.data): the scan reader on a SemanticKITTI-layout folder built from
crops of the shared scan, batching and splitting back, and the background loader (its
threads' device arrays on a stream of their own)."""
import sys
import threading
import time
import types

import numpy as np
import pytest

from numba_sc import voxelize
from numba_sc.core.backend import to_host
from numba_sc.core.device import gpu_present, simulating
from numba_sc.core.tensor import SparseTensor
from numba_sc.nn.layers import SubMConv3d
from numba_sc.train import augment as A
from numba_sc.train import data
from numba_sc.train.labels import load_semantickitti_labels

from conftest import DATA_DIR, crop, load_scan

# sequence -> point counts of its scans (crops of the shared scan around different points)
LAYOUT = {"00": (120, 150), "08": (90, 200)}
UNLABELLED = {"11": (80,)}  # a test-split sequence: no labels/ folder


def labelled_crop(n, seed):
    """(points float32 (n, 4), raw label words (n,)): a crop of the shared scan with its labels."""
    points = load_scan("semantickitti")
    raw = load_semantickitti_labels(DATA_DIR / "semantickitti_000000.label")
    with_index = np.column_stack([points.astype(np.float64), np.arange(len(points))])
    idx = crop(with_index, n, seed=seed)[:, 4].astype(np.int64)
    return points[idx], raw[idx]


def write_scan(folder, stem, points, labels=None, label_folder=None):
    folder.mkdir(parents=True, exist_ok=True)
    points.astype("<f4").tofile(folder / f"{stem}.bin")
    if labels is not None:
        (label_folder or folder).mkdir(parents=True, exist_ok=True)
        labels.astype("<u4").tofile((label_folder or folder) / f"{stem}.label")


@pytest.fixture(scope="module")
def kitti(tmp_path_factory):
    """root/sequences/{00, 08}/velodyne + labels, 11/velodyne only; and what was written."""
    root = tmp_path_factory.mktemp("kitti")
    written = {}
    seed = 0
    for seq, counts in {**LAYOUT, **UNLABELLED}.items():
        for k, n in enumerate(counts):
            seed += 1
            p, lab = labelled_crop(n, seed)
            stem = f"{k:06d}"
            keep_labels = seq not in UNLABELLED
            write_scan(root / "sequences" / seq / "velodyne", stem, p, lab if keep_labels else None,
                       root / "sequences" / seq / "labels")
            written[f"{seq}/{stem}"] = (p, lab if keep_labels else None)
    return root, written


# ------------------------------------------------------------------- reader
def test_reader_reads_what_was_written(kitti):
    root, written = kitti
    folder = data.ScanFolder(root)
    assert folder.layout == "semantickitti" and folder.sequences == ["00", "08", "11"]
    assert folder.names == sorted(written) and len(folder) == 5
    assert folder.counts == [120, 150, 90, 200, 80]
    for i, name in enumerate(folder.names):
        points, labels = folder[i]
        want_p, want_l = written[name]
        assert points.dtype == np.float32 and points.shape == want_p.shape
        np.testing.assert_array_equal(points, want_p)
        if want_l is None:
            assert labels is None and folder.label_paths[i] is None
        else:
            assert labels.dtype == np.uint32
            np.testing.assert_array_equal(labels, want_l)
        assert folder.paths[i] == root / "sequences" / name.split("/")[0] / "velodyne" / f"{name[3:]}.bin"
    np.testing.assert_array_equal(folder[-1][0], folder[4][0])
    with pytest.raises(IndexError):
        folder[5]
    assert "5 scans" in repr(folder)


def test_split_and_sequence_selection(kitti):
    root, _ = kitti
    assert data.ScanFolder(root, split="train").names == ["00/000000", "00/000001"]
    assert data.ScanFolder(root, split="valid").names == ["08/000000", "08/000001"]
    test = data.ScanFolder(root, split="test")
    assert test.names == ["11/000000"] and test[0][1] is None
    assert data.ScanFolder(root, sequences=[8]).names == data.ScanFolder(root, sequences=["08"]).names \
        == data.ScanFolder(root, sequences=8).names == ["08/000000", "08/000001"]
    assert data.ScanFolder(root, sequences=[8, 0]).sequences == ["00", "08"]
    assert data.SPLITS["train"] == (0, 1, 2, 3, 4, 5, 6, 7, 9, 10) and data.SPLITS["valid"] == (8,)
    assert data.SPLITS["test"] == tuple(range(11, 22))
    with pytest.raises(ValueError, match="split must be one of"):
        data.ScanFolder(root, split="val")
    with pytest.raises(ValueError, match="not both"):
        data.ScanFolder(root, sequences=[0], split="train")
    with pytest.raises(FileNotFoundError, match="sequence.*05.*present: 00, 08, 11"):
        data.ScanFolder(root, sequences=[0, 5])
    with pytest.raises(FileNotFoundError, match="labels are required"):
        data.ScanFolder(root, sequences=[11], require_labels=True)
    assert data.ScanFolder(root, split="train", require_labels=False)[0][1] is None


def test_one_sequence_folder_and_flat_folder(kitti, tmp_path):
    root, written = kitti
    seq = data.ScanFolder(root / "sequences" / "08")
    assert seq.layout == "sequence" and seq.names == ["000000", "000001"]
    np.testing.assert_array_equal(seq[1][1], written["08/000001"][1])
    for name, (p, lab) in written.items():
        if lab is not None:
            write_scan(tmp_path, name.replace("/", "_"), p, lab)
    flat = data.ScanFolder(tmp_path)
    assert flat.layout == "flat" and flat.names == ["00_000000", "00_000001", "08_000000", "08_000001"]
    for i, name in enumerate(flat.names):
        np.testing.assert_array_equal(flat[i][0], written[name.replace("_", "/")][0])
        np.testing.assert_array_equal(flat[i][1], written[name.replace("_", "/")][1])
    with pytest.raises(ValueError, match="no sequences/ folder"):
        data.ScanFolder(tmp_path, split="train")


def test_reader_errors(tmp_path):
    p, lab = labelled_crop(50, 1)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no scans"):
        data.ScanFolder(empty)
    with pytest.raises(FileNotFoundError, match="no folder"):
        data.ScanFolder(tmp_path / "absent")

    bad = tmp_path / "bad_size"
    write_scan(bad, "a", p, lab)
    with open(bad / "a.bin", "ab") as f:
        f.write(b"\0" * 4)  # 50 points and a stray float
    with pytest.raises(ValueError, match=r"a\.bin has 804 bytes, not a positive multiple of 16"):
        data.ScanFolder(bad)

    short = tmp_path / "short"
    write_scan(short, "a", p, lab[:-3])
    with pytest.raises(ValueError, match=r"a\.label holds 47 labels but .*a\.bin holds 50 points"):
        data.ScanFolder(short)

    half = tmp_path / "half"  # one scan with its label, one without
    write_scan(half, "a", p, lab)
    write_scan(half, "b", p)
    with pytest.raises(FileNotFoundError, match=r"b\.bin has no label file .*b\.label"):
        data.ScanFolder(half)
    assert data.ScanFolder(half, require_labels=False)[1][1] is None

    alone = tmp_path / "unlabelled"
    write_scan(alone, "a", p)
    assert data.ScanFolder(alone)[0][1] is None  # no labels at all: points alone
    with pytest.raises(FileNotFoundError, match="labels are required"):
        data.ScanFolder(alone, require_labels=True)

    orphan = tmp_path / "orphan"
    write_scan(orphan, "a", p, lab)
    lab.astype("<u4").tofile(orphan / "z.label")
    with pytest.raises(ValueError, match=r"without a \.bin.*z\.label"):
        data.ScanFolder(orphan)


# --------------------------------------------------------- collate and split
def voxelized(n, seed, channels=3):
    p, _ = labelled_crop(n, seed)
    feats = np.column_stack([p[:, 3:4], np.full((n, channels - 1), seed, np.float32)])
    return voxelize(np.ascontiguousarray(p[:, :3]), 0.05, features=feats, backend="reference")


@pytest.fixture(scope="module")
def scans():
    return [voxelized(n, s) for n, s in ((150, 1), (60, 2), (200, 3))]


def test_collate_matches_a_row_by_row_batch(scans):
    """The batched tensor against rows built one by one and sorted by Python."""
    x, offsets = data.sparse_collate(scans)
    rows = sorted((b, *map(int, c), *map(float, f)) for b, v in enumerate(scans)
                  for c, f in zip(v.coords, v.features))
    assert x.coords.shape == (len(rows), 4) and x.coords.dtype == np.int32
    np.testing.assert_array_equal(x.coords, np.array([r[:4] for r in rows]))
    np.testing.assert_array_equal(x.features, np.array([r[4:] for r in rows], np.float32))
    assert offsets.tolist() == [0, len(scans[0]), len(scans[0]) + len(scans[1]), len(rows)]
    for b, v in enumerate(scans):
        assert (x.coords[offsets[b]:offsets[b + 1], 0] == b).all()


def test_split_gives_each_scan_back(scans):
    tensors = [SparseTensor(v.coords, v.features) for v in scans]
    for inputs in (scans, tensors, [(v.coords, v.features) for v in scans]):
        x, offsets = data.sparse_collate(inputs)
        for v, f in zip(scans, data.split_batch(x.features, offsets)):
            np.testing.assert_array_equal(f, v.features)
        for v, t in zip(scans, data.split_batch(x, offsets)):
            assert t.coords.shape[1] == 3
            np.testing.assert_array_equal(t.coords, v.coords)
            np.testing.assert_array_equal(t.features, v.features)
        np.testing.assert_array_equal(data.batch_offsets(x.coords), offsets)
    pred = np.arange(len(x.coords))
    assert [len(s) for s in data.split_batch(pred, offsets)] == [len(v) for v in scans]
    with pytest.raises(ValueError, match="rows but offsets cover"):
        data.split_batch(pred[:-1], offsets)
    with pytest.raises(ValueError, match="batch column does not match"):
        data.split_batch(x, [0, offsets[1] + 1, offsets[2], offsets[3]])


def test_scans_of_a_batch_do_not_meet(scans):
    """The same crop placed in two scans: a convolution on the batch gives each scan what it
    gives alone (no neighbour found across batch indices)."""
    conv = SubMConv3d(3, 4, 3, rng=np.random.default_rng(0))
    twice = [scans[0], scans[0], scans[2]]
    x, offsets = data.sparse_collate(twice)
    y = conv(x, backend="reference")
    for v, got in zip(twice, data.split_batch(y.features, offsets)):
        alone = conv(SparseTensor(v.coords, v.features), backend="reference")
        np.testing.assert_allclose(got, alone.features, rtol=1e-5, atol=1e-6)


def test_collate_refusals(scans):
    one = (np.zeros((1, 3), np.int32), np.ones((1, 2), np.float32))
    x, offsets = data.sparse_collate([one] * 512)
    assert x.coords[:, 0].tolist() == list(range(512)) and offsets[-1] == 512
    with pytest.raises(ValueError, match="513 scans.*at most 512"):
        data.sparse_collate([one] * 513)
    with pytest.raises(ValueError, match="at least one"):
        data.sparse_collate([])
    c, f = scans[0].coords, scans[0].features
    with pytest.raises(ValueError, match="scan 1's coordinates are not sorted"):
        data.sparse_collate([(c, f), (c[::-1].copy(), f[::-1].copy())])
    with pytest.raises(ValueError, match="scan 1 has 2 float32 channels"):
        data.sparse_collate([(c, f), (c, f[:, :2].copy())])
    with pytest.raises(ValueError, match=r"scan 0: coords must be \(N, 3\)"):
        data.sparse_collate([(np.zeros((1, 4), np.int32), np.ones((1, 2), np.float32))])
    with pytest.raises(ValueError, match="more than once"):
        data.sparse_collate([(np.zeros((2, 3), np.int32), np.ones((2, 2), np.float32))])
    with pytest.raises(ValueError, match="batch_size"):
        data.Loader([(None, None)], 513, lambda p, lab, r: None)


# ------------------------------------------------------------------- loader
def prepare(points, labels, rng):
    """Augment and voxelize one scan with the references: (tensor, voxel labels, inverse)."""
    p = A.compose(A.rotate_z, A.flip, A.jitter)(points, rng)
    v = voxelize(np.ascontiguousarray(p[:, :3]), 0.1, features=p, backend="reference")
    vox_label = np.zeros(len(v), np.int64)
    vox_label[v.inverse] = labels & 0xFFFF  # any point's label: enough to follow the rows
    return SparseTensor(v.coords, v.features), vox_label, v.inverse


def same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.indices, y.indices)
        np.testing.assert_array_equal(x.tensor.coords, y.tensor.coords)
        np.testing.assert_array_equal(x.tensor.features, y.tensor.features)
        np.testing.assert_array_equal(x.offsets, y.offsets)
        for ex, ey in zip(x.extras, y.extras):
            for u, w in zip(ex, ey):
                np.testing.assert_array_equal(u, w)


def test_loader_is_deterministic_whatever_the_workers(kitti):
    folder = data.ScanFolder(kitti[0], sequences=[0, 8])
    runs = {w: [list(data.Loader(folder, 3, prepare, seed=5, workers=w)) for _ in range(2)] for w in (0, 1, 3)}
    for w in (1, 3):
        for epoch in range(2):
            same_batches(runs[0][epoch], runs[w][epoch])
    e0, e1 = runs[1]
    assert [len(b) for b in e0] == [3, 1]
    for epoch in (e0, e1):  # every scan once an epoch
        assert sorted(np.concatenate([b.indices for b in epoch]).tolist()) == [0, 1, 2, 3]
    b = e0[0]
    np.testing.assert_array_equal(b.concat(0), np.concatenate(b.extras[0]))
    assert len(b.concat(0)) == len(b.tensor.coords)
    # each item is prepare(folder[i], item_rng(epoch, i)): redone here by hand
    loader = data.Loader(folder, 3, prepare, seed=5)
    i = int(b.indices[1])
    x, lab, inv = prepare(*folder[i], np.random.default_rng([5, 0, i]))
    np.testing.assert_array_equal(b.split(b.tensor.features)[1], x.features)
    np.testing.assert_array_equal(b.extras[1][1], inv)
    assert loader.prepare_item(0, i)[0].features.tobytes() == x.features.tobytes()


def test_order_and_augmentation_follow_seed_and_epoch(kitti):
    folder = data.ScanFolder(kitti[0], sequences=[0, 8])
    loader = data.Loader(folder, 1, prepare, seed=0)
    orders = {(s, e): np.concatenate(data.Loader(folder, 1, prepare, seed=s).plan(e)).tolist()
              for s in (0, 1) for e in range(4)}
    assert len({tuple(o) for o in orders.values()}) > 2
    assert any(orders[(0, e)] != orders[(1, e)] for e in range(4))
    assert orders[(0, 0)] != orders[(0, 1)] or orders[(0, 1)] != orders[(0, 2)]
    assert np.concatenate(data.Loader(folder, 3, prepare, shuffle=False).plan(7)).tolist() == [0, 1, 2, 3]
    a = loader.prepare_item(0, 2)[0].features
    assert not np.array_equal(a, loader.prepare_item(1, 2)[0].features)  # another epoch: another rotation
    np.testing.assert_array_equal(a, loader.prepare_item(0, 2)[0].features)
    assert loader.epoch == 0
    list(loader)
    list(loader)
    assert loader.epoch == 2 and len(loader.waits) == 8 and len(loader) == 4
    assert len(data.Loader(folder, 3, prepare, drop_last=True)) == 1


def test_loader_overlaps_preparation_with_the_step():
    """prepare sleeps 20 ms an item, the step 60 ms: with workers the step never waits
    after the first batch; without, every batch waits for its two items."""

    def slow(points, labels, rng):
        time.sleep(0.02)
        return (np.zeros((1, 3), np.int32), np.full((1, 1), rng.random(), np.float32))

    scans = [(None, None)] * 8
    overlapped = data.Loader(scans, 2, slow, workers=2, prefetch=2)
    r = data.loader_wait_fraction(overlapped, lambda b: time.sleep(0.06))
    assert r["batches"] == 4 and len(overlapped.waits) == 4
    assert r["first_wait"] >= 0.015 and max(overlapped.waits[1:]) < 0.03, overlapped.waits
    assert r["fraction"] < 0.25 and r["waited"] == pytest.approx(overlapped.waited)
    serial = data.Loader(scans, 2, slow, workers=0)
    r0 = data.loader_wait_fraction(serial, lambda b: time.sleep(0.01))
    assert min(serial.waits) >= 0.035 and r0["fraction"] > 0.6, serial.waits


def test_loader_stops_cleanly_and_reports_errors(kitti):
    folder = data.ScanFolder(kitti[0], sequences=[0, 8])
    for batch in data.Loader(folder, 1, prepare, workers=2):
        break  # leaving early: the queued work is dropped, the threads end
    time.sleep(0.05)
    assert not [t for t in threading.enumerate() if t.name.startswith("numba-sc-") and t.is_alive()]

    def broken(points, labels, rng):
        if len(points) == 150:
            raise RuntimeError("bad scan")
        return prepare(points, labels, rng)

    with pytest.raises(RuntimeError, match="bad scan") as err:
        list(data.Loader(folder, 2, broken, shuffle=False, workers=2))
    assert "item 1 of epoch 0" in "".join(err.value.__notes__)


def test_prefetch_bounds_the_work_ahead():
    """While the caller holds batch i, batches i + 1 .. i + prefetch are prepared, and no more."""
    started = []

    def record(points, labels, rng):
        started.append(points)
        return (np.zeros((1, 3), np.int32), np.ones((1, 1), np.float32))

    scans = [(k, None) for k in range(10)]
    it = iter(data.Loader(scans, 1, record, shuffle=False, workers=3, prefetch=2))
    next(it)
    time.sleep(0.1)
    assert sorted(started) == [0, 1, 2]
    next(it)
    time.sleep(0.1)
    assert sorted(started) == [0, 1, 2, 3]
    it.close()


# ------------------------------------------------------------------ the loader's stream on a GPU
# Why (data's module docstring, "Device arrays made in the threads"): CuPy's memory pool keeps
# free blocks per stream, and a block the training thread frees on the legacy stream can be
# handed to another thread of that stream while GPU work on a side stream still reads it;
# benchmarks/bench_loader.py's stress check reproduced the corruption on a GPU with the
# loader's threads on the legacy stream. Without a GPU, a stand-in for CuPy records which
# stream was current in each prepare and collate call and when each was waited for; on a
# GPU the same is asked of CuPy itself.
ON_GPU = gpu_present() and not simulating()


def tiny_scans(n):
    """``n`` tiny labelled 'scans': (points, labels) whose content says which scan it is."""
    return [(np.full((3, 4), i, np.float32), np.full(3, i, np.uint32)) for i in range(n)]


def tiny_item(points):
    """A prepared scan as Loader's default collate takes it: (coords, features) on the host."""
    i = int(points[0, 0])
    return np.array([[i, 0, 0]], np.int32), np.full((1, 1), i, np.float32)


class FakeCupy:
    """What data's stream code asks of CuPy: ``cuda.runtime.getDevice`` and ``cuda.Stream``
    (a context manager that makes itself this thread's current stream, and ``synchronize``).
    Records every stream made and every wait, in order, with the thread that waited."""

    def __init__(self):
        self.made, self.events, self.local = [], [], threading.local()
        fake = self

        class Stream:
            def __init__(self, non_blocking=False):
                self.non_blocking = non_blocking
                fake.made.append(self)

            def __enter__(self):  # (the threads share a stream: what it replaced is kept per thread)
                fake.stack().append(self)
                return self

            def __exit__(self, *exc):
                fake.stack().pop()

            def synchronize(self):
                fake.events.append(("wait", threading.current_thread().name, self))

        self.cuda = types.SimpleNamespace(Stream=Stream, runtime=types.SimpleNamespace(getDevice=lambda: 0))

    def stack(self):
        if not hasattr(self.local, "stack"):
            self.local.stack = []
        return self.local.stack

    def current(self):
        return self.stack()[-1] if self.stack() else None


@pytest.fixture
def fake_gpu(monkeypatch):
    """The loader's view of a machine with a GPU, CuPy replaced by :class:`FakeCupy`."""
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(data, "gpu_present", lambda: True)
    monkeypatch.setattr(data, "simulating", lambda: False)
    monkeypatch.setattr(data, "_STREAMS", {})
    return fake


def recording_loader(fake, workers):
    """A Loader over 6 scans in batches of 2 whose prepare and collate note the thread and
    the current stream of each call (in ``fake.events``, beside the waits)."""

    def prepare(points, labels, rng):
        fake.events.append(("prepare", threading.current_thread().name, fake.current()))
        return tiny_item(points)

    def collate(items):
        fake.events.append(("collate", threading.current_thread().name, fake.current()))
        return data.collate_items(items)

    return data.Loader(tiny_scans(6), 2, prepare, shuffle=False, workers=workers, collate=collate)


def test_worker_threads_prepare_and_collate_on_the_loader_stream_and_wait_for_it(fake_gpu):
    batches = list(recording_loader(fake_gpu, workers=2))
    assert [b.tensor.features[:, 0].tolist() for b in batches] == [[0, 1], [2, 3], [4, 5]]
    assert len(fake_gpu.made) == 1 and fake_gpu.made[0].non_blocking is False  # one blocking stream
    stream = fake_gpu.made[0]
    calls = [e for e in fake_gpu.events if e[0] != "wait"]
    assert sorted(k for k, *_ in calls) == ["collate"] * 3 + ["prepare"] * 6
    for kind, thread, current in calls:
        assert thread.startswith("numba-sc-"), (kind, thread)  # the loader's own threads
        assert current is stream, (kind, thread)
    # each call's thread waits for the stream after the call and before its next one
    for k, (kind, thread, _) in enumerate(fake_gpu.events):
        if kind != "wait":
            later = [e for e in fake_gpu.events[k + 1:] if e[1] == thread]
            assert later and later[0][0] == "wait" and later[0][2] is stream, (kind, thread)


def test_the_calling_thread_keeps_its_stream(fake_gpu):
    """workers=0 prepares on the training thread itself: nothing to isolate, no stream, no wait."""
    list(recording_loader(fake_gpu, workers=0))
    assert not fake_gpu.made
    assert {(kind, current) for kind, _, current in fake_gpu.events} == {("prepare", None), ("collate", None)}


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_on_the_gpu_the_threads_use_a_stream_of_their_own():
    import cupy

    def run(workers):
        seen = []

        def prepare(points, labels, rng):
            seen.append(cupy.cuda.get_current_stream().ptr)
            c, f = tiny_item(points)
            return cupy.asarray(c), cupy.asarray(f)

        batches = [to_host(b.tensor.features).tolist()
                   for b in data.Loader(tiny_scans(6), 2, prepare, shuffle=False, workers=workers)]
        return batches, set(seen)

    threaded, streams = run(2)
    calling, calling_streams = run(0)
    assert threaded == calling
    assert streams == {data.loader_stream().ptr} and 0 not in streams
    assert calling_streams == {cupy.cuda.get_current_stream().ptr}

"""Data-parallel training (numba_sc.train.parallel): N ranks on shares of a batch train the
weights one process trains on the whole batch.

Without GPUs the ranks are Python threads (``ThreadGroup``) running the very step a GPU
process runs (``Trainer`` with a communicator, ``ShardedLoader``, synced BatchNorm), on
crops of the shared scan; with two GPUs a last test sums arrays over NCCL in two processes."""
import sys
import textwrap

import numpy as np
import pytest

from numba_sc import nn
from numba_sc.core.device import gpu_present, simulating
from numba_sc.train import optim, parallel
from numba_sc.train import run as tr
from numba_sc.train.labels import IGNORE_INDEX, learning_map
from numba_sc.train.trainer import Trainer

from conftest import DATA_DIR, load_scan


def _crops(n, size, unlabelled=()):
    """``n`` labelled crops of ``size`` points of the shared scan, as (points, raw labels);
    the crops numbered in ``unlabelled`` get raw label 0 everywhere (all ignored)."""
    points = load_scan("semantickitti")
    raw = np.fromfile(DATA_DIR / "semantickitti_000000.label", np.uint32)
    labelled = np.flatnonzero(learning_map(raw) != IGNORE_INDEX)
    out = []
    for i in range(n):
        centre = points[labelled[i * 15000], :3]
        keep = np.argsort(np.abs(points[:, :3] - centre).max(axis=1), kind="stable")[:size]
        out.append((points[keep], np.zeros(size, np.uint32) if i in unlabelled else raw[keep]))
    return out


def _prepare(points, raw, rng):
    return tr.prepare_scan(points, raw, rng)


def _train(scans, batch_size, model_fn, backend, epochs=1, comm=None, shuffle=True):
    """A run of ``epochs`` over ``scans`` as rank ``comm.rank`` (or one process): the
    history and the model's state dict."""
    model = model_fn()
    opt = optim.AdamW(model.trainable_parameters(), lr=1e-2)
    trainer = Trainer(model, opt, comm=comm, backend=backend)
    rank, size = (0, 1) if comm is None else (comm.rank, comm.size)
    loader = parallel.ShardedLoader(scans, batch_size, _prepare, rank=rank, size=size, seed=4, workers=0,
                                    shuffle=shuffle)
    history = tr.fit_dataset(model, opt, loader, epochs, trainer=trainer, backend=backend, print_=lambda s: None)
    return history, model.state_dict(), trainer.scans


def _assert_same_weights(one, ranks, rtol):
    for name, want in one.items():
        for r, state in enumerate(ranks):
            got = state[name]
            if r:  # every rank applies the same summed gradients: the same bits
                np.testing.assert_array_equal(got, ranks[0][name], err_msg=name)
            err = np.linalg.norm(got.astype(np.float64) - want) / max(np.linalg.norm(want.astype(np.float64)), 1e-30)
            assert err <= rtol, f"{name}: ||ranks - one process|| / ||one|| = {err:.2e}"


def test_two_ranks_as_threads_train_the_weights_of_one_process():
    """The simulator's kernels, synced BatchNorm and the bucketed all-reduce: global
    batches of 2 scans, 2 steps, as one process and as 2 ranks of one scan each."""
    scans = _crops(4, 20)

    def model():
        rng = np.random.default_rng(0)
        return nn.Sequential(nn.SubMConv3d(2, 8, 1, rng=rng), nn.BatchNorm(8), nn.ReLU(), nn.Linear(8, 19, rng=rng))

    one, state, seen = _train(scans, 2, model, None)
    ranks = parallel.ThreadGroup(2).run(lambda comm: _train(scans, 2, model, None, comm=comm))
    assert seen == 4 and [r[2] for r in ranks] == [4, 4]  # scans of the whole batches, on every rank
    assert ranks[0][0][0]["losses"] == pytest.approx(one[0]["losses"], rel=1e-6)
    _assert_same_weights(state, [r[1] for r in ranks], 1e-5)


def test_three_ranks_uneven_shares_a_share_without_labels_and_a_strided_unet():
    """Reference backend, a tiny U-Net (a strided convolution and its transposed one,
    BatchNorm at both levels): global batches of 4 scans over 3 ranks (shares of 2, 1, 1),
    crop 2 without a labelled point (rank 1's share of the first batch: it has no loss of
    its own but still joins BatchNorm's statistics), two epochs."""
    scans = _crops(8, 60, unlabelled={2})

    def model():
        rng = np.random.default_rng(1)
        down = nn.SparseConv3d(8, 8, 2, stride=2, rng=rng)
        return _UNet(nn.Sequential(nn.SubMConv3d(2, 8, 3, rng=rng), nn.BatchNorm(8), nn.ReLU()),
                     nn.Sequential(down, nn.BatchNorm(8), nn.ReLU()),
                     nn.Sequential(nn.SparseInverseConv3d(8, 8, 2, inverts=down, rng=rng), nn.BatchNorm(8)),
                     nn.Linear(8, 19, rng=rng))

    one, state, _ = _train(scans, 4, model, "reference", epochs=2, shuffle=False)
    ranks = parallel.ThreadGroup(3).run(lambda comm: _train(scans, 4, model, "reference", epochs=2, comm=comm,
                                                            shuffle=False))
    assert [len(h["losses"]) for h in one] == [2, 2]
    for got, want in zip(ranks[0][0], one):
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-6)
    _assert_same_weights(state, [r[1] for r in ranks], 1e-5)


class _UNet(nn.Module):
    def __init__(self, stem, down, up, head):
        super().__init__()
        self.stem, self.down, self.up, self.head = stem, down, up, head

    def forward(self, x):
        x = self.stem(x)
        return self.head(nn.add(self.up(self.down(x)), x, relu=True))


def test_sharded_loader_cuts_each_global_batch_into_contiguous_shares():
    scans = [(np.full((3, 4), i, np.float32), None) for i in range(7)]

    def prepare(points, raw, rng):
        return int(points[0, 0]), float(rng.random())  # the scan's index, and its generator's first draw

    def collate(items):
        return items

    one = parallel.ShardedLoader(scans, 3, prepare, seed=5, workers=0, collate=collate)
    ranks = [parallel.ShardedLoader(scans, 3, prepare, rank=r, size=2, seed=5, workers=1, collate=collate)
             for r in range(2)]
    whole, shares = list(one), [list(r) for r in ranks]
    assert len(one) == 3 and [len(b) for b in whole] == [3, 3, 1]
    # 7 scans in batches of 3 over 2 ranks: the last batch (1 scan) would leave rank 1 without one: dropped
    assert len(ranks[0]) == 2 and [len(b) for b in shares[0]] == [2, 2] and [len(b) for b in shares[1]] == [1, 1]
    for k in range(2):  # the shares, joined in rank order, are the batch, each item prepared alike
        assert shares[0][k] + shares[1][k] == whole[k]
    with pytest.raises(ValueError, match="global batch"):
        parallel.ShardedLoader(scans, 1, prepare, rank=0, size=2)
    with pytest.raises(ValueError, match="rank must be in 0..1"):
        parallel.ShardedLoader(scans, 4, prepare, rank=2, size=2)


def test_gradient_buckets_worked_example_and_round_trip():
    """The docstring's example: bucket_bytes 16 (4 values), parameters of 3, 2 and 6 values."""
    rng = np.random.default_rng(0)
    grads = {"a": rng.standard_normal(3).astype(np.float16), "b": rng.standard_normal((1, 2)).astype(np.float32),
             "c": rng.standard_normal((2, 3)).astype(np.float32)}
    buckets = parallel.GradientBuckets.for_gradients(["a", "b", "c"], grads, bucket_bytes=16)
    assert [[name for name, *_ in b] for b in buckets.buckets] == [["a"], ["b"], ["c"]]
    assert [len(b) for b in buckets.buffers] == [3, 2, 6]
    buckets.pack(grads)
    views = buckets.views()
    for name, g in grads.items():
        assert views[name].dtype == np.float32 and views[name].shape == g.shape
        np.testing.assert_array_equal(views[name], g.astype(np.float32))  # float16 widened exactly
    assert [len(b) for b in parallel.GradientBuckets.for_gradients(["a", "b", "c"], grads).buffers] == [11]
    with pytest.raises(ValueError, match="bucket_bytes"):
        parallel.GradientBuckets([("a", (3,))], bucket_bytes=2)


def test_thread_group_sums_in_place_and_a_failing_rank_ends_the_group():
    def body(comm):
        a = np.full(3, comm.rank + 1.0)
        comm.all_reduce(a)
        return a

    assert [r.tolist() for r in parallel.ThreadGroup(3).run(body)] == [[6.0] * 3] * 3

    def failing(comm):
        if comm.rank == 1:
            raise ZeroDivisionError("rank 1's own error")
        comm.all_reduce(np.zeros(1))  # rank 0 waits here for rank 1, which never comes

    with pytest.raises(ZeroDivisionError, match="rank 1's own error"):
        parallel.ThreadGroup(2).run(failing)


def test_placement_from_the_usual_environment_variables():
    assert parallel.placement_from_environment({}) is None
    p = parallel.placement_from_environment({"WORLD_SIZE": "16", "RANK": "9", "LOCAL_RANK": "1",
                                             "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert p == parallel.Placement(9, 16, 1, "10.0.0.1", 1234)
    p = parallel.placement_from_environment({"WORLD_SIZE": "2", "RANK": "1"})
    assert (p.local_rank, p.host, p.port) == (1, "127.0.0.1", parallel.DEFAULT_PORT)
    with pytest.raises(ValueError, match="RANK is not set"):
        parallel.placement_from_environment({"WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="RANK=2 is out of range"):
        parallel.placement_from_environment({"WORLD_SIZE": "2", "RANK": "2"})
    with pytest.raises(ValueError, match="MASTER_PORT='http' is not an integer"):
        parallel.placement_from_environment({"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "http"})


def test_the_command_refuses_more_gpus_than_the_machine_has(tmp_path, capsys):
    from numba_sc.__main__ import main

    scan = _crops(1, 20)[0]
    scan[0].tofile(tmp_path / "a.bin")
    scan[1].tofile(tmp_path / "a.label")
    count = 0
    if gpu_present() and not simulating():
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    assert main(["train", "fit", "--data", str(tmp_path), "--epochs", "1", "--gpus", str(max(2, count + 1))]) == 2
    assert f"this machine has {count} CUDA GPU(s)" in capsys.readouterr().err


def _gpu_count():
    if simulating() or not gpu_present():
        return 0
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


@pytest.mark.skipif(_gpu_count() < 2, reason="needs two CUDA GPUs")
def test_nccl_sums_over_two_processes(tmp_path):
    """Two processes started by spawn() as the launcher starts them: each finds its rank
    in the environment, selects its GPU, joins NCCL through CuPy and sums an array."""
    code = textwrap.dedent(f"""
        import cupy, numpy as np
        from numba_sc.train import parallel
        comm = parallel.connect(parallel.placement_from_environment())
        a = cupy.arange(5, dtype=cupy.float32) * (comm.rank + 1)
        comm.all_reduce(a)
        assert cupy.cuda.runtime.getDevice() == comm.rank
        np.save(r"{tmp_path}/rank%d.npy" % comm.rank, cupy.asnumpy(a))
        comm.close()
    """)
    status = parallel.spawn(2, [sys.executable, "-c", code])
    assert status == 0
    for r in range(2):
        np.testing.assert_array_equal(np.load(tmp_path / f"rank{r}.npy"), np.arange(5) * 3.0)

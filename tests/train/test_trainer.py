"""The Trainer (numba_sc.train.trainer): with no option on, its step is the loop's
train_step; a batch with no labelled point changes nothing; its state round-trips;
with several ranks it refuses an optimizer that does not hold the model's arrays."""
import numpy as np
import pytest

from numba_sc import nn
from numba_sc.train import optim
from numba_sc.train.labels import IGNORE_INDEX
from numba_sc.train.loop import train_step
from numba_sc.train.trainer import Trainer

from helpers import tensor


def _model():
    rng = np.random.default_rng(0)
    return nn.Sequential(nn.SubMConv3d(2, 8, 3, rng=rng), nn.BatchNorm(8), nn.ReLU(), nn.Linear(8, 5, rng=rng))


def _batch():
    rng = np.random.default_rng(1)
    x = tensor(rng, 60, 2, extent=5)
    return x, rng.integers(0, 5, len(x.coords)).astype(np.int64)


def test_a_plain_step_is_train_step():
    x, target = _batch()
    a, b = _model(), _model()
    trainer = Trainer(a, optim.SGD(a.trainable_parameters(), lr=0.1), backend="reference")
    assert trainer.plain and trainer.dtype == np.float32
    opt_b = optim.SGD(b.trainable_parameters(), lr=0.1)
    for _ in range(2):
        assert trainer.step(x, target, scans=3) == float(train_step(b, x, target, opt_b, "reference"))
    assert trainer.scans == 6
    for (name, wa), (_, wb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert np.array_equal(np.asarray(wa), np.asarray(wb)), name
    assert not np.array_equal(np.asarray(a.state_dict()["0.weight"]), np.asarray(_model().state_dict()["0.weight"]))


def test_a_batch_without_labels_changes_nothing():
    x, target = _batch()
    m = _model()
    trainer = Trainer(m, optim.SGD(m.trainable_parameters(), lr=0.1), backend="reference")
    before = {k: np.array(v) for k, v in m.state_dict().items()}
    assert trainer.step(x, np.full_like(target, IGNORE_INDEX)) is None
    assert trainer.scans == 0
    assert all(np.array_equal(before[k], np.asarray(v)) for k, v in m.state_dict().items())


def test_the_state_round_trips():
    x, target = _batch()
    m = _model()
    trainer = Trainer(m, optim.AdamW(m.trainable_parameters(), lr=1e-2), backend="reference")
    trainer.step(x, target)
    state = trainer.state_dict()
    assert set(state) == {"model", "optimizer"}
    fresh = _model()
    other = Trainer(fresh, optim.AdamW(fresh.trainable_parameters(), lr=1e-2), backend="reference")
    other.load_state_dict(state)
    assert other.step(x, target) == trainer.step(x, target)


class _TwoRanks:
    rank, size = 0, 2

    def all_reduce(self, a):
        raise AssertionError("not reached: the check comes first")


def test_several_ranks_need_the_models_own_arrays():
    m = _model()
    opt = optim.SGD(_model().trainable_parameters(), lr=0.1)  # another model's arrays
    with pytest.raises(ValueError, match="the optimizer must hold the model's own trainable arrays"):
        Trainer(m, opt, comm=_TwoRanks())

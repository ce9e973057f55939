"""The tape (reverse mode through whole networks): kernels == reference for every
parameter and the input, the reference against a central difference of the loss,
and the errors of a misused tape."""
import numpy as np
import pytest

import numba_sc as ns
from numba_sc import nn
from numba_sc.core.backend import to_host
from numba_sc.train.loss import cross_entropy


class _Small(nn.Module):
    """Every kind of layer and both joins, on a few hundred voxels."""

    def __init__(self, rng):
        super().__init__()
        self.stem = nn.Sequential(nn.SubMConv3d(4, 6, 3, rng=rng), nn.BatchNorm(6), nn.ReLU())
        self.down = nn.SparseConv3d(6, 8, 2, stride=2, rng=rng)
        self.bn = nn.BatchNorm(8)
        self.up = nn.SparseInverseConv3d(8, 6, 2, inverts=self.down, rng=rng)
        self.short = nn.SubMConv3d(6, 6, 1, rng=rng)
        self.head = nn.Linear(12, 3, rng=rng)

    def forward(self, x):
        a = self.stem(x)
        b = self.up(self.bn(self.down(a), relu=True))
        s = nn.add(b, self.short(a), relu=True)
        return self.head(nn.cat(s, a))


def _small_case(coords, seed):
    """(net in training mode, its input, three-class targets) on the crop, from ``seed``."""
    rng = np.random.default_rng(seed)
    net = _Small(rng)
    net.train()
    x = ns.SparseTensor(coords, rng.standard_normal((len(coords), 4)).astype(np.float32))
    return net, x, rng.integers(0, 3, len(coords))


def test_tape_through_a_network_kernels_reference_and_finite_differences(coords):
    """The tape's gradients: kernels == reference for every parameter and the input;
    the reference against a central difference of the loss along a random direction."""
    net, x, target = _small_case(coords, 4)
    got = {}
    for bk in ("reference", "cuda"):
        with nn.Tape() as tape:
            y = net(x, backend=bk)
        loss, g = cross_entropy(y.features, target, backend=bk)
        got[bk] = (tape.backward(y, g), tape.grad(x))
    params = dict(net.trainable_parameters())
    assert set(got["reference"][0]) == set(params)
    for name, want in got["reference"][0].items():
        assert np.abs(to_host(got["cuda"][0][name]) - want).max() <= 1e-4 * max(1e-3, np.abs(want).max()), name
    assert np.abs(to_host(got["cuda"][1]) - got["reference"][1]).max() < 1e-5

    grads, _ = got["reference"]
    direction = {k: np.random.default_rng(5).standard_normal(p.shape).astype(np.float32) for k, p in params.items()}
    slope = sum(float((direction[k] * grads[k]).sum()) for k in params)
    saved = {k: p.copy() for k, p in params.items()}

    def loss_at(t):
        for k, p in params.items():
            p[...] = saved[k] + t * direction[k]
        return cross_entropy(net(x, backend="reference").features, target, backend="reference")[0]

    # float32 forward: h small enough to cross few ReLU kinks, large enough for float32
    h = 3e-4
    numeric = (loss_at(h) - loss_at(-h)) / (2 * h)
    loss_at(0.0)
    assert abs(numeric - slope) < 0.02 * abs(slope), (numeric, slope)
    wrong = slope - float((direction["down.weight"] * grads["down.weight"]).sum())  # one layer's part lost
    assert abs(numeric - wrong) > 0.02 * abs(slope)


def test_tape_errors(coords):
    net = nn.Sequential(nn.SubMConv3d(4, 2, 3))
    x = ns.SparseTensor(coords, np.ones((len(coords), 4), np.float32))
    y = net(x, backend="reference")  # no tape open
    with nn.Tape() as tape:
        net(x, backend="reference")
    with pytest.raises(ValueError, match="not made by a layer"):
        tape.backward(y, np.ones_like(y.features))
    with pytest.raises(ValueError, match="shape"):
        tape.backward(y, np.ones((3, 2), np.float32))
    with nn.Tape() as tape:
        y = net(x, backend="reference")
    with pytest.raises(TypeError, match="grad is float64"):
        tape.backward(y, np.ones(y.features.shape))


def test_a_tape_plays_back_once_and_lets_go_of_its_steps(coords):
    net = nn.Sequential(nn.SubMConv3d(4, 2, 3))
    x = ns.SparseTensor(coords, np.ones((len(coords), 4), np.float32))
    with nn.Tape() as tape:
        y = net(x, backend="reference")
    assert len(tape.steps) == 1
    tape.backward(y, np.ones_like(y.features))
    assert tape.steps == []  # each step (and what it held) dropped once it ran
    with pytest.raises(RuntimeError, match="played back already"):
        tape.backward(y, np.ones_like(y.features))


def test_the_kept_buffers_stay_within_the_tapes_budget(coords):
    """A layer keeps its gathered input buffer for the weight gradient only while the
    tape's kept buffers fit its budget (by default none; None: the workspace); past it
    the backward gathers again, and the gradients are the same (the budget changes the
    memory, not the answer)."""
    net, x, target = _small_case(coords, 6)
    got = {}
    try:
        for nbytes, keep in ((0, None), (5000, None), (0, "default"), (0, "all but one byte")):
            if keep == "all but one byte":  # of what the unbounded tape kept: some buffers, not all
                keep = got[0, None][0] - 1
            ns.set_workspace(nbytes)
            with (nn.Tape() if keep == "default" else nn.Tape(keep_buffers=keep)) as tape:
                y = net(x.without_maps(), backend="cuda")
            kept = tape.kept_bytes
            loss, g = cross_entropy(y.features, target, backend="cuda")
            got[nbytes, keep] = (kept, tape.backward(y, g))
    finally:
        ns.set_workspace(None)
    # unbounded: every buffer kept; bounded (by the workspace or the tape): what fits; by default: none
    most = got[0, None][0] - 1
    assert got[0, None][0] > 5000 >= got[5000, None][0]
    assert got[0, "default"][0] == 0 and 0 < got[0, most][0] <= most
    for case in ((5000, None), (0, "default"), (0, most)):
        for name, want in got[0, None][1].items():
            have = to_host(got[case][1][name])
            assert np.abs(have - to_host(want)).max() <= 1e-5 * max(1e-3, np.abs(to_host(want)).max()), (case, name)
    t = nn.Tape(None)
    ns.set_workspace(100)
    try:
        assert t.keep_buffer(60) and not t.keep_buffer(60) and t.kept_bytes == 60
    finally:
        ns.set_workspace(None)
    assert not nn.Tape().keep_buffer(1) and nn.Tape(0).kept_bytes == 0
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="keep_buffers must be"):
            nn.Tape(keep_buffers=bad)

"""Checkpoints, state and objects at the edges (#33): damaged or foreign files, state
that survives training, one module in two networks, writes that a kill cannot tear.

The table is :mod:`test_edges`'s pattern: one line a case, ``(id, call, expected)``,
expected an (exception class, regex) or a check of the result.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import numba_sc as ns
from numba_sc import nn
from numba_sc.core import device
from numba_sc.train import augment, optim
from test_edges import C3, F3, test_edge as run_case  # noqa: F401 (the runner, reused below)

HERE = Path(__file__).parent


# ---------------------------------------------------------------- files the cases read
def _file(tmp, name, make):
    path = Path(tmp) / name
    make(path)
    return path


def _truncated(path):
    good = ns.save({"w": np.arange(10_000.0)}, path.with_name("whole.npz"))
    data = good.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _pointing_nowhere(path):  # an .npz that says it is ours but lacks the array it names
    meta = {"format": "numba-sc checkpoint 1", "structure": {"dict": {"w": {"array": "a7"}}}}
    np.savez(path, __structure__=np.array(json.dumps(meta)))


def _load(tmp, name, make):
    return ns.load(_file(tmp, name, make))


# ---------------------------------------------------------------- state the cases build
def _trained_bn():
    bn = nn.BatchNorm(2).train()
    bn(ns.SparseTensor(C3, F3 * np.arange(3, dtype=np.float32)[:, None]), backend="reference")
    return bn


def _bn_after_training_loads():
    bn = _trained_bn()
    bn.load_state_dict(nn.BatchNorm(2).state_dict())
    return bn.state_dict()["num_batches_tracked"]


def _sgd_state(change):
    o = optim.SGD([("w", np.ones(2, np.float32))], lr=0.1, momentum=0.9)
    o.step({"w": np.ones(2, np.float32)})
    s = o.state_dict()
    change(s)
    return o, s


def _load_sgd(change):
    o, s = _sgd_state(change)
    return o.load_state_dict(s)


def _set(path, value):
    """A change to a state dict: ``path`` of keys down to the entry set to ``value``."""
    def change(s):
        for k in path[:-1]:
            s = s[k]
        s[path[-1]] = value
    return change


def _without_cupy(call):
    """``call()`` as on a machine without a GPU, CuPy or the simulator."""
    cfg = device.numba_cuda_config
    was, saved = cfg.ENABLE_CUDASIM, sys.modules.get("cupy", "absent")
    cfg.ENABLE_CUDASIM, sys.modules["cupy"] = 0, None  # (None: `import cupy` fails, find_spec says absent)
    try:
        return call()
    finally:
        cfg.ENABLE_CUDASIM = was
        if saved == "absent":
            del sys.modules["cupy"]
        else:
            sys.modules["cupy"] = saved


P5 = np.array([[1, 2, 3, 0.5], [4, 5, 6, 0.1]], np.float32)


def _two_jitters(rng):
    return augment.jitter(augment.jitter(P5, rng), rng)


# (id, call(tmp), expected)
CASES = [
    # ns.load of what is not a checkpoint: ValueError naming the file and what it is
    ("load an empty file", lambda t: _load(t, "e.npz", lambda p: p.write_bytes(b"")),
     (ValueError, r"e\.npz: the file is empty.*Load an earlier checkpoint")),
    ("load a truncated file", lambda t: _load(t, "cut.npz", _truncated),
     (ValueError, r"cut\.npz: its contents are damaged or incomplete .*was its writing interrupted")),
    ("load a text file", lambda t: _load(t, "notes.npz", lambda p: p.write_text("epoch 3: loss 0.4\n")),
     (ValueError, r"notes\.npz: the file is not a zip archive")),
    ("load a .npy file", lambda t: _load(t, "w.npy", lambda p: np.save(p, np.zeros(3))),
     (ValueError, r"w\.npy: the file holds a single NumPy array \(\.npy, written by np\.save\)")),
    ("load an .npz naming a missing array", lambda t: _load(t, "x.npz", _pointing_nowhere),
     (ValueError, r"x\.npz: its contents are damaged .*KeyError")),
    ("load a folder", lambda t: _load(t, "runs", lambda p: p.mkdir()),
     (IsADirectoryError, r"runs is a folder, not a checkpoint")),
    # ns.save: refused before anything is written
    ("save into a missing folder", lambda t: ns.save({"a": 1}, Path(t) / "nodir" / "run.npz"),
     (FileNotFoundError, r"the folder .*nodir does not exist; create it first")),
    ("save over a folder", lambda t: ns.save({"a": 1}, _file(t, "run.npz", lambda p: p.mkdir())),
     (IsADirectoryError, r"run\.npz is a folder; give a file name inside it")),
    # BatchNorm after a training step: its counter stays an array a checkpoint loads into
    ("num_batches_tracked after training", lambda t: type(_trained_bn().num_batches_tracked),
     lambda kind: kind is np.ndarray),
    ("load_state_dict after training", lambda t: _bn_after_training_loads(), lambda n: n.shape == () and n == 0),
    # model.load_state_dict of what is not its state
    ("model state from a whole checkpoint", lambda t: nn.BatchNorm(2).load_state_dict(
        {"model": nn.BatchNorm(2).state_dict(), "epochs_done": 1}),
     (KeyError, r"a whole training checkpoint: pass its model's state, checkpoint\['model'\]")),
    ("model state as a list", lambda t: nn.BatchNorm(2).load_state_dict(list(nn.BatchNorm(2).state_dict().items())),
     (TypeError, r"state must be a dict name -> array .*got list")),
    # Optimizer.load_state_dict: everything checked before anything changes
    ("optimizer state without 'state'", lambda t: _load_sgd(lambda s: s.pop("state")),
     (ValueError, r"the optimizer state dict lacks \['state'\].*checkpoint\['optimizer'\]")),
    ("optimizer step -1", lambda t: _load_sgd(_set(["state", "w", "step"], -1)),
     (ValueError, r"state 'step' of 'w' must be a whole number >= 0 .*got -1")),
    ("optimizer step 2.5", lambda t: _load_sgd(_set(["state", "w", "step"], 2.5)),
     (ValueError, r"state 'step' of 'w' must be a whole number >= 0 .*got 2\.5")),
    ("optimizer step True", lambda t: _load_sgd(_set(["state", "w", "step"], True)),
     (ValueError, r"state 'step' of 'w' must be a whole number >= 0 .*got True")),
    ("optimizer NaN moment", lambda t: _load_sgd(_set(["state", "w", "momentum_buffer"], np.array([np.nan, 1.0]))),
     (ValueError, r"state 'momentum_buffer' of 'w' holds NaN or inf")),
    ("optimizer inf moment", lambda t: _load_sgd(_set(["state", "w", "momentum_buffer"], np.array([np.inf, 1.0]))),
     (ValueError, r"state 'momentum_buffer' of 'w' holds NaN or inf")),
    ("optimizer state of other parameters", lambda t: _load_sgd(lambda s: s["state"].update(v=s["state"].pop("w"))),
     (KeyError, r"the state dict is for other parameters: it holds \['v'\].*lacks \['w'\]")),
    # the device, without CuPy: SparseTensor.to says what model.to says
    ("SparseTensor.to('cuda') without CuPy", lambda t: _without_cupy(lambda: ns.SparseTensor(C3, F3).to("cuda")),
     (RuntimeError, r"SparseTensor.to\('cuda'\) needs CuPy: pip install 'numba-sc\[cuda12\]'")),
    # augmentations: a Generator, an int seed or None; anything else named
    ("rotate_z with a seed", lambda t: augment.rotate_z(P5, 3).tolist(),
     lambda r: r == augment.rotate_z(P5, np.random.default_rng(3)).tolist()),
    ("flip with rng=None", lambda t: augment.flip(P5, None).shape, lambda s: s == (2, 4)),
    ("scale with a seed", lambda t: augment.scale(P5, 0).tolist(),
     lambda r: r == augment.scale(P5, np.random.default_rng(0)).tolist()),
    ("jitter with rng=None", lambda t: augment.jitter(P5, None).shape, lambda s: s == (2, 4)),
    ("crop with a seed", lambda t: augment.crop(P5, None, 1, size=100.0)[0].shape, lambda s: s == (2, 4)),
    ("compose with a seed: one generator", lambda t: augment.compose(augment.jitter, augment.jitter)(P5, 5).tolist(),
     lambda r: r == _two_jitters(np.random.default_rng(5)).tolist()),
    ("augment with a string", lambda t: augment.scale(P5, "seed"),
     (TypeError, r"rng must be a numpy.random.Generator .*an int seed or None, got str 'seed'")),
    ("augment with a float seed", lambda t: augment.rotate_z(P5, 0.5),
     (TypeError, r"rng must be a numpy.random.Generator .*got float 0.5")),
    ("augment with a bool", lambda t: augment.flip(P5, True), (TypeError, r"rng must be .*got bool True")),
]


@pytest.mark.parametrize("call,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_state_edge(call, expected, tmp_path):
    run_case(lambda: call(tmp_path), expected)


# ---------------------------------------------------------------- a kill mid-save
WRITER = """
import sys
import numpy as np
import numba_sc as ns
target, n = sys.argv[1], int(sys.argv[2])
states = [{"w": np.full(n, float(v)), "v": v} for v in (1, 2)]
print("ready", flush=True)
i = 0
while True:  # saves back to back: a kill lands inside one
    ns.save(states[i % 2], target)
    i += 1
"""


def test_a_writer_killed_mid_save_leaves_a_whole_checkpoint(tmp_path):
    """A process saving a 40 MB state over and over is SIGKILLed at several moments; each
    time the checkpoint loads and is one of the states, whole. A kill leaves at most one
    temporary file (``.run.npz.tmp-*``: the unfinished write, never read; deleted here)."""
    target = tmp_path / "run.npz"
    n = 5_000_000  # float64: 40 MB a state
    assert ns.save({"w": np.zeros(n), "v": 0}, tmp_path / "run") == target  # ".npz" added, as np.savez does
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    rng = np.random.default_rng(0)
    seen = set()
    for kill in range(5):
        p = subprocess.Popen([sys.executable, "-c", WRITER, str(target), str(n)], env=env, stdout=subprocess.PIPE,
                             text=True)
        try:
            assert p.stdout.readline().strip() == "ready"
            time.sleep(float(rng.uniform(0.05, 1.5)))  # a few saves in, somewhere inside one
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
        ckpt = ns.load(target)
        v = ckpt["v"]
        assert v in (0, 1, 2) and ckpt["w"].shape == (n,) and (ckpt["w"] == v).all(), f"kill {kill}: torn"
        seen.add(v)
        left = [f for f in os.listdir(tmp_path) if f != "run.npz"]  # the killed write's temporary
        assert len(left) <= 1, left
        for f in left:
            os.unlink(tmp_path / f)
    assert os.listdir(tmp_path) == ["run.npz"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    from numba_sc.core.files import atomic_write

    target = tmp_path / "log.json"
    target.write_text("old")

    def fails(f):
        f.write("new, half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, fails, mode="w")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["log.json"]


# ---------------------------------------------------------------- state and objects
def _step(model, x, rng):
    with nn.Tape() as tape:
        y = model(x, backend="reference")
    return tape.backward(y, rng.normal(size=y.features.shape).astype(np.float32))


def test_rolling_back_to_a_checkpoint_after_training(tmp_path, rng):
    """The README's promise: train, save, train on, load the saved state: the model is
    the saved one again (its outputs bit for bit), also after its BatchNorm trained."""
    coords = np.unique(rng.integers(0, 6, (60, 3)), axis=0).astype(np.int32)
    x = ns.SparseTensor(coords, rng.normal(size=(len(coords), 4)).astype(np.float32))
    model = nn.Sequential(nn.SubMConv3d(4, 6, 3, rng=rng), nn.BatchNorm(6), nn.ReLU(), nn.Linear(6, 3, rng=rng))
    opt = optim.AdamW(model.trainable_parameters(), lr=1e-2)
    model.train()
    opt.step(_step(model, x, rng))
    path = ns.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "good.npz")
    want = model.eval()(x, backend="reference").features
    model.train()
    for _ in range(2):
        opt.step(_step(model, x, rng))
    assert not np.array_equal(model.eval()(x, backend="reference").features, want)
    ckpt = ns.load(path)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    np.testing.assert_array_equal(model(x, backend="reference").features, want)


def test_one_module_in_two_sequentials_gets_its_own_names(rng):
    """``net = Sequential(a, b)``, ``net2 = Sequential(b, a)``: a tape over ``net`` names
    the gradients as ``net.named_parameters()`` does, whichever network ran before, and
    the optimizer keeps each parameter's moments on that parameter."""
    coords = np.unique(rng.integers(0, 5, (40, 3)), axis=0).astype(np.int32)
    x = ns.SparseTensor(coords, rng.normal(size=(len(coords), 3)).astype(np.float32))
    a, b = nn.Linear(3, 3, rng=rng), nn.Linear(3, 3, rng=rng)
    net, net2 = nn.Sequential(a, b), nn.Sequential(b, a)
    net(x, backend="reference")  # names a "0" and b "1" ...
    _step(net2, x, rng)  # ... and a tape over net2 in between
    with nn.Tape() as tape:
        y = net(x, backend="reference")
    net2(x, backend="reference")  # another network called between the forward and the backward
    grads = tape.backward(y, np.ones_like(y.features))
    params = dict(net.named_parameters())
    assert all(grads.arrays[k] is params[k] for k in grads), "a gradient under another parameter's name"
    # the weight gradient of a Linear is x.T @ g: check a's and b's by their inputs
    np.testing.assert_allclose(grads["1.weight"], a(x, backend="reference").features.T @ np.ones_like(y.features),
                               rtol=1e-5)

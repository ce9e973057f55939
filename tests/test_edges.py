"""Trust at the edges (#26): bad or unusual input gets a clear error naming the argument
and the fix, or the right result; never a silent wrong answer.

One table: each case is one line, the call and what it must give (an exception class
and words of its message, or a check of the result). A new case is a new line.
"""
import numpy as np
import pytest
from helpers import check_case

import numba_sc as ns
from numba_sc import nn
from numba_sc.train import labels, optim
from numba_sc.train.loss import cross_entropy

C3 = np.array([[0, 0, 0], [1, 0, 0], [0, 1, 0]], np.int32)
F3 = np.ones((3, 2), np.float32)


def _bn_state(**changes):
    m = nn.BatchNorm(2)
    sd = m.state_dict()
    sd.update({k: np.asarray(v) for k, v in changes.items()})
    return m, sd


def _sgd_state(**hyper):
    o = optim.SGD([("w", np.ones(2, np.float32))], lr=0.1, momentum=0.9)
    s = o.state_dict()
    s["hyperparameters"].update(hyper)
    return o, s


def _load_bn(**changes):
    m, sd = _bn_state(**changes)
    return m.load_state_dict(sd)


def _load_sgd(**hyper):
    o, s = _sgd_state(**hyper)
    return o.load_state_dict(s)


def _conv(**kw):
    return ns.sparse_conv3d(ns.SparseTensor(C3, F3), np.ones((27, 2, 2), np.float32), backend="reference", **kw)


# (id, call, expected): expected is (exception class, regex) or a function of the result -> bool
CASES = [
    # coordinates: refused before any cast (uint32 4294967295 once became -1, int64 2**32 + 5 became 5)
    ("uint32 coords", lambda: ns.SparseTensor(np.array([[4294967295, 0, 0], [1, 0, 0]], np.uint32), F3[:2]),
     (ValueError, r"coords: spatial coordinates must lie in the packable range .*4294967295")),
    ("int64 coords past int32", lambda: ns.SparseTensor(np.array([[2**32 + 5, 0, 0], [1, 0, 0]]), F3[:2]),
     (ValueError, r"packable range .*4294967301")),
    ("uint64 coords", lambda: ns.SparseTensor(np.array([[2**63, 0, 0], [1, 0, 0]], np.uint64), F3[:2]),
     (ValueError, r"packable range")),
    ("int64 coords in range", lambda: ns.SparseTensor(C3.astype(np.int64), F3).coords.dtype == np.int32,
     lambda ok: ok),
    ("stride-2 tensor on odd coords", lambda: ns.SparseTensor(C3, F3, stride=2),
     (ValueError, r"coords must be multiples of the tensor stride \(2, 2, 2\).* \[1, 0, 0\]")),
    ("stride-2 tensor on even coords", lambda: len(ns.SparseTensor(C3 * 2, F3, stride=2)), lambda n: n == 3),
    # checkpoints and layer arguments
    ("negative running_var", lambda: _load_bn(running_var=[-1.0, 1.0]),
     (ValueError, r"running_var: a variance cannot be negative")),
    ("NaN num_batches_tracked", lambda: _load_bn(num_batches_tracked=np.nan),
     (ValueError, r"num_batches_tracked: the checkpoint holds NaN")),
    ("fractional num_batches_tracked", lambda: _load_bn(num_batches_tracked=2.5),
     (ValueError, r"num_batches_tracked: an integer parameter")),
    ("strings in a checkpoint", lambda: _load_bn(weight=np.array(["a", "b"])),
     (TypeError, r"weight: the checkpoint holds <U1 values")),
    ("complex numbers in a checkpoint", lambda: _load_bn(weight=np.array([1 + 2j, 1])),
     (TypeError, r"weight: the checkpoint holds complex128 values")),
    ("BatchNorm eps < 0", lambda: nn.BatchNorm(3, eps=-1e-5), (ValueError, r"eps must be a small positive number")),
    ("BatchNorm(-1)", lambda: nn.BatchNorm(-1), (ValueError, r"num_features must be a positive int, got -1")),
    ("Linear(3.7, 2)", lambda: nn.Linear(3.7, 2), (ValueError, r"in_features must be a positive int, got 3.7")),
    ("Linear(0, 5)", lambda: nn.Linear(0, 5), (ValueError, r"in_features must be a positive int, got 0")),
    ("SGD state with momentum -5", lambda: _load_sgd(momentum=-5), (ValueError, r"momentum must be a finite number >= 0")),
    # #33: a float or a bool is not a size, even inside a tuple
    ("kernel_size (3, 3, 3.0)", lambda: _conv(kernel_size=(3, 3, 3.0)),
     (TypeError, r"kernel_size must be an int or a sequence of 3 ints, got \(3, 3, 3\.0\)")),
    ("stride (2, 2, True)", lambda: nn.SparseConv3d(2, 2, 2, stride=(2, 2, True)),
     (TypeError, r"stride must be an int or a sequence of 3 ints")),
    ("voxel_size True", lambda: ns.voxelize(np.zeros((3, 3), np.float32), True),
     (TypeError, r"voxel_size must be a positive finite number or 3 of them")),
    ("voxel_size as np.float32", lambda: len(ns.voxelize(np.zeros((3, 3), np.float32), np.float32(0.5))), lambda n: n == 1),
    ("MinkUNet42 num_classes 5.0", lambda: ns.models.MinkUNet42(4, 5.0),
     (ValueError, r"num_classes must be a positive int, got 5\.0")),
    ("AdamW lr as np.float32", lambda: optim.AdamW([("w", np.ones(2, np.float32))], lr=np.float32(1e-3)).lr,
     lambda lr: abs(lr - 1e-3) < 1e-9),
    ("SGD lr True", lambda: optim.SGD([("w", np.ones(2, np.float32))], lr=True), (ValueError, r"lr must be a finite")),
    # labels
    ("float label ids", lambda: labels.learning_map(np.array([40.7])), (ValueError, r"must hold whole label ids")),
    ("whole float label ids", lambda: labels.learning_map(np.array([40.0, 10.0])).tolist(),
     lambda v: v == labels.learning_map(np.array([40, 10])).tolist()),
    ("negative label words", lambda: labels.semantic_ids(np.array([-3])), (ValueError, r"0 \.\. 2\*\*32 - 1")),
    ("voxel_labels with 0 classes", lambda: labels.voxel_labels(np.zeros(5, np.int64), np.zeros(5, np.int64), 0),
     (ValueError, r"num_classes must be a positive int")),
    ("cross_entropy of no rows", lambda: cross_entropy(np.zeros((0, 3), np.float32), np.zeros(0, np.int64)),
     (ValueError, r"logits has no rows")),
    # errors that say what to fix
    ("a layer given a NumPy array", lambda: nn.SubMConv3d(3, 3)(np.ones((3, 3), np.float32)),
     (TypeError, r"layer 'SubMConv3d' .*x must be a numba_sc.SparseTensor .*got ndarray")),
    ("build_kernel_map of a list", lambda: ns.build_kernel_map([[0, 0, 0], [1, 0, 0]], 3),
     (TypeError, r"in_coords must be a NumPy or CuPy integer array .*got list")),
    ("layer named by a list", lambda: _conv(layer=["a"]), (TypeError, r"layer must be a name for the layer")),
    ("model.to('cuda') is a device", lambda: nn.Linear(2, 3).to("cpu", np.float16).weight.dtype,
     lambda dt: dt == np.float16),
    ("model.to('gpu')", lambda: nn.Linear(2, 3).to("gpu"), (TypeError, r"to\(\) takes a device .* or a dtype")),
    ("SparseTensor.to(float16)", lambda: ns.SparseTensor(C3, F3).to(np.float16).features.dtype,
     lambda dt: dt == np.float16),
    ("SparseTensor.cpu()", lambda: type(ns.SparseTensor(C3, F3).cpu().coords), lambda t: t is np.ndarray),
    ("SparseTensor.to('tpu')", lambda: ns.SparseTensor(C3, F3).to("tpu"), (ValueError, r"device must be 'cuda' or")),
]


@pytest.mark.parametrize("call,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_edge(call, expected):
    check_case(call, expected)


# ---------------------------------------------------------------- training through replacements
def _small_problem(rng):
    pts = rng.normal(size=(400, 3)).astype(np.float32)
    vox = ns.voxelize(pts, 0.4, backend="reference")
    n = len(vox.coords)
    x = ns.SparseTensor(vox.coords, rng.normal(size=(n, 4)).astype(np.float32))
    target = rng.integers(0, 3, n)
    model = nn.Sequential(nn.SubMConv3d(4, 8, 3, rng=rng), nn.BatchNorm(8), nn.ReLU(),
                          nn.Linear(8, 3, rng=rng)).train()  # seeded: the same weights every run
    return x, target, model


def _losses(model, opt, x, target, steps=8):
    out = []
    for _ in range(steps):
        with nn.Tape() as tape:
            y = model(x, backend="reference")
        loss, g = cross_entropy(y.features, target)
        opt.step(tape.backward(y, g))
        out.append(float(loss))
    return out


@pytest.mark.parametrize("change", ["load_state_dict", "half", "float"])
def test_an_optimizer_built_before_a_change_trains(change, rng):
    """``load_state_dict`` writes into the parameters (their identity is kept); ``half()``
    makes new arrays, which the optimizer follows by name at its next step."""
    x, target, model = _small_problem(rng)
    other = nn.Sequential(nn.SubMConv3d(4, 8, 3), nn.BatchNorm(8), nn.ReLU(), nn.Linear(8, 3))
    opt = optim.AdamW(model.trainable_parameters(), lr=2e-2, weight_decay=0.0)
    before = dict(model.named_parameters())
    if change == "load_state_dict":
        model.load_state_dict(other.state_dict())
        assert all(v is before[k] for k, v in model.named_parameters())  # in place
        np.testing.assert_array_equal(model.state_dict()["0.weight"], other.state_dict()["0.weight"])
    elif change == "half":
        model.half()
        x = x.to(np.float16)
    else:
        model.float()  # nothing to change: the very same arrays
        assert all(v is before[k] for k, v in model.named_parameters())
    losses = _losses(model, opt, x, target)
    assert losses[-1] < 0.8 * losses[0], losses
    if change == "half":  # the optimizer now updates the model's float16 arrays
        assert all(opt.params[k] is v for k, v in model.trainable_parameters())


@pytest.mark.skipif(not ns.gpu_present(), reason="under the simulator .cuda() keeps the very same NumPy arrays")
def test_an_optimizer_built_before_cuda_follows_the_device_arrays(rng):
    import cupy

    x, target, model = _small_problem(rng)
    opt = optim.AdamW(model.trainable_parameters(), lr=2e-2, weight_decay=0.0)
    model.cuda()
    x = x.cuda()
    losses = []
    for _ in range(8):
        with nn.Tape() as tape:
            y = model(x)
        loss, g = cross_entropy(y.features, cupy.asarray(target))
        opt.step(tape.backward(y, g))
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0], losses
    assert all(opt.params[k] is v and isinstance(v, cupy.ndarray) for k, v in model.trainable_parameters())


def test_a_layer_trained_on_its_own_names_its_gradients_as_its_parameters(rng):
    x, target, _ = _small_problem(rng)
    layer = nn.SubMConv3d(4, 3, 3)
    opt = optim.SGD(layer.trainable_parameters(), lr=0.05)
    losses = _losses(layer, opt, x, target, steps=4)
    assert losses[-1] < losses[0]


def test_save_and_load_reproduce_a_model_bit_for_bit(tmp_path, rng):
    x, target, model = _small_problem(rng)
    model.eval()
    opt = optim.AdamW(model.trainable_parameters(), lr=1e-2)
    _losses(model.train(), opt, x, target, steps=2)
    model.eval()
    want = model(x, backend="reference").features
    path = ns.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 2}, tmp_path / "run")
    assert path.suffix == ".npz"
    ckpt = ns.load(path)
    assert ckpt["step"] == 2 and ckpt["optimizer"]["optimizer"] == "AdamW"
    fresh = nn.Sequential(nn.SubMConv3d(4, 8, 3), nn.BatchNorm(8), nn.ReLU(), nn.Linear(8, 3)).eval()
    fresh.load_state_dict(ckpt["model"])
    got = fresh(x.without_maps(), backend="reference").features
    assert got.dtype == want.dtype and np.array_equal(got, want)  # bit for bit
    opt2 = optim.AdamW(fresh.trainable_parameters(), lr=0.5)
    opt2.load_state_dict(ckpt["optimizer"])
    assert opt2.lr == opt.lr and opt2.state["0.weight"]["step"] == 2


@pytest.mark.parametrize("bad,match", [
    ({"a": object()}, r"cannot save a object"),
    ({1: np.zeros(2)}, r"keys must be strings"),
    ({"a": np.array([None], dtype=object)}, r"array of Python objects"),
])
def test_save_refuses_what_it_cannot_round_trip(tmp_path, bad, match):
    with pytest.raises(TypeError, match=match):
        ns.save(bad, tmp_path / "x.npz")


def test_load_refuses_a_file_that_is_not_a_checkpoint(tmp_path):
    np.savez(tmp_path / "plain.npz", w=np.zeros(3))
    with pytest.raises(ValueError, match="not a numba-sc checkpoint"):
        ns.load(tmp_path / "plain.npz")
    with pytest.raises(FileNotFoundError):
        ns.load(tmp_path / "missing.npz")


def test_two_models_on_one_tensor():
    """The second model's strided layers reuse the maps the first built on these
    coordinates; its transposed layers must find them (they once refused, naming the
    first model's layer)."""
    from helpers import scan_crop

    x = scan_crop(60)
    a = ns.models.MinkUNet42(4, 5, width=0.125)
    b = ns.models.MinkUNet42(4, 5, width=0.125, seed=1)
    ya = a(x, backend="reference")
    yb = b(x, backend="reference")
    assert ya.features.shape == yb.features.shape == (len(x), 5)
    np.testing.assert_array_equal(a(x, backend="reference").features, ya.features)


# ---------------------------------------------------------------- the command line
@pytest.mark.parametrize("argv,words", [
    (["check", "--crop", "-5"], "argument --crop: must be at least 1, got -5"),
    (["train", "--crop", "-5"], "argument --crop: must be at least 1, got -5"),
    (["train", "--crop", "0"], "argument --crop: must be at least 1, got 0"),
    (["train", "--log-every", "0"], "argument --log-every: must be at least 1, got 0"),
    (["train", "--steps", "0"], "argument --steps: must be at least 1"),
    (["train", "--lr", "nan"], "argument --lr: must be a positive number"),
    (["demo", "--voxel-size", "0"], "argument --voxel-size: must be a positive number"),
    (["demo", "--columns", "2"], "argument --columns: must be at least 3"),
    (["ladder", "--dtypes", ""], "argument --dtypes: a comma-separated list of float32 and float16"),
    (["ladder", "--dtypes", "float64"], "argument --dtypes: a comma-separated list of float32 and float16"),
    (["ladder", "--channels", "0"], "argument --channels: must be at least 1, got 0"),
    (["ladder", "--rounds", "x"], "argument --rounds: 'x' is not an integer"),
])
def test_command_line_refuses_out_of_range_numbers(argv, words, capsys):
    from numba_sc.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_command_line_version_and_help_are_plain_text(capsys):
    from numba_sc.__main__ import main

    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"numba-sc {ns.__version__}"
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "``" not in text and ":mod:" not in text and "numba-sc train overfit --steps 300" in text
    for command in ("demo", "check", "ladder", "train"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "example:\n  numba-sc " + command in capsys.readouterr().out


def test_train_refuses_labels_of_another_length(tmp_path, capsys):
    from numba_sc.__main__ import main
    from conftest import load_scan  # (skips without the real scan, as in an sdist)

    load_scan("semantickitti")[:50].tofile(tmp_path / "semantickitti_000000.bin")  # 50 points
    np.zeros(40, np.uint32).tofile(tmp_path / "semantickitti_000000.label")  # 40 labels
    assert main(["train", "--data", str(tmp_path), "--steps", "1", "--crop", "20"]) == 2
    assert "has 40 labels but the .bin has 50 points" in capsys.readouterr().err

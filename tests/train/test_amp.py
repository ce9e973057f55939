"""Mixed precision (numba_sc.train.amp, Trainer(amp=True)): a float16 step close to the float32
one, an overflowing step skipped with the scale halved, the scale doubled after good steps,
and a resumed amp run with the very losses and scales of an uninterrupted one."""
import numpy as np
import pytest

from numba_sc import nn
from numba_sc.train import amp, data, optim
from numba_sc.train import run as tr
from numba_sc.train.checkpoint import load
from numba_sc.train.labels import IGNORE_INDEX, learning_map
from numba_sc.train.trainer import Trainer

from conftest import DATA_DIR, load_scan
from helpers import stop_after_first_checkpoint


@pytest.fixture(scope="module")
def crops():
    """Four labelled crops of the shared scan, 40 points each, as (points, raw labels)."""
    points = load_scan("semantickitti")
    raw = np.fromfile(DATA_DIR / "semantickitti_000000.label", np.uint32)
    labelled = np.flatnonzero(learning_map(raw) != IGNORE_INDEX)
    out = []
    for i in range(4):
        keep = np.argsort(np.abs(points[:, :3] - points[labelled[i * 20000], :3]).max(axis=1), kind="stable")[:40]
        out.append((points[keep], raw[keep]))
    return out


def _model(k=3):
    rng = np.random.default_rng(0)
    return nn.Sequential(nn.SubMConv3d(2, 8, k, rng=rng), nn.BatchNorm(8), nn.ReLU(), nn.Linear(8, 19, rng=rng))


def _batch(crops, n=2):
    return data.collate_items([tr.prepare_scan(p, r, None, augmentation=False) for p, r in crops[:n]])


def test_loss_scaler_worked_example():
    """The docstring's table: growth_interval 2, starting at 8."""
    s = amp.LossScaler(init_scale=8.0, growth_interval=2)
    seen = []
    for finite in (True, True, False, True):
        s.update(finite)
        seen.append((s.scale, s.good_steps))
    assert seen == [(8.0, 1), (16.0, 0), (8.0, 0), (8.0, 1)] and s.skipped == 1
    s2 = amp.LossScaler()
    s2.load_state_dict(s.state_dict())
    assert s2.state_dict() == s.state_dict()
    low = amp.LossScaler(init_scale=2.0, min_scale=1.0)
    low.update(False)
    low.update(False)
    assert low.scale == 1.0  # never below min_scale
    with pytest.raises(ValueError, match="power of two"):
        amp.LossScaler(init_scale=1000.0)
    with pytest.raises(ValueError, match="good_steps"):
        s2.load_state_dict({**s.state_dict(), "good_steps": 2})


def test_an_amp_step_is_close_to_the_float32_step(crops):
    """The simulator's float16 kernels: one step of each from the same weights; the loss
    (computed from float16 logits) and the updated weights agree to float16's precision,
    and the model computes in float16 while the optimizer's masters stay float32."""
    b = _batch(crops)
    target = b.concat(0)
    m32, m16 = _model(1), _model(1)
    t32 = Trainer(m32, optim.SGD(m32.trainable_parameters(), lr=0.1))
    t16 = Trainer(m16, optim.SGD(m16.trainable_parameters(), lr=0.1), amp=True, init_scale=2.0 ** 10)
    loss32, loss16 = t32.step(b.tensor, target), t16.step(b.tensor, target)
    assert np.isfinite(loss16) and loss16 == pytest.approx(loss32, rel=2e-3)
    assert t16.dtype == np.float16 and m16[0].weight.dtype == np.float16
    assert t16.scaler.skipped == 0
    for name, w32 in m32.state_dict().items():
        w16 = t16.model_state_dict()[name]
        assert w16.dtype == w32.dtype  # the full-precision model: the masters
        assert np.abs(w16.astype(np.float64) - w32).max() <= 2e-3 * max(np.abs(w32).max(), 1.0), name
    np.testing.assert_array_equal(m16[0].weight, t16.masters.masters["0.weight"].astype(np.float16))


OVERFLOW = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                      "ignore:invalid value encountered:RuntimeWarning")  # (meant to happen)


@OVERFLOW
def test_an_overflowing_step_is_skipped_and_halves_the_scale(crops):
    """A scale of 2**40 drives the float16 gradients past 65504: no weight, no optimizer
    state changes, the scale halves; then a scale that fits trains."""
    b = _batch(crops)
    m = _model()
    opt = optim.AdamW(m.trainable_parameters(), lr=0.1)
    trainer = Trainer(m, opt, amp=True, init_scale=2.0 ** 40, backend="reference")
    before = trainer.model_state_dict()
    loss = trainer.step(b.tensor, b.concat(0))
    assert np.isfinite(loss)  # the loss itself is fine; its scaled gradient is not
    assert trainer.scaler.scale == 2.0 ** 39 and trainer.scaler.skipped == 1
    after = trainer.model_state_dict()
    assert all(np.array_equal(before[k], after[k]) for k in before if "running" not in k and "tracked" not in k)
    assert all(s["step"] == 0 and "exp_avg" not in s for s in opt.state.values())
    trainer.scaler.scale = 2.0 ** 8
    trainer.step(b.tensor, b.concat(0))
    assert trainer.scaler.skipped == 1 and all(s["step"] == 1 for s in opt.state.values())
    assert not np.array_equal(before["0.weight"], trainer.model_state_dict()["0.weight"])


def test_the_scale_doubles_after_growth_interval_good_steps(crops):
    b = _batch(crops)
    m = _model()
    trainer = Trainer(m, optim.SGD(m.trainable_parameters(), lr=0.01), amp=True, init_scale=2.0 ** 4,
                      growth_interval=3, backend="reference")
    scales = []
    for _ in range(4):
        trainer.step(b.tensor, b.concat(0))
        scales.append(trainer.scaler.scale)
    assert scales == [16.0, 16.0, 32.0, 32.0] and trainer.scaler.skipped == 0


def test_mixed_precision_needs_the_optimizer_on_the_float32_model():
    m = _model()
    other = {k: v.copy() for k, v in m.trainable_parameters()}
    with pytest.raises(ValueError, match="not the model's array"):
        amp.MasterWeights(m, optim.SGD(other, lr=0.1))
    m.half()
    with pytest.raises(TypeError, match="float32 model"):
        amp.MasterWeights(m, optim.SGD(m.trainable_parameters(), lr=0.1))


def _amp_run(crops, stop, start=0, history=None, trainer=None, save_to=None, epochs=3):
    """Epochs ``start .. stop - 1`` of an amp run of ``epochs`` epochs (its schedule spans them all);
    a growth interval of 2 and a first scale that overflows, so skips and growth both happen."""
    loader = data.Loader(crops, 2, lambda p, r, rng: tr.prepare_scan(p, r, rng), seed=3, workers=1)
    if trainer is None:
        m = _model()
        trainer = Trainer(m, optim.AdamW(m.trainable_parameters(), lr=1e-2), amp=True, init_scale=2.0 ** 24,
                          growth_interval=2, backend="reference")
    total = epochs * len(loader)
    hist = tr.fit_dataset(trainer.model, trainer.optimizer, loader, stop, start_epoch=start, history=history,
                          schedule=lambda s: optim.cosine_lr(s, total, 1e-2, warmup=2), save_to=save_to,
                          backend="reference", print_=lambda s: None, trainer=trainer)
    return hist, trainer


@OVERFLOW
def test_a_resumed_amp_run_has_the_losses_and_scales_of_an_uninterrupted_one(crops, tmp_path):
    straight, t = _amp_run(crops, 3)
    assert t.scaler.skipped >= 1 and len({h["loss_scale"] for h in straight}) > 1  # both rules ran
    _amp_run(crops, 1, save_to=tmp_path / "run.npz")
    ckpt = load(tmp_path / "run.npz")
    assert ckpt["model"]["0.weight"].dtype == np.float32 and ckpt["amp"]["scale"] == straight[0]["loss_scale"]
    m = _model()
    fresh = Trainer(m, optim.AdamW(m.trainable_parameters(), lr=0.5), amp=True, backend="reference")
    done, history, _ = tr.resume(tmp_path / "run.npz", m, fresh.optimizer, fresh)
    resumed, _ = _amp_run(crops, 3, start=done, history=history, trainer=fresh)
    assert [h["losses"] for h in resumed] == [h["losses"] for h in straight]  # exactly
    assert [h["loss_scale"] for h in resumed] == [h["loss_scale"] for h in straight]
    assert fresh.scaler.state_dict() == t.scaler.state_dict()
    for name, w in t.model_state_dict().items():
        np.testing.assert_array_equal(fresh.model_state_dict()[name], w, err_msg=name)


@OVERFLOW
def test_the_command_trains_with_amp_and_resumes_only_with_it(crops, tmp_path, capsys, monkeypatch):
    from numba_sc.__main__ import main
    from numba_sc.train import run as tr

    for i, (p, r) in enumerate(crops[:2]):
        p.tofile(tmp_path / f"crop{i}.bin")
        r.tofile(tmp_path / f"crop{i}.label")
    ckpt = tmp_path / "run.npz"
    argv = ["train", "fit", "--data", str(tmp_path), "--batch-size", "2", "--width", "0.125", "--workers", "0",
            "--save", str(ckpt), "--epochs", "2", "--amp"]
    stop_after_first_checkpoint(main, argv, monkeypatch)  # a run of two epochs, stopped after its first checkpoint
    assert "mixed precision" in capsys.readouterr().err
    saved = load(ckpt)
    assert saved["settings"]["amp"] is True and saved["amp"]["scale"] > 0
    assert saved["model"]["stem.0.weight"].dtype == np.float32  # the masters, not their float16 roundings
    assert main(argv + ["--resume", str(ckpt)]) == 0
    assert "resumed from" in capsys.readouterr().err
    assert main(argv[:-1] + ["--resume", str(ckpt)]) == 2  # without --amp: another run
    assert "other settings" in capsys.readouterr().err

"""Checkpoints (numba_sc.train.checkpoint): what is saved comes back with the same
nesting, dtypes, shapes and bits; what cannot be stored safely is refused before a
byte is written; a file that is not a checkpoint is named and refused."""
import math

import numpy as np
import pytest

from numba_sc.train.checkpoint import load, save


def test_a_nested_state_comes_back_bit_for_bit(tmp_path):
    rng = np.random.default_rng(0)
    state = {"model": {"w": rng.standard_normal((3, 4)).astype(np.float16),
                       "b": rng.standard_normal(4).astype(np.float32),
                       "idx": np.arange(5, dtype=np.int64)},
             "optimizer": {"step": 3, "lr": 0.1, "betas": (0.9, 0.999), "names": ["a", "b"], "amsgrad": False,
                           "scale": np.float32(2.0 ** 16), "none": None},
             "odd": {"inf": math.inf, "nan": math.nan, "tiny": 5e-324}}
    path = save(state, tmp_path / "run")
    assert path == tmp_path / "run.npz" and path.is_file()
    back = load(tmp_path / "run")  # the .npz found without its suffix
    for k in ("w", "b", "idx"):
        a, b = state["model"][k], back["model"][k]
        assert type(b) is np.ndarray and a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    opt = back["optimizer"]
    assert opt["step"] == 3 and type(opt["step"]) is int and opt["lr"] == 0.1
    assert opt["betas"] == (0.9, 0.999) and type(opt["betas"]) is tuple and opt["names"] == ["a", "b"]
    assert opt["amsgrad"] is False and opt["none"] is None
    assert type(opt["scale"]) is np.float32 and opt["scale"] == 2.0 ** 16
    assert back["odd"]["inf"] == math.inf and math.isnan(back["odd"]["nan"]) and back["odd"]["tiny"] == 5e-324


@pytest.mark.parametrize("state, match", [
    ({1: np.zeros(2)}, "keys must be strings"),
    ({"a": np.array([object()], dtype=object)}, "Python objects"),
    ({"a": {1, 2}}, "cannot save a set"),
])
def test_what_cannot_be_stored_is_refused_before_writing(tmp_path, state, match):
    with pytest.raises(TypeError, match=match):
        save(state, tmp_path / "x.npz")
    assert not list(tmp_path.iterdir())
    with pytest.raises(TypeError, match="must be a dict"):
        save([np.zeros(2)], tmp_path / "x.npz")


def test_what_is_not_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load(tmp_path / "missing.npz")
    with pytest.raises(IsADirectoryError):
        load(tmp_path)
    cases = {"empty.npz": b"", "text.npz": b"hello, world\n"}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
    np.save(tmp_path / "one.npy", np.zeros(3))
    np.savez(tmp_path / "foreign.npz", a=np.zeros(3))
    for name, what in (("empty.npz", "empty"), ("text.npz", "not a zip"), ("one.npy", "single NumPy array"),
                       ("foreign.npz", "not a numba-sc checkpoint")):
        with pytest.raises(ValueError, match=what):
            load(tmp_path / name)
    good = save({"a": np.arange(100.0)}, tmp_path / "good.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match="cut.npz"):
        load(tmp_path / "cut.npz")

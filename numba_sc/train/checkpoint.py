"""Saving and loading state: a model's and an optimizer's ``state_dict()``, in one file.

A state dict here is a nested dictionary of NumPy (or CuPy) arrays and plain
values: ``model.state_dict()`` gives ``{"stem.0.weight": array, ...}``,
``optimizer.state_dict()`` gives ``{"optimizer": "AdamW", "hyperparameters":
{...}, "state": {name: {"step": 3, "exp_avg": array, ...}}}``. A training run
usually saves both, and more::

    numba_sc.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 300},
                  "run.npz")
    ckpt = numba_sc.load("run.npz")
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])

The file is NumPy's ``.npz``: every array is stored as it is (dtype, shape and
bits, so a loaded model reproduces its outputs bit for bit), and the nesting with
the plain values (ints, floats, strings, bools, None, lists and tuples) is kept
as JSON in one more entry. Reading it needs NumPy only, and never unpickles
anything (``np.load(..., allow_pickle=False)``), so a checkpoint from elsewhere
cannot run code. PyTorch's ``torch.load(weights_only=True)`` does not read it;
:func:`load` does.
"""
from __future__ import annotations

import json
import math
import os
import zipfile
from pathlib import Path

import numpy as np

from ..core.backend import to_host
from ..core.files import atomic_write

FORMAT = "numba-sc checkpoint 1"  # stored in the file; a file without it is not ours
_META = "__structure__"


def _pack(value, arrays, where):
    """``value`` as JSON, its arrays moved into ``arrays`` (key -> NumPy array)."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: keys must be strings, got {k!r}")
            out[k] = _pack(v, arrays, f"{where}[{k!r}]")
        return {"dict": out}
    if isinstance(value, (list, tuple)):
        kind = "list" if isinstance(value, list) else "tuple"
        return {kind: [_pack(v, arrays, f"{where}[{i}]") for i, v in enumerate(value)]}
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # NumPy, CuPy, or a NumPy scalar
        a = np.asarray(to_host(value) if not isinstance(value, np.generic) else value)
        if a.dtype.hasobject:
            raise TypeError(f"{where}: an array of Python objects cannot be saved safely; use numbers")
        key = f"a{len(arrays)}"
        arrays[key] = a
        return {"scalar" if isinstance(value, np.generic) else "array": key}
    if value is None or isinstance(value, (bool, int, str)):
        return {"value": value}
    if isinstance(value, float):
        # JSON has no inf or NaN: those go by name (every finite float round-trips exactly)
        return {"float": value if math.isfinite(value) else repr(value)}
    raise TypeError(f"{where}: cannot save a {type(value).__name__}; a checkpoint holds dicts, lists, "
                    "tuples, arrays, numbers, strings, bools and None")


def _unpack(node, arrays):
    (kind, v), = node.items()
    if kind == "dict":
        return {k: _unpack(x, arrays) for k, x in v.items()}
    if kind in ("list", "tuple"):
        items = [_unpack(x, arrays) for x in v]
        return items if kind == "list" else tuple(items)
    if kind == "array":
        return arrays[v]
    if kind == "scalar":
        return arrays[v][()]
    if kind == "float":
        return float(v)
    return v


def save(state, path) -> Path:
    """Write ``state`` (a dict of arrays, numbers and nested dicts, e.g. a model's
    ``state_dict()``) to ``path`` (``.npz`` is added when missing). CuPy arrays are
    copied to the host. Returns the path written.

    The write is atomic (:func:`numba_sc.core.files.atomic_write`): a process killed
    while saving leaves the previous checkpoint at ``path``, whole, or the new one;
    never a half-written file in its place. Everything is checked (what can be
    stored, that the folder exists) before a byte is written."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict (e.g. model.state_dict()), got {type(state).__name__}")
    arrays = {}
    structure = _pack(state, arrays, "state")
    path = Path(os.fspath(path))
    if path.suffix != ".npz":
        path = path.with_name(path.name + ".npz")
    meta = json.dumps({"format": FORMAT, "structure": structure})
    # np.savez given an open file writes to it as it is (no ".npz" added: the name is ours)
    return atomic_write(path, lambda f: np.savez(f, **{_META: np.array(meta)}, **arrays), name="path")


def _damaged(path, what):
    return ValueError(f"{path}: {what}, so it cannot be read as a numba-sc checkpoint; was its writing "
                      "interrupted, or is it another kind of file? Load an earlier checkpoint, or write a "
                      "new one with numba_sc.save(model.state_dict(), path)")


def load(path) -> dict:
    """Read what :func:`save` wrote: the same nesting, NumPy arrays with the same dtype,
    shape and values.

    A file that is not such a checkpoint is refused with a ``ValueError`` that names it
    and says what it is instead (empty, truncated, text, a single ``.npy`` array, an
    ``.npz`` that :func:`save` did not write); a missing one with ``FileNotFoundError``."""
    path = Path(os.fspath(path))
    if not path.exists() and path.with_name(path.name + ".npz").exists():
        path = path.with_name(path.name + ".npz")
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}: check the path (numba_sc.save writes name.npz)")
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder, not a checkpoint: give the .npz file inside it")
    with open(path, "rb") as f:
        head = f.read(6)
    if not head:
        raise _damaged(path, "the file is empty")
    if head == b"\x93NUMPY":
        raise _damaged(path, "the file holds a single NumPy array (.npy, written by np.save)")
    if not head.startswith(b"PK"):
        raise _damaged(path, "the file is not a zip archive (.npz)")
    try:
        with np.load(path, allow_pickle=False) as f:
            if _META not in f.files:
                raise ValueError(f"{path} is an .npz but not a numba-sc checkpoint (no {_META} entry; it holds "
                                 f"{sorted(f.files)[:5]}): write one with numba_sc.save(model.state_dict(), path)")
            meta = json.loads(str(f[_META]))
            if not isinstance(meta, dict) or meta.get("format") != FORMAT:
                found = meta.get("format") if isinstance(meta, dict) else None
                raise ValueError(f"{path}: unknown checkpoint format {found!r} (this version reads "
                                 f"{FORMAT!r})")
            arrays = {k: f[k] for k in f.files if k != _META}
        return _unpack(meta["structure"], arrays)
    except ValueError as e:
        if str(path) in str(e):  # ours, above
            raise
        raise _damaged(path, f"its contents are damaged ({type(e).__name__}: {e})") from None
    except (zipfile.BadZipFile, EOFError, OSError, KeyError, TypeError, AttributeError) as e:
        raise _damaged(path, f"its contents are damaged or incomplete ({type(e).__name__}: {e})") from None

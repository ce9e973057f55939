"""Writing a file so that a kill at any moment leaves the old file or the new one, whole.

Opening ``run.npz`` for writing empties it at once; a process killed while it
writes the rest (out of memory, a job's time limit, Ctrl-C) leaves a file that
is neither the last checkpoint nor the new one, and the last good checkpoint is
gone. :func:`atomic_write` writes elsewhere first::

    run.npz.tmp-4711-ab12cd   written, flushed, fsynced   (run.npz untouched)
    os.replace(tmp, run.npz)  one rename: readers see the old file or the new

``os.replace`` is atomic on POSIX and on Windows when both names are in one
folder, which is why the temporary file sits beside the target, not in /tmp
(a rename across file systems is a copy). If the write raises, the temporary
file is removed; a ``SIGKILL`` gives no chance to, so at most one
``.<name>.tmp-*`` file per killed writer is left beside the target: harmless,
never read, safe to delete (its name says so).

Every file the library writes (checkpoints, training logs, result JSON, plots)
goes through here.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

TMP_MARK = ".tmp-"  # in the name of every temporary file: ".run.npz.tmp-<random>"
_UMASK = os.umask(0o022)  # read once, at import (reading it means setting it: not thread-safe later)
os.umask(_UMASK)


def check_writable(path, name: str = "path") -> Path:
    """Raise before any work when ``path`` cannot be written: its folder missing or not
    writable, or ``path`` a folder. ``name`` is the argument (or option) to name in
    the message. The one check of an output path: the library's writers and the
    command line's options (``--out``, ``--save``, ``--log``) both call it."""
    path = Path(os.fspath(path))
    folder = path.parent
    if path.is_dir():
        raise IsADirectoryError(f"{name} {path} is a folder; give a file name inside it, e.g. {path / 'run.npz'}")
    if not folder.is_dir():
        raise FileNotFoundError(f"{name} {path}: the folder {folder} does not exist; create it first "
                                f"(mkdir -p {folder}) or give a path in an existing folder")
    if not os.access(folder, os.W_OK | os.X_OK):  # (a new file in a folder needs both)
        raise PermissionError(f"{name} {path}: cannot write in {folder} (no permission); choose a folder you can "
                              "write to")
    return path


def atomic_write(path, write: Callable, mode: str = "wb", name: str = "path") -> Path:
    """Write the file ``path`` through ``write(f)`` (``f``: a file open in ``mode``, "wb"
    or "w"), all or nothing: a temporary file in the same folder is written, flushed
    and fsynced, then renamed over ``path``. On an error the temporary file is
    removed and ``path`` keeps its old contents. Returns ``path``."""
    path = check_writable(path, name)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}{TMP_MARK}", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes on disk before the name points at them
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give what a plain open() would
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def write_text(path, text: str, name: str = "path") -> Path:
    """``Path(path).write_text(text)``, atomically (UTF-8)."""
    return atomic_write(path, lambda f: f.write(text), mode="w", name=name)


__all__ = ["TMP_MARK", "atomic_write", "check_writable", "write_text"]

"""Writing a file all or nothing, and the one check of an output path."""
import os

import pytest

from numba_sc.core import files


def test_write_text_and_permissions(tmp_path):
    path = files.write_text(tmp_path / "a.txt", "héllo\n")
    assert path.read_text(encoding="utf-8") == "héllo\n"
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as a plain open() would make it
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]  # no temporary file left


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "run.npz"
    path.write_bytes(b"old")

    def write(f):
        f.write(b"half of the new")
        raise KeyboardInterrupt  # killed mid-write

    with pytest.raises(KeyboardInterrupt):
        files.atomic_write(path, write)
    assert path.read_bytes() == b"old"
    assert not [p for p in tmp_path.iterdir() if files.TMP_MARK in p.name]


def test_check_writable(tmp_path):
    assert files.check_writable(tmp_path / "x.json") == tmp_path / "x.json"
    with pytest.raises(IsADirectoryError, match="--out"):
        files.check_writable(tmp_path, "--out")
    with pytest.raises(FileNotFoundError, match="mkdir -p"):
        files.check_writable(tmp_path / "missing" / "x.json")

"""The benchmarks' shared helpers that touch files and imports (benchmarks/common.py):
result files written atomically, and older copies of the package imported by name."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import common  # noqa: E402


def test_a_result_file_is_written_whole_or_not_at_all(tmp_path):
    out = tmp_path / "r.json"
    common.write_json(out, {"ms": 1.5, "rows": [1, 2]})
    assert json.loads(out.read_text()) == {"ms": 1.5, "rows": [1, 2]}
    with pytest.raises(TypeError):  # not JSON: nothing written, the old file intact
        common.write_json(out, {"ms": object()})
    assert json.loads(out.read_text()) == {"ms": 1.5, "rows": [1, 2]}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary left behind


def test_copies_are_imported_under_their_names(tmp_path):
    import numba_sc

    (tmp_path / "old_sc").mkdir()
    (tmp_path / "old_sc" / "__init__.py").write_text("VERSION = 'old'\n")
    got = common.package_copies(tmp_path, "old")
    assert got["new"] is numba_sc and got["old"].VERSION == "old"
    assert sorted(common.package_copies(tmp_path)) == ["new", "old"]  # every copy there
    assert list(common.package_copies(tmp_path / "missing")) == ["new"]
    with pytest.raises(SystemExit, match="no copy gone_sc/"):
        common.package_copies(tmp_path, ["old", "gone"])

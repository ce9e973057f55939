"""The recorded results: a file read by name from the folder the environment names,
the vocabulary a figure's expression is written in, and where a file's numbers come from."""
import json

import pytest

from numba_sc.tools import results
from numba_sc.tools.results import evaluate, load, provenance


def test_load_names_the_known_files():
    with pytest.raises(FileNotFoundError, match="net_scans"):
        load("no_such_benchmark")


def test_the_folder_follows_the_environment(tmp_path, monkeypatch):
    """$NUMBA_SC_RESULTS is read at each call, not once at import."""
    (tmp_path / "mine.json").write_text(json.dumps({"runs": [{"x": 1.5}]}))
    monkeypatch.setenv("NUMBA_SC_RESULTS", str(tmp_path))
    assert results.results_folder() == tmp_path and load("mine") == {"runs": [{"x": 1.5}]}
    monkeypatch.delenv("NUMBA_SC_RESULTS")
    assert results.results_folder() == results.ROOT / "benchmarks" / "results"
    with pytest.raises(FileNotFoundError):
        load("mine")


def test_the_vocabulary():
    r = {"runs": [{"net": "a", "network": {"numba-sc": {"ms": 2.0}, "spconv Native": {"ms": 4.0},
                                           "spconv MaskImplicitGemm": {"ms": 5.0}}},
                  {"net": "b", "network": {"numba-sc": {"ms": 3.0}, "spconv Native": {"ms": 2.0},
                                           "spconv MaskImplicitGemm": {"ms": 6.0}}}]}
    assert evaluate("ratio(run(r, net='a'))", r) == (0.5,)
    assert evaluate("span(ratio(x) for x in r['runs'])", r) == (0.5, 1.5)
    with pytest.raises(LookupError, match="2 rows"):
        evaluate("row(r['runs'])", r)
    with pytest.raises(LookupError, match="no row"):
        evaluate("run(r, net='c')", r)
    block = {"times": {"kitti / numba-sc": {"host_ms": 1.0}, "kitti / spconv Native": {"host_ms": 4.0}}}
    assert results.versus(block, "numba-sc") == 0.25
    with pytest.raises(ValueError, match="finite numbers"):
        evaluate("r['runs'][0]['net']", r)
    with pytest.raises(NameError):  # no builtins beyond the vocabulary
        evaluate("open('x')", r)


def test_provenance_says_device_date_command():
    line = provenance({"recorded": {"device": "H100", "date": "2026-11-24", "command": "bench", "code": "abc"}})
    assert line == "H100, 2026-11-24, bench, code abc"
    merged = provenance({"recorded": {"map": {"device": "H100", "date": "d1"}, "conv": {"device": "H200", "date": "d2"}}})
    assert merged == "map: H100, d1; conv: H200, d2"
    assert provenance(load("net_scans")).startswith("NVIDIA H100")

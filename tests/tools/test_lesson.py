"""numba_sc.tools.lesson: what the notebooks print of a ladder."""
import pytest

from numba_sc.gmas import gather
from numba_sc.tools import lesson


def test_code_is_the_rung_as_written():
    src = lesson.code("gather", "v1")
    assert src.lstrip().startswith("@cuda.jit") and "def gather_v1(" in src
    assert "def batch_norm_v2(" in lesson.code("pointwise", "v2")  # the operation the ladder climbs
    assert "def atomic_reduce_v1(" in lesson.code("voxelization", "atomic_reduce_v1")  # a step's kernel
    # a module's second ladder, by its own name
    assert "def batch_norm_backward_v2(" in lesson.code("batch_norm_backward", "v2")
    assert "def batch_norm_backward_sums_v2(" in lesson.code("batch_norm_backward", "batch_norm_backward_sums_v2")


def test_diff_shows_what_the_rung_changed(capsys):
    text = lesson.diff("forward_search", "v1", "v2")
    assert text.startswith("--- forward_search_v1\n+++ forward_search_v2")
    added = [line for line in text.splitlines() if line.startswith("+") and not line.startswith("+++")]
    removed = [line for line in text.splitlines() if line.startswith("-") and not line.startswith("---")]
    assert added and removed and "while lo < hi" in "\n".join(removed)
    assert "forward_search_v2" in capsys.readouterr().out
    text = lesson.diff("batch_norm_backward", "v1", "v2")
    assert text.startswith("--- batch_norm_backward_v1\n+++ batch_norm_backward_v2")
    lesson.show("batch_norm_backward", "v1")
    assert "def batch_norm_backward_v1(" in capsys.readouterr().out


def test_unknown_names_say_what_exists():
    with pytest.raises(ValueError, match="gather_v1"):
        lesson.code("gather", "v9")
    with pytest.raises(ValueError, match="stage must be one of .*batch_norm_backward"):
        lesson.code("nonesuch", "v1")


def test_bought_reads_the_recorded_ladder():
    lines = []
    rows = lesson.bought("gather", print_=lines.append)
    assert [r["rung"] for r in rows if r["dtype"] == "float32"] == list(gather.LADDER.names[:len(rows) // 2])
    assert "64 channels" in lines[0] and "NVIDIA" in lines[0]
    header = []
    lesson.bought("forward_search", print_=header.append)
    assert "voxels (" in header[0] and "channels" not in header[0]  # the search ignores the features

"""Silent wrong values at the edges (#33): scoring, float points, float16 sums, the
declared Python.

The table of tests/test_edges.py, for the cases of this part: each line is (id, call,
expected), expected an (exception class, regex of its message) or a check of the result.
"""
import ast
import re
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
from helpers import check_case

import numba_sc as ns
from numba_sc import train
from numba_sc.core.backend import to_host
from numba_sc.train import augment, labels

ROOT = Path(__file__).resolve().parent.parent

# targets 0 0 1 1 (and an ignored point), predictions 0 1 1 1: IoU 1/2 and 2/3; class 2 in neither
TARGET = np.array([0, 0, 1, 1, 255])
PRED = np.array([0, 1, 1, 1, 2])
CM = labels.confusion_matrix(PRED, TARGET, 3)


def _evaluate(classes):
    return train.evaluate(PRED, TARGET, classes=classes, num_classes=3)["miou"]


def _points(bad):
    """Four points on two squares of a 10 m checkerboard, the third one replaced by ``bad``."""
    p = np.array([[1, 1, 0, 0], [11, 1, 0, 0], [2, 2, 0, 0], [12, 2, 0, 0]], np.float32)
    p[2, :3] = bad
    return p


# Three points on a line, one channel, fp16; every offset's weight 2, the centre's 0. Output 1 reads
# +40000 and -40000 through offsets -1 and +1: partial products +-80000, past fp16's 65504, sum 0.
LINE = np.array([[0, 0, 0], [1, 0, 0], [2, 0, 0]], np.int32)
BIG = np.array([[40000], [1], [-40000]], np.float16)
W2 = np.full((27, 1, 1), 2, np.float16)
W2[13] = 0


def _fp16_layer(backend, dataflow="gmas"):
    y = ns.sparse_conv3d(ns.SparseTensor(LINE, BIG), W2, backend=backend, dataflow=dataflow)
    return to_host(y.features).ravel().tolist()


def _fp16_input_gradient(backend):
    """The input gradient is the layer's transpose: dx[1] = G[0] W[+1] + G[2] W[-1] = 80000 - 80000."""
    x = ns.SparseTensor(LINE, np.ones((3, 1), np.float16))
    y = ns.sparse_conv3d(x, W2, backend="reference")
    dx, _ = ns.sparse_conv3d_backward(x, W2, BIG, y.kernel_map, backend=backend)
    return to_host(dx).ravel().tolist()


# ------------------------------------------------------- the declared Python against the code
# What a module may use only from a Python version on: (version, what, regex over the source).
NEWER = [
    ((3, 11), "BaseException.add_note", r"\.add_note\("),
    ((3, 11), "ExceptionGroup", r"\bExceptionGroup\b"),
    ((3, 11), "tomllib", r"^\s*(import|from) tomllib\b"),
    ((3, 11), "enum.StrEnum", r"\bStrEnum\b"),
    ((3, 11), "datetime.UTC", r"\bdatetime\.UTC\b"),
    ((3, 11), "typing.Self", r"\btyping\.Self\b|^\s*from typing import .*\bSelf\b"),
    ((3, 12), "itertools.batched", r"\bbatched\("),
    ((3, 12), "typing.override", r"^\s*from typing import .*\boverride\b|\btyping\.override\b"),
    ((3, 13), "copy.replace", r"\bcopy\.replace\("),
]


def _declared_python():
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    m = re.fullmatch(r">=\s*3\.(\d+)", spec.strip())
    assert m, f"requires-python {spec!r}: this test reads a plain '>=3.N'"
    return 3, int(m.group(1))


def _newer_than_declared():
    """Each use in numba_sc, tests and benchmarks of a syntax or library feature newer than
    the declared minimum Python, as 'file: what (3.N)'; and the running interpreter, if it
    is older than that minimum."""
    low = _declared_python()
    found = [] if sys.version_info[:2] >= low else [f"running Python {sys.version_info[:2]} < declared {low}"]
    for folder in ("numba_sc", "tests", "benchmarks"):
        for f in sorted((ROOT / folder).rglob("*.py")):
            src = f.read_text()
            name = f.relative_to(ROOT)
            try:  # syntax: the parser of the declared version (match, except*, type ... =)
                ast.parse(src, feature_version=low)
            except SyntaxError as e:
                found.append(f"{name}: syntax newer than {low} ({e.msg}, line {e.lineno})")
            for version, what, pattern in NEWER:
                if version > low and f.name != Path(__file__).name and re.search(pattern, src, re.M):
                    found.append(f"{name}: {what} ({version[0]}.{version[1]})")
    return found


CASES = [
    # classes to score: whole ids in range, each once (-1 once scored the last class, [0, 0, 1] counted 0 twice)
    ("evaluate classes [-1]", lambda: _evaluate([-1]), (ValueError, r"classes has ids \[-1\] outside \[0, 3\)")),
    ("evaluate classes past the end", lambda: _evaluate([0, 3]), (ValueError, r"classes has ids \[3\] outside")),
    ("evaluate classes [0, 0, 1]", lambda: _evaluate([0, 0, 1]),
     (ValueError, r"classes names the classes \[0\] more than once")),
    ("evaluate classes as floats", lambda: _evaluate([0.0, 1.0]), (TypeError, r"classes must hold int class ids")),
    ("evaluate classes as bools", lambda: _evaluate([True]), (TypeError, r"classes must hold int class ids")),
    ("evaluate classes as a string", lambda: _evaluate("01"), (TypeError, r"classes must be a sequence")),
    # a class in neither the targets nor the predictions is left out, as labels.miou does
    ("evaluate classes with one absent", lambda: _evaluate([0, 1, 2]), lambda m: m == pytest.approx(7 / 12)),
    ("evaluate classes as NumPy ints", lambda: _evaluate(np.array([2, 1, 0])), lambda m: m == pytest.approx(7 / 12)),
    ("evaluate and labels.miou agree", lambda: (_evaluate([0, 1, 2]), labels.miou(CM, [0, 1, 2]), labels.miou(CM)),
     lambda ms: ms[0] == ms[1] == ms[2] == pytest.approx(7 / 12)),
    ("evaluate classes all absent", lambda: _evaluate([2]), (ValueError, r"none of the classes \[2\] occurs")),
    ("labels.miou classes [-1]", lambda: labels.miou(CM, [-1]), (ValueError, r"classes has ids \[-1\]")),
    ("iou_table classes [-1]", lambda: train.iou_table({"run": train.evaluate(PRED, TARGET, num_classes=3)}, [-1]),
     (ValueError, r"classes has ids \[-1\]")),
    ("iou_table classes as floats",
     lambda: train.iou_table({"run": train.evaluate(PRED, TARGET, num_classes=3)}, [1.0]),
     (TypeError, r"classes must hold int class ids")),
    # float points with NaN or inf: refused, naming the argument (never put on a square)
    ("checkerboard NaN point", lambda: train.checkerboard(_points(np.nan)),
     (ValueError, r"points has 1 rows with NaN or inf \(first: row 2")),
    ("checkerboard inf point", lambda: train.checkerboard(_points(np.inf)), (ValueError, r"NaN or inf")),
    ("checkerboard strings", lambda: train.checkerboard(np.array([["a", "b"]])), (TypeError, r"numeric array")),
    ("rotate_z NaN point", lambda: augment.rotate_z(_points(np.nan), np.random.default_rng(0)),
     (ValueError, r"points has 1 rows with NaN or inf")),
    ("crop around an inf point", lambda: augment.crop(_points(-np.inf), None, np.random.default_rng(0), 5.0),
     (ValueError, r"points has 1 rows with NaN or inf")),
    # fp16 features through gather-GEMM-scatter: a per-offset product past fp16's range is computed again
    # in fp32 by the scatter (unguarded it was inf - inf = NaN where the other dataflows, summing in fp32
    # registers, gave 0)
    ("fp16 gmas, products past fp16, reference", lambda: _fp16_layer("reference"), lambda v: v == [2, 0, 2]),
    ("fp16 gmas, products past fp16, kernels", lambda: _fp16_layer("cuda"), lambda v: v == [2, 0, 2]),
    ("fp16 dataflows agree past fp16", lambda: [_fp16_layer("cuda", d) for d in ("gmas", "fetch", "implicit")],
     lambda vs: vs[0] == vs[1] == vs[2] == [2, 0, 2]),
    ("fp16 input gradient, products past fp16", lambda: _fp16_input_gradient("cuda"), lambda v: v == [2, 0, 2]),
    # the declared Python is the one the code needs (add_note is 3.11; pyproject said 3.10)
    ("declared Python covers the code", _newer_than_declared, lambda found: found == []),
]


@pytest.mark.parametrize("call,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_edge(call, expected):
    check_case(call, expected)


def test_a_scan_file_with_nan_points_is_named(tmp_path):
    """A damaged .bin (a NaN point) is refused by the loader, naming the file, not trained on."""
    from numba_sc.train.data import ScanFolder

    _points(np.nan).tofile(tmp_path / "000000.bin")
    with pytest.raises(ValueError, match=r"000000\.bin has 1 rows with NaN or inf"):
        ScanFolder(tmp_path)[0]

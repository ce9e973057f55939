"""The Map step's one entry (numba_sc/map/map_step.py): build_kernel_map runs the
method "auto" picks on the backend asked for, and hands the map back in the kind
of arrays the caller passed."""
import numpy as np
import pytest

import numba_sc as ns
from numba_sc.map import map_step

from helpers import assert_same_map, random_coords


@pytest.fixture(autouse=True)
def _fresh_state():
    ns.clear_caches()
    yield
    ns.clear_caches()


def test_both_backends_give_one_map_in_the_callers_arrays(rng):
    c = random_coords(rng, 150, span=5)
    ref = map_step.build_kernel_map(c, 3, backend="reference")
    got = map_step.build_kernel_map(c, 3, backend="cuda")
    assert ref.stats["backend"] == "reference" and got.stats["backend"] == "cuda"
    assert_same_map(got, ref)
    for name in ("in_coords", "out_coords", "in_order", "out_order", "table", "counts"):
        assert type(getattr(got, name)) is np.ndarray, name  # NumPy in, NumPy out
    assert ns.build_kernel_map is map_step.build_kernel_map


def test_auto_asks_the_method_module(rng, monkeypatch):
    asked = []

    def auto(n, *layer):
        asked.append((n, layer))
        return "hash"

    monkeypatch.setattr(map_step, "auto_map_method", auto)
    c = np.unique(random_coords(rng, 100, span=4), axis=0)
    assert map_step.build_kernel_map(c, 3, stride=2, backend="reference").stats["method"] == "hash"
    assert asked == [(len(c), (3, 2, 1, 1))]
    assert map_step.build_kernel_map(c, 3, backend="reference", method="grid").stats["method"] == "grid"
    assert len(asked) == 1  # a method given is not asked about


def test_bad_arguments_are_refused_before_any_work():
    with pytest.raises(TypeError, match="in_coords must be a NumPy or CuPy integer array"):
        map_step.build_kernel_map([[0, 0, 0]], 3)
    with pytest.raises(ValueError, match="method must be one of"):
        map_step.build_kernel_map(np.zeros((1, 3), np.int32), 3, backend="reference", method="octree")
    with pytest.raises(ValueError, match="out_coords has 4 columns"):
        map_step.build_kernel_map(np.zeros((1, 3), np.int32), 3, out_coords=np.zeros((1, 4), np.int32))

"""The Map step's method="auto": the rule, and a measured choice used by later maps
(numba_sc.map.method)."""
import numpy as np
import pytest

import numba_sc as ns
from numba_sc.map import kernel_map

from helpers import random_coords


@pytest.fixture(autouse=True)
def _fresh_choices():
    ns.clear_caches()
    yield
    ns.clear_caches()


def test_map_method_auto(rng, monkeypatch):
    c = np.unique(random_coords(rng, 200, span=5), axis=0)
    assert ns.build_kernel_map(c, 3, backend="cuda").stats["method"] == "sorted"  # the rule
    if ns.simulating():  # (on a GPU it measures)
        assert ns.choose_map_method(c).source == "rule"
    monkeypatch.setattr(kernel_map.ch, "measure", lambda cands, timer, rounds: {m: i + 1.0 for i, m in
                                                                    enumerate(reversed(list(cands)))})
    choice = ns.choose_map_method(c, timer=lambda fn: 0.0)
    assert choice.value == "grid" and choice.source == "measured"  # the box of this cloud fits
    assert ns.build_kernel_map(c, 3, backend="cuda").stats["method"] == "grid"
    assert ns.build_kernel_map(c, 3, backend="reference").stats["method"] == "grid"
    far = np.unique(random_coords(rng, 3000, span=40), axis=0)  # another size class: the rule
    assert ns.build_kernel_map(far, 3, backend="reference").stats["method"] == "sorted"

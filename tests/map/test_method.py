"""Which Map method ``method="auto"`` runs (numba_sc/map/method.py): the rule, the
measured choice kept in ``STATE.choices["map_method"]`` per (size class, kernel
volume), and ``choose_map_method``."""
import numpy as np
import pytest

import numba_sc as ns
from numba_sc.core.backend import to_host
from numba_sc.core.measure import Choice, size_class
from numba_sc.core.state import STATE
from numba_sc.map import method as mm

from helpers import random_coords


@pytest.fixture(autouse=True)
def _fresh_state():
    ns.clear_caches()
    yield
    ns.clear_caches()


def _fastest(name):
    """A ``measure`` that finds ``name`` fastest, and every other candidate slower."""
    def fake(cands, timer, rounds):
        return {m: (0.5 if m == name else 1.0 + i) for i, m in enumerate(cands)}
    return fake


def test_the_rule_is_the_sorted_search():
    assert mm.rule_map_method(94_444, 27) == "sorted"
    assert mm.auto_map_method(94_444, 3) == "sorted"  # nothing measured: the rule
    assert mm.MAP_METHODS == ("sorted", "hash", "grid")


def test_the_key_is_size_class_and_kernel_volume():
    assert mm.method_key(94_444, 27) == (size_class(94_444), 27)
    mm.remember_map_method(1000, 27, Choice("hash", "measured"))
    assert STATE.choices["map_method"] == {(size_class(1000), 27): Choice("hash", "measured")}
    assert mm.auto_map_method(1100, 3) == "hash"  # same size class, same kernel
    assert mm.auto_map_method(1100, 5) == "sorted"  # another kernel volume: the rule
    assert mm.auto_map_method(4000, 3) == "sorted"  # another size class: the rule
    ns.clear_caches()
    assert mm.auto_map_method(1100, 3) == "sorted"  # forgotten


def test_map_method_auto(rng, monkeypatch):
    c = np.unique(random_coords(rng, 200, span=5), axis=0)
    assert ns.build_kernel_map(c, 3, backend="cuda").stats["method"] == "sorted"  # the rule
    if ns.simulating():  # (on a GPU it measures)
        assert ns.choose_map_method(c).source == "rule"
        assert not STATE.choices["map_method"]  # and nothing is kept
    monkeypatch.setattr(mm, "measure", lambda cands, timer, rounds: {m: i + 1.0 for i, m in
                                                                    enumerate(reversed(list(cands)))})
    choice = ns.choose_map_method(c, timer=lambda fn: 0.0)
    assert choice.value == "grid" and choice.source == "measured"  # the box of this cloud fits
    assert ns.build_kernel_map(c, 3, backend="cuda").stats["method"] == "grid"
    assert ns.build_kernel_map(c, 3, backend="reference").stats["method"] == "grid"
    far = np.unique(random_coords(rng, 3000, span=40), axis=0)  # another size class: the rule
    assert ns.build_kernel_map(far, 3, backend="reference").stats["method"] == "sorted"


def test_choose_times_every_method_that_fits(rng, monkeypatch):
    """Every method whose map can be built is a candidate, and each candidate builds
    the map of that method; a grid whose box does not fit is left out."""
    seen = {}

    def fake(cands, timer, rounds):
        for name, fn in cands.items():
            seen[name] = fn()
        return _fastest("hash")(cands, timer, rounds)

    monkeypatch.setattr(mm, "measure", fake)
    c = np.unique(random_coords(rng, 300, span=6), axis=0)
    choice = mm.choose_map_method(c, timer=lambda fn: 0.0)
    assert choice == Choice("hash", "measured", choice.timings) and set(seen) == {"sorted", "hash", "grid"}
    ref = ns.build_kernel_map(c, 3, backend="reference", method="sorted")
    for name, m in seen.items():
        assert m.stats["method"] == name
        assert np.array_equal(to_host(m.table), ref.table), name
    assert mm.auto_map_method(len(c), 3) == "hash"

    seen.clear()
    wide = np.array([[0, 0, 0], [100_000, 100_000, 100_000]], np.int32)  # a box of ~1e15 cells
    mm.choose_map_method(wide, timer=lambda fn: 0.0)
    assert set(seen) == {"sorted", "hash"}


def test_a_planted_wrong_choice_is_caught(monkeypatch):
    """The checks above can fail: a measure that favours another method is seen."""
    monkeypatch.setattr(mm, "measure", _fastest("sorted"))
    c = np.unique(random_coords(np.random.default_rng(1), 200, span=5), axis=0)
    assert mm.choose_map_method(c, timer=lambda fn: 0.0).value != "grid"

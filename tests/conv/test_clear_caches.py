"""numba_sc.clear_caches() forgets a measured dataflow: ``dataflow="auto"`` answers after it
as a fresh process does (numba_sc.core.state, read by numba_sc.conv.choice)."""
import numpy as np
import pytest

import numba_sc as ns
from numba_sc.conv import layer

from helpers import random_coords


@pytest.fixture(autouse=True)
def _fresh():
    ns.clear_caches()
    yield
    ns.clear_caches()


def _layer(rng):
    coords = np.unique(random_coords(rng, 120, span=5), axis=0)
    x = ns.SparseTensor(coords, rng.standard_normal((len(coords), 4)).astype(np.float32))
    return x, (rng.standard_normal((27, 4, 4)) / 3).astype(np.float32)


def test_auto_is_the_same_before_and_after_a_measurement_cleared(rng, monkeypatch):
    x, w = _layer(rng)
    ran = []
    real = layer.fetch_or_implicit
    monkeypatch.setattr(layer, "fetch_or_implicit", lambda flow, *a: ran.append(flow) or real(flow, *a))

    def auto():
        """(what choose_dataflow answers without measuring, the dataflow sparse_conv3d runs)"""
        told = ns.choose_dataflow(x, w, backend="cuda").value if ns.simulating() else None
        ran.clear()
        ns.sparse_conv3d(x, w, backend="cuda")  # dataflow="auto"
        return told, (ran[0] if ran else "gmas")

    def fetch_fastest(fn):
        """A timer that runs the call and finds fetch-on-demand the fastest dataflow."""
        ran.clear()
        fn()
        return 1e-3 if ran == ["fetch"] else 3e-3

    before = auto()
    measured = ns.choose_dataflow(x, w, backend="cuda", timer=fetch_fastest, rounds=1)
    assert (measured.value, measured.source) == ("fetch", "measured")
    after_measuring = auto()
    ns.clear_caches()
    after_clearing = auto()
    assert before[1] == "gmas"  # the rule: 4 -> 4 channels on a map the layer builds
    assert after_measuring[1] == "fetch" != before[1]  # the measurement changed "auto" ...
    assert after_clearing == before  # ... and clear_caches undid it

"""Autotuning the gather and scatter tiles: the search with an injected timer, and the
heuristic used where nothing is timed (the simulator)."""
import numpy as np

from numba_sc import kernel_offsets, sparse_conv3d
from numba_sc import autotune as autotune_mod_fn  # the function
from numba_sc.core.device import simulating
from numba_sc.gmas.autotune import layer_key
from numba_sc.conv.arguments import resolve_tiles

from helpers import assert_close, oracle, tensor, weights


def test_autotune_search_with_injected_timer(rng):
    from numba_sc.gmas.autotune import forget_tiles, layer_key, tuned_tiles

    forget_tiles()
    x = tensor(rng, 40, 4, extent=5)
    w = weights(rng, 27, 4, 6)
    # One round times gather T = 1, 2, 4 then scatter T = 1, 2, 3, 6; the next
    # round the other way round. Fastest: gather T = 2, scatter T = 3.
    steady = [3.0, 1.0, 2.0, 5.0, 4.0, 1.0, 6.0]
    burst = [3.0, 9.0, 2.0, 5.0, 4.0, 9.0, 6.0]  # the GPU slowed down while T = 2 and 3 ran
    script = iter(steady + burst[::-1] + steady)  # 3 rounds, interleaved
    calls = []

    def timer(fn):
        fn()  # runs the kernel (simulator) with that tile size
        calls.append(1)
        return next(script)

    choice = autotune_mod_fn(x, w, layer="enc1", timer=timer, rounds=3, backend="cuda")
    # the burst cost the best tiles one round of three: the median drops it
    assert (choice.gather, choice.scatter, choice.source) == (2, 3, "autotuned")
    assert choice.timings["gather"] == {1: 3.0, 2: 1.0, 4: 2.0} and len(calls) == 21
    assert tuned_tiles(layer_key("enc1", 4, 6, 27, np.float32, False)) is choice
    assert resolve_tiles(None, 4, 6, len(x), len(x), np.float32, 27, False, "enc1") == (2, 3)
    y = sparse_conv3d(x, w, backend="cuda", layer="enc1")  # runs with the tuned tiles
    assert_close(y.features, oracle(x.coords, x.features, x.coords, w, kernel_offsets(3)))
    # Without a timer: on a GPU the kernels are timed; under the simulator the
    # heuristic is used, with no timing (simulated times mean nothing).
    h = autotune_mod_fn(x, w, layer="enc2", backend="cuda")
    if simulating():
        assert h.source == "heuristic" and h.timings == {}
    else:
        assert h.source == "autotuned" and sorted(h.timings["gather"]) == [1, 2, 4]
    assert 4 % h.gather == 0 and 6 % h.scatter == 0
    forget_tiles()


def test_heuristic_tile():
    from numba_sc.gmas.autotune import heuristic_tile

    assert heuristic_tile(64, 10) == 1  # tiny cloud: all the parallelism
    assert heuristic_tile(64, 1_000_000) == 8  # big cloud: 32-byte tiles
    assert heuristic_tile(64, 1_000_000, itemsize=2) == 16
    assert heuristic_tile(33, 1_000_000) == 3
    assert heuristic_tile(64, 20_000) == 8 and heuristic_tile(64, 5_000) == 2


def test_tuned_tiles_live_in_the_library_state():
    """A tuned layer is a measured choice of STATE.choices["tile"]: clear_caches forgets it."""
    import numba_sc
    from numba_sc.core.state import STATE
    from numba_sc.gmas.autotune import TileChoice, keep_tiles, tuned_tiles

    key = layer_key("dec3", 8, 8, 27, np.float32, False)
    choice = TileChoice(2, 4, "autotuned")
    keep_tiles(key, choice)
    assert tuned_tiles(key) is choice and STATE.choices["tile"][key] is choice
    assert resolve_tiles(None, 8, 8, 100, 100, np.float32, 27, False, "dec3") == (2, 4)
    numba_sc.clear_caches()
    assert tuned_tiles(key) is None
    assert resolve_tiles(None, 8, 8, 100, 100, np.float32, 27, False, "dec3") != (2, 4)  # the heuristic again

"""The fast launch path and the private attributes of Numba and CuPy it reads.

``numba_sc/core/fast_launch.py`` lists them (``PRIVATE``). The first tests here fail,
naming the attribute and the library's version, as soon as an installed release lacks
one; the fast launcher itself then falls back to the plain launch, which the fallback
tests check. The tests comparing the fast launcher with Numba's dispatcher need a GPU
(under the simulator every launch is the plain one) and are skipped elsewhere.
"""
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
from numba import cuda

from numba_sc.core import device, fast_launch, pieces
from numba_sc.core.launch import blocks_for, launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _real_numba(script: str) -> dict:
    """Run ``script`` (which prints one JSON line last) in a Python with the real numba-cuda,
    not the simulator: the simulator replaces the driver and dispatcher modules whose
    private attributes the fast path reads. Importing them needs no GPU."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def present():
    """For every row of PRIVATE: [owner installed, attribute present], checked with real numba."""
    return _real_numba(
        "import json\n"
        "from numba_sc.core import fast_launch as f\n"
        "print(json.dumps([[f.version(o) is not None, f.has_private(p, a)] for o, p, a in f.PRIVATE]))")


@pytest.mark.parametrize("row", range(len(fast_launch.PRIVATE)),
                         ids=[f"{o}:{p.rsplit('.', 1)[-1]}.{a}" for o, p, a in fast_launch.PRIVATE])
def test_every_private_attribute_is_there(present, row):
    owner, path, attribute = fast_launch.PRIVATE[row]
    installed, there = present[row]
    if not installed:
        pytest.skip(f"{owner} is not installed here")
    assert there, (f"{owner} {fast_launch.version(owner)} no longer has {path}.{attribute}: the fast launcher "
                   "falls back to the plain launch; update numba_sc/core/fast_launch.py")


def test_numba_rows_are_checked_here(present):
    """numba-cuda is installed wherever the library runs: its rows never skip."""
    rows = [present[i] for i, (owner, _, _) in enumerate(fast_launch.PRIVATE) if owner == "numba-cuda"]
    assert rows and all(installed for installed, _ in rows)


def test_missing_names_the_attribute_and_the_version():
    row = ("numba-cuda", "numba.cuda.simulator.kernelapi", "_no_such_attribute")
    (message,) = fast_launch.missing((row,))
    assert f"numba-cuda {fast_launch.version('numba-cuda')} no longer has " \
           "numba.cuda.simulator.kernelapi._no_such_attribute" in message
    assert "falls back to the plain launch" in message and "numba_sc/core/fast_launch.py" in message
    assert fast_launch.missing(fast_launch.SIMULATOR) == []  # the simulator's rows are there


def test_a_missing_attribute_turns_the_fast_path_off():
    """With numba-cuda's ``driver._to_core_stream`` made missing (deleted, as a release
    that drops it would), the launcher's first use finds it, reports itself off, names
    it, and answers every later launch with "not mine" (the plain launch runs)."""
    got = _real_numba(
        "import json, warnings\n"
        "from numba.cuda.cudadrv import driver\n"
        "del driver._to_core_stream\n"
        "from numba_sc.core import fast_launch as f\n"
        "fast = f.FastLauncher()\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    first = fast.launch(None, 1, 1, 0, ())\n"
        "    again = fast.launch(None, 1, 1, 0, ()), fast.learn(None, ())\n"
        "print(json.dumps({'first': first, 'again': again, 'on': fast.on, 'missing': fast.missing,\n"
        "                  'warned': [str(x.message) for x in w]}))")
    assert got["on"] is False and got["first"] is False and got["again"] == [False, False]
    assert any("driver._to_core_stream" in m for m in got["missing"]), got["missing"]
    assert len(got["warned"]) == 1 and "driver._to_core_stream" in got["warned"][0]  # said once


@cuda.jit
def _add_one(a, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = a[i] + 1


@pytest.mark.skipif(not device.simulating(), reason="the simulator stands in for a numba-cuda without them")
def test_launch_works_with_the_fast_path_off(monkeypatch):
    """The GPU's launch path, run by the simulator (stream 0): the simulator's driver has
    no ``_to_core_stream`` (nor the dispatcher a ``_Kernel``), so the launcher finds
    them missing, switches itself off, and the plain launch still computes."""
    fast = fast_launch.FastLauncher()
    monkeypatch.setattr(fast_launch, "FAST", fast)
    monkeypatch.setattr(fast_launch, "current_stream_ptr", lambda: 0)
    a = np.arange(300, dtype=np.int64)
    for _ in range(2):
        out = np.zeros_like(a)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "... no longer has ...": expected here
            fast_launch.launch_on_gpu(_add_one, blocks_for(300, 128), 128, (a, out))
        np.testing.assert_array_equal(out, a + 1)
    assert fast.on is False and any("_to_core_stream" in m for m in fast.missing)
    assert fast._compiled == {}  # nothing learned


def test_clear_caches_forgets_learned_kernels_and_launches_still_work():
    """The launcher's learned kernels and made-once objects are registered with
    numba_sc.core.state: clear_caches() empties them, and the next launch works."""
    from numba_sc.core.state import STATE, clear_caches

    fast = fast_launch.FastLauncher()
    for cache in (fast._compiled, fast._streams, fast._configs, fast._array_types):
        assert any(c is cache for c in STATE.caches)
    fast._compiled[("kernel", ())] = "entry"
    clear_caches()
    assert fast._compiled == {}
    a = np.arange(10, dtype=np.int64)
    out = np.zeros_like(a)
    launch(_add_one, 10, a, out)
    np.testing.assert_array_equal(out, a + 1)


def test_contiguity_reader_falls_back_to_the_public_flag():
    """An array type without CuPy's private flag is asked through ``flags.c_contiguous``."""
    read = fast_launch.c_contiguous_reader(np.ndarray)
    assert read(np.zeros((3, 4))) is True
    assert read(np.zeros((3, 4))[:, ::2]) is False


@cuda.jit
def mixed_kernel(a2d, b, scale, offset, flip, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        v = a2d[i, 0] * scale + a2d[i, 1] + b[i] + offset
        out[i] = -v if flip else v


@pytest.mark.skipif(not device.gpu_present(), reason="the fast launch path runs only on a GPU")
def test_fast_launch_matches_dispatcher(monkeypatch):
    fast = fast_launch.FastLauncher()
    monkeypatch.setattr(fast_launch, "FAST", fast)  # learns afresh
    import cupy

    rng = np.random.default_rng(1)
    a = cupy.asarray(rng.normal(size=(5000, 2)).astype(np.float32))
    b = cupy.asarray(rng.integers(-9, 9, 5000).astype(np.int64))
    expect = (a[:, 0] * 1.5 + a[:, 1] + b + 7).get()
    for flip in (False, True, False):  # first call learns, the others go fast
        out = cupy.full(5000, np.nan, np.float32)
        launch(mixed_kernel, 5000, a, b, 1.5, 7, flip, out, threads=128)
        np.testing.assert_allclose(out.get(), -expect if flip else expect, rtol=1e-5, atol=1e-5)
    (entry,) = [v for k, v in fast._compiled.items() if k[0] is mixed_kernel]
    assert entry[2] is not None  # a float scalar goes through the driver's slots too (its bits)
    out = cupy.full(5000, np.nan, np.float32)  # a NumPy float32 scalar: another signature, learned
    for _ in range(2):
        launch(mixed_kernel, 5000, a, b, np.float32(-0.25), 7, False, out, threads=128)
        np.testing.assert_allclose(out.get(), (a[:, 0] * -0.25 + a[:, 1] + b + 7).get(), rtol=1e-5, atol=1e-5)
    # A non-contiguous view is a different signature: it is learned, not mixed up.
    out2 = cupy.zeros(10000, np.float32)[::2]
    launch(mixed_kernel, 5000, a, b, 1.5, 7, False, out2)
    launch(mixed_kernel, 5000, a, b, 1.5, 7, False, out2)
    np.testing.assert_allclose(out2.get(), expect, rtol=1e-5, atol=1e-5)
    # Negative integers and a float32 scalar fill their slots correctly too.
    expect = (a[:, 0] * np.float32(-0.25) + a[:, 1] + b - 3).get()
    for _ in range(2):
        out = cupy.full(5000, np.nan, np.float32)
        launch(mixed_kernel, 5000, a, b, np.float32(-0.25), -3, False, out, threads=64)
        np.testing.assert_allclose(out.get(), expect, rtol=1e-5, atol=1e-5)
    # A CuPy stream made current is the stream the launch goes to: ordered with the
    # allocation, fill and read queued on it.
    with cupy.cuda.Stream(non_blocking=True):
        for _ in range(2):
            out = cupy.full(5000, np.nan, np.float32)
            launch(mixed_kernel, 5000, a, b, np.float32(-0.25), -3, False, out, threads=64)
            np.testing.assert_allclose(out.get(), expect, rtol=1e-5, atol=1e-5)
    # A piece of a larger allocation (numba_sc.core.pieces.Piece) is an array argument too.
    big = cupy.full(7000, np.nan, np.float32)
    for _ in range(2):
        part = pieces.piece(big, 4 * 1000, (5000,), np.float32)
        launch(mixed_kernel, 5000, a, b, np.float32(-0.25), -3, False, part, threads=64)
        np.testing.assert_allclose(big[1000:6000].get(), expect, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(part.get(), expect, rtol=1e-5, atol=1e-5)
    assert np.isnan(big[:1000].get()).all() and np.isnan(big[6000:].get()).all()  # nothing outside


@cuda.jit
def integer_kernel(a2d, b, offset, flip, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        v = a2d[i, 0] * 3 + a2d[i, 1] + b[i] + offset
        out[i] = -v if flip else v


@pytest.mark.skipif(not device.gpu_present(), reason="the fast launch path runs only on a GPU")
@pytest.mark.parametrize("raw", [True, False])
def test_raw_driver_launch_matches_dispatcher(monkeypatch, raw):
    """Integer-only signatures go straight to cuLaunchKernel from 8-byte slots
    (``FastLauncher.raw``); ``raw=False`` sends them through ``cuda.core``. Both
    must pass every field: 2-D and 1-D arrays, int32 and int64 arrays, negative
    scalars, booleans, pieces, a non-default stream."""
    fast = fast_launch.FastLauncher()
    fast.raw = raw
    monkeypatch.setattr(fast_launch, "FAST", fast)
    import cupy

    rng = np.random.default_rng(2)
    a = cupy.asarray(rng.integers(-50, 50, (3000, 2)).astype(np.int32))
    b = cupy.asarray(rng.integers(-9, 9, 3000).astype(np.int64))
    for offset, flip in ((5, False), (-(2 ** 40), True), (-7, False), (0, True)):
        expect = (a[:, 0].astype(np.int64) * 3 + a[:, 1] + b + offset).get()
        out = cupy.zeros(3000, np.int64)
        launch(integer_kernel, 3000, a, b, offset, flip, out, threads=128)
        np.testing.assert_array_equal(out.get(), -expect if flip else expect)
    (entry,) = [v for k, v in fast._compiled.items() if k[0] is integer_kernel]
    assert entry[2] is not None  # integer-only: the driver path is available
    big = cupy.full(5000, -1, np.int64)
    with cupy.cuda.Stream(non_blocking=True):
        for _ in range(2):
            part = pieces.piece(big, 8 * 1000, (3000,), np.int64)
            launch(integer_kernel, 3000, a, b, -3, False, part, threads=64)
            expect = (a[:, 0].astype(np.int64) * 3 + a[:, 1] + b - 3).get()
            np.testing.assert_array_equal(part.get(), expect)
    assert (big[:1000].get() == -1).all() and (big[4000:].get() == -1).all()


def test_simulator_threads_of_a_block_share_one_shared_array():
    """Numba's simulator makes a block's shared array in the first thread to reach the
    line, with no lock between its look-up and its store: two threads arriving together
    each made an array, and a thread wrote where nobody read (CI, 2026-11-27). Made
    certain here: the look-up is slowed so that every thread arrives before any store;
    with the lock, they all still get the very same array."""
    import threading
    import time

    from numba.cuda.simulator import kernelapi

    assert fast_launch.lock_simulator_shared_arrays(), ("numba's simulator moved FakeCUDAShared.array: "
                                                        "update core/fast_launch.py")

    class SlowLookUp(dict):
        def get(self, key, default=None):
            found = super().get(key, default)
            time.sleep(0.01)  # between the look-up and the store: every thread looks before any stores
            return found

    shared = kernelapi.FakeCUDAShared(0)
    shared._allocations = SlowLookUp()
    got, start = [], threading.Barrier(8)

    def thread():
        start.wait()
        got.append(shared.array(16, np.int64))  # one call site, as in a kernel (kept: ids of freed arrays repeat)

    threads = [threading.Thread(target=thread) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    arrays = {id(a) for a in got}
    assert len(got) == 8 and len(arrays) == 1, f"{len(arrays)} different arrays for one block"

"""The Map step's alternatives: hash table and dense grid == Minuet's sorted search == the oracle.

Kernels run under the simulator on small clouds; the NumPy references of all
three methods run on the full real scans.
"""
import numpy as np
import pytest
from conftest import crop
from helpers import (assert_matches_oracle, assert_same_map, oracle_map, oracle_offsets, oracle_outputs,
                     random_coords, searchsorted_oracle_table)

import numba_sc as ns
from numba_sc.core import conventions as cv
from numba_sc.map import grid_map
from numba_sc.map import hash_map
from numba_sc.core.backend import to_device, to_host
from numba_sc.core.pieces import as_array

METHODS = ("hash", "grid")


def _host(a):
    return None if a is None else np.asarray(to_host(as_array(a)))


def assert_same_extras(a, b):
    """What the forward search leaves for the metadata stage, found by the probes too."""
    for name in ("chunk_counts", "out_masks", "in_masks"):
        assert np.array_equal(_host(getattr(a, name)), _host(getattr(b, name))), name


# ------------------------------------------------------------- references
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", [
    dict(kernel_size=3), dict(kernel_size=3, stride=2), dict(kernel_size=2, stride=2),
    dict(kernel_size=5), dict(kernel_size=(1, 3, 1)), dict(kernel_size=3, dilation=2),
    dict(kernel_size=3, symmetric=False), dict(kernel_size=3, stride=(1, 2, 2)),
])
def test_reference_methods_match_oracle(rng, method, case):
    c = random_coords(rng, 400, span=7, batch=2)
    m = ns.build_kernel_map(c, backend="reference", method=method, **case)
    kw = {k: v for k, v in case.items() if k != "symmetric"}
    assert_matches_oracle(m, c, oracle_map(c, **kw))
    assert m.stats["method"] == method
    assert m.stats["probes"] >= (m.stats["pairs"] if method == "hash" else 0)


@pytest.mark.parametrize("method", METHODS)
def test_real_scans_reference(scan, method):
    name, points, vs = scan
    v = ns.voxelize(np.ascontiguousarray(points[:, :3]), vs, backend="reference").coords
    if method == "grid" and name == "semantickitti":  # an outdoor scan's box does not fit
        with pytest.raises(ValueError, match="method='sorted' or method='hash'"):
            ns.build_kernel_map(v, 3, backend="reference", method="grid")
        return
    for stride in (1, 2):
        m = ns.build_kernel_map(v, 3, stride=stride, backend="reference", method=method)
        ins, outs = np.unique(v, axis=0), oracle_outputs(v, stride, 1)
        offs = np.array(oracle_offsets(3))
        assert_matches_oracle(m, v, (ins, outs, offs, searchsorted_oracle_table(ins, outs, offs)))
        if method == "hash":  # load 1/2, a well-spread hash: Knuth's 1.5 (hit) to 2.5 (miss) slots
            assert 1.0 < m.stats["probes_per_lookup"] < 3.0, m.stats["probes_per_lookup"]


# ----------------------------------------------------------------- kernels
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", [dict(kernel_size=3), dict(kernel_size=3, stride=2),
                                  dict(kernel_size=2, stride=2, symmetric=False)])
def test_kernels_match_sorted_path(rng, method, case):
    c = random_coords(rng, 250, span=6, batch=2)  # shuffled: sorted on the device first
    ref = ns.build_kernel_map(c, backend="reference", **case)
    srt = ns.build_kernel_map(c, backend="cuda", masks=True, **case)
    got = ns.build_kernel_map(c, backend="cuda", masks=True, method=method, **case)
    assert_same_map(got, ref)
    assert_same_extras(got, srt)
    assert got.stats["method"] == method and got.stats["sorted_on_device"]


@pytest.mark.parametrize("method", METHODS)
def test_real_scan_crops_through_kernels(scan, method):
    _, points, vs = scan
    v = ns.voxelize(np.ascontiguousarray(crop(points, 400)[:, :3]), vs, backend="reference").coords
    m = ns.build_kernel_map(v, 3, backend="cuda", method=method, masks=True, assume_sorted=False)
    assert_matches_oracle(m, v, oracle_map(v, 3))
    assert_same_extras(m, ns.build_kernel_map(v, 3, backend="cuda", masks=True))


def test_sparse_conv_through_each_map(rng):
    """A layer given a hashed or gridded map computes what it computes on the sorted one."""
    c = random_coords(rng, 200, span=5)
    x = ns.SparseTensor(c, rng.standard_normal((len(c), 4)).astype(np.float32))
    w = rng.standard_normal((27, 4, 5)).astype(np.float32)
    want = ns.sparse_conv3d(x, w, backend="reference").features
    for method in METHODS:
        km = ns.build_kernel_map(x.coords, 3, backend="cuda", method=method, masks=True, assume_sorted=True)
        got = ns.sparse_conv3d(x, w, kernel_map=km, backend="cuda").features
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------- the hash table itself
def test_hash_kernel_and_reference_agree(rng):
    """The device hash equals the NumPy one: a table built by the kernel answers the
    reference lookups, and the reference counts what linear probing should cost."""
    keys = np.unique(cv.pack_keys(random_coords(rng, 300, span=20)))
    slot_keys, slot_vals = (to_host(a) for a in hash_map.build_cuda(to_device(keys)))
    assert len(slot_keys) == hash_map.capacity_for(len(keys)) == 1024
    found, probes = hash_map.lookup_reference(slot_keys, slot_vals, keys)
    assert np.array_equal(found, np.arange(len(keys)))  # every key finds its own index
    home = (hash_map.hash_reference(keys) & np.uint64(len(slot_keys) - 1)).astype(np.int64)
    at = np.flatnonzero(slot_keys != hash_map.EMPTY)
    # each stored key lies at its home slot or after it, with no empty slot in between
    for s in at:
        h = int(home[slot_vals[s]])
        assert np.all(slot_keys[np.arange(h, s + (s < h) * len(slot_keys) + 1) % len(slot_keys)] != -1)
    assert probes.mean() < 2.0
    missing, p = hash_map.lookup_reference(slot_keys, slot_vals, keys + (1 << 56))  # batch 4: none there
    assert np.all(missing == -1) and np.all(p >= 1)


def test_hash_worked_example_of_collisions():
    """The module's example: two keys sharing a home slot, the second walks on."""
    keys = np.array([5, 9, 12], np.int64)
    cap = 64
    homes = hash_map.hash_reference(keys) & np.uint64(cap - 1)
    # find keys with the same home slot to exercise the walk
    base = int(homes[0])
    more = [k for k in range(13, 5000) if int(hash_map.hash_reference([k])[0] & np.uint64(cap - 1)) == base][:2]
    keys = np.array([5, *more], np.int64)
    slot_keys, slot_vals, probes = hash_map.build_reference(keys, cap)
    assert slot_keys[base] == 5 and slot_keys[(base + 1) % cap] == more[0] and slot_keys[(base + 2) % cap] == more[1]
    assert probes == 1 + 2 + 3
    found, p = hash_map.lookup_reference(slot_keys, slot_vals, np.array([more[1], 7777777], np.int64))
    assert found[0] == 2 and p[0] == 3 and found[1] == -1


# ---------------------------------------------------------- the grid itself
def test_grid_worked_example():
    c = np.array([[0, 0, 3], [0, 0, 4], [0, 0, 7]], np.int32)
    box, cells = grid_map.grid_box_reference(c)
    assert cells == 5 and list(box[:3]) == [0, 0, 3]
    keys = cv.pack_keys(c)
    grid = grid_map.build_reference(keys, box)
    assert grid.tolist() == [0, 1, -1, -1, 2]
    q = cv.pack_keys(np.array([[0, 0, 6], [0, 0, 8], [0, 0, 4]], np.int32))
    found, reads = grid_map.lookup_reference(grid, box, q)
    assert found.tolist() == [-1, -1, 1] and reads.tolist() == [1, 0, 1]


def test_grid_kernels_match_reference(rng):
    c = np.unique(random_coords(rng, 300, span=8, batch=3), axis=0)  # sorted
    keys = cv.pack_keys(c)
    grid, box = (to_host(a) for a in grid_map.build_cuda(to_device(keys), to_device(c)))
    want_box, cells = grid_map.grid_box_reference(c)
    assert np.array_equal(box, want_box) and len(grid) == cells
    assert np.array_equal(grid, grid_map.build_reference(keys, want_box))
    # off by one: a box shifted by one voxel along x puts every input in the wrong cell
    shifted = want_box.copy()
    shifted[0] -= 1
    assert not np.array_equal(grid_map.build_reference(keys, shifted)[:cells], grid)


def test_probe_kernel_sees_an_off_by_one_delta(rng):
    """The comparison is sharp: deltas moved by one voxel along z give another table."""
    c = np.unique(random_coords(rng, 300, span=6), axis=0)
    keys = to_device(cv.pack_keys(c, (-1, -1, -1), (2, 2, 2)))
    m = ns.build_kernel_map(c, 3, backend="reference")
    from numba_sc.core.backend import filled
    from numba_sc.map.map_probe import probe_cuda
    slot_keys, slot_vals = hash_map.build_cuda(keys)
    deltas = cv.key_delta(m.offsets)
    for shift, same in ((0, True), (1, False)):
        K, Q = m.table.shape
        table, counts = filled((K, Q), np.int32, -1), filled(K, np.int64, 0)
        chunk_counts = filled((K, -(-Q // ns.gmas.metadata.chunk_size())), np.int32, 0)
        probe_cuda(hash_map.lookup_device, slot_keys, slot_vals, keys, to_device(deltas + shift), table, counts,
                   ns.gmas.metadata.chunk_size(), chunk_counts)
        assert np.array_equal(to_host(table), m.table) == same
        assert np.array_equal(to_host(counts), m.counts) == same


# ------------------------------------------------------------- bad input
def test_bad_method():
    with pytest.raises(ValueError, match="method must be one of"):
        ns.build_kernel_map(np.zeros((1, 3), np.int32), method="cuckoo", backend="reference")


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_grid_too_large_is_refused(backend):
    c = np.array([[0, 0, 0], [0, 0, 1], [5000, 4000, 100]], np.int32)
    with pytest.raises(ValueError, match=r"method='grid' needs a location table of .* cells"):
        ns.build_kernel_map(c, 3, backend=backend, method="grid")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_lookup_methods_refuse_what_sorted_refuses(method, backend):
    with pytest.raises(ValueError, match="packable range"):
        ns.build_kernel_map(np.array([[0, 0, cv.COORD_MAX]], np.int32), 3, backend=backend, method=method)
    with pytest.raises(ValueError, match="repeated"):
        ns.build_kernel_map(np.array([[0, 0, 1], [0, 0, 1], [0, 0, 0]], np.int32), 3, backend=backend,
                            method=method)
    with pytest.raises(ValueError, match="in_coords is empty"):
        ns.build_kernel_map(np.zeros((0, 3), np.int32), 3, backend=backend, method=method)

"""The Map step: kernels (simulator) == NumPy reference == an independent oracle.

The oracle is written in helpers.py from the definition alone: ``np.unique`` rows
for the sorted coordinates, ``itertools.product`` for the offsets, and a Python dict
from coordinate tuple to sorted index (small clouds) or ``searchsorted`` on keys
packed by its own formula (full scans).
"""
import numpy as np
import pytest
from conftest import crop
from hypothesis import given, settings
from hypothesis import strategies as st

import numba_sc as ns
from numba_sc.core import conventions as cv
from numba_sc.core.backend import to_device, to_host
from numba_sc.map.backward_search import (backward_search_cuda, backward_search_reference,
                                      max_balanced_blocks, split_query_blocks_reference)
from numba_sc.map.forward_search import forward_search_cuda, forward_search_reference
from numba_sc.core.conventions import chunk_size
from numba_sc.gmas.metadata import chunk_counts_reference
from numba_sc.map.query_segments import query_segments_reference

from helpers import (assert_matches_oracle, assert_same_map, oracle_map, oracle_offsets, oracle_outputs,
                     random_coords, searchsorted_oracle_table)


# ------------------------------------------------------------ worked example
def test_docstring_worked_example():
    c = np.array([[3, 0, 0], [0, 0, 0], [1, 0, 0]], np.int32)
    for backend in ("reference", "cuda"):
        m = ns.build_kernel_map(c, (3, 1, 1), backend=backend)
        assert m.in_order.tolist() == [1, 2, 0]
        assert m.table.tolist() == [[-1, 0, -1], [0, 1, 2], [1, -1, -1]]
        assert m.counts.tolist() == [1, 3, 1]


def test_stage_docstring_examples():
    """The worked example of backward_search.py and forward_search.py, both backends."""
    s, q, d = (np.array(a, np.int64) for a in ([1, 4, 6, 7, 9], [0, 2, 3, 4, 5, 8, 12], [0]))
    bounds, _ = backward_search_reference(s, q, d, 2)
    assert bounds.tolist() == [[0, 4, 5, 6]]
    ds, dq, dd = to_device(s), to_device(q), to_device(d)  # the stage launchers take device arrays
    upper = max_balanced_blocks(1, 5, 7, 2, 2)
    bounds_k, rows_k, n_rows = backward_search_cuda(ds, dq, dd, 2, 2, upper)
    assert np.array_equal(to_host(bounds_k), bounds)
    rows = split_query_blocks_reference(bounds, 2)
    assert rows.tolist() == [[0, 0, 0, 2], [0, 0, 2, 4], [0, 1, 4, 5], [0, 2, 5, 6]]
    assert int(to_host(n_rows)[0]) == 4
    assert sorted(to_host(rows_k)[:4].tolist()) == rows.tolist()  # written in no fixed order
    expect = [[-1, -1, -1, 1, -1, -1, -1]]
    assert forward_search_reference(s, q, d, bounds, 2)[0].tolist() == expect
    table, counts, _ = forward_search_cuda(ds, dq, dd, rows_k, n_rows, 2, 2, grid=upper)
    assert to_host(table).tolist() == expect
    assert to_host(counts).tolist() == [1]


def test_segments_are_shifted_keys(rng):
    """Stage 4's premise: key(q) + key_delta(d) == key(q + d), every segment sorted."""
    q = np.unique(rng.integers(-50, 50, size=(200, 3)), axis=0).astype(np.int32)
    offs = cv.kernel_offsets(3, 2)
    seg = query_segments_reference(cv.pack_keys(q, offs.min(0), offs.max(0)), cv.key_delta(offs))
    for k, d in enumerate(offs):
        assert np.array_equal(seg[k], cv.pack_keys(q + d))
        assert np.all(np.diff(seg[k]) > 0)


# ------------------------------------------------- kernel == reference == oracle
CASES = {
    # name: (cloud kwargs, layer kwargs, B, C)
    "k1": (dict(n=300), dict(kernel_size=1), 32, 16),
    "k2": (dict(n=300), dict(kernel_size=2), 32, 16),
    "k3": (dict(n=300), dict(kernel_size=3), 32, 16),
    "k131": (dict(n=300), dict(kernel_size=(1, 3, 1)), 32, 8),
    "k5": (dict(n=200), dict(kernel_size=5), 256, 128),
    "dilation2": (dict(n=250), dict(kernel_size=3, dilation=2), 64, 32),
    "stride2_k2": (dict(n=400), dict(kernel_size=2, stride=2), 32, 16),
    "stride2_k3": (dict(n=300), dict(kernel_size=3, stride=2), 64, 32),
    "stride122": (dict(n=300), dict(kernel_size=3, stride=(1, 2, 2)), 32, 16),
    "tensor_stride2": (dict(n=250, multiple=2), dict(kernel_size=3, stride=2, tensor_stride=2), 32, 32),
    "batch3": (dict(n=300, batch=3, span=5), dict(kernel_size=3), 32, 16),
    "batch3_stride2": (dict(n=300, batch=3, span=6), dict(kernel_size=2, stride=2), 32, 16),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_reference_oracle(rng, case):
    cloud, layer, B, C = CASES[case]
    c = random_coords(rng, **cloud)
    r = ns.build_kernel_map(c, backend="reference", source_block=B, query_block=C, **layer)
    k = ns.build_kernel_map(c, backend="cuda", source_block=B, query_block=C, **layer)
    assert_matches_oracle(r, c, oracle_map(c, **layer))
    assert_same_map(k, r)
    assert int(k.stats["query_blocks_after_balancing"]) == r.stats["query_blocks_after_balancing"]
    assert int(k.stats["pairs"]) == r.stats["pairs"] == int(r.counts.sum())
    assert r.stats["largest_query_block_after"] <= C
    assert r.stats["query_blocks_after_balancing"] <= r.stats["forward_grid_upper_bound"]
    assert k.out_tensor_stride == tuple(np.multiply(cv.as_int_tuple(layer.get("stride", 1), "s"),
                                                    cv.as_int_tuple(layer.get("tensor_stride", 1), "t")))


def test_many_blocks_and_splits_happen(rng):
    """The small B and C of the cases above really exercise stage 5's split."""
    c = random_coords(rng, 300)
    r = ns.build_kernel_map(c, 3, backend="reference", source_block=32, query_block=16)
    assert r.stats["source_blocks"] >= 8
    assert r.stats["query_blocks_after_balancing"] > r.stats["nonempty_query_blocks"]
    assert r.stats["largest_query_block_before"] > 16


def test_batches_never_mix(rng):
    """The same cloud in batches 0 and 2: each map is the single cloud's map."""
    one = random_coords(rng, 150, span=5)
    both = np.concatenate([np.column_stack([np.zeros(len(one), np.int32), one]),
                           np.column_stack([np.full(len(one), 2, np.int32), one])]).astype(np.int32)
    single = ns.build_kernel_map(one, 3, backend="reference")
    m = ns.build_kernel_map(both, 3, backend="cuda", source_block=64, query_block=64)
    n = len(one)
    assert np.array_equal(m.table[:, :n], single.table)  # batch 0 comes first in sorted order
    assert np.array_equal(m.table[:, n:], np.where(single.table >= 0, single.table + n, -1))


def test_backward_kernel_across_thread_blocks(rng):
    """More lanes than one thread block holds: the first lane of every thread block
    searches its start itself (its left neighbour's end lives in another block)."""
    c = random_coords(rng, 1500, span=12)
    offs = cv.kernel_offsets(3)
    skeys = np.sort(cv.pack_keys(c, offs.min(0), offs.max(0)))
    deltas = cv.key_delta(offs)
    B, C = 32, 16
    bounds_r, _ = backward_search_reference(skeys, skeys, deltas, B)
    assert bounds_r.size - len(deltas) > 3 * 256  # lanes: several thread blocks
    upper = max_balanced_blocks(len(deltas), len(skeys), len(skeys), B, C)
    dkeys, ddeltas = to_device(skeys), to_device(deltas)
    bounds_k, rows_k, n_rows = backward_search_cuda(dkeys, dkeys, ddeltas, B, C, upper)
    assert np.array_equal(to_host(bounds_k), bounds_r)
    rows_r = split_query_blocks_reference(bounds_r, C)
    got = to_host(rows_k)[: int(to_host(n_rows)[0])]
    assert np.array_equal(got[np.lexsort(got.T[::-1])], rows_r)


def test_stages_kernel_equals_reference(rng):
    """Stages 5 and 6 separately: bounds, balanced rows, and the upper-bound launch
    whose surplus blocks must leave without writing."""
    c = random_coords(rng, 150)
    offs = cv.kernel_offsets(3)
    skeys = np.sort(cv.pack_keys(c, offs.min(0), offs.max(0)))
    deltas = cv.key_delta(offs)
    B, C = 32, 32
    bounds_r, _ = backward_search_reference(skeys, skeys, deltas, B)
    dkeys, ddeltas = to_device(skeys), to_device(deltas)  # the stage launchers take device arrays
    upper = max_balanced_blocks(len(deltas), len(skeys), len(skeys), B, C)
    bounds_k, rows_k, n_rows = backward_search_cuda(dkeys, dkeys, ddeltas, B, C, upper)
    assert np.array_equal(to_host(bounds_k), bounds_r)
    rows_r = split_query_blocks_reference(bounds_r, C)
    assert int(to_host(n_rows)[0]) == len(rows_r) < upper
    got = to_host(rows_k)[: len(rows_r)]
    assert np.array_equal(got[np.lexsort(got.T[::-1])], rows_r)  # written in no fixed order
    # balanced rows tile every query block exactly
    sizes = rows_r[:, 3] - rows_r[:, 2]
    assert sizes.min() >= 1 and sizes.max() <= C
    assert sizes.sum() == (bounds_r[:, -1] - bounds_r[:, 0]).sum()
    table_r, _ = forward_search_reference(skeys, skeys, deltas, bounds_r, B)
    table_k, counts, chunk_counts = forward_search_cuda(dkeys, dkeys, ddeltas, rows_k, n_rows, B, C, grid=upper)
    assert np.array_equal(to_host(table_k), table_r)
    assert np.array_equal(to_host(counts), (table_r >= 0).sum(axis=1))  # counted in the kernel
    # and per chunk of outputs, for the metadata stage; a small chunk puts many borders inside
    _, _, small = forward_search_cuda(dkeys, dkeys, ddeltas, rows_k, n_rows, B, C, grid=upper, chunk=8)
    np.testing.assert_array_equal(to_host(small), chunk_counts_reference(table_r, 8))
    with pytest.raises(ValueError, match="power of two"):  # the kernel finds a chunk with a shift
        forward_search_cuda(dkeys, dkeys, ddeltas, rows_k, n_rows, B, C, grid=upper, chunk=7)
    np.testing.assert_array_equal(to_host(chunk_counts), chunk_counts_reference(table_r, chunk_size()))
    # Blocks past the device count must leave, even where the rows hold real work:
    # claim only half the rows and those queries must stay unanswered.
    cut = len(rows_r) // 2
    expect = table_r.copy()
    for k, _, a, b in got[cut:]:
        expect[k, a:b] = -1
    assert (expect != table_r).any()
    table_cut, _, _ = forward_search_cuda(dkeys, dkeys, ddeltas, rows_k, to_device(np.array([cut])), B, C,
                                          grid=upper)
    assert np.array_equal(to_host(table_cut), expect)
    assert np.array_equal(table_r, searchsorted_oracle_table(np.unique(c, axis=0), np.unique(c, axis=0), offs))


def test_empty_segments_and_blocks():
    """Offsets whose whole segment lies past the last input give no query block at all."""
    c = np.array([[0, 0, z] for z in range(40)], np.int32)  # one column of voxels
    r = ns.build_kernel_map(c, 3, backend="reference", source_block=32, query_block=16)
    k = ns.build_kernel_map(c, 3, backend="cuda", source_block=32, query_block=16)
    assert_matches_oracle(r, c, oracle_map(c, 3))
    assert_same_map(k, r)
    keys = cv.pack_keys(c, (-1,) * 3, (1,) * 3)
    bounds, _ = backward_search_reference(keys, keys, cv.key_delta(r.offsets), 32)
    dx_pos = r.offsets[:, 0] > 0
    assert (bounds[dx_pos, -1] == 0).all()  # x + 1 > every input: the segment is empty
    assert np.array_equal(r.counts > 0, (r.offsets[:, 0] == 0) & (r.offsets[:, 1] == 0))
    assert r.stats["nonempty_query_blocks"] < r.stats["query_blocks_before_balancing"]


@pytest.mark.parametrize("kernel_size, centre", [(3, 13), (2, 0), ((1, 3, 1), 1)])
def test_one_point(kernel_size, centre):
    c = np.array([[5, -7, 2]], np.int32)
    for backend in ("reference", "cuda"):
        m = ns.build_kernel_map(c, kernel_size, backend=backend)
        expect = np.full((len(m.offsets), 1), -1)
        expect[centre] = 0
        assert np.array_equal(m.table, expect)
        assert np.array_equal(m.offsets[centre], [0, 0, 0])


def test_given_out_coords(rng):
    """Outputs chosen by the caller, in any order: sorted for the search, out_order kept."""
    c = random_coords(rng, 250)
    out = random_coords(rng, 120)
    r = ns.build_kernel_map(c, 3, out_coords=out, backend="reference", source_block=32, query_block=16)
    k = ns.build_kernel_map(c, 3, out_coords=out, backend="cuda", source_block=32, query_block=16)
    assert_matches_oracle(r, c, oracle_map(c, 3, out_coords=out))
    assert np.array_equal(r.out_coords, out[r.out_order])
    assert_same_map(k, r)
    # only one side out of order: the kernel path finds out from its report, sorts
    # that side alone and searches again
    srt_c, srt_out = c[np.lexsort(c.T[::-1])], out[np.lexsort(out.T[::-1])]
    for cin, cout, which in ((srt_c, out, "out"), (c, srt_out, "in")):
        r = ns.build_kernel_map(cin, 3, out_coords=cout, backend="reference", source_block=32, query_block=16)
        k = ns.build_kernel_map(cin, 3, out_coords=cout, backend="cuda", source_block=32, query_block=16)
        assert_same_map(k, r)
        assert k.stats["sorted_on_device"], which  # assert_same_map compared both orders


# ------------------------------------------------------------------ real scans
def test_real_scan_reference_vs_oracle(scan):
    name, points, vs = scan
    v = ns.voxelize(np.ascontiguousarray(points[:, :3]), vs, backend="reference").coords
    for stride in (1, 2):
        m = ns.build_kernel_map(v, 3, stride=stride, backend="reference")
        ins, outs = np.unique(v, axis=0), oracle_outputs(v, stride, 1)
        offs = np.array(oracle_offsets(3))
        assert_matches_oracle(m, v, (ins, outs, offs, searchsorted_oracle_table(ins, outs, offs)))
        assert 0 < m.stats["hit_rate"] < 1
        assert m.stats["comparisons_per_query"] < m.stats["plain_binary_search_comparisons"] / m.stats["queries"]


def test_real_scan_crop_kernel(scan):
    name, points, vs = scan
    v = ns.voxelize(np.ascontiguousarray(crop(points, 800)[:, :3]), vs, backend="reference").coords
    r = ns.build_kernel_map(v, 3, backend="reference", source_block=64, query_block=64)
    k = ns.build_kernel_map(v, 3, backend="cuda", source_block=64, query_block=64)
    assert_matches_oracle(r, v, oracle_map(v, 3))
    assert_same_map(k, r)


def test_dict_and_searchsorted_oracles_agree(rng):
    c = random_coords(rng, 300)
    ins, outs, offs, table = oracle_map(c, 3, stride=2)
    assert np.array_equal(table, searchsorted_oracle_table(ins, outs, offs))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 120), span=st.integers(1, 8),
       kernel=st.sampled_from([1, 2, 3, (3, 1, 2)]), stride=st.sampled_from([1, 2, (2, 1, 3)]),
       B=st.sampled_from([32, 64]), C=st.integers(1, 40))
def test_reference_property(seed, n, span, kernel, stride, B, C):
    c = random_coords(np.random.default_rng(seed), n, span=span)
    m = ns.build_kernel_map(c, kernel, stride=stride, backend="reference", source_block=B, query_block=C)
    assert_matches_oracle(m, c, oracle_map(c, kernel, stride=stride))


# ------------------------------------------------------------------ transposed
def test_transposed_contract_and_round_trip(rng):
    c = random_coords(rng, 300)
    m = ns.build_kernel_map(c, 2, stride=2, backend="reference")
    T = m.transposed()
    K = len(m.offsets)
    assert np.array_equal(T.in_coords, m.out_coords) and np.array_equal(T.out_coords, m.in_coords)
    assert np.array_equal(T.offsets, -m.offsets[::-1])
    assert np.array_equal(T.offsets, np.unique(T.offsets, axis=0))  # still sorted
    assert np.array_equal(T.counts, m.counts[::-1])
    assert T.tensor_stride == m.out_tensor_stride == (2, 2, 2) and T.out_tensor_stride == m.tensor_stride
    assert T.is_transposed and not m.is_transposed
    expect = np.full((K, len(m.in_coords)), -1)
    for k in range(K):
        for i in range(len(m.out_coords)):
            if m.table[k, i] >= 0:
                expect[K - 1 - k, m.table[k, i]] = i
    assert np.array_equal(T.table, expect)
    # T obeys the usual rule: output p reads input p + T.offsets[k']
    kk, p = np.nonzero(T.table >= 0)
    assert np.array_equal(T.in_coords[T.table[kk, p]], T.out_coords[p] + T.offsets[kk])
    assert_same_map(T.transposed(), m)


def test_transposed_of_kernel_map(rng):
    c = random_coords(rng, 200, batch=2, span=5)
    k = ns.build_kernel_map(c, 3, stride=(1, 2, 2), backend="cuda", source_block=32, query_block=32)
    r = ns.build_kernel_map(c, 3, stride=(1, 2, 2), backend="reference")
    assert_same_map(k.transposed(), r.transposed())


# --------------------------------------------------------- the check can fail
def test_corrupted_table_is_caught(rng):
    c = random_coords(rng, 200)
    k = ns.build_kernel_map(c, 3, backend="cuda", source_block=32, query_block=32)
    oracle = oracle_map(c, 3)
    assert_matches_oracle(k, c, oracle)
    kk, i = np.argwhere(k.table >= 0)[7]
    k.table[kk, i] += 1  # off by one: the neighbouring input
    with pytest.raises(AssertionError):
        assert_matches_oracle(k, c, oracle)


# ------------------------------------------------------------------ bad inputs
@pytest.mark.parametrize("B", [100, 16, 8192, 0, -256])
def test_bad_source_block(B):
    c = np.zeros((1, 3), np.int32)
    with pytest.raises(ValueError, match=r"source_block \(B\) must be a power of two"):
        ns.build_kernel_map(c, backend="reference", source_block=B)


@pytest.mark.parametrize("C", [0, -5])
def test_bad_query_block(C):
    c = np.zeros((1, 3), np.int32)
    with pytest.raises(ValueError, match=r"query_block \(C\) must be a positive int"):
        ns.build_kernel_map(c, backend="reference", query_block=C)
    with pytest.raises(TypeError, match=r"query_block \(C\) must be an int"):
        ns.build_kernel_map(c, backend="reference", query_block=2.5)


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_edge_of_packable_range(backend):
    edge = np.array([[cv.COORD_MAX, 0, 0], [0, cv.COORD_MIN, 0]], np.int32)
    m = ns.build_kernel_map(edge, 1, backend=backend)  # no reach: fine
    assert m.table.tolist() == [[0, 1]]
    with pytest.raises(ValueError, match="in_coords.*packable"):
        ns.build_kernel_map(edge, 3, backend=backend)  # x + 1 would wrap into the batch field
    # a kernel reaching 1 below COORD_MIN on y would wrap into the x field
    with pytest.raises(ValueError, match="in_coords.*packable"):
        ns.build_kernel_map(edge[1:], (1, 3, 1), backend=backend)


def test_other_bad_inputs():
    c = np.array([[0, 0, 0], [1, 0, 0], [0, 0, 0]], np.int32)
    with pytest.raises(ValueError, match="repeated"):
        ns.build_kernel_map(c, backend="reference")
    with pytest.raises(ValueError, match="repeated"):
        ns.build_kernel_map(c, backend="cuda")
    with pytest.raises(ValueError, match="columns"):
        ns.build_kernel_map(c[:2], out_coords=np.zeros((1, 4), np.int32), backend="reference")
    with pytest.raises(ValueError, match="kernel_size"):
        ns.build_kernel_map(c[:2], kernel_size=0, backend="reference")
    # The layer's arguments are remembered per call signature (kernel_map.layer_arguments):
    # a bad one is refused every time, and equal layers spelled differently agree.
    with pytest.raises(ValueError, match="kernel_size"):
        ns.build_kernel_map(c[:2], kernel_size=0, backend="cuda")
    a = ns.build_kernel_map(c[:2], kernel_size=3, backend="reference")
    b = ns.build_kernel_map(c[:2], kernel_size=(3, 3, 3), dilation=np.array([1, 1, 1]), backend="reference")
    np.testing.assert_array_equal(a.offsets, b.offsets)
    assert not a.offsets.flags.writeable  # shared by every map of the layer
    with pytest.raises(TypeError, match="integer"):
        ns.build_kernel_map(c[:2].astype(np.float32), backend="reference")


# ------------------------------------------- sorted input, assume_sorted, the report
@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_sorted_input_needs_no_sort(rng, backend):
    """Sorted unique input: the identity order, and the same map as for a shuffled copy."""
    c = random_coords(rng, 200)
    srt = c[np.lexsort(c.T[::-1])]
    a = ns.build_kernel_map(srt, 3, backend=backend, source_block=32, query_block=16)
    b = ns.build_kernel_map(c, 3, backend=backend, source_block=32, query_block=16)
    assert np.array_equal(a.in_order, np.arange(len(c)))
    assert not np.array_equal(b.in_order, np.arange(len(c)))  # the shuffled copy was sorted
    if backend == "cuda":  # the optimistic search was confirmed, or redone after a sort
        assert a.stats["sorted_on_device"] is False and b.stats["sorted_on_device"] is True
    for name in ("in_coords", "table", "counts"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    # one swapped pair of rows is enough to need the sort
    swapped = srt.copy()
    swapped[[10, 11]] = swapped[[11, 10]]
    m = ns.build_kernel_map(swapped, 3, backend=backend, source_block=32, query_block=16)
    assert m.in_order[10] == 11 and m.in_order[11] == 10
    assert np.array_equal(m.table, a.table)


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_assume_sorted_is_checked(rng, backend):
    c = random_coords(rng, 100)
    srt = c[np.lexsort(c.T[::-1])]
    m = ns.build_kernel_map(srt, 3, backend=backend, assume_sorted=True)
    assert np.array_equal(m.table, ns.build_kernel_map(srt, 3, backend="reference").table)
    with pytest.raises(ValueError, match="assume_sorted=True but is not sorted"):
        ns.build_kernel_map(c, 3, backend=backend, assume_sorted=True)
    dup = np.concatenate([srt[:1], srt])  # sorted, but not unique
    with pytest.raises(ValueError, match="repeated|not sorted"):
        ns.build_kernel_map(dup, 3, backend=backend, assume_sorted=True)
    edge = np.array([[0, cv.COORD_MIN, 0]], np.int32)  # the range error is raised from the report
    with pytest.raises(ValueError, match="in_coords.*packable"):
        ns.build_kernel_map(edge, 3, backend=backend, assume_sorted=True)


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_repeated_rows_found_after_the_sort(backend):
    """Unsorted input with a repeat far from its twin: found by the sort path (permute
    kernel) and named with its count; the same for out_coords."""
    c = np.array([[5, 0, 0], [1, 0, 0], [3, 0, 0], [1, 0, 0], [0, 2, 0], [5, 0, 0]], np.int32)
    with pytest.raises(ValueError, match="in_coords holds 2 repeated"):
        ns.build_kernel_map(c, 3, backend=backend)
    ok = np.unique(c, axis=0)
    with pytest.raises(ValueError, match="out_coords holds 2 repeated"):
        ns.build_kernel_map(ok, 3, out_coords=c, backend=backend)


def test_host_counts_read_once_and_transposed(rng):
    c = random_coords(rng, 150)
    m = ns.build_kernel_map(c, 2, stride=2, backend="cuda")
    assert m.counts_host is not None  # read with the report, no second read
    assert np.array_equal(m.host_counts(), m.counts)
    t = m.transposed()
    assert np.array_equal(t.host_counts(), m.host_counts()[::-1])


# ------------------------------------------------ symmetric submanifold search
def test_mirror_reference_worked_example():
    """Rows not searched are read off their mirrors: table[K-1-k, table[k, i]] = i."""
    from numba_sc.map.forward_search import mirror_reference

    # one axis, P = Q = [0, 1, 3], offsets [-1, 0, 1]: only rows 0 (offset -1) and 1 searched
    half = np.array([[-1, 0, -1], [0, 1, 2]], np.int32)
    np.testing.assert_array_equal(mirror_reference(half, 3), [[-1, 0, -1], [0, 1, 2], [1, -1, -1]])
    np.testing.assert_array_equal(mirror_reference(half, 2), half)  # h == K: nothing to mirror


@pytest.mark.parametrize("kernel_size, dilation, searched", [
    (3, 1, 14), (5, 1, 63), ((1, 3, 1), 1, 2), (3, 2, 14), (1, 1, 1), (2, 1, 8), ((2, 3, 3), 1, 18)])
def test_symmetric_search_equals_full_search(rng, kernel_size, dilation, searched):
    """ceil(K/2) segments searched for odd kernels (all K for even ones), same table as
    the paper's full search and the oracle, on both backends, many blocks and splits."""
    c = np.unique(rng.integers(0, 10, size=(250, 3)).astype(np.int32), axis=0)
    _, _, _, want = oracle_map(c, kernel_size, dilation=dilation)
    kw = dict(dilation=dilation, source_block=32, query_block=16)
    full = ns.build_kernel_map(c, kernel_size, backend="reference", symmetric=False, **kw)
    assert full.stats["segments_searched"] == len(full.offsets)
    for backend in ("reference", "cuda"):
        m = ns.build_kernel_map(c, kernel_size, backend=backend, **kw)
        assert m.stats["segments_searched"] == searched
        np.testing.assert_array_equal(to_host(m.table), want)
        np.testing.assert_array_equal(to_host(m.counts), full.counts)
        if backend == "cuda":  # the mirrored entries are counted per chunk as well
            np.testing.assert_array_equal(to_host(m.chunk_counts), chunk_counts_reference(want, chunk_size()))
    half = ns.build_kernel_map(c, kernel_size, backend="reference", **kw)
    assert half.stats["queries_searched"] == searched * len(c)
    if searched < len(full.offsets):  # fewer queries searched, fewer comparisons made
        assert half.stats["forward_comparisons"] < full.stats["forward_comparisons"]


def test_strided_and_given_outputs_search_every_segment(rng):
    """The mirror needs Q = P: a strided layer, or outputs the caller chose, search all K."""
    c = np.unique(rng.integers(0, 10, size=(200, 3)).astype(np.int32), axis=0)
    assert ns.build_kernel_map(c, 3, stride=2, backend="reference").stats["segments_searched"] == 27
    m = ns.build_kernel_map(c, 3, out_coords=c[::2], backend="cuda", source_block=32, query_block=16)
    assert m.stats["segments_searched"] == 27
    np.testing.assert_array_equal(to_host(m.table), oracle_map(c, 3, out_coords=c[::2])[3])

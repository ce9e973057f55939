"""The scatter (stage 10). Every tile size, bit for bit against the reference, is
checked beside the gather in test_gather.py (``test_every_tile_size``); the word
views it reads are checked in test_words.py."""
import numpy as np

from numba_sc.core.backend import to_host


def test_public_scatter_leaves_init_untouched():
    from numba_sc.gmas.scatter import scatter

    obuf = np.arange(12, dtype=np.float32).reshape(6, 2)
    table = np.array([[0, 3], [1, -1], [2, 5]], dtype=np.int32)
    init = np.ones((3, 2), np.float32)
    for backend in ("cuda", "reference"):
        out = to_host(scatter(obuf, table, init, backend=backend))
        assert np.array_equal(init, np.ones((3, 2), np.float32))
        assert np.array_equal(out, 1 + np.array([[6, 8], [2, 3], [14, 16]], np.float32))


# ----------------------------------------------------------- the guard of fp16 products
def _poisoned_layer(c_out=4):
    """A 3x3x3 submanifold layer in fp16 (C_in 3, C_out ``c_out``) whose per-offset products are in an
    fp16 buffer, with one row in five (and about one centre product in four) replaced by inf, as
    cuBLAS writes a product past 65504. Returns the arrays the scatter gets, the exact fp32
    products and the mask of the rows poisoned."""
    import numba_sc as ns
    from numba_sc.gmas import gemm_grouping as gg
    from numba_sc.gmas.gather import gather_reference
    from numba_sc.gmas.plan import build_plan
    from helpers import random_coords

    rng = np.random.default_rng(7)
    coords = np.unique(random_coords(rng, 40, span=4), axis=0)
    x = rng.standard_normal((len(coords), 3)).astype(np.float16)
    w = rng.standard_normal((27, 3, c_out)).astype(np.float16)  # a different matrix per offset
    km = ns.sparse_conv3d(ns.SparseTensor(coords, x), w, backend="reference").kernel_map
    plan = build_plan(km, backend="reference")
    ibuf = gather_reference(x, plan.in_table, plan.rows)
    exact = gg.grouped_gemm_reference(ibuf, w, plan.groups, np.zeros((plan.rows, c_out), np.float32))
    init = x.astype(np.float32) @ w[plan.centre].astype(np.float32)
    bad_rows = np.arange(plan.rows) % 5 == 1
    # (only where pairs add to the centre product: alone, it is the output, and its inf the output's own)
    bad_init = (np.arange(len(coords)) % 4 == 2) & (plan.out_table >= 0).any(axis=1)
    obuf, init16 = exact.astype(np.float16), init.astype(np.float16)
    obuf[bad_rows], init16[bad_init] = np.inf, -np.inf
    return dict(plan=plan, x=x, w=w, ibuf=ibuf, obuf=obuf, init16=init16, exact=exact, init=init,
                bad_rows=bad_rows, bad_init=bad_init)


def _expected(c, w):
    """The scatter's sum with each poisoned value computed again from weight ``w``."""
    from numba_sc.gmas.gemm_grouping import grouped_gemm_reference
    from numba_sc.gmas.scatter import scatter_reference

    exact = grouped_gemm_reference(c["ibuf"], w, c["plan"].groups, np.zeros_like(c["exact"]))
    obuf = np.where(c["bad_rows"][:, None], exact, c["obuf"].astype(np.float32))
    init = np.where(c["bad_init"][:, None], c["x"].astype(np.float32) @ w[c["plan"].centre].astype(np.float32),
                    c["init16"].astype(np.float32))
    return scatter_reference(obuf, c["plan"].out_table, init, dtype=np.float16).astype(np.float32)


def test_the_guard_computes_an_overflowed_product_again_from_its_row_and_offset():
    from numba_sc.gmas.scatter import scatter_cuda

    for tile in (1, 4):  # channel by channel, and a tile that is one word of four fp16 channels
        c = _poisoned_layer()
        plan = c["plan"]
        got = to_host(scatter_cuda(c["obuf"], plan.out_lists, c["init16"].copy(), plan.n_out, 4, np.float16, tile,
                                   repair=(c["ibuf"], c["w"], c["x"], plan.centre))).astype(np.float32)
        want = _expected(c, c["w"])
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max(), rtol=0)
        # what the tolerance rejects: the offset one off (each offset has its own matrix), and no guard
        shifted = _expected(c, np.roll(c["w"], 1, axis=0))
        assert np.abs(shifted - want).max() > 0.1 * np.abs(want).max()
        plain = to_host(scatter_cuda(c["obuf"], plan.out_lists, c["init16"].copy(), plan.n_out, 4, np.float16, tile))
        assert not np.isfinite(plain.astype(np.float32)).all()


def test_the_guard_leaves_a_centre_it_was_not_told_of_and_an_input_nan():
    from numba_sc.gmas.scatter import scatter_cuda

    c = _poisoned_layer()
    plan = c["plan"]
    # centre -1: ``init`` holds running sums (a later window), which are never computed again
    got = to_host(scatter_cuda(c["obuf"], plan.out_lists, c["init16"].copy(), plan.n_out, 4, np.float16, 1,
                               repair=(c["ibuf"], c["w"], c["x"], -1))).astype(np.float32)
    assert np.isneginf(got[c["bad_init"]]).any() and np.isfinite(got[~c["bad_init"]]).all()
    # a NaN the inputs carry is computed again and stays NaN: the guard hides nothing
    ibuf = c["ibuf"].copy()
    ibuf[c["bad_rows"]] = np.nan
    got = to_host(scatter_cuda(c["obuf"], plan.out_lists, c["init16"].copy(), plan.n_out, 4, np.float16, 1,
                               repair=(ibuf, c["w"], c["x"], plan.centre))).astype(np.float32)
    reached = (plan.out_table[:, :, None] == np.flatnonzero(c["bad_rows"])[None, None]).any(axis=(1, 2))
    assert np.isnan(got[reached]).all() and np.isfinite(got[~reached]).all()


def test_fp16_products_into_fp32_sums_as_words_in_windows():
    """A layer run in windows (gmas.workspace): fp16 products added into fp32 running sums,
    each side read as its own words (tile 4: one 8-byte word of the buffer, two of the sums;
    tile 2: a 4-byte word and an 8-byte one; tile 1: channels and 4-byte words), the guard
    on. Two windows of the buffer give the one sum, in fp32, with nothing rounded to fp16."""
    from numba_sc.gmas.scatter import scatter_cuda, scatter_reference

    c = _poisoned_layer(c_out=8)  # two tiles of 4 a row: the second starts at a different word on each side
    plan = c["plan"]
    obuf = np.where(c["bad_rows"][:, None], c["exact"], c["obuf"].astype(np.float32))
    want = scatter_reference(obuf, plan.out_table, c["init"], dtype=np.float32)
    half = plan.rows // 2
    for tile in (1, 2, 4):
        out = c["init"].copy()  # the fp32 centre product the windows start from
        for lo, hi in ((0, half), (half, plan.rows)):
            out = scatter_cuda(c["obuf"][lo:hi], plan.out_lists, out, plan.n_out, 8, np.float32, tile, lo=lo,
                               rows=plan.rows, repair=(c["ibuf"][lo:hi], c["w"], c["x"], -1))
        got = to_host(out)
        assert got.dtype == np.float32 and np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())

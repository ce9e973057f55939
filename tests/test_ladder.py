"""Every rung of every kernel ladder equals its stage's NumPy reference (kernels under
the simulator here, on the GPU with NUMBA_ENABLE_CUDASIM=0), on a crop of a real scan,
for several tiles and both dtypes; and the comparison can fail."""
import dataclasses

import numpy as np
import pytest

import numba_sc as ns
from numba_sc.gmas import gather as ga
from numba_sc.tools import ladder
from numba_sc.gmas import scatter as sc
from numba_sc.core.backend import to_host

from conftest import crop, load_scan


@pytest.fixture(scope="module")
def crop_coords():
    pts = crop(load_scan("semantickitti"), 350, seed=3)
    return ns.voxelize(np.ascontiguousarray(pts[:, :3]), 0.05, backend="reference").coords


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_gather_and_scatter_rungs_equal_the_reference(crop_coords, dtype):
    """12 channels, tiles of 3, 4, 6 and 12: channel by channel (fp16 3), 4-byte words
    (fp32 3, fp16 6) and 8-byte words (the rest). Every rung must equal the reference to
    the bit (the same copies; the same sums in the same order, in fp32, rounded once)."""
    work = ladder._layer_work(crop_coords, 12, dtype, seed=1)
    plan = work["plan"]
    written = ladder._rows_in(plan.in_table)
    want_g = ga.gather_reference(to_host(work["features"]), to_host(plan.in_table), plan.rows)
    want_s = sc.scatter_reference(to_host(work["obuf"]), to_host(plan.out_table), to_host(work["init"]))
    for tile in (3, 4, 6, 12):
        for rung in ga.GATHER_RUNGS:
            got = to_host(ga.gather_rung(rung, work["features"], plan, tile))
            assert got.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(got[written], want_g[written], err_msg=f"gather {rung} tile {tile}")
        for rung in sc.SCATTER_RUNGS:
            got = to_host(sc.scatter_rung(rung, work["obuf"], plan, work["init"], tile))
            np.testing.assert_array_equal(got, want_s, err_msg=f"scatter {rung} tile {tile}")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_batchnorm_rungs_equal_the_reference(crop_coords, dtype):
    work = ladder._layer_work(crop_coords, 13, dtype, seed=2)
    lad = ladder.LADDERS["batchnorm"]
    tol = 4e-6 if dtype == "float32" else 2e-3  # fast math (v2), and one fp16 rounding
    want = lad.reference(work).astype(np.float64)
    for rung in lad.adds:
        got = to_host(lad.run(rung, work)).astype(np.float64)
        assert np.abs(got - want).max() <= tol * max(1.0, np.abs(want).max()), rung


def test_the_ladder_check_can_fail(crop_coords, monkeypatch):
    """One value of a rung's result off (what an off-by-one row or channel does) must
    show in the agreement column."""
    work = ladder._layer_work(crop_coords, 8, "float32")
    lad = ladder.LADDERS["scatter"]
    assert ladder.agreement(lad, "v2", work) == 0.0
    real = lad.run

    def one_off(rung, w):
        out = to_host(real(rung, w)).copy()
        out[len(out) // 2, 3] += 1.0
        return out

    monkeypatch.setattr(lad, "run", one_off)
    err = ladder.agreement(lad, "v2", work)
    assert err > 0 and not ladder.agrees(lad, "float32", err)
    bn = ladder.LADDERS["batchnorm"]  # a tolerance, for the fused multiply-add; one ulp of fp16 passes
    assert ladder.agrees(bn, "float16", 9.8e-4) and not ladder.agrees(bn, "float16", 1e-2)


def test_ladder_command(capsys):
    from numba_sc.__main__ import main

    load_scan("semantickitti")  # skips without the data
    assert main(["ladder", "gather", "batchnorm", "--crop", "150", "--dtypes", "float32"]) == 0
    out = capsys.readouterr().out
    assert "gather" in out and "v4" in out and "batchnorm" in out
    with pytest.raises(SystemExit):
        main(["ladder", "--rounds", "x"])
    assert main(["ladder", "nosuchstage"]) == 2


def test_search_rungs_equal_the_reference():
    """The forward- and backward-search rungs on a crop with small blocks (B = 32 keys,
    C = 16 queries), so that there are many source blocks, a short last one, and split
    query blocks: every rung must give the reference's table (bounds and rows) exactly."""
    pts = crop(load_scan("semantickitti"), 900, seed=5)
    coords = ns.voxelize(np.ascontiguousarray(pts[:, :3]), 0.05, backend="reference").coords
    w = ladder._search_work(coords, B=32, C=16)
    assert len(coords) % 32 and w["full"]["grid"] > 27 * (len(coords) // 32)  # short block; splits
    want = ladder._search_reference(w)
    assert (want >= 0).sum() > len(coords)  # pairs beyond the centre
    for rung in ladder.LADDERS["search"].adds:
        np.testing.assert_array_equal(to_host(ladder._search_rung(rung, w)), want, err_msg=rung)
    # the backward search's rungs on the same blocks: the same bounds and balanced rows
    want_b = ladder._backward_reference(w)
    for rung in ladder.LADDERS["backward"].adds:
        np.testing.assert_array_equal(ladder._bounds_and_rows(ladder._backward_rung(rung, w)), want_b,
                                      err_msg=f"backward {rung}")


def test_pipeline_stage_rungs_equal_the_reference(crop_coords):
    """voxelize, outcoords and metadata: every rung exact on the crop (the voxelize
    ladder from the crop's own points, 4 feature columns), and each comparison sees
    an off-by-one: a voxel's mean off, an output coordinate off, a buffer row off."""
    pts = crop(load_scan("semantickitti"), 350, seed=3)
    work = ladder._layer_work(crop_coords, 8, "float32")
    work.update(ladder._voxelize_work(pts, 0.05, "float32"))
    for stage in ("voxelize", "outcoords", "metadata"):
        lad = ladder.LADDERS[stage]
        for rung in lad.adds:
            assert ladder.agreement(lad, rung, work) == 0.0, (stage, rung)
    # what v1 of each would give with one thing off by one
    vox = ladder.LADDERS["voxelize"]
    bad = vox.collect(vox.run("v1", work))
    bad[len(bad) // 2, 4] += 1e-3
    assert np.abs(bad - vox.reference(work)).max() > 0
    oc_ = ladder.LADDERS["outcoords"]
    got = to_host(oc_.run("v1", work)).copy()
    got[-1, 2] += 2
    assert not np.array_equal(got, oc_.reference(work))
    from numba_sc.gmas.metadata import build_tables_v1, tables_v1
    from numba_sc.core.backend import filled, to_device
    from numba_sc.core.launch import launch
    out_t, in_t = build_tables_v1(work["km"])
    want = ladder._metadata_reference(work)
    assert np.array_equal(ladder._tables((out_t, in_t)), want)
    table = to_device(work["km"].table)
    K, n = table.shape
    rank = np.cumsum(to_host(table) >= 0, axis=1).astype(np.int32)  # inclusive; v1 takes one off
    plan = work["plan"]
    for r in (rank - 1, rank + 1):
        o, i = filled((n, K), np.int32, -1), filled((len(work["km"].in_coords), K), np.int32, -1)
        launch(tables_v1, K * n, table, to_device(r), to_device(plan.base), o, i)
        assert not np.array_equal(ladder._tables((o, i)), want)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_dataflow_rungs_equal_the_reference(crop_coords, dtype):
    """Fetch-on-demand and implicit GEMM, every rung, on the crop's 3x3x3 layer (centre
    done by the caller as init); and a rung fed the weights of the wrong offsets fails."""
    work = ladder._layer_work(crop_coords, 6, dtype, seed=4)
    for stage in ("fetch", "implicit"):
        lad = ladder.LADDERS[stage]
        for rung in lad.adds:
            err = ladder.agreement(lad, rung, work)
            assert ladder.agrees(lad, dtype, err), (stage, rung, err)
        wrong = dataclasses.replace(lad, run=lambda r, w, run=lad.run: run(r, dict(w, weight=w["weight"][::-1].copy())))
        assert not ladder.agrees(lad, dtype, ladder.agreement(wrong, list(lad.adds)[-1], work)), stage

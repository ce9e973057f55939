"""Every rung of every kernel ladder equals its stage's NumPy reference (kernels under
the simulator here, on the GPU with NUMBA_ENABLE_CUDASIM=0), on a crop of a real scan,
for several tiles and both dtypes; and the comparison can fail."""
import dataclasses
import importlib
import sys
import types

import numpy as np
import pytest

import numba_sc as ns
from numba_sc.coords import output_coords as oc
from numba_sc.coords import voxelization as vx
from numba_sc.core.backend import to_device, to_host
from numba_sc.core.rungs import Ladder
from numba_sc.tools.ladder import Context
from numba_sc.dataflows import fetch_on_demand as fod
from numba_sc.dataflows import implicit_gemm as ig
from numba_sc.gmas import gather as ga
from numba_sc.gmas import metadata as md
from numba_sc.gmas import scatter as sc
from numba_sc.map import backward_search as bs
from numba_sc.map import forward_search as fs
from numba_sc.nn import pointwise as pw
from numba_sc.tools import ladder

from conftest import crop, load_scan


@pytest.fixture(scope="module")
def crop_coords():
    pts = crop(load_scan("semantickitti"), 350, seed=3)
    return ns.voxelize(np.ascontiguousarray(pts[:, :3]), 0.05, backend="reference").coords


def with_runs(lad, wrap):
    """The ladder with every rung's runner wrapped: ``wrap(run)`` is the new runner."""
    return dataclasses.replace(lad, rungs=tuple(dataclasses.replace(r, run=wrap(r.run)) for r in lad.rungs))


def test_every_stage_declares_its_ladder_under_its_module_name():
    found, modules = ladder.ladders(), ladder.ladder_modules()
    # each module's LADDER under the module's name, then its further ladders, in the pipeline's order
    want = []
    for path in ladder.STAGES:
        mod = importlib.import_module(path)
        assert found[path.rpartition(".")[2]] is mod.LADDER
        want += [lad.stage for lad in ladder.module_ladders(mod)]
    assert list(found) == want
    assert want[want.index("pointwise") + 1] == "batch_norm_backward"  # pointwise's BACKWARD_LADDER
    assert found["batch_norm_backward"] is pw.BACKWARD_LADDER and modules["batch_norm_backward"] == pw.__name__
    for stage, lad in found.items():
        assert lad.names == tuple(f"v{i}" for i in range(1, len(lad.rungs) + 1)), stage
        assert all(r.adds for r in lad.rungs)
        # every rung's kernel (or factory, or host function) is named <operation>_v<n>
        mod = importlib.import_module(modules[stage])
        for rung in lad.declared:
            assert hasattr(mod, f"{lad.operation}_{rung.name}"), (stage, rung.name)
    assert found["pointwise"].operation == "batch_norm" and found["gather"].operation == "gather"
    assert fod.FetchTiles is not ig.Tiles  # two different things, two names


def test_the_tool_refuses_ambiguous_ladders(monkeypatch):
    """A module's LADDER must carry the module's name, a ladder bound twice is one
    ladder, and two ladders of one name (a module holding another's) stop the tool."""
    def module(name, **ladders):
        mod = types.ModuleType(name)
        vars(mod).update(ladders)
        monkeypatch.setitem(sys.modules, name, mod)
        return mod

    extra = Ladder("scatter_twice", sc.LADDER.rungs, sc.LADDER.workload, sc.LADDER.reference)
    mine = module("fake_stages.scatter", LADDER=sc.LADDER, EXTRA=extra, ALIAS=sc.LADDER)
    assert ladder.module_ladders(mine) == [sc.LADDER, extra]
    with pytest.raises(AssertionError, match="named after the module"):
        ladder.module_ladders(module("fake_stages.gather", LADDER=sc.LADDER))
    with pytest.raises(AssertionError, match="declares no LADDER"):
        ladder.module_ladders(module("fake_stages.metadata", EXTRA=extra))
    module("fake_stages.gather", LADDER=ga.LADDER, SCATTER=sc.LADDER)  # holds scatter's ladder too
    monkeypatch.setattr(ladder, "STAGES", ("fake_stages.gather", "numba_sc.gmas.scatter"))
    with pytest.raises(AssertionError, match="two ladders are named 'scatter'"):
        ladder.ladders()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_gather_and_scatter_rungs_equal_the_reference(crop_coords, dtype):
    """12 channels, tiles of 3, 4, 6 and 12: channel by channel (fp16 3), 4-byte words
    (fp32 3, fp16 6) and 8-byte words (the rest). Every rung must equal the reference to
    the bit (the same copies; the same sums in the same order, in fp32, rounded once)."""
    work = sc.LADDER.workload(Context(crop_coords, 12, dtype, seed=1))
    plan = work["plan"]
    written = ga.LADDER.written(work)
    want_g = ga.gather_reference(to_host(work["features"]), to_host(plan.in_table), plan.rows)
    want_s = sc.scatter_reference(to_host(work["obuf"]), to_host(plan.out_table), to_host(work["init"]))
    for tile in (3, 4, 6, 12):
        for rung in ga.LADDER.names:
            got = to_host(ga.gather_rung(rung, work["features"], plan, tile))
            assert got.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(got[written], want_g[written], err_msg=f"gather {rung} tile {tile}")
        for rung in sc.LADDER.names:
            got = to_host(sc.scatter_rung(rung, work["obuf"], plan, work["init"], tile))
            np.testing.assert_array_equal(got, want_s, err_msg=f"scatter {rung} tile {tile}")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_batchnorm_rungs_equal_the_reference(crop_coords, dtype):
    lad = pw.LADDER
    work = lad.workload(Context(crop_coords, 13, dtype, seed=2))
    tol = 4e-6 if dtype == "float32" else 2e-3  # fast math (v2), and one fp16 rounding
    want = lad.reference(work).astype(np.float64)
    for rung in lad.names:
        got = to_host(lad.run(rung, work)).astype(np.float64)
        assert np.abs(got - want).max() <= tol * max(1.0, np.abs(want).max()), rung


def test_the_ladder_check_can_fail(crop_coords):
    """One value of a rung's result off (what an off-by-one row or channel does) must
    show in the agreement column."""
    lad = sc.LADDER
    work = lad.workload(Context(crop_coords, 8, "float32"))
    assert ladder.agreement(lad, "v2", work) == 0.0

    def one_off(run):
        def wrong(w):
            out = to_host(run(w)).copy()
            out[len(out) // 2, 3] += 1.0
            return out
        return wrong

    err = ladder.agreement(with_runs(lad, one_off), "v2", work)
    assert err > 0 and not ladder.agrees(lad, "float32", err)
    bn = pw.LADDER  # a tolerance, for the fused multiply-add; one ulp of fp16 passes
    assert ladder.agrees(bn, "float16", 9.8e-4) and not ladder.agrees(bn, "float16", 1e-2)


def test_batch_norm_backward_ladder_runs_in_the_tool(crop_coords):
    """The module's second ladder, through the tool's own check: both rungs within
    tolerance of the reference on 40 voxels, 4 channels, both dtypes; a rung that
    forgets the ReLU's mask (run on an output that is positive everywhere) fails."""
    ctx = Context(crop_coords[:40], 4, "float32", seed=6)
    for dtype in ("float32", "float16"):
        errors = ladder.check_rungs(["batch_norm_backward"], dataclasses.replace(ctx, dtype=dtype),
                                    print_=lambda *_: None)
        assert list(errors) == [("batch_norm_backward", "v1"), ("batch_norm_backward", "v2")]
    lad = pw.BACKWARD_LADDER
    work = lad.workload(ctx)
    assert (to_host(work["y"]) <= 0).any()  # the mask matters here
    unmasked = with_runs(lad, lambda run: lambda w: run(dict(w, y=to_device(np.abs(to_host(w["y"])) + 1))))
    for rung in lad.names:
        assert not ladder.agrees(lad, "float32", ladder.agreement(unmasked, rung, work)), rung


def test_ladder_command(capsys):
    from numba_sc.__main__ import main

    assert main(["ladder", "--list"]) == 0
    out = capsys.readouterr().out
    for path in ladder.STAGES:
        assert path.rpartition(".")[2] in out and path in out
    assert "batch_norm_backward  (numba_sc.nn.pointwise)" in out  # a module's second ladder
    assert "the sums in one pass, dx in one kernel" in out
    assert "+ whole words, unpacked into channels to be added" in out
    load_scan("semantickitti")  # skips without the data
    assert main(["ladder", "gather", "pointwise", "batch_norm_backward", "--crop", "150", "--dtypes",
                 "float32"]) == 0
    out = capsys.readouterr().out
    assert "gather" in out and "v4" in out and "pointwise" in out
    assert [line.split()[2] for line in out.splitlines() if line.startswith("batch_norm_backward ")] == ["v1", "v2"]
    with pytest.raises(SystemExit):
        main(["ladder", "--rounds", "x"])
    assert main(["ladder", "nosuchstage"]) == 2
    assert main(["ladder", "batchnorm"]) == 2  # the old name: stages are named after their modules


def test_recorded_names_map_to_stages():
    """Recorded ladder files keep the stage names they were recorded with."""
    assert set(ladder.RECORDED_NAMES.values()) <= set(ladder.ladders())


def test_search_rungs_equal_the_reference():
    """The forward- and backward-search rungs on a crop with small blocks (B = 32 keys,
    C = 16 queries), so that there are many source blocks, a short last one, and split
    query blocks: every rung must give the reference's table (bounds and rows) exactly."""
    pts = crop(load_scan("semantickitti"), 900, seed=5)
    coords = ns.voxelize(np.ascontiguousarray(pts[:, :3]), 0.05, backend="reference").coords
    ctx = Context(coords, search_blocks=(32, 16))
    fw = fs.LADDER
    w = fw.workload(ctx)
    assert len(coords) % 32 and w["full"]["grid"] > 27 * (len(coords) // 32)  # short block; splits
    want = fw.reference(w)
    assert (want >= 0).sum() > len(coords)  # pairs beyond the centre
    for rung in fw.names:
        np.testing.assert_array_equal(to_host(fw.run(rung, w)), want, err_msg=rung)
    # the backward search's rungs on the same blocks: the same bounds and balanced rows
    bw = bs.LADDER
    wb = bw.workload(ctx)
    want_b = bw.reference(wb)
    for rung in bw.names:
        np.testing.assert_array_equal(bw.result(rung, wb), want_b, err_msg=f"backward_search {rung}")


def test_pipeline_stage_rungs_equal_the_reference(crop_coords):
    """voxelization, output_coords and metadata: every rung exact on the crop (the
    voxelization ladder from the crop's own points, 4 feature columns), and each
    comparison sees an off-by-one: a voxel's mean off, an output coordinate off, a
    buffer row off."""
    pts = crop(load_scan("semantickitti"), 350, seed=3)
    ctx = Context(crop_coords, 8, "float32", points=pts)
    for mod in (vx, oc, md):
        lad = mod.LADDER
        work = lad.workload(ctx)
        for rung in lad.names:
            assert ladder.agreement(lad, rung, work) == 0.0, (lad.stage, rung)
    # what v1 of each would give with one thing off by one
    vox = vx.LADDER
    wv = vox.workload(ctx)
    bad = vox.result("v1", wv)
    bad[len(bad) // 2, 4] += 1e-3
    assert np.abs(bad - vox.reference(wv)).max() > 0
    oc_ = oc.LADDER
    wo = oc_.workload(ctx)
    got = to_host(oc_.run("v1", wo)).copy()
    got[-1, 2] += 2
    assert not np.array_equal(got, oc_.reference(wo))
    from numba_sc.gmas.metadata import build_tables_v1, metadata_v1
    from numba_sc.core.backend import filled, to_device
    from numba_sc.core.launch import launch
    meta = md.LADDER
    wm = meta.workload(ctx)
    km = wm["km"]
    out_t, in_t = build_tables_v1(km)
    want = meta.reference(wm)
    assert np.array_equal(meta.collect((out_t, in_t)), want)
    table = to_device(km.table)
    K, n = table.shape
    rank = np.cumsum(to_host(table) >= 0, axis=1).astype(np.int32)  # inclusive; v1 takes one off
    plan = ctx.layer()["plan"]
    for r in (rank - 1, rank + 1):
        o, i = filled((n, K), np.int32, -1), filled((len(km.in_coords), K), np.int32, -1)
        launch(metadata_v1, K * n, table, to_device(r), to_device(plan.base), o, i)
        assert not np.array_equal(meta.collect((o, i)), want)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_dataflow_rungs_equal_the_reference(crop_coords, dtype):
    """Fetch-on-demand and implicit GEMM, every rung, on the crop's 3x3x3 layer (centre
    done by the caller as init); and a rung fed the weights of the wrong offsets fails."""
    ctx = Context(crop_coords, 6, dtype, seed=4)
    for mod in (fod, ig):
        lad = mod.LADDER
        work = lad.workload(ctx)
        for rung in lad.names:
            err = ladder.agreement(lad, rung, work)
            assert ladder.agrees(lad, dtype, err), (lad.stage, rung, err)
        wrong = with_runs(lad, lambda run: lambda w: run(dict(w, weight=w["weight"][::-1].copy())))
        assert not ladder.agrees(lad, dtype, ladder.agreement(wrong, lad.names[-1], work)), lad.stage

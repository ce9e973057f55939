"""What the prose says the library does, checked against the library.

The README, ``docs/`` and the notebooks' markdown make claims about the library's
behaviour: which tile ``sparse_conv3d`` runs, which dataflow ``"auto"`` picks, how many
times a Map step reads the device, which B and C the search uses. Each test here

1. finds the claim's words in its prose file (:func:`claim`), so that rewording the
   claim fails the test and sends the writer here, and
2. makes the library do what the claim describes and checks the result, so that
   changing the behaviour fails the test and sends the programmer to the prose.

Performance figures are not claims of this kind: they are figure links, checked
against their result files by ``numba-sc figures`` (tests/tools/test_prose.py).
"""
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest

import numba_sc as ns
from numba_sc import nn
from numba_sc.conv import choice, layer
from numba_sc.coords import output_coords as oc
from numba_sc.core.device import simulating
from numba_sc.core.state import STATE
from numba_sc.map import driver
from numba_sc.map import kernel_map as km_module
from numba_sc.nn import maps_up_front as mu
from numba_sc.tools import ladder

from conftest import ROOT, load_scan
from helpers import random_coords, scan_crop


# -- finding a claim in the prose -----------------------------------------------------------

def _flat(text: str) -> str:
    """``text`` with every run of white space one space: a claim survives re-wrapping."""
    return re.sub(r"\s+", " ", text).strip()


def prose_text(name: str) -> str:
    """The prose of ``name`` (a path from the repository's root): a Markdown file, or a
    notebook's markdown cells one after the other."""
    path = ROOT / name
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return path.read_text()


def claim(name: str, *words: str) -> None:
    """Fail unless every one of ``words`` is in the prose of ``name`` (white space aside)."""
    text = _flat(prose_text(name))
    for w in words:
        assert _flat(w) in text, (
            f"{name} no longer says {w!r}. If the claim changed on purpose, change the test that "
            f"checks it against the library (tests/test_prose_claims.py) with it")


def test_claim_sees_rewording(tmp_path, monkeypatch):
    """Guards :func:`claim`: it finds a claim wrapped differently and refuses a changed one."""
    (tmp_path / "p.md").write_text("A strided layer's Map step\nreads the device   once.\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    claim("p.md", "Map step reads the device once")
    with pytest.raises(AssertionError, match="no longer says"):
        claim("p.md", "Map step reads the device twice")


# -- which tile sparse_conv3d runs (notebook 05, docs/notation.md) --------------------------

class _Stop(Exception):
    """Raised by a spy once it has seen what it came for: the layer need not finish."""


def tiles_run(monkeypatch, x, w, **kw):
    """The (gather, scatter) tiles ``sparse_conv3d(x, w, **kw)`` hands its GMaS step."""
    seen = []

    def spy(features, weight, plan, tiles, *args, **kwargs):
        seen.append(tuple(int(t) for t in tiles))
        raise _Stop

    monkeypatch.setattr(layer, "gather_gemm_scatter", spy)
    with pytest.raises(_Stop):
        ns.sparse_conv3d(x, w, **kw)
    return seen[0]


@pytest.fixture
def fresh_state():
    ns.clear_caches()
    yield
    ns.clear_caches()


@pytest.fixture(scope="module")
def kitti():
    """The SemanticKITTI scan's voxels at 5 cm (94,444): notebook 05's layer."""
    scan = load_scan("semantickitti")
    return ns.voxelize(np.ascontiguousarray(scan[:, :3]), 0.05, backend="reference").coords


NB05 = "notebooks/05_gather_gemm_scatter.ipynb"


def test_the_tile_sparse_conv3d_runs_by_default(kitti, monkeypatch, fresh_state):
    claim(NB05, "With `tile_size=None` (the default), the tiles that `ns.autotune` chose for this layer, "
                "if it was called in this process",
          "otherwise the heuristic's: 8 channels for this fp32 layer, 16 in fp16",
          "runs `ns.heuristic_tile`'s count-based guess: 8 channels for this scan's 64-channel fp32 layer",
          "| the heuristic's pick | `ns.heuristic_tile(64, 94444, itemsize)`")
    claim("docs/notation.md", "otherwise `heuristic_tile`'s, the widest tile of at most 32 bytes")
    assert len(kitti) == 94444
    for dtype, tile in ((np.float32, 8), (np.float16, 16)):
        x = ns.SparseTensor(kitti, np.zeros((len(kitti), 64), dtype))
        w = np.zeros((27, 64, 64), dtype)
        assert tiles_run(monkeypatch, x, w, backend="reference") == (tile, tile)
        assert ns.heuristic_tile(64, len(kitti), np.dtype(dtype).itemsize) == tile


def test_the_ladder_times_at_the_heuristic_tile(kitti):
    claim(NB05, "| the ladder's tile | the tile at which section 7's ladders time the gather and the scatter",
          "at the heuristic's tile: 8 channels in fp32, 16 in fp16")
    for dtype, tile in (("float32", 8), ("float16", 16)):
        ctx = ladder.Context(kitti, channels=64, dtype=dtype)
        ctx.memo("layer", dict)  # the map and plan are not needed to know the tile: skip building them
        assert ctx.layer()["tile"] == tile


def test_autotune_only_when_asked(monkeypatch, fresh_state):
    claim(NB05, "Nothing autotunes on its own: neither `sparse_conv3d` nor the networks of `numba_sc.nn` "
                "call `ns.autotune`",
          "under the simulator or on the reference backend `ns.autotune` itself answers with the heuristic",
          "The library autotunes **only when asked**: `ns.autotune(x, w, layer=...)` times the tiles on a GPU "
          "and `sparse_conv3d` then uses its pick for that layer")
    claim("docs/notation.md", "Nothing calls `autotune` on its own")
    x = scan_crop(60)
    w = (np.random.default_rng(0).standard_normal((27, 4, 8)) / 3).astype(np.float32)
    # A layer and a network run: nothing is tuned behind the caller's back.
    ns.sparse_conv3d(x, w, backend="reference")
    net = nn.Sequential(nn.SubMConv3d(4, 8, 3, rng=np.random.default_rng(1)),
                        nn.SparseConv3d(8, 8, 2, stride=2, rng=np.random.default_rng(2)))
    net(x.without_maps(), backend="reference")
    assert STATE.choices["tile"] == {}
    # Without a GPU, autotune answers with the heuristic (on a GPU it would measure)...
    for backend in ("reference", "cuda") if simulating() else ("reference",):
        choice_ = ns.autotune(x, w, backend=backend)
        assert choice_.source == "heuristic"
        assert (choice_.gather, choice_.scatter) == (ns.heuristic_tile(4, len(x.coords)),
                                                    ns.heuristic_tile(8, len(x.coords)))
    # ... and once it has measured (a timer given, the search's verdict fixed here), the layer runs its pick.
    from numba_sc.conv import tuning
    monkeypatch.setattr(tuning, "search_tiles", lambda samples, c_out, timer, rounds, warmup: (2, 4, {}))
    tuned = ns.autotune(x, w, backend="cuda", timer=lambda fn: 0.0, layer="enc1")
    assert (tuned.gather, tuned.scatter, tuned.source) == (2, 4, "autotuned")
    assert tiles_run(monkeypatch, x, w, backend="cuda", layer="enc1") == (2, 4)
    assert tiles_run(monkeypatch, x, w, backend="cuda", layer="enc2") == (
        ns.heuristic_tile(4, len(x.coords)), ns.heuristic_tile(8, len(x.coords)))


# -- how often the Map step reads the device (notebooks 02 and 08) --------------------------

@pytest.fixture
def reads(monkeypatch):
    """Every device->host read of the Map step and of the output coordinates, by name."""
    seen = []
    for module, name in ((driver, "read_later"), (driver, "to_host"), (km_module, "to_host"), (oc, "to_host"),
                         (mu, "to_host")):
        real = getattr(module, name)

        def counting(*args, _real=real, _name=f"{module.__name__}.{name}", **kw):
            seen.append(_name)
            return _real(*args, **kw)
        monkeypatch.setattr(module, name, counting)
    return seen


def test_a_strided_map_step_reads_the_device_once(rng, reads):
    claim("notebooks/02_voxelization_and_output_coordinates.ipynb",
          "That is one device read for the whole step, where making the coordinates first and then the "
          "map took two.",
          "A strided layer's Map step goes further and reads the count only with the map itself.")
    claim("notebooks/08_networks.ipynb",
          "a strided layer's Map step now counts its outputs on the device and reads the count with the "
          "map's report")
    c = random_coords(rng, 400, span=8)
    c = c[np.lexsort(c.T[::-1])]  # sorted, as every layer hands them on
    for kernel_size in (2, 3):
        del reads[:]
        m = ns.build_kernel_map(c, kernel_size, stride=2, backend="cuda")
        assert reads == ["numba_sc.map.driver.read_later"], reads
        assert 0 < m.stats["n_out"] < len(c)


def test_a_network_builds_its_maps_up_front_in_two_reads(monkeypatch, reads):
    claim("notebooks/08_networks.ipynb",
          "a network builds all its maps before its first layer with at most two reads a pass (from its "
          "second pass on: the first records which maps it needs)")
    rng = np.random.default_rng(3)
    down = nn.SparseConv3d(4, 4, 2, stride=2, rng=rng)
    net = nn.Sequential(nn.SubMConv3d(4, 4, 3, rng=rng), down, nn.SubMConv3d(4, 4, 3, rng=rng),
                        nn.SparseInverseConv3d(4, 4, 2, inverts=down, rng=rng))
    x = scan_crop(40)
    net(x.without_maps(), backend="cuda")  # the first pass: the layers build their maps, the plan is recorded
    del reads[:]
    built = []
    real = mu.build_maps
    monkeypatch.setattr(mu, "build_maps", lambda plan, t: built.append(plan) or real(plan, t))
    net(x.without_maps(), backend="cuda")
    assert len(built) == 1  # every map of the pass, before its first layer
    # this network has a coarser level, so both reads: the levels' counts, then the maps' reports
    assert reads == ["numba_sc.nn.maps_up_front.to_host"] * 2, reads


# -- B and C (notebook 04, docs/notation.md) ------------------------------------------------

NB04 = "notebooks/04_double_traversed_binary_search.ipynb"


def test_the_search_runs_b_512_and_c_1024_on_every_cloud(rng):
    claim(NB04, "The library runs fixed defaults, **B = 512 and C = 1024**",
          "They do not depend on the cloud: every Map step uses them, `build_kernel_map` called alone or "
          "by a layer, unless `source_block=` and `query_block=` say otherwise",
          "every Map step runs the fixed defaults `B = 512, C = 1024`")
    claim("docs/notation.md", "the library runs B = 512 and C = 1024 on every cloud")
    for n in (50, 800):
        c = random_coords(rng, n, span=20)
        for backend in ("reference", "cuda"):
            stats = ns.build_kernel_map(c, 3, backend=backend).stats
            assert (stats["source_block"], stats["query_block"]) == (512, 1024)
    coords = np.unique(random_coords(rng, 200, span=10), axis=0)
    x = ns.SparseTensor(coords, np.ones((len(coords), 2), np.float32))
    y = ns.sparse_conv3d(x, np.ones((27, 2, 2), np.float32), backend="reference")
    assert (y.kernel_map.stats["source_block"], y.kernel_map.stats["query_block"]) == (512, 1024)
    mine = ns.build_kernel_map(random_coords(rng, 300, span=10), 3, backend="reference",
                               source_block=64, query_block=100).stats
    assert (mine["source_block"], mine["query_block"]) == (64, 100)


def test_eq4_sizes_for_the_scan(kitti):
    """The sizes notebook 04 says Eq. 4 would take on the scan (arithmetic on the paper's
    formulas, beside the library's fixed ones)."""
    claim(NB04, "on this scan they would be a source block of about 17 keys and query blocks of about 8",
          "(about 4 for a 94k-voxel scan)")
    B = math.log2(len(kitti))
    assert round(B) == 17 and round(B / math.sqrt(math.log2(B))) == 8 and round(math.log2(B)) == 4


# -- what dataflow="auto" and method="auto" pick (README) -----------------------------------

README = "README.md"


def flows_run(monkeypatch, x, w, **kw):
    """The dataflow ``sparse_conv3d(x, w, dataflow="auto", **kw)`` runs."""
    ran = []

    def spy(flow, *args):
        ran.append(flow)
        raise _Stop

    def gmas(*args, **kwargs):
        ran.append("gmas")
        raise _Stop

    monkeypatch.setattr(layer, "fetch_or_implicit", spy)
    monkeypatch.setattr(layer, "gather_gemm_scatter", gmas)
    with pytest.raises(_Stop):
        ns.sparse_conv3d(x, w, dataflow="auto", **kw)
    return ran[0]


def test_what_auto_picks(monkeypatch, fresh_state):
    claim(README, "sorted search for the map. For the dataflow, implicit GEMM for layers of at most 16 "
                  "channels in and out that are given a shared map on a small cloud (at most 2^17 outputs) "
                  "or that run on a large dense one (at least 2^18 outputs and 8 pairs an output outside "
                  "the centre), and for layers of up to 64 channels on a large dense cloud, in fp32, and in "
                  "fp16 where its tensor-core rung runs (on a GPU, from 8 channels); gather-GEMM-scatter "
                  "everywhere else, always on the reference backend, and whenever a layer trains.",
          "**the Map step** (sorted search, what `auto` runs)")
    # The map: sorted, when nothing was measured.
    c = random_coords(np.random.default_rng(4), 200, span=8)
    assert ns.build_kernel_map(c, 3, backend="cuda").stats["method"] == "sorted"
    # Through the layer: 4 channels given a map on a small cloud run implicit on the kernel
    # path, gmas on the reference; building the map, gmas.
    x = scan_crop(60)
    w = (np.random.default_rng(0).standard_normal((27, 4, 4)) / 3).astype(np.float32)
    km = ns.sparse_conv3d(x, w, backend="reference").kernel_map
    assert flows_run(monkeypatch, x, w, backend="cuda", kernel_map=km) == "implicit"
    assert flows_run(monkeypatch, x, w, backend="cuda") == "gmas"
    assert flows_run(monkeypatch, x, w, backend="reference", kernel_map=km) == "gmas"
    # The rule's thresholds, as the README states them.
    rule = choice.rule_dataflow
    small, large, dense = 2 ** 17, 2 ** 18, 8.0
    assert rule(16, 16, np.float32, small, map_given=True) == "implicit"
    assert rule(16, 16, np.float32, small + 1, map_given=True) == "gmas"  # not small, not dense
    assert rule(17, 16, np.float32, small, map_given=True) == "gmas"
    assert rule(16, 16, np.float32, large, pairs_per_output=dense) == "implicit"  # no map needed there
    assert rule(16, 16, np.float32, large - 1, pairs_per_output=dense) == "gmas"
    assert rule(16, 16, np.float32, large, pairs_per_output=dense - 0.1) == "gmas"
    assert rule(64, 64, np.float32, large, pairs_per_output=dense) == "implicit"
    assert rule(128, 64, np.float32, large, pairs_per_output=dense) == "gmas"
    monkeypatch.setattr(choice, "library_rung", lambda dtype, c_in, c_out: "v3")  # no tensor cores
    assert rule(64, 64, np.float16, large, pairs_per_output=dense) == "gmas"
    monkeypatch.setattr(choice, "library_rung", lambda dtype, c_in, c_out: "v4" if min(c_in, c_out) >= 8 else "v3")
    assert rule(64, 64, np.float16, large, pairs_per_output=dense) == "implicit"
    # Training: gmas, whatever the rule would say.
    assert choice.pick_dataflow("auto", None, None, None, None, False, True, True, -1, "cuda") == "gmas"


# -- the fit on one scan: one run quoted everywhere (README, notebook 09) -------------------

def test_the_readme_and_notebook_09_quote_one_fit_run():
    claim(README, "`numba-sc train overfit --steps 200 --out curve.json`",
          "The run quoted here and plotted in notebook 09 is `benchmarks/results/train_kitti.json` "
          "(`--steps 200` on an H100, 2026-11-24)")
    claim("notebooks/09_training.ipynb", "The run in this file is the one the README quotes: "
                                         "`python -m numba_sc train --steps 200`")
    record = json.loads((ROOT / "benchmarks/results/train_kitti.json").read_text())
    assert record["steps"] == 200 and "--steps 200" in record["recorded"]["command"]
    assert (record["recorded"]["date"], record["recorded"]["device"][:11]) == ("2026-11-24", "NVIDIA H100")
    # Every fit figure of both files links that one file: none quotes another run.
    fit = re.compile(r"\]\(([^)\s]*results/[^)\s]*train_kitti[^)\s]*\.json) \"[^\"]*(?:history|miou)")
    for name in (README, "notebooks/09_training.ipynb"):
        links = fit.findall(prose_text(name))
        assert links and {Path(p).name for p in links} == {"train_kitti.json"}, (name, links)
        assert not any("archive" in p for p in links), (name, links)

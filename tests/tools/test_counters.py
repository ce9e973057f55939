"""The reading helpers of the counters and of Figures 13-14 (numba_sc.tools.counters), on the
five files of a synthetic run made by the probe's own code (tests/tools/ncu_records.py): the
tables are well formed and hold the numbers of the file, the plots draw what the file holds,
and a file of another kind is refused by name."""
import copy

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from ncu_records import H100, synthetic_records  # noqa: E402
from numba_sc.tools import counters, results  # noqa: E402


def record(name):
    return copy.deepcopy(synthetic_records()[name])


def well_formed(table):
    lines = table.splitlines()
    assert len(lines) >= 3
    columns = lines[0].count("|")
    assert set(lines[1]) == {"|", "-"} and lines[1].count("|") == columns
    assert all(line.startswith("| ") and line.endswith(" |") and line.count("|") == columns for line in lines[2:])
    return lines


def test_peak_pct_worked_example():
    """30 MB in 20 us is 1.5 TB/s: 44.8 % of a peak of 3.35 TB/s (the module docstring's example)."""
    agg = {"bytes_per_s": 30e6 / 20e-6}
    assert round(counters.peak_pct(agg, {"dram_peak_bytes_per_s": 3.35e12}), 1) == 44.8
    assert counters.peak_pct(agg, H100) == pytest.approx(100 * 1.5e12 / H100["dram_peak_bytes_per_s"])
    assert counters.peak_pct(agg, {"name": "sim"}) is None and counters.peak_pct(None, H100) is None


def test_map_rows_hold_the_files_numbers():
    r = record("counters_map.json")
    rows = counters.map_rows(r)
    assert [x["variant"] for x in rows] == list(counters.MAP_VARIANTS)  # the crop's grid fits: all seven
    minuet = next(x for x in rows if x["variant"] == "minuet")
    want = results.row(r["rows"], variant="minuet")["query"]
    assert minuet["l2_hit_pct"] == want["l2_hit_pct"] and minuet["dram_mb"] == pytest.approx(want["dram_bytes"] / 1e6)
    assert minuet["time_us"] == pytest.approx(want["time_ns"] / 1e3)
    assert minuet["peak_pct"] == pytest.approx(100 * want["bytes_per_s"] / H100["dram_peak_bytes_per_s"])
    step = next(x for x in counters.map_rows(r, "step") if x["variant"] == "minuet")
    assert step["time_us"] > minuet["time_us"]  # pack and backward search too
    with pytest.raises(ValueError, match="which must be 'query'"):
        counters.map_rows(r, "all")


def test_map_table():
    r = record("counters_map.json")
    lines = well_formed(counters.map_table(r))
    assert lines[0].startswith("| cloud (voxels) | variant | L2 hit % |") and len(lines) == 2 + 7
    x = counters.map_rows(r)[0]
    assert lines[2].startswith(f"| crop_120 ({x['voxels']:,}) | unsorted | {x['l2_hit_pct']:.1f} |")


def test_hit_rates_by_notebook_03s_orders():
    r = record("counters_map.json")
    rates = counters.hit_rates(r)["crop_120"]
    orders = counters.query_orders(r, "crop_120")
    assert orders == {"random": rates["unsorted"], "segmented (Minuet)": rates["segmented"],
                      "fully sorted": rates["sorted"]}
    l1 = counters.hit_rates(r, level="l1")["crop_120"]
    assert counters.query_orders(r, "crop_120", "l1")["random"] == l1["unsorted"]
    with pytest.raises(ValueError, match="no cloud 'kitti'.*crop_120"):
        counters.query_orders(r, "kitti")
    with pytest.raises(ValueError, match="level must be"):
        counters.hit_rates(r, level="l3")


def test_table_bytes_against_l2():
    r = record("counters_map.json")
    b = counters.table_bytes(r)
    c = r["clouds"]["crop_120"]
    assert b["L2"] == H100["l2_bytes"] and b["crop_120"]["source keys"] == 8 * c["voxels"]
    assert b["crop_120"]["hash table"] == c["hash_table_bytes"] and b["crop_120"]["grid"] == c["grid_bytes"]
    r["clouds"]["crop_120"]["grid_bytes"] = None  # refused
    assert counters.table_bytes(r)["crop_120"]["grid"] is None


def test_paper_claims_follow_the_numbers():
    """Each claim holds or fails as the file's numbers say: set so that all six hold, then
    changed one at a time so that one fails."""
    r = record("counters_map.json")
    big = copy.deepcopy([x for x in r["rows"] if x["cloud"] == "crop_120"])
    for x in big:
        x["cloud"] = "big"
    r["rows"] += big
    r["clouds"]["big"] = dict(r["clouds"]["crop_120"], voxels=5_000_000)

    def query(cloud, variant):
        return results.row(r["rows"], cloud=cloud, variant=variant)["query"]

    def set_rate(cloud, variant, value):
        query(cloud, variant)["l2_hit_pct"] = value

    def verdicts():
        claims = counters.paper_claims(r, paper)
        assert [c["id"] for c in claims] == list(counters.CLAIMS)
        return {c["id"]: c["holds"] for c in claims}

    for cloud, (minuet, hashed, segmented, unsorted) in {"crop_120": (97, 60, 80, 40), "big": (96, 30, 85, 20)}.items():
        for variant, value in (("minuet", minuet), ("hash", hashed), ("segmented", segmented), ("unsorted", unsorted)):
            set_rate(cloud, variant, value)
        x = results.row(r["rows"], cloud=cloud, variant="minuet")
        x["step"]["time_ns"] = x["query"]["time_ns"] / 0.95  # the forward search: 95 % of the step
        query(cloud, "unsorted").update(l2_sectors=5000.0, time_ns=20000.0)  # more lookups, slower than segmented
    paper = results.load("paper")
    claims = counters.paper_claims(r, paper)
    assert all(verdicts().values()), claims
    assert claims[0]["measured"] == "crop_120 97.0 %, big 96.0 %" and claims[3]["measured"].startswith("crop_120 (")
    assert claims[5]["measured"].startswith("crop_120 0.48 vs 2.41 lookups a query, 13 vs 20 us")  # per query: /2072
    set_rate("big", "minuet", 90)  # below the paper's 95 %
    assert [k for k, v in verdicts().items() if not v] == ["forward_l2"]
    set_rate("big", "minuet", 96)
    set_rate("big", "hash", 70)  # grows with the cloud instead of falling
    assert [k for k, v in verdicts().items() if not v] == ["hash_falls"]
    set_rate("big", "hash", 30)
    set_rate("crop_120", "unsorted", 85)  # random order hits more often than sorted on one cloud
    assert [k for k, v in verdicts().items() if not v] == ["sorted_l2"]
    set_rate("crop_120", "unsorted", 40)
    query("big", "unsorted")["l2_sectors"] = 900.0  # random order makes fewer lookups than segmented on one cloud
    assert [k for k, v in verdicts().items() if not v] == ["sorted_fewer_lookups"]
    query("big", "unsorted").update(l2_sectors=5000.0, time_ns=12000.0)  # ... or is faster
    assert [k for k, v in verdicts().items() if not v] == ["sorted_fewer_lookups"]
    query("big", "unsorted")["time_ns"] = 20000.0
    x = results.row(r["rows"], cloud="big", variant="minuet")
    x["step"]["time_ns"] = x["query"]["time_ns"] / 0.5
    assert [k for k, v in verdicts().items() if not v] == ["forward_share"]
    del r["clouds"]["big"]  # one cloud: whether the rate falls with size cannot be told
    r["rows"] = [x for x in r["rows"] if x["cloud"] != "big"]
    assert verdicts()["hash_falls"] is None


def test_per_query_divides_by_the_lookups():
    r = record("counters_map.json")
    n = r["clouds"]["crop_120"]["queries"]
    q = results.row(r["rows"], variant="segmented")["query"]
    got = counters.per_query(r)["crop_120"]["segmented"]
    assert got["l2_lookups"] == pytest.approx(q["l2_sectors"] / n)
    assert got["l2_misses"] == pytest.approx(q["l2_sectors"] * (1 - q["l2_hit_pct"] / 100) / n)
    assert got["dram_bytes"] == pytest.approx(q["dram_bytes"] / n) and got["time_ns"] == pytest.approx(q["time_ns"] / n)
    assert list(counters.per_query(r)["crop_120"]) == list(counters.MAP_VARIANTS)
    q["l2_hit_pct"] = 119.0  # ncu's reading of a tiny kernel: no misses, not a negative number of them
    q["l2_sectors"] = None  # ... and a metric this ncu lacked
    got = counters.per_query(r)["crop_120"]["segmented"]
    assert got["l2_lookups"] is None and got["l2_misses"] is None
    q["l2_sectors"] = 100.0
    assert counters.per_query(r)["crop_120"]["segmented"]["l2_misses"] == 0.0
    step = counters.per_query(r, "step")["crop_120"]["minuet"]
    assert step["time_ns"] > counters.per_query(r)["crop_120"]["minuet"]["time_ns"]  # pack and backward search too
    with pytest.raises(ValueError, match="which must be 'query'"):
        counters.per_query(r, "all")


def test_paper_l2_reads_paper_json():
    got = counters.paper_l2(results.load("paper"))
    assert got["Minuet, forward search (Fig. 16b, min)"] == pytest.approx(95)
    assert got["TorchSparse hash (Fig. 3, mean)"] == pytest.approx(19)


def test_plot_map_draws_a_bar_per_variant():
    r = record("counters_map.json")
    ax = counters.plot_map(r, paper=results.load("paper"))
    assert len(ax.patches) == 7 and len(ax.lines) == 5  # 7 variants on one cloud; the paper's 5 rates
    assert "hash fits L2" in ax.get_xticklabels()[0].get_text()
    plt.close("all")


def test_tiles_table_and_best_tiles():
    r = record("counters_gather_scatter.json")
    lines = well_formed(counters.tiles_table(r))
    assert len(lines) == 2 + 2  # gather and scatter of one cloud in fp32
    best = counters.best_tiles(r)
    for (cloud, stage, dtype), tile in best.items():
        times = {x["tile"]: x["total"]["time_ns"] for x in r["rows"] if x["stage"] == stage}
        assert times[tile] == min(times.values())
        line = next(line for line in lines if f"| {stage} |" in line)
        assert f"**{times[tile] / 1e3:.1f}**" in line and f"| {tile} |" in line
    # a tie goes to the smaller tile
    for x in r["rows"]:
        x["total"]["time_ns"] = 1.0
    assert set(counters.best_tiles(r).values()) == {1}


def test_plot_tiles():
    axes = counters.plot_tiles(record("counters_gather_scatter.json"))
    assert len(axes) == 2 and len(axes[0]) == 2 and len(axes[0][0].lines) == 1
    plt.close("all")


def test_stages_table_shares_add_up():
    r = record("counters_layer_stages.json")
    lines = well_formed(counters.stages_table(r))
    shares = [float(line.split("|")[5].strip(" %")) for line in lines[2:]]
    assert [line.split("|")[3].strip() for line in lines[2:]] == ["Map", "metadata", "gather", "GEMMs", "scatter",
                                                                   "other"]
    assert sum(shares) == pytest.approx(100, abs=3)  # (each share rounded)


def test_stages_table_says_what_was_not_measured():
    """A run whose budget ran out before the layer has no rows: the table says so, with the
    probe's reason, rather than showing an empty table."""
    r = record("counters_layer_stages.json")
    r["rows"] = []
    r["not_run"] = [{"label": "layer kitti 64->64 float32", "why": "the time budget ran out (--budget-s)"}]
    got = counters.stages_table(r)
    assert got == ("No layer was measured in this run: layer kitti 64->64 float32 "
                   "(the time budget ran out (--budget-s)).")
    r["not_run"] = []
    assert counters.stages_table(r) == "No layer was measured in this run: nothing recorded."


def test_fig14_table_and_plot():
    r = record("paper_fig14.json")
    lines = well_formed(counters.fig14_table(r))
    c = r["clouds"]["crop_120"]
    assert [line.split("|")[2].strip() for line in lines[2:]] == ["baseline", "+AT", "+PG", "+SS", "+DTBS"]
    assert lines[2].endswith("| 1.00x | 1.00x |")
    for line, bar in zip(lines[2:], c["bars"]):
        cells = [float(v) for v in line.split("|")[3:7]]
        assert sum(cells[:3]) == pytest.approx(cells[3], abs=2e-3)
        assert cells[3] == pytest.approx(bar["host_ms"], abs=1e-3)
    axes = counters.plot_fig14(r, clock="gpu_ms")
    assert len(axes[0].patches) == 3 * 5  # three parts stacked on five bars
    plt.close("all")
    with pytest.raises(ValueError, match="clock must be"):
        counters.plot_fig14(r, clock="wall")


def test_fig13_table_and_plot():
    r = record("paper_fig13.json")
    lines = well_formed(counters.fig13_table(r))
    x = r["rows"][0]
    assert lines[2].startswith(f"| {x['n']:,} | {x['voxels']:,} |")
    assert f"| {x['map']['hash']['gpu_ms']:.3f} |" in lines[2]
    # a run with networks: their time over ours
    x["networks"] = [{"net": "unet42", "network": {"numba-sc": {"ms": 2.0}, "spconv Native": {"ms": 3.0},
                                                   "spconv MaskImplicitGemm": {"ms": 1.0}}}]
    r["rows"].append({"n": 1_000_000, "skipped": "the time budget ran out (--budget-s)"})
    lines = well_formed(counters.fig13_table(r))
    assert "unet42: Native 1.50x, MaskImplicitGemm 0.50x" in lines[2] and "not measured" in lines[3]
    axes = counters.plot_fig13(r, paper=results.load("paper"))
    assert len(axes[0].lines) == 3 and len(axes[1].lines) == 2 + 2  # 2 peers, the paper's mean, the 1x line
    plt.close("all")


@pytest.mark.parametrize("kind, name", [("fig14", "counters_map.json"), ("map", "paper_fig13.json"),
                                        ("tiles", "paper_fig14.json"), ("map", "counters_gather_scatter.json"),
                                        ("stages", "counters_map.json")])
def test_a_file_of_another_kind_is_refused_by_name(kind, name):
    with pytest.raises(ValueError, match=f"is it a {kind} file"):
        counters.check_record(record(name), kind)
    with pytest.raises(ValueError, match="kind must be one of"):
        counters.check_record(record(name), "figure 3")


# ------------------------------------------------------------------ the files the probe recorded
RECORDED = {"map": "counters_map", "tiles": "counters_gather_scatter", "stages": "counters_layer_stages",
            "fig13": "paper_fig13", "fig14": "paper_fig14"}


@pytest.fixture(scope="module")
def recorded():
    return {kind: results.load(name) for kind, name in RECORDED.items()}


def test_the_recorded_files_hold_their_provenance(recorded):
    """Each file says where its numbers come from (device, date, command, commit), and holds
    the device's L2 size and peak bandwidth that the notebooks set the counters against."""
    for kind, r in recorded.items():
        counters.check_record(r, kind)
        rec = r["recorded"]
        assert rec["device"] and rec["date"] and rec["command"] and rec["commit"], (kind, rec)
        assert r["device"]["l2_bytes"] > 0 and r["device"]["dram_peak_bytes_per_s"] > 0, kind


def test_the_recorded_files_load_through_every_helper(recorded):
    """Every helper notebooks 03, 04, 05 and 11 call, on the committed files: the clouds the
    notebooks name are there, every table is well formed, every plot draws, and every claim
    gets a verdict (the file holds what each needs)."""
    hw = recorded["map"]
    for cloud in ("crop_20000", "kitti"):  # notebook 03's region and notebook 04's scan
        assert cloud in hw["clouds"]
    for which in ("query", "step"):
        assert len(well_formed(counters.map_table(hw, which))) == 2 + len(counters.map_rows(hw, which))
    assert set(counters.query_orders(hw, "crop_20000")) == set(counters.NB03_ORDERS)
    assert set(counters.query_orders(hw, "crop_20000", "l1")) == set(counters.NB03_ORDERS)
    cost = counters.per_query(hw)
    assert all(v is not None and v >= 0 for c in cost.values() for x in c.values() for v in x.values())
    sizes = counters.table_bytes(hw)
    assert sizes["L2"] == hw["device"]["l2_bytes"] and set(sizes) == {"L2", *hw["clouds"]}
    claims = counters.paper_claims(hw, results.load("paper"))
    assert [c["id"] for c in claims] == list(counters.CLAIMS)
    assert all(isinstance(c["holds"], bool) and c["measured"] for c in claims), claims
    ax = counters.plot_map(hw, paper=results.load("paper"))
    assert len(ax.get_xticklabels()) == len(hw["clouds"])

    tiles = recorded["tiles"]
    assert len(well_formed(counters.tiles_table(tiles))) == 2 + len(counters.best_tiles(tiles))
    assert ("kitti", "gather", "float32") in counters.best_tiles(tiles)  # notebook 05's layer
    counters.plot_tiles(tiles)

    stages = counters.stages_table(recorded["stages"])
    assert stages.startswith("| cloud | layer |") or stages.startswith("No layer was measured in this run: ")

    fig13 = recorded["fig13"]
    assert len(well_formed(counters.fig13_table(fig13))) == 2 + len(fig13["rows"])
    counters.plot_fig13(fig13, paper=results.load("paper"))
    fig14 = recorded["fig14"]
    bars = sum(len(c.get("bars", [None])) for c in fig14["clouds"].values())
    assert len(well_formed(counters.fig14_table(fig14))) == 2 + bars
    counters.plot_fig14(fig14)
    plt.close("all")

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
    """Each claim holds or fails as the file's numbers say: set so that all five hold, then
    changed one at a time so that one fails."""
    r = record("counters_map.json")
    big = copy.deepcopy([x for x in r["rows"] if x["cloud"] == "crop_120"])
    for x in big:
        x["cloud"] = "big"
    r["rows"] += big
    r["clouds"]["big"] = dict(r["clouds"]["crop_120"], voxels=5_000_000)

    def set_rate(cloud, variant, value):
        results.row(r["rows"], cloud=cloud, variant=variant)["query"]["l2_hit_pct"] = value

    for cloud, (minuet, hashed, segmented, unsorted) in {"crop_120": (97, 60, 80, 40), "big": (96, 30, 85, 20)}.items():
        for variant, value in (("minuet", minuet), ("hash", hashed), ("segmented", segmented), ("unsorted", unsorted)):
            set_rate(cloud, variant, value)
        x = results.row(r["rows"], cloud=cloud, variant="minuet")
        x["step"]["time_ns"] = x["query"]["time_ns"] / 0.95  # the forward search: 95 % of the step
    paper = results.load("paper")
    claims = counters.paper_claims(r, paper)
    assert [c["holds"] for c in claims] == [True] * 5, claims
    assert claims[0]["measured"] == "crop_120 97.0 %, big 96.0 %" and claims[3]["measured"].startswith("crop_120 (")
    set_rate("big", "minuet", 90)  # below the paper's 95 %
    assert [c["holds"] for c in counters.paper_claims(r, paper)] == [False, True, True, True, True]
    set_rate("big", "minuet", 96)
    set_rate("big", "hash", 70)  # grows with the cloud instead of falling
    assert [c["holds"] for c in counters.paper_claims(r, paper)] == [True, True, True, False, True]
    set_rate("crop_120", "unsorted", 85)  # random order beats sorted on one cloud
    assert counters.paper_claims(r, paper)[1]["holds"] is False
    x = results.row(r["rows"], cloud="big", variant="minuet")
    x["step"]["time_ns"] = x["query"]["time_ns"] / 0.5
    assert counters.paper_claims(r, paper)[4]["holds"] is False
    del r["clouds"]["big"]  # one cloud: whether the rate falls with size cannot be told
    r["rows"] = [x for x in r["rows"] if x["cloud"] != "big"]
    assert counters.paper_claims(r, paper)[3]["holds"] is None


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

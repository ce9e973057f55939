"""The Nsight Compute probe (benchmarks/probes/ncu_counters.py), the parts that run without a
GPU: reading ncu's CSV (a realistic sample of each page it prints), filing kernels under
their measurements by the marker kernels, summing counters, the names of stages, the search
kernels of the plain variants against the reference, and every workload run once under the
simulator on a crop of the scan (``--dry-run --tiny``)."""
import math

import numpy as np
import pytest

from ncu_records import dry_run, probe, synthetic_csv

# A sample of ncu's details page (`ncu --import R --csv --page details`, no --print-units base):
# ncu's own lines first, units scaled per value, thousands separators, a value ncu could not
# give (n/a), a rule row without a metric, three kernels of which the first is a marker.
DETAILS = '''==PROF== Connected to process 31337 (/usr/bin/python3.12)
map kitti: 94,444 voxels, 1,322,216 lookups
==PROF== Disconnected from process 31337
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value","Rule Name","Rule Type","Rule Description","Estimated Speedup Type","Estimated Speedup"
"0","31337","python3.12","127.0.0.1","ncu_counters_marker","1","7","(1, 1, 1)","(6, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","1,824",,,,,
"1","31337","python3.12","127.0.0.1","forward_search","1","7","(128, 1, 1)","(3254, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","Mbyte","12.58",,,,,
"1","31337","python3.12","127.0.0.1","forward_search","1","7","(128, 1, 1)","(3254, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","Kbyte","640.00",,,,,
"1","31337","python3.12","127.0.0.1","forward_search","1","7","(128, 1, 1)","(3254, 1, 1)","0","9.0","Command line profiler metrics","dram__throughput.avg.pct_of_peak_sustained_elapsed","%","31.42",,,,,
"1","31337","python3.12","127.0.0.1","forward_search","1","7","(128, 1, 1)","(3254, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","1,102.40",,,,,
"1","31337","python3.12","127.0.0.1","forward_search","1","7","(128, 1, 1)","(3254, 1, 1)","0","9.0","Command line profiler metrics","lts__t_sector_hit_rate.pct","%","96.73",,,,,
"1","31337","python3.12","127.0.0.1","forward_search","1","7","(128, 1, 1)","(3254, 1, 1)","0","9.0","Command line profiler metrics","l1tex__t_sector_hit_rate.pct","%","n/a",,,,,
"1","31337","python3.12","127.0.0.1","forward_search","1","7","(128, 1, 1)","(3254, 1, 1)","0","9.0","Command line profiler metrics","","","","IssueSlotUtilization","WRN","...","",""
"2","31337","python3.12","127.0.0.1","probe_kernel::<locals>::probe","1","7","(256, 1, 1)","(5165, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","msecond","2.01",,,,,
"2","31337","python3.12","127.0.0.1","probe_kernel::<locals>::probe","1","7","(256, 1, 1)","(5165, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","Gbyte","1.50",,,,,
'''

# The same kind of output from the raw page (`--page raw`): one row a kernel, a metric a column,
# the units in the row under the header.
RAW = '''"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","dram__bytes_read.sum","gpu__time_duration.sum","lts__t_sector_hit_rate.pct"
"","","","","","","","","","","","Mbyte","usecond","%"
"0","31337","python3.12","127.0.0.1","ncu_counters_marker","1","7","(1, 1, 1)","(1, 1, 1)","0","9.0","0.00","1.82","0"
"1","31337","python3.12","127.0.0.1","search_listed","1","7","(256, 1, 1)","(5165, 1, 1)","0","9.0","1,250.00","3,210.50","38.10"
'''


def test_the_details_page_is_read_in_base_units():
    p = probe()
    kernels = p.parse_ncu_csv(DETAILS)
    assert [k["name"] for k in kernels] == ["ncu_counters_marker", "forward_search", "probe_kernel::<locals>::probe"]
    marker, fwd, prb = kernels
    assert marker["grid"] == "(6, 1, 1)" and marker["metrics"]["gpu__time_duration.sum"] == 1824
    m = fwd["metrics"]
    assert m["gpu__time_duration.sum"] == pytest.approx(1_102_400)  # usecond -> ns, separators dropped
    assert m["dram__bytes_read.sum"] == pytest.approx(12.58e6) and m["dram__bytes_write.sum"] == pytest.approx(640e3)
    assert m["lts__t_sector_hit_rate.pct"] == pytest.approx(96.73)
    assert m["l1tex__t_sector_hit_rate.pct"] is None  # n/a: no value, not zero
    assert "" not in m  # the rule row holds no metric
    assert prb["metrics"] == {"gpu__time_duration.sum": pytest.approx(2.01e6),
                              "dram__bytes_read.sum": pytest.approx(1.5e9)}


def test_the_raw_page_is_read_too():
    kernels = probe().parse_ncu_csv(RAW)
    assert [k["name"] for k in kernels] == ["ncu_counters_marker", "search_listed"]
    m = kernels[1]["metrics"]
    assert m["dram__bytes_read.sum"] == pytest.approx(1.25e9)
    assert m["gpu__time_duration.sum"] == pytest.approx(3_210_500)
    assert m["lts__t_sector_hit_rate.pct"] == pytest.approx(38.1) and kernels[1]["grid"] == "(5165, 1, 1)"


def test_output_without_a_table_quotes_ncus_errors():
    p = probe()
    text = ("==PROF== Connected to process 7\n==ERROR== Failed to find metric lts__t_sector_hit_rate.pctx\n"
            "==ERROR== An error occurred while trying to profile.\n")
    with pytest.raises(p.NcuOutputError, match="Failed to find metric lts__t_sector_hit_rate.pctx"):
        p.parse_ncu_csv(text)
    with pytest.raises(p.NcuOutputError, match="no ==ERROR== line"):
        p.parse_ncu_csv("nothing at all\n")


def test_units_to_base():
    p = probe()
    assert p.to_base(1.5, "msecond") == 1.5e6 and p.to_base(2, "second") == 2e9 and p.to_base(3, "nsecond") == 3
    assert p.to_base(2, "Gbyte") == 2e9 and p.to_base(2, "Kibyte") == 2048 and p.to_base(7, "Msector") == 7e6
    assert p.to_base(87.5, "%") == 87.5 and p.to_base(4, "") == 4
    assert p.number("1,234,567.5") == 1234567.5 and p.number("n/a") is None


def kernel(name, grid=7, **m):
    return {"name": name, "grid": f"({grid}, 1, 1)", "metrics": m}


def test_kernels_are_filed_under_their_marker_by_its_grid():
    """The marker of measurement 2 was not profiled: its kernel falls to measurement 1, and
    measurement 3 is still measurement 3 (the grid names it), not shifted to 2."""
    p = probe()
    ks = [kernel("cupy_fill"), kernel(p.MARKER, 1), kernel("a"), kernel(p.MARKER, 2), kernel("b"), kernel("c"),
          kernel(p.MARKER, 4), kernel("d")]
    groups, stray = p.attribute(ks)
    assert [k["name"] for k in stray] == ["cupy_fill"]
    assert {i: [k["name"] for k in g] for i, g in groups.items()} == {0: ["a"], 1: ["b", "c"], 3: ["d"]}
    # without grid sizes, the markers' rank
    for k in ks:
        k["grid"] = ""
    assert sorted(p.attribute(ks)[0]) == [0, 1, 2]


def test_hit_rates_add_up_by_sectors_not_by_kernels():
    """A kernel that hits 100 % of 10 sectors and one that hits 0 % of 30 hit 25 % together;
    the mean of the two rates (50 %) would be wrong."""
    p = probe()
    a = {"time_ns": 1000.0, "l2_hit_pct": 100.0, "l2_sectors": 10.0, "l1_hit_pct": 10.0, "dram_read_bytes": 3e3,
         "dram_write_bytes": 1e3, "dram_pct_peak": 20.0}
    b = dict(a, time_ns=3000.0, l2_hit_pct=0.0, l2_sectors=30.0, l1_hit_pct=50.0, dram_pct_peak=40.0)
    s = p.aggregate([a, b])
    assert s["l2_hit_pct"] == pytest.approx(25.0) and s["time_ns"] == 4000
    assert s["l1_hit_pct"] == pytest.approx(40.0) and s["dram_pct_peak"] == pytest.approx(35.0)  # time-weighted
    assert s["dram_bytes"] == 8e3 and s["bytes_per_s"] == pytest.approx(8e3 / 4000e-9)
    assert p.aggregate([dict(a, l2_sectors=None), dict(b, l2_sectors=None)])["l2_hit_pct"] == pytest.approx(25.0)
    assert p.aggregate([a, dict(b, dram_read_bytes=None)])["dram_bytes"] is None  # unknown, not a partial sum
    assert p.aggregate([]) is None


@pytest.mark.parametrize("name, stage", [
    ("cudapy::numba_sc::map::forward_search::forward_search_v4::<locals>::forward_search[abi:v1,cw51c](Array)",
     "forward search"),
    ("_ZN6cudapy8numba_sc3map9map_probe12probe_kernel12_3clocals_3e5probeB2v1E5ArrayIxLi1E1C7mutable7alignedE",
     "probe"),
    ("backward_search_v2", "backward search"), ("insert_kernel", "hash build"), ("fill_kernel", "grid build"),
    ("cudapy::__main__::search_listed[abi:v1]", "search"), ("gather_v3_kernel", "gather"),
    ("scatter_v3_kernel", "scatter"), ("metadata_v2_kernel", "metadata"),
    ("sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x32", "GEMM"), ("take_weights_kernel", "GEMM"),
    ("void cub::DeviceRadixSortOnesweepKernel<Policy>", "other"), ("cupy_copy__int32_int32", "other"),
    ("cudapy::__main__::ncu_counters_marker[abi:v1]", "marker")])
def test_stages_by_kernel_name(name, stage):
    assert probe().classify(name) == stage


def test_the_plain_search_kernels_find_what_the_reference_finds(coords):
    """search_listed in every order and search_segments give the searched half of the map."""
    import numba_sc as ns

    p = probe()
    offsets = ns.kernel_offsets(3)
    h = (len(offsets) + 1) // 2
    keys = ns.pack_keys(coords, reach_lo=offsets.min(0), reach_hi=offsets.max(0))
    deltas = ns.key_delta(offsets)[:h]
    table = ns.build_kernel_map(coords, 3, backend="reference").table
    segmented = (deltas[:, None] + keys[None, :]).ravel()
    for queries in (segmented, np.sort(segmented), np.random.default_rng(0).permutation(segmented)):
        found = np.full(len(queries), -7, np.int32)
        p.run_listed(keys, queries, found)
        at = np.minimum(np.searchsorted(keys, queries), len(keys) - 1)
        assert np.array_equal(found, np.where(keys[at] == queries, at, -1))
    half = np.full((h, len(keys)), -7, np.int32)
    p.run_segments(keys, keys, deltas, half)
    assert np.array_equal(half, table[:h])


def test_a_dry_run_runs_every_workload_once():
    """Every Map variant, every tile of 8 channels for both stages, one layer: measured (none
    refused on a crop, whose grid fits), nothing failed, and each measurement numbered in order."""
    p = probe()
    entries = dry_run().entries
    measured = [e for e in entries if e["kind"] == "measure"]
    assert [e["index"] for e in measured] == list(range(len(measured)))
    assert [e["variant"] for e in measured if e["part"] == "map"] == list(p.VARIANTS)
    tiles = {(e["stage"], e["tile"]) for e in measured if e["part"] == "tiles"}
    assert tiles == {(s, t) for s in ("gather", "scatter") for t in (1, 2, 4, 8)}
    assert sum(e["part"] == "stages" for e in measured) == 1
    assert not [e for e in entries if e["kind"] in ("failed", "skipped", "refused")]
    checks = {e["label"]: e["check"] for e in entries if e["kind"] == "check"}
    assert len(checks) == 4 and set(checks.values()) == {"ok"}
    cloud = next(e for e in entries if e["kind"] == "cloud" and e["part"] == "map")
    assert cloud["queries"] == 14 * cloud["voxels"] and cloud["hash_table_bytes"] >= 24 * cloud["voxels"]


def test_a_search_that_finds_too_little_is_reported(monkeypatch):
    """The check after each plain search: a kernel that finds nothing is a MISMATCH in its row,
    never a counter of a wrong answer passed off as right."""
    p = probe()
    monkeypatch.setattr(p, "run_listed", lambda src, queries, found: found.fill(-1))
    session = p.Session(profile=False, say=lambda *a: None)
    coords, how = p.make_cloud("crop_60", None)
    p.map_workloads(session, "crop_60", coords, how)
    checks = {e["label"]: e["check"] for e in session.entries if e["kind"] == "check"}
    assert all(checks[f"map crop_60 {v}"].startswith("MISMATCH: 0 hits") for v in ("unsorted", "sorted", "segmented"))
    assert checks["map crop_60 segmented_on_the_fly"] == "ok"


def test_records_file_every_kernel_and_say_what_is_missing():
    p = probe()
    entries = dry_run().entries
    first = next(e for e in entries if e["kind"] == "measure")
    records = p.build_records(p.parse_ncu_csv(synthetic_csv(entries, drop={first["index"]})), entries, {"device": "x"})
    assert set(records) == {p.FILES[k] for k in ("map", "tiles", "stages")}
    rows = records[p.FILES["map"]]["rows"]
    assert rows[0]["label"] == first["label"] and rows[0]["error"] and rows[0]["query"] is None
    minuet = next(r for r in rows if r["variant"] == "minuet")
    assert [k["stage"] for k in minuet["kernels"]] == ["pack", "backward search", "forward search"]
    assert minuet["query"]["kernels"] == 1 and minuet["step"]["kernels"] == 3  # Figure 16b: the forward search
    assert minuet["query"]["time_ns"] == minuet["kernels"][2]["time_ns"]
    layer = records[p.FILES["stages"]]["rows"][0]
    assert set(layer["by_stage"]) == {"Map", "metadata", "gather", "GEMMs", "scatter", "other"}
    assert layer["by_stage"]["GEMMs"]["kernels"] == 3
    assert math.isclose(sum(a["time_ns"] for a in layer["by_stage"].values()), layer["total"]["time_ns"])


def test_arguments():
    p = probe()
    assert [p.count(v) for v in ("300", "30k", "1M", "2.5M")] == [300, 30_000, 1_000_000, 2_500_000]
    with pytest.raises(ValueError, match="digits with an optional k or M"):
        p.count("1e6")
    with pytest.raises(SystemExit):
        p.parse_args(["--parts", "map,figure3"])
    with pytest.raises(ValueError, match="unknown cloud 'kitty'"):
        p.make_cloud("kitty", None)
    args = p.parse_args(["--parts", "map", "--map-clouds", "kitti_x2,random_30k_box64"])
    assert args.parts == ["map"] and args.map_clouds == ["kitti_x2", "random_30k_box64"]
    assert p._child_argv(["--parts", "map"], "/tmp/m.jsonl", 12.3)[-5:] == [
        "--child", "--manifest", "/tmp/m.jsonl", "--deadline", "12"]


def test_made_clouds_are_sorted_and_say_how_they_were_made():
    import numba_sc as ns

    p = probe()
    for name, columns in (("random_2k_box40", 3), ("kitti_x2", 4)):
        coords, how = p.make_cloud(name, None)
        keys = ns.pack_keys(coords)
        assert coords.shape[1] == columns and np.all(np.diff(keys) > 0), name
        assert how
    batch, _ = p.make_cloud("kitti_x2", None)
    kitti, _ = p.make_cloud("kitti", None)
    assert np.array_equal(batch[batch[:, 0] == 0, 1:], kitti)  # copy 0 is the scan itself
    assert abs(int((batch[:, 0] == 1).sum()) - len(kitti)) < 0.02 * len(kitti)  # turned: about as many voxels


FAKE_NCU = """#!{python}
import sys
args = sys.argv[1:]
metrics = args[args.index("--metrics") + 1].split(",")
l1 = [m for m in metrics if m.startswith("l1tex")]
if "{mode}" == "broken":
    print("==ERROR== the driver could not be loaded", file=sys.stderr)
    sys.exit(1)
if "{mode}" == "error" and l1:
    print("==ERROR== Failed to find metric regex:^" + l1[0] + "$", file=sys.stderr)
    sys.exit(1)
print({header!r})
for m in metrics:
    if not ("{mode}" == "silent" and m.startswith("l1tex")):
        print('"0","1","python3","h","cupy_add","1","7","(128, 1, 1)","(512, 1, 1)","0","9.0","Command line '
              'profiler metrics","' + m + '","%","1.0","","","","",""')
"""


@pytest.mark.parametrize("mode", ["error", "silent"])
def test_a_metric_ncu_cannot_measure_is_left_out_loudly(tmp_path, mode):
    """A trial under a stand-in ncu that cannot measure the L1 metric: it fails naming it
    (then succeeds without it), or leaves it out of its table."""
    import sys

    from ncu_records import HEADER

    p = probe()
    fake = tmp_path / "ncu"
    fake.write_text(FAKE_NCU.format(python=sys.executable, mode=mode, header=HEADER))
    fake.chmod(0o755)
    said = []
    got = p.usable_metrics(str(fake), said.append)
    assert got == [m for m in p.METRICS.values() if not m.startswith("l1tex")]
    assert len(said) == 1 and "l1tex__t_sector_hit_rate.pct" in said[0]


def test_an_ncu_that_fails_for_another_reason_says_why(tmp_path):
    import sys

    from ncu_records import HEADER

    p = probe()
    fake = tmp_path / "ncu"
    fake.write_text(FAKE_NCU.format(python=sys.executable, mode="broken", header=HEADER))
    fake.chmod(0o755)
    said = []
    assert p.usable_metrics(str(fake), said.append) is None
    assert "the driver could not be loaded" in said[0]

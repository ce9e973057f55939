"""Markdown tables made from the result files (numba_sc.tools.tables): every table
function is in TABLES and makes a well-formed table from the file it is written for;
a worked example gives the cells it should."""
import inspect

import pytest

from numba_sc.tools import tables
from numba_sc.tools.results import load

# Each table and a recorded file it is made from (the prose embeds these).
MADE_FROM = {"network_table": "net_scans", "layer_kinds_table": "net_scans", "ladder_table": "ladder_all_kitti",
             "train_step_table": "train_step", "train_curve_table": "train_kitti", "map_methods_table": "alternatives",
             "single_layers_table": "alternatives", "conv_table": "conv", "map_table": "map",
             "ab_map_table": "ab_map", "voxelize_table": "voxelize", "generalize_table": "generalize",
             "targets_table": "targets"}


def _targets37_row(target, work, cloud, dtype, ratio, limit, **more):
    return {"target": target, "limit": limit, "work": work, "cloud": cloud, "voxels": 20_000, "dtype": dtype,
            "ratio": ratio, "met": None if limit is None else ratio <= limit, **more}


# A targets_37.json in miniature (no GPU run has written one yet): two layer-kind rows of
# one line with their roofline, a memory line, a network line with no limit.
TARGETS37 = {"rows": [
    _targets37_row("layer kind", "subm reuse (SparseResNet21)", "kitti_20k", "float32", 0.8, 1.0,
                   tflops=12.0, gbps=400.0, pct_flops=8.0, pct_bandwidth=12.0),
    _targets37_row("layer kind", "subm reuse (MinkUNet42)", "scannet_20k", "float32", 1.2, 1.0,
                   tflops=20.0, gbps=650.0, pct_flops=13.4, pct_bandwidth=19.6),
    _targets37_row("layer kind", "subm reuse (MinkUNet42)", "random", "float16", 0.5, 1.0,
                   tflops=90.0, gbps=1500.0, pct_flops=15.0, pct_bandwidth=45.0),
    _targets37_row("layer kind", "batchnorm (MinkUNet42)", "kitti_20k", "float16", 0.9, 1.0,
                   tflops=0.0, gbps=800.0, pct_flops=0.0, pct_bandwidth=24.0),
    _targets37_row("peak memory, forward", "MinkUNet42 forward", "kitti_20k", "float32", 1.25, 1.5),
    _targets37_row("peak memory, forward", "MinkUNet42 forward", "sunrgbd_20k", "float32", 1.75, 1.5),
    _targets37_row("network, full scan", "MinkUNet42 forward", "kitti", "float16", 0.66, None),
]}
SYNTHETIC = {"targets37_table": TARGETS37}


def test_every_table_function_is_in_TABLES():
    public = {n for n, f in inspect.getmembers(tables, inspect.isfunction)
              if n.endswith("_table") and not n.startswith("_") and f.__module__ == tables.__name__}
    assert public == set(tables.TABLES) == set(MADE_FROM) | set(SYNTHETIC)
    assert all(tables.TABLES[n] is getattr(tables, n) for n in public)


@pytest.mark.parametrize("name", sorted(MADE_FROM) + sorted(SYNTHETIC))
def test_a_table_is_well_formed(name):
    made_from = SYNTHETIC[name] if name in SYNTHETIC else load(MADE_FROM[name])
    lines = tables.TABLES[name](made_from).splitlines()
    assert len(lines) >= 3, "a header, the rule, at least one row"
    columns = lines[0].count("|")
    assert set(lines[1]) == {"|", "-"} and lines[1].count("|") == columns
    assert all(line.startswith("| ") and line.endswith(" |") and line.count("|") == columns for line in lines[2:])


def test_a_worked_network_table():
    run = {"net": "resnet21", "cloud": "kitti", "n": 1234, "dtype": "float16",
           "network": {"numba-sc": {"ms": 3.0}, "spconv Native": {"ms": 4.0}, "spconv MaskImplicitGemm": {"ms": 6.0}},
           "rel_err": {"Native": 1.5e-4, "MaskImplicitGemm": 2e-4}}
    header, rule, row = tables.network_table({"runs": [run]}).splitlines()
    assert header.startswith("| network | cloud (voxels) | dtype |") and "spconv own outputs" not in header
    assert row == "| ResNet21 | SemanticKITTI (1,234) | fp16 | 3.00 | 4.00 | 6.00 | **0.75x** | 1.5e-04 / 2.0e-04 |"


def test_a_worked_targets37_table():
    header, rule, *rows = tables.targets37_table(TARGETS37).splitlines()
    assert header == ("| target | work | fp32 | fp16 | limit | rows within | roofline of ours (% of measured peak) |")
    assert rows == [
        # the crops' rows of a kind together, whatever the network; the 1M cloud's apart
        "| layer kind | subm reuse, 20k crops | 0.80-1.20x |  | 1.00 | 1 of 2 | "
        "12.00-20.00 TFLOP/s (8-13 %), 400-650 GB/s (12-20 %) |",
        "| layer kind | subm reuse, 1M random |  | 0.50x | 1.00 | 1 of 1 | 90.00 TFLOP/s (15 %), 1500 GB/s (45 %) |",
        # BatchNorm does no counted flops: its roofline is its bandwidth alone
        "| layer kind | batchnorm, 20k crops |  | 0.90x | 1.00 | 1 of 1 | 800 GB/s (24 %) |",
        "| peak memory, forward | MinkUNet42 forward | 1.25-1.75x |  | 1.50 | 1 of 2 |  |",
        "| network, full scan | MinkUNet42 forward |  | 0.66x | report | - |  |",
    ]

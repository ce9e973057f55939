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


def test_every_table_function_is_in_TABLES():
    public = {n for n, f in inspect.getmembers(tables, inspect.isfunction)
              if n.endswith("_table") and not n.startswith("_") and f.__module__ == tables.__name__}
    assert public == set(tables.TABLES) == set(MADE_FROM)
    assert all(tables.TABLES[n] is getattr(tables, n) for n in public)


@pytest.mark.parametrize("name", sorted(MADE_FROM))
def test_a_table_is_well_formed(name):
    lines = tables.TABLES[name](load(MADE_FROM[name])).splitlines()
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

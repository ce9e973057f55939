"""Fetch-on-demand's shapes (numba_sc.dataflows.fetch_shapes): the block table of the
module docstring's worked example, the plan's checks, v2's tiles."""
import numpy as np
import pytest

from numba_sc.core.backend import to_host
from numba_sc.dataflows import fetch_on_demand as fd
from numba_sc.dataflows import fetch_shapes as fsh

TABLE = np.array([[-1, 0, -1], [0, 1, 2], [1, -1, -1]], np.int32)  # x = 0, 1, 3; offsets -1, 0, +1


def test_block_table_of_the_worked_example():
    starts, off, start, stop = fsh.block_table([1, 3, 1], 1, 64)
    assert starts.tolist() == [0, 1, 1, 2]
    assert (off.tolist(), start.tolist(), stop.tolist()) == ([0, 2], [0, 1], [1, 2])
    starts, off, start, stop = fsh.block_table([5, 0, 3], -1, 2)  # blocks of 2 pairs, the last short
    assert off.tolist() == [0, 0, 0, 2, 2] and start.tolist() == [0, 2, 4, 5, 7]
    assert stop.tolist() == [2, 4, 5, 7, 8]


def test_plan_and_its_device_copy():
    plan = fd.fetch_plan_reference(TABLE, [1, 3, 1], skip=1, tile_p=64)
    assert (plan.in_rows.tolist(), plan.out_rows.tolist()) == ([0, 1], [1, 0])
    dev = plan.device()
    assert isinstance(dev, fsh.FetchPlan) and (dev.K, dev.n_pairs, dev.n_blocks) == (3, 2, 2)
    np.testing.assert_array_equal(to_host(dev.in_rows), plan.in_rows)


def test_checks_and_tiles():
    with pytest.raises(ValueError, match="one pair count per offset"):
        fsh.check_table(TABLE, [1, 3], -1, 64)
    with pytest.raises(TypeError, match="int32"):
        fsh.check_table_layout(TABLE.astype(np.int64), -1)
    with pytest.raises(ValueError, match="skip must be"):
        fsh.check_table_layout(TABLE, 3)
    assert fsh.v2_tiles(19, 17, simulated=True) == fsh.FetchTiles(8, 8, 8, 4, 2)
    assert fsh.v2_tiles(64, 64, simulated=False) == fsh.FetchTiles(64, 64, 32, 4, 4)
    init = np.ones((3, 2), np.float32)
    acc = fsh.accumulator(init, 3, 2)
    assert acc is not init and np.array_equal(to_host(acc), init)

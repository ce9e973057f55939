"""The tensor-core rungs compiled for a GPU, on a machine without one.

The simulator runs a kernel's Python, not Numba's CUDA compiler: a kernel can pass every
simulator test and still not compile for a GPU (a shared array sized by an expression, a
type the CUDA target lacks). ``compile_for_gpu.py`` compiles v4 and v5 of the implicit
GEMM to PTX with the simulator off (Numba needs NVVM for that, not a GPU); this checks
what the PTX says: the mma entry points of each warp tile, v4's two barriers a chunk
against v5's one, and shared arrays of the sizes the docstrings give."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from numba_sc.dataflows import implicit_shapes as ish
from numba_sc.dataflows import tensor_cores as tc


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("compile_for_gpu.py"))], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if "no_nvvm" in out:
        pytest.skip(f"NVVM (the CUDA toolkit's compiler library) is not here: {out['no_nvvm']}")
    return out["rows"]


def test_the_tensor_core_rungs_compile_for_a_gpu(compiled):
    assert {(r["rung"], r["tile_m"]) for r in compiled} == {(v, m) for v in ("v4", "v5") for m in (64, 16, 128)}
    for r in compiled:
        tiles = ish.TensorTiles(*r["tiles"])
        shape = (ish.v4_shape if r["rung"] == "v4" else ish.v5_shape)(r["tile_m"], tiles.tile_n)
        mi, ni = shape[2:]
        assert (mi, ni) in tc.MMA_SHAPES and r["calls"] == [f"implicit_mma_m{mi}n{ni}"], r
        assert r["barriers"] == (2 if r["rung"] == "v4" else 1), r  # v5: one barrier a step
        stages = 1 if r["rung"] == "v4" else 2
        a_bytes = stages * r["tile_m"] * (tiles.tile_k + 8) * 2
        b_bytes = stages * tiles.tile_k * (tiles.tile_n + 8) * 2
        assert r["shared"] == sorted([a_bytes, b_bytes]), r
        assert a_bytes + b_bytes <= 48 * 1024


def test_v5_at_64_by_128_takes_the_shared_memory_its_docstring_says(compiled):
    """Two stages of 64 x 40 and 32 x 136 fp16 values (the rows padded by 8)."""
    row = next(r for r in compiled if r["rung"] == "v5" and r["tiles"][0] == 128 and r["tile_m"] == 64)
    assert sum(row["shared"]) == 2 * 2 * (64 * 40 + 32 * 136)

"""Run by tests/dataflows/test_gpu_compile.py in a process of its own, with the simulator off:
the tensor-core rungs of the implicit GEMM compiled to PTX for a GPU (no GPU needed, only
NVVM). Prints one JSON line: each kernel's tile shape, the mma entry points its PTX calls,
its barriers and its shared arrays' bytes; or {"no_nvvm": reason} where NVVM cannot load."""
import json
import os
import re
import sys

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"  # before numba is imported

from numba import cuda  # noqa: E402

try:
    from numba.cuda.cudadrv import nvvm

    nvvm.NVVM()
except Exception as err:  # (a machine without the CUDA toolkit's NVVM)
    print(json.dumps({"no_nvvm": f"{type(err).__name__}: {err}"}))
    sys.exit(0)

from numba_sc.dataflows import implicit_gemm as ig  # noqa: E402
from numba_sc.dataflows import implicit_shapes as ish  # noqa: E402

rows = []
for rung, maker, tiles_for in (("v4", ig.implicit_gemm_v4, ish.tensor_tiles), ("v5", ig.implicit_gemm_v5, ish.v5_tiles)):
    for tile_m, c_in, c_out in ((64, 64, 64), (64, 128, 128), (16, 3, 5), (128, 24, 40)):
        tiles = tiles_for(c_in, c_out)
        ptx, _ = cuda.compile_ptx(maker(tile_m, *tiles).py_func, ish.tensor_core_signature(tiles), cc=(8, 0))
        rows.append(dict(rung=rung, tile_m=tile_m, tiles=list(tiles),
                         calls=sorted(set(re.findall(r"implicit_mma_m\d+n\d+", ptx))),
                         barriers=ptx.count("bar.sync"),
                         shared=sorted(int(x) for x in re.findall(r"\.shared \.align \d+ \.b8 \S+\[(\d+)\]", ptx))))
print(json.dumps({"rows": rows}))

"""numba-sc: the Minuet sparse-convolution engine as a readable Numba-CUDA reference.

Each stage of the pipeline is one module holding a docstring that teaches it, the
NumPy reference and the ``@cuda.jit`` kernels, in the order of the paper:

    conventions      coordinates, 64-bit keys, kernel offsets (one place for each)
    backend          "cuda" (GPU or simulator) / "reference" (NumPy); the API edge
    voxelization     1. float points -> unique voxel coordinates
    output_coords    2. Q = floor(P / s) * s
    sorting          3. library sort of packed keys; unique runs; duplicate check
    query_segments   4. segment k = sorted(Q) + delta_k, made on the fly
    backward_search  5. source-block pivots searched in each segment -> query blocks
    forward_search   6. each query block searched in its source block in shared memory
    kernel_map       the Map step assembled: build_kernel_map -> KernelMap
"""
from .backend import gpu_present, resolve_backend, simulating
from .conventions import kernel_offsets, key_delta, pack_keys, unpack_keys
from .kernel_map import KernelMap, build_kernel_map
from .output_coords import output_coordinates
from .voxelization import Voxelization, voxelize

__all__ = [
    "KernelMap", "Voxelization", "build_kernel_map", "gpu_present", "kernel_offsets", "key_delta",
    "output_coordinates", "pack_keys", "resolve_backend", "simulating", "unpack_keys", "voxelize",
]
__version__ = "0.1.0"

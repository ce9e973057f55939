"""numba-sc: the Minuet sparse-convolution engine as a readable Numba-CUDA reference.

Each stage of the pipeline is one module holding a docstring that teaches it, the
NumPy reference and the CUDA kernels (Numba), in the order of the paper:

    conventions      coordinates, 64-bit keys, kernel offsets (one place for each)
    backend          "cuda" (GPU or simulator) / "reference" (NumPy); the API edge
    voxelization     1. float points -> unique voxel coordinates
    output_coords    2. Q = floor(P / s) * s
    sorting          3. library sort of packed keys; unique runs; duplicate check
    query_segments   4. segment k = sorted(Q) + delta_k, made on the fly
    backward_search  5. source-block pivots searched in each segment -> query blocks
    forward_search   6. each query block searched in its source block in shared memory
    kernel_map       the Map step assembled: build_kernel_map -> KernelMap
    hash_map         the Map step's alternative 1: a GPU hash table (method="hash")
    grid_map         ... alternative 2: a dense grid over the bounding box (method="grid")
    map_probe        the one probe kernel both alternatives share
    metadata         7. pairs per offset, offset order, groups, buffer rows; in/out tables
    gather           8. tiled gather into the input buffer (Algorithm 1)
    gemm_grouping    9. offsets sorted by pair count, grouped into batched GEMMs
    scatter          10. tiled scatter-sum of partial results, no atomics
    autotune         11. tile sizes per layer (Algorithm 2)
    fetch_on_demand  the dataflow alternative 1: per-offset products, atomic adds (dataflow="fetch")
    implicit_gemm    ... alternative 2: output tiles over sorted offset masks (dataflow="implicit")
    choice           dataflow="auto", method="auto": measured per layer, else a rule of thumb
    tensor           SparseTensor: coordinates, features, the maps built on them
    conv             sparse_conv3d: Map + GMaS assembled
    pointwise        between the convolutions: BatchNorm, ReLU, residual add, concat
    nn               layers that hold their weights; maps kept on the tensors
    models           SparseResNet21 and MinkUNet42 (the paper's two networks)
    spconv_format    weights from and to spconv's layout
    trace, check     every intermediate of a layer; kernel-vs-reference per stage
"""
from .backend import gpu_present, resolve_backend, simulating
from .conventions import kernel_offsets, key_delta, pack_keys, unpack_keys
from .autotune import TileChoice, heuristic_tile
from .conv import autotune, choose_dataflow, sparse_conv3d
from .backward import sparse_conv3d_backward
from .tensor import SparseTensor
from . import models, nn, spconv_format
from .gemm_grouping import padding_report
from .kernel_map import KernelMap, build_kernel_map, choose_map_method
from .metadata import GmasPlan, build_plan, grouping_report
from .output_coords import output_coordinates
from .trace import Trace, trace
from .voxelization import Voxelization, voxelize

__all__ = [
    "sparse_conv3d_backward",
    "GmasPlan", "KernelMap", "SparseTensor", "TileChoice", "Voxelization", "autotune",
    "build_kernel_map", "build_plan", "gpu_present", "grouping_report", "heuristic_tile",
    "kernel_offsets", "key_delta", "output_coordinates", "pack_keys", "padding_report",
    "resolve_backend", "simulating", "sparse_conv3d", "Trace", "trace", "unpack_keys", "voxelize",
    "models", "nn", "spconv_format", "choose_dataflow", "choose_map_method",
]
__version__ = "0.1.0"

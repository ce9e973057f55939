"""numba-sc: the Minuet sparse-convolution engine as a readable Numba-CUDA reference.

The folders follow the paper's pipeline (Figure 6); each stage is one module holding a
docstring that teaches it, the NumPy reference and the CUDA kernels (Numba)::

    core/        backend selection and transfers, the launch path, conventions, SparseTensor
    coords/      1 voxelization, 2 output coordinates
    map/         3 sorting, 4 query segments, 5 backward search, 6 forward search, the Map
                 step (kernel_map); its alternatives: hash table, dense grid, their probe
    gmas/        7 metadata, 8 gather, 9 GEMM grouping, 10 scatter, 11 autotuning
    dataflows/   fetch-on-demand, implicit GEMM (their lessons, and the drivers of their plans)
    conv/        the layer: checks, map and plans, one dataflow run, the choice between
                 dataflows, autotune and choose_dataflow, the layer's gradient
    nn/          layers with weights, the pointwise kernels, the two models, spconv's weight format
    train/       the tape, loss, optimizers, labels, the loop
    tools/       ladder, check, trace, demo, synthetic scenes, the float64 oracle of gradients

The names below are the public API; every module is importable by its path
(``numba_sc.map.kernel_map``, ``numba_sc.gmas.gather``, ...).
"""
__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it)

from .core.device import gpu_present, simulating
from .core.backend import resolve_backend
from .core.state import clear_caches
from .core.conventions import kernel_offsets, key_delta, pack_keys, unpack_keys
from .gmas.autotune import TileChoice, heuristic_tile
from .conv.layer import sparse_conv3d
from .conv.tuning import autotune, choose_dataflow
from .conv.gradient import sparse_conv3d_backward
from .core.tensor import SparseTensor
from . import nn
from .nn import models, spconv_format
from .gmas.gemm_grouping import padding_report
from .map.kernel_map import KernelMap
from .map.map_step import build_kernel_map
from .map.method import choose_map_method
from .gmas.layout import GmasPlan
from .gmas.plan import build_plan, grouping_report
from .gmas.workspace import set_workspace, workspace_bytes
from .coords.output_coords import output_coordinates
from .tools.trace import Trace, trace
from .tools.oracle import gradients as check_gradients
from .train.checkpoint import load, save
from .coords.voxelization import Voxelization, voxelize

__all__ = [
    "sparse_conv3d_backward",
    "GmasPlan", "KernelMap", "SparseTensor", "TileChoice", "Voxelization", "autotune",
    "build_kernel_map", "build_plan", "gpu_present", "grouping_report", "heuristic_tile",
    "kernel_offsets", "key_delta", "output_coordinates", "pack_keys", "padding_report",
    "resolve_backend", "simulating", "sparse_conv3d", "Trace", "trace", "unpack_keys", "voxelize",
    "models", "nn", "spconv_format", "choose_dataflow", "choose_map_method", "save", "load",
    "check_gradients", "clear_caches", "set_workspace", "workspace_bytes",
]

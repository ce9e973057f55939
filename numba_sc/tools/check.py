"""``python -m numba_sc check``: every stage's kernel against its reference, located.

For each stage the CUDA kernels (GPU, or the simulator on a crop) and the NumPy
reference run on the *same* input; the outputs are compared exactly (integer
results) or to a stated tolerance (features). On a mismatch the first differing
element is printed with its context, so a kernel developer who swaps in their
own kernel learns *where* it differs, not only that it does.

The stages are listed once here and shared with the demo.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..core.device import gpu_present
from ..core.backend import to_host


@dataclass
class Stage:
    """One pipeline stage as the demo and the checker see it."""

    name: str
    run: Callable  # run(ctx, backend) -> result
    size: Callable  # size(result) -> str, the output size for the table
    compare: Callable  # compare(kernel_result, reference_result) -> None or a mismatch message


def _first_row_mismatch(a, b, what):
    a, b = to_host(a), to_host(b)
    if a.shape != b.shape:
        return f"{what}: shape {a.shape} vs reference {b.shape}"
    bad = np.flatnonzero((a != b).reshape(len(a), -1).any(axis=1)) if a.size else []
    if len(bad):
        i = int(bad[0])
        return f"{what}: {len(bad)} rows differ, first row {i}: {a[i].tolist()} vs reference {b[i].tolist()}"
    return None


def crop_points(points, n):
    """The n points nearest (Chebyshev distance) to the point nearest the cloud's centre:
    their indices, sorted. ``points`` (N, 3) are x, y, z (or (N, 4) coordinates with the
    batch index in column 0: the last three columns are the position)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"crop must be a positive number of points, got {n!r}")
    if n >= len(points):
        return np.arange(len(points))
    xyz = points[:, -3:]
    centre = xyz[np.argmin(np.abs(xyz - np.median(xyz, axis=0)).max(axis=1))]
    return np.sort(np.argsort(np.abs(xyz - centre).max(axis=1), kind="stable")[:n])


def make_context(points, features, voxel_size):
    """The inputs every stage reads: the cloud, its reference voxels, conv features and weights."""
    from ..coords.voxelization import voxelize

    ctx = {"points": points, "features": features, "voxel_size": voxel_size}
    ctx["voxels"] = voxelize(points, voxel_size, features, backend="reference")
    # Inputs for the convolution stages: fixed pseudo-random features and weights
    # (8 -> 8 channels, so that tiles of 1, 2, 4 and 8 channels all divide them).
    rng = np.random.default_rng(0)
    ctx["conv_features"] = rng.standard_normal((len(ctx["voxels"].coords), 8)).astype(np.float32)
    ctx["conv_weight"] = (rng.standard_normal((27, 8, 8)) / np.sqrt(27 * 8)).astype(np.float32)
    return ctx


def default_stages():
    """The stages that exist, in pipeline order."""
    from ..coords.output_coords import output_coordinates
    from ..coords.voxelization import voxelize

    def vox(ctx, backend):
        return voxelize(ctx["points"], ctx["voxel_size"], ctx["features"], backend=backend)

    def vox_cmp(k, r):
        return (_first_row_mismatch(k.coords, r.coords, "coords")
                or _first_row_mismatch(k.inverse, r.inverse, "inverse")
                or (None if k.features is None or np.allclose(to_host(k.features), to_host(r.features), rtol=1e-5)
                    else "features differ beyond rtol 1e-5"))

    def out2(ctx, backend):
        coords = ctx["voxels"].coords
        return output_coordinates(coords, 2, backend=backend)

    def conv_layer(ctx, backend):
        from ..conv.layer import SparseTensor, sparse_conv3d

        x = SparseTensor(ctx["voxels"].coords, ctx["conv_features"])
        return sparse_conv3d(x, ctx["conv_weight"], kernel_size=3, backend=backend)

    def plan(ctx, backend):
        from ..map.map_step import build_kernel_map
        from ..gmas.plan import build_plan

        km = build_kernel_map(ctx["voxels"].coords, 3, backend="reference")
        return build_plan(km, backend=backend)

    def plan_cmp(k, r):
        return (_first_table_mismatch(k.in_table, r.in_table, "input table (point, offset)")
                or _first_table_mismatch(k.out_table, r.out_table, "output table (point, offset)"))

    def conv_cmp(k, r):
        a, b = to_host(k.features).astype(np.float64), to_host(r.features).astype(np.float64)
        if a.shape != b.shape:
            return f"features: shape {a.shape} vs reference {b.shape}"
        err = np.abs(a - b).max(axis=1) / (np.abs(b).max() + 1e-30)
        if err.max() > 1e-5:
            i = int(np.argmax(err > 1e-5))
            return (f"output {i} at {to_host(r.coords)[i].tolist()}: {a[i, :4].round(5).tolist()}... "
                    f"vs reference {b[i, :4].round(5).tolist()}... (relative error {err[i]:.1e})")
        return None

    def kmap(ctx, backend):
        from ..map.map_step import build_kernel_map

        # Small blocks so that a crop still has many source blocks and splits.
        return build_kernel_map(ctx["voxels"].coords, 3, backend=backend, source_block=64, query_block=64)

    return [
        Stage("1 voxelize", vox, lambda r: f"{len(r.coords)} voxels", vox_cmp),
        Stage("2 output coords (s=2)", out2, lambda r: f"{len(r)} coords",
              lambda k, r: _first_row_mismatch(k, r, "coords")),
        Stage("3-6 kernel map (3x3x3, B=64, C=64)", kmap, lambda r: f"{int(to_host(r.counts).sum())} pairs",
              kernel_map_mismatch),
        Stage("7 metadata tables", plan, lambda r: f"{r.rows} buffer rows", plan_cmp),
        Stage("8-10 gather, GEMM, scatter (3x3x3, 8->8)", conv_layer,
              lambda r: f"{len(r.coords)} x {r.features.shape[1]}", conv_cmp),
    ]


def kernel_map_mismatch(k, r):
    """First differing kernel-map entry, told as coordinates: output, offset, input."""
    problem = (_first_row_mismatch(k.in_coords, r.in_coords, "sorted input coordinates")
               or _first_row_mismatch(k.out_coords, r.out_coords, "sorted output coordinates"))
    if problem:
        return problem
    a, b = to_host(k.table), to_host(r.table)
    bad = np.argwhere(a != b)
    if not len(bad):
        return None
    kk, i = bad[0].tolist()
    q, d = to_host(r.out_coords)[i], np.asarray(r.offsets)[kk]
    pin = to_host(r.in_coords)

    def name(j):
        return "no input (-1)" if j < 0 else f"input {j} at {pin[j].tolist()}"

    return (f"{len(bad)} table entries differ; first: output {i} at {q.tolist()}, offset {d.tolist()} "
            f"(looking for {(q[-3:] + d).tolist()}): expected {name(int(b[kk, i]))}, found {name(int(a[kk, i]))}")


def _first_table_mismatch(a, b, what):
    """First (row, column) where two 2-D integer tables differ, or None."""
    a, b = to_host(a), to_host(b)
    if a.shape != b.shape:
        return f"{what}: shape {a.shape} vs reference {b.shape}"
    bad = np.argwhere(a != b)
    if len(bad):
        i, k = bad[0].tolist()
        return f"{what}: {len(bad)} entries differ, first [{i}, {k}]: {a[i, k]} vs reference {b[i, k]}"
    return None


def select_stages(stage=None, stages=None):
    """The stages (of ``stages``, default all) whose name contains ``stage`` (any case);
    all when ``stage`` is empty. A text that matches none is refused, listing the names."""
    stages = stages or default_stages()
    if stage is None or stage == "":
        return stages
    if not isinstance(stage, str):
        raise TypeError(f"stage must be text, part of a stage's name, got {type(stage).__name__}")
    chosen = [s for s in stages if stage.lower() in s.name.lower()]
    if not chosen:
        names = "; ".join(s.name for s in stages)
        raise ValueError(f"--stage {stage!r} matches no stage; stages are: {names} (give part of a name)")
    return chosen


def run_check(points, features, voxel_size, stage=None, crop=1500, stages=None, log=print):
    """Compare kernel and reference for every stage (or those whose name contains ``stage``).

    Returns a list of ``(stage name, ok, detail)``; prints a table through ``log``.
    """
    stages = select_stages(stage, stages)
    if not gpu_present() and len(points) > crop:
        idx = crop_points(points, crop)
        points = np.ascontiguousarray(points[idx])
        features = None if features is None else np.ascontiguousarray(features[idx])
        log(f"No GPU: kernels run under the CUDA simulator on a crop of {len(points)} points.")
    ctx = make_context(points, features, voxel_size)
    results = []
    for st in stages:
        try:
            problem = st.compare(st.run(ctx, "cuda"), st.run(ctx, "reference"))
        except Exception as exc:  # a crashing kernel is a located failure too
            problem = f"raised {type(exc).__name__}: {exc}"
        results.append((st.name, problem is None, problem or "kernel == reference"))
    width = max(len(r[0]) for r in results)
    for name, ok, detail in results:
        log(f"{name.ljust(width)}  {'ok  ' if ok else 'FAIL'}  {detail}")
    return results

"""The inputs every checker draws from: crops of the real SemanticKITTI scan.

One place for where the scan is and how a crop is cut, so that each notebook's
checkers (``nb01.py`` ...) only say how many points they want. The scan is read from
``$NUMBA_SC_DATA``, else from ``shared/data`` beside the checkout (where the tests and
the notebooks look); without it, the package's synthetic street scene stands in (the
same kind of data), so a student without the scans can still check an answer.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ...core.state import cached

__all__ = ["SCAN", "VOXEL", "centre_crop", "crop_voxels", "data_folder", "scan_crop", "scan_points"]

SCAN = "semantickitti_000000.bin"  # x, y, z, remission; float32
VOXEL = 0.05  # metres: SemanticKITTI's voxel size throughout the notebooks


def data_folder(required: bool = False):
    """The folder holding :data:`SCAN`: ``$NUMBA_SC_DATA``, else ``shared/data`` beside
    the checkout; None when neither does (or, with ``required``, an error saying so)."""
    root = Path(__file__).resolve().parents[3]
    for folder in (os.environ.get("NUMBA_SC_DATA"), root.parent / "shared" / "data"):
        if folder and (Path(folder) / SCAN).is_file():
            return Path(folder)
    if required:
        raise FileNotFoundError(f"the exercises read {SCAN}; set NUMBA_SC_DATA to the folder that holds it")
    return None


@cached
def scan_points() -> np.ndarray:
    """float32 (N, 4): the scan's points and remission, or the synthetic street's points
    and intensity when the scan is not there."""
    folder = data_folder()
    if folder is not None:
        return np.fromfile(folder / SCAN, np.float32).reshape(-1, 4)
    from ..synthetic import lidar_scene

    xyz, intensity = lidar_scene(n_azimuth=400)
    return np.concatenate([xyz, intensity[:, None]], axis=1).astype(np.float32)


def scan_crop(n: int, seed: int = 0) -> np.ndarray:
    """float32 (n, 4): the ``n`` points nearest (Chebyshev distance) to a point picked by
    ``seed``, moved so that this point is the origin. Coordinates of both signs then
    occur, so an answer that truncates where it should floor shows."""
    points = scan_points()
    rng = np.random.default_rng(seed)
    centre = points[rng.integers(len(points)), :3]
    near = np.argsort(np.abs(points[:, :3] - centre).max(axis=1), kind="stable")[:n]
    crop = points[near].copy()
    crop[:, :3] -= centre
    return crop


def crop_voxels(n_points: int, seed: int = 0) -> np.ndarray:
    """int32 (M, 3): the voxels (sorted, unique) of :func:`scan_crop` at :data:`VOXEL`."""
    from ...coords.voxelization import voxelize

    crop = scan_crop(n_points, seed)
    return voxelize(np.ascontiguousarray(crop[:, :3]), VOXEL, backend="reference").coords


@cached
def centre_crop(n_points: int) -> np.ndarray:
    """int32 (M, 3): the voxels of the ``n_points`` points around the middle of the scan
    (:func:`numba_sc.tools.check.crop_points`), in the scan's own coordinates."""
    from ...coords.voxelization import voxelize
    from ..check import crop_points

    points = scan_points()[:, :3]
    crop = np.ascontiguousarray(points[crop_points(points, n_points)])
    return voxelize(crop, VOXEL, backend="reference").coords

"""Stages 1-2 of Minuet's Map step: where the points are, and where the outputs go.

    voxelization    1. float points -> unique sorted voxel coordinates (+ features, + point -> voxel)
    output_coords   2. the output coordinates Q = floor(P / s) * s (Eq. 1)
"""

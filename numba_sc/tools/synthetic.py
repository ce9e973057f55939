"""A deterministic synthetic LiDAR scan, so the demo needs no data download.

A 64-beam spinning sensor (elevations spread like a Velodyne HDL-64E, -24.8 to
+2 degrees) sits 1.73 m above a street. Every ray is cast against a small scene
made of a ground plane, two building facades, parked boxes ("cars") and poles;
the nearest hit within 80 m becomes a point, rays that hit nothing (sky) are
dropped. Like a real scan, the result is dense near the sensor and sparse far
away, with long thin structures (facades) and small blobs (poles, cars), which
is what makes a sparse-convolution kernel map non-trivial.

The scene is vectorized NumPy ray casting: ``t`` (distance along the ray) for each
surface, the minimum taken per ray.
"""
from __future__ import annotations

import numpy as np

SENSOR_HEIGHT = 1.73
MAX_RANGE = 80.0


def _boxes(rng, n):
    """Axis-aligned boxes (xmin, xmax, ymin, ymax, zmin, zmax) along both kerbs."""
    x = rng.uniform(-60, 60, n)
    side = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    y = side * rng.uniform(3.0, 5.0, n)
    length, width, height = rng.uniform(3.5, 5.0, n), rng.uniform(1.6, 2.0, n), rng.uniform(1.4, 2.2, n)
    return np.stack([x - length / 2, x + length / 2, y - width / 2, y + width / 2,
                     np.zeros(n), height], axis=1)


def _hit_boxes(o, d, boxes):
    """Slab test: distance to the nearest box along each ray (inf where none)."""
    best = np.full(len(d), np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = 1.0 / d
        for b in boxes:
            t1 = (b[0::2] - o) * inv  # (R, 3): entry planes
            t2 = (b[1::2] - o) * inv  # exit planes
            tmin = np.nanmax(np.minimum(t1, t2), axis=1)
            tmax = np.nanmin(np.maximum(t1, t2), axis=1)
            hit = (tmax >= tmin) & (tmin > 0)
            best = np.where(hit & (tmin < best), tmin, best)
    return best


def _hit_poles(o, d, poles, radius=0.15, height=6.0):
    """Distance to vertical cylinders (poles) of the given radius and height."""
    best = np.full(len(d), np.inf)
    a = d[:, 0] ** 2 + d[:, 1] ** 2
    for px, py in poles:
        ox, oy = o[0] - px, o[1] - py
        b = 2 * (ox * d[:, 0] + oy * d[:, 1])
        c = ox * ox + oy * oy - radius * radius
        disc = b * b - 4 * a * c
        with np.errstate(invalid="ignore", divide="ignore"):
            t = (-b - np.sqrt(disc)) / (2 * a)
        z = o[2] + t * d[:, 2]
        ok = (disc >= 0) & (t > 0) & (z >= 0) & (z <= height)
        best = np.where(ok & (t < best), t, best)
    return best


def lidar_scene(n_azimuth: int = 1600, seed: int = 0):
    """Return ``(points, intensity)``: float32 (N, 3) in metres and float32 (N,).

    With the defaults about 100k points. Deterministic for a given seed.
    """
    rng = np.random.default_rng(seed)
    elev = np.deg2rad(np.linspace(-24.8, 2.0, 64))
    azim = np.linspace(-np.pi, np.pi, n_azimuth, endpoint=False)
    el, az = np.meshgrid(elev, azim, indexing="ij")
    d = np.stack([np.cos(el) * np.cos(az), np.cos(el) * np.sin(az), np.sin(el)], -1).reshape(-1, 3)
    o = np.array([0.0, 0.0, SENSOR_HEIGHT])

    with np.errstate(divide="ignore", invalid="ignore"):
        t_ground = np.where(d[:, 2] < 0, -SENSOR_HEIGHT / d[:, 2], np.inf)
        # Two facades along the street, y = -9 and y = +11, 12 m tall, with gaps.
        t_wall = np.full(len(d), np.inf)
        for y0 in (-9.0, 11.0):
            t = (y0 - o[1]) / d[:, 1]
            x = o[0] + t * d[:, 0]
            z = o[2] + t * d[:, 2]
            ok = (t > 0) & (z <= 12.0) & (np.abs(x) < 70) & (np.mod(x, 17.0) > 2.0)
            t_wall = np.where(ok & (t < t_wall), t, t_wall)
    t_box = _hit_boxes(o, d, _boxes(rng, 14))
    poles = np.stack([np.arange(-60, 61, 12.0), np.tile([-6.5, 7.0], 6)[:11]], axis=1)
    t_pole = _hit_poles(o, d, poles)

    ts = np.stack([t_ground, t_wall, t_box, t_pole], axis=1)
    surface = np.argmin(ts, axis=1)
    t = ts[np.arange(len(d)), surface]
    keep = np.isfinite(t) & (t < MAX_RANGE)
    t, d, surface = t[keep], d[keep], surface[keep]
    t = t + rng.normal(0.0, 0.01, len(t))  # ~1 cm range noise, like a real sensor
    pts = o + d * t[:, None]
    base = np.array([0.25, 0.45, 0.7, 0.55])[surface]  # a remission per material
    intensity = np.clip(base + rng.normal(0, 0.05, len(t)), 0, 1)
    return pts.astype(np.float32), intensity.astype(np.float32)

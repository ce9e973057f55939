"""Augmentation (numba_sc.train.augment): each function against an independent reference
(a per-point loop or another formula, redoing the documented draws from a copy of the
generator), inputs never modified, float32 kept, results reproducible from the seed, and
the random choices distributed as documented."""
import cmath
import math
from functools import partial

import numpy as np
import pytest

from numba_sc.train import augment as A

from conftest import crop, load_scan


@pytest.fixture(scope="module")
def points():
    """About 400 points of the real scan: x, y, z, remission, float32."""
    return crop(load_scan("semantickitti"), 400, seed=3)


def rngs(seed):
    """Two generators in the same state: one for the function, one for the reference."""
    return np.random.default_rng(seed), np.random.default_rng(seed)


# ------------------------------------------------------------------ references
def rotate_ref(points, rng, max_angle=math.pi):
    """Per point, as a complex multiplication (x + iy) e^{it}: no rotation matrix."""
    t = rng.uniform(-max_angle, max_angle)
    out = np.array(points, dtype=np.float64)
    turn = cmath.exp(1j * t)
    for p in out:
        w = complex(p[0], p[1]) * turn
        p[0], p[1] = w.real, w.imag
    return out


def flip_ref(points, rng, axes=(0, 1)):
    draws = [rng.random() for _ in axes]  # one by one, rather than one array
    out = np.array(points, dtype=np.float64)
    for p in out:
        for ax, u in zip(axes, draws):
            if u < 0.5:
                p[ax] = 0.0 - p[ax]
    return out


def scale_ref(points, rng, low=0.95, high=1.05):
    s = low + (high - low) * rng.random()  # Generator.uniform is low + (high - low) * random()
    out = np.array(points, dtype=np.float64)
    for p in out:
        for a in range(3):
            p[a] *= s
    return out


def jitter_ref(points, rng, sigma=0.01, clip=0.05):
    noise = rng.normal(0.0, sigma, (len(points), 3))
    out = np.array(points, dtype=np.float64)
    for i, p in enumerate(out):
        for a in range(3):
            p[a] += min(max(noise[i, a], -clip), clip)
    return out


def crop_ref(points, rng, size):
    """The kept indices, one point at a time."""
    c = points[rng.integers(len(points))]
    half = [s / 2 for s in (size if np.ndim(size) else (size, size))]
    return [i for i, p in enumerate(points)
            if all(abs(float(p[a]) - float(c[a])) <= half[a] for a in range(len(half)))]


CASES = {  # name -> (function, reference, keyword arguments)
    "rotate_z": (A.rotate_z, rotate_ref, {}),
    "rotate_z small": (A.rotate_z, rotate_ref, {"max_angle": 0.3}),
    "flip": (A.flip, flip_ref, {}),
    "flip z x": (A.flip, flip_ref, {"axes": (2, 0)}),
    "scale": (A.scale, scale_ref, {"low": 0.8, "high": 1.25}),
    "jitter": (A.jitter, jitter_ref, {"sigma": 0.03, "clip": 0.04}),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("seed", [0, 1, 7, 12])
def test_against_reference(points, case, seed):
    fn, ref, kw = CASES[case]
    r1, r2 = rngs(seed)
    got = fn(points, r1, **kw)
    want = ref(points, r2, **kw)
    assert got.dtype == np.float32 and got.shape == points.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    assert r1.random() == r2.random()  # both drew the same numbers: the generators agree afterwards


@pytest.mark.parametrize("seed", [0, 5])
def test_crop_against_reference(points, seed):
    labels = np.arange(len(points), dtype=np.uint32) * 7
    for size in (2.0, (3.0, 1.0), (2.0, 2.0, 0.5)):
        r1, r2, r3 = np.random.default_rng(seed), np.random.default_rng(seed), np.random.default_rng(seed)
        keep = crop_ref(points, r2, size)
        idx = A.crop(points, labels, r1, size, return_indices=True)
        p, lab = A.crop(points, labels, r3, size)
        assert idx.tolist() == keep and 0 < len(keep) < len(points)
        np.testing.assert_array_equal(p, points[keep])
        np.testing.assert_array_equal(lab, labels[keep])
        assert p.dtype == np.float32
    p, lab = A.crop(points, None, np.random.default_rng(0), 1.0)
    assert lab is None and len(p) >= 1


def test_crop_boxes_the_right_axes():
    """A scalar size boxes x and y only (every height kept); a 3-size boxes z too."""
    p = np.array([[0, 0, 0], [0, 0, 50], [0.9, 0, 0], [0, 0.9, 0], [1.1, 0, 0], [0, -1.1, 0]], np.float32)
    assert np.random.default_rng(11).integers(len(p)) == 0  # this seed centres the box on the origin
    assert A.crop(p, None, np.random.default_rng(11), 2.0, return_indices=True).tolist() == [0, 1, 2, 3]
    assert A.crop(p, None, np.random.default_rng(11), (2.0, 2.0, 2.0), return_indices=True).tolist() == [0, 2, 3]
    assert A.crop(p, None, np.random.default_rng(11), (4.0, 1.0), return_indices=True).tolist() == [0, 1, 2, 4]


def test_rotation_turns_counter_clockwise_about_z(points):
    """Independent of the draw protocol: every point turns by the same angle about the z
    axis, distances to the axis, heights and remission are kept."""
    out = A.rotate_z(points, np.random.default_rng(4), max_angle=1.0)
    p, q = points.astype(np.float64), out.astype(np.float64)
    np.testing.assert_allclose(np.hypot(q[:, 0], q[:, 1]), np.hypot(p[:, 0], p[:, 1]), rtol=1e-5)
    np.testing.assert_array_equal(out[:, 2:], points[:, 2:])
    turn = np.angle((q[:, 0] + 1j * q[:, 1]) / (p[:, 0] + 1j * p[:, 1]))
    assert np.ptp(turn) < 1e-4 and 0 < abs(turn[0]) <= 1.0
    t = np.random.default_rng(4).uniform(-1.0, 1.0)
    assert turn[0] == pytest.approx(t, abs=1e-5)  # positive t: counter-clockwise seen from above


def test_quarter_turn_by_hand():
    """max_angle = low = high: a quarter turn takes x to y and y to -x."""

    class Fixed:
        def uniform(self, lo, hi):
            return math.pi / 2

    out = A.rotate_z(np.array([[1, 0, 5, 0.3], [0, 2, 5, 0.4]], np.float32), Fixed())
    np.testing.assert_allclose(out, [[0, 1, 5, 0.3], [-2, 0, 5, 0.4]], atol=1e-6)


@pytest.mark.parametrize("fn", [A.rotate_z, A.flip, A.scale, A.jitter,
                                lambda p, r: A.crop(p, np.zeros(len(p), np.uint32), r, 0.5)[0],
                                A.compose(A.rotate_z, A.flip, A.scale, A.jitter)])
def test_inputs_unchanged_outputs_new_and_reproducible(points, fn):
    before = points.copy()
    a = fn(points, np.random.default_rng(11))
    b = fn(points, np.random.default_rng(11))
    c = fn(points, np.random.default_rng(12))
    np.testing.assert_array_equal(points, before)
    assert not np.shares_memory(a, points) and a.dtype == np.float32
    np.testing.assert_array_equal(a, b)
    assert a.shape != c.shape or not np.array_equal(a, c)


def test_float64_stays_float64(points):
    p64 = points.astype(np.float64)
    assert A.rotate_z(p64, np.random.default_rng(0)).dtype == np.float64
    assert A.jitter(p64, np.random.default_rng(0)).dtype == np.float64


def test_compose_applies_in_order(points):
    aug = A.compose(partial(A.rotate_z, max_angle=0.5), A.flip, partial(A.scale, low=0.5, high=2.0))
    r1, r2 = rngs(3)
    want = A.scale(A.flip(A.rotate_z(points, r2, max_angle=0.5), r2), r2, low=0.5, high=2.0)
    np.testing.assert_array_equal(aug(points, r1), want)
    swapped = A.compose(A.flip, partial(A.rotate_z, max_angle=0.5), partial(A.scale, low=0.5, high=2.0))
    assert not np.array_equal(swapped(points, np.random.default_rng(3)), want)
    with pytest.raises(TypeError, match="compose takes functions"):
        A.compose(A.flip, 3)


def test_flips_happen_half_the_time_and_independently():
    p = np.ones((1, 3), np.float32)
    rng = np.random.default_rng(2024)
    n = 4000
    flipped = np.array([A.flip(p, rng)[0, :3] < 0 for _ in range(n)])
    rate = flipped.mean(axis=0)
    # binomial standard error sqrt(.25 / 4000) = 0.008: 0.04 is five of them
    assert abs(rate[0] - 0.5) < 0.04 and abs(rate[1] - 0.5) < 0.04 and rate[2] == 0
    assert abs((flipped[:, 0] & flipped[:, 1]).mean() - 0.25) < 0.04


def test_random_parameters_cover_their_ranges():
    rng = np.random.default_rng(7)
    p = np.array([[1, 0, 0]], np.float32)
    angles = np.array([math.atan2(*A.rotate_z(p, rng, max_angle=2.0)[0, 1::-1]) for _ in range(2000)])
    assert angles.min() >= -2.0 - 1e-6 and angles.max() <= 2.0 + 1e-6
    assert angles.min() < -1.9 and angles.max() > 1.9 and abs(angles.mean()) < 0.1
    s = np.array([A.scale(p, rng, 0.9, 1.1)[0, 0] for _ in range(2000)])
    assert 0.9 - 1e-6 <= s.min() < 0.91 and 1.09 < s.max() <= 1.1 + 1e-6
    noise = A.jitter(np.zeros((20000, 4), np.float32), rng, sigma=0.01, clip=0.03)
    assert np.abs(noise[:, :3]).max() <= 0.03 + 1e-7 and noise[:, 3].max() == 0
    assert noise[:, :3].std() == pytest.approx(0.01, rel=0.05)  # 3 sigma clip barely changes it


def test_bad_arguments_are_refused(points):
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=r"\(N, 3 \+ C\)"):
        A.rotate_z(points[:, :2], rng)
    with pytest.raises(TypeError, match="float"):
        A.flip(points.astype(np.int32), rng)
    with pytest.raises(ValueError, match="axes"):
        A.flip(points, rng, axes=(0, 3))
    with pytest.raises(ValueError, match="low <= high"):
        A.scale(points, rng, low=1.1, high=0.9)
    with pytest.raises(ValueError, match="clip"):
        A.jitter(points, rng, clip=0)
    with pytest.raises(ValueError, match="size"):
        A.crop(points, None, rng, (1, 2, 3, 4))
    with pytest.raises(ValueError, match="one label per point"):
        A.crop(points, np.zeros(3), rng, 1.0)

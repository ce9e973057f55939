"""The synthetic LiDAR scene (numba_sc.tools.synthetic): deterministic per seed, points
where a sensor 1.73 m up on a street can see them, a ground that is flat, and the
size the demo expects."""
import numpy as np

from numba_sc.tools.synthetic import MAX_RANGE, SENSOR_HEIGHT, lidar_scene


def test_the_scene_is_deterministic_and_sized():
    pts, inten = lidar_scene(n_azimuth=200, seed=3)
    again, inten2 = lidar_scene(n_azimuth=200, seed=3)
    assert np.array_equal(pts, again) and np.array_equal(inten, inten2)
    other, _ = lidar_scene(n_azimuth=200, seed=4)
    assert len(other) != len(pts) or not np.array_equal(other, pts)
    assert pts.dtype == np.float32 and inten.dtype == np.float32 and pts.shape == (len(inten), 3)
    assert 0.5 * 64 * 200 < len(pts) <= 64 * 200  # most of the 64 x 200 rays hit something


def test_points_lie_where_the_sensor_sees():
    pts, inten = lidar_scene(n_azimuth=400, seed=0)
    rng_ = np.linalg.norm(pts - [0, 0, SENSOR_HEIGHT], axis=1)
    assert rng_.max() < MAX_RANGE + 0.1 and pts[:, 2].min() > -0.1  # nothing beyond range or below the street
    assert pts[:, 2].max() <= 12.1  # the facades are 12 m tall
    assert inten.min() >= 0 and inten.max() <= 1
    ground = np.abs(pts[:, 2]) < 0.05
    assert ground.mean() > 0.3  # the lower beams hit the street, flat at z = 0 (1 cm noise)
    assert np.abs(pts[ground, 2]).std() < 0.03

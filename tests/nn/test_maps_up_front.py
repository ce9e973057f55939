"""numba_sc.nn.maps_up_front: a network's maps built before its first layer are the maps
its layers would have built, and the forward pass then builds none."""
import numpy as np
import numba_sc as ns
from numba_sc import nn
from numba_sc.conv import prepare
from numba_sc.nn import maps_up_front as mu

from helpers import host, scan_crop


def _net(rng):
    """Two levels down and back up, submanifold layers on each level, kernels of 2 and 3."""
    d1 = nn.SparseConv3d(4, 6, 2, stride=2, rng=rng)
    d2 = nn.SparseConv3d(6, 6, 3, stride=2, rng=rng)
    return nn.Sequential(nn.SubMConv3d(4, 4, 3, rng=rng), d1, nn.SubMConv3d(6, 6, 3, rng=rng), d2,
                         nn.SubMConv3d(6, 6, 3, dilation=2, rng=rng), nn.SparseInverseConv3d(6, 6, 3, inverts=d2, rng=rng),
                         nn.SparseInverseConv3d(6, 4, 2, inverts=d1, rng=rng))


def _same_maps(a, b):
    """Every map of two coordinate-set trees equal: keys, coordinates, tables, counts."""
    assert sorted(a.subm) == sorted(b.subm) and sorted(a.down) == sorted(b.down)
    for key in a.subm:
        ka, kb = a.subm[key], b.subm[key]
        np.testing.assert_array_equal(host(ka.table), host(kb.table))
        np.testing.assert_array_equal(ka.host_counts(), kb.host_counts())
    for key in a.down:
        (ka, ca), (kb, cb) = a.down[key], b.down[key]
        np.testing.assert_array_equal(host(ka.out_coords), host(kb.out_coords))
        np.testing.assert_array_equal(host(ka.table), host(kb.table))
        np.testing.assert_array_equal(ka.host_counts(), kb.host_counts())
        assert cb.up[key][0] is kb  # the transposed layer finds the map it reads backwards
        _same_maps(ca, cb)


def test_maps_up_front_equal_the_layers_maps(rng, monkeypatch):
    x = scan_crop(45)
    # two clouds in one batch: the batch column rides through every level
    c = np.concatenate([np.column_stack([np.zeros(len(x), np.int32), x.coords]),
                        np.column_stack([np.ones(len(x), np.int32), x.coords[::-1] + 3])])
    x = ns.SparseTensor(c, np.concatenate([x.features, x.features[::-1]]))
    net = _net(rng)
    lazy = x.without_maps()
    want = net(lazy, backend="cuda")  # the first pass: the layers build their maps; the plan is recorded
    plan = net._map_plans[mu.plan_key(x)]
    assert len(plan) == 5  # a submanifold map on each of the 3 levels (the last dilated), 2 strided maps
    up = x.without_maps()

    def no_build(*a, **k):
        raise AssertionError("a layer built a map although every map was built up front")

    monkeypatch.setattr(prepare, "build_kernel_map", no_build)
    got = net(up, backend="cuda")
    _same_maps(lazy.maps, up.maps)
    np.testing.assert_array_equal(host(got.coords), host(want.coords))
    np.testing.assert_allclose(host(got.features), host(want.features), rtol=1e-6, atol=1e-6)


def test_plan_records_the_tree_of_coordinate_sets(rng):
    x = scan_crop(50)
    net = _net(rng)
    net(x.without_maps(), backend="cuda")
    plan = net._map_plans[mu.plan_key(x)]
    (k1, p1), = plan.down
    assert k1 == ((2, 2, 2), (2, 2, 2), (1, 1, 1)) and plan.subm == (((3, 3, 3), (1, 1, 1)),)
    (k2, p2), = p1.down
    assert k2 == ((3, 3, 3), (2, 2, 2), (1, 1, 1))
    assert p2.subm == (((3, 3, 3), (2, 2, 2)),) and p2.down == ()
    # a tensor whose maps exist already is left alone; the reference backend records nothing
    y = x.without_maps()
    net(y, backend="cuda")
    maps = dict(y.maps.subm)
    mu.before_forward(net, y, "cuda")
    assert dict(y.maps.subm) == maps
    other = _net(rng)
    other(x.without_maps(), backend="reference")
    assert "_map_plans" not in other.__dict__
    other.maps_up_front = False  # switched off: the layers build their maps, nothing is recorded
    z = x.without_maps()
    other(z, backend="cuda")
    assert "_map_plans" not in other.__dict__ and z.maps.subm


def test_up_front_only_where_it_saves_reads(rng, monkeypatch):
    """A lone layer, or a submanifold and a strided layer, read the device once a map:
    up front they would read as often (or more), so they build their own maps."""
    one = mu.MapPlan((((3, 3, 3), (1, 1, 1)),), ())
    two_subm = mu.MapPlan((((3, 3, 3), (1, 1, 1)), ((3, 3, 3), (2, 2, 2))), ())
    subm_and_strided = mu.MapPlan((((3, 3, 3), (1, 1, 1)),), ((((2, 2, 2), (2, 2, 2), (1, 1, 1)), mu.MapPlan((), ())),))
    assert [mu.saves_reads(p) for p in (one, two_subm, subm_and_strided)] == [False, True, False]
    layer = ns.nn.SparseConv3d(4, 8, 3, rng=rng)
    x = scan_crop(40)
    layer(x.without_maps(), backend="cuda")
    built = []
    monkeypatch.setattr(mu, "build_maps", lambda plan, x: built.append(plan))
    y = layer(x.without_maps(), backend="cuda")
    assert built == [] and y.features.shape == (len(x.coords), 8)

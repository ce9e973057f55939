"""Oracles and builders that several test files share, imported as a plain module
(``from helpers import oracle``): tests/ is on sys.path through conftest.py.

* the convolution: a float64 oracle by dictionary look-ups, the expected
  coordinates of a strided layer, random clouds, tensors and weights, and the
  relative-error check with its tolerances;
* the Map step: an oracle map from the definition alone (``np.unique`` rows,
  ``itertools.product`` offsets, a dict or ``searchsorted`` for the look-ups);
* the networks: a crop of SemanticKITTI as a tensor, random BatchNorm statistics.

Nothing of the package but ``kernel_offsets`` (the documented weight order) is
used by the oracles.
"""
import itertools

import numpy as np

import numba_sc as ns
from numba_sc import SparseTensor, nn
from numba_sc.core.backend import to_host

from conftest import crop, load_scan


# ------------------------------------------------------------ the convolution
# Tolerances: float32 results must match the oracle to 1e-5 of the result's norm
# (fp32 rounding of sums of ~27 products); float16 (features, weights, buffers,
# output in half precision; sums in fp32) to 5e-3 of the norm: half precision keeps
# 11 significant bits (unit roundoff 4.9e-4), and a partial result is rounded in
# the output buffer and again at the end.
RTOL32 = 1e-5
RTOL16 = 5e-3


def oracle(in_coords, in_feats, out_coords, weight, offsets):
    """float64 ``out[q] = sum_k in[q + offsets[k]] @ W[k]`` by dictionary lookups.

    Coordinates may carry a batch column (N, 4): offsets move x, y, z only.
    """
    s = in_coords.shape[1] - 3
    where = {tuple(c): j for j, c in enumerate(np.asarray(in_coords).tolist())}
    f = np.asarray(in_feats, dtype=np.float64)
    w = np.asarray(weight, dtype=np.float64)
    out = np.zeros((len(out_coords), w.shape[2]))
    pairs = [([], []) for _ in offsets]
    for i, q in enumerate(np.asarray(out_coords).tolist()):
        for k, d in enumerate(np.asarray(offsets).tolist()):
            p = tuple(q[:s]) + (q[s] + d[0], q[s + 1] + d[1], q[s + 2] + d[2])
            j = where.get(p)
            if j is not None:
                pairs[k][0].append(i)
                pairs[k][1].append(j)
    for k, (ii, jj) in enumerate(pairs):  # the arithmetic vectorized, per offset
        if ii:
            np.add.at(out, np.array(ii), f[np.array(jj)] @ w[k])
    return out


def downsampled(coords, st):
    """Expected output coordinates of a strided layer: floor(P / st) * st, unique, sorted."""
    c = np.array(coords, dtype=np.int64)
    s = c.shape[1] - 3
    c[:, s:] = np.floor_divide(c[:, s:], st) * st
    return np.unique(c, axis=0).astype(np.int32)  # np.unique sorts rows lexicographically


def rel_err(got, want):
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def assert_close(got, want, rtol=RTOL32):
    assert got.shape == want.shape
    err = rel_err(got, want)
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


def cloud(rng, n, extent=8, batch=0):
    """About n unique random voxels in an extent^3 box (batch > 0: (N, 4) coords)."""
    c = rng.integers(0, extent, size=(n, 3))
    if batch:
        c = np.concatenate([rng.integers(0, batch, size=(n, 1)), c], axis=1)
    c = np.unique(c, axis=0)
    return c[rng.permutation(len(c))].astype(np.int32)  # unsorted, as a user may pass


def tensor(rng, n, c_in, extent=8, batch=0, dtype=np.float32):
    c = cloud(rng, n, extent, batch)
    return SparseTensor(c, rng.standard_normal((len(c), c_in)).astype(dtype))


def weights(rng, K, c_in, c_out, dtype=np.float32):
    return (rng.standard_normal((K, c_in, c_out)) / np.sqrt(c_in)).astype(dtype)


# ------------------------------------------------------------- the Map step
def oracle_offsets(kernel_size, dilation=1, tensor_stride=1):
    ks, dil, ts = (np.broadcast_to(np.asarray(v), (3,)).tolist() for v in (kernel_size, dilation, tensor_stride))
    axes = []
    for k, d, t in zip(ks, dil, ts):
        first = -((k - 1) // 2) if k % 2 else -(k // 2) + 1
        axes.append([(first + a) * d * t for a in range(k)])
    return sorted(itertools.product(*axes))


def oracle_outputs(in_coords, stride, tensor_stride):
    s = in_coords.shape[1] - 3
    st_ = np.broadcast_to(np.asarray(stride), (3,)) * np.broadcast_to(np.asarray(tensor_stride), (3,))
    if (np.broadcast_to(np.asarray(stride), (3,)) == 1).all():
        return np.unique(in_coords, axis=0)
    q = in_coords.astype(np.int64).copy()
    q[:, s:] = np.floor(q[:, s:] / st_).astype(np.int64) * st_
    return np.unique(q, axis=0)


def oracle_map(in_coords, kernel_size=3, stride=1, dilation=1, tensor_stride=1, out_coords=None):
    """(sorted inputs, sorted outputs, offsets, table) by dictionary look-ups."""
    s = in_coords.shape[1] - 3
    ins = np.unique(in_coords, axis=0)
    outs = oracle_outputs(in_coords, stride, tensor_stride) if out_coords is None else np.unique(out_coords, axis=0)
    index = {tuple(r): i for i, r in enumerate(ins.tolist())}
    offs = oracle_offsets(kernel_size, dilation, tensor_stride)
    table = np.full((len(offs), len(outs)), -1, np.int64)
    out_rows = outs.tolist()
    for k, d in enumerate(offs):
        dd = (0,) * s + tuple(d)
        for i, r in enumerate(out_rows):
            table[k, i] = index.get(tuple(a + b for a, b in zip(r, dd)), -1)
    return ins, outs, np.array(offs), table


def searchsorted_oracle_table(ins, outs, offs):
    """The table for big clouds: this file's own key, x, y, z each shifted by 2^19."""
    def key(c):
        c = c.astype(np.int64) + (1 << 19)
        return (c[:, 0] << 40) | (c[:, 1] << 20) | c[:, 2]
    src = key(ins)
    assert np.all(np.diff(src) > 0)
    table = np.full((len(offs), len(outs)), -1, np.int64)
    for k, d in enumerate(offs):
        q = key(outs + np.asarray(d))
        pos = np.minimum(np.searchsorted(src, q), len(src) - 1)
        table[k] = np.where(src[pos] == q, pos, -1)
    return table


def assert_matches_oracle(m, caller_coords, oracle):
    ins, outs, offs, table = oracle
    assert m.in_coords.dtype == np.int32 and m.out_coords.dtype == np.int32
    assert m.table.dtype == np.int32 and m.table.shape == (len(offs), len(outs))
    assert np.array_equal(m.in_coords, ins)
    assert np.array_equal(m.in_coords, caller_coords[m.in_order])
    assert np.array_equal(m.out_coords, outs)
    assert np.array_equal(m.offsets, offs)
    assert np.array_equal(m.table, table)
    assert np.array_equal(m.counts, (table >= 0).sum(axis=1))


def assert_same_map(a, b):
    for name in ("in_coords", "out_coords", "in_order", "out_order", "offsets", "table", "counts"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    for name in ("kernel_size", "stride", "dilation", "tensor_stride", "out_tensor_stride", "is_transposed"):
        assert getattr(a, name) == getattr(b, name), name


def random_coords(rng, n, span=9, batch=0, multiple=1):
    c = rng.integers(-span, span, size=(n, 3)) * multiple
    if batch:
        c = np.column_stack([rng.integers(0, batch, n), c])
    c = np.unique(c, axis=0).astype(np.int32)
    return c[rng.permutation(len(c))]  # the caller's order is arbitrary


# ------------------------------------------------------------- the networks
def small_tensor(rng, n, c, dtype=np.float32, span=5):
    """A tensor on about n unique random voxels in [-span, span)^3, c standard normal channels."""
    coords = np.unique(random_coords(rng, n, span=span), axis=0)
    return SparseTensor(coords, rng.standard_normal((len(coords), c)).astype(dtype))


def layer_weight(rng, k, cin, cout, dtype):
    """A (k, cin, cout) weight, standard normal / 3, of ``dtype``."""
    return (rng.standard_normal((k, cin, cout)) / 3).astype(dtype)


def host(a):
    return np.asarray(to_host(a))


def scan_crop(n=160, voxel=0.05, seed=0):
    """A SparseTensor of about n voxels from a crop of SemanticKITTI (4 features)."""
    pts = crop(load_scan("semantickitti"), 4 * n, seed)
    v = ns.voxelize(np.ascontiguousarray(pts[:, :3]), voxel, features=np.ascontiguousarray(pts[:, :4]),
                    backend="reference")
    return ns.SparseTensor(v.coords, v.features.astype(np.float32))


def random_bn(model, rng):
    """BatchNorm parameters and statistics drawn at random (not the identity), so a
    channel mix-up or a missing layer shows."""
    for bn in model.modules(nn.BatchNorm):
        c = bn.num_features
        bn.weight = rng.uniform(0.5, 1.5, c).astype(np.float32)
        bn.bias = rng.uniform(-0.2, 0.2, c).astype(np.float32)
        bn.running_mean = rng.uniform(-0.2, 0.2, c).astype(np.float32)
        bn.running_var = rng.uniform(0.5, 2.0, c).astype(np.float32)
    if hasattr(model, "classifier"):
        model.classifier.bias = rng.uniform(-0.1, 0.1, model.classifier.out_features).astype(np.float32)


def check_case(call, expected):
    """One line of an edge table (tests/test_edges*.py): ``expected`` is ``(exception class,
    regex of its message)`` that ``call()`` must raise, or a function of ``call()``'s result
    that must be true."""
    import pytest

    if isinstance(expected, tuple):
        with pytest.raises(expected[0], match=expected[1]):
            call()
    else:
        assert expected(call())


class Stopped(Exception):
    """Stands for a run stopped (killed, crashed) right after a checkpoint was written."""


def write_labelled_crops(root, count, spacing, size):
    """``count`` crops of the shared SemanticKITTI scan written to ``root`` as
    ``crop{i}.bin`` / ``crop{i}.label``: the ``size`` points nearest (in the max norm)
    the ``i * spacing``-th labelled point, a folder of scans for the training tests."""
    from numba_sc.train.labels import IGNORE_INDEX, learning_map

    from conftest import DATA_DIR

    points = load_scan("semantickitti")
    raw = np.fromfile(DATA_DIR / "semantickitti_000000.label", np.uint32)
    labelled = np.flatnonzero(learning_map(raw) != IGNORE_INDEX)
    for i in range(count):
        centre = points[labelled[i * spacing], :3]
        keep = np.argsort(np.abs(points[:, :3] - centre).max(axis=1), kind="stable")[:size]
        points[keep].tofile(root / f"crop{i}.bin")
        raw[keep].tofile(root / f"crop{i}.label")
    return root


def stop_after_first_checkpoint(main, argv, monkeypatch):
    """Run the command line ``main(argv)`` (``numba-sc train ... --save``) until it has
    written its first checkpoint, and stop it there, as a kill would: what a later
    ``--resume`` starts from."""
    import pytest

    from numba_sc.train import run

    save = run.save

    def save_then_stop(state, path):
        save(state, path)
        raise Stopped

    monkeypatch.setattr(run, "save", save_then_stop)
    try:
        with pytest.raises(Stopped):
            main(argv)
    finally:
        monkeypatch.undo()

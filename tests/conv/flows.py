"""What the dataflow tests of conv/ share: small random clouds and weights, the closeness
a dataflow must reach, four layers of every kind, and a spy on which dataflow ran."""
import numpy as np

import numba_sc as ns
from numba_sc.conv import layer

from helpers import layer_weight, small_tensor  # noqa: F401 (flows' users import them from here)

FLOWS = ("gmas", "fetch", "implicit")


def assert_flow_close(got, want, dtype):
    scale = max(float(np.abs(want.astype(np.float32)).max()), 1.0)
    tol = 2e-5 if np.dtype(dtype) == np.float32 else 4e-3
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=tol * scale, rtol=0)


def four_layers(x, ws, backend, flow):
    """A submanifold 3x3x3, a strided 2x2x2, the transposed layer that inverts it, a 1x1x1."""
    w3, w2, wt, w1 = ws
    sub = ns.sparse_conv3d(x, w3, backend=backend, dataflow=flow)
    down = ns.sparse_conv3d(x, w2, kernel_size=2, stride=2, backend=backend, dataflow=flow)
    up = ns.sparse_conv3d(down, wt, transposed=True, kernel_map=down.kernel_map, backend=backend, dataflow=flow)
    one = ns.sparse_conv3d(x, w1, kernel_size=1, backend=backend, dataflow=flow)
    return sub, down, up, one


def spy_dataflows(monkeypatch):
    """The dataflows other than gmas that run, in order (gmas runs when none does)."""
    ran = []
    real = layer.fetch_or_implicit
    monkeypatch.setattr(layer, "fetch_or_implicit", lambda flow, *a: ran.append(flow) or real(flow, *a))
    return ran

"""A bounded workspace: one layer's gather-GEMM-scatter in windows of buffer rows.

The GMaS dataflow (paper Figure 6) gives every pair of a layer a row in two
buffers: the input buffer (``rows x C_in``, written by the gather) and the output
buffer (``rows x C_out``, read by the scatter). Their size
grows with the pairs *and* the channels, and it is the peak of a forward pass on
a large cloud. On 1M random voxels in 400^3 the coarse levels of MinkUNet42 are
dense (about 15 pairs a voxel outside the centre at 128-256 channels), so one
layer's two buffers take several gigabytes, where spconv's fused implicit GEMM
holds none.

Nothing forces the buffers to hold every row at once. The rows are laid out
group by group (:mod:`numba_sc.gmas.gemm_grouping`), and every stage can work on
a *window* of them, ``lo .. hi - 1``:

* the gather writes only the rows of the window (:func:`numba_sc.gmas.gather.gather_cuda`,
  ``window=``), into a buffer of ``hi - lo`` rows;
* the GEMMs whose rows lie in the window run on it (a group too tall for a
  window is split: by its members, or one member's rows into pieces; rows of
  a GEMM are independent, so any split gives the same products);
* the scatter adds the window's rows into the output, which holds the sum of
  the windows before (``lo=``; the first window starts from the centre product
  or from zeros).

So a layer run in windows takes ``ceil(rows / window)`` rounds, each reusing
buffers of at most :func:`workspace_bytes` together. The price: every round
launches the three stages again and reads the point lists and the output once
more, which on a layer of a few thousand points is host time, so a layer whose
buffers fit runs in one window, exactly as before. A split changes the order of the additions
of an output (window by window, each in offset order), so a layer run in
windows agrees with one run whole to float rounding, not bit for bit.

The training step uses the same windows: the input gradient is a forward pass
of the transposed layer, and the weight gradient (:mod:`numba_sc.conv.gradient`)
gathers both of its buffers window by window, adding the products of a split
member into the same slot (cuBLAS's ``beta = 1``).

A layer given its map runs by ranges of its outputs instead, wherever they fit
and pay (:mod:`numba_sc.gmas.output_ranges`: each output written once, no running
sums; :func:`~numba_sc.gmas.output_ranges.ranges_pay`: outputs whose sums are too
big to read again cheaply); the windows serve the rest (sums that stay about in
the L2 cache, a bound below one chunk's pairs and their padding, a layer called
without its map) and the weight gradient, which has no scatter.

Worked example: a layer of 1,000 buffer rows, 64 -> 64 channels, fp32, whose
rows cost ``4 * 64 + 4 * 64 = 512`` bytes, in a workspace of 200 KiB (400 rows):
:func:`windows` gives rows 0-399, 400-799 and 800-999, three rounds of
gather, GEMMs and scatter, and the buffers never hold more than 400 rows.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..core.state import remember
from .gemm_grouping import Group

ENV = "NUMBA_SC_WORKSPACE_MB"  # the environment's workspace, in MiB ("0": unbounded)
DEFAULT_BYTES = 1 << 30  # 1 GiB: no layer of a scan comes near it; the 1M cloud's dense levels do

_CHOICE = remember({})  # set_workspace's choice, {"bytes": int or None}; cleared: the default again


def set_workspace(nbytes) -> None:
    """Bound the buffers of one layer's gather-GEMM-scatter to ``nbytes`` bytes
    (an int >= 1; ``None``: back to the default, :data:`ENV` or :data:`DEFAULT_BYTES`;
    ``0``: unbounded, every layer in one window). ``numba_sc.clear_caches()`` forgets
    the choice."""
    if nbytes is None:
        _CHOICE.clear()
        return
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be a whole number of bytes >= 0 (0: unbounded) or None, got {nbytes!r}")
    _CHOICE["bytes"] = nbytes


def workspace_bytes() -> int:
    """The bound in bytes (0: unbounded): :func:`set_workspace`'s choice, else the
    environment's ``NUMBA_SC_WORKSPACE_MB``, else :data:`DEFAULT_BYTES`."""
    if "bytes" in _CHOICE:
        return _CHOICE["bytes"]
    raw = os.environ.get(ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_BYTES
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(f"{ENV} must be a number of MiB (0: unbounded), got {raw!r}") from None
    if mb < 0:
        raise ValueError(f"{ENV} must be >= 0 MiB (0: unbounded), got {raw!r}")
    return int(mb * (1 << 20))


def window_rows(bytes_per_row: int, nbytes: int | None = None) -> int:
    """Buffer rows that fit the workspace at ``bytes_per_row`` bytes a row (both
    buffers' rows together); 0 when unbounded. At least one row."""
    nbytes = workspace_bytes() if nbytes is None else nbytes
    return 0 if nbytes <= 0 else max(1, nbytes // max(1, bytes_per_row))


@dataclass(frozen=True)
class Gemm:
    """One batched GEMM of a window: ``group`` (its ``start`` relative to the window),
    ``slot``: the buffer-order position of its first member (where the weight
    gradient keeps that member's product), ``accumulate``: the GEMM adds to that
    product (a later piece of a member split by rows) instead of writing it."""

    group: Group
    slot: int
    accumulate: bool = False


@dataclass(frozen=True)
class Window:
    """Buffer rows ``lo`` .. ``hi - 1`` and the GEMMs that read them."""

    lo: int
    hi: int
    gemms: tuple

    @property
    def groups(self) -> list:
        """The window's groups, as :func:`numba_sc.gmas.gemm_grouping.grouped_gemm_cuda` takes them."""
        return [g.group for g in self.gemms]


def _pieces(groups, limit):
    """The groups cut into GEMMs of at most ``limit`` rows each, in buffer order:
    ``(members, rows, start, slot, accumulate)`` with absolute starts."""
    slot = 0
    for g in groups:
        if g.padded_rows <= limit:  # whole
            yield g.members, g.rows, g.start, slot, False
        elif g.rows <= limit:  # by members: as many whole members as fit
            per = limit // g.rows
            for i in range(0, len(g.members), per):
                yield g.members[i:i + per], g.rows, g.start + i * g.rows, slot + i, False
        else:  # one member's rows into pieces (a GEMM's rows are independent)
            for i, k in enumerate(g.members):
                first = g.start + i * g.rows
                for lo in range(0, g.rows, limit):
                    yield (k,), min(limit, g.rows - lo), first + lo, slot + i, lo > 0
        slot += len(g.members)


def windows(groups, rows: int, limit: int) -> list:
    """The windows of a plan's buffer (``rows`` rows laid out as ``groups``) at most
    ``limit`` rows tall (``limit <= 0`` or ``rows <= limit``: one window, every group
    whole). Consecutive GEMMs share a window while they fit; a window's rows are
    contiguous, from the first GEMM's start to the last one's end."""
    if limit <= 0 or rows <= limit:
        return [Window(0, rows, tuple(Gemm(g, s) for g, s in zip(groups, _slots(groups))))]
    out, cur, lo = [], [], None
    for members, r, start, slot, acc in _pieces(groups, limit):
        end = start + len(members) * r
        if cur and end - lo > limit:
            out.append(_window(lo, cur))
            cur = []
        if not cur:
            lo = start
        cur.append((members, r, start, slot, acc))
    if cur:
        out.append(_window(lo, cur))
    return out


def _slots(groups):
    s = 0
    for g in groups:
        yield s
        s += len(g.members)


def _window(lo, pieces):
    hi = max(start + len(m) * r for m, r, start, _, _ in pieces)
    return Window(lo, hi, tuple(Gemm(Group(tuple(m), r, start - lo), slot, acc) for m, r, start, slot, acc in pieces))

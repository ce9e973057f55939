"""The library's plan builder: stage 7 as a layer runs it.

:mod:`numba_sc.gmas.metadata` teaches the stage (its reference, its rungs);
this module is what the layer calls, and what it keeps between calls:

* :func:`build_plan`: a layer's :class:`~numba_sc.gmas.layout.GmasPlan` from its
  kernel map, by the NumPy reference or the library's rung (v2,
  :func:`~numba_sc.gmas.metadata.metadata_cuda`), by backend;
* :func:`build_plan_cuda`: that rung with the base rows kept on the device per
  distinct layout (:func:`_device_layout`), so the layers of a network that
  share a kernel map share one copy;
* :func:`grouping_report`: what the grouping of a layer's offsets costs.

Worked example: a 3x3x3 submanifold layer's map (K = 27) gives a plan whose
centre (offset 13) is multiplied directly and whose other 26 offsets lie in the
buffers by pair count, grouped; ``build_plan(km).rows`` is its buffer height.
"""
from __future__ import annotations

from . import gemm_grouping as gg
from .layout import GmasPlan, submanifold_centre
from .metadata import build_plan_reference, copy_layout, metadata_cuda
from ..core.backend import resolve_backend
from ..core.device import device_xp, simulating
from ..core.state import remember

_LAYOUTS = remember({})  # (base values, device) -> (base, buffered bits) on that device


def _device_layout(base):
    """:func:`~numba_sc.gmas.metadata.copy_layout` of ``base``, kept per distinct ``base``.

    On a GPU the pair is kept per distinct ``base`` (K numbers; kernels only read
    it): the layers of a network that share a kernel map share it too, and a
    pinned copy costs far more host time than a dictionary look-up (measured:
    ``docs/performance.md``, "Caches: work done once per layer, not per call").
    """
    key = None if simulating() else (tuple(base.tolist()), device_xp().cuda.runtime.getDevice())
    hit = _LAYOUTS.get(key)
    if hit is None:
        hit = copy_layout(base)
        if key is not None:
            if len(_LAYOUTS) > 256:
                _LAYOUTS.clear()
            _LAYOUTS[key] = hit
    return hit


def build_plan_cuda(kernel_map, sort=True, max_padding=gg.DEFAULT_MAX_PADDING,
                    solo_rows=gg.DEFAULT_SOLO_ROWS, direct_centre=True,
                    threads: int | None = None, launch_rows=0) -> GmasPlan:
    """Device version: :func:`~numba_sc.gmas.metadata.metadata_cuda` (the lists, one
    kernel and no sync), its base rows copied once per layout and device.

    ``threads``: threads per block of the metadata kernels (default
    :func:`~numba_sc.core.conventions.metadata_threads`; the tests vary it).
    """
    return metadata_cuda(kernel_map, sort, max_padding, solo_rows, direct_centre, threads, launch_rows,
                         device_layout=_device_layout)


def build_plan(kernel_map, sort=True, max_padding=gg.DEFAULT_MAX_PADDING,
               solo_rows=gg.DEFAULT_SOLO_ROWS, direct_centre=True, backend=None,
               launch_rows=0) -> GmasPlan:
    """Metadata of one layer from its kernel map (see :mod:`numba_sc.gmas.metadata`).

    ``sort=False`` keeps the map's offset order (to measure what sorting buys);
    ``direct_centre=False`` sends the submanifold centre through the buffers too;
    ``launch_rows``: padding rows a GEMM launch is worth
    (:func:`numba_sc.gmas.gemm_grouping.launch_rows`; 0: the plain padding policy).
    """
    if resolve_backend(backend) == "reference":
        return build_plan_reference(kernel_map, sort, max_padding, solo_rows, direct_centre, launch_rows)
    return build_plan_cuda(kernel_map, sort, max_padding, solo_rows, direct_centre, launch_rows=launch_rows)


def grouping_report(kernel_map, max_padding=gg.DEFAULT_MAX_PADDING,
                    solo_rows=gg.DEFAULT_SOLO_ROWS, direct_centre=True, launch_rows=0) -> dict:
    """Padding overhead and GEMM launches of a layer, offsets sorted vs map order.

    See :func:`numba_sc.gmas.gemm_grouping.padding_report`; the submanifold centre (when
    multiplied directly) is in neither count.
    """
    centre = submanifold_centre(kernel_map) if direct_centre else -1
    return gg.padding_report(kernel_map.host_counts(), centre, max_padding, solo_rows, launch_rows)

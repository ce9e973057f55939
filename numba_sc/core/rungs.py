"""The kernel-ladder protocol: what a stage declares so that its kernels can be checked
and timed rung by rung (``python -m numba_sc ladder``, :mod:`numba_sc.tools.ladder`).

A stage with a ladder ends its module with one declaration, after its kernels and
its reference::

    LADDER = Ladder(
        "gather",                                    # the module's name
        (Rung("v1", lambda w: ..., "Algorithm 1 over the dense input table"),
         Rung("v2", lambda w: ..., "+ per-point lists"), ...),
        workload=_ladder_work,                       # Context -> the arrays the rungs read
        reference=lambda w: gather_reference(...),   # the stage's NumPy reference
        written=...,                                 # rows a kernel writes (None: all)
        bytes_moved=_bytes_moved,                    # work -> the least bytes the stage moves
    )

``v1`` is the paper's algorithm as plainly as Numba allows; every later rung adds
one thing, said in one line; the last is what the library runs.
:mod:`numba_sc.tools.ladder` only loops over these declarations: it builds each
workload from one shared :class:`~numba_sc.tools.ladder.Context`, runs every rung, compares it with the
reference, and on a GPU times it.

Where a module teaches a second operation rung by rung, it declares that ladder
the same way, beside ``LADDER`` (:mod:`numba_sc.nn.pointwise`: ``BACKWARD_LADDER``,
BatchNorm's backward). The tool needs no list of them: every :class:`Ladder` a
stage module holds at module level is one of its ladders, ``LADDER`` first, then
the others in the order the module defines them. A ladder therefore lives in the
module it climbs; a stage module that wants another's ladder imports the module,
not the ladder (two ladders of one name stop the tool, with both modules named).

Names, one rule for every stage:

* a module's ``LADDER`` is named after the module (``voxelization``,
  ``output_coords``, ``backward_search``, ``forward_search``, ``metadata``,
  ``gather``, ``scatter``, ``pointwise``, ``fetch_on_demand``, ``implicit_gemm``);
  any further ladder of the module is named after the operation it climbs
  (``batch_norm_backward``). These names are what ``numba-sc ladder STAGE`` and
  :mod:`numba_sc.tools.lesson` take;
* what rung n adds is named ``<operation>_v<n>``, the operation being the ladder's
  name unless the declaration says otherwise (``Ladder(..., operation=...)``).
  The object is the kernel, or the kernel factory where the kernel is compiled with
  sizes as constants (``gather_v3(tile, tiles)`` returns the kernel), or the host
  function where the rung is a different sequence of launches
  (``backward_search_v1``: two kernels and a scan). Kernels that are one step of
  such a rung are named for the step and the rung (``pivot_bounds_v1``); kernels
  that every rung shares keep their plain names (``quantize_kernel``);
* where a module holds several operations and its ``LADDER`` climbs one of them,
  the declaration names that operation (``pointwise``'s ``LADDER`` says
  ``operation="batch_norm"``: ``batch_norm_v1``, ``batch_norm_v2``); a further
  ladder, named after its operation, needs no such word (``batch_norm_backward_v1``);
* the library enters the last rung through the stage's ``*_cuda`` function, the
  counterpart of its ``*_reference``.

A rung whose kernel calls linked CUDA C++ (``Rung(..., gpu_only=True)``: the
implicit GEMM's tensor-core v4) cannot run under Numba's CUDA simulator; there
the ladder's ``rungs`` leave it out, so the highest Python rung is the last, and
``declared`` still lists it (``--list`` marks it).

The napkin math of a ladder (``numba-sc ladder STAGE --rung vN`` prints it, as
llm.c's ``dev/cuda`` does for each kernel version) is declared with it:
``bytes_moved(work)``, the bytes the stage cannot avoid moving between the GPU's
memory and its cores, and, for a stage that multiplies matrices, ``flops(work)``.
Divided by the device's peak bandwidth and arithmetic rate they give the time no
rung can beat; a rung's measured time beside it says how far from that bound it
runs, and which of the two bounds it is (memory or arithmetic).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import numpy as np

from .backend import to_host
from .device import simulating


@dataclass(frozen=True)
class Rung:
    """One rung: its name (``"v1"``), how to run it, and what it adds to the one before."""

    name: str
    run: Callable  # run(work) -> the result, on the device
    adds: str  # one line
    gpu_only: bool = False  # calls linked CUDA C++, which the simulator cannot run


@dataclass(frozen=True)
class Ladder:
    """One stage's ladder: its rungs in order, its workload, its reference and how to compare.

    ``workload(context)`` builds the arrays the rungs read (a dict) from a shared
    :class:`~numba_sc.tools.ladder.Context`; ``reference(work)`` is the expected result on the host;
    ``collect(result)`` turns a rung's result into the host array compared with it
    (default: the result, copied to the host); ``written(work)`` the rows of that
    array a kernel writes (default: all); ``tolerance`` the allowed error per dtype,
    relative to the largest reference value (default: exact); ``needs`` the
    :class:`~numba_sc.tools.ladder.Context` fields beyond the coordinates the workload needs (a ladder whose
    needs are not given is left out); ``operation`` the name its rung objects carry,
    ``<operation>_v<n>`` (default: ``stage``; module docstring).

    ``bytes_moved(work)`` is the stage's napkin math (module docstring): the bytes
    that every rung must at least read and write in the device's memory, at the
    workload's actual sizes. Each array the stage reads counts once (whole, or the
    part the result needs), and each array it writes counts once: the traffic of a
    perfect cache, which no rung beats, not the traffic of any one rung (v1 reads
    again what a cache would keep). An index counts as the least that tells the stage
    where to read or write (one int32 a pair, where a rung reads a dense table).
    ``flops(work)`` is the arithmetic every rung must do (a multiply-add counts
    two), declared where the stage multiplies matrices (the dataflows); elsewhere
    memory is the only bound. Both default to None: no napkin math.

    ``rungs`` are the rungs that can run here: under the simulator the ``gpu_only``
    ones are left out. ``declared`` holds every rung, as given.
    """

    stage: str
    rungs: tuple
    workload: Callable
    reference: Callable
    written: Callable | None = None
    tolerance: dict | None = None
    collect: Callable | None = None
    needs: tuple = ()
    operation: str | None = None
    bytes_moved: Callable | None = None  # work -> the least bytes read + written (docstring)
    flops: Callable | None = None  # work -> the least arithmetic, for a stage that multiplies matrices
    declared: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.operation is None:
            object.__setattr__(self, "operation", self.stage)
        object.__setattr__(self, "declared", tuple(self.rungs))
        if simulating():
            object.__setattr__(self, "rungs", tuple(r for r in self.rungs if not r.gpu_only))

    @cached_property
    def names(self) -> tuple:
        """The rungs' names, in order: ``("v1", "v2", ...)``."""
        return tuple(r.name for r in self.rungs)

    @cached_property
    def adds(self) -> dict:
        """{rung name: what it adds}."""
        return {r.name: r.adds for r in self.rungs}

    def rung(self, name: str) -> Rung:
        for r in self.rungs:
            if r.name == name:
                return r
        if any(r.name == name for r in self.declared):
            raise RuntimeError(f"{self.stage} {name} runs on a GPU only (it calls linked CUDA C++, which "
                               f"Numba's CUDA simulator cannot run); the rungs here are {self.names}")
        raise ValueError(f"{self.stage}: rung must be one of {self.names}, got {name!r}")

    def run(self, name: str, work):
        """Run rung ``name`` on ``work``; the result on the device."""
        return self.rung(name).run(work)

    def result(self, name: str, work) -> np.ndarray:
        """Rung ``name``'s result as the host array compared with the reference."""
        res = self.run(name, work)
        return self.collect(res) if self.collect else to_host(res)


# ------------------------------------------- napkin math of a layer's ladders
# For the ladders whose workload is one layer (``Context.layer()``: the map ``km`` with
# its centre offset, ``features``, ``weight`` (K, C_in, C_out) and the ``init`` they add
# onto): the fused dataflows (fetch-on-demand, implicit GEMM), whose rungs all do the
# same arithmetic on the same pairs.
def layer_pairs(w) -> tuple:
    """The layer's pairs outside the centre (the caller's dense product gives the centre
    as init): how many, how many inputs they read, and through how many offsets."""
    table = to_host(w["km"].table)
    hit = table >= 0  # (K, |Q|)
    if w["centre"] >= 0:
        hit[w["centre"]] = False
    return int(hit.sum()), len(np.unique(table[hit])), int(hit.any(axis=1).sum())


def layer_bytes_moved(w) -> int:
    """At least: each input row that a pair reads, W[k] of each offset with a pair, the
    pairs' indices (an input and an output, int32 each) and the init, read once; the
    output written once."""
    pairs, inputs, offsets = layer_pairs(w)
    _, c_in, c_out = w["weight"].shape
    size = w["features"].dtype.itemsize
    return (inputs * c_in + offsets * c_in * c_out) * size + pairs * 2 * 4 + 2 * w["init"].nbytes


def layer_flops(w) -> int:
    """Each pair's input row (C_in) times its W[k] (C_in x C_out): C_in x C_out multiply-adds,
    two flops each."""
    _, c_in, c_out = w["weight"].shape
    return 2 * layer_pairs(w)[0] * c_in * c_out

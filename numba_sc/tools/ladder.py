"""``python -m numba_sc ladder [STAGE ...]``: each stage's kernels, rung by rung, checked and timed.

Every stage with a ladder declares it in its own module, in one place: a
``LADDER`` (:class:`numba_sc.core.rungs.Ladder`) after its kernels and its
reference, listing its rungs in reading order. ``v1`` is the paper's algorithm as
plainly as Numba allows, and every later rung adds one optimization, with a
docstring that says what it changed, why the GPU rewards it, and what it bought
when it came in. The library runs the last rung. A module that climbs a second
operation declares that ladder beside its ``LADDER`` (``BACKWARD_LADDER`` in
:mod:`numba_sc.nn.pointwise`, named ``batch_norm_backward``): the modules' ladders
are every :class:`~numba_sc.core.rungs.Ladder` they hold at module level
(:func:`module_ladders`), so a new one needs no word here. This module holds
nothing stage-specific: it finds the ladders of the modules in :data:`STAGES` and
runs them, two ways:

* **without a GPU**, every rung under the simulator on a crop of the cloud,
  against the stage's NumPy reference: the agreement table;
* **on a GPU**, every rung on the whole cloud, timed with CUDA events (the
  median of ``rounds`` interleaved rounds, so that a slow minute of the
  machine costs every rung alike), with the speed-up of each step and over
  v1; ``--out`` writes the table with the device, date and command.

``--plot FILE.png`` draws the run as bars beside the recorded ladder
(:func:`plot_ladder`). One rung alone, with its code, its diff, its time beside the
recorded one and its napkin math, is ``--rung vN`` (:mod:`numba_sc.tools.rung`).

A module's ``LADDER`` is named after the module, a further ladder after the
operation it climbs (:mod:`numba_sc.core.rungs`); ``python -m numba_sc ladder
--list`` prints them, in the pipeline's order, with what each rung adds, and
``python -m numba_sc ladder NAME ...`` runs the ones named. Each builds its workload
from one shared :class:`Context` (the cloud's coordinates, and
the scan's points for ``voxelization``); most of them run on one 3x3x3 submanifold
layer on the cloud, its map and plan built by the kernels. The
GEMM grouping (stage 9) has one kernel of its own, ``take_weights_kernel`` (a
copy of K small matrices), with nothing to climb; its lesson is the grouping, on
the host. The search rungs build the same table whatever the features' dtype;
they are timed once per dtype all the same.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import sys
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..core.device import device_name, gpu_present, simulating
from ..core.backend import to_device
from ..core.files import atomic_write, write_text
from ..core.rungs import Ladder
from ..gmas.autotune import gpu_time_once, heuristic_tile
from ..gmas.layout import submanifold_centre
from ..gmas.plan import build_plan
from ..map.map_step import build_kernel_map
from . import results

__all__ = ["CHANNEL_FREE", "Context", "RECORDED_LADDERS", "RECORDED_NAMES", "STAGES", "agreement", "agrees",
           "check_rungs", "ladder_modules", "ladders", "list_ladders", "module_ladders", "plot_ladder", "plot_recorded",
           "recorded_rows", "run_ladder", "time_rungs"]

# The stage modules with ladders, in the pipeline's order (the only stage-specific
# thing here; each module's ladders are found in it, module_ladders): stages 1-2,
# the Map step's searches (5-6), the GMaS step (7, 8, 10), BatchNorm between the
# layers (forward and backward), and the two other dataflows of a layer.
STAGES = (
    "numba_sc.coords.voxelization",
    "numba_sc.coords.output_coords",
    "numba_sc.map.backward_search",
    "numba_sc.map.forward_search",
    "numba_sc.gmas.metadata",
    "numba_sc.gmas.gather",
    "numba_sc.gmas.scatter",
    "numba_sc.nn.pointwise",
    "numba_sc.dataflows.fetch_on_demand",
    "numba_sc.dataflows.implicit_gemm",
)

# Recorded ladder files (benchmarks/results/ladder_*.json) name the stages as they
# were named when they were recorded; records are not rewritten, so readers map.
RECORDED_NAMES = {"voxelize": "voxelization", "outcoords": "output_coords", "backward": "backward_search",
                  "search": "forward_search", "batchnorm": "pointwise", "fetch": "fetch_on_demand",
                  "implicit": "implicit_gemm"}

# The recorded ladder runs (``--out`` files in benchmarks/results/) that a rung's recorded
# figure is read from: the first that records the stage (recorded_rows). The first holds
# every stage up to BatchNorm's forward, the second the implicit GEMM's ladder, its
# tensor-core rung included; fetch-on-demand and BatchNorm's backward have no record.
RECORDED_LADDERS = ("ladder_all_kitti", "ladder_implicit_gemm")

# The ladders whose work does not depend on the features' channel count (the Map
# step's, and voxelization, whose features are the scan's own columns): their
# recorded figures are quoted without one.
CHANNEL_FREE = ("voxelization", "output_coords", "backward_search", "forward_search")


def recorded_rows(stage: str):
    """``(file name, record, rows)`` of the first of :data:`RECORDED_LADDERS` that records
    ``stage`` (a ladder name; the rows as recorded, every rung and dtype), or
    ``(None, None, [])``."""
    for name in RECORDED_LADDERS:
        try:
            record = results.load(name)
        except FileNotFoundError:  # an installed package has no benchmarks/
            continue
        rows = [r for r in record["rows"] if RECORDED_NAMES.get(r["stage"], r["stage"]) == stage]
        if rows:
            return name, record, rows
    return None, None, []


@dataclass
class Context:
    """What every ladder's workload is built from: a cloud's voxel coordinates (host,
    (N, 3) int32), the channel count and dtype of the features, and, for the ladders
    that need them, the scan's points (voxelized at ``voxel_size`` into ``coords``)
    and the searches' block sizes ``(B, C)`` (small blocks make a crop's search cross
    many source blocks, as the whole scan's does).

    Workloads share what they build through :meth:`memo`; contexts that differ only
    in dtype (``dataclasses.replace(ctx, dtype=...)``) share the cache, so the map and
    the plan are built once for both dtypes.
    """

    coords: Any
    channels: int = 8
    dtype: str = "float32"
    points: Any = None
    voxel_size: float = 0.05
    search_blocks: tuple = (512, 1024)
    seed: int = 0
    cache: dict = field(default_factory=dict, repr=False)

    def memo(self, key, build: Callable):
        """``build()``, made once per ``key`` and kept in the shared cache."""
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]

    def rng(self, name: str) -> np.random.Generator:
        """A generator seeded by the context's seed and ``name``: the same values for
        every stage that asks by that name."""
        return np.random.default_rng([self.seed, zlib.crc32(name.encode())])

    def normal(self, name: str, shape: tuple, scale: float = 1.0):
        """A device array of standard normal values times ``scale``, in the context's dtype."""
        key = ("normal", name, tuple(shape), scale, self.dtype, self.seed)
        return self.memo(key, lambda: to_device((self.rng(name).standard_normal(shape) * scale).astype(self.dtype)))

    def device_coords(self):
        """``coords`` on the device."""
        return self.memo("coords", lambda: to_device(np.asarray(self.coords)))

    def layer(self) -> dict:
        """One 3x3x3 submanifold layer on ``coords``, its map and plan built by the
        library's kernels: ``km`` (the kernel map, with masks), ``plan`` (its GMaS
        plan), ``centre`` (the centre offset), ``tile`` (the tile the library would
        pick), and, in the context's dtype, ``features`` (|P|, C), ``weight``
        (K, C, C) and ``init`` (|Q|, C) (a centre product to add onto)."""
        def build():
            km = build_kernel_map(self.device_coords(), 3, backend="cuda", masks=True)
            return {"km": km, "plan": build_plan(km, backend="cuda"), "centre": submanifold_centre(km)}

        shared = self.memo("layer", build)
        n, c = len(self.coords), self.channels
        return dict(shared, tile=heuristic_tile(c, n, np.dtype(self.dtype).itemsize),
                    features=self.normal("features", (n, c)), init=self.normal("init", (n, c)),
                    weight=self.normal("weight", (27, c, c), 1 / np.sqrt(c)))


def module_ladders(module) -> list:
    """The ladders a stage module declares: its ``LADDER``, which must be named after
    the module, then every other :class:`~numba_sc.core.rungs.Ladder` it holds at
    module level, in the order the module defines them."""
    name = module.__name__.rpartition(".")[2]
    main = getattr(module, "LADDER", None)
    if not isinstance(main, Ladder):
        raise AssertionError(f"{module.__name__} is in STAGES but declares no LADDER (numba_sc/core/rungs.py)")
    if main.stage != name:
        raise AssertionError(f"{module.__name__} declares the ladder {main.stage!r} as its LADDER: "
                             f"a module's LADDER is named after the module ({name!r})")
    found = [main]
    for value in vars(module).values():
        if isinstance(value, Ladder) and not any(value is f for f in found):
            found.append(value)
    return found


def _declared() -> dict:
    """{stage name: (the module that declares it, its Ladder)}, in the pipeline's order."""
    out = {}
    for path in STAGES:
        for ladder in module_ladders(importlib.import_module(path)):
            if ladder.stage in out:
                raise AssertionError(f"two ladders are named {ladder.stage!r}, in {out[ladder.stage][0]} and in "
                                     f"{path}: a ladder's name is unique, and a module that uses another's "
                                     "ladder imports that module, not the ladder")
            out[ladder.stage] = (path, ladder)
    return out


def ladders() -> dict:
    """{stage name: its :class:`Ladder`}, every ladder of every module in :data:`STAGES`,
    in the pipeline's order and, within a module, in the order it declares them
    (:func:`module_ladders`)."""
    return {stage: ladder for stage, (_, ladder) in _declared().items()}


def ladder_modules() -> dict:
    """{stage name: the module (dotted path) that declares its ladder}; what
    :mod:`numba_sc.tools.lesson` reads a rung's code from."""
    return {stage: path for stage, (path, _) in _declared().items()}


def list_ladders(print_=print):
    """Every ladder: its name and module, then each rung and what it adds."""
    for stage, (path, ladder) in _declared().items():
        needs = f"  (needs {', '.join(ladder.needs)})" if ladder.needs else ""
        print_(f"{stage}  ({path}){needs}")
        for rung in ladder.declared:
            print_(f"  {rung.name}  {rung.adds}" + ("  [GPU only]" if rung.gpu_only else ""))


def agreement(ladder, rung, work):
    """Max |rung - reference| over the values the rung writes, relative to the largest
    reference value (or 1, when they are all smaller): 0 for an exact stage."""
    got = np.asarray(ladder.result(rung, work), np.float64)
    want = np.asarray(ladder.reference(work), np.float64)
    rows = ladder.written(work) if ladder.written else None
    if rows is not None:
        got, want = got[rows], want[rows]
    if got.shape != want.shape:
        return float("inf")
    if not got.size:
        return 0.0
    return float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))


def agrees(ladder, dtype, error) -> bool:
    """Whether an :func:`agreement` is within the ladder's tolerance (exact by default)."""
    return error <= (ladder.tolerance or {}).get(dtype, 0.0)


def time_rungs(ladder, work, rounds=20, warmup=5, names=None):
    """Median GPU microseconds of each rung (of ``names``, default all), interleaved
    rounds, after ``warmup`` calls of each (the first compiles; the rest let the
    library's caches and memory pool settle: with one warm-up call, the stages that call
    the array library read up to twice as slow in a fresh process, measured on the H100)."""
    rungs = list(ladder.names if names is None else names)
    for _ in range(warmup):
        for r in rungs:
            ladder.run(r, work)
    samples = {r: [] for r in rungs}
    rng = np.random.default_rng(0)
    for _ in range(rounds):
        for i in rng.permutation(len(rungs)):
            r = rungs[i]
            samples[r].append(gpu_time_once(lambda: ladder.run(r, work)) * 1e6)
    return {r: float(np.median(v)) for r, v in samples.items()}


def check_rungs(stages, context: Context, print_=print):
    """Every rung of ``stages`` (ladder names, :func:`ladders`) against its reference, on the workloads
    built from ``context``; raises on a disagreement. Returns {(stage, rung): error}."""
    found, errors = ladders(), {}
    width = max([16, *map(len, stages)])
    for stage in stages:
        ladder = found[stage]
        work = ladder.workload(context)
        for rung in ladder.rungs:
            err = agreement(ladder, rung.name, work)
            errors[stage, rung.name] = err
            print_(f"{stage:{width}s} {rung.name}  error {err:.1e}  {rung.adds}")
            if not agrees(ladder, context.dtype, err):
                raise AssertionError(f"{stage} {rung.name} disagrees with the reference: {err:.3g}")
    return errors


def plot_recorded(record, stages, axes=None, mine=None):
    """Bars of a recorded ladder run (a ``--out`` file, loaded): each rung's GPU time per
    dtype, labelled with its speed-up over v1; one panel a stage (needs matplotlib).

    ``stages`` are ladder names; a record's rows may name them as they were named
    when it was recorded (:data:`RECORDED_NAMES`). ``mine``: rows of the reader's own
    run on a GPU (:func:`run_ladder`'s, or ``numba-sc ladder STAGE --rung vN``'s), drawn
    hatched beside the recorded bars of the same rung and dtype."""
    if axes is None:
        import matplotlib.pyplot as plt

        _, axes = plt.subplots(1, len(stages), figsize=(4.2 * len(stages), 3.4), squeeze=False)
        axes = axes[0]
    for ax, stage in zip(axes, stages):
        series = []  # (label, rows, colour, hatch): recorded, then the reader's, per dtype
        for j, dt in enumerate(("float32", "float16")):
            rec = [r for r in (record or {}).get("rows", [])
                   if RECORDED_NAMES.get(r["stage"], r["stage"]) == stage and r["dtype"] == dt]
            series.append((f"{dt} recorded" if mine else dt, rec, f"C{j}", None))
            if mine:
                own = [r for r in mine if r["stage"] == stage and r["dtype"] == dt and r.get("gpu_us")]
                series.append((f"{dt} yours", own, f"C{j}", "//"))
        series = [s for s in series if s[1]]
        rungs = sorted({r["rung"] for _, rows, _, _ in series for r in rows}, key=lambda n: int(n[1:]))
        width = 0.76 / max(1, len(series))
        for i, (label, rows, colour, hatch) in enumerate(series):
            xs = [rungs.index(r["rung"]) + (i - (len(series) - 1) / 2) * width for r in rows]
            ax.bar(xs, [r["gpu_us"] for r in rows], width, label=label, color=colour, hatch=hatch,
                   alpha=0.6 if hatch else 1.0)
            for x, r in zip(xs, rows):
                if "vs_v1" in r:
                    ax.text(x, r["gpu_us"], f"{r['vs_v1']:.1f}x", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(rungs)), rungs)
        ax.set_title(stage)
        ax.set_ylabel("GPU us")
    axes[0].legend(fontsize=8)
    if record:
        rec = record["recorded"]
        axes[0].figure.suptitle(f"{rec['device']}, {rec['date']}: {record['points']:,} voxels", fontsize=9)
    return axes


def plot_ladder(stages, mine, path, print_=print):
    """``numba-sc ladder ... --plot FILE.png``: the reader's ladder as bars, their GPU times
    (``mine``, rows with ``gpu_us``) beside the recorded ones, one panel a stage, written
    to ``path`` (atomically). Without times of their own (no GPU) it plots the recorded
    ladder alone and says so. Each panel's record is the stage's (:func:`recorded_rows`);
    a stage with neither times nor a record gets no panel."""
    from matplotlib.figure import Figure  # (no pyplot: nothing opens a window)

    timed = [r for r in mine if r.get("gpu_us")]
    panels = []  # (stage, record)
    for stage in stages:
        _, record, rows = recorded_rows(stage)
        if rows or any(r["stage"] == stage for r in timed):
            panels.append((stage, record))
        else:
            print_(f"--plot: {stage} has no recorded ladder and no GPU times here: no panel")
    if not panels:
        raise ValueError(f"--plot: nothing to plot for {', '.join(stages)}: no GPU times here and no recorded "
                         f"ladder ({', '.join(RECORDED_LADDERS)})")
    fig = Figure(figsize=(4.2 * len(panels), 3.6))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (stage, record) in zip(axes, panels):
        plot_recorded(record, [stage], axes=[ax], mine=timed or None)
        ax.legend(fontsize=7)
    records = dict.fromkeys(f"{r['recorded']['device']}, {r['recorded']['date']}, {r['points']:,} voxels"
                            for _, r in panels if r)
    recorded = "; ".join(records) or "nothing recorded"
    fig.suptitle((f"yours (hatched): {device_name()}; recorded: {recorded}" if timed else
                  f"no GPU here, so the recorded ladder alone: {recorded}"), fontsize=9)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=100), name="--plot")
    print_(f"--plot: wrote {path}: " + ("your GPU times beside the recorded ones" if timed else
                                        "no GPU times here (the kernels ran under the simulator), so it plots "
                                        "the recorded times alone"))


def run_ladder(stages, coords, channels=64, dtypes=("float32", "float16"), rounds=20, out=None, note="",
               print_=print, points=None, voxel_size=0.05):
    """The ladder table of ``stages`` on ``coords``: agreement with the reference always,
    GPU times when a GPU runs the kernels. Returns the rows; writes ``out`` (JSON).

    ``stages``: ladder names (:func:`ladders`). ``points`` (N, 3 or 4), voxelized at
    ``voxel_size`` into ``coords``: what the ``voxelization`` ladder starts from
    (a ladder whose workload needs what is not given is left out)."""
    found = ladders()
    base = Context(coords, channels, points=points, voxel_size=voxel_size)
    stages = [s for s in stages if all(getattr(base, n) is not None for n in found[s].needs)]
    timed = gpu_present() and not simulating()
    rows = []
    width = max([16, *map(len, stages)])  # the stage column: as wide as the longest name
    head = f"{'stage':{width}s} {'dtype':8s} {'rung':5s} {'error':>9s} {'ok':>3s}"
    head += f" {'GPU us':>9s} {'step':>6s} {'vs v1':>6s}" if timed else ""
    print_(head + "  adds")
    for dtype in dtypes:
        context = dataclasses.replace(base, dtype=dtype)  # (the same cache: the map is built once)
        for stage in stages:
            ladder = found[stage]
            work = ladder.workload(context)
            times = time_rungs(ladder, work, rounds) if timed else {}
            prev, first = None, next(iter(ladder.adds))  # (first: v1, or a shorter ladder's first rung)
            for rung, adds in ladder.adds.items():
                err = agreement(ladder, rung, work)
                ok = agrees(ladder, dtype, err)
                row = {"stage": stage, "dtype": dtype, "rung": rung, "adds": adds, "error": err, "agrees": ok}
                line = f"{stage:{width}s} {dtype:8s} {rung:5s} {err:9.2e} {'yes' if ok else 'NO':>3s}"
                if timed:
                    t = times[rung]
                    row.update(gpu_us=t, step=(times[prev] / t) if prev else 1.0, vs_v1=times[first] / t)
                    line += f" {t:9.1f} {row['step']:5.2f}x {row['vs_v1']:5.2f}x"
                print_(line + "  " + adds)
                rows.append(row)
                prev = rung
            for rung in (r for r in ladder.declared if r.name not in ladder.names):  # gpu_only, left out
                print_(f"{stage:{width}s} {dtype:8s} {rung.name:5s} not run here: GPU only (linked CUDA C++)")
    if out:
        rec = {"points": int(len(coords)), "channels": channels, "rounds": rounds, "rows": rows,
               "recorded": {"device": device_name(), "date": time.strftime("%Y-%m-%d"),
                            "command": "python -m numba_sc " + " ".join(sys.argv[1:]), "code": note}}
        write_text(out, json.dumps(rec, indent=1), name="--out")
    return rows


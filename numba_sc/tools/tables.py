"""Markdown tables of the recorded results, made from the result files, never typed.

Each function takes one parsed result file (:func:`numba_sc.tools.results.load`) and
returns a markdown table. Prose embeds a table between two comments that name the
file and the call that makes it::

    <!-- table: net_scans.json network_table(r) -->
    | network | cloud (voxels) | ... |
    <!-- /table -->

:func:`numba_sc.tools.prose.check_prose` makes the table again from the file and
reports it if the text differs; ``numba-sc figures --update`` writes it again. A
notebook prints the same table with ``print(tables.network_table(results.load("net_scans")))``.
"""
from __future__ import annotations

from .results import SPCONV, ratio, times, versus

__all__ = ["TABLES", "ab_map_table", "conv_table", "generalize_table", "ladder_table", "layer_kinds_table", "map_methods_table",
           "map_table", "network_table", "single_layers_table", "targets37_table", "targets_table", "train_curve_table", "train_step_table",
           "voxelize_table"]

NETS = {"resnet21": "ResNet21", "unet42": "MinkUNet42"}
CLOUDS = {"kitti": "SemanticKITTI", "scannet": "ScanNet", "sunrgbd": "SUN RGB-D", "random": "1M random",
          "random1M": "1M random", "dense": "dense (1M at stride 4)", "kitti_20k": "SemanticKITTI 20k",
          "scannet_20k": "ScanNet 20k", "sunrgbd_20k": "SUN RGB-D 20k"}
DTYPES = {"float32": "fp32", "float16": "fp16"}


def _table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _x(v) -> str:
    return f"{v:.2f}x"


def network_table(r) -> str:
    """``bench_net.py``: each network x cloud x dtype, ms of ours and of both spconv
    algorithms, ours over the best, and the relative error against each."""
    own = any("(Native, own outputs)" in x["network"] for x in r["runs"])
    header = ["network", "cloud (voxels)", "dtype", "numba-sc ms", "Native", "MaskImplicitGemm", "**ours / best**",
              "error vs Native / MIG"] + (["spconv own outputs"] if own else [])
    rows = []
    for x in r["runs"]:
        t = {k: v["ms"] for k, v in x["network"].items()}
        err = x["rel_err"]
        row = [NETS.get(x["net"], x["net"]), f"{CLOUDS.get(x['cloud'], x['cloud'])} ({x['n']:,})",
               DTYPES[x["dtype"]], f"{t['numba-sc']:.2f}", f"{t['spconv Native']:.2f}",
               f"{t['spconv MaskImplicitGemm']:.2f}", f"**{_x(ratio(x))}**",
               f"{err['Native']:.1e} / {err['MaskImplicitGemm']:.1e}"]
        if own:
            o = [x["network"][k]["ms"] for k in ("(Native, own outputs)", "(MaskImplicitGemm, own outputs)")
                 if k in x["network"]]
            row.append(f"{min(o):.2f}" if o else "")
        rows.append(row)
    return _table(header, rows)


KINDS = ("stem", "subm build", "subm reuse", "strided", "transposed", "1x1x1", "batchnorm", "classifier")


def layer_kinds_table(r) -> str:
    """``bench_net.py --layers``: every layer alone as it runs in the network, summed by
    kind, ours over the best spconv (the sum of each layer's faster algorithm)."""
    rows = []
    for x in r["runs"]:
        if "layers" not in x:
            continue
        sums = {}
        for layer in x["layers"]:
            s = sums.setdefault(layer["kind"], [0.0, 0.0])
            s[0] += layer["numba-sc"]
            s[1] += min(layer[p] for p in SPCONV)
        rows.append([NETS.get(x["net"], x["net"]), CLOUDS.get(x["cloud"], x["cloud"]), DTYPES[x["dtype"]]]
                    + [f"{sums[k][0] / sums[k][1]:.2f}" if k in sums else "-" for k in KINDS])
    return _table(["network", "cloud", "dtype", "stem", "subm (map built)", "subm (map reused)", "strided",
                   "transposed", "1x1x1", "BatchNorm", "classifier"], rows)


def ladder_table(r) -> str:
    """``numba-sc ladder --out``: each stage's rungs, GPU us from v1 to the library's, and
    the library's rung against v1, per dtype."""
    stages = list(dict.fromkeys(x["stage"] for x in r["rows"]))
    rows = []
    for st in stages:
        by = {dt: [x for x in r["rows"] if x["stage"] == st and x["dtype"] == dt] for dt in ("float32", "float16")}
        rows.append([st, len(by["float32"])]
                    + [" -> ".join(f"{x['gpu_us']:.0f}" for x in by[dt]) for dt in by]
                    + [" / ".join(_x(by[dt][-1]["vs_v1"]) for dt in by)])
    return _table(["stage (as recorded)", "rungs", "fp32 us, v1 -> ... -> library", "fp16 us",
                   "library vs v1 (fp32 / fp16)"], rows)


def train_step_table(r) -> str:
    """``bench_train.py``: one training step (forward + backward), ms."""
    rows = []
    for x in r["runs"]:
        t = {k: v["ms"] for k, v in x["step"].items()}
        rows.append([NETS.get(x["net"], x["net"]), f"{CLOUDS.get(x['cloud'], x['cloud'])} ({x['n']:,})",
                     f"{t['numba-sc']:.1f} ({t['numba-sc forward only']:.1f})", f"{t['spconv Native']:.1f}",
                     f"{t['spconv MaskImplicitGemm']:.1f}", _x(t["numba-sc"] / t["spconv Native"]),
                     _x(ratio(x["step"]))])
    return _table(["network", "cloud (voxels)", "ours (forward alone)", "spconv Native", "spconv MaskImplicitGemm",
                   "ours / Native", "ours / best"], rows)


def train_curve_table(r) -> str:
    """``numba-sc train --out``: the loss and scores along a fit."""
    h = r["history"]
    return _table(["step"] + [str(x["step"]) for x in h],
                  [["loss"] + [f"{x['loss']:.4f}" for x in h],
                   ["point accuracy"] + [f"{x['accuracy']:.3f}" for x in h],
                   ["mIoU"] + [f"{x['miou']:.3f}" for x in h]])


def map_methods_table(r) -> str:
    """``bench_alternatives.py --only map``: every Map method and spconv's, host ms."""
    rows = []
    for cloud, c in r["clouds"].items():
        t = times(c["map"])
        rows.append([CLOUDS.get(cloud, cloud), f"{c['voxels']:,}"]
                    + [f"{t[m]:.3f}" if m in t else "refused" for m in ("sorted", "hash", "grid", "spconv")]
                    + [_x(versus(c["map"], "sorted"))])
    return _table(["cloud", "voxels", "sorted (Minuet)", "hash", "grid", "spconv", "sorted / spconv"], rows)


def single_layers_table(r) -> str:
    """``bench_alternatives.py --only layer --reuse``: ours with ``dataflow="auto"`` over
    the best spconv, per cloud (fresh layers and layers given their map), host time."""
    rows = []
    for cloud, c in r["clouds"].items():
        ratios = {}
        for name, block in c.items():
            if name.startswith("layer"):
                ratios[name[len("layer "):]] = versus(block, "auto")
        over = [f"{k} {_x(v)}" for k, v in ratios.items() if v > 1]
        rows.append([CLOUDS.get(cloud, cloud), len(ratios), f"{min(ratios.values()):.2f}-{_x(max(ratios.values()))}",
                     len(over), "; ".join(over) or "none"])
    return _table(["cloud", "layers", "auto / best spconv", "rows over", "which"], rows)


def conv_table(r) -> str:
    """``bench_conv.py``: one submanifold 3x3x3 layer, host ms: ours whole and the GMaS
    step alone, against the best spconv (which one), our tiles and GEMM launches."""
    runs = r["runs"]
    rows = []
    for x in runs:
        if x["impl"] != "numba-sc":
            continue
        peers = [y for y in runs if y["impl"] in SPCONV and all(y[k] == x[k] for k in ("dataset", "cin", "cout", "dtype"))]
        whole = min(peers, key=lambda y: y["end_to_end"]["host_ms"])
        gmas = min(y["gmas"]["host_ms"] for y in peers)
        ours, step = x["end_to_end"]["host_ms"], x["gmas"]["host_ms"]
        rows.append([CLOUDS.get(x["dataset"], x["dataset"]), f"{x['cin']}->{x['cout']}", DTYPES[x["dtype"]],
                     f"{ours:.3f} / {whole['end_to_end']['host_ms']:.3f} ({'MIG' if 'Mask' in whole['impl'] else 'Native'})",
                     _x(ours / whole["end_to_end"]["host_ms"]), f"{step:.3f} / {gmas:.3f}", _x(step / gmas),
                     f"{x['tiles']['gather']}/{x['tiles']['scatter']}, {x['gemm_launches']}"])
    return _table(["cloud", "layer", "dtype", "whole layer", "ratio", "GMaS alone", "ratio", "tiles, GEMMs"], rows)


def map_table(r) -> str:
    """``bench_map.py``: the Map step on sorted and shuffled voxels and spconv's, GPU / wall ms."""
    rows = []
    for name, c in r.items():
        if not isinstance(c, dict) or "map" not in c or "spconv" not in c:
            continue
        g = lambda k: f"{c[k]['gpu_ms']:.3f} / {c[k]['wall_ms']:.3f}"  # noqa: E731
        rows.append([name, f"{c['map']['n']:,}", g("map"), g("map_assume_sorted"), g("map_shuffled_input"),
                     g("spconv"), _x(c["map_assume_sorted"]["wall_ms"] / c["spconv"]["wall_ms"])])
    return _table(["cloud", "voxels", "sorted", "`assume_sorted`", "shuffled", "spconv",
                   "`assume_sorted` / spconv (wall)"], rows)


def ab_map_table(r) -> str:
    """``ab_compare.py --only map``: this checkout's Map step, the baseline's and spconv's,
    interleaved, host ms (``assume_sorted=True``)."""
    rows = []
    for cloud, c in r["clouds"].items():
        t = times(c)
        rows.append([CLOUDS.get(cloud, cloud), f"{t['new']:.3f}", f"{t['base']:.3f}", f"{t['spconv']:.3f}",
                     _x(t["new"] / t["spconv"]), _x(t["new"] / t["base"])])
    return _table(["cloud", "ours", "baseline", "spconv", "ours / spconv", "ours / baseline"], rows)


def voxelize_table(r) -> str:
    """``bench_voxelize.py``: the whole scan voxelized, ms."""
    return _table(["variant", "GPU", "host", "NumPy reference", "reference / host"],
                  [[k, f"{v['gpu_ms']:.3f}", f"{v['host_ms']:.3f}", f"{v['numpy_ms']:.2f}",
                    f"{v['numpy_ms'] / v['host_ms']:.0f}x"] for k, v in r["rows"].items()])


def generalize_table(r) -> str:
    """``generalize.py``: each recipe's scores on the unseen squares."""
    rows = []
    for name, x in r["results"].items():
        fit = x.get("train_fit")
        rows.append([name, f"{x['accuracy']:.3f}", f"{x['miou']:.3f}", len(x["classes"]),
                     f"{fit['accuracy']:.3f} / {fit['miou']:.3f}" if fit else "-"])
    return _table(["recipe", "point accuracy (unseen squares)", "mIoU", "classes in both halves",
                   "training squares fit (accuracy / mIoU)"], rows)


def targets_table(r) -> str:
    """``benchmarks/targets.py``: issue #27's targets, one line per target and work (a
    layer kind: both networks), the range of ours / best spconv over the clouds in each
    dtype, and how many of the line's rows meet the limit."""
    groups = {}
    for x in r["rows"]:
        work = x["work"].split(" (")[0] if x["target"] == "layer kind" else x["work"]
        groups.setdefault((x["target"], work), {}).setdefault(x["dtype"], []).append(x)

    def span(xs):
        lo, hi = min(x["ratio"] for x in xs), max(x["ratio"] for x in xs)
        return _x(lo) if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{_x(hi)}"

    rows = []
    for (tgt, work), by_dtype in groups.items():
        xs = [x for v in by_dtype.values() for x in v]
        met = sum(x["met"] for x in xs)
        cells = [span(by_dtype[d]) if d in by_dtype else "" for d in ("float32", "float16")]
        if "-" in by_dtype:  # no dtype (the Map step)
            cells = [span(by_dtype["-"]), "(the same map)"]
        rows.append([tgt, work, *cells, f"{xs[0]['limit']:.2f}", f"{met} of {len(xs)}"])
    return _table(["target", "work", "fp32", "fp16", "limit", "rows within"], rows)


def _clouds_of(cloud) -> str:
    """Which set a cloud of the targets belongs to: the ~20k-voxel crops, the 1M random
    voxels, or the full scans."""
    return "1M random" if cloud.startswith("random") else "20k crops" if cloud.endswith("_20k") else "full scans"


def _range(values, fmt) -> str:
    """``lo-hi`` of ``values`` in ``fmt``, or one value when both read the same."""
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def targets37_table(r) -> str:
    """``benchmarks/targets.py --issue 37``: issue #37's targets, one line per target and
    work (a layer kind: both networks, on one set of clouds), the range of ours / best
    spconv in each dtype (time, or peak device memory for the memory lines), the limit
    ("report" where the issue sets none), how many rows meet it, and for a layer kind
    the roofline of ours: the range of its achieved TFLOP/s and GB/s over the line's rows,
    with their share of the device's measured GEMM and copy peaks in brackets."""
    groups = {}
    for x in r["rows"]:
        if x["target"] == "layer kind":
            work = f"{x['work'].split(' (')[0]}, {_clouds_of(x['cloud'])}"
        else:
            work = x["work"]
        groups.setdefault((x["target"], work), {}).setdefault(x["dtype"], []).append(x)

    rows = []
    for (tgt, work), by_dtype in groups.items():
        xs = [x for v in by_dtype.values() for x in v]
        cells = [_range([x["ratio"] for x in by_dtype[d]], "{:.2f}") + "x" if d in by_dtype else ""
                 for d in ("float32", "float16")]
        limit = xs[0]["limit"]
        within = "-" if limit is None else f"{sum(bool(x['met']) for x in xs)} of {len(xs)}"
        roof = ""
        if any(x.get("tflops") is not None for x in xs):
            rs = [x for x in xs if x.get("tflops") is not None]
            parts = []
            if any(x["tflops"] > 0 for x in rs):
                parts.append(f"{_range([x['tflops'] for x in rs], '{:.2f}')} TFLOP/s"
                             + (f" ({_range([x['pct_flops'] for x in rs], '{:.0f}')} %)"
                                if all(x.get("pct_flops") is not None for x in rs) else ""))
            parts.append(f"{_range([x['gbps'] for x in rs], '{:.0f}')} GB/s"
                         + (f" ({_range([x['pct_bandwidth'] for x in rs], '{:.0f}')} %)"
                            if all(x.get("pct_bandwidth") is not None for x in rs) else ""))
            roof = ", ".join(parts)
        rows.append([tgt, work, *cells, "report" if limit is None else f"{limit:.2f}", within, roof])
    return _table(["target", "work", "fp32", "fp16", "limit", "rows within", "roofline of ours (% of measured peak)"],
                  rows)


TABLES = {f.__name__: f for f in (network_table, layer_kinds_table, ladder_table, train_step_table, train_curve_table,
                                  map_methods_table, single_layers_table, conv_table, map_table, ab_map_table,
                                  voxelize_table, generalize_table, targets_table, targets37_table)}

#!/usr/bin/env python
"""Issue #27's targets, read off the runs that measure them: one file, one table.

    . benchmarks/gpu_env.sh
    bash benchmarks/targets.sh              # the runs (about 15 minutes on an H200)
    python3 benchmarks/targets.py           # -> results/targets.json, and the table

The targets compare the public API with the best of spconv 2.3.8's Native and
MaskImplicitGemm (the ratio ours / best; below 1 we are faster), each measured the
way a user meets it (wall clock between device-wide synchronizes, contenders
interleaved call by call, medians; see each benchmark's docstring):

=============================  =====  ==================================================
target                         limit  where it is measured
=============================  =====  ==================================================
network, real scan             0.85   ``bench_net.py`` on the crops of ~20k voxels and the
                                      full SemanticKITTI, ScanNet and SUN RGB-D scans
network, 1M random voxels      1.00   ``bench_net.py`` on ``random``
layer kind                     1.00   ``bench_net.py --layers`` on the crops: each layer
                                      alone as it runs in the network, summed by kind
Map step, 15-25k voxels        1.00   ``probes/small_map.py``: ``build_kernel_map`` against
                                      ``get_indice_pairs`` (submanifold 3x3x3, strided 2x2x2)
dense cloud, fp16 layer        1.00   ``bench_alternatives.py --clouds dense``: ``auto``
                                      against MaskImplicitGemm (not the best of both)
training step, fp32 and fp16   1.00   ``bench_train.py`` on the crops (fp16: loss scaling
                                      on both sides)
=============================  =====  ==================================================

Each row of ``results/targets.json`` is one measured ratio with its limit, so that
nothing is summarized away; :func:`numba_sc.tools.tables.targets_table` groups them
for the README (the range over clouds and networks, and how many rows meet the limit).
"""
import argparse
import json
from pathlib import Path

from common import CROPS, RESULTS

SOURCES = {  # the runs of targets.sh -> the file each writes
    "net_small": "targets_net_small.json", "net": "targets_net.json", "map": "targets_map.json",
    "dense": "targets_dense.json", "train": "targets_train.json"}
LIMITS = {"network, real scan": 0.85, "network, 1M random": 1.0, "layer kind": 1.0, "Map step, 15-25k voxels": 1.0,
          "dense cloud, fp16 layer": 1.0, "training step": 1.0}
NETS = {"resnet21": "SparseResNet21", "unet42": "MinkUNet42"}


def _best(times):
    """(ms, name) of the faster spconv algorithm among ``times`` (name -> ms)."""
    return min((v, k) for k, v in times.items() if k.startswith("spconv"))


def _row(target, work, cloud, voxels, dtype, ours, times, source):
    best, who = _best(times)
    return {"target": target, "limit": LIMITS[target], "work": work, "cloud": cloud, "voxels": voxels,
            "dtype": dtype, "ours_ms": round(ours, 4), "best_spconv_ms": round(best, 4),
            "best_spconv": who.replace("spconv ", ""), "ratio": round(ours / best, 4),
            "met": ours / best <= LIMITS[target], "source": source}


def network_rows(r, source):
    rows = []
    for x in r["runs"]:
        if "network" not in x:
            continue
        t = {k: v["ms"] for k, v in x["network"].items() if not k.startswith("(")}
        target = "network, 1M random" if x["cloud"].startswith("random") else "network, real scan"
        rows.append(_row(target, f"{NETS[x['net']]} forward", x["cloud"], x["n"], x["dtype"], t["numba-sc"],
                         {k: v for k, v in t.items() if k.startswith("spconv")}, source))
    return rows


def layer_rows(r, source):
    rows = []
    for x in r["runs"]:
        sums = {}
        for layer in x.get("layers", []):
            s = sums.setdefault(layer["kind"], {"numba-sc": 0.0, "spconv Native": 0.0, "spconv MaskImplicitGemm": 0.0})
            for k in s:
                s[k] += layer[k]
        for kind, s in sums.items():
            rows.append(_row("layer kind", f"{kind} ({NETS[x['net']]})", x["cloud"], x["n"], x["dtype"],
                             s["numba-sc"], s, source))
    return rows


def map_rows(r, source):
    rows = []
    for cloud, c in r["clouds"].items():
        for work in (w for w in c if w != "voxels"):
            t = {k: v["host_ms"] for k, v in c[work].items() if k == "ours" or k.startswith("spconv")}
            rows.append(_row("Map step, 15-25k voxels", f"build_kernel_map, {work}", cloud, c["voxels"], "-",
                             t.pop("ours"), t, source))
    return rows


def dense_rows(r, source):
    rows = []
    for cloud, c in r["clouds"].items():
        for name, w in c.items():
            if not isinstance(w, dict) or "times" not in w:
                continue
            t = {k.split(" / ")[1]: v["host_ms"] for k, v in w["times"].items()}
            if "spconv MaskImplicitGemm" not in t or "float16" not in name:
                continue
            rows.append(_row("dense cloud, fp16 layer", f"{name.replace(' float16', '')} (auto)", cloud, c["voxels"],
                             "float16", t["auto"], {"spconv MaskImplicitGemm": t["spconv MaskImplicitGemm"]}, source))
    return rows


def train_rows(r, source):
    rows = []
    for x in r["runs"]:
        if "step" not in x:
            continue
        t = {k: v["ms"] for k, v in x["step"].items()}
        rows.append(_row("training step", f"{NETS[x['net']]} step", x["cloud"], x["n"], x["dtype"], t["numba-sc"],
                         {k: v for k, v in t.items() if k.startswith("spconv")}, source))
    return rows


READERS = {"net_small": [network_rows, layer_rows], "net": [network_rows], "map": [map_rows], "dense": [dense_rows],
           "train": [train_rows]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=str(RESULTS), help="the folder targets.sh wrote to")
    ap.add_argument("--out", default=str(RESULTS / "targets.json"))
    args = ap.parse_args()
    folder = Path(args.results)
    out = {"what": "issue #27's targets: ours / the best spconv 2.3.8 algorithm, one row per measured ratio",
           "crops": {k: f"~{n:,} voxels of {base} nearest its centre (benchmarks/common.py CROPS)"
                     for k, (base, n) in CROPS.items()},
           "limits": LIMITS, "sources": {}, "rows": []}
    for key, name in SOURCES.items():
        path = folder / name
        if not path.exists():
            print(f"missing {path}: its rows are left out")
            continue
        r = json.loads(path.read_text())
        out["sources"][name] = r.get("recorded")
        for read in READERS[key]:
            out["rows"] += read(r, name)
    recs = [r for r in out["sources"].values() if r]
    out["recorded"] = {"device": ", ".join(sorted({r["device"] for r in recs})),
                       "date": ", ".join(sorted({r["date"] for r in recs})),
                       "command": "bash benchmarks/targets.sh; python3 benchmarks/targets.py",
                       "commit": ", ".join(sorted({str(r["commit"]) for r in recs})),
                       "code": "the sources' own records: see 'sources'"}
    Path(args.out).write_text(json.dumps(out, indent=1))
    for row in out["rows"]:
        print(f"{row['target']:26s} {row['work']:38s} {row['cloud']:12s} {row['dtype']:8s} "
              f"{row['ratio']:5.2f} (limit {row['limit']:.2f}) {'met' if row['met'] else 'MISSED'}")
    met = sum(r["met"] for r in out["rows"])
    print(f"{met} of {len(out['rows'])} ratios within their limits -> {args.out}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Issues #27's and #37's targets, read off the runs that measure them: one file, one table.

``--issue 37`` (the default; speed and memory) reads ``targets.sh``'s parts
``net_small37``, ``net37``, ``scans37``, ``train37`` and ``train37_random`` into ``results/targets_37.json``:
ours / the best spconv for networks on the ~20k-voxel crops (limit 0.75), on the 1M
random voxels (0.9), on the full scans (reported, no limit: the issue names none),
every layer kind on the crops and on the 1M cloud and full scans (1.0; each row also
carries ours' napkin ``flops`` and ``bytes``, the achieved ``tflops`` and ``gbps``, and
``pct_flops`` / ``pct_bandwidth`` of the run's measured GEMM and copy peaks, see
``roofline.py``), the training step (0.85), and the peak device memory of a forward
pass and of a training step, ours' peak bytes over the lower spconv peak (1.5).
:func:`numba_sc.tools.tables.targets37_table` groups them. ``--issue 27``: as below.

    . benchmarks/gpu_env.sh
    bash benchmarks/targets.sh              # the runs (about 15 minutes on an H200)
    python3 benchmarks/targets.py --issue 27   # -> results/targets.json, and the table

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

from common import CROPS, RESULTS, write_json

SOURCES = {  # the runs of targets.sh -> the file each writes
    "net_small": "targets_net_small.json", "net": "targets_net.json", "map": "targets_map.json",
    "dense": "targets_dense.json", "train": "targets_train.json"}
LIMITS = {"network, real scan": 0.85, "network, 1M random": 1.0, "layer kind": 1.0, "Map step, 15-25k voxels": 1.0,
          "dense cloud, fp16 layer": 1.0, "training step": 1.0}
NETS = {"resnet21": "SparseResNet21", "unet42": "MinkUNet42"}


def _best(times):
    """(ms, name) of the faster spconv algorithm among ``times`` (name -> ms)."""
    return min((v, k) for k, v in times.items() if k.startswith("spconv"))


def _row(target, work, cloud, voxels, dtype, ours, times, source, limits=None):
    """One measured ratio: ours / the best spconv of ``times``, against ``limits[target]``
    (default #27's :data:`LIMITS`; a limit of None: reported, no target)."""
    best, who = _best(times)
    limit = (LIMITS if limits is None else limits)[target]
    return {"target": target, "limit": limit, "work": work, "cloud": cloud, "voxels": voxels,
            "dtype": dtype, "ours_ms": round(ours, 4), "best_spconv_ms": round(best, 4),
            "best_spconv": who.replace("spconv ", ""), "ratio": round(ours / best, 4),
            "met": None if limit is None else ours / best <= limit, "source": source}


def network_target(cloud):
    """The #27 target of a network row on ``cloud``: 1M random voxels, or a real scan."""
    return "network, 1M random" if cloud.startswith("random") else "network, real scan"


def network_rows(r, source, target_of=network_target, limits=None):
    """One row per run's whole network: its target by ``target_of(cloud)``, against
    ``limits`` (default #27's; :func:`network_rows_37` gives #37's)."""
    rows = []
    for x in r["runs"]:
        if "network" not in x:
            continue
        t = {k: v["ms"] for k, v in x["network"].items() if not k.startswith("(")}
        rows.append(_row(target_of(x["cloud"]), f"{NETS[x['net']]} forward", x["cloud"], x["n"], x["dtype"],
                         t["numba-sc"], {k: v for k, v in t.items() if k.startswith("spconv")}, source, limits))
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


def train_rows(r, source, limits=None):
    """One row per run's training step, against ``limits`` (default #27's)."""
    rows = []
    for x in r["runs"]:
        if "step" not in x:
            continue
        t = {k: v["ms"] for k, v in x["step"].items()}
        rows.append(_row("training step", f"{NETS[x['net']]} step", x["cloud"], x["n"], x["dtype"], t["numba-sc"],
                         {k: v for k, v in t.items() if k.startswith("spconv")}, source, limits))
    return rows


READERS = {"net_small": [network_rows, layer_rows], "net": [network_rows], "map": [map_rows], "dense": [dense_rows],
           "train": [train_rows]}


# ------------------------------------------------------------------ issue #37
SOURCES_37 = {"net_small37": "targets37_net_small.json", "net37": "targets37_net.json",
              "scans37": "targets37_scans.json", "train37": "targets37_train.json",
              "train37_random": "targets37_train_random.json"}
LIMITS_37 = {"network, 20k crop": 0.75, "network, 1M random": 0.9, "network, full scan": None, "layer kind": 1.0,
             "training step": 0.85, "peak memory, forward": 1.5, "peak memory, training step": 1.5}


def network_target_37(cloud):
    """The #37 target of a network row on ``cloud``: the crops of ~20k voxels (0.75), the
    1M random voxels (0.9), a full scan (no limit in the issue: reported only)."""
    if cloud in CROPS:
        return "network, 20k crop"
    if cloud.startswith("random"):
        return "network, 1M random"
    return "network, full scan"


def network_rows_37(r, source):
    return network_rows(r, source, network_target_37, LIMITS_37)


def layer_rows_37(r, source):
    """Per run and layer kind: ours / best spconv (each summed over the kind's layers), with
    the roofline of ours attached: the napkin flops and bytes summed, the achieved TFLOP/s
    and GB/s, and their share of the run's measured peaks (``roofline.achieved``)."""
    from roofline import achieved

    peaks = r.get("peaks")
    rows = []
    for x in r["runs"]:
        sums = {}
        for layer in x.get("layers", []):
            s = sums.setdefault(layer["kind"], {"numba-sc": 0.0, "spconv Native": 0.0, "spconv MaskImplicitGemm": 0.0,
                                                "flops": 0, "bytes": 0, "layers": 0})
            for k in ("numba-sc", "spconv Native", "spconv MaskImplicitGemm"):
                s[k] += layer[k]
            s["flops"] += layer.get("flops", 0)
            s["bytes"] += layer.get("bytes", 0)
            s["layers"] += 1
        for kind, s in sums.items():
            times = {k: s[k] for k in ("spconv Native", "spconv MaskImplicitGemm")}
            row = _row("layer kind", f"{kind} ({NETS[x['net']]})", x["cloud"], x["n"], x["dtype"], s["numba-sc"],
                       times, source, LIMITS_37)
            row.update(layers=s["layers"], flops=s["flops"], bytes=s["bytes"])
            if s["flops"] or s["bytes"]:
                a = achieved(s["flops"], s["bytes"], s["numba-sc"], x["dtype"], peaks)
                row.update({k: None if v is None else round(v, 4) for k, v in a.items()})
            rows.append(row)
    return rows


def train_rows_37(r, source):
    return train_rows(r, source, LIMITS_37)


def memory_rows(target, what):
    """A reader of the runs' ``memory`` records: ours' peak bytes over the lowest spconv
    peak (the best of Native and MaskImplicitGemm), one row per run, for ``target``."""
    def read(r, source):
        rows = []
        for x in r["runs"]:
            if "memory" not in x:
                continue
            m = x["memory"]
            ours = m["numba-sc"]["peak_bytes"]
            best, who = min((v["peak_bytes"], k) for k, v in m.items() if k.startswith("spconv"))
            limit = LIMITS_37[target]
            rows.append({"target": target, "limit": limit, "work": f"{NETS[x['net']]} {what}", "cloud": x["cloud"],
                         "voxels": x["n"], "dtype": x["dtype"], "ours_bytes": ours, "best_spconv_bytes": best,
                         "best_spconv": who.replace("spconv ", ""),
                         "ours_extra_bytes": m["numba-sc"]["extra_bytes"],
                         "best_spconv_extra_bytes": m[who]["extra_bytes"],
                         "ratio": round(ours / best, 4), "met": ours / best <= limit, "source": source})
        return rows
    return read


READERS_37 = {"net_small37": [network_rows_37, layer_rows_37, memory_rows("peak memory, forward", "forward")],
              "net37": [network_rows_37, layer_rows_37, memory_rows("peak memory, forward", "forward")],
              "scans37": [network_rows_37, memory_rows("peak memory, forward", "forward")],
              "train37": [train_rows_37, memory_rows("peak memory, training step", "step")],
              "train37_random": [train_rows_37, memory_rows("peak memory, training step", "step")]}
ISSUES = {"27": (SOURCES, READERS, LIMITS, "targets.json",
                 "issue #27's targets: ours / the best spconv 2.3.8 algorithm, one row per measured ratio"),
          "37": (SOURCES_37, READERS_37, LIMITS_37, "targets_37.json",
                 "issue #37's targets (speed and memory): ours / the best spconv 2.3.8 algorithm, time or peak "
                 "device memory, one row per measured ratio; layer kinds with ours' achieved TFLOP/s and GB/s "
                 "against the device's measured peaks")}


def collect(issue, folder):
    """The targets file of ``issue`` ("27" or "37") from the result files in ``folder``."""
    if issue not in ISSUES:
        raise ValueError(f"unknown issue {issue!r}: one of {', '.join(ISSUES)}")
    sources, readers, limits, _, what = ISSUES[issue]
    folder = Path(folder)
    out = {"what": what, "crops": {k: f"~{n:,} voxels of {base} nearest its centre (benchmarks/common.py CROPS)"
                                   for k, (base, n) in CROPS.items()},
           "limits": limits, "sources": {}, "rows": []}
    for key, name in sources.items():
        path = folder / name
        if not path.exists():
            print(f"missing {path}: its rows are left out")
            continue
        r = json.loads(path.read_text())
        out["sources"][name] = r.get("recorded")
        if "peaks" in r:
            out.setdefault("peaks", {})[name] = r["peaks"]
        for read in readers[key]:
            out["rows"] += read(r, name)
    recs = [r for r in out["sources"].values() if r]
    script = "targets.sh" if issue == "27" else "targets.sh OUT net_small37,net37,scans37,train37,train37_random"
    out["recorded"] = {"device": ", ".join(sorted({r["device"] for r in recs})),
                       "date": ", ".join(sorted({r["date"] for r in recs})),
                       "command": f"bash benchmarks/{script}; python3 benchmarks/targets.py --issue {issue}",
                       "commit": ", ".join(sorted({str(r["commit"]) for r in recs})),
                       "code": "the sources' own records: see 'sources'"}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--issue", default="37", choices=sorted(ISSUES),
                    help="whose targets: 27 (results/targets.json) or 37, speed and memory (results/targets_37.json)")
    ap.add_argument("--results", default=str(RESULTS), help="the folder targets.sh wrote to")
    ap.add_argument("--out", default=None, help="default: results/targets.json (27), results/targets_37.json (37)")
    args = ap.parse_args(argv)
    out_path = args.out or str(RESULTS / ISSUES[args.issue][3])
    out = collect(args.issue, args.results)
    write_json(out_path, out)
    for row in out["rows"]:
        limit = "report only" if row["limit"] is None else f"limit {row['limit']:.2f}"
        verdict = "" if row["met"] is None else ("met" if row["met"] else "MISSED")
        print(f"{row['target']:26s} {row['work']:38s} {row['cloud']:12s} {row['dtype']:8s} "
              f"{row['ratio']:5.2f} ({limit}) {verdict}")
    judged = [r for r in out["rows"] if r["met"] is not None]
    print(f"{sum(r['met'] for r in judged)} of {len(judged)} ratios within their limits -> {out_path}")


if __name__ == "__main__":
    main()

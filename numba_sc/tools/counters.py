"""The hardware counters of Minuet's mechanism, and the paper's Figures 13 and 14, as recorded.

``benchmarks/probes/ncu_counters.py`` runs on the GPU machine and writes five result files;
this module turns them into the small tables and plots the notebooks show beside the
paper's figures and notebook 03's cache model. Every function takes the parsed file
(:func:`numba_sc.tools.results.load`) and computes what it shows from it:

=============================  ===========================================================
file                           what it holds, and the functions that read it
=============================  ===========================================================
``counters_map.json``          the Map step's search by query order and by structure, per
                               cloud: L2/L1 hit rates, DRAM bytes, time (Nsight Compute);
                               :func:`map_table`, :func:`hit_rates`, :func:`plot_map`,
                               :func:`query_orders`, :func:`per_query`,
                               :func:`table_bytes`, :func:`paper_claims`
``counters_gather_scatter``    gather and scatter by tile size (``.json``):
                               :func:`tiles_table`, :func:`plot_tiles`, :func:`best_tiles`
``counters_layer_stages``      one layer's kernels summed by stage (``.json``):
                               :func:`stages_table` (which says so when the run
                               did not reach the layer: ``not_run``)
``paper_fig13.json``           the density sweep: :func:`fig13_table`, :func:`plot_fig13`
``paper_fig14.json``           the four ideas switched on in turn: :func:`fig14_table`,
                               :func:`plot_fig14`
=============================  ===========================================================

Vocabulary of the counters files. Each measurement (a *row*) lists its kernels, each with
``time_ns``, ``l2_hit_pct``, ``l1_hit_pct``, ``dram_read_bytes``, ``dram_write_bytes`` and
``dram_pct_peak`` (ncu's DRAM throughput as a share of its peak), and sums them: a Map row's
``query`` is the query process alone (the paper's Figure 16b: Minuet's forward search, a
table's probes, a plain search), its ``step`` every kernel of the variant; the other rows
have a ``total``. A sum's ``bytes_per_s`` is its DRAM bytes over its time, which
:func:`peak_pct` sets against the device's peak bandwidth (``device`` in every file).

Worked example, numbers made up: a query kernel that moved 30 MB of DRAM in 20 us (typed: made up)
ran at 1.5 TB/s; on a device of 3.35 TB/s peak, ``peak_pct`` is 44.8 %. (typed: made up)
Its L2 hit rate says how many of its L2 lookups (sectors) found their data there: the
paper's measure (Figures 3, 16b).

A hit *rate* is a ratio, and its denominator moves. When the 32 threads of a warp read the
same 32-byte sector, the hardware makes one lookup for them all: sorted queries, whose
neighbouring threads walk the same path, turn most of their reads into a few lookups, and
the reuse that notebook 03's cache model counts as hits never reaches a cache to be
counted. So compare orders by what they cost as well: :func:`per_query` gives each
variant's L2 lookups, L2 misses (lookups that went on to DRAM), DRAM bytes and time per
query.
"""
from __future__ import annotations

from .results import row as find_row

__all__ = ["CLAIMS", "MAP_VARIANTS", "NB03_ORDERS", "best_tiles", "check_record", "fig13_table", "fig14_table",
           "hit_rates", "map_rows", "map_table", "paper_claims", "paper_l2", "peak_pct", "per_query", "plot_fig13",
           "plot_fig14", "plot_map", "plot_tiles", "query_orders", "stages_table", "table_bytes", "tiles_table"]

# The Map step's variants as the probe names them, in the order it shows them, and a short label.
MAP_VARIANTS = {"unsorted": "unsorted", "sorted": "fully sorted", "segmented": "segmented",
                "segmented_on_the_fly": "segmented, on the fly", "minuet": "Minuet (library)",
                "hash": "hash table", "grid": "dense grid"}
# Notebook 03's query orders (its LRU model) -> the variant measured with the same order and
# the same kernel (one plain binary search per query, the queries read from a list).
NB03_ORDERS = {"random": "unsorted", "segmented (Minuet)": "segmented", "fully sorted": "sorted"}
# What each kind of file must hold (check_record): its keys, and a key of each of its rows.
_NEEDS = {"map": (("rows", "clouds", "device"), "variant"), "tiles": (("rows", "clouds", "device"), "tile"),
          "stages": (("rows", "device"), "by_stage"), "fig13": (("rows", "box"), "n"),
          "fig14": (("clouds", "layer"), None)}


def check_record(record, kind: str) -> dict:
    """``record`` if it holds what the ``kind`` of file (``"map"``, ``"tiles"``, ``"stages"``,
    ``"fig13"``, ``"fig14"``) must, else a ValueError naming what is missing."""
    if kind not in _NEEDS:
        raise ValueError(f"kind must be one of {sorted(_NEEDS)}, got {kind!r}")
    if not isinstance(record, dict):
        raise ValueError(f"a {kind} record is a dict (results.load's), got {type(record).__name__}")
    keys, row_key = _NEEDS[kind]
    missing = [k for k in keys if k not in record]
    if not missing and row_key and any(row_key not in x for x in record["rows"]):
        missing = [f"rows[...]['{row_key}']"]
    if missing:
        raise ValueError(f"this record has no {missing}: is it a {kind} file written by "
                         f"benchmarks/probes/ncu_counters.py? (its keys: {sorted(record)})")
    return record


def _fmt(v, spec, none="-"):
    return none if v is None else format(v, spec)


def _table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def peak_pct(agg, device):
    """A sum's DRAM bandwidth (``bytes_per_s``) as a percentage of the device's peak
    (``device["dram_peak_bytes_per_s"]``), or None when either is unknown."""
    peak = (device or {}).get("dram_peak_bytes_per_s")
    if not agg or agg.get("bytes_per_s") is None or not peak:
        return None
    return 100.0 * agg["bytes_per_s"] / peak


# ----------------------------------------------------------------------------- the Map step
def _clouds_by_size(r):
    return sorted(r["clouds"], key=lambda c: r["clouds"][c].get("voxels", 0))


def map_rows(r, which="query") -> list:
    """One flat dict per measured (cloud, variant) of ``counters_map.json``, the clouds by size,
    the variants in :data:`MAP_VARIANTS` order: cloud, voxels, variant, the L2 and L1 hit
    rates, DRAM MB, time in us, achieved GB/s and its share of the device's peak, ncu's DRAM
    share. ``which``: ``"query"`` (the query process) or ``"step"`` (every kernel)."""
    check_record(r, "map")
    if which not in ("query", "step"):
        raise ValueError(f"which must be 'query' (the query process) or 'step' (every kernel), got {which!r}")
    order = {v: i for i, v in enumerate(MAP_VARIANTS)}
    out = []
    for cloud in _clouds_by_size(r):
        mine = sorted((x for x in r["rows"] if x["cloud"] == cloud), key=lambda x: order.get(x["variant"], 99))
        for x in mine:
            agg = x.get(which)
            if not agg:
                continue
            out.append({"cloud": cloud, "voxels": r["clouds"][cloud]["voxels"], "variant": x["variant"],
                        "l2_hit_pct": agg["l2_hit_pct"], "l1_hit_pct": agg["l1_hit_pct"],
                        "dram_mb": None if agg["dram_bytes"] is None else agg["dram_bytes"] / 1e6,
                        "time_us": None if agg["time_ns"] is None else agg["time_ns"] / 1e3,
                        "gb_per_s": None if agg["bytes_per_s"] is None else agg["bytes_per_s"] / 1e9,
                        "peak_pct": peak_pct(agg, r["device"]), "ncu_dram_pct": agg["dram_pct_peak"],
                        "check": x.get("check", "ok")})
    return out


def map_table(r, which="query") -> str:
    """Markdown: :func:`map_rows` as a table."""
    rows = [[f"{x['cloud']} ({x['voxels']:,})", MAP_VARIANTS.get(x["variant"], x["variant"]),
             _fmt(x["l2_hit_pct"], ".1f"), _fmt(x["l1_hit_pct"], ".1f"), _fmt(x["dram_mb"], ".1f"),
             _fmt(x["time_us"], ".1f"), _fmt(x["gb_per_s"], ".0f"), _fmt(x["peak_pct"], ".0f")]
            for x in map_rows(r, which)]
    return _table(["cloud (voxels)", "variant", "L2 hit %", "L1 hit %", "DRAM MB", "us (ncu)", "GB/s",
                   "% of peak"], rows)


def hit_rates(r, which="query", level="l2") -> dict:
    """{cloud: {variant: hit rate %}} of the L2 (``level="l2"``) or L1 cache."""
    key = {"l2": "l2_hit_pct", "l1": "l1_hit_pct"}.get(level)
    if key is None:
        raise ValueError(f"level must be 'l2' or 'l1', got {level!r}")
    out = {}
    for x in map_rows(r, which):
        out.setdefault(x["cloud"], {})[x["variant"]] = x[key]
    return out


def query_orders(r, cloud, level="l2") -> dict:
    """The measured hit rates of notebook 03's query orders on ``cloud``, by its names
    (:data:`NB03_ORDERS`): to set beside its LRU model's. Orders not measured are left out."""
    rates = hit_rates(r, "query", level).get(cloud)
    if rates is None:
        raise ValueError(f"no cloud {cloud!r} in this record; it has {_clouds_by_size(r)}")
    return {name: rates[v] for name, v in NB03_ORDERS.items() if v in rates}


def per_query(r, which="query") -> dict:
    """{cloud: {variant: cost}} of ``counters_map.json``, each cost per query (the lookups of
    the cloud's searched segments, ``clouds[cloud]["queries"]``): ``l2_lookups`` (L2 sector
    lookups), ``l2_misses`` (those that missed, so went on to DRAM), ``dram_bytes`` and
    ``time_ns``; None where ncu gave no value. Unlike a hit rate, every one of them falls when
    a change saves work (see the module docstring). ``which``: as in :func:`map_rows`."""
    check_record(r, "map")
    if which not in ("query", "step"):
        raise ValueError(f"which must be 'query' (the query process) or 'step' (every kernel), got {which!r}")
    order = {v: i for i, v in enumerate(MAP_VARIANTS)}
    out = {}
    for cloud in _clouds_by_size(r):
        n = r["clouds"][cloud]["queries"]
        for x in sorted((x for x in r["rows"] if x["cloud"] == cloud), key=lambda x: order.get(x["variant"], 99)):
            agg = x.get(which)
            if not agg:
                continue
            sectors, hit = agg.get("l2_sectors"), agg.get("l2_hit_pct")
            # ncu can report a hit rate a little over 100 % on a tiny kernel: no misses, not fewer than none.
            misses = None if sectors is None or hit is None else sectors * max(0.0, 1 - hit / 100)
            out.setdefault(cloud, {})[x["variant"]] = {
                name: None if v is None else v / n
                for name, v in (("l2_lookups", sectors), ("l2_misses", misses), ("dram_bytes", agg.get("dram_bytes")),
                                ("time_ns", agg.get("time_ns")))}
    return out


def table_bytes(r) -> dict:
    """{cloud: {structure: bytes}} of what each variant searches (the sorted source keys, the
    hash table, the grid or None where it was refused, the materialized queries), and
    ``"L2"``: the device's L2 size, to see which tables fit in it."""
    check_record(r, "map")
    out = {"L2": r["device"].get("l2_bytes")}
    for cloud in _clouds_by_size(r):
        c = r["clouds"][cloud]
        out[cloud] = {"source keys": c["source_key_bytes"], "hash table": c["hash_table_bytes"],
                      "grid": c.get("grid_bytes"), "queries (materialized)": c["query_bytes"]}
    return out


def paper_l2(paper) -> dict:
    """The paper's L2 hit rates (percent) from ``paper.json``: Minuet's forward search (Figure
    16b, its smallest), Minuet's Map step (Figure 3, smallest), MinkowskiEngine's and
    TorchSparse's hash tables (mean), Open3D's at 5M points."""
    ids = {"Minuet, forward search (Fig. 16b, min)": "map_l2_minuet_min",
           "Minuet (Fig. 3, min)": "map_l2_minuet_fig3_min",
           "MinkowskiEngine hash (Fig. 3, mean)": "map_l2_minkowski_mean",
           "TorchSparse hash (Fig. 3, mean)": "map_l2_torchsparse_mean",
           "Open3D hash at 5M points (Fig. 3)": "map_l2_open3d_5m"}
    return {label: 100.0 * find_row(paper["figures"], id=fid)["value"] for label, fid in ids.items()}


# The claims paper_claims checks, by the id each verdict carries (in the order it lists them).
CLAIMS = {
    "forward_l2": "Minuet's forward search hits L2 more than the paper's smallest rate (Figure 16b) on every cloud",
    "sorted_l2": "segmented (sorted) queries hit L2 more than unsorted ones, the same search and queries",
    "hash_below_minuet": "a hash table hits L2 less than Minuet's forward search on every cloud (Figures 3, 16b)",
    "hash_falls": "a hash table's L2 hit rate falls as the cloud grows: the largest cloud's below the smallest's",
    "forward_share": "the forward search is at least the paper's share of the Map step's GPU time (Section 6.4)",
    "sorted_fewer_lookups": "segmented queries make fewer L2 lookups per query than unsorted ones and take less "
                            "time, on every cloud (Section 5.1: the locality of Figure 7)",
}


def paper_claims(r, paper) -> list:
    """The paper's claims about the Map step's caches (:data:`CLAIMS`), each checked on
    ``counters_map.json``: ``[{"id", "claim", "where", "measured", "holds"}]`` in the order of
    :data:`CLAIMS`, ``holds`` True, False, or None when the file lacks what the claim needs.
    ``paper`` is ``paper.json``, loaded.

    The second claim is the paper's measure (a hit rate) applied to the query orders; the
    last one is what sorting is for (fewer lookups, less time). They can disagree: see the
    module docstring on what a hit rate's denominator does."""
    rows = {(x["cloud"], x["variant"]): x for x in check_record(r, "map")["rows"] if x.get("query")}
    clouds = [c for c in _clouds_by_size(r) if (c, "minuet") in rows]
    rate = lambda c, v: rows[(c, v)]["query"]["l2_hit_pct"] if (c, v) in rows else None  # noqa: E731
    minuet_min = 100 * find_row(paper["figures"], id="map_l2_minuet_min")["value"]
    share_min = 100 * find_row(paper["figures"], id="map_forward_share_min")["value"]

    def every(pairs):
        pairs = [(c, a, b) for c, a, b in pairs if a is not None and b is not None]
        return (all(a > b for _, a, b in pairs) if pairs else None), pairs

    out = []
    got = [(c, rate(c, "minuet")) for c in clouds if rate(c, "minuet") is not None]
    out.append({"id": "forward_l2",
                "claim": f"Minuet's forward search hits L2 more than {minuet_min:.0f} % of the time on every cloud",
                "where": "Figure 16b", "measured": ", ".join(f"{c} {v:.1f} %" for c, v in got),
                "holds": all(v > minuet_min for _, v in got) if got else None})
    holds, pairs = every((c, rate(c, "segmented"), rate(c, "unsorted")) for c in _clouds_by_size(r))
    out.append({"id": "sorted_l2",
                "claim": "segmented (sorted) queries hit L2 more than unsorted ones, the same search and queries",
                "where": "Section 5.1, Figure 7", "holds": holds,
                "measured": ", ".join(f"{c} {a:.1f} vs {b:.1f} %" for c, a, b in pairs)})
    holds, pairs = every((c, rate(c, "minuet"), rate(c, "hash")) for c in clouds)
    out.append({"id": "hash_below_minuet", "claim": "a hash table hits L2 less than Minuet's forward search",
                "where": "Figures 3, 16b", "holds": holds,
                "measured": ", ".join(f"{c} hash {b:.1f} vs {a:.1f} %" for c, a, b in pairs)})
    hashed = [(c, rate(c, "hash")) for c in _clouds_by_size(r) if rate(c, "hash") is not None]
    out.append({"id": "hash_falls", "claim": "a hash table's L2 hit rate falls as the cloud grows",
                "where": "Figures 3, 16b",
                "measured": ", ".join(f"{c} ({r['clouds'][c]['voxels']:,}) {v:.1f} %" for c, v in hashed),
                "holds": hashed[-1][1] < hashed[0][1] if len(hashed) > 1 else None})
    shares = []
    for c in clouds:
        x = rows[(c, "minuet")]
        if x["step"] and x["step"]["time_ns"]:
            shares.append((c, 100 * x["query"]["time_ns"] / x["step"]["time_ns"]))
    out.append({"id": "forward_share",
                "claim": f"the forward search is more than {share_min:.0f} % of the Map step's time",
                "where": "Section 6.4", "measured": ", ".join(f"{c} {v:.0f} %" for c, v in shares),
                "holds": all(v > share_min for _, v in shares) if shares else None})
    cost = per_query(r)
    both = [(c, cost[c]["segmented"], cost[c]["unsorted"]) for c in cost
            if "segmented" in cost[c] and "unsorted" in cost[c]
            and None not in (cost[c]["segmented"]["l2_lookups"], cost[c]["unsorted"]["l2_lookups"])]
    out.append({"id": "sorted_fewer_lookups",
                "claim": "segmented queries make fewer L2 lookups per query than unsorted ones, and take less time",
                "where": "Section 5.1, Figure 7",
                "measured": ", ".join(f"{c} {s['l2_lookups']:.2f} vs {u['l2_lookups']:.2f} lookups a query, "
                                      f"{rows[(c, 'segmented')]['query']['time_ns'] / 1e3:.0f} vs "
                                      f"{rows[(c, 'unsorted')]['query']['time_ns'] / 1e3:.0f} us" for c, s, u in both),
                "holds": all(s["l2_lookups"] < u["l2_lookups"] and s["time_ns"] < u["time_ns"] for _, s, u in both)
                if both else None})
    return out


def plot_map(r, which="query", ax=None, paper=None, level="l2"):
    """Bars: each cloud's hit rate per variant (``level``: L2 or L1), the clouds by size, each
    labelled with its voxels and whether its hash table fits in L2; ``paper`` (``paper.json``,
    loaded): its hit rates as dashed lines (:func:`paper_l2`). Returns the axes."""
    import matplotlib.pyplot as plt
    import numpy as np

    rates = hit_rates(r, which, level)
    sizes = table_bytes(r)
    if ax is None:
        _, ax = plt.subplots(figsize=(13, 4.4))
    variants = [v for v in MAP_VARIANTS if any(v in x for x in rates.values())]
    clouds = list(rates)
    width = 0.8 / max(1, len(variants))
    for i, v in enumerate(variants):
        xs = np.arange(len(clouds)) + (i - (len(variants) - 1) / 2) * width
        ys = [rates[c].get(v) for c in clouds]
        ax.bar([x for x, y in zip(xs, ys) if y is not None], [y for y in ys if y is not None], width,
               color=f"C{i}", label=MAP_VARIANTS[v])
    if paper is not None and level == "l2":
        for j, (label, value) in enumerate(paper_l2(paper).items()):
            ax.axhline(value, color="0.3", ls=("--", ":", "-.", (0, (1, 3)), (0, (5, 5)))[j % 5], lw=1,
                       label=f"paper: {label} {value:.0f} %")
    l2 = sizes["L2"]

    def label(c):
        fits = "" if not l2 else ("\n(hash fits L2)" if sizes[c]["hash table"] <= l2 else "\n(hash > L2)")
        return f"{c}\n{r['clouds'][c]['voxels']:,} voxels{fits}"

    ax.set_xticks(range(len(clouds)), [label(c) for c in clouds], fontsize=8)
    ax.set_ylabel(f"{level.upper()} hit rate, %")
    ax.set_ylim(0, 105)
    ax.set_title(f"The Map step's {'query process' if which == 'query' else 'kernels'}: {level.upper()} hit rate "
                 f"({r['device'].get('name', '?')}, Nsight Compute, caches cold)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1), borderaxespad=0)  # beside the bars
    return ax


# ------------------------------------------------------------------------- gather and scatter
def tiles_table(r) -> str:
    """Markdown: every gather and scatter of ``counters_gather_scatter.json``, per cloud, stage
    and dtype a row, the time in us of each tile (the fastest in bold) and, for the fastest,
    the napkin bytes over its time as a share of peak.

    The probe's napkin bytes (``napkin_bytes``) count every point's features for the gather,
    but the gather skips a point without a pair: on a sparse cloud (1M random voxels in
    400^3, where most points have none) the napkin share overstates the traffic, and the
    DRAM bandwidth Nsight Compute measured (:func:`plot_tiles`' lower panels) is the one
    to read."""
    check_record(r, "tiles")
    groups = {}
    for x in r["rows"]:
        if x.get("total"):
            groups.setdefault((x["cloud"], x["stage"], x["dtype"]), []).append(x)
    tiles = sorted({x["tile"] for g in groups.values() for x in g})
    rows = []
    for (cloud, stage, dtype), xs in groups.items():
        by = {x["tile"]: x for x in xs}
        best = min(xs, key=lambda x: x["total"]["time_ns"])
        cells = []
        for t in tiles:
            if t not in by:
                cells.append("")
                continue
            us = f"{by[t]['total']['time_ns'] / 1e3:.1f}"
            cells.append(f"**{us}**" if by[t] is best else us)
        napkin = best["napkin_bytes"] / best["total"]["time_ns"] * 1e9
        peak = r["device"].get("dram_peak_bytes_per_s")
        rows.append([cloud, stage, dtype, *cells, best["tile"], _fmt(100 * napkin / peak if peak else None, ".0f"),
                     _fmt(best["total"]["l2_hit_pct"], ".0f")])
    return _table(["cloud", "stage", "dtype", *[f"T={t} us" for t in tiles], "best T", "napkin % of peak",
                   "L2 hit %"], rows)


def best_tiles(r) -> dict:
    """{(cloud, stage, dtype): the tile with the least GPU time under ncu} (ties: the smaller)."""
    check_record(r, "tiles")
    out = {}
    for x in r["rows"]:
        if not x.get("total"):
            continue
        key = (x["cloud"], x["stage"], x["dtype"])
        t = (x["total"]["time_ns"], x["tile"])
        out[key] = min(out.get(key, t), t)
    return {k: v[1] for k, v in out.items()}


def plot_tiles(r, axes=None):
    """Two panels per stage: GPU us by tile (log-log), and the DRAM bandwidth ncu measured as a
    share of the device's peak by tile; a line per cloud and dtype. Returns the axes."""
    import matplotlib.pyplot as plt

    check_record(r, "tiles")
    stages = list(dict.fromkeys(x["stage"] for x in r["rows"]))
    if axes is None:
        _, axes = plt.subplots(2, len(stages), figsize=(6 * len(stages), 7), squeeze=False)
    lines = {}
    for x in r["rows"]:
        if x.get("total"):
            lines.setdefault((x["stage"], x["cloud"], x["dtype"]), []).append(x)
    for j, stage in enumerate(stages):
        for (st, cloud, dtype), xs in lines.items():
            if st != stage:
                continue
            xs = sorted(xs, key=lambda x: x["tile"])
            label = f"{cloud} {dtype}"
            axes[0][j].plot([x["tile"] for x in xs], [x["total"]["time_ns"] / 1e3 for x in xs], "o-", label=label)
            share = [peak_pct(x["total"], r["device"]) for x in xs]
            axes[1][j].plot([x["tile"] for x in xs], [s if s is not None else float("nan") for s in share], "o-",
                            label=label)
        axes[0][j].set(xscale="log", yscale="log", title=f"{stage}: GPU time (ncu, caches cold)", ylabel="us")
        axes[1][j].set(xscale="log", title=f"{stage}: DRAM bandwidth, % of peak", xlabel="tile (channels per thread)",
                       ylabel="% of peak", ylim=(0, 100))
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xscale("log", base=2)
            ax.legend(fontsize=7)
    return axes


# ---------------------------------------------------------------------------- one layer's stages
def _not_run(r) -> str:
    """What the run left out, as the probe recorded it (``not_run``: label and why)."""
    return "; ".join(f"{x.get('label', '?')} ({x.get('why', '?')})" for x in r.get("not_run", [])) or "nothing recorded"


def stages_table(r) -> str:
    """Markdown: ``counters_layer_stages.json``, per cloud and stage of the layer: time in us
    and its share, L2 hit rate, DRAM MB, bandwidth as a share of peak. A file without a
    measured layer (the probe's time budget ran out before it) gives one line saying so and
    why, from the file's ``not_run``."""
    check_record(r, "stages")
    order = ("Map", "metadata", "gather", "GEMMs", "scatter", "other")
    rows = []
    for x in r["rows"]:
        by, total = x.get("by_stage") or {}, x.get("total")
        if not total:
            continue
        for s in sorted(by, key=lambda s: order.index(s) if s in order else len(order)):
            a = by[s]
            rows.append([x["cloud"], x.get("layer", ""), s, f"{a['time_ns'] / 1e3:.1f}",
                         f"{100 * a['time_ns'] / total['time_ns']:.0f} %", _fmt(a["l2_hit_pct"], ".0f"),
                         _fmt(None if a["dram_bytes"] is None else a["dram_bytes"] / 1e6, ".1f"),
                         _fmt(peak_pct(a, r["device"]), ".0f")])
    if not rows:
        return f"No layer was measured in this run: {_not_run(r)}."
    return _table(["cloud", "layer", "stage", "us (ncu)", "share", "L2 hit %", "DRAM MB", "% of peak"], rows)


# ------------------------------------------------------------------------------ Figure 13
def _speedups(run):
    """{peer: its time over ours} of one bench_net run (an empty dict without peers)."""
    t = {k: v["ms"] for k, v in run.get("network", {}).items()}
    if "numba-sc" not in t:
        return {}
    return {k: v / t["numba-sc"] for k, v in t.items() if k.startswith("spconv")}


def fig13_table(r) -> str:
    """Markdown: per density, the Map step's GPU ms by method and each network's speed-up over
    each spconv algorithm (their wall-clock time over ours: above 1, ours is faster)."""
    check_record(r, "fig13")
    rows = []
    for x in r["rows"]:
        if "map" not in x:  # skipped: the time budget ran out before this size
            rows.append([f"{x['n']:,}", "", "", "", "", "", "not measured: " + str(x.get("skipped", "?"))])
            continue
        m = x["map"]
        nets = "; ".join(f"{run['net']}: " + ", ".join(f"{k.replace('spconv ', '')} {v:.2f}x"
                                                      for k, v in _speedups(run).items())
                         for run in x.get("networks", []) if "network" in run) or "-"
        rows.append([f"{x['n']:,}", f"{x['voxels']:,}", f"{x['density_pct']:.3g} %",
                     *(_fmt(m.get(k, {}).get("gpu_ms"), ".3f") for k in ("sorted", "hash", "grid")), nets])
    return _table(["target voxels", "voxels", "density", "map sorted GPU ms", "hash", "grid",
                   "network speed-up (peer / ours, wall)"], rows)


def plot_fig13(r, axes=None, paper=None):
    """Two panels: the Map step's GPU ms by method against the voxels (log-log), and each
    network's speed-up over each spconv algorithm against the voxels, with the paper's mean
    over its baselines (``paper``: ``paper.json``, loaded) as a dashed line. Returns the axes."""
    import matplotlib.pyplot as plt

    check_record(r, "fig13")
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(13, 4))
    done = [x for x in r["rows"] if "map" in x]
    for method in ("sorted", "hash", "grid"):
        pts = [(x["voxels"], x["map"][method]["gpu_ms"]) for x in done if method in x["map"]]
        if pts:
            axes[0].plot(*zip(*pts), "o-", label=method)
    axes[0].set(xscale="log", yscale="log", xlabel="voxels in the 400^3 box", ylabel="GPU ms (CUDA events)",
                title="the Map step by method")
    series = {}
    for x in done:
        for run in x.get("networks", []):
            for peer, s in _speedups(run).items():
                series.setdefault(f"{run['net']} over {peer}", []).append((x["voxels"], s))
    for name, pts in series.items():
        axes[1].plot(*zip(*pts), "o-", label=name)
    if paper is not None:
        mean = find_row(paper["figures"], id="density_mean")["value"]
        axes[1].axhline(mean, color="C3", ls="--", lw=1, label=f"paper: Minuet over ME/TorchSparse, mean {mean}x")
    axes[1].axhline(1, color="k", lw=0.8)
    axes[1].set(xscale="log", xlabel="voxels in the 400^3 box", ylabel="their time / ours (wall)",
                title="whole network (Figure 13's measure)")
    for ax in axes:
        ax.legend(fontsize=7)
    return axes


# ------------------------------------------------------------------------------ Figure 14
PARTS14 = ("map", "metadata", "GMaS")


def _part(component):
    return component.split(":", 1)[0]


def fig14_table(r) -> str:
    """Markdown: per cloud, each bar of Figure 14 (the ideas switched on one after another),
    its three parts and its total in host ms, and its speed-up over the baseline (host and
    GPU time)."""
    check_record(r, "fig14")
    rows = []
    for cloud, c in r["clouds"].items():
        if "bars" not in c:
            rows.append([cloud, "skipped", "", "", "", "", "", ""])
            continue
        base = c["bars"][0]
        for b in c["bars"]:
            parts = {_part(p): c["components"][p]["host_ms"] for p in b["parts"]}
            rows.append([cloud, b["name"], *(f"{parts.get(p, 0):.3f}" for p in PARTS14), f"{b['host_ms']:.3f}",
                         f"{base['host_ms'] / b['host_ms']:.2f}x", f"{base['gpu_ms'] / b['gpu_ms']:.2f}x"])
    return _table(["cloud", "bar", "Map ms", "metadata ms", "GMaS ms", "total ms (host)", "speed-up (host)",
                   "speed-up (GPU)"], rows)


def plot_fig14(r, axes=None, clock="host_ms"):
    """Figure 14 per cloud: stacked bars (Map, metadata, GMaS) of each idea switched on, in
    ``clock`` ("host_ms": wall; "gpu_ms": CUDA events), each labelled with its speed-up over
    the baseline. Returns the axes."""
    import matplotlib.pyplot as plt

    check_record(r, "fig14")
    if clock not in ("host_ms", "gpu_ms"):
        raise ValueError(f"clock must be 'host_ms' (wall) or 'gpu_ms' (CUDA events), got {clock!r}")
    clouds = [c for c, v in r["clouds"].items() if "bars" in v]
    if axes is None:
        _, axes = plt.subplots(1, max(1, len(clouds)), figsize=(5.5 * max(1, len(clouds)), 4), squeeze=False)
        axes = axes[0]
    for ax, cloud in zip(axes, clouds):
        c = r["clouds"][cloud]
        bars = c["bars"]
        bottom = [0.0] * len(bars)
        for i, part in enumerate(PARTS14):
            v = [sum(c["components"][p][clock] for p in b["parts"] if _part(p) == part) for b in bars]
            ax.bar(range(len(bars)), v, bottom=bottom, color=f"C{i}", label=part)
            bottom = [a + b for a, b in zip(bottom, v)]
        for i, b in enumerate(bars):
            ax.text(i, bottom[i], f"{bars[0][clock] / b[clock]:.2f}x", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(bars)), [b["name"] for b in bars])
        ax.set_ylabel("ms, " + ("wall clock" if clock == "host_ms" else "GPU (CUDA events)"))
        ax.set_title(f"{cloud} ({c['voxels']:,} voxels): {r.get('layer', '')}", fontsize=9)
        ax.legend(fontsize=7)
    return axes

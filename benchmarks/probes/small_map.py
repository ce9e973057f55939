"""Where the Map step of a small scan spends its time, beside spconv's.

    . benchmarks/gpu_env.sh; python3 benchmarks/probes/small_map.py [--clouds kitti_20k,scannet_20k]
        [--out small_map.json]

Issue #27: on scans of 15-25k voxels the Map step is host-bound. For each crop of
``common.CROPS`` (and the full scans for scale) and each map a network builds (the
submanifold 3x3x3 map, the strided 2x2x2 and 3x3x3 maps), this prints:

* host and GPU milliseconds of ``build_kernel_map`` (wall clock between device-wide
  synchronizes; CUDA events), interleaved with spconv's ``get_indice_pairs`` (Native)
  and ``get_indice_pairs_implicit_gemm`` (MaskImplicitGemm) on the same voxels;
* for the strided maps, our own baseline beside them: the same map with its outputs
  made first by ``output_coordinates`` (one read for their count, then the map's),
  as the library did before it counted them on the device (one read);
* what one call does on the host: kernel launches through ``core.launch``, device->host
  reads (``to_host``, ``read_later``), and the functions with the most own time (cProfile).

Never runs in CI.
"""
import argparse
import cProfile
import pstats
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py

from common import HOST_THEN_GPU, find_data, interleaved, recorded, scan_coords, write_json  # noqa: E402

MAPS = {"subm k3": dict(kernel_size=3), "strided k2 s2": dict(kernel_size=2, stride=2),
        "strided k3 s2": dict(kernel_size=3, stride=2)}
BASELINE = "ours, outputs read first"  # a strided map whose outputs are made (and counted) first: two reads


def spconv_calls(coords, name, spec):
    import torch
    from spconv.core import ConvAlgo
    from spconv.pytorch import ops

    c = coords - coords.min(0)
    shape = (c.max(0) + 2).tolist()
    ind = torch.from_numpy(np.column_stack([np.zeros(len(c), np.int32), c]).astype(np.int32)).cuda()
    k = [spec["kernel_size"]] * 3
    s = [spec.get("stride", 1)] * 3
    subm = s == [1, 1, 1]
    out_shape = shape if subm else ops.get_conv_output_size(shape, k, s, [0, 0, 0], [1, 1, 1])

    def native():
        return ops.get_indice_pairs(ind, 1, shape, ConvAlgo.Native, k, s, [0, 0, 0] if not subm else [1, 1, 1],
                                    [1, 1, 1], [0, 0, 0], subm=subm)

    def implicit():
        return ops.get_indice_pairs_implicit_gemm(ind, 1, shape, ConvAlgo.MaskImplicitGemm, k, s,
                                                  [0, 0, 0] if not subm else [1, 1, 1], [1, 1, 1], [0, 0, 0],
                                                  subm, False, False)

    calls = {}
    for algo, fn in (("Native", native), ("MaskImplicitGemm", implicit)):
        try:
            fn()
            calls[(name, f"spconv {algo}")] = fn
        except Exception as e:  # noqa: BLE001 - a peer's API may differ; say so and go on
            print(f"   spconv {algo} {name}: {type(e).__name__}: {str(e)[:120]}")
    return calls, out_shape


def count_host_work(fn, calls=20):
    """Launches and device reads of one call, and cProfile's top own-time functions."""
    import numba_sc.core.backend as backend
    import numba_sc.core.launch as launch

    counts = {"launches": 0, "reads": 0}
    real_launch, real_read, real_later = launch.launch, backend.to_host, backend.read_later

    def counting_launch(*a, **k):
        counts["launches"] += 1
        return real_launch(*a, **k)

    def counting_read(a):
        counts["reads"] += 1
        return real_read(a)

    def counting_later(a):
        counts["reads"] += 1
        return real_later(a)

    patched = []
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("numba_sc"):
            for attr, new in (("launch", counting_launch), ("to_host", counting_read),
                              ("read_later", counting_later)):
                old = getattr(mod, attr, None)
                if old in (real_launch, real_read, real_later):
                    setattr(mod, attr, new)
                    patched.append((mod, attr, old))
    try:
        fn()
    finally:
        for mod, attr, old in patched:
            setattr(mod, attr, old)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:12]
    top = [(f"{Path(f).name}:{line}:{fn_}", round(v[2] / calls * 1e3, 4), v[1] // calls) for (f, line, fn_), v in rows]
    return counts, top


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=None)
    ap.add_argument("--clouds", default="kitti_20k,scannet_20k,sunrgbd_20k,sunrgbd")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--block", type=int, default=2, help="timed calls per contender and round")
    ap.add_argument("--out", default="small_map.json")
    args = ap.parse_args()

    import cupy

    import numba_sc as ns

    data = find_data(args.data)
    result = {"recorded": recorded("probes/small_map.py"), "clouds": {}}
    for cloud in args.clouds.split(","):
        coords = scan_coords(data, cloud)
        c = cupy.asarray(coords)
        row = result["clouds"][cloud] = {"voxels": len(coords)}
        contenders = {}
        for name, spec in MAPS.items():
            ours = (lambda spec=spec: ns.build_kernel_map(c, assume_sorted=True, **spec))
            ours()
            contenders[(name, "ours")] = ours
            if spec.get("stride", 1) != 1:
                contenders[(name, BASELINE)] = (lambda spec=spec: ns.build_kernel_map(
                    c, assume_sorted=True, out_coords=ns.output_coordinates(c, spec["stride"]), **spec))
            peers, _ = spconv_calls(coords, name, spec)
            contenders.update(peers)
            counts, top = count_host_work(ours)
            row[name] = {"host_work": counts, "top": top}
        times = interleaved(contenders, args.rounds, block=args.block, warmup=3, timers=HOST_THEN_GPU)
        for (name, who), t in times.items():
            row[name][who] = {"host_ms": round(t["host_ms"], 4), "gpu_ms": round(t["gpu_ms"], 4)}
        print(f"{cloud} ({len(coords)} voxels)")
        for name in MAPS:
            r = row[name]
            peers = "  ".join(f"{w}: {r[w]['host_ms']:.3f}/{r[w]['gpu_ms']:.3f}" for w in r
                              if w.startswith("spconv") or w == BASELINE)
            print(f"  {name:14s} ours {r['ours']['host_ms']:.3f}/{r['ours']['gpu_ms']:.3f} ms (host/gpu)  {peers}")
            print(f"  {'':14s} launches {r['host_work']['launches']}, reads {r['host_work']['reads']}")
            for f, ms, n in r["top"][:8]:
                print(f"      {ms:8.4f} ms  x{n:<3d} {f}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()

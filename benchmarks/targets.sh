#!/bin/bash
# The runs behind results/targets.json (issue #27's targets), on one GPU with spconv:
#   . benchmarks/gpu_env.sh; bash benchmarks/targets.sh [OUT] [PARTS]
# OUT: where the result files go (default benchmarks/results); PARTS: any of net_small
# (networks and layer kinds on the ~20k-voxel crops), net (the full scans and 1M random
# voxels), map, dense, train, comma-separated (default all; each part runs in under 10
# minutes on an H200, the lent machine's limit for one command). Then:
#   python3 benchmarks/targets.py --results OUT
set -e
OUT=${1:-benchmarks/results}
PARTS=,${2:-net_small,net,map,dense,train},
B=$(dirname "$0")
# 40 samples in blocks of 2: 20 rounds, so that the lent machine's slow minutes hit every
# contender alike (in blocks of 4, 5 rounds split a slow minute unevenly).
if [[ $PARTS == *,net_small,* ]]; then
  python3 $B/bench_net.py --clouds kitti_20k,scannet_20k,sunrgbd_20k --reps 40 --block 2 --compare-lazy \
    --layers --layer-reps 8 --out $OUT/targets_net_small.json --note "issue #27 targets: small scans, layer kinds"
fi
if [[ $PARTS == *,net,* ]]; then
  python3 $B/bench_net.py --clouds kitti,scannet,sunrgbd,random --reps 40 --block 2 --compare-lazy \
    --out $OUT/targets_net.json --note "issue #27 targets: full scans and 1M random voxels"
fi
if [[ $PARTS == *,map,* ]]; then
  python3 $B/probes/small_map.py --clouds kitti_20k,scannet_20k,sunrgbd_20k --out $OUT/targets_map.json
fi
if [[ $PARTS == *,dense,* ]]; then
  python3 $B/bench_alternatives.py --clouds dense --only layer --dtypes float16 --rounds 10 \
    --out $OUT/targets_dense.json --note "issue #27 targets: the dense cloud's fp16 rows"
fi
if [[ $PARTS == *,train,* ]]; then
  python3 $B/bench_train.py --clouds kitti_20k,scannet_20k,sunrgbd_20k --dtypes float32,float16 \
    --out $OUT/targets_train.json --note "issue #27 targets: the training step, fp32 and fp16 with loss scaling"
fi

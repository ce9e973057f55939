#!/bin/bash
# The runs behind results/targets.json (issue #27's targets), on one GPU with spconv:
#   . benchmarks/gpu_env.sh; bash benchmarks/targets.sh [OUT] [PARTS]
# OUT: where the result files go (default benchmarks/results); PARTS: any of net_small
# (networks and layer kinds on the ~20k-voxel crops), net (the full scans and 1M random
# voxels), map, dense, train, comma-separated (default all; each part runs in under 10
# minutes on an H200, the lent machine's limit for one command). Then:
#   python3 benchmarks/targets.py --issue 27 --results OUT
# Issue #37's runs (speed and memory, with the roofline) are the parts net_small37 (the
# crops: networks, every layer alone with its napkin flops and bytes and the device's
# measured peaks, peak memory), net37 (1M random voxels: the same, layers at 8 samples),
# scans37 (the full scans: networks and peak memory, no layers), train37 (the training
# step on the crops, fp32 and fp16, with its peak memory) and train37_random (the same on
# 1M random voxels, 12 samples); none runs by default:
#   bash benchmarks/targets.sh benchmarks/results net_small37,net37,scans37,train37,train37_random
#   python3 benchmarks/targets.py --issue 37 --results OUT
# (each part is meant to fit the lent machine's 10 minutes a command; see benchmarks/README.md)
set -e
OUT=${1:-benchmarks/results}
PARTS=,${2:-net_small,net,map,dense,train},
KNOWN=,net_small,net,map,dense,train,net_small37,net37,scans37,train37,train37_random,
for p in ${PARTS//,/ }; do
  if [[ $KNOWN != *,$p,* ]]; then
    echo "targets.sh: unknown part '$p'; the parts are ${KNOWN:1:-1}" >&2
    exit 2
  fi
done
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
if [[ $PARTS == *,net_small37,* ]]; then
  python3 $B/bench_net.py --clouds kitti_20k,scannet_20k,sunrgbd_20k --reps 20 --block 2 --layers --layer-reps 8 \
    --memory --out $OUT/targets37_net_small.json --note "issue #37 targets: small scans, layer kinds with roofline, peak memory"
fi
if [[ $PARTS == *,net37,* ]]; then
  python3 $B/bench_net.py --clouds random --reps 20 --block 2 --layers --layer-reps 8 --memory \
    --out $OUT/targets37_net.json --note "issue #37 targets: 1M random voxels, layer kinds with roofline, peak memory"
fi
if [[ $PARTS == *,scans37,* ]]; then
  python3 $B/bench_net.py --clouds kitti,scannet,sunrgbd --reps 20 --block 2 --memory \
    --out $OUT/targets37_scans.json --note "issue #37 targets: full scans, peak memory"
fi
if [[ $PARTS == *,train37,* ]]; then
  python3 $B/bench_train.py --clouds kitti_20k,scannet_20k,sunrgbd_20k --dtypes float32,float16 --memory \
    --out $OUT/targets37_train.json --note "issue #37 targets: the training step on the crops, fp32 and fp16, peak memory"
fi
if [[ $PARTS == *,train37_random,* ]]; then
  python3 $B/bench_train.py --clouds random --dtypes float32,float16 --reps 12 --memory \
    --out $OUT/targets37_train_random.json --note "issue #37 targets: the training step on 1M random voxels, peak memory"
fi

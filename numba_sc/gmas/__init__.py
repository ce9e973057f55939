"""Stages 7-11: Minuet's GMaS step (gather, matrix multiply, scatter), and the layer.

    metadata        7. pairs per offset, the offset order, GEMM groups, each pair's buffer row
    layout          the plan stage 7 hands to stages 8-10 (GmasPlan, PointLists, the offsets' layout)
    plan            build_plan, the library's plan builder (stage 7 as a layer runs it)
    gather          8. the tiled gather into the input buffer (Algorithm 1)
    gemm_grouping   9. offsets sorted by pair count, grouped into batched GEMMs (Section 5.2.2)
    scatter         10. the tiled scatter-sum of partial results, no atomics
    autotune        11. tile sizes per layer (Algorithm 2)
    workspace       the buffers bounded: a layer in windows of buffer rows
    output_ranges   the buffers bounded: a layer by ranges of its outputs, each a map of its own
    conv            sparse_conv3d: the Map step and one dataflow, assembled into a layer
"""

"""The other two ways to compute a layer from its map, beside gather-GEMM-scatter.

    fetch_on_demand  per-offset products added into the outputs with atomics (dataflow="fetch")
    implicit_gemm    output tiles over outputs sorted by offset mask (dataflow="implicit")
    tensor_cores     its top rung's multiply-accumulate: a warp's mma.sync, CUDA C++ in mma.cu
"""

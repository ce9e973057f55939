"""The other two ways to compute a layer from its map, beside gather-GEMM-scatter.

    fetch_on_demand  per-offset products added into the outputs with atomics (dataflow="fetch")
    fetch_shapes     its plan's type (pair list, block table), checks, v2's tiles
    fetch_driver     its plan built on the device, the library's launcher
    implicit_gemm    output tiles over outputs sorted by offset mask (dataflow="implicit")
    implicit_shapes  its tile sizes, checks, the launches of one kernel per mask split
    implicit_driver  its plan built on the device, the rung the library runs, its launcher
    tensor_cores     its top rung's multiply-accumulate: a warp's mma.sync, CUDA C++ in mma.cu
"""

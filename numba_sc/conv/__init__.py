"""The layer: a sparse convolution assembled from the Map step and one dataflow.

    arguments   the layer's argument checks: weight, layer name, a given map, tile sizes
    prepare     the Map step and the plans a layer reads, built once and kept on its map
    dataflow    one layer on one dataflow: gather-GEMM-scatter, fetch-on-demand, implicit GEMM
    choice      dataflow="auto": the choice measured per layer, else a rule of thumb
    layer       sparse_conv3d: checks, map, plan, the dataflow chosen, the output tensor
    tuning      autotune (tile sizes) and choose_dataflow: measured choices for "auto"
    gradient    the layer's backward: input and weight gradients (sparse_conv3d_backward)
"""

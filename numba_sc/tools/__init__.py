"""Tools for reading, checking and timing the engine, and for teaching it.

    ladder      each stage's kernels rung by rung (v1 plain ... the library's), checked and timed
    check       every stage's kernel against its NumPy reference; the first mismatch located
    trace       every intermediate of one convolution, named as in the paper
    demo        the whole pipeline on a scan, kernels beside references
    synthetic   a synthetic LiDAR scene (when no scan is at hand)
    oracle      each path's gradients against the float64 oracle's, per parameter (check_gradients)

For the lessons (the notebooks and the book):

    lesson      a rung's code, the diff to the next rung, what it bought (recorded)
    mma_model   a warp's mma.m16n8k16 and ldmatrix in NumPy: the tensor-core rung, checkable without a GPU
    exercises   the notebooks' exercises: a checker each, against the stage's reference
    results     one source for every number: the recorded results, read and quoted
    tables      markdown tables made from the result files
    counters    the hardware counters (Nsight Compute) and Figures 13-14 as recorded: tables, plots
    prose       every figure the prose quotes checked against its result file (numba-sc figures)
    book        the site, built with Sphinx: every notebook executed, docs/, the API reference
"""

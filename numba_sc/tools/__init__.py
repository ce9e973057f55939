"""Tools for reading, checking and timing the engine.

    ladder      each stage's kernels rung by rung (v1 plain ... the library's), checked and timed
    check       every stage's kernel against its NumPy reference; the first mismatch located
    trace       every intermediate of one convolution, named as in the paper
    demo        the whole pipeline on a scan, kernels beside references
    synthetic   a synthetic LiDAR scene (when no scan is at hand)
"""

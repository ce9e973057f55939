"""What every stage stands on.

    backend       "cuda" (GPU or the simulator) / "reference" (NumPy); arrays cross host and device here
    conventions   int32 coordinates, 64-bit packed keys, kernel offsets: one place for each
    words         feature rows as 4- or 8-byte words (for the gather and the scatter)
    tensor        SparseTensor: sorted coordinates, features, and the kernel maps built on them
    rungs         the kernel-ladder protocol: each stage declares its rungs, reference and workload
"""

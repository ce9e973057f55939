"""What every stage stands on; imports no stage.

    conventions   int32 coordinates, 64-bit packed keys, kernel offsets: one place for each
    device        which device runs the kernels: a GPU, Numba's CUDA simulator, or none
    backend       "cuda" (GPU or the simulator) / "reference" (NumPy); arrays cross host and device here
    files         files written atomically, and the checks before writing
    launch        how a kernel is launched: kernel[blocks, threads](...), and the library's fast path
    fast_launch   the library's fast launcher, the one module that touches Numba's and CuPy's internals
    pieces        small device arrays cut from one allocation (the Map step's flags and counters)
    unique        sorted keys -> unique keys (voxelization, output coordinates and the Map step share it)
    words         feature rows as 4- or 8-byte words (for the gather and the scatter)
    tensor        SparseTensor: sorted coordinates, features, and the kernel maps built on them
    rungs         the kernel-ladder protocol: each stage declares its rungs and reference
    state         everything remembered between calls, in one object; clear_caches() resets it
    measure       how candidates are timed when the library is asked to choose
"""

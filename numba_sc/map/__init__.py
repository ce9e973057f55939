"""Stages 3-6 of Minuet's Map step: which input feeds which output through which offset.

    sorting          3. the library sort of packed keys; runs of equal keys; the duplicate check
    query_segments   4. segment k = sorted(Q) + delta_k, made on the fly (Section 5.1.1)
    backward_search  5. source-block pivots searched in every segment -> query blocks (Section 5.1.2)
    forward_search   6. each query block searched in its source block, in shared memory
    kernel_map       the Map step explained: the KernelMap type, the layer's arguments, the reference
    driver           the library's fast path: stages 3-6 launched back to back, one report read
    method           which method (below) method="auto" runs: measured, else a rule of thumb
    map_step         the one entry, build_kernel_map: picks the method and the backend

The alternatives the paper argues against, giving the same map:

    hash_map         a GPU hash table over the packed keys (method="hash")
    grid_map         a dense location grid over the bounding box (method="grid")
    map_probe        the one probe kernel both of them use
"""

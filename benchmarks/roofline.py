"""How far each layer is from the hardware: the napkin work of a layer call, the device's
measured peaks, and the achieved rate as a share of them (issue #37's roofline column).

Importable without a GPU (CI imports every script): :func:`measured_peaks` imports CuPy
inside. :func:`layer_napkin` and :func:`achieved` are pure functions of numbers.

**The napkin work of one layer call** (:func:`layer_napkin`), the least any
implementation must do, counted on the host from what the layer saw:

* a convolution with a kernel map (kinds ``stem``, ``subm build``, ``subm reuse``,
  ``strided``, ``transposed``): ``flops = 2 * pairs * C_in * C_out``, where ``pairs`` is
  the sum of the map's per-offset counts (a transposed layer reads the strided map it
  inverts backwards: the same pairs); ``bytes`` = the input features read once + the
  output features written once (rows x channels x the feature itemsize) + the weight
  (its own bytes) + 8 bytes a pair (an int32 input and an int32 output index);
* a 1x1x1 layer and the classifier: ``flops = 2 * N * C_in * C_out``, ``bytes = (N C_in +
  N C_out) itemsize`` + the weight;
* BatchNorm (with its ReLU and residual add): ``flops`` counted as 0 (a few per element,
  nothing a GEMM peak measures: it is bandwidth-bound, its row is read in GB/s);
  ``bytes`` = ``N C`` read + ``N C`` written, + ``N C`` read for the residual.

The map's own work (sorting, searching, the GMaS plan) is not in the napkin: a layer
that builds its map does more than it counts, and its row says so by a lower rate.

**The peaks** (:func:`measured_peaks`), measured once per run on the GPU: the TFLOP/s of a
large cuBLAS GEMM through CuPy (``cupy.matmul`` of two n x n matrices, fp32 and fp16;
CuPy's fp32 GEMM does not use TF32 unless ``CUPY_TF32=1``) and the GB/s of a large
device-to-device copy (bytes read + written over its time), both the median of several
runs timed with CUDA events; beside them the datasheet-style peaks computed from the
device's attributes (:func:`numba_sc.tools.rung.device_peaks`: DRAM bandwidth, FP32
CUDA-core FLOP/s). :func:`achieved` divides by the measured ones: a rate the same
hardware reached on the easiest work of its kind.
"""
from __future__ import annotations

import math
import statistics

CONV_KINDS = ("stem", "subm build", "subm reuse", "strided", "transposed")
DENSE_KINDS = ("1x1x1", "classifier")
KINDS = CONV_KINDS + DENSE_KINDS + ("batchnorm",)
PAIR_BYTES = 8  # an int32 input index and an int32 output index


def _count(v, name):
    """``v`` as an int, refused unless it is a whole number >= 0 (a NumPy integer is fine)."""
    whole = hasattr(v, "__index__") or (isinstance(v, float) and math.isfinite(v) and v == int(v))
    if isinstance(v, bool) or not whole or v < 0:
        raise ValueError(f"{name} must be a whole count >= 0, got {v!r}")
    return int(v)


def layer_napkin(kind, n_in, n_out, c_in, c_out, itemsize, pairs=None, weight_bytes=0, residual=False) -> dict:
    """``{"flops", "bytes"}`` of one layer call by the formulas of the module docstring.

    ``kind``: one of :data:`KINDS`; ``n_in``/``n_out``: rows in and out; ``c_in``/``c_out``:
    channels; ``itemsize``: bytes of a feature; ``pairs``: the kernel map's pairs
    (convolutions only, required there); ``weight_bytes``: the weight's bytes (0 for
    BatchNorm); ``residual``: a BatchNorm that adds a residual."""
    if kind not in KINDS:
        raise ValueError(f"unknown layer kind {kind!r}: one of {', '.join(KINDS)}")
    n_in, n_out, c_in, c_out = (_count(v, k) for v, k in ((n_in, "n_in"), (n_out, "n_out"), (c_in, "c_in"),
                                                            (c_out, "c_out")))
    itemsize, weight_bytes = _count(itemsize, "itemsize"), _count(weight_bytes, "weight_bytes")
    if itemsize == 0:
        raise ValueError("itemsize must be the bytes of one feature (2 or 4), got 0")
    features = (n_in * c_in + n_out * c_out) * itemsize
    if kind in CONV_KINDS:
        if pairs is None:
            raise ValueError(f"a {kind} layer needs pairs= (the sum of its kernel map's counts)")
        pairs = _count(pairs, "pairs")
        return {"flops": 2 * pairs * c_in * c_out, "bytes": features + weight_bytes + PAIR_BYTES * pairs}
    if kind in DENSE_KINDS:
        if n_in != n_out:
            raise ValueError(f"a {kind} layer keeps its rows: n_in {n_in} != n_out {n_out}")
        return {"flops": 2 * n_in * c_in * c_out, "bytes": features + weight_bytes}
    if n_in != n_out or c_in != c_out:
        raise ValueError(f"BatchNorm keeps its shape: ({n_in}, {c_in}) in, ({n_out}, {c_out}) out")
    return {"flops": 0, "bytes": (3 if residual else 2) * n_in * c_in * itemsize}


def achieved(flops, nbytes, ms, dtype, peaks) -> dict:
    """The rates of work ``flops``/``nbytes`` done in ``ms`` milliseconds, and their share of
    ``peaks`` (:func:`measured_peaks`' dict): ``tflops``, ``gbps``, ``pct_flops`` (of the
    GEMM peak of ``dtype``), ``pct_bandwidth`` (of the copy bandwidth); the two shares
    None without peaks."""
    if not ms or ms <= 0 or not math.isfinite(ms):
        raise ValueError(f"ms must be a positive time, got {ms!r}")
    seconds = ms * 1e-3
    tflops, gbps = flops / seconds / 1e12, nbytes / seconds / 1e9
    out = {"tflops": tflops, "gbps": gbps, "pct_flops": None, "pct_bandwidth": None}
    if peaks:
        gemm = peaks.get("gemm_tflops", {})
        if dtype not in gemm:
            raise ValueError(f"no GEMM peak for dtype {dtype!r} in the peaks (have {sorted(gemm)})")
        out["pct_flops"] = 100.0 * tflops / gemm[dtype]
        out["pct_bandwidth"] = 100.0 * gbps / peaks["copy_gbps"]
    return out


def measured_peaks(n=8192, reps=7, copy_mib=1024) -> dict:
    """This GPU's measured peaks (see the module docstring): ``gemm_tflops`` (dtype ->
    TFLOP/s of an ``n`` x ``n`` x ``n`` GEMM), ``copy_gbps`` (a ``copy_mib`` MiB
    device-to-device copy, bytes read + written), each the median of ``reps`` runs after
    a warm-up, and ``datasheet`` (bandwidth GB/s and FP32 TFLOP/s from the device's
    attributes, or None). Needs CuPy and a GPU."""
    import cupy

    from common import gpu_ms
    from numba_sc.tools.rung import device_peaks

    if n < 256 or reps < 1 or copy_mib < 1:
        raise ValueError(f"n >= 256, reps >= 1 and copy_mib >= 1 please (got {n}, {reps}, {copy_mib})")
    out = {"gemm_tflops": {}, "gemm_n": n, "reps": reps}
    rng = cupy.random.default_rng(0)
    for dt in ("float32", "float16"):
        a = rng.standard_normal((n, n), dtype=cupy.float32).astype(dt)
        b = rng.standard_normal((n, n), dtype=cupy.float32).astype(dt)
        c = cupy.empty((n, n), dtype=dt)
        cupy.matmul(a, b, out=c)  # warm-up: the handle, the algorithm
        ms = statistics.median(gpu_ms(lambda: cupy.matmul(a, b, out=c)) for _ in range(reps))
        out["gemm_tflops"][dt] = 2.0 * n ** 3 / (ms * 1e-3) / 1e12
        del a, b, c
    src = cupy.ones(copy_mib * 2 ** 20 // 4, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    cupy.copyto(dst, src)
    ms = statistics.median(gpu_ms(lambda: cupy.copyto(dst, src)) for _ in range(reps))
    out["copy_gbps"] = 2.0 * src.nbytes / (ms * 1e-3) / 1e9
    out["copy_mib"] = copy_mib
    del src, dst
    cupy.get_default_memory_pool().free_all_blocks()
    sheet = device_peaks()
    out["datasheet"] = None if sheet is None else {"bandwidth_gbps": sheet.bandwidth / 1e9,
                                                   "fp32_tflops": sheet.flops / 1e12, "source": sheet.source}
    out["method"] = ("cupy.matmul n^3 GEMM (cuBLAS) and cupy.copyto device-to-device, CUDA events, median; "
                     "datasheet: numba_sc.tools.rung.device_peaks()")
    return out

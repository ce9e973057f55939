"""Issue #37's measurement side, without a GPU: the napkin work of a layer call
(benchmarks/roofline.py), the rates against the peaks, the targets file's rows
(benchmarks/targets.py --issue 37) and the CuPy peak-memory hook's accounting
(benchmarks/common.py cupy_peak) against a stand-in pool."""
import contextlib
import json
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import common  # noqa: E402
import roofline  # noqa: E402
import targets  # noqa: E402


def test_napkin_of_a_convolution():
    # 1000 pairs, 16 -> 32 channels, fp16: 2*1000*16*32 flops; 500 rows in x 16 + 400 out x 32,
    # 2 bytes each, + the weight's 27*16*32*2 bytes + 8 bytes a pair
    got = roofline.layer_napkin("subm reuse", 500, 400, 16, 32, 2, pairs=1000, weight_bytes=27 * 16 * 32 * 2)
    assert got == {"flops": 1_024_000, "bytes": (500 * 16 + 400 * 32) * 2 + 27648 + 8000}
    assert roofline.layer_napkin("transposed", 400, 500, 32, 16, 4, pairs=1000, weight_bytes=0)["flops"] == 1_024_000


def test_napkin_of_dense_layers_and_batchnorm():
    assert roofline.layer_napkin("classifier", 10, 10, 96, 19, 4, weight_bytes=96 * 19 * 4) == \
        {"flops": 2 * 10 * 96 * 19, "bytes": (10 * 96 + 10 * 19) * 4 + 96 * 19 * 4}
    assert roofline.layer_napkin("batchnorm", 100, 100, 32, 32, 2) == {"flops": 0, "bytes": 2 * 100 * 32 * 2}
    assert roofline.layer_napkin("batchnorm", 100, 100, 32, 32, 2, residual=True)["bytes"] == 3 * 100 * 32 * 2


@pytest.mark.parametrize("call, message", [
    (lambda: roofline.layer_napkin("conv", 1, 1, 1, 1, 4), "unknown layer kind 'conv'"),
    (lambda: roofline.layer_napkin("strided", 1, 1, 1, 1, 4), "needs pairs="),
    (lambda: roofline.layer_napkin("stem", 1, 1, 1, 1, 4, pairs=-3), "pairs must be a whole count"),
    (lambda: roofline.layer_napkin("1x1x1", 5, 4, 1, 1, 4), "keeps its rows"),
    (lambda: roofline.layer_napkin("batchnorm", 5, 5, 2, 3, 4), "keeps its shape"),
    (lambda: roofline.layer_napkin("batchnorm", 5, 5, 2, 2, 0), "itemsize"),
    (lambda: roofline.achieved(1, 1, 0, "float32", None), "positive time"),
    (lambda: roofline.achieved(1, 1, 1, "int8", {"gemm_tflops": {"float32": 1.0}, "copy_gbps": 1.0}), "no GEMM peak"),
])
def test_bad_arguments_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_achieved_rates_and_shares():
    peaks = {"gemm_tflops": {"float32": 50.0, "float16": 500.0}, "copy_gbps": 2000.0}
    a = roofline.achieved(2e12, 1e9, 100.0, "float16", peaks)  # 2 TFLOP and 1 GB in 0.1 s
    assert a["tflops"] == pytest.approx(20.0) and a["gbps"] == pytest.approx(10.0)
    assert a["pct_flops"] == pytest.approx(4.0) and a["pct_bandwidth"] == pytest.approx(0.5)
    assert roofline.achieved(2e12, 1e9, 100.0, "float32", None)["pct_flops"] is None


def _layer(kind, ours, native, mig, flops, nbytes):
    return {"name": kind, "kind": kind, "numba-sc": ours, "spconv Native": native, "spconv MaskImplicitGemm": mig,
            "flops": flops, "bytes": nbytes}


def _memory(ours, native, mig):
    return {k: {"peak_bytes": v, "extra_bytes": v // 2, "before_bytes": v - v // 2}
            for k, v in (("numba-sc", ours), ("spconv Native", native), ("spconv MaskImplicitGemm", mig))}


def test_targets_37_rows(tmp_path):
    net = {"peaks": {"gemm_tflops": {"float32": 50.0, "float16": 400.0}, "copy_gbps": 2500.0},
           "recorded": {"device": "GPU", "date": "2030-01-01", "commit": "abc"},
           "runs": [{"net": "unet42", "cloud": "kitti_20k", "n": 20000, "dtype": "float32",
                     "network": {"numba-sc": {"ms": 6.0}, "spconv Native": {"ms": 10.0},
                                 "spconv MaskImplicitGemm": {"ms": 8.0}, "(Native, own outputs)": {"ms": 1.0}},
                     "layers": [_layer("subm reuse", 1.0, 2.0, 1.5, 5e9, 1e9), _layer("subm reuse", 1.0, 1.0, 2.5, 5e9, 1e9),
                                _layer("batchnorm", 0.5, 0.4, 0.6, 0, 2e8)],
                     "memory": _memory(300, 200, 250)},
                    {"net": "resnet21", "cloud": "kitti", "n": 90000, "dtype": "float16",
                     "network": {"numba-sc": {"ms": 9.0}, "spconv Native": {"ms": 10.0},
                                 "spconv MaskImplicitGemm": {"ms": 12.0}}}]}
    train = {"recorded": {"device": "GPU", "date": "2030-01-02", "commit": "abc"},
             "runs": [{"net": "resnet21", "cloud": "random", "n": 10 ** 6, "dtype": "float16",
                       "step": {"numba-sc": {"ms": 80.0}, "numba-sc forward only": {"ms": 30.0},
                                "spconv Native": {"ms": 100.0}, "spconv MaskImplicitGemm": {"ms": 90.0}},
                       "memory": _memory(100, 90, 60)}]}
    (tmp_path / "targets37_net_small.json").write_text(json.dumps(net))
    (tmp_path / "targets37_train_random.json").write_text(json.dumps(train))
    out = targets.collect("37", tmp_path)
    rows = {(r["target"], r["work"], r["cloud"]): r for r in out["rows"]}
    crop = rows[("network, 20k crop", "MinkUNet42 forward", "kitti_20k")]
    assert crop["ratio"] == 0.75 and crop["limit"] == 0.75 and crop["met"] is True and crop["best_spconv"] == "MaskImplicitGemm"
    scan = rows[("network, full scan", "SparseResNet21 forward", "kitti")]
    assert scan["limit"] is None and scan["met"] is None and scan["ratio"] == 0.9
    subm = rows[("layer kind", "subm reuse (MinkUNet42)", "kitti_20k")]
    # 2 ms of ours against the sum of each algorithm's (3.0 Native, 4.0 MIG); 10 GFLOP and 2 GB in 2 ms
    assert subm["ratio"] == pytest.approx(2 / 3, abs=1e-4) and subm["layers"] == 2
    assert subm["tflops"] == pytest.approx(5.0) and subm["gbps"] == pytest.approx(1000.0)
    assert subm["pct_flops"] == pytest.approx(10.0) and subm["pct_bandwidth"] == pytest.approx(40.0)
    bn = rows[("layer kind", "batchnorm (MinkUNet42)", "kitti_20k")]
    assert bn["ratio"] == 1.25 and bn["met"] is False and bn["tflops"] == 0.0 and bn["gbps"] == pytest.approx(400.0)
    fwd = rows[("peak memory, forward", "MinkUNet42 forward", "kitti_20k")]
    assert fwd["ratio"] == 1.5 and fwd["met"] is True and fwd["best_spconv"] == "Native"
    step = rows[("peak memory, training step", "SparseResNet21 step", "random")]
    assert step["ratio"] == pytest.approx(100 / 60, abs=1e-4) and step["met"] is False
    ts = rows[("training step", "SparseResNet21 step", "random")]
    assert ts["ratio"] == pytest.approx(80 / 90, abs=1e-4) and ts["limit"] == 0.85 and ts["met"] is False
    assert out["peaks"] == {"targets37_net_small.json": net["peaks"]}
    assert out["recorded"]["date"] == "2030-01-01, 2030-01-02"
    with pytest.raises(ValueError, match="unknown issue"):
        targets.collect("12", tmp_path)


def test_cupy_peak_counts_allocated_bytes_with_a_hook(monkeypatch):
    """A stand-in for CuPy's pool calls the registered hooks as CuPy's does (keyword
    arguments, after the pool's bookkeeping): the peak is the running count's maximum."""
    hooks = []

    class MemoryHook:
        def __enter__(self):
            hooks.append(self)

        def __exit__(self, *exc):
            hooks.remove(self)

    class Pool:
        used = 1000

        def used_bytes(self):
            return self.used

        def malloc(self, n):
            self.used += n
            for h in hooks:
                h.malloc_postprocess(device_id=0, size=n, mem_size=n, mem_ptr=1, pmem_id=id(n))

        def free(self, n):
            self.used -= n
            for h in hooks:
                h.free_postprocess(device_id=0, mem_size=n, mem_ptr=1, pmem_id=id(n))

    pool = Pool()
    cupy = types.ModuleType("cupy")
    cupy.get_default_memory_pool = lambda: pool
    cupy.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0, deviceSynchronize=lambda: None))
    memory_hook = types.ModuleType("cupy.cuda.memory_hook")
    memory_hook.MemoryHook = MemoryHook
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", types.ModuleType("cupy.cuda"))
    sys.modules["cupy.cuda"].memory_hook = memory_hook
    monkeypatch.setitem(sys.modules, "cupy.cuda.memory_hook", memory_hook)

    def work():  # 1000 -> 1512 -> 3560 -> 3048 -> 4072 (the peak) -> 2024
        pool.malloc(512)
        pool.malloc(2048)
        pool.free(512)
        pool.malloc(1024)
        pool.free(2048)
        return "kept"

    got = common.cupy_peak(work)
    assert got["before_bytes"] == 1000 and got["peak_bytes"] == 4072 and got["extra_bytes"] == 3072
    assert got["after_bytes"] == 2024 and not hooks
    with contextlib.suppress(ZeroDivisionError):
        common.cupy_peak(lambda: 1 / 0)
    assert not hooks, "the hook is unregistered even when the call raises"

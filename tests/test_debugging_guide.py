"""The debugging guide's session really works: pdb stops inside a simulated kernel."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_pdb_stops_inside_a_simulated_kernel():
    commands = "p cuda.threadIdx.x, cuda.blockIdx.x\np tile\np x._item[:4]\nc\n"
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONBREAKPOINT="pdb.set_trace")
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "debug_kernel.py")], input=commands,
                         capture_output=True, text=True, env=env, timeout=120)
    out = run.stdout
    assert run.returncode == 0, run.stderr
    assert "(0, 1)" in out  # stopped in thread 0 of block 1
    assert "8.,  9., 10., 11., 12., 13., 14., 15." in out  # that block's shared memory
    assert "array([0., 1., 2., 3.]" in out
    assert "block sums: [28. 92.]" in out

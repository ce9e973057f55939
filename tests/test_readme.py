"""The README's ten-line example runs as printed (default backend: the GPU, else NumPy)."""
import os
import re
import subprocess
import sys

from conftest import DATA_DIR, ROOT, load_scan


def test_readme_example_runs():
    load_scan("semantickitti")  # skips when the data is absent
    code = re.search(r"## Ten lines\n\n```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    code = code.replace('"../shared/data/', '"' + str(DATA_DIR) + '/')
    # Not under the simulator: 94k voxels there would take hours. Without a GPU the
    # default backend is then the NumPy reference.
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]

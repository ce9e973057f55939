"""Execute every teaching notebook in notebooks/ and check it ran clean and drew a figure.

Notebooks are committed without outputs; this test is what runs them. Each one is executed
top to bottom in a fresh kernel ("python3", i.e. the ipykernel of this interpreter) with
notebooks/ as the working directory, exactly as a student would open it. The kernel inherits
this process's environment, so NUMBA_ENABLE_CUDASIM set by conftest.py (or by you) and
NUMBA_SC_DATA reach the notebook.
"""
import os
import time
from pathlib import Path

import pytest

from conftest import DATA_DIR

nbformat = pytest.importorskip("nbformat", reason="nbformat is needed to read notebooks (pip install '.[dev]')")
nbclient = pytest.importorskip("nbclient", reason="nbclient is needed to run notebooks (pip install '.[dev]')")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 300


def test_there_are_notebooks():
    # Guards the parametrized test below: an empty glob would otherwise pass vacuously.
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOK_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stripped(path):
    """Committed notebooks carry no outputs: the repository stays small, this test runs them."""
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, f"{path.name}: cells {dirty} have outputs; clear them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path):
    if not DATA_DIR.is_dir():
        pytest.skip(f"the notebooks read real scans from {DATA_DIR}, which is missing "
                    "(set NUMBA_SC_DATA to the folder holding semantickitti_000000.bin)")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    t0 = time.perf_counter()
    try:
        client.execute(cwd=str(NOTEBOOK_DIR))
    except nbclient.exceptions.CellExecutionError as err:
        pytest.fail(f"{path.name} failed:\n{err}")
    elapsed = time.perf_counter() - t0
    print(f"{path.name}: executed in {elapsed:.1f} s")

    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: error outputs {[e.ename for e in errors]}"
    figures = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
               if o.output_type in ("display_data", "execute_result") and "image/png" in o.get("data", {})]
    assert figures, f"{path.name} produced no figure (no image/png output)"

    # Keep the executed copy for a human to look at, if asked to.
    out_dir = os.environ.get("NUMBA_SC_NOTEBOOK_OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, Path(out_dir) / path.name)

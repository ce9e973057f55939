"""What the package ships (issue #36): the sdist is the source and its tests run; the wheel is
the package alone; the metadata tells a package index what it needs to show.

The sdist and the wheel are built once for this module with ``python -m build`` (the wheel from
the sdist, as pip builds one), without build isolation: the dev extras install ``build`` and a
setuptools that writes an SPDX license, so nothing is downloaded. They are built from a copy of
the checkout without its build leftovers, because an old ``numba_sc.egg-info`` carries its list
of files into the next sdist and would hide a file MANIFEST.in forgot. ``.ci/run`` installs the
wheel into a fresh virtual environment and runs it from outside the checkout.
"""
import email.parser
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import ROOT, SCANS

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
DESCRIPTION = ROOT / PYPROJECT["project"]["readme"]["file"]
# Made by tools or local to one machine (as .gitignore says): never source, never shipped.
NOT_SOURCE = ("__pycache__", "*.pyc", "*.egg-info", ".venv", "build", "dist", ".git", ".pytest_cache",
              ".hypothesis", ".ipynb_checkpoints", ".ab",
              "generated")  # docs/api/generated: the API pages' sources, written by Sphinx (autosummary)
# The folders the sdist ships whole: the tests, and what the tests read besides the package.
SHIPPED_FOLDERS = ("numba_sc", "tests", "docs", "notebooks", "benchmarks", "examples")


@dataclass
class Built:
    sdist: Path
    wheel: Path
    sdist_names: set  # paths inside the sdist, without its top folder (numba_sc-0.1.0/)
    wheel_names: set


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    run = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp / "dist"), str(src)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (
        "python -m build failed (where it names a missing dependency: the dev extras install build and "
        f"setuptools>=77.0.3, run .venv/bin/pip install -e '.[dev]' again)\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    (sdist,), (wheel,) = (tmp / "dist").glob("*.tar.gz"), (tmp / "dist").glob("*.whl")
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        sdist_names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n and tar.getmember(n).isfile()}
    with zipfile.ZipFile(wheel) as z:
        wheel_names = set(z.namelist())
    assert top == f"numba_sc-{_version()}"
    return Built(sdist, wheel, sdist_names, wheel_names)


def _version():
    import numba_sc

    return numba_sc.__version__


def _source_files(folder):
    """The files under ``ROOT / folder`` that are source, as paths relative to ROOT."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(ROOT / folder):
        dirnames[:] = [d for d in dirnames if not any(Path(d).match(p) for p in NOT_SOURCE)]
        for f in filenames:
            if not any(Path(f).match(p) for p in NOT_SOURCE):
                out.add((Path(dirpath) / f).relative_to(ROOT).as_posix())
    return out


def _metadata(built):
    with zipfile.ZipFile(built.wheel) as z:
        return email.parser.Parser().parsestr(z.read(f"numba_sc-{_version()}.dist-info/METADATA").decode())


# --------------------------------------------------------------------------- the sdist
def test_sdist_holds_every_test_and_what_the_tests_read(built):
    assert {"tests/conftest.py", "tests/helpers.py", "tests/test_packaging.py"} <= built.sdist_names
    subfolders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert subfolders and all(any(n.startswith(f"tests/{d}/") for n in built.sdist_names) for d in subfolders)
    expected = set().union(*(_source_files(f) for f in SHIPPED_FOLDERS))
    expected |= {"README.md", "LICENSE", "pyproject.toml", "MANIFEST.in", DESCRIPTION.name}
    missing = sorted(expected - built.sdist_names)
    assert not missing, f"the sdist lacks {len(missing)} source files (MANIFEST.in?): {missing[:20]}"


def test_sdist_holds_no_scans_and_nothing_built(built):
    scans = {fname for fname, _, _ in SCANS.values()}
    wrong = sorted(n for n in built.sdist_names
                   if Path(n).name in scans or Path(n).suffix in (".bin", ".label", ".pyc") or "__pycache__" in n)
    assert not wrong, wrong


def test_the_sdists_tests_run_without_the_scans(built, tmp_path):
    """Unpacked elsewhere, the sdist's tests collect (conftest.py, helpers and every folder
    there), and a test of the real scan skips, naming NUMBA_SC_DATA, where no scan is."""
    with tarfile.open(built.sdist) as tar:
        # (the "data" filter: Python 3.12, and 3.11 from 3.11.4)
        tar.extractall(tmp_path, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    (unpacked,) = tmp_path.iterdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # (this run's, not theirs)
    env.update(NUMBA_SC_DATA=str(tmp_path / "no-scans-here"), NUMBA_ENABLE_CUDASIM="1")
    pytest_ = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q"]
    # (python -m puts the current folder first on sys.path: the sdist's own numba_sc is tested)
    collect = subprocess.run([*pytest_, "--collect-only", "-rs"], cwd=unpacked, env=env, capture_output=True,
                             text=True, timeout=600)
    assert collect.returncode == 0, collect.stdout[-3000:] + collect.stderr[-3000:]
    collected = {line.split("::")[0] for line in collect.stdout.splitlines() if "::" in line}
    # A module that skips itself where an optional package is missing (the notebook tools
    # without the dev extras) is collected as a skip: "SKIPPED [1] tests/x.py:12: reason".
    collected |= set(re.findall(r"SKIPPED \[\d+\] (tests/\S+\.py):", collect.stdout))
    optional = {"tests/nn/test_torch_adapter.py"}  # (skipped at collection without PyTorch)
    expected = {p for p in _source_files("tests") if re.search(r"/test_[^/]*\.py$", p)}
    assert expected - optional <= collected, sorted(expected - optional - collected)
    one = "tests/test_edges.py::test_train_refuses_labels_of_another_length"
    run = subprocess.run([*pytest_, "-rs", one], cwd=unpacked, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "1 skipped" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    assert "set NUMBA_SC_DATA to the folder that holds semantickitti_000000.bin" in run.stdout


# --------------------------------------------------------------------------- the wheel
def test_wheel_is_the_package_alone(built):
    dist_info = f"numba_sc-{_version()}.dist-info/"
    others = sorted(n for n in built.wheel_names if not n.startswith(("numba_sc/", dist_info)))
    assert not others, f"the wheel holds more than the package (tests, benchmarks, notebooks?): {others[:20]}"
    package = _source_files("numba_sc")
    assert {"numba_sc/dataflows/mma.cu", "numba_sc/py.typed"} <= package  # (what the next line must find)
    assert sorted(package - built.wheel_names) == []
    with zipfile.ZipFile(built.wheel) as z:
        assert z.read(f"{dist_info}licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        assert "numba-sc = numba_sc.__main__:main" in z.read(f"{dist_info}entry_points.txt").decode()


# --------------------------------------------------------------------------- the metadata
def test_metadata_license_urls_and_python(built):
    meta = _metadata(built)
    assert tuple(map(int, meta["Metadata-Version"].split("."))) >= (2, 4)  # (License-Expression: PEP 639)
    assert meta["Version"] == _version()
    assert meta["License-Expression"] == "MIT" and meta["License"] is None
    assert meta.get_all("License-File") == ["LICENSE"]
    assert meta["Author"] or meta["Author-email"]
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert {"Homepage", "Issues"} <= set(urls) and all(u.startswith("https://") for u in urls.values()), urls
    # The code needs Python 3.11 (BaseException.add_note, numba_sc/train/data.py).
    assert meta["Requires-Python"] == ">=3.11"


def test_classifiers_are_known_and_agree_with_the_rest(built):
    trove = pytest.importorskip("trove_classifiers", reason="the dev extras' list of known classifiers")
    known, deprecated_classifiers = trove.classifiers, trove.deprecated_classifiers

    found = _metadata(built).get_all("Classifier")
    assert found and not [c for c in found if c not in known or c in deprecated_classifiers]
    # PEP 639: the license is said once, by the expression; a License classifier beside it is refused.
    assert not [c for c in found if c.startswith("License ::")]
    versions = sorted(tuple(map(int, c.rsplit(" ", 1)[1].split("."))) for c in found
                      if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c))
    assert versions and ">=%d.%d" % versions[0] == _metadata(built)["Requires-Python"]
    assert "Typing :: Typed" in found and (ROOT / "numba_sc" / "py.typed").is_file()


# --------------------------------------------------------------------------- the description
def relative_links(markdown):
    """What reads wrong on a package index, where the page stands alone: links and images
    whose target is not an absolute address (outside code), paths that climb out of a
    folder (``../``) and the install from a checkout (``pip install -e``), anywhere."""
    prose = re.sub(r"```.*?```|`[^`\n]*`", "", markdown, flags=re.S)
    targets = re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)", prose)
    targets += re.findall(r"""(?:href|src)\s*=\s*["']([^"']+)""", prose)
    found = [t for t in targets if not re.match(r"(https?://|mailto:|#)", t)]
    found += re.findall(r"\.\./[\w./-]*", markdown)
    found += re.findall(r"pip install -e\b", markdown)
    return found


def test_relative_links_finds_what_reads_wrong():
    """The check rejects the README (written for a checkout) and a made-up page; it passes
    absolute links, anchors and ordinary text."""
    assert relative_links((ROOT / "README.md").read_text(encoding="utf-8"))
    bad = "[the notes](docs/notation.md) ![plot](img/a.png) <a href='x.html'>x</a> ../shared/data pip install -e ."
    assert relative_links(bad) == ["docs/notation.md", "img/a.png", "x.html", "../shared/data", "pip install -e"]
    assert relative_links("[paper](https://doi.org/1) [up](#install) 3 / 4 = 0.75 cd .. `x[0](y)`") == []


def test_the_index_gets_the_description_and_it_reads_right(built):
    text = DESCRIPTION.read_text(encoding="utf-8")
    meta = _metadata(built)
    assert meta["Description-Content-Type"].startswith("text/markdown")
    assert meta.get_payload().strip() == text.strip()
    assert relative_links(text) == []


def test_the_descriptions_example_runs(tmp_path):
    """The description's Python runs as printed, outside the checkout, with the kernels under the
    simulator (they are then the default backend) checked against the NumPy reference."""
    (code,) = re.findall(r"```python\n(.*?)```", DESCRIPTION.read_text(encoding="utf-8"), re.S)
    assert "assert" in code  # (the example checks itself: running is the test)
    code += "\nassert ns.resolve_backend(None) == 'cuda'  # (the kernels ran, not the reference twice)\n"
    path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=os.pathsep.join(path))
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]

"""The package's layout keeps its promises: every module is importable by its path
(no function or re-export shadows one), no module reaches into another's private
names, the modules import each other without a cycle and in the pipeline's order
(function-level imports counted), and a stage module opens with its lesson."""
import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import numba_sc

PKG = Path(numba_sc.__file__).parent
OPTIONAL = {"numba_sc.nn.torch_adapter", "numba_sc.nn.torch_layers", "numba_sc.nn.torch_models"}  # need PyTorch


def _modules():
    """(dotted name, file) of every module and package of numba_sc."""
    out = [("numba_sc", PKG / "__init__.py")]
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join(parts)
        if name != "numba_sc":
            out.append((name, f))
    return out


MODULES = dict(_modules())


def _is_package(name):
    return MODULES[name].name == "__init__.py"


def _resolve(module, node):
    """The modules an ImportFrom node of ``module`` loads, as dotted names of numba_sc."""
    if node.level:
        base = module.split(".") if _is_package(module) else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if not target.startswith("numba_sc"):
        return target, []
    loaded = [target] if target in MODULES else []
    for alias in node.names:  # `from pkg import submodule`
        sub = f"{target}.{alias.name}"
        if sub in MODULES:
            loaded.append(sub)
    return target, loaded


def _imports(tree):
    """Every import statement of the module, wherever it stands: at the top, under an
    ``if``/``try``, or inside a function (it runs when the function is called)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def _loaded(name, node):
    """The modules of numba_sc an import statement of ``name`` loads."""
    if isinstance(node, ast.ImportFrom):
        return _resolve(name, node)[1]
    return [a.name for a in node.names if a.name in MODULES]


def _parents(name):
    """The subpackages whose __init__ runs before ``name`` (the root excluded)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


@pytest.mark.parametrize("name", sorted(set(MODULES) - OPTIONAL))
def test_every_module_is_importable_by_its_path(name):
    mod = importlib.import_module(name)
    assert type(mod).__name__ == "module"
    parent, _, leaf = name.rpartition(".")
    if parent:
        # what the parent package's attribute of that name is: the module itself,
        # never a function or class of the same name (numba_sc.trace was once rebound)
        assert getattr(importlib.import_module(parent), leaf) is mod, f"{parent}.{leaf} is not the module"


def test_walk_packages_finds_the_same_modules():
    found = {m.name for m in pkgutil.walk_packages(numba_sc.__path__, "numba_sc.")}
    assert found == set(MODULES) - {"numba_sc"}


def test_no_module_imports_private_names_of_another():
    bad = []
    for name, f in MODULES.items():
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target, _ = _resolve(name, node)
                if not target.startswith("numba_sc") or target == name:
                    continue
                bad += [f"{name}: from {target} import {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, "\n".join(bad)


def _edges():
    """{module: the modules it imports}, function-level imports counted, with the
    subpackages whose ``__init__`` runs first (the root and the module's own
    packages excluded)."""
    edges = {name: set() for name in MODULES}
    for name, f in MODULES.items():
        for node in _imports(ast.parse(f.read_text())):
            for t in _loaded(name, node):
                for dep in _parents(t) + [t]:
                    if dep != name and dep != "numba_sc" and not name.startswith(dep + "."):
                        edges[name].add(dep)
    return edges


def _cycles(edges):
    """The import cycles a depth-first walk of ``edges`` meets, one per back edge, each
    as ``a -> b -> ... -> a``."""
    state, path, found = {}, [], []

    def visit(n):
        state[n] = "open"
        path.append(n)
        for m in sorted(edges[n]):
            if state.get(m) == "open":
                found.append(" -> ".join(path[path.index(m):] + [m]))
            elif m not in state:
                visit(m)
        path.pop()
        state[n] = "done"

    for n in sorted(edges):
        if n not in state:
            visit(n)
    return found


def test_no_import_cycle():
    found = _cycles(_edges())
    assert not found, "import cycle: " + "\nimport cycle: ".join(found)


# The folders in the pipeline's order, low to high: a module imports modules of its own
# folder or of a lower one, never of a later one (the package root may import anything).
PIPELINE = ("core", "coords", "map", "gmas", "dataflows", "conv", "nn", "train", "tools", "__main__")


def _folder(name):
    """The pipeline folder of module ``name`` (None for the package root)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def test_imports_follow_the_pipeline():
    bad = []
    for name, deps in sorted(_edges().items()):
        here = _folder(name)
        if here is None:
            continue
        assert here in PIPELINE, f"{name}: its folder {here!r} has no place in PIPELINE"
        for dep in sorted(deps):
            if any(d.startswith(dep + ".") for d in deps):
                continue  # a package whose module is reported below
            there = _folder(dep)
            if here == "core" and there != "core":
                bad.append(f"{name} imports {dep}: core imports no other folder")
            elif PIPELINE.index(there) > PIPELINE.index(here):
                bad.append(f"{name} imports {dep}, of a later folder ({here} < {there})")
    assert not bad, "imports against the pipeline:\n" + "\n".join(bad)


def _plant(monkeypatch, marker, source):
    """Make ``ast.parse`` add ``source`` inside a new function of the module whose text
    holds ``marker``: a function-level import the checks must see."""
    real = ast.parse

    def planted(src, *a, **k):
        tree = real(src, *a, **k)
        if marker in src:
            body = "def _planted():\n" + "".join(f"    {line}\n" for line in source.splitlines())
            tree.body += real(body).body
        return tree

    monkeypatch.setattr(ast, "parse", planted)


DEVICE = "Which device runs the kernels"  # core/device.py's docstring
MODELS = "The two networks of the Minuet paper's evaluation (Section 6)"  # nn/models.py


def test_the_cycle_check_sees_a_cycle(monkeypatch):
    """The checks above must be able to fail: a back edge planted inside a function
    of core/device.py (which the Map step imports) is reported by both."""
    _plant(monkeypatch, DEVICE, "from ..map.kernel_map import build_kernel_map")
    with pytest.raises(AssertionError, match=r"import cycle: [^\n]*numba_sc\.core\.device -> numba_sc\.map"):
        test_no_import_cycle()
    with pytest.raises(AssertionError, match="core.device imports numba_sc.map.kernel_map"):
        test_imports_follow_the_pipeline()


def test_the_pipeline_check_sees_a_later_folder(monkeypatch):
    """A function-level ``from .. import x`` of a later folder is reported even where it
    closes no cycle: nn/models.py (nothing in train imports the models) reaching into train."""
    _plant(monkeypatch, MODELS, "from ..train import loss")
    with pytest.raises(AssertionError, match="numba_sc.nn.models imports numba_sc.train.loss, of a later folder"):
        test_imports_follow_the_pipeline()
    monkeypatch.undo()
    _plant(monkeypatch, MODELS, "from .. import train")  # a package, by the relative form
    with pytest.raises(AssertionError, match="numba_sc.nn.models imports numba_sc.train, of a later folder"):
        test_imports_follow_the_pipeline()


LESSON_LINES = 150  # a reader who opens a stage module meets its reference and its v1 on the first screens


def _lesson_problems(name, tree):
    """Where module ``name`` (parsed) declares a module-level ``LADDER`` but does not
    begin its first ``def *_reference`` and its first ``*_v1`` definition within
    :data:`LESSON_LINES` lines: the idea, the reference, v1 first; the rest after."""
    declares = any(isinstance(n, (ast.Assign, ast.AnnAssign)) and any(
        isinstance(t, ast.Name) and t.id == "LADDER" for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))
        for n in tree.body)
    if not declares:
        return []
    defs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    out = []
    for what, test in (("*_reference", lambda d: d.name.endswith("_reference")),
                       ("*_v1", lambda d: d.name.endswith("_v1") and len(d.name) > 3)):
        starts = [min([d.lineno] + [x.lineno for x in d.decorator_list]) for d in defs if test(d)]
        if not starts:
            out.append(f"{name}: declares a LADDER but defines no {what}")
        elif min(starts) > LESSON_LINES:
            out.append(f"{name}: its first {what} begins at line {min(starts)}, after line {LESSON_LINES}")
    return out


def test_stage_modules_start_with_the_lesson():
    bad = [p for name, f in sorted(MODULES.items()) for p in _lesson_problems(name, ast.parse(f.read_text()))]
    assert not bad, "stage modules whose lesson does not come first:\n" + "\n".join(bad)


def test_the_lesson_check_sees_a_late_rung():
    """The check above must be able to fail: a v1 below line 150, a missing reference."""
    late = "LADDER = None\n\ndef scale_reference(x):\n    return x\n" + "\n" * 200 + "@jit\ndef scale_v1(x):\n    pass\n"
    [problem] = _lesson_problems("planted", ast.parse(late))
    assert "first *_v1 begins at line 205" in problem
    [problem] = _lesson_problems("planted", ast.parse("LADDER = None\n\ndef scale_v1(x):\n    pass\n"))
    assert "defines no *_reference" in problem
    assert _lesson_problems("planted", ast.parse(late.replace("LADDER", "OTHER"))) == []

"""The package's layout keeps its promises: every module is importable by its path
(no function or re-export shadows one), no module reaches into another's private
names, and the modules import each other without a cycle."""
import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import numba_sc

PKG = Path(numba_sc.__file__).parent
OPTIONAL = {"numba_sc.nn.torch_adapter"}  # needs PyTorch


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


def _top_level_imports(tree):
    """Import statements that run when the module is imported (not inside functions)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", [])
            for h in getattr(node, "handlers", []):
                todo += h.body


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


def test_no_import_cycle():
    edges = {name: set() for name in MODULES}
    for name, f in MODULES.items():
        for node in _top_level_imports(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                _, loaded = _resolve(name, node)
            else:
                loaded = [a.name for a in node.names if a.name in MODULES]
            for t in loaded:
                for dep in _parents(t) + [t]:
                    if dep != name and dep != "numba_sc" and not name.startswith(dep + "."):
                        edges[name].add(dep)
    state, path = {}, []

    def visit(n):
        state[n] = "open"
        path.append(n)
        for m in sorted(edges[n]):
            if state.get(m) == "open":
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
            if m not in state:
                visit(m)
        path.pop()
        state[n] = "done"

    for n in sorted(edges):
        if n not in state:
            visit(n)


def test_the_cycle_check_sees_a_cycle(monkeypatch):
    """The check above must be able to fail: a planted back edge is reported."""
    real = ast.parse

    def planted(src, *a, **k):
        tree = real(src, *a, **k)
        if "Which device runs the kernels" in src:  # core/device.py imports the Map step
            tree.body.append(ast.parse("from ..map.map_step import build_kernel_map").body[0])
        return tree

    monkeypatch.setattr(ast, "parse", planted)
    with pytest.raises(AssertionError, match="import cycle"):
        test_no_import_cycle()

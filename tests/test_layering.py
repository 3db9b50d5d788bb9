"""The import order runs one way (docs/design.md, 'Layers'): kernels, then library, then trainer.

``pallas_kernels`` (codecs and kernels) imports nothing of ``coat_jax``; outside
``coat_jax/training`` no module of ``coat_jax`` imports the trainer; no import cycle runs
through ``coat_jax``, counting the imports inside functions as much as those at module level
(so no import sits in a function to dodge a cycle); ``coat_jax`` imports its public names
eagerly, so each entry point works in a fresh interpreter.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, *, is_package: bool = False):
    """``(imported module, at module level)`` for every import in ``source``, at any depth.

    Covers ``import a.b``, ``from a import b`` (as ``a.b`` too, since ``b`` may be a submodule),
    relative imports, and ``importlib.import_module("...")`` / ``__import__("...")`` with a
    literal name.
    """
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    top_level = {id(node) for node in tree.body}
    for node in tree.body:
        if isinstance(node, ast.If):  # `if TYPE_CHECKING:` and similar guards at module level
            top_level.update(id(n) for n in ast.walk(node))
    found = []
    for node in ast.walk(tree):
        at_top = id(node) in top_level
        if isinstance(node, ast.Import):
            found += [(alias.name, at_top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            found.append((name, at_top))
            found += [(f"{name}.{alias.name}", at_top) for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.args[0].value, at_top))
    return found


def _is_within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _library_files(package: str) -> list[Path]:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no Python files under {ROOT / package}"
    return files


def _imports_of(path: Path):
    return imported_modules(
        path.read_text(), _module_name(path), is_package=path.name == "__init__.py"
    )


def test_the_checker_sees_every_kind_of_import():
    source = (
        "import coat_jax.quant\n"
        "def f():\n"
        "    from coat_jax import quant\n"
        "    from .. import training\n"
        "    importlib.import_module('coat_jax.training.loop')\n"
    )
    found = imported_modules(source, "coat_jax.sub.mod")
    assert ("coat_jax.quant", True) in found
    assert ("coat_jax.quant", False) in found
    assert ("coat_jax.training", False) in found
    assert ("coat_jax.training.loop", False) in found
    assert ("pallas_kernels.quant", True) in imported_modules(
        "from . import quant\n", "pallas_kernels", is_package=True
    )


def test_pallas_kernels_imports_nothing_of_coat_jax():
    bad = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in _library_files("pallas_kernels")
        for name, _ in _imports_of(path)
        if _is_within(name, "coat_jax")
    ]
    assert not bad, "pallas_kernels must not import coat_jax:\n" + "\n".join(bad)


def test_only_the_trainer_imports_the_trainer():
    training = ROOT / "coat_jax" / "training"
    bad = [
        f"{path.relative_to(ROOT)}: {name} ({'at module level' if at_top else 'inside a function'})"
        for path in _library_files("coat_jax")
        if training not in path.parents
        for name, at_top in _imports_of(path)
        if _is_within(name, "coat_jax.training")
    ]
    assert not bad, "the model and optimizer layers must not import the trainer:\n" + "\n".join(bad)


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, dict[str, bool]]:
    """``{module: {imported module: at module level}}`` over the modules of ``sources``.

    ``sources`` maps a module's name to ``(its source, whether it is a package's __init__)``.
    Only imports of modules in ``sources`` are edges; ``from a import b`` is an edge to ``a.b``
    where that is a module. A module's own packages are no edge: Python imports them before
    the module whatever it says. An import both at module level and in a function counts as
    at module level.
    """
    graph: dict[str, dict[str, bool]] = {}
    for module, (source, is_package) in sources.items():
        edges = graph.setdefault(module, {})
        ancestors = {module.rsplit(".", n)[0] for n in range(1, module.count(".") + 1)}
        for name, at_top in imported_modules(source, module, is_package=is_package):
            if name in sources and name != module and name not in ancestors:
                edges[name] = edges.get(name, False) or at_top
    return graph


def import_cycles(graph: dict[str, dict[str, bool]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each as one cycle
    through it: ``[a, b, ..., a]``."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_cycle_through(graph, component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def _cycle_through(graph, component: set[str]) -> list[str]:
    """One cycle inside ``component`` (a strongly connected set), from its first module."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v]):
            if w == start:
                return paths[v] + [start]
            if w in component and w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def _describe(graph, cycle: list[str]) -> str:
    hops = [
        f"{a} -> {b}{'' if graph[a][b] else ' (inside a function)'}"
        for a, b in zip(cycle, cycle[1:], strict=False)
    ]
    return "; ".join(hops)


def _library_graph() -> dict[str, dict[str, bool]]:
    files = _library_files("coat_jax") + _library_files("pallas_kernels")
    return import_graph({_module_name(p): (p.read_text(), p.name == "__init__.py") for p in files})


def test_the_cycle_check_counts_imports_inside_functions():
    sources = {
        "pkg": ("", True),
        "pkg.a": ("from pkg import b\n", False),
        "pkg.b": ("def f():\n    from pkg.c import g\n", False),
        "pkg.c": ("import pkg.a\nfrom pkg import d\n", False),
        "pkg.d": ("from . import e\n", False),
        "pkg.e": ("import numpy\nfrom pkg import x\n", False),
    }
    graph = import_graph(sources)
    assert graph["pkg.b"] == {"pkg.c": False}
    assert graph["pkg.d"] == {"pkg.e": True}
    assert "pkg" not in graph["pkg.a"]  # a module's own package is no edge
    (cycle,) = import_cycles(graph)
    assert cycle == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    assert "pkg.b -> pkg.c (inside a function)" in _describe(graph, cycle)
    del sources["pkg.b"]
    assert import_cycles(import_graph(sources)) == []


def test_no_import_cycle_in_the_library():
    graph = _library_graph()
    cycles = [_describe(graph, c) for c in import_cycles(graph)]
    assert not cycles, (
        "import cycles (an import inside a function counts too; move what both sides need into "
        "a module below them):\n" + "\n".join(cycles)
    )


def test_no_import_inside_a_function_dodges_a_cycle():
    """An import in a function whose module, imported at module level, would import the
    importer back: the cycle is there, only deferred to the call."""
    graph = _library_graph()

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            v = todo.pop()
            if v == goal:
                return True
            if v not in seen:
                seen.add(v)
                todo += list(graph.get(v, {}))
        return False

    dodges = [
        f"{module} imports {name} inside a function, and {name} imports {module} back"
        for module, edges in sorted(graph.items())
        for name, at_top in sorted(edges.items())
        if not at_top and reaches(name, module)
    ]
    assert not dodges, "\n".join(dodges)


def test_coat_jax_quant_reexports_every_codec():
    from coat_jax import quant as library_quant
    from pallas_kernels import quant as codecs

    defined = {
        name
        for name, value in vars(codecs).items()
        if not name.startswith("_")
        and not isinstance(value, type(sys))
        and getattr(value, "__module__", codecs.__name__) == codecs.__name__
    }
    assert defined == set(library_quant.__all__)
    for name in defined:
        assert getattr(library_quant, name) is getattr(codecs, name), name


def _sources(*paths: str) -> list[Path]:
    files = []
    for p in map(ROOT.joinpath, paths):
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return files


def test_design_references_name_sections_of_the_design_doc():
    headings = {
        line.lstrip("#").strip()
        for line in (ROOT / "docs" / "design.md").read_text().splitlines()
        if line.startswith("#")
    }
    cited, bad = 0, []
    for path in _sources("coat_jax", "pallas_kernels", "benchmarks", "train.py", "README.md"):
        text = path.read_text()
        for match in re.finditer(r"docs/design\.md\)?,\s+'([^']+)'", text):
            # A name may run over a line break of a comment (``# ...``) or a docstring.
            name = re.sub(r"\s*\n\s*#?\s*", " ", match.group(1))
            cited += 1
            if name not in headings:
                bad.append(f"{path.relative_to(ROOT)}: {name!r}")
    assert cited, "no docs/design.md references found: the pattern is out of date"
    assert not bad, f"not a heading of docs/design.md ({sorted(headings)}):\n" + "\n".join(bad)


def test_the_library_cites_no_spec_sections_or_issue_numbers():
    pattern = re.compile(r"SPEC section|SPEC §|SPEC:|issue [0-9]")
    bad = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in _sources("coat_jax", "pallas_kernels", "train.py")
        for n, line in enumerate(path.read_text().splitlines(), start=1)
        if pattern.search(line)
    ]
    assert not bad, "point to a section of docs/design.md instead:\n" + "\n".join(bad)


# The entry points in the order that keeps each check meaningful in one interpreter: the
# kernels first, while no coat_jax module is loaded; then `import coat_jax.quant`, which runs
# coat_jax/__init__.py before the submodule just as `import coat_jax` alone would.
ENTRY_POINTS = {
    # The kernels alone: no coat_jax module gets imported.
    "pallas_kernels": "import sys, pallas_kernels.fp8_quant, pallas_kernels.fp8_act,"
    " pallas_kernels.coat_adam; bad = [m for m in sys.modules if m.split('.')[0] == 'coat_jax'];"
    " assert not bad, bad",
    "coat_jax.quant": "import coat_jax.quant; coat_jax.quant.quantize_dre",
    # Eager exports: every public name is bound once `import coat_jax` returns.
    "coat_jax": "import coat_jax; coat_jax.coat_adamw;"
    " [getattr(coat_jax, name) for name in coat_jax.__all__];"
    " assert 'coat_jax.training' not in __import__('sys').modules",
}


def test_each_entry_point_imports_in_a_fresh_interpreter():
    # One child runs the entry points in order; the last name on its stderr is the one that
    # failed.
    code = "\n".join(
        f"__import__('sys').stderr.write('entry point {name}\\n')\n{snippet}"
        for name, snippet in ENTRY_POINTS.items()
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

"""The import order runs one way (docs/design.md, 'Layers'): kernels, then library, then trainer.

``pallas_kernels`` (codecs and kernels) imports nothing of ``coat_jax``; outside
``coat_jax/training`` no module of ``coat_jax`` imports the trainer; ``coat_jax`` imports its
public names eagerly, so each entry point works in a fresh interpreter.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The one upward import left: the command lines ``python -m coat_jax.convert`` and ``python -m
# coat_jax.generate`` also read train.py run directories, through the trainer's export module,
# imported inside the functions that need it. Each pair must still exist (the list only shrinks).
COMMAND_LINE_IMPORTS = {
    ("coat_jax.convert", "coat_jax.training.export"),
    ("coat_jax.generate", "coat_jax.training.export"),
}


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
    bad, seen = [], set()
    for path in _library_files("coat_jax"):
        if training in path.parents:
            continue
        module = _module_name(path)
        for name, at_top in _imports_of(path):
            if not _is_within(name, "coat_jax.training"):
                continue
            allowed = [
                pair
                for pair in COMMAND_LINE_IMPORTS
                if pair[0] == module and _is_within(name, pair[1])
            ]
            if allowed and not at_top:
                seen.update(allowed)
                continue
            where = "at module level" if at_top else "inside a function"
            bad.append(f"{path.relative_to(ROOT)}: {name} ({where})")
    assert not bad, "the model and optimizer layers must not import the trainer:\n" + "\n".join(bad)
    assert seen == COMMAND_LINE_IMPORTS, (
        f"no longer imported, remove from COMMAND_LINE_IMPORTS: {COMMAND_LINE_IMPORTS - seen}"
    )


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


@pytest.mark.parametrize(
    "code",
    [
        # The kernels alone: no coat_jax module gets imported.
        "import sys, pallas_kernels.fp8_quant, pallas_kernels.fp8_act, pallas_kernels.coat_adam;"
        " bad = [m for m in sys.modules if m.split('.')[0] == 'coat_jax']; assert not bad, bad",
        "import coat_jax.quant; coat_jax.quant.quantize_dre",
        # Eager exports: every public name is bound once `import coat_jax` returns.
        "import coat_jax; coat_jax.coat_adamw;"
        " [getattr(coat_jax, name) for name in coat_jax.__all__];"
        " assert 'coat_jax.training' not in __import__('sys').modules",
    ],
    ids=["pallas_kernels", "coat_jax.quant", "coat_jax"],
)
def test_each_entry_point_imports_in_a_fresh_interpreter(code):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

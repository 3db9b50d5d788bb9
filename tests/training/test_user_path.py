"""docs/quickstart.md's commands, run as written (on a 4-step run), so that CI checks them."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import subprocess
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

from tests.commands import run_each
from tests.tiny_runs import compilation_cache
from tests.training.test_train import REPO

QUICKSTART = REPO / "docs" / "quickstart.md"
# The quickstart's install: the library and the trainer's extra.
QUICKSTART_EXTRAS = ("train",)
QUICKSTART_INSTALL = 'pip install -e ".[train]"'
# Appended to the train.py command: a short run of small batches with the tests' caches.
SHORT_RUN = [
    "steps=4",
    "data.batch_size=4",
    "optimizer.warmup_steps=2",
    "eval.every=2",
    "eval.batches=1",
    "logging.progress_bar=false",
]


def quickstart_blocks(path=QUICKSTART) -> list[list[str]]:
    """The commands of each bash block of the section: the quickstart, then the extra's."""
    text = path.read_text()
    section = text.split("## From zero to a sampled model", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [[line for line in block.splitlines() if line.strip()] for block in blocks]


def quickstart_commands(path=QUICKSTART) -> list[str]:
    return quickstart_blocks(path)[0]


def test_readme_shows_the_same_commands():
    assert quickstart_blocks(REPO / "README.md") == quickstart_blocks()


def test_quickstart_has_at_most_five_commands_from_pip_install():
    commands = quickstart_commands()
    assert commands[0] == QUICKSTART_INSTALL and len(commands) <= 5
    assert commands[1].startswith("python train.py")


def _requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _extra_only_modules() -> list[str]:
    """Top-level modules of the installed distributions that only an extra of pyproject.toml
    other than the quickstart's brings (torch, accelerate, pytest, ...): what
    :data:`QUICKSTART_INSTALL` does not install."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    installed = [*project["dependencies"], *(r for e in QUICKSTART_EXTRAS for r in extras[e])]
    base = {_requirement_name(r) for r in installed}
    others = {_requirement_name(r) for reqs in extras.values() for r in reqs}
    only = others - base - {project["name"]}
    return sorted(
        module
        for module, dists in importlib.metadata.packages_distributions().items()
        if any(d.lower().replace("_", "-") in only for d in dists)
    )


def test_the_torch_extra_brings_what_transformers_runs_on():
    install, *commands = quickstart_blocks()[1]
    assert install == 'pip install -e ".[torch]"'
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "torch" in {_requirement_name(r) for r in project["optional-dependencies"]["torch"]}
    assert len(commands) == 1 and "from transformers import pipeline" in commands[0]
    assert "torch" in _extra_only_modules()


def _argv(command, tmp_path, caches) -> list[str]:
    """``command``'s argv (``python`` first) with the run folder under ``tmp_path`` and, for
    train.py, :data:`SHORT_RUN` and the tests' caches appended."""
    command = command.replace("runs/quick", str(tmp_path / "quick"))
    argv = shlex.split(command)
    assert argv[0] == "python", command
    if argv[1] == "train.py":
        argv += SHORT_RUN
        argv += [f"data.cache_dir={caches}/tokens", compilation_cache(f"{caches}/jax")]
    return argv


def _run(argv, env=None) -> str:
    proc = subprocess.run(
        [sys.executable, *argv[1:]], cwd=REPO, capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, f"{argv}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _run_each(argvs, tmp_path, env) -> list[str]:
    """The commands ``argvs`` run one after another in one child process
    (:func:`tests.commands.run_each`): their stdouts."""
    outs = [tmp_path / f"command_{i}.stdout" for i in range(len(argvs))]
    stdouts, codes, stderr = run_each(argvs, outs, env=env)
    for argv, code, stdout in zip(argvs, codes, stdouts, strict=True):
        assert code in (0, None), f"{argv}: exit {code}\n{stdout[-2000:]}\n{stderr[-3000:]}"
    return stdouts


def test_quickstart_commands_run(tmp_path, trainer_caches):
    # CI has installed the package already (`pip install -e ".[test]"`), so the install lines
    # are the only ones not run here. The quickstart's own commands run with every package that
    # only another extra brings made unimportable: what a fresh QUICKSTART_INSTALL has.
    hide = tmp_path / "base_install_only"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\n"
        f"for name in {_extra_only_modules()!r}:\n"
        "    sys.modules[name] = None  # import fails, importlib.util.find_spec gives None\n"
    )
    path = os.pathsep.join(p for p in (str(hide), os.environ.get("PYTHONPATH")) if p)
    base_only = dict(os.environ, PYTHONPATH=path)
    train_out, export_out, ours_out = _run_each(
        [_argv(c, tmp_path, trainer_caches) for c in quickstart_commands()[1:]], tmp_path, base_only
    )
    (hf_out,) = (_run(_argv(c, tmp_path, trainer_caches)) for c in quickstart_blocks()[1][1:])
    assert "done: step 4" in train_out
    assert "run-to-hf: wrote checkpoint step 4" in export_out and "byte tokenizer" in export_out
    for sampled in (hf_out, ours_out):
        assert sampled.startswith("It is a truth") and len(sampled.strip()) > len("It is a truth")

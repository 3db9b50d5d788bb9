"""docs/quickstart.md's commands, run as written (on a 20-step run), so that CI checks them."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

from tests.tiny_runs import compilation_cache
from tests.training.test_train import REPO

QUICKSTART = REPO / "docs" / "quickstart.md"
# Appended to the train.py command: a short run with this test's own caches.
SHORT_RUN = ["steps=20", "warmup_steps=2", "eval_every=10", "eval_batches=1", "progress_bar=false"]


def quickstart_commands(path=QUICKSTART) -> list[str]:
    text = path.read_text()
    section = text.split("## From zero to a sampled model", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_readme_shows_the_same_commands():
    assert quickstart_commands(REPO / "README.md") == quickstart_commands()


def test_quickstart_has_at_most_five_commands_from_pip_install():
    commands = quickstart_commands()
    assert commands[0] == "pip install -e ." and len(commands) <= 5
    assert commands[1].startswith("python train.py")


def test_quickstart_commands_run(tmp_path):
    # CI has installed the package already (`pip install -e ".[test]"`), so the first command
    # is the only one not run here.
    commands = quickstart_commands()[1:]
    outputs = []
    for command in commands:
        command = command.replace("runs/quick", str(tmp_path / "quick"))
        argv = shlex.split(command)
        assert argv[0] == "python", command
        argv[0] = sys.executable
        if argv[1] == "train.py":
            argv += SHORT_RUN
            argv += [f"cache_dir={tmp_path}/tokens", compilation_cache(f"{tmp_path}/jax")]
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        outputs.append(proc.stdout)
    train_out, export_out, hf_out, ours_out = outputs
    assert "done: step 20" in train_out
    assert "run-to-hf: wrote checkpoint step 20" in export_out and "byte tokenizer" in export_out
    for sampled in (hf_out, ours_out):
        assert sampled.startswith("It is a truth") and len(sampled.strip()) > len("It is a truth")

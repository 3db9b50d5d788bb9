"""The trainer overrides the tests' short runs share: a tiny Llama and quiet bookkeeping; and the
test-only switch that runs the trainer's kernels in Pallas interpret mode."""

import contextlib
import importlib.util
import os
from pathlib import Path

from coat_jax.training.optimizers import PALLAS_INTERPRET_ENV

REPO = Path(__file__).resolve().parents[1]


def load_train_script():
    """train.py loaded as a module: its ``main(argv)`` runs the command line in this process
    (no interpreter and JAX to start), returning the exit code."""
    spec = importlib.util.spec_from_file_location("train_script", REPO / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compilation_cache(folder) -> str:
    """The trainer override for JAX's compilation cache: the test run's (conftest.py), so
    that a program another test compiled loads from disk, else ``folder``."""
    return f"xla.compilation_cache_dir={os.environ.get('JAX_COMPILATION_CACHE_DIR', folder)}"


@contextlib.contextmanager
def pallas_interpret():
    """Programs built inside the block run every trainer kernel in Pallas interpret mode
    (``PALLAS_INTERPRET_ENV``; the kernels' mode is fixed when ``build_program`` runs), and so
    do subprocesses started inside it."""
    before = os.environ.get(PALLAS_INTERPRET_ENV)
    os.environ[PALLAS_INTERPRET_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[PALLAS_INTERPRET_ENV]
        else:
            os.environ[PALLAS_INTERPRET_ENV] = before


def tiny_run(
    *,
    hidden: int = 64,
    intermediate: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seq_len: int = 32,
    batch_size: int = 8,
) -> list[str]:
    """``key=value`` overrides of configs/default.yaml for a run of a few seconds on a CPU."""
    return [
        "model.vocab_size=258",
        f"model.hidden_size={hidden}",
        f"model.intermediate_size={intermediate}",
        f"model.num_hidden_layers={layers}",
        f"model.num_attention_heads={heads}",
        f"model.num_key_value_heads={kv_heads}",
        "model.head_dim=16",
        f"data.seq_len={seq_len}",
        f"data.batch_size={batch_size}",
        "optimizer.warmup_steps=2",
        "logging.every=1",
        "eval.every=1000",
        "checkpoint.every=1000",
        "logging.progress_bar=false",
        "logging.sample_prompt=null",
    ]

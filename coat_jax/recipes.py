"""Recipes: named, tested sets of training settings, one per measured best.

A recipe is a mapping of the trainer's dotted config keys (``precision.mode``, ...) to values:
precision, optimizer and the memory options. ``recipe: NAME`` in a config file (or ``recipe=NAME``
on ``train.py``'s command line) starts from it; every key the config sets itself wins over the
recipe's (defaults < recipe < config files < command line; ``train.py --print-config`` shows where
each value came from). Recipes name no kernel choice: ``kernels: auto`` runs the Pallas kernels on a
GPU and their jnp references elsewhere, so every recipe runs on a CPU too, with the same numerics
and none of the GPU's speed.

Each recipe's docstring says what it trades against ``bf16`` and names the docs page with its
measurements; docs/recipes.md lists them side by side.

Examples:
  >>> from coat_jax import recipes
  >>> recipes.settings("coat_max_batch")["precision.fp8_swiglu"]
  'fused'
  >>> sorted(recipes.RECIPES)
  ['bf16', 'coat', 'coat_bf16_masters', 'coat_max_batch', 'fp8']
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any


def bf16() -> dict[str, Any]:
    """The BF16 baseline: BF16 activations and linears, optax's AdamW with float32 moments.

    What every other recipe is measured against (docs/bench_e2e.md,
    docs/bench_largest_batch_split.md, docs/accuracy.md): float32 master weights and 8 bytes of
    optimizer state per parameter, BF16 activations kept for backward. Its fastest measured
    layout is unrolled layers without remat, which ``scan_layers`` and ``remat`` default to.
    """
    return {"precision.mode": "bf16", "optimizer.name": "adamw"}


def fp8() -> dict[str, Any]:
    """FP8 linear layers only (per-tensor E4M3 forward, E5M2 gradients), optax's AdamW.

    Trades: the linears' GEMMs run in FP8, the activations kept for backward and the optimizer
    state stay as BF16's, so it saves no memory. Each weight is quantized once per step
    (``precision.fp8_weight_residual: once``, faster than the option's default ``master`` for 1
    byte per weight: docs/memory_options.md). Accuracy against ``bf16``: docs/accuracy.md
    (mode ``fp8``); speed: docs/bench_e2e.md.
    """
    return {
        "precision.mode": "fp8",
        "precision.fp8_weight_residual": "once",
        "optimizer.name": "adamw",
    }


def coat() -> dict[str, Any]:
    """COAT, the paper's recipe and the default: FP8 activations and FP8 optimizer states.

    FP8 linears, the activations kept for backward in FP8 with 1x16 group scales, and
    ``coat_adamw``'s FP8 moments with dynamic-range expansion. Trades: speed at small batches
    (the quantization passes) for about half BF16's parameter and optimizer-state memory and
    smaller activations, which buy larger batches and, there, more tokens/s. Weights are
    quantized once per step, as in :func:`fp8`. Accuracy:
    docs/accuracy.md (mode ``coat``); memory and speed: docs/bench_e2e.md,
    docs/bench_e2e_once.md.
    """
    return {
        "precision.mode": "coat",
        "precision.fp8_weight_residual": "once",
        "optimizer.name": "coat_adamw",
    }


def coat_max_batch() -> dict[str, Any]:
    """COAT with every memory option that pays at the largest batch, for the most tokens/s.

    On top of :func:`coat`: the optimizer runs inside the backward pass (never holding the
    whole gradient; no global-norm clipping, so ``grad_clip`` is null, and the layers are
    scanned), attention keeps FP8 q, k, v, the cross-entropy runs in 2048-position chunks,
    activation scales take one byte (E8M0), the weights' FP8 codes are made in each linear
    instead of kept for the step (``fp8_weight_residual: master``), and the SwiGLU is one FP8
    op. Trades: no gradient clipping and a slower step at batch 1 for the largest batch that
    fits and the most tokens/s there. Measurements: docs/bench_fp8_kernels.md ("The default at
    7B's largest batch"), docs/bench_largest_batch_split.md, docs/memory_options.md sections
    3 to 5; accuracy of each option: docs/accuracy.md (modes ``coat_inbwd``, ``coat_e8m0``,
    ``coat_swiglu``, ``coat_fp8attn``).
    """
    return {
        **coat(),
        "memory.scan_layers": True,
        "memory.remat": "activations",
        "optimizer.in_backward": True,
        "optimizer.grad_clip": None,
        "precision.fp8_attention": True,
        "memory.loss_chunk_size": 2048,
        "precision.fp8_group_scale": "e8m0",
        "precision.fp8_weight_residual": "master",
        "precision.fp8_swiglu": "fused",
    }


def coat_bf16_masters() -> dict[str, Any]:
    """COAT with bfloat16 master weights, updated with stochastic rounding.

    Trades: 2 bytes per parameter of weights and 2 of gradients less than :func:`coat`, for
    stochastic rounding of every update. Memory and speed: docs/memory_options.md section 2,
    docs/bench_e2e.md; accuracy: docs/accuracy.md (mode ``coat_bf16m``: best validation loss
    inside BF16's seed range, two seeds).
    """
    return {**coat(), "precision.master_dtype": "bfloat16"}


RECIPES: dict[str, Callable[[], dict[str, Any]]] = {
    f.__name__: f for f in (bf16, fp8, coat, coat_max_batch, coat_bf16_masters)
}
DEFAULT = "coat"


def settings(name: str) -> dict[str, Any]:
    """The config keys and values of recipe ``name``.

    Raises:
      ValueError: no such recipe (the message names the close matches and every recipe).
    """
    recipe = RECIPES.get(name)
    if recipe is None:
        close = difflib.get_close_matches(str(name), RECIPES, n=2)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise ValueError(f"unknown recipe {name!r}; {hint}recipes: {', '.join(RECIPES)}")
    return recipe()


def summary(name: str) -> str:
    """The first line of recipe ``name``'s docstring."""
    return RECIPES[name].__doc__.strip().splitlines()[0]

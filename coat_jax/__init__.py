"""coat-jax: COAT (FP8 optimizer states and FP8 activations) for JAX, Flax and Optax.

Public names are imported on first use (PEP 562), so that ``import coat_jax.quant`` from the
Pallas kernels does not pull in the whole library, and the library in turn can import the kernels.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it. To export a name, add it here.
_EXPORTS = {
    # FP8 optimizer states
    "ScaleByCoatAdamState": "coat_jax.optim",
    "coat_adamw": "coat_jax.optim",
    "dequantized_moments": "coat_jax.optim",
    "find_coat_states": "coat_jax.optim",
    "scale_by_coat_adam": "coat_jax.optim",
    # FP8 state for any optax optimizer
    "FP8State": "coat_jax.fp8_wrapper",
    "dequantized_state": "coat_jax.fp8_wrapper",
    "find_fp8_states": "coat_jax.fp8_wrapper",
    "fp8_state": "coat_jax.fp8_wrapper",
    "full_precision_paths": "coat_jax.fp8_wrapper",
    "quantized_paths": "coat_jax.fp8_wrapper",
    # FP8 activations
    "FP8Config": "coat_jax.fp8_ops",
    "OpSet": "coat_jax.fp8_ops",
    "fp8_add": "coat_jax.fp8_ops",
    "fp8_attention": "coat_jax.fp8_ops",
    "fp8_compiler_options": "coat_jax.fp8_ops",
    "fp8_dot_general": "coat_jax.fp8_ops",
    "fp8_linear": "coat_jax.fp8_ops",
    "fp8_mul": "coat_jax.fp8_ops",
    "fp8_rmsnorm": "coat_jax.fp8_ops",
    "fp8_silu": "coat_jax.fp8_ops",
    "fp8_swiglu": "coat_jax.fp8_ops",
    "ops_for": "coat_jax.fp8_ops",
    "activation_bytes": "coat_jax.memory",
    "activation_bytes_by_dtype": "coat_jax.memory",
    "residuals": "coat_jax.memory",
    # Memory beyond the paper: chunked cross-entropy, BF16 master weights
    "cross_entropy_from_hidden": "coat_jax.losses",
    "apply_updates_stochastic": "coat_jax.master",
    "float32_optimizer": "coat_jax.master",
    "stochastic_round": "coat_jax.master",
    # Llama and checkpoints
    "Llama": "coat_jax.llama",
    "LlamaConfig": "coat_jax.llama",
    "RopeScaling": "coat_jax.llama",
    "from_pretrained": "coat_jax.checkpoint_io",
    "save_pretrained": "coat_jax.checkpoint_io",
    "ByteTokenizer": "coat_jax.tokenizer",
    "load_tokenizer": "coat_jax.tokenizer",
    # Sampling
    "generate": "coat_jax.generate",
    "generate_ids": "coat_jax.generate",
    "sample_text": "coat_jax.generate",
}
_SUBMODULES = ("quant", "optim", "fp8_ops", "memory", "llama", "checkpoint_io", "tokenizer")

__all__ = sorted(_EXPORTS) + list(_SUBMODULES)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"coat_jax.{name}")
    else:
        raise AttributeError(f"module 'coat_jax' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return __all__

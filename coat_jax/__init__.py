"""coat-jax: COAT (FP8 optimizer states and FP8 activations) for JAX, Flax and Optax.

The public names are imported here, from the modules that define them. The import order runs one
way (docs/design.md, 'Layers'): ``pallas_kernels`` (codecs and kernels) imports nothing of
``coat_jax``, so importing the library imports the kernels and never the other way round.

``generate`` is the module ``coat_jax.generate``, callable as its ``generate`` function, so both
``coat_jax.generate(model, tokenizer, prompt)`` and ``coat_jax.generate.generate_ids`` work.
"""

from __future__ import annotations

from coat_jax import (
    checkpoint_io,
    fp8_ops,
    generate,
    llama,
    memory,
    optim,
    quant,
    recipes,
    tokenizer,
)
from coat_jax.checkpoint_io import from_pretrained, save_pretrained
from coat_jax.fp8_ops import (
    FP8Config,
    FP8Weight,
    OpSet,
    fp8_add,
    fp8_attention,
    fp8_compiler_options,
    fp8_dot_general,
    fp8_linear,
    fp8_mul,
    fp8_rmsnorm,
    fp8_silu,
    fp8_swiglu,
    ops_for,
    prequantized,
    quantize_weight,
)
from coat_jax.fp8_wrapper import (
    FP8State,
    dequantized_state,
    find_fp8_states,
    fp8_state,
    full_precision_paths,
    quantized_paths,
)
from coat_jax.generate import generate_ids, sample_text
from coat_jax.llama import Llama, LlamaConfig, RopeScaling
from coat_jax.losses import cross_entropy_from_hidden
from coat_jax.master import apply_updates_stochastic, float32_optimizer, stochastic_round
from coat_jax.memory import activation_bytes, activation_bytes_by_dtype, residuals
from coat_jax.optim import (
    ScaleByCoatAdamState,
    apply_gradients,
    coat_adamw,
    dequantized_moments,
    find_coat_states,
    scale_by_coat_adam,
)
from coat_jax.quant import QuantizedTensor, state_bytes
from coat_jax.tokenizer import ByteTokenizer, load_tokenizer

__version__ = "0.1.0"

__all__ = [
    # FP8 values: codes, scales and their layout (codecs, kernels, residuals, moments)
    "QuantizedTensor",
    "state_bytes",
    # FP8 optimizer states
    "ScaleByCoatAdamState",
    "apply_gradients",
    "coat_adamw",
    "dequantized_moments",
    "find_coat_states",
    "scale_by_coat_adam",
    # FP8 state for any optax optimizer
    "FP8State",
    "dequantized_state",
    "find_fp8_states",
    "fp8_state",
    "full_precision_paths",
    "quantized_paths",
    # FP8 activations
    "FP8Config",
    "FP8Weight",
    "OpSet",
    "fp8_add",
    "fp8_attention",
    "fp8_compiler_options",
    "fp8_dot_general",
    "fp8_linear",
    "fp8_mul",
    "fp8_rmsnorm",
    "fp8_silu",
    "fp8_swiglu",
    "ops_for",
    "prequantized",
    "quantize_weight",
    "activation_bytes",
    "activation_bytes_by_dtype",
    "residuals",
    # Memory beyond the paper: chunked cross-entropy, BF16 master weights
    "cross_entropy_from_hidden",
    "apply_updates_stochastic",
    "float32_optimizer",
    "stochastic_round",
    # Llama and checkpoints
    "Llama",
    "LlamaConfig",
    "RopeScaling",
    "from_pretrained",
    "save_pretrained",
    "ByteTokenizer",
    "load_tokenizer",
    # Sampling (``generate`` is the callable module, see above)
    "generate",
    "generate_ids",
    "sample_text",
    # Submodules
    "quant",
    "optim",
    "fp8_ops",
    "memory",
    "llama",
    "checkpoint_io",
    "tokenizer",
    "recipes",
]


def __dir__():
    return sorted(set(globals()) | set(__all__))

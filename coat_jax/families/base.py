"""What a model family is: the switches of the one decoder (:class:`Family`) and the name map
of a decoder layer's tensors between Hugging Face and coat-jax (:data:`LLAMA_LAYER_MAP`, which
the other families extend).

A family's own module holds one :class:`Family`; ``coat_jax.families`` registers it by its
Hugging Face ``model_type`` (docs/design.md, 'Adding a model family').
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

QK_NORMS = ("none", "head", "full")


@dataclasses.dataclass(frozen=True)
class Transform:
    """A named, invertible array transform of the name map (HF layout -> coat-jax layout)."""

    name: str
    forward: Callable[[np.ndarray], np.ndarray]
    inverse: Callable[[np.ndarray], np.ndarray]


IDENTITY = Transform("identity", lambda a: a, lambda a: a)
# HF linear weights are [out, in]; coat-jax multiplies x @ w with w [in, out].
TRANSPOSE = Transform("transpose", lambda a: a.T, lambda a: a.T)

# A decoder layer's tensors: (HF name under ``model.layers.{i}.``, coat-jax path under
# ``layers.{i}.``, transform).
LLAMA_LAYER_MAP = (
    ("input_layernorm.weight", "input_layernorm.weight", IDENTITY),
    ("self_attn.q_proj.weight", "self_attn.q_proj", TRANSPOSE),
    ("self_attn.k_proj.weight", "self_attn.k_proj", TRANSPOSE),
    ("self_attn.v_proj.weight", "self_attn.v_proj", TRANSPOSE),
    ("self_attn.o_proj.weight", "self_attn.o_proj", TRANSPOSE),
    ("post_attention_layernorm.weight", "post_attention_layernorm.weight", IDENTITY),
    ("mlp.gate_proj.weight", "mlp.gate_proj", TRANSPOSE),
    ("mlp.up_proj.weight", "mlp.up_proj", TRANSPOSE),
    ("mlp.down_proj.weight", "mlp.down_proj", TRANSPOSE),
)

QKV_BIAS_MAP = (
    ("self_attn.q_proj.bias", "self_attn.q_bias", IDENTITY),
    ("self_attn.k_proj.bias", "self_attn.k_bias", IDENTITY),
    ("self_attn.v_proj.bias", "self_attn.v_bias", IDENTITY),
)

QK_NORM_MAP = (
    ("self_attn.q_norm.weight", "self_attn.q_norm.weight", IDENTITY),
    ("self_attn.k_norm.weight", "self_attn.k_norm.weight", IDENTITY),
)


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face ``model_type`` as switches of the decoder in ``coat_jax.llama_layers``.

    Attributes:
      model_type: Hugging Face's ``model_type`` (``config.json``).
      architecture: the transformers class an exported folder names (``architectures``).
      qkv_bias: biases on the q, k and v projections (added beside the linear).
      qk_norm: RMSNorm of q and k before RoPE: ``"none"``, ``"head"`` (over each head's
        ``head_dim``, one weight shared by the heads) or ``"full"`` (over the whole q and k
        projections).
      post_norms: OLMo 2's placement: no norm before attention and MLP; their outputs are
        normed (``post_attention_layernorm``, ``post_feedforward_layernorm``) before the
        residual add.
      sliding_window: the config's ``sliding_window`` is read (Mistral) and the model's own
        attention keeps to it; decoding with a cache and FP8 attention refuse sequences past
        it.
      fixed: Hugging Face config keys with the only value this port supports; a config that sets
        another value is refused, naming the key. ``config.json`` on export writes them.
      layer_map: a decoder layer's name map (:data:`LLAMA_LAYER_MAP`'s form).
    """

    model_type: str
    architecture: str
    layer_map: tuple[tuple[str, str, Transform], ...] = LLAMA_LAYER_MAP
    qkv_bias: bool = False
    qk_norm: str = "none"
    post_norms: bool = False
    sliding_window: bool = False
    fixed: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm={self.qk_norm!r} is not one of {list(QK_NORMS)}")

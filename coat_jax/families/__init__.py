"""The model families the one decoder serves, by Hugging Face ``model_type``.

Each family is one small module of switches and a name map (:class:`Family`); adding one is
that module and its entry in :data:`FAMILIES` (docs/design.md, 'Adding a model family').
"""

from coat_jax.families.base import (
    IDENTITY,
    LLAMA_LAYER_MAP,
    QK_NORMS,
    TRANSPOSE,
    Family,
    Transform,
)
from coat_jax.families.llama import LLAMA
from coat_jax.families.mistral import MISTRAL
from coat_jax.families.olmo2 import OLMO2
from coat_jax.families.qwen2 import QWEN2
from coat_jax.families.qwen3 import QWEN3

__all__ = [
    "FAMILIES",
    "IDENTITY",
    "LLAMA_LAYER_MAP",
    "QK_NORMS",
    "TRANSPOSE",
    "Family",
    "Transform",
    "family",
]

FAMILIES = {f.model_type: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, OLMO2)}


def family(model_type: str) -> Family:
    """The :class:`Family` of a Hugging Face ``model_type``; ``ValueError`` naming the valid."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type={model_type!r} is not supported; valid: {sorted(FAMILIES)}")
    return FAMILIES[model_type]

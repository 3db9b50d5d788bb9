"""Llama 2 and 3: the decoder with no switch on."""

from coat_jax.families.base import Family

LLAMA = Family(
    model_type="llama",
    architecture="LlamaForCausalLM",
    fixed=(("attention_bias", False), ("mlp_bias", False)),
)

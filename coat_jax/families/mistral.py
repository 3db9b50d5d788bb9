"""Mistral: Llama's layer, with sliding-window attention."""

from coat_jax.families.base import Family

MISTRAL = Family(model_type="mistral", architecture="MistralForCausalLM", sliding_window=True)

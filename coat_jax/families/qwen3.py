"""Qwen3 (dense): Llama's layer with RMSNorm over each head of q and k before RoPE; its
``head_dim`` need not be ``hidden_size / num_attention_heads``."""

from coat_jax.families.base import LLAMA_LAYER_MAP, QK_NORM_MAP, Family

QWEN3 = Family(
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    layer_map=LLAMA_LAYER_MAP + QK_NORM_MAP,
    qk_norm="head",
    fixed=(("attention_bias", False), ("use_sliding_window", False)),
)

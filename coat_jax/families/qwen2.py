"""Qwen2 and Qwen2.5: Llama's layer with biases on the q, k and v projections."""

from coat_jax.families.base import LLAMA_LAYER_MAP, QKV_BIAS_MAP, Family

QWEN2 = Family(
    model_type="qwen2",
    architecture="Qwen2ForCausalLM",
    layer_map=LLAMA_LAYER_MAP + QKV_BIAS_MAP,
    qkv_bias=True,
    fixed=(("use_sliding_window", False),),
)

"""OLMo 2: RMSNorm over the whole q and k projections, and the norms after attention and MLP,
inside the residual (no norm before them)."""

from coat_jax.families.base import IDENTITY, LLAMA_LAYER_MAP, QK_NORM_MAP, Family

OLMO2 = Family(
    model_type="olmo2",
    architecture="Olmo2ForCausalLM",
    layer_map=tuple(e for e in LLAMA_LAYER_MAP if e[0] != "input_layernorm.weight")
    + QK_NORM_MAP
    + (("post_feedforward_layernorm.weight", "post_feedforward_layernorm.weight", IDENTITY),),
    qk_norm="full",
    post_norms=True,
    fixed=(("attention_bias", False),),
)

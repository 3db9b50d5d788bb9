"""The families beyond Llama (Mistral, Qwen2, Qwen3, OLMo 2) against transformers' float32
models, in every precision and layout, and exported back to their own transformers classes."""

import jax.numpy as jnp
import pytest

from coat_jax.checkpoint_io import from_pretrained
from tests.llama_reference import rel_err, token_ids, torch_logits

SEQ = 160
COMMON = dict(
    vocab_size=317,  # odd, as real vocabularies after added tokens are
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)
# Per family: its transformers config class and what it sets beyond COMMON (GQA everywhere,
# tied and untied embeddings, a head_dim apart from hidden/heads, RoPE theta and scaling).
FAMILIES = {
    "qwen2": ("Qwen2", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": ("Qwen3", dict(tie_word_embeddings=False, head_dim=32)),
    "mistral": (
        "Mistral",
        dict(
            tie_word_embeddings=False,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=4096,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
    ),
    "olmo2": ("Olmo2", dict(tie_word_embeddings=False)),
}


def hf_model(family: str, seed: int = 0):
    """A random transformers model of ``family`` (float32, eval): weights and biases wider than
    the 0.02 init, norms away from 1, so every tensor matters for the logits."""
    import torch
    import transformers

    prefix, extra = FAMILIES[family]
    config = getattr(transformers, f"{prefix}Config")(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each family saved once by transformers: {family: (folder, torch model, logits)}."""
    out = {}
    ids = token_ids(COMMON["vocab_size"], 1, SEQ, seed=1)
    for family in FAMILIES:
        model = hf_model(family)
        folder = tmp_path_factory.mktemp(family)
        model.save_pretrained(folder)
        out[family] = (folder, model, torch_logits(model, ids))
    return out, ids


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_float32_logits_match_transformers(saved, family, scan_layers):
    cases, ids = saved
    folder, _, want = cases[family]
    model = from_pretrained(
        folder, dtype=jnp.float32, param_dtype=jnp.float32, scan_layers=scan_layers
    )
    assert model.config.model_type == family
    got = model(jnp.asarray(ids))
    assert got.shape == want.shape
    assert rel_err(got, want) <= 1e-4

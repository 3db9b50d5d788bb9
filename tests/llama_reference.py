"""Shared helpers of the Llama tests: tiny random transformers Llamas as the reference."""

from __future__ import annotations

import copy

import numpy as np

from tests.untraced import without_tracer

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that the test positions (hundreds) cross every frequency band.
    "original_max_position_embeddings": 64,
}

# Small configs covering MHA and GQA, tied and untied embeddings, no/linear/llama3 RoPE scaling
# and an explicit head_dim that is not hidden/heads (with multi-query attention).
CASES = {
    "mha_untied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    "gqa_tied_llama3": dict(
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_SCALING,
    ),
    "mqa_untied_linear_headdim": dict(
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=False,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
}


@without_tracer  # transformers' code only: no line of the library runs here
def hf_llama(
    case: str, *, seed: int = 0, std: float = 0.08, num_hidden_layers: int = 2, **overrides
):
    """A random transformers LlamaForCausalLM (float32, eval mode) for one of `CASES`.

    Weights are drawn wider than HF's 0.02 init and the norms away from 1, so the logits are
    far from uniform and every weight matters for them.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=num_hidden_layers,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
    )
    # transformers edits the rope dicts it is given in place: hand it copies.
    kwargs.update(copy.deepcopy({**CASES[case], **overrides}))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, std)
    return model


def with_precision(model, precision: str, dtype):
    """The same parameters (shared, not copied) under another precision mode / dtype, in the
    same layer layout."""
    from flax import nnx

    from coat_jax.llama import Llama

    _, state = nnx.split(model)
    abstract = nnx.eval_shape(
        lambda: Llama(
            model.config,
            precision=precision,
            dtype=dtype,
            rngs=nnx.Rngs(0),
            scan_layers=model.scan_layers,
        )
    )
    graphdef, _ = nnx.split(abstract)
    return nnx.merge(graphdef, state)


def token_ids(vocab: int, batch: int, seq: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (batch, seq), dtype=np.int32)


@without_tracer
def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(ids.astype(np.int64))).logits.float().numpy()


def rel_err(got, want) -> float:
    """max |got - want| / max |want|: error relative to the logits' scale."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())

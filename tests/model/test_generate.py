"""coat_jax.generate: the KV-cached decode against full forwards, and against transformers'
greedy `generate` on the real SmolLM2-135M."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import coat_jax
from coat_jax.convert import main as convert_main
from coat_jax.fp8_ops import ops_for
from coat_jax.generate import PROMPT_BUCKET, generate, generate_ids
from coat_jax.generate import main as generate_main
from coat_jax.llama import (
    KVCache,
    Llama,
    LlamaConfig,
    causal_attention,
    rope_inv_freq,
    stack_layers,
)
from tests.untraced import untraced

TINY = LlamaConfig(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_scaling={"rope_type": "linear", "factor": 2.0},
)


@pytest.fixture(scope="module")
def tiny_model():
    """A random float32 Llama whose next-token choices are far from uniform."""
    model = Llama(TINY, dtype=jnp.float32, rngs=nnx.Rngs(1))
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x * 6 if x.ndim == 2 else x, state))
    return model


@jax.jit
def _last_logits(model, ids_1T, last):
    return model(ids_1T)[0, last]


def greedy_by_full_forward(model, prompt, n, width=48):
    """Greedy decoding the slow way: the whole sequence again for every token. Right padding
    to a fixed width keeps it one compile (causal attention: the padding is never seen)."""
    ids = list(prompt)
    for _ in range(n):
        padded = jnp.asarray([ids + [0] * (width - len(ids))])
        ids.append(int(jnp.argmax(_last_logits(model, padded, len(ids) - 1))))
    return ids[len(prompt) :]


# Lengths on both sides of a PROMPT_BUCKET boundary, so one batch holds heavy left padding.
PROMPTS = [[5, 6, 7], list(range(1, PROMPT_BUCKET + 3)), [42], [3, 1, 4, 1, 5, 9, 2, 6]]


def test_cached_greedy_decode_equals_full_forwards(tiny_model):
    got = generate_ids(tiny_model, PROMPTS, 10)
    want = [greedy_by_full_forward(tiny_model, p, 10) for p in PROMPTS]
    assert got == want
    assert len({tuple(g) for g in got}) > 1
    # A row alone (little padding) gives the same ids as in the padded batch.
    assert generate_ids(tiny_model, PROMPTS[1:2], 10) == got[1:2]
    # A parameter tree in either layer layout, with its config, gives the same too.
    params = nnx.to_pure_dict(nnx.state(tiny_model, nnx.Param))
    for tree in (params, stack_layers(params)):
        assert generate_ids(tree, PROMPTS, 10, config=TINY, dtype=jnp.float32) == got


def test_a_layer_with_a_cache_equals_the_layer_without(tiny_model):
    # Decoding runs the model's own decoder layer: a prompt written into an empty cache under
    # the causal mask gives the layer's plain output, and the cache holds its keys and values.
    b, t, s = 2, 5, 8
    x_BTD = jax.random.normal(jax.random.key(0), (b, t, TINY.hidden_size))
    positions_BT = jnp.broadcast_to(jnp.arange(t), (b, t))
    inv_freq = rope_inv_freq(TINY)
    ops = ops_for("bf16")
    layer = nnx.merge(*nnx.split(tiny_model.layers[0]))
    empty = jnp.zeros((b, s, TINY.num_key_value_heads, TINY.head_dim))
    mask_B1TS = (jnp.arange(s)[None, :] <= jnp.arange(t)[:, None])[None, None]
    cache = KVCache(empty, empty, 0, jnp.broadcast_to(mask_B1TS, (b, 1, t, s)))
    cached, cache = layer(x_BTD, positions_BT, inv_freq, ops, cache=cache)
    plain = layer(x_BTD, positions_BT, inv_freq, ops._replace(attention=causal_attention))
    np.testing.assert_allclose(cached, plain, rtol=1e-5, atol=1e-5)
    assert bool(jnp.any(cache.k[:, :t] != 0)) and bool(jnp.all(cache.k[:, t:] == 0))
    with pytest.raises(ValueError, match="plain attention over the cache"):
        layer(x_BTD, positions_BT, inv_freq, tiny_model.ops(), cache=cache)


def test_eos_stops_a_row_and_sampling_settings(tiny_model):
    greedy = generate_ids(tiny_model, PROMPTS, 10)
    eos = greedy[0][2]
    stopped = generate_ids(tiny_model, PROMPTS, 10, eos_token_id=eos)
    for row, full in zip(stopped, greedy, strict=True):
        cut = full.index(eos) + 1 if eos in full else len(full)
        assert row == full[:cut]
    # top_k=1 keeps only the argmax, at any temperature.
    assert generate_ids(tiny_model, PROMPTS, 10, temperature=1.5, top_k=1, seed=4) == greedy
    sampled = generate_ids(tiny_model, PROMPTS, 10, temperature=1.0, seed=1)
    assert sampled == generate_ids(tiny_model, PROMPTS, 10, temperature=1.0, seed=1)
    assert sampled != generate_ids(tiny_model, PROMPTS, 10, temperature=1.0, seed=2)
    # A tiny top_p keeps only the most likely token too.
    assert generate_ids(tiny_model, PROMPTS, 10, temperature=1.0, top_p=1e-6) == greedy


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=0), r"max_new_tokens must be an int >= 1, got 0"),
        (dict(temperature=-1.0), r"temperature must be >= 0"),
        (dict(top_k=-2), r"top_k must be an int >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(prompts=[[1, 2], []]), r"prompt 1 is empty"),
        (dict(prompts=[[1, 97]]), r"prompt 0 has token ids \[97\] outside 0\.\.96"),
    ],
)
def test_bad_arguments_are_named(tiny_model, kwargs, message):
    args = dict(prompts=[[1, 2]], max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=message):
        generate_ids(tiny_model, **args)


def test_text_interface_with_the_byte_tokenizer(tiny_model):
    config = dataclasses.replace(TINY, vocab_size=258, rope_scaling=None)
    model = Llama(config, dtype=jnp.float32, rngs=nnx.Rngs(2))
    tok = coat_jax.ByteTokenizer()
    outs = coat_jax.generate(model, tok, ["Hello", "It is a truth"], 6)
    assert isinstance(outs, list) and len(outs) == 2
    ids = generate_ids(model, [tok.encode("Hello")], 6, eos_token_id=tok.eos_token_id)[0]
    assert outs[0] == tok.decode(ids)
    assert coat_jax.sample_text(model, tok, "Hello", 6).startswith("Hello")
    with pytest.raises(TypeError, match="tokenizer must be"):
        generate(model, object(), "x")
    with pytest.raises(TypeError, match="needs config=LlamaConfig"):
        generate({"layers": {}}, tok, "x")


# ----------------------------------------------------------------------------- SmolLM2-135M

SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
]
SMOL_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def smollm_hf(smollm_gguf, tmp_path_factory):
    # In this process: the convert command line runs as a program in tests/model/test_convert.py.
    folder = tmp_path_factory.mktemp("smollm2_hf")
    assert convert_main(["gguf-to-hf", smollm_gguf, str(folder)]) == 0
    return folder


def test_smollm2_greedy_matches_transformers_generate(smollm_tokenizer, smollm_hf, capsys):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    with untraced():  # transformers' code only
        tok = AutoTokenizer.from_pretrained(smollm_hf)
    ours_tok = smollm_tokenizer
    prompts = [tok(p)["input_ids"] for p in SMOL_PROMPTS]
    assert prompts == [ours_tok(p)["input_ids"] for p in SMOL_PROMPTS]
    assert tok.chat_template == ours_tok.chat_template and "<|im_start|>" in tok.chat_template
    gen_cfg = json.loads((smollm_hf / "generation_config.json").read_text())
    assert gen_cfg["eos_token_id"] == ours_tok.eos_token_id

    want = []
    with untraced():  # transformers' code only
        reference = LlamaForCausalLM.from_pretrained(smollm_hf, dtype=torch.float32).eval()
        for ids in prompts:
            out = reference.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=SMOL_NEW_TOKENS,
                do_sample=False,
                eos_token_id=ours_tok.eos_token_id,
                pad_token_id=ours_tok.eos_token_id,
            )
            want.append(out[0, len(ids) :].tolist())
    model = coat_jax.from_pretrained(smollm_hf, dtype=jnp.float32)
    got = generate_ids(model, prompts, SMOL_NEW_TOKENS, eos_token_id=ours_tok.eos_token_id)
    print("SmolLM2 greedy:", [ours_tok.decode(g) for g in got])
    assert got == want

    # The command line on the converted folder, in this process: it decodes the same batch of
    # prompts with `generate` (the program compiled above), one line of prompt and text each.
    # (The .gguf's loading is the smollm_hf fixture's and tests/model/test_gguf.py's.)
    argv = [str(smollm_hf), *SMOL_PROMPTS, "--max-new-tokens", str(SMOL_NEW_TOKENS)]
    capsys.readouterr()
    assert generate_main(argv) == 0
    texts = [ours_tok.decode(g, skip_special_tokens=True) for g in got]
    lines = [f"{p}{t}\n" for p, t in zip(SMOL_PROMPTS, texts, strict=True)]
    assert capsys.readouterr().out == "".join(lines)
    assert len(texts[0]) > 2


def test_generate_cli_names_a_bad_source(capsys):
    assert generate_main([os.devnull + ".gguf", "x"]) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("error: ")
    assert len(stderr.strip().splitlines()) == 1 and ";" in stderr

"""GGUF import: synthetic llama.cpp-layout files against transformers, and the real SmolLM2-135M."""

import importlib.util
import math
import os
import tarfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax.checkpoint_io import from_pretrained
from coat_jax.gguf_io import unpermute_rope_rows
from coat_jax.llama import RopeScaling
from coat_jax.tokenizer import load_tokenizer
from tests.llama_reference import hf_llama, rel_err, token_ids, torch_logits, with_precision
from tests.untraced import untraced

gguf = pytest.importorskip("gguf")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute` (the layout GGUF files hold)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama3_rope_factors(theta, head_dim, factor, low, high, old_len) -> np.ndarray:
    """llama.cpp's converter's `rope_freqs` for llama3 RoPE scaling (its own formula)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def write_gguf(torch_model, path, *, arch="llama", extra_tensors=()):
    """Writes a transformers Llama (or Qwen2) as llama.cpp does: F32 tensors, a Llama's q/k rows
    permuted. ``arch``: the architecture the file says it holds."""
    cfg = torch_model.config
    n_layers = cfg.num_hidden_layers
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[cfg.model_type.upper()], n_layers)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(n_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "llama3":
        factors = llama3_rope_factors(
            rope["rope_theta"],
            head_dim,
            rope["factor"],
            rope["low_freq_factor"],
            rope["high_freq_factor"],
            rope["original_max_position_embeddings"],
        )
        w.add_tensor("rope_freqs.weight", factors)
    for name, tensor in torch_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = tensor.float().numpy()
        if cfg.model_type == "llama" and name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, cfg.num_attention_heads)
        elif cfg.model_type == "llama" and name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, cfg.num_key_value_heads)
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), array)
    for name, array in extra_tensors:
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unpermute_inverts_llama_cpp():
    w = np.random.default_rng(0).standard_normal((6 * 8, 5)).astype(np.float32)
    for heads in (1, 2, 3, 6):
        permuted = llama_cpp_permute(w, heads)
        assert not np.array_equal(permuted, w)
        np.testing.assert_array_equal(unpermute_rope_rows(permuted, heads), w)
    with pytest.raises(ValueError, match="do not split into 5 heads"):
        unpermute_rope_rows(w, 5)


LLAMA3_8K = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    "case, overrides, rope_scaling",
    [
        ("mha_untied", {}, None),
        # head_dim 8 and theta 5e5: the 4 frequencies fall in all three llama3 bands.
        (
            "gqa_tied_llama3",
            {"rope_scaling": LLAMA3_8K, "max_position_embeddings": 16384},
            RopeScaling.from_hf(LLAMA3_8K),
        ),
        ("mqa_untied_linear_headdim", {}, RopeScaling("linear", 2.0)),
    ],
)
def test_synthetic_gguf_matches_transformers(tmp_path, case, overrides, rope_scaling):
    torch_model = hf_llama(case, **overrides)
    path = write_gguf(torch_model, str(tmp_path / "m.gguf"))
    model = from_pretrained(path, dtype=jnp.float32)
    assert model.config.tie_word_embeddings == torch_model.config.tie_word_embeddings
    assert model.config.rope_scaling == rope_scaling
    ids = token_ids(torch_model.config.vocab_size, 2, 320, seed=8)
    assert rel_err(model(jnp.asarray(ids)), torch_logits(torch_model, ids)) <= 1e-4


def test_gguf_errors(tmp_path):
    torch_model = hf_llama("mha_untied", num_hidden_layers=1)
    bad_arch = write_gguf(torch_model, str(tmp_path / "a.gguf"), arch="gemma")
    with pytest.raises(ValueError, match=r"architecture 'gemma'; supported: \['llama', 'qwen2'\]"):
        from_pretrained(bad_arch)
    extra = [("blk.0.attn_qkv.weight", np.zeros((192, 64), np.float32))]
    bad_tensor = write_gguf(torch_model, str(tmp_path / "b.gguf"), extra_tensors=extra)
    with pytest.raises(ValueError, match="'blk.0.attn_qkv.weight' is not part of a Llama or Qwen2"):
        from_pretrained(bad_tensor)
    # A bias is a Qwen2 tensor: a Llama file holding one is refused by name.
    extra = [("blk.0.attn_q.bias", np.zeros(64, np.float32))]
    bias = write_gguf(torch_model, str(tmp_path / "d.gguf"), extra_tensors=extra)
    with pytest.raises(
        ValueError, match=r"does not use, e.g. \['model.layers.0.self_attn.q_proj.bias"
    ):
        from_pretrained(bias)
    freqs = [("rope_freqs.weight", np.asarray([1.0, 3.0, 1.0, 2.0] * 2, np.float32))]
    bad_rope = write_gguf(torch_model, str(tmp_path / "c.gguf"), extra_tensors=freqs)
    with pytest.raises(ValueError, match="rope_freqs.weight does not match llama3"):
        from_pretrained(bad_rope)


# ----------------------------------------------------------------------------- SmolLM2-135M

REPO = Path(__file__).resolve().parents[2]
CORPUS_PLACES = (
    REPO / "data" / "public_domain_en.tar.xz",
    REPO.parent / "shared" / "data" / "corpus" / "public_domain_en.tar.xz",
)
N_TOKENS = 384
# Tolerances of the BF16, FP8 and COAT modes against float32 on real text with the real model:
# perplexity relative to float32's, and mean |log p(next token)| difference.
SMOLLM_MODE_TOLERANCES = {
    "bf16": dict(ppl=0.01, logprob=0.05),
    "fp8": dict(ppl=0.06, logprob=0.3),
    "coat": dict(ppl=0.06, logprob=0.3),
}


@pytest.fixture(scope="module")
def corpus_text():
    for place in CORPUS_PLACES:
        if place.is_file():
            with tarfile.open(place) as tf:
                austen = tf.extractfile("austen/prideprejudice.txt").read().decode()
                bible = tf.extractfile("web_bible.txt").read().decode()
            return austen, bible
    pytest.skip(f"corpus not found in {[str(p) for p in CORPUS_PLACES]}")


@pytest.fixture(scope="module")
def smollm(smollm_gguf, smollm_tokenizer, corpus_text):
    """Our float32 SmolLM2, its tokenizer (tests/model/conftest.py's), and N_TOKENS tokens of
    Pride and Prejudice.

    The layers are scanned: XLA compiles one layer body instead of 30 (the synthetic
    files above load unrolled; tests/model/test_scan_remat.py holds the two layouts equal)."""
    ids = smollm_tokenizer(corpus_text[0][20000:26000])["input_ids"][:N_TOKENS]
    assert len(ids) == N_TOKENS
    model = from_pretrained(smollm_gguf, dtype=jnp.float32, scan_layers=True)
    return model, smollm_tokenizer, np.asarray([ids], np.int32)


def _logprobs(model, ids) -> np.ndarray:
    return np.asarray(jax.nn.log_softmax(jax.jit(lambda m, x: m(x))(model, ids), axis=-1))


@pytest.fixture(scope="module")
def smollm_logprobs(smollm):
    """The float32 model's log-probabilities of every next token."""
    model, _, ids = smollm
    return _logprobs(model, jnp.asarray(ids))


def _target_logprobs(logprobs, ids) -> np.ndarray:
    return np.take_along_axis(logprobs[0, :-1], ids[0, 1:, None], axis=-1)[:, 0]


def test_smollm2_config(smollm):
    cfg = smollm[0].config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and cfg.rope_theta == 100000.0


def test_smollm2_tokenizer_matches_transformers(smollm, smollm_gguf, corpus_text):
    from transformers import AutoTokenizer

    folder, name = os.path.split(smollm_gguf)
    # Bible text: verse numbers exercise SmolLM's one-token-per-digit pre-tokenizer.
    texts = (corpus_text[0][50000:56000], corpus_text[1][100000:106000])
    with untraced():  # transformers' code only
        reference = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        want = [reference(text)["input_ids"] for text in texts]
    ours = smollm[1]
    for text, reference_ids in zip(texts, want, strict=True):
        ids = ours(text)["input_ids"]
        assert ids == reference_ids
        assert ours.decode(ids) == text
    assert ours("2024")["input_ids"] == [ours.convert_tokens_to_ids(d) for d in "2024"]
    assert ours("<|im_start|>user")["input_ids"][0] == ours.convert_tokens_to_ids("<|im_start|>")
    assert (ours.bos_token, ours.eos_token) == (reference.bos_token, reference.eos_token)


def test_smollm2_logprobs_match_transformers(smollm, smollm_gguf, smollm_logprobs):
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("transformers' GGUF loading needs accelerate (pip install accelerate)")
    import torch
    from transformers import AutoModelForCausalLM

    ids = smollm[2]
    folder, name = os.path.split(smollm_gguf)
    with untraced():  # transformers' code only
        reference = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32
        )
    want = np.asarray(
        jax.nn.log_softmax(torch_logits(reference.eval(), ids).astype(np.float32), axis=-1)
    )
    got = smollm_logprobs
    diff = np.abs(got - want)
    print(f"SmolLM2 max |logprob diff| {diff.max():.3g}, on targets {_targ_max(got, want, ids)}")
    assert diff.max() <= 1e-3
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


def _targ_max(got, want, ids) -> float:
    return float(np.abs(_target_logprobs(got, ids) - _target_logprobs(want, ids)).max())


def test_smollm2_perplexity_and_precision_modes(smollm, smollm_logprobs):
    model32, _, ids = smollm
    lp32 = _target_logprobs(smollm_logprobs, ids)
    ppl32 = float(np.exp(-lp32.mean()))
    # Without the q/k un-permutation this is about 230; a uniform guess would be 49152.
    assert 5.0 < ppl32 < 40.0, ppl32
    measured = {"float32": ppl32}
    for precision, tol in SMOLLM_MODE_TOLERANCES.items():
        model = with_precision(model32, precision, jnp.bfloat16)
        lp = _target_logprobs(_logprobs(model, jnp.asarray(ids)), ids)
        ppl = float(np.exp(-lp.mean()))
        dlp = float(np.abs(lp - lp32).mean())
        measured[precision] = (ppl, dlp)
        assert abs(ppl / ppl32 - 1) <= tol["ppl"], measured
        assert dlp <= tol["logprob"], measured
    print("SmolLM2 perplexity (ppl, mean |dlogprob|):", measured)


def test_a_qwen2_gguf_tokenizer_splits_as_transformers_does(tmp_path):
    """Qwen2's pre-tokenizer (tokenizer.ggml.pre = qwen2) splits every digit on its own, so the
    merge "1 2" never applies, where Llama 3's split would make "12" of "1212"."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    merges = ["1 2", "a b", "Ġ 1"]
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens += [m.replace(" ", "") for m in merges] + ["<|endoftext|>"]
    w = gguf.GGUFWriter(str(tmp_path / "tok.gguf"), "qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([1] * (len(tokens) - 1) + [3])
    w.add_eos_token_id(len(tokens) - 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = load_tokenizer(str(tmp_path / "tok.gguf"))
    text = "ab 12 345 don't 1212<|endoftext|>"
    assert ours.tokenize(text)[-5:] == ["1", "2", "1", "2", "<|endoftext|>"]
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tok.gguf")
    assert ours(text)["input_ids"] == reference(text)["input_ids"]

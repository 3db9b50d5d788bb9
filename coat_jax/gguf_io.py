"""GGUF files (llama.cpp) of architecture `llama` or `qwen2` as a tensor source and a tokenizer.

`GGUFSource` reads the model config from the GGUF metadata and serves each tensor under its
Hugging Face name, dequantized to float32 by the `gguf` package and, for a Llama's
q_proj/k_proj, with llama.cpp's RoPE row permutation undone (docs/design.md, 'Checkpoints';
llama.cpp keeps Qwen2's rows in Hugging Face's order), so `checkpoint_io` loads it with the same
name map as a Hugging Face folder.
"""

from __future__ import annotations

import os
import re

import numpy as np

from coat_jax.llama import LlamaConfig, RopeScaling

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# GGUF architectures read, by the model_type (coat_jax.families) they load as.
ARCHITECTURES = ("llama", "qwen2")
# llama.cpp stores Llama 3.1+ RoPE scaling as per-frequency divisors in this tensor.
_ROPE_FREQS = "rope_freqs.weight"
# Every Llama 3.1/3.2/3.3 release uses these; the factor is read from the tensor itself.
_LLAMA3_ROPE_DEFAULTS = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def gguf_to_hf_name(name: str) -> str:
    """Hugging Face name of a llama.cpp tensor name; ValueError for a name Llama lacks."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"GGUF tensor {name!r} is not part of a Llama or Qwen2 model")


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation (interleaved RoPE pairs -> HF's rotate-half).

    llama.cpp's converter reshapes the rows as [heads, 2, head_dim/2] and swaps the last two
    axes; this swaps them back.
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of even size")
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _rope_scaling(reader, arch: str, rope_freqs, config_kwargs) -> RopeScaling | None:
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if rope_freqs is not None:
        return _llama3_from_rope_freqs(rope_freqs, config_kwargs)
    if scaling_type in (None, "none"):
        return None
    if scaling_type == "linear":
        return RopeScaling("linear", float(_field(reader, f"{arch}.rope.scaling.factor")))
    raise ValueError(
        f"GGUF rope scaling type {scaling_type!r} is not supported; valid: none, linear, "
        f"llama3 (as a {_ROPE_FREQS} tensor)"
    )


def _llama3_from_rope_freqs(rope_freqs: np.ndarray, config_kwargs) -> RopeScaling:
    """The llama3 RopeScaling whose frequency divisors are `rope_freqs`, or ValueError."""
    from coat_jax.llama import rope_inv_freq

    factor = float(rope_freqs.max())
    scaling = RopeScaling("llama3", factor, **_LLAMA3_ROPE_DEFAULTS)
    base = LlamaConfig(**config_kwargs)
    plain = rope_inv_freq(base)
    scaled = rope_inv_freq(LlamaConfig(**{**config_kwargs, "rope_scaling": scaling}))
    if rope_freqs.shape != plain.shape or not np.allclose(plain / scaled, rope_freqs, rtol=1e-4):
        raise ValueError(
            f"GGUF {_ROPE_FREQS} does not match llama3 RoPE scaling with factor {factor} and "
            f"{_LLAMA3_ROPE_DEFAULTS}; this RoPE variant is not supported"
        )
    return scaling


def gguf_package():
    """The ``gguf`` package, an optional dependency: one line naming the extra when it is
    missing."""
    try:
        import gguf
    except ImportError as e:
        raise ImportError(
            "reading GGUF files needs the gguf package: pip install 'coat-jax[gguf]'"
        ) from e
    return gguf


class GGUFSource:
    """A Llama or Qwen2 `.gguf` file: `config` plus tensors by Hugging Face name (float32, HF
    layout)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.reader = gguf_package().GGUFReader(self.path)
        arch = _field(self.reader, "general.architecture")
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"{self.path} is a GGUF of architecture {arch!r}; supported: {list(ARCHITECTURES)}"
            )
        self._tensors = {}
        rope_freqs = None
        for t in self.reader.tensors:
            if t.name == _ROPE_FREQS:
                rope_freqs = self._dequantize(t)
                continue
            self._tensors[gguf_to_hf_name(t.name)] = t
        self.config = self._read_config(arch, rope_freqs)

    def _read_config(self, arch: str, rope_freqs) -> LlamaConfig:
        r = self.reader

        def need(key):
            value = _field(r, f"{arch}.{key}")
            if value is None:
                raise ValueError(f"{self.path} lacks GGUF metadata {arch}.{key}")
            return value

        heads = int(need("attention.head_count"))
        hidden = int(need("embedding_length"))
        head_dim = _field(r, f"{arch}.attention.key_length")
        if head_dim is None:
            head_dim = _field(r, f"{arch}.rope.dimension_count", hidden // heads)
        vocab = _field(r, f"{arch}.vocab_size")
        if vocab is None:
            vocab = len(r.fields["tokenizer.ggml.tokens"].data)
        kwargs = dict(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_hidden_layers=int(need("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(_field(r, f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(head_dim),
            rope_theta=float(_field(r, f"{arch}.rope.freq_base", 10000.0)),
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            tie_word_embeddings="lm_head.weight" not in self._tensors,
            max_position_embeddings=int(_field(r, f"{arch}.context_length", 2048)),
            model_type=arch,
        )
        kwargs["rope_scaling"] = _rope_scaling(r, arch, rope_freqs, kwargs)
        return LlamaConfig(**kwargs)

    def names(self) -> list[str]:
        return list(self._tensors)

    @staticmethod
    def _dequantize(t) -> np.ndarray:
        dequantize = gguf_package().dequantize
        # GGUF lists dims fastest-first; numpy (and HF) order is the reverse.
        shape = tuple(int(d) for d in reversed(t.shape))
        return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)

    def get(self, name: str) -> np.ndarray:
        w = self._dequantize(self._tensors[name])
        if self.config.model_type != "llama":
            return w
        if name.endswith("self_attn.q_proj.weight"):
            w = unpermute_rope_rows(w, self.config.num_attention_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            w = unpermute_rope_rows(w, self.config.num_key_value_heads)
        return w


# ----------------------------------------------------------------------------- tokenizer

_GPT2_DIGITS_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_GPT2_PLAIN_PRE = ("default", "gpt2", "mpt", "olmo", "jais")
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe")
# Llama 3's split regex from its tokenizer.json, as llama.cpp's "llama-bpe" uses it.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PRE = ("qwen2", "deepseek-r1-qwen")
_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str | None):
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre is None or pre in _GPT2_PLAIN_PRE:
        return byte_level
    if pre in _GPT2_DIGITS_PRE:
        # llama.cpp splits these on every digit first, then applies the GPT-2 regex.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _LLAMA3_PRE or pre in _QWEN2_PRE:
        if pre in _QWEN2_PRE:
            # Qwen2's split: Llama 3's with one digit per piece, from its transformers tokenizer.
            from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as split
        else:
            split = _LLAMA3_SPLIT
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    valid = sorted((*_GPT2_PLAIN_PRE, *_GPT2_DIGITS_PRE, *_LLAMA3_PRE, *_QWEN2_PRE))
    raise ValueError(f"GGUF tokenizer.ggml.pre={pre!r} is not supported; valid: {valid}")


def load_gguf_tokenizer(path: str | os.PathLike):
    """The tokenizer stored in a GGUF file's metadata, as a transformers fast tokenizer.

    Byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`: Llama 3, SmolLM, Qwen2) are built
    here from the tokens, merges and pre-tokenizer type. SentencePiece ones (`"llama"`: Llama 2)
    go through transformers' own GGUF tokenizer conversion.
    """
    GGUFReader = gguf_package().GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = os.fspath(path)
    reader = GGUFReader(path)
    model_type = _field(reader, "tokenizer.ggml.model")
    if model_type == "llama":
        folder, name = os.path.split(os.path.abspath(path))
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if model_type != "gpt2":
        raise ValueError(
            f"GGUF tokenizer.ggml.model={model_type!r} is not supported; valid: 'gpt2', 'llama'"
        )
    tokens = _field(reader, "tokenizer.ggml.tokens")
    token_types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise ValueError(
            f"{path}: {len(tokens)} tokens but {len(token_types)} token types in the metadata"
        )
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, token_types, strict=True)
            if kind == _TOKEN_TYPE_CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, token_types, strict=True)
            if kind == _TOKEN_TYPE_USER_DEFINED
        ]
    )

    def special(key):
        idx = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return None if idx is None else tokens[int(idx)]

    bos = special("bos")
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=special("eos"),
        unk_token=special("unknown"),
        pad_token=special("padding"),
    )
    chat_template = _field(reader, "tokenizer.chat_template")
    if chat_template is not None:
        out.chat_template = chat_template
    return out

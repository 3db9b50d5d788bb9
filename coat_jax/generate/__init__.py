"""Text generation for coat-jax's Llama: a KV cache, a jitted prefill and a jitted decode loop.

    python -m coat_jax.generate runs/default "It is a truth universally acknowledged"
    python -m coat_jax.generate model.gguf "The capital of France is" --max-new-tokens 32

`generate(model, tokenizer, prompt)` encodes one prompt or a batch, left-pads the batch (each row
keeps its own positions, and padding is masked out of attention), runs the prompt through the
model once (prefill) to fill a KV cache of `prompt + max_new_tokens` columns, then decodes one
token per step in a `lax.while_loop` that stops when every row has produced EOS. Prefill and
loop are one jitted program per (batch, padded prompt length, max_new_tokens): the sampling
settings are traced values, so changing them does not recompile, and prompt lengths are padded
up to a multiple of `PROMPT_BUCKET` so that nearby lengths share a compile.

The cached forward is the model's own: its embedding, its decoder layers (each given a
`coat_jax.llama.KVCache`), its final norm and LM head, in the model's compute dtype, with the
plain ops of `coat_jax.fp8_ops.ops_for("bf16")`. For the "fp8" and "coat" precisions
decoding therefore does not quantize: it runs the same weights in plain BF16 (or float32)
arithmetic. FP8 matters for training memory; for sampling the plain math is the reference.

Temperature 0 is greedy decoding (argmax); otherwise logits are divided by the temperature, cut
to the `top_k` most likely tokens and then to the smallest set whose probability reaches `top_p`
(transformers' order), and sampled with `jax.random` from `seed`.
"""

from __future__ import annotations

import argparse
import functools
import sys
import types
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from coat_jax.checkpoint_io import from_pretrained
from coat_jax.command_line import ErrorParser, one_line_error
from coat_jax.fp8_ops import ops_for
from coat_jax.llama import KVCache, Llama, LlamaConfig, rope_inv_freq, stack_layers
from coat_jax.runs import is_run_dir, load_run_model
from coat_jax.tokenizer import ByteTokenizer, load_tokenizer

# Prompt lengths are left-padded up to a multiple of this, so nearby lengths share a compile.
PROMPT_BUCKET = 16
# Decoding runs the plain ops in every precision mode (see the module docstring).
_OPS = ops_for("bf16")


# ----------------------------------------------------------------------------- the cached model


def _forward(model, ids_BT, positions_BT, cache, start, pads_B):
    """Runs T new tokens (cache columns ``start..start+T-1``) through ``model`` (a scanned
    `Llama`), its decoder layers reading and writing the KV cache.

    Returns the float32 logits of the last column [B, V] and the updated cache. ``cache`` is
    ``(k, v)``, each [layers, B, S, kv_heads, head_dim]; a row's first ``pads_B`` columns are
    padding that no query attends to.
    """
    ops = _OPS
    t = ids_BT.shape[1]
    inv_freq = rope_inv_freq(model.config)
    s = cache[0].shape[2]
    cols_T = start + jnp.arange(t)
    keys_S = jnp.arange(s)
    mask_B1TS = (keys_S[None, None, :] <= cols_T[None, :, None]) & (
        keys_S[None, None, :] >= pads_B[:, None, None]
    )
    mask_B1TS = mask_B1TS[:, None]
    graphdef, stacked = nnx.split(model.layers)

    def layer(carry, layer_state):
        x_BTD, k_cache, v_cache, i = carry
        kv = KVCache(k_cache[i], v_cache[i], start, mask_B1TS)
        x_BTD, kv = nnx.merge(graphdef, layer_state)(x_BTD, positions_BT, inv_freq, ops, cache=kv)
        k_cache = jax.lax.dynamic_update_slice(k_cache, kv.k[None], (i, 0, 0, 0, 0))
        v_cache = jax.lax.dynamic_update_slice(v_cache, kv.v[None], (i, 0, 0, 0, 0))
        return (x_BTD, k_cache, v_cache, i + 1), None

    (x_BTD, k_cache, v_cache, _), _ = jax.lax.scan(
        layer, (model.embed(ids_BT), *cache, jnp.int32(0)), stacked
    )
    x_BD = model.norm(x_BTD[:, -1], ops)
    logits_BV = jnp.einsum(
        "bd,dv->bv", x_BD, model.output_weight(), preferred_element_type=jnp.float32
    )
    return logits_BV, (k_cache, v_cache)


def _decoding_model(params, config: LlamaConfig, dtype) -> Llama:
    """A scanned `Llama` of compute ``dtype`` holding ``params`` (either layout)."""
    model = nnx.eval_shape(lambda: Llama(config, dtype=dtype, scan_layers=True))
    graphdef, state = nnx.split(model)
    nnx.replace_by_pure_dict(state, stack_layers(params))
    return nnx.merge(graphdef, state)


def _sample(logits_BV, key, temperature, top_k, top_p):
    """The next token per row: argmax at temperature 0, else top-k, then top-p sampling."""

    def greedy():
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)

    def sample():
        scaled_BV = logits_BV / temperature
        vocab = scaled_BV.shape[-1]
        sorted_BV = -jnp.sort(-scaled_BV, axis=-1)
        k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
        sorted_BV = jnp.where(jnp.arange(vocab) < k, sorted_BV, -jnp.inf)
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        # Keep a token while the mass before it is below top_p: the smallest set reaching it.
        kept_B = jnp.sum((jnp.cumsum(probs_BV, axis=-1) - probs_BV) < top_p, axis=-1)
        threshold_B1 = jnp.take_along_axis(sorted_BV, jnp.maximum(kept_B, 1)[:, None] - 1, axis=-1)
        masked_BV = jnp.where(scaled_BV >= threshold_B1, scaled_BV, -jnp.inf)
        return jax.random.categorical(key, masked_BV, axis=-1).astype(jnp.int32)

    return jax.lax.cond(temperature > 0, sample, greedy)


@functools.partial(jax.jit, static_argnames=("config", "dtype", "max_new_tokens"))
def _generate(
    params, ids_BP, pads_B, eos, temperature, top_k, top_p, key, *, config, dtype, max_new_tokens
):
    model = _decoding_model(params, config, dtype)
    b, p = ids_BP.shape
    shape = (config.num_hidden_layers, b, p + max_new_tokens)
    shape += (config.num_key_value_heads, config.head_dim)
    cache = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    positions_BP = jnp.maximum(jnp.arange(p)[None, :] - pads_B[:, None], 0)
    logits_BV, cache = _forward(model, ids_BP, positions_BP, cache, 0, pads_B)
    token_B = _sample(logits_BV, jax.random.fold_in(key, 0), temperature, top_k, top_p)
    out_BN = jnp.full((b, max_new_tokens), eos, jnp.int32).at[:, 0].set(token_B)

    def running(state):
        i, _, done_B, _, _ = state
        return (i < max_new_tokens) & ~jnp.all(done_B)

    def step(state):
        i, token_B, done_B, out_BN, cache = state
        col = p + i - 1  # the column of the token fed in now
        positions_B1 = (col - pads_B)[:, None]
        logits_BV, cache = _forward(model, token_B[:, None], positions_B1, cache, col, pads_B)
        token_B = _sample(logits_BV, jax.random.fold_in(key, i), temperature, top_k, top_p)
        token_B = jnp.where(done_B, eos, token_B)
        out_BN = jax.lax.dynamic_update_slice(out_BN, token_B[:, None], (0, i))
        return i + 1, token_B, done_B | (token_B == eos), out_BN, cache

    state = (jnp.int32(1), token_B, token_B == eos, out_BN, cache)
    return jax.lax.while_loop(running, step, state)[3]


# ----------------------------------------------------------------------------- token ids


def _model_parts(model, config, dtype) -> tuple[Mapping, LlamaConfig, Any]:
    """(pure-dict params, config, compute dtype) of a `Llama` or of a params tree + config."""
    if isinstance(model, Llama):
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        return params, model.config, model.dtype if dtype is None else jnp.dtype(dtype)
    if isinstance(model, Mapping):
        if not isinstance(config, LlamaConfig):
            raise TypeError(
                "generating from a parameter tree needs config=LlamaConfig(...), got "
                f"{type(config).__name__}"
            )
        return model, config, jnp.dtype(jnp.bfloat16 if dtype is None else dtype)
    raise TypeError(
        f"model must be a coat_jax.Llama or a pure-dict parameter tree, got {type(model).__name__}"
    )


def _check_sampling(max_new_tokens, temperature, top_k, top_p):
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature!r}")
    if not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0: off), got {top_k!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1: off), got {top_p!r}")


def generate_ids(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 64,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_token_id: int | None = None,
    config: LlamaConfig | None = None,
    dtype=None,
) -> list[list[int]]:
    """New token ids for each prompt of token ids, up to and including EOS (as transformers).

    Args:
      model: a `coat_jax.Llama`, or its pure-dict parameter tree (unrolled or stacked layers)
        with `config`.
      prompts: a batch of non-empty token-id lists, of any lengths.
      max_new_tokens: the most tokens generated per prompt.
      temperature: 0 for greedy decoding, else the softmax temperature.
      top_k: keep only the k most likely tokens (0: all).
      top_p: keep the smallest set of tokens whose probability reaches top_p (1: all).
      seed: the sampling randomness.
      eos_token_id: a row stops after producing it; None: always `max_new_tokens` tokens.
      config: the architecture, when `model` is a parameter tree.
      dtype: compute dtype; None: the model's (bfloat16 for a parameter tree).

    Returns:
      One list of new token ids per prompt.
    """
    params, config, dtype = _model_parts(model, config, dtype)
    _check_sampling(max_new_tokens, temperature, top_k, top_p)
    if isinstance(prompts, (str, bytes)) or not len(prompts):
        raise ValueError("prompts must be a non-empty list of token-id lists")
    rows = [np.asarray(p, np.int64).reshape(-1) for p in prompts]
    for i, row in enumerate(rows):
        if row.size == 0:
            raise ValueError(f"prompt {i} is empty; give at least one token")
        bad = row[(row < 0) | (row >= config.vocab_size)]
        if bad.size:
            raise ValueError(
                f"prompt {i} has token ids {bad[:5].tolist()} outside 0..{config.vocab_size - 1}"
            )
    longest = max(r.size for r in rows)
    padded = -(-longest // PROMPT_BUCKET) * PROMPT_BUCKET
    ids_BP = np.zeros((len(rows), padded), np.int32)
    for i, row in enumerate(rows):
        ids_BP[i, padded - row.size :] = row
    pads_B = np.asarray([padded - r.size for r in rows], np.int32)
    eos = -1 if eos_token_id is None else int(eos_token_id)
    out_BN = _generate(
        params,
        ids_BP,
        pads_B,
        np.int32(eos),
        np.float32(temperature),
        np.int32(top_k),
        np.float32(top_p),
        jax.random.key(seed),
        config=config,
        dtype=jnp.dtype(dtype),
        max_new_tokens=int(max_new_tokens),
    )
    result = []
    for row in np.asarray(out_BN).tolist():
        result.append(row[: row.index(eos) + 1] if eos in row else row)
    return result


# ----------------------------------------------------------------------------- text


def _codec(tokenizer):
    """(encode, decode, eos id) for a transformers tokenizer, ByteTokenizer or the trainer's."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode, tokenizer.decode, tokenizer.eos_token_id
    if hasattr(tokenizer, "eos_id") and hasattr(tokenizer, "encode"):
        # coat_jax.training.data.Tokenizer: encodes as the training data was (no BOS).
        return (lambda t: tokenizer.encode(t).tolist()), tokenizer.decode, tokenizer.eos_id
    if callable(tokenizer) and hasattr(tokenizer, "decode"):
        return (
            lambda t: tokenizer(t)["input_ids"],
            lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            tokenizer.eos_token_id,
        )
    raise TypeError(
        "tokenizer must be a transformers tokenizer, a coat_jax.ByteTokenizer or a "
        f"coat_jax.training.data.Tokenizer, got {type(tokenizer).__name__}"
    )


def generate(
    model,
    tokenizer,
    prompt: str | Sequence[str],
    max_new_tokens: int = 64,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    config: LlamaConfig | None = None,
    dtype=None,
) -> str | list[str]:
    """The continuation of a prompt (or of each prompt of a list), decoded to text.

    Generation stops at the tokenizer's EOS token, which is not part of the text. Arguments
    are those of `generate_ids`; `tokenizer` is a transformers tokenizer (its own special-token
    rules apply, e.g. a BOS), a `coat_jax.ByteTokenizer` or the trainer's tokenizer.

    Example (a random byte-level model, so the text is noise; with a trained one, e.g.
    ``coat_jax.from_pretrained("SmolLM2-135M.gguf")`` and ``coat_jax.load_tokenizer`` of the same
    file, it is the model's continuation):
      >>> cfg = LlamaConfig(vocab_size=258, hidden_size=32, intermediate_size=64,
      ...                   num_hidden_layers=1, num_attention_heads=4)
      >>> model = Llama(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
      >>> texts = generate(model, ByteTokenizer(), ["The capital of France is", "It is"], 8)
      >>> [type(t).__name__ for t in texts]
      ['str', 'str']
    """
    encode, decode, eos = _codec(tokenizer)
    texts = [prompt] if isinstance(prompt, str) else list(prompt)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError("prompt must be a string or a non-empty list of strings")
    new_ids = generate_ids(
        model,
        [encode(t) for t in texts],
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        eos_token_id=eos,
        config=config,
        dtype=dtype,
    )
    outs = [decode(ids[:-1] if ids and ids[-1] == eos else ids) for ids in new_ids]
    return outs[0] if isinstance(prompt, str) else outs


def sample_text(
    model,
    tokenizer,
    prompt: str,
    max_new_tokens: int = 64,
    *,
    config: LlamaConfig | None = None,
    dtype=None,
    temperature: float = 0.8,
    top_p: float = 0.95,
    seed: int = 0,
) -> str:
    """The prompt followed by a sampled continuation: a quick look at what a model learned.

    For the end of a training run: `model` may be the trainer's parameter tree with its
    `config` and compute `dtype`. Sampling (temperature 0.8, top-p 0.95) instead of greedy
    decoding, which makes small models repeat themselves.
    """
    return prompt + generate(
        model,
        tokenizer,
        prompt,
        max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        config=config,
        dtype=dtype,
    )


# ----------------------------------------------------------------------------- command line

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def load_for_generation(source: str, *, step: int | None = None, dtype="float32"):
    """(model, tokenizer) from a train.py run directory, an HF/coat-jax folder or a .gguf."""
    if is_run_dir(source):
        return load_run_model(source, step=step, dtype=_DTYPES[dtype])
    if step is not None:
        raise ValueError(f"--step is for train.py run directories; {source!r} is a checkpoint")
    return from_pretrained(source, dtype=_DTYPES[dtype]), load_tokenizer(source)


def main(argv: list[str] | None = None) -> int:
    parser = ErrorParser(
        prog="python -m coat_jax.generate",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            '  python -m coat_jax.generate runs/default "It is a truth" --max-new-tokens 80\n'
            '  python -m coat_jax.generate runs/default "Mr. Darcy" --temperature 0.8 --top-p 0.95\n'
            '  python -m coat_jax.generate path/to/hf_folder "Hello" "Bonjour"\n'
            '  python -m coat_jax.generate model.gguf "The capital of France is"'
        ),
    )
    parser.add_argument("source", help="a train.py output_dir, an HF or coat-jax folder, a .gguf")
    parser.add_argument("prompts", nargs="+", metavar="prompt", help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="default 64")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 (default): off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 (default): off")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--step", type=int, default=None, help="a run's checkpoint step (newest)")
    parser.add_argument(
        "--dtype", choices=sorted(_DTYPES), default="float32", help="compute dtype (float32)"
    )
    args = parser.parse_args(argv)
    try:
        model, tokenizer = load_for_generation(args.source, step=args.step, dtype=args.dtype)
        outs = generate(
            model,
            tokenizer,
            args.prompts,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
        )
    except (ValueError, TypeError, OSError) as e:
        print(one_line_error(e, "see python -m coat_jax.generate --help"), file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompts, outs, strict=True):
        print(prompt + out)
    return 0


class _CallableModule(types.ModuleType):
    """Importing this module binds ``coat_jax.generate`` to it, shadowing the function of the
    same name that ``coat_jax`` exports; calling the module calls the function, so
    ``coat_jax.generate(model, tokenizer, prompt)`` works whichever of the two it is."""

    def __call__(self, *args, **kwargs):
        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

"""FP8 attention: attention in the compute dtype that keeps FP8 q, k, v for backward, and
attention with the o_proj as one op whose backward does not run the attention forward again.
"""

from __future__ import annotations

import functools

import jax

from coat_jax import attention
from coat_jax.fp8.checks import check_float
from coat_jax.fp8.config import DEFAULT_CONFIG, FP8Config
from coat_jax.fp8.linear import fp8_linear_bwd, fp8_linear_fwd
from coat_jax.fp8.residuals import keep, pin
from pallas_kernels import fp8_quant


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 6))
def fp8_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    is_causal: bool = True,
    config: FP8Config = DEFAULT_CONFIG,
    segment_ids: jax.Array | None = None,
    window: int | None = None,
) -> jax.Array:
    """Attention in BF16 that keeps FP8 q, k, v (1x16 along the head dim) for backward.

    Beyond COAT, which keeps attention's q, k, v (and output) in BF16: backward dequantizes the
    saved q, k, v and re-runs the attention forward before its backward (one extra attention
    forward per step). Nothing of the ``[B, N, T, T]`` size is kept on any backend.

    Args:
      q: ``[B, T, N, H]``; k, v: ``[B, S, K, H]`` (GQA when ``K`` divides ``N``), one dtype.
      is_causal: static; config: static :class:`FP8Config`.
      segment_ids: int ``[B, T]`` or None: a query attends only to keys of its own segment
        (``coat_jax.attention.attend``; XLA's attention only).
      window: static int or None: each query attends to at most the ``window`` latest keys,
        itself included (a sliding window, as ``coat_jax.attention.attend``'s).
    """
    return _fp8_attention_fwd(q, k, v, is_causal, config, segment_ids, window)[0]


def _check_attention_inputs(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(name, t)
        if t.ndim != 4 or t.dtype != q.dtype:
            raise ValueError(
                f"fp8_attention needs [B, T, N, H] arrays of one dtype; got {name} "
                f"{t.shape} {t.dtype} (q is {q.shape} {q.dtype})"
            )


def _kept_qkv(q, k, v, config):
    """q, k and v as the FP8 attention ops keep them: E4M3 codes with 1xG scales, pinned."""
    saved = [
        fp8_quant.quantize_per_group(t, **config.quantize_kwargs("quantize_per_group"))
        for t in (q, k, v)
    ]
    return keep(pin(tuple(saved), config))


def _fp8_attention_fwd(q, k, v, is_causal, config, segment_ids=None, window=None):
    _check_attention_inputs(q, k, v)
    impl = attention.attention_implementation(q.dtype, config.attention)
    out = attention.attend(
        q, k, v, is_causal=is_causal, implementation=impl, segment_ids=segment_ids, window=window
    )
    return out, (_kept_qkv(q, k, v, config), segment_ids)


def _fp8_attention_bwd(is_causal, config, window, res, dy):
    kept, segment_ids = res
    q, k, v = (t.dequantize().astype(dy.dtype) for t in kept)
    impl = attention.attention_implementation(q.dtype, config.attention)
    attend = functools.partial(
        attention.attend,
        is_causal=is_causal,
        implementation=impl,
        segment_ids=segment_ids,
        window=window,
    )
    _, pullback = jax.vjp(attend, q, k, v)
    return (*pullback(dy), None)


fp8_attention.defvjp(_fp8_attention_fwd, _fp8_attention_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def fp8_attention_linear(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    w,
    is_causal: bool = True,
    config: FP8Config = DEFAULT_CONFIG,
) -> jax.Array:
    """``fp8_linear(attention(q, k, v), w)``: attention and the o_proj as one op whose backward
    does not run the attention forward again.

    Forward is :func:`fp8_attention`'s attention (on the exact q, k, v) followed by
    :func:`fp8_linear`. Kept for backward: the FP8 q, k, v (1xG, as :func:`fp8_attention`),
    the linear's own residuals (its E4M3 per-tensor input, i.e. the attention output, and its
    weights) and the attention's float32 softmax statistics. Backward runs the linear's
    backward, then the attention's backward at the dequantized q, k, v with the forward's
    statistics and the dequantized FP8 output (``coat_jax.attention.backward``: cuDNN on a GPU
    in BF16, the jnp reference elsewhere). ``FP8Config(attention_backward="saved_output")``.

    Args:
      q: ``[B, T, N, H]``; k, v: ``[B, S, K, H]`` (GQA when ``K`` divides ``N``), one dtype.
      w: the o_proj weight ``[N * H, D]`` as :func:`fp8_linear` takes it.
      is_causal: static; config: static :class:`FP8Config`.

    Returns:
      ``[B, T, D]`` in q's dtype.
    """
    return _fp8_attention_linear_fwd(q, k, v, w, is_causal, config)[0]


def _fp8_attention_linear_fwd(q, k, v, w, is_causal, config):
    _check_attention_inputs(q, k, v)
    if isinstance(w, (tuple, list)):
        raise ValueError(
            "fp8_attention_linear takes one o_proj weight [N * H, D] (or its FP8Weight), not a "
            f"{type(w).__name__} of {len(w)}; run fp8_attention and fp8_linear for several"
        )
    impl = attention.attention_implementation(q.dtype, config.attention)
    out, stats = attention.forward(q, k, v, is_causal, impl)
    b, t, n, h = q.shape
    y, linear_res = fp8_linear_fwd(out.reshape(b, t, n * h), w, config)
    return y, (_kept_qkv(q, k, v, config), keep(stats), linear_res)


def _fp8_attention_linear_bwd(is_causal, config, res, dy):
    saved, stats, linear_res = res
    d_out, dw = fp8_linear_bwd(config, linear_res, dy)
    q, k, v = (x.dequantize().astype(dy.dtype) for x in saved)
    # The linear's kept input is the attention output's E4M3 per-tensor codes, [B * T, N * H].
    out = linear_res[0].dequantize().astype(dy.dtype).reshape(q.shape)
    impl = attention.attention_implementation(q.dtype, config.attention)
    dq, dk, dv = attention.backward(q, k, v, out, stats, d_out.reshape(q.shape), is_causal, impl)
    return dq, dk, dv, dw


fp8_attention_linear.defvjp(_fp8_attention_linear_fwd, _fp8_attention_linear_bwd)

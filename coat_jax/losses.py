"""Chunked cross-entropy: the language-model loss without the [B, T, V] float32 logits.

``optax.softmax_cross_entropy_with_integer_labels(einsum("btd,dv->btv", h, w))`` keeps the
float32 logits (or the softmax) for backward, and its backward builds a float32 gradient of the
same size: ``B * T * V * 4`` bytes each, many times the token's BF16 hidden state at a large
vocabulary. :func:`cross_entropy_from_hidden` takes the hidden states and the head's weight
instead and works on blocks of ``chunk_size`` sequence positions by ``vocab_chunk_size``
vocabulary columns: the forward pass keeps an online logsumexp per token, backward keeps only
that (4 bytes per token) and recomputes each block's logits.

Against the plain loss and a ``jax.checkpoint`` over a ``lax.map`` of token chunks, it keeps the
least (XLA's ``compiled.memory_analysis()``; docs/memory_options.md, 'Chunked cross-entropy').
At a large hidden size weight-sized buffers, not the logits, dominate what remains: the
checkpointed map's autodiff backward keeps them and can end above the plain loss. The
hand-written backward runs vocabulary blocks outside and token chunks inside, so each block of
the weight gradient is summed in float32 as a ``[D, vocab_chunk_size]`` buffer and written once,
and the weight is cast and transposed block by block, never whole (XLA's CPU backend, which
upcasts bf16 matmul operands, still makes a float32 copy of a bf16 weight). Backward costs one
extra ``[B*T, D] x [D, V]`` matmul (the recomputed logits), as remat would.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp

DEFAULT_CHUNK_SIZE = 512
DEFAULT_VOCAB_CHUNK_SIZE = 8192


@dataclasses.dataclass(frozen=True)
class _Chunking:
    """Static settings of one chunked loss (hashable, so it is a ``nondiff_argnums`` entry)."""

    chunk_size: int
    vocab_chunk_size: int
    compute_dtype: jnp.dtype


def cross_entropy_from_hidden(
    hidden_BTD: jax.Array,
    w_DV: jax.Array,
    labels_BT: jax.Array,
    *,
    mask_BT: jax.Array | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    vocab_chunk_size: int | None = DEFAULT_VOCAB_CHUNK_SIZE,
    compute_dtype=None,
) -> jax.Array:
    r"""Mean softmax cross-entropy of ``hidden @ w`` against integer labels, in chunks.

    Equal (to float32 rounding when ``compute_dtype`` is float32) to::

        logits = jnp.einsum("btd,dv->btv", hidden, w.astype(compute_dtype),
                            preferred_element_type=jnp.float32)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        loss = (ce * mask).sum() / mask.sum()          # ce.mean() without a mask

    and differentiable in ``hidden`` and ``w``, but the logits exist only as blocks of
    ``chunk_size`` sequence positions (all ``B`` rows together, so a batch-sharded ``hidden``
    stays sharded) by ``vocab_chunk_size`` columns, and backward keeps only the per-token
    logsumexp. Backward recomputes each block's logits in float32, forms ``softmax - onehot`` in
    float32, and feeds it, cast to ``compute_dtype``, to the two gradient matmuls (float32
    accumulation), as a BF16 GEMM backward does; ``w``'s gradient is summed over tokens in
    float32 and returned in ``w``'s dtype. (XLA's autodiff of the plain einsum instead multiplies
    the float32 logits gradient with the bf16 operands and rounds ``w``'s gradient to bf16; in
    float32 compute the two are the same computation.) Lengths that the chunk sizes do not
    divide end in one shorter block; nothing is padded.

    For tied embeddings pass ``w_DV = embed_VD.T``: the gradient flows into the table.

    Args:
      hidden_BTD: final hidden states (after the last norm), ``[batch, seq, hidden]``.
      w_DV: the output projection, ``[hidden, vocab]`` (``lm_head``, or the embedding table
        transposed), in the master dtype; it is cast to ``compute_dtype`` inside.
      labels_BT: int token ids in ``[0, vocab)``, ``[batch, seq]``. Tokens to skip go in
        ``mask_BT``, not as out-of-range ids.
      mask_BT: optional per-token weights (bool or float), ``[batch, seq]``: the loss is
        ``sum(mask * ce) / sum(mask)`` (NaN for an all-zero mask, as the plain formula gives).
        Not differentiated.
      chunk_size: sequence positions per block (static).
      vocab_chunk_size: vocabulary columns per block (static); ``None`` means the whole
        vocabulary. A block's float32 logits take ``batch * chunk_size * vocab_chunk_size * 4``
        bytes, its weight-gradient accumulator ``hidden * vocab_chunk_size * 4``.
      compute_dtype: dtype of the matmul operands; ``None`` means ``hidden_BTD.dtype`` (what
        ``Llama`` does: bfloat16 activations, weight cast to bfloat16).

    Returns:
      A float32 scalar: the mean cross-entropy in nats.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> h = jax.random.normal(jax.random.key(0), (2, 100, 16), jnp.bfloat16)
      >>> w = 0.02 * jax.random.normal(jax.random.key(1), (16, 50))
      >>> y = jax.random.randint(jax.random.key(2), (2, 100), 0, 50)
      >>> loss, (dh, dw) = jax.value_and_grad(cross_entropy_from_hidden, (0, 1))(
      ...     h, w, y, chunk_size=32)
    """
    _check_shapes(hidden_BTD, w_DV, labels_BT, mask_BT)
    vocab = w_DV.shape[1]
    chunk_size = _positive_int("chunk_size", chunk_size)
    vocab_chunk_size = vocab if vocab_chunk_size is None else vocab_chunk_size
    vocab_chunk_size = min(_positive_int("vocab_chunk_size", vocab_chunk_size), vocab)
    compute_dtype = jnp.dtype(hidden_BTD.dtype if compute_dtype is None else compute_dtype)
    if not jnp.issubdtype(compute_dtype, jnp.floating):
        raise ValueError(f"compute_dtype must be a float dtype, got {compute_dtype}")
    if mask_BT is None:
        weight_BT = jnp.ones(labels_BT.shape, jnp.float32)
    else:
        weight_BT = jax.lax.stop_gradient(mask_BT.astype(jnp.float32))
    chunking = _Chunking(chunk_size, vocab_chunk_size, compute_dtype)
    return _chunked_ce(chunking, hidden_BTD, w_DV, labels_BT, weight_BT)


def _positive_int(name: str, value) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int (static), got {value!r}")
    return int(value)


def _check_shapes(hidden_BTD, w_DV, labels_BT, mask_BT) -> None:
    if hidden_BTD.ndim != 3 or not jnp.issubdtype(hidden_BTD.dtype, jnp.floating):
        raise ValueError(
            "hidden must be float [batch, seq, hidden], got "
            f"{hidden_BTD.dtype}{tuple(hidden_BTD.shape)}"
        )
    if w_DV.ndim != 2 or w_DV.shape[0] != hidden_BTD.shape[2]:
        raise ValueError(
            f"w must be [hidden={hidden_BTD.shape[2]}, vocab], got {tuple(w_DV.shape)}; for tied "
            "embeddings pass the [vocab, hidden] table transposed"
        )
    if labels_BT.shape != hidden_BTD.shape[:2] or not jnp.issubdtype(labels_BT.dtype, jnp.integer):
        raise ValueError(
            f"labels must be int ids of shape {tuple(hidden_BTD.shape[:2])} (hidden's batch, "
            f"seq), got {labels_BT.dtype}{tuple(labels_BT.shape)}"
        )
    if mask_BT is not None and mask_BT.shape != labels_BT.shape:
        raise ValueError(
            f"mask must have the labels' shape {tuple(labels_BT.shape)}, got {tuple(mask_BT.shape)}"
        )


def _blocks(carry, n: int, size: int, body):
    """Runs ``body(carry, start, size) -> (carry, out)`` over ``[0, n)`` in blocks of ``size``.

    Full blocks go through one ``lax.scan`` (``start`` traced); a shorter last block, if any,
    runs once more with static sizes. Returns the carry and the list of outputs (the scan's
    stacked one first).
    """
    full, tail = divmod(n, size)
    outs = []
    if full:
        carry, out = jax.lax.scan(
            lambda c, start: body(c, start, size), carry, jnp.arange(full) * size
        )
        outs.append(out)
    if tail:
        carry, out = body(carry, full * size, tail)
        outs.append(out)
    return carry, outs


def _slice(x, start, size, axis=1):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _block_logits(c: _Chunking, h_BCD, w_DV, start, size):
    """Logits of one token chunk against vocabulary columns ``[start, start + size)``."""
    w_DK = _slice(w_DV, start, size).astype(c.compute_dtype)
    logits_BCK = jnp.einsum(
        "bcd,dk->bck", h_BCD.astype(c.compute_dtype), w_DK, preferred_element_type=jnp.float32
    )
    return logits_BCK, w_DK


def _forward_chunk(c: _Chunking, h_BCD, w_DV, y_BC):
    """(logsumexp [B, C], label logit [B, C]) of one chunk, with an online logsumexp over
    vocabulary blocks, so only a ``[B, C, vocab_chunk_size]`` block is ever materialized."""
    shape = y_BC.shape

    def block(carry, start, size):
        max_BC, sum_BC, picked_BC = carry
        logits_BCK, _ = _block_logits(c, h_BCD, w_DV, start, size)
        new_max = jnp.maximum(max_BC, logits_BCK.max(axis=-1))
        sum_BC = sum_BC * jnp.exp(max_BC - new_max) + jnp.exp(logits_BCK - new_max[..., None]).sum(
            axis=-1
        )
        local = y_BC - start
        inside = (local >= 0) & (local < size)
        hit = jnp.take_along_axis(logits_BCK, jnp.clip(local, 0, size - 1)[..., None], axis=-1)
        picked_BC = picked_BC + jnp.where(inside, hit[..., 0], 0.0)
        return (new_max, sum_BC, picked_BC), None

    init = (
        jnp.full(shape, -jnp.inf, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros(shape, jnp.float32),
    )
    (max_BC, sum_BC, picked_BC), _ = _blocks(init, w_DV.shape[1], c.vocab_chunk_size, block)
    return max_BC + jnp.log(sum_BC), picked_BC


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked_ce(c: _Chunking, hidden_BTD, w_DV, labels_BT, weight_BT):
    loss, _ = _chunked_ce_fwd(c, hidden_BTD, w_DV, labels_BT, weight_BT)
    return loss


def _chunked_ce_fwd(c: _Chunking, hidden_BTD, w_DV, labels_BT, weight_BT):
    def chunk(total, start, size):
        lse_BC, picked_BC = _forward_chunk(
            c, _slice(hidden_BTD, start, size), w_DV, _slice(labels_BT, start, size)
        )
        return total + jnp.sum(_slice(weight_BT, start, size) * (lse_BC - picked_BC)), lse_BC

    total, lse_parts = _blocks(jnp.zeros([], jnp.float32), hidden_BTD.shape[1], c.chunk_size, chunk)
    # The scan stacks its chunks' logsumexp as [chunks, B, C]; lay them back along the sequence.
    lse_BT = jnp.concatenate(
        [p if p.ndim == 2 else jnp.moveaxis(p, 0, 1).reshape(p.shape[1], -1) for p in lse_parts],
        axis=1,
    )
    denom = jnp.sum(weight_BT)
    return total / denom, (hidden_BTD, w_DV, labels_BT, weight_BT, denom, lse_BT)


def _chunked_ce_bwd(c: _Chunking, residuals, g):
    """Vocabulary blocks outside, token chunks inside, logits recomputed per pair.

    Each block of ``w``'s gradient is summed over all tokens in float32 while it is a
    ``[D, vocab_chunk_size]`` buffer, then written once, in ``w``'s dtype, into its columns;
    the hidden gradient, ``[B, T, D]``, is the float32 sum over blocks. So the only
    ``[D, V]``-sized buffer is the gradient itself (no float32 accumulator when ``w`` is
    bfloat16, no transposed or cast copy of ``w``), and the largest temporary ``[B, T, D]``
    float32, which for any real language model is far smaller than ``[D, V]``.
    """
    hidden_BTD, w_DV, labels_BT, weight_BT, denom, lse_BT = residuals
    coef_BT = weight_BT * (g / denom)

    def vocab_block(carry, v_start, v_size):
        dh_BTD, dw_DV = carry
        w_DK = _slice(w_DV, v_start, v_size).astype(c.compute_dtype)

        def token_chunk(carry, t_start, t_size):
            dh_BTD, dw_DK = carry
            h_BCD = _slice(hidden_BTD, t_start, t_size).astype(c.compute_dtype)
            logits_BCK = jnp.einsum("bcd,dk->bck", h_BCD, w_DK, preferred_element_type=jnp.float32)
            local_BC = _slice(labels_BT, t_start, t_size) - v_start
            onehot_BCK = local_BC[..., None] == jnp.arange(v_size)
            dlogits_BCK = jnp.exp(logits_BCK - _slice(lse_BT, t_start, t_size)[..., None])
            dlogits_BCK = (dlogits_BCK - onehot_BCK) * _slice(coef_BT, t_start, t_size)[..., None]
            dlogits_BCK = dlogits_BCK.astype(c.compute_dtype)
            dh_BCD = _slice(dh_BTD, t_start, t_size) + jnp.einsum(
                "bck,dk->bcd", dlogits_BCK, w_DK, preferred_element_type=jnp.float32
            )
            dh_BTD = jax.lax.dynamic_update_slice_in_dim(dh_BTD, dh_BCD, t_start, axis=1)
            dw_DK = dw_DK + jnp.einsum(
                "bcd,bck->dk", h_BCD, dlogits_BCK, preferred_element_type=jnp.float32
            )
            return (dh_BTD, dw_DK), None

        init = (dh_BTD, jnp.zeros((w_DV.shape[0], v_size), jnp.float32))
        (dh_BTD, dw_DK), _ = _blocks(init, hidden_BTD.shape[1], c.chunk_size, token_chunk)
        dw_DV = jax.lax.dynamic_update_slice_in_dim(
            dw_DV, dw_DK.astype(dw_DV.dtype), v_start, axis=1
        )
        return (dh_BTD, dw_DV), None

    init = (jnp.zeros(hidden_BTD.shape, jnp.float32), jnp.zeros_like(w_DV))
    (dh_BTD, dw_DV), _ = _blocks(init, w_DV.shape[1], c.vocab_chunk_size, vocab_block)
    return dh_BTD.astype(hidden_BTD.dtype), dw_DV, None, None


_chunked_ce.defvjp(_chunked_ce_fwd, _chunked_ce_bwd)

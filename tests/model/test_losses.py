"""Chunked cross-entropy: equal to the plain loss and its gradients, and it never keeps [B, T, V]."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from coat_jax.losses import cross_entropy_from_hidden
from coat_jax.memory import residuals

B, T, D, V = 2, 40, 16, 96


def plain_loss(hidden_BTD, w_DV, labels_BT, mask_BT=None, compute_dtype=None):
    """The loss as the trainer computes it today: full float32 logits."""
    dtype = hidden_BTD.dtype if compute_dtype is None else compute_dtype
    logits_BTV = jnp.einsum(
        "btd,dv->btv", hidden_BTD.astype(dtype), w_DV.astype(dtype),
        preferred_element_type=jnp.float32,
    )  # fmt: skip
    ce_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, labels_BT)
    if mask_BT is None:
        return ce_BT.mean()
    m = mask_BT.astype(jnp.float32)
    return (ce_BT * m).sum() / m.sum()


def _inputs(seed=0, hidden_dtype=jnp.float32):
    k = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(k[0], (B, T, D), jnp.float32).astype(hidden_dtype)
    w = jax.random.normal(k[1], (D, V), jnp.float32) * 0.5
    y = jax.random.randint(k[2], (B, T), 0, V)
    return h, w, y


def _value_and_grads(f):
    return jax.jit(jax.value_and_grad(f, (0, 1)))


def _close(a, b, rtol=2e-6, atol=2e-7):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol, atol)


@pytest.mark.parametrize("chunk_size, vocab_chunk_size", [(8, None), (13, 32), (64, 40)])
def test_untied_matches_plain_loss_and_grads(chunk_size, vocab_chunk_size):
    # Tokens: 8 divides T=40, 13 leaves a tail of 1, 64 > T is the tail alone. Vocabulary:
    # whole, 32 divides V=96, 40 leaves a tail of 16.
    h, w, y = _inputs()
    chunked = lambda h, w: cross_entropy_from_hidden(
        h, w, y, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size
    )
    loss, (dh, dw) = _value_and_grads(chunked)(h, w)
    ref_loss, (ref_dh, ref_dw) = _value_and_grads(lambda h, w: plain_loss(h, w, y))(h, w)
    _close(loss, ref_loss)
    _close(dh, ref_dh)
    _close(dw, ref_dw)
    assert dh.dtype == h.dtype and dw.dtype == w.dtype


def test_tied_embeddings_gradient_flows_into_the_table():
    k = jax.random.split(jax.random.key(1), 3)
    embed_VD = jax.random.normal(k[0], (V, D)) * 0.5
    tokens_BT = jax.random.randint(k[1], (B, T), 0, V)
    y = jax.random.randint(k[2], (B, T), 0, V)

    def model(embed_VD, loss_fn):
        # The table feeds both the input gather and the (tied) head, as in Llama.
        h_BTD = jnp.tanh(jnp.take(embed_VD, tokens_BT, axis=0))
        return loss_fn(h_BTD, embed_VD.T)

    chunked = lambda h, w: cross_entropy_from_hidden(h, w, y, chunk_size=16, vocab_chunk_size=40)
    loss, g = jax.jit(jax.value_and_grad(model), static_argnums=1)(embed_VD, chunked)
    ref_loss, ref_g = jax.jit(jax.value_and_grad(model), static_argnums=1)(
        embed_VD, lambda h, w: plain_loss(h, w, y)
    )
    _close(loss, ref_loss)
    _close(g, ref_g)


def test_mask_weights_tokens_like_the_plain_masked_mean():
    h, w, y = _inputs(2)
    mask = jax.random.bernoulli(jax.random.key(3), 0.7, (B, T))
    f = lambda h, w: cross_entropy_from_hidden(
        h, w, y, mask_BT=mask, chunk_size=12, vocab_chunk_size=48
    )
    loss, (dh, dw) = _value_and_grads(f)(h, w)
    ref_loss, (ref_dh, ref_dw) = _value_and_grads(lambda h, w: plain_loss(h, w, y, mask))(h, w)
    _close(loss, ref_loss)
    _close(dh, ref_dh)
    _close(dw, ref_dw)
    assert float(jnp.abs(dh[~mask]).max()) == 0.0


def test_bf16_compute_matches_plain_bf16_and_is_no_less_accurate():
    h, w, y = _inputs(4, jnp.bfloat16)
    f = lambda h, w: cross_entropy_from_hidden(h, w, y, chunk_size=12, vocab_chunk_size=40)
    loss, (dh, dw) = _value_and_grads(f)(h, w)
    ref_loss, (ref_dh, ref_dw) = _value_and_grads(lambda h, w: plain_loss(h, w, y))(h, w)
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    # Same bf16 operands, float32 logits: the loss agrees to float32 rounding.
    _close(loss, ref_loss)
    # The gradients differ by where they are rounded to bf16 (the logits' gradient here, the
    # result of XLA's mixed float32 x bf16 matmuls there): bf16-sized differences.
    _close(dh, ref_dh, rtol=2e-2, atol=2e-4)
    _close(dw, ref_dw, rtol=2e-2, atol=2e-4)
    # Against float32 truth on the same bf16-valued inputs, the chunked gradients are as
    # accurate as the plain bf16 ones.
    h32, w32 = h.astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32)
    _, (true_dh, true_dw) = _value_and_grads(lambda h, w: plain_loss(h, w, y))(h32, w32)
    for got, ref, true in ((dh, ref_dh, true_dh), (dw, ref_dw, true_dw)):
        err = float(jnp.abs(got.astype(jnp.float32) - true).max())
        ref_err = float(jnp.abs(ref.astype(jnp.float32) - true).max())
        assert err <= 2 * ref_err + 1e-7, (err, ref_err)


def test_bf16_weight_gets_a_bf16_gradient():
    # BF16 master weights (coat_jax.master): the head's gradient comes back in bfloat16.
    h, w, y = _inputs(6, jnp.bfloat16)
    w = w.astype(jnp.bfloat16)
    f = lambda h, w: cross_entropy_from_hidden(h, w, y, chunk_size=16, vocab_chunk_size=64)
    loss, (dh, dw) = _value_and_grads(f)(h, w)
    ref_loss, (ref_dh, ref_dw) = _value_and_grads(lambda h, w: plain_loss(h, w, y))(h, w)
    assert dw.dtype == jnp.bfloat16
    _close(loss, ref_loss)
    _close(dh, ref_dh, rtol=2e-2, atol=2e-4)
    _close(dw, ref_dw, rtol=2e-2, atol=2e-4)


def test_compute_dtype_overrides_the_hidden_dtype():
    h, w, y = _inputs(5)
    f = lambda h, w: cross_entropy_from_hidden(h, w, y, chunk_size=7, compute_dtype=jnp.bfloat16)
    loss = jax.jit(f)(h, w)
    _close(loss, jax.jit(plain_loss, static_argnums=(3, 4))(h, w, y, None, jnp.bfloat16))
    assert (
        abs(float(loss) - float(jax.jit(plain_loss)(h, w, y))) > 1e-6
    )  # bf16 operands really used


# Big enough that [B*T, V] float32 (262 MB) dwarfs everything else; only compiled, never run.
MEM_B, MEM_T, MEM_D, MEM_V = 1, 2048, 64, 32000
FULL_LOGITS_BYTES = MEM_B * MEM_T * MEM_V * 4


def _mem_args():
    return (
        jax.ShapeDtypeStruct((MEM_B, MEM_T, MEM_D), jnp.bfloat16),
        jax.ShapeDtypeStruct((MEM_D, MEM_V), jnp.float32),
        jax.ShapeDtypeStruct((MEM_B, MEM_T), jnp.int32),
    )


def _temp_bytes(loss_fn):
    compiled = jax.jit(jax.value_and_grad(loss_fn, (0, 1))).lower(*_mem_args()).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_xla_temporaries_stay_far_below_the_full_logits():
    chunked = _temp_bytes(lambda h, w, y: cross_entropy_from_hidden(h, w, y, chunk_size=128))
    plain = _temp_bytes(plain_loss)
    assert plain > FULL_LOGITS_BYTES  # the measurement does see the logits
    assert chunked < FULL_LOGITS_BYTES / 4, (chunked, plain)


def test_backward_keeps_no_batch_by_vocab_residual():
    h, w, y = _mem_args()
    labels = jnp.zeros(y.shape, y.dtype)
    res = residuals(
        lambda h, w: cross_entropy_from_hidden(h, w, labels, chunk_size=128), h, w,
        param_argnums=(1,),
    )  # fmt: skip
    # The inputs themselves (bf16 hidden, float32 weight) plus 4 bytes per token each of
    # logsumexp, label and mask weight, and the normalizer: nothing [B, T, V].
    hidden, weight, per_token = MEM_B * MEM_T * MEM_D * 2, MEM_D * MEM_V * 4, MEM_B * MEM_T * 4
    assert sum(r.nbytes for r in res) <= hidden + weight + 3 * per_token + 4, res
    assert sum(r.nbytes for r in res if r.is_activation) <= hidden + per_token, res


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"chunk_size": 0}, "chunk_size must be a positive int"),
        ({"chunk_size": 2.5}, "chunk_size must be a positive int"),
        ({"vocab_chunk_size": -1}, "vocab_chunk_size must be a positive int"),
        ({"compute_dtype": jnp.int32}, "compute_dtype must be a float dtype"),
        ({"mask_BT": jnp.ones((B, T + 1), bool)}, "mask must have the labels' shape"),
    ],
)
def test_bad_settings_name_the_fix(kwargs, match):
    h, w, y = _inputs()
    with pytest.raises(ValueError, match=match):
        cross_entropy_from_hidden(h, w, y, **kwargs)


def test_bad_shapes_name_the_fix():
    h, w, y = _inputs()
    with pytest.raises(ValueError, match="for tied embeddings pass the"):
        cross_entropy_from_hidden(h, w.T, y)
    with pytest.raises(ValueError, match="labels must be int ids of shape"):
        cross_entropy_from_hidden(h, w, y.astype(jnp.float32))
    with pytest.raises(ValueError, match="hidden must be float"):
        cross_entropy_from_hidden(h[0], w, y)

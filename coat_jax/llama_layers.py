"""The layers of the decoder in Flax NNX: RoPE, the model's attention, RMSNorm, the attention
and MLP blocks, and the decoder layer, with the switches of the config's family
(:class:`coat_jax.families.Family`: q/k/v biases, q/k norms, OLMo 2's norm placement).

Every linear, RMSNorm, SiLU, product and residual add goes through the ``ops``
(:class:`~coat_jax.fp8_ops.OpSet`) a layer is called with, so the precision mode swaps the op
implementations and nothing else. Weights are stored ``[in, out]``; q/k/v and gate/up are
separate parameters, and each group goes through ONE ``ops.linear`` call with a tuple of
weights, which quantizes (and saves) the shared input once, without a concatenated weight copy.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from coat_jax import attention
from coat_jax.fp8_ops import FP8Weight, fp8_attention
from coat_jax.llama_config import LlamaConfig

# checkpoint_name of what attention keeps for backward (cuDNN: q, k, v, output, log-sum-exp;
# elsewhere q, k, v, with the attention recomputed).
ATTENTION = "attention"


def apply_rope(x_BTNH: jax.Array, positions_BT: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates halves (HF's `rotate_half` layout); angles in float32, product in x's dtype."""
    angles_BTh = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles_BTH = jnp.concatenate([angles_BTh, angles_BTh], axis=-1)
    cos = jnp.cos(angles_BTH)[:, :, None, :].astype(x_BTNH.dtype)
    sin = jnp.sin(angles_BTH)[:, :, None, :].astype(x_BTNH.dtype)
    x1, x2 = jnp.split(x_BTNH, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x_BTNH * cos + rotated * sin


def _model_attention(dtype, implementation: str, window: int | None = None, segment_ids_BT=None):
    """Causal :func:`coat_jax.attention.attend` on the kernel ``implementation`` resolves to
    (within the segments ``segment_ids_BT`` marks, if given); XLA's under ``jax.checkpoint``,
    since it would keep the [B, N, T, T] probabilities."""
    impl = attention.attention_implementation(dtype, implementation)
    attend_fn = functools.partial(
        attention.attend,
        is_causal=True,
        implementation=impl,
        window=window,
        segment_ids=segment_ids_BT,
    )
    return jax.checkpoint(attend_fn) if impl == "xla" else attend_fn


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def causal_attention(
    q_BTNH,
    k_BTKH,
    v_BTKH,
    implementation: str = "auto",
    window: int | None = None,
    segment_ids_BT=None,
) -> jax.Array:
    """Causal GQA attention via `jax.nn.dot_product_attention` (its native GQA support).

    On the GPU cuDNN's flash attention keeps only q, k, v, output and log-sum-exp for backward.
    XLA's version would keep the [B, N, T, T] probabilities, so there it is rematerialized
    (`jax.checkpoint` keeps the inputs only; docs/design.md, 'The precision flow'). Whatever the
    implementation keeps is tagged `ATTENTION` for the remat policies: the forward is
    `jax.vjp` of the attention, whose pullback's arrays are exactly its residuals.
    ``implementation`` (static): as :attr:`coat_jax.fp8_ops.FP8Config.attention`; ``window``
    (static): a sliding window, as :func:`coat_jax.attention.attend`'s, or ``None``.
    ``segment_ids_BT`` (int ``[B, T]``, or None): a query attends only to keys of its own
    segment (the documents of a packed window; XLA's attention only).
    """
    attend_fn = _model_attention(q_BTNH.dtype, implementation, window, segment_ids_BT)
    return attend_fn(q_BTNH, k_BTKH, v_BTKH)


def _causal_attention_fwd(
    q_BTNH, k_BTKH, v_BTKH, implementation="auto", window=None, segment_ids_BT=None
):
    attend_fn = _model_attention(q_BTNH.dtype, implementation, window, segment_ids_BT)
    out, pullback = jax.vjp(attend_fn, q_BTNH, k_BTKH, v_BTKH)
    return out, jax.tree.map(lambda r: checkpoint_name(r, ATTENTION), pullback)


def _causal_attention_bwd(implementation, window, pullback, dout):
    return (*pullback(dout), None)


causal_attention.defvjp(_causal_attention_fwd, _causal_attention_bwd)


class KVCache(NamedTuple):
    """One decoder layer's keys and values for decoding with a cache (``coat_jax.generate``).

    Attributes:
      k, v: ``[B, S, K, H]``, S the cache's length; columns ``start..start+T-1`` take the T
        new tokens' keys and values.
      start: the column of the first new token (a scalar int).
      mask: boolean ``[B, 1, T, S]``: the columns each new query attends to (the causal order
        and each row's padding).
    """

    k: jax.Array
    v: jax.Array
    start: jax.Array
    mask: jax.Array

    def attend(self, q_BTNH, k_BTKH, v_BTKH, ops, window=None) -> tuple[jax.Array, KVCache]:
        """``(out_BTNH, cache)``: the new keys and values written in, then attention of the new
        queries over the cache under :attr:`mask`, in the compute dtype on XLA's kernel; with
        ``window`` (an int), each query attends to at most the ``window`` latest columns, its
        own included (a sliding window)."""
        if ops.attention is not None or ops.attention_linear is not None:
            raise ValueError(
                "decoding with a KVCache runs the plain attention over the cache; call the layer "
                "with an op set whose attention is None, e.g. coat_jax.fp8_ops.ops_for('bf16')"
            )
        k = jax.lax.dynamic_update_slice(self.k, k_BTKH, (0, self.start, 0, 0))
        v = jax.lax.dynamic_update_slice(self.v, v_BTKH, (0, self.start, 0, 0))
        mask = self.mask
        if window is not None:
            query_T1 = self.start + jnp.arange(q_BTNH.shape[1])[:, None]
            mask = mask & (jnp.arange(k.shape[1])[None, :] > query_T1 - window)
        out_BTNH = attention.attend(q_BTNH, k, v, is_causal=False, implementation="xla", mask=mask)
        return out_BTNH, self._replace(k=k, v=v)


def normal_param(rngs: nnx.Rngs, shape, param_dtype, std: float) -> nnx.Param:
    """A parameter drawn from N(0, std^2) (HF's ``initializer_range``)."""
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, param_dtype))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x, ops):
        return ops.rmsnorm(x, self.weight[...], self.eps)

    def project(self, x, w, ops):
        """``ops.linear(self(x, ops), w)``, as one op where the op set fuses the two (the
        row-wise FP8 linear's producer writes its operand: ``OpSet.norm_linear``)."""
        return ops.rmsnorm_then_linear(x, self.weight[...], self.eps, w)


# The linear weights of a decoder layer by sub-module: what ``FP8Config(weight_residual="once")``
# quantizes once per step, before the layers run (``Llama.weight_codes``).
LINEAR_WEIGHTS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def _linear_weights(module, names: tuple[str, ...], codes) -> tuple | jax.Array:
    """The master weights ``names`` of ``module`` for one ``ops.linear`` call (one weight, or a
    tuple sharing the input), each paired with its FP8 codes (:class:`FP8Weight`) when ``codes``
    (a dict by name, or ``None``) holds them."""
    ws = tuple(
        getattr(module, n)[...] if codes is None else FP8Weight(getattr(module, n)[...], codes[n])
        for n in names
    )
    return ws[0] if len(ws) == 1 else ws


class Attention(nnx.Module):
    def __init__(self, config: LlamaConfig, *, param_dtype, rngs: nnx.Rngs):
        d, hd = config.hidden_size, config.head_dim
        n, k = config.num_attention_heads, config.num_key_value_heads
        std = 0.02
        self.q_proj = normal_param(rngs, (d, n * hd), param_dtype, std)
        self.k_proj = normal_param(rngs, (d, k * hd), param_dtype, std)
        self.v_proj = normal_param(rngs, (d, k * hd), param_dtype, std)
        self.o_proj = normal_param(rngs, (n * hd, d), param_dtype, std)
        self.num_heads, self.num_kv_heads, self.head_dim = n, k, hd
        family = config.family
        self.qkv_bias, self.qk_norm = family.qkv_bias, family.qk_norm
        self.sliding_window = config.sliding_window
        if self.qkv_bias:
            self.q_bias = nnx.Param(jnp.zeros((n * hd,), param_dtype))
            self.k_bias = nnx.Param(jnp.zeros((k * hd,), param_dtype))
            self.v_bias = nnx.Param(jnp.zeros((k * hd,), param_dtype))
        if self.qk_norm != "none":
            q_dim, k_dim = (hd, hd) if self.qk_norm == "head" else (n * hd, k * hd)
            eps = config.rms_norm_eps
            self.q_norm = RMSNorm(q_dim, eps, param_dtype=param_dtype)
            self.k_norm = RMSNorm(k_dim, eps, param_dtype=param_dtype)

    def _window(self, keys: int, ops, cache) -> int | None:
        """The sliding window the attention over ``keys`` positions needs (``None``: none, or
        one that every query's keys fit). The model's own attention (:func:`causal_attention`),
        FP8 attention (``fp8_attention``) and decoding with a cache apply it; the ops without
        one (FP8 attention with the o_proj as one op, or under the activation telemetry)
        refuse a window they would need."""
        if self.sliding_window is None or keys <= self.sliding_window:
            return None
        takes_window = cache is not None or (
            ops.attention_linear is None
            and (
                ops.attention is None
                or isinstance(ops.attention, functools.partial)
                and ops.attention.func in (causal_attention, fp8_attention)
            )
        )
        if not takes_window:
            raise ValueError(
                f"attention over {keys} positions exceeds sliding_window={self.sliding_window} "
                "and this FP8 attention (attention_backward='saved_output', or under the "
                "activation telemetry) has no sliding window: keep sequences within the window, "
                "or use fp8_attention_backward='recompute' without the telemetry"
            )
        return self.sliding_window

    def _projections(self, x_BTD, norm, ops, codes):
        """q, k, v as ``[B, T, heads, head_dim]`` before RoPE: the one linear call (with the norm
        in front of it, as one op where the op set fuses the two), then the family's biases
        (beside the linear: their backward keeps nothing) and q/k norms."""
        n, k, hd = self.num_heads, self.num_kv_heads, self.head_dim
        # One linear call for q, k and v: the shared input is quantized and saved once, and the
        # weights stay separate (no concatenated copy lives until backward).
        qkv = _linear_weights(self, ("q_proj", "k_proj", "v_proj"), codes)
        q, kk, v = ops.linear(x_BTD, qkv) if norm is None else norm.project(x_BTD, qkv, ops)
        if self.qkv_bias:
            q, kk, v = (
                y + b[...].astype(y.dtype)
                for y, b in zip((q, kk, v), (self.q_bias, self.k_bias, self.v_bias), strict=True)
            )
        if self.qk_norm == "full":
            q, kk = self.q_norm(q, ops), self.k_norm(kk, ops)
        b, t = x_BTD.shape[:2]
        q_BTNH, k_BTKH = q.reshape(b, t, n, hd), kk.reshape(b, t, k, hd)
        if self.qk_norm == "head":
            q_BTNH, k_BTKH = self.q_norm(q_BTNH, ops), self.k_norm(k_BTKH, ops)
        return q_BTNH, k_BTKH, v.reshape(b, t, k, hd)

    def __call__(self, x_BTD, norm, positions_BT, inv_freq, ops, codes=None, cache=None):
        """The attention block's output [B, T, D] for ``x_BTD`` and the :class:`RMSNorm` ``norm``
        in front of the block (``None`` for the families whose norms follow it); with a
        :class:`KVCache` ``cache``, ``(out, cache)``: the new tokens' keys and values written into
        it at ``cache.start``, and attention over the cache under ``cache.mask`` (decoding)."""
        n, hd = self.num_heads, self.head_dim
        q_BTNH, k_BTKH, v_BTKH = self._projections(x_BTD, norm, ops, codes)
        b, t = x_BTD.shape[:2]
        window = self._window(t if cache is None else cache.k.shape[1], ops, cache)
        q_BTNH = apply_rope(q_BTNH, positions_BT, inv_freq)
        k_BTKH = apply_rope(k_BTKH, positions_BT, inv_freq)
        o_proj = _linear_weights(self, ("o_proj",), codes)
        if cache is not None:
            out_BTNH, cache = cache.attend(q_BTNH, k_BTKH, v_BTKH, ops, window)
            return ops.linear(out_BTNH.reshape(b, t, n * hd), o_proj), cache
        if ops.attention_linear is not None:
            return ops.attention_linear(q_BTNH, k_BTKH, v_BTKH, o_proj)
        attend = ops.attention or causal_attention
        if window is not None:
            attend = functools.partial(attend, window=window)
        out_BTNH = attend(q_BTNH, k_BTKH, v_BTKH)
        return ops.linear(out_BTNH.reshape(b, t, n * hd), o_proj)


class MLP(nnx.Module):
    def __init__(self, config: LlamaConfig, *, param_dtype, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = normal_param(rngs, (d, f), param_dtype, 0.02)
        self.up_proj = normal_param(rngs, (d, f), param_dtype, 0.02)
        self.down_proj = normal_param(rngs, (f, d), param_dtype, 0.02)

    def __call__(self, x_BTD, norm, ops, codes=None):
        """The MLP block's output for ``x_BTD`` and the :class:`RMSNorm` ``norm`` in front of the
        block (``None`` for the families whose norms follow it)."""
        gate_up = _linear_weights(self, ("gate_proj", "up_proj"), codes)
        if norm is None:
            gate_BTF, up_BTF = ops.linear(x_BTD, gate_up)
        else:
            gate_BTF, up_BTF = norm.project(x_BTD, gate_up, ops)
        down = _linear_weights(self, ("down_proj",), codes)
        return ops.silu_mul_then_linear(gate_BTF, up_BTF, down)


class DecoderLayer(nnx.Module):
    """Pre-norm (``x + attn(norm(x))``, then the MLP alike) or, with the family's
    ``post_norms`` (OLMo 2), post-norm inside the residual (``x + norm(attn(x))``)."""

    def __init__(self, config: LlamaConfig, *, param_dtype, rngs: nnx.Rngs):
        eps, d = config.rms_norm_eps, config.hidden_size
        self.post_norms = config.family.post_norms
        if not self.post_norms:
            self.input_layernorm = RMSNorm(d, eps, param_dtype=param_dtype)
        self.self_attn = Attention(config, param_dtype=param_dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(d, eps, param_dtype=param_dtype)
        self.mlp = MLP(config, param_dtype=param_dtype, rngs=rngs)
        if self.post_norms:
            self.post_feedforward_layernorm = RMSNorm(d, eps, param_dtype=param_dtype)

    def __call__(self, x_BTD, positions_BT, inv_freq, ops, codes=None, cache=None):
        """One layer; ``codes``: this step's FP8 codes of its linear weights, by sub-module and
        name as :data:`LINEAR_WEIGHTS` (``Llama.weight_codes``), or ``None``. With a
        :class:`KVCache` ``cache`` (decoding), ``(x_BTD, cache)``: the layer's output and its
        cache with the new tokens' keys and values."""
        codes = codes or {}
        pre_norm = not self.post_norms
        h = self.self_attn(
            x_BTD,
            self.input_layernorm if pre_norm else None,
            positions_BT,
            inv_freq,
            ops,
            codes.get("self_attn"),
            cache,
        )
        if cache is not None:
            h, cache = h
        if self.post_norms:
            h = self.post_attention_layernorm(h, ops)
        x_BTD = ops.add(x_BTD, h)
        mlp = self.mlp(
            x_BTD, self.post_attention_layernorm if pre_norm else None, ops, codes.get("mlp")
        )
        if self.post_norms:
            mlp = self.post_feedforward_layernorm(mlp, ops)
        x_BTD = ops.add(x_BTD, mlp)
        return x_BTD if cache is None else (x_BTD, cache)

"""An independent float64 numpy oracle of the FP8 ops: forward, hand-derived backward, codecs.

Written from /work/shared/SPEC.md and docs/design.md ('Numerics'), not from coat_jax or
pallas_kernels: nothing here imports a formula of the library. tests/fp8/test_fp8_oracle.py compares
the library against it in two ways:

* exactly: the op's float64 value and gradient at the exact inputs (the FP8 error is then
  measured, and bounded);
* emulated: the same float64 formulas evaluated at the values the precision flow says backward
  keeps (E4M3 per-tensor GEMM inputs, E5M2 per-tensor output gradients, E4M3 1xG inputs of the
  non-linear ops), quantized here from the spec. On float32 inputs the library must agree with
  this to float32 rounding, so a scaled term, a missing term or a wrong format shows at once.

Choices the documents leave to the implementation are taken as docs/design.md states them: a
per-tensor scale is ``(max|x| + 1e-20) / fmax`` rounded up to a bfloat16 value; the 1e-20 of a
scale is added in float32 (where it vanishes next to any ``max|x|`` above about 1e-13), which
decides the E8M0 scale of a group whose maximum is ``fmax`` times a power of two; Dynamic Range
Expansion and the optimizer step are tests/spec_reference.py's rendering of SPEC section 2.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from tests.spec_reference import DTYPE, FMAX, dequantize, fp8_round, quantize

__all__ = [
    "FMAX",
    "DTYPE",
    "fp8_round",
    "quantize_dre",
    "dequantize_dre",
    "quantize_absmax_groups",
    "e8m0_scale",
    "quantize_per_group",
    "quantize_per_tensor",
    "linear",
    "linear_grads",
    "rmsnorm",
    "rmsnorm_rstd",
    "rmsnorm_grads",
    "silu",
    "silu_grad",
    "mul_grads",
    "swiglu",
    "swiglu_grads",
    "attention",
    "attention_grads",
    "cross_entropy",
    "cross_entropy_grads",
]

TINY = 1e-20


def _f64(x):
    return np.asarray(x, np.float64)


# --------------------------------------------------------------------------------------------
# codecs


def quantize_dre(x, *, group_size=128, fmt="e4m3", expand_min=16):
    """SPEC section 2's DRE codec: ``(codes as float64 values, {"scale", "expand", "center"})``."""
    return quantize(_f64(x), gs=group_size, fmt=fmt, expand_min=expand_min, expansion=True)


def dequantize_dre(codes, scale, expand, center, *, group_size=128):
    """``x = sign(q s) |q s|^(1/k) c`` per group, in float64."""
    stats = {"scale": _f64(scale), "expand": _f64(expand), "center": _f64(center)}
    return dequantize(_f64(codes), stats, gs=group_size)


def quantize_absmax_groups(x, *, group_size=128, fmt="e4m3"):
    """SPEC section 2 without expansion: ``(codes, scale)`` with ``s = (max|x| + 1e-20) / fmax``."""
    codes, stats = quantize(_f64(x), gs=group_size, fmt=fmt, expand_min=16, expansion=False)
    return codes, stats["scale"]


def _peak(amax):
    # docs/design.md's ``max + 1e-20``, added in float32 as the library's scales are.
    return _f64(np.float32(amax) + np.float32(TINY))


def e8m0_scale(amax, fmt):
    """The smallest power of two ``r`` with ``max|x| + 1e-20 <= fmax * r`` (docs/design.md,
    'One-byte group scales'), decided exactly: ``frexp`` splits ``peak / fmax`` into a mantissa
    in [0.5, 1) and an exponent, and the quotient is a power of two iff the mantissa is 0.5."""
    q = _peak(amax) / FMAX[fmt]
    mant, exp = np.frexp(q)
    return np.ldexp(1.0, np.where(mant == 0.5, exp - 1, exp))


def _groups(x, group_size):
    n = x.shape[-1]
    if n % group_size:
        raise ValueError(f"the oracle's 1xG codec needs a last axis divisible by {group_size}")
    return x.reshape(*x.shape[:-1], n // group_size, group_size)


def quantize_per_group(x, *, group_size=16, fmt="e4m3", scale_format="float32"):
    """1xG absmax along the last axis: ``(codes as float64 values, scales [..., n / G])``.

    ``scale_format="e8m0"`` takes :func:`e8m0_scale` instead of ``(max|x| + 1e-20) / fmax``."""
    xg = _groups(_f64(x), group_size)
    amax = np.abs(xg).max(-1)
    if scale_format == "float32":
        s = _peak(amax) / FMAX[fmt]
    elif scale_format == "e8m0":
        s = e8m0_scale(amax, fmt)
    else:
        raise ValueError(f"unknown scale format {scale_format!r}")
    codes = fp8_round(xg / s[..., None], fmt)
    return codes.reshape(x.shape), s


def dequantize_per_group(codes, scale, *, group_size=16):
    cg = _groups(_f64(codes), group_size)
    return (cg * _f64(scale)[..., None]).reshape(np.shape(codes))


def _round_up_to_bfloat16(s):
    """The smallest bfloat16 value >= ``s`` (positive, finite), as float64."""
    s = _f64(s)
    near = s.astype(ml_dtypes.bfloat16)
    up = np.where(near.astype(np.float64) < s, np.nextafter(near, np.inf), near)
    return up.astype(np.float64)


def quantize_per_tensor(x, *, fmt="e4m3"):
    """Per-tensor codes: ``(codes as float64 values, scale)``; the scale is ``(max|x| + 1e-20) /
    fmax`` rounded up to a bfloat16 value (group scaling's maximum is the tensor's maximum)."""
    x = _f64(x)
    s = _round_up_to_bfloat16(_peak(np.abs(x).max()) / FMAX[fmt])
    return fp8_round(x / s, fmt), float(s)


def per_tensor_values(x, fmt):
    """The values a per-tensor FP8 copy of ``x`` stands for."""
    codes, s = quantize_per_tensor(x, fmt=fmt)
    return codes * s


def per_group_values(x, *, group_size=16, fmt="e4m3", scale_format="float32"):
    """The values a 1xG FP8 copy of ``x`` stands for."""
    codes, s = quantize_per_group(x, group_size=group_size, fmt=fmt, scale_format=scale_format)
    return dequantize_per_group(codes, s, group_size=group_size)


# --------------------------------------------------------------------------------------------
# ops: forward and hand-derived backward


def linear(x, w):
    """``y = x w`` for ``x [..., K]``, ``w [K, N]``."""
    return _f64(x) @ _f64(w)


def linear_grads(x, w, dy):
    """``(dx, dw) = (dy w^T, x^T dy)``, the leading axes of ``x`` summed in ``dw``."""
    x, w, dy = _f64(x), _f64(w), _f64(dy)
    k, n = w.shape
    return dy @ w.T, x.reshape(-1, k).T @ dy.reshape(-1, n)


def rmsnorm_rstd(x, eps):
    """``r = 1 / sqrt(mean(x^2) + eps)`` per row, ``[..., 1]``."""
    x = _f64(x)
    return 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rmsnorm(x, w, eps):
    """``y = w * x * r``."""
    return _f64(w) * _f64(x) * rmsnorm_rstd(x, eps)


def rmsnorm_grads(x, w, dy, rstd):
    """``(dx, dw)`` of ``y = w * x * r(x)`` with ``r`` given (the forward's, of the exact input).

    With ``n = x r`` and ``dn = dy * w``: ``dr/dx_j = -r^3 x_j / D``, so
    ``dx = r dn + x * sum(dn * x) * (-r^3 / D) = r (dn - n mean(dn * n))``, and ``dw`` sums
    ``dy * n`` over the rows."""
    x, w, dy, r = _f64(x), _f64(w), _f64(dy), _f64(rstd)
    n = x * r
    dn = dy * w
    dx = r * (dn - n * np.mean(dn * n, axis=-1, keepdims=True))
    dw = np.sum((dy * n).reshape(-1, x.shape[-1]), axis=0)
    return dx, dw


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def silu(x):
    x = _f64(x)
    return x * _sigmoid(x)


def silu_grad(x):
    """``d/dx [x sigmoid(x)] = sigmoid(x) + x sigmoid(x) (1 - sigmoid(x))``."""
    x = _f64(x)
    s = _sigmoid(x)
    return s + x * s * (1.0 - s)


def mul_grads(a, b, dy):
    """``(da, db) = (dy b, dy a)``."""
    return _f64(dy) * _f64(b), _f64(dy) * _f64(a)


def swiglu(gate, up):
    return silu(gate) * _f64(up)


def swiglu_grads(gate, up, dy):
    """``(d gate, d up) = (dy up silu'(gate), dy silu(gate))``."""
    dy = _f64(dy)
    return dy * _f64(up) * silu_grad(gate), dy * silu(gate)


def _grouped_q(q, kv_heads):
    b, t, n, h = q.shape
    return q.reshape(b, t, kv_heads, n // kv_heads, h)


def _probabilities(q, k, is_causal, lse=None):
    """Softmax probabilities ``[B, K, G, T, S]`` of scaled logits, with the log-sum-exp given
    (``[B, N, T]``) or computed."""
    q, k = _f64(q), _f64(k)
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    logits = np.einsum("btkgh,bskh->bkgts", _grouped_q(q, kh), k) / math.sqrt(h)
    if is_causal:
        logits = np.where(np.tril(np.ones((t, s), bool)), logits, -np.inf)
    if lse is None:
        peak = logits.max(-1, keepdims=True)
        lse5 = peak + np.log(np.exp(logits - peak).sum(-1, keepdims=True))
    else:
        lse5 = _f64(lse).reshape(b, kh, n // kh, t)[..., None]
    return np.exp(logits - lse5), lse5[..., 0].reshape(b, n, t)


def attention(q, k, v, is_causal=True):
    """``(out [B, T, N, H], lse [B, N, T])``: softmax attention, scale ``1/sqrt(H)``, query i
    seeing keys ``j <= i`` when causal; k, v ``[B, S, K, H]`` shared by ``N / K`` query heads."""
    p, lse = _probabilities(q, k, is_causal)
    out = np.einsum("bkgts,bskh->btkgh", p, _f64(v))
    return out.reshape(np.shape(q)), lse


def attention_grads(q, k, v, dout, is_causal=True, out=None, lse=None):
    """``(dq, dk, dv)``. With ``P`` the probabilities and ``O = P V``:
    ``dV = P^T dO``, ``dP = dO V^T``, and the softmax's Jacobian gives
    ``dS = P * (dP - rowsum(dP * P)) = P * (dP - rowsum(dO * O))``; then ``dQ = dS K / sqrt(H)``,
    ``dK = dS^T Q / sqrt(H)``. ``out`` and ``lse`` default to the forward's at these q, k, v
    (a backward from a kept output and statistics passes its own)."""
    q, k, v, dout = _f64(q), _f64(k), _f64(v), _f64(dout)
    b, t, n, h = q.shape
    kh = k.shape[2]
    p, _ = _probabilities(q, k, is_causal, lse)
    if out is None:
        out = np.einsum("bkgts,bskh->btkgh", p, v).reshape(q.shape)
    do = _grouped_q(dout, kh)
    o = _grouped_q(_f64(out), kh)
    dv = np.einsum("bkgts,btkgh->bskh", p, do)
    dp = np.einsum("btkgh,bskh->bkgts", do, v)
    d = np.einsum("btkgh,btkgh->bkgt", do, o)
    ds = p * (dp - d[..., None])
    dq = np.einsum("bkgts,bskh->btkgh", ds, k) / math.sqrt(h)
    dk = np.einsum("bkgts,btkgh->bskh", ds, _grouped_q(q, kh)) / math.sqrt(h)
    return dq.reshape(q.shape), dk, dv


def _log_softmax(logits):
    peak = logits.max(-1, keepdims=True)
    return logits - peak - np.log(np.exp(logits - peak).sum(-1, keepdims=True))


def cross_entropy(h, w, labels, mask=None):
    """``sum(mask * (logsumexp(h w) - (h w)[label])) / sum(mask)``."""
    logp = _log_softmax(_f64(h) @ _f64(w))
    ce = -np.take_along_axis(logp, np.asarray(labels)[..., None], axis=-1)[..., 0]
    mask = np.ones(ce.shape) if mask is None else _f64(mask)
    return float((mask * ce).sum() / mask.sum())


def cross_entropy_grads(h, w, labels, mask=None):
    """``(dh, dw)``: with ``G = mask / sum(mask) * (softmax(h w) - onehot(label))``,
    ``dh = G w^T`` and ``dw = h^T G`` (tokens summed)."""
    h, w = _f64(h), _f64(w)
    logits = h @ w
    mask = np.ones(logits.shape[:-1]) if mask is None else _f64(mask)
    onehot = np.eye(w.shape[1])[np.asarray(labels)]
    g = (np.exp(_log_softmax(logits)) - onehot) * (mask / mask.sum())[..., None]
    return g @ w.T, h.reshape(-1, h.shape[-1]).T @ g.reshape(-1, w.shape[1])

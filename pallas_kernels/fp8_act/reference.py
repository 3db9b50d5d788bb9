"""The FP8 activation ops in plain jnp: the numerics contract and the CPU path."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_quant import (
    quantize_per_group_reference,
)
from pallas_kernels.quant import QuantizedTensor


def check_saved(op: str, *saved) -> None:
    """``TypeError`` unless ``saved`` are the quantized tensors the forward of ``op`` returned."""
    for q in saved:
        if not isinstance(q, QuantizedTensor):
            raise TypeError(
                f"{op} takes the QuantizedTensor(s) its forward returned (codes and scales in "
                f"one), got {type(q).__name__}"
            )


def rmsnorm_fwd_reference(
    x, w, eps: float, *, group_size: int = 16, fmt: str = "e4m3", scale_format: str = "float32"
):
    """``(y, x_q, rstd)``: ``y`` in ``x.dtype``, ``x_q`` the 1xG quantized ``x``, ``rstd [..., 1]``
    float32."""
    x32 = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    y = w.astype(x.dtype) * (x32 * rstd).astype(x.dtype)
    return (
        y,
        quantize_per_group_reference(x, group_size=group_size, fmt=fmt, scale_format=scale_format),
        rstd,
    )


def rmsnorm_bwd_reference(dy, x_q: QuantizedTensor, rstd, w):
    """``(dx in dy.dtype, dw in w.dtype)`` from the saved FP8 input."""
    n = x_q.dequantize() * rstd
    dy32 = dy.astype(jnp.float32)
    # The forward rounds the normalized value to x.dtype before the weight multiply.
    n_rounded = n.astype(dy.dtype).astype(jnp.float32)
    dw = jnp.sum((dy32 * n_rounded).reshape(-1, n.shape[-1]), axis=0)
    dn = dy32 * w.astype(dy.dtype).astype(jnp.float32)
    dx = rstd * (dn - n * jnp.mean(dn * n, axis=-1, keepdims=True))
    return dx.astype(dy.dtype), dw.astype(w.dtype)


def silu32(x32):
    # exp rather than lax.logistic so that the kernel and the reference share one formula.
    return x32 / (1.0 + jnp.exp(-x32))


def silu_fwd_reference(
    x, *, group_size: int = 16, fmt: str = "e4m3", scale_format: str = "float32"
):
    """``(y, x_q)``: ``y = silu(x)`` in float32 math, output in ``x.dtype``; ``x_q`` the 1xG
    quantized ``x``."""
    y = silu32(x.astype(jnp.float32)).astype(x.dtype)
    return y, quantize_per_group_reference(
        x, group_size=group_size, fmt=fmt, scale_format=scale_format
    )


def silu_grad(x32):
    sig = 1.0 / (1.0 + jnp.exp(-x32))
    return sig * (1.0 + x32 * (1.0 - sig))


def silu_bwd_reference(dy, x_q: QuantizedTensor):
    x = x_q.dequantize()
    return (dy.astype(jnp.float32) * silu_grad(x)).astype(dy.dtype)


def swiglu_fwd_reference(
    gate, up, *, group_size: int = 16, fmt: str = "e4m3", scale_format: str = "float32"
):
    """``(y, gate_q, up_q)``, ``y = silu(gate) * up``, with both inputs 1xG quantized."""
    g32, u32 = gate.astype(jnp.float32), up.astype(jnp.float32)
    y = (silu32(g32) * u32).astype(jnp.result_type(gate, up))
    return (
        y,
        quantize_per_group_reference(
            gate, group_size=group_size, fmt=fmt, scale_format=scale_format
        ),
        quantize_per_group_reference(up, group_size=group_size, fmt=fmt, scale_format=scale_format),
    )


def swiglu_grads(dy32, g32, u32):
    """``(d gate, d up)`` of ``silu(gate) * up`` in float32."""
    sig = 1.0 / (1.0 + jnp.exp(-g32))
    return dy32 * u32 * sig * (1.0 + g32 * (1.0 - sig)), dy32 * g32 * sig


def swiglu_bwd_reference(dy, gate_q: QuantizedTensor, up_q: QuantizedTensor):
    dg, du = swiglu_grads(dy.astype(jnp.float32), gate_q.dequantize(), up_q.dequantize())
    return dg.astype(dy.dtype), du.astype(dy.dtype)


def mul_fwd_reference(
    a, b, *, group_size: int = 16, fmt: str = "e4m3", scale_format: str = "float32"
):
    """``(y, a_q, b_q)`` with ``y = a * b`` in the inputs' dtype, both inputs 1xG quantized."""
    y = (a.astype(jnp.float32) * b.astype(jnp.float32)).astype(jnp.result_type(a, b))
    return (
        y,
        quantize_per_group_reference(a, group_size=group_size, fmt=fmt, scale_format=scale_format),
        quantize_per_group_reference(b, group_size=group_size, fmt=fmt, scale_format=scale_format),
    )


def mul_bwd_reference(dy, a_q: QuantizedTensor, b_q: QuantizedTensor):
    dy32 = dy.astype(jnp.float32)
    da = dy32 * b_q.dequantize()
    db = dy32 * a_q.dequantize()
    return da.astype(dy.dtype), db.astype(dy.dtype)

"""The element-wise FP8 ops of a Llama layer: RMSNorm, SiLU, product, fused SwiGLU, residual add.

Each keeps its inputs for backward as E4M3 codes with 1xG scales (``fp8_add`` keeps nothing)
and computes its output from the exact inputs in float32. The fused kernels and their jnp
references live in :mod:`pallas_kernels.fp8_act`.
"""

from __future__ import annotations

import functools

import jax

from coat_jax.fp8.checks import check_float, check_pair
from coat_jax.fp8.config import DEFAULT_CONFIG, FP8Config
from coat_jax.fp8.residuals import keep, pin
from pallas_kernels import fp8_act


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def fp8_rmsnorm(
    x: jax.Array, weight: jax.Array, eps: float = 1e-6, config: FP8Config = DEFAULT_CONFIG
) -> jax.Array:
    """RMSNorm (``weight * x / sqrt(mean(x^2) + eps)``, float32 math) keeping FP8 ``x``.

    Args:
      x: ``[..., D]``; weight: ``[D]`` (any float dtype); eps: a Python float (static).

    Returns:
      ``[..., D]`` in ``x.dtype``; ``weight``'s gradient comes back in ``weight.dtype``.
    """
    return _fp8_rmsnorm_fwd(x, weight, eps, config)[0]


def _fp8_rmsnorm_fwd(x, weight, eps, config):
    check_float("x", x)
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rmsnorm weight must have shape {x.shape[-1:]}, got {weight.shape}")
    y, x_q, rstd = fp8_act.rmsnorm_fwd(x, weight, eps, **config.quantize_kwargs("rmsnorm"))
    return y, (*keep((pin(x_q, config), rstd)), weight)


def _fp8_rmsnorm_bwd(eps, config, res, dy):
    del eps
    x_q, rstd, weight = res
    return fp8_act.rmsnorm_bwd(dy, x_q, rstd, weight, **config.kernel_kwargs("rmsnorm"))


fp8_rmsnorm.defvjp(_fp8_rmsnorm_fwd, _fp8_rmsnorm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def fp8_silu(x: jax.Array, config: FP8Config = DEFAULT_CONFIG) -> jax.Array:
    """``x * sigmoid(x)`` (float32 math, output in ``x.dtype``) keeping FP8 ``x`` (1x16)."""
    return _fp8_silu_fwd(x, config)[0]


def _fp8_silu_fwd(x, config):
    check_float("x", x)
    y, x_q = fp8_act.silu_fwd(x, **config.quantize_kwargs("silu"))
    return y, keep(pin(x_q, config))


def _fp8_silu_bwd(config, res, dy):
    return (fp8_act.silu_bwd(dy, res, **config.kernel_kwargs("silu")),)


fp8_silu.defvjp(_fp8_silu_fwd, _fp8_silu_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def fp8_mul(a: jax.Array, b: jax.Array, config: FP8Config = DEFAULT_CONFIG) -> jax.Array:
    """``a * b`` (SwiGLU's product) keeping FP8 ``a`` and ``b`` (1x16) for backward."""
    return _fp8_mul_fwd(a, b, config)[0]


def _fp8_mul_fwd(a, b, config):
    check_pair("fp8_mul", a, b)
    y, a_q, b_q = fp8_act.mul_fwd(a, b, **config.quantize_kwargs("mul"))
    return y, keep(pin((a_q, b_q), config))


def _fp8_mul_bwd(config, res, dy):
    return fp8_act.mul_bwd(dy, *res, **config.kernel_kwargs("mul"))


fp8_mul.defvjp(_fp8_mul_fwd, _fp8_mul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def fp8_swiglu(gate: jax.Array, up: jax.Array, config: FP8Config = DEFAULT_CONFIG) -> jax.Array:
    """``silu(gate) * up`` keeping only FP8 ``gate`` and ``up`` (1x16); beyond COAT's op list.

    ``fp8_mul(fp8_silu(gate), up)`` keeps three intermediate-size FP8 tensors (gate, SiLU output,
    up), as COAT does; this fused op keeps two and recomputes the SiLU in backward.
    """
    return _fp8_swiglu_fwd(gate, up, config)[0]


def _fp8_swiglu_fwd(gate, up, config):
    check_pair("fp8_swiglu", gate, up)
    y, gate_q, up_q = fp8_act.swiglu_fwd(gate, up, **config.quantize_kwargs("swiglu"))
    return y, keep(pin((gate_q, up_q), config))


def _fp8_swiglu_bwd(config, res, dy):
    return fp8_act.swiglu_bwd(dy, *res, **config.kernel_kwargs("swiglu"))


fp8_swiglu.defvjp(_fp8_swiglu_fwd, _fp8_swiglu_bwd)


@jax.custom_vjp
def fp8_add(a: jax.Array, b: jax.Array) -> jax.Array:
    """Residual add in the inputs' dtype; its backward needs (and keeps) nothing.

    XLA's autodiff keeps nothing for an add either; this op exists so that the residual stream's
    FP8 copy is unambiguous: it is the one the consuming :func:`fp8_rmsnorm` saves.
    """
    return _fp8_add_fwd(a, b)[0]


def _fp8_add_fwd(a, b):
    check_pair("fp8_add", a, b)
    return a + b, None


def _fp8_add_bwd(res, dy):
    del res
    return dy, dy


fp8_add.defvjp(_fp8_add_fwd, _fp8_add_bwd)

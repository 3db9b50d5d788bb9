"""The COAT AdamW step in plain jnp: the numerics contract (docs/design.md, 'The optimizer
step') and the CPU path; the kernel matches it to float32 rounding."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import quant
from pallas_kernels.coat_adam.config import MomentSpec
from pallas_kernels.quant import QuantizedTensor


def quantize_moment(x: jax.Array, fmt: str, spec: MomentSpec, expand_min) -> QuantizedTensor:
    """Quantizes a float32 moment as ``spec`` says (DRE or plain absmax)."""
    if spec.expansion:
        return quant.quantize_dre(x, group_size=spec.group_size, fmt=fmt, expand_min=expand_min)
    return quant.quantize_absmax(x, group_size=spec.group_size, fmt=fmt)


def check_groups(name: str, moment: QuantizedTensor, spec: MomentSpec) -> None:
    """``TypeError`` unless ``moment`` is a :class:`QuantizedTensor`, ``ValueError`` unless it
    was quantized per group of ``spec.group_size``."""
    if not isinstance(moment, QuantizedTensor):
        raise TypeError(f"{name} must be a QuantizedTensor, got {type(moment).__name__}")
    if moment.granularity != "group" or moment.group_size != spec.group_size:
        raise ValueError(
            f"{name} was quantized with granularity={moment.granularity!r}, group_size="
            f"{moment.group_size}; the step's spec has groups of {spec.group_size}: quantize the "
            "moments with the spec (quantize_moment) or pass the spec they were made with"
        )


def check_view(shape: tuple[int, ...], mu: QuantizedTensor, nu: QuantizedTensor) -> None:
    """``ValueError`` unless both moments have one shape, a group view of ``shape`` (as many
    values)."""
    if mu.shape != nu.shape or math.prod(mu.shape) != math.prod(shape):
        raise ValueError(
            f"the moments' shapes {mu.shape} and {nu.shape} must be one group view of the "
            f"parameter's {tuple(shape)} (a reshape with as many values); quantize them from "
            "moments of the parameter's size"
        )


def adam_moments_and_update(g, m, v, *, count, b1, b2, eps):
    """Adam's moments and direction in float32 (no weight decay, no lr).

    docs/design.md, 'The optimizer step'.
    """
    g = g.astype(jnp.float32)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    t = jnp.asarray(count, jnp.float32)
    update = m / (1 - b1**t) / (jnp.sqrt(v / (1 - b2**t)) + eps)
    return m, v, update


def coat_adam_step_reference(
    grad: jax.Array,
    mu: QuantizedTensor,
    nu: QuantizedTensor,
    *,
    count,
    b1,
    b2,
    eps,
    expand_min,
    spec: MomentSpec,
) -> tuple[jax.Array, QuantizedTensor, QuantizedTensor]:
    """Plain-jnp COAT AdamW step of one parameter.

    Args:
      grad: the gradient, any float dtype, the parameter's shape.
      mu, nu: the quantized first and second moments (per group of ``spec.group_size``), in
        the parameter's group view: its shape, or a reshape of it whose last axis the groups
        run along (``coat_jax.state_codec.group_view``).
      count: the step number t, starting at 1 (a traced int is fine).
      b1, b2, eps, expand_min: numeric hyper-parameters (traced values are fine).
      spec: the static quantization settings.

    Returns:
      ``(update, new_mu, new_nu)``: the update ``m_hat / (sqrt(v_hat) + eps)`` in ``grad.dtype``
      and the re-quantized moments.
    """
    check_groups("mu", mu, spec)
    check_groups("nu", nu, spec)
    check_view(grad.shape, mu, nu)
    # The step itself runs in the parameter's shape and only the codec in the group view, as
    # coat_jax.fp8_state runs any optimizer, so the two agree bit for bit.
    m = mu.dequantize().reshape(grad.shape)
    v = nu.dequantize().reshape(grad.shape)
    m, v, update = adam_moments_and_update(grad, m, v, count=count, b1=b1, b2=b2, eps=eps)
    return (
        update.astype(grad.dtype),
        quantize_moment(m.reshape(mu.shape), spec.mu_format, spec, expand_min),
        quantize_moment(v.reshape(nu.shape), spec.nu_format, spec, expand_min),
    )


def apply_update(param, update, *, learning_rate, weight_decay):
    """``optax.add_decayed_weights``, ``scale_by_learning_rate`` and ``apply_updates`` in one.

    ``p + (u + wd * p) * (-lr)``, cast back to ``p``'s dtype: what ``coat_adamw``'s chain computes
    for a non-zero weight decay (optax skips the addition for a literal 0, which rounds the
    scaled update to the gradient's dtype; here it is always float32).
    """
    u = update + weight_decay * param
    return (param + u * (-learning_rate)).astype(param.dtype)


def coat_adamw_apply_reference(
    param,
    grad,
    mu,
    nu,
    *,
    count,
    b1,
    b2,
    eps,
    expand_min,
    learning_rate,
    weight_decay,
    spec,
    grad_scale=None,
) -> tuple[jax.Array, QuantizedTensor, QuantizedTensor]:
    """Plain-jnp fused AdamW step of one parameter: ``(new_param, new_mu, new_nu)``.

    ``grad_scale`` (a scalar, ``None`` for 1) multiplies the gradient in float32 first, as the
    kernel does (gradient clipping folded into the step).
    """
    g = grad if grad_scale is None else grad.astype(jnp.float32) * grad_scale
    update, new_mu, new_nu = coat_adam_step_reference(
        g, mu, nu, count=count, b1=b1, b2=b2, eps=eps, expand_min=expand_min, spec=spec
    )
    # The kernel rounds the update to the gradient's dtype, scaled or not.
    update = update.astype(grad.dtype)
    new_param = apply_update(param, update, learning_rate=learning_rate, weight_decay=weight_decay)
    return new_param, new_mu, new_nu

"""Row-wise FP8 linears fused with the op that produces their input: RMSNorm and SwiGLU.

Under ``FP8Config(linear_scaling="row" | "row_gw_hp")`` a Llama layer's q|k|v and gate|up
linears read an RMSNorm's output, and its down projection reads ``silu(gate) * up``. Called as
two ops, the producer writes its BF16 output and the linear reads it twice, once for each row's
maximum and once to cast it. Here each pair is one ``custom_vjp`` op whose producer writes the
linear's operand directly, E4M3 codes with one float32 scale per row
(:mod:`pallas_kernels.fp8_rowquant`: a Pallas kernel that holds whole rows, or its jnp
reference, by ``FP8Config.op_implementations``' ``rmsnorm_rowwise`` and ``swiglu_rowwise``),
and the GEMMs take those codes (:func:`coat_jax.fp8.rowwise.rowwise_gemms`).

Kept for backward, as the two ops would keep them: the producer's FP8 inputs with 1xG scales
(RMSNorm's ``x`` and ``rstd``; SwiGLU's gate and up), the row codes and scales of the linear's
input, and references to the master weights; no BF16 activation. Backward runs the linear's
backward (:func:`~coat_jax.fp8.rowwise.rowwise_grads`) and then the producer's
(``fp8_act.rmsnorm_bwd``, ``fp8_act.swiglu_bwd``, by the ``rmsnorm`` and ``swiglu`` entries).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from coat_jax.fp8.checks import check_float, check_pair
from coat_jax.fp8.residuals import keep, pin
from coat_jax.fp8.rowwise import check_linear, rowwise_gemms, rowwise_grads
from pallas_kernels import fp8_act, fp8_rowquant
from pallas_kernels.dispatch import dispatch_tiled


def _producer(op, config, pallas, reference, *args):
    """``(row codes, *1xG saved)`` of ``op`` (``rmsnorm_rowwise`` or ``swiglu_rowwise``) by its
    implementation. The kernel's outputs pass no barrier: XLA cannot fold a Pallas kernel's
    round trip, and a barrier between the row codes and the GEMM would hide them from the FP8
    GEMM rewriter (docs/fp8_gemm.md). The reference's codes are XLA's and are pinned."""

    def pinned(*reference_args, **settings):
        return pin(reference(*reference_args, **settings), config)

    settings = config.group_kwargs()
    return dispatch_tiled(op, pallas, pinned, args, settings, **config.kernel_kwargs(op))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def fp8_rmsnorm_rowwise_linear(x: jax.Array, norm_weight: jax.Array, w, eps: float, config):
    """``linear(rmsnorm(x, norm_weight, eps), w)`` with the RMSNorm writing the linear's
    row-quantized operand (:func:`coat_jax.fp8.rowwise.fp8_rowwise_linear`'s numerics).

    Args:
      x: ``[..., D]``, the residual stream (BF16 or float32).
      norm_weight: the RMSNorm's weight ``[D]``.
      w: master weight ``[D, N]`` or a tuple of them (q|k|v).
      eps: the RMSNorm's epsilon (a Python float, static).
      config: a static ``FP8Config`` with ``linear_scaling`` ``"row"`` or ``"row_gw_hp"``.

    Returns:
      ``[..., N]`` in ``x.dtype`` (a tuple for a tuple ``w``).
    """
    return _fp8_rmsnorm_rowwise_linear_fwd(x, norm_weight, w, eps, config)[0]


def _fp8_rmsnorm_rowwise_linear_fwd(x, norm_weight, w, eps, config):
    check_float("x", x)
    if norm_weight.shape != x.shape[-1:]:
        raise ValueError(f"rmsnorm weight must have shape {x.shape[-1:]}, got {norm_weight.shape}")
    check_linear(x, w, config)
    y_q, x_q, rstd = _producer(
        "rmsnorm_rowwise",
        config,
        fp8_rowquant.rmsnorm_rowwise_pallas,
        fp8_rowquant.rmsnorm_rowwise_reference,
        x,
        norm_weight,
        eps,
    )
    out = rowwise_gemms(y_q, w, config, x.dtype)
    return out, (*keep((y_q, x_q, rstd)), norm_weight, w)


def _fp8_rmsnorm_rowwise_linear_bwd(eps, config, res, dy):
    del eps
    y_q, x_q, rstd, norm_weight, w = res
    d_normed, dw = rowwise_grads(y_q, w, dy, config)
    dx, d_norm_weight = fp8_act.rmsnorm_bwd(
        d_normed, x_q, rstd, norm_weight, **config.kernel_kwargs("rmsnorm")
    )
    return dx, d_norm_weight, dw


fp8_rmsnorm_rowwise_linear.defvjp(_fp8_rmsnorm_rowwise_linear_fwd, _fp8_rmsnorm_rowwise_linear_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def fp8_swiglu_rowwise_linear(gate: jax.Array, up: jax.Array, w: jax.Array, config):
    """``linear(silu(gate) * up, w)`` with the SwiGLU writing the linear's row-quantized operand;
    keeps FP8 gate and up (1xG) and recomputes the SiLU in backward, as
    ``fp8_ops.fp8_swiglu`` does.

    Args:
      gate, up: ``[..., F]`` (one dtype).
      w: the down projection's master weight ``[F, N]``.
      config: a static ``FP8Config`` with ``linear_scaling`` ``"row"`` or ``"row_gw_hp"``.

    Returns:
      ``[..., N]`` in the inputs' dtype.
    """
    return _fp8_swiglu_rowwise_linear_fwd(gate, up, w, config)[0]


def _fp8_swiglu_rowwise_linear_fwd(gate, up, w, config):
    check_pair("fp8_swiglu_rowwise_linear", gate, up)
    check_linear(gate, w, config)
    h_q, gate_q, up_q = _producer(
        "swiglu_rowwise",
        config,
        fp8_rowquant.swiglu_rowwise_pallas,
        fp8_rowquant.swiglu_rowwise_reference,
        gate,
        up,
    )
    out = rowwise_gemms(h_q, w, config, jnp.result_type(gate, up))
    return out, (*keep((h_q, gate_q, up_q)), w)


def _fp8_swiglu_rowwise_linear_bwd(config, res, dy):
    h_q, gate_q, up_q, w = res
    dh, dw = rowwise_grads(h_q, w, dy, config)
    d_gate, d_up = fp8_act.swiglu_bwd(dh, gate_q, up_q, **config.kernel_kwargs("swiglu"))
    return d_gate, d_up, dw


fp8_swiglu_rowwise_linear.defvjp(_fp8_swiglu_rowwise_linear_fwd, _fp8_swiglu_rowwise_linear_bwd)

"""Row-wise scaled FP8 linear: one scale per token of the input, one per output channel.

``FP8Config(linear_scaling="row" | "row_gw_hp")`` runs every FP8 linear of :func:`coat_jax.
fp8_ops.ops_for` through :func:`fp8_rowwise_linear` instead of the per-tensor ``fp8_linear``.
The non-linear ops (1x16 E4M3 residuals) and the FP8 optimizer states are unchanged.

Forward, for ``x [..., K]`` and ``w [K, N]``::

    x_q, s_x = E4M3(x), amax over K per row        (s_x: one float32 per token)
    w_q, s_w = E4M3(w), amax over K per column     (s_w: one float32 per output channel)
    y = dot(convert(x_q), convert(w_q)) * (s_x[..., None] * s_w[None, :])

Both scales are constant along the contraction axis, so they factor out of the sum and the GEMM
itself runs with unit scales: XLA's GPU compiler can still rewrite it into cuBLASLt's FP8 GEMM
(the scales-after-the-dot spelling, docs/fp8_gemm.md), and the scaling is an elementwise
multiply that XLA fuses with the output's consumer. Each scale is a reduction along one axis of
the operand its producer writes, which XLA can fuse into that producer's fusion, where a
per-tensor scale needs the whole tensor's maximum before any code can be cast.

Saved for backward: ``x``'s E4M3 codes and per-row scales (a :class:`~pallas_kernels.quant.
QuantizedTensor` with one group of ``K`` per row, tagged :data:`ACTIVATION`) and a reference to
the master weight, which backward quantizes again (``weight_residual="master"``, the only one
this op takes).

Backward (``dy [..., N]``), with every quantization along the GEMM's contraction axis, so that
each scale again factors out of its sum:

* ``dx = dy @ w.T``: ``dy`` in E5M2 per row (amax over N), ``w`` in E4M3 per row of ``w``
  (amax over N).
* ``dw = x.T @ dy``, ``linear_scaling="row"``: ``x`` dequantized from its saved codes and
  quantized again in E4M3 per column (amax over the tokens), ``dy`` in E5M2 per column.
  ``"row_gw_hp"``: the dequantized ``x`` and ``dy`` in the compute dtype (a BF16 GEMM, float32
  accumulation), as torchao's ``ROWWISE_WITH_GW_HP`` recipe: the weight gradient, which sums
  over every token, avoids the second quantization of ``x`` and the E5M2 ``dy``.

The quantizers here are jnp, left for XLA to fuse. Where the input's producer is one of the
model's FP8 ops (RMSNorm, SwiGLU), :mod:`coat_jax.fp8.rowwise_fused` runs producer and linear as
one op whose producer writes the row codes itself (``pallas_kernels.fp8_rowquant``), through
:func:`rowwise_gemms` and :func:`rowwise_grads`. FP8 codes made by XLA pass an optimization
barrier unless ``config.codes_barrier`` is off, as the per-tensor linear's XLA quantizer does
(``coat_jax.fp8_ops.materialize`` says why).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from coat_jax import quant
from coat_jax.fp8.residuals import ACTIVATION


def quantize_along(x: jax.Array, axis: int, fmt: str, config) -> tuple[jax.Array, jax.Array]:
    """``(codes, scale)`` of ``x`` with one float32 absmax scale per slice along ``axis``
    (``scale`` keeps ``axis`` with length 1, so ``codes * scale`` is the dequantized value).

    The scale is ``(max|x| + 1e-20) / fmax`` over the slice, COAT's absmax rule
    (:func:`~pallas_kernels.quant.absmax_scale`); codes are clipped then cast.

    Examples:
      >>> from coat_jax.fp8_ops import FP8Config
      >>> codes, scale = quantize_along(jnp.ones((4, 8)), 1, "e4m3", FP8Config())
      >>> codes.dtype, scale.shape
      (dtype(float8_e4m3fn), (4, 1))
    """
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=axis, keepdims=True)
    scale = quant.absmax_scale(amax, quant.FP8_MAX[fmt], "float32")
    codes = quant.cast_to_fp8(x32 / scale, fmt)
    if config.codes_barrier:
        codes = jax.lax.optimization_barrier(codes)
    return codes, scale


def _dot(a_codes, b_codes, contracting, scale, config, compute_dtype, out_dtype):
    """``dot(convert(a_codes), convert(b_codes)) * scale`` in ``out_dtype``: an FP8 GEMM with
    unit scales, float32 accumulation, then the operands' scales as one outer product.

    The converts follow ``coat_jax.fp8_ops``'s FP8 GEMMs (``config.gemm_dequant``). A BF16
    result under ``gemm_output="compute"`` is written by the GEMM in BF16 (the rewriter emits a
    BF16 result only for a BF16 dot) and scaled in float32 after: two roundings to BF16. Any
    other result is a float32 GEMM output, scaled, then cast.
    """
    dims = (contracting, ((), ()))
    out_dtype = jnp.dtype(out_dtype)
    if config.gemm_output == "compute" and out_dtype == jnp.bfloat16:
        acc = jax.lax.dot_general(
            a_codes.astype(out_dtype),
            b_codes.astype(out_dtype),
            dims,
            preferred_element_type=out_dtype,
        )
    else:
        dtype = jnp.float32 if config.gemm_dequant == "float32" else compute_dtype
        acc = jax.lax.dot_general(
            a_codes.astype(dtype), b_codes.astype(dtype), dims, preferred_element_type=jnp.float32
        )
    return (acc.astype(jnp.float32) * scale).astype(out_dtype)


def as_weights(w) -> tuple:
    """The weights of one linear call: ``w`` itself if a tuple or list, else ``(w,)``."""
    return tuple(w) if isinstance(w, (tuple, list)) else (w,)


def check_linear(x, w, config, op="fp8_rowwise_linear", scalings=("row", "row_gw_hp")):
    """Errors for what the linear ``op`` does not take: a config whose ``linear_scaling`` is
    not one of ``scalings``, a weight that is not a 2-D master weight of ``x``'s last axis."""
    if config.linear_scaling not in scalings:
        raise ValueError(
            f"{op} runs linear_scaling {' or '.join(map(repr, scalings))}, got "
            f"{config.linear_scaling!r}; for 'tensor' call coat_jax.fp8_ops.fp8_linear (ops_for("
            "precision, config).linear picks the linear of each scaling)"
        )
    weights = as_weights(w)
    if not weights:
        raise ValueError(f"{op} needs at least one weight")
    for wi in weights:
        if not isinstance(wi, jax.Array):
            raise TypeError(
                f"{op} takes master weights (arrays), got {type(wi).__name__}; it re-quantizes "
                "the master weight, use weight_residual='master'"
            )
        if wi.ndim != 2 or x.ndim < 1 or x.shape[-1] != wi.shape[0]:
            raise ValueError(
                f"{op} needs x [..., K] and w [K, N]; got x {x.shape} and w {wi.shape}"
            )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def fp8_rowwise_linear(x: jax.Array, w, config):
    """``x @ w`` as an FP8 GEMM with per-token and per-output-channel E4M3 scales.

    Args:
      x: activations ``[..., K]`` (BF16 or float32).
      w: master weight ``[K, N]`` or a tuple of them sharing the input (q|k|v, gate|up: ``x``
        is quantized and kept once).
      config: a static ``coat_jax.fp8_ops.FP8Config`` with ``linear_scaling`` ``"row"`` or
        ``"row_gw_hp"`` (its formats, ``gemm_dequant``, ``gemm_output`` and
        ``codes_barrier`` apply).

    Returns:
      ``[..., N]`` in ``x.dtype`` (a tuple for a tuple ``w``); weight gradients come back in
      each master weight's dtype.

    Examples:
      >>> from coat_jax.fp8_ops import FP8Config
      >>> x = jnp.ones((2, 8, 32), jnp.bfloat16)
      >>> fp8_rowwise_linear(x, jnp.ones((32, 16)), FP8Config(linear_scaling="row")).shape
      (2, 8, 16)
    """
    return _fp8_rowwise_linear_fwd(x, w, config)[0]


def rows_of(x: jax.Array, config) -> quant.QuantizedTensor:
    """``x [..., K]`` quantized per row in ``config.act_format``: the operand
    :func:`rowwise_gemms` takes (one group of ``K`` per row, ``scale [..., 1]``)."""
    k = x.shape[-1]
    # The 2-D view feeds the GEMM straight from the codes' producer (no reshape in between).
    codes, scale = quantize_along(x.reshape(-1, k), 1, config.act_format, config)
    return quant.QuantizedTensor(
        codes.reshape(x.shape),
        scale.reshape(*x.shape[:-1], 1),
        fmt=config.act_format,
        granularity="group",
        group_size=k,
    )


def rowwise_gemms(x_q: quant.QuantizedTensor, w, config, out_dtype):
    """The forward GEMMs of :func:`fp8_rowwise_linear` from an input already quantized per row
    (:func:`rows_of`, or a producer that writes row codes itself, ``pallas_kernels.
    fp8_rowquant``): ``x @ w`` in ``out_dtype`` (a tuple for a tuple ``w``)."""
    k = x_q.shape[-1]
    x_codes, x_scale = x_q.codes.reshape(-1, k), x_q.scale.reshape(-1, 1)
    ys = []
    for wi in as_weights(w):
        w_codes, w_scale = quantize_along(wi, 0, config.act_format, config)
        y = _dot(x_codes, w_codes, ((1,), (0,)), x_scale * w_scale, config, out_dtype, out_dtype)
        ys.append(y.reshape(*x_q.shape[:-1], wi.shape[1]))
    return tuple(ys) if isinstance(w, (tuple, list)) else ys[0]


def _fp8_rowwise_linear_fwd(x, w, config):
    check_linear(x, w, config)
    x_q = rows_of(x, config)
    return rowwise_gemms(x_q, w, config, x.dtype), (quant.named(x_q, ACTIVATION), w)


def rowwise_grads(x_q: quant.QuantizedTensor, w, dy, config):
    """:func:`fp8_rowwise_linear`'s backward from its row-quantized input ``x_q``, the master
    weight(s) ``w`` and the output gradient(s) ``dy``: ``(dx, dw)``, ``dx`` in ``dy``'s dtype,
    ``dw`` like ``w``."""
    weights, dys = as_weights(w), as_weights(dy)
    compute = dys[0].dtype
    k = x_q.shape[-1]
    x = x_q.dequantize().reshape(-1, k)
    if config.linear_scaling == "row":
        xt_codes, xt_scale = quantize_along(x, 0, config.act_format, config)
    dx, dws = None, []
    for wi, dyi in zip(weights, dys, strict=True):
        dy2 = dyi.reshape(-1, wi.shape[1])
        dy_codes, dy_scale = quantize_along(dy2, 1, config.grad_format, config)
        w_codes, w_scale = quantize_along(wi, 1, config.act_format, config)
        # A tuple of weights sums its input gradients in float32.
        dx_dtype = compute if len(dys) == 1 else jnp.float32
        dx_i = _dot(
            dy_codes, w_codes, ((1,), (1,)), dy_scale * w_scale.T, config, compute, dx_dtype
        )
        dx = dx_i if dx is None else dx + dx_i
        if config.linear_scaling == "row":
            dyt_codes, dyt_scale = quantize_along(dy2, 0, config.grad_format, config)
            scale = xt_scale.T * dyt_scale
            dw = _dot(xt_codes, dyt_codes, ((0,), (0,)), scale, config, compute, jnp.float32)
        else:
            dw = jax.lax.dot_general(
                x.astype(compute),
                dy2.astype(compute),
                (((0,), (0,)), ((), ())),
                preferred_element_type=jnp.float32,
            )
        dws.append(dw.astype(wi.dtype))
    dx = dx.astype(compute).reshape(*dys[0].shape[:-1], k)
    return dx, (type(w)(dws) if isinstance(w, (tuple, list)) else dws[0])


def _fp8_rowwise_linear_bwd(config, res, dy):
    return rowwise_grads(*res, dy, config)


fp8_rowwise_linear.defvjp(_fp8_rowwise_linear_fwd, _fp8_rowwise_linear_bwd)

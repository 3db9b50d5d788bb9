"""COAT's FP8 precision flow for a Llama layer: ops that keep FP8 activations for backward.

Every op here is a ``jax.custom_vjp`` whose forward saves FP8 codes plus float32 scales (one
:class:`~pallas_kernels.quant.QuantizedTensor` per saved tensor, tagged for remat by
:func:`keep`) instead of the BF16 tensor XLA's own autodiff would keep (COAT, Xi et al. 2025,
section 5; docs/design.md, 'The precision flow'):

==================  ==========================================  ================================
op                  saved for backward                          format
==================  ==========================================  ================================
``fp8_linear``      the input (one per call: q|k|v and gate|up   E4M3, per-tensor scale
                    run as one GEMM each, so one copy each)
``fp8_rmsnorm``     the input (the residual stream), 1/D rstd   E4M3, 1x16 scales
``fp8_silu``        the input (gate projection output)          E4M3, 1x16 scales
``fp8_mul``         both inputs (SiLU output, up projection)    E4M3, 1x16 scales
``fp8_add``         nothing (the residual add's backward is     --
                    the identity)
``fp8_swiglu``      gate and up (SiLU recomputed in backward)   E4M3, 1x16 scales
``fp8_attention``   q, k, v (attention re-run in backward)      E4M3, 1x16 scales
==================  ==========================================  ================================

``fp8_swiglu`` and ``fp8_attention`` go beyond COAT (which keeps the SiLU output, and BF16 q, k,
v); a model opts in: :func:`ops_for` gives ``fp8_swiglu`` as its ``swiglu`` op with
``FP8Config(swiglu="fused")``, and ``Llama(fp8_attention=True)`` takes ``fp8_attention`` (or,
with ``FP8Config(attention_backward="saved_output")``, ``fp8_attention_linear``: attention and
the o_proj as one op that keeps q, k, v as ``fp8_attention`` does, the o_proj's FP8 input
and the float32 softmax statistics, and whose backward reads that input, the attention output,
instead of re-running the attention forward).

FP8 linear: input and weight are quantized to E4M3 with per-tensor scales computed just in time
by group scaling; the forward GEMM is written as ``dot(convert(x_fp8) * s_x, convert(w_fp8) *
s_w)``, the pattern XLA's GPU compiler rewrites into cuBLASLt's FP8 GEMM
(``__cublas$lt$matmul$f8``). Backward quantizes the output gradient per-tensor to E5M2 and runs
dgrad and wgrad as the same FP8 pattern; by default (``FP8Config.weight_residual="master"``) the
weight is re-quantized from the master weight rather than kept as an FP8 copy, and with ``"fp8"``
forward's codes are kept for backward instead (1 byte per weight, tagged :data:`WEIGHT`; the same
codes, so the same results). With ``"once"`` the model quantizes every linear weight once per
step before its layers run (:func:`quantize_weight`, all layers of a scanned model in one pass)
and hands :class:`FP8Weight` pairs to ``fp8_linear``, whose forward and backward both read those
codes. Its gradient comes out in the master dtype.

The residual stream travels in BF16 (``fp8_add`` computes the sum in BF16); its FP8 copy is the
one the next ``fp8_rmsnorm`` makes and saves, and since each residual-stream value feeds exactly
one RMSNorm there is one FP8 copy of it, as in COAT.

FP8 tensors made by XLA's own quantizer pass :func:`materialize` (an optimization barrier), so
that XLA cannot fold the quantize-dequantize round trip back into the unquantized value. On a GPU
the default ``implementation="auto"`` quantizes in Pallas kernels, whose FP8 outputs XLA cannot
see through; there the linear layers' codes skip the barrier, which would otherwise hide them from
XLA's FP8 GEMM rewriter. A program compiled without excess precision
(``xla_allow_excess_precision=False``) cannot fold the round trip:
``FP8Config(codes_barrier=False)`` leaves the barrier out there, so that a scanned model's
forward can write its kept codes straight into the stacked residuals (an option, slower in the
trainer's step: docs/bench_codes_barrier.md).

Forward outputs are computed from the exact inputs in float32 (only what backward keeps is
quantized), which costs no memory and keeps the forward as accurate as BF16 outside the GEMMs.

:func:`ops_for` returns the op set of a precision mode: ``"bf16"`` (plain jnp, XLA autodiff),
``"fp8"`` (FP8 linear only, like TransformerEngine) or ``"coat"`` (all of the above).

This module is the FP8 ops' public face: the op sets by precision (:class:`OpSet`,
:func:`ops_for`) and every public name of the ops, which live in the modules of
:mod:`coat_jax.fp8` (config, residuals, compiler, linear, elementwise, attention, plain,
recording) and are re-exported here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax

from coat_jax import attention
from coat_jax.attention import attention_implementation
from coat_jax.fp8.attention import fp8_attention, fp8_attention_linear
from coat_jax.fp8.blockwise import fp8_blockwise_linear
from coat_jax.fp8.checks import check_float, check_pair
from coat_jax.fp8.compiler import (
    GPU_BACKENDS,
    GPU_COMPILER_OPTIONS,
    GPU_XLA_FLAGS,
    fp8_compiler_options,
    is_gpu_backend,
)
from coat_jax.fp8.config import (
    ATTENTION_BACKWARDS,
    ATTENTION_IMPLEMENTATIONS,
    DEFAULT_CONFIG,
    GEMM_DEQUANT,
    GEMM_OUTPUTS,
    KERNEL_OPS,
    PRECISIONS,
    SWIGLU_OPS,
    WEIGHT_RESIDUALS,
    FP8Config,
    check_op_implementations,
)
from coat_jax.fp8.elementwise import fp8_add, fp8_mul, fp8_rmsnorm, fp8_silu, fp8_swiglu
from coat_jax.fp8.linear import (
    FP8Weight,
    fp8_dot_general,
    fp8_linear,
    linear_of,
    prequantized,
    quantize_weight,
)
from coat_jax.fp8.plain import add, linear, mul, rmsnorm, silu
from coat_jax.fp8.recording import (
    ScaleRecorder,
    observed_attention,
    observed_attention_linear,
    observed_linear,
    observed_mul,
    observed_rmsnorm,
    observed_silu,
    observed_swiglu,
    placeholder,
)
from coat_jax.fp8.residuals import ACTIVATION, WEIGHT, keep, keep_weight, materialize, pin
from coat_jax.fp8.rowwise import fp8_rowwise_linear
from coat_jax.fp8.rowwise_fused import fp8_rmsnorm_rowwise_linear, fp8_swiglu_rowwise_linear

__all__ = [
    # op sets
    "OpSet",
    "ops_for",
    "recorded_attention",
    "recorded_attention_linear",
    # config
    "ATTENTION_BACKWARDS",
    "ATTENTION_IMPLEMENTATIONS",
    "DEFAULT_CONFIG",
    "GEMM_DEQUANT",
    "GEMM_OUTPUTS",
    "KERNEL_OPS",
    "PRECISIONS",
    "SWIGLU_OPS",
    "WEIGHT_RESIDUALS",
    "FP8Config",
    "check_op_implementations",
    # what the ops keep
    "ACTIVATION",
    "WEIGHT",
    "keep",
    "keep_weight",
    "materialize",
    "pin",
    "check_float",
    "check_pair",
    # compiler options
    "GPU_BACKENDS",
    "GPU_COMPILER_OPTIONS",
    "GPU_XLA_FLAGS",
    "fp8_compiler_options",
    "is_gpu_backend",
    # ops
    "FP8Weight",
    "fp8_dot_general",
    "fp8_linear",
    "prequantized",
    "quantize_weight",
    "fp8_add",
    "fp8_mul",
    "fp8_rmsnorm",
    "fp8_silu",
    "fp8_swiglu",
    "attention",
    "attention_implementation",
    "fp8_attention",
    "fp8_attention_linear",
    "fp8_rowwise_linear",
    "fp8_blockwise_linear",
    "fp8_rmsnorm_rowwise_linear",
    "fp8_swiglu_rowwise_linear",
    # plain ops
    "add",
    "linear",
    "mul",
    "rmsnorm",
    "silu",
    # activation telemetry
    "ScaleRecorder",
    "observed_attention",
    "observed_attention_linear",
    "observed_linear",
    "observed_mul",
    "observed_rmsnorm",
    "observed_silu",
    "observed_swiglu",
    "placeholder",
]


class OpSet(NamedTuple):
    """The ops a Llama layer needs, for one precision mode (see :func:`ops_for`)."""

    precision: str
    linear: Callable[[jax.Array, jax.Array], jax.Array]
    rmsnorm: Callable[[jax.Array, jax.Array, float], jax.Array]
    silu: Callable[[jax.Array], jax.Array]
    mul: Callable[[jax.Array, jax.Array], jax.Array]
    add: Callable[[jax.Array, jax.Array], jax.Array]
    # Causal attention ``(q, k, v) -> out``; None: the model's own (BF16, cuDNN on a GPU).
    attention: Callable | None = None
    # ``(gate, up) -> silu(gate) * up`` as one op; None: ``mul(silu(gate), up)``.
    swiglu: Callable | None = None
    # ``(q, k, v, o_proj weight) -> linear(attention(q, k, v), w)`` as one op
    # (:func:`fp8_attention_linear`); None: ``attention`` then ``linear``.
    attention_linear: Callable | None = None
    # ``(x, norm weight, eps, w) -> linear(rmsnorm(x, norm weight, eps), w)`` as one op
    # (:func:`fp8_rmsnorm_rowwise_linear`); None: ``rmsnorm`` then ``linear``.
    norm_linear: Callable | None = None
    # ``(gate, up, w) -> linear(silu(gate) * up, w)`` as one op (:func:`fp8_swiglu_rowwise_linear`);
    # None: :meth:`silu_mul` then ``linear``.
    swiglu_linear: Callable | None = None

    def silu_mul(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        """``silu(gate) * up``: the fused op where the set has one, else the SiLU and product."""
        return self.mul(self.silu(gate), up) if self.swiglu is None else self.swiglu(gate, up)

    def rmsnorm_then_linear(self, x: jax.Array, norm_weight: jax.Array, eps: float, w):
        """``linear(rmsnorm(x, norm_weight, eps), w)``: one op where the set has one."""
        if self.norm_linear is None:
            return self.linear(self.rmsnorm(x, norm_weight, eps), w)
        return self.norm_linear(x, norm_weight, eps, w)

    def silu_mul_then_linear(self, gate: jax.Array, up: jax.Array, w):
        """``linear(silu(gate) * up, w)``: one op where the set has one."""
        if self.swiglu_linear is None:
            return self.linear(self.silu_mul(gate, up), w)
        return self.swiglu_linear(gate, up, w)


def ops_for(
    precision: str, config: FP8Config = DEFAULT_CONFIG, *, recorder: ScaleRecorder | None = None
) -> OpSet:
    """The op set of a precision mode.

    Args:
      precision: ``"bf16"`` (plain jnp with XLA autodiff: the baseline), ``"fp8"`` (FP8 linear
        layers only, TransformerEngine-style) or ``"coat"`` (COAT's full precision flow).
      config: static FP8 settings for the FP8 ops (with ``swiglu="fused"`` the coat set's
        ``swiglu`` is :func:`fp8_swiglu`).
      recorder: a :class:`ScaleRecorder` that the FP8 ops hand the scales they quantize with
        (the activation telemetry). The ops are then the ``observed_*`` variants: the same
        forward and backward, the same results. ``None``: the plain FP8 ops.

    Examples:
      >>> import jax.numpy as jnp
      >>> ops = ops_for("coat")
      >>> ops.silu(jnp.ones((2, 32), jnp.bfloat16)).dtype
      dtype(bfloat16)
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {list(PRECISIONS)}")
    if not isinstance(config, FP8Config):
        raise TypeError(f"config must be an FP8Config, got {type(config).__name__}")
    plain = OpSet(precision, linear, rmsnorm, silu, mul, add)
    if precision == "bf16":
        return plain
    if recorder is not None:
        return _recording_ops(plain, precision, config, recorder)
    rowwise = config.linear_scaling in ("row", "row_gw_hp")
    fp8_lin = _bound(linear_of(config), config)
    if precision == "fp8":
        return plain._replace(linear=fp8_lin)
    fused = config.swiglu == "fused"
    return OpSet(
        precision,
        linear=fp8_lin,
        rmsnorm=_bound_rmsnorm(config),
        silu=_bound(fp8_silu, config),
        mul=_bound(fp8_mul, config),
        add=fp8_add,
        swiglu=_bound(fp8_swiglu, config) if fused else None,
        norm_linear=_bound_norm_linear(config) if rowwise else None,
        swiglu_linear=_bound(fp8_swiglu_rowwise_linear, config) if rowwise and fused else None,
    )


def _recording_ops(plain: OpSet, precision: str, config: FP8Config, recorder) -> OpSet:
    """:func:`ops_for`'s FP8 ops as their ``observed_*`` variants, handing ``recorder`` the
    scales (closures: a recorder belongs to one trace, so these op sets are never cached)."""
    if config.linear_scaling != "tensor":
        raise ValueError(
            f"the activation telemetry records per-tensor linear scales, and linear_scaling="
            f"{config.linear_scaling!r} makes none; turn the telemetry off or use 'tensor'"
        )

    def linear(x, w):
        y, scale = observed_linear(x, w, config)
        recorder.record_linear(scale)
        return y

    def rmsnorm(x, weight, eps=1e-6):
        y, scales = observed_rmsnorm(x, weight, float(eps), config)
        recorder.record_group(scales)
        return y

    def silu(x):
        y, scales = observed_silu(x, config)
        recorder.record_group(scales)
        return y

    def mul(a, b):
        y, scales = observed_mul(a, b, config)
        recorder.record_group(scales)
        return y

    def swiglu(gate, up):
        y, scales = observed_swiglu(gate, up, config)
        recorder.record_group(scales)
        return y

    if precision == "fp8":
        return plain._replace(linear=linear)
    fused = swiglu if config.swiglu == "fused" else None
    return OpSet(
        precision, linear=linear, rmsnorm=rmsnorm, silu=silu, mul=mul, add=fp8_add, swiglu=fused
    )


def recorded_attention_linear(config: FP8Config, recorder: ScaleRecorder):
    """Causal :func:`fp8_attention_linear` ``(q, k, v, w) -> out`` that hands ``recorder`` the
    1xG scales of the q, k and v it keeps, then the o_proj input's per-tensor scale (the order
    of :func:`recorded_attention` followed by the linear)."""

    def attention_linear(q, k, v, w):
        out, (group, linear_scale) = observed_attention_linear(q, k, v, w, True, config)
        recorder.record_group(group)
        recorder.record_linear(linear_scale)
        return out

    return attention_linear


def recorded_attention(config: FP8Config, recorder: ScaleRecorder):
    """Causal ``fp8_attention`` ``(q, k, v) -> out`` that hands ``recorder`` the 1xG scales of
    the q, k and v it keeps (``Llama(fp8_attention=True)`` under the activation telemetry)."""

    def attention(q, k, v):
        # No segment ids: attention within documents runs without the telemetry.
        out, scales = observed_attention(q, k, v, True, config, None, None)
        recorder.record_group(scales)
        return out

    return attention


def _bound(op, config: FP8Config):
    """``op(*args, config)``: an FP8 op with its static config bound, carrying ``op``'s name and
    docstring (``help(ops_for("coat").linear)`` shows ``fp8_linear``'s)."""

    def bound(*args):
        return op(*args, config)

    return functools.update_wrapper(bound, op)


def _bound_rmsnorm(config: FP8Config):
    """:func:`fp8_rmsnorm` with ``config`` bound and the plain op's ``eps`` default."""

    def rmsnorm(x, weight, eps=1e-6):
        return fp8_rmsnorm(x, weight, float(eps), config)

    return functools.update_wrapper(rmsnorm, fp8_rmsnorm)


def _bound_norm_linear(config: FP8Config):
    """:func:`fp8_rmsnorm_rowwise_linear` with ``config`` bound (``eps`` a Python float)."""

    def norm_linear(x, weight, eps, w):
        return fp8_rmsnorm_rowwise_linear(x, weight, w, float(eps), config)

    return functools.update_wrapper(norm_linear, fp8_rmsnorm_rowwise_linear)

"""Row-quantizing producers in plain jnp: the numerics contract and the CPU path."""

from __future__ import annotations

import jax

from pallas_kernels import quant
from pallas_kernels.fp8_act.reference import rmsnorm_fwd_reference, swiglu_fwd_reference
from pallas_kernels.quant import QuantizedTensor


def quantize_rows_reference(y: jax.Array, *, fmt: str = "e4m3") -> QuantizedTensor:
    """``y [..., D]`` as E4M3 (or ``fmt``) codes with one float32 absmax scale per row
    (``scale [..., 1]``, one group of ``D``): the operand of a row-wise scaled FP8 GEMM."""
    return quant.quantize_absmax(y, group_size=y.shape[-1], fmt=fmt)


def rmsnorm_rowwise_reference(
    x, w, eps: float, *, group_size: int = 16, fmt: str = "e4m3", scale_format: str = "float32"
):
    """``(y_q, x_q, rstd)``: the RMSNorm output ``y`` (rounded to ``x.dtype``, as
    :func:`~pallas_kernels.fp8_act.rmsnorm_fwd_reference` writes it) quantized per row, ``x``
    quantized 1xG for the norm's backward, and ``rstd [..., 1]`` float32."""
    y, x_q, rstd = rmsnorm_fwd_reference(
        x, w, eps, group_size=group_size, fmt=fmt, scale_format=scale_format
    )
    return quantize_rows_reference(y, fmt=fmt), x_q, rstd


def swiglu_rowwise_reference(
    gate, up, *, group_size: int = 16, fmt: str = "e4m3", scale_format: str = "float32"
):
    """``(h_q, gate_q, up_q)``: ``h = silu(gate) * up`` (rounded to the inputs' dtype) quantized
    per row, and ``gate``, ``up`` quantized 1xG for SwiGLU's backward."""
    h, gate_q, up_q = swiglu_fwd_reference(
        gate, up, group_size=group_size, fmt=fmt, scale_format=scale_format
    )
    return quantize_rows_reference(h, fmt=fmt), gate_q, up_q

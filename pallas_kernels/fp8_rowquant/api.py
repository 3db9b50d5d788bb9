"""The row-quantizing producers' public entry points and the choice of implementation (through
:func:`pallas_kernels.dispatch.dispatch`)."""

from __future__ import annotations

from pallas_kernels import quant
from pallas_kernels.dispatch import dispatch_tiled
from pallas_kernels.fp8_quant import DEFAULT_TILES
from pallas_kernels.fp8_rowquant.pallas_triton import (
    rmsnorm_rowwise_pallas,
    swiglu_rowwise_pallas,
)
from pallas_kernels.fp8_rowquant.reference import (
    rmsnorm_rowwise_reference,
    swiglu_rowwise_reference,
)
from pallas_kernels.sharding import KernelMesh


def rmsnorm_rowwise(
    x,
    w,
    eps: float,
    *,
    group_size=16,
    fmt="e4m3",
    scale_format="float32",
    implementation="auto",
    interpret=False,
    tiles=DEFAULT_TILES,
    mesh: KernelMesh | None = None,
):
    """RMSNorm whose output comes out quantized per row: ``(y_q, x_q, rstd [..., 1])``, ``y_q``
    with one float32 scale per row, ``x_q`` the 1xG input the norm's backward reads
    (:func:`pallas_kernels.fp8_act.rmsnorm_bwd`)."""
    settings = quant.group_settings(group_size, fmt, scale_format)
    kernels = (rmsnorm_rowwise_pallas, rmsnorm_rowwise_reference)
    launch = dict(implementation=implementation, interpret=interpret, tiles=tiles, mesh=mesh)
    return dispatch_tiled("rmsnorm_rowwise", *kernels, (x, w, eps), settings, **launch)


def swiglu_rowwise(
    gate,
    up,
    *,
    group_size=16,
    fmt="e4m3",
    scale_format="float32",
    implementation="auto",
    interpret=False,
    tiles=DEFAULT_TILES,
    mesh: KernelMesh | None = None,
):
    """``silu(gate) * up`` quantized per row: ``(h_q, gate_q, up_q)``, the 1xG gate and up
    being what SwiGLU's backward reads (:func:`pallas_kernels.fp8_act.swiglu_bwd`)."""
    settings = quant.group_settings(group_size, fmt, scale_format)
    kernels = (swiglu_rowwise_pallas, swiglu_rowwise_reference)
    launch = dict(implementation=implementation, interpret=interpret, tiles=tiles, mesh=mesh)
    return dispatch_tiled("swiglu_rowwise", *kernels, (gate, up), settings, **launch)

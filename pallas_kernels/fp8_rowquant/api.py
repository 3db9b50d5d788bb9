"""The row-quantizing producers' public entry points and the choice of implementation (through
:func:`pallas_kernels.dispatch.dispatch`)."""

from __future__ import annotations

from pallas_kernels import quant
from pallas_kernels.dispatch import dispatch
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


def _checked(fmt, scale_format, group_size):
    quant.fp8_format(fmt)
    quant.check_scale_format(scale_format)
    quant.check_group_size(group_size)
    return dict(group_size=group_size, fmt=fmt, scale_format=scale_format)


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
    kw = _checked(fmt, scale_format, group_size)
    return dispatch(
        "rmsnorm_rowwise",
        implementation,
        interpret=interpret,
        mesh=mesh,
        pallas=lambda: rmsnorm_rowwise_pallas(
            x, w, eps, **kw, tiles=tiles, interpret=interpret, mesh=mesh
        ),
        xla=lambda: rmsnorm_rowwise_reference(x, w, eps, **kw),
    )[1]


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
    kw = _checked(fmt, scale_format, group_size)
    return dispatch(
        "swiglu_rowwise",
        implementation,
        interpret=interpret,
        mesh=mesh,
        pallas=lambda: swiglu_rowwise_pallas(
            gate, up, **kw, tiles=tiles, interpret=interpret, mesh=mesh
        ),
        xla=lambda: swiglu_rowwise_reference(gate, up, **kw),
    )[1]

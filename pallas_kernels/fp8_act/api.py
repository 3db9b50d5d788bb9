"""The FP8 activation ops' public entry points and the choice of implementation (through
:func:`pallas_kernels.dispatch.dispatch`)."""

from __future__ import annotations

from pallas_kernels import quant
from pallas_kernels.dispatch import dispatch
from pallas_kernels.fp8_act.pallas_triton import (
    mul_bwd_pallas,
    mul_fwd_pallas,
    rmsnorm_bwd_pallas,
    rmsnorm_fwd_pallas,
    silu_bwd_pallas,
    silu_fwd_pallas,
    swiglu_bwd_pallas,
    swiglu_fwd_pallas,
)
from pallas_kernels.fp8_act.reference import (
    check_saved,
    mul_bwd_reference,
    mul_fwd_reference,
    rmsnorm_bwd_reference,
    rmsnorm_fwd_reference,
    silu_bwd_reference,
    silu_fwd_reference,
    swiglu_bwd_reference,
    swiglu_fwd_reference,
)
from pallas_kernels.fp8_quant import DEFAULT_TILES
from pallas_kernels.quant import QuantizedTensor
from pallas_kernels.sharding import KernelMesh


def _run(op, implementation, interpret, mesh, pallas, xla):
    return dispatch(op, implementation, interpret=interpret, mesh=mesh, pallas=pallas, xla=xla)[1]


def rmsnorm_fwd(
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
    """Fused RMSNorm forward + 1xG quantization of ``x``: ``(y, x_q, rstd [..., 1])``."""
    quant.fp8_format(fmt)
    quant.check_scale_format(scale_format)
    kw = dict(group_size=group_size, fmt=fmt, scale_format=scale_format)
    return _run(
        "rmsnorm_fwd",
        implementation,
        interpret,
        mesh,
        lambda: rmsnorm_fwd_pallas(x, w, eps, **kw, tiles=tiles, interpret=interpret, mesh=mesh),
        lambda: rmsnorm_fwd_reference(x, w, eps, **kw),
    )


def rmsnorm_bwd(
    dy,
    x_q: QuantizedTensor,
    rstd,
    w,
    *,
    implementation="auto",
    interpret=False,
    tiles=DEFAULT_TILES,
    mesh: KernelMesh | None = None,
):
    """RMSNorm backward from the saved FP8 input ``x_q`` and ``rstd``: ``(dx, dw)``."""
    check_saved("rmsnorm_bwd", x_q)
    return _run(
        "rmsnorm_bwd",
        implementation,
        interpret,
        mesh,
        lambda: rmsnorm_bwd_pallas(dy, x_q, rstd, w, tiles=tiles, interpret=interpret, mesh=mesh),
        lambda: rmsnorm_bwd_reference(dy, x_q, rstd, w),
    )


def silu_fwd(
    x,
    *,
    group_size=16,
    fmt="e4m3",
    scale_format="float32",
    implementation="auto",
    interpret=False,
    tiles=DEFAULT_TILES,
    mesh: KernelMesh | None = None,
):
    """Fused SiLU forward + 1xG quantization of ``x``: ``(y, x_q)``."""
    quant.fp8_format(fmt)
    quant.check_scale_format(scale_format)
    kw = dict(group_size=group_size, fmt=fmt, scale_format=scale_format)
    return _run(
        "silu_fwd",
        implementation,
        interpret,
        mesh,
        lambda: silu_fwd_pallas(x, **kw, tiles=tiles, interpret=interpret, mesh=mesh),
        lambda: silu_fwd_reference(x, **kw),
    )


def silu_bwd(
    dy,
    x_q: QuantizedTensor,
    *,
    implementation="auto",
    interpret=False,
    tiles=DEFAULT_TILES,
    mesh: KernelMesh | None = None,
):
    """SiLU backward from the saved FP8 input ``x_q``: ``dx``."""
    check_saved("silu_bwd", x_q)
    return _run(
        "silu_bwd",
        implementation,
        interpret,
        mesh,
        lambda: silu_bwd_pallas(dy, x_q, tiles=tiles, interpret=interpret, mesh=mesh),
        lambda: silu_bwd_reference(dy, x_q),
    )


def mul_fwd(
    a,
    b,
    *,
    group_size=16,
    fmt="e4m3",
    scale_format="float32",
    implementation="auto",
    interpret=False,
    tiles=DEFAULT_TILES,
    mesh: KernelMesh | None = None,
):
    """Fused product + 1xG quantization of both inputs: ``(y, a_q, b_q)``."""
    quant.fp8_format(fmt)
    quant.check_scale_format(scale_format)
    kw = dict(group_size=group_size, fmt=fmt, scale_format=scale_format)
    return _run(
        "mul_fwd",
        implementation,
        interpret,
        mesh,
        lambda: mul_fwd_pallas(a, b, **kw, tiles=tiles, interpret=interpret, mesh=mesh),
        lambda: mul_fwd_reference(a, b, **kw),
    )


def mul_bwd(
    dy,
    a_q: QuantizedTensor,
    b_q: QuantizedTensor,
    *,
    implementation="auto",
    interpret=False,
    tiles=DEFAULT_TILES,
    mesh: KernelMesh | None = None,
):
    """Product backward from the saved FP8 inputs ``a_q``, ``b_q``: ``(da, db)``."""
    check_saved("mul_bwd", a_q, b_q)
    return _run(
        "mul_bwd",
        implementation,
        interpret,
        mesh,
        lambda: mul_bwd_pallas(dy, a_q, b_q, tiles=tiles, interpret=interpret, mesh=mesh),
        lambda: mul_bwd_reference(dy, a_q, b_q),
    )


def swiglu_fwd(
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
    """Fused ``silu(gate) * up`` + 1xG quantization of both inputs: ``(y, gate_q, up_q)`` (the
    SiLU is recomputed in backward)."""
    quant.fp8_format(fmt)
    quant.check_scale_format(scale_format)
    kw = dict(group_size=group_size, fmt=fmt, scale_format=scale_format)
    return _run(
        "swiglu_fwd",
        implementation,
        interpret,
        mesh,
        lambda: swiglu_fwd_pallas(gate, up, **kw, tiles=tiles, interpret=interpret, mesh=mesh),
        lambda: swiglu_fwd_reference(gate, up, **kw),
    )


def swiglu_bwd(
    dy,
    gate_q: QuantizedTensor,
    up_q: QuantizedTensor,
    *,
    implementation="auto",
    interpret=False,
    tiles=DEFAULT_TILES,
    mesh: KernelMesh | None = None,
):
    """SwiGLU backward from the saved FP8 gate and up: ``(d gate, d up)``."""
    check_saved("swiglu_bwd", gate_q, up_q)
    return _run(
        "swiglu_bwd",
        implementation,
        interpret,
        mesh,
        lambda: swiglu_bwd_pallas(dy, gate_q, up_q, tiles=tiles, interpret=interpret, mesh=mesh),
        lambda: swiglu_bwd_reference(dy, gate_q, up_q),
    )

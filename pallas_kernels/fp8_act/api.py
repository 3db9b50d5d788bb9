"""The FP8 activation ops' public entry points and the choice of implementation (through
:func:`pallas_kernels.dispatch.dispatch`)."""

from __future__ import annotations

from pallas_kernels import quant
from pallas_kernels.dispatch import dispatch_tiled
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

_KERNELS = {
    "rmsnorm_fwd": (rmsnorm_fwd_pallas, rmsnorm_fwd_reference),
    "rmsnorm_bwd": (rmsnorm_bwd_pallas, rmsnorm_bwd_reference),
    "silu_fwd": (silu_fwd_pallas, silu_fwd_reference),
    "silu_bwd": (silu_bwd_pallas, silu_bwd_reference),
    "mul_fwd": (mul_fwd_pallas, mul_fwd_reference),
    "mul_bwd": (mul_bwd_pallas, mul_bwd_reference),
    "swiglu_fwd": (swiglu_fwd_pallas, swiglu_fwd_reference),
    "swiglu_bwd": (swiglu_bwd_pallas, swiglu_bwd_reference),
}


def _run(op, args, settings, implementation, interpret, tiles, mesh):
    """The op's kernel or reference (:func:`~pallas_kernels.dispatch.dispatch_tiled`)."""
    pallas, reference = _KERNELS[op]
    kw = dict(implementation=implementation, interpret=interpret, tiles=tiles, mesh=mesh)
    return dispatch_tiled(op, pallas, reference, args, settings, **kw)


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
    settings = quant.group_settings(group_size, fmt, scale_format)
    return _run("rmsnorm_fwd", (x, w, eps), settings, implementation, interpret, tiles, mesh)


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
    return _run("rmsnorm_bwd", (dy, x_q, rstd, w), {}, implementation, interpret, tiles, mesh)


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
    settings = quant.group_settings(group_size, fmt, scale_format)
    return _run("silu_fwd", (x,), settings, implementation, interpret, tiles, mesh)


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
    return _run("silu_bwd", (dy, x_q), {}, implementation, interpret, tiles, mesh)


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
    settings = quant.group_settings(group_size, fmt, scale_format)
    return _run("mul_fwd", (a, b), settings, implementation, interpret, tiles, mesh)


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
    return _run("mul_bwd", (dy, a_q, b_q), {}, implementation, interpret, tiles, mesh)


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
    settings = quant.group_settings(group_size, fmt, scale_format)
    return _run("swiglu_fwd", (gate, up), settings, implementation, interpret, tiles, mesh)


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
    return _run("swiglu_bwd", (dy, gate_q, up_q), {}, implementation, interpret, tiles, mesh)

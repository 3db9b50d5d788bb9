"""Non-linear ops of COAT's precision flow fused with their 1xG FP8 quantization, fwd and bwd.

Each op computes its forward output from the exact (BF16) input in float32 and, in the same pass,
writes the FP8 E4M3 codes and 1xG scales (float32, or one-byte powers of two with
``scale_format="e8m0"``) of the input(s) that its backward needs, as one
:class:`pallas_kernels.quant.QuantizedTensor` per input; the backward takes those quantized
tensors instead of a BF16 copy (docs/design.md, 'The precision flow'):

* RMSNorm: ``y = w * (x * rsqrt(mean(x^2) + eps))`` (Hugging Face Llama's rounding); saves
  FP8 ``x`` and the float32 per-row ``rsqrt`` (one number per row, 1/D of the activation).
* SiLU: ``y = x * sigmoid(x)``; saves FP8 ``x``.
* product: ``y = a * b``; saves FP8 ``a`` and FP8 ``b``.
* SwiGLU (beyond COAT's op list): ``y = silu(gate) * up``; saves FP8 ``gate`` and ``up`` only and
  recomputes the SiLU in backward, so the SiLU output is never kept.

Every op has a plain-jnp ``*_reference`` (the CPU path and the numerics contract) and a Pallas
Triton kernel; the public entry points (``rmsnorm_fwd``, ``rmsnorm_bwd``, ``silu_fwd``, ...) take
``implementation="auto" | "xla" | "pallas"``, ``interpret`` and ``mesh`` like the quantizers in
:mod:`pallas_kernels.fp8_quant`, whose tile layout (``[M, D / G, G]`` tiles) they share, and go
through the one dispatcher (:func:`pallas_kernels._dispatch.dispatch`). The kernels need ``D`` to
be a multiple of ``G``, and RMSNorm's, which hold whole rows, ``D / G`` to be a power of two;
:func:`pallas_supports` says whether a shape fits. A kernel raises ``NotImplementedError`` for
a shape it does not take, so ``"auto"`` runs the reference there and ``"pallas"`` raises a
``ValueError`` naming the shape.

With ``mesh`` (a :class:`~pallas_kernels.sharding.KernelMesh`) the kernels run on each batch
shard of activations split along their leading axis: per row and per group, they need nothing
from other shards, except RMSNorm's weight gradient (a ``psum`` of the shards' partial sums).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import quant
from pallas_kernels._dispatch import dispatch, require_gpu
from pallas_kernels.fp8_quant import (
    DEFAULT_TILES,
    group_quantize_tile,
    grouped_view,
    per_group,
    pow2_divisor,
    quantize_per_group_reference,
    tiles_for,
)
from pallas_kernels.quant import QuantizedTensor
from pallas_kernels.sharding import KernelMesh, over_batch

OPS = ("rmsnorm", "silu", "mul", "swiglu")


def pallas_supports(op: str, shape: tuple[int, ...], group_size: int = 16) -> bool:
    """Whether the Pallas kernels of ``op`` handle an input of ``shape``."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; valid ops are {list(OPS)}")
    if len(shape) == 0 or shape[-1] % group_size:
        return False
    groups = shape[-1] // group_size
    return op != "rmsnorm" or groups & (groups - 1) == 0


def _check_supported(op: str, shape, group_size: int) -> None:
    """``NotImplementedError`` for a shape the Pallas kernels of ``op`` do not take."""
    if not pallas_supports(op, tuple(shape), group_size):
        raise NotImplementedError(
            f"the Pallas {op} kernels do not take shape {tuple(shape)} with group_size "
            f"{group_size}: they need the last axis a multiple of the group size"
            + (" and a power-of-two number of groups" if op == "rmsnorm" else "")
        )


def _check_saved(op: str, *saved) -> None:
    """``TypeError`` unless ``saved`` are the quantized tensors the forward of ``op`` returned."""
    for q in saved:
        if not isinstance(q, QuantizedTensor):
            raise TypeError(
                f"{op} takes the QuantizedTensor(s) its forward returned (codes and scales in "
                f"one), got {type(q).__name__}"
            )


def _kernel_groups(op: str, *saved: QuantizedTensor) -> int:
    """The group size of 1xG absmax ``saved`` (one for all); ``NotImplementedError`` for any
    other layout, which the reference dequantizes instead."""
    sizes = {q.group_size for q in saved}
    if any(q.granularity != "group" or q.expansion for q in saved) or len(sizes) != 1:
        raise NotImplementedError(
            f"the Pallas {op} kernel reads 1xG absmax codes of one group size, got "
            + ", ".join(repr(q) for q in saved)
        )
    return sizes.pop()


# --------------------------------------------------------------------------------------------
# references


def rmsnorm_fwd_reference(
    x, w, eps: float, *, group_size: int = 16, fmt: str = "e4m3", scale_format: str = "float32"
):
    """``(y, x_q, rstd)``: ``y`` in ``x.dtype``, ``x_q`` the 1xG quantized ``x``, ``rstd [..., 1]``
    float32."""
    x32 = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    y = w.astype(x.dtype) * (x32 * rstd).astype(x.dtype)
    return (
        y,
        quantize_per_group_reference(x, group_size=group_size, fmt=fmt, scale_format=scale_format),
        rstd,
    )


def rmsnorm_bwd_reference(dy, x_q: QuantizedTensor, rstd, w):
    """``(dx in dy.dtype, dw in w.dtype)`` from the saved FP8 input."""
    n = x_q.dequantize() * rstd
    dy32 = dy.astype(jnp.float32)
    # The forward rounds the normalized value to x.dtype before the weight multiply.
    n_rounded = n.astype(dy.dtype).astype(jnp.float32)
    dw = jnp.sum((dy32 * n_rounded).reshape(-1, n.shape[-1]), axis=0)
    dn = dy32 * w.astype(dy.dtype).astype(jnp.float32)
    dx = rstd * (dn - n * jnp.mean(dn * n, axis=-1, keepdims=True))
    return dx.astype(dy.dtype), dw.astype(w.dtype)


def silu32(x32):
    # exp rather than lax.logistic so that the kernel and the reference share one formula.
    return x32 / (1.0 + jnp.exp(-x32))


def silu_fwd_reference(
    x, *, group_size: int = 16, fmt: str = "e4m3", scale_format: str = "float32"
):
    """``(y, x_q)``: ``y = silu(x)`` in float32 math, output in ``x.dtype``; ``x_q`` the 1xG
    quantized ``x``."""
    y = silu32(x.astype(jnp.float32)).astype(x.dtype)
    return y, quantize_per_group_reference(
        x, group_size=group_size, fmt=fmt, scale_format=scale_format
    )


def silu_grad(x32):
    sig = 1.0 / (1.0 + jnp.exp(-x32))
    return sig * (1.0 + x32 * (1.0 - sig))


def silu_bwd_reference(dy, x_q: QuantizedTensor):
    x = x_q.dequantize()
    return (dy.astype(jnp.float32) * silu_grad(x)).astype(dy.dtype)


def swiglu_fwd_reference(
    gate, up, *, group_size: int = 16, fmt: str = "e4m3", scale_format: str = "float32"
):
    """``(y, gate_q, up_q)``, ``y = silu(gate) * up``, with both inputs 1xG quantized."""
    g32, u32 = gate.astype(jnp.float32), up.astype(jnp.float32)
    y = (silu32(g32) * u32).astype(jnp.result_type(gate, up))
    return (
        y,
        quantize_per_group_reference(
            gate, group_size=group_size, fmt=fmt, scale_format=scale_format
        ),
        quantize_per_group_reference(up, group_size=group_size, fmt=fmt, scale_format=scale_format),
    )


def swiglu_grads(dy32, g32, u32):
    """``(d gate, d up)`` of ``silu(gate) * up`` in float32."""
    sig = 1.0 / (1.0 + jnp.exp(-g32))
    return dy32 * u32 * sig * (1.0 + g32 * (1.0 - sig)), dy32 * g32 * sig


def swiglu_bwd_reference(dy, gate_q: QuantizedTensor, up_q: QuantizedTensor):
    dg, du = swiglu_grads(dy.astype(jnp.float32), gate_q.dequantize(), up_q.dequantize())
    return dg.astype(dy.dtype), du.astype(dy.dtype)


def mul_fwd_reference(
    a, b, *, group_size: int = 16, fmt: str = "e4m3", scale_format: str = "float32"
):
    """``(y, a_q, b_q)`` with ``y = a * b`` in the inputs' dtype, both inputs 1xG quantized."""
    y = (a.astype(jnp.float32) * b.astype(jnp.float32)).astype(jnp.result_type(a, b))
    return (
        y,
        quantize_per_group_reference(a, group_size=group_size, fmt=fmt, scale_format=scale_format),
        quantize_per_group_reference(b, group_size=group_size, fmt=fmt, scale_format=scale_format),
    )


def mul_bwd_reference(dy, a_q: QuantizedTensor, b_q: QuantizedTensor):
    dy32 = dy.astype(jnp.float32)
    da = dy32 * b_q.dequantize()
    db = dy32 * a_q.dequantize()
    return da.astype(dy.dtype), db.astype(dy.dtype)


# --------------------------------------------------------------------------------------------
# Pallas kernels (tiles of [rows, groups, G]; see the module docstring)


def _rmsnorm_fwd_kernel(x_ref, w_ref, y_ref, q_ref, s_ref, r_ref, *, eps, fmt, scale_format):
    x = x_ref[...].astype(jnp.float32)
    d = x.shape[-2] * x.shape[-1]
    rstd = jax.lax.rsqrt(jnp.sum(jnp.sum(x * x, axis=-1), axis=-1) / d + eps)
    normed = (x * rstd[:, None, None]).astype(y_ref.dtype)
    y_ref[...] = w_ref[...].astype(y_ref.dtype)[None] * normed
    q_ref[...], s_ref[...] = group_quantize_tile(x, fmt, scale_format)
    r_ref[...] = rstd


def _rmsnorm_bwd_kernel(dy_ref, q_ref, s_ref, r_ref, w_ref, dx_ref, dw_ref):
    rstd = r_ref[...][:, None, None]
    n = q_ref[...].astype(jnp.float32) * quant.decode_scale(s_ref[...])[..., None] * rstd
    dy = dy_ref[...].astype(jnp.float32)
    n_rounded = n.astype(dy_ref.dtype).astype(jnp.float32)
    dw_ref[...] = jnp.sum(dy * n_rounded, axis=0)[None]
    dn = dy * w_ref[...].astype(dy_ref.dtype).astype(jnp.float32)[None]
    d = n.shape[-2] * n.shape[-1]
    c = jnp.sum(jnp.sum(dn * n, axis=-1), axis=-1) / d
    dx_ref[...] = (rstd * (dn - n * c[:, None, None])).astype(dx_ref.dtype)


def _silu_fwd_kernel(x_ref, y_ref, q_ref, s_ref, *, fmt, scale_format):
    x = x_ref[...].astype(jnp.float32)
    y_ref[...] = silu32(x).astype(y_ref.dtype)
    q_ref[...], s_ref[...] = group_quantize_tile(x, fmt, scale_format)


def _silu_bwd_kernel(dy_ref, q_ref, s_ref, dx_ref):
    x = q_ref[...].astype(jnp.float32) * quant.decode_scale(s_ref[...])[..., None]
    dx_ref[...] = (dy_ref[...].astype(jnp.float32) * silu_grad(x)).astype(dx_ref.dtype)


def _mul_fwd_kernel(a_ref, b_ref, y_ref, qa_ref, sa_ref, qb_ref, sb_ref, *, fmt, scale_format):
    a = a_ref[...].astype(jnp.float32)
    b = b_ref[...].astype(jnp.float32)
    y_ref[...] = (a * b).astype(y_ref.dtype)
    qa_ref[...], sa_ref[...] = group_quantize_tile(a, fmt, scale_format)
    qb_ref[...], sb_ref[...] = group_quantize_tile(b, fmt, scale_format)


def _mul_bwd_kernel(dy_ref, qa_ref, sa_ref, qb_ref, sb_ref, da_ref, db_ref):
    dy = dy_ref[...].astype(jnp.float32)
    a = qa_ref[...].astype(jnp.float32) * quant.decode_scale(sa_ref[...])[..., None]
    b = qb_ref[...].astype(jnp.float32) * quant.decode_scale(sb_ref[...])[..., None]
    da_ref[...] = (dy * b).astype(da_ref.dtype)
    db_ref[...] = (dy * a).astype(db_ref.dtype)


def _swiglu_fwd_kernel(g_ref, u_ref, y_ref, qg_ref, sg_ref, qu_ref, su_ref, *, fmt, scale_format):
    g = g_ref[...].astype(jnp.float32)
    u = u_ref[...].astype(jnp.float32)
    y_ref[...] = (silu32(g) * u).astype(y_ref.dtype)
    qg_ref[...], sg_ref[...] = group_quantize_tile(g, fmt, scale_format)
    qu_ref[...], su_ref[...] = group_quantize_tile(u, fmt, scale_format)


def _swiglu_bwd_kernel(dy_ref, qg_ref, sg_ref, qu_ref, su_ref, dg_ref, du_ref):
    g = qg_ref[...].astype(jnp.float32) * quant.decode_scale(sg_ref[...])[..., None]
    u = qu_ref[...].astype(jnp.float32) * quant.decode_scale(su_ref[...])[..., None]
    dg, du = swiglu_grads(dy_ref[...].astype(jnp.float32), g, u)
    dg_ref[...] = dg.astype(dg_ref.dtype)
    du_ref[...] = du.astype(du_ref.dtype)


def _elementwise_call(kernel, name, inputs, outputs, group_size, tiles, interpret):
    """Runs ``kernel`` over ``[bm, bg, G]`` tiles of same-shaped ``inputs``.

    ``inputs`` and ``outputs`` are lists of ``("x", array-or-ShapeDtypeStruct)`` (a full tensor
    ``[..., D]``) or ``("s", ...)`` (its 1xG scales ``[..., D / G]``); outputs come back in the
    same layouts, reshaped to the first input's leading shape.
    """
    full = next(a for kind, a in inputs if kind == "x")
    grouped_view(full, group_size)  # NotImplementedError for a ragged last axis
    require_gpu(interpret)
    lead, d = full.shape[:-1], full.shape[-1]
    m, g = full.size // d, d // group_size
    bm, bg = tiles_for(m, g, tiles)

    def spec(kind):
        if kind == "x":
            return pl.BlockSpec((bm, bg, group_size), lambda i, j: (i, j, 0))
        return pl.BlockSpec((bm, bg), lambda i, j: (i, j))

    def view(kind, a):
        return grouped_view(a, group_size) if kind == "x" else a.reshape(m, g)

    def out_struct(kind, dtype):
        shape = (m, g, group_size) if kind == "x" else (m, g)
        return jax.ShapeDtypeStruct(shape, dtype)

    results = pl.pallas_call(
        kernel,
        grid=(m // bm, g // bg),
        in_specs=[spec(kind) for kind, _ in inputs],
        out_specs=[spec(kind) for kind, _ in outputs],
        out_shape=[out_struct(kind, dtype) for kind, dtype in outputs],
        compiler_params=tiles.compiler_params(),
        interpret=interpret,
        name=name,
    )(*[view(kind, a) for kind, a in inputs])
    return [
        r.reshape(*lead, d) if kind == "x" else r.reshape(*lead, g)
        for (kind, _), r in zip(outputs, results, strict=True)
    ]


def _row_specs(bm, g, group_size):
    return (
        pl.BlockSpec((bm, g, group_size), lambda i: (i, 0, 0)),
        pl.BlockSpec((bm, g), lambda i: (i, 0)),
        pl.BlockSpec((bm,), lambda i: (i,)),
        pl.BlockSpec((g, group_size), lambda i: (0, 0)),
    )


@over_batch("br", "bbb")
def rmsnorm_fwd_pallas(
    x,
    w,
    eps,
    *,
    group_size=16,
    fmt="e4m3",
    scale_format="float32",
    tiles=DEFAULT_TILES,
    interpret=False,
):
    _check_supported("rmsnorm", x.shape, group_size)
    require_gpu(interpret)
    x3 = grouped_view(x, group_size)
    m, g, _ = x3.shape
    bm = pow2_divisor(m, tiles.norm_block_rows)
    full, scales, rows, weight = _row_specs(bm, g, group_size)
    y, codes, scale, rstd = pl.pallas_call(
        functools.partial(_rmsnorm_fwd_kernel, eps=float(eps), fmt=fmt, scale_format=scale_format),
        grid=(m // bm,),
        in_specs=[full, weight],
        out_specs=[full, full, scales, rows],
        out_shape=[
            jax.ShapeDtypeStruct(x3.shape, x.dtype),
            jax.ShapeDtypeStruct(x3.shape, quant.FORMATS[fmt]),
            jax.ShapeDtypeStruct((m, g), quant.SCALE_DTYPES[scale_format]),
            jax.ShapeDtypeStruct((m,), jnp.float32),
        ],
        compiler_params=tiles.norm_compiler_params(),
        interpret=interpret,
        name="fp8_rmsnorm_fwd",
    )(x3, w.reshape(g, group_size))
    lead = x.shape[:-1]
    x_q = per_group(codes.reshape(x.shape), scale.reshape(*lead, g), fmt=fmt, group_size=group_size)
    return y.reshape(x.shape), x_q, rstd.reshape(*lead, 1)


@over_batch("bbbr", "bs")
def rmsnorm_bwd_pallas(dy, x_q, rstd, w, *, tiles=DEFAULT_TILES, interpret=False):
    group_size = _kernel_groups("rmsnorm_bwd", x_q)
    _check_supported("rmsnorm", dy.shape, group_size)
    require_gpu(interpret)
    dy3 = grouped_view(dy, group_size)
    m, g, _ = dy3.shape
    bm = pow2_divisor(m, tiles.norm_block_rows)
    full, scales, rows, weight = _row_specs(bm, g, group_size)
    dx, dw_parts = pl.pallas_call(
        _rmsnorm_bwd_kernel,
        grid=(m // bm,),
        in_specs=[full, full, scales, rows, weight],
        out_specs=[full, pl.BlockSpec((1, g, group_size), lambda i: (i, 0, 0))],
        out_shape=[
            jax.ShapeDtypeStruct(dy3.shape, dy.dtype),
            jax.ShapeDtypeStruct((m // bm, g, group_size), jnp.float32),
        ],
        compiler_params=tiles.norm_compiler_params(),
        interpret=interpret,
        name="fp8_rmsnorm_bwd",
    )(
        dy3,
        grouped_view(x_q.codes, group_size),
        x_q.scale.reshape(m, g),
        rstd.reshape(m),
        w.reshape(g, group_size),
    )
    dw = jnp.sum(dw_parts, axis=0).reshape(w.shape)
    return dx.reshape(dy.shape), dw.astype(w.dtype)


def _fwd_call(
    kernel,
    name,
    inputs,
    out_dtype,
    *,
    group_size=16,
    fmt="e4m3",
    scale_format="float32",
    tiles=DEFAULT_TILES,
    interpret=False,
):
    """``_elementwise_call`` of a forward kernel that writes ``y`` and the 1xG codes and scales
    of each input: ``(y, *quantized inputs)``."""
    fp8, scale_dtype = quant.FORMATS[fmt], quant.SCALE_DTYPES[scale_format]
    y, *saved = _elementwise_call(
        functools.partial(kernel, fmt=fmt, scale_format=scale_format),
        name,
        [("x", x) for x in inputs],
        [("x", out_dtype)] + [("x", fp8), ("s", scale_dtype)] * len(inputs),
        group_size,
        tiles,
        interpret,
    )
    quantized = [
        per_group(codes, scale, fmt=fmt, group_size=group_size)
        for codes, scale in zip(saved[::2], saved[1::2], strict=True)
    ]
    return (y, *quantized)


def _bwd_call(kernel, name, dy, saved, n_out, tiles, interpret):
    """``_elementwise_call`` of a backward kernel reading ``dy`` and the 1xG ``saved``."""
    group_size = _kernel_groups(name, *saved)
    inputs = [("x", dy)] + [part for q in saved for part in (("x", q.codes), ("s", q.scale))]
    return _elementwise_call(
        kernel, name, inputs, [("x", dy.dtype)] * n_out, group_size, tiles, interpret
    )


@over_batch("b", "bb")
def silu_fwd_pallas(x, **quantize):
    """Keywords: ``_fwd_call``'s (group_size, fmt, scale_format, tiles, interpret)."""
    return _fwd_call(_silu_fwd_kernel, "fp8_silu_fwd", [x], x.dtype, **quantize)


@over_batch("bb", "b")
def silu_bwd_pallas(dy, x_q, *, tiles=DEFAULT_TILES, interpret=False):
    (dx,) = _bwd_call(_silu_bwd_kernel, "fp8_silu_bwd", dy, [x_q], 1, tiles, interpret)
    return dx


@over_batch("bb", "bbb")
def mul_fwd_pallas(a, b, **quantize):
    return _fwd_call(_mul_fwd_kernel, "fp8_mul_fwd", [a, b], jnp.result_type(a, b), **quantize)


@over_batch("bb", "bbb")
def swiglu_fwd_pallas(gate, up, **quantize):
    out_dtype = jnp.result_type(gate, up)
    return _fwd_call(_swiglu_fwd_kernel, "fp8_swiglu_fwd", [gate, up], out_dtype, **quantize)


@over_batch("bbb", "bb")
def swiglu_bwd_pallas(dy, gate_q, up_q, *, tiles=DEFAULT_TILES, interpret=False):
    dg, du = _bwd_call(
        _swiglu_bwd_kernel, "fp8_swiglu_bwd", dy, [gate_q, up_q], 2, tiles, interpret
    )
    return dg, du


@over_batch("bbb", "bb")
def mul_bwd_pallas(dy, a_q, b_q, *, tiles=DEFAULT_TILES, interpret=False):
    da, db = _bwd_call(_mul_bwd_kernel, "fp8_mul_bwd", dy, [a_q, b_q], 2, tiles, interpret)
    return da, db


# --------------------------------------------------------------------------------------------
# entry points


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
    _check_saved("rmsnorm_bwd", x_q)
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
    _check_saved("silu_bwd", x_q)
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
    _check_saved("mul_bwd", a_q, b_q)
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
    _check_saved("swiglu_bwd", gate_q, up_q)
    return _run(
        "swiglu_bwd",
        implementation,
        interpret,
        mesh,
        lambda: swiglu_bwd_pallas(dy, gate_q, up_q, tiles=tiles, interpret=interpret, mesh=mesh),
        lambda: swiglu_bwd_reference(dy, gate_q, up_q),
    )

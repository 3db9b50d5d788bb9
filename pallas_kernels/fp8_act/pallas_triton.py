"""The FP8 activation ops' Pallas Triton kernels: one pass that computes the output and quantizes
what the backward keeps."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import quant
from pallas_kernels.dispatch import require_gpu
from pallas_kernels.fp8_act.reference import (
    silu32,
    silu_grad,
    swiglu_grads,
)
from pallas_kernels.fp8_quant import (
    DEFAULT_TILES,
    group_quantize_tile,
    grouped_view,
    per_group,
    pow2_divisor,
    tiles_for,
)
from pallas_kernels.quant import QuantizedTensor
from pallas_kernels.sharding import over_batch

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


def _norm_tiles(x, group_size, tiles, interpret):
    """``x`` as ``[M, D / G, G]`` tiles, the row block and the block specs of the RMSNorm kernels,
    which hold whole rows; ``NotImplementedError`` where they cannot run."""
    _check_supported("rmsnorm", x.shape, group_size)
    require_gpu(interpret)
    x3 = grouped_view(x, group_size)
    bm = pow2_divisor(x3.shape[0], tiles.norm_block_rows)
    return x3, bm, _row_specs(bm, x3.shape[1], group_size)


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
    x3, bm, (full, scales, rows, weight) = _norm_tiles(x, group_size, tiles, interpret)
    m, g, _ = x3.shape
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
    dy3, bm, (full, scales, rows, weight) = _norm_tiles(dy, group_size, tiles, interpret)
    m, g, _ = dy3.shape
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

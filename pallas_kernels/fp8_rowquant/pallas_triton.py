"""Pallas Triton kernels of the row-quantizing producers: one program holds whole rows, so the
row's maximum is finished inside the kernel that computes the row, and the codes are written
in the same launch.

A program takes ``norm_block_rows`` rows of the ``[M, D / G, G]`` view and walks each row in
chunks of ``block_groups`` groups (the largest power of two dividing ``D / G``, as Triton loads
power-of-two tiles): a first walk writes the 1xG codes the backward keeps and reduces the row
(RMSNorm's sum of squares, SwiGLU's maximum), the last writes the row-scaled codes. The later
walks read the same rows again, which the earlier walk has just brought into the cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import quant
from pallas_kernels.dispatch import require_gpu
from pallas_kernels.fp8_act.reference import silu32
from pallas_kernels.fp8_quant import (
    DEFAULT_TILES,
    group_quantize_tile,
    grouped_view,
    per_group,
    pow2_divisor,
)
from pallas_kernels.quant import QuantizedTensor
from pallas_kernels.sharding import over_batch


def _row_max(value_of, n, rows):
    """``max|value_of(j)|`` over the ``n`` chunks of each of ``rows`` rows."""

    def step(j, m):
        return jnp.maximum(m, jnp.max(jnp.max(jnp.abs(value_of(j)), axis=-1), axis=-1))

    return jax.lax.fori_loop(0, n, step, jnp.zeros((rows,), jnp.float32))


def _write_rows(value_of, amax, n, cols, q_ref, s_ref, fmt):
    """Writes the codes of every chunk ``value_of(j)`` scaled by its row's absmax scale."""
    fmax = quant.FP8_MAX[fmt]
    scale = quant.absmax_scale(amax, fmax, "float32")

    def step(j, carry):
        y = value_of(j) / scale[:, None, None]
        q_ref[:, cols(j), :] = jnp.clip(y, -fmax, fmax).astype(quant.FORMATS[fmt])
        return carry

    jax.lax.fori_loop(0, n, step, 0)
    s_ref[...] = scale


def _chunks(chunk):
    return lambda j: pl.ds(pl.multiple_of(j * chunk, chunk), chunk)


def _rmsnorm_kernel(
    x_ref, w_ref, yq_ref, ys_ref, xq_ref, xs_ref, r_ref, *, eps, fmt, scale_format, chunk
):
    rows, g, group = x_ref.shape
    n, cols = g // chunk, _chunks(chunk)
    out_dtype = x_ref.dtype

    def squares(j, acc):
        x = x_ref[:, cols(j), :].astype(jnp.float32)
        xq_ref[:, cols(j), :], xs_ref[:, cols(j)] = group_quantize_tile(x, fmt, scale_format)
        return acc + jnp.sum(jnp.sum(x * x, axis=-1), axis=-1)

    ss = jax.lax.fori_loop(0, n, squares, jnp.zeros((rows,), jnp.float32))
    rstd = jax.lax.rsqrt(ss / (g * group) + eps)
    r_ref[...] = rstd

    def y_of(j):
        normed = (x_ref[:, cols(j), :].astype(jnp.float32) * rstd[:, None, None]).astype(out_dtype)
        return (w_ref[cols(j), :].astype(out_dtype)[None] * normed).astype(jnp.float32)

    _write_rows(y_of, _row_max(y_of, n, rows), n, cols, yq_ref, ys_ref, fmt)


def _swiglu_kernel(
    g_ref, u_ref, hq_ref, hs_ref, gq_ref, gs_ref, uq_ref, us_ref, *, fmt, scale_format, chunk
):
    rows, g, _ = g_ref.shape
    n, cols = g // chunk, _chunks(chunk)
    out_dtype = jnp.result_type(g_ref.dtype, u_ref.dtype)

    def h_of(j):
        gate = g_ref[:, cols(j), :].astype(jnp.float32)
        up = u_ref[:, cols(j), :].astype(jnp.float32)
        return (silu32(gate) * up).astype(out_dtype).astype(jnp.float32)

    def first(j, m):
        gate = g_ref[:, cols(j), :].astype(jnp.float32)
        up = u_ref[:, cols(j), :].astype(jnp.float32)
        gq_ref[:, cols(j), :], gs_ref[:, cols(j)] = group_quantize_tile(gate, fmt, scale_format)
        uq_ref[:, cols(j), :], us_ref[:, cols(j)] = group_quantize_tile(up, fmt, scale_format)
        h = (silu32(gate) * up).astype(out_dtype).astype(jnp.float32)
        return jnp.maximum(m, jnp.max(jnp.max(jnp.abs(h), axis=-1), axis=-1))

    amax = jax.lax.fori_loop(0, n, first, jnp.zeros((rows,), jnp.float32))
    _write_rows(h_of, amax, n, cols, hq_ref, hs_ref, fmt)


def _layout(x3, tiles):
    """The rows of one program and the groups of one chunk, for ``x3 [M, g, G]``."""
    return pow2_divisor(x3.shape[0], tiles.norm_block_rows), pow2_divisor(
        x3.shape[1], tiles.block_groups
    )


def _specs(rows, g, group_size):
    full = pl.BlockSpec((rows, g, group_size), lambda i: (i, 0, 0))
    groups = pl.BlockSpec((rows, g), lambda i: (i, 0))
    per_row = pl.BlockSpec((rows,), lambda i: (i,))
    return full, groups, per_row


def _shapes(m, g, group_size, fmt, scale_format):
    codes = jax.ShapeDtypeStruct((m, g, group_size), quant.FORMATS[fmt])
    scales = jax.ShapeDtypeStruct((m, g), quant.SCALE_DTYPES[scale_format])
    return codes, scales, jax.ShapeDtypeStruct((m,), jnp.float32)


def _rows_q(codes, scale, shape, fmt) -> QuantizedTensor:
    return QuantizedTensor(
        codes.reshape(shape),
        scale.reshape(*shape[:-1], 1),
        fmt=fmt,
        granularity="group",
        group_size=shape[-1],
    )


@over_batch("br", "bbb")
def rmsnorm_rowwise_pallas(
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
    """:func:`~pallas_kernels.fp8_rowquant.rmsnorm_rowwise_reference` in one kernel."""
    x3 = grouped_view(x, group_size)
    require_gpu(interpret)
    m, g, _ = x3.shape
    rows, chunk = _layout(x3, tiles)
    full, groups, per_row = _specs(rows, g, group_size)
    codes, scales, row_f32 = _shapes(m, g, group_size, fmt, scale_format)
    y_codes, y_scale, x_codes, x_scale, rstd = pl.pallas_call(
        functools.partial(
            _rmsnorm_kernel, eps=float(eps), fmt=fmt, scale_format=scale_format, chunk=chunk
        ),
        grid=(m // rows,),
        in_specs=[full, pl.BlockSpec((g, group_size), lambda i: (0, 0))],
        out_specs=[full, per_row, full, groups, per_row],
        out_shape=[codes, row_f32, codes, scales, row_f32],
        compiler_params=tiles.norm_compiler_params(),
        interpret=interpret,
        name="fp8_rmsnorm_rowwise",
    )(x3, w.reshape(g, group_size))
    lead = x.shape[:-1]
    x_q = per_group(
        x_codes.reshape(x.shape), x_scale.reshape(*lead, g), fmt=fmt, group_size=group_size
    )
    return _rows_q(y_codes, y_scale, x.shape, fmt), x_q, rstd.reshape(*lead, 1)


@over_batch("bb", "bbb")
def swiglu_rowwise_pallas(
    gate,
    up,
    *,
    group_size=16,
    fmt="e4m3",
    scale_format="float32",
    tiles=DEFAULT_TILES,
    interpret=False,
):
    """:func:`~pallas_kernels.fp8_rowquant.swiglu_rowwise_reference` in one kernel."""
    if gate.shape != up.shape:
        raise NotImplementedError(
            f"the SwiGLU kernel takes gate and up of one shape, got {gate.shape} and {up.shape}"
        )
    g3, u3 = grouped_view(gate, group_size), grouped_view(up, group_size)
    require_gpu(interpret)
    m, g, _ = g3.shape
    rows, chunk = _layout(g3, tiles)
    full, groups, per_row = _specs(rows, g, group_size)
    codes, scales, row_f32 = _shapes(m, g, group_size, fmt, scale_format)
    h_codes, h_scale, g_codes, g_scale, u_codes, u_scale = pl.pallas_call(
        functools.partial(_swiglu_kernel, fmt=fmt, scale_format=scale_format, chunk=chunk),
        grid=(m // rows,),
        in_specs=[full, full],
        out_specs=[full, per_row, full, groups, full, groups],
        out_shape=[codes, row_f32, codes, scales, codes, scales],
        compiler_params=tiles.norm_compiler_params(),
        interpret=interpret,
        name="fp8_swiglu_rowwise",
    )(g3, u3)
    lead = gate.shape[:-1]

    def saved(c, s):
        return per_group(c.reshape(gate.shape), s.reshape(*lead, g), fmt=fmt, group_size=group_size)

    return (
        _rows_q(h_codes, h_scale, gate.shape, fmt),
        saved(g_codes, g_scale),
        saved(u_codes, u_scale),
    )

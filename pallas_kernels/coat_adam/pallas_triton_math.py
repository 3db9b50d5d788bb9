"""The fused kernel's arithmetic on one tile of groups: dequantize, quantize, and the
element-wise operations whose fast form differs between Triton and interpret mode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels import quant


def _flush(x):
    """``x`` with subnormal values as (signed) zeros: the GPU's flush-to-zero, in jnp."""
    return jnp.where(jnp.abs(x) < jnp.finfo(jnp.float32).tiny, x * 0.0, x)


# The power of two by which a centre's reciprocal is taken (``Math.reciprocal``, ``ftz=False``).
CENTRE_SCALE = 2.0**-4


class Math:
    """Element-wise operations whose fast form differs between Triton and interpret mode.

    ``fast=False`` is the reference's own arithmetic. ``fast=True`` trades a few float32 ulps
    for throughput, since the step is compute-bound with exact arithmetic
    (docs/optimizer_kernel.md): on the GPU, powers go through the approximate
    ``ex2``/``lg2`` instructions and reciprocals, square roots and the update's division through
    ``rcp.approx``/``sqrt.approx``. Interpret mode has no PTX: there the powers run as
    ``exp2(e * log2(a))`` and the divisions as products with the reciprocal in jnp, the rest
    exactly, and the ``.ftz`` forms flush subnormal values as the GPU does. The ``.ftz`` forms
    appear only where the argument or a flushed result cannot matter (noted at each call).
    """

    def __init__(self, fast: bool, native: bool):
        self.fast = fast
        self.native = fast and native

    def _asm(self, instruction, *args):
        """One float32 PTX ``instruction`` per element of ``args`` (broadcast to one shape)."""
        shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in args))
        operands = ", ".join(f"${i}" for i in range(len(args) + 1))
        (out,) = pl_triton.elementwise_inline_asm(
            f"{instruction} {operands};",
            args=[jnp.broadcast_to(x, shape) for x in args],
            constraints=",".join(["=f"] + ["f"] * len(args)),
            pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)],
        )
        return out

    def log2(self, a, *, ftz=False):
        """``log2(a)`` for ``a >= 0`` (``-inf`` at 0), approximate on the GPU (fast math).

        ``ftz``: a subnormal ``a`` reads as 0, as the GPU's ``.ftz`` form does; interpret mode
        flushes the same way, so that CPU tests see what the flush loses.
        """
        if self.native:
            return self._asm("lg2.approx.ftz.f32" if ftz else "lg2.approx.f32", a)
        return jnp.log2(_flush(a) if ftz else a)

    def exp2(self, x, *, ftz=False):
        """``2 ** x`` (``0`` at ``-inf``), approximate on the GPU (fast math); ``ftz``: a
        subnormal result is 0 (interpret mode too)."""
        if self.native:
            return self._asm("ex2.approx.ftz.f32" if ftz else "ex2.approx.f32", x)
        return _flush(jnp.exp2(x)) if ftz else jnp.exp2(x)

    def power(self, a, e, *, ftz_log=False, ftz_exp=False):
        """``a ** e`` for ``a >= 0`` and ``e > 0``; ``lg2(0) = -inf`` and ``ex2(-inf) = 0``."""
        if not self.fast:
            return jnp.power(a, e)
        return self.exp2(e * self.log2(a, ftz=ftz_log), ftz=ftz_exp)

    def reciprocal(self, d, *, ftz=True):
        """``1 / d`` of a normal, per-group or scalar ``d``.

        ``ftz``: the reciprocal may flush to zero, right for a ``d`` below 2**126; a group
        centre may be larger (its subnormal reciprocal, flushed, would turn the group's codes
        into NaN), so it takes ``ftz=False``. Scalars take the exact division: it runs once
        per program, not per element.
        """
        if self.native and jnp.ndim(d) > 0:
            if ftz:
                return self._asm("rcp.approx.ftz.f32", d)
            # Scaled by 2**-4 (exact) for d in [2**-122, 2**128), which holds every centre
            # (at least quant.DRE_TINY): the scaled reciprocal stays normal, and the product, a
            # plain multiply, keeps a subnormal result.
            return self._asm("rcp.approx.ftz.f32", d * CENTRE_SCALE) * CENTRE_SCALE
        return 1.0 / d

    def divide(self, x, d, *, ftz=True, spread=None):
        """``x / d`` for ``d`` constant along the group (a per-group or scalar divisor);
        ``ftz`` as in :meth:`reciprocal`. Interpret mode divides where the reciprocal may not
        flush: a CPU flushes every subnormal value, the GPU's scaled form does not.

        ``spread``: maps a per-group value to ``x``'s shape (e.g. a ``[groups]`` vector to a
        column), applied to the reciprocal, or to ``d`` where it divides: the reciprocal is
        taken once per group either way."""
        spread = spread or (lambda v: v)
        if not self.fast or (not ftz and not self.native):
            return x / spread(d)
        return x * spread(self.reciprocal(d, ftz=ftz))

    def adam_direction(self, m_hat, v_hat, eps):
        """``m_hat / (sqrt(v_hat) + eps)``."""
        if not self.native:
            # (No flush here: it could move the quotient by rounding only.)
            return m_hat / (jnp.sqrt(v_hat) + eps)
        # sqrt.approx maps +0 to +0 and rcp.approx.ftz is exact enough for eps-sized values.
        return m_hat * self._asm("rcp.approx.ftz.f32", self._asm("sqrt.approx.f32", v_hat) + eps)


def _copysign(magnitude, x):
    """``sign(x) * magnitude`` for ``magnitude >= 0``, bit for bit (signed zeros included), in
    two integer operations instead of sign()'s compare-and-select chain and a multiply."""
    sign_bit = lax.bitcast_convert_type(x, jnp.int32) & jnp.int32(-(2**31))
    return lax.bitcast_convert_type(
        lax.bitcast_convert_type(magnitude, jnp.int32) | sign_bit, jnp.float32
    )


def _log2_ratio(mx, mn):
    """``quant.dre_statistics``'s overflow-safe ``log2(mx / mn)`` with two logs instead of three.

    Where ``mx / mn`` is finite this is ``log2(ratio) - log2(1)``, and ``log2(1)`` is exactly 0;
    elsewhere ``log2(mx) - log2(mn)``: the reference's value bit for bit either way.
    """
    ratio = mx / mn
    finite = jnp.isfinite(ratio)
    return jnp.log2(jnp.where(finite, ratio, mx)) - jnp.log2(jnp.where(finite, 1.0, mn))


def _flat(column, flat: bool):
    """A per-group ``[groups, 1]`` column as a ``[groups]`` vector when ``flat`` (else as is)."""
    return column.reshape(column.shape[0]) if flat else column


def _column(v, flat: bool):
    """The inverse of :func:`_flat`: a per-group value as a ``[groups, 1]`` column."""
    return v[:, None] if flat else v


def dequantize_tile(codes, scale, expand, center, math_: Math, flat: bool = False):
    """Float32 moment of one tile, as :meth:`QuantizedTensor.dequantize` computes it."""
    q = codes.astype(jnp.float32)
    y = q * scale
    if expand is None:
        return y
    inv_expand = _column(math_.reciprocal(_flat(expand, flat)), flat)
    # |y| >= smallest code * scale >= 2**-16 / 57344: never subnormal, so lg2 may flush.
    return _copysign(math_.power(jnp.abs(y), inv_expand, ftz_log=True), y) * center


def quantize_tile(x, fmt, expansion, expand_min, log2_range, math_: Math, flat: bool = False):
    """Codes and statistics of one tile of groups (one group per row), as the reference does.

    The statistics repeat ``quant.dre_statistics`` / ``quant.quantize_absmax`` operation by
    operation up to the exponent k, which a floor makes discontinuous; the centre and scale,
    continuous in their inputs, and the per-element work follow ``math_``. With ``flat`` the
    per-group arithmetic runs on ``[groups]`` vectors (``KernelConfig.flat_stats``): the same
    operations on the same values.
    """
    fmax = quant.FP8_MAX[fmt]
    dtype = quant.FORMATS[fmt]
    a = jnp.abs(x)

    def per_element_divide(v, d, ftz=True):
        # ``v / d`` for a per-group ``d``.
        return math_.divide(v, d, ftz=ftz, spread=lambda g: _column(g, flat))

    if not expansion:
        scale = _flat(jnp.max(a, axis=1, keepdims=True), flat) + quant.ABSMAX_TINY
        scale = scale / fmax
        codes = jnp.clip(per_element_divide(x, scale), -fmax, fmax).astype(dtype)
        return codes, (_column(scale, flat),)
    mx = _flat(jnp.max(a, axis=1, keepdims=True), flat) + quant.DRE_TINY
    nonzero_min = _flat(jnp.min(jnp.where(a > 0, a, jnp.inf), axis=1, keepdims=True), flat)
    mn = jnp.where(jnp.isfinite(nonzero_min), nonzero_min, 0.0) + quant.DRE_TINY
    c = jnp.sqrt(mx) * jnp.sqrt(mn)
    k = jnp.floor(log2_range / _log2_ratio(mx, mn) * expand_min) / expand_min
    k = jnp.clip(k, 1.0 / expand_min, quant.MAX_EXPAND)
    # The centre reaches 2**126 in groups of huge values: its reciprocal must not flush.
    s = math_.divide(math_.power(math_.divide(mx, c, ftz=False), k), fmax)
    stats = (_column(s, flat), _column(k, flat), _column(c, flat))
    # An ex2 result below 2**-126 ends as code 0 after the division by s >= 1 / fmax, so the
    # exponential may flush; the log's argument |x / c| stays exact (extreme groups reach
    # subnormal ratios).
    ratio = per_element_divide(x, c, ftz=False)
    y = _copysign(math_.power(jnp.abs(ratio), _column(k, flat), ftz_exp=True), x)
    codes = jnp.clip(per_element_divide(y, s), -fmax, fmax).astype(dtype)
    return codes, stats

"""FP8 codecs in pure jnp: clip-then-cast, per-group absmax and Dynamic Range Expansion (DRE).

Everything here is the reference numerics of docs/design.md, 'Formats', 'Groups of 128' and
'Dynamic Range Expansion'; the Pallas kernels beside this module must agree with these functions.
The codecs are the bottom layer (docs/design.md, 'Layers'): this module imports nothing of the
project, the kernels and the library build on it, and ``coat_jax.quant`` re-exports it.

A quantized tensor travels as its codes (the tensor's own shape, in a float8 dtype) plus float32
per-group statistics of shape ``x.shape[:-1] + (ceil(n / group_size),)``: the same rank as ``x``,
so a sharding of ``x`` that does not split its last axis applies to the statistics unchanged.

Groups are ``group_size`` consecutive elements along the last axis. When the last axis is not a
multiple of ``group_size`` the final group is shorter: it is padded with zeros, which change neither
the absmax nor the DRE statistics (DRE's minimum is taken over non-zero magnitudes).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

FORMATS: dict[str, jnp.dtype] = {
    "e4m3": jnp.dtype(jnp.float8_e4m3fn),
    "e5m2": jnp.dtype(jnp.float8_e5m2),
}
FP8_MAX: dict[str, float] = {"e4m3": 448.0, "e5m2": 57344.0}

# Offsets that keep DRE's max, min and centre away from zero (docs/design.md, 'Dynamic Range
# Expansion').
DRE_TINY = 1e-30
# The offset in the scale of plain (non-expanded) per-group absmax quantization (docs/design.md,
# 'Groups of 128').
ABSMAX_TINY = 1e-20
# Upper bound on the DRE exponent k. k is only huge when a group's magnitudes are (nearly) all
# equal, e.g. a single non-zero value, where the formula gives k = inf. Any k represents such a
# group exactly; the cap only keeps (max/centre)^k finite and well conditioned in float32. It
# binds only for groups whose max/min ratio is below 2**(log2(fmax**2 / 2) / 4096), i.e. within
# 0.3% for E4M3, which a real moment group practically never is.
MAX_EXPAND = 4096.0


def fp8_format(fmt: str) -> str:
    """Validates an FP8 format name ("e4m3" or "e5m2") and returns it."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown FP8 format {fmt!r}; valid formats are {sorted(FORMATS)}")
    return fmt


def format_of(dtype) -> str:
    """The format name of a float8 dtype."""
    dtype = jnp.dtype(dtype)
    for name, d in FORMATS.items():
        if d == dtype:
            return name
    raise ValueError(f"{dtype} is not an FP8 dtype; valid dtypes are {list(FORMATS.values())}")


def cast_to_fp8(x: jax.Array, fmt: str) -> jax.Array:
    """Clips to the format's largest finite value, then casts (round to nearest even).

    A plain cast does not saturate: E4M3 turns values past 448 into NaN and E5M2 into inf.
    """
    fmax = FP8_MAX[fp8_format(fmt)]
    return jnp.clip(x, -fmax, fmax).astype(FORMATS[fmt])


def num_groups(n: int, group_size: int) -> int:
    """How many groups of ``group_size`` a last axis of length ``n`` forms (the last may be short)."""
    return -(-n // group_size)


def check_group_size(group_size) -> int:
    """Validates a group size: a positive Python int."""
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)):
        raise ValueError(
            f"group_size must be a positive int, got {group_size!r} of type "
            f"{type(group_size).__name__}"
        )
    if group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size}")
    return int(group_size)


def to_groups(x: jax.Array, group_size: int) -> jax.Array:
    """``[..., n]`` -> ``[..., G, group_size]``, zero-padding a short last group."""
    if x.ndim == 0:
        raise ValueError("per-group quantization needs at least one axis; got a scalar")
    n = x.shape[-1]
    g = num_groups(n, group_size)
    pad = g * group_size - n
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], g, group_size)


def from_groups(x_g: jax.Array, n: int) -> jax.Array:
    """``[..., G, group_size]`` -> ``[..., n]``, dropping the padding."""
    x = x_g.reshape(*x_g.shape[:-2], x_g.shape[-2] * x_g.shape[-1])
    return x[..., :n] if x.shape[-1] != n else x


class AbsmaxQuantized(NamedTuple):
    """Per-group absmax quantization: ``x ~= codes * scale`` (scale broadcast over each group)."""

    codes: jax.Array
    scale: jax.Array


class DREQuantized(NamedTuple):
    """Per-group quantization with Dynamic Range Expansion: codes, scale, exponent, centre.

    The formulas: docs/design.md, 'Dynamic Range Expansion'.
    """

    codes: jax.Array
    scale: jax.Array
    expand: jax.Array
    center: jax.Array


def quantize_absmax(x: jax.Array, *, group_size: int = 128, fmt: str = "e4m3") -> AbsmaxQuantized:
    """Per-group absmax quantization: ``s = (max|x| + 1e-20) / fmax``, ``q = fp8(x / s)``."""
    fmax = FP8_MAX[fp8_format(fmt)]
    x_g = to_groups(x.astype(jnp.float32), group_size)
    scale = (jnp.max(jnp.abs(x_g), axis=-1) + ABSMAX_TINY) / fmax
    codes = cast_to_fp8(x_g / scale[..., None], fmt)
    return AbsmaxQuantized(from_groups(codes, x.shape[-1]), scale)


def dequantize_absmax(codes: jax.Array, scale: jax.Array, *, group_size: int = 128) -> jax.Array:
    """Inverse of :func:`quantize_absmax`, in float32."""
    q_g = to_groups(codes.astype(jnp.float32), group_size)
    return from_groups(q_g * scale[..., None], codes.shape[-1])


def dre_statistics(x_g: jax.Array, *, fmt: str, expand_min) -> tuple[jax.Array, ...]:
    """DRE's per-group centre ``c``, exponent ``k`` and scale ``s`` for grouped ``x_g [..., G, gs]``.

    ``expand_min`` may be a traced value (it only enters arithmetic).
    """
    fmax = FP8_MAX[fp8_format(fmt)]
    a = jnp.abs(x_g)
    mx = jnp.max(a, axis=-1) + DRE_TINY
    nonzero_min = jnp.min(jnp.where(a > 0, a, jnp.inf), axis=-1)
    mn = jnp.where(jnp.isfinite(nonzero_min), nonzero_min, 0.0) + DRE_TINY
    c = jnp.sqrt(mx) * jnp.sqrt(mn)
    ratio = mx / mn
    # mx / mn overflows float32 for groups spanning more than 2**128 (e.g. 1e10 next to 1e-30);
    # the difference of logs is the same number without the overflow.
    log_ratio = jnp.where(jnp.isfinite(ratio), jnp.log2(ratio), jnp.log2(mx) - jnp.log2(mn))
    expand_min = jnp.asarray(expand_min, jnp.float32)
    k = jnp.floor(jnp.log2(jnp.float32(fmax * fmax / 2)) / log_ratio * expand_min) / expand_min
    # Floor can reach 0 for a small expand_min and a huge ratio, and x**0 would erase the group.
    k = jnp.clip(k, 1.0 / expand_min, MAX_EXPAND)
    s = jnp.power(mx / c, k) / fmax
    return c, k, s


def quantize_dre(
    x: jax.Array, *, group_size: int = 128, fmt: str = "e4m3", expand_min=16
) -> DREQuantized:
    """Per-group quantization with Dynamic Range Expansion (COAT).

    Per group: ``y = sign(x) |x / c|^k``, ``s = (max / c)^k / fmax``, ``q = fp8(y / s)``, with
    ``c = sqrt(max) sqrt(min_nonzero)`` and ``k`` the largest multiple of ``1 / expand_min`` that
    maps the group's max/min ratio onto ``fmax**2 / 2`` (docs/design.md, 'Dynamic Range
    Expansion', says why).
    """
    x_g = to_groups(x.astype(jnp.float32), group_size)
    c, k, s = dre_statistics(x_g, fmt=fmt, expand_min=expand_min)
    y = jnp.sign(x_g) * jnp.power(jnp.abs(x_g / c[..., None]), k[..., None])
    codes = cast_to_fp8(y / s[..., None], fmt)
    return DREQuantized(from_groups(codes, x.shape[-1]), s, k, c)


def dequantize_dre(
    codes: jax.Array,
    scale: jax.Array,
    expand: jax.Array,
    center: jax.Array,
    *,
    group_size: int = 128,
) -> jax.Array:
    """Inverse of :func:`quantize_dre`: ``x = sign(q s) |q s|^(1/k) c``, in float32."""
    q_g = to_groups(codes.astype(jnp.float32), group_size)
    y = q_g * scale[..., None]
    x = jnp.sign(y) * jnp.power(jnp.abs(y), 1.0 / expand[..., None]) * center[..., None]
    return from_groups(x, codes.shape[-1])


def state_bytes(tree) -> int:
    """Bytes held by the array leaves of ``tree`` (works on arrays and ShapeDtypeStructs)."""
    return sum(
        math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree)
    )

"""FP8 codecs in pure jnp: clip-then-cast, per-group absmax and Dynamic Range Expansion (DRE).

Everything here is the reference numerics of docs/design.md, 'Formats', 'Groups of 128' and
'Dynamic Range Expansion'; the Pallas kernels beside this module must agree with these functions.
The codecs are the bottom layer (docs/design.md, 'Layers'): this module imports nothing of the
project, the kernels and the library build on it, and ``coat_jax.quant`` re-exports it.

A quantized tensor travels as one pytree, :class:`QuantizedTensor`: its codes (the tensor's own
shape, in a float8 dtype) plus float32 scales -- one per tensor, or per group of shape
``x.shape[:-1] + (ceil(n / group_size),)``, the same rank as ``x``, so a sharding of ``x`` that
does not split its last axis applies to the statistics unchanged -- and, as static metadata, the
format and group layout it was made with.

Groups are ``group_size`` consecutive elements along the last axis. When the last axis is not a
multiple of ``group_size`` the final group is shorter: it is padded with zeros, which change neither
the absmax nor the DRE statistics (DRE's minimum is taken over non-zero magnitudes).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

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


GRANULARITIES = ("tensor", "group")


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["codes", "scale", "expand", "center"],
    meta_fields=["fmt", "granularity", "group_size"],
)
@dataclasses.dataclass(frozen=True, repr=False)
class QuantizedTensor:
    """An FP8-quantized tensor: its codes, its scales and the layout they were made with.

    The one form a quantized value takes in the library: what the codecs here return, what the
    kernels take and return (``pallas_kernels.fp8_quant``, ``fp8_act``, ``coat_adam``), what the
    FP8 ops keep for backward and what the optimizer's moments are between its state fields.

    A pytree: ``codes``, ``scale``, ``expand`` and ``center`` are its leaves (``None`` fields are
    absent, not leaves), the layout is static metadata, so it passes through ``jit``,
    ``eval_shape``, ``vmap``, ``shard_map`` and ``custom_vjp`` residuals like a tuple of arrays,
    and a change of layout (not of values) retraces.

    Attributes:
      codes: the values in the FP8 format ``fmt``, the tensor's own shape.
      scale: float32 (or, for 1xG absmax scales made with ``scale_format="e8m0"``, uint8: a
        power of two stored as its exponent, :func:`decode_scale`). ``granularity="tensor"``:
        a scalar. ``"group"``: one per group of
        ``group_size`` consecutive values along the last axis, shape
        ``codes.shape[:-1] + (ceil(n / group_size),)`` (the tensor's rank, so the tensor's
        sharding fits it); a short last group is zero-padded (docs/design.md, 'Groups of 128').
      expand, center: Dynamic Range Expansion's per-group exponent and centre (float32, the
        scale's shape), or ``None`` for plain absmax scaling (docs/design.md, 'Dynamic Range
        Expansion').
      fmt: the FP8 format name, ``"e4m3"`` or ``"e5m2"`` (static).
      granularity: ``"tensor"`` (one scale) or ``"group"`` (static).
      group_size: values per group along the last axis; ``None`` for ``"tensor"`` (static).

    Examples:
      >>> x = jnp.linspace(-1.0, 1.0, 32).reshape(2, 16)
      >>> q = quantize_absmax(x, group_size=16)
      >>> q
      QuantizedTensor(e4m3, group of 16, codes float8_e4m3fn[2, 16], scale float32[2, 1])
      >>> q.nbytes, bool(jnp.max(jnp.abs(q.dequantize() - x)) < 0.05)
      (40, True)
    """

    codes: jax.Array
    scale: jax.Array
    expand: jax.Array | None = None
    center: jax.Array | None = None
    _: dataclasses.KW_ONLY
    fmt: str
    granularity: str
    group_size: int | None = None

    def __post_init__(self):
        # Runs on every unflatten too, where the array fields may hold any placeholder (tracers,
        # ShapeDtypeStructs, PartitionSpecs): only the static fields and the presence of the
        # statistics are checked.
        fp8_format(self.fmt)
        if self.granularity not in GRANULARITIES:
            raise ValueError(
                f"granularity={self.granularity!r} is not one of {list(GRANULARITIES)}"
            )
        if (self.expand is None) != (self.center is None):
            raise ValueError(
                "a QuantizedTensor has both DRE statistics (expand and center) or neither"
            )
        if self.granularity == "tensor":
            if self.group_size is not None:
                raise ValueError(
                    f"a per-tensor QuantizedTensor has no group size, got group_size="
                    f"{self.group_size!r}; pass granularity='group' for per-group scales"
                )
            if self.expand is not None:
                raise ValueError("Dynamic Range Expansion is per group: use granularity='group'")
        else:
            object.__setattr__(self, "group_size", check_group_size(self.group_size))

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape (its codes')."""
        return tuple(self.codes.shape)

    @property
    def ndim(self) -> int:
        return len(self.codes.shape)

    @property
    def expansion(self) -> bool:
        """Whether the codes carry Dynamic Range Expansion (``expand`` and ``center``)."""
        return self.expand is not None

    @property
    def nbytes(self) -> int:
        """Bytes of codes and statistics (works on arrays and ``ShapeDtypeStruct`` leaves)."""
        return state_bytes(self)

    def dequantize(self) -> jax.Array:
        """The float32 tensor the codes stand for: :func:`dequantize_dre`,
        :func:`dequantize_absmax`, or ``codes * scale`` for one scale per tensor."""
        if self.granularity == "tensor":
            return self.codes.astype(jnp.float32) * decode_scale(self.scale)
        if self.expansion:
            return dequantize_dre(
                self.codes, self.scale, self.expand, self.center, group_size=self.group_size
            )
        return dequantize_absmax(self.codes, self.scale, group_size=self.group_size)

    def replace(self, **changes) -> QuantizedTensor:
        """A copy with some fields replaced (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    def __repr__(self) -> str:
        def field(name):
            x = getattr(self, name)
            if x is None:
                return None
            dtype = getattr(x, "dtype", None)
            shape = getattr(x, "shape", None)
            if dtype is None or shape is None:
                return f"{name} {x!r}"
            return f"{name} {jnp.dtype(dtype).name}{list(shape)}"

        layout = "tensor" if self.granularity == "tensor" else f"group of {self.group_size}"
        parts = [self.fmt, layout] + [
            f for f in map(field, ("codes", "scale", "expand", "center")) if f is not None
        ]
        return f"QuantizedTensor({', '.join(parts)})"


def named(tree, name: str):
    """Tags every array of ``tree`` (quantized tensors included) with ``checkpoint_name(name)``.

    The one way residuals are named for remat: a policy that saves ``name``
    (``jax.checkpoint_policies.save_only_these_names``) keeps every array ``tree`` holds.
    """
    return jax.tree.map(lambda x: checkpoint_name(x, name), tree)


def quantize_absmax(
    x: jax.Array, *, group_size: int = 128, fmt: str = "e4m3", scale_format: str = "float32"
) -> QuantizedTensor:
    """Per-group absmax quantization: ``s = (max|x| + 1e-20) / fmax``, ``q = fp8(x / s)``.

    ``scale_format="e8m0"`` takes the smallest power of two ``s`` with ``max|x| + 1e-20 <=
    fmax * s`` (:func:`absmax_scale`) and stores it in one byte (:func:`encode_scale`).
    """
    fmax = FP8_MAX[fp8_format(fmt)]
    x_g = to_groups(x.astype(jnp.float32), group_size)
    scale = absmax_scale(jnp.max(jnp.abs(x_g), axis=-1), fmax, scale_format)
    codes = cast_to_fp8(x_g / scale[..., None], fmt)
    return QuantizedTensor(
        from_groups(codes, x.shape[-1]),
        encode_scale(scale, scale_format),
        fmt=fmt,
        granularity="group",
        group_size=group_size,
    )


def dequantize_absmax(codes: jax.Array, scale: jax.Array, *, group_size: int = 128) -> jax.Array:
    """Inverse of :func:`quantize_absmax`, in float32 (``scale`` float32 or E8M0 bytes)."""
    q_g = to_groups(codes.astype(jnp.float32), group_size)
    return from_groups(q_g * decode_scale(scale)[..., None], codes.shape[-1])


# --------------------------------------------------------------------------------------------
# per-group scales in one byte (OCP MX's E8M0: a power of two, stored as its biased exponent)

# How 1xG absmax scales are stored: "float32" (COAT), or "e8m0": the scale rounded up to a
# power of two and kept as the 8 exponent bits of that float32 (1 byte instead of 4). With a
# power-of-two scale x / s only shifts exponents, so a value's FP8 rounding error relative to
# itself is the same as with the exact scale; what changes is that a group's largest |x| / s
# lands in (fmax / 2, fmax] instead of at fmax, so values under the FP8 format's smallest normal
# (2^-6 of fmax for E4M3 at the exact scale) can lose up to one more bit.
SCALE_FORMATS = ("float32", "e8m0")
SCALE_DTYPES = {"float32": jnp.dtype(jnp.float32), "e8m0": jnp.dtype(jnp.uint8)}
_MANTISSA = 0x007FFFFF
_EXPONENT = 0xFF800000  # sign and exponent bits
_NAN_BITS = 0x7FC00000


def check_scale_format(scale_format: str) -> str:
    if scale_format not in SCALE_FORMATS:
        raise ValueError(
            f"unknown scale format {scale_format!r}; valid formats are {list(SCALE_FORMATS)} "
            "('float32': exact scales, 'e8m0': power-of-two scales in one byte)"
        )
    return scale_format


def group_settings(group_size, fmt: str, scale_format: str) -> dict:
    """Validated 1xG quantization settings, as the keyword arguments the quantizing kernels
    and their references take."""
    return dict(
        fmt=fp8_format(fmt),
        scale_format=check_scale_format(scale_format),
        group_size=check_group_size(group_size),
    )


def round_scale(scale: jax.Array, scale_format: str) -> jax.Array:
    """``scale`` (positive float32) as ``scale_format`` represents it: itself for "float32",
    the smallest power of two >= it for "e8m0" (so every ``|x| / scale`` stays <= fmax).

    Integer bit arithmetic (the exponent goes up by one unless the mantissa is zero), so the
    Pallas kernels and this reference round identically; a NaN stays NaN.
    """
    if check_scale_format(scale_format) == "float32":
        return scale
    bits = jax.lax.bitcast_convert_type(jnp.asarray(scale, jnp.float32), jnp.uint32)
    up = (bits + jnp.uint32(_MANTISSA)) & jnp.uint32(_EXPONENT)
    rounded = jax.lax.bitcast_convert_type(up, jnp.float32)
    return jnp.where(scale != scale, scale, rounded)


def absmax_scale(amax: jax.Array, fmax: float, scale_format: str) -> jax.Array:
    """The 1xG absmax scale of groups whose largest magnitude is ``amax`` (float32).

    "float32": ``(amax + 1e-20) / fmax``. "e8m0": the smallest power of two ``r`` with
    ``amax + 1e-20 <= fmax * r``. :func:`round_scale` of the quotient gives it up to the
    quotient's own rounding: where ``amax`` is ``fmax`` times a power of two (about 1 group in
    130 of BF16 data) a division one ulp high (a GPU's approximate divide) would double ``r``.
    Two exact comparisons (``fmax * r`` is exact: 448 and 57344 have 3 and 1 significant bits)
    settle it, so the Pallas kernels and this reference agree whatever their division does.
    """
    peak = amax + ABSMAX_TINY
    scale = peak / fmax
    if check_scale_format(scale_format) == "float32":
        return scale
    r = round_scale(scale, scale_format)
    r = jnp.where(peak <= fmax * (r * 0.5), r * 0.5, r)
    return jnp.where(peak > fmax * r, r * 2.0, r)


def encode_scale(scale: jax.Array, scale_format: str) -> jax.Array:
    """The stored form of a :func:`round_scale` result: float32, or the uint8 biased exponent."""
    if check_scale_format(scale_format) == "float32":
        return scale
    bits = jax.lax.bitcast_convert_type(jnp.asarray(scale, jnp.float32), jnp.uint32)
    return (bits >> jnp.uint32(23)).astype(jnp.uint8)  # the sign bit is 0: scales are > 0


def decode_scale(stored: jax.Array) -> jax.Array:
    """float32 scales from their stored form (float32 as is; uint8 E8M0, 255 = NaN).

    Byte 0 decodes to 0.0, not OCP's 2^-127: no scale here is that small (the 1e-20 floor of
    :func:`absmax_scale` keeps every scale above 2^-76).
    """
    if stored.dtype != jnp.uint8:
        return stored.astype(jnp.float32)
    e = stored.astype(jnp.uint32)
    bits = jnp.where(e == jnp.uint32(255), jnp.uint32(_NAN_BITS), e << jnp.uint32(23))
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


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
) -> QuantizedTensor:
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
    return QuantizedTensor(
        from_groups(codes, x.shape[-1]),
        s,
        k,
        c,
        fmt=fmt,
        granularity="group",
        group_size=group_size,
    )


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

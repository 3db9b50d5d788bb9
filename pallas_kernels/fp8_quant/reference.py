"""The FP8 quantizers in plain jnp: the numerics contract and the CPU path."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import quant
from pallas_kernels.quant import QuantizedTensor


def per_group(codes: jax.Array, scale: jax.Array, *, fmt: str, group_size: int) -> QuantizedTensor:
    """The :class:`QuantizedTensor` of a kernel's 1xG codes and scales."""
    return QuantizedTensor(codes, scale, fmt=fmt, granularity="group", group_size=group_size)


def quantize_per_group_reference(
    x: jax.Array, *, group_size: int = 16, fmt: str = "e4m3", scale_format: str = "float32"
) -> QuantizedTensor:
    """Plain-jnp 1xG absmax quantization: codes ``[..., D]``, scales ``[..., D / G]`` (float32,
    or E8M0 bytes with ``scale_format="e8m0"``)."""
    return quant.quantize_absmax(x, group_size=group_size, fmt=fmt, scale_format=scale_format)


def group_amax_reference(x: jax.Array, *, group_size: int = 16) -> jax.Array:
    """Group scaling, first stage: ``max|x|`` of every 1xG group, float32 ``[..., D / G]``."""
    return jnp.max(jnp.abs(quant.to_groups(x.astype(jnp.float32), group_size)), axis=-1)


def round_up_to_bfloat16(s: jax.Array) -> jax.Array:
    """The smallest bfloat16-representable float32 ``>= s`` (``s`` positive and finite)."""
    # bfloat16 is the top half of a float32: adding 0xFFFF to the bits and clearing the low half
    # rounds the magnitude up.
    bits = jax.lax.bitcast_convert_type(s.astype(jnp.float32), jnp.uint32)
    bits = (bits + jnp.uint32(0xFFFF)) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def scale_from_amax(amax: jax.Array, fmt: str) -> jax.Array:
    """Per-tensor scale from the group maxima: ``(max(amax) + 1e-20) / fmax``, rounded up.

    The FP8 GEMM dequantizes in BF16 (``convert(codes) * bf16(scale)``, the pattern XLA maps to
    cuBLASLt); a scale that is already a bfloat16 value makes that exact. Rounding up (by less
    than 0.4%) keeps every ``|x| / scale <= fmax``.
    """
    return round_up_to_bfloat16((jnp.max(amax) + quant.ABSMAX_TINY) / quant.FP8_MAX[fmt])


def per_tensor(codes: jax.Array, scale: jax.Array, *, fmt: str) -> QuantizedTensor:
    """The :class:`QuantizedTensor` of codes with one float32 scalar scale."""
    return QuantizedTensor(codes, scale, fmt=fmt, granularity="tensor")


def quantize_per_tensor_reference(
    x: jax.Array, *, fmt: str = "e4m3", group_size: int = 16
) -> QuantizedTensor:
    """Plain-jnp per-tensor quantization: codes with a float32 scalar scale."""
    scale = scale_from_amax(group_amax_reference(x, group_size=group_size), quant.fp8_format(fmt))
    return per_tensor(quant.cast_to_fp8(x.astype(jnp.float32) / scale, fmt), scale, fmt=fmt)

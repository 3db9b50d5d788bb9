"""FP8 codecs under the library's name: ``coat_jax.quant`` is ``pallas_kernels.quant``.

The codecs (FP8 formats, clip-then-cast, per-group absmax and Dynamic Range Expansion, and the
:class:`QuantizedTensor` they return) live at the bottom of the import order, beside the kernels
that must agree with them (docs/design.md, 'Layers'); this module re-exports their public names
so that ``coat_jax.quant.quantize_dre`` and ``from coat_jax import quant`` keep working.

Examples:
  >>> import jax.numpy as jnp
  >>> from coat_jax import quant
  >>> q = quant.quantize_dre(jnp.linspace(-1.0, 1.0, 256).reshape(2, 128))
  >>> type(q).__name__, q.codes.dtype, q.scale.shape, q.group_size, q.expansion
  ('QuantizedTensor', dtype(float8_e4m3fn), (2, 1), 128, True)
"""

from pallas_kernels.quant import (
    ABSMAX_TINY,
    DRE_TINY,
    FORMATS,
    FP8_MAX,
    GRANULARITIES,
    MAX_EXPAND,
    SCALE_DTYPES,
    SCALE_FORMATS,
    QuantizedTensor,
    absmax_scale,
    cast_to_fp8,
    check_group_size,
    check_scale_format,
    decode_scale,
    dequantize_absmax,
    dequantize_dre,
    dre_statistics,
    encode_scale,
    format_of,
    fp8_format,
    from_groups,
    group_settings,
    named,
    num_groups,
    quantize_absmax,
    quantize_dre,
    round_scale,
    state_bytes,
    to_groups,
)

__all__ = [
    "FORMATS",
    "FP8_MAX",
    "DRE_TINY",
    "ABSMAX_TINY",
    "MAX_EXPAND",
    "fp8_format",
    "format_of",
    "cast_to_fp8",
    "num_groups",
    "check_group_size",
    "group_settings",
    "to_groups",
    "from_groups",
    "GRANULARITIES",
    "QuantizedTensor",
    "named",
    "quantize_absmax",
    "dequantize_absmax",
    "SCALE_FORMATS",
    "SCALE_DTYPES",
    "check_scale_format",
    "round_scale",
    "absmax_scale",
    "encode_scale",
    "decode_scale",
    "dre_statistics",
    "quantize_dre",
    "dequantize_dre",
    "state_bytes",
]

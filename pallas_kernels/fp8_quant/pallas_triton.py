"""The FP8 quantizers' Pallas Triton kernels: the fused 1xG quantizer and the per-tensor
scaled cast (whose scale XLA's group maxima give)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec

from pallas_kernels import quant
from pallas_kernels.dispatch import require_gpu
from pallas_kernels.fp8_quant.config import (
    DEFAULT_TILES,
    TileConfig,
    grouped_view,
    tiles_for,
)
from pallas_kernels.fp8_quant.reference import (
    group_amax_reference,
    per_group,
    per_tensor,
    scale_from_amax,
)
from pallas_kernels.quant import QuantizedTensor
from pallas_kernels.sharding import KernelMesh, check_spec, over_batch, shard_map, spec_axes


def group_quantize_tile(x, fmt: str, scale_format: str = "float32"):
    """Kernel-side 1xG quantization of a ``[rows, groups, G]`` float32 tile: the codes and the
    scales in their stored form (``quant.encode_scale``)."""
    fmax = quant.FP8_MAX[fmt]
    scale = quant.absmax_scale(jnp.max(jnp.abs(x), axis=-1), fmax, scale_format)
    codes = jnp.clip(x / scale[..., None], -fmax, fmax).astype(quant.FORMATS[fmt])
    return codes, quant.encode_scale(scale, scale_format)


def _per_group_kernel(x_ref, q_ref, s_ref, *, fmt, scale_format):
    codes, scale = group_quantize_tile(x_ref[...].astype(jnp.float32), fmt, scale_format)
    q_ref[...] = codes
    s_ref[...] = scale


@over_batch("b", "b")
def quantize_per_group_pallas(
    x: jax.Array,
    *,
    group_size: int = 16,
    fmt: str = "e4m3",
    scale_format: str = "float32",
    tiles: TileConfig = DEFAULT_TILES,
    interpret: bool = False,
):
    """Pallas Triton 1xG quantization; same results as :func:`quantize_per_group_reference`.

    ``mesh`` (keyword, a :class:`KernelMesh`): run on each batch shard of ``x``.
    """
    quant.fp8_format(fmt)
    x3 = grouped_view(x, quant.check_group_size(group_size))
    require_gpu(interpret)
    m, g, gs = x3.shape
    bm, bg = tiles_for(m, g, tiles)
    codes, scale = pl.pallas_call(
        functools.partial(_per_group_kernel, fmt=fmt, scale_format=scale_format),
        grid=(m // bm, g // bg),
        in_specs=[pl.BlockSpec((bm, bg, gs), lambda i, j: (i, j, 0))],
        out_specs=[
            pl.BlockSpec((bm, bg, gs), lambda i, j: (i, j, 0)),
            pl.BlockSpec((bm, bg), lambda i, j: (i, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(x3.shape, quant.FORMATS[fmt]),
            jax.ShapeDtypeStruct((m, g), quant.SCALE_DTYPES[scale_format]),
        ],
        compiler_params=tiles.compiler_params(),
        interpret=interpret,
        name="fp8_quantize_per_group",
    )(x3)
    return per_group(
        codes.reshape(x.shape), scale.reshape(*x.shape[:-1], g), fmt=fmt, group_size=gs
    )


def _scaled_cast_kernel(x_ref, s_ref, q_ref, *, fmt):
    fmax = quant.FP8_MAX[fmt]
    y = x_ref[...].astype(jnp.float32) / s_ref[0]
    q_ref[...] = jnp.clip(y, -fmax, fmax).astype(quant.FORMATS[fmt])


def quantize_per_tensor_pallas(
    x: jax.Array,
    *,
    fmt: str = "e4m3",
    group_size: int = 16,
    tiles: TileConfig = DEFAULT_TILES,
    interpret: bool = False,
    mesh: KernelMesh | None = None,
    partition: PartitionSpec | None = None,
) -> QuantizedTensor:
    """XLA's group maxima (:func:`group_amax_reference`), then the Pallas scaled cast.

    The maxima stay in XLA, which can fuse them into the op that produces ``x``: the training
    step ran faster this way than with a Pallas pass for the maxima. The cast is the kernel:
    XLA's fusion of the same cast is slower (docs/bench_fp8_cast.md, docs/bench_fp8_kernels.md).

    With ``mesh``, ``x`` is split as ``partition`` (default: ``mesh.activation_spec``, the
    leading axis over the batch axes; a weight takes ``mesh.param_spec(w.shape)``) and both
    passes run per shard; the scale is the ``pmax`` of the shards' maxima over the mesh axes
    ``partition`` splits, so it equals the unsharded scale bit for bit.
    """
    quant.fp8_format(fmt)
    kwargs = dict(fmt=fmt, group_size=group_size, tiles=tiles, interpret=interpret)
    if mesh is None:
        return per_tensor(*_per_tensor_shard(x, axes=(), **kwargs), fmt=fmt)
    spec = mesh.activation_spec(x.shape) if partition is None else partition
    check_spec(spec, x.shape, mesh.mesh, "quantize_per_tensor")
    axes = spec_axes(spec)
    codes, scale = shard_map(
        functools.partial(_per_tensor_shard, axes=axes, **kwargs),
        mesh.mesh,
        (spec,),
        (spec, PartitionSpec()),
    )(x)
    return per_tensor(codes, scale, fmt=fmt)


def _per_tensor_shard(x, *, fmt, group_size, tiles, interpret, axes):
    """Per-tensor quantization of one shard; ``axes``: the mesh axes the tensor is split over."""
    grouped_view(x, group_size)  # NotImplementedError for a ragged last axis, before tracing
    require_gpu(interpret)
    peak = jnp.max(group_amax_reference(x, group_size=group_size))
    if axes:
        # A maximum is exact in any order: the global scale equals one device's bit for bit.
        peak = jax.lax.pmax(peak, axes)
    scale = scale_from_amax(peak, fmt)
    codes = scaled_cast_pallas(
        x, scale, fmt=fmt, group_size=group_size, tiles=tiles, interpret=interpret
    )
    return codes, scale


def scaled_cast_pallas(
    x: jax.Array,
    scale: jax.Array,
    *,
    fmt: str = "e4m3",
    group_size: int = 16,
    tiles: TileConfig = DEFAULT_TILES,
    interpret: bool = False,
) -> jax.Array:
    """The cast of :func:`quantize_per_tensor_pallas`: the FP8 codes of ``x / scale`` (clipped
    to the format's range) in ``x``'s shape, ``scale`` a float32 scalar; same codes as
    ``quant.cast_to_fp8(x.astype(float32) / scale, fmt)``."""
    quant.fp8_format(fmt)
    m, g, gs = grouped_view(x, group_size).shape  # NotImplementedError for a ragged last axis
    require_gpu(interpret)
    bm, bg = tiles_for(m, g, tiles)
    # The cast works on 2-D [M, D] tiles and returns codes in x's own layout: XLA's FP8 GEMM
    # rewriter wants convert(codes) right on the FP8 producer, with no reshape in between.
    x2 = x.reshape(m, g * gs)
    codes = pl.pallas_call(
        functools.partial(_scaled_cast_kernel, fmt=fmt),
        grid=(m // bm, g // bg),
        in_specs=[
            pl.BlockSpec((bm, bg * gs), lambda i, j: (i, j)),
            pl.BlockSpec((1,), lambda i, j: (0,)),
        ],
        out_specs=pl.BlockSpec((bm, bg * gs), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct(x2.shape, quant.FORMATS[fmt]),
        compiler_params=tiles.compiler_params(),
        interpret=interpret,
        name="fp8_scaled_cast",
    )(x2, jnp.asarray(scale, jnp.float32).reshape(1))
    return codes.reshape(x.shape)

"""FP8 quantizers of the activation precision flow: per-group 1xG and per-tensor with group scaling.

Two quantizers feed COAT's FP8 activations (docs/design.md, 'The precision flow'):

* :func:`quantize_per_group` -- E4M3 codes plus one float32 scale per 1xG group along the last
  axis (G = 16 for non-linear ops): ``s = (max|x| + 1e-20) / fmax``, ``q = fp8(x / s)``. It is
  ``pallas_kernels.quant.quantize_absmax`` with ``group_size=G``, fused into one kernel.
* :func:`quantize_per_tensor` -- codes plus one float32 scalar scale, the input format of an FP8
  GEMM. The scale is found just in time by *group scaling*: a max over each 1xG group, then a
  max over that G-times smaller tensor, with no amax history.

Both return a :class:`pallas_kernels.quant.QuantizedTensor` (``granularity="group"`` with
``group_size=G``, and ``"tensor"``), from the kernel and from the reference alike.

Each entry point takes ``implementation="auto" | "xla" | "pallas"`` and ``interpret`` (run the
Pallas kernel in interpret mode, which is how the CPU tests check the kernels against the
reference), dispatched by :func:`pallas_kernels._dispatch.dispatch`: ``"auto"`` runs the Pallas
Triton kernel where it applies and the plain-jnp ``*_reference`` otherwise (off a GPU, for a last
axis that is not a multiple of ``G``). With ``mesh=`` (a
:class:`~pallas_kernels.sharding.KernelMesh`) the kernels run on each shard of an operand
sharded over the mesh; a per-tensor scale is then the maximum over all shards (one scalar
``pmax``), bit for bit the scale one device computes.

Kernel layout: ``x [..., D]`` is viewed (for free) as ``[M, D / G, G]``; a program handles a
``[block_rows, block_groups, G]`` tile, so group maxima are a reduction over the tile's last axis
and no in-kernel reshape is needed. Triton wants power-of-two tile dimensions, so the tile sizes
used are the largest powers of two up to the config's that divide ``M`` and ``D / G``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec

from pallas_kernels import quant
from pallas_kernels._dispatch import dispatch, require_gpu
from pallas_kernels.quant import QuantizedTensor
from pallas_kernels.sharding import KernelMesh, check_spec, over_batch, shard_map, spec_axes


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch settings of the element-wise FP8 kernels (upper bounds).

    The defaults are the fastest of a sweep at Llama-2-7B's batch-20 shapes on the H200
    (``benchmarks/fp8_tiles.py``, docs/bench_fp8_tiles.md): every setting gives the same
    element-wise outputs; the RMSNorm kernels' row reductions depend on ``norm_num_warps``.
    """

    block_rows: int = 8
    block_groups: int = 128
    num_warps: int = 4
    num_stages: int = 1
    # RMSNorm holds whole rows (D elements each) in one program.
    norm_block_rows: int = 2
    norm_num_warps: int = 8

    def __post_init__(self):
        for name in (f.name for f in dataclasses.fields(self)):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value & (value - 1):
                raise ValueError(
                    f"TileConfig.{name} must be a positive power of two, got {value!r}"
                )

    def compiler_params(self):
        return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)

    def norm_compiler_params(self):
        return plgpu.CompilerParams(num_warps=self.norm_num_warps, num_stages=self.num_stages)


DEFAULT_TILES = TileConfig()


def pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two that divides ``n`` and is at most ``cap``."""
    return math.gcd(n & -n, cap) if n else cap


def grouped_view(x: jax.Array, group_size: int) -> jax.Array:
    """``x [..., D]`` as ``[M, D / G, G]``; ``NotImplementedError`` unless ``G`` divides ``D``."""
    if x.ndim == 0:
        raise NotImplementedError("the FP8 activation kernels need at least one axis; got a scalar")
    d = x.shape[-1]
    if d % group_size:
        raise NotImplementedError(
            f"the kernels need the last axis of shape {tuple(x.shape)} to be a multiple of the "
            f"group size {group_size} (ragged groups run on the XLA reference)"
        )
    return x.reshape(-1, d // group_size, group_size)


def tiles_for(m: int, groups: int, tiles: TileConfig) -> tuple[int, int]:
    return pow2_divisor(m, tiles.block_rows), pow2_divisor(groups, tiles.block_groups)


# --------------------------------------------------------------------------------------------
# per-group (1xG) quantization


def per_group(codes: jax.Array, scale: jax.Array, *, fmt: str, group_size: int) -> QuantizedTensor:
    """The :class:`QuantizedTensor` of a kernel's 1xG codes and scales."""
    return QuantizedTensor(codes, scale, fmt=fmt, granularity="group", group_size=group_size)


def quantize_per_group_reference(
    x: jax.Array, *, group_size: int = 16, fmt: str = "e4m3", scale_format: str = "float32"
) -> QuantizedTensor:
    """Plain-jnp 1xG absmax quantization: codes ``[..., D]``, scales ``[..., D / G]`` (float32,
    or E8M0 bytes with ``scale_format="e8m0"``)."""
    return quant.quantize_absmax(x, group_size=group_size, fmt=fmt, scale_format=scale_format)


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


def quantize_per_group(
    x: jax.Array,
    *,
    group_size: int = 16,
    fmt: str = "e4m3",
    scale_format: str = "float32",
    implementation: str = "auto",
    interpret: bool = False,
    tiles: TileConfig = DEFAULT_TILES,
    mesh: KernelMesh | None = None,
) -> QuantizedTensor:
    """1xG absmax quantization along the last axis: codes and scales ``[..., D / G]``.

    ``scale_format``: ``"float32"`` scales (COAT), or ``"e8m0"``: each scale rounded up to a
    power of two and stored in one byte (``pallas_kernels.quant.absmax_scale``).
    ``mesh``: the :class:`KernelMesh` ``x`` is sharded over (batch-split leading axis), or
    ``None`` for one device.

    Example:
        >>> q = quantize_per_group(jnp.ones((4, 32)), implementation="xla")
        >>> q.codes.dtype, q.scale.shape, q.group_size
        (dtype(float8_e4m3fn), (4, 2), 16)
    """
    quant.check_scale_format(scale_format)
    kw = dict(group_size=group_size, fmt=fmt, scale_format=scale_format)
    return dispatch(
        "quantize_per_group",
        implementation,
        interpret=interpret,
        mesh=mesh,
        pallas=lambda: quantize_per_group_pallas(
            x, **kw, tiles=tiles, interpret=interpret, mesh=mesh
        ),
        xla=lambda: quantize_per_group_reference(x, **kw),
    )[1]


# --------------------------------------------------------------------------------------------
# per-tensor quantization with group scaling


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

    The maxima stay in XLA, which can fuse them into the op that produces ``x``: train.py's
    Llama-2-7B step at batch 20 on the H200 ran 1.5% faster this way than with a Pallas pass
    for the maxima. The cast is the kernel: XLA's fusion of the same cast took 1.38x its time
    on a [40960, 11008] BF16 tensor (docs/bench_fp8_cast.md, docs/bench_fp8_kernels.md).

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


def quantize_per_tensor(
    x: jax.Array,
    *,
    fmt: str = "e4m3",
    group_size: int = 16,
    implementation: str = "auto",
    interpret: bool = False,
    tiles: TileConfig = DEFAULT_TILES,
    mesh: KernelMesh | None = None,
    partition: PartitionSpec | None = None,
) -> QuantizedTensor:
    """Per-tensor quantization with a just-in-time group-scaling scale (a float32 scalar).

    ``mesh``/``partition``: where ``x`` lives (see :func:`quantize_per_tensor_pallas`); the XLA
    reference needs neither (XLA partitions its maximum itself).

    Example:
        >>> q = quantize_per_tensor(jnp.ones((4, 32)), implementation="xla")
        >>> q.granularity, q.scale.shape, float(q.scale) >= 1 / 448
        ('tensor', (), True)
    """
    return dispatch(
        "quantize_per_tensor",
        implementation,
        interpret=interpret,
        mesh=mesh,
        pallas=lambda: quantize_per_tensor_pallas(
            x,
            fmt=fmt,
            group_size=group_size,
            tiles=tiles,
            interpret=interpret,
            mesh=mesh,
            partition=partition,
        ),
        xla=lambda: quantize_per_tensor_reference(x, fmt=fmt, group_size=group_size),
    )[1]

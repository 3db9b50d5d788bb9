"""The FP8 quantizers' public entry points and the choice of implementation (through
:func:`pallas_kernels.dispatch.dispatch`)."""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec

from pallas_kernels import quant
from pallas_kernels.dispatch import dispatch
from pallas_kernels.fp8_quant.config import (
    DEFAULT_TILES,
    TileConfig,
)
from pallas_kernels.fp8_quant.pallas_triton import (
    quantize_per_group_pallas,
    quantize_per_tensor_pallas,
)
from pallas_kernels.fp8_quant.reference import (
    quantize_per_group_reference,
    quantize_per_tensor_reference,
)
from pallas_kernels.quant import QuantizedTensor
from pallas_kernels.sharding import KernelMesh


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

    Examples:
        >>> import jax.numpy as jnp
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

    Examples:
        >>> import jax.numpy as jnp
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

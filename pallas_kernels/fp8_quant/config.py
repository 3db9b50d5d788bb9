"""Tile sizes of the FP8 element-wise kernels and the ``[M, D / G, G]`` view they tile."""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch settings of the element-wise FP8 kernels (upper bounds).

    The defaults are the fastest of a sweep (``benchmarks/fp8_tiles.py``,
    docs/bench_fp8_tiles.md): every setting gives the same
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

"""Tile sizes and launch settings of the block-scaled FP8 GEMM kernel."""

from __future__ import annotations

import dataclasses

from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class GemmTiles:
    """Output tile of one program (upper bounds) and the Triton launch settings.

    The contraction step is the operands' scaling block (``block`` of
    :func:`~pallas_kernels.fp8_blockgemm.blockwise_matmul`), so that each step multiplies one
    scale per row of ``a`` and one per column of ``b``. The tile used along ``M`` (``N``) is
    the largest power of two up to ``block_m`` (``block_n``) that divides it.
    """

    block_m: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_n", "num_warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value & (value - 1):
                raise ValueError(f"GemmTiles.{name} must be a positive power of two, got {value!r}")

        if not isinstance(self.num_stages, int) or self.num_stages <= 0:
            raise ValueError(
                f"GemmTiles.num_stages must be a positive int, got {self.num_stages!r}"
            )

    def compiler_params(self):
        return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


DEFAULT_GEMM_TILES = GemmTiles()

"""Static settings of the COAT AdamW step: the moments' quantization and the kernel's launch."""

from __future__ import annotations

import dataclasses

from pallas_kernels import quant


@dataclasses.dataclass(frozen=True)
class MomentSpec:
    """Static (structural) quantization settings of the two moments."""

    group_size: int = 128
    mu_format: str = "e4m3"
    nu_format: str = "e4m3"
    expansion: bool = True

    def __post_init__(self):
        quant.check_group_size(self.group_size)
        quant.fp8_format(self.mu_format)
        quant.fp8_format(self.nu_format)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch settings of the fused kernel (static: one compile per setting and shape).

    Attributes:
      block_rows: groups per program, a power of two (one group is ``group_size`` values).
      num_warps: Triton warps per program.
      num_stages: Triton pipelining stages (the kernel body has no loop to pipeline).
      fast_math: trade a few float32 ulps for throughput (see ``Math``): powers through the
        GPU's approximate ``ex2``/``lg2``, reciprocals, square roots and the update's division
        through ``rcp.approx``/``sqrt.approx``, divisions by per-group values as products with
        the reciprocal. Codes change only at rounding ties; the DRE exponent k, which a floor
        makes discontinuous, and the centre stay exactly the reference's computation. Several
        times faster than exact arithmetic (docs/optimizer_kernel.md).
      flat_stats: compute the per-group statistics (DRE exponent, centre, scale, and the
        reciprocals the element work multiplies by) on a vector of the tile's groups rather
        than on the ``[groups, 1]`` column the row reductions give. Triton lays that column out
        across all of a warp's lanes, each lane repeating every group's scalar arithmetic; a
        flat vector lets the compiler spread the groups over the lanes. Same values either way.
      tiles: tiles of ``block_rows`` groups each program handles, one after another in a loop
        (with ``num_stages > 1`` Triton may prefetch the next tile's loads under the current
        tile's arithmetic). ``1``: one tile per program, no loop.
    """

    # The fastest of the settings timed (docs/optimizer_kernel.md).
    block_rows: int = 16
    num_warps: int = 4
    num_stages: int = 1
    fast_math: bool = True
    flat_stats: bool = True
    tiles: int = 1

    def __post_init__(self):
        for name in ("block_rows", "num_warps", "tiles"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two, got {value!r}")
        if not isinstance(self.num_stages, int) or self.num_stages <= 0:
            raise ValueError(
                f"KernelConfig.num_stages must be a positive int, got {self.num_stages!r}"
            )
        for name in ("fast_math", "flat_stats"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"KernelConfig.{name} must be a bool, got {value!r}")


DEFAULT_CONFIG = KernelConfig()

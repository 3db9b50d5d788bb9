"""Block-scaled FP8 GEMM: DeepSeek-V3's ``1 x 128`` activation tiles and ``128 x 128`` weight
blocks, the scales applied inside the contraction loop.

The block-wise FP8 linear (``FP8Config(linear_scaling="block")``, :mod:`coat_jax.fp8.blockwise`)
quantizes each operand with one scale per block of 128 values of the GEMM's contraction axis.
Such scales do not factor out of the GEMM's sum, so neither cuBLASLt's per-tensor FP8 GEMM nor
a unit-scale GEMM followed by a rescale can run it: each block's partial product is scaled
before it joins the float32 accumulator.

* :func:`quantize_1x128`, :func:`quantize_128x128`, :func:`expand_block_scale`: the
  quantizers (plain jnp, left for XLA to fuse).
* :func:`blockwise_matmul`: the GEMM, a plain-jnp ``blockwise_matmul_reference`` (the CPU path
  and the numerics contract: a scan over the blocks of the contraction axis) and a Pallas
  Triton kernel, chosen by ``implementation="auto" | "xla" | "pallas"`` through the one
  dispatcher (:func:`pallas_kernels.dispatch.dispatch`); a Mosaic GPU kernel would be one more
  entry there. The kernel needs the contraction axis a multiple of the block, and ``M`` and
  ``N`` multiples of 16; the reference zero-pads a short last block.

Modules: ``config`` (:class:`GemmTiles`), ``reference``, ``pallas_triton`` and ``api``, as
:mod:`pallas_kernels.fp8_rowquant`.
"""

from pallas_kernels.fp8_blockgemm.api import blockwise_matmul
from pallas_kernels.fp8_blockgemm.config import DEFAULT_GEMM_TILES, GemmTiles
from pallas_kernels.fp8_blockgemm.pallas_triton import blockwise_matmul_pallas
from pallas_kernels.fp8_blockgemm.reference import (
    BLOCK,
    blockwise_matmul_reference,
    expand_block_scale,
    num_blocks,
    quantize_1x128,
    quantize_128x128,
)

__all__ = [
    "BLOCK",
    "DEFAULT_GEMM_TILES",
    "GemmTiles",
    "blockwise_matmul",
    "blockwise_matmul_pallas",
    "blockwise_matmul_reference",
    "expand_block_scale",
    "num_blocks",
    "quantize_1x128",
    "quantize_128x128",
]

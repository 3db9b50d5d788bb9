"""The block-scaled FP8 GEMM's public entry point and the choice of implementation (through
:func:`pallas_kernels.dispatch.dispatch`)."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.dispatch import dispatch
from pallas_kernels.fp8_blockgemm.config import DEFAULT_GEMM_TILES, GemmTiles
from pallas_kernels.fp8_blockgemm.pallas_triton import blockwise_matmul_pallas
from pallas_kernels.fp8_blockgemm.reference import (
    BLOCK,
    blockwise_matmul_reference,
    check_operands,
)
from pallas_kernels.sharding import KernelMesh


def blockwise_matmul(
    a_codes,
    a_scale,
    b_codes,
    b_scale,
    *,
    block: int = BLOCK,
    out_dtype=jnp.float32,
    implementation: str = "auto",
    interpret: bool = False,
    tiles: GemmTiles = DEFAULT_GEMM_TILES,
    mesh: KernelMesh | None = None,
):
    """``a [M, K] @ b [K, N]`` from FP8 codes with per-block scales, in ``out_dtype``:
    ``sum_k (A_k @ B_k) * a_scale[:, k, None] * b_scale[k, None, :]`` over the ``block``-wide
    slices ``k`` of the contraction axis, accumulated in float32.

    Args:
      a_codes, a_scale: FP8 codes ``[M, K]`` and float32 scales ``[M, ceil(K / block)]`` (one
        per row per block: ``quantize_1x128``).
      b_codes, b_scale: FP8 codes ``[K, N]`` and float32 scales ``[ceil(K / block), N]`` (one
        per column per block: ``expand_block_scale`` of a weight's ``quantize_128x128``).
      implementation: ``"auto"`` (the Pallas kernel where it applies, else the reference),
        ``"pallas"`` or ``"xla"``; ``interpret`` runs the kernel in Pallas interpret mode.

    Examples:
      >>> from pallas_kernels.fp8_blockgemm import quantize_1x128, quantize_128x128
      >>> from pallas_kernels.fp8_blockgemm import expand_block_scale
      >>> a, (wc, ws) = quantize_1x128(jnp.ones((16, 256))), quantize_128x128(jnp.ones((256, 32)))
      >>> out = blockwise_matmul(a.codes, a.scale, wc, expand_block_scale(ws, 32))
      >>> out.shape, round(float(out[0, 0]), 3)
      ((16, 32), 256.0)
    """
    check_operands(a_codes, a_scale, b_codes, b_scale, block)
    kw = dict(block=block, out_dtype=out_dtype)
    return dispatch(
        "blockwise_matmul",
        implementation,
        interpret=interpret,
        mesh=mesh,
        pallas=lambda: blockwise_matmul_pallas(
            a_codes, a_scale, b_codes, b_scale, **kw, tiles=tiles, interpret=interpret, mesh=mesh
        ),
        xla=lambda: blockwise_matmul_reference(a_codes, a_scale, b_codes, b_scale, **kw),
    )[1]

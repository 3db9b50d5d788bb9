"""Pallas Triton kernel of the block-scaled FP8 GEMM: one program per output tile, the
contraction axis walked one scaling block at a time, each block's FP8 product multiplied by its
scales before it joins the float32 accumulator.

A program holds ``[block_m, block_n]`` of the output. Each step of its loop loads ``[block_m,
block]`` codes of ``a`` and ``[block, block_n]`` codes of ``b``, multiplies them on the FP8
tensor cores (float32 result), and scales the partial product by ``a``'s scales of that block
(one per row) and ``b``'s (one per column), as DeepSeek-V3 promotes its partial sums to float32
with their scales applied. Operands of two FP8 formats (the backward's E5M2 gradient times
E4M3 codes) run on the BF16 tensor cores instead.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.dispatch import require_gpu
from pallas_kernels.fp8_blockgemm.config import DEFAULT_GEMM_TILES
from pallas_kernels.fp8_blockgemm.reference import BLOCK, check_operands
from pallas_kernels.fp8_quant import pow2_divisor

# Triton's dot wants at least 16 rows, columns and contraction values per tile.
MIN_TILE = 16


def _kernel(a_ref, sa_ref, b_ref, sb_ref, o_ref, *, block):
    rows, cols = o_ref.shape
    # Triton's dot takes two FP8 operands of one format only: an E5M2 gradient times E4M3
    # codes is multiplied in BF16, which holds every value of both formats exactly.
    mixed = a_ref.dtype != b_ref.dtype

    def step(k, acc):
        ks = pl.ds(pl.multiple_of(k * block, block), block)
        a, b = a_ref[:, ks], b_ref[ks, :]
        if mixed:
            a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
        part = jnp.dot(a, b, preferred_element_type=jnp.float32)
        return acc + part * sa_ref[:, pl.ds(k, 1)] * sb_ref[pl.ds(k, 1), :]

    acc = jax.lax.fori_loop(0, sa_ref.shape[1], step, jnp.zeros((rows, cols), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _tile(n: int, cap: int, axis: str, shape) -> int:
    tile = pow2_divisor(n, cap)
    if tile < MIN_TILE:
        raise NotImplementedError(
            f"the block GEMM kernel needs {axis} of {shape} to be a multiple of {MIN_TILE} "
            "(other shapes run on the XLA reference)"
        )
    return tile


def blockwise_matmul_pallas(
    a_codes,
    a_scale,
    b_codes,
    b_scale,
    *,
    block: int = BLOCK,
    out_dtype=jnp.float32,
    tiles=DEFAULT_GEMM_TILES,
    interpret: bool = False,
    mesh=None,
):
    """:func:`~pallas_kernels.fp8_blockgemm.blockwise_matmul_reference` in one kernel.

    ``NotImplementedError`` (so that ``implementation="auto"`` runs the reference) for a
    contraction axis that is not a multiple of ``block``, ``M`` or ``N`` not a multiple of 16,
    a ``block`` that is not a power of two of at least 16, and under a kernel mesh (the kernel
    has no per-shard wrapper).
    """
    check_operands(a_codes, a_scale, b_codes, b_scale, block)
    if mesh is not None:
        raise NotImplementedError("the block GEMM kernel runs on one device (no mesh wrapper)")
    (m, k), n = a_codes.shape, b_codes.shape[1]
    if block < MIN_TILE or block & (block - 1):
        raise NotImplementedError(
            f"the block GEMM kernel needs block a power of two >= 16, got {block}"
        )
    if k % block:
        raise NotImplementedError(
            f"the block GEMM kernel needs the contraction axis K={k} (a {a_codes.shape} @ b "
            f"{b_codes.shape}) to be a multiple of block={block}; pad K or run the XLA "
            "reference, which zero-pads the last block"
        )
    require_gpu(interpret)
    rows = _tile(m, tiles.block_m, "M", a_codes.shape)
    cols = _tile(n, tiles.block_n, "N", b_codes.shape)
    kb = k // block
    return pl.pallas_call(
        functools.partial(_kernel, block=block),
        grid=(m // rows, n // cols),
        in_specs=[
            pl.BlockSpec((rows, k), lambda i, j: (i, 0)),
            pl.BlockSpec((rows, kb), lambda i, j: (i, 0)),
            pl.BlockSpec((k, cols), lambda i, j: (0, j)),
            pl.BlockSpec((kb, cols), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((rows, cols), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        compiler_params=tiles.compiler_params(),
        interpret=interpret,
        name="fp8_blockwise_matmul",
    )(a_codes, a_scale, b_codes, b_scale)

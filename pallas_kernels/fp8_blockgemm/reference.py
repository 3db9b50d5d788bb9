"""Block-scaled FP8 quantizers and GEMM in plain jnp: the numerics contract and the CPU path.

DeepSeek-V3's fine-grained scaling (arXiv:2412.19437, section 3.3): activations in ``1 x 128``
tiles (one scale per row per 128 consecutive values of the contraction axis), weights in
``128 x 128`` blocks. A scale that changes along the contraction axis does not factor out of a
GEMM's sum, so the GEMM multiplies the scales into each block's partial product:

    out = sum_k (A[:, k-th block] @ B[k-th block, :]) * sa[:, k, None] * sb[k, None, :]

in float32. ``sb [Kb, N]`` is one scale per column of ``B`` per block of the contraction axis:
a weight's ``128 x 128`` block scales repeated over the block's columns
(:func:`expand_block_scale`), or an output gradient's ``1 x 128`` tiles along the tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import quant
from pallas_kernels.quant import QuantizedTensor

# DeepSeek-V3's tile: 128 values of the contraction axis per scale.
BLOCK = 128


def num_blocks(n: int, block: int) -> int:
    """Blocks of ``block`` covering ``n`` values (a short last block is zero-padded)."""
    return -(-n // block)


def quantize_1x128(x: jax.Array, *, block: int = BLOCK, fmt: str = "e4m3") -> QuantizedTensor:
    """``x [..., K]`` in ``1 x block`` tiles along its last axis: one float32 absmax scale per
    row per ``block`` consecutive values (``scale [..., ceil(K / block)]``; a short last tile
    is zero-padded), COAT's absmax rule ``s = (max|x| + 1e-20) / fmax``.

    Examples:
      >>> q = quantize_1x128(jnp.ones((4, 256)))
      >>> q.codes.dtype, q.scale.shape
      (dtype(float8_e4m3fn), (4, 2))
    """
    return quant.quantize_absmax(x, group_size=block, fmt=fmt)


def quantize_128x128(
    w: jax.Array, *, block: int = BLOCK, fmt: str = "e4m3"
) -> tuple[jax.Array, jax.Array]:
    """``w [K, N]`` in ``block x block`` blocks: ``(codes [K, N], scale [Kb, Nb])`` with one
    float32 absmax scale per block (partial edge blocks zero-padded).

    Examples:
      >>> codes, scale = quantize_128x128(jnp.ones((256, 384)))
      >>> codes.shape, scale.shape
      ((256, 384), (2, 3))
    """
    if w.ndim != 2:
        raise ValueError(f"quantize_128x128 takes a 2-D weight [K, N], got shape {w.shape}")
    k, n = w.shape
    kb, nb = num_blocks(k, block), num_blocks(n, block)
    padded = jnp.pad(w.astype(jnp.float32), ((0, kb * block - k), (0, nb * block - n)))
    w4 = padded.reshape(kb, block, nb, block)
    scale = quant.absmax_scale(jnp.max(jnp.abs(w4), axis=(1, 3)), quant.FP8_MAX[fmt], "float32")
    codes = quant.cast_to_fp8(w4 / scale[:, None, :, None], fmt)
    return codes.reshape(kb * block, nb * block)[:k, :n], scale


def expand_block_scale(scale: jax.Array, n: int, block: int = BLOCK) -> jax.Array:
    """Block scales ``[Kb, Nb]`` as one scale per column ``[Kb, n]``: the ``sb`` operand of
    :func:`blockwise_matmul_reference` (pass ``scale.T`` for the transposed weight)."""
    return jnp.repeat(scale, block, axis=1)[:, :n]


def check_operands(a_codes, a_scale, b_codes, b_scale, block: int) -> None:
    """``ValueError`` naming the shapes unless ``a [M, K]``, ``sa [M, Kb]``, ``b [K, N]``,
    ``sb [Kb, N]`` with ``Kb = ceil(K / block)``."""
    if a_codes.ndim != 2 or b_codes.ndim != 2 or a_codes.shape[1] != b_codes.shape[0]:
        raise ValueError(
            f"blockwise_matmul takes a [M, K] and b [K, N]; got a {a_codes.shape} and "
            f"b {b_codes.shape}"
        )
    (m, k), n = a_codes.shape, b_codes.shape[1]
    kb = num_blocks(k, quant.check_group_size(block))
    if a_scale.shape != (m, kb) or b_scale.shape != (kb, n):
        raise ValueError(
            f"blockwise_matmul with K={k} and block={block} takes scales a_scale {(m, kb)} and "
            f"b_scale {(kb, n)}; got {a_scale.shape} and {b_scale.shape}"
        )


def blockwise_matmul_reference(
    a_codes, a_scale, b_codes, b_scale, *, block: int = BLOCK, out_dtype=jnp.float32
) -> jax.Array:
    """``sum_k (A_k @ B_k) * sa[:, k, None] * sb[k, None, :]`` over the ``block``-wide slices of
    the contraction axis, accumulated in float32 block after block, written in ``out_dtype``.

    Args:
      a_codes: FP8 codes ``[M, K]``; ``a_scale`` float32 ``[M, Kb]``, ``Kb = ceil(K / block)``.
      b_codes: FP8 codes ``[K, N]``; ``b_scale`` float32 ``[Kb, N]``.

    Equal to the float32 product of the dequantized operands up to the order of float32
    summation: the product of two FP8 values is exact in float32. A ``K`` that is not a
    multiple of ``block`` is zero-padded.
    """
    check_operands(a_codes, a_scale, b_codes, b_scale, block)
    (m, k), n = a_codes.shape, b_codes.shape[1]
    kb = num_blocks(k, block)
    pad = kb * block - k
    a_blocks = jnp.pad(a_codes, ((0, 0), (0, pad))).reshape(m, kb, block).transpose(1, 0, 2)
    b_blocks = jnp.pad(b_codes, ((0, pad), (0, 0))).reshape(kb, block, n)

    def step(acc, blocks):
        a_k, b_k, sa_k, sb_k = blocks
        # Unit-scale dot of converted codes: the spelling XLA's FP8 GEMM rewriter takes.
        part = jax.lax.dot(
            a_k.astype(jnp.float32), b_k.astype(jnp.float32), preferred_element_type=jnp.float32
        )
        return acc + part * sa_k[:, None] * sb_k[None, :], None

    acc, _ = jax.lax.scan(
        step, jnp.zeros((m, n), jnp.float32), (a_blocks, b_blocks, a_scale.T, b_scale)
    )
    return acc.astype(out_dtype)

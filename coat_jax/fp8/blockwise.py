"""Block-wise scaled FP8 linear: DeepSeek-V3's ``1 x 128`` activation tiles and ``128 x 128``
weight blocks (``FP8Config(linear_scaling="block")``).

Forward, for ``x [..., K]`` and ``w [K, N]`` (``pallas_kernels.fp8_blockgemm``)::

    x_q, s_x = E4M3(x) in 1 x 128 tiles along K      (s_x [M, K / 128])
    w_q, s_w = E4M3(w) in 128 x 128 blocks           (s_w [K / 128, N / 128])
    y = sum_k (x_q[:, k] @ w_q[k, :]) * s_x[:, k] * s_w[k, n / 128]      (float32 accumulation)

A scale per block of the contraction axis follows the values more closely than one per row or
per tensor (an outlier inflates the scale of its 128 values only), at the price of a GEMM that
applies the scales inside its K loop: :func:`~pallas_kernels.fp8_blockgemm.blockwise_matmul`, a
Pallas kernel on a GPU, a scan over the blocks elsewhere (``FP8Config.implementation`` and
``op_implementations`` entry ``"blockwise_gemm"``). It is not cuBLASLt's FP8 GEMM, which takes
one scale per operand.

Saved for backward: ``x``'s E4M3 codes and ``1 x 128`` scales (a
:class:`~pallas_kernels.quant.QuantizedTensor` with groups of 128, tagged :data:`ACTIVATION`)
and a reference to the master weight, which backward quantizes again into the same blocks
(``weight_residual="master"``, the only one this op takes).

Backward (``dy [..., N]``), every operand again scaled per block of its GEMM's contraction axis,
as DeepSeek-V3:

* ``dx = dy @ w.T``: ``dy`` in ``1 x 128`` tiles along N (``FP8Config.grad_format``, E5M2 by
  default where DeepSeek-V3 takes E4M3), ``w`` as the transposed view of its ``128 x 128``
  blocks.
* ``dw = x.T @ dy``, in FP8 too: ``x`` dequantized from its saved codes and quantized again in
  tiles of 128 tokens per input channel, ``dy`` in tiles of 128 tokens per output channel.

Shapes: a contraction axis that is not a multiple of 128 (``K`` forward, ``N`` for ``dx``, the
tokens for ``dw``) zero-pads its last block in the reference; the Pallas kernel refuses it, so
``implementation="auto"`` runs the reference there and ``"pallas"`` names the shape. FP8 codes
made by XLA pass :func:`~coat_jax.fp8.residuals.pin`, as the other linears' quantizers do.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from coat_jax.fp8.residuals import keep, pin
from coat_jax.fp8.rowwise import as_weights, check_linear
from pallas_kernels import fp8_blockgemm
from pallas_kernels.fp8_blockgemm import BLOCK, expand_block_scale
from pallas_kernels.quant import QuantizedTensor


def _tiles(x2: jax.Array, fmt: str, config) -> QuantizedTensor:
    """``x2 [R, C]`` in ``1 x 128`` tiles along ``C``."""
    q = fp8_blockgemm.quantize_1x128(x2, block=BLOCK, fmt=fmt)
    return dataclasses.replace(q, codes=pin(q.codes, config))


def _weight_blocks(w: jax.Array, config) -> tuple[jax.Array, jax.Array]:
    codes, scale = fp8_blockgemm.quantize_128x128(w, block=BLOCK, fmt=config.act_format)
    return pin(codes, config), scale


def _gemm(a_codes, a_scale, b_codes, b_scale, config, out_dtype):
    return fp8_blockgemm.blockwise_matmul(
        a_codes,
        a_scale,
        b_codes,
        b_scale,
        block=BLOCK,
        out_dtype=out_dtype,
        implementation=config.implementation_of("blockwise_gemm"),
        interpret=config.interpret,
        mesh=config.mesh,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def fp8_blockwise_linear(x: jax.Array, w, config):
    """``x @ w`` as an FP8 GEMM with ``1 x 128`` tile scales of ``x`` and ``128 x 128`` block
    scales of ``w``, applied inside the contraction loop (float32 accumulation).

    Args:
      x: activations ``[..., K]`` (BF16 or float32).
      w: master weight ``[K, N]`` or a tuple of them sharing the input (q|k|v, gate|up: ``x``
        is quantized and kept once).
      config: a static ``coat_jax.fp8_ops.FP8Config`` with ``linear_scaling="block"`` (its
        formats, ``implementation`` / ``op_implementations["blockwise_gemm"]``,
        ``interpret`` and ``codes_barrier`` apply).

    Returns:
      ``[..., N]`` in ``x.dtype`` (a tuple for a tuple ``w``); weight gradients come back in
      each master weight's dtype.

    Examples:
      >>> from coat_jax.fp8_ops import FP8Config
      >>> x = jnp.ones((2, 8, 32), jnp.bfloat16)
      >>> fp8_blockwise_linear(x, jnp.ones((32, 16)), FP8Config(linear_scaling="block")).shape
      (2, 8, 16)
    """
    return _fp8_blockwise_linear_fwd(x, w, config)[0]


def _fp8_blockwise_linear_fwd(x, w, config):
    check_linear(x, w, config, "fp8_blockwise_linear", ("block",))
    k = x.shape[-1]
    x_q = _tiles(x.reshape(-1, k), config.act_format, config)
    ys = []
    for wi in as_weights(w):
        n = wi.shape[1]
        w_codes, w_scale = _weight_blocks(wi, config)
        sb = expand_block_scale(w_scale, n, BLOCK)
        y = _gemm(x_q.codes, x_q.scale, w_codes, sb, config, x.dtype)
        ys.append(y.reshape(*x.shape[:-1], n))
    # Kept in x's shape (scales of its rank), so that its sharding carries over.
    kept = dataclasses.replace(
        x_q, codes=x_q.codes.reshape(x.shape), scale=x_q.scale.reshape(*x.shape[:-1], -1)
    )
    out = tuple(ys) if isinstance(w, (tuple, list)) else ys[0]
    return out, (keep(kept), w)


def _fp8_blockwise_linear_bwd(config, res, dy):
    x_q, w = res
    weights, dys = as_weights(w), as_weights(dy)
    compute = dys[0].dtype
    k = x_q.shape[-1]
    x = x_q.dequantize().reshape(-1, k)
    # dw contracts over the tokens: x in tiles of 128 tokens per input channel.
    xt_q = _tiles(x.T, config.act_format, config)
    # A tuple of weights sums its input gradients in float32.
    dx_dtype = compute if len(dys) == 1 else jnp.float32
    dx, dws = None, []
    for wi, dyi in zip(weights, dys, strict=True):
        n = wi.shape[1]
        dy2 = dyi.reshape(-1, n)
        dy_q = _tiles(dy2, config.grad_format, config)
        w_codes, w_scale = _weight_blocks(wi, config)
        sb = expand_block_scale(w_scale.T, k, BLOCK)
        dx_i = _gemm(dy_q.codes, dy_q.scale, w_codes.T, sb, config, dx_dtype)
        dx = dx_i if dx is None else dx + dx_i
        dyt_q = _tiles(dy2.T, config.grad_format, config)
        dw = _gemm(xt_q.codes, xt_q.scale, dyt_q.codes.T, dyt_q.scale.T, config, jnp.float32)
        dws.append(dw.astype(wi.dtype))
    dx = dx.astype(compute).reshape(*dys[0].shape[:-1], k)
    return dx, (type(w)(dws) if isinstance(w, (tuple, list)) else dws[0])


fp8_blockwise_linear.defvjp(_fp8_blockwise_linear_fwd, _fp8_blockwise_linear_bwd)

"""Block-scaled FP8 GEMM (``pallas_kernels.fp8_blockgemm``): the Pallas kernel against its jnp
reference on each backend of tests/kernels/contract.py, and the reference against the float64
product of the dequantized operands.

The kernel and the reference sum the same float32 partial products block after block, so they
agree to float32 rounding (relative 1e-6); the reference equals the dequantized product up to
the order of float32 summation (the product of two FP8 values is exact in float32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fp8_blockgemm as bg
from pallas_kernels.fp8_blockgemm import GemmTiles
from tests.kernels.contract import Backend, CompiledGPU, Interpret


def data(shape, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    spread = 10.0 ** jax.random.uniform(k2, shape, minval=-2.0, maxval=2.0)
    return spread * jax.random.normal(k1, shape)


def operands(m, k, n, block, a_fmt="e4m3"):
    a = bg.quantize_1x128(data((m, k)), block=block, fmt=a_fmt)
    w_codes, w_scale = bg.quantize_128x128(0.05 * data((k, n), seed=1), block=block)
    return a.codes, a.scale, w_codes, bg.expand_block_scale(w_scale, n, block)


def dequantized_product(a_codes, a_scale, b_codes, b_scale, block):
    f64 = lambda v: np.asarray(v, np.float64)
    a = f64(a_codes.astype(jnp.float32)) * np.repeat(f64(a_scale), block, 1)[:, : a_codes.shape[1]]
    b = f64(b_codes.astype(jnp.float32)) * np.repeat(f64(b_scale), block, 0)[: b_codes.shape[0]]
    return a @ b


def rel(a, ref):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


# (M, K, N, block, tiles, format of a, output dtype): DeepSeek-V3's block with two K steps and
# two column tiles; a small block and output tiles narrower than the tile bounds, an E5M2
# gradient times E4M3 weights (as in the input gradient), written in BF16.
CASES = [
    (32, 256, 256, 128, GemmTiles(), "e4m3", jnp.float32),
    (32, 64, 32, 32, GemmTiles(block_m=16, block_n=16), "e5m2", jnp.bfloat16),
]


class Fp8BlockGemmContract(Backend):
    @pytest.mark.parametrize(("m", "k", "n", "block", "tiles", "a_fmt", "out_dtype"), CASES)
    def test_kernel_matches_reference(self, m, k, n, block, tiles, a_fmt, out_dtype):
        ops = operands(m, k, n, block, a_fmt)
        kernel = functools.partial(
            bg.blockwise_matmul_pallas,
            block=block,
            out_dtype=out_dtype,
            tiles=tiles,
            interpret=self.interpret,
        )
        got = jax.jit(kernel)(*ops)
        want = bg.blockwise_matmul_reference(*ops, block=block)
        assert got.dtype == out_dtype and got.shape == (m, n)
        # float32: the same sums in the same order; BF16: one rounding of the result.
        assert rel(got, want) < (1e-6 if out_dtype == jnp.float32 else 2**-8)


class TestInterpret(Fp8BlockGemmContract, Interpret):
    pass


class TestCompiledGPU(Fp8BlockGemmContract, CompiledGPU):
    pass


def test_reference_is_the_dequantized_product():
    # Two blocks along K = 200, the short last one zero-padded.
    k, n = 200, 136
    ops = operands(16, k, n, 128)
    assert ops[1].shape == (16, -(-k // 128)) and ops[3].shape == (-(-k // 128), n)
    got = jax.jit(bg.blockwise_matmul_reference)(*ops)
    assert rel(got, dequantized_product(*ops, 128)) < 1e-6


def test_weight_blocks_have_one_absmax_scale_each():
    w = data((200, 136), seed=2)
    codes, scale = bg.quantize_128x128(w)
    assert codes.dtype == jnp.float8_e4m3fn and codes.shape == w.shape and scale.shape == (2, 2)
    w64 = np.asarray(w, np.float64)
    for i, j in np.ndindex(2, 2):
        block = w64[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)]
        np.testing.assert_allclose(scale[i, j], (np.abs(block).max() + 1e-20) / 448, rtol=1e-6)
    deq = (
        np.asarray(codes.astype(jnp.float32))
        * np.repeat(np.repeat(scale, 128, 0), 128, 1)[:200, :136]
    )
    assert np.all(
        np.abs(deq - w64)
        <= 2**-4 * np.abs(w64) + 2**-9 * np.repeat(np.repeat(scale, 128, 0), 128, 1)[:200, :136]
    )


def test_shapes_the_kernel_cannot_take_fall_back_or_name_the_shape():
    ops = operands(16, 200, 32, 128)
    want = bg.blockwise_matmul_reference(*ops)
    got = bg.blockwise_matmul(*ops, implementation="auto", interpret=True)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=r"cannot run blockwise_matmul.*K=200.*multiple of block"):
        bg.blockwise_matmul(*ops, implementation="pallas", interpret=True)
    with pytest.raises(ValueError, match=r"takes scales a_scale \(16, 2\)"):
        bg.blockwise_matmul(ops[0], ops[1][:, :1], ops[2], ops[3], implementation="xla")

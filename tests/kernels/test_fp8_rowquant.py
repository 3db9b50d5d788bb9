"""Row-quantizing producers (``pallas_kernels.fp8_rowquant``): Pallas kernels against their jnp
references, the contract runs on each backend of tests/kernels/contract.py.

The saved 1xG tensors and RMSNorm's ``rstd`` match as in tests/kernels/test_fp8_act.py. The
row-quantized output is compared through its scale and its dequantized values: the BF16
intermediate the row is quantized from may be rounded differently by the kernel and by XLA
(which may keep excess precision), one BF16 rounding, so a row's scale may differ by that
(relative 2^-7 at most) and a value by one E4M3 step (2^-3 relative) plus that.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fp8_rowquant
from pallas_kernels.fp8_quant import TileConfig
from tests.kernels.contract import Backend, CompiledGPU, Interpret

# Several chunks per row: 2 of 2 groups (4 rows a program); 3 of 2 groups (an odd number of
# rows, one a program).
CASES = [((4, 6, 64), TileConfig(norm_block_rows=4, block_groups=2)), ((5, 96), TileConfig())]


def data(shape, dtype=jnp.bfloat16, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    rows = 10.0 ** jax.random.uniform(k2, shape[:-1] + (1,), minval=-3.0, maxval=3.0)
    return (rows * jax.random.normal(k1, shape)).astype(dtype)


def assert_rows_match(got, want):
    assert (got.codes.dtype, got.codes.shape) == (want.codes.dtype, want.codes.shape)
    assert got.scale.shape == want.scale.shape == want.codes.shape[:-1] + (1,)
    assert (got.group_size, got.granularity) == (want.group_size, "group")
    np.testing.assert_allclose(got.scale, want.scale, rtol=2**-7)
    g, w = np.asarray(got.dequantize()), np.asarray(want.dequantize())
    bound = 2**-3 * np.abs(w) + 2**-7 * 448 * np.asarray(want.scale) * 2**-3
    assert np.all(np.abs(g - w) <= bound)
    assert np.mean(got.codes.astype(jnp.float32) != want.codes.astype(jnp.float32)) < 0.2


def assert_saved_equal(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=0
        )


class Fp8RowquantContract(Backend):
    """The producers' contract, run on each backend by the subclasses below."""

    @pytest.mark.parametrize(("shape", "tiles"), CASES)
    def test_rmsnorm_rowwise_matches_reference(self, shape, tiles):
        x, w = data(shape), 1.0 + 0.1 * jax.random.normal(jax.random.key(3), shape[-1:])
        kernel = functools.partial(
            fp8_rowquant.rmsnorm_rowwise_pallas, tiles=tiles, interpret=self.interpret
        )
        y_q, x_q, rstd = jax.jit(kernel, static_argnums=2)(x, w, 1e-6)
        ry, rx, rr = fp8_rowquant.rmsnorm_rowwise_reference(x, w, 1e-6)
        assert_rows_match(y_q, ry)
        assert_saved_equal(x_q, rx)
        np.testing.assert_allclose(rstd, rr, rtol=1e-5)

    @pytest.mark.parametrize(("shape", "tiles"), CASES)
    def test_swiglu_rowwise_matches_reference(self, shape, tiles):
        gate, up = data(shape, seed=1), data(shape, seed=2)
        kernel = functools.partial(
            fp8_rowquant.swiglu_rowwise_pallas, tiles=tiles, interpret=self.interpret
        )
        h_q, g_q, u_q = jax.jit(kernel)(gate, up)
        rh, rg, ru = fp8_rowquant.swiglu_rowwise_reference(gate, up)
        assert_rows_match(h_q, rh)
        assert_saved_equal((g_q, u_q), (rg, ru))


class TestInterpret(Fp8RowquantContract, Interpret):
    pass


class TestCompiledGPU(Fp8RowquantContract, CompiledGPU):
    pass


def test_row_scale_is_the_absmax_of_the_producer_output():
    x = data((3, 64))
    y_q, _, _ = fp8_rowquant.rmsnorm_rowwise_reference(x, jnp.ones(64), 1e-6)
    x64 = np.asarray(x, np.float64)
    y = x64 / np.sqrt(np.mean(x64**2, -1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(y_q.scale, np.abs(y).max(-1, keepdims=True) / 448, rtol=2**-7)


@pytest.mark.parametrize("op", ["rmsnorm_rowwise", "swiglu_rowwise"])
def test_dispatch_falls_back_and_names_the_shape(op):
    x = data((4, 40))  # 40 is not a multiple of the group size 16
    args = (x, jnp.ones(40), 1e-6) if op == "rmsnorm_rowwise" else (x, x)
    public = getattr(fp8_rowquant, op)
    ref = getattr(fp8_rowquant, f"{op}_reference")(*args)
    got = public(*args, implementation="auto", interpret=True)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=rf"implementation='pallas' cannot run {op}.*40"):
        public(*args, implementation="pallas", interpret=True)

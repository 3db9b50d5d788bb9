"""The Pallas FP8 element-wise kernels (fused RMSNorm / SiLU / product / SwiGLU with their FP8
residuals, pallas_kernels/fp8_act/) against their jnp references.

The contract runs on each backend of tests/kernels/contract.py; the checks and their tolerances
are in tests/kernels/fp8_checks.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax import quant
from pallas_kernels import fp8_act, fp8_quant
from tests.kernels.contract import CompiledGPU, Interpret
from tests.kernels.fp8_checks import (
    NORM_SHAPES,
    SHAPES,
    Fp8KernelContract,
    assert_close,
    assert_codes_match,
    assert_saved_format,
    assert_scales_match,
    data,
)


def _cases(shapes):
    """(shape, dtype, scale format): every shape, and every dtype with both scale formats, the
    shapes taken in turn (two shapes: each with both dtypes and both scale formats). The three
    are independent options of the kernels, so a fuller product would compile more programs
    for no other path."""
    formats = quant.SCALE_FORMATS
    pairs = [
        (dtype, formats[(i + j) % len(formats)])
        for j, dtype in enumerate((jnp.bfloat16, jnp.float32))
        for i in range(len(formats))
    ]
    return [
        (shapes[k % len(shapes)], *pairs[k % len(pairs)])
        for k in range(max(len(shapes), len(pairs)))
    ]


class Fp8ActContract(Fp8KernelContract):
    @pytest.mark.parametrize("shape,dtype,scale_format", _cases(NORM_SHAPES))
    def test_rmsnorm_kernels(self, shape, dtype, scale_format):
        x = data(shape, dtype, seed=2)
        w = 1.0 + 0.1 * jax.random.normal(jax.random.key(3), shape[-1:])
        got, ref = self.both(fp8_act.rmsnorm_fwd, x, w, 1e-6, scale_format=scale_format)
        assert_saved_format(got[1:2] + ref[1:2], scale_format)
        assert_close(got[0], ref[0], dtype)
        assert_codes_match(got[1].codes, ref[1].codes)
        assert_scales_match(got[1].scale, ref[1].scale)
        assert_close(got[2], ref[2], jnp.float32)
        dy = jax.random.normal(jax.random.key(4), shape, dtype)
        (dx, dw), (dx_ref, dw_ref) = self.both(fp8_act.rmsnorm_bwd, dy, *ref[1:], w)
        # Row sums in a different order: a few float32 roundings, then the output rounding.
        np.testing.assert_allclose(
            np.asarray(dx, np.float32), np.asarray(dx_ref, np.float32), rtol=1e-2, atol=1e-6
        )
        np.testing.assert_allclose(dw, dw_ref, rtol=1e-4, atol=1e-6)
        assert dx.dtype == dtype and dw.dtype == w.dtype

    @pytest.mark.parametrize("shape,dtype,scale_format", _cases(SHAPES))
    def test_silu_kernels(self, shape, dtype, scale_format):
        x = data(shape, dtype, seed=5)
        got, ref = self.both(fp8_act.silu_fwd, x, scale_format=scale_format)
        assert_saved_format(got[1:2] + ref[1:2], scale_format)
        assert_close(got[0], ref[0], dtype)
        assert_codes_match(got[1].codes, ref[1].codes)
        assert_scales_match(got[1].scale, ref[1].scale)
        dy = jax.random.normal(jax.random.key(6), shape, dtype)
        dx, dx_ref = self.both(fp8_act.silu_bwd, dy, *ref[1:])
        assert_close(dx, dx_ref, dtype)

    @pytest.mark.parametrize("shape,dtype,scale_format", _cases(SHAPES))
    def test_mul_kernels(self, shape, dtype, scale_format):
        a, b = data(shape, dtype, seed=7), data(shape, dtype, seed=8)
        got, ref = self.both(fp8_act.mul_fwd, a, b, scale_format=scale_format)
        assert_saved_format(got[1:3] + ref[1:3], scale_format)
        assert_close(got[0], ref[0], dtype)
        for i in (1, 2):
            assert_codes_match(got[i].codes, ref[i].codes)
            assert_scales_match(got[i].scale, ref[i].scale)
        dy = jax.random.normal(jax.random.key(9), shape, dtype)
        (da, db), (da_ref, db_ref) = self.both(fp8_act.mul_bwd, dy, *ref[1:])
        assert_close(da, da_ref, dtype)
        assert_close(db, db_ref, dtype)

    @pytest.mark.parametrize("shape,dtype,scale_format", _cases(SHAPES))
    def test_swiglu_kernels(self, shape, dtype, scale_format):
        g, u = data(shape, dtype, seed=10), data(shape, dtype, seed=11)
        got, ref = self.both(fp8_act.swiglu_fwd, g, u, scale_format=scale_format)
        assert_saved_format(got[1:3] + ref[1:3], scale_format)
        assert_close(got[0], ref[0], dtype)
        for i in (1, 2):
            assert_codes_match(got[i].codes, ref[i].codes)
            assert_scales_match(got[i].scale, ref[i].scale)
        dy = jax.random.normal(jax.random.key(12), shape, dtype)
        (dg, du), (dg_ref, du_ref) = self.both(fp8_act.swiglu_bwd, dy, *ref[1:])
        assert_close(dg, dg_ref, dtype)
        assert_close(du, du_ref, dtype)


class TestInterpret(Fp8ActContract, Interpret):
    pass


class TestCompiledGPU(Fp8ActContract, CompiledGPU):
    pass


def test_implementation_switch():
    x = jnp.ones((4, 40))  # 40 is not a multiple of 16
    with pytest.raises(ValueError, match="multiple of the group size"):
        fp8_act.silu_fwd(x, implementation="pallas", interpret=True)
    with pytest.raises(ValueError, match="power-of-two number of groups"):
        fp8_act.rmsnorm_fwd(jnp.ones((4, 48)), jnp.ones(48), 1e-6, implementation="pallas")
    with pytest.raises(ValueError, match="valid values"):
        fp8_quant.quantize_per_group(x, implementation="triton")
    # auto: the reference off the GPU, and for shapes the kernels do not take.
    np.testing.assert_array_equal(
        fp8_act.silu_fwd(x, implementation="auto")[0], fp8_act.silu_fwd_reference(x)[0]
    )
    assert fp8_act.pallas_supports("silu", (4, 48)) and not fp8_act.pallas_supports(
        "rmsnorm", (4, 48)
    )
    with pytest.raises(ValueError, match="power of two"):
        fp8_quant.TileConfig(block_rows=12)

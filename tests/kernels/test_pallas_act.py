"""Pallas FP8 kernels (quantizers, fused RMSNorm / SiLU / product) against their XLA references.

On the CPU the kernels run in interpret mode; on a GPU they run compiled by Triton. Codes must be
identical except for rare rounding ties (the kernel and XLA may evaluate ``x / s`` with different
rounding; at most 0.1% of codes may differ, by one FP8 step); scales must be equal to float32
rounding; outputs equal up to one rounding of the output dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax import quant
from pallas_kernels import fp8_act, fp8_quant

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
# Shapes: plain; rows and groups that the default tiles do not divide (12 rows, 3 / 6 groups).
SHAPES = [(4, 8, 64), (12, 48), (3, 5, 96)]
NORM_SHAPES = [(4, 8, 64), (12, 128)]


def data(shape, dtype, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    rows = 10.0 ** jax.random.uniform(k2, shape[:-1] + (1,), minval=-4.0, maxval=4.0)
    return (rows * jax.random.normal(k1, shape)).astype(dtype)


def assert_codes_match(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    g = np.asarray(got.astype(jnp.float32))
    w = np.asarray(want.astype(jnp.float32))
    differ = g != w
    assert differ.mean() <= 1e-3, differ.mean()
    if differ.any():
        # A tie broken the other way lands on the neighbouring code: within one FP8 step.
        np.testing.assert_allclose(g[differ], w[differ], rtol=0.26)


def assert_close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    # Two roundings of the output dtype, or a few float32 ulps where exp / rsqrt differ.
    rtol = max(2 * float(jnp.finfo(dtype).eps), 1e-5)
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=rtol, atol=1e-30
    )


def assert_scales_match(got, want):
    """float32 scales equal to float32 rounding; E8M0 bytes equal (a scale within float32
    rounding of a power of two may round up on one side only: one exponent step, rarely)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype != jnp.uint8:
        assert_close(got, want, jnp.float32)
        return
    g, w = np.asarray(got, np.int32), np.asarray(want, np.int32)
    assert (g != w).mean() <= 1e-3 and np.abs(g - w).max() <= 1


def assert_saved_format(quantized, scale_format):
    for q in quantized:
        assert q.scale.dtype == quant.SCALE_DTYPES[scale_format], q


def both(fn, *args, **kwargs):
    return (
        fn(*args, implementation="pallas", interpret=INTERPRET, **kwargs),
        fn(*args, implementation="xla", **kwargs),
    )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale_format", quant.SCALE_FORMATS)
def test_per_group_quantizer(shape, dtype, fmt, scale_format):
    q, q_ref = both(
        fp8_quant.quantize_per_group, data(shape, dtype), fmt=fmt, scale_format=scale_format
    )
    (codes, scale), (codes_ref, scale_ref) = (q.codes, q.scale), (q_ref.codes, q_ref.scale)
    assert scale.shape == shape[:-1] + (shape[-1] // 16,)
    assert scale.dtype == quant.SCALE_DTYPES[scale_format]
    assert_scales_match(scale, scale_ref)
    assert_codes_match(codes, codes_ref)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_per_tensor_quantizer_with_group_scaling(shape, fmt):
    x = data(shape, jnp.bfloat16, seed=1)
    q, q_ref = both(fp8_quant.quantize_per_tensor, x, fmt=fmt)
    (codes, scale), (codes_ref, scale_ref) = (q.codes, q.scale), (q_ref.codes, q_ref.scale)
    assert scale.shape == ()
    # Group scaling (max of group maxima) is the plain tensor max, rounded up to bfloat16.
    amax = float(jnp.max(jnp.abs(x.astype(jnp.float32))))
    assert amax / quant.FP8_MAX[fmt] <= float(scale) < amax / quant.FP8_MAX[fmt] * (1 + 2**-7)
    assert float(scale) == float(scale.astype(jnp.bfloat16))
    assert float(scale) == float(scale_ref)
    assert_codes_match(codes, codes_ref)


@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("scale_format", quant.SCALE_FORMATS)
def test_rmsnorm_kernels(shape, dtype, scale_format):
    x = data(shape, dtype, seed=2)
    w = 1.0 + 0.1 * jax.random.normal(jax.random.key(3), shape[-1:])
    got, ref = both(fp8_act.rmsnorm_fwd, x, w, 1e-6, scale_format=scale_format)
    assert_saved_format(got[1:2] + ref[1:2], scale_format)
    assert_close(got[0], ref[0], dtype)
    assert_codes_match(got[1].codes, ref[1].codes)
    assert_scales_match(got[1].scale, ref[1].scale)
    assert_close(got[2], ref[2], jnp.float32)
    dy = jax.random.normal(jax.random.key(4), shape, dtype)
    (dx, dw), (dx_ref, dw_ref) = both(fp8_act.rmsnorm_bwd, dy, *ref[1:], w)
    # Row sums in a different order: a few float32 roundings, then the output rounding.
    np.testing.assert_allclose(
        np.asarray(dx, np.float32), np.asarray(dx_ref, np.float32), rtol=1e-2, atol=1e-6
    )
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-4, atol=1e-6)
    assert dx.dtype == dtype and dw.dtype == w.dtype


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("scale_format", quant.SCALE_FORMATS)
def test_silu_kernels(shape, dtype, scale_format):
    x = data(shape, dtype, seed=5)
    got, ref = both(fp8_act.silu_fwd, x, scale_format=scale_format)
    assert_saved_format(got[1:2] + ref[1:2], scale_format)
    assert_close(got[0], ref[0], dtype)
    assert_codes_match(got[1].codes, ref[1].codes)
    assert_scales_match(got[1].scale, ref[1].scale)
    dy = jax.random.normal(jax.random.key(6), shape, dtype)
    dx, dx_ref = both(fp8_act.silu_bwd, dy, *ref[1:])
    assert_close(dx, dx_ref, dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("scale_format", quant.SCALE_FORMATS)
def test_mul_kernels(shape, dtype, scale_format):
    a, b = data(shape, dtype, seed=7), data(shape, dtype, seed=8)
    got, ref = both(fp8_act.mul_fwd, a, b, scale_format=scale_format)
    assert_saved_format(got[1:3] + ref[1:3], scale_format)
    assert_close(got[0], ref[0], dtype)
    for i in (1, 2):
        assert_codes_match(got[i].codes, ref[i].codes)
        assert_scales_match(got[i].scale, ref[i].scale)
    dy = jax.random.normal(jax.random.key(9), shape, dtype)
    (da, db), (da_ref, db_ref) = both(fp8_act.mul_bwd, dy, *ref[1:])
    assert_close(da, da_ref, dtype)
    assert_close(db, db_ref, dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("scale_format", quant.SCALE_FORMATS)
def test_swiglu_kernels(shape, dtype, scale_format):
    g, u = data(shape, dtype, seed=10), data(shape, dtype, seed=11)
    got, ref = both(fp8_act.swiglu_fwd, g, u, scale_format=scale_format)
    assert_saved_format(got[1:3] + ref[1:3], scale_format)
    assert_close(got[0], ref[0], dtype)
    for i in (1, 2):
        assert_codes_match(got[i].codes, ref[i].codes)
        assert_scales_match(got[i].scale, ref[i].scale)
    dy = jax.random.normal(jax.random.key(12), shape, dtype)
    (dg, du), (dg_ref, du_ref) = both(fp8_act.swiglu_bwd, dy, *ref[1:])
    assert_close(dg, dg_ref, dtype)
    assert_close(du, du_ref, dtype)


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

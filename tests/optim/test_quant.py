"""FP8 codecs (coat_jax.quant) against the float64 SPEC rendering and on edge cases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax import quant
from tests import spec_reference as ref

FORMATS = ["e4m3", "e5m2"]


def _moment_like(rng, shape):
    # Adam-moment-like data: log-normal magnitudes over many decades, random signs.
    return rng.standard_normal(shape) * np.exp(rng.uniform(-12, 2, shape))


@pytest.mark.parametrize("fmt", FORMATS)
def test_cast_clips_instead_of_overflowing(fmt):
    x = jnp.array([1e9, -1e9, 460.0, -70000.0, 0.0, 1.0], jnp.float32)
    q = quant.cast_to_fp8(x, fmt).astype(jnp.float32)
    assert bool(jnp.all(jnp.isfinite(q)))
    fmax = quant.FP8_MAX[fmt]
    np.testing.assert_array_equal(np.asarray(q[:2]), [fmax, -fmax])
    # A plain cast would not saturate: that is why the clip exists.
    raw = x.astype(quant.FORMATS[fmt]).astype(jnp.float32)
    assert not bool(jnp.all(jnp.isfinite(raw)))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(3, 256), (5, 300), (77,), (2, 3, 128)])
def test_dre_matches_float64_spec(fmt, shape):
    rng = np.random.default_rng(0)
    x = _moment_like(rng, shape).astype(np.float32)
    got = quant.quantize_dre(jnp.asarray(x), group_size=128, fmt=fmt, expand_min=16)
    codes, stats = ref.quantize(
        x.astype(np.float64), gs=128, fmt=fmt, expand_min=16, expansion=True
    )
    g = quant.num_groups(shape[-1], 128)
    assert got.scale.shape == (*shape[:-1], g)
    assert got.codes.dtype == quant.FORMATS[fmt] and got.codes.shape == shape
    np.testing.assert_array_equal(np.asarray(got.expand), stats["expand"])
    np.testing.assert_allclose(np.asarray(got.center), stats["center"], rtol=2e-6)
    np.testing.assert_allclose(np.asarray(got.scale), stats["scale"], rtol=1e-4)
    same = np.asarray(got.codes.astype(jnp.float32)) == codes
    # float32 vs float64 can only flip a value sitting on a rounding boundary
    assert same.mean() >= 0.995, same.mean()


@pytest.mark.parametrize("fmt", FORMATS)
def test_absmax_matches_float64_spec(fmt):
    rng = np.random.default_rng(1)
    x = _moment_like(rng, (4, 384)).astype(np.float32)
    got = quant.quantize_absmax(jnp.asarray(x), group_size=128, fmt=fmt)
    codes, stats = ref.quantize(
        x.astype(np.float64), gs=128, fmt=fmt, expand_min=16, expansion=False
    )
    np.testing.assert_allclose(np.asarray(got.scale), stats["scale"], rtol=1e-6)
    assert (np.asarray(got.codes.astype(jnp.float32)) == codes).mean() >= 0.995


def test_expansion_lowers_error_on_wide_range_groups():
    rng = np.random.default_rng(2)
    x = jnp.asarray(_moment_like(rng, (64, 128)).astype(np.float32))
    d = quant.quantize_dre(x)
    a = quant.quantize_absmax(x)
    err_dre = jnp.abs(quant.dequantize_dre(d.codes, d.scale, d.expand, d.center) - x) / jnp.abs(x)
    err_abs = jnp.abs(quant.dequantize_absmax(a.codes, a.scale) - x) / jnp.abs(x)
    # Values far below a group's max flush to zero without expansion (relative error 1); DRE
    # compresses the range (k < 1 here) so that none does.
    assert float(jnp.mean(err_dre == 1.0)) == 0.0
    assert float(jnp.mean(err_abs == 1.0)) > 0.05
    assert float(jnp.mean(err_dre)) < 0.05
    assert float(jnp.mean(err_dre)) < float(jnp.mean(err_abs)) / 2


EDGE_CASES = {
    "all_zero": np.zeros((2, 128)),
    "one_nonzero": np.concatenate([np.zeros((2, 127)), np.full((2, 1), 3.5)], axis=1),
    "all_equal": np.full((2, 128), -0.25),
    "denormal": np.full((2, 128), 1e-40) * np.sign(np.arange(256).reshape(2, 128) % 3 - 1),
    "tiny": np.geomspace(1e-38, 1e-30, 256).reshape(2, 128),
    "huge": np.geomspace(1e-30, 1e30, 256).reshape(2, 128),
    "huge_and_tiny": np.array([[1e30] + [1e-38] * 127, [1e-30] * 64 + [1e10] * 64]),
    "near_equal": 1.0 + np.arange(256).reshape(2, 128) * 1e-7,
}


@pytest.mark.parametrize("case", sorted(EDGE_CASES))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("expand_min", [16, 1])
def test_dre_edge_cases_stay_finite_and_accurate(case, fmt, expand_min):
    x = jnp.asarray(EDGE_CASES[case], jnp.float32)
    q = quant.quantize_dre(x, fmt=fmt, expand_min=expand_min)
    for leaf in jax.tree.leaves(q):
        assert bool(jnp.all(jnp.isfinite(leaf.astype(jnp.float32)))), case
    back = quant.dequantize_dre(q.codes, q.scale, q.expand, q.center)
    assert bool(jnp.all(jnp.isfinite(back)))
    # The group's largest magnitude comes back to within FP8 precision. SPEC's 1e-30 offsets
    # make magnitudes below about 1e-30 indistinguishable from zero, hence the atol.
    amax_in = jnp.max(jnp.abs(x), axis=-1)
    amax_out = jnp.max(jnp.abs(back), axis=-1)
    np.testing.assert_allclose(np.asarray(amax_out), np.asarray(amax_in), rtol=0.07, atol=1e-29)


def test_absmax_all_zero_is_zero():
    q = quant.quantize_absmax(jnp.zeros((3, 128)))
    assert bool(jnp.all(quant.dequantize_absmax(q.codes, q.scale) == 0))


def test_stats_keep_rank_for_sharding():
    x = jnp.ones((2, 3, 4, 500))
    q = quant.quantize_dre(x)
    assert q.scale.shape == (2, 3, 4, 4) and q.codes.shape == x.shape


@pytest.mark.parametrize("bad", [0, -3, 1.5, "128", True])
def test_bad_group_size(bad):
    with pytest.raises(ValueError, match="group_size"):
        quant.check_group_size(bad)


def test_unknown_format():
    with pytest.raises(ValueError, match="e4m3"):
        quant.cast_to_fp8(jnp.ones(3), "e3m4")


def test_scalar_cannot_be_grouped():
    with pytest.raises(ValueError, match="scalar"):
        quant.quantize_dre(jnp.float32(1.0))


def test_jittable():
    def round_trip(x):
        q = quant.quantize_dre(x)
        return quant.dequantize_dre(q.codes, q.scale, q.expand, q.center)

    f = jax.jit(round_trip)
    x = jnp.linspace(-1, 1, 256).reshape(2, 128)
    np.testing.assert_allclose(np.asarray(f(x)), np.asarray(x), rtol=0.15, atol=1e-6)

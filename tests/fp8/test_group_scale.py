"""One-byte (E8M0) 1xG scales of the FP8 activations: ``FP8Config(group_scale="e8m0")``.

The scale is rounded up to a power of two and stored as its biased exponent (OCP MX's E8M0), so
the activations kept for backward need 1 byte per 16 values for their scales instead of 4. The
kernels against their references are in tests/kernels/test_fp8_quant.py and test_fp8_act.py
(parametrized over both scale formats); here: the rounding itself, the error it costs, what the model then keeps for
backward, and the trainer option.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax import quant
from coat_jax.fp8_ops import FP8Config, ops_for
from coat_jax.memory import residuals
from coat_jax.training import load_config
from coat_jax.training.model import next_token_loss
from coat_jax.training.program import build_program
from tests.tiny_runs import tiny_run


def _spread(shape, seed=0):
    """Values over 16 decades, each group of 16 with its own magnitude."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    groups = 10.0 ** jax.random.uniform(k2, shape[:-1] + (shape[-1] // 16, 1), minval=-8, maxval=8)
    x = jax.random.normal(k1, shape[:-1] + (shape[-1] // 16, 16)) * groups
    return x.reshape(shape)


def test_round_scale_is_the_next_power_of_two():
    s = jnp.abs(_spread((64, 256))).reshape(-1) / 448.0 + 1e-30
    r = np.asarray(quant.round_scale(s, "e8m0"), np.float64)
    s64 = np.asarray(s, np.float64)
    mantissa, _ = np.frexp(r)
    assert np.all(mantissa == 0.5)  # a power of two
    assert np.all(r >= s64) and np.all(r < 2 * s64)
    exact = np.asarray([0.25, 1.0, 2.0**-100, 2.0**100], np.float32)
    assert np.array_equal(np.asarray(quant.round_scale(jnp.asarray(exact), "e8m0")), exact)
    # float32 leaves the scale alone; NaN stays NaN through rounding, encoding and decoding.
    assert quant.round_scale(s, "float32") is s
    nan = quant.decode_scale(quant.encode_scale(quant.round_scale(jnp.nan, "e8m0"), "e8m0"))
    assert bool(jnp.isnan(nan))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_absmax_scale_is_decided_exactly(fmt):
    """The smallest power of two r with amax + 1e-20 <= fmax * r, also where amax / fmax is
    itself a power of two (there a division one ulp high would double a rounded quotient)."""
    fmax = quant.FP8_MAX[fmt]
    exps = np.arange(-10, 60)  # where the 1e-20 floor is below half an ulp of amax
    on_boundary = jnp.asarray(fmax * np.ldexp(1.0, exps), jnp.float32)
    r = np.asarray(quant.absmax_scale(on_boundary, fmax, "e8m0"), np.float64)
    assert np.array_equal(r, np.ldexp(1.0, exps))
    amax = jnp.abs(_spread((64, 256))).reshape(-1)
    r = np.asarray(quant.absmax_scale(amax, fmax, "e8m0"), np.float64)
    peak = np.asarray(amax + quant.ABSMAX_TINY, np.float64)
    assert np.all(peak <= fmax * r) and np.all(peak > fmax * r / 2)
    # float32 scales are the plain quotient.
    s = quant.absmax_scale(amax, fmax, "float32")
    assert np.array_equal(np.asarray(s), np.asarray((amax + quant.ABSMAX_TINY) / fmax))


def test_encoding_is_one_byte_and_lossless_for_powers_of_two():
    exps = np.arange(-126, 128)
    scales = jnp.asarray(np.ldexp(1.0, exps), jnp.float32)
    stored = quant.encode_scale(scales, "e8m0")
    assert stored.dtype == jnp.uint8
    assert np.array_equal(np.asarray(stored, np.int32), exps + 127)
    assert np.array_equal(np.asarray(quant.decode_scale(stored)), np.asarray(scales))
    with pytest.raises(ValueError, match="e8m0"):
        quant.check_scale_format("bf16")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_error_per_value_is_the_formats_rounding(fmt):
    x = _spread((32, 512), seed=1)
    mantissa_bits = {"e4m3": 3, "e5m2": 2}[fmt]
    fmax = quant.FP8_MAX[fmt]
    errors = {}
    for scale_format in quant.SCALE_FORMATS:
        q = quant.quantize_absmax(x, group_size=16, fmt=fmt, scale_format=scale_format)
        assert q.scale.dtype == quant.SCALE_DTYPES[scale_format]
        scale = np.repeat(np.asarray(quant.decode_scale(q.scale)), 16, axis=-1)
        xs = np.abs(np.asarray(x)) / scale
        # Where x / s is a normal number of the format, the error is half an ulp of it.
        normal = xs >= float(jnp.finfo(quant.FORMATS[fmt]).smallest_normal)
        rel = np.abs(np.asarray(q.dequantize()) - np.asarray(x)) / np.abs(np.asarray(x))
        assert rel[normal].max() <= 2.0 ** -(mantissa_bits + 1) * (1 + 1e-6)
        # Each group's largest value lands at fmax (exact scale) or in (fmax / 2, fmax] (E8M0).
        peak = xs.reshape(32, -1, 16).max(axis=-1)
        low = fmax * (1 - 1e-6) if scale_format == "float32" else fmax / 2
        assert np.all(peak > low) and np.all(peak <= fmax * (1 + 1e-6))
        errors[scale_format] = float(np.mean(rel))
    # Less range used per group costs some error on the small values, not orders of magnitude.
    assert errors["float32"] <= errors["e8m0"] < 2 * errors["float32"], errors


B, T, D, F = 2, 32, 64, 176


def _mlp(ops):
    def block(p, x):
        h = ops.rmsnorm(x, p["norm"])
        gu = ops.linear(h, p["gate_up"])
        g, u = gu[..., :F], gu[..., F:]
        return ops.add(x, ops.linear(ops.mul(ops.silu(g), u), p["down"]))

    return block


PARAMS = {
    "norm": jax.ShapeDtypeStruct((D,), jnp.float32),
    "gate_up": jax.ShapeDtypeStruct((D, 2 * F), jnp.float32),
    "down": jax.ShapeDtypeStruct((F, D), jnp.float32),
}
X = jax.ShapeDtypeStruct((B, T, D), jnp.bfloat16)


def test_mlp_keeps_byte_scales_and_saves_three_bytes_per_scale():
    kept = {}
    for scale_format in quant.SCALE_FORMATS:
        config = FP8Config(implementation="xla", group_scale=scale_format)
        kept[scale_format] = [
            r
            for r in residuals(_mlp(ops_for("coat", config)), PARAMS, X, param_argnums=(0,))
            if r.is_activation
        ]
    n_scales = (B * T * D + 3 * B * T * F) // 16  # RMSNorm's x; SiLU's x; the product's a, b
    byte_scales = [r for r in kept["e8m0"] if r.dtype == jnp.uint8]
    assert sum(int(np.prod(r.shape)) for r in byte_scales) == n_scales
    # No float32 group scale is left (the per-row rstd and the per-tensor scales remain).
    f32_scales = lambda rs: [
        r for r in rs if r.dtype == jnp.float32 and r.shape and r.shape[-1] * 16 in (D, F)
    ]
    assert not f32_scales(kept["e8m0"])
    assert len(f32_scales(kept["float32"])) == 4  # the check can fail
    saved = sum(r.nbytes for r in kept["float32"]) - sum(r.nbytes for r in kept["e8m0"])
    assert saved == 3 * n_scales


def test_gradients_stay_close_to_float32_scales():
    k = jax.random.split(jax.random.key(2), 4)
    params = {
        "norm": 1.0 + 0.1 * jax.random.normal(k[0], (D,)),
        "gate_up": jax.random.normal(k[1], (D, 2 * F)) / np.sqrt(D),
        "down": jax.random.normal(k[2], (F, D)) / np.sqrt(F),
    }
    x = jax.random.normal(k[3], (B, T, D), jnp.bfloat16)

    def grads(ops):
        loss = lambda p, x: jnp.sum(_mlp(ops)(p, x).astype(jnp.float32) ** 2)
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)  # one program, not one per op

    exact = grads(ops_for("bf16"))
    flat = lambda g: np.concatenate(
        [np.ravel(np.asarray(a, np.float32)) for a in jax.tree.leaves(g)]
    )
    dist = {}
    for scale_format in quant.SCALE_FORMATS:
        got = grads(ops_for("coat", FP8Config(implementation="xla", group_scale=scale_format)))
        dist[scale_format] = np.linalg.norm(flat(got) - flat(exact)) / np.linalg.norm(flat(exact))
    assert dist["e8m0"] < 0.1 and dist["e8m0"] < 2 * dist["float32"], dist


def test_trainer_option():
    overrides = [*tiny_run(layers=1), "kernels=xla"]
    cfg = load_config(None, [*overrides, "precision.fp8_group_scale=e8m0"])
    program = build_program(cfg, cfg.model)
    assert program.model_def.graphdef is not None
    tokens = jax.ShapeDtypeStruct((2, cfg.seq_len + 1), jnp.int32)
    kept = residuals(
        lambda p, t: next_token_loss(program.model_def, p, t), program.abstract_params, tokens
    )
    assert any(r.dtype == jnp.uint8 for r in kept)  # the option reaches the model's FP8 ops
    # The option trains in tests/fp8/test_fp8_rowwise.py::test_trainer_runs_three_steps, whose one
    # run turns on the trainer options that compose.
    for precision in ("bf16", "fp8"):  # neither keeps FP8 activations with 1x16 scales
        with pytest.raises(ValueError, match="keeps none; use precision.mode=coat"):
            load_config(
                None,
                [
                    *overrides,
                    f"precision.mode={precision}",
                    "optimizer.name=adamw",
                    "precision.fp8_group_scale=e8m0",
                ],
            )
    load_config(
        None,
        [
            *overrides,
            "precision.mode=fp8",
            "precision.fp8_attention=true",
            "precision.fp8_group_scale=e8m0",
        ],
    )
    with pytest.raises(ValueError, match="group_scale='bf16' is not one of"):
        FP8Config(group_scale="bf16")

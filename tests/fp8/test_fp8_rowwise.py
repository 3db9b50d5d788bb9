"""Row-wise scaled FP8 linear: ``FP8Config(linear_scaling="row" | "row_gw_hp")``, trainer
``fp8_linear_scaling``.

Tolerances (measured on these inputs: x normal with rows spanning 1e-3..1e3, w normal):
* forward against the float64 dot of the dequantized codes times their scales: float32
  rounding (relative Frobenius error below 1e-5; measured 5.0e-8);
* forward against float32: below 0.08 relative (measured 0.037; per-tensor 0.038);
* gradients against float32 autodiff, relative Frobenius error: dx below 0.15 (measured 0.055
  for both variants; per-tensor 0.058); dw below 0.15 for "row" (measured 0.056; per-tensor
  0.050) and below 0.08 for "row_gw_hp" (measured 0.023: its weight gradient skips the second
  quantization of x and the E5M2 rounding of dy);
* "really quantized": every gradient differs from float32's by at least 1e-3 relative.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax import fp8_ops
from coat_jax.fp8 import rowwise as fp8_rowwise
from coat_jax.fp8.rowwise import fp8_rowwise_linear, quantize_along
from coat_jax.fp8_ops import FP8Config, ops_for
from coat_jax.memory import residuals
from coat_jax.training import load_config
from coat_jax.training.loop import train
from coat_jax.training.program import build_program
from tests.jaxprs import equations
from tests.tiny_runs import tiny_run

ROW = FP8Config(implementation="xla", linear_scaling="row")
GW_HP = FP8Config(implementation="xla", linear_scaling="row_gw_hp")
E4M3 = jnp.dtype(jnp.float8_e4m3fn)
FP8_DTYPES = {"float8_e4m3fn", "float8_e5m2"}


def _x(shape=(2, 24, 64), dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(0))
    rows = 10.0 ** jax.random.uniform(k2, shape[:-1] + (1,), minval=-3.0, maxval=3.0)
    return (rows * jax.random.normal(k1, shape)).astype(dtype)


def _w(k=64, n=48, seed=1):
    return 0.05 * jax.random.normal(jax.random.key(seed), (k, n))


def _rel(a, ref):
    a, ref = (np.asarray(jnp.asarray(v, jnp.float32), np.float64) for v in (a, ref))
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def test_forward_is_the_dequantized_product():
    x, w = _x(), _w()
    y = fp8_rowwise_linear(x, w, ROW)
    xc, sx = quantize_along(x.reshape(-1, 64), 1, "e4m3", ROW)
    wc, sw = quantize_along(w, 0, "e4m3", ROW)
    assert xc.dtype == wc.dtype == E4M3 and sx.shape == (48, 1) and sw.shape == (1, 48)
    f64 = lambda a: np.asarray(a, np.float64)
    ref = (f64(xc.astype(jnp.float32)) * f64(sx)) @ (f64(wc.astype(jnp.float32)) * f64(sw))
    assert _rel(y.reshape(-1, 48), ref) < 1e-5
    assert _rel(y, x @ w) < 0.08
    # BF16 in, BF16 out: the GEMM writes BF16 and the scales are applied after (two roundings).
    yb = fp8_rowwise_linear(x.astype(jnp.bfloat16), w, ROW)
    assert yb.dtype == jnp.bfloat16
    xbc, sxb = quantize_along(x.astype(jnp.bfloat16).reshape(-1, 64), 1, "e4m3", ROW)
    refb = (f64(xbc.astype(jnp.float32)) * f64(sxb)) @ (f64(wc.astype(jnp.float32)) * f64(sw))
    assert _rel(yb.reshape(-1, 48), refb) < 2**-7


@pytest.mark.parametrize(("config", "dw_bound"), [(ROW, 0.15), (GW_HP, 0.08)])
def test_gradients_close_to_float32(config, dw_bound):
    x, w = _x(), _w()
    c = jax.random.normal(jax.random.key(2), (2, 24, 48))
    loss = lambda f: lambda x, w: jnp.sum(f(x, w) * c)
    gx, gw = jax.grad(loss(lambda x, w: fp8_rowwise_linear(x, w, config)), (0, 1))(x, w)
    rx, rw = jax.grad(loss(lambda x, w: x @ w), (0, 1))(x, w)
    assert gx.dtype == x.dtype and gw.dtype == w.dtype
    assert 1e-3 < _rel(gx, rx) < 0.15
    assert 1e-3 < _rel(gw, rw) < dw_bound


def test_weight_gradient_variants_differ_only_in_dw():
    x, w = _x(), _w()
    grad = lambda cfg: jax.grad(lambda x, w: jnp.sum(fp8_rowwise_linear(x, w, cfg) ** 2), (0, 1))
    (ax, aw), (bx, bw) = grad(ROW)(x, w), grad(GW_HP)(x, w)
    np.testing.assert_array_equal(ax, bx)
    assert not np.array_equal(aw, bw)


def test_tuple_of_weights_matches_one_call_each():
    x = _x(dtype=jnp.bfloat16)
    ws = (_w(seed=1), _w(n=16, seed=2))
    ys = fp8_rowwise_linear(x, ws, ROW)
    for y, w in zip(ys, ws, strict=True):
        np.testing.assert_array_equal(y, fp8_rowwise_linear(x, w, ROW))
    # The input gradient of the pair is the sum of each one's (summed in float32).
    cot = lambda y: jnp.sin(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))
    dot_sum = lambda ys: sum(jnp.sum(y.astype(jnp.float32) * cot(y)) for y in ys)
    gx = jax.grad(lambda x: dot_sum(fp8_rowwise_linear(x, ws, ROW)))(x)
    each = [jax.grad(lambda x, w=w: dot_sum([fp8_rowwise_linear(x, w, ROW)]))(x) for w in ws]
    assert _rel(gx, each[0].astype(jnp.float32) + each[1].astype(jnp.float32)) < 2**-7


@pytest.mark.parametrize("config", [ROW, GW_HP], ids=["row", "row_gw_hp"])
def test_keeps_fp8_codes_and_per_row_scales_of_x(config):
    x, w = _x(dtype=jnp.bfloat16), _w()
    kept = residuals(lambda w, x: fp8_rowwise_linear(x, w, config), w, x, param_argnums=(0,))
    acts = [r for r in kept if r.is_activation]
    assert sorted((r.shape, str(r.dtype)) for r in acts) == [
        ((2, 24, 1), "float32"),  # one float32 scale per row (token), the codes' rank
        ((2, 24, 64), "float8_e4m3fn"),
    ]
    # No activation of x's size in a wider dtype: the BF16 x is not kept (the master weight is).
    assert not any(r.dtype.itemsize > 1 and np.prod(r.shape) >= x.size for r in acts)


def test_kept_codes_carry_the_activation_name():
    assert fp8_rowwise.ACTIVATION == fp8_ops.ACTIVATION
    x, w = _x(), _w()
    pullback = lambda x: jax.tree.leaves(jax.vjp(lambda x: fp8_rowwise_linear(x, w, ROW), x)[1])
    jaxpr = jax.make_jaxpr(pullback)(x)
    names = [e.params["name"] for e in equations(jaxpr.jaxpr) if e.primitive.name == "name"]
    assert names.count(fp8_ops.ACTIVATION) == 2, names  # the codes and the scales


@pytest.mark.parametrize(("config", "fp8_dots"), [(ROW, 3), (GW_HP, 2)])
def test_dots_take_fp8_codes_directly(config, fp8_dots):
    # Forward, dgrad and (for "row") wgrad are dots of convert(float8 codes), nothing between:
    # the spelling XLA's cuBLASLt FP8 rewriter takes (docs/fp8_gemm.md).
    x, w = _x(dtype=jnp.bfloat16), _w()
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(fp8_rowwise_linear(x, w, config)), (0, 1)))
    eqns = list(equations(jaxpr(x, w).jaxpr))
    producer = {v: e for e in eqns for v in e.outvars}
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3

    def source(v):
        p = producer.get(v)
        if p is None or p.primitive.name != "convert_element_type":
            return None
        return str(p.invars[0].aval.dtype)

    fp8 = [d for d in dots if all(source(v) in FP8_DTYPES for v in d.invars)]
    assert len(fp8) == fp8_dots


def test_ops_for_and_dot_general_dispatch():
    x, w = _x(dtype=jnp.bfloat16), _w()
    expected = fp8_rowwise_linear(x, w, ROW)
    for precision in ("fp8", "coat"):
        np.testing.assert_array_equal(ops_for(precision, ROW).linear(x, w), expected)
    np.testing.assert_array_equal(
        fp8_ops.fp8_dot_general(x, w, (((2,), (0,)), ((), ())), config=ROW), expected
    )
    assert not np.array_equal(
        ops_for("fp8", FP8Config(implementation="xla")).linear(x, w), expected
    )
    with pytest.raises(ValueError, match="telemetry records per-tensor linear scales"):
        ops_for("coat", ROW, recorder=fp8_ops.ScaleRecorder(ROW))


def test_config_checks():
    with pytest.raises(ValueError, match=r"linear_scaling='col' is not one of \['tensor'"):
        FP8Config(linear_scaling="col")
    with pytest.raises(ValueError, match="set weight_residual='master'"):
        FP8Config(linear_scaling="row", weight_residual="once")
    with pytest.raises(ValueError, match="set attention_backward='recompute'"):
        FP8Config(linear_scaling="row", attention_backward="saved_output")
    with pytest.raises(ValueError, match="for 'tensor' call"):
        fp8_rowwise_linear(_x(), _w(), FP8Config())
    with pytest.raises(TypeError, match="takes master weights"):
        fp8_rowwise_linear(_x(), fp8_ops.prequantized(_w()), ROW)
    run = tiny_run(layers=1)
    with pytest.raises(ValueError, match="fp8_linear_scaling") as bad:
        load_config(None, [*run, "precision.fp8_linear_scaling=col"])
    assert "\n" not in str(bad.value) and "row_gw_hp" in str(bad.value)
    with pytest.raises(ValueError, match="set precision.fp8_linear_scaling=tensor") as once:
        load_config(
            None, [*run, "precision.fp8_linear_scaling=row"]
        )  # the trainer's default is "once"
    assert "\n" not in str(once.value)


def test_trainer_runs_three_steps(tmp_path):
    # One run for three trainer options that compose: row scaling, the fused SwiGLU
    # (tests/fp8/test_fused_swiglu.py::test_trainer_option) and E8M0 group scales
    # (tests/fp8/test_group_scale.py::test_trainer_option) each reach the model and train.
    overrides = [
        *tiny_run(layers=1),
        "steps=3",
        "kernels=xla",
        "xla.compilation_cache_dir=null",
        "precision.fp8_weight_residual=master",
        "precision.fp8_linear_scaling=row",
        "precision.fp8_swiglu=fused",
        "precision.fp8_group_scale=e8m0",
        f"output_dir={tmp_path}/r",
        # No final checkpoint: the run's steps and validation are what this test reads.
        "checkpoint.save_final=false",
    ]
    cfg = load_config(None, overrides)
    program = build_program(cfg, cfg.model)
    model = program.model_def.bind(program.abstract_params)
    assert model.fp8_config.linear_scaling == "row"  # the key reaches the model's FP8 ops
    assert model.fp8_config.swiglu == "fused" and model.fp8_config.group_scale == "e8m0"
    result = train(cfg, say=lambda msg: None)
    assert result.step == 3 and np.isfinite(result.val_loss)


# ------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize(("scaling", "fp8_gemms"), [("row", 3), ("row_gw_hp", 2)])
def test_compiles_to_cublaslt_fp8(scaling, fp8_gemms):
    # Llama-2-7B-sized projection (compile only): forward and dgrad (and "row"'s wgrad) are
    # cuBLASLt FP8 GEMMs; "row_gw_hp"'s wgrad is one BF16 GEMM.
    sds = jax.ShapeDtypeStruct
    x, w = sds((2, 1024, 4096), jnp.bfloat16), sds((4096, 11008), jnp.float32)
    c = sds((2, 1024, 11008), jnp.float32)
    config = FP8Config(linear_scaling=scaling)

    def loss(x, w, c):
        return jnp.sum(fp8_rowwise_linear(x, w, config).astype(jnp.float32) * c)

    options = fp8_ops.fp8_compiler_options()
    step = jax.jit(jax.value_and_grad(loss, (0, 1)), compiler_options=options)
    hlo = step.lower(x, w, c).compile().as_text()
    targets = re.findall(r'custom_call_target="([^"]+)"', hlo)
    assert targets.count("__cublas$lt$matmul$f8") == fp8_gemms, sorted(targets)
    gemms = [t for t in targets if t.startswith("__cublas")]
    assert len(gemms) == 3, sorted(targets)
    assert "__triton_gemm" not in hlo

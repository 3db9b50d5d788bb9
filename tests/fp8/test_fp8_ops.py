"""FP8 precision-flow ops: numerics against float32, what backward keeps, FP8 GEMMs on the GPU.

Tolerances (stated once, used throughout):
* FP8 GEMM forward (E4M3 per-tensor): relative Frobenius error to float32 below 0.08 and cosine
  similarity at least 0.995; E4M3 keeps 3 mantissa bits (relative rounding error <= 2**-4).
* Gradients of every FP8 op: cosine similarity with float32 at least 0.99, relative error below
  0.1 (E5M2 output gradients keep 2 mantissa bits).
* Non-linear forwards are computed from the exact input, so they match float32 to the output
  dtype's rounding (bfloat16: 2**-8 relative).
* "Really quantized": on float32 inputs an FP8 op's gradient differs from the float32 one by at
  least 1e-3 relative -- a float32 computation would differ by about 1e-7.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jex_core

from coat_jax import fp8_ops
from coat_jax.fp8 import linear as fp8_linear_module
from coat_jax.fp8_ops import FP8Config, fp8_dot_general, ops_for
from coat_jax.memory import activation_bytes, activation_bytes_by_dtype, residuals

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
MAGNITUDES = (1e-5, 1.0, 3e3)
XLA = FP8Config(implementation="xla")


def _f32(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64).ravel()


def cosine(a, b):
    a, b = _f32(a), _f32(b)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def rel_err(a, ref):
    a, ref = _f32(a), _f32(ref)
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def mixed_normal(key, shape, dtype, magnitude):
    """Normal values whose rows span 1e-3..1e3 around ``magnitude`` (group scales must cope)."""
    k1, k2 = jax.random.split(key)
    row_scale = 10.0 ** jax.random.uniform(k2, shape[:-1] + (1,), minval=-3.0, maxval=3.0)
    return (magnitude * row_scale * jax.random.normal(k1, shape)).astype(dtype)


def grads(f, *args):
    """Gradients of ``sum(f(*args) * c)`` for a fixed random cotangent ``c`` (not all ones)."""

    def loss(*a):
        y = f(*a)
        c = jax.random.normal(jax.random.key(7), y.shape, jnp.float32)
        return jnp.sum(y.astype(jnp.float32) * c)

    return jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)


def check_op(fp8_fn, ref_fn, args, *, fwd_rel, fwd_cos):
    """Forward and every gradient of ``fp8_fn`` against ``ref_fn`` on float32 copies.

    A range check across input magnitudes (finite, right dtype, roughly the float32 values),
    with one bound for every op: it cannot see a formula wrong by a few percent. The bounds at
    each op's measured FP8 error, the bias checks and the emulated-FP8 comparisons that can
    are in tests/fp8/test_fp8_oracle.py, against the float64 oracle of tests/oracle.py.
    """
    ref_args = [a.astype(jnp.float32) for a in args]
    y, y_ref = jax.jit(fp8_fn)(*args), ref_fn(*ref_args)
    assert y.dtype == args[0].dtype
    assert rel_err(y, y_ref) < fwd_rel
    assert cosine(y, y_ref) >= fwd_cos
    g, g_ref = grads(fp8_fn, *args), grads(ref_fn, *ref_args)
    for a, gi, gr in zip(args, g, g_ref, strict=True):
        assert gi.dtype == a.dtype
        assert np.all(np.isfinite(_f32(gi)))
        assert cosine(gi, gr) >= 0.99, cosine(gi, gr)
        assert rel_err(gi, gr) < 0.1, rel_err(gi, gr)


# ------------------------------------------------------------------------------------------
# numerics of each op


@pytest.mark.parametrize("magnitude", MAGNITUDES)
def test_linear_matches_float32(magnitude):
    kx, kw = jax.random.split(jax.random.key(0))
    x = (magnitude * jax.random.normal(kx, (4, 16, 64))).astype(jnp.bfloat16)
    w = 0.05 * jax.random.normal(kw, (64, 48))
    check_op(
        lambda x, w: fp8_ops.fp8_linear(x, w, XLA),
        fp8_ops.linear,
        (x, w),
        fwd_rel=0.08,
        fwd_cos=0.995,
    )


@pytest.mark.parametrize("magnitude", MAGNITUDES)
def test_rmsnorm_matches_float32(magnitude):
    kx, kw = jax.random.split(jax.random.key(1))
    x = mixed_normal(kx, (4, 8, 64), jnp.bfloat16, magnitude)
    w = 1.0 + 0.1 * jax.random.normal(kw, (64,))
    check_op(
        lambda x, w: fp8_ops.fp8_rmsnorm(x, w, 1e-6, XLA),
        lambda x, w: fp8_ops.rmsnorm(x, w, 1e-6),
        (x, w),
        fwd_rel=2**-7,
        fwd_cos=0.9999,
    )


@pytest.mark.parametrize("magnitude", MAGNITUDES)
def test_silu_matches_float32(magnitude):
    x = mixed_normal(jax.random.key(2), (4, 8, 96), jnp.bfloat16, magnitude)
    check_op(lambda x: fp8_ops.fp8_silu(x, XLA), fp8_ops.silu, (x,), fwd_rel=2**-7, fwd_cos=0.9999)


@pytest.mark.parametrize("magnitude", MAGNITUDES)
def test_mul_matches_float32(magnitude):
    ka, kb = jax.random.split(jax.random.key(3))
    a = mixed_normal(ka, (4, 8, 96), jnp.bfloat16, magnitude)
    b = mixed_normal(kb, (4, 8, 96), jnp.bfloat16, 1.0)
    check_op(
        lambda a, b: fp8_ops.fp8_mul(a, b, XLA), fp8_ops.mul, (a, b), fwd_rel=2**-7, fwd_cos=0.9999
    )


@pytest.mark.parametrize("magnitude", MAGNITUDES)
def test_swiglu_matches_float32_and_keeps_two_fp8_tensors(magnitude):
    kg, ku = jax.random.split(jax.random.key(13))
    gate = mixed_normal(kg, (4, 8, 96), jnp.bfloat16, magnitude)
    up = mixed_normal(ku, (4, 8, 96), jnp.bfloat16, 1.0)
    check_op(
        lambda g, u: fp8_ops.fp8_swiglu(g, u, XLA),
        lambda g, u: fp8_ops.silu(g) * u,
        (gate, up),
        fwd_rel=2**-7,
        fwd_cos=0.9999,
    )
    kept = residuals(lambda g, u: fp8_ops.fp8_swiglu(g, u, XLA), gate, up)
    assert sorted(r.dtype.name for r in kept if r.shape == gate.shape) == ["float8_e4m3fn"] * 2


def test_attention_keeps_fp8_qkv_and_matches_float32():
    kq, kk, kv = jax.random.split(jax.random.key(14), 3)
    q, k, v = (jax.random.normal(key, (2, 16, 4, 32), jnp.bfloat16) for key in (kq, kk, kv))
    check_op(
        lambda q, k, v: fp8_ops.fp8_attention(q, k, v, True, XLA),
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
        (q, k, v),
        fwd_rel=2**-6,
        fwd_cos=0.9999,
    )
    kept = residuals(lambda q, k, v: fp8_ops.fp8_attention(q, k, v, True, XLA), q, k, v)
    assert [r.dtype.name for r in kept if r.shape == q.shape] == ["float8_e4m3fn"] * 3
    assert all(r.nbytes < q.size for r in kept if r.shape != q.shape)  # 1x16 scales only
    with pytest.raises(ValueError, match=r"\[B, T, N, H\]"):
        fp8_ops.fp8_attention(q[0], k[0], v[0], True, XLA)


def test_attention_takes_a_sliding_window():
    kq, kk, kv = jax.random.split(jax.random.key(15), 3)
    q, k, v = (jax.random.normal(key, (2, 16, 4, 32), jnp.bfloat16) for key in (kq, kk, kv))
    windowed = lambda q, k, v: fp8_ops.fp8_attention(q, k, v, True, XLA, None, 5)
    check_op(
        windowed,
        lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, local_window_size=(4, 0)
        ),
        (q, k, v),
        fwd_rel=2**-6,
        fwd_cos=0.9999,
    )
    # The window matters: without it the output differs.
    full = fp8_ops.fp8_attention(q, k, v, True, XLA)
    assert float(jnp.max(jnp.abs(windowed(q, k, v) - full))) > 0.1


def test_add_is_exact_and_keeps_nothing():
    ka, kb = jax.random.split(jax.random.key(4))
    a = jax.random.normal(ka, (4, 8, 32), jnp.bfloat16)
    b = jax.random.normal(kb, (4, 8, 32), jnp.bfloat16)
    np.testing.assert_array_equal(fp8_ops.fp8_add(a, b), a + b)
    ga, gb = grads(fp8_ops.fp8_add, a, b)
    np.testing.assert_array_equal(ga, gb)
    assert residuals(fp8_ops.fp8_add, a, b) == []


def test_linear_weight_gradient_in_master_dtype_and_batch_rank():
    x = jax.random.normal(jax.random.key(5), (2, 3, 4, 32), jnp.bfloat16)
    for w_dtype in (jnp.float32, jnp.bfloat16):
        w = jnp.ones((32, 16), w_dtype)
        y = fp8_ops.fp8_linear(x, w, XLA)
        assert y.shape == (2, 3, 4, 16) and y.dtype == jnp.bfloat16
        gx, gw = grads(lambda x, w: fp8_ops.fp8_linear(x, w, XLA), x, w)
        assert gx.dtype == jnp.bfloat16 and gw.dtype == w_dtype


# On a GPU also the default config (Pallas kernels): XLA's GPU compiler may fold FP8 round trips.
REALLY_QUANTIZED_CONFIGS = [XLA] + ([FP8Config()] if jax.default_backend() == "gpu" else [])


@pytest.mark.parametrize("config", REALLY_QUANTIZED_CONFIGS, ids=lambda c: c.implementation)
@pytest.mark.parametrize("op", ["linear", "rmsnorm", "silu", "mul"])
def test_fp8_path_really_quantizes(op, config):
    """On float32 inputs an FP8 op's gradients differ from float32's by a quantization amount."""
    keys = jax.random.split(jax.random.key(6), 3)
    x = jax.random.normal(keys[0], (8, 64))
    other = {
        "linear": 0.1 * jax.random.normal(keys[1], (64, 32)),
        "rmsnorm": 1.0 + 0.1 * jax.random.normal(keys[1], (64,)),
        "mul": jax.random.normal(keys[1], (8, 64)),
        "silu": None,
    }[op]
    args = (x,) if other is None else (x, other)
    coat, plain = ops_for("coat", config), ops_for("bf16")
    fns = [getattr(o, op) for o in (coat, plain)]
    if op == "rmsnorm":
        fns = [lambda x, w, f=f: f(x, w, 1e-6) for f in fns]
    g_fp8, g_ref = grads(fns[0], *args), grads(fns[1], *args)
    errs = [rel_err(a, b) for a, b in zip(g_fp8, g_ref, strict=True)]
    assert 1e-3 < max(errs) < 0.1, errs
    kept = residuals(fns[0], *args)
    assert any(r.dtype in FP8_DTYPES for r in kept)
    assert not any(r.dtype in FP8_DTYPES for r in residuals(fns[1], *args))


NO_EXCESS = {"xla_allow_excess_precision": False}


def _barriers(fn, *args) -> int:
    jaxpr = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=0))(*args)
    return str(jaxpr).count("optimization_barrier")


def _codes_op(op, config):
    """``op`` of ``ops_for("coat", config)`` (SwiGLU fused) as a function of arrays; ``None``
    config: the plain BF16 op (none for attention)."""
    if op == "attention":
        return (
            None if config is None else lambda q, k, v: fp8_ops.fp8_attention(q, k, v, True, config)
        )
    ops = (
        ops_for("bf16")
        if config is None
        else ops_for("coat", dataclasses.replace(config, swiglu="fused"))
    )
    if op == "swiglu" and config is None:
        return lambda g, u: ops.mul(ops.silu(g), u)
    fn = getattr(ops, op)
    return (lambda x, w: fn(x, w, 1e-6)) if op == "rmsnorm" else fn


@pytest.mark.parametrize("op", ["linear", "rmsnorm", "silu", "mul", "swiglu", "attention"])
def test_codes_barrier_off_keeps_the_fp8_numbers_without_excess_precision(op):
    """``codes_barrier=False`` drops the optimization barrier on the kept codes; compiled
    without excess precision (where XLA cannot fold the round trip) the gradients are those of
    the barrier's program, not the unquantized ones: on the CPU and on a GPU, whose compiler
    folds FP8 round trips under excess precision."""
    keys = jax.random.split(jax.random.key(11), 4)
    x = jax.random.normal(keys[0], (4, 16, 64))
    other = {
        "linear": (0.1 * jax.random.normal(keys[1], (64, 32)),),
        "rmsnorm": (1.0 + 0.1 * jax.random.normal(keys[1], (64,)),),
        "mul": (jax.random.normal(keys[1], (4, 16, 64)),),
        "swiglu": (jax.random.normal(keys[1], (4, 16, 64)),),
        "silu": (),
        "attention": tuple(jax.random.normal(k, (4, 16, 2, 32)) for k in keys[2:]),
    }[op]
    if op == "attention":
        x = x.reshape(4, 16, 2, 32)
    args = (x, *other)
    found = {}
    for barrier in (True, False):
        fn = _codes_op(op, dataclasses.replace(XLA, codes_barrier=barrier))
        assert (_barriers(fn, *args) > 0) is barrier, op
        found[barrier] = jax.jit(lambda *a, fn=fn: grads(fn, *a), compiler_options=NO_EXCESS)(*args)
    for with_barrier, without in zip(found[True], found[False], strict=True):
        assert rel_err(without, with_barrier) < 1e-5, op
    plain = _codes_op(op, None)
    if plain is not None:  # really quantized: a quantization amount from the plain op
        reference = grads(plain, *args)
        assert max(rel_err(a, b) for a, b in zip(found[False], reference, strict=True)) > 1e-3


def test_fp8_paths_work_under_jit_and_with_pallas_interpret():
    cfg = FP8Config(implementation="pallas", interpret=True)
    x = jax.random.normal(jax.random.key(8), (2, 8, 64), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(9), (64,))

    def f(x, w, ops):
        h = ops.rmsnorm(x, w, 1e-6)
        return ops.add(h, ops.mul(ops.silu(h), h))

    outs = [
        jax.jit(jax.value_and_grad(lambda x, w, o=o: jnp.sum(f(x, w, o).astype(jnp.float32))))(x, w)
        for o in (ops_for("coat", cfg), ops_for("coat", XLA))
    ]
    np.testing.assert_allclose(_f32(outs[0][0]), _f32(outs[1][0]), rtol=1e-2)
    assert cosine(outs[0][1], outs[1][1]) > 0.9999


# ------------------------------------------------------------------------------------------
# what backward keeps

B, T, D, F, H = 2, 32, 64, 128, 4


def mlp_block(ops):
    def block(params, x):
        h = ops.rmsnorm(x, params["norm"], 1e-6)
        gate, up = jnp.split(ops.linear(h, params["gate_up"]), 2, axis=-1)
        return ops.add(x, ops.linear(ops.mul(ops.silu(gate), up), params["down"]))

    return block


def attention_block(ops):
    attend = jax.checkpoint(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))

    def block(params, x):
        h = ops.rmsnorm(x, params["norm"], 1e-6)
        q, k, v = jnp.split(ops.linear(h, params["qkv"]), 3, axis=-1)
        q, k, v = (t.reshape(B, T, H, D // H) for t in (q, k, v))
        out = attend(q, k, v).reshape(B, T, D)
        return ops.add(x, ops.linear(out, params["o"]))

    return block


PARAMS = {
    "norm": jax.ShapeDtypeStruct((D,), jnp.float32),
    "gate_up": jax.ShapeDtypeStruct((D, 2 * F), jnp.float32),
    "down": jax.ShapeDtypeStruct((F, D), jnp.float32),
    "qkv": jax.ShapeDtypeStruct((D, 3 * D), jnp.float32),
    "o": jax.ShapeDtypeStruct((D, D), jnp.float32),
}
X = jax.ShapeDtypeStruct((B, T, D), jnp.bfloat16)


def unscaled_activations(block):
    """Activation residuals at least a 16th of a hidden-size tensor that are not FP8 codes.

    Scales of 1x16 groups are exactly a 16th of their tensor in elements; per-row statistics
    (RMSNorm's rsqrt) and per-tensor scales are far smaller, so anything else this big is a
    BF16/float32 activation.
    """
    kept = residuals(block, PARAMS, X, param_argnums=(0,))
    return [
        r
        for r in kept
        if r.is_activation
        and r.dtype not in FP8_DTYPES
        and np.prod(r.shape) >= B * T * D // 16
        and not (r.dtype == jnp.float32 and r.shape[-1] * 16 in (D, F, 2 * F, 3 * D))
    ]


def test_mlp_block_keeps_only_fp8_and_scales():
    assert unscaled_activations(mlp_block(ops_for("coat", XLA))) == []
    # The check can fail: the same block in BF16 keeps BF16 / float32 activations.
    assert unscaled_activations(mlp_block(ops_for("bf16")))


def test_attention_block_keeps_fp8_plus_qkv():
    left = unscaled_activations(attention_block(ops_for("coat", XLA)))
    assert [(r.shape, r.dtype) for r in left] == [((B, T, H, D // H), jnp.bfloat16)] * 3
    assert len(unscaled_activations(attention_block(ops_for("bf16")))) > 3


def test_each_linear_input_saved_once_in_fp8():
    kept = residuals(mlp_block(ops_for("fp8", XLA)), PARAMS, X, param_argnums=(0,))
    fp8 = [r for r in kept if r.dtype in FP8_DTYPES]
    assert sorted(r.shape for r in fp8) == sorted([(B * T, D), (B * T, F)])
    weights = [r for r in kept if not r.is_activation and len(r.shape) == 2]
    assert all(r.dtype == jnp.float32 for r in weights)  # master weights, no FP8 copies


def test_coat_mlp_bytes_match_the_precision_flow():
    """MLP block in COAT keeps, in bytes: FP8 rmsnorm input + gate_up input, gate, up, SiLU
    output, down input (each 1 byte/elem), 1x16 float32 scales, per-row rstd, per-tensor scales."""
    n_d, n_f = B * T * D, B * T * F
    expected = (
        (n_d + n_d // 16 * 4 + B * T * 4)  # RMSNorm: FP8 x, scales, rstd
        + (n_d + 4)  # gate|up linear input, per-tensor
        + (n_f + n_f // 16 * 4)  # SiLU input (gate)
        + 2 * (n_f + n_f // 16 * 4)  # product inputs (SiLU output, up)
        + (n_f + 4)  # down linear input
    )
    got = activation_bytes(mlp_block(ops_for("coat", XLA)), PARAMS, X, param_argnums=(0,))
    assert got == expected
    by_dtype = activation_bytes_by_dtype(
        mlp_block(ops_for("coat", XLA)), PARAMS, X, param_argnums=(0,)
    )
    assert set(by_dtype) == {"float8_e4m3fn", "float32"}


def test_llama2_7b_layer_activation_target():
    """COAT mode keeps <= 13.5U and >= 1.6x less than BF16 (SPEC 3); the stretch is < 10U."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "activation_memory.py")
    spec = importlib.util.spec_from_file_location("activation_memory", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results, unit = bench.measure_all(batch=4, seq=2048)
    u = {name: total / unit for name, (total, _, _) in results.items()}
    assert u["coat"] <= 13.5 and u["bf16"] / u["coat"] >= 1.6, u
    assert u["coat (ops layer)"] == u["coat"]
    assert u["coat + FP8 attention + fused SwiGLU"] < 10, u
    assert u["coat"] < u["fp8"] < u["bf16"], u


def test_activation_bytes_counts_xla_residuals():
    # sin keeps cos(x) (the input's size and dtype); a weight-only residual is not counted.
    x = jax.ShapeDtypeStruct((1024,), jnp.bfloat16)
    assert activation_bytes(lambda x: jnp.sin(x), x) == 2048
    w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    f = lambda w, x: jnp.sin(x.reshape(128, 8).astype(jnp.float32) @ jnp.tanh(w))
    kept = residuals(f, w, x, param_argnums=(0,))
    assert any(not r.is_activation for r in kept)
    assert activation_bytes(f, w, x, param_argnums=(0,)) < activation_bytes(f, w, x)
    with pytest.raises(ValueError, match="param_argnums"):
        activation_bytes(f, w, x, param_argnums=(2,))


# ------------------------------------------------------------------------------------------
# API and errors


def test_ops_for_rejects_unknown_precision():
    with pytest.raises(ValueError, match=r"'fp16'.*\['bf16', 'fp8', 'coat'\]"):
        ops_for("fp16")
    with pytest.raises(TypeError, match="FP8Config"):
        ops_for("coat", {"group_size": 16})


def test_op_sets_and_float32_baseline():
    assert ops_for("bf16").linear is fp8_ops.linear
    assert ops_for("fp8").rmsnorm is fp8_ops.rmsnorm
    x = jax.random.normal(jax.random.key(10), (3, 32))
    w = jax.random.normal(jax.random.key(11), (32,))
    np.testing.assert_allclose(
        ops_for("bf16").rmsnorm(x, w, 1e-5),
        w * x / np.sqrt(np.mean(np.square(x), -1, keepdims=True) + 1e-5),
        rtol=1e-5,
    )


def test_config_and_shape_errors():
    with pytest.raises(ValueError, match="e4m3"):
        FP8Config(act_format="e3m4")
    with pytest.raises(ValueError, match="implementation"):
        FP8Config(implementation="cuda")
    with pytest.raises(ValueError, match=r"x \[..., K\] and w \[K, N\]"):
        fp8_ops.fp8_linear(jnp.ones((4, 8)), jnp.ones((16, 4)), XLA)
    with pytest.raises(TypeError, match="float8"):
        fp8_ops.fp8_silu(jnp.ones((4, 16), jnp.float8_e4m3fn), XLA)
    with pytest.raises(ValueError, match="one shape and dtype"):
        fp8_ops.fp8_mul(jnp.ones((4, 16)), jnp.ones((4, 16), jnp.bfloat16), XLA)
    with pytest.raises(ValueError, match="weight must have shape"):
        fp8_ops.fp8_rmsnorm(jnp.ones((4, 16)), jnp.ones((8,)), 1e-6, XLA)


def test_dot_general_drop_in_for_nnx_linear():
    rngs = nnx.Rngs(0)
    fp8_layer = nnx.Linear(64, 32, dot_general=fp8_dot_general, rngs=rngs)
    plain = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(12), (4, 64))
    assert cosine(fp8_layer(x), plain(x)) > 0.995
    grad = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(fp8_layer)
    grad_ref = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(plain)
    assert cosine(grad.kernel[...], grad_ref.kernel[...]) >= 0.99
    with pytest.raises(ValueError, match="dimension_numbers"):
        fp8_dot_general(x, jnp.ones((4, 32)), (((0,), (0,)), ((), ())))


# ------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("weight_residual", fp8_ops.WEIGHT_RESIDUALS)
@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("n_weights", [1, 2])
@pytest.mark.parametrize("gemm_output", fp8_ops.GEMM_OUTPUTS)
def test_fp8_linear_compiles_to_cublaslt_fp8(
    implementation, n_weights, weight_residual, gemm_output
):
    # Llama-2-7B-sized projections (compile only): every GEMM of forward, dgrad and wgrad must
    # be cuBLASLt's FP8 GEMM, none a BF16/float32 GEMM or a Triton GEMM fusion.
    sds = jax.ShapeDtypeStruct
    x = sds((2, 1024, 4096), jnp.bfloat16)
    ws = tuple(sds((4096, n), jnp.float32) for n in (4096, 1024)[:n_weights])
    cs = tuple(sds((2, 1024, w.shape[1]), jnp.float32) for w in ws)
    config = FP8Config(
        implementation=implementation, weight_residual=weight_residual, gemm_output=gemm_output
    )

    def loss(x, ws, cs):
        # Cotangents that are arguments, so XLA cannot constant-fold the gradient path.
        ys = fp8_ops.fp8_linear(x, ws if n_weights > 1 else ws[0], config)
        ys = ys if n_weights > 1 else (ys,)
        return sum(jnp.sum(y.astype(jnp.float32) * c) for y, c in zip(ys, cs, strict=True))

    hlo = (
        jax.jit(jax.value_and_grad(loss, (0, 1)), compiler_options=fp8_ops.fp8_compiler_options())
        .lower(x, ws, cs)
        .compile()
        .as_text()
    )
    targets = re.findall(r'custom_call_target="([^"]+)"', hlo)
    # forward, dgrad and wgrad per weight
    assert targets.count("__cublas$lt$matmul$f8") == 3 * n_weights, sorted(targets)
    assert "__cublas$lt$matmul" not in targets and "__cublas$gemm" not in targets, targets
    assert "__triton_gemm" not in hlo
    # gemm_output="compute": forward's GEMMs, and one weight's dgrad, write BF16 themselves.
    results = re.findall(r'= \((\w+)\[[^\n]*?custom_call_target="__cublas\$lt\$matmul\$f8"', hlo)
    assert len(results) == 3 * n_weights, results
    expected = 0 if gemm_output == "float32" else n_weights + (n_weights == 1)
    assert results.count("bf16") == expected, results


def _sub_jaxprs(values):
    for v in values:
        if isinstance(v, (list, tuple)):
            yield from _sub_jaxprs(v)
        elif hasattr(v, "eqns"):
            yield v
        elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
            yield v.jaxpr


def _dot_operand_sources(jaxpr) -> list[tuple[str, str, str]]:
    """For every dot_general in ``jaxpr`` (recursively): its result dtype and, per operand, the
    dtype it was converted from (``"float8_e4m3fn"``), that with ``"*scale"`` when the convert
    is multiplied by a scalar (a 0-d value, broadcast or not), or ``"not a convert"``."""
    found = []

    def walk(jx):
        producers = {}

        def source(v):
            p = None if isinstance(v, jex_core.Literal) else producers.get(v)
            if p is not None and p.primitive.name == "convert_element_type":
                return str(p.invars[0].aval.dtype)
            if p is not None and p.primitive.name == "mul":
                inner = [source(u) for u in p.invars]
                scalar = [_is_scalar(u) for u in p.invars]
                for i in (0, 1):
                    if scalar[1 - i] and inner[i].startswith("float8"):
                        return inner[i] + "*scale"
            return "not a convert"

        def _is_scalar(v):
            if not hasattr(v, "aval"):
                return False
            if v.aval.shape == ():
                return True
            p = None if isinstance(v, jex_core.Literal) else producers.get(v)
            return (
                p is not None
                and p.primitive.name == "broadcast_in_dim"
                and (p.invars[0].aval.shape == ())
            )

        for eqn in jx.eqns:
            for out in eqn.outvars:
                producers[out] = eqn
            if eqn.primitive.name == "dot_general":
                out_dtype = str(eqn.outvars[0].aval.dtype)
                found.append((out_dtype, *(source(v) for v in eqn.invars)))
            for sub in _sub_jaxprs(eqn.params.values()):
                walk(sub)

    walk(jaxpr.jaxpr)
    return found


@pytest.mark.parametrize("gemm_output", fp8_ops.GEMM_OUTPUTS)
@pytest.mark.parametrize("n_weights", [1, 2])
@pytest.mark.parametrize("weight_residual", fp8_ops.WEIGHT_RESIDUALS)
@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_fp8_linear_dots_take_fp8_codes_directly(
    implementation, weight_residual, n_weights, gemm_output
):
    # The spellings XLA's cuBLASLt FP8 rewriter needs (docs/fp8_gemm.md): every GEMM of forward,
    # dgrad and wgrad is a dot of convert(float8 codes). A float32 result takes the scales after
    # the dot; a BF16 result (gemm_output="compute": forward, and dgrad of one weight) takes
    # convert(codes) * scalar scale as operands. A dequantize-then-dot on anything else (a
    # float32/BF16 operand) would compile to a float32 or BF16 GEMM on the GPU.
    config = FP8Config(
        implementation=implementation,
        interpret=True,
        weight_residual=weight_residual,
        gemm_output=gemm_output,
    )
    x = jnp.ones((2, 16, 64), jnp.bfloat16)
    ws = (jnp.ones((64, 32)), jnp.ones((64, 16)))[:n_weights]

    def loss(x, ws):
        ys = fp8_ops.fp8_linear(x, ws if n_weights > 1 else ws[0], config)
        ys = ys if n_weights > 1 else (ys,)
        return sum(jnp.sum(y.astype(jnp.float32) ** 2) for y in ys)

    sources = _dot_operand_sources(jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, ws))
    assert len(sources) == 3 * n_weights, sources  # (forward, dgrad, wgrad) per weight
    fp8 = {"float8_e4m3fn", "float8_e5m2"}
    for out, *operands in sources:
        if out == "bfloat16":
            assert gemm_output == "compute", sources
            assert all(o.removesuffix("*scale") in fp8 and o.endswith("*scale") for o in operands)
        else:
            assert out == "float32" and set(operands) <= fp8, sources
    # BF16 results: forward's, and one weight's dgrad (a tuple's dgrads are summed in float32).
    narrow = [s for s in sources if s[0] == "bfloat16"]
    assert len(narrow) == (0 if gemm_output == "float32" else n_weights + (n_weights == 1))


def test_fp8_linear_float16_keeps_float32_gemm_results():
    # Float16 cannot hold an E5M2 gradient scale of a small gradient (2^-24 is its smallest
    # value): its GEMMs keep the float32 spelling, and a small gradient still comes through.
    x = jnp.ones((2, 8, 64), jnp.float16)
    w = jnp.ones((64, 32)) * 0.01
    loss = lambda x, w: 1e-3 * jnp.sum(fp8_ops.fp8_linear(x, w, XLA).astype(jnp.float32))
    sources = _dot_operand_sources(jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, w))
    assert len(sources) == 3 and all(out == "float32" for out, *_ in sources), sources
    dx, dw = jax.grad(loss, (0, 1))(x, w)
    assert dx.dtype == jnp.float16 and float(jnp.min(jnp.abs(dx))) > 0
    np.testing.assert_allclose(np.asarray(dx, np.float32), 1e-3 * 0.01 * 32, rtol=0.07)


def test_fp8_linear_gemm_output_float32_matches_compute():
    # The two spellings compute the same product; "compute" rounds each dequantized operand to
    # BF16 off the GPU (and the output once), so they agree to about BF16 precision.
    x = jax.random.normal(jax.random.key(0), (4, 32, 64), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (64, 48)) * 0.1

    def run(gemm_output):
        config = FP8Config(implementation="xla", gemm_output=gemm_output)

        def loss(x, w):
            return jnp.sum(fp8_ops.fp8_linear(x, w, config).astype(jnp.float32) ** 2)

        y = fp8_ops.fp8_linear(x, w, config)
        return y, jax.grad(loss, (0, 1))(x, w)

    (y_c, (dx_c, dw_c)), (y_f, (dx_f, dw_f)) = run("compute"), run("float32")
    assert y_c.dtype == y_f.dtype == jnp.bfloat16 and dx_c.dtype == dx_f.dtype == jnp.bfloat16
    # Forward differs by BF16 roundings only; the gradients also by the E5M2 codes of the output
    # gradient that a BF16 rounding of y can flip (one E5M2 step is 12.5% of a value).
    for a, b, tol in ((y_c, y_f, 0.01), (dx_c, dx_f, 0.05), (dw_c, dw_f, 0.05)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= tol * np.linalg.norm(b), np.linalg.norm(a - b)
    with pytest.raises(ValueError, match="gemm_output='bf16' is not one of"):
        FP8Config(gemm_output="bf16")


def test_fp8_compiler_options_only_on_gpu():
    assert fp8_ops.fp8_compiler_options("cpu") is None
    opts = fp8_ops.fp8_compiler_options("gpu")
    assert opts == {"xla_gpu_enable_triton_gemm": False, "xla_gpu_dot_merger_threshold_mb": 0}
    assert fp8_ops.GPU_XLA_FLAGS == (
        "--xla_gpu_enable_triton_gemm=false --xla_gpu_dot_merger_threshold_mb=0"
    )


# ------------------------------------------------------------------------------------------
# weight residual: "master" (re-quantize in backward) against "fp8" (keep forward's codes)

WEIGHT_OPTIONS = fp8_ops.WEIGHT_RESIDUALS
PALLAS_INTERPRET = FP8Config(implementation="pallas", interpret=True)


def _assert_identical(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) and la
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def _two_linears(config, policy="none"):
    """``fp8_linear`` twice (a tuple of weights, then a single one) with a SiLU between, under
    ``jax.checkpoint`` with a named remat policy of coat_jax.llama."""
    from coat_jax.llama import REMAT_POLICIES

    def block(ws, x):
        a, b = fp8_ops.fp8_linear(x, (ws[0], ws[1]), config)
        return fp8_ops.fp8_linear(jax.nn.silu(a) * b, ws[2], config)

    if policy == "none":
        return block
    return jax.checkpoint(block, policy=REMAT_POLICIES[policy])


def _block_args():
    keys = jax.random.split(jax.random.key(21), 4)
    x = jax.random.normal(keys[0], (2, 16, 64), jnp.bfloat16)
    ws = (
        0.05 * jax.random.normal(keys[1], (64, 96)),
        (0.05 * jax.random.normal(keys[2], (64, 96))).astype(jnp.bfloat16),
        0.05 * jax.random.normal(keys[3], (96, 48)),
    )
    return ws, x


def _weight_codes_kept(fn, *args):
    """Residuals of ``jax.vjp(fn, ws, x)`` that are FP8 and depend on the weights only."""
    kept = residuals(fn, *args, param_argnums=(0,))
    return sorted(r.shape for r in kept if not r.is_activation and r.dtype in FP8_DTYPES)


@pytest.mark.parametrize(
    "base,policy",
    [(XLA, p) for p in ("none", "full", "attention", "activations")]
    + [(PALLAS_INTERPRET, "activations")],
    ids=["xla-none", "xla-full", "xla-attention", "xla-activations", "pallas-activations"],
)
def test_weight_residual_fp8_is_bit_identical_to_master(base, policy):
    ws, x = _block_args()
    outs = {}
    for option in WEIGHT_OPTIONS:
        config = dataclasses.replace(base, weight_residual=option)
        block = _two_linears(config, policy)

        def loss(ws, x, block=block):
            y = block(ws, x)
            c = jax.random.normal(jax.random.key(7), y.shape, jnp.float32)
            return jnp.sum(y.astype(jnp.float32) * c)

        def output_and_grads(ws, x, block=block, loss=loss):  # one program per option
            return block(ws, x), jax.grad(loss, (0, 1))(ws, x)

        outs[option] = jax.jit(output_and_grads)(ws, x)
    _assert_identical(outs["master"], outs["fp8"])
    y, (gw, gx) = outs["fp8"]
    assert [g.dtype for g in gw] == [w.dtype for w in ws] and gx.dtype == x.dtype
    # Both really quantize: the output differs from the plain BF16 block's by an FP8 amount.
    a, b = fp8_ops.linear(x, ws[:2])
    err = rel_err(y, fp8_ops.linear(jax.nn.silu(a) * b, ws[2]))
    assert 1e-3 < err < 0.1, err


@pytest.mark.parametrize("policy", ["none", "full", "attention", "activations"])
def test_what_backward_keeps_of_the_weights(policy):
    ws, x = _block_args()
    weight_shapes = sorted(w.shape for w in ws)
    kept = {
        option: _weight_codes_kept(
            _two_linears(FP8Config(implementation="xla", weight_residual=option), policy), ws, x
        )
        for option in WEIGHT_OPTIONS
    }
    # "master" keeps no FP8 weight: backward re-quantizes the master weights it references.
    assert kept["master"] == []
    master = residuals(
        _two_linears(FP8Config(implementation="xla"), "none"), ws, x, param_argnums=(0,)
    )
    master_kept = sorted(r.shape for r in master if not r.is_activation and len(r.shape) == 2)
    assert master_kept == weight_shapes
    # "fp8" keeps forward's codes of every weight where the policy saves WEIGHT-tagged values
    # (no remat, and "activations"); "full" and "attention" recompute them in backward.
    expected = weight_shapes if policy in ("none", "activations") else []
    assert kept["fp8"] == expected, kept


def test_fp8_weight_codes_carry_their_own_checkpoint_name():
    ws, x = _block_args()
    block = _two_linears(FP8Config(implementation="xla", weight_residual="fp8"))
    save = jax.checkpoint_policies.save_only_these_names
    by_name = {
        name: _weight_codes_kept(jax.checkpoint(block, policy=save(name)), ws, x)
        for name in (fp8_ops.WEIGHT, fp8_ops.ACTIVATION)
    }
    assert by_name[fp8_ops.WEIGHT] == sorted(w.shape for w in ws)
    assert by_name[fp8_ops.ACTIVATION] == []


def _weight_quantizations(config, ws, x) -> int:
    """How many E4M3 arrays of a weight's shape the jaxpr of forward + backward makes (XLA
    quantizer: one ``convert_element_type`` to float8 per quantized weight)."""
    shapes = {w.shape for w in ws}
    count = 0

    def walk(jx):
        nonlocal count
        for eqn in jx.eqns:
            if eqn.primitive.name == "convert_element_type":
                out = eqn.outvars[0].aval
                count += out.dtype == jnp.float8_e4m3fn and out.shape in shapes
            for sub in _sub_jaxprs(eqn.params.values()):
                walk(sub)

    loss = lambda ws, x: jnp.sum(_two_linears(config)(ws, x).astype(jnp.float32))
    walk(jax.make_jaxpr(jax.grad(loss, (0, 1)))(ws, x).jaxpr)
    return count


def test_fp8_weight_residual_quantizes_each_weight_once():
    ws, x = _block_args()
    counts = {
        option: _weight_quantizations(
            FP8Config(implementation="xla", weight_residual=option), ws, x
        )
        for option in WEIGHT_OPTIONS
    }
    # "once" given plain master weights (no FP8Weight) keeps forward's codes, as "fp8" does.
    assert counts == {"master": 2 * len(ws), "fp8": len(ws), "once": len(ws)}, counts


def test_op_sets_carry_their_ops_names_and_docstrings():
    # help(ops_for("coat").linear) shows fp8_linear's docstring, not a functools.partial's.
    ops = ops_for("coat", FP8Config(swiglu="fused"))
    for name, op in (
        ("linear", fp8_ops.fp8_linear),
        ("rmsnorm", fp8_ops.fp8_rmsnorm),
        ("silu", fp8_ops.fp8_silu),
        ("mul", fp8_ops.fp8_mul),
        ("swiglu", fp8_ops.fp8_swiglu),
    ):
        bound = getattr(ops, name)
        assert bound.__name__ == op.__name__ and bound.__doc__ == op.__doc__, name
        assert "FP8" in bound.__doc__, name


def test_weight_quantizer_is_the_weight_path():
    # fp8_linear quantizes weights with _per_tensor(..., weight=True); on one device (no kernel
    # mesh) it is the same quantizer as the activations' (bit for bit).
    w = 0.05 * jax.random.normal(jax.random.key(22), (64, 96))
    for config in (XLA, PALLAS_INTERPRET):
        quantize = jax.jit(
            fp8_linear_module._per_tensor, static_argnums=(1, 2), static_argnames="weight"
        )
        _assert_identical(quantize(w, "e4m3", config, weight=True), quantize(w, "e4m3", config))
    calls = []
    original = fp8_linear_module._per_tensor

    def spy(x, fmt, config, *, weight=False):
        calls.append((x.shape, weight))
        return original(x, fmt, config, weight=weight)

    ws, x = _block_args()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fp8_linear_module, "_per_tensor", spy)
        for option in WEIGHT_OPTIONS:
            config = FP8Config(implementation="xla", weight_residual=option)
            loss = lambda ws, x, c=config: jnp.sum(_two_linears(c)(ws, x).astype(jnp.float32))
            jax.make_jaxpr(jax.grad(loss))(ws, x)  # tracing calls the quantizers
    weight_calls = [c for c in calls if c[0] in {w.shape for w in ws}]
    assert weight_calls and all(weight for _, weight in weight_calls), calls


FSDP_SNIPPET = r"""
import re
import jax, jax.numpy as jnp, numpy as np
from coat_jax import fp8_ops
from coat_jax.fp8 import linear as fp8_linear_module
from coat_jax.fp8_ops import FP8Config
from coat_jax.training import sharding
from pallas_kernels.sharding import KernelMesh

P = jax.sharding.PartitionSpec
mesh = sharding.make_mesh(1, 4)
kmesh = KernelMesh(mesh)
x = jax.random.normal(jax.random.key(0), (8, 16, 64), jnp.bfloat16)
w = 0.05 * jax.random.normal(jax.random.key(1), (64, 1024)).at[3, 900].set(-0.9)
spec = kmesh.param_spec(w.shape)
assert spec == P(None, "fsdp"), spec  # columns split: the activation rule would split rows
xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, P(("data", "fsdp"))))
ws = jax.device_put(w, jax.sharding.NamedSharding(mesh, spec))


def step(config):
    loss = lambda x, w: jnp.sum(fp8_ops.fp8_linear(x, w, config).astype(jnp.float32) ** 2)
    return jax.jit(jax.value_and_grad(loss, (0, 1)))


def relayouts(hlo):
    # Collectives that move the float32 weight between layouts before it is quantized. (The
    # GEMMs' all-gathers are of the codes; the CPU backend converts them to float32 first.)
    return re.findall(r" (all-to-all|collective-permute)(?:-start)?\(", hlo)


pallas = dict(implementation="pallas", interpret=True)
results = {}
for option in fp8_ops.WEIGHT_RESIDUALS:
    on_mesh = step(FP8Config(mesh=kmesh, weight_residual=option, **pallas))
    hlo = on_mesh.lower(xs, ws).compile().as_text()
    assert relayouts(hlo) == [], (option, relayouts(hlo))
    (v, (gx, gw)) = on_mesh(xs, ws)
    (v1, (gx1, gw1)) = step(FP8Config(weight_residual=option, **pallas))(x, w)
    assert np.asarray(v) == np.asarray(v1) and np.array_equal(gx, gx1), option
    np.testing.assert_allclose(gw, gw1, rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(gw1))))
    results[option] = (v, gx, gw)
for a, b in zip(results["master"], results["fp8"]):
    assert np.array_equal(np.asarray(a), np.asarray(b))

# The check can fail: quantizing the weight by the activation rule (rows over the batch axes)
# re-lays the float32 weight out first.
original = fp8_linear_module._per_tensor
fp8_linear_module._per_tensor = lambda x, fmt, config, weight=False: original(x, fmt, config)
hlo = step(FP8Config(mesh=kmesh, **pallas)).lower(xs, ws).compile().as_text()
assert relayouts(hlo), "the activation rule re-laid out no float32 weight"
print("ok")
"""


def test_fsdp_weight_is_quantized_on_its_shards():
    from tests.fake_devices import run_on_fake_devices

    assert run_on_fake_devices(FSDP_SNIPPET, devices=4, timeout=240).strip().endswith("ok")


def test_weight_residual_is_checked():
    with pytest.raises(ValueError, match=r"weight_residual='bf16'.*\['master', 'fp8', 'once'\]"):
        FP8Config(weight_residual="bf16")

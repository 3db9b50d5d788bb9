"""Row-wise FP8 linears fused with their producers (``coat_jax.fp8.rowwise_fused``): RMSNorm
then q|k|v (or gate|up), SwiGLU then down, under ``FP8Config(linear_scaling="row")``.

With the XLA reference the fused op is the two ops it replaces, forward and backward, bit for
bit on float32 activations (the same codes feed the same GEMMs). With the Pallas kernels (interpret mode on the CPU) the
row codes may differ by one BF16 rounding of the producer's output (tests/kernels/
test_fp8_rowquant.py), so results agree to FP8 precision: relative Frobenius error below
2^-4 (measured: forward 0.03, gradients 0.03 to 0.05), and against float32 autodiff as the
plain row-wise linear does (tests/fp8/test_fp8_rowwise.py: below 0.15).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax.fp8_ops import (
    FP8Config,
    fp8_rmsnorm,
    fp8_rmsnorm_rowwise_linear,
    fp8_rowwise_linear,
    fp8_swiglu,
    fp8_swiglu_rowwise_linear,
    ops_for,
)
from coat_jax.memory import residuals

ROW = FP8Config(implementation="xla", linear_scaling="row", swiglu="fused")
# The Pallas producers: compiled on a GPU, in interpret mode elsewhere.
PALLAS = dataclasses.replace(ROW, implementation="pallas", interpret=jax.default_backend() != "gpu")


def _act(shape, seed):
    k1, k2 = jax.random.split(jax.random.key(seed))
    rows = 10.0 ** jax.random.uniform(k2, shape[:-1] + (1,), minval=-2.0, maxval=2.0)
    return (rows * jax.random.normal(k1, shape)).astype(jnp.bfloat16)


def _w(k, n, seed):
    return 0.05 * jax.random.normal(jax.random.key(seed), (k, n))


def _rel(a, ref):
    a, ref = (np.asarray(jnp.asarray(v, jnp.float32), np.float64) for v in (a, ref))
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


X, NORM_W = _act((2, 8, 64), 0), 1.0 + 0.1 * jax.random.normal(jax.random.key(9), (64,))
WS = (_w(64, 32, 1), _w(64, 16, 2))
GATE, UP, DOWN = _act((2, 8, 96), 3), _act((2, 8, 96), 4), _w(96, 64, 5)
# A fixed cotangent for the MLP's output, whose rows span 1e-4..1e4.
COT = jnp.sin(jnp.arange(2 * 8 * 64, dtype=jnp.float32).reshape(2, 8, 64))


def _norm_loss(fused, config):
    def loss(x, nw, ws):
        if fused:
            ys = fp8_rmsnorm_rowwise_linear(x, nw, ws, 1e-6, config)
        else:
            ys = fp8_rowwise_linear(fp8_rmsnorm(x, nw, 1e-6, config), ws, config)
        return sum(jnp.sum(jnp.sin(y.astype(jnp.float32))) for y in ys)

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))


def _swiglu_loss(fused, config):
    def loss(g, u, w):
        if fused:
            y = fp8_swiglu_rowwise_linear(g, u, w, config)
        else:
            y = fp8_rowwise_linear(fp8_swiglu(g, u, config), w, config)
        return jnp.sum(y.astype(jnp.float32) * COT)

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))


def _f32_grads(f, *args):
    return jax.grad(f, tuple(range(len(args))))(*(jnp.asarray(a, jnp.float32) for a in args))


@pytest.mark.parametrize("kind", ["rmsnorm", "swiglu"])
def test_reference_path_is_the_two_ops_bit_for_bit(kind):
    # float32 activations: with BF16 ones XLA's excess precision may skip the BF16 rounding of
    # the producer's output in one program and not the other (one E4M3 step on some codes).
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    if kind == "rmsnorm":
        make, args = _norm_loss, (f32(X), NORM_W, WS)
    else:
        make, args = _swiglu_loss, (f32(GATE), f32(UP), DOWN)
    fused, plain = make(True, ROW)(*args), make(False, ROW)(*args)
    for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(a, b)


def test_pallas_rmsnorm_path_within_fp8_tolerance():
    (_, got), (_, ref) = (
        _norm_loss(True, PALLAS)(X, NORM_W, WS),
        _norm_loss(True, ROW)(X, NORM_W, WS),
    )
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        assert _rel(a, b) < 2**-4
    exact = _f32_grads(
        lambda x, nw, w0, w1: sum(
            jnp.sum(jnp.sin(x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * nw @ w))
            for w in (w0, w1)
        ),
        X,
        NORM_W,
        *WS,
    )
    for a, b in zip(jax.tree.leaves(got), exact, strict=True):
        assert 1e-3 < _rel(a, b) < 0.15


def test_pallas_swiglu_path_within_fp8_tolerance():
    (_, got), (_, ref) = (
        _swiglu_loss(True, PALLAS)(GATE, UP, DOWN),
        _swiglu_loss(True, ROW)(GATE, UP, DOWN),
    )
    for a, b in zip(got, ref, strict=True):
        assert _rel(a, b) < 2**-4
    exact = _f32_grads(lambda g, u, w: jnp.sum((jax.nn.silu(g) * u) @ w * COT), GATE, UP, DOWN)
    for a, b in zip(got, exact, strict=True):
        assert 1e-3 < _rel(a, b) < 0.15


@pytest.mark.parametrize("config", [ROW, PALLAS], ids=["xla", "pallas"])
def test_keeps_fp8_activations_only(config):
    kept = residuals(
        lambda nw, ws, x: fp8_rmsnorm_rowwise_linear(x, nw, ws, 1e-6, config),
        NORM_W,
        WS,
        X,
        param_argnums=(0, 1),
    )
    acts = sorted((r.shape, str(r.dtype)) for r in kept if r.is_activation)
    assert acts == [
        ((2, 8, 1), "float32"),  # rstd
        ((2, 8, 1), "float32"),  # the row scales of the normalized input
        ((2, 8, 4), "float32"),  # the 1x16 scales of x
        ((2, 8, 64), "float8_e4m3fn"),  # x, 1x16
        ((2, 8, 64), "float8_e4m3fn"),  # the normalized input, per row
    ]
    kept = residuals(
        lambda w, g, u: fp8_swiglu_rowwise_linear(g, u, w, config),
        DOWN,
        GATE,
        UP,
        param_argnums=(0,),
    )
    wide = [
        r
        for r in kept
        if r.is_activation and r.dtype.itemsize > 1 and np.prod(r.shape) >= GATE.size
    ]
    assert not wide


def test_ops_for_fuses_under_row_scaling_only():
    coat = ops_for("coat", ROW)
    assert coat.norm_linear is not None and coat.swiglu_linear is not None
    assert ops_for("coat", dataclasses.replace(ROW, swiglu="coat")).swiglu_linear is None
    assert ops_for("fp8", ROW).norm_linear is None
    assert ops_for("coat", FP8Config()).norm_linear is None
    np.testing.assert_array_equal(
        coat.silu_mul_then_linear(GATE, UP, DOWN), fp8_swiglu_rowwise_linear(GATE, UP, DOWN, ROW)
    )
    plain = ops_for("bf16")
    np.testing.assert_array_equal(
        plain.rmsnorm_then_linear(X, NORM_W, 1e-6, WS[0]),
        plain.linear(plain.rmsnorm(X, NORM_W, 1e-6), WS[0]),
    )

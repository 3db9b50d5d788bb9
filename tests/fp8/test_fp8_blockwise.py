"""Block-wise scaled FP8 linear: ``FP8Config(linear_scaling="block")``, trainer
``fp8_linear_scaling=block``.

Tolerances (inputs as tests/fp8/test_fp8_rowwise.py's: x normal with rows spanning 1e-3..1e3,
w normal):
* forward against the float64 dot of the dequantized codes times their scales: float32
  rounding (relative Frobenius error below 1e-5);
* forward against float32: below 0.08 relative (measured 0.039 at K=200, N=136; row-wise 0.034);
* gradients against float32 autodiff, relative Frobenius error: dx and dw below 0.15 (measured
  0.057 and 0.062; row-wise 0.058 and 0.061);
* "really quantized": every gradient differs from float32's by at least 1e-3 relative.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax import fp8_ops
from coat_jax.fp8.blockwise import fp8_blockwise_linear
from coat_jax.fp8_ops import FP8Config, fp8_rowwise_linear, ops_for
from coat_jax.memory import residuals
from coat_jax.training import load_config
from coat_jax.training.program import build_program
from pallas_kernels import fp8_blockgemm as bg
from tests.tiny_runs import tiny_run

BLOCK = FP8Config(implementation="xla", linear_scaling="block")


def _x(shape=(2, 24, 256), dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(0))
    rows = 10.0 ** jax.random.uniform(k2, shape[:-1] + (1,), minval=-3.0, maxval=3.0)
    return (rows * jax.random.normal(k1, shape)).astype(dtype)


def _w(k=256, n=192, seed=1):
    return 0.05 * jax.random.normal(jax.random.key(seed), (k, n))


def _rel(a, ref):
    a, ref = (np.asarray(jnp.asarray(v, jnp.float32), np.float64) for v in (a, ref))
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def test_forward_is_the_dequantized_product():
    # K and N not multiples of 128: two blocks each, the last ones zero-padded.
    k, n = 200, 136
    x, w = _x((2, 24, k)), _w(k, n)
    y = jax.jit(fp8_blockwise_linear, static_argnums=2)(x, w, BLOCK)
    x_q = bg.quantize_1x128(x.reshape(-1, k))
    w_codes, w_scale = bg.quantize_128x128(w)
    assert x_q.scale.shape == (48, -(-k // 128)) and w_scale.shape == (-(-k // 128), -(-n // 128))
    w_deq = (
        np.asarray(w_codes.astype(jnp.float32), np.float64)
        * np.repeat(np.repeat(np.asarray(w_scale, np.float64), 128, 0), 128, 1)[:k, :n]
    )
    ref = np.asarray(x_q.dequantize(), np.float64) @ w_deq
    assert _rel(y.reshape(-1, n), ref) < 1e-5
    assert _rel(y, x @ w) < 0.08


def test_gradients_close_to_float32():
    x, w = _x(), _w()
    c = jax.random.normal(jax.random.key(2), (2, 24, 192))
    loss = lambda f: lambda x, w: jnp.sum(f(x, w) * c)
    grads = jax.jit(jax.grad(loss(lambda x, w: fp8_blockwise_linear(x, w, BLOCK)), (0, 1)))
    gx, gw = grads(x, w)
    rx, rw = jax.grad(loss(lambda x, w: x @ w), (0, 1))(x, w)
    assert gx.dtype == x.dtype and gw.dtype == w.dtype
    assert 1e-3 < _rel(gx, rx) < 0.15
    assert 1e-3 < _rel(gw, rw) < 0.15


def test_keeps_fp8_codes_and_tile_scales_of_x():
    x, ws = _x(dtype=jnp.bfloat16), (_w(), _w(n=64, seed=2))
    kept = residuals(lambda ws, x: fp8_blockwise_linear(x, ws, BLOCK), ws, x, param_argnums=(0,))
    acts = [r for r in kept if r.is_activation]
    assert sorted((r.shape, str(r.dtype)) for r in acts) == [
        ((2, 24, 2), "float32"),  # one float32 scale per token per 128 channels, x's rank
        ((2, 24, 256), "float8_e4m3fn"),  # x kept once for the pair of weights
    ]
    assert not any(r.dtype.itemsize > 1 and np.prod(r.shape) >= x.size for r in acts)


def test_pallas_interpret_equals_the_reference_forward_and_backward():
    # 128 tokens and N = 256, so that the kernel takes every GEMM (the weight gradient
    # contracts over the tokens). Both run on the CPU, where the reference's dots sum in the
    # kernel's order; a GPU's library GEMM sums in another, which the loss's cancellation
    # magnifies past this bound.
    cpu = jax.devices("cpu")[0]
    x, w = jax.device_put(_x((2, 64, 256)), cpu), jax.device_put(_w(256, 256), cpu)
    pallas = FP8Config(implementation="pallas", interpret=True, linear_scaling="block")

    def value_and_grads(config):
        f = lambda x, w: jnp.sum(jnp.sin(fp8_blockwise_linear(x, w, config)))
        with jax.default_device(cpu):
            return jax.jit(jax.value_and_grad(f, (0, 1)))(x, w)

    for got, want in zip(
        jax.tree.leaves(value_and_grads(pallas)),
        jax.tree.leaves(value_and_grads(BLOCK)),
        strict=True,
    ):
        assert _rel(got, want) < 1e-6


def test_ops_for_dot_general_and_config_checks():
    x, w = _x((2, 8, 64), jnp.bfloat16), _w(64, 32)
    expected = fp8_blockwise_linear(x, w, BLOCK)
    for precision in ("fp8", "coat"):
        ops = ops_for(precision, BLOCK)
        assert ops.linear.__wrapped__ is fp8_blockwise_linear  # config bound by ops_for
        assert ops.norm_linear is None and ops.swiglu_linear is None
    np.testing.assert_array_equal(
        fp8_ops.fp8_dot_general(x, w, (((2,), (0,)), ((), ())), config=BLOCK), expected
    )
    with pytest.raises(ValueError, match="set weight_residual='master'"):
        FP8Config(linear_scaling="block", weight_residual="once")
    with pytest.raises(ValueError, match="set attention_backward='recompute'"):
        FP8Config(linear_scaling="block", attention_backward="saved_output")
    with pytest.raises(ValueError, match="fp8_blockwise_linear runs linear_scaling 'block'"):
        fp8_blockwise_linear(x, w, FP8Config(linear_scaling="row"))
    with pytest.raises(ValueError, match="fp8_rowwise_linear runs linear_scaling 'row' or"):
        fp8_rowwise_linear(x, w, BLOCK)
    # The trainer's default weight residual is "once".
    with pytest.raises(ValueError, match="set precision.fp8_linear_scaling=tensor"):
        load_config(None, [*tiny_run(layers=1), "precision.fp8_linear_scaling=block"])


def test_trainer_step_runs_twice(tmp_path):
    # The trainer's own jitted step (build_program), without the run's data, evaluation and
    # checkpoints: the key reaches the model, and two steps give finite losses.
    overrides = [
        *tiny_run(layers=1, batch_size=2, seq_len=16),
        "kernels=xla",
        "precision.fp8_weight_residual=master",
        "precision.fp8_linear_scaling=block",
        f"output_dir={tmp_path}/r",
    ]
    cfg = load_config(None, overrides)
    program = build_program(cfg, cfg.model)
    assert program.model_def.bind(program.abstract_params).fp8_config.linear_scaling == "block"
    params = program.init_params(jax.random.key(0))
    state = program.init_opt_state(params)
    batch = jax.random.randint(jax.random.key(1), program.abstract_batch().shape, 0, 258)
    losses = []
    for _ in range(2):
        params, state, metrics = program.step_fn(params, state, batch)
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and losses[1] < losses[0]

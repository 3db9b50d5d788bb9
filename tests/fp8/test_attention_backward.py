"""FP8 attention whose backward reads the saved output (``attention_backward="saved_output"``).

``coat_jax.attention``: the jnp reference against ``jax.nn.dot_product_attention`` (CPU, float32)
and cuDNN's forward and backward-from-statistics against the reference (GPU only).
``fp8_ops.fp8_attention_linear``: what it keeps (the FP8 q, k, v and o_proj input of the
re-running pair plus the float32 statistics, nothing in BF16), that its backward runs no
attention forward, and its gradients against float32 and against the re-running pair's.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coat_jax import attention, fp8_ops, llama
from coat_jax.fp8_ops import FP8Config
from coat_jax.memory import residuals
from tests.model.test_scan_remat import CFG

XLA = FP8Config(implementation="xla", attention="xla")
SAVED = dataclasses.replace(XLA, attention_backward="saved_output")
ON_GPU = jax.default_backend() == "gpu"


def _rel(a, ref):
    a, ref = (np.asarray(jnp.asarray(x, jnp.float32), np.float64).ravel() for x in (a, ref))
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def _qkv(dtype, b=2, t=64, n=8, k=2, h=32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = (1.5 * jax.random.normal(keys[0], (b, t, n, h))).astype(dtype)
    kk = (1.5 * jax.random.normal(keys[1], (b, t, k, h))).astype(dtype)
    v = jax.random.normal(keys[2], (b, t, k, h)).astype(dtype)
    dout = jax.random.normal(keys[3], (b, t, n, h)).astype(dtype)
    return q, kk, v, dout


@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("kv_heads, kv_len", [(8, 64), (2, 64), (2, 96)])
def test_reference_forward_and_backward_match_jax_attention(is_causal, kv_heads, kv_len):
    q, k, v, dout = _qkv(jnp.float32, k=kv_heads)
    if kv_len != q.shape[1]:  # S != T: the causal mask's alignment matters
        k, v = (jnp.concatenate([x, x[:, : kv_len - x.shape[1]] * 0.5], axis=1) for x in (k, v))
    with jax.default_matmul_precision("highest"):  # no TF32 on a GPU
        _check_reference(q, k, v, dout, is_causal)


def _check_reference(q, k, v, dout, is_causal):
    ref, pullback = jax.vjp(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=is_causal), q, k, v
    )
    out, lse = attention.forward(q, k, v, is_causal, "xla")
    assert lse.shape == (2, 8, 64) and lse.dtype == jnp.float32
    np.testing.assert_allclose(out, ref, atol=1e-5)
    got = attention.backward(q, k, v, out, lse, dout, is_causal, "xla")
    for g, want in zip(got, pullback(dout), strict=True):
        assert g.shape == want.shape and g.dtype == want.dtype
        np.testing.assert_allclose(g, want, atol=2e-5)
    # The statistics matter: a backward given other statistics gives other gradients.
    off = attention.backward(q, k, v, out, lse + 0.5, dout, is_causal, "xla")
    assert _rel(off[2], got[2]) > 0.1


def test_attention_refuses_bad_shapes_and_implementations():
    q, k, v, _ = _qkv(jnp.float32, k=3)  # 3 kv heads do not divide 8 query heads
    with pytest.raises(ValueError, match="K dividing N"):
        attention.forward(q, k, v, True, "xla")
    q, k, v, _ = _qkv(jnp.float32)
    with pytest.raises(ValueError, match="one dtype"):
        attention.forward(q, k.astype(jnp.bfloat16), v, True, "xla")
    with pytest.raises(ValueError, match="not one of"):
        attention.forward(q, k, v, True, "flash")
    out, lse = attention.forward(q, k, v, True, "xla")
    with pytest.raises(ValueError, match="shaped as q"):
        attention.backward(q, k, v, out[:, :8], lse, out, True, "xla")
    with pytest.raises(ValueError, match=r"float32 statistics \[B, N, T\]"):
        attention.backward(q, k, v, out, jnp.swapaxes(lse, 1, 2), out, True, "xla")
    with pytest.raises(ValueError, match="one dtype"):
        attention.forward(q[0], k, v, True, "xla")
    with pytest.raises(ValueError, match="K dividing N"):
        attention.forward(q, k[:, :, :0], v[:, :, :0], True, "xla")
    with pytest.raises(ValueError, match="one o_proj weight"):
        w = _weight()
        fp8_ops.fp8_attention_linear(q, k, v, (w, w), True, SAVED)
    with pytest.raises(ValueError, match="attention_backward='bogus' is not one of"):
        FP8Config(attention_backward="bogus")


@pytest.mark.skipif(not ON_GPU, reason="cuDNN's attention needs a GPU")
@pytest.mark.parametrize("is_causal", [True, False])
def test_cudnn_forward_and_backward_from_statistics_match_the_reference(is_causal):
    assert attention.cudnn_available()
    q, k, v, dout = _qkv(jnp.bfloat16, b=2, t=256, n=8, k=2, h=128)
    out, stats = jax.jit(attention.forward, static_argnums=(3, 4))(q, k, v, is_causal, "cudnn")
    ref_out, ref_lse = attention.forward(q, k, v, is_causal, "xla")
    assert _rel(out, ref_out) < 1e-2
    back = jax.jit(attention.backward, static_argnums=(6, 7))
    got = back(q, k, v, out, stats, dout, is_causal, "cudnn")
    want = attention.backward(q, k, v, ref_out, ref_lse, dout, is_causal, "xla")
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert _rel(g, w) < 2e-2, _rel(g, w)
    # The cuDNN backward reads the statistics it is given (not ones it recomputes).
    shifted = back(q, k, v, out, stats + 0.5, dout, is_causal, "cudnn")
    assert _rel(shifted[2], got[2]) > 0.1


def _pair(config):
    """``fp8_linear(fp8_attention(q, k, v), w)``, the re-running pair."""

    def f(q, k, v, w):
        b, t, n, h = q.shape
        out = fp8_ops.fp8_attention(q, k, v, True, config)
        return fp8_ops.fp8_linear(out.reshape(b, t, n * h), w, config)

    return f


def _fused(config):
    return lambda q, k, v, w: fp8_ops.fp8_attention_linear(q, k, v, w, True, config)


def _exact(q, k, v, w):
    b, t, n, h = q.shape
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return out.reshape(b, t, n * h) @ w


def _grads(f, q, k, v, w, seed=5):
    c = jax.random.normal(jax.random.key(seed), (q.shape[0], q.shape[1], w.shape[1]))
    return jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * c), argnums=(0, 1, 2, 3))(
        q, k, v, w
    )


def _weight(n_h=256, d=48):
    return 0.05 * jax.random.normal(jax.random.key(9), (n_h, d))


def test_keeps_the_pairs_fp8_tensors_plus_float32_statistics_and_nothing_in_bf16():
    q, k, v, _ = _qkv(jnp.bfloat16)
    w = _weight()
    kept = residuals(_fused(SAVED), q, k, v, w, param_argnums=(3,))
    pair = residuals(_pair(XLA), q, k, v, w, param_argnums=(3,))
    act = lambda rs: sorted((r.shape, jnp.dtype(r.dtype).name) for r in rs if r.is_activation)
    stats = ((2, 8, 64), "float32")
    assert act(kept) == sorted([*act(pair), stats]), (act(kept), act(pair))
    fp8 = [r for r in kept if jnp.dtype(r.dtype) == jnp.float8_e4m3fn]
    # q, k, v (1x16 groups) and the o_proj input (per tensor, the attention output's codes).
    assert sorted(r.shape for r in fp8) == sorted([q.shape, k.shape, v.shape, (2 * 64, 256)])
    assert not [r for r in kept if r.is_activation and jnp.dtype(r.dtype) == jnp.bfloat16]


def test_backward_runs_no_attention_forward(monkeypatch):
    q, k, v, _ = _qkv(jnp.float32)
    w = _weight()
    y, pullback = jax.vjp(_fused(SAVED), q, k, v, w)
    _, pair_pullback = jax.vjp(_pair(XLA), q, k, v, w)

    def refuse(*args, **kwargs):
        raise AssertionError("the backward ran an attention forward")

    # Every way to an attention forward: the op's own, the re-running pair's (coat_jax's one
    # attention, attention.attend), jax.nn's.
    for module, name in (
        (attention, "forward"),
        (attention, "forward_reference"),
        (attention, "attend"),
        (jax.nn, "dot_product_attention"),
    ):
        monkeypatch.setattr(module, name, refuse)
    grads = pullback(jnp.ones_like(y))  # reads the kept output and statistics instead
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape, w.shape]
    # The check can fail: the re-running pair's backward is refused.
    with pytest.raises(AssertionError, match="ran an attention forward"):
        pair_pullback(jnp.ones_like(y))


def test_fp8_weight_codes_give_the_pairs_weight_gradient():
    q, k, v, _ = _qkv(jnp.bfloat16)
    w = fp8_ops.prequantized(_weight(), XLA)
    fused, pair = _grads(_fused(SAVED), q, k, v, w), _grads(_pair(XLA), q, k, v, w)
    assert jax.tree.structure(fused[3]) == jax.tree.structure(pair[3])
    np.testing.assert_allclose(fused[3].master, pair[3].master, rtol=0.05, atol=1e-3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradients_are_close_to_float32_and_to_the_re_running_pair(dtype):
    q, k, v, _ = _qkv(dtype)
    w = _weight()
    exact = _grads(_exact, *(x.astype(jnp.float32) for x in (q, k, v)), w)
    pair = _grads(_pair(XLA), q, k, v, w)
    fused = _grads(_fused(SAVED), q, k, v, w)
    np.testing.assert_allclose(
        _fused(SAVED)(q, k, v, w).astype(jnp.float32),
        _pair(XLA)(q, k, v, w).astype(jnp.float32),
        rtol=0.05,
        atol=0.05,
    )
    for name, g_fused, g_pair, g_exact in zip("qkvw", fused, pair, exact, strict=True):
        e_fused, e_pair = _rel(g_fused, g_exact), _rel(g_pair, g_exact)
        # Really quantized (a float32 path would be ~1e-6 away), within the FP8 ops' gradient
        # bound, and at most 1.6x the re-running pair's error (the forward's statistics with
        # the FP8 q, k: measured 1.5x on q and k in float32).
        assert 1e-3 < e_fused < 0.15, (name, e_fused)
        assert e_fused <= 1.6 * e_pair + 0.01, (name, e_fused, e_pair)


def _model_grads(config, scan, precision="coat"):
    model = llama.Llama(
        dataclasses.replace(CFG, num_hidden_layers=1),  # one layer takes the option as well
        precision=precision,
        rngs=nnx.Rngs(0),
        fp8_attention=True,
        fp8_config=config,
        scan_layers=scan,
        remat="activations",
    )
    tokens = jax.random.randint(jax.random.key(3), (2, 32), 0, CFG.vocab_size)
    graphdef, state = nnx.split(model)

    def loss(state):
        logits = nnx.merge(graphdef, state)(tokens).astype(jnp.float32)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])

    value, g = jax.jit(jax.value_and_grad(loss))(state)
    return value, np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])


@pytest.mark.parametrize("precision", ["fp8", "coat"])
@pytest.mark.parametrize("scan", [False, True])
def test_the_model_takes_the_option_in_both_layouts(scan, precision):
    base = dataclasses.replace(XLA, implementation="auto", attention="auto")
    saved = dataclasses.replace(base, attention_backward="saved_output")
    l_pair, g_pair = _model_grads(base, scan, precision)
    l_saved, g_saved = _model_grads(saved, scan, precision)
    np.testing.assert_allclose(l_saved, l_pair, rtol=1e-3)
    rel = _rel(g_saved, g_pair)
    assert 0 < rel < 0.05, rel  # another backward, close to the re-running one


def test_the_model_keeps_the_statistics_under_the_activations_policy():
    def kept(config):
        model = llama.Llama(
            CFG,
            precision="coat",
            rngs=nnx.Rngs(0),
            scan_layers=True,
            remat="activations",
            fp8_attention=True,
            fp8_config=config,
        )
        graphdef, state = nnx.split(model)
        tokens = jnp.zeros((3, 32), jnp.int32)
        res = residuals(
            lambda s, x: nnx.merge(graphdef, s)(x).sum(), state, tokens, param_argnums=(0,)
        )
        return sorted((r.shape, jnp.dtype(r.dtype).name) for r in res if r.is_activation)

    pair, saved = kept(FP8Config()), kept(FP8Config(attention_backward="saved_output"))
    # One more residual per layer, the float32 [B, N, T] statistics: nothing recomputed in its
    # place and no BF16 output kept.
    assert saved == sorted([*pair, ((CFG.num_hidden_layers, 3, 4, 32), "float32")]), (saved, pair)


def test_the_option_needs_fp8_attention():
    with pytest.raises(ValueError, match="pass fp8_attention=True"):
        llama.Llama(CFG, precision="coat", fp8_config=FP8Config(attention_backward="saved_output"))


@pytest.mark.skipif(not ON_GPU, reason="counts cuDNN attention kernels in the GPU program")
def test_on_the_gpu_the_backward_launches_one_attention_forward_less():
    q, k, v, _ = _qkv(jnp.bfloat16, t=256, h=128)
    w = _weight(n_h=8 * 128, d=256)
    base = FP8Config()

    def forwards(config, fn):
        c = jnp.ones((2, 256, 256), jnp.float32)
        step = jax.jit(
            jax.grad(lambda *a: jnp.sum(fn(config)(*a).astype(jnp.float32) * c), (0, 1, 2, 3))
        )
        hlo = step.lower(q, k, v, w).compile().as_text()
        return len(re.findall(r"custom_call_target=\"__cudnn\$fmhaSoftmax\"", hlo)), hlo

    pair, hlo_pair = forwards(base, _pair)
    fused, _ = forwards(dataclasses.replace(base, attention_backward="saved_output"), _fused)
    assert pair == 2 and fused == 1, (pair, fused)
    assert "__cudnn$fmhaSoftmaxBackward" in hlo_pair


def test_the_error_benchmark_measures_both_backwards():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import attention_backward_error as bench

    e = bench.errors(1.5, b=1, t=64, n=4, k=2, h=32)
    assert set(e) == {"recompute", "saved_output"}
    # FP8 inputs: both a few percent off, neither zero (a float32 path would be ~1e-6).
    assert all(1e-3 < x < 0.3 for xs in e.values() for x in xs), e


def test_the_trainer_key_reaches_the_model_and_needs_fp8_attention():
    from coat_jax.training.config import load_config
    from coat_jax.training.model import model_def_for

    with pytest.raises(ValueError, match="set precision.fp8_attention=true"):
        load_config(None, ["precision.fp8_attention_backward=saved_output"])
    cfg = load_config(
        None, ["precision.fp8_attention=true", "precision.fp8_attention_backward=saved_output"]
    )
    model_def = model_def_for(cfg.model, cfg)
    model = model_def.bind(model_def.abstract_params)
    assert model.fp8_config.attention_backward == "saved_output"
    assert model.ops().attention_linear is not None

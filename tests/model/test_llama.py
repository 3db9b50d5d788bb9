"""The Flax Llama against transformers' PyTorch LlamaForCausalLM, and its precision modes."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coat_jax.checkpoint_io import from_pretrained
from coat_jax.llama import Llama, LlamaConfig, RopeScaling, rope_inv_freq
from tests.llama_reference import (
    CASES,
    LLAMA3_SCALING,
    hf_llama,
    rel_err,
    token_ids,
    torch_logits,
    with_precision,
)

SEQ = 384


@pytest.fixture(scope="module")
def saved_cases(tmp_path_factory):
    """Each case saved once by transformers' save_pretrained: (folder, torch model)."""
    out = {}
    for case in CASES:
        model = hf_llama(case)
        folder = tmp_path_factory.mktemp(case)
        model.save_pretrained(folder)
        out[case] = (folder, model)
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_float32_logits_match_transformers(saved_cases, case):
    folder, torch_model = saved_cases[case]
    ids = token_ids(torch_model.config.vocab_size, 2, SEQ, seed=1)
    want = torch_logits(torch_model, ids)
    model = from_pretrained(folder, dtype=jnp.float32, param_dtype=jnp.float32)
    got = model(jnp.asarray(ids))
    assert got.dtype == jnp.float32 and got.shape == want.shape
    assert rel_err(got, want) <= 1e-4


def test_rope_frequencies_match_transformers():
    from transformers import LlamaConfig as HFConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = HFConfig(
        hidden_size=512,
        num_attention_heads=4,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling={**LLAMA3_SCALING, "original_max_position_embeddings": 8192},
    )
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    cfg = LlamaConfig.from_hf(hf.to_dict())
    got = rope_inv_freq(cfg)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    # All three llama3 bands occur: kept, interpolated and divided by the factor.
    ratio = rope_inv_freq(dataclasses.replace(cfg, rope_scaling=None)) / got
    assert np.isclose(ratio.min(), 1.0) and np.isclose(ratio.max(), 8.0)
    assert np.any((ratio > 1.01) & (ratio < 7.99))


def _loss_and_grads(model: Llama, ids):
    def loss_fn(m):
        logits = m(ids[:, :-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    flat = jnp.concatenate([g.ravel() for g in jax.tree.leaves(grads)])
    return loss, flat


# Tolerances against the float32 model on the tiny random GQA model (weights std 0.08): the
# normalized RMS error of the logits, ||got - want|| / ||want||, the loss difference relative to
# the loss, and the cosine similarity of the full parameter gradient. BF16 has an 8-bit mantissa;
# FP8 E4M3 GEMM inputs have 3 bits (about 4% error on one random GEMM already).
MODE_TOLERANCES = {
    "bf16": dict(logits=2e-2, loss=1e-3, grad_cos=0.999),
    "fp8": dict(logits=0.15, loss=1e-2, grad_cos=0.98),
    "coat": dict(logits=0.15, loss=1e-2, grad_cos=0.98),
}


def _nrmse(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.fixture(scope="module")
def float32_reference(saved_cases):
    folder, torch_model = saved_cases["gqa_tied_llama3"]
    model = from_pretrained(folder, dtype=jnp.float32)
    ids = jnp.asarray(token_ids(torch_model.config.vocab_size, 2, 129, seed=2))
    loss, grads = _loss_and_grads(model, ids)
    return model, ids, model(ids[:, :-1]), loss, grads


@pytest.mark.parametrize("precision", sorted(MODE_TOLERANCES))
def test_precision_modes_stay_close_to_float32(float32_reference, precision):
    model32, ids, logits32, loss32, grads32 = float32_reference
    model = with_precision(model32, precision, jnp.bfloat16)
    logits = model(ids[:, :-1])
    assert logits.dtype == jnp.float32
    tol = MODE_TOLERANCES[precision]
    loss, grads = _loss_and_grads(model, ids)
    cos = float(jnp.dot(grads, grads32) / (jnp.linalg.norm(grads) * jnp.linalg.norm(grads32)))
    measured = dict(
        logits=_nrmse(logits, logits32),
        loss=abs(float(loss) - float(loss32)) / float(loss32),
        grad_cos=cos,
    )
    print(precision, measured)
    assert measured["logits"] <= tol["logits"], measured
    assert measured["loss"] <= tol["loss"], measured
    assert measured["grad_cos"] >= tol["grad_cos"], measured


def _tiny(**overrides) -> LlamaConfig:
    kwargs = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def test_projections_share_their_input_without_weight_copies():
    # q, k, v (and gate, up) go through one ops.linear call with a tuple of weights: in bf16 mode
    # one dot per weight (autodiff keeps the shared input once) and no concatenated weight.
    # Per layer: q, k, v, o, gate, up, down and attention's two batched dots; plus lm_head.
    cfg = _tiny()
    model = Llama(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(
        state, jnp.zeros((1, 8), jnp.int32)
    )
    text = str(jaxpr)
    assert text.count("dot_general[") == 9 * cfg.num_hidden_layers + 1
    weight_dims = {cfg.hidden_size, cfg.intermediate_size}
    for eqn in jaxpr.jaxpr.eqns:
        if eqn.primitive.name == "concatenate":
            assert eqn.outvars[0].aval.ndim != 2 or not (
                set(eqn.outvars[0].aval.shape) & weight_dims
            ), eqn


def test_coat_mode_saves_the_shared_projection_input_once():
    cfg = _tiny(num_hidden_layers=1)
    model = Llama(cfg, precision="coat", rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    f = lambda s: nnx.merge(graphdef, s)(jnp.zeros((2, 16), jnp.int32)).sum()
    residuals = jax.tree.leaves(jax.eval_shape(lambda s: jax.vjp(f, s)[1], state))
    fp8_inputs = [
        r.shape
        for r in residuals
        if r.dtype == jnp.float8_e4m3fn and r.shape == (32, cfg.hidden_size)
    ]
    # Per-tensor FP8 inputs of hidden size: the q|k|v input, o_proj's input (heads * head_dim
    # equals hidden here) and the gate|up input, once each; per-weight calls would keep six.
    assert len(fp8_inputs) == 3, fp8_inputs


def test_cpu_attention_saves_no_probabilities():
    # XLA attention keeps [B, N, T, T] probabilities for backward unless rematerialized.
    cfg = _tiny(num_hidden_layers=1)
    t = 40  # unlike any model dimension, so a (t, t) trailing shape can only be attention's
    model = Llama(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    f = lambda s: nnx.merge(graphdef, s)(jnp.zeros((1, t), jnp.int32)).sum()
    # The vjp closure is a pytree whose leaves are the residuals kept for backward.
    residuals = jax.eval_shape(lambda s: jax.vjp(f, s)[1], state)
    shapes = [r.shape for r in jax.tree.leaves(residuals)]
    assert shapes, "expected residuals"
    assert not [s for s in shapes if s[-2:] == (t, t)], shapes


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cuDNN runs there")
@pytest.mark.parametrize(
    "precision, fp8_attention", [("bf16", False), ("coat", False), ("coat", True)]
)
def test_the_attention_setting_reaches_the_attention(precision, fp8_attention):
    """``FP8Config.attention`` picks the kernel the model's attention runs: on the CPU ``cudnn``
    reaches the attention op, which refuses it by name (JAX 0.10 raised its own cuDNN error
    there, 0.11 fails later with a lowering error), and ``xla`` runs."""
    from coat_jax.fp8_ops import FP8Config

    cfg = _tiny(num_hidden_layers=1)
    tokens = jnp.zeros((1, 16), jnp.int32)
    for choice in ("xla", "cudnn"):
        model = Llama(
            cfg,
            precision=precision,
            fp8_attention=fp8_attention,
            fp8_config=FP8Config(attention=choice),
            rngs=nnx.Rngs(0),
        )
        graphdef, state = nnx.split(model)
        loss = lambda s, g=graphdef: nnx.merge(g, s)(tokens).astype(jnp.float32).sum()
        run = jax.jit(jax.grad(loss)).lower
        if choice == "xla":
            run(state)
        else:
            with pytest.raises(RuntimeError, match="attention='cudnn'.*needs a CUDA GPU"):
                run(state)


def test_rope_is_relative_positions_shift(saved_cases):
    # RoPE attention depends only on position differences: shifting every position leaves the
    # logits unchanged up to float32 rounding, while other positions change them.
    folder, torch_model = saved_cases["mha_untied"]
    model = from_pretrained(folder, dtype=jnp.float32)
    ids = jnp.asarray(token_ids(torch_model.config.vocab_size, 1, 64, seed=4))
    base = model(ids)
    shifted = model(ids, jnp.arange(64)[None] + 1000)
    assert rel_err(shifted, base) <= 1e-4
    assert rel_err(model(ids, jnp.arange(64)[None] * 2), base) > 1e-2


def test_bad_precision_and_inputs():
    cfg = _tiny()
    with pytest.raises(ValueError, match=r"precision='fp16'.*\['bf16', 'fp8', 'coat'\]"):
        Llama(cfg, precision="fp16")
    model = Llama(cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="int token ids"):
        model(jnp.zeros((1, 4), jnp.float32))
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        model(jnp.zeros((4,), jnp.int32))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(hidden_size=30, num_attention_heads=4), "does not divide hidden_size=30"),
        (dict(num_key_value_heads=3), "num_key_value_heads=3 does not divide"),
        (dict(vocab_size=0), "vocab_size must be a positive int"),
        (dict(head_dim=7), "head_dim must be a positive even int"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "'yarn' is not supported"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "llama3 rope_scaling needs"),
    ],
)
def test_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        _tiny(**overrides)


def test_config_from_hf_forms_and_round_trip(tmp_path):
    cfg = _tiny(rope_scaling=dict(LLAMA3_SCALING), tie_word_embeddings=True)
    assert isinstance(cfg.rope_scaling, RopeScaling)
    hash(cfg)
    d = cfg.to_hf_dict()
    assert LlamaConfig.from_hf(d) == cfg
    # transformers 5 writes rope_parameters instead of rope_theta + rope_scaling.
    v5 = {k: v for k, v in d.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_theta": d["rope_theta"], **LLAMA3_SCALING}
    assert LlamaConfig.from_hf(v5) == cfg
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert LlamaConfig.from_hf(tmp_path) == cfg
    assert LlamaConfig.from_hf(tmp_path / "config.json") == cfg
    with pytest.raises(ValueError, match="model_type='gpt_neox' is not supported; valid: "):
        LlamaConfig.from_hf({**d, "model_type": "gpt_neox"})
    with pytest.raises(ValueError, match="attention_bias=True is not supported"):
        LlamaConfig.from_hf({**d, "attention_bias": True})
    with pytest.raises(FileNotFoundError):
        LlamaConfig.from_hf(tmp_path / "nowhere")


def test_config_round_trips_through_transformers():
    from transformers import LlamaConfig as HFConfig

    cfg = _tiny(rope_scaling=dict(LLAMA3_SCALING), head_dim=16, rms_norm_eps=1e-5)
    hf = HFConfig(**cfg.to_hf_dict())
    assert LlamaConfig.from_hf(hf.to_dict()) == cfg

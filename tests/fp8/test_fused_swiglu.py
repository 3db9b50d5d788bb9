"""The fused SwiGLU of the coat precision: ``FP8Config(swiglu="fused")``, trainer ``fp8_swiglu``.

COAT runs the MLP's ``silu(gate) * up`` as two FP8 ops and keeps gate, the SiLU output and up
in FP8 for backward; the fused op keeps gate and up and recomputes the SiLU in backward. Here:
what the model then keeps (exactly one intermediate-size FP8 tensor and its scales less per
layer), that its loss stays within 2% of BF16's and its gradients within 1.5x of COAT's
distance from BF16's, and the trainer option.
The op against its references is in tests/fp8/test_fp8_ops.py and tests/kernels/test_fp8_act.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax.fp8_ops import FP8Config, ops_for
from coat_jax.memory import residuals
from coat_jax.training import load_config
from coat_jax.training.model import next_token_loss
from coat_jax.training.program import build_program
from tests.tiny_runs import tiny_run

B = 2
# The trainer's tiny model (hidden 64, intermediate 160, 1 layer): the intermediate size is
# apart from every other axis, so the intermediate-size residuals are found by their last axis.
RUN = [
    *tiny_run(intermediate=160, layers=1, batch_size=B),
    "kernels=xla",
    "xla.compilation_cache_dir=null",
]


@functools.cache
def _program(swiglu: str, precision: str = "coat"):
    """``(config, loss, params)``: the trainer's program for the option and its loss
    ``(params, tokens) -> nats`` (``next_token_loss``), with the weights of seed 0 (the same
    for every option)."""
    extra = ["optimizer.name=adamw"] if precision != "coat" else [f"precision.fp8_swiglu={swiglu}"]
    cfg = load_config(None, [*RUN, f"precision.mode={precision}", *extra])
    program = build_program(cfg, cfg.model)
    loss = functools.partial(next_token_loss, program.model_def)
    return cfg, loss, program.init_params(jax.random.key(0))


def _tokens(cfg):
    shape = (B, cfg.seq_len + 1)
    return jax.random.randint(jax.random.key(1), shape, 0, cfg.model.vocab_size, jnp.int32)


def test_ops_for_gives_the_fused_op_only_when_asked():
    assert ops_for("coat", FP8Config(implementation="xla")).swiglu is None
    assert ops_for("coat", FP8Config(implementation="xla", swiglu="fused")).swiglu is not None
    # The bf16 and fp8 precisions run the SiLU and the product in BF16 whatever the option.
    for precision in ("bf16", "fp8"):
        assert ops_for(precision, FP8Config(implementation="xla", swiglu="fused")).swiglu is None
    with pytest.raises(ValueError, match="swiglu='silu' is not one of"):
        FP8Config(swiglu="silu")


def test_keeps_one_intermediate_fp8_tensor_less_per_layer():
    kept = {}
    for swiglu in ("coat", "fused"):
        cfg, loss, params = _program(swiglu)
        kept[swiglu] = [
            r for r in residuals(loss, params, _tokens(cfg), param_argnums=(0,)) if r.is_activation
        ]
    fp8 = lambda rs, n: [r for r in rs if r.dtype.itemsize == 1 and r.shape[-1] == n]
    f = cfg.model.intermediate_size
    layers = cfg.model.num_hidden_layers
    T = cfg.seq_len
    # COAT: gate (SiLU's input), the SiLU output and up (the product's inputs); fused: gate,
    # up. Both: down_proj's per-tensor input.
    assert len(fp8(kept["coat"], f)) == 4 * layers
    assert len(fp8(kept["fused"], f)) == 3 * layers
    saved = sum(r.nbytes for r in kept["coat"]) - sum(r.nbytes for r in kept["fused"])
    # Per layer one [B, T, F] tensor of E4M3 codes and its float32 1x16 scales.
    assert saved == layers * B * T * f * (1 + 4 / 16)


def test_forward_and_gradients_stay_as_close_to_bf16_as_coats():
    cfg, loss_bf16, params = _program("coat", precision="bf16")
    grad = lambda loss, params: jax.jit(jax.value_and_grad(loss))(params, _tokens(cfg))
    ref_loss, ref_grads = grad(loss_bf16, params)
    flat = lambda g: np.concatenate(
        [np.ravel(np.asarray(a, np.float32)) for a in jax.tree.leaves(g)]
    )
    dist = {}
    for swiglu in ("coat", "fused"):
        _, loss, params = _program(swiglu)  # the same seed: the same weights
        value, grads = grad(loss, params)
        assert abs(float(value) - float(ref_loss)) < 0.02 * abs(float(ref_loss))
        dist[swiglu] = np.linalg.norm(flat(grads) - flat(ref_grads)) / np.linalg.norm(
            flat(ref_grads)
        )
    # One FP8 rounding fewer (the SiLU output's): no further from BF16 than COAT, up to noise.
    assert 0 < dist["fused"] < 0.1 and dist["fused"] < 1.5 * dist["coat"], dist


def test_trainer_option():
    overrides = [*tiny_run(layers=1), "kernels=xla"]
    cfg = load_config(None, [*overrides, "precision.fp8_swiglu=fused"])
    program = build_program(cfg, cfg.model)
    model = program.model_def.bind(program.abstract_params)
    assert model.fp8_config.swiglu == "fused"  # the option reaches the model's FP8 ops
    assert model.activation_names()["group"][-2:] == ("mlp.swiglu_gate", "mlp.swiglu_up")
    tokens = jax.ShapeDtypeStruct((2, cfg.seq_len + 1), jnp.int32)
    count = lambda c: sum(
        r.dtype.itemsize == 1 and r.shape[-1] == c.model.intermediate_size
        for r in residuals(
            lambda p, t: next_token_loss(build_program(c, c.model).model_def, p, t),
            program.abstract_params,
            tokens,
        )
    )
    coat = dataclasses.replace(cfg, fp8_swiglu="coat")
    # One layer: the SiLU output's FP8 copy less (gate, up, down_proj's input and the weight
    # codes of gate_proj and up_proj, whose last axis is the intermediate size too, remain).
    assert count(coat) - count(cfg) == 1 and count(cfg) >= 3
    # The option trains in tests/fp8/test_fp8_rowwise.py::test_trainer_runs_three_steps, whose one
    # run turns on the trainer options that compose.
    for precision in ("bf16", "fp8"):
        with pytest.raises(ValueError, match="precision.fp8_swiglu=fused changes the FP8 SiLU"):
            load_config(
                None,
                [
                    *overrides,
                    f"precision.mode={precision}",
                    "optimizer.name=adamw",
                    "precision.fp8_swiglu=fused",
                ],
            )

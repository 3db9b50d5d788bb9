"""``FP8Config(weight_residual="once")``: every linear weight quantized once per step, before the
decoder layers run (``quantize_weight``, ``FP8Weight``, ``Llama.weight_codes``).

The codes must be the ones ``fp8_linear`` makes of each weight itself (so every result is bit for
bit the other options'), the stacked weights of a scanned model must be quantized outside the
layer loop (that is the point: the scan then slices 1-byte codes instead of copying float32
slices out for the quantizer), and the codes must not be kept twice.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coat_jax import llama
from coat_jax.fp8 import linear as fp8_linear_module
from coat_jax.fp8_ops import FP8Config, FP8Weight, fp8_linear, prequantized, quantize_weight
from coat_jax.memory import residuals
from tests.fp8.test_fp8_ops import _assert_identical as _equal
from tests.model import test_scan_remat

XLA = FP8Config(implementation="xla")
PALLAS = FP8Config(implementation="pallas", interpret=True)
# Three layers, so that one scale per layer of the stacked weights shows.
CFG = dataclasses.replace(test_scan_remat.CFG, num_hidden_layers=3)


@pytest.mark.parametrize("config", [XLA, PALLAS], ids=["xla", "pallas"])
def test_stacked_weights_are_quantized_layer_by_layer(config):
    # One scale per layer, and each layer's codes exactly what the 2-D quantizer makes of it
    # (layers of very different magnitudes, so one shared scale would show).
    w = (
        jax.random.normal(jax.random.key(0), (3, 64, 96))
        * jnp.array([1e-3, 1.0, 40.0])[:, None, None]
    )
    stacked = quantize_weight(w, config)
    assert stacked.codes.shape == w.shape and stacked.codes.dtype == jnp.float8_e4m3fn
    assert stacked.scale.shape == (3,) and stacked.granularity == "tensor"
    for layer in range(3):
        one = quantize_weight(w[layer], config)
        np.testing.assert_array_equal(np.asarray(stacked.scale[layer]), np.asarray(one.scale))
        _equal(stacked.codes[layer], one.codes)
    assert len(set(np.asarray(stacked.scale).tolist())) == 3


def test_quantize_weight_checks_its_input():
    with pytest.raises(ValueError, match=r"\[K, N\] or stacked weights \[L, K, N\]"):
        quantize_weight(jnp.ones((2, 3, 4, 5)))
    with pytest.raises(TypeError, match="float array"):
        quantize_weight(jnp.ones((4, 5), jnp.int32))


@pytest.mark.parametrize("config", [XLA, PALLAS], ids=["xla", "pallas"])
def test_fp8_weight_gives_the_master_modes_results_bit_for_bit(config):
    x = jax.random.normal(jax.random.key(1), (2, 8, 64), jnp.bfloat16)
    ws = (0.05 * jax.random.normal(jax.random.key(2), (64, 32)), jnp.full((64, 16), 0.01))
    c = jax.random.normal(jax.random.key(3), (2, 8, 48))

    def loss(x, ws, pre):
        w = tuple(prequantized(wi, config) for wi in ws) if pre else ws
        y = jnp.concatenate(fp8_linear(x, w, config), axis=-1)
        return jnp.sum(y.astype(jnp.float32) * c)

    grad = jax.jit(jax.value_and_grad(loss, (0, 1)), static_argnums=2)
    (v0, (dx0, dw0)), (v1, (dx1, dw1)) = grad(x, ws, False), grad(x, ws, True)
    _equal((v0, dx0, dw0), (v1, dx1, dw1))
    assert all(d.dtype == jnp.float32 for d in dw1)  # the master weights' dtype
    assert float(jnp.max(jnp.abs(dw1[0]))) > 0


def test_fp8_weight_quantizes_no_weight_inside_the_linear():
    calls = []
    original = fp8_linear_module._per_tensor

    def spy(x, fmt, config, *, weight=False):
        calls.append(weight)
        return original(x, fmt, config, weight=weight)

    x = jnp.ones((4, 64), jnp.bfloat16)
    w = prequantized(0.02 * jnp.ones((64, 32)), XLA)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fp8_linear_module, "_per_tensor", spy)
        jax.make_jaxpr(jax.grad(lambda m: jnp.sum(fp8_linear(x, FP8Weight(m, w.quantized), XLA))))(
            w.master
        )
    assert calls and not any(calls), calls  # activations and gradients only


def test_fp8_weight_must_hold_codes_of_its_weight():
    x = jnp.ones((4, 64), jnp.bfloat16)
    bad = FP8Weight(jnp.ones((64, 32)), quantize_weight(jnp.ones((64, 16))))
    with pytest.raises(ValueError, match="make it with prequantized"):
        fp8_linear(x, bad, XLA)


def _model(option, *, scan, remat="none", precision="coat", cfg=CFG):
    config = FP8Config(implementation="xla", weight_residual=option)
    return llama.Llama(
        cfg,
        precision=precision,
        rngs=nnx.Rngs(0),
        fp8_config=config,
        scan_layers=scan,
        remat=remat,
        dtype=jnp.bfloat16,
    )


def _tokens():
    return jax.random.randint(jax.random.key(5), (2, 17), 0, CFG.vocab_size)


def _loss_and_grads(model):
    graphdef, state = nnx.split(model)
    tokens = _tokens()

    def loss(state):
        logits = nnx.merge(graphdef, state)(tokens[:, :-1])
        return jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

    return jax.jit(jax.value_and_grad(loss))(state)


def _converts_to_e4m3(jaxpr, shapes, *, in_loop=False) -> dict[bool, int]:
    """How many float32 -> E4M3 casts of ``shapes`` the jaxpr holds, inside and outside loops."""
    counts = {True: 0, False: 0}
    for eqn in jaxpr.eqns:
        out = eqn.outvars[0].aval if eqn.outvars else None
        if (
            eqn.primitive.name == "convert_element_type"
            and out.dtype == jnp.float8_e4m3fn
            and tuple(out.shape) in shapes
        ):
            counts[in_loop] += 1
        for v in eqn.params.values():
            sub = getattr(v, "jaxpr", v)
            if hasattr(sub, "eqns"):
                inner = _converts_to_e4m3(
                    sub, shapes, in_loop=in_loop or eqn.primitive.name in ("scan", "while")
                )
                counts[True] += inner[True]
                counts[False] += inner[False]
    return counts


@pytest.mark.parametrize("scan,remat", [(True, "none"), (True, "activations"), (False, "full")])
def test_once_trains_exactly_as_master(scan, remat):
    # Two layers: enough for a wrong layer's scale to change the result.
    cfg = dataclasses.replace(CFG, num_hidden_layers=2)
    (v0, g0) = _loss_and_grads(_model("master", scan=scan, remat=remat, cfg=cfg))
    (v1, g1) = _loss_and_grads(_model("once", scan=scan, remat=remat, cfg=cfg))
    _equal((v0, g0), (v1, g1))


def test_scanned_model_quantizes_its_weights_before_the_loop():
    d, f = CFG.hidden_size, CFG.intermediate_size
    kv = CFG.num_key_value_heads * CFG.head_dim
    layer = {(d, d), (d, kv), (f, d), (d, f)}
    stacked = {(CFG.num_hidden_layers, *s) for s in layer}
    counts = {}
    for option in ("master", "once"):
        graphdef, state = nnx.split(_model(option, scan=True, remat="activations"))
        fn = lambda s, g=graphdef: jnp.sum(nnx.merge(g, s)(_tokens()[:, :-1]))
        jaxpr = jax.make_jaxpr(jax.grad(fn))(state).jaxpr
        counts[option] = (_converts_to_e4m3(jaxpr, layer), _converts_to_e4m3(jaxpr, stacked))
    # "master": each of the 7 projections quantized in the forward loop and again in backward's.
    assert counts["master"] == ({True: 14, False: 0}, {True: 0, False: 0}), counts
    # "once": the 7 stacked weights quantized once, outside any loop; no weight inside one.
    assert counts["once"] == ({True: 0, False: 0}, {True: 0, False: 7}), counts


def test_once_keeps_the_codes_once():
    # Residuals of the scanned model's vjp: "once" keeps its stacked codes (1 byte per weight),
    # exactly what "fp8" keeps of forward's, and no second stacked copy of them.
    def fp8_bytes(option):
        graphdef, state = nnx.split(_model(option, scan=True, remat="activations"))
        res = residuals(lambda s, x: nnx.merge(graphdef, s)(x).sum(), state, _tokens()[:, :-1])
        return sum(r.nbytes for r in res if jnp.dtype(r.dtype) == jnp.float8_e4m3fn)

    d, f = CFG.hidden_size, CFG.intermediate_size
    kv = CFG.num_key_value_heads * CFG.head_dim
    weight_bytes = CFG.num_hidden_layers * (2 * d * d + 2 * d * kv + 3 * d * f)
    assert fp8_bytes("once") == fp8_bytes("fp8") == fp8_bytes("master") + weight_bytes


def test_bf16_model_has_no_weight_codes():
    model = _model("once", scan=True, precision="bf16")
    assert model.weight_codes(nnx.split(model.layers)[1]) is None

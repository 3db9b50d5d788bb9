"""The activation telemetry (docs/telemetry.md, 'Activation scales'): the range of the scales the
FP8 activation ops quantize with, as ``act/`` metrics of the train step.

The scales must be the ones the ops use (the library's quantizers applied to the captured
intermediate tensors give the same), in every layer layout; the step without the telemetry must
be the program it was; with it, training must not change by a bit.
"""

from __future__ import annotations

import collections
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params

from coat_jax import fp8_ops, quant
from coat_jax.llama import Llama
from coat_jax.training import layerwise, load_config
from coat_jax.training import program as program_module
from coat_jax.training.act_telemetry import ActivationTelemetry, activation_telemetry
from coat_jax.training.model import (
    init_params_fn,
    loss_from_hidden,
    model_def_for,
    next_token_loss,
    observed_next_token_loss,
)
from coat_jax.training.optimizers import make_optimizer
from coat_jax.training.program import build_program
from coat_jax.training.sharding import make_mesh, param_shardings
from coat_jax.training.telemetry import ACT_COMPUTED, logged_metrics
from pallas_kernels import fp8_quant
from tests.tiny_runs import tiny_run

DEFAULT = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"
# Smaller than the trainer tests' model: these tests compile one program per layout.
SMALL = [
    *tiny_run(hidden=32, intermediate=64, seq_len=16, batch_size=2),
    "kernels=xla",
    "xla.compilation_cache_dir=null",
]


def config(*extra):
    return load_config(DEFAULT, [*SMALL, *extra])


def model_and_params(*extra):
    """The trainer's model of ``config(*extra)`` and its parameters. The weights are drawn in
    the scanned layout whatever the layout (``init_params_fn``), so every layout of one seed
    holds the same weights."""
    cfg = config(*extra)
    model_def = model_def_for(cfg.model, cfg)
    mesh = make_mesh(1, 1)
    params = init_params_fn(cfg.model, cfg, param_shardings(model_def.abstract_params, mesh))(
        jax.random.key(0)
    )
    return cfg, model_def, params


def tokens(cfg, seed=1):
    shape = (cfg.batch_size, cfg.seq_len + 1)
    return jax.random.randint(jax.random.key(seed), shape, 0, cfg.model.vocab_size, jnp.int32)


# ----------------------------------------------------------------------------- the scales


def captured_scales(model_def, params, tokens_BT1, monkeypatch):
    """The telemetry's scales of an unrolled model without remat, and the tensors its FP8 ops
    quantized, captured in the same program (the observed ops' inputs, in call order)."""
    captured = collections.defaultdict(list)

    def capture(name, op, arg_count):
        def wrapped(*args):
            # The op gets the very tensors captured. Left to itself XLA may fuse a bfloat16
            # producer (the residual add) into the quantizer under excess precision, which
            # then reads the float32 sum before its rounding to bfloat16, while the captured
            # (materialized) tensor is rounded: a scale up to half a bfloat16 step apart, seen
            # on the CPU. The telemetry reports the op's own scales either way.
            inputs = jax.lax.optimization_barrier(args[:arg_count])
            captured[name].append(inputs)
            return op(*inputs, *args[arg_count:])

        monkeypatch.setattr(fp8_ops, name, wrapped)

    capture("observed_linear", fp8_ops.observed_linear, 1)
    capture("observed_rmsnorm", fp8_ops.observed_rmsnorm, 1)
    capture("observed_silu", fp8_ops.observed_silu, 1)
    capture("observed_mul", fp8_ops.observed_mul, 2)
    capture("observed_swiglu", fp8_ops.observed_swiglu, 2)
    capture("observed_attention", fp8_ops.observed_attention, 3)

    real_attention_linear = fp8_ops.observed_attention_linear

    def attention_linear(q, k, v, w, is_causal, config):
        # Attention and the o_proj as one op: q, k and v are captured as attention's, and the
        # attention output (the o_proj's input, made inside the op) as the next linear input.
        inputs = jax.lax.optimization_barrier((q, k, v))
        captured["observed_attention"].append(inputs)
        impl = fp8_ops.attention_implementation(q.dtype, config.attention)
        out = fp8_ops.attention.forward(*inputs, is_causal, impl)[0]
        captured["observed_linear"].append((out.reshape(*out.shape[:2], -1),))
        return real_attention_linear(*inputs, w, is_causal, config)

    monkeypatch.setattr(fp8_ops, "observed_attention_linear", attention_linear)

    @jax.jit
    def run(params):
        captured.clear()
        model = model_def.bind(params)
        hidden, scales = model.observed_hidden_states(tokens_BT1[:, :-1], jnp.asarray(True))
        return hidden, scales, dict(captured)

    return run(params)


# The library's quantizers as the ops run them: jitted. Run op by op, ``(amax + 1e-20) / 448``
# can round differently from XLA's compiled division (a per-tensor scale one bfloat16 step
# apart, seen on the CPU where amax / 448 is itself a bfloat16 value).
@functools.partial(jax.jit, static_argnames="config")
def per_tensor_scale(x, config: fp8_ops.FP8Config):
    x_2d = x.reshape(-1, x.shape[-1])
    kw = dict(fmt=config.act_format, group_size=config.group_size)
    return fp8_quant.quantize_per_tensor_reference(x_2d, **kw).scale


@functools.partial(jax.jit, static_argnames="config")
def group_scales(x, config: fp8_ops.FP8Config):
    kw = dict(group_size=config.group_size, fmt=config.act_format, scale_format=config.group_scale)
    return quant.decode_scale(fp8_quant.quantize_per_group_reference(x, **kw).scale)


def group_summary(x, config: fp8_ops.FP8Config):
    """Largest scale, smallest of a group with a non-zero value, non-finite count: straight
    from the library's 1xG quantizer on ``x``, the groups' non-zero values found in ``x``."""
    s = np.asarray(group_scales(x, config))
    nonzero = np.asarray(jnp.max(jnp.abs(quant.to_groups(x, config.group_size)), axis=-1) > 0)
    return s.max(), s[nonzero].min(), int((~np.isfinite(s)).sum())


# The fused SwiGLU (the MLP's ops) and the E8M0 group scales share a configuration with FP8
# attention (the attention's ops): independent paths, one program.
@pytest.mark.parametrize(
    "extra",
    [
        ["precision.mode=coat"],
        [
            "precision.mode=coat",
            "precision.fp8_attention=true",
            "precision.fp8_group_scale=e8m0",
            "precision.fp8_swiglu=fused",
        ],
        [
            "precision.mode=coat",
            "precision.fp8_attention=true",
            "precision.fp8_attention_backward=saved_output",
        ],
        ["precision.mode=fp8"],
    ],
    ids=["coat", "coat-fp8attn-e8m0-fused-swiglu", "coat-fp8attn-saved", "fp8"],
)
def test_the_scales_are_the_quantizers_scales_of_the_captured_activations(extra, monkeypatch):
    cfg, model_def, params = model_and_params(*extra)
    t = tokens(cfg)
    hidden, scales, captured = captured_scales(model_def, params, t, monkeypatch)
    model = model_def.bind(params)
    config = model.fp8_config
    names = model.activation_names()
    num_layers = cfg.model.num_hidden_layers
    assert hidden.shape == (*t[:, :-1].shape, cfg.model.hidden_size)
    # Per-tensor scales of the linears' inputs, as fp8_linear quantizes them (its 2-D view).
    linear_inputs = [x for (x,) in captured["observed_linear"]]
    assert len(linear_inputs) == num_layers * len(names["linear"])
    want = [per_tensor_scale(x, config) for x in linear_inputs]
    got = scales["layers"]["linear"]
    assert got.shape == (num_layers, len(names["linear"]))
    np.testing.assert_array_equal(np.asarray(got).reshape(-1), np.asarray(want))

    # 1xG scales of what the non-linear ops keep, in call order: each layer's, then the norm's.
    group_names = names["group"]
    if not group_names:
        assert "group" not in scales["layers"] and scales["norm"] == {}
        return
    order = _call_order(captured, group_names, num_layers, has_norm=bool(names["norm"]))
    want = np.array([group_summary(x, config) for x in order], dtype=np.float64)
    group = scales["layers"]["group"]
    per_layer = len(group_names)
    for k, field in enumerate(("max", "min", "nonfinite")):
        got = np.asarray(group[field], np.float64).reshape(-1)
        np.testing.assert_array_equal(got, want[: num_layers * per_layer, k], err_msg=field)
        if names["norm"]:
            assert float(scales["norm"]["group"][field][0]) == want[-1, k], field
    assert np.all(want[:, 2] == 0) and np.all(want[:, 1] > 0)


def _call_order(captured, group_names, num_layers, *, has_norm):
    """The 1xG-scaled tensors in the order a layer's ops keep them (``group_names``), layer by
    layer, then the final norm's input."""
    norms = [x for (x,) in captured.get("observed_rmsnorm", [])]
    silu = [x for (x,) in captured.get("observed_silu", [])]
    mul = captured.get("observed_mul", [])
    swiglu = captured.get("observed_swiglu", [])
    attention = captured.get("observed_attention", [])
    by_name = {
        "input_layernorm": lambda layer: norms[2 * layer],
        "post_attention_layernorm": lambda layer: norms[2 * layer + 1],
        "mlp.silu": lambda layer: silu[layer],
        "mlp.mul_silu": lambda layer: mul[layer][0],
        "mlp.mul_up": lambda layer: mul[layer][1],
        "mlp.swiglu_gate": lambda layer: swiglu[layer][0],
        "mlp.swiglu_up": lambda layer: swiglu[layer][1],
        "self_attn.q": lambda layer: attention[layer][0],
        "self_attn.k": lambda layer: attention[layer][1],
        "self_attn.v": lambda layer: attention[layer][2],
    }
    order = [by_name[name](layer) for layer in range(num_layers) for name in group_names]
    if has_norm:
        assert len(norms) == 2 * num_layers + 1
        order.append(norms[-1])
    return order


# Without XLA's excess precision the layouts compute the same activations bit for bit (with it,
# the programs keep different bfloat16 intermediates in float32, and layer 1's scales of the
# scanned and the unrolled model differed by up to 3% here), so their scales must be equal.
NO_EXCESS = {"xla_allow_excess_precision": False}


@functools.cache
def reference_scales():
    """The scales of the unrolled model without remat (the layout the capture test checks)."""
    cfg, model_def, params = model_and_params()
    t = tokens(cfg)
    observe = jnp.asarray(True)
    return jax.jit(
        lambda p: model_def.bind(p).observed_hidden_states(t[:, :-1], observe)[1],
        compiler_options=NO_EXCESS,
    )(params)


# With the capture test's unrolled layers without remat, every layer layout and remat policy
# (the layerwise test adds the scan under "activations"), and both fp8_weight_residual modes.
LAYOUTS = {
    "unrolled-activations": ["memory.remat=activations"],
    "scan": ["memory.scan_layers=true"],
    "scan-full-master": [
        "memory.scan_layers=true",
        "memory.remat=full",
        "precision.fp8_weight_residual=master",
    ],
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_every_layout_reports_the_same_scales_and_the_same_gradients(layout):
    cfg, model_def, params = model_and_params(*layout)
    t = tokens(cfg)

    @functools.partial(jax.jit, compiler_options=NO_EXCESS)
    def both(params, observe):
        off = jax.value_and_grad(functools.partial(next_token_loss, model_def))(params, t)
        on = jax.value_and_grad(
            lambda p: observed_next_token_loss(model_def, p, t, observe), has_aux=True
        )(params)
        return off, on

    (loss, grads), ((loss_on, scales), grads_on) = both(params, jnp.asarray(True))
    # Observing changes nothing: the loss and every gradient, bit for bit.
    assert np.asarray(loss_on).tobytes() == np.asarray(loss).tobytes()
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_on), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Per layer (stacked by the scan or by the loop), the scales of the unrolled layers.
    want = reference_scales()
    for path, got in jax.tree_util.tree_flatten_with_path(scales)[0]:
        ref = functools.reduce(lambda tree, k: tree[k.key], path, want)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref), err_msg=str(path))
    assert jax.tree.structure(scales) == jax.tree.structure(want)


# ----------------------------------------------------------------------------- the steps


def step_jaxpr(prog):
    # The jitted step's own jaxpr. Not jax.make_jaxpr(step_fn): on a GPU the step is a jit with
    # compiler options (the FP8 GEMMs'), which JAX refuses to nest inside another trace.
    return prog.step_fn.trace(
        prog.abstract_params, prog.abstract_opt_state, prog.abstract_batch()
    ).jaxpr


@pytest.mark.parametrize("layout", [[], ["memory.scan_layers=true", "memory.remat=activations"]])
def test_without_the_telemetry_the_step_is_the_program_it_was(layout, monkeypatch):
    cfg = config(*layout, "logging.telemetry=false")
    before = str(step_jaxpr(build_program(cfg, cfg.model)))

    # The same program when nothing the activation telemetry added can run: the step without
    # it never reaches the observed ops, the recorder or the observed model methods.
    def unreachable(*args, **kwargs):
        raise AssertionError("the step without telemetry reached the activation telemetry")

    for name in ("observed_linear", "observed_rmsnorm", "observed_silu", "observed_mul"):
        monkeypatch.setattr(fp8_ops, name, unreachable)
    monkeypatch.setattr(fp8_ops.ScaleRecorder, "__init__", unreachable)
    for name in ("observed_hidden_states", "observed_decoder", "observed_norm"):
        monkeypatch.setattr(Llama, name, unreachable)
    assert str(step_jaxpr(build_program(cfg, cfg.model))) == before


def sizes_outside_conds(jaxpr) -> collections.Counter:
    """(primitive, largest input size) of every equation outside conds, sub-jaxprs included."""
    out = collections.Counter()
    for e in jaxpr.eqns:
        sizes = [int(np.prod(v.aval.shape)) for v in e.invars if hasattr(v.aval, "shape")]
        out[e.primitive.name, max(sizes, default=0)] += 1
        if e.primitive.name != "cond":
            for sub in jaxprs_in_params(e.params):
                out += sizes_outside_conds(sub)
    return out


@pytest.mark.parametrize("layout", [[], ["memory.scan_layers=true", "memory.remat=activations"]])
def test_outside_its_conds_it_reads_no_activation(layout, monkeypatch):
    """Where the step does not compute it, the telemetry costs the conds on a flag and scalar
    work on the per-tensor scales and the conds' outputs: every equation it adds outside its
    conds reads at most a layer summary; the scales themselves only go into the conds (and
    through ``stop_gradient`` and, under a scanned remat, float32-to-float32
    ``reduce_precision``: identities, which compute nothing)."""
    cfg = config(*layout, "logging.telemetry=true")
    step = step_jaxpr(build_program(cfg, cfg.model)).jaxpr
    on = sizes_outside_conds(step)
    # The same step with the optimizer state's telemetry alone.
    with monkeypatch.context() as patch:
        patch.setattr(program_module, "activation_telemetry", lambda cfg: None)
        state_only = build_program(cfg, cfg.model)
    added = on - sizes_outside_conds(step_jaxpr(state_only).jaxpr)
    # 4 linear inputs and 5 1xG tensors a layer, 2 layers, the final norm: 11 values at most.
    passed = ("cond", "stop_gradient", "reduce_precision")
    large = {k: n for k, n in added.items() if k[1] > 11 and k[0] not in passed}
    assert not large, large
    # A cond per layer (scanned: the body's, and the part of it that depends on the flag
    # alone, which JAX hoists out of the differentiated scan) and the final norm's; none makes
    # anything larger than a layer's summary (a constant the size of the scales would be made
    # on every step, computed or not).
    conds = conds_outputs(step)
    assert len(conds) == 3 and max(max(sizes) for sizes in conds) <= 11, conds


def conds_outputs(jaxpr) -> list[list[int]]:
    """The output sizes of every cond, in sub-jaxprs too."""
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name == "cond":
            out.append([int(np.prod(v.aval.shape)) for v in e.outvars])
        for sub in jaxprs_in_params(e.params):
            out += conds_outputs(sub)
    return out


def layerwise_step(prog, activations):
    """The step of the trainer's optimizer_in_backward program ``prog`` built with
    ``activations`` (the trainer refuses telemetry there: the optimizer state's needs the whole
    gradient)."""
    return layerwise.make_train_step(
        prog.model_def,
        make_optimizer(prog.cfg, prog.schedule),
        functools.partial(loss_from_hidden, prog.model_def),
        fused_apply=prog.cfg.fused_apply,
        activations=activations,
    )


def test_optimizer_in_backward_reports_the_scales_and_trains_as_without():
    """The layerwise step's own forward scan (under remat "activations") gives the scales of
    the unrolled model, on the steps the telemetry computes, and the same training."""
    cfg = config(
        "memory.scan_layers=true",
        "memory.remat=activations",
        "optimizer.grad_clip=null",
        "optimizer.in_backward=true",
    )
    telemetry = ActivationTelemetry(every=3)
    prog = build_program(cfg, cfg.model)
    with_it, without = layerwise_step(prog, telemetry), layerwise_step(prog, None)

    @functools.partial(jax.jit, compiler_options=NO_EXCESS)
    def both(params, state, tokens_ABT1):
        return with_it(params, state, tokens_ABT1), without(params, state, tokens_ABT1)

    params = prog.init_params(jax.random.key(0))
    state = prog.init_opt_state(params)
    t = tokens(cfg)[None]
    for step in (1, 2):
        (params, state, metrics), (params_off, state_off, metrics_off) = both(params, state, t)
        trained = zip(
            jax.tree.leaves((params, state)), jax.tree.leaves((params_off, state_off)), strict=True
        )
        for a, b in trained:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        for key in ("loss", "grad_norm"):
            assert np.asarray(metrics[key]).tobytes() == np.asarray(metrics_off[key]).tobytes()
        logged = logged_metrics(jax.device_get(metrics))
        if step == 1:
            # Computed (the first step): the unrolled model's scales' metrics, at step 1's
            # parameters (the same draw in both layouts).
            want = telemetry.metrics(reference_scales(), True)
            assert bool(metrics[ACT_COMPUTED])
            for key, value in want.items():
                if key != ACT_COMPUTED:
                    assert np.asarray(logged[key]).tobytes() == np.asarray(value).tobytes(), key
        else:
            # Step 2 is not logged with every=3: placeholders, which the record drops.
            assert not bool(metrics[ACT_COMPUTED])
            assert np.isnan(metrics["act/group_scale_max"])
            assert not any(k.startswith("act/") for k in logged)


# ----------------------------------------------------------------------------- the metrics


def test_the_metrics_reduce_layers_microbatches_and_the_final_norm():
    """By hand: 2 microbatches, 3 layers of 2 linear inputs and 2 1xG tensors, a final norm."""
    linear = np.full((2, 3, 2), 1e-3, np.float32)
    linear[1, 2, 0] = 5e-3  # the largest: microbatch 1, layer 2, input 0
    linear[0, 0, 1] = 1e-5
    group = {
        "max": np.full((2, 3, 2), 2e-3, np.float32),
        "min": np.full((2, 3, 2), 1e-4, np.float32),
        "nonfinite": np.zeros((2, 3, 2), np.int32),
    }
    group["min"][0, 1, 1] = 1e-6
    group["nonfinite"][1, 0, 0] = 2
    norm = {
        "max": np.array([[3e-3], [4e-3]], np.float32),  # the final norm holds the largest
        "min": np.array([[2e-4], [np.inf]], np.float32),  # inf: all groups zero
        "nonfinite": np.zeros((2, 1), np.int32),
    }
    scales = {"layers": {"linear": linear, "group": group}, "norm": {"group": norm}}
    got = jax.device_get(ActivationTelemetry().metrics(scales, True))
    assert got == {
        ACT_COMPUTED: True,
        "act/linear_scale_min": np.float32(1e-5),
        "act/linear_scale_max": np.float32(5e-3),
        "act/linear_worst_layer": 2,
        "act/linear_worst_input": 0,
        "act/group_scale_min": np.float32(1e-6),
        "act/group_scale_max": np.float32(4e-3),
        "act/group_worst_layer": 3,  # the layer count: the final norm
        "act/group_worst_tensor": 2,  # after a layer's 2 tensors: "norm"
        "act/nonfinite": 2,
    }
    # A NaN scale is counted and makes its layer the worst.
    linear[0, 1, 1] = np.nan
    got = jax.device_get(ActivationTelemetry().metrics(scales, True))
    assert got["act/nonfinite"] == 3
    assert (got["act/linear_worst_layer"], got["act/linear_worst_input"]) == (1, 1)
    # Linear scales only (precision "fp8"): no act/group_ keys.
    fp8 = ActivationTelemetry().metrics({"layers": {"linear": linear[0]}, "norm": {}}, True)
    assert sorted(fp8) == [
        ACT_COMPUTED,
        "act/linear_scale_max",
        "act/linear_scale_min",
        "act/linear_worst_input",
        "act/linear_worst_layer",
        "act/nonfinite",
    ]


def test_the_trainer_observes_fp8_activations_only():
    assert activation_telemetry(config("logging.telemetry=false")) is None
    assert activation_telemetry(config("logging.telemetry=true", "precision.mode=bf16")) is None
    telemetry = activation_telemetry(
        config("logging.telemetry=true", "logging.every=5", "steps=12")
    )
    assert telemetry == ActivationTelemetry(every=5, last_step=12, max_skipped=0)
    assert [s for s in range(1, 13) if telemetry.computes(s)] == [1, 5, 10, 12]
    with pytest.raises(ValueError, match="every must be a positive int, got 0"):
        ActivationTelemetry(every=0)
    # optimizer_in_backward still refuses telemetry (the optimizer state's needs the gradient).
    with pytest.raises(ValueError, match="logging.telemetry=false"):
        config(
            "memory.scan_layers=true",
            "optimizer.grad_clip=null",
            "optimizer.in_backward=true",
            "logging.telemetry=true",
        )

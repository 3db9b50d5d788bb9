"""The training loop: model and optimizer set-up, the jitted step, evaluation and bookkeeping.

``train(cfg)`` runs a whole job from a :class:`~coat_jax.training.config.TrainConfig`. The step
is a pure function ``(params, opt_state, tokens) -> (params, opt_state, metrics)`` compiled once
with parameters and optimizer state donated, so XLA updates them in place instead of holding two
copies (docs/design.md, 'One training step'). Gradient accumulation is an explicit ``lax.scan``
over microbatches inside that one step (not ``optax.MultiSteps``): the optimizer sees one averaged
gradient per step, its state holds no accumulator, and the step counter counts optimizer steps.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from flax import nnx

from coat_jax.checkpoint_io import from_pretrained
from coat_jax.fp8_ops import fp8_compiler_options, is_gpu_backend
from coat_jax.generate import sample_text
from coat_jax.llama import Llama, LlamaConfig, relayout
from coat_jax.losses import cross_entropy_from_hidden
from coat_jax.master import apply_updates_stochastic, float32_optimizer
from coat_jax.optim import apply_gradients
from coat_jax.runs import resolve_init_from
from coat_jax.training import distributed, layerwise, sharding
from coat_jax.training.checkpoint import Checkpointer, CheckpointError, CheckpointSaveError
from coat_jax.training.config import TrainConfig, parse_op_kernels, to_dict
from coat_jax.training.data import (
    PackedWindows,
    TrainOrder,
    make_tokenizer,
    tokenize_to_cache,
    validation_batches,
)
from coat_jax.training.errors import DivergedError, error_line, exit_code
from coat_jax.training.metrics import (
    MetricsLog,
    device_peak_bytes,
    host_peak_rss_bytes,
    plot_loss_curve,
)
from coat_jax.training.optimizers import (  # noqa: F401 - weight_decay_mask: public here too
    kernel_options,
    make_optimizer,
    optimizer_fingerprint,
    weight_decay_mask,
)
from coat_jax.training.rundir import RunDirectory
from coat_jax.training.telemetry import (
    ActivationTelemetry,
    StateTelemetry,
    activation_telemetry,
    logged_metrics,
    state_telemetry,
)
from pallas_kernels.sharding import KernelMesh

COMPUTE_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """The static half of an NNX Llama; ``apply`` runs it on a pure-dict parameter tree."""

    config: LlamaConfig
    graphdef: Any
    abstract_state: Any
    loss_chunk_size: int | None = None

    def bind(self, params) -> Llama:
        state = jax.tree.map(lambda x: x, self.abstract_state)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)

    def apply(self, params, tokens_BT):
        return self.bind(params)(tokens_BT)

    @property
    def abstract_params(self):
        return nnx.to_pure_dict(self.abstract_state)


def _split_params(model) -> tuple[Any, Any]:
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise ValueError(
            "the model holds state other than parameters "
            f"({list(nnx.to_flat_state(rest))[:3]}...); the trainer would not checkpoint it"
        )
    return graphdef, params


def model_def_for(llama_cfg: LlamaConfig, cfg: TrainConfig, mesh=None) -> ModelDef:
    """The model ``cfg`` trains (precision, dtype, layer layout, remat), built abstractly.

    ``cfg.fp8_kernels`` (unset with ``kernels: auto``: by the model's width and the tokens per
    device, ``optimizers.fp8_ops_auto``; else as ``cfg.kernels``) picks where the FP8 ops run;
    with ``mesh`` (a program on several devices) their Pallas kernels, where chosen, run on
    each shard (``FP8Config(mesh=KernelMesh(mesh))``): activations split over the batch axes,
    weights as the trainer's FSDP rule places them.
    """
    abstract = nnx.eval_shape(lambda: new_model(llama_cfg, cfg, jax.random.key(0)))
    placement = {}
    if mesh is not None:
        placement["mesh"] = KernelMesh(mesh, batch_axes=sharding.BATCH_AXES, param_axis="fsdp")
    # Static FP8 settings from the trainer config (they live in the graphdef). XLA's
    # deterministic ops take XLA's attention (see TrainConfig's ``deterministic``).
    abstract.fp8_config = dataclasses.replace(
        abstract.fp8_config,
        weight_residual=cfg.fp8_weight_residual,
        group_scale=cfg.fp8_group_scale,
        swiglu=cfg.fp8_swiglu,
        attention_backward=cfg.fp8_attention_backward,
        gemm_output=cfg.fp8_gemm_output,
        attention="xla" if cfg.deterministic else "auto",
        codes_barrier=codes_barrier(cfg),
        op_implementations=parse_op_kernels(cfg.fp8_op_kernels),
        **kernel_options(
            cfg,
            fp8_ops=True,
            devices=1 if mesh is None else mesh.devices.size,
            hidden_size=llama_cfg.hidden_size,
        ),
        **placement,
    )
    graphdef, state = _split_params(abstract)
    return ModelDef(llama_cfg, graphdef, state, cfg.loss_chunk_size)


MASTER_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def new_model(llama_cfg: LlamaConfig, cfg: TrainConfig, key) -> Llama:
    return Llama(
        llama_cfg,
        precision=cfg.precision,
        dtype=COMPUTE_DTYPES[cfg.compute_dtype],
        param_dtype=MASTER_DTYPES[cfg.master_dtype],
        rngs=nnx.Rngs(params=key),
        scan_layers=cfg.scan_layers,
        remat=cfg.remat,
        fp8_attention=cfg.fp8_attention,
    )


def init_params_fn(llama_cfg: LlamaConfig, cfg: TrainConfig, param_shardings):
    """``key -> params``, drawing each shard of the weights on its device.

    The key is an argument: a jitted function of no arguments would make it a constant, and
    XLA then constant-folds the random weights at compile time (for Llama-2-7B: still
    compiling after 290 s on the H200). The weights are always drawn in the scanned layout, one
    vmapped layer init (Llama-2-7B: 5.9 s with its compile, H200). An unrolled run then takes
    each layer out with one jitted slice: drawing 32 layers in one unrolled program took 83 s,
    and slicing the stacked draw inside that program compiled for over 145 s (H200, JAX 0.11.2).
    """
    stacked_cfg = dataclasses.replace(cfg, scan_layers=True)

    def init_stacked(key):
        return nnx.to_pure_dict(_split_params(new_model(llama_cfg, stacked_cfg, key))[1])

    if cfg.scan_layers:
        return jax.jit(init_stacked, out_shardings=param_shardings)
    mesh = jax.tree.leaves(param_shardings)[0].mesh
    stacked_sh = sharding.param_shardings(jax.eval_shape(init_stacked, jax.random.key(0)), mesh)
    draw = jax.jit(init_stacked, out_shardings=stacked_sh)
    take = jax.jit(
        lambda layers, i: jax.tree.map(lambda a: a[i], layers),
        out_shardings=param_shardings["layers"][0],
    )

    def init(key):
        params = draw(key)
        layers = params.pop("layers")
        params["layers"] = {i: take(layers, i) for i in range(llama_cfg.num_hidden_layers)}
        del layers
        return jax.device_put(params, param_shardings)

    return init


def llama_config_dict(llama_cfg: LlamaConfig) -> dict:
    """A JSON-clean dict of the architecture (the form stored in checkpoint metadata)."""
    return json.loads(json.dumps(dataclasses.asdict(llama_cfg)))


def llama_config_from_dict(d: dict) -> LlamaConfig:
    return LlamaConfig(**d)


def make_schedule(cfg: TrainConfig):
    """Linear warmup to ``learning_rate`` over ``warmup_steps``, then cosine to the floor.

    Step ``c`` (0-based) of warmup uses ``lr * (c + 1) / warmup_steps``, so no step is spent
    at learning rate 0.
    """
    peak, floor = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    warmup, total = cfg.warmup_steps, cfg.steps

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        warm = peak * (count + 1) / max(warmup, 1)
        progress = jnp.clip((count - warmup) / max(total - warmup, 1), 0.0, 1.0)
        cosine = floor + (peak - floor) * 0.5 * (1 + jnp.cos(jnp.pi * progress))
        return jnp.where(count < warmup, warm, cosine)

    return schedule


def next_token_loss(model_def: ModelDef, params, tokens_BT1) -> jax.Array:
    """Mean cross-entropy (nats) of predicting ``tokens[:, 1:]`` from ``tokens[:, :-1]``.

    With ``loss_chunk_size`` set the logits are never materialised whole
    (:func:`coat_jax.losses.cross_entropy_from_hidden`); otherwise the plain optax loss.
    """
    inputs_BT, labels_BT = tokens_BT1[:, :-1], tokens_BT1[:, 1:]
    model = model_def.bind(params)
    return loss_from_hidden(model_def, model, model.hidden_states(inputs_BT), labels_BT)


def observed_next_token_loss(model_def: ModelDef, params, tokens_BT1, observe) -> tuple:
    """``(next_token_loss, scales)``: the same loss, bit for bit, and the scales the FP8 ops
    quantized activations with (``Llama.observed_hidden_states``; ``observe`` says whether
    their per-group reductions are computed)."""
    inputs_BT, labels_BT = tokens_BT1[:, :-1], tokens_BT1[:, 1:]
    model = model_def.bind(params)
    hidden_BTD, scales = model.observed_hidden_states(inputs_BT, observe)
    return loss_from_hidden(model_def, model, hidden_BTD, labels_BT), scales


def loss_from_hidden(model_def: ModelDef, model: Llama, hidden_BTD, labels_BT) -> jax.Array:
    """Mean cross-entropy of the final hidden states against ``labels`` (the model's head)."""
    if model_def.loss_chunk_size is None:
        logits_BTV = model.logits(hidden_BTD)
        return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, labels_BT).mean()
    return cross_entropy_from_hidden(
        hidden_BTD, model.output_weight(cast=False), labels_BT, chunk_size=model_def.loss_chunk_size
    )


class StochasticRoundingState(NamedTuple):
    """The optimizer state of a run with bfloat16 masters: the inner state and a step count.

    The count seeds each step's stochastic rounding (``fold_in(key(seed), count)``), so a resumed
    run draws the same bits as an uninterrupted one.
    """

    inner: Any
    count: jax.Array


def with_rounding_count(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` in float32 (``coat_jax.master.float32_optimizer``) plus a rounding-step count."""
    inner = float32_optimizer(tx)

    def init(params):
        return StochasticRoundingState(inner.init(params), jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        updates, inner_state = inner.update(updates, state.inner, params)
        return updates, StochasticRoundingState(inner_state, state.count + 1)

    return optax.GradientTransformation(init, update)


def make_train_step(
    model_def: ModelDef,
    tx: optax.GradientTransformation,
    *,
    seed: int = 0,
    telemetry: StateTelemetry | None = None,
    activations: ActivationTelemetry | None = None,
    fused_apply: bool = True,
):
    """The pure train step over ``tokens_ABT1``: A microbatches of B windows of T + 1 tokens.

    With bfloat16 parameters (``master_dtype: bfloat16``) ``tx`` must come from
    :func:`with_rounding_count`: gradients are accumulated and clipped in float32 and each
    update is applied with stochastic rounding. With ``telemetry`` the metrics also hold the
    optimizer state's quantization telemetry, with ``activations`` the range of the scales the
    FP8 activation ops used (:mod:`coat_jax.training.telemetry`); without it the step is the
    program it was before the activation telemetry existed. With
    ``fused_apply`` a ``tx`` that can apply itself (``coat_adamw``: its kernel writes the new
    parameter) does so through ``coat_jax.optim.apply_gradients``, with the telemetry too
    (``StateTelemetry.apply``); bfloat16 parameters take ``tx.update`` and apply the updates
    apart.
    """
    grad_fn = jax.value_and_grad(lambda p, t: next_token_loss(model_def, p, t))
    low_precision = any(
        jnp.dtype(x.dtype) == jnp.bfloat16 for x in jax.tree.leaves(model_def.abstract_params)
    )
    as_f32 = lambda tree: jax.tree.map(lambda g: g.astype(jnp.float32), tree)
    observed_grad_fn = jax.value_and_grad(
        lambda p, t, observe: observed_next_token_loss(model_def, p, t, observe), has_aux=True
    )

    def loss_and_grads(params, tokens_BT1, observe):
        """``(loss, grads, scales)``: ``scales`` the activation scales, ``None`` without the
        activation telemetry (``observe`` None)."""
        if observe is None:
            return (*grad_fn(params, tokens_BT1), None)
        (loss, scales), grads = observed_grad_fn(params, tokens_BT1, observe)
        return loss, grads, scales

    def update(grads, opt_state, params):
        if telemetry is None:
            return (*tx.update(grads, opt_state, params), {})
        return telemetry.update(tx, grads, opt_state, params)

    def train_step(params, opt_state, tokens_ABT1):
        num_micro = tokens_ABT1.shape[0]
        # Known before the forward pass: the layers reduce their scales only where it is true.
        observe = None if activations is None else activations.observe(opt_state)
        if num_micro == 1:
            loss, grads, scales = loss_and_grads(params, tokens_ABT1[0], observe)
        else:

            def accumulate(grad_sum, tokens_BT1):
                loss, grads, scales = loss_and_grads(params, tokens_BT1, observe)
                grads = as_f32(grads) if low_precision else grads
                return jax.tree.map(jnp.add, grad_sum, grads), (loss, scales)

            zeros = jax.tree.map(
                lambda p: jnp.zeros(p.shape, jnp.float32 if low_precision else p.dtype), params
            )
            grad_sum, (losses, scales) = jax.lax.scan(accumulate, zeros, tokens_ABT1)
            grads = jax.tree.map(lambda g: g / num_micro, grad_sum)
            loss = losses.mean()
        if low_precision:
            key = jax.random.fold_in(jax.random.key(seed), opt_state.count)
            updates, opt_state, observed = update(grads, opt_state, params)
            params = apply_updates_stochastic(params, updates, key)
        elif fused_apply and telemetry is None:
            params, opt_state = apply_gradients(tx, grads, opt_state, params)
            observed = {}
        elif fused_apply:
            # The telemetry samples the old state first, then lets the kernel apply in place.
            params, opt_state, observed = telemetry.apply(tx, grads, opt_state, params)
        else:
            updates, opt_state, observed = update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        grad_norm = optax.tree.norm(as_f32(grads) if low_precision else grads)
        if activations is not None:
            observed = {**observed, **activations.metrics(scales, observe)}
        return params, opt_state, {"loss": loss, "grad_norm": grad_norm, **observed}

    return train_step


def evaluate(eval_fn, params, windows: PackedWindows, cfg: TrainConfig, batch_sharding) -> float:
    losses = [
        eval_fn(params, sharding.put_batch(batch, batch_sharding))
        for batch in validation_batches(windows, cfg.batch_size, cfg.eval_batches)
    ]
    return float(np.mean(jax.device_get(losses)))


class GracefulStop:
    """Turns the first SIGINT/SIGTERM into a request to checkpoint and stop after this step.

    A second signal raises KeyboardInterrupt at once (the half-written checkpoint, if any, stays
    in Orbax's temporary directory and is never taken for a complete one). While ``compiling``
    is set (the first step's compilation, which cannot be interrupted) the request is to stop
    without a checkpoint: no step has changed the state yet. ``finished()`` gives the number
    of finished steps for the message. Handlers can only be installed from the main thread;
    elsewhere the default behaviour is kept.
    """

    def __init__(self, say, finished=lambda: "?"):
        self.signum: int | None = None
        self.compiling = False
        self._say = say
        self._finished = finished
        self._previous: dict[int, Any] = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        name = signal.Signals(signum).name
        if self.compiling:
            self._say(f"received {name} while compiling the train step: stopping (no step has run)")
        else:
            when = (
                "every process has agreed to stop (at a step boundary, one step later than alone)"
                if jax.process_count() > 1
                else "the step in flight finishes"
            )
            self._say(
                f"received {name} after step {self._finished()}: saving a checkpoint once "
                f"{when}, then stopping (send it again to abort without saving)"
            )

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` ends with; ``params`` and ``opt_state`` are None when a signal stopped
    it during the first step's compilation (the state was already given to that step)."""

    step: int
    params: Any
    opt_state: Any
    val_loss: float | None
    val_perplexity: float | None
    stopped_by: str | None
    output_dir: Path


def _with_shardings(abstract, shardings):
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**30:.2f}GiB" if n >= 2**30 else f"{n / 2**20:.0f}MiB"


# ----------------------------------------------------------------------------- the program


@dataclasses.dataclass(frozen=True)
class TrainProgram:
    """Everything the step needs that does not depend on data: what ``train`` compiles.

    Benchmarks build this with :func:`build_program` too, so what they time is what
    ``train.py`` runs.
    """

    cfg: TrainConfig
    mesh: Any
    model_def: ModelDef
    schedule: Any
    tx: optax.GradientTransformation
    param_shardings: Any
    opt_shardings: Any
    batch_sharding: Any
    eval_batch_sharding: Any
    step_fn: Any
    eval_fn: Any

    @property
    def abstract_params(self):
        return _with_shardings(self.model_def.abstract_params, self.param_shardings)

    @property
    def abstract_opt_state(self):
        return _with_shardings(
            jax.eval_shape(self.tx.init, self.model_def.abstract_params), self.opt_shardings
        )

    def abstract_batch(self, batch_size: int | None = None):
        """The step's token batch ``[grad_accum, batch, seq_len + 1]`` as a ShapeDtypeStruct."""
        b = self.cfg.batch_size if batch_size is None else batch_size
        shape = (self.cfg.grad_accum, b, self.cfg.seq_len + 1)
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sharding)

    def init_params(self, key):
        """Random parameters (jitted, the key an argument, each shard made on its device)."""
        return init_params_fn(self.model_def.config, self.cfg, self.param_shardings)(key)

    def init_opt_state(self, params):
        """The optimizer state of ``params``, jitted, each leaf placed like its parameter."""
        return jax.jit(self.tx.init, out_shardings=self.opt_shardings)(params)


def excess_precision(cfg: TrainConfig, backend: str | None = None) -> bool | None:
    """XLA's ``xla_allow_excess_precision`` for ``cfg``'s programs; ``None``: XLA's default.

    ``cfg.xla_excess_precision`` where set. Unset: ``False`` for precision ``coat`` on a GPU
    backend, where rounding every bfloat16 intermediate was measured faster on the H200
    (Llama-2-7B batch 1 2.1% faster, step times apart; BF16's step was not faster, so it keeps
    XLA's default, and ``fp8`` was not measured: docs/bench_excess_precision.md). Elsewhere
    XLA's default: nothing was measured there, and a jit without compiler options can still be
    traced inside another (``jax.make_jaxpr(program.step_fn)``), which JAX refuses for one with
    options.
    """
    if cfg.xla_excess_precision is not None:
        return bool(cfg.xla_excess_precision)
    if cfg.precision == "coat" and is_gpu_backend(backend):
        return False
    return None


def codes_barrier(cfg: TrainConfig, backend: str | None = None) -> bool:
    """``FP8Config.codes_barrier`` for ``cfg``'s model: ``cfg.fp8_codes_barrier``, checked.

    ``False`` (no optimization barrier on the FP8 codes XLA's quantizers make for backward) is
    refused unless :func:`excess_precision` is ``False`` on ``backend``: under XLA's excess
    precision the kept "FP8" activations could silently be the unquantized values.
    """
    if not cfg.fp8_codes_barrier and excess_precision(cfg, backend) is not False:
        raise ValueError(
            "fp8_codes_barrier=false needs the step compiled without excess precision, and "
            "xla_excess_precision resolves to XLA's default on this backend: set "
            "xla_excess_precision=false, or fp8_codes_barrier=true"
        )
    return bool(cfg.fp8_codes_barrier)


def compiler_options(cfg: TrainConfig) -> dict | None:
    """``jax.jit``'s ``compiler_options`` for the run's training step and evaluation.

    On a GPU: no Triton GEMM fusion, so that the FP8 linears compile to cuBLASLt FP8 GEMMs
    (:func:`coat_jax.fp8_ops.fp8_compiler_options`). With ``cfg.deterministic`` also XLA's
    ``xla_gpu_deterministic_ops`` (on every backend: the CPU's compiler takes the option and
    ignores it, so a misspelt option fails the CPU tests too). XLA's
    ``xla_allow_excess_precision``, on every backend: ``cfg.xla_excess_precision`` where set;
    unset, off for precision ``coat`` on a GPU (:func:`excess_precision`).
    """
    options = dict(fp8_compiler_options() or {})
    if cfg.deterministic:
        options["xla_gpu_deterministic_ops"] = True
    excess = excess_precision(cfg)
    if excess is not None:
        options["xla_allow_excess_precision"] = excess
    return options or None


def build_program(
    cfg: TrainConfig, llama_cfg: LlamaConfig, mesh=None, *, observe_activations: bool = True
) -> TrainProgram:
    """The model, optimizer, shardings and the jitted train and evaluation steps of ``cfg``.

    ``observe_activations=False`` leaves the activation telemetry out of a ``telemetry: true``
    step (the telemetry benchmark's program with the optimizer state's telemetry alone).
    """
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp) if mesh is None else mesh
    sharding.check_batch_divisible(cfg.batch_size, mesh)
    # Several devices: the kernels run per shard on the mesh (even a mesh of one device, which
    # places the program on one of several); one device in the process: no mesh, as ever.
    kernel_mesh = mesh if jax.device_count() > 1 else None
    model_def = model_def_for(llama_cfg, cfg, kernel_mesh)
    schedule = make_schedule(cfg)
    tx = make_optimizer(cfg, schedule, mesh=kernel_mesh)
    abstract_params = model_def.abstract_params
    param_sh = sharding.param_shardings(abstract_params, mesh)
    if cfg.optimizer_in_backward:
        inner = tx if cfg.master_dtype == "float32" else float32_optimizer(tx)
        tx = layerwise.layerwise_optimizer(inner)
        opt_sh = layerwise.state_shardings(inner, abstract_params, mesh)
        train_step = layerwise.make_train_step(
            model_def,
            inner,
            functools.partial(loss_from_hidden, model_def),
            seed=cfg.seed,
            fused_apply=cfg.fused_apply,
            low_precision=cfg.master_dtype != "float32",
        )
    else:
        if cfg.master_dtype != "float32":
            tx = with_rounding_count(tx)
        opt_sh = sharding.state_shardings(
            jax.eval_shape(tx.init, abstract_params), abstract_params, mesh
        )
        train_step = make_train_step(
            model_def,
            tx,
            seed=cfg.seed,
            telemetry=state_telemetry(cfg, schedule),
            activations=activation_telemetry(cfg) if observe_activations else None,
            fused_apply=cfg.fused_apply,
        )
    # Train batches are [microbatches, batch, T + 1]; validation batches [batch, T + 1].
    batch_sh = sharding.batch_sharding(mesh, batch_axis=1, rank=3)
    eval_batch_sh = sharding.batch_sharding(mesh, batch_axis=0, rank=2)
    step_fn = jax.jit(
        train_step,
        in_shardings=(param_sh, opt_sh, batch_sh),
        out_shardings=(param_sh, opt_sh, None),
        donate_argnums=(0, 1),
        compiler_options=compiler_options(cfg),
    )
    eval_fn = jax.jit(
        lambda p, t: next_token_loss(model_def, p, t),
        in_shardings=(param_sh, eval_batch_sh),
        compiler_options=compiler_options(cfg),
    )
    return TrainProgram(
        cfg,
        mesh,
        model_def,
        schedule,
        tx,
        param_sh,
        opt_sh,
        batch_sh,
        eval_batch_sh,
        step_fn,
        eval_fn,
    )


# ----------------------------------------------------------------------------- set-up / restore


@dataclasses.dataclass
class RunState:
    """A run ready for its loop: data, the program, and the state at ``step``."""

    program: TrainProgram
    checkpointer: Checkpointer
    tokenizer: Any
    order: TrainOrder
    val_windows: PackedWindows
    params: Any
    opt_state: Any
    step: int
    position: int
    skipped_steps: int = 0


def _run_fingerprint(cfg: TrainConfig, tokenizer) -> dict:
    optimizer = optimizer_fingerprint(cfg)
    if not cfg.fp8_state:
        # Recorded only when set, so that checkpoints from before the option still resume.
        del optimizer["fp8_state"]
    return {
        "precision": cfg.precision,
        **optimizer,
        "tokenizer": tokenizer.identity,
        # Recorded only when not the default, so that checkpoints from before the option resume.
        **({"master_dtype": cfg.master_dtype} if cfg.master_dtype != "float32" else {}),
        # The per-layer state layout (coat_jax.training.layerwise) is not the plain one.
        **({"optimizer_in_backward": True} if cfg.optimizer_in_backward else {}),
        # Held-out documents change the training text, so a resume must keep them.
        **({"val_documents": cfg.val_documents} if cfg.val_documents else {}),
    }


def setup_run(cfg: TrainConfig, out: Path, checkpointer: Checkpointer, say) -> RunState:
    """Data, model, optimizer and the starting state: restored (``resume``) or initialised."""
    if not cfg.resume:
        _claim_for_new_run(cfg, out, checkpointer, say)
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp)
    sharding.check_batch_divisible(cfg.batch_size, mesh)
    if mesh.size < len(jax.devices()):
        say(f"note: the mesh uses {mesh.size} of {len(jax.devices())} devices")

    tokenizer = make_tokenizer(
        cfg.tokenizer, resolve_init_from(cfg.init_from) if cfg.init_from else None
    )
    tokens = tokenize_to_cache(
        cfg.data_path, tokenizer, cfg.cache_dir, cfg.val_fraction, cfg.val_documents
    )
    if tokens.tokenized_s is not None:
        say(
            f"tokenized {cfg.data_path} in {tokens.tokenized_s:.1f} s: {len(tokens.train):,} "
            f"training and {len(tokens.val):,} validation tokens, cached in {tokens.directory}"
        )
    order = TrainOrder(PackedWindows(tokens.train, cfg.seq_len, "train"), cfg.seed)
    val_windows = PackedWindows(tokens.val, cfg.seq_len, "validation")

    meta, pretrained = None, None
    if cfg.resume:
        meta = checkpointer.latest_meta()
        if not isinstance(meta["fingerprint"].get("model"), dict):
            raise CheckpointError(
                f"checkpoint metadata in {checkpointer.directory} lacks the model"
            )
        # With init_from the architecture is whatever the checkpoint was trained as: the
        # initial weights no longer matter and need not be loaded again.
        llama_cfg = (
            llama_config_from_dict(meta["fingerprint"]["model"]) if cfg.init_from else cfg.model
        )
    else:
        llama_cfg = cfg.model
        if cfg.init_from:
            path = resolve_init_from(cfg.init_from)
            say(f"loading {path} (its architecture replaces the config's model section)")
            try:
                pretrained = from_pretrained(
                    path,
                    precision=cfg.precision,
                    dtype=COMPUTE_DTYPES[cfg.compute_dtype],
                    param_dtype=MASTER_DTYPES[cfg.master_dtype],
                    scan_layers=cfg.scan_layers,
                    remat=cfg.remat,
                    fp8_attention=cfg.fp8_attention,
                )
            except FileNotFoundError as e:
                raise ValueError(
                    f"init_from={cfg.init_from!r}: {e}; give a Hugging Face or coat-jax folder "
                    "with its *.safetensors weights, or a .gguf file"
                ) from None
            except KeyError as e:
                raise ValueError(
                    f"init_from={cfg.init_from!r}: its config lacks the key {e}; give a "
                    "complete Llama config.json (Hugging Face's) or a .gguf file"
                ) from None
            llama_cfg = pretrained.config
    if cfg.init_from and cfg.seq_len > llama_cfg.max_position_embeddings:
        raise ValueError(
            f"seq_len={cfg.seq_len} is longer than init_from's max_position_embeddings="
            f"{llama_cfg.max_position_embeddings}; lower seq_len"
        )
    if tokenizer.vocab_size > llama_cfg.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
            f"{llama_cfg.vocab_size}; raise model.vocab_size"
        )
    checkpointer.fingerprint = json.loads(
        json.dumps({"model": llama_config_dict(llama_cfg), **_run_fingerprint(cfg, tokenizer)})
    )
    schedule_steps = cfg.steps if meta is None else _resumed_schedule(cfg, meta, say)
    program = build_program(
        cfg if schedule_steps == cfg.steps else dataclasses.replace(cfg, steps=schedule_steps),
        llama_cfg,
        mesh,
    )

    skipped = 0
    if meta is not None:
        params, opt_state, meta = _restore(program, checkpointer, meta, say)
        step, position = meta["step"], meta["data_position"]
        skipped = meta.get("skipped_steps", 0)
        say(f"resumed from step {step} in {checkpointer.directory}")
    else:
        if pretrained is not None:
            _, pretrained_state = _split_params(pretrained)
            params = jax.device_put(nnx.to_pure_dict(pretrained_state), program.param_shardings)
            del pretrained, pretrained_state
        else:
            params = program.init_params(jax.random.key(cfg.seed))
        opt_state = program.init_opt_state(params)
        step, position = 0, 0
    return RunState(
        program,
        checkpointer,
        tokenizer,
        order,
        val_windows,
        params,
        opt_state,
        step,
        position,
        skipped,
    )


# Files every run writes: a directory holding them belongs to another run.
_RUN_FILES = ("config.yaml", "metrics.jsonl", "tensorboard")


def _claim_for_new_run(cfg: TrainConfig, out: Path, checkpointer: Checkpointer, say) -> None:
    """Refuses an ``output_dir`` holding another run's files, or (``overwrite``) deletes them."""
    existing = checkpointer.steps()
    others = [name for name in _RUN_FILES if (out / name).exists()]
    # Several processes: all have looked before any deletes, so all take the same branch.
    distributed.sync("coat_jax output_dir listed")
    if (existing or others) and cfg.overwrite:
        say(
            f"overwrite=true: deleting the previous run's checkpoints {existing} and "
            f"{', '.join(others) or 'no other files'} in {out}"
        )
        checkpointer.delete_all()  # Orbax: the main process deletes, every process waits
        if distributed.is_main_process():
            for name in others:
                path = out / name
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        distributed.sync("coat_jax output_dir overwritten")
    elif existing:
        raise ValueError(
            f"output_dir {str(out)!r} already holds checkpoints (steps {existing}); pass "
            "resume=true to continue that run, choose another output_dir, or pass "
            "overwrite=true to delete them and start a new run there"
        )
    elif others:
        raise ValueError(
            f"output_dir {str(out)!r} holds another run's {', '.join(others)} but no "
            "checkpoint; choose another output_dir, or pass overwrite=true to replace them"
        )


def _resumed_schedule(cfg: TrainConfig, meta: dict, say) -> int:
    """The learning-rate schedule's length on resume: the checkpoint's run's, unless
    ``reschedule``; a changed ``steps`` alone would re-stretch the cosine mid-run."""
    saved = meta.get("schedule_steps")
    if saved is None:
        say(
            f"note: checkpoint step {meta['step']} does not record its learning-rate schedule "
            f"(written before coat-jax recorded it); the schedule spans steps={cfg.steps}"
        )
        return cfg.steps
    if saved == cfg.steps:
        return saved
    if cfg.reschedule:
        say(
            f"reschedule=true: the learning-rate schedule now spans {cfg.steps} steps instead "
            f"of the original run's {saved}"
        )
        return cfg.steps
    after = (
        f"; after step {saved} the rate stays at its floor, "
        f"{cfg.learning_rate * cfg.min_lr_ratio:.3g}"
        if cfg.steps > saved
        else ""
    )
    say(
        f"note: steps={cfg.steps}, but the learning-rate schedule stays the original run's "
        f"({saved} steps{after}); pass reschedule=true to spread it over {cfg.steps} steps"
    )
    return saved


def _checkpoint_is_stacked(meta) -> bool:
    return not any(k.startswith("['params']['layers'][0]") for k in meta["leaves"])


def _restore(program: TrainProgram, checkpointer: Checkpointer, meta, say):
    """The checkpointed state in this run's layer layout (converted if saved in the other)."""
    cfg = program.cfg
    saved_stacked = _checkpoint_is_stacked(meta)
    if saved_stacked == cfg.scan_layers:
        abstract = {"params": program.abstract_params, "opt_state": program.abstract_opt_state}
        state, meta = checkpointer.restore(meta, abstract, seed=cfg.seed)
        return state["params"], state["opt_state"], meta
    # Saved in the other layout: restore it as saved, then stack or unstack every tree that
    # mirrors the parameters (moments, FP8 codes, per-group statistics alike).
    saved_params = jax.eval_shape(
        lambda p: relayout(p, scan_layers=saved_stacked), program.model_def.abstract_params
    )
    saved_opt = jax.eval_shape(program.tx.init, saved_params)
    param_sh = sharding.param_shardings(saved_params, program.mesh)
    opt_sh = sharding.state_shardings(saved_opt, saved_params, program.mesh)
    abstract = {
        "params": _with_shardings(saved_params, param_sh),
        "opt_state": _with_shardings(saved_opt, opt_sh),
    }
    state, meta = checkpointer.restore(meta, abstract, seed=cfg.seed)
    state = jax.jit(
        lambda s: relayout(s, scan_layers=cfg.scan_layers),
        out_shardings={"params": program.param_shardings, "opt_state": program.opt_shardings},
    )(state)
    say(
        f"converted the checkpoint from the {'scanned' if saved_stacked else 'unrolled'} to "
        f"the {'scanned' if cfg.scan_layers else 'unrolled'} layer layout"
    )
    return state["params"], state["opt_state"], meta


# ----------------------------------------------------------------------------- the loop


def train(cfg: TrainConfig, *, stop_at: int | None = None, say=print) -> TrainResult:
    """Runs (or resumes) the job ``cfg`` describes.

    The output directory is locked for the run (:class:`~coat_jax.training.rundir.RunDirectory`)
    and, once the run is set up, every status line and the error that ends a failed run also go
    to its ``train.log``; a run refused before that leaves ``output_dir`` as it was.

    Args:
      cfg: the run.
      stop_at: stop after this global step as if interrupted (checkpoint, no final evaluation);
        for tests and for splitting a run into pieces.
      say: where status lines go.

    Returns:
      The final step, parameters and optimizer state, validation loss and perplexity (None when
      stopped early) and the signal that stopped the run, if any.

    Raises:
      ValueError: bad input (the message says what to change); ``OutputDirInUseError`` when
        another trainer holds ``output_dir``, ``CheckpointError`` for checkpoints that cannot
        be read or written.
      DivergedError: the loss, the gradient or the state became non-finite.
    """
    if cfg.compilation_cache_dir:
        # JAX's persistent cache: a rerun or resume of the same set-up skips recompiling the
        # step. Process-wide, like every jax.config setting.
        jax.config.update(
            "jax_compilation_cache_dir", str(Path(cfg.compilation_cache_dir).expanduser())
        )
    out = Path(cfg.output_dir).expanduser()
    with RunDirectory(distributed.process_dir(out)) as run_dir:
        say = _Say(say if distributed.is_main_process() else distributed.quiet, run_dir.log)
        run_dir.log(f"pid {os.getpid()}: {'resuming' if cfg.resume else 'a new run'} in {out}")
        if run_dir.took_over:
            say(f"note: took over the lock of a trainer no longer running ({run_dir.took_over})")
        try:
            checkpointer = Checkpointer(out, keep=cfg.keep_checkpoints, fingerprint={})
            if checkpointer.removed_incomplete:
                say(
                    f"removed {', '.join(checkpointer.removed_incomplete)}: checkpoint(s) an "
                    "interrupted save left incomplete"
                )
            try:
                run = setup_run(cfg, out, checkpointer, say)
                run_dir.start_log()
                # Every process has checked output_dir before the main one writes there.
                distributed.sync("coat_jax set-up")
                if distributed.is_main_process():
                    config = yaml.safe_dump(to_dict(cfg), sort_keys=False)
                    (out / "config.yaml").write_text(config)
                result = run_loop(run, cfg, out, stop_at, say)
            except BaseException:
                # A failed save in flight must not hide the error that stops the run.
                try:
                    checkpointer.close()
                except CheckpointSaveError as e:
                    say(f"warning: {e}")
                raise
            checkpointer.close()
            return result
        except BaseException as e:
            if exit_code(e) is not None:
                run_dir.log(error_line(e))
            raise


class _Say:
    """A status-line sink: the console (print, or the progress bar's write) and train.log."""

    def __init__(self, console, log=None):
        self.console, self.log = console, log

    def __call__(self, line: str) -> None:
        self.console(line)
        if self.log is not None:
            self.log(line)


def run_loop(run: RunState, cfg: TrainConfig, out: Path, stop_at, say) -> TrainResult:
    """Steps from ``run.step`` to ``cfg.steps`` (or ``stop_at``), logging, evaluating, saving."""
    program, mesh = run.program, run.program.mesh
    num_params = sum(math.prod(p.shape) for p in jax.tree.leaves(program.abstract_params))
    say(
        f"Llama {num_params / 1e6:.2f}M params, precision={cfg.precision}, "
        f"optimizer={cfg.optimizer}, scan_layers={cfg.scan_layers}, remat={cfg.remat}, "
        f"mesh data={mesh.shape['data']} x fsdp={mesh.shape['fsdp']}, "
        f"{cfg.tokens_per_step} tokens/step, {run.order.windows.num_windows} training windows"
    )
    log = (MetricsLog if distributed.is_main_process() else distributed.NoLog)(
        out / "metrics.jsonl",
        resume_step=run.step if cfg.resume else None,
        tensorboard_dir=out / "tensorboard" if cfg.tensorboard else None,
    )
    try:
        return _steps(run, cfg, out, stop_at, say, log)
    finally:
        log.close()


# The thread that compiles and dispatches the first step (see _first_step); train.py exits
# with os._exit while it is still alive.
FIRST_STEP_THREAD = "coat_jax first step"


def _first_step(step_fn, args, stop: GracefulStop):
    """``step_fn(*args)`` for the first step, in a thread, so a stop signal is honoured at once.

    The first call compiles the step (minutes at 7B), which a signal handler cannot
    interrupt; the main thread waits here instead and returns None when a signal arrives
    first, leaving the thread to finish on its own.
    """
    box: dict[str, Any] = {}

    def run():
        try:
            box["out"] = step_fn(*args)
        except BaseException as e:  # re-raised in the main thread
            box["error"] = e

    worker = threading.Thread(target=run, name=FIRST_STEP_THREAD, daemon=True)
    stop.compiling = True
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.05)
            if stop.signum is not None and worker.is_alive():
                return None
    finally:
        stop.compiling = False
    if "error" in box:
        raise box["error"]
    return box["out"]


def _first_step_of(cfg: TrainConfig, step_fn, args, stop: GracefulStop):
    """:func:`_first_step`; with ``cfg.deterministic`` an error of the first step (its compile,
    or its run) becomes a ``ValueError`` that names the option (``train.py`` prints it as one
    line). Runs of several processes compile their first step elsewhere and keep the error."""
    try:
        return _first_step(step_fn, args, stop)
    except (ValueError, FloatingPointError, KeyboardInterrupt):
        raise
    except Exception as e:
        if not cfg.deterministic:
            raise
        raise ValueError(
            f"the first training step failed to compile or run with deterministic=true (XLA's "
            f"xla_gpu_deterministic_ops): {type(e).__name__}: {str(e)[:300]}. Set "
            "deterministic=false; on JAX 0.11.2 on an H200 BF16 and COAT steps with cuDNN's "
            "attention failed to compile this way, and the same step with "
            "compute_dtype=float32 compiled"
        ) from e


class _Progress:
    """Steps dispatched but not yet finished, and what finishing one does.

    Finishing a step fetches its metrics (which waits for it), checks that its loss and
    gradient norm are finite, moves the bar and writes a metrics.jsonl record every
    ``log_every`` steps. A non-finite step stops the run (:class:`DivergedError`) unless
    ``skip_nonfinite_steps`` allows one more skipped step (the optimizer has left the state as
    it was: :func:`coat_jax.training.optimizers.skip_nonfinite`).
    """

    def __init__(self, cfg, schedule, log, bar, say, checkpointer, last_step, step, skipped):
        self.cfg, self.schedule, self.log, self.bar, self.say = cfg, schedule, log, bar, say
        self.checkpointer, self.last_step = checkpointer, last_step
        self.first_step = step + 1
        self.finished = step
        self.recorded = step  # the step of the last metrics.jsonl record
        self.skipped = skipped
        self.in_flight: collections.deque = collections.deque()
        self.window: list[dict] = []  # finished, not skipped, steps since the last record
        # Throughput: tokens of the steps seen done since the window's start (``clock``), over
        # the time from that start to the last of them (``seen``). None: the window starts at
        # the next step seen done.
        self.clock: float | None = None
        self.seen: float | None = None
        self.tokens = 0
        self.started = time.perf_counter()

    def dispatched(self, step: int, metrics) -> None:
        self.in_flight.append((step, metrics))

    def finish(self, keep: int = 0) -> None:
        """Finishes the oldest steps in flight until at most ``keep`` remain."""
        while len(self.in_flight) > keep:
            step, metrics = self.in_flight.popleft()
            values = jax.device_get(metrics)
            now = time.perf_counter()
            # Throughput is timed between instants at which the host saw a step done, so the
            # host's own work in between (writing a record) neither shortens nor lengthens a
            # window. Only steps seen with the next one already in flight are timed: that is
            # how every step but the last before a drain (an evaluation, a save, the end) is
            # seen, and on the H200 it is seen later than a step with nothing after it (a 7B
            # run's final step looked 0.5 s shorter than the others). A window needs two timed
            # steps, so with eval_every or checkpoint_every of 1 or 2 no record has tokens/s.
            self._finished(step, values, now if self.in_flight else None)

    def restart_clock(self) -> None:
        """Starts a new throughput window at the next timed step (after an evaluation or a
        save, which are not training throughput)."""
        self.clock, self.seen, self.tokens = None, None, 0

    def _timed(self, now: float | None) -> None:
        if now is None:
            return
        if self.clock is None:
            self.clock = now
        else:
            self.tokens += self.cfg.tokens_per_step
            self.seen = now

    def _finished(self, step: int, values: dict, now: float | None) -> None:
        cfg = self.cfg
        loss, grad_norm = float(values["loss"]), float(values["grad_norm"])
        skipped = not math.isfinite(grad_norm) and cfg.skip_nonfinite_steps > 0
        if skipped:
            self.skipped += 1
            if self.skipped > cfg.skip_nonfinite_steps:
                raise _diverged(
                    f"step {step} is non-finite (loss {loss}, gradient norm {grad_norm}), "
                    f"{self.skipped} such steps, more than skip_nonfinite_steps="
                    f"{cfg.skip_nonfinite_steps}",
                    self.checkpointer,
                )
            self.say(
                f"step {step}: loss {loss}, gradient norm {grad_norm}: update skipped "
                f"({self.skipped} of at most {cfg.skip_nonfinite_steps})"
            )
        elif not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise _diverged(
                f"training loss is {loss} (gradient norm {grad_norm}) at step {step}",
                self.checkpointer,
            )
        self.finished = step
        self.bar.update(1)
        if not skipped:
            self.window.append(values)
        if step == self.first_step:
            # The first step includes compilation; throughput is timed from its end. Its loss
            # is logged on its own, so the starting loss is seen.
            record = self._record(step, 0, 0.0)
            record["first_step_s"] = (now or time.perf_counter()) - self.started
            self.log.write(record)
            self.recorded = step
            if "loss" in record:
                self.say(
                    f"step {step}: loss {record['loss']:.4f}; the first step took "
                    f"{record['first_step_s']:.1f} s (compilation included)"
                )
            self._timed(now)  # starts the window: the next step has been running since
            return
        self._timed(now)
        if step % cfg.log_every == 0 or step == self.last_step:
            self.flush()

    def flush(self) -> None:
        """Writes the record of the steps finished since the last one, if any."""
        if self.finished == self.recorded:
            return
        timed = self.tokens > 0
        record = self._record(self.finished, self.tokens, self.seen - self.clock if timed else 0.0)
        if timed:  # the next window starts where this one ended
            self.clock, self.tokens = self.seen, 0
        self.log.write(record)
        self.recorded = self.finished
        if "loss" in record:
            self.bar.set_postfix_str(_postfix(record))
            if not self.cfg.progress_bar:
                self.say(f"step {self.finished}/{self.cfg.steps}: {_postfix(record)}")

    def _record(self, step: int, tokens: int, elapsed: float) -> dict:
        if self.window:
            record = _log_record(self.window, step, self.schedule, tokens, elapsed)
        else:  # every step since the last record was skipped
            record = {"step": step}
        if self.cfg.skip_nonfinite_steps:
            record["skipped_steps"] = self.skipped
        # Wall time since the loop started, checkpoints and evaluations included (which
        # tokens_per_sec leaves out): what a save costs the run shows here.
        record["elapsed_s"] = time.perf_counter() - self.started
        self.window = []
        return record


def _steps(run: RunState, cfg: TrainConfig, out: Path, stop_at, say, log) -> TrainResult:
    from tqdm.auto import tqdm

    program, checkpointer = run.program, run.checkpointer
    params, opt_state, step, position = run.params, run.opt_state, run.step, run.position
    sequences_per_step = cfg.batch_size * cfg.grad_accum
    last_step = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
    val_loss = None

    def validate() -> float:
        return evaluate(program.eval_fn, params, run.val_windows, cfg, program.eval_batch_sharding)

    bar = tqdm(
        total=cfg.steps,
        initial=step,
        desc="train",
        dynamic_ncols=True,
        disable=not cfg.progress_bar or not distributed.is_main_process(),
    )
    if not bar.disable:
        say = _Say(bar.write, say.log if isinstance(say, _Say) else None)
    progress = _Progress(
        cfg, program.schedule, log, bar, say, checkpointer, last_step, step, run.skipped_steps
    )
    no_checkpoint = lambda: checkpointer.latest_step() is None

    def attempt(action, fatal) -> None:
        # A failed save stops the run only when no good checkpoint would remain (or it was the
        # final one); otherwise training goes on and the next save may succeed.
        try:
            note = action()
        except CheckpointSaveError as e:
            if fatal():
                raise
            say(f"warning: {e}")
        else:
            if note:
                say(note)

    def checkpoint(final: bool) -> None:
        attempt(checkpointer.wait, fatal=lambda: not final and no_checkpoint())
        attempt(
            lambda: checkpointer.save(
                step,
                {"params": params, "opt_state": opt_state},
                data_position=position,
                seed=cfg.seed,
                schedule_steps=program.cfg.steps,
                skipped_steps=progress.skipped,
            ),
            fatal=lambda: final or no_checkpoint(),
        )

    will_save = (
        cfg.save_final
        or last_step < cfg.steps
        or last_step // cfg.checkpoint_every > step // cfg.checkpoint_every
    )
    if will_save and step < last_step:
        checkpointer.check_room(
            {"params": program.abstract_params, "opt_state": program.abstract_opt_state}
        )
        # The first save's pinned host buffers, allocated while the first steps run (GPU only).
        checkpointer.warm_host_memory({"params": params, "opt_state": opt_state})
    if cfg.eval_at_start and step == 0:
        # The starting weights' validation loss (a fine-tune's "before"), logged as step 0.
        val_loss = validate()
        log.write({"step": 0, "val_loss": val_loss, "val_perplexity": math.exp(val_loss)})
        say(f"step 0: validation loss {val_loss:.4f} (before training)")
    # Several processes stop together: a signal becomes a decision of all at a step boundary.
    agreement = distributed.StopAgreement(say)
    with GracefulStop(say, lambda: progress.finished) as stop:
        if step < last_step:
            # Until the first step is dispatched (_first_step). Several processes compile it
            # to the end: one that abandoned it would leave the others in its collectives.
            stop.compiling = not agreement.several
            say(f"step {step + 1}: compiling the train step")
        while step < last_step and agreement.stop(stop.signum) is None:
            batch = run.order.take(position, sequences_per_step)
            batch = batch.reshape(cfg.grad_accum, cfg.batch_size, cfg.seq_len + 1)
            args = (params, opt_state, sharding.put_batch(batch, program.batch_sharding))
            if step + 1 == progress.first_step and not agreement.several:
                outputs = _first_step_of(cfg, program.step_fn, args, stop)
                if outputs is None:  # the state went to the abandoned step
                    params = opt_state = None
                    break
            else:
                outputs = program.step_fn(*args)
            params, opt_state, metrics = outputs
            del args, outputs
            step += 1
            position += sequences_per_step
            # Bounded dispatch: with step `step` queued, wait for the one before it. A stop
            # signal then waits for one step, and the bar counts finished steps.
            progress.dispatched(step, metrics)
            progress.finish(keep=1)
            evaluate_now = step % cfg.eval_every == 0 and step < cfg.steps
            save_now = step % cfg.checkpoint_every == 0
            if evaluate_now or save_now:
                progress.finish()
            if evaluate_now:
                val_loss = validate()
                log.write({"step": step, "val_loss": val_loss})
                say(f"step {step}: validation loss {val_loss:.4f}")
                # Evaluation and checkpoints are not training throughput.
                progress.restart_clock()
            if save_now:
                checkpoint(final=False)
                progress.restart_clock()
        stop.compiling = False
        progress.finish()
        progress.flush()
        bar.close()
        signum = agreement.final(stop.signum)
        stopped_by = signal.Signals(signum).name if signum is not None else None
        if stopped_by and step == run.step:
            say(
                f"stopped by {stopped_by} before the first step ran; nothing to save (the run "
                f"is at step {step}, as it started)"
            )
            return TrainResult(step, params, opt_state, None, None, stopped_by, out)
        completed = stopped_by is None and step >= cfg.steps
        final_save = not completed or cfg.save_final
        if final_save:
            checkpoint(final=True)
        if completed:
            # The final checkpoint is written while the run evaluates and samples.
            val_loss = validate()
            log.write({"step": step, "val_loss": val_loss, "val_perplexity": math.exp(val_loss)})
            if cfg.sample_prompt:
                text = sample_text(
                    params,
                    run.tokenizer,
                    cfg.sample_prompt,
                    cfg.sample_tokens,
                    config=program.model_def.config,
                    dtype=COMPUTE_DTYPES[cfg.compute_dtype],
                    seed=cfg.seed,
                )
                say(f"sample: {text!r}")
        else:
            val_loss = None
        attempt(checkpointer.wait, fatal=lambda: final_save or no_checkpoint())
    if distributed.is_main_process():
        plot_loss_curve(log.read(), out / "loss_curve.png", f"{cfg.precision} / {cfg.optimizer}")
    if not completed:
        say(
            f"stopped at step {step}{' by ' + stopped_by if stopped_by else ''}; checkpoint "
            f"saved in {checkpointer.directory}; continue with resume=true"
        )
    else:
        saved = (
            f"checkpoint in {checkpointer.directory}"
            if final_save
            else f"no final checkpoint (save_final=false), {checkpointer.newest()}"
        )
        say(
            f"done: step {step}, validation loss {val_loss:.4f}, perplexity "
            f"{math.exp(val_loss):.3f}; metrics in {out / 'metrics.jsonl'}, curve in "
            f"{out / 'loss_curve.png'}; {saved}"
        )
    return TrainResult(
        step=step,
        params=params,
        opt_state=opt_state,
        val_loss=val_loss,
        val_perplexity=None if val_loss is None else math.exp(val_loss),
        stopped_by=stopped_by,
        output_dir=out,
    )


def _diverged(what: str, checkpointer: Checkpointer) -> DivergedError:
    """The error that stops a diverged run, naming the newest checkpoint (all are finite:
    :meth:`Checkpointer.save` refuses non-finite states)."""
    try:
        checkpointer.wait()
        failed = ""
    except CheckpointSaveError as e:
        failed = f" (and the save in flight failed: {e})"
    return DivergedError(
        f"{what}; stopping without saving, and {checkpointer.newest()}{failed}; lower "
        "learning_rate, or set skip_nonfinite_steps to skip such steps"
    )


def host_schedule_value(schedule, step: int) -> float:
    """``schedule(step)`` computed on the host's CPU device where there is one.

    On the accelerator the schedule's few ops would queue behind the step in flight, so
    reading the value would wait for that step (a stall in the logging, not in training).
    """
    try:
        cpu = jax.local_devices(backend="cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS without "cpu": the accelerator computes it
        return float(schedule(step))
    with jax.default_device(cpu):
        return float(schedule(step))


def _log_record(pending, step, schedule, tokens_since, elapsed) -> dict:
    """The metrics.jsonl record of the steps in ``pending``: ``tokens_since`` tokens trained in
    ``elapsed`` seconds (between the instants the host saw the window's first and last steps
    end)."""
    values = jax.device_get(pending)
    record = {
        "step": step,
        "loss": float(np.mean([v["loss"] for v in values])),
        "grad_norm": float(values[-1]["grad_norm"]),
        "learning_rate": host_schedule_value(schedule, step - 1),
        "tokens_per_sec": tokens_since / elapsed if tokens_since else None,
        "host_peak_rss_bytes": host_peak_rss_bytes(),
    }
    # Any other scalar metric of the step (the telemetry's): its value at the record's step,
    # where that step computed it (logged_metrics drops a placeholder-filled telemetry).
    last = logged_metrics(values[-1])
    record.update({k: v.item() for k, v in last.items() if k not in record and np.ndim(v) == 0})
    peak = device_peak_bytes()
    if peak is not None:
        record["peak_memory_bytes"] = peak
    return record


def _postfix(record: dict) -> str:
    parts = [f"loss={record['loss']:.4f}"]
    if record["tokens_per_sec"]:
        parts.append(f"tok/s={record['tokens_per_sec']:,.0f}")
    if "peak_memory_bytes" in record:
        parts.append(f"mem={_fmt_bytes(record['peak_memory_bytes'])}")
    else:
        parts.append(f"rss={_fmt_bytes(record['host_peak_rss_bytes'])}")
    return " ".join(parts)

"""The training loop: model and optimizer set-up, the jitted step, evaluation and bookkeeping.

``train(cfg)`` runs a whole job from a :class:`~coat_jax.training.config.TrainConfig`. The step
is a pure function ``(params, opt_state, tokens) -> (params, opt_state, metrics)`` compiled once
with parameters and optimizer state donated, so XLA updates them in place instead of holding two
copies (SPEC section 4). Gradient accumulation is an explicit ``lax.scan`` over microbatches
inside that one step (not ``optax.MultiSteps``): the optimizer sees one averaged gradient per
step, its state holds no accumulator, and the step counter counts optimizer steps.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
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
from coat_jax.fp8_ops import fp8_compiler_options
from coat_jax.generate import sample_text
from coat_jax.llama import Llama, LlamaConfig, relayout
from coat_jax.losses import cross_entropy_from_hidden
from coat_jax.master import apply_updates_stochastic, float32_optimizer
from coat_jax.training import sharding
from coat_jax.training.checkpoint import Checkpointer, CheckpointError
from coat_jax.training.config import TrainConfig, to_dict
from coat_jax.training.data import (
    PackedWindows,
    TrainOrder,
    make_tokenizer,
    tokenize_to_cache,
    validation_batches,
)
from coat_jax.training.metrics import (
    MetricsLog,
    device_peak_bytes,
    host_peak_rss_bytes,
    plot_loss_curve,
)
from coat_jax.training.optimizers import (  # noqa: F401 - weight_decay_mask: public here too
    make_optimizer,
    optimizer_fingerprint,
    weight_decay_mask,
)

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


def model_def_for(llama_cfg: LlamaConfig, cfg: TrainConfig) -> ModelDef:
    """The model ``cfg`` trains (precision, dtype, layer layout, remat), built abstractly."""
    abstract = nnx.eval_shape(lambda: new_model(llama_cfg, cfg, jax.random.key(0)))
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


def resolve_init_from(spec: str) -> str:
    """A checkpoint path; ``pkg:NAME/rest`` looks inside an installed package (no import)."""
    if spec.startswith("pkg:"):
        package, _, rest = spec[4:].partition("/")
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise ValueError(f"init_from={spec!r}: package {package!r} is not installed")
        path = Path(list(found.submodule_search_locations)[0]) / rest
    else:
        path = Path(spec).expanduser()
    if not path.exists():
        raise ValueError(f"init_from={spec!r}: {str(path)!r} does not exist")
    return str(path)


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
    if model_def.loss_chunk_size is None:
        logits_BTV = model(inputs_BT)
        return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, labels_BT).mean()
    hidden_BTD = model.hidden_states(inputs_BT)
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


def make_train_step(model_def: ModelDef, tx: optax.GradientTransformation, *, seed: int = 0):
    """The pure train step over ``tokens_ABT1``: A microbatches of B windows of T + 1 tokens.

    With bfloat16 parameters (``master_dtype: bfloat16``) ``tx`` must come from
    :func:`with_rounding_count`: gradients are accumulated and clipped in float32 and each
    update is applied with stochastic rounding.
    """
    grad_fn = jax.value_and_grad(lambda p, t: next_token_loss(model_def, p, t))
    low_precision = any(
        jnp.dtype(x.dtype) == jnp.bfloat16 for x in jax.tree.leaves(model_def.abstract_params)
    )
    as_f32 = lambda tree: jax.tree.map(lambda g: g.astype(jnp.float32), tree)

    def train_step(params, opt_state, tokens_ABT1):
        num_micro = tokens_ABT1.shape[0]
        if num_micro == 1:
            loss, grads = grad_fn(params, tokens_ABT1[0])
        else:

            def accumulate(grad_sum, tokens_BT1):
                loss, grads = grad_fn(params, tokens_BT1)
                grads = as_f32(grads) if low_precision else grads
                return jax.tree.map(jnp.add, grad_sum, grads), loss

            zeros = jax.tree.map(
                lambda p: jnp.zeros(p.shape, jnp.float32 if low_precision else p.dtype), params
            )
            grad_sum, losses = jax.lax.scan(accumulate, zeros, tokens_ABT1)
            grads = jax.tree.map(lambda g: g / num_micro, grad_sum)
            loss = losses.mean()
        if low_precision:
            key = jax.random.fold_in(jax.random.key(seed), opt_state.count)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = apply_updates_stochastic(params, updates, key)
        else:
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        grad_norm = optax.tree.norm(as_f32(grads) if low_precision else grads)
        return params, opt_state, {"loss": loss, "grad_norm": grad_norm}

    return train_step


def evaluate(eval_fn, params, windows: PackedWindows, cfg: TrainConfig, batch_sharding) -> float:
    losses = [
        eval_fn(params, jax.device_put(batch, batch_sharding))
        for batch in validation_batches(windows, cfg.batch_size, cfg.eval_batches)
    ]
    return float(np.mean(jax.device_get(losses)))


class GracefulStop:
    """Turns the first SIGINT/SIGTERM into a request to checkpoint and stop after this step.

    A second signal raises KeyboardInterrupt at once (the half-written checkpoint, if any, stays
    in Orbax's temporary directory and is never taken for a complete one). Handlers can only be
    installed from the main thread; elsewhere the default behaviour is kept.
    """

    def __init__(self, say):
        self.signum: int | None = None
        self._say = say
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
        self._say(
            f"received {signal.Signals(signum).name}: saving a checkpoint after this step, then "
            "stopping (send it again to abort without saving)"
        )

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)


@dataclasses.dataclass
class TrainResult:
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


def build_program(cfg: TrainConfig, llama_cfg: LlamaConfig, mesh=None) -> TrainProgram:
    """The model, optimizer, shardings and the jitted train and evaluation steps of ``cfg``."""
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp) if mesh is None else mesh
    sharding.check_batch_divisible(cfg.batch_size, mesh)
    model_def = model_def_for(llama_cfg, cfg)
    schedule = make_schedule(cfg)
    tx = make_optimizer(cfg, schedule)
    if cfg.master_dtype != "float32":
        tx = with_rounding_count(tx)
    abstract_params = model_def.abstract_params
    param_sh = sharding.param_shardings(abstract_params, mesh)
    opt_sh = sharding.state_shardings(
        jax.eval_shape(tx.init, abstract_params), abstract_params, mesh
    )
    # Train batches are [microbatches, batch, T + 1]; validation batches [batch, T + 1].
    batch_sh = sharding.batch_sharding(mesh, batch_axis=1, rank=3)
    eval_batch_sh = sharding.batch_sharding(mesh, batch_axis=0, rank=2)
    step_fn = jax.jit(
        make_train_step(model_def, tx, seed=cfg.seed),
        in_shardings=(param_sh, opt_sh, batch_sh),
        out_shardings=(param_sh, opt_sh, None),
        donate_argnums=(0, 1),
        # On a GPU: no Triton GEMM fusion, so that the FP8 linears compile to cuBLASLt FP8 GEMMs.
        compiler_options=fp8_compiler_options(),
    )
    eval_fn = jax.jit(
        lambda p, t: next_token_loss(model_def, p, t),
        in_shardings=(param_sh, eval_batch_sh),
        compiler_options=fp8_compiler_options(),
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
    }


def setup_run(cfg: TrainConfig, out: Path, checkpointer: Checkpointer, say) -> RunState:
    """Data, model, optimizer and the starting state: restored (``resume``) or initialised."""
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp)
    sharding.check_batch_divisible(cfg.batch_size, mesh)
    if mesh.size < len(jax.devices()):
        say(f"note: the mesh uses {mesh.size} of {len(jax.devices())} devices")

    tokenizer = make_tokenizer(
        cfg.tokenizer, resolve_init_from(cfg.init_from) if cfg.init_from else None
    )
    tokens = tokenize_to_cache(cfg.data_path, tokenizer, cfg.cache_dir, cfg.val_fraction)
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
        existing = checkpointer.steps()
        if existing:
            raise ValueError(
                f"output_dir {str(out)!r} already holds checkpoints (steps {existing}); pass "
                "resume=true to continue that run or choose another output_dir (a new run "
                "there would overwrite them)"
            )
        llama_cfg = cfg.model
        if cfg.init_from:
            path = resolve_init_from(cfg.init_from)
            say(f"loading {path} (its architecture replaces the config's model section)")
            pretrained = from_pretrained(
                path,
                precision=cfg.precision,
                dtype=COMPUTE_DTYPES[cfg.compute_dtype],
                param_dtype=MASTER_DTYPES[cfg.master_dtype],
                scan_layers=cfg.scan_layers,
                remat=cfg.remat,
                fp8_attention=cfg.fp8_attention,
            )
            llama_cfg = pretrained.config
    if tokenizer.vocab_size > llama_cfg.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
            f"{llama_cfg.vocab_size}; raise model.vocab_size"
        )
    checkpointer.fingerprint = json.loads(
        json.dumps({"model": llama_config_dict(llama_cfg), **_run_fingerprint(cfg, tokenizer)})
    )
    program = build_program(cfg, llama_cfg, mesh)

    if meta is not None:
        params, opt_state, meta = _restore(program, checkpointer, meta, say)
        step, position = meta["step"], meta["data_position"]
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
        program, checkpointer, tokenizer, order, val_windows, params, opt_state, step, position
    )


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

    Args:
      cfg: the run.
      stop_at: stop after this global step as if interrupted (checkpoint, no final evaluation);
        for tests and for splitting a run into pieces.
      say: where status lines go.

    Returns:
      The final step, parameters and optimizer state, validation loss and perplexity (None when
      stopped early) and the signal that stopped the run, if any.
    """
    if cfg.compilation_cache_dir:
        # JAX's persistent cache: a rerun or resume of the same set-up skips recompiling the
        # step. Process-wide, like every jax.config setting.
        jax.config.update(
            "jax_compilation_cache_dir", str(Path(cfg.compilation_cache_dir).expanduser())
        )
    out = Path(cfg.output_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    checkpointer = Checkpointer(out, keep=cfg.keep_checkpoints, fingerprint={})
    try:
        run = setup_run(cfg, out, checkpointer, say)
        (out / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return run_loop(run, cfg, out, stop_at, say)
    finally:
        checkpointer.close()


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
    log = MetricsLog(
        out / "metrics.jsonl",
        resume_step=run.step if cfg.resume else None,
        tensorboard_dir=out / "tensorboard" if cfg.tensorboard else None,
    )
    try:
        return _steps(run, cfg, out, stop_at, say, log)
    finally:
        log.close()


def _steps(run: RunState, cfg: TrainConfig, out: Path, stop_at, say, log) -> TrainResult:
    from tqdm.auto import tqdm

    program, checkpointer = run.program, run.checkpointer
    params, opt_state, step, position = run.params, run.opt_state, run.step, run.position
    sequences_per_step = cfg.batch_size * cfg.grad_accum
    last_step = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
    val_loss = None

    def validate() -> float:
        return evaluate(program.eval_fn, params, run.val_windows, cfg, program.eval_batch_sharding)

    def save() -> None:
        checkpointer.save(
            step, {"params": params, "opt_state": opt_state}, data_position=position, seed=cfg.seed
        )

    bar = tqdm(
        total=cfg.steps,
        initial=step,
        desc="train",
        dynamic_ncols=True,
        disable=not cfg.progress_bar,
    )
    say = bar.write if cfg.progress_bar else say
    pending: list[dict] = []
    timer = None
    tokens_since = 0
    first_step_started = time.perf_counter()
    with GracefulStop(say) as stop:
        while step < last_step and stop.signum is None:
            batch = run.order.take(position, sequences_per_step)
            batch = batch.reshape(cfg.grad_accum, cfg.batch_size, cfg.seq_len + 1)
            params, opt_state, metrics = program.step_fn(
                params, opt_state, jax.device_put(batch, program.batch_sharding)
            )
            pending.append(metrics)
            step += 1
            position += sequences_per_step
            bar.update(1)
            if timer is None:
                # The first step includes compilation; throughput is timed from its end. Its
                # loss is logged on its own, so the starting loss is seen.
                jax.block_until_ready(metrics)
                record = _log_record(pending, step, program.schedule, 0, time.perf_counter())
                record["first_step_s"] = time.perf_counter() - first_step_started
                _check_finite(record, step, checkpointer)
                log.write(record)
                say(
                    f"step {step}: loss {record['loss']:.4f}; the first step took "
                    f"{record['first_step_s']:.1f} s (compilation included)"
                )
                pending, timer, tokens_since = [], time.perf_counter(), 0
            else:
                tokens_since += cfg.tokens_per_step
            if pending and (
                step % cfg.log_every == 0 or step == last_step or stop.signum is not None
            ):
                record = _log_record(pending, step, program.schedule, tokens_since, timer)
                pending, timer, tokens_since = [], time.perf_counter(), 0
                _check_finite(record, step, checkpointer)
                log.write(record)
                bar.set_postfix_str(_postfix(record))
                if not cfg.progress_bar:
                    say(f"step {step}/{cfg.steps}: {_postfix(record)}")
            if step % cfg.eval_every == 0 and step < cfg.steps:
                val_loss = validate()
                log.write({"step": step, "val_loss": val_loss})
                say(f"step {step}: validation loss {val_loss:.4f}")
                # Evaluation and checkpoints are not training throughput.
                timer, tokens_since = time.perf_counter(), 0
            if step % cfg.checkpoint_every == 0:
                save()
                timer, tokens_since = time.perf_counter(), 0
        bar.close()
        stopped_by = signal.Signals(stop.signum).name if stop.signum is not None else None
        save()
        if stopped_by is None and step >= cfg.steps:
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
    plot_loss_curve(log.read(), out / "loss_curve.png", f"{cfg.precision} / {cfg.optimizer}")
    if stopped_by or step < cfg.steps:
        say(
            f"stopped at step {step}{' by ' + stopped_by if stopped_by else ''}; checkpoint "
            f"saved in {checkpointer.directory}; continue with resume=true"
        )
    else:
        say(
            f"done: step {step}, validation loss {val_loss:.4f}, perplexity "
            f"{math.exp(val_loss):.3f}; metrics in {out / 'metrics.jsonl'}, curve in "
            f"{out / 'loss_curve.png'}"
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


def _check_finite(record: dict, step: int, checkpointer: Checkpointer) -> None:
    if not math.isfinite(record["loss"]):
        latest = checkpointer.latest_step()
        raise FloatingPointError(
            f"training loss is {record['loss']} at step {step}; stopping without "
            f"saving (latest checkpoint: step {latest}); try a lower learning_rate"
        )


def _log_record(pending, step, schedule, tokens_since, timer) -> dict:
    values = jax.device_get(pending)
    elapsed = time.perf_counter() - timer
    record = {
        "step": step,
        "loss": float(np.mean([v["loss"] for v in values])),
        "grad_norm": float(values[-1]["grad_norm"]),
        "learning_rate": float(schedule(step - 1)),
        "tokens_per_sec": tokens_since / elapsed if tokens_since else None,
        "host_peak_rss_bytes": host_peak_rss_bytes(),
    }
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

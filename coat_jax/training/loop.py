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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from flax import nnx

from coat_jax.checkpoint_io import from_pretrained
from coat_jax.fp8_ops import fp8_compiler_options
from coat_jax.llama import Llama, LlamaConfig
from coat_jax.optim import coat_adamw
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

COMPUTE_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """The static half of an NNX Llama; ``apply`` runs it on a pure-dict parameter tree."""

    config: LlamaConfig
    graphdef: Any
    abstract_state: Any

    def apply(self, params, tokens_BT):
        state = jax.tree.map(lambda x: x, self.abstract_state)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)(tokens_BT)


def _split_params(model) -> tuple[Any, Any]:
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise ValueError(
            "the model holds state other than parameters "
            f"({list(nnx.to_flat_state(rest))[:3]}...); the trainer would not checkpoint it"
        )
    return graphdef, params


def model_def_for(llama_cfg: LlamaConfig, cfg: TrainConfig) -> ModelDef:
    abstract = nnx.eval_shape(lambda: _new_model(llama_cfg, cfg))
    graphdef, state = _split_params(abstract)
    return ModelDef(llama_cfg, graphdef, state)


def _new_model(llama_cfg: LlamaConfig, cfg: TrainConfig) -> Llama:
    return Llama(
        llama_cfg,
        precision=cfg.precision,
        dtype=COMPUTE_DTYPES[cfg.compute_dtype],
        param_dtype=jnp.float32,
        rngs=nnx.Rngs(cfg.seed),
    )


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


def weight_decay_mask(params, decay_all: bool):
    """True where weight decay applies: matrices, except embeddings (and any norm) by default."""

    def decays(path, p):
        names = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
        special = any("embed" in n or "norm" in n for n in names)
        return decay_all or (p.ndim >= 2 and not special)

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(cfg: TrainConfig, schedule) -> optax.GradientTransformation:
    mask = lambda params: weight_decay_mask(params, cfg.decay_norms_and_embeddings)
    if cfg.optimizer == "coat_adamw":
        tx = coat_adamw(
            schedule,
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=mask,
            mu_format=cfg.mu_format,
            nu_format=cfg.nu_format,
        )
    else:
        tx = optax.adamw(
            schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=mask
        )
    if cfg.grad_clip is None:
        return tx
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), tx)


def next_token_loss(model_def: ModelDef, params, tokens_BT1) -> jax.Array:
    """Mean cross-entropy (nats) of predicting ``tokens[:, 1:]`` from ``tokens[:, :-1]``."""
    logits_BTV = model_def.apply(params, tokens_BT1[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, tokens_BT1[:, 1:]).mean()


def make_train_step(model_def: ModelDef, tx: optax.GradientTransformation):
    """The pure train step over ``tokens_ABT1``: A microbatches of B windows of T + 1 tokens."""
    grad_fn = jax.value_and_grad(lambda p, t: next_token_loss(model_def, p, t))

    def train_step(params, opt_state, tokens_ABT1):
        num_micro = tokens_ABT1.shape[0]
        if num_micro == 1:
            loss, grads = grad_fn(params, tokens_ABT1[0])
        else:

            def accumulate(grad_sum, tokens_BT1):
                loss, grads = grad_fn(params, tokens_BT1)
                return jax.tree.map(jnp.add, grad_sum, grads), loss

            grad_sum, losses = jax.lax.scan(
                accumulate, jax.tree.map(jnp.zeros_like, params), tokens_ABT1
            )
            grads = jax.tree.map(lambda g: g / num_micro, grad_sum)
            loss = losses.mean()
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

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
        return _run(cfg, out, checkpointer, stop_at, say)
    finally:
        checkpointer.close()


def _run(cfg: TrainConfig, out: Path, checkpointer: Checkpointer, stop_at, say) -> TrainResult:
    from tqdm.auto import tqdm

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

    schedule = make_schedule(cfg)
    tx = make_optimizer(cfg, schedule)
    run_fingerprint = {
        "precision": cfg.precision,
        "optimizer": cfg.optimizer,
        "mu_format": cfg.mu_format if cfg.optimizer == "coat_adamw" else None,
        "nu_format": cfg.nu_format if cfg.optimizer == "coat_adamw" else None,
        "tokenizer": tokenizer.identity,
    }

    if cfg.resume:
        meta = checkpointer.latest_meta()
        if not isinstance(meta["fingerprint"].get("model"), dict):
            raise CheckpointError(
                f"checkpoint metadata in {checkpointer.directory} lacks the model"
            )
        # With init_from the architecture is whatever the checkpoint was trained as: the
        # initial weights no longer matter and need not be loaded again.
        llama_cfg = (
            llama_config_from_dict(meta["fingerprint"]["model"])
            if cfg.init_from
            else LlamaConfig(**dataclasses.asdict(cfg.model))
        )
    else:
        existing = checkpointer.steps()
        if existing:
            raise ValueError(
                f"output_dir {str(out)!r} already holds checkpoints (steps {existing}); pass "
                "resume=true to continue that run or choose another output_dir (a new run "
                "there would overwrite them)"
            )
        pretrained = None
        if cfg.init_from:
            path = resolve_init_from(cfg.init_from)
            say(f"loading {path} (its architecture replaces the config's model section)")
            pretrained = from_pretrained(
                path,
                precision=cfg.precision,
                dtype=COMPUTE_DTYPES[cfg.compute_dtype],
                param_dtype=jnp.float32,
            )
            llama_cfg = pretrained.config
        else:
            llama_cfg = LlamaConfig(**dataclasses.asdict(cfg.model))
    if tokenizer.vocab_size > llama_cfg.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
            f"{llama_cfg.vocab_size}; raise model.vocab_size"
        )
    checkpointer.fingerprint = json.loads(
        json.dumps({"model": llama_config_dict(llama_cfg), **run_fingerprint})
    )

    model_def = model_def_for(llama_cfg, cfg)
    abstract_params = nnx.to_pure_dict(model_def.abstract_state)
    param_sh = sharding.param_shardings(abstract_params, mesh)
    # Train batches are [microbatches, batch, T + 1]; validation batches [batch, T + 1].
    batch_sh = sharding.batch_sharding(mesh, batch_axis=1, rank=3)
    eval_batch_sh = sharding.batch_sharding(mesh, batch_axis=0, rank=2)

    if cfg.resume:
        abstract_opt = jax.eval_shape(tx.init, abstract_params)
        opt_sh = sharding.state_shardings(abstract_opt, abstract_params, mesh)
        abstract_state = {
            "params": _with_shardings(abstract_params, param_sh),
            "opt_state": _with_shardings(abstract_opt, opt_sh),
        }
        state, meta = checkpointer.restore(meta, abstract_state, seed=cfg.seed)
        params, opt_state = state["params"], state["opt_state"]
        step, position = meta["step"], meta["data_position"]
        say(f"resumed from step {step} in {checkpointer.directory}")
    else:
        if pretrained is not None:
            _, pretrained_state = _split_params(pretrained)
            params = jax.device_put(nnx.to_pure_dict(pretrained_state), param_sh)
            del pretrained, pretrained_state
        else:
            params = jax.jit(
                lambda: nnx.to_pure_dict(_split_params(_new_model(llama_cfg, cfg))[1]),
                out_shardings=param_sh,
            )()
        # Eagerly, on the sharded parameters: each state leaf is created next to its parameter,
        # and no init function needs compiling.
        opt_state = tx.init(params)
        opt_sh = sharding.state_shardings(opt_state, abstract_params, mesh)
        opt_state = jax.device_put(opt_state, opt_sh)
        step, position = 0, 0

    (out / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    num_params = sum(math.prod(p.shape) for p in jax.tree.leaves(abstract_params))
    say(
        f"Llama {num_params / 1e6:.2f}M params, precision={cfg.precision}, "
        f"optimizer={cfg.optimizer}, mesh data={mesh.shape['data']} x fsdp={mesh.shape['fsdp']}, "
        f"{cfg.tokens_per_step} tokens/step, {order.windows.num_windows} training windows"
    )

    step_fn = jax.jit(
        make_train_step(model_def, tx),
        in_shardings=(param_sh, opt_sh, batch_sh),
        out_shardings=(param_sh, opt_sh, None),
        donate_argnums=(0, 1),
        # On a GPU: no Triton GEMM fusion, so that the FP8 linears compile to cuBLASLt FP8 GEMMs.
        compiler_options=fp8_compiler_options(),
    )
    eval_fn = jax.jit(
        lambda p, t: next_token_loss(model_def, p, t), compiler_options=fp8_compiler_options()
    )
    log = MetricsLog(out / "metrics.jsonl", resume_step=step if cfg.resume else None)
    sequences_per_step = cfg.batch_size * cfg.grad_accum
    last_step = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
    val_loss = None

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
    with GracefulStop(say) as stop:
        while step < last_step and stop.signum is None:
            batch = order.take(position, sequences_per_step)
            batch = batch.reshape(cfg.grad_accum, cfg.batch_size, cfg.seq_len + 1)
            params, opt_state, metrics = step_fn(params, opt_state, jax.device_put(batch, batch_sh))
            pending.append(metrics)
            step += 1
            position += sequences_per_step
            bar.update(1)
            if timer is None:
                # The first step includes compilation; throughput is timed from its end.
                jax.block_until_ready(metrics)
                timer, tokens_since = time.perf_counter(), 0
            else:
                tokens_since += cfg.tokens_per_step
            if step % cfg.log_every == 0 or step == last_step or stop.signum is not None:
                record = _log_record(pending, step, schedule, tokens_since, timer)
                pending, timer, tokens_since = [], time.perf_counter(), 0
                if not math.isfinite(record["loss"]):
                    latest = checkpointer.latest_step()
                    raise FloatingPointError(
                        f"training loss is {record['loss']} at step {step}; stopping without "
                        f"saving (latest checkpoint: step {latest}); try a lower learning_rate"
                    )
                log.write(record)
                bar.set_postfix_str(_postfix(record))
            if step % cfg.eval_every == 0 and step < cfg.steps:
                val_loss = evaluate(eval_fn, params, val_windows, cfg, eval_batch_sh)
                log.write({"step": step, "val_loss": val_loss})
                say(f"step {step}: validation loss {val_loss:.4f}")
                # Evaluation and checkpoints are not training throughput.
                timer, tokens_since = time.perf_counter(), 0
            if step % cfg.checkpoint_every == 0:
                checkpointer.save(
                    step,
                    {"params": params, "opt_state": opt_state},
                    data_position=position,
                    seed=cfg.seed,
                )
                timer, tokens_since = time.perf_counter(), 0
        bar.close()
        stopped_by = signal.Signals(stop.signum).name if stop.signum is not None else None
        checkpointer.save(
            step,
            {"params": params, "opt_state": opt_state},
            data_position=position,
            seed=cfg.seed,
        )
        if stopped_by is None and step >= cfg.steps:
            val_loss = evaluate(eval_fn, params, val_windows, cfg, eval_batch_sh)
            log.write({"step": step, "val_loss": val_loss, "val_perplexity": math.exp(val_loss)})
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

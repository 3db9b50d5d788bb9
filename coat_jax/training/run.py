"""A run's set-up: its output directory claimed, its data and program, its state restored or new.

:func:`setup_run` refuses (or, with ``overwrite``, clears) an output directory holding another
run, tokenizes the data, builds the program and restores the newest checkpoint (``resume``,
converting between layer layouts) or initialises the parameters. :class:`GracefulStop` turns a
signal into a checkpoint-and-stop request, and :func:`first_step_of` runs the first step (its
compilation) in a thread so that such a request is honoured at once.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from coat_jax.checkpoint_io import from_pretrained
from coat_jax.llama import relayout
from coat_jax.runs import resolve_init_from
from coat_jax.training import distributed, sharding
from coat_jax.training.checkpoint import Checkpointer, CheckpointError
from coat_jax.training.config import TrainConfig
from coat_jax.training.data import (
    InterleavedWindows,
    MixtureOrder,
    PackedWindows,
    TrainOrder,
    data_sources,
    make_tokenizer,
    tokenize_to_cache,
    within_documents,
)
from coat_jax.training.model import (
    COMPUTE_DTYPES,
    MASTER_DTYPES,
    llama_config_dict,
    llama_config_from_dict,
    split_params,
)
from coat_jax.training.optimizers import optimizer_fingerprint
from coat_jax.training.program import TrainProgram, build_program, with_shardings

# ----------------------------------------------------------------------------- set-up / restore


@dataclasses.dataclass
class RunState:
    """A run ready for its loop: data, the program, and the state at ``step``."""

    program: TrainProgram
    checkpointer: Checkpointer
    tokenizer: Any
    order: TrainOrder | MixtureOrder
    val_windows: PackedWindows | InterleavedWindows
    params: Any
    opt_state: Any
    step: int
    position: int
    skipped_steps: int = 0


def _run_fingerprint(cfg: TrainConfig, tokenizer) -> dict:
    optimizer = optimizer_fingerprint(cfg)
    if not cfg.fp8_state:
        # Recorded only when set, so that checkpoints without the key still resume.
        del optimizer["fp8_state"]
    return {
        "precision": cfg.precision,
        **optimizer,
        "tokenizer": tokenizer.identity,
        # Recorded only when not the default, so that checkpoints without the key resume.
        **({"master_dtype": cfg.master_dtype} if cfg.master_dtype != "float32" else {}),
        # The per-layer state layout (coat_jax.training.layerwise) is not the plain one.
        **({"optimizer_in_backward": True} if cfg.optimizer_in_backward else {}),
        # Held-out documents change the training text, so a resume must keep them.
        **({"val_documents": cfg.val_documents} if cfg.val_documents else {}),
    }


def _data(cfg: TrainConfig, tokenizer, say):
    """The training order and the validation windows of the run's source or mixture; whether
    any source holds chats (whose windows mark tokens that are no loss target); and whether
    attention stays within documents (``attention_across_documents``)."""
    sources = data_sources(cfg)

    def tokenized(source):
        tokens = tokenize_to_cache(
            source.path,
            tokenizer,
            cfg.cache_dir,
            cfg.val_fraction,
            cfg.val_documents,
            source.text_field or cfg.text_field,
            progress=cfg.progress_bar and distributed.is_main_process(),
        )
        if tokens.tokenized_s is not None:
            say(
                f"tokenized {source.path} in {tokens.tokenized_s:.1f} s: {len(tokens.train):,} "
                f"training and {len(tokens.val):,} validation tokens, cached in "
                f"{tokens.directory}"
            )
        return tokens

    # The main process tokenizes while the others wait, then they find the caches it wrote (in
    # a cache_dir they share; on a host of its own a process tokenizes for itself). A source
    # the main process fails on fails the same way in the others.
    if distributed.is_main_process():
        try:
            caches = [tokenized(source) for source in sources]
        finally:
            distributed.sync("coat_jax tokenized")
    else:
        distributed.sync("coat_jax tokenized")
        caches = [tokenized(source) for source in sources]
    chat = any(tokens.chat for tokens in caches)
    within = within_documents(cfg, chat)
    flag = within or cfg.document_positions
    train, val = [], []
    for source, t in zip(sources, caches, strict=True):
        where = f"split of {source.path}"
        train_docs, val_docs = (t.train_docs, t.val_docs) if flag else (None, None)
        train.append(
            PackedWindows(t.train, cfg.seq_len, f"train {where}", t.train_loss, train_docs)
        )
        val.append(PackedWindows(t.val, cfg.seq_len, f"validation {where}", t.val_loss, val_docs))
    if len(sources) == 1:
        return TrainOrder(train[0], cfg.seed), val[0], chat, within
    order = MixtureOrder(train, [s.weight for s in sources], cfg.seed)
    return order, InterleavedWindows(val), chat, within


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
    order, val_windows, chat, within = _data(cfg, tokenizer, say)

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
            f"data.seq_len={cfg.seq_len} is longer than init_from's max_position_embeddings="
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
        loss_mask=chat,
        within_documents=within,
    )

    skipped = 0
    if meta is not None:
        params, opt_state, meta = _restore(program, checkpointer, meta, say)
        step, position = meta["step"], meta["data_position"]
        skipped = meta.get("skipped_steps", 0)
        say(f"resumed from step {step} in {checkpointer.directory}")
    else:
        if pretrained is not None:
            _, pretrained_state = split_params(pretrained)
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
_RUN_FILES = ("config.yaml", "metrics.jsonl", "tensorboard", "wandb", "profile")


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
        "params": with_shardings(saved_params, param_sh),
        "opt_state": with_shardings(saved_opt, opt_sh),
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
        # What a signal has to say, written by say_notes() from the main flow: a handler runs
        # between any two bytecodes, also inside a write to the very stream it would write to.
        self._notes: list[str] = []

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
            self._notes.append(
                f"received {name} while compiling the train step: stopping (no step has run)"
            )
        else:
            when = (
                "every process has agreed to stop (at a step boundary, one step later than alone)"
                if jax.process_count() > 1
                else "the step in flight finishes"
            )
            self._notes.append(
                f"received {name} after step {self._finished()}: saving a checkpoint once "
                f"{when}, then stopping (send it again to abort without saving)"
            )

    def say_notes(self) -> None:
        """Says what the signals received so far have to say (call it outside the handler)."""
        while self._notes:
            self._say(self._notes.pop(0))

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self.say_notes()


FIRST_STEP_THREAD = "coat_jax first step"


def first_step(step_fn, args, stop: GracefulStop):
    """``step_fn(*args)`` for the first step, in a thread, so a stop signal is honoured at once.

    The first call compiles the step (minutes for a large model), which a signal handler cannot
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
                stop.say_notes()
                return None
    finally:
        stop.compiling = False
    if "error" in box:
        raise box["error"]
    return box["out"]


def first_step_of(cfg: TrainConfig, step_fn, args, stop: GracefulStop):
    """:func:`_first_step`; with ``cfg.deterministic`` an error of the first step (its compile,
    or its run) becomes a ``ValueError`` that names the option (``train.py`` prints it as one
    line). Runs of several processes compile their first step elsewhere and keep the error."""
    try:
        return first_step(step_fn, args, stop)
    except (ValueError, FloatingPointError, KeyboardInterrupt):
        raise
    except Exception as e:
        if not cfg.deterministic:
            raise
        raise ValueError(
            f"the first training step failed to compile or run with xla.deterministic=true (XLA's "
            f"xla_gpu_deterministic_ops): {type(e).__name__}: {str(e)[:300]}. Set "
            "xla.deterministic=false (BF16 and COAT steps with cuDNN's attention have failed to "
            "compile this way, the same step with precision.compute_dtype=float32 compiled)"
        ) from e

"""The training loop: ``train(cfg)`` runs a whole job from a ``TrainConfig``.

The run is set up by :mod:`coat_jax.training.run` and its program built by
:mod:`coat_jax.training.program`; this module steps it, evaluates, saves checkpoints and
writes the final evaluation, sample and loss curve.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml

from coat_jax.generate import sample_text
from coat_jax.training import distributed, sharding
from coat_jax.training.checkpoint import Checkpointer, CheckpointSaveError
from coat_jax.training.config import TrainConfig, to_dict
from coat_jax.training.data import PackedWindows, validation_window_ids
from coat_jax.training.errors import error_line, exit_code
from coat_jax.training.metrics import MetricsLog, WandbWriter, plot_loss_curve
from coat_jax.training.model import COMPUTE_DTYPES
from coat_jax.training.plan import resolve_batch
from coat_jax.training.program import warmup_of
from coat_jax.training.progress import Progress
from coat_jax.training.run import GracefulStop, RunState, first_step_of, setup_run
from coat_jax.training.rundir import RunDirectory


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


def evaluate(eval_fn, params, windows: PackedWindows, cfg: TrainConfig, batch_sharding) -> float:
    shape = (cfg.batch_size, windows.seq_len + 1)
    losses = [
        eval_fn(
            params,
            sharding.put_rows(
                lambda rows, ids=ids: windows.gather(ids[rows]), shape, batch_sharding
            ),
        )
        for ids in validation_window_ids(windows, cfg.batch_size, cfg.eval_batches)
    ]
    return float(np.mean(jax.device_get(losses)))


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
    # batch_size=auto is planned by compiling (never running) candidate steps.
    cfg = resolve_batch(cfg, say=say)
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
                    # Made here, not by the Checkpointer: a run refused above leaves none.
                    checkpointer.directory.mkdir(exist_ok=True)
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
    warmup = warmup_of(program.cfg)
    if warmup != program.cfg.warmup_steps:
        say(
            f"note: optimizer.warmup_steps={program.cfg.warmup_steps} is not below steps="
            f"{program.cfg.steps}: the warmup shrinks to {warmup} steps (a tenth of the run)"
        )
    num_params = sum(math.prod(p.shape) for p in jax.tree.leaves(program.abstract_params))
    say(
        f"{program.model_def.config.model_type} {num_params / 1e6:.2f}M params, "
        f"precision.mode={cfg.precision}, "
        f"optimizer.name={cfg.optimizer}, memory.scan_layers={cfg.scan_layers}, "
        f"memory.remat={cfg.remat}, "
        f"mesh data={mesh.shape['data']} x fsdp={mesh.shape['fsdp']}, "
        f"{cfg.tokens_per_step} tokens/step, {run.order.num_windows} training windows"
    )
    if distributed.is_main_process():
        wandb = cfg.wandb_project and WandbWriter(
            out,
            project=cfg.wandb_project,
            mode=cfg.wandb_mode,
            config=to_dict(cfg),
            resume=cfg.resume,
        )
        log = MetricsLog(
            out / "metrics.jsonl",
            resume_step=run.step if cfg.resume else None,
            tensorboard_dir=out / "tensorboard" if cfg.tensorboard else None,
            writers=[wandb] if wandb else [],
        )
    else:
        log = distributed.NoLog()
    try:
        return _steps(run, cfg, out, stop_at, say, log)
    finally:
        log.close()


# The thread that compiles and dispatches the first step (see _first_step); train.py exits
# with os._exit while it is still alive.


class StepTrace:
    """A ``jax.profiler`` trace of the steps ``[first, last]`` (``profile_steps``, 1-based,
    inclusive) into ``directory``; TensorBoard's profile plugin and Perfetto read it. A no-op
    for ``steps=None``. The trace stops once its last step has finished on the device, so it
    holds the steps' device work and not only their dispatch."""

    def __init__(self, steps: tuple[int, int] | None, directory: Path, say):
        self.first, self.last = steps or (0, -1)
        self.directory, self.say = directory, say
        self.active, self.traced = False, 0

    def before(self, step: int) -> None:
        if self.first <= step <= self.last and not self.active:
            jax.profiler.start_trace(os.fspath(self.directory))
            self.active, self.first = True, step

    def after(self, step: int, progress: Progress) -> None:
        if self.active:
            self.traced = step
            if step >= self.last:
                progress.finish()
                self.stop()

    def stop(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active, self.last = False, -1
            self.say(f"profile of steps {self.first} to {self.traced} written to {self.directory}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


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
    progress = Progress(
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
    if agreement.several:
        shape = (cfg.grad_accum, cfg.batch_size, cfg.seq_len + 1)
        held = program.batch_sharding.addressable_devices
        say(
            f"process {jax.process_index()} of {jax.process_count()} reads "
            f"{len(sharding.batch_rows(shape, program.batch_sharding, held))} of the "
            f"{sequences_per_step} sequences of each step: the rows its devices hold"
        )
    trace = StepTrace(cfg.profile_steps, out / "profile", say)
    with GracefulStop(say, lambda: progress.finished) as stop, trace:
        if step < last_step:
            # Until the first step is dispatched (_first_step). Several processes compile it
            # to the end: one that abandoned it would leave the others in its collectives.
            stop.compiling = not agreement.several
            say(f"step {step + 1}: compiling the train step")
        while step < last_step and agreement.stop(stop.signum) is None:
            stop.say_notes()
            trace.before(step + 1)
            batch = sharding.put_rows(
                lambda rows, at=position: run.order.take(at, sequences_per_step, rows),
                (cfg.grad_accum, cfg.batch_size, cfg.seq_len + 1),
                program.batch_sharding,
            )
            args = (params, opt_state, batch)
            if step + 1 == progress.first_step and not agreement.several:
                outputs = first_step_of(cfg, program.step_fn, args, stop)
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
            trace.after(step, progress)
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
        stop.say_notes()
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

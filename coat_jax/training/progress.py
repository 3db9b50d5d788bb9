"""The loop's bookkeeping of finished steps: finiteness checks, metrics.jsonl records, throughput.

:class:`Progress` holds the steps dispatched but not yet finished; finishing one fetches its
metrics, stops a diverged run (or skips the step, within ``skip_nonfinite_steps``), moves the
progress bar and writes a record every ``log_every`` steps with the tokens per second timed
between the instants the host saw steps end.
"""

from __future__ import annotations

import collections
import math
import time

import jax
import numpy as np

from coat_jax.training.checkpoint import Checkpointer, CheckpointSaveError
from coat_jax.training.errors import DivergedError
from coat_jax.training.metrics import device_peak_bytes, host_peak_rss_bytes
from coat_jax.training.telemetry import logged_metrics


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**30:.2f}GiB" if n >= 2**30 else f"{n / 2**20:.0f}MiB"


class Progress:
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
            # seen, and on a GPU such a step is seen later than one with nothing after it, so
            # mixing the two would skew the window. A window needs two timed
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
                    f"{self.skipped} such steps, more than optimizer.skip_nonfinite_steps="
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
        # The target tokens of the steps behind ``loss``: every label of plain text, the
        # assistant's tokens of a chat.
        **(
            {"loss_tokens": int(sum(v["loss_tokens"] for v in values))}
            if "loss_tokens" in values[0]
            else {}
        ),
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

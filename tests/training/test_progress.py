"""The trainer's logged tokens/s: timed between the instants the host saw steps end.

A record's host work (reading the learning rate, writing metrics.jsonl) happens while the next
step runs on the device. It must not move the throughput window: measured from the end of that
work, the window would miss part of a step it counts (on the H200 a 7B run logged about 30% more
tokens/s than the benchmark's blocking timer). And a step seen with the next one in flight is
seen later than one with nothing after it (the last before a drain): only the former are timed
(on the H200 a 7B run's final step looked 0.5 s shorter than the 1.5 s of the others).
"""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest

from coat_jax.training import progress as progress_module

STEP_S = 1.5  # device time per step
WRITE_S = 1.2  # host time to write one record (a step in flight runs meanwhile)
SEEN_LATE_S = 0.5  # how much later a step is seen while the next one runs
TOKENS = 100


class _Metrics(dict):
    """One step's metrics and the instant the (fake) host sees that step done."""

    done_at = 0.0


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(progress_module.time, "perf_counter", c)
    real_get = jax.device_get

    def device_get(x):
        if isinstance(x, _Metrics):  # waiting for the step: the clock moves to its end
            c.now = max(c.now, x.done_at)
        return real_get(x)

    monkeypatch.setattr(jax, "device_get", device_get)
    return c


class _Log:
    def __init__(self, clock):
        self.clock, self.records = clock, []

    def write(self, record):
        self.records.append(record)
        self.clock.now += WRITE_S


def _progress(clock, steps, log_every):
    cfg = types.SimpleNamespace(
        tokens_per_step=TOKENS,
        log_every=log_every,
        skip_nonfinite_steps=0,
        progress_bar=False,
        steps=steps,
    )
    bar = types.SimpleNamespace(update=lambda n: None, set_postfix_str=lambda s: None)
    log = _Log(clock)
    progress = progress_module.Progress(
        cfg, lambda step: 1e-3, log, bar, lambda msg: None, None, steps, 0, 0
    )
    return progress, log


@pytest.mark.parametrize("log_every", [1, 2, 4, 5])
def test_tokens_per_sec_is_device_throughput_despite_record_overhead(clock, log_every):
    steps = 12
    progress, log = _progress(clock, steps, log_every)
    start = 10.0  # the first step ends at 10 s (compilation), then one every STEP_S
    for step in range(1, steps + 1):
        m = _Metrics(loss=np.float32(2.0), grad_norm=np.float32(1.0))
        # Every step but the last is seen while the next one runs.
        m.done_at = start + (step - 1) * STEP_S + (SEEN_LATE_S if step < steps else 0.0)
        progress.dispatched(step, m)
        progress.finish(keep=1)  # the trainer's bounded dispatch: one step stays in flight
    progress.finish()
    progress.flush()
    records = log.records
    assert [r["step"] for r in records] == sorted(
        {1, steps} | {s for s in range(2, steps + 1) if s % log_every == 0}
    )
    timed = [r for r in records if r.get("tokens_per_sec")]
    # Steps 2 .. steps-1 are timed (the first starts the clock, the last is seen early); a
    # record holding only the last step has no throughput.
    assert len(timed) == len({min(-(-s // log_every) * log_every, steps) for s in range(2, steps)})
    for r in timed:
        # WRITE_S < STEP_S: the host keeps up, so the device never waits and each record's
        # throughput is exactly one step's tokens per STEP_S.
        assert r["tokens_per_sec"] == pytest.approx(TOKENS / STEP_S, rel=1e-9), r
    assert records[0]["first_step_s"] == pytest.approx(start + SEEN_LATE_S)


def test_throughput_restarts_after_an_evaluation(clock):
    steps = 8
    progress, log = _progress(clock, steps, 100)
    t = 0.0
    for step in range(1, steps + 1):
        m = _Metrics(loss=np.float32(2.0), grad_norm=np.float32(1.0))
        t += STEP_S
        m.done_at = t + SEEN_LATE_S
        progress.dispatched(step, m)
        progress.finish(keep=1)
        if step == 4:  # an evaluation: drain, 30 s of other work, a new window
            progress.finish()
            clock.now += 30.0
            t = clock.now
            progress.restart_clock()
    progress.finish()
    progress.flush()
    (last,) = [r for r in log.records if r["step"] == steps]
    assert last["tokens_per_sec"] == pytest.approx(TOKENS / STEP_S, rel=1e-9)


def test_host_schedule_value_runs_on_the_cpu(monkeypatch):
    # On this CPU-only machine the default device is the CPU anyway: what is checked is that
    # the schedule runs under jax.default_device(the CPU device).
    placed, real = [], jax.default_device

    def default_device(device):
        placed.append(device)
        return real(device)

    monkeypatch.setattr(jax, "default_device", default_device)
    calls = []

    def schedule(step):
        calls.append(placed[-1] if placed else None)
        return 0.5 * step

    assert progress_module.host_schedule_value(schedule, 3) == 1.5
    assert calls == [jax.local_devices(backend="cpu")[0]]

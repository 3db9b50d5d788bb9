"""The cost of the trainer's telemetry: seconds per train step with ``telemetry`` off and on.

    python benchmarks/telemetry_cost.py configs/default.yaml steps=200 --steps 20 --rounds 5

Prints JSON: per program the median round's seconds per step, each round, the compile time,
XLA's temporary bytes and the last metrics, and the overhead of each program against the first
(docs/telemetry.md holds the measurements).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from coat_jax.training.config import TrainConfig, load_config  # noqa: E402
from coat_jax.training.program import build_program  # noqa: E402
from coat_jax.training.telemetry import logged_metrics  # noqa: E402


def benchmark(cfg: TrainConfig, *, steps: int = 20, rounds: int = 5, together: bool = True) -> dict:
    """Seconds per train step of ``cfg`` with telemetry off and on.

    Builds the trainer's program (``build_program``) twice: ``"off"`` (no telemetry) and
    ``"on"`` (``telemetry: true``: the optimizer state's and, for FP8 activations, the
    activation telemetry). From the same parameters and tokens it times ``rounds`` rounds of
    ``steps`` steps of each: alternating (``together``, so a machine's varying load hits both
    alike), or one program after the other, freeing the first (a model whose two states do not
    fit at once). Each step is blocked on: step latencies. Returns per program the median
    round's seconds per step (wall clock, and the process's CPU time, which a busy machine
    disturbs less), each round, the compile time, XLA's temporary bytes and the last metrics;
    ``overhead_step_s`` and ``overhead_step_cpu_s``: "on" against "off".
    """
    runs = {}
    for name in ("off", "on"):
        runs[name] = _BenchRun(dataclasses.replace(cfg, telemetry=name == "on"))
        if not together:
            for _ in range(rounds):
                runs[name].round(steps)
            runs[name].free()
    if together:
        for _ in range(rounds):
            for run in runs.values():
                run.round(steps)
    result = {name: run.summary() for name, run in runs.items()}
    for key in ("step_s", "step_cpu_s"):
        result[f"overhead_{key}"] = result["on"][key] / result["off"][key] - 1
    return result


class _BenchRun:
    """One compiled train step of :func:`benchmark`, its state and its timings."""

    def __init__(self, cfg: TrainConfig):
        program = build_program(cfg, cfg.model)
        params = program.init_params(jax.random.key(cfg.seed))
        opt_state = program.init_opt_state(params)
        tokens = np.random.default_rng(cfg.seed).integers(
            0, cfg.model.vocab_size, program.abstract_batch().shape, dtype=np.int32
        )
        self.tokens = jax.device_put(tokens, program.batch_sharding)
        start = time.perf_counter()
        self.compiled = program.step_fn.lower(params, opt_state, self.tokens).compile()
        self.compile_s = time.perf_counter() - start
        memory = self.compiled.memory_analysis()
        self.temp_bytes = None if memory is None else int(memory.temp_size_in_bytes)
        self.state = (params, opt_state)
        self.metrics = self.step()
        self.wall, self.cpu = [], []

    def step(self):
        params, opt_state, metrics = self.compiled(*self.state, self.tokens)
        jax.block_until_ready((params, opt_state, metrics))
        self.state = (params, opt_state)
        return metrics

    def round(self, steps: int) -> None:
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            self.metrics = self.step()
        self.wall.append((time.perf_counter() - start) / steps)
        self.cpu.append((time.process_time() - cpu) / steps)

    def free(self) -> None:
        self.state = self.compiled = None

    def summary(self) -> dict:
        return {
            "step_s": float(np.median(self.wall)),
            "step_cpu_s": float(np.median(self.cpu)),
            "rounds_s": self.wall,
            "compile_s": self.compile_s,
            "temp_bytes": self.temp_bytes,
            "metrics": {
                k: np.asarray(v).item()
                for k, v in logged_metrics(jax.device_get(self.metrics)).items()
            },
        }


def main(argv=None) -> None:
    """The cost of the telemetry (:func:`benchmark`), printed as JSON.

    ``python benchmarks/telemetry_cost.py [CONFIG] [key=value ...] [--steps N] [--rounds R]
    [--one-at-a-time]``.
    """
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("config", nargs="?", default=None)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of each program")
    parser.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="time one program, free it, then the other (a model whose two states do not fit)",
    )
    args = parser.parse_args(argv)
    if args.config is not None and "=" in args.config:
        args.overrides.insert(0, args.config)
        args.config = None
    cfg = load_config(args.config, args.overrides)
    result = benchmark(
        cfg,
        steps=args.steps,
        rounds=args.rounds,
        together=not args.one_at_a_time,
    )
    result["device"] = str(jax.devices()[0].device_kind)
    result["config"] = {"config": args.config, "overrides": args.overrides}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

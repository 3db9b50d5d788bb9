"""What a checkpoint costs the training loop: train.py's own step and its own checkpointer.

The state, the step and the checkpointer are the trainer's: the config is loaded with
``coat_jax.training.load_config`` (``configs/llama2_7b.yaml``, or the tiny model with ``--tiny``),
the program comes from ``coat_jax.training.program.build_program`` and the saves go through
``coat_jax.training.checkpoint.Checkpointer`` exactly as ``train.py`` calls it. Timed, in
one process:

1. the step alone (median of ``--reps`` steps, each ended by reading its loss);
2. the parts of a save that block the loop, apart: the jitted finiteness check and checksums
   (``_save_summary``: first call, compile included, then warm), a plain ``jax.device_get`` of the
   whole state (what a copy to host memory costs on this machine), and ``Checkpointer.save``
   (summary, space check and Orbax up to the point where it holds a host copy);
3. the steps that run while Orbax writes in the background, and the wait for the rest;
4. the same save a second time (``--saves``; the checkpoint before it is deleted first, so a
   disk that holds one checkpoint is enough), which is what every periodic save after the first
   costs.

The report gives the overhead per step of a checkpoint every N steps,
``(blocking + extra time of the steps during the write) / (N x step)``, and the smallest N
within 5%.

    python benchmarks/bench_checkpoint.py --tiny                 # CPU smoke test
    python benchmarks/bench_checkpoint.py --out-dir /tmp/ck       # one H200, Llama-2-7B
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
from bench_e2e import trainer_config  # noqa: E402


def _orbax_version() -> str:
    import orbax.checkpoint as ocp

    return getattr(ocp, "__version__", "?")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setting", default="coat:scan:activations", help="mode:layout:remat[:k=v+..]")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--reps", type=int, default=10, help="steps timed without a save")
    p.add_argument("--steps-during", type=int, default=40, help="steps timed while a save writes")
    p.add_argument("--saves", type=int, default=2, help="saves timed one after another")
    p.add_argument("--out-dir", default="runs/bench_checkpoint", help="checkpoints and records")
    p.add_argument("--tiny", action="store_true", help="tiny model on the CPU (smoke test)")
    args = p.parse_args(argv)
    if args.tiny:
        args.seq = min(args.seq, 64)
        args.reps = min(args.reps, 3)
        args.steps_during = min(args.steps_during, 3)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    from bench_e2e import parse_settings

    from coat_jax.training import checkpoint as ck
    from coat_jax.training.program import build_program

    mode, layout, remat, extra = parse_settings(args.setting)[0]
    cfg = trainer_config(mode, layout, remat, extra, seq=args.seq, batch=args.batch, tiny=args.tiny)
    program = build_program(cfg, cfg.model)
    os.makedirs(args.out_dir, exist_ok=True)
    jsonl = os.path.join(args.out_dir, "checkpoint.jsonl")
    env = C.environment()
    rec = {"setting": args.setting, "batch": args.batch, "seq": args.seq, **env}

    def say(what, **fields):
        rec.update(fields)
        print(f"[bench_checkpoint] {what}: {fields}", flush=True)

    t0 = time.perf_counter()
    params = program.init_params(jax.random.key(cfg.seed))
    opt_state = program.init_opt_state(params)
    jax.block_until_ready((params, opt_state))
    state_bytes = ck.state_bytes({"params": params, "opt_state": opt_state})
    leaves = len(jax.tree.leaves((params, opt_state)))
    say("init", init_s=round(time.perf_counter() - t0, 2), state_bytes=state_bytes, leaves=leaves)

    tokens = jax.random.randint(
        jax.random.key(1), (1, args.batch, args.seq + 1), 0, cfg.model.vocab_size, jnp.int32
    )
    tokens = jax.device_put(tokens, program.batch_sharding)
    t0 = time.perf_counter()
    step = program.step_fn.lower(params, opt_state, tokens).compile()
    say("compile", compile_s=round(time.perf_counter() - t0, 2))

    def one_step() -> float:
        nonlocal params, opt_state
        t = time.perf_counter()
        params, opt_state, metrics = step(params, opt_state, tokens)
        float(metrics["loss"])  # waits for the step
        return time.perf_counter() - t

    for _ in range(2):
        one_step()
    alone = [one_step() for _ in range(args.reps)]
    step_s = statistics.median(alone)
    say("steps without a save", step_s=round(step_s, 5), step_min_s=round(min(alone), 5))

    def state():
        return {"params": params, "opt_state": opt_state}

    t = time.perf_counter()
    jax.device_get(ck._save_summary(state()))
    first = time.perf_counter() - t
    t = time.perf_counter()
    jax.device_get(ck._save_summary(state()))
    warm = time.perf_counter() - t
    say("summary", summary_first_s=round(first, 3), summary_warm_s=round(warm, 3))

    # What a copy of the state to host memory costs, by way: pinned host memory through XLA
    # (``jax.device_put`` to the ``pinned_host`` memory kind, which Orbax uses on GPUs), then the
    # copy of those buffers into numpy arrays (what Orbax hands to TensorStore). Not
    # ``jax.device_get(state)``: it caches the host copy on the arrays themselves.
    import numpy as np

    transfers = {}
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    say("memory kinds", memory_kinds=sorted(kinds), orbax=_orbax_version())
    if "pinned_host" in kinds:
        to_pinned = jax.tree.map(lambda x: x.sharding.with_memory_kind("pinned_host"), state())
        for i in range(2):
            t = time.perf_counter()
            pinned = jax.block_until_ready(jax.device_put(state(), to_pinned))
            transfers[f"pinned_{i + 1}_s"] = round(time.perf_counter() - t, 3)
            t = time.perf_counter()
            host = [np.asarray(x) for x in jax.tree.leaves(pinned)]
            transfers[f"pinned_to_numpy_{i + 1}_s"] = round(time.perf_counter() - t, 3)
            del host, pinned
    one_step()  # fresh state arrays, nothing cached on them
    t = time.perf_counter()
    host = [np.asarray(x) for x in jax.tree.leaves(jax.tree.map(jnp.copy, state()))]
    transfers["pageable_s"] = round(time.perf_counter() - t, 3)
    del host
    say("copies to host", **transfers, gb=round(state_bytes / 1e9, 2))

    root = os.path.join(args.out_dir, "run")
    shutil.rmtree(root, ignore_errors=True)
    manager = ck.Checkpointer(root, keep=1, fingerprint={"bench": "checkpoint"})
    saves = []
    for i in range(args.saves):
        manager.delete_all()
        t = time.perf_counter()
        manager.save(1000 + i, state(), data_position=0, seed=cfg.seed)
        blocking = time.perf_counter() - t
        during = [one_step() for _ in range(args.steps_during)]
        t = time.perf_counter()
        manager.wait()
        rest = time.perf_counter() - t
        extra_s = sum(during) - len(during) * step_s
        saves.append(
            {
                "save": i + 1,
                "blocking_s": round(blocking, 3),
                "steps_during": len(during),
                "step_during_s": round(statistics.median(during), 5),
                "extra_during_s": round(extra_s, 3),
                "wait_after_s": round(rest, 3),
            }
        )
        say(f"save {i + 1}", **saves[-1])
    manager.close()
    shutil.rmtree(root, ignore_errors=True)
    rec["saves"] = saves
    C.append_jsonl(jsonl, rec)

    # The steady cost is the last save's: every periodic save after the first one.
    last = saves[-1]
    # A write that outlasts the steps timed during it also costs its wait (the loop waits for
    # the save in flight before the next one): counted when the interval is that short.
    cost = last["blocking_s"] + max(last["extra_during_s"], 0.0)
    need = math.ceil(cost / (0.05 * step_s)) if step_s > 0 else None
    print()
    print(
        "| save | blocks the loop (s) | step during the write (s) | extra over the steps (s) | wait after (s) |"
    )
    print("|---|---|---|---|---|")
    for s in saves:
        print(
            f"| {s['save']} | {s['blocking_s']:.3f} | {s['step_during_s']:.5f} | "
            f"{s['extra_during_s']:.3f} | {s['wait_after_s']:.3f} |"
        )
    print(
        f"\nstep {step_s:.5f} s; summary first {first:.3f} s, warm {warm:.3f} s; copies to host "
        f"{transfers} for {state_bytes / 2**30:.2f} GiB; "
        f"a save every N steps costs {cost:.3f} / (N x {step_s:.5f} s): within 5% from N = {need}"
    )
    rec["steady_cost_s"], rec["interval_for_5pct"] = round(cost, 3), need
    print(json.dumps({"interval_for_5pct": need, "steady_cost_s": round(cost, 3)}))
    return rec


if __name__ == "__main__":
    main()

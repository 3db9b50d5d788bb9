"""One Llama-2-7B decoder layer, forward + backward: bf16 vs fp8 vs COAT side by side (issue 7).

The layer is the trainer's own model (``configs/llama2_7b.yaml`` with ``num_hidden_layers=1``,
built by ``coat_jax.training.loop.build_program``; hidden 4096, intermediate 11008, 32 heads):
its ``Llama.decoder`` under the config's layout and remat policy (``--scan``, ``--remat``), with
float32 master weights and bfloat16 activations, at seq 2048 and each ``--batches`` value. The
timed function is ``x, dy -> jax.vjp(layer, params, x)[1](dy)`` (forward, then backward into the
weights and the input), jitted, after a warm-up, the median of ``--reps`` calls, each ending in
``block_until_ready``.

Per mode and batch:

* time (ms) and model TFLOP/s (6 FLOPs per weight per token + causal attention 6*T*d per token);
* activations kept for backward in U = batch*seq*hidden*2 bytes: the residuals of ``jax.vjp``
  (``coat_jax.residuals`` under ``jax.make_jaxpr``/``jax.eval_shape``) that depend on the input;
* XLA's ``compiled.memory_analysis()`` (arguments + outputs + temporaries) and the allocator's
  ``peak_bytes_in_use`` (each mode in a fresh subprocess, batches in increasing order, so the peak
  read after a batch is that batch's);
* FP8 GEMMs in the compiled HLO (custom calls ``__cublas$lt$matmul$f8``).

    python benchmarks/bench_layer.py --tiny                    # CPU smoke test
    python benchmarks/bench_layer.py --out-dir runs/layer --docs docs/bench_layer.md   # one H200
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

MODES = ("bf16", "fp8", "coat")
PAPER_U = {"bf16": 22.66, "fp8": 18.33, "coat": 13.33}  # COAT Table 2 (PyTorch, TE for fp8)


def layer_overrides(tiny: bool) -> dict:
    """The model section of configs/llama2_7b.yaml cut to one layer (or a small one, --tiny)."""
    if tiny:
        return {
            "vocab_size": 256,
            "hidden_size": 128,
            "intermediate_size": 352,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 32,
        }
    return {"num_hidden_layers": 1}


def layer_flops(config, batch: int, seq: int) -> float:
    d, f = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * config.head_dim
    weights = 2 * d * d + 2 * d * kv + 3 * d * f
    tokens = batch * seq
    return 6.0 * weights * tokens + 6.0 * d * seq * tokens


def worker(args) -> None:
    import jax
    import jax.numpy as jnp

    from coat_jax.memory import residuals
    from coat_jax.training import load_config
    from coat_jax.training.loop import build_program

    mode, seq = args.worker, args.seq
    env = C.environment()
    # The trainer's own model with one decoder layer: what train.py runs, layer by layer.
    overrides = [
        f"precision={mode}",
        "optimizer=adamw",
        f"scan_layers={str(args.scan).lower()}",
        f"remat={args.remat}",
        f"seq_len={seq}",
        "mesh.data=1",
        "mesh.fsdp=1",
        "compilation_cache_dir=null",
        *(f"model.{k}={v}" for k, v in layer_overrides(args.tiny).items()),
    ]
    cfg = load_config(os.path.join(ROOT, "configs", "llama2_7b.yaml"), overrides)
    config = cfg.model
    program = build_program(cfg, config)
    model_def = program.model_def

    def apply(params, x_BTD):
        b, t = x_BTD.shape[:2]
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        return model_def.bind(params).decoder(x_BTD, positions)

    def init(key):
        return program.init_params(key)

    @jax.jit
    def fwd_bwd(params, x_BTD, dy_BTD):
        _, pullback = jax.vjp(apply, params, x_BTD)
        return pullback(dy_BTD)

    params = init(jax.random.key(0))
    abstract_params = program.model_def.abstract_params
    for batch in sorted(args.batches):
        shape = (batch, seq, config.hidden_size)
        u = batch * seq * config.hidden_size * 2
        xs = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
        kept = [
            r for r in residuals(apply, abstract_params, xs, param_argnums=(0,)) if r.is_activation
        ]
        by_dtype: dict[str, int] = {}
        for r in kept:
            by_dtype[r.dtype.name] = by_dtype.get(r.dtype.name, 0) + r.nbytes
        act = sum(by_dtype.values())
        t0 = time.perf_counter()
        compiled = fwd_bwd.lower(abstract_params, xs, xs).compile()
        compile_s = time.perf_counter() - t0
        mem = C.compiled_memory(compiled)
        hlo = compiled.as_text() or ""
        calls = C.custom_call_counts(hlo)
        kx, kdy = jax.random.split(jax.random.key(batch))
        x = jax.random.normal(kx, shape, jnp.bfloat16)
        dy = jax.random.normal(kdy, shape, jnp.bfloat16)
        try:
            timing = C.time_fn(
                lambda c=compiled, x=x, dy=dy: jax.block_until_ready(c(params, x, dy)),
                warmup=args.warmup,
                reps=args.reps,
            )
        except Exception as e:  # noqa: BLE001 - XlaRuntimeError's class moves between versions
            if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
                raise
            C.append_jsonl(args.jsonl, {"kind": "oom", "mode": mode, "batch": batch, **env})
            print(f"[{mode}] batch {batch}: out of memory")
            break
        stats = C.memory_stats()
        rec = {
            "kind": "layer",
            "mode": mode,
            "remat": args.remat,
            "scan": args.scan,
            "batch": batch,
            "seq": seq,
            **env,
            "time": timing,
            "tflops": layer_flops(config, batch, seq) / timing["median_s"] / 1e12,
            "activation_bytes": act,
            "activation_U": act / u,
            "activation_U_by_dtype": {k: v / u for k, v in by_dtype.items()},
            "compiled_memory": mem,
            "compile_s": round(compile_s, 1),
            "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
            "fp8_gemms": calls.get(C.FP8_GEMM_TARGET, 0),
            "hlo_calls": calls,
            "hlo_ops": C.hlo_op_counts(hlo),
        }
        C.append_jsonl(args.jsonl, rec)
        print(
            f"[{mode}] batch {batch}: {timing['median_s'] * 1e3:.2f} ms, "
            f"{rec['tflops']:.0f} TFLOP/s, act {rec['activation_U']:.2f}U, "
            f"compiled peak {C.gib(mem.get('peak'))} GiB, "
            f"peak_bytes_in_use {C.gib(stats.get('peak_bytes_in_use'))} GiB, "
            f"FP8 GEMMs {rec['fp8_gemms']}, custom calls {calls}",
            flush=True,
        )


def write_docs(path: str | None, records: list[dict], command: str) -> str:
    rows = [r for r in records if r["kind"] == "layer"]
    lines = ["# One Llama-2-7B decoder layer, forward + backward (issue 7)", ""]
    if rows:
        r0 = rows[0]
        lines += [
            f"Measured {r0['date']} on {r0['device']} with JAX {r0['jax']}, by `{command}`.",
            f"Layer: `Llama.decoder` of train.py's model with one layer (`build_program`), "
            f"remat `{r0.get('remat', 'none')}`, seq {r0['seq']}, float32 master weights, "
            "bfloat16 activations; each mode in its own process. Time: median of the jitted "
            "`jax.vjp` forward + backward (weights and input gradients). U = batch x seq x "
            "hidden x 2 bytes; activations are the `jax.vjp` residuals that depend on the "
            "input (on the GPU attention is cuDNN's, which also keeps its output and "
            "log-sum-exp).",
            "",
        ]
    lines += [
        "| batch | mode | time (ms) | TFLOP/s | speed vs bf16 | activations (U) | paper U "
        "| act. vs bf16 | compiled peak (GiB) | peak_bytes_in_use (GiB) | FP8 GEMMs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {r["batch"]: r for r in rows if r["mode"] == "bf16"}
    for batch in sorted({r["batch"] for r in rows}):
        for mode in MODES:
            r = next((x for x in rows if x["batch"] == batch and x["mode"] == mode), None)
            if r is None:
                lines.append(f"| {batch} | {mode} | not measured | | | | | | | | |")
                continue
            b = base.get(batch)
            speed = C.ratio(b["time"]["median_s"], r["time"]["median_s"]) if b else "n/a"
            act_ratio = C.ratio(b["activation_bytes"], r["activation_bytes"]) if b else "n/a"
            lines.append(
                f"| {batch} | {mode} | {r['time']['median_s'] * 1e3:.2f} | {r['tflops']:.0f} | "
                f"{speed} | {r['activation_U']:.2f} | {PAPER_U[mode]} | {act_ratio} | "
                f"{C.gib(r['compiled_memory'].get('peak'))} | {C.gib(r['peak_bytes_in_use'])} | "
                f"{r['fp8_gemms']} |"
            )
    ooms = [r for r in records if r["kind"] == "oom"]
    if ooms:
        lines += [""] + [f"- {r['mode']} batch {r['batch']}: out of memory" for r in ooms]
    if rows:
        lines += ["", "Custom calls in the compiled step (first batch):", ""]
        first = min(r["batch"] for r in rows)
        for r in rows:
            if r["batch"] == first:
                lines.append(f"- {r['mode']}: {r['hlo_calls']}")
        lines += ["", "Activations by dtype (U, first batch):", ""]
        for r in rows:
            if r["batch"] == first:
                parts = ", ".join(f"{k} {v:.3f}" for k, v in r["activation_U_by_dtype"].items())
                lines.append(f"- {r['mode']}: {parts}")
    text = "\n".join(lines) + "\n"
    if path:
        with open(path, "w") as f:
            f.write(text)
    return text


def report(args, jsonl: str) -> None:
    """Rewrites the docs from a finished (or cut short) run's records."""
    records = C.read_jsonl(jsonl)
    if not records:
        raise ValueError(f"no records in {jsonl}")
    cmds = [r["command"] for r in records if r["kind"] == "command"]
    print(write_docs(args.docs, records, cmds[-1] if cmds else "unknown"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--batches", default=None, help="comma-separated (4,8; 2 with --tiny)")
    p.add_argument("--seq", type=int, default=None, help="2048 (64 with --tiny)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="a small layer on the CPU: a smoke test")
    p.add_argument("--remat", default="none", help="remat policy of the layer (REMAT_POLICIES)")
    p.add_argument("--scan", action="store_true", help="the scanned layer layout")
    p.add_argument("--child-timeout-s", type=float, default=240.0)
    p.add_argument("--out-dir", default="runs/bench_layer")
    p.add_argument("--docs", default=None)
    p.add_argument("--no-child-logs", action="store_true", help="no per-mode log files")
    p.add_argument(
        "--report-only", action="store_true", help="only rewrite --docs/--plot from out-dir"
    )
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--jsonl", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.seq is None:
        args.seq = 64 if args.tiny else 2048
    if args.batches is None:
        args.batches = "2" if args.tiny else "4,8"
    try:
        args.batches = [int(b) for b in str(args.batches).split(",")]
    except ValueError:
        raise ValueError(f"--batches must be comma-separated ints, got {args.batches!r}") from None
    if any(b <= 0 for b in args.batches):
        raise ValueError(f"--batches must be positive, got {args.batches}")
    if args.worker:
        worker(args)
        return
    modes = C.parse_modes(args.modes, MODES)
    os.makedirs(args.out_dir, exist_ok=True)
    jsonl = os.path.join(args.out_dir, "layer.jsonl")
    if args.report_only:
        return report(args, jsonl)
    command = C.command_line()
    C.append_jsonl(jsonl, {"kind": "command", "command": command})
    for mode in modes:
        child = (
            [
                os.path.abspath(__file__),
                f"--worker={mode}",
                f"--batches={','.join(map(str, args.batches))}",
                f"--seq={args.seq}",
                f"--reps={args.reps}",
                f"--warmup={args.warmup}",
                f"--jsonl={jsonl}",
                f"--remat={args.remat}",
            ]
            + (["--tiny"] if args.tiny else [])
            + (["--scan"] if args.scan else [])
        )
        rc = C.run_child(
            child,
            timeout_s=args.child_timeout_s,
            log_path=None
            if args.no_child_logs
            else os.path.join(args.out_dir, f"layer_{mode}.log"),
        )
        if rc:
            print(f"[parent] {mode} exited with {rc}; continuing with what it recorded")
        text = write_docs(args.docs, C.read_jsonl(jsonl), command)
    print(text)


if __name__ == "__main__":
    main()

"""One Llama-2-7B decoder layer, forward + backward: bf16 vs fp8 vs COAT side by side.

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
* FP8 GEMMs in the compiled HLO (custom calls ``__cublas$lt$matmul$f8``);
* kernels per layer step: the instructions of the compiled HLO that launch work, counted in the
  computations that run (the entry and the scan's while bodies, not the fused computations
  inside a fusion), by opcode (fusions, custom calls: GEMMs, attention, Pallas kernels, copies,
  ...), and how many of them write a transposed FP8 array (``fp8 transposes``).

``--weight-residual master,fp8`` runs the fp8 and coat modes once per
``FP8Config.weight_residual`` option (the trainer's ``fp8_weight_residual``): ``master``
re-quantizes each float32 weight in backward, ``fp8`` keeps forward's E4M3 codes for it
(docs/memory_options.md, "FP8 weight codes"). bf16 has no FP8 weights and runs once.

    python benchmarks/bench_layer.py --tiny --weight-residual master,fp8    # CPU smoke test
    python benchmarks/bench_layer.py --out-dir runs/layer --docs docs/bench_layer.md   # one H200
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import sys
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

MODES = ("bf16", "fp8", "coat")
PAPER_U = {"bf16": 22.66, "fp8": 18.33, "coat": 13.33}  # COAT Table 2 (PyTorch, TE for fp8)
WEIGHT_RESIDUALS = ("master", "fp8")  # coat_jax.fp8_ops.WEIGHT_RESIDUALS (no JAX import here)
# Instructions that launch no kernel of their own: bookkeeping, control flow (its bodies are
# counted instead), and the second half of async pairs.
NOT_KERNELS = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "while",
    "conditional",
    "call",
    "after-all",
    "add-dependency",
    "opt-barrier",
    "partition-id",
    "replica-id",
    "domain",
}
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")


def _computations(hlo: str) -> tuple[dict[str, list[tuple[str, str, str]]], str | None]:
    """Compiled HLO text -> ({computation: [(type, opcode, rest of line)]}, entry name)."""
    comps: dict[str, list[tuple[str, str, str]]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        if current is None:
            m = _COMPUTATION.match(line)
            if m and not line.startswith("HloModule"):
                current = m.group(2)
                comps[current] = []
                entry = current if m.group(1) else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if m:
            comps[current].append((m.group(2), m.group(3), m.group(4)))
    return comps, entry


def kernel_counts(hlo: str) -> dict:
    """Kernels one run of a compiled executable launches (a static count, from its HLO text).

    Counts the instructions of the computations that run as a schedule (the entry, and through
    ``while``/``conditional``/``call`` their bodies, each once: a one-layer scan runs its body
    once), skipping :data:`NOT_KERNELS` and the ``-done`` halves of async pairs; fused
    computations and reducers are inside their kernel and not counted. Returns
    ``{"total": n, "by_opcode": {...}, "fp8_transposes": m}``, where ``fp8_transposes`` counts
    the kernels whose result is an FP8 array and that are, or fuse, a ``transpose``.
    """
    comps, entry = _computations(hlo)
    if entry is None:
        return {"total": 0, "by_opcode": {}, "fp8_transposes": 0}
    scheduled, todo = set(), [entry]
    while todo:
        name = todo.pop()
        if name in scheduled or name not in comps:
            continue
        scheduled.add(name)
        for _, opcode, rest in comps[name]:
            if opcode in ("while", "conditional", "call"):
                todo += re.findall(
                    r"(?:body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)",
                    rest,
                )
                for group in re.findall(r"branch_computations=\{([^}]*)\}", rest):
                    todo += [b.strip().lstrip("%") for b in group.split(",")]
    by_opcode: Counter = Counter()
    fp8_transposes = 0
    for name in scheduled:
        for type_, opcode, rest in comps[name]:
            if opcode in NOT_KERNELS or opcode.endswith("-done"):
                continue
            by_opcode[opcode] += 1
            if not type_.lstrip("(").startswith("f8"):
                continue
            called = re.findall(r"calls=%?([\w.\-]+)", rest)
            if opcode == "transpose" or any(
                op == "transpose" for c in called for _, op, _ in comps.get(c, [])
            ):
                fp8_transposes += 1
    return {
        "total": sum(by_opcode.values()),
        "by_opcode": dict(by_opcode.most_common()),
        "fp8_transposes": fp8_transposes,
    }


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
    weight_residual = args.weight_residual if mode != "bf16" else "master"
    label = mode if mode == "bf16" else f"{mode}/{weight_residual}"
    env = C.environment()
    # The trainer's own model with one decoder layer: what train.py runs, layer by layer.
    overrides = [
        f"precision={mode}",
        "optimizer=adamw",
        f"scan_layers={str(args.scan).lower()}",
        f"remat={args.remat}",
        f"fp8_weight_residual={weight_residual}",
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

    def apply(params, x_BTD, weight_residual=None):
        b, t = x_BTD.shape[:2]
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        model = model_def.bind(params)
        if weight_residual is not None:  # the same layer with another FP8Config option
            model.fp8_config = dataclasses.replace(
                model.fp8_config, weight_residual=weight_residual
            )
        return model.decoder(x_BTD, positions)

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
        # Activations are those of the "master" variant: both options keep the same ones
        # (tests/test_scan_remat.py), and through a scan every residual counts as dependent on
        # the input, weight codes included. The FP8 weight codes "fp8" keeps are the FP8
        # residual bytes it holds beyond master's (master keeps float32 weight references).
        res_master = residuals(
            functools.partial(apply, weight_residual="master"),
            abstract_params,
            xs,
            param_argnums=(0,),
        )
        by_dtype: dict[str, int] = {}
        for r in res_master:
            if r.is_activation:
                by_dtype[r.dtype.name] = by_dtype.get(r.dtype.name, 0) + r.nbytes
        act = sum(by_dtype.values())
        weight_codes = 0
        if weight_residual != "master":
            res = residuals(apply, abstract_params, xs, param_argnums=(0,))
            fp8_bytes = lambda rs: sum(r.nbytes for r in rs if r.dtype.itemsize == 1)
            weight_codes = fp8_bytes(res) - fp8_bytes(res_master)
        t0 = time.perf_counter()
        compiled = fwd_bwd.lower(abstract_params, xs, xs).compile()
        compile_s = time.perf_counter() - t0
        mem = C.compiled_memory(compiled)
        hlo = compiled.as_text() or ""
        calls = C.custom_call_counts(hlo)
        kernels = kernel_counts(hlo)
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
            C.append_jsonl(
                args.jsonl,
                {
                    "kind": "oom",
                    "mode": mode,
                    "weight_residual": weight_residual,
                    "batch": batch,
                    **env,
                },
            )
            print(f"[{label}] batch {batch}: out of memory")
            break
        stats = C.memory_stats()
        rec = {
            "kind": "layer",
            "mode": mode,
            "weight_residual": weight_residual,
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
            "weight_code_bytes": weight_codes,
            "compiled_memory": mem,
            "compile_s": round(compile_s, 1),
            "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
            "fp8_gemms": calls.get(C.FP8_GEMM_TARGET, 0),
            "hlo_calls": calls,
            "hlo_ops": C.hlo_op_counts(hlo),
            "kernels": kernels,
        }
        C.append_jsonl(args.jsonl, rec)
        print(
            f"[{label}] batch {batch}: "
            f"{timing['median_s'] * 1e3:.2f} ms per layer step, "
            f"{rec['tflops']:.0f} TFLOP/s, act {rec['activation_U']:.2f}U, "
            f"FP8 weight codes kept {_mib(weight_codes)} MiB, "
            f"compiled peak {C.gib(mem.get('peak'))} GiB, "
            f"peak_bytes_in_use {C.gib(stats.get('peak_bytes_in_use'))} GiB, "
            f"FP8 GEMMs {rec['fp8_gemms']}, kernels {kernels['total']} "
            f"(fp8 transposes {kernels['fp8_transposes']}) {kernels['by_opcode']}, "
            f"custom calls {calls}",
            flush=True,
        )


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f}"


def _variant(r: dict) -> str:
    """A record's mode with its weight residual (``coat``, ``coat/fp8``; bf16 has none)."""
    wr = r.get("weight_residual", "master")
    return r["mode"] if r["mode"] == "bf16" else f"{r['mode']}/{wr}"


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
            "log-sum-exp). Mode `coat/fp8` is `coat` with `fp8_weight_residual=fp8` (forward's "
            "FP8 weight codes kept for backward, their bytes in `weight codes kept`), "
            "`coat/master` the default. Kernels: launches of one fwd+bwd step, counted in the "
            "compiled HLO (`kernel_counts`).",
            "",
        ]
    lines += [
        "| batch | mode | time (ms) | TFLOP/s | speed vs bf16 | activations (U) | paper U "
        "| act. vs bf16 | weight codes kept (MiB) | compiled peak (GiB) | peak_bytes_in_use (GiB) "
        "| FP8 GEMMs | kernels | fp8 transposes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {r["batch"]: r for r in rows if r["mode"] == "bf16"}
    variants = sorted({_variant(r) for r in rows}, key=lambda v: (MODES.index(v.split("/")[0]), v))
    for batch in sorted({r["batch"] for r in rows}):
        for variant in variants:
            r = next((x for x in rows if x["batch"] == batch and _variant(x) == variant), None)
            if r is None:
                lines.append(f"| {batch} | {variant} | not measured |" + " |" * 11)
                continue
            b = base.get(batch)
            speed = C.ratio(b["time"]["median_s"], r["time"]["median_s"]) if b else "n/a"
            act_ratio = C.ratio(b["activation_bytes"], r["activation_bytes"]) if b else "n/a"
            kernels = r.get("kernels", {})
            lines.append(
                f"| {batch} | {variant} | {r['time']['median_s'] * 1e3:.2f} | {r['tflops']:.0f} | "
                f"{speed} | {r['activation_U']:.2f} | {PAPER_U[r['mode']]} | {act_ratio} | "
                f"{_mib(r.get('weight_code_bytes'))} | "
                f"{C.gib(r['compiled_memory'].get('peak'))} | {C.gib(r['peak_bytes_in_use'])} | "
                f"{r['fp8_gemms']} | {kernels.get('total', 'n/a')} | "
                f"{kernels.get('fp8_transposes', 'n/a')} |"
            )
    ooms = [r for r in records if r["kind"] == "oom"]
    if ooms:
        lines += [""] + [f"- {_variant(r)} batch {r['batch']}: out of memory" for r in ooms]
    if rows:
        first = min(r["batch"] for r in rows)
        lines += ["", "Custom calls in the compiled step (first batch):", ""]
        for r in rows:
            if r["batch"] == first:
                lines.append(f"- {_variant(r)}: {r['hlo_calls']}")
        lines += ["", "Kernels by opcode (first batch):", ""]
        for r in rows:
            if r["batch"] == first and "kernels" in r:
                lines.append(f"- {_variant(r)}: {r['kernels']['by_opcode']}")
        lines += ["", "Activations by dtype (U, first batch):", ""]
        for r in rows:
            if r["batch"] == first:
                parts = ", ".join(f"{k} {v:.3f}" for k, v in r["activation_U_by_dtype"].items())
                lines.append(f"- {_variant(r)}: {parts}")
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
    p.add_argument(
        "--weight-residual",
        default="master",
        help="comma-separated FP8Config.weight_residual options for the fp8 and coat modes "
        "(master: backward re-quantizes the weights; fp8: keeps forward's FP8 codes)",
    )
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
    weight_residuals = [w.strip() for w in args.weight_residual.split(",") if w.strip()]
    if not weight_residuals or any(w not in WEIGHT_RESIDUALS for w in weight_residuals):
        raise ValueError(
            f"--weight-residual must be a comma-separated list of {list(WEIGHT_RESIDUALS)}, "
            f"got {args.weight_residual!r}"
        )
    if args.worker:
        if len(weight_residuals) != 1:
            raise ValueError("a worker runs one --weight-residual option")
        args.weight_residual = weight_residuals[0]
        worker(args)
        return
    modes = C.parse_modes(args.modes, MODES)
    os.makedirs(args.out_dir, exist_ok=True)
    jsonl = os.path.join(args.out_dir, "layer.jsonl")
    if args.report_only:
        return report(args, jsonl)
    command = C.command_line()
    C.append_jsonl(jsonl, {"kind": "command", "command": command})
    text = ""
    for mode in modes:
        for weight_residual in weight_residuals if mode != "bf16" else ["master"]:
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
                    f"--weight-residual={weight_residual}",
                ]
                + (["--tiny"] if args.tiny else [])
                + (["--scan"] if args.scan else [])
            )
            name = mode if mode == "bf16" else f"{mode}_{weight_residual}"
            rc = C.run_child(
                child,
                timeout_s=args.child_timeout_s,
                log_path=None
                if args.no_child_logs
                else os.path.join(args.out_dir, f"layer_{name}.log"),
            )
            if rc:
                print(f"[parent] {name} exited with {rc}; continuing with what it recorded")
            text = write_docs(args.docs, C.read_jsonl(jsonl), command)
    print(text)


if __name__ == "__main__":
    main()

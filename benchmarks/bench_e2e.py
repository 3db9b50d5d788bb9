"""train.py's own training step, Llama-2-7B on one GPU: each precision at its best setting.

What is timed is what ``python train.py --config configs/llama2_7b.yaml`` runs: the config is
loaded with ``coat_jax.training.load_config`` and the model, optimizer (with the config's
schedule, gradient clipping and weight-decay mask), shardings and jitted step come from
``coat_jax.training.program.build_program``; nothing here builds a model of its own.

A *setting* is ``mode:layout:remat``: the precision (``bf16`` + ``optax.adamw``, ``fp8`` +
``optax.adamw``, ``coat`` + ``coat_adamw``), the layer layout (``scan`` or ``unrolled``, the
config's ``scan_layers``) and the remat policy (``coat_jax.llama.REMAT_POLICIES``, the config's
``remat``). Each setting runs in its own process, so the allocator's ``peak_bytes_in_use`` is its
own. Per setting: init and compile seconds, peak device memory and tokens/s at
``--equal-batch``; the largest batch that fits, searched with compile-only
``memory_analysis()`` against the device's ``bytes_limit`` (an affine fit over the compiled
peaks, then confirmed by running it), and tokens/s there. The report takes each mode's best
setting for each column and states the ratios against BF16's best.

``--first-step`` also times ``python train.py --config configs/llama2_7b.yaml`` itself from
launch to its first logged step (a child process, stopped once that line is written).

``--profile-reps N`` also traces N steps at the equal batch after the timed ones and records
where the step's time goes (``bench_layer.measure_split``: GEMMs, attention, FP8 Pallas kernels,
FP8 XLA fusions, optimizer kernels, copies, other XLA kernels, launch gaps) with its longest
kernels; the coat_adamw kernels count as optimizer by name, optax's fusions as other.

Records are appended to ``<out-dir>/e2e.jsonl`` as they come, so a timeout keeps what was done.

    python benchmarks/bench_e2e.py --tiny                        # CPU smoke test
    python benchmarks/bench_e2e.py --settings bf16:unrolled:none,coat:scan:activations \\
        --first-step --out-dir runs/e2e --docs docs/bench_e2e.md  # one H200
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

MODES = ("bf16", "fp8", "coat")
LAYOUTS = ("scan", "unrolled")
OPTIMIZER = {"bf16": "adamw", "fp8": "adamw", "coat": "coat_adamw"}
CONFIG_7B = os.path.join(ROOT, "configs", "llama2_7b.yaml")
CONFIG_TINY = os.path.join(ROOT, "configs", "default.yaml")
PROFILE_TOP = 25  # kernels listed per profiled setting (--top-kernels)
MODEL_NAMES = {
    "configs/llama2_7b.yaml": "Llama-2-7B",
    "configs/llama3_8b.yaml": "Llama-3-8B",
    "configs/default.yaml": "tiny",
}
TINY_MODEL = [
    "model.vocab_size=256",
    "model.hidden_size=64",
    "model.intermediate_size=176",
    "model.num_hidden_layers=3",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=4",
    "model.head_dim=16",
    "model.max_position_embeddings=128",
]
DEFAULT_SETTINGS = (
    "bf16:unrolled:none,bf16:unrolled:activations,bf16:scan:activations,"
    "coat:scan:activations,coat:unrolled:activations"
)


def parse_settings(text: str) -> list[tuple[str, str, str, str]]:
    """``"coat:scan:activations,bf16:unrolled:none"`` -> [(mode, layout, remat, extra), ...].

    An optional fourth part holds more config overrides joined by ``+``, e.g.
    ``coat:scan:activations:precision.master_dtype=bfloat16+memory.loss_chunk_size=1024``.
    """
    from coat_jax.llama import REMAT_POLICIES

    out = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        parts = item.split(":")
        if len(parts) not in (3, 4):
            raise ValueError(f"setting {item!r} is not mode:layout:remat[:key=value+...]")
        mode, layout, remat = parts[:3]
        extra = parts[3] if len(parts) == 4 else ""
        if extra and not all("=" in kv for kv in extra.split("+")):
            raise ValueError(f"setting {item!r}: extras must be key=value joined by '+'")
        if mode not in MODES or layout not in LAYOUTS or remat not in REMAT_POLICIES:
            raise ValueError(
                f"setting {item!r}: mode in {list(MODES)}, layout in {list(LAYOUTS)}, "
                f"remat in {list(REMAT_POLICIES)}"
            )
        out.append((mode, layout, remat, extra))
    if not out:
        raise ValueError("--settings is empty")
    return out


def setting_name(mode: str, layout: str, remat: str, extra: str = "") -> str:
    return f"{mode}:{layout}:{remat}" + (f":{extra}" if extra else "")


def trainer_config(
    mode: str,
    layout: str,
    remat: str,
    extra: str = "",
    *,
    seq: int,
    batch: int,
    tiny: bool,
    config: str = CONFIG_7B,
):
    """The training config ``train.py`` would run for this setting (``config``, or tiny on the
    CPU)."""
    from coat_jax.training import load_config

    overrides = [
        f"precision.mode={mode}",
        f"optimizer.name={OPTIMIZER[mode]}",
        f"memory.scan_layers={'true' if layout == 'scan' else 'false'}",
        f"memory.remat={remat}",
        f"data.seq_len={seq}",
        f"data.batch_size={batch}",
        "data.grad_accum=1",
        "mesh.data=1",
        "mesh.fsdp=1",
        "xla.compilation_cache_dir=null",
        *(kv for kv in extra.split("+") if kv),
    ]
    if tiny:
        overrides += TINY_MODEL + ["precision.compute_dtype=bfloat16"]
    return load_config(CONFIG_TINY if tiny else config, overrides)


def flops_per_step(config, batch: int, seq: int) -> float:
    """Model FLOPs of one training step (6 per parameter per token; causal attention 6*T*d/layer).

    The embedding gather is not a matmul and is left out; the LM head is counted.
    """
    d, f, v, n_layers = (
        config.hidden_size,
        config.intermediate_size,
        config.vocab_size,
        config.num_hidden_layers,
    )
    kv = config.num_key_value_heads * config.head_dim
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * f
    matmul_params = n_layers * per_layer + d * v
    tokens = batch * seq
    return 6.0 * matmul_params * tokens + 6.0 * n_layers * d * seq * tokens


# ------------------------------------------------------------------------------------------------
# worker: one setting in its own process


def worker(args) -> None:
    import jax
    import jax.numpy as jnp

    from coat_jax.memory import residuals
    from coat_jax.training.model import next_token_loss
    from coat_jax.training.optimizers import kernel_options
    from coat_jax.training.program import build_program

    mode, layout, remat, extra = parse_settings(args.worker)[0]
    seq, tiny, b0 = args.seq, args.tiny, args.equal_batch
    start = time.monotonic()
    deadline = start + args.child_budget_s
    env = C.environment()
    cfg = trainer_config(
        mode, layout, remat, extra, seq=seq, batch=b0, tiny=tiny, config=args.config
    )
    program = build_program(cfg, cfg.model)
    config = cfg.model
    base = {
        "setting": setting_name(mode, layout, remat, extra),
        "mode": mode,
        "layout": layout,
        "remat": remat,
        "optimizer": OPTIMIZER[mode],
        "seq": seq,
        "config": os.path.relpath(CONFIG_TINY if tiny else args.config, ROOT),
        # Where the FP8 activation ops ran (the trainer's default for them has changed).
        "fp8_ops_implementation": kernel_options(cfg, fp8_ops=True)["implementation"]
        if mode != "bf16"
        else None,
        **env,
    }

    def record(kind, **fields):
        rec = {"kind": kind, **base, **fields}
        C.append_jsonl(args.jsonl, rec)
        shown = {k: v for k, v in fields.items() if k not in ("hlo_calls", "memory_stats")}
        print(f"[{base['setting']}] {kind}: {shown}", flush=True)
        return rec

    abstract_params, abstract_opt = program.abstract_params, program.abstract_opt_state
    state_bytes = {
        "params": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_params)),
        "opt_state": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_opt)),
    }
    n_params = sum(x.size for x in jax.tree.leaves(abstract_params))
    stats0 = C.memory_stats()
    limit = stats0.get("bytes_limit") or stats0.get("bytes_reservable_limit")
    record("setup", n_params=n_params, bytes_limit=limit, **state_bytes)

    compiled_cache: dict[int, object] = {}
    mem_cache: dict[int, dict] = {}

    def fits(mem) -> bool | None:
        if not limit or "peak" not in mem:
            return None
        return mem["peak"] <= limit - args.margin_bytes

    def compile_at(batch: int):
        if batch in compiled_cache:
            return compiled_cache[batch], mem_cache[batch]
        t0 = time.perf_counter()
        compiled = program.step_fn.lower(
            abstract_params, abstract_opt, program.abstract_batch(batch)
        ).compile()
        mem = C.compiled_memory(compiled)
        hlo = compiled.as_text() or ""
        calls = C.custom_call_counts(hlo)
        compiled_cache[batch], mem_cache[batch] = compiled, mem
        if args.hlo_dir:
            os.makedirs(args.hlo_dir, exist_ok=True)
            name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{base['setting']}_b{batch}.hlo.txt")
            with open(os.path.join(args.hlo_dir, name), "w") as f:
                f.write(hlo)
        record(
            "compile",
            batch=batch,
            compile_s=round(time.perf_counter() - t0, 1),
            memory=mem,
            fits=fits(mem),
            fp8_gemms=calls.get(C.FP8_GEMM_TARGET, 0),
            hlo_calls=calls,
            hlo_ops=C.hlo_op_counts(hlo),
        )
        return compiled, mem

    def init_state():
        t0 = time.perf_counter()
        params = program.init_params(jax.random.key(cfg.seed))
        opt_state = program.init_opt_state(params)
        jax.block_until_ready((params, opt_state))
        return params, opt_state, time.perf_counter() - t0

    params, opt_state, init_s = init_state()
    record("init", init_s=round(init_s, 1), memory_stats=C.memory_stats())
    rng = jax.random.key(1)

    def tokens_at(batch: int):
        """The random token batch timed at ``batch``, on the trainer's batch sharding."""
        tokens = jax.random.randint(
            jax.random.fold_in(rng, batch), (1, batch, seq + 1), 0, config.vocab_size, jnp.int32
        )
        return jax.device_put(tokens, program.batch_sharding)

    def run_at(batch: int, reps: int):
        nonlocal params, opt_state
        compiled, mem = compile_at(batch)
        tokens = tokens_at(batch)
        losses = []

        def one():
            nonlocal params, opt_state
            params, opt_state, metrics = compiled(params, opt_state, tokens)
            losses.append(float(metrics["loss"]))  # float() blocks until the step is done

        timing = C.time_fn(one, warmup=args.warmup, reps=reps)
        stats = C.memory_stats()

        def dispatch():
            nonlocal params, opt_state
            params, opt_state, metrics = compiled(params, opt_state, tokens)
            return metrics

        def fetch(metrics):
            losses.append(float(metrics["loss"]))

        # The same steps with one in flight, as train.py's loop runs them: the host's dispatch
        # (for an unrolled 7B step, thousands of buffers) overlaps the previous step's work.
        pipelined = C.time_pipelined(dispatch, fetch, warmup=1, reps=reps)
        return record(
            "run",
            batch=batch,
            tokens_per_s=batch * seq / timing["median_s"],
            tokens_per_s_pipelined=batch * seq / pipelined["median_s"],
            step=timing,
            step_pipelined=pipelined,
            model_tflops=flops_per_step(config, batch, seq) / timing["median_s"] / 1e12,
            peak_bytes_in_use=stats.get("peak_bytes_in_use"),
            bytes_in_use=stats.get("bytes_in_use"),
            compiled_peak=mem.get("peak"),
            losses=[round(x, 4) for x in losses],
        )

    def profile_at(batch: int, wall_s: float):
        """The time split of ``args.profile_reps`` traced steps (after the allocator's peak
        was read, so the profiler's buffers do not count in it)."""
        from bench_layer import measure_split

        nonlocal params, opt_state
        compiled, _ = compile_at(batch)
        tokens = tokens_at(batch)

        def call():
            nonlocal params, opt_state
            params, opt_state, metrics = compiled(params, opt_state, tokens)
            jax.block_until_ready(metrics)

        label = base["setting"]
        hlo = compiled.as_text() or ""
        split = measure_split(
            call, args.profile_reps, hlo, wall_s, "train_step", label, batch, top=args.top_kernels
        )
        record("profile", batch=batch, split=split)

    def try_run(batch: int, reps: int):
        """run_at, or None after an out-of-memory error (then the state is rebuilt)."""
        nonlocal params, opt_state
        try:
            return run_at(batch, reps)
        except Exception as e:  # noqa: BLE001 - XlaRuntimeError's class moves between versions
            msg = str(e)
            if "RESOURCE_EXHAUSTED" not in msg and "out of memory" not in msg.lower():
                raise
            record("oom", batch=batch, error=msg[:400])
            # The donated buffers may be gone after a failed call: rebuild them.
            params = opt_state = None
            params, opt_state, _ = init_state()
            return None

    def time_left() -> float:
        return deadline - time.monotonic()

    def residual_bytes(batch: int) -> int:
        tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
        return sum(
            r.nbytes
            for r in residuals(
                lambda p, t: next_token_loss(program.model_def, p, t), abstract_params, tokens
            )
        )

    # 1. the common batch (the peak recorded here is the equal-batch peak: nothing larger ran)
    done = {}
    rec0 = try_run(b0, args.reps)
    if rec0 is not None:
        done[b0] = rec0
        if args.profile_reps:
            profile_at(b0, rec0["step"]["median_s"])
    if args.no_search:
        return
    # 2. largest batch: a first guess from the growth of the backward residuals per sequence
    #    (traced, nothing compiled); each compile then refines an affine fit of XLA's compiled
    #    peak against the batch, between the largest batch known to fit and the smallest not.
    if time_left() < args.min_compile_s:
        record("search_skipped", reason="child time budget spent before the batch search")
        return
    _, m0 = compile_at(b0)
    res_slope = residual_bytes(b0 + 1) - residual_bytes(b0)
    if tiny and not limit:
        # The CPU has no allocator limit; pretend one that fits about three more sequences.
        limit = int(m0["peak"] + 3.5 * max(res_slope, 1))
        record("tiny_limit", bytes_limit=limit)
    if not limit or res_slope <= 0:
        record("search_skipped", reason=f"no bytes_limit ({limit}) or residual slope {res_slope}")
        return
    allowed = limit - args.margin_bytes
    fit_lo = b0 if fits(m0) else None  # largest batch known to fit
    fit_hi = None  # smallest batch known not to fit
    b = max(1, min(b0 + math.floor((allowed - m0["peak"]) / res_slope), args.max_batch))
    record("predict", residual_bytes_per_sequence=res_slope, first_guess=b, allowed=allowed)
    for _ in range(args.max_search_compiles):
        if time_left() < args.min_compile_s or b == fit_lo or b == fit_hi:
            break
        _, mem = compile_at(b)
        if fits(mem):
            fit_lo = b if fit_lo is None else max(fit_lo, b)
        else:
            fit_hi = b if fit_hi is None else min(fit_hi, b)
        slope = (mem["peak"] - m0["peak"]) / (b - b0) if b != b0 else res_slope
        nb = b + math.floor((allowed - mem["peak"]) / max(slope, 1))
        if fit_hi is not None:
            nb = min(nb, fit_hi - 1)
        if fit_lo is not None:
            nb = max(nb, fit_lo + 1 if fit_hi is None or fit_lo + 1 < fit_hi else fit_lo)
        nb = max(1, min(nb, args.max_batch))
        if fit_lo is not None and fit_hi is not None and fit_hi - fit_lo <= 1:
            break
        b = nb
    record("search", largest_fitting=fit_lo, smallest_not_fitting=fit_hi)
    if fit_lo is None:
        record("search_skipped", reason=f"no fitting batch found (smallest too big {fit_hi})")
        return
    # 3. confirm by running it, stepping down on an out-of-memory error.
    best = fit_lo
    while best >= 1 and time_left() > args.min_compile_s / 2:
        rec = done.get(best) or try_run(best, max(3, args.reps // 2) if best > b0 else args.reps)
        if rec is not None:
            record("max_batch", batch=best, tokens_per_s=rec["tokens_per_s"])
            return
        best -= 1
    record("search_skipped", reason="out of time before a confirming run succeeded")


# ------------------------------------------------------------------------------------------------
# train.py itself: launch to the first logged step


def first_step(args, jsonl: str, overrides: list[str]) -> None:
    """Runs ``train.py`` as a user would and times launch -> its first metrics record."""
    import shutil

    out = os.path.join(args.out_dir, "first_step_run")
    shutil.rmtree(out, ignore_errors=True)
    config = CONFIG_TINY if args.tiny else args.config
    cmd = [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        "--config",
        config,
        f"output_dir={out}",
        "logging.progress_bar=false",
        *overrides,
    ]
    print(f"[first-step] {' '.join(cmd)}", flush=True)
    log_path = os.path.join(args.out_dir, "first_step.log")
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=C.child_env(), stdout=log, stderr=subprocess.STDOUT)
        metrics = os.path.join(out, "metrics.jsonl")
        first = None
        while time.monotonic() - t0 < args.first_step_budget_s and proc.poll() is None:
            if os.path.exists(metrics):
                with open(metrics) as f:
                    lines = [json.loads(x) for x in f if x.strip()]
                first = next((r for r in lines if "loss" in r), None)
                if first is not None:
                    break
            time.sleep(0.5)
        wall = time.monotonic() - t0
        proc.kill()
        proc.wait()
    with open(log_path) as f:
        tail = f.read()[-3000:]
    rec = {
        "kind": "first_step",
        **C.environment(),
        "command": "python train.py --config "
        + os.path.relpath(config, ROOT)
        + (" " + " ".join(overrides) if overrides else ""),
        "wall_to_first_log_s": round(wall, 1) if first else None,
        "first_step_s": round(first["first_step_s"], 1) if first else None,
        "loss": first["loss"] if first else None,
        "peak_memory_bytes": first.get("peak_memory_bytes") if first else None,
        "log_tail": tail,
    }
    C.append_jsonl(jsonl, rec)
    print(f"[first-step] {json.dumps({k: v for k, v in rec.items() if k != 'log_tail'})}")
    if first is None:
        print(tail)


# ------------------------------------------------------------------------------------------------
# parent: one child per setting, then the tables


def summarize(records: list[dict]) -> dict:
    by: dict[str, dict] = {}
    for r in records:
        if "setting" not in r:
            continue
        m = by.setdefault(r["setting"], {"runs": {}, "compiles": {}, "rec": r})
        if r["kind"] == "run":
            m["runs"][r["batch"]] = r
        elif r["kind"] == "compile":
            m["compiles"][r["batch"]] = r
        elif r["kind"] in ("setup", "max_batch", "init", "search"):
            m[r["kind"]] = r
        elif r["kind"] == "search_skipped":
            m.setdefault("notes", []).append(r["reason"])
        elif r["kind"] == "oom":
            m.setdefault("notes", []).append(f"OOM when run at batch {r['batch']}")
    return by


def _best(by, mode, key, lower_is_better=False, options=False):
    """(setting, value) of the mode's best setting by ``key(summary)``; None when unmeasured.

    ``options``: among the settings with extra overrides (such as bfloat16 masters) instead of
    among the plain ones.
    """
    cands = [
        (s, key(m))
        for s, m in by.items()
        if m["rec"]["mode"] == mode and key(m) and (s.count(":") == 3) == options
    ]
    if not cands:
        return None
    return (min if lower_is_better else max)(cands, key=lambda c: c[1])


def _tokens(v: float | None) -> str:
    """Tokens/s for a table cell; ``n/a`` where the run did not record it."""
    return "n/a" if not v else f"{v:.0f}"


def write_docs(path: str | None, records: list[dict], equal_batch: int, command: str) -> str:
    by = summarize(records)
    env = next((r for r in records if r["kind"] == "setup"), None)
    config = env.get("config", "configs/llama2_7b.yaml") if env else "configs/llama2_7b.yaml"
    model = MODEL_NAMES.get(config, config)
    lines = [f"# train.py's {model} training step on one GPU: BF16 against COAT", ""]
    if env:
        lines += [
            f"By `{command}`; each setting's device, JAX version and date are in the table of "
            "every setting.",
            f"Sequence length {env['seq']}. Every number comes from `train.py`'s own step: "
            f"`{config}` loaded by `coat_jax.training.load_config`, the step built "
            "by `coat_jax.training.program.build_program` (forward, backward, the config's gradient "
            "clipping unless a setting sets `optimizer.grad_clip=null`, "
            "optimizer with the config's schedule; parameters and optimizer state donated; "
            "float32 master weights unless a setting sets `precision.master_dtype=bfloat16`; bfloat16 "
            "activations), each setting in its own process. "
            "A setting is precision:layer layout:remat policy (`scan_layers`, `remat`). "
            "Tokens/s is batch x sequence over the median step: timed with the host waiting "
            "for each step, and (where recorded) with one step in flight as `train.py`'s loop "
            "runs, the host queuing step k + 1 before it waits for step k (intervals between "
            "steps seen done).",
            "",
        ]
    eq = lambda m: m["runs"].get(equal_batch, {})
    mx = lambda m: m["runs"].get(m.get("max_batch", {}).get("batch"), {})
    # The allocator's peak where the backend keeps one (GPU); XLA's compiled peak elsewhere.
    peak = lambda r: r.get("peak_bytes_in_use") or r.get("compiled_peak")
    best = {}
    for options in (False, True):
        best[options] = {
            "mem": {mode: _best(by, mode, lambda m: peak(eq(m)), True, options) for mode in MODES},
            "eq": {
                mode: _best(by, mode, lambda m: eq(m).get("tokens_per_s"), False, options)
                for mode in MODES
            },
            "eq_pipe": {
                mode: _best(by, mode, lambda m: eq(m).get("tokens_per_s_pipelined"), False, options)
                for mode in MODES
            },
            "mx": {
                mode: _best(by, mode, lambda m: mx(m).get("tokens_per_s"), False, options)
                for mode in MODES
            },
        }
    firsts = [r for r in records if r["kind"] == "first_step"]
    if any(best[False]["mem"].values()):
        lines += [
            "Each mode at its best setting (ratios against BF16's best; settings with extra "
            "options such as `precision.master_dtype=bfloat16` are in the second column of COAT):",
            "",
            "| | BF16 | FP8 linears | COAT | COAT / BF16 | COAT with options | with options / BF16 |",
            "|---|---|---|---|---|---|---|",
        ]

        def cell(b, fmt):
            return f"{fmt(b[1])} (`{b[0]}`)" if b else "not measured"

        def ratio(bf, other, bf16_over):
            if not bf or not other:
                return "n/a"
            return C.ratio(bf[1], other[1]) if bf16_over else C.ratio(other[1], bf[1])

        for label, key, fmt, bf16_over in (
            (f"peak memory at batch {equal_batch} (GiB; ratio BF16/COAT)", "mem", C.gib, True),
            (f"tokens/s at batch {equal_batch}", "eq", lambda v: f"{v:.0f}", False),
            (
                f"tokens/s at batch {equal_batch}, one step in flight (train.py's loop)",
                "eq_pipe",
                lambda v: f"{v:.0f}",
                False,
            ),
            ("tokens/s at its largest batch", "mx", lambda v: f"{v:.0f}", False),
        ):
            plain, opts = best[False][key], best[True][key]
            if not any(plain.values()) and not any(opts.values()):
                continue  # not recorded (records from before the pipelined timing)
            bf = plain.get("bf16")
            lines.append(
                f"| {label} | "
                + " | ".join(cell(plain.get(mode), fmt) for mode in MODES)
                + f" | {ratio(bf, plain.get('coat'), bf16_over)} | {cell(opts.get('coat'), fmt)}"
                + f" | {ratio(bf, opts.get('coat'), bf16_over)} |"
            )
        lines.append("")
    lines += [
        "Every setting measured:",
        "",
        f"| setting | optimizer | params + opt state (GiB) | init s | compile s (batch "
        f"{equal_batch}) | peak at batch {equal_batch} (GiB) | tokens/s at batch {equal_batch} | "
        f"same, one step in flight | largest batch | peak there (GiB) | tokens/s there | "
        "FP8 GEMMs in HLO | device | JAX | date |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in by.items():
        setup = m.get("setup", {})
        st = (setup.get("params", 0) + setup.get("opt_state", 0)) or None
        e, x = eq(m), mx(m)
        comp = m["compiles"].get(equal_batch, {})
        mb = m.get("max_batch", {}).get("batch")
        if mb is None and m.get("search", {}).get("largest_fitting"):
            mb = f"{m['search']['largest_fitting']} by compile (not run)"
        lines.append(
            f"| `{name}` | {m['rec']['optimizer']} | {C.gib(st)} | "
            f"{m.get('init', {}).get('init_s', 'n/a')} | {comp.get('compile_s', 'n/a')} | "
            f"{C.gib(e.get('peak_bytes_in_use'))} | {_tokens(e.get('tokens_per_s'))} | "
            f"{_tokens(e.get('tokens_per_s_pipelined'))} | {mb or 'n/a'} | "
            f"{C.gib(x.get('peak_bytes_in_use'))} | {_tokens(x.get('tokens_per_s'))} | "
            f"{comp.get('fp8_gemms', 'n/a')} | {setup.get('device', 'n/a')} | "
            f"{setup.get('jax', 'n/a')} | {setup.get('date', 'n/a')[:10]} |"
        )
    if firsts:
        lines += [
            "",
            "`train.py` from launch to its first logged step (tokenizing the bundled corpus, "
            "init, compile, one step):",
            "",
            "| command | launch to first logged step (s) | first step incl. compile (s) | "
            "peak memory (GiB) |",
            "|---|---|---|---|",
        ]
        for r in firsts:
            lines.append(
                f"| `{r['command']}` | {r['wall_to_first_log_s']} | {r['first_step_s']} | "
                f"{C.gib(r.get('peak_memory_bytes'))} |"
            )
    lines += [
        "",
        "Compiled memory (XLA `memory_analysis()`: arguments + outputs - donated + temporaries), "
        "per compiled batch:",
        "",
        "| setting | batch | compile s | arguments GiB | temporaries GiB | peak GiB | fits |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, m in by.items():
        for b, c in sorted(m["compiles"].items()):
            mem = c["memory"]
            lines.append(
                f"| `{name}` | {b} | {c['compile_s']} | {C.gib(mem.get('argument'))} | "
                f"{C.gib(mem.get('temp'))} | {C.gib(mem.get('peak'))} | {c['fits']} |"
            )
    lines += profile_lines(records)
    notes = [(name, n) for name, m in by.items() for n in m.get("notes", [])]
    if notes:
        lines += ["", "Not measured / notes:", ""] + [f"- `{s}`: {n}" for s, n in notes]
    text = "\n".join(lines) + "\n"
    if path:
        with open(path, "w") as f:
            f.write(text)
    return text


def profile_lines(records: list[dict]) -> list[str]:
    """The ``--profile-reps`` records as a time-split table and each setting's longest kernels
    (ms per step; gaps = the untraced median step - the time some kernel ran)."""
    from bench_layer import SPLIT_CATEGORIES

    profiles = [r for r in records if r["kind"] == "profile" and r["split"].get("traced")]
    untraced = [r for r in records if r["kind"] == "profile" and not r["split"].get("traced")]
    lines = []
    if profiles:
        lines += [
            "",
            "Time split of the step (ms per step, `jax.profiler` trace of "
            f"{profiles[0]['split']['reps']} steps after the timed ones; the coat_adamw kernels "
            "are the optimizer, optax's fusions fall under other XLA kernels):",
            "",
            "| setting | batch | wall (ms) | kernels per step | kernel time | busy | gaps | "
            + " | ".join(SPLIT_CATEGORIES.values())
            + " |",
            "|---|---|---|---|---|---|---|" + "---|" * len(SPLIT_CATEGORIES),
        ]
        for r in profiles:
            sp = r["split"]
            cats = " | ".join(f"{sp['categories'][c]['ms']:.2f}" for c in SPLIT_CATEGORIES)
            lines.append(
                f"| `{r['setting']}` | {r['batch']} | {sp['wall_ms']:.2f} | "
                f"{sp['kernels_per_step']:.0f} | {sp['kernel_ms']:.2f} | {sp['busy_ms']:.2f} | "
                f"{sp['wall_ms'] - sp['busy_ms']:.2f} | {cats} |"
            )
        for r in profiles:
            lines += ["", f"Longest kernels of `{r['setting']}` (ms per step, launches per step):"]
            lines += [
                f"- {t['ms']:.3f} ms, {t['kernels']:.1f}x, {t['category']}: `{t['name']}`"
                for t in r["split"]["top"]
            ]
    for r in untraced:
        lines += ["", f"`{r['setting']}`: no time split ({r['split'].get('reason')})."]
    return lines


def recorded_command(records: list[dict]) -> str:
    cmds = [r["command"] for r in records if r["kind"] == "command"]
    return "` then `".join(dict.fromkeys(cmds)) if cmds else "unknown"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--settings", default=None, help=f"mode:layout:remat,... ({DEFAULT_SETTINGS})")
    p.add_argument("--seq", type=int, default=None, help="sequence length (2048; 64 with --tiny)")
    p.add_argument("--equal-batch", type=int, default=1, help="the batch every setting runs")
    p.add_argument("--reps", type=int, default=5, help="timed steps per batch (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-search", action="store_true", help="skip the largest-batch search")
    p.add_argument("--margin-bytes", type=int, default=None, help="headroom (512 MiB; 0 tiny)")
    p.add_argument("--max-batch", type=int, default=64, help="upper end of the search")
    p.add_argument("--max-search-compiles", type=int, default=3)
    p.add_argument("--child-budget-s", type=float, default=300.0, help="per-setting time budget")
    p.add_argument("--child-budgets", default="", help="per-setting budgets (s), comma-separated")
    p.add_argument("--min-compile-s", type=float, default=40.0, help="time one compile may take")
    p.add_argument("--first-step", action="store_true", help="also time train.py to its 1st log")
    p.add_argument("--first-step-overrides", default="", help="key=value,... for that train.py")
    p.add_argument("--first-step-budget-s", type=float, default=300.0)
    p.add_argument("--tiny", action="store_true", help="3 small layers on the CPU: a smoke test")
    p.add_argument(
        "--profile-reps", type=int, default=0, help="trace this many steps at the equal batch"
    )
    p.add_argument(
        "--top-kernels",
        type=int,
        default=PROFILE_TOP,
        help="how many kernels a profile lists, longest total time first",
    )
    p.add_argument("--hlo-dir", default=None, help="write each compiled step's HLO text here")
    p.add_argument("--config", default=CONFIG_7B, help="the train.py config (llama2_7b.yaml)")
    p.add_argument("--out-dir", default="runs/bench_e2e")
    p.add_argument("--docs", default=None, help="write the markdown table here")
    p.add_argument("--no-child-logs", action="store_true", help="no per-setting log files")
    p.add_argument("--report-only", action="store_true", help="only rewrite --docs from out-dir")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--jsonl", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.top_kernels < 1:
        raise ValueError(f"--top-kernels must be >= 1, got {args.top_kernels}")
    if args.seq is None:
        args.seq = 64 if args.tiny else 2048
    if args.margin_bytes is None:
        args.margin_bytes = 0 if args.tiny else 512 * 1024**2
    if args.settings is None:
        args.settings = (
            "bf16:unrolled:none,coat:scan:activations" if args.tiny else DEFAULT_SETTINGS
        )
    if args.worker:
        worker(args)
        return
    settings = parse_settings(args.settings)
    os.makedirs(args.out_dir, exist_ok=True)
    jsonl = os.path.join(args.out_dir, "e2e.jsonl")
    if args.report_only:
        records = C.read_jsonl(jsonl)
        if not records:
            raise ValueError(f"no records in {jsonl}")
        print(write_docs(args.docs, records, args.equal_batch, recorded_command(records)))
        return
    command = C.command_line()
    C.append_jsonl(jsonl, {"kind": "command", "command": command})
    if args.first_step:
        overrides = [o for o in args.first_step_overrides.split(",") if o]
        first_step(args, jsonl, overrides)
    passthrough = [
        f"--seq={args.seq}",
        f"--equal-batch={args.equal_batch}",
        f"--reps={args.reps}",
        f"--warmup={args.warmup}",
        f"--margin-bytes={args.margin_bytes}",
        f"--min-compile-s={args.min_compile_s}",
        f"--max-batch={args.max_batch}",
        f"--max-search-compiles={args.max_search_compiles}",
        f"--profile-reps={args.profile_reps}",
        f"--top-kernels={args.top_kernels}",
        f"--jsonl={jsonl}",
        *([f"--hlo-dir={os.path.abspath(args.hlo_dir)}"] if args.hlo_dir else []),
        f"--config={os.path.abspath(args.config)}",
    ]
    passthrough += ["--tiny"] if args.tiny else []
    passthrough += ["--no-search"] if args.no_search else []
    budgets = [float(b) for b in args.child_budgets.split(",") if b.strip()]
    if budgets and len(budgets) != len(settings):
        raise ValueError(f"--child-budgets has {len(budgets)} entries for {len(settings)} settings")
    text = ""
    for i, s in enumerate(settings):
        name = setting_name(*s)
        budget = budgets[i] if budgets else args.child_budget_s
        rc = C.run_child(
            [
                os.path.abspath(__file__),
                f"--worker={name}",
                f"--child-budget-s={budget}",
                *passthrough,
            ],
            timeout_s=budget + 30,
            log_path=None
            if args.no_child_logs
            else os.path.join(args.out_dir, f"e2e_{len(C.read_jsonl(jsonl))}.log"),
        )
        if rc:
            print(f"[parent] {name} exited with {rc}; continuing with what it recorded")
        text = write_docs(args.docs, C.read_jsonl(jsonl), args.equal_batch, command)
    print(text)


if __name__ == "__main__":
    main()

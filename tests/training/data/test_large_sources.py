"""Large sources: a large text file streams, in pieces, to the tokens it gave read whole, and
tokenizing a large corpus keeps the process's peak memory bounded."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from coat_jax.training.data import (
    TextFile,
    make_tokenizer,
    read_documents,
    read_source,
    tokenize_to_cache,
)
from coat_jax.training.data import cache as cache_module
from coat_jax.training.data import sources as sources_module

REPO_ROOT = Path(__file__).resolve().parents[3]
# Characters of one to four UTF-8 bytes, so that piece edges cut some of them.
TEXT = "".join(f"line {i}: héllo wörld € 𝄞 ok\n" for i in range(400))


@pytest.mark.parametrize("piece_bytes", [1, 2, 3, 5, 997])
def test_a_text_files_pieces_join_to_its_text(tmp_path, monkeypatch, piece_bytes):
    path = tmp_path / "big.txt"
    path.write_text(TEXT, encoding="utf-8")
    monkeypatch.setattr(sources_module, "TEXT_PIECE_BYTES", piece_bytes)
    pieces = list(TextFile(path).pieces())
    assert "".join(pieces) == TEXT
    assert len(pieces) > 1


def _streams(files):
    return [np.asarray(a) for a in (files.train, files.val, files.train_docs, files.val_docs)]


@pytest.mark.parametrize("val_documents", [None, "big.txt"])
def test_a_large_text_file_streams_to_the_tokens_it_gave_read_whole(
    tmp_path, monkeypatch, val_documents
):
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "a.txt").write_text("A small file.\n", encoding="utf-8")
    (folder / "big.txt").write_text(TEXT, encoding="utf-8")
    (folder / "blank.txt").write_text(" \n\t" * 2000, encoding="utf-8")
    (folder / "c.jsonl").write_text('{"text": "a record"}\n' * 3, encoding="utf-8")
    tok = make_tokenizer("byte", None)
    whole = tokenize_to_cache(str(folder), tok, str(tmp_path / "whole"), 0.1, val_documents)
    # Pieces of 997 bytes cut the file's characters, and writing 1,500 tokens at a time
    # makes its validation tokens be read back from the files in several pieces.
    monkeypatch.setattr(sources_module, "STREAMED_TEXT_BYTES", 997)
    monkeypatch.setattr(sources_module, "TEXT_PIECE_BYTES", 997)
    monkeypatch.setattr(cache_module, "WRITE_TOKENS", 1500)
    docs = {name: doc for name, doc, _ in read_source(str(folder))}
    assert isinstance(docs["big.txt"], TextFile) and "blank.txt" not in docs
    assert dict(read_documents(str(folder)))["big.txt"] == TEXT
    streamed = tokenize_to_cache(str(folder), tok, str(tmp_path / "streamed"), 0.1, val_documents)
    for a, b in zip(_streams(whole), _streams(streamed), strict=True):
        np.testing.assert_array_equal(a, b)
    # The file's tokens by hand: its UTF-8 bytes and EOS, the last tenth to validation.
    ids = np.asarray([*TEXT.encode("utf-8"), tok.eos_id])
    train, val = np.asarray(streamed.train), np.asarray(streamed.val)
    if val_documents:
        np.testing.assert_array_equal(val, ids)
    else:
        cut = int(round(len(ids) * 0.9))
        start = int(np.asarray(streamed.train_docs)[1])
        np.testing.assert_array_equal(train[start : start + cut], ids[:cut])
        val_start = int(np.asarray(streamed.val_docs)[1])
        np.testing.assert_array_equal(val[val_start : val_start + len(ids) - cut], ids[cut:])


BAD_UTF8 = {
    "a bad byte in a later piece": TEXT.encode() + b"ab\xffcd" + b"x" * 3000,
    "a character cut by the file's end": TEXT.encode() + b"abc\xe2\x82",
    "a bad continuation after a piece's edge": b"x" * 996 + b"\xe2\x28\xa1" + b"y" * 3000,
}


@pytest.mark.parametrize("case", sorted(BAD_UTF8))
def test_a_streamed_file_that_is_not_utf8_fails_as_read_whole(tmp_path, monkeypatch, case):
    path = tmp_path / "bad.txt"
    path.write_bytes(BAD_UTF8[case])
    tok = make_tokenizer("byte", None)
    errors = []
    # Read whole, then streamed in pieces of 997 bytes.
    for size in (1 << 26, 997):
        monkeypatch.setattr(sources_module, "STREAMED_TEXT_BYTES", size)
        monkeypatch.setattr(sources_module, "TEXT_PIECE_BYTES", size)
        cache = tmp_path / f"cache{size}"
        with pytest.raises(ValueError, match="is not UTF-8 text") as err:
            tokenize_to_cache(str(path), tok, str(cache), 0.1)
        assert list(cache.iterdir()) == []
        errors.append(str(err.value))
    assert errors[0] == errors[1]


# The child process measures its peak resident memory while tokenizing, above what it holds
# after its imports (VmHWM reset through /proc/self/clear_refs).
RSS_CHILD = textwrap.dedent(
    """
    import sys, time
    from coat_jax.training.data import make_tokenizer, tokenize_to_cache

    def kib(key):
        with open("/proc/self/status") as f:
            return int(next(line.split()[1] for line in f if line.startswith(key)))

    tok = make_tokenizer("byte", None)
    for name in sys.argv[2:]:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        baseline, started = kib("VmRSS:"), time.process_time()
        files = tokenize_to_cache(f"{sys.argv[1]}/{name}", tok, f"{sys.argv[1]}/cache", 0.01)
        cpu = time.process_time() - started
        tokens = len(files.train) + len(files.val)
        print(name, tokens, (kib("VmHWM:") - baseline) / 1024, cpu)
    """
)


@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="measures memory through Linux's /proc"
)
def test_tokenizing_a_200_mb_corpus_keeps_peak_rss_bounded(tmp_path):
    """Tokenizing 200 MB of JSON Lines (200,000 records of 1,000 bytes) and an 80 MiB text file
    with the byte tokenizer each raises the process's peak RSS at most 100 MB above what it
    held after its imports (docs/data.md, "The token cache", has the measured peaks and
    times): a chunk of documents, or a piece of the text file, at a time. Reading the text
    file whole, or holding the JSON Lines corpus's tokens at once, would exceed the bound.
    """
    record = b'{"text": "' + b"x" * 987 + b'"}\n'
    with open(tmp_path / "corpus.jsonl", "wb") as f:
        for _ in range(200):
            f.write(record * 1000)
    with open(tmp_path / "corpus.txt", "wb") as f:
        for _ in range(80):
            f.write("héllo € 𝄞\n".encode() * (1 << 16))
    text_bytes = (tmp_path / "corpus.txt").stat().st_size
    try:
        run = subprocess.run(
            [sys.executable, "-c", RSS_CHILD, str(tmp_path), "corpus.jsonl", "corpus.txt"],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
        )
    finally:
        # pytest keeps recent runs' temporary folders: leave no corpus behind.
        for path in tmp_path.iterdir():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    assert run.returncode == 0, run.stderr
    measured = {}
    for line in run.stdout.splitlines():
        name, tokens, peak_mb, cpu_s = line.split()
        measured[name] = (int(tokens), float(peak_mb), float(cpu_s))
    assert measured["corpus.jsonl"][0] == 200_000 * (987 + 1)
    assert measured["corpus.txt"][0] == text_bytes + 1
    for name, (_, peak_mb, _) in measured.items():
        assert peak_mb <= 100, (name, measured)

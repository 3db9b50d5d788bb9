"""Token caches: a source tokenized once into cached token files, memory-mapped afterwards.

Every document is tokenized and followed by the tokenizer's end-of-sequence id. A text file's
document gives the last ``val_fraction`` of its tokens to validation, so every file is
represented in both splits; a source's records (JSON Lines, Parquet, ...) are held out whole,
evenly spaced, ``val_fraction`` of them. ``val_documents`` instead holds out named documents
whole. The streams go to ``<cache_dir>/<key>/``: ``{train,val}.bin`` (raw uint16 or uint32),
``{train,val}.docs.bin`` (int64 offsets where each document starts) and, for a source with chats,
``{train,val}.loss.bin`` (uint8, 1 where a token is a loss target: an assistant's token of a
chat, every token of a plain text). The key hashes the source's files, the text field, the
tokenizer and the split, so a changed corpus or tokenizer never reuses a stale cache. The cache
is written in a scratch folder renamed into place, and only once the whole source has been read
and tokenized, so a failed source leaves nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from coat_jax.training.data.sources import TextFile, read_source, source_digest
from coat_jax.training.data.tokenizer import Tokenizer

CACHE_FORMAT = 2


@dataclass(frozen=True)
class TokenFiles:
    """A source's cached streams: tokens, document starts and (chats) loss targets per split."""

    train: np.ndarray
    val: np.ndarray
    directory: Path
    train_docs: np.ndarray
    val_docs: np.ndarray
    # None: every token is a loss target (no chats in the source).
    train_loss: np.ndarray | None = None
    val_loss: np.ndarray | None = None
    # Seconds this call spent building the cache: reading, tokenizing and writing the corpus
    # (None: the cache was there already).
    tokenized_s: float | None = None

    @property
    def chat(self) -> bool:
        return self.train_loss is not None


def split_names(val_documents: str | None) -> tuple[str, ...]:
    """The document names of a ``val_documents`` setting (comma-separated), in order."""
    if val_documents is None:
        return ()
    return tuple(n.strip() for n in val_documents.split(",") if n.strip())


def tokenize_to_cache(
    data_path: str,
    tokenizer: Tokenizer,
    cache_dir: str,
    val_fraction: float,
    val_documents: str | None = None,
    text_field: str = "text",
    progress: bool = False,
) -> TokenFiles:
    """Tokenizes a source once and memory-maps its cached train and validation streams.

    With ``val_documents`` (comma-separated document names, as
    :func:`~coat_jax.training.data.sources.read_documents` names them) those documents are held
    out whole for validation and the others are all training text: a split by document, so no
    validation text is ever trained on. Otherwise ``val_fraction`` is held out as the module
    says. ``progress``: a progress bar of the documents and tokens tokenized (on stderr).
    """
    held_out = split_names(val_documents)
    split = {"val_documents": list(held_out)} if held_out else val_fraction
    key_parts = [CACHE_FORMAT, source_digest(data_path, text_field), tokenizer.identity, split]
    key = hashlib.sha256(json.dumps(key_parts).encode()).hexdigest()[:24]
    root = Path(cache_dir).expanduser()
    final = root / key
    tokenized_s = None
    if not (final / "meta.json").exists():
        started = time.perf_counter()
        _write_cache(
            data_path, text_field, tokenizer, val_fraction, root, final, held_out, progress
        )
        tokenized_s = time.perf_counter() - started
    meta = json.loads((final / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"])
    streams = {}
    for split_name in ("train", "val"):
        tokens = np.memmap(final / f"{split_name}.bin", dtype=dtype, mode="r")
        docs = np.fromfile(final / f"{split_name}.docs.bin", dtype=np.int64)
        loss = None
        if meta["chat"]:
            loss = np.memmap(final / f"{split_name}.loss.bin", dtype=np.uint8, mode="r")
        if len(tokens) != meta[f"{split_name}_tokens"] or (
            loss is not None and len(loss) != len(tokens)
        ):
            raise ValueError(f"token cache {str(final)!r} is truncated; delete it to re-tokenize")
        streams[split_name] = (tokens, docs, loss)
    return TokenFiles(
        train=streams["train"][0],
        val=streams["val"][0],
        directory=final,
        train_docs=streams["train"][1],
        val_docs=streams["val"][1],
        train_loss=streams["train"][2],
        val_loss=streams["val"][2],
        tokenized_s=tokenized_s,
    )


# A source is read and tokenized this many documents (or characters) at a time, so that host
# memory holds one such chunk whatever the source's size.
CHUNK_DOCUMENTS = 4096
CHUNK_CHARS = 1 << 26
# A split writes its tokens out once it holds this many (and at the end of each chunk), and
# reads back a text file's validation tokens this many at a time.
WRITE_TOKENS = 1 << 20


def _chunks(documents):
    chunk, chars = [], 0
    for doc in documents:
        chunk.append(doc)
        chars += len(doc[1]) if isinstance(doc[1], str) else 0
        if len(chunk) >= CHUNK_DOCUMENTS or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


# A piece of a document: its ids and which are loss targets (None: every one).
Piece = tuple[np.ndarray, "np.ndarray | None"]


def _encode(tokenizer: Tokenizer, documents) -> list[Iterable[Piece]]:
    """Each document's pieces, its end-of-sequence id last; a chat's EOS is no target (the
    template's end of turn is the assistant's). A :class:`TextFile` is read and encoded a piece
    at a time as its pieces are taken."""
    texts = [doc for _, doc, _ in documents if isinstance(doc, str)]
    encoded = iter(tokenizer.encode_many(texts))
    eos = np.asarray([tokenizer.eos_id])
    out = []
    for name, doc, _ in documents:
        if isinstance(doc, str):
            out.append([(next(encoded), None), (eos, None)])
        elif isinstance(doc, TextFile):
            out.append(_text_file_pieces(tokenizer, doc, eos))
        else:
            ids, assistant = tokenizer.encode_chat(doc, repr(name))
            out.append([(ids, assistant), (eos, np.zeros(1, dtype=bool))])
    return out


def _text_file_pieces(tokenizer: Tokenizer, doc: TextFile, eos: np.ndarray) -> Iterator[Piece]:
    for ids in tokenizer.encode_pieces(doc.pieces()):
        yield ids, None
    yield eos, None


def _is_held_out_record(index: int, val_fraction: float) -> bool:
    """Whether record ``index`` goes to validation: ``val_fraction`` of them, evenly spaced."""
    return int((index + 1) * val_fraction) > int(index * val_fraction)


class _SplitWriter:
    """Appends one split's documents to its token, document-start and loss files, holding up to
    ``WRITE_TOKENS`` tokens to write them with one call a file."""

    def __init__(self, folder: Path, split: str, dtype):
        self.dtype = dtype
        self.paths = [folder / f"{split}{ext}" for ext in (".bin", ".docs.bin", ".loss.bin")]
        self.files = [open(path, "wb") for path in self.paths]
        self.tokens = 0
        # Where the held documents start, and their pieces; tokens before `written` are in the
        # files.
        self.starts: list[int] = []
        self.held: list[Piece] = []
        self.written = 0

    def add(self, pieces: Iterable[Piece], start: bool = True) -> None:
        """Appends a document's pieces; ``start``: notes where it starts (unless it has no
        tokens)."""
        first = self.tokens
        for piece in pieces:
            self.held.append(piece)
            self.tokens += len(piece[0])
            if self.tokens - self.written >= WRITE_TOKENS:
                self.flush()
        if start and self.tokens > first:
            self.starts.append(first)

    def flush(self) -> None:
        tokens, docs, loss = self.files
        if self.held:
            ids = [piece[0] for piece in self.held]
            tokens.write(np.concatenate(ids, dtype=self.dtype, casting="unsafe"))
            targets = np.ones(self.tokens - self.written, dtype=np.uint8)
            at = 0
            for piece_ids, piece_targets in self.held:
                if piece_targets is not None:
                    targets[at : at + len(piece_ids)] = piece_targets
                at += len(piece_ids)
            loss.write(targets)
        docs.write(np.asarray(self.starts, dtype=np.int64))
        for f in self.files:
            f.flush()
        self.starts, self.held, self.written = [], [], self.tokens

    def move_tail(self, cut: int, other: _SplitWriter) -> None:
        """Moves this split's tokens from ``cut`` on to the end of ``other``, as one document,
        reading them back from the files ``WRITE_TOKENS`` at a time."""
        self.flush()
        size = np.dtype(self.dtype).itemsize
        tail = (
            (
                np.fromfile(self.paths[0], self.dtype, WRITE_TOKENS, offset=at * size),
                np.fromfile(self.paths[2], np.uint8, WRITE_TOKENS, offset=at),
            )
            for at in range(cut, self.tokens, WRITE_TOKENS)
        )
        other.add(tail)
        for f, itemsize in ((self.files[0], size), (self.files[2], 1)):
            f.truncate(cut * itemsize)
            f.seek(0, os.SEEK_END)
        self.tokens = self.written = cut

    def close(self) -> None:
        for f in self.files:
            f.close()


def _add_text(pieces, train: _SplitWriter, val: _SplitWriter, val_fraction: float) -> None:
    """Appends a text file's document, the first ``1 - val_fraction`` of its tokens to train and
    the rest to val; the tokens go to train as they come (the count is known at the end only)
    and the rest moves to val."""
    start = train.tokens
    train.add(pieces, start=False)
    cut = start + int(round((train.tokens - start) * (1.0 - val_fraction)))
    train.move_tail(cut, val)
    if cut > start:
        train.starts.append(start)


def _write_cache(
    data_path: str,
    text_field: str,
    tokenizer: Tokenizer,
    val_fraction: float,
    root: Path,
    final: Path,
    held_out=(),
    progress: bool = False,
) -> None:
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    root.mkdir(parents=True, exist_ok=True)
    # Written in a scratch directory and renamed into place once the whole source is read, so
    # a crash or bad data never leaves a cache that looks complete; a concurrent writer that
    # wins the rename is equally good.
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
    splits = {}
    bar = tqdm(desc=f"tokenizing {data_path}", unit=" docs", disable=not progress)
    try:
        for name in ("train", "val"):
            splits[name] = _SplitWriter(tmp, name, dtype)
        names, held, records, chat = [], 0, 0, False
        for chunk in _chunks(read_source(data_path, text_field)):
            for (name, doc, is_record), pieces in zip(
                chunk, _encode(tokenizer, chunk), strict=True
            ):
                chat = chat or isinstance(doc, list)
                if held_out:
                    names.append(name)
                    to_val = name in held_out
                    held += to_val
                elif is_record:
                    to_val = _is_held_out_record(records, val_fraction)
                    records += 1
                else:
                    _add_text(pieces, splits["train"], splits["val"], val_fraction)
                    continue
                splits["val" if to_val else "train"].add(pieces)
            for split in splits.values():
                split.flush()
            bar.update(len(chunk))
            tokens = splits["train"].tokens + splits["val"].tokens
            bar.set_postfix_str(f"{tokens / max(bar.format_dict['elapsed'], 1e-9):,.0f} tokens/s")
        for split in splits.values():
            split.close()
        _check_held_out(data_path, held_out, names, held)
        if not chat:
            for split in splits:
                (tmp / f"{split}.loss.bin").unlink()
        meta = {
            "format": CACHE_FORMAT,
            "source": data_path,
            "text_field": text_field,
            "tokenizer": tokenizer.identity,
            "dtype": np.dtype(dtype).name,
            "chat": chat,
            **{f"{name}_tokens": split.tokens for name, split in splits.items()},
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "meta.json").exists():
                raise
    finally:
        bar.close()
        for split in splits.values():
            split.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _check_held_out(data_path: str, held_out, names: list[str], held: int) -> None:
    known = set(names)
    missing = [n for n in held_out if n not in known]
    if missing:
        shown = names if len(names) <= 20 else [*names[:20], "..."]
        raise ValueError(
            f"val_documents names {missing} not in {data_path!r}; its documents are "
            f"{shown}; name some of them (comma-separated) or set data.val_documents=null"
        )
    if held_out and held == len(names):
        raise ValueError(
            f"val_documents holds out every document of {data_path!r}, leaving no training "
            "text; hold out fewer"
        )

"""Training data: text tokenized once into cached token files, packed into fixed-length windows.

Every document is tokenized and followed by the tokenizer's end-of-sequence id; the last
``val_fraction`` of each document's tokens goes to validation, so every source is represented in
both splits, or (``val_documents``) whole documents are held out for validation. The token streams are written once to ``<cache_dir>/<key>/{train,val}.bin`` (raw
uint16 or uint32, read back with ``np.memmap``); the key hashes the source bytes, the tokenizer and
the split, so a changed corpus or tokenizer never reuses a stale cache.

Packing cuts a stream into non-overlapping windows of ``seq_len + 1`` tokens (inputs and shifted
targets share one window). The training order is a permutation of the windows per epoch drawn
from ``(seed, epoch)``, so the batch at any position is a pure function of the seed and the
position: resuming needs only the position, which the checkpoint stores.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coat_jax.runs import tokenizer_identity
from coat_jax.tokenizer import ByteTokenizer, load_tokenizer

_CACHE_FORMAT = 1
REPO_ROOT = Path(__file__).resolve().parents[2]


class Tokenizer:
    """What the data pipeline needs of a tokenizer: ``encode``, ``eos_id``, size and identity.

    Wraps ``coat_jax.tokenizer.ByteTokenizer`` or a transformers tokenizer. ``identity`` names the
    exact vocabulary (a hash of the fast tokenizer's JSON), so caches and checkpoints made with
    another tokenizer are never mistaken for this one's.
    """

    def __init__(self, tok, source: str):
        self._tok = tok
        self._fast = getattr(tok, "backend_tokenizer", None)
        self.identity = tokenizer_identity(tok)
        if isinstance(tok, ByteTokenizer):
            self.vocab_size = tok.vocab_size
        elif self._fast is not None:
            self.vocab_size = len(tok)
        else:
            raise ValueError(
                f"tokenizer from {source!r} ({type(tok).__name__}) is not a fast tokenizer; "
                "use tokenizer=byte or a folder with tokenizer.json"
            )
        eos = getattr(tok, "eos_token_id", None)
        if eos is None:
            raise ValueError(
                f"tokenizer from {source!r} has no end-of-sequence token, so documents cannot "
                "be separated; use tokenizer=byte or a tokenizer with an eos token"
            )
        self.eos_id = int(eos)

    def encode(self, text: str) -> np.ndarray:
        # One call per document: splitting it first could change the tokens at the cut points.
        if self._fast is not None:
            ids = self._fast.encode(text, add_special_tokens=False).ids
        else:
            ids = self._tok.encode(text)
        return np.asarray(ids, dtype=np.int64)

    def encode_many(self, texts: list[str], batch_chars: int = 1 << 26) -> Iterator[np.ndarray]:
        """``encode`` of each text, in order. A fast tokenizer encodes up to as many documents
        at once as there are cores, and at most ``batch_chars`` characters of them (a document
        longer than that alone): each document whole, so the tokens equal ``encode``'s. A
        corpus of many large documents tokenizes on every core instead of one; the bound keeps
        the tokenizer's per-token records of a batch (about 100 bytes a token) to a few GB.
        """
        if self._fast is None or self._fast.padding is not None:
            # A tokenizer that pads would pad a batch to its longest document: one at a time.
            yield from (self.encode(t) for t in texts)
            return
        cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        most = max(1, len(cores) if cores else os.cpu_count() or 1)
        start = 0
        while start < len(texts):
            end, chars = start + 1, len(texts[start])
            while (
                end < len(texts) and end - start < most and chars + len(texts[end]) <= batch_chars
            ):
                chars += len(texts[end])
                end += 1
            for enc in self._fast.encode_batch(texts[start:end], add_special_tokens=False):
                yield np.asarray(enc.ids, dtype=np.int64)
            start = end

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def make_tokenizer(spec: str, init_from: str | None) -> Tokenizer:
    """``"byte"``, ``"init_from"`` (the checkpoint's own tokenizer) or a tokenizer path."""
    if spec == "byte":
        return Tokenizer(ByteTokenizer(), spec)
    if spec == "init_from":
        if init_from is None:
            raise ValueError("tokenizer=init_from needs init_from to name a checkpoint")
        spec = init_from
    return Tokenizer(load_tokenizer(spec), spec)


def resolve_path(path: str) -> Path:
    """Finds a relative path in the working directory first, then in the repository root."""
    p = Path(path).expanduser()
    if p.is_absolute():
        candidates = [p]
    else:
        candidates = [Path.cwd() / p, REPO_ROOT / p]
    for c in candidates:
        if c.exists():
            return c
    tried = ", ".join(repr(str(c)) for c in candidates)
    raise ValueError(f"data path {path!r} does not exist (looked for {tried})")


def _utf8(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"data file {where} is not UTF-8 text (byte {e.start}: {e.reason}); convert it to "
            "UTF-8 or leave it out of data_path"
        ) from None


def read_documents(path: Path) -> list[tuple[str, str]]:
    """Reads ``(name, text)`` pairs from a .txt file, a directory of them, or a tar archive.

    Raises:
      ValueError: a file is not UTF-8 (the message names it), or there is no text at all.
    """
    if path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in (".txt", ".md"))
        docs = [(str(f.relative_to(path)), _utf8(f.read_bytes(), repr(str(f)))) for f in files]
    elif tarfile.is_tarfile(path):
        with tarfile.open(path) as tar:
            members = sorted((m for m in tar.getmembers() if m.isfile()), key=lambda m: m.name)
            docs = [
                (m.name, _utf8(tar.extractfile(m).read(), f"{m.name!r} in {str(path)!r}"))
                for m in members
            ]
    else:
        docs = [(path.name, _utf8(path.read_bytes(), repr(str(path))))]
    docs = [(name, text) for name, text in docs if text.strip()]
    if not docs:
        raise ValueError(f"no text documents found in {str(path)!r}")
    return docs


def _source_digest(path: Path) -> str:
    h = hashlib.sha256()
    files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
    for f in files:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class TokenFiles:
    train: np.ndarray
    val: np.ndarray
    directory: Path
    # Seconds this call spent building the cache: reading, tokenizing and writing the corpus
    # (None: the cache was there already).
    tokenized_s: float | None = None


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
) -> TokenFiles:
    """Tokenizes the corpus once and memory-maps the cached train and validation token files.

    With ``val_documents`` (comma-separated document names, as :func:`read_documents` names
    them) those documents are held out whole for validation and the others are all training
    text: a split by document, so no validation text is ever trained on. Otherwise the last
    ``val_fraction`` of every document is held out.
    """
    source = resolve_path(data_path)
    held_out = split_names(val_documents)
    key_parts = [_CACHE_FORMAT, _source_digest(source), tokenizer.identity, val_fraction]
    if held_out:
        key_parts = [*key_parts[:3], {"val_documents": list(held_out)}]
    key = hashlib.sha256(json.dumps(key_parts).encode()).hexdigest()[:24]
    root = Path(cache_dir).expanduser()
    final = root / key
    tokenized_s = None
    if not (final / "meta.json").exists():
        started = time.perf_counter()
        _write_cache(source, tokenizer, val_fraction, root, final, held_out)
        tokenized_s = time.perf_counter() - started
    meta = json.loads((final / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"])
    train = np.memmap(final / "train.bin", dtype=dtype, mode="r")
    val = np.memmap(final / "val.bin", dtype=dtype, mode="r")
    if len(train) != meta["train_tokens"] or len(val) != meta["val_tokens"]:
        raise ValueError(f"token cache {str(final)!r} is truncated; delete it to re-tokenize")
    return TokenFiles(train=train, val=val, directory=final, tokenized_s=tokenized_s)


def _write_cache(
    source: Path, tokenizer: Tokenizer, val_fraction: float, root: Path, final: Path, held_out=()
) -> None:
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    documents = read_documents(source)
    names = [name for name, _ in documents]
    missing = [n for n in held_out if n not in names]
    if missing:
        raise ValueError(
            f"val_documents names {missing} not in {str(source)!r}; its documents are "
            f"{names}; name some of them (comma-separated) or set val_documents=null"
        )
    if held_out and len(held_out) == len(names):
        raise ValueError(
            f"val_documents holds out every document of {str(source)!r}, leaving no training "
            "text; hold out fewer"
        )
    train_parts, val_parts = [], []
    encoded = tokenizer.encode_many([text for _, text in documents])
    for (name, _), doc_ids in zip(documents, encoded, strict=True):
        ids = np.concatenate([doc_ids, [tokenizer.eos_id]])
        if held_out:
            (val_parts if name in held_out else train_parts).append(ids)
            continue
        cut = int(round(len(ids) * (1.0 - val_fraction)))
        train_parts.append(ids[:cut])
        val_parts.append(ids[cut:])
    train = np.concatenate(train_parts).astype(dtype)
    val = np.concatenate(val_parts).astype(dtype)
    root.mkdir(parents=True, exist_ok=True)
    # Written in a scratch directory and renamed into place, so a crash never leaves a cache
    # that looks complete; a concurrent writer that wins the rename is equally good.
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
    try:
        train.tofile(tmp / "train.bin")
        val.tofile(tmp / "val.bin")
        meta = {
            "format": _CACHE_FORMAT,
            "source": str(source),
            "tokenizer": tokenizer.identity,
            "dtype": np.dtype(dtype).name,
            "train_tokens": len(train),
            "val_tokens": len(val),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "meta.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class PackedWindows:
    """Non-overlapping windows of ``seq_len + 1`` tokens over a token stream."""

    def __init__(self, tokens: np.ndarray, seq_len: int, split: str):
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(
                f"the {split} split has {len(tokens)} tokens, too few for one window of "
                f"seq_len={seq_len}; use a shorter seq_len or more data"
            )

    def gather(self, window_ids: np.ndarray) -> np.ndarray:
        starts = np.asarray(window_ids, dtype=np.int64) * self.seq_len
        offsets = np.arange(self.seq_len + 1)
        return np.asarray(self.tokens[starts[:, None] + offsets], dtype=np.int32)


class TrainOrder:
    """Shuffled window order; batch ``k`` of any run with this seed is the same windows."""

    def __init__(self, windows: PackedWindows, seed: int):
        self.windows = windows
        self.seed = seed
        self._epoch = -1
        self._perm = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm = rng.permutation(self.windows.num_windows)
            self._epoch = epoch
        return self._perm

    def take(self, position: int, count: int) -> np.ndarray:
        """The ``count`` windows starting at sequence ``position``, as int32 ``[count, T + 1]``."""
        ids = np.empty(count, dtype=np.int64)
        for i in range(count):
            epoch, j = divmod(position + i, self.windows.num_windows)
            ids[i] = self._permutation(epoch)[j]
        return self.windows.gather(ids)


def validation_batches(windows: PackedWindows, batch_size: int, num_batches: int) -> Iterator:
    """The first ``num_batches`` full batches of validation windows, in corpus order."""
    available = windows.num_windows // batch_size
    if available < 1:
        raise ValueError(
            f"validation split has {windows.num_windows} windows, fewer than batch_size="
            f"{batch_size}; raise val_fraction or lower batch_size"
        )
    for b in range(min(num_batches, available)):
        yield windows.gather(np.arange(b * batch_size, (b + 1) * batch_size))

"""Where training text comes from: files of several formats, read into named documents.

A source is a path: a ``.txt``/``.md`` file, a tar archive of text files, a ``.jsonl``, ``.json``
(an array of records), ``.parquet`` or ``.arrow`` file, a folder holding any of these, a glob
pattern (``data/*.jsonl``), or a folder written by Hugging Face ``datasets.save_to_disk``. A
folder reads its files of these kinds, but ``.json`` files only when named or globbed. A text
file is one document (one larger than ``STREAMED_TEXT_BYTES`` is read a piece at a time as it
is tokenized: a :class:`TextFile`); a record is one document, its ``text_field`` a plain text
or, for a record without that field, a ``messages`` list (``role``/``content``) of a chat
(docs/data.md). Every error names the file and the record (line or row) and the fix.
"""

from __future__ import annotations

import codecs
import dataclasses
import glob
import hashlib
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

REPO_ROOT = Path(__file__).resolve().parents[3]
TEXT_SUFFIXES = (".txt", ".md")
RECORD_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
CHAT_ROLES = ("system", "user", "assistant", "tool")
# A text file larger than this is read TEXT_PIECE_BYTES at a time as it is tokenized, so that
# memory holds a piece of it, not the whole file (docs/data.md, "The token cache"). A smaller
# one is read whole: the cache's chunk of documents may hold as many characters, and a Hugging
# Face tokenizer encodes whole files several at once, on every core.
STREAMED_TEXT_BYTES = 1 << 26
TEXT_PIECE_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class TextFile:
    """A text file's document read a piece at a time: a file larger than
    ``STREAMED_TEXT_BYTES``.

    ``pieces()`` decodes the file ``TEXT_PIECE_BYTES`` bytes at a time; a character whose UTF-8
    bytes a piece's edge cuts is completed from the next piece, so the pieces join to the
    file's text, and a file that is not UTF-8 fails as decoding it whole would, naming the same
    byte.
    """

    path: Path

    def pieces(self) -> Iterator[str]:
        decoder = codecs.getincrementaldecoder("utf-8")()
        offset = 0
        with open(self.path, "rb") as fh:
            while True:
                raw = fh.read(TEXT_PIECE_BYTES)
                held = len(decoder.getstate()[0])
                try:
                    text = decoder.decode(raw, final=not raw)
                except UnicodeDecodeError as e:
                    raise _not_utf8(
                        repr(str(self.path)), offset - held + e.start, e.reason
                    ) from None
                offset += len(raw)
                if text:
                    yield text
                if not raw:
                    return

    def read(self) -> str:
        return "".join(self.pieces())


# A document's value: its text, a large text file's (read as it is tokenized), or a chat's
# messages.
Document = tuple[str, "str | TextFile | list[dict[str, str]]"]


@dataclasses.dataclass(frozen=True)
class DataSource:
    """One source of a mixture: a path, its share of the training windows, its text field.

    ``weight`` is relative (the weights of a mixture need not sum to 1); ``text_field`` null:
    the config's ``text_field``.
    """

    path: str
    weight: float = 1.0
    text_field: str | None = None

    def __post_init__(self):
        if not self.weight > 0:
            raise ValueError(
                f"source {self.path!r} has weight {self.weight}; a mixture weight must be a "
                "positive number (leave the source out instead of weighting it 0)"
            )


def resolve_path(path: str) -> Path:
    """Finds a relative path in the working directory first, then in the repository root."""
    p = Path(path).expanduser()
    candidates = [p] if p.is_absolute() else [Path.cwd() / p, REPO_ROOT / p]
    for c in candidates:
        if c.exists():
            return c
    tried = ", ".join(repr(str(c)) for c in candidates)
    raise ValueError(f"data path {path!r} does not exist (looked for {tried})")


def source_files(path: str) -> tuple[Path, list[Path]]:
    """The root a source's document names are relative to, and its files in reading order.

    A glob pattern is matched in the working directory first, then in the repository root; a
    ``save_to_disk`` folder gives its Arrow files in the order of its ``state.json``.
    """
    if any(c in path for c in "*?["):
        for base in (Path.cwd(), REPO_ROOT):
            pattern = path if Path(path).expanduser().is_absolute() else str(base / path)
            files = sorted(
                Path(f) for f in glob.glob(str(Path(pattern).expanduser()), recursive=True)
            )
            files = [f for f in files if f.is_file()]
            if files:
                return Path(_glob_root(str(Path(pattern).expanduser()))), files
        raise ValueError(f"data path pattern {path!r} matches no file; check the pattern")
    root = resolve_path(path)
    if not root.is_dir():
        return root.parent, [root]
    if (root / "dataset_dict.json").exists():
        splits = json.loads((root / "dataset_dict.json").read_text()).get("splits", [])
        raise ValueError(
            f"{str(root)!r} holds a DatasetDict (splits {splits}); name one split's folder, "
            f"e.g. {str(root / (splits[0] if splits else 'train'))!r}"
        )
    if (root / "state.json").exists():
        state = json.loads((root / "state.json").read_text())
        return root, [root / f["filename"] for f in state.get("_data_files", [])]
    # A folder's .json files are left out: folders often keep metadata in JSON beside the
    # data. A .json source is named itself, or matched by a glob.
    folder_suffixes = set(TEXT_SUFFIXES + RECORD_SUFFIXES) - {".json"}
    files = sorted(f for f in root.rglob("*") if f.is_file() and f.suffix in folder_suffixes)
    return root, files


def _glob_root(pattern: str) -> str:
    parts = Path(pattern).parts
    fixed = [p for p in parts[: next(i for i, p in enumerate(parts) if any(c in p for c in "*?["))]]
    return str(Path(*fixed)) if fixed else "."


def source_digest(path: str, text_field: str) -> str:
    """A hash of everything a source's documents depend on: its files' names and bytes."""
    root, files = source_files(path)
    h = hashlib.sha256(json.dumps(["text_field", text_field]).encode())
    for f in files:
        h.update(str(f.relative_to(root)).encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def read_documents(path: str | Path, text_field: str = "text") -> list[Document]:
    """Reads ``(name, document)`` pairs of a source, in order, a text file's text whole; empty
    texts are left out."""
    return [
        (name, doc.read() if isinstance(doc, TextFile) else doc)
        for name, doc, _ in read_source(path, text_field)
    ]


def read_source(path: str | Path, text_field: str = "text") -> Iterator[tuple[str, Any, bool]]:
    """``(name, document, is_record)`` of a source, in order, one at a time (a record file is
    read a line or a batch of rows at a time, a text file larger than ``STREAMED_TEXT_BYTES``
    given as a :class:`TextFile` to read a piece at a time); empty texts are left out.

    A text file's name is its path relative to the source's folder (a tar member's, its name in
    the archive); a record's is its file's name and ``:LINE`` (JSON Lines) or ``:ROW``
    (0-based, Parquet, Arrow and JSON arrays).

    Raises:
      ValueError: one line naming the file, the record and the fix (not UTF-8, not valid
        JSON, no ``text_field``, a bad chat, an unreadable file), or, once the source is read,
        no text at all.
    """
    root, files = source_files(str(path))
    found = False
    for f in files:
        name = str(f.relative_to(root)) if f != root else f.name
        if f.suffix in RECORD_SUFFIXES:
            docs = ((n, d, True) for n, d in _read_records(f, name, text_field))
        elif tarfile.is_tarfile(f):
            docs = _read_tar(f)
        else:
            docs = [(name, _text_file(f), False)]
        for doc in docs:
            if _has_text(doc[1]):
                found = True
                yield doc
    if not found:
        raise ValueError(
            f"no documents found in {str(path)!r}; point data_path at text, .jsonl, .json, "
            ".parquet or .arrow files that hold some"
        )


def _read_tar(f: Path) -> Iterator[tuple[str, str, bool]]:
    with tarfile.open(f) as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile()), key=lambda m: m.name)
        for m in members:
            raw = tar.extractfile(m).read()
            yield m.name, _utf8(raw, f"{m.name!r} in {str(f)!r}"), False


def _text_file(f: Path) -> str | TextFile:
    if f.stat().st_size > STREAMED_TEXT_BYTES:
        return TextFile(f)
    return _utf8(f.read_bytes(), repr(str(f)))


def _has_text(document: str | TextFile | list) -> bool:
    """Whether a document is more than whitespace (a chat always is)."""
    if isinstance(document, str):
        return bool(document) and not document.isspace()
    if isinstance(document, TextFile):
        return any(not piece.isspace() for piece in document.pieces())
    return True


def _utf8(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(where, e.start, e.reason) from None


def _not_utf8(where: str, byte: int, reason: str) -> ValueError:
    return ValueError(
        f"data file {where} is not UTF-8 text (byte {byte}: {reason}); convert it to UTF-8 or "
        "leave it out of data_path"
    )


def _read_records(f: Path, name: str, text_field: str) -> Iterator[Document]:
    where = repr(str(f))
    if f.suffix == ".jsonl":
        with open(f, "rb") as fh:
            for line_no, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                line = _utf8(raw, f"{where} line {line_no}")
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"data file {where} line {line_no} is not valid JSON ({e.msg}, column "
                        f"{e.colno}); fix or delete that line"
                    ) from None
                yield _document(record, f"{where} line {line_no}", text_field, f"{name}:{line_no}")
        return
    if f.suffix == ".json":
        text = _utf8(f.read_bytes(), where)
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"data file {where} is not valid JSON ({e.msg} at line {e.lineno}, column "
                f"{e.colno}); fix it there (one record a line: save it as .jsonl)"
            ) from None
        if not isinstance(records, list):
            raise ValueError(
                f"data file {where} holds a JSON {type(records).__name__}, not an array of "
                "records; write [{...}, {...}] or one record a line in a .jsonl file"
            )
        for i, r in enumerate(records):
            yield _document(r, f"{where} record {i}", text_field, f"{name}:{i}")
        return
    row = 0
    for batch in _record_batches(f, text_field):
        for r in batch.to_pylist():
            yield _document(r, f"{where} row {row}", text_field, f"{name}:{row}")
            row += 1


def _record_batches(f: Path, text_field: str) -> Iterator[pa.RecordBatch]:
    """The rows of a Parquet or Arrow file a batch at a time, only the text field's column (or,
    without one, a chat's ``messages``)."""
    kind = "Parquet" if f.suffix == ".parquet" else "Arrow"
    try:
        if f.suffix == ".parquet":
            reader = pq.ParquetFile(f)
            names = reader.schema_arrow.names
            columns = [text_field] if text_field in names else ["messages"]
            if columns[0] in names:
                yield from reader.iter_batches(columns=columns)
        else:
            with pa.memory_map(str(f)) as source:
                reader = pa.ipc.open_stream(source)
                names = reader.schema.names
                if text_field in names or "messages" in names:
                    column = text_field if text_field in names else "messages"
                    for batch in reader:
                        yield batch.select([column])
    except (pa.ArrowException, OSError) as e:
        raise ValueError(
            f"data file {str(f)!r} is not a readable {kind} file ({e}); rewrite it or leave "
            "it out of data_path"
        ) from None
    if text_field not in names and "messages" not in names:
        raise ValueError(
            f"data file {str(f)!r} has no column {text_field!r} (its columns: {names}); set "
            "text_field to the one holding the text"
        )


def _document(record: Any, where: str, text_field: str, name: str) -> Document:
    if not isinstance(record, dict):
        raise ValueError(
            f"data file {where} is a JSON {type(record).__name__}, not a record; write "
            f'{{"{text_field}": "..."}}'
        )
    if text_field in record:
        text = record[text_field]
        if not isinstance(text, str):
            raise ValueError(
                f"data file {where}: field {text_field!r} is a {type(text).__name__}, not text; "
                "make it a string"
            )
        return name, text
    if "messages" in record:
        return name, _chat(record["messages"], where)
    raise ValueError(
        f"data file {where} has no field {text_field!r} (its fields: {sorted(record)}); set "
        "text_field to the one holding the text, or give chats a 'messages' list"
    )


def _chat(messages: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"data file {where}: 'messages' must be a non-empty list of "
            '{"role": ..., "content": ...}'
        )
    out = []
    for i, m in enumerate(messages):
        ok = isinstance(m, dict) and isinstance(m.get("content"), str)
        if not ok:
            raise ValueError(
                f"data file {where}: message {i} is not a record with a text 'content'; write "
                '{"role": "user", "content": "..."}'
            )
        if m.get("role") not in CHAT_ROLES:
            raise ValueError(
                f"data file {where}: message {i} has role {m.get('role')!r}; use one of "
                f"{list(CHAT_ROLES)}"
            )
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError(
            f"data file {where}: the chat has no assistant message, so nothing to train on; "
            "add one or leave the record out"
        )
    return out

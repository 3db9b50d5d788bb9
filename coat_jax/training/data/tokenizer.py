"""The data pipeline's tokenizer: plain texts, and chats rendered with a chat template.

A chat is encoded with a loss mask that is true on the tokens an assistant wrote. A Hugging Face
tokenizer renders it with its own ``chat_template``; an assistant message's tokens are those its
rendering adds after the prompt for it (``add_generation_prompt``), end-of-turn marker included.
The byte tokenizer has a built-in format (docs/data.md, "Chat data"): each message is
``<|ROLE|>`` and a newline, its content, then a newline, except that an assistant message ends
with the end-of-sequence id instead, so the model learns where to stop.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import numpy as np

from coat_jax.runs import tokenizer_identity
from coat_jax.tokenizer import ByteTokenizer, load_tokenizer


class Tokenizer:
    """What the data pipeline needs of a tokenizer: ``encode``, ``eos_id``, size and identity.

    Wraps ``coat_jax.tokenizer.ByteTokenizer`` or a transformers tokenizer. ``identity`` names the
    exact vocabulary (a hash of the fast tokenizer's JSON), so caches and checkpoints made with
    another tokenizer are never mistaken for this one's.
    """

    def __init__(self, tok, source: str):
        self._tok = tok
        self._source = source
        self._fast = getattr(tok, "backend_tokenizer", None)
        self.identity = tokenizer_identity(tok)
        if isinstance(tok, ByteTokenizer):
            self.vocab_size = tok.vocab_size
        elif self._fast is not None:
            self.vocab_size = len(tok)
        else:
            raise ValueError(
                f"tokenizer from {source!r} ({type(tok).__name__}) is not a fast tokenizer; "
                "use data.tokenizer=byte or a folder with tokenizer.json"
            )
        eos = getattr(tok, "eos_token_id", None)
        if eos is None:
            raise ValueError(
                f"tokenizer from {source!r} has no end-of-sequence token, so documents cannot "
                "be separated; use data.tokenizer=byte or a tokenizer with an eos token"
            )
        self.eos_id = int(eos)

    def encode(self, text: str) -> np.ndarray:
        # One call per document: splitting it first could change the tokens at the cut points.
        if self._fast is not None:
            ids = self._fast.encode(text, add_special_tokens=False).ids
        elif isinstance(self._tok, ByteTokenizer):
            # ByteTokenizer.encode's ids without a Python int per byte: the UTF-8 bytes are them.
            return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64)
        else:
            ids = self._tok.encode(text)
        return np.asarray(ids, dtype=np.int64)

    def encode_pieces(self, pieces: Iterable[str]) -> Iterator[np.ndarray]:
        """``encode`` of the text that ``pieces`` join to, in order. The byte tokenizer encodes
        a piece at a time (a text's UTF-8 bytes are its pieces' bytes one after another), so a
        large text is never whole in memory; any other tokenizer could tokenize differently at
        the cut points, so it encodes the joined text at once."""
        if isinstance(self._tok, ByteTokenizer):
            yield from map(self.encode, pieces)
        else:
            yield self.encode("".join(pieces))

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

    def encode_chat(
        self, messages: list[dict[str, str]], where: str
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, assistant)``: a chat's tokens and a mask true on the assistant's tokens."""
        if isinstance(self._tok, ByteTokenizer):
            return _byte_chat(messages, self.eos_id)
        template = getattr(self._tok, "chat_template", None)
        if not template:
            raise ValueError(
                f"tokenizer from {self._source!r} has no chat template, and {where} is a chat; "
                "use an instruct model's tokenizer (one with chat_template) or data.tokenizer=byte"
            )
        render = lambda msgs, prompt: self._tok.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=prompt
        )
        text = render(messages, False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = len(render(messages[:i], True)) if i else 0
            end = len(render(messages[: i + 1], False))
            if not text.startswith(render(messages[: i + 1], False)):
                raise ValueError(
                    f"the chat template of {self._source!r} does not render {where} turn by "
                    "turn (an earlier turn renders differently later), so the assistant's "
                    "tokens cannot be found; use another tokenizer's template"
                )
            spans.append((start, end))
        enc = self._fast.encode(text, add_special_tokens=False)
        starts = np.asarray([s for s, _ in enc.offsets], dtype=np.int64)
        assistant = np.zeros(len(starts), dtype=bool)
        for s, e in spans:
            assistant |= (starts >= s) & (starts < e)
        return np.asarray(enc.ids, dtype=np.int64), assistant

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def _byte_chat(messages, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    ids, assistant = [], []
    for m in messages:
        header = list(f"<|{m['role']}|>\n".encode())
        body = list(m["content"].encode())
        mine = m["role"] == "assistant"
        end = [eos_id] if mine else list(b"\n")
        ids += header + body + end
        assistant += [False] * len(header) + [mine] * (len(body) + len(end))
    return np.asarray(ids, dtype=np.int64), np.asarray(assistant, dtype=bool)


def make_tokenizer(spec: str, init_from: str | None) -> Tokenizer:
    """``"byte"``, ``"init_from"`` (the checkpoint's own tokenizer) or a tokenizer path."""
    if spec == "byte":
        return Tokenizer(ByteTokenizer(), spec)
    if spec == "init_from":
        if init_from is None:
            raise ValueError("data.tokenizer=init_from needs init_from to name a checkpoint")
        spec = init_from
    return Tokenizer(load_tokenizer(spec), spec)

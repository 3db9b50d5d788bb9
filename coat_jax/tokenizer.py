"""Tokenizers: a checkpoint's own (local folder or GGUF file) and a byte-level one for training."""

from __future__ import annotations

import os


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer that belongs to a checkpoint, from local files only.

    Args:
      path: a Hugging Face or coat-jax folder holding tokenizer files (tokenizer.json, ...),
        or a `.gguf` file whose metadata holds the vocabulary.

    Returns:
      A transformers tokenizer (`tok(text)["input_ids"]`, `tok.decode(ids)`).
    """
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        from coat_jax.gguf_io import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is neither a checkpoint folder nor a .gguf file")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"no usable tokenizer files in {path}: {e}") from e


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus BOS and EOS; needs no vocabulary file.

    Examples:
      >>> tok = ByteTokenizer()
      >>> tok.decode(tok.encode("héllo"))
      'héllo'
    """

    vocab_size = 258
    bos_token_id = 256
    eos_token_id = 257

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return (
            ([self.bos_token_id] if add_bos else [])
            + ids
            + ([self.eos_token_id] if add_eos else [])
        )

    def decode(self, ids) -> str:
        """Drops BOS/EOS; invalid UTF-8 (a cut multi-byte character) becomes U+FFFD."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside 0..{self.vocab_size - 1}")
        data = bytes(i for i in ids if i < 256)
        return data.decode("utf-8", errors="replace")

"""Training data: sources read into documents, tokenized once into caches, packed into windows.

:mod:`~coat_jax.training.data.sources` reads the formats (docs/data.md),
:mod:`~coat_jax.training.data.tokenizer` encodes texts and chats,
:mod:`~coat_jax.training.data.cache` writes and maps the token caches, and
:mod:`~coat_jax.training.data.order` packs windows and orders them (one source or a mixture).
"""

from coat_jax.training.data.cache import CACHE_FORMAT, TokenFiles, split_names, tokenize_to_cache
from coat_jax.training.data.order import (
    DOCUMENT_START,
    MIXTURE_BLOCK,
    InterleavedWindows,
    MixtureOrder,
    PackedWindows,
    TrainOrder,
    loss_tokens,
    mixture_counts,
    targets,
    validation_window_ids,
)
from coat_jax.training.data.settings import (
    DEFAULT_DATA_PATH,
    check_data_keys,
    data_sources,
    planned_data_flags,
    within_documents,
)
from coat_jax.training.data.sources import (
    DataSource,
    TextFile,
    read_documents,
    read_source,
    resolve_path,
    source_files,
)
from coat_jax.training.data.tokenizer import Tokenizer, make_tokenizer

__all__ = [
    "CACHE_FORMAT",
    "DEFAULT_DATA_PATH",
    "DOCUMENT_START",
    "MIXTURE_BLOCK",
    "DataSource",
    "InterleavedWindows",
    "MixtureOrder",
    "PackedWindows",
    "TextFile",
    "TokenFiles",
    "Tokenizer",
    "TrainOrder",
    "check_data_keys",
    "data_sources",
    "loss_tokens",
    "make_tokenizer",
    "mixture_counts",
    "read_documents",
    "read_source",
    "resolve_path",
    "source_files",
    "split_names",
    "tokenize_to_cache",
    "targets",
    "validation_window_ids",
    "planned_data_flags",
    "within_documents",
]

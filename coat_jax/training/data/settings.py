"""The data keys of the training config, checked together (docs/data.md)."""

from __future__ import annotations

from coat_jax.training.data.cache import split_names
from coat_jax.training.data.sources import DataSource, read_source

DEFAULT_DATA_PATH = "data/public_domain_en.tar.xz"


def check_data_keys(cfg) -> None:
    """Raises ``ValueError`` naming the fix for data keys that contradict each other."""
    if not 0.0 < cfg.val_fraction < 0.5:
        raise ValueError(f"val_fraction must be in (0, 0.5), got {cfg.val_fraction}")
    if cfg.val_documents is not None and not split_names(cfg.val_documents):
        raise ValueError(
            "val_documents must name documents (comma-separated, e.g. "
            "austen/persuasion.txt) or be null (a val_fraction of every document)"
        )
    if cfg.sources is not None:
        if not cfg.sources:
            raise ValueError("sources is an empty list; name at least one {path: ...}, or null")
        if cfg.data_path != DEFAULT_DATA_PATH:
            raise ValueError(
                f"data.path={cfg.data_path!r} and sources are both set; put that path in "
                "sources, or set data.sources=null"
            )
        if cfg.val_documents is not None and len(cfg.sources) > 1:
            raise ValueError(
                "val_documents names documents of one source, and sources has "
                f"{len(cfg.sources)}; hold out with val_fraction, or use one source"
            )
    if cfg.attention_across_documents is False and cfg.fp8_attention_backward != "recompute":
        raise ValueError(
            f"data.attention_across_documents=false masks attention between documents, and "
            f"precision.fp8_attention_backward={cfg.fp8_attention_backward} cannot take that "
            "mask; set precision.fp8_attention_backward=recompute, or "
            "data.attention_across_documents=true"
        )
    if not cfg.text_field:
        raise ValueError("text_field is empty; name the field that holds the text, e.g. text")


def within_documents(cfg, chat: bool) -> bool:
    """Whether attention stays within documents: ``attention_across_documents`` false, or
    unset with data that has chats."""
    across = cfg.attention_across_documents
    return not (across if across is not None else not chat)


def data_sources(cfg) -> tuple[DataSource, ...]:
    """The run's sources: ``sources``, or ``data_path`` alone with weight 1."""
    if cfg.sources is None:
        return (DataSource(cfg.data_path),)
    return cfg.sources


def planned_data_flags(cfg) -> tuple[bool, bool]:
    """``(chat, within_documents)`` of the run's data as the planner sees it, without
    tokenizing: a source holds chats when its first document is one. The run itself decides
    from every document as it tokenizes (a source whose first document is plain text and a later
    one a chat is planned as plain text)."""
    chat = any(
        isinstance(next(read_source(s.path, s.text_field or cfg.text_field))[1], list)
        for s in data_sources(cfg)
    )
    return chat, within_documents(cfg, chat)

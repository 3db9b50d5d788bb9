"""``fp8_op_kernels``: the per-op exceptions to ``fp8_kernels``, in their text and mapping forms.

The config field holds one stored form, the text ``"op=implementation;..."``; a YAML mapping
``{op: implementation}`` (in a file, or ``fp8_op_kernels.OP=IMPL`` on the command line) is turned
into it, and the model takes the parsed pairs as ``FP8Config.op_implementations``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from coat_jax.fp8_ops import check_op_implementations


def parse_op_kernels(text: str | None) -> tuple[tuple[str, str], ...]:
    """``fp8_op_kernels`` (``"op=implementation;..."``) as ``FP8Config.op_implementations``.

    ``ValueError`` names a malformed entry, an unknown op or implementation, or a repeated op.
    """
    if text is None:
        return ()
    pairs = []
    for entry in (e.strip() for e in str(text).split(";")):
        op, sep, implementation = entry.partition("=")
        if not sep or not op.strip() or not implementation.strip():
            raise ValueError(
                f"fp8_op_kernels entry {entry!r} is not op=implementation; write e.g. "
                "fp8_op_kernels='quantize_per_tensor=pallas;swiglu=xla'"
            )
        pairs.append((op.strip(), implementation.strip()))
    try:
        return check_op_implementations(tuple(pairs))
    except ValueError as e:
        raise ValueError(f"fp8_op_kernels={text!r}: {e}") from None


def op_kernels_text(mapping: Mapping[str, Any]) -> str:
    """A YAML mapping ``{op: implementation}`` for ``fp8_op_kernels`` as its
    ``"op=implementation;..."`` text (the field's one stored form)."""
    bad = {k: v for k, v in mapping.items() if not isinstance(k, str) or not isinstance(v, str)}
    if bad or not mapping:
        raise ValueError(
            f"fp8_op_kernels={dict(mapping)!r}: a mapping must name at least one op and map "
            "each op name to an implementation name (auto, xla or pallas), e.g. "
            "{swiglu: pallas, rmsnorm: xla}"
        )
    return ";".join(f"{op}={implementation}" for op, implementation in mapping.items())


def op_kernels_as_mapping(raw: dict) -> None:
    """``raw["fp8_op_kernels"]`` in its text form becomes a mapping, so that one op's setting
    (``fp8_op_kernels.OP=IMPL``, or a mapping in a file over a ``base:`` file's text) replaces
    or adds that op and keeps the others, as over a mapping."""
    if isinstance(raw.get("fp8_op_kernels"), str):
        raw["fp8_op_kernels"] = dict(parse_op_kernels(raw["fp8_op_kernels"]))

"""Config values as files and command lines give them: YAML files with a ``base:`` chain,
dotted ``section.key`` overrides, and each value checked against its field's type.

:mod:`coat_jax.training.config` builds a :class:`~coat_jax.training.config.TrainConfig` with
these; they know nothing of its keys.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

from coat_jax.training.kernel_choice import check_kernels, kernels_mapping


def read_config_file(path: str | Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The mapping of a YAML config file, its ``base:`` chain merged in (the file's keys win)."""
    path = Path(path)
    path = path.expanduser().resolve()
    if path in seen:
        chain = " -> ".join(str(p) for p in (*seen, path))
        raise ValueError(f"config base cycle: {chain}")
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    with open(path) as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
            problem = getattr(e, "problem", None) or type(e).__name__
            raise ValueError(
                f"config file {str(path)!r} is not valid YAML{where}: {problem}; fix the syntax "
                "there (python train.py --help lists the keys)"
            ) from None
    if not isinstance(data, dict):
        raise ValueError(
            f"config file {str(path)!r} must hold a mapping, got {type(data).__name__}"
        )
    base = data.pop("base", None)
    if base is None:
        return data
    merged = read_config_file(path.parent / base, (*seen, path))
    if isinstance(data.get("kernels"), Mapping) and "kernels" in merged:
        # A mapping over a base file's name changes the parts it names and keeps the others.
        merged["kernels"] = kernels_mapping(check_kernels(merged["kernels"]))
    deep_update(merged, data)
    return merged


def deep_update(dst: dict, src: Mapping) -> None:
    """Updates ``dst`` with ``src``, section by section."""
    for key, value in src.items():
        if isinstance(value, Mapping) and isinstance(dst.get(key), dict):
            deep_update(dst[key], value)
        else:
            dst[key] = value


def set_dotted(raw: dict, key: str, value: Any) -> None:
    """Sets ``section.key`` (or a top-level ``key``) of ``raw``."""
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"override {key!r}: {part!r} is not a section")
        node = child
    node[leaf] = value


def coerce(key: str, hint, value):
    """Checks ``value`` against a field type; ints are accepted where floats are expected."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ValueError(f"{key}={value!r} is not valid; choose one of {list(choices)}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for hint_i in inner[:-1]:  # e.g. batch_size: an int or "auto"
            try:
                return coerce(key, hint_i, value)
            except ValueError:
                pass
        return coerce(key, inner[-1], value)
    if origin is tuple:
        items = typing.get_args(hint)
        if not isinstance(value, list | tuple) or len(value) != len(items):
            raise ValueError(f"{key}={value!r} is not valid; expected a list of {len(items)}")
        pairs = enumerate(zip(items, value, strict=True))
        return tuple(coerce(f"{key}[{i}]", h, v) for i, (h, v) in pairs)
    if dataclasses.is_dataclass(hint):
        # An optional nested setting such as model.rope_scaling: a mapping the dataclass's owner
        # converts and validates (LlamaConfig reads Hugging Face's rope_scaling dict).
        if not isinstance(value, Mapping):
            raise ValueError(f"{key}={value!r} is not valid; expected a mapping or null")
        return dict(value)
    if hint is float and isinstance(value, str):
        # PyYAML reads "1e-3" (no dot) as a string: YAML 1.1 wants "1.0e-3". Accept both.
        try:
            value = float(value)
        except ValueError:
            pass
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
        str: isinstance(value, str),
    }[hint]
    if not ok:
        raise ValueError(f"{key}={value!r} is not valid; expected {hint.__name__}")
    return float(value) if hint is float else value

"""The names of the trainer's config keys in files and on the command line, grouped by concern.

:class:`~coat_jax.training.config.TrainConfig` keeps one flat field per key (the trainer reads
``cfg.fp8_attention``); config files, ``key=value`` overrides, recipes, ``train.py --help``,
``--print-config`` and a run's saved ``config.yaml`` name each key ``section.key`` as
:data:`SECTIONS` gives, the run-wide keys at the top level. ``model`` and ``mesh`` are sections
of their own dataclasses (``LlamaConfig``, ``MeshConfig``) and keep their fields' names. A mapping
may also spell a key dotted (``{"precision.mode": "bf16"}``), as recipes do.

This table is the one place a key's name is defined: flat keys (unsectioned names, e.g.
``fp8_attention``) are refused with their sectioned names (:func:`flatten`), and a script that
rewrites a project's flat keys reads :data:`MOVED`.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

# Section -> {key in the section: TrainConfig field}; "" holds the top-level keys. The order is
# --help's and the saved config.yaml's.
SECTIONS: dict[str, dict[str, str]] = {
    "": {
        name: name
        for name in (
            "recipe",
            "steps",
            "output_dir",
            "resume",
            "reschedule",
            "overwrite",
            "seed",
            "init_from",
            "kernels",
        )
    },
    "model": {},
    "precision": {
        "mode": "precision",
        "compute_dtype": "compute_dtype",
        "master_dtype": "master_dtype",
        "fp8_attention": "fp8_attention",
        "fp8_attention_backward": "fp8_attention_backward",
        "fp8_weight_residual": "fp8_weight_residual",
        "fp8_group_scale": "fp8_group_scale",
        "fp8_swiglu": "fp8_swiglu",
        "fp8_linear_scaling": "fp8_linear_scaling",
    },
    "memory": {
        "scan_layers": "scan_layers",
        "remat": "remat",
        "loss_chunk_size": "loss_chunk_size",
    },
    "data": {
        "path": "data_path",
        "sources": "sources",
        "text_field": "text_field",
        "attention_across_documents": "attention_across_documents",
        "document_positions": "document_positions",
        "tokenizer": "tokenizer",
        "cache_dir": "cache_dir",
        "val_fraction": "val_fraction",
        "val_documents": "val_documents",
        "seq_len": "seq_len",
        "batch_size": "batch_size",
        "grad_accum": "grad_accum",
        "global_batch_size": "global_batch_size",
    },
    "optimizer": {
        "name": "optimizer",
        "fp8_state": "fp8_state",
        "momentum": "momentum",
        "learning_rate": "learning_rate",
        "min_lr_ratio": "min_lr_ratio",
        "warmup_steps": "warmup_steps",
        "grad_clip": "grad_clip",
        "weight_decay": "weight_decay",
        "decay_norms_and_embeddings": "decay_norms_and_embeddings",
        "b1": "b1",
        "b2": "b2",
        "eps": "eps",
        "mu_format": "mu_format",
        "nu_format": "nu_format",
        "fused_apply": "fused_apply",
        "in_backward": "optimizer_in_backward",
        "skip_nonfinite_steps": "skip_nonfinite_steps",
    },
    "checkpoint": {
        "every": "checkpoint_every",
        "keep": "keep_checkpoints",
        "save_final": "save_final",
    },
    "eval": {
        "every": "eval_every",
        "batches": "eval_batches",
        "at_start": "eval_at_start",
    },
    "logging": {
        "every": "log_every",
        "progress_bar": "progress_bar",
        "tensorboard": "tensorboard",
        "wandb_project": "wandb_project",
        "wandb_mode": "wandb_mode",
        "profile_steps": "profile_steps",
        "telemetry": "telemetry",
        "sample_prompt": "sample_prompt",
        "sample_tokens": "sample_tokens",
    },
    "xla": {
        "compilation_cache_dir": "compilation_cache_dir",
        "deterministic": "deterministic",
        "excess_precision": "xla_excess_precision",
    },
    "mesh": {},
}
# Sections whose keys are the fields of a dataclass of their own.
DATACLASS_SECTIONS = ("model", "mesh")
NAME_OF_FIELD: dict[str, str] = {
    field: f"{section}.{key}" if section else key
    for section, keys in SECTIONS.items()
    for key, field in keys.items()
}
FIELD_OF_NAME: dict[str, str] = {name: field for field, name in NAME_OF_FIELD.items()}
# Each flat key (an unsectioned name) -> its sectioned name.
MOVED: dict[str, str] = {
    **{field: name for field, name in NAME_OF_FIELD.items() if field != name},
    "fp8_kernels": "kernels.fp8_ops",
    "fp8_op_kernels": "kernels.OP",
}


def name_of(field: str) -> str:
    """The file and command-line name of TrainConfig field ``field`` (``model.*`` and
    ``mesh.*`` names are their own)."""
    return NAME_OF_FIELD.get(field, field)


def field_of(name: str) -> str:
    """The TrainConfig field of the dotted key ``name`` (``ValueError`` for an unknown one)."""
    if name not in FIELD_OF_NAME:
        raise unknown_keys([name])
    return FIELD_OF_NAME[name]


def moved_error(old: str) -> ValueError:
    """The one-line error for a flat key (an unsectioned name)."""
    new = MOVED[old]
    if old == "fp8_kernels":
        how = "kernels: {fp8_ops: IMPL} in a file"
    elif old == "fp8_op_kernels":
        how = "kernels: {OP: IMPL, ...} in a file"
    else:
        return ValueError(f"`{old}` is now `{new}`; see train.py --help")
    return ValueError(
        f"`{old}` is now `{new}` ({how}, {new}=IMPL on the command line); see train.py --help"
    )


def unknown_keys(names) -> ValueError:
    """The error for unknown dotted keys, with the close matches of each."""
    known = [*NAME_OF_FIELD.values(), *(f"{s}." for s in DATACLASS_SECTIONS)]
    hints = []
    for name in names:
        close = difflib.get_close_matches(str(name), known, n=3)
        if close:
            hints.append(f"did you mean {' or '.join(close)}?")
    return ValueError(
        f"unknown config key(s) {', '.join(str(n) for n in names)}; "
        f"{' '.join(hints) + ' ' if hints else ''}python train.py --help lists every key"
    )


def flatten(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A config mapping with sections (or dotted keys) as ``{TrainConfig field: value}``;
    ``model`` and ``mesh`` stay mappings. A flat key (an unsectioned name) is refused with
    its new name (:func:`moved_error`), any other unknown key with its close matches."""
    flat: dict[str, Any] = {}
    unknown = []
    for key, value in raw.items():
        key = str(key)
        section, dot, leaf = key.partition(".")
        if dot and section in SECTIONS and section not in DATACLASS_SECTIONS:
            value, key = {leaf: value}, section
        elif dot and section in DATACLASS_SECTIONS:
            flat.setdefault(section, {})
            if not isinstance(flat[section], dict):
                raise ValueError(f"{section} must be a mapping, got {flat[section]!r}")
            flat[section][leaf] = value
            continue
        if key in DATACLASS_SECTIONS:
            flat[key] = {**flat[key], **value} if isinstance(flat.get(key), dict) else value
        elif key in SECTIONS and key:
            if value is None:
                continue
            if not isinstance(value, Mapping):
                if key in MOVED:  # precision and optimizer were keys before they were sections
                    raise moved_error(key)
                raise ValueError(f"{key} must be a mapping of its keys, got {value!r}")
            for leaf, item in value.items():
                field = SECTIONS[key].get(str(leaf))
                if field is None:
                    unknown.append(f"{key}.{leaf}")
                else:
                    flat[field] = item
        elif key in SECTIONS[""]:
            flat[key] = value
        elif key in MOVED:
            raise moved_error(key)
        else:
            unknown.append(key)
    if unknown:
        raise unknown_keys(sorted(unknown))
    return flat


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{TrainConfig field: value}`` as the sectioned mapping a config file holds, in the
    order of :data:`SECTIONS`."""
    out: dict[str, Any] = {}
    for section, keys in SECTIONS.items():
        if section in DATACLASS_SECTIONS:
            if section in flat:
                out[section] = flat[section]
            continue
        items = {key: flat[field] for key, field in keys.items() if field in flat}
        if section:
            if items:
                out[section] = items
        else:
            out.update(items)
    return out

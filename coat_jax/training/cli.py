"""`train.py --help`: every config key with its type, default and meaning, read from the config.

The keys, types and defaults come from the :class:`~coat_jax.training.config.TrainConfig`
dataclasses at run time (``dataclasses.fields``), so the help never lists a key that does not
exist nor misses one that does. Meanings come from a field's ``metadata["help"]`` where it has
one, else from :data:`DESCRIPTIONS`; a key in neither says "(no description)", which
``tests/training/test_cli.py`` refuses for every key of the shipped config.
"""

from __future__ import annotations

import dataclasses
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from coat_jax import recipes
from coat_jax.training.config import TrainConfig, to_dict
from coat_jax.training.config_names import DATACLASS_SECTIONS, SECTIONS, name_of
from coat_jax.training.config_values import read_config_file
from coat_jax.training.kernel_choice import to_yaml

NO_DESCRIPTION = "(no description)"
# Columns of `train.py --help`.
HELP_WIDTH = 100

# One line per key, by its dotted name.
DESCRIPTIONS = {
    # Run.
    "recipe": "named settings the config starts from (coat_jax.recipes; listed below); keys set "
    "in a file or on the command line win",
    "steps": "optimizer steps of the whole run (a resumed run stops at the same total)",
    "output_dir": "where checkpoints, metrics.jsonl, config.yaml and loss_curve.png go",
    "resume": "continue from the newest checkpoint in output_dir (else such a dir is refused)",
    "reschedule": "on resume, spread the learning-rate schedule over the new steps (default: "
    "keep the original run's)",
    "overwrite": "start a new run in an output_dir holding another run's files, deleting them",
    "seed": "seed of the initialization and of the data order",
    # Model.
    "precision.mode": "bf16: plain ops; fp8: FP8 linear layers; coat: COAT's full FP8 flow",
    "precision.compute_dtype": "dtype of activations and attention",
    "precision.fp8_attention": "keep attention's q, k, v in FP8 for backward (fp8 and coat "
    "precision)",
    "precision.fp8_attention_backward": "recompute: FP8 attention re-runs its forward in backward; "
    "saved_output: keeps the softmax statistics, reads the output from the o_proj's FP8 input",
    "precision.fp8_weight_residual": (
        "once (default): all weights quantized once per step, before the layers; "
        "master: forward and backward quantize, nothing kept; fp8: keeps forward's FP8 codes"
    ),
    "precision.fp8_group_scale": "1x16 activation scales: float32 (COAT) or e8m0 (power of two, 1 "
    "byte)",
    "precision.fp8_swiglu": "coat: FP8 SiLU and product ops (COAT); fused: one FP8 SwiGLU keeping "
    "gate and up only (precision coat)",
    "precision.fp8_linear_scaling": "FP8 linear scales: tensor (COAT); row (per token and "
    "channel); row_gw_hp (row, the weight gradient in BF16); block (1x128 tiles, 128x128 "
    "weight blocks)",
    "precision.master_dtype": "dtype of the trained parameters (bfloat16: stochastic-rounded "
    "updates)",
    "memory.loss_chunk_size": "cross-entropy in blocks of this many positions (null: plain loss)",
    "kernels": "auto: Pallas kernels on a GPU (per shard on a mesh; the FP8 ops by the run's "
    "shape: auto for hidden >= 4096 and >= 16384 tokens per device, else xla); xla: jnp; pallas; "
    "or a mapping {optimizer: IMPL, fp8_ops: IMPL, OP: IMPL} (OP: quantize_per_tensor, "
    "quantize_per_group, rmsnorm, silu, mul, swiglu, rmsnorm_rowwise, swiglu_rowwise, "
    "blockwise_gemm), a part left out taking auto",
    "init_from": "HF/coat-jax folder or .gguf to start from (pkg:PACKAGE/FILE looks in a package)",
    "model.vocab_size": "vocabulary size (at least the tokenizer's)",
    "model.hidden_size": "width of the residual stream",
    "model.intermediate_size": "width of the SwiGLU MLP",
    "model.num_hidden_layers": "number of decoder layers",
    "model.num_attention_heads": "query heads",
    "model.num_key_value_heads": "key/value heads (grouped-query attention; null: as many as "
    "query)",
    "model.head_dim": "width of one head (null: hidden_size / num_attention_heads)",
    "model.rope_theta": "RoPE base frequency",
    "model.rope_scaling": "RoPE frequency scaling, as HF's rope_scaling dict (linear or llama3)",
    "model.rms_norm_eps": "epsilon of the RMSNorms",
    "model.tie_word_embeddings": "use the embedding matrix as the LM head too",
    "model.max_position_embeddings": "longest sequence the model is meant for (HF config field)",
    "model.model_type": "the family: llama, mistral, qwen2, qwen3 or olmo2 (coat_jax.families)",
    "model.sliding_window": "mistral's sliding attention window (null: none)",
    "memory.scan_layers": "stack the decoder layers and run them with lax.scan (one compiled "
    "layer)",
    "memory.remat": "rematerialization policy of the decoder layers "
    "(coat_jax.llama.REMAT_POLICIES)",
    # Data.
    "data.path": "text (.txt/.md, tar), .jsonl/.json/.parquet/.arrow, a folder or glob of them "
    "or a datasets.save_to_disk folder (docs/data.md)",
    "data.sources": "a mixture: a list of {path, weight, text_field}, replacing data_path; null: "
    "data_path alone",
    "data.text_field": "the field (column) of records that holds the text; records without it may "
    "hold a chat's 'messages'",
    "data.attention_across_documents": "false: a token attends only to its own document of a "
    "packed window (on XLA's attention); null: false for data with chats, true otherwise",
    "data.document_positions": "positions restart at 0 at each document's first token in a window",
    "data.tokenizer": "byte (UTF-8 bytes, 258 ids), init_from (its checkpoint's) or a tokenizer "
    "path",
    "data.cache_dir": "where tokenized data is cached (keyed by corpus and tokenizer)",
    "data.val_fraction": "share of each document's tokens held out for validation",
    "data.val_documents": "comma-separated document names held out whole for validation (the "
    "split by document; val_fraction is then unused); null: val_fraction of each document",
    "data.seq_len": "tokens per training sequence",
    "data.batch_size": "sequences per microbatch, across all devices; auto: the largest that fits "
    "the device, planned by compiling the step (GPU; not on a backend without a memory limit)",
    "data.grad_accum": "microbatches averaged into one optimizer step",
    "data.global_batch_size": "sequences per optimizer step, kept by setting grad_accum to "
    "global_batch_size / batch_size (null: batch_size * grad_accum)",
    # Optimizer.
    "optimizer.name": "coat_adamw: COAT's FP8 AdamW; the others are optax's",
    "optimizer.fp8_state": "keep an optax optimizer's parameter-shaped state in FP8 "
    "(coat_jax.fp8_state)",
    "optimizer.momentum": "sgd's momentum and muon's decay",
    "optimizer.learning_rate": "peak learning rate, reached after warmup",
    "optimizer.min_lr_ratio": "the cosine schedule ends at learning_rate * min_lr_ratio",
    "optimizer.warmup_steps": "steps of linear warmup from learning_rate / warmup_steps",
    "optimizer.grad_clip": "global-norm gradient clipping threshold (null: off)",
    "optimizer.weight_decay": "decoupled weight decay (AdamW's)",
    "optimizer.decay_norms_and_embeddings": "also decay norms and the embedding (default: matrices "
    "only)",
    "optimizer.b1": "decay of the first moment",
    "optimizer.b2": "decay of the second moment",
    "optimizer.eps": "added to the second moment's square root",
    "optimizer.mu_format": "FP8 format of the first moment / signed optimizer state",
    "optimizer.nu_format": "FP8 format of the second moment / non-negative optimizer state",
    # Bookkeeping.
    "logging.every": "steps between metrics.jsonl records (each averages the losses since the "
    "last)",
    "eval.every": "steps between validation losses",
    "eval.at_start": "also evaluate the starting weights, logged as step 0 (a fine-tune's before)",
    "eval.batches": "batches per validation loss",
    "checkpoint.every": "steps between checkpoints (also one at the end, unless "
    "checkpoint.save_final=false, "
    "and on signals)",
    "checkpoint.keep": "how many recent checkpoints to keep",
    "checkpoint.save_final": "write a checkpoint at the end of the run (false: only periodic and "
    "on signals)",
    "optimizer.skip_nonfinite_steps": "skip up to this many steps with a non-finite gradient, then "
    "stop (0: stop at the first)",
    "logging.progress_bar": "show a tqdm progress bar (false: plain log lines)",
    "logging.tensorboard": "write metrics.jsonl's records to <output_dir>/tensorboard too (needs "
    "tensorboardX)",
    "logging.wandb_project": "also log metrics.jsonl's records to this Weights & Biases project "
    "(pip install 'coat-jax[wandb]'; null: off)",
    "logging.wandb_mode": "online: sync to the W&B server as the run goes; offline: write the run "
    "under <output_dir>/wandb only (wandb sync uploads it later)",
    "logging.profile_steps": "[first, last]: trace these steps (1-based, inclusive) with "
    "jax.profiler into <output_dir>/profile (null: off)",
    "optimizer.fused_apply": "coat_adamw's kernel applies the update in its own pass (false: "
    "optax's update, then apply_updates)",
    "optimizer.in_backward": "update each layer inside the backward pass: never holds the whole "
    "gradient (needs scan_layers, optimizer.grad_clip=null; docs/memory_options.md)",
    "logging.telemetry": "log the FP8 optimizer state's error, saturation, clip counts and the FP8 "
    "activation scales' range (docs/telemetry.md)",
    "logging.sample_prompt": "prompt of the short sample printed at the end of a run (null: no "
    "sample)",
    "logging.sample_tokens": "tokens the end-of-run sample generates",
    "xla.compilation_cache_dir": "JAX's persistent compilation cache (null: JAX's own setting)",
    "xla.deterministic": "compile with XLA's xla_gpu_deterministic_ops and XLA's attention, so "
    "that a single-GPU run repeats bit for bit (slower)",
    "xla.excess_precision": "XLA's xla_allow_excess_precision (false: bfloat16 "
    "intermediates cross memory as bfloat16, not float32; null: false for coat on a GPU, "
    "XLA's own default otherwise)",
    "mesh.data": "data-parallel size (-1: all remaining devices)",
    "mesh.fsdp": "parameter-sharding (FSDP) size (-1: all remaining devices)",
}


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    """One config key as `--help` lists it."""

    name: str
    type: str
    default: Any
    meaning: str


def type_name(hint) -> str:
    """A short name of a field type: ``int``, ``bool``, ``str or null``, ``bf16|fp8|coat``."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "|".join(str(a) for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        name = " or ".join(type_name(a) for a in args)
        return f"{name} or null" if len(args) < len(typing.get_args(hint)) else name
    if dataclasses.is_dataclass(hint):
        return "mapping"
    if origin is tuple:
        return f"[{', '.join(type_name(a) for a in typing.get_args(hint))}]"
    return getattr(hint, "__name__", str(hint))


def _described(field: dataclasses.Field, name: str) -> str:
    return field.metadata.get("help") or DESCRIPTIONS.get(name, NO_DESCRIPTION)


def config_keys(cls=None, instance=None, prefix: str = "") -> list[KeyDoc]:
    """Every key of `cls` (default `TrainConfig`, by its sections of
    :data:`~coat_jax.training.config_names.SECTIONS`), sections expanded, named as files name
    them.

    Defaults are read from `instance` (default `cls()`), so nested sections show the values
    their default factories give.
    """
    if cls is None:
        instance = TrainConfig() if instance is None else instance
        docs = []
        for section, keys in SECTIONS.items():
            if section in DATACLASS_SECTIONS:
                value = getattr(instance, section)
                docs += config_keys(type(value), value, f"{section}.")
            else:
                docs += [_key_doc(instance, field) for field in keys.values()]
        return docs
    instance = cls() if instance is None else instance
    hints = typing.get_type_hints(cls)
    docs = []
    for field in dataclasses.fields(cls):
        name, hint = prefix + field.name, hints[field.name]
        value = getattr(instance, field.name)
        if dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
        docs.append(KeyDoc(name, type_name(hint), value, _described(field, name)))
    return docs


def _key_doc(cfg: TrainConfig, field_name: str) -> KeyDoc:
    field = next(f for f in dataclasses.fields(cfg) if f.name == field_name)
    name, value = name_of(field_name), getattr(cfg, field_name)
    if field_name == "kernels":
        return KeyDoc(name, "auto|xla|pallas or mapping", to_yaml(value), _described(field, name))
    hint = typing.get_type_hints(TrainConfig)[field_name]
    return KeyDoc(name, type_name(hint), value, _described(field, name))


def _yaml_value(value) -> str:
    return (
        yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...")
    )


def config_help(width: int = HELP_WIDTH) -> str:
    """The `train.py --help` table of config keys (name, type, default, meaning) by section,
    and the recipes, wrapped to ``width`` columns."""
    docs = config_keys()
    column = max(len(d.name) for d in docs) + 4
    lines = ["config keys (set in the YAML file or as key=value; type, default: meaning):"]
    section = None
    for d in docs:
        here = d.name.partition(".")[0] if "." in d.name else ""
        if here != section:
            section = here
            lines += ["", f"{here}:" if here else "run (top-level keys):"]
        text = f"  {d.name:<{column - 4}}  {d.type}, {_yaml_value(d.default)}: {d.meaning}"
        lines += textwrap.wrap(text, width, subsequent_indent=" " * column)
    lines += ["", "recipes (recipe=NAME; docs/recipes.md has their measurements):"]
    column = max(len(name) for name in recipes.RECIPES) + 4
    for name in recipes.RECIPES:
        text = f"  {name:<{column - 4}}  {recipes.summary(name)}"
        lines += textwrap.wrap(text, width, subsequent_indent=" " * column)
    return "\n".join(lines)


def config_sources(cfg: TrainConfig, path, overrides: Sequence[str]) -> dict[str, str]:
    """Where each resolved key of ``cfg`` came from: ``command line``, ``file PATH``,
    ``recipe NAME`` or ``default`` (the first that sets it, in that order; a key of a file's
    ``base:`` chain counts as the file's)."""
    leaves = [d.name for d in config_keys()]
    in_file = set() if path is None else set(_leaf_names(read_config_file(path), set(leaves)))
    given = [item.partition("=")[0].strip() for item in overrides]
    in_recipe = set(recipes.settings(cfg.recipe))
    if path is not None and Path(path).resolve().is_relative_to(Path.cwd()):
        path = Path(path).resolve().relative_to(Path.cwd())
    sources = {}
    for name in leaves:
        if any(k == name or k.startswith(name + ".") or name.startswith(k + ".") for k in given):
            sources[name] = "command line"
        elif name in in_file:
            sources[name] = f"file {path}"
        elif name in in_recipe:
            sources[name] = f"recipe {cfg.recipe}"
        else:
            sources[name] = "default"
    return sources


def _leaf_names(raw: Mapping, leaves: set[str], prefix: str = ""):
    for key, value in raw.items():
        name = prefix + str(key)
        if name not in leaves and isinstance(value, Mapping):
            yield from _leaf_names(value, leaves, name + ".")
        else:
            yield name


def annotated_config(cfg: TrainConfig, sources: Mapping[str, str]) -> str:
    """The resolved config as YAML, each value followed by a comment naming its source."""
    lines = []

    def emit(mapping: Mapping, prefix: str, indent: str) -> None:
        for key, value in mapping.items():
            name = prefix + key
            if name in sources:
                text = f"{indent}{key}: {_yaml_value(value)}"
                lines.append(f"{text:<44}  # {sources[name]}")
            else:
                lines.append(f"{indent}{key}:")
                emit(value, name + ".", indent + "  ")

    emit(to_dict(cfg), "", "")
    return "\n".join(lines)

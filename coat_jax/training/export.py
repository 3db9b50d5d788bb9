"""A `train.py` run as a model: export it to a Hugging Face folder, or load it to sample from.

A run directory (`output_dir`) holds `config.yaml` and Orbax checkpoints written by
:class:`~coat_jax.training.checkpoint.Checkpointer`. Only the parameters are read
(:func:`~coat_jax.training.checkpoint.read_params`), in whichever layer layout the run used,
so no optimizer is built; the architecture comes from the checkpoint's fingerprint and the
tokenizer from the run's config:

- ``tokenizer: byte``: the byte tokenizer, written as an equivalent Hugging Face fast tokenizer
  (:func:`byte_tokenizer_hf`) so that transformers encodes and decodes exactly as training did;
- ``tokenizer: init_from`` or a path: the files of that folder are copied (tokenizer, chat
  template, generation config), or, for a ``.gguf``, the tokenizer is rebuilt from its metadata.

Either way the tokenizer is checked against the identity the checkpoint recorded, so an export
never pairs the weights with another vocabulary.

    python -m coat_jax.convert run-to-hf runs/default runs/default-hf
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx

from coat_jax.checkpoint_io import (
    DEFAULT_MAX_SHARD_BYTES,
    _copy_sidecars,
    save_pretrained,
    write_generation_config,
    write_tokenizer_files,
)
from coat_jax.llama import Llama, LlamaConfig, unstack_layers
from coat_jax.tokenizer import ByteTokenizer, load_tokenizer
from coat_jax.training.checkpoint import CheckpointError, read_params

EXPORT_DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16}
# The byte tokenizer's BOS and EOS (ids 256 and 257) as text, in its Hugging Face form.
BYTE_BOS, BYTE_EOS = "<|bos|>", "<|eos|>"


def is_run_dir(path: str | os.PathLike) -> bool:
    """True for a train.py output directory (``config.yaml`` and ``checkpoints/``)."""
    p = Path(path).expanduser()
    return (p / "config.yaml").is_file() and (p / "checkpoints").is_dir()


@dataclasses.dataclass(frozen=True)
class TrainedRun:
    """One checkpoint of a run: its parameters (numpy, unrolled layers) and what they need."""

    run_dir: Path
    step: int
    config: LlamaConfig
    params: dict
    compute_dtype: str
    tokenizer: str
    init_from: str | None
    tokenizer_identity: str | None


def read_run(run_dir: str | os.PathLike, *, step: int | None = None) -> TrainedRun:
    """Reads a run's newest (or `step`'s) checkpoint parameters and its settings.

    Raises:
      ValueError: not a run directory, or its config/checkpoint lacks what an export needs
        (CheckpointError, a ValueError, for a missing, unreadable or corrupt checkpoint).
    """
    run_dir = Path(run_dir).expanduser()
    if not is_run_dir(run_dir):
        raise ValueError(
            f"{str(run_dir)!r} is not a train.py run directory (it needs config.yaml and "
            "checkpoints/); give the output_dir of a run"
        )
    settings = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    missing = [k for k in ("tokenizer", "init_from") if k not in settings]
    if missing:
        raise ValueError(
            f"{run_dir / 'config.yaml'} lacks {missing}; it was not written by train.py"
        )
    params, meta = read_params(run_dir, step)
    model = meta["fingerprint"].get("model")
    if not isinstance(model, dict):
        raise CheckpointError(
            f"checkpoint step {meta['step']} in {run_dir} has no architecture in its metadata; "
            "it was written by an older coat_jax"
        )
    return TrainedRun(
        run_dir=run_dir,
        step=int(meta["step"]),
        config=LlamaConfig(**model),
        params=unstack_layers(params),
        compute_dtype=str(settings.get("compute_dtype", "bfloat16")),
        tokenizer=str(settings["tokenizer"]),
        init_from=settings["init_from"],
        tokenizer_identity=meta["fingerprint"].get("tokenizer"),
    )


def _tokenizer_source(run: TrainedRun) -> str | None:
    """The path the run's tokenizer came from; None for the byte tokenizer."""
    from coat_jax.training.loop import resolve_init_from

    if run.tokenizer == "byte":
        return None
    spec = run.init_from if run.tokenizer == "init_from" else run.tokenizer
    if not spec:
        raise ValueError(f"{run.run_dir}/config.yaml says tokenizer=init_from but has no init_from")
    try:
        return resolve_init_from(spec)
    except ValueError as e:
        raise ValueError(
            f"the run's tokenizer is not where its config says: {e}; run from the directory "
            f"train.py ran in, or edit the path in {run.run_dir / 'config.yaml'}"
        ) from e


def _check_identity(run: TrainedRun, tokenizer, source: str) -> None:
    from coat_jax.training.data import Tokenizer

    if run.tokenizer_identity is None:
        return
    if Tokenizer(tokenizer, source).identity != run.tokenizer_identity:
        raise ValueError(
            f"the tokenizer at {source!r} is not the one checkpoint step {run.step} was trained "
            f"with (its vocabulary differs); point {run.run_dir / 'config.yaml'} at the "
            "tokenizer files the run used"
        )


def run_tokenizer(run: TrainedRun):
    """The run's tokenizer: a `ByteTokenizer` or a transformers tokenizer, identity-checked."""
    source = _tokenizer_source(run)
    if source is None:
        return ByteTokenizer()
    tokenizer = load_tokenizer(source)
    _check_identity(run, tokenizer, source)
    return tokenizer


def run_model(run: TrainedRun, *, dtype=None, param_dtype=jnp.float32) -> Llama:
    """The run's parameters as a `Llama` (unrolled layers, "bf16" precision: plain math).

    `dtype` is the compute dtype; None takes the run's `compute_dtype`.
    """
    dtype = jnp.dtype(run.compute_dtype if dtype is None else dtype)
    abstract = nnx.eval_shape(
        lambda: Llama(run.config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    )
    graphdef, state = nnx.split(abstract)
    wanted = nnx.to_pure_dict(state)
    want_sig = jax.tree.map(lambda s: tuple(s.shape), wanted)
    have_sig = jax.tree.map(lambda a: tuple(a.shape), run.params)
    if want_sig != have_sig:
        raise CheckpointError(
            f"checkpoint step {run.step} in {run.run_dir} does not hold the parameters of its "
            "own architecture (corrupt metadata?)"
        )
    values = jax.tree.map(lambda a, s: jnp.asarray(a, s.dtype), run.params, wanted)
    nnx.replace_by_pure_dict(state, values)
    return nnx.merge(graphdef, state)


def load_run_model(run_dir: str | os.PathLike, *, step: int | None = None, dtype=None):
    """(model, tokenizer) of a run's newest (or `step`'s) checkpoint, for `coat_jax.generate`."""
    run = read_run(run_dir, step=step)
    return run_model(run, dtype=dtype), run_tokenizer(run)


# ----------------------------------------------------------------------------- byte tokenizer


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table, the one `tokenizers`' ByteLevel uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def byte_tokenizer_hf():
    """`coat_jax.ByteTokenizer` as a transformers fast tokenizer with the same ids.

    Bytes 0..255 are tokens 0..255 (a byte-level BPE vocabulary of single bytes and no merges),
    BOS and EOS are the special tokens 256 and 257 (``<|bos|>``, ``<|eos|>``); like the byte
    tokenizer it adds neither on its own, and special-token text in the input stays bytes.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: b for b, c in enumerate(_gpt2_byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (BYTE_BOS, BYTE_EOS)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BYTE_BOS, eos_token=BYTE_EOS, split_special_tokens=True
    )


# ----------------------------------------------------------------------------- export


@dataclasses.dataclass(frozen=True)
class ExportResult:
    step: int
    dst: Path
    config: LlamaConfig
    tokenizer_note: str


def export_run_to_hf(
    run_dir: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    step: int | None = None,
    dtype: str = "float32",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> ExportResult:
    """Writes a run's checkpoint as a Hugging Face Llama folder that transformers loads.

    Args:
      run_dir: the run's output_dir.
      dst: a new or empty folder.
      step: the checkpoint step; None means the newest.
      dtype: "float32" (the master weights, bit for bit) or "bfloat16".
      max_shard_bytes: above this the weights are split into shards plus an index.

    Returns:
      The step, folder and config written, and a sentence saying where the tokenizer came from.
    """
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {list(EXPORT_DTYPES)}")
    run = read_run(run_dir, step=step)
    source = _tokenizer_source(run)
    tokenizer = byte_tokenizer_hf() if source is None else load_tokenizer(source)
    if source is not None:
        _check_identity(run, tokenizer, source)
    model = run_model(run, dtype=jnp.float32)
    dst = Path(dst).expanduser()
    save_pretrained(
        model, dst, format="hf", dtype=EXPORT_DTYPES[dtype], max_shard_bytes=max_shard_bytes
    )
    if source is None:
        files = write_tokenizer_files(tokenizer, dst)
        note = (
            "the byte tokenizer (UTF-8 bytes = ids 0..255, <|bos|> 256, <|eos|> 257) as an "
            f"equivalent Hugging Face tokenizer: {', '.join(files)}"
        )
    elif os.path.isfile(source):
        files = write_tokenizer_files(tokenizer, dst)
        note = f"the tokenizer of {source}, rebuilt from its GGUF metadata: {', '.join(files)}"
    else:
        before = set(os.listdir(dst))
        _copy_sidecars(source, dst)
        write_generation_config(tokenizer, dst)
        files = sorted(set(os.listdir(dst)) - before)
        note = f"the tokenizer files of {source}: {', '.join(files)}"
    return ExportResult(step=run.step, dst=dst, config=run.config, tokenizer_note=note)

"""Decoder weights (any family of :mod:`coat_jax.families`) in and out: Hugging Face safetensors, the coat-jax format, and GGUF.

The Hugging Face <-> coat-jax correspondence is one declarative name map (`name_map`, a decoder
layer's part from the config's family): each parameter of `coat_jax.Llama` has exactly one HF
tensor and one small named transform. Loading
streams: the model is built abstractly (`nnx.eval_shape`, no random init) and each tensor is read
alone (safetensors `safe_open` memory-maps the file), checked, cast to the parameter dtype and put
on the device before the next one is read, so no second full copy of the model ever exists.

The coat-jax format is a folder with `coat_jax.json` (format marker), an HF-style `config.json`
and safetensors files whose tensor names are the model's parameter paths
(`layers.0.self_attn.q_proj`) in the model's `[in, out]` layout, dtypes kept as given.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from coat_jax.families import IDENTITY, TRANSPOSE, Transform
from coat_jax.llama import Llama, LlamaConfig, check_precision

COAT_JAX_MARKER = "coat_jax.json"
COAT_JAX_FORMAT = {"format": "coat-jax", "version": 1}
SAFETENSORS_INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 4 * 2**30
# Files that travel with the weights so a converted folder still has its tokenizer.
SIDECAR_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)
# Buffers older transformers versions saved next to the weights; recomputed from the config.
_IGNORED_HF_TENSORS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


@dataclasses.dataclass(frozen=True)
class MapEntry:
    hf_name: str
    jax_name: str
    transform: Transform


def name_map(config: LlamaConfig) -> list[MapEntry]:
    """Every parameter of `Llama(config)`: its HF tensor name, its path and the transform."""
    entries = [MapEntry("model.embed_tokens.weight", "embed_tokens", IDENTITY)]
    for i in range(config.num_hidden_layers):
        entries += [
            MapEntry(f"model.layers.{i}.{hf}", f"layers.{i}.{jx}", t)
            for hf, jx, t in config.family.layer_map
        ]
    entries.append(MapEntry("model.norm.weight", "norm.weight", IDENTITY))
    if not config.tie_word_embeddings:
        entries.append(MapEntry("lm_head.weight", "lm_head", TRANSPOSE))
    return entries


# ----------------------------------------------------------------------------- tensor sources


class SafetensorsSource:
    """Named tensors of a folder's safetensors files (single file, or sharded with an index)."""

    def __init__(self, folder: str):
        self.folder = folder
        index_path = os.path.join(folder, SAFETENSORS_INDEX)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {folder}")
            weight_map = None
        self._handles = {}
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{SAFETENSORS_INDEX} names {name}, missing in {folder}")
            self._handles[name] = safe_open(path, framework="numpy")
        if weight_map is None:
            weight_map = {}
            for fname, handle in self._handles.items():
                for key in handle.keys():
                    if key in weight_map:
                        raise ValueError(
                            f"tensor {key!r} is in both {weight_map[key]} and {fname} in {folder}"
                        )
                    weight_map[key] = fname
        self._where = weight_map

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        return self._handles[self._where[name]].get_tensor(name)

    def metadata(self) -> dict[str, str]:
        first = next(iter(self._handles.values()))
        return first.metadata() or {}


class _ShardedWriter:
    """Writes tensors into safetensors shards of at most `max_shard_bytes` (one shard in RAM)."""

    def __init__(self, folder: str, max_shard_bytes: int, metadata: dict[str, str]):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
        self.folder, self.max_shard_bytes, self.metadata = folder, max_shard_bytes, metadata
        self._pending: dict[str, np.ndarray] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, array: np.ndarray):
        if self._pending and self._pending_bytes + array.nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = np.ascontiguousarray(array)
        self._pending_bytes += array.nbytes
        self.total_bytes += array.nbytes

    def _flush(self):
        tmp_name = f"tmp-shard-{len(self._shards):05d}.safetensors"
        save_file(self._pending, os.path.join(self.folder, tmp_name), metadata=self.metadata)
        self._shards.append((tmp_name, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self):
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        if n == 1:
            os.replace(
                os.path.join(self.folder, self._shards[0][0]),
                os.path.join(self.folder, "model.safetensors"),
            )
            return
        weight_map = {}
        for i, (tmp_name, names) in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.folder, tmp_name), os.path.join(self.folder, final))
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        with open(os.path.join(self.folder, SAFETENSORS_INDEX), "w") as f:
            json.dump(index, f, indent=2)


# ----------------------------------------------------------------------------- kinds of input


def checkpoint_kind(path: str | os.PathLike) -> str:
    """'gguf', 'coat-jax' or 'hf' for a checkpoint path; ValueError if it is none of them."""
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return "gguf"
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, COAT_JAX_MARKER)):
            return "coat-jax"
        if os.path.isfile(os.path.join(path, "config.json")):
            return "hf"
    raise ValueError(
        f"{path!r} is not a Llama checkpoint: expected a Hugging Face folder (config.json + "
        f"*.safetensors), a coat-jax folder ({COAT_JAX_MARKER} + config.json + *.safetensors) "
        "or a .gguf file"
    )


def _check_coat_jax_marker(folder: str):
    with open(os.path.join(folder, COAT_JAX_MARKER)) as f:
        marker = json.load(f)
    if marker.get("format") != "coat-jax" or marker.get("version") != 1:
        raise ValueError(
            f"{folder}/{COAT_JAX_MARKER} says {marker}; this coat-jax reads {COAT_JAX_FORMAT}"
        )


def _tied_lm_head_ok(source, embed_name: str) -> bool:
    return np.array_equal(source.get("lm_head.weight"), source.get(embed_name))


def _plan(config: LlamaConfig, kind: str, source) -> dict[str, tuple[str, Transform]]:
    """Model parameter path -> (tensor name in `source`, transform); checks the name sets."""
    entries = name_map(config)
    if kind == "coat-jax":
        plan = {e.jax_name: (e.jax_name, IDENTITY) for e in entries}
    else:
        plan = {e.jax_name: (e.hf_name, e.transform) for e in entries}
    available = set(source.names())
    wanted = {name for name, _ in plan.values()}
    missing = sorted(wanted - available)
    if missing:
        raise ValueError(
            f"checkpoint lacks {len(missing)} tensor(s) the config needs, e.g. {missing[:5]}"
        )
    extra = available - wanted
    if kind != "coat-jax":
        extra = {n for n in extra if not _IGNORED_HF_TENSORS.fullmatch(n)}
        # Some tied checkpoints still carry lm_head.weight; it must then be the embedding.
        if config.tie_word_embeddings and "lm_head.weight" in extra:
            if not _tied_lm_head_ok(source, "model.embed_tokens.weight"):
                raise ValueError(
                    "config says tie_word_embeddings=True but the checkpoint's lm_head.weight "
                    "differs from model.embed_tokens.weight"
                )
            extra.discard("lm_head.weight")
    if extra:
        raise ValueError(
            f"checkpoint has {len(extra)} tensor(s) a Llama with this config does not use, "
            f"e.g. {sorted(extra)[:5]}"
        )
    return plan


def _open_source(path: str, kind: str):
    """(config, source) for a checkpoint path of the given kind."""
    if kind == "gguf":
        from coat_jax.gguf_io import GGUFSource

        source = GGUFSource(path)
        return source.config, source
    if kind == "coat-jax":
        _check_coat_jax_marker(path)
    return LlamaConfig.from_hf(path), SafetensorsSource(path)


def read_config(path: str | os.PathLike) -> LlamaConfig:
    """The architecture of a checkpoint (HF folder, coat-jax folder or .gguf), no weights read."""
    path = os.fspath(path)
    config, _ = _open_source(path, checkpoint_kind(path))
    return config


def _flat_params(state) -> Iterator[tuple[str, Any]]:
    for path, variable in nnx.to_flat_state(state):
        yield ".".join(str(p) for p in path), variable


def _layer_names(key: str, config: LlamaConfig, scan_layers: bool) -> list[str]:
    """The name-map paths one model parameter holds: itself, or one per layer if stacked."""
    if scan_layers and key.startswith("layers."):
        rest = key[len("layers.") :]
        return [f"layers.{i}.{rest}" for i in range(config.num_hidden_layers)]
    return [key]


def from_pretrained(
    path: str | os.PathLike,
    *,
    precision: str = "bf16",
    dtype=jnp.bfloat16,
    param_dtype=jnp.float32,
    fp8_config=None,
    scan_layers: bool = False,
    remat: str = "none",
    fp8_attention: bool = False,
) -> Llama:
    """Loads a Llama from an HF folder, a coat-jax folder or a Llama `.gguf` file.

    Tensors are streamed one at a time into the model's parameters (cast to `param_dtype`);
    with `scan_layers` the per-layer tensors of one parameter are stacked on the host first.
    Raises ValueError naming the tensor for a missing tensor, a wrong shape or an unexpected
    extra tensor, and for a checkpoint that is not a Llama. `precision`, `dtype`, `param_dtype`,
    `fp8_config`, `scan_layers`, `remat` and `fp8_attention` are passed to `Llama`.

    Example (an HF folder written here; a downloaded one, e.g. Llama-3.2-1B, loads the same way):
      >>> import tempfile
      >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
      ...                   num_hidden_layers=2, num_attention_heads=4)
      >>> folder = os.path.join(tempfile.mkdtemp(), "tiny-llama")
      >>> save_pretrained(Llama(cfg, rngs=nnx.Rngs(0)), folder)
      >>> model = from_pretrained(folder, precision="coat")
      >>> model.config == cfg
      True
    """
    path = os.fspath(path)
    check_precision(precision)
    kind = checkpoint_kind(path)
    config, source = _open_source(path, kind)
    plan = _plan(config, kind, source)
    abstract = nnx.eval_shape(
        lambda: Llama(
            config,
            precision=precision,
            dtype=dtype,
            param_dtype=param_dtype,
            fp8_config=fp8_config,
            scan_layers=scan_layers,
            remat=remat,
            fp8_attention=fp8_attention,
        )
    )
    graphdef, state = nnx.split(abstract)
    seen = set()
    for key, variable in _flat_params(state):
        spec = variable.get_value()
        arrays = []
        layer_keys = _layer_names(key, config, scan_layers)
        for layer_key in layer_keys:
            if layer_key not in plan:
                raise RuntimeError(f"parameter {layer_key} of Llama is missing from the name map")
            name, transform = plan[layer_key]
            array = transform.forward(source.get(name))
            want = spec.shape if layer_keys == [key] else spec.shape[1:]
            if tuple(array.shape) != tuple(want):
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(array.shape)} after {transform.name}; "
                    f"the config needs {tuple(want)}"
                )
            arrays.append(np.asarray(array, dtype=spec.dtype))
            seen.add(layer_key)
        value = arrays[0] if layer_keys == [key] else np.stack(arrays)
        variable.set_value(jnp.asarray(value, dtype=spec.dtype))
        del arrays, value
    unfilled = set(plan) - seen
    if unfilled:
        raise RuntimeError(f"name map entries without a model parameter: {sorted(unfilled)[:5]}")
    return nnx.merge(graphdef, state)


# ----------------------------------------------------------------------------- saving / converting


def copy_sidecars(src: str, dst: str):
    if not os.path.isdir(src):
        return
    for name in SIDECAR_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))


def write_tokenizer_files(tokenizer, dst: str | os.PathLike) -> list[str]:
    """Saves a transformers tokenizer (and its chat template) into an HF folder.

    Also writes `generation_config.json` with the tokenizer's BOS/EOS ids unless the folder
    has one, so that transformers' `generate` stops at this tokenizer's EOS (its LlamaConfig
    defaults, 1 and 2, belong to Llama 2's vocabulary). Returns the names of the new files.
    """
    dst = os.fspath(dst)
    before = set(os.listdir(dst))
    tokenizer.save_pretrained(dst)
    write_generation_config(tokenizer, dst)
    return sorted(set(os.listdir(dst)) - before)


def write_generation_config(tokenizer, dst: str | os.PathLike) -> None:
    """`generation_config.json` with the tokenizer's BOS/EOS ids, unless `dst` has one."""
    path = os.path.join(os.fspath(dst), "generation_config.json")
    if os.path.isfile(path):
        return
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    with open(path, "w") as f:
        json.dump({k: v for k, v in ids.items() if v is not None}, f, indent=2)


def gguf_to_hf(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    dtype=np.float32,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> LlamaConfig:
    """Writes a Llama `.gguf` file as a Hugging Face folder: weights, config and tokenizer.

    Quantized GGUF tensors are dequantized (float32 holds every dequantized value exactly;
    `dtype=jnp.bfloat16` rounds them) and q/k rows get llama.cpp's RoPE permutation undone, as
    `from_pretrained` reads them. The tokenizer is rebuilt from the GGUF metadata with its chat
    template, as `load_tokenizer` reads it. Returns the model's config.
    """
    src, dst = os.fspath(src), os.fspath(dst)
    kind = checkpoint_kind(src)
    if kind != "gguf":
        raise ValueError(f"{src!r} is a {kind} checkpoint, not a .gguf file")
    config, source = _open_source(src, kind)
    _plan(config, kind, source)

    def tensors():
        for e in name_map(config):
            yield e.hf_name, source.get(e.hf_name).astype(dtype)

    _write_folder(dst, config, "hf", tensors(), max_shard_bytes)
    from coat_jax.gguf_io import load_gguf_tokenizer

    write_tokenizer_files(load_gguf_tokenizer(src), dst)
    return config


def _dtype_name(dtype) -> str:
    return str(np.dtype(dtype)) if np.dtype(dtype) != jnp.bfloat16 else "bfloat16"


def _write_folder(
    dst: str,
    config: LlamaConfig,
    fmt: str,
    tensors: Iterator[tuple[str, np.ndarray]],
    max_shard_bytes: int,
):
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(dst):
        if name.endswith(".safetensors") or name == SAFETENSORS_INDEX:
            raise FileExistsError(f"{dst} already holds weights ({name}); pick an empty folder")
    metadata = {"format": "pt"} if fmt == "hf" else {"format": "coat-jax"}
    writer = _ShardedWriter(dst, max_shard_bytes, metadata)
    first_dtype = None
    for name, array in tensors:
        first_dtype = first_dtype or _dtype_name(array.dtype)
        writer.add(name, array)
    writer.close()
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config.to_hf_dict(torch_dtype=first_dtype), f, indent=2)
    if fmt == "coat-jax":
        with open(os.path.join(dst, COAT_JAX_MARKER), "w") as f:
            json.dump(COAT_JAX_FORMAT, f, indent=2)


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    to: str,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
):
    """Converts an HF folder to coat-jax (`to="coat-jax"`) or back (`to="hf"`), bit-exactly.

    Streams tensor by tensor with dtypes kept (no JAX involved), so converting back and forth
    reproduces every tensor bit for bit. Tokenizer and generation files are copied along.
    """
    src, dst = os.fspath(src), os.fspath(dst)
    formats = ("coat-jax", "hf")
    if to not in formats:
        raise ValueError(f"to={to!r} is not one of {list(formats)}")
    kind = checkpoint_kind(src)
    want_kind = "hf" if to == "coat-jax" else "coat-jax"
    if kind != want_kind:
        raise ValueError(f"converting to {to} needs a {want_kind} checkpoint, {src!r} is {kind}")
    config, source = _open_source(src, kind)
    plan = _plan(config, kind, source)
    entries = name_map(config)

    def tensors():
        for e in entries:
            if to == "coat-jax":
                yield e.jax_name, e.transform.forward(source.get(plan[e.jax_name][0]))
            else:
                yield e.hf_name, e.transform.inverse(source.get(e.jax_name))

    _write_folder(dst, config, to, tensors(), max_shard_bytes)
    copy_sidecars(src, dst)


def save_pretrained(
    model: Llama,
    dst: str | os.PathLike,
    *,
    format: str = "hf",
    dtype=None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer_from: str | os.PathLike | None = None,
):
    """Writes a model's weights as an HF folder (`format="hf"`) or a coat-jax folder.

    Args:
      model: the `Llama` to save.
      dst: an empty or new folder.
      format: "hf" (transformers loads it) or "coat-jax".
      dtype: dtype of the written tensors (e.g. jnp.bfloat16); None keeps the parameter dtype.
      max_shard_bytes: above this the weights are split into shards plus an index.
      tokenizer_from: a folder whose tokenizer/generation files are copied along.
    """
    formats = ("hf", "coat-jax")
    if format not in formats:
        raise ValueError(f"format={format!r} is not one of {list(formats)}")
    if not isinstance(model, Llama):
        raise TypeError(f"model must be a coat_jax.Llama, got {type(model).__name__}")
    _, state = nnx.split(model)
    params = {}
    for key, variable in _flat_params(state):
        names = _layer_names(key, model.config, model.scan_layers)
        for i, name in enumerate(names):
            params[name] = (variable, i if len(names) > 1 or name != key else None)
    entries = name_map(model.config)

    def tensors():
        for e in entries:
            variable, layer = params[e.jax_name]
            value = variable.get_value()
            array = np.asarray(jax.device_get(value if layer is None else value[layer]))
            if dtype is not None:
                array = array.astype(dtype)
            if format == "hf":
                yield e.hf_name, e.transform.inverse(array)
            else:
                yield e.jax_name, array

    dst = os.fspath(dst)
    _write_folder(dst, model.config, format, tensors(), max_shard_bytes)
    if tokenizer_from is not None:
        copy_sidecars(os.fspath(tokenizer_from), dst)

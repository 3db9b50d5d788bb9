"""The architecture of a decoder of one of the Llama-like families (Llama, Mistral, Qwen2,
Qwen3, OLMo 2; :mod:`coat_jax.families`): :class:`LlamaConfig`, its RoPE scaling, and the RoPE
frequencies it implies. Field names and defaults follow Hugging Face's ``LlamaConfig``, which
:meth:`LlamaConfig.from_hf` reads (any family's ``config.json``) and
:meth:`LlamaConfig.to_hf_dict` writes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from coat_jax import families

ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as Hugging Face's `rope_scaling` describes it.

    `linear` divides every frequency by `factor`. `llama3` (Llama 3.1+) divides the low
    frequencies by `factor`, keeps the high ones and interpolates smoothly in between; it uses
    `low_freq_factor`, `high_freq_factor` and `original_max_position_embeddings`.
    """

    rope_type: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def __post_init__(self):
        if self.rope_type not in ("linear", "llama3"):
            raise ValueError(
                f"rope_scaling type {self.rope_type!r} is not supported; valid: "
                "None (no scaling), 'linear', 'llama3'"
            )
        if not self.factor > 0:
            raise ValueError(f"rope_scaling factor must be > 0, got {self.factor!r}")
        if self.rope_type == "llama3":
            missing = [
                name
                for name in (
                    "low_freq_factor",
                    "high_freq_factor",
                    "original_max_position_embeddings",
                )
                if getattr(self, name) is None
            ]
            if missing:
                raise ValueError(f"llama3 rope_scaling needs {missing}")
            if not self.high_freq_factor > self.low_freq_factor:
                raise ValueError(
                    "llama3 rope_scaling needs high_freq_factor > low_freq_factor, got "
                    f"{self.high_freq_factor!r} <= {self.low_freq_factor!r}"
                )

    @classmethod
    def from_hf(cls, d: Mapping[str, Any] | None) -> RopeScaling | None:
        """Reads HF's `rope_scaling` / `rope_parameters` dict; None or type 'default' -> None."""
        if d is None:
            return None
        rope_type = d.get("rope_type", d.get("type", "default"))
        if rope_type == "default":
            return None
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported; valid: {list(ROPE_TYPES)}"
            )
        ompe = d.get("original_max_position_embeddings")
        return cls(
            rope_type=rope_type,
            factor=float(d["factor"]),
            low_freq_factor=_opt_float(d.get("low_freq_factor")),
            high_freq_factor=_opt_float(d.get("high_freq_factor")),
            original_max_position_embeddings=None if ompe is None else int(ompe),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        d = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "llama3":
            d["low_freq_factor"] = self.low_freq_factor
            d["high_freq_factor"] = self.high_freq_factor
            d["original_max_position_embeddings"] = self.original_max_position_embeddings
        return d


def _opt_float(v):
    return None if v is None else float(v)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Architecture of a decoder; field names follow Hugging Face's `LlamaConfig`.

    `model_type` names the family (`coat_jax.families.FAMILIES`: "llama", "mistral", "qwen2",
    "qwen3", "olmo2"), whose switches (:attr:`family`) shape the layers. `rope_scaling` accepts
    a `RopeScaling` or an HF-style dict (converted on construction, so the config stays
    hashable). `head_dim=None` means `hidden_size // num_attention_heads`. `sliding_window`
    (Mistral only): each query attends to at most this many latest positions (the model's own
    attention; decoding with a cache and FP8 attention refuse sequences past it).
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    model_type: str = "llama"
    sliding_window: int | None = None

    def __post_init__(self):
        fam = families.family(self.model_type)
        if self.sliding_window is not None:
            if not fam.sliding_window:
                raise ValueError(
                    f"sliding_window={self.sliding_window!r} is not a switch of model_type="
                    f"{self.model_type!r}; leave it None"
                )
            if isinstance(self.sliding_window, bool) or not self.sliding_window > 0:
                raise ValueError(
                    f"sliding_window must be a positive int or None, got {self.sliding_window!r}"
                )
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", RopeScaling.from_hf(self.rope_scaling))
        elif self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(
                "rope_scaling must be None, a RopeScaling or a dict, got "
                f"{type(self.rope_scaling).__name__}"
            )
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"num_attention_heads={self.num_attention_heads} does not divide "
                    f"hidden_size={self.hidden_size}; pass head_dim explicitly or change them"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be a positive even int (RoPE), got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} does not divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")

    @property
    def family(self) -> families.Family:
        """The switches of :attr:`model_type` (:class:`coat_jax.families.Family`)."""
        return families.family(self.model_type)

    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | Mapping[str, Any]) -> LlamaConfig:
        """Builds the config from an HF `config.json` (a folder, the file itself, or its dict).

        Reads both the transformers 4 keys (`rope_theta`, `rope_scaling`) and the transformers 5
        `rope_parameters`. Raises ValueError for a `model_type` outside
        `coat_jax.families.FAMILIES`, or a switch its family does not support, naming it.
        """
        if isinstance(path_or_dict, Mapping):
            d = dict(path_or_dict)
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"no config.json at {path}")
            with open(path) as f:
                d = json.load(f)
        model_type = d.get("model_type", "llama")
        fam = families.family(model_type)
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported; valid: 'silu'")
        for key, value in fam.fixed:
            if d.get(key, value) != value:
                raise ValueError(
                    f"{key}={d[key]!r} is not supported for model_type={model_type!r}; "
                    f"valid: {value!r}"
                )
        layer_types = set(d.get("layer_types") or ()) - {"full_attention"}
        if layer_types:
            raise ValueError(
                f"layer_types {sorted(layer_types)} are not supported; valid: 'full_attention'"
            )
        rope_params = d.get("rope_parameters")
        if rope_params is not None:
            rope_theta = rope_params.get("rope_theta", d.get("rope_theta", 10000.0))
            rope_scaling = rope_params
        else:
            rope_theta = d.get("rope_theta", 10000.0)
            rope_scaling = d.get("rope_scaling")
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads"),
            head_dim=d.get("head_dim"),
            rope_theta=float(rope_theta),
            rope_scaling=RopeScaling.from_hf(rope_scaling),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            model_type=model_type,
            sliding_window=d.get("sliding_window") if fam.sliding_window else None,
        )

    def to_hf_dict(self, torch_dtype: str | None = None) -> dict[str, Any]:
        """An HF `config.json` dict that transformers 4 and 5 both load as this model."""
        fam = self.family
        d = {
            "architectures": [fam.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            **dict(fam.fixed),
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_hf_dict(),
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
        }
        if fam.sliding_window:
            d["sliding_window"] = self.sliding_window
        if torch_dtype is not None:
            d["torch_dtype"] = torch_dtype
        return d


def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] in float32, computed as transformers does."""
    dim = config.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    # llama3: long wavelengths (low frequencies) are stretched by `factor`, short ones kept,
    # and the band in between is interpolated so the spectrum stays continuous.
    factor = scaling.factor
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)

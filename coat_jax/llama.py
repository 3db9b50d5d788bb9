"""Llama 2/3 decoder in Flax NNX with BF16, FP8-linear and COAT precision modes.

One model code path serves all three modes: every linear, RMSNorm, SiLU, product and residual add
goes through the `OpSet` that `coat_jax.fp8_ops.ops_for(precision)` returns, so switching modes
swaps the op implementations and nothing else. Attention stays in the compute dtype (BF16) in
every mode, as in COAT (docs/design.md, 'The precision flow').

Weights are stored `[in, out]` (HF stores `[out, in]`; `coat_jax.checkpoint_io` transposes) and
q/k/v and gate/up are separate parameters, so the checkpoint name map stays one-to-one; each group
goes through ONE `ops.linear` call with a tuple of weights, which quantizes (and saves) the shared
input once instead of three or two times, without a concatenated weight copy.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from coat_jax.attention import attend, attention_implementation
from coat_jax.fp8_ops import (
    ACTIVATION,
    DEFAULT_CONFIG,
    PRECISIONS,
    WEIGHT,
    FP8Config,
    FP8Weight,
    OpSet,
    ScaleRecorder,
    fp8_attention,
    fp8_attention_linear,
    ops_for,
    quantize_weight,
    recorded_attention,
    recorded_attention_linear,
)

ROPE_TYPES = ("default", "linear", "llama3")
# checkpoint_name of what attention keeps for backward (cuDNN: q, k, v, output, log-sum-exp;
# elsewhere q, k, v, with the attention recomputed).
ATTENTION = "attention"
# Named rematerialization policies for the decoder layers (MaxText's ``remat_policy``). They work
# by the checkpoint_name tags on what each op keeps, never by primitive name or rank:
#   none        no jax.checkpoint: XLA's autodiff keeps what it keeps (weight casts included).
#   full        keep only each layer's input; backward recomputes the whole layer.
#   attention   keep what attention keeps; recompute the rest (norms, MLP, projections).
#   activations keep what each op tags as its residual (ACTIVATION) plus attention's: in
#               precision "coat" exactly the FP8 residuals of docs/design.md, 'The precision
#               flow'; in "bf16" the BF16 inputs of the linears, norms, SiLU and product.
#               Weight casts and float32 intermediates are recomputed in backward. The FP8
#               weight codes of ``FP8Config(weight_residual="fp8")`` (tagged WEIGHT) are kept
#               too, since keeping them is what that option is for (1 byte per weight until
#               backward); with "master" no value carries that tag and backward re-quantizes
#               each weight.
# With weight_residual "fp8", "none" keeps the WEIGHT-tagged codes too (every residual is kept);
# "full" and "attention" do not: their backward recomputes the codes from the master weight and
# its GEMMs use those (with "master" backward quantizes each weight a second time).
# docs/memory_options.md, "FP8 weight codes".
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "attention": jax.checkpoint_policies.save_only_these_names(ATTENTION),
    "activations": jax.checkpoint_policies.save_only_these_names(ACTIVATION, ATTENTION, WEIGHT),
}


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
    """Architecture of a Llama 2/3 model; field names follow Hugging Face's `LlamaConfig`.

    `rope_scaling` accepts a `RopeScaling` or an HF-style dict (converted on construction, so
    the config stays hashable). `head_dim=None` means `hidden_size // num_attention_heads`.
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

    def __post_init__(self):
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

    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | Mapping[str, Any]) -> LlamaConfig:
        """Builds the config from an HF `config.json` (a folder, the file itself, or its dict).

        Reads both the transformers 4 keys (`rope_theta`, `rope_scaling`) and the transformers 5
        `rope_parameters`. Raises ValueError for a non-Llama model or features this port lacks.
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
        if model_type != "llama":
            raise ValueError(f"not a Llama config: model_type={model_type!r}, expected 'llama'")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported; Llama uses 'silu'")
        for flag in ("attention_bias", "mlp_bias"):
            if d.get(flag, False):
                raise ValueError(f"{flag}=True is not supported by this Llama port")
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
        )

    def to_hf_dict(self, torch_dtype: str | None = None) -> dict[str, Any]:
        """An HF `config.json` dict that transformers 4 and 5 both load as this model."""
        d = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_hf_dict(),
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
        }
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


def apply_rope(x_BTNH: jax.Array, positions_BT: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates halves (HF's `rotate_half` layout); angles in float32, product in x's dtype."""
    angles_BTh = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles_BTH = jnp.concatenate([angles_BTh, angles_BTh], axis=-1)
    cos = jnp.cos(angles_BTH)[:, :, None, :].astype(x_BTNH.dtype)
    sin = jnp.sin(angles_BTH)[:, :, None, :].astype(x_BTNH.dtype)
    x1, x2 = jnp.split(x_BTNH, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x_BTNH * cos + rotated * sin


def _model_attention(dtype, implementation: str):
    """Causal :func:`coat_jax.attention.attend` on the kernel ``implementation`` resolves to;
    XLA's under ``jax.checkpoint``, since it would keep the [B, N, T, T] probabilities."""
    impl = attention_implementation(dtype, implementation)
    attend_fn = functools.partial(attend, is_causal=True, implementation=impl)
    return jax.checkpoint(attend_fn) if impl == "xla" else attend_fn


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def causal_attention(q_BTNH, k_BTKH, v_BTKH, implementation: str = "auto") -> jax.Array:
    """Causal GQA attention via `jax.nn.dot_product_attention` (its native GQA support).

    On the GPU cuDNN's flash attention keeps only q, k, v, output and log-sum-exp for backward.
    XLA's version would keep the [B, N, T, T] probabilities, so there it is rematerialized
    (`jax.checkpoint` keeps the inputs only; docs/design.md, 'The precision flow'). Whatever the
    implementation keeps is tagged `ATTENTION` for the remat policies: the forward is
    `jax.vjp` of the attention, whose pullback's arrays are exactly its residuals.
    ``implementation`` (static): as :attr:`coat_jax.fp8_ops.FP8Config.attention`.
    """
    return _model_attention(q_BTNH.dtype, implementation)(q_BTNH, k_BTKH, v_BTKH)


def _causal_attention_fwd(q_BTNH, k_BTKH, v_BTKH, implementation="auto"):
    attend_fn = _model_attention(q_BTNH.dtype, implementation)
    out, pullback = jax.vjp(attend_fn, q_BTNH, k_BTKH, v_BTKH)
    return out, jax.tree.map(lambda r: checkpoint_name(r, ATTENTION), pullback)


def _causal_attention_bwd(implementation, pullback, dout):
    return pullback(dout)


causal_attention.defvjp(_causal_attention_fwd, _causal_attention_bwd)


def check_input_ids(input_ids_BT) -> None:
    """``ValueError`` unless ``input_ids`` are integer token ids of shape [batch, seq]."""
    if input_ids_BT.ndim != 2 or not jnp.issubdtype(input_ids_BT.dtype, jnp.integer):
        raise ValueError(
            "input_ids must be int token ids of shape [batch, seq], got "
            f"{input_ids_BT.dtype}{tuple(input_ids_BT.shape)}"
        )


def default_positions(input_ids_BT, positions_BT=None) -> jax.Array:
    """``positions`` as given, or 0..T-1 for every row of ``input_ids`` [B, T]."""
    if positions_BT is not None:
        return positions_BT
    b, t = input_ids_BT.shape
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def _param(rngs: nnx.Rngs, shape, param_dtype, std: float) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, param_dtype))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x, ops):
        return ops.rmsnorm(x, self.weight[...], self.eps)


# The linear weights of a decoder layer by sub-module: what ``FP8Config(weight_residual="once")``
# quantizes once per step, before the layers run (``Llama.weight_codes``).
LINEAR_WEIGHTS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def _linear_weights(module, names: tuple[str, ...], codes) -> tuple | jax.Array:
    """The master weights ``names`` of ``module`` for one ``ops.linear`` call (one weight, or a
    tuple sharing the input), each paired with its FP8 codes (:class:`FP8Weight`) when ``codes``
    (a dict by name, or ``None``) holds them."""
    ws = tuple(
        getattr(module, n)[...] if codes is None else FP8Weight(getattr(module, n)[...], codes[n])
        for n in names
    )
    return ws[0] if len(ws) == 1 else ws


class Attention(nnx.Module):
    def __init__(self, config: LlamaConfig, *, param_dtype, rngs: nnx.Rngs):
        d, hd = config.hidden_size, config.head_dim
        n, k = config.num_attention_heads, config.num_key_value_heads
        std = 0.02
        self.q_proj = _param(rngs, (d, n * hd), param_dtype, std)
        self.k_proj = _param(rngs, (d, k * hd), param_dtype, std)
        self.v_proj = _param(rngs, (d, k * hd), param_dtype, std)
        self.o_proj = _param(rngs, (n * hd, d), param_dtype, std)
        self.num_heads, self.num_kv_heads, self.head_dim = n, k, hd

    def __call__(self, x_BTD, positions_BT, inv_freq, ops, codes=None):
        n, k, hd = self.num_heads, self.num_kv_heads, self.head_dim
        # One linear call for q, k and v: the shared input is quantized and saved once, and the
        # weights stay separate (no concatenated copy lives until backward).
        q, kk, v = ops.linear(x_BTD, _linear_weights(self, ("q_proj", "k_proj", "v_proj"), codes))
        b, t = x_BTD.shape[:2]
        q_BTNH = apply_rope(q.reshape(b, t, n, hd), positions_BT, inv_freq)
        k_BTKH = apply_rope(kk.reshape(b, t, k, hd), positions_BT, inv_freq)
        v_BTKH = v.reshape(b, t, k, hd)
        o_proj = _linear_weights(self, ("o_proj",), codes)
        if ops.attention_linear is not None:
            return ops.attention_linear(q_BTNH, k_BTKH, v_BTKH, o_proj)
        out_BTNH = (ops.attention or causal_attention)(q_BTNH, k_BTKH, v_BTKH)
        return ops.linear(out_BTNH.reshape(b, t, n * hd), o_proj)


class MLP(nnx.Module):
    def __init__(self, config: LlamaConfig, *, param_dtype, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = _param(rngs, (d, f), param_dtype, 0.02)
        self.up_proj = _param(rngs, (d, f), param_dtype, 0.02)
        self.down_proj = _param(rngs, (f, d), param_dtype, 0.02)

    def __call__(self, x_BTD, ops, codes=None):
        gate_BTF, up_BTF = ops.linear(x_BTD, _linear_weights(self, ("gate_proj", "up_proj"), codes))
        down = _linear_weights(self, ("down_proj",), codes)
        return ops.linear(ops.silu_mul(gate_BTF, up_BTF), down)


# What a decoder layer's FP8 ops quantize, in the order the layer calls them (the indices of the
# activation telemetry, docs/telemetry.md; tests/test_act_telemetry.py checks the order): the
# inputs of its linears (per-tensor scales), and the tensors its non-linear ops keep for
# backward (1xG scales): the residual stream into each RMSNorm, the gate projection into SiLU,
# SiLU's output and the up projection into the product (with FP8Config(swiglu="fused"): gate
# and up into the fused SwiGLU); with fp8_attention q, k and v too.
LINEAR_INPUTS = ("self_attn.qkv", "self_attn.o_proj", "mlp.gate_up", "mlp.down_proj")
ATTENTION_INPUTS = ("self_attn.q", "self_attn.k", "self_attn.v")


def group_scaled(precision: str, fp8_attention: bool, swiglu: str = "coat") -> tuple[str, ...]:
    """The 1xG-scaled tensors a decoder layer keeps, in call order (:data:`LINEAR_INPUTS`);
    ``swiglu`` is ``FP8Config.swiglu``."""
    attention = ATTENTION_INPUTS if fp8_attention else ()
    if precision != "coat":
        return attention
    if swiglu == "fused":
        mlp = ("post_attention_layernorm", "mlp.swiglu_gate", "mlp.swiglu_up")
    else:
        mlp = ("post_attention_layernorm", "mlp.silu", "mlp.mul_silu", "mlp.mul_up")
    return ("input_layernorm", *attention, *mlp)


def _model_ops(precision: str, config: FP8Config, fp8_attn: bool, recorder=None) -> OpSet:
    """The op set of a model (:meth:`Llama.ops`); with ``recorder``, ops that hand it the scales
    they quantize with."""
    ops = ops_for(precision, config, recorder=recorder)
    if fp8_attn:
        if recorder is None:
            attention = lambda q, k, v: fp8_attention(q, k, v, True, config)
            attention_linear = lambda q, k, v, w: fp8_attention_linear(q, k, v, w, True, config)
        else:
            attention = recorded_attention(config, recorder)
            attention_linear = recorded_attention_linear(config, recorder)
        ops = ops._replace(attention=attention)
        if config.attention_backward == "saved_output":
            ops = ops._replace(attention_linear=attention_linear)
    elif ops.attention is None:
        ops = ops._replace(
            attention=functools.partial(causal_attention, implementation=config.attention)
        )
    return ops


def _recording(precision: str, config: FP8Config, fp8_attn: bool) -> tuple[ScaleRecorder, OpSet]:
    """A fresh :class:`ScaleRecorder` and the model's ops that hand it their scales."""
    recorder = ScaleRecorder(config)
    return recorder, _model_ops(precision, config, fp8_attn, recorder)


class DecoderLayer(nnx.Module):
    def __init__(self, config: LlamaConfig, *, param_dtype, rngs: nnx.Rngs):
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, param_dtype=param_dtype)
        self.self_attn = Attention(config, param_dtype=param_dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, param_dtype=param_dtype)
        self.mlp = MLP(config, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x_BTD, positions_BT, inv_freq, ops, codes=None):
        """One layer; ``codes``: this step's FP8 codes of its linear weights, by sub-module and
        name as :data:`LINEAR_WEIGHTS` (``Llama.weight_codes``), or ``None``."""
        codes = codes or {}
        h = self.self_attn(
            self.input_layernorm(x_BTD, ops),
            positions_BT,
            inv_freq,
            ops,
            codes.get("self_attn"),
        )
        x_BTD = ops.add(x_BTD, h)
        mlp = self.mlp(self.post_attention_layernorm(x_BTD, ops), ops, codes.get("mlp"))
        return ops.add(x_BTD, mlp)


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {list(PRECISIONS)}")
    return precision


def check_remat(remat: str) -> str:
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat={remat!r} is not one of {list(REMAT_POLICIES)}")
    return remat


def _stacked_layers(config: LlamaConfig, param_dtype, rngs: nnx.Rngs) -> DecoderLayer:
    """One `DecoderLayer` whose parameters carry a leading `num_hidden_layers` axis.

    The per-layer init is `jax.vmap`ped over split keys, so under `jax.jit` (or
    `nnx.eval_shape`) the stacked weights are drawn on the device in one program, with no
    per-layer Python loop and no host copy.
    """
    make = lambda key: DecoderLayer(config, param_dtype=param_dtype, rngs=nnx.Rngs(params=key))
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: make(jax.random.key(0))))
    keys = jax.random.split(rngs.params(), config.num_hidden_layers)
    state = jax.vmap(lambda key: nnx.split(make(key))[1])(keys)
    return nnx.merge(graphdef, state)


def _layer_fn(graphdef, remat: str, ops, inv_freq, *, in_scan: bool, recording=None):
    """``(x, layer_state, positions, codes=None) -> x`` for one decoder layer, under the remat
    policy (``codes``: ``Llama.weight_codes`` of the layer, or ``None``).

    With ``recording`` (``() -> (ScaleRecorder, OpSet)``, the model's :func:`_recording`) the
    layer runs on ops that record their scales instead of ``ops``, and is ``(x, layer_state,
    positions, codes, observe) -> (x, scales)``: ``scales`` the recorder's
    ``summary(observe)``, made inside the layer (under the remat policy, in the scan's body), so
    that only those few arrays leave it.
    """

    if recording is None:

        def run(x_BTD, layer_state, positions_BT, codes=None):
            return nnx.merge(graphdef, layer_state)(x_BTD, positions_BT, inv_freq, ops, codes)

    else:

        def run(x_BTD, layer_state, positions_BT, codes, observe):
            recorder, observed_ops = recording()
            layer = nnx.merge(graphdef, layer_state)
            x_BTD = layer(x_BTD, positions_BT, inv_freq, observed_ops, codes)
            return x_BTD, recorder.summary(observe)

    if remat == "none":
        return run
    # Inside a scan the loop boundary already stops XLA from merging the recomputation with
    # the forward, so CSE prevention is not needed there (jax.checkpoint's docs).
    return jax.checkpoint(run, policy=REMAT_POLICIES[remat], prevent_cse=not in_scan)


def is_stacked(params: Mapping) -> bool:
    """True for a pure-dict parameter tree in the scanned layout (stacked `layers`)."""
    layers = params.get("layers")
    if not isinstance(layers, Mapping) or not layers:
        raise ValueError("not a Llama parameter tree: it has no 'layers' entry")
    int_keys = [isinstance(k, (int, np.integer)) for k in layers]
    if all(int_keys):
        return False
    if any(int_keys):
        raise ValueError(f"'layers' mixes layer indices and names: {sorted(map(str, layers))}")
    return True


def stack_layers(params: Mapping) -> dict:
    """Unrolled pure-dict parameters (`layers` = {0: ..., 1: ...}) -> the scanned layout.

    Works on any tree that mirrors the parameters (optimizer moments, FP8 codes and per-group
    statistics: their last axis is untouched, so groups stay the same). Identity on a tree
    that is already stacked.
    """
    if is_stacked(params):
        return dict(params)
    layers = params["layers"]
    per_layer = [layers[i] for i in sorted(layers)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs) if _is_array(xs[0]) else xs[0], *per_layer)
    return {**params, "layers": stacked}


def unstack_layers(params: Mapping) -> dict:
    """The scanned layout -> unrolled pure-dict parameters; identity on an unrolled tree."""
    if not is_stacked(params):
        return dict(params)
    stacked = params["layers"]
    arrays = [a for a in jax.tree.leaves(stacked) if _is_array(a)]
    if not arrays:
        raise ValueError("stacked 'layers' hold no arrays")
    n = arrays[0].shape[0]
    layers = {
        i: jax.tree.map(lambda a, i=i: a[i] if _is_array(a) else a, stacked) for i in range(n)
    }
    return {**params, "layers": layers}


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def relayout(tree, *, scan_layers: bool):
    """Every parameter-mirroring dict in ``tree`` (one with a ``layers`` entry) in one layout.

    ``tree`` may be the parameters, an optimizer state holding trees like them (optax's
    ``mu``/``nu``, coat_adamw's FP8 codes and per-group statistics) or a dict of both;
    everything else passes through unchanged.
    """
    convert = stack_layers if scan_layers else unstack_layers
    is_params = lambda x: isinstance(x, Mapping) and "layers" in x and "embed_tokens" in x
    return jax.tree.map(lambda x: convert(x) if is_params(x) else x, tree, is_leaf=is_params)


class Llama(nnx.Module):
    """Llama causal LM: int token ids [batch, seq] -> float32 logits [batch, seq, vocab].

    Args:
      config: the architecture.
      precision: "bf16" (plain ops, XLA autodiff), "fp8" (FP8 linear layers only, like
        TransformerEngine) or "coat" (COAT's full FP8 precision flow, docs/design.md, 'The
        precision flow').
      dtype: compute dtype of activations and attention (bfloat16; float32 for exactness tests).
      param_dtype: dtype of the master weights.
      rngs: initialization randomness (normal, std 0.02, as HF's `initializer_range`).
      fp8_config: static settings of the FP8 ops (formats, group size, kernels, what the
        linears keep of their weights) for "fp8" and "coat"; None means
        `coat_jax.fp8_ops.DEFAULT_CONFIG`.
      scan_layers: keep the decoder layers' parameters stacked (leading `num_hidden_layers`
        axis) and run them with `jax.lax.scan`: one compiled layer body instead of one per
        layer (MaxText's `scan_layers`). The pure-dict layouts convert with `stack_layers` /
        `unstack_layers`; the same seed draws different weights in the two layouts.
      remat: a name of `REMAT_POLICIES`, applied to every decoder layer (scanned or not).
      fp8_attention: keep attention's q, k and v for backward as FP8 (E4M3, 1xG scales) and
        re-run the attention forward in backward (`coat_jax.fp8_ops.fp8_attention`), instead
        of the BF16 q, k, v, output and log-sum-exp cuDNN keeps. Beyond COAT; "fp8" and
        "coat" precision only. The forward is unchanged (attention on the exact q, k, v).
        With ``FP8Config(attention_backward="saved_output")`` attention and the o_proj run as
        one op (`coat_jax.fp8_ops.fp8_attention_linear`) that keeps the softmax statistics
        too and takes the output from the o_proj's FP8 input: no forward re-run.

    Example:
      >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
      ...                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
      >>> logits = Llama(cfg, rngs=nnx.Rngs(0), scan_layers=True)(jnp.zeros((1, 8), jnp.int32))
      >>> logits.shape
      (1, 8, 64)
    """

    def __init__(
        self,
        config: LlamaConfig,
        *,
        precision: str = "bf16",
        dtype=jnp.bfloat16,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs | None = None,
        fp8_config: FP8Config | None = None,
        scan_layers: bool = False,
        remat: str = "none",
        fp8_attention: bool = False,
    ):
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"config must be a LlamaConfig, got {type(config).__name__}")
        self.config = config
        self.precision = check_precision(precision)
        self.dtype = jnp.dtype(dtype)
        self.fp8_config = DEFAULT_CONFIG if fp8_config is None else fp8_config
        self.scan_layers = bool(scan_layers)
        self.remat = check_remat(remat)
        if fp8_attention and self.precision == "bf16":
            raise ValueError(
                "fp8_attention=True needs precision 'fp8' or 'coat' (FP8 residuals); "
                "precision 'bf16' is the plain baseline"
            )
        self.fp8_attention = bool(fp8_attention)
        if self.fp8_config.attention_backward != "recompute" and not self.fp8_attention:
            raise ValueError(
                f"FP8Config(attention_backward={self.fp8_config.attention_backward!r}) is an "
                "option of FP8 attention: pass fp8_attention=True (precision 'fp8' or 'coat'), "
                "or leave attention_backward='recompute'"
            )
        rngs = nnx.Rngs(0) if rngs is None else rngs
        self.embed_tokens = _param(rngs, (config.vocab_size, config.hidden_size), param_dtype, 0.02)
        if self.scan_layers:
            self.layers = _stacked_layers(config, param_dtype, rngs)
        else:
            self.layers = nnx.List(
                [
                    DecoderLayer(config, param_dtype=param_dtype, rngs=rngs)
                    for _ in range(config.num_hidden_layers)
                ]
            )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype=param_dtype)
        if not config.tie_word_embeddings:
            self.lm_head = _param(rngs, (config.hidden_size, config.vocab_size), param_dtype, 0.02)

    def hidden_states(
        self, input_ids_BT: jax.Array, positions_BT: jax.Array | None = None
    ) -> jax.Array:
        """The final normed hidden states [B, T, D] in the compute dtype (before the LM head)."""
        check_input_ids(input_ids_BT)
        x_BTD = self.decoder(
            self.embed(input_ids_BT), default_positions(input_ids_BT, positions_BT)
        )
        return self.norm(x_BTD, self.ops())

    def embed(self, input_ids_BT: jax.Array) -> jax.Array:
        """The token embeddings [B, T, D] in the compute dtype."""
        # Gather rows in the master dtype, then cast: casting the whole table first would
        # materialize a second [vocab, hidden] copy every step.
        return jnp.take(self.embed_tokens[...], input_ids_BT, axis=0).astype(self.dtype)

    def ops(self, recorder: ScaleRecorder | None = None) -> OpSet:
        """The op set of this model's precision (with FP8 attention if asked for); with
        ``recorder``, FP8 ops that hand it the scales they quantize with (same results)."""
        return _model_ops(self.precision, self.fp8_config, self.fp8_attention, recorder)

    def _recording(self):
        """``() -> (ScaleRecorder, OpSet)``: a fresh recorder and this model's ops that record
        into it (static: a layer's function calls it inside its own trace)."""
        return functools.partial(_recording, self.precision, self.fp8_config, self.fp8_attention)

    def activation_names(self) -> dict[str, tuple[str, ...]]:
        """What the activation scales of :meth:`observed_hidden_states` are, by their last
        axis: ``"linear"`` the linear inputs of a layer (per-tensor scales), ``"group"`` the
        1xG-scaled tensors of a layer, ``"norm"`` the final norm's input. Empty where the
        precision has no such FP8 tensors (all three for ``"bf16"``).

        Example:
          >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
          ...                   num_hidden_layers=2, num_attention_heads=4)
          >>> names = Llama(cfg, precision="coat", rngs=nnx.Rngs(0)).activation_names()
          >>> names["linear"][0], names["group"][:2], names["norm"]
          ('self_attn.qkv', ('input_layernorm', 'post_attention_layernorm'), ('norm',))
        """
        fp8 = self.precision != "bf16"
        return {
            "linear": LINEAR_INPUTS if fp8 else (),
            "group": group_scaled(self.precision, self.fp8_attention, self.fp8_config.swiglu)
            if fp8
            else (),
            "norm": ("norm",) if self.precision == "coat" else (),
        }

    def scanned_layer(self, *, observed: bool = False):
        """``(layer, stacked)`` of a scanned model: one decoder layer as a function and the state.

        ``layer(x_BTD, layer_state, positions_BT, codes=None) -> x_BTD`` runs one layer (under
        the remat policy) on one layer's slice of ``stacked`` (the ``nnx.State`` of the stacked
        layers, leading axis ``num_hidden_layers``) and of :meth:`weight_codes`; :meth:`decoder`
        scans it. For code that drives the layers itself (``coat_jax.training.layerwise``).
        With ``observed``, ``layer(x_BTD, layer_state, positions_BT, codes, observe) -> (x_BTD,
        scales)``: the layer's activation scales as :meth:`observed_decoder` gives them per
        layer.
        """
        if not self.scan_layers:
            raise ValueError("scanned_layer() needs a model built with scan_layers=True")
        graphdef, stacked = nnx.split(self.layers)
        layer = _layer_fn(
            graphdef,
            self.remat,
            self.ops(),
            rope_inv_freq(self.config),
            in_scan=True,
            recording=self._recording() if observed else None,
        )
        return layer, stacked

    def weight_codes(self, layer_state) -> dict | None:
        """This step's FP8 codes of the linear weights in ``layer_state`` (one layer's
        ``nnx.State``, or the stacked layers': one scale per layer), as ``{sub-module: {name:
        QuantizedTensor}}`` (:data:`LINEAR_WEIGHTS`); ``None`` unless the precision has FP8
        linears and ``fp8_config.weight_residual`` is ``"once"``.

        Under ``"once"`` :meth:`decoder` makes them before the layers run, each weight once per
        step, and the layers' forward and backward GEMMs read them (``FP8Weight``).
        """
        if self.precision == "bf16" or self.fp8_config.weight_residual != "once":
            return None
        weights = nnx.to_pure_dict(layer_state)
        return {
            part: {n: quantize_weight(weights[part][n], self.fp8_config) for n in names}
            for part, names in LINEAR_WEIGHTS.items()
        }

    def decoder(self, x_BTD: jax.Array, positions_BT: jax.Array) -> jax.Array:
        """The decoder layers on embedded inputs [B, T, D] (scanned or not, under the remat)."""
        return self._decoder(x_BTD, positions_BT, None)[0]

    def observed_decoder(self, x_BTD: jax.Array, positions_BT: jax.Array, observe) -> tuple:
        """:meth:`decoder` and the scales its FP8 ops quantize activations with:
        ``(x_BTD, scales)``, ``scales`` each layer's ``ScaleRecorder.summary(observe)``
        stacked on a leading layer axis (``{"linear": [L, n], "group": {"max", "min",
        "nonfinite": [L, m]}}``, by :meth:`activation_names`). ``observe`` (a boolean scalar)
        says whether the per-group reductions are computed (placeholders where not). The
        same result as :meth:`decoder`, bit for bit.
        """
        return self._decoder(x_BTD, positions_BT, observe)

    def _decoder(self, x_BTD, positions_BT, observe):
        recording = None if observe is None else self._recording()
        # observe=None runs the layers exactly as without the telemetry (the same program).
        extra = () if observe is None else (observe,)
        if self.scan_layers:
            layer, stacked = self.scanned_layer(observed=observe is not None)

            def body(x_BTD, xs):
                layer_state, codes = xs
                out = layer(x_BTD, layer_state, positions_BT, codes, *extra)
                return out if observe is not None else (out, None)

            return jax.lax.scan(body, x_BTD, (stacked, self.weight_codes(stacked)))
        ops = self.ops()
        inv_freq = rope_inv_freq(self.config)
        scales = []
        for decoder_layer in self.layers:
            graphdef, layer_state = nnx.split(decoder_layer)
            layer = _layer_fn(
                graphdef, self.remat, ops, inv_freq, in_scan=False, recording=recording
            )
            x_BTD = layer(x_BTD, layer_state, positions_BT, self.weight_codes(layer_state), *extra)
            if observe is not None:
                x_BTD, layer_scales = x_BTD
                scales.append(layer_scales)
        stacked_scales = jax.tree.map(lambda *xs: jnp.stack(xs), *scales) if scales else None
        return x_BTD, stacked_scales

    def observed_norm(self, x_BTD: jax.Array, observe) -> tuple:
        """The final norm of :meth:`hidden_states` and the summary of the 1xG scales it keeps
        (``ScaleRecorder.summary(observe)``; empty unless the precision is ``"coat"``)."""
        recorder, ops = self._recording()()
        return self.norm(x_BTD, ops), recorder.summary(observe)

    def observed_hidden_states(
        self, input_ids_BT: jax.Array, observe, positions_BT: jax.Array | None = None
    ) -> tuple:
        """:meth:`hidden_states` and the scales the FP8 ops quantized activations with:
        ``(hidden_BTD, {"layers": observed_decoder's scales, "norm": observed_norm's})``.

        The activation telemetry (``coat_jax.training.telemetry.ActivationTelemetry``) reads
        them; the hidden states are :meth:`hidden_states`' bit for bit.
        """
        check_input_ids(input_ids_BT)
        x_BTD, layers = self.observed_decoder(
            self.embed(input_ids_BT), default_positions(input_ids_BT, positions_BT), observe
        )
        hidden_BTD, norm = self.observed_norm(x_BTD, observe)
        return hidden_BTD, {"layers": layers, "norm": norm}

    def output_weight(self, *, cast: bool = True) -> jax.Array:
        """The LM head as [D, V] (the tied embedding's transpose if tied).

        In the compute dtype, or with ``cast=False`` in the master dtype (for a loss that casts
        block by block, such as ``coat_jax.losses.cross_entropy_from_hidden``).
        """
        w_DV = self.embed_tokens[...].T if self.config.tie_word_embeddings else self.lm_head[...]
        return w_DV.astype(self.dtype) if cast else w_DV

    def __call__(self, input_ids_BT: jax.Array, positions_BT: jax.Array | None = None):
        """Logits [B, T, V] in float32; `positions` default to 0..T-1 for every row."""
        return self.logits(self.hidden_states(input_ids_BT, positions_BT))

    def logits(self, hidden_BTD: jax.Array) -> jax.Array:
        """Float32 logits [B, T, V] of final hidden states (:meth:`hidden_states`)."""
        return jnp.einsum(
            "btd,dv->btv", hidden_BTD, self.output_weight(), preferred_element_type=jnp.float32
        )

"""The Llama-like decoder in Flax NNX with BF16, FP8-linear and COAT precision modes.

One decoder serves the families of :mod:`coat_jax.families` (Llama 2/3, Mistral, Qwen2/2.5,
Qwen3, OLMo 2): the config's ``model_type`` picks the family's switches.

One model code path serves all three modes: every linear, RMSNorm, SiLU, product and residual add
goes through the `OpSet` that `coat_jax.fp8_ops.ops_for(precision)` returns, so switching modes
swaps the op implementations and nothing else. Attention stays in the compute dtype (BF16) in
every mode, as in COAT (docs/design.md, 'The precision flow').

Weights are stored `[in, out]` (HF stores `[out, in]`; `coat_jax.checkpoint_io` transposes) and
q/k/v and gate/up are separate parameters, so the checkpoint name map stays one-to-one.

This module is the model: :class:`Llama`, its remat policies, the op set it runs and the
telemetry names of what its layers quantize. Its parts live beside it and are re-exported here:
the architecture in :mod:`coat_jax.llama_config`, the layers in :mod:`coat_jax.llama_layers`,
the two parameter-tree layouts in :mod:`coat_jax.llama_layout`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from coat_jax.attention import attention_implementation
from coat_jax.families import LLAMA, Family
from coat_jax.fp8_ops import (
    ACTIVATION,
    DEFAULT_CONFIG,
    PRECISIONS,
    WEIGHT,
    FP8Config,
    OpSet,
    ScaleRecorder,
    fp8_attention,
    fp8_attention_linear,
    ops_for,
    quantize_weight,
    recorded_attention,
    recorded_attention_linear,
)
from coat_jax.llama_config import ROPE_TYPES, LlamaConfig, RopeScaling, rope_inv_freq
from coat_jax.llama_layers import (
    ATTENTION,
    LINEAR_WEIGHTS,
    MLP,
    Attention,
    DecoderLayer,
    KVCache,
    RMSNorm,
    apply_rope,
    causal_attention,
    normal_param,
)
from coat_jax.llama_layout import is_stacked, relayout, stack_layers, unstack_layers

__all__ = [
    # the model
    "Llama",
    "REMAT_POLICIES",
    "LINEAR_INPUTS",
    "ATTENTION_INPUTS",
    "group_scaled",
    "check_input_ids",
    "check_precision",
    "check_remat",
    "default_positions",
    # its architecture (coat_jax.llama_config)
    "ROPE_TYPES",
    "LlamaConfig",
    "RopeScaling",
    "rope_inv_freq",
    # its layers (coat_jax.llama_layers)
    "ATTENTION",
    "LINEAR_WEIGHTS",
    "MLP",
    "Attention",
    "DecoderLayer",
    "KVCache",
    "RMSNorm",
    "apply_rope",
    "causal_attention",
    # its parameter layouts (coat_jax.llama_layout)
    "is_stacked",
    "relayout",
    "stack_layers",
    "unstack_layers",
]

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


# What a decoder layer's FP8 ops quantize, in the order the layer calls them (the indices of the
# activation telemetry, docs/telemetry.md; tests/training/test_act_telemetry.py checks the order): the
# inputs of its linears (per-tensor scales), and the tensors its non-linear ops keep for
# backward (1xG scales): the residual stream into each RMSNorm, the gate projection into SiLU,
# SiLU's output and the up projection into the product (with FP8Config(swiglu="fused"): gate
# and up into the fused SwiGLU); with fp8_attention q, k and v too.
LINEAR_INPUTS = ("self_attn.qkv", "self_attn.o_proj", "mlp.gate_up", "mlp.down_proj")
ATTENTION_INPUTS = ("self_attn.q", "self_attn.k", "self_attn.v")


def group_scaled(
    precision: str, fp8_attention: bool, swiglu: str = "coat", family: Family = LLAMA
) -> tuple[str, ...]:
    """The 1xG-scaled tensors a decoder layer of ``family`` keeps, in call order
    (:data:`LINEAR_INPUTS`); ``swiglu`` is ``FP8Config.swiglu``."""
    attention = ATTENTION_INPUTS if fp8_attention else ()
    if precision != "coat":
        return attention
    if swiglu == "fused":
        mlp = ("mlp.swiglu_gate", "mlp.swiglu_up")
    else:
        mlp = ("mlp.silu", "mlp.mul_silu", "mlp.mul_up")
    qk = ("self_attn.q_norm", "self_attn.k_norm") if family.qk_norm != "none" else ()
    if family.post_norms:
        return (*qk, *attention, "post_attention_layernorm", *mlp, "post_feedforward_layernorm")
    return ("input_layernorm", *qk, *attention, "post_attention_layernorm", *mlp)


def _model_ops(
    precision: str, config: FP8Config, fp8_attn: bool, dtype, recorder=None, segment_ids_BT=None
) -> OpSet:
    """The op set of a model (:meth:`Llama.ops`) of compute ``dtype``; with ``recorder``, ops
    that hand it the scales they quantize with. The model's own attention takes the kernel
    ``config.attention`` resolves to for ``dtype``; with ``segment_ids_BT`` attention stays
    within each segment (the documents of packed windows)."""
    ops = ops_for(precision, config, recorder=recorder)
    if (
        segment_ids_BT is not None
        and fp8_attn
        and (recorder is not None or config.attention_backward == "saved_output")
    ):
        raise ValueError(
            "attention within documents (segment ids) runs FP8 attention with "
            "attention_backward='recompute' and without the activation telemetry; use those, "
            "or attend across documents"
        )
    if fp8_attn:
        if recorder is None:
            attention = functools.partial(
                fp8_attention, is_causal=True, config=config, segment_ids=segment_ids_BT
            )
            attention_linear = lambda q, k, v, w: fp8_attention_linear(q, k, v, w, True, config)
        else:
            attention = recorded_attention(config, recorder)
            attention_linear = recorded_attention_linear(config, recorder)
        ops = ops._replace(attention=attention)
        if config.attention_backward == "saved_output":
            ops = ops._replace(attention_linear=attention_linear)
    elif ops.attention is None:
        impl = attention_implementation(dtype, config.attention)
        ops = ops._replace(
            attention=functools.partial(
                causal_attention, implementation=impl, segment_ids_BT=segment_ids_BT
            )
        )
    return ops


def _recording(
    precision: str, config: FP8Config, fp8_attn: bool, dtype, segment_ids_BT=None
) -> tuple[ScaleRecorder, OpSet]:
    """A fresh :class:`ScaleRecorder` and the model's ops that hand it their scales."""
    recorder = ScaleRecorder(config)
    return recorder, _model_ops(precision, config, fp8_attn, dtype, recorder, segment_ids_BT)


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


class Llama(nnx.Module):
    """Causal LM of any family: int token ids [batch, seq] -> float32 logits [batch, seq, vocab].

    Args:
      config: the architecture (its ``model_type`` picks the family's switches).
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

    Examples:
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
        self.embed_tokens = normal_param(
            rngs, (config.vocab_size, config.hidden_size), param_dtype, 0.02
        )
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
            self.lm_head = normal_param(
                rngs, (config.hidden_size, config.vocab_size), param_dtype, 0.02
            )

    def hidden_states(
        self,
        input_ids_BT: jax.Array,
        positions_BT: jax.Array | None = None,
        segment_ids_BT: jax.Array | None = None,
    ) -> jax.Array:
        """The final normed hidden states [B, T, D] in the compute dtype (before the LM head);
        with ``segment_ids_BT`` (int [B, T]) a token attends only to tokens of its own segment
        (the documents of a packed window), on XLA's attention."""
        check_input_ids(input_ids_BT)
        x_BTD = self.decoder(
            self.embed(input_ids_BT),
            default_positions(input_ids_BT, positions_BT),
            segment_ids_BT,
        )
        return self.norm(x_BTD, self.ops())

    def embed(self, input_ids_BT: jax.Array) -> jax.Array:
        """The token embeddings [B, T, D] in the compute dtype."""
        # Gather rows in the master dtype, then cast: casting the whole table first would
        # materialize a second [vocab, hidden] copy every step.
        return jnp.take(self.embed_tokens[...], input_ids_BT, axis=0).astype(self.dtype)

    def ops(self, recorder: ScaleRecorder | None = None, segment_ids_BT=None) -> OpSet:
        """The op set of this model's precision (with FP8 attention if asked for); with
        ``recorder``, FP8 ops that hand it the scales they quantize with (same results); with
        ``segment_ids_BT``, attention within each segment."""
        return _model_ops(
            self.precision,
            self.fp8_config,
            self.fp8_attention,
            self.dtype,
            recorder,
            segment_ids_BT,
        )

    def _recording(self, segment_ids_BT=None):
        """``() -> (ScaleRecorder, OpSet)``: a fresh recorder and this model's ops that record
        into it (static: a layer's function calls it inside its own trace)."""
        return functools.partial(
            _recording,
            self.precision,
            self.fp8_config,
            self.fp8_attention,
            self.dtype,
            segment_ids_BT=segment_ids_BT,
        )

    def activation_names(self) -> dict[str, tuple[str, ...]]:
        """What the activation scales of :meth:`observed_hidden_states` are, by their last
        axis: ``"linear"`` the linear inputs of a layer (per-tensor scales), ``"group"`` the
        1xG-scaled tensors of a layer, ``"norm"`` the final norm's input. Empty where the
        precision has no such FP8 tensors (all three for ``"bf16"``).

        Examples:
          >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
          ...                   num_hidden_layers=2, num_attention_heads=4)
          >>> names = Llama(cfg, precision="coat", rngs=nnx.Rngs(0)).activation_names()
          >>> names["linear"][0], names["group"][:2], names["norm"]
          ('self_attn.qkv', ('input_layernorm', 'post_attention_layernorm'), ('norm',))
        """
        fp8 = self.precision != "bf16"
        return {
            "linear": LINEAR_INPUTS if fp8 else (),
            "group": group_scaled(
                self.precision, self.fp8_attention, self.fp8_config.swiglu, self.config.family
            )
            if fp8
            else (),
            "norm": ("norm",) if self.precision == "coat" else (),
        }

    def scanned_layer(self, *, observed: bool = False, segment_ids_BT=None):
        """``(layer, stacked)`` of a scanned model: one decoder layer as a function and the state.

        ``layer(x_BTD, layer_state, positions_BT, codes=None) -> x_BTD`` runs one layer (under
        the remat policy) on one layer's slice of ``stacked`` (the ``nnx.State`` of the stacked
        layers, leading axis ``num_hidden_layers``) and of :meth:`weight_codes`; :meth:`decoder`
        scans it. For code that drives the layers itself (``coat_jax.training.layerwise``).
        With ``observed``, ``layer(x_BTD, layer_state, positions_BT, codes, observe) -> (x_BTD,
        scales)``: the layer's activation scales as :meth:`observed_decoder` gives them per
        layer. ``segment_ids_BT``: attention within each segment (:meth:`hidden_states`).
        """
        if not self.scan_layers:
            raise ValueError("scanned_layer() needs a model built with scan_layers=True")
        graphdef, stacked = nnx.split(self.layers)
        layer = _layer_fn(
            graphdef,
            self.remat,
            self.ops(segment_ids_BT=segment_ids_BT),
            rope_inv_freq(self.config),
            in_scan=True,
            recording=self._recording(segment_ids_BT) if observed else None,
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

    def decoder(self, x_BTD: jax.Array, positions_BT: jax.Array, segment_ids_BT=None) -> jax.Array:
        """The decoder layers on embedded inputs [B, T, D] (scanned or not, under the remat);
        ``segment_ids_BT``: attention within each segment (:meth:`hidden_states`)."""
        return self._decoder(x_BTD, positions_BT, None, segment_ids_BT)[0]

    def observed_decoder(
        self, x_BTD: jax.Array, positions_BT: jax.Array, observe, segment_ids_BT=None
    ) -> tuple:
        """:meth:`decoder` and the scales its FP8 ops quantize activations with:
        ``(x_BTD, scales)``, ``scales`` each layer's ``ScaleRecorder.summary(observe)``
        stacked on a leading layer axis (``{"linear": [L, n], "group": {"max", "min",
        "nonfinite": [L, m]}}``, by :meth:`activation_names`). ``observe`` (a boolean scalar)
        says whether the per-group reductions are computed (placeholders where not). The
        same result as :meth:`decoder`, bit for bit.
        """
        return self._decoder(x_BTD, positions_BT, observe, segment_ids_BT)

    def _decoder(self, x_BTD, positions_BT, observe, segment_ids_BT=None):
        recording = None if observe is None else self._recording(segment_ids_BT)
        # observe=None runs the layers exactly as without the telemetry (the same program).
        extra = () if observe is None else (observe,)
        if self.scan_layers:
            layer, stacked = self.scanned_layer(
                observed=observe is not None, segment_ids_BT=segment_ids_BT
            )

            def body(x_BTD, xs):
                layer_state, codes = xs
                out = layer(x_BTD, layer_state, positions_BT, codes, *extra)
                return out if observe is not None else (out, None)

            return jax.lax.scan(body, x_BTD, (stacked, self.weight_codes(stacked)))
        ops = self.ops(segment_ids_BT=segment_ids_BT)
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
        self,
        input_ids_BT: jax.Array,
        observe,
        positions_BT: jax.Array | None = None,
        segment_ids_BT: jax.Array | None = None,
    ) -> tuple:
        """:meth:`hidden_states` and the scales the FP8 ops quantized activations with:
        ``(hidden_BTD, {"layers": observed_decoder's scales, "norm": observed_norm's})``.

        The activation telemetry (``coat_jax.training.telemetry.ActivationTelemetry``) reads
        them; the hidden states are :meth:`hidden_states`' bit for bit.
        """
        check_input_ids(input_ids_BT)
        x_BTD, layers = self.observed_decoder(
            self.embed(input_ids_BT),
            default_positions(input_ids_BT, positions_BT),
            observe,
            segment_ids_BT,
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

"""The model a config trains, as the step sees it: built abstractly, bound to a parameter tree.

:class:`ModelDef` is the static half of an NNX Llama (its graph and abstract state), built by
:func:`model_def_for` with the config's precision, dtypes, layer layout, remat policy and FP8
settings; the step binds it to a pure-dict parameter tree and computes the next-token loss
(:func:`next_token_loss`, and :func:`observed_next_token_loss` for the activation telemetry).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from coat_jax.fp8_ops import is_gpu_backend
from coat_jax.llama import Llama, LlamaConfig
from coat_jax.losses import cross_entropy_from_hidden
from coat_jax.training import sharding
from coat_jax.training.config import TrainConfig
from coat_jax.training.data import DOCUMENT_START, targets
from coat_jax.training.kernel_choice import op_implementations
from coat_jax.training.optimizers import kernel_options
from pallas_kernels.sharding import KernelMesh

COMPUTE_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """The static half of an NNX Llama; ``apply`` runs it on a pure-dict parameter tree."""

    config: LlamaConfig
    graphdef: Any
    abstract_state: Any
    loss_chunk_size: int | None = None
    # Windows mark the tokens that are no loss target (a chat's non-assistant tokens) by their
    # sign: -(id + 1) (coat_jax.training.data.order.PackedWindows). Static, so that a run on
    # plain text computes the plain mean.
    loss_mask: bool = False
    # Windows flag each document's first token (``DOCUMENT_START`` added to its id): attention
    # stays within documents (``within_documents``) and positions restart at each
    # (``document_positions``).
    within_documents: bool = False
    document_positions: bool = False

    @property
    def flags_documents(self) -> bool:
        return self.within_documents or self.document_positions

    def bind(self, params) -> Llama:
        state = jax.tree.map(lambda x: x, self.abstract_state)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)

    def apply(self, params, tokens_BT):
        return self.bind(params)(tokens_BT)

    @property
    def abstract_params(self):
        return nnx.to_pure_dict(self.abstract_state)


def split_params(model) -> tuple[Any, Any]:
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise ValueError(
            "the model holds state other than parameters "
            f"({list(nnx.to_flat_state(rest))[:3]}...); the trainer would not checkpoint it"
        )
    return graphdef, params


def model_def_for(
    llama_cfg: LlamaConfig,
    cfg: TrainConfig,
    mesh=None,
    *,
    loss_mask: bool = False,
    within_documents: bool = False,
) -> ModelDef:
    """The model ``cfg`` trains (precision, dtype, layer layout, remat), built abstractly.

    ``cfg.kernels`` (its ``fp8_ops`` part, unset: by the model's width and the tokens per
    device, ``optimizers.fp8_ops_auto``; and its per-op parts) picks where the FP8 ops run;
    with ``mesh`` (a program on several devices) their Pallas kernels, where chosen, run on
    each shard (``FP8Config(mesh=KernelMesh(mesh))``): activations split over the batch axes,
    weights as the trainer's FSDP rule places them. ``loss_mask``: the windows mark tokens that
    are no loss target; ``within_documents``: attention stays within the documents of a
    window, on XLA's attention, which alone takes that mask (:class:`ModelDef`).
    """
    abstract = nnx.eval_shape(lambda: new_model(llama_cfg, cfg, jax.random.key(0)))
    placement = {}
    if mesh is not None:
        placement["mesh"] = KernelMesh(mesh, batch_axes=sharding.BATCH_AXES, param_axis="fsdp")
    # Static FP8 settings from the trainer config (they live in the graphdef). XLA's
    # deterministic ops take XLA's attention (see TrainConfig's ``deterministic``).
    abstract.fp8_config = dataclasses.replace(
        abstract.fp8_config,
        weight_residual=cfg.fp8_weight_residual,
        group_scale=cfg.fp8_group_scale,
        swiglu=cfg.fp8_swiglu,
        attention_backward=cfg.fp8_attention_backward,
        linear_scaling=cfg.fp8_linear_scaling,
        attention="xla" if cfg.deterministic or within_documents else "auto",
        op_implementations=op_implementations(cfg.kernels),
        **kernel_options(
            cfg,
            fp8_ops=True,
            devices=1 if mesh is None else mesh.devices.size,
            hidden_size=llama_cfg.hidden_size,
        ),
        **placement,
    )
    graphdef, state = split_params(abstract)
    return ModelDef(
        llama_cfg,
        graphdef,
        state,
        cfg.loss_chunk_size,
        loss_mask,
        within_documents,
        cfg.document_positions,
    )


MASTER_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def new_model(llama_cfg: LlamaConfig, cfg: TrainConfig, key) -> Llama:
    return Llama(
        llama_cfg,
        precision=cfg.precision,
        dtype=COMPUTE_DTYPES[cfg.compute_dtype],
        param_dtype=MASTER_DTYPES[cfg.master_dtype],
        rngs=nnx.Rngs(params=key),
        scan_layers=cfg.scan_layers,
        remat=cfg.remat,
        fp8_attention=cfg.fp8_attention,
    )


def init_params_fn(llama_cfg: LlamaConfig, cfg: TrainConfig, param_shardings):
    """``key -> params``, drawing each shard of the weights on its device.

    The key is an argument: a jitted function of no arguments would make it a constant, and
    XLA then constant-folds the random weights at compile time, which for a large model takes
    far longer than drawing them. The weights are always drawn in the scanned layout, one
    vmapped layer init that compiles once for all layers. An unrolled run then takes each
    layer out with one jitted slice: drawing every layer in one unrolled program, or slicing
    the stacked draw inside that program, compiles for much longer.
    """
    stacked_cfg = dataclasses.replace(cfg, scan_layers=True)

    def init_stacked(key):
        return nnx.to_pure_dict(split_params(new_model(llama_cfg, stacked_cfg, key))[1])

    if cfg.scan_layers:
        return jax.jit(init_stacked, out_shardings=param_shardings)
    mesh = jax.tree.leaves(param_shardings)[0].mesh
    stacked_sh = sharding.param_shardings(jax.eval_shape(init_stacked, jax.random.key(0)), mesh)
    draw = jax.jit(init_stacked, out_shardings=stacked_sh)
    take = jax.jit(
        lambda layers, i: jax.tree.map(lambda a: a[i], layers),
        out_shardings=param_shardings["layers"][0],
    )

    def init(key):
        params = draw(key)
        layers = params.pop("layers")
        params["layers"] = {i: take(layers, i) for i in range(llama_cfg.num_hidden_layers)}
        del layers
        return jax.device_put(params, param_shardings)

    return init


def llama_config_dict(llama_cfg: LlamaConfig) -> dict:
    """A JSON-clean dict of the architecture (the form stored in checkpoint metadata)."""
    d = json.loads(json.dumps(dataclasses.asdict(llama_cfg)))
    # The family's keys are recorded only when not the default, so that checkpoints without
    # them (Llama runs) still resume: their fingerprints compare equal.
    for key, default in (("model_type", "llama"), ("sliding_window", None)):
        if d[key] == default:
            del d[key]
    return d


def llama_config_from_dict(d: dict) -> LlamaConfig:
    return LlamaConfig(**d)


def next_token_loss(model_def: ModelDef, params, tokens_BT1) -> jax.Array:
    """Mean cross-entropy (nats) of predicting ``tokens[:, 1:]`` from ``tokens[:, :-1]``.

    With ``loss_chunk_size`` set the logits are never materialised whole
    (:func:`coat_jax.losses.cross_entropy_from_hidden`); otherwise the plain optax loss.
    """
    inputs_BT, labels_BT, segments_BT, positions_BT = split_window(model_def, tokens_BT1)
    model = model_def.bind(params)
    hidden_BTD = model.hidden_states(inputs_BT, positions_BT, segments_BT)
    return loss_from_hidden(model_def, model, hidden_BTD, labels_BT)


def observed_next_token_loss(model_def: ModelDef, params, tokens_BT1, observe) -> tuple:
    """``(next_token_loss, scales)``: the same loss, bit for bit, and the scales the FP8 ops
    quantized activations with (``Llama.observed_hidden_states``; ``observe`` says whether
    their per-group reductions are computed)."""
    inputs_BT, labels_BT, segments_BT, positions_BT = split_window(model_def, tokens_BT1)
    model = model_def.bind(params)
    hidden_BTD, scales = model.observed_hidden_states(inputs_BT, observe, positions_BT, segments_BT)
    return loss_from_hidden(model_def, model, hidden_BTD, labels_BT), scales


def split_window(model_def: ModelDef, tokens_BT1) -> tuple:
    """``(inputs_BT, labels_BT, segment_ids_BT, positions_BT)`` of windows of ``T + 1`` tokens:
    the inputs as token ids, the labels as the window holds them (:func:`loss_from_hidden`
    reads them), the inputs' documents (numbered from 0 in each row; None unless
    ``within_documents``) and positions (0 at each document's first token and at the window's;
    None, the default 0..T-1, unless ``document_positions``)."""
    inputs_BT, labels_BT = tokens_BT1[:, :-1], tokens_BT1[:, 1:]
    if model_def.loss_mask:
        inputs_BT = jnp.where(inputs_BT < 0, -inputs_BT - 1, inputs_BT)
    if not model_def.flags_documents:
        return inputs_BT, labels_BT, None, None
    starts_BT = inputs_BT >= DOCUMENT_START
    inputs_BT = jnp.where(starts_BT, inputs_BT - DOCUMENT_START, inputs_BT)
    segments_BT = jnp.cumsum(starts_BT, axis=1) if model_def.within_documents else None
    positions_BT = None
    if model_def.document_positions:
        index_BT = jnp.broadcast_to(jnp.arange(inputs_BT.shape[1]), inputs_BT.shape)
        last_start_BT = jax.lax.cummax(jnp.where(starts_BT, index_BT, 0), axis=1)
        positions_BT = index_BT - last_start_BT
    return inputs_BT, labels_BT, segments_BT, positions_BT


def target_count(tokens_ABT1) -> jax.Array:
    """How many labels of windows (``[..., T + 1]``) are loss targets, counted where the windows
    are (every label of plain text, the assistant's tokens of a chat): ``loss_tokens``."""
    return jnp.count_nonzero(targets(tokens_ABT1))


def loss_from_hidden(model_def: ModelDef, model: Llama, hidden_BTD, labels_BT) -> jax.Array:
    """Mean cross-entropy of the final hidden states against ``labels`` (the model's head);
    with ``loss_mask`` the mean over the labels that are targets (non-negative) alone."""
    mask_BT = None
    if model_def.loss_mask:
        mask_BT = labels_BT >= 0
        labels_BT = jnp.where(mask_BT, labels_BT, -labels_BT - 1)
    if model_def.flags_documents:
        labels_BT = jnp.where(labels_BT >= DOCUMENT_START, labels_BT - DOCUMENT_START, labels_BT)
    if model_def.loss_chunk_size is None:
        logits_BTV = model.logits(hidden_BTD)
        ce_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, labels_BT)
        if mask_BT is None:
            return ce_BT.mean()
        return (ce_BT * mask_BT).sum() / mask_BT.sum()
    return cross_entropy_from_hidden(
        hidden_BTD,
        model.output_weight(cast=False),
        labels_BT,
        mask_BT=mask_BT,
        chunk_size=model_def.loss_chunk_size,
    )


def excess_precision(cfg: TrainConfig, backend: str | None = None) -> bool | None:
    """XLA's ``xla_allow_excess_precision`` for ``cfg``'s programs; ``None``: XLA's default.

    ``cfg.xla_excess_precision`` where set. Unset: ``False`` for precision ``coat`` on a GPU
    backend, where rounding every bfloat16 intermediate was measured faster (BF16's step was
    not, so it keeps XLA's default, and ``fp8`` was not measured:
    docs/bench_excess_precision.md). Elsewhere
    XLA's default: nothing was measured there, and a jit without compiler options can still be
    traced inside another (``jax.make_jaxpr(program.step_fn)``), which JAX refuses for one with
    options.
    """
    if cfg.xla_excess_precision is not None:
        return bool(cfg.xla_excess_precision)
    if cfg.precision == "coat" and is_gpu_backend(backend):
        return False
    return None

"""The optimizer inside the backward pass: each decoder layer is updated once its gradient exists.

The plain train step of a scanned model (``scan_layers: true``) differentiates the whole loss,
so its backward scan writes every layer's gradient into one stacked buffer before the optimizer
reads it: a float32 gradient of the whole model held beside the parameters and the optimizer
state, the largest item of the step's peak after them (docs/memory_options.md). Here (trainer key
``optimizer_in_backward``, torchtune's ``optimizer_in_bwd``) the step drives the layers itself:

1. forward: the embedding, then a scan over the layers that keeps each layer's backward
   residuals (what ``jax.vjp`` of the layer under its remat policy keeps, minus the layer's own
   weights, which are read back from the parameters instead of being stacked a second time),
   then the final norm and the loss;
2. backward: a reverse scan whose carry holds the stacked parameters and their optimizer state.
   At layer ``l`` it pulls the cotangent through the layer, gets that layer's gradient, runs the
   optimizer on it and writes the new weights and state into the carry in place: coat_adamw's
   fused kernel steps layer ``l`` inside the stacks itself (``coat_jax.optim.
   apply_gradients_at``), any other optimizer on the layer's slices, written back. Only one
   layer's gradient exists at a time;
3. the embedding, the final norm and the LM head are updated last, with the embedding's
   gradient complete (tied or not).

The optimizer is any optax transformation: :func:`layerwise_optimizer` keeps its state of one
layer ``vmap``-ped over the layers (every leaf gains the leading layer axis, step counts
included) and its state of the other parameters apart (:class:`LayerwiseState`), so a per-layer
update is exactly ``tx.update`` on one layer's tree. What needs the whole gradient before any
update cannot run here, and the trainer refuses it: global-norm clipping (``grad_clip``),
``skip_nonfinite_steps``, ``grad_accum`` > 1 and the optimizer telemetry. The activation
telemetry needs only the forward pass: :func:`make_train_step` takes it (``activations``), the
layers' scales leaving the forward scan beside the residuals. Results equal the plain step's
without clipping to float32 rounding (tests/training/test_layerwise.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from coat_jax.llama import default_positions
from coat_jax.optim import apply_gradients_at, fused_in_place
from coat_jax.training import sharding
from coat_jax.training.act_telemetry import ActivationTelemetry
from coat_jax.training.model import split_window, target_count
from coat_jax.training.step import apply_strategy
from pallas_kernels.stacks import element, put_element

# The key of one layer's parameters in the tree the optimizer sees per layer. Not "layers":
# coat_jax's FSDP rule reads a leading axis under "layers" as the stacked layer axis.
LAYER_KEY = "layer"


class LayerwiseState(NamedTuple):
    """The optimizer state of a run with ``optimizer_in_backward``.

    ``layers``: the optimizer's state of ``{"layer": one layer's parameters}``, vmapped (each leaf
    has a leading ``num_hidden_layers`` axis); ``head``: its state of the final norm and the LM
    head (when untied); ``embed``: of the embedding; ``count``: steps taken (seeds the
    stochastic rounding of bfloat16 masters).
    """

    layers: Any
    head: Any
    embed: Any
    count: jax.Array


EMBED = "embed_tokens"


def split_params(params) -> tuple[Any, dict, dict]:
    """``(stacked layers, head, embedding)`` of a scanned pure-dict parameter tree.

    The head is every parameter after the layers (the final norm, an untied LM head); it is
    updated before the layers' backward, the embedding after it (a tied head's gradient and the
    lookup's add up there).
    """
    if "layers" not in params:
        raise ValueError("optimizer_in_backward needs the scanned layout (scan_layers: true)")
    head = {k: v for k, v in params.items() if k not in ("layers", EMBED)}
    return params["layers"], head, {EMBED: params[EMBED]}


def _one_layer(layers):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), layers)


def layerwise_optimizer(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx``'s state laid out per layer (:class:`LayerwiseState`), for :func:`make_train_step`.

    Its ``update`` raises: the updates happen inside the backward pass of the train step.
    """

    def init(params):
        layers, head, embed = split_params(params)
        per_layer = jax.vmap(lambda p: tx.init({LAYER_KEY: p}))(layers)
        return LayerwiseState(per_layer, tx.init(head), tx.init(embed), jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        raise NotImplementedError(
            "optimizer_in_backward applies the optimizer inside the backward pass; run "
            "coat_jax.training.layerwise.make_train_step's step instead of tx.update"
        )

    return optax.GradientTransformation(init, update)


def state_shardings(tx: optax.GradientTransformation, abstract_params, mesh: Mesh):
    """The shardings of :func:`layerwise_optimizer`'s state: each leaf follows its parameter.

    A layer's state takes one layer's parameter specs (the trainer's FSDP rule) behind an
    unsplit layer axis, as the stacked parameters do.
    """
    layers, head, embed = split_params(abstract_params)
    one = {LAYER_KEY: _one_layer(layers)}
    per_layer = sharding.state_shardings(jax.eval_shape(tx.init, one), one, mesh)
    of = lambda tree: sharding.state_shardings(jax.eval_shape(tx.init, tree), tree, mesh)
    return LayerwiseState(
        jax.tree.map(lambda s: NamedSharding(mesh, PartitionSpec(None, *s.spec)), per_layer),
        of(head),
        of(embed),
        NamedSharding(mesh, PartitionSpec()),
    )


def _sum_squares(tree) -> jax.Array:
    return optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), tree), squared=True)


def make_train_step(
    model_def,
    tx: optax.GradientTransformation,
    loss_from_hidden,
    *,
    seed: int = 0,
    fused_apply: bool = True,
    low_precision: bool = False,
    activations: ActivationTelemetry | None = None,
):
    """The train step ``(params, LayerwiseState, tokens_ABT1) -> (params, state, metrics)``.

    Args:
      model_def: the trainer's ``ModelDef`` of a scanned Llama.
      tx: the optimizer (not :func:`layerwise_optimizer`'s wrapper: the transformation whose
        state it lays out). With bfloat16 parameters, one that computes in float32
        (``coat_jax.master.float32_optimizer``); each update is then applied with stochastic
        rounding, keyed by ``seed``, the step count and the layer.
      loss_from_hidden: ``(model, hidden_BTD, labels_BT) -> mean loss`` (the trainer's).
      fused_apply, low_precision: how each update is applied, as the plain step applies it
        (``coat_jax.training.step.apply_strategy``): through ``coat_jax.apply_gradients``
        (coat_adamw's fused kernel);
        for a ``tx`` whose kernel can step one layer inside the stacks (``coat_adamw``:
        ``coat_jax.optim.apply_gradients_at``), in place, with no slice of a layer's state
        read out or written back.
      activations: the activation telemetry (``act/`` metrics): each layer's scales leave the
        forward scan as an output beside its residuals, the final norm's its ``vjp``. On the
        steps it does not compute (:meth:`ActivationTelemetry.computes` of the state's count
        plus one), placeholders. ``None``: the step without it, unchanged.
    """

    in_place = fused_apply and not low_precision and fused_in_place(tx)
    apply = apply_strategy(tx, fused_apply=fused_apply, low_precision=low_precision)

    def update(grads, state, params, key):
        params, state, _ = apply(grads, state, params, key)
        return params, state

    def train_step(params, opt_state: LayerwiseState, tokens_ABT1):
        if tokens_ABT1.shape[0] != 1:
            raise ValueError(
                "optimizer_in_backward updates each layer during the backward pass, so it cannot "
                f"accumulate {tokens_ABT1.shape[0]} microbatches; set grad_accum: 1"
            )
        inputs_BT, labels_BT, segments_BT, positions_BT = split_window(model_def, tokens_ABT1[0])
        positions_BT = default_positions(inputs_BT, positions_BT)
        layers, head_params, embed_params = split_params(params)
        bind = lambda h, e, layers=layers: model_def.bind({**h, **e, "layers": layers})
        # The activation telemetry's flag: the layers reduce their scales only where it is true.
        observe = None if activations is None else activations.computes(opt_state.count + 1)
        extra = () if observe is None else (observe,)
        layer, stacked_state = bind(head_params, embed_params).scanned_layer(
            observed=observe is not None, segment_ids_BT=segments_BT
        )
        num_layers = jax.tree.leaves(layers)[0].shape[0]

        def layer_on_dict(p_l, x_BTD, codes_l):
            state = jax.tree.map(lambda a: a, stacked_state)
            nnx.replace_by_pure_dict(state, p_l)
            return layer(x_BTD, state, positions_BT, codes_l, *extra)

        # fp8_weight_residual "once": every layer's FP8 weight codes, made before the forward
        # scan (one pass over the stacked weights) and read by both scans; None otherwise.
        codes = bind(head_params, embed_params).weight_codes(stacked_state)

        x_BTD, embed_vjp = jax.vjp(lambda e: bind(head_params, e).embed(inputs_BT), embed_params)

        # What a layer's pullback holds, as a static record filled while tracing the scan body:
        # its tree structure, and for each leaf the index of the layer weight or weight code it
        # is (None: a residual that the scan stacks). Weights and codes are read back from the
        # stacks in backward instead of being stacked a second time.
        layout = {}

        def forward(x_BTD, xs):
            p_l, codes_l = xs
            # With the telemetry the layer's scales are the vjp's auxiliary output.
            y_BTD, pullback, *scales = jax.vjp(
                lambda p, x: layer_on_dict(p, x, codes_l), p_l, x_BTD, has_aux=bool(extra)
            )
            leaves, layout["treedef"] = jax.tree.flatten(pullback)
            weights = jax.tree.leaves((p_l, codes_l))
            layout["weight"] = [
                next((k for k, w in enumerate(weights) if leaf is w), None) for leaf in leaves
            ]
            kept = [leaf for leaf, k in zip(leaves, layout["weight"], strict=True) if k is None]
            return y_BTD, (kept, *scales)

        h_BTD, (residuals, *layer_scales) = lax.scan(forward, x_BTD, (layers, codes))

        def head(h, e, h_BTD):
            model = bind(h, e)
            if observe is None:
                return loss_from_hidden(model, model.norm(h_BTD, model.ops()), labels_BT)
            hidden_BTD, norm_scales = model.observed_norm(h_BTD, observe)
            return loss_from_hidden(model, hidden_BTD, labels_BT), norm_scales

        loss, head_vjp, *norm_scales = jax.vjp(
            head, head_params, embed_params, h_BTD, has_aux=bool(extra)
        )
        g_head, g_embed, g_BTD = head_vjp(jnp.ones_like(loss))
        step_key = jax.random.fold_in(jax.random.key(seed), opt_state.count)
        # The head is updated now, so that its gradient (a vocabulary-by-width float32 matrix)
        # is gone before the layers' backward; the new head rides through the backward scan's
        # carry, so that XLA cannot move the update after it.
        keys = jax.random.split(step_key, 2)
        head_params, head_state = update(g_head, opt_state.head, head_params, keys[0])
        sum_sq = _sum_squares(g_head)

        # The backward scan's carry holds the stacked parameters and state, updated in place,
        # and the slices of the layer it works on, read one iteration ahead (after the previous
        # layer's write). Reading a slice in the iteration that writes it lets XLA fuse the read
        # into the computations that end in the writes, and since the new weights need the old
        # moments and the new moments the old weights' gradient, those fusions then read each
        # other's buffers after the in-place writes: XLA copies every stacked buffer in every
        # iteration to keep the old values (seen on the CPU, where an optimization barrier is
        # expanded away before fusion). The CPU still copies the stacked FP8 moments, which it
        # computes in float16; on a GPU they are written in place (the compiled peak equals the
        # one with them carried as uint8 bytes: docs/memory_options.md).
        def layer_gradient(g_BTD, p_l, kept, i):
            weights, kept = jax.tree.leaves((p_l, element(codes, i))), iter(kept)
            leaves = [next(kept) if k is None else weights[k] for k in layout["weight"]]
            pullback = jax.tree.unflatten(layout["treedef"], leaves)
            return pullback(g_BTD)

        def backward(carry, xs):
            g_BTD, layers, states, p_l, s_l, head_params, sum_sq = carry
            kept, i = xs
            g_l, g_BTD = layer_gradient(g_BTD, p_l, kept, i)
            key = jax.random.fold_in(keys[1], i + 1)
            new_p, new_s = update({LAYER_KEY: g_l}, s_l, {LAYER_KEY: p_l}, key)
            layers = put_element(layers, new_p[LAYER_KEY], i)
            states = put_element(states, new_s, i)
            ahead = jnp.maximum(i - 1, 0)
            carry = (
                g_BTD,
                layers,
                states,
                element(layers, ahead),
                element(states, ahead),
                head_params,
            )
            return (*carry, sum_sq + _sum_squares(g_l)), None

        def backward_in_place(carry, xs):
            # coat_adamw's kernel steps layer i inside the stacks (apply_gradients_at): no
            # slice of the layer's state is read out and nothing is written back. Only the
            # layer's weights the pullback needs are read, one iteration ahead as above.
            g_BTD, layers, states, p_l, head_params, sum_sq = carry
            kept, i = xs
            g_l, g_BTD = layer_gradient(g_BTD, p_l, kept, i)
            new_p, states = apply_gradients_at(tx, {LAYER_KEY: g_l}, states, {LAYER_KEY: layers}, i)
            layers = new_p[LAYER_KEY]
            ahead = jnp.maximum(i - 1, 0)
            carry = (g_BTD, layers, states, element(layers, ahead), head_params)
            return (*carry, sum_sq + _sum_squares(g_l)), None

        last = num_layers - 1
        states = opt_state.layers
        xs = (residuals, jnp.arange(num_layers))
        if in_place:
            carry = (g_BTD, layers, states, element(layers, last), head_params, sum_sq)
            carry, _ = lax.scan(backward_in_place, carry, xs, reverse=True)
            g_BTD, layers, layer_states, _, head_params, sum_sq = carry
        else:
            carry = (g_BTD, layers, states, element(layers, last), element(states, last))
            carry, _ = lax.scan(backward, (*carry, head_params, sum_sq), xs, reverse=True)
            g_BTD, layers, layer_states, _, _, head_params, sum_sq = carry
        (g_lookup,) = embed_vjp(g_BTD)
        g_embed = jax.tree.map(jnp.add, g_embed, g_lookup)
        embed_params, embed_state = update(g_embed, opt_state.embed, embed_params, keys[1])
        grad_norm = jnp.sqrt(sum_sq + _sum_squares(g_embed))
        new_state = LayerwiseState(layer_states, head_state, embed_state, opt_state.count + 1)
        new_params = {**head_params, **embed_params, "layers": layers}
        metrics = {"loss": loss, "grad_norm": grad_norm, "loss_tokens": target_count(tokens_ABT1)}
        if activations is not None:
            scales = {"layers": layer_scales[0], "norm": norm_scales[0]}
            metrics.update(activations.metrics(scales, observe))
        return new_params, new_state, metrics

    return train_step

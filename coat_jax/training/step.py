"""One train step: the loss and gradient over microbatches, then the optimizer applied.

The step is a pure function ``(params, opt_state, tokens) -> (params, opt_state, metrics)``
(docs/design.md, 'One training step'). Gradient accumulation is an explicit ``lax.scan`` over
microbatches inside that one step (not ``optax.MultiSteps``): the optimizer sees one averaged
gradient per step, its state holds no accumulator, and the step counter counts optimizer steps.
How the optimizer is applied (:func:`apply_strategy`: stochastic rounding for bfloat16
parameters, the fused kernel, or ``tx.update`` then ``optax.apply_updates``) is shared with the
step that updates each layer inside the backward pass (:mod:`coat_jax.training.layerwise`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from coat_jax.master import apply_updates_stochastic, float32_optimizer
from coat_jax.optim import apply_gradients
from coat_jax.training.act_telemetry import ActivationTelemetry
from coat_jax.training.model import (
    ModelDef,
    next_token_loss,
    observed_next_token_loss,
    target_count,
)
from coat_jax.training.telemetry import StateTelemetry


class StochasticRoundingState(NamedTuple):
    """The optimizer state of a run with bfloat16 masters: the inner state and a step count.

    The count seeds each step's stochastic rounding (``fold_in(key(seed), count)``), so a resumed
    run draws the same bits as an uninterrupted one.
    """

    inner: Any
    count: jax.Array


def with_rounding_count(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` in float32 (``coat_jax.master.float32_optimizer``) plus a rounding-step count."""
    inner = float32_optimizer(tx)

    def init(params):
        return StochasticRoundingState(inner.init(params), jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        updates, inner_state = inner.update(updates, state.inner, params)
        return updates, StochasticRoundingState(inner_state, state.count + 1)

    return optax.GradientTransformation(init, update)


def apply_strategy(
    tx: optax.GradientTransformation,
    *,
    fused_apply: bool,
    low_precision: bool,
    telemetry: StateTelemetry | None = None,
):
    """How a step applies the optimizer: ``(grads, opt_state, params, key) -> (params,
    opt_state, metrics)``.

    - ``low_precision`` (bfloat16 parameters): ``tx.update`` on the float32 gradients (``tx``
      computes in float32: ``coat_jax.master.float32_optimizer``), the updates applied with
      stochastic rounding keyed by ``key``;
    - ``fused_apply``: ``coat_jax.optim.apply_gradients``, so a ``tx`` that can apply itself
      (``coat_adamw``: its kernel writes the new parameter) does;
    - otherwise ``tx.update``, then ``optax.apply_updates``.

    With ``telemetry`` the optimizer runs through it (``StateTelemetry.update`` /
    ``StateTelemetry.apply``) and its metrics are returned; else the metrics are empty.
    """

    def update(grads, opt_state, params):
        if telemetry is None:
            return (*tx.update(grads, opt_state, params), {})
        return telemetry.update(tx, grads, opt_state, params)

    def apply(grads, opt_state, params, key):
        if low_precision:
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
            updates, opt_state, observed = update(grads, opt_state, params)
            return apply_updates_stochastic(params, updates, key), opt_state, observed
        if fused_apply and telemetry is None:
            return (*apply_gradients(tx, grads, opt_state, params), {})
        if fused_apply:
            # The telemetry samples the old state first, then lets the kernel apply in place.
            return telemetry.apply(tx, grads, opt_state, params)
        updates, opt_state, observed = update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, observed

    return apply


def make_train_step(
    model_def: ModelDef,
    tx: optax.GradientTransformation,
    *,
    seed: int = 0,
    telemetry: StateTelemetry | None = None,
    activations: ActivationTelemetry | None = None,
    fused_apply: bool = True,
):
    """The pure train step over ``tokens_ABT1``: A microbatches of B windows of T + 1 tokens.

    With bfloat16 parameters (``master_dtype: bfloat16``) ``tx`` must come from
    :func:`with_rounding_count`: gradients are accumulated and clipped in float32 and each
    update is applied with stochastic rounding. With ``telemetry`` the metrics also hold the
    optimizer state's quantization telemetry, with ``activations`` the range of the scales the
    FP8 activation ops used (:mod:`coat_jax.training.telemetry`). The optimizer is applied as
    :func:`apply_strategy` says (``fused_apply``: through ``coat_jax.optim.apply_gradients``,
    with the telemetry too; bfloat16 parameters take ``tx.update`` and apply the updates
    apart).
    """
    grad_fn = jax.value_and_grad(lambda p, t: next_token_loss(model_def, p, t))
    low_precision = any(
        jnp.dtype(x.dtype) == jnp.bfloat16 for x in jax.tree.leaves(model_def.abstract_params)
    )
    as_f32 = lambda tree: jax.tree.map(lambda g: g.astype(jnp.float32), tree)
    observed_grad_fn = jax.value_and_grad(
        lambda p, t, observe: observed_next_token_loss(model_def, p, t, observe), has_aux=True
    )

    def loss_and_grads(params, tokens_BT1, observe):
        """``(loss, grads, scales)``: ``scales`` the activation scales, ``None`` without the
        activation telemetry (``observe`` None)."""
        if observe is None:
            return (*grad_fn(params, tokens_BT1), None)
        (loss, scales), grads = observed_grad_fn(params, tokens_BT1, observe)
        return loss, grads, scales

    apply = apply_strategy(
        tx, fused_apply=fused_apply, low_precision=low_precision, telemetry=telemetry
    )

    def train_step(params, opt_state, tokens_ABT1):
        num_micro = tokens_ABT1.shape[0]
        # Known before the forward pass: the layers reduce their scales only where it is true.
        observe = None if activations is None else activations.observe(opt_state)
        if num_micro == 1:
            loss, grads, scales = loss_and_grads(params, tokens_ABT1[0], observe)
        else:

            def accumulate(grad_sum, tokens_BT1):
                loss, grads, scales = loss_and_grads(params, tokens_BT1, observe)
                grads = as_f32(grads) if low_precision else grads
                return jax.tree.map(jnp.add, grad_sum, grads), (loss, scales)

            zeros = jax.tree.map(
                lambda p: jnp.zeros(p.shape, jnp.float32 if low_precision else p.dtype), params
            )
            grad_sum, (losses, scales) = jax.lax.scan(accumulate, zeros, tokens_ABT1)
            grads = jax.tree.map(lambda g: g / num_micro, grad_sum)
            loss = losses.mean()
        key = jax.random.fold_in(jax.random.key(seed), opt_state.count) if low_precision else None
        params, opt_state, observed = apply(grads, opt_state, params, key)
        grad_norm = optax.tree.norm(as_f32(grads) if low_precision else grads)
        if activations is not None:
            observed = {**observed, **activations.metrics(scales, observe)}
        metrics = {"loss": loss, "grad_norm": grad_norm, "loss_tokens": target_count(tokens_ABT1)}
        return params, opt_state, {**metrics, **observed}

    return train_step

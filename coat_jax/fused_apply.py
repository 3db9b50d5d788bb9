"""Fused applies: an optimizer whose kernel writes the new parameters itself.

An optax optimizer returns updates and ``optax.apply_updates`` adds them to the parameters: the
updates make one round trip through memory. :func:`coat_jax.coat_adamw` can instead update each
parameter in the pass that updates its FP8 moments. It says so by its type: it returns a
:class:`FusedGradientTransformation`, an ``optax.GradientTransformationExtraArgs`` (``init`` and
``update`` as in optax) with two more attributes, ``apply`` and ``apply_at``, which
:func:`apply_gradients` and :func:`apply_gradients_at` call.

Composing with optax: a fused transformation is an optax transformation, so ``optax.chain``,
``optax.MultiSteps``, ``optax.apply_if_finite`` and ``nnx.Optimizer`` take it as they take any
other; their result has no fused apply (optax's types carry no ``apply``), and
:func:`apply_gradients` then runs ``update`` followed by ``optax.apply_updates``, the same
numbers to float32 rounding. To keep the fused apply behind other transformations (a gradient
clip, say), chain them with :func:`chain` instead of ``optax.chain``: the same state, and a
:class:`FusedGradientTransformation` again. A transformation that only multiplies every
gradient by one scalar is a :class:`GradScaleTransformation` (:func:`clip_by_global_norm`);
:func:`chain` hands its scalar to the kernel, which multiplies each gradient as it reads it,
so the clip costs no pass over the gradients of its own (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from pallas_kernels import stacks


class FusedGradientTransformation(optax.GradientTransformationExtraArgs):
    """An optax transformation with a fused apply.

    A pair ``(init, update)`` as every optax transformation (so ``optax.chain`` and the other
    optax wrappers take it), carrying two more attributes:

    Attributes:
      apply: ``(grads, state, params, grad_scale=None) -> (new_params, new_state)``: ``update``
        followed by ``optax.apply_updates`` in one pass, the gradients first multiplied by the
        scalar ``grad_scale`` (``None``: 1). The new state is ``update``'s.
      apply_at: ``(grads, state, params, index) -> (new_params, new_state)``: ``apply`` on
        element ``index`` of stacked parameters and state, in place (see
        :func:`apply_gradients_at`); ``None`` where the transformation has no in-place form.
    """

    apply: Callable[..., tuple[Any, Any]]
    apply_at: Callable[..., tuple[Any, Any]] | None

    def __new__(cls, init, update, apply, apply_at=None):
        self = super().__new__(cls, init, update)
        self.apply = apply
        self.apply_at = apply_at
        return self


class GradScaleTransformation(optax.GradientTransformationExtraArgs):
    """An optax transformation whose ``update`` multiplies every gradient by one scalar.

    A pair ``(init, update)`` as every optax transformation, carrying one more attribute:

    Attributes:
      grad_scale: ``(grads, factor=None) -> scalar``: the scalar ``update`` multiplies
        ``grads`` by, times ``factor`` (``None``: 1), a factor that enclosing transformations
        have already applied to ``grads``.
    """

    grad_scale: Callable[..., jax.Array]

    def __new__(cls, init, update, grad_scale):
        self = super().__new__(cls, init, update)
        self.grad_scale = grad_scale
        return self


def apply_gradients(tx: optax.GradientTransformation, grads, state, params):
    """One optimizer step: ``(new_params, new_state)``.

    ``tx.update`` followed by ``optax.apply_updates``, except for a
    :class:`FusedGradientTransformation` (:func:`coat_adamw`, alone or as the last of
    :func:`chain`): then its kernel reads each parameter and writes the new one in the same pass
    that updates the FP8 moments, so the update never reaches memory (docs/benchmarks.md). The
    state is the same as ``tx.update``'s, so the two ways mix freely and share checkpoints. The
    results agree to float32 rounding: the fused way applies weight decay and the learning rate
    in float32 where optax first rounds an update without weight decay to the gradient's dtype.

    Examples:
      >>> import jax.numpy as jnp, optax, coat_jax
      >>> params = {"w": jnp.zeros((8, 128))}
      >>> tx = coat_jax.optim.chain(optax.clip_by_global_norm(1.0), coat_jax.coat_adamw(1e-3))
      >>> state = tx.init(params)
      >>> params, state = coat_jax.apply_gradients(tx, {"w": jnp.ones((8, 128))}, state, params)
    """
    if isinstance(tx, FusedGradientTransformation):
        return tx.apply(grads, state, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def apply_gradients_at(tx: optax.GradientTransformation, grads, state, params, index):
    """:func:`apply_gradients` on element ``index`` of stacked parameters and state.

    ``params`` and ``state`` are stacks: every leaf has a leading axis, as ``jax.vmap(tx.init)``
    of one element's parameters makes them (a scanned model's layers, updated one layer at a
    time inside the backward pass: ``optimizer_in_backward``); ``grads`` is one element's
    gradient. Returns the whole stacks, element ``index`` stepped, the others unchanged.
    :func:`coat_adamw`'s kernel reads and writes that element inside the stacks (its
    ``apply_at``), so a step that donates them copies no slice out and none back; any other
    ``tx`` is applied to the slices, which are then written back.

    Examples:
      >>> import jax, jax.numpy as jnp, coat_jax
      >>> tx = coat_jax.coat_adamw(1e-3)
      >>> stack = {"w": jnp.zeros((3, 8, 128))}
      >>> state = jax.vmap(tx.init)(stack)
      >>> grads = {"w": jnp.ones((8, 128))}
      >>> stack, state = coat_jax.optim.apply_gradients_at(tx, grads, state, stack, 1)
      >>> [round(float(stack["w"][i].sum()), 3) for i in range(3)]
      [0.0, -1.024, 0.0]
    """
    if fused_in_place(tx):
        return tx.apply_at(grads, state, params, index)
    return stacks.step_element(
        lambda ps: apply_gradients(tx, grads, ps[1], ps[0]), (params, state), index
    )


def fused_in_place(tx) -> bool:
    """Whether :func:`apply_gradients_at` steps ``tx``'s stacks in place (its ``apply_at``)."""
    return isinstance(tx, FusedGradientTransformation) and tx.apply_at is not None


def chain(*transforms: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``optax.chain`` that keeps the last transformation's fused apply.

    When the last of ``transforms`` is a :class:`FusedGradientTransformation`
    (:func:`coat_adamw`, or another chain ending in it), the result is one too:
    :func:`apply_gradients` runs the others' updates on the gradients (clipping, say) and then
    its fused apply. When every other transformation is a :class:`GradScaleTransformation`
    (:func:`clip_by_global_norm`), their scalar goes to the kernel instead, which multiplies each
    gradient as it reads it: no pass of its own over the gradients. The state is
    ``optax.chain``'s; otherwise the result is ``optax.chain``'s.
    """
    tx = optax.chain(*transforms)
    if not transforms or not isinstance(transforms[-1], FusedGradientTransformation):
        return tx
    last, others = transforms[-1], transforms[:-1]
    scaling = all(isinstance(t, GradScaleTransformation) for t in others)

    def apply_fn(grads, state, params, grad_scale=None):
        # ``grad_scale``: the factor of an enclosing chain's scaling transformations.
        if scaling:
            factor = grad_scale
            for t in others:
                factor = t.grad_scale(grads, factor)
            new_params, s = last.apply(grads, state[-1], params, grad_scale=factor)
            return new_params, (*state[:-1], s)
        if grad_scale is not None:
            grads = _scaled(grads, grad_scale)
        states = []
        for t, s in zip(others, state[:-1], strict=True):
            grads, s = t.update(grads, s, params)
            states.append(s)
        new_params, s = last.apply(grads, state[-1], params)
        return new_params, (*states, s)

    return FusedGradientTransformation(tx.init, tx.update, apply_fn)


def _scaled(grads, factor):
    return jax.tree.map(lambda g: (g * factor).astype(g.dtype), grads)


def clip_factor(norm, max_norm) -> jax.Array:
    """What :func:`clip_by_global_norm` multiplies every gradient by: 1 while the global
    ``norm`` is below ``max_norm``, else ``max_norm / norm`` (float32)."""
    norm = jnp.asarray(norm, jnp.float32)
    return jnp.where(norm < max_norm, jnp.float32(1.0), max_norm / norm).astype(jnp.float32)


def clip_by_global_norm(max_norm: float) -> GradScaleTransformation:
    """``optax.clip_by_global_norm`` (the same state and trigger) that :func:`chain` can fold
    into :func:`coat_adamw`'s fused apply as a gradient scale.

    Each gradient is multiplied by :func:`clip_factor` of the global norm, by its ``update`` and
    by the fused kernel alike, so the two ways clip identically (for float32 gradients bit for
    bit). optax divides by the norm and multiplies by ``max_norm``: the clipped gradients agree
    with optax's to float32 rounding.

    Examples:
      >>> import jax.numpy as jnp, coat_jax
      >>> tx = coat_jax.optim.chain(clip_by_global_norm(1.0), coat_jax.coat_adamw(1e-3))
      >>> params = {"w": jnp.zeros((8, 128))}
      >>> params, _ = coat_jax.apply_gradients(tx, {"w": jnp.ones((8, 128))}, tx.init(params), params)
    """

    def grad_scale(grads, factor=None):
        norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
        if factor is not None:
            norm = norm * jnp.abs(factor)
        scale = clip_factor(norm, max_norm)
        return scale if factor is None else scale * factor

    def update(updates, state, params=None, **extra_args):
        del params, extra_args
        return _scaled(updates, grad_scale(updates)), state

    return GradScaleTransformation(optax.clip_by_global_norm(max_norm).init, update, grad_scale)

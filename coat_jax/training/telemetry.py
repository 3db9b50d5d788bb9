"""Per-step telemetry of the optimizer state: how faithfully FP8 codes hold the moments.

With ``telemetry: true`` the train step adds scalars to its metrics, which reach
``metrics.jsonl`` (and TensorBoard) with the records of the steps they are computed at
(docs/telemetry.md): the steps the trainer logs on schedule, the first, every ``log_every``-th
and the last (:meth:`StateTelemetry.computes`). On the other steps a ``lax.cond`` skips them and
the metrics are placeholders, NaN or -1 with ``state/computed`` false, which
:func:`logged_metrics` drops from a record. For each moment of the optimizer state, named by
its state field ``F`` (``mu`` and ``nu`` for AdamW and COAT AdamW, ``mu`` for Lion and Muon,
``trace`` for SGD):

==========================  ======================================================================
``state/F_rel_err``         mean of ``|dequantized - m| / |m|`` over the non-zero values of a
                            sample of groups, pooled over tensors, where ``m`` is the float32
                            moment this step quantized into those codes
``state/F_rel_err_max``     the largest such mean of one tensor
``state/F_worst_tensor``    that tensor's index in ``jax.tree.leaves(params)``
                            (:func:`tensor_names` gives the names)
``state/F_flushed``         share of the sampled non-zero moments stored as 0
``state/F_saturated``       codes equal to the format's maximum in magnitude, whole tensors
``state/F_nonfinite``       NaN or infinite codes, plus groups with a NaN or infinite statistic
``state/F_k_floor``         groups whose DRE exponent sits at its lower clip ``1 / expand_min``
``state/F_k_cap``           groups whose DRE exponent sits at its upper clip ``quant.MAX_EXPAND``
``state/F_groups``          quantization groups in all (a constant: the scale of the counts)
``state/computed``          whether this step computed the others (:data:`COMPUTED`)
==========================  ======================================================================

The error is per value, not norm-wise: Adam's update ``m / sqrt(v)`` is per element, so a small
moment matters as much as a large one, and a norm-wise error only sees the largest values.
Per-group scaling maps the largest magnitude of every non-zero group onto the format's maximum,
so ``saturated`` is about one per non-zero group by design; more means ties at the maximum.
``k_cap`` counts groups with (nearly) one magnitude, all-zero groups included (an embedding row
of a token never seen); ``k_floor`` counts groups whose range exceeds what even ``k = 1/16``
maps into FP8, the case where DRE loses small values.

The float32 moment is not kept by the optimizer, so the telemetry replays this step's moment
update on the sample: for ``coat_adamw``, ``m = b1 m_old + (1 - b1) g`` and
``v = b2 v_old + (1 - b2) g^2`` from the dequantized old state and the (clipped) gradient, the
reference arithmetic of :func:`pallas_kernels.coat_adam.adam_moments_and_update`; for an optax
optimizer (with ``fp8_state`` or without), the optimizer's own ``update`` on the sampled
parameters, gradients and dequantized state. Moments kept in float32 (masked-out parameters,
an optimizer without FP8 state) have no quantization error and are left out: a field without
FP8 moments reports an error of 0 and worst tensor -1. The replay needs an element-wise moment
update: every optimizer of the trainer but ``adafactor`` (whose factored statistics are not per
element), for which only the counts are given.

The sample (:class:`SamplePlan`): ``rows`` rows of every tensor, spread evenly over its leading
axes (a scanned layer stack keeps every layer: ``rows`` rows per layer), and ``groups`` groups of
each, spread evenly along the last axis: 16 x 8 groups of 128 values by default, 16384 values
per tensor and layer. The slices are taken one axis at a time, leading axes first, so that on a
sharded mesh XLA moves only the sampled values between devices. The sampled groups of all the
tensors of one field are concatenated, so that dequantization, replay (COAT's) and error are one
computation per field, not per tensor. Pooled sums weigh each tensor by its values per sampled
value, so they estimate the error over whole tensors. The counts read
the whole new state: one byte per value of each moment and one pass over the statistics, two
variadic reductions per tensor.

For a model with FP8 activations, :class:`ActivationTelemetry` adds the ``act/`` metrics: the
range of the scales the FP8 activation ops quantize with (per-tensor scales of the linears'
inputs, 1x16 scales of what the non-linear ops keep), taken from the ops themselves
(``coat_jax.fp8_ops.observed_*``, ``Llama.observed_hidden_states``), with the layer and the
tensor of the largest and a count of non-finite scales; on the same steps, with its own flag
:data:`ACT_COMPUTED`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from coat_jax import quant
from coat_jax.fp8_ops import placeholder
from coat_jax.fp8_wrapper import _field_name, _owner, find_fp8_states
from coat_jax.optim import (
    DEFAULT_GROUP_SIZE,
    _moment_of,
    _moments_of,
    apply_gradients,
    clip_factor,
    find_coat_states,
)
from coat_jax.training.config import TrainConfig
from coat_jax.training.optimizers import make_optimizer
from coat_jax.training.sharding import _is_stacked_layer
from pallas_kernels.coat_adam import adam_moments_and_update

DEFAULT_ROWS = 16
DEFAULT_GROUPS = 8
# The metric that says whether a step computed the telemetry (the other ``state/`` metrics of a
# step that did not are placeholders; :func:`logged_metrics` drops them).
COMPUTED = "state/computed"
# The metric that says whether a step computed the activation telemetry (its other ``act/``
# metrics are placeholders where not).
ACT_COMPUTED = "act/computed"
# Optimizers whose state update is not element-wise, so a sample cannot replay it.
NOT_REPLAYABLE = frozenset({"adafactor"})


@dataclasses.dataclass(frozen=True)
class SamplePlan:
    """Which values of one tensor the relative error looks at (static: it only knows shapes).

    Attributes:
      row_slices: ``(axis, stride, count)`` per leading axis that is sampled: indices
        ``0, stride, ..., (count - 1) * stride``.
      group_stride, group_count: groups ``0, group_stride, ...`` along the last axis.
      group_size: values per group.
      weight: the tensor's values per sampled value, so that weighted sums over the sample
        estimate sums over whole tensors (a pooled error is not biased towards the tensors a
        sample covers more densely).
    """

    row_slices: tuple[tuple[int, int, int], ...]
    group_stride: int
    group_count: int
    group_size: int
    weight: float

    @classmethod
    def for_shape(cls, shape, *, stacked: bool, rows: int, groups: int, group_size: int):
        """The plan of a tensor of ``shape`` (``None`` for scalars and empty arrays)."""
        if not shape or math.prod(shape) == 0:
            return None
        row_slices, budget = [], rows
        for axis in range(1 if stacked and len(shape) > 1 else 0, len(shape) - 1):
            count = min(shape[axis], max(1, budget))
            budget //= count
            if count < shape[axis]:
                row_slices.append((axis, shape[axis] // count, count))
        n = shape[-1]
        n_groups = quant.num_groups(n, group_size)
        count = min(n_groups, groups)
        stride = n_groups // count
        per_row = sum(min(group_size, n - g * stride * group_size) for g in range(count))
        sampled = per_row * math.prod(shape[:-1]) // math.prod(shape[a] for a, _, _ in row_slices)
        sampled *= math.prod(c for _, _, c in row_slices)
        return cls(tuple(row_slices), stride, count, group_size, math.prod(shape) / sampled)

    def values(self, x: jax.Array) -> jax.Array:
        """The sampled values of a parameter-shaped ``x``: ``[..., group_count * group_size]``
        (a short last group zero-padded)."""
        x_g = quant.to_groups(self._rows(x), self.group_size)
        x_g = self._groups(x_g, axis=x_g.ndim - 2)
        return x_g.reshape(*x_g.shape[:-2], self.group_count * self.group_size)

    def stats(self, s: jax.Array) -> jax.Array:
        """The sampled groups' statistics, from statistics of shape ``shape[:-1] + (groups,)``."""
        return self._groups(self._rows(s), axis=s.ndim - 1)

    def _rows(self, x):
        # One axis at a time: one multi-axis slice of a tensor sharded along its last axis makes
        # XLA move whole shards before slicing.
        for axis, stride, count in self.row_slices:
            x = lax.slice_in_dim(x, 0, (count - 1) * stride + 1, stride, axis)
        return x

    def _groups(self, x, axis):
        end = (self.group_count - 1) * self.group_stride + 1
        return lax.slice_in_dim(x, 0, end, self.group_stride, axis)


class _Stored(NamedTuple):
    """One parameter-shaped moment leaf as stored: FP8 codes and statistics, or float32."""

    field: str
    param: int
    moment: quant.QuantizedTensor | jax.Array  # an array: the float32 moment itself


def _sample(plan: SamplePlan | None, x):
    return x if plan is None else plan.values(x)


def _sampled_value(stored: _Stored, plan: SamplePlan | None) -> jax.Array:
    """The sampled values ``stored`` stands for, dequantized, float32, shaped as
    :meth:`SamplePlan.values` gives them."""
    m = stored.moment
    if not isinstance(m, quant.QuantizedTensor):
        return _sample(plan, m).astype(jnp.float32)
    sampled = m.replace(
        codes=plan.values(m.codes),
        scale=plan.stats(m.scale),
        expand=None if m.expand is None else plan.stats(m.expand),
        center=None if m.center is None else plan.stats(m.center),
    )
    return sampled.dequantize()


def _rows(x, group_size: int) -> jax.Array:
    """A sample as rows of one group each: ``[groups, group_size]``."""
    return x.reshape(-1, group_size)


def _sampled_rows(stored: list[_Stored], plans, group_size: int) -> tuple[jax.Array, list[int]]:
    """The sampled groups of several FP8 leaves of one field, concatenated and dequantized at
    once (one set of fusions however many tensors): ``[groups, group_size]`` float32, and the
    number of groups each leaf contributes."""
    moments = [s.moment for s in stored]
    if len({m.expand is None for m in moments}) != 1:
        raise ValueError("telemetry: one state field mixes DRE and absmax leaves")
    leaf_plans = [plans[s.param] for s in stored]
    codes = [
        _rows(p.values(m.codes.astype(jnp.float32)), group_size)
        for p, m in zip(leaf_plans, moments, strict=True)
    ]

    def stat(name):
        if getattr(moments[0], name) is None:
            return None
        parts = [p.stats(getattr(m, name)) for p, m in zip(leaf_plans, moments, strict=True)]
        return jnp.concatenate([x.reshape(-1, 1) for x in parts])

    moment = moments[0].replace(
        codes=jnp.concatenate(codes),
        scale=stat("scale"),
        expand=stat("expand"),
        center=stat("center"),
    )
    return moment.dequantize(), [c.shape[0] for c in codes]


def _coat_stored(state, params, group_size: int) -> list[_Stored]:
    treedef = jax.tree.structure(params)
    return [
        _Stored(prefix, i, m)
        for prefix in ("mu", "nu")
        for i, m in enumerate(_moments_of(state, treedef, prefix, group_size))
    ]


def _unmasked(x):
    return None if isinstance(x, optax.MaskedNode) else x


def _optax_stored(
    inner_state, scale, expand, center, params, *, group_size: int
) -> list[tuple[int, _Stored]]:
    """``(leaf position in inner_state, stored moment)`` for each parameter-shaped float leaf.

    ``scale``/``expand``/``center`` are an FP8State's statistics trees, or None (float32 state).
    A leaf belongs to the parameter whose key path ends its own (fp8_state's rule).
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(inner_state)
    stats = [
        [None] * len(flat) if tree is None else treedef.flatten_up_to(tree)
        for tree in (scale, expand, center)
    ]
    param_flat = jax.tree_util.tree_flatten_with_path(params)[0]
    # fp8_state's owner lookup, here mapping each parameter's path to its index.
    by_path = {tuple(path): (i, True) for i, (path, _) in enumerate(param_flat)}
    longest = max((len(k) for k in by_path), default=0)
    found = []
    for pos, (path, leaf) in enumerate(flat):
        index, _, n = _owner(path, by_path, longest)
        if index is None:
            continue
        p = param_flat[index][1]
        s, e, c = (_unmasked(st[pos]) for st in stats)
        floating = hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)
        if s is None and not (floating and leaf.shape == p.shape and leaf.ndim and leaf.size):
            continue
        field = _field_name(path[: len(path) - n]) or "state"
        moment = leaf if s is None else _moment_of(leaf, s, e, c, group_size)
        found.append((pos, _Stored(field, index, moment)))
    return found


def _find_inner(opt_state, structure) -> tuple[int, Any]:
    """The one subtree of ``opt_state`` with ``structure``: its position and value."""
    is_match = lambda x: jax.tree.structure(x) == structure
    flat = jax.tree.leaves(opt_state, is_leaf=is_match)
    matches = [i for i, x in enumerate(flat) if is_match(x)]
    if len(matches) != 1:
        raise ValueError(
            f"telemetry found {len(matches)} copies of the inner optimizer's state in the "
            "optimizer state, expected one; pass the optimizer that tx wraps as inner="
        )
    return matches[0], flat[matches[0]]


def _nth_inner(opt_state, structure, position):
    is_match = lambda x: jax.tree.structure(x) == structure
    return jax.tree.leaves(opt_state, is_leaf=is_match)[position]


@dataclasses.dataclass(frozen=True)
class StateTelemetry:
    """What the telemetry needs to replay the optimizer's moment update on a sample.

    Attributes:
      b1, b2: ``coat_adamw``'s decays (used when the state is COAT's).
      grad_clip: the global-norm clipping ``tx`` applies before the optimizer (None: none).
      inner: for an optax optimizer (under ``fp8_state`` or not): the optimizer without the
        clipping, whose ``update`` is replayed; ``None`` with COAT state.
      replay: False for optimizers whose moment update is not element-wise (only the counts).
      group_size, expand_min: the optimizer's quantization settings.
      rows, groups: the sample's size per tensor (:class:`SamplePlan`).
      every, last_step, max_skipped: on which steps the telemetry is computed
        (:meth:`computes`); on the others the step's metrics hold placeholders
        (:data:`COMPUTED` false). ``every=1``: every step.
    """

    b1: float = 0.9
    b2: float = 0.999
    grad_clip: float | None = None
    inner: optax.GradientTransformation | None = None
    replay: bool = True
    group_size: int = DEFAULT_GROUP_SIZE
    expand_min: float = 16
    rows: int = DEFAULT_ROWS
    groups: int = DEFAULT_GROUPS
    every: int = 1
    last_step: int | None = None
    max_skipped: int = 0

    def __post_init__(self):
        quant.check_group_size(self.group_size)
        for name, least in (("rows", 1), ("groups", 1), ("every", 1), ("max_skipped", 0)):
            _check_int(name, getattr(self, name), least)
        if self.last_step is not None:
            _check_int("last_step", self.last_step, 1)

    def computes(self, step):
        """Whether the telemetry is computed at ``step``: the optimizer state's step count before
        this step's update plus one (1-based, the trainer's step number when no step was
        skipped).

        The steps the trainer logs on schedule: the first, every multiple of ``every`` and
        ``last_step``. A step skipped for a non-finite gradient (``skip_nonfinite_steps``)
        leaves the count where it was, so after ``n`` skips the trainer's step is ``step + n``:
        with up to ``max_skipped`` skips, the telemetry is computed wherever ``step + n`` is
        logged for some ``n`` in ``[0, max_skipped]``.

        Works on Python and NumPy ints and on traced ones.

        Example:
          >>> t = StateTelemetry(every=10, last_step=25)
          >>> [s for s in range(1, 26) if t.computes(s)]
          [1, 10, 20, 25]
          >>> [s for s in range(1, 26) if StateTelemetry(every=10, max_skipped=1).computes(s)]
          [1, 9, 10, 19, 20]
        """
        return _logged(step, self.every, self.last_step, self.max_skipped)

    def update(self, tx: optax.GradientTransformation, grads, opt_state, params):
        """``tx.update(grads, opt_state, params)`` plus the telemetry's metrics.

        With ``every > 1`` the telemetry is two ``lax.cond`` on :meth:`computes` of the state's
        step count (the sample of the old state before the update, the counts and errors
        after it): on a step it does not compute, the metrics are placeholders (NaN for the
        float metrics, -1 for the integer ones, :data:`COMPUTED` false) and nothing of the
        state or the gradient is read. The updates and the new state are ``tx``'s either way.

        Returns:
          ``(updates, new_opt_state, metrics)``, ``metrics`` a dict of scalars.
        """
        return self._run(tx.update, grads, opt_state, params)

    def apply(self, tx: optax.GradientTransformation, grads, opt_state, params):
        """``coat_jax.optim.apply_gradients(tx, grads, opt_state, params)`` plus the telemetry's
        metrics: as :meth:`update`, but ``coat_adamw``'s fused kernel writes the new parameters
        (and any other ``tx`` applies its updates), so the trainer keeps its fused step with the
        telemetry on. The replay reads only what it sampled before the kernel overwrites the
        old state and parameters in place (and the state's scalar step count).

        Returns:
          ``(new_params, new_opt_state, metrics)``.
        """
        return self._run(lambda g, s, p: apply_gradients(tx, g, s, p), grads, opt_state, params)

    def _run(self, step, grads, opt_state, params):
        if self.every == 1:
            computed = jnp.asarray(True)
            when = lambda compute: compute()
        else:
            computed = jnp.asarray(self.computes(_step_count(opt_state) + 1))
            when = lambda compute: lax.cond(computed, compute, placeholder(compute))
        out, new_state, metrics = self._update(step, grads, opt_state, params, when)
        return out, new_state, {**metrics, COMPUTED: computed}

    def _update(self, step, grads, opt_state, params, when):
        """:meth:`update` / :meth:`apply` with ``step(grads, opt_state, params)`` the
        optimizer's (``tx.update`` or the fused apply) and ``when(compute)`` the value of
        ``compute()`` if the telemetry is computed at this step (and a placeholder of the same
        structure if not)."""
        gs = self.group_size
        params32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        grads32 = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        plans = [
            SamplePlan.for_shape(
                p.shape,
                stacked=_is_stacked_layer(path),
                rows=self.rows,
                groups=self.groups,
                group_size=gs,
            )
            for path, p in jax.tree_util.tree_flatten_with_path(params)[0]
        ]
        kind, read = self._reader(opt_state, params)
        old = read(opt_state)
        fields = _fp8_fields(old)
        sample = {}
        if self.replay and any(fields.values()):
            sample = when(lambda: self._sample(kind, old, fields, plans, grads32, params32))
        if sample:
            # The old state and the gradient are sampled before the update: the optimizer
            # overwrites the state in place (donated buffers, the Pallas kernel's aliasing),
            # and the barrier orders these reads before it, so no copy of the state is needed.
            grads, sample = lax.optimization_barrier((grads, sample))
        out, new_state = step(grads, opt_state, params)
        new = read(new_state)

        def measure():
            metrics = _count_metrics(new, self.expand_min)
            if self.replay:
                stored = {
                    f: _sampled_rows([new[i] for i in members], plans, gs)
                    for f, members in fields.items()
                    if members
                }
                exact = self._replay(kind, opt_state, params, old, fields, sample) if stored else {}
                metrics.update(_error_metrics(new, fields, exact, stored, plans))
            return dict(sorted(metrics.items()))

        return out, new_state, when(measure)

    def _sample(self, kind, old, fields, plans, grads32, params32) -> dict:
        """What the replay needs of the old state and the (clipped) gradient, sampled."""
        gs = self.group_size
        grads = [_sample(p, g) for p, g in zip(plans, jax.tree.leaves(grads32), strict=True)]
        if self.grad_clip is not None:
            # The trainer's clip (coat_jax.optim.clip_by_global_norm), on the sample.
            factor = clip_factor(optax.tree.norm(grads32), self.grad_clip)
            grads = [g * factor for g in grads]
        if kind == "coat":
            # COAT's replay is element-wise: every tensor's groups at once.
            return {
                "old": {
                    f: _sampled_rows([old[i] for i in members], plans, gs)[0]
                    for f, members in fields.items()
                    if members
                },
                "grads": {
                    f: jnp.concatenate([_rows(grads[old[i].param], gs) for i in members])
                    for f, members in fields.items()
                    if members
                },
            }
        # An optax optimizer's update takes its state tree: samples shaped like the tensors.
        return {
            "old": [_sampled_value(s, plans[s.param]) for s in old],
            "grads": grads,
            "params": [
                _sample(p, x) for p, x in zip(plans, jax.tree.leaves(params32), strict=True)
            ],
        }

    def _reader(self, opt_state, params):
        """``(kind, read)``: ``read(state)`` lists the stored moments of a state like ``opt_state``."""
        if find_coat_states(opt_state):
            return "coat", lambda state: _coat_stored(
                _one(find_coat_states(state), "COAT"), params, self.group_size
            )
        if find_fp8_states(opt_state):

            def read_fp8(state):
                _, s = _one(find_fp8_states(state), "fp8_state")
                stored = _optax_stored(
                    s.inner_state, s.scale, s.expand, s.center, params, group_size=self.group_size
                )
                return [leaf for _, leaf in stored]

            return "fp8_state", read_fp8
        if self.inner is None:
            raise ValueError(
                "telemetry found neither COAT (coat_adamw) nor fp8_state optimizer state; for "
                "an optax optimizer with float32 state pass it as StateTelemetry(inner=...)"
            )
        structure = jax.tree.structure(jax.eval_shape(self.inner.init, params))
        position, _ = _find_inner(opt_state, structure)

        def read_plain(state):
            inner_state = _nth_inner(state, structure, position)
            stored = _optax_stored(
                inner_state, None, None, None, params, group_size=self.group_size
            )
            return [leaf for _, leaf in stored]

        return "optax", read_plain

    def _replay(self, kind, opt_state, params, old, fields, sample) -> dict[str, jax.Array]:
        """Per field, the float32 moments this step quantized into the sampled groups, as the
        rows :func:`_sampled_rows` gives."""
        gs = self.group_size
        if kind == "coat":
            if [old[i].param for i in fields["mu"]] != [old[i].param for i in fields["nu"]]:
                raise ValueError("telemetry: COAT state with FP8 mu and nu on different tensors")
            count = optax.safe_increment(_one(find_coat_states(opt_state), "COAT").count)
            m, v, _ = adam_moments_and_update(
                sample["grads"]["mu"],
                sample["old"]["mu"],
                sample["old"]["nu"],
                count=count,
                b1=self.b1,
                b2=self.b2,
                eps=0.0,
            )
            return {"mu": m, "nu": v}
        if self.inner is None:
            raise ValueError(
                "telemetry of fp8_state needs the wrapped optimizer to replay its update: "
                "StateTelemetry(inner=...), or replay=False for the counts only"
            )
        if kind == "fp8_state":
            ((_, s),) = find_fp8_states(opt_state)
            inner_state = s.inner_state
            positions = [pos for pos, _ in _optax_stored(*s, params, group_size=gs)]
        else:
            structure = jax.tree.structure(jax.eval_shape(self.inner.init, params))
            _, inner_state = _find_inner(opt_state, structure)
            stored = _optax_stored(inner_state, None, None, None, params, group_size=gs)
            positions = [pos for pos, _ in stored]
        leaves, treedef = jax.tree.flatten(inner_state)
        for pos, value in zip(positions, sample["old"], strict=True):
            leaves[pos] = value
        treedef_p = jax.tree.structure(params)
        _, replayed = self.inner.update(
            treedef_p.unflatten(sample["grads"]),
            treedef.unflatten(leaves),
            treedef_p.unflatten(sample["params"]),
        )
        new_leaves = jax.tree.leaves(replayed)
        if len(new_leaves) != len(leaves):
            raise ValueError(
                "the optimizer's update changed its state's structure on the telemetry sample; "
                "its state update is not element-wise: set replay=False"
            )
        return {
            f: jnp.concatenate(
                [_rows(new_leaves[positions[i]].astype(jnp.float32), gs) for i in members]
            )
            for f, members in fields.items()
            if members
        }


def _check_int(name: str, value, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        what = "a positive int" if least == 1 else f"an int >= {least}"
        raise ValueError(f"telemetry {name} must be {what}, got {value!r}")


def _logged(step, every: int, last_step: int | None, max_skipped: int):
    """:meth:`StateTelemetry.computes` (and :meth:`ActivationTelemetry.computes`)."""
    if every == 1:
        return jnp.ones_like(step, bool)
    # Steps to the next multiple of `every` (0 at one); % takes the divisor's sign.
    due = ((-step) % every <= max_skipped) | (step == 1)
    if last_step is not None:
        due = due | ((step <= last_step) & (last_step - step <= max_skipped))
    return due


def _step_count(opt_state) -> jax.Array:
    """The optimizer state's step count: the largest ``count`` field (optax's and COAT's
    states, the schedule's, a bfloat16 master's rounding count, which also counts skipped
    steps). They agree but for that one."""
    counts = [
        leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]
        if path
        and isinstance(path[-1], jax.tree_util.GetAttrKey)
        and path[-1].name == "count"
        and jnp.ndim(leaf) == 0
        and jnp.issubdtype(leaf.dtype, jnp.integer)
    ]
    if not counts:
        raise ValueError(
            "telemetry every > 1 reads the step from the optimizer state's count, and this "
            "state has none; use every=1 (the telemetry at every step)"
        )
    return functools.reduce(jnp.maximum, [c.astype(jnp.int32) for c in counts])


def logged_metrics(metrics: dict) -> dict:
    """A train step's ``metrics`` as a record may log them: without :data:`COMPUTED` and
    :data:`ACT_COMPUTED`, and without the telemetry's ``state/`` (``act/``) keys where that
    step did not compute them (its placeholders). Other keys and other steps' metrics are
    returned as they are.

    Example:
      >>> logged_metrics({"loss": 2.5, "state/mu_rel_err": float("nan"), COMPUTED: False})
      {'loss': 2.5}
    """
    dropped = set()
    for flag in (COMPUTED, ACT_COMPUTED):
        if flag in metrics:
            prefix = flag.partition("/")[0] + "/"
            dropped |= {flag} | (
                set() if metrics[flag] else {k for k in metrics if k.startswith(prefix)}
            )
    return {k: v for k, v in metrics.items() if k not in dropped} if dropped else metrics


def _one(found: list, what: str):
    if len(found) != 1:
        raise ValueError(f"telemetry expects one {what} optimizer state, found {len(found)}")
    return found[0]


def _by_field(stored: list[_Stored]) -> dict[str, list[int]]:
    fields: dict[str, list[int]] = {}
    for i, s in enumerate(stored):
        fields.setdefault(s.field, []).append(i)
    return fields


def _fp8_fields(stored: list[_Stored]) -> dict[str, list[int]]:
    """Per field, its FP8 leaves (positions in ``stored``); a field may have none."""
    return {
        f: [i for i in members if isinstance(stored[i].moment, quant.QuantizedTensor)]
        for f, members in _by_field(stored).items()
    }


def _sums(values, dtype, axes=None) -> jax.Array:
    """``[sum(v, axes) for v in values]`` (same-shape arrays) as one variadic reduction: XLA
    reads the inputs they are computed from once, and materializes nothing of their size."""
    values = [v.astype(dtype) for v in values]
    axes = tuple(range(values[0].ndim)) if axes is None else axes
    zeros = [jnp.zeros([], dtype)] * len(values)
    add = lambda xs, ys: [x + y for x, y in zip(xs, ys, strict=True)]
    return jnp.stack(lax.reduce(values, zeros, add, axes))


def _count_metrics(stored: list[_Stored], expand_min) -> dict[str, jax.Array]:
    """Saturated and non-finite values, clipped DRE exponents, groups: whole tensors.

    Two reductions per tensor, one over its codes and one over its statistics, so that a model
    of hundreds of tensors adds few fusions to the step.
    """
    floor = 1.0 / jnp.asarray(expand_min, jnp.float32)
    metrics = {}
    for field, members in _by_field(stored).items():
        quantized = [
            stored[i].moment for i in members if isinstance(stored[i].moment, quant.QuantizedTensor)
        ]
        values = sum(m.codes.size for m in quantized)
        # int32 is exact below 2**31; a sum that could pass it is counted in float32.
        dtype = jnp.int32 if values < 2**31 else jnp.float32
        # saturated, non-finite, k at the floor, k at the cap
        total = jnp.zeros([4], dtype)
        for m in quantized:
            q = m.codes.astype(jnp.float32)
            fmax = quant.FP8_MAX[quant.format_of(m.codes.dtype)]
            codes = _sums([jnp.abs(q) == fmax, ~jnp.isfinite(q)], dtype)
            stats = [x for x in (m.scale, m.expand, m.center) if x is not None]
            bad = ~jnp.isfinite(stats[0])
            for x in stats[1:]:
                bad |= ~jnp.isfinite(x)
            conditions = [bad]
            if m.expand is not None:
                conditions += [m.expand == floor, m.expand == quant.MAX_EXPAND]
            groups = jnp.pad(_sums(conditions, dtype), (0, 3 - len(conditions)))
            total += jnp.stack([codes[0], codes[1] + groups[0], groups[1], groups[2]])
        metrics.update(
            {
                f"state/{field}_saturated": total[0],
                f"state/{field}_nonfinite": total[1],
                f"state/{field}_k_floor": total[2],
                f"state/{field}_k_cap": total[3],
                f"state/{field}_groups": jnp.asarray(
                    sum(m.scale.size for m in quantized), jnp.int32
                ),
            }
        )
    return metrics


def _mean(total, count):
    return total / jnp.where(count == 0, 1.0, count)


def _error_metrics(stored: list[_Stored], fields, exact, sampled, plans) -> dict[str, jax.Array]:
    """Relative errors of the sampled FP8 moments (``sampled``: per field, rows and groups per
    leaf) against the replayed float32 ones (``exact``); a field without FP8 moments has error
    0 and worst tensor -1.

    Per value ``|stored - exact| / |exact|`` over the non-zero exact values, averaged: Adam's
    update is per element, so a small moment matters as much as a large one (a norm-wise error
    would only see the largest). Pooled sums weigh each tensor by its plan's ``weight``, an
    estimate over whole tensors that is not biased towards densely sampled ones.
    """
    metrics = {}
    for field, members in fields.items():
        if not members:
            zero = jnp.zeros([], jnp.float32)
            metrics.update(
                {
                    f"state/{field}_rel_err": zero,
                    f"state/{field}_rel_err_max": zero,
                    f"state/{field}_flushed": zero,
                    f"state/{field}_worst_tensor": jnp.asarray(-1, jnp.int32),
                }
            )
            continue
        (y, sizes), x = sampled[field], exact[field]
        nonzero = x != 0
        rel = jnp.where(nonzero, jnp.abs(y - x) / jnp.abs(jnp.where(nonzero, x, 1.0)), 0.0)
        per_group = _sums([rel, nonzero, nonzero & (y == 0)], jnp.float32, axes=(1,))
        leaf_of_group = np.repeat(np.arange(len(members)), sizes)
        sums, counts, flushed = jax.ops.segment_sum(
            per_group.T, leaf_of_group, num_segments=len(members), indices_are_sorted=True
        ).T
        per_tensor = _mean(sums, counts)
        w = jnp.asarray([plans[stored[i].param].weight for i in members], jnp.float32)
        # A NaN makes its tensor the worst one: argmax takes NaN for the maximum.
        worst = jnp.argmax(per_tensor)
        params = jnp.asarray([stored[i].param for i in members], jnp.int32)
        metrics.update(
            {
                f"state/{field}_rel_err": _mean(jnp.sum(w * sums), jnp.sum(w * counts)),
                f"state/{field}_rel_err_max": per_tensor[worst],
                f"state/{field}_flushed": _mean(jnp.sum(w * flushed), jnp.sum(w * counts)),
                f"state/{field}_worst_tensor": params[worst],
            }
        )
    return metrics


def tensor_names(params) -> list[str]:
    """The names ``state/*_worst_tensor`` indexes: each parameter's key path, in leaf order.

    Example:
      >>> tensor_names({"embed": jnp.zeros(4), "layers": [{"w": jnp.zeros(2)}]})
      ["['embed']", "['layers'][0]['w']"]
    """
    return [
        jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    ]


def state_telemetry(cfg: TrainConfig, schedule) -> StateTelemetry | None:
    """The telemetry of ``cfg``'s optimizer (``None`` when ``cfg.telemetry`` is off)."""
    if not cfg.telemetry:
        return None
    # Computed on the steps the trainer logs on schedule (StateTelemetry.computes).
    when = dict(every=cfg.log_every, last_step=cfg.steps, max_skipped=cfg.skip_nonfinite_steps)
    if cfg.optimizer == "coat_adamw":
        return StateTelemetry(b1=cfg.b1, b2=cfg.b2, grad_clip=cfg.grad_clip, **when)
    inner = make_optimizer(dataclasses.replace(cfg, fp8_state=False, grad_clip=None), schedule)
    return StateTelemetry(
        grad_clip=cfg.grad_clip, inner=inner, replay=cfg.optimizer not in NOT_REPLAYABLE, **when
    )


# ----------------------------------------------------------------------------- activations


@dataclasses.dataclass(frozen=True)
class ActivationTelemetry:
    """The range of the scales the FP8 activation ops quantize with, as step metrics.

    The model's FP8 ops return the scales they quantize with beside their outputs
    (``coat_jax.fp8_ops.observed_*``, through ``Llama.observed_hidden_states``): the per-tensor
    scale of every FP8 linear's input, and the 1xG scales of every tensor the non-linear ops
    keep for backward, reduced inside each layer to a largest scale, a smallest scale of a
    group holding a non-zero value and a count of non-finite scales per tensor
    (``fp8_ops.ScaleRecorder``). :meth:`metrics` reduces those over layers (and microbatches):

    ==========================  ==================================================================
    ``act/linear_scale_min``    smallest per-tensor scale of a linear's input, all layers
    ``act/linear_scale_max``    largest one
    ``act/linear_worst_layer``  the layer of the largest one
    ``act/linear_worst_input``  which input of that layer (``Llama.activation_names()["linear"]``)
    ``act/group_scale_min``     smallest 1xG scale of a group with a non-zero value (``inf``: none)
    ``act/group_scale_max``     largest 1xG scale
    ``act/group_worst_layer``   the layer of the largest (the layer count: the final norm)
    ``act/group_worst_tensor``  which tensor (``activation_names()["group"] + ("norm",)``)
    ``act/nonfinite``           NaN or infinite scales, linear and 1xG
    ``act/computed``            whether this step computed the 1xG metrics (:data:`ACT_COMPUTED`)
    ==========================  ==================================================================

    The ``act/group_*`` keys exist where the model has 1xG-scaled activations (precision
    ``coat``, or ``fp8`` with ``fp8_attention``); a ``bf16`` model has no FP8 activations and
    no ``act/`` keys (the trainer builds no activation telemetry for it). A scale is
    ``(max|x| + 1e-20) / 448`` (E4M3), so a largest scale of ``s`` means activations of
    ``448 s``; a NaN makes its layer the worst one (``argmax`` takes NaN for the maximum).

    Attributes:
      every, last_step, max_skipped: on which steps the per-group reductions are computed, as
        :meth:`StateTelemetry.computes`; on the others the ``act/`` metrics are placeholders
        and :data:`ACT_COMPUTED` is false.
    """

    every: int = 1
    last_step: int | None = None
    max_skipped: int = 0

    def __post_init__(self):
        _check_int("every", self.every, 1)
        _check_int("max_skipped", self.max_skipped, 0)
        if self.last_step is not None:
            _check_int("last_step", self.last_step, 1)

    def computes(self, step):
        """Whether the telemetry is computed at ``step`` (:meth:`StateTelemetry.computes`)."""
        return _logged(step, self.every, self.last_step, self.max_skipped)

    def observe(self, opt_state) -> jax.Array:
        """:meth:`computes` of the step after ``opt_state``'s count (a boolean scalar): the
        ``observe`` flag of ``Llama.observed_hidden_states``, known before the forward pass."""
        if self.every == 1:
            return jnp.asarray(True)
        return jnp.asarray(self.computes(_step_count(opt_state) + 1))

    def metrics(self, scales: dict, observe) -> dict[str, jax.Array]:
        """The ``act/`` metrics of ``Llama.observed_hidden_states``' scales (leaves may carry
        leading microbatch axes), and :data:`ACT_COMPUTED` (``observe``)."""
        layers, norm = scales["layers"] or {}, scales["norm"]
        # Leading (microbatch) axes reduce like the layers: largest, smallest, summed counts.
        over = lambda f, x, keep: f(x.reshape(-1, *x.shape[x.ndim - keep :]), axis=0)
        metrics = {ACT_COMPUTED: jnp.asarray(observe)}
        nonfinite = jnp.zeros([], jnp.int32)
        if "linear" in layers:
            linear = layers["linear"]
            n = linear.shape[-1]
            largest = over(jnp.max, linear, 2).reshape(-1)
            worst = jnp.argmax(largest)
            nonfinite += jnp.sum(~jnp.isfinite(linear), dtype=jnp.int32)
            metrics.update(
                {
                    "act/linear_scale_min": jnp.min(linear),
                    "act/linear_scale_max": largest[worst],
                    "act/linear_worst_layer": (worst // n).astype(jnp.int32),
                    "act/linear_worst_input": (worst % n).astype(jnp.int32),
                }
            )
        # Every array of a layer summary is [..., layers, tensors].
        num_layers = jax.tree.leaves(layers)[0].shape[-2] if layers else 0
        m = layers["group"]["max"].shape[-1] if "group" in layers else 0
        groups = []  # (summary, its axes per layer, the layer and tensor of each value)
        if "group" in layers:
            layer_of, tensor_of = np.divmod(np.arange(num_layers * m), m)
            groups.append((layers["group"], 2, layer_of, tensor_of))
        if "group" in norm:
            # The final norm: one layer past the decoder's, the tensor after a layer's.
            groups.append((norm["group"], 1, np.array([num_layers]), np.array([m])))
        if groups:
            cat = lambda name, f: jnp.concatenate(
                [over(f, g[name], keep).reshape(-1) for g, keep, _, _ in groups]
            )
            largest, smallest = cat("max", jnp.max), cat("min", jnp.min)
            worst = jnp.argmax(largest)
            layer_of = jnp.asarray(np.concatenate([g[2] for g in groups]), jnp.int32)
            tensor_of = jnp.asarray(np.concatenate([g[3] for g in groups]), jnp.int32)
            nonfinite += jnp.sum(cat("nonfinite", jnp.sum))
            metrics.update(
                {
                    "act/group_scale_min": jnp.min(smallest),
                    "act/group_scale_max": largest[worst],
                    "act/group_worst_layer": layer_of[worst],
                    "act/group_worst_tensor": tensor_of[worst],
                }
            )
        metrics["act/nonfinite"] = nonfinite
        return metrics


def activation_telemetry(cfg: TrainConfig) -> ActivationTelemetry | None:
    """The activation telemetry of ``cfg`` (``None`` with ``telemetry`` off, and for precision
    ``bf16``, which has no FP8 activations), on the steps :func:`state_telemetry` uses."""
    if not cfg.telemetry or cfg.precision == "bf16":
        return None
    return ActivationTelemetry(
        every=cfg.log_every, last_step=cfg.steps, max_skipped=cfg.skip_nonfinite_steps
    )

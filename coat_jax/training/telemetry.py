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

For a model with FP8 activations, ``coat_jax.training.act_telemetry.ActivationTelemetry`` adds
the ``act/`` metrics: the range of the scales the FP8 activation ops quantize with (per-tensor
scales of the linears' inputs, 1x16 scales of what the non-linear ops keep), taken from the ops
themselves
(``coat_jax.fp8_ops.observed_*``, ``Llama.observed_hidden_states``), with the layer and the
tensor of the largest and a count of non-finite scales; on the same steps, with its own flag
:data:`ACT_COMPUTED`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from jax import lax

from coat_jax import quant
from coat_jax.fp8_ops import placeholder
from coat_jax.fp8_wrapper import find_fp8_states
from coat_jax.llama_layout import is_stacked_layer
from coat_jax.optim import DEFAULT_GROUP_SIZE, apply_gradients, clip_factor, find_coat_states
from coat_jax.training.config import TrainConfig
from coat_jax.training.optimizers import make_optimizer
from coat_jax.training.telemetry_sample import (
    SamplePlan,
    coat_stored,
    count_metrics,
    error_metrics,
    find_inner,
    fp8_fields,
    group_rows,
    nth_inner,
    only_one,
    optax_stored,
    sample_of,
    sampled_rows,
    sampled_value,
    stored_layout,
)
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
            check_int(name, getattr(self, name), least)
        if self.last_step is not None:
            check_int("last_step", self.last_step, 1)

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

        Examples:
          >>> t = StateTelemetry(every=10, last_step=25)
          >>> [s for s in range(1, 26) if t.computes(s)]
          [1, 10, 20, 25]
          >>> [s for s in range(1, 26) if StateTelemetry(every=10, max_skipped=1).computes(s)]
          [1, 9, 10, 19, 20]
        """
        return due_at(step, self.every, self.last_step, self.max_skipped)

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
            computed = jnp.asarray(self.computes(step_count(opt_state) + 1))
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
        kind, read = self._reader(opt_state, params)
        # The stored moments' layout, from shapes alone: the reads themselves (a reshape of
        # the codes to their group view) stay inside the computed branches.
        layout = stored_layout(read, opt_state)
        # A parameter is sampled in the group view its FP8 moments are stored in.
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        views = [p.shape for _, p in flat]
        for s in layout:
            if isinstance(s.moment, quant.QuantizedTensor):
                views[s.param] = s.moment.shape
        plans = [
            SamplePlan.for_shape(
                view,
                stacked=is_stacked_layer(path),
                rows=self.rows,
                groups=self.groups,
                group_size=gs,
            )
            for (path, _), view in zip(flat, views, strict=True)
        ]
        fields = fp8_fields(layout)
        sample = {}
        if self.replay and any(fields.values()):
            sample = when(
                lambda: self._sample(kind, read(opt_state), fields, plans, grads32, params32)
            )
        if sample:
            # The old state and the gradient are sampled before the update: the optimizer
            # overwrites the state in place (donated buffers, the Pallas kernel's aliasing),
            # and the barrier orders these reads before it, so no copy of the state is needed.
            grads, sample = lax.optimization_barrier((grads, sample))
        out, new_state = step(grads, opt_state, params)

        def measure():
            new = read(new_state)
            metrics = count_metrics(new, self.expand_min)
            if self.replay:
                stored = {
                    f: sampled_rows([new[i] for i in members], plans, gs)
                    for f, members in fields.items()
                    if members
                }
                exact = (
                    self._replay(kind, opt_state, params, layout, fields, sample) if stored else {}
                )
                metrics.update(error_metrics(new, fields, exact, stored, plans))
            return dict(sorted(metrics.items()))

        return out, new_state, when(measure)

    def _sample(self, kind, old, fields, plans, grads32, params32) -> dict:
        """What the replay needs of the old state and the (clipped) gradient, sampled."""
        gs = self.group_size
        grads = [sample_of(p, g) for p, g in zip(plans, jax.tree.leaves(grads32), strict=True)]
        if self.grad_clip is not None:
            # The trainer's clip (coat_jax.optim.clip_by_global_norm), on the sample.
            factor = clip_factor(optax.tree.norm(grads32), self.grad_clip)
            grads = [g * factor for g in grads]
        if kind == "coat":
            # COAT's replay is element-wise: every tensor's groups at once.
            return {
                "old": {
                    f: sampled_rows([old[i] for i in members], plans, gs)[0]
                    for f, members in fields.items()
                    if members
                },
                "grads": {
                    f: jnp.concatenate([group_rows(grads[old[i].param], gs) for i in members])
                    for f, members in fields.items()
                    if members
                },
            }
        # An optax optimizer's update takes its state tree: samples shaped like the tensors.
        return {
            "old": [sampled_value(s, plans[s.param]) for s in old],
            "grads": grads,
            "params": [
                sample_of(p, x) for p, x in zip(plans, jax.tree.leaves(params32), strict=True)
            ],
        }

    def _reader(self, opt_state, params):
        """``(kind, read)``: ``read(state)`` lists the stored moments of a state like ``opt_state``."""
        if find_coat_states(opt_state):
            return "coat", lambda state: coat_stored(
                only_one(find_coat_states(state), "COAT"), params, self.group_size
            )
        if find_fp8_states(opt_state):

            def read_fp8(state):
                _, s = only_one(find_fp8_states(state), "fp8_state")
                stored = optax_stored(
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
        position, _ = find_inner(opt_state, structure)

        def read_plain(state):
            inner_state = nth_inner(state, structure, position)
            stored = optax_stored(inner_state, None, None, None, params, group_size=self.group_size)
            return [leaf for _, leaf in stored]

        return "optax", read_plain

    def _replay(self, kind, opt_state, params, old, fields, sample) -> dict[str, jax.Array]:
        """Per field, the float32 moments this step quantized into the sampled groups, as the
        rows :func:`sampled_rows` gives."""
        gs = self.group_size
        if kind == "coat":
            if [old[i].param for i in fields["mu"]] != [old[i].param for i in fields["nu"]]:
                raise ValueError("telemetry: COAT state with FP8 mu and nu on different tensors")
            count = optax.safe_increment(only_one(find_coat_states(opt_state), "COAT").count)
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
            positions = [pos for pos, _ in optax_stored(*s, params, group_size=gs)]
        else:
            structure = jax.tree.structure(jax.eval_shape(self.inner.init, params))
            _, inner_state = find_inner(opt_state, structure)
            stored = optax_stored(inner_state, None, None, None, params, group_size=gs)
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
                [group_rows(new_leaves[positions[i]].astype(jnp.float32), gs) for i in members]
            )
            for f, members in fields.items()
            if members
        }


def check_int(name: str, value, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        what = "a positive int" if least == 1 else f"an int >= {least}"
        raise ValueError(f"telemetry {name} must be {what}, got {value!r}")


def due_at(step, every: int, last_step: int | None, max_skipped: int):
    """:meth:`StateTelemetry.computes` (and ``ActivationTelemetry.computes``)."""
    if every == 1:
        return jnp.ones_like(step, bool)
    # Steps to the next multiple of `every` (0 at one); % takes the divisor's sign.
    due = ((-step) % every <= max_skipped) | (step == 1)
    if last_step is not None:
        due = due | ((step <= last_step) & (last_step - step <= max_skipped))
    return due


def step_count(opt_state) -> jax.Array:
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

    Examples:
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


def tensor_names(params) -> list[str]:
    """The names ``state/*_worst_tensor`` indexes: each parameter's key path, in leaf order.

    Examples:
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

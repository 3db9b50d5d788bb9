"""What the optimizer-state telemetry reads of a state: samples, stored moments and the metrics.

:class:`SamplePlan` picks the values of one tensor the relative error looks at; the readers
list each parameter-shaped moment as stored (FP8 codes and statistics, or float32) for COAT's
state, ``fp8_state``'s and a plain optax state; :func:`count_metrics` and
:func:`error_metrics` turn them into the ``state/`` metrics (docs/telemetry.md). The step-level
logic (when, and the replay of the moment update) is
:class:`coat_jax.training.telemetry.StateTelemetry`'s.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from coat_jax import quant, state_codec
from coat_jax.fp8_wrapper import field_name, owner
from coat_jax.optim import moments_of


@dataclasses.dataclass(frozen=True)
class SamplePlan:
    """Which values of one tensor the relative error looks at (static: it only knows shapes).

    Attributes:
      shape: the tensor's group view (``coat_jax.state_codec.group_view``; its own shape for
        a moment kept in float32): the shape whose last axis the groups run along.
      row_slices: ``(axis, stride, count)`` per leading axis that is sampled: indices
        ``0, stride, ..., (count - 1) * stride``.
      group_stride, group_count: groups ``0, group_stride, ...`` along the last axis.
      group_size: values per group.
      weight: the tensor's values per sampled value, so that weighted sums over the sample
        estimate sums over whole tensors (a pooled error is not biased towards the tensors a
        sample covers more densely).
    """

    shape: tuple[int, ...]
    row_slices: tuple[tuple[int, int, int], ...]
    group_stride: int
    group_count: int
    group_size: int
    weight: float

    @classmethod
    def for_shape(cls, shape, *, stacked: bool, rows: int, groups: int, group_size: int):
        """The plan of a tensor grouped in ``shape`` (``None`` for scalars and empty arrays)."""
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
        weight = math.prod(shape) / sampled
        return cls(tuple(shape), tuple(row_slices), stride, count, group_size, weight)

    def values(self, x: jax.Array) -> jax.Array:
        """The sampled values of a parameter-shaped ``x`` (or of ``x`` in the plan's shape):
        ``[..., group_count * group_size]`` (a short last group zero-padded)."""
        x_g = quant.to_groups(self._rows(x.reshape(self.shape)), self.group_size)
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


class Stored(NamedTuple):
    """One parameter-shaped moment leaf as stored: FP8 codes and statistics, or float32."""

    field: str
    param: int
    moment: quant.QuantizedTensor | jax.Array  # an array: the float32 moment itself


def sample_of(plan: SamplePlan | None, x):
    """``plan``'s sample of ``x`` (``x`` itself without a plan: a scalar or an empty array)."""
    return x if plan is None else plan.values(x)


def sampled_value(stored: Stored, plan: SamplePlan | None) -> jax.Array:
    """The sampled values ``stored`` stands for, dequantized, float32, shaped as
    :meth:`SamplePlan.values` gives them."""
    m = stored.moment
    if not isinstance(m, quant.QuantizedTensor):
        return sample_of(plan, m).astype(jnp.float32)
    sampled = m.replace(
        codes=plan.values(m.codes),
        scale=plan.stats(m.scale),
        expand=None if m.expand is None else plan.stats(m.expand),
        center=None if m.center is None else plan.stats(m.center),
    )
    return sampled.dequantize()


def group_rows(x, group_size: int) -> jax.Array:
    """A sample as rows of one group each: ``[groups, group_size]``."""
    return x.reshape(-1, group_size)


def sampled_rows(stored: list[Stored], plans, group_size: int) -> tuple[jax.Array, list[int]]:
    """The sampled groups of several FP8 leaves of one field, concatenated and dequantized at
    once (one set of fusions however many tensors): ``[groups, group_size]`` float32, and the
    number of groups each leaf contributes."""
    moments = [s.moment for s in stored]
    if len({m.expand is None for m in moments}) != 1:
        raise ValueError("telemetry: one state field mixes DRE and absmax leaves")
    leaf_plans = [plans[s.param] for s in stored]
    codes = [
        group_rows(p.values(m.codes.astype(jnp.float32)), group_size)
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


def coat_stored(state, params, group_size: int) -> list[Stored]:
    """The FP8 moments of a COAT state, ``mu`` then ``nu``, one per parameter."""
    treedef = jax.tree.structure(params)
    return [
        Stored(prefix, i, m)
        for prefix in ("mu", "nu")
        for i, m in enumerate(moments_of(state, treedef, prefix, group_size))
    ]


def _unmasked(x):
    return None if isinstance(x, optax.MaskedNode) else x


def optax_stored(
    inner_state, scale, expand, center, params, *, group_size: int
) -> list[tuple[int, Stored]]:
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
    by_path = {tuple(path): i for i, (path, _) in enumerate(param_flat)}
    longest = max((len(k) for k in by_path), default=0)
    found = []
    for pos, (path, leaf) in enumerate(flat):
        index, n = owner(path, by_path, longest)
        if index is None:
            continue
        p = param_flat[index][1]
        s, e, c = (_unmasked(st[pos]) for st in stats)
        floating = hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)
        if s is None and not (floating and leaf.shape == p.shape and leaf.ndim and leaf.size):
            continue
        field = field_name(path[: len(path) - n]) or "state"
        moment = leaf if s is None else state_codec.load(leaf, s, e, c, group_size)
        found.append((pos, Stored(field, index, moment)))
    return found


def stored_layout(read, state) -> list[Stored]:
    """``read(state)`` in shapes only (``jax.eval_shape``): each moment's field, parameter and
    form (a :class:`~coat_jax.quant.QuantizedTensor` or an array of ``ShapeDtypeStruct``
    leaves), without tracing a read into the caller's program."""
    names = []

    def moments(s):
        stored = read(s)
        # Field names and parameter indices are static: they leave the trace as they are.
        names.extend((x.field, x.param) for x in stored)
        return [x.moment for x in stored]

    shapes = jax.eval_shape(moments, state)
    return [Stored(f, i, m) for (f, i), m in zip(names, shapes, strict=True)]


def find_inner(opt_state, structure) -> tuple[int, Any]:
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


def nth_inner(opt_state, structure, position):
    """The subtree of ``opt_state`` with ``structure`` at :func:`find_inner`'s position."""
    is_match = lambda x: jax.tree.structure(x) == structure
    return jax.tree.leaves(opt_state, is_leaf=is_match)[position]


def only_one(found: list, what: str):
    """The one element of ``found``; a clear error when the optimizer state holds more or none."""
    if len(found) != 1:
        raise ValueError(f"telemetry expects one {what} optimizer state, found {len(found)}")
    return found[0]


def by_field(stored: list[Stored]) -> dict[str, list[int]]:
    """Per state field, the positions of its leaves in ``stored``."""
    fields: dict[str, list[int]] = {}
    for i, s in enumerate(stored):
        fields.setdefault(s.field, []).append(i)
    return fields


def fp8_fields(stored: list[Stored]) -> dict[str, list[int]]:
    """Per field, its FP8 leaves (positions in ``stored``); a field may have none."""
    return {
        f: [i for i in members if isinstance(stored[i].moment, quant.QuantizedTensor)]
        for f, members in by_field(stored).items()
    }


def variadic_sums(values, dtype, axes=None) -> jax.Array:
    """``[sum(v, axes) for v in values]`` (same-shape arrays) as one variadic reduction: XLA
    reads the inputs they are computed from once, and materializes nothing of their size."""
    values = [v.astype(dtype) for v in values]
    axes = tuple(range(values[0].ndim)) if axes is None else axes
    zeros = [jnp.zeros([], dtype)] * len(values)
    add = lambda xs, ys: [x + y for x, y in zip(xs, ys, strict=True)]
    return jnp.stack(lax.reduce(values, zeros, add, axes))


def count_metrics(stored: list[Stored], expand_min) -> dict[str, jax.Array]:
    """Saturated and non-finite values, clipped DRE exponents, groups: whole tensors.

    Two reductions per tensor, one over its codes and one over its statistics, so that a model
    of hundreds of tensors adds few fusions to the step.
    """
    floor = 1.0 / jnp.asarray(expand_min, jnp.float32)
    metrics = {}
    for field, members in by_field(stored).items():
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
            codes = variadic_sums([jnp.abs(q) == fmax, ~jnp.isfinite(q)], dtype)
            stats = [x for x in (m.scale, m.expand, m.center) if x is not None]
            bad = ~jnp.isfinite(stats[0])
            for x in stats[1:]:
                bad |= ~jnp.isfinite(x)
            conditions = [bad]
            if m.expand is not None:
                conditions += [m.expand == floor, m.expand == quant.MAX_EXPAND]
            groups = jnp.pad(variadic_sums(conditions, dtype), (0, 3 - len(conditions)))
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


def safe_mean(total, count):
    """``total / count``, 0 where ``count`` is 0."""
    return total / jnp.where(count == 0, 1.0, count)


def error_metrics(stored: list[Stored], fields, exact, sampled, plans) -> dict[str, jax.Array]:
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
        per_group = variadic_sums([rel, nonzero, nonzero & (y == 0)], jnp.float32, axes=(1,))
        leaf_of_group = np.repeat(np.arange(len(members)), sizes)
        sums, counts, flushed = jax.ops.segment_sum(
            per_group.T, leaf_of_group, num_segments=len(members), indices_are_sorted=True
        ).T
        per_tensor = safe_mean(sums, counts)
        w = jnp.asarray([plans[stored[i].param].weight for i in members], jnp.float32)
        # A NaN makes its tensor the worst one: argmax takes NaN for the maximum.
        worst = jnp.argmax(per_tensor)
        params = jnp.asarray([stored[i].param for i in members], jnp.int32)
        metrics.update(
            {
                f"state/{field}_rel_err": safe_mean(jnp.sum(w * sums), jnp.sum(w * counts)),
                f"state/{field}_rel_err_max": per_tensor[worst],
                f"state/{field}_flushed": safe_mean(jnp.sum(w * flushed), jnp.sum(w * counts)),
                f"state/{field}_worst_tensor": params[worst],
            }
        )
    return metrics

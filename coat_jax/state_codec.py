"""The FP8 optimizer-state codec shared by ``coat_adamw`` and ``fp8_state``.

One moment (one parameter's state leaf) is stored as four state fields, each a tree of plain
arrays mirroring the parameters in its optimizer's state (:class:`StoredMoment`): FP8 codes with
the parameter's shape and float32 per-group statistics (``scale``, and with Dynamic Range
Expansion ``expand`` and ``center``; ``optax.MaskedNode()`` without). A moment kept in float32
sits in ``codes`` itself, its statistics ``optax.MaskedNode()``.

Groups (:func:`grouped_axis`, docs/fp8_state.md, 'Narrow parameters'): ``group_size``
consecutive values of the row-major flatten of the parameter's trailing axes ``shape[k:]``, for
the largest ``k`` whose trailing block fills its groups at least three quarters (``k = ndim - 1``,
groups along the last axis, for every last axis that is a multiple of ``group_size``, COAT's
layout; ``k = 0``, the whole parameter, when no block does). The statistics then have shape
``shape[:k] + (1,) * (ndim - 1 - k) + (G,)`` with ``G = ceil(prod(shape[k:]) / group_size)``:
the parameter's rank, its leading axes, and the groups last, so they shard like the parameter
(:func:`stat_spec`). A moment is stored in FP8 only where that takes fewer bytes than float32
(:func:`fp8_pays`); elsewhere (a scalar, an empty array, a handful of values) it stays float32.

:func:`quantize` and :func:`store` turn a moment into its fields, :func:`load` and
:func:`dequantize` read them back: :func:`load` gives the moment as a
:class:`~coat_jax.quant.QuantizedTensor` of its grouped view ``shape[:k] + (prod(shape[k:]),)``
(groups along the view's last axis, the form the kernels take), :func:`store` reshapes it back.
The placement helpers put the fields where their parameter lives, so that a state's sharding
never changes between ``init`` and ``update``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

from coat_jax import quant
from coat_jax.quant import grouped_axis, view_shape  # noqa: F401 - public here too


class StoredMoment(NamedTuple):
    """One moment's four state fields (see the module docstring)."""

    codes: Any
    scale: Any
    expand: Any
    center: Any


def _stored_stat_shape(view_stats: tuple[int, ...], rank: int) -> tuple[int, ...]:
    return (*view_stats[:-1], *([1] * (rank - len(view_stats))), view_stats[-1])


def stat_shape(shape: tuple[int, ...], group_size: int) -> tuple[int, ...]:
    """The stored statistics' shape for a parameter of ``shape`` (module docstring)."""
    view = view_shape(shape, group_size)
    return _stored_stat_shape((*view[:-1], quant.num_groups(view[-1], group_size)), len(shape))


def fp8_pays(shape: tuple[int, ...], group_size: int, n_stats: int) -> bool:
    """Whether 1-byte codes plus ``n_stats`` float32 statistics per group take fewer bytes than
    a float32 moment of ``shape`` (``n_stats``: 3 with Dynamic Range Expansion, 1 without)."""
    size = math.prod(shape)
    if not shape or size == 0:
        return False
    return size + 4 * n_stats * math.prod(stat_shape(shape, group_size)) < 4 * size


def stored_view(codes_shape, stats_shape, group_size: int) -> tuple[int, ...]:
    """The grouped view that stored statistics of ``stats_shape`` stand for (module docstring).

    Read from the shapes, not from :func:`grouped_axis`, so that a stack of states made one
    element at a time (``vmap`` of ``init``) and a state written with groups along the last axis
    read back as they were made.
    """
    codes_shape, stats_shape = tuple(codes_shape), tuple(stats_shape)
    rank = len(codes_shape)
    for k in range(rank - 1, -1, -1):
        m = math.prod(codes_shape[k:])
        view_stats = (*codes_shape[:k], quant.num_groups(m, group_size))
        if stats_shape == _stored_stat_shape(view_stats, rank):
            return (*codes_shape[:k], m)
    raise ValueError(
        f"optimizer statistics of shape {stats_shape} do not fit FP8 codes of shape "
        f"{codes_shape} with group_size={group_size}: build the optimizer with the group_size "
        "the state was made with"
    )


def quantize(x: jax.Array, *, fmt: str, expansion: bool, group_size: int, expand_min, view=None):
    """``x`` quantized per group of ``group_size`` along the last axis of its grouped view
    (``view``, default :func:`view_shape`): Dynamic Range Expansion (``expansion``) or plain
    absmax, in ``fmt``. The result is a :class:`~coat_jax.quant.QuantizedTensor` of the view."""
    x = x.reshape(view_shape(x.shape, group_size) if view is None else view)
    if expansion:
        return quant.quantize_dre(x, group_size=group_size, fmt=fmt, expand_min=expand_min)
    return quant.quantize_absmax(x, group_size=group_size, fmt=fmt)


def store(moment, shape: tuple[int, ...] | None = None) -> StoredMoment:
    """A moment's state fields: a :class:`~coat_jax.quant.QuantizedTensor`'s codes (reshaped
    from its grouped view to the parameter's ``shape``) and statistics (``MaskedNode`` for
    absent ones), or a float32 moment in ``codes``."""
    if not isinstance(moment, quant.QuantizedTensor):
        return StoredMoment(moment, optax.MaskedNode(), optax.MaskedNode(), optax.MaskedNode())
    shape = moment.codes.shape if shape is None else tuple(shape)
    stats = _stored_stat_shape(moment.scale.shape, len(shape))

    def stat(x):
        return optax.MaskedNode() if x is None else x.reshape(stats)

    return StoredMoment(
        moment.codes.reshape(shape), stat(moment.scale), stat(moment.expand), stat(moment.center)
    )


def _unmask(x):
    return None if isinstance(x, optax.MaskedNode) else x


def load(codes, scale, expand, center, group_size: int):
    """The inverse of :func:`store`: a :class:`~coat_jax.quant.QuantizedTensor` of the grouped
    view, or the float32 moment itself where ``codes`` holds it (statistics ``MaskedNode``)."""
    if isinstance(scale, optax.MaskedNode):
        return codes
    view = stored_view(codes.shape, scale.shape, group_size)

    def stat(x):
        x = _unmask(x)
        return None if x is None else x.reshape(*view[:-1], x.shape[-1])

    return quant.QuantizedTensor(
        codes.reshape(view),
        stat(scale),
        stat(expand),
        stat(center),
        fmt=quant.format_of(codes.dtype),
        granularity="group",
        group_size=group_size,
    )


def dequantize(codes, scale, expand, center, group_size: int) -> jax.Array:
    """The float32 moment that four state fields stand for, in the parameter's shape."""
    moment = load(codes, scale, expand, center, group_size)
    if isinstance(moment, quant.QuantizedTensor):
        return moment.dequantize().reshape(codes.shape)
    return moment


def flatten_option(option, params, treedef, *, name: str, of: str) -> list:
    """The leaves of a per-parameter option (a tree like ``params``, or a callable returning one).

    ``name`` and ``of`` only word the error: ``"fp8_mask"``, ``"bools"``.
    """
    tree = option(params) if callable(option) else option
    try:
        return treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{name} must be a tree of {of} with the parameters' structure (or a callable "
            f"returning one); it does not match the parameters: {e}"
        ) from None


def stat_spec(spec: PartitionSpec, param_shape, stats_shape, axis_sizes) -> PartitionSpec:
    """The ``PartitionSpec`` of a leaf of a parameter's rank stored with it (its statistics, or
    its codes), given the parameter's ``spec``; another leaf of that rank is split axis by axis.

    Leading axes keep the parameter's split; the groups' axis (the last) takes the split of the
    first flattened axis when no later one is split (each shard then holds a contiguous run of
    the flatten); an axis the leaf's size there does not divide stays unsplit. ``axis_sizes``
    maps mesh axis names to sizes.
    """
    param_shape, stats_shape = tuple(param_shape), tuple(stats_shape)
    rank = len(param_shape)
    entries = list(spec) + [None] * (rank - len(spec))
    # The grouped view's leading axes: where the statistics stop repeating the parameter's shape
    # and turn to ones (two readings of one shape group the same values: docs/fp8_state.md).
    k = next(
        (
            k
            for k in range(rank - 1, -1, -1)
            if stats_shape[:k] == param_shape[:k] and all(d == 1 for d in stats_shape[k:-1])
        ),
        None,
    )
    if k is None:
        # Another leaf of the parameter's rank: axis by axis.
        stats = entries
    else:
        stats = [*entries[:k], *([None] * (rank - k))]
        if all(e is None for e in entries[k + 1 :]):
            stats[-1] = entries[k]
    for i, entry in enumerate(stats):
        names = entry if isinstance(entry, tuple) else (entry,)
        ways = math.prod(axis_sizes[n] for n in names if n is not None)
        if stats_shape[i] % ways:
            stats[i] = None
    return PartitionSpec(*stats)


def stat_sharding(param, stat_shape):
    """Where a parameter's per-group statistics live: its own sharding where the shapes allow
    (:func:`stat_spec`)."""
    # Tracers first: asking a tracer for its sharding is slow (quadratic over a traced init).
    if isinstance(param, jax.core.Tracer):
        return None
    sharding = getattr(param, "sharding", None)
    if sharding is None:
        return None
    if isinstance(sharding, NamedSharding):
        axis_sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes, strict=True))
        spec = stat_spec(sharding.spec, param.shape, stat_shape, axis_sizes)
        return NamedSharding(sharding.mesh, spec)
    if sharding.is_fully_replicated:
        return sharding
    return None


def kernel_placement(grad, mesh, partition, implementation: str) -> tuple[Any, Any]:
    """``(mesh, PartitionSpec)`` the optimizer's kernel steps one parameter under.

    With ``mesh`` given, that mesh and the parameter's spec. Without it, on a process with
    several devices, ``implementation="pallas"`` takes the placement from a concrete gradient's
    ``NamedSharding`` (so no operand is gathered), and refuses a traced one: inside ``jit`` the
    placement is decided later, and a ``pallas_call`` with no partitioning rule would make XLA
    gather sharded operands whole. ``"auto"`` then runs the XLA path (``dispatch``).
    """
    if mesh is not None or implementation != "pallas" or jax.device_count() == 1:
        return mesh, partition
    if isinstance(grad, jax.core.Tracer):
        raise ValueError(
            f"coat_adamw(implementation='pallas') inside jit on a process with "
            f"{jax.device_count()} devices needs mesh= and partition_specs= (the kernel has no "
            "partitioning rule, so XLA would gather sharded parameters whole); pass them, or "
            "use implementation='auto', whose XLA path partitions like any jnp code"
        )
    sharding = grad.sharding
    if len(sharding.device_set) == 1:
        return None, None
    if not isinstance(sharding, NamedSharding):
        raise ValueError(
            f"coat_adamw(implementation='pallas') got a gradient placed as {sharding}, not a "
            "NamedSharding; pass mesh= and partition_specs="
        )
    return sharding.mesh, sharding.spec


def replicated_like(leaves):
    """A replicated sharding on the parameters' mesh, so the step count lives where they do."""
    for p in leaves:
        if isinstance(p, jax.core.Tracer):
            return None
        sharding = getattr(p, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return NamedSharding(sharding.mesh, PartitionSpec())
    return None


def unbox(x):
    """A state leaf out of its ``nnx.Variable`` box (``nnx.Optimizer`` boxes its state)."""
    return x.get_value() if hasattr(x, "get_value") else x

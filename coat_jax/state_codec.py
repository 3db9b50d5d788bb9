"""The FP8 optimizer-state codec shared by ``coat_adamw`` and ``fp8_state``.

One moment (one parameter's state leaf) is stored as four state fields, each a tree of plain
arrays mirroring the parameters in its optimizer's state (:class:`StoredMoment`): FP8 codes with
the parameter's shape and float32 per-group statistics (``scale``, and with Dynamic Range
Expansion ``expand`` and ``center``; ``optax.MaskedNode()`` without). A moment kept in float32
(masked out, or one whose FP8 form would not be smaller: :func:`fp8_pays`) sits in ``codes``
itself, its statistics ``optax.MaskedNode()``.

Groups are ``group_size`` consecutive values of the row-major flatten of each element of a
parameter: the parameter itself, or with ``stacked_axes`` leading axes each slice along them (a
scanned model's layers). They run along the last axis of the parameter's *group view*
(:func:`group_view`), a reshape of it of the same rank: the parameter's own shape where its rows
(its last axis) fill at least three quarters of their groups (``rows_keep_groups``; each row its
own groups, as COAT's kernel; a multiple of ``group_size`` fills them all), otherwise
``shape[:stacked_axes] + (1, ..., 1, m)`` with ``m`` the element's size, so that a narrow
parameter fills whole groups. Rows kept whole keep a column split of the parameter local to each
shard; the three quarters bound the statistics' padding, so no shape of at least ``group_size``
values costs more than a third of a group's statistics over its fill. The statistics have the
view's shape with its last axis counted in groups, ``view[:-1] + (ceil(view[-1] /
group_size),)``, so a stored moment names its own view (:func:`view_of`) and a slice of a
stack's fields is the slice's own state.

:func:`quantize` and :func:`store` turn a moment into its fields, :func:`load` and
:func:`dequantize` read them back; the placement helpers put the fields where their parameter
lives, so that a state's sharding never changes between ``init`` and ``update``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from coat_jax import quant
from pallas_kernels.sharding import rows_keep_groups, view_spec


class StoredMoment(NamedTuple):
    """One moment's four state fields (see the module docstring)."""

    codes: Any
    scale: Any
    expand: Any
    center: Any


def group_view(shape: Sequence[int], stacked_axes: int, group_size: int) -> tuple[int, ...]:
    """The shape a moment of ``shape`` is quantized in: groups of ``group_size`` run along its
    last axis (see the module docstring).

    ``stacked_axes`` leading axes index separate elements (a layer stack), whose values never
    share a group. A stack of scalars gets a last axis of 1 (FP8 does not pay there).

    Examples:
      >>> group_view((4096, 11008), 0, 128), group_view((512, 1), 0, 128)
      ((4096, 11008), (1, 512))
      >>> group_view((4, 7, 129), 1, 128), group_view((64, 1000), 0, 128)
      ((4, 1, 903), (64, 1000))
    """
    shape = tuple(shape)
    element = shape[stacked_axes:]
    if not element:
        return (*shape, 1)
    if len(element) == 1 or rows_keep_groups(shape[-1], group_size):
        return shape
    return (*shape[:stacked_axes], *(1,) * (len(element) - 1), math.prod(element))


def stat_shape(view: Sequence[int], group_size: int) -> tuple[int, ...]:
    """The per-group statistics' shape of a moment quantized in ``view``."""
    return (*view[:-1], quant.num_groups(view[-1], group_size))


def view_of(codes_shape: Sequence[int], stats_shape: Sequence[int]) -> tuple[int, ...]:
    """The group view of a stored moment, read off its codes' and statistics' shapes."""
    rows = math.prod(stats_shape[:-1])
    return (*stats_shape[:-1], math.prod(codes_shape) // rows)


def fp8_pays(view: Sequence[int], group_size: int, expansion: bool) -> bool:
    """Whether a moment quantized in ``view`` (:func:`group_view`) takes fewer bytes in FP8 (a
    byte a value, plus per group 3 float32 statistics with Dynamic Range Expansion, 1 without)
    than in float32.

    False for scalars, empty arrays and views whose last axis has at most 4 values (1 without
    expansion), so no parameter's FP8 state outweighs its float32 state (docs/fp8_state.md,
    'Parameters FP8 would not shrink'). A stack's view ends as each element's does, so a stack
    decides as each of its elements would.
    """
    if not view or 0 in view:
        return False
    n = view[-1]
    return n + 4 * (3 if expansion else 1) * quant.num_groups(n, group_size) < 4 * n


def stacked_counts(option, params, treedef) -> list[int]:
    """Per leaf of ``params``, its number of stacked leading axes from ``stacked_axes``: ``None``
    (0 for all), an int for every parameter, a tree of ints like ``params``, or a callable
    returning one."""
    leaves = treedef.flatten_up_to(params)
    if isinstance(option, jax.core.Tracer):
        raise ValueError(
            "stacked_axes is structural (it fixes the state's shapes) and cannot be traced; with "
            "optax.inject_hyperparams pass static_args=('stacked_axes',)"
        )
    if isinstance(option, (jax.Array, np.ndarray)) and option.ndim == 0:
        # optax.inject_hyperparams hands a number over as a concrete array.
        option = option.item()
    if option is None:
        counts = [0] * len(leaves)
    elif isinstance(option, int) and not isinstance(option, bool):
        counts = [option] * len(leaves)
    else:
        counts = flatten_option(option, params, treedef, name="stacked_axes", of="ints")
    for k, p in zip(counts, leaves, strict=True):
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= len(p.shape):
            raise ValueError(
                f"stacked_axes gives {k!r} for a parameter of shape {tuple(p.shape)}; each count "
                "must be an int from 0 to the parameter's rank"
            )
    return counts


def quantize(x: jax.Array, *, fmt: str, expansion: bool, group_size: int, expand_min):
    """``x`` (a moment in its group view) quantized per group of ``group_size`` along its last
    axis: Dynamic Range Expansion (``expansion``) or plain absmax, in ``fmt``."""
    if expansion:
        return quant.quantize_dre(x, group_size=group_size, fmt=fmt, expand_min=expand_min)
    return quant.quantize_absmax(x, group_size=group_size, fmt=fmt)


def store(moment, shape: Sequence[int]) -> StoredMoment:
    """A moment's state fields: a :class:`~coat_jax.quant.QuantizedTensor`'s codes (in
    ``shape``, the parameter's) and statistics (``MaskedNode`` for absent ones), or a float32
    moment in ``codes``."""
    if not isinstance(moment, quant.QuantizedTensor):
        return StoredMoment(moment, optax.MaskedNode(), optax.MaskedNode(), optax.MaskedNode())
    return StoredMoment(
        moment.codes.reshape(shape),
        moment.scale,
        optax.MaskedNode() if moment.expand is None else moment.expand,
        optax.MaskedNode() if moment.center is None else moment.center,
    )


def _unmask(x):
    return None if isinstance(x, optax.MaskedNode) else x


def load(codes, scale, expand, center, group_size: int):
    """The inverse of :func:`store`: a :class:`~coat_jax.quant.QuantizedTensor` in the moment's
    group view (:func:`view_of`), or the float32 moment itself where ``codes`` holds it (its
    statistics are ``MaskedNode``)."""
    if isinstance(scale, optax.MaskedNode):
        return codes
    return quant.QuantizedTensor(
        codes.reshape(view_of(codes.shape, scale.shape)),
        scale,
        _unmask(expand),
        _unmask(center),
        fmt=quant.format_of(codes.dtype),
        granularity="group",
        group_size=group_size,
    )


def dequantize(codes, scale, expand, center, group_size: int) -> jax.Array:
    """The float32 moment that four state fields stand for, in the codes' shape."""
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


def stat_sharding(param, view, stats_shape):
    """Where a parameter's per-group statistics live: its own sharding (for its group view
    ``view``) where the shapes allow."""
    # Tracers first: asking a tracer for its sharding is slow (quadratic over a traced init).
    if isinstance(param, jax.core.Tracer):
        return None
    sharding = getattr(param, "sharding", None)
    if sharding is None:
        return None
    if isinstance(sharding, NamedSharding):
        spec = list(view_spec(sharding.spec, param.shape, view))
        axis_sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes, strict=True))
        for i, entry in enumerate(spec):
            names = entry if isinstance(entry, tuple) else (entry,)
            ways = int(np.prod([axis_sizes[n] for n in names if n is not None]))
            if stats_shape[i] % ways:
                spec[i] = None
        return NamedSharding(sharding.mesh, PartitionSpec(*spec))
    if sharding.is_fully_replicated:
        return sharding
    return None


def fp8_views(params, mask, stacked_axes, *, group_size: int, expansion: bool) -> list:
    """Per leaf of ``params``: its group view (:func:`group_view`) where its moments are kept in
    FP8 (``mask``, optax's ``MaskOrFn`` or ``None`` for all, selects it and :func:`fp8_pays`),
    else ``None``. ``stacked_axes``: as :func:`stacked_counts` takes it."""
    leaves, treedef = jax.tree.flatten(params)
    if mask is None:
        wanted = [True] * len(leaves)
    else:
        wanted = flatten_option(mask, params, treedef, name="fp8_mask", of="bools")
    counts = stacked_counts(stacked_axes, params, treedef)
    views = [group_view(p.shape, k, group_size) for p, k in zip(leaves, counts, strict=True)]
    return [
        v if w and fp8_pays(v, group_size, expansion) else None
        for v, w in zip(views, wanted, strict=True)
    ]


def zero_moment(param, view, *, fmt: str, expansion: bool, group_size: int, expand_min):
    """The quantized form of an all-zero moment of ``param`` in its group view ``view``, its
    statistics placed like ``param`` (:func:`stat_sharding`)."""
    stats_shape = stat_shape(view, group_size)
    # What quantizing one all-zero group gives: the state starts as exactly quantize(0).
    zero = quantize(
        jnp.zeros((group_size,), jnp.float32),
        fmt=fmt,
        expansion=expansion,
        group_size=group_size,
        expand_min=expand_min,
    )
    sharding = stat_sharding(param, view, stats_shape)

    def stat(value):
        return jnp.full(stats_shape, value[0], jnp.float32, device=sharding)

    codes = jnp.zeros_like(param, dtype=quant.FORMATS[fmt]).reshape(view)
    if not expansion:
        return zero.replace(codes=codes, scale=stat(zero.scale))
    return zero.replace(
        codes=codes, scale=stat(zero.scale), expand=stat(zero.expand), center=stat(zero.center)
    )


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

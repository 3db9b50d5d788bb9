"""The FP8 optimizer-state codec shared by ``coat_adamw`` and ``fp8_state``.

One moment (one parameter's state leaf) is stored as four state fields, each a tree of plain
arrays mirroring the parameters in its optimizer's state (:class:`StoredMoment`): FP8 codes with
the parameter's shape and float32 per-group statistics of shape
``param.shape[:-1] + (ceil(n / group_size),)`` (``scale``, and with Dynamic Range Expansion
``expand`` and ``center``; ``optax.MaskedNode()`` without). A moment kept in float32 (masked out,
or one whose FP8 form would not be smaller: :func:`fp8_pays`) sits in ``codes`` itself, its
statistics ``optax.MaskedNode()``.

:func:`quantize` and :func:`store` turn a moment into its fields, :func:`load` and
:func:`dequantize` read them back; the placement helpers put the fields where their parameter
lives, so that a state's sharding never changes between ``init`` and ``update``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from coat_jax import quant


class StoredMoment(NamedTuple):
    """One moment's four state fields (see the module docstring)."""

    codes: Any
    scale: Any
    expand: Any
    center: Any


def fp8_pays(shape: tuple[int, ...], group_size: int, expansion: bool) -> bool:
    """Whether a moment of ``shape`` takes fewer bytes in FP8 (a byte a value, plus per group of
    its last axis 3 float32 statistics with Dynamic Range Expansion, 1 without) than in float32.

    False for scalars, empty arrays and last axes of at most 4 values (1 without expansion), so
    no parameter's FP8 state outweighs its float32 state (docs/fp8_state.md, 'Bytes per
    parameter'). It reads the last axis only, so a stack of parameters (a scanned model's leading
    layer axis) decides as each of its elements would.
    """
    if not shape or 0 in shape:
        return False
    n = shape[-1]
    return n + 4 * (3 if expansion else 1) * quant.num_groups(n, group_size) < 4 * n


def quantize(x: jax.Array, *, fmt: str, expansion: bool, group_size: int, expand_min):
    """``x`` quantized per group of ``group_size`` along its last axis: Dynamic Range Expansion
    (``expansion``) or plain absmax, in ``fmt``."""
    if expansion:
        return quant.quantize_dre(x, group_size=group_size, fmt=fmt, expand_min=expand_min)
    return quant.quantize_absmax(x, group_size=group_size, fmt=fmt)


def store(moment) -> StoredMoment:
    """A moment's state fields: a :class:`~coat_jax.quant.QuantizedTensor`'s codes and
    statistics (``MaskedNode`` for absent ones), or a float32 moment in ``codes``."""
    if not isinstance(moment, quant.QuantizedTensor):
        return StoredMoment(moment, optax.MaskedNode(), optax.MaskedNode(), optax.MaskedNode())
    return StoredMoment(
        moment.codes,
        moment.scale,
        optax.MaskedNode() if moment.expand is None else moment.expand,
        optax.MaskedNode() if moment.center is None else moment.center,
    )


def _unmask(x):
    return None if isinstance(x, optax.MaskedNode) else x


def load(codes, scale, expand, center, group_size: int):
    """The inverse of :func:`store`: a :class:`~coat_jax.quant.QuantizedTensor`, or the float32
    moment itself where ``codes`` holds it (its statistics are ``MaskedNode``)."""
    if isinstance(scale, optax.MaskedNode):
        return codes
    return quant.QuantizedTensor(
        codes,
        scale,
        _unmask(expand),
        _unmask(center),
        fmt=quant.format_of(codes.dtype),
        granularity="group",
        group_size=group_size,
    )


def dequantize(codes, scale, expand, center, group_size: int) -> jax.Array:
    """The float32 moment that four state fields stand for."""
    moment = load(codes, scale, expand, center, group_size)
    return moment.dequantize() if isinstance(moment, quant.QuantizedTensor) else moment


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


def stat_sharding(param, stat_shape):
    """Where a parameter's per-group statistics live: its own sharding where the shapes allow."""
    # Tracers first: asking a tracer for its sharding is slow (quadratic over a traced init).
    if isinstance(param, jax.core.Tracer):
        return None
    sharding = getattr(param, "sharding", None)
    if sharding is None:
        return None
    if isinstance(sharding, NamedSharding):
        spec = list(sharding.spec) + [None] * (len(stat_shape) - len(sharding.spec))
        axis_sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes, strict=True))
        for i, entry in enumerate(spec):
            names = entry if isinstance(entry, tuple) else (entry,)
            ways = int(np.prod([axis_sizes[n] for n in names if n is not None]))
            if stat_shape[i] % ways:
                spec[i] = None
        return NamedSharding(sharding.mesh, PartitionSpec(*spec))
    if sharding.is_fully_replicated:
        return sharding
    return None


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

"""FP8 optimizer state for any Optax optimizer: COAT's storage, applied as a wrapper.

``fp8_state(inner)`` is an ``optax.GradientTransformation`` that runs ``inner`` unchanged but
keeps the parameter-shaped floating leaves of its state in FP8 between steps: each step
dequantizes them to float32, calls ``inner.update`` and re-quantizes the new state, each leaf on
its own, with the per-group FP8 state codec it shares with ``coat_adamw``
(:mod:`coat_jax.state_codec`: Dynamic Range Expansion or plain absmax; docs/design.md, 'Groups
of 128'). ``fp8_state(optax.adamw(...))`` is therefore the same algorithm
as :func:`coat_jax.coat_adamw` (its ``implementation="xla"`` path), and the same storage serves
``optax.lion``, ``optax.sgd(momentum=...)``, ``optax.adafactor``, ``optax.contrib.muon`` and the
rest.

Which state leaves are quantized (the rule is static: it only looks at structure, shapes and
dtypes, never at values, so ``jax.eval_shape(init)`` gives the same layout):

1. The leaf belongs to a parameter: the parameter's full key path ends the leaf's key path (the
   rule ``coat_jax.training.sharding.state_shardings`` also uses; optax states mirror the
   parameters this way), the longest such parameter when several match.
2. It has that parameter's shape, at least one axis and at least one element, and a floating
   dtype; and ``mask`` selects the parameter.

Everything else is kept exactly as ``inner`` made it: step counts, scalars and hyper-parameters,
factored statistics (adafactor's ``v_row``/``v_col`` of a factored matrix), leaves whose shape
differs from the parameter's, integer leaves, masked-out parameters. :func:`quantized_paths` and
:func:`full_precision_paths` list the two sets for a given state.

Signed and non-negative leaves: a quantized leaf is *non-negative* when the name of the state
field holding it (the last ``NamedTuple`` field name or string dict key on its path before the
parameter's own path) is in ``nonnegative_fields`` (:data:`NONNEGATIVE_FIELDS` by default: the
second moments and squared-gradient accumulators of optax's states, e.g. adam's ``nu``,
adafactor's ``v``), and *signed* otherwise (momenta: adam's ``mu``, lion's ``mu``, sgd's
``trace``, muon's ``mu``). The role picks the leaf's FP8 format and whether it uses expansion
(``formats`` and ``expansion``). Both codecs keep each value's sign, so a leaf in the wrong role
is still stored correctly, only in the other role's format.

State layout (:class:`FP8State`): ``inner_state`` is ``inner``'s state with every quantized leaf
replaced by its FP8 codes (the parameter's shape); ``scale``, ``expand`` and ``center`` have the
same structure, holding the float32 per-group statistics at quantized leaves (shape
``param.shape[:-1] + (n / group_size,)`` for a last axis ``n`` that ``group_size`` divides;
otherwise the groups run over the flatten of each slice along ``stacked_axes``:
``coat_jax.state_codec.group_view``) and ``optax.MaskedNode()`` elsewhere (``expand``/``center``
also where expansion is off). Every leaf therefore sits at a key path ending in its parameter's
key path, with its parameter's rank, so the trainer shards it like the parameter. A quantized
leaf costs 1 byte per element plus 12 bytes per group of 128 with expansion (1.09 bytes per
parameter), 4 bytes per group without (1.03); a leaf that FP8 would not shrink (a scalar, an
element of at most 4 values: ``state_codec.fp8_pays``) stays as it is.

The dequantized leaves ``inner.update`` sees are float32 whatever dtype ``inner.init`` gave them
(a ``mu_dtype=bfloat16`` momentum is read back as float32 and stored as FP8 either way).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from coat_jax import quant, state_codec
from coat_jax.state_codec import StoredMoment

ROLES = ("signed", "nonnegative")

# Second moments and squared-gradient accumulators in optax's states: adam/adamw/amsgrad/yogi/
# rms/belief/rstddev ``nu`` (and amsgrad's ``nu_max``), adafactor's ``v``, ``v_row``, ``v_col``,
# adagrad/rss's ``sum_of_squares``, adadelta's ``e_g`` and ``e_x``.
NONNEGATIVE_FIELDS: frozenset[str] = frozenset(
    {"nu", "nu_max", "v", "v_row", "v_col", "sum_of_squares", "e_g", "e_x"}
)


class FP8State(NamedTuple):
    """State of :func:`fp8_state`: the inner state with FP8 codes, plus per-group statistics."""

    inner_state: Any
    scale: Any
    expand: Any
    center: Any


class _Codec(NamedTuple):
    fmt: str
    expansion: bool


def _per_role(name: str, value, check) -> dict[str, Any]:
    """``value`` for both roles, or a mapping ``{role: value}`` (missing roles: the default)."""
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(ROLES))
        if unknown:
            raise ValueError(
                f"{name} has unknown role(s) {unknown}; valid keys are {list(ROLES)} "
                "(or pass one value for both)"
            )
        return {role: check(value[role]) if role in value else None for role in ROLES}
    value = check(value)
    return dict.fromkeys(ROLES, value)


def _check_format(fmt) -> str:
    if fmt not in quant.FORMATS:
        raise ValueError(f"unknown FP8 format {fmt!r} in formats; valid: {sorted(quant.FORMATS)}")
    return fmt


def _check_expansion(value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expansion must be True or False (or a role mapping), got {value!r}")
    return value


def field_name(prefix) -> str | None:
    """The state field a leaf sits in: the last NamedTuple field or string dict key."""
    for key in reversed(prefix):
        if isinstance(key, jax.tree_util.GetAttrKey):
            return key.name
        if isinstance(key, jax.tree_util.DictKey) and isinstance(key.key, str):
            return key.key
    return None


def _is_floating(leaf) -> bool:
    return hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)


class _Owner(NamedTuple):
    param: Any
    wanted: bool
    stacked_axes: int


def _params_by_path(params, mask, stacked_axes) -> dict[tuple, _Owner]:
    """``{param key path: (param, wanted, stacked axes)}`` with ``wanted`` from the
    optax-style ``mask``."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    if mask is None:
        wanted = [True] * len(flat)
    else:
        wanted = state_codec.flatten_option(mask, params, treedef, name="mask", of="bools")
    counts = state_codec.stacked_counts(stacked_axes, params, treedef)
    return {
        tuple(path): _Owner(p, bool(w), k)
        for (path, p), w, k in zip(flat, wanted, counts, strict=True)
    }


def owner(path, by_path, longest) -> tuple[Any, int]:
    """``(found, n)``: ``by_path``'s entry for the parameter whose full key path (of length
    ``n``) ends ``path``, the longest such; ``(None, 0)`` when there is none."""
    for n in range(min(longest, len(path)), -1, -1):
        found = by_path.get(tuple(path[len(path) - n :]))
        if found is not None:
            return found, n
    return None, 0


def _place(x, sharding):
    # Tracers (jit, eval_shape) carry no placement; concrete arrays go where their parameter is.
    if sharding is None or not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return x
    return jax.device_put(x, sharding)


def _quantize(x, view, codec: _Codec, group_size: int, expand_min) -> StoredMoment:
    """``x`` quantized in its group view ``view``, stored in ``x``'s shape."""
    return state_codec.store(
        state_codec.quantize(
            x.reshape(view),
            fmt=codec.fmt,
            expansion=codec.expansion,
            group_size=group_size,
            expand_min=expand_min,
        ),
        x.shape,
    )


def _split(leaves) -> FP8State:
    def field(i):
        return jax.tree.map(
            lambda leaf: leaf[i], leaves, is_leaf=lambda x: isinstance(x, StoredMoment)
        )

    return FP8State(*(field(i) for i in range(4)))


def fp8_state(
    inner: optax.GradientTransformation,
    *,
    formats: str | Mapping[str, str] = "e4m3",
    group_size: int = 128,
    expansion: bool | Mapping[str, bool] = True,
    mask: Any | Callable[[optax.Params], Any] | None = None,
    expand_min: int = 16,
    nonnegative_fields: Collection[str] = NONNEGATIVE_FIELDS,
    stacked_axes: int | Any | Callable[[optax.Params], Any] | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Wraps any Optax optimizer so that its parameter-shaped state is stored in FP8 (COAT).

    Each step, for every quantized state leaf ``s`` (see the module docstring for which)::

        s = dequantize(codes, statistics)                 # float32
        updates, s_new = inner.update(grads, s, params)
        codes, statistics = quantize(s_new)               # per group of ``group_size`` values

    with Dynamic Range Expansion (COAT) or per-group absmax scaling (docs/design.md, 'Dynamic
    Range Expansion').
    ``fp8_state(optax.adamw(lr, ...))`` is COAT AdamW: with the defaults it stores and updates
    exactly what :func:`coat_jax.coat_adamw` does.

    Args:
      inner: the optimizer whose state is stored in FP8.
      formats: FP8 format of the quantized leaves, ``"e4m3"`` or ``"e5m2"``: one for all, or
        ``{"signed": ..., "nonnegative": ...}`` (a missing role gets ``"e4m3"``). COAT uses E4M3
        for both moments; E5M2 for the second moment is the other recommended pair.
      group_size: values per quantization group (static: it fixes the state's shapes): that
        many consecutive values of a leaf's row-major flatten (of each slice along its
        ``stacked_axes``), i.e. of one row where rows fill three quarters of their groups.
      expansion: Dynamic Range Expansion on (COAT) or off (absmax): one for all, or
        ``{"signed": ..., "nonnegative": ...}`` (a missing role gets ``True``).
      mask: which parameters' state is quantized, in optax's ``MaskOrFn`` convention (a tree
        of bools like the parameters, or a function of the parameters returning one).
        ``None``: all of them.
      expand_min: DRE's exponent is a multiple of ``1 / expand_min``.
      nonnegative_fields: state field names whose leaves are non-negative (second moments);
        every other quantized leaf is signed. Default :data:`NONNEGATIVE_FIELDS`.
      stacked_axes: how many leading axes of each parameter index elements that never share a
        group (static): an int, or a tree of ints like the parameters (or a function of them
        returning one); ``None`` or 0: the whole parameter. A scanned model passes 1 for its
        ``(layers, ...)`` stacks, so that each layer is grouped as it would be alone (see
        :func:`coat_jax.coat_adamw`).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is an :class:`FP8State`
      (extra arguments of ``update`` are passed on to ``inner``).

    Examples:
      >>> import jax.numpy as jnp, optax, coat_jax
      >>> tx = coat_jax.fp8_state(optax.lion(1e-4))
      >>> params = {"w": jnp.ones((4, 256))}
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": jnp.full((4, 256), 0.5)}, state, params)
      >>> coat_jax.quantized_paths(state)
      [".inner_state[0].mu['w']"]

      A stack of layers, grouped per layer (a ``(512, 1)`` weight alone fills 4 groups):

      >>> tx = coat_jax.fp8_state(optax.lion(1e-4), stacked_axes=1)
      >>> state = tx.init({"w": jnp.ones((2, 512, 1))})
      >>> state.scale[0].mu["w"].shape
      (2, 1, 4)

    References:
      Xi et al., "COAT: Compressing Optimizer States and Activation for Memory-Efficient FP8
      Training", ICLR 2025, arXiv:2410.19313.
    """
    if not isinstance(inner, optax.GradientTransformation | optax.GradientTransformationExtraArgs):
        raise ValueError(
            f"inner must be an optax.GradientTransformation (e.g. optax.adamw(1e-3)), got "
            f"{type(inner).__name__}"
        )
    inner = optax.with_extra_args_support(inner)
    group_size = quant.check_group_size(group_size)
    if isinstance(expand_min, bool) or not isinstance(expand_min, int | float) or expand_min <= 0:
        raise ValueError(f"expand_min must be a positive number, got {expand_min!r}")
    fmts = _per_role("formats", formats, _check_format)
    expands = _per_role("expansion", expansion, _check_expansion)
    codecs = {
        role: _Codec(fmts[role] or "e4m3", True if expands[role] is None else expands[role])
        for role in ROLES
    }
    if isinstance(nonnegative_fields, str) or not all(
        isinstance(f, str) for f in nonnegative_fields
    ):
        raise ValueError(
            "nonnegative_fields must be a collection of state field names (e.g. {'nu', 'v'}), "
            f"got {nonnegative_fields!r}"
        )
    nonnegative = frozenset(nonnegative_fields)

    def init_fn(params):
        inner_state = inner.init(params)
        by_path = _params_by_path(params, mask, stacked_axes)
        longest = max((len(k) for k in by_path), default=0)
        # Where jit puts the leaves kept as they are (counts, ...) after an update: on the
        # parameters' mesh, replicated. Placing them there now keeps every leaf's sharding fixed.
        replicated = state_codec.replicated_like(jax.tree.leaves(params))

        def store(path, leaf):
            found, n = owner(path, by_path, longest)
            param = None if found is None else found.param
            field = field_name(path[: len(path) - n])
            codec = codecs["nonnegative" if field in nonnegative else "signed"]
            shape = getattr(leaf, "shape", None)
            if param is None or shape != param.shape:
                return state_codec.store(_place(leaf, replicated), shape)
            view = state_codec.group_view(shape, found.stacked_axes, group_size)
            if (
                not found.wanted
                or not _is_floating(leaf)
                or not state_codec.fp8_pays(view, group_size, codec.expansion)
            ):
                return state_codec.store(_place(leaf, getattr(param, "sharding", None)), shape)
            q = _quantize(leaf, view, codec, group_size, expand_min)
            stat_sharding = state_codec.stat_sharding(param, view, q.scale.shape)
            return StoredMoment(
                _place(q.codes, getattr(param, "sharding", None)),
                *(
                    s if isinstance(s, optax.MaskedNode) else _place(s, stat_sharding)
                    for s in q[1:]
                ),
            )

        return _split(jax.tree_util.tree_map_with_path(store, inner_state))

    def update_fn(updates, state, params=None, **extra_args):
        def load(codes, scale, expand, center):
            return state_codec.dequantize(codes, scale, expand, center, group_size)

        inner_state = jax.tree.map(load, state.inner_state, state.scale, state.expand, state.center)
        updates, new_inner = inner.update(updates, inner_state, params, **extra_args)

        def store(new, codes, scale, expand):
            if isinstance(scale, optax.MaskedNode):
                return state_codec.store(new, getattr(new, "shape", None))
            codec = _Codec(quant.format_of(codes.dtype), not isinstance(expand, optax.MaskedNode))
            view = state_codec.view_of(codes.shape, scale.shape)
            return _quantize(new, view, codec, group_size, expand_min)

        try:
            stored = jax.tree.map(store, new_inner, state.inner_state, state.scale, state.expand)
        except ValueError as e:
            raise ValueError(
                "inner.update returned a state whose structure differs from its init state; "
                f"fp8_state needs the inner optimizer's state structure to be fixed: {e}"
            ) from None
        return updates, _split(stored)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def find_fp8_states(opt_state) -> list[tuple[str, FP8State]]:
    """Every :class:`FP8State` inside an optimizer state, with its key path (chains, wrappers,
    ``nnx.Optimizer.opt_state``)."""
    is_state = lambda x: isinstance(x, FP8State)
    flat, _ = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=is_state)
    return [
        (
            jax.tree_util.keystr(path),
            jax.tree.map(state_codec.unbox, s, is_leaf=lambda x: hasattr(x, "get_value")),
        )
        for path, s in flat
        if is_state(s)
    ]


def _leaf_paths(opt_state, quantized: bool) -> list[str]:
    found = find_fp8_states(opt_state)
    if not found:
        raise ValueError("opt_state holds no FP8State; build the optimizer with fp8_state(...)")
    paths = []
    for prefix, state in found:
        flat, _ = jax.tree_util.tree_flatten_with_path(state.inner_state)
        scales = jax.tree_util.tree_structure(state.inner_state).flatten_up_to(state.scale)
        for (path, leaf), scale in zip(flat, scales, strict=True):
            held = not isinstance(scale, optax.MaskedNode)
            if held == quantized and (quantized or _is_floating(leaf)):
                paths.append(f"{prefix}.inner_state{jax.tree_util.keystr(path)}")
    return paths


def quantized_paths(opt_state) -> list[str]:
    """Key paths (``jax.tree_util.keystr``, within ``opt_state``) of the state leaves in FP8.

    Works on concrete states and on ``jax.eval_shape(tx.init, params)``.
    """
    return _leaf_paths(opt_state, quantized=True)


def full_precision_paths(opt_state) -> list[str]:
    """Key paths of the floating state leaves :func:`fp8_state` keeps as they are (see the
    module docstring for the rule), e.g. factored statistics or masked-out parameters."""
    return _leaf_paths(opt_state, quantized=False)


def dequantized_state(opt_state, *, group_size: int = 128):
    """The inner optimizer's state with its FP8 leaves read back as float32.

    For diagnostics and tests. ``opt_state`` must hold exactly one :class:`FP8State`, built with
    this ``group_size``.
    """
    found = find_fp8_states(opt_state)
    if len(found) != 1:
        raise ValueError(f"expected exactly one FP8State in opt_state, found {len(found)}")
    ((_, state),) = found
    group_size = quant.check_group_size(group_size)
    return jax.tree.map(
        lambda c, s, e, m: state_codec.dequantize(c, s, e, m, group_size),
        state.inner_state,
        state.scale,
        state.expand,
        state.center,
    )

"""COAT AdamW: Adam whose two moments are stored in FP8 with Dynamic Range Expansion.

``scale_by_coat_adam`` is the core Optax transformation; ``coat_adamw`` chains it with decoupled
weight decay and the learning rate exactly as ``optax.adamw`` does, so ``coat_adamw`` is
``optax.adamw`` (``eps_root=0``) with quantized moments. The numerics follow docs/design.md,
'The optimizer step', and COAT's CUDA kernel (Xi et al., "COAT: Compressing Optimizer states and
Activation for Memory-Efficient FP8 Training", ICLR 2025, arXiv:2410.19313).

State layout (:class:`ScaleByCoatAdamState`): every field but ``count`` is a tree mirroring the
parameters. For a parameter quantized in FP8:

* ``mu_codes`` / ``nu_codes``: the parameter's shape, ``float8_e4m3fn`` or ``float8_e5m2``;
* ``mu_scale``, ``mu_expand``, ``mu_center`` (and ``nu_*``): float32, 3 floats per group of 128
  values (about 2.19 bytes per parameter for both moments, against 8 for float32 moments), shape
  ``param.shape[:-1] + (ceil(n / group_size),)`` for a last axis of ``n`` that fills at least
  three quarters of its groups (``pallas_kernels.sharding.rows_keep_groups``). Other
  parameters are grouped over the flatten of each slice along their ``stacked_axes``
  (``state_codec.group_view``; docs/design.md, 'Groups of 128'). Without expansion
  ``*_expand`` and ``*_center`` are ``optax.MaskedNode()`` (2.06 bytes).

Parameters FP8 would not shrink (``state_codec.fp8_pays``: scalars, empty arrays, elements of at
most 4 values) and those ``fp8_mask`` excludes keep float32 moments in ``*_codes``.

Sharded parameters (docs/sharding.md): on several devices the Pallas kernel runs on each shard
through ``shard_map`` once the optimizer knows the mesh: ``coat_adamw(..., mesh=mesh)``, with each
parameter's ``PartitionSpec`` from ``partition_specs`` (the trainer's rule:
``pallas_kernels.sharding.fsdp_param_shardings`` with the model's layout). Inside ``jit`` the
parameters are tracers whose placement XLA decides later, so the mesh has to be told; without it
``implementation="auto"`` keeps multi-device programs on the jnp path, which XLA partitions like
any jnp code.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from coat_jax import quant, state_codec
from coat_jax.fused_apply import (
    FusedGradientTransformation,
    GradScaleTransformation,
    apply_gradients,
    apply_gradients_at,
    chain,
    clip_by_global_norm,
    clip_factor,
    fused_in_place,
)
from pallas_kernels import coat_adam as kernels
from pallas_kernels import stacks
from pallas_kernels.dispatch import check_implementation

DEFAULT_GROUP_SIZE = 128

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "FusedGradientTransformation",
    "GradScaleTransformation",
    "ScaleByCoatAdam",
    "ScaleByCoatAdamState",
    "apply_gradients",
    "apply_gradients_at",
    "chain",
    "clip_by_global_norm",
    "clip_factor",
    "coat_adamw",
    "dequantized_moments",
    "find_coat_states",
    "fused_in_place",
    "moments_of",
    "scale_by_coat_adam",
]


class ScaleByCoatAdamState(NamedTuple):
    """State of :func:`scale_by_coat_adam`: FP8 codes plus float32 per-group statistics."""

    count: jax.Array
    mu_codes: optax.Updates
    mu_scale: optax.Updates
    mu_expand: optax.Updates
    mu_center: optax.Updates
    nu_codes: optax.Updates
    nu_scale: optax.Updates
    nu_expand: optax.Updates
    nu_center: optax.Updates


class ScaleByCoatAdam(optax.GradientTransformation):
    """What :func:`scale_by_coat_adam` returns: an ``optax.GradientTransformation`` (the pair
    ``(init, update)``) that also carries its step.

    Attributes:
      step: ``(updates, state, params=None, decay=None, grad_scale=None, index=None)``:
        ``update``, or with ``decay = (learning_rate, weight decay per leaf)`` the fused apply
        that :func:`coat_adamw` runs: ``(new_params, new_state)``, the gradients multiplied by
        ``grad_scale`` first (a scalar or ``None``) inside the kernel. With ``index`` (and
        ``decay``), ``params`` and ``state`` are stacks (every leaf with a leading axis, the
        step count included) and element ``index`` is updated in place.
    """

    step: Callable[..., tuple[Any, ScaleByCoatAdamState]]

    def __new__(cls, init, update, step):
        self = super().__new__(cls, init, update)
        self.step = step
        return self


def _is_concrete_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_decay(name: str, value) -> None:
    # Traced or array hyper-parameters (optax.inject_hyperparams) are checked by the caller's
    # schedule, not here: a Python `if` on them would break jit.
    if _is_concrete_number(value) and not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")


def _static_group_size(group_size) -> int:
    if group_size is None:
        return DEFAULT_GROUP_SIZE
    if isinstance(group_size, jax.core.Tracer):
        raise ValueError(
            "group_size is structural (it fixes the state's shapes) and cannot be traced; with "
            "optax.inject_hyperparams pass static_args=('group_size',)"
        )
    if isinstance(group_size, (jax.Array, np.ndarray)) and group_size.ndim == 0:
        if not jnp.issubdtype(group_size.dtype, jnp.integer):
            raise ValueError(f"group_size must be a positive int, got {group_size!r}")
        group_size = int(group_size)
    return quant.check_group_size(group_size)


def scale_by_coat_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    group_size: int | None = None,
    expand_min: int = 16,
    expansion: bool = True,
    mu_format: str = "e4m3",
    nu_format: str = "e4m3",
    fp8_mask: Any | Callable[[optax.Params], Any] | None = None,
    stacked_axes: int | Any | Callable[[optax.Params], Any] | None = None,
    implementation: str = "auto",
    interpret: bool = False,
    mesh: Mesh | None = None,
    partition_specs: Any | Callable[[optax.Params], Any] | None = None,
) -> ScaleByCoatAdam:
    r"""Rescales updates by Adam's rule, keeping both moments in FP8 (COAT).

    Per element, in float32, with ``m`` and ``v`` first dequantized and ``t`` the step (from 1)::

        m = b1 m + (1 - b1) g
        v = b2 v + (1 - b2) g g
        update = m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps)

    then ``m`` and ``v`` are re-quantized per group of ``group_size`` values, with Dynamic Range
    Expansion (``expansion=True``) or plain absmax scaling. A group is ``group_size`` consecutive
    values of a parameter's row-major flatten (of each slice along its ``stacked_axes``); where
    rows fill at least three quarters of their groups, ``group_size`` values of one row, as in
    COAT's kernel (docs/design.md, 'Groups of 128').

    Args:
      b1: decay of the first moment, in [0, 1).
      b2: decay of the second moment, in [0, 1).
      eps: added to the denominator, outside the square root (as in ``optax.adam``).
      group_size: values per quantization group (static; ``None`` means 128, COAT's size). It
        fixes the state's shapes, so with ``optax.inject_hyperparams`` pass it in ``static_args``.
      expand_min: DRE's exponent is a multiple of ``1 / expand_min``.
      expansion: Dynamic Range Expansion on (COAT) or off (per-group absmax).
      mu_format: the first moment's FP8 format, ``"e4m3"`` (COAT's default) or ``"e5m2"``.
      nu_format: the second moment's FP8 format, ``"e4m3"`` (COAT's default) or ``"e5m2"``.
      fp8_mask: which parameters get FP8 moments, in optax's ``MaskOrFn`` convention (a tree of
        bools like the parameters, or a function of the parameters returning one). ``None``:
        all of them. Masked-out ones and those FP8 would not shrink keep float32 moments.
      stacked_axes: how many leading axes of a parameter index elements that never share a
        group (static): an int, or a tree of ints like the parameters (or a function of them
        returning one); ``None`` or 0: the whole parameter. A scanned model passes 1 for its
        ``(layers, ...)`` stacks, so each layer is grouped as alone and a per-layer update of
        the stack equals the whole's. Only parameters grouped over a flatten are affected.
      implementation: ``"auto"`` (the Pallas kernel where it applies: on a GPU, with a
        power-of-two group size, on one device or with ``mesh`` given; jnp elsewhere),
        ``"xla"`` or ``"pallas"`` (on several devices without ``mesh``: concrete arrays run
        per shard of their ``NamedSharding``, and a call inside ``jit`` is refused, since XLA
        would gather sharded operands whole for the kernel).
      interpret: run the Pallas kernel in interpret mode (for CPU tests; ``"auto"`` then tries
        it too).
      mesh: the ``jax.sharding.Mesh`` the parameters are sharded over. The kernel then runs on
        each shard (``shard_map``): no gather of parameters, gradients or state. ``None``: one
        device, or (with ``"auto"``) the jnp path on several.
      partition_specs: each parameter's ``PartitionSpec`` on ``mesh``: a tree like the
        parameters, or a function of the parameters returning one; required with ``mesh``
        (the trainer's: ``pallas_kernels.sharding.fsdp_param_shardings`` with the model's
        ``is_stacked`` rule). The state may live anywhere; XLA moves what differs from these
        specs.

    Returns:
      A :class:`ScaleByCoatAdam` (an ``optax.GradientTransformation``) whose state is a
      :class:`ScaleByCoatAdamState`.

    Examples:
      >>> import jax.numpy as jnp, optax, coat_jax
      >>> tx = optax.chain(coat_jax.scale_by_coat_adam(), optax.scale(-1e-3))
      >>> params = {"w": jnp.ones((4, 256))}
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": jnp.full((4, 256), 0.5)}, state, params)

      A narrow parameter fills whole groups of its flatten; a stack of layers is grouped per
      layer with ``stacked_axes``:

      >>> tx = coat_jax.scale_by_coat_adam(stacked_axes={"w": 0, "layers": 1})
      >>> state = tx.init({"w": jnp.ones((512, 1)), "layers": jnp.ones((2, 7, 129))})
      >>> state.mu_scale["w"].shape, state.mu_scale["layers"].shape
      ((1, 4), (2, 1, 8))
    """
    _check_decay("b1", b1)
    _check_decay("b2", b2)
    if _is_concrete_number(eps) and eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if _is_concrete_number(expand_min) and expand_min <= 0:
        raise ValueError(f"expand_min must be a positive number, got {expand_min}")
    if not isinstance(expansion, bool):
        raise ValueError(f"expansion must be True or False, got {expansion!r}")
    spec = kernels.MomentSpec(
        group_size=_static_group_size(group_size),
        mu_format=_named_format("mu_format", mu_format),
        nu_format=_named_format("nu_format", nu_format),
        expansion=expansion,
    )
    check_implementation(implementation)
    if mesh is not None and not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh or None, got {mesh!r}")
    if partition_specs is not None and mesh is None:
        raise ValueError("partition_specs needs mesh=: the specs name that mesh's axes")

    def init_fn(params):
        leaves, treedef = jax.tree.flatten(params)
        views = state_codec.fp8_views(
            params, fp8_mask, stacked_axes, group_size=spec.group_size, expansion=spec.expansion
        )
        codec = dict(expansion=spec.expansion, group_size=spec.group_size, expand_min=expand_min)
        mus, nus = [], []
        for p, view in zip(leaves, views, strict=True):
            if view is not None:
                mus.append(state_codec.zero_moment(p, view, fmt=spec.mu_format, **codec))
                nus.append(state_codec.zero_moment(p, view, fmt=spec.nu_format, **codec))
            else:
                mus.append(jnp.zeros_like(p, dtype=jnp.float32))
                nus.append(jnp.zeros_like(p, dtype=jnp.float32))
        count = jnp.zeros([], jnp.int32, device=state_codec.replicated_like(leaves))
        shapes = [p.shape for p in leaves]
        return _state_from_leaves(count, treedef, mus, nus, shapes)

    def step(updates, state, params=None, decay=None, grad_scale=None, index=None):
        if grad_scale is not None and decay is None:
            raise ValueError("grad_scale is folded into the fused apply only: pass decay too")
        if index is not None and decay is None:
            raise ValueError("index applies to the fused apply only: pass decay too")
        leaves, treedef = jax.tree.flatten(updates)
        _, count, new_count = _tick(state.count, index)
        partitions = _leaf_partitions(updates, treedef, mesh, partition_specs)
        if decay is None:
            learning_rate, decays, ps = None, [None] * len(leaves), [None] * len(leaves)
        else:
            (learning_rate, decays), ps = decay, treedef.flatten_up_to(params)
        # Where each parameter's moments are stored: its shape, or its stack's with index.
        shapes = [g.shape if p is None else p.shape for g, p in zip(leaves, ps, strict=True)]
        out, mus, nus = [], [], []
        for g, p, wd, mu, nu, partition in zip(
            leaves,
            ps,
            decays,
            moments_of(state, treedef, "mu", spec.group_size),
            moments_of(state, treedef, "nu", spec.group_size),
            partitions,
            strict=True,
        ):
            if not isinstance(mu, quant.QuantizedTensor):
                if grad_scale is not None:
                    g = g.astype(jnp.float32) * grad_scale

                def float32_step(pmv, g=g, wd=wd):
                    p, mu, nu = pmv
                    m, v, u = kernels.adam_moments_and_update(
                        g, mu, nu, count=count, b1=b1, b2=b2, eps=eps
                    )
                    if p is None:
                        return u.astype(g.dtype), m, v
                    new_p = kernels.apply_update(p, u, learning_rate=learning_rate, weight_decay=wd)
                    return new_p, m, v

                # Float32 moments (small, masked-out leaves); stacked: slice, step, write back.
                new_p, m, v = (
                    float32_step((p, mu, nu))
                    if index is None
                    else stacks.step_element(float32_step, (p, mu, nu), index)
                )
                out.append(new_p)
                mus.append(m)
                nus.append(v)
                continue
            leaf_mesh, partition = _placement(g, mesh, partition, implementation)
            hyper = dict(
                count=count,
                b1=b1,
                b2=b2,
                eps=eps,
                expand_min=expand_min,
                spec=spec,
                implementation=implementation,
                interpret=interpret,
                mesh=leaf_mesh,
                partition=partition,
            )
            decayed = dict(learning_rate=learning_rate, weight_decay=wd, grad_scale=grad_scale)
            if p is None:
                u, new_mu, new_nu = kernels.coat_adam_step(g, mu, nu, **hyper)
            else:
                u, new_mu, new_nu = kernels.coat_adamw_apply(
                    p, g, mu, nu, index=index, **decayed, **hyper
                )
            out.append(u)
            mus.append(new_mu)
            nus.append(new_nu)
        return treedef.unflatten(out), _state_from_leaves(new_count, treedef, mus, nus, shapes)

    def update_fn(updates, state, params=None):
        del params
        return step(updates, state)

    return ScaleByCoatAdam(init_fn, update_fn, step)


def _leaf_partitions(updates, treedef, mesh, partition_specs) -> list:
    """Per leaf of ``updates``: its ``PartitionSpec`` on ``mesh`` (``None`` without a mesh)."""
    if mesh is None:
        return [None] * treedef.num_leaves
    if partition_specs is None:
        raise ValueError(
            "coat_adamw(mesh=...) needs partition_specs: each parameter's PartitionSpec on the "
            "mesh (a tree like the parameters, or a function of them), e.g. the specs of "
            "pallas_kernels.sharding.fsdp_param_shardings(params, mesh, is_stacked=...) with "
            "the model's layout rule"
        )
    specs = state_codec.flatten_option(
        partition_specs, updates, treedef, name="partition_specs", of="PartitionSpecs"
    )
    for s in specs:
        if not isinstance(s, PartitionSpec):
            raise ValueError(f"partition_specs holds {s!r}; every leaf must be a PartitionSpec")
    return specs


def _placement(grad, mesh, partition, implementation: str) -> tuple[Mesh | None, Any]:
    """``(mesh, PartitionSpec)`` the kernel steps one parameter under: ``mesh``'s, else (pallas on
    several devices) a concrete gradient's ``NamedSharding``; a traced one is refused, since a
    ``pallas_call`` with no partitioning rule would make XLA gather sharded operands whole."""
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


def _named_format(name: str, fmt) -> str:
    if fmt not in quant.FORMATS:
        raise ValueError(f"unknown {name} {fmt!r}; valid values are {sorted(quant.FORMATS)}")
    return fmt


def _state_from_leaves(count, treedef, mus, nus, shapes) -> ScaleByCoatAdamState:
    """The state of moments ``mus``, ``nus`` of parameters (or stacks) of ``shapes``."""

    def field(moments, i):
        return treedef.unflatten(
            [state_codec.store(m, shape)[i] for m, shape in zip(moments, shapes, strict=True)]
        )

    return ScaleByCoatAdamState(
        count,
        *(field(mus, i) for i in range(4)),
        *(field(nus, i) for i in range(4)),
    )


def moments_of(state: ScaleByCoatAdamState, treedef, prefix: str, group_size: int) -> list:
    """The moments ``prefix`` (``"mu"`` or ``"nu"``) of ``state``, one per leaf of ``treedef``:
    each a ``QuantizedTensor`` in its group view, or the float32 moment
    (``coat_jax.state_codec.load``)."""
    fields = [getattr(state, f"{prefix}_{name}") for name in ("codes", "scale", "expand", "center")]
    per_field = [treedef.flatten_up_to(f) for f in fields]
    return [state_codec.load(*parts, group_size) for parts in zip(*per_field, strict=True)]


def coat_adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    mask: Any | Callable[[optax.Params], Any] | None = None,
    *,
    group_size: int | None = None,
    expand_min: int = 16,
    expansion: bool = True,
    mu_format: str = "e4m3",
    nu_format: str = "e4m3",
    fp8_mask: Any | Callable[[optax.Params], Any] | None = None,
    stacked_axes: int | Any | Callable[[optax.Params], Any] | None = None,
    implementation: str = "auto",
    interpret: bool = False,
    mesh: Mesh | None = None,
    partition_specs: Any | Callable[[optax.Params], Any] | None = None,
) -> FusedGradientTransformation:
    r"""AdamW with FP8 moments (COAT): ``optax.adamw``'s signature and math, quantized state.

    ``chain(scale_by_coat_adam(...), add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate(learning_rate))``, so per element::

        update = m_hat / (sqrt(v_hat) + eps) + weight_decay * p
        p_new = p - learning_rate * update

    Args:
      learning_rate: a float or an optax schedule.
      b1: decay of the first moment, as in ``optax.adamw``.
      b2: decay of the second moment, as in ``optax.adamw``.
      eps: as in ``optax.adamw``, added outside the square root.
      weight_decay: decoupled weight decay (uses the parameter before this step).
      mask: which parameters weight decay applies to (optax's ``MaskOrFn``).
      group_size: see :func:`scale_by_coat_adam`.
      expand_min: see :func:`scale_by_coat_adam`.
      expansion: see :func:`scale_by_coat_adam`.
      mu_format: see :func:`scale_by_coat_adam`.
      nu_format: see :func:`scale_by_coat_adam`.
      fp8_mask: see :func:`scale_by_coat_adam`.
      stacked_axes: see :func:`scale_by_coat_adam`.
      implementation: see :func:`scale_by_coat_adam`.
      interpret: see :func:`scale_by_coat_adam`.
      mesh: see :func:`scale_by_coat_adam`.
      partition_specs: see :func:`scale_by_coat_adam`.

    Returns:
      A :class:`~coat_jax.fused_apply.FusedGradientTransformation`: an optax transformation
      whose :func:`apply_gradients` updates each parameter in the kernel's own pass (the result
      of ``update`` followed by ``optax.apply_updates``, to float32 rounding). Behind other
      transformations, chain with :func:`coat_jax.optim.chain` to keep that (``optax.chain``
      works too, without the fused apply; see :mod:`coat_jax.fused_apply`).

    Examples:
      >>> import jax, jax.numpy as jnp, optax, coat_jax
      >>> params = {"w": jnp.zeros((8, 128))}
      >>> tx = coat_jax.coat_adamw(optax.cosine_decay_schedule(1e-3, 100), weight_decay=0.1)
      >>> state = tx.init(params)
      >>> grads = {"w": jnp.ones((8, 128))}
      >>> updates, state = tx.update(grads, state, params)
      >>> params = optax.apply_updates(params, updates)
    """
    scale = scale_by_coat_adam(
        b1,
        b2,
        eps,
        group_size=group_size,
        expand_min=expand_min,
        expansion=expansion,
        mu_format=mu_format,
        nu_format=nu_format,
        fp8_mask=fp8_mask,
        stacked_axes=stacked_axes,
        implementation=implementation,
        interpret=interpret,
        mesh=mesh,
        partition_specs=partition_specs,
    )
    step = scale.step
    tx = optax.chain(
        scale,
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )

    def apply_fn(grads, state, params, grad_scale=None, index=None):
        coat_state, decay_state, lr_state = state
        if callable(learning_rate):
            # optax.scale_by_schedule: the rate at the count before this step, then count + 1.
            before, _, stored = _tick(lr_state.count, index)
            lr = learning_rate(before)
            lr_state = lr_state._replace(count=stored)
        else:
            lr = learning_rate
        leaves, treedef = jax.tree.flatten(params)
        if mask is None:
            decays = [weight_decay] * len(leaves)
        else:
            # optax's MaskOrFn: a tree like the parameters or a prefix of it, or a function (of
            # one element with an index: the parameters as tx.init saw them).
            if callable(mask):
                tree = mask(params if index is None else stacks.element(params, index))
            else:
                tree = mask
            try:
                tree = jax.tree.map(lambda m, sub: jax.tree.map(lambda _: m, sub), tree, params)
            except (ValueError, TypeError) as e:
                raise ValueError(
                    "mask must be a tree of bools like the parameters or a prefix of them (or a "
                    f"callable returning one); it does not match the parameters: {e}"
                ) from None
            flags = state_codec.flatten_option(tree, params, treedef, name="mask", of="bools")
            decays = [weight_decay if m else 0.0 for m in flags]
        new_params, coat_state = step(
            grads, coat_state, params, decay=(lr, decays), grad_scale=grad_scale, index=index
        )
        return new_params, (coat_state, decay_state, lr_state)

    def apply_at_fn(grads, state, params, index):
        return apply_fn(grads, state, params, index=index)

    return FusedGradientTransformation(tx.init, tx.update, apply_fn, apply_at_fn)


def _tick(count, index):
    """A step count's advance: ``(before, after, stored)``, where ``stored`` is ``after``, or
    with ``index`` the stacked ``count`` with its element ``index`` advanced."""
    before = count if index is None else stacks.element(count, index)
    after = optax.safe_increment(before)
    return before, after, after if index is None else stacks.put_element(count, after, index)


def find_coat_states(opt_state) -> list[ScaleByCoatAdamState]:
    """Every :class:`ScaleByCoatAdamState` inside an optimizer state (chains, wrappers, nnx)."""
    found = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, ScaleByCoatAdamState))
    return [
        jax.tree.map(state_codec.unbox, s, is_leaf=lambda x: hasattr(x, "get_value"))
        for s in found
        if isinstance(s, ScaleByCoatAdamState)
    ]


def dequantized_moments(opt_state, *, group_size: int = DEFAULT_GROUP_SIZE):
    """Reads the float32 moments ``(mu, nu)`` back from a COAT optimizer state.

    For diagnostics and tests: it materializes float32 copies of both moments.

    Args:
      opt_state: the state of ``coat_adamw`` or ``scale_by_coat_adam``, or of anything wrapping
        them (``optax.chain``, ``inject_hyperparams``, ``MultiSteps``, ``apply_if_finite``,
        ``nnx.Optimizer.opt_state``). It must hold exactly one COAT state.
      group_size: the group size the optimizer was built with.

    Returns:
      Two trees like the parameters, float32.
    """
    states = find_coat_states(opt_state)
    if len(states) != 1:
        raise ValueError(
            f"expected exactly one ScaleByCoatAdamState in opt_state, found {len(states)}"
        )
    (state,) = states
    group_size = quant.check_group_size(group_size)
    treedef = jax.tree.structure(
        state.mu_codes, is_leaf=lambda x: isinstance(x, (jax.Array, np.ndarray))
    )

    def read(prefix):
        # Each moment back in its codes' (the parameter's) shape from its group view.
        codes = treedef.flatten_up_to(getattr(state, f"{prefix}_codes"))
        moments = moments_of(state, treedef, prefix, group_size)
        return treedef.unflatten(
            [
                m.dequantize().reshape(c.shape) if isinstance(m, quant.QuantizedTensor) else m
                for m, c in zip(moments, codes, strict=True)
            ]
        )

    return read("mu"), read("nu")

"""One dispatcher for every kernel: the ``implementation`` switch and its fallback rule.

As in tokamax, a kernel raises ``NotImplementedError`` for what it cannot do (a shape, a group
size, a backend) before it emits anything, and :func:`dispatch` tries an op's implementations in
order of preference:

* ``"auto"``: Pallas, then the XLA reference if Pallas raised ``NotImplementedError``, where
  Pallas can run (on a GPU, or anywhere with ``interpret=True``) and its placement is known (one
  device, or a kernel mesh given); the XLA reference otherwise.
* ``"pallas"``: Pallas only; a ``NotImplementedError`` surfaces as a ``ValueError`` that names
  the op, the reason (shape, setting) and the fix.
* ``"xla"``: the plain-jnp reference (also the CPU path).

Why multi-device programs without a mesh stay on XLA: a ``pallas_call`` has no SPMD partitioning
rule, so on operands sharded over several devices XLA would gather them whole onto every device.
Given a mesh, the Pallas implementations run on each shard through ``shard_map``
(:mod:`pallas_kernels.sharding`); without one, ``"auto"`` keeps the XLA path, which partitions
like any jnp code, and ``"pallas"`` is the caller's business: ``coat_adamw`` takes the placement
from concrete operands' shardings and refuses traced ones, so that no operand is gathered.

A new backend (a Mosaic GPU kernel, say) is one more name in :data:`PREFERENCE`, one more keyword
at the call sites, and one more value of ``implementation``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax

IMPLEMENTATIONS = ("auto", "xla", "pallas")
# The order "auto" tries implementations in; "xla" (the reference) is always last.
PREFERENCE = ("pallas", "xla")

T = TypeVar("T")


def check_implementation(implementation: str) -> str:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"unknown implementation {implementation!r}; valid values are {list(IMPLEMENTATIONS)}"
        )
    return implementation


def require_gpu(interpret: bool) -> None:
    """Raises ``NotImplementedError`` unless a Pallas Triton kernel can run here."""
    if not interpret and jax.default_backend() != "gpu":
        raise NotImplementedError(
            "the Pallas Triton kernels run on a GPU, but the default backend is "
            f"{jax.default_backend()!r}; pass interpret=True to run them in interpret mode"
        )


def candidates(implementation: str, *, interpret: bool, mesh=None) -> tuple[str, ...]:
    """The implementations ``implementation`` stands for, in the order they are tried."""
    if check_implementation(implementation) != "auto":
        return (implementation,)
    pallas_runs = interpret or jax.default_backend() == "gpu"
    placement_known = mesh is not None or jax.device_count() == 1
    return PREFERENCE if pallas_runs and placement_known else ("xla",)


def dispatch(
    op: str,
    implementation: str,
    *,
    interpret: bool,
    mesh=None,
    **implementations: Callable[[], T],
) -> tuple[str, T]:
    """Runs the first implementation of ``op`` that applies: ``(its name, its result)``.

    Args:
      op: the op's name, for error messages.
      implementation: ``"auto"``, ``"xla"`` or ``"pallas"`` (see the module docstring).
      interpret: whether Pallas runs in interpret mode (which lets ``"auto"`` try it off a GPU).
      mesh: the kernel mesh the Pallas implementation shards over, or ``None``.
      **implementations: one zero-argument callable per name in :data:`PREFERENCE`; it raises
        ``NotImplementedError`` (before tracing anything) for inputs it cannot take.
    """
    order = candidates(implementation, interpret=interpret, mesh=mesh)
    missing = set(PREFERENCE) - set(implementations)
    if missing:
        raise TypeError(f"dispatch of {op} lacks implementations {sorted(missing)}")
    reasons = []
    for name in order:
        try:
            return name, implementations[name]()
        except NotImplementedError as e:
            if implementation != "auto":
                raise ValueError(
                    f"implementation={implementation!r} cannot run {op}: {e}. Use "
                    "implementation='auto' (which falls back to the XLA reference) or 'xla'"
                ) from e
            reasons.append(f"{name}: {e}")
    # Only reached if the reference itself declined, which it never does by design.
    raise NotImplementedError(f"no implementation of {op} applies: {'; '.join(reasons)}")


def dispatch_tiled(
    op, pallas, reference, args, settings, *, implementation, interpret, tiles, mesh
):
    """The result of :func:`dispatch` for an op whose Pallas kernel takes the reference's
    arguments plus its launch: ``pallas(*args, **settings, tiles=, interpret=, mesh=)`` or
    ``reference(*args, **settings)`` (the tiled activation ops of :mod:`pallas_kernels.fp8_act`
    and :mod:`pallas_kernels.fp8_rowquant`)."""
    return dispatch(
        op,
        implementation,
        interpret=interpret,
        mesh=mesh,
        pallas=lambda: pallas(*args, **settings, tiles=tiles, interpret=interpret, mesh=mesh),
        xla=lambda: reference(*args, **settings),
    )[1]

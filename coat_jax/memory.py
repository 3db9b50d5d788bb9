"""What backward keeps: activation memory measured from XLA's own residuals, without running.

``jax.vjp(fn, *args)`` returns a pullback whose array leaves are exactly the residuals the
backward pass will read. Traced under ``jax.eval_shape`` / ``jax.make_jaxpr`` nothing is computed,
so a full-size Llama layer can be measured on a CPU.

A residual counts as an *activation* when it depends on an activation argument (by default every
argument; name parameter arguments in ``param_argnums``). Residuals that depend only on
parameters or constants -- a weight kept for dgrad, a BF16 cast or a q|k|v concatenation of
master weights -- are weight-sized, not batch-sized, and are reported apart
(:func:`residuals` gives both).

These are the residuals as traced, before XLA optimizes the program; the compiled program's
buffers (``jax.jit(...).lower(...).compile().memory_analysis()``) are the final word on a given
backend.

Attention: XLA's CPU attention keeps the ``batch x heads x seq x seq`` probabilities, which
cuDNN's flash attention does not; wrap attention in ``jax.checkpoint`` when measuring on CPU so
the count matches what a GPU keeps (docs/design.md, 'The precision flow').
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core


@dataclasses.dataclass(frozen=True)
class Residual:
    """One array the backward pass keeps."""

    shape: tuple[int, ...]
    dtype: jnp.dtype
    is_activation: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * jnp.dtype(self.dtype).itemsize


def _depends(jaxpr, marked_invars: Sequence[bool]) -> list[bool]:
    """For each output of ``jaxpr``, whether it depends on a marked input (conservative).

    An equation's outputs depend on everything its inputs depend on, so nested calls (jit,
    custom_vjp, checkpoint) are treated as one node: exact enough for telling batch-sized
    activations from weight-derived values.
    """
    marked = {v for v, m in zip(jaxpr.invars, marked_invars, strict=True) if m}
    for eqn in jaxpr.eqns:
        if any(isinstance(v, jex_core.Var) and v in marked for v in eqn.invars):
            marked.update(eqn.outvars)
    return [isinstance(v, jex_core.Var) and v in marked for v in jaxpr.outvars]


def residuals(fn: Callable, *args, param_argnums: Sequence[int] = ()) -> list[Residual]:
    """The residuals ``jax.vjp(fn, *args)`` keeps for backward, found by tracing only.

    Args:
      fn: the function to differentiate (all of its array arguments are differentiated).
      *args: its arguments: arrays or ``jax.ShapeDtypeStruct`` trees.
      param_argnums: positions of parameter arguments; residuals that depend only on them (or on
        constants) are marked ``is_activation=False``.

    Returns:
      One :class:`Residual` per leaf of the pullback, in its order.
    """
    nargs = len(args)
    for i in param_argnums:
        if not 0 <= i < nargs:
            raise ValueError(f"param_argnums entry {i} is out of range for {nargs} arguments")

    def pullback_leaves(*a):
        _, pullback = jax.vjp(fn, *a)
        return jax.tree.leaves(pullback)

    closed = jax.make_jaxpr(pullback_leaves)(*args)
    structs = jax.eval_shape(pullback_leaves, *args)
    marks = [i not in param_argnums for i, arg in enumerate(args) for _ in jax.tree.leaves(arg)]
    deps = _depends(closed.jaxpr, marks)
    return [
        Residual(tuple(s.shape), jnp.dtype(s.dtype), d) for s, d in zip(structs, deps, strict=True)
    ]


def activation_bytes(fn: Callable, *args, param_argnums: Sequence[int] = ()) -> int:
    """Bytes of activations that backward keeps for ``fn(*args)``, from XLA's residuals.

    The residuals are the leaves of the pullback ``jax.vjp`` returns, with shapes from
    ``jax.eval_shape`` (nothing runs). Residuals that depend only on ``param_argnums`` arguments
    or constants (weights) are not activations and are left out.

    Examples:
      >>> f = lambda x: jnp.sum(jnp.sin(x))
      >>> activation_bytes(f, jax.ShapeDtypeStruct((1024,), jnp.bfloat16))  # keeps cos(x)
      2048
    """
    return sum(
        r.nbytes for r in residuals(fn, *args, param_argnums=param_argnums) if r.is_activation
    )


def activation_bytes_by_dtype(
    fn: Callable, *args, param_argnums: Sequence[int] = ()
) -> dict[str, int]:
    """:func:`activation_bytes` split by dtype name (e.g. ``{"float8_e4m3fn": ..., ...}``)."""
    out: dict[str, int] = collections.defaultdict(int)
    for r in residuals(fn, *args, param_argnums=param_argnums):
        if r.is_activation:
            out[r.dtype.name] += r.nbytes
    return dict(out)

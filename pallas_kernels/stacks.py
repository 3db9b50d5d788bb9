"""Stacks: pytrees whose leaves share a leading element axis (a scanned model's layers and their
optimizer state), read and written one element at a time.

Stepping one element of a stack by slicing it out and writing the result back is what an
implementation without an in-place form does (the XLA reference, a kernel that cannot take the
whole stacks, an optimizer without a stacked apply); these helpers are that one pattern.

Examples:
  >>> import jax.numpy as jnp
  >>> stack = {"w": jnp.zeros((3, 2))}
  >>> new = step_element(lambda t: {"w": t["w"] + 1}, stack, 1)
  >>> new["w"].tolist()
  [[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import lax


def element(tree: Any, index) -> Any:
    """Element ``index`` (an integer scalar, traced is fine) of every leaf of ``tree``."""
    return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, index, keepdims=False), tree)


def put_element(stacks: Any, values: Any, index) -> Any:
    """``stacks`` with element ``index`` of each leaf replaced by the matching leaf of
    ``values`` (same tree structure, one element's shapes)."""
    return jax.tree.map(
        lambda s, v: lax.dynamic_update_index_in_dim(s, v, index, 0), stacks, values
    )


def step_element(fn: Callable[[Any], Any], stacks: Any, index) -> Any:
    """``fn`` applied to element ``index`` of ``stacks``, its result written back: the whole
    stacks with that element replaced. ``fn`` returns a tree shaped like its argument."""
    return put_element(stacks, fn(element(stacks, index)), index)

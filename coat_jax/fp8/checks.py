"""Input checks the FP8 ops share: one error line naming the bad input and what is valid."""

from __future__ import annotations

import jax.numpy as jnp

from coat_jax import quant


def check_float(name: str, x) -> None:
    dtype = jnp.dtype(x.dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or dtype in quant.FORMATS.values():
        raise TypeError(
            f"{name} must be a float array (bfloat16, float16 or float32), got dtype {dtype}"
        )


def check_pair(op: str, a, b) -> None:
    check_float("a", a)
    check_float("b", b)
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(
            f"{op} needs inputs of one shape and dtype, got {a.shape} {a.dtype} and "
            f"{b.shape} {b.dtype}"
        )

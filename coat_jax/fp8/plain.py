"""The plain ops of the ``"bf16"`` precision: what a JAX user writes, differentiated by XLA's
autodiff, with the inputs autodiff keeps tagged as kept activations for the remat policies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from coat_jax.fp8.residuals import keep


def linear(x: jax.Array, w):
    """``x @ w`` in ``x.dtype`` (the master weight is cast to it, as ``nnx.Linear(dtype=...)``).

    A tuple ``w`` gives a tuple of outputs: one dot per weight, so autodiff keeps ``x`` once and
    no concatenated weight.
    """
    x = keep(x)
    if isinstance(w, (tuple, list)):
        return tuple(jnp.einsum("...k,kn->...n", x, wi.astype(x.dtype)) for wi in w)
    return jnp.einsum("...k,kn->...n", x, w.astype(x.dtype))


def rmsnorm(x: jax.Array, weight: jax.Array, eps: float = 1e-6) -> jax.Array:
    """Hugging Face Llama's RMSNorm: float32 statistics, output in ``x.dtype``."""
    x = keep(x)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def silu(x: jax.Array) -> jax.Array:
    return jax.nn.silu(keep(x))


def mul(a: jax.Array, b: jax.Array) -> jax.Array:
    return keep(a) * keep(b)


def add(a: jax.Array, b: jax.Array) -> jax.Array:
    return a + b

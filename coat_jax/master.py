"""Low-precision master weights: BF16 parameters updated with stochastic rounding.

With float32 master weights a parameter costs 4 bytes, its gradient 4 more (the cotangent of a
float32 leaf), and every use in a BF16 forward casts it to a BF16 copy. Keeping the parameters
themselves in BF16 halves the first two and removes the copies, but ``p + u`` rounded to nearest
loses every update below half a BF16 ULP (``|u| < 2^-9 |p|``): late in training, with a small
learning rate, most updates vanish and the weights stop moving. Stochastic rounding (SR) rounds
up with probability equal to the distance from the lower neighbour, so ``E[SR(x)] = x`` and small
updates survive on average (Zamirai et al., "Revisiting BFloat16 Training", arXiv:2010.06192;
torchao ships the same rounding for its low-bit optimizers, ``_fp32_to_bf16_sr`` in
``torchao/optim/quant_utils.py``).

* :func:`stochastic_round`: float32 -> bfloat16, unbiased.
* :func:`apply_updates_stochastic`: ``optax.apply_updates`` with BF16 leaves rounded by SR.
* :func:`float32_optimizer`: runs any optax transformation on float32 views of BF16 parameters
  and gradients, so its state and updates are float32 (``optax.adamw`` would otherwise keep BF16
  moments; ``coat_adamw`` would return BF16 updates).

A compensated (Kahan) update is not offered: its BF16 compensation buffer costs 2 bytes per
parameter, which brings BF16 weights back to the 4 bytes of float32 masters.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

_BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)


def stochastic_round(x: jax.Array, key: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    r"""Rounds float32 to bfloat16 stochastically: up with probability = distance from below.

    A float32 value's top 16 bits are its bfloat16 truncation toward zero; the low 16 bits ``L``
    say how far it is to the next bfloat16 away from zero, in units of 2^-16 ULP. Adding 16
    uniform random bits to the bit pattern and truncating therefore rounds away from zero with
    probability ``L / 2^16``, which makes the result unbiased, ``E[SR(x)] = x``, for either sign
    (also across a binade boundary and for subnormals, whose bit patterns are contiguous).
    Values already representable (``L = 0``) come back exactly.

    Values that cannot be rounded without bias keep ``x.astype(bfloat16)``'s round-to-nearest:
    NaN stays NaN, +-inf stays +-inf, and finite values beyond bfloat16's largest finite
    (3.39e38) become +-max or +-inf as they would there. A finite input inside that range never
    becomes NaN or inf.

    Args:
      x: a float32 array.
      key: a JAX PRNG key (typed or raw). The random bits follow ``jax.random.bits``, so with
        ``jax_threefry_partitionable`` (the default) they do not depend on sharding.
      dtype: the target dtype; only ``jnp.bfloat16`` (whose values are float32 truncated to its
        top 16 bits) is supported.

    Returns:
      A bfloat16 array of ``x``'s shape.

    Examples:
      >>> x = jnp.full((100_000,), 1.0 + 2.0**-8, jnp.float32)  # half a ULP above 1
      >>> float(x.astype(jnp.bfloat16)[0])  # round to nearest (even) loses it
      1.0
      >>> y = stochastic_round(x, jax.random.key(0))
      >>> round(float(y.astype(jnp.float32).mean()), 3)  # 1 + 2^-8 on average
      1.004
    """
    if jnp.dtype(dtype) != jnp.bfloat16:
        raise ValueError(
            f"stochastic_round rounds to bfloat16 only, got dtype={jnp.dtype(dtype)}; keep "
            "parameters of other dtypes in float32"
        )
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
        raise ValueError(f"x must be float32, got {x.dtype}; pass x.astype(jnp.float32)")
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    noise = jax.random.bits(key, x.shape, jnp.uint16).astype(jnp.uint32)
    top = ((bits + noise) >> 16).astype(jnp.uint16)
    rounded = jax.lax.bitcast_convert_type(top, jnp.bfloat16)
    # NaN, inf and out-of-range values: the carry could turn a NaN into inf (or -0) and a
    # finite value into inf, so they take round-to-nearest instead.
    return jnp.where(jnp.abs(x) <= _BF16_MAX, rounded, x.astype(jnp.bfloat16))


def _apply_leaf(p, u, key):
    p_dtype = jnp.asarray(p).dtype
    if p_dtype == jnp.bfloat16:
        return stochastic_round(
            jnp.asarray(p, jnp.float32) + jnp.asarray(u).astype(jnp.float32), key
        )
    if jnp.issubdtype(p_dtype, jnp.floating) and jnp.finfo(p_dtype).bits < 32:
        raise ValueError(
            f"a {p_dtype} parameter cannot take stochastically rounded updates (only bfloat16 "
            "can); keep it in bfloat16 or float32"
        )
    return jnp.asarray(p + u).astype(p_dtype)


def apply_updates_stochastic(params: optax.Params, updates: optax.Updates, key: jax.Array):
    r"""``optax.apply_updates`` with stochastic rounding for bfloat16 parameters.

    Per leaf: a bfloat16 ``p`` becomes ``stochastic_round(float32(p) + float32(u))``; float32
    (and other wider) leaves get ``optax.apply_updates``'s ``(p + u).astype(p.dtype)``. Leaf
    ``i`` (in ``jax.tree.flatten`` order) draws its bits from ``jax.random.fold_in(key, i)``,
    so the result depends only on the key and the tree, not on how leaves are sharded.

    Args:
      params: the parameters (bfloat16 and/or float32 leaves).
      updates: updates with the parameters' structure, in any float dtype (float32 from
        :func:`float32_optimizer` keeps the full update until the single rounding).
      key: a PRNG key; pass a fresh one every step, e.g. ``jax.random.fold_in(base, step)``.

    Returns:
      The new parameters, each in its old dtype.

    Raises:
      ValueError: for float16 or FP8 parameters, which this rounding does not cover.

    Examples:
      >>> params = {"w": jnp.ones((4, 4), jnp.bfloat16)}
      >>> updates = {"w": jnp.full((4, 4), -1e-4)}  # 1/78 of a bfloat16 ULP at 1.0
      >>> new = apply_updates_stochastic(params, updates, jax.random.key(0))
    """
    leaves, treedef = jax.tree.flatten(params)
    try:
        update_leaves = treedef.flatten_up_to(updates)
    except (ValueError, TypeError) as e:
        raise ValueError(f"updates must have the parameters' tree structure: {e}") from None
    new = [
        _apply_leaf(p, u, jax.random.fold_in(key, i))
        for i, (p, u) in enumerate(zip(leaves, update_leaves, strict=True))
    ]
    return treedef.unflatten(new)


def _upcast(tree):
    def leaf(x):
        dtype = jnp.dtype(x.dtype)
        if not (jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=x.sharding)
        return x.astype(jnp.float32)

    return jax.tree.map(leaf, tree)


def float32_optimizer(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    r"""Runs ``inner`` in float32 for low-precision (bfloat16) parameters.

    ``init`` sees the parameters and ``update`` the gradients and parameters cast to float32,
    so the state ``inner`` builds and the updates it returns are float32 whatever the
    parameters' dtype. Without it, ``optax.adamw`` on bfloat16 parameters keeps bfloat16 moments
    (its ``nu`` follows the parameters' dtype even with ``mu_dtype=float32``; a ``b2 = 0.999``
    decay is below half a bfloat16 ULP, so ``nu`` rounds back to itself), and ``coat_adamw``
    returns updates in the gradients' dtype. Apply the float32 updates with
    :func:`apply_updates_stochastic`. The casts are elementwise and fuse into the optimizer's
    own elementwise work under ``jit``; a Pallas optimizer kernel reads a float32 copy of one
    gradient leaf at a time.

    Args:
      inner: any optax transformation (e.g. ``coat_jax.coat_adamw(...)``, ``optax.adamw(...)``,
        or a chain with gradient clipping, so the clipping norm is float32 too).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with ``inner``'s state.

    Examples:
      >>> import coat_jax
      >>> params = {"w": jnp.zeros((8, 128), jnp.bfloat16)}
      >>> tx = float32_optimizer(coat_jax.coat_adamw(1e-3))
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": jnp.ones((8, 128), jnp.bfloat16)}, state, params)
      >>> params = apply_updates_stochastic(params, updates, jax.random.key(0))
    """
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return inner.init(_upcast(params))

    def update_fn(updates, state, params=None, **extra_args: Any):
        params = None if params is None else _upcast(params)
        return inner.update(_upcast(updates), state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)

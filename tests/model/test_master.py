"""BF16 master weights: stochastic rounding, its optax update, and the float32 optimizer view."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import coat_jax
from coat_jax.master import apply_updates_stochastic, float32_optimizer, stochastic_round

# One compile per shape instead of one per eager op.
_sr = jax.jit(stochastic_round)


def _bf16_neighbours(lo_bf16: np.ndarray):
    """(lo, next bfloat16 away from zero) as float64, for nonnegative or negative lo."""
    lo = np.asarray(lo_bf16, dtype=jnp.bfloat16)
    hi = (lo.view(np.uint16) + 1).view(jnp.bfloat16)
    return lo.astype(np.float64), hi.astype(np.float64)


def _from_bits(bits):
    return np.asarray(bits, np.uint32).view(np.float32)


def test_mean_of_many_draws_is_the_value():
    # Values between two bfloat16 neighbours: normal, negative, huge, tiny, subnormal, and
    # just below a power of two (rounding up crosses into the next binade).
    lo = np.array([1.0, -3.0, 6e37, -1e-30, 1e-39, 1.9921875, 2.0**-126], jnp.bfloat16)
    lo64, hi64 = _bf16_neighbours(lo)
    frac = np.array([0.1, 0.25, 0.5, 0.9, 0.7, 0.999, 0.3])
    x = (lo64 + frac * (hi64 - lo64)).astype(np.float32)
    n = 20_000
    draws = _sr(jnp.broadcast_to(x[:, None], (len(x), n)), jax.random.key(0))
    d = np.asarray(draws.astype(jnp.float32), np.float64)
    assert np.all((d == lo64[:, None]) | (d == hi64[:, None]))  # only the two neighbours
    ulp = np.abs(hi64 - lo64)
    p = (np.asarray(x, np.float64) - lo64) / (hi64 - lo64)  # exact fraction after f32 rounding
    std_of_mean = ulp * np.sqrt(p * (1 - p) / n)
    np.testing.assert_array_less(np.abs(d.mean(axis=1) - x), 5 * std_of_mean)


def test_representable_values_come_back_exactly():
    special = [0.0, -0.0, 1.0, -1.0, 2.0**-133, -(2.0**-126), 3.3895e38, -3.3895e38, 448.0]
    rand = jax.random.normal(jax.random.key(1), (4096,)) * jnp.exp(
        jax.random.uniform(jax.random.key(2), (4096,), minval=-80, maxval=80)
    )
    x_bf16 = jnp.concatenate([jnp.array(special, jnp.bfloat16), rand.astype(jnp.bfloat16)])
    out = _sr(x_bf16.astype(jnp.float32), jax.random.key(3))
    np.testing.assert_array_equal(
        np.asarray(out).view(np.uint16), np.asarray(x_bf16).view(np.uint16)
    )  # bitwise: -0.0 stays -0.0


def test_finite_inputs_never_give_nan_and_in_range_never_inf():
    bits = np.random.default_rng(4).integers(0, 2**32, 200_000, dtype=np.uint32)
    x = _from_bits(bits)
    x = jnp.asarray(np.where(np.isfinite(x), x, np.float32(1.0)))
    out = _sr(x, jax.random.key(5)).astype(jnp.float32)
    assert not bool(jnp.any(jnp.isnan(out)))
    in_range = jnp.abs(x) <= float(jnp.finfo(jnp.bfloat16).max)
    assert bool(jnp.all(jnp.isfinite(out) | ~in_range))
    # Beyond bfloat16's largest finite, round to nearest decides (max or inf), as astype does.
    big = jnp.array(
        [_from_bits(0x7F7FFFFF), -_from_bits(0x7F7FFFFF), _from_bits(0x7F7F7000)], jnp.float32
    )
    for seed in range(4):
        np.testing.assert_array_equal(
            np.asarray(_sr(big, jax.random.key(seed))),
            np.asarray(big.astype(jnp.bfloat16)),
        )


def test_nan_and_inf_pass_through():
    # NaNs whose payload sits in the low 16 bits would truncate to inf; the top one would carry
    # into the sign bit.
    nans = _from_bits([0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000])
    out = _sr(jnp.asarray(nans), jax.random.key(6))
    assert bool(jnp.all(jnp.isnan(out)))
    infs = jnp.array([jnp.inf, -jnp.inf], jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(_sr(infs, jax.random.key(7)), np.float32), [np.inf, -np.inf]
    )


def test_sign_is_symmetric():
    x = jax.random.normal(jax.random.key(8), (10_000,)) * 10.0
    key = jax.random.key(9)
    pos, neg = _sr(x, key), _sr(-x, key)
    np.testing.assert_array_equal(np.asarray(neg), np.asarray(-pos))  # magnitude rounds alike
    assert bool(jnp.all(jnp.signbit(pos) == jnp.signbit(x)))


def test_key_decides_the_draws():
    x = jnp.full((1000,), 1.0 + 2.0**-9, jnp.float32)
    a, b = _sr(x, jax.random.key(10)), _sr(x, jax.random.key(10))
    c = _sr(x, jax.random.key(11))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert bool(jnp.any(a != c))
    raw = _sr(x, jax.random.PRNGKey(10))  # raw uint32 keys work too
    assert raw.dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "x, dtype, match",
    [
        (jnp.ones(3, jnp.bfloat16), jnp.bfloat16, "x must be float32"),
        (jnp.ones(3, jnp.float32), jnp.float16, "rounds to bfloat16 only"),
    ],
)
def test_stochastic_round_rejects_what_it_cannot_do(x, dtype, match):
    with pytest.raises(ValueError, match=match):
        stochastic_round(x, jax.random.key(0), dtype)


def test_apply_updates_stochastic_per_leaf():
    params = {
        "a": jnp.ones((512,), jnp.bfloat16),
        "b": jnp.ones((512,), jnp.bfloat16),
        "f": jnp.linspace(0, 1, 512, dtype=jnp.float32),
        "step": jnp.array(3, jnp.int32),
    }
    u = jnp.full((512,), 2.0**-9, jnp.float32)  # a quarter ULP at 1.0
    updates = {"a": u, "b": u, "f": u, "step": jnp.array(1, jnp.int32)}
    key = jax.random.key(12)
    new = jax.jit(apply_updates_stochastic)(params, updates, key)
    assert jax.tree.map(lambda x: x.dtype, new) == jax.tree.map(lambda x: x.dtype, params)
    plain = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(np.asarray(new["f"]), np.asarray(plain["f"]))
    assert int(new["step"]) == 4
    for name in ("a", "b"):
        v = np.asarray(new[name], np.float32)
        assert set(np.unique(v)) <= {1.0, 1.0078125}
        assert 0.15 < (v > 1).mean() < 0.35  # rounded up about a quarter of the time
    assert bool(jnp.any(new["a"] != new["b"]))  # one key per leaf
    again = apply_updates_stochastic(params, updates, key)
    assert jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.all(x == y)), new, again))


def test_apply_updates_stochastic_rejects_float16_and_mismatched_trees():
    with pytest.raises(ValueError, match="keep it in bfloat16 or float32"):
        apply_updates_stochastic(
            {"w": jnp.ones(4, jnp.float16)}, {"w": jnp.ones(4)}, jax.random.key(0)
        )
    with pytest.raises(ValueError, match="the parameters' tree structure"):
        apply_updates_stochastic({"w": jnp.ones(4)}, {"v": jnp.ones(4)}, jax.random.key(0))


def _optimizers():
    return {
        "coat_adamw": lambda lr: coat_jax.coat_adamw(lr, weight_decay=0.0),
        "optax_adamw": lambda lr: optax.adamw(lr, weight_decay=0.0),
    }


@pytest.mark.parametrize("name", sorted(_optimizers()))
def test_float32_optimizer_state_and_updates_are_float32_and_stable(name):
    params = {"w": jnp.ones((4, 256), jnp.bfloat16), "norm": jnp.ones((256,), jnp.bfloat16)}
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
    tx = float32_optimizer(optax.chain(optax.clip_by_global_norm(1.0), _optimizers()[name](1e-3)))
    state = tx.init(params)
    updates, new_state = jax.jit(tx.update)(grads, state, params)
    assert all(u.dtype == jnp.float32 for u in jax.tree.leaves(updates))
    dtypes = lambda s: [x.dtype for x in jax.tree.leaves(s)]
    assert dtypes(new_state) == dtypes(state)  # no dtype drift between steps
    assert jnp.dtype(jnp.bfloat16) not in dtypes(state)  # moments are not bf16
    abstract = jax.eval_shape(
        tx.init, jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
    )
    assert dtypes(abstract) == dtypes(state)


@pytest.mark.parametrize("name", sorted(_optimizers()))
def test_bf16_with_stochastic_rounding_tracks_float32_masters(name):
    """The classic failure: Adam steps of 1e-4 on weights near 1 are below half a bf16 ULP."""
    n, steps, lr = 2048, 150, 1e-4
    k1, k2 = jax.random.split(jax.random.key(13))
    target = (1.0 + jax.random.uniform(k1, (n,))).astype(jnp.bfloat16).astype(jnp.float32)
    # 0.03 away, a distance 150 steps of at most lr do not cover: every weight keeps moving.
    start = target + 0.03 * jnp.sign(jax.random.normal(k2, (n,)))
    start = start.astype(jnp.bfloat16).astype(jnp.float32)  # the same start for all three
    loss = lambda p: 0.5 * jnp.sum((p["w"].astype(jnp.float32) - target) ** 2)
    tx = float32_optimizer(_optimizers()[name](lr))

    def run(params, apply):
        def step(carry, i):
            params, state = carry
            grads = jax.grad(loss)(params)
            updates, state = tx.update(grads, state, params)
            return (apply(params, updates, i), state), None

        (params, _), _ = jax.lax.scan(step, (params, tx.init(params)), jnp.arange(steps))
        return params["w"].astype(jnp.float32)

    base = jax.random.key(14)
    rtn = lambda p, u, i: optax.apply_updates(p, u)
    sr = lambda p, u, i: apply_updates_stochastic(p, u, jax.random.fold_in(base, i))
    f32 = jax.jit(lambda p: run(p, rtn))({"w": start})
    bf16_rtn = jax.jit(lambda p: run(p, rtn))({"w": start.astype(jnp.bfloat16)})
    bf16_sr = jax.jit(lambda p: run(p, sr))({"w": start.astype(jnp.bfloat16)})
    # Progress along the way to the target: SR's rounding noise averages out over the weights,
    # round to nearest makes none.
    toward = jnp.sign(target - start)
    progress = lambda w: float(((w - start) * toward).mean())
    assert progress(f32) > 0.01  # float32 masters moved about lr * steps = 0.015
    assert progress(bf16_rtn) == 0.0  # every update was below half a ULP (2^-8 at [1, 2))
    assert abs(progress(bf16_sr) - progress(f32)) < 0.1 * progress(f32)

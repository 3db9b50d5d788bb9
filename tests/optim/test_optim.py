"""coat_adamw / scale_by_coat_adam: numerics against the float64 SPEC rendering, and composition."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import coat_jax
from coat_jax import quant
from tests import spec_reference as ref

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _grads(key, params, scale=1.0):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    return treedef.unflatten(
        [scale * jax.random.normal(k, p.shape, p.dtype) for k, p in zip(keys, leaves, strict=True)]
    )


def _all_leaves(state):
    return [x for x in jax.tree.leaves(state) if hasattr(x, "dtype")]


# --- storage -------------------------------------------------------------------------------


# Both formats and both expansion settings; they are independent options of the storage.
@pytest.mark.parametrize("nu_format,expansion", [("e4m3", True), ("e5m2", False)])
def test_moments_are_stored_in_8_bits(nu_format, expansion):
    params = {"w": jnp.zeros((8, 256)), "b": jnp.zeros((300,)), "k": jnp.zeros((2, 3, 130))}
    # Groups of 128 along a last axis that 128 divides, else over the flatten: 780 values of k.
    stat_shapes = {"w": (8, 2), "b": (3,), "k": (1, 1, 7)}
    tx = coat_jax.coat_adamw(1e-3, nu_format=nu_format, expansion=expansion)
    state = tx.init(params)
    update = jax.jit(tx.update)
    params2 = optax.apply_updates(
        params, update(_grads(jax.random.key(0), params), state, params)[0]
    )
    for s in (state, update(_grads(jax.random.key(1), params2), state, params2)[1]):
        (cs,) = coat_jax.find_coat_states(s)
        for name in ("mu_codes", "nu_codes"):
            for leaf in jax.tree.leaves(getattr(cs, name)):
                assert jnp.dtype(leaf.dtype).itemsize == 1, (name, leaf.dtype)
                assert jnp.issubdtype(leaf.dtype, jnp.floating)
        assert jax.tree.leaves(cs.nu_codes)[0].dtype == quant.FORMATS[nu_format]
        for name in ("mu_scale", "nu_scale"):
            for k, st in getattr(cs, name).items():
                assert st.dtype == jnp.float32
                assert st.shape == stat_shapes[k]
        # Without expansion no exponent or centre is stored at all.
        assert bool(jax.tree.leaves(cs.mu_expand)) == expansion


def test_state_bytes_per_parameter_4096x4096():
    param = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    state = jax.eval_shape(coat_jax.coat_adamw(1e-3).init, {"w": param})
    per_param = quant.state_bytes(state) / (4096 * 4096)
    adam = quant.state_bytes(jax.eval_shape(optax.adamw(1e-3).init, {"w": param})) / 4096**2
    print(f"\ncoat_adamw state: {per_param:.4f} bytes/parameter (optax.adamw: {adam:.4f})")
    assert per_param <= 2.25
    assert adam == pytest.approx(8.0, abs=1e-3)


def test_scalars_and_masked_leaves_keep_float32():
    params = {"scale": jnp.float32(1.0), "norm": jnp.ones((256,)), "w": jnp.ones((4, 256))}
    tx = coat_jax.scale_by_coat_adam(fp8_mask={"scale": True, "norm": False, "w": True})
    state = tx.init(params)
    assert state.mu_codes["scale"].dtype == jnp.float32
    assert state.mu_codes["norm"].dtype == jnp.float32
    assert isinstance(state.mu_scale["norm"], optax.MaskedNode)
    assert state.mu_codes["w"].dtype == jnp.float8_e4m3fn
    # The full-precision leaves run plain Adam: compare with optax.scale_by_adam.
    g = _grads(jax.random.key(2), params)
    u, state = tx.update(g, state)
    u_ref, _ = optax.scale_by_adam().update(g, optax.scale_by_adam().init(params))
    np.testing.assert_allclose(u["norm"], u_ref["norm"], rtol=1e-6)
    np.testing.assert_allclose(u["scale"], u_ref["scale"], rtol=1e-6)


def test_fp8_mask_callable_and_mismatch():
    params = {"a": jnp.ones((2, 128)), "b": jnp.ones((128,))}
    tx = coat_jax.scale_by_coat_adam(fp8_mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
    state = tx.init(params)
    assert state.mu_codes["a"].dtype == jnp.float8_e4m3fn
    assert state.mu_codes["b"].dtype == jnp.float32
    with pytest.raises(ValueError, match="fp8_mask"):
        coat_jax.scale_by_coat_adam(fp8_mask={"a": True}).init(params)


# --- numerics against SPEC section 2 -------------------------------------------------------


@pytest.mark.parametrize(
    "shape,view,kw",
    [
        ((4, 384), (4, 384), {}),
        ((3, 200), (3, 200), {"nu_format": "e5m2"}),
        # Rows that fill less than three quarters of their groups: groups over the flatten (the
        # oracle groups the documented view along its last axis).
        ((3, 80), (1, 240), {}),
        ((2, 256), (2, 256), {"expansion": False}),
        ((130,), (130,), {"expand_min": 8}),
    ],
)
def test_trajectory_matches_float64_spec(shape, view, kw):
    steps, lr, wd = 30, 1e-2, 0.1
    rng = np.random.default_rng(0)
    p0 = rng.standard_normal(shape).astype(np.float32)
    # Gradients spanning several decades per row, as real ones do.
    grads = [
        (rng.standard_normal(shape) * np.exp(rng.uniform(-6, 1, shape))).astype(np.float32)
        for _ in range(steps)
    ]
    tx = coat_jax.coat_adamw(lr, weight_decay=wd, implementation="xla", **kw)
    spec = ref.CoatAdamW(view, lr=lr, wd=wd, **{k: v for k, v in kw.items()})

    @jax.jit
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    p, state = jnp.asarray(p0), jax.jit(tx.init)(jnp.asarray(p0))
    p_ref = p0.astype(np.float64)
    for g in grads:
        p, state = step(p, state, jnp.asarray(g))
        p_ref = spec.step(p_ref.reshape(view), g.astype(np.float64).reshape(view)).reshape(shape)
    moved = np.abs(p_ref - p0)
    err = np.abs(np.asarray(p, np.float64) - p_ref)
    # float32 against float64: a code on a rounding boundary may flip, changing one element's
    # moment by one FP8 step; everything else agrees to float32 rounding.
    assert np.median(err / moved) < 1e-5, np.median(err / moved)
    assert np.quantile(err / moved, 0.99) < 5e-3
    assert err.max() < 0.02 * lr * steps
    mu, nu = coat_jax.dequantized_moments(state)
    m_ref = ref.dequantize(*spec.mu, gs=128).reshape(shape)
    np.testing.assert_allclose(np.asarray(mu), m_ref, rtol=0.15, atol=1e-6)


def test_one_step_codes_and_stats_match_spec():
    rng = np.random.default_rng(3)
    shape = (16, 512)
    p = jnp.zeros(shape)
    tx = coat_jax.scale_by_coat_adam(implementation="xla")
    state = jax.jit(tx.init)(p)
    update, moments = jax.jit(tx.update), jax.jit(coat_jax.dequantized_moments)
    for _ in range(5):
        g = rng.standard_normal(shape) * np.exp(rng.uniform(-8, 0, shape))
        prev_mu, _ = moments(state)
        _, state = update(jnp.asarray(g, jnp.float32), state)
    # Re-do the last step in float64 from the dequantized previous state.
    m = 0.9 * np.asarray(prev_mu, np.float64) + 0.1 * g.astype(np.float32)
    codes, stats = ref.quantize(m, gs=128, fmt="e4m3", expand_min=16, expansion=True)
    np.testing.assert_array_equal(np.asarray(state.mu_expand), stats["expand"])
    np.testing.assert_allclose(np.asarray(state.mu_center), stats["center"], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(state.mu_scale), stats["scale"], rtol=5e-4)
    same = np.asarray(state.mu_codes.astype(jnp.float32)) == codes
    assert same.mean() > 0.995, same.mean()


def test_first_step_equals_optax_adamw_up_to_quantization():
    # Before any quantization error enters (zero moments are exact), step 1 is optax.adamw's.
    params = {"w": jax.random.normal(jax.random.key(0), (4, 256))}
    g = _grads(jax.random.key(1), params)
    ours, _ = coat_jax.coat_adamw(1e-2, weight_decay=0.1).update(
        g, coat_jax.coat_adamw(1e-2, weight_decay=0.1).init(params), params
    )
    theirs, _ = optax.adamw(1e-2, weight_decay=0.1).update(
        g, optax.adamw(1e-2, weight_decay=0.1).init(params), params
    )
    np.testing.assert_allclose(ours["w"], theirs["w"], rtol=1e-5)


def _fit(tx, loss_fn, params, data_fn, steps):
    state = jax.jit(tx.init)(params)

    @jax.jit
    def step(params, state, i):
        batch = data_fn(i)
        loss, g = jax.value_and_grad(loss_fn)(params, batch)
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), state, loss

    losses = []
    for i in range(steps):
        params, state, loss = step(params, state, i)
        losses.append(float(loss))
    return params, losses


def test_tracks_optax_adamw_on_regression():
    w_true = jax.random.normal(jax.random.key(0), (64, 128))

    def data(i):
        x = jax.random.normal(jax.random.fold_in(jax.random.key(1), i), (32, 64))
        return x, x @ w_true

    def loss_fn(p, batch):
        x, y = batch
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    params = {"w": jnp.zeros((64, 128)), "b": jnp.zeros((128,))}
    _, ours = _fit(coat_jax.coat_adamw(3e-2, weight_decay=0.0), loss_fn, params, data, 300)
    _, theirs = _fit(optax.adamw(3e-2, weight_decay=0.0), loss_fn, params, data, 300)
    print(
        f"\nregression final loss: coat {np.mean(ours[-20:]):.5f} optax {np.mean(theirs[-20:]):.5f}"
        f" (start {ours[0]:.2f})"
    )
    assert ours[-1] < ours[0] / 100
    assert np.mean(ours[-20:]) <= np.mean(theirs[-20:]) * 1.05 + 1e-4


def test_tracks_optax_adamw_on_mlp():
    key = jax.random.key(0)
    k1, k2, k3 = jax.random.split(key, 3)
    teacher = jax.random.normal(k1, (32, 10))

    def data(i):
        x = jax.random.normal(jax.random.fold_in(k3, i), (64, 32))
        return x, jnp.argmax(jnp.tanh(x) @ teacher, axis=-1)

    def loss_fn(p, batch):
        x, y = batch
        h = jax.nn.gelu(x @ p["w1"] + p["b1"])
        logits = h @ p["w2"] + p["b2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    params = {
        "w1": jax.random.normal(k2, (32, 256)) / np.sqrt(32),
        "b1": jnp.zeros((256,)),
        "w2": jax.random.normal(jax.random.fold_in(k2, 1), (256, 10)) / 16,
        "b2": jnp.zeros((10,)),
    }
    _, ours = _fit(coat_jax.coat_adamw(3e-3), loss_fn, params, data, 400)
    _, theirs = _fit(optax.adamw(3e-3, weight_decay=1e-4), loss_fn, params, data, 400)
    final_ours, final_theirs = np.mean(ours[-50:]), np.mean(theirs[-50:])
    print(f"\nMLP final loss: coat {final_ours:.4f} optax {final_theirs:.4f} (start {ours[0]:.3f})")
    assert final_ours < ours[0] / 3
    assert final_ours <= final_theirs * 1.05


# --- composition ---------------------------------------------------------------------------


def _params():
    return {"w": jax.random.normal(jax.random.key(0), (8, 256)), "b": jnp.zeros((128,))}


def _run(tx, steps=3, params=None, jit=True):
    params = _params() if params is None else params
    state = tx.init(params)
    update = jax.jit(tx.update) if jit else tx.update
    for i in range(steps):
        u, state = update(_grads(jax.random.key(10 + i), params), state, params)
        params = optax.apply_updates(params, u)
    return params, state


def test_state_dtypes_and_structure_unchanged_by_update():
    params = _params()
    tx = coat_jax.coat_adamw(1e-3)
    s0 = tx.init(params)
    s1 = jax.jit(tx.update)(_grads(jax.random.key(0), params), s0, params)[1]
    assert jax.tree.structure(s0) == jax.tree.structure(s1)
    for a, b in zip(_all_leaves(s0), _all_leaves(s1), strict=True):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)


def test_jit_equals_eager():
    p_jit, _ = _run(coat_jax.coat_adamw(1e-2), jit=True)
    p_eager, _ = _run(coat_jax.coat_adamw(1e-2), jit=False)
    for a, b in zip(jax.tree.leaves(p_jit), jax.tree.leaves(p_eager), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_init_on_shape_dtype_struct():
    shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), _params())
    abstract = jax.eval_shape(coat_jax.coat_adamw(1e-3).init, shapes)
    concrete = coat_jax.coat_adamw(1e-3).init(_params())
    assert jax.tree.structure(abstract) == jax.tree.structure(concrete)
    for a, b in zip(_all_leaves(abstract), _all_leaves(concrete), strict=True):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)


def test_inject_hyperparams_and_schedule():
    # A schedule as the learning rate, directly and through inject (with two numeric
    # hyper-parameters injected beside it): the two ways give the same parameters.
    sched = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
    direct, _ = _run(coat_jax.coat_adamw(sched, b1=0.8, b2=0.99, weight_decay=0.05))
    injected_tx = optax.inject_hyperparams(coat_jax.coat_adamw)(
        learning_rate=sched, b1=0.8, b2=0.99, weight_decay=0.05
    )
    injected, state = _run(injected_tx)
    # Injected hyper-parameters are float32 arrays instead of Python floats: rounding differs.
    for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(injected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # The state keeps the values the last update used: the schedule at count 2, its peak.
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(float(sched(2)))
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(1e-2)
    # group_size is structural: passing it through inject needs static_args.
    _run(
        optax.inject_hyperparams(coat_jax.coat_adamw, static_args=("group_size",))(
            learning_rate=1e-2, group_size=64
        )
    )
    with pytest.raises(ValueError, match="static_args"):
        _run(optax.inject_hyperparams(coat_jax.coat_adamw)(learning_rate=1e-2, group_size=64))


def test_multisteps_accumulates():
    params = _params()
    tx = optax.MultiSteps(coat_jax.coat_adamw(1e-2), every_k_schedule=3)
    state = tx.init(params)
    update = jax.jit(tx.update)
    seen = []
    for i in range(6):
        u, state = update(_grads(jax.random.key(i), params), state, params)
        seen.append(float(jnp.abs(u["w"]).max()))
        params = optax.apply_updates(params, u)
    assert seen[0] == seen[1] == 0.0 and seen[2] > 0.0
    assert seen[3] == seen[4] == 0.0 and seen[5] > 0.0
    (cs,) = coat_jax.find_coat_states(state)
    assert int(cs.count) == 2


def test_apply_if_finite_skips_bad_steps_and_state_stays_finite():
    params = _params()
    tx = optax.apply_if_finite(coat_jax.coat_adamw(1e-2), max_consecutive_errors=5)
    state = tx.init(params)
    state = jax.jit(tx.update)(_grads(jax.random.key(0), params), state, params)[1]
    before = jax.tree.map(np.asarray, state.inner_state)
    for bad in (jnp.nan, jnp.inf, -jnp.inf):
        g = _grads(jax.random.key(1), params)
        g["w"] = g["w"].at[3, 7].set(bad)
        u, state = jax.jit(tx.update)(g, state, params)
        assert all(bool(jnp.all(x == 0)) for x in jax.tree.leaves(u))
        for leaf in _all_leaves(state.inner_state):
            assert bool(jnp.all(jnp.isfinite(leaf.astype(jnp.float32))))
    after = jax.tree.map(np.asarray, state.inner_state)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a.astype(np.float32), b.astype(np.float32))
    assert int(state.notfinite_count) == 3


@functools.cache
def _edge_case_tx():
    """The edge cases' optimizer and its jitted update: the cases share one compiled step."""
    tx = coat_jax.coat_adamw(1e-3)
    return tx, jax.jit(tx.update)


@pytest.mark.parametrize(
    "grad_fn",
    [
        lambda s: jnp.zeros(s),
        lambda s: jnp.full(s, 1e-30),
        lambda s: jnp.full(s, 1e-42),
        lambda s: jnp.full(s, 1e15),
        lambda s: jnp.zeros(s).at[..., 5].set(2.0),
        lambda s: jnp.where(jnp.arange(s[-1]) % 2 == 0, 1e-20, 1e12) * jnp.ones(s),
    ],
    ids=["zeros", "tiny", "denormal", "huge", "single_value", "wide"],
)
def test_edge_case_gradients_keep_state_finite(grad_fn):
    params = {"w": jnp.ones((4, 256)), "v": jnp.ones((300,))}
    tx, update = _edge_case_tx()
    state = tx.init(params)
    for _ in range(3):
        g = jax.tree.map(lambda p: grad_fn(p.shape).astype(jnp.float32), params)
        u, state = update(g, state, params)
        for leaf in _all_leaves(state) + jax.tree.leaves(u):
            assert bool(jnp.all(jnp.isfinite(leaf.astype(jnp.float32))))


def test_weight_decay_mask():
    params = {"w": jnp.ones((2, 128)), "norm": jnp.ones((128,))}
    tx = coat_jax.coat_adamw(1.0, weight_decay=0.5, mask={"w": True, "norm": False})
    zero_g = jax.tree.map(jnp.zeros_like, params)
    u, _ = tx.update(zero_g, tx.init(params), params)
    np.testing.assert_allclose(u["w"], -0.5 * jnp.ones((2, 128)))
    np.testing.assert_allclose(u["norm"], jnp.zeros((128,)))


def test_bf16_params_and_grads():
    params = {"w": jnp.ones((4, 256), jnp.bfloat16)}
    p, state = _run(coat_jax.coat_adamw(1e-2), params=params)
    assert p["w"].dtype == jnp.bfloat16
    assert state[0].mu_codes["w"].dtype == jnp.float8_e4m3fn


def test_nnx_optimizer():
    model = nnx.Linear(128, 256, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, coat_jax.coat_adamw(1e-2), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(0), (16, 128))

    @nnx.jit
    def train_step(model, opt):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        opt.update(model, grads)
        return loss

    losses = [float(train_step(model, opt)) for _ in range(20)]
    assert losses[-1] < losses[0] / 2
    mu, _ = coat_jax.dequantized_moments(opt.opt_state)
    assert jax.tree.leaves(mu)[0].dtype == jnp.float32


# --- bad options ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"b1": 1.0}, "b1"),
        ({"b1": -0.1}, "b1"),
        ({"b2": 1.5}, "b2"),
        ({"eps": -1.0}, "eps"),
        ({"group_size": 0}, "group_size"),
        ({"group_size": -128}, "group_size"),
        ({"group_size": 12.5}, "group_size"),
        ({"mu_format": "e3m4"}, "mu_format.*e4m3"),
        ({"nu_format": "int8"}, "nu_format.*e5m2"),
        ({"expand_min": 0}, "expand_min"),
        ({"implementation": "cuda"}, "implementation.*pallas"),
        ({"expansion": "yes"}, "expansion"),
    ],
)
def test_bad_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        coat_jax.coat_adamw(1e-3, **kwargs)
    with pytest.raises(ValueError, match=match):
        coat_jax.scale_by_coat_adam(**kwargs)


def test_dequantized_moments_needs_one_coat_state():
    with pytest.raises(ValueError, match="exactly one"):
        coat_jax.dequantized_moments(optax.adam(1e-3).init({"w": jnp.ones(3)}))


def test_a_mesh_needs_the_callers_partition_specs():
    """The optimizer knows no model's parameter layout: on a mesh, its caller names each
    parameter's spec (the trainer: fsdp_param_shardings with the model's is_stacked rule)."""
    mesh = jax.make_mesh((1, 1), ("data", "fsdp"))
    tx = coat_jax.coat_adamw(1e-3, implementation="xla", mesh=mesh)
    params = {"w": jnp.ones((8, 128))}
    with pytest.raises(ValueError, match="needs partition_specs"):
        tx.update(params, tx.init(params), params)

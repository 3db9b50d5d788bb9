"""fp8_state: FP8 storage for any optax optimizer, against coat_adamw, the float64 SPEC codecs
and the plain optimizers, and through optax's and the trainer's compositions."""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from optax import contrib

import coat_jax
from coat_jax import quant
from coat_jax.fp8_wrapper import FP8State, dequantized_state, full_precision_paths, quantized_paths
from pallas_kernels import coat_adam as kernels
from tests import spec_reference as ref

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

INNERS = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "lion": lambda: optax.lion(1e-3, weight_decay=0.1),
    "sgd": lambda: optax.sgd(1e-2, momentum=0.9),
    "adafactor": lambda: optax.adafactor(1e-2),
    "muon": lambda: contrib.muon(1e-2),
}


def _params():
    return {
        "w": jax.random.normal(jax.random.key(0), (8, 256)),
        "big": jax.random.normal(jax.random.key(1), (128, 256)) * 0.1,
        "b": jnp.zeros((300,)),
        "s": jnp.float32(1.0),
    }


def _grads(key, params, scale=1.0):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    return treedef.unflatten(
        [scale * jax.random.normal(k, p.shape, p.dtype) for k, p in zip(keys, leaves, strict=True)]
    )


def _arrays(state):
    return [x for x in jax.tree.leaves(state) if hasattr(x, "dtype")]


def _run(tx, steps=3, params=None, jit=True):
    params = _params() if params is None else params
    state = tx.init(params)
    update = jax.jit(tx.update) if jit else tx.update
    for i in range(steps):
        u, state = update(_grads(jax.random.key(10 + i), params), state, params)
        params = optax.apply_updates(params, u)
    return params, state


def _bits(x):
    return np.asarray(x).view(np.uint8 if x.dtype.itemsize == 1 else np.uint32)


# --- against coat_adamw --------------------------------------------------------------------


def _coat_math_adam(b1, b2, eps):
    """optax.scale_by_adam computed by coat_adamw's own float32 expressions (pallas_kernels)."""

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return optax.ScaleByAdamState(jnp.zeros([], jnp.int32), zeros, zeros)

    def update(g, state, params=None):
        count = optax.safe_increment(state.count)
        out = jax.tree.map(
            lambda g, m, v: kernels.adam_moments_and_update(
                g, m, v, count=count, b1=b1, b2=b2, eps=eps
            ),
            g,
            state.mu,
            state.nu,
        )
        pick = lambda i: jax.tree.map(lambda t: t[i], out, is_leaf=lambda x: isinstance(x, tuple))
        return pick(2), optax.ScaleByAdamState(count, pick(0), pick(1))

    return optax.GradientTransformation(init, update)


COAT_CASES = [
    ({}, {}),
    (
        {"nu_format": "e5m2", "expand_min": 8, "group_size": 64},
        {"formats": {"nonnegative": "e5m2"}, "expand_min": 8, "group_size": 64},
    ),
    ({"expansion": False}, {"expansion": False}),
]


def _trajectory(tx, params, grads):
    step = jax.jit(
        lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p))
    )
    state = jax.jit(tx.init)(params)
    for g in grads:
        params, state = step(params, state, g)
    return params, state


def _coat_problem(steps):
    rng = np.random.default_rng(0)
    shapes = {"w": (16, 384), "b": (200,), "k": (3, 4, 130), "s": ()}
    params = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}
    # Gradients spanning several decades, as real ones do.
    grads = [
        {
            k: jnp.asarray(rng.standard_normal(s) * np.exp(rng.uniform(-6, 1, s)), jnp.float32)
            for k, s in shapes.items()
        }
        for _ in range(steps)
    ]
    return params, grads


def _coat_fields(coat_state, k):
    (cs,) = coat_jax.find_coat_states(coat_state)
    return {
        "mu": [getattr(cs, f"mu_{n}")[k] for n in ("codes", "scale", "expand", "center")],
        "nu": [getattr(cs, f"nu_{n}")[k] for n in ("codes", "scale", "expand", "center")],
    }


def _wrapper_fields(state, k):
    (s,) = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, FP8State))]
    return {
        name: [getattr(s, f)[0]._asdict()[name][k] for f in FP8State._fields]
        for name in ("mu", "nu")
    }


@pytest.mark.parametrize("coat_kw,wrap_kw", COAT_CASES)
def test_storage_is_coat_adamw_bit_for_bit(coat_kw, wrap_kw):
    # With coat_adamw's own float32 Adam expressions inside, the wrapper must store exactly what
    # coat_adamw (reference path) stores, step after step: same codes, same statistics.
    params, grads = _coat_problem(10)
    lr, wd, b1, b2, eps = 1e-2, 0.1, 0.9, 0.95, 1e-8
    coat = coat_jax.coat_adamw(lr, b1, b2, eps, wd, implementation="xla", **coat_kw)
    wrapped = coat_jax.fp8_state(
        optax.chain(
            _coat_math_adam(b1, b2, eps),
            optax.add_decayed_weights(wd),
            optax.scale_by_learning_rate(lr),
        ),
        **wrap_kw,
    )
    pa, sa = _trajectory(coat, params, grads)
    pb, sb = _trajectory(wrapped, params, grads)
    for k in ("w", "b", "k"):
        fa, fb = _coat_fields(sa, k), _wrapper_fields(sb, k)
        for moment in ("mu", "nu"):
            for a, b in zip(fa[moment], fb[moment], strict=True):
                if isinstance(a, optax.MaskedNode):
                    assert isinstance(b, optax.MaskedNode)
                    continue
                assert a.dtype == b.dtype and a.shape == b.shape
                np.testing.assert_array_equal(_bits(a), _bits(b))
    for k in params:
        np.testing.assert_array_equal(_bits(pa[k]), _bits(pb[k]))


@pytest.mark.parametrize("coat_kw,wrap_kw", COAT_CASES[::2])
def test_optax_adamw_tracks_coat_adamw_step_for_step(coat_kw, wrap_kw):
    # optax.adamw spells the same float32 math in another order ((1-b1)*g + b1*m, (1-b2)*g**2),
    # and XLA fuses a*b + c into an FMA, so its moments differ from coat_adamw's in the last
    # bit. FP8 codes hide that: all but a rare rounding-boundary code stay identical.
    params, grads = _coat_problem(20)
    coat = coat_jax.coat_adamw(1e-2, b2=0.95, weight_decay=0.1, implementation="xla", **coat_kw)
    wrapped = coat_jax.fp8_state(optax.adamw(1e-2, b2=0.95, weight_decay=0.1), **wrap_kw)
    pa, sa = _trajectory(coat, params, grads)
    pb, sb = _trajectory(wrapped, params, grads)
    for k in ("w", "b", "k"):
        fa, fb = _coat_fields(sa, k), _wrapper_fields(sb, k)
        for moment in ("mu", "nu"):
            same = np.mean(_bits(fa[moment][0]) == _bits(fb[moment][0]))
            assert same >= 0.999, (k, moment, same)
            np.testing.assert_allclose(fa[moment][1], fb[moment][1], rtol=1e-5)
    for k in params:
        # 20 steps of lr 1e-2 move a parameter by up to 0.2; the two agree to float32 rounding.
        np.testing.assert_allclose(pa[k], pb[k], rtol=0, atol=2e-5)


# --- against the float64 SPEC codecs: the right leaves, formats and codecs -------------------


# Every optimizer and both expansion settings; they are independent options of the wrapper.
@pytest.mark.parametrize(
    "name,field,role,expansion",
    [
        ("lion", "mu", "signed", True),
        ("sgd", "trace", "signed", False),
        ("adafactor", "v", "nonnegative", True),
        ("adafactor", "v", "nonnegative", False),
    ],
)
def test_one_step_codes_match_float64_spec(name, field, role, expansion):
    formats = {"signed": "e4m3", "nonnegative": "e5m2"}
    params = {"w": jnp.zeros((8, 384))}
    inner = INNERS[name]()
    tx = coat_jax.fp8_state(inner, formats=formats, expansion=expansion)
    rng = np.random.default_rng(1)
    state = jax.jit(tx.init)(params)
    update, dequantized = jax.jit(tx.update), jax.jit(dequantized_state)
    for _ in range(4):
        g = {"w": jnp.asarray(rng.standard_normal((8, 384)) * np.exp(rng.uniform(-8, 0, (8, 384))))}
        prev = dequantized(state)
        _, state = update(g, state, params)
    # The float state the inner optimizer makes from the dequantized previous one, in float64
    # through the SPEC codec: what the wrapper must store.
    _, expected_inner = inner.update(g, prev, params)
    x = np.asarray(getattr(expected_inner[0], field)["w"], np.float64)
    codes, stats = ref.quantize(x, gs=128, fmt=formats[role], expand_min=16, expansion=expansion)
    (s,) = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, FP8State))]
    got = getattr(s.inner_state[0], field)["w"]
    assert got.dtype == quant.FORMATS[formats[role]]
    same = np.asarray(got.astype(jnp.float32)) == codes
    assert same.mean() > 0.995, same.mean()
    np.testing.assert_allclose(getattr(s.scale[0], field)["w"], stats["scale"], rtol=5e-4)
    if expansion:
        np.testing.assert_array_equal(getattr(s.expand[0], field)["w"], stats["expand"])
    else:
        assert isinstance(getattr(s.expand[0], field)["w"], optax.MaskedNode)


# --- which leaves: layout, bytes, rules ---------------------------------------------------


def test_quantized_and_kept_leaves_of_each_optimizer():
    params = _params()
    expected = {
        "adamw": [f"[0].{f}['{k}']" for f in ("mu", "nu") for k in ("w", "big", "b")],
        "lion": [f"[0].mu['{k}']" for k in ("w", "big", "b")],
        "sgd": [f"[0].trace['{k}']" for k in ("w", "big", "b")],
        # "big" (128 x 256) is factored: its v_row / v_col stay float32, its v is a dummy (1,).
        "adafactor": ["[0].v['w']", "[0].v['b']"],
        "muon": [
            ".inner_states['adam'].inner_state[0].mu['b']",
            ".inner_states['adam'].inner_state[0].nu['b']",
            ".inner_states['muon'].inner_state[0].mu['w']",
            ".inner_states['muon'].inner_state[0].mu['big']",
        ],
    }
    # The states' layout only: jax.eval_shape (test_structure_dtypes_eval_shape_and_jit checks
    # that it is the concrete states' layout).
    for name, make in INNERS.items():
        state = jax.eval_shape(coat_jax.fp8_state(make()).init, params)
        got = quantized_paths(state)
        assert sorted(got) == sorted(f".inner_state{p}" for p in expected[name]), (name, got)
        kept = full_precision_paths(state)
        # The scalar parameter's state is never quantized, and no floating leaf is dropped.
        assert any("['s']" in p for p in kept), name
        n_float = sum(
            1
            for x in jax.tree.leaves(jax.eval_shape(make().init, params))
            if jnp.issubdtype(x.dtype, jnp.floating)
        )
        assert len(got) + len(kept) == n_float, name
    kept = full_precision_paths(
        jax.eval_shape(coat_jax.fp8_state(optax.adafactor(1e-2)).init, params)
    )
    assert {".inner_state[0].v_row['big']", ".inner_state[0].v_col['big']"} <= set(kept)


@pytest.mark.parametrize("name,moments", [("adamw", 2), ("lion", 1), ("sgd", 1), ("muon", 1)])
@pytest.mark.parametrize("expansion", [True, False])
def test_state_bytes_per_parameter_4096x4096(name, moments, expansion):
    param = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}
    state = jax.eval_shape(coat_jax.fp8_state(INNERS[name](), expansion=expansion).init, param)
    per_param = quant.state_bytes(state) / 4096**2
    per_group = (3 if expansion else 1) * 4
    # muon keeps its 3 Newton-Schulz coefficients and counts: a few bytes in all.
    assert per_param == pytest.approx(moments * (1 + per_group / 128), abs=1e-5), per_param
    assert per_param / moments <= 1.1


def test_statistics_shapes_dtypes_and_formats():
    params = {"w": jnp.zeros((2, 3, 300)), "b": jnp.zeros((130,))}
    tx = coat_jax.fp8_state(
        optax.adam(1e-3),
        formats={"nonnegative": "e5m2"},
        expansion={"signed": True, "nonnegative": False},
        group_size=64,
    )
    state = jax.jit(tx.init)(params)
    adam = state.inner_state[0]
    for k, p in params.items():
        assert adam.mu[k].dtype == jnp.float8_e4m3fn and adam.mu[k].shape == p.shape
        assert adam.nu[k].dtype == jnp.float8_e5m2
        stat_shape = (*p.shape[:-1], -(-p.shape[-1] // 64))
        for field in (state.scale, state.expand, state.center):
            assert field[0].mu[k].shape == stat_shape and field[0].mu[k].dtype == jnp.float32
        assert state.scale[0].nu[k].shape == stat_shape
        assert isinstance(state.expand[0].nu[k], optax.MaskedNode)
    assert adam.count.dtype == jnp.int32
    # The all-zero initial state reads back as exact zeros.
    dequantized = jax.jit(functools.partial(dequantized_state, group_size=64))
    for x in jax.tree.leaves(dequantized(state)[0].mu):
        assert not np.any(np.asarray(x))


def test_nonnegative_fields_override_and_bf16_state():
    params = {"w": jnp.zeros((4, 256))}
    tx = coat_jax.fp8_state(
        optax.adam(1e-3, mu_dtype=jnp.bfloat16),
        formats={"signed": "e4m3", "nonnegative": "e5m2"},
        nonnegative_fields={"mu"},
    )
    _, state = _run(tx, params=params)
    assert state.inner_state[0].mu["w"].dtype == jnp.float8_e5m2
    assert state.inner_state[0].nu["w"].dtype == jnp.float8_e4m3fn


def test_mask_keeps_float32_state_and_plain_numbers():
    params = _params()
    tree_mask = {"w": True, "big": True, "b": False, "s": True}
    for mask in (tree_mask, lambda p: {k: k != "b" for k in p}):
        tx = coat_jax.fp8_state(optax.adam(1e-2), mask=mask)
        state = tx.init(params)
        assert state.inner_state[0].mu["b"].dtype == jnp.float32
        assert state.inner_state[0].mu["w"].dtype == jnp.float8_e4m3fn
        g = _grads(jax.random.key(2), params)
        u, _ = tx.update(g, state, params)
        plain = optax.adam(1e-2)
        u_ref, _ = plain.update(g, plain.init(params), params)
        np.testing.assert_allclose(u["b"], u_ref["b"], rtol=1e-6)
    with pytest.raises(ValueError, match="mask"):
        coat_jax.fp8_state(optax.adam(1e-2), mask={"w": True}).init(params)


def test_factored_adafactor_state_is_untouched():
    # A factored matrix keeps all of its (tiny) state in float32: its updates are adafactor's.
    params = {"big": jax.random.normal(jax.random.key(0), (256, 384))}
    g = _grads(jax.random.key(1), params)
    tx = coat_jax.fp8_state(optax.adafactor(1e-2))
    assert quantized_paths(tx.init(params)) == []
    u, _ = tx.update(g, tx.init(params), params)
    plain = optax.adafactor(1e-2)
    u_ref, _ = plain.update(g, plain.init(params), params)
    np.testing.assert_allclose(u["big"], u_ref["big"], rtol=1e-6)


# --- convergence next to the float32 optimizers --------------------------------------------


@pytest.mark.parametrize("name", list(INNERS))
def test_tracks_float32_optimizer_on_regression(name):
    w_true = jax.random.normal(jax.random.key(0), (64, 128))

    def loss_fn(p, i):
        x = jax.random.normal(jax.random.fold_in(jax.random.key(1), i), (32, 64))
        return jnp.mean((x @ p["w"] + p["b"] - x @ w_true) ** 2)

    def fit(tx):
        params = {"w": jnp.zeros((64, 128)), "b": jnp.zeros((128,))}
        state = jax.jit(tx.init)(params)

        @jax.jit
        def step(params, state, i):
            loss, g = jax.value_and_grad(loss_fn)(params, i)
            u, state = tx.update(g, state, params)
            return optax.apply_updates(params, u), state, loss

        losses = []
        for i in range(150):
            params, state, loss = step(params, state, i)
            losses.append(float(loss))
        return np.mean(losses[-10:]), losses[0]

    lr = {"adamw": 3e-2, "lion": 3e-3, "sgd": 3e-2, "adafactor": 3e-2, "muon": 3e-2}[name]
    make = {
        "adamw": lambda: optax.adamw(lr, weight_decay=0.0),
        "lion": lambda: optax.lion(lr, weight_decay=0.0),
        "sgd": lambda: optax.sgd(lr, momentum=0.9),
        "adafactor": lambda: optax.adafactor(lr, multiply_by_parameter_scale=False),
        "muon": lambda: contrib.muon(lr, consistent_rms=0.2),
    }[name]
    ours, start = fit(coat_jax.fp8_state(make()))
    theirs, _ = fit(make())
    print(f"\n{name}: fp8 state {ours:.5f}, float32 {theirs:.5f} (start {start:.2f})")
    assert ours < start * 0.6
    assert ours <= theirs * 1.05 + 1e-3


# --- composition ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(INNERS))
def test_structure_dtypes_eval_shape_and_jit(name):
    params = _params()
    tx = coat_jax.fp8_state(INNERS[name]())
    s0 = tx.init(params)
    s1 = jax.jit(tx.update)(_grads(jax.random.key(0), params), s0, params)[1]
    shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
    abstract = jax.eval_shape(tx.init, shapes)
    for s in (s1, abstract):
        assert jax.tree.structure(s) == jax.tree.structure(s0)
        for a, b in zip(_arrays(s0), _arrays(s), strict=True):
            assert (a.shape, a.dtype) == (b.shape, b.dtype)
    assert quantized_paths(abstract) == quantized_paths(s0)
    if name == "lion":
        p_jit, _ = _run(tx, steps=2, jit=True)
        p_eager, _ = _run(tx, steps=2, jit=False)
        for a, b in zip(jax.tree.leaves(p_jit), jax.tree.leaves(p_eager), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_inject_hyperparams_inside_and_outside():
    # A schedule as the learning rate: directly, injected inside the wrapper and outside it.
    sched = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
    direct, _ = _run(coat_jax.fp8_state(optax.adamw(sched, b1=0.8, weight_decay=0.05)))
    inside, state = _run(
        coat_jax.fp8_state(
            optax.inject_hyperparams(optax.adamw)(learning_rate=sched, b1=0.8, weight_decay=0.05)
        )
    )
    # The state keeps the values the last update used: the schedule at count 2, its peak.
    assert float(state.inner_state.hyperparams["learning_rate"]) == pytest.approx(1e-2)
    assert quantized_paths(state)

    def fp8_adamw(learning_rate, b1, weight_decay):
        return coat_jax.fp8_state(optax.adamw(learning_rate, b1=b1, weight_decay=weight_decay))

    outside, state = _run(
        optax.inject_hyperparams(fp8_adamw)(learning_rate=sched, b1=0.8, weight_decay=0.05)
    )
    assert quantized_paths(state)
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(float(sched(2)))
    # Injected hyper-parameters are float32 arrays instead of Python floats: rounding differs.
    for tree in (inside, outside):
        for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(tree), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_multisteps_accumulates():
    params = _params()
    tx = optax.MultiSteps(coat_jax.fp8_state(optax.lion(1e-3)), every_k_schedule=3)
    state = tx.init(params)
    update = jax.jit(tx.update)
    seen = []
    for i in range(6):
        u, state = update(_grads(jax.random.key(i), params), state, params)
        seen.append(float(jnp.abs(u["w"]).max()))
        params = optax.apply_updates(params, u)
    assert seen[0] == seen[1] == 0.0 and seen[2] > 0.0
    assert seen[3] == seen[4] == 0.0 and seen[5] > 0.0
    assert int(state.inner_opt_state.inner_state[0].count) == 2
    # The accumulator is MultiSteps' own, outside the wrapper: float32.
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.acc_grads))


def test_apply_if_finite_skips_bad_steps_and_state_stays_finite():
    params = _params()
    tx = optax.apply_if_finite(coat_jax.fp8_state(optax.adamw(1e-2)), max_consecutive_errors=5)
    state = tx.init(params)
    state = jax.jit(tx.update)(_grads(jax.random.key(0), params), state, params)[1]
    before = jax.tree.map(np.asarray, state.inner_state)
    for bad in (jnp.nan, jnp.inf, -jnp.inf):
        g = _grads(jax.random.key(1), params)
        g["w"] = g["w"].at[3, 7].set(bad)
        u, state = jax.jit(tx.update)(g, state, params)
        assert all(bool(jnp.all(x == 0)) for x in jax.tree.leaves(u))
        for leaf in _arrays(state.inner_state):
            assert bool(jnp.all(jnp.isfinite(leaf.astype(jnp.float32))))
    after = jax.tree.map(np.asarray, state.inner_state)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    assert int(state.notfinite_count) == 3


def test_masked_composition_both_ways():
    mask = {"w": True, "big": False, "b": True, "s": False}
    outer = optax.masked(coat_jax.fp8_state(optax.lion(1e-3)), mask)
    inner = coat_jax.fp8_state(optax.masked(optax.lion(1e-3), mask))
    p_outer, s_outer = _run(outer)
    p_inner, s_inner = _run(inner)
    assert len(quantized_paths(s_outer)) == len(quantized_paths(s_inner)) == 2
    for a, b in zip(jax.tree.leaves(p_outer), jax.tree.leaves(p_inner), strict=True):
        np.testing.assert_array_equal(a, b)


@functools.cache
def _edge_case_txs():
    """The edge cases' optimizers and their jitted updates: the cases share the compiled steps."""
    txs = [coat_jax.fp8_state(INNERS[name]()) for name in ("adamw", "lion")]
    return [(tx, jax.jit(tx.update)) for tx in txs]


@pytest.mark.parametrize(
    "grad_fn",
    [
        lambda s: jnp.zeros(s),
        lambda s: jnp.full(s, 1e-42),
        lambda s: jnp.full(s, 1e15),
        lambda s: jnp.zeros(s).at[..., 5].set(2.0),
        lambda s: jnp.where(jnp.arange(s[-1]) % 2 == 0, 1e-20, 1e12) * jnp.ones(s),
    ],
    ids=["zeros", "denormal", "huge", "single_value", "wide"],
)
def test_edge_case_gradients_keep_state_finite(grad_fn):
    params = {"w": jnp.ones((4, 256)), "v": jnp.ones((300,))}
    for tx, update in _edge_case_txs():
        state = tx.init(params)
        for _ in range(3):
            g = jax.tree.map(lambda p: grad_fn(p.shape).astype(jnp.float32), params)
            u, state = update(g, state, params)
            for leaf in _arrays(state) + jax.tree.leaves(u):
                assert bool(jnp.all(jnp.isfinite(leaf.astype(jnp.float32))))


def test_nnx_optimizer():
    model = nnx.Linear(128, 256, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, coat_jax.fp8_state(optax.adamw(1e-2)), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(0), (16, 128))

    @nnx.jit
    def train_step(model, opt):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        opt.update(model, grads)
        return loss

    losses = [float(train_step(model, opt)) for _ in range(20)]
    assert losses[-1] < losses[0] / 2
    assert len(quantized_paths(opt.opt_state)) == 4  # mu and nu of kernel and bias


def test_orbax_round_trip_bit_for_bit(tmp_path):
    params = _params()
    tx = coat_jax.fp8_state(
        optax.adamw(1e-2), formats={"nonnegative": "e5m2"}, expansion={"nonnegative": False}
    )
    _, state = _run(tx)
    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(1, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
        back = manager.restore(1, args=ocp.args.StandardRestore(jax.eval_shape(lambda: state)))
    assert jax.tree.structure(back) == jax.tree.structure(state)
    dtypes = set()
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(_bits(a), _bits(b))
        dtypes.add(np.dtype(a.dtype).name)
    assert {"float8_e4m3fn", "float8_e5m2", "float32", "int32"} <= dtypes
    # The restored state continues exactly like the original.
    g = _grads(jax.random.key(5), params)
    ua, _ = jax.jit(tx.update)(g, state, params)
    ub, _ = jax.jit(tx.update)(g, back, params)
    for a, b in zip(jax.tree.leaves(ua), jax.tree.leaves(ub), strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(b))


# --- bad options ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"formats": "e3m4"}, "e3m4.*e4m3"),
        ({"formats": {"second": "e5m2"}}, "second.*nonnegative"),
        ({"formats": {"signed": "int8"}}, "int8"),
        ({"expansion": "yes"}, "expansion"),
        ({"expansion": {"mu": True}}, "mu.*signed"),
        ({"group_size": 0}, "group_size"),
        ({"group_size": 12.5}, "group_size"),
        ({"expand_min": 0}, "expand_min"),
        ({"nonnegative_fields": "nu"}, "nonnegative_fields"),
    ],
)
def test_bad_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        coat_jax.fp8_state(optax.adam(1e-3), **kwargs)


def test_bad_inner_and_state_queries():
    with pytest.raises(ValueError, match="GradientTransformation"):
        coat_jax.fp8_state(optax.adam)
    with pytest.raises(ValueError, match="fp8_state"):
        quantized_paths(optax.adam(1e-3).init({"w": jnp.ones(3)}))
    with pytest.raises(ValueError, match="exactly one"):
        dequantized_state(optax.adam(1e-3).init({"w": jnp.ones(3)}))


# --- the trainer's optimizers ---------------------------------------------------------------


def _cfg(**kw):
    from coat_jax.training import load_config

    cfg = load_config(os.path.join(ROOT, "configs", "default.yaml"))
    return dataclasses.replace(cfg, **kw)


def _llama_like():
    k = jax.random.key(0)
    return {
        "embed_tokens": {"embedding": jax.random.normal(k, (258, 128))},
        "layers": {"q_proj": {"kernel": jax.random.normal(k, (128, 128)) * 0.1}},
        "norm": {"weight": jnp.ones((128,))},
        "lm_head": {"kernel": jax.random.normal(k, (128, 258)) * 0.1},
    }


@pytest.mark.parametrize("name", ["adamw", "lion", "sgd", "adafactor", "muon"])
def test_make_optimizer_every_optimizer_with_and_without_fp8(name):
    from coat_jax.training.optimizers import make_optimizer
    from coat_jax.training.program import make_schedule

    params = _llama_like()
    g = _grads(jax.random.key(3), params, 0.01)
    out = {}
    for fp8 in (False, True):
        cfg = _cfg(optimizer=name, fp8_state=fp8)
        tx = make_optimizer(cfg, make_schedule(cfg))
        state = tx.init(params)
        u, state = jax.jit(tx.update)(g, state, params)
        out[fp8] = u
        found = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, FP8State))]
        assert any(isinstance(x, FP8State) for x in found) == fp8
    # Step 1 from zero state: FP8 storage has not entered yet, so the updates agree.
    for a, b in zip(jax.tree.leaves(out[False]), jax.tree.leaves(out[True]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_make_optimizer_reproduces_the_trainers_adamw_and_coat_adamw():
    from coat_jax.training import optimizers
    from coat_jax.training.optimizers import make_optimizer, weight_decay_mask
    from coat_jax.training.program import make_schedule

    params = _llama_like()
    decays = weight_decay_mask(params, False)
    assert decays["layers"]["q_proj"]["kernel"] and decays["lm_head"]["kernel"]
    assert not decays["embed_tokens"]["embedding"] and not decays["norm"]["weight"]
    assert all(jax.tree.leaves(weight_decay_mask(params, True)))
    for name in ("adamw", "coat_adamw"):
        cfg = _cfg(optimizer=name)
        ours, theirs = (
            make_optimizer(cfg, make_schedule(cfg)),
            optimizers.make_optimizer(cfg, make_schedule(cfg)),
        )
        p1, s1 = _run(ours, params=params)
        p2, s2 = _run(theirs, params=params)
        assert jax.tree.structure(s1) == jax.tree.structure(s2)
        for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
            np.testing.assert_array_equal(a, b)


def test_config_keys():
    cfg = _cfg()
    assert (cfg.optimizer, cfg.fp8_state) == ("coat_adamw", False)
    with pytest.raises(ValueError, match="coat_adamw already keeps FP8"):
        _cfg(fp8_state=True)
    with pytest.raises(ValueError, match="momentum"):
        _cfg(optimizer="sgd", momentum=1.0)
    from coat_jax.training.optimizers import optimizer_fingerprint

    assert optimizer_fingerprint(_cfg(optimizer="lion"))["mu_format"] is None
    assert optimizer_fingerprint(_cfg(optimizer="lion", fp8_state=True))["mu_format"] == "e4m3"

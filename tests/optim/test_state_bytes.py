"""Bytes per parameter of the FP8 optimizer states, on every kind of shape, and the grouping of
narrow parameters over their flatten (docs/fp8_state.md, 'Parameters FP8 would not shrink')."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import coat_jax
from coat_jax import state_codec

# Every shape of at least 128 elements meets its optimizer's bound; the others (and these) never
# take more than the float32 state.
SHAPES = [
    (3,),
    (1, 1),
    (2, 3, 4),
    (5, 3, 2),
    (512, 1),
    (1, 512),
    (128,),
    (130,),
    (7, 129),
    (512, 5),
    (64, 2, 3),
    (2, 3, 256),
    # Rows that fill at least three quarters of their groups keep them.
    (3, 200),
    (40, 300),
    (64, 1000),
    (9, 576),
    (4096, 11008),
]

# An element of 129 to 191 values needs two groups of 128 (and their statistics) in any layout,
# above coat_adamw's bound (docs/fp8_state.md, 'Parameters FP8 would not shrink').
TWO_SHORT_GROUPS = [(130,)]

OPTIMIZERS = {
    # name: (FP8 state, its float32 counterpart, bound in bytes per parameter where groups fill)
    "coat_adamw": (
        lambda **kw: coat_jax.coat_adamw(1e-3, **kw),
        lambda: optax.adamw(1e-3),
        2.25,
    ),
    "fp8_state(lion)": (
        lambda **kw: coat_jax.fp8_state(optax.lion(1e-3), **kw),
        lambda: optax.lion(1e-3),
        1.15,
    ),
}


def _bytes(tx, shape) -> int:
    # jax.eval_shape: the (4096, 11008) state is measured, not allocated.
    param = jax.ShapeDtypeStruct(shape, jnp.float32)
    return coat_jax.state_bytes(jax.eval_shape(tx.init, {"w": param}))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fp8_state_never_outweighs_float32_and_is_small_where_groups_fill(name):
    fp8, float32, bound = OPTIMIZERS[name]
    for shape in SHAPES:
        assert _bytes(fp8(), shape) <= _bytes(float32(), shape), shape
        if math.prod(shape) >= 128 and shape not in TWO_SHORT_GROUPS:
            assert _bytes(fp8(), shape) / math.prod(shape) <= bound, shape


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_layer_stack_keeps_each_layers_choice(name):
    # The layerwise step updates a scanned model's (layers, ...) stack one slice at a time:
    # with stacked_axes=1 the stack and each slice are stored alike, in FP8 or in float32.
    fp8 = OPTIMIZERS[name][0]
    for shape in [(512, 1), (3,), (2, 4), (7, 129), (1, 512)]:
        one = jax.eval_shape(fp8().init, {"w": jax.ShapeDtypeStruct(shape, jnp.float32)})
        stack = jax.eval_shape(
            fp8(stacked_axes=1).init, {"w": jax.ShapeDtypeStruct((4, *shape), jnp.float32)}
        )
        dtypes = [leaf.dtype for leaf in jax.tree.leaves(one) if leaf.ndim]
        assert [leaf.dtype for leaf in jax.tree.leaves(stack) if leaf.ndim] == dtypes, shape
        stacked_shapes = [leaf.shape for leaf in jax.tree.leaves(stack) if leaf.ndim]
        assert stacked_shapes == [(4, *leaf.shape) for leaf in jax.tree.leaves(one) if leaf.ndim]


def test_group_views():
    view = state_codec.group_view
    # A last axis that the group size divides keeps its rows' groups (Llama's shapes).
    assert view((4096, 11008), 0, 128) == (4096, 11008)
    assert view((32, 4096, 11008), 1, 128) == (32, 4096, 11008)
    assert view((300,), 0, 128) == (300,)
    # Rows that fill three quarters of their groups keep them (a column split stays local).
    assert view((64, 1000), 0, 128) == (64, 1000)
    assert view((3, 288), 0, 128) == (3, 288)
    assert view((3, 287), 0, 128) == (1, 861)
    assert view((64, 64), 0, 128) == (1, 4096)
    assert view((512, 1), 0, 128) == (1, 512)
    assert view((4, 7, 129), 1, 128) == (4, 1, 903)
    assert view((4, 7, 129), 0, 128) == (1, 1, 3612)
    assert view((4,), 1, 128) == (4, 1)  # a stack of scalars
    assert state_codec.view_of((4, 7, 129), (4, 1, 8)) == (4, 1, 903)
    with pytest.raises(ValueError, match=r"stacked_axes gives 3 for a parameter of shape \(4, 5\)"):
        coat_jax.coat_adamw(1e-3, stacked_axes=3).init({"w": jnp.zeros((4, 5))})
    with pytest.raises(ValueError, match="stacked_axes must be a tree of ints"):
        coat_jax.fp8_state(optax.sgd(1e-3, 0.9), stacked_axes={"v": 0}).init({"w": jnp.zeros(3)})


STACK = {"a": (2, 7, 129), "b": (2, 512, 1)}


def _stack_problem(steps):
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in STACK.items()}
    grads = [
        {
            k: jnp.asarray(rng.standard_normal(s) * np.exp(rng.uniform(-6, 1, s)), jnp.float32)
            for k, s in STACK.items()
        }
        for _ in range(steps)
    ]
    return params, grads


def _element(tree, i):
    return jax.tree.map(lambda x: x[i], tree)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_stack_steps_as_its_slices_bit_for_bit(name):
    # What the layerwise step relies on: the stacked state, stepped whole, is the slices'
    # states stepped one by one and stacked, bit for bit (codes, statistics and updates).
    fp8 = OPTIMIZERS[name][0]
    params, grads = _stack_problem(2)
    kw = {"implementation": "xla"} if name == "coat_adamw" else {}
    whole, alone = fp8(stacked_axes=1, **kw), fp8(**kw)
    whole_step = jax.jit(whole.update)
    # Each slice stepped on its own, in one program.
    slices_step = jax.jit(
        lambda g, states, p: [
            alone.update(_element(g, i), s, _element(p, i)) for i, s in enumerate(states)
        ]
    )
    state = jax.jit(whole.init)(params)
    alone_init = jax.jit(alone.init)
    slices = [alone_init(_element(params, i)) for i in range(2)]
    for g in grads:
        updates, state = whole_step(g, state, params)
        stepped = slices_step(g, slices, params)
        slices = [s for _, s in stepped]
        for i, (u_i, _) in enumerate(stepped):
            for a, b in zip(
                jax.tree.leaves(_element(updates, i)), jax.tree.leaves(u_i), strict=True
            ):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *slices)
    assert jax.tree.structure(stacked) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(stacked), strict=True):
        if a.ndim:
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(
                np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)
            )


def test_pallas_interpret_matches_the_reference_on_narrow_shapes():
    # The fused kernel sees the parameter, its gradient and its moments in their group view:
    # a stack's step, then one element stepped inside the stacks (in place for whole groups,
    # through the element's slice for a short last group), as the layerwise step does.
    params, grads = _stack_problem(2)
    runs = {}
    for impl in ("xla", "pallas"):
        kw = dict(weight_decay=0.1, implementation=impl, interpret=True)
        whole = coat_jax.coat_adamw(1e-2, stacked_axes=1, **kw)
        alone = coat_jax.coat_adamw(1e-2, **kw)
        step = jax.jit(lambda g, s, p, tx=whole: coat_jax.apply_gradients(tx, g, s, p))
        step_at = jax.jit(
            lambda g, s, p, tx=alone: coat_jax.optim.apply_gradients_at(tx, g, s, p, 1)
        )
        runs[impl] = (
            step(grads[0], jax.jit(whole.init)(params), params),
            step_at(_element(grads[1], 1), jax.jit(jax.vmap(alone.init))(params), params),
        )
    for (p_x, s_x), (p_p, s_p) in zip(runs["xla"], runs["pallas"], strict=True):
        assert jax.tree.map(lambda x: (x.dtype, x.shape), s_p) == jax.tree.map(
            lambda x: (x.dtype, x.shape), s_x
        )
        for k in params:
            np.testing.assert_allclose(p_p[k], p_x[k], rtol=1e-5, atol=1e-6)
        moments = coat_jax.dequantized_moments(s_p), coat_jax.dequantized_moments(s_x)
        for a, b in zip(*moments, strict=True):
            for k in params:
                # A rounding tie may flip one code.
                assert np.mean(~np.isclose(a[k], b[k], rtol=1e-5, atol=0)) <= 0.005, k

"""Bytes per parameter of the FP8 optimizer states, on every kind of shape
(docs/fp8_state.md, 'Parameters FP8 would not shrink')."""

import math

import jax
import jax.numpy as jnp
import optax
import pytest

import coat_jax

NARROW = [(3,), (1, 1), (512, 1), (2, 3, 4), (512, 5), (7, 129)]
WIDE = [(1, 512), (128,), (2, 3, 256), (4096, 11008)]

OPTIMIZERS = {
    # name: (FP8 state, its float32 counterpart, bound in bytes per parameter where groups fill)
    "coat_adamw": (lambda: coat_jax.coat_adamw(1e-3), lambda: optax.adamw(1e-3), 2.25),
    "fp8_state(lion)": (
        lambda: coat_jax.fp8_state(optax.lion(1e-3)),
        lambda: optax.lion(1e-3),
        1.15,
    ),
}


def _bytes(tx, shape) -> int:
    param = jax.ShapeDtypeStruct(shape, jnp.float32)
    return coat_jax.state_bytes(jax.eval_shape(tx.init, {"w": param}))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fp8_state_never_outweighs_float32_and_is_small_where_groups_fill(name):
    fp8, float32, bound = OPTIMIZERS[name]
    for shape in NARROW + WIDE:
        assert _bytes(fp8(), shape) <= _bytes(float32(), shape), shape
    for shape in WIDE:
        assert _bytes(fp8(), shape) / math.prod(shape) <= bound, shape


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_layer_stack_keeps_each_layers_choice(name):
    # The layerwise step updates a scanned model's (layers, ...) stack one slice at a time:
    # the stack and each slice are stored alike, in FP8 or in float32.
    fp8 = OPTIMIZERS[name][0]
    for shape in [(512, 1), (3,), (2, 4), (7, 129), (1, 512)]:
        one = jax.eval_shape(fp8().init, {"w": jax.ShapeDtypeStruct(shape, jnp.float32)})
        stack = jax.eval_shape(fp8().init, {"w": jax.ShapeDtypeStruct((4, *shape), jnp.float32)})
        dtypes = [leaf.dtype for leaf in jax.tree.leaves(one) if leaf.ndim]
        assert [leaf.dtype for leaf in jax.tree.leaves(stack) if leaf.ndim] == dtypes, shape
        stacked_shapes = [leaf.shape for leaf in jax.tree.leaves(stack) if leaf.ndim]
        assert stacked_shapes == [(4, *leaf.shape) for leaf in jax.tree.leaves(one) if leaf.ndim]

"""Bytes of optimizer state per parameter, as ``coat_jax.quant.state_bytes`` reports them, on
narrow and odd shapes (docs/fp8_state.md, 'Narrow parameters')."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import coat_jax
from coat_jax import state_codec
from coat_jax.quant import state_bytes

# Shapes of at least 128 values (the bound of docs/fp8_state.md, 'Narrow parameters'), then
# others: a block just three quarters full, and tiny ones.
SHAPES = [(512, 1), (1, 512), (128,), (7, 129), (4096, 11008), (64, 64), (8, 200)]
OTHERS = [(2, 3, 130), (3,), (1, 1), (4,), (5,), (2, 2)]


def _bytes(tx, shape):
    params = {"w": jax.ShapeDtypeStruct(shape, jnp.float32)}
    return state_bytes(jax.eval_shape(tx.init, params)) / math.prod(shape)


@pytest.mark.parametrize("shape", SHAPES + OTHERS, ids=str)
def test_fp8_state_never_outweighs_float32_and_meets_the_bound(shape):
    adamw, coat = _bytes(optax.adamw(1e-3), shape), _bytes(coat_jax.coat_adamw(1e-3), shape)
    lion, fp8_lion = (
        _bytes(optax.lion(1e-3), shape),
        _bytes(coat_jax.fp8_state(optax.lion(1e-3)), shape),
    )
    assert coat <= adamw and fp8_lion <= lion, (coat, adamw, fp8_lion, lion)
    if shape in SHAPES:
        assert coat <= 2.25 and fp8_lion <= 1.15, (coat, fp8_lion)


def test_narrow_parameters_group_along_the_flatten():
    assert state_codec.stat_shape((512, 1), 128) == (1, 4)
    assert state_codec.stat_shape((7, 129), 128) == (1, 8)
    assert state_codec.stat_shape((2, 3, 130), 128) == (2, 1, 4)
    # COAT's layout wherever the last axis fills its groups.
    assert state_codec.stat_shape((4096, 11008), 128) == (4096, 86)
    assert state_codec.stat_shape((8, 200), 128) == (8, 2)
    assert not state_codec.fp8_pays((3,), 128, 3) and state_codec.fp8_pays((5,), 128, 3)


def test_narrow_statistics_shard_like_the_parameter():
    sizes = {"fsdp": 8}
    P = jax.sharding.PartitionSpec
    # Rows split: the flattened block's groups take the split.
    assert state_codec.stat_spec(P("fsdp"), (4096, 64), (1, 2048), sizes) == P(None, "fsdp")
    assert state_codec.stat_spec(P(None, "fsdp"), (4, 8, 64), (4, 1, 4), sizes) == P(
        None, None, None
    )
    assert state_codec.stat_spec(P("fsdp"), (4096, 256), (4096, 2), sizes) == P("fsdp", None)


def test_a_state_grouped_along_the_last_axis_still_steps():
    # A state made when every parameter grouped along its last axis: statistics (512, 1) for a
    # (512, 1) parameter. It reads back and steps in its own layout.
    params = {"w": jnp.linspace(-1.0, 1.0, 512).reshape(512, 1)}
    grads = {"w": jnp.cos(params["w"])}
    tx = coat_jax.coat_adamw(1e-2, implementation="xla")
    new = tx.init(params)
    (cs,) = coat_jax.find_coat_states(new)
    last_axis = {
        f"{m}_{f}": {"w": jnp.broadcast_to(getattr(cs, f"{m}_{f}")["w"][:1, :1], (512, 1))}
        for m in ("mu", "nu")
        for f in ("scale", "expand", "center")
    }
    assert cs.mu_scale["w"].shape == (1, 4)
    old = (new[0]._replace(**last_axis), *new[1:])
    updates, state = jax.jit(tx.update)(grads, old, params)
    assert coat_jax.find_coat_states(state)[0].mu_scale["w"].shape == (512, 1)
    np.testing.assert_allclose(updates["w"], -1e-2 * np.sign(grads["w"]), rtol=1e-3)

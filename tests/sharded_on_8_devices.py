"""Pallas kernels on operands sharded over 8 CPU devices, against one device (issue 16).

Run by tests/test_sharded_kernels.py in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (the flag must be set before JAX starts).
The Pallas paths run in interpret mode inside ``shard_map``; each result must equal the one-device
result: bit for bit for per-element and per-group work and for per-tensor scales (a maximum is
exact in any order), to float32 rounding for a sum over the batch shards (RMSNorm's weight
gradient).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import coat_jax
from coat_jax import fp8_ops
from coat_jax.training import sharding
from pallas_kernels import _dispatch, fp8_act, fp8_quant
from pallas_kernels.sharding import KernelMesh, group_aligned_spec

if jax.device_count() != 8:
    pytest.skip(
        "needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/test_sharded_kernels.py)",
        allow_module_level=True,
    )

P = jax.sharding.PartitionSpec
MESH = sharding.make_mesh(2, 4)  # data x fsdp
KMESH = KernelMesh(MESH)
BATCH = jax.sharding.NamedSharding(MESH, P(("data", "fsdp")))
# fsdp_spec over 4 devices, and what the per-group kernel runs under (group size 128):
SHAPES = {
    "q": (64, 512),  # split on the last axis, 128 columns per shard: on group boundaries
    "gate": (64, 1000),  # last axis 250 per shard, off group boundaries: moves to rows
    "norm": (256,),  # 64 per shard and no other axis: replicated
}
REPLICATED = {"norm"}


def _equal(a, b, what=""):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, what
        np.testing.assert_array_equal(
            np.asarray(x, np.float32), np.asarray(y, np.float32), err_msg=what
        )


def test_auto_needs_a_mesh_on_several_devices():
    assert _dispatch.candidates("auto", interpret=True) == ("xla",)
    assert _dispatch.candidates("auto", interpret=True, mesh=KMESH) == ("pallas", "xla")


def test_group_aligned_specs():
    fsdp = {k: sharding.fsdp_spec(s, 4) for k, s in SHAPES.items()}
    assert fsdp["q"] == P(None, "fsdp") and fsdp["gate"] == P(None, "fsdp")
    kernel = {k: group_aligned_spec(fsdp[k], s, MESH, 128) for k, s in SHAPES.items()}
    assert kernel == {
        "q": P(None, "fsdp"),
        "gate": P("fsdp", None),
        "norm": P(None),
    }


# --- the optimizer ------------------------------------------------------------------------


def _tree(seed, scale=1.0):
    keys = jax.random.split(jax.random.key(seed), len(SHAPES))
    return {
        k: scale * jax.random.normal(key, s)
        for key, (k, s) in zip(keys, SHAPES.items(), strict=True)
    }


def _optimizer(mesh):
    return coat_jax.coat_adamw(
        1e-2, weight_decay=0.1, implementation="pallas", interpret=True, mesh=mesh
    )


def _sharded_step():
    tx = _optimizer(MESH)
    params = _tree(0)
    param_sh = sharding.param_shardings(params, MESH)
    state = tx.init(jax.device_put(params, param_sh))
    state_sh = sharding.state_shardings(state, params, MESH)

    def step(p, s, g):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    jitted = jax.jit(
        step,
        in_shardings=(param_sh, state_sh, param_sh),
        out_shardings=(param_sh, state_sh),
        donate_argnums=(0, 1),
    )
    return jitted, jax.device_put(params, param_sh), jax.device_put(state, state_sh), param_sh


def _gathered_shapes(hlo: str) -> list[tuple[int, ...]]:
    """Result shapes of the all-gathers in compiled HLO text."""
    shapes = []
    for m in re.finditer(r"=\s*\(?([a-z0-9]+)\[([0-9,]*)\][^=]*?\ball-gather(?:-start)?\(", hlo):
        shapes.append(tuple(int(d) for d in m.group(2).split(",") if d))
    return shapes


def test_optimizer_on_shards_equals_one_device_and_gathers_no_parameter():
    jitted, params, state, param_sh = _sharded_step()
    grads = [_tree(10 + t, scale=1e-2) for t in range(2)]
    compiled = jitted.lower(params, state, jax.device_put(grads[0], param_sh)).compile()
    hlo = compiled.as_text()
    gathered = set(_gathered_shapes(hlo))
    # Only the leaf that cannot split on group boundaries anywhere is gathered (explicitly).
    assert {k for k, s in SHAPES.items() if s in gathered} == REPLICATED, gathered
    # The leaf whose last-axis split falls off group boundaries is re-laid out, not gathered.
    assert "all-to-all" in hlo

    tx1 = _optimizer(None)
    ref_p = _tree(0)
    ref_s = tx1.init(ref_p)

    @jax.jit
    def ref_step(p, s, g):
        updates, s = tx1.update(g, s, p)
        return optax.apply_updates(p, updates), s

    for t, g in enumerate(grads, start=1):
        params, state = compiled(params, state, jax.device_put(g, param_sh))
        ref_p, ref_s = ref_step(ref_p, ref_s, g)
        # The kernels' outputs (the FP8 state) match bit for bit; the parameters are within
        # two float32 ulps of |p| ~ 1, since XLA fuses optax's apply differently in the two programs.
        _equal(state, ref_s, f"state after step {t}")
        for k in SHAPES:
            np.testing.assert_allclose(params[k], ref_p[k], rtol=0, atol=2.5e-7, err_msg=k)
    assert params["q"].sharding.spec == P(None, "fsdp")
    assert state[0].mu_codes["gate"].sharding.spec == P(None, "fsdp")


def test_optimizer_without_mesh_stays_on_xla_with_auto():
    tx = coat_jax.coat_adamw(1e-2, interpret=True)  # auto, no mesh, 8 devices: jnp path
    params = jax.device_put(_tree(0), sharding.param_shardings(_tree(0), MESH))
    state = tx.init(params)
    hlo = jax.jit(tx.update).lower(params, state, params).as_text()
    assert "coat_adam_step" not in hlo


# --- the quantizers -----------------------------------------------------------------------


def _activation(shape, seed=0):
    rows = 10.0 ** jax.random.uniform(
        jax.random.key(seed + 1), shape[:-1] + (1,), minval=-3, maxval=3
    )
    return (rows * jax.random.normal(jax.random.key(seed), shape)).astype(jnp.bfloat16)


def _on_mesh(fn, *args):
    """``fn`` under jit on batch-sharded arguments, with the kernel mesh."""
    sharded = [jax.device_put(a, BATCH) if a.ndim > 1 else a for a in args]
    return jax.jit(lambda *a: fn(*a, mesh=KMESH))(*sharded)


def _one_device(fn, *args):
    return jax.jit(lambda *a: fn(*a, mesh=None))(*args)


PALLAS = dict(implementation="pallas", interpret=True)


def test_per_group_quantizer_on_shards():
    x = _activation((16, 8, 64))
    fn = lambda x, mesh: fp8_quant.quantize_per_group(x, mesh=mesh, **PALLAS)
    _equal(_on_mesh(fn, x), _one_device(fn, x))


def test_per_tensor_scale_is_the_global_maximum_bit_for_bit(fmt="e5m2"):
    # The largest value sits on one shard only: each shard's own scale would differ.
    x = _activation((16, 96), seed=3).at[5, 7].set(300.0)
    fn = lambda x, mesh: fp8_quant.quantize_per_tensor(x, fmt=fmt, mesh=mesh, **PALLAS)
    (codes, scale), (codes1, scale1) = _on_mesh(fn, x), _one_device(fn, x)
    assert np.asarray(scale).view(np.uint32) == np.asarray(scale1).view(np.uint32)
    _, scale_ref = fp8_quant.quantize_per_tensor_reference(x, fmt=fmt)
    assert np.asarray(scale).view(np.uint32) == np.asarray(scale_ref).view(np.uint32)
    _equal(codes, codes1)
    assert codes.sharding.spec == P(("data", "fsdp"))
    hlo = jax.jit(lambda x: fn(x, KMESH)).lower(jax.device_put(x, BATCH)).compile().as_text()
    assert "all-reduce" in hlo and (16, 96) not in _gathered_shapes(hlo)


def test_per_tensor_quantizer_of_a_weight_on_its_fsdp_shards():
    w = jax.random.normal(jax.random.key(4), (64, 256)).at[3, 200].set(-50.0)
    spec = KMESH.param_spec(w.shape)
    assert spec == P(None, "fsdp")
    w_sh = jax.device_put(w, jax.sharding.NamedSharding(MESH, spec))
    fn = jax.jit(lambda w: fp8_quant.quantize_per_tensor(w, mesh=KMESH, partition=spec, **PALLAS))
    codes, scale = fn(w_sh)
    codes1, scale1 = jax.jit(lambda w: fp8_quant.quantize_per_tensor(w, **PALLAS))(w)
    assert np.asarray(scale).view(np.uint32) == np.asarray(scale1).view(np.uint32)
    _equal(codes, codes1)
    assert (64, 256) not in _gathered_shapes(fn.lower(w_sh).compile().as_text())


def test_leading_axis_the_batch_devices_do_not_divide():
    x = _activation((6, 64))  # 6 rows over 8 batch devices
    auto = fp8_quant.quantize_per_group(x, mesh=KMESH, implementation="auto", interpret=True)
    _equal(auto, fp8_quant.quantize_per_group_reference(x))
    with pytest.raises(ValueError, match=r"\(6, 64\).*leading batch axis.*'auto'"):
        fp8_quant.quantize_per_group(x, mesh=KMESH, **PALLAS)


# --- the fused non-linear ops -------------------------------------------------------------


def test_fused_ops_on_shards_equal_one_device():
    shape = (16, 4, 64)
    x, y = _activation(shape, 5), _activation(shape, 6)
    dy = _activation(shape, 7)
    w = 1.0 + 0.1 * jax.random.normal(jax.random.key(8), shape[-1:])
    for op in ("silu", "mul"):  # swiglu shares mul's sharding (two batch-split inputs)
        fwd = getattr(fp8_act, f"{op}_fwd")
        bwd = getattr(fp8_act, f"{op}_bwd")
        args = (x,) if op == "silu" else (x, y)
        fwd_fn = lambda *a, mesh, fwd=fwd: fwd(*a, mesh=mesh, **PALLAS)
        out = _on_mesh(fwd_fn, *args)
        _equal(out, _one_device(fwd_fn, *args), f"{op}_fwd")
        bwd_fn = lambda *a, mesh, bwd=bwd: bwd(*a, mesh=mesh, **PALLAS)
        saved = _one_device(fwd_fn, *args)[1:]
        _equal(_on_mesh(bwd_fn, dy, *saved), _one_device(bwd_fn, dy, *saved), f"{op}_bwd")
    fwd_fn = lambda x, w, mesh: fp8_act.rmsnorm_fwd(x, w, 1e-6, mesh=mesh, **PALLAS)
    _equal(_on_mesh(fwd_fn, x, w), _one_device(fwd_fn, x, w), "rmsnorm_fwd")
    saved = _one_device(fwd_fn, x, w)[1:]
    bwd_fn = lambda *a, mesh: fp8_act.rmsnorm_bwd(*a, mesh=mesh, **PALLAS)
    (dx, dw), (dx1, dw1) = _on_mesh(bwd_fn, dy, *saved, w), _one_device(bwd_fn, dy, *saved, w)
    _equal(dx, dx1, "rmsnorm_bwd dx")
    # The weight gradient is a psum of 8 partial sums: another summation order.
    np.testing.assert_allclose(dw, dw1, rtol=1e-5, atol=1e-6)


def test_fp8_layer_on_shards_equals_one_device():
    """FP8Config(mesh=...): an MLP block's loss and gradients, on 8 devices and on one."""
    d, f = 64, 128
    x = _activation((16, 4, d), 9)
    params = {
        "norm": 1.0 + 0.1 * jax.random.normal(jax.random.key(10), (d,)),
        "up": 0.1 * jax.random.normal(jax.random.key(11), (d, f)),
        "down": 0.1 * jax.random.normal(jax.random.key(12), (f, d)),
    }

    def loss(params, x, config):
        ops = fp8_ops.ops_for("coat", config)
        h = ops.linear(ops.rmsnorm(x, params["norm"], 1e-6), params["up"])
        out = ops.add(x, ops.linear(ops.mul(ops.silu(h), h), params["down"]))
        return jnp.mean(out.astype(jnp.float32) ** 2)

    one = fp8_ops.FP8Config(**PALLAS)
    sharded = fp8_ops.FP8Config(mesh=KMESH, **PALLAS)
    grad = jax.value_and_grad(loss)
    l1, g1 = jax.jit(lambda p, x: grad(p, x, one))(params, x)
    p_sh = jax.device_put(params, sharding.param_shardings(params, MESH))
    fn = jax.jit(lambda p, x: grad(p, x, sharded))
    l8, g8 = fn(p_sh, jax.device_put(x, BATCH))
    # Batch-split GEMMs and the weight-gradient psums add in another order.
    np.testing.assert_allclose(l8, l1, rtol=1e-6)
    for k in params:
        np.testing.assert_allclose(g8[k], g1[k], rtol=2e-3, atol=1e-6, err_msg=k)
    hlo = fn.lower(p_sh, jax.device_put(x, BATCH)).compile().as_text()
    assert (16, 4, d) not in _gathered_shapes(hlo) and (64, d) not in _gathered_shapes(hlo)

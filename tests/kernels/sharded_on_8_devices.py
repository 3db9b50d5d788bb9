"""Pallas kernels on operands sharded over 8 CPU devices, against one device (and the optimizer
wrappers' states on 8 devices: every test that needs 8 devices shares this one process).

Run by tests/kernels/test_sharded_kernels.py in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (the flag must be set before JAX starts).
The Pallas paths run in interpret mode inside ``shard_map``; each result must equal the one-device
result: bit for bit for per-element and per-group work and for per-tensor scales (a maximum is
exact in any order), to float32 rounding for a sum over the batch shards (RMSNorm's weight
gradient).
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax import contrib

import coat_jax
from coat_jax import fp8_ops
from coat_jax.training import sharding
from coat_jax.training.optimizers import PALLAS_INTERPRET_ENV
from pallas_kernels import dispatch, fp8_act, fp8_quant
from pallas_kernels.sharding import KernelMesh, group_aligned_spec
from tests.jaxprs import pallas_calls
from tests.kernels.contract import CPU_DEFAULT_EMITTERS
from tests.tiny_runs import tiny_run

if jax.device_count() != 8:
    pytest.skip(
        "needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/kernels/test_sharded_kernels.py)",
        allow_module_level=True,
    )

ROOT = Path(__file__).resolve().parents[2]
P = jax.sharding.PartitionSpec
MESH = sharding.make_mesh(2, 4)  # data x fsdp
KMESH = KernelMesh(MESH)
ONE_DEVICE = sharding.make_mesh(1, 1)
BATCH = jax.sharding.NamedSharding(MESH, P(("data", "fsdp")))
# The trainer's FSDP rule over 4 devices (whole 128-value groups per shard on the last axis):
SHAPES = {
    "q": (64, 512),  # the last axis, 128 columns per shard: whole groups
    "gate": (64, 1000),  # 250 columns per shard would split groups: rows instead
    "norm": (256,),  # 64 per shard would split a group, and there is no other axis: replicated
}
TRAINER_SPECS = {"q": P(None, "fsdp"), "gate": P("fsdp", None), "norm": P()}
# A user's own layout, the largest divisible axis without regard to groups: the kernel re-lays
# gate's shards out (all-to-all) and gathers norm whole.
NAIVE_SPECS = {"q": P(None, "fsdp"), "gate": P(None, "fsdp"), "norm": P("fsdp")}


def _equal(a, b, what=""):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, what
        np.testing.assert_array_equal(
            np.asarray(x, np.float32), np.asarray(y, np.float32), err_msg=what
        )


def test_auto_needs_a_mesh_on_several_devices():
    assert dispatch.candidates("auto", interpret=True) == ("xla",)
    assert dispatch.candidates("auto", interpret=True, mesh=KMESH) == ("pallas", "xla")


def test_trainer_rule_keeps_whole_groups_and_group_aligned_specs_adapt_others():
    assert {k: sharding.fsdp_spec(s, 4) for k, s in SHAPES.items()} == TRAINER_SPECS
    for k, s in SHAPES.items():
        # The trainer's layout is what the kernel runs under: nothing to move.
        kernel = jax.sharding.NamedSharding(
            MESH, group_aligned_spec(TRAINER_SPECS[k], s, MESH, 128)
        )
        assert kernel.is_equivalent_to(jax.sharding.NamedSharding(MESH, TRAINER_SPECS[k]), len(s))
    kernel = {k: group_aligned_spec(NAIVE_SPECS[k], s, MESH, 128) for k, s in SHAPES.items()}
    assert kernel == {"q": P(None, "fsdp"), "gate": P("fsdp", None), "norm": P(None)}


# --- the optimizer ------------------------------------------------------------------------


def _tree(seed, scale=1.0):
    keys = jax.random.split(jax.random.key(seed), len(SHAPES))
    return {
        k: scale * jax.random.normal(key, s)
        for key, (k, s) in zip(keys, SHAPES.items(), strict=True)
    }


def _optimizer(mesh, partition_specs=None):
    """``coat_adamw`` on ``mesh``; ``partition_specs`` ``None``: the trainer's rule."""
    if mesh is not None and partition_specs is None:
        partition_specs = lambda params: jax.tree.map(  # noqa: E731
            lambda s: s.spec, sharding.param_shardings(params, mesh)
        )
    return coat_jax.coat_adamw(
        1e-2,
        weight_decay=0.1,
        implementation="pallas",
        interpret=True,
        mesh=mesh,
        partition_specs=partition_specs,
    )


def _sharded_step(specs):
    """The optimizer step jitted on ``MESH`` with parameters, gradients and state laid out as
    ``specs`` (``None``: the trainer's rule)."""
    tx = _optimizer(MESH, specs)
    params = _tree(0)
    if specs is None:
        param_sh = sharding.param_shardings(params, MESH)
    else:
        param_sh = {k: jax.sharding.NamedSharding(MESH, s) for k, s in specs.items()}
    state = tx.init(jax.device_put(params, param_sh))
    if specs is None:
        state_sh = sharding.state_shardings(state, params, MESH)
    else:
        state_sh = jax.tree.map(lambda x: x.sharding, state)

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
    return [shape for _, shape in _gathers(hlo)]


def _gathers(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(element type, result shape)`` of each all-gather in compiled HLO text."""
    found = []
    for m in re.finditer(r"=\s*\(?([a-z0-9]+)\[([0-9,]*)\][^=]*?\ball-gather(?:-start)?\(", hlo):
        found.append((m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)))
    return found


def test_gather_parser_sees_an_all_gather():
    """The HLO parser the no-gather checks rely on finds XLA's all-gathers."""
    x = jax.device_put(jnp.ones((64, 512)), jax.sharding.NamedSharding(MESH, P(None, "fsdp")))
    gather = jax.jit(lambda x: x * 2, out_shardings=jax.sharding.NamedSharding(MESH, P()))
    assert ("f32", (64, 512)) in _gathers(gather.lower(x).compile().as_text())


def _grads():
    return [_tree(10 + t, scale=1e-2) for t in range(2)]


@functools.cache
def _one_device_steps():
    """Parameters and state after each step of :func:`_grads` on a mesh of one device (the
    plain kernel call, bit for bit: test_mesh_of_one_device_equals_no_mesh); both layouts
    compare with it, so it is traced once."""
    tx1 = _optimizer(ONE_DEVICE)
    ref_p = _tree(0)
    ref_s = tx1.init(ref_p)

    @jax.jit
    def ref_step(p, s, g):
        updates, s = tx1.update(g, s, p)
        return optax.apply_updates(p, updates), s

    steps = []
    for g in _grads():
        ref_p, ref_s = ref_step(ref_p, ref_s, g)
        steps.append((ref_p, ref_s))
    return steps


@pytest.mark.parametrize("layout", ["trainer", "naive"])
def test_optimizer_on_shards_equals_one_device_and_gathers_no_parameter(layout):
    specs = None if layout == "trainer" else NAIVE_SPECS
    jitted, params, state, param_sh = _sharded_step(specs)
    grads = _grads()
    compiled = jitted.lower(params, state, jax.device_put(grads[0], param_sh)).compile()
    hlo = compiled.as_text()
    gathered = {k for k, s in SHAPES.items() if s in set(_gathered_shapes(hlo))}
    if layout == "trainer":
        # Every group lies on one shard where it is stored: no communication at all.
        assert not gathered and "all-to-all" not in hlo, (gathered, _gathered_shapes(hlo))
    else:
        # Only the leaf that cannot split on group boundaries anywhere is gathered (explicitly);
        # the one whose last-axis split falls off group boundaries is re-laid out.
        assert gathered == {"norm"}, gathered
        assert "all-to-all" in hlo

    for t, (g, (ref_p, ref_s)) in enumerate(zip(grads, _one_device_steps(), strict=True), 1):
        params, state = compiled(params, state, jax.device_put(g, param_sh))
        # The kernels' outputs (the FP8 state) match bit for bit; the parameters are within
        # two float32 ulps of |p| ~ 1, since XLA fuses optax's apply differently in the two programs.
        _equal(state, ref_s, f"state after step {t}")
        for k in SHAPES:
            np.testing.assert_allclose(params[k], ref_p[k], rtol=0, atol=2.5e-7, err_msg=k)
    expected = TRAINER_SPECS if layout == "trainer" else NAIVE_SPECS
    assert {k: params[k].sharding.spec for k in SHAPES} == expected
    assert state[0].mu_codes["gate"].sharding.spec == expected["gate"]


def test_mesh_of_one_device_equals_no_mesh():
    """The sharded code path on a mesh of one device: the same bits as the plain kernel call
    (without a mesh on 8 devices "pallas" runs outside jit only: arrays on one device)."""
    params, grads = _tree(0), _tree(10, scale=1e-2)
    results = []
    # Compared bit for bit: XLA's default fusion emitters (tests/kernels/contract.py).
    exact = functools.partial(jax.jit, compiler_options=CPU_DEFAULT_EMITTERS)
    for mesh, step in ((None, lambda f: f), (ONE_DEVICE, exact)):
        tx = _optimizer(mesh)
        results.append(step(tx.update)(grads, tx.init(params), params))
    _equal(results[0], results[1])


def test_optimizer_without_mesh_stays_on_xla_with_auto():
    tx = coat_jax.coat_adamw(1e-2, interpret=True)  # auto, no mesh, 8 devices: jnp path
    params = jax.device_put(_tree(0), sharding.param_shardings(_tree(0), MESH))
    state = tx.init(params)
    hlo = jax.jit(tx.update).lower(params, state, params).as_text()
    assert "coat_adam_step" not in hlo


def test_optimizer_without_mesh_gathers_no_parameter():
    # An optax user's call: parameters sharded 8 ways, coat_adamw(lr) with no mesh.
    mesh8 = jax.make_mesh((8,), ("fsdp",))
    rows = jax.sharding.NamedSharding(mesh8, P("fsdp"))
    shape = (256, 256)
    p = {"w": jax.random.normal(jax.random.key(0), shape)}
    g = {"w": 1e-2 * jax.random.normal(jax.random.key(1), shape)}
    p8, g8 = jax.device_put(p, rows), jax.device_put(g, rows)

    auto = coat_jax.coat_adamw(1e-2, interpret=True)
    state8 = auto.init(p8)
    assert state8[0].mu_scale["w"].sharding.is_equivalent_to(rows, 2)
    step = jax.jit(auto.update)
    hlo = step.lower(g8, state8, p8).compile().as_text()
    big = [s for s in _gathered_shapes(hlo) if np.prod(s) >= np.prod(shape) // 8]
    assert not big, big
    one = jax.jit(auto.update)(g, auto.init(p), p)
    _equal(step(g8, state8, p8), one, "auto on 8 shards")

    # "pallas" inside jit cannot see where the operands live: refused in one line.
    pallas = coat_jax.coat_adamw(1e-2, implementation="pallas", interpret=True)
    with pytest.raises(ValueError, match=r"needs mesh= and partition_specs=") as refused:
        jax.jit(pallas.update)(g8, pallas.init(p8), p8)
    assert "\n" not in str(refused.value)
    # Outside jit it runs on each shard of the arrays' NamedSharding.
    updates, state = pallas.update(g8, pallas.init(p8), p8)
    assert updates["w"].sharding.is_equivalent_to(rows, 2)
    _equal((updates, state), pallas.update(g, pallas.init(p), p), "pallas on 8 shards")


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
    q, q1 = _on_mesh(fn, x), _one_device(fn, x)
    (codes, scale), (codes1, scale1) = (q.codes, q.scale), (q1.codes, q1.scale)
    assert np.asarray(scale).view(np.uint32) == np.asarray(scale1).view(np.uint32)
    scale_ref = fp8_quant.quantize_per_tensor_reference(x, fmt=fmt).scale
    assert np.asarray(scale).view(np.uint32) == np.asarray(scale_ref).view(np.uint32)
    _equal(codes, codes1)
    assert codes.sharding.spec == P(("data", "fsdp"))
    hlo = jax.jit(lambda x: fn(x, KMESH)).lower(jax.device_put(x, BATCH)).compile().as_text()
    assert "all-reduce" in hlo and (16, 96) not in _gathered_shapes(hlo)


def test_stacked_weights_quantized_once_on_the_mesh_equal_one_device():
    # fp8_weight_residual "once" on a kernel mesh: the stacked weights, split by the FSDP rule,
    # give each layer the codes and scale of the unsharded quantizer, bit for bit.
    w = (
        jax.random.normal(jax.random.key(7), (3, 64, 256))
        * jnp.array([1e-2, 1.0, 30.0])[:, None, None]
    )
    w = w.at[1, 3, 200].set(-90.0)
    spec = P(None, *KMESH.param_spec(w.shape[1:]))
    w_sh = jax.device_put(w, jax.sharding.NamedSharding(MESH, spec))
    config = fp8_ops.FP8Config(mesh=KMESH, **PALLAS)
    q = jax.jit(lambda w: fp8_ops.quantize_weight(w, config))(w_sh)
    q1 = jax.jit(lambda w: fp8_ops.quantize_weight(w, fp8_ops.FP8Config(**PALLAS)))(w)
    assert np.array_equal(np.asarray(q.scale).view(np.uint32), np.asarray(q1.scale).view(np.uint32))
    _equal(q.codes, q1.codes)


def test_per_tensor_quantizer_of_a_weight_on_its_fsdp_shards():
    w = jax.random.normal(jax.random.key(4), (64, 256)).at[3, 200].set(-50.0)
    spec = KMESH.param_spec(w.shape)
    assert spec == P("fsdp", None)  # 64 columns per shard would split groups: rows
    w_sh = jax.device_put(w, jax.sharding.NamedSharding(MESH, spec))
    fn = jax.jit(lambda w: fp8_quant.quantize_per_tensor(w, mesh=KMESH, partition=spec, **PALLAS))
    q, q1 = fn(w_sh), jax.jit(lambda w: fp8_quant.quantize_per_tensor(w, **PALLAS))(w)
    (codes, scale), (codes1, scale1) = (q.codes, q.scale), (q1.codes, q1.scale)
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


# --- FSDP's weight all-gather ---------------------------------------------------------------


def test_gathered_weight_codes_travel_as_fp8_not_float32():
    w = jax.random.normal(jax.random.key(13), (64, 256))
    spec = KMESH.param_spec(w.shape)
    w_sh = jax.device_put(w, jax.sharding.NamedSharding(MESH, spec))
    x = jax.device_put(jax.random.normal(jax.random.key(14), (16, 64)), BATCH)

    def gemm(x, w, gather):
        q = fp8_quant.quantize_per_tensor(w, mesh=KMESH, partition=spec, **PALLAS)
        codes, scale = q.codes, q.scale
        codes = KMESH.gathered(codes) if gather else codes
        return (x @ codes.astype(jnp.float32)) * scale

    types, outs = {}, {}
    for gather in (False, True):
        fn = jax.jit(lambda x, w, gather=gather: gemm(x, w, gather))
        hlo = fn.lower(x, w_sh).compile().as_text()
        types[gather] = {t for t, shape in _gathers(hlo) if shape == w.shape}
        outs[gather] = fn(x, w_sh)
    assert types[False] == {"f32"}, types  # the float32 operand the codes are converted to
    # The codes themselves (XLA:CPU moves FP8 as f16 through its collectives).
    assert types[True] and "f32" not in types[True], types
    _equal(outs[True], outs[False])


# --- optimizer states on 8 devices (the optax wrappers, XLA's path) ---------------------------


def test_fp8_state_keeps_the_trainers_placement_and_equals_one_device():
    """coat_jax.fp8_state around optax's adamw and muon on the trainer's mesh (automatic axes:
    under explicit axes, quant's grouping reshape of a last axis split 4 ways into 2 groups needs
    an out_sharding it does not give)."""
    shapes = {"w": (64, 256), "u": (16, 4096), "b": (512,)}
    # The trainer's placement: each parameter split along its largest divisible axis (the last
    # only into whole 128-value groups: w's 64 columns per shard would not be).
    specs = {k: sharding.fsdp_spec(s, 4) for k, s in shapes.items()}
    assert specs == {"w": P("fsdp", None), "u": P(None, "fsdp"), "b": P("fsdp")}

    def place(tree):
        return {
            k: jax.device_put(v, jax.sharding.NamedSharding(MESH, specs[k]))
            for k, v in tree.items()
        }

    ones = {k: jnp.ones(s) for k, s in shapes.items()}
    grads = [
        {k: jax.random.normal(jax.random.key(i), s) for k, s in shapes.items()} for i in range(2)
    ]
    for make in (lambda: optax.adamw(1e-2), lambda: contrib.muon(1e-2)):
        tx = coat_jax.fp8_state(make())
        params = place(ones)
        state = tx.init(params)
        before = [(x.dtype, x.sharding) for x in jax.tree.leaves(state)]
        step = jax.jit(tx.update, donate_argnums=(1,))
        for g in grads:
            u, state = step(place(g), state, params)
            params = optax.apply_updates(params, u)
        after = [(x.dtype, x.sharding) for x in jax.tree.leaves(state)]
        for (d0, s0), (d1, s1) in zip(before, after, strict=True):
            assert d0 == d1, (d0, d1)
            assert s0.is_equivalent_to(s1, 2), (s0, s1)
        # The trainer's rule (key-path suffix) gives every leaf the placement init chose.
        rule = sharding.state_shardings(state, params, MESH)
        for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(rule), strict=True):
            if x.ndim:
                assert x.sharding.is_equivalent_to(s, x.ndim), (x.shape, x.sharding, s)
        same = [x for x in jax.tree.leaves(state) if x.shape == (16, 32)]
        assert same and all(x.sharding.spec == P(None, "fsdp") for x in same)
        assert all(x.addressable_shards[0].data.shape == (16, 8) for x in same)
        codes = [x for x in jax.tree.leaves(state) if x.dtype == jnp.float8_e4m3fn]
        rows = jax.sharding.NamedSharding(MESH, P("fsdp", None))
        flags = [x.sharding.is_equivalent_to(rows, 2) for x in codes if x.shape == (64, 256)]
        assert flags and all(flags), flags
        ref, st1 = dict(ones), tx.init(ones)
        for g in grads:
            u, st1 = jax.jit(tx.update)(g, st1, ref)
            ref = optax.apply_updates(ref, u)
        for k in shapes:
            np.testing.assert_allclose(
                np.asarray(params[k]), np.asarray(ref[k]), rtol=1e-5, atol=1e-6
            )


def test_coat_adamw_on_a_users_mesh_keeps_its_placement_and_equals_one_device():
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
    specs = {"w": P("fsdp", None), "u": P(None, "fsdp"), "b": P("fsdp")}
    shapes = {"w": (64, 256), "u": (16, 4096), "b": (512,)}
    params = {
        k: jax.device_put(jnp.ones(s), jax.sharding.NamedSharding(mesh, specs[k]))
        for k, s in shapes.items()
    }
    tx = coat_jax.coat_adamw(1e-2)
    state = tx.init(params)
    step = jax.jit(tx.update, donate_argnums=(1,))
    before = [(x.dtype, x.sharding) for x in jax.tree.leaves(state)]
    for i in range(2):
        g = {
            k: jax.device_put(
                jax.random.normal(jax.random.key(i), s),
                jax.sharding.NamedSharding(mesh, specs[k]),
            )
            for k, s in shapes.items()
        }
        u, state = step(g, state, params)
        params = optax.apply_updates(params, u)
    after = [(x.dtype, x.sharding) for x in jax.tree.leaves(state)]
    for (d0, s0), (d1, s1) in zip(before, after, strict=True):
        assert d0 == d1, (d0, d1)
        assert s0.is_equivalent_to(s1, 2), (s0, s1)
    cs = state[0]
    assert cs.mu_codes["w"].sharding.spec == P("fsdp", None)
    assert cs.mu_scale["u"].sharding.spec == P(None, "fsdp")
    assert cs.mu_scale["u"].addressable_shards[0].data.shape == (16, 8)
    assert params["w"].sharding.spec == P("fsdp", None)
    # Same numbers as one device.
    ref = {k: jnp.ones(s) for k, s in shapes.items()}
    tx1 = coat_jax.coat_adamw(1e-2)
    st1 = tx1.init(ref)
    for i in range(2):
        g = {k: jax.random.normal(jax.random.key(i), s) for k, s in shapes.items()}
        u, st1 = jax.jit(tx1.update)(g, st1, ref)
        ref = optax.apply_updates(ref, u)
    for k in shapes:
        np.testing.assert_allclose(np.asarray(params[k]), np.asarray(ref[k]), rtol=1e-6)


# --- the trainer ----------------------------------------------------------------------------

# One configuration for both trainer tests, so that the 8-device step program the first one
# compiles is loaded from the test run's compilation cache by the second: scanned layers whose MLP
# weights are wide enough that some split their last axis (128 columns on each of 4 devices).
TINY = [
    *tiny_run(intermediate=512, layers=2),
    "memory.scan_layers=true",
    "steps=6",
    "xla.compilation_cache_dir=null",
    "precision.compute_dtype=float32",
]
EIGHT = ["mesh.data=2", "mesh.fsdp=4"]
# The trainer's kernels in Pallas interpret mode, as a CPU needs (the test-only switch; this
# module runs in a process of its own).
os.environ[PALLAS_INTERPRET_ENV] = "1"
KERNELS = {
    "coat_adamw_apply",  # the trainer's default fused_apply: the kernel also writes the weight
    "fp8_scaled_cast",
    "fp8_rmsnorm_fwd",
    "fp8_rmsnorm_bwd",
    "fp8_silu_fwd",
    "fp8_silu_bwd",
    "fp8_mul_fwd",
    "fp8_mul_bwd",
}


def _config(*overrides):
    from coat_jax.training import load_config

    return load_config(ROOT / "configs" / "default.yaml", [*TINY, *overrides])


def _abstract(tree, shardings):
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings
    )


def test_trainer_step_runs_each_kernel_per_shard_and_its_optimizer_gathers_nothing():
    from coat_jax.training.program import build_program

    cfg = _config(*EIGHT)
    program = build_program(cfg, cfg.model)
    params = _abstract(program.abstract_params, program.param_shardings)
    state = _abstract(program.abstract_opt_state, program.opt_shardings)
    batch = jax.ShapeDtypeStruct((1, 8, 33), jnp.int32, sharding=program.batch_sharding)
    # One trace of the step serves the jaxpr checks here and the compiled HLO's below.
    traced = program.step_fn.trace(params, state, batch)
    calls = pallas_calls(traced.jaxpr.jaxpr)
    assert KERNELS <= {name for name, _ in calls}, calls
    assert all(inside for _, inside in calls), [c for c in calls if not c[1]]

    specs = [s.spec for s in jax.tree.leaves(program.param_shardings)]
    assert P(None, None, "fsdp") in specs and P(None, "fsdp", None) in specs, specs

    def optax_way(p, s, g):
        updates, s = program.tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    def fused_way(p, s, g):
        return coat_jax.apply_gradients(program.tx, g, s, p)

    shapes = {p.shape for p in jax.tree.leaves(program.abstract_params)}
    for optimizer_step in (fused_way, optax_way):
        hlo = (
            jax.jit(
                optimizer_step,
                in_shardings=(
                    program.param_shardings,
                    program.opt_shardings,
                    program.param_shardings,
                ),
                out_shardings=(program.param_shardings, program.opt_shardings),
            )
            .lower(params, state, params)
            .compile()
            .as_text()
        )
        # Every group lies on one shard where it is stored: nothing is gathered or re-laid out.
        assert not shapes & set(_gathered_shapes(hlo)), (optimizer_step, _gathered_shapes(hlo))
        assert "all-to-all" not in hlo, optimizer_step

    # The forward and backward all-gather each FSDP-split linear weight as its FP8 codes
    # (XLA:CPU moves FP8 through collectives as f16), never as the float32 master or its
    # float32 or BF16 GEMM operand.
    step_hlo = traced.lower().compile().as_text()
    # With fp8_weight_residual "once" the codes are a scan input: XLA gathers the [1, K, N]
    # slice of the stack before dropping its unit axis.
    stacked = [p.shape for p in jax.tree.leaves(program.abstract_params) if p.ndim == 3]
    weights = {s[1:] for s in stacked} | {(1, *s[1:]) for s in stacked}
    weight_gathers = [(t, shape) for t, shape in _gathers(step_hlo) if shape in weights]
    assert weight_gathers, _gathers(step_hlo)
    assert all(t not in ("f32", "bf16") for t, _ in weight_gathers), weight_gathers
    # One layer's codes at a time: no device gathers the whole stack of them.
    assert not set(stacked) & {shape for _, shape in _gathers(step_hlo)}, _gathers(step_hlo)


def test_train_on_8_devices_equals_one_device_with_the_kernels(tmp_path):
    from coat_jax.training import train

    # Fake CPU devices share a small thread pool; one program at a time keeps their
    # collectives from waiting on each other (as tests/training/test_train.py does).
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    try:
        results = {}
        for name, mesh in (("one", ["mesh.data=1", "mesh.fsdp=1"]), ("eight", EIGHT)):
            cfg = _config(
                *mesh,
                f"output_dir={tmp_path / name}",
                f"data.cache_dir={tmp_path / 'tokens'}",
            )
            results[name] = train(cfg, stop_at=4, say=lambda line: None)
    finally:
        jax.config.update("jax_cpu_enable_async_dispatch", True)
    losses = {}
    for name in results:
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        losses[name] = [r["loss"] for r in map(json.loads, lines) if "loss" in r]
    assert len(losses["one"]) == len(losses["eight"]) == 4
    worst = max(abs(a - b) / b for a, b in zip(losses["eight"], losses["one"], strict=True))
    p1, p8 = (
        np.concatenate([np.ravel(x) for x in jax.tree.leaves(jax.device_get(results[n].params))])
        for n in ("one", "eight")
    )
    rel = float(np.linalg.norm(p8 - p1) / np.linalg.norm(p1))
    print(
        f"kernels, 8 vs 1 device: worst relative loss difference {worst:.2e}, parameters {rel:.2e}"
    )
    # tests/training/test_train.py::test_eight_devices_match_one's tolerances (8 devices add partial sums
    # in another order; Adam turns that into parameter steps of up to ~lr). Four steps: past the
    # first warm-up steps, whose updates are too small to show a difference.
    assert worst < 1e-4
    assert rel < 5e-3

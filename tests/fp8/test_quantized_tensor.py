"""The one quantized-tensor pytree (pallas_kernels.quant.QuantizedTensor) and where it travels.

Codecs, kernels, FP8 ops and the optimizer all hand quantized values around as this type; these
tests check that they do, that it behaves as a pytree with static layout metadata, that its
``dequantize`` is the codec functions' result bit for bit, and that the residuals the FP8 ops keep
are still FP8 codes under the remat names the policies select by.
"""

from __future__ import annotations

import contextlib
import io
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import coat_jax
from coat_jax import fp8_ops, memory, optim, quant
from pallas_kernels import coat_adam as ca
from pallas_kernels import fp8_act, fp8_quant

QT = quant.QuantizedTensor
INTERPRET = jax.default_backend() != "gpu"
XLA = fp8_ops.FP8Config(implementation="xla")
HYPER = dict(b1=0.9, b2=0.999, eps=1e-8, expand_min=16)


def _data(shape, seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape).astype(dtype)


def _bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def _layout(q):
    return (q.fmt, q.granularity, q.group_size, q.expansion)


# --- what the codecs, kernels and ops return ------------------------------------------------


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_codecs_return_the_type_with_their_layout(fmt):
    x = _data((3, 200))
    absmax = quant.quantize_absmax(x, group_size=64, fmt=fmt)
    dre = quant.quantize_dre(x, group_size=64, fmt=fmt)
    assert isinstance(absmax, QT) and isinstance(dre, QT)
    assert _layout(absmax) == (fmt, "group", 64, False)
    assert _layout(dre) == (fmt, "group", 64, True)
    assert absmax.codes.dtype == quant.FORMATS[fmt] and absmax.shape == x.shape
    assert absmax.scale.shape == dre.expand.shape == (3, quant.num_groups(200, 64))


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_activation_quantizers_and_kernels_return_the_type(implementation):
    kw = dict(implementation=implementation, interpret=INTERPRET)
    x, y = _data((4, 64), 1, jnp.bfloat16), _data((4, 64), 2, jnp.bfloat16)
    per_group = fp8_quant.quantize_per_group(x, group_size=16, **kw)
    assert isinstance(per_group, QT) and _layout(per_group) == ("e4m3", "group", 16, False)
    per_tensor = fp8_quant.quantize_per_tensor(x, fmt="e5m2", **kw)
    assert isinstance(per_tensor, QT) and _layout(per_tensor) == ("e5m2", "tensor", None, False)
    assert per_tensor.scale.shape == ()
    outputs = {
        "rmsnorm": fp8_act.rmsnorm_fwd(x, jnp.ones(64), 1e-6, **kw),
        "silu": fp8_act.silu_fwd(x, **kw),
        "mul": fp8_act.mul_fwd(x, y, **kw),
        "swiglu": fp8_act.swiglu_fwd(x, y, **kw),
    }
    for op, (out, *saved) in outputs.items():
        assert out.shape == x.shape, op
        # rmsnorm also returns its float32 1/rms; every quantized input is one QuantizedTensor.
        quantized = saved[:1] if op == "rmsnorm" else saved
        assert len(quantized) == (2 if op in ("mul", "swiglu") else 1), op
        for q in quantized:
            assert isinstance(q, QT) and _layout(q) == ("e4m3", "group", 16, False), op
    # Backward takes them as they came.
    dy = _data((4, 64), 3, jnp.bfloat16)
    dx = fp8_act.silu_bwd(dy, outputs["silu"][1], **kw)
    assert dx.shape == x.shape and dx.dtype == dy.dtype


def test_backward_kernels_refuse_bare_codes():
    x = _data((4, 32), dtype=jnp.bfloat16)
    _, x_q = fp8_act.silu_fwd(x, implementation="xla")
    with pytest.raises(TypeError, match="QuantizedTensor"):
        fp8_act.silu_bwd(x, (x_q.codes, x_q.scale), implementation="xla")


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("expansion", [True, False])
def test_optimizer_kernels_take_and_return_the_type(implementation, expansion):
    spec = ca.MomentSpec(nu_format="e5m2", expansion=expansion)
    shape = (2, 256)
    mu = ca.quantize_moment(jnp.zeros(shape), spec.mu_format, spec, 16)
    nu = ca.quantize_moment(jnp.zeros(shape), spec.nu_format, spec, 16)
    g = _data(shape, 4)
    kw = dict(count=1, spec=spec, implementation=implementation, interpret=INTERPRET, **HYPER)
    u, new_mu, new_nu = ca.coat_adam_step(g, mu, nu, **kw)
    p, fused_mu, fused_nu = ca.coat_adamw_apply(
        g, g, mu, nu, learning_rate=1e-3, weight_decay=0.1, **kw
    )
    assert u.shape == p.shape == shape
    for q, fmt in ((new_mu, "e4m3"), (new_nu, "e5m2"), (fused_mu, "e4m3"), (fused_nu, "e5m2")):
        assert isinstance(q, QT) and _layout(q) == (fmt, "group", 128, expansion)
        assert jax.tree.structure(q) == jax.tree.structure(mu if fmt == "e4m3" else nu)


def test_optimizer_step_refuses_moments_of_another_group_size():
    spec = ca.MomentSpec()
    mu = quant.quantize_dre(jnp.zeros((2, 256)), group_size=64)
    with pytest.raises(ValueError, match="group_size=64.*groups of 128"):
        ca.coat_adam_step_reference(jnp.zeros((2, 256)), mu, mu, count=1, spec=spec, **HYPER)


# --- a pytree with static layout ------------------------------------------------------------


def test_absent_statistics_are_not_leaves():
    x = _data((2, 128))
    assert len(jax.tree.leaves(quant.quantize_absmax(x))) == 2
    assert len(jax.tree.leaves(quant.quantize_dre(x))) == 4
    for q in (quant.quantize_absmax(x), quant.quantize_dre(x)):
        assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(q))


@pytest.mark.parametrize("expansion", [True, False])
def test_round_trip_through_jit_eval_shape_and_vmap(expansion):
    x = _data((4, 256), 5)
    q = quant.quantize_dre(x) if expansion else quant.quantize_absmax(x)
    leaves, treedef = jax.tree.flatten(q)
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert _layout(rebuilt) == _layout(q) and all(
        a is b for a, b in zip(jax.tree.leaves(rebuilt), leaves, strict=True)
    )
    through_jit = jax.jit(lambda q: q)(q)
    assert jax.tree.structure(through_jit) == treedef
    for a, b in zip(jax.tree.leaves(through_jit), leaves, strict=True):
        _bits_equal(a, b)
    shapes = jax.eval_shape(lambda q: q, q)
    assert jax.tree.structure(shapes) == treedef and shapes.nbytes == q.nbytes
    # vmap over the leading axis: each row is a quantized tensor of its own.
    per_row = jax.vmap(lambda q: q.dequantize())(q)
    _bits_equal(per_row, q.dequantize())
    made_per_row = jax.vmap(quant.quantize_dre if expansion else quant.quantize_absmax)(x)
    assert jax.tree.structure(made_per_row) == treedef
    for a, b in zip(jax.tree.leaves(made_per_row), leaves, strict=True):
        _bits_equal(a, b)


def test_layout_is_static_so_only_a_new_layout_retraces():
    traces = []

    @jax.jit
    def dequantize(q):
        traces.append(_layout(q))
        return q.dequantize()

    a = quant.quantize_absmax(_data((2, 128), 6))
    dequantize(a)
    dequantize(quant.quantize_absmax(_data((2, 128), 7)))  # new values, same layout
    assert traces == [_layout(a)]
    # The same arrays under another label: only the static metadata differs, and it retraces.
    relabelled = a.replace(fmt="e5m2")
    dequantize(relabelled)
    assert traces == [_layout(a), _layout(relabelled)]
    assert jax.tree.structure(a) != jax.tree.structure(relabelled)
    assert all(x is y for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(relabelled), strict=True))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(fmt="e3m4", granularity="group", group_size=16), "e3m4"),
        (dict(fmt="e4m3", granularity="block", group_size=16), "granularity='block'"),
        (dict(fmt="e4m3", granularity="group"), "group_size"),
        (dict(fmt="e4m3", granularity="tensor", group_size=16), "no group size"),
    ],
)
def test_bad_layouts_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QT(jnp.zeros(16, jnp.float8_e4m3fn), jnp.ones(1), **kwargs)


def test_dre_statistics_come_in_pairs():
    ones = jnp.ones((1,))
    with pytest.raises(ValueError, match="expand and center"):
        QT(jnp.zeros(16), ones, ones, fmt="e4m3", granularity="group", group_size=16)
    with pytest.raises(ValueError, match="per group"):
        QT(jnp.zeros(16), ones, ones, ones, fmt="e4m3", granularity="tensor")


# --- numerics: dequantize is the codecs' decode, bit for bit ---------------------------------


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(3, 256), (5, 300), (77,)])
def test_dequantize_equals_the_codec_functions(fmt, shape):
    x = _data(shape, 8) * jnp.exp(_data(shape, 9) * 4)
    d = quant.quantize_dre(x, group_size=128, fmt=fmt)
    _bits_equal(
        d.dequantize(), quant.dequantize_dre(d.codes, d.scale, d.expand, d.center, group_size=128)
    )
    a = quant.quantize_absmax(x, group_size=16, fmt=fmt)
    _bits_equal(a.dequantize(), quant.dequantize_absmax(a.codes, a.scale, group_size=16))
    t = fp8_quant.quantize_per_tensor(x, fmt=fmt, implementation="xla")
    _bits_equal(t.dequantize(), t.codes.astype(jnp.float32) * t.scale)


def test_nbytes_counts_codes_and_present_statistics():
    shape = (6, 300)
    groups = math.prod(shape[:-1]) * quant.num_groups(shape[-1], 128)
    x = _data(shape, 10)
    for q, stats in ((quant.quantize_absmax(x), 1), (quant.quantize_dre(x), 3)):
        itemsize = jnp.dtype(jnp.float32).itemsize
        assert q.nbytes == math.prod(shape) + stats * groups * itemsize
        assert q.nbytes == quant.state_bytes(q) == jax.eval_shape(lambda q: q, q).nbytes
    t = fp8_quant.quantize_per_tensor(x, implementation="xla")
    assert t.nbytes == math.prod(shape) + jnp.dtype(jnp.float32).itemsize


# --- the FP8 ops keep quantized tensors, named for remat --------------------------------------


def _fp8_op_cases():
    x = jax.ShapeDtypeStruct((4, 8, 64), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((64,), jnp.float32)
    return {
        "silu": (lambda x: fp8_ops.fp8_silu(x, XLA), (x,)),
        "mul": (lambda a, b: fp8_ops.fp8_mul(a, b, XLA), (x, x)),
        "rmsnorm": (lambda x, w: fp8_ops.fp8_rmsnorm(x, w, 1e-6, XLA), (x, w)),
        # A weight of another size than the activation, so that sizes tell them apart.
        "linear": (lambda x: fp8_ops.fp8_linear(x, jnp.ones((64, 48)), XLA), (x,)),
    }


@pytest.mark.parametrize("op", ["silu", "mul", "rmsnorm", "linear"])
def test_fp8_op_residuals_are_fp8_codes(op):
    fn, args = _fp8_op_cases()[op]
    kept = memory.residuals(fn, *args)
    activation = args[0].shape
    big = [r for r in kept if math.prod(r.shape) == math.prod(activation)]
    # Each saved activation is one FP8 copy; nothing activation-sized is float32 or bfloat16.
    assert big and all(r.dtype in quant.FORMATS.values() for r in big), kept
    with contextlib.redirect_stdout(io.StringIO()) as out:
        jax.ad_checkpoint.print_saved_residuals(fn, *args)
    lines = out.getvalue().splitlines()
    printed = [re.match(r"(\w+)\[([\d,]*)\]", line) for line in lines]
    assert all(printed), lines
    big = [
        (m.group(1), line)
        for m, line in zip(printed, lines, strict=True)
        if math.prod(int(d) for d in m.group(2).split(",") if d) == math.prod(activation)
    ]
    assert big and all(dtype == "f8_e4m3fn" for dtype, _ in big), lines
    assert all(f"named '{fp8_ops.ACTIVATION}'" in line for _, line in big), lines


@pytest.mark.parametrize("op", ["silu", "mul", "rmsnorm"])
def test_remat_policy_selects_the_quantized_residuals_by_name(op):
    fn, args = _fp8_op_cases()[op]
    plain = memory.residuals(fn, *args)
    save = jax.checkpoint_policies.save_only_these_names(fp8_ops.ACTIVATION)
    named = memory.residuals(jax.checkpoint(fn, policy=save), *args)
    # The policy keeps exactly what the op tags (codes and scales), and nothing when the name
    # is not saved: the tags sit on the quantized tensors' leaves.
    assert sorted((r.shape, r.dtype.name) for r in named) == sorted(
        (r.shape, r.dtype.name) for r in plain if r.is_activation
    )
    other = jax.checkpoint_policies.save_only_these_names("some_other_name")
    assert not any(
        r.dtype in quant.FORMATS.values()
        for r in memory.residuals(jax.checkpoint(fn, policy=other), *args)
    )


def test_named_tags_every_leaf():
    q = quant.quantize_dre(_data((2, 128)))
    jaxpr = jax.make_jaxpr(lambda q: quant.named(q, "kept"))(q)
    names = [e.params["name"] for e in jaxpr.eqns if e.primitive.name == "name"]
    assert names == ["kept"] * len(jax.tree.leaves(q))


# --- the optimizer state keeps its flat layout ------------------------------------------------


@pytest.mark.parametrize("expansion", [True, False])
def test_optimizer_state_layout_is_unchanged_by_the_view(expansion):
    params = {"w": _data((4, 256)), "b": _data((256,)), "s": jnp.float32(1.0)}
    tx = coat_jax.scale_by_coat_adam(expansion=expansion, implementation="xla")
    state = tx.init(params)
    assert type(state) is optim.ScaleByCoatAdamState
    treedef = jax.tree.structure(params)
    mus = optim.moments_of(state, treedef, "mu", 128)
    nus = optim.moments_of(state, treedef, "nu", 128)
    by_name = dict(zip(("b", "s", "w"), mus, strict=True))  # dict leaves in key order
    assert isinstance(by_name["w"], QT) and by_name["w"].expansion == expansion
    assert not isinstance(by_name["s"], QT)  # a scalar keeps its float32 moment
    shapes = [p.shape for p in jax.tree.leaves(params)]
    rebuilt = optim._state_from_leaves(state.count, treedef, mus, nus, shapes)
    # Same fields, key paths, leaves (the very arrays) and MaskedNodes: checkpoints restore.
    paths = lambda s: [p for p, _ in jax.tree_util.tree_flatten_with_path(s)[0]]
    assert jax.tree.structure(rebuilt) == jax.tree.structure(state)
    assert paths(rebuilt) == paths(state)
    assert all(
        a is b for a, b in zip(jax.tree.leaves(rebuilt), jax.tree.leaves(state), strict=True)
    )
    masked = jax.tree.leaves(state.mu_expand, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
    assert all(isinstance(m, optax.MaskedNode) for m in masked) == (not expansion)

"""The one kernel dispatcher (pallas_kernels/dispatch.py) on odd shapes, for every op.

For each op: ``"xla"`` is the reference; ``"auto"`` runs the Pallas kernel where it applies and
falls back to the reference where the kernel raises ``NotImplementedError``; ``"pallas"`` raises
a ``ValueError`` that names the shape and the fix where it cannot run. Off a GPU the kernels run
in interpret mode (``interpret=True``, with which ``"auto"`` tries them too).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import coat_adam as ca
from pallas_kernels import dispatch, fp8_act, fp8_quant

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
HYPER = dict(b1=0.9, b2=0.999, eps=1e-8, expand_min=16)
# 1560 = 97.5 groups of 16 and 12.2 groups of 128. Whether a kernel takes a shape turns on its
# last axis only, so the rows are few: every op runs on it.
ODD = (48, 1560)
# 3 groups of 16: the element-wise kernels take it, RMSNorm's (whole rows) do not.
THREE_GROUPS = (6, 48)


def _data(shape, seed=0, dtype=jnp.bfloat16):
    return jax.random.normal(jax.random.key(seed), shape).astype(dtype)


def _equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def _saved(op, x):
    """What each op's forward saves (from the reference), for its backward's inputs."""
    if op == "rmsnorm":
        return fp8_act.rmsnorm_fwd_reference(x, jnp.ones(x.shape[-1]), 1e-6)[1:]
    if op == "silu":
        return fp8_act.silu_fwd_reference(x)[1:]
    return getattr(fp8_act, f"{op}_fwd_reference")(x, x)[1:]


def _calls(shape):
    """name -> (fn(*args, implementation=, interpret=), args) for every activation-side op."""
    x = _data(shape)
    w = jnp.ones(shape[-1])
    calls = {
        "quantize_per_group": (fp8_quant.quantize_per_group, (x,)),
        "quantize_per_tensor": (fp8_quant.quantize_per_tensor, (x,)),
        "rmsnorm_fwd": (lambda x, w, **k: fp8_act.rmsnorm_fwd(x, w, 1e-6, **k), (x, w)),
        "rmsnorm_bwd": (fp8_act.rmsnorm_bwd, (x, *_saved("rmsnorm", x), w)),
        "silu_fwd": (fp8_act.silu_fwd, (x,)),
        "silu_bwd": (fp8_act.silu_bwd, (x, *_saved("silu", x))),
    }
    for op in ("mul", "swiglu"):
        calls[f"{op}_fwd"] = (getattr(fp8_act, f"{op}_fwd"), (x, x))
        calls[f"{op}_bwd"] = (getattr(fp8_act, f"{op}_bwd"), (x, *_saved(op, x)))
    return calls


def _supported(name, shape):
    return fp8_act.pallas_supports("rmsnorm" if name.startswith("rmsnorm") else "silu", shape)


@pytest.mark.parametrize("shape", [ODD, THREE_GROUPS], ids=str)
def test_activation_ops_on_odd_shapes(shape):
    for name, (fn, args) in _calls(shape).items():
        # Arguments, not captured constants: XLA would constant-fold the whole op.
        run = jax.jit(
            lambda *a, impl, fn=fn: fn(*a, implementation=impl, interpret=INTERPRET),
            static_argnames="impl",
        )
        auto = run(*args, impl="auto")
        if _supported(name, shape):
            # The kernel applies, so "auto" is the kernel, bit for bit.
            _equal(auto, run(*args, impl="pallas"))
        else:
            _equal(auto, run(*args, impl="xla"))
            with pytest.raises(ValueError, match=rf"cannot run {name}.*{shape}.*'auto'"):
                run(*args, impl="pallas")


def test_candidates():
    if not ON_GPU:
        assert dispatch.candidates("auto", interpret=False) == ("xla",)
        with pytest.raises(ValueError, match="interpret=True"):
            fp8_quant.quantize_per_group(_data((4, 32)), implementation="pallas")
    assert dispatch.candidates("auto", interpret=True) == ("pallas", "xla")
    assert dispatch.candidates("pallas", interpret=False) == ("pallas",)
    assert dispatch.candidates("xla", interpret=True) == ("xla",)
    with pytest.raises(ValueError, match="valid values"):
        dispatch.candidates("mosaic", interpret=False)


def _moments(shape, spec):
    zero = ca.quantize_moment(jnp.zeros(shape, jnp.float32), "e4m3", spec, 16)
    return zero, zero


def test_optimizer_step_on_an_odd_shape():
    """48 x 1560: a last axis with a short, masked last group of 24 values (13 groups of 128 per
    row, the last one short). The rows are few because interpret mode is slow; 16 groups per
    program make 39 programs."""
    shape = ODD
    spec = ca.MomentSpec()
    g = _data(shape, seed=1, dtype=jnp.float32)
    mu, nu = _moments(shape, spec)
    kw = dict(count=1, spec=spec, interpret=INTERPRET, config=ca.KernelConfig(block_rows=16))
    step = jax.jit(
        lambda g, mu, nu, impl: ca.coat_adam_step(g, mu, nu, implementation=impl, **kw, **HYPER),
        static_argnums=3,
    )
    pallas = step(g, mu, nu, "pallas")
    _equal(step(g, mu, nu, "auto"), pallas)
    u_ref, mu_ref, _ = ca.coat_adam_step_reference(g, mu, nu, count=1, spec=spec, **HYPER)
    np.testing.assert_allclose(pallas[0], u_ref, rtol=1e-5)
    differ = np.asarray(pallas[1].codes, np.float32) != np.asarray(mu_ref.codes, np.float32)
    assert differ.mean() <= 0.005  # rounding ties only
    np.testing.assert_allclose(pallas[1].expand, mu_ref.expand, rtol=0)


@pytest.mark.parametrize("apply", [False, True], ids=["step", "fused apply"])
def test_optimizer_falls_back_for_a_group_size_the_kernel_lacks(apply):
    spec = ca.MomentSpec(group_size=96)
    shape = (3, 200)
    g = _data(shape, seed=2, dtype=jnp.float32)
    p = _data(shape, seed=3, dtype=jnp.float32)
    mu, nu = _moments(shape, spec)
    kw = dict(count=1, spec=spec, **HYPER)
    if apply:
        kw |= dict(learning_rate=1e-3, weight_decay=0.1)
        fn, ref = ca.coat_adamw_apply, ca.coat_adamw_apply_reference(p, g, mu, nu, **kw)
        args = (p, g, mu, nu)
    else:
        fn, ref = ca.coat_adam_step, ca.coat_adam_step_reference(g, mu, nu, **kw)
        args = (g, mu, nu)
    _equal(fn(*args, implementation="auto", interpret=INTERPRET, **kw), ref)
    with pytest.raises(ValueError, match=r"cannot run coat_adam.*power-of-two group_size, got 96"):
        fn(*args, implementation="pallas", interpret=INTERPRET, **kw)


def test_bad_inputs_are_errors_not_fallbacks():
    """A shape mismatch is the caller's bug: "auto" must raise it, not hide it behind XLA."""
    spec = ca.MomentSpec()
    mu, nu = _moments((2, 128), spec)
    with pytest.raises(ValueError, match="must be one group view of the parameter's"):
        ca.coat_adam_step(
            jnp.zeros((2, 256)),
            mu,
            nu,
            count=1,
            spec=spec,
            implementation="auto",
            interpret=True,
            **HYPER,
        )
    with pytest.raises(ValueError, match="mesh and partition go together"):
        ca.coat_adam_step(
            jnp.zeros((2, 128)),
            mu,
            nu,
            count=1,
            spec=spec,
            mesh=None,
            partition=jax.sharding.PartitionSpec(),
            **HYPER,
        )

"""The FP8 ops, kernels and codecs against the independent float64 oracle (tests/oracle.py).

Every op and every gradient is checked three ways, over several seeds and shapes, on the XLA
implementation and on the Pallas kernels in interpret mode where they exist:

* emulated (float32 inputs): the oracle's formulas evaluated at the values backward keeps,
  quantized by the oracle from the spec. The library must agree to float32 rounding: a scaled
  or missing term, a wrong FP8 format or a shifted group moves this by far more.
* exact: the FP8 gradient against the float64 gradient at the exact inputs (float32 and
  bfloat16). The bound sits at a few times the error measured over the seeds and shapes here
  (the measured value stands beside each bound).
* bias: the least-squares slope of the FP8 gradient against the exact one is 1 within a
  fraction of a percent: FP8 rounding is unbiased, a scaled formula is not.

Then the precision flow read from jaxprs (E5M2 output gradients and E4M3 operands entering the
GEMMs, FP8 residuals only), the E8M0 scale's decision under a GPU's inexact division, and the
codecs (DRE, per-group, the optimizer's state) against the float64 spec on moments spanning
1e-12 to 1e2.
"""

from __future__ import annotations

import ast
import dataclasses
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# The library under test: every import of it is in this block.
from coat_jax import quant
from coat_jax.fp8_ops import (
    FP8Config,
    fp8_attention,
    fp8_attention_linear,
    fp8_linear,
    fp8_mul,
    fp8_rmsnorm,
    fp8_silu,
    fp8_swiglu,
)
from coat_jax.losses import cross_entropy_from_hidden
from coat_jax.optim import coat_adamw, dequantized_moments
from pallas_kernels.coat_adam import MomentSpec, coat_adam_step, quantize_moment
from pallas_kernels.fp8_quant import (
    group_quantize_tile,
    quantize_per_group,
    quantize_per_tensor,
    scaled_cast_pallas,
)
from tests import oracle, spec_reference

XLA = FP8Config(implementation="xla")
PALLAS = FP8Config(implementation="pallas", interpret=True)
CONFIGS = {"xla": XLA, "pallas": PALLAS}
SEEDS = (0, 1, 2)
FP8_DTYPES = {jnp.dtype(jnp.float8_e4m3fn): "e4m3", jnp.dtype(jnp.float8_e5m2): "e5m2"}


def _f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def rel_err(got, want):
    got, want = _f64(got).ravel(), np.asarray(want, np.float64).ravel()
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def slope(got, want):
    """Least-squares slope of ``got`` against ``want`` (1 for an unbiased estimate).

    Rows (last axis) are weighted by their inverse squared norm, floored at the median row's:
    rows whose magnitudes span decades then count alike, instead of the few largest deciding
    the slope, while rows near zero (a causal attention's first query) add no noise."""
    got = _f64(got).reshape(-1, np.shape(want)[-1] if np.ndim(want) else 1)
    want = np.asarray(want, np.float64).reshape(got.shape)
    norms = np.sum(want * want, axis=-1)
    weight = 1.0 / np.maximum(norms, np.median(norms))
    return float(np.sum(weight * np.sum(got * want, -1)) / np.sum(weight * norms))


def _inputs(seed, shapes, dtype, spread=2.0):
    """Normal values whose rows span ``10**-spread .. 10**spread`` (group scales must cope)."""
    rng = np.random.default_rng(seed)
    out = []
    for shape in shapes:
        rows = 10.0 ** rng.uniform(-spread, spread, shape[:-1] + (1,))
        x = rng.standard_normal(shape) * rows
        out.append(jnp.asarray(x, dtype))
    return out


def _cotangent(seed, shape, dtype):
    rng = np.random.default_rng(1000 + seed)
    return jnp.asarray(rng.standard_normal(shape), dtype)


# --------------------------------------------------------------------------------------------
# the ops: (library call, oracle forward, exact oracle gradients, emulated oracle gradients)


@dataclasses.dataclass(frozen=True)
class Op:
    """One FP8 op under test.

    ``run(args, config)``: the library's output. ``shapes``: input shapes per case.
    ``exact(args, dy)`` and ``emulated(args, dy)``: the oracle's (forward, gradients) at the
    exact inputs, and at the values the precision flow keeps. ``spread``: the decades each
    side of 1 the rows' magnitudes span; ``prepare``: maps the random inputs to realistic ones
    (weights)."""

    run: object
    shapes: tuple
    exact: object
    emulated: object
    spread: float = 2.0
    prepare: object = None


def _linear_exact(args, dy):
    x, w = (_f64(a) for a in args)
    return oracle.linear(x, w), oracle.linear_grads(x, w, _f64(dy))


def _linear_emulated(args, dy):
    x, w = (_f64(a) for a in args)
    k = x.shape[-1]
    xq = oracle.per_tensor_values(x.reshape(-1, k), "e4m3").reshape(x.shape)
    wq = oracle.per_tensor_values(w, "e4m3")
    dyq = oracle.per_tensor_values(_f64(dy).reshape(-1, w.shape[1]), "e5m2").reshape(dy.shape)
    return oracle.linear(xq, wq), oracle.linear_grads(xq, wq, dyq)


EPS = 1e-6


def _rmsnorm_exact(args, dy):
    x, w = (_f64(a) for a in args)
    return oracle.rmsnorm(x, w, EPS), oracle.rmsnorm_grads(
        x, w, _f64(dy), oracle.rmsnorm_rstd(x, EPS)
    )


def _group_values(x, scale_format="float32"):
    return oracle.per_group_values(x, group_size=16, fmt="e4m3", scale_format=scale_format)


def _rmsnorm_emulated(args, dy, scale_format="float32"):
    x, w = (_f64(a) for a in args)
    rstd = oracle.rmsnorm_rstd(x, EPS)
    grads = oracle.rmsnorm_grads(_group_values(x, scale_format), w, _f64(dy), rstd)
    return oracle.rmsnorm(x, w, EPS), grads


def _silu_exact(args, dy):
    (x,) = (_f64(a) for a in args)
    return oracle.silu(x), (_f64(dy) * oracle.silu_grad(x),)


def _silu_emulated(args, dy, scale_format="float32"):
    (x,) = (_f64(a) for a in args)
    return oracle.silu(x), (_f64(dy) * oracle.silu_grad(_group_values(x, scale_format)),)


def _mul_exact(args, dy):
    a, b = (_f64(t) for t in args)
    return a * b, oracle.mul_grads(a, b, _f64(dy))


def _mul_emulated(args, dy, scale_format="float32"):
    a, b = (_f64(t) for t in args)
    aq, bq = _group_values(a, scale_format), _group_values(b, scale_format)
    return a * b, oracle.mul_grads(aq, bq, _f64(dy))


def _swiglu_exact(args, dy):
    g, u = (_f64(t) for t in args)
    return oracle.swiglu(g, u), oracle.swiglu_grads(g, u, _f64(dy))


def _swiglu_emulated(args, dy):
    g, u = (_f64(t) for t in args)
    return oracle.swiglu(g, u), oracle.swiglu_grads(_group_values(g), _group_values(u), _f64(dy))


def _attention_exact(args, dy):
    q, k, v = (_f64(t) for t in args)
    return oracle.attention(q, k, v)[0], oracle.attention_grads(q, k, v, _f64(dy))


def _attention_emulated(args, dy):
    q, k, v = (_f64(t) for t in args)
    kept = [_group_values(t) for t in (q, k, v)]
    return oracle.attention(q, k, v)[0], oracle.attention_grads(*kept, _f64(dy))


def _attention_linear_exact(args, dy):
    q, k, v, w = (_f64(t) for t in args)
    out, _ = oracle.attention(q, k, v)
    b, t, n, h = q.shape
    flat = out.reshape(b, t, n * h)
    d_out, dw = oracle.linear_grads(flat, w, _f64(dy))
    return oracle.linear(flat, w), (*oracle.attention_grads(q, k, v, d_out.reshape(q.shape)), dw)


def _attention_linear_emulated(args, dy):
    """The linear's backward from its E4M3 per-tensor input (the attention output), then the
    attention's backward at the kept q, k, v with the forward's log-sum-exp and that FP8
    output in place of the recomputed one."""
    q, k, v, w = (_f64(t) for t in args)
    out, lse = oracle.attention(q, k, v)
    b, t, n, h = q.shape
    flat = out.reshape(b * t, n * h)
    out_q = oracle.per_tensor_values(flat, "e4m3")
    wq = oracle.per_tensor_values(w, "e4m3")
    dyq = oracle.per_tensor_values(_f64(dy).reshape(b * t, -1), "e5m2")
    d_out, dw = oracle.linear_grads(out_q, wq, dyq)
    kept = [_group_values(x) for x in (q, k, v)]
    dq, dk, dv = oracle.attention_grads(
        *kept, d_out.reshape(q.shape), out=out_q.reshape(q.shape), lse=lse
    )
    y = oracle.linear(out_q, wq).reshape(b, t, -1)
    return y, (dq, dk, dv, dw)


def _attention_linear_run(args, config):
    q, k, v, w = args
    return fp8_attention_linear(q, k, v, w, True, dataclasses.replace(config, attention="xla"))


def _small_weight(args):
    """A linear weight of an initializer's size (the last input)."""
    return [*args[:-1], (0.05 * args[-1].astype(jnp.float32)).astype(args[-1].dtype)]


def _norm_weight(args):
    """A norm weight near 1, as trained ones are."""
    x, w = args
    w32 = w.astype(jnp.float32)
    return [x, (1.0 + 0.2 * w32 / jnp.max(jnp.abs(w32))).astype(w.dtype)]


OPS = {
    "linear": Op(
        lambda a, c: fp8_linear(*a, c),
        (((4, 32, 256), (256, 128)), ((128, 192), (192, 96))),
        _linear_exact,
        _linear_emulated,
        spread=0.0,
        prepare=_small_weight,
    ),
    "rmsnorm": Op(
        lambda a, c: fp8_rmsnorm(*a, EPS, c),
        (((4, 8, 64), (64,)), ((6, 128), (128,))),
        _rmsnorm_exact,
        _rmsnorm_emulated,
        prepare=_norm_weight,
    ),
    "silu": Op(
        lambda a, c: fp8_silu(*a, c),
        (((4, 8, 96),), ((6, 160),)),
        _silu_exact,
        _silu_emulated,
    ),
    "mul": Op(
        lambda a, c: fp8_mul(*a, c),
        (((4, 8, 96), (4, 8, 96)), ((6, 160), (6, 160))),
        _mul_exact,
        _mul_emulated,
    ),
    "swiglu": Op(
        lambda a, c: fp8_swiglu(*a, c),
        (((4, 8, 96), (4, 8, 96)), ((6, 160), (6, 160))),
        _swiglu_exact,
        _swiglu_emulated,
    ),
    "attention": Op(
        lambda a, c: fp8_attention(*a, True, dataclasses.replace(c, attention="xla")),
        (((2, 8, 4, 32), (2, 8, 2, 32), (2, 8, 2, 32)), ((1, 12, 2, 16),) * 3),
        _attention_exact,
        _attention_emulated,
        spread=0.5,
    ),
    "attention_linear": Op(
        _attention_linear_run,
        (((2, 8, 4, 32), (2, 8, 2, 32), (2, 8, 2, 32), (128, 48)),),
        _attention_linear_exact,
        _attention_linear_emulated,
        spread=0.5,
        prepare=_small_weight,
    ),
}


def _args(op: Op, case: int, seed: int, dtype):
    args = _inputs(seed, op.shapes[case], dtype, op.spread)
    return args if op.prepare is None else op.prepare(args)


def run_op(name, impl, case, seed, dtype):
    """``(inputs, library forward, library gradients, cotangent dy)`` of one case."""
    op = OPS[name]
    args = _args(op, case, seed, dtype)
    y, pullback = jax.vjp(lambda *a: op.run(a, CONFIGS[impl]), *args)
    dy = _cotangent(seed, y.shape, y.dtype)
    return args, y, pullback(dy), dy


def metrics(name, impl, case, seed, dtype):
    """Per output (``"y"`` and each gradient): emulated and exact relative errors, and the
    slope against the exact value."""
    op = OPS[name]
    args, y, grads, dy = run_op(name, impl, case, seed, dtype)
    y_exact, g_exact = op.exact(args, dy)
    # The emulated oracle is float32 rounding away only on float32 inputs.
    y_emu, g_emu = op.emulated(args, dy) if dtype == jnp.float32 else (None, [None] * len(args))
    out = {}
    for key, got, exact, emu in zip(
        ["y"] + [f"d{i}" for i in range(len(args))],
        [y, *grads],
        [y_exact, *g_exact],
        [y_emu, *g_emu],
        strict=True,
    ):
        out[key] = (
            None if emu is None else rel_err(got, emu),
            rel_err(got, exact),
            slope(got, exact),
        )
    for a, g in zip(args, grads, strict=True):
        assert g.dtype == a.dtype and g.shape == a.shape
    return out


# Bounds per op and output: (emulated relative error in float32, exact relative error in
# float32, exact relative error in bfloat16, |slope - 1|). Beside each, the largest value
# measured over SEEDS, both cases and both implementations, in the same order. A bound is twice
# that, or five times where the measured value is float32 rounding (below 1e-6: it depends on
# the order XLA sums in); slopes at least 1e-3. Attention's gradients stay noisy at these sizes
# (a few hundred values each, errors shared through the quantized q and k), hence its wider
# slopes; the emulated bounds hold it to the oracle all the same.
BOUNDS = {
    "linear": {
        "y": (1.6e-07, 0.076, 0.076, 0.0076),  # 3.1e-08, 0.038, 0.038, 0.0038
        "d0": (1.4e-07, 0.12, 0.12, 0.016),  # 2.7e-08, 0.06, 0.06, 0.0079
        "d1": (1.4e-07, 0.12, 0.12, 0.0093),  # 2.7e-08, 0.06, 0.06, 0.0046
    },
    "rmsnorm": {
        "y": (3.5e-07, 3.5e-07, 0.0048, 0.001),  # 6.9e-08, 6.9e-08, 0.0024, 0.00017
        "d0": (3.8e-07, 0.012, 0.012, 0.001),  # 7.5e-08, 0.0055, 0.0056, 0.00031
        "d1": (7.5e-07, 0.049, 0.052, 0.0047),  # 1.5e-07, 0.024, 0.026, 0.0023
    },
    "silu": {
        "y": (1e-07, 1e-07, 0.00075, 0.001),  # 2e-08, 2e-08, 0.00037, 0.00023
        "d0": (9.2e-07, 0.0098, 0.011, 0.001),  # 1.8e-07, 0.0049, 0.0051, 0.00029
    },
    "mul": {
        "y": (1.4e-07, 1.4e-07, 0.0035, 0.001),  # 2.6e-08, 2.6e-08, 0.0017, 0.00026
        "d0": (3.9e-07, 0.044, 0.044, 0.0044),  # 7.6e-08, 0.022, 0.022, 0.0022
        "d1": (3.7e-07, 0.05, 0.05, 0.0037),  # 7.2e-08, 0.025, 0.025, 0.0018
    },
    "swiglu": {
        "y": (1.9e-07, 1.9e-07, 0.0038, 0.001),  # 3.7e-08, 3.7e-08, 0.0019, 0.00045
        "d0": (1.1e-06, 0.049, 0.049, 0.011),  # 2.1e-07, 0.024, 0.024, 0.0054
        "d1": (3.4e-07, 0.05, 0.049, 0.007),  # 6.8e-08, 0.025, 0.024, 0.0035
    },
    "attention": {
        "y": (7.1e-07, 7.1e-07, 0.0045, 0.001),  # 1.4e-07, 1.4e-07, 0.0022, 0.00049
        "d0": (1.6e-06, 0.24, 0.18, 0.032),  # 3e-07, 0.12, 0.087, 0.016
        "d1": (2e-06, 0.22, 0.17, 0.11),  # 3.8e-07, 0.11, 0.082, 0.053
        "d2": (6.7e-07, 0.095, 0.088, 0.015),  # 1.3e-07, 0.047, 0.044, 0.0073
    },
    "attention_linear": {
        "y": (1.7e-07, 0.076, 0.074, 0.013),  # 3.3e-08, 0.038, 0.037, 0.0062
        "d0": (2.5e-06, 0.25, 0.27, 0.059),  # 4.9e-07, 0.12, 0.13, 0.029
        "d1": (3.4e-06, 0.25, 0.28, 0.017),  # 6.8e-07, 0.12, 0.14, 0.0081
        "d2": (3.1e-06, 0.22, 0.2, 0.072),  # 6e-07, 0.11, 0.099, 0.036
        "d3": (1.4e-07, 0.13, 0.13, 0.027),  # 2.6e-08, 0.061, 0.061, 0.013
    },
}


# The XLA path in float32 and bfloat16; the Pallas kernels (interpret mode, slow on a CPU) in
# float32, where the emulated comparison pins them to the oracle.
CASES = [
    pytest.param(name, impl, case, dtype, id=f"{name}-{impl}-{case}-{jnp.dtype(dtype).name}")
    for name, op in OPS.items()
    for impl, dtypes in (("xla", (jnp.float32, jnp.bfloat16)), ("pallas", (jnp.float32,)))
    for dtype in dtypes
    for case in range(len(op.shapes))
]


@pytest.mark.parametrize("name,impl,case,dtype", CASES)
def test_op_matches_oracle(name, impl, case, dtype):
    for seed in SEEDS:
        for out, (emu, exact, sl) in metrics(name, impl, case, seed, dtype).items():
            b_emu, b_f32, b_bf16, b_slope = BOUNDS[name][out]
            what = f"{name} {out} seed {seed}"
            if emu is not None:
                assert emu <= b_emu, f"{what}: emulated error {emu:.3g} > {b_emu}"
            bound = b_f32 if dtype == jnp.float32 else b_bf16
            assert exact <= bound, f"{what}: error {exact:.3g} > {bound}"
            assert abs(sl - 1) <= b_slope, f"{what}: slope {sl:.5f} not within {b_slope} of 1"


@pytest.mark.parametrize("name", ["rmsnorm", "silu", "mul"])
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_e8m0_group_scales_match_the_oracle(name, impl):
    """With one-byte power-of-two scales the kept values are the oracle's E8M0 quantization."""
    op = OPS[name]
    config = dataclasses.replace(CONFIGS[impl], group_scale="e8m0")
    for seed in SEEDS[:2]:
        args = _args(op, 0, seed, jnp.float32)
        y, pullback = jax.vjp(lambda *a: op.run(a, config), *args)
        dy = _cotangent(seed, y.shape, y.dtype)
        _, want = op.emulated(args, dy, scale_format="e8m0")
        for got, w in zip(pullback(dy), want, strict=True):
            assert rel_err(got, w) <= 5e-7  # measured 1.5e-7


# --------------------------------------------------------------------------------------------
# the chunked cross-entropy (no FP8: float32 against float64)


@pytest.mark.parametrize("chunks", [(4, 16), (3, None)])
def test_chunked_cross_entropy_matches_oracle(chunks):
    rng = np.random.default_rng(5)
    h = jnp.asarray(rng.standard_normal((2, 10, 32)), jnp.float32)
    w = jnp.asarray(0.3 * rng.standard_normal((32, 40)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 40, (2, 10)))
    mask = jnp.asarray(rng.uniform(size=(2, 10)) > 0.3)
    chunk, vocab_chunk = chunks

    def loss(h, w):
        return cross_entropy_from_hidden(
            h, w, labels, mask_BT=mask, chunk_size=chunk, vocab_chunk_size=vocab_chunk
        )

    value, (dh, dw) = jax.value_and_grad(loss, (0, 1))(h, w)
    args = (_f64(h), _f64(w), np.asarray(labels), np.asarray(mask))
    want = oracle.cross_entropy(*args)
    assert abs(float(value) - want) <= 3e-7 * want  # measured 6e-8
    want_dh, want_dw = oracle.cross_entropy_grads(*args)
    assert rel_err(dh, want_dh) <= 1e-6  # measured 2.2e-7
    assert rel_err(dw, want_dw) <= 9e-7  # measured 1.8e-7


# --------------------------------------------------------------------------------------------
# the precision flow, read from jaxprs and residuals


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        for sub in value if isinstance(value, (list, tuple)) else (value,):
            sub = getattr(sub, "jaxpr", sub)
            if hasattr(sub, "eqns"):
                yield sub


# Primitives a GEMM operand may pass through between its FP8 codes and the dot.
_PASS_THROUGH = ("convert_element_type", "reshape", "transpose", "name", "copy", "mul")


def _fp8_source(var, producers):
    """The FP8 format of the codes ``var`` is computed from, or ``None``."""
    while True:
        fmt = FP8_DTYPES.get(jnp.dtype(var.aval.dtype))
        if fmt is not None:
            return fmt
        eqn = producers.get(var)
        if eqn is None:
            return None
        name = eqn.primitive.name
        if name == "optimization_barrier":
            var = eqn.invars[eqn.outvars.index(var)]
        elif name in _PASS_THROUGH:
            # A scale multiplies the codes: follow the operand of the full size.
            arrays = [v for v in eqn.invars if not hasattr(v, "val")]
            var = max(arrays, key=lambda v: np.prod(v.aval.shape))
        else:
            return None


def dot_formats(jaxpr):
    """``(lhs format, rhs format)`` of every ``dot_general`` in ``jaxpr``, recursively."""
    found = []
    producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(tuple(_fp8_source(v, producers) for v in eqn.invars))
        for sub in _sub_jaxprs(eqn):
            found += dot_formats(sub)
    return found


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_linear_gemms_take_e4m3_operands_and_e5m2_gradients(dtype, impl):
    x = jnp.ones((8, 64), dtype)
    w = jnp.ones((64, 32), jnp.float32)
    config = CONFIGS[impl]
    forward = jax.make_jaxpr(lambda x, w: fp8_linear(x, w, config))(x, w)
    assert dot_formats(forward.jaxpr) == [("e4m3", "e4m3")]
    _, pullback = jax.vjp(lambda x, w: fp8_linear(x, w, config), x, w)
    backward = jax.make_jaxpr(pullback)(jnp.ones((8, 32), dtype))
    # dgrad: dy (E5M2) against the weight (E4M3); wgrad: x (E4M3) against dy (E5M2).
    assert sorted(dot_formats(backward.jaxpr)) == [("e4m3", "e5m2"), ("e5m2", "e4m3")]


def test_attention_linear_gemms_take_e4m3_operands_and_e5m2_gradients():
    q = k = v = jnp.ones((1, 8, 2, 16))
    w = jnp.ones((32, 24))
    _, pullback = jax.vjp(lambda q, k, v, w: _attention_linear_run((q, k, v, w), XLA), q, k, v, w)
    formats = dot_formats(jax.make_jaxpr(pullback)(jnp.ones((1, 8, 24))).jaxpr)
    assert ("e5m2", "e4m3") in formats and ("e4m3", "e5m2") in formats


def _residuals(fn, *args):
    _, pullback = jax.vjp(fn, *args)
    return jax.tree.leaves(pullback)


# op -> (call, input shapes, kept FP8 tensors as (shape, scale shape), a master weight among the
# inputs). Granularity: 1x16 scales [..., D / 16] for the non-linear ops and FP8 attention's
# q, k, v, one scalar for a linear's input.
RESIDUALS = {
    "linear": (
        lambda x, w: fp8_linear(x, w, XLA),
        ((8, 64), (64, 48)),
        [((8, 64), ())],
        True,
    ),
    "rmsnorm": (
        lambda x, w: fp8_rmsnorm(x, w, EPS, XLA),
        ((8, 64), (64,)),
        [((8, 64), (8, 4))],
        False,
    ),
    "silu": (lambda x: fp8_silu(x, XLA), ((8, 64),), [((8, 64), (8, 4))], False),
    "mul": (lambda a, b: fp8_mul(a, b, XLA), ((8, 64),) * 2, [((8, 64), (8, 4))] * 2, False),
    "swiglu": (
        lambda a, b: fp8_swiglu(a, b, XLA),
        ((8, 64),) * 2,
        [((8, 64), (8, 4))] * 2,
        False,
    ),
    "attention": (
        lambda q, k, v: fp8_attention(q, k, v, True, XLA),
        ((1, 8, 2, 32),) * 3,
        [((1, 8, 2, 32), (1, 8, 2, 2))] * 3,
        False,
    ),
    "attention_linear": (
        lambda q, k, v, w: _attention_linear_run((q, k, v, w), XLA),
        ((1, 8, 2, 32),) * 3 + ((64, 48),),
        [((1, 8, 2, 32), (1, 8, 2, 2))] * 3 + [((8, 64), ())],
        True,
    ),
}


@pytest.mark.parametrize("name", sorted(RESIDUALS))
def test_residuals_are_fp8_of_the_documented_granularity(name):
    fn, shapes, kept, has_weight = RESIDUALS[name]
    args = [jnp.ones(s, jnp.bfloat16) for s in shapes]
    if has_weight:
        args[-1] = jnp.ones(shapes[-1], jnp.float32)
    leaves = _residuals(fn, *args)
    activation = np.prod(shapes[0])
    codes = [(x.shape, FP8_DTYPES[jnp.dtype(x.dtype)]) for x in leaves if x.dtype in FP8_DTYPES]
    assert sorted(codes) == sorted((shape, "e4m3") for shape, _ in kept)
    scales = Counter(x.shape for x in leaves if x.dtype == jnp.float32)
    for scale_shape, count in Counter(s for _, s in kept).items():
        assert scales[scale_shape] >= count, (scales, scale_shape)
    # Nothing of activation size is kept in a compute dtype: a linear keeps a reference to its
    # master weight (an input of the step), RMSNorm its weight and one 1/rms per row, the
    # attention-linear pair its softmax statistics (one per query row and head).
    for x in leaves:
        if x.dtype not in FP8_DTYPES and x.size >= activation:
            assert has_weight and x.shape == shapes[-1], (name, x.shape, x.dtype)


# --------------------------------------------------------------------------------------------
# quantizers and codecs against the oracle


def _code_steps(got, want, fmt):
    """How many FP8 codes apart ``got`` and ``want`` (float64 values of codes) are."""
    dtype = oracle.DTYPE[fmt]

    def ordinal(v):
        bits = np.asarray(v, np.float64).astype(dtype).view(np.uint8).astype(np.int32)
        return np.where(bits & 0x80, -(bits & 0x7F), bits & 0x7F)

    return np.abs(ordinal(got) - ordinal(want))


def _assert_codes(got, want, fmt, max_ties=1e-3):
    steps = _code_steps(_f64(got), want, fmt)
    assert steps.max() <= 1, f"codes differ by {steps.max()} steps"
    assert np.mean(steps > 0) <= max_ties, f"{np.mean(steps > 0):.2%} of codes differ"


def _quantizer_data(seed, shape=(6, 96)):
    x = _f64(_inputs(seed, [shape], jnp.float32, spread=3.0)[0])
    # Groups whose maximum is exactly fmax times a power of two (the E8M0 boundary), and an
    # all-negative group.
    x[0, :16] = np.linspace(-1.0, 1.0, 16) * 448.0 * 2.0**-3
    x[1, 16:32] = -np.abs(x[1, 16:32])
    x[2, :16] = 0.0
    return jnp.asarray(x, jnp.float32)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale_format", ["float32", "e8m0"])
def test_per_group_quantizer_matches_oracle(impl, fmt, scale_format):
    for seed in SEEDS:
        x = _quantizer_data(seed)
        got = quantize_per_group(
            x,
            group_size=16,
            fmt=fmt,
            scale_format=scale_format,
            implementation=impl,
            interpret=True,
        )
        codes, scale = oracle.quantize_per_group(
            _f64(x), group_size=16, fmt=fmt, scale_format=scale_format
        )
        assert got.codes.dtype == quant.FORMATS[fmt] and got.scale.shape == scale.shape
        np.testing.assert_allclose(_f64(quant.decode_scale(got.scale)), scale, rtol=2**-23)
        _assert_codes(got.codes, codes, fmt)
        np.testing.assert_allclose(
            _f64(got.dequantize()), oracle.dequantize_per_group(codes, scale), rtol=0.07
        )


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_per_tensor_quantizer_matches_oracle(impl, fmt):
    for seed in SEEDS:
        x = _quantizer_data(seed, (8, 64))
        got = quantize_per_tensor(x, fmt=fmt, implementation=impl, interpret=True)
        codes, scale = oracle.quantize_per_tensor(_f64(x), fmt=fmt)
        assert got.scale.shape == () and float(got.scale) == scale
        _assert_codes(got.codes, codes, fmt)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_scaled_cast_clips_before_the_cast(fmt):
    """A scale below max|x| / fmax (another shard's, a stale one) saturates, never NaN/inf."""
    x = _quantizer_data(0, (8, 64))
    scale = jnp.float32(float(jnp.max(jnp.abs(x))) / oracle.FMAX[fmt] / 8.0)
    got = scaled_cast_pallas(x, scale, fmt=fmt, interpret=True)
    want = oracle.fp8_round(_f64(x) / float(scale), fmt)
    assert np.all(np.isfinite(_f64(got)))
    _assert_codes(got, want, fmt)
    np.testing.assert_array_equal(_f64(quant.cast_to_fp8(x / scale, fmt)), _f64(got))


# --- the E8M0 scale under an inexact division ----------------------------------------------


def _with_inexact_division(fn, direction, *args):
    """``fn(*args)`` with every floating-point division's quotient moved one ulp towards
    ``direction`` (+1 or -1): a GPU's approximate divide, which a CPU's exact one hides."""
    closed = jax.make_jaxpr(fn)(*args)

    def run(jaxpr, consts, *values):
        env = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, values, strict=True))

        def read(v):
            return v.val if hasattr(v, "val") else env[v]

        for eqn in jaxpr.eqns:
            inputs = [read(v) for v in eqn.invars]
            sub = eqn.params.get("jaxpr")
            if sub is not None and hasattr(sub, "consts"):
                outputs = run(sub.jaxpr, sub.consts, *inputs)
            else:
                outputs = eqn.primitive.bind(*inputs, **eqn.params)
                if not eqn.primitive.multiple_results:
                    outputs = [outputs]
                if eqn.primitive.name == "div" and jnp.issubdtype(outputs[0].dtype, jnp.floating):
                    outputs = [jnp.nextafter(outputs[0], direction * jnp.inf)]
            env.update(zip(eqn.outvars, outputs, strict=True))
        return [read(v) for v in jaxpr.outvars]

    return run(closed.jaxpr, closed.consts, *args)


def _boundary_maxima(fmt):
    """Group maxima at ``fmax * 2**e`` exactly and one float32 ulp either side."""
    at = np.float32(oracle.FMAX[fmt]) * np.float32(2.0) ** np.arange(-20, 12, dtype=np.float32)
    return np.concatenate([at, np.nextafter(at, np.float32(0)), np.nextafter(at, np.float32(1e30))])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("direction", [1, -1])
def test_e8m0_scale_is_exact_under_an_inexact_division(fmt, direction):
    amax = jnp.asarray(_boundary_maxima(fmt))
    want = oracle.e8m0_scale(np.asarray(amax), fmt)
    fmax = oracle.FMAX[fmt]
    (scale,) = _with_inexact_division(
        lambda a: quant.absmax_scale(a, fmax, "e8m0"), direction, amax
    )
    np.testing.assert_array_equal(_f64(scale), want)
    # The kernels' quantizer of a tile decides its scales the same way.
    tile = jnp.broadcast_to(amax[:, None, None], (amax.size, 1, 16)).astype(jnp.float32)
    _, stored = _with_inexact_division(
        lambda t: group_quantize_tile(t, fmt, "e8m0"), direction, tile
    )
    np.testing.assert_array_equal(_f64(quant.decode_scale(stored))[:, 0], want)


# --- DRE and the optimizer's state codec on moments spanning many decades -------------------


def _wide_moments(seed, shape, low=-12.0, high=2.0, signed=True):
    """Magnitudes log-uniform in ``10**low .. 10**high`` (each row its own sub-range, so that
    both narrow and wide groups occur), some exact zeros."""
    rng = np.random.default_rng(seed)
    centre = rng.uniform(low, high, shape[:-1] + (1,))
    width = rng.choice([0.1, 1.0, 4.0, high - low], shape[:-1] + (1,))
    x = 10.0 ** np.clip(centre + width * rng.uniform(-0.5, 0.5, shape), low, high)
    if signed:
        x = x * rng.choice([-1.0, 1.0], shape)
    x[..., ::37] = 0.0
    return x.astype(np.float32)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_dre_codec_matches_the_spec_on_wide_moments(fmt):
    x = _wide_moments(0, (24, 256))
    got = quant.quantize_dre(jnp.asarray(x), group_size=128, fmt=fmt, expand_min=16)
    codes, stats = oracle.quantize_dre(x, group_size=128, fmt=fmt, expand_min=16)
    np.testing.assert_array_equal(_f64(got.expand), stats["expand"])
    np.testing.assert_allclose(_f64(got.center), stats["center"], rtol=1e-6)
    _assert_codes(got.codes, codes, fmt, max_ties=5e-3)
    # Decoding the library's own codes and statistics: float32 powers against float64.
    want = oracle.dequantize_dre(_f64(got.codes), got.scale, got.expand, got.center, group_size=128)
    back = _f64(quant.dequantize_dre(got.codes, got.scale, got.expand, got.center))
    nz = want != 0
    assert np.array_equal(back == 0, ~nz)
    err = np.abs(back[nz] / want[nz] - 1)
    assert err.max() <= 2e-6, err.max()  # measured 6.5e-7
    assert abs(slope(back[nz], want[nz]) - 1) <= 1e-6  # measured 1.7e-7
    np.testing.assert_array_equal(_f64(got.dequantize()), back)


# One optimizer step on wide moments, against the spec from the same stored state: the update
# (float32 against float64 through m = b1 m + (1 - b1) g, which cancels where m and g differ in
# sign), the new state decoded against the spec's own codes of the exact moments, and the
# slope of the decoded state against those exact moments.
UPDATE_BOUND = 1e-5  # measured 3.4e-6
STATE_BOUND = 2e-6  # measured 7.3e-7
STATE_SLOPE_BOUND = 4e-3  # measured 1.7e-3 (E4M3 with DRE)


def _adam_oracle(g, m_prev, v_prev, count, b1=0.9, b2=0.999, eps=1e-8):
    """SPEC section 2's moments and direction, in float64."""
    m = b1 * m_prev + (1 - b1) * g
    v = b2 * v_prev + (1 - b2) * g * g
    update = m / (1 - b1**count) / (np.sqrt(v / (1 - b2**count)) + eps)
    return m, v, update


def _decode(moment):
    """The oracle's decoding of a library moment's codes and statistics."""
    stats = {"scale": _f64(moment.scale)}
    if moment.expand is not None:
        stats.update(expand=_f64(moment.expand), center=_f64(moment.center))
    return spec_reference.dequantize(_f64(moment.codes), stats, gs=moment.group_size)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("expansion", [True, False])
@pytest.mark.parametrize("nu_format", ["e4m3", "e5m2"])
def test_optimizer_step_codec_matches_the_spec_on_wide_moments(impl, expansion, nu_format):
    """One step from moments spanning 1e-12..1e2 with gradients down to 1e-10: the update from
    the decoded state, and the new state's codes and decoded values, as the spec's."""
    spec = MomentSpec(group_size=128, nu_format=nu_format, expansion=expansion)
    shape = (16, 256)
    m0 = _wide_moments(1, shape)
    v0 = _wide_moments(2, shape, signed=False)
    g = _wide_moments(3, shape, low=-10.0, high=1.0)
    mu = quantize_moment(jnp.asarray(m0), "e4m3", spec, 16)
    nu = quantize_moment(jnp.asarray(v0), nu_format, spec, 16)
    update, new_mu, new_nu = coat_adam_step(
        jnp.asarray(g),
        mu,
        nu,
        count=3,
        b1=0.9,
        b2=0.999,
        eps=1e-8,
        expand_min=16,
        spec=spec,
        implementation=impl,
        interpret=True,
    )
    m, v, want = _adam_oracle(_f64(g), _decode(mu), _decode(nu), 3)
    assert rel_err(update, want) <= UPDATE_BOUND
    for got, x, fmt in ((new_mu, m, "e4m3"), (new_nu, v, nu_format)):
        codes, stats = spec_reference.quantize(
            x, gs=128, fmt=fmt, expand_min=16, expansion=expansion
        )
        _assert_codes(got.codes, codes, fmt, max_ties=5e-3)
        back = _decode(got)
        assert rel_err(back, spec_reference.dequantize(codes, stats, gs=128)) <= STATE_BOUND
        assert abs(slope(back, x) - 1) <= STATE_SLOPE_BOUND


def test_coat_adamw_tracks_the_spec_with_small_gradients():
    """The public optimizer over a few steps whose gradients reach 1e-10 (and exact zeros)."""
    shape, steps, lr = (4, 256), 5, 1e-2
    p0 = _wide_moments(4, shape, low=-1.0, high=0.0)
    grads = [_wide_moments(10 + i, shape, low=-10.0, high=1.0) for i in range(steps)]
    tx = coat_adamw(lr, weight_decay=0.0, implementation="xla")
    spec = spec_reference.CoatAdamW(shape, lr=lr)
    p, state = jnp.asarray(p0), tx.init(jnp.asarray(p0))
    p_ref = p0.astype(np.float64)
    update = jax.jit(tx.update)
    for g in grads:
        u, state = update(jnp.asarray(g), state, p)
        p = p + u
        p_ref = spec.step(p_ref, g.astype(np.float64))
    moved = np.abs(p_ref - p0)
    err = np.abs(_f64(p) - p_ref)
    # Elements whose gradient was always zero stay where they were.
    still = moved == 0
    assert np.all(err[still] == 0)
    # float32 parameters against float64: each step rounds p (about 1) next to a move of 1e-2.
    assert np.median(err[~still] / moved[~still]) < 3e-5  # measured 7.4e-6
    mu, nu = dequantized_moments(state)
    for got, (codes, stats) in ((mu, spec.mu), (nu, spec.nu)):
        want = spec_reference.dequantize(codes, stats, gs=128)
        assert abs(slope(got, want) - 1) <= 3e-6  # measured 6.9e-7
        assert rel_err(got, want) <= 5e-6  # measured 1.1e-6


@pytest.mark.parametrize("module", [oracle, spec_reference])
def test_oracle_is_independent_of_the_library(module):
    """The oracle imports numpy, ml_dtypes and the spec's float64 rendering, nothing else."""
    with open(module.__file__) as f:
        tree = ast.parse(f.read())
    imported = {
        alias.name if isinstance(node, ast.Import) else node.module
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert imported <= {"__future__", "math", "ml_dtypes", "numpy", "tests.spec_reference"}

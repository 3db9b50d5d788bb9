"""The fused Pallas COAT AdamW kernel against the jnp reference (pallas_kernels/coat_adam/).

The contract (:class:`CoatAdamContract`) runs on each backend of tests/kernels/contract.py: in
interpret mode on a CPU (CI), on the real Triton backend on a GPU (``pytest -m gpu`` there).
Shapes are tiny because interpret mode is slow; they still cover a last axis that is a multiple of
the group size (one contiguous group per row, with and without a ragged last block of rows) and
one that is not (masked short groups).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import coat_jax
from coat_jax import quant
from pallas_kernels import coat_adam as ca
from pallas_kernels.coat_adam import pallas_triton, pallas_triton_math
from tests.kernels.contract import CompiledGPU, Interpret

ON_GPU = jax.default_backend() == "gpu"
HYPER = dict(b1=0.9, b2=0.999, eps=1e-8, expand_min=16)
STEPS = 4
# Codes may differ at rounding ties only: by one code, in at most this fraction of elements.
MAX_TIE_FRACTION = 0.005


def _zero_moment(shape, fmt, spec):
    return ca.quantize_moment(jnp.zeros(shape, jnp.float32), fmt, spec, HYPER["expand_min"])


def _code_ordinal(codes):
    """FP8 codes as signed integers that step by one between neighbouring values (+0 == -0)."""
    bits = np.asarray(jax.lax.bitcast_convert_type(codes, jnp.uint8)).astype(np.int32)
    magnitude = bits & 0x7F
    return np.where(bits & 0x80, -magnitude, magnitude)


def _assert_codes_match(got, want, what):
    a, b = _code_ordinal(got), _code_ordinal(want)
    diff = np.abs(a - b)
    assert diff.max() <= 1, f"{what}: codes differ by {diff.max()} steps"
    frac = float(np.mean(diff > 0))
    assert frac <= MAX_TIE_FRACTION, f"{what}: {frac:.2%} of codes differ"


def _assert_stats_match(got: quant.QuantizedTensor, want: quant.QuantizedTensor, what, rtol=1e-5):
    for name in ("scale", "expand", "center"):
        g, w = getattr(got, name), getattr(want, name)
        assert (g is None) == (w is None), (what, name)
        if g is None:
            continue
        assert g.dtype == w.dtype == jnp.float32 and g.shape == w.shape, (what, name)
        g, w = np.asarray(g), np.asarray(w)
        tol = np.full(w.shape, rtol)
        if name == "scale" and want.expand is not None:
            # s = (max / c)**k: a relative error e in the moment becomes k * e in s, and groups
            # of a few close values have a large k.
            tol = tol + 1e-6 * np.asarray(want.expand)
        bad = np.abs(g - w) > tol * np.abs(w)
        assert not bad.any(), f"{what}.{name}: got {g[bad]}, want {w[bad]} (k {want.expand})"


def _update_rtol(dtype):
    # The update is rounded to the gradient's dtype: a float32 difference can flip one bf16 ulp.
    return 1e-5 if jnp.dtype(dtype) == jnp.float32 else 2.0**-7


def _step_fn(mode, spec, config=None, compiler_options=None):
    """The kernel step as one jitted function of traced (grad, mu, nu, count)."""

    def step(g, mu, nu, count):
        return ca.coat_adam_step_pallas(
            g,
            mu,
            nu,
            count=count,
            spec=spec,
            interpret=mode == "interpret",
            config=config,
            **HYPER,
        )

    return jax.jit(step, compiler_options=compiler_options)


def _apply_fn(mode, config, kw, compiler_options=None):
    """The kernel's fused apply as one jitted function of traced (p, grad, mu, nu, count)."""
    return jax.jit(
        lambda p, g, mu, nu, count: ca.coat_adamw_apply(
            p,
            g,
            mu,
            nu,
            count=count,
            implementation="pallas",
            interpret=mode == "interpret",
            config=config,
            **kw,
        ),
        compiler_options=compiler_options,
    )


_reference_step = jax.jit(
    lambda g, mu, nu, count, spec: ca.coat_adam_step_reference(
        g, mu, nu, count=count, spec=spec, **HYPER
    ),
    static_argnums=4,
)


def _fixed_sign_grads(key, shape, dtype, steps):
    """Gradients that keep each element's sign: no cancellation in m, so every output is well
    conditioned and the kernel must agree with the reference to float32 rounding."""
    sign_key, *keys = jax.random.split(key, steps + 1)
    sign = jnp.where(jax.random.bernoulli(sign_key, 0.5, shape), 1.0, -1.0)
    return [
        (sign * jax.random.uniform(k, shape, minval=0.05, maxval=3.0)).astype(dtype) for k in keys
    ]


CASES = [
    # shape, expansion, mu_format, nu_format, grad dtype. A whole-group shape of 6 rows (one
    # partial block) is (2, 3, 128), both ways; (33, 128) is the same launch over several blocks.
    ((4, 512), True, "e4m3", "e5m2", jnp.bfloat16),  # 16 groups: full blocks, no masks
    ((5, 300), True, "e4m3", "e5m2", jnp.bfloat16),
    ((5, 300), False, "e4m3", "e4m3", jnp.float32),
    ((130,), True, "e4m3", "e4m3", jnp.bfloat16),
    ((130,), False, "e5m2", "e5m2", jnp.float32),
    ((2, 3, 128), True, "e5m2", "e5m2", jnp.float32),
    ((2, 3, 128), False, "e4m3", "e5m2", jnp.bfloat16),
    ((33, 128), True, "e4m3", "e4m3", jnp.float32),  # ragged last block of rows
]


# Launch settings that must not change the arithmetic (flat_stats defaults to on).
COLUMN_STATS = ca.KernelConfig(flat_stats=False)
TILE_LOOP = ca.KernelConfig(block_rows=4, tiles=4)
SMALL_TILES = ca.KernelConfig(block_rows=2, tiles=2, flat_stats=True, num_stages=2)


def test_centre_reciprocal_scale_covers_every_centre():
    """The GPU takes a centre's reciprocal as ``rcp.ftz(c * scale) * scale``: right only where
    ``c * scale`` and its reciprocal are normal float32 numbers, for every centre from
    ``DRE_TINY`` (the smallest ``sqrt(mx) * sqrt(mn)``) to float32's largest."""
    tiny = float(np.finfo(np.float32).tiny)
    for c in (quant.DRE_TINY, 1.0, float(np.finfo(np.float32).max)):
        scaled = c * pallas_triton_math.CENTRE_SCALE
        assert scaled >= tiny and 1.0 / scaled >= tiny, c
    # A power of two, so the scaling rounds nothing: in float32 arithmetic that keeps subnormal
    # values (numpy's, as the GPU's plain multiply does) the scaled form is 1 / c exactly,
    # subnormal reciprocals of centres from 2**126 included.
    assert np.log2(pallas_triton_math.CENTRE_SCALE) == int(np.log2(pallas_triton_math.CENTRE_SCALE))
    c = np.asarray([quant.DRE_TINY, 3e-20, 0.7, 2.0**126, 2.5e38, np.finfo(np.float32).max])
    c = c.astype(np.float32)
    s = np.float32(pallas_triton_math.CENTRE_SCALE)
    got = (np.float32(1) / (c * s)) * s
    np.testing.assert_array_equal(got, np.float32(1) / c)
    assert got[-1] < tiny and got[-1] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="a CPU flushes subnormal values, the reference's too")
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_huge_moments_stay_finite(fmt):
    """Moments whose group centre is at least 2**126 (values from 1e38): the centre's
    reciprocal is subnormal there, and a flush-to-zero reciprocal turned the group's codes into
    NaN. Next to them, ordinary groups in the same tile. GPU only: on a CPU, XLA computes the
    reference's ``x / c`` as ``x * (1 / c)`` and the CPU flushes that reciprocal to 0, so the
    reference itself loses these groups there."""
    mode = "gpu"
    spec = ca.MomentSpec(mu_format=fmt, nu_format=fmt)
    rng = np.random.RandomState(5)
    shape = (4, 256)
    big = rng.uniform(1e38, 3e38, shape) * rng.choice([-1, 1], shape)
    small = rng.uniform(0.01, 2.0, shape) * rng.choice([-1, 1], shape)
    huge_rows = (np.arange(shape[0]) % 2 == 0)[:, None]
    m0 = jnp.asarray(np.where(huge_rows, big, small), jnp.float32)
    mu = ca.quantize_moment(m0, fmt, spec, HYPER["expand_min"])
    nu = ca.quantize_moment(jnp.abs(m0), fmt, spec, HYPER["expand_min"])
    assert float(jnp.max(mu.center)) >= 2.0**126 and float(jnp.max(nu.center)) >= 2.0**126
    g = jnp.asarray(np.where(huge_rows, 1e18, 1.0) * rng.uniform(-1, 1, shape), jnp.float32)
    # A late step: its bias corrections keep the reference's v_hat finite.
    count = jnp.int32(10_000)
    u, k_mu, k_nu = _step_fn(mode, spec)(g, mu, nu, count)
    u_ref, mu_ref, nu_ref = _reference_step(g, mu, nu, count, spec)
    for name, got, want in (("mu", k_mu, mu_ref), ("nu", k_nu, nu_ref)):
        values = got.dequantize()
        assert bool(jnp.all(jnp.isfinite(values))), f"{name}: non-finite values"
        _assert_codes_match(got.codes, want.codes, name)
        # The ordinary groups' centres move with the approximate dequantization (as in
        # _assert_stats_match); the huge groups' are the reference's.
        np.testing.assert_allclose(got.center, want.center, rtol=1e-5)
        same = np.asarray(got.codes.astype(jnp.float32) == want.codes.astype(jnp.float32))
        np.testing.assert_allclose(
            np.asarray(values)[same], np.asarray(want.dequantize())[same], rtol=2e-5, atol=0
        )
    np.testing.assert_allclose(u, u_ref, rtol=1e-5, atol=1e-6)


def test_bad_input_raises():
    spec = ca.MomentSpec()
    g = jnp.zeros((2, 128))
    mu = _zero_moment((2, 128), "e4m3", spec)
    kw = dict(count=1, spec=spec, **HYPER)
    if not ON_GPU:
        with pytest.raises(ValueError, match="interpret=True"):
            ca.coat_adam_step(g, mu, mu, implementation="pallas", **kw)
    with pytest.raises(ValueError, match="power-of-two group_size"):
        ca.coat_adam_step(
            g,
            mu,
            mu,
            implementation="pallas",
            interpret=True,
            **{**kw, "spec": ca.MomentSpec(group_size=96)},
        )
    with pytest.raises(ValueError, match="codes must be"):
        ca.coat_adam_step_pallas(g[:, :64], mu, mu, interpret=True, **kw)
    with pytest.raises(ValueError, match="block_rows"):
        ca.KernelConfig(block_rows=12)
    with pytest.raises(ValueError, match="implementation"):
        ca.coat_adam_step(g, mu, mu, implementation="triton", **kw)


def test_auto_uses_reference_for_odd_group_sizes():
    spec = ca.MomentSpec(group_size=96)
    g = jax.random.normal(jax.random.key(0), (2, 200))
    mu = _zero_moment((2, 200), "e4m3", spec)
    got = ca.coat_adam_step(g, mu, mu, count=1, spec=spec, implementation="auto", **HYPER)
    want = ca.coat_adam_step_reference(g, mu, mu, count=1, spec=spec, **HYPER)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert quant.num_groups(200, 96) == got[1].scale.shape[-1]


def _stacked_moment(key, shape, fmt, spec, *, positive):
    """A non-trivial stacked moment ``[L, ...]``: quantized random values."""
    x = jax.random.normal(key, shape, jnp.float32) * 1e-3
    return ca.quantize_moment(jnp.abs(x) if positive else x, fmt, spec, HYPER["expand_min"])


def test_stacked_apply_bad_input():
    spec = ca.MomentSpec()
    kw = dict(count=1, learning_rate=1e-3, weight_decay=0.0, spec=spec, **HYPER)
    mu = _stacked_moment(jax.random.key(0), (2, 4, 300), "e4m3", spec, positive=False)
    nu = _stacked_moment(jax.random.key(1), (2, 4, 300), "e4m3", spec, positive=True)
    p, g = jnp.zeros((2, 4, 300)), jnp.zeros((4, 300))
    with pytest.raises(ValueError, match="stack"):
        ca.coat_adamw_apply(p[0], g, mu, nu, index=0, implementation="xla", **kw)
    with pytest.raises(TypeError, match="integer"):
        ca.coat_adamw_apply(p, g, mu, nu, index=0.5, implementation="xla", **kw)


@pytest.mark.skipif(ON_GPU, reason="the GPU runs the kernels themselves")
@pytest.mark.parametrize(
    "config,stacked,rows",
    [
        (None, False, 64),
        (None, True, 64),
        (ca.KernelConfig(flat_stats=False, tiles=4, num_stages=2), False, 64),
        (ca.KernelConfig(block_rows=8, tiles=2), True, 64),
        (ca.KernelConfig(block_rows=8, tiles=4), False, 64),
        # 74 groups: the last program's loop runs a traced number of tiles (2 of 4).
        (ca.KernelConfig(block_rows=8, tiles=4), False, 37),
    ],
    ids=str,
)
def test_the_kernel_lowers_to_triton_for_cuda(monkeypatch, config, stacked, rows):
    """Without a GPU (CI): the real kernel's Pallas-to-Triton lowering for CUDA, through
    ``jax.export`` (no PTX is compiled: that needs the GPU's XLA). It catches what interpret mode
    cannot: a primitive, a shape or a block the Triton backend does not take."""
    from jax import export

    monkeypatch.setattr(pallas_triton, "require_gpu", lambda interpret: None)
    spec = ca.MomentSpec(nu_format="e5m2")
    layers, shape = 3, (rows, 256)
    stack = (layers, *shape) if stacked else shape
    mu = _zero_moment(stack, "e4m3", spec)
    nu = _zero_moment(stack, "e5m2", spec)
    kw = dict(count=jnp.int32(1), learning_rate=1e-3, weight_decay=0.1, spec=spec, **HYPER)

    def step(p, g, mu, nu, index):
        return ca.coat_adamw_apply(
            p,
            g,
            mu,
            nu,
            index=index if stacked else None,
            implementation="pallas",
            config=config,
            **kw,
        )

    # JAX 0.11's Triton lowering asks the device for its GPU's architecture, so without a GPU
    # it needs an abstract one to lower for (0.10 lowers without asking; the context is inert).
    hopper = jax.sharding.AbstractDevice("NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=hopper)):
        exported = export.export(
            jax.jit(step),
            platforms=("cuda",),
            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(jnp.zeros(stack), jnp.zeros(shape), mu, nu, jnp.int32(1))
    module = exported.mlir_module()
    assert module.count("__gpu$xla.gpu.triton") == 1
    # Parameter and moments are written in place: every output aliases an input.
    assert module.count("#stablehlo.output_operand_alias<") == 9
    assert ("lg2.approx.ftz.f32" in module) and ("ex2.approx.f32" in module)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("low,high", [(1e-8, 1.02e-8), (1e-8, 1.003e-8), (1e30, 1.003e30)])
def test_powers_keep_narrow_groups_exact(fmt, low, high):
    """Narrow groups of unequal values have a large k (hundreds to thousands), which multiplies
    every rounding error in the power's exponent: the kernel's powers stay centred on the group,
    so its codes match the reference's up to ties and its dequantized values to float32
    rounding."""
    rng = np.random.RandomState(3)
    x = jnp.asarray(rng.uniform(low, high, (64, 128)) * rng.choice([-1, 1], (64, 128)), jnp.float32)
    spec = ca.MomentSpec()
    want = ca.quantize_moment(x, fmt, spec, 16)
    assert float(jnp.min(want.expand)) > 100
    math_ = pallas_triton_math.Math(True, False)
    log2_range = jnp.log2(jnp.float32(quant.FP8_MAX[fmt] ** 2 / 2))
    for flat in (True, False):
        codes, stats = pallas_triton_math.quantize_tile(x, fmt, True, 16.0, log2_range, math_, flat)
        _assert_codes_match(codes, want.codes, f"{fmt} [{low}, {high}]")
        values = pallas_triton_math.dequantize_tile(want.codes, *stats, math_, flat)
        np.testing.assert_allclose(values, want.dequantize(), rtol=2e-6, atol=0)


class CoatAdamContract:
    """The kernel's contract, run on each backend by the subclasses below."""

    backend: str

    @pytest.mark.parametrize("shape,expansion,mu_format,nu_format,dtype", CASES)
    def test_kernel_matches_reference(self, shape, expansion, mu_format, nu_format, dtype):
        mode = self.backend
        spec = ca.MomentSpec(mu_format=mu_format, nu_format=nu_format, expansion=expansion)
        step = _step_fn(mode, spec)
        mu, nu = _zero_moment(shape, mu_format, spec), _zero_moment(shape, nu_format, spec)
        grads = _fixed_sign_grads(jax.random.key(sum(shape)), shape, dtype, STEPS)
        for t, g in enumerate(grads, start=1):
            # Both sides start each step from the reference's state, so a rounding tie in one step
            # cannot snowball; the states are non-trivial from step 2 on.
            u, k_mu, k_nu = step(g, mu, nu, jnp.int32(t))
            u_ref, mu, nu = _reference_step(g, mu, nu, jnp.int32(t), spec)
            what = f"step {t}"
            assert u.dtype == g.dtype and u.shape == shape
            np.testing.assert_allclose(
                np.asarray(u, np.float32),
                np.asarray(u_ref, np.float32),
                rtol=_update_rtol(dtype),
                atol=0,
                err_msg=f"{what} update",
            )
            for got, want, name in ((k_mu, mu, "mu"), (k_nu, nu, "nu")):
                assert got.codes.dtype == want.codes.dtype and got.codes.shape == shape
                _assert_codes_match(got.codes, want.codes, f"{what} {name}")
                _assert_stats_match(got, want, f"{what} {name}")

    def test_exact_math_and_other_launch_settings(self):
        """fast_math=False (the reference's own arithmetic) with a non-default tile and warp
        count."""
        mode = self.backend
        spec = ca.MomentSpec(nu_format="e5m2")
        shape = (7, 300)
        step = _step_fn(mode, spec, ca.KernelConfig(block_rows=4, num_warps=2, fast_math=False))
        mu, nu = _zero_moment(shape, "e4m3", spec), _zero_moment(shape, "e5m2", spec)
        for t, g in enumerate(_fixed_sign_grads(jax.random.key(5), shape, jnp.float32, 3), start=1):
            u, k_mu, k_nu = step(g, mu, nu, jnp.int32(t))
            u_ref, mu, nu = _reference_step(g, mu, nu, jnp.int32(t), spec)
            np.testing.assert_allclose(u, u_ref, rtol=1e-5, atol=0)
            for got, want, name in ((k_mu, mu, "mu"), (k_nu, nu, "nu")):
                _assert_codes_match(got.codes, want.codes, f"step {t} {name}")
                _assert_stats_match(got, want, f"step {t} {name}")

    @pytest.mark.parametrize(
        "shape,expansion,variants",
        # 74 groups, every variant: tile loops with a ragged last program that skips a tile
        # (4 x 4 rows: 74 = 4 * 16 + 10). 32 groups: whole programs only, the tile loop's static
        # bound. 300 columns: masked short groups, one row per program, with column statistics
        # and with a last program that runs 1 of its 2 tiles. No expansion: column statistics
        # and the ragged tile loop. Each variant is a program of its own per shape, so a shape
        # takes only the variants whose launch on it no other case runs.
        [
            ((37, 256), True, (COLUMN_STATS, TILE_LOOP, SMALL_TILES)),
            ((8, 512), True, (TILE_LOOP,)),
            ((5, 300), True, (COLUMN_STATS, SMALL_TILES)),
            ((37, 256), False, (COLUMN_STATS, TILE_LOOP)),
        ],
        ids=["ragged-tiles", "whole-programs", "short-groups", "no-expansion"],
    )
    def test_flat_statistics_and_tile_loops_equal_the_default_launch(
        self, shape, expansion, variants
    ):
        """``flat_stats`` (default on) and ``tiles`` reorganise the launch, not the arithmetic: each
        of ``variants`` gives the default launch's outputs bit for bit (interpret mode; on a GPU
        the compiler may schedule the fast-math instructions differently, so there the
        reference's bounds apply), in the update path and the fused apply. The default launch and
        the reference run once per shape; every variant is held against them."""
        mode = self.backend
        spec = ca.MomentSpec(expansion=expansion, nu_format="e5m2")
        exact = self.bit_exact_options
        default = _step_fn(mode, spec, None, exact)
        mu, nu = _zero_moment(shape, "e4m3", spec), _zero_moment(shape, "e5m2", spec)
        grads = _fixed_sign_grads(jax.random.key(11), shape, jnp.float32, 3)
        # Per step: the inputs (the reference's state), the default launch's outputs and the
        # reference's.
        steps = []
        for t, g in enumerate(grads, start=1):
            want = default(g, mu, nu, jnp.int32(t))
            u_ref, mu_ref, nu_ref = _reference_step(g, mu, nu, jnp.int32(t), spec)
            steps.append(((g, mu, nu, jnp.int32(t)), want, (u_ref, mu_ref, nu_ref)))
            mu, nu = mu_ref, nu_ref
        kw = dict(spec=spec, learning_rate=3e-3, weight_decay=0.1, **HYPER)
        p = jax.random.normal(jax.random.key(12), shape, jnp.float32)
        apply_args = (p, grads[0], mu, nu, jnp.int32(4))
        apply_want = _apply_fn(mode, None, kw, exact)(*apply_args)
        p_ref = ca.coat_adamw_apply_reference(p, grads[0], mu, nu, count=jnp.int32(4), **kw)[0]
        for config in variants:
            variant = _step_fn(mode, spec, config, exact)
            for t, (args, want, (u_ref, mu_ref, nu_ref)) in enumerate(steps, start=1):
                got = variant(*args)
                what = f"{config} step {t}"
                if mode == "interpret":
                    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=what)
                np.testing.assert_allclose(got[0], u_ref, rtol=1e-5, atol=0, err_msg=what)
                for moment, ref, name in ((got[1], mu_ref, "mu"), (got[2], nu_ref, "nu")):
                    _assert_codes_match(moment.codes, ref.codes, f"{what} {name}")
                    _assert_stats_match(moment, ref, f"{what} {name}")
            got = _apply_fn(mode, config, kw, exact)(*apply_args)
            np.testing.assert_allclose(
                got[0], p_ref, rtol=1e-6, atol=3e-3 * 1e-5, err_msg=str(config)
            )
            if mode == "interpret":
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(apply_want), strict=True):
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(config))

    @pytest.mark.parametrize("shape,expansion", [((5, 300), True), ((3, 256), False)])
    def test_kernel_matches_reference_with_cancellation(self, shape, expansion):
        """Random-sign gradients: m passes through zero, so its smallest values are ill conditioned;
        codes still agree up to ties and updates to float32 rounding of the largest update."""
        mode = self.backend
        spec = ca.MomentSpec(expansion=expansion, nu_format="e5m2")
        step = _step_fn(mode, spec)
        mu, nu = _zero_moment(shape, "e4m3", spec), _zero_moment(shape, "e5m2", spec)
        for t, key in enumerate(jax.random.split(jax.random.key(7), STEPS), start=1):
            g = jax.random.normal(key, shape, jnp.float32)
            u, k_mu, k_nu = step(g, mu, nu, jnp.int32(t))
            u_ref, mu, nu = _reference_step(g, mu, nu, jnp.int32(t), spec)
            np.testing.assert_allclose(u, u_ref, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(u_ref))))
            _assert_codes_match(k_mu.codes, mu.codes, f"step {t} mu")
            _assert_codes_match(k_nu.codes, nu.codes, f"step {t} nu")

    def test_edge_groups(self):
        """All-zero groups, one non-zero value, equal values, denormal-sized and huge gradients
        (as huge as float32 squares without overflow: g*g feeds the second moment), and a group
        whose first moment spans subnormal values to 1e15, whose smallest values still get non-zero
        codes (k = 1/16): on a GPU the kernel's flush-to-zero fast path must not take that tile (a
        CPU flushes subnormal values in the reference and in interpret mode alike)."""
        mode = self.backend
        spec = ca.MomentSpec()
        shape = (7, 128)
        rows = [
            np.zeros(128),
            np.eye(1, 128, 5)[0] * 3.0,
            np.full(128, 0.25),
            np.linspace(1e-38, 1e-36, 128),
            np.linspace(-1e18, 1e18, 128),
            np.geomspace(1e-20, 1e15, 128),
            np.concatenate([np.geomspace(1e-38, 1e-37, 8), np.geomspace(1e-15, 1e16, 120)]),
        ]
        g = jnp.asarray(np.stack(rows), jnp.float32)
        step = _step_fn(mode, spec)
        mu, nu = _zero_moment(shape, "e4m3", spec), _zero_moment(shape, "e4m3", spec)
        for t in (1, 2):
            u, k_mu, k_nu = step(g, mu, nu, jnp.int32(t))
            u_ref, mu, nu = _reference_step(g, mu, nu, jnp.int32(t), spec)
            for x in jax.tree.leaves((k_mu, k_nu, mu, nu)):
                assert bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))), f"step {t}: non-finite"
            np.testing.assert_array_equal(jnp.isfinite(u), jnp.isfinite(u_ref))
            _assert_codes_match(k_mu.codes, mu.codes, f"step {t} mu")
            _assert_codes_match(k_nu.codes, nu.codes, f"step {t} nu")
            np.testing.assert_allclose(k_mu.expand, mu.expand, rtol=0)
            np.testing.assert_allclose(k_nu.expand, nu.expand, rtol=0)

    @pytest.mark.parametrize("shape,dtype", [((5, 300), jnp.bfloat16), ((4, 256), jnp.float32)])
    def test_fused_apply_matches_reference(self, shape, dtype):
        mode = self.backend
        spec = ca.MomentSpec(nu_format="e5m2")
        kw = dict(spec=spec, learning_rate=3e-3, weight_decay=0.1, **HYPER)

        @jax.jit
        def kernel(p, g, mu, nu, count):
            return ca.coat_adamw_apply(
                p,
                g,
                mu,
                nu,
                count=count,
                implementation="pallas",
                interpret=mode == "interpret",
                **kw,
            )

        reference = jax.jit(
            lambda p, g, mu, nu, count: ca.coat_adamw_apply_reference(
                p, g, mu, nu, count=count, **kw
            )
        )
        p = jax.random.normal(jax.random.key(1), shape, jnp.float32)
        mu, nu = _zero_moment(shape, "e4m3", spec), _zero_moment(shape, "e5m2", spec)
        for t, g in enumerate(_fixed_sign_grads(jax.random.key(2), shape, dtype, 3), start=1):
            p_new, k_mu, k_nu = kernel(p, g, mu, nu, jnp.int32(t))
            p_ref, mu, nu = reference(p, g, mu, nu, jnp.int32(t))
            assert p_new.dtype == jnp.float32 and p_new.shape == shape
            # |p| ~ 1 and the step is lr * O(1): one bf16 ulp of the update is <= 3e-3 * 2**-7.
            np.testing.assert_allclose(p_new, p_ref, rtol=1e-6, atol=3e-3 * _update_rtol(dtype))
            _assert_codes_match(k_mu.codes, mu.codes, f"step {t} mu")
            _assert_stats_match(k_nu, nu, f"step {t} nu")
            p = p_ref

    def test_coat_adamw_pallas_matches_xla(self):
        """The optimizer on both implementations, independent trajectories over a few steps."""
        mode = self.backend
        params = {
            "w": jax.random.normal(jax.random.key(0), (3, 256)),
            "b": jax.random.normal(jax.random.key(1), (130,)),
            "k": jax.random.normal(jax.random.key(2), (2, 3, 128)),
        }
        lr, steps = 1e-2, 3
        runs = {}
        for impl in ("xla", "pallas"):
            tx = coat_jax.coat_adamw(
                lr,
                weight_decay=0.1,
                nu_format="e5m2",
                implementation=impl,
                interpret=mode == "interpret",
            )

            @jax.jit
            def step(p, s, g, tx=tx):
                updates, s = tx.update(g, s, p)
                return optax.apply_updates(p, updates), s

            p, s = params, tx.init(params)
            for t in range(steps):
                keys = jax.random.split(jax.random.key(100 + t), len(params))
                g = {
                    name: jnp.abs(jax.random.normal(k, x.shape)) * jnp.sign(params[name])
                    for k, (name, x) in zip(keys, params.items(), strict=True)
                }
                p, s = step(p, s, g)
            runs[impl] = (p, s)
        (p_x, s_x), (p_p, s_p) = runs["xla"], runs["pallas"]
        for name in params:
            diff = np.abs(np.asarray(p_p[name]) - np.asarray(p_x[name]))
            tol = 1e-5 * np.abs(np.asarray(p_x[name])) + 1e-7
            # A rounding tie can flip one code and so move one element by a fraction of lr.
            assert np.mean(diff > tol) <= MAX_TIE_FRACTION, name
            assert diff.max() <= 0.2 * lr * steps, name
        mu_x, nu_x = coat_jax.dequantized_moments(s_x)
        mu_p, nu_p = coat_jax.dequantized_moments(s_p)
        for a, b in ((mu_p, mu_x), (nu_p, nu_x)):
            for name in params:
                close = np.isclose(a[name], b[name], rtol=1e-5, atol=0)
                assert np.mean(~close) <= MAX_TIE_FRACTION, name
        assert jax.tree.map(lambda x: (x.dtype, x.shape), s_p) == jax.tree.map(
            lambda x: (x.dtype, x.shape), s_x
        )

    def test_one_compile_serves_every_step(self):
        """Hyper-parameters are operands: new counts and decay rates reuse the compiled kernel."""
        mode = self.backend
        spec = ca.MomentSpec()
        shape = (2, 128)

        @jax.jit
        def step(g, mu, nu, count, b1, b2, eps, expand_min):
            return ca.coat_adam_step_pallas(
                g,
                mu,
                nu,
                count=count,
                b1=b1,
                b2=b2,
                eps=eps,
                expand_min=expand_min,
                spec=spec,
                interpret=mode == "interpret",
            )

        reference = jax.jit(
            lambda g, mu, nu, t, b1, b2, eps, em: ca.coat_adam_step_reference(
                g, mu, nu, count=t, b1=b1, b2=b2, eps=eps, expand_min=em, spec=spec
            )
        )
        mu, nu = _zero_moment(shape, "e4m3", spec), _zero_moment(shape, "e4m3", spec)
        g = jax.random.normal(jax.random.key(0), shape)
        for t, (b1, b2) in enumerate([(0.9, 0.999), (0.8, 0.99), (0.5, 0.9)], start=1):
            args = [jnp.float32(x) for x in (b1, b2, 1e-8, 16)]
            u, mu_k, nu_k = step(g, mu, nu, jnp.int32(t), *args)
            u_ref, mu, nu = reference(g, mu, nu, jnp.int32(t), *args)
            np.testing.assert_allclose(u, u_ref, rtol=1e-5)
        assert step._cache_size() == 1

    @pytest.mark.parametrize(
        "shape,expansion,config",
        [
            ((24, 256), True, None),  # 48 groups per element: 3 programs of 16
            ((256,), False, None),  # 2 groups per element: one program of 2
            # 96 groups per element: 6 programs of 4 tiles of 4 (tile loops)
            ((2, 16, 384), True, ca.KernelConfig(block_rows=4, tiles=4)),
        ],
    )
    def test_stacked_apply_updates_one_element_in_place(self, shape, expansion, config):
        """``coat_adamw_apply(..., index=i)`` on stacks ``[L, ...]``: element ``i`` becomes what the
        step gives that element alone (the kernel's own result, bit for bit in interpret mode; the
        XLA path's slice, step and write-back likewise), every other element stays as it was, bit
        for bit."""
        mode = self.backend
        spec = ca.MomentSpec(expansion=expansion, nu_format="e5m2")
        layers = 3
        keys = jax.random.split(jax.random.key(21), 4)
        p = jax.random.normal(keys[0], (layers, *shape), jnp.float32)
        g = jax.random.normal(keys[1], shape, jnp.float32) * 1e-2
        mu = _stacked_moment(keys[2], (layers, *shape), "e4m3", spec, positive=False)
        nu = _stacked_moment(keys[3], (layers, *shape), "e5m2", spec, positive=True)
        kw = dict(count=jnp.int32(5), learning_rate=3e-3, weight_decay=0.1, spec=spec, **HYPER)
        interpret = mode == "interpret"
        exact = functools.partial(jax.jit, compiler_options=self.bit_exact_options)

        @exact
        def stacked(p, g, mu, nu, index):
            return ca.coat_adamw_apply(
                p,
                g,
                mu,
                nu,
                index=index,
                implementation="pallas",
                interpret=interpret,
                config=config,
                **kw,
            )

        @exact
        def alone(p, g, mu, nu):
            return ca.coat_adamw_apply(
                p, g, mu, nu, implementation="pallas", interpret=interpret, config=config, **kw
            )

        xla = exact(
            lambda p, g, mu, nu, index: ca.coat_adamw_apply(
                p, g, mu, nu, index=index, implementation="xla", **kw
            )
        )
        xla_alone = exact(
            lambda p, g, mu, nu: ca.coat_adamw_apply(p, g, mu, nu, implementation="xla", **kw)
        )
        at = lambda tree, i: jax.tree.map(lambda x: x[i], tree)
        for index in (0, layers - 1):
            got = stacked(p, g, mu, nu, jnp.int32(index))
            want = alone(p[index], g, at(mu, index), at(nu, index))
            ref = xla(p, g, mu, nu, jnp.int32(index))
            ref_alone = xla_alone(p[index], g, at(mu, index), at(nu, index))
            for new, old, one, r in zip(
                jax.tree.leaves(got),
                jax.tree.leaves((p, mu, nu)),
                jax.tree.leaves(want),
                jax.tree.leaves(ref),
                strict=True,
            ):
                new, old, r = np.asarray(new), np.asarray(old), np.asarray(r)
                others = [i for i in range(layers) if i != index]
                np.testing.assert_array_equal(new[others], old[others])
                np.testing.assert_array_equal(r[others], old[others])
                if interpret:
                    np.testing.assert_array_equal(new[index], np.asarray(one))
            # The XLA path's element (sliced inside one program) is the XLA step of that element
            # alone, bit for bit.
            for a, b in zip(
                jax.tree.leaves(at(ref, index)), jax.tree.leaves(ref_alone), strict=True
            ):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            # The kernel's element against the reference's, to the kernel's usual bounds.
            np.testing.assert_allclose(got[0][index], ref[0][index], rtol=1e-6, atol=3e-3 * 1e-5)
            _assert_codes_match(got[1].codes[index], ref[1].codes[index], f"mu {index}")
            _assert_codes_match(got[2].codes[index], ref[2].codes[index], f"nu {index}")

    def test_stacked_apply_with_a_short_last_group_steps_the_slices(self):
        mode = self.backend
        # The in-place kernel takes whole groups only: "pallas" steps the element's slices with the
        # per-parameter kernel and writes them back; the same step as the XLA path's.
        spec = ca.MomentSpec()
        kw = dict(count=3, learning_rate=1e-3, weight_decay=0.1, spec=spec, **HYPER)
        mu = _stacked_moment(jax.random.key(0), (3, 4, 300), "e4m3", spec, positive=False)
        nu = _stacked_moment(jax.random.key(1), (3, 4, 300), "e4m3", spec, positive=True)
        p = jax.random.normal(jax.random.key(2), (3, 4, 300))
        g = jax.random.normal(jax.random.key(3), (4, 300))
        hyper = pallas_triton.hyper_vector(
            spec=spec, index=1, **{k: v for k, v in kw.items() if k != "spec"}
        )
        with pytest.raises(NotImplementedError, match="multiple of the group size"):
            pallas_triton.fused_call(
                g, p, mu, nu, hyper, spec=spec, config=None, interpret=True, stacked=True
            )
        interpret = mode == "interpret"
        got = jax.jit(
            lambda p, mu, nu: ca.coat_adamw_apply(
                p, g, mu, nu, index=1, implementation="pallas", interpret=interpret, **kw
            )
        )(p, mu, nu)
        ref = ca.coat_adamw_apply(p, g, mu, nu, index=1, implementation="xla", **kw)
        np.testing.assert_allclose(got[0], ref[0], rtol=1e-6, atol=1e-7)
        for i in (0, 2):  # the other elements untouched
            np.testing.assert_array_equal(got[0][i], p[i])
            for new, old in ((got[1], mu), (got[2], nu)):
                for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old), strict=True):
                    np.testing.assert_array_equal(a[i], b[i])
        _assert_codes_match(got[1].codes[1], ref[1].codes[1], "mu 1")
        _assert_codes_match(got[2].codes[1], ref[2].codes[1], "nu 1")


class TestInterpret(CoatAdamContract, Interpret):
    pass


class TestCompiledGPU(CoatAdamContract, CompiledGPU):
    pass

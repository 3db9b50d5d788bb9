"""Checks shared by the FP8 kernel contracts (tests/kernels/test_fp8_quant.py, test_fp8_act.py).

Codes must be identical except for rare rounding ties (the kernel and XLA may evaluate ``x / s``
with different rounding; at most 0.1% of codes may differ, by one FP8 step); scales must be equal
to float32 rounding; outputs equal up to one rounding of the output dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from coat_jax import quant
from tests.kernels.contract import Backend

# Shapes: plain; rows and groups that the default tiles do not divide (12 rows, 3 / 6 groups).
SHAPES = [(4, 8, 64), (12, 48), (3, 5, 96)]
NORM_SHAPES = [(4, 8, 64), (12, 128)]


def data(shape, dtype, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    rows = 10.0 ** jax.random.uniform(k2, shape[:-1] + (1,), minval=-4.0, maxval=4.0)
    return (rows * jax.random.normal(k1, shape)).astype(dtype)


def assert_codes_match(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    g = np.asarray(got.astype(jnp.float32))
    w = np.asarray(want.astype(jnp.float32))
    differ = g != w
    assert differ.mean() <= 1e-3, differ.mean()
    if differ.any():
        # A tie broken the other way lands on the neighbouring code: within one FP8 step.
        np.testing.assert_allclose(g[differ], w[differ], rtol=0.26)


def assert_close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    # Two roundings of the output dtype, or a few float32 ulps where exp / rsqrt differ.
    rtol = max(2 * float(jnp.finfo(dtype).eps), 1e-5)
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=rtol, atol=1e-30
    )


def assert_scales_match(got, want):
    """float32 scales equal to float32 rounding; E8M0 bytes equal (a scale within float32
    rounding of a power of two may round up on one side only: one exponent step, rarely)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype != jnp.uint8:
        assert_close(got, want, jnp.float32)
        return
    g, w = np.asarray(got, np.int32), np.asarray(want, np.int32)
    assert (g != w).mean() <= 1e-3 and np.abs(g - w).max() <= 1


def assert_saved_format(quantized, scale_format):
    for q in quantized:
        assert q.scale.dtype == quant.SCALE_DTYPES[scale_format], q


class Fp8KernelContract(Backend):
    """Runs an op on the backend under test and on its jnp reference (the ``xla`` path)."""

    def both(self, fn, *args, **kwargs):
        return (
            fn(*args, implementation="pallas", interpret=self.interpret, **kwargs),
            fn(*args, implementation="xla", **kwargs),
        )

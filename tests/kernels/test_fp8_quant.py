"""The Pallas FP8 quantizers (pallas_kernels/fp8_quant/) against their jnp references.

The contract runs on each backend of tests/kernels/contract.py; the checks and their tolerances
are in tests/kernels/fp8_checks.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from coat_jax import quant
from pallas_kernels import fp8_quant
from tests.kernels.contract import CompiledGPU, Interpret
from tests.kernels.fp8_checks import (
    SHAPES,
    Fp8KernelContract,
    assert_codes_match,
    assert_scales_match,
    data,
)


class Fp8QuantContract(Fp8KernelContract):
    @pytest.mark.parametrize("shape", SHAPES)
    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
    @pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
    @pytest.mark.parametrize("scale_format", quant.SCALE_FORMATS)
    def test_per_group_quantizer(self, shape, dtype, fmt, scale_format):
        q, q_ref = self.both(
            fp8_quant.quantize_per_group, data(shape, dtype), fmt=fmt, scale_format=scale_format
        )
        (codes, scale), (codes_ref, scale_ref) = (q.codes, q.scale), (q_ref.codes, q_ref.scale)
        assert scale.shape == shape[:-1] + (shape[-1] // 16,)
        assert scale.dtype == quant.SCALE_DTYPES[scale_format]
        assert_scales_match(scale, scale_ref)
        assert_codes_match(codes, codes_ref)

    @pytest.mark.parametrize("shape", SHAPES)
    @pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
    def test_per_tensor_quantizer_with_group_scaling(self, shape, fmt):
        x = data(shape, jnp.bfloat16, seed=1)
        q, q_ref = self.both(fp8_quant.quantize_per_tensor, x, fmt=fmt)
        (codes, scale), (codes_ref, scale_ref) = (q.codes, q.scale), (q_ref.codes, q_ref.scale)
        assert scale.shape == ()
        # Group scaling (max of group maxima) is the plain tensor max, rounded up to bfloat16.
        amax = float(jnp.max(jnp.abs(x.astype(jnp.float32))))
        assert amax / quant.FP8_MAX[fmt] <= float(scale) < amax / quant.FP8_MAX[fmt] * (1 + 2**-7)
        assert float(scale) == float(scale.astype(jnp.bfloat16))
        assert float(scale) == float(scale_ref)
        assert_codes_match(codes, codes_ref)


class TestInterpret(Fp8QuantContract, Interpret):
    pass


class TestCompiledGPU(Fp8QuantContract, CompiledGPU):
    pass

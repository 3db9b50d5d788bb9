"""The backends every kernel contract runs on, shared by the per-op kernel tests.

As tokamax's ``test_base``: an op's tests are the methods of one contract class (``<Op>Contract``
in ``tests/kernels/test_<op>.py``), written once against ``self.backend``; each implementation is
a subclass that mixes in one backend below and says nothing else:

- :class:`Interpret`: the Pallas kernel in interpret mode (the CPU, and so CI);
- :class:`CompiledGPU`: the Pallas kernel compiled by Triton (skips without a CUDA GPU).

The jnp references that the contracts compare against are the CPU path of each op; they are
checked against the float64 oracle in ``tests/fp8/test_fp8_oracle.py``.
"""

from __future__ import annotations

import jax
import pytest

ON_GPU = jax.default_backend() == "gpu"
# The test run compiles for the CPU with XLA's loop-fusion emitters (conftest.py); they may round
# one element-wise chain differently in two programs that fuse it differently (one float32 ulp).
# Comparisons of two launches bit for bit compile with XLA's default fusion emitters instead.
CPU_DEFAULT_EMITTERS = {"xla_cpu_use_fusion_emitters": True}


class Backend:
    backend: str

    @property
    def interpret(self) -> bool:
        return self.backend == "interpret"

    @property
    def bit_exact_options(self) -> dict | None:
        """``jax.jit``'s ``compiler_options`` for programs whose results a test compares bit for
        bit with another launch of the kernel: in interpret mode, XLA:CPU's own fusion emitters
        (:data:`CPU_DEFAULT_EMITTERS`)."""
        return CPU_DEFAULT_EMITTERS if self.interpret else None


@pytest.mark.skipif(ON_GPU, reason="the compiled kernel runs on GPUs")
class Interpret(Backend):
    backend = "interpret"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
class CompiledGPU(Backend):
    backend = "gpu"

"""XLA compiler options under which the FP8 linears compile to cuBLASLt FP8 GEMMs on a GPU."""

from __future__ import annotations

import jax

# XLA options under which the FP8 GEMMs compile to cuBLASLt FP8 on a GPU (docs/fp8_gemm.md). By
# default XLA's Triton GEMM pass wraps every dot whose operands are ``convert(fp8)`` into a
# Triton fusion and autotunes it, which makes a large model's step slow to compile. With Triton
# GEMMs off the dots go to the cuBLAS rewriter, which emits ``__cublas$lt$matmul$f8``. The dot
# merger is off too: it joins small dots that share an operand (q|k|v) into one whose operand is
# a concatenation, no longer ``convert(codes)``.
GPU_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_dot_merger_threshold_mb": 0}
GPU_XLA_FLAGS = " ".join(f"--{k}={str(v).lower()}" for k, v in GPU_COMPILER_OPTIONS.items())


GPU_BACKENDS = ("gpu", "cuda", "rocm")


def is_gpu_backend(backend: str | None = None) -> bool:
    """Whether ``backend`` (default: JAX's default backend) is a GPU platform by any of the
    names JAX gives one (``gpu``, ``cuda``, ``rocm``)."""
    return (backend or jax.default_backend()) in GPU_BACKENDS


def fp8_compiler_options(backend: str | None = None) -> dict | None:
    """``jax.jit(..., compiler_options=...)`` for programs that use the FP8 linears.

    On a GPU backend this turns off XLA's Triton GEMM fusion and its dot merger, so that the FP8
    GEMMs become cuBLASLt FP8 GEMMs and compile in seconds; elsewhere it returns ``None`` (no
    options). The same setting for a whole process is :data:`GPU_XLA_FLAGS` in ``XLA_FLAGS``,
    set before JAX starts.

    Examples:
      >>> step = jax.jit(lambda x: x + 1, compiler_options=fp8_compiler_options())
    """
    return dict(GPU_COMPILER_OPTIONS) if is_gpu_backend(backend) else None

"""Alias of :mod:`pallas_kernels.dispatch` for ``coat_jax/fp8_ops.py``'s import; remove it once
that import names ``pallas_kernels.dispatch``."""

from pallas_kernels.dispatch import check_implementation, dispatch

__all__ = ["check_implementation", "dispatch"]

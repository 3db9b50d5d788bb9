"""Producers that write their output as a row-wise scaled FP8 operand, in one pass.

The row-wise FP8 linear (``FP8Config(linear_scaling="row")``, :mod:`coat_jax.fp8.rowwise`)
takes its input as E4M3 codes with one float32 scale per row. The maximum of a row is a
reduction over what the producer of that row computes, so a kernel that holds whole rows can
finish it and write the codes itself: the producer's BF16 output is never written, and no
separate pass reads it for its maximum and again for its cast. Two producers of a Llama layer:

* :func:`rmsnorm_rowwise`: RMSNorm, also writing the 1xG FP8 input and ``rstd`` its backward
  reads (as :func:`pallas_kernels.fp8_act.rmsnorm_fwd` keeps them);
* :func:`swiglu_rowwise`: ``silu(gate) * up``, also writing the 1xG FP8 gate and up
  (as :func:`pallas_kernels.fp8_act.swiglu_fwd` keeps them).

The row codes come out as a :class:`~pallas_kernels.quant.QuantizedTensor` with one group of
``D`` per row (``scale [..., 1]``), the form the row-wise linear keeps. Their backward is the
plain ops' (``fp8_act.rmsnorm_bwd``, ``fp8_act.swiglu_bwd``).

Each has a plain-jnp ``*_reference`` (the CPU path and the numerics contract) and a Pallas
Triton kernel, chosen by ``implementation="auto" | "xla" | "pallas"`` through the one dispatcher
(:func:`pallas_kernels.dispatch.dispatch`); a Mosaic GPU kernel would be one more entry there.
The kernels need ``D`` a multiple of ``G``; ``mesh`` runs them per batch shard.

Modules: ``reference``, ``pallas_triton`` and ``api``, as :mod:`pallas_kernels.fp8_act`.
"""

from pallas_kernels.fp8_rowquant.api import rmsnorm_rowwise, swiglu_rowwise
from pallas_kernels.fp8_rowquant.pallas_triton import (
    rmsnorm_rowwise_pallas,
    swiglu_rowwise_pallas,
)
from pallas_kernels.fp8_rowquant.reference import (
    quantize_rows_reference,
    rmsnorm_rowwise_reference,
    swiglu_rowwise_reference,
)

__all__ = [
    "quantize_rows_reference",
    "rmsnorm_rowwise",
    "rmsnorm_rowwise_pallas",
    "rmsnorm_rowwise_reference",
    "swiglu_rowwise",
    "swiglu_rowwise_pallas",
    "swiglu_rowwise_reference",
]

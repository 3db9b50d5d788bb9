"""Non-linear ops of COAT's precision flow fused with their 1xG FP8 quantization, fwd and bwd.

Each op computes its forward output from the exact (BF16) input in float32 and, in the same pass,
writes the FP8 E4M3 codes and 1xG scales (float32, or one-byte powers of two with
``scale_format="e8m0"``) of the input(s) that its backward needs, as one
:class:`pallas_kernels.quant.QuantizedTensor` per input; the backward takes those quantized
tensors instead of a BF16 copy (docs/design.md, 'The precision flow'):

* RMSNorm: ``y = w * (x * rsqrt(mean(x^2) + eps))`` (Hugging Face Llama's rounding); saves
  FP8 ``x`` and the float32 per-row ``rsqrt`` (one number per row, 1/D of the activation).
* SiLU: ``y = x * sigmoid(x)``; saves FP8 ``x``.
* product: ``y = a * b``; saves FP8 ``a`` and FP8 ``b``.
* SwiGLU (beyond COAT's op list): ``y = silu(gate) * up``; saves FP8 ``gate`` and ``up`` only and
  recomputes the SiLU in backward, so the SiLU output is never kept.

Every op has a plain-jnp ``*_reference`` (the CPU path and the numerics contract) and a Pallas
Triton kernel; the public entry points (``rmsnorm_fwd``, ``rmsnorm_bwd``, ``silu_fwd``, ...) take
``implementation="auto" | "xla" | "pallas"``, ``interpret`` and ``mesh`` like the quantizers in
:mod:`pallas_kernels.fp8_quant`, whose tile layout (``[M, D / G, G]`` tiles) they share, and go
through the one dispatcher (:func:`pallas_kernels.dispatch.dispatch`). The kernels need ``D`` to
be a multiple of ``G``, and RMSNorm's, which hold whole rows, ``D / G`` to be a power of two;
:func:`pallas_supports` says whether a shape fits. A kernel raises ``NotImplementedError`` for
a shape it does not take, so ``"auto"`` runs the reference there and ``"pallas"`` raises a
``ValueError`` naming the shape.

With ``mesh`` (a :class:`~pallas_kernels.sharding.KernelMesh`) the kernels run on each batch
shard of activations split along their leading axis: per row and per group, they need nothing
from other shards, except RMSNorm's weight gradient (a ``psum`` of the shards' partial sums).

Modules: ``reference`` (the jnp references, also the CPU path), ``pallas_triton`` (the kernels
and :func:`pallas_supports`) and ``api`` (the public entry points and the choice of
implementation).
"""

from pallas_kernels.fp8_act.api import (
    mul_bwd,
    mul_fwd,
    rmsnorm_bwd,
    rmsnorm_fwd,
    silu_bwd,
    silu_fwd,
    swiglu_bwd,
    swiglu_fwd,
)
from pallas_kernels.fp8_act.pallas_triton import (
    OPS,
    mul_bwd_pallas,
    mul_fwd_pallas,
    pallas_supports,
    rmsnorm_bwd_pallas,
    rmsnorm_fwd_pallas,
    silu_bwd_pallas,
    silu_fwd_pallas,
    swiglu_bwd_pallas,
    swiglu_fwd_pallas,
)
from pallas_kernels.fp8_act.reference import (
    mul_bwd_reference,
    mul_fwd_reference,
    rmsnorm_bwd_reference,
    rmsnorm_fwd_reference,
    silu32,
    silu_bwd_reference,
    silu_fwd_reference,
    silu_grad,
    swiglu_bwd_reference,
    swiglu_fwd_reference,
    swiglu_grads,
)

__all__ = [
    "OPS",
    "mul_bwd",
    "mul_bwd_pallas",
    "mul_bwd_reference",
    "mul_fwd",
    "mul_fwd_pallas",
    "mul_fwd_reference",
    "pallas_supports",
    "rmsnorm_bwd",
    "rmsnorm_bwd_pallas",
    "rmsnorm_bwd_reference",
    "rmsnorm_fwd",
    "rmsnorm_fwd_pallas",
    "rmsnorm_fwd_reference",
    "silu32",
    "silu_bwd",
    "silu_bwd_pallas",
    "silu_bwd_reference",
    "silu_fwd",
    "silu_fwd_pallas",
    "silu_fwd_reference",
    "silu_grad",
    "swiglu_bwd",
    "swiglu_bwd_pallas",
    "swiglu_bwd_reference",
    "swiglu_fwd",
    "swiglu_fwd_pallas",
    "swiglu_fwd_reference",
    "swiglu_grads",
]

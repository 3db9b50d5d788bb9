"""One COAT AdamW step for one parameter: dequantize the FP8 moments, update, re-quantize.

``coat_adam_step`` is the entry point ``coat_jax.scale_by_coat_adam`` calls per parameter. It
dispatches on ``implementation`` through :func:`pallas_kernels.dispatch.dispatch`: ``"xla"`` runs
:func:`coat_adam_step_reference` (plain jnp, the CPU path and the numerics contract of
docs/design.md, 'The optimizer step', line by line), ``"pallas"`` the fused kernel
:func:`coat_adam_step_pallas`, ``"auto"`` the kernel where it applies (a GPU, a power-of-two group
size, one device or a known mesh) and the reference elsewhere.

Sharded parameters: with ``mesh`` and the parameter's ``partition`` (a ``PartitionSpec``) the
kernel runs on each shard through ``shard_map``, with no gather of the parameter, its gradient or
its state: every group lies on one shard, because the kernel runs under
:func:`pallas_kernels.sharding.group_aligned_spec` (a split of the last axis off group boundaries
moves to another axis, or that axis is replicated). The hyper-parameters are a replicated operand.

A moment travels as a :class:`pallas_kernels.quant.QuantizedTensor` made per group of
``spec.group_size`` in the parameter's *group view*: the parameter's shape, or a reshape of it of
the same rank whose last axis the groups run along (``coat_jax.state_codec.group_view``: a
narrow parameter is grouped over its flatten). Its codes are in a float8 dtype, its float32
per-group statistics of shape ``view[:-1] + (ceil(view[-1] / group_size),)``; ``expand`` and
``center`` are ``None`` without Dynamic Range Expansion. The entry points take the parameter and
its gradient in the parameter's shape: the reference steps them there and quantizes in the view,
the kernel sees them reshaped to the view (free in memory).

The kernel (Pallas, Triton backend) does the whole step in one pass over memory: it reads the
gradient, both moments' codes and statistics, and writes the update, the new codes and the new
statistics (codes and statistics in place). :func:`coat_adamw_apply` is the same pass that also
reads the float32 parameter and writes the new parameter instead of the update (decoupled weight
decay and the learning rate folded in), which saves the update's round trip through memory.

The kernel's layout and its hyper-parameter operand: :mod:`pallas_kernels.coat_adam.pallas_triton`.
Everything specific to Triton (masked loads and stores, inline PTX for ``ex2``/``lg2``,
``num_warps``) sits in the ``interpret=False`` branch and in :class:`KernelConfig`, so a Mosaic
GPU kernel could replace it.

Modules (one job each): ``config`` (:class:`MomentSpec`, :class:`KernelConfig`), ``reference``
(the jnp reference, also the CPU path), ``pallas_triton_math`` (the kernel's per-tile arithmetic),
``pallas_triton`` (the kernel and its ``pallas_call``), ``sharded`` (the kernel per shard through
``shard_map``) and ``api`` (the public functions and the choice of implementation).
"""

from pallas_kernels.coat_adam.api import (
    coat_adam_step,
    coat_adam_step_pallas,
    coat_adamw_apply,
)
from pallas_kernels.coat_adam.config import DEFAULT_CONFIG, KernelConfig, MomentSpec
from pallas_kernels.coat_adam.reference import (
    adam_moments_and_update,
    apply_update,
    coat_adam_step_reference,
    coat_adamw_apply_reference,
    quantize_moment,
)

__all__ = [
    "DEFAULT_CONFIG",
    "KernelConfig",
    "MomentSpec",
    "adam_moments_and_update",
    "apply_update",
    "coat_adam_step",
    "coat_adam_step_pallas",
    "coat_adam_step_reference",
    "coat_adamw_apply",
    "coat_adamw_apply_reference",
    "quantize_moment",
]

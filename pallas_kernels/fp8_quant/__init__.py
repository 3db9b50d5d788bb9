"""FP8 quantizers of the activation precision flow: per-group 1xG and per-tensor with group scaling.

Two quantizers feed COAT's FP8 activations (docs/design.md, 'The precision flow'):

* :func:`quantize_per_group` -- E4M3 codes plus one float32 scale per 1xG group along the last
  axis (G = 16 for non-linear ops): ``s = (max|x| + 1e-20) / fmax``, ``q = fp8(x / s)``. It is
  ``pallas_kernels.quant.quantize_absmax`` with ``group_size=G``, fused into one kernel.
* :func:`quantize_per_tensor` -- codes plus one float32 scalar scale, the input format of an FP8
  GEMM. The scale is found just in time by *group scaling*: a max over each 1xG group, then a
  max over that G-times smaller tensor, with no amax history.

Both return a :class:`pallas_kernels.quant.QuantizedTensor` (``granularity="group"`` with
``group_size=G``, and ``"tensor"``), from the kernel and from the reference alike.

Each entry point takes ``implementation="auto" | "xla" | "pallas"`` and ``interpret`` (run the
Pallas kernel in interpret mode, which is how the CPU tests check the kernels against the
reference), dispatched by :func:`pallas_kernels.dispatch.dispatch`: ``"auto"`` runs the Pallas
Triton kernel where it applies and the plain-jnp ``*_reference`` otherwise (off a GPU, for a last
axis that is not a multiple of ``G``). With ``mesh=`` (a
:class:`~pallas_kernels.sharding.KernelMesh`) the kernels run on each shard of an operand
sharded over the mesh; a per-tensor scale is then the maximum over all shards (one scalar
``pmax``), bit for bit the scale one device computes.

Kernel layout: ``x [..., D]`` is viewed (for free) as ``[M, D / G, G]``; a program handles a
``[block_rows, block_groups, G]`` tile, so group maxima are a reduction over the tile's last axis
and no in-kernel reshape is needed. Triton wants power-of-two tile dimensions, so the tile sizes
used are the largest powers of two up to the config's that divide ``M`` and ``D / G``.

Modules: ``config`` (:class:`TileConfig` and the tiled view), ``reference`` (the jnp
references, also the CPU path), ``pallas_triton`` (the kernels) and ``api`` (the public entry
points and the choice of implementation).
"""

from pallas_kernels.fp8_quant.api import (
    quantize_per_group,
    quantize_per_tensor,
)
from pallas_kernels.fp8_quant.config import (
    DEFAULT_TILES,
    TileConfig,
    grouped_view,
    pow2_divisor,
    tiles_for,
)
from pallas_kernels.fp8_quant.pallas_triton import (
    group_quantize_tile,
    quantize_per_group_pallas,
    quantize_per_tensor_pallas,
    scaled_cast_pallas,
)
from pallas_kernels.fp8_quant.reference import (
    group_amax_reference,
    per_group,
    per_tensor,
    quantize_per_group_reference,
    quantize_per_tensor_reference,
    round_up_to_bfloat16,
    scale_from_amax,
)

__all__ = [
    "DEFAULT_TILES",
    "TileConfig",
    "group_amax_reference",
    "group_quantize_tile",
    "grouped_view",
    "per_group",
    "per_tensor",
    "pow2_divisor",
    "quantize_per_group",
    "quantize_per_group_pallas",
    "quantize_per_group_reference",
    "quantize_per_tensor",
    "quantize_per_tensor_pallas",
    "quantize_per_tensor_reference",
    "round_up_to_bfloat16",
    "scale_from_amax",
    "scaled_cast_pallas",
    "tiles_for",
]

"""What the FP8 ops keep for backward: the remat names they tag it with, and the codes barrier.

Every op tags the tensors it keeps (:func:`keep`, :func:`keep_weight`) so that a remat policy
selects them by name (docs/design.md, 'The precision flow'). FP8 codes made by XLA's own
quantizers pass :func:`pin` (an optimization barrier unless ``FP8Config.codes_barrier`` is off),
so that XLA cannot fold the quantize-dequantize round trip back into the unquantized value.
"""

from __future__ import annotations

import jax

from coat_jax import quant
from coat_jax.fp8.config import FP8Config

# ``jax.ad_checkpoint.checkpoint_name`` of every activation an op keeps for backward, in every
# precision: the FP8 codes and scales of the COAT ops (plus RMSNorm's 1/rms) and the inputs the
# plain ops' autodiff needs. A remat policy that saves this name keeps exactly the precision
# flow's residuals (docs/design.md, 'The precision flow') and recomputes everything else, weight
# casts included (``coat_jax.llama.REMAT_POLICIES``).
ACTIVATION = "activation"
# ``checkpoint_name`` of the FP8 weight codes and per-tensor scales ``fp8_linear`` keeps for
# backward with ``FP8Config(weight_residual="fp8")`` (1 byte per weight, alive from forward to
# backward). A remat policy that saves this name keeps them; one that does not recomputes them in
# backward (``coat_jax.llama.REMAT_POLICIES``). With ``"master"`` nothing carries this name.
WEIGHT = "fp8_weight"


def keep(tree):
    """Tags every array of ``tree`` (quantized tensors' codes and scales included) as a kept
    activation (:data:`ACTIVATION`) for remat."""
    return quant.named(tree, ACTIVATION)


def keep_weight(tree):
    """Tags every array of ``tree`` as kept FP8 weight codes (:data:`WEIGHT`) for remat."""
    return quant.named(tree, WEIGHT)


def materialize(tree):
    """Makes XLA keep FP8 codes as FP8 (an optimization barrier on ``tree``).

    With excess precision allowed (XLA's default) the GPU compiler folds a round trip such as
    ``convert(convert(y, f8), f32)`` back to ``y`` when both ends are in one program: the saved
    "FP8" activation would silently become the float32 value (4x the memory) and the FP8 GEMM a
    BF16 one. The barrier pins the quantized value.
    """
    return jax.lax.optimization_barrier(tree)


def pin(tree, config: FP8Config):
    """:func:`materialize` unless ``config.codes_barrier`` is off."""
    return materialize(tree) if config.codes_barrier else tree

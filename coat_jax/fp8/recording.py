"""Activation telemetry of the FP8 ops: each op's ``observed_*`` variant, which also returns the
scales it quantized with, and the :class:`ScaleRecorder` that collects them per trace.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from coat_jax import quant
from coat_jax.fp8.attention import fp8_attention, fp8_attention_linear
from coat_jax.fp8.config import DEFAULT_CONFIG, FP8Config
from coat_jax.fp8.elementwise import fp8_mul, fp8_rmsnorm, fp8_silu, fp8_swiglu
from coat_jax.fp8.linear import fp8_linear


def observed_variant(op, saved_scales):
    """``op`` (a ``custom_vjp``) as a ``custom_vjp`` returning ``(out,
    saved_scales(residuals))``: the scales of the FP8 tensors its forward keeps for backward,
    the very arrays backward reads, in their stored form. Forward and backward are ``op``'s own
    rules (``op.fwd``, ``op.bwd``); the scales' cotangent is dropped (a scale is a statistic of
    the input, held constant as the FP8 rounding is)."""
    fwd, bwd = op.fwd, op.bwd

    def observed(*args):
        return observed_fwd(*args)[0]

    def observed_fwd(*args):
        out, res = fwd(*args)
        return (out, saved_scales(res)), res

    def observed_bwd(*args):
        *static, res, (dy, _) = args
        return bwd(*static, res, dy)

    observed = jax.custom_vjp(observed, nondiff_argnums=op.nondiff_argnums)
    observed.defvjp(observed_fwd, observed_bwd)
    return observed


# ``(out, scales)``: the op's output and the scales of what it keeps for backward: the linear
# input's per-tensor scale (a scalar), or the 1xG scales of the non-linear ops' saved inputs
# (``[..., D / G]`` each, float32 or E8M0 bytes as ``FP8Config.group_scale`` stores them).
observed_linear = observed_variant(fp8_linear, lambda r: r[0].scale)
observed_rmsnorm = observed_variant(fp8_rmsnorm, lambda r: (r[0].scale,))
observed_silu = observed_variant(fp8_silu, lambda r: (r.scale,))
observed_mul = observed_variant(fp8_mul, lambda r: (r[0].scale, r[1].scale))
observed_swiglu = observed_variant(fp8_swiglu, lambda r: (r[0].scale, r[1].scale))
# ``fp8_attention``'s residuals are its kept q, k, v and the segment ids (called with all six
# arguments, so that its backward's cotangents match them).
observed_attention = observed_variant(fp8_attention, lambda r: tuple(t.scale for t in r[0]))
# ``(out, (q, k, v scales, the o_proj input's scale))``
observed_attention_linear = observed_variant(
    fp8_attention_linear,
    lambda r: (tuple(t.scale for t in r[0]), r[2][0].scale),
)


def placeholder(compute):
    """A function of no arguments returning what ``compute()`` returns in structure, dtype
    and shape, filled with NaN (floats) or -1 (integers: no count is negative), and computing
    nothing: the other branch of a telemetry's ``lax.cond``.

    Examples:
      >>> placeholder(lambda: (jnp.ones(2), jnp.int32(3)))()
      (Array([nan, nan], dtype=float32), Array(-1, dtype=int32))
    """

    def fill(x):
        return jnp.full(x.shape, jnp.nan if jnp.issubdtype(x.dtype, jnp.floating) else -1, x.dtype)

    shapes = jax.eval_shape(compute)
    return lambda: jax.tree.map(fill, shapes)


class ScaleRecorder:
    """Collects the scales the FP8 ops of one traced call quantize activations with, in call
    order, for the activation telemetry (``ops_for(..., recorder=)``).

    ``linear``: the per-tensor scale of each FP8 linear's input (a float32 scalar); ``group``:
    the 1xG scales of each tensor a non-linear op keeps (``fp8_rmsnorm``'s input, ``fp8_silu``'s,
    both of ``fp8_mul``'s or of ``fp8_swiglu``'s, ``fp8_attention``'s q, k and v). Both as the
    ops computed them: the ops return them beside their outputs (``observed_*``), so nothing is
    quantized twice.

    A recorder lives within one trace (a layer's body under ``jax.checkpoint`` or ``scan``):
    :meth:`summary` turns what it holds into a few arrays that cross those boundaries.
    """

    def __init__(self, config: FP8Config = DEFAULT_CONFIG):
        self.config = config
        self.linear: list[jax.Array] = []
        self.group: list[jax.Array] = []

    def record_linear(self, scale: jax.Array) -> None:
        # No gradient flows into the telemetry: its computations stay out of the backward pass.
        self.linear.append(jax.lax.stop_gradient(scale))

    def record_group(self, scales) -> None:
        self.group.extend(jax.lax.stop_gradient(s) for s in scales)

    def summary(self, observe) -> dict:
        """The recorded scales as telemetry: ``{"linear": [n_linear]}`` (the scales as they
        are: scalars cost nothing) and ``{"group": {"max", "min", "nonfinite"}: [n_group]}``
        per 1xG-scaled tensor: its largest scale, its smallest scale of a group holding a
        non-zero value (``inf`` if none does), and its count of NaN or infinite scales. A
        key is absent when nothing of its kind was recorded.

        The per-group reductions read every scale, so they run in a ``lax.cond`` on
        ``observe`` (a boolean scalar): where it is false they are placeholders (NaN, -1) and
        nothing is read.
        """
        out = {}
        if self.linear:
            out["linear"] = jnp.stack(self.linear)
        if self.group:
            compute = lambda: _group_summary(self.group, self.config)
            out["group"] = jax.lax.cond(observe, compute, placeholder(compute))
        return out


def _group_summary(stored: list[jax.Array], config: FP8Config) -> dict[str, jax.Array]:
    """Largest scale, smallest scale above an all-zero group's, NaN/inf count, per tensor."""
    fmt, scale_format = config.act_format, config.group_scale
    # The scale quant.absmax_scale gives a group of zeros (max|x| = 0), stored and read back as
    # the ops store it: every group with a non-zero value has a larger one.
    zero = quant.absmax_scale(jnp.zeros([], jnp.float32), quant.FP8_MAX[fmt], scale_format)
    zero = quant.decode_scale(quant.encode_scale(zero, scale_format))
    largest, smallest, nonfinite = [], [], []
    for s in stored:
        s = quant.decode_scale(s)
        peak = jnp.max(s)
        # Zero groups are filled with the largest scale, not a constant: a constant the size of
        # the scales would be hoisted out of a differentiated scan and made every step.
        least = jnp.min(jnp.where(s > zero, s, peak))
        largest.append(peak)
        smallest.append(jnp.where(peak > zero, least, jnp.inf))
        nonfinite.append(jnp.sum(~jnp.isfinite(s), dtype=jnp.int32))
    return {
        "max": jnp.stack(largest),
        "min": jnp.stack(smallest),
        "nonfinite": jnp.stack(nonfinite),
    }

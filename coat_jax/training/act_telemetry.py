"""The range of the scales the FP8 activation ops quantize with, as step metrics (``act/``).

The activation half of the trainer's telemetry (docs/telemetry.md), computed on the steps the
optimizer state's telemetry uses (:meth:`coat_jax.training.telemetry.StateTelemetry.computes`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from coat_jax.training.config import TrainConfig
from coat_jax.training.telemetry import ACT_COMPUTED, check_int, due_at, step_count


@dataclasses.dataclass(frozen=True)
class ActivationTelemetry:
    """The range of the scales the FP8 activation ops quantize with, as step metrics.

    The model's FP8 ops return the scales they quantize with beside their outputs
    (``coat_jax.fp8_ops.observed_*``, through ``Llama.observed_hidden_states``): the per-tensor
    scale of every FP8 linear's input, and the 1xG scales of every tensor the non-linear ops
    keep for backward, reduced inside each layer to a largest scale, a smallest scale of a
    group holding a non-zero value and a count of non-finite scales per tensor
    (``fp8_ops.ScaleRecorder``). :meth:`metrics` reduces those over layers (and microbatches):

    ==========================  ==================================================================
    ``act/linear_scale_min``    smallest per-tensor scale of a linear's input, all layers
    ``act/linear_scale_max``    largest one
    ``act/linear_worst_layer``  the layer of the largest one
    ``act/linear_worst_input``  which input of that layer (``Llama.activation_names()["linear"]``)
    ``act/group_scale_min``     smallest 1xG scale of a group with a non-zero value (``inf``: none)
    ``act/group_scale_max``     largest 1xG scale
    ``act/group_worst_layer``   the layer of the largest (the layer count: the final norm)
    ``act/group_worst_tensor``  which tensor (``activation_names()["group"] + ("norm",)``)
    ``act/nonfinite``           NaN or infinite scales, linear and 1xG
    ``act/computed``            whether this step computed the 1xG metrics (:data:`ACT_COMPUTED`)
    ==========================  ==================================================================

    The ``act/group_*`` keys exist where the model has 1xG-scaled activations (precision
    ``coat``, or ``fp8`` with ``fp8_attention``); a ``bf16`` model has no FP8 activations and
    no ``act/`` keys (the trainer builds no activation telemetry for it). A scale is
    ``(max|x| + 1e-20) / 448`` (E4M3), so a largest scale of ``s`` means activations of
    ``448 s``; a NaN makes its layer the worst one (``argmax`` takes NaN for the maximum).

    Attributes:
      every, last_step, max_skipped: on which steps the per-group reductions are computed, as
        :meth:`StateTelemetry.computes`; on the others the ``act/`` metrics are placeholders
        and :data:`ACT_COMPUTED` is false.
    """

    every: int = 1
    last_step: int | None = None
    max_skipped: int = 0

    def __post_init__(self):
        check_int("every", self.every, 1)
        check_int("max_skipped", self.max_skipped, 0)
        if self.last_step is not None:
            check_int("last_step", self.last_step, 1)

    def computes(self, step):
        """Whether the telemetry is computed at ``step`` (:meth:`StateTelemetry.computes`)."""
        return due_at(step, self.every, self.last_step, self.max_skipped)

    def observe(self, opt_state) -> jax.Array:
        """:meth:`computes` of the step after ``opt_state``'s count (a boolean scalar): the
        ``observe`` flag of ``Llama.observed_hidden_states``, known before the forward pass."""
        if self.every == 1:
            return jnp.asarray(True)
        return jnp.asarray(self.computes(step_count(opt_state) + 1))

    def metrics(self, scales: dict, observe) -> dict[str, jax.Array]:
        """The ``act/`` metrics of ``Llama.observed_hidden_states``' scales (leaves may carry
        leading microbatch axes), and :data:`ACT_COMPUTED` (``observe``)."""
        layers, norm = scales["layers"] or {}, scales["norm"]
        # Leading (microbatch) axes reduce like the layers: largest, smallest, summed counts.
        over = lambda f, x, keep: f(x.reshape(-1, *x.shape[x.ndim - keep :]), axis=0)
        metrics = {ACT_COMPUTED: jnp.asarray(observe)}
        nonfinite = jnp.zeros([], jnp.int32)
        if "linear" in layers:
            linear = layers["linear"]
            n = linear.shape[-1]
            largest = over(jnp.max, linear, 2).reshape(-1)
            worst = jnp.argmax(largest)
            nonfinite += jnp.sum(~jnp.isfinite(linear), dtype=jnp.int32)
            metrics.update(
                {
                    "act/linear_scale_min": jnp.min(linear),
                    "act/linear_scale_max": largest[worst],
                    "act/linear_worst_layer": (worst // n).astype(jnp.int32),
                    "act/linear_worst_input": (worst % n).astype(jnp.int32),
                }
            )
        # Every array of a layer summary is [..., layers, tensors].
        num_layers = jax.tree.leaves(layers)[0].shape[-2] if layers else 0
        m = layers["group"]["max"].shape[-1] if "group" in layers else 0
        groups = []  # (summary, its axes per layer, the layer and tensor of each value)
        if "group" in layers:
            layer_of, tensor_of = np.divmod(np.arange(num_layers * m), m)
            groups.append((layers["group"], 2, layer_of, tensor_of))
        if "group" in norm:
            # The final norm: one layer past the decoder's, the tensor after a layer's.
            groups.append((norm["group"], 1, np.array([num_layers]), np.array([m])))
        if groups:
            cat = lambda name, f: jnp.concatenate(
                [over(f, g[name], keep).reshape(-1) for g, keep, _, _ in groups]
            )
            largest, smallest = cat("max", jnp.max), cat("min", jnp.min)
            worst = jnp.argmax(largest)
            layer_of = jnp.asarray(np.concatenate([g[2] for g in groups]), jnp.int32)
            tensor_of = jnp.asarray(np.concatenate([g[3] for g in groups]), jnp.int32)
            nonfinite += jnp.sum(cat("nonfinite", jnp.sum))
            metrics.update(
                {
                    "act/group_scale_min": jnp.min(smallest),
                    "act/group_scale_max": largest[worst],
                    "act/group_worst_layer": layer_of[worst],
                    "act/group_worst_tensor": tensor_of[worst],
                }
            )
        metrics["act/nonfinite"] = nonfinite
        return metrics


def activation_telemetry(cfg: TrainConfig) -> ActivationTelemetry | None:
    """The activation telemetry of ``cfg`` (``None`` with ``telemetry`` off, and for precision
    ``bf16``, which has no FP8 activations), on the steps :func:`state_telemetry` uses."""
    if not cfg.telemetry or cfg.precision == "bf16":
        return None
    return ActivationTelemetry(
        every=cfg.log_every, last_step=cfg.steps, max_skipped=cfg.skip_nonfinite_steps
    )

"""The trainer's optimizers: ``make_optimizer(cfg, schedule)`` and the weight-decay mask.

``optimizer`` picks the algorithm; ``fp8_state: true`` wraps it in :func:`coat_jax.fp8_state`,
which stores its parameter-shaped state in FP8 (``mu_format`` for signed state such as momenta,
``nu_format`` for non-negative state such as second moments). ``coat_adamw`` is COAT's own AdamW
with the fused FP8 step; ``adamw`` with ``fp8_state: true`` is the same algorithm through the
generic wrapper.

Per optimizer, with ``lr`` the schedule and ``wd`` ``weight_decay`` (under the weight-decay
mask):

- ``adamw`` / ``coat_adamw``: ``b1``, ``b2``, ``eps``; decoupled decay ``lr * wd * p``.
- ``lion``: ``b1``, ``b2``; decoupled decay ``lr * wd * p``.
- ``sgd``: ``momentum`` (heavy ball); L2 decay ``wd * p`` added to the gradient before the
  momentum (PyTorch's SGD ``weight_decay``).
- ``adafactor``: optax's defaults (factored second moment, relative step sizes, update clipping
  at 1, no momentum); decoupled decay ``lr * wd * p``.
- ``muon``: Muon on the 2-D weights other than the embedding and the output head, with
  ``momentum`` as its decay and ``consistent_rms=0.2`` so that its updates have AdamW's RMS
  and share AdamW's learning rate (Liu et al. 2025); AdamW (``b1``, ``b2``, ``eps``) on the
  rest; decoupled decay ``lr * wd * p`` on both.

``grad_clip`` clips the global gradient norm before any of them; with ``skip_nonfinite_steps``
the whole is wrapped in :func:`skip_nonfinite`.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from optax import contrib

from coat_jax.fp8_wrapper import fp8_state
from coat_jax.llama_layout import stacked_layer_axes
from coat_jax.optim import chain as optim_chain
from coat_jax.optim import clip_by_global_norm, coat_adamw
from coat_jax.training import sharding
from coat_jax.training.config import TrainConfig
from coat_jax.training.kernel_choice import kernels_mapping, to_yaml


def weight_decay_mask(params, decay_all: bool):
    """True where weight decay applies: matrices, except embeddings (and any norm) by default."""

    def decays(path, p):
        names = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
        special = any("embed" in n or "norm" in n for n in names)
        return decay_all or (p.ndim >= 2 and not special)

    return jax.tree_util.tree_map_with_path(decays, params)


def muon_dimension_numbers(params):
    """Muon's parameters: 2-D matrices except the embedding and the output head (Adam's)."""

    def spec(path, p):
        names = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
        special = any("embed" in n or "lm_head" in n for n in names)
        return contrib.MuonDimensionNumbers() if p.ndim == 2 and not special else None

    return jax.tree_util.tree_map_with_path(spec, params)


def _inner_optimizer(cfg: TrainConfig, schedule, mask) -> optax.GradientTransformation:
    wd = cfg.weight_decay
    if cfg.optimizer == "adamw":
        return optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=wd, mask=mask)
    if cfg.optimizer == "lion":
        return optax.lion(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=wd, mask=mask)
    if cfg.optimizer == "sgd":
        return optax.chain(
            optax.add_decayed_weights(wd, mask), optax.sgd(schedule, momentum=cfg.momentum)
        )
    if cfg.optimizer == "adafactor":
        return optax.adafactor(
            schedule, weight_decay_rate=lambda count: wd * schedule(count), weight_decay_mask=mask
        )
    if cfg.optimizer == "muon":
        return contrib.muon(
            schedule,
            beta=cfg.momentum,
            weight_decay=wd,
            weight_decay_mask=mask,
            adam_b1=cfg.b1,
            adam_b2=cfg.b2,
            eps=cfg.eps,
            adam_weight_decay=wd,
            muon_weight_dimension_numbers=muon_dimension_numbers,
            consistent_rms=0.2,
        )
    raise ValueError(
        f"optimizer.name={cfg.optimizer!r} has no inner optax optimizer; valid: adamw, lion, sgd, "
        "adafactor, muon"
    )


# Where the FP8 activation ops run when ``kernels`` leaves them unset (``kernels: auto``):
# ``auto`` (the Pallas kernels where they run, XLA's fusions elsewhere) for a model at least
# FP8_PALLAS_MIN_HIDDEN wide with at least FP8_PALLAS_MIN_TOKENS microbatch tokens per device,
# ``xla`` (XLA's fusions of the jnp references, fused into their neighbours) otherwise. The
# thresholds are where the Pallas kernels' tokens/s measured at least level with XLA's fusions
# in train.py's step; the measurements, and the widths not measured, are in
# docs/bench_fp8_kernels.md.
FP8_PALLAS_MIN_HIDDEN = 4096
FP8_PALLAS_MIN_TOKENS = 16384


def fp8_ops_auto(cfg: TrainConfig, devices: int = 1, hidden_size: int | None = None) -> str:
    """The FP8 activation ops' implementation where ``kernels`` leaves ``fp8_ops`` unset
    on ``devices`` devices sharing the batch: ``"auto"`` when the model's width
    (``hidden_size``, default ``cfg.model.hidden_size``; the trainer passes the width of the
    model it builds, which ``init_from`` takes from the checkpoint) is at least
    :data:`FP8_PALLAS_MIN_HIDDEN` and each device's microbatch (``batch_size * seq_len /
    devices`` tokens) at least :data:`FP8_PALLAS_MIN_TOKENS`, else ``"xla"``. The choice is
    made once, for ``cfg.batch_size``: a program built from ``cfg`` and compiled at other batch
    sizes (``train.py --plan``, ``benchmarks/bench_e2e.py``'s batch search) keeps it."""
    if devices < 1:
        raise ValueError(f"devices must be at least 1, got {devices}")
    tokens = cfg.batch_size * cfg.seq_len / devices
    width = cfg.model.hidden_size if hidden_size is None else hidden_size
    wide = width >= FP8_PALLAS_MIN_HIDDEN
    return "auto" if wide and tokens >= FP8_PALLAS_MIN_TOKENS else "xla"


# Set to "1", every kernel of the trainer runs in Pallas interpret mode (slow; CPU tests of the
# kernel paths). A test-only switch, not a config key: a user run never wants it.
PALLAS_INTERPRET_ENV = "COAT_JAX_PALLAS_INTERPRET"


def pallas_interpret() -> bool:
    """Whether :data:`PALLAS_INTERPRET_ENV` asks for Pallas interpret mode (``1``; unset or
    ``0``: no); any other value is refused."""
    value = os.environ.get(PALLAS_INTERPRET_ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{PALLAS_INTERPRET_ENV}={value!r} is not valid; set it to 1 or 0")
    return value == "1"


def kernel_options(
    cfg: TrainConfig, *, fp8_ops: bool = False, devices: int = 1, hidden_size: int | None = None
) -> dict:
    """``implementation`` and ``interpret`` of the kernels ``cfg.kernels`` picks
    (:mod:`coat_jax.training.kernel_choice`): its ``optimizer`` part; with ``fp8_ops``, its
    ``fp8_ops`` part, where unset :func:`fp8_ops_auto` (for ``devices`` devices sharing the
    batch and a model ``hidden_size`` wide).

    With the environment variable :data:`PALLAS_INTERPRET_ENV` set to ``1`` (tests on a CPU)
    every kernel runs in Pallas interpret mode: ``auto`` with ``interpret``, the FP8 ops too
    unless ``kernels.fp8_ops`` is set; it needs the optimizer's part ``auto``.
    """
    interpret = pallas_interpret()
    parts = kernels_mapping(cfg.kernels)
    optimizer = parts.get("optimizer", "auto")
    if interpret and optimizer != "auto":
        raise ValueError(
            f"{PALLAS_INTERPRET_ENV}=1 runs every kernel in Pallas interpret mode, and "
            f"kernels={to_yaml(cfg.kernels)} asks for another; set kernels=auto or unset "
            f"{PALLAS_INTERPRET_ENV}"
        )
    implementation = optimizer
    if fp8_ops and "fp8_ops" in parts:
        implementation = parts["fp8_ops"]
    elif fp8_ops and not interpret:
        implementation = fp8_ops_auto(cfg, devices, hidden_size)
    return dict(implementation=implementation, interpret=interpret)


def make_optimizer(
    cfg: TrainConfig, schedule, *, mesh: Mesh | None = None
) -> optax.GradientTransformation:
    """The optimizer ``cfg`` asks for (see the module docstring), with gradient clipping.

    Args:
      cfg: the run's config (``optimizer``, ``fp8_state``, ``kernels`` and the
        hyper-parameters).
      schedule: the learning-rate schedule, ``count -> lr``.
      mesh: the trainer's device mesh, for a program on several devices: ``coat_adamw`` then
        runs its fused step on each parameter's shards, split as the trainer places them
        (``coat_jax.training.sharding.param_shardings``). ``None``: one device.

    Returns:
      An ``optax.GradientTransformation``.
    """
    mask = lambda params: weight_decay_mask(params, cfg.decay_norms_and_embeddings)
    if cfg.optimizer == "coat_adamw":
        placement = {}
        if mesh is not None:
            placement = dict(
                mesh=mesh,
                partition_specs=lambda params: jax.tree.map(
                    lambda s: s.spec, sharding.param_shardings(params, mesh)
                ),
            )
        # TrainConfig refuses fp8_state=true here: these moments are FP8 already.
        tx = coat_adamw(
            schedule,
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=mask,
            mu_format=cfg.mu_format,
            nu_format=cfg.nu_format,
            stacked_axes=stacked_layer_axes,
            **kernel_options(cfg),
            **placement,
        )
    else:
        tx = _inner_optimizer(cfg, schedule, mask)
        if cfg.fp8_state:
            tx = fp8_state(
                tx,
                formats={"signed": cfg.mu_format, "nonnegative": cfg.nu_format},
                stacked_axes=stacked_layer_axes,
            )
    if cfg.grad_clip is not None:
        # coat_jax.optim.chain keeps coat_adamw's fused apply behind the clipping, which it
        # folds into the kernel as a gradient scale.
        tx = optim_chain(clip_by_global_norm(cfg.grad_clip), tx)
    return skip_nonfinite(tx) if cfg.skip_nonfinite_steps else tx


def skip_nonfinite(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` that skips a step whose gradient is not finite: zero updates, state unchanged.

    ``optax.apply_if_finite`` without its counters: the state is ``tx``'s own, so checkpoints
    of runs with and without ``skip_nonfinite_steps`` resume in each other, and every
    non-finite step is skipped; the trainer counts them and stops past its limit. A step is
    non-finite when the gradient's global norm is, as the train step's ``grad_norm`` metric
    reports it (the same norm of the same float32 gradient).

    Examples:
      >>> tx = skip_nonfinite(optax.adam(1e-3))
      >>> state = tx.init({"w": jnp.ones(2)})
      >>> updates, same = tx.update({"w": jnp.array([jnp.nan, 1.0])}, state)  # zeros, state
    """

    def update(updates, state, params=None):
        finite = jnp.isfinite(optax.tree.norm(updates))
        new_updates, new_state = tx.update(updates, state, params)
        new_updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), new_updates)
        return new_updates, jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_state, state)

    return optax.GradientTransformation(tx.init, update)


def optimizer_fingerprint(cfg: TrainConfig) -> dict:
    """The optimizer's part of a run fingerprint: what fixes its state's layout.

    A checkpoint's optimizer state only fits an optimizer with the same algorithm, the same
    storage (FP8 or float32) and, for FP8, the same formats.
    """
    fp8 = cfg.optimizer == "coat_adamw" or cfg.fp8_state
    return {
        "optimizer": cfg.optimizer,
        "fp8_state": cfg.fp8_state,
        "mu_format": cfg.mu_format if fp8 else None,
        "nu_format": cfg.nu_format if fp8 else None,
    }

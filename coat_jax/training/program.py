"""The program of a config: model, optimizer, shardings and the compiled train and eval steps.

:func:`build_program` returns a :class:`TrainProgram`, everything the step needs that does not
depend on data, compiled once with parameters and optimizer state donated, so XLA updates them
in place instead of holding two copies (docs/design.md, 'One training step'). ``train.py``,
``--plan`` and the benchmarks build their programs with it, so what they measure is what the
trainer runs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from coat_jax.fp8_ops import fp8_compiler_options
from coat_jax.llama import LlamaConfig
from coat_jax.master import float32_optimizer
from coat_jax.training import layerwise, sharding
from coat_jax.training.act_telemetry import activation_telemetry
from coat_jax.training.config import TrainConfig
from coat_jax.training.model import (
    ModelDef,
    excess_precision,
    init_params_fn,
    loss_from_hidden,
    model_def_for,
    next_token_loss,
)
from coat_jax.training.optimizers import make_optimizer
from coat_jax.training.step import make_train_step, with_rounding_count
from coat_jax.training.telemetry import state_telemetry


def warmup_of(cfg: TrainConfig) -> int:
    """The schedule's warmup: ``warmup_steps``, or a tenth of ``steps`` where the warmup would
    not end before the run does (a short run of a config made for a long one; the trainer says
    so in one line)."""
    return cfg.warmup_steps if cfg.warmup_steps < cfg.steps else cfg.steps // 10


def make_schedule(cfg: TrainConfig):
    """Linear warmup to ``learning_rate`` over :func:`warmup_of` steps, then cosine to the floor.

    Step ``c`` (0-based) of warmup uses ``lr * (c + 1) / warmup``, so no step is spent
    at learning rate 0.
    """
    peak, floor = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    warmup, total = warmup_of(cfg), cfg.steps

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        warm = peak * (count + 1) / max(warmup, 1)
        progress = jnp.clip((count - warmup) / max(total - warmup, 1), 0.0, 1.0)
        cosine = floor + (peak - floor) * 0.5 * (1 + jnp.cos(jnp.pi * progress))
        return jnp.where(count < warmup, warm, cosine)

    return schedule


def with_shardings(abstract, shardings):
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )


# ----------------------------------------------------------------------------- the program


@dataclasses.dataclass(frozen=True)
class TrainProgram:
    """Everything the step needs that does not depend on data: what ``train`` compiles.

    Benchmarks build this with :func:`build_program` too, so what they time is what
    ``train.py`` runs.
    """

    cfg: TrainConfig
    mesh: Any
    model_def: ModelDef
    schedule: Any
    tx: optax.GradientTransformation
    param_shardings: Any
    opt_shardings: Any
    batch_sharding: Any
    eval_batch_sharding: Any
    step_fn: Any
    eval_fn: Any

    @property
    def abstract_params(self):
        return with_shardings(self.model_def.abstract_params, self.param_shardings)

    @property
    def abstract_opt_state(self):
        return with_shardings(
            jax.eval_shape(self.tx.init, self.model_def.abstract_params), self.opt_shardings
        )

    def abstract_batch(self, batch_size: int | None = None):
        """The step's token batch ``[grad_accum, batch, seq_len + 1]`` as a ShapeDtypeStruct."""
        b = self.cfg.batch_size if batch_size is None else batch_size
        shape = (self.cfg.grad_accum, b, self.cfg.seq_len + 1)
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sharding)

    def init_params(self, key):
        """Random parameters (jitted, the key an argument, each shard made on its device)."""
        return init_params_fn(self.model_def.config, self.cfg, self.param_shardings)(key)

    def init_opt_state(self, params):
        """The optimizer state of ``params``, jitted, each leaf placed like its parameter."""
        return jax.jit(self.tx.init, out_shardings=self.opt_shardings)(params)


def compiler_options(cfg: TrainConfig) -> dict | None:
    """``jax.jit``'s ``compiler_options`` for the run's training step and evaluation.

    On a GPU: no Triton GEMM fusion, so that the FP8 linears compile to cuBLASLt FP8 GEMMs
    (:func:`coat_jax.fp8_ops.fp8_compiler_options`). With ``cfg.deterministic`` also XLA's
    ``xla_gpu_deterministic_ops`` (on every backend: the CPU's compiler takes the option and
    ignores it, so a misspelt option fails the CPU tests too). XLA's
    ``xla_allow_excess_precision``, on every backend: ``cfg.xla_excess_precision`` where set;
    unset, off for precision ``coat`` on a GPU (:func:`excess_precision`).
    """
    options = dict(fp8_compiler_options() or {})
    if cfg.deterministic:
        options["xla_gpu_deterministic_ops"] = True
    excess = excess_precision(cfg)
    if excess is not None:
        options["xla_allow_excess_precision"] = excess
    return options or None


def build_program(
    cfg: TrainConfig,
    llama_cfg: LlamaConfig,
    mesh=None,
    *,
    loss_mask: bool = False,
    within_documents: bool = False,
) -> TrainProgram:
    """The model, optimizer, shardings and the jitted train and evaluation steps of ``cfg``;
    ``loss_mask``: the batches mark tokens that are no loss target (chat data);
    ``within_documents``: attention stays within each batch's documents
    (``coat_jax.training.model.ModelDef``)."""
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp) if mesh is None else mesh
    sharding.check_batch_divisible(cfg.batch_size, mesh)
    # Several devices: the kernels run per shard on the mesh (even a mesh of one device, which
    # places the program on one of several); one device in the process: no mesh.
    kernel_mesh = mesh if jax.device_count() > 1 else None
    model_def = model_def_for(
        llama_cfg, cfg, kernel_mesh, loss_mask=loss_mask, within_documents=within_documents
    )
    schedule = make_schedule(cfg)
    tx = make_optimizer(cfg, schedule, mesh=kernel_mesh)
    abstract_params = model_def.abstract_params
    param_sh = sharding.param_shardings(abstract_params, mesh)
    if cfg.optimizer_in_backward:
        inner = tx if cfg.master_dtype == "float32" else float32_optimizer(tx)
        tx = layerwise.layerwise_optimizer(inner)
        opt_sh = layerwise.state_shardings(inner, abstract_params, mesh)
        train_step = layerwise.make_train_step(
            model_def,
            inner,
            functools.partial(loss_from_hidden, model_def),
            seed=cfg.seed,
            fused_apply=cfg.fused_apply,
            low_precision=cfg.master_dtype != "float32",
        )
    else:
        if cfg.master_dtype != "float32":
            tx = with_rounding_count(tx)
        opt_sh = sharding.state_shardings(
            jax.eval_shape(tx.init, abstract_params), abstract_params, mesh
        )
        train_step = make_train_step(
            model_def,
            tx,
            seed=cfg.seed,
            telemetry=state_telemetry(cfg, schedule),
            activations=activation_telemetry(cfg),
            fused_apply=cfg.fused_apply,
        )
    # Train batches are [microbatches, batch, T + 1]; validation batches [batch, T + 1].
    batch_sh = sharding.batch_sharding(mesh, batch_axis=1, rank=3)
    eval_batch_sh = sharding.batch_sharding(mesh, batch_axis=0, rank=2)
    step_fn = jax.jit(
        train_step,
        in_shardings=(param_sh, opt_sh, batch_sh),
        out_shardings=(param_sh, opt_sh, None),
        donate_argnums=(0, 1),
        compiler_options=compiler_options(cfg),
    )
    eval_fn = jax.jit(
        lambda p, t: next_token_loss(model_def, p, t),
        in_shardings=(param_sh, eval_batch_sh),
        compiler_options=compiler_options(cfg),
    )
    return TrainProgram(
        cfg,
        mesh,
        model_def,
        schedule,
        tx,
        param_sh,
        opt_sh,
        batch_sh,
        eval_batch_sh,
        step_fn,
        eval_fn,
    )

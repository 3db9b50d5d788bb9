"""What a training config will need, before training: ``python train.py --plan``.

The trainer's own step (:func:`coat_jax.training.program.build_program`) is compiled, never run, at
each batch size, and XLA's ``compiled.memory_analysis()`` gives its peak: arguments (parameters,
optimizer state, the token batch) + outputs - donated + temporaries. Temporaries are split into
the activations backward keeps (the residuals of the loss's ``jax.vjp``, traced with
:func:`coat_jax.memory.residuals`) and the rest, called workspace here (gradients, the
optimizer's intermediates, XLA's scratch). The largest batch that fits is searched the same way
against the device's ``bytes_limit``; the CPU has none, so there the report gives the numbers of
XLA's CPU backend and says that it found no limit.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from coat_jax.checkpoint_io import read_config
from coat_jax.memory import residuals
from coat_jax.quant import state_bytes
from coat_jax.runs import resolve_init_from
from coat_jax.training import sharding
from coat_jax.training.config import TrainConfig
from coat_jax.training.data import planned_data_flags
from coat_jax.training.model import next_token_loss
from coat_jax.training.program import build_program

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """XLA's memory account of the step at one batch size, in bytes."""

    batch_size: int
    params: int
    opt_state: int
    activations: int
    workspace: int
    peak: int
    fits: bool | None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def device_limit() -> int | None:
    """The first device's allocator limit in bytes (None on backends without one: the CPU)."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        stats = {}
    return stats.get("bytes_limit") or stats.get("bytes_reservable_limit")


def _llama_config(cfg: TrainConfig):
    if not cfg.init_from:
        return cfg.model
    return read_config(resolve_init_from(cfg.init_from))


def plan_memory(
    cfg: TrainConfig, batch_sizes=None, *, search: bool = True, max_compiles: int = 8
) -> tuple[list[PlanRow], int | None, int | None]:
    """Compiles ``cfg``'s step at each batch size and returns XLA's memory account.

    Args:
      cfg: the training config (its ``batch_size`` is planned when ``batch_sizes`` is None).
      batch_sizes: microbatch sizes to compile.
      search: also find the largest batch that fits the device (compile-only).
      max_compiles: how many compiles the search may spend.

    Returns:
      ``(rows, largest_fitting_batch, device_limit_bytes)``; the last two are None where the
      backend has no memory limit.
    """
    for b in batch_sizes or ():
        if not isinstance(b, int) or b <= 0:
            raise ValueError(f"batch sizes must be positive integers, got {b!r}")
    chat, within = planned_data_flags(cfg)
    program = build_program(cfg, _llama_config(cfg), loss_mask=chat, within_documents=within)
    params, opt_state = program.abstract_params, program.abstract_opt_state
    params_bytes, opt_bytes = state_bytes(params), state_bytes(opt_state)
    limit = device_limit()
    rows: dict[int, PlanRow] = {}

    def row(batch: int) -> PlanRow:
        if batch in rows:
            return rows[batch]
        compiled = program.step_fn.lower(params, opt_state, program.abstract_batch(batch)).compile()
        ma = compiled.memory_analysis()
        peak = _peak(ma)
        tokens = jax.ShapeDtypeStruct((batch, cfg.seq_len + 1), jnp.int32)
        kept = residuals(
            lambda p, t: next_token_loss(program.model_def, p, t),
            program.model_def.abstract_params,
            tokens,
            param_argnums=(0,),
        )
        activations = sum(r.nbytes for r in kept if r.is_activation) * cfg.grad_accum
        rows[batch] = PlanRow(
            batch_size=batch,
            params=params_bytes,
            opt_state=opt_bytes,
            activations=activations,
            workspace=int(ma.temp_size_in_bytes) - activations,
            peak=int(peak),
            fits=None if limit is None else peak <= limit,
        )
        return rows[batch]

    for b in batch_sizes or [cfg.batch_size]:
        row(b)
    largest = None
    if search and limit is not None:
        largest = _largest_fitting(row, min(rows), max_compiles)
    return sorted(rows.values(), key=lambda r: r.batch_size), largest, limit


def compiled_peak(program, batch: int) -> int:
    """XLA's peak bytes of ``program``'s step at microbatch ``batch``: arguments + outputs -
    donated + temporaries of the compiled (never run) step."""
    args = (program.abstract_params, program.abstract_opt_state, program.abstract_batch(batch))
    return _peak(program.step_fn.lower(*args).compile().memory_analysis())


def _peak(ma) -> int:
    """Arguments + outputs - donated + temporaries of XLA's ``memory_analysis()``."""
    return int(
        ma.argument_size_in_bytes
        + ma.output_size_in_bytes
        - ma.alias_size_in_bytes
        + ma.temp_size_in_bytes
    )


@dataclasses.dataclass(frozen=True)
class _Fit:
    fits: bool


def resolve_batch(cfg: TrainConfig, *, limit: int | None = None, say=print, max_compiles=10):
    """``cfg`` with a number for ``batch_size: auto`` and ``grad_accum`` from
    ``global_batch_size``; a config with neither comes back as it is.

    ``auto`` is the largest batch whose compiled step fits ``limit`` (default: the device's
    allocator limit, :func:`device_limit`), searched by doubling and bisection over multiples
    of the mesh's data x fsdp devices, each candidate compiled (never run) as the trainer
    builds it, so that batch-dependent choices (``kernels.fp8_ops`` unset) follow the
    candidate. With ``global_batch_size`` only its divisors are candidates, each with
    ``grad_accum = global_batch_size / batch_size``.

    Raises:
      ValueError: ``auto`` on a backend without a memory limit (the CPU), no batch fits, or a
        ``global_batch_size`` that the batch does not divide.
    """
    total = cfg.global_batch_size
    if cfg.batch_size != "auto":
        if total is None:
            return cfg
        return dataclasses.replace(cfg, grad_accum=_accum_for(cfg, cfg.batch_size))
    if total is not None and cfg.grad_accum != 1:
        raise ValueError(
            f"data.batch_size=auto with data.global_batch_size={total} sets grad_accum itself; "
            f"leave grad_accum at 1 (got {cfg.grad_accum})"
        )
    limit = device_limit() if limit is None else limit
    if limit is None:
        raise ValueError(
            f"data.batch_size=auto plans against the device's memory limit, and the "
            f"{jax.default_backend()} backend reports none; set batch_size to a number"
        )
    ways = math.prod(sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp).shape.values())
    if total is None:
        candidate = lambda k: ways * k
    else:
        divisors = [b for b in range(ways, total + 1, ways) if total % b == 0]
        candidate = lambda k: divisors[k - 1] if k <= len(divisors) else None
    llama_cfg = _llama_config(cfg)
    chat, within = planned_data_flags(cfg)
    seen: dict[int, _Fit] = {}

    def row(k: int) -> _Fit:
        batch = candidate(k)
        if batch is None:
            return _Fit(False)
        if k not in seen:
            trial = dataclasses.replace(
                cfg,
                batch_size=batch,
                grad_accum=cfg.grad_accum if total is None else total // batch,
            )
            program = build_program(trial, llama_cfg, loss_mask=chat, within_documents=within)
            seen[k] = _Fit(compiled_peak(program, batch) <= limit)
        return seen[k]

    k = _largest_fitting(row, 1, max_compiles)
    if k is None:
        raise ValueError(
            f"data.batch_size=auto: not even batch {candidate(1)} fits the device's "
            f"{limit / GIB:.2f} GiB; see python train.py --plan for the memory account"
        )
    batch = candidate(k)
    accum = cfg.grad_accum if total is None else total // batch
    say(
        f"data.batch_size=auto: {batch}, the largest batch whose compiled step fits the device's "
        f"{limit / GIB:.2f} GiB ({len(seen)} compiles)"
        + (f"; data.grad_accum={accum} keeps data.global_batch_size={total}" if total else "")
    )
    return dataclasses.replace(cfg, batch_size=batch, grad_accum=accum)


def _accum_for(cfg: TrainConfig, batch: int) -> int:
    total = cfg.global_batch_size
    if total % batch or cfg.grad_accum not in (1, total // batch):
        raise ValueError(
            f"data.global_batch_size={total} must be data.batch_size={batch} times grad_accum; "
            "leave grad_accum at 1 (it becomes global_batch_size / batch_size) and choose a "
            f"batch_size that divides {total}"
        )
    return total // batch


def _largest_fitting(row, start: int, max_compiles: int) -> int | None:
    """Doubling, then bisection, over compile-only peaks; None if even ``start`` does not fit."""
    lo, hi = (start, None) if row(start).fits else (None, start)
    if lo is None:
        lo_try = start // 2
        while lo_try >= 1 and max_compiles > 0:
            max_compiles -= 1
            if row(lo_try).fits:
                lo = lo_try
                break
            hi, lo_try = lo_try, lo_try // 2
        if lo is None:
            return None
    while hi is None and max_compiles > 0:
        max_compiles -= 1
        if row(lo * 2).fits:
            lo *= 2
        else:
            hi = lo * 2
    while hi is not None and hi - lo > 1 and max_compiles > 0:
        max_compiles -= 1
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if row(mid).fits else (lo, mid)
    return lo


def format_plan(rows: list[PlanRow], largest: int | None, limit: int | None, cfg) -> str:
    """The plan as a table, in GiB (MiB when every peak is below 1 GiB)."""
    backend = jax.default_backend()
    unit, size = ("GiB", GIB) if max(r.peak for r in rows) >= GIB else ("MiB", 2**20)
    # Without an allocator limit (the CPU) the figures are that backend's program, not a GPU
    # plan: said first, and the peak column named after the backend.
    peak_name = "peak" if limit is not None else f"{backend} peak"
    lines = (
        []
        if limit is not None
        else [
            f"NOT A GPU PLAN: the {backend} backend reports no memory limit, so these are XLA's "
            f"{backend} figures (a GPU compiles another program); run --plan on the GPU to plan "
            f"it.",
            "",
        ]
    )
    lines += [
        f"memory plan of this config's train step ({cfg.precision}, {cfg.optimizer}, "
        f"memory.scan_layers={cfg.scan_layers}, memory.remat={cfg.remat}, "
        f"precision.master_dtype={cfg.master_dtype}, "
        f"data.seq_len={cfg.seq_len}, data.grad_accum={cfg.grad_accum}) on {backend}, compiled, "
        f"not run:",
        "",
        f"{'batch':>6} {'params':>9} {'opt state':>10} {'activations':>12} {'workspace':>10} "
        f"{peak_name:>9}" + ("  fits" if limit is not None else ""),
    ]
    for r in rows:
        fits = "" if r.fits is None else ("  yes" if r.fits else "  no")
        lines.append(
            f"{r.batch_size:>6} {r.params / size:>9.2f} {r.opt_state / size:>10.2f} "
            f"{r.activations / size:>12.2f} {r.workspace / size:>10.2f} {r.peak / size:>9.2f}"
            f"{fits}"
        )
    lines.append("")
    lines.append(
        f"{unit}; peak = XLA's memory_analysis() (arguments + outputs - donated + temporaries); "
        "activations = what backward keeps (traced residuals); workspace = the rest of the "
        "temporaries (gradients, optimizer intermediates, scratch)."
    )
    if limit is None:
        lines.append(
            f"The {backend} backend reports no memory limit: these are XLA's {backend} numbers "
            "and no largest batch is searched."
        )
    elif largest is None:
        lines.append(f"No batch fits the device's {limit / GIB:.2f} GiB.")
    else:
        lines.append(f"Largest batch that fits the device's {limit / GIB:.2f} GiB: {largest}.")
    return "\n".join(lines)

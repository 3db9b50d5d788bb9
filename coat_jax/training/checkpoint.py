"""Orbax checkpoints of the whole training state, with checks that refuse bad or foreign ones.

A checkpoint is one Orbax step directory ``<output_dir>/checkpoints/<step>/`` holding two items:

- ``state``: the pytree ``{"params", "opt_state"}``, with the optimizer state whole
  (COAT's float8_e4m3fn / float8_e5m2 codes are stored as float8 by tensorstore and come back
  bit-exact; ``tests/training/test_train.py`` checks every one of the 256 codes of both formats);
- ``meta``: JSON with the step, the data position, the seed, a fingerprint of the run (model
  architecture, precision, optimizer and its structural options) and every state leaf's shape
  and dtype, and a checksum of each leaf's bits.

The run holds no random state beyond its seed: the initialization is drawn from it, the step
is deterministic (no dropout; FP8 casts round to nearest) and the data order is a pure function
of ``(seed, data position)``. The seed and the data position therefore restore it exactly, and a
resume with another seed is refused.

Saves are asynchronous (Orbax's async checkpointing): :meth:`Checkpointer.save` returns once
the arrays are copied off the device and the files are written in the background while training
goes on; at most one save is in flight, the next one (and :meth:`Checkpointer.wait`) waits for
it, and a failed write is raised there with its reason. Before a save the state is checked to be
finite (one jitted program for the whole tree, with the checksums; nothing non-finite is ever
written) and the free space of the target against the state's size.

Orbax writes a step into a temporary directory and renames it when complete, so a crash mid-save
never leaves a checkpoint that looks whole; such leftovers are removed when the next trainer
opens the directory. Restoring checks the fingerprint and the leaf shapes before reading any
array, and the checksums after, and raises :class:`CheckpointError` naming what differs; a step
that cannot be read is reported, never skipped in favour of an older one.

What readers of a run share with this module lives below the trainer, in :mod:`coat_jax.runs`:
the checksum of a leaf, :class:`~coat_jax.runs.CheckpointError`, and
:func:`~coat_jax.runs.read_params` (one checkpoint's parameters, without an optimizer).
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from coat_jax.quant import state_bytes  # a checkpoint's size before compression
from coat_jax.runs import (
    CheckpointError,
    by_keypath,
    cause,
    checksum,
    leaf_checksums,
    quiet_orbax,
)
from coat_jax.training.errors import DivergedError


class CheckpointSaveError(CheckpointError):
    """A checkpoint could not be written (no space, a failed write); older ones are intact."""


# Orbax writes step N into "N.orbax-checkpoint-tmp..." and renames it when complete.
_INCOMPLETE_MARK = ".orbax-checkpoint-tmp"


def _all_finite(x) -> jax.Array:
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.array(True)
    return jnp.all(jnp.isfinite(x))


# Before a save: the checksums and every leaf's finiteness, one program and one transfer.
_save_summary = jax.jit(
    lambda tree: (
        jax.tree.map(checksum, tree),
        jnp.stack([_all_finite(x) for x in jax.tree.leaves(tree)]),
    )
)


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def leaf_signature(tree) -> dict[str, list]:
    """``{keypath: [shape, dtype]}`` for every leaf of a pytree of arrays or ShapeDtypeStructs."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {
        jax.tree_util.keystr(path): [list(leaf.shape), np.dtype(leaf.dtype).name]
        for path, leaf in flat
    }


class Checkpointer:
    """Saves and restores training state under ``<output_dir>/checkpoints``.

    ``fingerprint`` describes the run set-up (JSON-able); it is stored with every save and a
    restore refuses a checkpoint whose fingerprint differs. Saves are asynchronous unless
    ``asynchronous=False``; :meth:`steps` lists only complete checkpoints.
    """

    def __init__(
        self,
        output_dir: str | Path,
        *,
        keep: int,
        fingerprint: dict[str, Any],
        asynchronous: bool = True,
    ):
        self.directory = Path(output_dir).expanduser().resolve() / "checkpoints"
        self.fingerprint = json.loads(json.dumps(fingerprint))
        self.keep = keep
        # Saves a killed trainer left half-written; Orbax removes them as it opens the directory
        # (the output_dir's lock file guarantees no other trainer is writing them).
        self.removed_incomplete = (
            sorted(p.name for p in self.directory.glob(f"*{_INCOMPLETE_MARK}*"))
            if self.directory.is_dir()
            else []
        )
        quiet_orbax()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                # The first save creates the directory: a run refused before it leaves none.
                create=False,
                enable_async_checkpointing=asynchronous,
                cleanup_tmp_directories=True,
            ),
        )
        self._in_flight: int | None = None

    def steps(self) -> list[int]:
        """The complete checkpoints' steps (not the one being written)."""
        return sorted(s for s in self._manager.all_steps() if s != self._in_flight)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def newest(self) -> str:
        """A phrase naming the newest complete checkpoint, for error messages."""
        step = self.latest_step()
        if step is None:
            return f"there is no complete checkpoint in {str(self.directory)!r}"
        return (
            f"the newest complete checkpoint is step {step} in {str(self.directory)!r} "
            "(resume=true continues from it)"
        )

    def save(
        self,
        step: int,
        state,
        *,
        data_position: int,
        seed: int,
        schedule_steps: int | None = None,
        skipped_steps: int = 0,
    ) -> str | None:
        """Starts writing ``state`` as step ``step``; a step already saved is left untouched.

        Waits for the save in flight first (at most one), checks that every leaf of ``state``
        is finite and that the target has room for it, and returns once Orbax holds a host
        copy of the arrays: ``state`` may then be donated to the next step.

        Args:
          step, data_position, seed: where the run is; restored by :meth:`restore`.
          state: the pytree ``{"params", "opt_state"}``.
          schedule_steps: the length of the run's learning-rate schedule (kept on resume).
          skipped_steps: how many non-finite steps the run has skipped so far.

        Returns:
          A warning for the log when the next checkpoint will not fit, else None.

        Raises:
          DivergedError: ``state`` holds a non-finite value; nothing is written.
          CheckpointSaveError: the previous save failed, or there is not enough free space.
        """
        self.wait()
        if step in self._manager.all_steps():
            return None
        sums, finite = jax.device_get(_save_summary(state))
        if not np.all(finite):
            paths = [
                jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]
            ]
            bad = [path for path, ok in zip(paths, finite, strict=True) if not ok]
            raise DivergedError(
                f"the training state at step {step} holds non-finite values ({len(bad)} "
                f"array(s), e.g. state{bad[0]}); not saving it, and {self.newest()}; lower "
                "learning_rate or set skip_nonfinite_steps"
            )
        need, free = self._room(
            state,
            f"checkpoint step {step}",
            f"{self.newest()}; free space there, lower keep_checkpoints or point output_dir at "
            "a larger disk",
        )
        meta = {
            "step": int(step),
            "data_position": int(data_position),
            "seed": int(seed),
            "fingerprint": self.fingerprint,
            "leaves": leaf_signature(state),
            "checksums": by_keypath(sums),
            "schedule_steps": schedule_steps,
            "skipped_steps": int(skipped_steps),
        }
        try:
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
                ),
            )
        except Exception as e:
            self._remove_incomplete(step)
            raise self._failed(step, e) from e
        self._in_flight = step
        # Once this save is complete the oldest one beyond `keep` is deleted, giving its space
        # back; until `keep` checkpoints exist each save takes space for good.
        after = free - need + (need if len(self.steps()) + 1 > self.keep else 0)
        if after < need:
            return (
                f"warning: after checkpoint step {step} about {_fmt_bytes(after)} will be free "
                f"in {str(self.directory)!r}, less than the next checkpoint needs "
                f"({_fmt_bytes(need)}); free space there or lower keep_checkpoints"
            )
        return None

    def check_room(self, abstract_state) -> None:
        """Refuses to start a run whose checkpoints cannot fit: the free space of the target
        against the size of one, from the state's shapes and dtypes.

        Raises:
          CheckpointSaveError: less free space than one checkpoint needs.
        """
        self._room(
            abstract_state,
            "a checkpoint",
            "free space there or point output_dir at a larger disk (or, to train without "
            "checkpoints, set checkpoint.save_final=false and checkpoint_every above steps)",
        )

    def _room(self, state, what: str, advice: str) -> tuple[int, int]:
        """``(bytes state needs, bytes free)`` at the target; raises if they do not fit."""
        need = state_bytes(state)
        # Before the first save the directory may not exist yet: its nearest existing parent
        # is on the disk it will be on.
        target = next(p for p in (self.directory, *self.directory.parents) if p.exists())
        free = shutil.disk_usage(target).free
        if free < need:
            raise CheckpointSaveError(
                f"not enough free space for {what} in {str(self.directory)!r}: it needs about "
                f"{_fmt_bytes(need)} (the state's size) and {_fmt_bytes(free)} is free; {advice}"
            )
        return need, free

    def wait(self) -> None:
        """Blocks until the save in flight is written.

        Raises:
          CheckpointSaveError: it failed (with Orbax's reason); its partial files are removed
            and the older checkpoints are intact.
        """
        step, self._in_flight = self._in_flight, None
        if step is None:
            return
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            self._remove_incomplete(step)
            raise self._failed(step, e) from e

    def _failed(self, step: int, error: Exception) -> CheckpointSaveError:
        return CheckpointSaveError(
            "check the disk (free space, permissions) and continue with resume=true; "
            f"{self.newest()}.\n  writing checkpoint step {step} in {str(self.directory)!r} "
            f"failed: {cause(error)}"
        )

    def _remove_incomplete(self, step: int) -> None:
        for path in self.directory.glob(f"{step}{_INCOMPLETE_MARK}*"):
            shutil.rmtree(path, ignore_errors=True)

    def delete_all(self) -> None:
        """Deletes every checkpoint (``overwrite=true``: a new run replaces the old one)."""
        self.wait()
        for step in self.steps():
            self._manager.delete(step)

    def _where(self, step: int) -> str:
        return f"checkpoint step {step} in {str(self.directory)!r}"

    def _unreadable(self, step: int, error: Exception) -> CheckpointError:
        earlier = [s for s in self.steps() if s < step]
        if earlier:
            remedy = (
                f"move {str(self.directory / str(step))!r} aside to resume from step "
                f"{earlier[-1]} (earlier checkpoints: {earlier})"
            )
        else:
            remedy = "there is no earlier checkpoint: start a new run with resume=false"
        return CheckpointError(
            f"{remedy}.\n  {self._where(step)} is unreadable (corrupt or incomplete): "
            f"{cause(error)}"
        )

    def latest_meta(self) -> dict[str, Any]:
        """The newest checkpoint's metadata (step, data position, seed, fingerprint, leaves).

        Raises:
          CheckpointError: there is no checkpoint, or its metadata cannot be read.
        """
        step = self.latest_step()
        if step is None:
            raise CheckpointError(
                f"resume=true but there is no checkpoint in {str(self.directory)!r}; "
                "set resume=false to start a new run there"
            )
        try:
            meta = self._manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )["meta"]
        except Exception as e:
            raise self._unreadable(step, e) from e
        if not isinstance(meta, dict) or not {"step", "fingerprint", "leaves", "checksums"} <= set(
            meta
        ):
            raise CheckpointError(
                f"{self._where(step)} has no coat_jax training metadata; it was not written by "
                "coat_jax.training"
            )
        return meta

    def restore(self, meta: dict[str, Any], abstract_state, *, seed: int):
        """Restores the step ``meta`` describes into ``abstract_state``'s structure and shardings.

        Raises:
          CheckpointError: the set-up, seed or any leaf's shape or dtype differs from this run,
            or the arrays cannot be read.
        """
        step = meta["step"]
        self._check_matches(meta, abstract_state, seed, self._where(step))
        try:
            state = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
            )["state"]
        except Exception as e:
            raise self._unreadable(step, e) from e
        # Tensorstore reads flipped bytes back without complaint; the checksums catch them.
        saved_sums = meta.get("checksums", {})
        bad = [k for k, v in leaf_checksums(state).items() if saved_sums.get(k) != v]
        if bad:
            raise self._unreadable(
                step, ValueError(f"{len(bad)} array(s) fail their checksum, e.g. state{bad[0]}")
            )
        return state, meta

    def _check_matches(self, meta, abstract_state, seed, where) -> None:
        problems = []
        saved_fp = meta["fingerprint"]
        for key in sorted(set(saved_fp) | set(self.fingerprint)):
            if saved_fp.get(key) != self.fingerprint.get(key):
                problems.append(
                    f"{key}: checkpoint has {saved_fp.get(key)!r}, this run has "
                    f"{self.fingerprint.get(key)!r}"
                )
        if meta.get("seed") != seed:
            problems.append(
                f"seed: checkpoint has {meta.get('seed')}, this run has {seed} (the data order "
                "depends on it)"
            )
        remedy = (
            "resume with the settings (and coat_jax version) that wrote it, or start a new run "
            "with resume=false or another output_dir"
        )
        if problems:
            # A different set-up changes the state's leaves too; listing them would bury the cause.
            raise CheckpointError(
                f"{remedy}.\n  {where} does not match this run: " + "; ".join(problems)
            )
        saved, wanted = meta["leaves"], leaf_signature(abstract_state)
        mismatched = [k for k in sorted(set(saved) | set(wanted)) if saved.get(k) != wanted.get(k)]
        if mismatched:
            key = mismatched[0]
            raise CheckpointError(
                f"{remedy}.\n  {where} does not match this run's state: {len(mismatched)} "
                f"array(s) differ, e.g. state{key}: checkpoint has {saved.get(key)}, this run "
                f"expects {wanted.get(key)}"
            )

    def warm_host_memory(self, abstract_state) -> threading.Thread | None:
        """Allocates, in a background thread, the pinned host memory the first save will use.

        On a GPU Orbax copies the state to pinned host memory before it returns from a save.
        The first allocation of that memory is slow and later ones reuse it (measured with
        ``benchmarks/bench_checkpoint.py``: docs/reliability.md). Buffers shaped like this
        process's shards of the state are made (zeros) and freed while training starts, so the
        first save blocks the loop about as briefly as the later ones.
        Elsewhere (no ``pinned_host`` memory, or not a GPU: Orbax then copies without it)
        nothing is done and ``None`` is returned.
        """
        if jax.default_backend() != "gpu":
            return None
        local = jax.local_devices()
        if not any(m.kind == "pinned_host" for m in local[0].addressable_memories()):
            return None
        shards = []  # (shape, dtype, device) of every shard this process will copy
        for leaf in jax.tree.leaves(abstract_state):
            sharding = getattr(leaf, "sharding", None) or jax.sharding.SingleDeviceSharding(
                local[0]
            )
            shape = sharding.shard_shape(leaf.shape)
            for device in sharding.addressable_devices:
                shards.append((shape, leaf.dtype, device))

        def allocate() -> None:
            # From numpy, not from a jitted program: a host-to-host copy needs no device memory
            # (the loop may be using all of it), and fresh zero pages cost no host memory.
            try:
                held = [
                    jax.device_put(
                        np.zeros(shape, dtype),
                        jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host"),
                    )
                    for shape, dtype, device in shards
                ]
                jax.block_until_ready(held)
            except Exception as e:  # noqa: BLE001 - only a speed-up: the save works without it
                logging.getLogger(__name__).warning("pinned host memory not warmed: %s", e)

        thread = threading.Thread(target=allocate, name="pinned-host-warmup", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """Waits for the save in flight (raising :class:`CheckpointSaveError` if it failed)."""
        try:
            self.wait()
        finally:
            self._manager.close()

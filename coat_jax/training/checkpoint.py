"""Orbax checkpoints of the whole training state, with checks that refuse bad or foreign ones.

A checkpoint is one Orbax step directory ``<output_dir>/checkpoints/<step>/`` holding two items:

- ``state``: the pytree ``{"params", "opt_state"}``, with the optimizer state whole
  (COAT's float8_e4m3fn / float8_e5m2 codes are stored as float8 by tensorstore and come back
  bit-exact; ``tests/test_train.py`` checks every one of the 256 codes of both formats);
- ``meta``: JSON with the step, the data position, the seed, a fingerprint of the run (model
  architecture, precision, optimizer and its structural options) and every state leaf's shape
  and dtype, and a checksum of each leaf's bits.

The run holds no random state beyond its seed: the initialization is drawn from it, the step
is deterministic (no dropout; FP8 casts round to nearest) and the data order is a pure function
of ``(seed, data position)``. The seed and the data position therefore restore it exactly, and a
resume with another seed is refused.

Orbax writes a step into a temporary directory and renames it when complete, so a crash mid-save
never leaves a checkpoint that looks whole. Restoring checks the fingerprint and the leaf shapes
before reading any array, and the checksums after, and raises :class:`CheckpointError` naming
what differs; a step that cannot be read is reported, never skipped in favour of an older one.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or belongs to a different run set-up."""


_UINT_OF_WIDTH = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _checksum(x) -> jax.Array:
    """Two position-weighted sums (mod 2**32) of the raw bits of ``x``.

    Integer sums do not depend on reduction order, so the value is the same however the array
    is sharded; the position weights catch swapped as well as altered values.
    """
    width = np.dtype(x.dtype).itemsize
    if width not in _UINT_OF_WIDTH:
        raise TypeError(f"cannot checksum dtype {x.dtype}")
    words = jax.lax.bitcast_convert_type(x, _UINT_OF_WIDTH[width]).astype(jnp.uint32).ravel()
    weights = jax.lax.iota(jnp.uint32, words.size) % jnp.uint32(65521) + jnp.uint32(1)
    return jnp.stack([jnp.sum(words, dtype=jnp.uint32), jnp.sum(words * weights, dtype=jnp.uint32)])


# One program for the whole tree, not one per leaf: on sharded leaves each checksum ends in a
# cross-device reduction, and hundreds of small collective programs in flight at once stalled
# XLA:CPU on 8 fake devices (7 of 8 threads reached an all-reduce; FP8 optimizer states have
# four leaves per moment, so they hit it first).
_tree_checksums = jax.jit(lambda tree: jax.tree.map(_checksum, tree))


def leaf_checksums(tree) -> dict[str, list[int]]:
    """``{keypath: [sum, weighted sum]}`` of every leaf's bits, for detecting corrupt files."""
    sums = jax.device_get(_tree_checksums(tree))
    flat, _ = jax.tree_util.tree_flatten_with_path(sums)
    return {jax.tree_util.keystr(path): [int(v) for v in leaf] for path, leaf in flat}


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
    restore refuses a checkpoint whose fingerprint differs.
    """

    def __init__(self, output_dir: str | Path, *, keep: int, fingerprint: dict[str, Any]):
        self.directory = Path(output_dir).expanduser().resolve() / "checkpoints"
        self.fingerprint = json.loads(json.dumps(fingerprint))
        # Orbax logs every save at INFO through absl; that would break the progress bar's line.
        logging.getLogger("absl").setLevel(logging.WARNING)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True, enable_async_checkpointing=False
            ),
        )

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state, *, data_position: int, seed: int) -> None:
        """Writes ``state`` as step ``step``; a step already on disk is left untouched."""
        if step in self._manager.all_steps():
            return
        meta = {
            "step": int(step),
            "data_position": int(data_position),
            "seed": int(seed),
            "fingerprint": self.fingerprint,
            "leaves": leaf_signature(state),
            "checksums": leaf_checksums(state),
        }
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
        )
        self._manager.wait_until_finished()

    def _where(self, step: int) -> str:
        return f"checkpoint step {step} in {str(self.directory)!r}"

    def _unreadable(self, step: int, error: Exception) -> CheckpointError:
        earlier = [s for s in self.steps() if s < step]
        advice = (
            f" Earlier checkpoints: {earlier}; move step {step} aside to resume from one."
            if earlier
            else ""
        )
        return CheckpointError(
            f"{self._where(step)} is unreadable (corrupt or incomplete): "
            f"{type(error).__name__}: {error}.{advice}"
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
        if problems:
            # A different set-up changes the state's leaves too; listing them would bury the cause.
            raise CheckpointError(f"{where} does not match this run:\n  " + "\n  ".join(problems))
        saved, wanted = meta["leaves"], leaf_signature(abstract_state)
        mismatched = [k for k in sorted(set(saved) | set(wanted)) if saved.get(k) != wanted.get(k)]
        for key in mismatched[:20]:
            problems.append(
                f"state{key}: checkpoint has {saved.get(key)}, this run expects {wanted.get(key)}"
            )
        if len(mismatched) > 20:
            problems.append(f"... and {len(mismatched) - 20} more leaves")
        if problems:
            raise CheckpointError(f"{where} does not match this run:\n  " + "\n  ".join(problems))

    def close(self) -> None:
        self._manager.close()


# One key of a `jax.tree_util.keystr` path of a pure dict: ['name'] or [0].
_KEYSTR_PART = re.compile(r"\[(?:'([^']*)'|(\d+))\]")


def _abstract_subtree(leaves: dict[str, list], top: str) -> dict:
    """The pure-dict tree of ShapeDtypeStructs under ``[top]`` of a ``leaf_signature``."""
    tree: dict = {}
    for path, (shape, dtype) in leaves.items():
        keys = [name if name else int(index) for name, index in _KEYSTR_PART.findall(path)]
        if not keys or keys[0] != top:
            continue
        if "".join(repr([k]) for k in keys) != path:
            raise CheckpointError(f"leaf {path} under [{top!r}] is not a pure-dict path")
        node = tree
        for key in keys[1:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype))
    return tree


def read_params(output_dir: str | Path, step: int | None = None) -> tuple[dict, dict[str, Any]]:
    """The parameters of one checkpoint as numpy arrays, and its metadata; no optimizer needed.

    Reads only the ``params`` half of the ``state`` item (Orbax partial restore), in the layout
    it was saved in, and checks each array against its stored checksum.

    Args:
      output_dir: a training run's output directory (the one holding ``checkpoints/``).
      step: which checkpoint; None means the newest.

    Returns:
      ``(params, meta)``: the pure-dict parameter tree and the metadata ``Checkpointer.save``
      wrote (step, data position, seed, fingerprint, leaves, checksums).

    Raises:
      CheckpointError: no checkpoints, no such step, or a checkpoint that cannot be read.
    """
    directory = Path(output_dir).expanduser().resolve() / "checkpoints"
    if not directory.is_dir():
        raise CheckpointError(
            f"{str(directory)!r} does not exist; give the output_dir of a train.py run"
        )
    logging.getLogger("absl").setLevel(logging.WARNING)
    with ocp.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(create=False)
    ) as manager:
        steps = sorted(manager.all_steps())
        if not steps:
            raise CheckpointError(f"there is no checkpoint in {str(directory)!r}")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise CheckpointError(
                f"there is no checkpoint step {step} in {str(directory)!r}; steps: {steps}"
            )
        where = f"checkpoint step {step} in {str(directory)!r}"
        try:
            meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
                "meta"
            ]
        except Exception as e:
            raise CheckpointError(f"{where} is unreadable: {type(e).__name__}: {e}") from e
        if not isinstance(meta, dict) or not {"fingerprint", "leaves", "checksums"} <= set(meta):
            raise CheckpointError(f"{where} has no coat_jax training metadata")
        abstract = _abstract_subtree(meta["leaves"], "params")
        if not abstract:
            raise CheckpointError(f"{where} holds no parameters")
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), abstract)
        try:
            params = manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        item={"params": abstract},
                        restore_args={"params": restore_args},
                        partial_restore=True,
                    )
                ),
            )["state"]["params"]
        except Exception as e:
            raise CheckpointError(f"{where} is unreadable: {type(e).__name__}: {e}") from e
    sums = meta["checksums"]
    bad = [k for k, v in leaf_checksums({"params": params}).items() if sums.get(k) != v]
    if bad:
        raise CheckpointError(
            f"{where} is corrupt: {len(bad)} array(s) fail their checksum, e.g. state{bad[0]}"
        )
    return params, meta

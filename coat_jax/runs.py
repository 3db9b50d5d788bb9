"""A `train.py` run directory, read without the trainer: its parameters, settings and tokenizer.

A run directory (`output_dir`) holds `config.yaml` and Orbax checkpoints written by the trainer
(``coat_jax.training.checkpoint.Checkpointer``). This module reads one checkpoint's parameters
(:func:`read_params`, each array checked against its stored checksum) in whichever layer layout
the run used, so no optimizer is built; the architecture comes from the checkpoint's
fingerprint and the tokenizer from the run's config, checked against the identity the
checkpoint recorded. It also owns what the trainer and these readers must agree on: the
checksum of a leaf (:func:`checksum`), the identity of a tokenizer (:func:`tokenizer_identity`)
and where an ``init_from`` spec points (:func:`resolve_init_from`).

``python -m coat_jax.convert run-to-hf`` and ``python -m coat_jax.generate`` read runs through
this module; the trainer imports it, never the other way round (docs/design.md, 'Layers').
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import logging
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx

from coat_jax.llama import Llama, LlamaConfig, unstack_layers
from coat_jax.tokenizer import ByteTokenizer, load_tokenizer


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or belongs to a different run set-up."""


def cause(error: BaseException, limit: int = 300) -> str:
    """The root of an error's chain: its type and first line, cut to about ``limit`` characters.

    Orbax wraps what went wrong (a short read, a full disk) in errors that say only where, and
    carries the TensorStore spec and source locations after it; the root names the cause.
    """
    while True:
        inner = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
        if inner is None or not str(inner).strip():
            break
        error = inner
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    for marker in (" [tensorstore_spec", " [source locations"):
        first = first.split(marker)[0]
    if len(first) > limit:
        # TensorStore names what failed first and why last ("No space left on device"); the
        # paths between repeat the checkpoint's directory.
        first = f"{first[: limit // 3]} ... {first[-(limit - limit // 3 - 5) :]}"
    return f"{type(error).__name__}: {first}"


_UINT_OF_WIDTH = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def checksum(x) -> jax.Array:
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
# cross-device reduction, and many small collective programs in flight at once can stall
# XLA:CPU's fake devices (FP8 optimizer states, with four leaves per moment, hit it first).
_tree_checksums = jax.jit(lambda tree: jax.tree.map(checksum, tree))


def by_keypath(sums) -> dict[str, list[int]]:
    """``{keypath: [sum, weighted sum]}`` of a tree of :func:`checksum` results (on the host)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(sums)
    return {jax.tree_util.keystr(path): [int(v) for v in leaf] for path, leaf in flat}


def leaf_checksums(tree) -> dict[str, list[int]]:
    """``{keypath: [sum, weighted sum]}`` of every leaf's bits, for detecting corrupt files."""
    return by_keypath(jax.device_get(_tree_checksums(tree)))


def _orbax_file(path: str) -> bool:
    return f"{os.sep}orbax{os.sep}" in path


class _DropOrbaxTracebacks(logging.Filter):
    """Drops the tracebacks logged for Orbax's failed background work.

    - absl, from Orbax's threads, for a failed write: :meth:`Checkpointer.wait` raises the same
      error with the step and what to do; a traceback per Orbax thread before it would bury
      that line.
    - asyncio's "Task exception was never retrieved", for a read Orbax abandoned: when one array
      of a checkpoint cannot be read, Orbax's restore raises at once, and a read that failed too
      but that nobody awaited is logged when the garbage collector takes its task. The error
      that matters is the one the restore raised.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info:
            return True
        frames = traceback.extract_tb(record.exc_info[2])
        return not (_orbax_file(record.pathname) or any(_orbax_file(f.filename) for f in frames))


class _DropAbandonedReadCallbacks:
    """A ``sys.unraisablehook`` that drops the errors of the TensorStore reads Orbax abandoned.

    When one array of a checkpoint cannot be read, Orbax's restore raises at once and closes its
    event loop while the other reads are still in flight. Each of them may then report an error
    nobody can catch: from a TensorStore thread, that it could not call back into the closed
    loop; or, when the garbage collector closes its unfinished read coroutine, the exception
    Orbax raises for any error inside a read (the collector's ``GeneratorExit`` included). The
    error that matters is the one the restore raised; every other unraisable error goes to
    ``previous``.
    """

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, unraisable) -> None:
        error = unraisable.exc_value
        closed_loop = (
            isinstance(error, RuntimeError)
            and str(error) == "Event loop is closed"
            and any(
                frame.name == "call_soon_threadsafe"
                for frame in traceback.extract_tb(unraisable.exc_traceback)
            )
        )
        if not (closed_loop or _closed_orbax_read(unraisable.object, error)):
            self.previous(unraisable)


def _closed_orbax_read(obj, error) -> bool:
    """Whether ``error`` is what an Orbax coroutine raised as the garbage collector closed it."""
    code = getattr(obj, "cr_code", None)
    return (
        code is not None
        and _orbax_file(code.co_filename)
        and isinstance(getattr(error, "__context__", None), GeneratorExit)
    )


def quiet_orbax() -> None:
    # Orbax logs every save at INFO through absl; that would break the progress bar's line.
    logging.getLogger("absl").setLevel(logging.WARNING)
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropOrbaxTracebacks) for f in logger.filters):
            logger.addFilter(_DropOrbaxTracebacks())
    if not isinstance(sys.unraisablehook, _DropAbandonedReadCallbacks):
        sys.unraisablehook = _DropAbandonedReadCallbacks(sys.unraisablehook)


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
    import orbax.checkpoint as ocp  # heavy; `import coat_jax` reaches this module

    directory = Path(output_dir).expanduser().resolve() / "checkpoints"
    if not directory.is_dir():
        raise CheckpointError(
            f"{str(directory)!r} does not exist; give the output_dir of a train.py run"
        )
    quiet_orbax()
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
            raise CheckpointError(f"{where} is unreadable: {cause(e)}") from e
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
            raise CheckpointError(f"{where} is unreadable: {cause(e)}") from e
    sums = meta["checksums"]
    bad = [k for k, v in leaf_checksums({"params": params}).items() if sums.get(k) != v]
    if bad:
        raise CheckpointError(
            f"{where} is corrupt: {len(bad)} array(s) fail their checksum, e.g. state{bad[0]}"
        )
    return params, meta


def tokenizer_identity(tok) -> str | None:
    """The exact vocabulary of ``tok``: the byte tokenizer's name, or a hash of a fast
    tokenizer's JSON (None for a tokenizer that is neither), as checkpoints record it."""
    if isinstance(tok, ByteTokenizer):
        return f"coat_jax.ByteTokenizer(vocab_size={tok.vocab_size})"
    fast = getattr(tok, "backend_tokenizer", None)
    if fast is None:
        return None
    return hashlib.sha256(fast.to_str().encode()).hexdigest()


def resolve_init_from(spec: str) -> str:
    """A checkpoint path; ``pkg:NAME/rest`` looks inside an installed package (no import)."""
    if spec.startswith("pkg:"):
        package, _, rest = spec[4:].partition("/")
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise ValueError(f"init_from={spec!r}: package {package!r} is not installed")
        path = Path(list(found.submodule_search_locations)[0]) / rest
    else:
        path = Path(spec).expanduser()
    if not path.exists():
        raise ValueError(f"init_from={spec!r}: {str(path)!r} does not exist")
    return str(path)


def is_run_dir(path: str | os.PathLike) -> bool:
    """True for a train.py output directory (``config.yaml`` and ``checkpoints/``)."""
    p = Path(path).expanduser()
    return (p / "config.yaml").is_file() and (p / "checkpoints").is_dir()


@dataclasses.dataclass(frozen=True)
class TrainedRun:
    """One checkpoint of a run: its parameters (numpy, unrolled layers) and what they need."""

    run_dir: Path
    step: int
    config: LlamaConfig
    params: dict
    compute_dtype: str
    tokenizer: str
    init_from: str | None
    tokenizer_identity: str | None


def saved_run_settings(path: Path) -> dict:
    """``tokenizer``, ``init_from`` and ``compute_dtype`` of a run's saved config: its sections
    (``data.tokenizer``, ``precision.compute_dtype``), or the flat keys a run of an earlier
    coat_jax saved."""
    saved = yaml.safe_load(path.read_text()) or {}
    data, precision = saved.get("data"), saved.get("precision")
    if isinstance(data, dict) and isinstance(precision, dict):
        saved = {
            "tokenizer": data.get("tokenizer"),
            "init_from": saved.get("init_from"),
            "compute_dtype": precision.get("compute_dtype", "bfloat16"),
        }
    if "tokenizer" not in saved or "init_from" not in saved or saved["tokenizer"] is None:
        raise ValueError(f"{path} lacks tokenizer or init_from; it was not written by train.py")
    return {"compute_dtype": "bfloat16", **saved}


def read_run(run_dir: str | os.PathLike, *, step: int | None = None) -> TrainedRun:
    """Reads a run's newest (or `step`'s) checkpoint parameters and its settings.

    Raises:
      ValueError: not a run directory, or its config/checkpoint lacks what an export needs
        (CheckpointError, a ValueError, for a missing, unreadable or corrupt checkpoint).
    """
    run_dir = Path(run_dir).expanduser()
    if not is_run_dir(run_dir):
        raise ValueError(
            f"{str(run_dir)!r} is not a train.py run directory (it needs config.yaml and "
            "checkpoints/); give the output_dir of a run"
        )
    settings = saved_run_settings(run_dir / "config.yaml")
    params, meta = read_params(run_dir, step)
    model = meta["fingerprint"].get("model")
    if not isinstance(model, dict):
        raise CheckpointError(
            f"checkpoint step {meta['step']} in {run_dir} has no architecture in its metadata; "
            "it was written by an older coat_jax"
        )
    return TrainedRun(
        run_dir=run_dir,
        step=int(meta["step"]),
        config=LlamaConfig(**model),
        params=unstack_layers(params),
        compute_dtype=str(settings["compute_dtype"]),
        tokenizer=str(settings["tokenizer"]),
        init_from=settings["init_from"],
        tokenizer_identity=meta["fingerprint"].get("tokenizer"),
    )


def tokenizer_source(run: TrainedRun) -> str | None:
    """The path the run's tokenizer came from; None for the byte tokenizer."""
    if run.tokenizer == "byte":
        return None
    spec = run.init_from if run.tokenizer == "init_from" else run.tokenizer
    if not spec:
        raise ValueError(
            f"{run.run_dir}/config.yaml says data.tokenizer=init_from but has no init_from"
        )
    try:
        return resolve_init_from(spec)
    except ValueError as e:
        raise ValueError(
            f"the run's tokenizer is not where its config says: {e}; run from the directory "
            f"train.py ran in, or edit the path in {run.run_dir / 'config.yaml'}"
        ) from e


def check_identity(run: TrainedRun, tokenizer, source: str) -> None:
    """Refuses a tokenizer whose vocabulary is not the one the run's checkpoint recorded."""
    if run.tokenizer_identity is None:
        return
    if tokenizer_identity(tokenizer) != run.tokenizer_identity:
        raise ValueError(
            f"the tokenizer at {source!r} is not the one checkpoint step {run.step} was trained "
            f"with (its vocabulary differs); point {run.run_dir / 'config.yaml'} at the "
            "tokenizer files the run used"
        )


def run_tokenizer(run: TrainedRun):
    """The run's tokenizer: a `ByteTokenizer` or a transformers tokenizer, identity-checked."""
    source = tokenizer_source(run)
    if source is None:
        return ByteTokenizer()
    tokenizer = load_tokenizer(source)
    check_identity(run, tokenizer, source)
    return tokenizer


def run_model(run: TrainedRun, *, dtype=None, param_dtype=jnp.float32) -> Llama:
    """The run's parameters as a `Llama` (unrolled layers, "bf16" precision.mode: plain math).

    `dtype` is the compute dtype; None takes the run's `compute_dtype`.
    """
    dtype = jnp.dtype(run.compute_dtype if dtype is None else dtype)
    abstract = nnx.eval_shape(
        lambda: Llama(run.config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    )
    graphdef, state = nnx.split(abstract)
    wanted = nnx.to_pure_dict(state)
    want_sig = jax.tree.map(lambda s: tuple(s.shape), wanted)
    have_sig = jax.tree.map(lambda a: tuple(a.shape), run.params)
    if want_sig != have_sig:
        raise CheckpointError(
            f"checkpoint step {run.step} in {run.run_dir} does not hold the parameters of its "
            "own architecture (corrupt metadata?)"
        )
    values = jax.tree.map(lambda a, s: jnp.asarray(a, s.dtype), run.params, wanted)
    nnx.replace_by_pure_dict(state, values)
    return nnx.merge(graphdef, state)


def load_run_model(run_dir: str | os.PathLike, *, step: int | None = None, dtype=None):
    """(model, tokenizer) of a run's newest (or `step`'s) checkpoint, for `coat_jax.generate`."""
    run = read_run(run_dir, step=step)
    return run_model(run, dtype=dtype), run_tokenizer(run)

"""Multi-process (multi-host) start-up: ``jax.distributed.initialize`` when a launcher asks for it.

``train.py`` calls :func:`maybe_initialize` before JAX touches a device. It initializes JAX's
distributed runtime in exactly two cases, and otherwise does nothing (one process):

* ``COAT_JAX_COORDINATOR`` is set: ``host:port`` of process 0's coordinator service, with
  ``COAT_JAX_NUM_PROCESSES`` (how many processes) and ``COAT_JAX_PROCESS_ID`` (this one's,
  from 0), and optionally ``COAT_JAX_LOCAL_DEVICE_IDS`` (comma-separated ids of the local
  devices this process uses, for several processes per host). Any launcher can set these.
* a launcher JAX detects by itself started several processes: Slurm (``srun`` with more than one
  task: ``SLURM_STEP_NUM_TASKS``, else ``SLURM_NTASKS``, above 1) or Open MPI (``mpirun``:
  ``OMPI_MCA_orte_hnp_uri`` set and ``OMPI_COMM_WORLD_SIZE`` above 1). JAX then reads the
  coordinator, the process count and the process id from the launcher's variables.

``COAT_JAX_DISTRIBUTED=off`` turns the launcher detection off (independent single-process runs
inside one Slurm step). A program that initialized ``jax.distributed`` itself is left alone.

After it, ``jax.devices()`` lists every process's devices, the trainer's mesh spans all of them,
each process reads and transfers only its own devices' rows of every batch
(:func:`coat_jax.training.sharding.put_rows`), only the main process (index 0) writes
metrics.jsonl, config.yaml, the loss plot and status lines, and every process takes part in
Orbax's checkpoint saves and restores (the output directory must be one shared file system).
A stop signal (SIGTERM, Ctrl-C) that reaches only some processes stops all of them at the same
step (:class:`StopAgreement`).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

COORDINATOR = "COAT_JAX_COORDINATOR"
NUM_PROCESSES = "COAT_JAX_NUM_PROCESSES"
PROCESS_ID = "COAT_JAX_PROCESS_ID"
LOCAL_DEVICE_IDS = "COAT_JAX_LOCAL_DEVICE_IDS"
SWITCH = "COAT_JAX_DISTRIBUTED"


def _int(env: Mapping[str, str], name: str) -> int:
    text = env.get(name)
    if text is None:
        raise ValueError(
            f"{COORDINATOR}={env[COORDINATOR]!r} is set but {name} is not; set {NUM_PROCESSES} "
            f"(the number of processes) and {PROCESS_ID} (this process's index, from 0) too"
        )
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer") from None


def _explicit_args(env: Mapping[str, str]) -> dict:
    """``jax.distributed.initialize`` arguments from the ``COAT_JAX_*`` variables."""
    coordinator = env[COORDINATOR]
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(
            f"{COORDINATOR}={coordinator!r} is not host:port (e.g. node0:1234, the address "
            "process 0 listens on)"
        )
    num, pid = _int(env, NUM_PROCESSES), _int(env, PROCESS_ID)
    if num < 1 or not 0 <= pid < num:
        raise ValueError(
            f"{PROCESS_ID}={pid} must be in [0, {NUM_PROCESSES}={num}) and {NUM_PROCESSES} >= 1"
        )
    args = dict(coordinator_address=coordinator, num_processes=num, process_id=pid)
    ids = env.get(LOCAL_DEVICE_IDS)
    if ids:
        try:
            args["local_device_ids"] = [int(i) for i in ids.split(",")]
        except ValueError:
            raise ValueError(
                f"{LOCAL_DEVICE_IDS}={ids!r} is not a comma-separated list of device ids"
            ) from None
    return args


def _count(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env.get(name, "1"))
    except ValueError:
        raise ValueError(f"the launcher set {name}={env[name]!r}, which is not a count") from None


def launcher(env: Mapping[str, str] | None = None) -> str | None:
    """The multi-process launcher that started this process, or ``None`` (see module docstring).

    Returns ``"coat_jax"`` (the ``COAT_JAX_*`` variables), ``"slurm"`` or ``"ompi"``.
    """
    env = os.environ if env is None else env
    if env.get(COORDINATOR):
        return "coat_jax"
    for name in (NUM_PROCESSES, PROCESS_ID, LOCAL_DEVICE_IDS):
        if env.get(name):
            raise ValueError(
                f"{name} is set but {COORDINATOR} is not; set {COORDINATOR}=host:port (process "
                f"0's address) to start several processes, or unset {name}"
            )
    switch = env.get(SWITCH, "auto").lower()
    if switch not in ("auto", "off"):
        raise ValueError(f"{SWITCH}={env[SWITCH]!r} is not one of 'auto', 'off'")
    if switch == "off":
        return None
    # What jax._src.clusters.SlurmCluster needs to find the coordinator and the ranks.
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(v in env for v in slurm):
        tasks = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
        if _count(env, tasks) > 1:
            return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in env and _count(env, "OMPI_COMM_WORLD_SIZE") > 1:
        return "ompi"
    return None


def maybe_initialize(env: Mapping[str, str] | None = None) -> bool:
    """Initializes ``jax.distributed`` if a multi-process launcher started this process.

    Call it before anything asks JAX for devices. Returns whether it initialized.

    Raises:
      ValueError: the ``COAT_JAX_*`` variables are incomplete or malformed.
      RuntimeError: JAX already started its backends (a device was used before this call).
    """
    env = os.environ if env is None else env
    found = launcher(env)
    if found is None or jax.distributed.is_initialized():
        return False
    args = _explicit_args(env) if found == "coat_jax" else {}
    if not jax.config.jax_cpu_collectives_implementation:
        # Cross-process collectives of the CPU backend (tests, CPU clusters).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(**args)
    except RuntimeError as e:
        raise RuntimeError(
            f"jax.distributed.initialize() for the {found} launcher failed: {e}. It must run "
            "before JAX uses a device (train.py calls it first thing)"
        ) from e
    return True


def is_main_process() -> bool:
    """Process 0: the one that writes metrics, plots, the run's config and status lines."""
    return jax.process_index() == 0


def sync(name: str) -> None:
    """Waits until every process got here (nothing with one process).

    ``train`` calls it between the set-up, where every process checks the output directory,
    and the main process's first write there.
    """
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


class StopAgreement:
    """Turns each process's stop request (a signal number, or None) into one decision for all.

    With one process the decision is the process's own request, at once: nothing is computed.
    With several, a signal that reaches only some of them must still stop every process at the
    same step, or the others wait in the step's next collective for processes that left. At each
    step boundary :meth:`stop` dispatches a tiny jitted maximum of every process's request (one
    int32 per process, on one device of each: a cross-process all-reduce) and reads the result
    of the one it dispatched at the boundary before. Every process reads the same result at the
    same boundary, so all stop after the same step, report the same signal (the largest number
    requested: SIGTERM over SIGINT) and exit with the same code. Reading one boundary late keeps
    the bounded dispatch: that reduction was queued behind the previous step, which the loop has
    already waited for, so the host never waits for the step in flight; the price is that the
    processes stop one step later than one process would. :meth:`final`, after the loop, reads
    the last reduction; a signal that arrives after it is not acted on (the run finishes).
    """

    def __init__(self, say=print):
        self._say = say
        self.several = jax.process_count() > 1
        self.signum: int | None = None  # the agreed request
        self._pending: jax.Array | None = None
        if self.several:
            first = {}
            for d in jax.devices():
                first.setdefault(d.process_index, d)
            mesh = jax.sharding.Mesh(np.array([first[p] for p in sorted(first)]), ("processes",))
            self._sharding = jax.sharding.NamedSharding(
                mesh, jax.sharding.PartitionSpec("processes")
            )
            replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            self._reduce = jax.jit(jnp.max, out_shardings=replicated)
            self._inputs: dict[int, jax.Array] = {}

    def stop(self, local: int | None) -> int | None:
        """At a step boundary: the agreed request (None: go on). ``local``: this process's."""
        if not self.several:
            self.signum = local
            return local
        if self.signum is None:
            previous, self._pending = self._pending, self._reduce(self._input(local))
            if previous is not None:
                self._read(previous, local)
        return self.signum

    def final(self, local: int | None) -> int | None:
        """After the last step: the agreed request, from every reduction dispatched."""
        if not self.several:
            self.signum = local
            return local
        if self.signum is None and self._pending is not None:
            self._read(self._pending, local)
        self._pending = None
        return self.signum

    def _input(self, local: int | None) -> jax.Array:
        value = 0 if local is None else int(local)
        if value not in self._inputs:
            self._inputs[value] = jax.make_array_from_process_local_data(
                self._sharding, np.array([value], np.int32)
            )
        return self._inputs[value]

    def _read(self, reduced: jax.Array, local: int | None) -> None:
        value = int(np.asarray(reduced.addressable_data(0)))
        if value:
            self.signum = value
            if local is None:
                self._say(
                    f"another process received {signal.Signals(value).name}: stopping with it "
                    "once the step in flight finishes, as every process does"
                )


class NoLog:
    """The metrics log of a process other than the main one: it writes and reads nothing."""

    def __init__(self, *args, **kwargs):
        del args, kwargs

    def write(self, record: dict) -> None:
        del record

    def read(self) -> list[dict]:
        return []

    def close(self) -> None:
        pass


def quiet(line: str) -> None:
    """The console of a process other than the main one: status lines go to its log only."""
    del line


def process_dir(output_dir: Path) -> Path:
    """Where this process keeps its lock and ``train.log``: ``output_dir`` for the main process,
    ``output_dir/processes/<index>`` for the others (each has its own log; the main process's
    lock guards the directory against a second run)."""
    if is_main_process():
        return output_dir
    return output_dir / "processes" / str(jax.process_index())

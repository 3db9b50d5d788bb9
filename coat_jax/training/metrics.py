"""metrics.jsonl and the writers that mirror it (TensorBoard, Weights & Biases), memory
readings and the loss-curve plot."""

from __future__ import annotations

import json
import os
import resource
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import jax


def device_peak_bytes() -> int | None:
    """Peak bytes in use on the first local device, where the backend reports it (GPU/TPU)."""
    stats = jax.local_devices()[0].memory_stats()
    if not stats:
        return None
    return stats.get("peak_bytes_in_use")


def host_peak_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux and bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


class MetricWriter(Protocol):
    """Where metrics.jsonl's records also go: each numeric value of a record becomes a scalar
    of the same name at the record's ``step``."""

    def write(self, record: dict) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict) -> dict[str, float]:
    """The numbers of a record other than its ``step`` (None, booleans and text left out)."""
    return {
        k: v
        for k, v in record.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
    }


class TensorBoardWriter:
    """TensorBoard events through ``tensorboardX`` (``pip install 'coat-jax[tensorboard]'``);
    on resume, events after ``resume_step`` are purged."""

    def __init__(self, directory: str | os.PathLike, *, resume_step: int | None):
        try:
            from tensorboardX import SummaryWriter
        except ImportError as e:
            raise ValueError(
                f"TensorBoard logging to {str(directory)!r} needs tensorboardX; "
                "pip install 'coat-jax[tensorboard]' or turn TensorBoard logging off"
            ) from e
        purge = None if resume_step is None else resume_step + 1
        self._writer = SummaryWriter(os.fspath(Path(directory).expanduser()), purge_step=purge)

    def write(self, record: dict) -> None:
        for key, value in scalars(record).items():
            self._writer.add_scalar(key, value, global_step=record["step"])
        # A run killed between records still shows everything it logged.
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbWriter:
    """A Weights & Biases run (``pip install 'coat-jax[wandb]'``) in ``directory``/wandb.

    ``mode`` is W&B's: ``online`` syncs as the run goes, ``offline`` only writes the run's
    files (``wandb sync`` uploads them later). The run's id is kept in
    ``directory``/wandb/run_id, so a resumed training run continues the same W&B run.
    """

    def __init__(self, directory: Path, *, project: str, mode: str, config: dict, resume: bool):
        try:
            import wandb
        except ImportError as e:
            raise ValueError(
                f"logging.wandb_project={project!r} needs wandb; pip install 'coat-jax[wandb]' or "
                "set logging.wandb_project=null"
            ) from e
        id_file = directory / "wandb" / "run_id"
        run_id = id_file.read_text().strip() if resume and id_file.exists() else None
        self._run = wandb.init(
            project=project,
            mode=mode,
            dir=os.fspath(directory),
            id=run_id,
            resume="allow" if run_id else None,
            config=config,
            settings=wandb.Settings(silent=True, console="off"),
        )
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(self._run.id)

    def write(self, record: dict) -> None:
        self._run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self._run.finish()


class MetricsLog:
    """Appends one JSON object per line; on resume drops lines logged after the checkpoint.

    Every record also goes to each of ``writers`` (:class:`MetricWriter`); ``tensorboard_dir``
    adds a :class:`TensorBoardWriter` there, so TensorBoard shows exactly what metrics.jsonl
    holds.

    Examples:
      >>> import tempfile
      >>> run = Path(tempfile.mkdtemp())
      >>> log = MetricsLog(run / "metrics.jsonl", resume_step=None, tensorboard_dir=run / "tb")
      >>> log.write({"step": 1, "loss": 5.5})
      >>> log.close()
      >>> log.read()
      [{'step': 1, 'loss': 5.5}]
    """

    def __init__(
        self,
        path: Path,
        *,
        resume_step: int | None,
        tensorboard_dir: str | os.PathLike | None = None,
        writers: Sequence[MetricWriter] = (),
    ):
        self.path = path
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            kept = [line for line in self.read() if line.get("step", 0) <= resume_step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.path)
        self._writers = list(writers)
        if tensorboard_dir is not None:
            self._writers.insert(0, TensorBoardWriter(tensorboard_dir, resume_step=resume_step))

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for writer in self._writers:
            writer.write(record)

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def close(self) -> None:
        writers, self._writers = self._writers, []
        for writer in writers:
            writer.close()


def plot_loss_curve(records: list[dict], path: Path, title: str) -> None:
    """Training loss (and validation loss where logged) against step, as a PNG."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(
            "the trainer's loss curve needs matplotlib: pip install 'coat-jax[train]'"
        ) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation loss", ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

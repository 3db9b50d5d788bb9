"""metrics.jsonl, memory readings and the loss-curve plot."""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

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


class MetricsLog:
    """Appends one JSON object per line; on resume drops lines logged after the checkpoint.

    With ``tensorboard_dir`` every record also goes to TensorBoard (through ``tensorboardX``,
    ``pip install 'coat-jax[tensorboard]'``): each number of a record becomes a scalar of the
    same name at the record's ``step``, so TensorBoard shows exactly what metrics.jsonl holds.
    On resume, events after the checkpoint's step are purged there too.

    Example:
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
    ):
        self.path = path
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            kept = [line for line in self.read() if line.get("step", 0) <= resume_step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.path)
        self._tensorboard = None
        if tensorboard_dir is not None:
            try:
                from tensorboardX import SummaryWriter
            except ImportError as e:
                raise ValueError(
                    f"TensorBoard logging to {str(tensorboard_dir)!r} needs tensorboardX; "
                    "pip install 'coat-jax[tensorboard]' or turn TensorBoard logging off"
                ) from e
            purge = None if resume_step is None else resume_step + 1
            self._tensorboard = SummaryWriter(
                os.fspath(Path(tensorboard_dir).expanduser()), purge_step=purge
            )

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tensorboard is not None:
            step = record["step"]
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                    self._tensorboard.add_scalar(key, value, global_step=step)
            # A run killed between records still shows everything it logged.
            self._tensorboard.flush()

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None


def plot_loss_curve(records: list[dict], path: Path, title: str) -> None:
    """Training loss (and validation loss where logged) against step, as a PNG."""
    import matplotlib

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

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
    """Appends one JSON object per line; on resume drops lines logged after the checkpoint."""

    def __init__(self, path: Path, *, resume_step: int | None):
        self.path = path
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            kept = [line for line in self.read() if line.get("step", 0) <= resume_step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.path)

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


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

"""train.py with a fault injected, run as a child process by tests/training/test_reliability.py.

  python tests/fault_child.py --block-save STEP --marker FILE -- key=value ...

``--block-save STEP``: the checkpoint of step STEP never finishes writing. Its files go to
Orbax's temporary directory as usual, but the write's last commit waits forever after creating
FILE, so the test can kill -9 the trainer while that checkpoint is being written. The trainer
is otherwise train.py itself (``runpy``), arguments after ``--`` and all.
"""

from __future__ import annotations

import argparse
import runpy
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def block_save(step: int, marker: Path) -> None:
    """Makes Orbax's write of checkpoint ``step`` hang in its background commit."""
    import orbax.checkpoint as ocp

    original = ocp.JsonCheckpointHandler.async_save

    class Never:
        """A commit future that never completes (Orbax waits on ``result()``)."""

        def result(self, timeout=None):
            marker.write_text(str(step))
            while True:
                time.sleep(3600)

    async def async_save(self, directory, item=None, args=None):
        futures = await original(self, directory, item, args)
        meta = args.item if args is not None else item
        if isinstance(meta, dict) and meta.get("step") == step:
            return [*(futures or []), Never()]
        return futures

    ocp.JsonCheckpointHandler.async_save = async_save


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--block-save", type=int, required=True)
    parser.add_argument("--marker", type=Path, required=True)
    parser.add_argument("train_args", nargs="*")
    args = parser.parse_args()
    block_save(args.block_save, args.marker)
    # As `python train.py` would have it: the repository first on the path.
    sys.path.insert(0, str(REPO))
    sys.argv = [str(REPO / "train.py"), *args.train_args]
    runpy.run_path(str(REPO / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main()

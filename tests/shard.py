"""Run one shard of the suite: every N-th collected test, so that N processes share one machine.

``python tests/shard.py K N [pytest arguments]`` runs the tests whose collection index is K modulo
N (0 <= K < N) and deselects the rest; N such processes at once cover the suite, each with an even
share of every file (docs/jax_versions.md ran the suite on JAX 0.11.2 this way).
"""

from __future__ import annotations

import sys

import pytest


class Shard:
    """A pytest plugin keeping the collected items whose index is ``index`` modulo ``count``."""

    def __init__(self, index: int, count: int):
        if not 0 <= index < count:
            raise ValueError(f"shard {index} of {count}: need 0 <= K < N")
        self.index, self.count = index, count

    def pytest_collection_modifyitems(self, config, items):
        keep = [it for i, it in enumerate(items) if i % self.count == self.index]
        drop = [it for i, it in enumerate(items) if i % self.count != self.index]
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not (argv[0].isdigit() and argv[1].isdigit()):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    return pytest.main(argv[2:], plugins=[Shard(int(argv[0]), int(argv[1]))])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

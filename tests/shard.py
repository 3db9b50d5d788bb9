"""Run one shard of the suite: every N-th collected test, so that N processes share one machine.

``python tests/shard.py K N [pytest arguments]`` runs the tests whose collection index is K modulo
N (0 <= K < N) and deselects the rest; N such processes at once cover the suite, each with an even
share of every file (docs/jax_versions.md ran the suite on JAX 0.11.2 this way).

``python tests/shard.py --gpu K N [pytest arguments]`` first keeps only the tests with a ``skipif``
whose reason names a GPU, CUDA or cuDNN (those a CPU skips for want of a GPU, and the CPU-only
variants beside them, which then skip on the GPU) and the files of GPU kernel tests,
:data:`GPU_FILES`, then shards those.
"""

from __future__ import annotations

import re
import sys

import pytest

GPU_FILES = (
    "tests/fp8/test_fp8_ops.py",
    "tests/kernels/test_coat_adam.py",
    "tests/fp8/test_attention_backward.py",
    "tests/fp8/test_gemm_output.py",
)
_GPU_REASON = re.compile(r"gpu|cuda|cudnn", re.IGNORECASE)


def needs_gpu(item) -> bool:
    """Whether a collected test belongs to the GPU selection (``--gpu``)."""
    if item.nodeid.startswith(GPU_FILES):
        return True
    return any(
        _GPU_REASON.search(str(mark.kwargs.get("reason", "")))
        for mark in item.iter_markers("skipif")
    )


class Shard:
    """A pytest plugin keeping the collected items whose index is ``index`` modulo ``count``."""

    def __init__(self, index: int, count: int, *, gpu: bool = False):
        if not 0 <= index < count:
            raise ValueError(f"shard {index} of {count}: need 0 <= K < N")
        self.index, self.count, self.gpu = index, count, gpu

    def pytest_collection_modifyitems(self, config, items):
        chosen = [it for it in items if needs_gpu(it)] if self.gpu else list(items)
        keep = [it for i, it in enumerate(chosen) if i % self.count == self.index]
        kept = {id(it) for it in keep}
        drop = [it for it in items if id(it) not in kept]
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def main(argv: list[str]) -> int:
    gpu = bool(argv) and argv[0] == "--gpu"
    if gpu:
        argv = argv[1:]
    if len(argv) < 2 or not (argv[0].isdigit() and argv[1].isdigit()):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    return pytest.main(argv[2:], plugins=[Shard(int(argv[0]), int(argv[1]), gpu=gpu)])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

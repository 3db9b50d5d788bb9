"""Test-run settings that make the CPU suite compile less; loaded before any test module.

Most of the suite's time on a CPU is XLA compiling small programs, many of them the same program
compiled again by another test, another pytest-xdist worker or a ``train.py`` child process.

- One persistent JAX compilation cache for the whole test run (a temporary folder shared by the
  workers and every child process through the environment), so a program compiled once is loaded
  from disk after that. Tests that pass ``compilation_cache_dir=...`` to the trainer still get
  their own.
- XLA:CPU's backend at optimization level 0: the programs are tiny, so LLVM's optimizations cost
  far more time than they save. The arithmetic is the same at every level (XLA:CPU keeps fast
  math off), so every tolerance and bit-for-bit comparison holds.
- XLA:CPU's loop-fusion emitters instead of its MLIR fusion emitters, which take much of a small
  program's compile time. They may round an element-wise chain differently (one float32 ulp)
  in two programs that fuse it differently, so the few tests that compare two such programs bit
  for bit compile those with the default emitters (``tests/kernels/contract.py``'s
  ``CPU_DEFAULT_EMITTERS``, passed as ``jax.jit``'s ``compiler_options``).
- None of the flags is set where a GPU is present, so GPU tests compile as users' programs do;
  a flag already in ``XLA_FLAGS`` keeps its value.

``COAT_JAX_TEST_COMPILE=default`` turns all of them off.

Under coverage (CI's ``--cov``), the test bodies listed in ``tests/untraced_bodies.txt`` run
without the tracer (pytest-cov's ``no_cover``). The tracer slows every Python line JAX runs while
it traces a program, and those bodies reach no line or branch of the library that collection,
fixtures or a traced body before them does not reach too, so the coverage report is the same.
``tools/coverage_overlap.py`` checks and rewrites the list from a run with per-test contexts.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

UNTRACED_BODIES = Path(__file__).resolve().parent / "tests" / "untraced_bodies.txt"

CPU_TEST_XLA_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_use_fusion_emitters=false",
)


def _fast_compile_settings() -> None:
    if os.environ.get("COAT_JAX_TEST_COMPILE") == "default":
        return
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        folder = tempfile.mkdtemp(prefix="coat-jax-test-xla-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        os.environ["JAX_COMPILATION_CACHE_DIR"] = folder
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    has_gpu = shutil.which("nvidia-smi") is not None
    flags = os.environ.get("XLA_FLAGS", "").split()
    if not has_gpu:
        # A flag already in XLA_FLAGS keeps its value (child processes inherit the run's flags).
        named = {f.split("=")[0] for f in flags}
        missing = [f for f in CPU_TEST_XLA_FLAGS if f.split("=")[0] not in named]
        os.environ["XLA_FLAGS"] = " ".join([*flags, *missing])


_fast_compile_settings()


def untraced_bodies() -> set[str]:
    """The node ids listed in :data:`UNTRACED_BODIES` (comments and blank lines skipped)."""
    if not UNTRACED_BODIES.exists():
        return set()
    lines = (line.strip() for line in UNTRACED_BODIES.read_text().splitlines())
    return {line for line in lines if line and not line.startswith("#")}


def pytest_collection_modifyitems(items):
    listed = untraced_bodies()
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.no_cover)

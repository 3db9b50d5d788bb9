"""Test-run settings that make the CPU suite compile less; loaded before any test module.

Most of the suite's time on a CPU is XLA compiling small programs, many of them the same program
compiled again by another test, another pytest-xdist worker or a ``train.py`` child process.

- One persistent JAX compilation cache for the whole test run (a temporary folder shared by the
  workers and every child process through the environment), so a program that was slow to
  compile once is loaded from disk after that. Tests that pass ``compilation_cache_dir=...`` to
  the trainer still get their own.
- XLA:CPU's backend at optimization level 0: the programs are tiny, so LLVM's optimizations cost
  far more time than they save. The arithmetic is the same at every level (XLA:CPU keeps fast
  math off), so every tolerance and bit-for-bit comparison holds.
- XLA:CPU's loop-fusion emitters instead of its MLIR fusion emitters, which take much of a small
  program's compile time. They may round an element-wise chain differently (one float32 ulp)
  in two programs that fuse it differently, so the few tests that compare two such programs bit
  for bit compile those with the default emitters (``tests/kernels/contract.py``'s
  ``CPU_DEFAULT_EMITTERS``, passed as ``jax.jit``'s ``compiler_options``).
- Each lowered operation's location is the line that made it, not the full Python traceback
  JAX records by default (``JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS``): locations are
  metadata only, and building them from full tracebacks costs lowering time.
- None of the XLA flags is set where a GPU is present, so GPU tests compile as users' programs do;
  a flag already in ``XLA_FLAGS`` keeps its value.

``COAT_JAX_TEST_COMPILE=default`` turns all of them off.

Under coverage (CI's ``--cov``), the test bodies and the fixtures' set-ups listed in
``tests/untraced_bodies.txt`` run without the tracer (pytest-cov's ``no_cover``, and its pause
around a listed fixture). The tracer slows every Python line JAX runs while it traces a program,
and what is listed reaches no line or branch of the library that collection or traced code before
it does not reach too, so the coverage report is the same. ``tools/coverage_overlap.py`` checks
and rewrites the list from a run with per-test contexts. The tracer also stops while JAX lowers
and compiles a program, and inside Orbax's checkpoint manager, Matplotlib's rendering and the gguf
package's reader, none of which runs a line of the library.
"""

from __future__ import annotations

import atexit
import functools
import gc
import importlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest

UNTRACED_BODIES = Path(__file__).resolve().parent / "tests" / "untraced_bodies.txt"
# Set for tools/coverage_overlap.py's contexts run: everything runs traced, and each fixture's
# set-up gets a coverage context of its own, so the tool can tell a fixture's arcs from those of
# the test that first requested it.
CONTEXTS_RUN = "COAT_JAX_COVERAGE_CONTEXTS"

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
        # A program that compiles faster than this costs more to serialize and compress
        # for the cache than to compile again in another process.
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"
        os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    os.environ.setdefault("JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS", "0")
    has_gpu = shutil.which("nvidia-smi") is not None
    flags = os.environ.get("XLA_FLAGS", "").split()
    if not has_gpu:
        # A flag already in XLA_FLAGS keeps its value (child processes inherit the run's flags).
        named = {f.split("=")[0] for f in flags}
        missing = [f for f in CPU_TEST_XLA_FLAGS if f.split("=")[0] not in named]
        os.environ["XLA_FLAGS"] = " ".join([*flags, *missing])


_fast_compile_settings()


# Code the library calls that runs none of the library's lines and calls none back, as
# (module, class or "" for the module itself, functions). Under coverage the tracer slows every
# Python line of it, so the tracer stops there; what the report counts is unchanged.
# - JAX lowering a traced program to StableHLO and compiling it: the library has no lowering
#   rules or compile-time callbacks (its lines all run while JAX traces); Pallas interpret mode
#   lowers each kernel's grid to loops there.
# - Orbax's checkpoint manager (it saves and restores plain pytrees of arrays), Matplotlib's
#   rendering of the loss curve, and the gguf package's parsing of a file's metadata.
UNTRACED_CALLS = (
    ("jax._src.interpreters.pxla", "", ("lower_sharding_computation",)),
    ("jax._src.interpreters.pxla", "MeshComputation", ("compile",)),
    (
        "orbax.checkpoint",
        "CheckpointManager",
        ("__init__", "save", "restore", "wait_until_finished", "close"),
    ),
    ("matplotlib.figure", "Figure", ("savefig", "tight_layout")),
    ("gguf", "GGUFReader", ("__init__",)),
)


def _untraced_calls() -> None:
    """Wraps :data:`UNTRACED_CALLS` (those installed) in :func:`tests.untraced.without_tracer`."""
    from tests.untraced import without_tracer

    for module, cls, names in UNTRACED_CALLS:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            continue
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        for name in names:
            if hasattr(owner, name):
                setattr(owner, name, without_tracer(getattr(owner, name)))


def pytest_configure(config):
    # pytest collects garbage five times at the end of a session to surface the last unraisable
    # exceptions; once does that too, and each pass over a worker's heap of JAX objects is slow.
    try:
        from _pytest.unraisableexception import gc_collect_iterations_key
    except ImportError:
        pass
    else:
        config.stash[gc_collect_iterations_key] = 1
    # Only a process that runs tests under coverage: not pytest-xdist's controller, which runs
    # none, nor a run without --cov (each wrapped module would be imported for nothing).
    # Called after _fast_compile_settings: JAX reads JAX_COMPILATION_CACHE_DIR when first imported.
    controller = bool(getattr(config.option, "numprocesses", None)) and not hasattr(
        config, "workerinput"
    )
    covered = bool(getattr(config.option, "cov_source", None))
    if covered and not controller and os.environ.get(CONTEXTS_RUN) != "1":
        _untraced_calls()


FIXTURE = "fixture "


def _listed() -> list[str]:
    if os.environ.get(CONTEXTS_RUN) == "1" or not UNTRACED_BODIES.exists():
        return []
    lines = (line.strip() for line in UNTRACED_BODIES.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def untraced_bodies() -> set[str]:
    """The test node ids listed in :data:`UNTRACED_BODIES` (comments and blank lines skipped)."""
    return {line for line in _listed() if not line.startswith(FIXTURE)}


@functools.cache
def untraced_fixtures() -> frozenset[str]:
    """The fixtures listed in :data:`UNTRACED_BODIES` (``fixture <key>`` lines, keys as
    :func:`fixture_key`): their set-up runs without the tracer."""
    return frozenset(line[len(FIXTURE) :] for line in _listed() if line.startswith(FIXTURE))


def fixture_key(fixturedef) -> str:
    """``<where it is defined>::<name>``: the defining module's or conftest folder's node id."""
    return f"{fixturedef.baseid}::{fixturedef.argname}"


def pytest_collection_modifyitems(items):
    listed = untraced_bodies()
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.no_cover)


_running: dict[str, str] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _running["nodeid"] = item.nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    controller = getattr(request.config.pluginmanager.get_plugin("_cov"), "cov_controller", None)
    if controller is None or not controller.started:
        yield
        return
    key = fixture_key(fixturedef)
    if os.environ.get(CONTEXTS_RUN) == "1":
        nodeid = _running.get("nodeid", "")
        before = controller.cov.switch_context(f"{nodeid}|{FIXTURE}{key}")
        try:
            yield
        finally:
            controller.cov.switch_context(before or f"{nodeid}|setup")
    elif key in untraced_fixtures():
        controller.pause()
        try:
            yield
        finally:
            controller.resume()
    else:
        yield


def pytest_collection_finish(session):
    # By now a process holds the long-lived objects of JAX, PyTorch, transformers and the
    # collected tests, and each full garbage collection walks them all. Frozen, they are left
    # out of every later collection; and with a larger first threshold the collector runs far
    # less often while tests trace programs (cyclic garbage is still collected).
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)

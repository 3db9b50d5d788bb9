"""Shared helpers of the layer and end-to-end benchmarks (docs/design.md, 'Where the
measurements live').

Everything here measures, nothing estimates: memory comes from XLA (``memory_analysis()`` of the
compiled executable and the allocator's ``memory_stats()``), FP8 GEMMs from the compiled HLO.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter

GIB = 1024**3
FP8_GEMM_TARGET = "__cublas$lt$matmul$f8"
# On the GPU JAX pre-allocates 75% of the card by default; the end-to-end step of a 7B model needs
# nearly all of it, so children run with a higher fraction (set before jax is imported).
MEM_FRACTION = "0.95"


def child_env() -> dict:
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MEM_FRACTION)
    env["PYTHONUNBUFFERED"] = "1"
    # Every mode compiles without XLA's Triton GEMM fusion, so that the FP8 GEMMs become cuBLASLt
    # FP8 GEMMs (coat_jax.fp8_ops.fp8_compiler_options); BF16 GEMMs go to cuBLAS either way.
    from coat_jax.fp8_ops import GPU_XLA_FLAGS

    if "xla_gpu_enable_triton_gemm" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + GPU_XLA_FLAGS).strip()
    return env


def git_commit() -> str | None:
    """The checkout's commit (short hash, ``+`` when tracked files have changes), or ``None``
    where the benchmarks run from a copy without git or its history."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if shutil.which("git") is None:
        return None
    head = subprocess.run(
        ["git", "-C", root, "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True
    )
    if head.returncode:
        return None
    dirty = subprocess.run(
        ["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return head.stdout.strip() + ("+" if dirty else "")


def environment() -> dict:
    """Device, JAX version, date and commit: what every published number is stamped with."""
    import jax

    dev = jax.devices()[0]
    return {
        "device": f"{dev.platform}:{getattr(dev, 'device_kind', '?')}",
        "jax": jax.__version__,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "host": platform.machine(),
    }


def parse_modes(text: str, valid) -> list[str]:
    """``--modes a,b`` -> ``["a", "b"]``, rejecting names not in ``valid``."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in valid]
    if bad or not modes:
        raise ValueError(f"--modes has {bad or modes}; valid: {list(valid)}")
    return modes


def command_line() -> str:
    return "python " + " ".join(shlex.quote(a) for a in sys.argv)


def memory_stats() -> dict:
    """The allocator's statistics of device 0 ({} where the backend keeps none, e.g. the CPU)."""
    import jax

    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        stats = None
    return dict(stats or {})


def compiled_memory(compiled) -> dict:
    """XLA's own account of one executable's device memory, in bytes.

    ``peak`` is arguments + outputs - aliased (donated) + temporaries: what the executable needs
    while it runs, the number the batch search compares with the device's ``bytes_limit``.
    """
    ma = compiled.memory_analysis()
    if ma is None:
        return {}
    out = {
        "argument": int(ma.argument_size_in_bytes),
        "output": int(ma.output_size_in_bytes),
        "alias": int(ma.alias_size_in_bytes),
        "temp": int(ma.temp_size_in_bytes),
        "generated_code": int(ma.generated_code_size_in_bytes),
    }
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    xla_peak = getattr(ma, "peak_memory_in_bytes", None)
    if xla_peak:
        out["xla_peak"] = int(xla_peak)
    return out


def custom_call_counts(hlo_text: str) -> dict:
    """How many custom calls of each target the optimized HLO holds (GEMMs, attention, ...)."""
    return dict(Counter(re.findall(r'custom_call_target="([^"]+)"', hlo_text)))


def hlo_op_counts(hlo_text: str) -> dict:
    """Kernel-level op counts of an optimized HLO module: fusions, custom calls, while loops."""
    return {
        "fusion": len(re.findall(r"\bfusion\(", hlo_text)),
        "custom-call": len(re.findall(r"\bcustom-call\(", hlo_text)),
        "while": len(re.findall(r"\bwhile\(", hlo_text)),
    }


def fp8_gemm_count(hlo_text: str) -> int:
    return custom_call_counts(hlo_text).get(FP8_GEMM_TARGET, 0)


def time_fn(call, *, warmup: int, reps: int) -> dict:
    """Median / min / max seconds of ``call()`` (which must block until the device is done)."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "reps": reps,
    }


def time_pipelined(dispatch, fetch, *, warmup: int, reps: int) -> dict:
    """Seconds per step with one step in flight, as ``train.py``'s loop runs its steps.

    ``dispatch()`` starts a step and returns its handle; ``fetch(handle)`` waits for that step.
    Each iteration starts the next step, then waits for the previous one (``train.py``: the
    metrics of step ``k`` are fetched once step ``k + 1`` is queued), so the host's dispatch of
    a step overlaps the device's work on the one before. The times are the intervals between
    the instants consecutive steps are seen done (how ``train.py`` times its tokens/s).
    """
    pending = dispatch()
    seen = []
    for _ in range(warmup + reps + 1):
        following = dispatch()
        fetch(pending)
        seen.append(time.perf_counter())
        pending = following
    fetch(pending)
    times = [b - a for a, b in zip(seen[warmup:-1], seen[warmup + 1 :], strict=True)]
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "reps": reps,
    }


def append_jsonl(path: str, record: dict) -> None:
    """Appends one record and flushes it, so a run killed at its time limit keeps what it had."""
    with open(path, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def write_results(out: str | None, records: list[dict], title: str, text: str) -> None:
    """Writes ``OUT.jsonl`` (one record per line) and ``OUT.md`` (``# title`` then ``text``);
    nothing when ``out`` is ``None``."""
    if not out:
        return
    write_jsonl(out, records)
    with open(out + ".md", "w") as f:
        f.write(f"# {title}\n\n{text}\n")


def write_jsonl(out: str | None, records: list[dict]) -> None:
    """Writes ``OUT.jsonl``, one record per line; nothing when ``out`` is ``None``."""
    if not out:
        return
    with open(out + ".jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def rendered(name: str, body: str) -> str:
    """``body`` as the rendered block ``name`` of a page (benchmarks/render.py re-renders it)."""
    return f"<!-- rendered: {name} -->\n{body}<!-- end rendered -->\n"


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_child(args: list[str], *, timeout_s: float, log_path: str | None) -> int:
    """Runs ``python <args>`` in a fresh process (clean allocator statistics); returns its rc.

    Its output goes to the terminal and, when given, to ``log_path``.
    """
    cmd = [sys.executable, *args]
    print(f"[child] {' '.join(shlex.quote(a) for a in cmd)}", flush=True)
    log = open(log_path, "a") if log_path else None  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        cmd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )

    def pump():
        # A thread, so that a child silent for minutes (compiling) still meets its deadline.
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if log:
                log.write(line)
                log.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
        print(f"[child] killed after {timeout_s:.0f} s", flush=True)
        rc = 124
    reader.join(timeout=5)
    if log:
        log.close()
    return rc


def gib(n: float | None) -> str:
    """Bytes in GiB to two places, truncated (never rounded up)."""
    return "n/a" if n is None else f"{math.floor(n / GIB * 100) / 100:.2f}"


def truncated(x: float, places: int = 3) -> str:
    """``x`` to ``places`` decimals, truncated: a published figure is never rounded up."""
    return f"{math.floor(x * 10**places) / 10**places:.{places}f}"


def times(x: float, places: int = 3) -> str:
    """A ratio to ``places`` decimals, truncated: a published ratio is never rounded up."""
    return truncated(x, places) + "x"


def ratio(a: float | None, b: float | None) -> str:
    """``a / b`` as :func:`times` writes it."""
    if not a or not b:
        return "n/a"
    return times(a / b)

"""Runs a snippet in a fresh Python with several fake CPU devices.

``--xla_force_host_platform_device_count`` only takes effect before JAX starts, so tests that
need a mesh run their code in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)


def xla_flags(devices: int, *more: str) -> str:
    """``XLA_FLAGS`` for a child process with ``devices`` CPU devices, keeping the test run's flags
    (the test compile settings of conftest.py)."""
    flags = [os.environ.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count={devices}"]
    return " ".join(f for f in [*flags, *more] if f)


def run_on_fake_devices(code: str, *, devices: int = 8, timeout: int = 300) -> str:
    """Runs ``code`` with ``devices`` CPU devices; returns its stdout, failing on a non-zero rc."""
    env = dict(os.environ, XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout

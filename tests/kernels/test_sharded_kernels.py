"""Runs tests/kernels/sharded_on_8_devices.py on 8 fake CPU devices in a subprocess.

``--xla_force_host_platform_device_count`` only takes effect before JAX starts, so those tests
cannot run in this process (which has already imported JAX with one device).
"""

import os
import subprocess
import sys
from pathlib import Path

from tests.fake_devices import xla_flags

ROOT = Path(__file__).resolve().parents[2]


def test_kernels_on_8_devices_equal_one_device():
    env = dict(
        os.environ,
        XLA_FLAGS=xla_flags(8),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT),
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/kernels/sharded_on_8_devices.py",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]

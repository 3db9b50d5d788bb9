"""Stopping a ``train.py`` child process the way a scheduler does, for the signal tests."""

from __future__ import annotations

import signal
import subprocess


def stop_with_sigterm(proc: subprocess.Popen, timeout: float = 120.0) -> str:
    """Sends SIGTERM to ``proc`` (text output piped), waits for it and returns its output, which
    must end with the exit status of a run stopped by SIGTERM (128 + 15). A child still running
    after ``timeout`` seconds is killed."""
    try:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, output
    return output

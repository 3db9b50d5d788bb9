"""One trainer per output directory: its lock file and its log file.

``<output_dir>/train.lock`` holds the owner's pid and host while a trainer runs there. It is
locked with ``flock``, which the kernel releases when the owner dies however it dies, so a lock
left by a killed trainer is taken over (and said so), while a second trainer started on a
directory in use is refused with the owner's pid. ``<output_dir>/train.log`` receives every
status line of the run, and its error line if it fails, from the moment the run is set up
(:meth:`RunDirectory.start_log`): a run refused before that (bad input, a checkpoint that does
not match) leaves the directory as it found it: its error line goes to stderr only, the lock
file is removed, and the directories it created for the run (``output_dir`` and its missing
parents) are removed again.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from coat_jax.training.errors import OutputDirInUseError

LOCK_NAME = "train.lock"
LOG_NAME = "train.log"


class RunDirectory:
    """The output directory of one running trainer (a context manager holding its lock).

    Examples:
      >>> with RunDirectory("runs/default") as run_dir:
      ...     run_dir.log("step 1: loss 5.5")
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()
        self.lock_path = self.path / LOCK_NAME
        self.log_path = self.path / LOG_NAME
        self.took_over: str | None = None
        self._fd: int | None = None
        self._log = None
        self._early: list[str] = []
        self._created: list[Path] = []

    def __enter__(self) -> RunDirectory:
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(
                f"output_dir {str(self.path)!r} is a file, not a directory; choose another "
                "output_dir"
            )
        self._created = [p for p in (self.path, *self.path.parents) if not p.exists()]
        self.path.mkdir(parents=True, exist_ok=True)
        self._fd = self._lock()
        return self

    def _lock(self) -> int:
        while True:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise OutputDirInUseError(
                    f"output_dir {str(self.path)!r} is in use by another trainer ({owner}, "
                    f"lock file {str(self.lock_path)!r}); wait for it to finish or stop it, or "
                    "choose another output_dir"
                ) from None
            except BaseException:
                os.close(fd)
                raise
            # The previous owner unlinks the file as it releases the lock: if that happened
            # between our open and flock, we hold a lock on a file nobody else will see.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.lock_path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            previous = os.pread(fd, 200, 0).decode(errors="replace").strip()
            if previous:
                self.took_over = previous
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
            return fd

    def log(self, line: str) -> None:
        """Appends a status line, with the time, to ``train.log`` (held back until
        :meth:`start_log`, and dropped if the run never gets that far)."""
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n"
        if self._log is None:
            self._early.append(line)
        else:
            self._log.write(line)

    def start_log(self) -> None:
        """Opens ``train.log`` (the run is set up) and writes the lines held back so far."""
        self._log = open(self.log_path, "a", buffering=1)
        self._log.writelines(self._early)
        self._early = []

    def __exit__(self, *exc) -> None:
        started = self._log is not None
        if started:
            self._log.close()
            self._log = None
        if self._fd is not None:
            # Unlinked while still locked, so no newcomer locks this file after we let go.
            self.lock_path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None
        if not started:
            # A run that never got set up leaves no directory it made (deepest first).
            for path in self._created:
                try:
                    path.rmdir()
                except OSError:
                    break

"""How the trainer fails: the errors a user can cause, their one-line form and exit codes.

``train.py`` turns every error below into one line ``error: <what>; <what to do>`` on stderr
(and in the run's ``train.log``) and an exit code, never a traceback:

- 2: bad input or a run that cannot go on (``ValueError`` and its subclasses such as
  :class:`~coat_jax.training.checkpoint.CheckpointError`, ``OSError``);
- 3: a diverged run (:class:`DivergedError`, any ``FloatingPointError``);
- 130: interrupted by a second Ctrl-C or SIGTERM (``KeyboardInterrupt``).

Anything else is a bug in coat_jax and keeps its traceback.
"""

from __future__ import annotations

EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_INTERRUPTED = 130

INTERRUPTED = (
    "interrupted (a second Ctrl-C or SIGTERM) before the run could save; the checkpoints "
    "already written are intact; continue with resume=true"
)


class DivergedError(FloatingPointError):
    """The loss, the gradient or the state became non-finite; nothing non-finite was saved."""


class OutputDirInUseError(ValueError):
    """Another live trainer holds the output directory's lock file."""


def exit_code(error: BaseException) -> int | None:
    """``train.py``'s exit code for ``error``; None for an error that is a bug (traceback)."""
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(error, FloatingPointError):
        return EXIT_DIVERGED
    if isinstance(error, ValueError | OSError):
        return EXIT_BAD_INPUT
    return None


def error_line(error: BaseException) -> str:
    """``error: ...`` for a user-facing error: its message, prefixed by its class when that is
    coat_jax's own (``CheckpointError: ...``), which says which part of the run refused."""
    if isinstance(error, KeyboardInterrupt):
        return f"error: {INTERRUPTED}"
    if type(error).__module__ == "builtins":
        if isinstance(error, OSError) and error.filename is not None:
            what = f"{error.strerror or error} ({error.filename})"
            return f"error: {what}; check that path, its permissions and its free space"
        return f"error: {error}"
    return f"error: {type(error).__name__}: {error}"

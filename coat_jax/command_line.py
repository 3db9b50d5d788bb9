"""What the library's command lines share: usage and input errors as one line, exit code 2.

``python -m coat_jax.convert`` and ``python -m coat_jax.generate`` parse their arguments with
:class:`ErrorParser` and print a bad input's error with :func:`one_line_error`, so either
answers a mistake with ``error: <what>; <what to do>`` and never a traceback.
"""

from __future__ import annotations

import argparse


class ErrorParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line, ``error: <what>; <what to do>``."""

    def error(self, message):
        self.exit(2, f"error: {message}; see {self.prog} --help\n")


def one_line_error(error: Exception, advice: str) -> str:
    """``error: <what>; <what to do>`` on one line; `advice` when the message has none."""
    message = "; ".join(part.strip() for part in str(error).splitlines() if part.strip())
    if ";" not in message:
        message = f"{message}; {advice}"
    return f"error: {message}"

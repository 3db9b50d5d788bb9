"""Coverage's tracer stopped around code that runs none of the library's lines.

Under coverage (CI's ``--cov``) the tracer slows every Python line, the library's or not: JAX
lowering a program, transformers loading a reference model. What runs with the tracer stopped
must never reach coat_jax or pallas_kernels, or the coverage report would miss those lines.
"""

from __future__ import annotations

import contextlib
import functools
import sys


@contextlib.contextmanager
def untraced():
    """The block runs with this thread's coverage tracer stopped (restarted after it, also on an
    exception); without coverage, or while it is paused already, it does nothing."""
    tracer = sys.gettrace()
    if type(tracer).__name__ != "CTracer":
        yield
        return
    tracer.stop()
    try:
        yield
    finally:
        tracer.start()


def without_tracer(fn):
    """``fn``, run :func:`untraced`."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with untraced():
            return fn(*args, **kwargs)

    return wrapper

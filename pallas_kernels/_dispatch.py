"""The ``implementation`` switch every kernel entry point shares."""

from __future__ import annotations

import jax

IMPLEMENTATIONS = ("auto", "xla", "pallas")


def check_implementation(implementation: str) -> str:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"unknown implementation {implementation!r}; valid values are {list(IMPLEMENTATIONS)}"
        )
    return implementation


def resolve_implementation(implementation: str) -> str:
    """``"auto"`` -> ``"pallas"`` on a single-GPU process, ``"xla"`` elsewhere.

    A ``pallas_call`` has no SPMD partitioning rule: on operands sharded over several devices XLA
    would gather them whole onto every device. Until the kernels carry a partitioning rule
    (``custom_partitioning`` or a ``shard_map`` wrapper), ``"auto"`` keeps multi-device programs on
    the XLA path, which partitions like any jnp code. ``"pallas"`` forces the kernel anyway.
    """
    if check_implementation(implementation) == "auto":
        single_gpu = jax.default_backend() == "gpu" and jax.device_count() == 1
        return "pallas" if single_gpu else "xla"
    return implementation

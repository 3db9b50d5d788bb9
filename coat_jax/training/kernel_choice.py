"""``kernels``: where the trainer's kernels run, one choice for all or a mapping part by part.

``kernels: auto``, ``xla`` or ``pallas`` picks for every kernel (``auto``: the Pallas kernels on
a GPU, per shard on a mesh, the FP8 activation ops by the run's shape; plain jnp elsewhere). A
mapping picks part by part, each part it leaves out taking ``auto``:

- ``optimizer``: coat_adamw's fused step;
- ``fp8_ops``: the FP8 activation ops (quantizers and fused non-linear ops); left out, they
  follow the run's shape (``coat_jax.training.optimizers.fp8_ops_auto``);
- an op of :data:`coat_jax.fp8_ops.KERNEL_OPS` (``swiglu``, ``rmsnorm``, ...): that FP8 op alone
  (``FP8Config.op_implementations``; docs/bench_fp8_kernels.md has the measurements).

The config field holds the name, or the mapping as ``(part, implementation)`` pairs (a frozen
config is hashable); ``kernels.PART=IMPL`` on the command line, or a mapping in a file over a
``base:`` file's setting, changes one part and keeps the others.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from coat_jax.fp8_ops import KERNEL_OPS

IMPLEMENTATIONS = ("auto", "xla", "pallas")
PARTS = ("optimizer", "fp8_ops", *KERNEL_OPS)
Kernels = str | tuple[tuple[str, str], ...]


def check_kernels(value: Any) -> Kernels:
    """``kernels`` as a config gives it (a name or a mapping), checked and in its stored form."""
    if isinstance(value, str) and value in IMPLEMENTATIONS:
        return value
    if not isinstance(value, Mapping):
        raise ValueError(
            f"kernels={value!r} is not valid; choose one of {list(IMPLEMENTATIONS)} or a mapping "
            "{part: implementation}, e.g. kernels: {fp8_ops: xla, swiglu: pallas}"
        )
    for part, implementation in value.items():
        if part not in PARTS:
            raise ValueError(f"kernels.{part} is not a part; the parts are {list(PARTS)}")
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"kernels.{part}={implementation!r} is not valid; choose one of "
                f"{list(IMPLEMENTATIONS)}"
            )
    return tuple((part, value[part]) for part in PARTS if part in value)


def kernels_mapping(value: Kernels) -> dict[str, str]:
    """``kernels`` as its mapping: a name picks ``optimizer`` and (other than ``auto``, which
    leaves them to the run's shape) ``fp8_ops``."""
    if isinstance(value, str):
        value = check_kernels(value)
        return {} if value == "auto" else {"optimizer": value, "fp8_ops": value}
    return dict(value)


def to_yaml(value: Kernels) -> str | dict[str, str]:
    """``kernels`` as a config file writes it."""
    return value if isinstance(value, str) else dict(value)


def op_implementations(value: Kernels) -> tuple[tuple[str, str], ...]:
    """The per-op parts of ``kernels`` as ``FP8Config.op_implementations``."""
    mapping = kernels_mapping(value)
    return tuple((op, mapping[op]) for op in KERNEL_OPS if op in mapping)


def names_fp8_ops(value: Kernels) -> bool:
    """Whether ``kernels`` picks for the FP8 activation ops in particular."""
    return isinstance(value, tuple) and any(part != "optimizer" for part, _ in value)

"""Reading jaxprs in tests: their equations, recursively, and which Pallas kernels they call."""

from __future__ import annotations

from collections.abc import Iterator


def _subjaxprs(eqn) -> Iterator:
    """The jaxprs an equation holds in its parameters (a scan's body, a cond's branches, ...)."""
    for value in eqn.params.values():
        for sub in value if isinstance(value, (list, tuple)) else (value,):
            sub = getattr(sub, "jaxpr", sub)
            if hasattr(sub, "eqns"):
                yield sub


def equations(jaxpr) -> Iterator:
    """Every equation of ``jaxpr`` and of the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _subjaxprs(eqn):
            yield from equations(sub)


def pallas_calls(jaxpr, inside: bool = False) -> list[tuple[str, bool]]:
    """``(kernel name, inside a shard_map)`` of every ``pallas_call`` in a jaxpr, recursively."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            # "name" in JAX 0.10, "name_and_src_info" in later releases.
            name = eqn.params.get("name_and_src_info", eqn.params.get("name"))
            found.append((getattr(name, "name", str(name)), inside))
        for sub in _subjaxprs(eqn):
            found += pallas_calls(sub, inside or eqn.primitive.name == "shard_map")
    return found

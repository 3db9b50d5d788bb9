"""Reading jaxprs in tests: which Pallas kernels a program calls."""

from __future__ import annotations


def pallas_calls(jaxpr, inside: bool = False) -> list[tuple[str, bool]]:
    """``(kernel name, inside a shard_map)`` of every ``pallas_call`` in a jaxpr, recursively."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            # "name" in JAX 0.10, "name_and_src_info" in later releases.
            name = eqn.params.get("name_and_src_info", eqn.params.get("name"))
            found.append((getattr(name, "name", str(name)), inside))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    found += pallas_calls(sub, inside or eqn.primitive.name == "shard_map")
    return found

"""Arrays committed to the default device, as a jitted step's outputs are.

A jitted function compiles once per placement of its arguments: arrays made eagerly (an
optimizer's ``init``, ``jax.random``) are uncommitted, the step's outputs committed, so a loop
that starts from eager arrays compiles its step twice. Tests that loop start from
:func:`committed` arrays and compile it once.
"""

from __future__ import annotations

import jax


def committed(tree):
    """``tree``'s arrays committed to the default device (the values unchanged)."""
    return jax.device_put(tree, jax.devices()[0])

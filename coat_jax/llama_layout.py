"""The two layouts of a Llama parameter tree: unrolled (``layers`` = ``{0: ..., 1: ...}``) and
scanned (``layers`` holds each parameter stacked on a leading layer axis), and conversions
between them for the parameters and for any tree that mirrors them (optimizer states).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np


def is_stacked(params: Mapping) -> bool:
    """True for a pure-dict parameter tree in the scanned layout (stacked `layers`)."""
    layers = params.get("layers")
    if not isinstance(layers, Mapping) or not layers:
        raise ValueError("not a Llama parameter tree: it has no 'layers' entry")
    int_keys = [isinstance(k, (int, np.integer)) for k in layers]
    if all(int_keys):
        return False
    if any(int_keys):
        raise ValueError(f"'layers' mixes layer indices and names: {sorted(map(str, layers))}")
    return True


def stack_layers(params: Mapping) -> dict:
    """Unrolled pure-dict parameters (`layers` = {0: ..., 1: ...}) -> the scanned layout.

    Works on any tree that mirrors the parameters (optimizer moments, FP8 codes and per-group
    statistics: their last axis is untouched, so groups stay the same). Identity on a tree
    that is already stacked.
    """
    if is_stacked(params):
        return dict(params)
    layers = params["layers"]
    per_layer = [layers[i] for i in sorted(layers)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs) if _is_array(xs[0]) else xs[0], *per_layer)
    return {**params, "layers": stacked}


def unstack_layers(params: Mapping) -> dict:
    """The scanned layout -> unrolled pure-dict parameters; identity on an unrolled tree."""
    if not is_stacked(params):
        return dict(params)
    stacked = params["layers"]
    arrays = [a for a in jax.tree.leaves(stacked) if _is_array(a)]
    if not arrays:
        raise ValueError("stacked 'layers' hold no arrays")
    n = arrays[0].shape[0]
    layers = {
        i: jax.tree.map(lambda a, i=i: a[i] if _is_array(a) else a, stacked) for i in range(n)
    }
    return {**params, "layers": layers}


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def relayout(tree, *, scan_layers: bool):
    """Every parameter-mirroring dict in ``tree`` (one with a ``layers`` entry) in one layout.

    ``tree`` may be the parameters, an optimizer state holding trees like them (optax's
    ``mu``/``nu``, coat_adamw's FP8 codes and per-group statistics) or a dict of both;
    everything else passes through unchanged. An FP8 state relayouts into the state its
    optimizer makes of the other layout when that optimizer groups each layer apart
    (``stacked_axes=``:func:`stacked_layer_axes`, as the trainer's do).
    """
    convert = stack_layers if scan_layers else unstack_layers
    is_params = lambda x: isinstance(x, Mapping) and "layers" in x and "embed_tokens" in x
    return jax.tree.map(lambda x: convert(x) if is_params(x) else x, tree, is_leaf=is_params)


def is_stacked_layer(path) -> bool:
    """Whether a parameter at key ``path`` is a leaf of the scanned layout's ``layers`` (its
    leading axis is the layer index): the layout rule the FSDP sharding and the optimizer's
    kernels take from the model (``pallas_kernels.sharding.fsdp_param_spec(is_stacked=...)``)."""
    keys = [getattr(k, "key", None) for k in path]
    return len(keys) > 1 and keys[0] == "layers" and not isinstance(keys[1], int)


def stacked_layer_axes(params):
    """Per parameter, its number of stacked layer axes: 1 for a leaf of the scanned layout's
    ``layers`` (:func:`is_stacked_layer`), 0 elsewhere. The FP8 optimizers' ``stacked_axes``
    (``coat_jax.coat_adamw``, ``coat_jax.fp8_state``): each layer's state is then grouped as the
    layer's alone, so the stacked state equals the unrolled layers' stacked, and a per-layer
    update of it (``optimizer_in_backward``) equals the update of the whole."""
    return jax.tree_util.tree_map_with_path(lambda path, _: int(is_stacked_layer(path)), params)

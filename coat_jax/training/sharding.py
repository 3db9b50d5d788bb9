"""Device mesh and FSDP-style shardings for parameters and (FP8) optimizer state.

The mesh has axes ``("data", "fsdp")``. Batches are split over both axes; each parameter is
split over ``fsdp`` along its largest axis that ``fsdp`` divides into whole quantization groups
(the first such axis on ties, so square matrices split rows and their per-group statistics can
follow), and replicated over ``data``. The last axis, along which COAT groups its 128 values,
only counts when each shard holds whole groups (``(n / fsdp) % 128 == 0``): every group then
lies on one device and the fused optimizer step runs on each shard as it is stored, with no
communication at all. A parameter with no such axis is replicated. An optimizer-state leaf
follows the parameter it belongs to: a leaf of the parameter's rank (FP8 codes, shape
``p.shape``; per-group statistics, ``p.shape[:-1] + (groups,)``) takes the parameter's spec with
any axis the leaf's size there does not divide left unsplit; other leaves (step counts,
scalars) are replicated. On one device every spec is trivially replicated.

With several processes (``coat_jax.training.distributed``) the mesh spans every process's
devices and :func:`put_rows` builds each global batch from the rows the process's own devices
hold, reading no other.
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from coat_jax import state_codec
from coat_jax.llama_layout import is_stacked_layer

# The FSDP rule lives with the kernels that run on its shards; the model says which of its
# parameters are stacked layers.
from pallas_kernels.sharding import (  # noqa: F401 - public here too
    GROUP_SIZE,
    fsdp_param_shardings,
    fsdp_param_spec,
    fsdp_spec,
)

AXES = ("data", "fsdp")
BATCH_AXES = AXES


def param_spec(path, shape: tuple[int, ...], fsdp_size: int) -> PartitionSpec:
    """The FSDP spec of the Llama parameter at ``path`` (:func:`~pallas_kernels.sharding.
    fsdp_param_spec` with the model's :func:`~coat_jax.llama_layout.is_stacked_layer`)."""
    return fsdp_param_spec(path, shape, fsdp_size, is_stacked=is_stacked_layer)


def param_shardings(abstract_params, mesh: Mesh):
    """Each Llama parameter's ``NamedSharding`` on ``mesh`` under the FSDP rule."""
    return fsdp_param_shardings(abstract_params, mesh, is_stacked=is_stacked_layer)


def make_mesh(data: int, fsdp: int, devices=None) -> Mesh:
    """A ``(data, fsdp)`` mesh; a size of -1 takes all devices the other axis leaves."""
    devices = jax.devices() if devices is None else devices
    n = len(devices)
    if data == -1:
        if n % fsdp:
            raise ValueError(f"mesh.fsdp={fsdp} does not divide the {n} available devices")
        data = n // fsdp
    if fsdp == -1:
        if n % data:
            raise ValueError(f"mesh.data={data} does not divide the {n} available devices")
        fsdp = n // data
    if data * fsdp > n:
        raise ValueError(
            f"mesh data={data} x fsdp={fsdp} needs {data * fsdp} devices, only {n} available"
        )
    return Mesh(np.asarray(devices[: data * fsdp]).reshape(data, fsdp), AXES)


def _follow(spec: PartitionSpec, param_shape, leaf_shape, mesh: Mesh) -> PartitionSpec:
    if len(leaf_shape) != len(param_shape):
        return PartitionSpec()
    if tuple(leaf_shape) != tuple(param_shape) and 0 not in leaf_shape:
        # Per-group statistics have the shape of the parameter's group view, counted in groups.
        view = state_codec.view_of(param_shape, leaf_shape)
        spec = state_codec.view_spec(spec, param_shape, view)
    entries = list(spec) + [None] * (len(leaf_shape) - len(spec))
    for i, name in enumerate(entries):
        if name is not None and leaf_shape[i] % mesh.shape[name]:
            entries[i] = None
    return PartitionSpec(*entries)


def state_shardings(abstract_opt_state, abstract_params, mesh: Mesh):
    """Shardings for an optimizer state whose param-like leaves sit at the params' key paths.

    Optax states (``ScaleByAdamState``, ``ScaleByCoatAdamState``, ``MaskedState``, chains) hold
    trees mirroring the params, so a leaf belongs to the parameter whose full key path ends its
    own key path.
    """
    fsdp = mesh.shape["fsdp"]
    by_path = {
        tuple(path): p for path, p in jax.tree_util.tree_flatten_with_path(abstract_params)[0]
    }
    longest = max((len(k) for k in by_path), default=0)

    def shard(path, leaf):
        for n in range(min(longest, len(path)), 0, -1):
            param_path = tuple(path[-n:])
            param = by_path.get(param_path)
            if param is not None:
                spec = param_spec(param_path, param.shape, fsdp)
                spec = _follow(spec, param.shape, leaf.shape, mesh)
                return NamedSharding(mesh, spec)
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree_util.tree_map_with_path(shard, abstract_opt_state)


def batch_sharding(mesh: Mesh, *, batch_axis: int, rank: int) -> NamedSharding:
    """Splits the batch axis of a token array over every mesh device."""
    spec = [None] * rank
    spec[batch_axis] = BATCH_AXES
    return NamedSharding(mesh, PartitionSpec(*spec))


def batch_rows(shape: tuple[int, ...], sharding: NamedSharding, devices) -> np.ndarray:
    """The rows of a global batch of ``shape`` (a row: an index over every axis but the last,
    flattened) that ``devices`` hold when it is placed as ``sharding``; sorted, each once."""
    flat = np.arange(math.prod(shape[:-1])).reshape(shape[:-1])
    held = sharding.devices_indices_map(shape)
    return np.unique(np.concatenate([flat[held[d][:-1]].ravel() for d in devices]))


def put_rows(read, shape: tuple[int, ...], sharding: NamedSharding) -> jax.Array:
    """A global batch of ``shape`` placed as ``sharding``, of which this process reads only the
    rows its own devices hold. ``read(rows)`` gives the rows ``rows`` (flattened indices over
    every axis but the last) as ``[len(rows), shape[-1]]``.

    With one process this is ``jax.device_put`` of every row. With several, each process reads
    and transfers only its own rows (``jax.make_array_from_callback``), and nothing checks that
    the processes agree: they do by construction, since the data order is a pure function of the
    seed and the data position (``coat_jax.training.data.TrainOrder``). ``jax.device_put`` of a
    host array onto devices of other processes would compare the whole batch across processes
    at every step first.
    """
    rows = math.prod(shape[:-1])
    if jax.process_count() == 1:
        return jax.device_put(read(np.arange(rows)).reshape(shape), sharding)
    mine, flat = _own_rows(shape, sharding)
    local = read(mine)
    return jax.make_array_from_callback(
        shape, sharding, lambda index: local[flat[index[:-1]]][..., index[-1]]
    )


@functools.lru_cache(maxsize=8)
def _own_rows(shape: tuple[int, ...], sharding: NamedSharding) -> tuple[np.ndarray, np.ndarray]:
    """This process's rows of a batch of ``shape`` (:func:`batch_rows`) and, over every axis but
    the last, each row's position among them (-1: another process's): the same every step."""
    mine = batch_rows(shape, sharding, sharding.addressable_devices)
    where = np.full(math.prod(shape[:-1]), -1, dtype=np.int64)
    where[mine] = np.arange(len(mine))
    return mine, where.reshape(shape[:-1])


def check_batch_divisible(batch_size: int, mesh: Mesh) -> None:
    ways = math.prod(mesh.shape[a] for a in BATCH_AXES)
    if batch_size % ways:
        raise ValueError(
            f"data.batch_size={batch_size} must be a multiple of the mesh's data x fsdp = {ways} "
            "devices (each device takes an equal share of every batch)"
        )

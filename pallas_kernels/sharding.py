"""Pallas kernels on sharded operands: each device runs the kernel on its own shard.

A ``pallas_call`` has no SPMD partitioning rule: XLA would gather sharded operands whole onto
every device. The kernels here all work per element or per group, so given where the operands
live they run unchanged on each shard inside ``jax.shard_map``; what needs the whole tensor is one
small collective (a per-tensor scale's maximum, a weight gradient's sum over the batch).

Where the operands live is told, not guessed: inside ``jit`` the arrays are tracers whose
sharding XLA decides later (outside explicit-sharding mode), so

* the FP8 activation ops take a :class:`KernelMesh` (``FP8Config(mesh=...)``): activations are
  split along their leading (batch) axis over ``batch_axes`` and replicated over the other mesh
  axes; weights are split by the FSDP rule of :func:`fsdp_spec` (the trainer's layout) over
  ``param_axis``;
* the optimizer takes ``mesh=`` and, per parameter, a ``PartitionSpec``, and
  :func:`group_aligned_spec` adapts any spec to the quantization groups.

The trainer (``coat_jax.training``) passes its ``(data, fsdp)`` mesh to both whenever the
process has several devices; docs/sharding.md describes the whole layout. The FSDP rule for a
tree of parameters (:func:`fsdp_param_shardings`) lives here too, so that the optimizer's specs
and the trainer's shardings come from one rule and neither imports the other (docs/design.md,
'Layers'); which parameters are stacks of layers is the model's rule, passed in as
``is_stacked``.

A shape the sharded kernel cannot take (a batch axis the batch devices do not divide) raises
``NotImplementedError``, so ``implementation="auto"`` falls back to the XLA reference, which XLA
partitions like any jnp code.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def shard_map(fn, mesh: Mesh, in_specs, out_specs):
    """``jax.shard_map`` without replication checks (``pallas_call`` has no rule for them).

    ``jax.shard_map`` exists from JAX 0.6; older releases have ``jax.experimental.shard_map``.
    """
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as experimental_shard_map

    return experimental_shard_map(fn, mesh, in_specs, out_specs, check_rep=False)


def spec_axes(spec: PartitionSpec) -> tuple[str, ...]:
    """The mesh axes a ``PartitionSpec`` splits over, in order."""
    names = []
    for entry in spec:
        for name in entry if isinstance(entry, tuple) else (entry,):
            if name is not None:
                names.append(name)
    return tuple(names)


def _ways(mesh: Mesh, entry) -> int:
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[n] for n in names if n is not None)


def check_spec(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh, what: str) -> None:
    """``ValueError`` unless ``spec`` names mesh axes and divides ``shape`` evenly."""
    if not isinstance(spec, PartitionSpec):
        raise ValueError(f"{what}: expected a jax.sharding.PartitionSpec, got {spec!r}")
    if len(spec) > len(shape):
        raise ValueError(f"{what}: spec {spec} has more entries than shape {shape} has axes")
    unknown = [n for n in spec_axes(spec) if n not in mesh.axis_names]
    if unknown:
        raise ValueError(
            f"{what}: spec {spec} names mesh axes {unknown} that the mesh {dict(mesh.shape)} lacks"
        )
    for size, entry in zip(shape, spec, strict=False):
        if size % _ways(mesh, entry):
            raise ValueError(
                f"{what}: spec {spec} splits an axis of size {size} of shape {shape} "
                f"{_ways(mesh, entry)} ways, which does not divide it; pass a spec that divides "
                "every split axis"
            )


def group_aligned_spec(
    spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh, group_size: int
) -> PartitionSpec:
    """The spec the per-group optimizer kernel runs under for a parameter stored as ``spec``.

    Quantization groups run along the last axis, so a split of the last axis must fall on group
    boundaries (each shard's length a multiple of ``group_size``). The trainer's FSDP rule only
    makes such splits, so its specs come back unchanged. Where a spec of the caller's does not
    (Llama-2-7B's ``[4096, 11008]`` gate and up projections split 8 ways along columns: 1376 per
    shard, 10.75 groups), the last axis's mesh axes move to the largest other unsplit axis they
    divide, so XLA re-lays the shard out with an all-to-all (no device holds more than its
    share); if there is none, the last axis is replicated (an all-gather of that one parameter,
    done by XLA).
    """
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if not entries or entries[-1] is None:
        return PartitionSpec(*entries)
    ways = _ways(mesh, entries[-1])
    if (shape[-1] // ways) % group_size == 0:
        return PartitionSpec(*entries)
    last, entries[-1] = entries[-1], None
    free = [i for i in range(len(shape) - 1) if entries[i] is None and shape[i] % ways == 0]
    if free:
        entries[max(free, key=lambda i: (shape[i], -i))] = last
    return PartitionSpec(*entries)


def rows_keep_groups(last: int, group_size: int) -> bool:
    """Whether rows of ``last`` values keep their own quantization groups (the optimizer's group
    view, ``coat_jax.state_codec.group_view``): they fill at least three quarters of them, which
    bounds the padding of each row's last group. Narrower rows are grouped over a flatten.

    Examples:
      >>> rows_keep_groups(11008, 128), rows_keep_groups(1000, 128), rows_keep_groups(129, 128)
      (True, True, False)
    """
    return 3 * -(-last // group_size) * group_size <= 4 * last


def view_spec(spec: PartitionSpec, shape: tuple[int, ...], view: tuple[int, ...]) -> PartitionSpec:
    """The ``PartitionSpec`` of a tensor of ``shape`` split as ``spec``, for ``view``: a reshape
    of it of the same rank that flattens trailing axes into the last (a group view,
    ``coat_jax.state_codec.group_view``, whose last axis the optimizer's groups run along).

    The leading axes keep their splits; the flattened axis takes the split of the one flattened
    axis that is split (of the first, each shard already holds a contiguous block of it; of a
    later one, XLA re-lays the shards out, as :func:`group_aligned_spec` does), and is
    replicated where several are.

    Examples:
      >>> view_spec(PartitionSpec("fsdp", None), (512, 5), (1, 2560))
      P(None, 'fsdp')
    """
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if tuple(view) == tuple(shape):
        return PartitionSpec(*entries)
    lead = 0
    while shape[lead] == view[lead]:
        lead += 1
    split = [e for e in entries[lead:] if e is not None]
    last = split[0] if len(split) == 1 else None
    return PartitionSpec(*entries[:lead], *[None] * (len(view) - lead - 1), last)


@dataclasses.dataclass(frozen=True)
class KernelMesh:
    """Where the FP8 activation kernels' operands live (static and hashable, for ``FP8Config``).

    Attributes:
      mesh: the device mesh of the program (``coat_jax.training.sharding.make_mesh``).
      batch_axes: mesh axes the activations' leading (batch) axis is split over; the other mesh
        axes hold replicas. The trainer splits batches over ``("data", "fsdp")``.
      param_axis: mesh axis the weights are split over by the FSDP rule (``fsdp_spec``), or
        ``None`` for replicated weights.

    Example (the FP8 ops take it as ``coat_jax.FP8Config(mesh=KernelMesh(mesh))``):
      >>> n = len(jax.devices())
      >>> kmesh = KernelMesh(jax.make_mesh((1, n), ("data", "fsdp")))
      >>> kmesh.activation_spec((4 * n, 2048, 4096))
      P(('data', 'fsdp'),)
    """

    mesh: Mesh
    batch_axes: tuple[str, ...] = ("data", "fsdp")
    param_axis: str | None = "fsdp"

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh):
            raise TypeError(f"KernelMesh.mesh must be a jax.sharding.Mesh, got {self.mesh!r}")
        axes = (self.batch_axes,) if isinstance(self.batch_axes, str) else tuple(self.batch_axes)
        object.__setattr__(self, "batch_axes", axes)
        for name in (*axes, *([self.param_axis] if self.param_axis else [])):
            if name not in self.mesh.axis_names:
                raise ValueError(
                    f"KernelMesh: axis {name!r} is not a mesh axis; the mesh has "
                    f"{list(self.mesh.axis_names)}"
                )

    @property
    def batch_ways(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.batch_axes)

    def activation_spec(self, shape: tuple[int, ...]) -> PartitionSpec:
        """The leading axis split over the batch axes; ``NotImplementedError`` if it does not
        divide (then ``"auto"`` uses the XLA reference)."""
        if len(shape) < 2 or shape[0] % self.batch_ways:
            raise NotImplementedError(
                f"on the kernel mesh an activation of shape {tuple(shape)} needs a leading batch "
                f"axis that the {self.batch_ways} devices of batch_axes {self.batch_axes} divide"
            )
        return PartitionSpec(self.batch_axes)

    def param_spec(self, shape: tuple[int, ...]) -> PartitionSpec:
        """A weight's spec by the trainer's FSDP rule (:func:`fsdp_spec`) over ``param_axis``."""
        if self.param_axis is None:
            return PartitionSpec()
        return fsdp_rule(shape, self.mesh, self.param_axis)

    def gathered(self, x: jax.Array) -> jax.Array:
        """``x`` whole on every device: FSDP's all-gather of a weight, at this point.

        Applied to a weight's FP8 codes as they come out of the per-shard quantizer, it makes
        XLA all-gather the codes, 1 byte a value. Left to itself the partitioner gathers the
        GEMM operand that the codes are converted to instead (8 CPU devices, the tiny Llama's
        train step: every weight gathered as float32), and that all-gather then sits between
        ``convert(codes)`` and the dot, where XLA's FP8 GEMM rewriter looks for the FP8 codes
        (docs/fp8_gemm.md).
        """
        return lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec()))


# COAT's quantization group (coat_jax.optim.DEFAULT_GROUP_SIZE, coat_jax.fp8_state's default):
# a split of the last axis keeps whole groups per shard.
GROUP_SIZE = 128


def fsdp_spec(
    shape: tuple[int, ...], fsdp_size: int, group_size: int = GROUP_SIZE
) -> PartitionSpec:
    """Splits the largest axis ``fsdp_size`` divides into whole groups; else replicates.

    An axis other than the last qualifies when ``fsdp_size`` divides it; the last axis (the one
    quantization groups of ``group_size`` values run along) only when each shard's length is a
    multiple of ``group_size``. Where rows do not keep their own groups (:func:`rows_keep_groups`)
    the groups run over the flatten, and only its first axis of more than one value qualifies,
    when each shard's block of the flatten holds whole groups. Llama-2-7B on 8 devices: the
    ``[4096, 11008]`` gate and up projections split rows (11008 / 8 = 1376 columns would be
    10.75 groups), the ``[11008, 4096]`` down projection rows too (largest axis), the
    ``[4096, 32000]`` LM head rows (4000 columns: 31.25 groups). Ties go to the earliest axis.

    Examples:
      >>> fsdp_spec((4096, 11008), 8)
      P('fsdp', None)
      >>> fsdp_spec((64,), 4)  # 16 values per shard: not a whole group
      P()
    """
    if fsdp_size == 1 or not shape:
        return PartitionSpec()
    last = len(shape) - 1
    # Groups run over the flatten where rows do not keep their own (rows_keep_groups): only a
    # split of its first axis of more than one value keeps contiguous blocks of it, whose
    # length must hold whole groups.
    flat = len(shape) > 1 and not rows_keep_groups(shape[-1], group_size)
    first = next((i for i, d in enumerate(shape) if d > 1), 0)
    candidates = [
        i
        for i, d in enumerate(shape)
        if d % fsdp_size == 0
        and (i < last or (d // fsdp_size) % group_size == 0)
        and (
            not flat
            or (i == first and (d // fsdp_size) * math.prod(shape[i + 1 :]) % group_size == 0)
        )
    ]
    if not candidates:
        return PartitionSpec()
    axis = max(candidates, key=lambda i: (shape[i], -i))
    return PartitionSpec(*[("fsdp" if i == axis else None) for i in range(len(shape))])


def fsdp_rule(shape: tuple[int, ...], mesh: Mesh, axis: str = "fsdp") -> PartitionSpec:
    """:func:`fsdp_spec` over mesh axis ``axis``: the trainer's parameter layout."""
    spec = fsdp_spec(tuple(shape), mesh.shape[axis])
    return PartitionSpec(*[axis if entry == "fsdp" else entry for entry in spec])


def fsdp_param_spec(
    path, shape: tuple[int, ...], fsdp_size: int, *, is_stacked: Callable[[Any], bool]
) -> PartitionSpec:
    """:func:`fsdp_spec`, except that a stacked layer axis is never split.

    A scan takes one layer per iteration; splitting the layer axis would put whole layers on
    single devices instead of splitting every layer's weights across the ``fsdp`` axis.

    Args:
      path: the parameter's key path in its tree (as ``jax.tree_util`` gives it).
      shape: the parameter's shape.
      fsdp_size: the size of the ``fsdp`` mesh axis.
      is_stacked: the model's layout rule: whether the parameter at ``path`` is a stack whose
        leading axis indexes layers (the model knows its own tree; the kernels do not).

    Examples:
      >>> from jax.tree_util import DictKey
      >>> stacked = lambda path: path[0].key == "layers"
      >>> fsdp_param_spec((DictKey("layers"), DictKey("w_up")), (32, 4096, 11008), 8,
      ...                 is_stacked=stacked)
      P(None, 'fsdp', None)
      >>> fsdp_param_spec((DictKey("lm_head"),), (4096, 32000), 8, is_stacked=stacked)
      P('fsdp', None)
    """
    if shape and is_stacked(path):
        return PartitionSpec(None, *fsdp_spec(shape[1:], fsdp_size))
    return fsdp_spec(shape, fsdp_size)


def fsdp_param_shardings(abstract_params, mesh: Mesh, *, is_stacked: Callable[[Any], bool]):
    """Each parameter's ``NamedSharding`` on ``mesh`` by :func:`fsdp_param_spec` over
    ``"fsdp"``, with the model's layout rule ``is_stacked`` (see there)."""
    fsdp = mesh.shape["fsdp"]
    return jax.tree_util.tree_map_with_path(
        lambda path, p: NamedSharding(
            mesh, fsdp_param_spec(path, p.shape, fsdp, is_stacked=is_stacked)
        ),
        abstract_params,
    )


def over_batch(in_kinds: str, out_kinds: str):
    """Adds ``mesh: KernelMesh | None`` to a Pallas entry point: with a mesh it runs per shard.

    ``in_kinds`` describes the leading positional arrays, ``out_kinds`` the outputs: ``"b"`` is
    split along its leading axis over the batch axes, ``"r"`` is replicated, and an ``"s"``
    output is the sum over the batch shards (a ``psum`` of each shard's partial sum). Positional
    arguments past ``in_kinds`` and all keywords are static and reach every shard as they are.
    """

    def decorate(fn):
        @functools.wraps(fn)
        def wrapped(*args, mesh: KernelMesh | None = None, **kwargs):
            if mesh is None:
                return fn(*args, **kwargs)
            arrays, static = args[: len(in_kinds)], args[len(in_kinds) :]
            batched = next(a for a, k in zip(arrays, in_kinds, strict=True) if k == "b")
            split = mesh.activation_spec(batched.shape)

            def spec(kind):
                return split if kind == "b" else PartitionSpec()

            def local(*shards):
                outs = fn(*shards, *static, **kwargs)
                outs = outs if isinstance(outs, tuple) else (outs,)
                return tuple(
                    lax.psum(o, mesh.batch_axes) if k == "s" else o
                    for o, k in zip(outs, out_kinds, strict=True)
                )

            outs = shard_map(
                local,
                mesh.mesh,
                tuple(spec(k) for k in in_kinds),
                tuple(spec(k) for k in out_kinds),
            )(*arrays)
            return outs if len(out_kinds) > 1 else outs[0]

        return wrapped

    return decorate

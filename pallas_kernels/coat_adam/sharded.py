"""The fused kernel on each shard of a sharded parameter, through ``shard_map``: no gather of
the parameter, its gradient or its state (every group lies on one shard)."""

from __future__ import annotations

from jax.sharding import PartitionSpec

from pallas_kernels import quant
from pallas_kernels.coat_adam.pallas_triton import check_moment, fused_call
from pallas_kernels.sharding import check_spec, group_aligned_spec, shard_map


def sharded_call(
    grad, param, mu, nu, hyper, *, spec, config, interpret, mesh, partition, stacked=False
):
    """:func:`fused_call`, on each shard of a parameter split as ``partition`` over ``mesh``
    (with ``stacked``: ``partition`` is one element's; the stacks' leading axis is not split)."""
    kw = dict(spec=spec, config=config, interpret=interpret, stacked=stacked)
    if mesh is None:
        return fused_call(grad, param, mu, nu, hyper, **kw)
    shape = grad.shape
    n_groups = quant.num_groups(shape[-1], spec.group_size)
    moment_shape = param.shape if stacked else shape
    # Whole-array checks first, so that a mismatch is reported in the caller's shapes.
    check_moment("mu", mu, spec.mu_format, moment_shape, n_groups, spec)
    check_moment("nu", nu, spec.nu_format, moment_shape, n_groups, spec)
    check_spec(partition, shape, mesh, f"the partition of a parameter of shape {shape}")
    split = group_aligned_spec(partition, shape, mesh, spec.group_size)
    state_split = PartitionSpec(None, *split) if stacked else split
    apply = param is not None

    def local(hyper, grad, *rest):
        p = rest[0] if apply else None
        mu_l, nu_l = rest[-2:]
        return fused_call(grad, p, mu_l, nu_l, hyper, **kw)

    # One spec per moment, for its codes and its statistics alike: the statistics have the
    # parameter's rank and every group lies on one shard.
    in_specs = (PartitionSpec(), split) + ((state_split,) if apply else ())
    in_specs = in_specs + (state_split, state_split)
    out_specs = (state_split, state_split, state_split)
    return shard_map(local, mesh, in_specs, out_specs)(
        hyper, grad, *((param,) if apply else ()), mu, nu
    )

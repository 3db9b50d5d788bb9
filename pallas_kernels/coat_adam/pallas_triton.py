"""The fused COAT AdamW kernel (Pallas, Triton backend) and its ``pallas_call``.

Layout: the parameter is viewed as ``[rows, n]`` and one program handles ``block_rows`` groups.
When ``n`` is a multiple of the group size the view is ``[rows * n / group_size, group_size]``:
one group per row, contiguous in memory. Otherwise the view stays ``[rows, n]``, the grid has one
column of programs per group and the short last group is masked (its missing values read as 0,
which changes neither absmax nor DRE's statistics).

Numeric hyper-parameters enter as a small float32 vector operand (:func:`hyper_vector`), so one
compiled kernel serves every step, schedule value and ``inject_hyperparams`` setting.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels import quant
from pallas_kernels.coat_adam.config import DEFAULT_CONFIG, MomentSpec
from pallas_kernels.coat_adam.pallas_triton_math import Math, dequantize_tile, quantize_tile
from pallas_kernels.coat_adam.reference import check_groups
from pallas_kernels.dispatch import require_gpu
from pallas_kernels.quant import QuantizedTensor

# Positions in the float32 hyper-parameter operand (a power-of-two length for Triton).
(
    _B1,
    _C1,
    _B2,
    _C2,
    _EPS,
    _BC1,
    _BC2,
    _EXPAND_MIN,
    _RANGE_MU,
    _RANGE_NU,
    _NEG_LR,
    _WD,
    _GRAD_SCALE,
    _INDEX,
) = range(14)
_HYPER_SIZE = 16


def hyper_vector(
    *,
    count,
    b1,
    b2,
    eps,
    expand_min,
    spec,
    learning_rate=0.0,
    weight_decay=0.0,
    grad_scale=None,
    index=None,
):
    """The numeric hyper-parameters as one float32 vector, computed as the reference does.

    ``1 - b1`` is formed before the cast (in Python double for a Python float, as the reference's
    ``(1 - b1) * g`` does), and the bias corrections with the reference's expressions, so the
    kernel multiplies by the very same float32 numbers.
    """
    t = jnp.asarray(count, jnp.float32)

    def log2_range(fmt):
        fmax = quant.FP8_MAX[fmt]
        return jnp.log2(jnp.float32(fmax * fmax / 2))

    values = [
        b1,
        1 - b1,
        b2,
        1 - b2,
        eps,
        1 - b1**t,
        1 - b2**t,
        expand_min,
        log2_range(spec.mu_format),
        log2_range(spec.nu_format),
        -learning_rate,
        weight_decay,
        1.0 if grad_scale is None else grad_scale,
        # The stacked apply's element (exact in float32 below 2**24).
        0 if index is None else index,
    ]
    vec = jnp.stack([jnp.asarray(v, jnp.float32).reshape(()) for v in values])
    return jnp.pad(vec, (0, _HYPER_SIZE - len(values)))


def _kernel(
    hyper_ref,
    grad_ref,
    *refs,
    spec: MomentSpec,
    n_rows: int,
    n_cols: int,
    block_rows: int,
    tiles: int,
    apply: bool,
    fast_math: bool,
    flat: bool,
    native: bool,
    stacked: bool = False,
):
    n_moment = 4 if spec.expansion else 2
    refs = list(refs)
    param_ref = refs.pop(0) if apply else None
    mu_in, nu_in = refs[:n_moment], refs[n_moment : 2 * n_moment]
    out_ref = refs[2 * n_moment]
    mu_out = refs[2 * n_moment + 1 : 3 * n_moment + 1]
    nu_out = refs[3 * n_moment + 1 :]
    gs = spec.group_size
    math_ = Math(fast_math, native)
    h = [hyper_ref[i] for i in range(_INDEX + 1)]
    expand_min = h[_EXPAND_MIN]
    # Masks only where the shape leaves a ragged edge, so the common case issues plain loads.
    ragged_rows = n_rows % (block_rows * tiles) != 0
    # Read once, outside the tile loop (interpret mode has no program id inside a loop body).
    first_row = pl.program_id(0) * (tiles * block_rows)
    stacked_refs = set()
    if stacked:
        # The parameter and the moments are whole stacks (every element's rows one after the
        # other); this program's rows of element `index` start at `stack_row`. The caller
        # guarantees whole groups and whole programs (no masks).
        stacked_refs = {id(r) for r in [param_ref, *refs]}
        stack_row = h[_INDEX].astype(jnp.int32) * n_rows + first_row
    col_mask = None
    if n_cols % gs:
        cols = pl.program_id(1) * gs + lax.broadcasted_iota(jnp.int32, (1, gs), 1)
        col_mask = cols < n_cols

    def tile(t):
        # Tile t of this program's `tiles`.
        first = t * block_rows
        if tiles == 1:
            window = slice(None)
        else:
            window = pl.ds(pl.multiple_of(first, block_rows), block_rows)
        row_mask = None
        if ragged_rows:
            rows = (first_row + first) + lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)
            row_mask = rows < n_rows
        if row_mask is None or col_mask is None:
            tile_mask = row_mask if col_mask is None else col_mask
        else:
            tile_mask = row_mask & col_mask

        def view_of(ref):
            if id(ref) in stacked_refs:
                return ref.at[pl.ds(stack_row + first, block_rows), :]
            return ref.at[window, :]

        def load(ref, mask, other):
            view = view_of(ref)
            if mask is None:
                return view[...]
            return pl_triton.load(view, mask=mask, other=jnp.asarray(other, ref.dtype))

        def store(ref, value, mask):
            view = view_of(ref)
            if mask is None:
                view[...] = value.astype(ref.dtype)
            else:
                pl_triton.store(view, value.astype(ref.dtype), mask=mask)

        def moment_in(moment_refs):
            # Codes, then statistics; statistics of padding rows read as 1 so those rows
            # compute finite garbage.
            codes = load(moment_refs[0], tile_mask, 0)
            stats = [load(r, row_mask, 1) for r in moment_refs[1:]]
            if not spec.expansion:
                return dequantize_tile(codes, stats[0], None, None, math_, flat)
            return dequantize_tile(codes, *stats, math_, flat)

        def moment_out(moment_refs, x, fmt, log2_range):
            codes, stats = quantize_tile(
                x, fmt, spec.expansion, expand_min, log2_range, math_, flat
            )
            store(moment_refs[0], codes, tile_mask)
            for r, value in zip(moment_refs[1:], stats, strict=True):
                store(r, value, row_mask)

        g = load(grad_ref, tile_mask, 0).astype(jnp.float32)
        m = moment_in(mu_in)
        v = moment_in(nu_in)
        # The gradient times its clip factor (exactly 1 unless the caller clips), then
        # adam_moments_and_update operation by operation.
        g = g * h[_GRAD_SCALE]
        m = h[_B1] * m + h[_C1] * g
        v = h[_B2] * v + h[_C2] * g * g
        update = math_.adam_direction(math_.divide(m, h[_BC1]), math_.divide(v, h[_BC2]), h[_EPS])
        update = update.astype(grad_ref.dtype)
        if apply:
            p = load(param_ref, tile_mask, 0).astype(jnp.float32)
            u = update.astype(jnp.float32) + h[_WD] * p
            store(out_ref, p + u * h[_NEG_LR], tile_mask)
        else:
            store(out_ref, update, tile_mask)
        moment_out(mu_out, m, spec.mu_format, h[_RANGE_MU])
        moment_out(nu_out, v, spec.nu_format, h[_RANGE_NU])

    def body(t, carry):
        tile(t)
        return carry

    if tiles == 1:
        tile(0)
    elif not ragged_rows:
        lax.fori_loop(0, tiles, body, 0)
    else:
        # Tiles wholly past the array's end (the last program's) would only mask everything.
        left = n_rows - first_row
        lax.fori_loop(0, jnp.minimum(tiles, (left + block_rows - 1) // block_rows), body, 0)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_moment(
    name: str, moment: QuantizedTensor, fmt: str, shape, n_groups: int, spec: MomentSpec
):
    check_groups(name, moment, spec)
    stat_shape = (*shape[:-1], n_groups)
    if moment.codes.shape != tuple(shape) or moment.codes.dtype != quant.FORMATS[fmt]:
        raise ValueError(
            f"{name}.codes must be {quant.FORMATS[fmt]} of shape {tuple(shape)}, got "
            f"{moment.codes.dtype} of shape {moment.codes.shape}"
        )
    if moment.fmt != fmt:
        raise ValueError(f"{name}.fmt is {moment.fmt!r} but its codes are {fmt!r} codes")
    stats = [moment.scale] + ([moment.expand, moment.center] if spec.expansion else [])
    if not spec.expansion and (moment.expand is not None or moment.center is not None):
        raise ValueError(f"{name} has expand/center statistics but spec.expansion is False")
    for s in stats:
        if s is None or s.shape != stat_shape or s.dtype != jnp.float32:
            raise ValueError(
                f"{name} statistics must be float32 of shape {stat_shape} (expansion="
                f"{spec.expansion}), got {None if s is None else (s.dtype, s.shape)}"
            )
    return stats


def _largest_pow2_dividing(n: int, limit: int) -> int:
    """The largest power of two that divides ``n`` and is at most ``limit``."""
    p = 1
    while p * 2 <= limit and n % (p * 2) == 0:
        p *= 2
    return p


def fused_call(grad, param, mu, nu, hyper, *, spec, config, interpret, stacked=False):
    """The kernel on one parameter; with ``stacked``, ``param``, ``mu`` and ``nu`` are stacks
    ``[L, *grad.shape]`` and the kernel updates their element ``hyper[_INDEX]`` in place."""
    config = DEFAULT_CONFIG if config is None else config
    if not jnp.issubdtype(grad.dtype, jnp.floating):
        raise TypeError(f"grad must be a float array, got {grad.dtype}")
    if grad.ndim == 0 or grad.size == 0:
        raise ValueError(f"the kernel needs a non-empty array with an axis, got {grad.shape}")
    shape = grad.shape
    gs = spec.group_size
    n = shape[-1]
    n_groups = quant.num_groups(n, gs)
    layers = 1
    if stacked:
        if param is None or param.ndim != grad.ndim + 1 or param.shape[1:] != shape:
            raise ValueError(
                f"the stacked apply needs param [L, *grad.shape]; got param "
                f"{None if param is None else param.shape} for grad {shape}"
            )
        layers = param.shape[0]
    moment_shape = (layers, *shape) if stacked else shape
    mu_stats = check_moment("mu", mu, spec.mu_format, moment_shape, n_groups, spec)
    nu_stats = check_moment("nu", nu, spec.nu_format, moment_shape, n_groups, spec)
    if stacked and n % gs:
        # Whole-stack operands are sliced by hand; a short last group would need masked
        # slices past a row's end, which interpret mode clamps instead of masking.
        raise NotImplementedError(
            f"the stacked apply needs a last axis that is a multiple of the group size {gs}, "
            f"got {n}"
        )
    require_gpu(interpret)
    rows = math.prod(shape[:-1])
    if n % gs == 0:
        # One group per row, contiguous: the reshapes are free (row-major bitcasts).
        view_rows, view_cols, view_groups = rows * n_groups, gs, 1
    else:
        view_rows, view_cols, view_groups = rows, n, n_groups
    if stacked:
        # Whole programs only (no masks): the rows of one element split evenly.
        block_rows = _largest_pow2_dividing(view_rows, config.block_rows)
        tiles = _largest_pow2_dividing(view_rows // block_rows, config.tiles)
    else:
        block_rows = min(config.block_rows, _next_pow2(view_rows))
        tiles = min(config.tiles, _next_pow2(pl.cdiv(view_rows, block_rows)))
    rows_per_program = block_rows * tiles
    grid = (pl.cdiv(view_rows, rows_per_program), view_groups)

    data_spec = pl.BlockSpec((rows_per_program, gs), lambda i, j: (i, j))
    stat_spec = pl.BlockSpec((rows_per_program, 1), lambda i, j: (i, j))
    hyper_spec = pl.BlockSpec((_HYPER_SIZE,), lambda i, j: (0,))
    # A stack is one whole operand (its element's offset is a traced index, which a block
    # index map cannot take); the kernel slices it.
    stack_spec = pl.no_block_spec

    def data(x):
        return x.reshape(layers * view_rows if x.ndim > len(shape) else view_rows, view_cols)

    def stat(x):
        return x.reshape(layers * view_rows if x.ndim > len(shape) else view_rows, view_groups)

    apply = param is not None
    moments_in = [data(mu.codes), *map(stat, mu_stats), data(nu.codes), *map(stat, nu_stats)]
    if stacked:
        data_out, moment_specs = stack_spec, [stack_spec] * len(moments_in)
        param_spec = stack_spec
    else:
        data_out, param_spec = data_spec, data_spec
        moment_specs = [data_spec] + [stat_spec] * len(mu_stats)
        moment_specs = moment_specs + moment_specs
    inputs = [hyper, data(grad)] + ([data(param)] if apply else []) + moments_in
    in_specs = [hyper_spec, data_spec] + ([param_spec] if apply else []) + moment_specs
    out_dtype = param.dtype if apply else grad.dtype
    out_rows = layers * view_rows if stacked else view_rows
    out_shape = [jax.ShapeDtypeStruct((out_rows, view_cols), out_dtype)] + [
        jax.ShapeDtypeStruct(x.shape, x.dtype) for x in moments_in
    ]
    first_moment_input = 3 if apply else 2
    # New codes and statistics overwrite the old ones (and the new parameter the old one):
    # the state is donated in a training step, so the step needs no second copy of it.
    aliases = {first_moment_input + i: 1 + i for i in range(len(moments_in))}
    if apply:
        aliases[2] = 0
    kernel = functools.partial(
        _kernel,
        spec=spec,
        n_rows=view_rows,
        n_cols=view_cols,
        block_rows=block_rows,
        tiles=tiles,
        apply=apply,
        fast_math=config.fast_math,
        flat=config.flat_stats,
        native=not interpret,
        stacked=stacked,
    )
    compiler_params = (
        None
        if interpret
        else pl_triton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)
    )
    out, *moments_out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=[data_out] + moment_specs,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=compiler_params,
        name="coat_adamw_apply" if apply else "coat_adam_step",
    )(*inputs)

    n_moment = len(mu_stats) + 1
    stat_shape = (*moment_shape[:-1], n_groups)

    def moment(parts, fmt):
        codes, *stats = parts
        stats = [s.reshape(stat_shape) for s in stats]
        return QuantizedTensor(
            codes.reshape(moment_shape), *stats, fmt=fmt, granularity="group", group_size=gs
        )

    return (
        out.reshape(moment_shape if stacked else shape),
        moment(moments_out[:n_moment], spec.mu_format),
        moment(moments_out[n_moment:], spec.nu_format),
    )

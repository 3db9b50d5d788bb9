"""One COAT AdamW step for one parameter: dequantize the FP8 moments, update, re-quantize.

``coat_adam_step`` is the entry point ``coat_jax.scale_by_coat_adam`` calls per parameter. It
dispatches on ``implementation`` through :func:`pallas_kernels._dispatch.dispatch`: ``"xla"`` runs
:func:`coat_adam_step_reference` (plain jnp, the CPU path and the numerics contract of
docs/design.md, 'The optimizer step', line by line), ``"pallas"`` the fused kernel
:func:`coat_adam_step_pallas`, ``"auto"`` the kernel where it applies (a GPU, a power-of-two group
size, one device or a known mesh) and the reference elsewhere.

Sharded parameters: with ``mesh`` and the parameter's ``partition`` (a ``PartitionSpec``) the
kernel runs on each shard through ``shard_map``, with no gather of the parameter, its gradient or
its state: every group lies on one shard, because the kernel runs under
:func:`pallas_kernels.sharding.group_aligned_spec` (a split of the last axis off group boundaries
moves to another axis, or that axis is replicated). The hyper-parameters are a replicated operand.

A moment travels as a :class:`pallas_kernels.quant.QuantizedTensor` made per group of
``spec.group_size``: codes with the parameter's shape in a float8 dtype and float32 per-group
statistics of shape ``param.shape[:-1] + (ceil(n / group_size),)``; ``expand`` and ``center`` are
``None`` without Dynamic Range Expansion.

The kernel (Pallas, Triton backend) does the whole step in one pass over memory: it reads the
gradient, both moments' codes and statistics, and writes the update, the new codes and the new
statistics (codes and statistics in place). :func:`coat_adamw_apply` is the same pass that also
reads the float32 parameter and writes the new parameter instead of the update (decoupled weight
decay and the learning rate folded in), which saves the update's round trip through memory.

Layout: the parameter is viewed as ``[rows, n]`` and one program handles ``block_rows`` groups.
When ``n`` is a multiple of the group size the view is ``[rows * n / group_size, group_size]``:
one group per row, contiguous in memory. Otherwise the view stays ``[rows, n]``, the grid has one
column of programs per group and the short last group is masked (its missing values read as 0,
which changes neither absmax nor DRE's statistics).

Numeric hyper-parameters enter as a small float32 vector operand, so one compiled kernel serves
every step, schedule value and ``inject_hyperparams`` setting. Everything specific to Triton
(masked loads and stores, inline PTX for ``ex2``/``lg2``, ``num_warps``) sits in the
``interpret=False`` branch and in :class:`KernelConfig`, so a Mosaic GPU kernel could replace it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton
from jax.sharding import Mesh, PartitionSpec

from pallas_kernels import quant, stacks
from pallas_kernels._dispatch import dispatch, require_gpu
from pallas_kernels.quant import QuantizedTensor
from pallas_kernels.sharding import check_spec, group_aligned_spec, shard_map


@dataclasses.dataclass(frozen=True)
class MomentSpec:
    """Static (structural) quantization settings of the two moments."""

    group_size: int = 128
    mu_format: str = "e4m3"
    nu_format: str = "e4m3"
    expansion: bool = True

    def __post_init__(self):
        quant.check_group_size(self.group_size)
        quant.fp8_format(self.mu_format)
        quant.fp8_format(self.nu_format)


def quantize_moment(x: jax.Array, fmt: str, spec: MomentSpec, expand_min) -> QuantizedTensor:
    """Quantizes a float32 moment as ``spec`` says (DRE or plain absmax)."""
    if spec.expansion:
        return quant.quantize_dre(x, group_size=spec.group_size, fmt=fmt, expand_min=expand_min)
    return quant.quantize_absmax(x, group_size=spec.group_size, fmt=fmt)


def _check_groups(name: str, moment: QuantizedTensor, spec: MomentSpec) -> None:
    """``TypeError`` unless ``moment`` is a :class:`QuantizedTensor`, ``ValueError`` unless it
    was quantized per group of ``spec.group_size``."""
    if not isinstance(moment, QuantizedTensor):
        raise TypeError(f"{name} must be a QuantizedTensor, got {type(moment).__name__}")
    if moment.granularity != "group" or moment.group_size != spec.group_size:
        raise ValueError(
            f"{name} was quantized with granularity={moment.granularity!r}, group_size="
            f"{moment.group_size}; the step's spec has groups of {spec.group_size}: quantize the "
            "moments with the spec (quantize_moment) or pass the spec they were made with"
        )


def adam_moments_and_update(g, m, v, *, count, b1, b2, eps):
    """Adam's moments and direction in float32 (no weight decay, no lr).

    docs/design.md, 'The optimizer step'.
    """
    g = g.astype(jnp.float32)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    t = jnp.asarray(count, jnp.float32)
    update = m / (1 - b1**t) / (jnp.sqrt(v / (1 - b2**t)) + eps)
    return m, v, update


def coat_adam_step_reference(
    grad: jax.Array,
    mu: QuantizedTensor,
    nu: QuantizedTensor,
    *,
    count,
    b1,
    b2,
    eps,
    expand_min,
    spec: MomentSpec,
) -> tuple[jax.Array, QuantizedTensor, QuantizedTensor]:
    """Plain-jnp COAT AdamW step of one parameter.

    Args:
      grad: the gradient, any float dtype, the parameter's shape.
      mu, nu: the quantized first and second moments (per group of ``spec.group_size``).
      count: the step number t, starting at 1 (a traced int is fine).
      b1, b2, eps, expand_min: numeric hyper-parameters (traced values are fine).
      spec: the static quantization settings.

    Returns:
      ``(update, new_mu, new_nu)``: the update ``m_hat / (sqrt(v_hat) + eps)`` in ``grad.dtype``
      and the re-quantized moments.
    """
    _check_groups("mu", mu, spec)
    _check_groups("nu", nu, spec)
    m = mu.dequantize()
    v = nu.dequantize()
    m, v, update = adam_moments_and_update(grad, m, v, count=count, b1=b1, b2=b2, eps=eps)
    return (
        update.astype(grad.dtype),
        quantize_moment(m, spec.mu_format, spec, expand_min),
        quantize_moment(v, spec.nu_format, spec, expand_min),
    )


# --- dispatch -------------------------------------------------------------------------------


def _check_kernel_spec(spec: MomentSpec) -> None:
    """``NotImplementedError`` unless the kernel handles ``spec``: Triton tiles need a
    power-of-two group size."""
    if spec.group_size & (spec.group_size - 1):
        raise NotImplementedError(
            f"the Pallas kernel needs a power-of-two group_size, got {spec.group_size}"
        )


def _check_placement(mesh, partition) -> None:
    if (mesh is None) != (partition is None):
        raise ValueError(
            "mesh and partition go together: pass both (the parameter's PartitionSpec on that "
            f"mesh) or neither; got mesh={mesh!r}, partition={partition!r}"
        )


def coat_adam_step(
    grad: jax.Array,
    mu: QuantizedTensor,
    nu: QuantizedTensor,
    *,
    count,
    b1,
    b2,
    eps,
    expand_min,
    spec: MomentSpec,
    implementation: str = "auto",
    interpret: bool = False,
    config: KernelConfig | None = None,
    mesh: Mesh | None = None,
    partition: PartitionSpec | None = None,
) -> tuple[jax.Array, QuantizedTensor, QuantizedTensor]:
    """COAT AdamW step of one parameter on the chosen implementation (see module docstring).

    ``"auto"`` runs the kernel on a GPU when the group size is a power of two (COAT's 128 is)
    and the placement is known (one device, or ``mesh`` given), the reference otherwise;
    ``"pallas"`` raises ``ValueError`` where the kernel cannot run.

    Args:
      mesh, partition: the mesh the parameter is sharded over and its ``PartitionSpec`` (both or
        neither): the kernel then runs on each shard. The reference needs neither.
      config: kernel launch settings (``None``: :data:`DEFAULT_CONFIG`).
      Others: as in :func:`coat_adam_step_reference`.
    """
    _check_placement(mesh, partition)
    kwargs = dict(count=count, b1=b1, b2=b2, eps=eps, expand_min=expand_min, spec=spec)
    return dispatch(
        "coat_adam_step",
        implementation,
        interpret=interpret,
        mesh=mesh,
        pallas=lambda: coat_adam_step_pallas(
            grad,
            mu,
            nu,
            interpret=interpret,
            config=config,
            mesh=mesh,
            partition=partition,
            **kwargs,
        ),
        xla=lambda: coat_adam_step_reference(grad, mu, nu, **kwargs),
    )[1]


# --- fused apply: the step plus weight decay, learning rate and the parameter update ---------


def apply_update(param, update, *, learning_rate, weight_decay):
    """``optax.add_decayed_weights``, ``scale_by_learning_rate`` and ``apply_updates`` in one.

    ``p + (u + wd * p) * (-lr)``, cast back to ``p``'s dtype: what ``coat_adamw``'s chain computes
    for a non-zero weight decay (optax skips the addition for a literal 0, which rounds the
    scaled update to the gradient's dtype; here it is always float32).
    """
    u = update + weight_decay * param
    return (param + u * (-learning_rate)).astype(param.dtype)


def coat_adamw_apply_reference(
    param,
    grad,
    mu,
    nu,
    *,
    count,
    b1,
    b2,
    eps,
    expand_min,
    learning_rate,
    weight_decay,
    spec,
    grad_scale=None,
) -> tuple[jax.Array, QuantizedTensor, QuantizedTensor]:
    """Plain-jnp fused AdamW step of one parameter: ``(new_param, new_mu, new_nu)``.

    ``grad_scale`` (a scalar, ``None`` for 1) multiplies the gradient in float32 first, as the
    kernel does (gradient clipping folded into the step).
    """
    g = grad if grad_scale is None else grad.astype(jnp.float32) * grad_scale
    update, new_mu, new_nu = coat_adam_step_reference(
        g, mu, nu, count=count, b1=b1, b2=b2, eps=eps, expand_min=expand_min, spec=spec
    )
    # The kernel rounds the update to the gradient's dtype, scaled or not.
    update = update.astype(grad.dtype)
    new_param = apply_update(param, update, learning_rate=learning_rate, weight_decay=weight_decay)
    return new_param, new_mu, new_nu


def coat_adamw_apply(
    param: jax.Array,
    grad: jax.Array,
    mu: QuantizedTensor,
    nu: QuantizedTensor,
    *,
    count,
    b1,
    b2,
    eps,
    expand_min,
    learning_rate,
    weight_decay,
    spec: MomentSpec,
    grad_scale=None,
    implementation: str = "auto",
    interpret: bool = False,
    config: KernelConfig | None = None,
    mesh: Mesh | None = None,
    partition: PartitionSpec | None = None,
    index=None,
) -> tuple[jax.Array, QuantizedTensor, QuantizedTensor]:
    """One whole COAT AdamW step of one parameter: ``(new_param, new_mu, new_nu)``.

    The same result as ``coat_adamw``'s update followed by ``optax.apply_updates`` (for a
    non-zero weight decay, see :func:`apply_update`), but on the kernel path in one pass that
    reads the parameter and writes the new one in place: about 14 bytes per parameter with bf16
    gradients, against 18 for the update followed by XLA's apply.

    Args:
      param: the parameter (float32 master weights, typically).
      grad: its gradient, the parameter's shape, any float dtype.
      mu, nu: the quantized moments.
      count: the step number t, starting at 1.
      b1, b2, eps, expand_min, learning_rate, weight_decay: numeric hyper-parameters (traced
        values are fine: they reach the kernel as operands).
      spec: static quantization settings.
      grad_scale: a scalar the gradient is multiplied by first, in float32 (``None``: 1), so that
        a global-norm clip costs no pass of its own over the gradient
        (``coat_jax.optim.clip_by_global_norm``); traced values are fine.
      implementation, interpret, mesh, partition: as in :func:`coat_adam_step`; ``partition``
        is the gradient's (one element's) with ``index``.
      config: kernel launch settings (``None``: :data:`DEFAULT_CONFIG`).
      index: ``None``, or an integer scalar (traced is fine): then ``param``, ``mu`` and ``nu``
        are stacks ``[L, *grad.shape]`` (a scanned model's layers and their state) and the step
        updates their element ``index`` in place, returning the whole stacks with the other
        elements unchanged. The kernel reads and writes that element inside the stacks (the
        stacks are aliased to the outputs), so a training step that donates them copies
        nothing; for a last axis that is not a multiple of the group size it steps the
        element's slices and writes them back, as the XLA path always does.
    """
    _check_placement(mesh, partition)
    kwargs = dict(count=count, b1=b1, b2=b2, eps=eps, expand_min=expand_min, spec=spec)
    decay = dict(learning_rate=learning_rate, weight_decay=weight_decay)
    scale = dict(grad_scale=grad_scale)
    stacked = index is not None
    if stacked and (param.ndim != grad.ndim + 1 or param.shape[1:] != grad.shape):
        raise ValueError(
            f"with index, param must be a stack [L, *grad.shape]; got param {param.shape} for "
            f"grad {grad.shape}"
        )
    if stacked and not jnp.issubdtype(jnp.asarray(index).dtype, jnp.integer):
        raise TypeError(f"index must be an integer scalar, got {jnp.asarray(index).dtype}")

    def kernel(param, mu, nu, in_place):
        hyper = _hyper_vector(
            spec=spec, **decay, **scale, **_no_spec(kwargs), index=index if in_place else None
        )
        return _sharded_call(
            grad,
            param,
            mu,
            nu,
            hyper,
            spec=spec,
            config=config,
            interpret=interpret,
            mesh=mesh,
            partition=partition,
            stacked=in_place,
        )

    def pallas():
        _check_kernel_spec(spec)
        if not stacked and param.shape != grad.shape:
            raise ValueError(f"param shape {param.shape} differs from grad shape {grad.shape}")
        if not jnp.issubdtype(param.dtype, jnp.floating):
            raise TypeError(f"param must be a float array, got {param.dtype}")
        if stacked and grad.shape[-1] % spec.group_size:
            # The in-place kernel takes whole groups only (_fused_call): a short last group
            # steps the element's slices with the per-parameter kernel and writes them back.
            return stacks.step_element(lambda t: kernel(*t, in_place=False), (param, mu, nu), index)
        return kernel(param, mu, nu, in_place=stacked)

    def xla():
        if not stacked:
            return coat_adamw_apply_reference(param, grad, mu, nu, **decay, **scale, **kwargs)
        return stacks.step_element(
            lambda t: coat_adamw_apply_reference(*t[:1], grad, *t[1:], **decay, **scale, **kwargs),
            (param, mu, nu),
            index,
        )

    return dispatch(
        "coat_adamw_apply",
        implementation,
        interpret=interpret,
        mesh=mesh,
        pallas=pallas,
        xla=xla,
    )[1]


# --- the kernel -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch settings of the fused kernel (static: one compile per setting and shape).

    Attributes:
      block_rows: groups per program, a power of two (one group is ``group_size`` values).
      num_warps: Triton warps per program.
      num_stages: Triton pipelining stages (the kernel body has no loop to pipeline).
      fast_math: trade a few float32 ulps for throughput (see ``_Math``): powers through the
        GPU's approximate ``ex2``/``lg2``, reciprocals, square roots and the update's division
        through ``rcp.approx``/``sqrt.approx``, divisions by per-group values as products with
        the reciprocal. Codes change only at rounding ties; the DRE exponent k, which a floor
        makes discontinuous, and the centre stay exactly the reference's computation. Measured
        on an H200: 3.4x faster than exact arithmetic (docs/notes_optimizer_kernel.md).
      flat_stats: compute the per-group statistics (DRE exponent, centre, scale, and the
        reciprocals the element work multiplies by) on a vector of the tile's groups rather
        than on the ``[groups, 1]`` column the row reductions give. Triton lays that column out
        across all of a warp's lanes, each lane repeating every group's scalar arithmetic; a
        flat vector lets the compiler spread the groups over the lanes. Same values either way.
      tiles: tiles of ``block_rows`` groups each program handles, one after another in a loop
        (with ``num_stages > 1`` Triton may prefetch the next tile's loads under the current
        tile's arithmetic). ``1``: one tile per program, no loop.
    """

    # Best of the settings timed on an H200 (docs/benchmarks.md, docs/notes_optimizer_kernel.md:
    # 11 settings on one Llama-2-7B layer, 2026-12-02).
    block_rows: int = 16
    num_warps: int = 4
    num_stages: int = 1
    fast_math: bool = True
    flat_stats: bool = True
    tiles: int = 1

    def __post_init__(self):
        for name in ("block_rows", "num_warps", "tiles"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two, got {value!r}")
        if not isinstance(self.num_stages, int) or self.num_stages <= 0:
            raise ValueError(
                f"KernelConfig.num_stages must be a positive int, got {self.num_stages!r}"
            )
        for name in ("fast_math", "flat_stats"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"KernelConfig.{name} must be a bool, got {value!r}")


DEFAULT_CONFIG = KernelConfig()

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


def _no_spec(kwargs):
    return {k: v for k, v in kwargs.items() if k != "spec"}


def _hyper_vector(
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


def _flush(x):
    """``x`` with subnormal values as (signed) zeros: the GPU's flush-to-zero, in jnp."""
    return jnp.where(jnp.abs(x) < jnp.finfo(jnp.float32).tiny, x * 0.0, x)


# The power of two by which a centre's reciprocal is taken (``_Math.reciprocal``, ``ftz=False``).
_CENTRE_SCALE = 2.0**-4


class _Math:
    """Element-wise operations whose fast form differs between Triton and interpret mode.

    ``fast=False`` is the reference's own arithmetic. ``fast=True`` trades a few float32 ulps
    for throughput, since the step is compute-bound on an H200 with exact arithmetic: on the
    GPU, powers go through the approximate ``ex2``/``lg2`` instructions and reciprocals, square
    roots and the update's division through ``rcp.approx``/``sqrt.approx``. Interpret mode has
    no PTX: there the powers run as ``exp2(e * log2(a))`` and the divisions as products with the
    reciprocal in jnp, the rest exactly, and the ``.ftz`` forms flush subnormal values as the GPU
    does. The ``.ftz`` forms appear only where the argument or a flushed result cannot matter
    (noted at each call), or in the branch a tile takes when it holds no subnormal value.
    """

    def __init__(self, fast: bool, native: bool):
        self.fast = fast
        self.native = fast and native

    def _asm(self, instruction, *args):
        """One float32 PTX ``instruction`` per element of ``args`` (broadcast to one shape)."""
        shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in args))
        operands = ", ".join(f"${i}" for i in range(len(args) + 1))
        (out,) = pl_triton.elementwise_inline_asm(
            f"{instruction} {operands};",
            args=[jnp.broadcast_to(x, shape) for x in args],
            constraints=",".join(["=f"] + ["f"] * len(args)),
            pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)],
        )
        return out

    def log2(self, a, *, ftz=False):
        """``log2(a)`` for ``a >= 0`` (``-inf`` at 0), approximate on the GPU (fast math).

        ``ftz``: a subnormal ``a`` reads as 0, as the GPU's ``.ftz`` form does; interpret mode
        flushes the same way, so that CPU tests see what the flush loses.
        """
        if self.native:
            return self._asm("lg2.approx.ftz.f32" if ftz else "lg2.approx.f32", a)
        return jnp.log2(_flush(a) if ftz else a)

    def exp2(self, x, *, ftz=False):
        """``2 ** x`` (``0`` at ``-inf``), approximate on the GPU (fast math); ``ftz``: a
        subnormal result is 0 (interpret mode too)."""
        if self.native:
            return self._asm("ex2.approx.ftz.f32" if ftz else "ex2.approx.f32", x)
        return _flush(jnp.exp2(x)) if ftz else jnp.exp2(x)

    def power(self, a, e, *, ftz_log=False, ftz_exp=False):
        """``a ** e`` for ``a >= 0`` and ``e > 0``; ``lg2(0) = -inf`` and ``ex2(-inf) = 0``."""
        if not self.fast:
            return jnp.power(a, e)
        return self.exp2(e * self.log2(a, ftz=ftz_log), ftz=ftz_exp)

    def reciprocal(self, d, *, ftz=True):
        """``1 / d`` of a normal, per-group or scalar ``d``.

        ``ftz``: the reciprocal may flush to zero, right for a ``d`` below 2**126; a group
        centre may be larger (its subnormal reciprocal, flushed, would turn the group's codes
        into NaN), so it takes ``ftz=False``. Scalars take the exact division: it runs once
        per program, not per element.
        """
        if self.native and jnp.ndim(d) > 0:
            if ftz:
                return self._asm("rcp.approx.ftz.f32", d)
            # Scaled by 2**-4 (exact) for d in [2**-122, 2**128), which holds every centre
            # (at least quant.DRE_TINY): the scaled reciprocal stays normal, and the product, a
            # plain multiply, keeps a subnormal result.
            return self._asm("rcp.approx.ftz.f32", d * _CENTRE_SCALE) * _CENTRE_SCALE
        return 1.0 / d

    def divide(self, x, d, *, ftz=True, spread=None):
        """``x / d`` for ``d`` constant along the group (a per-group or scalar divisor);
        ``ftz`` as in :meth:`reciprocal`. Interpret mode divides where the reciprocal may not
        flush: a CPU flushes every subnormal value, the GPU's scaled form does not.

        ``spread``: maps a per-group value to ``x``'s shape (e.g. a ``[groups]`` vector to a
        column), applied to the reciprocal, or to ``d`` where it divides: the reciprocal is
        taken once per group either way."""
        spread = spread or (lambda v: v)
        if not self.fast or (not ftz and not self.native):
            return x / spread(d)
        return x * spread(self.reciprocal(d, ftz=ftz))

    def adam_direction(self, m_hat, v_hat, eps):
        """``m_hat / (sqrt(v_hat) + eps)``."""
        if not self.native:
            # (No flush here: it could move the quotient by rounding only.)
            return m_hat / (jnp.sqrt(v_hat) + eps)
        # sqrt.approx maps +0 to +0 and rcp.approx.ftz is exact enough for eps-sized values.
        return m_hat * self._asm("rcp.approx.ftz.f32", self._asm("sqrt.approx.f32", v_hat) + eps)


def _copysign(magnitude, x):
    """``sign(x) * magnitude`` for ``magnitude >= 0``, bit for bit (signed zeros included), in
    two integer operations instead of sign()'s compare-and-select chain and a multiply."""
    sign_bit = lax.bitcast_convert_type(x, jnp.int32) & jnp.int32(-(2**31))
    return lax.bitcast_convert_type(
        lax.bitcast_convert_type(magnitude, jnp.int32) | sign_bit, jnp.float32
    )


def _log2_ratio(mx, mn):
    """``quant.dre_statistics``'s overflow-safe ``log2(mx / mn)`` with two logs instead of three.

    Where ``mx / mn`` is finite this is ``log2(ratio) - log2(1)``, and ``log2(1)`` is exactly 0;
    elsewhere ``log2(mx) - log2(mn)``: the reference's value bit for bit either way.
    """
    ratio = mx / mn
    finite = jnp.isfinite(ratio)
    return jnp.log2(jnp.where(finite, ratio, mx)) - jnp.log2(jnp.where(finite, 1.0, mn))


def _flat(column, flat: bool):
    """A per-group ``[groups, 1]`` column as a ``[groups]`` vector when ``flat`` (else as is)."""
    return column.reshape(column.shape[0]) if flat else column


def _column(v, flat: bool):
    """The inverse of :func:`_flat`: a per-group value as a ``[groups, 1]`` column."""
    return v[:, None] if flat else v


def _dequantize(codes, scale, expand, center, math_: _Math, flat: bool = False):
    """Float32 moment of one tile, as :meth:`QuantizedTensor.dequantize` computes it."""
    q = codes.astype(jnp.float32)
    y = q * scale
    if expand is None:
        return y
    inv_expand = _column(math_.reciprocal(_flat(expand, flat)), flat)
    # |y| >= smallest code * scale >= 2**-16 / 57344: never subnormal, so lg2 may flush.
    return _copysign(math_.power(jnp.abs(y), inv_expand, ftz_log=True), y) * center


def _quantize(x, fmt, expansion, expand_min, log2_range, math_: _Math, flat: bool = False):
    """Codes and statistics of one tile of groups (one group per row), as the reference does.

    The statistics repeat ``quant.dre_statistics`` / ``quant.quantize_absmax`` operation by
    operation up to the exponent k, which a floor makes discontinuous; the centre and scale,
    continuous in their inputs, and the per-element work follow ``math_``. With ``flat`` the
    per-group arithmetic runs on ``[groups]`` vectors (``KernelConfig.flat_stats``): the same
    operations on the same values.
    """
    fmax = quant.FP8_MAX[fmt]
    dtype = quant.FORMATS[fmt]
    a = jnp.abs(x)

    def per_element_divide(v, d, ftz=True):
        # ``v / d`` for a per-group ``d``.
        return math_.divide(v, d, ftz=ftz, spread=lambda g: _column(g, flat))

    if not expansion:
        scale = _flat(jnp.max(a, axis=1, keepdims=True), flat) + quant.ABSMAX_TINY
        scale = scale / fmax
        codes = jnp.clip(per_element_divide(x, scale), -fmax, fmax).astype(dtype)
        return codes, (_column(scale, flat),)
    mx = _flat(jnp.max(a, axis=1, keepdims=True), flat) + quant.DRE_TINY
    nonzero_min = _flat(jnp.min(jnp.where(a > 0, a, jnp.inf), axis=1, keepdims=True), flat)
    mn = jnp.where(jnp.isfinite(nonzero_min), nonzero_min, 0.0) + quant.DRE_TINY
    c = jnp.sqrt(mx) * jnp.sqrt(mn)
    k = jnp.floor(log2_range / _log2_ratio(mx, mn) * expand_min) / expand_min
    k = jnp.clip(k, 1.0 / expand_min, quant.MAX_EXPAND)
    # The centre reaches 2**126 in groups of huge values: its reciprocal must not flush.
    s = math_.divide(math_.power(math_.divide(mx, c, ftz=False), k), fmax)
    stats = (_column(s, flat), _column(k, flat), _column(c, flat))
    # An ex2 result below 2**-126 ends as code 0 after the division by s >= 1 / fmax, so the
    # exponential may flush; the log's argument |x / c| stays exact (extreme groups reach
    # subnormal ratios).
    ratio = per_element_divide(x, c, ftz=False)
    y = _copysign(math_.power(jnp.abs(ratio), _column(k, flat), ftz_exp=True), x)
    codes = jnp.clip(per_element_divide(y, s), -fmax, fmax).astype(dtype)
    return codes, stats


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
    math_ = _Math(fast_math, native)
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
                return _dequantize(codes, stats[0], None, None, math_, flat)
            return _dequantize(codes, *stats, math_, flat)

        def moment_out(moment_refs, x, fmt, log2_range):
            codes, stats = _quantize(x, fmt, spec.expansion, expand_min, log2_range, math_, flat)
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


def _check_moment(
    name: str, moment: QuantizedTensor, fmt: str, shape, n_groups: int, spec: MomentSpec
):
    _check_groups(name, moment, spec)
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


def _fused_call(grad, param, mu, nu, hyper, *, spec, config, interpret, stacked=False):
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
    mu_stats = _check_moment("mu", mu, spec.mu_format, moment_shape, n_groups, spec)
    nu_stats = _check_moment("nu", nu, spec.nu_format, moment_shape, n_groups, spec)
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


def coat_adam_step_pallas(
    grad: jax.Array,
    mu: QuantizedTensor,
    nu: QuantizedTensor,
    *,
    count,
    b1,
    b2,
    eps,
    expand_min,
    spec: MomentSpec,
    interpret: bool = False,
    config: KernelConfig | None = None,
    mesh: Mesh | None = None,
    partition: PartitionSpec | None = None,
) -> tuple[jax.Array, QuantizedTensor, QuantizedTensor]:
    """The fused kernel version of :func:`coat_adam_step_reference` (same arguments, same result
    to float32 rounding; codes equal except at rounding ties).

    ``interpret=True`` runs the kernel body through XLA (CPU tests); ``config`` sets the launch
    (``None``: :data:`DEFAULT_CONFIG`); ``mesh`` and ``partition`` run it on each shard. Raises
    ``NotImplementedError`` for a group size that is not a power of two, or off a GPU without
    ``interpret``.
    """
    _check_placement(mesh, partition)
    _check_kernel_spec(spec)
    hyper = _hyper_vector(count=count, b1=b1, b2=b2, eps=eps, expand_min=expand_min, spec=spec)
    return _sharded_call(
        grad,
        None,
        mu,
        nu,
        hyper,
        spec=spec,
        config=config,
        interpret=interpret,
        mesh=mesh,
        partition=partition,
    )


def _sharded_call(
    grad, param, mu, nu, hyper, *, spec, config, interpret, mesh, partition, stacked=False
):
    """:func:`_fused_call`, on each shard of a parameter split as ``partition`` over ``mesh``
    (with ``stacked``: ``partition`` is one element's; the stacks' leading axis is not split)."""
    kw = dict(spec=spec, config=config, interpret=interpret, stacked=stacked)
    if mesh is None:
        return _fused_call(grad, param, mu, nu, hyper, **kw)
    shape = grad.shape
    n_groups = quant.num_groups(shape[-1], spec.group_size)
    moment_shape = param.shape if stacked else shape
    # Whole-array checks first, so that a mismatch is reported in the caller's shapes.
    _check_moment("mu", mu, spec.mu_format, moment_shape, n_groups, spec)
    _check_moment("nu", nu, spec.nu_format, moment_shape, n_groups, spec)
    check_spec(partition, shape, mesh, f"the partition of a parameter of shape {shape}")
    split = group_aligned_spec(partition, shape, mesh, spec.group_size)
    state_split = PartitionSpec(None, *split) if stacked else split
    apply = param is not None

    def local(hyper, grad, *rest):
        p = rest[0] if apply else None
        mu_l, nu_l = rest[-2:]
        return _fused_call(grad, p, mu_l, nu_l, hyper, **kw)

    # One spec per moment, for its codes and its statistics alike: the statistics have the
    # parameter's rank and every group lies on one shard.
    in_specs = (PartitionSpec(), split) + ((state_split,) if apply else ())
    in_specs = in_specs + (state_split, state_split)
    out_specs = (state_split, state_split, state_split)
    return shard_map(local, mesh, in_specs, out_specs)(
        hyper, grad, *((param,) if apply else ()), mu, nu
    )

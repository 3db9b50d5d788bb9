"""The FP8 linear layer: ``x @ w`` as an FP8 GEMM that keeps only the FP8 input for backward.

Input and weight are quantized to E4M3 with per-tensor scales computed just in time by group
scaling; the forward GEMM is written as ``dot(convert(x_fp8) * s_x, convert(w_fp8) * s_w)``,
the pattern XLA's GPU compiler rewrites into cuBLASLt's FP8 GEMM (``__cublas$lt$matmul$f8``).
Backward quantizes the output gradient per-tensor to E5M2 and runs dgrad and wgrad as the same
FP8 pattern. What backward gets of the weights is ``FP8Config.weight_residual``: the master
weight, quantized again (``"master"``), forward's codes (``"fp8"``), or the codes of an
:class:`FP8Weight` the model made once per step before its layers ran (``"once"``; see
:func:`quantize_weight`). The same codes feed the same GEMMs in all three, so the results are
bit-identical. The weight gradient comes out in the master dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from coat_jax import quant
from coat_jax.fp8.blockwise import fp8_blockwise_linear
from coat_jax.fp8.checks import check_float
from coat_jax.fp8.config import DEFAULT_CONFIG, FP8Config
from coat_jax.fp8.residuals import keep, keep_weight, pin
from coat_jax.fp8.rowwise import fp8_rowwise_linear
from pallas_kernels import fp8_quant
from pallas_kernels.dispatch import dispatch


def _per_tensor(x, fmt, config: FP8Config, *, weight: bool = False) -> quant.QuantizedTensor:
    """Per-tensor codes and scale of ``x``, an activation (on a kernel mesh: split along its
    leading axis over the batch axes) or, with ``weight=True``, a weight (split by the FSDP
    rule)."""
    mesh = config.mesh
    partition = mesh.param_spec(x.shape) if mesh is not None and weight else None
    kw = dict(fmt=fmt, group_size=config.group_size)
    return dispatch(
        "quantize_per_tensor",
        config.implementation_of("quantize_per_tensor"),
        interpret=config.interpret,
        mesh=mesh,
        # A Pallas quantizer is opaque to XLA, so nothing can fold its round trip; a barrier
        # here would also hide the FP8 codes from the GEMM rewriter: an optimization barrier
        # between the codes and the dot turns cuBLASLt FP8 GEMMs into float32 ones
        # (docs/fp8_gemm.md).
        pallas=lambda: fp8_quant.quantize_per_tensor_pallas(
            x, tiles=config.tiles, interpret=config.interpret, mesh=mesh, partition=partition, **kw
        ),
        xla=lambda: _per_tensor_xla(x, fmt, config),
    )[1]


def _per_tensor_xla(x, fmt, config: FP8Config) -> quant.QuantizedTensor:
    """XLA's per-tensor quantizer (the reference), pinned by
    :func:`~coat_jax.fp8.residuals.pin`."""
    kw = dict(fmt=fmt, group_size=config.group_size)
    return pin(fp8_quant.quantize_per_tensor_reference(x, **kw), config)


def _fp8_dot(a, b, contracting, config, compute_dtype, out_dtype):
    """``(a.codes * a.scale) . (b.codes * b.scale)`` of two per-tensor quantized operands as one
    FP8 GEMM, float32 accumulation, written in ``out_dtype``.

    A float32 result is spelled ``dot(convert(a_codes), convert(b_codes)) * (a_scale *
    b_scale)``. On the GPU, XLA's Triton GEMM pass runs before its cuBLAS FP8 rewriter and pulls
    the dot's operand producers into a fusion; it takes ``convert(codes)`` but leaves
    ``convert(codes) * scale`` outside when the scale is computed in the same program, and the
    dot then compiles to a float32 GEMM on dequantized copies. With the scales applied after
    the dot, the rewriter sees FP8 operands and folds the scalar product into cuBLASLt's scale
    arguments (``benchmarks/probe_fp8_gemm.py``, docs/fp8_gemm.md).

    A BF16 ``out_dtype`` under ``gemm_output="compute"`` is spelled
    ``dot(convert(a_codes) * a_scale, convert(b_codes) * b_scale)`` in that dtype: the
    rewriter only emits a BF16 result when the dot itself is BF16 (it folds no cast of a
    float32 result), and with :func:`fp8_compiler_options` (Triton GEMMs off) it folds the
    operand scales into cuBLASLt's (docs/fp8_gemm.md). The scales are BF16 values, so there
    nothing is rounded but the output; where they are not folded, each dequantized operand is
    rounded to BF16. Float16 keeps the float32 spelling (E5M2 gradient scales fall below its
    range).
    """
    dims = (contracting, ((), ()))
    out_dtype = jnp.dtype(out_dtype)
    if config.gemm_output == "compute" and out_dtype == jnp.bfloat16:
        return jax.lax.dot_general(
            a.codes.astype(out_dtype) * a.scale.astype(out_dtype),
            b.codes.astype(out_dtype) * b.scale.astype(out_dtype),
            dims,
            preferred_element_type=out_dtype,
        )
    dtype = jnp.float32 if config.gemm_dequant == "float32" else compute_dtype
    acc = jax.lax.dot_general(
        a.codes.astype(dtype), b.codes.astype(dtype), dims, preferred_element_type=jnp.float32
    )
    return (acc * (a.scale.astype(jnp.float32) * b.scale.astype(jnp.float32))).astype(out_dtype)


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["master", "quantized"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class FP8Weight:
    """A master weight paired with this step's FP8 codes of it (``weight_residual="once"``).

    ``fp8_linear`` takes it wherever it takes a master weight: forward and backward run their
    GEMMs on ``quantized`` and the weight gradient goes to ``master`` (the codes are a function of
    the master weight held constant, as its FP8 rounding is in every mode). Made by
    :func:`prequantized`; the model makes one per linear weight before its layers run.

    Attributes:
      master: the master weight ``[K, N]``, any float dtype.
      quantized: its E4M3 per-tensor :class:`~pallas_kernels.quant.QuantizedTensor` (codes
        ``[K, N]``, scalar scale).
    """

    master: jax.Array
    quantized: quant.QuantizedTensor

    @property
    def shape(self):
        return self.master.shape

    @property
    def dtype(self):
        return self.master.dtype

    @property
    def ndim(self):
        return self.master.ndim


def quantize_weight(w: jax.Array, config: FP8Config = DEFAULT_CONFIG) -> quant.QuantizedTensor:
    """E4M3 per-tensor codes of a master weight ``[K, N]``, or of stacked weights ``[L, K, N]``
    (one scale per ``w[l]``), with no gradient (``weight_residual="once"``).

    The codes equal what ``fp8_linear`` makes of each weight itself (group-scaled maximum, scale
    rounded up to a bfloat16 value). Stacked weights are quantized in one pass over the stacked
    array (``vmap``, batched kernels; on a kernel mesh the XLA reference on the sharded array),
    so a scan over layers slices 1-byte codes rather than handing each float32 slice to a
    kernel, which XLA must first copy out of the stack. On a kernel mesh the stacked weights
    take XLA's quantizer whatever ``config.implementation`` says: the partitioner splits it
    like the weight and takes each layer's maximum over the shards (the per-shard kernels are
    written for 2-D weights).

    Examples:
      >>> quantize_weight(jnp.ones((3, 32, 16))).scale.shape
      (3,)
    """
    check_float("w", w)
    w = jax.lax.stop_gradient(w)
    if w.ndim == 2:
        return _per_tensor(w, config.act_format, config, weight=True)
    if w.ndim != 3:
        raise ValueError(
            f"quantize_weight needs a weight [K, N] or stacked weights [L, K, N], got {w.shape}"
        )
    if config.mesh is not None:
        return jax.vmap(lambda wl: _per_tensor_xla(wl, config.act_format, config))(w)
    return jax.vmap(lambda wl: _per_tensor(wl, config.act_format, config, weight=True))(w)


def prequantized(w: jax.Array, config: FP8Config = DEFAULT_CONFIG) -> FP8Weight:
    """``FP8Weight(w, quantize_weight(w))``: a master weight ``[K, N]`` with its codes.

    Examples:
      >>> x = jnp.ones((4, 32), jnp.bfloat16)
      >>> fp8_linear(x, prequantized(jnp.ones((32, 16))), DEFAULT_CONFIG).shape
      (4, 16)
    """
    return FP8Weight(w, quantize_weight(w, config))


def _as_weights(w) -> tuple:
    return tuple(w) if isinstance(w, (tuple, list)) else (w,)


def _master(w):
    return w.master if isinstance(w, FP8Weight) else w


def _check_linear(x, w):
    check_float("x", x)
    weights = _as_weights(w)
    if not weights:
        raise ValueError("fp8_linear needs at least one weight")
    for wi in weights:
        check_float("w", _master(wi))
        if wi.ndim != 2 or x.ndim < 1 or x.shape[-1] != wi.shape[0]:
            raise ValueError(
                f"fp8_linear needs x [..., K] and w [K, N]; got x {x.shape} and w {wi.shape}"
            )
        if isinstance(wi, FP8Weight) and (
            wi.quantized.codes.shape != wi.shape or wi.quantized.granularity != "tensor"
        ):
            raise ValueError(
                f"FP8Weight of a weight {wi.shape} holds {wi.quantized.granularity} codes of "
                f"shape {wi.quantized.codes.shape}; make it with prequantized(w, config)"
            )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def fp8_linear(x: jax.Array, w, config: FP8Config = DEFAULT_CONFIG):
    """``x @ w`` as an FP8 GEMM (E4M3 per-tensor), keeping only FP8 ``x`` for backward.

    ``w`` may also be a tuple of weights sharing the input (q|k|v, gate|up): ``x`` is then
    quantized and saved once, each weight gets its own per-tensor scale, and a tuple of outputs
    comes back. No concatenated weight copy is made. What backward gets of the weights is
    ``config.weight_residual``: with ``"master"`` a reference to the caller's master weights
    (which live anyway), quantized again in backward; with ``"fp8"`` (or ``"once"``) forward's
    E4M3 codes and scales (1 byte per weight, tagged :data:`WEIGHT`), so each weight is quantized
    once. A weight given as an :class:`FP8Weight` is not quantized here at all: forward and
    backward use its codes, and its gradient goes to its master weight.

    Weights are quantized as weights (``_per_tensor(..., weight=True)``): on a kernel mesh
    (``config.mesh``) each FSDP shard is quantized where it lives, with the scale of the global
    maximum, so the GEMM gathers 1-byte codes rather than the float32 weight.

    Args:
      x: activations ``[..., K]`` (BF16 or float32).
      w: master weight ``[K, N]`` (any float dtype) or :class:`FP8Weight`, or a tuple of them.
      config: static :class:`FP8Config`.

    Returns:
      ``[..., N]`` in ``x.dtype`` (a tuple for a tuple ``w``). Weight gradients come back in
      each master weight's dtype.

    Examples:
      >>> x = jnp.ones((2, 8, 32), jnp.bfloat16)
      >>> fp8_linear(x, jnp.ones((32, 16)), DEFAULT_CONFIG).shape
      (2, 8, 16)
    """
    return fp8_linear_fwd(x, w, config)[0]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["items"],
    meta_fields=["dtypes", "container", "prequantized"],
)
@dataclasses.dataclass(frozen=True)
class _KeptWeights:
    """What ``fp8_linear``'s backward gets of its weights: per weight either its master weight
    (``weight_residual="master"``: backward quantizes it again) or its E4M3 per-tensor
    :class:`~pallas_kernels.quant.QuantizedTensor` (forward's codes, tagged :data:`WEIGHT`, or
    an :class:`FP8Weight`'s, which are an input and need no tag); static: the master dtypes the
    gradients take, the container of ``w`` (``tuple``, ``list``, or ``None`` for a single
    weight) and which weights came as :class:`FP8Weight` (their gradient goes to ``master``)."""

    items: tuple
    dtypes: tuple
    container: type | None
    prequantized: tuple


def _gathered(w_q: quant.QuantizedTensor, config: FP8Config) -> quant.QuantizedTensor:
    """On a kernel mesh: the FSDP all-gather of a weight placed on its FP8 codes (1 byte a
    value), where the per-shard quantizer left them; kept codes stay sharded. Left to itself the
    partitioner gathers the converted GEMM operand instead (float32 on 8 CPU devices)."""
    return w_q if config.mesh is None else w_q.replace(codes=config.mesh.gathered(w_q.codes))


def fp8_linear_fwd(x, w, config):
    """:func:`fp8_linear`'s forward rule: ``(y, residuals)``. Public because
    ``fp8_attention_linear`` runs it (and :func:`fp8_linear_bwd`) as its o_proj half."""
    _check_linear(x, w)
    k = x.shape[-1]
    # Quantize the 2-D view so that the codes feed the GEMM with no reshape in between (XLA's
    # FP8 GEMM rewriter only matches convert(codes) * scale directly on the FP8 producer).
    x_q = _per_tensor(x.reshape(-1, k), config.act_format, config)
    weights = _as_weights(w)
    ys, kept = [], []
    for wi in weights:
        if isinstance(wi, FP8Weight):
            w_q = wi.quantized
            kept.append(w_q)
        else:
            w_q = _per_tensor(wi, config.act_format, config, weight=True)
            kept.append(wi if config.weight_residual == "master" else keep_weight(w_q))
        y = _fp8_dot(x_q, _gathered(w_q, config), ((1,), (0,)), config, x.dtype, x.dtype)
        ys.append(y.reshape(*x.shape[:-1], wi.shape[1]))
    container = type(w) if isinstance(w, (tuple, list)) else None
    out = ys[0] if container is None else tuple(ys)
    kept_w = _KeptWeights(
        tuple(kept),
        tuple(jnp.dtype(wi.dtype) for wi in weights),
        container,
        tuple(isinstance(wi, FP8Weight) for wi in weights),
    )
    return out, (keep(x_q), kept_w)


def fp8_linear_bwd(config, res, dy):
    """:func:`fp8_linear`'s backward rule: ``(dx, dw)`` from :func:`fp8_linear_fwd`'s
    residuals."""
    x_q, kept_w = res
    dys = _as_weights(dy)
    compute = dys[0].dtype
    dx, dws = None, []
    for item, dtype, pre, dyi in zip(
        kept_w.items, kept_w.dtypes, kept_w.prequantized, dys, strict=True
    ):
        # "master": quantize the master weight again, exactly as forward did.
        w_q = (
            item
            if isinstance(item, quant.QuantizedTensor)
            else _per_tensor(item, config.act_format, config, weight=True)
        )
        dy_q = _per_tensor(dyi.reshape(-1, w_q.shape[1]), config.grad_format, config)
        # dgrad contracts the codes' last axis (N): [K, N] codes are already in the layout
        # cuBLASLt's FP8 GEMM takes, so no transposed copy is needed for it.
        w_q = _gathered(w_q, config)
        # A tuple of weights sums its input gradients in float32; one weight's is written in
        # the compute dtype straight from the GEMM (FP8Config.gemm_output).
        dx_dtype = compute if len(dys) == 1 else jnp.float32
        dx_i = _fp8_dot(dy_q, w_q, ((1,), (1,)), config, compute, dx_dtype)
        dx = dx_i if dx is None else dx + dx_i
        dw = _fp8_dot(x_q, dy_q, ((0,), (0,)), config, compute, jnp.float32).astype(dtype)
        # An FP8Weight's codes are held constant: its whole gradient is its master's.
        dws.append(FP8Weight(dw, None) if pre else dw)
    dx = dx.astype(compute).reshape(*dys[0].shape[:-1], x_q.shape[1])
    container = kept_w.container
    return dx, (dws[0] if container is None else container(dws))


fp8_linear.defvjp(fp8_linear_fwd, fp8_linear_bwd)


def fp8_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    *,
    config: FP8Config = DEFAULT_CONFIG,
    **unused_kwargs,
) -> jax.Array:
    """A ``lax.dot_general``-compatible FP8 linear, for ``nnx.Linear(dot_general=...)``.

    Only the contraction ``nnx.Linear`` performs is accepted: the last axis of ``lhs`` with the
    first of a 2-D ``rhs``, no batch axes. ``precision`` is ignored (the GEMM is FP8);
    ``out_sharding`` and other keyword arguments ``nnx.Linear`` forwards are ignored too.

    Examples:
      >>> from flax import nnx
      >>> layer = nnx.Linear(32, 16, dot_general=fp8_dot_general, rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((4, 32))).shape
      (4, 16)
    """
    del precision, unused_kwargs
    expected = (((lhs.ndim - 1,), (0,)), ((), ()))
    normalized = tuple(
        tuple(tuple(int(a) for a in axes) for axes in pair) for pair in dimension_numbers
    )
    if rhs.ndim != 2 or normalized != expected:
        raise ValueError(
            f"fp8_dot_general supports only x [..., K] @ w [K, N], i.e. dimension_numbers "
            f"{expected} with a 2-D rhs; got {dimension_numbers} with rhs shape {rhs.shape}"
        )
    y = linear_of(config)(lhs, rhs, config)
    return y if preferred_element_type is None else y.astype(preferred_element_type)


def linear_of(config: FP8Config):
    """The FP8 linear ``(x, w, config)`` of ``config.linear_scaling``: :func:`fp8_linear`
    (``"tensor"``), ``fp8_rowwise_linear`` (``"row"``, ``"row_gw_hp"``) or
    ``fp8_blockwise_linear`` (``"block"``)."""
    if config.linear_scaling == "tensor":
        return fp8_linear
    return fp8_blockwise_linear if config.linear_scaling == "block" else fp8_rowwise_linear

"""COAT's FP8 precision flow for a Llama layer: ops that keep FP8 activations for backward.

Every op here is a ``jax.custom_vjp`` whose forward saves FP8 codes plus float32 scales (one
:class:`~pallas_kernels.quant.QuantizedTensor` per saved tensor, tagged for remat by
:func:`keep`) instead of the BF16 tensor XLA's own autodiff would keep (COAT, Xi et al. 2025,
section 5; docs/design.md, 'The precision flow'):

==================  ==========================================  ================================
op                  saved for backward                          format
==================  ==========================================  ================================
``fp8_linear``      the input (one per call: q|k|v and gate|up   E4M3, per-tensor scale
                    run as one GEMM each, so one copy each)
``fp8_rmsnorm``     the input (the residual stream), 1/D rstd   E4M3, 1x16 scales
``fp8_silu``        the input (gate projection output)          E4M3, 1x16 scales
``fp8_mul``         both inputs (SiLU output, up projection)    E4M3, 1x16 scales
``fp8_add``         nothing (the residual add's backward is     --
                    the identity)
``fp8_swiglu``      gate and up (SiLU recomputed in backward)   E4M3, 1x16 scales
``fp8_attention``   q, k, v (attention re-run in backward)      E4M3, 1x16 scales
==================  ==========================================  ================================

``fp8_swiglu`` and ``fp8_attention`` go beyond COAT (which keeps the SiLU output, and BF16 q, k,
v); a model opts in: :func:`ops_for` gives ``fp8_swiglu`` as its ``swiglu`` op with
``FP8Config(swiglu="fused")``, and ``Llama(fp8_attention=True)`` takes ``fp8_attention`` (or,
with ``FP8Config(attention_backward="saved_output")``, ``fp8_attention_linear``: attention and
the o_proj as one op that keeps q, k, v as ``fp8_attention`` does, the o_proj's FP8 input
and the float32 softmax statistics, and whose backward reads that input, the attention output,
instead of re-running the attention forward).

FP8 linear: input and weight are quantized to E4M3 with per-tensor scales computed just in time
by group scaling; the forward GEMM is written as ``dot(convert(x_fp8) * s_x, convert(w_fp8) *
s_w)``, the pattern XLA's GPU compiler rewrites into cuBLASLt's FP8 GEMM
(``__cublas$lt$matmul$f8``). Backward quantizes the output gradient per-tensor to E5M2 and runs
dgrad and wgrad as the same FP8 pattern; by default (``FP8Config.weight_residual="master"``) the
weight is re-quantized from the master weight rather than kept as an FP8 copy, and with ``"fp8"``
forward's codes are kept for backward instead (1 byte per weight, tagged :data:`WEIGHT`; the same
codes, so the same results). With ``"once"`` the model quantizes every linear weight once per
step before its layers run (:func:`quantize_weight`, all layers of a scanned model in one pass)
and hands :class:`FP8Weight` pairs to ``fp8_linear``, whose forward and backward both read those
codes. Its gradient comes out in the master dtype.

The residual stream travels in BF16 (``fp8_add`` computes the sum in BF16); its FP8 copy is the
one the next ``fp8_rmsnorm`` makes and saves, and since each residual-stream value feeds exactly
one RMSNorm there is one FP8 copy of it, as in COAT.

FP8 tensors made by XLA's own quantizer pass :func:`materialize` (an optimization barrier), so
that XLA cannot fold the quantize-dequantize round trip back into the unquantized value. On a GPU
the default ``implementation="auto"`` quantizes in Pallas kernels, whose FP8 outputs XLA cannot
see through; there the linear layers' codes skip the barrier, which would otherwise hide them from
XLA's FP8 GEMM rewriter. A program compiled without excess precision
(``xla_allow_excess_precision=False``) cannot fold the round trip: ``FP8Config(codes_barrier=False)``
leaves the barrier out there, so that a scanned model's forward can write its kept codes straight
into the stacked residuals (an option: measured 0.78% slower in the trainer's Llama-2-7B step).

Forward outputs are computed from the exact inputs in float32 (only what backward keeps is
quantized), which costs no memory and keeps the forward as accurate as BF16 outside the GEMMs.

:func:`ops_for` returns the op set of a precision mode: ``"bf16"`` (plain jnp, XLA autodiff),
``"fp8"`` (FP8 linear only, like TransformerEngine) or ``"coat"`` (all of the above).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from coat_jax import attention, fp8_rowwise, quant
from pallas_kernels import fp8_act, fp8_quant
from pallas_kernels._dispatch import check_implementation, dispatch
from pallas_kernels.sharding import KernelMesh

PRECISIONS = ("bf16", "fp8", "coat")
GEMM_DEQUANT = ("compute", "float32")
GEMM_OUTPUTS = ("compute", "float32")

# ``jax.ad_checkpoint.checkpoint_name`` of every activation an op keeps for backward, in every
# precision: the FP8 codes and scales of the COAT ops (plus RMSNorm's 1/rms) and the inputs the
# plain ops' autodiff needs. A remat policy that saves this name keeps exactly the precision
# flow's residuals (docs/design.md, 'The precision flow') and recomputes everything else, weight
# casts included (``coat_jax.llama.REMAT_POLICIES``).
ACTIVATION = "activation"
# ``checkpoint_name`` of the FP8 weight codes and per-tensor scales ``fp8_linear`` keeps for
# backward with ``FP8Config(weight_residual="fp8")`` (1 byte per weight, alive from forward to
# backward). A remat policy that saves this name keeps them; one that does not recomputes them in
# backward (``coat_jax.llama.REMAT_POLICIES``). With ``"master"`` nothing carries this name.
WEIGHT = "fp8_weight"
# What ``fp8_linear`` keeps of its weights for backward (``FP8Config.weight_residual``).
WEIGHT_RESIDUALS = ("master", "fp8", "once")
# Attention's kernel: "auto" is cuDNN's fused attention on a GPU in BF16, XLA's elsewhere.
ATTENTION_IMPLEMENTATIONS = ("auto", "cudnn", "xla")
# What ``fp8_attention`` keeps to run attention's backward (``FP8Config.attention_backward``):
# "recompute" re-runs the forward from the FP8 q, k, v; "saved_output" takes the output from
# the o_proj's FP8 input codes and keeps the softmax statistics (``fp8_attention_linear``).
ATTENTION_BACKWARDS = ("recompute", "saved_output")
# The MLP's SiLU and product in the coat precision (``FP8Config.swiglu``): "coat" as COAT, one
# op each (three 1xG tensors kept), "fused" one ``fp8_swiglu`` (two kept).
SWIGLU_OPS = ("coat", "fused")
# The ops whose kernels ``FP8Config.op_implementations`` picks one by one.
KERNEL_OPS = ("quantize_per_tensor", "quantize_per_group", "rmsnorm", "silu", "mul", "swiglu")


def check_op_implementations(pairs) -> tuple[tuple[str, str], ...]:
    """``pairs`` (``FP8Config.op_implementations``) checked: ``(op, implementation)`` tuples,
    each op of :data:`KERNEL_OPS` at most once."""
    if not isinstance(pairs, tuple) or not all(
        isinstance(p, tuple) and len(p) == 2 and all(isinstance(v, str) for v in p) for p in pairs
    ):
        raise TypeError(
            "op_implementations must be a tuple of (op, implementation) string pairs, e.g. "
            f"(('quantize_per_tensor', 'pallas'),), got {pairs!r}"
        )
    seen = set()
    for op, implementation in pairs:
        if op not in KERNEL_OPS:
            raise ValueError(
                f"op_implementations names op {op!r}; valid ops are {list(KERNEL_OPS)}"
            )
        if op in seen:
            raise ValueError(f"op_implementations names op {op!r} twice")
        seen.add(op)
        check_implementation(implementation)
    return pairs


def keep(tree):
    """Tags every array of ``tree`` (quantized tensors' codes and scales included) as a kept
    activation (:data:`ACTIVATION`) for remat."""
    return quant.named(tree, ACTIVATION)


def keep_weight(tree):
    """Tags every array of ``tree`` as kept FP8 weight codes (:data:`WEIGHT`) for remat."""
    return quant.named(tree, WEIGHT)


@dataclasses.dataclass(frozen=True)
class FP8Config:
    """Static settings of the FP8 ops (hashable: passed as a non-differentiable argument).

    Attributes:
      act_format: FP8 format of forward activations and weights (COAT: E4M3).
      grad_format: FP8 format of output gradients entering backward GEMMs (COAT: E5M2).
      group_size: G of the 1xG groups of the non-linear ops and of group scaling (COAT: 16).
      implementation: "auto" (Pallas kernels where they apply: on a GPU, on one device or with
        ``mesh`` given; XLA elsewhere), "xla" or "pallas", for the quantizers and the fused
        non-linear kernels. The GEMMs are always XLA dots.
      op_implementations: per-op exceptions to ``implementation``, ``((op, implementation),
        ...)`` with ``op`` one of :data:`KERNEL_OPS` (``"quantize_per_tensor"``: the linear
        layers' per-tensor quantizer; ``"quantize_per_group"``: FP8 attention's 1xG q, k, v;
        ``"rmsnorm"``, ``"silu"``, ``"mul"``, ``"swiglu"``: the fused non-linear ops, forward
        and backward). Lets a program run XLA's fusions where they are faster and a Pallas
        kernel where it is (docs/bench_fp8_kernels.md).
      interpret: run Pallas kernels in interpret mode (CPU tests; "auto" then tries them too).
      tiles: tile sizes of the Pallas kernels.
      mesh: the :class:`~pallas_kernels.sharding.KernelMesh` of a multi-device program (its
        mesh, the batch axes the activations' leading axis is split over, the FSDP axis of the
        weights): the Pallas kernels then run on each shard, and per-tensor scales take the
        maximum over the mesh. ``None``: one device, or (with "auto") XLA on several.
      gemm_dequant: dtype the FP8 codes are converted to in the ``dot(convert(codes), ...)``
        pattern that XLA rewrites to cuBLASLt's FP8 GEMM: "float32" (default) or "compute" (the
        activations' dtype). Both are exact (FP8 values are exact in BF16); the GEMM accumulates
        in float32 either way. docs/fp8_gemm.md has which spellings the H200 rewrites. With
        ``gemm_output="compute"`` the GEMMs that write the activations' dtype convert to it.
      gemm_output: what the FP8 GEMMs whose result is a BF16 activation (forward's outputs,
        and dgrad's input gradient of a single weight) write: ``"compute"`` (default) BF16
        straight from cuBLASLt, the per-tensor scales applied to the operands
        (``dot(convert(a) * sa, convert(b) * sb)`` in BF16, which the GPU rewriter under
        :func:`fp8_compiler_options` folds into cuBLASLt's scale arguments: then only the
        output is rounded, as before); ``"float32"`` a float32 GEMM result scaled and then cast
        (2x the bytes written and read again; XLA does not fold that cast into the GEMM).
        Weight gradients, the input gradient summed over a tuple of weights, and float32 or
        float16 activations take the float32 spelling either way. Where the scales are not
        folded (off the GPU, or a GPU program compiled without the options), ``"compute"``
        rounds each dequantized operand to BF16 before the dot (a relative error below 2^-8
        per value).
      weight_residual: what ``fp8_linear`` keeps of each weight for backward. ``"master"``
        (default): a reference to the master weight, which backward quantizes again (nothing
        weight-sized is added; the weight is read and quantized twice per step). ``"fp8"``: the
        E4M3 codes and scale forward computed (1 byte per weight, tagged :data:`WEIGHT`, alive
        until backward), so backward quantizes no weight. ``"once"``: the model quantizes each
        linear weight once per step before its decoder layers run (a scanned model: all layers'
        stacked weights in one pass, so the scan slices 1-byte codes instead of handing each
        float32 weight slice to the quantizer as a copy) and passes :class:`FP8Weight` pairs;
        forward and backward read those codes (1 byte per weight, alive for the whole step). A
        plain master weight reaching ``fp8_linear`` under ``"once"`` is treated as under
        ``"fp8"``. All three give bit-identical results: the same codes feed the same GEMMs.
        docs/memory_options.md, "FP8 weight codes".
      group_scale: how the 1xG scales of the non-linear ops' saved inputs (and of FP8
        attention's q, k, v) are stored. ``"float32"`` (default, COAT): exact scales, 4 bytes
        per 16 values. ``"e8m0"``: each scale rounded up to a power of two and stored as its
        8-bit exponent (OCP MX's E8M0), 1 byte per 16 values: about 0.94U less per Llama
        layer kept for backward (docs/memory_options.md, "One-byte group scales"). The codes
        then differ: each value's relative FP8 rounding is unchanged, a group's largest value
        lands in (fmax / 2, fmax] rather than at fmax.
      attention: the kernel of the model's attention (and of :func:`fp8_attention`'s forward
        and its re-run in backward): ``"auto"`` (default) cuDNN's fused attention on a GPU in
        BF16, XLA's elsewhere; ``"xla"`` XLA's everywhere (the trainer's ``deterministic``
        takes it: on the H200, JAX 0.11.2, BF16 Llama steps failed to compile with
        ``xla_gpu_deterministic_ops`` while the float32 step, on XLA's attention, compiled;
        the cause is not located, and that XLA's attention avoids it is not verified there); ``"cudnn"``
        cuDNN's (GPU only).
      attention_backward: what a model with FP8 attention (``Llama(fp8_attention=True)``) runs
        attention's backward from. ``"recompute"`` (default): :func:`fp8_attention` keeps the
        FP8 q, k, v and re-runs the attention forward in backward for its output and softmax
        statistics. ``"saved_output"``: :func:`fp8_attention_linear` (attention and the o_proj
        as one op) keeps the same FP8 q, k, v plus the float32 log-sum-exp (4 bytes per query
        row and head) and takes the output from the E4M3 codes the o_proj keeps anyway: no
        forward re-run. Its gradients are those of the backward at the dequantized q, k, v
        with the forward's statistics and the FP8 output, further from the exact ones than
        the re-run's (docs/memory_options.md, section 6). Its residuals are tagged
        :data:`ACTIVATION` like the other FP8 ops': a remat policy that keeps those (``none``,
        ``activations``) skips the re-run; under ``attention`` or ``full`` the op is
        recomputed with the rest of the layer.
      swiglu: the MLP's ``silu(gate) * up`` in the ``coat`` precision (:func:`ops_for`'s
        ``swiglu`` op). ``"coat"`` (default, COAT): ``fp8_silu`` then ``fp8_mul``, keeping
        gate, the SiLU output and up in FP8 (three intermediate-size tensors). ``"fused"``: one
        :func:`fp8_swiglu`, keeping gate and up only and recomputing the SiLU in backward from
        the FP8 gate: one intermediate-size FP8 tensor (and its scales) less per layer, and
        one quantization less each way. Beyond COAT (docs/memory_options.md, "Fused SwiGLU").
      codes_barrier: pass the FP8 codes that XLA's own quantizers make through
        :func:`materialize` (default ``True``). Needed wherever the program may be compiled with
        XLA's excess precision (its default), which can fold a quantize-dequantize round trip
        back into the unquantized value. ``False`` is for programs compiled with
        ``xla_allow_excess_precision=False``, where nothing folds: XLA may then write the
        kept codes straight into a scanned model's stacked residuals instead of into a buffer
        of their own that a device copy moves there (measured smaller and slower in the
        trainer's step: docs/bench_codes_barrier.md).
      linear_scaling: how the FP8 linears of :func:`ops_for` scale their operands.
        ``"tensor"`` (default, COAT): one scale per tensor (:func:`fp8_linear`). ``"row"``: one
        per token of the input and one per output channel of the weight, backward GEMMs scaled
        along their contraction axes; ``"row_gw_hp"``: the same with the weight gradient in the
        compute dtype (:func:`coat_jax.fp8_rowwise.fp8_rowwise_linear`). The row-wise ones take
        ``weight_residual="master"`` and ``attention_backward="recompute"`` only.
    """

    act_format: str = "e4m3"
    grad_format: str = "e5m2"
    group_size: int = 16
    implementation: str = "auto"
    op_implementations: tuple[tuple[str, str], ...] = ()
    interpret: bool = False
    tiles: fp8_quant.TileConfig = fp8_quant.DEFAULT_TILES
    gemm_dequant: str = "float32"
    gemm_output: str = "compute"
    mesh: KernelMesh | None = None
    weight_residual: str = "master"
    group_scale: str = "float32"
    attention: str = "auto"
    attention_backward: str = "recompute"
    swiglu: str = "coat"
    codes_barrier: bool = True
    linear_scaling: str = "tensor"

    def __post_init__(self):
        fp8_rowwise.check_linear_scaling(self.linear_scaling)
        if self.linear_scaling != "tensor" and self.weight_residual != "master":
            raise ValueError(
                f"linear_scaling={self.linear_scaling!r} re-quantizes the master weight per "
                f"channel, and weight_residual={self.weight_residual!r} hands per-tensor codes; "
                "set weight_residual='master'"
            )
        if self.linear_scaling != "tensor" and self.attention_backward != "recompute":
            raise ValueError(
                f"linear_scaling={self.linear_scaling!r} has no fused attention and o_proj op; "
                "set attention_backward='recompute' (or linear_scaling='tensor')"
            )
        if self.gemm_dequant not in GEMM_DEQUANT:
            raise ValueError(
                f"gemm_dequant={self.gemm_dequant!r} is not one of {list(GEMM_DEQUANT)}"
            )
        if self.gemm_output not in GEMM_OUTPUTS:
            raise ValueError(
                f"gemm_output={self.gemm_output!r} is not one of {list(GEMM_OUTPUTS)}: 'compute' "
                "writes the activations' dtype from the FP8 GEMM, 'float32' a float32 result "
                "cast afterwards"
            )
        if self.weight_residual not in WEIGHT_RESIDUALS:
            raise ValueError(
                f"weight_residual={self.weight_residual!r} is not one of "
                f"{list(WEIGHT_RESIDUALS)}: 'master' re-quantizes the master weight in backward, "
                "'fp8' keeps forward's FP8 weight codes for it, 'once' quantizes every weight "
                "once per step before the layers run"
            )
        if self.group_scale not in quant.SCALE_FORMATS:
            raise ValueError(
                f"group_scale={self.group_scale!r} is not one of {list(quant.SCALE_FORMATS)}: "
                "'float32' keeps exact 1xG scales, 'e8m0' power-of-two scales in one byte"
            )
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"attention={self.attention!r} is not one of {list(ATTENTION_IMPLEMENTATIONS)}: "
                "'auto' runs cuDNN's fused attention on a GPU in BF16, 'xla' XLA's everywhere"
            )
        if self.attention_backward not in ATTENTION_BACKWARDS:
            raise ValueError(
                f"attention_backward={self.attention_backward!r} is not one of "
                f"{list(ATTENTION_BACKWARDS)}: 'recompute' re-runs FP8 attention's forward in "
                "backward, 'saved_output' keeps its softmax statistics and reads the output from "
                "the o_proj's FP8 input"
            )
        if self.swiglu not in SWIGLU_OPS:
            raise ValueError(
                f"swiglu={self.swiglu!r} is not one of {list(SWIGLU_OPS)}: 'coat' runs the SiLU "
                "and the product as two FP8 ops (three FP8 tensors kept), 'fused' one fp8_swiglu "
                "(two kept, SiLU recomputed in backward)"
            )
        quant.fp8_format(self.act_format)
        quant.fp8_format(self.grad_format)
        quant.check_group_size(self.group_size)
        check_implementation(self.implementation)
        check_op_implementations(self.op_implementations)
        if self.mesh is not None and not isinstance(self.mesh, KernelMesh):
            raise TypeError(
                f"FP8Config.mesh must be a KernelMesh (pallas_kernels.sharding) or None, got "
                f"{type(self.mesh).__name__}; wrap a Mesh as KernelMesh(mesh)"
            )

    def implementation_of(self, op: str) -> str:
        """The implementation ``op`` (one of :data:`KERNEL_OPS`) runs: its entry in
        ``op_implementations``, else ``implementation``."""
        if op not in KERNEL_OPS:
            raise ValueError(f"unknown kernel op {op!r}; valid ops are {list(KERNEL_OPS)}")
        return dict(self.op_implementations).get(op, self.implementation)

    def kernel_kwargs(self, op: str) -> dict:
        """``op``'s dispatch settings (a backward reads its group size off what it gets)."""
        return dict(
            implementation=self.implementation_of(op),
            interpret=self.interpret,
            tiles=self.tiles,
            mesh=self.mesh,
        )

    def quantize_kwargs(self, op: str) -> dict:
        """:meth:`kernel_kwargs` plus how forward quantizes activations (format, 1xG groups)."""
        return dict(
            fmt=self.act_format,
            group_size=self.group_size,
            scale_format=self.group_scale,
            **self.kernel_kwargs(op),
        )


DEFAULT_CONFIG = FP8Config()


def _check_float(name: str, x) -> None:
    dtype = jnp.dtype(x.dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or dtype in quant.FORMATS.values():
        raise TypeError(
            f"{name} must be a float array (bfloat16, float16 or float32), got dtype {dtype}"
        )


def _check_pair(op: str, a, b) -> None:
    _check_float("a", a)
    _check_float("b", b)
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(
            f"{op} needs inputs of one shape and dtype, got {a.shape} {a.dtype} and "
            f"{b.shape} {b.dtype}"
        )


# --------------------------------------------------------------------------------------------
# FP8 linear


def materialize(tree):
    """Makes XLA keep FP8 codes as FP8 (an optimization barrier on ``tree``).

    With excess precision allowed (XLA's default) the GPU compiler folds a round trip such as
    ``convert(convert(y, f8), f32)`` back to ``y`` when both ends are in one program: the saved
    "FP8" activation would silently become the float32 value (4x the memory) and the FP8 GEMM a
    BF16 one. The barrier pins the quantized value.
    """
    return jax.lax.optimization_barrier(tree)


def _pin(tree, config: FP8Config):
    """:func:`materialize` unless ``config.codes_barrier`` is off."""
    return materialize(tree) if config.codes_barrier else tree


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
        # here would also hide the FP8 codes from the GEMM rewriter (measured on the H200: an
        # optimization barrier between the codes and the dot turns cuBLASLt FP8 GEMMs into
        # float32 ones).
        pallas=lambda: fp8_quant.quantize_per_tensor_pallas(
            x, tiles=config.tiles, interpret=config.interpret, mesh=mesh, partition=partition, **kw
        ),
        xla=lambda: _per_tensor_xla(x, fmt, config),
    )[1]


def _per_tensor_xla(x, fmt, config: FP8Config) -> quant.QuantizedTensor:
    """XLA's per-tensor quantizer (the reference), pinned by :func:`materialize` unless
    ``config.codes_barrier`` is off."""
    kw = dict(fmt=fmt, group_size=config.group_size)
    return _pin(fp8_quant.quantize_per_tensor_reference(x, **kw), config)


# XLA options under which the FP8 GEMMs compile to cuBLASLt FP8 on a GPU (H200, JAX 0.11.2,
# docs/fp8_gemm.md). By default XLA's Triton GEMM pass wraps every dot whose operands are
# ``convert(fp8)`` into a Triton fusion and autotunes it: a Llama-2-7B layer then took longer than
# 240 s to compile. With Triton GEMMs off the dots go to the cuBLAS rewriter, which emits
# ``__cublas$lt$matmul$f8``. The dot merger is off too: it joins small dots that share an
# operand (q|k|v) into one whose operand is a concatenation, no longer ``convert(codes)``.
GPU_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_dot_merger_threshold_mb": 0}
GPU_XLA_FLAGS = " ".join(f"--{k}={str(v).lower()}" for k, v in GPU_COMPILER_OPTIONS.items())


GPU_BACKENDS = ("gpu", "cuda", "rocm")


def is_gpu_backend(backend: str | None = None) -> bool:
    """Whether ``backend`` (default: JAX's default backend) is a GPU platform by any of the
    names JAX gives one (``gpu``, ``cuda``, ``rocm``)."""
    return (backend or jax.default_backend()) in GPU_BACKENDS


def fp8_compiler_options(backend: str | None = None) -> dict | None:
    """``jax.jit(..., compiler_options=...)`` for programs that use the FP8 linears.

    On a GPU backend this turns off XLA's Triton GEMM fusion and its dot merger, so that the FP8
    GEMMs become cuBLASLt FP8 GEMMs and compile in seconds; elsewhere it returns ``None`` (no
    options). The same setting for a whole process is :data:`GPU_XLA_FLAGS` in ``XLA_FLAGS``,
    set before JAX starts.

    Example:
      >>> step = jax.jit(lambda x: x + 1, compiler_options=fp8_compiler_options())
    """
    return dict(GPU_COMPILER_OPTIONS) if is_gpu_backend(backend) else None


def _fp8_dot(a, b, contracting, config, compute_dtype, out_dtype):
    """``(a.codes * a.scale) . (b.codes * b.scale)`` of two per-tensor quantized operands as one
    FP8 GEMM, float32 accumulation, written in ``out_dtype``.

    A float32 result is spelled ``dot(convert(a_codes), convert(b_codes)) * (a_scale *
    b_scale)``. On the GPU, XLA's Triton GEMM pass runs before its cuBLAS FP8 rewriter and pulls
    the dot's operand producers into a fusion; it takes ``convert(codes)`` but leaves
    ``convert(codes) * scale`` outside when the scale is computed in the same program, and the
    dot then compiles to a float32 GEMM on dequantized copies. With the scales applied after
    the dot, the rewriter sees FP8 operands and folds the scalar product into cuBLASLt's scale
    arguments (measured on the H200 with JAX 0.11.2 by ``benchmarks/probe_fp8_gemm.py``:
    docs/fp8_gemm.md).

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

    Example:
      >>> quantize_weight(jnp.ones((3, 32, 16))).scale.shape
      (3,)
    """
    _check_float("w", w)
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

    Example:
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
    _check_float("x", x)
    weights = _as_weights(w)
    if not weights:
        raise ValueError("fp8_linear needs at least one weight")
    for wi in weights:
        _check_float("w", _master(wi))
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

    Example:
      >>> x = jnp.ones((2, 8, 32), jnp.bfloat16)
      >>> fp8_linear(x, jnp.ones((32, 16)), DEFAULT_CONFIG).shape
      (2, 8, 16)
    """
    return _fp8_linear_fwd(x, w, config)[0]


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


def _fp8_linear_fwd(x, w, config):
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


def _fp8_linear_bwd(config, res, dy):
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


fp8_linear.defvjp(_fp8_linear_fwd, _fp8_linear_bwd)


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

    Example:
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
    y = _linear_with_config(lhs, rhs, config=config)
    return y if preferred_element_type is None else y.astype(preferred_element_type)


# --------------------------------------------------------------------------------------------
# FP8 non-linear ops (1x16 E4M3 residuals)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def fp8_rmsnorm(
    x: jax.Array, weight: jax.Array, eps: float = 1e-6, config: FP8Config = DEFAULT_CONFIG
) -> jax.Array:
    """RMSNorm (``weight * x / sqrt(mean(x^2) + eps)``, float32 math) keeping FP8 ``x``.

    Args:
      x: ``[..., D]``; weight: ``[D]`` (any float dtype); eps: a Python float (static).

    Returns:
      ``[..., D]`` in ``x.dtype``; ``weight``'s gradient comes back in ``weight.dtype``.
    """
    return _fp8_rmsnorm_fwd(x, weight, eps, config)[0]


def _fp8_rmsnorm_fwd(x, weight, eps, config):
    _check_float("x", x)
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rmsnorm weight must have shape {x.shape[-1:]}, got {weight.shape}")
    y, x_q, rstd = fp8_act.rmsnorm_fwd(x, weight, eps, **config.quantize_kwargs("rmsnorm"))
    return y, (*keep((_pin(x_q, config), rstd)), weight)


def _fp8_rmsnorm_bwd(eps, config, res, dy):
    del eps
    x_q, rstd, weight = res
    return fp8_act.rmsnorm_bwd(dy, x_q, rstd, weight, **config.kernel_kwargs("rmsnorm"))


fp8_rmsnorm.defvjp(_fp8_rmsnorm_fwd, _fp8_rmsnorm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def fp8_silu(x: jax.Array, config: FP8Config = DEFAULT_CONFIG) -> jax.Array:
    """``x * sigmoid(x)`` (float32 math, output in ``x.dtype``) keeping FP8 ``x`` (1x16)."""
    return _fp8_silu_fwd(x, config)[0]


def _fp8_silu_fwd(x, config):
    _check_float("x", x)
    y, x_q = fp8_act.silu_fwd(x, **config.quantize_kwargs("silu"))
    return y, keep(_pin(x_q, config))


def _fp8_silu_bwd(config, res, dy):
    return (fp8_act.silu_bwd(dy, res, **config.kernel_kwargs("silu")),)


fp8_silu.defvjp(_fp8_silu_fwd, _fp8_silu_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def fp8_mul(a: jax.Array, b: jax.Array, config: FP8Config = DEFAULT_CONFIG) -> jax.Array:
    """``a * b`` (SwiGLU's product) keeping FP8 ``a`` and ``b`` (1x16) for backward."""
    return _fp8_mul_fwd(a, b, config)[0]


def _fp8_mul_fwd(a, b, config):
    _check_pair("fp8_mul", a, b)
    y, a_q, b_q = fp8_act.mul_fwd(a, b, **config.quantize_kwargs("mul"))
    return y, keep(_pin((a_q, b_q), config))


def _fp8_mul_bwd(config, res, dy):
    return fp8_act.mul_bwd(dy, *res, **config.kernel_kwargs("mul"))


fp8_mul.defvjp(_fp8_mul_fwd, _fp8_mul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def fp8_swiglu(gate: jax.Array, up: jax.Array, config: FP8Config = DEFAULT_CONFIG) -> jax.Array:
    """``silu(gate) * up`` keeping only FP8 ``gate`` and ``up`` (1x16); beyond COAT's op list.

    ``fp8_mul(fp8_silu(gate), up)`` keeps three intermediate-size FP8 tensors (gate, SiLU output,
    up), as COAT does; this fused op keeps two and recomputes the SiLU in backward.
    """
    return _fp8_swiglu_fwd(gate, up, config)[0]


def _fp8_swiglu_fwd(gate, up, config):
    _check_pair("fp8_swiglu", gate, up)
    y, gate_q, up_q = fp8_act.swiglu_fwd(gate, up, **config.quantize_kwargs("swiglu"))
    return y, keep(_pin((gate_q, up_q), config))


def _fp8_swiglu_bwd(config, res, dy):
    return fp8_act.swiglu_bwd(dy, *res, **config.kernel_kwargs("swiglu"))


fp8_swiglu.defvjp(_fp8_swiglu_fwd, _fp8_swiglu_bwd)


def attention_implementation(dtype, choice: str = "auto") -> str:
    """``jax.nn.dot_product_attention``'s ``implementation`` for :attr:`FP8Config.attention`:
    ``"auto"`` is cuDNN's fused attention on the GPU in BF16 and XLA's elsewhere; ``"cudnn"``
    without a GPU raises (JAX itself fails later there, with a message that depends on its
    version)."""
    if choice == "cudnn" and jax.default_backend() != "gpu":
        raise RuntimeError(
            f"attention='cudnn' runs cuDNN's fused attention, which needs a CUDA GPU, and this "
            f"process's backend is {jax.default_backend()!r}: use attention='auto' (cuDNN on a "
            "GPU, XLA's attention elsewhere) or 'xla'"
        )
    if choice != "auto":
        return choice
    return "cudnn" if jax.default_backend() == "gpu" and jnp.dtype(dtype) == jnp.bfloat16 else "xla"


def _attend(q, k, v, is_causal, choice="auto"):
    impl = attention_implementation(q.dtype, choice)
    return jax.nn.dot_product_attention(q, k, v, is_causal=is_causal, implementation=impl)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def fp8_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    is_causal: bool = True,
    config: FP8Config = DEFAULT_CONFIG,
) -> jax.Array:
    """Attention in BF16 that keeps FP8 q, k, v (1x16 along the head dim) for backward.

    Beyond COAT, which keeps attention's q, k, v (and output) in BF16: backward dequantizes the
    saved q, k, v and re-runs the attention forward before its backward (one extra attention
    forward per step). Nothing of the ``[B, N, T, T]`` size is kept on any backend.

    Args:
      q: ``[B, T, N, H]``; k, v: ``[B, S, K, H]`` (GQA when ``K`` divides ``N``), one dtype.
      is_causal: static; config: static :class:`FP8Config`.
    """
    return _fp8_attention_fwd(q, k, v, is_causal, config)[0]


def _check_attention_inputs(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_float(name, t)
        if t.ndim != 4 or t.dtype != q.dtype:
            raise ValueError(
                f"fp8_attention needs [B, T, N, H] arrays of one dtype; got {name} "
                f"{t.shape} {t.dtype} (q is {q.shape} {q.dtype})"
            )


def _kept_qkv(q, k, v, config):
    """q, k and v as the FP8 attention ops keep them: E4M3 codes with 1xG scales, pinned."""
    saved = [
        fp8_quant.quantize_per_group(t, **config.quantize_kwargs("quantize_per_group"))
        for t in (q, k, v)
    ]
    return keep(_pin(tuple(saved), config))


def _fp8_attention_fwd(q, k, v, is_causal, config):
    _check_attention_inputs(q, k, v)
    return _attend(q, k, v, is_causal, config.attention), _kept_qkv(q, k, v, config)


def _fp8_attention_bwd(is_causal, config, res, dy):
    q, k, v = (t.dequantize().astype(dy.dtype) for t in res)
    _, pullback = jax.vjp(lambda q, k, v: _attend(q, k, v, is_causal, config.attention), q, k, v)
    return pullback(dy)


fp8_attention.defvjp(_fp8_attention_fwd, _fp8_attention_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def fp8_attention_linear(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    w,
    is_causal: bool = True,
    config: FP8Config = DEFAULT_CONFIG,
) -> jax.Array:
    """``fp8_linear(attention(q, k, v), w)``: attention and the o_proj as one op whose backward
    does not run the attention forward again.

    Forward is :func:`fp8_attention`'s attention (on the exact q, k, v) followed by
    :func:`fp8_linear`. Kept for backward: the FP8 q, k, v (1xG, as :func:`fp8_attention`),
    the linear's own residuals (its E4M3 per-tensor input, i.e. the attention output, and its
    weights) and the attention's float32 softmax statistics. Backward runs the linear's
    backward, then the attention's backward at the dequantized q, k, v with the forward's
    statistics and the dequantized FP8 output (``coat_jax.attention.backward``: cuDNN on a GPU
    in BF16, the jnp reference elsewhere). ``FP8Config(attention_backward="saved_output")``.

    Args:
      q: ``[B, T, N, H]``; k, v: ``[B, S, K, H]`` (GQA when ``K`` divides ``N``), one dtype.
      w: the o_proj weight ``[N * H, D]`` as :func:`fp8_linear` takes it.
      is_causal: static; config: static :class:`FP8Config`.

    Returns:
      ``[B, T, D]`` in q's dtype.
    """
    return _fp8_attention_linear_fwd(q, k, v, w, is_causal, config)[0]


def _fp8_attention_linear_fwd(q, k, v, w, is_causal, config):
    _check_attention_inputs(q, k, v)
    if isinstance(w, (tuple, list)):
        raise ValueError(
            "fp8_attention_linear takes one o_proj weight [N * H, D] (or its FP8Weight), not a "
            f"{type(w).__name__} of {len(w)}; run fp8_attention and fp8_linear for several"
        )
    impl = attention_implementation(q.dtype, config.attention)
    out, stats = attention.forward(q, k, v, is_causal, impl)
    b, t, n, h = q.shape
    y, linear_res = _fp8_linear_fwd(out.reshape(b, t, n * h), w, config)
    return y, (_kept_qkv(q, k, v, config), keep(stats), linear_res)


def _fp8_attention_linear_bwd(is_causal, config, res, dy):
    saved, stats, linear_res = res
    d_out, dw = _fp8_linear_bwd(config, linear_res, dy)
    q, k, v = (x.dequantize().astype(dy.dtype) for x in saved)
    # The linear's kept input is the attention output's E4M3 per-tensor codes, [B * T, N * H].
    out = linear_res[0].dequantize().astype(dy.dtype).reshape(q.shape)
    impl = attention_implementation(q.dtype, config.attention)
    dq, dk, dv = attention.backward(q, k, v, out, stats, d_out.reshape(q.shape), is_causal, impl)
    return dq, dk, dv, dw


fp8_attention_linear.defvjp(_fp8_attention_linear_fwd, _fp8_attention_linear_bwd)


@jax.custom_vjp
def fp8_add(a: jax.Array, b: jax.Array) -> jax.Array:
    """Residual add in the inputs' dtype; its backward needs (and keeps) nothing.

    XLA's autodiff keeps nothing for an add either; this op exists so that the residual stream's
    FP8 copy is unambiguous: it is the one the consuming :func:`fp8_rmsnorm` saves.
    """
    return _fp8_add_fwd(a, b)[0]


def _fp8_add_fwd(a, b):
    _check_pair("fp8_add", a, b)
    return a + b, None


def _fp8_add_bwd(res, dy):
    del res
    return dy, dy


fp8_add.defvjp(_fp8_add_fwd, _fp8_add_bwd)


# --------------------------------------------------------------------------------------------
# observed ops: the same ops, also returning the scales they quantized with (telemetry)


def _observed(op, fwd, bwd, saved_scales):
    """``op`` (a ``custom_vjp`` with forward ``fwd`` and backward ``bwd``) as a ``custom_vjp``
    returning ``(out, saved_scales(residuals))``: the scales of the FP8 tensors its forward
    keeps for backward, the very arrays backward reads, in their stored form. Forward and
    backward are ``op``'s own; the scales' cotangent is dropped (a scale is a statistic of the
    input, held constant as the FP8 rounding is)."""

    def observed(*args):
        return observed_fwd(*args)[0]

    def observed_fwd(*args):
        out, res = fwd(*args)
        return (out, saved_scales(res)), res

    def observed_bwd(*args):
        *static, res, (dy, _) = args
        return bwd(*static, res, dy)

    observed = jax.custom_vjp(observed, nondiff_argnums=op.nondiff_argnums)
    observed.defvjp(observed_fwd, observed_bwd)
    return observed


# ``(out, scales)``: the op's output and the scales of what it keeps for backward: the linear
# input's per-tensor scale (a scalar), or the 1xG scales of the non-linear ops' saved inputs
# (``[..., D / G]`` each, float32 or E8M0 bytes as ``FP8Config.group_scale`` stores them).
observed_linear = _observed(fp8_linear, _fp8_linear_fwd, _fp8_linear_bwd, lambda r: r[0].scale)
observed_rmsnorm = _observed(
    fp8_rmsnorm, _fp8_rmsnorm_fwd, _fp8_rmsnorm_bwd, lambda r: (r[0].scale,)
)
observed_silu = _observed(fp8_silu, _fp8_silu_fwd, _fp8_silu_bwd, lambda r: (r.scale,))
observed_mul = _observed(fp8_mul, _fp8_mul_fwd, _fp8_mul_bwd, lambda r: (r[0].scale, r[1].scale))
observed_swiglu = _observed(
    fp8_swiglu, _fp8_swiglu_fwd, _fp8_swiglu_bwd, lambda r: (r[0].scale, r[1].scale)
)
observed_attention = _observed(
    fp8_attention, _fp8_attention_fwd, _fp8_attention_bwd, lambda r: tuple(t.scale for t in r)
)
# ``(out, (q, k, v scales, the o_proj input's scale))``
observed_attention_linear = _observed(
    fp8_attention_linear,
    _fp8_attention_linear_fwd,
    _fp8_attention_linear_bwd,
    lambda r: (tuple(t.scale for t in r[0]), r[2][0].scale),
)


def placeholder(compute):
    """A function of no arguments returning what ``compute()`` returns in structure, dtype
    and shape, filled with NaN (floats) or -1 (integers: no count is negative), and computing
    nothing: the other branch of a telemetry's ``lax.cond``.

    Example:
      >>> placeholder(lambda: (jnp.ones(2), jnp.int32(3)))()
      (Array([nan, nan], dtype=float32), Array(-1, dtype=int32))
    """

    def fill(x):
        return jnp.full(x.shape, jnp.nan if jnp.issubdtype(x.dtype, jnp.floating) else -1, x.dtype)

    shapes = jax.eval_shape(compute)
    return lambda: jax.tree.map(fill, shapes)


class ScaleRecorder:
    """Collects the scales the FP8 ops of one traced call quantize activations with, in call
    order, for the activation telemetry (``ops_for(..., recorder=)``).

    ``linear``: the per-tensor scale of each FP8 linear's input (a float32 scalar); ``group``:
    the 1xG scales of each tensor a non-linear op keeps (``fp8_rmsnorm``'s input, ``fp8_silu``'s,
    both of ``fp8_mul``'s or of ``fp8_swiglu``'s, ``fp8_attention``'s q, k and v). Both as the
    ops computed them: the ops return them beside their outputs (``observed_*``), so nothing is
    quantized twice.

    A recorder lives within one trace (a layer's body under ``jax.checkpoint`` or ``scan``):
    :meth:`summary` turns what it holds into a few arrays that cross those boundaries.
    """

    def __init__(self, config: FP8Config = DEFAULT_CONFIG):
        self.config = config
        self.linear: list[jax.Array] = []
        self.group: list[jax.Array] = []

    def record_linear(self, scale: jax.Array) -> None:
        # No gradient flows into the telemetry: its computations stay out of the backward pass.
        self.linear.append(jax.lax.stop_gradient(scale))

    def record_group(self, scales) -> None:
        self.group.extend(jax.lax.stop_gradient(s) for s in scales)

    def summary(self, observe) -> dict:
        """The recorded scales as telemetry: ``{"linear": [n_linear]}`` (the scales as they
        are: scalars cost nothing) and ``{"group": {"max", "min", "nonfinite"}: [n_group]}``
        per 1xG-scaled tensor: its largest scale, its smallest scale of a group holding a
        non-zero value (``inf`` if none does), and its count of NaN or infinite scales. A
        key is absent when nothing of its kind was recorded.

        The per-group reductions read every scale, so they run in a ``lax.cond`` on
        ``observe`` (a boolean scalar): where it is false they are placeholders (NaN, -1) and
        nothing is read.
        """
        out = {}
        if self.linear:
            out["linear"] = jnp.stack(self.linear)
        if self.group:
            compute = lambda: _group_summary(self.group, self.config)
            out["group"] = jax.lax.cond(observe, compute, placeholder(compute))
        return out


def _group_summary(stored: list[jax.Array], config: FP8Config) -> dict[str, jax.Array]:
    """Largest scale, smallest scale above an all-zero group's, NaN/inf count, per tensor."""
    fmt, scale_format = config.act_format, config.group_scale
    # The scale quant.absmax_scale gives a group of zeros (max|x| = 0), stored and read back as
    # the ops store it: every group with a non-zero value has a larger one.
    zero = quant.absmax_scale(jnp.zeros([], jnp.float32), quant.FP8_MAX[fmt], scale_format)
    zero = quant.decode_scale(quant.encode_scale(zero, scale_format))
    largest, smallest, nonfinite = [], [], []
    for s in stored:
        s = quant.decode_scale(s)
        peak = jnp.max(s)
        # Zero groups are filled with the largest scale, not a constant: a constant the size of
        # the scales would be hoisted out of a differentiated scan and made every step.
        least = jnp.min(jnp.where(s > zero, s, peak))
        largest.append(peak)
        smallest.append(jnp.where(peak > zero, least, jnp.inf))
        nonfinite.append(jnp.sum(~jnp.isfinite(s), dtype=jnp.int32))
    return {
        "max": jnp.stack(largest),
        "min": jnp.stack(smallest),
        "nonfinite": jnp.stack(nonfinite),
    }


# --------------------------------------------------------------------------------------------
# plain ops (the "bf16" baseline: what a JAX user writes, XLA autodiff)


def linear(x: jax.Array, w):
    """``x @ w`` in ``x.dtype`` (the master weight is cast to it, as ``nnx.Linear(dtype=...)``).

    A tuple ``w`` gives a tuple of outputs: one dot per weight, so autodiff keeps ``x`` once and
    no concatenated weight.
    """
    x = keep(x)
    if isinstance(w, (tuple, list)):
        return tuple(jnp.einsum("...k,kn->...n", x, wi.astype(x.dtype)) for wi in w)
    return jnp.einsum("...k,kn->...n", x, w.astype(x.dtype))


def rmsnorm(x: jax.Array, weight: jax.Array, eps: float = 1e-6) -> jax.Array:
    """Hugging Face Llama's RMSNorm: float32 statistics, output in ``x.dtype``."""
    x = keep(x)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def silu(x: jax.Array) -> jax.Array:
    return jax.nn.silu(keep(x))


def mul(a: jax.Array, b: jax.Array) -> jax.Array:
    return keep(a) * keep(b)


def add(a: jax.Array, b: jax.Array) -> jax.Array:
    return a + b


# --------------------------------------------------------------------------------------------
# op sets


class OpSet(NamedTuple):
    """The ops a Llama layer needs, for one precision mode (see :func:`ops_for`)."""

    precision: str
    linear: Callable[[jax.Array, jax.Array], jax.Array]
    rmsnorm: Callable[[jax.Array, jax.Array, float], jax.Array]
    silu: Callable[[jax.Array], jax.Array]
    mul: Callable[[jax.Array, jax.Array], jax.Array]
    add: Callable[[jax.Array, jax.Array], jax.Array]
    # Causal attention ``(q, k, v) -> out``; None: the model's own (BF16, cuDNN on a GPU).
    attention: Callable | None = None
    # ``(gate, up) -> silu(gate) * up`` as one op; None: ``mul(silu(gate), up)``.
    swiglu: Callable | None = None
    # ``(q, k, v, o_proj weight) -> linear(attention(q, k, v), w)`` as one op
    # (:func:`fp8_attention_linear`); None: ``attention`` then ``linear``.
    attention_linear: Callable | None = None

    def silu_mul(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        """``silu(gate) * up``: the fused op where the set has one, else the SiLU and product."""
        return self.mul(self.silu(gate), up) if self.swiglu is None else self.swiglu(gate, up)


def ops_for(
    precision: str, config: FP8Config = DEFAULT_CONFIG, *, recorder: ScaleRecorder | None = None
) -> OpSet:
    """The op set of a precision mode.

    Args:
      precision: ``"bf16"`` (plain jnp with XLA autodiff: the baseline), ``"fp8"`` (FP8 linear
        layers only, TransformerEngine-style) or ``"coat"`` (COAT's full precision flow).
      config: static FP8 settings for the FP8 ops (with ``swiglu="fused"`` the coat set's
        ``swiglu`` is :func:`fp8_swiglu`).
      recorder: a :class:`ScaleRecorder` that the FP8 ops hand the scales they quantize with
        (the activation telemetry). The ops are then the ``observed_*`` variants: the same
        forward and backward, the same results. ``None``: the plain FP8 ops.

    Example:
      >>> ops = ops_for("coat")
      >>> ops.silu(jnp.ones((2, 32), jnp.bfloat16)).dtype
      dtype(bfloat16)
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {list(PRECISIONS)}")
    if not isinstance(config, FP8Config):
        raise TypeError(f"config must be an FP8Config, got {type(config).__name__}")
    plain = OpSet(precision, linear, rmsnorm, silu, mul, add)
    if precision == "bf16":
        return plain
    if recorder is not None:
        return _recording_ops(plain, precision, config, recorder)
    fp8_lin = functools.partial(_linear_with_config, config=config)
    if precision == "fp8":
        return plain._replace(linear=fp8_lin)
    fused = config.swiglu == "fused"
    return OpSet(
        precision,
        linear=fp8_lin,
        rmsnorm=functools.partial(_rmsnorm_with_config, config=config),
        silu=functools.partial(_silu_with_config, config=config),
        mul=functools.partial(_mul_with_config, config=config),
        add=fp8_add,
        swiglu=functools.partial(_swiglu_with_config, config=config) if fused else None,
    )


def _recording_ops(plain: OpSet, precision: str, config: FP8Config, recorder) -> OpSet:
    """:func:`ops_for`'s FP8 ops as their ``observed_*`` variants, handing ``recorder`` the
    scales (closures: a recorder belongs to one trace, so these op sets are never cached)."""
    if config.linear_scaling != "tensor":
        raise ValueError(
            f"the activation telemetry records per-tensor linear scales, and linear_scaling="
            f"{config.linear_scaling!r} makes none; turn the telemetry off or use 'tensor'"
        )

    def linear(x, w):
        y, scale = observed_linear(x, w, config)
        recorder.record_linear(scale)
        return y

    def rmsnorm(x, weight, eps=1e-6):
        y, scales = observed_rmsnorm(x, weight, float(eps), config)
        recorder.record_group(scales)
        return y

    def silu(x):
        y, scales = observed_silu(x, config)
        recorder.record_group(scales)
        return y

    def mul(a, b):
        y, scales = observed_mul(a, b, config)
        recorder.record_group(scales)
        return y

    def swiglu(gate, up):
        y, scales = observed_swiglu(gate, up, config)
        recorder.record_group(scales)
        return y

    if precision == "fp8":
        return plain._replace(linear=linear)
    fused = swiglu if config.swiglu == "fused" else None
    return OpSet(
        precision, linear=linear, rmsnorm=rmsnorm, silu=silu, mul=mul, add=fp8_add, swiglu=fused
    )


def recorded_attention_linear(config: FP8Config, recorder: ScaleRecorder):
    """Causal :func:`fp8_attention_linear` ``(q, k, v, w) -> out`` that hands ``recorder`` the
    1xG scales of the q, k and v it keeps, then the o_proj input's per-tensor scale (the order
    of :func:`recorded_attention` followed by the linear)."""

    def attention_linear(q, k, v, w):
        out, (group, linear_scale) = observed_attention_linear(q, k, v, w, True, config)
        recorder.record_group(group)
        recorder.record_linear(linear_scale)
        return out

    return attention_linear


def recorded_attention(config: FP8Config, recorder: ScaleRecorder):
    """Causal ``fp8_attention`` ``(q, k, v) -> out`` that hands ``recorder`` the 1xG scales of
    the q, k and v it keeps (``Llama(fp8_attention=True)`` under the activation telemetry)."""

    def attention(q, k, v):
        out, scales = observed_attention(q, k, v, True, config)
        recorder.record_group(scales)
        return out

    return attention


def _linear_with_config(x, w, *, config):
    if config.linear_scaling != "tensor":
        return fp8_rowwise.fp8_rowwise_linear(x, w, config)
    return fp8_linear(x, w, config)


def _rmsnorm_with_config(x, weight, eps=1e-6, *, config):
    return fp8_rmsnorm(x, weight, float(eps), config)


def _silu_with_config(x, *, config):
    return fp8_silu(x, config)


def _mul_with_config(a, b, *, config):
    return fp8_mul(a, b, config)


def _swiglu_with_config(gate, up, *, config):
    return fp8_swiglu(gate, up, config)

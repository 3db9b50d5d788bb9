"""The static settings of the FP8 ops: :class:`FP8Config` and the values each option takes.

An :class:`FP8Config` is frozen and hashable: the ops take it as a non-differentiable argument,
so one compiled program serves one configuration.
"""

from __future__ import annotations

import dataclasses

from coat_jax import quant
from pallas_kernels import fp8_quant
from pallas_kernels.dispatch import check_implementation
from pallas_kernels.sharding import KernelMesh

PRECISIONS = ("bf16", "fp8", "coat")
GEMM_DEQUANT = ("compute", "float32")
GEMM_OUTPUTS = ("compute", "float32")
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
# How the linears of the op sets scale their FP8 operands (``FP8Config.linear_scaling``):
# "tensor" one scale per tensor (COAT, ``fp8_linear``); "row" and "row_gw_hp" one per token
# and per output channel (``coat_jax.fp8.rowwise``), differing in the weight gradient's GEMM;
# "block" one per 1x128 activation tile and 128x128 weight block (``coat_jax.fp8.blockwise``).
LINEAR_SCALINGS = ("tensor", "row", "row_gw_hp", "block")
# The ops whose kernels ``FP8Config.op_implementations`` picks one by one.
KERNEL_OPS = (
    "quantize_per_tensor",
    "quantize_per_group",
    "rmsnorm",
    "silu",
    "mul",
    "swiglu",
    "rmsnorm_rowwise",
    "swiglu_rowwise",
    "blockwise_gemm",
)


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


@dataclasses.dataclass(frozen=True)
class FP8Config:
    """Static settings of the FP8 ops (hashable: passed as a non-differentiable argument).

    Attributes:
      act_format: FP8 format of forward activations and weights (COAT: E4M3).
      grad_format: FP8 format of output gradients entering backward GEMMs (COAT: E5M2).
      group_size: G of the 1xG groups of the non-linear ops and of group scaling (COAT: 16).
      implementation: "auto" (Pallas kernels where they apply: on a GPU, on one device or with
        ``mesh`` given; XLA elsewhere), "xla" or "pallas", for the quantizers and the fused
        non-linear kernels, and for the block-scaled GEMM of ``linear_scaling="block"``; the
        other GEMMs are always XLA dots.
      op_implementations: per-op exceptions to ``implementation``, ``((op, implementation),
        ...)`` with ``op`` one of :data:`KERNEL_OPS` (``"quantize_per_tensor"``: the linear
        layers' per-tensor quantizer; ``"quantize_per_group"``: FP8 attention's 1xG q, k, v;
        ``"rmsnorm"``, ``"silu"``, ``"mul"``, ``"swiglu"``: the fused non-linear ops, forward
        and backward; ``"rmsnorm_rowwise"``, ``"swiglu_rowwise"``: the producers that write a
        row-wise linear's operand, ``coat_jax.fp8.rowwise_fused``, forward;
        ``"blockwise_gemm"``: the block-scaled GEMM of ``linear_scaling="block"``). Lets a program run
        XLA's fusions where they are faster and a Pallas kernel where it is
        (docs/bench_fp8_kernels.md, docs/bench_fp8_rowwise.md).
      interpret: run Pallas kernels in interpret mode (CPU tests; "auto" then tries them too).
      tiles: tile sizes of the Pallas kernels.
      mesh: the :class:`~pallas_kernels.sharding.KernelMesh` of a multi-device program (its
        mesh, the batch axes the activations' leading axis is split over, the FSDP axis of the
        weights): the Pallas kernels then run on each shard, and per-tensor scales take the
        maximum over the mesh. ``None``: one device, or (with "auto") XLA on several.
      gemm_dequant: dtype the FP8 codes are converted to in the ``dot(convert(codes), ...)``
        pattern that XLA rewrites to cuBLASLt's FP8 GEMM: "float32" (default) or "compute" (the
        activations' dtype). Both are exact (FP8 values are exact in BF16); the GEMM accumulates
        in float32 either way. docs/fp8_gemm.md has which spellings XLA's GPU compiler
        rewrites. With ``gemm_output="compute"`` the GEMMs that write the activations' dtype
        convert to it.
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
        8-bit exponent (OCP MX's E8M0), 1 byte per 16 values: less kept for backward per
        layer (docs/memory_options.md, "One-byte group scales"). The codes
        then differ: each value's relative FP8 rounding is unchanged, a group's largest value
        lands in (fmax / 2, fmax] rather than at fmax.
      attention: the kernel of the model's attention (and of :func:`fp8_attention`'s forward
        and its re-run in backward): ``"auto"`` (default) cuDNN's fused attention on a GPU in
        BF16, XLA's elsewhere; ``"xla"`` XLA's everywhere (the trainer's ``deterministic``
        takes it: with ``xla_gpu_deterministic_ops`` BF16 Llama steps failed to compile while
        the float32 step, on XLA's attention, compiled; docs/accuracy.md); ``"cudnn"`` cuDNN's
        (GPU only).
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
        :func:`~coat_jax.fp8.residuals.materialize` (default ``True``). Needed wherever the
        program may be compiled with XLA's excess precision (its default), which can fold a
        quantize-dequantize round trip back into the unquantized value. ``False`` is for
        programs compiled with ``xla_allow_excess_precision=False``, where nothing folds: XLA
        may then write the kept codes straight into a scanned model's stacked residuals
        instead of into a buffer of their own that a device copy moves there (smaller and
        slower in the trainer's step: docs/bench_codes_barrier.md).
      linear_scaling: how the FP8 linears of ``ops_for`` scale their operands (static).
        ``"tensor"`` (default, COAT): one scale per tensor (``fp8_linear``). ``"row"``: one
        per token of the input and one per output channel of the weight, backward GEMMs scaled
        along their contraction axes; ``"row_gw_hp"``: the same with the weight gradient in the
        compute dtype (:func:`coat_jax.fp8.rowwise.fp8_rowwise_linear`). ``"block"``: one
        scale per 1x128 tile of the input and per 128x128 block of the weight, applied inside
        the GEMM's contraction loop, FP8 backward GEMMs scaled likewise
        (:func:`coat_jax.fp8.blockwise.fp8_blockwise_linear`). All but ``"tensor"`` take
        ``weight_residual="master"`` and ``attention_backward="recompute"`` only. In the
        ``coat`` op set the row-wise ones also run each RMSNorm with the linear it feeds, and
        (with ``swiglu="fused"``) the SwiGLU with the down projection, as one op whose producer
        writes the row codes (:mod:`coat_jax.fp8.rowwise_fused`).
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
        if self.linear_scaling not in LINEAR_SCALINGS:
            raise ValueError(
                f"linear_scaling={self.linear_scaling!r} is not one of {list(LINEAR_SCALINGS)}: "
                "'tensor' scales each linear's operands per tensor, 'row' per token and output "
                "channel with FP8 backward GEMMs, 'row_gw_hp' the same with the weight gradient "
                "in BF16, 'block' per 1x128 activation tile and 128x128 weight block"
            )
        if self.linear_scaling != "tensor" and self.weight_residual != "master":
            raise ValueError(
                f"linear_scaling={self.linear_scaling!r} re-quantizes the master weight per "
                f"channel or block, and weight_residual={self.weight_residual!r} hands per-tensor codes; "
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

    def group_kwargs(self) -> dict:
        """How forward quantizes activations: format, 1xG groups and their scales' format."""
        return dict(fmt=self.act_format, group_size=self.group_size, scale_format=self.group_scale)

    def quantize_kwargs(self, op: str) -> dict:
        """:meth:`kernel_kwargs` plus :meth:`group_kwargs`."""
        return dict(**self.group_kwargs(), **self.kernel_kwargs(op))


DEFAULT_CONFIG = FP8Config()

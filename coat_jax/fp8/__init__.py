"""The FP8 ops of COAT's precision flow, one job per module; ``coat_jax.fp8_ops`` is their
public face (the op sets by precision, and every name below re-exported).

- ``config``: :class:`~coat_jax.fp8.config.FP8Config` and the values of its options.
- ``residuals``: the remat names of what the ops keep, and the FP8 codes barrier.
- ``checks``: the input checks the ops share.
- ``compiler``: XLA options under which the FP8 GEMMs become cuBLASLt FP8 GEMMs.
- ``linear``: ``fp8_linear``, ``fp8_dot_general``, FP8 weights (``FP8Weight``,
  ``quantize_weight``, ``prequantized``).
- ``elementwise``: ``fp8_rmsnorm``, ``fp8_silu``, ``fp8_mul``, ``fp8_swiglu``, ``fp8_add``.
- ``attention``: ``fp8_attention``, ``fp8_attention_linear``.
- ``plain``: the plain ops of the ``"bf16"`` precision.
- ``recording``: the ops' ``observed_*`` variants and ``ScaleRecorder`` (activation telemetry).
- ``rowwise``: ``fp8_rowwise_linear``, the linear of ``FP8Config.linear_scaling`` ``"row"`` and
  ``"row_gw_hp"`` (per-token and per-output-channel scales).
- ``rowwise_fused``: the row-wise linear with the op producing its input, as one op.
- ``blockwise``: ``fp8_blockwise_linear``, the linear of ``FP8Config.linear_scaling`` ``"block"``
  (1x128 activation tiles, 128x128 weight blocks, DeepSeek-V3's scaling).
"""

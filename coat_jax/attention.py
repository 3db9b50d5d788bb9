"""Attention: the one implementation every attention of coat-jax runs.

:func:`attend` is ``jax.nn.dot_product_attention`` on the kernel
:func:`attention_implementation` picks: the model's attention, FP8 attention's forward and its
re-run in backward, and decoding with a KV cache (which passes a mask) all run it.
:func:`forward` and :func:`backward` are attention with its softmax statistics, and its
backward from a given output.

A flash attention's backward needs, besides q, k, v and the output gradient, the forward's
output ``O`` (for ``D = rowsum(dO * O)``) and the log-sum-exp of each query row's logits. JAX's
own attention keeps both in BF16; :func:`coat_jax.fp8_ops.fp8_attention_linear` instead keeps
the output as the FP8 codes its ``o_proj`` GEMM reads anyway, plus the float32 log-sum-exp
(``B * N * T * 4`` bytes), and calls :func:`backward` with the dequantized output.

Two implementations of those, picked by :func:`attention_implementation`:

- ``"cudnn"``: cuDNN's fused flash attention, forward with its statistics and backward from
  given statistics and output. JAX has no public entry point for the second, so this goes
  through ``jax._src.cudnn.fused_attention_stablehlo`` (the rules of its ``custom_vjp``, the
  same in JAX 0.10.2 and 0.11); :func:`cudnn_available` says whether that module has them.
- ``"xla"``: the plain-jnp reference below (the CPU path), in float32; it materializes the
  ``[B, N, T, S]`` probabilities transiently, as XLA's own attention does.

Layouts: q ``[B, T, N, H]``, k and v ``[B, S, K, H]`` with ``K`` dividing ``N`` (grouped-query
attention), the output as q. Statistics: float32 ``[B, N, T]`` from both implementations
(cuDNN's layout, which the reference follows); each implementation's statistics go back to its
own :func:`backward`.
"""

from __future__ import annotations

import functools
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np

IMPLEMENTATIONS = ("cudnn", "xla")


def _check(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if (
            t.ndim != 4
            or t.dtype != q.dtype
            or t.shape[0] != q.shape[0]
            or t.shape[3] != q.shape[3]
        ):
            raise ValueError(
                f"attention needs q [B, T, N, H] and k, v [B, S, K, H] of one dtype; got q "
                f"{q.shape} {q.dtype}, {name} {t.shape} {t.dtype}"
            )
    if k.shape != v.shape or k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"attention needs q [B, T, N, H] and k, v [B, S, K, H] with K dividing N; got q "
            f"{q.shape}, k {k.shape}, v {v.shape}"
        )


def _scale(q) -> float:
    """``1/sqrt(H)``, as ``jax.nn.dot_product_attention``."""
    return 1.0 / math.sqrt(q.shape[-1])


def _check_implementation(implementation: str) -> str:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"attention implementation {implementation!r} is not one of {list(IMPLEMENTATIONS)}"
        )
    if implementation == "cudnn" and not cudnn_available():
        raise NotImplementedError(
            "this JAX has no cuDNN attention backward rule to call "
            "(jax._src.cudnn.fused_attention_stablehlo._dot_product_attention_bwd_rule); "
            "use FP8Config(attention='xla') or attention_backward='recompute'"
        )
    return implementation


@functools.cache
def _cudnn_module():
    try:
        from jax._src.cudnn import fused_attention_stablehlo as module
    except ImportError:
        return None
    names = (
        "dot_product_attention",
        "_dot_product_attention_bwd_rule",
        "MaskType",
        "_normalize_layout",
        "check_cudnn_version",
    )
    if not all(hasattr(module, n) for n in names):
        return None
    # (scale, seed, dropout_rate, variadic_args, mask_type, layout, sliding_window_length,
    # cudnn_version, return_residual, res, grad_output): what backward passes, in JAX 0.10-0.11.
    params = inspect.signature(module._dot_product_attention_bwd_rule).parameters
    return module if len(params) == 11 else None


def cudnn_available() -> bool:
    """Whether this JAX exposes the cuDNN attention rules :func:`backward` calls."""
    return _cudnn_module() is not None


def attention_implementation(dtype, choice: str = "auto") -> str:
    """``jax.nn.dot_product_attention``'s ``implementation`` for
    :attr:`coat_jax.fp8_ops.FP8Config.attention`: ``"auto"`` is cuDNN's fused attention on the
    GPU in BF16 and XLA's elsewhere; ``"cudnn"`` without a GPU raises (JAX itself fails later
    there, with a message that depends on its version)."""
    if choice == "cudnn" and jax.default_backend() != "gpu":
        raise RuntimeError(
            f"attention='cudnn' runs cuDNN's fused attention, which needs a CUDA GPU, and this "
            f"process's backend is {jax.default_backend()!r}: use attention='auto' (cuDNN on a "
            "GPU, XLA's attention elsewhere) or 'xla'"
        )
    if choice != "auto":
        return choice
    return "cudnn" if jax.default_backend() == "gpu" and jnp.dtype(dtype) == jnp.bfloat16 else "xla"


def attend(
    q, k, v, *, is_causal: bool, implementation: str, mask=None, window=None, segment_ids=None
):
    """``jax.nn.dot_product_attention`` of q ``[B, T, N, H]`` and k, v ``[B, S, K, H]`` (GQA),
    scale ``1/sqrt(H)``, on ``implementation`` (``"cudnn"`` or ``"xla"``, as
    :func:`attention_implementation` resolves it); ``mask`` (boolean, broadcast to ``[B, N, T,
    S]``): which keys each query may attend to, besides the causal mask; ``window`` (an int):
    each query attends to at most the ``window`` latest keys, itself included (Mistral's
    sliding window, as transformers masks it). ``segment_ids`` (int ``[B, T]``, self-attention,
    T == S): a query attends only to keys of its own segment (the documents of a packed window);
    XLA's implementation only, as the trainer runs it.

    Raises:
      ValueError: ``segment_ids`` with ``implementation="cudnn"``.
    """
    if segment_ids is not None:
        if implementation != "xla":
            raise ValueError(
                f"attention between documents is masked on XLA's attention only, and this one "
                f"runs on {implementation!r}; use implementation='xla' (the trainer does so "
                "with attention_across_documents=false)"
            )
        same_B1TS = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
        mask = same_B1TS if mask is None else mask & same_B1TS
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        mask=mask,
        is_causal=is_causal,
        local_window_size=None if window is None else (window - 1, 0),
        implementation=implementation,
    )


def forward(q, k, v, is_causal: bool, implementation: str):
    """``(out, stats)``: causal (or full) attention of q, k, v with scale ``1/sqrt(H)`` (as
    ``jax.nn.dot_product_attention``), and the float32 statistics :func:`backward` takes."""
    _check(q, k, v)
    scale = _scale(q)
    if _check_implementation(implementation) == "cudnn":
        fa = _cudnn_module()
        mask = fa.MaskType.CAUSAL if is_causal else fa.MaskType.NO_MASK
        return fa.dot_product_attention(q, k, v, scale=scale, mask_type=mask, return_residual=True)
    return forward_reference(q, k, v, is_causal, scale)


def backward(q, k, v, out, stats, dout, is_causal: bool, implementation: str):
    """``(dq, dk, dv)`` of the attention from the forward's ``out`` and ``stats`` (of the same
    implementation's :func:`forward`), without running the forward again."""
    _check(q, k, v)
    if out.shape != q.shape or dout.shape != q.shape:
        raise ValueError(
            f"attention backward needs out and dout shaped as q {q.shape}; got {out.shape}, "
            f"{dout.shape}"
        )
    b, t, n, _ = q.shape
    if stats.shape != (b, n, t) or stats.dtype != jnp.float32:
        raise ValueError(
            f"attention backward needs the forward's float32 statistics [B, N, T] = {(b, n, t)}; "
            f"got {stats.shape} {stats.dtype} (pass what forward returned, unchanged)"
        )
    scale = _scale(q)
    if _check_implementation(implementation) == "cudnn":
        fa = _cudnn_module()
        mask = fa.MaskType.CAUSAL if is_causal else fa.MaskType.NO_MASK
        none = jnp.zeros((0,), q.dtype)
        # The residuals of its custom_vjp, in its order: q, k, v, bias, q_seqlen, kv_seqlen,
        # q_offsets, kv_offsets, page_table_k, page_table_v, softmax statistics, output.
        res = (q, k, v, none, none, none, none, none, none, none, stats, out.astype(q.dtype))
        grads = fa._dot_product_attention_bwd_rule(
            scale,
            42,  # seed (no dropout)
            0.0,  # dropout rate
            (False, False),  # (has bias, has dbias)
            mask,
            fa._normalize_layout("BTNH").value,
            None,  # sliding window
            fa.check_cudnn_version(),
            False,  # return_residual
            res,
            dout.astype(q.dtype),
        )
        return tuple(grads[:3])
    return backward_reference(q, k, v, out, stats, dout, is_causal, scale)


def _logits(q, k, is_causal, scale):
    """``[B, K, G, T, S]`` float32 logits of q grouped as ``[B, T, K, G, H]`` (GQA), masked."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    q_grouped = q.reshape(b, t, kh, n // kh, h)
    logits = jnp.einsum(
        "btkgh,bskh->bkgts", q_grouped, k, preferred_element_type=jnp.float32
    ) * jnp.float32(scale)
    if is_causal:
        # Query i attends to keys j <= i (top-left aligned, as jax.nn.dot_product_attention).
        allowed = np.tril(np.ones((t, s), bool))
        logits = jnp.where(allowed, logits, -jnp.inf)
    return logits


def forward_reference(q, k, v, is_causal: bool, scale: float):
    """The jnp reference of :func:`forward`: ``(out, lse)`` with lse ``[B, N, T]`` float32."""
    b, t, n, h = q.shape
    logits = _logits(q, k, is_causal, scale)
    lse = jax.nn.logsumexp(logits, axis=-1)
    probs = jnp.exp(logits - lse[..., None])
    out = jnp.einsum(
        "bkgts,bskh->btkgh", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    return out.reshape(b, t, n, h).astype(q.dtype), lse.reshape(b, n, t)


def backward_reference(q, k, v, out, lse, dout, is_causal: bool, scale: float):
    """The jnp reference of :func:`backward` (flash attention's backward, in float32):
    ``P = exp(logits - lse)``, ``dv = P^T dO``, ``dS = P * (dO v^T - rowsum(dO * O))``,
    ``dq = dS k * scale``, ``dk = dS^T q * scale``."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    f32 = jnp.float32
    logits = _logits(q, k, is_causal, scale)
    probs = jnp.exp(logits - lse.reshape(b, kh, g, t)[..., None].astype(f32))
    do = dout.reshape(b, t, kh, g, h).astype(f32)
    o = out.reshape(b, t, kh, g, h).astype(f32)
    dv = jnp.einsum("bkgts,btkgh->bskh", probs, do)
    dp = jnp.einsum("btkgh,bskh->bkgts", do, v.astype(f32))
    d = jnp.einsum("btkgh,btkgh->bkgt", do, o)
    ds = probs * (dp - d[..., None])
    dq = jnp.einsum("bkgts,bskh->btkgh", ds, k.astype(f32)) * scale
    dk = jnp.einsum("bkgts,btkgh->bskh", ds, q.reshape(b, t, kh, g, h).astype(f32)) * scale
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

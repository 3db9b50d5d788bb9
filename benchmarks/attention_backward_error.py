"""How far FP8 attention's gradients are from the exact ones, by backward, as attention sharpens.

For random q, k, v (BF16, q and k scaled by ``--scales`` so that the logits' spread grows) and a
random output gradient, the relative Frobenius error of dq, dk, dv against float32 attention's
exact gradients, for the two backwards of ``FP8Config.attention_backward``:

- ``recompute``: the forward re-run on the dequantized FP8 q, k, v (E4M3, 1x16 groups), then
  its backward (what ``fp8_attention`` does);
- ``saved_output``: the backward at the dequantized q, k, v with the forward's statistics (of
  the exact q, k) and the output's E4M3 per-tensor codes (what ``fp8_attention_linear`` does).

Both use the jnp reference of ``coat_jax.attention`` in float32, so this runs on the CPU::

    python benchmarks/attention_backward_error.py [--seq 512 --heads 8 --kv-heads 4 --head-dim 128]
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from coat_jax import attention
from coat_jax.fp8_ops import FP8Config
from pallas_kernels import fp8_quant


def _rel(a, ref):
    a, ref = jnp.asarray(a, jnp.float32), jnp.asarray(ref, jnp.float32)
    return float(jnp.linalg.norm(a - ref) / jnp.linalg.norm(ref))


def errors(scale: float, b=2, t=512, n=8, k=4, h=128, seed=0) -> dict[str, list[float]]:
    """``{backward: [dq, dk, dv relative errors]}`` for q and k drawn with std ``scale``."""
    config = FP8Config(implementation="xla")
    keys = jax.random.split(jax.random.key(seed), 4)
    q = (scale * jax.random.normal(keys[0], (b, t, n, h))).astype(jnp.bfloat16)
    kk = (scale * jax.random.normal(keys[1], (b, t, k, h))).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, k, h)).astype(jnp.bfloat16)
    dout = jax.random.normal(keys[3], (b, t, n, h)).astype(jnp.bfloat16)
    f32 = lambda x: x.astype(jnp.float32)
    out, lse = attention.forward(f32(q), f32(kk), f32(v), True, "xla")
    exact = attention.backward(f32(q), f32(kk), f32(v), out, lse, f32(dout), True, "xla")

    def fp8(x):
        codes = fp8_quant.quantize_per_group(x, **config.quantize_kwargs("quantize_per_group"))
        return codes.dequantize().astype(x.dtype)

    def per_tensor(o):
        flat = o.reshape(-1, n * h)
        codes = fp8_quant.quantize_per_tensor_reference(flat, fmt="e4m3", group_size=16)
        return codes.dequantize().reshape(o.shape).astype(o.dtype)

    qq, kq, vq = fp8(q), fp8(kk), fp8(v)
    re_out, re_lse = attention.forward(qq, kq, vq, True, "xla")
    recompute = attention.backward(qq, kq, vq, re_out, re_lse, dout, True, "xla")
    fwd_out, fwd_lse = attention.forward(q, kk, v, True, "xla")
    saved = attention.backward(qq, kq, vq, per_tensor(fwd_out), fwd_lse, dout, True, "xla")
    return {
        "recompute": [_rel(g, e) for g, e in zip(recompute, exact, strict=True)],
        "saved_output": [_rel(g, e) for g, e in zip(saved, exact, strict=True)],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scales", default="0.5,1.0,1.5,2.0", help="std of q and k, comma-separated")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args(argv)
    shape = dict(t=args.seq, n=args.heads, k=args.kv_heads, h=args.head_dim)
    print("| q, k std | recompute dq, dk, dv | saved_output dq, dk, dv | saved / recompute (dq) |")
    print("|---|---|---|---|")
    for scale in (float(s) for s in args.scales.split(",")):
        e = errors(scale, **shape)
        fmt = lambda xs: ", ".join(f"{x:.4f}" for x in xs)
        ratio = e["saved_output"][0] / e["recompute"][0]
        print(f"| {scale} | {fmt(e['recompute'])} | {fmt(e['saved_output'])} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

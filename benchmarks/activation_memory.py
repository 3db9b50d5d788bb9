"""Activation memory of one Llama-2-7B decoder layer per precision mode, measured by XLA.

Counts the residuals ``jax.vjp`` keeps for backward (``coat_jax.residuals``: traced with
``jax.make_jaxpr`` / ``jax.eval_shape``, nothing is computed or allocated), in units of
U = batch * seq * hidden * 2 bytes (COAT paper, Table 2). Attention on the CPU goes through
``jax.checkpoint`` (docs/design.md, 'The precision flow'), so it keeps q, k, v as cuDNN's flash
attention would.

Rows:
* bf16, fp8, coat -- ``coat_jax.llama.DecoderLayer`` with ``ops_for(mode)``: the model as
  trained.
* coat (ops layer) -- the same layer written here from the ops directly, as a cross-check.
* coat + FP8 attention + fused SwiGLU -- beyond the paper: attention keeps FP8 q, k, v
  (``fp8_attention``) and the MLP keeps FP8 gate and up only (``fp8_swiglu``).

Usage: ``python benchmarks/activation_memory.py [--batch 4] [--seq 2048] [--out PATH]``; writes
``docs/activation_memory.md`` by default.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import platform
import sys

import jax
import jax.numpy as jnp
from flax import nnx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

from coat_jax import fp8_ops, llama  # noqa: E402
from coat_jax.fp8_ops import ops_for  # noqa: E402
from coat_jax.memory import residuals  # noqa: E402

PAPER_U = {"bf16": 22.66, "fp8": 18.33, "coat": 13.33}  # COAT Table 2 (PyTorch)


def llama_layer(config: llama.LlamaConfig, precision: str):
    """``(fn(params, x), abstract params)`` for one ``coat_jax.llama.DecoderLayer``."""
    abstract = nnx.eval_shape(
        lambda: llama.DecoderLayer(config, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    )
    graphdef, params = nnx.split(abstract)
    inv_freq = llama.rope_inv_freq(config)
    ops = ops_for(precision)

    def fn(params, x_BTD):
        b, t = x_BTD.shape[:2]
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        return nnx.merge(graphdef, params)(x_BTD, positions, inv_freq, ops)

    return fn, params


def ops_layer(config: llama.LlamaConfig, *, fp8_attention: bool, fused_swiglu: bool):
    """The COAT layer written from the ops (q|k|v and gate|up as one linear each)."""
    d, f = config.hidden_size, config.intermediate_size
    n, hd = config.num_attention_heads, config.head_dim or d // config.num_attention_heads
    kv = config.num_key_value_heads
    inv_freq = llama.rope_inv_freq(config)
    ops = ops_for("coat")
    cfg = fp8_ops.DEFAULT_CONFIG
    f32 = jnp.float32
    params = {
        "norm1": jax.ShapeDtypeStruct((d,), f32),
        "qkv": jax.ShapeDtypeStruct((d, (n + 2 * kv) * hd), f32),
        "o": jax.ShapeDtypeStruct((n * hd, d), f32),
        "norm2": jax.ShapeDtypeStruct((d,), f32),
        "gate_up": jax.ShapeDtypeStruct((d, 2 * f), f32),
        "down": jax.ShapeDtypeStruct((f, d), f32),
    }

    def attend(q, k, v):
        if fp8_attention:
            return fp8_ops.fp8_attention(q, k, v, True, cfg)
        return llama.causal_attention(q, k, v)

    def fn(p, x_BTD):
        b, t = x_BTD.shape[:2]
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        h = ops.rmsnorm(x_BTD, p["norm1"], config.rms_norm_eps)
        q, k, v = jnp.split(ops.linear(h, p["qkv"]), [n * hd, (n + kv) * hd], axis=-1)
        q = llama.apply_rope(q.reshape(b, t, n, hd), positions, inv_freq)
        k = llama.apply_rope(k.reshape(b, t, kv, hd), positions, inv_freq)
        out = attend(q, k, v.reshape(b, t, kv, hd)).reshape(b, t, n * hd)
        x_BTD = ops.add(x_BTD, ops.linear(out, p["o"]))
        h = ops.rmsnorm(x_BTD, p["norm2"], config.rms_norm_eps)
        gate, up = jnp.split(ops.linear(h, p["gate_up"]), 2, axis=-1)
        act = fp8_ops.fp8_swiglu(gate, up, cfg) if fused_swiglu else ops.mul(ops.silu(gate), up)
        return ops.add(x_BTD, ops.linear(act, p["down"]))

    return fn, params


def measure(fn, params, x):
    kept = [r for r in residuals(fn, params, x, param_argnums=(0,)) if r.is_activation]
    by_dtype = collections.Counter()
    for r in kept:
        by_dtype[r.dtype.name] += r.nbytes
    return sum(by_dtype.values()), dict(by_dtype), kept


LLAMA2_7B = llama.LlamaConfig(
    hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_hidden_layers=1
)


def measure_all(batch: int, seq: int, config: llama.LlamaConfig = LLAMA2_7B):
    """``({row name: (bytes, bytes by dtype, residuals)}, U in bytes)`` for one layer."""
    x = jax.ShapeDtypeStruct((batch, seq, config.hidden_size), jnp.bfloat16)
    rows = {
        "bf16": llama_layer(config, "bf16"),
        "fp8": llama_layer(config, "fp8"),
        "coat": llama_layer(config, "coat"),
        "coat (ops layer)": ops_layer(config, fp8_attention=False, fused_swiglu=False),
        "coat + FP8 attention + fused SwiGLU": ops_layer(
            config, fp8_attention=True, fused_swiglu=True
        ),
    }
    results = {name: measure(fn, params, x) for name, (fn, params) in rows.items()}
    return results, batch * seq * config.hidden_size * 2


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "activation_memory.md"))
    args = parser.parse_args(argv)

    results, unit = measure_all(args.batch, args.seq)
    config = LLAMA2_7B
    bf16_bytes = results["bf16"][0]

    command = "python benchmarks/activation_memory.py" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:])
    )
    lines = [
        "# Activation memory of one Llama-2-7B decoder layer",
        "",
        f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC with JAX "
        f"{jax.__version__} on {jax.devices()[0].platform} ({platform.machine()}), by "
        f"`{command}`.",
        "",
        f"Layer: hidden {config.hidden_size}, intermediate {config.intermediate_size}, "
        f"{config.num_attention_heads} heads; batch {args.batch}, seq {args.seq}; master weights "
        "float32, activations bfloat16. U = batch x seq x hidden x 2 bytes = "
        f"{unit / 2**20:.0f} MiB.",
        "",
        "What is counted: every residual the backward pass keeps (the leaves of the pullback "
        "`jax.vjp` returns, shapes by `jax.eval_shape`; `coat_jax.residuals`) that depends on the "
        "layer input. Weight-only residuals (the master weights, q|k|v and gate|up "
        "concatenations, BF16 weight casts) are weight-sized and left out. Attention is "
        "rematerialized with `jax.checkpoint` on the CPU, so it keeps q, k, v as cuDNN's flash "
        "attention does (which also keeps its output and log-sum-exp: +1U on the GPU for the "
        "BF16 attention rows).",
        "",
        "| mode | kept for backward | U | vs bf16 | paper (PyTorch) U | by dtype (U) |",
        "|---|---|---|---|---|---|",
    ]
    for name, (total, by_dtype, _) in results.items():
        paper = PAPER_U.get(name, "")
        dtypes = ", ".join(f"{k} {v / unit:.3f}" for k, v in sorted(by_dtype.items()))
        lines.append(
            f"| {name} | {total / 2**30:.3f} GiB | {total / unit:.3f} | "
            f"{C.times(bf16_bytes / total, 2)} | {paper} | {dtypes} |"
        )
    lines += [
        "",
        "Residuals of activation size (at least U/100), per mode:",
        "",
    ]
    for name, (_, _, kept) in results.items():
        big = collections.Counter((r.shape, r.dtype.name) for r in kept if r.nbytes * 100 >= unit)
        parts = [
            f"{count} x {dtype}{list(shape)} ({count * r_bytes(shape, dtype) / unit:.3f}U)"
            for (shape, dtype), count in sorted(big.items(), key=lambda kv: str(kv[0]))
        ]
        lines.append(f"- **{name}**: " + "; ".join(parts))
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        fh.write(text)
    print(text)
    coat_u = results["coat"][0] / unit
    ratio = bf16_bytes / results["coat"][0]
    print(f"target: coat <= 13.5U ({coat_u:.3f}U) and >= 1.6x less than bf16 ({C.times(ratio, 2)})")
    return 0 if coat_u <= 13.5 and ratio >= 1.6 else 1


def r_bytes(shape, dtype) -> int:
    size = 1
    for s in shape:
        size *= s
    return size * jnp.dtype(dtype).itemsize


if __name__ == "__main__":
    sys.exit(main())

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

Usage: ``python benchmarks/activation_memory.py [--batch 4] [--seq 2048] [--out OUT]``; writes
one record per row to ``OUT.jsonl`` (``benchmarks/results/activation_memory/layer.jsonl`` by
default), from which ``benchmarks/render.py`` renders docs/activation_memory.md's table.
"""

from __future__ import annotations

import argparse
import collections
import os
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


def r_bytes(shape, dtype) -> int:
    size = 1
    for s in shape:
        size *= s
    return size * jnp.dtype(dtype).itemsize


def records_of(results: dict, unit: int, batch: int, seq: int) -> list[dict]:
    """One record per row of :func:`measure_all`'s results, sizes in U, with the stamp."""
    stamp = {**C.environment(), "command": C.command_line(), "batch": batch, "seq": seq}
    out = []
    for name, (total, by_dtype, kept) in results.items():
        big = collections.Counter((r.shape, r.dtype.name) for r in kept if r.nbytes * 100 >= unit)
        residuals_u = [
            {
                "count": n,
                "dtype": dtype,
                "shape": list(shape),
                "u": n * r_bytes(shape, dtype) / unit,
            }
            for (shape, dtype), n in sorted(big.items(), key=lambda kv: str(kv[0]))
        ]
        out.append(
            {
                **stamp,
                "mode": name,
                "unit_bytes": unit,
                "u": total / unit,
                "by_dtype_u": {k: v / unit for k, v in sorted(by_dtype.items())},
                "residuals": residuals_u,
            }
        )
    return out


def report(records: list[dict]) -> str:
    """The table of ``records`` (kept bytes per mode, each with its stamp) and each mode's
    activation-sized residuals, as Markdown."""
    bf16 = next(r for r in records if r["mode"] == "bf16")
    lines = [
        "| mode | kept for backward | U | vs bf16 | paper (PyTorch) U | by dtype (U) "
        "| batch x seq | device | JAX | date |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        dtypes = ", ".join(f"{k} {v:.3f}" for k, v in r["by_dtype_u"].items())
        lines.append(
            f"| {r['mode']} | {r['u'] * r['unit_bytes'] / 2**30:.3f} GiB | {r['u']:.3f} | "
            f"{C.times(bf16['u'] / r['u'], 2)} | {PAPER_U.get(r['mode'], '')} | {dtypes} | "
            f"{r['batch']} x {r['seq']} | {r['device']} | {r['jax']} | {r['date'][:10]} |"
        )
    lines += ["", "Residuals of activation size (at least U/100), per mode:", ""]
    for r in records:
        parts = [f"{x['count']} x {x['dtype']}{x['shape']} ({x['u']:.3f}U)" for x in r["residuals"]]
        lines.append(f"- **{r['mode']}**: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument(
        "--out", default=os.path.join(ROOT, "benchmarks", "results", "activation_memory", "layer")
    )
    args = parser.parse_args(argv)

    results, unit = measure_all(args.batch, args.seq)
    records = records_of(results, unit, args.batch, args.seq)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    C.write_jsonl(args.out, records)
    print(report(records))
    bf16_bytes = results["bf16"][0]
    coat_u = results["coat"][0] / unit
    ratio = bf16_bytes / results["coat"][0]
    print(f"target: coat <= 13.5U ({coat_u:.3f}U) and >= 1.6x less than bf16 ({C.times(ratio, 2)})")


if __name__ == "__main__":
    sys.exit(main())

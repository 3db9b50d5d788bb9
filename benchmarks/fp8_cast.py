"""The per-tensor FP8 cast: XLA's fusion of the jnp reference against the Pallas kernel.

Usage (on a GPU): ``python benchmarks/fp8_cast.py [--rows 40960 --cols 11008] [--out benchmarks/results/fp8_cast/fp8_cast]``.

Times, side by side in one process, each on the same BF16 tensor (Llama-2-7B's MLP activation at
batch 20 x 2048 by default): the cast alone (``x / scale``, clipped, to E4M3 and to E5M2) as XLA
compiles ``quant.cast_to_fp8`` and as :func:`pallas_kernels.fp8_quant.scaled_cast_pallas`; the
whole per-tensor quantizer (group maxima, scale, cast) as the reference and as the Pallas
implementation; and a BF16 copy (``x * 2``) for scale. Prints a table with bandwidth by the bytes
each moves and writes ``OUT.jsonl`` and ``OUT.md`` with device, JAX version, date and command.
Compiled as the trainer compiles COAT on a GPU (``fp8_compiler_options``, no excess precision).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

from coat_jax import fp8_ops  # noqa: E402
from pallas_kernels import fp8_quant, quant  # noqa: E402


def cases():
    """name -> (fn, bytes moved per value)."""
    out = {}
    for fmt in ("e4m3", "e5m2"):
        out[f"cast {fmt}, XLA"] = (
            lambda x, s, fmt=fmt: quant.cast_to_fp8(x.astype(jnp.float32) / s, fmt),
            3,
        )
        out[f"cast {fmt}, Pallas"] = (
            lambda x, s, fmt=fmt: fp8_quant.scaled_cast_pallas(x, s, fmt=fmt),
            3,
        )
        out[f"per-tensor quantizer {fmt}, XLA"] = (
            lambda x, s, fmt=fmt: fp8_quant.quantize_per_tensor_reference(x, fmt=fmt).codes,
            5,
        )
        out[f"per-tensor quantizer {fmt}, Pallas"] = (
            lambda x, s, fmt=fmt: fp8_quant.quantize_per_tensor_pallas(x, fmt=fmt).codes,
            5,
        )
    out["BF16 copy (x * 2)"] = (lambda x, s: x * 2, 4)
    return out


def table(rows: list[dict]) -> list[str]:
    """The timings of ``rows`` (the records) as a Markdown table, figures truncated."""
    tr = C.truncated
    lines = ["| case | ms [min, max] | TB/s |", "|---|---|---|"]
    for r in rows:
        if "ms" in r:
            lines.append(
                f"| {r['case']} | {tr(r['ms'])} [{tr(r['min_ms'])}, {tr(r['max_ms'])}] | "
                f"{tr(r['tb_per_s'], 2)} |"
            )
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=40960)
    p.add_argument("--cols", type=int, default=11008)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None, help="write OUT.jsonl and OUT.md")
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        raise SystemExit("fp8_cast.py times GPU kernels; run it on a GPU")
    options = dict(fp8_ops.fp8_compiler_options() or {}, xla_allow_excess_precision=False)
    x = jax.random.normal(jax.random.key(0), (args.rows, args.cols), jnp.bfloat16)
    scale = fp8_quant.scale_from_amax(fp8_quant.group_amax_reference(x), "e4m3")
    n = x.size
    env = dict(C.environment(), command=C.command_line())
    timed = cases()
    rows = []
    compiled = {name: jax.jit(fn, compiler_options=options) for name, (fn, _) in timed.items()}
    for name, (_, bytes_per) in timed.items():
        f = compiled[name]
        t = C.time_fn(lambda f=f: jax.block_until_ready(f(x, scale)), warmup=2, reps=args.reps)
        ms = t["median_s"] * 1e3
        rows.append(
            dict(
                case=name,
                ms=ms,
                min_ms=t["min_s"] * 1e3,
                max_ms=t["max_s"] * 1e3,
                tb_per_s=bytes_per * n / t["median_s"] / 1e12,
                bytes_per_value=bytes_per,
                shape=[args.rows, args.cols],
                **env,
            )
        )
        print(f"{name}: {ms:.3f} ms", flush=True)
    for fmt in ("e4m3", "e5m2"):
        same = jnp.array_equal(
            compiled[f"cast {fmt}, XLA"](x, scale).view(jnp.uint8),
            compiled[f"cast {fmt}, Pallas"](x, scale).view(jnp.uint8),
        )
        print(f"cast {fmt}: Pallas codes equal XLA's: {bool(same)}")
        rows.append(dict(case=f"cast {fmt} codes equal", equal=bool(same), **env))
    lines = [
        f"{env['device']}, JAX {env['jax']}, {env['date']}; `{C.command_line()}`",
        "",
        f"BF16 [{args.rows}, {args.cols}], median of {args.reps} (ms, truncated); TB/s by the "
        "bytes each moves (cast: 2 read + 1 written per value; quantizer: +2 read for the "
        "maxima; copy: 2 + 2):",
        "",
        *table(rows),
    ]
    text = "\n".join(lines)
    print(text)
    C.write_results(args.out, rows, "The per-tensor FP8 cast: XLA against Pallas", text)


if __name__ == "__main__":
    main()

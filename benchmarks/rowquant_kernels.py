"""The row-quantizing producers alone (``pallas_kernels.fp8_rowquant``): Pallas kernel against
XLA's fusion of the jnp reference, at Llama-2-7B sizes, per tile setting.

Times the jitted producer (median of ``--reps`` calls, each blocking) for RMSNorm at
``[tokens, hidden]`` and SwiGLU at ``[tokens, ffn]`` (BF16 in; E4M3 row codes, 1x16 saved
inputs with E8M0 scales out), and prints the bytes each moves at the least (inputs read once,
outputs written once) with the bandwidth that makes. One JSON line per measurement to
``--jsonl``.

    python benchmarks/rowquant_kernels.py --jsonl runs/rowquant.jsonl        # one GPU
    python benchmarks/rowquant_kernels.py --tokens 64 --hidden 64 --ffn 96 --reps 2   # CPU
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import _common as C  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels import fp8_rowquant  # noqa: E402
from pallas_kernels.fp8_quant import TileConfig  # noqa: E402

# (norm_block_rows, block_groups, norm_num_warps) settings tried for the Pallas kernels.
SETTINGS = [(2, 128, 8), (1, 256, 8), (4, 128, 8), (2, 64, 4), (8, 128, 8), (16, 128, 8)]


def min_bytes(op: str, tokens: int, d: int) -> int:
    """Inputs read once, outputs written once (E8M0 1x16 scales, float32 row scales)."""
    n = tokens * d
    if op == "rmsnorm":
        return 2 * n + 4 * d + n + n + n // 16 + 8 * tokens
    return 4 * n + n + 2 * (n + n // 16) + 4 * tokens


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=11008)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--jsonl", default=None)
    args = p.parse_args(argv)
    interpret = jax.default_backend() != "gpu"
    env = C.environment()
    keys = iter(jax.random.split(jax.random.key(0), 3))
    x = jax.random.normal(next(keys), (args.tokens, args.hidden), jnp.bfloat16)
    w = jnp.ones((args.hidden,), jnp.float32)
    gate = jax.random.normal(next(keys), (args.tokens, args.ffn), jnp.bfloat16)
    up = jax.random.normal(next(keys), (args.tokens, args.ffn), jnp.bfloat16)
    kw = dict(scale_format="e8m0")
    cases = {
        "rmsnorm": (
            (x, w),
            lambda impl, tiles: (
                lambda x, w: fp8_rowquant.rmsnorm_rowwise(
                    x, w, 1e-5, implementation=impl, interpret=interpret, tiles=tiles, **kw
                )
            ),
            args.hidden,
        ),
        "swiglu": (
            (gate, up),
            lambda impl, tiles: (
                lambda g, u: fp8_rowquant.swiglu_rowwise(
                    g, u, implementation=impl, interpret=interpret, tiles=tiles, **kw
                )
            ),
            args.ffn,
        ),
    }
    for op, (inputs, make, d) in cases.items():
        runs = [("xla", None)] + [("pallas", s) for s in SETTINGS]
        for impl, setting in runs:
            tiles = (
                TileConfig()
                if setting is None
                else TileConfig(
                    norm_block_rows=setting[0], block_groups=setting[1], norm_num_warps=setting[2]
                )
            )
            fn = jax.jit(make(impl, tiles))
            call = functools.partial(lambda f, a: jax.block_until_ready(f(*a)), fn, inputs)
            try:
                t = C.time_fn(call, warmup=2, reps=args.reps)
            except Exception as e:  # a setting the compiler refuses: say so and go on
                print(f"{op} {impl} {setting}: failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            gbs = min_bytes(op, args.tokens, d) / t["median_s"] / 1e9
            rec = dict(env, op=op, implementation=impl, tiles=setting, tokens=args.tokens, d=d)
            rec.update(time=t, min_bytes_gb_per_s=gbs)
            print(
                f"{op:8s} {impl:6s} {str(setting):15s} {t['median_s'] * 1e3:8.3f} ms  "
                f"{gbs:7.0f} GB/s (least bytes)",
                flush=True,
            )
            if args.jsonl:
                C.append_jsonl(args.jsonl, rec)


if __name__ == "__main__":
    main()

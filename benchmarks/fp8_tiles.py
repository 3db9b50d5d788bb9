"""Tile sizes of the Pallas FP8 activation kernels: each kernel under several ``TileConfig``s.

Usage (on a GPU): ``python benchmarks/fp8_tiles.py [--rows 40960] [--out benchmarks/results/fp8_tiles/fp8_tiles]``.

Times, side by side in one process, each Pallas kernel the trainer's FP8 ops run (the fused
SwiGLU forward and backward, the per-tensor cast to E4M3 and E5M2, the RMSNorm forward and
backward, the 1x16 quantizer) at Llama-2-7B's shapes (``--rows`` tokens by 4096 or 11008; 40960
is batch 20 x 2048) under each tile setting of :data:`SETTINGS`, and XLA's fusion of the op's
jnp reference beside them. The ``pallas_kernels.fp8_quant.DEFAULT_TILES`` row is the default; the
table gives each setting's time relative to it. Every kernel's outputs under every setting are
compared with the default's: the element-wise kernels' are equal bit for bit under every
setting; the RMSNorm kernels' row reductions depend on the number of warps, and the backward's
weight gradient sums per-block partial sums, so those may differ in rounding (the table gives
the largest absolute difference). Writes ``OUT.jsonl`` and ``OUT.md`` with device, JAX
version, date and command. Compiled as the trainer compiles COAT on a GPU (``fp8_compiler_options``, no excess precision).
``--interpret --rows 64 --reps 1``: a CPU smoke test of the script (times mean nothing there).
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
from pallas_kernels import fp8_act, fp8_quant, quant  # noqa: E402
from pallas_kernels.fp8_quant import DEFAULT_TILES, TileConfig  # noqa: E402

D, F = 4096, 11008
# (block_rows, block_groups, num_warps) of the element-wise kernels; the RMSNorm's own
# (norm_block_rows, norm_num_warps) vary separately below.
SETTINGS = [
    (16, 64, 4),
    (8, 64, 4),
    (32, 64, 4),
    (16, 32, 4),
    (16, 128, 4),
    (8, 128, 4),
    (32, 32, 4),
    (16, 64, 8),
    (32, 64, 8),
    (32, 128, 8),
]
NORM_SETTINGS = [(4, 8), (1, 4), (2, 4), (2, 8), (4, 4), (8, 8), (4, 16), (8, 16)]


def configs(norm: bool) -> list[TileConfig]:
    """The default first, then each setting of the kernel's kind not equal to it."""
    if norm:
        swept = [TileConfig(norm_block_rows=br, norm_num_warps=w) for br, w in NORM_SETTINGS]
    else:
        swept = [TileConfig(block_rows=br, block_groups=bg, num_warps=w) for br, bg, w in SETTINGS]
    return [DEFAULT_TILES] + [t for t in dict.fromkeys(swept) if t != DEFAULT_TILES]


def label(t: TileConfig, norm: bool) -> str:
    if norm:
        return f"rows {t.norm_block_rows}, {t.norm_num_warps} warps"
    return f"{t.block_rows} x {t.block_groups} groups, {t.num_warps} warps"


def leaves(out):
    return [x.view(jnp.uint8) if x.dtype.itemsize == 1 else x for x in jax.tree.leaves(out)]


def ops(rows: int, interpret: bool = False):
    """name -> (inputs, pallas(tiles)(*inputs), xla(*inputs), norm?, bytes moved per call)."""
    k = jax.random.split(jax.random.key(0), 4)
    bf = jnp.bfloat16
    gate = jax.random.normal(k[0], (rows, F), bf)
    up = jax.random.normal(k[1], (rows, F), bf)
    dy_f = jax.random.normal(k[2], (rows, F), bf)
    x = jax.random.normal(k[3], (rows, D), bf)
    w = jnp.ones((D,), bf)
    q = dict(group_size=16, fmt="e4m3", scale_format="e8m0")
    _, gate_q, up_q = fp8_act.swiglu_fwd_reference(gate, up, **q)
    _, x_q, rstd = fp8_act.rmsnorm_fwd_reference(x, w, 1e-5, **q)
    scale = fp8_quant.scale_from_amax(fp8_quant.group_amax_reference(gate), "e4m3")
    nf, nd = rows * F, rows * D

    def cast(fmt):
        return (
            (gate, scale),
            lambda t: (
                lambda a, s: fp8_quant.scaled_cast_pallas(
                    a, s, fmt=fmt, tiles=t, interpret=interpret
                )
            ),
            lambda a, s: quant.cast_to_fp8(a.astype(jnp.float32) / s, fmt),
            False,
            nf * 3,
        )

    return {
        "SwiGLU forward": (
            (gate, up),
            lambda t: (
                lambda a, b: fp8_act.swiglu_fwd_pallas(a, b, tiles=t, interpret=interpret, **q)
            ),
            lambda a, b: fp8_act.swiglu_fwd_reference(a, b, **q),
            False,
            nf * (4 + 2 + 2) + 2 * (nf // 16),
        ),
        "SwiGLU backward": (
            (dy_f, gate_q, up_q),
            lambda t: (
                lambda d, a, b: fp8_act.swiglu_bwd_pallas(d, a, b, tiles=t, interpret=interpret)
            ),
            fp8_act.swiglu_bwd_reference,
            False,
            nf * (2 + 2 + 4) + 2 * (nf // 16),
        ),
        "cast to E4M3": cast("e4m3"),
        "cast to E5M2": cast("e5m2"),
        "1x16 quantizer [rows, 4096]": (
            (x,),
            lambda t: (
                lambda a: fp8_quant.quantize_per_group_pallas(a, tiles=t, interpret=interpret, **q)
            ),
            lambda a: fp8_quant.quantize_per_group_reference(a, **q),
            False,
            nd * 3 + nd // 16,
        ),
        "RMSNorm forward": (
            (x, w),
            lambda t: (
                lambda a, b: fp8_act.rmsnorm_fwd_pallas(
                    a, b, 1e-5, tiles=t, interpret=interpret, **q
                )
            ),
            lambda a, b: fp8_act.rmsnorm_fwd_reference(a, b, 1e-5, **q),
            True,
            nd * (2 + 2 + 1) + nd // 16,
        ),
        "RMSNorm backward": (
            (x, x_q, rstd, w),
            lambda t: (
                lambda d, a, r, b: fp8_act.rmsnorm_bwd_pallas(
                    d, a, r, b, tiles=t, interpret=interpret
                )
            ),
            fp8_act.rmsnorm_bwd_reference,
            True,
            nd * (2 + 1 + 2) + nd // 16,
        ),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=40960)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--only", default="", help="comma-separated op names (default: all)")
    p.add_argument("--out", default=None, help="write OUT.jsonl and OUT.md")
    p.add_argument(
        "--interpret", action="store_true", help="Pallas interpret mode: a CPU smoke test"
    )
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu" and not args.interpret:
        raise SystemExit("fp8_tiles.py times GPU kernels; run it on a GPU (or --interpret)")
    options = dict(fp8_ops.fp8_compiler_options() or {}, xla_allow_excess_precision=False)
    env = dict(C.environment(), command=C.command_line())
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    rows = []

    def timed(fn, inputs):
        f = jax.jit(fn, compiler_options=options)
        t = C.time_fn(lambda: jax.block_until_ready(f(*inputs)), warmup=2, reps=args.reps)
        return f, t

    for name, (inputs, pallas, xla, norm, nbytes) in ops(args.rows, args.interpret).items():
        if only and name not in only:
            continue
        _, t = timed(xla, inputs)
        base = dict(op=name, rows=args.rows, bytes=nbytes, **env)
        rows.append(dict(base, setting="XLA's fusion", **_times(t, nbytes)))
        print(f"{name}, XLA: {t['median_s'] * 1e3:.3f} ms", flush=True)
        expected = None
        for tiles in configs(norm):
            setting = label(tiles, norm) + (" (default)" if tiles == DEFAULT_TILES else "")
            try:
                f, t = timed(pallas(tiles), inputs)
            except Exception as e:  # a setting Triton cannot compile is reported, not fatal
                rows.append(dict(base, setting=setting, error=f"{type(e).__name__}: {e}"[:300]))
                print(f"{name}, {setting}: {rows[-1]['error']}", flush=True)
                continue
            got = leaves(f(*inputs))
            if expected is None:
                expected = got
            # Codes are compared as their bytes, so a zero difference is bit equality.
            diff = max(
                float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                for a, b in zip(got, expected, strict=True)
            )
            same = diff == 0.0
            rows.append(
                dict(
                    base,
                    setting=setting,
                    equal_to_default=same,
                    max_abs_diff=diff,
                    **_times(t, nbytes),
                )
            )
            print(f"{name}, {setting}: {t['median_s'] * 1e3:.3f} ms, equal {same}", flush=True)
    text = report(rows, args, env)
    print(text)
    C.write_results(args.out, rows, "Tile sizes of the Pallas FP8 activation kernels", text)


def _times(t, nbytes):
    return dict(
        ms=t["median_s"] * 1e3,
        min_ms=t["min_s"] * 1e3,
        max_ms=t["max_s"] * 1e3,
        tb_per_s=nbytes / t["median_s"] / 1e12,
    )


def report(rows, args, env) -> str:
    lines = [
        f"{env['device']}, JAX {env['jax']}, {env['date']}; `{C.command_line()}`",
        "",
        f"`[{args.rows}, 4096 or 11008]` BF16 inputs, median of {args.reps} (ms, truncated); "
        "TB/s by the bytes each kernel reads and writes; relative to the default tiles "
        "(below 1: faster). Equal: the outputs equal the default's bit for bit (else the largest "
        "absolute difference).",
        "",
        *table(rows),
    ]
    return "\n".join(lines)


def table(rows: list[dict]) -> list[str]:
    """The timings of ``rows`` (the records) as a Markdown table, relative to the default tiles."""
    lines = [
        "| op | setting | ms [min, max] | TB/s | / default | equal |",
        "|---|---|---|---|---|---|",
    ]
    default = {r["op"]: r["ms"] for r in rows if r.get("setting", "").endswith("(default)")}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['op']} | {r['setting']} | failed: {r['error'][:80]} | | | |")
            continue
        rel = C.truncated(r["ms"] / default[r["op"]]) if r["op"] in default else ""
        eq = {True: "yes", False: f"no, {r.get('max_abs_diff', 0):.1e}"}.get(
            r.get("equal_to_default"), ""
        )
        lines.append(
            f"| {r['op']} | {r['setting']} | {C.truncated(r['ms'])} [{C.truncated(r['min_ms'])}, "
            f"{C.truncated(r['max_ms'])}] | {C.truncated(r['tb_per_s'], 2)} | {rel} | {eq} |"
        )
    return lines


if __name__ == "__main__":
    main()

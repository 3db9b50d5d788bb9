"""What XLA makes of the FP8 linear's scalings: its GEMMs and the fusions that quantize.

Compiles ``value_and_grad`` of ``h -> sum(c * linear(rmsnorm(h), w))`` at a Llama-2-7B MLP
size (``h [B*T, 4096]`` BF16, ``w [4096, 11008]``) once per ``FP8Config.linear_scaling``, with
the FP8 compiler options, and reports per scaling: the GEMM custom calls by target and result
dtype, and every fusion of the program that writes FP8 codes or takes a maximum (JAX's
``reduce_max``), with what it reads and writes. A row-wise scale's maximum inside the fusion
that writes the producer's output shows as a multi-output fusion with both. The full optimized
HLO of each scaling goes to ``<out>/hlo_<scaling>.txt.gz``.

Then the row-wise operands' maxima, forward only, for the two producers of a Llama layer
(RMSNorm into q|k|v at ``[tokens, hidden]``, SwiGLU into the down projection at ``[tokens,
ffn]``), each as two ops (the producer's output written in BF16, then quantized by the linear)
and as the fused op (``coat_jax.fp8.rowwise_fused``; on a GPU its Pallas producer): the number
of fusions that reduce a maximum to one value per token. ``0`` means no separate maximum pass
over the operand remains (the producer's kernel finished each row's maximum itself); the weight's
per-channel maxima are not per token and are not counted.

    python benchmarks/rowwise_hlo.py --out runs/rowwise            # one GPU
    python benchmarks/rowwise_hlo.py --out /tmp/r --tokens 64 --hidden 32 --ffn 48   # CPU
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from coat_jax import fp8_ops  # noqa: E402
from coat_jax.fp8 import config as fp8_config  # noqa: E402

FP8_TYPES = ("f8e4m3fn", "f8e5m2")


def compiled_hlo(scaling: str, tokens: int, hidden: int, ffn: int) -> str:
    config = fp8_ops.FP8Config(linear_scaling=scaling)
    sds = jax.ShapeDtypeStruct
    h, w = sds((tokens, hidden), jnp.bfloat16), sds((hidden, ffn), jnp.float32)
    g, c = sds((hidden,), jnp.float32), sds((tokens, ffn), jnp.float32)

    def loss(h, g, w, c):
        x = fp8_ops.rmsnorm(h, g)  # the plain producer: XLA sees its whole computation
        y = fp8_ops.ops_for("fp8", config).linear(x, w)
        return jnp.sum(y.astype(jnp.float32) * c)

    step = jax.jit(
        jax.value_and_grad(loss, (0, 1, 2)), compiler_options=fp8_ops.fp8_compiler_options()
    )
    return step.lower(h, g, w, c).compile().as_text()


def producer_forward_hlo(producer: str, fused: bool, tokens: int, hidden: int, ffn: int) -> str:
    """The compiled forward of one producer and its row-wise linear, as two ops or fused."""
    config = fp8_ops.FP8Config(linear_scaling="row", swiglu="fused")
    ops = fp8_ops.ops_for("coat", config)
    if not fused:
        ops = ops._replace(norm_linear=None, swiglu_linear=None)
    sds = jax.ShapeDtypeStruct
    if producer == "rmsnorm":
        args = (sds((tokens, hidden), jnp.bfloat16), sds((hidden,), jnp.float32))
        args += (sds((hidden, hidden), jnp.float32),)
        fn = lambda x, g, w: ops.rmsnorm_then_linear(x, g, 1e-6, w)  # noqa: E731
    else:
        act = sds((tokens, ffn), jnp.bfloat16)
        args = (act, act, sds((ffn, hidden), jnp.float32))
        fn = ops.silu_mul_then_linear
    step = jax.jit(fn, compiler_options=fp8_ops.fp8_compiler_options())
    return step.lower(*args).compile().as_text()


def per_token_maxima(hlo: str, tokens: int) -> list[str]:
    """The fusions of ``hlo`` whose ``reduce_max`` leaves one value per token."""
    bodies = computations(hlo)
    found = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.+?) fusion\(.*calls=%?([\w.\-]+)", line)
        if not m or not re.search(r"%reduce_max[\w.\-]* = ", bodies.get(m.group(3), "")):
            continue
        if re.search(rf"f32\[{tokens}(,1)?\]", m.group(2)):
            found.append(m.group(1))
    return found


def computations(hlo: str) -> dict[str, str]:
    """Computation name -> its body text."""
    out, name, lines = {}, None, []
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m and not line.startswith(" "):
            name, lines = m.group(1), []
        elif line == "}" and name is not None:
            out[name] = "\n".join(lines)
            name = None
        elif name is not None:
            lines.append(line)
    return out


def summary(hlo: str) -> list[str]:
    bodies = computations(hlo)
    gemms = re.findall(r"= (\S+) custom-call\([^\n]*custom_call_target=\"(__cublas[^\"]*)\"", hlo)
    rows = [f"GEMMs: {len(gemms)}"]
    rows += [f"  {target} -> {result}" for result, target in gemms]
    rows.append("fusions writing FP8 or taking a maximum (name: kind, outputs <- operands):")
    for line in hlo.splitlines():
        m = re.match(
            r"\s*(?:ROOT )?%?([\w.\-]+) = (.+?) fusion\((.*?)\), kind=(\w+).*calls=%?([\w.\-]+)",
            line,
        )
        if not m:
            continue
        name, result, operands, kind, called = m.groups()
        body = bodies.get(called, "")
        maxima = len(re.findall(r"%reduce_max[\w.\-]* = ", body))
        writes_fp8 = any(t in result for t in FP8_TYPES)
        if not (writes_fp8 or maxima):
            continue
        shapes = re.findall(r"\b(\w+\[[\d,]*\])", result)
        ins = re.findall(r"%([\w.\-]+)", operands)
        rows.append(f"  {name}: {kind}, reduce-max x{maxima}, {shapes} <- {ins}")
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=11008)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for scaling in fp8_config.LINEAR_SCALINGS:
        hlo = compiled_hlo(scaling, args.tokens, args.hidden, args.ffn)
        with gzip.open(os.path.join(args.out, f"hlo_{scaling}.txt.gz"), "wt") as f:
            f.write(hlo)
        print(f"== linear_scaling={scaling} ({jax.devices()[0].device_kind})")
        print("\n".join(summary(hlo)), flush=True)
    print(f"== row-wise operands, forward: per-token maximum passes ({jax.default_backend()})")
    for producer in ("rmsnorm", "swiglu"):
        for fused in (False, True):
            hlo = producer_forward_hlo(producer, fused, args.tokens, args.hidden, args.ffn)
            name = f"{producer}_{'fused' if fused else 'two_ops'}"
            with gzip.open(os.path.join(args.out, f"hlo_fwd_{name}.txt.gz"), "wt") as f:
                f.write(hlo)
            maxima = per_token_maxima(hlo, args.tokens)
            kernels = len(re.findall(r"custom_call_target=\"__gpu\$xla\.gpu\.triton\"", hlo))
            print(f"  {name}: {len(maxima)} {maxima}, Pallas/Triton calls {kernels}", flush=True)


if __name__ == "__main__":
    main()

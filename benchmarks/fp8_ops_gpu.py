"""GPU check of the FP8 ops: runs their tests on the real backend, then times fwd+bwd per op.

Usage (on a CUDA machine): ``python benchmarks/fp8_ops_gpu.py``. Prints the pytest summary, then a
table of fwd+bwd milliseconds at Llama-2-7B shapes (batch 4 x seq 2048 tokens) for the plain
BF16 op, the FP8 op with XLA quantizers, and the FP8 op with the Pallas kernels; and how many
cuBLASLt FP8 GEMMs the compiled FP8 linear contains.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from coat_jax import fp8_ops  # noqa: E402
from coat_jax.attention import attend, attention_implementation  # noqa: E402
from coat_jax.fp8_ops import FP8Config, ops_for  # noqa: E402

TOKENS, D, F = 4 * 2048, 4096, 11008


def bench(fn, *args, iters=20):
    """Median milliseconds of ``fn(*args)`` (jitted, compiled and warmed up first)."""
    fn = jax.jit(fn)
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


def fwd_bwd(op):
    def run(*args):
        y, pullback = jax.vjp(op, *args)
        return y, pullback(y)

    return run


def main():
    tests = [
        "tests/fp8/test_fp8_ops.py",
        "tests/kernels/test_fp8_quant.py",
        "tests/kernels/test_fp8_act.py",
    ]
    env = dict(os.environ, CI="")
    rc = subprocess.call(
        [sys.executable, "-m", "pytest", *tests, "-q", "--tb=line", "-rf"], cwd=ROOT, env=env
    )
    print(f"pytest exit code {rc}")
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}")

    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (TOKENS, D), jnp.bfloat16)
    g = jax.random.normal(keys[1], (TOKENS, F), jnp.bfloat16)
    u = jax.random.normal(keys[2], (TOKENS, F), jnp.bfloat16)
    w = 0.02 * jax.random.normal(keys[3], (D, F), jnp.float32)
    nw = jnp.ones((D,), jnp.float32)
    configs = {
        "fp8/xla": FP8Config(implementation="xla"),
        "fp8/pallas": FP8Config(implementation="pallas"),
    }
    modes = {"bf16": ops_for("bf16"), **{m: ops_for("coat", c) for m, c in configs.items()}}
    config_of = {id(ops): configs.get(m) for m, ops in modes.items()}
    cases = {
        "linear 8192x4096x11008": (lambda o: o.linear, (x, w)),
        "rmsnorm 8192x4096": (lambda o: lambda x, w: o.rmsnorm(x, w, 1e-6), (x, nw)),
        "silu 8192x11008": (lambda o: o.silu, (g,)),
        "mul 8192x11008": (lambda o: o.mul, (g, u)),
    }
    q = jax.random.normal(keys[0], (4, 2048, 32, 128), jnp.bfloat16)

    def fused_swiglu(o):
        if o.precision == "bf16":
            return lambda g, u: o.mul(o.silu(g), u)
        return lambda g, u: fp8_ops.fp8_swiglu(g, u, config_of[id(o)])

    def attention(o):
        if o.precision == "bf16":
            impl = attention_implementation(q.dtype)
            return lambda q, k, v: attend(q, k, v, is_causal=True, implementation=impl)
        return lambda q, k, v: fp8_ops.fp8_attention(q, k, v, True, config_of[id(o)])

    cases["swiglu 8192x11008"] = (fused_swiglu, (g, u))
    cases["attention 4x2048x32x128"] = (attention, (q, q, q))
    print(f"{'op (fwd+bwd, ms)':26s}" + "".join(f"{m:>12s}" for m in modes), flush=True)
    for name, (pick, args) in cases.items():
        row = [bench(fwd_bwd(pick(ops)), *args) for ops in modes.values()]
        print(f"{name:26s}" + "".join(f"{t:12.3f}" for t in row), flush=True)

    probe(x, w)
    return rc


def f8_gemms(fn, *args):
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    return hlo.count("__cublas$lt$matmul$f8")


def probe(x, w):
    """Which spellings of the FP8 GEMM pattern XLA rewrites to cuBLASLt FP8 here."""
    a8 = x.astype(jnp.float8_e4m3fn)
    b8 = w.astype(jnp.float8_e4m3fn)
    s = jnp.float32(0.5)
    dims = (((1,), (0,)), ((), ()))
    for dq in (jnp.bfloat16, jnp.float32):
        for pet in (None, jnp.bfloat16):
            for prec in (None, jax.lax.Precision.HIGHEST):

                def f(a8, b8, sa, sb, dq=dq, pet=pet, prec=prec):
                    a = a8.astype(dq) * sa.astype(dq)
                    b = b8.astype(dq) * sb.astype(dq)
                    return jax.lax.dot_general(
                        a, b, dims, precision=prec, preferred_element_type=pet
                    )

                n = f8_gemms(f, a8, b8, s, s)
                ms = bench(f, a8, b8, s, s)
                print(
                    f"pattern dq={jnp.dtype(dq).name} out={pet} prec={prec}: f8 gemms {n}, {ms:.3f} ms"
                )
    raw = lambda a8, b8: jax.lax.dot_general(a8, b8, dims, preferred_element_type=jnp.bfloat16)
    print(f"raw f8 dot_general: f8 gemms {f8_gemms(raw, a8, b8)}, {bench(raw, a8, b8):.3f} ms")
    bf16 = lambda a, b: a @ b.astype(jnp.bfloat16)
    print(f"bf16 dot: {bench(bf16, x, w):.3f} ms")
    for impl in ("xla", "pallas"):
        for dq in ("compute", "float32"):
            # gemm_dequant is only used by the float32-result spelling.
            cfg = FP8Config(implementation=impl, gemm_dequant=dq, gemm_output="float32")

            def loss(x, w, c, cfg=cfg):
                return jnp.sum(fp8_ops.fp8_linear(x, w, cfg).astype(jnp.float32) * c)

            c = jnp.ones((TOKENS, F), jnp.float32)
            n = f8_gemms(jax.value_and_grad(loss, (0, 1)), x, w, c)
            ms = bench(fwd_bwd(lambda x, w, cfg=cfg: fp8_ops.fp8_linear(x, w, cfg)), x, w)
            print(f"fp8_linear impl={impl} dequant={dq}: f8 gemms fwd+bwd {n}, fwd+bwd {ms:.3f} ms")


if __name__ == "__main__":
    sys.exit(main())

"""Which spellings of an in-program FP8 GEMM XLA rewrites to cuBLASLt FP8 (compile only, GPU).

Each variant is one jitted function; the script counts ``__cublas$lt$matmul$f8`` in its compiled
HLO and, with ``--dump DIR``, has XLA dump the HLO around its GEMM passes so that a variant that
is not rewritten can be diffed against one that is.

Usage:
  python benchmarks/probe_fp8_gemm.py [--m 8192 --k 4096 --n 11008] [--dump DIR] [--only SUBSTR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=8192)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=11008)
    p.add_argument("--dump", default=None, help="XLA dump directory (HLO around GEMM passes)")
    p.add_argument("--only", default=None, help="run only variants whose name contains this")
    args = p.parse_args(argv)
    if args.dump:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_dump_to={args.dump} --xla_dump_hlo_pass_re=gemm|cublas"
        )

    import jax
    import jax.numpy as jnp

    from benchmarks import _common as C
    from coat_jax import fp8_ops, quant
    from pallas_kernels import fp8_quant

    m, k, n = args.m, args.k, args.n
    f8, sds = jnp.float8_e4m3fn, jax.ShapeDtypeStruct
    dims = (((1,), (0,)), ((), ()))

    def dot32(a8, sa, b8, sb, out=jnp.bfloat16):
        a = a8.astype(jnp.float32) * sa.astype(jnp.float32)
        b = b8.astype(jnp.float32) * sb.astype(jnp.float32)
        return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32).astype(out)

    def jnp_quant(x):
        s = (jnp.max(jnp.abs(x.astype(jnp.float32))) + 1e-20) / 448.0
        return quant.cast_to_fp8(x.astype(jnp.float32) / s, "e4m3"), s

    def pallas_quant(x):
        q = fp8_quant.quantize_per_tensor(x, fmt="e4m3", implementation="pallas")
        return q.codes, q.scale

    def v_params(a8, sa, b8, sb):
        return dot32(a8, sa, b8, sb)

    def v_jnp_quant(x, w):
        (a8, sa), (b8, sb) = jnp_quant(x), jnp_quant(w)
        return dot32(a8, sa, b8, sb)

    def v_jnp_quant_codes_barrier(x, w):
        (a8, sa), (b8, sb) = jnp_quant(x), jnp_quant(w)
        a8, b8 = jax.lax.optimization_barrier((a8, b8))
        return dot32(a8, sa, b8, sb)

    def v_pallas_quant(x, w):
        (a8, sa), (b8, sb) = pallas_quant(x), pallas_quant(w)
        return dot32(a8, sa, b8, sb)

    def v_pallas_codes_param_scale(x, w, sa, sb):
        (a8, _), (b8, _) = pallas_quant(x), pallas_quant(w)
        return dot32(a8, sa, b8, sb)

    def v_param_codes_pallas_scale(a8, b8, x, w):
        (_, sa), (_, sb) = pallas_quant(x), pallas_quant(w)
        return dot32(a8, sa, b8, sb)

    def v_param_codes_plain_scale(a8, b8, x, w):
        sa = jnp.max(jnp.abs(x.astype(jnp.float32))) / 448.0
        sb = jnp.max(jnp.abs(w)) / 448.0
        return dot32(a8, sa, b8, sb)

    def v_param_codes_pow2_scale(a8, b8, x, w):
        sa = fp8_quant.round_up_to_bfloat16(jnp.max(jnp.abs(x.astype(jnp.float32))) / 448.0)
        sb = fp8_quant.round_up_to_bfloat16(jnp.max(jnp.abs(w)) / 448.0)
        return dot32(a8, sa, b8, sb)

    def plain_scales(x, w):
        sa = jnp.max(jnp.abs(x.astype(jnp.float32))) / 448.0
        sb = jnp.max(jnp.abs(w)) / 448.0
        return sa, sb

    def scale_after_dot(a8, b8, x, w, convert_to):
        sa, sb = plain_scales(x, w)
        y = jax.lax.dot_general(
            a8.astype(convert_to), b8.astype(convert_to), dims, preferred_element_type=jnp.float32
        )
        return (y * (sa * sb)).astype(jnp.bfloat16)

    def v_scale_after_dot(a8, b8, x, w):
        return scale_after_dot(a8, b8, x, w, jnp.float32)

    def v_scale_barrier(a8, b8, x, w):
        sa, sb = jax.lax.optimization_barrier(plain_scales(x, w))
        return dot32(a8, sa, b8, sb)

    def v_scale_reduce_only(a8, b8, x, w):
        sa = jnp.max(jnp.abs(x.astype(jnp.float32)))
        sb = jnp.max(jnp.abs(w))
        return dot32(a8, sa, b8, sb)

    def _copy_kernel(s_ref, o_ref):
        o_ref[...] = s_ref[...]

    def pallas_copy(s):
        from jax.experimental import pallas as pl

        out = pl.pallas_call(_copy_kernel, out_shape=jax.ShapeDtypeStruct((1,), s.dtype))(
            s.reshape(1)
        )
        return out.reshape(())

    def v_scale_pallas_copy(a8, b8, x, w):
        sa, sb = plain_scales(x, w)
        return dot32(a8, pallas_copy(sa), b8, pallas_copy(sb))

    def v_scale_after_dot_bf16(a8, b8, x, w):
        return scale_after_dot(a8, b8, x, w, jnp.bfloat16)

    def linear(impl, dq="float32"):
        # The float32-result spelling docs/fp8_gemm.md's table measured (BF16 results, the
        # default gemm_output="compute", are measured in docs/bench_gemm_output.md).
        cfg = fp8_ops.FP8Config(implementation=impl, gemm_dequant=dq, gemm_output="float32")

        def f(x, w):
            return fp8_ops.fp8_linear(x, w, cfg)

        f.__name__ = f"v_fp8_linear_{impl}_{dq}"
        return f

    def linear_grad(impl, dq="float32"):
        # The float32-result spelling docs/fp8_gemm.md's table measured (BF16 results, the
        # default gemm_output="compute", are measured in docs/bench_gemm_output.md).
        cfg = fp8_ops.FP8Config(implementation=impl, gemm_dequant=dq, gemm_output="float32")

        def loss(x, w, c):
            y = fp8_ops.fp8_linear(x, w, cfg)
            # keep the forward GEMM alive: it feeds the loss and the cotangent
            return jnp.sum(y.astype(jnp.float32) * c) + jnp.sum(y.astype(jnp.float32) ** 2)

        g = jax.grad(loss, (0, 1))
        g.__name__ = f"v_fp8_linear_grad_{impl}_{dq}"
        return g

    NO_TRITON = dict(fp8_ops.GPU_COMPILER_OPTIONS)  # Triton GEMM and dot merger off
    x, w = sds((m, k), jnp.bfloat16), sds((k, n), jnp.float32)
    a8, b8, s = sds((m, k), f8), sds((k, n), f8), sds((), jnp.float32)
    c = sds((m, n), jnp.float32)
    variants = {
        "params": (v_params, (a8, s, b8, s)),
        "jnp_quant": (v_jnp_quant, (x, w)),
        "jnp_quant_codes_barrier": (v_jnp_quant_codes_barrier, (x, w)),
        "pallas_quant": (v_pallas_quant, (x, w)),
        "pallas_codes_param_scale": (v_pallas_codes_param_scale, (x, w, s, s)),
        "param_codes_pallas_scale": (v_param_codes_pallas_scale, (a8, b8, x, w)),
        "param_codes_plain_scale": (v_param_codes_plain_scale, (a8, b8, x, w)),
        "param_codes_pow2_scale": (v_param_codes_pow2_scale, (a8, b8, x, w)),
        "scale_after_dot": (v_scale_after_dot, (a8, b8, x, w)),
        "scale_barrier": (v_scale_barrier, (a8, b8, x, w)),
        "scale_reduce_only": (v_scale_reduce_only, (a8, b8, x, w)),
        "scale_pallas_copy": (v_scale_pallas_copy, (a8, b8, x, w)),
        "plain_scale_no_triton_gemm": (v_param_codes_plain_scale, (a8, b8, x, w), NO_TRITON),
        "fp8_linear_pallas_no_triton_gemm": (linear("pallas"), (x, w), NO_TRITON),
        "fp8_linear_grad_pallas_no_triton_gemm": (linear_grad("pallas"), (x, w, c), NO_TRITON),
        "fp8_linear_grad_xla_no_triton_gemm": (linear_grad("xla"), (x, w, c), NO_TRITON),
        "scale_after_dot_bf16": (v_scale_after_dot_bf16, (a8, b8, x, w)),
        "fp8_linear_pallas_compute": (linear("pallas", "compute"), (x, w)),
        "fp8_linear_grad_pallas_compute": (linear_grad("pallas", "compute"), (x, w, c)),
        "fp8_linear_grad_xla_compute": (linear_grad("xla", "compute"), (x, w, c)),
        "fp8_linear_pallas": (linear("pallas"), (x, w)),
        "fp8_linear_xla": (linear("xla"), (x, w)),
        "fp8_linear_grad_pallas": (linear_grad("pallas"), (x, w, c)),
        "fp8_linear_grad_xla": (linear_grad("xla"), (x, w, c)),
    }
    rows = []
    for name, (fn, fargs, *opts) in variants.items():
        if args.only and args.only not in name:
            continue
        try:
            options = opts[0] if opts else None
            t0 = time.perf_counter()
            hlo = jax.jit(fn).lower(*fargs).compile(compiler_options=options).as_text() or ""
            compile_s = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - report and go on with the other variants
            rows.append((name, "error", float("nan"), str(e)[:200]))
            continue
        calls = C.custom_call_counts(hlo)
        rows.append((name, calls.get(C.FP8_GEMM_TARGET, 0), compile_s, calls))
        if args.dump:
            with open(os.path.join(args.dump, f"final_{name}.txt"), "w") as f:
                f.write(hlo)
    print(f"JAX {jax.__version__} on {jax.devices()[0].device_kind}, m={m} k={k} n={n}")
    print(f"{'variant':38s} {'FP8 GEMMs':>9s} {'compile s':>9s}  custom calls")
    for name, count, compile_s, calls in rows:
        print(f"{name:38s} {count!s:>9s} {compile_s:9.1f}  {calls}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

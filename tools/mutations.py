"""Mutation check of the FP8 numerics: does some test fail when a formula is made wrong?

Each fault is a list of exact string replacements ``(file, old, new)`` in the library (one fault
may edit a reference and its Pallas kernel alike, where both would carry the same mistake),
plus the tests expected to catch it. For each fault the repository is copied to a temporary
directory, the copy is edited (the working tree is never touched), and the tests run there with
``python -m pytest -x -q``; a fault is caught when they fail. The table printed at the end says
which test caught each fault.

Every ``old`` string must occur exactly once in its file: when the code moves, the script stops
with the fault's name, and the fault is retargeted by editing its entry below.

Usage::

    python tools/mutations.py                    # every fault, the new tests first
    python tools/mutations.py --list             # the faults' names
    python tools/mutations.py -k silu -k e8m0    # faults whose name contains a word
    python tools/mutations.py --baseline         # the chosen tests on the unmutated copy
    python tools/mutations.py --existing         # also run each fault's existing tests
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORACLE_TESTS = "tests/fp8/test_fp8_oracle.py"

QUANT = "pallas_kernels/quant.py"
ACT_REFERENCE = "pallas_kernels/fp8_act/reference.py"
ACT_KERNEL = "pallas_kernels/fp8_act/pallas_triton.py"
FP8_QUANT_REFERENCE = "pallas_kernels/fp8_quant/reference.py"
FP8_QUANT_KERNEL = "pallas_kernels/fp8_quant/pallas_triton.py"
ADAM_KERNEL_MATH = "pallas_kernels/coat_adam/pallas_triton_math.py"
LINEAR = "coat_jax/fp8/linear.py"
FP8_ATTENTION = "coat_jax/fp8/attention.py"
ATTENTION = "coat_jax/attention.py"
LOSSES = "coat_jax/losses.py"


@dataclasses.dataclass(frozen=True)
class Fault:
    """A small wrong change to the numerics.

    Attributes:
      name: a short description.
      edits: ``(file, old, new)`` exact replacements, ``old`` occurring once in ``file``.
      select: the ``-k`` expression choosing the tests of tests/fp8/test_fp8_oracle.py to run.
      existing: the existing tests (pytest arguments) that cover the same code.
    """

    name: str
    edits: tuple[tuple[str, str, str], ...]
    select: str
    existing: tuple[str, ...] = ()


FAULTS = (
    Fault(
        "SiLU derivative x1.05 (kernel and reference share silu_grad)",
        (
            (
                ACT_REFERENCE,
                "    return sig * (1.0 + x32 * (1.0 - sig))",
                "    return 1.05 * sig * (1.0 + x32 * (1.0 - sig))",
            ),
        ),
        "silu-xla-0-float32",
        ("tests/fp8/test_fp8_ops.py", "-k", "silu"),
    ),
    Fault(
        "linear output gradient quantized as E4M3 instead of E5M2",
        (
            (
                LINEAR,
                "dy_q = _per_tensor(dyi.reshape(-1, w_q.shape[1]), config.grad_format, config)",
                "dy_q = _per_tensor(dyi.reshape(-1, w_q.shape[1]), config.act_format, config)",
            ),
        ),
        "linear-xla-0-float32 or gemms",
        ("tests/fp8/test_fp8_ops.py", "-k", "linear"),
    ),
    Fault(
        "linear input gradient x1.04",
        (
            (
                LINEAR,
                "dx = dx.astype(compute).reshape(",
                "dx = (1.04 * dx).astype(compute).reshape(",
            ),
        ),
        "linear-xla-0-float32",
        ("tests/fp8/test_fp8_ops.py", "-k", "linear"),
    ),
    Fault(
        "linear weight gradient x0.97",
        (
            (
                LINEAR,
                "dw = _fp8_dot(x_q, dy_q, ((0,), (0,)), config, compute, jnp.float32).astype(dtype)",
                "dw = (0.97 * _fp8_dot(x_q, dy_q, ((0,), (0,)), config, compute, jnp.float32)).astype(dtype)",
            ),
        ),
        "linear-xla-0-float32",
    ),
    Fault(
        "RMSNorm backward without its projection term (reference and kernel)",
        (
            (
                ACT_REFERENCE,
                "dx = rstd * (dn - n * jnp.mean(dn * n, axis=-1, keepdims=True))",
                "dx = rstd * dn",
            ),
            (
                ACT_KERNEL,
                "dx_ref[...] = (rstd * (dn - n * c[:, None, None])).astype(dx_ref.dtype)",
                "dx_ref[...] = (rstd * dn).astype(dx_ref.dtype)",
            ),
        ),
        "rmsnorm-xla-0-float32 or rmsnorm-pallas-0-float32",
        ("tests/fp8/test_fp8_ops.py", "-k", "rmsnorm"),
    ),
    Fault(
        "RMSNorm weight gradient x0.98 (reference and kernel)",
        (
            (
                ACT_REFERENCE,
                "dw = jnp.sum((dy32 * n_rounded).reshape(-1, n.shape[-1]), axis=0)",
                "dw = 0.98 * jnp.sum((dy32 * n_rounded).reshape(-1, n.shape[-1]), axis=0)",
            ),
            (
                ACT_KERNEL,
                "dw_ref[...] = jnp.sum(dy * n_rounded, axis=0)[None]",
                "dw_ref[...] = 0.98 * jnp.sum(dy * n_rounded, axis=0)[None]",
            ),
        ),
        "rmsnorm-xla-0-float32 or rmsnorm-pallas-0-float32",
    ),
    Fault(
        "RMSNorm 1/rms without eps (reference and kernel)",
        (
            (
                ACT_REFERENCE,
                "rstd = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)",
                "rstd = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True))",
            ),
            (
                ACT_KERNEL,
                "rstd = jax.lax.rsqrt(jnp.sum(jnp.sum(x * x, axis=-1), axis=-1) / d + eps)",
                "rstd = jax.lax.rsqrt(jnp.sum(jnp.sum(x * x, axis=-1), axis=-1) / d)",
            ),
        ),
        "rmsnorm-xla-0-float32 or rmsnorm-pallas-0-float32",
    ),
    Fault(
        "SiLU forward x1.01 (kernel and reference share silu32)",
        (
            (
                ACT_REFERENCE,
                "    return x32 / (1.0 + jnp.exp(-x32))",
                "    return 1.01 * x32 / (1.0 + jnp.exp(-x32))",
            ),
        ),
        "silu-xla-0-float32",
    ),
    Fault(
        "product backward multiplies by the wrong input (reference and kernel)",
        (
            (ACT_REFERENCE, "da = dy32 * b_q.dequantize()", "da = dy32 * a_q.dequantize()"),
            (
                ACT_KERNEL,
                "da_ref[...] = (dy * b).astype(da_ref.dtype)",
                "da_ref[...] = (dy * a).astype(da_ref.dtype)",
            ),
        ),
        "mul-xla-0-float32 or mul-pallas-0-float32",
    ),
    Fault(
        "SwiGLU gate gradient without SiLU's x(1 - sigmoid) term (kernel and reference)",
        (
            (
                ACT_REFERENCE,
                "return dy32 * u32 * sig * (1.0 + g32 * (1.0 - sig)), dy32 * g32 * sig",
                "return dy32 * u32 * sig, dy32 * g32 * sig",
            ),
        ),
        "swiglu-xla-0-float32 or swiglu-pallas-0-float32",
    ),
    Fault(
        "E8M0 scale's exact-boundary corrections removed",
        (
            (
                QUANT,
                "    r = round_scale(scale, scale_format)\n"
                "    r = jnp.where(peak <= fmax * (r * 0.5), r * 0.5, r)\n"
                "    return jnp.where(peak > fmax * r, r * 2.0, r)",
                "    return round_scale(scale, scale_format)",
            ),
        ),
        "inexact",
        ("tests/fp8/test_group_scale.py",),
    ),
    Fault(
        "dequantize_dre 0.4% bias",
        (
            (
                QUANT,
                "x = jnp.sign(y) * jnp.power(jnp.abs(y), 1.0 / expand[..., None]) * center[..., None]",
                "x = jnp.sign(y) * jnp.power(jnp.abs(y), 1.0 / expand[..., None]) * center[..., None] * 1.004",
            ),
        ),
        "dre or optimizer or adamw",
        ("tests/optim/test_quant.py", "tests/optim/test_optim.py", "-k", "spec"),
    ),
    Fault(
        "optimizer kernel's DRE decode 0.4% bias",
        (
            (
                ADAM_KERNEL_MATH,
                "return _copysign(math_.power(jnp.abs(y), inv_expand, ftz_log=True), y) * center",
                "return _copysign(math_.power(jnp.abs(y), inv_expand, ftz_log=True), y) * center * 1.004",
            ),
        ),
        "optimizer and pallas",
    ),
    Fault(
        "DRE off: exponent k forced to 1 (reference and kernel)",
        (
            (QUANT, "k = jnp.clip(k, 1.0 / expand_min, MAX_EXPAND)", "k = jnp.ones_like(k)"),
            (
                ADAM_KERNEL_MATH,
                "k = jnp.clip(k, 1.0 / expand_min, quant.MAX_EXPAND)",
                "k = jnp.ones_like(k)",
            ),
        ),
        "dre or optimizer",
    ),
    Fault(
        "FP8 cast double-rounded through bfloat16 (reference and kernel)",
        (
            (
                QUANT,
                "return jnp.clip(x, -fmax, fmax).astype(FORMATS[fmt])",
                "return jnp.clip(x, -fmax, fmax).astype(jnp.bfloat16).astype(FORMATS[fmt])",
            ),
            (
                FP8_QUANT_KERNEL,
                "codes = jnp.clip(x / scale[..., None], -fmax, fmax).astype(quant.FORMATS[fmt])",
                "codes = jnp.clip(x / scale[..., None], -fmax, fmax).astype(jnp.bfloat16).astype(quant.FORMATS[fmt])",
            ),
        ),
        "quantizer",
    ),
    Fault(
        "per-tensor scale rounded to the nearest bfloat16 instead of up",
        (
            (
                FP8_QUANT_REFERENCE,
                "bits = (bits + jnp.uint32(0xFFFF)) & jnp.uint32(0xFFFF0000)",
                "bits = (bits + jnp.uint32(0x8000)) & jnp.uint32(0xFFFF0000)",
            ),
        ),
        "per_tensor or linear-xla-0-float32",
    ),
    Fault(
        "dropped clip before the per-tensor kernel's cast",
        (
            (
                FP8_QUANT_KERNEL,
                "q_ref[...] = jnp.clip(y, -fmax, fmax).astype(quant.FORMATS[fmt])",
                "q_ref[...] = y.astype(quant.FORMATS[fmt])",
            ),
        ),
        "scaled_cast",
    ),
    Fault(
        "dropped clip in cast_to_fp8",
        (
            (
                QUANT,
                "return jnp.clip(x, -fmax, fmax).astype(FORMATS[fmt])",
                "return x.astype(FORMATS[fmt])",
            ),
        ),
        "scaled_cast",
        ("tests/optim/test_quant.py", "-k", "clips"),
    ),
    Fault(
        "group scale from max(x) instead of max|x| (reference and kernel)",
        (
            (
                QUANT,
                "scale = absmax_scale(jnp.max(jnp.abs(x_g), axis=-1), fmax, scale_format)",
                "scale = absmax_scale(jnp.max(x_g, axis=-1), fmax, scale_format)",
            ),
            (
                FP8_QUANT_KERNEL,
                "scale = quant.absmax_scale(jnp.max(jnp.abs(x), axis=-1), fmax, scale_format)",
                "scale = quant.absmax_scale(jnp.max(x, axis=-1), fmax, scale_format)",
            ),
        ),
        "per_group",
    ),
    Fault(
        "off by one group: the 1xG kernels' grid skips the last column of group tiles",
        (
            (
                ACT_KERNEL,
                "        grid=(m // bm, g // bg),",
                "        grid=(m // bm, max(g // bg - 1, 1)),",
            ),
        ),
        "pallas and (silu or mul or swiglu)",
    ),
    Fault(
        "off by one group: the per-group reference quantizes groups of G + 1",
        (
            (
                FP8_QUANT_REFERENCE,
                "return quant.quantize_absmax(x, group_size=group_size, fmt=fmt, scale_format=scale_format)",
                "return quant.quantize_absmax(x, group_size=group_size + 1, fmt=fmt, scale_format=scale_format)",
            ),
        ),
        "silu-xla-0-float32 or per_group",
    ),
    Fault(
        "FP8 attention keeps q, k, v in E5M2",
        (
            (
                FP8_ATTENTION,
                'fp8_quant.quantize_per_group(t, **config.quantize_kwargs("quantize_per_group"))',
                'fp8_quant.quantize_per_group(t, **{**config.quantize_kwargs("quantize_per_group"), "fmt": "e5m2"})',
            ),
        ),
        "attention-xla-0-float32 or residuals",
    ),
    Fault(
        "attention backward from a kept output without rowsum(dO * O)",
        ((ATTENTION, "ds = probs * (dp - d[..., None])", "ds = probs * dp"),),
        "attention_linear-xla-0-float32",
        ("tests/fp8/test_attention_backward.py", "-k", "gradients_are_close"),
    ),
    Fault(
        "chunked cross-entropy gradient 0.3% bias",
        (
            (
                LOSSES,
                "coef_BT = weight_BT * (g / denom)",
                "coef_BT = weight_BT * (1.003 * g / denom)",
            ),
        ),
        "cross_entropy",
        ("tests/model/test_losses.py",),
    ),
    # The same kinds of fault in a Pallas kernel alone, its reference left right.
    Fault(
        "RMSNorm kernel's backward without its projection term (kernel only)",
        (
            (
                ACT_KERNEL,
                "dx_ref[...] = (rstd * (dn - n * c[:, None, None])).astype(dx_ref.dtype)",
                "dx_ref[...] = (rstd * dn).astype(dx_ref.dtype)",
            ),
        ),
        "rmsnorm-pallas-0-float32",
    ),
    Fault(
        "product kernel's backward multiplies by the wrong input (kernel only)",
        (
            (
                ACT_KERNEL,
                "da_ref[...] = (dy * b).astype(da_ref.dtype)",
                "da_ref[...] = (dy * a).astype(da_ref.dtype)",
            ),
        ),
        "mul-pallas-0-float32",
    ),
    Fault(
        "SwiGLU kernel's backward decodes gate with up's scales (kernel only)",
        (
            (
                ACT_KERNEL,
                "g = qg_ref[...].astype(jnp.float32) * quant.decode_scale(sg_ref[...])[..., None]",
                "g = qg_ref[...].astype(jnp.float32) * quant.decode_scale(su_ref[...])[..., None]",
            ),
        ),
        "swiglu-pallas-0-float32",
    ),
    Fault(
        "1xG kernel quantizer double-rounds through bfloat16 (kernel only)",
        (
            (
                FP8_QUANT_KERNEL,
                "codes = jnp.clip(x / scale[..., None], -fmax, fmax).astype(quant.FORMATS[fmt])",
                "codes = jnp.clip(x / scale[..., None], -fmax, fmax).astype(jnp.bfloat16)"
                ".astype(quant.FORMATS[fmt])",
            ),
        ),
        "quantizer and pallas",
    ),
    Fault(
        "optimizer kernel's DRE exponent forced to 1 (kernel only)",
        (
            (
                ADAM_KERNEL_MATH,
                "k = jnp.clip(k, 1.0 / expand_min, quant.MAX_EXPAND)",
                "k = jnp.ones_like(k)",
            ),
        ),
        "optimizer and pallas",
    ),
)


def _copy_tree(dest: str) -> None:
    shutil.copytree(
        ROOT,
        dest,
        ignore=shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache", ".ruff_cache"),
        dirs_exist_ok=True,
    )


def apply(fault: Fault, tree: str) -> None:
    """Applies ``fault``'s edits to the copy at ``tree``; each ``old`` must occur exactly once."""
    for path, old, new in fault.edits:
        full = os.path.join(tree, path)
        with open(full) as f:
            text = f.read()
        count = text.count(old)
        if count != 1:
            raise SystemExit(
                f"fault {fault.name!r}: {old!r} occurs {count} times in {path} (needs exactly "
                "once); retarget the fault's edit in tools/mutations.py"
            )
        with open(full, "w") as f:
            f.write(text.replace(old, new))


def stale_edits(tree: str = ROOT) -> list[str]:
    """The faults whose ``old`` strings no longer occur exactly once in ``tree``'s files."""
    stale = []
    for fault in FAULTS:
        for path, old, _ in fault.edits:
            with open(os.path.join(tree, path)) as f:
                if f.read().count(old) != 1:
                    stale.append(f"{fault.name}: {path}: {old!r}")
    return stale


def _pytest(tree: str, args: list[str], timeout: float) -> tuple[str, str]:
    """Runs pytest in ``tree``: ``("caught", test)``, ``("passed", "")`` or ``("timeout", "")``."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args]
    env = dict(os.environ, PYTHONPATH=tree)
    try:
        done = subprocess.run(
            cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return "timeout", ""
    out = done.stdout + done.stderr
    if done.returncode == 0:
        return "passed", ""
    if done.returncode == 5:
        return "no tests", ""
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.MULTILINE)
    return "caught", failed[0] if failed else out.strip().splitlines()[-1]


def run(fault: Fault | None, *, existing: bool, timeout: float) -> dict:
    """Applies ``fault`` (``None``: the baseline) to a fresh copy and runs its tests."""
    with tempfile.TemporaryDirectory(prefix="coat_mutation_") as tree:
        _copy_tree(tree)
        if fault is not None:
            apply(fault, tree)
        select = ["-k", fault.select] if fault is not None else []
        result = {"new": _pytest(tree, [ORACLE_TESTS, *select], timeout)}
        if fault is not None and fault.existing and (existing or result["new"][0] != "caught"):
            result["existing"] = _pytest(tree, list(fault.existing), timeout)
        return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", action="append", default=[], help="run faults naming this word")
    parser.add_argument("--list", action="store_true", help="list the faults and exit")
    parser.add_argument("--baseline", action="store_true", help="run the tests unmutated")
    parser.add_argument("--existing", action="store_true", help="also run the existing tests")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run")
    args = parser.parse_args(argv)
    faults = [f for f in FAULTS if not args.k or any(w in f.name for w in args.k)]
    if args.list:
        for f in faults:
            print(f.name)
        return 0
    if args.baseline:
        result = run(None, existing=False, timeout=args.timeout)
        print("baseline:", result["new"][0])
        return 0 if result["new"][0] == "passed" else 1
    rows, missed = [], 0
    for fault in faults:
        start = time.time()
        result = run(fault, existing=args.existing, timeout=args.timeout)
        caught = [
            f"{kind}: {test}" for kind, (status, test) in result.items() if status == "caught"
        ]
        missed += not caught
        status = "caught" if caught else "NOT CAUGHT " + str(result)
        rows.append((fault.name, status, "; ".join(caught)))
        print(f"{fault.name} | {status} | {'; '.join(caught)} | {time.time() - start:.0f} s")
        sys.stdout.flush()
    print("\n| fault | result | caught by |\n|---|---|---|")
    for name, status, by in rows:
        print(f"| {name} | {status} | {by} |")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())

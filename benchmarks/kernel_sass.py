"""Compiled instruction counts of the fused COAT AdamW kernel, for Hopper, with or without a GPU.

Usage: ``python benchmarks/kernel_sass.py --settings 16/4,16/4/t2 [--out benchmarks/results/optimizer/kernel_sass]``.

For each launch setting (``bench_optimizer.parse_setting``'s syntax) this lowers
``pallas_kernels.coat_adam.coat_adamw_apply`` for CUDA on a ``[4096, 4096]`` float32 parameter
with float32 gradients and E4M3 moments with expansion (one Llama-2-7B projection), compiles its
Triton kernel to PTX with the Triton compiler in JAX's CUDA plugin (it needs no GPU), then to
``sm_90a`` SASS with ``ptxas``, and counts the SASS instructions of one thread. Divided by the
elements one thread updates (``block_rows * 128 / (32 * num_warps)``), that is the issue-slot
cost per parameter: a Hopper SM issues four warp instructions per clock, so a kernel that needs
N instructions per parameter cannot update more than ``4 * 32 * SMs * clock / N`` parameters per
second, whatever its memory traffic.

This is a count, not a timing (timings: ``bench_optimizer.py`` on a GPU). Needs, besides JAX:
``jax-cuda12-plugin`` and ``jax-cuda12-pjrt`` of jaxlib's version (pip; on a CPU machine set
``JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``), a ``ptxas`` that reads the PTX version
the plugin writes (``nvidia-cuda-nvcc-cu12`` 12.9 for JAX 0.10), and ``cuobjdump`` (any CUDA
toolkit, or the ``triton`` wheel's ``backends/nvidia/bin``). ``--ptxas``/``--cuobjdump`` name
them where they are not on ``PATH``. Writes ``OUT.jsonl`` (one record per setting, with the
environment and command; ``benchmarks/render.py`` renders docs/kernel_sass_optimizer.md's table
from the committed records) and ``OUT.<setting>.sass`` listings when ``--keep-sass``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_optimizer import parse_setting  # noqa: E402

from pallas_kernels import coat_adam as ca  # noqa: E402
from pallas_kernels.coat_adam import pallas_triton  # noqa: E402

SHAPE = (4096, 4096)
SASS_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def triton_compiler():
    """JAX's Triton-to-PTX entry point with the CUDA plugin's handler registered."""
    from jax._src.lib import triton

    jax.devices()  # plugin discovery
    if not triton.has_compilation_handler("CUDA"):
        try:
            import jax_plugins.xla_cuda12 as plugin
        except ImportError as e:
            raise SystemExit(
                "kernel_sass.py needs the CUDA plugin's Triton compiler: pip install "
                f"jax-cuda12-plugin=={jax.__version__} jax-cuda12-pjrt=={jax.__version__} "
                "(no GPU needed; set JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1)"
            ) from e
        plugin.initialize()
    if not triton.has_compilation_handler("CUDA"):
        raise SystemExit("the CUDA plugin registered no Triton compilation handler")
    return triton


def kernel_ptx(config: ca.KernelConfig) -> str:
    """PTX of the fused apply's Triton kernel at ``config`` (compiled for compute capability 9.0)."""
    from jax import export
    from jax._src.pallas.triton import pallas_call_registration as registration

    triton = triton_compiler()
    modules, ptx = [], []
    compile_ = triton.compile
    custom_call = registration.mlir.custom_call

    def compile_capture(platform, module, arch_name, **kw):
        # JAX versions that compile at lowering time: keep the PTX.
        result = compile_(platform, module, arch_name, **kw)
        ptx.append(result.asm)
        return result

    def custom_call_capture(*args, backend_config=None, **kw):
        # Versions that hand XLA the Triton module instead: keep the module's bytes.
        if isinstance(backend_config, dict) and "ir" in backend_config:
            modules.append(backend_config["ir"].value_bytes)
        return custom_call(*args, backend_config=backend_config, **kw)

    spec = ca.MomentSpec()
    mu = ca.quantize_moment(jnp.zeros(SHAPE), "e4m3", spec, 16)
    nu = ca.quantize_moment(jnp.zeros(SHAPE), "e4m3", spec, 16)

    def step(p, g, mu, nu):
        return ca.coat_adamw_apply(
            p,
            g,
            mu,
            nu,
            count=jnp.int32(1),
            b1=0.9,
            b2=0.95,
            eps=1e-8,
            expand_min=16,
            learning_rate=1e-4,
            weight_decay=0.1,
            spec=spec,
            implementation="pallas",
            config=config,
        )

    require_gpu = pallas_triton.require_gpu
    triton.compile, registration.mlir.custom_call = compile_capture, custom_call_capture
    pallas_triton.require_gpu = lambda interpret: None  # lowering only: nothing runs
    try:
        export.export(
            jax.jit(step),
            platforms=("cuda",),
            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(jnp.zeros(SHAPE), jnp.zeros(SHAPE), mu, nu)
    finally:
        triton.compile, registration.mlir.custom_call = compile_, custom_call
        pallas_triton.require_gpu = require_gpu
    if len(modules) > 1:
        raise RuntimeError(f"expected one Triton kernel, captured {len(modules)}")
    if modules:
        (module,) = modules
        ptx.append(
            triton.compile(
                "cuda",
                module,
                "9.0",
                num_warps=config.num_warps,
                num_ctas=1,
                num_stages=config.num_stages,
            ).asm
        )
    if len(ptx) != 1:
        raise RuntimeError(f"expected one Triton kernel, captured {len(ptx)}")
    return ptx[0]


def find_tool(name: str, given: str | None) -> str:
    if given:
        return given
    found = shutil.which(name)
    candidates = [found] if found else []
    try:
        import nvidia.cuda_nvcc as nvcc  # the pip ptxas

        candidates.append(os.path.join(list(nvcc.__path__)[0], "bin", name))
    except ImportError:
        pass
    try:
        import triton  # its wheel ships ptxas, cuobjdump and nvdisasm

        candidates.append(
            os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin", name)
        )
    except ImportError:
        pass
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    raise SystemExit(f"{name} not found: pass --{name} PATH")


def sass(ptx: str, ptxas: str, cuobjdump: str) -> tuple[list[tuple[int, str]], str]:
    """``[(address, instruction)]`` of the kernel's SASS for sm_90a, and ptxas's resource line."""
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        built = subprocess.run(
            [ptxas, "-arch=sm_90a", "-O3", "-v", src, "-o", cubin], capture_output=True, text=True
        )
        if built.returncode:
            raise SystemExit(f"ptxas failed (too old for this PTX?):\n{built.stderr[-2000:]}")
        usage = " ".join(
            line.split(":", 1)[-1].strip()
            for line in built.stderr.splitlines()
            if "registers" in line
        )
        dumped = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True)
        if dumped.returncode:
            raise SystemExit(f"cuobjdump failed:\n{dumped.stderr[-2000:]}")
        listing = dumped.stdout
    return parse_listing(listing), usage.strip()


def parse_listing(listing: str) -> list[tuple[int, str]]:
    """``[(address, instruction)]`` of a ``cuobjdump -sass`` listing."""
    return [(int(m[1], 16), m[2]) for m in map(SASS_LINE.match, listing.splitlines()) if m]


def opcode(instruction: str) -> str:
    words = instruction.split()
    return words[1] if words[0].startswith("@") else words[0]


def load_schedule(lines: list[tuple[int, str]]) -> dict:
    """Where the kernel issues its global loads (``LDG``), as fractions of its length: a
    load issued late leaves its latency exposed unless other warps cover it. ``wide`` are the
    128-bit loads (the float32 tiles: gradient, parameter)."""
    at = [(k / len(lines), opcode(ins)) for k, (_, ins) in enumerate(lines)]
    loads = [x for x, op in at if op.startswith("LDG")]
    wide = [x for x, op in at if op.startswith("LDG.E.128")]
    return {"loads": len(loads), "last_load_at": max(loads, default=0.0), "wide_loads_at": wide}


def count(setting: str, ptxas: str, cuobjdump: str, keep: str | None) -> dict:
    config = parse_setting(setting)
    lines, usage = sass(kernel_ptx(config), ptxas, cuobjdump)
    if keep:
        with open(f"{keep}.{setting.replace('/', '_')}.sass", "w") as f:
            f.write("\n".join(f"{a:05x} {ins}" for a, ins in lines) + "\n")
    per_thread = config.block_rows * 128 / (32 * config.num_warps)
    ops = collections.Counter(opcode(ins) for _, ins in lines)
    return {
        "setting": setting,
        "config": dataclasses.asdict(config),
        "shape": list(SHAPE),
        "elements_per_thread": per_thread,
        "sass_total": len(lines),
        "per_element": len(lines) / per_thread,
        "mufu": sum(v for k, v in ops.items() if k.startswith("MUFU")),
        "resources": usage,
        "opcodes": dict(ops.most_common()),
        **load_schedule(lines),
    }


def _fast_path(r: dict, key: str):
    """``r[key]`` over the kernel's fast path: records of a kernel with a flush-to-zero branch
    count the path without it (``key + "_fast_path"``), others count every instruction."""
    return r[f"{key}_fast_path"] if f"{key}_fast_path" in r else r[key]


def table(records: list[dict]) -> list[str]:
    """The counts of ``records`` as a Markdown table, per element against the first setting,
    load positions as fractions of the instruction order (truncated), each with its stamp."""
    tr = C.truncated
    base = _fast_path(records[0], "per_element")
    lines = [
        "| setting | SASS (all) | fast path | branches left out | per element | MUFU per element "
        f"| per element vs {records[0]['setting']} | global loads (last at) | 128-bit loads at "
        "| ptxas | device | JAX | ptxas version | date |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['setting']} | {r['sass_total']} | {r.get('sass_fast_path', r['sass_total'])} | {r.get('branches_left_out', 0)} | "
            f"{tr(_fast_path(r, 'per_element'), 2)} | "
            f"{tr(_fast_path(r, 'mufu') / r['elements_per_thread'], 2)} | "
            f"{C.times(_fast_path(r, 'per_element') / base)} | "
            f"{r['loads']} ({tr(100 * r['last_load_at'], 0)}%) | "
            f"{', '.join(f'{tr(100 * x, 0)}%' for x in r['wide_loads_at'])} | "
            f"{r['resources']} | {r['device']} | {r['jax']} | {r['ptxas_version']} | "
            f"{r['date'][:10]} |"
        )
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="16/4,16/4/t2")
    ap.add_argument("--out", help="write the records to OUT.jsonl")
    ap.add_argument("--ptxas")
    ap.add_argument("--cuobjdump")
    ap.add_argument("--keep-sass", action="store_true", help="also write OUT.<setting>.sass")
    args = ap.parse_args(argv)
    ptxas, cuobjdump = find_tool("ptxas", args.ptxas), find_tool("cuobjdump", args.cuobjdump)
    env = C.environment()
    ptxas_version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    env["ptxas_version"] = ptxas_version.strip().splitlines()[-1]
    keep = args.out if args.keep_sass and args.out else None
    settings = [x for x in args.settings.split(",") if x]
    if not settings:
        raise SystemExit("--settings names no launch setting")
    records = []
    for setting in settings:
        r = count(setting, ptxas, cuobjdump, keep)
        records.append({**env, "command": C.command_line(), **r})
        print(
            f"{setting}: {r['sass_total']} SASS instructions, "
            f"{C.truncated(r['per_element'], 2)} per element ({r['resources']})",
            flush=True,
        )
    print("\n".join(table(records)))
    C.write_jsonl(args.out, records)


if __name__ == "__main__":
    main()

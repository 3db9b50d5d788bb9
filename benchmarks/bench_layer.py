"""One Llama-2-7B decoder layer: forward + backward, and the layer step with its optimizer.

The layer is the trainer's own model (``configs/llama2_7b.yaml`` with ``num_hidden_layers=1``,
built by ``coat_jax.training.program.build_program``; hidden 4096, intermediate 11008, 32 heads):
its ``Llama.decoder`` under the config's layout and remat policy (``--scan``, ``--remat``), with
float32 master weights and bfloat16 activations, at seq 2048 and each ``--batches`` value. Two
programs are timed, jitted, after a warm-up, the median of ``--reps`` calls, each ending in
``block_until_ready``:

* ``fwd_bwd``: ``x, dy -> jax.vjp(layer, params, x)[1](dy)`` (forward, then backward into the
  weights and the input), as in every earlier run;
* the layer step (``--optimizer``, on by default): the same forward and backward into the
  layer's weights and the input, then the mode's optimizer applied to the layer's weights as
  the trainer applies it: ``build_program``'s ``tx`` (``adamw`` for bf16 and fp8, ``coat_adamw``
  for coat, clipping by the layer's gradient norm at the config's ``grad_clip``) through
  ``coat_jax.apply_gradients`` (coat_adamw's fused apply), weights and state donated.

Per mode and batch:

* time (ms) and model TFLOP/s of ``fwd_bwd`` (6 FLOPs per weight per token + causal attention
  6*T*d per token), and the layer step's time;
* activations kept for backward in U = batch*seq*hidden*2 bytes: the residuals of ``jax.vjp``
  (``coat_jax.residuals`` under ``jax.make_jaxpr``/``jax.eval_shape``) that depend on the input;
* XLA's ``compiled.memory_analysis()`` (arguments + outputs + temporaries) and the allocator's
  ``peak_bytes_in_use`` of ``fwd_bwd`` (each mode in a fresh subprocess, batches in increasing
  order, so the peak read after a batch is that batch's; the layer steps run after every
  batch's ``fwd_bwd``, so they do not raise it);
* FP8 GEMMs in the compiled HLO (custom calls ``__cublas$lt$matmul$f8``);
* kernels per program: the instructions of the compiled HLO that launch work, counted in the
  computations that run (the entry and the scan's while bodies, not the fused computations
  inside a fusion), by opcode (fusions, custom calls: GEMMs, attention, Pallas kernels, copies,
  ...), and how many of them write a transposed FP8 array (``fp8 transposes``);
* the time split of the layer step (of ``fwd_bwd`` with ``--no-optimizer``), measured: after the
  timed calls, ``--profile-reps`` more run under ``jax.profiler.trace``; every GPU kernel of the
  trace (``jax.profiler.ProfileData``, planes ``/device:GPU:N``, their stream lines) goes to one
  of :data:`SPLIT_CATEGORIES` (:func:`kernel_category`: its name, else the HLO instruction it
  ran); per category ms per step and % of the summed kernel time, the top kernels by time, the
  summed kernel time, the time some kernel ran (busy) and the wall time of the untraced step
  (wall - busy = launch gaps and idle). The CPU has no device kernels: its rows say so.

``--weight-residual master,fp8`` runs the fp8 and coat modes once per
``FP8Config.weight_residual`` option (the trainer's ``fp8_weight_residual``): ``master``
re-quantizes each float32 weight in backward, ``fp8`` keeps forward's E4M3 codes for it
(docs/memory_options.md, "FP8 weight codes"). bf16 has no FP8 weights and runs once.

    python benchmarks/bench_layer.py --tiny --weight-residual master,fp8    # CPU smoke test
    python benchmarks/bench_layer.py --out-dir runs/layer --docs docs/bench_layer.md   # one H200
    python benchmarks/bench_layer.py --batches 1,4 --weight-residual master,fp8 --reps 5 \\
        --warmup 2 --profile-reps 3 --out-dir runs/layer --docs docs/bench_layer.md
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import os
import re
import sys
import tempfile
import time
import warnings
from collections import Counter
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

MODES = ("bf16", "fp8", "coat")
PAPER_U = {"bf16": 22.66, "fp8": 18.33, "coat": 13.33}  # COAT Table 2 (PyTorch, TE for fp8)
WEIGHT_RESIDUALS = ("master", "fp8", "once")  # coat_jax.fp8_ops.WEIGHT_RESIDUALS (no JAX here)
# The trainer's fp8_kernels option: "default" leaves it unset (with `kernels: auto` the FP8 ops
# then run as the trainer's shape rule picks, optimizers.fp8_ops_auto).
FP8_KERNELS = ("default", "auto", "xla", "pallas")
# The optimizer of each mode's layer step, as train.py pairs them (docs/bench_e2e.md).
MODE_OPTIMIZERS = {"bf16": "adamw", "fp8": "adamw", "coat": "coat_adamw"}
# Instructions that launch no kernel of their own: bookkeeping, control flow (its bodies are
# counted instead), and the second half of async pairs.
NOT_KERNELS = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "while",
    "conditional",
    "call",
    "after-all",
    "add-dependency",
    "opt-barrier",
    "partition-id",
    "replica-id",
    "domain",
}
# Where the time of a layer step goes. Every traced GPU kernel lands in exactly one.
SPLIT_CATEGORIES = {
    "gemm": "GEMMs",
    "attention": "attention",
    "fp8_pallas": "FP8 Pallas kernels",
    "fp8_xla": "FP8 XLA fusions",
    "optimizer": "optimizer",
    "memcpy": "memcpy/memset",
    "other": "other XLA kernels",
}
# The layer step's optimizer runs under this jax.named_scope, so that its XLA fusions can be
# told from the backward's by their HLO metadata (op_name).
OPTIMIZER_SCOPE = "layer_optimizer"
# Kernel names: cuDNN's attention (cudnn_generated_fort_native_sdpa_sm90_flash_fprop_...);
# cuBLAS/cuBLASLt GEMMs (nvjet_* and sm90_xmma_gemm_* on Hopper, cutlass kernels, the split-K
# reduction, cuBLASLt's epilogue kernels); the CUPTI names of copies and fills.
_ATTENTION_NAME = re.compile(r"fmha|flash|sdpa|attention|cudnn")
_GEMM_NAME = re.compile(r"gemm|gemv|cublas|cutlass|xmma|nvjet|matmul|splitkreduce")
_MEMCPY_NAME = re.compile(r"memcpy|memset")
# Every pallas_call name of pallas_kernels/fp8_act/ and fp8_quant/ starts with the first, of
# pallas_kernels/coat_adam/ with the second (tests/benchmarks/test_bench_layer.py reads the sources).
FP8_KERNEL_PREFIX = "fp8_"
OPTIMIZER_KERNEL_PREFIX = "coat_adam"
# Lines of a device plane that the profiler derives from the kernels it traced (xprof's
# names): counting them as well would count each kernel twice.
DERIVED_LINES = {
    "Steps",
    "XLA Modules",
    "XLA Ops",
    "Async XLA Ops",
    "XLA TraceMe",
    "Launch Stats",
    "Source code",
    "TensorFlow Name Scope",
    "TensorFlow Ops",
    "Framework Name Scope",
    "Framework Ops",
}
GPU_PLANE_PREFIX = "/device:GPU:"
TOP_KERNELS = 10
TOP_HLO_OPS = 5  # HLO instructions listed per kernel name in the split's ``top``
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")


class Instruction(NamedTuple):
    name: str
    type: str
    opcode: str
    rest: str  # operands, attributes and metadata


def _computations(hlo: str) -> tuple[dict[str, list[Instruction]], str | None]:
    """Compiled HLO text -> ({computation: [instructions]}, entry name)."""
    comps: dict[str, list[Instruction]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        if current is None:
            m = _COMPUTATION.match(line)
            if m and not line.startswith("HloModule"):
                current = m.group(2)
                comps[current] = []
                entry = current if m.group(1) else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if m:
            comps[current].append(Instruction(*m.groups()))
    return comps, entry


def _scheduled(comps: dict[str, list[Instruction]], entry: str | None) -> set[str]:
    """The computations that run as a schedule: the entry and, through control flow, its bodies."""
    scheduled, todo = set(), [] if entry is None else [entry]
    while todo:
        name = todo.pop()
        if name in scheduled or name not in comps:
            continue
        scheduled.add(name)
        for ins in comps[name]:
            if ins.opcode in ("while", "conditional", "call"):
                todo += re.findall(
                    r"(?:body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)",
                    ins.rest,
                )
                for group in re.findall(r"branch_computations=\{([^}]*)\}", ins.rest):
                    todo += [b.strip().lstrip("%") for b in group.split(",")]
    return scheduled


def _kernels(hlo: str):
    """``(instruction, computations)`` for every kernel-launching instruction that runs."""
    comps, entry = _computations(hlo)
    for name in _scheduled(comps, entry):
        for ins in comps[name]:
            if ins.opcode not in NOT_KERNELS and not ins.opcode.endswith("-done"):
                yield ins, comps


def kernel_counts(hlo: str) -> dict:
    """Kernels one run of a compiled executable launches (a static count, from its HLO text).

    Counts the instructions of the computations that run as a schedule (the entry, and through
    ``while``/``conditional``/``call`` their bodies, each once: a one-layer scan runs its body
    once), skipping :data:`NOT_KERNELS` and the ``-done`` halves of async pairs; fused
    computations and reducers are inside their kernel and not counted. Returns
    ``{"total": n, "by_opcode": {...}, "fp8_transposes": m}``, where ``fp8_transposes`` counts
    the kernels whose result is an FP8 array and that are, or fuse, a ``transpose``.
    """
    by_opcode: Counter = Counter()
    fp8_transposes = 0
    for ins, comps in _kernels(hlo):
        by_opcode[ins.opcode] += 1
        if not ins.type.lstrip("(").startswith("f8"):
            continue
        called = re.findall(r"calls=%?([\w.\-]+)", ins.rest)
        if ins.opcode == "transpose" or any(
            c.opcode == "transpose" for name in called for c in comps.get(name, [])
        ):
            fp8_transposes += 1
    return {
        "total": sum(by_opcode.values()),
        "by_opcode": dict(by_opcode.most_common()),
        "fp8_transposes": fp8_transposes,
    }


def _instruction_category(ins: Instruction) -> str | None:
    """The split category an HLO instruction's kernel belongs to, where the HLO says it."""
    target = re.search(r'custom_call_target="([^"]+)"', ins.rest)
    target = target.group(1) if target else ""
    op_name = re.search(r'op_name="([^"]*)"', ins.rest)
    if target.startswith("__cublas"):
        return "gemm"
    if target.startswith("__cudnn$fmha"):
        return "attention"
    if op_name and re.search(rf"(^|/){OPTIMIZER_SCOPE}(/|$)", op_name.group(1)):
        return "optimizer"
    if target == "__gpu$xla.gpu.triton":
        # Every Pallas kernel of the layer outside its optimizer is an FP8 op of ours.
        return "fp8_pallas"
    if ins.opcode in ("fusion", "convert") and re.search(r"\bf8e\w*\[", ins.type):
        return "fp8_xla"
    return None


def hlo_kernel_categories(hlo: str) -> dict[str, str | None]:
    """``{instruction name: category or None}`` for every kernel of a compiled program.

    The category is what the HLO shows: cuBLAS custom calls are GEMMs, cuDNN ``fmha`` calls
    attention; instructions whose metadata (``op_name``) lies in :data:`OPTIMIZER_SCOPE` the
    optimizer; other Pallas (Triton) custom calls the FP8 Pallas kernels; fusions and converts
    that write an FP8 array the FP8 XLA fusions; ``None`` for the rest. Each name is there as
    written and as XLA names its kernel (``.`` and ``-`` as ``_``), so that a traced kernel
    finds its instruction by either.
    """
    out = {}
    for ins, _ in _kernels(hlo):
        category = _instruction_category(ins)
        out[ins.name] = category
        out[re.sub(r"[.\-]", "_", ins.name)] = category
    return out


def hlo_category_counts(hlo: str) -> dict[str, int]:
    """How many kernels of a compiled program :func:`hlo_kernel_categories` places, by category."""
    counts = Counter(_instruction_category(ins) for ins, _ in _kernels(hlo))
    return {c: counts[c] for c in SPLIT_CATEGORIES if counts[c]}


def classify_kernel(name: str) -> str:
    """The split category of a GPU kernel, from its name alone (``"other"`` when it says none).

    Copies and fills (CUPTI's ``Memcpy*``/``Memset*``), cuDNN attention, cuBLAS/cuBLASLt and
    CUTLASS GEMMs, and our Pallas kernels by their ``pallas_call`` names (:data:`FP8_KERNEL_PREFIX`,
    :data:`OPTIMIZER_KERNEL_PREFIX`); everything else, XLA's fusions included, is ``"other"``.
    """
    low = name.lower()
    if _MEMCPY_NAME.search(low):
        return "memcpy"
    if _ATTENTION_NAME.search(low):
        return "attention"
    if _GEMM_NAME.search(low):
        return "gemm"
    if low.startswith(FP8_KERNEL_PREFIX):
        return "fp8_pallas"
    if low.startswith(OPTIMIZER_KERNEL_PREFIX):
        return "optimizer"
    return "other"


def kernel_category(name: str, hlo_op: str | None, hlo_categories: dict[str, str | None]) -> str:
    """The split category of one traced kernel.

    The HLO instruction it ran (its ``hlo_op`` stat, else its name read as an instruction name)
    decides first when that instruction is the optimizer's, since the optimizer may run any
    kernel; then the kernel's name (:func:`classify_kernel`); then what the HLO says of the
    instruction (:func:`hlo_kernel_categories`); else ``"other"``.
    """
    hlo = hlo_categories.get(hlo_op) if hlo_op else None
    hlo = hlo or hlo_categories.get(name)
    if hlo == "optimizer":
        return "optimizer"
    by_name = classify_kernel(name)
    if by_name != "other":
        return by_name
    return hlo or "other"


class KernelEvent(NamedTuple):
    name: str
    hlo_op: str | None
    start_ns: float
    duration_ns: float


def gpu_kernel_events(profile) -> tuple[list[KernelEvent], dict]:
    """The GPU kernels of a ``jax.profiler.ProfileData`` trace, and what was read.

    Kernels are the events of the planes named ``/device:GPU:N``, on their stream lines
    (``Stream #...``) or, where no line is named so, on every line but :data:`DERIVED_LINES`.
    The second result has ``planes`` (every plane's name) and ``lines`` (``{plane line: events}``
    of the lines counted) so that a record shows what its numbers come from.
    """
    events, planes, lines = [], [], {}
    for plane in profile.planes:
        planes.append(plane.name)
        if not plane.name.startswith(GPU_PLANE_PREFIX):
            continue
        all_lines = list(plane.lines)
        counted = [line for line in all_lines if line.name.startswith("Stream")] or [
            line for line in all_lines if line.name not in DERIVED_LINES
        ]
        for line in counted:
            line_events = list(line.events)
            lines[f"{plane.name} {line.name}"] = len(line_events)
            for e in line_events:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    stats = dict(e.stats)
                hlo_op = stats.get("hlo_op")
                events.append(
                    KernelEvent(e.name, str(hlo_op) if hlo_op else None, e.start_ns, e.duration_ns)
                )
    return events, {"planes": planes, "lines": lines}


def _busy_ns(events: list[KernelEvent]) -> float:
    """The time some kernel ran: the union of the kernels' intervals (streams overlap)."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted((e.start_ns, e.start_ns + e.duration_ns) for e in events):
        if start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy


def time_split(
    events: list[KernelEvent],
    reps: int,
    hlo_categories: dict[str, str | None],
    top: int = TOP_KERNELS,
) -> dict:
    """Per-step split of traced kernel time into :data:`SPLIT_CATEGORIES`.

    Args:
      events: the kernels of ``reps`` traced steps (:func:`gpu_kernel_events`).
      reps: how many steps the trace holds.
      hlo_categories: the program's :func:`hlo_kernel_categories`.
      top: how many kernel names to list, longest total time first.

    Returns:
      ``kernel_ms`` (summed kernel time per step), ``busy_ms`` (time some kernel ran per step),
      ``kernels_per_step``, ``categories`` (``{category: {"ms", "pct", "kernels"}}``, ms and
      kernels per step, pct of ``kernel_ms``; every category, summing to the totals),
      ``top`` (``[{"name", "category", "ms", "kernels", "hlo_ops"}]`` per step; ``hlo_ops``
      the instructions that launched it, longest first) and ``hlo_matched`` (the
      fraction of kernels whose HLO instruction was found, by ``hlo_op`` or by name).
    """
    if reps <= 0:
        raise ValueError(f"reps must be positive, got {reps}")
    if not events:
        raise ValueError("no kernel events to split: the trace holds no GPU kernels")
    ns, count = Counter(), Counter()
    by_name: dict[str, list] = {}
    matched = 0
    for e in events:
        category = kernel_category(e.name, e.hlo_op, hlo_categories)
        matched += bool((e.hlo_op and e.hlo_op in hlo_categories) or e.name in hlo_categories)
        ns[category] += e.duration_ns
        count[category] += 1
        entry = by_name.setdefault(e.name, [category, 0.0, 0, Counter()])
        entry[1] += e.duration_ns
        entry[2] += 1
        entry[3][e.hlo_op] += e.duration_ns
    total = sum(ns.values())
    per_step_ms = lambda n: n / reps / 1e6
    categories = {
        c: {
            "ms": per_step_ms(ns[c]),
            "pct": 100.0 * ns[c] / total if total else 0.0,
            "kernels": count[c] / reps,
        }
        for c in SPLIT_CATEGORIES
    }
    longest = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "kernel_ms": per_step_ms(total),
        "busy_ms": per_step_ms(_busy_ns(events)),
        "kernels_per_step": len(events) / reps,
        "categories": categories,
        "top": [
            {
                "name": n,
                "category": c,
                "ms": per_step_ms(t),
                "kernels": k / reps,
                # The HLO instructions that launched it, longest first (None: no hlo_op stat).
                "hlo_ops": [op for op, _ in ops.most_common(TOP_HLO_OPS)],
            }
            for n, (c, t, k, ops) in longest
        ],
        "hlo_matched": matched / len(events),
    }


def trace_kernels(call, reps: int) -> tuple[list[KernelEvent], dict, float]:
    """Runs ``call()`` ``reps`` times under ``jax.profiler.trace``: (kernels, what was read, s)."""
    import jax
    from jax.profiler import ProfileData

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python frames: host overhead, no device kernels
    with tempfile.TemporaryDirectory() as directory:
        t0 = time.perf_counter()
        with jax.profiler.trace(directory, profiler_options=options):
            for _ in range(reps):
                call()
        traced_s = time.perf_counter() - t0
        pattern = os.path.join(directory, "plugins", "profile", "**", "*.xplane.pb")
        paths = glob.glob(pattern, recursive=True)
        if len(paths) != 1:
            raise RuntimeError(f"expected one .xplane.pb under {directory}, found {paths}")
        events, info = gpu_kernel_events(ProfileData.from_file(paths[0]))
    return events, info, traced_s


def measure_split(
    call,
    reps: int,
    hlo: str,
    wall_s: float,
    program: str,
    label: str,
    batch: int,
    top: int = TOP_KERNELS,
) -> dict:
    """The time split of ``call`` (one step of ``program``), recorded and printed, with its
    ``top`` longest kernels."""
    split = {"program": program, "reps": reps, "wall_ms": wall_s * 1e3}
    try:
        events, info, traced_s = trace_kernels(call, reps)
    except Exception as e:  # noqa: BLE001 - the profiler's errors share no class
        split.update(traced=False, reason=f"the profiler failed: {type(e).__name__}: {e}")
        print(f"[{label}] batch {batch}: no time split, {split['reason']}", flush=True)
        return split
    split.update(info, traced_wall_ms=traced_s / reps * 1e3)
    if not events:
        split.update(
            traced=False,
            reason=f"no GPU kernels traced (no {GPU_PLANE_PREFIX}N plane among {info['planes']})",
        )
        print(f"[{label}] batch {batch}: no time split, {split['reason']}", flush=True)
        return split
    split.update(traced=True, **time_split(events, reps, hlo_kernel_categories(hlo), top))
    print(f"[{label}] batch {batch}: {program} {split_summary(split)}", flush=True)
    for t in split["top"]:
        print(
            f"    {t['ms']:8.3f} ms  {t['kernels']:5.1f}x  {t['category']:<10} {t['name']}",
            flush=True,
        )
    return split


def _cell(category: dict) -> str:
    return f"{category['ms']:.2f} ({category['pct']:.0f}%)"


def split_summary(split: dict) -> str:
    """One line: totals, then ms and % of each category."""
    if not split.get("traced"):
        return f"no time split: {split.get('reason', 'not traced')}"
    cats = split["categories"]
    parts = ", ".join(
        f"{label} {cats[c]['ms']:.2f} ms ({cats[c]['pct']:.0f}%)"
        for c, label in SPLIT_CATEGORIES.items()
    )
    gaps = split["wall_ms"] - split["busy_ms"]
    return (
        f"{split['kernels_per_step']:.1f} kernels traced per step, kernel time "
        f"{split['kernel_ms']:.2f} ms, busy {split['busy_ms']:.2f} ms of wall "
        f"{split['wall_ms']:.2f} ms (gaps {gaps:.2f} ms), HLO instruction found for "
        f"{split['hlo_matched']:.0%} of the kernels: {parts}"
    )


def layer_overrides(tiny: bool) -> dict:
    """The model section of configs/llama2_7b.yaml cut to one layer (or a small one, --tiny)."""
    if tiny:
        return {
            "vocab_size": 256,
            "hidden_size": 128,
            "intermediate_size": 352,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 32,
        }
    return {"num_hidden_layers": 1}


def layer_flops(config, batch: int, seq: int) -> float:
    d, f = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * config.head_dim
    weights = 2 * d * d + 2 * d * kv + 3 * d * f
    tokens = batch * seq
    return 6.0 * weights * tokens + 6.0 * d * seq * tokens


def _is_oom(e: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()


def worker(args) -> None:
    import jax
    import jax.numpy as jnp

    from coat_jax.memory import residuals
    from coat_jax.optim import apply_gradients
    from coat_jax.training import load_config
    from coat_jax.training.optimizers import kernel_options
    from coat_jax.training.program import build_program, compiler_options

    # The kernel categories read OPTIMIZER_SCOPE from each instruction's op_name, which JAX
    # writes with the name scope only when locations carry full tracebacks (its default).
    jax.config.update("jax_include_full_tracebacks_in_locations", True)
    mode, seq = args.worker, args.seq
    weight_residual = args.weight_residual if mode != "bf16" else "master"
    fp8_kernels = args.fp8_kernels if mode != "bf16" else "default"
    env = C.environment()
    # The trainer's own model with one decoder layer and the mode's optimizer: what train.py
    # runs, layer by layer.
    overrides = [
        f"precision.mode={mode}",
        f"optimizer.name={MODE_OPTIMIZERS[mode]}",
        f"memory.scan_layers={str(args.scan).lower()}",
        f"memory.remat={args.remat}",
        f"precision.fp8_weight_residual={weight_residual}",
        f"data.seq_len={seq}",
        "mesh.data=1",
        "mesh.fsdp=1",
        "xla.compilation_cache_dir=null",
        *(f"model.{k}={v}" for k, v in layer_overrides(args.tiny).items()),
        *([f"kernels.fp8_ops={fp8_kernels}"] if fp8_kernels != "default" else []),
        *args.set_all,
        *(args.set if mode != "bf16" else []),
    ]
    cfg = load_config(os.path.join(ROOT, "configs", "llama2_7b.yaml"), overrides)
    config = cfg.model
    program = build_program(cfg, config)
    model_def = program.model_def
    tx = program.tx
    keys = {"mode": mode, "weight_residual": weight_residual, "fp8_kernels": fp8_kernels}
    if args.set_all:
        keys["set_all"] = list(args.set_all)
    if args.set and mode != "bf16":
        keys["set"] = list(args.set)
    # What the option resolved to: "default" follows the trainer's default, which has changed.
    keys["fp8_ops_implementation"] = (
        kernel_options(cfg, fp8_ops=True)["implementation"] if mode != "bf16" else None
    )
    label = variant_of(keys)

    def apply(params, x_BTD, weight_residual=None):
        b, t = x_BTD.shape[:2]
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        model = model_def.bind(params)
        if weight_residual is not None:  # the same layer with another FP8Config option
            model.fp8_config = dataclasses.replace(
                model.fp8_config, weight_residual=weight_residual
            )
        return model.decoder(x_BTD, positions)

    # The trainer's compiler options (Triton GEMMs off on a GPU, and what the config sets).
    options = compiler_options(cfg)

    @functools.partial(jax.jit, compiler_options=options)
    def fwd_bwd(params, x_BTD, dy_BTD):
        _, pullback = jax.vjp(apply, params, x_BTD)
        return pullback(dy_BTD)

    @functools.partial(jax.jit, donate_argnums=(1, 2), compiler_options=options)
    def layer_step(rest, layer, opt_state, x_BTD, dy_BTD):
        # Gradients of the layer's weights only (the embedding and the head take no part), then
        # the step train.py's make_train_step takes on them.
        _, pullback = jax.vjp(lambda w, x: apply({**rest, "layers": w}, x), layer, x_BTD)
        grads, dx_BTD = pullback(dy_BTD)
        with jax.named_scope(OPTIMIZER_SCOPE):
            layer, opt_state = apply_gradients(tx, grads, opt_state, layer)
        return layer, opt_state, dx_BTD

    def inputs(batch):
        """``x`` and ``dy`` of a batch, the same in both programs."""
        shape = (batch, seq, config.hidden_size)
        kx, kdy = jax.random.split(jax.random.key(batch))
        return jax.random.normal(kx, shape, jnp.bfloat16), jax.random.normal(
            kdy, shape, jnp.bfloat16
        )

    params = program.init_params(jax.random.key(0))
    abstract_params = program.model_def.abstract_params
    done = []
    for batch in sorted(args.batches):
        shape = (batch, seq, config.hidden_size)
        u = batch * seq * config.hidden_size * 2
        xs = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
        # Activations are those of the "master" variant: both options keep the same ones
        # (tests/model/test_scan_remat.py), and through a scan every residual counts as dependent on
        # the input, weight codes included. The FP8 weight codes "fp8" keeps are the FP8
        # residual bytes it holds beyond master's (master keeps float32 weight references).
        res_master = residuals(
            functools.partial(apply, weight_residual="master"),
            abstract_params,
            xs,
            param_argnums=(0,),
        )
        by_dtype: dict[str, int] = {}
        for r in res_master:
            if r.is_activation:
                by_dtype[r.dtype.name] = by_dtype.get(r.dtype.name, 0) + r.nbytes
        act = sum(by_dtype.values())
        weight_codes = 0
        if weight_residual != "master":
            res = residuals(apply, abstract_params, xs, param_argnums=(0,))
            fp8_bytes = lambda rs: sum(r.nbytes for r in rs if r.dtype.itemsize == 1)
            weight_codes = fp8_bytes(res) - fp8_bytes(res_master)
        t0 = time.perf_counter()
        compiled = fwd_bwd.lower(abstract_params, xs, xs).compile()
        compile_s = time.perf_counter() - t0
        mem = C.compiled_memory(compiled)
        hlo = compiled.as_text() or ""
        calls = C.custom_call_counts(hlo)
        kernels = kernel_counts(hlo)
        x, dy = inputs(batch)
        call = lambda c=compiled, x=x, dy=dy: jax.block_until_ready(c(params, x, dy))
        try:
            timing = C.time_fn(call, warmup=args.warmup, reps=args.reps)
        except Exception as e:  # noqa: BLE001 - XlaRuntimeError's class moves between versions
            if not _is_oom(e):
                raise
            C.append_jsonl(args.jsonl, {"kind": "oom", **keys, "batch": batch, **env})
            print(f"[{label}] batch {batch}: out of memory")
            break
        stats = C.memory_stats()
        rec = {
            "kind": "layer",
            **keys,
            "remat": args.remat,
            "scan": args.scan,
            "batch": batch,
            "seq": seq,
            **env,
            "time": timing,
            "tflops": layer_flops(config, batch, seq) / timing["median_s"] / 1e12,
            "activation_bytes": act,
            "activation_U": act / u,
            "activation_U_by_dtype": {k: v / u for k, v in by_dtype.items()},
            "weight_code_bytes": weight_codes,
            "compiled_memory": mem,
            "compile_s": round(compile_s, 1),
            "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
            "fp8_gemms": calls.get(C.FP8_GEMM_TARGET, 0),
            "hlo_calls": calls,
            "hlo_ops": C.hlo_op_counts(hlo),
            "kernels": kernels,
        }
        print(
            f"[{label}] batch {batch}: "
            f"{timing['median_s'] * 1e3:.2f} ms per fwd+bwd, "
            f"{rec['tflops']:.0f} TFLOP/s, act {rec['activation_U']:.2f}U, "
            f"FP8 weight codes kept {_mib(weight_codes)} MiB, "
            f"compiled peak {C.gib(mem.get('peak'))} GiB, "
            f"peak_bytes_in_use {C.gib(stats.get('peak_bytes_in_use'))} GiB, "
            f"FP8 GEMMs {rec['fp8_gemms']}, kernels {kernels['total']} "
            f"(fp8 transposes {kernels['fp8_transposes']}) {kernels['by_opcode']}, "
            f"custom calls {calls}",
            flush=True,
        )
        _dump_hlo(args, hlo, label, "fwd_bwd", batch)
        if not args.optimizer and args.profile_reps:
            # After the allocator's peak was read: the profiler's buffers do not count in it.
            rec["split"] = measure_split(
                call,
                args.profile_reps,
                hlo,
                timing["median_s"],
                "fwd_bwd",
                label,
                batch,
                top=args.top_kernels,
            )
        C.append_jsonl(args.jsonl, rec)
        done.append(batch)
    if not args.optimizer:
        return
    # The layer steps run after every batch's fwd_bwd: their optimizer state and weight copies
    # would otherwise raise the peak_bytes_in_use read for the next batch.
    rest = {k: v for k, v in params.items() if k != "layers"}
    abstract_rest = {k: v for k, v in abstract_params.items() if k != "layers"}
    abstract_layer = abstract_params["layers"]
    abstract_opt = jax.eval_shape(tx.init, abstract_layer)
    for batch in done:
        x, dy = inputs(batch)
        xs = jax.ShapeDtypeStruct(x.shape, x.dtype)
        t0 = time.perf_counter()
        compiled = layer_step.lower(abstract_rest, abstract_layer, abstract_opt, xs, xs).compile()
        compile_s = time.perf_counter() - t0
        hlo = compiled.as_text() or ""
        kernels = kernel_counts(hlo)
        layer = jax.tree.map(jnp.copy, params["layers"])  # donated, step after step
        state = [layer, jax.jit(tx.init)(layer)]

        def call(c=compiled, x=x, dy=dy, state=state):
            state[0], state[1], dx = c(rest, state[0], state[1], x, dy)
            jax.block_until_ready((state[0], state[1], dx))

        try:
            timing = C.time_fn(call, warmup=args.warmup, reps=args.reps)
        except Exception as e:  # noqa: BLE001 - XlaRuntimeError's class moves between versions
            if not _is_oom(e):
                raise
            C.append_jsonl(
                args.jsonl,
                {"kind": "oom", "program": "layer_step", **keys, "batch": batch, **env},
            )
            print(f"[{label}] batch {batch}: layer step out of memory")
            break
        rec = {
            "kind": "layer_step",
            **keys,
            "optimizer": MODE_OPTIMIZERS[mode],
            "grad_clip": cfg.grad_clip,
            "batch": batch,
            "seq": seq,
            **env,
            "time": timing,
            "compiled_memory": C.compiled_memory(compiled),
            "compile_s": round(compile_s, 1),
            "kernels": kernels,
            "hlo_categories": hlo_category_counts(hlo),
        }
        print(
            f"[{label}] batch {batch}: {timing['median_s'] * 1e3:.2f} ms per layer step "
            f"({rec['optimizer']}), kernels {kernels['total']} {kernels['by_opcode']}, "
            f"kernels by HLO category {rec['hlo_categories']}",
            flush=True,
        )
        _dump_hlo(args, hlo, label, "layer_step", batch)
        if args.profile_reps:
            rec["split"] = measure_split(
                call,
                args.profile_reps,
                hlo,
                timing["median_s"],
                "layer_step",
                label,
                batch,
                top=args.top_kernels,
            )
        C.append_jsonl(args.jsonl, rec)
        del state, layer, call  # before the next batch's copies are made


def _dump_hlo(args, hlo: str, label: str, program: str, batch: int) -> None:
    """Writes a compiled program's optimized HLO under ``--hlo-dir`` (when given), to read
    what each traced kernel (its ``hlo_op``) computes."""
    if not args.hlo_dir:
        return
    os.makedirs(args.hlo_dir, exist_ok=True)
    name = f"{label.replace('/', '_')}_{program}_b{batch}.hlo.txt"
    with open(os.path.join(args.hlo_dir, name), "w") as f:
        f.write(hlo)


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f}"


def variant_of(r: dict) -> str:
    """A record's mode with its weight residual and where its FP8 ops ran (``coat/once/xla``,
    ``coat/once/pallas``; bf16 has neither). Records from before the runs named the resolved
    implementation show the ``fp8_kernels`` option where one was set (``coat/once`` then ran the
    Pallas kernels, the trainer's default of that time)."""
    if r["mode"] == "bf16":
        return "bf16"
    wr = r.get("weight_residual", "master")
    kernels = r.get("fp8_ops_implementation") or r.get("fp8_kernels", "default")
    extra = "".join(f"+{kv}" for kv in r.get("set", []))
    return f"{r['mode']}/{wr}" + ("" if kernels == "default" else f"/{kernels}") + extra


def _find(records: list[dict], kind: str, batch: int, variant: str) -> dict | None:
    return next(
        (
            r
            for r in records
            if r["kind"] == kind and r["batch"] == batch and variant_of(r) == variant
        ),
        None,
    )


def _split_rows(records: list[dict]) -> list[tuple[int, str, dict]]:
    """``(batch, variant, split)`` of each measured time split, layer steps first."""
    out, seen = [], set()
    for kind in ("layer_step", "layer"):
        for r in records:
            if r["kind"] == kind and "split" in r and (r["batch"], variant_of(r)) not in seen:
                seen.add((r["batch"], variant_of(r)))
                out.append((r["batch"], variant_of(r), r["split"]))
    variant_order = lambda v: (MODES.index(v.split("/")[0]), v)
    return sorted(out, key=lambda row: (row[0], variant_order(row[1])))


def split_table(records: list[dict]) -> list[str]:
    """The markdown lines of the time-split table and each row's top kernels."""
    rows = _split_rows(records)
    if not rows:
        return []
    header = " | ".join(SPLIT_CATEGORIES.values())
    lines = [
        "",
        "Time split (ms per step, % of the summed kernel time; `jax.profiler` trace of the "
        "program after its timed calls; wall = the untraced median, busy = time some kernel "
        "ran, gaps = wall - busy):",
        "",
        "| batch | mode | program | wall (ms) | kernels traced | kernel time (ms) | busy (ms) "
        f"| gaps (ms) | {header} |",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(SPLIT_CATEGORIES),
    ]
    for batch, variant, s in rows:
        if not s.get("traced"):
            reason = s.get("reason", "not traced")
            lines.append(
                f"| {batch} | {variant} | {s['program']} | {s['wall_ms']:.2f} | {reason} |"
            )
            continue
        cells = " | ".join(_cell(s["categories"][c]) for c in SPLIT_CATEGORIES)
        lines.append(
            f"| {batch} | {variant} | {s['program']} | {s['wall_ms']:.2f} | "
            f"{s['kernels_per_step']:.1f} | {s['kernel_ms']:.2f} | {s['busy_ms']:.2f} | "
            f"{s['wall_ms'] - s['busy_ms']:.2f} | {cells} |"
        )
    traced = [(b, v, s) for b, v, s in rows if s.get("traced")]
    if traced:
        lines += ["", f"Top {TOP_KERNELS} kernels by time (ms per step, launches per step):"]
        for batch, variant, s in traced:
            lines += ["", f"- batch {batch}, {variant} ({s['program']}):"]
            lines += [
                f"  - {t['ms']:.3f} ms, {t['kernels']:.1f}x, {t['category']}: `{t['name']}`"
                for t in s["top"]
            ]
    return lines


def write_docs(path: str | None, records: list[dict], command: str) -> str:
    rows = [r for r in records if r["kind"] == "layer"]
    lines = ["# One Llama-2-7B decoder layer: forward + backward and the layer step", ""]
    if rows:
        r0 = rows[0]
        steps = [r for r in records if r["kind"] == "layer_step"]
        clip = steps[0].get("grad_clip") if steps else None
        lines += [
            f"By `{command}`; each row's device, JAX version and date are in its last columns.",
            f"Layer: `Llama.decoder` of train.py's model with one layer (`build_program`), "
            f"remat `{r0.get('remat', 'none')}`, seq {r0['seq']}, float32 master weights, "
            "bfloat16 activations; each mode in its own process. Time: median of the jitted "
            "`jax.vjp` forward + backward (weights and input gradients). Layer step: the same "
            "forward and backward into the layer's weights and the input, then the mode's "
            "optimizer on the layer's weights through `coat_jax.apply_gradients`, as train.py "
            f"applies it (bf16 and fp8: `adamw`; coat: `coat_adamw`, its fused apply; clipping "
            f"at {clip} by the layer's gradient norm). U = batch x seq x "
            "hidden x 2 bytes; activations are the `jax.vjp` residuals that depend on the "
            "input (on the GPU attention is cuDNN's, which also keeps its output and "
            "log-sum-exp). Mode `coat/fp8` is `coat` with `precision.fp8_weight_residual=fp8` (forward's "
            "FP8 weight codes kept for backward, their bytes in `weight codes kept`), "
            "`coat/master` re-quantizes the float32 weights in backward, `coat/once` "
            "quantizes each weight once per step (the trainer's default); a third part says "
            "where the FP8 activation ops ran (`xla`: XLA's fusions of their jnp references, "
            "the trainer's default; `pallas`: the Pallas kernels; `auto`: Pallas where one "
            "runs). Kernels: launches of one step, counted in the "
            "compiled HLO (`kernel_counts`); memory columns are fwd+bwd's.",
            "",
        ]
    lines += [
        "| batch | mode | time (ms) | TFLOP/s | speed vs bf16 | layer step (ms) | step vs bf16 "
        "| activations (U) | paper U | act. vs bf16 | weight codes kept (MiB) "
        "| compiled peak (GiB) | peak_bytes_in_use (GiB) | FP8 GEMMs | kernels | step kernels "
        "| fp8 transposes | device | JAX | date |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    variants = sorted(
        {variant_of(r) for r in rows}, key=lambda v: (MODES.index(v.split("/")[0]), v)
    )
    for batch in sorted({r["batch"] for r in rows}):
        b = _find(records, "layer", batch, "bf16")
        b_step = _find(records, "layer_step", batch, "bf16")
        for variant in variants:
            r = _find(records, "layer", batch, variant)
            if r is None:
                lines.append(f"| {batch} | {variant} | not measured |" + " |" * 17)
                continue
            step = _find(records, "layer_step", batch, variant)
            speed = C.ratio(b["time"]["median_s"], r["time"]["median_s"]) if b else "n/a"
            step_ms = f"{step['time']['median_s'] * 1e3:.2f}" if step else "n/a"
            step_speed = (
                C.ratio(b_step["time"]["median_s"], step["time"]["median_s"])
                if step and b_step
                else "n/a"
            )
            act_ratio = C.ratio(b["activation_bytes"], r["activation_bytes"]) if b else "n/a"
            kernels = r.get("kernels", {})
            step_kernels = step["kernels"]["total"] if step else "n/a"
            lines.append(
                f"| {batch} | {variant} | {r['time']['median_s'] * 1e3:.2f} | {r['tflops']:.0f} | "
                f"{speed} | {step_ms} | {step_speed} | {r['activation_U']:.2f} | "
                f"{PAPER_U[r['mode']]} | {act_ratio} | {_mib(r.get('weight_code_bytes'))} | "
                f"{C.gib(r['compiled_memory'].get('peak'))} | {C.gib(r['peak_bytes_in_use'])} | "
                f"{r['fp8_gemms']} | {kernels.get('total', 'n/a')} | {step_kernels} | "
                f"{kernels.get('fp8_transposes', 'n/a')} | {r['device']} | {r['jax']} | "
                f"{r['date'][:10]} |"
            )
    ooms = [r for r in records if r["kind"] == "oom"]
    if ooms:
        lines += [""] + [
            f"- {variant_of(r)} batch {r['batch']}: {r.get('program', 'fwd_bwd')} out of memory"
            for r in ooms
        ]
    lines += split_table(records)
    if rows:
        first = min(r["batch"] for r in rows)
        lines += ["", "Custom calls in the compiled step (first batch):", ""]
        for r in rows:
            if r["batch"] == first:
                lines.append(f"- {variant_of(r)}: {r['hlo_calls']}")
        lines += ["", "Kernels by opcode (first batch; fwd+bwd, then the layer step):", ""]
        for r in rows:
            if r["batch"] == first and "kernels" in r:
                step = _find(records, "layer_step", first, variant_of(r))
                by_step = f"; layer step {step['kernels']['by_opcode']}" if step else ""
                lines.append(f"- {variant_of(r)}: {r['kernels']['by_opcode']}{by_step}")
        lines += ["", "Activations by dtype (U, first batch):", ""]
        for r in rows:
            if r["batch"] == first:
                parts = ", ".join(f"{k} {v:.3f}" for k, v in r["activation_U_by_dtype"].items())
                lines.append(f"- {variant_of(r)}: {parts}")
    text = "\n".join(lines) + "\n"
    if path:
        with open(path, "w") as f:
            f.write(text)
    return text


def report(args, jsonl: str) -> None:
    """Rewrites the docs from a finished (or cut short) run's records."""
    records = C.read_jsonl(jsonl)
    if not records:
        raise ValueError(f"no records in {jsonl}")
    cmds = [r["command"] for r in records if r["kind"] == "command"]
    print(write_docs(args.docs, records, cmds[-1] if cmds else "unknown"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--batches", default=None, help="comma-separated (4,8; 2 with --tiny)")
    p.add_argument("--seq", type=int, default=None, help="2048 (64 with --tiny)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="a small layer on the CPU: a smoke test")
    p.add_argument("--remat", default="none", help="remat policy of the layer (REMAT_POLICIES)")
    p.add_argument("--scan", action="store_true", help="the scanned layer layout")
    p.add_argument(
        "--weight-residual",
        default="master",
        help="comma-separated FP8Config.weight_residual options for the fp8 and coat modes "
        "(master: backward re-quantizes the weights; fp8: keeps forward's FP8 codes)",
    )
    p.add_argument(
        "--fp8-kernels",
        default="default",
        help="comma-separated fp8_kernels options for the fp8 and coat modes (default: unset, "
        "the trainer's default, by shape with kernels=auto: optimizers.fp8_ops_auto; xla: XLA's "
        "fusions of the jnp references; pallas: the Pallas kernels; auto: Pallas where one runs)",
    )
    p.add_argument(
        "--optimizer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the layer step: fwd+bwd, then the mode's optimizer on the layer's "
        "weights (adamw; coat_adamw for coat), as train.py applies it",
    )
    p.add_argument(
        "--profile-reps",
        type=int,
        default=5,
        help="steps traced by jax.profiler for the time split of the layer step (of fwd+bwd "
        "with --no-optimizer); 0: no split",
    )
    p.add_argument(
        "--top-kernels",
        type=int,
        default=TOP_KERNELS,
        help="how many kernels the time split lists, longest total time first",
    )
    p.add_argument(
        "--hlo-dir",
        default=None,
        help="write each compiled program's optimized HLO text here (one file per variant, "
        "program and batch)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a trainer config override for the fp8 and coat modes (repeatable; their variant "
        "names show it), e.g. --set precision.fp8_swiglu=fused",
    )
    p.add_argument(
        "--set-all",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a trainer config override for every mode, bf16 included (repeatable; kept in the "
        "records as set_all), e.g. --set-all xla.excess_precision=false",
    )
    p.add_argument("--child-timeout-s", type=float, default=240.0)
    p.add_argument("--out-dir", default="runs/bench_layer")
    p.add_argument("--docs", default=None)
    p.add_argument("--no-child-logs", action="store_true", help="no per-mode log files")
    p.add_argument(
        "--report-only", action="store_true", help="only rewrite --docs/--plot from out-dir"
    )
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--jsonl", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.seq is None:
        args.seq = 64 if args.tiny else 2048
    if args.batches is None:
        args.batches = "2" if args.tiny else "4,8"
    try:
        args.batches = [int(b) for b in str(args.batches).split(",")]
    except ValueError:
        raise ValueError(f"--batches must be comma-separated ints, got {args.batches!r}") from None
    if any(b <= 0 for b in args.batches):
        raise ValueError(f"--batches must be positive, got {args.batches}")
    if args.top_kernels < 1:
        raise ValueError(f"--top-kernels must be >= 1, got {args.top_kernels}")
    if args.profile_reps < 0:
        raise ValueError(f"--profile-reps must be >= 0 (0: no time split), got {args.profile_reps}")
    weight_residuals = [w.strip() for w in args.weight_residual.split(",") if w.strip()]
    if not weight_residuals or any(w not in WEIGHT_RESIDUALS for w in weight_residuals):
        raise ValueError(
            f"--weight-residual must be a comma-separated list of {list(WEIGHT_RESIDUALS)}, "
            f"got {args.weight_residual!r}"
        )
    fp8_kernels = [k.strip() for k in args.fp8_kernels.split(",") if k.strip()]
    if not fp8_kernels or any(k not in FP8_KERNELS for k in fp8_kernels):
        raise ValueError(
            f"--fp8-kernels must be a comma-separated list of {list(FP8_KERNELS)}, "
            f"got {args.fp8_kernels!r}"
        )
    if args.worker:
        if len(weight_residuals) != 1 or len(fp8_kernels) != 1:
            raise ValueError("a worker runs one --weight-residual and one --fp8-kernels option")
        args.weight_residual = weight_residuals[0]
        args.fp8_kernels = fp8_kernels[0]
        worker(args)
        return
    modes = C.parse_modes(args.modes, MODES)
    os.makedirs(args.out_dir, exist_ok=True)
    jsonl = os.path.join(args.out_dir, "layer.jsonl")
    if args.report_only:
        return report(args, jsonl)
    command = C.command_line()
    C.append_jsonl(jsonl, {"kind": "command", "command": command})
    text = ""
    variants = [
        (mode, wr, k)
        for mode in modes
        for wr in (weight_residuals if mode != "bf16" else ["master"])
        for k in (fp8_kernels if mode != "bf16" else ["default"])
    ]
    for mode, weight_residual, kernels in variants:
        child = (
            [
                os.path.abspath(__file__),
                f"--worker={mode}",
                f"--batches={','.join(map(str, args.batches))}",
                f"--seq={args.seq}",
                f"--reps={args.reps}",
                f"--warmup={args.warmup}",
                f"--jsonl={jsonl}",
                f"--remat={args.remat}",
                f"--weight-residual={weight_residual}",
                f"--fp8-kernels={kernels}",
                f"--profile-reps={args.profile_reps}",
                f"--top-kernels={args.top_kernels}",
                *([f"--hlo-dir={args.hlo_dir}"] if args.hlo_dir else []),
                "--optimizer" if args.optimizer else "--no-optimizer",
                *(f"--set={kv}" for kv in args.set),
                *(f"--set-all={kv}" for kv in args.set_all),
            ]
            + (["--tiny"] if args.tiny else [])
            + (["--scan"] if args.scan else [])
        )
        name = variant_of(
            {"mode": mode, "weight_residual": weight_residual, "fp8_kernels": kernels}
        ).replace("/", "_")  # the option asked for; the records name what it resolved to
        rc = C.run_child(
            child,
            timeout_s=args.child_timeout_s,
            log_path=None
            if args.no_child_logs
            else os.path.join(args.out_dir, f"layer_{name}.log"),
        )
        if rc:
            print(f"[parent] {name} exited with {rc}; continuing with what it recorded")
        text = write_docs(args.docs, C.read_jsonl(jsonl), command)
    print(text)


if __name__ == "__main__":
    main()

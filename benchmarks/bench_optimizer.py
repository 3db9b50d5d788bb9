"""Optimizer step on Llama-2-7B's parameter shapes: optax.adamw against coat_adamw.

One process, side by side on one device: ``optax.adamw`` (float32 moments),
``optax.adamw(mu_dtype=bfloat16)``, ``coat_adamw`` on the jnp path (``implementation="xla"``),
``coat_adamw`` on the Pallas path (the optax chain: the kernel writes the update, XLA applies it)
and the fused Pallas apply (``pallas_kernels.coat_adam.coat_adamw_apply``: one pass writes the new
parameter). Each is the full jitted step ``(params, state, grads) -> (params, state)`` with
params and state donated; params are float32 masters, gradients ``--grad-dtype`` (bf16 default).

Per step it reports the median time (warm-up, then ``--reps`` timings of ``--steps`` back-to-back
steps, device-synchronised), the bytes the step must move by our count, the achieved bandwidth
against a device-to-device copy measured in the same run, and the optimizer state's memory (the
real state leaves' nbytes, and XLA's compiled.memory_analysis()).

    python benchmarks/bench_optimizer.py                       # all 32 layers (6.74B parameters)
    python benchmarks/bench_optimizer.py --layers 2 --reps 3   # a quick look
    python benchmarks/bench_optimizer.py --layers 16           # an 80 GB card (H100)
    python benchmarks/bench_optimizer.py --json OUT.json      # the record (render.py reads it)
    python benchmarks/bench_optimizer.py --kernel-mesh --only "coat_adamw pallas"   # sharded

``--kernel-mesh`` adds ``coat_adamw(..., mesh=...)`` on a ``(data=1, fsdp=1)`` mesh: the kernel
inside ``shard_map`` on one device, to compare with today's unsharded path (the difference is
the cost of the wrapper, which should be none).

On an 80 GB card ``optax.adamw``'s float32 state for all 32 layers does not fit; each optimizer
is checked against the device's free memory before anything is allocated and reported as
FAILED, naming the fix, instead of minutes of allocator retries.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

import coat_jax  # noqa: E402
from coat_jax import quant  # noqa: E402
from coat_jax.training import sharding  # noqa: E402
from pallas_kernels import coat_adam as ca  # noqa: E402

LR, B1, B2, EPS, WD = 1e-4, 0.9, 0.999, 1e-8, 0.1
# --interpret runs the Pallas paths in interpret mode: a CPU smoke test of this script only.
INTERPRET = False


def llama2_7b_shapes(
    layers: int, hidden=4096, intermediate=11008, vocab=32000, *, stacked: bool = False
):
    """Llama-2-7B's parameter shapes, Flax layout (kernels are [in, out]).

    ``stacked``: one array per projection with a leading layer axis, the layout of
    ``train.py`` with ``scan_layers: true`` (the 7B config's); else one array per layer.
    """
    shapes = {"embed": (vocab, hidden), "final_norm": (hidden,), "lm_head": (hidden, vocab)}
    layer = {name: (hidden, hidden) for name in ("q", "k", "v", "o")}
    layer |= {"gate": (hidden, intermediate), "up": (hidden, intermediate)}
    layer |= {"down": (intermediate, hidden), "attn_norm": (hidden,), "mlp_norm": (hidden,)}
    if stacked:
        shapes["layers"] = {name: (layers, *shape) for name, shape in layer.items()}
        return shapes
    for i in range(layers):
        shapes[f"layer_{i:02d}"] = dict(layer)
    return shapes


def parse_setting(text: str) -> ca.KernelConfig:
    """A kernel launch setting from
    ``rows/warps[/sN][/tN][/flat][/exact]``, e.g. ``16/4/t4/s2``.

    Example:
      >>> parse_setting("32/8/t2/flat/exact")
      KernelConfig(block_rows=32, num_warps=8, num_stages=1, fast_math=False, flat_stats=True, tiles=2)
    """
    rows, warps, *rest = text.split("/")
    kw = dict(block_rows=int(rows), num_warps=int(warps))
    for part in rest:
        if part == "flat":
            kw["flat_stats"] = True
        elif part == "exact":
            kw["fast_math"] = False
        elif part[:1] in ("s", "t") and part[1:].isdigit():
            kw["num_stages" if part[0] == "s" else "tiles"] = int(part[1:])
        else:
            raise ValueError(f"unknown part {part!r} of kernel setting {text!r}")
    return ca.KernelConfig(**kw)


def is_shape(x):
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def make_tree(shapes, dtype, seed, scale):
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=is_shape)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    gen = jax.jit(lambda k, s: scale * jax.random.normal(k, s, dtype), static_argnums=1)
    return treedef.unflatten([gen(k, s) for k, s in zip(keys, leaves, strict=True)])


def sync(tree):
    for x in jax.tree.leaves(tree):
        x.block_until_ready()


def copy_bandwidth(nbytes: int, reps: int) -> dict:
    """Device-to-device copy and a read+write elementwise pass, bytes read plus written / s."""
    x = jax.random.normal(jax.random.key(0), (nbytes // 4,), jnp.float32)
    results = {}
    for name, fn in (("copy", jax.jit(lambda x: jnp.copy(x))), ("x*2", jax.jit(lambda x: x * 2))):
        y = fn(x)
        sync(y)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            y = fn(x)
            y.block_until_ready()
            times.append(time.perf_counter() - t0)
        del y
        results[name] = 2 * x.nbytes / statistics.median(times)
    return results


def reference_bandwidth(copy_bw: dict) -> float:
    """The copy figure, unless XLA elided the copy (then the elementwise pass)."""
    if copy_bw["copy"] > 1.5 * copy_bw["x*2"]:
        return copy_bw["x*2"]
    return max(copy_bw.values())


def fused_coat_adamw(config: ca.KernelConfig | None):
    """The fused kernel at launch settings ``config`` (the ``--sweep`` variants only).

    What ships is ``coat_jax.apply_gradients`` on ``coat_adamw`` (:func:`applied_step`), which
    runs the kernel at its default settings; this calls ``coat_adamw_apply`` per parameter to
    time other settings on the same state.
    """
    tx = coat_jax.coat_adamw(LR, B1, B2, EPS, WD, implementation="pallas", interpret=INTERPRET)
    spec = ca.MomentSpec()

    def unmask(x):
        return None if isinstance(x, optax.MaskedNode) else x

    def mask(x):
        return optax.MaskedNode() if x is None else x

    def step(params, state, grads):
        cs = state[0]
        count = optax.safe_increment(cs.count)
        leaves, treedef = jax.tree.flatten(params)
        fields = cs._fields[1:]
        per_field = [treedef.flatten_up_to(getattr(cs, f)) for f in fields]
        new_p, new_fields = [], [[] for _ in fields]
        for i, (p, g) in enumerate(zip(leaves, treedef.flatten_up_to(grads), strict=True)):
            parts = [unmask(f[i]) for f in per_field]
            layout = dict(granularity="group", group_size=spec.group_size)
            mu = quant.QuantizedTensor(*parts[:4], fmt=spec.mu_format, **layout)
            nu = quant.QuantizedTensor(*parts[4:], fmt=spec.nu_format, **layout)
            p, mu, nu = ca.coat_adamw_apply(
                p,
                g,
                mu,
                nu,
                count=count,
                b1=B1,
                b2=B2,
                eps=EPS,
                expand_min=16,
                learning_rate=LR,
                weight_decay=WD,
                spec=spec,
                implementation="pallas",
                interpret=INTERPRET,
                config=config,
            )
            new_p.append(p)
            stored = [(m.codes, m.scale, m.expand, m.center) for m in (mu, nu)]
            for j, x in enumerate((*stored[0], *stored[1])):
                new_fields[j].append(mask(x))
        new_cs = type(cs)(count, *(treedef.unflatten(f) for f in new_fields))
        return treedef.unflatten(new_p), (new_cs, *state[1:])

    return tx.init, step


def chain_step(tx):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return tx.init, step


def applied_step(tx):
    """The step ``train.py`` runs: ``coat_jax.apply_gradients`` (the fused apply of coat_adamw)."""

    def step(params, state, grads):
        return coat_jax.apply_gradients(tx, grads, state, params)

    return tx.init, step


def check_fits(name, init, shapes, stats):
    """Raise ``MemoryError``, with the fix, when the float32 parameters and ``init``'s state
    cannot fit in the memory the device has free; ``stats`` is its ``memory_stats()``.

    Counts the exact shapes (``jax.eval_shape``; nothing is allocated) against the allocator's
    limit less what is in use (the gradients among it). Without the check an 80 GB card spends
    minutes in allocator retries before ``optax.adamw``'s float32 state for the 32-layer tree
    fails. The step's own temporaries come on top, so passing it does not promise the step fits.
    Devices that report no limit (the CPU) are not checked.
    """
    if not stats or "bytes_limit" not in stats:
        return
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shapes, is_leaf=is_shape)
    need = quant.state_bytes((params, jax.eval_shape(init, params)))
    if need > free:
        raise MemoryError(
            f"{name}: its float32 parameters and optimizer state take {need / 2**30:.2f} GiB, "
            f"more than the {free / 2**30:.2f} GiB free on the device; run fewer layers "
            "(--layers, e.g. --layers 16 on an 80 GB card) or --only the other optimizers"
        )


def run_optimizer(name, init, step, shapes, grads, args, *, update_bytes_per_step=0):
    check_fits(name, init, shapes, jax.devices()[0].memory_stats())
    params = make_tree(shapes, jnp.float32, seed=1, scale=0.02)
    state = init(params)
    sync(state)
    jitted = jax.jit(step, donate_argnums=(0, 1))
    t0 = time.perf_counter()
    compiled = jitted.lower(params, state, grads).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    state_bytes = quant.state_bytes(state)
    param_bytes = quant.state_bytes(params)
    grad_bytes = quant.state_bytes(grads)
    for _ in range(args.warmup):
        params, state = compiled(params, state, grads)
    sync((params, state))
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        for _ in range(args.steps):
            params, state = compiled(params, state, grads)
        sync((params, state))
        times.append((time.perf_counter() - t0) / args.steps)
    finite = bool(all(jnp.all(jnp.isfinite(p)) for p in jax.tree.leaves(params)))
    del params, state, compiled
    # Read p, g, the state; write p and the state; the chain also writes and re-reads the update.
    moved = 2 * param_bytes + grad_bytes + 2 * state_bytes + update_bytes_per_step
    return {
        "name": name,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "compile_s": compile_s,
        "bytes_moved": moved,
        "state_bytes": state_bytes,
        "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
        "argument_bytes": getattr(mem, "argument_size_in_bytes", None),
        "alias_bytes": getattr(mem, "alias_size_in_bytes", None),
        "params_finite": finite,
    }


def sweep(args, grads_dtype):
    """Kernel launch settings on one decoder layer's shapes, fused apply."""
    shapes = {"layer": llama2_7b_shapes(1)["layer_00"]}
    grads = make_tree(shapes, grads_dtype, seed=2, scale=1e-3)
    rows = []
    if args.sweep_settings:
        settings = [parse_setting(t) for t in args.sweep_settings.split(",") if t]
    else:
        settings = ["16/4", "32/4", "32/8", "16/4/exact"][: args.sweep]
        settings = [parse_setting(t) for t in settings]
    for cfg in settings:
        init, step = fused_coat_adamw(cfg)
        try:
            r = run_optimizer(str(cfg), init, step, shapes, grads, args)
        except Exception as e:  # report and carry on: one bad setting must not end the run
            print(f"sweep {cfg}: FAILED {type(e).__name__}: {e}"[:400], flush=True)
            continue
        r["config"] = dataclasses.asdict(cfg)
        print(
            f"sweep {cfg}: {r['median_s'] * 1e3:8.3f} ms  "
            f"{r['bytes_moved'] / r['median_s'] / 1e12:6.2f} TB/s",
            flush=True,
        )
        rows.append(r)
    return rows


def setting_text(config: dict) -> str:
    """A launch setting in :func:`parse_setting`'s syntax, from a record's ``config``; the
    ``folded`` and ``prefetch`` forms of records of earlier kernels keep their names."""
    parts = [str(config["block_rows"]), str(config["num_warps"])]
    if config["num_stages"] > 1:
        parts.append(f"s{config['num_stages']}")
    if config["tiles"] > 1:
        parts.append(f"t{config['tiles']}")
    parts += [flag for flag in ("flat_stats", "folded", "prefetch") if config.get(flag)]
    if not config["fast_math"]:
        parts.append("exact")
    return "/".join(parts).replace("flat_stats", "flat")


def _tree(meta: dict) -> str:
    layout = "stacked" if meta.get("stacked") else "per layer"
    return f"{meta['layers']} layers, {layout}, {meta['grad_dtype']} gradients"


def table(runs: list[tuple[str, dict]]) -> list[str]:
    """The whole-tree steps of ``runs`` (``(record name, --json record)``) as a Markdown table:
    each optimizer against ``optax.adamw`` (float32 moments) of its own run, bandwidth by the
    byte count against the copy of its own process, figures truncated."""
    tr = C.truncated
    lines = [
        "| record | tree | optimizer | step ms [min, max] | vs optax.adamw | TB/s (% of copy) "
        "| state GB | device | JAX | date |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rel, run in runs:
        meta = run["meta"]
        base = next((r for r in run["results"] if r["name"] == "optax.adamw (f32 moments)"), None)
        # Records that kept only the printed copy bandwidth show no percentage.
        bw_ref = reference_bandwidth(run["copy_bw"]) if "copy_bw" in run else None
        name = rel + (f" ({run['variant']})" if "variant" in run else "")
        for r in run["results"]:
            bw = r["bytes_moved"] / r["median_s"]
            vs = C.ratio(r["median_s"], base["median_s"]) if base else "-"
            lines.append(
                f"| `{name}` | {_tree(meta)} | {r['name']} | {tr(r['median_s'] * 1e3, 2)} "
                f"[{tr(r['min_s'] * 1e3, 2)}, {tr(r['max_s'] * 1e3, 2)}] | {vs} | "
                f"{tr(bw / 1e12, 2)}{f' ({tr(100 * bw / bw_ref, 0)}%)' if bw_ref else ''} | "
                f"{tr(r['state_bytes'] / 1e9, 2)} "
                f"| {meta['device']} | {meta['jax']} | {meta['date'][:10]} |"
            )
    return lines


def sweep_table(runs: list[tuple[str, dict]]) -> list[str]:
    """The launch settings each of ``runs`` swept on one decoder layer (fused apply)."""
    tr = C.truncated
    lines = [
        "| record | setting | one layer ms [min, max] | TB/s | device | JAX | date |",
        "|---|---|---|---|---|---|---|",
    ]
    for rel, run in runs:
        meta = run["meta"]
        for r in run.get("sweep", []):
            lines.append(
                f"| `{rel}` | {setting_text(r['config'])} | {tr(r['median_s'] * 1e3, 3)} "
                f"[{tr(r['min_s'] * 1e3, 3)}, {tr(r['max_s'] * 1e3, 3)}] | "
                f"{tr(r['bytes_moved'] / r['median_s'] / 1e12, 2)} | {meta['device']} | "
                f"{meta['jax']} | {meta['date'][:10]} |"
            )
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--grad-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--steps", type=int, default=3, help="back-to-back steps per timing")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--copy-gib", type=float, default=4.0)
    ap.add_argument(
        "--sweep", type=int, default=0, metavar="N", help="also time N (<= 4) kernel settings"
    )
    ap.add_argument(
        "--sweep-settings",
        default="",
        help="comma-separated launch settings to sweep instead "
        "(rows/warps[/sN][/tN][/flat][/exact])",
    )
    ap.add_argument(
        "--best-full", action="store_true", help="also run the whole tree with the sweep's best"
    )
    ap.add_argument(
        "--full-settings",
        default="",
        help="comma-separated launch settings to also run on the whole tree (fused apply)",
    )
    ap.add_argument(
        "--stacked",
        action="store_true",
        help="one array per projection with a layer axis (train.py's scan_layers layout)",
    )
    ap.add_argument("--only", default="", help="comma-separated subset of optimizer names")
    ap.add_argument("--json", type=Path, help="write every number here")
    ap.add_argument("--width", type=int, default=1, help="divide every dimension (smoke tests)")
    ap.add_argument("--interpret", action="store_true", help="Pallas in interpret mode (CPU)")
    ap.add_argument(
        "--kernel-mesh",
        action="store_true",
        help="also time coat_adamw(mesh=...) on a one-device mesh (the shard_map path)",
    )
    args = ap.parse_args(argv)
    global INTERPRET
    INTERPRET = args.interpret

    dev = jax.devices()[0]
    meta = {
        "device": getattr(dev, "device_kind", str(dev)),
        "platform": dev.platform,
        "jax": jax.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": C.git_commit(),
        "command": "python " + " ".join(sys.argv),
        "layers": args.layers,
        "stacked": args.stacked,
        "grad_dtype": args.grad_dtype,
        "reps": args.reps,
        "steps": args.steps,
        "warmup": args.warmup,
    }
    print(json.dumps(meta), flush=True)
    copy_bw = copy_bandwidth(int(args.copy_gib * 2**30), reps=20)
    print({k: f"{v / 1e12:.3f} TB/s" for k, v in copy_bw.items()}, flush=True)

    grad_dtype = jnp.dtype(args.grad_dtype)
    sweep_rows = sweep(args, grad_dtype) if args.sweep or args.sweep_settings else []
    best = None
    if sweep_rows:
        best = ca.KernelConfig(**min(sweep_rows, key=lambda r: r["median_s"])["config"])
        print("best kernel setting:", best, flush=True)

    shapes = llama2_7b_shapes(
        args.layers,
        4096 // args.width,
        11008 // args.width,
        32000 // args.width,
        stacked=args.stacked,
    )
    grads = make_tree(shapes, grad_dtype, seed=2, scale=1e-3)
    meta["n_params"] = sum(math.prod(s) for s in jax.tree.leaves(shapes, is_leaf=is_shape))
    meta["n_leaves"] = len(jax.tree.leaves(shapes, is_leaf=is_shape))
    update_bytes = 2 * quant.state_bytes(grads)  # the chain's update: written once, read once

    def coat(impl):
        return coat_jax.coat_adamw(LR, B1, B2, EPS, WD, implementation=impl, interpret=INTERPRET)

    candidates = [
        ("optax.adamw (f32 moments)", chain_step(optax.adamw(LR, B1, B2, EPS, weight_decay=WD)), 0),
        (
            "optax.adamw (bf16 mu)",
            chain_step(optax.adamw(LR, B1, B2, EPS, weight_decay=WD, mu_dtype=jnp.bfloat16)),
            0,
        ),
        ("coat_adamw pallas (optax chain)", chain_step(coat("pallas")), update_bytes),
        ("coat_adamw pallas (fused apply)", applied_step(coat("pallas")), 0),
    ]
    if args.kernel_mesh:
        mesh = sharding.make_mesh(1, 1)
        tx = coat_jax.coat_adamw(
            LR,
            B1,
            B2,
            EPS,
            WD,
            implementation="pallas",
            interpret=INTERPRET,
            mesh=mesh,
            partition_specs=lambda p: jax.tree.map(
                lambda s: s.spec, sharding.param_shardings(p, mesh)
            ),
        )
        candidates.append(("coat_adamw pallas (chain, mesh=1)", chain_step(tx), update_bytes))
        candidates.append(("coat_adamw pallas (fused apply, mesh=1)", applied_step(tx), 0))
    if args.best_full and best is not None and best != ca.DEFAULT_CONFIG:
        candidates.append((f"fused apply, {best}", fused_coat_adamw(best), 0))
    for text in filter(None, args.full_settings.split(",")):
        candidates.append((f"fused apply, {text}", fused_coat_adamw(parse_setting(text)), 0))
    # Last: the jnp path compiles slowest, and the others must not wait on it.
    candidates.append(("coat_adamw jnp (xla)", chain_step(coat("xla")), update_bytes))
    only = [s for s in args.only.split(",") if s]
    results = []
    for name, (init, step), extra in candidates:
        if only and not any(s in name for s in only):
            continue
        try:
            r = run_optimizer(name, init, step, shapes, grads, args, update_bytes_per_step=extra)
        except Exception as e:  # report and carry on with the other optimizers
            print(f"{name}: FAILED {type(e).__name__}: {e}"[:2000], flush=True)
            continue
        results.append(r)
        print(json.dumps(r), flush=True)

    if args.json:
        args.json.write_text(
            json.dumps(
                {"meta": meta, "copy_bw": copy_bw, "results": results, "sweep": sweep_rows},
                indent=1,
            )
        )
    bw_ref = reference_bandwidth(copy_bw)
    print(
        f"\n{meta['device']}, JAX {meta['jax']}, {meta['n_params'] / 1e9:.2f}B params, "
        f"grads {args.grad_dtype}, copy {bw_ref / 1e12:.2f} TB/s"
    )
    print(
        f"{'optimizer':34s} {'ms':>8s} {'vs f32':>7s} {'TB/s':>6s} {'%copy':>6s} {'state GB':>9s}"
        f" {'vs f32':>7s}"
    )
    base = next((r for r in results if r["name"].startswith("optax.adamw (f32")), None)
    for r in results:
        bw = r["bytes_moved"] / r["median_s"]
        rel_t = r["median_s"] / base["median_s"] if base else float("nan")
        rel_s = r["state_bytes"] / base["state_bytes"] if base else float("nan")
        print(
            f"{r['name'][:34]:34s} {r['median_s'] * 1e3:8.2f} {rel_t:7.2f} {bw / 1e12:6.2f} "
            f"{100 * bw / bw_ref:5.0f}% {r['state_bytes'] / 1e9:9.2f} {rel_s:7.3f}"
        )


if __name__ == "__main__":
    main()

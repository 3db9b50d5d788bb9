"""End-to-end training step of Llama-2-7B on one GPU: bf16 vs fp8 vs COAT (issue 7, paper Table 7).

One step = forward, backward and optimizer update, jitted with parameters and optimizer state
donated (``donate_argnums=(0, 1)``), from random initialisation (nothing is loaded):

* ``bf16`` + ``optax.adamw`` (float32 master weights and moments; the JAX user's baseline);
* ``fp8``  + ``optax.adamw`` (FP8 linear layers only: the TransformerEngine-like point);
* ``coat`` + ``coat_jax.coat_adamw`` (FP8 activations and FP8 moments).

The model is ``coat_jax.llama``'s ``DecoderLayer`` with its layers **stacked and run through
``jax.lax.scan``**: one ``DecoderLayer`` is split with ``nnx.split`` for its graphdef, the stacked
parameters are created directly on the device by a jitted ``jax.vmap`` of the layer's init (no
27 GB host copy), and the scan body rebuilds the layer with ``nnx.merge``. The embedding, final
norm and LM head are as in ``coat_jax.llama.Llama`` (``--tiny`` checks the logits equal
``Llama``'s). Scanning compiles one layer instead of 32, which keeps compile time inside the
device's 10-minute call limit. The scan body is a ``jax.checkpoint`` whose policy (``--remat``,
``REMAT_POLICIES``) stops it from keeping per-layer copies of the weights (BF16 casts, q|k|v and
gate|up concatenations) for backward; without it the scan keeps 12 to 17 GiB of them.

Each mode runs in its own subprocess, so the allocator's ``peak_bytes_in_use`` is that mode's.
Per mode: peak device memory and tokens/s at ``--equal-batch``; the largest batch that fits,
searched with compile-only ``jit(...).lower(...).compile().memory_analysis()`` against the
device's ``bytes_limit`` (an affine fit over two batch sizes predicts it; the prediction is
compiled, stepped down until it fits, then confirmed by running it), and tokens/s there.
Records are appended to ``<out-dir>/e2e.jsonl`` as they come, so a timeout keeps what was done.

    python benchmarks/bench_e2e.py --tiny                       # CPU smoke test, seconds
    python benchmarks/bench_e2e.py --out-dir runs/e2e --docs docs/bench_e2e.md --plot \\
        docs/benchmarks_e2e.png                                 # one H200
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

MODES = ("bf16", "fp8", "coat")
OPTIMIZER = {"bf16": "optax.adamw", "fp8": "optax.adamw", "coat": "coat_jax.coat_adamw"}
LR, WD = 1e-4, 0.1


def model_config(tiny: bool):
    from coat_jax import llama

    if tiny:
        return llama.LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=3,
            num_attention_heads=4,
            max_position_embeddings=128,
        )
    return llama.LlamaConfig()  # Llama-2-7B: 4096 / 11008 / 32 layers / 32 heads / vocab 32000


REMAT = ("weights", "rank", "none")
# Weight-preparation primitives: concatenating q|k|v or gate|up and casting to the compute dtype.
_WEIGHT_PREP = ("concatenate", "convert_element_type")


def _save_unless_weight_prep(prim, *avals, **params) -> bool:
    """Remat policy "weights": recompute weight preparation in backward, keep everything else.

    Without it the scanned step keeps, per layer and stacked over 32 layers, what the layer
    computes from its weights alone: BF16 weight casts (12 GiB) in bf16 mode and float32 q|k|v
    and gate|up concatenations (17 GiB) in fp8 and coat mode (``coat_jax.residuals`` of the
    7B step, traced on the CPU). Activations are never rank <= 2 *and* a concatenate or convert
    in this model's forward, so only those two primitives on rank <= 2 inputs are dropped;
    backward redoes them (memory-bound, a few ms a step). Applied to every mode alike.
    """
    del params
    if prim.name in _WEIGHT_PREP:
        return any(getattr(a, "ndim", 0) >= 3 for a in avals)
    return True


def _save_rank3(prim, *avals, **params) -> bool:
    """Remat policy "rank" (the first version, kept to reproduce its measurements).

    Keeps a value only if one input of its op has rank >= 3. That also drops the Pallas FP8
    quantizer outputs of ``fp8_linear``, which work on the rank-2 [tokens, features] view, so
    fp8 and coat keep the BF16 input of those linears instead of its FP8 codes and re-quantize
    it in backward.
    """
    del prim, params
    return any(getattr(a, "ndim", 0) >= 3 for a in avals)


REMAT_POLICIES = {"weights": _save_unless_weight_prep, "rank": _save_rank3}


class ScannedLlama:
    """``coat_jax.llama.Llama`` with its decoder layers stacked and run by ``jax.lax.scan``.

    Parameters are a pure dict ``{"embed", "layers", "norm", "lm_head"}``; ``layers`` holds every
    ``DecoderLayer`` parameter with a leading ``num_hidden_layers`` axis.
    """

    def __init__(self, config, precision: str, *, dtype=None, param_dtype=None, remat="weights"):
        import jax.numpy as jnp
        from flax import nnx

        from coat_jax import llama
        from coat_jax.fp8_ops import ops_for

        if config.tie_word_embeddings:
            raise ValueError("ScannedLlama expects an untied LM head (Llama-2)")
        self.config = config
        self.precision = llama.check_precision(precision)
        self.dtype = jnp.bfloat16 if dtype is None else dtype
        self.param_dtype = jnp.float32 if param_dtype is None else param_dtype
        if remat not in REMAT:
            raise ValueError(f"remat={remat!r} is not one of {list(REMAT)}")
        self.remat = remat
        self.ops = ops_for(precision)
        self.inv_freq = llama.rope_inv_freq(config)
        layer = nnx.eval_shape(
            lambda: llama.DecoderLayer(config, param_dtype=self.param_dtype, rngs=nnx.Rngs(0))
        )
        self.graphdef, self.abstract_layer = nnx.split(layer)

    def _init_layer(self, key):
        from flax import nnx

        from coat_jax import llama

        layer = llama.DecoderLayer(
            self.config, param_dtype=self.param_dtype, rngs=nnx.Rngs(params=key)
        )
        return nnx.to_pure_dict(nnx.split(layer)[1])

    def init(self, key):
        """Random parameters (std 0.02, norms 1), built inside jit: call under ``jax.jit``."""
        import jax
        import jax.numpy as jnp

        c = self.config
        k_embed, k_head, k_layers = jax.random.split(key, 3)
        layers = jax.vmap(self._init_layer)(jax.random.split(k_layers, c.num_hidden_layers))
        std = 0.02
        return {
            "embed": std
            * jax.random.normal(k_embed, (c.vocab_size, c.hidden_size), self.param_dtype),
            "layers": layers,
            "norm": jnp.ones((c.hidden_size,), self.param_dtype),
            "lm_head": std
            * jax.random.normal(k_head, (c.hidden_size, c.vocab_size), self.param_dtype),
        }

    def _layer(self, layer_params):
        import jax
        from flax import nnx

        state = jax.tree.map(lambda x: x, self.abstract_layer)
        nnx.replace_by_pure_dict(state, layer_params)
        return nnx.merge(self.graphdef, state)

    def logits(self, params, tokens_BT):
        import jax
        import jax.numpy as jnp

        b, t = tokens_BT.shape
        positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        # As in Llama: gather rows in the master dtype, then cast.
        x_BTD = jnp.take(params["embed"], tokens_BT, axis=0).astype(self.dtype)

        def body(x_BTD, layer_params):
            layer = self._layer(layer_params)
            return layer(x_BTD, positions_BT, self.inv_freq, self.ops), None

        if self.remat in REMAT_POLICIES:
            # CPU note: the policy also overrides causal_attention's inner jax.checkpoint, so
            # XLA's attention keeps its probabilities (fine for --tiny; the GPU uses cuDNN).
            body = jax.checkpoint(body, policy=REMAT_POLICIES[self.remat], prevent_cse=False)
        x_BTD, _ = jax.lax.scan(body, x_BTD, params["layers"])
        x_BTD = self.ops.rmsnorm(x_BTD, params["norm"], self.config.rms_norm_eps)
        return jnp.einsum(
            "btd,dv->btv",
            x_BTD,
            params["lm_head"].astype(self.dtype),
            preferred_element_type=jnp.float32,
        )

    def loss(self, params, tokens_BT1):
        """Mean next-token cross-entropy, as ``coat_jax.training.loop.next_token_loss``."""
        import optax

        logits = self.logits(params, tokens_BT1[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens_BT1[:, 1:]).mean()


def optimizer_for(mode: str, tiny: bool):
    import optax

    import coat_jax

    if mode == "coat":
        # On the CPU the Pallas kernel would run interpreted; the jnp path is the same math.
        impl = "xla" if tiny else "auto"
        return coat_jax.coat_adamw(LR, weight_decay=WD, implementation=impl)
    return optax.adamw(LR, weight_decay=WD)


def make_step(model: ScannedLlama, tx):
    import jax
    import optax

    def step(params, opt_state, tokens_BT1):
        loss, grads = jax.value_and_grad(model.loss)(params, tokens_BT1)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def flops_per_step(config, batch: int, seq: int) -> float:
    """Model FLOPs of one training step (6 per parameter per token; causal attention 6*T*d/layer).

    The embedding gather is not a matmul and is left out; the LM head is counted.
    """
    d, f, v, n_layers = (
        config.hidden_size,
        config.intermediate_size,
        config.vocab_size,
        config.num_hidden_layers,
    )
    kv = config.num_key_value_heads * config.head_dim
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * f
    matmul_params = n_layers * per_layer + d * v
    tokens = batch * seq
    return 6.0 * matmul_params * tokens + 6.0 * n_layers * d * seq * tokens


# ------------------------------------------------------------------------------------------------
# worker: one mode in its own process


def worker(args) -> None:
    import jax
    import jax.numpy as jnp

    from coat_jax.memory import residuals

    mode, seq, tiny = args.worker, args.seq, args.tiny
    start = time.monotonic()
    deadline = start + args.child_budget_s
    env = C.environment()
    config = model_config(tiny)
    model = ScannedLlama(config, mode, remat=args.remat)
    tx = optimizer_for(mode, tiny)
    step = make_step(model, tx)
    base = {"mode": mode, "optimizer": OPTIMIZER[mode], "seq": seq, "remat": args.remat, **env}

    def record(kind, **fields):
        rec = {"kind": kind, **base, **fields}
        C.append_jsonl(args.jsonl, rec)
        print(f"[{mode}] {kind}: { {k: v for k, v in fields.items() if k != 'hlo_calls'} }")
        return rec

    init = jax.jit(model.init)
    abstract_params = jax.eval_shape(init, jax.random.key(0))
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    state_bytes = {
        "params": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_params)),
        "opt_state": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_opt)),
    }
    n_params = sum(x.size for x in jax.tree.leaves(abstract_params))
    stats0 = C.memory_stats()
    limit = stats0.get("bytes_limit") or stats0.get("bytes_reservable_limit")
    record("setup", n_params=n_params, bytes_limit=limit, **state_bytes)

    compiled_cache: dict[int, object] = {}
    mem_cache: dict[int, dict] = {}

    def compile_at(batch: int):
        if batch in compiled_cache:
            return compiled_cache[batch], mem_cache[batch]
        tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
        t0 = time.perf_counter()
        compiled = step.lower(abstract_params, abstract_opt, tokens).compile()
        mem = C.compiled_memory(compiled)
        hlo = compiled.as_text() or ""
        calls = C.custom_call_counts(hlo)
        compiled_cache[batch], mem_cache[batch] = compiled, mem
        record(
            "compile",
            batch=batch,
            compile_s=round(time.perf_counter() - t0, 1),
            memory=mem,
            fits=fits(mem),
            fp8_gemms=calls.get(C.FP8_GEMM_TARGET, 0),
            hlo_calls=calls,
            hlo_ops=C.hlo_op_counts(hlo),
        )
        return compiled, mem

    def fits(mem) -> bool | None:
        if not limit or "peak" not in mem:
            return None
        return mem["peak"] <= limit - args.margin_bytes

    t0 = time.perf_counter()
    params = init(jax.random.key(0))
    opt_state = jax.jit(tx.init)(params)
    jax.block_until_ready((params, opt_state))
    record("init", init_s=round(time.perf_counter() - t0, 1), memory_stats=C.memory_stats())
    rng = jax.random.key(1)

    def run_at(batch: int, reps: int):
        nonlocal params, opt_state
        compiled, mem = compile_at(batch)
        tokens = jax.random.randint(
            jax.random.fold_in(rng, batch), (batch, seq + 1), 0, config.vocab_size, jnp.int32
        )
        losses = []

        def one():
            nonlocal params, opt_state
            params, opt_state, loss = compiled(params, opt_state, tokens)
            losses.append(float(loss))  # float() blocks until the step is done

        timing = C.time_fn(one, warmup=args.warmup, reps=reps)
        stats = C.memory_stats()
        tokens_per_step = batch * seq
        return record(
            "run",
            batch=batch,
            tokens_per_s=tokens_per_step / timing["median_s"],
            step=timing,
            model_tflops=flops_per_step(config, batch, seq) / timing["median_s"] / 1e12,
            peak_bytes_in_use=stats.get("peak_bytes_in_use"),
            bytes_in_use=stats.get("bytes_in_use"),
            compiled_peak=mem.get("peak"),
            losses=[round(x, 4) for x in losses],
        )

    def time_left() -> float:
        return deadline - time.monotonic()

    def try_run(batch: int, reps: int):
        """run_at, or None after an out-of-memory error (then the state is rebuilt)."""
        nonlocal params, opt_state
        try:
            return run_at(batch, reps)
        except Exception as e:  # noqa: BLE001 - XlaRuntimeError's class moves between versions
            msg = str(e)
            if "RESOURCE_EXHAUSTED" not in msg and "out of memory" not in msg.lower():
                raise
            record("oom", batch=batch, error=msg[:400])
            # The donated buffers may be gone after a failed call: rebuild them.
            params = opt_state = None
            params = init(jax.random.key(0))
            opt_state = jax.jit(tx.init)(params)
            return None

    def residual_bytes(batch: int) -> int:
        tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
        return sum(r.nbytes for r in residuals(model.loss, abstract_params, tokens))

    # 1. the common batch (the peak recorded here is the equal-batch peak: nothing larger ran)
    b0 = args.equal_batch
    done = {}
    rec0 = try_run(b0, args.reps)
    if rec0 is not None:
        done[b0] = rec0
    if args.no_search:
        return
    # 2. largest batch. The first guess uses the growth of the backward residuals per sequence
    #    (traced, nothing compiled); each compile then refines an affine fit of XLA's compiled
    #    peak against the batch, between the largest batch known to fit and the smallest not.
    if time_left() < args.min_compile_s:
        record("search_skipped", reason="child time budget spent before the batch search")
        return
    _, m0 = compile_at(b0)
    res_slope = residual_bytes(b0 + 1) - residual_bytes(b0)
    if tiny and not limit:
        # The CPU has no allocator limit; pretend one that fits about three more sequences.
        limit = int(m0["peak"] + 3.5 * max(res_slope, 1))
        record("tiny_limit", bytes_limit=limit)
    if not limit or res_slope <= 0:
        record("search_skipped", reason=f"no bytes_limit ({limit}) or residual slope {res_slope}")
        return
    allowed = limit - args.margin_bytes
    fit_lo = b0 if fits(m0) else None  # largest batch known to fit
    fit_hi = None  # smallest batch known not to fit
    b = max(1, min(b0 + math.floor((allowed - m0["peak"]) / res_slope), args.max_batch))
    record("predict", residual_bytes_per_sequence=res_slope, first_guess=b, allowed=allowed)
    for _ in range(args.max_search_compiles):
        if time_left() < args.min_compile_s or b == fit_lo or b == fit_hi:
            break
        _, mem = compile_at(b)
        if fits(mem):
            fit_lo = b if fit_lo is None else max(fit_lo, b)
        else:
            fit_hi = b if fit_hi is None else min(fit_hi, b)
        slope = (mem["peak"] - m0["peak"]) / (b - b0) if b != b0 else res_slope
        nb = b + math.floor((allowed - mem["peak"]) / max(slope, 1))
        if fit_hi is not None:
            nb = min(nb, fit_hi - 1)
        if fit_lo is not None:
            nb = max(nb, fit_lo + 1 if fit_hi is None or fit_lo + 1 < fit_hi else fit_lo)
        nb = max(1, min(nb, args.max_batch))
        if fit_lo is not None and fit_hi is not None and fit_hi - fit_lo <= 1:
            break
        b = nb
    best = fit_lo
    record("search", largest_fitting=fit_lo, smallest_not_fitting=fit_hi)
    if best is None:
        record("search_skipped", reason=f"no fitting batch found (smallest too big {fit_hi})")
        return
    # 3. confirm by running it, stepping down on an out-of-memory error.
    while best >= 1 and time_left() > args.min_compile_s / 2:
        if best == b0 and b0 in done:
            rec = done[b0]
        else:
            rec = try_run(best, max(3, args.reps // 2) if best > b0 else args.reps)
        if rec is not None:
            record("max_batch", batch=best, tokens_per_s=rec["tokens_per_s"])
            return
        best -= 1
    record("search_skipped", reason="out of time before a confirming run succeeded")


# ------------------------------------------------------------------------------------------------
# parent: one child per mode, then the tables


def tiny_check() -> None:
    """ScannedLlama's logits equal coat_jax.llama.Llama's on the same parameters (all modes)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from coat_jax import llama

    config = model_config(tiny=True)
    tokens = jax.random.randint(jax.random.key(3), (2, 16), 0, config.vocab_size, jnp.int32)
    for mode in MODES:
        # float32 compute, so eager-vs-scan rounding differences stay far below the tolerance.
        ref = llama.Llama(config, precision=mode, dtype=jnp.float32, rngs=nnx.Rngs(0))
        pure = nnx.to_pure_dict(nnx.state(ref, nnx.Param))
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[pure["layers"][i] for i in range(3)])
        params = {
            "embed": pure["embed_tokens"],
            "layers": stacked,
            "norm": pure["norm"]["weight"],
            "lm_head": pure["lm_head"],
        }
        got = ScannedLlama(config, mode, dtype=jnp.float32).logits(params, tokens)
        want = ref(tokens)
        err = float(jnp.max(jnp.abs(got - want)))
        if not np.isfinite(err) or err > 1e-4:
            raise AssertionError(f"{mode}: scanned logits differ from Llama's by {err}")
        print(f"tiny check {mode}: scanned == Llama logits (max abs diff {err:.2e})")
        # The remat policy must not change the gradient.
        tokens1 = jnp.concatenate([tokens, tokens[:, :1]], axis=1)
        grads = [
            jax.grad(ScannedLlama(config, mode, dtype=jnp.float32, remat=r).loss)(params, tokens1)
            for r in REMAT
        ]
        gerr = max(
            float(jnp.max(jnp.abs(a - b)))
            for g in grads[:-1]
            for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(grads[-1]), strict=True)
        )
        if not np.isfinite(gerr) or gerr > 1e-5:
            raise AssertionError(f"{mode}: remat changes the gradient by {gerr}")
        print(f"tiny check {mode}: gradient with remat == without (max abs diff {gerr:.2e})")


def summarize(records: list[dict]) -> dict:
    by_mode: dict[str, dict] = {}
    for r in records:
        if "mode" not in r:
            continue  # the command record
        m = by_mode.setdefault(r["mode"], {"runs": {}, "compiles": {}})
        if r["kind"] == "run":
            m["runs"][r["batch"]] = r
        elif r["kind"] == "compile":
            m["compiles"][r["batch"]] = r
        elif r["kind"] in ("setup", "max_batch", "predict"):
            m[r["kind"]] = r
        elif r["kind"] == "search_skipped":
            m.setdefault("notes", []).append(r["reason"])
        elif r["kind"] == "oom":
            m.setdefault("notes", []).append(f"OOM when run at batch {r['batch']}")
    return by_mode


def write_docs(path: str, records: list[dict], equal_batch: int, command: str) -> str:
    s = summarize(records)
    env = next((r for r in records if r["kind"] == "setup"), None)
    lines = ["# End-to-end training step: Llama-2-7B on one GPU (issue 7)", ""]
    if env:
        lines += [
            f"Measured {env['date']} on {env['device']} with JAX {env['jax']}, by `{command}`.",
            f"Sequence length {env['seq']}; the step is forward + backward + optimizer, jitted, "
            "parameters and optimizer state donated; master weights float32; activations "
            "bfloat16. Layers are stacked and run through `jax.lax.scan` (one `DecoderLayer` "
            "split with `nnx.split`, stacked parameters created on the device by a jitted "
            "vmapped init, `nnx.merge` in the scan body). Each mode ran in its own process. "
            f"Scan-body remat policy: `{env.get('remat')}` (`REMAT_POLICIES` in "
            "benchmarks/bench_e2e.py).",
            "",
        ]
    lines += [
        f"| mode | optimizer | params + opt state (GiB) | peak at batch {equal_batch} (GiB) | "
        f"XLA peak at batch {equal_batch} (GiB) | tokens/s at batch {equal_batch} | "
        "largest batch | peak there (GiB) | tokens/s there | FP8 GEMMs in HLO |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    peaks, speeds, eq_speeds = {}, {}, {}
    for mode in MODES:
        m = s.get(mode)
        if not m:
            continue
        setup = m.get("setup", {})
        st = (setup.get("params", 0) + setup.get("opt_state", 0)) or None
        eq = m["runs"].get(equal_batch, {})
        mb = m.get("max_batch", {}).get("batch")
        mx = m["runs"].get(mb, {}) if mb else {}
        comp = m["compiles"].get(equal_batch, {})
        peaks[mode] = eq.get("peak_bytes_in_use")
        eq_speeds[mode] = eq.get("tokens_per_s")
        speeds[mode] = mx.get("tokens_per_s")
        lines.append(
            f"| {mode} | {OPTIMIZER[mode]} | {C.gib(st)} | {C.gib(eq.get('peak_bytes_in_use'))} | "
            f"{C.gib(comp.get('memory', {}).get('peak'))} | "
            f"{eq.get('tokens_per_s', 0):.0f} | {mb or 'n/a'} | "
            f"{C.gib(mx.get('peak_bytes_in_use'))} | {mx.get('tokens_per_s', 0):.0f} | "
            f"{comp.get('fp8_gemms', 'n/a')} |"
        )
    lines += [
        "",
        "Ratios (targets from SPEC section 4 / issue 7):",
        "",
        f"- peak memory at batch {equal_batch}, BF16 / COAT: "
        f"{C.ratio(peaks.get('bf16'), peaks.get('coat'))}"
        " (target >= 1.54x)",
        f"- peak memory at batch {equal_batch}, BF16 / FP8: "
        f"{C.ratio(peaks.get('bf16'), peaks.get('fp8'))}",
        f"- tokens/s at each one's largest batch, COAT / BF16: "
        f"{C.ratio(speeds.get('coat'), speeds.get('bf16'))} (target >= 1.43x)",
        f"- tokens/s at batch {equal_batch}, COAT / BF16: "
        f"{C.ratio(eq_speeds.get('coat'), eq_speeds.get('bf16'))} (target >= 1.00x)",
        f"- tokens/s at batch {equal_batch}, FP8 / BF16: "
        f"{C.ratio(eq_speeds.get('fp8'), eq_speeds.get('bf16'))}",
        "",
        "Compiled memory (XLA `memory_analysis()`: arguments + outputs - donated + temporaries), "
        "per compiled batch:",
        "",
        "| mode | batch | compile s | arguments GiB | temporaries GiB | peak GiB | fits |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        for b, c in sorted(s.get(mode, {}).get("compiles", {}).items()):
            mem = c["memory"]
            lines.append(
                f"| {mode} | {b} | {c['compile_s']} | {C.gib(mem.get('argument'))} | "
                f"{C.gib(mem.get('temp'))} | {C.gib(mem.get('peak'))} | {c['fits']} |"
            )
    notes = [(mode, n) for mode in MODES for n in s.get(mode, {}).get("notes", [])]
    if notes:
        lines += ["", "Not measured / notes:", ""] + [f"- {mode}: {n}" for mode, n in notes]
    text = "\n".join(lines) + "\n"
    if path:
        with open(path, "w") as f:
            f.write(text)
    return text


def plot(path: str, records: list[dict], equal_batch: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = summarize(records)
    modes = [m for m in MODES if m in s]
    fig, (ax_mem, ax_tps) = plt.subplots(1, 2, figsize=(10, 4))
    env = next((r for r in records if r["kind"] == "setup"), {})
    for i, mode in enumerate(modes):
        eq = s[mode]["runs"].get(equal_batch, {})
        mb = s[mode].get("max_batch", {}).get("batch")
        mx = s[mode]["runs"].get(mb, {}) if mb else {}
        ax_mem.bar(i, (eq.get("peak_bytes_in_use") or 0) / C.GIB, color=f"C{i}")
        ax_tps.bar(i - 0.2, eq.get("tokens_per_s", 0), width=0.4, color=f"C{i}", alpha=0.5)
        ax_tps.bar(i + 0.2, mx.get("tokens_per_s", 0), width=0.4, color=f"C{i}")
        if mb:
            ax_tps.text(i + 0.2, mx.get("tokens_per_s", 0), f"b={mb}", ha="center", va="bottom")
    for ax in (ax_mem, ax_tps):
        ax.set_xticks(range(len(modes)), modes)
    ax_mem.set_ylabel(f"peak device memory at batch {equal_batch} (GiB)")
    ax_tps.set_ylabel(f"tokens/s (light: batch {equal_batch}; dark: largest batch)")
    fig.suptitle(
        f"Llama-2-7B train step, {env.get('device', '?')}, JAX {env.get('jax', '?')}, "
        f"{env.get('date', '')}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def recorded_command(records: list[dict]) -> str:
    cmds = [r["command"] for r in records if r["kind"] == "command"]
    return "` then `".join(dict.fromkeys(cmds)) if cmds else "unknown"


def report(args, jsonl: str) -> None:
    """Rewrites the docs and plot from a finished (or cut short) run's records."""
    records = C.read_jsonl(jsonl)
    if not records:
        raise ValueError(f"no records in {jsonl}")
    print(write_docs(args.docs, records, args.equal_batch, recorded_command(records)))
    if args.plot:
        plot(args.plot, records, args.equal_batch)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated subset of bf16,fp8,coat"
    )
    p.add_argument("--seq", type=int, default=None, help="sequence length (2048; 64 with --tiny)")
    p.add_argument("--equal-batch", type=int, default=1, help="the batch every mode runs")
    p.add_argument("--reps", type=int, default=5, help="timed steps per batch (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-search", action="store_true", help="skip the largest-batch search")
    p.add_argument("--margin-bytes", type=int, default=None, help="headroom (512 MiB; 0 tiny)")
    p.add_argument("--max-batch", type=int, default=64, help="upper end of the search")
    p.add_argument("--max-search-compiles", type=int, default=3)
    p.add_argument("--child-budget-s", type=float, default=300.0, help="per-mode time budget")
    p.add_argument("--min-compile-s", type=float, default=40.0, help="time one compile may take")
    p.add_argument("--remat", choices=REMAT, default="weights", help="scan-body remat policy")
    p.add_argument("--tiny", action="store_true", help="3 small layers on the CPU: a smoke test")
    p.add_argument("--out-dir", default="runs/bench_e2e")
    p.add_argument("--docs", default=None, help="write the markdown table here")
    p.add_argument("--plot", default=None, help="write the plot (PNG) here")
    p.add_argument("--no-child-logs", action="store_true", help="no per-mode log files")
    p.add_argument(
        "--report-only", action="store_true", help="only rewrite --docs/--plot from out-dir"
    )
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--jsonl", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.seq is None:
        args.seq = 64 if args.tiny else 2048
    if args.margin_bytes is None:
        args.margin_bytes = 0 if args.tiny else 512 * 1024**2
    if args.worker:
        worker(args)
        return
    modes = C.parse_modes(args.modes, MODES)
    os.makedirs(args.out_dir, exist_ok=True)
    jsonl = os.path.join(args.out_dir, "e2e.jsonl")
    if args.report_only:
        return report(args, jsonl)
    command = C.command_line()
    C.append_jsonl(jsonl, {"kind": "command", "command": command})
    if args.tiny:
        tiny_check()
    passthrough = [
        f"--seq={args.seq}",
        f"--equal-batch={args.equal_batch}",
        f"--reps={args.reps}",
        f"--warmup={args.warmup}",
        f"--margin-bytes={args.margin_bytes}",
        f"--child-budget-s={args.child_budget_s}",
        f"--min-compile-s={args.min_compile_s}",
        f"--max-batch={args.max_batch}",
        f"--remat={args.remat}",
        f"--max-search-compiles={args.max_search_compiles}",
        f"--jsonl={jsonl}",
    ]
    passthrough += ["--tiny"] if args.tiny else []
    passthrough += ["--no-search"] if args.no_search else []
    for mode in modes:
        rc = C.run_child(
            [os.path.abspath(__file__), f"--worker={mode}", *passthrough],
            timeout_s=args.child_budget_s + 30,
            log_path=None if args.no_child_logs else os.path.join(args.out_dir, f"e2e_{mode}.log"),
        )
        if rc:
            print(f"[parent] {mode} exited with {rc}; continuing with what it recorded")
        records = C.read_jsonl(jsonl)
        text = write_docs(args.docs, records, args.equal_batch, command)
    print(text)
    if args.plot:
        plot(args.plot, C.read_jsonl(jsonl), args.equal_batch)


if __name__ == "__main__":
    main()

"""Optimizer-state quantization error, the paper's Table 1, from moments of a real training run.

Trains a small Llama (coat_jax.Llama, BF16 mode, float32 master weights) on the bundled
public-domain corpus with ``optax.adamw`` (float32 moments), takes Adam's first and second moments
from that run, quantizes them with each format pair, with and without Dynamic Range Expansion,
and reports the mean squared error of the Adam direction ``m / (sqrt(v) + eps)`` between the
float32 moments and their FP8 round trip. Writes one record per format pair to ``OUT.jsonl``;
``benchmarks/render.py`` renders docs/quant_error.md's table from the committed records.

    python benchmarks/quant_error.py [--steps 300] [--out benchmarks/results/quant_error/run]
"""

from __future__ import annotations

import argparse
import io
import sys
import tarfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from coat_jax import quant
from coat_jax.llama import Llama, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data" / "public_domain_en.tar.xz"
EPS = 1e-8

# (label, mu format, mu expansion, nu format, nu expansion); the paper's Table 1 rows.
CONFIGS = [
    ("E4M3 / E4M3", "e4m3", False, "e4m3", False),
    ("E4M3 + expand / E4M3", "e4m3", True, "e4m3", False),
    ("E4M3 / E4M3 + expand", "e4m3", False, "e4m3", True),
    ("E4M3 + expand / E4M3 + expand", "e4m3", True, "e4m3", True),
    ("E4M3 + expand / E5M2", "e4m3", True, "e5m2", False),
    ("E4M3 + expand / E5M2 + expand", "e4m3", True, "e5m2", True),
    ("E5M2 / E5M2", "e5m2", False, "e5m2", False),
]
PAPER = {
    "E4M3 / E4M3": 20.10,
    "E4M3 + expand / E4M3 + expand": 12.31,
    "E4M3 + expand / E5M2 + expand": 12.43,
    "E5M2 / E5M2": 40.30,
}


def corpus_bytes(limit: int) -> np.ndarray:
    with tarfile.open(CORPUS) as tar:
        chunks, total = [], 0
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if not member.isfile():
                continue
            data = tar.extractfile(member).read()
            chunks.append(data)
            total += len(data)
            if total >= limit:
                break
    return np.frombuffer(io.BytesIO(b"".join(chunks)).getvalue()[:limit], np.uint8)


def train_moments(steps: int, seed: int = 0):
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    model = Llama(cfg, precision="bf16", rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = corpus_bytes(4_000_000).astype(np.int32)
    batch, seq = 16, 128
    tx = optax.adamw(1e-3, weight_decay=0.1)
    opt_state = tx.init(params)

    def loss_fn(p, x):
        logits = nnx.merge(graphdef, p)(x[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, x[:, 1:]).mean()

    @jax.jit
    def step(p, s, x):
        loss, g = jax.value_and_grad(loss_fn)(p, x)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        starts = rng.integers(0, len(tokens) - seq - 1, batch)
        x = jnp.asarray(np.stack([tokens[s : s + seq + 1] for s in starts]))
        params, opt_state, loss = step(params, opt_state, x)
        losses.append(float(loss))
    adam = opt_state[0]
    mus = [np.asarray(m) for m in jax.tree.leaves(adam.mu)]
    nus = [np.asarray(v) for v in jax.tree.leaves(adam.nu)]
    keep = [i for i, m in enumerate(mus) if m.ndim == 2]  # weight matrices, as in the paper
    return (
        [mus[i] for i in keep],
        [nus[i] for i in keep],
        losses,
        int(sum(mus[i].size for i in keep)),
    )


def roundtrip(x, fmt, expansion):
    x = jnp.asarray(x, jnp.float32)
    if expansion:
        return np.asarray(quant.quantize_dre(x, fmt=fmt).dequantize())
    return np.asarray(quant.quantize_absmax(x, fmt=fmt).dequantize())


def direction_mse(mus, nus, mu_fmt, mu_exp, nu_fmt, nu_exp):
    se, ae, n, zero_v = 0.0, 0.0, 0, 0
    for m, v in zip(mus, nus, strict=True):
        exact = m / (np.sqrt(v) + EPS)
        mq, vq = roundtrip(m, mu_fmt, mu_exp), roundtrip(v, nu_fmt, nu_exp)
        approx = mq / (np.sqrt(vq) + EPS)
        diff = exact.astype(np.float64) - approx
        se += float(np.sum(diff**2))
        ae += float(np.sum(np.abs(diff)))
        n += m.size
        zero_v += int(np.sum((vq == 0) & (v != 0)))
    return se / n, ae / n, zero_v / n


def report(records: list[dict]) -> str:
    """The run's moments, the table of ``records`` (one per format pair) with its stamp, and
    the ratio the paper reports, as Markdown."""
    by = {r["case"]: r for r in records}
    run = records[0]
    ratio = by["E4M3 / E4M3"]["mse"] / by["E4M3 + expand / E4M3 + expand"]["mse"]
    paper_ratio = PAPER["E4M3 / E4M3"] / PAPER["E4M3 + expand / E4M3 + expand"]
    lines = [
        f"Moments after {run['steps']} steps: loss {run['loss_first']:.3f} -> "
        f"{run['loss_last']:.3f}; {run['params_measured']:,} weight-matrix parameters measured; "
        f"training took {run['train_s']:.0f} s.",
        "",
        "| first / second moment | MSE (ours) | paper's MSE | mean abs error | v flushed to 0 "
        "| device | JAX | date |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        paper = PAPER.get(r["case"])
        lines.append(
            f"| {r['case']} | {r['mse']:.4g} | {paper if paper is not None else '-'} | "
            f"{r['mae']:.4g} | {r['v_flushed']:.4%} | {r['device']} | {r['jax']} | "
            f"{r['date'][:10]} |"
        )
    lines += [
        "",
        f"Expansion on both moments lowers the error {C.times(ratio, 2)} (E4M3/E4M3 -> "
        f"E4M3+expand/E4M3+expand); the paper's is {C.times(paper_ratio, 2)} (20.10 -> 12.31).",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quant_error" / "run"))
    args = ap.parse_args(argv)
    t0 = time.time()
    mus, nus, losses, n_params = train_moments(args.steps)
    run = {
        **C.environment(),
        "command": C.command_line(),
        "steps": args.steps,
        "loss_first": losses[0],
        "loss_last": float(np.mean(losses[-10:])),
        "params_measured": n_params,
        "train_s": time.time() - t0,
    }
    records = []
    for label, mf, me, nf, ne in CONFIGS:
        mse, mae, flushed = direction_mse(mus, nus, mf, me, nf, ne)
        records.append({**run, "case": label, "mse": mse, "mae": mae, "v_flushed": flushed})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    C.write_jsonl(args.out, records)
    print(report(records))


if __name__ == "__main__":
    main()

"""Final validation loss of the default tiny Llama with each optimizer, float32 vs FP8 state.

Trains what ``python train.py`` trains (configs/default.yaml: the tiny Llama in COAT mode on the
bundled corpus) once per optimizer with ``optimizer.fp8_state=false`` and once with ``optimizer.fp8_state=true``,
through the trainer's Python API, and prints a Markdown table (and writes it, with the raw
numbers, under ``--out``). docs/fp8_state.md holds a measured table.

  python benchmarks/fp8_state_accuracy.py                       # every optimizer, 600 steps
  python benchmarks/fp8_state_accuracy.py --steps 300 --optimizers lion sgd
  python benchmarks/fp8_state_accuracy.py --state-bytes OUT   # bytes/parameter: Llama-2-7B, shapes

Learning rates: AdamW's default 3e-3 for adamw, adafactor and muon (whose consistent-RMS
scaling is meant to share AdamW's learning rate); lion takes a tenth of it (its sign updates are
larger than Adam's, Chen et al. 2023 use 3-10x less), sgd a larger one (its updates are the raw
clipped gradient). ``--lr name=value`` overrides one.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import dataclasses  # noqa: E402

import _common as C  # noqa: E402
import derived  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import coat_jax  # noqa: E402
from coat_jax import quant  # noqa: E402
from coat_jax.fp8_wrapper import quantized_paths  # noqa: E402
from coat_jax.llama import Llama, LlamaConfig  # noqa: E402
from coat_jax.training import load_config, optimizers, program, train  # noqa: E402

OPTIMIZERS = ("adamw", "lion", "sgd", "adafactor", "muon")
LEARNING_RATES = {"adamw": 3e-3, "lion": 3e-4, "sgd": 0.3, "adafactor": 3e-3, "muon": 3e-3}


def run(optimizer: str, fp8: bool, *, steps: int, lr: float, out: Path, extra) -> dict:
    name = f"{optimizer}_{'fp8' if fp8 else 'f32'}"
    cfg = load_config(
        REPO / "configs" / "default.yaml",
        [
            f"optimizer.name={optimizer}",
            f"optimizer.fp8_state={str(fp8).lower()}",
            f"optimizer.learning_rate={lr}",
            f"steps={steps}",
            f"optimizer.warmup_steps={min(50, steps // 10)}",
            f"output_dir={out / name}",
            f"eval.every={steps + 1}",
            f"checkpoint.every={steps + 1}",
            "checkpoint.keep=1",
            "logging.progress_bar=false",
            *extra,
        ],
    )
    start = time.perf_counter()
    result = train(cfg, say=lambda *_: None)
    return {
        "optimizer": optimizer,
        "fp8_state": fp8,
        "learning_rate": lr,
        "steps": steps,
        "val_loss": result.val_loss,
        "seconds": time.perf_counter() - start,
    }


def state_bytes_records() -> list[dict]:
    """State bytes of every trainer optimizer, float32 and FP8 state, and of ``coat_adamw``
    (its fused FP8 state) on the Llama-2-7B parameter tree, from ``jax.eval_shape(tx.init,
    params)`` (no array is allocated): one ``"kind": "state_bytes"`` record each, stamped with
    the environment and command (``derived.state_bytes_table`` renders them)."""
    model = nnx.eval_shape(
        lambda: Llama(
            LlamaConfig(), precision="coat", param_dtype=jax.numpy.float32, rngs=nnx.Rngs(0)
        )
    )
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    n = sum(p.size for p in jax.tree.leaves(params))
    base = load_config(REPO / "configs" / "default.yaml")
    stamp = {**C.environment(), "command": C.command_line()}
    records = []
    configs = [
        (opt, fp8, dataclasses.replace(base, optimizer=opt, fp8_state=fp8))
        for opt in OPTIMIZERS
        for fp8 in (False, True)
    ]
    configs.append(("coat_adamw", True, dataclasses.replace(base, optimizer="coat_adamw")))
    for opt, fp8, cfg in configs:
        state = jax.eval_shape(
            optimizers.make_optimizer(cfg, program.make_schedule(cfg)).init, params
        )
        records.append(
            {
                "kind": "state_bytes",
                "optimizer": opt,
                "fp8_state": fp8,
                "state_bytes": quant.state_bytes(state),
                "fp8_leaves": len(quantized_paths(state)) if cfg.fp8_state else None,
                "n_params": n,
                **stamp,
            }
        )
    return records


# The parameter shapes of docs/fp8_state.md's per-shape table: a vector and a scalar-sized
# matrix below a group, one narrow row or column, one group, a last axis 128 does not divide,
# a narrow last axis, a Llama-2-7B MLP weight.
SHAPES = ((3,), (1, 1), (512, 1), (1, 512), (128,), (7, 129), (512, 5), (4096, 11008))
# Each FP8 state of that table and the float32 states of its inner optimizers.
SHAPE_OPTIMIZERS = {
    "coat_adamw": lambda: coat_jax.coat_adamw(1e-3),
    "fp8_state(lion)": lambda: coat_jax.fp8_state(optax.lion(1e-3)),
    "adamw": lambda: optax.adamw(1e-3),
    "lion": lambda: optax.lion(1e-3),
}


def shape_bytes_records() -> list[dict]:
    """State bytes of one float32 parameter ``{"w": ...}`` of each of ``SHAPES`` under each of
    ``SHAPE_OPTIMIZERS``, from ``jax.eval_shape(tx.init, params)``: one ``"kind":
    "shape_state_bytes"`` record each (``derived.shape_bytes_table`` renders them)."""
    stamp = {**C.environment(), "command": C.command_line()}
    records = []
    for shape in SHAPES:
        params = {"w": jax.ShapeDtypeStruct(shape, jax.numpy.float32)}
        for name, make in SHAPE_OPTIMIZERS.items():
            state = jax.eval_shape(make().init, params)
            records.append(
                {
                    "kind": "shape_state_bytes",
                    "optimizer": name,
                    "shape": list(shape),
                    "state_bytes": quant.state_bytes(state),
                    **stamp,
                }
            )
    return records


def table(rows: list[dict]) -> str:
    by = {(r["optimizer"], r["fp8_state"]): r for r in rows}
    lines = [
        "| optimizer | learning rate | float32 state | FP8 state | FP8 - float32 |",
        "|---|---|---|---|---|",
    ]
    for opt in dict.fromkeys(r["optimizer"] for r in rows):
        f32, fp8 = by.get((opt, False)), by.get((opt, True))
        if f32 is None or fp8 is None:
            continue
        rel = (fp8["val_loss"] - f32["val_loss"]) / f32["val_loss"]
        lines.append(
            f"| {opt} | {f32['learning_rate']:g} | {f32['val_loss']:.4f} | {fp8['val_loss']:.4f} "
            f"| {100 * rel:+.2f}% |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", nargs="*", default=[], metavar="NAME=VALUE")
    parser.add_argument("--out", default="runs/fp8_state_accuracy")
    parser.add_argument(
        "--state-bytes",
        metavar="OUT",
        help="write the state-bytes records (Llama-2-7B tree, one parameter per shape) to "
        "OUT.jsonl, print their tables and exit",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = parser.parse_args(argv)
    if args.state_bytes:
        records = state_bytes_records() + shape_bytes_records()
        C.write_jsonl(args.state_bytes, records)
        print("\n".join(derived.state_bytes_table(records)))
        print("\n".join(derived.shape_bytes_table(records)))
        return 0
    lrs = dict(LEARNING_RATES)
    for item in args.lr:
        name, _, value = item.partition("=")
        if name not in lrs or not value:
            parser.error(f"--lr {item!r}: expected NAME=VALUE with NAME in {list(lrs)}")
        lrs[name] = float(value)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        parser.error(f"--out {str(out)!r} is not empty; choose a new directory")
    rows = []
    for opt in args.optimizers:
        for fp8 in (False, True):
            row = run(opt, fp8, steps=args.steps, lr=lrs[opt], out=out, extra=args.overrides)
            if not math.isfinite(row["val_loss"]):
                raise FloatingPointError(f"{opt} optimizer.fp8_state={fp8}: validation loss {row}")
            print(json.dumps(row), flush=True)
            rows.append(row)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    text = table(rows)
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

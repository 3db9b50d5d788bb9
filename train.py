"""Train or fine-tune a Llama with COAT (FP8 optimizer states and activations).

  python train.py                                        # the default: a tiny Llama, CPU-sized
  python train.py --config configs/smollm2_135m_finetune.yaml steps=200 output_dir=runs/smol
  python train.py output_dir=runs/default resume=true    # continue from the latest checkpoint
  python train.py steps=50 --print-config                # show the resolved config, run nothing
  python train.py --config configs/llama2_7b.yaml recipe=coat_max_batch data.batch_size=auto

Every key below can be set in the YAML file (in its section) or as key=value (section.key=value
for a sectioned key, e.g. precision.fp8_attention=true). Ctrl-C or SIGTERM saves a checkpoint
and stops. An error is one line on stderr (and in <output_dir>/train.log), with exit code 2 for
bad input, 3 for a diverged run. Afterwards:
  python -m coat_jax.generate runs/default "It is a truth"      # sample from the run
  python -m coat_jax.convert run-to-hf runs/default runs/hf     # export for transformers
"""

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from coat_jax.training import load_config, train
from coat_jax.training.cli import HELP_WIDTH, annotated_config, config_help, config_sources
from coat_jax.training.distributed import maybe_initialize
from coat_jax.training.errors import error_line, exit_code
from coat_jax.training.plan import format_plan, plan_memory, resolve_batch
from coat_jax.training.run import FIRST_STEP_THREAD

MEMORY_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog=config_help(),
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, width=HELP_WIDTH),
    )
    parser.add_argument(
        "--config",
        default=str(Path(__file__).resolve().parent / "configs" / "default.yaml"),
        help="YAML config file (default: configs/default.yaml)",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config as YAML, each value with its source (default, recipe, "
        "file, command line), and exit without training",
    )
    parser.add_argument(
        "--plan",
        nargs="?",
        const="",
        metavar="B1,B2,...",
        help="compile the train step without running it and print XLA's peak memory (params, "
        "optimizer state, activations, workspace) at these batch sizes (default: the config's) "
        "and the largest batch that fits the device; then exit",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = parser.parse_args(argv)
    if not any(os.environ.get(k) for k in ("XLA_CLIENT_MEM_FRACTION", MEMORY_FRACTION_ENV)):
        # JAX's allocator takes 75% of a GPU unless told; the shipped configs' batches
        # (docs/recipes.md) were measured with 95%, as every benchmark runs
        # (benchmarks/_common.py). Read when the first device is used, after this.
        os.environ[MEMORY_FRACTION_ENV] = "0.95"
    try:
        cfg = load_config(args.config, args.overrides)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(annotated_config(cfg, config_sources(cfg, args.config, args.overrides)))
        return 0
    try:
        # Before JAX uses a device: under a multi-process launcher (COAT_JAX_COORDINATOR, srun,
        # mpirun) every process joins one runtime and the mesh spans all their devices.
        maybe_initialize()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.plan is not None:
        return _plan(cfg, args.plan)
    try:
        result = train(cfg)
    except (Exception, KeyboardInterrupt) as e:
        # Bad input, a diverged run, a second signal: the message says what and what to do; a
        # traceback would only bury it. Other errors are bugs and keep theirs.
        code = exit_code(e)
        if code is None:
            raise
        print(error_line(e), file=sys.stderr)
        return code
    if result.stopped_by is not None:
        return 128 + signal.Signals[result.stopped_by].value
    return 0


def _plan(cfg, text: str) -> int:
    try:
        batches = [int(b) for b in text.split(",") if b.strip()] or None
    except ValueError:
        print(
            f"error: --plan {text!r} is not a comma-separated list of batch sizes", file=sys.stderr
        )
        return 2
    try:
        cfg = resolve_batch(cfg)
        rows, largest, limit = plan_memory(cfg, batches)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_plan(rows, largest, limit, cfg))
    return 0


if __name__ == "__main__":
    code = main()
    if any(t.name == FIRST_STEP_THREAD and t.is_alive() for t in threading.enumerate()):
        # Stopped while compiling the first step: an interpreter exit would tear XLA down
        # under that compilation and abort.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)

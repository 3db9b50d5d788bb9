"""Train or fine-tune a Llama with COAT (FP8 optimizer states and activations).

  python train.py                                        # the default: a tiny Llama, CPU-sized
  python train.py --config configs/smollm2_135m_finetune.yaml steps=200 output_dir=runs/smol
  python train.py output_dir=runs/default resume=true    # continue from the latest checkpoint

Every key of coat_jax.training.TrainConfig can be set in the YAML file or as key=value
(section.key=value for model.* and mesh.*). Ctrl-C or SIGTERM saves a checkpoint and stops.
"""

import argparse
import signal
import sys
from pathlib import Path

from coat_jax.training import load_config, train


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--config",
        default=str(Path(__file__).resolve().parent / "configs" / "default.yaml"),
        help="YAML config file (default: configs/default.yaml)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ValueError as e:
        parser.error(str(e))
    try:
        result = train(cfg)
    except ValueError as e:
        # Bad input (data path, checkpoint, sizes): the message says what and why; a traceback
        # would only bury it.
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if result.stopped_by is not None:
        return 128 + signal.Signals[result.stopped_by].value
    return 0


if __name__ == "__main__":
    sys.exit(main())

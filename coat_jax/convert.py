"""Convert Llama checkpoints between Hugging Face and coat-jax layouts, bit-exactly.

    python -m coat_jax.convert hf-to-jax SRC_HF_FOLDER DST_FOLDER
    python -m coat_jax.convert jax-to-hf SRC_COAT_JAX_FOLDER DST_FOLDER

Tensors stream one at a time with their dtypes kept; the output of jax-to-hf loads with
transformers' `LlamaForCausalLM.from_pretrained`.
"""

from __future__ import annotations

import argparse
import sys

from coat_jax.checkpoint_io import DEFAULT_MAX_SHARD_BYTES, convert

_COMMANDS = {"hf-to-jax": "coat-jax", "jax-to-hf": "hf"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coat_jax.convert", description=__doc__)
    parser.add_argument("command", choices=sorted(_COMMANDS))
    parser.add_argument("src", help="source checkpoint folder")
    parser.add_argument("dst", help="destination folder (new or empty)")
    parser.add_argument(
        "--max-shard-bytes",
        type=int,
        default=DEFAULT_MAX_SHARD_BYTES,
        help="split the weights into shards of at most this many bytes (default 4 GiB)",
    )
    args = parser.parse_args(argv)
    convert(args.src, args.dst, to=_COMMANDS[args.command], max_shard_bytes=args.max_shard_bytes)
    print(f"{args.command}: wrote {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

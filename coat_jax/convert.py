"""Convert Llama checkpoints between Hugging Face, coat-jax, GGUF and train.py runs.

commands:
  hf-to-jax SRC DST     a Hugging Face folder to the coat-jax layout (bit-exact)
  jax-to-hf SRC DST     a coat-jax folder back to Hugging Face (bit-exact)
  gguf-to-hf SRC DST    a Llama .gguf file to a Hugging Face folder with its tokenizer
  run-to-hf RUN DST     a train.py run's newest (or --step) checkpoint to a Hugging Face folder
                        with the run's tokenizer; only the parameters are read

Every Hugging Face folder written loads with transformers' LlamaForCausalLM.from_pretrained and
AutoTokenizer.from_pretrained. Tensors stream one at a time.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

EXAMPLES = """\
examples:
  python -m coat_jax.convert run-to-hf runs/default runs/default-hf
  python -m coat_jax.convert run-to-hf runs/smol runs/smol-hf --step 200 --dtype bfloat16
  python -m coat_jax.convert gguf-to-hf SmolLM2-135M-Instruct.Q4_1.gguf smollm2-hf
  python -m coat_jax.convert hf-to-jax path/to/Llama-3.2-1B llama32-coat-jax
  python -m coat_jax.convert jax-to-hf llama32-coat-jax llama32-hf --max-shard-bytes 2000000000
"""
DTYPE_HELP = {
    "gguf-to-hf": "weight dtype (default float32: every dequantized value exactly)",
    "run-to-hf": "weight dtype (default float32: the master weights bit for bit)",
}
# What each kind of source converts with, for errors that name the right command.
_COMMAND_FOR_KIND = {
    "hf": "hf-to-jax",
    "coat-jax": "jax-to-hf",
    "gguf": "gguf-to-hf",
    "run": "run-to-hf",
}


class ErrorParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line, ``error: <what>; <what to do>``."""

    def error(self, message):
        self.exit(2, f"error: {message}; see {self.prog} --help\n")


def one_line_error(error: Exception, advice: str) -> str:
    """``error: <what>; <what to do>`` on one line; `advice` when the message has none."""
    message = "; ".join(part.strip() for part in str(error).splitlines() if part.strip())
    if ";" not in message:
        message = f"{message}; {advice}"
    return f"error: {message}"


_DESCRIBED = {
    "hf": "a Hugging Face Llama folder (config.json + *.safetensors)",
    "coat-jax": "a coat-jax folder (coat_jax.json + config.json + *.safetensors)",
    "gguf": "a Llama .gguf file",
    "run": "a train.py output_dir (config.yaml + checkpoints/)",
}


def _kind(path: str) -> str | None:
    from coat_jax.checkpoint_io import checkpoint_kind
    from coat_jax.training.export import is_run_dir

    if is_run_dir(path):
        return "run"
    try:
        return checkpoint_kind(path)
    except ValueError:
        return None


def _check_source(command: str, src: str, want: str) -> None:
    """One-line errors for a source that does not exist or needs another command."""
    if not os.path.exists(src):
        raise ValueError(f"{src!r} does not exist; give the path of the source checkpoint")
    kind = _kind(src)
    if kind == want:
        return
    if kind is None:
        raise ValueError(f"{src!r} is not a checkpoint; {command} needs {_DESCRIBED[want]}")
    raise ValueError(
        f"{src!r} is {_DESCRIBED[kind]}, not {_DESCRIBED[want]}; convert it with: "
        f"python -m coat_jax.convert {_COMMAND_FOR_KIND[kind]} {src} DST"
    )


def _run(args) -> str:
    from coat_jax import checkpoint_io

    if args.command in ("hf-to-jax", "jax-to-hf"):
        want = "hf" if args.command == "hf-to-jax" else "coat-jax"
        _check_source(args.command, args.src, want)
        to = "coat-jax" if args.command == "hf-to-jax" else "hf"
        checkpoint_io.convert(args.src, args.dst, to=to, max_shard_bytes=args.max_shard_bytes)
        return f"{args.command}: wrote {args.dst}"
    if args.command == "gguf-to-hf":
        import jax.numpy as jnp

        _check_source(args.command, args.src, "gguf")
        dtype = {"float32": np.float32, "bfloat16": jnp.bfloat16}[args.dtype]
        checkpoint_io.gguf_to_hf(
            args.src, args.dst, dtype=dtype, max_shard_bytes=args.max_shard_bytes
        )
        return f"gguf-to-hf: wrote {args.dst} ({args.dtype} weights, tokenizer, chat template)"
    from coat_jax.training.export import export_run_to_hf

    _check_source(args.command, args.src, "run")
    result = export_run_to_hf(
        args.src,
        args.dst,
        step=args.step,
        dtype=args.dtype,
        max_shard_bytes=args.max_shard_bytes,
    )
    return (
        f"run-to-hf: wrote checkpoint step {result.step} of {args.src} to {result.dst} "
        f"({args.dtype} weights); tokenizer: {result.tokenizer_note}"
    )


def _parser() -> ErrorParser:
    from coat_jax.checkpoint_io import DEFAULT_MAX_SHARD_BYTES

    parser = ErrorParser(
        prog="python -m coat_jax.convert",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(
        dest="command",
        metavar="command",
        required=True,
        parser_class=ErrorParser,
        help="one of the commands above",
    )
    helps = {
        "hf-to-jax": ("a Hugging Face folder", "Hugging Face -> coat-jax, bit-exact"),
        "jax-to-hf": ("a coat-jax folder", "coat-jax -> Hugging Face, bit-exact"),
        "gguf-to-hf": ("a Llama .gguf file", "GGUF -> Hugging Face with the tokenizer"),
        "run-to-hf": ("a train.py output_dir", "a train.py run -> Hugging Face"),
    }
    for name, (src_help, summary) in helps.items():
        sub = commands.add_parser(
            name,
            description=summary,
            epilog=EXAMPLES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sub.add_argument("src", help=src_help)
        sub.add_argument("dst", help="destination folder (new or empty)")
        sub.add_argument(
            "--max-shard-bytes",
            type=int,
            default=DEFAULT_MAX_SHARD_BYTES,
            help="split the weights into shards of at most this many bytes (default 4 GiB)",
        )
        if name in DTYPE_HELP:
            sub.add_argument(
                "--dtype", choices=("float32", "bfloat16"), default="float32", help=DTYPE_HELP[name]
            )
        if name == "run-to-hf":
            sub.add_argument(
                "--step", type=int, default=None, help="checkpoint step (default: the newest)"
            )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        message = _run(args)
    except (ValueError, OSError) as e:
        # Bad input: the message names it and the fix; a traceback would only bury it.
        print(
            one_line_error(e, f"see python -m coat_jax.convert {args.command} --help"),
            file=sys.stderr,
        )
        return 2
    print(message)
    return 0


if __name__ == "__main__":
    sys.exit(main())

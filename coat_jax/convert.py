"""Convert checkpoints (any family of coat_jax.families) between Hugging Face, coat-jax, GGUF
and train.py runs.

commands:
  hf-to-jax SRC DST     a Hugging Face folder to the coat-jax layout (bit-exact)
  jax-to-hf SRC DST     a coat-jax folder back to Hugging Face (bit-exact)
  gguf-to-hf SRC DST    a Llama .gguf file to a Hugging Face folder with its tokenizer
  run-to-hf RUN DST     a train.py run's newest (or --step) checkpoint to a Hugging Face folder
                        with the run's tokenizer; only the parameters are read

Every Hugging Face folder written loads with its family's transformers class (LlamaForCausalLM,
Qwen2ForCausalLM, ...; AutoModelForCausalLM.from_pretrained) and
AutoTokenizer.from_pretrained. Tensors stream one at a time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from coat_jax import checkpoint_io
from coat_jax.checkpoint_io import (
    DEFAULT_MAX_SHARD_BYTES,
    copy_sidecars,
    save_pretrained,
    write_generation_config,
    write_tokenizer_files,
)
from coat_jax.command_line import ErrorParser, one_line_error
from coat_jax.llama import LlamaConfig
from coat_jax.runs import check_identity, is_run_dir, read_run, run_model, tokenizer_source
from coat_jax.tokenizer import load_tokenizer

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
EXPORT_DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16}
# The byte tokenizer's BOS and EOS (ids 256 and 257) as text, in its Hugging Face form.
BYTE_BOS, BYTE_EOS = "<|bos|>", "<|eos|>"
# What each kind of source converts with, for errors that name the right command.
_COMMAND_FOR_KIND = {
    "hf": "hf-to-jax",
    "coat-jax": "jax-to-hf",
    "gguf": "gguf-to-hf",
    "run": "run-to-hf",
}


_DESCRIBED = {
    "hf": "a Hugging Face Llama folder (config.json + *.safetensors)",
    "coat-jax": "a coat-jax folder (coat_jax.json + config.json + *.safetensors)",
    "gguf": "a Llama .gguf file",
    "run": "a train.py output_dir (config.yaml + checkpoints/)",
}


def _kind(path: str) -> str | None:
    if is_run_dir(path):
        return "run"
    try:
        return checkpoint_io.checkpoint_kind(path)
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
    if args.command in ("hf-to-jax", "jax-to-hf"):
        want = "hf" if args.command == "hf-to-jax" else "coat-jax"
        _check_source(args.command, args.src, want)
        to = "coat-jax" if args.command == "hf-to-jax" else "hf"
        checkpoint_io.convert(args.src, args.dst, to=to, max_shard_bytes=args.max_shard_bytes)
        return f"{args.command}: wrote {args.dst}"
    if args.command == "gguf-to-hf":
        _check_source(args.command, args.src, "gguf")
        dtype = EXPORT_DTYPES[args.dtype]
        checkpoint_io.gguf_to_hf(
            args.src, args.dst, dtype=dtype, max_shard_bytes=args.max_shard_bytes
        )
        return f"gguf-to-hf: wrote {args.dst} ({args.dtype} weights, tokenizer, chat template)"
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


# ----------------------------------------------------------------------------- byte tokenizer


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table, the one `tokenizers`' ByteLevel uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def byte_tokenizer_hf():
    """`coat_jax.ByteTokenizer` as a transformers fast tokenizer with the same ids.

    Bytes 0..255 are tokens 0..255 (a byte-level BPE vocabulary of single bytes and no merges),
    BOS and EOS are the special tokens 256 and 257 (``<|bos|>``, ``<|eos|>``); like the byte
    tokenizer it adds neither on its own, and special-token text in the input stays bytes.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: b for b, c in enumerate(_gpt2_byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (BYTE_BOS, BYTE_EOS)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BYTE_BOS, eos_token=BYTE_EOS, split_special_tokens=True
    )


# ----------------------------------------------------------------------------- export


@dataclasses.dataclass(frozen=True)
class ExportResult:
    step: int
    dst: Path
    config: LlamaConfig
    tokenizer_note: str


def export_run_to_hf(
    run_dir: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    step: int | None = None,
    dtype: str = "float32",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> ExportResult:
    """Writes a run's checkpoint as a Hugging Face folder that transformers loads (the
    class of the run's model family).

    Args:
      run_dir: the run's output_dir.
      dst: a new or empty folder.
      step: the checkpoint step; None means the newest.
      dtype: "float32" (the master weights, bit for bit) or "bfloat16".
      max_shard_bytes: above this the weights are split into shards plus an index.

    Returns:
      The step, folder and config written, and a sentence saying where the tokenizer came from.
    """
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {list(EXPORT_DTYPES)}")
    run = read_run(run_dir, step=step)
    source = tokenizer_source(run)
    tokenizer = byte_tokenizer_hf() if source is None else load_tokenizer(source)
    if source is not None:
        check_identity(run, tokenizer, source)
    model = run_model(run, dtype=jnp.float32)
    dst = Path(dst).expanduser()
    save_pretrained(
        model, dst, format="hf", dtype=EXPORT_DTYPES[dtype], max_shard_bytes=max_shard_bytes
    )
    if source is None:
        files = write_tokenizer_files(tokenizer, dst)
        note = (
            "the byte tokenizer (UTF-8 bytes = ids 0..255, <|bos|> 256, <|eos|> 257) as an "
            f"equivalent Hugging Face tokenizer: {', '.join(files)}"
        )
    elif os.path.isfile(source):
        files = write_tokenizer_files(tokenizer, dst)
        note = f"the tokenizer of {source}, rebuilt from its GGUF metadata: {', '.join(files)}"
    else:
        before = set(os.listdir(dst))
        copy_sidecars(source, dst)
        write_generation_config(tokenizer, dst)
        files = sorted(set(os.listdir(dst)) - before)
        note = f"the tokenizer files of {source}: {', '.join(files)}"
    return ExportResult(step=run.step, dst=dst, config=run.config, tokenizer_note=note)


# ----------------------------------------------------------------------------- command line


def _parser() -> ErrorParser:
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

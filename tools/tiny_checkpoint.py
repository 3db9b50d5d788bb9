"""Write a tiny random Hugging Face checkpoint of a model family, for fine-tuning on a CPU.

  python -m tools.tiny_checkpoint qwen2 runs/qwen2_tiny_hf
  python train.py --config configs/qwen2_tiny_finetune.yaml

The folder loads in the family's transformers class (``AutoModelForCausalLM``) and in
``train.py init_from=``; its vocabulary is the byte tokenizer's (258 ids), so the run trains on
the bundled corpus with ``tokenizer: byte``.
"""

from __future__ import annotations

import argparse
import os
import sys

from flax import nnx

from coat_jax.checkpoint_io import save_pretrained
from coat_jax.families import FAMILIES
from coat_jax.llama import Llama, LlamaConfig

# Small enough for a CPU run of a few minutes, with GQA and a head_dim apart from hidden/heads.
TINY = dict(
    vocab_size=258,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rms_norm_eps=1e-5,
    max_position_embeddings=2048,
)


def write_tiny_checkpoint(model_type: str, dst: str | os.PathLike, seed: int = 0) -> LlamaConfig:
    """Writes a random ``model_type`` model of :data:`TINY`'s size as an HF folder ``dst``;
    embeddings are tied for Qwen2, as its small models are. Returns its config."""
    tied = model_type == "qwen2"
    config = LlamaConfig(**TINY, model_type=model_type, tie_word_embeddings=tied)
    save_pretrained(Llama(config, rngs=nnx.Rngs(seed)), dst, format="hf")
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", choices=sorted(FAMILIES), help="Hugging Face model_type")
    parser.add_argument("dst", help="a new or empty folder")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = write_tiny_checkpoint(args.family, args.dst, args.seed)
    print(f"wrote a random {config.model_type} model to {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

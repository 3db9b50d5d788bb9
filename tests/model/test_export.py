"""Exporting train.py runs (`convert run-to-hf`) and GGUF files to Hugging Face folders that
transformers loads with the same logits; the convert CLI's one-line errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from coat_jax.convert import byte_tokenizer_hf
from coat_jax.convert import main as convert_main
from coat_jax.runs import CheckpointError, load_run_model, read_params, read_run
from coat_jax.tokenizer import ByteTokenizer
from coat_jax.training import load_config, train
from tests.training.test_train import REPO, TINY, cache_overrides

TEXT = "It is a truth universally acknowledged, that a single man — «déjà vu» ✓ <|eos|>"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two tiny runs, unrolled and scanned layers, with checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("export")
    out = {}
    # The scanned run in plain bf16 with optax.adamw: the layout, not the precision, is tested.
    scanned = ["memory.scan_layers=true", "precision.mode=bf16", "optimizer.name=adamw"]
    for name, extra in (("unrolled", []), ("scanned", scanned)):
        cfg = load_config(
            REPO / "configs" / "default.yaml",
            [
                *TINY,
                *cache_overrides(root / "caches"),
                f"output_dir={root / name}",
                "steps=4",
                "checkpoint.every=2",
                *extra,
            ],
        )
        train(cfg)
        out[name] = root / name
    return out


def _hf_logits(folder, ids, dtype="float32"):
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.float().numpy()


@pytest.mark.parametrize("layout", ["unrolled", "scanned"])
def test_run_export_matches_in_transformers(runs, tmp_path, layout):
    from transformers import AutoTokenizer

    run, dst = runs[layout], tmp_path / "hf"
    assert convert_main(["run-to-hf", str(run), str(dst)]) == 0
    ids = np.asarray([ByteTokenizer().encode(TEXT)[:96]], np.int64)
    model, tok = load_run_model(run, dtype=jnp.float32)
    ours = np.asarray(model(jnp.asarray(ids)))
    theirs = _hf_logits(dst, ids)
    assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(ours).max()
    # The byte tokenizer's Hugging Face form encodes and decodes as the run's tokenizer did.
    hf_tok = AutoTokenizer.from_pretrained(dst)
    assert hf_tok(TEXT)["input_ids"] == tok.encode(TEXT)
    assert hf_tok.decode(tok.encode(TEXT)) == TEXT
    assert json.loads((dst / "generation_config.json").read_text())["eos_token_id"] == 257
    config = json.loads((dst / "config.json").read_text())
    assert config["hidden_size"] == 64 and config["num_hidden_layers"] == 2


def test_step_and_dtype_choice(runs, tmp_path):
    run = runs["unrolled"]
    assert read_run(run).step == 4 and read_run(run, step=2).step == 2
    older, _ = read_params(run, 2)
    newer, _ = read_params(run, 4)
    assert not np.array_equal(older["embed_tokens"], newer["embed_tokens"])
    dst = tmp_path / "bf16"
    assert (
        convert_main(["run-to-hf", str(run), str(dst), "--step", "2", "--dtype", "bfloat16"]) == 0
    )
    with safe_open(dst / "model.safetensors", framework="numpy") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    assert embed.dtype == jnp.bfloat16
    np.testing.assert_array_equal(embed, older["embed_tokens"].astype(jnp.bfloat16))
    with pytest.raises(CheckpointError, match=r"no checkpoint step 3 .*steps: \[2, 4\]"):
        read_params(run, 3)


def test_generate_cli_on_a_run(runs):
    proc = subprocess.run(
        [sys.executable, "-m", "coat_jax.generate", str(runs["unrolled"]), "It is", "Mr."]
        + ["--max-new-tokens", "8", "--temperature", "0.8", "--top-p", "0.9"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("It is") and any(line.startswith("Mr.") for line in lines)


def test_byte_tokenizer_hf_equals_the_byte_tokenizer():
    hf, byte = byte_tokenizer_hf(), ByteTokenizer()
    every_byte = bytes(range(256)).decode("latin-1") + "ünï©ødé 😀\n\t\r "
    assert hf(every_byte)["input_ids"] == byte.encode(every_byte)
    assert hf.decode(byte.encode(every_byte)) == every_byte
    assert (hf.bos_token_id, hf.eos_token_id, len(hf)) == (256, 257, 258)


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "coat_jax.convert", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["hf-to-jax", "{gguf}", "{out}"],
            r"is a Llama \.gguf file, not a Hugging Face .*gguf-to-hf",
        ),
        (["hf-to-jax", "{run}", "{out}"], r"is a train\.py output_dir .*run-to-hf"),
        (["gguf-to-hf", "{tmp}/missing.gguf", "{out}"], r"does not exist; give the path"),
        (["run-to-hf", "{tmp}", "{out}"], r"is not a checkpoint; run-to-hf needs a train\.py"),
        (["run-to-hf", "{run}", "{out}", "--step", "3"], r"no checkpoint step 3 .*steps: \[2, 4\]"),
        (["run-to-hf", "{run}", "{out}", "--dtype", "fp16"], r"invalid choice: 'fp16'"),
        (["to-gguf", "{run}", "{out}"], r"invalid choice: 'to-gguf'.*; see python -m"),
        (["run-to-hf", "{run}"], r"the following arguments are required: dst"),
    ],
)
def test_convert_errors_are_one_line(runs, tmp_path, args, message):
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    subs = {"gguf": gguf, "out": tmp_path / "out", "run": runs["unrolled"], "tmp": tmp_path}
    proc = _cli(*(a.format(**subs) for a in args))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("error: ") and "; " in proc.stderr
    assert re.search(message, proc.stderr), proc.stderr


def test_convert_help_has_formatted_examples():
    proc = _cli("--help")
    assert proc.returncode == 0
    assert "\nexamples:\n  python -m coat_jax.convert run-to-hf runs/default" in proc.stdout
    assert "  run-to-hf RUN DST " in proc.stdout

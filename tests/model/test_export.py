"""Exporting train.py runs (`convert run-to-hf`) and GGUF files to Hugging Face folders that
transformers loads with the same logits; the convert CLI's one-line errors."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from coat_jax.convert import byte_tokenizer_hf
from coat_jax.convert import main as convert_main
from coat_jax.generate import main as generate_main
from coat_jax.runs import CheckpointError, load_run_model, read_params, read_run
from coat_jax.tokenizer import ByteTokenizer
from coat_jax.training import load_config, train
from tests.training.test_train import REPO, TINY, cache_overrides
from tests.untraced import without_tracer

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


@without_tracer  # transformers' code only
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


def test_generate_cli_on_a_run(runs, capsys):
    # In this process: docs/quickstart.md's sampling command runs as a program in
    # tests/training/test_user_path.py.
    argv = [str(runs["unrolled"]), "It is", "Mr."]
    argv += ["--max-new-tokens", "8", "--temperature", "0.8", "--top-p", "0.9"]
    assert generate_main(argv) == 0, capsys.readouterr().err
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("It is") and any(line.startswith("Mr.") for line in lines)


def test_byte_tokenizer_hf_equals_the_byte_tokenizer():
    hf, byte = byte_tokenizer_hf(), ByteTokenizer()
    every_byte = bytes(range(256)).decode("latin-1") + "ünï©ødé 😀\n\t\r "
    assert hf(every_byte)["input_ids"] == byte.encode(every_byte)
    assert hf.decode(byte.encode(every_byte)) == every_byte
    assert (hf.bos_token_id, hf.eos_token_id, len(hf)) == (256, 257, 258)


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
def test_convert_errors_are_one_line(runs, tmp_path, capsys, args, message):
    # The command's own function, in this process (the program runs in
    # tests/model/test_convert.py); a traceback would fail the test.
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    subs = {"gguf": gguf, "out": tmp_path / "out", "run": runs["unrolled"], "tmp": tmp_path}
    try:
        code = convert_main([a.format(**subs) for a in args])
    except SystemExit as usage_error:
        code = usage_error.code
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1
    assert stderr.startswith("error: ") and "; " in stderr
    assert re.search(message, stderr), stderr


def test_convert_help_has_formatted_examples(capsys):
    with pytest.raises(SystemExit) as done:
        convert_main(["--help"])
    assert done.value.code == 0
    stdout = capsys.readouterr().out
    assert "\nexamples:\n  python -m coat_jax.convert run-to-hf runs/default" in stdout
    assert "  run-to-hf RUN DST " in stdout

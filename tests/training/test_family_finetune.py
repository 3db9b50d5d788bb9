"""A family other than Llama fine-tuned by the trainer from a tiny random checkpoint that
tools/tiny_checkpoint.py writes, with configs/qwen2_tiny_finetune.yaml, on the CPU."""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from coat_jax.checkpoint_io import from_pretrained, read_config
from coat_jax.convert import main as convert_main
from coat_jax.llama import LlamaConfig
from coat_jax.training import load_config, train
from coat_jax.training.model import llama_config_dict, llama_config_from_dict
from tests.tiny_runs import compilation_cache
from tools.tiny_checkpoint import write_tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]
QUICK = [
    "data.seq_len=32",
    "data.batch_size=4",
    "optimizer.warmup_steps=1",
    "logging.every=1",
    "eval.every=1000",
    "checkpoint.every=1000",
    "logging.progress_bar=false",
    "logging.sample_prompt=null",
]


def test_qwen2_fine_tunes_from_init_from_resumes_bit_for_bit_and_exports(tmp_path):
    write_tiny_checkpoint("qwen2", tmp_path / "hf")
    assert read_config(tmp_path / "hf").family.qkv_bias

    def config(out, *extra):
        overrides = [f"init_from={tmp_path / 'hf'}", f"output_dir={tmp_path / out}", *QUICK]
        overrides += [
            f"data.cache_dir={tmp_path}/tokens",
            compilation_cache(f"{tmp_path}/jax"),
        ]
        return load_config(REPO / "configs" / "qwen2_tiny_finetune.yaml", [*overrides, *extra])

    straight = train(config("straight", "steps=3", "checkpoint.every=2"))
    records = (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()
    losses = [r["loss"] for r in map(json.loads, records) if "loss" in r]
    assert len(losses) == 3 and np.isfinite(losses).all()
    # The straight run's folder without its step-3 checkpoint: that run stopped after step 2.
    shutil.copytree(tmp_path / "straight", tmp_path / "split")
    shutil.rmtree(tmp_path / "split" / "checkpoints" / "3")
    resumed = train(config("split", "steps=3", "resume=true"))
    assert resumed.step == 3
    as_bytes = lambda tree: [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]
    assert as_bytes(resumed.params) == as_bytes(straight.params)
    assert as_bytes(resumed.opt_state) == as_bytes(straight.opt_state)

    # run-to-hf: transformers loads Qwen2ForCausalLM with the run's weights, biases included,
    # and gives coat-jax's float32 logits.
    import torch
    import transformers

    assert convert_main(["run-to-hf", str(tmp_path / "straight"), str(tmp_path / "export")]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert type(reloaded).__name__ == "Qwen2ForCausalLM"
    bias = reloaded.model.layers[0].self_attn.q_proj.bias.detach().numpy()
    assert np.abs(bias).max() > 0  # trained away from its zero start
    ids = np.arange(24, dtype=np.int32)[None] % 258
    want = from_pretrained(tmp_path / "export", dtype=jnp.float32)(jnp.asarray(ids))
    with torch.no_grad():
        got = reloaded(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-4, atol=1e-4)


def test_the_checkpoint_fingerprint_names_a_family_only_beyond_llama():
    """A Llama's architecture is recorded without the family keys, as before there were
    families, so its checkpoints resume; any other family's round-trips with them."""
    llama = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
    )
    assert not {"model_type", "sliding_window"} & set(llama_config_dict(llama))
    assert llama_config_from_dict(llama_config_dict(llama)) == llama
    mistral = dataclasses.replace(llama, model_type="mistral", sliding_window=4096)
    assert llama_config_dict(mistral)["model_type"] == "mistral"
    assert llama_config_from_dict(llama_config_dict(mistral)) == mistral

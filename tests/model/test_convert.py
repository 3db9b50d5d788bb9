"""Checkpoint conversion and loading: bit-exact round trips, sharding and clear errors."""

import copy
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from coat_jax.checkpoint_io import convert, from_pretrained, save_pretrained
from coat_jax.convert import main as convert_main
from coat_jax.tokenizer import ByteTokenizer, load_tokenizer
from tests.llama_reference import hf_llama, rel_err, token_ids, torch_logits


def _tensors(folder) -> dict[str, np.ndarray]:
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), framework="numpy") as f:
                for key in f.keys():
                    assert key not in out
                    out[key] = f.get_tensor(key)
    return out


def _assert_bit_equal(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert a[key].tobytes() == b[key].tobytes(), key


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """A bf16 HF checkpoint (the usual release dtype) with a tokenizer, and its torch model."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = hf_llama("gqa_tied_llama3").to(torch.bfloat16)
    folder = tmp_path_factory.mktemp("hf_bf16")
    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(folder)
    return folder, model


def test_hf_to_jax_to_hf_is_bit_exact_and_loads_in_transformers(bf16_checkpoint, tmp_path):
    import torch
    from transformers import LlamaForCausalLM

    src, torch_model = bf16_checkpoint
    jax_dir, back_dir = tmp_path / "jax", tmp_path / "back"
    # Small shards force the sharded layout (index + several files) on both sides.
    assert convert_main(["hf-to-jax", str(src), str(jax_dir), "--max-shard-bytes", "40000"]) == 0
    assert (jax_dir / "model.safetensors.index.json").is_file()
    assert len(list(jax_dir.glob("model-*-of-*.safetensors"))) > 1
    jax_tensors = _tensors(jax_dir)
    # [out, in] in HF, [in, out] in coat-jax: k_proj has 2 kv heads of 8 dims.
    assert jax_tensors["layers.0.self_attn.k_proj"].shape == (64, 2 * 8)
    assert convert_main(["jax-to-hf", str(jax_dir), str(back_dir)]) == 0
    _assert_bit_equal(_tensors(src), _tensors(back_dir))
    # A second round trip reproduces the coat-jax files too.
    again = tmp_path / "again"
    convert_main(["hf-to-jax", str(back_dir), str(again)])
    _assert_bit_equal(jax_tensors, _tensors(again))

    # Compared with transformers' own reload of the source: a model cast with .to(bfloat16) in
    # memory keeps float32 RoPE buffers and differs from any reload.
    reloaded = LlamaForCausalLM.from_pretrained(back_dir, dtype=torch.bfloat16).eval()
    original = LlamaForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    ids = token_ids(torch_model.config.vocab_size, 1, 64, seed=5)
    np.testing.assert_array_equal(torch_logits(reloaded, ids), torch_logits(original, ids))
    assert load_tokenizer(back_dir)("t5 t7")["input_ids"] == [5, 7]
    assert load_tokenizer(jax_dir)("t9")["input_ids"] == [9]


def test_cli_entry_point(bf16_checkpoint, tmp_path, capsys):
    src, _ = bf16_checkpoint
    dst = tmp_path / "cli"
    run = subprocess.run(
        [sys.executable, "-m", "coat_jax.convert", "hf-to-jax", str(src), str(dst)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads((dst / "coat_jax.json").read_text())["format"] == "coat-jax"
    # A bad source: the command's own function, in this process (the program runs above).
    assert convert_main(["gguf-to-hf", str(src), str(dst)]) == 2
    assert "not a Llama .gguf file; convert it with" in capsys.readouterr().err


def test_every_format_loads_to_the_same_model(bf16_checkpoint, tmp_path):
    src, torch_model = bf16_checkpoint
    sharded_hf = tmp_path / "sharded_hf"
    jax_dir = tmp_path / "jax"
    convert_main(["hf-to-jax", str(src), str(jax_dir)])
    convert_main(["jax-to-hf", str(jax_dir), str(sharded_hf), "--max-shard-bytes", "30000"])
    assert (sharded_hf / "model.safetensors.index.json").is_file()
    ids = jnp.asarray(token_ids(torch_model.config.vocab_size, 1, 200, seed=6))
    want = np.asarray(from_pretrained(src, dtype=jnp.float32)(ids))
    for folder in (sharded_hf, jax_dir):
        got = from_pretrained(folder, dtype=jnp.float32)(ids)
        np.testing.assert_array_equal(got, want)
    # bf16 weights widen exactly to float32, so the float32 forward matches torch's.
    torch_f32 = torch_logits(copy.deepcopy(torch_model).float(), np.asarray(ids))
    assert rel_err(want, torch_f32) <= 1e-4


def test_save_pretrained_from_a_model(tmp_path):
    import torch
    from transformers import LlamaForCausalLM

    torch_model = hf_llama("mha_untied")
    torch_model.save_pretrained(tmp_path / "src")
    model = from_pretrained(tmp_path / "src", dtype=jnp.float32)
    save_pretrained(model, tmp_path / "hf", format="hf")
    save_pretrained(model, tmp_path / "cj", format="coat-jax", dtype=jnp.bfloat16)
    _assert_bit_equal(_tensors(tmp_path / "src"), _tensors(tmp_path / "hf"))
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = token_ids(320, 1, 50, seed=7)
    np.testing.assert_array_equal(torch_logits(reloaded, ids), torch_logits(torch_model, ids))
    assert {t.dtype for t in _tensors(tmp_path / "cj").values()} == {np.dtype(jnp.bfloat16)}
    with pytest.raises(ValueError, match=r"format='gguf' is not one of \['hf', 'coat-jax'\]"):
        save_pretrained(model, tmp_path / "x", format="gguf")
    with pytest.raises(FileExistsError, match="already holds weights"):
        save_pretrained(model, tmp_path / "hf")


@pytest.fixture
def f32_folder(tmp_path):
    folder = tmp_path / "hf"
    hf_llama("mha_untied", num_hidden_layers=1).save_pretrained(folder)
    return folder


def _edit_weights(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_tensor_is_named(f32_folder):
    _edit_weights(f32_folder, lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*model\.layers\.0\.mlp\.up_proj\.weight"):
        from_pretrained(f32_folder)


def test_wrong_shape_is_named(f32_folder):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][
            :8
        ]

    _edit_weights(f32_folder, shrink)
    with pytest.raises(ValueError, match=r"k_proj\.weight' has shape \(64, 8\).*needs \(64, 64\)"):
        from_pretrained(f32_folder)


def test_unexpected_tensor_is_named(f32_folder):
    _edit_weights(f32_folder, lambda t: t.update({"model.layers.0.extra.bias": np.zeros(3)}))
    with pytest.raises(ValueError, match=r"does not use.*model\.layers\.0\.extra\.bias"):
        from_pretrained(f32_folder)


def test_tied_lm_head_copy_must_equal_the_embedding(tmp_path):
    folder = tmp_path / "tied"
    hf_llama("gqa_tied_llama3", num_hidden_layers=1).save_pretrained(folder)
    embed = load_file(folder / "model.safetensors")["model.embed_tokens.weight"]
    _edit_weights(folder, lambda t: t.update({"lm_head.weight": embed.copy()}))
    from_pretrained(folder)
    _edit_weights(folder, lambda t: t.update({"lm_head.weight": embed + 1}))
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        from_pretrained(folder)


def test_not_a_llama(f32_folder, tmp_path):
    cfg = json.loads((f32_folder / "config.json").read_text())
    (f32_folder / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))
    with pytest.raises(ValueError, match="model_type='gpt_neox' is not supported; valid: "):
        from_pretrained(f32_folder)
    with pytest.raises(ValueError, match="is not a Llama checkpoint"):
        from_pretrained(tmp_path / "empty")
    with pytest.raises(ValueError, match=r"precision='int8' is not one of"):
        from_pretrained(f32_folder, precision="int8")


def test_conversion_direction_is_checked(f32_folder, tmp_path, capsys):
    assert convert_main(["jax-to-hf", str(f32_folder), str(tmp_path / "out")]) == 2
    assert "is a Hugging Face Llama folder" in capsys.readouterr().err
    with pytest.raises(ValueError, match="converting to hf needs a coat-jax checkpoint"):
        convert(f32_folder, tmp_path / "out", to="hf")


def test_byte_tokenizer():
    tok = ByteTokenizer()
    ids = tok.encode("héllo ✓", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert max(ids[1:-1]) < 256 and len(ids) == 2 + len("héllo ✓".encode())
    assert tok.decode(ids) == "héllo ✓"
    with pytest.raises(ValueError, match=r"token ids \[300\] are outside 0\.\.257"):
        tok.decode([300])

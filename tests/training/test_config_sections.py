"""The config grouped by concern: one table of key names, flat (unsectioned) keys refused
with their new names, --help by section, the FP8 options' one default, saved configs of both
layouts."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from coat_jax import recipes
from coat_jax.fp8_ops import FP8Config
from coat_jax.runs import saved_run_settings
from coat_jax.training.cli import annotated_config, config_help, config_keys, config_sources
from coat_jax.training.config import TrainConfig, load_config, to_dict
from coat_jax.training.config_names import MOVED, NAME_OF_FIELD, SECTIONS, field_of, flatten


def test_every_field_has_one_name_and_every_name_one_field():
    fields = {f.name for f in dataclasses.fields(TrainConfig)} - {"model", "mesh"}
    assert set(NAME_OF_FIELD) == fields
    assert len(set(NAME_OF_FIELD.values())) == len(NAME_OF_FIELD)
    assert {field_of(name) for name in NAME_OF_FIELD.values()} == fields
    for recipe in recipes.RECIPES:
        assert all(field_of(key) for key in recipes.settings(recipe)), recipe


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_flat_key_of_an_earlier_version_names_its_new_key(old, tmp_path):
    new = MOVED[old]
    line = f"`{old}` is now `{new}`"
    with pytest.raises(ValueError, match=f"^{line}") as raised:
        load_config(None, [f"{old}=1"])
    assert "\n" not in str(raised.value) and "train.py --help" in str(raised.value)
    path = tmp_path / "old.yaml"
    path.write_text(f"steps: 5\n{old}: 1\n")
    with pytest.raises(ValueError, match=f"^{line}"):
        load_config(path)


def test_sections_and_dotted_keys_spell_the_same_config():
    nested = {"precision": {"mode": "bf16"}, "data": {"batch_size": 4}, "mesh": {"fsdp": 1}}
    dotted = {"precision.mode": "bf16", "data.batch_size": 4, "mesh.fsdp": 1}
    assert (
        flatten(nested)
        == flatten(dotted)
        == {
            "precision": "bf16",
            "batch_size": 4,
            "mesh": {"fsdp": 1},
        }
    )
    with pytest.raises(ValueError, match=r"unknown config key\(s\) data.batch; did you mean"):
        flatten({"data": {"batch": 4}})
    cfg = load_config(None, ["precision.mode=bf16", "kernels.optimizer=xla"])
    saved = yaml.safe_load(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    assert list(saved) == [k for k in SECTIONS[""]] + [s for s in SECTIONS if s]
    assert saved["kernels"] == {"optimizer": "xla"} and saved["precision"]["mode"] == "bf16"
    assert load_config(None, [f"{k}={v}" for k, v in _dotted(saved)]) == cfg


def _dotted(mapping, prefix=""):
    for key, value in mapping.items():
        if isinstance(value, dict) and key != "kernels" and prefix + key != "model.rope_scaling":
            yield from _dotted(value, f"{prefix}{key}.")
        else:
            yield prefix + key, yaml.safe_dump(value, default_flow_style=True).strip()


def test_print_config_names_each_source_under_the_new_names():
    overrides = ["kernels.swiglu=xla", "optimizer.learning_rate=0.01"]
    cfg = load_config(None, overrides)
    sources = config_sources(cfg, None, overrides)
    assert sources["kernels"] == sources["optimizer.learning_rate"] == "command line"
    assert sources["precision.mode"] == sources["precision.fp8_weight_residual"] == "recipe coat"
    assert sources["data.batch_size"] == sources["mesh.fsdp"] == "default"
    printed = annotated_config(cfg, sources)
    assert yaml.safe_load(printed) == to_dict(cfg)
    assert "kernels: {swiglu: xla}" in printed and "  learning_rate: 0.01" in printed


def test_help_is_grouped_by_section_in_100_columns():
    text = config_help()
    assert max(len(line) for line in text.splitlines()) <= 100
    headers = [line for line in text.splitlines() if line.endswith(":") and " " not in line]
    assert headers == [f"{s}:" for s in SECTIONS if s]
    assert "run (top-level keys):" in text
    assert [d.name for d in config_keys()][:2] == ["recipe", "steps"]


def test_the_fp8_options_take_fp8configs_defaults():
    fp8, cfg = FP8Config(), TrainConfig()
    for option in ("weight_residual", "group_scale", "swiglu", "attention_backward"):
        assert getattr(cfg, f"fp8_{option}") == getattr(fp8, option), option
    assert cfg.fp8_linear_scaling == fp8.linear_scaling
    # The trainer's measured setting is the recipes', shown as theirs by --print-config.
    assert load_config(None).fp8_weight_residual == "once" != fp8.weight_residual


def test_a_saved_config_of_either_layout_names_tokenizer_and_init_from(tmp_path):
    path = tmp_path / "config.yaml"
    new = to_dict(load_config(None, ["data.tokenizer=init_from", "init_from=x"]))
    path.write_text(yaml.safe_dump(new))
    assert saved_run_settings(path) == {
        "tokenizer": "init_from",
        "init_from": "x",
        "compute_dtype": "bfloat16",
    }
    old = "tokenizer: byte\ninit_from: null\ncompute_dtype: float32\nsteps: 3\n"  # old flat key
    path.write_text(old)
    got = saved_run_settings(path)
    assert (got["tokenizer"], got["init_from"], got["compute_dtype"]) == ("byte", None, "float32")
    path.write_text("steps: 5\n")
    with pytest.raises(ValueError, match="lacks tokenizer or init_from"):
        saved_run_settings(path)

"""train.py's command line (--help generated from the config, --print-config), run in this
process (tests/training/test_train.py runs it as a process), and TensorBoard logging in
MetricsLog."""

from __future__ import annotations

import struct
import sys

import pytest
import yaml

from coat_jax.training.cli import DESCRIPTIONS, NO_DESCRIPTION, config_keys
from coat_jax.training.config import load_config, to_dict
from coat_jax.training.metrics import MetricsLog
from tests.training.test_train import REPO


def test_every_config_key_is_described_and_no_stale_descriptions():
    keys = config_keys()
    names = [k.name for k in keys]
    assert {"steps", "model.hidden_size", "mesh.fsdp", "optimizer.name"} <= set(names)
    assert [k.name for k in keys if k.meaning == NO_DESCRIPTION] == []
    assert sorted(set(DESCRIPTIONS) - set(names)) == []
    by_name = {k.name: k for k in keys}
    assert (by_name["steps"].type, by_name["steps"].default) == ("int", 600)
    assert by_name["precision.mode"].type == "bf16|fp8|coat"
    assert by_name["optimizer.grad_clip"].type == "float or null"


def test_train_help_lists_every_key_and_print_config_resolves(train_py):
    code, help_text, _ = train_py("--help")
    assert code == 0
    for key in config_keys():
        assert f"\n  {key.name} " in help_text, key.name
    assert max(len(line) for line in help_text.splitlines()) <= 100
    assert (
        "model.hidden_size" in help_text and "int, 128: width of the residual stream" in help_text
    )
    overrides = ["steps=7", "optimizer.warmup_steps=1", "model.hidden_size=96", "mesh.fsdp=1"]
    code, out, err = train_py("--print-config", *overrides)
    assert code == 0, err
    printed = yaml.safe_load(out)
    assert printed == to_dict(load_config(REPO / "configs" / "default.yaml", overrides))
    assert printed["steps"] == 7 and printed["model"]["hidden_size"] == 96


def test_removed_options_leave_the_help_and_are_refused_in_one_line(train_py):
    _, help_text, _ = train_py("--help")
    for removed in ("fp8_codes_barrier", "fp8_gemm_output", "interpret"):
        assert removed not in help_text, removed
    for override, replaced in [
        ("fp8_codes_barrier=false", "always on"),
        ("fp8_gemm_output=float32", "always write BF16"),
        ("kernels=interpret", "use kernels=auto, xla or pallas"),
    ]:
        code, _, err = train_py(override)
        assert code == 2, (override, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and replaced in lines[0], lines


def test_a_yaml_syntax_error_is_one_line_and_exit_2(tmp_path, train_py):
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 10\nmodel: [hidden_size: 64\n")
    with pytest.raises(ValueError, match="is not valid YAML at line 3, column 1") as info:
        load_config(bad, [])
    assert "\n" not in str(info.value)
    code, _, err = train_py("--config", str(bad))
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "not valid YAML" in lines[0] and str(bad) in lines[0], lines
    assert not (tmp_path / "runs").exists()


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Scalars of TensorBoard event files, read with tensorboardX's protos (TFRecord framing)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_metrics_log_writes_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboardX")
    tb = tmp_path / "tb"
    log = MetricsLog(tmp_path / "metrics.jsonl", resume_step=None, tensorboard_dir=tb)
    log.write({"step": 1, "loss": 5.5, "tokens_per_sec": None, "grad_norm": 2.0})
    log.write({"step": 2, "loss": 4.5, "grad_norm": 1.5})
    log.write({"step": 2, "val_loss": 4.25, "val_perplexity": 70.1})
    log.close()
    scalars = _scalars(tb)
    assert scalars["loss"] == [(1, 5.5), (2, 4.5)]
    assert scalars["grad_norm"] == [(1, 2.0), (2, 1.5)]
    assert scalars["val_loss"] == [(2, 4.25)] and "tokens_per_sec" not in scalars
    assert [r["step"] for r in log.read()] == [1, 2, 2]


def test_tensorboard_without_tensorboardx_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(
        ValueError, match=r"needs tensorboardX; pip install 'coat-jax\[tensorboard\]'"
    ):
        MetricsLog(tmp_path / "m.jsonl", resume_step=None, tensorboard_dir=tmp_path / "tb")

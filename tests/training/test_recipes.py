"""Recipes (coat_jax.recipes) and the config around them: resolution and sources, each recipe's
tiny step on the CPU, batch_size=auto, the metric writers, profile_steps, short-run warmups."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import numpy as np
import pytest
import yaml

from coat_jax import recipes
from coat_jax.training import plan, train
from coat_jax.training.cli import annotated_config, config_help, config_sources
from coat_jax.training.config import load_config, to_dict
from coat_jax.training.config_names import field_of
from coat_jax.training.metrics import MetricsLog, WandbWriter
from coat_jax.training.program import build_program
from tests.tiny_runs import tiny_run
from tests.training.test_train import REPO

DEFAULT = REPO / "configs" / "default.yaml"
# The smallest model the recipes all take (coat_max_batch scans the layers).
TINY = [
    *tiny_run(hidden=32, intermediate=64, layers=1, heads=2, kv_heads=1, seq_len=16, batch_size=2),
    "xla.compilation_cache_dir=null",
]


def test_each_recipe_resolves_to_its_documented_settings():
    page = (REPO / "docs" / "recipes.md").read_text()
    for name in recipes.RECIPES:
        cfg = load_config(DEFAULT, [f"recipe={name}"])
        for key, value in recipes.settings(name).items():
            assert getattr(cfg, field_of(key)) == value, (name, key)
        doc = recipes.RECIPES[name].__doc__
        pages = re.findall(r"docs/\w+\.md", doc)
        assert pages and all((REPO / p).is_file() for p in pages), (name, pages)
        assert f"`{name}`" in page, name
    assert load_config(DEFAULT).recipe == recipes.DEFAULT == "coat"
    with pytest.raises(ValueError, match="unknown recipe 'coat_max'; did you mean coat_max_batch"):
        load_config(DEFAULT, ["recipe=coat_max"])


def test_explicit_keys_override_a_recipe_and_print_config_names_each_source(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        "base: " + str(DEFAULT) + "\nrecipe: coat_max_batch\nprecision.fp8_swiglu: coat\n"
    )
    overrides = ["steps=7", "precision.fp8_group_scale=float32"]
    cfg = load_config(config, overrides)
    assert (cfg.fp8_swiglu, cfg.fp8_group_scale, cfg.steps) == ("coat", "float32", 7)
    assert cfg.optimizer_in_backward and cfg.grad_clip is None  # the recipe's
    sources = config_sources(cfg, config, overrides)
    assert sources["precision.fp8_swiglu"] == sources["data.seq_len"] == f"file {config}"
    assert sources["steps"] == sources["precision.fp8_group_scale"] == "command line"
    assert sources["optimizer.in_backward"] == "recipe coat_max_batch"
    assert sources["reschedule"] == "default" and sources["model.hidden_size"] == f"file {config}"
    printed = annotated_config(cfg, sources)
    assert yaml.safe_load(printed) == to_dict(cfg)
    assert "fp8_swiglu: coat" in printed and "# recipe coat_max_batch" in printed
    # A key that contradicts the recipe is refused in one line that names what the recipe set.
    with pytest.raises(
        ValueError,
        match=r"data.grad_accum=1 .*\(recipe coat_max_batch sets .*optimizer.in_backward",
    ):
        load_config(DEFAULT, ["recipe=coat_max_batch", "data.grad_accum=2"])


def test_help_lines_fit_100_columns_and_list_the_recipes():
    text = config_help()
    assert max(len(line) for line in text.splitlines()) <= 100
    for name in recipes.RECIPES:
        assert f"\n  {name} " in text


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, 258, (1, 2, 17), dtype=np.int32)


@pytest.mark.parametrize("name", ["bf16", "fp8", "coat_bf16_masters"])
def test_each_recipe_runs_3_steps_of_the_tiny_model(name, tokens):
    # kernels=auto: on the CPU the recipes' ops run as their jnp references. coat, the default,
    # is what every trainer test runs (tests/training/test_train.py); coat_max_batch runs in
    # test_recipe_run_with_profile_and_short_warmup through the whole trainer.
    cfg = load_config(DEFAULT, [*TINY, f"recipe={name}"])
    program = build_program(cfg, cfg.model)
    params = program.init_params(jax.random.key(0))
    opt_state = program.init_opt_state(params)
    losses = []
    for _ in range(3):
        params, opt_state, metrics = program.step_fn(params, opt_state, tokens)
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], (name, losses)


def test_recipe_run_with_profile_and_short_warmup(tmp_path):
    said = []
    cfg = load_config(
        DEFAULT,
        [
            *TINY,
            "recipe=coat_max_batch",
            "steps=3",
            "optimizer.warmup_steps=50",
            "checkpoint.save_final=false",
            "eval.batches=1",
            "logging.profile_steps=[2, 3]",
            f"output_dir={tmp_path}",
        ],
    )
    assert cfg.profile_steps == (2, 3)
    result = train(cfg, say=said.append)
    assert result.step == 3 and np.isfinite(result.val_loss)
    assert any(
        "optimizer.warmup_steps=50 is not below steps=3: the warmup shrinks to 0" in s for s in said
    )
    assert list((tmp_path / "profile").rglob("*.xplane.pb")), "no trace written"
    assert any("profile of steps 2 to 3" in s for s in said)
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert written["recipe"] == "coat_max_batch" and written["logging"]["profile_steps"] == [2, 3]


def test_unknown_key_gets_close_matches_and_the_help():
    with pytest.raises(ValueError, match=r"stepz; did you mean steps\? python train.py --help"):
        load_config(DEFAULT, ["stepz=10"])


# ----------------------------------------------------------------------------- batch_size: auto


def test_batch_size_auto_fits_a_fake_limit_and_is_refused_without_one(monkeypatch):
    cfg = load_config(DEFAULT, [*TINY, "recipe=bf16", "data.batch_size=auto"])
    with pytest.raises(ValueError, match="backend reports none; set batch_size to a number"):
        plan.resolve_batch(cfg)
    # Each batch's step is compiled once: the searches below ask again for batch 1's peak,
    # the limit, of the same program. Batch 2's program is the bf16 recipe test's (TINY),
    # which the test run's compilation cache holds when that test ran first.
    real, peaks = plan.compiled_peak, {}

    def peak(program, batch):
        if batch not in peaks:
            peaks[batch] = real(program, batch)
        return peaks[batch]

    monkeypatch.setattr(plan, "compiled_peak", peak)
    fixed = dataclasses.replace(cfg, batch_size=1)
    limit = plan.compiled_peak(build_program(fixed, fixed.model), 1)
    said = []
    auto = plan.resolve_batch(cfg, limit=limit, say=said.append)
    assert (auto.batch_size, auto.grad_accum) == (1, 1)
    assert said == [
        "data.batch_size=auto: 1, the largest batch whose compiled step fits the device's "
        f"{limit / 2**30:.2f} GiB (2 compiles)"
    ]
    with pytest.raises(ValueError, match="not even batch 1 fits the device's"):
        plan.resolve_batch(cfg, limit=limit - 1)
    assert sorted(peaks) == [1, 2]


def test_batch_size_auto_keeps_global_batch_size_by_accumulation(monkeypatch):
    # A fake account: the step's peak grows with the microbatch and with accumulation.
    compiled = []

    def peak(program, batch):
        compiled.append((batch, program.cfg.grad_accum))
        return 100 * batch + program.cfg.grad_accum

    monkeypatch.setattr(plan, "compiled_peak", peak)
    cfg = load_config(DEFAULT, [*TINY, "data.batch_size=auto", "data.global_batch_size=12"])
    auto = plan.resolve_batch(cfg, limit=450, say=lambda s: None)
    assert (auto.batch_size, auto.grad_accum) == (4, 3)  # 12 = 4 x 3; 6 would need 600
    assert all(12 % b == 0 and b * a == 12 for b, a in compiled)
    fixed = plan.resolve_batch(load_config(DEFAULT, [*TINY, "data.global_batch_size=8"]))
    assert (fixed.batch_size, fixed.grad_accum) == (2, 4)
    with pytest.raises(ValueError, match="sets grad_accum itself; leave grad_accum at 1"):
        plan.resolve_batch(dataclasses.replace(cfg, grad_accum=2), limit=450)
    with pytest.raises(
        ValueError, match="data.global_batch_size=7 must be data.batch_size=2 times"
    ):
        plan.resolve_batch(load_config(DEFAULT, [*TINY, "data.global_batch_size=7"]))


# ----------------------------------------------------------------------------- writers


def test_wandb_offline_writes_its_run_with_metrics_jsonl_scalars(tmp_path):
    wandb = pytest.importorskip(
        "wandb", reason="wandb is not installed (pip install 'coat-jax[wandb]')"
    )
    records = [
        {"step": 1, "loss": 5.5, "tokens_per_sec": None, "grad_norm": 2.0},
        {"step": 2, "loss": 4.5, "grad_norm": 1.5},
        {"step": 2, "val_loss": 4.25},
    ]
    writer = WandbWriter(tmp_path, project="coat-jax-test", mode="offline", config={}, resume=False)
    log = MetricsLog(tmp_path / "metrics.jsonl", resume_step=None, writers=[writer])
    for record in records:
        log.write(record)
    log.close()
    wandb.teardown()  # the service process has written the whole run file once it has stopped
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    (data,) = run_dir.glob("run-*.wandb")
    history = _wandb_history(data)
    expected = {}
    for record in log.read():
        for key, value in record.items():
            if key != "step" and value is not None:
                expected.setdefault(key, []).append((record["step"], value))
    assert history == expected
    assert (tmp_path / "wandb" / "run_id").read_text() in data.name


def _wandb_history(path) -> dict:
    """Each logged scalar's ``(step, value)`` pairs, read back from the run's .wandb file: a
    7-byte header, then LevelDB-log records (4-byte checksum, 2-byte length, 1-byte type: 1 a
    whole record, 2 to 4 its first, middle and last pieces) in 32 KiB blocks, each a
    ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, piece = path.read_bytes(), 32 * 1024, 7, b""
    out: dict = {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        piece += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind not in (1, 4):
            continue
        record, piece = wandb_internal_pb2.Record.FromString(piece), b""
        if record.WhichOneof("record_type") != "history":
            continue
        items = {
            i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item
        }
        step = items.pop("_step")
        for key, value in items.items():
            if not key.startswith("_"):
                out.setdefault(key, []).append((step, value))
    return out

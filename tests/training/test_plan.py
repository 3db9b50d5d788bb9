"""The compile-only memory plan (``train.py --plan``) on the CPU."""

from __future__ import annotations

import json

import pytest

from coat_jax.training import load_config
from coat_jax.training import plan as plan_mod
from tests.tiny_runs import REPO, tiny_run

# A one-layer model: the plan's account and its search do not depend on the model's depth.
SMALL = [
    *tiny_run(hidden=32, intermediate=64, layers=1, heads=2, kv_heads=1, seq_len=16),
    "xla.compilation_cache_dir=null",
]


def _cfg(*extra):
    return load_config(REPO / "configs" / "default.yaml", [*SMALL, *extra])


@pytest.fixture(scope="module")
def plan_2_4():
    """The plan of batches 2 and 4."""
    return plan_mod.plan_memory(_cfg(), [2, 4])


def test_plan_reports_xla_memory_that_grows_with_the_batch(plan_2_4):
    rows, largest, limit = plan_2_4
    assert limit is None and largest is None  # the CPU has no allocator limit
    small, big = rows
    assert (small.batch_size, big.batch_size) == (2, 4)
    assert small.params == big.params > 0 and small.opt_state == big.opt_state > 0
    assert big.activations > small.activations > 0
    assert big.peak > small.peak >= small.params + small.opt_state
    assert small.fits is None


def test_largest_batch_search_against_a_device_limit(monkeypatch, plan_2_4):
    r2 = {r.batch_size: r for r in plan_2_4[0]}[2]
    # A limit of batch 2's peak, below batch 4's: the largest fitting batch lies in [2, 4).
    # The search doubles to 4 (the program the fixture compiled), which does not fit, and
    # bisects to 3 (the fake account of test_recipes.py's batch_size=auto test takes the
    # doubling that fits).
    monkeypatch.setattr(plan_mod, "device_limit", lambda: r2.peak)
    rows, largest, limit = plan_mod.plan_memory(_cfg(), [2])
    assert 2 <= largest < 4
    by_batch = {r.batch_size: r for r in rows}
    assert by_batch[largest].fits and by_batch[largest].peak <= limit
    assert not by_batch[largest + 1].fits


def test_train_py_plan_prints_a_table(train_py):
    code, out, err = train_py("--plan", "2", *SMALL)
    assert code == 0, err[-2000:]
    assert "memory plan" in out and "no memory limit" in out
    # Off the GPU the table says first that it is not a GPU plan, and names no bare peak.
    assert out.startswith("NOT A GPU PLAN: the cpu backend reports no memory limit")
    header = next(line for line in out.splitlines() if line.lstrip().startswith("batch"))
    assert "cpu peak" in header and "fits" not in header
    code, _, err = train_py("--plan", "two")
    assert code == 2 and err.startswith("error:")


@pytest.mark.parametrize("batch", [0, -1])
def test_bad_batch_sizes_are_refused(batch):
    with pytest.raises(ValueError, match="batch sizes must be positive"):
        plan_mod.plan_memory(_cfg(), [batch])


class _Built(Exception):
    pass


@pytest.mark.parametrize("chat", [False, True])
def test_the_plan_compiles_the_step_that_the_data_needs(tmp_path, monkeypatch, chat):
    # Chat data: a loss mask, and attention within documents (its default for chats); the plan
    # must compile that step, not the plain-text one.
    record = (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
        if chat
        else {"text": "plain text"}
    )
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(record) + "\n")
    built = {}

    def build_program(cfg, llama_cfg, **flags):
        built.update(flags)
        raise _Built

    monkeypatch.setattr(plan_mod, "build_program", build_program)
    with pytest.raises(_Built):
        plan_mod.plan_memory(_cfg(f"data.path={data}"), [2])
    assert built == {"loss_mask": chat, "within_documents": chat}

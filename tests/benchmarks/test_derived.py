"""benchmarks/derived.py: the tables render.py computes from records pair the runs they say."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import derived  # noqa: E402

STAMP = {"device": "gpu:X", "jax": "0.0", "date": "2026-01-01 00:00 UTC"}


def run(setting, batch, tps, call=1, **extra):
    return {
        "kind": "run",
        "setting": setting,
        "mode": setting.split(":")[0],
        "batch": batch,
        "seq": 2,
        "tokens_per_s": tps,
        "tokens_per_s_pipelined": tps,
        "device_call": call,
        "step": {"median_s": 1.0, "min_s": 0.9, "max_s": 1.1},
        **STAMP,
        **extra,
    }


def label(r):
    return r["setting"]


def test_coat_over_bf16_pairs_each_run_with_the_bf16_run_of_its_call():
    rows = derived.coat_over_bf16(
        [
            run("bf16:a", 6, 100.0, 1),
            run("coat:a", 20, 150.0, 1),
            run("bf16:a", 6, 200.0, 2),
            run("coat:a", 20, 300.0, 2),
            run("coat:b", 20, 1.0, 3),
        ],
        label,
    )[2:]
    assert [r.split(" | ")[5] for r in rows] == ["1.500x", "1.500x"]  # call 3 has no BF16 run


def test_coat_over_bf16_largest_pairs_the_largest_batches_only():
    records = [
        run("bf16:a", 1, 10.0),
        run("bf16:a", 6, 20.0),
        run("coat:a", 1, 11.0),
        run("coat:a", 17, 30.0),
    ]
    rows = derived.coat_over_bf16(records, label, "largest")[2:]
    assert len(rows) == 1 and " | 17 | bf16:a | 6 | 1.500x |" in rows[0]


def test_coat_over_bf16_names_an_ambiguous_pair_and_an_unknown_pairing():
    records = [run("bf16:a", 1, 10.0), run("bf16:b", 1, 10.0), run("coat:a", 1, 11.0)]
    with pytest.raises(ValueError, match="2 BF16 runs pair with 'coat:a', expected one"):
        derived.coat_over_bf16(records, label, "batch")
    with pytest.raises(ValueError, match="pair='size'; expected one of"):
        derived.coat_over_bf16(records, label, "size")


def test_pallas_over_xla_pairs_settings_that_differ_only_in_fp8_kernels():
    x = run("coat:a", 8, 100.0, fp8_ops_implementation="xla")
    p = run("coat:a:fp8_kernels=pallas", 8, 102.0, fp8_ops_implementation="pallas")
    other = run("coat:b:fp8_kernels=pallas", 8, 1.0, fp8_ops_implementation="pallas")
    rows = derived.pallas_over_xla([x, p, other], label)[2:]
    assert len(rows) == 1 and "| 1.020x |" in rows[0] and "| overlap |" in rows[0]


def test_losses_reads_the_steps_one_based_and_the_lowest_with_its_step():
    rows = derived.losses([run("coat:a", 1, 1.0, losses=[3.0, 2.5, 0.5, 0.75])], label, (1, 2))
    assert rows[2].startswith("| coat:a | 1 | 3.0 | 2.5 | 0.5 (3) | X |")


def test_epochs_divides_a_runs_tokens_by_the_training_tokens_and_refuses_mixed_runs():
    corpora = {"columns": ["setting", "training tokens"], "rows": [["s", "1,000"]]}
    records = [{"setting": "s", "tokens": 2500, **STAMP}]
    assert derived.epochs(records, corpora)[2].startswith("| s | 2,500 | 1,000 | 2.50 | X |")
    with pytest.raises(ValueError, match="setting 's': runs of 2 token counts, expected one"):
        derived.epochs([*records, {"setting": "s", "tokens": 1, **STAMP}], corpora)


def test_shape_bytes_table_divides_by_the_shapes_size():
    names = ("coat_adamw", "fp8_state(lion)", "adamw", "lion")
    records = [
        {"kind": "shape_state_bytes", "optimizer": n, "shape": [2, 3], "state_bytes": b, **STAMP}
        for n, b in zip(names, (13, 7, 48, 24), strict=True)
    ]
    rows = derived.shape_bytes_table(records)
    assert rows[2].startswith("| (2, 3) | 2.1666 | 1.1666 | 8.0000 / 4.0000 | X |")

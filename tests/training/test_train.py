"""train.py and coat_jax.training: the real step, resume, signals, bad input, several devices.

Everything runs on CPU with a tiny Llama (hidden 64, 2 layers) in COAT mode with coat_adamw,
unless a test says otherwise.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hashlib
import inspect
import json
import logging
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint._src.serialization import serialization

from coat_jax.runs import _DropAbandonedReadCallbacks, quiet_orbax
from coat_jax.training import CheckpointError, load_config, train
from coat_jax.training.sharding import fsdp_spec
from tests.commands import run_each
from tests.jaxprs import pallas_calls
from tests.signals import stop_with_sigterm
from tests.tiny_runs import compilation_cache, tiny_run

REPO = Path(__file__).resolve().parents[2]

TINY = [*tiny_run(), "optimizer.learning_rate=3e-3", "eval.batches=2"]

# The schedule's length is compiled into the step: runs on this long schedule, stopped with
# stop_at or a signal, share one program.
LONG = "steps=100000"


@pytest.fixture(scope="module")
def cache_dir(trainer_caches):
    """Token cache and JAX compilation cache shared by this module's runs (and subprocesses)."""
    return str(trainer_caches)


def cache_overrides(cache_dir) -> list[str]:
    return [f"data.cache_dir={cache_dir}/tokens", compilation_cache(f"{cache_dir}/jax")]


def tiny(out, cache_dir, *extra):
    return load_config(
        REPO / "configs" / "default.yaml",
        [*TINY, f"output_dir={out}", *cache_overrides(cache_dir), *extra],
    )


def losses(out) -> dict[int, float]:
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def tree_bytes(tree) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def dir_digest(path) -> dict[str, str]:
    return {
        str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(Path(path).rglob("*"))
        if f.is_file()
    }


# ----------------------------------------------------------------------------- config


def test_every_shipped_config_loads():
    names = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))
    for name in ("default.yaml", "smollm2_135m_finetune.yaml", "llama2_7b.yaml", "llama3_8b.yaml"):
        assert name in names
    for name in names:
        load_config(REPO / "configs" / name)
    smol = load_config(REPO / "configs" / "smollm2_135m_finetune.yaml")
    assert smol.init_from and smol.tokenizer == "init_from"
    l7 = load_config(REPO / "configs" / "llama2_7b.yaml")
    assert (l7.model.hidden_size, l7.model.num_hidden_layers, l7.model.vocab_size) == (
        4096,
        32,
        32000,
    )
    l8 = load_config(REPO / "configs" / "llama3_8b.yaml")
    assert (l8.model.num_key_value_heads, l8.model.vocab_size) == (8, 128256)


def test_base_inheritance_and_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text("steps: 77\nmodel:\n  hidden_size: 96\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\nmodel:\n  num_hidden_layers: 3\n")
    cfg = load_config(tmp_path / "child.yaml", ["optimizer.learning_rate=1e-4", "mesh.fsdp=2"])
    assert cfg.steps == 77 and cfg.model.hidden_size == 96 and cfg.model.num_hidden_layers == 3
    assert cfg.learning_rate == 1e-4 and cfg.mesh.fsdp == 2
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ValueError, match="cycle"):
        load_config(tmp_path / "a.yaml")


@pytest.mark.parametrize(
    "override, message",
    [
        ("stepz=10", r"unknown config key\(s\) stepz; did you mean steps\? python train.py --help"),
        ("model.hidden=8", r"unknown config key\(s\) model.hidden; did you mean model.hidden_size"),
        (
            "precision.mode=fp16",
            r"precision.mode='fp16' is not valid; choose one of \['bf16', 'fp8', 'coat'\]",
        ),
        ("optimizer.name=rmsprop", r"choose one of \['adamw', 'coat_adamw', 'lion'"),
        ("steps=1.5", r"steps=1.5 is not valid; expected int"),
        ("resume=yes please", r"expected bool"),
        ("optimizer.learning_rate=-1", r"learning_rate must be > 0"),
        ("optimizer.warmup_steps=-1", r"warmup_steps must be >= 0"),
        ("optimizer.b2=1.0", r"b2 must be in \[0, 1\)"),
        ("steps", r"not of the form key=value"),
        ("data.val_documents=[a", r"the value is not valid YAML .*; quote it"),
        ("data.val_documents= , ", r"the value is not valid YAML"),
        ("data.val_documents=' , '", r"val_documents must name documents"),
    ],
)
def test_bad_config_is_a_clear_error(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(REPO / "configs" / "default.yaml", [override])


def test_kernels_fp8_ops_without_fp8_ops_is_a_clear_error():
    with pytest.raises(ValueError, match="precision.mode=bf16 has none"):
        load_config(
            REPO / "configs" / "default.yaml", ["precision.mode=bf16", "kernels.fp8_ops=xla"]
        )
    with pytest.raises(ValueError, match="kernels.fp8_ops='interpret' is not valid"):
        load_config(REPO / "configs" / "default.yaml", ["kernels.fp8_ops=interpret"])
    with pytest.raises(ValueError, match="^`fp8_kernels` is now `kernels.fp8_ops`"):
        load_config(REPO / "configs" / "default.yaml", ["fp8_kernels=xla"])  # old flat key


@pytest.mark.parametrize(
    "overrides, fp8_ops, optimizer",
    [
        # the default at this config's size: XLA's fusions for the FP8 ops, Pallas for the step
        ([], "xla", "auto"),
        (["kernels.fp8_ops=pallas"], "pallas", "auto"),
        (["kernels.fp8_ops=auto"], "auto", "auto"),
        (["kernels=pallas"], "pallas", "pallas"),
        (["kernels=xla"], "xla", "xla"),
        (["kernels=pallas", "kernels.fp8_ops=xla"], "xla", "pallas"),
        (["kernels.optimizer=xla"], "xla", "xla"),
    ],
)
def test_fp8_kernels_default_and_overrides(overrides, fp8_ops, optimizer):
    """Unset, ``kernels.fp8_ops`` sends the FP8 activation ops of the default config (a narrow
    model, few tokens) to XLA's fusions under ``kernels: auto``; a name other than ``auto`` sets
    both parts; ``kernels.optimizer`` picks the optimizer's kernels alone. The model the trainer
    builds carries it."""
    from coat_jax.training.model import model_def_for
    from coat_jax.training.optimizers import kernel_options

    cfg = load_config(REPO / "configs" / "default.yaml", ["precision.mode=coat", *overrides])
    assert kernel_options(cfg, fp8_ops=True)["implementation"] == fp8_ops
    assert kernel_options(cfg)["implementation"] == optimizer
    model_def = model_def_for(cfg.model, cfg)
    model = model_def.bind(model_def.abstract_params)
    assert model.fp8_config.implementation == fp8_ops


def test_the_interpret_switch_keeps_every_pallas_kernel(monkeypatch):
    """The test-only switch (``PALLAS_INTERPRET_ENV``, formerly ``kernels=interpret``): every
    kernel, the FP8 ops' too, is Pallas's in interpret mode; it needs ``kernels: auto``."""
    from coat_jax.training.model import model_def_for
    from coat_jax.training.optimizers import PALLAS_INTERPRET_ENV, kernel_options

    cfg = load_config(REPO / "configs" / "default.yaml", ["precision.mode=coat"])
    assert kernel_options(cfg, fp8_ops=True) == {"implementation": "xla", "interpret": False}
    monkeypatch.setenv(PALLAS_INTERPRET_ENV, "1")
    assert kernel_options(cfg, fp8_ops=True) == {"implementation": "auto", "interpret": True}
    assert kernel_options(cfg) == {"implementation": "auto", "interpret": True}
    model_def = model_def_for(cfg.model, cfg)
    model = model_def.bind(model_def.abstract_params)
    assert model.fp8_config.implementation == "auto" and model.fp8_config.interpret
    with pytest.raises(ValueError, match="set kernels=auto or unset COAT_JAX_PALLAS_INTERPRET"):
        kernel_options(dataclasses.replace(cfg, kernels="xla"))
    monkeypatch.setenv(PALLAS_INTERPRET_ENV, "yes")
    with pytest.raises(ValueError, match="COAT_JAX_PALLAS_INTERPRET='yes' is not valid"):
        kernel_options(cfg)


@pytest.mark.parametrize(
    "override, message",
    [
        ("kernels=interpret", "kernels=interpret was removed: .* use kernels=auto, xla or pallas"),
        ("fp8_codes_barrier=false", "fp8_codes_barrier was removed: .* always on"),
        ("fp8_codes_barrier=true", "fp8_codes_barrier was removed"),
        ("fp8_gemm_output=float32", "fp8_gemm_output was removed: .*docs/bench_gemm_output.md"),
        ("fp8_gemm_output=compute", "fp8_gemm_output was removed"),
    ],
)
def test_a_removed_option_says_what_replaced_it(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(REPO / "configs" / "default.yaml", [override])


def test_fp8_kernels_unset_follow_the_model_width_and_tokens_per_device():
    """Unset under ``kernels: auto``, the FP8 ops take the Pallas kernels (``auto``) for a model
    at least FP8_PALLAS_MIN_HIDDEN wide with at least FP8_PALLAS_MIN_TOKENS tokens per device,
    XLA's fusions otherwise; devices sharing the batch divide the tokens; a set
    ``kernels.fp8_ops`` or another ``kernels`` wins."""
    from coat_jax.training.model import model_def_for
    from coat_jax.training.optimizers import (
        FP8_PALLAS_MIN_HIDDEN,
        FP8_PALLAS_MIN_TOKENS,
        fp8_ops_auto,
        kernel_options,
    )

    base = load_config(
        REPO / "configs" / "default.yaml",
        ["precision.mode=coat", f"model.hidden_size={FP8_PALLAS_MIN_HIDDEN}", "model.head_dim=64"],
    )
    at = FP8_PALLAS_MIN_TOKENS // base.seq_len
    assert at * base.seq_len == FP8_PALLAS_MIN_TOKENS  # the default config divides it exactly
    big = dataclasses.replace(base, batch_size=at)
    narrow = dataclasses.replace(
        big, model=dataclasses.replace(big.model, hidden_size=FP8_PALLAS_MIN_HIDDEN // 2)
    )
    assert fp8_ops_auto(big) == "auto"
    assert fp8_ops_auto(narrow) == "xla"
    assert fp8_ops_auto(dataclasses.replace(base, batch_size=at - 1)) == "xla"
    assert fp8_ops_auto(big, devices=2) == "xla"
    assert fp8_ops_auto(dataclasses.replace(base, batch_size=2 * at), devices=2) == "auto"
    assert kernel_options(big, fp8_ops=True)["implementation"] == "auto"
    assert kernel_options(big, fp8_ops=True, devices=2)["implementation"] == "xla"
    assert kernel_options(
        dataclasses.replace(big, kernels=(("fp8_ops", "xla"),)), fp8_ops=True
    ) == {
        "implementation": "xla",
        "interpret": False,
    }
    assert (
        kernel_options(dataclasses.replace(big, kernels="xla"), fp8_ops=True)["implementation"]
        == "xla"
    )
    model_def = model_def_for(big.model, big)
    assert model_def.bind(model_def.abstract_params).fp8_config.implementation == "auto"
    # The width is the built model's (init_from takes it from a checkpoint, not cfg.model).
    assert fp8_ops_auto(narrow, hidden_size=FP8_PALLAS_MIN_HIDDEN) == "auto"
    assert fp8_ops_auto(big, hidden_size=FP8_PALLAS_MIN_HIDDEN // 2) == "xla"
    model_def = model_def_for(big.model, narrow)
    assert model_def.bind(model_def.abstract_params).fp8_config.implementation == "auto"
    model_def = model_def_for(narrow.model, big)
    assert model_def.bind(model_def.abstract_params).fp8_config.implementation == "xla"
    with pytest.raises(ValueError, match="devices must be at least 1"):
        fp8_ops_auto(big, devices=0)


def test_train_py_reports_config_errors_without_traceback(train_py):
    code, _, err = train_py("stepz=3")
    assert code == 2
    assert "unknown config key(s) stepz" in err and "Traceback" not in err


# ----------------------------------------------------------------------------- the real step


# The 40-step run, evaluated and checkpointed every 20 steps, that
# test_tiny_coat_run_learns_and_writes_its_outputs inspects and test_resume_is_bit_exact resumes
# from its step-20 checkpoint.
RUN_40 = ("steps=40", "eval.every=20", "checkpoint.every=20")


@pytest.fixture(scope="module")
def run_40(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("run_40") / "run"
    return out, train(tiny(out, cache_dir, *RUN_40))


def test_tiny_coat_run_learns_and_writes_its_outputs(run_40):
    out, result = run_40
    curve = losses(out)
    assert sorted(curve) == list(range(1, 41))
    first, last = (
        np.mean([curve[s] for s in range(1, 6)]),
        np.mean([curve[s] for s in range(36, 41)]),
    )
    print(f"tiny coat run: loss {curve[1]:.3f} at step 1, mean {first:.3f} over steps 1-5, ")
    print(f"{last:.3f} over steps 36-40")
    assert abs(curve[1] - math.log(258)) < 0.1  # starts near uniform over the byte vocabulary
    assert last < first - 1.5, (first, last)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "loss" in r]
    for key in ("step", "loss", "learning_rate", "tokens_per_sec", "grad_norm"):
        assert key in train_records[-1]
    # Throughput is timed only for steps seen with the next one in flight (tests/
    # test_progress.py): not the step drained before the evaluation (20) or at the end (40),
    # nor step 21, whose end starts the window after the evaluation.
    untimed = {r["step"] for r in train_records if not r["tokens_per_sec"]}
    assert untimed == {1, 20, 21, 40}, untimed
    assert all(r["tokens_per_sec"] > 0 for r in train_records if r["step"] not in untimed)
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in val] == [20, 40] and "val_perplexity" in val[-1]
    assert result.val_perplexity == pytest.approx(math.exp(val[-1]["val_loss"]))
    assert result.val_perplexity < 258 / 4
    assert (out / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "checkpoints" / "40").is_dir()
    # The optimizer really is COAT's: moments stored as 8-bit codes.
    fp8 = [x for x in jax.tree.leaves(result.opt_state) if x.dtype == jnp.float8_e4m3fn]
    assert fp8 and sum(x.size for x in fp8) >= sum(x.size for x in jax.tree.leaves(result.params))


def test_weight_decay_skips_norms_and_embeddings(tmp_path, cache_dir):
    from coat_jax.training.optimizers import weight_decay_mask

    cfg = tiny(tmp_path, cache_dir)
    params = {
        "embed_tokens": jnp.zeros((258, 64)),
        "layers": {
            0: {"input_layernorm": {"weight": jnp.zeros(64)}, "q_proj": jnp.zeros((64, 64))}
        },
        "lm_head": jnp.zeros((64, 258)),
        "norm": {"weight": jnp.zeros(64)},
    }
    mask = weight_decay_mask(params, cfg.decay_norms_and_embeddings)
    assert mask == {
        "embed_tokens": False,
        "layers": {0: {"input_layernorm": {"weight": False}, "q_proj": True}},
        "lm_head": True,
        "norm": {"weight": False},
    }
    assert all(jax.tree.leaves(weight_decay_mask(params, True)))


def test_schedule_warms_up_then_decays_to_the_floor(tmp_path, cache_dir):
    from coat_jax.training.program import make_schedule

    cfg = tiny(
        tmp_path, cache_dir, "steps=100", "optimizer.warmup_steps=10", "optimizer.min_lr_ratio=0.1"
    )
    lr = [float(make_schedule(cfg)(c)) for c in range(100)]
    assert lr[0] == pytest.approx(3e-4) and lr[9] == pytest.approx(3e-3)
    assert lr[10] == pytest.approx(3e-3) and all(np.diff(lr[10:]) <= 0)
    assert lr[-1] == pytest.approx(3e-4, rel=1e-2)


# ----------------------------------------------------------------------------- checkpoints


def test_fp8_codes_round_trip_orbax_bit_exactly(tmp_path):
    every_code = np.arange(256, dtype=np.uint8)
    tree = {
        "e4m3": jnp.asarray(every_code.view(jnp.float8_e4m3fn)).reshape(2, 128),
        "e5m2": jnp.asarray(every_code.view(jnp.float8_e5m2)).reshape(2, 128),
    }
    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(1, args=ocp.args.StandardSave(tree))
        manager.wait_until_finished()
        back = manager.restore(1, args=ocp.args.StandardRestore(jax.eval_shape(lambda: tree)))
    for name in tree:
        assert back[name].dtype == tree[name].dtype
        assert np.asarray(back[name]).view(np.uint8).tolist() == every_code.reshape(2, 128).tolist()


def test_resume_is_bit_exact(tmp_path, cache_dir, run_40):
    straight_out, straight = run_40
    # The straight run's folder without its step-40 checkpoint: that run stopped after step 20,
    # just after its evaluation there (a run stopped there by stop_at:
    # test_a_stopped_run_checkpoints_its_step_and_reports_no_final_evaluation).
    shutil.copytree(straight_out, tmp_path / "split")
    shutil.rmtree(tmp_path / "split" / "checkpoints" / "40")
    assert (tmp_path / "split" / "checkpoints" / "20").is_dir()
    resumed = train(tiny(tmp_path / "split", cache_dir, *RUN_40, "resume=true"))
    assert resumed.step == 40
    assert losses(tmp_path / "split") == losses(straight_out)
    assert tree_bytes(resumed.params) == tree_bytes(straight.params)
    assert tree_bytes(resumed.opt_state) == tree_bytes(straight.opt_state)
    assert resumed.val_loss == straight.val_loss


def test_deterministic_passes_xlas_option_and_keeps_the_numbers(tmp_path, cache_dir, good):
    """``xla.deterministic=true`` compiles with ``xla_gpu_deterministic_ops`` (a misspelt option would
    fail to compile here too); on the CPU, deterministic anyway, the run is the same bit for bit.
    On a GPU the option may choose other kernels, so the numbers are compared on the CPU only
    (this test failed on the H200 when it compared them there)."""
    from coat_jax.training.program import compiler_options

    assert "xla_gpu_deterministic_ops" not in (compiler_options(tiny(tmp_path, cache_dir)) or {})
    cfg = tiny(tmp_path / "det", cache_dir, LONG, "xla.deterministic=true")
    assert compiler_options(cfg)["xla_gpu_deterministic_ops"] is True
    if jax.default_backend() != "cpu":
        pytest.skip("the same numbers with and without the option: the CPU only")
    det = train(cfg, stop_at=6)
    plain_out, plain = good  # the same run without the option
    assert losses(tmp_path / "det") == losses(plain_out)
    assert tree_bytes(det.params) == tree_bytes(plain.params)


def test_the_step_and_the_evaluation_compile_with_compiler_options(monkeypatch, tmp_path):
    """Both jits take ``compiler_options(cfg)``: an option XLA does not know must reach them."""
    from coat_jax.training import program

    monkeypatch.setattr(program, "compiler_options", lambda cfg: {"xla_no_such_option": True})
    cfg = tiny(tmp_path, str(tmp_path))
    prog = program.build_program(cfg, cfg.model)
    params, state = prog.abstract_params, prog.abstract_opt_state
    with pytest.raises(Exception, match="No such compile option"):
        prog.step_fn.lower(params, state, prog.abstract_batch()).compile()
    windows = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len + 1), jnp.int32)
    with pytest.raises(Exception, match="No such compile option"):
        prog.eval_fn.lower(params, windows).compile()


def test_a_deterministic_step_that_fails_to_compile_names_the_option(
    monkeypatch, tmp_path, cache_dir
):
    """The first step failing under ``xla.deterministic=true`` (as BF16 steps did on the H200, an
    ``IndexError`` from absl while compiling) ends as a ``ValueError`` that names the option and
    the fix; without the option the error is left as it is."""
    from coat_jax.training import run

    def fails(*_):
        raise IndexError("absl::container_internal::raw_hash_map<>::at")

    monkeypatch.setattr(run, "first_step", fails)
    with pytest.raises(ValueError, match="xla.deterministic=true.*Set xla.deterministic=false"):
        train(tiny(tmp_path / "det", cache_dir, "steps=4", "xla.deterministic=true"))
    with pytest.raises(IndexError):
        train(tiny(tmp_path / "plain", cache_dir, "steps=4"))


@pytest.mark.parametrize("precision", ["bf16", "coat"])
def test_deterministic_takes_xlas_attention(precision, monkeypatch, tmp_path):
    """A step with ``xla.deterministic=true`` asks for XLA's attention, not cuDNN's (with XLA's
    deterministic ops BF16 steps did not compile on the H200, the float32 step did)."""
    from coat_jax import llama
    from coat_jax.training import program

    asked = []
    real = llama.attention_implementation

    def spy(dtype, choice="auto"):
        asked.append(choice)
        return real(dtype, choice)

    monkeypatch.setattr(llama, "attention_implementation", spy)
    extra = ["optimizer.name=adamw"] if precision == "bf16" else []
    for det, want in (("false", {"auto"}), ("true", {"xla"})):
        asked.clear()
        cfg = tiny(
            tmp_path,
            str(tmp_path),
            f"precision.mode={precision}",
            f"xla.deterministic={det}",
            *extra,
        )
        prog = program.build_program(cfg, cfg.model)
        prog.step_fn.trace(prog.abstract_params, prog.abstract_opt_state, prog.abstract_batch())
        assert set(asked) == want, (det, asked)


@pytest.mark.parametrize("fp8_kernels", [None, "xla"])
def test_fp8_kernels_moves_the_fp8_ops_alone(fp8_kernels, tmp_path, monkeypatch):
    """``kernels.fp8_ops=xla``: the FP8 activation ops run as XLA (no kernel of theirs in the step)
    while coat_adamw keeps its Pallas kernel; unset, both run Pallas (here in interpret mode)."""
    from coat_jax.training import program
    from coat_jax.training.optimizers import PALLAS_INTERPRET_ENV

    monkeypatch.setenv(PALLAS_INTERPRET_ENV, "1")
    extra = [] if fp8_kernels is None else [f"kernels.fp8_ops={fp8_kernels}"]
    cfg = tiny(tmp_path, str(tmp_path), *extra)
    prog = program.build_program(cfg, cfg.model)
    jaxpr = prog.step_fn.trace(
        prog.abstract_params, prog.abstract_opt_state, prog.abstract_batch()
    ).jaxpr
    names = {name for name, _ in pallas_calls(jaxpr)}
    optimizer = {n for n in names if n.startswith("coat_adamw")}
    assert optimizer, names
    if fp8_kernels is None:
        assert names - optimizer, names  # the FP8 ops' own kernels
    else:
        assert names == optimizer, names


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
def test_deterministic_gpu_runs_repeat_bit_for_bit(tmp_path, cache_dir):
    """On the GPU two runs of one configuration may differ (atomics in the embedding's scatter-add
    gradient, reductions, kernels autotuned per compilation); with ``xla.deterministic=true`` they must
    not. Each run is its own process with no compilation cache, so each compiles anew."""

    def run(name, *extra):
        out = tmp_path / name
        cmd = [
            sys.executable,
            str(REPO / "train.py"),
            "--config",
            str(REPO / "configs/default.yaml"),
        ]
        cmd += [*TINY, "steps=30", f"output_dir={out}", f"data.cache_dir={cache_dir}/tokens"]
        cmd += ["xla.compilation_cache_dir=null", *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        records = (out / "metrics.jsonl").read_text().splitlines()
        return [
            (r["step"], r["loss"], r.get("grad_norm"))
            for r in map(json.loads, records)
            if "loss" in r
        ]

    first = run("a", "xla.deterministic=true")
    assert run("b", "xla.deterministic=true") == first
    # The control, reported rather than asserted: without the option the runs may or may not differ.
    control = run("c") == run("d")
    print(f"without xla.deterministic=true two runs were {'the same' if control else 'different'}")


def test_a_checkpoint_resumes_in_the_other_layer_layout(tmp_path, cache_dir):
    # Unrolled for 4 steps, then scanned (with COAT's remat policy) to 8: the FP8 optimizer
    # state is stacked on restore, and the run continues as the unrolled one does. The unrolled
    # run's folder without its step-8 checkpoint is that run stopped after step 4.
    f32 = ("steps=8", "precision.compute_dtype=float32")
    straight = train(tiny(tmp_path / "straight", cache_dir, *f32, "checkpoint.every=4"))
    shutil.copytree(tmp_path / "straight", tmp_path / "split")
    shutil.rmtree(tmp_path / "split" / "checkpoints" / "8")
    resumed = train(
        tiny(
            tmp_path / "split",
            cache_dir,
            *f32,
            "resume=true",
            "memory.scan_layers=true",
            "memory.remat=activations",
        )
    )
    assert resumed.step == 8
    assert resumed.params["layers"]["self_attn"]["q_proj"].shape[0] == 2  # stacked
    from coat_jax.llama import unstack_layers

    for a, b in zip(
        jax.tree.leaves(straight.params),
        jax.tree.leaves(unstack_layers(resumed.params)),
        strict=True,
    ):
        if jax.default_backend() == "cpu":
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
        else:
            # The two layouts compile to different fusions, and on a GPU their rounding
            # differs enough to flip an FP8 code now and then (H200: 1 of 16512 values 6e-4
            # apart after 8 steps); each tensor as a whole stays within 1e-4.
            a, b = np.float64(a), np.float64(b)
            assert np.linalg.norm(b - a) <= 1e-4 * np.linalg.norm(a)
    l1, l2 = losses(tmp_path / "straight"), losses(tmp_path / "split")
    assert all(abs(l1[s] - l2[s]) <= 1e-4 * l1[s] for s in l1)


@pytest.fixture(scope="module")
def good(tmp_path_factory, cache_dir):
    """A run stopped after 6 steps of the long schedule, just after its evaluation there: its
    output_dir and its result. The SIGTERM test's trainer runs the same program, so it loads it
    from the compilation cache."""
    out = tmp_path_factory.mktemp("good") / "run"
    return out, train(tiny(out, cache_dir, LONG, "eval.every=6"), stop_at=6)


@pytest.fixture(scope="module")
def good_run(good):
    return good[0]


def test_a_stopped_run_checkpoints_its_step_and_reports_no_final_evaluation(good):
    out, result = good
    assert result.step == 6 and result.val_loss is None
    assert (out / "checkpoints" / "6").is_dir()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_loss" in r] == [6]


def test_resume_without_a_checkpoint_is_an_error(tmp_path, cache_dir):
    with pytest.raises(CheckpointError, match="there is no checkpoint"):
        train(tiny(tmp_path, cache_dir, "steps=6", "resume=true"))


@pytest.mark.parametrize("existing", [False, True], ids=["new_dir", "existing_dir"])
def test_refused_runs_leave_the_output_dir_as_they_found_it(tmp_path, cache_dir, existing):
    # docs/training.md, 'Reliability': no file, no directory, no train.log line from a refused
    # run.
    out = tmp_path / "parent" / "run"
    if existing:
        out.mkdir(parents=True)
        (out / "notes.txt").write_text("the user's own file")
    before = dir_digest(tmp_path)
    refusals = [
        (["init_from=/nonexistent"], ValueError, "init_from"),
        (["resume=true"], CheckpointError, "there is no checkpoint"),
    ]
    for overrides, error, message in refusals:
        with pytest.raises(error, match=message):
            train(tiny(out, cache_dir, "steps=6", *overrides))
        assert dir_digest(tmp_path) == before
        assert out.exists() == existing and (tmp_path / "parent").exists() == existing
        if existing:
            assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_a_new_run_never_overwrites_checkpoints(good_run, cache_dir):
    before = dir_digest(good_run)
    with pytest.raises(ValueError, match=r"already holds checkpoints \(steps \[6\]\); pass resume"):
        train(tiny(good_run, cache_dir, "steps=6"))
    assert dir_digest(good_run) == before


@pytest.mark.parametrize(
    "extra, message",
    [
        (["model.hidden_size=32"], r"model: checkpoint has .*'hidden_size': 64"),
        (["optimizer.name=adamw"], r"optimizer: checkpoint has 'coat_adamw', this run has 'adamw'"),
        (["seed=1"], r"seed: checkpoint has 0, this run has 1"),
    ],
)
def test_mismatched_checkpoint_is_refused(good_run, cache_dir, extra, message):
    before = dir_digest(good_run)
    with pytest.raises(CheckpointError, match=message):
        train(tiny(good_run, cache_dir, "steps=8", "resume=true", *extra))
    assert dir_digest(good_run) == before


def _corrupt_largest_array_file(run):
    data = max((run / "checkpoints" / "6" / "state").rglob("d/*"), key=lambda f: f.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one flipped bit: tensorstore reads it back without complaint
    data.write_bytes(bytes(raw))


def _break_metadata(run):
    (run / "checkpoints" / "6" / "meta" / "metadata").write_text("{not json")


def _truncate_largest_array_file(run):
    data = max((run / "checkpoints" / "6" / "state").rglob("d/*"), key=lambda f: f.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def _delete_arrays(run):
    for f in (run / "checkpoints" / "6" / "state").rglob("d/*"):
        f.unlink()


DAMAGES = [
    _corrupt_largest_array_file,
    _truncate_largest_array_file,
    _break_metadata,
    _delete_arrays,
]


@pytest.fixture(scope="module")
def corrupt_runs(good_run, tmp_path_factory, cache_dir):
    """A copy of ``good_run`` per damage, damaged, resumed through train.py: its folder, its
    digest before the resume, the exit code and stderr, and the child's other stderr."""
    root = tmp_path_factory.mktemp("corrupt")
    runs, argvs = {}, []
    for damage in DAMAGES:
        run = root / damage.__name__
        shutil.copytree(good_run, run)
        damage(run)
        runs[damage.__name__] = run, dir_digest(run)
        overrides = [*TINY, f"output_dir={run}", *cache_overrides(cache_dir), "steps=8"]
        argvs.append(["python", "train.py", *overrides, "resume=true"])
    # train.py on each damaged run in turn, in one child process: each run's stderr (file
    # descriptor 2, Orbax's and TensorStore's C++ logging included) to a file of its own.
    names = [damage.__name__ for damage in DAMAGES]
    stderrs, codes, other_stderr = run_each(
        argvs, [root / f"{name}.stderr" for name in names], fd=2
    )
    return {
        name: (*runs[name], code, stderr, other_stderr)
        for name, code, stderr in zip(names, codes, stderrs, strict=True)
    }


@pytest.mark.parametrize("damage", DAMAGES)
def test_corrupt_checkpoint_is_refused_and_left_alone(corrupt_runs, damage):
    # Through train.py in a child process: its whole stderr, exit code included.
    run, before, code, stderr, other_stderr = corrupt_runs[damage.__name__]
    assert code == 2, stderr[-2000:]
    # stderr is the error alone (no Orbax noise, no TensorStore spec): at most three lines,
    # the remedy first.
    assert other_stderr == "", other_stderr[-2000:]
    error = stderr.strip().splitlines()
    assert 1 <= len(error) <= 3 and "tensorstore_spec" not in stderr, stderr[-2000:]
    assert error[0].startswith("error: CheckpointError: there is no earlier checkpoint: start a")
    assert re.search(r"checkpoint step 6 .* is unreadable", error[1])
    assert dir_digest(run) == before


def _orbax_read():
    """An unstarted coroutine of Orbax's array read (its body runs only when awaited, so any
    arguments make one)."""
    read = serialization._read_array_index_and_device_put
    return read(**dict.fromkeys(inspect.signature(read).parameters))


def test_only_the_reads_orbax_abandoned_are_kept_off_stderr():
    # The child above (with its collection) shows the real case end to end; this one shows
    # that the hook keeps every other unraisable error.
    def closed_by_the_collector(message):
        try:
            try:
                raise GeneratorExit
            except BaseException as e:
                raise Exception(message) from e
        except Exception as e:
            return e

    async def not_orbax():
        pass

    reported = []
    hook = _DropAbandonedReadCallbacks(reported.append)
    orbax_read = _orbax_read()
    ours = not_orbax()
    try:
        kept = [
            SimpleNamespace(object=ours, exc_value=closed_by_the_collector("x")),
            SimpleNamespace(object=orbax_read, exc_value=ValueError("a real read error")),
            SimpleNamespace(object=None, exc_value=None),
        ]
        dropped = SimpleNamespace(object=orbax_read, exc_value=closed_by_the_collector("read"))
        for unraisable in [*kept, dropped]:
            unraisable.exc_traceback = getattr(unraisable.exc_value, "__traceback__", None)
            hook(unraisable)
    finally:
        orbax_read.close()
        ours.close()
    assert reported == kept


def test_only_the_tasks_orbax_abandoned_are_kept_off_the_log(caplog):
    # asyncio logs a failed task nobody awaited when the garbage collector takes it: for a read
    # Orbax abandoned, quiet_orbax drops that record; any other task's, and any record without
    # an exception, is kept.
    quiet_orbax()

    async def not_orbax():
        raise ValueError("not a read")

    def failed_task(coroutine):
        loop = asyncio.new_event_loop()
        try:
            task = loop.create_task(coroutine)
            loop.run_until_complete(asyncio.sleep(0.01))
            assert task.done()
        finally:
            loop.close()
        del task
        gc.collect()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        failed_task(_orbax_read())
        assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
        failed_task(not_orbax())
        assert [r for r in caplog.records if "never retrieved" in r.getMessage()]
        logging.getLogger("asyncio").error("a record without an exception")
        assert caplog.records[-1].getMessage() == "a record without an exception"


def test_sigterm_writes_a_checkpoint_that_resumes(tmp_path, cache_dir):
    out = tmp_path / "run"
    args = [*TINY, f"output_dir={out}", *cache_overrides(cache_dir), LONG]
    proc = subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.stdout.read()
    output = stop_with_sigterm(proc)
    assert "received SIGTERM" in output
    steps = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert len(steps) == 1 and steps[0] >= 3
    assert max(losses(out)) == steps[0]
    resumed = train(tiny(out, cache_dir, f"steps={steps[0] + 2}", "resume=true"))
    assert resumed.step == steps[0] + 2
    assert sorted(losses(out)) == list(range(1, steps[0] + 3))


# ----------------------------------------------------------------------------- several devices


def test_fsdp_spec_picks_the_largest_divisible_axis():
    # The last axis only counts when each shard holds whole 128-value groups.
    assert fsdp_spec((64, 1024), 4) == jax.sharding.PartitionSpec(None, "fsdp")
    assert fsdp_spec((64, 128), 4) == jax.sharding.PartitionSpec("fsdp", None)
    assert fsdp_spec((128, 128), 4) == jax.sharding.PartitionSpec("fsdp", None)
    assert fsdp_spec((258, 64), 4) == jax.sharding.PartitionSpec()
    assert fsdp_spec((6,), 4) == jax.sharding.PartitionSpec()
    assert fsdp_spec((64, 128), 1) == jax.sharding.PartitionSpec()
    # A last axis 128 does not divide: the split must keep whole groups of the flatten.
    assert fsdp_spec((128, 64), 4) == jax.sharding.PartitionSpec("fsdp", None)
    assert fsdp_spec((128, 258), 4) == jax.sharding.PartitionSpec()
    assert fsdp_spec((1, 128, 258), 2) == jax.sharding.PartitionSpec(None, "fsdp", None)


# ----------------------------------------------------------------------------- init_from


def test_init_from_a_checkpoint_folder_starts_from_its_weights(tmp_path, cache_dir):
    import dataclasses

    from flax import nnx

    from coat_jax.checkpoint_io import save_pretrained
    from coat_jax.llama import Llama, LlamaConfig

    base = tiny(tmp_path / "unused", cache_dir)
    model = Llama(LlamaConfig(**dataclasses.asdict(base.model)), rngs=nnx.Rngs(123))
    save_pretrained(model, tmp_path / "hf", format="hf")
    wanted = jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    # A learning rate of 1e-9 keeps the weights where init_from put them, to within 1e-8.
    run = [
        f"init_from={tmp_path / 'hf'}",
        "optimizer.learning_rate=1e-9",
        "optimizer.warmup_steps=0",
    ]
    first = train(tiny(tmp_path / "run", cache_dir, "steps=2", *run))
    got = jax.device_get(first.params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(wanted), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-7)
    # Resuming takes the architecture from the checkpoint, not from init_from's weights.
    resumed = train(tiny(tmp_path / "run", cache_dir, "steps=3", "resume=true", *run))
    assert resumed.step == 3

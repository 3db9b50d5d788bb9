"""Reliability of the trainer: asynchronous, checked checkpoints, faults, bad input, signals.

Fault injection on CPU with a Llama smaller than the default tiny one (hidden 32, one layer,
16-token windows): kill -9 during a checkpoint write, a full disk, SIGTERM during the first
compilation and while training, two trainers on one output_dir; and every bad input that used
to end in a traceback. Trainers run in child processes where the fault needs one (a signal, a
kill, a second process), in this process otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import coat_jax
from coat_jax.runs import CheckpointError, read_params
from coat_jax.training import Checkpointer, load_config, train
from coat_jax.training import checkpoint as checkpoint_mod
from coat_jax.training.checkpoint import CheckpointSaveError, _fmt_bytes, state_bytes
from coat_jax.training.errors import DivergedError
from coat_jax.training.optimizers import skip_nonfinite
from coat_jax.training.program import make_schedule
from tests.signals import stop_with_sigterm
from tests.tiny_runs import compilation_cache, tiny_run

REPO = Path(__file__).resolve().parents[2]

# Most runs share one program (the step's schedule length is compiled in): a long schedule,
# cut short with stop_at or a signal.
LONG = "steps=100000"
quiet = lambda line: None

MINI = [
    *tiny_run(hidden=32, intermediate=64, layers=1, heads=2, kv_heads=1, seq_len=16, batch_size=4),
    "eval.batches=2",
]


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> dict:
    """A small corpus (the repository's own docs) and the token and compilation caches."""
    root = tmp_path_factory.mktemp("caches")
    text = "\n\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    (root / "corpus.txt").write_text(text)
    return {
        "dir": root,
        "overrides": [
            f"data.path={root / 'corpus.txt'}",
            f"data.cache_dir={root / 'tokens'}",
            compilation_cache(root / "jax"),
        ],
    }


def mini_args(out, caches, *extra) -> list[str]:
    return [*MINI, f"output_dir={out}", *caches["overrides"], *extra]


def mini(out, caches, *extra):
    return load_config(REPO / "configs" / "default.yaml", mini_args(out, caches, *extra))


def records(out) -> list[dict]:
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(out) if "loss" in r}


def tree_bytes(tree) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def step_dirs(out) -> list[str]:
    return sorted(p.name for p in (Path(out) / "checkpoints").iterdir())


def child(*args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


def wait_for(predicate, proc, timeout=120.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"the trainer exited early ({proc.returncode}):\n{proc.stdout.read()}")
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting; trainer output:\n{proc.communicate()[0]}")
        time.sleep(0.05)


# ----------------------------------------------------------------------------- checkpointer


def _slow_metadata_write(monkeypatch, seconds: float) -> None:
    """Every checkpoint's write takes ``seconds`` longer, in Orbax's background commit."""
    original = ocp.JsonCheckpointHandler.async_save

    class Slow:
        def result(self, timeout=None):
            time.sleep(seconds)

    async def async_save(self, directory, item=None, args=None):
        return [*(await original(self, directory, item, args) or []), Slow()]

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "async_save", async_save)


def _state(seed: int, n: int = 1000):
    key = jax.random.key(seed)
    return {
        "params": {"w": jax.random.normal(key, (n,))},
        "opt_state": {
            "count": jnp.array(seed, jnp.int32),
            "codes": jnp.zeros(8, jnp.float8_e4m3fn),
        },
    }


def test_save_is_asynchronous_and_nonfinite_state_is_never_written(tmp_path, monkeypatch):
    ck = Checkpointer(tmp_path, keep=3, fingerprint={"run": "test"})
    ck.save(1, _state(1), data_position=4, seed=0, schedule_steps=10)
    ck.wait()
    _slow_metadata_write(monkeypatch, 2.0)
    started = time.perf_counter()
    ck.save(2, _state(2), data_position=8, seed=0, schedule_steps=10)
    returned = time.perf_counter() - started
    assert ck.steps() == [1]  # step 2 is still being written
    ck.wait()
    written = time.perf_counter() - started
    print(f"save returned after {returned:.3f} s, the write finished after {written:.3f} s")
    assert returned < 1.0 and written >= 2.0
    assert ck.steps() == [1, 2]

    bad = _state(3)
    bad["params"]["w"] = bad["params"]["w"].at[7].set(jnp.inf)
    with pytest.raises(DivergedError) as info:
        ck.save(3, bad, data_position=12, seed=0)
    message = str(info.value)
    assert "state at step 3 holds non-finite values (1 array(s), e.g. state['params']['w'])" in (
        message
    )
    assert "the newest complete checkpoint is step 2" in message
    assert ck.steps() == [1, 2] and not list(ck.directory.glob("3*"))

    meta = ck.latest_meta()
    assert (meta["step"], meta["data_position"], meta["schedule_steps"]) == (2, 8, 10)
    restored, _ = ck.restore(meta, jax.eval_shape(lambda: _state(2)), seed=0)
    assert tree_bytes(restored) == tree_bytes(_state(2))
    ck.close()


def test_fp8_state_grouped_along_the_last_axis_alone_is_refused_not_misread(tmp_path):
    # A (4, 64) weight's moments grouped along its last axis alone have statistics (4, 1);
    # grouped over its flatten they are (1, 2): such a checkpoint is refused before any read.
    params = {"w": jnp.zeros((4, 64))}
    state = coat_jax.coat_adamw(1e-3).init(params)
    old = jax.tree.map(lambda x: jnp.ones((4, 1), x.dtype) if x.shape == (1, 2) else x, state)
    ck = Checkpointer(tmp_path, keep=1, fingerprint={})
    ck.save(1, {"params": params, "opt_state": old}, data_position=0, seed=0)
    ck.wait()
    wanted = jax.eval_shape(lambda: {"params": params, "opt_state": state})
    with pytest.raises(CheckpointError) as info:
        ck.restore(ck.latest_meta(), wanted, seed=0)
    message = str(info.value)
    assert len(message.splitlines()) <= 2
    assert "start a new run with resume=false" in message
    assert (
        "mu_center['w']: checkpoint has [[4, 1], 'float32'], this run expects [[1, 2], 'float32']"
        in message
    )
    ck.close()


def test_save_refuses_a_disk_without_room_and_names_both_numbers(tmp_path, monkeypatch):
    ck = Checkpointer(tmp_path, keep=3, fingerprint={})
    ck.save(1, _state(1), data_position=0, seed=0)
    ck.wait()
    need = state_bytes(_state(2))
    real = shutil.disk_usage
    free = need - 1
    monkeypatch.setattr(checkpoint_mod.shutil, "disk_usage", lambda p: real(p)._replace(free=free))
    with pytest.raises(CheckpointSaveError) as info:
        ck.save(2, _state(2), data_position=0, seed=0)
    message = str(info.value)
    assert (
        f"it needs about {_fmt_bytes(need)} (the state's size) and {_fmt_bytes(free)} is free"
        in (message)
    )
    assert "the newest complete checkpoint is step 1" in message
    with pytest.raises(CheckpointSaveError, match=r"for a checkpoint .* it needs about .* is free"):
        ck.check_room(jax.eval_shape(lambda: _state(2)))
    assert ck.steps() == [1] and not list(ck.directory.glob("2*"))
    ck.close()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2.5 MiB tmpfs (needs root, as in this project's dev container; skipped elsewhere)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2560k", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_fails_the_write_with_its_reason_and_keeps_older_checkpoints(
    small_tmpfs, monkeypatch, capfd
):
    # 1 MiB of random floats per checkpoint: two fit in 2.5 MiB, the third runs out of space
    # mid-write. The free-space check is told there is room, as when another process fills
    # the disk during the write.
    real = shutil.disk_usage
    monkeypatch.setattr(checkpoint_mod.shutil, "disk_usage", lambda p: real(p)._replace(free=2**40))
    ck = Checkpointer(small_tmpfs, keep=5, fingerprint={})
    n = 2**18
    for step in (1, 2):
        ck.save(step, _state(step, n), data_position=step, seed=0)
        ck.wait()
    capfd.readouterr()
    ck.save(3, _state(3, n), data_position=3, seed=0)
    with pytest.raises(CheckpointSaveError) as info:
        ck.wait()
    message = str(info.value)
    assert "writing checkpoint step 3" in message and "No space left on device" in message
    assert "the newest complete checkpoint is step 2" in message
    assert "Traceback" not in capfd.readouterr().err  # Orbax's thread tracebacks are dropped
    assert ck.steps() == [1, 2] and step_dirs(small_tmpfs) == ["1", "2"]
    for step in (1, 2):
        params, meta = read_params(small_tmpfs, step)  # checksums verified
        assert meta["data_position"] == step
        np.testing.assert_array_equal(params["w"], np.asarray(_state(step, n)["params"]["w"]))
    ck.close()


def test_skip_nonfinite_leaves_the_state_alone_on_a_bad_gradient():
    tx = skip_nonfinite(optax.adam(0.1))
    params = {"w": jnp.array([1.0, -2.0])}
    state = tx.init(params)
    good = {"w": jnp.array([0.5, 0.25])}
    updates, state1 = tx.update(good, state, params)
    want_updates, want_state = optax.adam(0.1).update(good, state, params)
    assert tree_bytes((updates, state1)) == tree_bytes((want_updates, want_state))
    for bad in (jnp.nan, jnp.inf):
        grads = {"w": jnp.array([bad, 0.25])}
        updates, state2 = tx.update(grads, state1, params)
        assert np.all(np.asarray(updates["w"]) == 0)
        assert tree_bytes(state2) == tree_bytes(state1)


# ----------------------------------------------------------------------------- faults


def test_kill_9_during_a_checkpoint_write_and_a_second_trainer(tmp_path, caches, train_py):
    # The child trainer's write of checkpoint 4 never finishes, so it holds the lock (and
    # hangs at its next save, which waits for that one) until it is killed. The straight run
    # it is compared with needs no checkpoint but its last.
    run = (LONG, "checkpoint.every=2")
    straight = train(mini(tmp_path / "straight", caches, LONG), stop_at=6, say=quiet)
    out, marker = tmp_path / "killed", tmp_path / "writing"
    first = child(
        "tests/fault_child.py",
        "--block-save=4",
        f"--marker={marker}",
        "--",
        *mini_args(out, caches, *run),
    )
    try:
        wait_for(marker.exists, first)
        # The second trainer: train.py's command line, in this process.
        code, _, err = train_py(*mini_args(out, caches, *run))
        assert first.poll() is None
        first.kill()
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(
        f"error: OutputDirInUseError: output_dir {str(out)!r} is in use by another trainer "
        f"(pid {first.pid} on "
    ), err
    assert "wait for it to finish or stop it, or choose another output_dir" in err
    # Step 4 is in Orbax's temporary directory, step 2 complete; the dead trainer's lock stays.
    names = step_dirs(out)
    assert "2" in names and "4" not in names and any(n.startswith("4.") for n in names), names
    assert (out / "train.lock").exists()
    lines: list[str] = []
    resumed = train(mini(out, caches, *run, "resume=true"), stop_at=6, say=lines.append)
    said = "\n".join(lines)
    assert f"note: took over the lock of a trainer no longer running (pid {first.pid} on" in said
    assert re.search(r"removed 4\.orbax-checkpoint-tmp\S*: checkpoint\(s\) an interrupted", said)
    assert f"resumed from step 2 in {out / 'checkpoints'}" in said
    assert resumed.step == 6
    assert losses(out) == losses(tmp_path / "straight")
    assert sorted(losses(out)) == list(range(1, 7))
    assert tree_bytes(resumed.params) == tree_bytes(straight.params)
    assert tree_bytes(resumed.opt_state) == tree_bytes(straight.opt_state)
    assert step_dirs(out) == ["2", "4", "6"] and not (out / "train.lock").exists()


def test_a_size_limited_disk_is_an_error_and_older_checkpoints_survive(
    tmp_path, caches, monkeypatch
):
    # A disk that holds two and a half checkpoints: steps 2 and 4 fit; 6 does not (a warning,
    # training goes on) and neither does the last one at 8 (the error that ends the run).
    out = tmp_path / "run"
    cfg = mini(out, caches, LONG, "checkpoint.every=2", "checkpoint.keep=5")
    from coat_jax.training.program import build_program

    program = build_program(cfg, cfg.model)
    need = state_bytes({"params": program.abstract_params, "opt_state": program.abstract_opt_state})
    real = shutil.disk_usage

    def limited(path):
        complete = [p for p in (out / "checkpoints").iterdir() if p.name.isdigit()]
        return real(path)._replace(free=int((2.5 - len(complete)) * need))

    monkeypatch.setattr(checkpoint_mod.shutil, "disk_usage", limited)
    lines: list[str] = []
    with pytest.raises(CheckpointSaveError) as info:
        train(cfg, stop_at=8, say=lines.append)
    message = str(info.value)
    assert message.startswith("not enough free space for checkpoint step 8")
    assert f"it needs about {_fmt_bytes(need)}" in message
    assert f"and {_fmt_bytes(0.5 * need)} is free" in message
    assert "the newest complete checkpoint is step 4" in message
    said = "\n".join(lines)
    assert "warning: after checkpoint step 4 about" in said
    assert "warning: not enough free space for checkpoint step 6" in said
    assert (
        (out / "train.log").read_text().rstrip().endswith(f"error: CheckpointSaveError: {message}")
    )
    assert step_dirs(out) == ["2", "4"]
    assert sorted(losses(out)) == list(range(1, 9))
    for step in (2, 4):
        assert read_params(out, step)[1]["step"] == step

    # A disk without room for one checkpoint is refused before the first step.
    fresh = tmp_path / "fresh"
    monkeypatch.setattr(
        checkpoint_mod.shutil, "disk_usage", lambda p: real(p)._replace(free=need // 2)
    )
    with pytest.raises(
        CheckpointSaveError, match=r"for a checkpoint .* it needs about .* and .* is free"
    ):
        train(mini(fresh, caches, LONG), stop_at=8, say=quiet)
    assert records(fresh) == [] and step_dirs(fresh) == []


def test_sigterm_saves_within_a_step(tmp_path, caches):
    out = tmp_path / "run"
    # log_every=1000: the loss is still checked at every step (bounded dispatch), not logged.
    proc = child("train.py", *mini_args(out, caches, LONG, "logging.every=1000"))
    wait_for(lambda: (out / "metrics.jsonl").exists() and records(out), proc)
    output = stop_with_sigterm(proc)
    finished = int(re.search(r"received SIGTERM after step (\d+)", output).group(1))
    (saved,) = [int(n) for n in step_dirs(out)]
    print(f"SIGTERM after step {finished} finished; checkpoint at step {saved}")
    # At most the step in flight and the one being dispatched run after the signal.
    assert finished <= saved <= finished + 2
    assert f"stopped at step {saved} by SIGTERM; checkpoint saved" in output
    assert "Traceback" not in output and not (out / "train.lock").exists()


def test_sigterm_during_the_first_compilation_stops_at_once(tmp_path, caches):
    out = tmp_path / "run"
    # No compilation cache (the trainer's nor the test run's): the first step compiles for
    # seconds, and the signal comes in them.
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    proc = child(
        "train.py", *mini_args(out, caches, LONG, "xla.compilation_cache_dir=null"), env=env
    )
    for line in proc.stdout:
        if "compiling the train step" in line:
            break
    output = stop_with_sigterm(proc)
    assert "received SIGTERM while compiling the train step: stopping (no step has run)" in output
    assert (
        "stopped by SIGTERM before the first step ran; nothing to save (the run is at step 0"
        in (output)
    )
    assert "Traceback" not in output
    assert step_dirs(out) == [] and records(out) == []
    assert not (out / "train.lock").exists()


# ----------------------------------------------------------------------------- bad input


def _bad_inputs(tmp_path) -> dict:
    (tmp_path / "a_file").write_text("not a directory")
    hf = tmp_path / "hf_without_weights"
    hf.mkdir()
    hf_config = mini(tmp_path, {"overrides": []}).model.to_hf_dict(torch_dtype="float32")
    (hf / "config.json").write_text(json.dumps(hf_config))
    broken = tmp_path / "hf_broken_config"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1") * 100)
    other = tmp_path / "other_run"
    other.mkdir()
    (other / "config.yaml").write_text("steps: 5\n")
    (other / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    return {
        "output_dir is a file": (
            [f"output_dir={tmp_path / 'a_file'}"],
            r"output_dir '.*a_file' is a file, not a directory; choose another output_dir",
        ),
        "init_from without weights": (
            [f"init_from={hf}"],
            r"init_from='.*hf_without_weights': no \*\.safetensors files in .*; give a Hugging "
            r"Face or coat-jax folder",
        ),
        "init_from with a broken config": (
            [f"init_from={broken}"],
            r"init_from='.*hf_broken_config': its config lacks the key 'vocab_size'; give a "
            r"complete Llama config\.json",
        ),
        "data not UTF-8": (
            [f"data.path={tmp_path / 'latin1.txt'}"],
            r"data file '.*latin1\.txt' is not UTF-8 text \(byte 3: invalid continuation byte\); "
            r"convert it to UTF-8",
        ),
        "seq_len too long": (
            ["data.seq_len=4096"],
            r"data.seq_len=4096 is longer than model\.max_position_embeddings=2048; lower seq_len",
        ),
        "another run's files": (
            [f"output_dir={other}"],
            r"output_dir '.*other_run' holds another run's config\.yaml, metrics\.jsonl but no "
            r"checkpoint; choose another output_dir, or pass overwrite=true",
        ),
        "resume and overwrite": (
            ["resume=true", "overwrite=true"],
            r"resume=true continues the run in output_dir and overwrite=true deletes it",
        ),
    }


BAD_INPUTS = [
    "output_dir is a file",
    "init_from without weights",
    "init_from with a broken config",
    "data not UTF-8",
    "seq_len too long",
    "another run's files",
    "resume and overwrite",
]


def file_digest(root) -> dict[str, bytes]:
    return {str(f): f.read_bytes() for f in sorted(Path(root).rglob("*")) if f.is_file()}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_line_exit_code_2_and_changes_no_file(tmp_path, caches, train_py, case):
    extra, message = _bad_inputs(tmp_path)[case]
    before = file_digest(tmp_path)
    code, _, err = train_py(*mini_args(tmp_path / "run", caches, "steps=4", *extra))
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert re.search(message, err), err
    # A run refused while setting up writes nothing (no train.log, no lock left behind).
    assert file_digest(tmp_path) == before


def test_a_diverged_run_exits_3_naming_the_newest_finite_checkpoint(tmp_path, caches, train_py):
    out = tmp_path / "run"
    code, _, err = train_py(
        *mini_args(out, caches, LONG, "optimizer.learning_rate=1e6", "checkpoint.every=2")
    )
    assert code == 3, err
    assert err.count("\n") == 1 and err.startswith("error: DivergedError: "), err
    assert "stopping without saving" in err and "lower learning_rate" in err
    saved = [int(n) for n in step_dirs(out)]
    if saved:
        assert f"the newest complete checkpoint is step {max(saved)}" in err
    else:
        assert "there is no complete checkpoint" in err
    # Whatever was saved is finite (read_params verifies checksums; the values are checked here).
    for step in saved:
        params, _ = read_params(out, step)
        assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(params))
    assert (out / "train.log").read_text().rstrip().endswith(err.strip())


def test_skip_nonfinite_steps_skips_counts_and_then_stops(tmp_path, caches, train_py):
    # learning_rate=1e6 makes every step from the 4th on non-finite; three are skipped.
    out = tmp_path / "run"
    args = mini_args(out, caches, LONG, "optimizer.learning_rate=1e6", "checkpoint.every=2")
    code, _, err = train_py(*args, "optimizer.skip_nonfinite_steps=3")
    assert code == 3, err
    skipped = {r["step"]: r["skipped_steps"] for r in records(out)}
    first = min(s for s, n in skipped.items() if n == 1)
    assert [skipped[first + i] for i in range(3)] == [1, 2, 3]
    assert all("loss" not in r for r in records(out) if r["step"] >= first)
    assert f"step {first + 3} is non-finite" in err
    assert "4 such steps, more than optimizer.skip_nonfinite_steps=3" in err
    # A skipped step leaves the state as it was: the checkpoints after the first skip are equal.
    saved = [s for s in (int(n) for n in step_dirs(out)) if s >= first]
    assert len(saved) >= 2, step_dirs(out)
    kept = [tree_bytes(read_params(out, s)[0]) for s in saved]
    assert all(k == kept[0] for k in kept)


def test_resume_keeps_the_schedule_unless_asked_and_overwrite_replaces_a_run(tmp_path, caches):
    # A finished 4-step run, resumed for more steps: its schedule is kept (the learning rate
    # stays at the floor) unless reschedule=true spreads it over the new steps.
    first = mini(tmp_path / "keep", caches, "steps=4")
    train(first, say=quiet)
    shutil.copytree(tmp_path / "keep", tmp_path / "reschedule")
    more = (LONG, "resume=true")
    lines: list[str] = []
    train(mini(tmp_path / "keep", caches, *more), stop_at=8, say=lines.append)
    assert any(
        "note: steps=100000, but the learning-rate schedule stays the original run's (4 steps; "
        "after step 4 the rate stays at its floor" in line
        for line in lines
    ), lines
    lines = []
    rescheduled = mini(tmp_path / "reschedule", caches, *more, "reschedule=true")
    train(rescheduled, stop_at=8, say=lines.append)
    assert any(
        "reschedule=true: the learning-rate schedule now spans 100000 steps" in x for x in lines
    )
    rate = lambda out: {r["step"]: r["learning_rate"] for r in records(out) if "loss" in r}
    later = range(5, 9)
    over_4, over_long = make_schedule(first), make_schedule(rescheduled)
    assert [rate(tmp_path / "keep")[s] for s in later] == [float(over_4(s - 1)) for s in later]
    assert [rate(tmp_path / "reschedule")[s] for s in later] == [
        float(over_long(s - 1)) for s in later
    ]
    assert float(over_4(4)) != float(over_long(4))

    # A new run there: refused, unless overwrite=true; save_final=false writes no checkpoint.
    keep = tmp_path / "keep"
    with pytest.raises(ValueError, match=r"already holds checkpoints \(steps \[4, 8\]\)"):
        train(mini(keep, caches, "steps=4"), say=quiet)
    lines = []
    result = train(
        mini(keep, caches, "steps=4", "overwrite=true", "checkpoint.save_final=false"),
        say=lines.append,
    )
    assert result.step == 4 and step_dirs(keep) == []
    assert any("overwrite=true: deleting the previous run's checkpoints [4, 8]" in x for x in lines)
    assert "no final checkpoint (save_final=false)" in lines[-1]
    assert sorted(losses(keep)) == list(range(1, 5))


@pytest.mark.slow
def test_soak_2000_steps_with_checkpoints_and_resumes_equal_the_straight_run(tmp_path, caches):
    run = ("steps=2000", "checkpoint.every=50", "eval.every=100000")
    quiet = lambda line: None
    started = time.perf_counter()
    straight = train(mini(tmp_path / "straight", caches, *run), say=quiet)
    straight_s = time.perf_counter() - started
    out = tmp_path / "pieces"
    result = train(mini(out, caches, *run), stop_at=500, say=quiet)
    for stop in (1000, 1500, 2000):
        assert result.step == stop - 500 and str(result.step) in step_dirs(out)
        result = train(mini(out, caches, *run, "resume=true"), stop_at=stop, say=quiet)
    print(f"soak: straight run {straight_s:.1f} s, all {time.perf_counter() - started:.1f} s")
    assert result.step == 2000
    assert losses(out) == losses(tmp_path / "straight")
    assert sorted(losses(out)) == list(range(1, 2001))
    assert tree_bytes(result.params) == tree_bytes(straight.params)
    assert tree_bytes(result.opt_state) == tree_bytes(straight.opt_state)


def test_warm_host_memory_allocates_pinned_shards_off_the_loop(tmp_path, monkeypatch, caplog):
    """The first save's pinned host buffers: made in a background thread, one per local shard;
    nothing on a backend that is not a GPU (Orbax copies without pinned memory there)."""
    state = {"w": jnp.ones((4, 8), jnp.float32), "c": jnp.zeros((16,), jnp.float8_e4m3fn)}
    ck = Checkpointer(tmp_path, keep=1, fingerprint={})
    try:
        assert ck.warm_host_memory(state) is None  # the CPU backend
        made = []
        real_put = jax.device_put

        def put(x, sharding):
            made.append((x.shape, x.dtype, sharding.memory_kind))
            return real_put(x, sharding)

        monkeypatch.setattr(checkpoint_mod.jax, "default_backend", lambda: "gpu")
        monkeypatch.setattr(checkpoint_mod.jax, "device_put", put)
        thread = ck.warm_host_memory(state)
        assert thread is not None
        thread.join(timeout=60)
        assert not thread.is_alive()
        assert "not warmed" not in caplog.text
        assert sorted(made, key=str) == sorted(
            [
                ((4, 8), np.dtype(np.float32), "pinned_host"),
                ((16,), state["c"].dtype, "pinned_host"),
            ],
            key=str,
        )
    finally:
        ck.close()

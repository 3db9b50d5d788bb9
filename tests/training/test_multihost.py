"""Multi-process training: ``train.py`` under a launcher, 2 processes x 4 CPU devices; and one
process of 8 CPU devices against one device.

The start-up rules of ``coat_jax.training.distributed`` are checked on environments given as
dicts; the end-to-end test starts ``train.py`` twice with the ``COAT_JAX_*`` variables and a
coordinator on 127.0.0.1 (JAX's CPU backend runs cross-process collectives over gloo), stops
both with a signal to one, resumes both, and compares the finished run with one process driving
all 8 devices of the same ``(data=2, fsdp=4)`` mesh.

Bit-equality is not possible there: the in-process CPU all-reduce and gloo's add the 8 partial
sums (gradients, the loss) in different orders, which changes float32 results in the last bit
(docs/sharding.md has the measurement). The runs agree to a few float32 ulps instead.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from coat_jax.runs import read_params
from coat_jax.training import distributed
from tests.fake_devices import xla_flags
from tests.tiny_runs import tiny_run

ROOT = Path(__file__).resolve().parents[2]

COAT_JAX = {
    "COAT_JAX_COORDINATOR": "127.0.0.1:1234",
    "COAT_JAX_NUM_PROCESSES": "2",
    "COAT_JAX_PROCESS_ID": "1",
}
SLURM = {
    "SLURM_JOB_ID": "7",
    "SLURM_STEP_NODELIST": "node[1-2]",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
}


# --- which launcher, from the environment ---------------------------------------------------


def test_no_launcher_means_one_process():
    assert distributed.launcher({}) is None
    assert distributed.maybe_initialize({}) is False
    # A Slurm allocation of one task, or an sbatch script outside srun, is one process.
    assert distributed.launcher({**SLURM, "SLURM_NTASKS": "1"}) is None
    assert distributed.launcher({**SLURM, "SLURM_STEP_NUM_TASKS": "1"}) is None
    assert distributed.launcher({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "1"}) is None


def test_launchers_are_detected():
    assert distributed.launcher(COAT_JAX) == "coat_jax"
    assert distributed.launcher(SLURM) == "slurm"
    assert distributed.launcher({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "4"}) == (
        "ompi"
    )
    assert distributed.launcher({**SLURM, "COAT_JAX_DISTRIBUTED": "off"}) is None


def test_explicit_variables_become_initialize_arguments():
    args = distributed._explicit_args({**COAT_JAX, "COAT_JAX_LOCAL_DEVICE_IDS": "2,3"})
    assert args == {
        "coordinator_address": "127.0.0.1:1234",
        "num_processes": 2,
        "process_id": 1,
        "local_device_ids": [2, 3],
    }


@pytest.mark.parametrize(
    "env,match",
    [
        ({"COAT_JAX_COORDINATOR": "127.0.0.1:1234"}, "COAT_JAX_NUM_PROCESSES is not"),
        ({**COAT_JAX, "COAT_JAX_COORDINATOR": "127.0.0.1"}, "not host:port"),
        ({**COAT_JAX, "COAT_JAX_PROCESS_ID": "2"}, r"must be in \[0, COAT_JAX_NUM_PROCESSES=2\)"),
        ({**COAT_JAX, "COAT_JAX_NUM_PROCESSES": "two"}, "'two' is not an integer"),
        ({**COAT_JAX, "COAT_JAX_LOCAL_DEVICE_IDS": "0;1"}, "comma-separated"),
    ],
)
def test_bad_explicit_variables_name_the_fix(env, match):
    with pytest.raises(ValueError, match=match):
        distributed.maybe_initialize(env)


def test_half_set_or_unknown_switches_are_refused():
    with pytest.raises(ValueError, match="COAT_JAX_PROCESS_ID is set but COAT_JAX_COORDINATOR"):
        distributed.launcher({"COAT_JAX_PROCESS_ID": "0"})
    with pytest.raises(ValueError, match="'no' is not one of 'auto', 'off'"):
        distributed.launcher({**SLURM, "COAT_JAX_DISTRIBUTED": "no"})


def test_too_late_to_initialize_says_why():
    jax.devices()  # this process's backend is running
    with pytest.raises(RuntimeError, match="before JAX uses a device"):
        distributed.maybe_initialize(COAT_JAX)


def test_one_process_puts_batches_as_before():
    batch = np.arange(2 * 8 * 5, dtype=np.int32).reshape(2, 8, 5)
    mesh = jax.make_mesh((1, 1), ("data", "fsdp"))
    from coat_jax.training import sharding

    reads = []

    def read(rows):
        reads.append(rows)
        return batch.reshape(16, 5)[rows]

    placed = sharding.put_rows(
        read, batch.shape, sharding.batch_sharding(mesh, batch_axis=1, rank=3)
    )
    np.testing.assert_array_equal(np.asarray(placed), batch)
    # One read of every row, in order.
    assert len(reads) == 1 and reads[0].tolist() == list(range(16))


class _FourWaysOfTheBatchAxis:
    """A sharding's ``devices_indices_map`` for a ``(accum, batch, T)`` batch whose batch axis
    is split over four devices ``d0..d3``, the accumulation axis whole on each."""

    def devices_indices_map(self, shape):
        quarter = shape[1] // 4
        return {
            f"d{i}": (slice(None), slice(i * quarter, (i + 1) * quarter), slice(None))
            for i in range(4)
        }


def test_the_rows_of_two_processes_are_disjoint_and_cover_the_batch():
    from coat_jax.training import sharding

    shape, split = (2, 8, 5), _FourWaysOfTheBatchAxis()
    first = sharding.batch_rows(shape, split, ["d0", "d1"])
    second = sharding.batch_rows(shape, split, ["d2", "d3"])
    # Rows are flattened over (accum, batch): process 0 holds sequences 0-3 of each micro-batch.
    assert first.tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert second.tolist() == [4, 5, 6, 7, 12, 13, 14, 15]


def test_one_process_stops_on_its_own_signal_at_once():
    agreement = distributed.StopAgreement(say=pytest.fail)
    assert not agreement.several and not hasattr(agreement, "_reduce")  # nothing to compile
    assert agreement.stop(None) is None
    assert agreement.stop(signal.SIGTERM) == signal.SIGTERM  # this boundary, not the next
    assert agreement.final(signal.SIGINT) == signal.SIGINT


# --- two processes against one ----------------------------------------------------------------

# A learning rate flat after the warmup (the cosine's floor is its peak): the two-process run,
# whose schedule spans the steps=100000 it started with, and the one-process run of the steps it
# ends at then take the same rate at every step.
RUN = [
    *tiny_run(layers=1),
    "optimizer.min_lr_ratio=1.0",
    "eval.batches=1",
    "precision.compute_dtype=float32",
    "xla.compilation_cache_dir=null",
    "mesh.data=2",
    "mesh.fsdp=4",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, extra_env: dict, *flags: str) -> dict[str, str]:
    env = dict(
        os.environ,
        XLA_FLAGS=xla_flags(devices, *flags),
        JAX_PLATFORMS="cpu",
        JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
        PYTHONPATH=str(ROOT),
        **extra_env,
    )
    for name in list(env):
        if name.startswith(("COAT_JAX_", "SLURM_", "OMPI_")) and name not in extra_env:
            del env[name]
    return env


def _start(out: Path, cache: Path, extra_env: dict, args=(), tag="") -> subprocess.Popen:
    """train.py as one of two processes of 4 devices each."""
    name = f"{out.name}{tag}.{extra_env['COAT_JAX_PROCESS_ID']}.log"
    log = open(out.parent / name, "w")
    return subprocess.Popen(
        [sys.executable, "train.py", *RUN, f"output_dir={out}", f"data.cache_dir={cache}", *args],
        cwd=ROOT,
        env=_env(4, extra_env),
        stdout=log,
        stderr=subprocess.STDOUT,
    )


# One process driving 8 devices trains the run of the two processes' steps on their (data=2,
# fsdp=4) mesh, then the same run on one of its devices (test_eight_devices_match_one's numbers),
# and lays out COAT's state on that mesh as train() does; its report goes to a JSON file.
ONE_PROCESS = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp
    from coat_jax import coat_adamw
    from coat_jax.training import load_config, sharding, train
    # Fake CPU devices share a small thread pool; one program at a time keeps their
    # collectives from waiting on each other.
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    args = json.loads(sys.argv[1])
    assert len(jax.devices()) == 8, jax.devices()
    report = {}
    for name, mesh in (("eight", []), ("one", ["mesh.data=1", "mesh.fsdp=1"])):
        cfg = load_config(args["config"], args["overrides"] + [f"output_dir={args[name]}"] + mesh)
        r = train(cfg)
        report[name] = {
            "val_loss": r.val_loss,
            "devices": sorted({d.id for x in jax.tree.leaves(r.params) for d in x.devices()}),
            "params": {jax.tree_util.keystr(p): x.tolist() for p, x in
                       jax.tree_util.tree_flatten_with_path(jax.device_get(r.params))[0]},
        }
    mesh = sharding.make_mesh(2, 4)
    params = {"q_proj": jnp.ones((64, 64)), "up_proj": jnp.ones((64, 128)), "lm_head": jnp.ones((64, 258))}
    params = jax.device_put(params, sharding.param_shardings(params, mesh))
    state = coat_adamw(1e-3).init(params)
    state = jax.device_put(state, sharding.state_shardings(state, params, mesh))
    flat = jax.tree_util.tree_flatten_with_path({"params": params, "opt": state})[0]
    report["coat_specs"] = {
        jax.tree_util.keystr(p): [str(x.dtype), list(x.shape), list(x.sharding.spec)] for p, x in flat
    }
    with open(args["report"], "w") as f:
        json.dump(report, f)
    """
)


def _start_one_process(tmp_path: Path, cache: Path, steps: int) -> subprocess.Popen:
    """:data:`ONE_PROCESS` over ``steps`` steps: the 8-device run's folder is
    ``tmp_path/one_process``, the one-device run's ``tmp_path/one_device``, the report
    ``tmp_path/one_process.json``."""
    args = {
        "config": str(ROOT / "configs" / "default.yaml"),
        "overrides": [*RUN, f"data.cache_dir={cache}", f"steps={steps}"],
        "eight": str(tmp_path / "one_process"),
        "one": str(tmp_path / "one_device"),
        "report": str(tmp_path / "one_process.json"),
    }
    log = open(tmp_path / "one_process.single.log", "w")
    return subprocess.Popen(
        [sys.executable, "-c", ONE_PROCESS, json.dumps(args)],
        cwd=ROOT,
        env=_env(8, {}, "--xla_cpu_collective_call_terminate_timeout_seconds=120"),
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _kill_survivors(procs: dict[str, subprocess.Popen]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _logs(tmp_path: Path) -> dict[str, str]:
    return {p.name: p.read_text()[-3000:] for p in tmp_path.glob("*.log")}


def _wait(procs: dict[str, subprocess.Popen], tmp_path: Path, timeout: float) -> None:
    try:
        for proc in procs.values():
            proc.wait(timeout=timeout)
    finally:
        _kill_survivors(procs)
    logs = _logs(tmp_path)
    failed = {name: proc.returncode for name, proc in procs.items() if proc.returncode}
    assert not failed, (failed, logs)


def _two_processes(out: Path, cache: Path, args=(), tag="") -> dict[str, subprocess.Popen]:
    port = _free_port()
    return {
        f"process {i}": _start(
            out,
            cache,
            {
                "COAT_JAX_COORDINATOR": f"127.0.0.1:{port}",
                "COAT_JAX_NUM_PROCESSES": "2",
                "COAT_JAX_PROCESS_ID": str(i),
            },
            args,
            tag,
        )
        for i in range(2)
    }


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_sigterm_to_one_of_two_processes_stops_both_and_the_resumed_run_matches_one_process(
    tmp_path, trainer_caches
):
    """2 processes x 4 devices: SIGTERM to process 1 alone stops both at the same step; both
    resume from its checkpoint and finish; the whole run then matches one process driving all 8
    devices of the same mesh over the same steps (resuming is bit-exact:
    tests/training/test_train.py), and that process's run on one of its devices matches its run
    on all 8 (:func:`_assert_eight_devices_match_one`)."""
    # A signal that reaches process 1 only: without the processes' agreement process 1 alone
    # stops and saves, and both then wait for each other (in a collective, or in Orbax's save),
    # until the timeouts below.
    # The token cache is written atomically: the runs may race to write it.
    cache, out = trainer_caches / "tokens", tmp_path / "two_processes"
    # A shared compilation cache: the resumed run compiles less (about 10 s here).
    xla = f"xla.compilation_cache_dir={tmp_path / 'xla'}"
    procs = _two_processes(out, cache, ["steps=100000", xla])
    try:
        deadline = time.monotonic() + 240
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert all(p.poll() is None for p in procs.values()), "a process ended early"
            assert time.monotonic() < deadline, "no step finished in 240 s"
            time.sleep(0.1)
        procs["process 1"].send_signal(signal.SIGTERM)
        start = time.monotonic()
        for proc in procs.values():
            proc.wait(timeout=max(1.0, 90 - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        alive = [name for name, p in procs.items() if p.poll() is None]
        pytest.fail(f"{alive} still running 90 s after SIGTERM to process 1 (a hang)")
    finally:
        _kill_survivors(procs)
    logs = _logs(tmp_path)
    codes = {name: p.returncode for name, p in procs.items()}
    assert codes == {"process 0": 128 + signal.SIGTERM, "process 1": 128 + signal.SIGTERM}, logs
    own = (out / "processes" / "1" / "train.log").read_text()
    main = (out / "train.log").read_text()
    finished = int(re.search(r"received SIGTERM after step (\d+)", own).group(1))
    assert "received SIGTERM after" not in main
    assert "another process received SIGTERM: stopping with it" in main
    # One complete checkpoint, at the step both processes report; both processes took part in it
    # (Orbax writes from all of them) and it reads back whole.
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert not [n for n in names if "tmp" in n], names
    (saved,) = [int(n) for n in names if n.isdigit()]
    for text in (main, own):
        assert f"stopped at step {saved} by SIGTERM; checkpoint saved" in text, text[-2000:]
    # The step in flight and at most two more (one boundary's agreement) ran after the signal.
    print(f"SIGTERM to process 1 after step {finished}: both stopped at step {saved}")
    assert finished < saved <= finished + 3
    assert read_params(out)[1]["step"] == saved
    assert [r["step"] for r in _records(out) if "loss" in r] == list(range(1, saved + 1))

    # Both processes resume from it and finish two more steps, while one process of 8 devices
    # runs the same steps from the start.
    end = saved + 2
    procs = _two_processes(out, cache, [f"steps={end}", "resume=true", xla], ".resumed")
    single = tmp_path / "one_process"
    procs["one process"] = _start_one_process(tmp_path, cache, end)
    _wait(procs, tmp_path, timeout=300)
    assert f"resumed from step {saved} in" in (out / "train.log").read_text()
    two, one = _records(out), _records(single)
    assert [r["step"] for r in two if "loss" in r] == list(range(1, end + 1))
    assert "val_loss" in two[-1]
    # Process 0 alone wrote the metrics (one record per step, not two), the config and the plot;
    # process 1 kept only its own train.log.
    assert [r["step"] for r in two] == [r["step"] for r in one]
    assert (out / "config.yaml").is_file() and (out / "loss_curve.png").is_file()
    assert sorted(p.name for p in (out / "processes" / "1").iterdir()) == ["train.log"]
    # Process 0 tokenized (or found the cache another run wrote) while process 1 waited for
    # it; each read only its own devices' half of every batch.
    second = (out / "processes" / "1" / "train.log").read_text()
    assert "tokenized" not in second
    assert "process 1 of 2 reads 4 of the 8 sequences of each step" in second
    assert "process 0 of 2 reads 4 of the 8 sequences of each step" in (
        (out / "train.log").read_text()
    )
    losses = [(a["loss"], b["loss"]) for a, b in zip(two, one, strict=True) if "loss" in a]
    worst = max(abs(a - b) / b for a, b in losses)
    # The final checkpoint, written by both processes, reads back whole, and its parameters are
    # the single-process run's to float32 rounding.
    p2, meta2 = read_params(out)
    p1, meta1 = read_params(single)
    assert meta2["step"] == meta1["step"] == end
    flat2 = np.concatenate([np.ravel(x) for x in jax.tree.leaves(p2)])
    flat1 = np.concatenate([np.ravel(x) for x in jax.tree.leaves(p1)])
    rel = float(np.linalg.norm(flat2 - flat1) / np.linalg.norm(flat1))
    print(
        f"2 processes vs 1 over {end} steps: worst relative loss difference {worst:.2e}, "
        f"relative parameter difference {rel:.2e}, {int(np.sum(flat2 != flat1))} of "
        f"{flat1.size} parameters differ"
    )
    # Not bit-equal: gloo's all-reduce adds the partial sums in another order than one process
    # does, an ulp in a gradient now and then moves an FP8 moment code across a rounding tie,
    # and Adam turns that into a parameter step a fraction of the learning rate different
    # (docs/sharding.md, "Measured on the CPU").
    assert worst < 1e-6
    assert rel < 5e-5
    assert two[-1]["val_loss"] == pytest.approx(one[-1]["val_loss"], rel=1e-5)
    _assert_eight_devices_match_one(tmp_path)


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(out) if "loss" in r}


def _assert_eight_devices_match_one(tmp_path: Path) -> None:
    """:data:`ONE_PROCESS`'s run on 8 devices matches its run on one, with the default
    optimizer, coat_adamw, whose FP8 moments are sharded like their parameters; and COAT's
    state is placed on the mesh as FSDP wants it."""
    report = json.loads((tmp_path / "one_process.json").read_text())
    one, eight = report["one"], report["eight"]
    assert one["devices"] == [0] and eight["devices"] == list(range(8))
    l1, l8 = _losses(tmp_path / "one_device"), _losses(tmp_path / "one_process")
    assert sorted(l1) == sorted(l8)
    worst = max(abs(l1[s] - l8[s]) / l1[s] for s in l1)
    p1 = np.concatenate([np.ravel(one["params"][k]) for k in sorted(one["params"])])
    p8 = np.concatenate([np.ravel(eight["params"][k]) for k in sorted(one["params"])])
    rel = float(np.linalg.norm(p1 - p8) / np.linalg.norm(p1))
    print(
        f"8 vs 1 device: worst relative loss difference {worst:.2e}, relative parameter "
        f"difference {rel:.2e}, largest single parameter difference {np.max(np.abs(p1 - p8)):.2e}"
    )
    # 8 devices sum gradients in another order. Adam turns near-zero gradient components into
    # full-size steps (early on the update is about sign(g)), so single parameters can move by
    # ~lr; the bounds leave a wide margin over the distances this test prints. bfloat16 compute
    # would make them larger, which is why this comparison runs in float32.
    assert worst < 1e-4
    assert rel < 5e-3
    assert abs(one["val_loss"] - eight["val_loss"]) / one["val_loss"] < 1e-4
    # FSDP placement of COAT's state: FP8 codes take their parameter's spec; per-group
    # statistics (shape p.shape[:-1] + (groups,) where 128 divides the last axis, else grouped
    # over the flatten, the row split moving to the flattened axis) keep it where it divides.
    specs = report["coat_specs"]
    assert specs["['params']['q_proj']"] == ["float32", [64, 64], ["fsdp", None]]
    assert specs["['params']['up_proj']"] == ["float32", [64, 128], ["fsdp", None]]
    # 16 rows of 258 values per shard would split the groups of its flatten: replicated.
    assert specs["['params']['lm_head']"] == ["float32", [64, 258], []]
    for field in ("mu_codes", "nu_codes"):
        codes = {k.rsplit("[", 1)[1]: v for k, v in specs.items() if f".{field}[" in k}
        assert codes["'q_proj']"] == ["float8_e4m3fn", [64, 64], ["fsdp", None]]
        assert codes["'up_proj']"] == ["float8_e4m3fn", [64, 128], ["fsdp", None]]
    for field in ("mu_scale", "mu_expand", "mu_center", "nu_scale"):
        stats = {k.rsplit("[", 1)[1]: v for k, v in specs.items() if f".{field}[" in k}
        assert stats["'q_proj']"] == ["float32", [1, 32], [None, "fsdp"]]
        assert stats["'up_proj']"] == ["float32", [64, 1], ["fsdp", None]]
        assert stats["'lm_head']"] == ["float32", [1, 129], [None, None]]

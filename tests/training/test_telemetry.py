"""coat_jax.training.telemetry: the optimizer state's quantization error and counts per step."""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend.core import jaxprs_in_params

from coat_jax import coat_adamw, fp8_state, optim, quant
from coat_jax.optim import dequantized_moments
from coat_jax.training import load_config, program, train
from coat_jax.training.optimizers import make_optimizer
from coat_jax.training.step import with_rounding_count
from coat_jax.training.telemetry import (
    COMPUTED,
    StateTelemetry,
    logged_metrics,
    state_telemetry,
    tensor_names,
)
from coat_jax.training.telemetry_sample import SamplePlan
from tests.fake_devices import run_on_fake_devices
from tests.jaxprs import pallas_calls
from tests.placement import committed
from tests.training.test_cli import _scalars
from tests.training.test_train import tiny, tree_bytes

B1, B2, CLIP = 0.9, 0.95, 0.5


SHAPES = {"w": (40, 300), "b": (256,), "up": (3, 24, 256)}


def problem(shapes=SHAPES, seed=0):
    """Parameters (by default: a short last group, a vector, a stacked-layer tensor) and
    gradients drawn per step, with moments that span several decades."""
    keys = jax.random.split(jax.random.key(seed), 4)
    params = {k: jax.random.normal(keys[0], s) for k, s in shapes.items() if k != "up"}
    params["layers"] = {"up": jax.random.normal(keys[2], shapes["up"])}

    def grads(step):
        leaves, treedef = jax.tree.flatten(params)
        ks = jax.random.split(jax.random.fold_in(keys[3], step), len(leaves))
        spread = [
            jnp.exp(3 * jax.random.normal(k, p.shape)) for k, p in zip(ks, leaves, strict=True)
        ]
        return treedef.unflatten(
            [
                s * jax.random.normal(k, p.shape)
                for s, k, p in zip(spread, ks[::-1], leaves, strict=True)
            ]
        )

    return params, grads


STEPS = 3


def run(tx, telemetries: dict):
    """``STEPS`` steps of ``tx`` in one jitted program, each observed by every telemetry in
    ``telemetries``: per step the metrics by telemetry name, the states around the last step.
    Every telemetry's updates and new state must be ``tx``'s, bit for bit."""
    params, grads = problem()
    params, state = committed((params, tx.init(params)))

    def step(g, s, p):
        results = {name: t.update(tx, g, s, p) for name, t in telemetries.items()}
        return tx.update(g, s, p), results

    step = jax.jit(step)
    per_step = []
    for i in range(STEPS):
        before = state
        (updates, state), results = step(grads(i), state, params)
        for name, (u, s, _) in results.items():
            assert tree_bytes((u, s)) == tree_bytes((updates, state)), (name, i)
        params = optax.apply_updates(params, updates)
        per_step.append(jax.device_get({name: r[2] for name, r in results.items()}))
    return per_step, before, state


def clipped(tx):
    return optax.chain(optax.clip_by_global_norm(CLIP), tx)


ADAMW = optax.adamw(1e-3, b1=B1, b2=B2)
COAT = StateTelemetry(b1=B1, b2=B2, grad_clip=CLIP)
# Per optimizer, the telemetries that watch it.
SETUPS = {
    "coat": (
        coat_adamw(1e-3, b1=B1, b2=B2),
        {
            "default": COAT,
            # A sample of everything, and one of 4 groups per tensor.
            "everything": StateTelemetry(b1=B1, b2=B2, grad_clip=CLIP, rows=10**6, groups=10**6),
            "small": StateTelemetry(b1=B1, b2=B2, grad_clip=CLIP, rows=4, groups=1),
            # Replays that are not the optimizer's: b1, or the clipping, wrong.
            "wrong_b1": StateTelemetry(b1=0.8, b2=B2, grad_clip=CLIP),
            "no_clip": StateTelemetry(b1=B1, b2=B2),
            # Computed at steps 1 (the first) and 2 (every 2nd), not at 3.
            "sparse": StateTelemetry(b1=B1, b2=B2, grad_clip=CLIP, every=2),
        },
    ),
    # "w" keeps float32 moments; the others are stored as in "coat", step for step.
    "coat_w_float32": (
        coat_adamw(
            1e-3, b1=B1, b2=B2, fp8_mask=lambda p: {**jax.tree.map(lambda _: True, p), "w": False}
        ),
        {"default": COAT},
    ),
    "fp8_state_adamw": (
        fp8_state(ADAMW),
        {
            "default": StateTelemetry(grad_clip=CLIP, inner=ADAMW),
            # Computed at steps 1 (the first) and 3 (the last), not at 2.
            "sparse": StateTelemetry(grad_clip=CLIP, inner=ADAMW, every=5, last_step=STEPS),
        },
    ),
    "adamw": (ADAMW, {"default": StateTelemetry(grad_clip=CLIP, inner=ADAMW)}),
}


@functools.cache
def observed(setup: str):
    tx, telemetries = SETUPS[setup]
    return run(clipped(tx), telemetries)


def metrics_of(setup: str, telemetry: str = "default") -> dict:
    return observed(setup)[0][-1][telemetry]


def test_relative_error_is_small_for_fp8_state_and_zero_for_float32():
    coat, optax_fp8 = metrics_of("coat"), metrics_of("fp8_state_adamw")
    print({k: float(v) for k, v in coat.items() if "rel_err" in k})
    for m in (coat, optax_fp8):
        for f in ("mu", "nu"):
            # E4M3 with DRE: per cent level on these wide-range moments, never exact.
            assert 1e-3 < m[f"state/{f}_rel_err"] <= m[f"state/{f}_rel_err_max"] < 0.2
            assert 0 <= m[f"state/{f}_flushed"] < 1e-3
            assert m[f"state/{f}_groups"] == 120 + 2 + 3 * 24 * 2
    # The same algorithm and storage: fp8_state(adamw) and coat_adamw agree closely.
    for f in ("mu", "nu"):
        assert optax_fp8[f"state/{f}_rel_err"] == pytest.approx(
            coat[f"state/{f}_rel_err"], rel=0.05
        )
    # Float32 moments carry no quantization error: left out of the error, never the worst.
    mixed = metrics_of("coat_w_float32")
    w = tensor_names(problem()[0]).index("['w']")
    for f in ("mu", "nu"):
        assert 0 < mixed[f"state/{f}_rel_err"] and mixed[f"state/{f}_worst_tensor"] != w
        assert mixed[f"state/{f}_groups"] == 2 + 3 * 24 * 2
    plain = metrics_of("adamw")
    for f in ("mu", "nu"):
        assert plain[f"state/{f}_rel_err"] == 0 and plain[f"state/{f}_worst_tensor"] == -1
        assert plain[f"state/{f}_groups"] == 0 and plain[f"state/{f}_saturated"] == 0


@pytest.mark.parametrize("wrong", ["wrong_b1", "no_clip"])
def test_a_replay_that_is_not_the_optimizer_shows(wrong):
    # The relative error measures the replay too: with b1 or the clipping not the optimizer's,
    # the "float32 moment" is another number and the error is far larger.
    right = metrics_of("coat")["state/mu_rel_err"]
    assert metrics_of("coat", wrong)["state/mu_rel_err"] > 3 * right


def full_relative_errors(before, g, after):
    """Brute force over whole tensors, from the COAT states around the last step and its
    gradient: the mean of |dequantized - float32 replay| / |replay| over each tensor's non-zero
    values, per tensor and over all."""
    old_mu, old_nu = dequantized_moments(before)
    norm = optax.tree.norm(g)
    g = jax.tree.map(lambda x: x * min(1.0, CLIP / norm), g)
    exact = {
        "mu": jax.tree.map(lambda m, x: B1 * m + (1 - B1) * x, old_mu, g),
        "nu": jax.tree.map(lambda v, x: B2 * v + (1 - B2) * x * x, old_nu, g),
    }
    stored = dict(zip(("mu", "nu"), dequantized_moments(after), strict=True))
    out = {}
    for f in ("mu", "nu"):
        rel = [
            np.abs(s - e)[e != 0] / np.abs(e[e != 0])
            for s, e in zip(jax.tree.leaves(stored[f]), jax.tree.leaves(exact[f]), strict=True)
        ]
        out[f] = (np.array([r.mean() for r in rel]), np.concatenate(rel).mean())
    return out


def test_sampled_error_estimates_the_whole_tensors():
    per_step, before, after = observed("coat")
    metrics = per_step[-1]
    full = full_relative_errors(before, problem()[1](STEPS - 1), after)
    for f in ("mu", "nu"):
        per_tensor, pooled = full[f]
        # A sample that covers everything is the whole computation (up to float32 rounding
        # of the replay and the sums).
        everything = metrics["everything"]
        assert everything[f"state/{f}_rel_err"] == pytest.approx(pooled, rel=1e-3)
        assert everything[f"state/{f}_rel_err_max"] == pytest.approx(per_tensor.max(), rel=1e-3)
        assert everything[f"state/{f}_worst_tensor"] == int(np.argmax(per_tensor))
        # A few groups per tensor estimate it (the same quantizer on like-distributed values).
        small = metrics["small"][f"state/{f}_rel_err"]
        assert 0.8 * pooled < small < 1.25 * pooled, (f, pooled, small)


def test_sample_plan_picks_rows_and_groups_evenly():
    # A scanned layer stack keeps every layer; rows spread over the other leading axes.
    plan = SamplePlan.for_shape((3, 24, 1000), stacked=True, rows=4, groups=3, group_size=128)
    assert plan.row_slices == ((1, 6, 4),) and (plan.group_stride, plan.group_count) == (2, 3)
    x = jnp.arange(3 * 24 * 1000).reshape(3, 24, 1000)
    values = np.asarray(plan.values(x)).reshape(3, 4, 3, 128)
    for layer, row, group in np.ndindex(3, 4, 3):
        start = group * 2 * 128
        expected = np.asarray(x[layer, row * 6, start : start + 128])
        np.testing.assert_array_equal(values[layer, row, group, : len(expected)], expected)
    stats = np.asarray(plan.stats(jnp.arange(3 * 24 * 8).reshape(3, 24, 8)))
    assert stats.shape == (3, 4, 3) and stats[1, 2].tolist() == [
        1 * 192 + 12 * 8 + g for g in (0, 2, 4)
    ]
    # The last group of 1000 values is short: zero-padded.
    plan = SamplePlan.for_shape((1000,), stacked=False, rows=4, groups=8, group_size=128)
    assert plan.row_slices == () and np.asarray(plan.values(jnp.ones(1000)))[-24:].sum() == 0
    # Unstacked: the budget of rows goes to the first axis first.
    plan = SamplePlan.for_shape((5, 7, 9), stacked=False, rows=10, groups=1, group_size=128)
    assert plan.row_slices == ((1, 3, 2),)
    assert SamplePlan.for_shape((), stacked=False, rows=4, groups=4, group_size=128) is None


# ----------------------------------------------------------------------------- counts


def constant_tx(state):
    """An optimizer whose update returns ``state``: the counts then read a state made by hand."""
    return optax.GradientTransformation(lambda p: state, lambda u, s, p=None: (u, state))


def test_counts_of_a_state_made_by_hand():
    params = {"a": jnp.ones((4, 256)), "b": jnp.ones((2, 128))}  # 8 + 2 groups
    state = coat_adamw(1e-3, nu_format="e5m2").init(params)
    (coat, *_) = state
    mu_a = np.zeros((4, 256), np.float32)
    mu_a[0, :3] = 448.0
    mu_a[1, 7] = mu_a[3, 200] = -448.0
    mu_a[2, 5] = 416.0  # the largest code below the maximum
    mu_b = np.zeros((2, 128), np.float32)
    mu_b[1, 0] = np.nan
    nu_a = np.zeros((4, 256), np.float32)
    nu_a[0, 0] = nu_a[1, 1] = 57344.0  # E5M2's maximum; 448 is not one there
    nu_a[2, 2] = 448.0
    mu_expand = {"a": np.full((4, 2), 1.5, np.float32), "b": np.full((2, 1), 1.5, np.float32)}
    mu_expand["a"][0, 0] = 1 / 16
    mu_expand["a"][1, 1] = mu_expand["a"][2, 0] = quant.MAX_EXPAND
    mu_expand["b"][0, 0] = quant.MAX_EXPAND
    nu_scale = {"a": np.ones((4, 2), np.float32), "b": np.ones((2, 1), np.float32)}
    nu_scale["b"][1, 0] = np.inf
    coat = coat._replace(
        mu_codes={
            "a": jnp.asarray(mu_a, jnp.float8_e4m3fn),
            "b": jnp.asarray(mu_b, jnp.float8_e4m3fn),
        },
        mu_expand=jax.tree.map(jnp.asarray, mu_expand),
        nu_codes={"a": jnp.asarray(nu_a, jnp.float8_e5m2), "b": coat.nu_codes["b"]},
        nu_scale=jax.tree.map(jnp.asarray, nu_scale),
    )
    state = (coat, *state[1:])
    grads = jax.tree.map(jnp.ones_like, params)
    _, _, metrics = jax.jit(lambda s: StateTelemetry().update(constant_tx(s), grads, s, params))(
        state
    )
    metrics = jax.device_get(metrics)
    assert metrics["state/mu_saturated"] == 5
    assert metrics["state/mu_nonfinite"] == 1
    assert metrics["state/mu_k_floor"] == 1 and metrics["state/mu_k_cap"] == 3
    assert metrics["state/mu_groups"] == 10 and metrics["state/nu_groups"] == 10
    assert metrics["state/nu_saturated"] == 2
    assert metrics["state/nu_nonfinite"] == 1
    # The initial all-zero groups of nu sit at the cap.
    assert metrics["state/nu_k_floor"] == 0 and metrics["state/nu_k_cap"] == 10
    # The NaN makes its tensor the worst one, with a NaN error.
    assert tensor_names(params)[metrics["state/mu_worst_tensor"]] == "['b']"
    assert np.isnan(metrics["state/mu_rel_err_max"])


def test_optimizer_state_it_cannot_read_is_a_clear_error():
    params = {"w": jnp.ones((2, 128))}
    tx = optax.adamw(1e-3)
    with pytest.raises(ValueError, match="neither COAT .* nor fp8_state"):
        StateTelemetry().update(tx, params, tx.init(params), params)
    with pytest.raises(ValueError, match="rows must be a positive int"):
        StateTelemetry(rows=0)


# ----------------------------------------------------------------------------- when


def assert_same_telemetry(got: dict, want: dict) -> None:
    """The metrics of one step, computed in another program: counts exactly, errors to float32
    rounding (a cond's branch fuses its sums differently, the clip factor's norm among them, and
    a relative error divides by small moments: 2.3e-5 apart measured on the CPU)."""
    got, want = ({k: v for k, v in logged_metrics(m).items() if "state/" in k} for m in (got, want))
    assert sorted(got) == sorted(want) and want
    for k, v in want.items():
        if np.issubdtype(np.asarray(v).dtype, np.floating):
            np.testing.assert_allclose(got[k], v, rtol=1e-4, err_msg=k)
        else:
            assert got[k] == v, (k, got[k], v)


@functools.cache
def interpret_coat():
    """Clipped coat_adamw in Pallas interpret mode and its jitted ``apply_gradients``: one
    object, so that the parametrizations of the fused-apply test trace, lower and compile the
    plain step (the telemetry's reference) once."""
    tx = optim.chain(
        optim.clip_by_global_norm(CLIP), coat_adamw(1e-3, b1=B1, b2=B2, interpret=True)
    )
    return tx, jax.jit(lambda g, s, p: optim.apply_gradients(tx, g, s, p))


@pytest.mark.parametrize("every", [1, 2])
def test_apply_keeps_the_fused_kernel_and_reports_what_update_reports(every):
    """``StateTelemetry.apply``, the trainer's step with the telemetry on: coat_adamw's fused
    apply kernel and no separate update kernel; the new parameters and state of
    ``apply_gradients`` bit for bit; the metrics of ``update`` (the same samples of the old
    state, the same new moments) wherever it computes them."""
    tx, plain = interpret_coat()
    telemetry = StateTelemetry(b1=B1, b2=B2, grad_clip=CLIP, every=every)
    params, grads = problem()
    state = tx.init(params)
    fused = jax.jit(lambda g, s, p: telemetry.apply(tx, g, s, p))
    # The jaxpr of the step's own trace, which its first call reuses.
    names = [name for name, _ in pallas_calls(fused.trace(grads(0), state, params).jaxpr.jaxpr)]
    assert names and all("coat_adamw_apply" in n for n in names), names
    split = jax.jit(lambda g, s, p: telemetry.update(tx, g, s, p))
    computed = []
    for i in range(STEPS):
        new_params, new_state, metrics = fused(grads(i), state, params)
        assert tree_bytes((new_params, new_state)) == tree_bytes(plain(grads(i), state, params))
        _, split_state, split_metrics = split(grads(i), state, params)
        assert tree_bytes(split_state) == tree_bytes(new_state)
        assert bool(metrics[COMPUTED]) == bool(split_metrics[COMPUTED])
        if metrics[COMPUTED]:
            computed.append(i + 1)
            assert_same_telemetry(jax.device_get(metrics), jax.device_get(split_metrics))
        params, state = new_params, new_state
    assert computed == ([1, 2, 3] if every == 1 else [1, 2])


@pytest.mark.parametrize(("setup", "expected"), [("coat", [1, 2]), ("fp8_state_adamw", [1, 3])])
def test_sparse_telemetry_is_the_every_step_telemetry_where_computed(setup, expected):
    per_step = observed(setup)[0]
    computed = [step for step, m in enumerate(per_step, 1) if m["sparse"][COMPUTED]]
    assert computed == expected
    for step, metrics in enumerate(per_step, 1):
        every, sparse = metrics["default"], metrics["sparse"]
        assert every[COMPUTED]
        if step in computed:
            assert_same_telemetry(sparse, every)
            continue
        # Placeholders, which a record does not log.
        state = {k: v for k, v in sparse.items() if k.startswith("state/") and k != COMPUTED}
        assert sorted(state) == sorted(k for k in every if k != COMPUTED)
        for k, v in state.items():
            assert np.isnan(v) if np.issubdtype(v.dtype, np.floating) else v == -1, (k, v)
        assert logged_metrics({"loss": 1.5, **sparse}) == {"loss": 1.5}


def test_the_steps_the_trainer_logs_are_computed():
    def logged(step, every, last):  # _Progress: the first step, multiples, the last
        return step == 1 or step % every == 0 or step == last

    for every, last, max_skipped in [(1, 30, 0), (4, 30, 0), (7, 30, 0), (5, 23, 2), (4, 30, 6)]:
        t = StateTelemetry(every=every, last_step=last, max_skipped=max_skipped)
        counts = range(1, last + 1)
        computed = {c for c in counts if t.computes(c)}
        if max_skipped == 0:
            assert computed == {c for c in counts if logged(c, every, last)}
        # After n skipped steps the trainer's step is the count + n.
        for n in range(max_skipped + 1):
            assert {c for c in counts if logged(c + n, every, last)} <= computed
        # At most max_skipped + 1 steps of each `every`, besides the first and the last.
        assert len(computed - {1}) <= (last // every + 1) * (max_skipped + 1)
        # The traced predicate is the same.
        traced = jax.jit(jax.vmap(t.computes))(jnp.arange(1, last + 1))
        assert {c for c, on in zip(counts, np.asarray(traced), strict=True) if on} == computed


def eqns_outside_conds(jaxpr) -> collections.Counter:
    """(primitive, output shapes) of every equation, sub-jaxprs included but not conds'."""
    out = collections.Counter()
    for e in jaxpr.eqns:
        out[e.primitive.name, tuple(tuple(v.aval.shape) for v in e.outvars)] += 1
        if e.primitive.name != "cond":
            for sub in jaxprs_in_params(e.params):
                out += eqns_outside_conds(sub)
    return out


@pytest.mark.parametrize("setup", ["coat", "fp8_state_adamw"])
def test_a_step_it_does_not_compute_reads_nothing(setup):
    tx, telemetries = SETUPS[setup]
    tx, telemetry = clipped(tx), telemetries["sparse"]
    params, grads = problem()
    state = tx.init(params)
    plain = jax.make_jaxpr(tx.update)(grads(0), state, params).jaxpr
    observed = jax.make_jaxpr(lambda g, s, p: telemetry.update(tx, g, s, p))(
        grads(0), state, params
    ).jaxpr
    added = eqns_outside_conds(observed) - eqns_outside_conds(plain)
    conds = [e for e in observed.eqns if e.primitive.name == "cond"]
    # Outside the two conds (the sample before the update, the metrics after it) the telemetry
    # adds the barrier and scalar arithmetic on the step count, nothing that reads a tensor.
    assert len(conds) == 2 and sum(n for (name, _), n in added.items() if name == "cond") == 2
    for (name, shapes), _ in added.items():
        assert name in ("cond", "optimization_barrier") or shapes == ((),), (name, shapes)
    for cond in conds:
        skip, compute = cond.params["branches"]
        # The branch of a step that is not computed only fills constants.
        assert {e.primitive.name for e in skip.jaxpr.eqns} <= {"broadcast_in_dim"}
        assert not any(v in skip.jaxpr.invars for e in skip.jaxpr.eqns for v in e.invars)
        names = set(eqns_outside_conds(compute.jaxpr))
        assert any(name.startswith(("reduce", "slice")) for name, _ in names)


def test_every_trainer_optimizer_tells_the_step():
    # The trainer's telemetry reads the step from the optimizer state: every optimizer (with
    # the trainer's schedule, clipping, skipping and bfloat16 masters) has a count, and the
    # conds give the metrics of the every-step telemetry, same keys, same dtypes.
    params = {"embed_tokens": jnp.ones((8, 128)), "layers": [{"w": jnp.ones((128, 256))}]}
    for optimizer, extra in [
        ("coat_adamw", ["optimizer.skip_nonfinite_steps=2"]),
        *[(o, ["optimizer.fp8_state=true"]) for o in ("adamw", "lion", "sgd", "adafactor", "muon")],
        ("adamw", ["precision.master_dtype=bfloat16"]),
    ]:
        cfg = load_config(None, [f"optimizer.name={optimizer}", "logging.telemetry=true", *extra])
        tx = make_optimizer(cfg, program.make_schedule(cfg))
        tx = tx if cfg.master_dtype == "float32" else with_rounding_count(tx)
        telemetry = state_telemetry(cfg, program.make_schedule(cfg))
        assert telemetry.every == cfg.log_every > 1
        state = tx.init(params)
        shapes = [
            jax.eval_shape(functools.partial(t.update, tx), params, state, params)[2]
            for t in (telemetry, dataclasses.replace(telemetry, every=1))
        ]
        assert shapes[0] == shapes[1] and len(shapes[0]) > 5, optimizer


def test_when_it_cannot_tell_the_step_is_a_clear_error():
    params = {"w": jnp.ones((2, 128))}
    tx = optax.trace(0.9)  # no count in its state
    telemetry = StateTelemetry(inner=tx, every=2)
    with pytest.raises(ValueError, match="has none; use every=1"):
        telemetry.update(tx, params, tx.init(params), params)
    with pytest.raises(ValueError, match="every must be a positive int, got 0"):
        StateTelemetry(every=0)
    with pytest.raises(ValueError, match="max_skipped must be an int >= 0, got -1"):
        StateTelemetry(max_skipped=-1)


# ----------------------------------------------------------------------------- the trainer


LOG_EVERY, STEPS_RUN, STOP = 3, 7, 4


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory, cache_dir):
    """metrics.jsonl's training records of ``STEPS_RUN`` steps logged every ``LOG_EVERY``: without
    telemetry, with the every-step telemetry (the behaviour before the telemetry followed
    log_every), and with the trainer's own, stopped at ``STOP`` and resumed (and TensorBoard's
    scalars of that run)."""
    root = tmp_path_factory.mktemp("telemetry_runs")
    flags = [f"steps={STEPS_RUN}", f"logging.every={LOG_EVERY}", "model.num_hidden_layers=1"]

    def records(out):
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}

    # Only the split run's checkpoints are read.
    unsaved = [*flags, "checkpoint.save_final=false"]
    train(tiny(root / "off", cache_dir, *unsaved, "logging.telemetry=false"))
    own = program.state_telemetry
    every_step = lambda cfg, schedule: dataclasses.replace(own(cfg, schedule), every=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(program, "state_telemetry", every_step)
        train(tiny(root / "every", cache_dir, *unsaved, "logging.telemetry=true"))
    split = [*flags, "logging.telemetry=true", "logging.tensorboard=true"]
    train(tiny(root / "split", cache_dir, *split), stop_at=STOP)
    train(tiny(root / "split", cache_dir, *split, "resume=true"))
    runs = {name: records(root / name) for name in ("off", "every", "split")}
    return runs, _scalars(root / "split" / "tensorboard")


# The record steps of a run (_Progress): the first, multiples of log_every, the last; the split
# run also writes its stop step and its first step after the resume.
LOGGED = [1, 3, 6, 7]
IRREGULAR = [STOP, STOP + 1]
# The activation telemetry's metrics of a COAT model (docs/telemetry.md).
ACT_KEYS = sorted(
    f"act/{k}"
    for k in (
        "linear_scale_min",
        "linear_scale_max",
        "linear_worst_layer",
        "linear_worst_input",
        "group_scale_min",
        "group_scale_max",
        "group_worst_layer",
        "group_worst_tensor",
        "nonfinite",
    )
)


def test_a_train_run_logs_each_logged_steps_telemetry_and_trains_as_without(trainer_runs):
    runs, scalars = trainer_runs
    off, every, split = runs["off"], runs["every"], runs["split"]
    assert list(off) == list(every) == LOGGED and list(split) == sorted(LOGGED + IRREGULAR)
    # The telemetry only observes: the same losses and gradient norms, bit for bit (a record's
    # loss is the mean over the steps since the previous record, and the split run's records
    # at 4 and 5 make its step 6 the mean of step 6 alone). The run without telemetry folds the
    # clip into the fused kernel; the telemetry's update clips by the same factor.
    assert [(r["loss"], r["grad_norm"]) for r in every.values()] == [
        (r["loss"], r["grad_norm"]) for r in off.values()
    ]
    assert [split[s]["grad_norm"] for s in LOGGED] == [off[s]["grad_norm"] for s in LOGGED]
    assert [split[s]["loss"] for s in (1, 3, 7)] == [off[s]["loss"] for s in (1, 3, 7)]
    assert not any(k.startswith(("state/", "act/")) for r in off.values() for k in r)
    # Each logged step holds its own telemetry: what the every-step telemetry gives there,
    # before and after the resume at a step that is not a multiple of log_every.
    for step in LOGGED:
        assert_same_telemetry(split[step], every[step])
        state = {k: v for k, v in logged_metrics(split[step]).items() if "state/" in k}
        # TensorBoard shows what metrics.jsonl holds.
        assert {k: dict(scalars[k])[step] for k in state} == pytest.approx(state, rel=1e-6)
        # The activation scales (tests/training/test_act_telemetry.py): at each logged step, from that
        # step's forward pass, the same in both runs (the same parameters, the same forward).
        act = {k: v for k, v in split[step].items() if k.startswith("act/")}
        assert sorted(act) == ACT_KEYS, step
        assert act == {k: v for k, v in every[step].items() if k.startswith("act/")}
        assert {k: dict(scalars[k])[step] for k in act} == pytest.approx(act, rel=1e-6)
    last = split[STEPS_RUN]
    assert last["act/nonfinite"] == 0
    assert 0 < last["act/linear_scale_min"] <= last["act/linear_scale_max"] < 1
    assert 0 < last["act/group_scale_min"] <= last["act/group_scale_max"] < 1
    # One decoder layer: layer 0, or 1 for the final norm (its tensor index then 5, "norm").
    assert last["act/linear_worst_layer"] == 0 and 0 <= last["act/linear_worst_input"] < 4
    assert (last["act/group_worst_layer"], last["act/group_worst_tensor"] == 5) in (
        (0, False),
        (1, True),
    )
    for f in ("mu", "nu"):
        assert 0 < last[f"state/{f}_rel_err"] <= last[f"state/{f}_rel_err_max"] < 0.05
        assert last[f"state/{f}_nonfinite"] == 0
        assert 0 < last[f"state/{f}_saturated"] <= 2 * last[f"state/{f}_groups"]
        assert 0 <= last[f"state/{f}_flushed"] < 0.01
        assert isinstance(last[f"state/{f}_worst_tensor"], int)


def test_no_record_holds_the_placeholders_of_a_step_not_computed(trainer_runs):
    runs, scalars = trainer_runs
    # The stop step and the first step after the resume are not computed (their count does not
    # say the trainer logs them): their records carry no telemetry, and TensorBoard none.
    for step in IRREGULAR:
        assert not any(k.startswith(("state/", "act/")) for k in runs["split"][step]), step
    for key, values in scalars.items():
        if key.startswith(("state/", "act/")):
            assert [s for s, _ in values] == LOGGED, key
    assert {k for k in scalars if k.startswith("act/")} == set(ACT_KEYS)


@pytest.fixture(scope="module")
def cache_dir(trainer_caches):
    return str(trainer_caches)


SHARDED = textwrap.dedent(
    """
    import re
    import jax, numpy as np, optax
    from coat_jax import coat_adamw
    from coat_jax.training import sharding
    from coat_jax.training.telemetry import StateTelemetry
    from tests.training.test_telemetry import problem, B1, B2, CLIP

    # Both split along their last axis on 4 devices: the case a careless slice gathers.
    params, grads = problem({"w": (256, 1024), "up": (2, 256, 512)})
    mesh = sharding.make_mesh(1, 4)
    tx = optax.chain(optax.clip_by_global_norm(CLIP), coat_adamw(1e-3, b1=B1, b2=B2))
    p_sh = sharding.param_shardings(params, mesh)
    assert p_sh["w"].spec == jax.sharding.PartitionSpec(None, "fsdp"), p_sh
    s_sh = sharding.state_shardings(jax.eval_shape(tx.init, params), params, mesh)

    def largest_collective(fn, *args):
        # Values of the largest array any collective of fn's program moves.
        largest = 0
        for line in jax.jit(fn).lower(*args).compile().as_text().splitlines():
            op = re.search(
                r"= (.*?) (all-gather|collective-permute|all-to-all|all-reduce|reduce-scatter)"
                r"(-start)?\\(",
                line,
            )
            if op:
                for dims in re.findall(r"\\w+\\[([0-9,]*)\\]", op.group(1)):
                    largest = max(largest, int(np.prod([int(d) for d in dims.split(",") if d])))
        return largest

    # Every step, and in conds (computed at steps 1 and 2, the first and a multiple of 2).
    for every in (1, 2):
        telemetry = StateTelemetry(b1=B1, b2=B2, grad_clip=CLIP, rows=4, groups=2, every=every)
        results = {}
        for name, p_s, s_s in (("one", None, None), ("four", p_sh, s_sh)):
            p = params if p_s is None else jax.device_put(params, p_s)
            state = tx.init(p)
            state = state if s_s is None else jax.device_put(state, s_s)
            step = jax.jit(lambda g, s, p: telemetry.update(tx, g, s, p))
            for i in range(2):
                g = grads(i) if p_s is None else jax.device_put(grads(i), p_s)
                _, state, metrics = step(g, state, p)
            results[name] = jax.device_get(metrics)
        one, four = results["one"], results["four"]
        assert one["state/computed"] and four["state/computed"]
        for k in one:
            if "rel_err" in k:
                assert abs(one[k] - four[k]) <= 1e-3 * abs(one[k]), (k, one[k], four[k])
            else:
                assert one[k] == four[k], (k, one[k], four[k])
        # The telemetry moves sampled values between devices, never whole rows or shards: no
        # collective carries more than the largest tensor's sample (2 layers x 4 rows x 2
        # groups).
        plain = largest_collective(lambda g, s, p: tx.update(g, s, p), g, state, p)
        observed = largest_collective(lambda g, s, p: telemetry.update(tx, g, s, p), g, state, p)
        print("every", every, "largest collective", plain, observed)
        assert observed <= max(plain, 2 * 4 * 2 * 128)
    print("OK")
    """
)


def test_sharded_state_gives_the_one_device_metrics():
    out = run_on_fake_devices(SHARDED, devices=4, timeout=240)
    print(out)
    assert out.strip().endswith("OK")

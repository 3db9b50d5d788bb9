"""coat_adamw's fused apply: ``apply_gradients`` against ``update`` + ``optax.apply_updates``.

The fused way (the kernel reads each parameter and writes the new one) must give the optax way's
parameters to float32 rounding and the same state, through clipping chains, masks, schedules and
the trainer; a transformation without a fused apply must take the optax way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import coat_jax
from coat_jax import optim
from coat_jax.training.optimizers import make_optimizer, skip_nonfinite
from coat_jax.training.program import make_schedule
from tests.jaxprs import equations, pallas_calls
from tests.placement import committed

PARAMS_SHAPES = {"w": (8, 256), "v": (3, 200), "b": (3,), "s": ()}


def _params(seed=0):
    keys = jax.random.split(jax.random.key(seed), len(PARAMS_SHAPES))
    return {
        k: jax.random.normal(key, shape, jnp.float32)
        for key, (k, shape) in zip(keys, PARAMS_SHAPES.items(), strict=True)
    }


def _grads(t, dtype=jnp.float32):
    return jax.tree.map(
        lambda p: (0.1 * jax.random.normal(jax.random.key(100 + t), p.shape)).astype(dtype),
        _params(),
    )


def _run(tx, fused, steps=3, dtype=jnp.float32):
    params, state = committed((_params(), tx.init(_params())))
    if fused:
        step = jax.jit(lambda p, s, g: optim.apply_gradients(tx, g, s, p))
    else:

        @jax.jit
        def step(p, s, g):
            updates, s = tx.update(g, s, p)
            return optax.apply_updates(p, updates), s

    for t in range(steps):
        params, state = step(params, state, _grads(t, dtype))
    return params, state


def _pallas_calls(fn, *args) -> list[str]:
    """Names of the pallas_calls in ``fn``'s jaxpr."""
    return [name for name, _ in pallas_calls(jax.make_jaxpr(fn)(*args).jaxpr)]


MASKS = {
    "none": None,
    "tree": {"w": True, "v": False, "b": False, "s": True},
    "fn": lambda p: jax.tree.map(lambda x: x.ndim > 1, p),
}


# (mask, schedule, implementation): every mask and both learning rates (a constant, a schedule)
# on the XLA path, two of them on the kernel's. The mask and the schedule are independent options
# of the step, so their full product would add programs but no path.
CASES = [
    ("none", False, "xla"),
    ("tree", True, "xla"),
    ("fn", True, "xla"),
    ("tree", True, "interpret"),
    ("none", False, "interpret"),
]


@pytest.mark.parametrize("mask,schedule,implementation", CASES)
def test_fused_apply_equals_update_then_apply(mask, schedule, implementation):
    lr = optax.cosine_decay_schedule(3e-2, 10) if schedule else 3e-2
    tx = optim.chain(
        optax.clip_by_global_norm(1.0),
        coat_jax.coat_adamw(
            lr,
            weight_decay=0.1,
            mask=MASKS[mask],
            implementation="auto" if implementation == "interpret" else "xla",
            interpret=implementation == "interpret",
        ),
    )
    p_fused, s_fused = _run(tx, fused=True)
    p_optax, s_optax = _run(tx, fused=False)
    assert jax.tree.structure(s_fused) == jax.tree.structure(s_optax)
    for a, b in zip(jax.tree.leaves(s_fused), jax.tree.leaves(s_optax), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    moved = 0.0
    for path, a in jax.tree_util.tree_flatten_with_path(p_fused)[0]:
        b = p_optax[path[0].key]
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7, err_msg=str(path))
        moved = max(moved, float(jnp.max(jnp.abs(a - _params()[path[0].key]))))
    assert moved > 1e-3, "the parameters did not move: the comparison would prove nothing"


def test_fused_apply_runs_the_apply_kernel():
    """On the kernel path the step holds the apply kernel and no separate update kernel."""
    tx = optim.chain(optax.clip_by_global_norm(1.0), coat_jax.coat_adamw(1e-3, interpret=True))
    params = {"w": jnp.ones((8, 256))}
    state = tx.init(params)
    fused = _pallas_calls(lambda p, s, g: optim.apply_gradients(tx, g, s, p), params, state, params)
    split = _pallas_calls(lambda p, s, g: tx.update(g, s, p), params, state, params)
    assert fused and all("coat_adamw_apply" in n for n in fused), fused
    assert split and all("coat_adam_step" in n for n in split), split


def test_weight_decay_zero_and_bf16_grads_agree_to_rounding():
    tx = coat_jax.coat_adamw(1e-2, weight_decay=0.0, implementation="xla")
    p_fused, _ = _run(tx, fused=True, dtype=jnp.bfloat16)
    p_optax, _ = _run(tx, fused=False, dtype=jnp.bfloat16)
    # optax rounds a zero-decay update to the gradient's dtype (bf16) before scaling it; the
    # fused way keeps it in float32: the parameters differ by at most lr x bf16's rounding.
    for a, b in zip(jax.tree.leaves(p_fused), jax.tree.leaves(p_optax), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=3 * 1e-2 * 2**-8)


def test_transformations_without_fused_apply_take_the_optax_way():
    params, grads = _params(), _grads(0)
    plain = optax.adamw(1e-2)
    state = plain.init(params)
    p1, s1 = optim.apply_gradients(plain, grads, state, params)
    updates, s2 = plain.update(grads, state, params)
    p2 = optax.apply_updates(params, updates)
    for a, b in zip(jax.tree.leaves((p1, s1)), jax.tree.leaves((p2, s2)), strict=True):
        np.testing.assert_array_equal(a, b)
    # optax.chain and skip_nonfinite do not carry the fused apply; coat_jax.optim.chain does.
    fused = optim.FusedGradientTransformation
    coat = coat_jax.coat_adamw(1e-3)
    assert isinstance(coat, fused) and isinstance(coat, optax.GradientTransformation)
    assert optim.fused_in_place(coat)
    assert isinstance(optim.chain(optax.clip(1.0), coat), fused)
    assert not optim.fused_in_place(optim.chain(optax.clip(1.0), coat))
    assert not isinstance(optax.chain(optax.clip(1.0), coat), fused)
    assert not isinstance(skip_nonfinite(coat), fused)
    assert not isinstance(optim.chain(coat, optax.scale(1.0)), fused)
    assert isinstance(optim.clip_by_global_norm(1.0), optim.GradScaleTransformation)


def test_trainer_fused_apply_equals_the_optax_way(tmp_path):
    """train.py's step with ``fused_apply`` true and false: the same losses and parameters."""
    import json
    from pathlib import Path

    from coat_jax.training import load_config, train
    from tests.tiny_runs import tiny_run

    repo = Path(__file__).resolve().parents[2]
    runs = {}
    for fused in ("true", "false"):
        out = tmp_path / fused
        cfg = load_config(
            repo / "configs" / "default.yaml",
            [
                *tiny_run(layers=1),
                "steps=6",
                "optimizer.learning_rate=3e-3",
                f"optimizer.fused_apply={fused}",
                f"output_dir={out}",
                f"data.cache_dir={tmp_path}/tokens",
                # No final checkpoint: the losses and parameters are what this test reads.
                "checkpoint.save_final=false",
            ],
        )
        if fused == "true":
            # The trainer's optimizer (clipping, then coat_adamw) keeps the fused apply.
            tx = make_optimizer(cfg, make_schedule(cfg))
            assert isinstance(tx, optim.FusedGradientTransformation)
        result = train(cfg)
        lines = (out / "metrics.jsonl").read_text().splitlines()
        losses = [r["loss"] for r in map(json.loads, lines) if "loss" in r]
        assert len(losses) == 6
        runs[fused] = (losses, result.params)
    (losses_f, params_f), (losses_o, params_o) = runs["true"], runs["false"]
    np.testing.assert_allclose(losses_f, losses_o, rtol=1e-6)
    assert losses_f[-1] < losses_f[0], "the run did not train: the comparison would prove nothing"
    for a, b in zip(jax.tree.leaves(params_f), jax.tree.leaves(params_o), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def _dequantized_state(state):
    return jax.tree.leaves(coat_jax.dequantized_moments(state))


def _clip_test_coat(implementation):
    kw = dict(implementation="auto", interpret=True) if implementation == "interpret" else {}
    return coat_jax.coat_adamw(3e-2, weight_decay=0.1, **(kw or dict(implementation="xla")))


def _run_clipped(chain, fused, max_norm):
    """:func:`_run` of ``chain``'s optimizer for ``max_norm``, an operand of the step: one
    compiled step serves every ``max_norm``."""
    make_tx, steps = chain
    params, state = committed((_params(), make_tx(max_norm).init(_params())))
    for t in range(3):
        params, state = steps[fused](params, state, _grads(t), jnp.float32(max_norm))
    return params, state


def _clip_chain(clip, implementation):
    """``max_norm -> chain(clip(max_norm), coat_adamw)`` and its jitted steps, the fused
    apply's (True) and the optax way's (False)."""

    def make_tx(max_norm):
        return optim.chain(clip(max_norm), _clip_test_coat(implementation))

    def fused_step(p, s, g, max_norm):
        return optim.apply_gradients(make_tx(max_norm), g, s, p)

    def optax_step(p, s, g, max_norm):
        updates, s = make_tx(max_norm).update(g, s, p)
        return optax.apply_updates(p, updates), s

    return make_tx, {True: jax.jit(fused_step), False: jax.jit(optax_step)}


@pytest.mark.parametrize("implementation", ["xla", "interpret"])
def test_clip_folded_into_the_kernel_equals_optax_clip(implementation):
    # coat_jax.optim.clip_by_global_norm hands the fused apply a gradient scale instead of
    # writing clipped gradients: the same step as optax's clip, to float32 rounding (and bit
    # for bit when the clip does not trigger: the scale is then exactly 1). Both max_norm run
    # through the same compiled steps (max_norm is their operand).
    folded = _clip_chain(optim.clip_by_global_norm, implementation)
    plain = _clip_chain(optax.clip_by_global_norm, implementation)
    unclipped = jax.tree.leaves(_run(_clip_test_coat(implementation), fused=True)[0])
    norm = float(optax.tree.norm(_grads(0)))
    for max_norm in (1.0, 1e3):
        p_folded, s_folded = _run_clipped(folded, True, max_norm)
        p_plain, s_plain = _run_clipped(plain, False, max_norm)
        # The folded clip's own update clips by the same factor the kernel applies: the same
        # state.
        p_update, s_update = _run_clipped(folded, False, max_norm)
        for a, b in zip(jax.tree.leaves(s_folded), jax.tree.leaves(s_update), strict=True):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        for a, b in zip(jax.tree.leaves(p_folded), jax.tree.leaves(p_update), strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
        assert (norm > max_norm) == (max_norm == 1.0), norm  # the clip triggers in one case only
        assert jax.tree.structure(s_folded) == jax.tree.structure(s_plain)
        if max_norm > norm:
            for a, b in zip(jax.tree.leaves(s_folded), jax.tree.leaves(s_plain), strict=True):
                np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        for a, b in zip(_dequantized_state(s_folded), _dequantized_state(s_plain), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9)
        for a, b in zip(jax.tree.leaves(p_folded), jax.tree.leaves(p_plain), strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
        # The clip moved the step: without it the parameters differ by far more than the
        # tolerance.
        gap = max(
            float(jnp.max(jnp.abs(a - b)))
            for a, b in zip(unclipped, jax.tree.leaves(p_plain), strict=True)
        )
        assert (gap > 1e-4) == (max_norm == 1.0), gap


def test_folded_clip_writes_no_clipped_gradient():
    # optax's clip selects between the gradient and its scaled copy, a whole pass over the
    # gradient; folded into the fused apply, the gradient goes to the step as it is.
    params, grads = _params(), _grads(0)
    selects = {}
    for name, clip in (("optax", optax.clip_by_global_norm), ("folded", optim.clip_by_global_norm)):
        tx = optim.chain(clip(1.0), coat_jax.coat_adamw(1e-3, implementation="xla"))
        jaxpr = jax.make_jaxpr(lambda p, s, g, tx=tx: optim.apply_gradients(tx, g, s, p))(
            params, tx.init(params), grads
        )
        shapes = {g.shape for g in jax.tree.leaves(grads) if g.ndim}
        selects[name] = [
            e
            for e in equations(jaxpr.jaxpr)
            if e.primitive.name == "select_n" and e.outvars[0].aval.shape in shapes
        ]
    assert selects["optax"], "optax's clip should select per gradient: the check proves nothing"
    assert selects["folded"] == [], selects["folded"]


def _assert_fused_step_is_the_update(tx):
    """One step of ``tx``: the fused apply's parameters are update + apply's."""
    params, grads = _params(), _grads(0)
    fused = optim.apply_gradients(tx, grads, tx.init(params), params)
    updates, _ = tx.update(grads, tx.init(params), params)
    plain = optax.apply_updates(params, updates)
    for a, b in zip(jax.tree.leaves(fused[0]), jax.tree.leaves(plain), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)


def test_folded_clip_falls_back_behind_other_transformations():
    # Only gradient scales fold; any other transformation before coat_adamw runs its update.
    for first in (optax.clip(0.01), optax.scale(0.5)):
        coat = coat_jax.coat_adamw(1e-2)
        _assert_fused_step_is_the_update(optim.chain(optim.clip_by_global_norm(1.0), first, coat))


def test_nested_chains_fold_their_scales():
    # A chain inside a chain: the outer clip's factor reaches the inner chain's fused apply
    # (folded again when the inner transformations scale too, applied to the gradients when not).
    for inner_first in (optim.clip_by_global_norm(2.0), optax.scale(0.5)):
        coat = coat_jax.coat_adamw(1e-2, implementation="xla")
        _assert_fused_step_is_the_update(
            optim.chain(optim.clip_by_global_norm(1.0), optim.chain(inner_first, coat))
        )


def test_grad_scale_needs_the_fused_apply():
    tx = coat_jax.scale_by_coat_adam(implementation="xla")
    params = {"w": jnp.ones((8, 128))}
    with pytest.raises(ValueError, match="fused apply only"):
        tx.step(params, tx.init(params), params, grad_scale=jnp.float32(0.5))


# ----------------------------------------------------------------- one element of stacks

LAYERS = 3


def _stacked(seed):
    """Stacks of ``LAYERS`` elements: an FP8-state matrix, a short-group matrix (FP8 on the XLA
    path only), a vector with float32 moments (fp8_mask) and a scalar."""
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = {"w": (8, 256), "v": (3, 200), "n": (256,), "s": ()}
    return {
        k: jax.random.normal(key, (LAYERS, *shape), jnp.float32)
        for key, (k, shape) in zip(keys, shapes.items(), strict=True)
    }


def _one(tree, i):
    return jax.tree.map(lambda x: x[i], tree)


def _stacked_tx(implementation):
    schedule = optax.linear_schedule(1e-2, 1e-3, 10)
    return coat_jax.coat_adamw(
        schedule,
        weight_decay=0.1,
        mask=lambda p: {k: k != "n" for k in p},
        fp8_mask=lambda p: {k: k != "n" for k in p},
        implementation=implementation,
        interpret=implementation != "xla",
    )


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_apply_at_steps_one_element_as_apply_gradients_would(implementation):
    """``apply_gradients_at(tx, g, stacked_state, stacked_params, i)``: element ``i`` of the
    result is ``apply_gradients(tx, g, state[i], params[i])`` (the kernel's and XLA's alike:
    FP8 codes and counts bit for bit, float32 values to rounding), with the schedule, the
    weight-decay mask, float32 moments and a short last group per element; the other elements
    are untouched, bit for bit; three steps on different elements in turn."""
    tx = _stacked_tx(implementation)
    params = _stacked(0)
    state = jax.jit(jax.vmap(tx.init))(params)
    at = jax.jit(lambda g, s, p, i: optim.apply_gradients_at(tx, g, s, p, i))
    alone = jax.jit(lambda g, s, p: optim.apply_gradients(tx, g, s, p))
    for t, index in enumerate((1, 0, 1)):
        grads = jax.tree.map(lambda p, t=t: 0.1 * jnp.sin(p[0] * (t + 1)), params)
        new_params, new_state = at(grads, state, params, jnp.int32(index))
        want_params, want_state = alone(grads, _one(state, index), _one(params, index))
        for new, old, want in zip(
            jax.tree.leaves((new_params, new_state)),
            jax.tree.leaves((params, state)),
            jax.tree.leaves((want_params, want_state)),
            strict=True,
        ):
            new, old, want = np.asarray(new), np.asarray(old), np.asarray(want)
            if new.dtype == np.float32:
                # XLA fuses the element's float32 arithmetic differently in the two programs
                # (a multiply-add contracted or not): a few ulps apart.
                atol = 1e-5 * float(np.max(np.abs(want), initial=0.0))
                np.testing.assert_allclose(new[index], want, rtol=1e-5, atol=atol)
            else:
                np.testing.assert_array_equal(new[index], want)
            others = [i for i in range(LAYERS) if i != index]
            np.testing.assert_array_equal(new[others], old[others])
        params, state = new_params, new_state
    counts = [np.asarray(x) for x in jax.tree.leaves(state) if np.asarray(x).dtype == np.int32]
    assert counts and all(c.tolist() == [1, 2, 0] for c in counts), counts


def test_apply_at_reads_and_writes_the_kernels_stacks_in_place():
    """On the kernel path the FP8 stacks go whole into the kernel: no slice of them out, no
    write-back (what would copy a layer's state per layer in optimizer_in_backward)."""
    tx = _stacked_tx("pallas")
    params = _stacked(0)
    state = jax.jit(jax.vmap(tx.init))(params)
    grads = _one(params, 0)
    from jax._src.interpreters import partial_eval as pe

    jaxpr = jax.make_jaxpr(lambda g, s, p: optim.apply_gradients_at(tx, g, s, p, 1))(
        grads, state, params
    )
    # What XLA keeps: the mask function's slices of the parameters are dead code.
    live, _ = pe.dce_jaxpr(jaxpr.jaxpr, [True] * len(jaxpr.jaxpr.outvars))
    fp8_stack = (LAYERS, 8, 256)
    sliced = [
        e
        for e in equations(live)
        if e.primitive.name in ("dynamic_slice", "dynamic_update_slice", "gather", "scatter")
        and any(tuple(getattr(v.aval, "shape", ())) == fp8_stack for v in e.invars)
    ]
    assert not sliced, [e.primitive.name for e in sliced]
    assert any(
        "coat_adamw_apply" in n
        for n in _pallas_calls(
            lambda g, s, p: optim.apply_gradients_at(tx, g, s, p, 1), grads, state, params
        )
    )


def test_apply_at_without_a_fused_apply_slices_and_writes_back():
    tx = optax.adamw(1e-2)
    params = _stacked(1)
    state = jax.vmap(tx.init)(params)
    grads = jax.tree.map(lambda p: 0.1 * p[0], params)
    new_params, new_state = optim.apply_gradients_at(tx, grads, state, params, 2)
    want_params, want_state = optim.apply_gradients(tx, grads, _one(state, 2), _one(params, 2))
    for new, want in zip(
        jax.tree.leaves((new_params, new_state)),
        jax.tree.leaves((want_params, want_state)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(new)[2], np.asarray(want))
    np.testing.assert_array_equal(new_params["w"][:2], params["w"][:2])

"""Scanned layers and remat policies: same function, the residuals SPEC section 3 names, and
checkpoints and conversions that work in both layer layouts."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coat_jax import llama
from coat_jax.checkpoint_io import from_pretrained, save_pretrained
from coat_jax.fp8_ops import WEIGHT_RESIDUALS, FP8Config
from coat_jax.memory import residuals

CFG = llama.LlamaConfig(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
PRECISIONS = ("bf16", "fp8", "coat")


def _pair(precision, dtype=jnp.float32, remat="none", config=CFG):
    """An unrolled model and a scanned one holding the same weights."""
    unrolled = llama.Llama(config, precision=precision, dtype=dtype, rngs=nnx.Rngs(0), remat=remat)
    scanned = llama.Llama(
        config, precision=precision, dtype=dtype, rngs=nnx.Rngs(1), scan_layers=True, remat=remat
    )
    graphdef, state = nnx.split(scanned)
    nnx.replace_by_pure_dict(state, llama.stack_layers(nnx.to_pure_dict(nnx.split(unrolled)[1])))
    return unrolled, nnx.merge(graphdef, state)


def _tokens(b=2, t=16, seed=3):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, CFG.vocab_size, jnp.int32)


def _loss_and_grads(model, tokens):
    """(loss, gradients, logits of ``tokens[:, :-1]``) from one jitted program."""
    graphdef, state = nnx.split(model)

    def loss(state):
        logits = nnx.merge(graphdef, state)(tokens[:, :-1])
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1)
        return jnp.mean(nll), logits

    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    return value, nnx.to_pure_dict(grads), logits


@pytest.mark.parametrize("precision", PRECISIONS)
def test_scan_and_unrolled_give_the_same_logits_and_gradients(precision):
    unrolled, scanned = _pair(precision)
    tokens = _tokens()
    lu, gu, logits_u = _loss_and_grads(unrolled, tokens)
    ls, gs, logits_s = _loss_and_grads(scanned, tokens)
    np.testing.assert_allclose(logits_s, logits_u, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ls, lu, rtol=1e-6)
    gs = llama.unstack_layers(gs)
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(gu)[0], jax.tree.leaves(gs), strict=True
    ):
        scale = float(jnp.max(jnp.abs(a))) + 1e-12
        err = float(jnp.max(jnp.abs(a - b))) / scale
        assert err < 1e-4, (jax.tree_util.keystr(path), err)


@pytest.mark.parametrize(
    "precision,scan,policies",
    [
        ("coat", True, tuple(llama.REMAT_POLICIES)),
        ("bf16", True, ("none", "activations", "full")),
        ("coat", False, ("none", "activations")),
    ],
)
def test_remat_policies_do_not_change_the_gradient(precision, scan, policies):
    tokens = _tokens()
    ref = None
    for remat in policies:
        model = llama.Llama(
            CFG,
            precision=precision,
            dtype=jnp.float32,
            rngs=nnx.Rngs(0),
            scan_layers=scan,
            remat=remat,
        )
        loss, grads, _ = _loss_and_grads(model, tokens)
        if ref is None:
            ref = (loss, grads)
            continue
        np.testing.assert_allclose(loss, ref[0], rtol=1e-6)
        for a, b in zip(jax.tree.leaves(ref[1]), jax.tree.leaves(grads), strict=True):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6 * float(jnp.max(jnp.abs(a))))


def test_unknown_remat_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="remat='sometimes' is not one of"):
        llama.Llama(CFG, rngs=nnx.Rngs(0), remat="sometimes")


# ----------------------------------------------------------------------------- residuals


def _layer_residuals(precision, remat, b=3, t=32, **kw):
    """Activation residuals of the scanned layers (leading axis = num_hidden_layers)."""
    model = llama.Llama(
        CFG, precision=precision, rngs=nnx.Rngs(0), scan_layers=True, remat=remat, **kw
    )
    graphdef, state = nnx.split(model)
    res = residuals(
        lambda s, x: nnx.merge(graphdef, s)(x).sum(), state, _tokens(b, t), param_argnums=(0,)
    )
    return [r for r in res if r.is_activation and r.shape[:1] == (CFG.num_hidden_layers,)]


def _tokens_sized(r, b=3, t=32):
    """True when a residual holds one value per token or more (an activation-sized tensor)."""
    return int(np.prod(r.shape[1:])) >= b * t * CFG.hidden_size // 2


def _bf16_activations(res):
    return [r for r in res if jnp.dtype(r.dtype) == jnp.bfloat16 and _tokens_sized(r)]


def test_coat_policy_keeps_the_fp8_codes_and_only_attention_in_bf16():
    res = _layer_residuals("coat", "activations")
    fp8 = [r for r in res if jnp.dtype(r.dtype) == jnp.float8_e4m3fn]
    # Per layer: the two RMSNorm inputs, the q|k|v and gate|up inputs, the o_proj and down_proj
    # inputs, the SiLU input and both product inputs (SPEC section 3): nine FP8 tensors.
    assert len(fp8) == 9, [(r.shape, r.dtype) for r in res]
    bf16 = _bf16_activations(res)
    # BF16 only where attention keeps it: q, k and v, [L, B, T, heads, head_dim].
    assert len(bf16) == 3 and all(len(r.shape) == 5 for r in bf16), [
        (r.shape, r.dtype) for r in bf16
    ]
    f32 = [r for r in res if jnp.dtype(r.dtype) == jnp.float32 and _tokens_sized(r)]
    assert not f32, [(r.shape, r.dtype) for r in f32]


def test_the_residual_check_fails_for_a_policy_that_keeps_bf16_inputs(monkeypatch):
    # The benchmark's old policy kept a value when an input of its op had rank >= 3. The
    # quantizers work on the [tokens, features] view, so their FP8 codes were dropped and the
    # BF16 inputs of the linears kept instead: the check above must see that.
    def rank_policy(prim, *avals, **params):
        return any(getattr(a, "ndim", 0) >= 3 for a in avals)

    monkeypatch.setitem(llama.REMAT_POLICIES, "rank", rank_policy)
    assert len(_bf16_activations(_layer_residuals("coat", "rank"))) > 3


def test_bf16_activations_policy_keeps_bf16_inputs_and_no_float32():
    res = _layer_residuals("bf16", "activations")
    assert all(jnp.dtype(r.dtype) != jnp.float32 or not _tokens_sized(r) for r in res)
    assert _bf16_activations(res)
    # Full remat keeps one tensor per layer: its input.
    full = [(r.shape, r.dtype) for r in _layer_residuals("bf16", "full")]
    assert full == [((CFG.num_hidden_layers, 3, 32, CFG.hidden_size), jnp.bfloat16)], full


def test_fp8_attention_keeps_no_bf16_activation_and_the_same_forward():
    res = _layer_residuals("coat", "activations", fp8_attention=True)
    assert not _bf16_activations(res), [(r.shape, r.dtype) for r in _bf16_activations(res)]
    # The three COAT linears' and non-linears' FP8 tensors plus FP8 q, k and v.
    assert len([r for r in res if jnp.dtype(r.dtype) == jnp.float8_e4m3fn]) == 12
    tokens = _tokens()
    plain = llama.Llama(CFG, precision="coat", dtype=jnp.float32, rngs=nnx.Rngs(0))
    fp8 = llama.Llama(
        CFG, precision="coat", dtype=jnp.float32, rngs=nnx.Rngs(0), fp8_attention=True
    )
    _, g_plain, logits_plain = _loss_and_grads(plain, tokens)
    _, g_fp8, logits_fp8 = _loss_and_grads(fp8, tokens)
    np.testing.assert_array_equal(logits_fp8, logits_plain)
    a = np.concatenate([np.ravel(x) for x in jax.tree.leaves(g_plain)])
    b = np.concatenate([np.ravel(x) for x in jax.tree.leaves(g_fp8)])
    rel = float(np.linalg.norm(a - b) / np.linalg.norm(a))
    assert 0 < rel < 0.05, rel  # FP8 q, k, v in backward: close, and not silently BF16
    with pytest.raises(ValueError, match="fp8_attention=True needs precision"):
        llama.Llama(CFG, rngs=nnx.Rngs(0), fp8_attention=True)


# ----------------------------------------------------------------------------- layouts


def test_stack_and_unstack_are_inverse_on_parameters_and_states():
    model = llama.Llama(CFG, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.split(model)[1])
    stacked = llama.stack_layers(params)
    assert llama.is_stacked(stacked) and not llama.is_stacked(params)
    assert stacked["layers"]["self_attn"]["q_proj"].shape == (2, 64, 64)
    back = llama.unstack_layers(stacked)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(a, b)
    from coat_jax import coat_adamw
    from coat_jax.llama_layout import stacked_layer_axes

    # Each layer of the stack grouped as alone (as the trainer's optimizers): the unrolled
    # layers' states, stacked, are the stacked parameters' state.
    tx = coat_adamw(1e-3, stacked_axes=stacked_layer_axes)
    state = tx.init(params)
    moved = llama.relayout({"params": params, "opt_state": state}, scan_layers=True)
    restacked = tx.init(stacked)
    assert jax.tree.structure(moved["opt_state"]) == jax.tree.structure(restacked)
    for a, b in zip(jax.tree.leaves(moved["opt_state"]), jax.tree.leaves(restacked), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype


@pytest.mark.parametrize("load_scanned", [False, True])
def test_hf_round_trip_of_a_scanned_model(tmp_path, load_scanned):
    _, scanned = _pair("bf16", dtype=jnp.float32)
    save_pretrained(scanned, tmp_path / "hf", format="hf")
    loaded = from_pretrained(
        tmp_path / "hf", dtype=jnp.float32, scan_layers=load_scanned, remat="activations"
    )
    assert loaded.scan_layers == load_scanned and loaded.remat == "activations"
    want = llama.unstack_layers(nnx.to_pure_dict(nnx.split(scanned)[1]))
    got = llama.unstack_layers(nnx.to_pure_dict(nnx.split(loaded)[1]))
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(a, b)
    tokens = _tokens()
    np.testing.assert_allclose(loaded(tokens), scanned(tokens), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- init


def test_init_takes_the_key_as_an_argument_and_lowers_without_weight_constants():
    from coat_jax.training import load_config
    from coat_jax.training.model import init_params_fn
    from coat_jax.training.sharding import make_mesh, param_shardings

    # Llama-2-7B, abstractly: 6.7B parameters that must never become constants.
    cfg = load_config(
        None,
        [
            "model.vocab_size=32000",
            "model.hidden_size=4096",
            "model.intermediate_size=11008",
            "model.num_hidden_layers=32",
            "model.num_attention_heads=32",
            "model.num_key_value_heads=32",
            "model.head_dim=128",
            "memory.scan_layers=true",
        ],
    )
    from coat_jax.training.model import model_def_for

    abstract = model_def_for(cfg.model, cfg).abstract_params
    assert sum(x.size for x in jax.tree.leaves(abstract)) > 6.7e9
    init = init_params_fn(cfg.model, cfg, param_shardings(abstract, make_mesh(1, 1)))
    key = jax.eval_shape(lambda: jax.random.key(0))
    text = init.lower(key).as_text()
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert "key<fry>" in main or "ui32" in main, main  # the key is the argument
    sizes = [
        int(np.prod([int(d) for d in m.group(1).split("x") if d.isdigit()] or [1]))
        for m in re.finditer(r"stablehlo\.constant dense<[^>]*> : tensor<([0-9x]*)", text)
    ]
    assert max(sizes, default=0) < 4096, max(sizes)


# ----------------------------------------------------------------------------- FP8 weight codes


def _with_weight_residual(option, precision="coat", **kw):
    fp8_config = FP8Config(weight_residual=option)
    return llama.Llama(CFG, precision=precision, rngs=nnx.Rngs(0), fp8_config=fp8_config, **kw)


# Every policy at the op level is in tests/fp8/test_fp8_ops.py; "attention" treats the weight codes
# as "full" does (recomputed in backward).
@pytest.mark.parametrize(
    "scan,remat", [(True, "none"), (True, "full"), (True, "activations"), (False, "activations")]
)
def test_fp8_weight_residual_gives_bit_identical_logits_and_gradients(scan, remat):
    tokens = _tokens()
    out = {}
    for option in WEIGHT_RESIDUALS:
        model = _with_weight_residual(option, scan_layers=scan, remat=remat)
        graphdef, state = nnx.split(model)

        def loss(state, graphdef=graphdef):
            logits = nnx.merge(graphdef, state)(tokens[:, :-1])
            nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1)
            return jnp.mean(nll), logits

        out[option] = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    master = jax.tree.leaves(out["master"])
    assert len(master) > 3
    for option in WEIGHT_RESIDUALS[1:]:
        for a, b in zip(master, jax.tree.leaves(out[option]), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _weight_codes_kept(option, remat, *, scan=True):
    """The E4M3 residuals of the model's vjp that have a projection weight's shape (3 x 32
    tokens: no activation has such a shape)."""
    model = _with_weight_residual(option, scan_layers=scan, remat=remat)
    graphdef, state = nnx.split(model)
    res = residuals(lambda s, x: nnx.merge(graphdef, s)(x).sum(), state, _tokens(3, 32))
    weights = set(_projection_shapes(scan))
    return sorted(
        r.shape
        for r in res
        if jnp.dtype(r.dtype) == jnp.float8_e4m3fn and tuple(r.shape) in weights
    )


def _projection_shapes(stacked: bool):
    d, f = CFG.hidden_size, CFG.intermediate_size
    kv = CFG.num_key_value_heads * CFG.head_dim
    shapes = [(d, d), (d, kv), (d, kv), (d, d), (d, f), (d, f), (f, d)]
    if stacked:
        return sorted((CFG.num_hidden_layers, *s) for s in shapes)
    return sorted(shapes * CFG.num_hidden_layers)


@pytest.mark.parametrize("remat", tuple(llama.REMAT_POLICIES))
def test_backward_keeps_fp8_weight_codes_only_with_fp8(remat):
    assert _weight_codes_kept("master", remat) == []
    # "activations" (and no remat) keep the WEIGHT-tagged codes of all seven projections of
    # every layer, stacked by the scan; "full" and "attention" recompute them in backward.
    expected = _projection_shapes(True) if remat in ("none", "activations") else []
    assert _weight_codes_kept("fp8", remat) == expected
    # "once" quantizes the stacked weights before the scan, outside every layer's remat: its
    # codes live for the whole step under every policy, once each (never stacked a second time).
    assert _weight_codes_kept("once", remat) == _projection_shapes(True)


def test_unrolled_layers_keep_each_layers_codes():
    assert _weight_codes_kept("fp8", "activations", scan=False) == _projection_shapes(False)
    assert _weight_codes_kept("once", "full", scan=False) == _projection_shapes(False)
    assert _weight_codes_kept("master", "none", scan=False) == []


def test_trainer_key_sets_the_weight_residual():
    from coat_jax.training import load_config
    from coat_jax.training.model import model_def_for

    for option in WEIGHT_RESIDUALS:
        cfg = load_config(None, [f"precision.fp8_weight_residual={option}", "precision.mode=coat"])
        model_def = model_def_for(cfg.model, cfg)
        model = nnx.merge(model_def.graphdef, model_def.abstract_state)
        assert model.fp8_config.weight_residual == option
    with pytest.raises(
        ValueError, match="precision.fp8_weight_residual=fp8 needs precision fp8 or coat"
    ):
        load_config(None, ["precision.fp8_weight_residual=fp8", "precision.mode=bf16"])

"""The families beyond Llama (Mistral, Qwen2, Qwen3, OLMo 2) against transformers' float32
models, in every precision and layout, and exported back to their own transformers classes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from coat_jax.checkpoint_io import SafetensorsSource, from_pretrained, save_pretrained
from coat_jax.convert import main as convert_main
from coat_jax.fp8_ops import FP8Config
from coat_jax.generate import generate_ids
from coat_jax.llama import Llama, LlamaConfig, rope_inv_freq
from coat_jax.memory import residuals
from tests.llama_reference import rel_err, token_ids, torch_logits
from tests.model.test_gguf import write_gguf
from tests.untraced import without_tracer

SEQ = 160
COMMON = dict(
    vocab_size=317,  # odd, as real vocabularies after added tokens are
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)
# Per family: its transformers config class and what it sets beyond COMMON (GQA everywhere,
# tied and untied embeddings, a head_dim apart from hidden/heads, RoPE theta and scaling).
FAMILIES = {
    "qwen2": ("Qwen2", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": ("Qwen3", dict(tie_word_embeddings=False, head_dim=32)),
    "mistral": (
        "Mistral",
        dict(
            tie_word_embeddings=False,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=4096,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
    ),
    "olmo2": ("Olmo2", dict(tie_word_embeddings=False)),
}


@without_tracer  # transformers' code only
def hf_model(family: str, seed: int = 0, **overrides):
    """A random transformers model of ``family`` (float32, eval): weights and biases wider than
    the 0.02 init, norms away from 1, so every tensor matters for the logits."""
    import torch
    import transformers

    prefix, extra = FAMILIES[family]
    config = getattr(transformers, f"{prefix}Config")(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each family saved once by transformers: {family: (folder, torch model, logits)}."""
    out = {}
    ids = token_ids(COMMON["vocab_size"], 1, SEQ, seed=1)
    for family in FAMILIES:
        model = hf_model(family)
        folder = tmp_path_factory.mktemp(family)
        model.save_pretrained(folder)
        out[family] = (folder, model, torch_logits(model, ids))
    return out, ids


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_float32_logits_match_transformers(saved, family, scan_layers):
    cases, ids = saved
    folder, _, want = cases[family]
    model = from_pretrained(
        folder, dtype=jnp.float32, param_dtype=jnp.float32, scan_layers=scan_layers
    )
    assert model.config.model_type == family
    got = model(jnp.asarray(ids))
    assert got.shape == want.shape
    assert rel_err(got, want) <= 1e-4


def _loss_and_grads(model, ids):
    graphdef, state = nnx.split(model)

    def loss(s):
        logits = nnx.merge(graphdef, s)(ids[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    return jax.jit(jax.value_and_grad(loss))(state)


# Every family in every precision (Llama's are tests/model/test_llama.py's).
PRECISION_CASES = [(f, p) for f in sorted(FAMILIES) for p in ("bf16", "fp8", "coat")]


@pytest.mark.parametrize("family, precision", PRECISION_CASES)
def test_one_train_step_is_finite(saved, family, precision):
    cases, ids = saved
    model = from_pretrained(cases[family][0], precision=precision, scan_layers=True)
    loss, grads = _loss_and_grads(model, jnp.asarray(ids[:, :33]))
    assert np.isfinite(float(loss))
    for path, g in nnx.to_flat_state(grads):
        g = np.asarray(g.get_value(), np.float32)
        # Every parameter, the family's biases and norms included, gets a gradient.
        assert np.isfinite(g).all() and np.abs(g).max() > 0, path


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_coat_layer_keeps_only_fp8_besides_attention(saved, family):
    """As for Llama (tests/fp8/test_fp8_ops.py::unscaled_activations): in precision "coat" the
    only activation-sized tensors a layer keeps that are not FP8 codes or their 1x16 scales
    are attention's q, k and v; the family's q/k norms and post-norms keep FP8 and the biases
    keep nothing."""
    config = LlamaConfig.from_hf(saved[0][family][0])
    n, k, h = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    b, t = 2, 32
    want = [((b, t, n, h), "bfloat16"), ((b, t, k, h), "bfloat16"), ((b, t, k, h), "bfloat16")]
    assert unscaled_activations(config, "coat") == sorted(want)
    # The check can fail: the same layer in "bf16" keeps BF16 activations of every op.
    assert len(unscaled_activations(config, "bf16")) > 3


def unscaled_activations(config, precision, b=2, t=32):
    """The activation residuals of one decoder layer that are neither FP8 codes nor their 1x16
    scales nor per-row statistics: ``[(shape, dtype name)]``, sorted."""
    model = Llama(config, precision=precision, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model.layers[0])
    ops, inv_freq = model.ops(), rope_inv_freq(config)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    layer = lambda s, x: nnx.merge(graphdef, s)(x, positions, inv_freq, ops)
    x = jax.ShapeDtypeStruct((b, t, config.hidden_size), jnp.bfloat16)
    kept = residuals(layer, state, x, param_argnums=(0,))
    dims = {config.hidden_size, config.intermediate_size}
    dims |= {
        config.num_attention_heads * config.head_dim,
        config.num_key_value_heads * config.head_dim,
    }
    unscaled = [
        (r.shape, jnp.dtype(r.dtype).name)
        for r in kept
        if r.is_activation
        and r.shape
        and r.dtype not in (jnp.float8_e4m3fn, jnp.float8_e5m2)
        and r.shape[-1] != 1  # RMSNorm's one 1/rms per row
        and not (r.dtype == jnp.float32 and r.shape[-1] * 16 in dims | {config.head_dim})
        and np.prod(r.shape) >= b * t * config.hidden_size // 16
    ]
    return sorted(unscaled)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_loads_in_its_transformers_class_with_the_same_logits(saved, family, tmp_path):
    import transformers

    cases, ids = saved
    folder, torch_model, want = cases[family]
    model = from_pretrained(folder, dtype=jnp.float32)
    save_pretrained(model, tmp_path / "hf", format="hf")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(reloaded) is type(torch_model)
    np.testing.assert_array_equal(torch_logits(reloaded, ids), want)
    # python -m coat_jax.convert: HF -> coat-jax -> HF, every tensor bit for bit.
    assert convert_main(["hf-to-jax", str(folder), str(tmp_path / "jax")]) == 0
    assert convert_main(["jax-to-hf", str(tmp_path / "jax"), str(tmp_path / "back")]) == 0
    original, back = SafetensorsSource(str(folder)), SafetensorsSource(str(tmp_path / "back"))
    assert sorted(back.names()) == sorted(original.names())
    for name in original.names():
        np.testing.assert_array_equal(back.get(name), original.get(name), err_msg=name)
    config = transformers.AutoConfig.from_pretrained(tmp_path / "back")
    assert config.model_type == family


@pytest.mark.parametrize(
    "family, overrides, message",
    [
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window=True is not supported"),
        ("qwen3", {"attention_bias": True}, "attention_bias=True is not supported"),
        ("olmo2", {"attention_bias": True}, "attention_bias=True is not supported"),
        ("qwen3", {"layer_types": ["sliding_attention"] * 2}, "layer_types"),
        ("mistral", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ("mistral", {"model_type": "mixtral"}, "model_type='mixtral' is not supported"),
    ],
)
def test_unsupported_switches_are_refused_in_one_line(saved, family, overrides, message):
    d = {**saved[0][family][1].config.to_dict(), **overrides}
    with pytest.raises(ValueError, match=message) as err:
        LlamaConfig.from_hf(d)
    assert "\n" not in str(err.value)


def test_mistral_sliding_window_matches_transformers(saved, tmp_path):
    """A window shorter than the sequence: transformers' float32 logits; decoding with a cache
    past the window gives the greedy tokens of the uncached model; FP8 attention takes the
    window, and its saved-output form, which has none, refuses attention past it in one line."""
    torch_model = hf_model("mistral", sliding_window=48)
    torch_model.save_pretrained(tmp_path)
    ids = saved[1]
    model = from_pretrained(tmp_path, dtype=jnp.float32, scan_layers=True)
    assert model.config.sliding_window == 48
    want = torch_logits(torch_model, ids)
    assert rel_err(model(jnp.asarray(ids)), want) <= 1e-4
    # The window matters: the same weights with a window past the sequence differ.
    assert rel_err(want, saved[0]["mistral"][2]) > 1e-3
    prompt = [int(i) for i in ids[0, :44]]
    greedy = list(prompt)
    # Right padding to one width keeps the uncached forward one compile: causal attention never
    # sees the padding.
    last_logits = jax.jit(lambda model, ids_1T, last: model(ids_1T)[0, last])
    for _ in range(8):  # the uncached model, one token at a time, up to 52 > 48 positions
        padded = jnp.asarray([greedy + [0] * (52 - len(greedy))])
        greedy.append(int(jnp.argmax(last_logits(model, padded, len(greedy) - 1))))
    assert generate_ids(model, [prompt], 8) == [greedy[44:]]
    fp8 = from_pretrained(tmp_path, precision="coat", fp8_attention=True)
    logits = lambda model, t: jax.eval_shape(lambda: model(jnp.zeros((1, t), jnp.int32)))
    assert logits(fp8, 49).shape == (1, 49, COMMON["vocab_size"])
    saved_output = from_pretrained(
        tmp_path,
        precision="coat",
        fp8_attention=True,
        fp8_config=FP8Config(attention_backward="saved_output"),
    )
    assert logits(saved_output, 48).shape == (1, 48, COMMON["vocab_size"])
    with pytest.raises(ValueError, match="exceeds sliding_window=48 and this FP8 attention"):
        logits(saved_output, 49)
    config = model.config
    with pytest.raises(ValueError, match="sliding_window=8 is not a switch of model_type='qwen2'"):
        dataclasses.replace(config, model_type="qwen2", sliding_window=8)


@pytest.mark.parametrize("family", ["olmo2", "qwen3"])
def test_cached_greedy_decode_matches_transformers(saved, family):
    """Decoding runs the family's layer with a KV cache (norms of q and k before the cache,
    post-norms after attention): transformers' greedy tokens, one by one."""
    import torch

    folder, torch_model, _ = saved[0][family]
    prompt = [int(i) for i in saved[1][0, :7]]
    with torch.no_grad():
        out = torch_model.generate(
            torch.tensor([prompt]), max_new_tokens=5, do_sample=False, pad_token_id=0
        )
    want = out[0, len(prompt) :].tolist()
    model = from_pretrained(folder, dtype=jnp.float32)
    assert generate_ids(model, [prompt], 5) == [want]


@pytest.mark.parametrize("fp8_attention", [False, True])
@pytest.mark.parametrize("family", ["olmo2", "qwen3"])
def test_activation_names_follow_what_the_layer_records(saved, family, fp8_attention):
    """The activation telemetry names each 1xG-scaled tensor of a layer (``group_scaled``, by
    family: q/k norms, post-norms); the layer records exactly that many. Qwen2's and Mistral's
    are Llama's."""
    config = LlamaConfig.from_hf(saved[0][family][0])
    model = Llama(config, precision="coat", fp8_attention=fp8_attention, rngs=nnx.Rngs(0))
    ids = jnp.zeros((1, 16), jnp.int32)
    _, scales = jax.eval_shape(lambda: model.observed_hidden_states(ids, jnp.bool_(True)))
    names, n_layers = model.activation_names(), config.num_hidden_layers
    assert scales["layers"]["group"]["max"].shape == (n_layers, len(names["group"]))
    assert scales["layers"]["linear"].shape == (n_layers, len(names["linear"]))


def test_qwen2_gguf_matches_transformers(saved, tmp_path):
    """A Qwen2 GGUF as llama.cpp writes it (biases, q/k rows unpermuted) loads as qwen2."""
    cases, ids = saved
    _, torch_model, want = cases["qwen2"]
    path = write_gguf(torch_model, str(tmp_path / "qwen2.gguf"), arch="qwen2")
    model = from_pretrained(path, dtype=jnp.float32, scan_layers=True)
    assert model.config.model_type == "qwen2" and model.config.tie_word_embeddings
    assert rel_err(model(jnp.asarray(ids)), want) <= 1e-4

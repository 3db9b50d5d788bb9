"""Per-op kernel choices: ``FP8Config.op_implementations`` and the trainer's ``kernels`` mapping.

Each named op runs the implementation its entry gives and every other op ``implementation``'s,
read off the Pallas kernels in the traced program; the results equal the all-XLA program's
(the kernels compute what their references do). Off a GPU the kernels run in interpret mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax import fp8_ops
from coat_jax.fp8_ops import FP8Config, ops_for
from coat_jax.training import load_config
from coat_jax.training.kernel_choice import kernels_mapping, op_implementations

INTERPRET = jax.default_backend() != "gpu"
# The Pallas kernel names each op's forward and backward launch.
KERNEL_NAMES = {
    "quantize_per_tensor": ("fp8_scaled_cast",),
    "rmsnorm": ("fp8_rmsnorm_fwd", "fp8_rmsnorm_bwd"),
    "swiglu": ("fp8_swiglu_fwd", "fp8_swiglu_bwd"),
}


def _mlp_block(config: FP8Config):
    """RMSNorm, gate/up linears, the fused SwiGLU and the down linear, as in a Llama MLP."""
    ops = ops_for("coat", config)

    def block(x, norm_w, w_gate, w_up, w_down):
        h = ops.rmsnorm(x, norm_w)
        gate, up = ops.linear(h, w_gate), ops.linear(h, w_up)
        return ops.linear(ops.silu_mul(gate, up), w_down)

    return block


def _args():
    k = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(k[0], (2, 16, 64), jnp.float32).astype(jnp.bfloat16)
    norm_w = 1 + 0.1 * jax.random.normal(k[1], (64,))
    w_gate = 0.1 * jax.random.normal(k[2], (64, 128))
    w_up = 0.1 * jax.random.normal(k[3], (64, 128))
    w_down = 0.1 * jax.random.normal(k[4], (128, 64))
    return x, norm_w, w_gate, w_up, w_down


def _value_and_grads(config: FP8Config):
    block = _mlp_block(config)

    def loss(*args):
        return jnp.sum(block(*args).astype(jnp.float32) ** 2)

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))


def _kernels_in(fn, *args) -> set[str]:
    text = str(jax.make_jaxpr(fn)(*args))
    return {name for names in KERNEL_NAMES.values() for name in names if name in text}


def _config(implementation="xla", pairs=()):
    return FP8Config(
        implementation=implementation,
        op_implementations=pairs,
        interpret=INTERPRET,
        swiglu="fused",
    )


@pytest.mark.parametrize(
    "implementation, pairs, expected",
    [
        ("xla", (), set()),
        ("xla", (("quantize_per_tensor", "pallas"),), {"fp8_scaled_cast"}),
        ("xla", (("swiglu", "pallas"),), {"fp8_swiglu_fwd", "fp8_swiglu_bwd"}),
        (
            "pallas",
            (("swiglu", "xla"),),
            {"fp8_scaled_cast", "fp8_rmsnorm_fwd", "fp8_rmsnorm_bwd"},
        ),
        (
            "pallas",
            (),
            {n for names in KERNEL_NAMES.values() for n in names},
        ),
    ],
)
def test_each_op_runs_the_implementation_named_for_it(implementation, pairs, expected):
    args = _args()
    assert _kernels_in(_value_and_grads(_config(implementation, pairs)), *args) == expected


def test_mixed_kernels_give_the_all_xla_results():
    # As the trainer compiles COAT on a GPU: without XLA's excess precision, which could keep
    # XLA's BF16 intermediates (the SwiGLU product) in float32 where the kernels round them.
    options = dict(fp8_ops.fp8_compiler_options() or {}, xla_allow_excess_precision=False)
    args = _args()
    want = jax.jit(_value_and_grads(_config("xla")), compiler_options=options)(*args)
    pairs = (("quantize_per_tensor", "pallas"), ("swiglu", "pallas"))
    got = jax.jit(_value_and_grads(_config("xla", pairs)), compiler_options=options)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize(
    "pairs, match",
    [
        ((("foo", "xla"),), "valid ops are"),
        ((("swiglu", "gpu"),), "unknown implementation 'gpu'"),
        ((("swiglu", "xla"), ("swiglu", "pallas")), "names op 'swiglu' twice"),
        ([("swiglu", "xla")], "tuple of \\(op, implementation\\)"),
        ((("swiglu",),), "tuple of \\(op, implementation\\)"),
    ],
)
def test_bad_op_implementations_are_refused(pairs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        FP8Config(op_implementations=pairs)


def test_implementation_of_names_the_op_or_refuses():
    config = FP8Config(implementation="xla", op_implementations=(("rmsnorm", "pallas"),))
    assert config.implementation_of("rmsnorm") == "pallas"
    assert config.implementation_of("swiglu") == "xla"
    with pytest.raises(ValueError, match="unknown kernel op 'attention'"):
        config.implementation_of("attention")
    assert set(fp8_ops.KERNEL_OPS) >= set(KERNEL_NAMES)


def test_trainer_key_checks_and_reaches_the_model():
    from coat_jax.llama import LlamaConfig
    from coat_jax.training.model import model_def_for

    cfg = load_config(None, ["kernels.quantize_per_tensor=pallas", "kernels.swiglu=xla"])
    assert op_implementations(cfg.kernels) == (
        ("quantize_per_tensor", "pallas"),
        ("swiglu", "xla"),
    )
    for bad, match in [
        ("kernels.attention=xla", "kernels.attention is not a part; the parts are"),
        ("kernels.swiglu=fast", "kernels.swiglu='fast' is not valid; choose one of"),
        ("kernels=fast", "kernels='fast' is not valid"),
        ("fp8_op_kernels.swiglu=xla", "`fp8_op_kernels` is now `kernels.OP`"),  # old flat key
    ]:
        with pytest.raises(ValueError, match=match):
            load_config(None, ["precision.mode=coat", bad])
    with pytest.raises(ValueError, match="precision.mode=bf16 has none"):
        load_config(None, ["precision.mode=bf16", "kernels.swiglu=xla"])

    cfg = load_config(
        None,
        ["precision.mode=coat", "kernels.fp8_ops=xla", "kernels.quantize_per_tensor=pallas"],
    )
    tiny = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    text = str(model_def_for(tiny, cfg).graphdef)  # the model's FP8Config lives in it
    assert "op_implementations=(('quantize_per_tensor', 'pallas'),)" in text, text[:2000]


def test_trainer_key_takes_a_yaml_mapping(tmp_path):
    """In a YAML file ``kernels`` may be a mapping part by part, checked part by part; an
    empty mapping leaves every part ``auto``."""
    path = tmp_path / "run.yaml"
    path.write_text("precision:\n  mode: coat\nkernels:\n  swiglu: pallas\n  rmsnorm: xla\n")
    cfg = load_config(path)
    assert kernels_mapping(cfg.kernels) == {"swiglu": "pallas", "rmsnorm": "xla"}
    assert op_implementations(cfg.kernels) == (("rmsnorm", "xla"), ("swiglu", "pallas"))
    for body, match in [
        ("kernels: {swiglu: fast}\n", "kernels.swiglu='fast' is not valid"),
        ("kernels: {attention: xla}\n", "kernels.attention is not a part"),
        ("kernels: {swiglu: 1}\n", "kernels.swiglu=1 is not valid"),
    ]:
        path.write_text("precision:\n  mode: coat\n" + body)
        with pytest.raises(ValueError, match=match):
            load_config(path)
    path.write_text("kernels: {}\n")
    assert kernels_mapping(load_config(path).kernels) == {}


def test_one_parts_override_merges_into_the_files_setting(tmp_path):
    """``kernels.PART=IMPL`` on the command line over a file that sets ``kernels`` (a name or a
    mapping) replaces or adds that part and keeps the others; so does a file's mapping over its
    ``base:`` file's setting."""
    path = tmp_path / "run.yaml"
    path.write_text("kernels: {swiglu: pallas, rmsnorm: xla}\n")
    cfg = load_config(path, ["kernels.swiglu=xla"])
    assert kernels_mapping(cfg.kernels) == {"swiglu": "xla", "rmsnorm": "xla"}
    cfg = load_config(path, ["kernels.quantize_per_tensor=pallas"])
    assert kernels_mapping(cfg.kernels) == {
        "swiglu": "pallas",
        "rmsnorm": "xla",
        "quantize_per_tensor": "pallas",
    }
    # Over a name, the name's parts are kept.
    cfg = load_config(None, ["kernels=xla", "kernels.rmsnorm=pallas"])
    assert kernels_mapping(cfg.kernels) == {
        "optimizer": "xla",
        "fp8_ops": "xla",
        "rmsnorm": "pallas",
    }
    with pytest.raises(ValueError, match="kernels.swiglu='fast' is not valid"):
        load_config(path, ["kernels.swiglu=fast"])
    # A file's mapping over its base file's setting merges part by part too.
    child = tmp_path / "child.yaml"
    child.write_text("base: run.yaml\nkernels:\n  rmsnorm: pallas\n")
    assert kernels_mapping(load_config(child).kernels) == {"swiglu": "pallas", "rmsnorm": "pallas"}
    path.write_text("kernels: pallas\n")
    assert kernels_mapping(load_config(child).kernels) == {
        "optimizer": "pallas",
        "fp8_ops": "pallas",
        "rmsnorm": "pallas",
    }

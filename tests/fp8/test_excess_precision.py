"""The trainer's ``xla_excess_precision``: XLA's ``xla_allow_excess_precision`` for its programs.

Unset (``null``) it is off for precision ``coat`` on a GPU (measured faster on the H200) and
XLA's own default otherwise; ``true`` and ``false`` reach the compiled training step and evaluation (the jits' compiler options are
checked to reach both in tests/training/test_train.py). The flag's effect is checked on the backend that
runs the tests (the CPU in CI; the H200 too): without excess precision a jitted chain of
bfloat16 ops rounds after every op, as the ops one by one do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coat_jax.fp8_ops import fp8_compiler_options, is_gpu_backend
from coat_jax.training import load_config
from coat_jax.training.model import excess_precision, next_token_loss
from coat_jax.training.program import build_program, compiler_options
from tests.tiny_runs import tiny_run

RUN = [*tiny_run(layers=1, batch_size=2), "xla.compilation_cache_dir=null", "precision.mode=coat"]


def _chain(x):
    y = jnp.sin(x.astype(jnp.bfloat16)) * jnp.bfloat16(3)
    return jnp.exp(y).astype(jnp.float32)


def test_without_excess_precision_bfloat16_rounds_after_every_op():
    x = jnp.linspace(0.0, 3.0, 4096, dtype=jnp.float32)
    op_by_op = _chain(x)  # each op its own program: every result is rounded to bfloat16
    rounded = jax.jit(_chain, compiler_options={"xla_allow_excess_precision": False})(x)
    kept = jax.jit(_chain, compiler_options={"xla_allow_excess_precision": True})(x)
    np.testing.assert_array_equal(np.asarray(rounded), np.asarray(op_by_op))
    # With XLA's default the intermediates stay float32 and many results differ: most of them
    # on the CPU, 1255 of the 4096 on the H200 (JAX 0.11.2), where the chain is one fusion too.
    assert int((kept != op_by_op).sum()) > x.size // 8


@pytest.mark.parametrize(
    "backend, gpu", [("gpu", True), ("cuda", True), ("rocm", True), ("cpu", False), ("tpu", False)]
)
def test_gpu_backends_by_every_name(backend, gpu):
    """The FP8 GEMMs' compiler options and COAT's excess-precision default share one test of
    the backend, so they cannot disagree about which backends are GPUs."""
    assert is_gpu_backend(backend) is gpu
    cfg = load_config(None, RUN)
    assert (excess_precision(cfg, backend) is False) is gpu
    assert (fp8_compiler_options(backend) is not None) is gpu


@pytest.mark.parametrize("value", [None, True, False])
@pytest.mark.parametrize("precision", ["bf16", "fp8", "coat"])
def test_the_option_becomes_xlas(value, precision):
    extra = [] if value is None else [f"xla.excess_precision={str(value).lower()}"]
    optimizer = "coat_adamw" if precision == "coat" else "adamw"
    cfg = load_config(
        None, [*RUN, f"precision.mode={precision}", f"optimizer.name={optimizer}", *extra]
    )
    assert cfg.xla_excess_precision is value
    options = compiler_options(cfg) or {}
    on_gpu = jax.default_backend() == "gpu"
    if value is not None:
        assert options["xla_allow_excess_precision"] is value
    elif precision == "coat" and on_gpu:  # the measured default: COAT rounds its intermediates
        assert options["xla_allow_excess_precision"] is False
    else:  # XLA's own default
        assert "xla_allow_excess_precision" not in options
    # The default per backend, whichever this one is: off for COAT on a GPU only.
    expected_gpu = value if value is not None else (False if precision == "coat" else None)
    assert excess_precision(cfg, "gpu") is expected_gpu
    assert excess_precision(cfg, "cpu") is value


def test_the_cpu_default_leaves_the_step_traceable_inside_another_trace():
    """Unset on the CPU, COAT's step carries no compiler options, so it can be traced inside
    another (JAX refuses ``compiler_options`` on a nested jit); set, the option is the user's."""
    cfg = load_config(None, RUN)
    if jax.default_backend() != "cpu":
        pytest.skip("the CPU default")
    assert compiler_options(cfg) is None
    program = build_program(cfg, cfg.model)
    jax.make_jaxpr(program.step_fn)(
        program.abstract_params, program.abstract_opt_state, program.abstract_batch()
    )


def test_the_trainers_loss_without_excess_precision():
    """The trainer's loss compiled with ``xla.excess_precision=false`` runs and its loss agrees
    with XLA's default's to bfloat16 rounding (only where intermediates are rounded changes)."""
    losses = {}
    for value in ("true", "false"):
        cfg = load_config(None, [*RUN, f"xla.excess_precision={value}"])
        program = build_program(cfg, cfg.model)
        params = program.init_params(jax.random.key(0))
        tokens = jax.random.randint(
            jax.random.key(1), (2, cfg.seq_len + 1), 0, cfg.model.vocab_size
        )
        loss = jax.jit(
            lambda p, t, m=program.model_def: next_token_loss(m, p, t),
            compiler_options=compiler_options(cfg),
        )
        losses[value] = float(loss(params, tokens))
    assert np.isfinite(losses["false"])
    assert abs(losses["false"] - losses["true"]) < 1e-2 * abs(losses["true"])


def test_a_wrong_value_names_the_option():
    with pytest.raises(ValueError, match=r"xla\.excess_precision"):
        load_config(None, [*RUN, "xla.excess_precision=maybe"])


# --------------------------------------------------------------------------------------------
# The barrier on the kept FP8 codes: always on (the trainer key fp8_codes_barrier was removed)


@pytest.mark.parametrize("extra", [[], ["xla.excess_precision=false"]])
def test_the_model_always_gets_the_codes_barrier(extra):
    cfg = load_config(None, [*RUN, *extra])
    program = build_program(cfg, cfg.model)
    model = nnx.merge(program.model_def.graphdef, program.model_def.abstract_state)
    assert model.fp8_config.codes_barrier is True


@pytest.mark.parametrize("value", ["true", "false"])
def test_fp8_codes_barrier_is_refused_as_removed(value):
    with pytest.raises(ValueError, match="fp8_codes_barrier was removed: .* always on"):
        load_config(None, [*RUN, "xla.excess_precision=false", f"fp8_codes_barrier={value}"])

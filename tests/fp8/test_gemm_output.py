"""What the FP8 GEMMs write: ``FP8Config(gemm_output=...)``; the trainer always takes ``compute``.

With ``compute`` (the default) the GEMMs whose result is an activation (forward's, and dgrad's
of one weight) are BF16 dots of scaled FP8 codes, which cuBLASLt writes in BF16 itself; with
``float32`` every GEMM writes float32 and the cast is a separate pass. The per-op spelling is
checked in tests/fp8/test_fp8_ops.py (and compiled on the GPU there); here the trainer's own model,
with its ``FP8Config`` replaced for ``float32`` (the trainer key ``fp8_gemm_output`` was
removed).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax.training import load_config
from coat_jax.training.model import loss_from_hidden
from coat_jax.training.program import build_program
from tests.fp8.test_fp8_ops import _dot_operand_sources
from tests.tiny_runs import tiny_run

# Pinned: plain (unremat) attention and layers, so the dots are the 7 projections' and the head's.
RUN = [
    *tiny_run(layers=1, batch_size=2),
    "kernels=xla",
    "xla.compilation_cache_dir=null",
    "memory.remat=none",
    "precision.fp8_attention=false",
    "memory.scan_layers=false",
]


def _dots(gemm_output: str, precision: str = "coat"):
    """The dots of the trainer's loss and gradient for one setting, and the loss value."""
    cfg = load_config(None, [*RUN, f"precision.mode={precision}"])
    program = build_program(cfg, cfg.model)
    model = program.model_def.bind(program.abstract_params)
    assert model.fp8_config.gemm_output == "compute"  # the trainer's setting
    params = program.init_params(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, cfg.seq_len + 1), 0, cfg.model.vocab_size)

    def loss(p):
        model = program.model_def.bind(p)
        model.fp8_config = dataclasses.replace(model.fp8_config, gemm_output=gemm_output)
        hidden_BTD = model.hidden_states(tokens[:, :-1])
        return loss_from_hidden(program.model_def, model, hidden_BTD, tokens[:, 1:])

    dots = _dot_operand_sources(jax.make_jaxpr(jax.value_and_grad(loss))(params))
    return dots, jax.jit(loss)(params)  # one program, not one per operation


@pytest.mark.parametrize("precision", ["fp8", "coat"])
def test_trainer_gemm_output(precision):
    dots_c, loss_c = _dots("compute", precision)
    dots_f, loss_f = _dots("float32", precision)
    fp8 = {"float8_e4m3fn", "float8_e5m2"}
    is_fp8 = lambda d: all(o.removesuffix("*scale") in fp8 for o in d[1:])
    fp8_c, fp8_f = [d for d in dots_c if is_fp8(d)], [d for d in dots_f if is_fp8(d)]
    # One layer: 7 projections (q, k, v, o, gate, up, down) x forward, dgrad, wgrad.
    assert len(fp8_c) == len(fp8_f) == 21, (dots_c, dots_f)
    assert all(d[0] == "float32" for d in fp8_f)
    # compute: the 7 forward GEMMs and the dgrads of o_proj and down_proj write BF16 (q|k|v and
    # gate|up sum their dgrads in float32).
    assert sum(d[0] == "bfloat16" for d in fp8_c) == 9, fp8_c
    assert abs(float(loss_c) - float(loss_f)) < 1e-2 * abs(float(loss_f))
    assert np.isfinite(float(loss_c))


def test_trainer_gemm_output_is_refused_as_removed():
    for value in ("float32", "compute", "bf16"):
        with pytest.raises(ValueError, match="fp8_gemm_output was removed"):
            load_config(None, [*RUN, f"fp8_gemm_output={value}"])


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
def test_gemm_output_compute_matches_float32_on_gpu():
    # On the GPU both spellings are one cuBLASLt FP8 GEMM with the same scales (a_scale * b_scale
    # in float32); only where the BF16 rounding of the result happens differs (in the GEMM's
    # epilogue or in a separate cast). Forward and the input gradient agree to one BF16 step.
    from coat_jax import fp8_ops
    from coat_jax.fp8_ops import FP8Config

    x = jax.random.normal(jax.random.key(0), (4, 256, 512), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (512, 384)) * 0.05
    c = jax.random.normal(jax.random.key(2), (4, 256, 384), jnp.float32)

    def run(gemm_output):
        config = FP8Config(gemm_output=gemm_output)

        def f(x, w):
            y, vjp = jax.vjp(lambda x: fp8_ops.fp8_linear(x, w, config), x)
            return y, vjp(c.astype(y.dtype))[0]

        return jax.jit(f, compiler_options=fp8_ops.fp8_compiler_options())(x, w)

    for a, b in zip(run("compute"), run("float32"), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        same = float(np.mean(a == b))
        print(f"bit-identical fraction {same:.6f}")
        step = 2.0**-7 * np.maximum(np.abs(a), np.abs(b))
        assert np.all(np.abs(a - b) <= step + 1e-30), np.abs(a - b).max()

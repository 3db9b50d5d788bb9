"""benchmarks/bench_optimizer.py: the memory check that fails fast on a device too small."""

import sys
from pathlib import Path

import optax
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_optimizer as B  # noqa: E402

import coat_jax  # noqa: E402

SHAPES = {"a": (256, 512), "b": (512,)}  # 131,584 float32 parameters: 526,336 bytes
PARAM_BYTES = 4 * (256 * 512 + 512)


def test_check_fits_counts_parameters_and_state_against_free_memory():
    init = optax.adamw(1e-3).init  # two float32 moments: the state is twice the parameters
    need = 3 * PARAM_BYTES  # plus the step count's 4 bytes
    B.check_fits("adamw", init, SHAPES, {"bytes_limit": need + 4, "bytes_in_use": 0})
    with pytest.raises(MemoryError, match=r"adamw: .* GiB free .*--layers"):
        B.check_fits("adamw", init, SHAPES, {"bytes_limit": need + 4, "bytes_in_use": 1})
    # What is in use (e.g. the gradients) counts against the limit.
    with pytest.raises(MemoryError):
        B.check_fits("adamw", init, SHAPES, {"bytes_limit": 2 * need, "bytes_in_use": need})


def test_check_fits_uses_the_optimizers_own_state():
    """coat_adamw's FP8 state is about a quarter of adamw's: the same budget fits it."""
    budget = {"bytes_limit": 2 * PARAM_BYTES, "bytes_in_use": 0}
    with pytest.raises(MemoryError):
        B.check_fits("adamw", optax.adamw(1e-3).init, SHAPES, budget)
    B.check_fits("coat_adamw", coat_jax.coat_adamw(1e-3, implementation="xla").init, SHAPES, budget)


@pytest.mark.parametrize("stats", [None, {}, {"bytes_in_use": 10}])
def test_check_fits_skips_devices_without_a_limit(stats):
    B.check_fits("adamw", optax.adamw(1e-3).init, {"a": (1 << 20, 1 << 10)}, stats)

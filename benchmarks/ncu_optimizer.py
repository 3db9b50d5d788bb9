"""One fused COAT AdamW apply on a Llama-2-7B MLP weight, for Nsight Compute.

Builds a [4096, 11008] float32 parameter, its float32 gradient and E4M3 moments, and runs
``pallas_kernels.coat_adam.coat_adamw_apply`` three times (a GPU is required). Profile the
second launch::

    ncu --clock-control none --kernel-name coat_adamw_apply --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python benchmarks/ncu_optimizer.py 16/4

Argument: optionally one launch setting in ``bench_optimizer.parse_setting``'s syntax, e.g.
``16/4/t4`` (default ``16/4``).
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_optimizer import parse_setting  # noqa: E402

from pallas_kernels import coat_adam as ca  # noqa: E402


def main(argv):
    if len(argv) > 1:
        raise SystemExit("usage: ncu_optimizer.py [SETTING]")
    cfg = parse_setting(argv[0] if argv else "16/4")
    spec = ca.MomentSpec()
    k1, k2 = jax.random.split(jax.random.key(0))
    shape = (4096, 11008)
    p = jax.random.normal(k1, shape, jnp.float32)
    g = jax.random.normal(k2, shape, jnp.float32) * 1e-3
    mu = ca.quantize_moment(g * 0.1, "e4m3", spec, 16)
    nu = ca.quantize_moment(g * g, "e4m3", spec, 16)
    hyper = dict(learning_rate=1e-4, weight_decay=0.1, b1=0.9, b2=0.999, eps=1e-8, expand_min=16)
    step = jax.jit(
        lambda p, g, mu, nu, t: ca.coat_adamw_apply(
            p, g, mu, nu, count=t, spec=spec, implementation="pallas", config=cfg, **hyper
        )
    )
    for t in range(1, 4):
        jax.block_until_ready(step(p, g, mu, nu, jnp.int32(t)))
    print("done", cfg)


if __name__ == "__main__":
    main(sys.argv[1:])

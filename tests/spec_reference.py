"""An independent float64 numpy rendering of SPEC section 2 (COAT AdamW with FP8 moments).

Written from the SPEC text, not from coat_jax: the tests compare the library against it. The only
choices the SPEC leaves open are taken as coat_jax documents them: k is clipped to
[1 / expand_min, 4096] (k = inf for a group whose magnitudes are all equal), the scale uses the
format's own largest value (448 for E4M3, 57344 for E5M2), and a short last group is zero-padded.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FMAX = {"e4m3": 448.0, "e5m2": 57344.0}
DTYPE = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def _groups(x, gs):
    n = x.shape[-1]
    g = -(-n // gs)
    pad = np.zeros((*x.shape[:-1], g * gs - n))
    return np.concatenate([x, pad], axis=-1).reshape(*x.shape[:-1], g, gs)


def _ungroup(xg, n):
    return xg.reshape(*xg.shape[:-2], -1)[..., :n]


def fp8_round(x, fmt):
    """Clip to the format's max, round to the nearest FP8 value (ties to even), back to float64."""
    fmax = FMAX[fmt]
    return np.clip(x, -fmax, fmax).astype(DTYPE[fmt]).astype(np.float64)


def quantize(x, *, gs, fmt, expand_min, expansion):
    """Returns (codes as float64 values, stats dict) for a float64 moment."""
    fmax = FMAX[fmt]
    xg = _groups(np.asarray(x, np.float64), gs)
    if not expansion:
        s = (np.abs(xg).max(-1) + 1e-20) / fmax
        return _ungroup(fp8_round(xg / s[..., None], fmt), x.shape[-1]), {"scale": s}
    a = np.abs(xg)
    mx = a.max(-1) + 1e-30
    nz = np.where(a > 0, a, np.inf).min(-1)
    mn = np.where(np.isfinite(nz), nz, 0.0) + 1e-30
    c = np.sqrt(mx) * np.sqrt(mn)
    with np.errstate(divide="ignore"):
        k = np.floor(np.log2(fmax * fmax / 2) / np.log2(mx / mn) * expand_min) / expand_min
    k = np.clip(k, 1.0 / expand_min, 4096.0)
    y = np.sign(xg) * np.abs(xg / c[..., None]) ** k[..., None]
    s = (mx / c) ** k / fmax
    q = fp8_round(y / s[..., None], fmt)
    return _ungroup(q, x.shape[-1]), {"scale": s, "expand": k, "center": c}


def dequantize(q, stats, *, gs):
    qg = _groups(q, gs)
    y = qg * stats["scale"][..., None]
    if "expand" not in stats:
        return _ungroup(y, q.shape[-1])
    x = np.sign(y) * np.abs(y) ** (1.0 / stats["expand"][..., None]) * stats["center"][..., None]
    return _ungroup(x, q.shape[-1])


class CoatAdamW:
    """COAT AdamW on one float64 parameter array, per SPEC section 2."""

    def __init__(
        self,
        shape,
        *,
        lr,
        b1=0.9,
        b2=0.999,
        eps=1e-8,
        wd=0.0,
        gs=128,
        expand_min=16,
        expansion=True,
        mu_format="e4m3",
        nu_format="e4m3",
    ):
        self.hp = dict(lr=lr, b1=b1, b2=b2, eps=eps, wd=wd)
        self.q = dict(gs=gs, expand_min=expand_min, expansion=expansion)
        self.fmts = (mu_format, nu_format)
        zero = np.zeros(shape)
        self.mu = quantize(zero, fmt=mu_format, **self.q)
        self.nu = quantize(zero, fmt=nu_format, **self.q)
        self.t = 0

    def step(self, p, g):
        h = self.hp
        self.t += 1
        m = dequantize(*self.mu, gs=self.q["gs"])
        v = dequantize(*self.nu, gs=self.q["gs"])
        g = np.asarray(g, np.float64)
        m = h["b1"] * m + (1 - h["b1"]) * g
        v = h["b2"] * v + (1 - h["b2"]) * g * g
        update = m / (1 - h["b1"] ** self.t) / (np.sqrt(v / (1 - h["b2"] ** self.t)) + h["eps"])
        update = update + h["wd"] * p
        self.mu = quantize(m, fmt=self.fmts[0], **self.q)
        self.nu = quantize(v, fmt=self.fmts[1], **self.q)
        return p - h["lr"] * update

"""What every backend does to the raw scores before the softmax: scale, bias, soft cap.

Shared by the Triton kernels and the blockwise backend, so both compute the same thing.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)  # base-2 logsumexp -> natural log


@dataclasses.dataclass(frozen=True, kw_only=True)
class Logits:
    """Static description of what is added to / done with the scores before softmax.

    `bias_dims` / `mask_dims`: for a bias / boolean mask broadcastable to [B, N, T, S],
    which of those four dims it has in full (the rest are 1). `bias_grad`: the backward
    pass also returns the bias gradient. `softcap`: cap * tanh(s / cap).
    """

    bias_dims: tuple[bool, bool, bool, bool] | None = None
    mask_dims: tuple[bool, bool, bool, bool] | None = None
    bias_grad: bool = False
    softcap: float | None = None


def base2_scores(s, *, scale: float, bias=None, softcap=None):
    """Raw q k^T scores (float32) -> base-2 scores, and tanh(s / cap) when soft-capped
    (the backward needs it).

    Without bias or cap this is one multiply by scale * log2(e) (exp(x) = exp2(x log2 e));
    otherwise the natural scores scale * q k^T + bias are capped, then put in base 2.
    """
    if bias is None and softcap is None:
        return s * (scale * LOG2E), None
    s = s * scale
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    t = None
    if softcap is not None:
        t = jnp.tanh(s / softcap)
        s = softcap * t
    return s * LOG2E, t


def backward_stats(o, do, lse, dlse):
    """What the backward pass needs per query row, [B, N, T] float32 each.

    The logsumexp in base 2 with +inf on empty rows (so that P = exp2(S - lse) is exactly
    0 there, no mask needed), and D = rowsum(dO * O) - dlse (the logsumexp's cotangent
    enters through D: d lse_i / d s_ij = p_ij).
    """
    delta = jnp.einsum(
        "btnh,btnh->bnt",
        o.astype(jnp.float32),
        do.astype(jnp.float32),
        precision=lax.Precision.HIGHEST,
    )
    if dlse is not None:
        delta = delta - dlse
    return jnp.where(jnp.isneginf(lse), jnp.inf, lse * LOG2E), delta

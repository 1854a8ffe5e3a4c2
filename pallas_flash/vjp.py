"""The one custom_vjp that joins a forward pass to its recomputation backward pass.

The forward saves only (q, k, v, o, lse) and the lengths: linear in the sequence length.
The backward recomputes the attention probabilities tile by tile from q, k and the
logsumexp. The logsumexp is an output too, and differentiable: its cotangent enters
the backward pass through D (d lse_i / d s_ij = p_ij, so D_i becomes D_i - dlse_i),
which is what merging partial attention results (ring attention) needs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from pallas_flash import blockwise, masks
from pallas_flash.triton import backward as triton_backward
from pallas_flash.triton import forward as triton_forward


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything static about one call: backend, mask, scale and tile configs."""

    backend: str  # "triton" or "xla_blockwise"
    spec: masks.MaskSpec
    scale: float
    fwd_config: Any
    bwd_config: Any
    interpret: bool = False
    dropout_rate: float = 0.0


def _kernels(plan: Plan):
    """The plan's forward and backward functions, with everything static bound."""
    if plan.backend == "triton":
        fwd, bwd, extra = (
            triton_forward.forward,
            triton_backward.backward,
            {"interpret": plan.interpret},
        )
    elif plan.backend == "xla_blockwise":
        fwd, bwd, extra = blockwise.forward, blockwise.backward, {}
    else:
        raise ValueError(f"no kernel backend named {plan.backend!r}")
    common = dict(spec=plan.spec, scale=plan.scale, dropout_rate=plan.dropout_rate, **extra)
    return (
        functools.partial(fwd, config=plan.fwd_config, **common),
        functools.partial(bwd, config=plan.bwd_config, **common),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(plan: Plan, q, k, v, q_len, kv_len, segments=None, seeds=None):
    """Returns (o [B, T, N, H], lse [B, N, T] float32, natural log, -inf on empty rows).

    `segments` is None or (query ids [B, T], key ids [B, S]) int32; `seeds` is None or
    the dropout seeds, int32 [2] (dropout.seeds_from_key).
    """
    return _kernels(plan)[0](q, k, v, q_len, kv_len, segments, seeds)


def _attention_fwd(plan, q, k, v, q_len, kv_len, segments=None, seeds=None):
    o, lse = _kernels(plan)[0](q, k, v, q_len, kv_len, segments, seeds)
    return (o, lse), (q, k, v, o, lse, q_len, kv_len, segments, seeds)


def _attention_bwd(plan, residuals, cotangents):
    q, k, v, o, lse, q_len, kv_len, segments, seeds = residuals
    do, dlse = cotangents
    dq, dk, dv = _kernels(plan)[1](q, k, v, o, lse, do, dlse, q_len, kv_len, segments, seeds)
    return dq, dk, dv, None, None, None, None


attention.defvjp(_attention_fwd, _attention_bwd)

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
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from pallas_flash import blockwise, masks
from pallas_flash.logits import Logits
from pallas_flash.mosaic import backward as mosaic_backward
from pallas_flash.mosaic import forward as mosaic_forward
from pallas_flash.triton import backward as triton_backward
from pallas_flash.triton import forward as triton_forward


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything static about one call: backend, mask, scale and tile configs."""

    backend: str  # "mosaic", "triton" or "xla_blockwise"
    spec: masks.MaskSpec
    scale: float
    fwd_config: Any
    bwd_config: Any
    interpret: bool = False
    dropout_rate: float = 0.0
    logits: Logits = Logits()  # bias / mask broadcast pattern, soft cap


def _kernels(plan: Plan, bias_grad: bool = False):
    """The plan's forward and backward functions, with everything static bound."""
    logits = dataclasses.replace(plan.logits, bias_grad=bias_grad)
    common = dict(spec=plan.spec, scale=plan.scale, dropout_rate=plan.dropout_rate, logits=logits)
    if plan.backend == "triton":
        fwd, bwd = triton_forward.forward, triton_backward.backward
        common.update(interpret=plan.interpret)
    elif plan.backend == "mosaic":
        fwd, bwd = mosaic_forward.forward, mosaic_backward.backward
        common.update(interpret=plan.interpret)
    elif plan.backend == "xla_blockwise":
        fwd, bwd = blockwise.forward, blockwise.backward
    else:
        raise ValueError(f"no kernel backend named {plan.backend!r}")
    return (
        functools.partial(fwd, config=plan.fwd_config, **common),
        functools.partial(bwd, config=plan.bwd_config, **common),
    )


def kernels(plan: Plan):
    """The plan's (forward, backward) functions, for callers that write their own VJP
    around them (ring.py merges per-shard results and reuses the backward kernels)."""
    return _kernels(plan)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(
    plan: Plan,
    q,
    k,
    v,
    q_len,
    kv_len,
    segments=None,
    seeds=None,
    bias=None,
    mask=None,
    layout=None,
):
    """Returns (o [B, T, N, H], lse [B, N, T] float32, natural log, -inf on empty rows).

    `segments` is None or (query ids [B, T], key ids [B, S]) int32; `seeds` is None or
    the dropout seeds, int32 [2] (dropout.seeds_from_key); `bias` broadcasts to
    [B, N, T, S]; `mask` too, in kernel_mask's form; `layout` is a block-sparse
    layout, bool [1 or N, T / block_q, S / block_kv] at the configs' tile sizes.
    """
    return _kernels(plan)[0](q, k, v, q_len, kv_len, segments, seeds, bias, mask, layout)


def kernel_mask(plan: Plan, mask):
    """The user's boolean mask (or None) in the form the backend reads, made once per
    call (outside the custom_vjp) and shared by the forward and backward kernels: the
    Triton kernels take it bit-packed, along the query rows when it varies along T, else
    along the keys when it varies along S (masks.mask_word_axis, masks.pack_mask_bits
    says why); every other case (a mask constant along both, the other backends) takes
    bytes."""
    if mask is None:
        return None
    axis = masks.mask_word_axis(plan.logits.mask_dims) if plan.backend == "triton" else None
    if axis is not None:
        return masks.pack_mask_bits(mask, axis=axis)
    return mask.astype(jnp.int8)


def _attention_fwd(plan, *args):
    # symbolic_zeros: each array argument arrives as CustomVJPPrimal(value, perturbed),
    # which tells whether the bias is being differentiated (dS is then kept).
    is_primal = lambda x: isinstance(x, CustomVJPPrimal)  # noqa: E731
    values = jax.tree.map(lambda x: x.value, args, is_leaf=is_primal)
    bias = args[7]
    bias_grad = bias is not None and bias.perturbed
    o, lse = _kernels(plan, bias_grad)[0](*values)
    q, k, v, q_len, kv_len, segments, seeds, bias, mask, layout = values
    marker = jnp.zeros((0,)) if bias_grad else None
    extras = (q_len, kv_len, segments, seeds, bias, mask, layout)
    return (o, lse), (q, k, v, o, lse, extras, marker)


def _attention_bwd(plan, residuals, cotangents):
    q, k, v, o, lse, extras, marker = residuals
    q_len, kv_len, segments, seeds, bias, mask, layout = extras
    do, dlse = cotangents
    if isinstance(do, SymbolicZero):
        do = jnp.zeros(o.shape, o.dtype)
    if isinstance(dlse, SymbolicZero):
        dlse = None
    bias_grad = marker is not None
    out = _kernels(plan, bias_grad)[1](
        q, k, v, o, lse, do, dlse, q_len, kv_len, segments, seeds, bias, mask, layout
    )
    dq, dk, dv = out[:3]
    dbias = None
    if bias_grad:  # sum dS over the dims the bias broadcasts along
        ds = out[3].astype(jnp.float32)
        axes = tuple(a for a in range(4) if bias.shape[a] == 1 and ds.shape[a] != 1)
        dbias = ds.sum(axis=axes, keepdims=True).astype(bias.dtype)
    return dq, dk, dv, None, None, None, None, dbias, None, None


attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)

"""FlashAttention forward pass, Triton-lowered Pallas.

Algorithm 1 of FlashAttention (Dao et al., 2022) with the loop order of
FlashAttention-2 (Dao, 2023, Sec. 3.1): each program owns one query tile of one
(batch, head), keeps it on chip, and streams the key/value tiles past it, carrying the
running row maximum `m_i`, the running row sum `l_i` and the unnormalised output `acc`
in float32. The N x N score matrix never reaches HBM; the program writes O and the
logsumexp (natural log, float32), which the backward pass uses to recompute P.

Key/value tiles are split three ways by `masks.kv_tile_range`: fully visible (no mask),
boundary (element mask: causal diagonal, key padding), and skipped (above the causal
diagonal or past the valid length), which cost no loads and no FLOPs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_flash import dropout, masks
from pallas_flash.configs import TritonConfig, fit_block, padded_head_dim
from pallas_flash.logits import LN2, Logits
from pallas_flash.triton.common import (
    broadcast_inputs,
    dot,
    dropout_inputs,
    load_broadcast_tile,
    load_mask_tile,
    load_tile,
    mask_inputs,
    round_up,
    scores,
    segment_inputs,
    sparse_inputs,
    split_refs,
    store_tile,
    tile_bounds,
    visit_tiles,
)


def _forward_kernel(
    q_len_ref,
    kv_len_ref,
    q_ref,
    k_ref,
    v_ref,
    *rest,
    spec: masks.MaskSpec,
    scale: float,
    block_q: int,
    block_kv: int,
    seq_q: int,
    seq_kv: int,
    head_dim: int,
    dropout_rate: float,
    logits: Logits,
):
    (q_seg_ref, kv_seg_ref, ranges_ref), seeds_ref, bias_ref, mask_ref, sparse, outs = split_refs(
        rest, spec, dropout_rate > 0, 2, logits
    )
    o_ref, lse_ref = outs
    num_q_tiles = pl.num_programs(0)
    i = pl.program_id(0)
    if spec.causal:
        # Causal tiles near the bottom do the most work: launch them first so the
        # last wave of programs is short ones.
        i = num_q_tiles - 1 - i
    q0 = i * block_q
    q_len = q_len_ref[...]
    kv_len = kv_len_ref[...]
    diag = masks.offset(spec, q_len, kv_len)
    bounds = tile_bounds(
        spec, ranges_ref, i, q0, block_q, block_kv, q_len, kv_len, diag, over_kv=True
    )

    q = load_tile(q_ref, q0, block_q, seq_q, head_dim)  # [block_q, hp]
    rows = (q0 + jnp.arange(block_q))[:, None]  # [block_q, 1]
    if dropout_rate > 0:
        seeds = (seeds_ref[0], seeds_ref[1])
        batch_head = pl.program_id(1) * pl.num_programs(2) + pl.program_id(2)

    def body(j, carry, *, masked: bool):
        acc, m_i, l_i = carry
        k0 = j * block_kv
        k = load_tile(k_ref, k0, block_kv, seq_kv, head_dim)  # [block_kv, hp]
        bias = None
        if bias_ref is not None:
            bias = load_broadcast_tile(
                bias_ref, None, q0, k0, block_q, block_kv, seq_q, seq_kv, logits.bias_dims
            )
        # Base-2 logits: exp(x) = exp2(x * log2(e)), with log2(e) folded into the scale.
        s, _ = scores(q, k, scale=scale, bias=bias, softcap=logits.softcap)
        keep = None
        if masked:  # the structural masks cut this tile (full tiles skip this work)
            cols = (k0 + jnp.arange(block_kv))[None, :]
            segs = None
            if q_seg_ref is not None:  # read here, not held in registers across the loop
                segs = (
                    q_seg_ref[pl.ds(q0, block_q)][:, None],
                    kv_seg_ref[pl.ds(k0, block_kv)][None, :],
                )
            keep = masks.tile_mask(spec, rows, cols, kv_len, diag, segs)
        if mask_ref is not None:  # a user mask can cut any tile
            user = load_mask_tile(
                mask_ref, None, q0, k0, block_q, block_kv, seq_q, seq_kv, logits.mask_dims
            )
            keep = user if keep is None else keep & user
        if keep is not None:
            s = jnp.where(keep, s, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))  # [block_q]
        if keep is not None:
            # A row that has seen only masked keys has max -inf; subtracting it would
            # give exp2(-inf + inf) = NaN. Use 0 instead: its p and alpha are then 0.
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        else:
            m_use = m_new
        alpha = jnp.exp2(m_i - m_use)  # rescales what was accumulated so far
        p = jnp.exp2(s - m_use[:, None])  # [block_q, block_kv]
        l_i = l_i * alpha + jnp.sum(p, axis=1)  # the normaliser never sees dropout
        if dropout_rate > 0:
            cols = (k0 + jnp.arange(block_kv))[None, :]
            keep = dropout.keep_mask(seeds, batch_head, rows, cols, dropout_rate)
            p = jnp.where(keep, p, 0.0)  # the 1 / (1 - rate) is applied once, at the end
        v = load_tile(v_ref, k0, block_kv, seq_kv, head_dim)  # [block_kv, hp]
        acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)  # [block_q, hp]
        return acc, m_new, l_i

    hp = q.shape[-1]
    carry = (
        jnp.zeros((block_q, hp), jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    acc, m_i, l_i = visit_tiles(body, spec, sparse, jnp.int32(0), i, bounds, carry)

    # A fully masked row (l_i == 0) outputs 0 with logsumexp -inf, never 0/0.
    empty = (l_i == 0.0) | (rows[:, 0] >= q_len)
    l_safe = jnp.where(empty, 1.0, l_i)
    lse = jnp.where(empty, -jnp.inf, (m_i + jnp.log2(l_safe)) * LN2)
    if dropout_rate > 0:
        l_safe = l_safe * (1.0 - dropout_rate)  # kept probabilities scale by 1 / (1 - rate)
    o = jnp.where(empty[:, None], 0.0, acc / l_safe[:, None])
    store_tile(o_ref, q0, o, seq_q, head_dim)
    lse_mask = None if seq_q % block_q == 0 else rows[:, 0] < seq_q
    plgpu.store(lse_ref.at[pl.ds(q0, block_q)], lse, mask=lse_mask)


def forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_len: jax.Array,
    kv_len: jax.Array,
    segments: tuple[jax.Array, jax.Array] | None = None,
    seeds: jax.Array | None = None,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    layout: jax.Array | None = None,
    *,
    spec: masks.MaskSpec,
    scale: float,
    config: TritonConfig,
    interpret: bool,
    dropout_rate: float = 0.0,
    logits: Logits = Logits(),
) -> tuple[jax.Array, jax.Array]:
    """Returns O [B, T, N, H] in q's dtype and the logsumexp [B, N, T] float32.

    `bias` and `mask` broadcast to [B, N, T, S] as `logits.bias_dims` / `logits.mask_dims`
    say; `mask` is in load_mask_tile's form (vjp.kernel_mask's: bit-packed along T when it
    varies there, else along S when it varies there, else int8).
    """
    B, T, N, H = q.shape
    _, S, K, _ = k.shape
    masks.check_shapes(q, k, q_len, kv_len, segments)
    G = N // K
    hp = padded_head_dim(H)
    block_q = fit_block(config.block_q, T)
    block_kv = fit_block(config.block_kv, S)
    t_pad, s_pad = round_up(T, block_q), round_up(S, block_kv)

    kernel = functools.partial(
        _forward_kernel,
        spec=spec,
        scale=scale,
        block_q=block_q,
        block_kv=block_kv,
        seq_q=T,
        seq_kv=S,
        head_dim=H,
        dropout_rate=dropout_rate,
        logits=logits,
    )
    # Each program sees its (batch, head) slab whole and slices its tiles itself; the
    # block shapes are padded to whole tiles (interpret mode pads the arrays to them,
    # the compiled kernel masks every access past the real extent).
    per_len = pl.BlockSpec((None,), lambda i, b, h: (b,))
    q_spec = pl.BlockSpec((None, t_pad, None, hp), lambda i, b, h: (b, 0, h, 0))
    kv_spec = pl.BlockSpec((None, s_pad, None, hp), lambda i, b, h: (b, 0, h // G, 0))
    q_lists = None  # block-sparse: for each query tile, the key tiles to visit
    if layout is not None:
        q_lists = masks.sparse_tile_lists(
            layout, spec, block_q, block_kv, T, S, q_len, kv_len, segments
        )[0]
    extra_specs, extra_args = [], []
    for specs_args in (
        segment_inputs(segments, block_q, block_kv, t_pad, s_pad, lambda i, b, h: b, own_is_q=True),
        dropout_inputs(seeds),
        broadcast_inputs(
            bias, logits.bias_dims, t_pad, s_pad, lambda i, b, h: b, lambda i, b, h: h
        ),
        mask_inputs(mask, logits.mask_dims, t_pad, s_pad, lambda i, b, h: b, lambda i, b, h: h),
        sparse_inputs(q_lists, lambda i, b, h: b, lambda i, b, h: h),
    ):
        extra_specs += specs_args[0]
        extra_args += specs_args[1]
    return pl.pallas_call(
        kernel,
        grid=(t_pad // block_q, B, N),
        in_specs=[per_len, per_len, q_spec, kv_spec, kv_spec, *extra_specs],
        out_specs=[q_spec, pl.BlockSpec((None, None, t_pad), lambda i, b, h: (b, h, 0))],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((B, N, T), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name="pallas_flash_fwd",
    )(q_len, kv_len, q, k, v, *extra_args)

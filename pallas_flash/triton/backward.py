"""FlashAttention backward pass by recomputation, Triton-lowered Pallas.

FlashAttention (Dao et al., 2022), Algorithm 2 / Appendix B.2, with FlashAttention-2's
split into two kernels so that nothing is accumulated with atomics (the result is
bitwise reproducible):

* dK/dV: one program per (key tile, batch, key/value head) holds K_j, V_j and streams
  the query tiles of every query head in its group (GQA/MQA), recomputing
  P = exp(S - lse) from Q and the saved logsumexp:
      dV_j += P^T dO,   dS = P * (dO V_j^T - D),   dK_j += scale * dS^T Q.
* dQ: one program per (query tile, batch, query head) streams the key tiles:
      dQ_i += scale * dS K.

D = rowsum(dO * O) (minus the logsumexp's own cotangent, when it has one) is computed
before the kernels, in XLA (a fused, memory-bound reduction). The saved logsumexp comes
in base 2 with +inf on fully masked rows, so that P = exp2(S - lse) is exactly 0 on
those rows with no extra mask.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_flash import dropout, masks
from pallas_flash.configs import TritonBwdConfig, fit_block, padded_head_dim
from pallas_flash.logits import Logits, backward_stats
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


class _Tile:
    """What the backward pass recomputes for one (query tile, key tile) pair."""

    def __init__(self, q, k, lse2, *, scale, logits: Logits, bias, keep):
        s, self.tanh = scores(q, k, scale=scale, bias=bias, softcap=logits.softcap)
        if keep is not None:
            s = jnp.where(keep, s, -jnp.inf)
        self.p = jnp.exp2(s - lse2[:, None])  # [block_q, block_kv], float32

    def ds(self, dp, delta):
        """Gradient of the natural (pre-cap) scores: P * (dP - D), through the soft cap."""
        ds = self.p * (dp - delta[:, None])
        if self.tanh is not None:
            ds = ds * (1.0 - self.tanh * self.tanh)  # d(cap * tanh(s / cap)) / ds
        return ds


def _keep(spec, masked, rows, cols, kv_len, diag, segs, user):
    """The tile's element mask: the structural masks where they cut it (`masked`), and
    the user's mask (a tile, or None) everywhere; None when nothing cuts it."""
    keep = masks.tile_mask(spec, rows, cols, kv_len, diag, segs()) if masked else None
    if user is not None:
        keep = user if keep is None else keep & user
    return keep


def _segment_tiles(q_seg_ref, kv_seg_ref, block_q, block_kv, q0, k0):
    """A tile's (query ids [block_q, 1], key ids [1, block_kv]), or None. Read inside the
    masked loops only, so full tiles never hold them in registers."""
    if q_seg_ref is None:
        return None
    return q_seg_ref[pl.ds(q0, block_q)][:, None], kv_seg_ref[pl.ds(k0, block_kv)][None, :]


def _dropped(seeds, batch_head, rows, cols, rate, p, dp):
    """Dropout in the backward pass: the kept, rescaled P (for dV) and dP through the mask.

    O = (P * Z / (1 - rate)) V, so dV = (P * Z / (1 - rate))^T dO and the gradient
    reaching P is (dO V^T) * Z / (1 - rate); D = rowsum(dO * O) is unchanged.
    """
    keep = dropout.keep_mask(seeds, batch_head, rows, cols, rate)
    inv = 1.0 / (1.0 - rate)
    return jnp.where(keep, p * inv, 0.0), jnp.where(keep, dp * inv, 0.0)


def _dkdv_kernel(
    q_len_ref,
    kv_len_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    *rest,
    spec,
    scale,
    block_q,
    block_kv,
    seq_q,
    seq_kv,
    head_dim,
    group,
    dropout_rate,
    logits,
):
    (q_seg_ref, kv_seg_ref, ranges_ref), seeds_ref, bias_ref, mask_ref, sparse, outs = split_refs(
        rest, spec, dropout_rate > 0, 2, logits
    )
    dk_ref, dv_ref = outs
    j = pl.program_id(0)
    k0 = j * block_kv
    q_len = q_len_ref[...]
    kv_len = kv_len_ref[...]
    diag = masks.offset(spec, q_len, kv_len)
    bounds = tile_bounds(
        spec, ranges_ref, j, k0, block_kv, block_q, q_len, kv_len, diag, over_kv=False
    )
    segs_of = functools.partial(_segment_tiles, q_seg_ref, kv_seg_ref, block_q, block_kv)

    k = load_tile(k_ref, k0, block_kv, seq_kv, head_dim)  # [block_kv, hp]
    v = load_tile(v_ref, k0, block_kv, seq_kv, head_dim)  # [block_kv, hp]
    cols = (k0 + jnp.arange(block_kv))[None, :]
    if dropout_rate > 0:
        seeds = (seeds_ref[0], seeds_ref[1])
        # batch * N + query head, where query head = kv_head * group + g
        batch_head0 = (pl.program_id(1) * pl.num_programs(2) + pl.program_id(2)) * group

    def body(i, carry, *, g, masked: bool):
        dk, dv = carry
        q0 = i * block_q
        q = load_tile(q_ref, q0, block_q, seq_q, head_dim, head=g)  # [block_q, hp]
        do = load_tile(do_ref, q0, block_q, seq_q, head_dim, head=g)  # [block_q, hp]
        lse2 = lse_ref[g, pl.ds(q0, block_q)]  # [block_q]
        delta = delta_ref[g, pl.ds(q0, block_q)]  # [block_q]
        rows = (q0 + jnp.arange(block_q))[:, None]

        def head_tile(load, ref, dims):  # query head g's tile of a bias or mask
            return load(ref, g if dims[1] else 0, q0, k0, block_q, block_kv, seq_q, seq_kv, dims)

        bias = (
            None if bias_ref is None else head_tile(load_broadcast_tile, bias_ref, logits.bias_dims)
        )
        user = None if mask_ref is None else head_tile(load_mask_tile, mask_ref, logits.mask_dims)
        keep = _keep(
            spec, masked, rows, cols, kv_len, diag, functools.partial(segs_of, q0, k0), user
        )
        tile = _Tile(q, k, lse2, scale=scale, logits=logits, bias=bias, keep=keep)
        dp = dot(do, v, trans_b=True)  # [block_q, block_kv]
        p_out = tile.p
        if dropout_rate > 0:
            p_out, dp = _dropped(seeds, batch_head0 + g, rows, cols, dropout_rate, tile.p, dp)
        dv = dv + dot(p_out.astype(do.dtype), do, trans_a=True)  # [block_kv, hp]
        ds = tile.ds(dp, delta)
        dk = dk + dot(ds.astype(q.dtype), q, trans_a=True)  # [block_kv, hp]
        return dk, dv

    def per_head(g, carry):
        return visit_tiles(
            functools.partial(body, g=g),
            spec,
            sparse,
            g,
            j,
            bounds,
            carry,
        )

    hp = k.shape[-1]
    zeros = jnp.zeros((block_kv, hp), jnp.float32)
    dk, dv = lax.fori_loop(0, group, per_head, (zeros, zeros))
    store_tile(dk_ref, k0, dk * scale, seq_kv, head_dim)
    store_tile(dv_ref, k0, dv, seq_kv, head_dim)


def _dq_kernel(
    q_len_ref,
    kv_len_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    *rest,
    spec,
    scale,
    block_q,
    block_kv,
    seq_q,
    seq_kv,
    head_dim,
    dropout_rate,
    logits,
):
    n_out = 2 if logits.bias_grad else 1
    if logits.bias_grad:  # drop the zeros that the dS output aliases (it is not read)
        rest = rest[: -n_out - 1] + rest[-n_out:]
    (q_seg_ref, kv_seg_ref, ranges_ref), seeds_ref, bias_ref, mask_ref, sparse, outs = split_refs(
        rest, spec, dropout_rate > 0, n_out, logits
    )
    dq_ref, ds_ref = outs[0], (outs[1] if logits.bias_grad else None)
    num_q_tiles = pl.num_programs(0)
    i = pl.program_id(0)
    if spec.causal:
        i = num_q_tiles - 1 - i  # longest rows first, as in the forward pass
    q0 = i * block_q
    q_len = q_len_ref[...]
    kv_len = kv_len_ref[...]
    diag = masks.offset(spec, q_len, kv_len)
    bounds = tile_bounds(
        spec, ranges_ref, i, q0, block_q, block_kv, q_len, kv_len, diag, over_kv=True
    )
    segs_of = functools.partial(_segment_tiles, q_seg_ref, kv_seg_ref, block_q, block_kv)

    q = load_tile(q_ref, q0, block_q, seq_q, head_dim)  # [block_q, hp]
    do = load_tile(do_ref, q0, block_q, seq_q, head_dim)  # [block_q, hp]
    lse2 = lse_ref[pl.ds(q0, block_q)]
    delta = delta_ref[pl.ds(q0, block_q)]
    rows = (q0 + jnp.arange(block_q))[:, None]
    if dropout_rate > 0:
        seeds = (seeds_ref[0], seeds_ref[1])
        batch_head = pl.program_id(1) * pl.num_programs(2) + pl.program_id(2)

    def body(j, dq, *, masked: bool):
        k0 = j * block_kv
        k = load_tile(k_ref, k0, block_kv, seq_kv, head_dim)
        v = load_tile(v_ref, k0, block_kv, seq_kv, head_dim)
        cols = (k0 + jnp.arange(block_kv))[None, :]
        bias = keep = None
        if bias_ref is not None:
            bias = load_broadcast_tile(
                bias_ref, None, q0, k0, block_q, block_kv, seq_q, seq_kv, logits.bias_dims
            )
        user = None
        if mask_ref is not None:
            user = load_mask_tile(
                mask_ref, None, q0, k0, block_q, block_kv, seq_q, seq_kv, logits.mask_dims
            )
        keep = _keep(
            spec, masked, rows, cols, kv_len, diag, functools.partial(segs_of, q0, k0), user
        )
        tile = _Tile(q, k, lse2, scale=scale, logits=logits, bias=bias, keep=keep)
        dp = dot(do, v, trans_b=True)  # [block_q, block_kv]
        if dropout_rate > 0:
            _, dp = _dropped(seeds, batch_head, rows, cols, dropout_rate, tile.p, dp)
        ds = tile.ds(dp, delta)
        if ds_ref is not None:  # dS is the bias gradient of this (batch, head)
            store_mask = (rows < seq_q) & (cols < seq_kv)
            plgpu.store(
                ds_ref.at[pl.ds(q0, block_q), pl.ds(k0, block_kv)],
                ds.astype(ds_ref.dtype),
                mask=store_mask,
            )
        return dq + dot(ds.astype(k.dtype), k)  # [block_q, hp]

    dq = visit_tiles(
        body,
        spec,
        sparse,
        jnp.int32(0),
        i,
        bounds,
        jnp.zeros(q.shape, jnp.float32),
    )
    store_tile(dq_ref, q0, dq * scale, seq_q, head_dim)


def prepare_stats(o, do, lse, dlse, t_pad: int):
    """Base-2 logsumexp (+inf on empty rows) and D = rowsum(dO * O) - dlse, [B, N, t_pad]."""
    lse2, delta = backward_stats(o, do, lse, dlse)
    pad = [(0, 0), (0, 0), (0, t_pad - lse.shape[-1])]
    return jnp.pad(lse2, pad, constant_values=jnp.inf), jnp.pad(delta, pad)


def backward(
    q,
    k,
    v,
    o,
    lse,
    do,
    dlse,
    q_len,
    kv_len,
    segments=None,
    seeds=None,
    bias=None,
    mask=None,
    layout=None,
    *,
    spec: masks.MaskSpec,
    scale: float,
    config: TritonBwdConfig,
    interpret: bool,
    dropout_rate: float = 0.0,
    logits: Logits = Logits(),
):
    """Returns dq, dk, dv in the dtypes of q, k, v, and dS [B, N, T, S] (in the bias's
    dtype) when `logits.bias_grad`, else None. `bias` and `mask` as in forward.forward
    (the mask in load_mask_tile's form, the same array the forward read)."""
    B, T, N, H = q.shape
    _, S, K, _ = k.shape
    masks.check_shapes(q, k, q_len, kv_len, segments)
    G = N // K
    hp = padded_head_dim(H)
    params = plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)
    common = dict(
        spec=spec,
        scale=scale,
        seq_q=T,
        seq_kv=S,
        head_dim=H,
        dropout_rate=dropout_rate,
        logits=logits,
    )
    per_len = pl.BlockSpec((None,), lambda j, b, h: (b,))

    def extras(bq, bk, t_pad, s_pad, own_is_q, head_of, head_block):
        lists = None  # block-sparse: each own tile's list of the other kind's tiles
        if layout is not None:
            per_q, per_kv = masks.sparse_tile_lists(
                layout, spec, bq, bk, T, S, q_len, kv_len, segments
            )
            lists = per_q if own_is_q else per_kv
        specs, args = [], []
        for specs_args in (
            segment_inputs(segments, bq, bk, t_pad, s_pad, lambda j, b, h: b, own_is_q=own_is_q),
            dropout_inputs(seeds),
            broadcast_inputs(
                bias, logits.bias_dims, t_pad, s_pad, lambda j, b, h: b, head_of, head_block
            ),
            mask_inputs(
                mask, logits.mask_dims, t_pad, s_pad, lambda j, b, h: b, head_of, head_block
            ),
            sparse_inputs(lists, lambda j, b, h: b, head_of, head_block),
        ):
            specs += specs_args[0]
            args += specs_args[1]
        return specs, args

    # dK, dV: grid over key tiles; each program sees its group's G query heads.
    bq, bk = fit_block(config.block_q_dkv, T), fit_block(config.block_kv_dkv, S)
    t_pad, s_pad = round_up(T, bq), round_up(S, bk)
    lse2, delta = prepare_stats(o, do, lse, dlse, t_pad)
    q_group = pl.BlockSpec((None, t_pad, G, hp), lambda j, b, h: (b, 0, h, 0))
    kv_head = pl.BlockSpec((None, s_pad, None, hp), lambda j, b, h: (b, 0, h, 0))
    stat_group = pl.BlockSpec((None, G, t_pad), lambda j, b, h: (b, h, 0))
    specs, args = extras(bq, bk, t_pad, s_pad, False, lambda j, b, h: h, G)
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, block_q=bq, block_kv=bk, group=G, **common),
        grid=(s_pad // bk, B, K),
        in_specs=[
            per_len,
            per_len,
            q_group,
            kv_head,
            kv_head,
            q_group,
            stat_group,
            stat_group,
            *specs,
        ],
        out_specs=[kv_head, kv_head],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=params,
        interpret=interpret,
        name="pallas_flash_bwd_dkdv",
    )(q_len, kv_len, q, k, v, do, lse2, delta, *args)

    # dQ (and dS for the bias): grid over query tiles of every query head.
    bq, bk = fit_block(config.block_q_dq, T), fit_block(config.block_kv_dq, S)
    t_pad2, s_pad = round_up(T, bq), round_up(S, bk)
    if t_pad2 != t_pad:
        lse2, delta = prepare_stats(o, do, lse, dlse, t_pad2)
    q_head = pl.BlockSpec((None, t_pad2, None, hp), lambda i, b, h: (b, 0, h, 0))
    kv_of_q = pl.BlockSpec((None, s_pad, None, hp), lambda i, b, h: (b, 0, h // G, 0))
    stat_head = pl.BlockSpec((None, None, t_pad2), lambda i, b, h: (b, h, 0))
    specs, args = extras(bq, bk, t_pad2, s_pad, True, lambda i, b, h: h, None)
    in_specs = [per_len, per_len, q_head, kv_of_q, kv_of_q, q_head, stat_head, stat_head, *specs]
    out_specs, out_shape, aliases = [q_head], [jax.ShapeDtypeStruct(q.shape, q.dtype)], {}
    if logits.bias_grad:
        # Tiles the mask skips are never written: start from zeros (aliased in place).
        ds0 = jnp.zeros((B, N, T, S), bias.dtype)
        ds_spec = pl.BlockSpec((None, None, t_pad2, s_pad), lambda i, b, h: (b, h, 0, 0))
        in_specs.append(ds_spec)
        args.append(ds0)
        aliases = {8 + len(specs): 1}
        out_specs.append(ds_spec)
        out_shape.append(jax.ShapeDtypeStruct(ds0.shape, ds0.dtype))
    outs = pl.pallas_call(
        functools.partial(_dq_kernel, block_q=bq, block_kv=bk, **common),
        grid=(t_pad2 // bq, B, N),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=params,
        interpret=interpret,
        name="pallas_flash_bwd_dq",
    )(q_len, kv_len, q, k, v, do, lse2, delta, *args)
    return outs[0], dk, dv, (outs[1] if logits.bias_grad else None)

"""FlashAttention backward pass for Hopper (sm_90) in Mosaic GPU Pallas, FlashAttention-3 style.

The math is FlashAttention-2's backward (Dao, 2023, Sec. 3.2, Algorithm 2): nothing of
size T x S is stored; each tile pair recomputes S = Q K^T and P = exp(S - lse) from the
saved logsumexp, then dV += P^T dO, dP = dO V^T, dS = P * (dP - D) with
D = rowsum(dO * O), dK += dS^T Q and dQ += dS K (times the softmax scale). The schedule
is FlashAttention-3's (Shah et al., 2024, Sec. 3.1 and Appendix B.1): a TMA producer
warpgroup streams tiles through a ring of shared-memory slots ("ready" barriers
completed by the copies' byte counts, "free" barriers by one arrival per consumer)
while consumer warpgroups run every matmul as wgmma with float32 accumulators.

FA3 accumulates dQ with atomic adds from the dK/dV kernel, whose order varies from run
to run. Here, as in triton/backward.py, two kernels keep the result bitwise
deterministic:

* dK/dV (dkdv_kernel.py): a CTA owns key/value tiles, resident in shared memory. The
  producer streams, for each query head of the key/value head's GQA group and each query
  tile the masks leave visible, the Q and dO tiles with their rows of lse and D. Each
  consumer computes S^T = K Q^T and dP^T = V dO^T (keys on the rows, so that P^T and
  dS^T come out of the accumulator already in the layout a register operand of the
  next wgmma needs), then dV += P^T dO and dK += dS^T Q. The group's query heads are
  summed inside the CTA: no atomics, no second reduction pass. Two consumers own a key
  tile each; where the two accumulators of a tile would not fit in a warpgroup's
  registers (head dim > 128), they share one tile instead, one accumulating dV and the
  other dK (`MosaicBwdConfig.split_dkv`).
* dQ (dq_kernel.py): a CTA owns query tiles (one per consumer, as in the forward pass);
  the producer streams the K and V tiles; each consumer computes S and dP, then
  dQ += dS K.

The price: S and dP are computed twice, seven T x S x H matmuls where a fused kernel
does five, and the FLOP convention (2.5x the forward) counts five. At head dim 128,
non-causal, 16k, this backward's 470 TFLOP/s by the convention are 658 TFLOP/s of
matmul work (`fa-mosaic-fa74dc8.jsonl`), about 90 % of the H200's dense bf16 rate
(728-785, ../shared/ANCHORS.md); cuDNN's 541 by the convention would need 757 here. So
this design cannot reach cuDNN at long lengths there; what can is one fused kernel
that adds dQ in a fixed order (FA3's deterministic mode orders its atomic adds with
a semaphore per query tile).

`MosaicBwdConfig.fused` is that kernel: the dK/dV kernel also computes each visited query
tile's dQ share dS K. Each consumer stores its dS^T to shared memory and, once every
consumer's is in, computes its slice of the share over all the CTA's key tiles (half the
head-dim columns each, or half the rows where the columns would be narrower than 64);
a writer adds the slices to a float32 dQ in increasing key span, the order held by a
global semaphore per query tile (mosaic/dq_adds.py), and XLA scales and casts the sum.
The writer is a fourth warpgroup, or one warp of the producer's (`writer_warp`), or two
warps taking every other step (`split_writer`). Built in FA3's order with its share
whole and two writer warps (`bwd_config.fused_full_bwd_config`), it is the default at
padded head dim 128 when the call is not causal; the pair is the default elsewhere.
Fused, each head's query tiles are walked from the last down, so that the
CTAs of neighbouring spans reach a tile at about the same step and their ordered adds
do not wait on each other's tails. Its step comes in three forms: the plain one (every
group of wgmmas awaited before the next work), FA3's order over S^T (`fa3_step`), and
FA3's orientation, the queries on the rows with P and dS through shared memory
(`rows_step`, `MosaicBwdConfig.query_rows`).

Scores are in base 2 (log2(e) folded into the scale) and the logsumexp arrives in base
2 with +inf on rows that see no key (`logits.backward_stats`), so P = exp2(S c - lse2)
is exactly 0 there and on padding rows, with no mask: their gradients are 0, never NaN.

Masking. Tile ranges come from `masks.q_tile_range` (dK/dV, for the CTA's key span) and
`masks.kv_tile_range` (dQ, for the CTA's rows): skipped tiles are never loaded, tiles
seen in full run unmasked, boundary tiles apply `masks.tile_mask`. Segment ids narrow
those ranges in XLA first and compare element by element in boundary tiles; the ids of
the resident tile (keys in dK/dV, rows in dQ) are loaded once, the streamed tiles' ids
travel with Q (dK/dV) or K (dQ) on the same barriers. Lengths are padded
to whole CTAs with zeros (padded keys masked through kv_len; padded rows carry lse2 =
+inf), the head dim to a multiple of 64; padding is cut from the result.

GPU interpret mode (CPU) runs these kernels with their barriers, TMA copies and wgmma
simulated, except that its wgmma takes both operands from shared memory and cannot
accumulate in place (`pl.run_state` over an accumulator does not lower on CPU): there
P^T, dS^T and dS are stored to a staging buffer and each product lands in a fresh
accumulator that is added (`MosaicBwdConfig.operands_in_registers=False`, which a GPU
can run too), and fresh accumulators start from run_scoped's zeros (`held_zero`, which
stores into them). Everything else is the same code.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash import masks
from pallas_flash.logits import Logits, backward_stats
from pallas_flash.mosaic import dq_adds, split_tail
from pallas_flash.mosaic.bwd_config import MosaicBwdConfig, q_do_fit_registers
from pallas_flash.mosaic.config import NARROW_SWIZZLE, SMEM_BYTES, padded_head_dim
from pallas_flash.mosaic.dkdv_kernel import dkdv_kernel
from pallas_flash.mosaic.dq_kernel import dq_kernel
from pallas_flash.mosaic.pipeline import (
    intersect_tables,
    kv_tile_ranges,
    pad_to,
    pair_cluster,
    sm_count,
    swizzled,
)
from pallas_flash.mosaic.support import unsupported

# split_tail in GPU interpret mode: a pretend SM count that the small test grids do not
# divide, so that their last CTAs go in pieces.
_TAIL_SMS = 5


def check_fits(config: MosaicBwdConfig, hp: int):
    """ValueError unless both kernels fit in shared memory and their accumulators in
    registers at this (padded) head dim."""
    kernels = [("dK/dV", config.smem_bytes_dkv(hp))]
    if not config.fused:  # fused, there is no dQ kernel
        kernels.append(("dQ", config.smem_bytes_dq(hp)))
    for kernel, need in kernels:
        if need > SMEM_BYTES:
            raise ValueError(
                f"{config} needs {need} bytes of shared memory in its {kernel} kernel at "
                f"head dim {hp}, more than the {SMEM_BYTES} of a Hopper SM: lower its "
                "blocks, stages or warpgroups"
            )
    # A float32 accumulator costs (its elements / 128 threads) registers a thread. Past
    # 128 for the accumulators (of the 232 a consumer gets; S, dP and P need the rest)
    # ptxas would spill, which the lowering does not check.
    if not config.split_dkv and 2 * config.block_kv_dkv * hp > 128 * 128:
        raise ValueError(
            f"{config.block_kv_dkv=} x head dim {hp} is too large for a warpgroup's dK and "
            "dV accumulators: use split_dkv=True or block_kv_dkv=64"
        )
    if config.fused:
        rows, cols = config.dq_part(hp)
        # dK, dV and the dQ share; S^T, dP^T and their casts take the rest.
        if 2 * config.block_kv_dkv * hp + rows * cols > 160 * 128:
            raise ValueError(
                f"{config.block_kv_dkv=} and a dQ share of {rows} x {cols} at head dim {hp} "
                "are too large for a warpgroup's registers: lower block_kv_dkv or block_q_dkv"
            )
    elif config.split_dq and hp % 128:
        raise ValueError(
            f"split_dq halves dQ's head-dim columns between the warpgroups: head dim {hp} "
            "has no halves of whole 64-column tiles (it needs a multiple of 128)"
        )
    elif config.block_q_dq * hp // (2 if config.split_dq else 1) > 128 * 128:
        raise ValueError(
            f"{config.block_q_dq=} x head dim {hp} is too large for a warpgroup's dQ "
            "accumulator: use block_q_dq=64"
        )
    # Q and dO (16-bit) in registers cost what the dQ accumulator does; K and V what one
    # of dK, dV does.
    if config.q_do_in_registers and not q_do_fit_registers(config.block_q_dq, hp):
        raise ValueError(
            f"q_do_in_registers at head dim {hp}: Q, dO and dQ of {config.block_q_dq} rows "
            "are too large for a warpgroup's registers (head dim 128 at most, 64-row tiles)"
        )
    if config.k_v_in_registers and 3 * config.block_kv_dkv * hp > 160 * 128:
        raise ValueError(
            f"k_v_in_registers at head dim {hp}: K, V, dK and dV of {config.block_kv_dkv} "
            "keys are too large for a warpgroup's registers (head dim 64 at most, 64-key tiles)"
        )


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
    config: MosaicBwdConfig,
    interpret: bool | plgpu.InterpretGPUParams = False,
    dropout_rate: float = 0.0,
    logits: Logits = Logits(),
):
    """Returns dq, dk, dv in the dtypes of q, k, v, and None (no bias gradient), as
    triton/backward.py's `backward`.

    `o` [B, T, N, H] and `lse` [B, N, T] (float32, natural log, -inf on rows that see no
    key) are the forward pass's; `do` the output's cotangent and `dlse` the logsumexp's
    (or None). `interpret`: True (or an `InterpretGPUParams`) runs GPU interpret mode on
    CPU, with the register operands staged through shared memory. Raises
    NotImplementedError for what the kernels lack (see support.unsupported) and
    ValueError when the config does not fit in shared memory or registers.
    """
    B, T, N, H = q.shape
    _, S, K, _ = k.shape
    masks.check_shapes(q, k, q_len, kv_len, segments)
    reason = unsupported(
        q.dtype,
        H,
        spec,
        segments=segments is not None,
        dropout=dropout_rate > 0 or seeds is not None,
        bias=bias is not None or logits.bias_grad,
        mask=mask is not None,
        softcap=logits.softcap is not None,
    )
    if reason is None and layout is not None:
        reason = "block_sparse not supported by the Mosaic kernel yet"
    if reason is not None:
        raise NotImplementedError(reason)
    hp = padded_head_dim(H)
    check_fits(config, hp)  # as compiled, also when interpreted
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    if interpret is not False:  # the interpreter's wgmma reads shared memory only
        config = config.interpreted()
    # high_spans_first where a band's query-side tiles fit the L2 (high_first_bytes).
    config = config.launched(K, B, T, hp, N // K)

    # One padded length serves both kernels: whole dK/dV query tiles and dQ CTAs, whole
    # dK/dV CTAs and dQ key tiles.
    rows_dq = (1 if config.split_dq else config.consumers_dq) * config.block_q_dq
    # dq_kv_multicast: the dQ kernel's key tiles are walked per cluster of two CTAs.
    range_rows_dq = rows_dq * (2 if config.dq_kv_multicast else 1)
    keys_dkv = config.key_tiles_dkv * config.block_kv_dkv
    # dkdv_q_multicast: the dK/dV kernel's query tiles are walked per cluster of two spans.
    range_keys = keys_dkv * (2 if config.dkdv_q_multicast else 1)
    t_step = math.lcm(config.block_q_dkv, range_rows_dq)
    s_step = math.lcm(range_keys, config.block_kv_dq)
    if config.fused:  # one kernel
        t_step, s_step = config.block_q_dkv, keys_dkv
    t_pad, s_pad = -(-T // t_step) * t_step, -(-S // s_step) * s_step
    lse2, delta = backward_stats(o, do, lse, dlse)  # [B, N, T] each
    pad = [(0, 0), (0, 0), (0, t_pad - T)]
    lse2 = jnp.pad(lse2, pad, constant_values=jnp.inf)  # padding rows: P = 0
    delta = jnp.pad(delta, pad)
    q_p, do_p = pad_to(q, t_pad, hp), pad_to(do.astype(q.dtype), t_pad, hp)
    k_p, v_p = pad_to(k, s_pad, hp), pad_to(v, s_pad, hp)
    q_len, kv_len = q_len.astype(jnp.int32), kv_len.astype(jnp.int32)
    inputs = (q_p, k_p, v_p, do_p, lse2, delta)
    if segments is not None:  # padded like the rows and keys (edge: still sorted)
        q_seg, kv_seg = (x.astype(jnp.int32) for x in segments)
        q_seg = jnp.pad(q_seg, [(0, 0), (0, t_pad - T)], mode="edge")
        kv_seg = jnp.pad(kv_seg, [(0, 0), (0, s_pad - S)], mode="edge")
        inputs += (q_seg, kv_seg)
    with_segs = segments is not None
    transforms = swizzled(q.dtype.itemsize)
    tile = lambda *shape: plgpu.SMEM(shape, q.dtype, transforms=transforms)  # noqa: E731
    # share_halves: K, Q and the dS^T tiles, the operands a 32-column piece of the dQ
    # share (and S^T = K Q^T) reads, in the narrower swizzle (config.NARROW_SWIZZLE).
    narrow = swizzled(q.dtype.itemsize, NARROW_SWIZZLE) if config.share_halves else transforms
    narrow_tile = lambda *shape: plgpu.SMEM(shape, q.dtype, transforms=narrow)  # noqa: E731
    f32_transforms = swizzled(4)
    params = dict(
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=None if interpret is False else interpret,
        thread_name="wg",
    )
    # Staging for products from registers (GPU interpret mode); query_rows has none.
    staged = not config.operands_in_registers and not config.query_rows

    # dK, dV: one CTA per (key/value head, key span, batch).
    bq, bk, stages = config.block_q_dkv, config.block_kv_dkv, config.num_stages_dkv
    tiles, c_dkv = config.key_tiles_dkv, config.consumers_dkv
    ranges = masks.tile_range_table(
        masks.q_tile_range, spec, q_len, kv_len, s_pad // range_keys, bq, range_keys, range_keys
    )
    if with_segs:
        per_k = masks.segment_tile_ranges(q_seg, kv_seg, bq, range_keys)[1]
        ranges = intersect_tables(ranges, per_k)
    dkdv_free, dkdv_cluster = pair_cluster(config.dkdv_q_multicast)
    fused = config.fused
    num_q_tiles = t_pad // bq
    order = dq_adds.order_tables(ranges, num_q_tiles) if fused else ()
    spans = s_pad // range_keys
    if config.rotated_ring:  # (high_spans_first has none: every turn in decreasing span)
        order += (dq_adds.ring_table(ranges),)
        # A span may wait on one of higher index: all of a head's must be resident at
        # once (the grid below launches them together, one CTA an SM); high_spans_first
        # launches the higher ones first instead.
        if interpret is False and spans > sm_count():
            raise ValueError(
                f"rotated_adds needs a head's {spans} key spans resident at once, at most "
                f"the GPU's {sm_count()} SMs: fewer keys, or rotated_adds=False"
            )
    # The launch order is the grid's last axis fastest: with rotated_adds a head's
    # spans come one after another, else its spans of each batch element (with
    # high_spans_first the kernel reads the span axis from the last span down); in bands of
    # span_band heads (fewer where band_pairs caps them), every (head, batch element) of
    # a band's first span, then every second one, then the next band (a grid of four
    # axes: Mosaic folds the first two into one CUDA axis, the first slower).
    band = config.heads_per_band(K, B)
    grid, grid_names = (K, spans, B), ("heads", "kv_tiles", "batch")
    if config.rotated_ring:
        grid, grid_names = (B, K, spans), ("batch", "heads", "kv_tiles")
    elif band > 1:
        grid = (K // band, spans, band, B)
        grid_names = ("head_bands", "kv_tiles", "band_heads", "batch")
    out_type = [
        jax.ShapeDtypeStruct((B, s_pad, K, hp), k.dtype),
        jax.ShapeDtypeStruct((B, s_pad, K, hp), v.dtype),
    ]
    if fused:  # the float32 dQ the ordered adds build
        out_type.append(jax.ShapeDtypeStruct((B, t_pad, N, hp), jnp.float32))
    interpreted = interpret is not False
    # split_tail: one grid axis, the whole CTAs in the plain order, then the pieces of
    # the last wave's query tiles (split_tail.py); their dK and dV out apart, summed below.
    tail = None
    if config.split_tail:
        sms = _TAIL_SMS if interpreted else sm_count()
        tail = split_tail.even_pieces(K * spans * B, sms, num_q_tiles)
    if tail is not None:
        grid, grid_names = (tail.whole + len(tail.table),), ("cta",)
        piece_shape = (len(tail.table), keys_dkv, hp)
        out_type += [jax.ShapeDtypeStruct(piece_shape, jnp.float32)] * 2
    outs = plgpu.kernel(
        functools.partial(
            dkdv_kernel,
            spec=spec,
            scale=scale,
            config=config,
            group=N // K,
            with_segs=with_segs,
            interpret=interpreted,
            semaphores=(B, N, num_q_tiles) if fused else None,
            band=band,
            spans=spans,
            tail=None if tail is None else (tail.whole, B),
        ),
        out_type=tuple(out_type),
        scratch_types=dict(
            k_smem=narrow_tile(tiles, bk, hp),
            v_smem=tile(tiles, bk, hp),
            q_smem=narrow_tile(stages, bq, hp),
            do_smem=tile(stages, bq, hp),
            lse_smem=plgpu.SMEM((stages, bq), jnp.float32),
            delta_smem=plgpu.SMEM((stages, bq), jnp.float32),
            q_seg_smem=plgpu.SMEM((stages, bq), jnp.int32) if with_segs else None,
            kv_seg_smem=plgpu.SMEM((tiles, bk), jnp.int32) if with_segs else None,
            staging_smem=tile(c_dkv, bk, bq) if staged else None,
            kv_ready=plgpu.Barrier(num_arrivals=(2 + with_segs) * tiles),  # K, V (, key ids)
            # Q and lse (and the query ids)
            q_ready=plgpu.Barrier(num_arrivals=2 + with_segs, num_barriers=stages),
            do_ready=plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # dO and D
            free=dkdv_free(num_arrivals=c_dkv, num_barriers=stages),
            done=plgpu.Barrier(num_arrivals=2) if config.split_dkv else None,
            probs_scratch=(
                dict(
                    tile=plgpu.SMEM((bk, bq), jnp.float32, transforms=f32_transforms),
                    ready=plgpu.Barrier(),
                    free=plgpu.Barrier(),
                )
                if config.share_probs
                else None
            ),
            fused_scratch=(
                dq_adds.scratch(config, hp, q.dtype, narrow, interpreted) if fused else None
            ),
        ),
        grid=grid,
        grid_names=grid_names,
        # The fused kernel's fourth warpgroup adds the dQ shares (dq_adds.writer), unless
        # a warp of the producer's does (writer_warp).
        num_threads=c_dkv + 1 + (fused and not config.writer_warp),
        kernel_name="pallas_flash_mosaic_bwd_fused" if fused else "pallas_flash_mosaic_bwd_dkdv",
        **params,
        **dkdv_cluster,
    )(q_len, kv_len, ranges, *inputs, *order, *(() if tail is None else (tail.table,)))
    dk, dv = outs[:2]
    if tail is not None:  # the split spans' dK and dV: their pieces' sums
        coords = split_tail.span_coords(tail.items, spans, B, band)
        dk = split_tail.sum_pieces(dk, outs[-2], tail, coords, keys_dkv)
        dv = split_tail.sum_pieces(dv, outs[-1], tail, coords, keys_dkv)
    if fused:
        _, first, last = order[:3]
        rows = dq_adds.visited_rows(first, last, bq, T)[:, :, None, None]
        # dS was of the scaled scores; rows no CTA visited were never written.
        dq = jnp.where(rows, outs[2][:, :T, :, :H] * scale, 0.0).astype(q.dtype)
        return dq, dk[:, :S, :, :H], dv[:, :S, :, :H], None

    # dQ: one CTA per (query head, consumers * block_q rows, batch).
    bq, bk, stages = config.block_q_dq, config.block_kv_dq, config.num_stages_dq
    c_dq = config.consumers_dq
    split = config.split_dq
    q_tiles = 1 if split else c_dq  # query tiles a CTA holds
    num_q_tiles = t_pad // rows_dq
    segs = (q_seg, kv_seg) if with_segs else None
    ranges = kv_tile_ranges(spec, q_len, kv_len, segs, t_pad, range_rows_dq, bk)
    free_barrier, cluster = pair_cluster(config.dq_kv_multicast)
    dq = plgpu.kernel(
        functools.partial(
            dq_kernel,
            spec=spec,
            scale=scale,
            config=config,
            num_q_tiles=num_q_tiles,
            group=N // K,
            # GPU interpret mode runs no inline PTX: the mbarrier form there
            named_turns=config.dq_pingpong and interpret is False,
        ),
        out_type=jax.ShapeDtypeStruct((B, t_pad, N, hp), q.dtype),
        scratch_types=dict(
            # split_dq: Q and dO as two column halves (split_dq_consumer)
            q_smem=tile(2, bq, hp // 2) if split else tile(c_dq, bq, hp),
            do_smem=tile(2, bq, hp // 2) if split else tile(c_dq, bq, hp),
            lse_smem=plgpu.SMEM((q_tiles, bq), jnp.float32),
            delta_smem=plgpu.SMEM((q_tiles, bq), jnp.float32),
            k_smem=tile(stages, bk, hp),
            v_smem=tile(stages, bk, hp),
            q_seg_smem=plgpu.SMEM((q_tiles, bq), jnp.int32) if with_segs else None,
            kv_seg_smem=plgpu.SMEM((stages, bk), jnp.int32) if with_segs else None,
            staging_smem=tile(c_dq, bq, bk) if staged and not split else None,
            # Q, dO, lse, D (and the query ids), or with split_dq Q and lse (and the ids)
            # only; K (and its key ids)
            q_ready=plgpu.Barrier(
                num_arrivals=(3 if split else 4) + with_segs, num_barriers=1 if split else c_dq
            ),
            k_ready=plgpu.Barrier(num_arrivals=1 + with_segs, num_barriers=stages),
            v_ready=plgpu.Barrier(num_barriers=stages),
            k_free=free_barrier(num_arrivals=c_dq, num_barriers=stages),
            # split_dq: only warpgroup 1 reads V
            v_free=free_barrier(num_arrivals=1 if split else c_dq, num_barriers=stages),
            split_scratch=(
                dict(
                    p=plgpu.SMEM((bq, bk), jnp.float32, transforms=f32_transforms),
                    ds=tile(bq, bk),
                    do_ready=plgpu.Barrier(num_arrivals=3),  # dO's halves and D
                    p_ready=plgpu.Barrier(),
                    p_free=plgpu.Barrier(),
                    ds_ready=plgpu.Barrier(),
                    ds_free=plgpu.Barrier(num_arrivals=2),
                )
                if split
                else None
            ),
            turns=plgpu.Barrier(num_arrivals=2) if config.dq_pingpong else None,
        ),
        grid=(N, t_pad // range_rows_dq, B),
        grid_names=("heads", "q_tiles", "batch"),
        num_threads=c_dq + 1,
        kernel_name="pallas_flash_mosaic_bwd_dq",
        **params,
        **cluster,
    )(q_len, kv_len, ranges, *inputs)
    return dq[:, :T, :, :H], dk[:, :S, :, :H], dv[:, :S, :, :H], None

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

* dK/dV (`_dkdv_kernel`): a CTA owns key/value tiles, resident in shared memory. The
  producer streams, for each query head of the key/value head's GQA group and each query
  tile the masks leave visible, the Q and dO tiles with their rows of lse and D. Each
  consumer computes S^T = K Q^T and dP^T = V dO^T (keys on the rows, so that P^T and
  dS^T come out of the accumulator already in the layout a register operand of the
  next wgmma needs), then dV += P^T dO and dK += dS^T Q. The group's query heads are
  summed inside the CTA: no atomics, no second reduction pass. Two consumers own a key
  tile each; where the two accumulators of a tile would not fit in a warpgroup's
  registers (head dim > 128), they share one tile instead, one accumulating dV and the
  other dK (`MosaicBwdConfig.split_dkv`).
* dQ (`_dq_kernel`): a CTA owns query tiles (one per consumer, as in the forward pass);
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

`MosaicBwdConfig.fused` is that kernel: `_dkdv_kernel` also computes each visited query
tile's dQ share dS K. Each consumer stores its dS^T to shared memory and, once every
consumer's is in, computes its slice of the share over all the CTA's key tiles (half the
head-dim columns each, or half the rows where the columns would be narrower than 64);
a fourth warpgroup adds the slices to a float32 dQ in increasing key span, the order
held by a global semaphore per query tile (mosaic/dq_adds.py), and XLA scales and casts
the sum. Fused, each head's query tiles are walked from the last down, so that the
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
can run too). Everything else is the same code.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash import masks
from pallas_flash.logits import LOG2E, Logits, backward_stats
from pallas_flash.mosaic import dq_adds
from pallas_flash.mosaic.config import (
    CONSUMER_REGISTERS,
    FUSED_SIDE_REGISTERS,
    NARROW_SWIZZLE,
    PRODUCER_REGISTERS,
    SMEM_BYTES,
    SOLO_CONSUMER_REGISTERS,
    WARP_WRITER_CONSUMER_REGISTERS,
    MosaicBwdConfig,
    padded_head_dim,
    q_do_fit_registers,
)
from pallas_flash.mosaic.forward import (
    _COL,
    _ROW,
    PingPong,
    _pad,
    element_mask,
    intersect_tables,
    kv_tile_ranges,
    pair_cluster,
    sm_count,
    stream_kv_tiles,
    swizzled,
    unsupported,
)


def _accumulate(terms, staging):
    """[acc + a @ b for (acc, a, b) in terms]: `a` [M, K] in registers, `b` a [K, N]
    shared-memory ref, float32 accumulators.

    staging None: the products are issued back to back, in place on the accumulators,
    and awaited together. Otherwise each `a` is stored to `staging` and its product
    lands in a fresh accumulator that is added (GPU interpret mode, see module doc).
    """
    if staging is None:

        def mma(acc_refs):
            for acc_ref, (_, a, b) in zip(acc_refs, terms):
                plgpu.wgmma(acc_ref, a, b)

        # run_state awaits the wgmmas before returning the accumulators.
        return list(pl.run_state(mma)(tuple(plgpu.ACC.init(acc) for acc, _, _ in terms)))
    out = []
    for acc, a, b in terms:
        staging[...] = a
        plgpu.commit_smem()  # make the stores visible to the wgmma's async reads

        def mma(acc_ref, b=b):
            plgpu.wgmma(acc_ref, staging, b)
            return acc_ref[...]

        # Reading the result awaits the wgmma, so `staging` is free again afterwards.
        out.append(acc + pl.run_scoped(mma, plgpu.ACC(acc.shape, jnp.float32)))
    return out


def _products(pairs, shape, after_issue=lambda: None):
    """[a @ b for (a, b) in pairs], both shared-memory refs, into fresh float32
    accumulators of `shape`, issued together and awaited once; `after_issue` runs
    between the two (a ping-pong's hand-over)."""

    def mma(*acc_refs):
        for acc_ref, (a, b) in zip(acc_refs, pairs):
            plgpu.wgmma(acc_ref, a, b)
        after_issue()
        return tuple(acc_ref[...] for acc_ref in acc_refs)

    return pl.run_scoped(mma, *(plgpu.ACC(shape, jnp.float32) for _ in pairs))


def _bcast(x, shape, dim: int):
    """A vector laid along dimension `dim` of `shape`, repeated along the other one."""
    return lax.broadcast_in_dim(x, shape, [dim])


def _row_probs(s, lse2, c, *, masked: bool, mask_args, q_segs=None, k_seg_ref=None):
    """P = exp2(S c - lse2) [bq, bk] (float32) of scores S with the queries on the rows
    (the dQ kernels), zero where the mask drops an element when the tile is `masked`.
    `mask_args` (spec, row_bound_mask, first row, (key tile index, keys a tile), kv_len,
    diagonal offset) go to `element_mask`; with segment ids, `q_segs` [bq] are the rows'
    and `k_seg_ref` the key tile's ids in shared memory."""
    shape = s.shape
    p = jnp.exp2(s * c - _bcast(lse2, shape, 0))
    if not masked:
        return p
    spec, row_bound, q0, (j, bk), kv_len, diag = mask_args
    keys = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    segs = None
    if q_segs is not None:  # (query ids, key ids), both [bq, bk]
        k_segs = plgpu.load(k_seg_ref, layout=_COL)  # [bk]
        segs = (_bcast(q_segs, shape, 0), _bcast(k_segs, shape, 1))
    keep = element_mask(spec, row_bound, q0, keys, j * bk, kv_len, diag, 0, segs)
    return jnp.where(keep, p, 0.0)


def _dkdv_kernel(
    q_len_ref,
    kv_len_ref,
    ranges_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    *refs,
    k_smem,
    v_smem,
    q_smem,
    do_smem,
    lse_smem,
    delta_smem,
    q_seg_smem,
    kv_seg_smem,
    staging_smem,
    kv_ready,
    q_ready,
    do_ready,
    free,
    done,
    probs_scratch,
    fused_scratch,
    spec: masks.MaskSpec,
    scale: float,
    config: MosaicBwdConfig,
    group: int,
    with_segs: bool,
    interpret: bool,
    semaphores: tuple[int, ...] | None,
):
    # After the nine inputs above: the segment ids ([B, T], [B, S]) when given, the
    # fused kernel's order tables, then the outputs dK, dV (and the float32 dQ).
    refs = list(refs)
    q_seg_ref, kv_seg_ref = (refs.pop(0), refs.pop(0)) if with_segs else (None, None)
    rotated = config.rotated_adds  # the order tables, then the rotation table
    order_refs = tuple(refs.pop(0) for _ in range(3 + rotated)) if config.fused else None
    dk_ref, dv_ref, *dq_acc_ref = refs
    bq, bk, stages = config.block_q_dkv, config.block_kv_dkv, config.num_stages_dkv
    consumers, tiles = config.consumers_dkv, config.key_tiles_dkv
    dtype = q_smem.dtype
    b = lax.axis_index("batch")
    kv_head = lax.axis_index("heads")
    span = lax.axis_index("kv_tiles")  # with dkdv_q_multicast, a cluster of two spans
    wg = lax.axis_index("wg")
    # The query tiles this CTA walks: its own key span's, or its cluster's (both spans').
    lo, full_lo, full_hi, hi = (ranges_ref[b, span, c] for c in range(4))
    if config.dkdv_q_multicast:
        span = span * 2 + lax.axis_index("cluster")
    n = hi - lo  # query tiles per query head of the group
    k0 = span * tiles * bk  # first key of the CTA

    # The fused kernel walks each head's query tiles from the last down: every CTA
    # of a key/value head then reaches a query tile after as many steps as the CTAs
    # before it (their ranges end at or before its own), so the ordered dQ adds of
    # neighbouring CTAs come due together instead of waiting on each other's tails.
    # With rotated_adds it walks them upward, its unmasked tiles rotated by its index
    # where every span has one range (`rot`; dq_adds.turn says why).
    rot = dq_adds.rotation(order_refs, b, order_refs[0][b, span])[2] if rotated else 0

    def step_of(g, i):
        if rotated:
            return g * n + dq_adds.walk_place(i, lo, full_lo, full_hi, rot)
        return g * n + (hi - 1 - i if config.fused else i - lo)

    def each_tile(start, stop, body, carry, turned: bool = False):
        """body(i, carry) over query tiles [start, stop), in the walk's order (`turned`:
        the unmasked tiles of a rotated walk, from start + rot round)."""
        if turned:
            tile = lambda j: dq_adds.rotated_tile(j, start, stop, rot)  # noqa: E731
            return lax.fori_loop(0, stop - start, lambda j, c: body(tile(j), c), carry)
        if not config.fused or rotated:
            return lax.fori_loop(start, stop, body, carry)
        return lax.fori_loop(0, stop - start, lambda j, c: body(stop - 1 - j, c), carry)

    def walk(body, carry):
        """body(i, carry, masked=) over one head's query tiles in the walk's order: the
        tiles the structural masks cut (masked) apart from the full ones."""
        segments = ((lo, full_lo, True), (full_lo, full_hi, False), (full_hi, hi, True))
        for start, stop, masked in segments[:: -1 if config.fused and not rotated else 1]:
            part = functools.partial(body, masked=masked)
            carry = each_tile(start, stop, part, carry, turned=rotated and not masked)
        return carry

    cluster = "cluster" if config.dkdv_q_multicast else None

    def load_all():
        """The producer: K and V once, then each step's Q, lse, dO and D."""
        for t in range(tiles):
            keys = (b, pl.ds(k0 + t * bk, bk), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[t], kv_ready)
            plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[t], kv_ready)
            if kv_seg_ref is not None:
                plgpu.copy_gmem_to_smem(kv_seg_ref.at[keys[:2]], kv_seg_smem.at[t], kv_ready)

        def per_head(g, _):
            h = kv_head * group + g

            def load(i, _):
                step = step_of(g, i)
                slot = lax.rem(step, jnp.int32(stages))
                rows = pl.ds(i * bq, bq)

                # The slot held the tile `stages` steps back: overwrite it once every
                # consumer is done with it.
                @pl.when(step >= stages)
                def _():
                    plgpu.barrier_wait(free.at[slot])

                # dkdv_q_multicast: Q and dO land in both CTAs of the cluster, half loaded
                # by each (their row statistics and ids, a few hundred bytes, by each).
                plgpu.copy_gmem_to_smem(
                    q_ref.at[b, rows, h], q_smem.at[slot], q_ready.at[slot], collective_axes=cluster
                )
                plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows], lse_smem.at[slot], q_ready.at[slot])
                if q_seg_ref is not None:
                    plgpu.copy_gmem_to_smem(
                        q_seg_ref.at[b, rows], q_seg_smem.at[slot], q_ready.at[slot]
                    )
                plgpu.copy_gmem_to_smem(
                    do_ref.at[b, rows, h],
                    do_smem.at[slot],
                    do_ready.at[slot],
                    collective_axes=cluster,
                )
                plgpu.copy_gmem_to_smem(
                    delta_ref.at[b, h, rows], delta_smem.at[slot], do_ready.at[slot]
                )

            if rotated:  # the consumers' order, segment by segment
                walk(lambda i, c, masked: load(i, c), None)
            else:
                each_tile(lo, hi, load, None)

        lax.fori_loop(0, group, per_head, None)

        def drain(step, _):
            plgpu.barrier_wait(free.at[lax.rem(step, jnp.int32(stages))])

        # Await the consumers' release of the last tiles too: the shared memory must
        # not be released under them, and every phase of a barrier should be seen
        # (GPU interpret mode checks this at deallocation).
        steps = group * n
        lax.fori_loop(jnp.maximum(0, steps - stages), steps, drain, None)

    part = config.dq_part(k_smem.shape[-1]) if config.fused else None  # a consumer's dQ slice
    pieces = config.share_pieces
    writer = None
    if config.fused:
        writer = functools.partial(
            dq_adds.writer,
            order_refs,
            dq_acc_ref[0],
            fused_scratch,
            b=b,
            kv_head=kv_head,
            span=span,
            group=group,
            steps=(lo, full_lo, full_hi, hi),
            block_q=bq,
            part=part,
            interpret=interpret,
            rotated=rotated,
        )

    @pl.when(wg == consumers)
    def _producer():
        plgpu.set_max_registers(
            FUSED_SIDE_REGISTERS if config.fused else PRODUCER_REGISTERS, action="decrease"
        )
        if not config.writer_warp:
            load_all()
            return
        sems = dq_adds.semaphores(semaphores, interpret)  # in warpgroup code

        # One warp loads, another adds the dQ shares (MosaicBwdConfig.writer_warp); the
        # other two idle, or with split_writer a third adds every other step's. The
        # join at the end of warp_map waits for them all.
        def per_warp(warp):
            pl.when(warp == 0)(load_all)
            if not config.split_writer:
                pl.when(warp == 1)(functools.partial(writer, sems=sems, registers=False))
                return
            for p in range(dq_adds.SLOTS):
                adds = functools.partial(writer, sems=sems, registers=False, parity=p)
                pl.when(warp == 1 + p)(adds)

        plgpu.warp_map(per_warp)

    if config.fused and not config.writer_warp:

        @pl.when(wg == consumers + 1)  # a fourth warpgroup
        def _():
            writer(sems=dq_adds.semaphores(semaphores, interpret))

    def consumer(w, does_dv: bool, does_dk: bool):
        """Warpgroup `w` (static or traced) accumulates dV and/or dK of its key tile
        (and, fused, its slice of each query tile's dQ share)."""
        registers = WARP_WRITER_CONSUMER_REGISTERS if config.writer_warp else CONSUMER_REGISTERS
        plgpu.set_max_registers(registers, action="increase")
        t = 0 if config.split_dkv else w
        kw0 = k0 + t * bk  # the warpgroup's first key
        k_tile, v_tile = k_smem.at[t], v_smem.at[t]
        staging = None if staging_smem is None else staging_smem.at[w]
        q_len = q_len_ref[b]
        kv_len = kv_len_ref[b]
        diag = masks.offset(spec, q_len, kv_len)
        c = scale * LOG2E  # base-2 scores: log2(e) folded into the scale
        shape = (bk, bq)  # S^T and its kin: keys on the rows, queries on the columns

        def probs(s_t, i, slot, masked: bool, query_dim: int = 1):
            """P^T [bk, bq] (float32) of the step's scores S^T, masked where the tile needs
            it; with `query_dim` 0, P [bq, bk] of S (`query_rows`)."""
            layout = _COL if query_dim == 1 else _ROW  # one value per query
            tile_shape, key_dim = s_t.shape, 1 - query_dim
            lse2 = plgpu.load(lse_smem.at[slot], layout=layout)  # [bq], base 2, +inf if empty
            p_t = jnp.exp2(s_t * c - _bcast(lse2, tile_shape, query_dim))
            if not masked:  # the structural masks cut this tile (full tiles skip this work)
                return p_t
            keys = plgpu.broadcasted_iota(jnp.int32, tile_shape, key_dim, layout=plgpu.Layout.WGMMA)
            segs = None
            if q_seg_ref is not None:  # (query ids, key ids), both tile-shaped
                q_segs = plgpu.load(q_seg_smem.at[slot], layout=layout)  # [bq]
                segs = (_bcast(q_segs, tile_shape, query_dim), _bcast(k_segs, tile_shape, key_dim))
            keep = element_mask(
                spec, config.row_bound_mask, i * bq, keys, kw0, kv_len, diag, query_dim, segs
            )
            return jnp.where(keep, p_t, 0.0)

        def dscores(p_t, dp_t, slot, query_dim: int = 1):
            """dS^T = P^T (dP^T - D) (or, with `query_dim` 0, dS), in the inputs' dtype."""
            layout = _COL if query_dim == 1 else _ROW
            delta = plgpu.load(delta_smem.at[slot], layout=layout)  # [bq]
            return (p_t * (dp_t - _bcast(delta, p_t.shape, query_dim))).astype(dtype)

        def fa3_step(i, carry, *, step, slot, q_tile, do_tile, k_tile, v_tile, z, masked: bool):
            """One fused step in FlashAttention-3's order (`MosaicBwdConfig.fa3_order`):
            S^T and dP^T issued together, the exp2 beside dP^T; then dV, with dS^T stored
            and exchanged while it runs; the share and dK queued behind it, and the share
            handed over while dK runs. Nothing is awaited that the next issue does not
            need."""

            def scores(s_ref, dp_ref):
                plgpu.wgmma(s_ref, k_tile, q_tile.transpose((1, 0)))  # s^T = k @ q.T
                plgpu.wgmma(dp_ref, v_tile, do_tile.transpose((1, 0)))  # dp^T = v @ do.T
                # wgmma groups complete in order: S^T is in, dP^T runs beside the exp2.
                p_t = probs(plgpu.wgmma_accumulator_load(s_ref, wait_n=1), i, slot, masked)
                return p_t.astype(dtype), dscores(p_t, dp_ref[...], slot)

            p_t, ds_t = pl.run_scoped(scores, *(plgpu.ACC(shape, jnp.float32),) * 2)
            if config.chained_share:
                return chained_fa3_products(carry, step, slot, q_tile, do_tile, z, p_t, ds_t)
            piece = dq_adds.piece_shape(part, pieces)
            share0 = plgpu.layout_cast(jnp.zeros(piece, jnp.float32), plgpu.Layout.WGMMA)
            issue = functools.partial(dq_adds.issue_share, fused_scratch, w, k_smem, part, z=z)

            def products(refs):
                dv_ref, share_ref, dk_ref = refs
                plgpu.wgmma(dv_ref, p_t, do_tile)  # dv += p^T @ do
                dq_adds.share_ds(fused_scratch, step, w, ds_t)  # while dV runs
                issue(share_ref, piece=(0, pieces))
                plgpu.wgmma(dk_ref, ds_t, q_tile)  # dk += ds^T @ q
                # dV's and the share's groups are done; dK's runs beside the hand-over.
                share = plgpu.wgmma_accumulator_load(share_ref, wait_n=1)
                dq_adds.hand_share(fused_scratch, step, w, share, (0, pieces))
                for index in range(1, pieces):  # share_halves: the next piece, dK in flight

                    def rest(acc_ref, index=index):
                        issue(acc_ref, piece=(index, pieces))
                        return plgpu.wgmma_accumulator_load(acc_ref, wait_n=0)

                    share = pl.run_scoped(rest, plgpu.ACC(piece, jnp.float32))
                    dq_adds.hand_share(fused_scratch, step, w, share, (index, pieces))

            # run_state awaits dK before returning the accumulators.
            dv, _, dk = pl.run_state(products)(
                tuple(plgpu.ACC.init(x) for x in (carry[0], share0, carry[1]))
            )
            plgpu.barrier_arrive(free.at[slot])
            return dv, dk

        def chained_fa3_products(carry, step, slot, q_tile, do_tile, z, p_t, ds_t):
            """fa3_step's products with `chained_share`: dV; this consumer's dS^T stored for
            its own share while dV runs; the share's first part (started, for consumer 1,
            from consumer 0's) and dK queued behind it, the part handed on while dK runs;
            then the other parts."""
            parts = fused_scratch["share"].shape[1]
            start = dq_adds.chained_start(fused_scratch, w, 0, part)
            hand = functools.partial(dq_adds.chained_hand, fused_scratch, step, w, parts=parts)
            pair = functools.partial(dq_adds.chained_pair, fused_scratch, w, k_smem, part=part, z=z)

            def products(refs):
                dv_ref, share_ref, dk_ref = refs
                plgpu.wgmma(dv_ref, p_t, do_tile)  # dv += p^T @ do
                dq_adds.publish_own_ds(fused_scratch, w, ds_t)  # while dV runs
                plgpu.wgmma(share_ref, *pair(0))
                plgpu.wgmma(dk_ref, ds_t, q_tile)  # dk += ds^T @ q
                # dV's and the part's groups are done; dK's runs beside the hand-over.
                hand(0, plgpu.wgmma_accumulator_load(share_ref, wait_n=1))
                for p in range(1, parts):

                    def onto(acc_ref, p=p):  # indexed inside: see dq_adds.chained_share
                        plgpu.wgmma(acc_ref, *pair(p))

                    start_p = dq_adds.chained_start(fused_scratch, w, p, part)
                    hand(p, pl.run_state(onto)(plgpu.ACC.init(start_p)))  # awaited

            # run_state awaits dK before returning the accumulators.
            dv, _, dk = pl.run_state(products)(
                tuple(plgpu.ACC.init(x) for x in (carry[0], start, carry[1]))
            )
            plgpu.barrier_arrive(free.at[slot])
            return dv, dk

        rshape = (bq, bk)  # query_rows: S and its kin with the queries on the rows

        def rows_step(i, carry, *, step, slot, q_tile, do_tile, k_tile, v_tile, z, masked: bool):
            """One fused step with the queries on the rows (`MosaicBwdConfig.query_rows`,
            FA3's orientation): S = Q K^T and dP = dO V^T [bq, bk], so the row statistics
            lse and D are two values a thread (a column's were 16); P and then dS pass
            through the consumer's shared-memory tile into dV = P^T dO and dK = dS^T Q
            (no wgmma operand in registers), and the dQ share reads dS there as it is."""
            # [bq, bk]: this step's P, then its dS. Indexed where it is used: a ref
            # indexed outside pl.run_state and closed over fails to lower there.
            tile = lambda: fused_scratch["ds"].at[w + z]  # noqa: E731
            s_, dp = _products([(q_tile, k_tile.transpose((1, 0))),
                                (do_tile, v_tile.transpose((1, 0)))], rshape)  # fmt: skip
            p = probs(s_, i, slot, masked, query_dim=0)

            # The tile is free once every consumer's share of the last step has read it.
            @pl.when(step > 0)
            def _():
                plgpu.barrier_wait(fused_scratch["ds_free"])

            tile()[...] = p.astype(dtype)
            plgpu.commit_smem()  # visible to the wgmma's async reads
            if config.operands_in_registers:  # compiled: in place, dS computed beside dV

                def products(refs):
                    dv_ref, dk_ref = refs
                    plgpu.wgmma(dv_ref, tile().transpose((1, 0)), do_tile)  # dv += p^T @ do
                    ds = dscores(p, dp, slot, query_dim=0)
                    plgpu.wgmma_wait(0)  # dV has read P: the tile takes dS
                    tile()[...] = ds
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(fused_scratch["ds_ready"])
                    plgpu.wgmma(dk_ref, tile().transpose((1, 0)), q_tile)  # dk += ds^T @ q

                dv, dk = pl.run_state(products)(tuple(plgpu.ACC.init(x) for x in carry))
            else:  # GPU interpret mode: fresh accumulators, added (module doc)
                (pv,) = _products([(tile().transpose((1, 0)), do_tile)], carry[0].shape)
                tile()[...] = dscores(p, dp, slot, query_dim=0)
                plgpu.commit_smem()
                plgpu.barrier_arrive(fused_scratch["ds_ready"])
                (sq,) = _products([(tile().transpose((1, 0)), q_tile)], carry[1].shape)
                dv, dk = carry[0] + pv, carry[1] + sq
            plgpu.barrier_arrive(free.at[slot])
            dq_adds.dq_share(fused_scratch, step, w, k_smem, part, z, query_rows=True)
            return dv, dk

        def shared_probs_step(i, carry, *, step, slot, q_tile, do_tile, k_tile, v_tile, masked):
            """One split step with P^T handed over (`MosaicBwdConfig.share_probs`): the dV
            warpgroup computes S^T and P^T, stores P^T (float32) for the dK warpgroup and
            accumulates dV; the dK warpgroup computes dP^T meanwhile, then reads P^T
            (the same values it would have recomputed) for dS^T and dK."""
            tile, ready, free_ = (probs_scratch[x] for x in ("tile", "ready", "free"))
            if does_dv:
                (s_t,) = _products([(k_tile, q_tile.transpose((1, 0)))], shape)  # s^T = k @ q.T
                p_t = probs(s_t, i, slot, masked)

                @pl.when(step > 0)  # the dK warpgroup has read the last step's P^T
                def _():
                    plgpu.barrier_wait(free_)

                tile[...] = p_t
                plgpu.barrier_arrive(ready)
                return tuple(_accumulate([(carry[0], p_t.astype(dtype), do_tile)], staging))
            (dp_t,) = _products([(v_tile, do_tile.transpose((1, 0)))], shape)  # dp^T = v @ do.T
            plgpu.barrier_wait(ready)
            p_t = plgpu.load(tile, layout=plgpu.Layout.WGMMA)
            plgpu.barrier_arrive(free_)
            ds_t = dscores(p_t, dp_t, slot)
            return tuple(_accumulate([(carry[-1], ds_t, q_tile)], staging))

        def step_operands(step):
            """This step's K and V tiles, and the index offset `z` (0) of the buffers that
            stay in place. With `config.step_descriptors` they are addressed through
            `z`, which is 0 (steps count from 0) but not to the compiler, so each step
            builds their wgmma descriptors anew instead of holding them all across the
            loop (where the fused kernel spilled them, README)."""
            if not config.step_descriptors:
                return k_tile, v_tile, 0
            z = lax.shift_right_logical(step, 31)
            return k_smem.at[t + z], v_smem.at[t + z], z

        def body(i, carry, *, g, masked: bool):
            step = step_of(g, i)
            slot = lax.rem(step, jnp.int32(stages))
            q_tile, do_tile = q_smem.at[slot], do_smem.at[slot]
            plgpu.barrier_wait(q_ready.at[slot])
            plgpu.barrier_wait(do_ready.at[slot])  # every consumer sees every phase
            k_tile, v_tile, z = step_operands(step)
            if config.query_rows:
                return rows_step(
                    i, carry, step=step, slot=slot, q_tile=q_tile, do_tile=do_tile,
                    k_tile=k_tile, v_tile=v_tile, z=z, masked=masked,
                )  # fmt: skip
            if config.fa3_order:
                return fa3_step(
                    i, carry, step=step, slot=slot, q_tile=q_tile, do_tile=do_tile,
                    k_tile=k_tile, v_tile=v_tile, z=z, masked=masked,
                )  # fmt: skip
            if config.share_probs:
                carry = shared_probs_step(
                    i, carry, step=step, slot=slot, q_tile=q_tile, do_tile=do_tile,
                    k_tile=k_tile, v_tile=v_tile, masked=masked,
                )  # fmt: skip
                plgpu.barrier_arrive(free.at[slot])
                return carry
            k_a, v_a = (k_tile, v_tile) if kv_regs is None else kv_regs
            pairs = [(k_a, q_tile.transpose((1, 0)))]  # s^T = k @ q.T: [bk, bq]
            if does_dk:
                pairs.append((v_a, do_tile.transpose((1, 0))))  # dp^T = v @ do.T: [bk, bq]
            products = _products(pairs, shape)
            p_t = probs(products[0], i, slot, masked)
            terms = []
            if does_dv:
                terms.append((carry[0], p_t.astype(dtype), do_tile))  # dv += p^T @ do: [bk, hp]
            if does_dk:
                ds_t = dscores(p_t, products[1], slot)
                terms.append((carry[-1], ds_t, q_tile))  # dk += ds^T @ q: [bk, hp]
                if config.fused and not config.chained_share:
                    # the other consumers' dQ slices read this tile's dS^T
                    dq_adds.share_ds(fused_scratch, step, w, ds_t)
            carry = tuple(_accumulate(terms, staging))
            plgpu.barrier_arrive(free.at[slot])
            if config.chained_share:
                staged = staging is not None
                dq_adds.chained_share(fused_scratch, step, w, k_smem, part, ds_t, z, staged)
            elif config.fused:
                dq_adds.dq_share(fused_scratch, step, w, k_smem, part, z, pieces=pieces)
            return carry

        def per_head(g, carry):
            return walk(functools.partial(body, g=g), carry)

        zeros = plgpu.layout_cast(
            jnp.zeros((bk, k_tile.shape[-1]), jnp.float32), plgpu.Layout.WGMMA
        )
        plgpu.barrier_wait(kv_ready)
        kv_regs = None  # k_v_in_registers: K and V, the A operands of S^T and dP^T
        if config.k_v_in_registers:
            kv_regs = tuple(plgpu.load(x, layout=plgpu.Layout.WGMMA) for x in (k_tile, v_tile))
        if kv_seg_ref is not None:
            # [bk]: the tile's key ids, along the rows of S^T (or the columns of S)
            k_segs = plgpu.load(kv_seg_smem.at[t], layout=_COL if config.query_rows else _ROW)
        accs = lax.fori_loop(0, group, per_head, (zeros,) * (does_dv + does_dk))
        if config.share_probs and does_dv:  # the dK warpgroup's read of the last P^T

            @pl.when(group * n > 0)
            def _():
                plgpu.barrier_wait(probs_scratch["free"])

        if config.split_dkv:  # K and V are read by both warpgroups until both are done
            plgpu.barrier_arrive(done)
            plgpu.barrier_wait(done)
        if config.fused:  # the other consumers' last dQ slices read this K tile
            dq_adds.consumers_done(fused_scratch, group * n, w)
        outs = []
        if does_dv:
            outs.append((v_tile, accs[0], dv_ref))
        if does_dk:
            outs.append((k_tile, accs[-1] * scale, dk_ref))  # dS was of the scaled scores
        for tile, acc, ref in outs:
            tile[...] = acc.astype(dtype)
        plgpu.commit_smem()
        for tile, _, ref in outs:
            plgpu.copy_smem_to_gmem(tile, ref.at[b, pl.ds(kw0, bk), kv_head])
        # The CTA ends: the tiles only have to be read out (forward.py's epilogue says why).
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    if config.split_dkv:
        pl.when(wg == 0)(functools.partial(consumer, 0, True, False))
        pl.when(wg == 1)(functools.partial(consumer, 1, False, True))
    elif config.fused:  # static warpgroup indices: each slices K and dS^T at its own offset
        for w in range(consumers):
            pl.when(wg == w)(functools.partial(consumer, w, True, True))
    else:
        pl.when(wg < consumers)(functools.partial(consumer, wg, True, True))


def _dq_kernel(
    q_len_ref,
    kv_len_ref,
    ranges_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    *refs,
    q_smem,
    do_smem,
    lse_smem,
    delta_smem,
    k_smem,
    v_smem,
    q_seg_smem,
    kv_seg_smem,
    staging_smem,
    q_ready,
    k_ready,
    v_ready,
    k_free,
    v_free,
    split_scratch,
    turns,
    spec: masks.MaskSpec,
    scale: float,
    config: MosaicBwdConfig,
    num_q_tiles: int,
    group: int,
    named_turns: bool,
):
    q_seg_ref, kv_seg_ref, dq_ref = refs if len(refs) == 3 else (None, None, *refs)
    bq, bk, stages = config.block_q_dq, config.block_kv_dq, config.num_stages_dq
    consumers = config.consumers_dq
    dtype = q_smem.dtype
    b = lax.axis_index("batch")
    h = lax.axis_index("heads")
    tile = lax.axis_index("q_tiles")  # with dq_kv_multicast, a cluster of two tiles
    if spec.causal:  # longest rows first, as in the forward pass
        tile = num_q_tiles // (2 if config.dq_kv_multicast else 1) - 1 - tile
    # The key tiles this CTA walks: its own query tile's, or its cluster's (both tiles').
    lo, full_lo, full_hi, hi = (ranges_ref[b, tile, c] for c in range(4))
    if config.dq_kv_multicast:
        tile = tile * 2 + lax.axis_index("cluster")
    wg = lax.axis_index("wg")

    def slot_of(j):  # key tile j lives in ring slot (j - lo) % stages
        return lax.rem(j - lo, jnp.int32(stages))

    @pl.when(wg == consumers)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
        kv_head = lax.div(h, jnp.int32(group))
        stream_kv_tiles(
            (k_ref, v_ref, kv_seg_ref),
            (k_smem, v_smem, kv_seg_smem),
            (k_ready, v_ready, k_free, v_free),
            b=b,
            kv_head=kv_head,
            lo=lo,
            hi=hi,
            block_kv=bk,
            multicast=config.dq_kv_multicast,
        )

    if config.split_dq:
        for w in range(consumers):
            pl.when(wg == w)(
                functools.partial(
                    _split_dq_consumer,
                    w,
                    refs=(q_ref, do_ref, lse_ref, delta_ref, q_seg_ref, dq_ref),
                    smem=(q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, q_seg_smem),
                    kv_seg_smem=kv_seg_smem,
                    barriers=(q_ready, k_ready, v_ready, k_free, v_free),
                    scratch=split_scratch,
                    lens=(q_len_ref, kv_len_ref),
                    tile_index=(b, h, tile),
                    ranges=(lo, full_lo, full_hi, hi),
                    slot_of=slot_of,
                    spec=spec,
                    scale=scale,
                    config=config,
                )
            )
        return

    @pl.when(wg < consumers)
    def _consumer():
        regs = SOLO_CONSUMER_REGISTERS if config.solo_dq_registers else CONSUMER_REGISTERS
        plgpu.set_max_registers(regs, action="increase")
        q0 = (tile * consumers + wg) * bq
        rows_of = (b, pl.ds(q0, bq), h)
        q_tile, do_tile = q_smem.at[wg], do_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[rows_of], q_tile, q_ready.at[wg])
        plgpu.copy_gmem_to_smem(do_ref.at[rows_of], do_tile, q_ready.at[wg])
        plgpu.copy_gmem_to_smem(lse_ref.at[b, h, pl.ds(q0, bq)], lse_smem.at[wg], q_ready.at[wg])
        plgpu.copy_gmem_to_smem(
            delta_ref.at[b, h, pl.ds(q0, bq)], delta_smem.at[wg], q_ready.at[wg]
        )
        if q_seg_ref is not None:
            plgpu.copy_gmem_to_smem(
                q_seg_ref.at[b, pl.ds(q0, bq)], q_seg_smem.at[wg], q_ready.at[wg]
            )
        staging = None if staging_smem is None else staging_smem.at[wg]
        q_len = q_len_ref[b]
        kv_len = kv_len_ref[b]
        diag = masks.offset(spec, q_len, kv_len)
        c = scale * LOG2E
        shape = (bq, bk)
        # dq_pingpong: a turn is dS K of one tile and S, dP of the next (the forward's
        # P V and next Q K^T); turns None: every hand-over is a no-op.
        pingpong = PingPong(turns, wg, named=named_turns)

        def body(j, dq, *, masked: bool):
            slot = slot_of(j)
            k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.barrier_wait(v_ready.at[slot])
            s, dp = _products(
                [
                    (q_a, k_tile.transpose((1, 0))),  # s = q @ k.T: [bq, bk]
                    (do_a, v_tile.transpose((1, 0))),  # dp = do @ v.T: [bq, bk]
                ],
                shape,
                after_issue=pingpong.meet,  # ours are issued: the other may issue its own
            )
            plgpu.barrier_arrive(v_free.at[slot])
            p = _row_probs(
                s,
                lse2,
                c,
                masked=masked,
                mask_args=(spec, config.row_bound_mask, q0, (j, bk), kv_len, diag),
                q_segs=q_segs,
                k_seg_ref=None if q_segs is None else kv_seg_smem.at[slot],
            )
            ds = (p * (dp - _bcast(delta, shape, 0))).astype(dtype)  # [bq, bk]
            pingpong.elementwise_done()
            pingpong.my_turn()  # our turn: dS K, then the next tile's S and dP
            (dq,) = _accumulate([(dq, ds, k_tile)], staging)  # dq += ds @ k
            plgpu.barrier_arrive(k_free.at[slot])
            return dq

        plgpu.barrier_wait(q_ready.at[wg])
        q_a, do_a = q_tile, do_tile  # the A operands of S and dP
        if config.q_do_in_registers:  # loaded once, read from registers in every step
            q_a, do_a = (plgpu.load(x, layout=plgpu.Layout.WGMMA) for x in (q_tile, do_tile))
        lse2 = plgpu.load(lse_smem.at[wg], layout=_ROW)  # [bq], base 2, +inf if empty
        delta = plgpu.load(delta_smem.at[wg], layout=_ROW)  # [bq]
        q_segs = None  # [bq]: the rows' ids, with segment ids
        if q_seg_ref is not None:
            q_segs = plgpu.load(q_seg_smem.at[wg], layout=_ROW)
        dq = plgpu.layout_cast(jnp.zeros((bq, q_tile.shape[-1]), jnp.float32), plgpu.Layout.WGMMA)
        pingpong.start()  # consumer 1 takes a turn ahead (both walk the same key tiles)
        dq = lax.fori_loop(lo, full_lo, functools.partial(body, masked=True), dq)
        dq = lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False), dq)
        dq = lax.fori_loop(full_hi, hi, functools.partial(body, masked=True), dq)
        pingpong.end()
        q_tile[...] = (dq * scale).astype(dtype)  # dS was of the scaled scores
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_tile, dq_ref.at[rows_of])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the CTA ends (as above)


def _split_dq_consumer(
    w: int,
    *,
    refs,
    smem,
    kv_seg_smem,
    barriers,
    scratch,
    lens,
    tile_index,
    ranges,
    slot_of,
    spec: masks.MaskSpec,
    scale: float,
    config: MosaicBwdConfig,
):
    """Warpgroup `w` of the dQ kernel with `MosaicBwdConfig.split_dq`: both warpgroups
    share one query tile. Warpgroup 0 loads Q and lse, computes S and P (masked) and hands
    P (float32) over; warpgroup 1 loads dO and D, computes dP and then dS from that P, and
    stores dS for both. Each accumulates dQ's head-dim columns [w * H/2, (w + 1) * H/2) as
    dS K, from shared memory, and writes them out."""
    q_ref, do_ref, lse_ref, delta_ref, q_seg_ref, dq_ref = refs
    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, q_seg_smem = smem  # Q, dO: halves
    q_ready, k_ready, v_ready, k_free, v_free = barriers
    b, h, tile = tile_index
    lo, full_lo, full_hi, hi = ranges
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
    q_len, kv_len = (ref[b] for ref in lens)
    bq, bk = config.block_q_dq, config.block_kv_dq
    dtype = q_smem.dtype
    q0 = tile * bq
    rows = pl.ds(q0, bq)
    # Q and dO are held as two column halves ([2, bq, H/2]), so that each warpgroup's
    # half of dQ leaves through a contiguous tile (TMA stores need one).
    cols = q_smem.shape[-1]
    shape = (bq, bk)
    in_place = config.operands_in_registers  # GPU interpret mode cannot accumulate in place
    halves = [pl.ds(i * cols, cols) for i in range(2)]
    if w == 0:  # S and P: Q, lse (and the rows' ids)
        ready = q_ready
        for i, half in enumerate(halves):
            plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h, half], q_smem.at[i], ready)
        plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows], lse_smem.at[0], ready)
        if q_seg_ref is not None:
            plgpu.copy_gmem_to_smem(q_seg_ref.at[b, rows], q_seg_smem.at[0], ready)
    else:  # dP and dS: dO, D
        ready = scratch["do_ready"]
        for i, half in enumerate(halves):
            plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h, half], do_smem.at[i], ready)
        plgpu.copy_gmem_to_smem(delta_ref.at[b, h, rows], delta_smem.at[0], ready)

    def issue_product(acc_ref, a_halves, b_tile):
        """acc += a @ b.T [bq, bk] over the head dim, from a's two column halves: issued
        (wgmma), not awaited."""
        for i, half in enumerate(halves):
            plgpu.wgmma(acc_ref, a_halves.at[i], b_tile.at[:, half].transpose((1, 0)))

    def product(a_halves, b_tile):
        """a @ b.T [bq, bk] over the head dim, from a's two column halves."""

        def mma(acc_ref):
            issue_product(acc_ref, a_halves, b_tile)
            return acc_ref[...]

        return pl.run_scoped(mma, plgpu.ACC(shape, jnp.float32))

    plgpu.barrier_wait(ready)
    diag = masks.offset(spec, q_len, kv_len)
    c = scale * LOG2E
    if w == 0:
        lse2 = plgpu.load(lse_smem.at[0], layout=_ROW)  # [bq], base 2, +inf if empty
        q_segs = None
        if q_seg_ref is not None:
            q_segs = plgpu.load(q_seg_smem.at[0], layout=_ROW)
    else:
        delta = plgpu.load(delta_smem.at[0], layout=_ROW)  # [bq]

    def probs(s_, j, masked: bool):
        """P [bq, bk] (float32) of key tile j's scores S, masked where the tile needs it."""
        return _row_probs(
            s_,
            lse2,
            c,
            masked=masked,
            mask_args=(spec, config.row_bound_mask, q0, (j, bk), kv_len, diag),
            q_segs=q_segs,
            k_seg_ref=None if q_segs is None else kv_seg_smem.at[slot_of(j)],
        )

    def hand_p(p, j):
        """P of key tile j to warpgroup 1, once it has read the last one."""

        @pl.when(j > lo)
        def _():
            plgpu.barrier_wait(scratch["p_free"])

        scratch["p"][...] = p
        plgpu.barrier_arrive(scratch["p_ready"])

    def hand_ds(dp, j):
        """dS of key tile j from warpgroup 0's P and this dP, stored for both warpgroups'
        dS K once both have done the last one's."""
        plgpu.barrier_wait(scratch["p_ready"])
        p = plgpu.load(scratch["p"], layout=plgpu.Layout.WGMMA)
        plgpu.barrier_arrive(scratch["p_free"])
        ds = (p * (dp - _bcast(delta, shape, 0))).astype(dtype)  # [bq, bk]

        @pl.when(j > lo)
        def _():
            plgpu.barrier_wait(scratch["ds_free"])

        scratch["ds"][...] = ds
        plgpu.commit_smem()  # visible to the wgmmas' async reads
        plgpu.barrier_arrive(scratch["ds_ready"])

    def with_dq(dq, work):
        """dq after `work(acc_ref)`, which issues this warpgroup's dS K into acc_ref and
        may do more while it runs: in place (compiled), or into a fresh accumulator that
        is added (GPU interpret mode). Awaits every wgmma issued."""
        if in_place:
            return pl.run_state(work)(plgpu.ACC.init(dq))

        def fresh(acc_ref):
            work(acc_ref)
            return acc_ref[...]

        return dq + pl.run_scoped(fresh, plgpu.ACC((bq, cols), jnp.float32))

    def add_ds_k(acc_ref, j):
        """dq[:, half] += dS_j @ K_j[:, half], issued (wgmma), not awaited."""
        k_half = k_smem.at[slot_of(j)].at[:, halves[w]]
        plgpu.wgmma(acc_ref, scratch["ds"], k_half)

    def release(j):
        """This warpgroup is done with dS_j and K_j."""
        plgpu.barrier_arrive(scratch["ds_free"])
        plgpu.barrier_arrive(k_free.at[slot_of(j)])

    # The steps are pipelined across the warpgroups: step j issues this tile's S (w 0) or
    # dP (w 1) beside the last tile's dS K, so that the tensor cores have work while the
    # exp2 (w 0) and dS (w 1) run. The first tile's S / dP comes before the loop, the last
    # tile's dS K after it.
    def first(j):
        plgpu.barrier_wait(k_ready.at[slot_of(j)])
        if w == 0:  # masked, whatever the tile (one step)
            hand_p(probs(product(q_smem, k_smem.at[slot_of(j)]), j, True), j)
        else:
            plgpu.barrier_wait(v_ready.at[slot_of(j)])
            dp = product(do_smem, v_smem.at[slot_of(j)])
            plgpu.barrier_arrive(v_free.at[slot_of(j)])
            hand_ds(dp, j)

    def body(j, dq, *, masked: bool):
        slot = slot_of(j)
        plgpu.barrier_wait(k_ready.at[slot])  # S here; dS K next step in both
        if w == 0:

            def work(acc_ref):
                def scores(s_ref):
                    issue_product(s_ref, q_smem, k_smem.at[slot])  # s = q @ k.T
                    plgpu.barrier_wait(scratch["ds_ready"])  # dS of tile j - 1
                    add_ds_k(acc_ref, j - 1)
                    # wgmma groups complete in order: S is in, dS K runs beside the exp2.
                    s_ = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)
                    hand_p(probs(s_, j, masked), j)

                pl.run_scoped(scores, plgpu.ACC(shape, jnp.float32))

            dq = with_dq(dq, work)
            release(j - 1)
            return dq

        plgpu.barrier_wait(v_ready.at[slot])

        def grads(dp_ref):
            def work(acc_ref):
                add_ds_k(acc_ref, j - 1)
                issue_product(dp_ref, do_smem, v_smem.at[slot])  # dp = do @ v.T

            return with_dq(dq, work), dp_ref[...]  # both awaited

        dq, dp = pl.run_scoped(grads, plgpu.ACC(shape, jnp.float32))
        plgpu.barrier_arrive(v_free.at[slot])
        release(j - 1)
        hand_ds(dp, j)
        return dq

    def last(dq, j):
        if w == 0:
            plgpu.barrier_wait(scratch["ds_ready"])
        dq = with_dq(dq, lambda acc_ref: add_ds_k(acc_ref, j))
        release(j)
        return dq

    dq = plgpu.layout_cast(jnp.zeros((bq, cols), jnp.float32), plgpu.Layout.WGMMA)
    pl.when(hi > lo)(lambda: first(lo))
    after = lo + 1
    dq = lax.fori_loop(after, full_lo, functools.partial(body, masked=True), dq)
    start = jnp.maximum(full_lo, after)
    dq = lax.fori_loop(start, full_hi, functools.partial(body, masked=False), dq)
    dq = lax.fori_loop(jnp.maximum(full_hi, after), hi, functools.partial(body, masked=True), dq)
    dq = lax.fori_loop(jnp.maximum(hi - 1, lo), hi, lambda j, x: last(x, j), dq)  # once, or not

    # Every phase seen: the other warpgroup's release of the last P (w 0) or dS (w 1).
    @pl.when(hi > lo)
    def _():
        plgpu.barrier_wait(scratch["p_free" if w == 0 else "ds_free"])

    # Out through a half of this warpgroup's own input (Q or dO), which it alone read.
    out = (q_smem if w == 0 else do_smem).at[w]
    out[...] = (dq * scale).astype(dtype)  # dS was of the scaled scores
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out, dq_ref.at[b, rows, h, halves[w]])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the CTA ends (as above)


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
    NotImplementedError for what the kernels lack (see forward.unsupported) and
    ValueError when the config does not fit in shared memory or registers.
    """
    B, T, N, H = q.shape
    _, S, K, _ = k.shape
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
        config = dataclasses.replace(
            config,
            operands_in_registers=False,
            fa3_order=False,
            q_do_in_registers=False,
            k_v_in_registers=False,
        )

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
    q_p, do_p = _pad(q, t_pad, hp), _pad(do.astype(q.dtype), t_pad, hp)
    k_p, v_p = _pad(k, s_pad, hp), _pad(v, s_pad, hp)
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
    if config.rotated_adds:
        order += (dq_adds.ring_table(ranges),)
        # A span may wait on one of higher index: all of a head's must be resident at
        # once (the grid below launches them together, one CTA an SM).
        if interpret is False and spans > sm_count():
            raise ValueError(
                f"rotated_adds needs a head's {spans} key spans resident at once, at most "
                f"the GPU's {sm_count()} SMs: fewer keys, or rotated_adds=False"
            )
    # The launch order is the grid's last axis fastest: with rotated_adds a head's
    # spans come one after another, else its spans of each batch element.
    grid, grid_names = (K, spans, B), ("heads", "kv_tiles", "batch")
    if config.rotated_adds:
        grid, grid_names = (B, K, spans), ("batch", "heads", "kv_tiles")
    out_type = [
        jax.ShapeDtypeStruct((B, s_pad, K, hp), k.dtype),
        jax.ShapeDtypeStruct((B, s_pad, K, hp), v.dtype),
    ]
    if fused:  # the float32 dQ the ordered adds build
        out_type.append(jax.ShapeDtypeStruct((B, t_pad, N, hp), jnp.float32))
    interpreted = interpret is not False
    outs = plgpu.kernel(
        functools.partial(
            _dkdv_kernel,
            spec=spec,
            scale=scale,
            config=config,
            group=N // K,
            with_segs=with_segs,
            interpret=interpreted,
            semaphores=(B, N, num_q_tiles) if fused else None,
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
    )(q_len, kv_len, ranges, *inputs, *order)
    dk, dv = outs[:2]
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
            _dq_kernel,
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
            # split_dq: Q and dO as two column halves (_split_dq_consumer)
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

"""The backward's dQ kernel for Hopper (the pair's second kernel): a CTA owns query
tiles, the producer streams K and V, each consumer recomputes S and dP and accumulates
dQ += dS K (FlashAttention-2's backward, Dao, 2023, Algorithm 2, on FlashAttention-3's
producer-consumer schedule). `split_dq_consumer`: its two warpgroups on one query tile,
each with half of Q's and dO's head-dim columns. mosaic/backward.py's module doc
describes the algorithm; `backward` there builds the grid and calls this."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash import masks
from pallas_flash.logits import LOG2E
from pallas_flash.mosaic.bwd_config import MosaicBwdConfig
from pallas_flash.mosaic.config import (
    CONSUMER_REGISTERS,
    PRODUCER_REGISTERS,
    SOLO_CONSUMER_REGISTERS,
)
from pallas_flash.mosaic.pipeline import (
    COL,
    ROW,
    PingPong,
    accumulate,
    bcast,
    element_mask,
    held_zero,
    start_from,
    stream_kv_tiles,
    wgmma_products,
)


def row_probs(s, lse2, c, *, masked: bool, mask_args, q_segs=None, k_seg_ref=None):
    """P = exp2(S c - lse2) [bq, bk] (float32) of scores S with the queries on the rows
    (the dQ kernels), zero where the mask drops an element when the tile is `masked`.
    `mask_args` (spec, the kernel's config, first row, (key tile index, keys a tile),
    kv_len, diagonal offset) go to `element_mask`; with segment ids, `q_segs` [bq] are the rows'
    and `k_seg_ref` the key tile's ids in shared memory."""
    shape = s.shape
    p = jnp.exp2(s * c - bcast(lse2, shape, 0))
    if not masked:
        return p
    spec, config, q0, (j, bk), kv_len, diag = mask_args
    keys = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    segs = None
    if q_segs is not None:  # (query ids, key ids), both [bq, bk]
        k_segs = plgpu.load(k_seg_ref, layout=COL)  # [bk]
        segs = (bcast(q_segs, shape, 0), bcast(k_segs, shape, 1))
    keep = element_mask(
        spec, config.row_bound_mask, q0, keys, j * bk, kv_len, diag, 0, segs,
        column_blocks=config.column_blocks,
    )  # fmt: skip
    return jnp.where(keep, p, 0.0)


def dq_kernel(
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
                    split_dq_consumer,
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
        zero = held_zero(config.held_zero)  # fresh accumulators' zeros
        # dq_pingpong: a turn is dS K of one tile and S, dP of the next (the forward's
        # P V and next Q K^T); turns None: every hand-over is a no-op.
        pingpong = PingPong(turns, wg, named=named_turns)

        def body(j, dq, *, masked: bool):
            slot = slot_of(j)
            k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.barrier_wait(v_ready.at[slot])
            pairs = [
                (q_a, k_tile.transpose((1, 0))),  # s = q @ k.T: [bq, bk]
                (do_a, v_tile.transpose((1, 0))),  # dp = do @ v.T: [bq, bk]
            ]
            probs = functools.partial(
                row_probs,
                lse2=lse2,
                c=c,
                masked=masked,
                mask_args=(spec, config, q0, (j, bk), kv_len, diag),
                q_segs=q_segs,
                k_seg_ref=None if q_segs is None else kv_seg_smem.at[slot],
            )
            early = config.probs_before_dp  # the exp2 beside dP
            s_or_p, dp = wgmma_products(
                pairs,
                shape,
                after_issue=pingpong.meet,  # ours are issued: the other may issue its own
                zero=zero,
                first=probs if early else None,
            )
            plgpu.barrier_arrive(v_free.at[slot])
            p = s_or_p if early else probs(s_or_p)
            ds = (p * (dp - bcast(delta, shape, 0))).astype(dtype)  # [bq, bk]
            pingpong.elementwise_done()
            pingpong.my_turn()  # our turn: dS K, then the next tile's S and dP
            (dq,) = accumulate([(dq, ds, k_tile)], staging)  # dq += ds @ k
            plgpu.barrier_arrive(k_free.at[slot])
            return dq

        plgpu.barrier_wait(q_ready.at[wg])
        q_a, do_a = q_tile, do_tile  # the A operands of S and dP
        if config.q_do_in_registers:  # loaded once, read from registers in every step
            q_a, do_a = (plgpu.load(x, layout=plgpu.Layout.WGMMA) for x in (q_tile, do_tile))
        lse2 = plgpu.load(lse_smem.at[wg], layout=ROW)  # [bq], base 2, +inf if empty
        delta = plgpu.load(delta_smem.at[wg], layout=ROW)  # [bq]
        q_segs = None  # [bq]: the rows' ids, with segment ids
        if q_seg_ref is not None:
            q_segs = plgpu.load(q_seg_smem.at[wg], layout=ROW)
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


def split_dq_consumer(
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
    zero = held_zero(config.held_zero)  # fresh accumulators' zeros
    if w == 0:
        lse2 = plgpu.load(lse_smem.at[0], layout=ROW)  # [bq], base 2, +inf if empty
        q_segs = None
        if q_seg_ref is not None:
            q_segs = plgpu.load(q_seg_smem.at[0], layout=ROW)
    else:
        delta = plgpu.load(delta_smem.at[0], layout=ROW)  # [bq]

    def probs(s_, j, masked: bool):
        """P [bq, bk] (float32) of key tile j's scores S, masked where the tile needs it."""
        return row_probs(
            s_,
            lse2,
            c,
            masked=masked,
            mask_args=(spec, config, q0, (j, bk), kv_len, diag),
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
        ds = (p * (dp - bcast(delta, shape, 0))).astype(dtype)  # [bq, bk]

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
                    start_from(zero, s_ref)
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
            start_from(zero, dp_ref)

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

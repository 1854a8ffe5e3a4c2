"""The backward's dK/dV kernel for Hopper, and the fused kernel (`MosaicBwdConfig.fused`),
which also computes each visited query tile's dQ share and adds it in a fixed order
(mosaic/dq_adds.py): FlashAttention-2's backward (Dao, 2023, Algorithm 2) with a CTA
per key span, on FlashAttention-3's producer-consumer schedule (Shah et al., 2024,
Appendix B.1). mosaic/backward.py's module doc describes the algorithm, the masks and
what GPU interpret mode runs; `backward` there builds the grid and calls this."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash import masks
from pallas_flash.logits import LOG2E
from pallas_flash.mosaic import dq_adds, split_tail
from pallas_flash.mosaic.bwd_config import MosaicBwdConfig
from pallas_flash.mosaic.config import (
    CONSUMER_REGISTERS,
    FUSED_SIDE_REGISTERS,
    PRODUCER_REGISTERS,
    WARP_WRITER_CONSUMER_REGISTERS,
)
from pallas_flash.mosaic.pipeline import (
    COL,
    ROW,
    accumulate,
    bcast,
    element_mask,
    held_zero,
    piece_range,
    start_from,
    wgmma_products,
    zeros_from,
)


def dkdv_kernel(
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
    band: int,
    spans: int,
    tail: tuple[int, int] | None = None,
):
    # After the nine inputs above: the segment ids ([B, T], [B, S]) when given, the
    # fused kernel's order tables, split_tail's pieces ([pieces, 3]); then the outputs
    # dK, dV (and the float32 dQ; and split_tail's pieces' float32 dK, dV).
    refs = list(refs)
    q_seg_ref, kv_seg_ref = (refs.pop(0), refs.pop(0)) if with_segs else (None, None)
    rotated = config.rotated_adds  # its walks upward
    # The rotated walk where no mask cuts the spans (not with high_spans_first): the
    # order tables, then the rotation table.
    ring = config.rotated_ring
    order_refs = tuple(refs.pop(0) for _ in range(3 + ring)) if config.fused else None
    pieces_ref = refs.pop(0) if tail else None
    piece_refs = (refs.pop(), refs.pop())[::-1] if tail else None  # (dK, dV)
    dk_ref, dv_ref, *dq_acc_ref = refs
    bq, bk, stages = config.block_q_dkv, config.block_kv_dkv, config.num_stages_dkv
    consumers, tiles = config.consumers_dkv, config.key_tiles_dkv
    dtype = q_smem.dtype
    in_tail = piece = None
    if tail:  # split_tail's grid (backward.py): the whole CTAs in launch order, then pieces
        whole, batch = tail
        cta = lax.axis_index("cta")
        in_tail = cta >= whole
        piece = jnp.maximum(cta - whole, 0)
        item = jnp.where(in_tail, pieces_ref[piece, 0], cta)
        b, kv_head, span = split_tail.kernel_span_coords(item, spans, batch, band)
    else:
        b = lax.axis_index("batch")
        if band > 1:  # span_band's grid (backward.py)
            kv_head = lax.axis_index("head_bands") * band + lax.axis_index("band_heads")
        else:
            kv_head = lax.axis_index("heads")
        span = lax.axis_index("kv_tiles")  # with dkdv_q_multicast, a cluster of two spans
        if config.high_spans_first:  # the grid's span axis from the last span down
            span = jnp.int32(spans - 1) - span
    wg = lax.axis_index("wg")
    # The query tiles this CTA walks: its own key span's, or its cluster's (both spans').
    lo, full_lo, full_hi, hi = (ranges_ref[b, span, c] for c in range(4))
    if tail:  # a piece walks its own query tiles of them (the masked ones kept masked)
        first, end = pieces_ref[piece, 1], pieces_ref[piece, 2]
        bounds = (lo, full_lo, full_hi, hi)
        lo, full_lo, full_hi, hi = piece_range(bounds, first, end, in_tail)
    if config.dkdv_q_multicast:
        span = span * 2 + lax.axis_index("cluster")
    n = hi - lo  # query tiles per query head of the group
    k0 = span * tiles * bk  # first key of the CTA

    # The fused kernel walks each head's query tiles from the last down: every CTA
    # of a key/value head then reaches a query tile after as many steps as the CTAs
    # before it (their ranges end at or before its own), so the ordered dQ adds of
    # neighbouring CTAs come due together instead of waiting on each other's tails.
    # With rotated_adds it walks them upward, its unmasked tiles rotated by its index
    # where every span has one range (`rot`; dq_adds.turn says why), but with
    # high_spans_first plainly (no ring: no rotation arithmetic in the steps).
    rot = dq_adds.rotation(order_refs, b, order_refs[0][b, span])[2] if ring else 0

    def step_of(g, i):
        if ring:
            return g * n + dq_adds.walk_place(i, lo, full_lo, full_hi, rot)
        return g * n + (hi - 1 - i if config.fused and not rotated else i - lo)

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
            carry = each_tile(start, stop, part, carry, turned=ring and not masked)
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

            if ring:  # the consumers' order, segment by segment
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
    pieces = config.share_pieces(k_smem.shape[-1]) if config.fused else 1
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
            descending=config.high_spans_first,
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
        zero = held_zero(config.held_zero)  # fresh accumulators' zeros

        def step_lse(slot, query_dim: int = 1):
            """The step's lse (base 2, +inf where a query row is empty), one value per
            query: [bq], laid along the tile's query dimension."""
            return plgpu.load(lse_smem.at[slot], layout=COL if query_dim == 1 else ROW)

        def early_lse(slot, query_dim: int = 1):
            """The step's lse read before its scores' wgmma is issued (`config.early_lse`),
            so that the read's latency runs beside the wgmma; else None (`probs` reads
            it, after the scores are awaited)."""
            return step_lse(slot, query_dim) if config.early_lse else None

        def probs(s_t, i, slot, masked: bool, query_dim: int = 1, lse2=None):
            """P^T [bk, bq] (float32) of the step's scores S^T, masked where the tile needs
            it; with `query_dim` 0, P [bq, bk] of S (`query_rows`). `lse2`: the step's
            lse if already read (early_lse)."""
            layout = COL if query_dim == 1 else ROW  # one value per query
            tile_shape, key_dim = s_t.shape, 1 - query_dim
            if lse2 is None:
                lse2 = step_lse(slot, query_dim)
            p_t = jnp.exp2(s_t * c - bcast(lse2, tile_shape, query_dim))
            if not masked:  # the structural masks cut this tile (full tiles skip this work)
                return p_t
            keys = plgpu.broadcasted_iota(jnp.int32, tile_shape, key_dim, layout=plgpu.Layout.WGMMA)
            segs = None
            if q_seg_ref is not None:  # (query ids, key ids), both tile-shaped
                q_segs = plgpu.load(q_seg_smem.at[slot], layout=layout)  # [bq]
                segs = (bcast(q_segs, tile_shape, query_dim), bcast(k_segs, tile_shape, key_dim))
            keep = element_mask(
                spec, config.row_bound_mask, i * bq, keys, kw0, kv_len, diag, query_dim, segs
            )
            return jnp.where(keep, p_t, 0.0)

        def dscores(p_t, dp_t, slot, query_dim: int = 1):
            """dS^T = P^T (dP^T - D) (or, with `query_dim` 0, dS), in the inputs' dtype."""
            layout = COL if query_dim == 1 else ROW
            delta = plgpu.load(delta_smem.at[slot], layout=layout)  # [bq]
            return (p_t * (dp_t - bcast(delta, p_t.shape, query_dim))).astype(dtype)

        def fa3_step(i, carry, *, step, slot, q_tile, do_tile, k_tile, v_tile, z, masked: bool):
            """One fused step in FlashAttention-3's order (`MosaicBwdConfig.fa3_order`):
            S^T and dP^T issued together, the exp2 beside dP^T; then dV, with dS^T stored
            and exchanged while it runs; the share and dK queued behind it, and the share
            handed over while dK runs. Nothing is awaited that the next issue does not
            need."""

            def scores(s_ref, dp_ref):
                lse2 = early_lse(slot)
                start_from(zero, s_ref, dp_ref)
                plgpu.wgmma(s_ref, k_tile, q_tile.transpose((1, 0)))  # s^T = k @ q.T
                plgpu.wgmma(dp_ref, v_tile, do_tile.transpose((1, 0)))  # dp^T = v @ do.T
                # wgmma groups complete in order: S^T is in, dP^T runs beside the exp2.
                s_t = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)
                p_t = probs(s_t, i, slot, masked, lse2=lse2)
                return p_t.astype(dtype), dscores(p_t, dp_ref[...], slot)

            p_t, ds_t = pl.run_scoped(scores, *(plgpu.ACC(shape, jnp.float32),) * 2)
            if config.chained_share:
                return chained_fa3_products(carry, step, slot, q_tile, do_tile, z, p_t, ds_t)
            piece = dq_adds.piece_shape(part, pieces)
            share0 = zeros_from(piece, zero)
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
                        start_from(zero, acc_ref)
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
            lse2 = early_lse(slot, query_dim=0)
            s_, dp = wgmma_products([(q_tile, k_tile.transpose((1, 0))),
                                (do_tile, v_tile.transpose((1, 0)))], rshape)  # fmt: skip
            p = probs(s_, i, slot, masked, query_dim=0, lse2=lse2)

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
                (pv,) = wgmma_products([(tile().transpose((1, 0)), do_tile)], carry[0].shape)
                tile()[...] = dscores(p, dp, slot, query_dim=0)
                plgpu.commit_smem()
                plgpu.barrier_arrive(fused_scratch["ds_ready"])
                (sq,) = wgmma_products([(tile().transpose((1, 0)), q_tile)], carry[1].shape)
                dv, dk = carry[0] + pv, carry[1] + sq
            plgpu.barrier_arrive(free.at[slot])
            dq_adds.dq_share(fused_scratch, step, w, k_smem, part, z, query_rows=True, zero=zero)
            return dv, dk

        def shared_probs_step(i, carry, *, step, slot, q_tile, do_tile, k_tile, v_tile, masked):
            """One split step with P^T handed over (`MosaicBwdConfig.share_probs`): the dV
            warpgroup computes S^T and P^T, stores P^T (float32) for the dK warpgroup and
            accumulates dV; the dK warpgroup computes dP^T meanwhile, then reads P^T
            (the same values it would have recomputed) for dS^T and dK."""
            tile, ready, free_ = (probs_scratch[x] for x in ("tile", "ready", "free"))
            if does_dv:
                lse2 = early_lse(slot)
                (s_t,) = wgmma_products(
                    [(k_tile, q_tile.transpose((1, 0)))], shape
                )  # s^T = k @ q.T
                p_t = probs(s_t, i, slot, masked, lse2=lse2)

                @pl.when(step > 0)  # the dK warpgroup has read the last step's P^T
                def _():
                    plgpu.barrier_wait(free_)

                tile[...] = p_t
                plgpu.barrier_arrive(ready)
                return tuple(accumulate([(carry[0], p_t.astype(dtype), do_tile)], staging))
            (dp_t,) = wgmma_products(
                [(v_tile, do_tile.transpose((1, 0)))], shape
            )  # dp^T = v @ do.T
            plgpu.barrier_wait(ready)
            p_t = plgpu.load(tile, layout=plgpu.Layout.WGMMA)
            plgpu.barrier_arrive(free_)
            ds_t = dscores(p_t, dp_t, slot)
            return tuple(accumulate([(carry[-1], ds_t, q_tile)], staging))

        def step_operands(step):
            """This step's K and V tiles, and the index offset `z` (0) of the buffers that
            stay in place. With `config.step_descriptors` they are addressed through
            `z`, which is 0 (steps count from 0) but not to the compiler, so each step
            builds their wgmma descriptors anew instead of holding them all across the
            loop (where the fused kernel spilled them, docs/mosaic.md)."""
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
            lse2 = early_lse(slot)  # before the scores' wgmma is issued
            probs_of = functools.partial(probs, i=i, slot=slot, masked=masked, lse2=lse2)
            early = config.probs_before_dp and does_dk  # the exp2 beside dP^T
            products = wgmma_products(pairs, shape, zero=zero, first=probs_of if early else None)
            p_t = products[0] if early else probs_of(products[0])
            terms = []
            if does_dv:
                terms.append((carry[0], p_t.astype(dtype), do_tile))  # dv += p^T @ do: [bk, hp]
            if does_dk:
                ds_t = dscores(p_t, products[1], slot)
                terms.append((carry[-1], ds_t, q_tile))  # dk += ds^T @ q: [bk, hp]
                if config.fused and not config.chained_share:
                    # the other consumers' dQ slices read this tile's dS^T
                    dq_adds.share_ds(fused_scratch, step, w, ds_t)
            carry = tuple(accumulate(terms, staging))
            plgpu.barrier_arrive(free.at[slot])
            if config.chained_share:
                staged = staging is not None
                dq_adds.chained_share(fused_scratch, step, w, k_smem, part, ds_t, z, staged)
            elif config.fused:
                dq_adds.dq_share(fused_scratch, step, w, k_smem, part, z, pieces=pieces, zero=zero)
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
            k_segs = plgpu.load(kv_seg_smem.at[t], layout=COL if config.query_rows else ROW)
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
            outs.append((v_tile, accs[0], dv_ref, 1))
        if does_dk:
            outs.append((k_tile, accs[-1] * scale, dk_ref, 0))  # dS was of the scaled scores

        def store():
            for tile, acc, _, _ in outs:
                tile[...] = acc.astype(dtype)
            plgpu.commit_smem()
            for tile, _, ref, _ in outs:
                plgpu.copy_smem_to_gmem(tile, ref.at[b, pl.ds(kw0, bk), kv_head])

        def store_piece():  # split_tail: float32 partials from registers, summed later
            for _, acc, _, which in outs:
                piece_refs[which].at[piece, pl.ds(t * bk, bk)][...] = acc

        if tail:
            pl.when(jnp.logical_not(in_tail))(store)
            pl.when(in_tail)(store_piece)
        else:
            store()
        # The CTA ends: the tiles only have to be read out (fwd_kernel.py's epilogue says why).
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    if config.split_dkv:
        pl.when(wg == 0)(functools.partial(consumer, 0, True, False))
        pl.when(wg == 1)(functools.partial(consumer, 1, False, True))
    elif config.fused:  # static warpgroup indices: each slices K and dS^T at its own offset
        for w in range(consumers):
            pl.when(wg == w)(functools.partial(consumer, w, True, True))
    else:
        pl.when(wg < consumers)(functools.partial(consumer, wg, True, True))

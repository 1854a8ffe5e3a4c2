"""The forward kernel for Hopper: a CTA's walk over its work items (one, or with the
persistent grid one SM's share), on FlashAttention-3's producer-consumer schedule.
mosaic/forward.py's module doc describes the algorithm, the masks and what GPU interpret
mode runs; `forward` there pads the inputs, builds the grid and calls this."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash import masks
from pallas_flash.logits import LN2, LOG2E
from pallas_flash.mosaic.config import (
    CONSUMER_REGISTERS,
    NAMED_FREE,
    PRODUCER_REGISTERS,
    ROW_SUM_COLS,
    SWIZZLE,
    THREE_CONSUMER_REGISTERS,
    THREE_PRODUCER_REGISTERS,
    MosaicConfig,
)
from pallas_flash.mosaic.pipeline import (
    COL,
    ORDER_COLS,
    ROW,
    NamedSlots,
    PingPong,
    drain_ring,
    element_mask,
    head_rounds_coords,
    lax_divmod,
    persistent_item,
    persistent_item_count,
    piece_range,
    release_slot,
    stream_kv_tiles,
)
from pallas_flash.mosaic.softmax import online_softmax, warp_any
from pallas_flash.mosaic.split_tail import PIECE_COLS, merge_pair

# row_sum_wgmma: the keys of P each wgmma with the ones takes (a 128-byte swizzle's).
ONES_KEYS = 64


def walks_own_keys(config: MosaicConfig, spec: masks.MaskSpec) -> bool:
    """Whether each CTA of a kv_multicast cluster walks its own tile's key tiles among its
    pair's, passing the others' slots on (MosaicConfig.multicast_own_keys): where a mask
    bounds the keys by row (causal, a window) or by document (segment ids), so that the
    two tiles' ranges differ. Without one they differ only past q_len, whose rows are
    cut; the table of key ranges then has the pairs' alone (forward.py)."""
    bounded = spec.left is not None or spec.right is not None or spec.segments
    return config.kv_multicast and config.multicast_own_keys and bounded


def fwd_kernel(
    q_len_ref,
    kv_len_ref,
    ranges_ref,
    q_ref,
    k_ref,
    v_ref,
    *refs,
    qo_smem,
    k_smem,
    v_smem,
    p_smem,
    lse_smem,
    ones_smem,
    q_seg_smem,
    kv_seg_smem,
    q_ready,
    k_ready,
    v_ready,
    k_free,
    v_free,
    turns,
    o_smem,
    spec: masks.MaskSpec,
    scale: float,
    config: MosaicConfig,
    num_q_tiles: int,
    group: int,
    heads: int,
    batch: int,
    num_ctas: int,
    compiled: bool,
    tail_rounds: int | None = None,
    fixup_items: int = 0,
    head_rounds: bool = False,
):
    # With segment ids, their [B, T] and [B, S] arrays come before the outputs; with
    # split_tail (`tail_rounds`: the whole rounds), the pieces' table [P, 2, 7] comes
    # last of the inputs, and the pieces' O and logsumexp last of the outputs ([P, 2,
    # rows(, H)], or with tail_fixup, `fixup_items` > 0: [split items, pieces - 1,
    # rows(, H)], those of the pieces after each item's first, which merges them; with
    # kv_multicast P and the split items count tiles, two a cluster or item); with
    # `head_rounds`, the items' order (pipeline.head_rounds_order: [items], or with
    # order_ranges [items, 8], pipeline.order_rows, or with greedy_items the per-CTA
    # lists of pipeline.greedy_items_order) is the last input.
    refs = list(refs)
    piece_o_ref, piece_lse_ref = (refs.pop(-2), refs.pop()) if tail_rounds else (None, None)
    o_ref, lse_ref = refs.pop(-2), refs.pop()
    order_ref = refs.pop() if head_rounds else None
    pieces_ref = refs.pop() if tail_rounds else None
    q_seg_ref, kv_seg_ref = refs if refs else (None, None)
    block_q, block_kv, stages = config.block_q, config.block_kv, config.num_stages
    if config.named_releases:  # the slot releases on hardware named barriers instead
        k_free, v_free = NamedSlots(NAMED_FREE), NamedSlots(NAMED_FREE + stages)
    head_dim = qo_smem.shape[-1]
    dtype = qo_smem.dtype
    wg = lax.axis_index("wg")
    # kv_multicast: an item is a pair of adjacent query tiles, walked by a cluster of two
    # (a tile each), and a persistent grid's `num_ctas` counts clusters.
    units = num_q_tiles // 2 if config.kv_multicast else num_q_tiles  # an item's: tiles or pairs
    num_items = heads * units * batch
    # tail_fixup: per split item (own(): per tile of one, with kv_multicast) and consumer,
    # the count of its later pieces stored (a global semaphore, zeroed before each call);
    # the item's first piece awaits them.
    sems = (
        pl.get_global(plgpu.SemaphoreType.REGULAR((fixup_items, config.consumers)))
        if fixup_items
        else None
    )

    def item_index(i):
        cta = lax.axis_index("cta")
        if not tail_rounds:
            return persistent_item(cta, i, num_ctas, snake=spec.causal)
        # split_tail: after the whole rounds, this CTA's pieces of the last round's items
        whole = persistent_item(cta, jnp.minimum(i, tail_rounds - 1), num_ctas, snake=spec.causal)
        return jnp.where(i < tail_rounds, whole, piece_col(i, "item"))

    def piece_of(i):  # split_tail: item i's piece of this CTA (0 in the whole rounds)
        return jnp.clip(i - tail_rounds, 0, 1)

    def piece_col(i, name):  # split_tail: a column (PIECE_COLS) of item i's piece
        return pieces_ref[lax.axis_index("cta"), piece_of(i), PIECE_COLS.index(name)]

    def own(index):
        """This CTA's row of a pair's two (kv_multicast: the cluster's first CTA's, then its
        second's): its query tile of pair `index`, or its row of a split_tail piece's
        outputs and semaphores, kept per tile; else `index` itself."""
        if not config.kv_multicast:
            return index
        return index * 2 + lax.axis_index("cluster")

    # order_ranges: the table's rows carry each item's key range and lengths (ORDER_COLS).
    order_rows = order_ref is not None and config.order_ranges

    def order_row(i):  # head_rounds: this CTA's item i's entry (row) of the order table
        cta = lax.axis_index("cta")
        if config.greedy_items:  # pipeline.greedy_items_order: the counts, then the items
            return (i + 1) * num_ctas + cta
        return persistent_item(cta, i, num_ctas, snake=True)

    def lengths(i, b):  # (q_len, kv_len) of item i, in batch element b
        if not order_rows:
            return q_len_ref[b], kv_len_ref[b]
        row = order_row(i)
        return tuple(order_ref[row, ORDER_COLS.index(name)] for name in ("q_len", "kv_len"))

    def key_range(i, b, tile, ends_only: bool = False, own: bool = False):
        """(lo, full_lo, full_hi, hi): the key tiles item i walks, the masked ones below
        full_lo and from full_hi; a split_tail piece's are its own keys among them.
        `ends_only` (the producer's): (lo, hi), the other two not read. With kv_multicast
        the item's are its pair's, and `own` gives this CTA's tile's among them (where
        walks_own_keys: the table's columns 4-7 of the pair's first tile, 8-11 of its
        second)."""
        cols = (0, 3) if ends_only else range(4)
        if order_rows and not own:  # from the item's row of the table, read with its index
            return tuple(order_ref[order_row(i), ORDER_COLS.index("lo") + c] for c in cols)
        row = range_row(tile)
        first_col = 4 + 4 * lax.rem(tile, jnp.int32(2)) if own else 0
        bounds = tuple(ranges_ref[b, row, first_col + c] for c in cols)
        if not tail_rounds:
            return bounds
        first, end = piece_col(i, "first"), piece_col(i, "end")
        return piece_range(bounds, first, end, i >= tail_rounds)

    def item_at(i):
        """(batch, head, query tile) of this CTA's work item i. Causal tiles near the
        bottom do the most work: they come first, so that the last ones are short. With
        kv_multicast an item is a pair of adjacent tiles, a cluster's, one tile a CTA:
        the orders below hand out pairs."""
        if not config.persistent:  # one item per CTA (or cluster): its grid position
            b, h, t = (lax.axis_index(name) for name in ("batch", "heads", "q_tiles"))
        elif order_ref is not None:  # head_rounds: head order, from the table
            w = order_ref[order_row(i), 0] if order_rows else order_ref[order_row(i)]
            b, h, u = head_rounds_coords(w, heads, units, divmod=lax_divmod)
            return b, h, own(u)
        else:
            w = item_index(i)
            if spec.causal:  # tile-major: every (batch, head)'s bottom tile first
                t, rest = lax.div(w, heads * batch), lax.rem(w, heads * batch)
                h, b = lax.div(rest, batch), lax.rem(rest, batch)
            else:  # one (batch, head)'s tiles together: they share K and V in L2
                rest, t = lax.div(w, units), lax.rem(w, units)
                b, h = lax.div(rest, heads), lax.rem(rest, heads)
        return b, h, own((units - 1 - t) if spec.causal else t)

    def range_row(tile):
        """The row of `ranges_ref` with the key tiles of query tile `tile`: with
        kv_multicast, one row per cluster (both tiles' keys), since the two CTAs must
        walk the same key tiles, which each loads half of for both."""
        return lax.div(tile, jnp.int32(2)) if config.kv_multicast else tile

    def item_count():  # this CTA's work items
        if not config.persistent:
            return 1
        cta = lax.axis_index("cta")
        if tail_rounds:  # the whole rounds, then this CTA's pieces of the last one
            exists = PIECE_COLS.index("exists")
            return tail_rounds + pieces_ref[cta, 0, exists] + pieces_ref[cta, 1, exists]
        if order_ref is not None and config.greedy_items:  # the list schedule's count
            return order_ref[cta]
        return persistent_item_count(cta, num_items, num_ctas, snake=spec.causal)

    def run_items(fn):
        """fn(i, base) over this CTA's items, base threading the ring position."""
        if not config.persistent:
            return fn(0, 0)
        return lax.fori_loop(0, item_count(), fn, jnp.int32(0))

    consumers = config.consumers
    producer = consumers  # the producer is the last warpgroup
    producer_regs, consumer_regs = (
        (PRODUCER_REGISTERS, CONSUMER_REGISTERS)
        if consumers == 2
        else (THREE_PRODUCER_REGISTERS, THREE_CONSUMER_REGISTERS)
    )

    @pl.when(wg == producer)
    def _producer():
        plgpu.set_max_registers(producer_regs, action="decrease")

        def produce(i, base):
            b, h, tile = item_at(i)
            kv_head = lax.div(h, jnp.int32(group))
            lo, hi = key_range(i, b, tile, ends_only=True)
            return stream_kv_tiles(
                (k_ref, v_ref, kv_seg_ref),
                (k_smem, v_smem, kv_seg_smem),
                (k_ready, v_ready, k_free, v_free),
                b=b,
                kv_head=kv_head,
                lo=lo,
                hi=hi,
                block_kv=block_kv,
                base=base,
                drain=False,
                multicast=config.kv_multicast,
            )

        drain_ring((k_free, v_free), run_items(produce), stages)

    @pl.when(wg < producer)
    def _consumer():
        plgpu.set_max_registers(consumer_regs, action="increase")

        def load_q(i):  # item i's Q rows of this consumer (and their segment ids)
            b, h, tile = item_at(i)
            q0 = (tile * consumers + wg) * block_q
            plgpu.copy_gmem_to_smem(
                q_ref.at[b, pl.ds(q0, block_q), h], qo_smem.at[wg], q_ready.at[wg]
            )
            if q_seg_ref is not None:  # the rows' segment ids travel with Q
                plgpu.copy_gmem_to_smem(
                    q_seg_ref.at[b, pl.ds(q0, block_q)], q_seg_smem.at[wg], q_ready.at[wg]
                )

        load_q(0)
        count = item_count()
        if config.row_sum_wgmma:  # the ones P is multiplied by, for its row sums
            shape, ones_dtype = ones_smem.shape[1:], ones_smem.dtype
            layout = plgpu.Layout.SMEM_GMEM_COPY(shape, ones_dtype, SWIZZLE)
            ones_smem.at[wg][...] = plgpu.layout_cast(jnp.ones(shape, ones_dtype), layout)
            plgpu.commit_smem()  # visible to the wgmmas' async reads

        def consume(i, base):
            b, h, tile = item_at(i)
            lo, full_lo, full_hi, hi = key_range(i, b, tile)
            first = lo  # the first tile streamed, at ring position base

            def slot_of(j):  # key tile j is at ring position base + j - first
                return lax.rem(base + j - first, jnp.int32(stages))

            own_keys = walks_own_keys(config, spec)

            def streamed_end():  # the end of the tiles streamed (the pair's, own_keys)
                return key_range(i, b, tile, ends_only=True)[1] if own_keys else hi

            def pass_tiles(start, stop):
                """own_keys: tiles start .. stop - 1 of the pair's that this CTA's rows
                do not see: awaited (each barrier phase is waited once) and released, so
                that the producers can refill their slots."""

                def pass_tile(j, _):
                    slot = slot_of(j)
                    for ready, free in ((k_ready, k_free), (v_ready, v_free)):
                        plgpu.barrier_wait(ready.at[slot])
                        release_slot(free, slot)

                lax.fori_loop(start, stop, pass_tile, None)

            if own_keys:  # this tile's own key tiles (within its pair's) walked
                end = hi  # (read again where the pair's last tiles pass: fewer live registers)
                lo, full_lo, full_hi, hi = key_range(i, b, tile, own=True)
                lo = jnp.minimum(jnp.maximum(lo, first), jnp.maximum(end, first))
                hi = jnp.minimum(jnp.maximum(hi, lo), jnp.maximum(end, lo))
                full_lo = jnp.minimum(jnp.maximum(full_lo, lo), hi)
                full_hi = jnp.minimum(jnp.maximum(full_hi, full_lo), hi)
                pass_tiles(first, lo)

            q0 = (tile * consumers + wg) * block_q
            q_smem = qo_smem.at[wg]
            # O goes out through Q's buffer, or (persistent) one of its own, so that the
            # next item's Q can load while this O is stored.
            out_smem = q_smem if o_smem is None else o_smem.at[wg]
            q_len, kv_len = lengths(i, b)
            # Top-left alignment: the literal 0, not a traced zero, which `pl.run_state`
            # (intra_overlap) cannot close over in Mosaic GPU's lowering.
            diag = masks.offset(spec, q_len, kv_len) if spec.uses_offset else 0
            c = scale * LOG2E  # base-2 scores: log2(e) folded into the scale
            # The softmax's options; compiled, exp2_poly and the warp vote as PTX.
            softmax = functools.partial(
                online_softmax,
                poly_cols=config.poly_exp2_cols,
                ptx=compiled,
                slack=config.rescale_slack,
                row_sum=not config.row_sum_wgmma,
            )

            pingpong = PingPong(turns, wg, named=config.named_turns, consumers=consumers)

            def wait_next_k(j):  # early_k_wait: K of tile j + 1, while tile j's P V runs
                @pl.when(j + 1 < hi)
                def _():
                    plgpu.barrier_wait(k_ready.at[slot_of(j + 1)])

            def release_k(j, slot, shape, masked: bool):
                """Frees K slot `slot` (tile j's scores are in registers) and returns tile j's
                element mask, or None for a tile every row sees in full. A boundary tile's
                key segment ids are read first: they share the slot's barriers."""
                segs = None
                if masked and q_seg_ref is not None:
                    segs = (
                        lax.broadcast_in_dim(q_segs, shape, [0]),
                        lax.broadcast_in_dim(
                            plgpu.load(kv_seg_smem.at[slot], layout=COL), shape, [1]
                        ),
                    )
                release_slot(k_free, slot)
                if not masked:
                    return None
                cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
                return element_mask(
                    spec, config.row_bound_mask, q0, cols, j * block_kv, kv_len, diag, 0, segs,
                    column_blocks=config.column_blocks,
                )  # [block_q, block_kv]  # fmt: skip

            def issue_qk(s_ref, slot):  # Q K^T of the K tile in `slot`, issued
                k_tile = k_smem.at[slot]
                if q_regs is None:
                    plgpu.wgmma(s_ref, q_smem, k_tile.transpose((1, 0)))
                    return
                # q_register_cols: Q's first columns from registers, the rest from shared
                # memory, in the order of the contraction, as one wgmma would take them.
                c = config.q_register_cols
                plgpu.wgmma(s_ref, q_regs, k_tile.at[:, pl.ds(0, c)].transpose((1, 0)))
                if c < head_dim:
                    rest = pl.ds(c, head_dim - c)
                    plgpu.wgmma(s_ref, q_smem.at[:, rest], k_tile.at[:, rest].transpose((1, 0)))

            def qk_scores(slot):  # Q K^T of the K tile in `slot` [block_q, block_kv], awaited
                def qk(s_ref):
                    issue_qk(s_ref, slot)
                    pingpong.meet()  # ours are issued: the other consumer may issue its own
                    return s_ref[...]  # waits for this wgmma

                return pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))

            def accumulate_pv(
                acc, p, slot, after_issue=lambda: None, l_acc=None, next_slot=None, s=None
            ):
                """acc + P V of the V tile in `slot` (and, with `l_acc`, l_acc + P times a
                tile of ones: row_sum_wgmma's row sums; then a pair). P in registers (an
                array) accumulates in place; P staged in shared memory (a ref: GPU interpret
                mode's form) goes into fresh accumulators that are added. `after_issue` runs
                while the wgmmas do. With `next_slot` (qk_behind_pv), the Q K^T of the K
                tile there (landed) is issued first and the P V behind it, the other
                consumer met, and all awaited together; returned as (that, the next
                scores) (`s`: this step's scores, whose registers the next ones may take).
                Q K^T goes first so that its accumulator's zeroing is next to its first
                wgmma, which ptxas then folds into it (`RZ, !UPT`); behind P V, or after
                the K wait's branch, ptxas zeroed the 64 registers with 128 moves a step
                at head dim 128."""

                # The row sums: each 64 keys of P times the same [64, 8] of ones, so that
                # the ones' wgmma descriptors are the same four in every step and for every
                # chunk (a [block_kv, 8] tile's sixteen, held across the loop, spilled at
                # head dim 64 with 256-key tiles: 216 bytes).
                def issue(acc_refs, p_chunk):
                    plgpu.wgmma(acc_refs[0], p, v_smem.at[slot])
                    if l_acc is not None:
                        ones = ones_smem.at[wg].at[:, pl.ds(0, ONES_KEYS)].transpose((1, 0))
                        for keys in (pl.ds(c, ONES_KEYS) for c in range(0, block_kv, ONES_KEYS)):
                            plgpu.wgmma(acc_refs[1], p_chunk(keys), ones)
                    after_issue()

                def issue_step(pv_refs, s_ref, p_chunk):
                    """The step's products; with `s_ref` (qk_behind_pv), the next tile's Q
                    K^T first, and the other consumer met once all are issued."""
                    if s_ref is not None:
                        issue_qk(s_ref, next_slot)
                    issue(pv_refs, p_chunk)
                    if s_ref is not None:
                        pingpong.meet()  # ours are issued: the other may issue its own

                accs = (acc,) if l_acc is None else (acc, l_acc)
                scores = () if next_slot is None else (plgpu.ACC((block_q, block_kv), jnp.float32),)
                if config.p_in_registers and next_slot is None:
                    # run_state awaits the wgmmas before returning the accumulators.
                    out = pl.run_state(lambda refs: issue(refs, lambda keys: p[:, keys]))(
                        tuple(plgpu.ACC.init(a) for a in accs)
                    )
                elif config.p_in_registers:

                    def pv_then_qk(refs):  # the last ref carries the next scores out
                        def scoped(s_ref):
                            issue_step(refs[:-1], s_ref, lambda keys: p[:, keys])
                            refs[-1][...] = s_ref[...]  # awaits every wgmma issued

                        pl.run_scoped(scoped, *scores)

                    out = pl.run_state(pv_then_qk)((*(plgpu.ACC.init(a) for a in accs), s))
                else:

                    def pv_fresh(*refs):  # the accumulators' products (and the next scores)
                        s_ref = refs[len(accs)] if scores else None
                        issue_step(refs[: len(accs)], s_ref, lambda keys: p.at[:, keys])
                        return tuple(ref[...] for ref in refs)

                    fresh = [plgpu.ACC(a.shape, jnp.float32) for a in accs]
                    out = pl.run_scoped(pv_fresh, *fresh, *scores)
                    out = [a + d for a, d in zip(accs, out)] + list(out[len(accs) :])
                pv = tuple(out[: len(accs)]) if l_acc is not None else out[0]
                return pv if next_slot is None else (pv, out[-1])

            def body(j, carry, *, masked: bool, chained: bool = False, last: bool = False):
                """Tile j's step. `chained` (qk_behind_pv): its scores came in the carry
                with the last step's P V, and this one's issues tile j + 1's behind its
                own but for the `last` step."""
                slot = slot_of(j)
                if chained:
                    acc, m_i, l_i, s = carry
                else:
                    acc, m_i, l_i = carry
                    if not config.early_k_wait:
                        plgpu.barrier_wait(k_ready.at[slot])
                    s = qk_scores(slot)
                if config.early_q_load and (last or not chained):
                    # Q is read no more (its last Q K^T is awaited): the next item's may load
                    more = i + 1 < count
                    pl.when(more if chained else (j == hi - 1) & more)(lambda: load_q(i + 1))
                keep = release_k(j, slot, s.shape, masked)
                p, m_i, l_i, alpha, rescaled = softmax(
                    s, m_i, l_i, c, keep
                )  # p: [block_q, block_kv]

                def rescale(acc, l_i, p):  # [block_q, head_dim], l_i, and P as the wgmma takes it
                    # row_sum_wgmma: l_i is an accumulator [block_q, 8], rescaled with O.
                    kept = (acc, l_i) if config.row_sum_wgmma else (acc,)

                    def scaled():
                        return tuple(x * lax.broadcast_in_dim(alpha, x.shape, [0]) for x in kept)

                    if rescaled is not None and compiled:  # the warp's flag: skip if unset
                        kept = lax.cond(rescaled, scaled, lambda: kept)
                    else:
                        kept = scaled()
                    if config.row_sum_wgmma:
                        acc, l_i = kept
                    else:
                        (acc,) = kept
                    return acc, l_i, p.astype(dtype)

                if config.rescale_before_turn:
                    acc, l_i, p = rescale(acc, l_i, p)
                    # Keep the compiler from sinking this work past the turn below.
                    acc, p, m_i, l_i = lax.optimization_barrier((acc, p, m_i, l_i))
                pingpong.elementwise_done()  # softmax done: the other may start its own
                plgpu.barrier_wait(v_ready.at[slot])
                if chained and not last:  # the next Q K^T's K, before the turn (j + 1 < hi)
                    plgpu.barrier_wait(k_ready.at[slot_of(j + 1)])
                pingpong.my_turn()  # our turn: P V, then the next Q K^T
                if not config.rescale_before_turn:
                    acc, l_i, p = rescale(acc, l_i, p)
                if not config.p_in_registers:
                    p_smem.at[wg][...] = p
                    plgpu.commit_smem()  # make the stores visible to the wgmma's async reads
                    p = p_smem.at[wg]
                # (chained, the next K was awaited above, or there is none)
                early = config.early_k_wait and not chained
                after = (lambda: wait_next_k(j)) if early else (lambda: None)
                next_slot = slot_of(j + 1) if chained and not last else None
                l_acc = l_i if config.row_sum_wgmma else None
                out = accumulate_pv(acc, p, slot, after, l_acc, next_slot=next_slot, s=s)
                if next_slot is not None:
                    out, s = out
                if config.row_sum_wgmma:
                    acc, l_i = out
                else:
                    acc = out
                release_slot(v_free, slot)
                return (acc, m_i, l_i, s) if chained else (acc, m_i, l_i)

            # intra_overlap: FA3's intra-warpgroup pipelining (Shah et al., 2024, Sec. 3.2).
            # Tile j's Q K^T and tile j - 1's P V are issued together; the softmax of tile j
            # runs while that P V is still on the tensor cores, and the accumulator is
            # rescaled after it: O_j = (O_{j-1} + P_{j-1} V_{j-1}) * alpha_j. A prologue
            # computes tile lo's scores alone and an epilogue the last P V. The turns are
            # taken as in `body` (one after issuing, one around the softmax's end), so the
            # two consumers still ping-pong and take the same number of turns.
            def p_buffer(j):  # P staged in shared memory: two buffers, tile j in (j - lo) % 2
                return p_smem.at[wg, lax.rem(j - lo, jnp.int32(2))]

            def keep_p(p, j):  # P as the next step's P V takes it: registers or its buffer
                if config.p_in_registers:
                    return p.astype(dtype)
                p_buffer(j)[...] = p.astype(dtype)
                plgpu.commit_smem()  # visible to the wgmma's asynchronous reads
                return None

            def first_tile(carry):
                acc, m_i, l_i = carry
                slot = slot_of(lo)
                plgpu.barrier_wait(k_ready.at[slot])
                s = qk_scores(slot)
                # The first tile may be a full one: masking it is exact, and it is one tile.
                p, m_i, l_i, _, _ = softmax(s, m_i, l_i, c, release_k(lo, slot, s.shape, True))
                p = keep_p(p, lo)
                pingpong.elementwise_done()  # softmax done
                return acc, m_i, l_i, p

            def overlapped_body(j, carry, *, masked: bool):
                acc, m_i, l_i, p_prev = carry
                slot, prev = slot_of(j), slot_of(j - 1)
                plgpu.barrier_wait(k_ready.at[slot])
                plgpu.barrier_wait(v_ready.at[prev])
                pingpong.my_turn()  # our turn: Q K^T of j and P V of j - 1

                def scores(s_ref, pv_ref, p_prev):  # issue both, wait for Q K^T only
                    issue_qk(s_ref, slot)
                    plgpu.wgmma(pv_ref, p_prev, v_smem.at[prev])
                    pingpong.meet()
                    # wgmma groups complete in order: at most one in flight is the P V.
                    s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)
                    # with rescale_slack, alpha is 1 on each row the softmax left as it
                    # was (the flag is taken again below, outside the wgmmas' scope)
                    return softmax(s, m_i, l_i, c, release_k(j, slot, s.shape, masked))[:4]

                if config.p_in_registers:

                    def step(refs):  # P V accumulates in place on acc
                        acc_ref, p_ref, m_ref, l_ref, alpha_ref = refs
                        p, m_new, l_new, alpha = pl.run_scoped(
                            lambda s_ref: scores(s_ref, acc_ref, p_ref[...]),
                            plgpu.ACC((block_q, block_kv), jnp.float32),
                        )
                        # Tile j's P takes the registers tile j - 1's P V reads as it
                        # runs (the loop carries them), so it is written only once that
                        # P V is done: ptxas serializes every wgmma of the kernel
                        # (C7513) if a register a wgmma in flight reads is written. The
                        # barrier (no instruction) keeps LLVM from converting P before
                        # the wait, as it did in two of the three loops.
                        plgpu.wgmma_wait(0)
                        p = lax.optimization_barrier(p)
                        p_ref[...], m_ref[...], l_ref[...] = keep_p(p, j), m_new, l_new
                        alpha_ref[...] = alpha
                        pingpong.elementwise_done()  # softmax done

                    # run_state awaits the P V before returning the accumulator; the refs
                    # after it carry the softmax's results out (alpha's starts as m_i).
                    acc, p, m_i, l_i, alpha = pl.run_state(step)(
                        (plgpu.ACC.init(acc), p_prev, m_i, l_i, m_i)
                    )
                else:

                    def step(s_ref, pv_ref):  # P V into a fresh accumulator, added below
                        p, m_new, l_new, alpha = scores(s_ref, pv_ref, p_buffer(j - 1))
                        keep_p(p, j)
                        pingpong.elementwise_done()  # softmax done
                        return m_new, l_new, alpha, pv_ref[...]

                    m_i, l_i, alpha, pv = pl.run_scoped(
                        step,
                        plgpu.ACC((block_q, block_kv), jnp.float32),
                        plgpu.ACC((block_q, head_dim), jnp.float32),
                    )
                    acc, p = acc + pv, None
                release_slot(v_free, prev)

                def scaled():
                    return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

                if config.rescale_slack is not None and compiled:
                    # The conditional rescale: a warp none of whose rows moved its max
                    # (alpha 1 on each) skips the multiply, as `body` does with the flag.
                    return lax.cond(warp_any(alpha != 1.0), scaled, lambda: acc), m_i, l_i, p
                return scaled(), m_i, l_i, p

            def last_pv(acc, p, j):
                slot = slot_of(j)
                plgpu.barrier_wait(v_ready.at[slot])
                pingpong.my_turn()
                acc = accumulate_pv(acc, p if config.p_in_registers else p_buffer(j), slot)
                release_slot(v_free, slot)
                return acc

            def overlapped(carry):
                carry = first_tile(carry)
                start = lo + 1
                carry = lax.fori_loop(
                    start, full_lo, functools.partial(overlapped_body, masked=True), carry
                )
                carry = lax.fori_loop(
                    jnp.maximum(start, full_lo),
                    full_hi,
                    functools.partial(overlapped_body, masked=False),
                    carry,
                )
                acc, m_i, l_i, p = lax.fori_loop(
                    jnp.maximum(start, full_hi),
                    hi,
                    functools.partial(overlapped_body, masked=True),
                    carry,
                )
                return last_pv(acc, p, hi - 1), m_i, l_i

            row_layout = plgpu.Layout.WGMMA.reduce(1)
            carry = (
                plgpu.layout_cast(jnp.zeros((block_q, head_dim), jnp.float32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), row_layout),
                plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), row_layout)
                if not config.row_sum_wgmma
                else plgpu.layout_cast(
                    jnp.zeros((block_q, ROW_SUM_COLS), jnp.float32), plgpu.Layout.WGMMA
                ),
            )
            plgpu.barrier_wait(q_ready.at[wg])
            q_regs = None  # q_register_cols: those columns of Q, as Q K^T's A operand
            if config.q_register_cols:
                q_regs = plgpu.load(
                    q_smem.at[:, pl.ds(0, config.q_register_cols)], layout=plgpu.Layout.WGMMA
                )
            q_segs = None
            if q_seg_ref is not None:
                q_segs = plgpu.load(q_seg_smem.at[wg], layout=ROW)  # [block_q]
            if config.early_k_wait:  # the first tile's K; each later one is awaited a step early
                pl.when(hi > lo)(lambda: plgpu.barrier_wait(k_ready.at[slot_of(lo)]))
            # Consumer 1 takes one turn ahead and consumer 0 one after the loop, so that one
            # issues its P V and next Q K^T while the other computes its softmax (FA3's
            # ping-pong); both take the same number of turns, so neither waits forever.
            pingpong.start()

            def merge_later_pieces(i, o32, lse):
                """tail_fixup: O (float32, normalised) and the logsumexp of this item's rows
                with its later pieces' merged in, in key order (split_tail.merge_pair),
                where this is the first piece of a split item; else as they are."""
                n, count = own(piece_col(i, "n")), piece_col(i, "count")
                first = (i >= tail_rounds) & (piece_col(i, "k") == 0) & (count > 1)
                pl.when(first)(
                    lambda: plgpu.semaphore_wait(sems.at[n, wg], count - 1, memory_scope="gpu")
                )
                mine = pl.ds(wg * block_q, block_q)

                def merge(j, carry):
                    o32, lse = carry
                    # Global loads into registers (Mosaic GPU's optimized transfers are for
                    # shared memory only); the pieces were stored in these layouts.
                    load = functools.partial(plgpu.load, optimized=False)
                    o_j = load(piece_o_ref.at[n, j - 1, mine], layout=plgpu.Layout.WGMMA)
                    lse_j = load(piece_lse_ref.at[n, j - 1, mine], layout=row_layout)
                    return merge_pair(o32, lse, o_j, lse_j)

                return lax.fori_loop(1, jnp.where(first, count, 1), merge, (o32, lse))

            def finish(acc, m_i, l_i):
                pingpong.end()
                if own_keys:  # the pair's tiles after this tile's own
                    pass_tiles(hi, streamed_end())
                if config.row_sum_wgmma:  # every column of the accumulator is the row sum
                    l_i = jnp.max(l_i, axis=1)
                # Rows past q_len are padding, and a fully masked row has l_i == 0: both
                # output 0 with logsumexp -inf, never 0/0.
                rows = q0 + plgpu.broadcasted_iota(jnp.int32, (block_q,), 0, layout=row_layout)
                l_i = jnp.where(rows < q_len, l_i, 0.0)
                empty = l_i == 0.0
                l_safe = jnp.where(empty, 1.0, l_i)
                inv = jnp.where(empty, 0.0, 1.0 / l_safe)
                lse = jnp.where(empty, -jnp.inf, (m_i + jnp.log2(l_safe)) * LN2)
                o32 = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
                if fixup_items:  # an item's first piece takes in the item's others
                    o32, lse = merge_later_pieces(i, o32, lse)
                o = o32.astype(dtype)
                o_gmem = o_ref.at[b, pl.ds(q0, block_q), h]
                o_apart = config.o_apart(head_dim, dtype.itemsize)
                if config.persistent and o_apart:
                    # Q is read no more: the next item's loads while this one finishes
                    # (early_q_load: it has, unless this item had no key tile). The last
                    # item's O and lse stores must have left the buffers first.
                    more = i + 1 < count
                    if config.early_q_load:
                        more = more & (hi <= lo)  # else the last Q K^T's step loaded it
                    pl.when(more)(lambda: load_q(i + 1))
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                lse_smem.at[wg][...] = lse

                def store():  # O and the logsumexp of the item's rows
                    if config.o_from_registers:
                        o_gmem[...] = o  # global stores: no shared memory, no TMA
                    else:
                        out_smem[...] = o
                    plgpu.commit_smem()
                    if not config.o_from_registers:
                        plgpu.copy_smem_to_gmem(out_smem, o_gmem)
                    lse_gmem = lse_ref.at[b, h, pl.ds(q0, block_q)]
                    plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_gmem)

                def store_piece():  # split_tail: the piece's, float32, apart (merged later)
                    cta, piece, rows = (
                        own(lax.axis_index("cta")),
                        piece_of(i),
                        pl.ds(wg * block_q, block_q),
                    )
                    piece_o_ref.at[cta, piece, rows][...] = acc * lax.broadcast_in_dim(
                        inv, acc.shape, [0]
                    )  # global stores from registers
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(lse_smem.at[wg], piece_lse_ref.at[cta, piece, rows])

                def store_later_piece():  # tail_fixup: for the item's first piece to merge
                    n, k = own(piece_col(i, "n")), piece_col(i, "k")
                    mine = pl.ds(wg * block_q, block_q)
                    piece_o_ref.at[n, k - 1, mine][...] = o32  # global stores from registers
                    piece_lse_ref.at[n, k - 1, mine][...] = lse
                    # After this warpgroup's stores (a warpgroup barrier, then one thread's
                    # release at GPU scope): the first piece's acquire sees them.
                    plgpu.semaphore_signal(sems.at[n, wg], 1, memory_scope="gpu")

                if fixup_items:
                    later = (i >= tail_rounds) & (piece_col(i, "k") > 0)
                    pl.when(~later)(store)
                    pl.when(later)(store_later_piece)
                elif tail_rounds:
                    pl.when(i < tail_rounds)(store)
                    pl.when(i >= tail_rounds)(store_piece)
                else:
                    store()
                if config.persistent and not o_apart:
                    # O leaves through Q's buffer: the next Q loads once it is read out.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    pl.when(i + 1 < count)(lambda: load_q(i + 1))
                if not config.persistent:
                    # The CTA ends: the buffers only have to be read out (the writes land by
                    # the kernel's end, as CUTLASS's epilogues rely on); awaiting the writes
                    # too held each SM for a round trip to memory per CTA.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            def chained(carry):
                """qk_behind_pv's walk (hi > lo): tile lo's scores first; each step but the
                last issues the next tile's Q K^T behind its P V; the last only its P V,
                masked or not as the tile is."""
                carry = (*carry, qk_scores(slot_of(lo)))
                last = hi - 1
                step = functools.partial(body, chained=True)
                a, b = jnp.minimum(full_lo, last), jnp.minimum(full_hi, last)
                carry = lax.fori_loop(lo, a, functools.partial(step, masked=True), carry)
                carry = lax.fori_loop(a, b, functools.partial(step, masked=False), carry)
                carry = lax.fori_loop(b, last, functools.partial(step, masked=True), carry)

                def final(masked):
                    return lambda carry: step(last, carry, masked=masked, last=True)[:3]

                edge = (last < full_lo) | (last >= full_hi)
                return lax.cond(edge, final(True), final(False), carry)

            if config.qk_behind_pv:
                finish(*lax.cond(hi > lo, chained, lambda carry: carry, carry))
            elif not config.intra_overlap:
                carry = lax.fori_loop(lo, full_lo, functools.partial(body, masked=True), carry)
                carry = lax.fori_loop(
                    full_lo, full_hi, functools.partial(body, masked=False), carry
                )
                finish(*lax.fori_loop(full_hi, hi, functools.partial(body, masked=True), carry))
            else:
                # The prologue needs a first tile: a row block that sees none skips to the end.
                pl.when(hi > lo)(lambda: finish(*overlapped(carry)))
                pl.when(hi <= lo)(lambda: finish(*carry))
            return base + jnp.maximum(streamed_end() - first, 0)

        run_items(consume)
        if config.persistent:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # as at the end of a CTA above

"""Building blocks the Mosaic GPU kernels share (fwd_kernel.py, and backward.py's kernels):
the producer's TMA stream of K/V tiles into a ring of shared-memory slots and its
free/ready barriers (`stream_kv_tiles`, `drain_ring`, named-barrier slots), FA3's
ping-pong of two consumer warpgroups (`PingPong`), the persistent grid's work order,
the key-tile ranges each query span walks (from the mask, lengths and segment ids), the
element masks of a boundary tile, in the layouts of a wgmma accumulator, and the wgmma
helpers the backward kernels issue their products with (`accumulate`,
`wgmma_products`, and `held_zero` for their fresh accumulators)."""

from __future__ import annotations

import dataclasses
import functools
import heapq

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash import masks
from pallas_flash.mosaic.config import (
    NAMED_TURNS,
    NUM_CONSUMERS,
    SWIZZLE,
    WARPGROUP_THREADS,
)


def intersect_tables(a, b):
    """Two [B, n_tiles, 4] interval tables, intersected tile by tile (masks.intersect)."""
    parts = masks.intersect(tuple(a[..., c] for c in range(4)), tuple(b[..., c] for c in range(4)))
    return jnp.stack(parts, axis=-1).astype(jnp.int32)


def stream_kv_tiles(
    refs,
    smem,
    barriers,
    *,
    b,
    kv_head,
    lo,
    hi,
    block_kv: int,
    base=0,
    drain: bool = True,
    multicast: bool = False,
):
    """The producer warpgroup of the forward and dQ kernels: key/value tiles lo .. hi - 1
    of (b, kv_head) into a ring of shared-memory slots by TMA, each with its key ids when
    the call has segment ids, then (`drain`) a wait for the consumers to release the
    last ones. Returns the ring position after these tiles.

    `refs` (K, V, key ids or None) in HBM, `smem` their rings, `barriers` (k_ready,
    v_ready, k_free, v_free) per slot. `base`: tiles this CTA streamed before (a
    persistent kernel's earlier work items); tile j goes to ring position
    base + j - lo, slot (base + j - lo) % stages. `multicast`: the CTA is one of a
    cluster of two walking the same tiles (`MosaicConfig.kv_multicast`): each K and V
    copy lands in both CTAs' slots, each CTA's TMA loading half of it, and the free
    barriers are cluster barriers that both CTAs' consumers arrive on.
    """
    cluster = "cluster" if multicast else None
    k_ref, v_ref, kv_seg_ref = refs
    k_smem, v_smem, kv_seg_smem = smem
    k_ready, v_ready, k_free, v_free = barriers
    stages = k_smem.shape[0]

    def load(j, _):
        pos = base + j - lo
        slot = lax.rem(pos, jnp.int32(stages))
        rows = pl.ds(j * block_kv, block_kv)
        # The slot held the tile of position pos - stages: overwrite it once every
        # consumer is done.
        reuse = pos >= stages

        @pl.when(reuse)
        def _():
            await_free_slot(k_free, slot)

        plgpu.copy_gmem_to_smem(
            k_ref.at[b, rows, kv_head], k_smem.at[slot], k_ready.at[slot], collective_axes=cluster
        )
        if kv_seg_ref is not None:  # the tile's key segment ids travel with K
            plgpu.copy_gmem_to_smem(kv_seg_ref.at[b, rows], kv_seg_smem.at[slot], k_ready.at[slot])

        @pl.when(reuse)
        def _():
            await_free_slot(v_free, slot)

        plgpu.copy_gmem_to_smem(
            v_ref.at[b, rows, kv_head], v_smem.at[slot], v_ready.at[slot], collective_axes=cluster
        )

    lax.fori_loop(lo, hi, load, None)
    end = base + jnp.maximum(hi - lo, 0)
    if drain:
        drain_ring((k_free, v_free), end, stages)
    return end


def swizzled(itemsize: int, swizzle: int = SWIZZLE) -> tuple:
    """The shared-memory transforms of a wgmma operand (or a TMA'd float32 tile) of
    `itemsize`-byte elements: 8-row tiles one swizzle span wide, swizzled."""
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def pair_cluster(multicast: bool):
    """(the slots' free-barrier type, `plgpu.kernel`'s cluster arguments) of a kernel whose
    CTAs run in clusters of two that load each streamed tile once for both by TMA
    multicast (`multicast`; the cluster axis is "cluster"), or of one whose CTAs run
    alone. In a cluster a slot's free barrier counts the consumers of both CTAs, so that
    neither producer refills a slot the other CTA still reads."""
    if not multicast:
        return plgpu.Barrier, {}
    free = functools.partial(plgpu.ClusterBarrier, collective_axes=("cluster",))
    return free, dict(cluster=(2,), cluster_names=("cluster",))


def kv_tile_ranges(spec: masks.MaskSpec, q_len, kv_len, segments, t_pad: int, rows: int, bk: int):
    """[B, t_pad // rows, 4] int32: the key tiles of `bk` keys (lo, full_lo, full_hi, hi)
    that each span of `rows` query rows walks, from the mask and lengths and, with
    `segments` (int32 query and key ids, or None), narrowed to the documents they meet.
    The forward's and the dQ kernel's walk, per CTA or (multicast) per cluster."""
    ranges = masks.tile_range_table(
        masks.kv_tile_range, spec, q_len, kv_len, t_pad // rows, rows, bk, rows
    )
    if segments is None:
        return ranges
    q_seg, kv_seg = segments
    return intersect_tables(ranges, masks.segment_tile_ranges(q_seg, kv_seg, rows, bk)[0])


def drain_ring(free, end, stages: int):
    """Waits for the consumers to release the ring's last tiles (positions up to `end`):
    the shared memory must not be released under them, and a barrier should end with
    every phase seen (GPU interpret mode checks this at deallocation)."""

    def wait(pos, _):
        slot = lax.rem(pos, jnp.int32(stages))
        for barrier in free:
            await_free_slot(barrier, slot)

    lax.fori_loop(jnp.maximum(0, end - stages), end, wait, None)


class PingPong:
    """FA3's ping-pong of two consumer warpgroups over a `turns` barrier (two arrivals),
    for steps of one shape: products, elementwise work (the softmax), more products. A
    consumer meets the other after issuing a step's first products (`meet`: ours are
    issued, the other may issue its own), arrives when its elementwise work is done
    (`elementwise_done`) and waits for its turn before the next products (`my_turn`);
    consumer 1 meets once before the first step (`start`) and consumer 0 once after the
    last (`end`), so that one's elementwise work runs beside the other's matmuls. Both
    must walk the same number of steps, so that neither waits forever. `turns` None (no
    ping-pong): every call is a no-op.

    The meet also waits for the other's previous elementwise work, so the two softmaxes
    never overlap. FA3's and tokamax's one-way hand-over (one arrive after issuing, one
    wait before the next products) avoids that; built here as an option at ac9dc15 and
    timed at 41958b0, it ran 0.96-1.00x this rendezvous at head dim 128 (docs/mosaic.md), so it
    was removed.

    `named` (MosaicConfig.named_turns): the one-way hand-over again, on the SM's
    hardware named barriers rather than a shared-memory mbarrier (tokamax's form):
    barrier NAMED_TURNS + w is consumer w's turn. A consumer arrives on the other's
    after issuing its first products (`meet`) and syncs on its own before the next
    (`my_turn`), 128 threads each, so a turn needs the other's products issued; consumer
    1 syncs once before the first step, and consumer 0 syncs on consumer 1's barrier
    after the last, which completes with consumer 1's last turn. Within a work item
    neither can arrive twice on one barrier before the other syncs (its next arrival
    follows its own next sync, which needs the other's arrival after that sync); the
    sync at the end keeps it so across a persistent CTA's items, where an arrival there
    could meet the next item's first before consumer 1 took its last turn.

    Three consumers (MosaicConfig.consumers=3, named turns only): the turns go round,
    consumer w arriving on consumer w + 1's barrier (mod 3) after issuing its products;
    consumers 1 and 2 sync once before their first step, and after their last consumers
    0 and 1 sync on the next one's barrier, taking up its last turn as consumer 0 does
    with two. Per work item each barrier of consumer w >= 1 then completes once per
    step plus once: its start sync with the first arrival, each later arrival with the
    sync before the next step, and the last sync with the end sync.
    """

    def __init__(self, turns, wg, named: bool = False, consumers: int = NUM_CONSUMERS):
        self.turns, self.wg = turns, wg  # wg: the consumer's index, static or traced
        self.named = named and turns is not None
        self.consumers = consumers
        if consumers != 2 and turns is not None and not named:
            raise ValueError("the mbarrier ping-pong is a rendezvous of two consumers")

    def _next(self):  # the barrier of the consumer whose turn follows ours
        if self.consumers == 2:
            return NAMED_TURNS + 1 - self.wg
        if isinstance(self.wg, int):
            return NAMED_TURNS + (self.wg + 1) % self.consumers
        return NAMED_TURNS + lax.rem(self.wg + 1, self.consumers)

    def meet(self):
        if self.named:
            named_barrier("arrive", self._next(), 2 * WARPGROUP_THREADS)
        elif self.turns is not None:
            plgpu.barrier_arrive(self.turns)
            plgpu.barrier_wait(self.turns)

    def elementwise_done(self):
        if self.turns is not None and not self.named:
            plgpu.barrier_arrive(self.turns)

    def my_turn(self):
        if self.named:
            named_barrier("sync", NAMED_TURNS + self.wg, 2 * WARPGROUP_THREADS)
        elif self.turns is not None:
            plgpu.barrier_wait(self.turns)

    def start(self):  # before the first step: consumer 1's first turn (and 2's)
        if self.consumers == 2:
            self._on(1, self.my_turn if self.named else self.meet)
        else:
            self._if(lambda wg: wg != 0, self.my_turn)

    def end(self):  # after the last: consumer 0 waits out consumer 1's last turn
        if self.consumers != 2:  # (and consumer 1 consumer 2's)
            last = self.consumers - 1
            sync_next = lambda: named_barrier("sync", self._next(), 2 * WARPGROUP_THREADS)  # noqa: E731
            self._if(lambda wg: wg != last, sync_next)
        elif self.named:
            self._on(0, lambda: named_barrier("sync", NAMED_TURNS + 1, 2 * WARPGROUP_THREADS))
        else:
            self._on(0, self.meet)

    def _on(self, wg: int, fn):  # fn() if this is consumer `wg`
        self._if(lambda w: w == wg, fn)

    def _if(self, pred, fn):  # fn() if pred(this consumer's index), with a ping-pong
        if self.turns is None:
            return
        if isinstance(self.wg, int):
            if pred(self.wg):
                fn()
        else:
            pl.when(pred(self.wg))(fn)


def named_barrier(op: str, barrier, threads: int) -> None:
    """`bar.arrive` or `bar.sync` (op) of the executing warpgroup on hardware named barrier
    `barrier` (an int or a traced int32, the same in every thread), which completes when
    `threads` threads have arrived or synced. No shared memory: the SM counts them."""

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,))
    def emit(_ctx, barrier_id):
        mgpu_utils.inline_ptx(
            f"bar.{op} $0, {threads};", barrier_id.registers[()], has_side_effects=True
        )

    emit(jnp.asarray(barrier, jnp.int32))


@dataclasses.dataclass(frozen=True)
class NamedSlots:
    """A ring's slot releases on hardware named barriers (MosaicConfig.named_releases):
    slot s's is barrier `first + s`. Both consumers arrive when done with a slot and the
    producer warpgroup syncs before refilling it, so each completes at 384 threads, in
    the SM's barrier unit rather than by 256 atomics on a shared-memory mbarrier. The
    producer syncs once per refill and once per slot at the end (drain_ring), so every
    release is taken."""

    first: int

    def release(self, slot):
        named_barrier("arrive", self.first + slot, (NUM_CONSUMERS + 1) * WARPGROUP_THREADS)

    def await_free(self, slot):
        named_barrier("sync", self.first + slot, (NUM_CONSUMERS + 1) * WARPGROUP_THREADS)


def release_slot(free, slot) -> None:
    """A consumer is done with ring slot `slot`: `free` is the ring's free barriers (an
    mbarrier array, or NamedSlots)."""
    if isinstance(free, NamedSlots):
        free.release(slot)
    else:
        plgpu.barrier_arrive(free.at[slot])


def await_free_slot(free, slot) -> None:
    """The producer waits until every consumer released ring slot `slot`."""
    if isinstance(free, NamedSlots):
        free.await_free(slot)
    else:
        plgpu.barrier_wait(free.at[slot])


def persistent_item(cta, i, num_ctas: int, *, snake: bool):
    """The persistent grid's item index of CTA `cta`'s work item `i` (traced or not).
    Round i hands items [i * num_ctas, (i + 1) * num_ctas) out one per CTA; with `snake`
    (causal) the rounds alternate direction, so that the CTA given a round's longest
    item is given the next round's shortest. Causal items shrink along the order (the
    bottom query tiles first), and handed out the same way every round the first CTAs
    would get the longest item of every round: at 8k, 2048 items on 132 SMs, about 6 %
    more work than the mean, while the other CTAs wait at the end."""
    if snake:
        cta = jnp.where(i % 2 == 0, cta, num_ctas - 1 - cta)
    return cta + i * num_ctas


def persistent_item_count(cta, num_items: int, num_ctas: int, *, snake: bool):
    """How many items CTA `cta` walks: one per whole round, and one more if the partial
    last round's item for it exists."""
    rounds = num_items // num_ctas
    last = persistent_item(cta, rounds, num_ctas, snake=snake)
    return jnp.where(last < num_items, rounds + 1, rounds).astype(jnp.int32)


def head_rounds_order(pairs: int, num_q_tiles: int, num_ctas: int) -> np.ndarray:
    """The persistent causal grid's items in head order, each round's sorted longest
    first (MosaicConfig.head_rounds): int32 [pairs * num_q_tiles], whose entry at
    `persistent_item(cta, i, ...)` is the item CTA `cta` walks i-th, as
    `(pair * num_q_tiles + d)` for the (batch, head) pair's d-th tile from the bottom
    (d = 0 walks the most key tiles). A round is num_ctas consecutive items of the head
    order: its items stay together, only their hand-out among the CTAs changes, so that
    the snake gives the CTA with a round's longest item the next round's shortest."""
    items = np.arange(pairs * num_q_tiles, dtype=np.int64)
    from_bottom = items % num_q_tiles
    key = (items // num_ctas) * num_q_tiles + from_bottom  # round first, then the length
    return np.argsort(key, kind="stable").astype(np.int32)


# greedy_items: what an item costs a persistent CTA beyond its key tiles, in key tiles
# (the part of its start and end the next item's does not hide; 1k at head dim 128 non-
# causal, 8 tiles an item, ran 1.06x persistent against one CTA per item: about half a
# tile an item, docs/mosaic.md "A persistent forward").
GREEDY_ITEM_STEPS = 0.5


@functools.lru_cache(maxsize=64)
def greedy_items_lists(tile_costs: tuple, heads: int, batch: int, num_ctas: int):
    """greedy_items' schedule (greedy_items_order says how it is made): for each CTA, its
    items in the order it walks them, in head_rounds_order's encoding. `tile_costs`: a
    tuple (the schedule is cached), each query tile's key tiles from the top."""
    tiles = len(tile_costs)
    free = [(0.0, cta) for cta in range(num_ctas)]  # (modelled end of its work, CTA)
    lists = [[] for _ in range(num_ctas)]
    for h in range(heads):  # the grid's launch order: heads, tiles bottom first, batch
        for d in range(tiles):
            cost = tile_costs[tiles - 1 - d] + GREEDY_ITEM_STEPS
            for b in range(batch):
                end, cta = heapq.heappop(free)
                lists[cta].append((b * heads + h) * tiles + d)
                heapq.heappush(free, (end + cost, cta))
    return tuple(map(tuple, lists))  # cached: not to be changed by a caller


def greedy_items_order(tile_costs, heads: int, batch: int, num_ctas: int) -> np.ndarray:
    """The persistent causal grid's items handed out as the block scheduler hands out the
    grid of one CTA per item (MosaicConfig.greedy_items): in that grid's launch order
    (heads, then query tiles from the bottom, then batch elements), each to the CTA whose
    work so far ends first, an item costing its query tile's key tiles (`tile_costs`,
    [num_q_tiles], the mask's at the call's full lengths) and GREEDY_ITEM_STEPS. The
    hardware decides as each CTA ends; here it is decided before the kernel, by the model.
    int32 [(slots + 1) * num_ctas]: entry `cta` is the count of CTA cta's items, entry
    `(i + 1) * num_ctas + cta` its i-th, encoded as head_rounds_order's (pair * num_q_tiles
    + d, d from the bottom), 0 past its count."""
    lists = greedy_items_lists(tuple(int(c) for c in tile_costs), heads, batch, num_ctas)
    table = np.zeros((max(map(len, lists)) + 1, num_ctas), np.int32)
    for cta, items in enumerate(lists):
        table[0, cta] = len(items)
        table[1 : len(items) + 1, cta] = items
    return table.reshape(-1)


def nominal_key_tiles(
    spec: masks.MaskSpec, q_len: int, kv_len: int, num_tiles: int, rows: int, bk: int
):
    """[num_tiles] int: the key tiles each span of `rows` query rows walks at these static
    lengths (the mask's kv_tile_range, evaluated while tracing, as numpy)."""
    lengths = (jnp.full((1,), n, jnp.int32) for n in (q_len, kv_len))
    with jax.ensure_compile_time_eval():
        table = masks.tile_range_table(
            masks.kv_tile_range, spec, *lengths, num_tiles, rows, bk, rows
        )
    table = np.asarray(table)[0]
    return table[:, 3] - table[:, 0]


def lax_divmod(a, b):
    """np.divmod's pair for the kernels' non-negative int32 scalars (lax.div, lax.rem)."""
    return lax.div(a, b), lax.rem(a, b)


def head_rounds_coords(entries, heads: int, num_q_tiles: int, divmod=np.divmod):
    """(batch, head, query tile) of head_rounds' table entries: on the host (numpy, a
    scalar or an array) and, with divmod=lax_divmod, in `fwd_kernel.item_at`, so that
    the table's one encoding (head_rounds_order) has one decoding."""
    pair, from_bottom = divmod(entries, num_q_tiles)
    b, h = divmod(pair, heads)
    return b, h, num_q_tiles - 1 - from_bottom


# order_ranges: the columns of a row of the order table (order_rows).
ORDER_COLS = ("item", "lo", "full_lo", "full_hi", "hi", "q_len", "kv_len", "pad")


def order_rows(order: np.ndarray, ranges, q_len, kv_len, heads: int, num_q_tiles: int):
    """head_rounds' table with each item's key range and lengths beside it (MosaicConfig.
    order_ranges): int32 [items, 8], ORDER_COLS, gathered from `ranges` [B, tiles, 4]
    and the lengths [B] before the kernel, so that a CTA starting an item waits on one
    row's loads rather than the entry's and then, indexed by it, the range's."""
    b, _, tile = head_rounds_coords(order, heads, num_q_tiles)
    cols = [
        jnp.asarray(order)[:, None],
        ranges[b, tile, :4],  # (kv_multicast's tables carry its tiles' ranges after)
        q_len[b][:, None],
        kv_len[b][:, None],
        jnp.zeros((len(order), 1), jnp.int32),
    ]
    return jnp.concatenate([c.astype(jnp.int32) for c in cols], axis=1)


ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a wgmma accumulator


COL = plgpu.Layout.WGMMA.reduce(0)  # one value per column


def bound_mask(
    spec: masks.MaskSpec,
    queries,
    keys,
    first_key,
    kv_len,
    diag,
    query_dim: int,
    column_blocks: bool = True,
):
    """A boundary tile's element mask from each query's key bounds (the configs'
    `row_bound_mask`): `queries` [n] are the tile's absolute query positions, `keys` its
    key iota counted from the absolute key `first_key`, with the queries along
    `query_dim`. Equal to `masks.tile_mask` without segment ids (tests/test_masks.py),
    but with one compare per element (two with a window's start), the bounds worked out
    once per query. Only where a bound depends on the query (`masks.has_row_bounds`):
    without one, `element_mask` compares the key iota with the key length directly.
    With the queries on the rows, `column_blocks` (the configs' field) compares eight
    key columns at a time (`_columns_within`); `keys` is then the tile's column iota."""
    lo, hi = masks.row_bounds(spec, queries, kv_len, diag)
    if column_blocks and query_dim == 0 and jnp.ndim(hi) and keys.shape[1] > 8:
        return _columns_within(keys, hi - first_key, None if lo is None else lo - first_key)

    def per_query(bound):  # [n] -> keys.shape, relative to the tile's first key
        bound = bound - first_key
        if jnp.ndim(bound) == 0:  # the key length alone (a window without an end)
            return bound
        return lax.broadcast_in_dim(bound, keys.shape, [query_dim])

    keep = keys < per_query(hi)
    if lo is not None:
        keep = keep & (keys >= per_query(lo))
    return keep


def _columns_within(keys, hi, lo=None):
    """keys < hi (and keys >= lo) for `keys` the column iota of a [rows, k] tile (wgmma
    layout) and per-row bounds `hi`, `lo` [rows], eight columns at a time: a thread's
    columns 8j + c are its first eight's plus 8j, so each bound less those first columns
    is worked out once (`rel`) and every element is one compare with the constant 8j.
    Compared column by column, ptxas rebuilt each column's iota from the thread index
    (five instructions before each compare)."""
    first = keys[:, :8]

    def rel(bound):  # [rows] -> [rows, 8]: the bound less the thread's first columns
        return lax.broadcast_in_dim(bound, first.shape, [0]) - first

    hi_rel = rel(hi)
    lo_rel = None if lo is None else rel(lo)
    blocks = []
    for j in range(keys.shape[1] // 8):
        keep = hi_rel > 8 * j  # first + 8j < hi
        if lo_rel is not None:
            keep = keep & (lo_rel <= 8 * j)  # first + 8j >= lo
        blocks.append(keep)
    return jnp.concatenate(blocks, axis=1)


def element_mask(
    spec: masks.MaskSpec,
    row_bound: bool,
    first_query,
    keys,
    first_key,
    kv_len,
    diag,
    query_dim: int,
    segs=None,
    *,
    column_blocks: bool = True,
):
    """A boundary tile's element mask, for the forward and both backward kernels: the
    queries run along `query_dim` from the absolute position `first_query`, `keys` is
    the tile's key iota (wgmma layout) counted from the absolute key `first_key`, and
    `segs` is None or the (query ids, key ids) pair broadcast to the tile. Where no bound
    depends on the query, the key length alone, one compare per element; with
    `row_bound` (the configs' `row_bound_mask`), `bound_mask`'s one or two compares per
    element; otherwise `masks.tile_mask`."""
    shape = keys.shape
    if not masks.has_row_bounds(spec):
        # The key length alone (no causal mask, no window): the tile's first key moves to
        # the bound, one compare per element against a scalar, where `first_key + keys`
        # cost an add per element and the key iota was rebuilt from the thread index.
        keep = keys < kv_len - first_key
        return keep if segs is None else keep & (segs[0] == segs[1])
    if row_bound:
        layout = ROW if query_dim == 0 else COL
        queries = first_query + plgpu.broadcasted_iota(
            jnp.int32, (shape[query_dim],), 0, layout=layout
        )
        keep = bound_mask(spec, queries, keys, first_key, kv_len, diag, query_dim, column_blocks)
        return keep if segs is None else keep & (segs[0] == segs[1])
    queries = first_query + plgpu.broadcasted_iota(
        jnp.int32, shape, query_dim, layout=plgpu.Layout.WGMMA
    )
    return masks.tile_mask(spec, queries, first_key + keys, kv_len, diag, segs)


def sm_count() -> int:
    """Streaming multiprocessors of the first device (132 on an H100 SXM or an H200)."""
    return getattr(jax.devices()[0], "core_count", None) or 132


def piece_range(bounds, first, end, on):
    """A tile range (lo, hi) or (lo, full_lo, full_hi, hi) cut to a split_tail piece's
    tiles [first, end) where `on` (traced): the ends clamped, the unmasked tiles the
    range's within them, so a piece masks exactly the tiles its item would."""
    lo, *full, hi = bounds
    lo = jnp.where(on, jnp.maximum(lo, first), lo)
    hi = jnp.where(on, jnp.maximum(jnp.minimum(hi, end), lo), hi)
    if not full:
        return lo, hi
    full_lo = jnp.minimum(jnp.maximum(full[0], lo), hi)
    full_hi = jnp.maximum(jnp.minimum(full[1], hi), full_lo)
    return lo, full_lo, full_hi, hi


def pad_to(x, seq: int, head_dim: int):
    """Zero-pads [B, L, heads, H] to [B, seq, heads, head_dim] (no copy when whole)."""
    _, length, _, h = x.shape
    if (length, h) == (seq, head_dim):
        return x
    return jnp.pad(x, [(0, 0), (0, seq - length), (0, 0), (0, head_dim - h)])


def accumulate(terms, staging):
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


def held_zero(on: bool = True):
    """A float32 zero computed once, before a kernel's loops, for its fresh accumulators
    (`start_from`; `MosaicBwdConfig.held_zero`, passed as `on`: None when off).

    A fresh accumulator is 64 (or 32) registers of zeros that its first wgmma adds onto,
    and ptxas drops them (it issues that wgmma as `HGMMA ..., RZ, !UPT`, reading no
    accumulator) only where each is a copy of a zero that outlives them. run_scoped's
    accumulators are splats of the constant 0, which LLVM materialises inside the loop;
    where nothing else in the step reads that register, it makes it the accumulator's
    last register, and ptxas then zeroes the other 63 with a move each, every step: 63
    of the 533 instructions of the pair's dK/dV step at head dim 64 (deviceless, SASS).
    Through an optimisation barrier, opaque to LLVM and no instruction to ptxas, the
    zero is a value defined once and live across the loop, so every accumulator
    register is a copy of it and ptxas folds them all. The same zeros, so the same
    numbers."""
    return lax.optimization_barrier(jnp.float32(0)) if on else None


def zeros_from(shape, zero):
    """Float32 zeros of `shape` in the wgmma accumulator layout, copies of `zero`
    (held_zero's), or the constant 0 with `zero` None."""
    fill = jnp.full(shape, jnp.float32(0) if zero is None else zero, jnp.float32)
    return plgpu.layout_cast(fill, plgpu.Layout.WGMMA)


def start_from(zero, *acc_refs):
    """Sets run_scoped's fresh accumulators to zeros copied from `zero` (held_zero's)
    before their first wgmma; with `zero` None, leaves them as run_scoped made them."""
    if zero is None:
        return
    for acc_ref in acc_refs:
        acc_ref[...] = zeros_from(acc_ref.shape, zero)


def wgmma_products(pairs, shape, after_issue=lambda: None, zero=None, first=None):
    """[a @ b for (a, b) in pairs], both shared-memory refs, into fresh float32
    accumulators of `shape` (starting from `zero`, `start_from`), issued together and
    awaited once; `after_issue` runs between the two (a ping-pong's hand-over).

    With `first` (MosaicBwdConfig.probs_before_dp), the first product is awaited alone
    and `first` of it (P of S) is made before the rest are read, so it runs while they
    are on the tensor cores: wgmma groups complete in order, so the first is in once the
    others are the only ones pending. Where ptxas places the later wait is its own
    choice: compiled for the H200, the dQ kernel's step at head dim 64 issues all 64 of
    its FFMAs and 16 of its 64 exp2 between the two waits (docs/mosaic.md, "Scores' exp2 beside
    dP")."""

    def mma(*acc_refs):
        start_from(zero, *acc_refs)
        for acc_ref, (a, b) in zip(acc_refs, pairs):
            plgpu.wgmma(acc_ref, a, b)
        after_issue()
        if first is None:
            return tuple(acc_ref[...] for acc_ref in acc_refs)
        head = first(plgpu.wgmma_accumulator_load(acc_refs[0], wait_n=len(acc_refs) - 1))
        return (head, *(acc_ref[...] for acc_ref in acc_refs[1:]))

    return pl.run_scoped(mma, *(plgpu.ACC(shape, jnp.float32) for _ in pairs))


def bcast(x, shape, dim: int):
    """A vector laid along dimension `dim` of `shape`, repeated along the other one."""
    return lax.broadcast_in_dim(x, shape, [dim])

"""Ordered dQ adds of the fused Mosaic backward (`MosaicBwdConfig.fused`, backward.py).

In the fused kernel each dK/dV CTA (one key span) also computes, for every query tile
it visits, that tile's dQ share dS K over its own keys. A query tile's shares come from
several CTAs, and float32 addition is not associative, so they are added to the float32
dQ in one fixed order, increasing key span, and the gradients stay bitwise
deterministic (FA3 adds them with atomics in whatever order the CTAs arrive; its
deterministic mode orders them the same way, with a semaphore per query tile).

The protocol, per (batch, query head, query tile), one global semaphore starting at 0
that counts the shares added: the visitor of rank r (its place among the tile's
visitors, from `order_tables`) waits until the semaphore reads r, adds its share with a
TMA reduce-add (rank 0 stores instead, so dQ needs no zeroing; tiles nobody visits are
zeroed in XLA), and once the add has landed in global memory adds 1 (Mosaic GPU signals
constants only). The writer awaits that landing at once, once the share's slot is
freed: until 8d64c73 it awaited it one step late, after issuing the next tile's adds,
to keep the round trip to L2 off each step's path, but then each visitor's turn came a
step after the add it waited for, and the spans of a head, waiting on each other in a
chain, fell behind one step more each: at head dim 128 causal 8k (B=2, 16 heads, FA3's
order and step_descriptors) the fused backward ran 268.3 TFLOP/s that way and 384.2
handing over at once (`benchmarks/results/mosaic-8d64c73/`; without any waits, wrong
sums but the same traffic, 405.7). The last visitor's wait takes the count back to 0
and it signals nothing, so the semaphores end as they started (Pallas zeroes them per
call today; this does not rely on it).

Ranks. The visitors of query tile m are the spans whose query range [lo, hi) holds m.
Those ranges are intervals monotone in the span (mask bands and lengths, intersected
with the ranges of sorted segment ids; unsorted ids give every span every tile), so a
tile's visitors are consecutive among the spans with a non-empty range, and
rank = (non-empty spans before this one) - (non-empty spans before the first visitor).
tests/test_mosaic_backward.py checks the tables against a count over all span pairs.

Deadlock freedom: a CTA waits only on CTAs of lower span index of its own head and
batch, which have a lower linear CTA index and so are launched no later (CUDA starts a
grid's CTAs in increasing linear index); the lowest unfinished CTA never waits.

Roles in the CTA: each consumer stores its tile's dS^T (bf16/fp16) to shared memory,
and after a barrier computes its slice of the share (head-dim columns, or rows,
`MosaicBwdConfig.dq_part`) over all the CTA's key tiles, then hands it over through
one of two float32 slots to a fourth warpgroup, the writer, which does the waiting and
the adds: the consumers never stall on another CTA, only on a slot the writer has not
emptied yet. (One dS^T buffer, two share slots: at head dim 128 that is what fits in
227 KiB beside K, V and the two-stage Q/dO ring; the consumers run in step, so the
buffer is free again long before it is needed.)

Two options change who adds when (docs/mosaic.md, "What the fused kernel's dQ costs"; the first
off, the second in the fused default, bwd_config.BWD_FUSED_ROWS). `rotated_adds`: the CTAs
walk their query tiles upward and a tile's adds go in decreasing span order, or where no
mask cuts the spans each CTA's walk is rotated by its index and the turns go round from
the span that reached the tile first (`turn`), so that when the CTAs run at one pace
every turn is due on arrival; a span then waits on spans of higher index, so a head's
spans are launched together and must all be resident (at most one span an SM), unless
`high_spans_first` launches each head's spans from the last down (and drops the
rotation): then every wait is on a CTA launched earlier, and under a causal mask the
span above still reaches each tile first (with high_spans_first, the head-dim-64 causal
default since 78baa53: bwd_config.BWD_HIGH_SPANS_FIRST_DIMS).
`split_writer` (with writer_warp): two writer warps, one a slot, so one step's adds wait
and land while the next step's go out.

GPU interpret mode has neither global semaphores nor TMA reductions, but runs the CTAs
one after another in grid order, which visits the spans of a head in increasing order:
there the writer reads the running dQ, adds its share and stores it, the same float32
additions in the same order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash.mosaic.bwd_config import MosaicBwdConfig
from pallas_flash.mosaic.config import FUSED_SIDE_REGISTERS
from pallas_flash.mosaic.pipeline import start_from, swizzled

SLOTS = 2  # dQ shares in flight per consumer (dS^T tiles: one); chained_share: one


def order_tables(ranges, num_tiles: int):
    """The ranks of the ordered adds, from the dK/dV kernel's [B, spans, 4] query-tile
    ranges: (index of each span among the non-empty ones [B, spans], and for each query
    tile that index of its first and last visitor [B, num_tiles]; first > last when no
    span visits the tile). Linear in the lengths; computed in XLA."""
    lo, hi = ranges[..., 0], ranges[..., 3]
    nonempty = hi > lo
    count = nonempty.astype(jnp.int32)
    index = jnp.cumsum(count, axis=1) - count  # non-empty spans before each span
    big = jnp.iinfo(jnp.int32).max
    # Non-decreasing stand-ins that skip the empty spans: the first span whose range
    # ends past m is the first visitor, the last span whose range starts at or before m
    # the last (the ranges being monotone in the span).
    ends = lax.cummax(jnp.where(nonempty, hi, -1), axis=1)
    starts = lax.cummin(jnp.where(nonempty, lo, big), axis=1, reverse=True)
    tiles = jnp.arange(num_tiles, dtype=jnp.int32)

    def per_batch(index, ends, starts):
        first = jnp.searchsorted(ends, tiles, side="right", method="sort")
        last = jnp.searchsorted(starts, tiles, side="right", method="sort") - 1
        visited = first <= last
        spans = index.shape[0]
        first_i = jnp.where(visited, index[jnp.clip(first, 0, spans - 1)], 0)
        last_i = jnp.where(visited, index[jnp.clip(last, 0, spans - 1)], -1)
        return first_i, last_i

    first, last = jax.vmap(per_batch)(index, ends, starts)
    return index.astype(jnp.int32), first.astype(jnp.int32), last.astype(jnp.int32)


def ring_table(ranges):
    """[B, 2] int32 for `MosaicBwdConfig.rotated_adds`, per batch element: the non-empty
    key spans E, and 1 where the rotated walk applies: every non-empty span has the
    same query range and segments (no mask cuts them), and E is at most its unmasked
    tiles, so each span reaches each of them at a step of its own."""
    nonempty = ranges[..., 3] > ranges[..., 0]
    count = nonempty.sum(axis=1).astype(jnp.int32)
    first = jnp.argmax(nonempty, axis=1)
    ref = jnp.take_along_axis(ranges, first[:, None, None], axis=1)  # [B, 1, 4]
    same = jnp.all(jnp.where(nonempty[..., None], ranges == ref, True), axis=(1, 2))
    ring = same & (count >= 1) & (count <= ref[:, 0, 2] - ref[:, 0, 1])
    return jnp.stack([count, ring.astype(jnp.int32)], axis=1)


def rotation(order_refs, b, own):
    """rotated_adds: (non-empty spans E, the ring flag, the rotation of the walk of the
    span with index `own`) of batch element b, from `ring_table`'s row in order_refs."""
    count, ring = order_refs[3][b, 0], order_refs[3][b, 1]
    return count, ring, lax.select(ring != 0, own, 0)


def rotated_tile(j, start, stop, rot):
    """The tile at place j of tiles [start, stop) walked upward from start + rot, round.
    Scalar lax ops only (the writer runs in warp code)."""
    return start + lax.rem(j + rot, lax.max(stop - start, 1))


def walk_tile(j, lo, full_lo, full_hi, rot):
    """rotated_adds: the query tile at place j of a CTA's walk of one head: upward from
    lo, its unmasked tiles [full_lo, full_hi) started at full_lo + rot (0 <= rot <
    their number)."""
    inside = (j >= full_lo - lo) & (j < full_hi - lo)
    return lax.select(inside, rotated_tile(j - (full_lo - lo), full_lo, full_hi, rot), lo + j)


def walk_place(i, lo, full_lo, full_hi, rot):
    """The place of query tile i in the walk of `walk_tile` (its inverse)."""
    width = lax.max(full_hi - full_lo, 1)
    inside = (i >= full_lo) & (i < full_hi)
    return lax.select(inside, full_lo - lo + lax.rem(i - full_lo - rot + width, width), i - lo)


def turn(own, first, last, i, count, ring, full_lo, full_hi):
    """rotated_adds: (rank, visitors) of the span with index `own` (among the non-empty
    ones) at query tile i, whose visitors are those with indices [first, last]. The
    order is decreasing span index (a span above reached the tile no later), but at
    the unmasked tiles of a rotated walk (`ring`, E = `count` spans, each rotated by
    its index) the order in which the spans reach the tile: the span at place 0, then
    the one rotated one further, which reaches it a step later, and round. With
    u = i - full_lo, span e reaches the tile at place (u - e) mod W (W unmasked tiles,
    E <= W), and the spans before it there are those with e' in (e, min(u, E - 1)], or,
    when e > u, all of [0, u] and (e, E): rank (min(u, E - 1) - e) mod E."""
    visitors = last - first + 1
    e_count = lax.max(count, 1)
    rotated = lax.rem(lax.min(i - full_lo, e_count - 1) - own + e_count, e_count)
    inside = (ring != 0) & (i >= full_lo) & (i < full_hi)
    return lax.select(inside, rotated, last - own), visitors


def descending_rank(own, first, last):
    """high_spans_first: (rank, is last, is not last) of the span with index `own` among
    a tile's visitors [first, last], whose adds go in decreasing span index: the span
    above reached the tile first under a causal mask, and was launched first."""
    return last - own, own == first, own != first


def visited_rows(first, last, block_q: int, seq_q: int):
    """[B, seq_q] bool: rows of the query tiles some span visited (the others' dQ was
    never written)."""
    return jnp.repeat(last >= first, block_q, axis=1)[:, :seq_q]


def scratch(config: MosaicBwdConfig, head_dim: int, dtype, transforms, interpret: bool):
    """Shared memory and barriers of the fused kernel's dQ path."""
    c, bq, bk = config.consumers_dkv, config.block_q_dkv, config.block_kv_dkv
    rows, cols = config.dq_part(head_dim)
    f32 = swizzled(4)
    chained = config.chained_share
    slots = 1 if chained else SLOTS
    out = dict(
        # dS^T [bk, bq] each, or with query_rows P and then dS [bq, bk]
        ds=plgpu.SMEM(
            (c, bq, bk) if config.query_rows else (c, bk, bq), dtype, transforms=transforms
        ),
        # Each step's share, part w of the query tile's [bq, head dim] in [slot, w]:
        # consumer w's slice, or (chained) consumer 1's totals of every part.
        share=plgpu.SMEM((slots, c, rows, cols), jnp.float32, transforms=f32),
        # chained: only consumer 1 hands the slot over
        share_ready=plgpu.Barrier(num_arrivals=1 if chained else c, num_barriers=slots),
        share_free=plgpu.Barrier(num_barriers=slots),
        done=plgpu.Barrier(num_arrivals=c),
    )
    if chained:  # consumer 0's sums of each part, for consumer 1 to start from
        out["lead"] = plgpu.SMEM((c, rows, cols), jnp.float32, transforms=f32)
        out["lead_ready"] = plgpu.Barrier(num_barriers=c)
        out["lead_free"] = plgpu.Barrier(num_barriers=c)
    else:  # the dS^T tiles every consumer's slice reads
        out["ds_ready"] = plgpu.Barrier(num_arrivals=c)
        out["ds_free"] = plgpu.Barrier(num_arrivals=c)
    if interpret:  # the running dQ, read back for the add (one buffer a writer)
        writers = 2 if config.split_writer else 1
        out["old"] = plgpu.SMEM((writers, c, rows, cols), jnp.float32, transforms=f32)
        out["old_ready"] = plgpu.Barrier(num_arrivals=c, num_barriers=writers)
    return out


def share_ds(s, step, w: int, ds_t):
    """Consumer `w` publishes its dS^T tile [block_kv, block_q] of this step, once
    every consumer's dQ slice of the last step has read the buffer."""

    @pl.when(step > 0)
    def _():
        plgpu.barrier_wait(s["ds_free"])

    s["ds"].at[w][...] = ds_t
    plgpu.commit_smem()  # visible to the wgmma's async reads, here and in the others
    plgpu.barrier_arrive(s["ds_ready"])


def share_pairs(
    s, w: int, k_smem, part: tuple[int, int], z=0, query_rows: bool = False, piece=(0, 1)
):
    """The (A, B) shared-memory operands of consumer `w`'s slice of the dQ share,
    dS @ K over every key tile of the CTA ([rows, cols] from each pair); their tiles
    indexed with the offset `z` (0: MosaicBwdConfig.step_descriptors). The tiles hold
    dS^T, or dS itself with `query_rows`. `piece` (index, count): that column piece of
    the slice only ([rows, cols / count], MosaicBwdConfig.share_halves)."""
    rows, cols = part
    index, count = piece
    width = cols // count
    c0 = (w * cols if cols < k_smem.shape[-1] else 0) + index * width  # K's first column
    pairs = []
    for t in range(s["ds"].shape[0]):
        ds, k_t = s["ds"].at[t + z], k_smem.at[t + z]  # [bq, bk] (or [bk, bq]), [bk, hp]
        if query_rows:
            ds = ds.at[pl.ds(w * rows, rows), :] if rows < ds.shape[0] else ds
        else:  # dS^T: its query columns sliced, then read transposed
            ds = ds.at[:, pl.ds(w * rows, rows)] if rows < ds.shape[1] else ds
            ds = ds.transpose((1, 0))
        if width < k_t.shape[1]:
            k_t = k_t.at[:, pl.ds(c0, width)]
        pairs.append((ds, k_t))  # ds @ k: [rows, width]
    return pairs


def issue_share(
    s, w: int, k_smem, part: tuple[int, int], acc_ref, z=0, query_rows=False, piece=(0, 1)
):
    """Issues consumer `w`'s slice (or its column `piece`, as share_pairs) of this
    step's dQ share into `acc_ref` (float32, unscaled: backward.py scales the sum), once
    every consumer's dS^T is in (awaited by the first piece); the caller awaits the
    wgmmas."""
    if piece[0] == 0:
        plgpu.barrier_wait(s["ds_ready"])  # every consumer's dS^T is in
    for a, b in share_pairs(s, w, k_smem, part, z, query_rows, piece):
        plgpu.wgmma(acc_ref, a, b)


def piece_shape(part: tuple[int, int], pieces: int) -> tuple[int, int]:
    """[rows, cols / pieces]: the accumulator of one column piece of a share slice."""
    return part[0], part[1] // pieces


def dq_share(
    s,
    step,
    w: int,
    k_smem,
    part: tuple[int, int],
    z=0,
    query_rows=False,
    pieces: int = 1,
    zero=None,
):
    """Consumer `w`'s slice of this step's dQ share, computed alone (after dK's and dV's
    wait) in `pieces` column pieces, one after another, and handed to the writer; each
    piece's accumulator starts from `zero` (pipeline.held_zero, or None)."""
    for index in range(pieces):

        def mma(acc_ref, index=index):
            start_from(zero, acc_ref)
            issue_share(s, w, k_smem, part, acc_ref, z, query_rows, (index, pieces))
            return acc_ref[...]  # awaits the wgmmas

        share = pl.run_scoped(mma, plgpu.ACC(piece_shape(part, pieces), jnp.float32))
        hand_share(s, step, w, share, (index, pieces))


def hand_share(s, step, w: int, share, piece=(0, 1)):
    """Stores consumer `w`'s share slice (or its column `piece`, as share_pairs) in this
    step's slot; the first piece waits for the slot, and the last frees the dS^T tiles
    (the share's wgmmas have read them) and hands the slot to the writer."""
    index, count = piece
    if index == count - 1:
        plgpu.barrier_arrive(s["ds_free"])  # done reading the dS^T tiles
    cols = None
    if count > 1:
        width = s["share"].shape[-1] // count
        cols = pl.ds(index * width, width)
    _to_writer(s, step, w, share, index == 0, index == count - 1, cols)


def _to_writer(s, step, part: int, value, first: bool, last: bool, cols=None):
    """Stores `value` in part `part` (its columns `cols`, or all) of this step's writer
    slot: the first store of a step waits for the slot, and the last hands it over."""
    slots = s["share"].shape[0]
    slot = lax.rem(step, jnp.int32(slots))
    if first:

        @pl.when(step >= slots)  # the writer has sent this slot's share of `slots` steps back
        def _():
            plgpu.barrier_wait(s["share_free"].at[slot])

    dst = s["share"].at[slot, part]
    dst = dst if cols is None else dst.at[:, cols]
    dst[...] = value
    if last:
        plgpu.commit_smem()  # visible to the writer's TMA
        plgpu.barrier_arrive(s["share_ready"].at[slot])


# --- chained_share: each consumer's share over its own key tile, consumer 1 adding
# consumer 0's (MosaicBwdConfig.chained_share) -------------------------------------


def publish_own_ds(s, w: int, ds_t):
    """Consumer `w` stores its dS^T tile [block_kv, block_q] for its own share only: the
    last step's share wgmmas, which read the buffer, were awaited before their hand-over."""
    s["ds"].at[w][...] = ds_t
    plgpu.commit_smem()  # visible to the wgmma's async reads


def chained_pair(s, w: int, k_smem, p: int, part: tuple[int, int], z=0):
    """(A, B) of consumer `w`'s part `p` of the share over its own key tile: of the
    unchained slice `p` (share_pairs, one pair a key tile), the pair of tile `w`."""
    return share_pairs(s, p, k_smem, part, z)[w]


def chained_start(s, w: int, p: int, part: tuple[int, int]):
    """What consumer `w`'s part `p` starts from: zeros for consumer 0; for consumer 1,
    consumer 0's sum of the part, awaited and read (its buffer then freed)."""
    if w == 0:
        return plgpu.layout_cast(jnp.zeros(part, jnp.float32), plgpu.Layout.WGMMA)
    plgpu.barrier_wait(s["lead_ready"].at[p])
    start = plgpu.load(s["lead"].at[p], layout=plgpu.Layout.WGMMA)
    plgpu.barrier_arrive(s["lead_free"].at[p])  # every thread has read its share of it
    return start


def chained_hand(s, step, w: int, p: int, value, parts: int):
    """Consumer 0 hands its part `p` to consumer 1 (once consumer 1 has read the last
    step's); consumer 1 stores its total in the writer's slot (the last part hands the
    slot over)."""
    if w == 1:
        _to_writer(s, step, p, value, p == 0, p == parts - 1)
        return

    @pl.when(step > 0)
    def _():
        plgpu.barrier_wait(s["lead_free"].at[p])

    s["lead"].at[p][...] = value
    plgpu.barrier_arrive(s["lead_ready"].at[p])


def chained_share(s, step, w: int, k_smem, part: tuple[int, int], ds_t, z=0, staged=False):
    """Consumer `w`'s parts of this step's share over its own key tile, computed alone
    (after dK's and dV's wait), each started from `chained_start` and handed on
    (`chained_hand`). `staged` (GPU interpret mode, where a wgmma cannot accumulate in
    place): each part's products land in a fresh accumulator, added to the start."""
    publish_own_ds(s, w, ds_t)
    parts = s["share"].shape[1]
    for p in range(parts):
        # The operands are indexed where they are used: a ref indexed outside
        # pl.run_state and closed over fails to lower there.
        def mma(acc_ref, p=p):
            plgpu.wgmma(acc_ref, *chained_pair(s, w, k_smem, p, part, z))

        if w == 1 and not staged:  # in place, on consumer 0's part
            value = pl.run_state(mma)(plgpu.ACC.init(chained_start(s, w, p, part)))
        else:

            def fresh(acc_ref):
                mma(acc_ref)
                return acc_ref[...]  # awaits the wgmma

            value = pl.run_scoped(fresh, plgpu.ACC(part, jnp.float32))
            if w == 1:  # staged: consumer 0's part added
                value = chained_start(s, w, p, part) + value
        chained_hand(s, step, w, p, value, parts)


def consumers_done(s, steps, w: int):
    """Every consumer is past its last dQ share (the K tiles may be overwritten), and
    the last phases of the barriers it waits on have been seen: the release of the
    dS^T tiles and the writer's slots, or (chained) consumer 1's reads of consumer 0's
    parts (consumer 0) and the writer's slot (consumer 1)."""
    plgpu.barrier_arrive(s["done"])
    plgpu.barrier_wait(s["done"])
    chained = "lead" in s
    if chained and w == 0:

        @pl.when(steps > 0)
        def _():
            for p in range(s["lead"].shape[0]):
                plgpu.barrier_wait(s["lead_free"].at[p])

        return
    if not chained:

        @pl.when(steps > 0)  # the last step's release of the dS^T tiles
        def _():
            plgpu.barrier_wait(s["ds_free"])

    slots = s["share"].shape[0]

    def drain(step, _):
        plgpu.barrier_wait(s["share_free"].at[lax.rem(step, jnp.int32(slots))])

    lax.fori_loop(jnp.maximum(0, steps - slots), steps, drain, None)


def semaphores(shape: tuple[int, ...], interpret: bool):
    """The turn counters [B, N, query tiles] of the module doc (None interpreted, where
    the CTAs run in order). Taken in warpgroup code: get_global has no warp lowering."""
    return None if interpret else pl.get_global(plgpu.SemaphoreType.REGULAR(shape))


def writer(
    order_refs,
    dq_ref,
    s,
    *,
    b,
    kv_head,
    span,
    group: int,
    steps,
    block_q: int,
    part: tuple[int, int],
    sems,
    interpret: bool,
    rotated: bool = False,
    descending: bool = False,
    registers: bool = True,
    parity: int | None = None,
):
    """The fourth warpgroup (or, with writer_warp, one warp of the producer's, which
    has set the registers already: `registers` False; with split_writer, one of two
    such warps, the one adding the steps of this `parity`, the shares of one slot):
    adds each step's shares to dQ [B, T, N, H] (float32) in the order of the module
    doc. `steps` is the CTA's query-tile range (lo, full_lo, full_hi, hi), walked for
    each head of the group as the consumers do: from hi - 1 down, or with `rotated`
    (rotated_adds) upward, in the order `turn` gives (`descending`: high_spans_first's
    grid, whose CTAs run in that order interpreted too). A slot is freed as soon as its
    TMA has read it; the turn is handed over once the adds have landed. `sems`:
    `semaphores`' (None interpreted)."""
    if registers:
        plgpu.set_max_registers(FUSED_SIDE_REGISTERS, action="decrease")
    index_ref, first_ref, last_ref = order_refs[:3]
    lo, full_lo, full_hi, hi = steps
    n = hi - lo
    rows, cols = part
    c = s["share"].shape[1]
    own = index_ref[b, span]
    rotating = rotated and not descending  # the rotated walk and `turn` (a ring table)
    count, ring, rot = rotation(order_refs, b, own) if rotating else (0, 0, 0)

    def windows(h, i):  # consumer w's slice of query tile i of head h in dQ
        out = []
        for w in range(c):
            r0 = i * block_q + (w * rows if rows < block_q else 0)
            c0 = w * cols if rows == block_q else 0  # columns split (w is 0 alone)
            out.append(dq_ref.at[b, pl.ds(r0, rows), h, pl.ds(c0, cols)])
        return out

    total = group * n  # steps: each head's query tiles, in the walk's order

    def tile_of(step):  # (query head, query tile) of a step (only called when n > 0)
        g, j = lax.div(step, n), lax.rem(step, n)
        h = kv_head * group + g
        if rotating:
            return h, walk_tile(j, lo, full_lo, full_hi, rot)
        return h, lo + j if rotated else hi - 1 - j

    # Interpreted, the CTAs run one by one in grid order (increasing span index, or
    # with high_spans_first decreasing, the turns' order), and the first of them
    # stores: the plain order's ranks, or the turns'.
    turns = rotated and (descending or not interpret)

    def rotated_order(i):
        """(rank, is last, is not last) of this CTA's add to query tile i (`turn`, or
        with `descending` decreasing span: descending_rank)."""
        if descending:
            return descending_rank(own, first_ref[b, i], last_ref[b, i])
        rank, visitors = turn(
            own, first_ref[b, i], last_ref[b, i], i, count, ring, full_lo, full_hi
        )
        return rank, rank == visitors - 1, rank != visitors - 1

    def hand_over(step):
        """The next visitor's turn at the tile of `step`, whose adds have landed."""
        h, i = tile_of(step)

        @pl.when(rotated_order(i)[2] if turns else own != last_ref[b, i])
        def _():
            plgpu.semaphore_signal(sems.at[b, h, i], 1, memory_scope="gpu")

    def add(step, _):
        h, i = tile_of(step)
        slot = lax.rem(step, jnp.int32(s["share"].shape[0]))
        shares = [s["share"].at[slot, w] for w in range(c)]
        if turns:
            rank, is_last, not_last = rotated_order(i)
        else:
            rank = own - first_ref[b, i]
        plgpu.barrier_wait(s["share_ready"].at[slot])
        dsts = windows(h, i)
        if interpret:  # read, add, store: the CTAs run one by one, in order
            old, old_ready = s["old"].at[parity or 0], s["old_ready"].at[parity or 0]

            @pl.when(rank > 0)
            def _():
                for w in range(c):
                    plgpu.copy_gmem_to_smem(dsts[w], old.at[w], old_ready)
                plgpu.barrier_wait(old_ready)
                for w in range(c):
                    shares[w][...] = old.at[w][...] + shares[w][...]
                plgpu.commit_smem()

            for w in range(c):
                plgpu.copy_smem_to_gmem(shares[w], dsts[w])
            plgpu.wait_smem_to_gmem(0, wait_read_only=False)
            plgpu.barrier_arrive(s["share_free"].at[slot])
            return
        sem = sems.at[b, h, i]
        if not turns:
            last = last_ref[b, i]
            is_last, not_last = own == last, own != last  # (no `not` in warp code)

        @pl.when((rank > 0) & not_last)
        def _():
            pl.semaphore_wait(sem, rank, decrement=False)  # our turn

        @pl.when((rank > 0) & is_last)
        def _():
            pl.semaphore_wait(sem, rank)  # our turn, and the count back to 0

        for w in range(c):
            plgpu.copy_smem_to_gmem(shares[w], dsts[w], predicate=rank == 0, commit_group=False)
            plgpu.copy_smem_to_gmem(
                shares[w], dsts[w], predicate=rank > 0, commit_group=False, reduction_op="add"
            )
        plgpu.commit_smem_to_gmem_group()
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the slot is read out: free it
        plgpu.barrier_arrive(s["share_free"].at[slot])
        # The next visitor's turn as soon as the adds have landed: each CTA of a head
        # waits on the one before it, so a hand-over put off by a step (as until
        # 8d64c73) delays every later span's adds by a step more than the last (at
        # once: 1.43x the fused backward at head dim 128 causal 8k, module doc).
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)
        hand_over(step)

    if parity is None:
        lax.fori_loop(0, total, add, None)
    else:  # every other step: the slot of this parity (SLOTS is 2)
        mine = lax.div(total + 1 - parity, 2)  # (not `count`: rotated_order reads that)
        lax.fori_loop(0, mine, lambda k, carry: add(2 * k + parity, carry), None)

"""The persistent forward's last round split by keys (`MosaicConfig.split_tail`).

A persistent grid of P CTAs walks E items in rounds of P; when P does not divide E, the
last round has r = E mod P items and P - r SMs wait for them (at 16k tokens a batch
every non-causal grid point has 2048 or 4096 equal items on 132 SMs: 15.5 or 31.03
rounds, a fill of 0.970; benchmarks/launch_sim.py). Split instead, the last r items'
key tiles, laid end to end (r x key tiles steps), go to the P CTAs in P equal runs
(stream-K over the tail): each run covers at most two items' pieces, since a run is no
longer than one item. A piece is an item's rows over some of its key tiles; the kernel
writes its O (normalised by its own row sums, float32) and its logsumexp apart, and
`combine` below merges an item's pieces in a fixed order (the logsumexps' weights)
into O and the logsumexp: the same result up to float32 rounding, and the same bits
from call to call. With `MosaicConfig.tail_fixup` the kernel merges them itself (stream-K's
fix-up): an item's piece of its first key tiles (k = 0, the last piece its CTA walks, or
its first where the run starts at the item) awaits the others, which each CTA walks
first in its run and hands over through global memory and a semaphore, and writes O
and the logsumexp; no merge after the kernel.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax

# The pieces a CTA's run may hold: a run is at most one item long, so it ends in the
# item it starts in or in the next.
PIECES_PER_CTA = 2
# The columns of a piece's row of `TailPlan.pieces`: its item, first and end key tile, 1
# if it exists; for tail_fixup its item's index among the split items (n), its place
# among that item's pieces in key order (k; 0 merges the others) and their count.
PIECE_COLS = ("item", "first", "end", "exists", "n", "k", "count")


@dataclasses.dataclass(frozen=True)
class TailPlan:
    """rounds: the whole rounds every CTA walks first. pieces: [P, 2, 7] int32, each
    CTA's pieces (PIECE_COLS). items: the split items, in order; parts: [r, max pieces,
    2] (CTA, piece) of each item's pieces in key order and valid: [r, max pieces] which
    of them exist."""

    rounds: int
    pieces: np.ndarray
    items: np.ndarray
    parts: np.ndarray
    valid: np.ndarray


def plan(num_items: int, num_ctas: int, key_tiles: int) -> TailPlan | None:
    """The split of the last round of `num_items` items, each `key_tiles` tiles long (key
    tiles in the forward, query tiles in the backward's), over `num_ctas` CTAs (or SMs);
    None where the rounds are whole (nothing to split)."""
    rounds, r = divmod(num_items, num_ctas)
    if r == 0 or key_tiles == 0:
        return None
    steps = r * key_tiles  # the tail's key tiles, item after item
    bounds = [c * steps // num_ctas for c in range(num_ctas + 1)]
    pieces = np.zeros((num_ctas, PIECES_PER_CTA, len(PIECE_COLS)), np.int32)
    by_item: dict[int, list[tuple[int, int]]] = {}
    for cta in range(num_ctas):
        start, end, slot = bounds[cta], bounds[cta + 1], 0
        while start < end:
            k, lo = divmod(start, key_tiles)
            hi = min(end - k * key_tiles, key_tiles)
            item = rounds * num_ctas + k
            pieces[cta, slot, :4] = (item, lo, hi, 1)
            by_item.setdefault(item, []).append((cta, slot))
            start, slot = k * key_tiles + hi, slot + 1
    items = np.array(sorted(by_item), np.int32)
    width = max(len(p) for p in by_item.values())
    parts = np.zeros((len(items), width, 2), np.int32)
    valid = np.zeros((len(items), width), bool)
    for n, item in enumerate(items):
        mine = by_item[int(item)]  # in CTA order, so in key order: the first has key 0
        for m, part in enumerate(mine):
            parts[n, m], valid[n, m] = part, True
            pieces[part[0], part[1], 4:] = (n, m, len(mine))
    return TailPlan(rounds, pieces, items, parts, valid)


def item_coords(items: np.ndarray, heads: int, batch: int, num_q_tiles: int, causal: bool):
    """(batch, head, query tile) of persistent items: fwd_kernel's `item_at`, on the host
    (causal: tile-major from the bottom tile; else a (batch, head)'s tiles together)."""
    if causal:
        t, rest = np.divmod(items, heads * batch)
        h, b = np.divmod(rest, batch)
        return b, h, num_q_tiles - 1 - t
    rest, t = np.divmod(items, num_q_tiles)
    b, h = np.divmod(rest, heads)
    return b, h, t


def per_tile(tail: TailPlan, coords):
    """The plan and coordinates of a grid of clusters (`MosaicConfig.kv_multicast`) by
    tile: each item is a pair of query tiles (`coords` give the pair's index, from
    `item_coords` over pairs), walked by a cluster of two CTAs, a tile each; a piece's
    output is a CTA's, at row cluster * 2 + its rank (fwd_kernel's `own`). Each split
    item becomes two, the cluster's first tile's then its second's."""
    cta, slot = tail.parts[..., 0], tail.parts[..., 1]
    parts = np.concatenate([np.stack([cta * 2 + rank, slot], axis=-1) for rank in (0, 1)])
    b, h, pair = coords
    coords = (
        np.concatenate([b, b]),
        np.concatenate([h, h]),
        np.concatenate([pair * 2, pair * 2 + 1]),
    )
    tail = dataclasses.replace(
        tail,
        items=np.concatenate([tail.items, tail.items]),
        parts=parts.astype(np.int32),
        valid=np.concatenate([tail.valid, tail.valid]),
    )
    return tail, coords


def combine(o, lse, piece_o, piece_lse, tail: TailPlan, coords, rows: int):
    """O [B, T, N, H] and the logsumexp [B, N, T] with the split items' rows merged from
    their pieces (piece_o [P, 2, rows, H] float32, piece_lse [P, 2, rows]): each piece
    weighs exp(its logsumexp - the item's); a row no piece's key reached stays 0 with
    logsumexp -inf."""
    cta, slot = tail.parts[..., 0], tail.parts[..., 1]
    valid = jnp.asarray(tail.valid)[..., None]  # [r, pieces, 1]
    part_lse = jnp.where(valid, piece_lse[cta, slot], -jnp.inf)  # [r, pieces, rows]
    top = part_lse.max(axis=1)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weight = jnp.exp(part_lse - top[:, None])  # 0 for a piece (row) that saw no key
    total = weight.sum(axis=1)
    seen = total > 0
    merged_lse = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    part_o = jnp.where(valid[..., None], piece_o[cta, slot], 0.0)  # [r, pieces, rows, H]
    merged_o = (weight[..., None] * part_o).sum(axis=1)
    merged_o = merged_o / jnp.where(seen, total, 1.0)[..., None]
    b, h, t = (np.asarray(x)[:, None] for x in coords)
    row = t * rows + np.arange(rows)[None, :]  # [r, rows]
    o = o.at[b, row, h].set(merged_o.astype(o.dtype))
    lse = lse.at[b, h, row].set(merged_lse)
    return o, lse


def merge_pair(o, lse, o_j, lse_j):
    """tail_fixup's merge of two pieces of the same rows (O [rows, H] float32, each
    normalised by its own row sums, and the logsumexp [rows]): each weighs exp(its
    logsumexp - the pair's); a row neither saw stays 0 with -inf. The kernel's first
    piece folds the later ones in with this, one after another in key order (it traces
    in a Mosaic GPU kernel as on CPU, where its test runs)."""
    top = jnp.maximum(lse, lse_j)
    top = jnp.where(top == -jnp.inf, 0.0, top)
    w, w_j = jnp.exp(lse - top), jnp.exp(lse_j - top)
    total = w + w_j
    seen = total > 0
    total = jnp.where(seen, total, 1.0)
    w, w_j = w / total, w_j / total
    o = o * lax.broadcast_in_dim(w, o.shape, [0]) + o_j * lax.broadcast_in_dim(w_j, o.shape, [0])
    return o, jnp.where(seen, top + jnp.log(total), -jnp.inf)


# The backward's half: the dK/dV (fused) grid's last wave, split by query tiles. Its grid
# is not persistent, so each piece is a CTA of its own, launched after the whole CTAs in
# the same order (a piece waits only on lower key spans, launched before it): a span of
# the last wave goes in m equal pieces, m chosen so that the pieces' waves end soonest.


@dataclasses.dataclass(frozen=True)
class PieceSplit:
    """whole: the CTAs that run whole, the first in launch order. table: [pieces, 3]
    int32 (item, first tile, end tile) in launch order. items: the split items; rows:
    [r, m] each one's pieces' rows in `table`, in the order of their tiles."""

    whole: int
    table: np.ndarray
    items: np.ndarray
    rows: np.ndarray


def even_pieces(num_items: int, sms: int, tiles: int, cta_steps: int = 2) -> PieceSplit | None:
    """The split of the last wave of `num_items` CTAs of `tiles` steps each on `sms`
    SMs: each of its r CTAs in m pieces of about tiles / m steps, m the count (up to
    `tiles`) whose ceil(r m / sms) waves of pieces, each `cta_steps` longer for a CTA's
    fixed costs, end first. None where the waves are whole or splitting gains nothing."""
    whole = num_items // sms * sms
    r = num_items - whole
    if r == 0 or tiles < 2:
        return None
    cost = lambda m: -(-r * m // sms) * (-(-tiles // m) + cta_steps)  # noqa: E731
    m = min(range(1, tiles + 1), key=lambda m: (cost(m), m))
    if m == 1:
        return None
    bounds = [j * tiles // m for j in range(m + 1)]
    items = np.arange(whole, num_items, dtype=np.int32)
    table = np.array(
        [(item, bounds[j], bounds[j + 1]) for item in items for j in range(m)], np.int32
    )
    rows = np.arange(r * m, dtype=np.int32).reshape(r, m)
    return PieceSplit(whole, table, items, rows)


def span_coords(
    items, spans: int, batch: int, band: int = 1, div=np.floor_divide, rem=np.remainder
):
    """(batch, key/value head, key span) of dK/dV CTAs by launch position: the plain
    grid (heads, spans, batch) in order, or in bands of `band` heads (head bands, spans,
    heads of a band, batch: span_band's order). One decode for the host (numpy arrays)
    and the kernel (int32 scalars, with `div` and `rem` of lax)."""
    b, rest = rem(items, batch), div(items, batch)
    in_band, rest = rem(rest, band), div(rest, band)
    return b, div(rest, spans) * band + in_band, rem(rest, spans)


def kernel_span_coords(item, spans: int, batch: int, band: int):
    """span_coords on the kernel's int32 scalar (dkdv_kernel): lax's truncating div and
    rem, which are numpy's floor forms on positions, never negative."""
    return span_coords(
        item,
        spans,
        batch,
        band,
        div=lambda x, d: lax.div(x, jnp.int32(d)),
        rem=lambda x, d: lax.rem(x, jnp.int32(d)),
    )


def sum_pieces(out, pieces, split: PieceSplit, coords, keys: int):
    """`out` [B, S, K, H] with each split span's keys the sum of its pieces' float32
    partials (`pieces` [n, keys, H]) in the order of their query tiles; `coords`: the
    split spans' (batch, key/value head, span)."""
    part = pieces[split.rows]  # [r, m, keys, H]
    total = part[:, 0]
    for j in range(1, part.shape[1]):  # a fixed order: the same bits every call
        total = total + part[:, j]
    b, h, span = (np.asarray(x)[:, None] for x in coords)
    key = span * keys + np.arange(keys)[None, :]
    return out.at[b, key, h].set(total.astype(out.dtype))

"""Pieces shared by the Triton-lowered forward and backward kernels."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_flash import masks
from pallas_flash.logits import Logits, base2_scores


def dot(a, b, *, trans_a: bool = False, trans_b: bool = False):
    """a @ b with float32 accumulation; float32 operands use exact (IEEE) products.

    Triton's default for float32 operands is TF32, about 1e-3 relative error; the
    float32 path promises float32 accuracy, so it asks for HIGHEST.
    """
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((0,) if trans_a else (1,), (1,) if trans_b else (0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _view(ref, start, block: int, head):
    if head is None:  # ref is [seq_padded, head_dim_padded]
        return ref.at[pl.ds(start, block), :]
    return ref.at[pl.ds(start, block), head, :]  # ref is [seq_padded, heads, hd_padded]


def load_tile(ref, start, block: int, seq: int, head_dim: int, head=None):
    """Loads rows [start, start + block) of a [seq_padded, (heads,) head_dim_padded] ref.

    Rows at or past `seq` and columns at or past `head_dim` read as 0: never garbage,
    since a NaN in a masked-out V row would still poison P @ V (0 * NaN = NaN).
    The masks are emitted only when the shapes make them necessary.
    """
    hp = ref.shape[-1]
    mask = None
    if seq % block:
        mask = (start + jnp.arange(block) < seq)[:, None]
    if head_dim != hp:
        cols = (jnp.arange(hp) < head_dim)[None, :]
        mask = cols if mask is None else mask & cols
    view = _view(ref, start, block, head)
    if mask is None:
        return plgpu.load(view)
    return plgpu.load(view, mask=mask, other=0.0)


def store_tile(ref, start, value, seq: int, head_dim: int, head=None):
    """Stores a [block, head_dim_padded] tile at rows [start, ...), skipping padding."""
    block, hp = value.shape
    mask = None
    if seq % block:
        mask = (start + jnp.arange(block) < seq)[:, None]
    if head_dim != hp:
        cols = (jnp.arange(hp) < head_dim)[None, :]
        mask = cols if mask is None else mask & cols
    plgpu.store(_view(ref, start, block, head), value.astype(ref.dtype), mask=mask)


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def interval_loops(body, bounds, carry):
    """Runs body over the unmasked tiles [full_lo, full_hi), then over the boundary tiles
    [lo, full_lo) and [full_hi, hi), masked, in one loop.

    `body(j, carry, masked=...)`; `bounds` is masks.kv_tile_range's or q_tile_range's.
    Two loops, not three (masked, unmasked, masked): with segment ids every bound is
    traced, so all three loops were emitted, and the backward at T = 8k ran 1.16x the
    unmasked time with a single segment, where the third loop runs no iteration
    (benchmarks/results/masks-fa74dc8.jsonl). With two loops it is 1.01x, and the causal
    backward, which had three loops too, went from 4.23 to 4.00 ms
    (masks-38e3e75.jsonl, the next run on the same H200).
    """
    lo, full_lo, full_hi, hi = bounds
    carry = lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False), carry)
    before = full_lo - lo  # boundary tiles before the unmasked run, then those after it

    def boundary(t, carry):
        j = jnp.where(t < before, lo + t, full_hi + t - before)
        return body(j, carry, masked=True)

    return lax.fori_loop(0, before + (hi - full_hi), boundary, carry)


def tile_bounds(
    spec, ranges_ref, tile, start, block_own, block_other, q_len, kv_len, diag, *, over_kv: bool
):
    """This tile's loop bounds: from the mask spec, intersected with segment metadata."""
    fn = masks.kv_tile_range if over_kv else masks.q_tile_range
    bq, bk = (block_own, block_other) if over_kv else (block_other, block_own)
    bounds = fn(spec, start, bq, bk, q_len, kv_len, diag)
    if ranges_ref is None:
        return bounds
    seg = tuple(ranges_ref[tile, c] for c in range(4))
    return masks.intersect(bounds, seg)


def segment_inputs(
    segments, block_q: int, block_kv: int, t_pad: int, s_pad: int, batch_of, *, own_is_q: bool
):
    """BlockSpecs and arrays for the segment ids (padded to whole tiles) and tile ranges.

    The kernel gets both id vectors of its batch element whole, and the [n_tiles, 4]
    interval table of its own tiles (query tiles when `own_is_q`, else key tiles).
    """
    if segments is None:
        return [], []
    q_seg, kv_seg = (x.astype(jnp.int32) for x in segments)
    per_q, per_kv = masks.segment_tile_ranges(q_seg, kv_seg, block_q, block_kv)
    ranges = per_q if own_is_q else per_kv
    q_seg = jnp.pad(q_seg, [(0, 0), (0, t_pad - q_seg.shape[1])], mode="edge")
    kv_seg = jnp.pad(kv_seg, [(0, 0), (0, s_pad - kv_seg.shape[1])], mode="edge")

    def spec_for(x):
        return pl.BlockSpec((None, *x.shape[1:]), lambda *g: (batch_of(*g),) + (0,) * (x.ndim - 1))

    args = [q_seg, kv_seg, ranges]
    return [spec_for(x) for x in args], args


def dropout_inputs(seeds):
    """BlockSpec and array for the two dropout seeds (every program reads both)."""
    if seeds is None:
        return [], []
    return [pl.BlockSpec((2,), lambda *grid: (0,))], [seeds]


def split_refs(rest, spec, dropout: bool, n_out: int, logits: Logits | None = None):
    """Splits a kernel's optional refs: (q_seg, kv_seg, ranges), seeds, bias, mask,
    (sparse counts, sparse indices), outputs.

    `rest` is [q_seg, kv_seg, ranges (with segments)], [seeds (with dropout)], [bias],
    [mask], [counts, indices (block-sparse)], *outputs.
    """
    logits = logits or Logits()
    ins, outs = list(rest[:-n_out]), list(rest[-n_out:])
    segs = (ins.pop(0), ins.pop(0), ins.pop(0)) if spec.segments else (None, None, None)
    seeds = ins.pop(0) if dropout else None
    bias = ins.pop(0) if logits.bias_dims else None
    mask = ins.pop(0) if logits.mask_dims else None
    sparse = (ins.pop(0), ins.pop(0)) if spec.block_sparse else None
    assert not ins, "unexpected kernel inputs"
    return segs, seeds, bias, mask, sparse, outs


def visit_tiles(body, spec, sparse, head, tile, bounds, carry):
    """Runs `body(j, carry, masked=...)` over the tiles this program must visit;
    `masked` says whether the structural masks (causal, window, lengths, segments) cut
    the tile. A user's boolean mask is applied by the body on every tile.

    Dense: the interval loops of `bounds`.
    Block-sparse: the precomputed list of this tile (`sparse` = counts, indices refs of
    [heads, n_tiles, 2] / [heads, n_tiles, n_other]): unmasked entries first, then masked.
    """
    if sparse is None:
        return interval_loops(body, bounds, carry)
    counts_ref, index_ref = sparse
    h = head if spec.sparse_per_head else jnp.int32(0)
    n_full, n_all = counts_ref[h, tile, 0], counts_ref[h, tile, 1]

    def listed(t, carry, *, masked):
        return body(index_ref[h, tile, t], carry, masked=masked)

    carry = lax.fori_loop(0, n_full, functools.partial(listed, masked=False), carry)
    return lax.fori_loop(n_full, n_all, functools.partial(listed, masked=True), carry)


def sparse_inputs(lists, batch_of, head_of, head_block=None):
    """BlockSpecs and arrays for one direction's block-sparse visit lists."""
    if lists is None:
        return [], []
    counts, index = lists  # [B, Nl, n_own, 2], [B, Nl, n_own, n_other]
    per_head = counts.shape[1] > 1
    hb = head_block if (head_block and per_head) else 1

    def spec_for(x):
        block = (None, hb, *x.shape[2:])
        return pl.BlockSpec(block, lambda *g: (batch_of(*g), head_of(*g) if per_head else 0, 0, 0))

    return [spec_for(counts), spec_for(index)], [counts, index]


def load_broadcast_tile(
    ref, head, r0, c0, block_r: int, block_c: int, seq_r: int, seq_c: int, dims
):
    """[block_r, block_c] tile of a [heads?, R, C] bias/mask ref that broadcasts over
    [B, N, T, S]: `dims` says which are full; a dim of size 1 is broadcast. Positions
    past the real extent read as 0."""
    _, _, full_r, full_c = dims
    rs = pl.ds(r0, block_r) if full_r else pl.ds(0, 1)
    cs = pl.ds(c0, block_c) if full_c else pl.ds(0, 1)
    mask = None
    if full_r and seq_r % block_r:
        mask = (r0 + jnp.arange(block_r) < seq_r)[:, None]
    if full_c and seq_c % block_c:
        cols = (c0 + jnp.arange(block_c) < seq_c)[None, :]
        mask = cols if mask is None else mask & cols
    if isinstance(head, int):
        head = jnp.int32(head)  # a traced-style index: interpret mode rejects a bare int
    view = ref.at[rs, cs] if head is None else ref.at[head, rs, cs]
    x = plgpu.load(view) if mask is None else plgpu.load(view, mask=mask, other=0)
    return jnp.broadcast_to(x, (block_r, block_c))


def load_mask_tile(
    ref, head, r0, c0, block_r: int, block_c: int, seq_r: int, seq_c: int, dims, axis="auto"
):
    """[block_r, block_c] bool tile of the user's mask (True = attend); rows are query
    rows and columns keys at every call site (the dK/dV kernel's too: it loads the
    (query tile, key tile) pair it recomputes, untransposed).

    The mask arrives in the form masks.mask_word_axis picks (vjp.kernel_mask packs it):
    - varying along T: bit-packed along the rows (masks.pack_mask_bits, axis=-2). The
      tile's [block_r / 16, block_c] words are loaded and word w's bit b is spread to row
      16 w + b by a broadcast, an AND and a reshape that merges leading axes only.
    - constant along T, varying along S: bit-packed along the keys (axis=-1), one row of
      [block_c / 16] words, each spread over its 16 columns and broadcast over the rows.
    - neither: int8 [.., 1, 1], broadcast.
    Words past the packed extent read as 0, so rows past T and keys past S are masked out.
    `axis` overrides that choice (benchmarks/mask_layouts.py times the alternatives).
    """
    axis = masks.mask_word_axis(dims) if axis == "auto" else axis
    if axis is None:
        x = load_broadcast_tile(ref, head, r0, c0, block_r, block_c, seq_r, seq_c, dims)
        return x != 0
    w = masks.MASK_WORD_BITS
    if (block_r if axis == -2 else block_c) % w:
        raise ValueError(
            f"a mask packed along {'the query rows' if axis == -2 else 'the keys'} needs "
            f"tiles of whole {w}-bit words, got a {block_r} x {block_c} tile"
        )
    bit = 1 << jnp.arange(w, dtype=jnp.int32)
    if axis == -2:
        words = load_broadcast_tile(
            ref, head, r0 // w, c0, block_r // w, block_c, -(-seq_r // w), seq_c, dims
        ).astype(jnp.int32)  # [block_r / w, block_c]
        bits = words[:, None, :] & bit[None, :, None]
    else:
        words = load_broadcast_tile(
            ref, head, r0, c0 // w, block_r, block_c // w, seq_r, -(-seq_c // w), dims
        ).astype(jnp.int32)  # [block_r, block_c / w]
        bits = words[:, :, None] & bit[None, None, :]
    return bits.reshape(block_r, block_c) != 0


def mask_inputs(
    mask, dims, t_pad: int, s_pad: int, batch_of, head_of, head_block=None, axis="auto"
):
    """BlockSpec and array for the user's mask, in load_mask_tile's form: the packed axis
    has t_pad / 16 or s_pad / 16 words per (batch, head) block."""
    axis = masks.mask_word_axis(dims) if axis == "auto" else axis
    w = masks.MASK_WORD_BITS
    rows, cols = t_pad, s_pad
    if axis is not None and (t_pad if axis == -2 else s_pad) % w:
        raise ValueError(f"padded lengths {t_pad} x {s_pad} are not whole {w}-bit mask words")
    if axis == -2:
        rows = t_pad // w
    elif axis == -1:
        cols = s_pad // w
    return broadcast_inputs(mask, dims, rows, cols, batch_of, head_of, head_block)


def scores(q, k, *, scale: float, bias=None, softcap=None):
    """Base-2 scores of a tile [block_q, block_kv], and tanh(s / cap) when soft-capped."""
    return base2_scores(dot(q, k, trans_b=True), scale=scale, bias=bias, softcap=softcap)


def broadcast_inputs(x, dims, t_pad: int, s_pad: int, batch_of, head_of, head_block=None):
    """BlockSpec and array for a bias or mask broadcastable to [B, N, T, S].

    The kernel sees its (batch, head) slice, [T_pad or 1, S_pad or 1] (with a leading
    head axis of `head_block` when given: the dK/dV kernel's query-head group).
    """
    if x is None:
        return [], []
    fb, fn, ft, fs = dims
    rows, cols = (t_pad if ft else 1), (s_pad if fs else 1)
    if head_block is None:
        block = (None, None, rows, cols)
    else:
        block = (None, head_block if fn else 1, rows, cols)

    def index(*grid):
        return (batch_of(*grid) if fb else 0, head_of(*grid) if fn else 0, 0, 0)

    return [pl.BlockSpec(block, index)], [x]

"""Which (query, key) pairs attend: the mask description and its per-tile arithmetic.

The kernels never build a dense mask. They receive a `MaskSpec` (static), the per-batch
valid lengths and, for segment ids, per-tile metadata (dynamic, linear in the sequence
length), and from those derive for each tile pair whether it is skipped (no loads, no
FLOPs), fully visible (no mask applied) or on a boundary (masked element-wise). Every
constraint makes the visible key tiles of a query tile an interval, and the fully
visible ones a sub-interval: a kernel loops over the unmasked tiles, then over the
boundary tiles on either side of them, masked.
The reference builds the same mask densely with `dense_mask`.

Positions. Query row i and key column j are aligned through a per-batch `offset`:
the diagonal of row i is column i + offset. With jax.nn's (top-left) alignment the
offset is 0; with bottom-right alignment (KV-cache decoding, where the queries are the
last T of the keys) it is kv_len - q_len of that batch element.

    top-left, T=3, S=5          bottom-right, T=3, S=5
        k0 k1 k2 k3 k4              k0 k1 k2 k3 k4
    q0   x  .  .  .  .          q0   x  x  x  .  .
    q1   x  x  .  .  .          q1   x  x  x  x  .
    q2   x  x  x  .  .          q2   x  x  x  x  x

Causal keeps j <= diag; a local window (left, right) keeps diag - left <= j <= diag + right
(jax.nn's meaning); segment ids keep pairs with equal ids; lengths drop keys j >= kv_len
and make query rows i >= q_len padding (output 0).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True, kw_only=True)
class MaskSpec:
    """The static part of a mask: causal and its alignment, window, whether segments exist."""

    causal: bool = False
    bottom_right: bool = False
    local_window: tuple[int, int] | None = None
    segments: bool = False
    # Block-sparse layout: None, or whether it has one layout per query head.
    sparse_per_head: bool | None = None
    # The layout's block (query, key); kernel tiles divide it.
    sparse_block: tuple[int, int] | None = None

    @property
    def block_sparse(self) -> bool:
        return self.sparse_per_head is not None

    @property
    def uses_offset(self) -> bool:
        return self.bottom_right and (self.causal or self.local_window is not None)

    @property
    def left(self) -> int | None:
        """How far left of the diagonal a row sees (None: unbounded)."""
        return None if self.local_window is None else self.local_window[0]

    @property
    def right(self) -> int | None:
        """How far right of the diagonal a row sees (None: unbounded)."""
        bounds = [
            b
            for b in (
                0 if self.causal else None,
                None if self.local_window is None else self.local_window[1],
            )
            if b is not None
        ]
        return min(bounds) if bounds else None


def check_shapes(q, k, q_len, kv_len, segments) -> None:
    """Raises ValueError naming the argument whose shape does not fit q [B, T, N, H] and
    k [B, S, K, H]: the lengths must be [B] and the segment ids [B, T] and [B, S]. The
    API checks the same before dispatch; each kernel family's forward and backward also
    checks, since they are called directly too (tests, benchmarks), where ids of another
    batch size would broadcast into a silently wrong mask."""
    B, T = q.shape[:2]
    S = k.shape[1]
    if k.shape[0] != B:
        raise ValueError(f"k must have batch {B} as q, got shape {tuple(k.shape)}")
    wants = [("q_len", q_len, (B,)), ("kv_len", kv_len, (B,))]
    if segments is not None:
        if len(segments) != 2:
            raise ValueError("segments must be a pair (query ids [B, T], key ids [B, S])")
        wants += [("segments[0] (query ids)", segments[0], (B, T))]
        wants += [("segments[1] (key ids)", segments[1], (B, S))]
    for name, x, want in wants:
        if tuple(x.shape) != want:
            raise ValueError(f"{name} must have shape {want}, got {tuple(x.shape)}")


def lengths_or_full(
    query_seq_lengths: jax.Array | None,
    key_value_seq_lengths: jax.Array | None,
    batch: int,
    seq_q: int,
    seq_kv: int,
) -> tuple[jax.Array, jax.Array]:
    """Per-batch valid lengths as int32 [B], clipped to [0, T] and [0, S]."""

    def one(lengths, full):
        if lengths is None:
            return jnp.full((batch,), full, jnp.int32)
        return jnp.clip(lengths.astype(jnp.int32), 0, full)

    return one(query_seq_lengths, seq_q), one(key_value_seq_lengths, seq_kv)


def offset(spec: MaskSpec, q_len, kv_len):
    """Column of row 0's diagonal (see module doc)."""
    if spec.uses_offset:
        return kv_len - q_len
    return jnp.zeros_like(kv_len)


def dense_mask(
    spec: MaskSpec,
    seq_q: int,
    seq_kv: int,
    q_len: jax.Array,
    kv_len: jax.Array,
    *,
    segment_ids: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """The full boolean mask, [B, 1, T, S]: True where query i may attend key j."""
    rows = jnp.arange(seq_q)[None, :, None]
    cols = jnp.arange(seq_kv)[None, None, :]
    diag = offset(spec, q_len, kv_len)[:, None, None]
    seg = None if segment_ids is None else (segment_ids[0][:, :, None], segment_ids[1][:, None, :])
    keep = tile_mask(spec, rows, cols, kv_len[:, None, None], diag, seg)
    return jnp.broadcast_to(keep, (q_len.shape[0], seq_q, seq_kv))[:, None]


MASK_WORD_BITS = 16  # the Triton kernels' tiles are >= 16 long on both axes: whole words


def mask_word_axis(dims) -> int | None:
    """Along which axis the Triton kernels read a boolean mask bit-packed, from its
    `mask_dims` (which of [B, N, T, S] it has in full): -2, the query rows, when it varies
    along T; else -1, the keys, when it varies along S; else None (int8, broadcast).

    Why rows first: see pack_mask_bits."""
    if dims is None:
        return None
    if dims[2]:
        return -2
    if dims[3]:
        return -1
    return None


def pack_mask_bits(mask, *, axis: int):
    """A boolean mask -> int16 words holding 16 consecutive positions of `axis` each: bit
    b of word w is position 16 w + b along `axis`, which shrinks to ceil(n / 16); the bits
    past the end are False (masked out). `axis` is -2 (query rows) or -1 (keys) for the
    Triton kernels, which take the axis from mask_word_axis.

    Why bits: a tile costs 1/8 of the bytes of an int8 mask, and one XLA fusion packs the
    mask once per call (vjp.kernel_mask), shared by the forward and backward kernels.

    Why along the rows when the mask varies there: a [block_q, block_kv] tile then loads
    [block_q / 16, block_kv] words and spreads each over 16 rows, and the reshape back to
    the tile merges leading axes only, leaving the key axis (the tile's minor one) alone,
    where bits along the keys must split it (presumably what they pay for). On an H200
    at T = 8k (benchmarks/results/mask-layouts-a5fdc5b.jsonl, from benchmarks/mask_layouts.py)
    bits along the rows cost 1.16-1.18x the unmasked forward and 1.07-1.10x its backward,
    bits along the keys 1.29x and 1.14-1.23x. A mask constant along the rows but not the
    keys (key padding, [B, 1, 1, S]) is packed along the keys: its one row of words is
    broadcast over the tile's rows.
    """
    axis = axis % mask.ndim
    widths = [(0, 0)] * mask.ndim
    widths[axis] = (0, -mask.shape[axis] % MASK_WORD_BITS)
    bits = jnp.pad(mask, widths)
    bits = bits.reshape(*mask.shape[:axis], -1, MASK_WORD_BITS, *mask.shape[axis + 1 :])
    shifts = jnp.arange(MASK_WORD_BITS, dtype=jnp.uint32).reshape(
        MASK_WORD_BITS, *[1] * (mask.ndim - axis - 1)
    )
    words = (bits.astype(jnp.uint32) << shifts).sum(axis + 1)
    return lax.bitcast_convert_type(words.astype(jnp.uint16), jnp.int16)


def unpack_mask_bits(words, length: int, *, axis: int):
    """The inverse of pack_mask_bits: `axis` back to `length` positions (the tests check
    the packing with it)."""
    axis = axis % words.ndim
    shifts = jnp.arange(MASK_WORD_BITS, dtype=jnp.int32).reshape(
        MASK_WORD_BITS, *[1] * (words.ndim - axis - 1)
    )
    bits = (jnp.expand_dims(words.astype(jnp.int32), axis + 1) >> shifts) & 1
    bits = bits.reshape(*words.shape[:axis], -1, *words.shape[axis + 1 :])
    return lax.slice_in_dim(bits, 0, length, axis=axis) != 0


def tile_mask(spec: MaskSpec, rows, cols, kv_len, diag, segments=None):
    """Element mask of a tile from absolute positions `rows` [.., bq, 1], `cols` [.., 1, bk].

    `segments` is (query ids [.., bq, 1], key ids [.., 1, bk]) when the call has them.
    """
    keep = cols < kv_len
    if spec.right is not None:
        keep = keep & (cols <= rows + diag + spec.right)
    if spec.left is not None:
        keep = keep & (cols >= rows + diag - spec.left)
    if segments is not None:
        keep = keep & (segments[0] == segments[1])
    return keep


def has_row_bounds(spec: MaskSpec) -> bool:
    """Whether a row's visible keys depend on the row (causal or a window), beyond the
    key length every row shares: where `row_bounds` adds nothing to `tile_mask`."""
    return spec.right is not None or spec.left is not None


def row_bounds(spec: MaskSpec, rows, kv_len, diag):
    """The keys each row sees without segment ids, as absolute positions [lo, hi): lo is
    None when only the end bounds a row. `tile_mask` without segments equals
    `(lo <= cols) & (cols < hi)` (tests/test_masks.py), but that is one compare per
    element pair (two with a window's start) where `tile_mask` has up to three and their
    ands: the Mosaic forward's `row_bound_mask` computes the bounds once per row and
    compares tile columns to them."""
    hi = kv_len
    if spec.right is not None:
        hi = jnp.minimum(hi, rows + diag + spec.right + 1)
    lo = None if spec.left is None else rows + diag - spec.left
    return lo, hi


def _cdiv(a, b: int):
    return lax.div(a + (b - 1), b)


def _tiles(lo_any, hi_any, lo_all, hi_all, block: int):
    """Position intervals -> tile intervals (lo, full_lo, full_hi, hi), clamped to nest."""
    lo = lax.div(jnp.maximum(lo_any, 0), block)
    hi = jnp.maximum(_cdiv(jnp.maximum(hi_any, 0), block), lo)
    full_lo = jnp.clip(_cdiv(jnp.maximum(lo_all, 0), block), lo, hi)
    full_hi = jnp.clip(lax.div(jnp.maximum(hi_all, 0), block), full_lo, hi)
    return lo, full_lo, full_hi, hi


def intersect(a, b):
    """Intersection of two (lo, full_lo, full_hi, hi) tile intervals."""
    lo, hi = jnp.maximum(a[0], b[0]), jnp.minimum(a[3], b[3])
    hi = jnp.maximum(hi, lo)
    full_lo = jnp.clip(jnp.maximum(a[1], b[1]), lo, hi)
    full_hi = jnp.clip(jnp.minimum(a[2], b[2]), full_lo, hi)
    return lo, full_lo, full_hi, hi


def kv_tile_range(spec: MaskSpec, q0, block_q: int, block_kv: int, q_len, kv_len, diag):
    """Key/value tiles for the query tile starting at row q0: (lo, full_lo, full_hi, hi).

    Tiles [full_lo, full_hi) are visible to every row and need no mask; tiles in
    [lo, full_lo) and [full_hi, hi) need the element mask; the rest are skipped.
    """
    first, last = q0 + diag, q0 + block_q - 1 + diag  # diagonals of the first/last row
    hi_any, hi_all = kv_len, kv_len
    lo_any, lo_all = jnp.zeros_like(kv_len), jnp.zeros_like(kv_len)
    if spec.right is not None:
        hi_any = jnp.minimum(hi_any, last + spec.right + 1)
        hi_all = jnp.minimum(hi_all, first + spec.right + 1)
    if spec.left is not None:
        lo_any = jnp.maximum(lo_any, first - spec.left)
        lo_all = jnp.maximum(lo_all, last - spec.left)
    hi_any = jnp.where(q0 < q_len, hi_any, 0)  # padding-only query tiles do nothing
    return _tiles(lo_any, hi_any, lo_all, hi_all, block_kv)


def tile_range_table(
    fn, spec: MaskSpec, q_len, kv_len, num_tiles: int, block_q: int, block_kv: int, span: int
):
    """[B, num_tiles, 4] int32: `fn` (kv_tile_range or q_tile_range) of the tiles that start
    every `span` rows (or keys), for each batch element's lengths; computed in XLA."""
    starts = jnp.arange(num_tiles, dtype=jnp.int32) * span

    def per_batch(ql, kl):
        diag = offset(spec, ql, kl)
        return jax.vmap(lambda x0: jnp.stack(fn(spec, x0, block_q, block_kv, ql, kl, diag)))(starts)

    return jax.vmap(per_batch)(q_len, kv_len).astype(jnp.int32)


def q_tile_range(spec: MaskSpec, k0, block_q: int, block_kv: int, q_len, kv_len, diag):
    """Query tiles for the key tile starting at column k0: (lo, full_lo, full_hi, hi)."""
    k_last = k0 + block_kv - 1
    lo_any, lo_all = jnp.zeros_like(q_len), jnp.zeros_like(q_len)
    # Rows at or past q_len carry lse = +inf in the backward pass, so P is 0 there
    # without a mask: the tile holding the last valid row can still run unmasked.
    hi_any, hi_all = q_len, _cdiv(q_len, block_q) * block_q
    if spec.right is not None:  # row r sees column c when c <= r + diag + right
        lo_any = jnp.maximum(lo_any, k0 - diag - spec.right)
        lo_all = jnp.maximum(lo_all, k_last - diag - spec.right)
    if spec.left is not None:  # ... and when c >= r + diag - left
        hi_any = jnp.minimum(hi_any, k_last - diag + spec.left + 1)
        hi_all = jnp.minimum(hi_all, k0 - diag + spec.left + 1)
    hi_any = jnp.where(k0 < kv_len, hi_any, 0)  # a padding-only key tile does nothing
    hi_all = jnp.where(k_last < kv_len, hi_all, 0)  # one that runs past kv_len is masked
    return _tiles(lo_any, hi_any, lo_all, hi_all, block_q)


def segment_tile_ranges(q_seg, kv_seg, block_q: int, block_kv: int):
    """Per-tile intervals from segment ids, computed in XLA before the kernels.

    Returns ([B, nq, 4] key-tile intervals per query tile, [B, nk, 4] query-tile
    intervals per key tile), each row (lo, full_lo, full_hi, hi). When the ids are
    non-decreasing (packed sequences), tiles whose id ranges do not meet are skipped
    and tiles holding a single shared id need no mask; otherwise every tile is
    visited with the element mask. Linear in the sequence length.
    """
    return (
        _seg_ranges(q_seg, kv_seg, block_q, block_kv),
        _seg_ranges(kv_seg, q_seg, block_kv, block_q),
    )


def _tile_min_max(ids, block: int):
    B, n = ids.shape
    pad = -n % block
    ids = jnp.pad(ids, [(0, 0), (0, pad)], mode="edge").reshape(B, -1, block)
    return ids.min(-1), ids.max(-1)


def _seg_ranges(own, other, block_own: int, block_other: int):
    own_min, own_max = _tile_min_max(own, block_own)  # [B, n_own]
    oth_min, oth_max = _tile_min_max(other, block_other)  # [B, n_other]
    n_other = oth_min.shape[1]
    sorted_ = jnp.all(jnp.diff(other, axis=1) >= 0, axis=1)[:, None]  # [B, 1]
    # method="sort": one sort kernel. The default binary search is a while loop, which
    # on a GPU costs a device-to-host sync per step, in every forward and backward call.
    search = jax.vmap(
        lambda a, v, side: jnp.searchsorted(a, v, side=side, method="sort"), in_axes=(0, 0, None)
    )
    lo = search(oth_max, own_min, "left")  # first tile whose ids reach own_min
    hi = search(oth_min, own_max, "right")  # tiles starting at or below own_max
    single = own_min == own_max
    full_lo = search(oth_min, own_min, "left")  # tiles entirely equal to the one id
    full_hi = search(oth_max, own_min, "right")
    full_lo = jnp.where(single, full_lo, lo)
    full_hi = jnp.where(single, full_hi, lo)
    out = [
        jnp.where(sorted_, x, default)
        for x, default in ((lo, 0), (full_lo, 0), (full_hi, 0), (hi, n_other))
    ]
    return jnp.stack(_tiles_clamp(*out), axis=-1).astype(jnp.int32)


def _tiles_clamp(lo, full_lo, full_hi, hi):
    hi = jnp.maximum(hi, lo)
    full_lo = jnp.clip(full_lo, lo, hi)
    return lo, full_lo, jnp.clip(full_hi, full_lo, hi), hi


def layout_at_tiles(layout, layout_block, block_q: int, block_kv: int, seq_q: int, seq_kv: int):
    """A layout of `layout_block` blocks restated at the kernel's tiles, which divide
    them: each layout block becomes (bq_L / block_q) x (bk_L / block_kv) tiles, so the
    kernel keeps the tile size it is fastest at, whatever block the user's layout has."""
    (lq, lk) = layout_block
    if lq % block_q or lk % block_kv:
        raise ValueError(f"tiles {block_q}x{block_kv} do not divide layout blocks {lq}x{lk}")
    layout = jnp.repeat(jnp.repeat(layout, lq // block_q, axis=1), lk // block_kv, axis=2)
    return layout[:, : -(-seq_q // block_q), : -(-seq_kv // block_kv)]


def sparse_tile_lists(
    layout,
    spec: MaskSpec,
    block_q: int,
    block_kv: int,
    seq_q: int,
    seq_kv: int,
    q_len,
    kv_len,
    segments=None,
):
    """Block-sparse layout -> per-tile lists of the tiles to visit, computed in XLA.

    `layout` is bool [Nl, nq_L, nk_L] at the blocks of `spec.sparse_block` (Nl = 1 or
    the number of query heads); the lists are at the kernel's [block_q, block_kv] tiles
    (`layout_at_tiles`). Returns
    (per query tile: counts [B, Nl, nq, 2] and key-tile indices [B, Nl, nq, nk];
    per key tile: counts [B, Nl, nk, 2] and query-tile indices [B, Nl, nk, nq]). Each
    list holds the layout's tiles that the other constraints (causal, window, lengths,
    segments) leave visible: first those that need no element mask, then those that
    do; counts are (number unmasked, number in all). Skipped tiles are never listed.
    """
    layout = layout_at_tiles(layout, spec.sparse_block, block_q, block_kv, seq_q, seq_kv)
    _, nq, nk = layout.shape
    tiles = (spec, q_len, kv_len)
    q_b = tile_range_table(kv_tile_range, *tiles, nq, block_q, block_kv, block_q)
    k_b = tile_range_table(q_tile_range, *tiles, nk, block_q, block_kv, block_kv)
    if segments is not None:
        seg_q, seg_k = segment_tile_ranges(*segments, block_q, block_kv)
        q_b = jnp.stack(
            intersect(tuple(jnp.moveaxis(q_b, -1, 0)), tuple(jnp.moveaxis(seg_q, -1, 0))), -1
        )
        k_b = jnp.stack(
            intersect(tuple(jnp.moveaxis(k_b, -1, 0)), tuple(jnp.moveaxis(seg_k, -1, 0))), -1
        )
    q_lists = _lists(layout[None], q_b[:, None, :, None, :], nk)  # [B, Nl, nq, ...]
    k_lists = _lists(jnp.swapaxes(layout, 1, 2)[None], k_b[:, None, :, None, :], nq)
    return q_lists, k_lists


def _lists(layout, b, n: int):
    """Visit lists from a layout [.., own, n] and interval bounds [.., own, 1, 4]."""
    j = jnp.arange(n)
    active = layout & (j >= b[..., 0]) & (j < b[..., 3])
    full = active & (j >= b[..., 1]) & (j < b[..., 2])
    rank = jnp.where(full, 0, jnp.where(active, 1, 2)) * n + j  # unmasked, masked, skipped
    order = jnp.argsort(rank, axis=-1).astype(jnp.int32)
    counts = jnp.stack([full.sum(-1), active.sum(-1)], axis=-1).astype(jnp.int32)
    return counts, order

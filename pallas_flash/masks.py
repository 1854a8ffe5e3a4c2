"""Which (query, key) pairs attend: the mask description and its per-tile arithmetic.

The kernels never build a dense mask. They receive a `MaskSpec` (static) and the
per-batch valid lengths (dynamic), and from those derive, per tile, whether the tile is
skipped (no loads, no FLOPs), fully visible (no mask applied) or on a boundary (masked
element-wise). The reference builds the same mask densely with `dense_mask`.

Positions. Query row i and key column j are aligned through a per-batch `offset`:
key j is "at or before" query i when j <= i + offset. With jax.nn's (top-left)
alignment the offset is 0; with bottom-right alignment (KV-cache decoding, where the
queries are the last T of the keys) it is kv_len - q_len of that batch element.

    top-left, T=3, S=5          bottom-right, T=3, S=5
        k0 k1 k2 k3 k4              k0 k1 k2 k3 k4
    q0   x  .  .  .  .          q0   x  x  x  .  .
    q1   x  x  .  .  .          q1   x  x  x  x  .
    q2   x  x  x  .  .          q2   x  x  x  x  x
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True, kw_only=True)
class MaskSpec:
    """The static part of a mask: causal and its alignment, local window."""

    causal: bool = False
    bottom_right: bool = False
    local_window: tuple[int, int] | None = None

    @property
    def uses_offset(self) -> bool:
        return self.bottom_right and (self.causal or self.local_window is not None)


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
    """Key position minus query position on the causal diagonal (see module doc)."""
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
    diag = rows + offset(spec, q_len, kv_len)[:, None, None]  # [B, T, 1]
    keep = cols < kv_len[:, None, None]
    if spec.causal:
        keep = keep & (cols <= diag)
    if spec.local_window is not None:
        left, right = spec.local_window
        keep = keep & (cols >= diag - left) & (cols <= diag + right)
    if segment_ids is not None:
        q_seg, kv_seg = segment_ids
        keep = keep & (q_seg[:, :, None] == kv_seg[:, None, :])
    return keep[:, None]


def tile_mask(spec: MaskSpec, rows, cols, kv_len, diag_offset):
    """Element mask of one tile; `rows` [bq, 1] and `cols` [1, bk] are absolute positions."""
    keep = cols < kv_len
    if spec.causal:
        keep = keep & (cols <= rows + diag_offset)
    return keep


def _cdiv(a, b: int):
    return lax.div(a + (b - 1), b)


def kv_tile_range(spec: MaskSpec, q0, block_q: int, block_kv: int, q_len, kv_len, diag):
    """For the query tile starting at row q0: (n_full, n_tiles) key/value tiles.

    Tiles [0, n_full) are visible to every row of the query tile and need no mask;
    tiles [n_full, n_tiles) need the element mask; tiles from n_tiles on are skipped.
    """
    hi = kv_len
    full = kv_len
    if spec.causal:
        # The last row of the tile sees keys <= q0 + block_q - 1 + diag; the first
        # row sees keys <= q0 + diag.
        hi = jnp.minimum(hi, q0 + block_q + diag)
        full = jnp.minimum(full, q0 + 1 + diag)
    hi = jnp.where(q0 < q_len, jnp.maximum(hi, 0), 0)  # padding-only tiles do nothing
    n_tiles = _cdiv(hi, block_kv)
    n_full = jnp.minimum(lax.div(jnp.maximum(full, 0), block_kv), n_tiles)
    return n_full, n_tiles


def q_tile_range(spec: MaskSpec, k0, block_q: int, block_kv: int, q_len, kv_len, diag):
    """For the key tile starting at column k0: (lo, start_full, hi) query tiles.

    Query tiles [lo, start_full) need the element mask, [start_full, hi) need none,
    and the rest are skipped (they see none of this key tile).
    """
    hi = jnp.where(k0 < kv_len, _cdiv(q_len, block_q), 0)
    lo = jnp.zeros_like(hi)
    if spec.causal:
        # Row r sees column k0 when k0 <= r + diag, so rows below k0 - diag see nothing.
        lo = lax.div(jnp.maximum(k0 - diag, 0), block_q)
        # Every row of the tile sees the whole key tile once q0 >= k0 + block_kv - 1 - diag.
        start_full = _cdiv(jnp.maximum(k0 + block_kv - 1 - diag, 0), block_q)
    else:
        start_full = lo
    # A key tile that runs past kv_len is masked for every query tile.
    start_full = jnp.where(k0 + block_kv <= kv_len, start_full, hi)
    lo = jnp.minimum(lo, hi)
    start_full = jnp.clip(start_full, lo, hi)
    return lo, start_full, hi

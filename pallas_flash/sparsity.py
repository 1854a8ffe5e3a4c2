"""Block-sparse FlashAttention (Dao et al., 2022, Sec. 3.3): which tiles are computed.

A `BlockSparse` layout says, for each (query block, key block) pair, whether the pair
is computed at all. The kernels visit only the listed tiles (no loads, no FLOPs for the
others), so the IO and the time scale with the layout's density. Within a computed
tile every other mask (causal, window, lengths, segments, a boolean mask) still
applies element-wise. Semantically it is attention with the mask
`layout[i // block_q, j // block_kv]`, which is how the reference computes it.

Helpers build the paper's patterns: `local` (a band around the diagonal), `global_`
(the first blocks attend and are attended everywhere) and `butterfly` (the flat
butterfly of Pixelfly: pairs whose indices differ in one bit), combined with `union`.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockSparse:
    """A block layout: bool [n_q_blocks, n_kv_blocks], or [heads, ...] for one per head.

    Blocks are block_q x block_kv (powers of two >= 16). The kernels run at tiles that
    divide them (their usual tiles, shrunk to the block when larger), so a coarse layout
    costs no speed: a 128 x 128 layout runs at the kernels' 64 x 64 backward tiles.
    """

    layout: jax.Array | np.ndarray
    block_q: int = dataclasses.field(default=128, metadata=dict(static=True))
    block_kv: int = dataclasses.field(default=128, metadata=dict(static=True))

    def __post_init__(self):
        for name in ("block_q", "block_kv"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"BlockSparse.{name}={value!r} must be a power of two >= 16")

    def density(self) -> float:
        """Fraction of tiles computed."""
        return float(np.asarray(self.layout).mean())


def local(n_q: int, n_kv: int, width: int) -> np.ndarray:
    """Blocks within `width` blocks of the (proportional) diagonal."""
    i = np.arange(n_q)[:, None] * n_kv // max(n_q, 1)
    return np.abs(i - np.arange(n_kv)[None, :]) <= width


def global_(n_q: int, n_kv: int, n_global: int) -> np.ndarray:
    """The first `n_global` query blocks see everything, and every block sees the first
    `n_global` key blocks."""
    out = np.zeros((n_q, n_kv), bool)
    out[:n_global, :] = True
    out[:, :n_global] = True
    return out


def butterfly(n_q: int, n_kv: int) -> np.ndarray:
    """Flat butterfly: block (i, j) when i == j or i XOR j is a power of two."""
    x = np.arange(n_q)[:, None] ^ np.arange(n_kv)[None, :]
    return (x == 0) | ((x & (x - 1)) == 0)


def union(*layouts: np.ndarray) -> np.ndarray:
    return np.logical_or.reduce([np.asarray(x, bool) for x in layouts])


def dense_mask(sparse: BlockSparse, seq_q: int, seq_kv: int):
    """The element mask the layout means: [heads or 1, T, S]."""
    import jax.numpy as jnp

    layout = jnp.asarray(sparse.layout, bool)
    layout = layout if layout.ndim == 3 else layout[None]
    rows = jnp.arange(seq_q) // sparse.block_q
    cols = jnp.arange(seq_kv) // sparse.block_kv
    return layout[:, rows][:, :, cols]

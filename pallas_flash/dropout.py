"""Attention dropout from a counter-based hash: the mask is computed, never stored.

FlashAttention (Sec. 3.1, Alg. 2) fuses dropout into the kernel and regenerates the
same mask in the backward pass from the random state. Here the keep bit of entry
(batch b, query head h, row i, column j) is a pure function of a 64-bit seed taken from
the caller's JAX key and of (b, h, i, j): the forward kernel, the backward kernels, the
blockwise backend and the reference all evaluate this same function (it is plain jnp
integer arithmetic, so it runs inside Pallas kernels and in XLA alike), so they agree
bit for bit and nothing of size T x S is ever materialised.

The hash: a row code (murmur3's 32-bit finaliser of the seed, the (b, h) index and the
row), xor-ed with a column code, then finalised once more per entry. Dropped
probabilities are zeroed and kept ones scaled by 1 / (1 - rate), after the softmax
normalisation (the logsumexp does not see dropout).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_ROW, _COL, _HEAD = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D  # odd multipliers (golden ratio, murmur)


def _u32(x):
    return x.astype(jnp.uint32)


def _fmix32(x):
    """murmur3's finaliser: every input bit affects every output bit."""
    x = x ^ lax.shift_right_logical(x, jnp.uint32(16))
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ lax.shift_right_logical(x, jnp.uint32(13))
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ lax.shift_right_logical(x, jnp.uint32(16))


def seeds_from_key(key: jax.Array) -> jax.Array:
    """Two 31-bit seeds, as non-negative int32 [2], from a JAX PRNG key (typed or raw)."""
    bits = jax.random.bits(key, (2,), jnp.uint32)
    return lax.shift_right_logical(bits, jnp.uint32(1)).astype(jnp.int32)


def threshold(rate: float) -> int:
    """Keep an entry when its 31-bit hash is >= this (probability 1 - rate)."""
    return min(int(round(rate * 2**31)), 2**31 - 1)


def keep_mask(seeds, batch_head, rows, cols, rate: float):
    """Boolean keep mask for positions `rows` [.., R, 1] x `cols` [.., 1, C].

    `seeds` is (seed0, seed1) as int32 scalars or arrays that broadcast; `batch_head`
    is b * num_heads + h (int32, broadcastable). Comparisons use the top 31 bits as a
    non-negative int32, so no unsigned compare is needed anywhere.
    """
    seed0, seed1 = _u32(seeds[0]), _u32(seeds[1])
    head_code = _u32(batch_head) * jnp.uint32(_HEAD)
    row_code = _fmix32(seed0 ^ head_code ^ (_u32(rows) * jnp.uint32(_ROW)))
    col_code = _u32(cols) * jnp.uint32(_COL) + seed1
    bits = _fmix32(row_code ^ col_code)
    return lax.shift_right_logical(bits, jnp.uint32(1)).astype(jnp.int32) >= threshold(rate)

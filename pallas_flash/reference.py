"""The semantics of attention, in plain JAX: the oracle every backend is tested against.

`attention` materialises the full [B, N, T, S] score matrix (quadratic memory) and is
also the `"xla"` backend. By default it upcasts to float32 with exact (HIGHEST) matmuls;
`upcast=False` instead computes the way a naive implementation in the inputs' dtype
would (matmuls rounded to that dtype, softmax in float32), which the tests use to size
their tolerance: a kernel may be at most about twice as far from the float32 truth as
that naive computation is.

A fully masked query row (every key masked out) has output 0 and logsumexp -inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_flash import dropout, masks


def attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float,
    mask_spec: masks.MaskSpec,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    segment_ids: tuple[jax.Array, jax.Array] | None = None,
    dropout_rate: float = 0.0,
    dropout_seeds: jax.Array | None = None,
    logits_soft_cap: float | None = None,
    upcast: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Returns (output [B, T, N, H] float32, logsumexp [B, N, T] float32).

    `dropout_seeds` (int32 [2], from dropout.seeds_from_key) drop probabilities after
    normalisation; the logsumexp is that of the undropped scores.
    """
    B, T, N, H = query.shape
    _, S, K, _ = key.shape
    G = N // K
    in_dtype = query.dtype
    if upcast:
        query, key, value = (x.astype(jnp.float32) for x in (query, key, value))
        mm = dict(precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    else:
        mm = dict(preferred_element_type=in_dtype)
    # Group query heads by their key/value head instead of repeating K and V.
    q = query.reshape(B, T, K, G, H)
    s = jnp.einsum("btkgh,bskh->bkgts", q, key, **mm).astype(jnp.float32)
    s = s.reshape(B, N, T, S) * scale
    if bias is not None:
        s = s + jnp.broadcast_to(bias.astype(jnp.float32), (B, N, T, S))
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)

    q_len, kv_len = masks.lengths_or_full(query_seq_lengths, key_value_seq_lengths, B, T, S)
    keep = masks.dense_mask(mask_spec, T, S, q_len, kv_len, segment_ids=segment_ids)  # [B, 1, T, S]
    if mask is not None:
        keep = keep & jnp.broadcast_to(mask, (B, N, T, S))
    keep = jnp.broadcast_to(keep, (B, N, T, S))
    s = jnp.where(keep, s, -jnp.inf)

    m = jnp.max(s, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)  # an empty row has max -inf
    p = jnp.exp(s - m_safe)
    row_sum = jnp.sum(p, axis=-1, keepdims=True)
    empty = row_sum == 0.0
    row_sum = jnp.where(empty, 1.0, row_sum)
    lse = jnp.where(empty, -jnp.inf, m_safe + jnp.log(row_sum))
    p = p / row_sum
    if dropout_rate > 0:  # the very mask the kernels regenerate (dropout.py)
        batch_head = (jnp.arange(B)[:, None] * N + jnp.arange(N)[None, :])[:, :, None, None]
        rows, cols = jnp.arange(T)[:, None], jnp.arange(S)[None, :]
        keep = dropout.keep_mask(dropout_seeds, batch_head, rows, cols, dropout_rate)
        p = jnp.where(keep, p / (1.0 - dropout_rate), 0.0)
    if not upcast:
        p = p.astype(in_dtype)
    p = p.reshape(B, K, G, T, S)
    out = jnp.einsum("bkgts,bskh->btkgh", p, value, **mm).astype(jnp.float32)
    out = out.reshape(B, T, N, H)
    q_valid = jnp.arange(T)[None, :] < q_len[:, None]  # [B, T]
    out = jnp.where(q_valid[:, :, None, None], out, 0.0)
    lse = jnp.where(q_valid[:, None, :], lse[..., 0], -jnp.inf)
    return out, lse

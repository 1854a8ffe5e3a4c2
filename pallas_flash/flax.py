"""Flax integration: a drop-in `attention_fn` and an NNX `MultiHeadAttention`.

`attention_fn` has the signature of `flax.linen.dot_product_attention` (and of
`flax.nnx.dot_product_attention`), so either Flax attention module uses our kernels
unchanged::

    from pallas_flash.flax import attention_fn
    flax.linen.MultiHeadDotProductAttention(num_heads=8, attention_fn=attention_fn)

`MultiHeadAttention` is `flax.nnx.MultiHeadAttention` with that `attention_fn` as its
default: same constructor, same parameters, same call.

Differences from Flax's own attention, each deliberate:
* Dropout is the kernels' fused dropout: its mask is a hash of the key and of
  (batch, head, row, column), independent per batch element and head, and never
  stored, so `broadcast_dropout` (a memory saving for materialised masks) has nothing
  to save and does not apply.
* The attention weights never exist, so `sow_weights` (module=...) raises.
* `precision` other than None raises: the kernels fix it (exact float32 products for
  float32 inputs, float32 accumulation for 16-bit inputs).
"""

from __future__ import annotations

import functools
import math

import flax.nnx
import jax.numpy as jnp

from pallas_flash.api import flash_attention


def attention_fn(
    query,
    key,
    value,
    bias=None,
    mask=None,
    broadcast_dropout: bool = True,
    dropout_rng=None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype=None,
    precision=None,
    module=None,
    is_causal: bool = False,
    *,
    implementation=None,
):
    """Flax-compatible attention through `pallas_flash.flash_attention`.

    Args follow `flax.linen.dot_product_attention`: query [batch..., T, N, H], key and
    value [batch..., S, K, H] (K may divide N: GQA), bias and mask broadcastable to
    [batch..., N, T, S]. `implementation` picks the backend (default: the best one).
    See the module docstring for `broadcast_dropout`, `module` and `precision`.
    """
    del broadcast_dropout  # fused dropout masks are never stored: nothing to broadcast
    if module is not None:
        raise NotImplementedError(
            "sow_weights: FlashAttention never forms the attention weights to sow"
        )
    if precision is not None:
        raise NotImplementedError(
            f"precision={precision!r}: the kernels fix their precision (exact for float32 "
            "inputs, float32 accumulation for 16-bit inputs); pass None"
        )
    if dtype is not None:
        query, key, value = (x.astype(dtype) for x in (query, key, value))
    batch_dims = query.shape[:-3]

    def flat(x):  # [batch..., L, heads, H] -> [B, L, heads, H]
        return x.reshape((math.prod(batch_dims),) + x.shape[len(batch_dims) :])

    def flat_4d(x):  # [batch..., N, T, S] or broadcastable -> [B or 1, ., ., .]
        if x is None:
            return None
        x = jnp.asarray(x)
        if x.ndim < 4:
            x = x.reshape((1,) * (4 - x.ndim) + x.shape)
        lead = x.shape[: x.ndim - 3]
        return x.reshape((math.prod(lead),) + x.shape[x.ndim - 3 :])

    use_dropout = dropout_rate > 0.0 and not deterministic
    out = flash_attention(
        flat(query),
        flat(key),
        flat(value),
        bias=flat_4d(bias),
        mask=None if mask is None else flat_4d(mask).astype(bool),
        is_causal=is_causal,
        dropout_rate=float(dropout_rate) if use_dropout else 0.0,
        dropout_rng=dropout_rng if use_dropout else None,
        implementation=implementation,
    )
    return out.reshape(batch_dims + out.shape[1:])


_attention_fn = attention_fn  # the constructor's argument of that name shadows it


class MultiHeadAttention(flax.nnx.MultiHeadAttention):
    """`flax.nnx.MultiHeadAttention` whose attention runs through pallas-flash.

    Same constructor and call as Flax's (masks, dropout, GQA via `num_kv_heads`,
    `is_causal`, decoding with its cache); `attention_fn` defaults to
    `pallas_flash.flax.attention_fn` and `implementation` picks our backend.
    """

    def __init__(self, *args, implementation=None, attention_fn=None, **kwargs):
        if attention_fn is not None and implementation is not None:
            raise ValueError("pass implementation or attention_fn, not both")
        fn = attention_fn or functools.partial(_attention_fn, implementation=implementation)
        super().__init__(*args, attention_fn=fn, **kwargs)

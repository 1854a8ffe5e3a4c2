"""The `"xla_blockwise"` backend: FlashAttention's algorithm in plain JAX, on any device.

The same tiled online softmax as the kernels (FlashAttention Alg. 1), written as a
`lax.scan` over key/value tiles: every query row stays resident and each step folds one
tile into the running (m, l, acc). Its backward pass (used through vjp.py's custom_vjp)
scans the tiles again and recomputes P from q, k and the logsumexp, so the temporary
memory is B * N * T * block_kv scores, linear in the sequence length. GQA is computed
by grouping query heads, never by repeating K and V.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_flash import dropout, masks
from pallas_flash.configs import BlockwiseConfig
from pallas_flash.logits import LN2, Logits, backward_stats, base2_scores


def _matmul_kwargs(dtype):
    # Float32 inputs get exact products; 16-bit inputs multiply in their own dtype
    # and accumulate in float32, as the kernels do.
    if dtype == jnp.float32:
        return dict(precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return dict(preferred_element_type=jnp.float32)


def _tiles(x, block: int):
    """[B, S, K, H] -> [S_pad / block, B, block, K, H], zero padded."""
    B, S, K, H = x.shape
    s_pad = -(-S // block) * block
    x = jnp.pad(x, [(0, 0), (0, s_pad - S), (0, 0), (0, 0)])
    return jnp.moveaxis(x.reshape(B, s_pad // block, block, K, H), 1, 0)


def _tile_keep(spec, j, block, seq_q, q_len, kv_len, segments, kv_seg_j):
    """Boolean [B, 1, 1, T, block] mask of key tile j."""
    rows = jnp.arange(seq_q)[None, :, None]
    cols = (j * block + jnp.arange(block))[None, None, :]
    diag = masks.offset(spec, q_len, kv_len)[:, None, None]
    segs = None if segments is None else (segments[0][:, :, None], kv_seg_j[:, None, :])
    keep = masks.tile_mask(spec, rows, cols, kv_len[:, None, None], diag, segs)
    return keep[:, None, None]


def _tile_keep_dropout(seeds, rate, j, block, shape):
    """Dropout keep mask [B, K, G, T, block] of key tile j (query head = k * G + g)."""
    B, K, G, T, _ = shape
    batch_head = (jnp.arange(B)[:, None, None] * (K * G) + jnp.arange(K * G).reshape(1, K, G))[
        ..., None, None
    ]
    rows = jnp.arange(T)[:, None]
    cols = (j * block + jnp.arange(block))[None, :]
    return dropout.keep_mask(seeds, batch_head, rows, cols, rate)


def _extra_tiles(x, K: int, G: int, S: int, block: int, fill):
    """A bias or mask broadcastable to [B, N, T, S] -> per key tile, [n, Bb, Kb, Gb, Tb, block].

    Heads split as (K, G) (or stay 1); a key dim of 1 is broadcast to S first.
    """
    if x is None:
        return None
    Bb, Nb, Tb, _ = x.shape
    x = jnp.broadcast_to(x, (Bb, Nb, Tb, S))
    x = x.reshape(Bb, K, G, Tb, S) if Nb != 1 else x[:, :, None]
    x = jnp.pad(x, [(0, 0)] * 4 + [(0, -S % block)], constant_values=fill)
    x = x.reshape(*x.shape[:4], -1, block)
    return jnp.moveaxis(x, 4, 0)


def _scores(qg, k_j, mm, scale, bias_j, softcap):
    """Base-2 scores [B, K, G, T, block], and tanh(s / cap) when soft-capped."""
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k_j, **mm)
    return base2_scores(s, scale=scale, bias=bias_j, softcap=softcap)


def _kv_seg_tiles(segments, block: int):
    """Key segment ids as [n_tiles, B, block] (padding is masked by kv_len anyway)."""
    if segments is None:
        return None
    kv_seg = segments[1]
    B, S = kv_seg.shape
    kv_seg = jnp.pad(kv_seg, [(0, 0), (0, -S % block)], mode="edge")
    return jnp.moveaxis(kv_seg.reshape(B, -1, block), 1, 0)


def forward(
    q,
    k,
    v,
    q_len,
    kv_len,
    segments=None,
    seeds=None,
    bias=None,
    mask=None,
    layout=None,
    *,
    spec: masks.MaskSpec,
    scale: float,
    config: BlockwiseConfig,
    dropout_rate: float = 0.0,
    logits: Logits = Logits(),
):
    """Returns O [B, T, N, H] in q's dtype and the logsumexp [B, N, T] float32."""
    assert layout is None, "the API sends block-sparse calls elsewhere"
    B, T, N, H = q.shape
    _, S, K, _ = k.shape
    G = N // K
    block = min(config.block_kv, S)
    mm = _matmul_kwargs(q.dtype)
    qg = q.reshape(B, T, K, G, H)

    def step(carry, xs):
        acc, m_i, l_i = carry  # [B, K, G, T, H], [B, K, G, T], [B, K, G, T]
        j, k_j, v_j, seg_j, bias_j, mask_j = xs
        s, _ = _scores(qg, k_j, mm, scale, bias_j, logits.softcap)
        keep = _tile_keep(spec, j, block, T, q_len, kv_len, segments, seg_j)
        if mask_j is not None:
            keep = keep & mask_j
        s = jnp.where(keep, s, -jnp.inf)
        m_new = jnp.maximum(m_i, s.max(-1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # empty so far: avoid inf - inf
        alpha = jnp.exp2(m_i - m_use)
        p = jnp.exp2(s - m_use[..., None])
        l_i = l_i * alpha + p.sum(-1)  # the normaliser never sees dropout
        if dropout_rate > 0:
            p = jnp.where(_tile_keep_dropout(seeds, dropout_rate, j, block, p.shape), p, 0.0)
        pv = jnp.einsum("bkgts,bskh->bkgth", p.astype(v_j.dtype), v_j, **mm)
        return (acc * alpha[..., None] + pv, m_new, l_i), None

    k_t, v_t = _tiles(k, block), _tiles(v, block)
    init = (
        jnp.zeros((B, K, G, T, H), jnp.float32),
        jnp.full((B, K, G, T), -jnp.inf, jnp.float32),
        jnp.zeros((B, K, G, T), jnp.float32),
    )
    xs = (
        jnp.arange(k_t.shape[0]),
        k_t,
        v_t,
        _kv_seg_tiles(segments, block),
        _extra_tiles(bias, K, G, S, block, 0),
        _extra_tiles(mask, K, G, S, block, 0),
    )
    if mask is not None:
        xs = (*xs[:5], xs[5] != 0)
    (acc, m_i, l_i), _ = lax.scan(step, init, xs)

    q_valid = (jnp.arange(T)[None, :] < q_len[:, None])[:, None, None, :]  # [B, 1, 1, T]
    empty = (l_i == 0.0) | ~q_valid
    l_safe = jnp.where(empty, 1.0, l_i)
    lse = jnp.where(empty, -jnp.inf, (m_i + jnp.log2(l_safe)) * LN2)
    o = jnp.where(empty[..., None], 0.0, acc / (l_safe * (1.0 - dropout_rate))[..., None])
    o = jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(B, T, N, H).astype(q.dtype)
    return o, lse.reshape(B, N, T)


def backward(
    q,
    k,
    v,
    o,
    lse,
    do,
    dlse,
    q_len,
    kv_len,
    segments=None,
    seeds=None,
    bias=None,
    mask=None,
    layout=None,
    *,
    spec: masks.MaskSpec,
    scale: float,
    config: BlockwiseConfig,
    dropout_rate: float = 0.0,
    logits: Logits = Logits(),
):
    """Returns dq, dk, dv in the dtypes of q, k, v, and the bias gradient (in the bias's
    shape and dtype) when `logits.bias_grad`, else None."""
    B, T, N, H = q.shape
    _, S, K, _ = k.shape
    G = N // K
    block = min(config.block_kv, S)
    mm = _matmul_kwargs(q.dtype)
    qg = q.reshape(B, T, K, G, H)
    dog = do.reshape(B, T, K, G, H)
    lse2, delta = (x.reshape(B, K, G, T) for x in backward_stats(o, do, lse, dlse))
    bias_t = _extra_tiles(bias, K, G, S, block, 0)

    def step(dq, xs):
        j, k_j, v_j, seg_j, bias_j, mask_j = xs
        s, tanh = _scores(qg, k_j, mm, scale, bias_j, logits.softcap)
        keep = _tile_keep(spec, j, block, T, q_len, kv_len, segments, seg_j)
        if mask_j is not None:
            keep = keep & mask_j
        s = jnp.where(keep, s, -jnp.inf)
        p = jnp.exp2(s - lse2[..., None])  # [B, K, G, T, block]
        dp = jnp.einsum("btkgh,bskh->bkgts", dog, v_j, **mm)
        p_out = p
        if dropout_rate > 0:  # O = (P * Z / (1 - rate)) V: see triton/backward.py
            z = _tile_keep_dropout(seeds, dropout_rate, j, block, p.shape)
            inv = 1.0 / (1.0 - dropout_rate)
            p_out, dp = jnp.where(z, p * inv, 0.0), jnp.where(z, dp * inv, 0.0)
        dv_j = jnp.einsum("bkgts,btkgh->bskh", p_out.astype(do.dtype), dog, **mm)
        ds32 = p * (dp - delta[..., None])
        if tanh is not None:
            ds32 = ds32 * (1.0 - tanh * tanh)  # through cap * tanh(s / cap)
        ds = ds32.astype(q.dtype)
        dk_j = jnp.einsum("bkgts,btkgh->bskh", ds, qg, **mm) * scale
        dq = dq + jnp.einsum("bkgts,bskh->btkgh", ds, k_j, **mm) * scale
        dbias_j = None
        if logits.bias_grad:  # sum dS over the dims the bias broadcasts along
            axes = tuple(a for a in range(5) if bias_j.shape[a] == 1 and ds32.shape[a] != 1)
            dbias_j = ds32.sum(axis=axes, keepdims=True)
        return dq, (dk_j, dv_j, dbias_j)

    k_t, v_t = _tiles(k, block), _tiles(v, block)
    dq0 = jnp.zeros((B, T, K, G, H), jnp.float32)
    mask_t = None if mask is None else _extra_tiles(mask, K, G, S, block, 0) != 0
    xs = (jnp.arange(k_t.shape[0]), k_t, v_t, _kv_seg_tiles(segments, block), bias_t, mask_t)
    dq, (dk_t, dv_t, dbias_t) = lax.scan(step, dq0, xs)

    def untile(x):
        return jnp.moveaxis(x, 0, 1).reshape(B, -1, K, H)[:, :S]

    dbias = None
    if logits.bias_grad:  # [n, Bb, Kb, Gb, Tb, block] -> the bias's own shape
        Bb, Nb, Tb, Sb = bias.shape
        d = jnp.moveaxis(dbias_t, 0, 4).reshape(Bb, Nb, Tb, -1)[..., :S]
        dbias = (d if Sb == S else d.sum(-1, keepdims=True)).astype(bias.dtype)
    return (
        dq.reshape(B, T, N, H).astype(q.dtype),
        untile(dk_t).astype(k.dtype),
        untile(dv_t).astype(v.dtype),
        dbias,
    )

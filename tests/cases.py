"""The shared table of attention cases every backend runs, and the tolerance rule.

The full product of the factors (3 dtypes x causal x 3 head layouts x 5 head dims x
5 lengths x T != S x padding) is ~1,800 cases: too many for interpret mode on CPU. The
table instead walks every (head dim, length) pair once and rotates the other factors
through it, so each factor value meets each head dim and each length; extra cases cover
what a rotation could miss (fully masked rows, bottom-right causal, tiny and ragged).
"""

from __future__ import annotations

import dataclasses
import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
HEAD_DIMS = (32, 64, 80, 128, 256)
LENGTHS = (1, 97, 128, 257, 1025)
HEADS = ((4, 4), (4, 2), (4, 1))  # (query heads, key/value heads): MHA, GQA, MQA


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    seq_q: int
    seq_kv: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: object
    causal: bool = False
    bottom_right: bool = False
    q_lens: tuple[int, ...] | None = None
    kv_lens: tuple[int, ...] | None = None
    window: tuple[int, int] | None = None
    # Segment ids per batch element: (query ids, key ids), each a tuple of tuples.
    segments: tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]] | None = None
    dropout: float = 0.0
    bias: str | None = None  # "full" [B,N,T,S], "heads" [1,N,T,S], "keys" [B,1,1,S]
    # A random boolean mask (70 % attend): True [B, 1, T, S], "heads" [1, N, T, S],
    # "rows" [B, 1, T, 1] (constant along the keys: packed along the rows like the others,
    # its one column of words broadcast over the keys), "keys" [B, 1, 1, S] (key padding
    # as a mask: the one mask the kernels read packed along the keys, one row of words
    # broadcast over every query).
    mask: bool | str = False
    softcap: float | None = None

    @property
    def id(self) -> str:
        parts = [
            jnp.dtype(self.dtype).name,
            f"b{self.batch}",
            f"t{self.seq_q}",
            f"s{self.seq_kv}",
            f"n{self.heads}k{self.kv_heads}",
            f"h{self.head_dim}",
        ]
        if self.causal:
            parts.append("causal-br" if self.bottom_right else "causal")
        if self.q_lens or self.kv_lens:
            parts.append(f"len{self.q_lens}-{self.kv_lens}")
        if self.window:
            parts.append(f"win{self.window[0]}-{self.window[1]}")
        if self.segments:
            parts.append(f"seg{len(set(self.segments[0][0]))}")
        if self.dropout:
            parts.append(f"drop{self.dropout}")
        if self.bias:
            parts.append(f"bias-{self.bias}")
        if self.mask:
            parts.append("mask" if self.mask is True else f"mask-{self.mask}")
        if self.softcap:
            parts.append(f"cap{self.softcap}")
        return "_".join(parts).replace(" ", "")

    def kwargs(self) -> dict:
        lens = lambda x: None if x is None else jnp.asarray(x, jnp.int32)  # noqa: E731
        segs = None
        if self.segments:
            segs = tuple(jnp.asarray(x, jnp.int32) for x in self.segments)
        return dict(
            is_causal=self.causal,
            causal_alignment="bottom_right" if self.bottom_right else "top_left",
            query_seq_lengths=lens(self.q_lens),
            key_value_seq_lengths=lens(self.kv_lens),
            local_window_size=self.window,
            segment_ids=segs,
            dropout_rate=self.dropout,
            dropout_rng=jax.random.key(7) if self.dropout else None,
            mask=self.mask_array(),
            logits_soft_cap=self.softcap,
        )

    def bias_array(self, seed: int = 0):
        if self.bias is None:
            return None
        B, N, T, S = self.batch, self.heads, self.seq_q, self.seq_kv
        shape = {"full": (B, N, T, S), "heads": (1, N, T, S), "keys": (B, 1, 1, S)}[self.bias]
        return jax.random.normal(jax.random.PRNGKey(seed + 77), shape, jnp.float32).astype(
            self.dtype
        )

    def mask_array(self):
        if not self.mask:
            return None
        B, N, T, S = self.batch, self.heads, self.seq_q, self.seq_kv
        shapes = {True: (B, 1, T, S), "heads": (1, N, T, S), "rows": (B, 1, T, 1)}
        shape = (shapes | {"keys": (B, 1, 1, S)})[self.mask]
        return jax.random.bernoulli(jax.random.PRNGKey(5), 0.7, shape)

    def inputs(self, seed: int = 0):
        """Fresh random q, k, v and a random output cotangent."""
        kq, kk, kv, kd = jax.random.split(jax.random.PRNGKey(seed), 4)
        B, T, S, H = self.batch, self.seq_q, self.seq_kv, self.head_dim
        q = jax.random.normal(kq, (B, T, self.heads, H), self.dtype)
        k = jax.random.normal(kk, (B, S, self.kv_heads, H), self.dtype)
        v = jax.random.normal(kv, (B, S, self.kv_heads, H), self.dtype)
        do = jax.random.normal(kd, (B, T, self.heads, H), self.dtype)
        return q, k, v, do


def seed_of(case: Case) -> int:
    """A case's input seed: the same in every run (Python's hash() of a string is not)."""
    return zlib.crc32(case.id.encode()) % 1000


def _ragged(length: int, batch: int, i: int) -> tuple[int, ...]:
    """Valid lengths for a padded batch: one full, the rest cut at varied points."""
    cuts = [length, max(1, (length * 2) // 3), max(0, length // 3 - i % 2)]
    return tuple(cuts[j % 3] for j in range(batch))


def packed(lengths_per_batch, total: int) -> tuple[tuple[int, ...], ...]:
    """Segment ids of packed documents: consecutive runs of the given lengths, then padding
    (the last id continues to the end)."""
    out = []
    for lengths in lengths_per_batch:
        ids = [i for i, n in enumerate(lengths) for _ in range(n)]
        ids += [len(lengths) - 1] * (total - len(ids))
        out.append(tuple(ids[:total]))
    return tuple(out)


def table() -> list[Case]:
    cases = []
    for i, (h, length) in enumerate(itertools.product(HEAD_DIMS, LENGTHS)):
        dtype = DTYPES[i % 3]
        heads, kv_heads = HEADS[(i // 3) % 3]
        # Periods 2, 4 and 7 against the 5 x 5 walk: every pair of (causal, T != S,
        # padded) values occurs, and padding meets every head dim and length.
        causal = i % 2 == 1
        other = LENGTHS[(LENGTHS.index(length) + 1 + i % 3) % len(LENGTHS)]
        seq_q, seq_kv = (length, other) if (i // 2) % 2 == 0 else (length, length)
        padded = i % 7 in (2, 5)
        cases.append(
            Case(
                batch=2,
                seq_q=seq_q,
                seq_kv=seq_kv,
                heads=heads,
                kv_heads=kv_heads,
                head_dim=h,
                dtype=dtype,
                causal=causal,
                q_lens=_ragged(seq_q, 2, i) if padded else None,
                kv_lens=_ragged(seq_kv, 2, i + 1) if padded else None,
            )
        )
    cases += [
        # Bottom-right causal with T > S: the first T - S rows see no key at all.
        Case(2, 97, 40, 4, 2, 64, jnp.bfloat16, causal=True, bottom_right=True),
        Case(
            2,
            257,
            128,
            4,
            1,
            32,
            jnp.float32,
            causal=True,
            bottom_right=True,
            q_lens=(257, 200),
            kv_lens=(100, 128),
        ),
        # KV-cache shape: few queries, many keys, bottom-right.
        Case(
            2, 16, 257, 4, 4, 128, jnp.float16, causal=True, bottom_right=True, kv_lens=(257, 150)
        ),
        # A batch element with no valid key at all, and one with no valid query.
        Case(2, 97, 97, 4, 2, 64, jnp.float32, q_lens=(0, 97), kv_lens=(97, 0)),
        # Head dims off the table: tiny and odd.
        Case(1, 33, 65, 2, 1, 1, jnp.float32, causal=True),
        Case(1, 65, 33, 2, 2, 96, jnp.bfloat16),
        # Local windows: symmetric, causal sliding window, bottom-right with T != S.
        Case(2, 257, 257, 4, 2, 64, jnp.bfloat16, window=(40, 40)),
        Case(2, 300, 300, 4, 1, 32, jnp.float16, causal=True, window=(64, 0)),
        Case(
            2,
            97,
            257,
            4,
            4,
            80,
            jnp.float32,
            causal=True,
            bottom_right=True,
            window=(20, 3),
            kv_lens=(257, 200),
        ),
        Case(1, 128, 128, 2, 2, 32, jnp.float32, window=(0, 0)),  # each row sees one key
        # Segment ids: packed documents (causal, GQA, ragged), cross-attention with T != S,
        # and non-monotone ids (no tile can be skipped; every tile masked).
        Case(
            2,
            300,
            300,
            4,
            2,
            64,
            jnp.bfloat16,
            causal=True,
            kv_lens=(300, 250),
            segments=(packed([(100, 150, 50), (7, 200, 93)], 300),) * 2,
        ),
        Case(
            2,
            97,
            257,
            4,
            1,
            32,
            jnp.float16,
            segments=(packed([(30, 67), (97,)], 97), packed([(100, 157), (257,)], 257)),
        ),
        Case(
            2,
            130,
            130,
            4,
            4,
            128,
            jnp.float32,
            window=(30, 10),
            segments=(tuple(tuple((i * 7 // 3) % 3 for i in range(130)) for _ in range(2)),) * 2,
        ),
        # Dropout alone, and composed: causal + segment ids + GQA + ragged lengths.
        Case(2, 97, 130, 4, 2, 64, jnp.bfloat16, dropout=0.2),
        Case(
            2,
            200,
            200,
            4,
            1,
            32,
            jnp.float32,
            causal=True,
            kv_lens=(200, 120),
            dropout=0.5,
            segments=(packed([(60, 140), (200,)], 200),) * 2,
        ),
        # Bias (differentiated; full, per-head ALiBi-like, per-key), boolean masks, soft cap,
        # and all of them composed with causal, GQA, lengths and dropout.
        Case(2, 97, 130, 4, 2, 64, jnp.float32, bias="full"),
        Case(2, 130, 130, 4, 1, 32, jnp.bfloat16, causal=True, bias="heads"),
        Case(2, 97, 65, 4, 4, 80, jnp.float16, bias="keys", kv_lens=(65, 30)),
        Case(2, 130, 97, 4, 2, 32, jnp.float32, mask=True, q_lens=(130, 60)),
        # Per-head masks (read per query head in the GQA group's dK/dV program), query and
        # key lengths that are no multiple of the 16-position mask words (rows past T and
        # keys past S read as masked out), and masks without a key or a query axis.
        Case(1, 37, 53, 4, 2, 32, jnp.float32, mask="heads"),
        Case(2, 70, 45, 2, 1, 16, jnp.bfloat16, causal=True, mask="rows", kv_lens=(45, 20)),
        Case(2, 33, 90, 4, 4, 32, jnp.float16, mask="keys", q_lens=(33, 17)),
        Case(2, 128, 128, 4, 2, 64, jnp.bfloat16, causal=True, softcap=5.0),
        Case(
            2,
            100,
            100,
            4,
            2,
            32,
            jnp.float32,
            causal=True,
            bias="heads",
            mask=True,
            softcap=3.0,
            dropout=0.3,
            segments=(packed([(40, 60), (100,)], 100),) * 2,
        ),
    ]
    return cases


CASES = table()


def tolerance_check(name: str, got, ref, naive, dtype) -> None:
    """flash-attn's rule: |got - ref| <= 2 |naive - ref| + floor, and never NaN.

    `ref` is the float32 reference, `naive` the same math done naively in `dtype`; the
    floor is one unit in the last place of `dtype` at the largest reference value (the
    output is stored in `dtype`, so it cannot be closer), and 2^-17 relative for float32.
    """
    got, ref, naive = (np.asarray(x, np.float64) for x in (got, ref, naive))
    assert got.shape == ref.shape, f"{name}: shape {got.shape} != {ref.shape}"
    both_inf = np.isinf(ref) & (got == ref)
    assert not np.isnan(got).any(), f"{name}: NaN in the output"
    assert np.array_equal(np.isinf(got), np.isinf(ref)), f"{name}: inf pattern differs"
    got, ref, naive = (np.where(both_inf, 0.0, x) for x in (got, ref, naive))
    naive = np.where(np.isfinite(naive), naive, ref)
    scale = float(np.max(np.abs(ref), initial=0.0))
    eps = 2.0**-17 if jnp.dtype(dtype) == jnp.float32 else float(jnp.finfo(dtype).eps)
    err = float(np.max(np.abs(got - ref), initial=0.0))
    bound = 2.0 * float(np.max(np.abs(naive - ref), initial=0.0)) + eps * max(scale, 1e-3)
    assert err <= bound, f"{name}: max error {err:.3g} > bound {bound:.3g} (|ref| <= {scale:.3g})"

"""Masks: the tile intervals agree with the dense mask, and every mask kind runs on the kernels.

The interval test is the kernels' skipping logic checked exhaustively against
`dense_mask`: a skipped tile must hold no visible pair, an unmasked ("full") tile must
hold only visible pairs for every real query row. Hypothesis draws the irregular
inputs (segment boundaries, ragged lengths, windows).
"""

from __future__ import annotations

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax import lax

from pallas_flash import configs, masks, vjp
from pallas_flash.logits import Logits
from tests.cases import Case, packed, tolerance_check
from tests.util import run_impl, run_references

SETTINGS = settings(derandomize=True, max_examples=60, deadline=None)


@st.composite
def mask_problems(draw):
    T = draw(st.integers(1, 90))
    S = draw(st.integers(1, 90))
    causal = draw(st.booleans())
    window = draw(st.none() | st.tuples(st.integers(0, 40), st.integers(0, 40)))
    bottom_right = (causal or window is not None) and draw(st.booleans())
    q_len = draw(st.integers(0, T))
    kv_len = draw(st.integers(0, S))
    segments = None
    if draw(st.booleans()):

        def ids(n):
            cuts = sorted(draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=4)))
            return np.searchsorted(np.array(cuts), np.arange(n), side="right")

        if draw(st.booleans()):  # non-monotone ids
            segments = (
                np.array(draw(st.lists(st.integers(0, 2), min_size=T, max_size=T))),
                np.array(draw(st.lists(st.integers(0, 2), min_size=S, max_size=S))),
            )
        else:
            segments = (ids(T), ids(S))
    spec = masks.MaskSpec(
        causal=causal, bottom_right=bottom_right, local_window=window, segments=segments is not None
    )
    bq = draw(st.sampled_from([16, 32]))
    bk = draw(st.sampled_from([16, 32]))
    return spec, T, S, q_len, kv_len, segments, bq, bk


# Jitted: one program per shape drawn, where eager runs compile each op for each shape.
_dense_mask = jax.jit(masks.dense_mask, static_argnums=(0, 1, 2))
_segment_tile_ranges = jax.jit(masks.segment_tile_ranges, static_argnums=(2, 3))


@SETTINGS
@given(mask_problems())
def test_tile_intervals_agree_with_dense_mask(problem):
    spec, T, S, q_len, kv_len, segments, bq, bk = problem
    ql, kl = jnp.array([q_len]), jnp.array([kv_len])
    seg = None if segments is None else tuple(jnp.asarray(x)[None] for x in segments)
    dense = np.asarray(_dense_mask(spec, T, S, ql, kl, segment_ids=seg))[0, 0]
    diag = masks.offset(spec, ql, kl)[0]
    if seg is not None:
        per_q, per_kv = (np.asarray(x)[0] for x in _segment_tile_ranges(*seg, bq, bk))
    valid_rows = np.arange(T) < q_len
    for i in range(-(-T // bq)):
        bounds = masks.kv_tile_range(spec, i * bq, bq, bk, q_len, kv_len, diag)
        if seg is not None:
            bounds = masks.intersect(bounds, tuple(per_q[i]))
        _check_tiles(dense[i * bq : (i + 1) * bq], valid_rows[i * bq : (i + 1) * bq], bounds, bk)
    for j in range(-(-S // bk)):
        bounds = masks.q_tile_range(spec, j * bk, bq, bk, q_len, kv_len, diag)
        if seg is not None:
            bounds = masks.intersect(bounds, tuple(per_kv[j]))
        # In the backward pass, query rows past q_len (or past T) carry P = 0 without a
        # mask: they must not be skipped-but-visible, but may sit in a full tile.
        strip = dense[:, j * bk : (j + 1) * bk].T
        _check_tiles(strip, np.ones(strip.shape[0], bool), bounds, bq, dont_care=~valid_rows)


def _check_tiles(strip, valid, bounds, block, dont_care=None):
    """`strip` [rows, positions]: tiles of `block` positions; only `valid` rows count.
    Positions in `dont_care`, and (when it is given) past the strip's end, may be masked
    inside a full tile."""
    past_end_ok = dont_care is not None
    lo, full_lo, full_hi, hi = (int(b) for b in bounds)
    assert 0 <= lo <= full_lo <= full_hi <= hi
    if dont_care is None:
        dont_care = np.zeros(strip.shape[1], bool)
    visible = strip & ~dont_care[None, :]
    for t in range(-(-strip.shape[1] // block)):
        cut = slice(t * block, (t + 1) * block)
        if t < lo or t >= hi:
            assert not visible[valid][:, cut].any(), f"tile {t} skipped but visible {bounds}"
        elif full_lo <= t < full_hi:
            partial = strip[:, cut].shape[1] < block
            assert not partial or past_end_ok, f"tile {t} full but runs past the end"
            assert (strip | dont_care[None, :])[valid][:, cut].all(), f"tile {t} full, masked"


def _segment_case(draw_lengths, T, heads, kv_heads, dtype, **kw):
    return Case(2, T, T, heads, kv_heads, 32, dtype, segments=(packed(draw_lengths, T),) * 2, **kw)


# Four examples (each compiles both kernels' programs and the reference's): among them
# lengths 0, ragged lengths cutting documents, five documents, and causal.
@pytest.mark.kernel
@settings(derandomize=True, max_examples=4, deadline=None)
@given(st.data())
def test_segments_and_ragged_lengths_match_reference(data):
    T = data.draw(st.integers(20, 160), label="T")
    docs = [
        data.draw(st.lists(st.integers(1, 60), min_size=1, max_size=5), label=f"docs{b}")
        for b in range(2)
    ]
    causal = data.draw(st.booleans(), label="causal")
    lens = tuple(data.draw(st.integers(0, T), label=f"len{b}") for b in range(2))
    case = _segment_case(docs, T, 4, 2, jnp.float32, causal=causal, kv_lens=lens, q_lens=lens)
    ref, naive = run_references(case)
    for impl in ("triton", "xla_blockwise"):
        for name, g, r, n in zip(("o", "lse", "dq", "dk", "dv"), run_impl(case, impl), ref, naive):
            tolerance_check(f"{impl} {name}", g, r, n, case.dtype)


# Jitted: one program per shape drawn, where eager runs compile each op for each shape.
_pack = jax.jit(masks.pack_mask_bits, static_argnames="axis")
_unpack = jax.jit(masks.unpack_mask_bits, static_argnums=1, static_argnames="axis")


@given(
    st.integers(1, 70),
    st.integers(1, 40),
    st.sampled_from([-2, -1]),
    st.integers(0, 2**31 - 1),
)
@settings(derandomize=True, max_examples=40, deadline=None)
def test_mask_bit_packing_round_trips(seq_q, seq_k, axis, seed):
    """The Triton kernels' packed mask, along the query rows (axis -2) or the keys (-1):
    16 positions per int16 word, the other axis untouched, the bits past the last
    position False, and unpacking gives the mask back."""
    mask = np.random.default_rng(seed).random((2, 3, seq_q, seq_k)) < 0.5
    words = np.asarray(_pack(jnp.asarray(mask), axis=axis))
    n = mask.shape[axis]
    shape = list(mask.shape)
    shape[axis] = -(-n // 16)
    assert words.dtype == np.int16 and words.shape == tuple(shape)
    got = _unpack(words, n, axis=axis)
    np.testing.assert_array_equal(np.asarray(got), mask)
    whole = np.asarray(_unpack(words, words.shape[axis] * 16, axis=axis))
    assert not np.take(whole, np.arange(n, whole.shape[axis]), axis=axis).any()
    # Bit b of word w is position 16 w + b: what load_mask_tile's spreading assumes.
    w, b = divmod(n - 1, 16)
    last = np.take(words, w, axis=axis).astype(np.int32) >> b & 1
    np.testing.assert_array_equal(last != 0, np.take(mask, n - 1, axis=axis))


@pytest.mark.parametrize(
    "dims,axis",
    [
        ((True, False, True, True), -2),
        ((False, True, True, False), -2),
        ((True, False, False, True), -1),
        ((True, True, False, False), None),
        (None, None),
    ],
)
def test_mask_word_axis_prefers_the_rows(dims, axis):
    """Packed along T whenever the mask varies there (the faster layout,
    mask-layouts-a5fdc5b.jsonl), along S only for masks constant along T."""
    assert masks.mask_word_axis(dims) == axis


# The Triton kernels' lowering for Hopper (compute capability 9.0), on any machine: an
# abstract H200 stands in for the device Pallas asks for its compute capability.
HOPPER = jax.sharding.AbstractMesh(
    (1,),
    ("x",),
    abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"
    ),
)


@pytest.mark.parametrize("mask_shape", ["rows", "keys"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_kernels_with_a_mask_lower_for_hopper(head_dim, dtype, mask_shape):
    """Pallas to Triton IR for sm_90 (the forward, dK/dV and dQ kernels of one gradient,
    compiled, not interpreted), with a [B, 1, T, S] mask (packed along the rows) and a
    [B, 1, 1, S] one (packed along the keys), at the default configs' tiles, GQA, causal,
    ragged T and S. What is left for the GPU: Triton's own passes, PTX, ptxas, running."""
    B, T, S, N, K = 2, 300, 257, 4, 2
    shape = (B, 1, T, S) if mask_shape == "rows" else (B, 1, 1, S)
    dims = tuple(d == f for d, f in zip(shape, (B, N, T, S)))
    assert masks.mask_word_axis(dims) == (-2 if mask_shape == "rows" else -1)
    plan = vjp.Plan(
        backend="triton",
        spec=masks.MaskSpec(causal=True),
        scale=0.1,
        fwd_config=configs.default_triton_config(head_dim, dtype),
        bwd_config=configs.default_triton_bwd_config(head_dim, dtype),
        interpret=False,
        logits=Logits(mask_dims=dims),
    )

    def loss(q, k, v, lens, mask):
        o, _ = vjp.attention(plan, q, k, v, lens, lens, mask=vjp.kernel_mask(plan, mask))
        return jnp.sum(o.astype(jnp.float32))

    q = jax.ShapeDtypeStruct((B, T, N, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((B, S, K, head_dim), dtype)
    lens = jax.ShapeDtypeStruct((B,), jnp.int32)
    mask = jax.ShapeDtypeStruct(shape, jnp.bool_)
    with jax.sharding.use_abstract_mesh(HOPPER):
        traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv, lens, mask)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3  # forward, dK/dV, dQ


@pytest.mark.parametrize(
    "spec",
    [
        masks.MaskSpec(),
        masks.MaskSpec(causal=True),
        masks.MaskSpec(causal=True, bottom_right=True),
        masks.MaskSpec(local_window=(5, 3)),
        masks.MaskSpec(local_window=(0, 0), bottom_right=True),
        masks.MaskSpec(causal=True, local_window=(7, 0)),
    ],
    ids=["full", "causal", "causal-br", "window", "diagonal-br", "causal-window"],
)
def test_row_bounds_give_tile_mask(spec):
    """masks.row_bounds (the Mosaic forward's row_bound_mask) and masks.tile_mask keep
    the same element pairs: every row of a 37 x 45 problem against every key, with key
    lengths from 0 to past the end and both alignments' offsets."""
    rows = jnp.arange(37)[:, None]
    cols = jnp.arange(45)[None, :]
    for q_len, kv_len in [(37, 45), (37, 20), (10, 0), (37, 60)]:
        q_len, kv_len = jnp.int32(q_len), jnp.int32(kv_len)
        diag = masks.offset(spec, q_len, kv_len) if spec.uses_offset else 0
        want = masks.tile_mask(spec, rows, cols, kv_len, diag)
        lo, hi = masks.row_bounds(spec, rows, kv_len, diag)
        got = cols < hi
        if lo is not None:
            got = got & (cols >= lo)
        np.testing.assert_array_equal(got, jnp.broadcast_to(want, got.shape))


@pytest.mark.parametrize(
    "spec",
    [
        masks.MaskSpec(causal=True),
        masks.MaskSpec(causal=True, bottom_right=True),
        masks.MaskSpec(local_window=(5, 3)),
        masks.MaskSpec(causal=True, local_window=(7, 0)),
    ],
    ids=["causal", "causal-br", "window", "causal-window"],
)
@pytest.mark.parametrize(
    "query_dim, column_blocks", [(0, True), (0, False), (1, True)], ids=["blocks", "rows", "keys"]
)
def test_bound_mask_gives_tile_mask(spec, query_dim, column_blocks):
    """The Mosaic kernels' boundary-tile mask (pipeline.bound_mask: with the queries on the
    rows, eight key columns at a time against each row's bounds less its first columns
    (`column_blocks`), or each column against the row's bounds; with the keys on the
    rows, each key against the bounds) keeps the element pairs masks.tile_mask keeps:
    16 queries against a 64-key tile at several offsets, with key lengths that end
    before, inside and past it."""
    from pallas_flash.mosaic import pipeline

    bq, bk = 16, 64
    for first_query, first_key in [(0, 0), (40, 32), (96, 64), (3, 128)]:
        for q_len, kv_len in [(112, 200), (112, 70), (50, 0), (112, 110)]:
            q_len, kv_len = jnp.int32(q_len), jnp.int32(kv_len)
            diag = masks.offset(spec, q_len, kv_len) if spec.uses_offset else 0
            queries = first_query + jnp.arange(bq)
            rows, cols = queries[:, None], first_key + jnp.arange(bk)[None, :]
            want = jnp.broadcast_to(masks.tile_mask(spec, rows, cols, kv_len, diag), (bq, bk))
            shape = (bq, bk) if query_dim == 0 else (bk, bq)
            keys = lax.broadcasted_iota(jnp.int32, shape, 1 - query_dim)
            got = pipeline.bound_mask(
                spec, queries, keys, first_key, kv_len, diag, query_dim, column_blocks
            )
            got = got if query_dim == 0 else got.T
            np.testing.assert_array_equal(got, want, err_msg=f"{first_query=} {first_key=}")

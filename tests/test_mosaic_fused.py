"""The fused Mosaic GPU backward (`MosaicBwdConfig.fused`: one kernel, dQ added in a fixed
order, mosaic/dq_adds.py) against the float32 reference, its turn order, and its configs.

On CPU the kernel runs in Mosaic GPU's interpret mode, where the CTAs run one by one in
grid order and the writer adds without taking turns (the order tests check the turns'
arithmetic instead); its register-operand forms (fa3_order) only lower there
(tests/test_mosaic_lowering.py). Tests marked `gpu` run it compiled on the H200.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash import masks
from pallas_flash.mosaic import backward as mosaic_backward
from pallas_flash.mosaic import pipeline
from pallas_flash.mosaic.bwd_config import (
    BWD_CAUSAL_SPAN_BAND,
    QUERY_SIDE_BYTES,
    MosaicBwdConfig,
    default_mosaic_bwd_config,
    fused_full_bwd_config,
    fused_mosaic_bwd_config,
    pair_mosaic_bwd_config,
)
from pallas_flash.mosaic.config import padded_head_dim
from tests.cases import Case, packed, tolerance_check
from tests.test_mosaic_backward import (
    GPU_CASES,
    ROW_BOUND_CASES,
    _backward,
    _compare,
    _flag_changes_no_bit,
    _problem,
    _seed,
)

pytestmark = pytest.mark.mosaic  # the GPU run takes these in a step of their own

BF16, F16 = jnp.bfloat16, jnp.float16


# Head dim 128: each of two consumers computes half of the dQ share's columns. Head dim
# 64 (columns not splittable in 64s): one consumer computing the whole share.
FUSED = MosaicBwdConfig(fused=True)


FUSED_ONE = MosaicBwdConfig(fused=True, consumers_dkv=1)


# Head dim 64 with two consumers: 128-row query tiles, each consumer 64 rows of the share.
FUSED_ROWS = MosaicBwdConfig(fused=True, block_q_dkv=128)


# Head dim 64 with 64-row query tiles: each consumer 32 of the share's 64 columns, K, Q and
# dS^T in share_halves' 64-byte swizzle (dq_part's third form). Half of FUSED_ROWS's
# score tile and a 32-column share slice, the registers a consumer holds at head dim 64.
FUSED_NARROW = MosaicBwdConfig(fused=True, block_q_dkv=64, share_halves=True)
# ... and as it is timed against the pair (docs/mosaic.md, "A narrow share at head dim 64"): from
# the pair's row, in FA3's order, with two writer warps. Without step descriptors: compiled
# for the H200 here, its unmasked step is 438 instructions against 503 with them, and
# ptxas spills 8 bytes against 4 (docs/mosaic.md, "Compiled here, for the H200").
NARROW_CANDIDATE = dataclasses.replace(
    pair_mosaic_bwd_config(64),
    q_do_in_registers=False,
    fused=True,
    block_q_dkv=64,
    share_halves=True,
    fa3_order=True,
    writer_warp=True,
    split_writer=True,
)


FUSED_CASES = [
    # A GQA group of 2, bottom-right causal with a ragged key length: masked, full and
    # skipped tiles, several visitors per query tile in both heads.
    (Case(1, 150, 200, 2, 1, 128, BF16, causal=True, bottom_right=True, kv_lens=(180,)), FUSED),
    # Ragged lengths: batch 1's keys end at 33 and its rows at 61, so spans past the
    # keys visit nothing and some query tiles no span visits (their dQ is zero).
    (Case(2, 100, 90, 1, 1, 64, F16, causal=True, q_lens=(100, 61), kv_lens=(33, 90)), FUSED_ONE),
    # Packed documents: segment ids narrow each span's query range.
    (Case(1, 200, 200, 1, 1, 64, BF16, segments=(packed([(60, 140)], 200),) * 2), FUSED_ONE),
    # Two consumers at head dim 64: each computes 64 of the 128 rows of the share.
    (Case(1, 260, 190, 2, 2, 64, F16, causal=True), FUSED_ROWS),
    # Packed documents with two consumers (and a GQA group, T != S): the variants that
    # split the share between them see skipped tiles and narrowed ranges too.
    (
        Case(
            1,
            200,
            230,
            2,
            1,
            128,
            BF16,
            causal=True,
            segments=(packed([(60, 140)], 200), packed([(70, 170)], 230)),
        ),
        FUSED,
    ),  # fmt: skip
    # No mask and whole key spans: every span has one query range, so rotated_adds
    # rotates each span's walk (a GQA group of 2, a ragged last query tile).
    (Case(1, 300, 512, 2, 1, 128, BF16), FUSED),
]


# The fused kernel's variants: the step's two orientations, S^T (keys on the rows) and,
# with `query_rows`, S (P and dS through shared memory); the dQ share in two column
# halves (`share_halves`, K, Q and dS^T in the narrower swizzle) with the writer as a
# warp of the producer's warpgroup (`writer_warp`); each consumer's share over its own
# keys, consumer 1 adding consumer 0's (`chained_share`); the walks upward, rotated
# where no mask cuts the spans (`rotated_adds`: GPU interpret mode runs the CTAs in
# order, so it checks the walks, not the turns: test_rotated_adds_turns does); the
# writer warp's adds split between two warps, a slot each (`split_writer`), with the
# halves or the whole share; the last wave in pieces (`split_tail`).
FUSED_VARIANTS = {
    "keys-rows": {},
    "query-rows": {"query_rows": True},
    "share-halves-writer-warp": {"share_halves": True, "writer_warp": True},
    "chained-share": {"chained_share": True},
    "rotated-adds": {"rotated_adds": True},
    # The same walks in the non-causal head-dim-128 default's build (FA3's order, step
    # descriptors, two writer warps): what call 15 of benchmarks/next_calls.sh times.
    "rotated-adds-default-build": {
        "rotated_adds": True,
        "fa3_order": True,
        "step_descriptors": True,
        "writer_warp": True,
        "split_writer": True,
    },
    # The spans launched from the last down, so interpreted (CTAs in grid order) the
    # adds run in the turns' decreasing span order, bit for bit as compiled.
    "high-spans-first": {"rotated_adds": True, "high_spans_first": True},
    "split-writer": {"share_halves": True, "writer_warp": True, "split_writer": True},
    # Two writer warps with the whole share (head dim 64's rows: a share of N = 64).
    "writer-warps": {"writer_warp": True, "split_writer": True},
    # The queries on the rows with the two writer warps: the candidate timed at 7a9e602.
    "query-rows-writer-warps": {"query_rows": True, "writer_warp": True, "split_writer": True},
    # The last wave in pieces (backward._TAIL_SMS pretend SMs; a grid of fewer CTAs is all
    # pieces), their dK and dV summed after the kernel.
    "split-tail": {"split_tail": True},
}


def _variant(config, variant: dict):
    """`config` with a FUSED_VARIANTS entry; chained_share needs two consumers, so a
    one-consumer config keeps its own share there."""
    if variant.get("chained_share") and config.consumers_dkv != 2:
        return config
    return dataclasses.replace(config, **variant)


@pytest.mark.extended
@pytest.mark.parametrize("variant", FUSED_VARIANTS.values(), ids=FUSED_VARIANTS.keys())
@pytest.mark.parametrize("case,config", FUSED_CASES, ids=lambda x: getattr(x, "id", None))
def test_interpret_fused_matches_reference(case, config, variant):
    _compare(case, _variant(config, variant), interpret=True, seed=_seed(case))


NARROW_CASES = [
    # Causal with a GQA group of 2 and a ragged key length.
    Case(1, 200, 170, 2, 1, 64, BF16, causal=True, kv_lens=(150,)),
    # Packed documents, two batch elements, T != S.
    Case(
        2,
        130,
        200,
        2,
        2,
        64,
        F16,
        segments=(packed([(50, 90), (130,)], 130), packed([(70, 150), (200,)], 200)),
    ),  # fmt: skip
]


@pytest.mark.extended
@pytest.mark.parametrize(
    "writers",
    [{}, {"writer_warp": True, "split_writer": True}],
    ids=["writer-warpgroup", "writer-warps"],
)
@pytest.mark.parametrize("case", NARROW_CASES, ids=lambda c: c.id)
def test_interpret_fused_narrow_share_matches_reference(case, writers):
    """FUSED_NARROW (head dim 64, 64-row query tiles, the share's columns split 32 and 32)
    against the reference, with the writer as a warpgroup or as two warps."""
    _compare(case, dataclasses.replace(FUSED_NARROW, **writers), interpret=True, seed=_seed(case))


@pytest.mark.extended
@pytest.mark.parametrize(
    "case,config",
    [
        (ROW_BOUND_CASES[0], pair_mosaic_bwd_config(128)),  # the pair
        FUSED_CASES[0],  # two consumers, each reading both K and dS^T tiles
    ],
    ids=["pair", "fused"],
)
def test_interpret_step_descriptors_change_no_bit(case, config):
    """`step_descriptors` addresses the same buffers (through an offset that is 0), so
    the gradients are the same bits."""
    _flag_changes_no_bit(case, config, "step_descriptors", True)


# Two batch elements, four K/V heads (GQA groups of 2), 300 keys: 3 key spans of 128 per
# (head, batch element), causal, so the spans walk different numbers of query tiles; in
# bands of 2 heads, two bands.
SPAN_BAND_CASE = Case(2, 130, 300, 8, 4, 64, BF16, causal=True)
# One of its key/value heads' query-side bytes (high_first_bytes): 2 batch elements x
# 130 queries x 64 columns x 2 query heads.
SPAN_BAND_HEAD_BYTES = 2 * 130 * 64 * 2 * QUERY_SIDE_BYTES


@pytest.mark.extended
@pytest.mark.parametrize(
    "case,config,band",
    [
        (SPAN_BAND_CASE, pair_mosaic_bwd_config(64), 2),  # the pair's dK/dV kernel
        (SPAN_BAND_CASE, FUSED_ROWS, 2),  # the fused kernel, its adds over 3 spans a head
        # the spans from the last down: their turns the same in any band
        (
            SPAN_BAND_CASE,
            dataclasses.replace(FUSED_ROWS, rotated_adds=True, high_spans_first=True),
            2,
        ),
        # no mask, every span and tile; a band wider than the 2 heads: all at once
        (Case(2, 200, 300, 4, 2, 128, F16), FUSED, 8),
    ],
    ids=["pair", "fused", "fused-high-spans-first", "fused-no-mask-all-heads"],
)
def test_interpret_span_band_changes_no_bit(case, config, band):
    """`span_band` launches the same CTAs in another order (a band's (head, batch
    element) pairs' first span first: here 2 x 2 of them a band, 3 spans each, so the
    order differs); the fused kernel's adds keep their order, so the same bits as the
    plain order (a band of 1)."""
    _flag_changes_no_bit(case, config, "span_band", True, values=(band, 1))


def test_high_first_bytes_narrows_a_band_that_does_not_fit():
    """high_spans_first applies where a band's query-side tiles (Q, dO and float32 dQ of
    its heads' query heads and batch elements: 8 bytes a value) fit high_first_bytes;
    above, the band narrows to the most whole heads that fit, and where one head does
    not, the call launches in the plain order (rotated_adds off too); a config without
    it is launched as it is."""
    high = default_mosaic_bwd_config(64, True)
    assert high.high_spans_first and high.high_first_bytes == 32 * 2**20
    assert high.span_band == 4
    plain = dataclasses.replace(high, rotated_adds=False, high_spans_first=False)
    band = lambda n: dataclasses.replace(high, span_band=n)  # noqa: E731
    # the grid's 16k tokens, 32 heads: bands of 4 (fewer at 1k, band_pairs) take 32 MiB
    for seq in (1024, 2048, 16384):
        assert high.launched(32, 16384 // seq, seq, 64, 1) == high, seq
    assert high.launched(32, 2, 16384, 64, 1) == band(2)  # 32k tokens: 16 MiB a head
    assert high.launched(32, 1, 16384, 64, 2) == band(2)  # a GQA group of 2: the same
    assert high.launched(32, 8, 8192, 64, 1) == band(1)  # 64k tokens: 32 MiB a head
    assert high.launched(32, 4, 16384, 64, 1) == band(1)
    assert high.launched(4, 2, 8192, 64, 4) == band(1)  # 4 heads of 4 queries: 32 MiB
    # whole bands only: 3 heads of 16 MiB (32k tokens) take a band of 1, not 2
    assert high.launched(3, 2, 16384, 64, 1) == band(1)
    assert high.launched(32, 16, 8192, 64, 1) == plain  # 128k tokens: 64 MiB a head
    assert high.launched(32, 1, 16384, 64, 8) == plain  # a group of 8: 64 MiB a head
    # a band narrowed by band_pairs: 32 batch elements at 1k, one head, 16 MiB
    assert high.launched(32, 32, 1024, 64, 1) == high
    assert plain.launched(32, 2, 16384, 64, 1) == plain
    wide = dataclasses.replace(high, high_first_bytes=2**40)
    assert wide.launched(32, 2, 16384, 64, 1) == wide
    with pytest.raises(ValueError, match="high_first_bytes=0 must be >= 1"):
        dataclasses.replace(high, high_first_bytes=0)


def test_high_first_bytes_reaches_the_kernel(monkeypatch):
    """backward.py launches the config `launched` gives (traced only, not run): the
    spans from the last down where the band fits, in narrower bands where only they fit,
    the plain order where one head does not."""
    seen = []
    real = mosaic_backward.dkdv_kernel

    def spy(*args, config, **kwargs):
        seen.append((config.high_spans_first, config.span_band))
        return real(*args, config=config, **kwargs)

    monkeypatch.setattr(mosaic_backward, "dkdv_kernel", spy)
    (q, k, v, do, dlse), ref, _ = _problem(SPAN_BAND_CASE, 0, True)
    o, lse = ref[0].astype(SPAN_BAND_CASE.dtype), ref[1]
    high = dataclasses.replace(FUSED_ROWS, rotated_adds=True, high_spans_first=True, span_band=4)
    head_bytes = SPAN_BAND_HEAD_BYTES
    for first_bytes, want in (
        (4 * head_bytes, (True, 4)),
        (3 * head_bytes, (True, 2)),  # whole bands: 2 heads, not 3
        (head_bytes, (True, 1)),
        (head_bytes - 1, (False, 4)),
    ):
        config = dataclasses.replace(high, high_first_bytes=first_bytes)
        seen.clear()
        jax.eval_shape(
            lambda *a, c=config: _backward(SPAN_BAND_CASE, c, True, *a), q, k, v, o, lse, do, dlse
        )
        assert seen and set(seen) == {want}, (first_bytes, seen)


@pytest.mark.extended
def test_interpret_high_first_bytes_narrows_or_gives_the_plain_orders_bits():
    """A band over high_first_bytes narrows to the heads that fit and keeps
    high_spans_first's bits (one head of SPAN_BAND_CASE's four fits: bands of one); where
    no head fits (1 byte) the call launches in the plain order and gives its bits."""
    high = dataclasses.replace(FUSED_ROWS, rotated_adds=True, high_spans_first=True, span_band=4)
    one_head = dataclasses.replace(high, high_first_bytes=SPAN_BAND_HEAD_BYTES)
    seed = _seed(SPAN_BAND_CASE)
    chex.assert_trees_all_equal(
        _compare(SPAN_BAND_CASE, one_head, True, seed=seed),
        _compare(SPAN_BAND_CASE, high, True, seed=seed),
    )
    chex.assert_trees_all_equal(
        _compare(SPAN_BAND_CASE, dataclasses.replace(high, high_first_bytes=1), True, seed=seed),
        _compare(SPAN_BAND_CASE, FUSED_ROWS, True, seed=seed),
    )


def test_span_band_heads_per_band():
    """A band is whole: the largest divisor of the head count not above span_band, nor
    above band_pairs / batch ((head, batch element) pairs), one head at least."""
    band = lambda n, heads, batch=1: (  # noqa: E731
        dataclasses.replace(FUSED, span_band=n).heads_per_band(heads, batch)
    )
    assert [band(n, 16) for n in (1, 2, 3, 4, 5, 16, 64)] == [1, 2, 2, 4, 4, 16, 16]
    assert [band(4, heads) for heads in (1, 2, 3, 6, 7)] == [1, 2, 3, 3, 1]
    # band_pairs = 32: bands of 4 whole up to 8 batch elements (16k tokens from 2k), then
    # narrower: 2 heads at 16, one at 32 or more (never none); bands of 8 at 4 elements
    assert [band(4, 16, b) for b in (1, 8, 9, 16, 17, 32, 64)] == [4, 4, 2, 2, 1, 1, 1]
    assert [band(8, 32, b) for b in (1, 4, 8)] == [8, 8, 4]
    assert band(4, 6, 10) == 3  # the largest divisor of 6 not above 32 // 10
    assert dataclasses.replace(FUSED, span_band=16, band_pairs=64).heads_per_band(16, 8) == 8


def test_span_band_refuses_rotated_adds_and_zero():
    """rotated_adds' turns need a head's spans resident together, which a band of more
    than one head does not give; a band of no heads is no order: ValueErrors naming
    them, before anything is built."""
    with pytest.raises(ValueError, match="rotated_adds .* not with span_band=2"):
        dataclasses.replace(FUSED, rotated_adds=True, span_band=2)
    with pytest.raises(ValueError, match="span_band=0 must be >= 1"):
        dataclasses.replace(FUSED, span_band=0)
    with pytest.raises(ValueError, match="band_pairs=0 must be >= 1"):
        dataclasses.replace(FUSED, band_pairs=0)
    assert dataclasses.replace(FUSED, rotated_adds=True, span_band=1).rotated_adds
    # launched from the last span down, the turns wait on earlier CTAs only: any band
    both = dataclasses.replace(FUSED, rotated_adds=True, high_spans_first=True, span_band=4)
    assert both.span_band == 4
    with pytest.raises(ValueError, match="high_spans_first .* needs rotated_adds=True"):
        dataclasses.replace(FUSED, high_spans_first=True)
    with pytest.raises(ValueError, match="split_tail .* not with rotated_adds"):
        dataclasses.replace(FUSED, rotated_adds=True, high_spans_first=True, split_tail=True)


# split_tail in interpret mode (5 pretend SMs): 12 CTAs (2 K/V heads x 3 key spans x 2
# batch elements), so 10 whole and the last 2 (the last span of head 1, each batch
# element) in pieces over the 5 runs; causal bottom-right, so that the last span's keys
# are seen (by the lower rows only), with a ragged key length.
SPLIT_TAIL_CASE = Case(
    2, 130, 300, 4, 2, 64, BF16, causal=True, bottom_right=True, kv_lens=(300, 280)
)


@pytest.mark.extended
@pytest.mark.parametrize(
    "case,config",
    [
        (SPLIT_TAIL_CASE, pair_mosaic_bwd_config(64)),  # the pair's dK/dV kernel
        (SPLIT_TAIL_CASE, FUSED_ROWS),  # the fused kernel: its dQ adds over the pieces
        (Case(2, 200, 300, 4, 2, 128, F16), FUSED),  # no mask
        # the whole CTAs in bands of 2 heads (10 of 12 on 5 SMs), then the last two in
        # pieces: spans of two heads, where the plain order would put two of one head's
        (Case(1, 512, 300, 4, 4, 128, F16), dataclasses.replace(FUSED, span_band=2)),
    ],
    ids=["pair", "fused", "fused-no-mask", "fused-bands"],
)
def test_interpret_split_tail_matches_the_reference_and_the_whole_grid(case, config):
    """The last wave in pieces: the reference's tolerance; dQ (the same adds in the same
    turns) bit for bit the plain grid's, dK and dV within float32 summing of it."""
    split = dataclasses.replace(config, split_tail=True)
    config = dataclasses.replace(config, span_band=1)
    spans = -(-case.seq_kv // (config.key_tiles_dkv * config.block_kv_dkv))
    assert case.kv_heads * spans * case.batch % mosaic_backward._TAIL_SMS  # a last wave
    dq, dk, dv = _compare(case, split, True, seed=_seed(case))
    dq0, dk0, dv0 = _compare(case, config, True, seed=_seed(case))
    chex.assert_trees_all_equal(dq, dq0)
    for got, want in ((dk, dk0), (dv, dv0)):
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2
        )


def test_split_tail_refuses_the_other_launch_orders():
    """split_tail lays the grid out itself: not with rotated_adds or dkdv_q_multicast (a
    ValueError naming them, before anything is built); span_band's order it takes."""
    pair = pair_mosaic_bwd_config(64)
    assert dataclasses.replace(FUSED, split_tail=True, span_band=2).span_band == 2
    for base, flags in (
        (FUSED, dict(rotated_adds=True)),
        (pair, dict(dkdv_q_multicast=True)),
    ):
        with pytest.raises(ValueError, match="split_tail .* not with rotated_adds"):
            dataclasses.replace(base, split_tail=True, **flags)


@pytest.mark.extended
def test_interpret_fused_probs_before_dp_changes_no_bit():
    """`probs_before_dp` in the fused kernel's plain order (S^T awaited alone, P^T made
    before dP^T is read): the same bits (FA3's order refuses it, having its own)."""
    case, config = FUSED_CASES[0]
    _flag_changes_no_bit(case, config, "probs_before_dp", True)


@pytest.mark.extended  # early_lse is off in the fused rows (timed level at 128): not in CI's time
@pytest.mark.parametrize("query_rows", [False, True], ids=["keys-rows", "query-rows"])
def test_interpret_fused_early_lse_changes_no_bit(query_rows):
    """`early_lse` in the fused kernel's plain order and with the queries on the rows
    (whose lse lies along the other dimension): the same bits (FA3's order, the
    default's, only lowers on CPU: test_gpu_fused_early_lse_changes_no_bit)."""
    case, config = FUSED_CASES[4]  # two consumers, GQA, T != S, documents under causal
    config = dataclasses.replace(config, query_rows=query_rows)
    _flag_changes_no_bit(case, config, "early_lse", True)


@pytest.mark.extended
@pytest.mark.parametrize("variant", FUSED_VARIANTS.values(), ids=FUSED_VARIANTS.keys())
def test_interpret_fused_finds_no_data_race(capsys, variant):
    """The race detector (as test_interpret_finds_no_data_race) over the fused kernel's
    own buffers too: the one dS^T buffer both consumers read and the two share slots
    the writer empties. It does flag the interpreted writer's read-add-store of dQ in
    global memory, and only that: between CTAs it is ordered by the interpreter running
    them one by one, where the compiled kernel has its semaphores, which the interpreter
    lacks (dq_adds' module doc)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # no public accessor

    params = plgpu.InterpretGPUParams(detect_races=True)
    case = Case(1, 200, 190, 1, 1, 128, BF16, causal=True)
    config = dataclasses.replace(FUSED, **variant)  # query_rows: P and dS share a tile
    _compare(case, config, interpret=params, with_dlse=False)
    races = capsys.readouterr().out.split("RACE DETECTED")[1:]
    assert bool(races) == gpu_callbacks.get_races().races_found
    for race in races:  # both sides are the interpreted writer's dQ accesses
        assert race.count("dq_adds.py") == 2 and race.count("(writer.") == 2, race


def _visitor_table(ranges, num_tiles):
    """(index among the non-empty spans, first, last) by counting over all pairs."""
    ranges = np.asarray(ranges)
    B, spans, _ = ranges.shape
    index = np.zeros((B, spans), np.int32)
    first = np.zeros((B, num_tiles), np.int32)
    last = np.full((B, num_tiles), -1, np.int32)
    for b in range(B):
        lo, hi = ranges[b, :, 0], ranges[b, :, 3]
        nonempty = hi > lo
        index[b] = np.cumsum(nonempty) - nonempty
        for m in range(num_tiles):
            visitors = [n for n in range(spans) if lo[n] <= m < hi[n]]
            if visitors:
                ranks = index[b, visitors]
                # The visitors are consecutive among the non-empty spans: the ranks
                # the kernel derives (index - first) are 0, 1, 2, ...
                np.testing.assert_array_equal(ranks, ranks[0] + np.arange(len(ranks)))
                first[b, m], last[b, m] = ranks[0], ranks[-1]
    return index, first, last


ORDER_SPECS = {
    "full": (masks.MaskSpec(), None),
    "causal": (masks.MaskSpec(causal=True), None),
    "causal-br": (masks.MaskSpec(causal=True, bottom_right=True), None),
    "window": (masks.MaskSpec(local_window=(100, 20)), None),
    "causal-packed": (
        masks.MaskSpec(causal=True, segments=True),
        ((90, 243, 187), (200, 210, 290)),
    ),
    "unsorted-ids": (masks.MaskSpec(segments=True), "unsorted"),
}


@pytest.mark.extended
@pytest.mark.parametrize("spec,segments", ORDER_SPECS.values(), ids=ORDER_SPECS.keys())
def test_fused_add_order_matches_a_count(spec, segments):
    """The ranks of the ordered dQ adds (dq_adds.order_tables, computed in XLA from the
    kernel's query-tile ranges) against a count over every (span, tile) pair, for mask
    bands, ragged and empty lengths, packed and unsorted segment ids."""
    from pallas_flash.mosaic import dq_adds

    ranges, tiles = _order_ranges(spec, segments, S=700)
    got = dq_adds.order_tables(ranges, tiles)
    for g, want in zip(got, _visitor_table(ranges, tiles)):
        np.testing.assert_array_equal(np.asarray(g), want)


def _order_ranges(spec, segments, S: int):
    """The dK/dV kernel's query-tile ranges [4, spans, 4] for T = 520 rows of 64-row
    tiles and S keys in 128-key spans; batch 0 whole, 1 ragged (300 rows, 250 keys),
    2 and 3 empty. `segments`: None, "unsorted" (random ids), or the packed documents'
    bounds ((query bounds), (key bounds)). Returns (ranges, query tiles)."""
    T, bq, keys = 520, 64, 128
    q_len = jnp.array([520, 300, 0, 520], jnp.int32)
    kv_len = jnp.array([S, 250, S, 0], jnp.int32)
    spans, tiles = -(-S // keys), -(-T // bq)
    ranges = masks.tile_range_table(masks.q_tile_range, spec, q_len, kv_len, spans, bq, keys, keys)
    if segments is not None:
        if segments == "unsorted":
            rng = np.random.default_rng(0)
            q_seg, kv_seg = (rng.integers(0, 3, (4, n)) for n in (tiles * bq, spans * keys))
        else:
            q_seg = np.array(packed([segments[0]], T) * 4)
            kv_seg = np.array(packed([segments[1]], S) * 4)
            q_seg = np.pad(q_seg, [(0, 0), (0, tiles * bq - T)], mode="edge")
            kv_seg = np.pad(kv_seg, [(0, 0), (0, spans * keys - S)], mode="edge")
        seg = masks.segment_tile_ranges(jnp.asarray(q_seg), jnp.asarray(kv_seg), bq, keys)[1]
        ranges = pipeline.intersect_tables(ranges, seg)
    return ranges, tiles


def _adds_complete(walks, ranks, launch, resident: int, group: int = 2) -> bool:
    """The ordered adds' semaphore protocol with CTAs launched in `launch` order and at
    most `resident` of them running at once (a CTA an SM; a new one starts when one
    ends): each span's adds in its walk's order, head by head, an add going when its
    tile's count reads its rank. True when every add is made, False on a deadlock."""
    tiles = 1 + max(max(w) for w in walks.values())
    counts = np.zeros((group, tiles), np.int32)
    done = dict.fromkeys(walks, 0)
    waiting, running = list(launch), []
    while waiting or running:
        while waiting and len(running) < resident:
            running.append(waiting.pop(0))
        progress = False
        for span in running:
            walk = walks[span]
            while done[span] < group * len(walk):
                g, i = divmod(done[span], len(walk))
                if counts[g, walk[i]] != ranks[span, walk[i]]:
                    break
                counts[g, walk[i]] += 1
                done[span] += 1
                progress = True
        finished = [s for s in running if done[s] == group * len(walks[s])]
        running = [s for s in running if s not in finished]
        if not progress and not finished:
            return False
    return True


@pytest.mark.parametrize("spec,segments", ORDER_SPECS.values(), ids=ORDER_SPECS.keys())
def test_rotated_adds_turns(spec, segments):
    """rotated_adds' walks and turns (dq_adds.walk_tile, walk_place, turn), as the
    kernel derives them, over the order tests' masks with 640 keys (5 whole spans, so
    batch 0 without a mask takes the rotated walk): each walk visits its range once
    and walk_place inverts it; a tile's ranks are 0 .. visitors - 1; when every span
    runs at one pace no span waits on one that reaches the tile later (strictly
    earlier in the rotated walk and under the causal mask, the cases it is for);
    and the semaphore protocol, every span resident, ends with every add made (no
    deadlock), over a GQA group of two heads."""
    from pallas_flash.mosaic import dq_adds

    ranges, tiles = _order_ranges(spec, segments, S=640)
    index, first, last = (np.asarray(x) for x in dq_adds.order_tables(ranges, tiles))
    ring_table = np.asarray(dq_adds.ring_table(ranges))
    ranges = np.asarray(ranges)
    rotated_batches = 0
    for b in range(ranges.shape[0]):
        count, ring = ring_table[b]
        rotated_batches += int(ring)
        walks, ranks = {}, {}
        for span in range(ranges.shape[1]):
            lo, full_lo, full_hi, hi = (int(x) for x in ranges[b, span])
            if hi <= lo:
                continue
            own = index[b, span]
            rot = own if ring else 0
            walk = [int(dq_adds.walk_tile(j, lo, full_lo, full_hi, rot)) for j in range(hi - lo)]
            assert sorted(walk) == list(range(lo, hi)), (b, span, walk)
            places = [int(dq_adds.walk_place(i, lo, full_lo, full_hi, rot)) for i in walk]
            assert places == list(range(hi - lo)), (b, span)
            walks[span] = walk
            for i in walk:
                rank, visitors = dq_adds.turn(
                    own, first[b, i], last[b, i], i, count, ring, full_lo, full_hi
                )
                ranks[span, i] = int(rank)
                assert int(visitors) == last[b, i] - first[b, i] + 1
        for m in range(tiles):
            by_rank = sorted((ranks[s, m], walks[s].index(m)) for s in walks if m in walks[s])
            assert [r for r, _ in by_rank] == list(range(len(by_rank))), (b, m, by_rank)
            places = [p for _, p in by_rank]
            assert places == sorted(places), (b, m, by_rank)  # no wait on a later arrival
            if ring or spec == ORDER_SPECS["causal"][0]:
                assert len(set(places)) == len(places), (b, m, by_rank)
        # The protocol (_adds_complete), every span resident.
        if walks:
            assert _adds_complete(walks, ranks, list(walks), resident=len(walks)), b
    assert rotated_batches == (1 if spec == ORDER_SPECS["full"][0] else 0)


# high_spans_first is the head-dim-64 causal default (bwd_config.BWD_HIGH_SPANS_FIRST_DIMS):
# in the default run the causal masks it takes there, the rest in the extended tier.
HIGH_FIRST_SPECS = [
    pytest.param(*v, id=k, marks=() if v[0].causal else pytest.mark.extended)
    for k, v in ORDER_SPECS.items()
]


@pytest.mark.parametrize("spec,segments", HIGH_FIRST_SPECS)
def test_high_spans_first_turns_need_no_residency(spec, segments):
    """high_spans_first: no ring, so every tile's turns go in decreasing span order
    (dq_adds.descending_rank, which the writer takes: `turn`'s order without a ring),
    the walks upward from each span's first tile, unrotated; launched from the last
    span down, the adds complete with any number of CTAs resident, one included,
    over 640 keys (5 spans) and the order tests' masks. Launched the plain way (the
    lowest span first) with one CTA resident, they would not, wherever a tile has two
    visitors: what the reversed launch order is for."""
    from pallas_flash.mosaic import dq_adds

    ranges, tiles = _order_ranges(spec, segments, S=640)
    index, first, last = (np.asarray(x) for x in dq_adds.order_tables(ranges, tiles))
    ranges = np.asarray(ranges)
    for b in range(ranges.shape[0]):
        walks, ranks = {}, {}
        for span in range(ranges.shape[1]):
            lo, hi = int(ranges[b, span, 0]), int(ranges[b, span, 3])
            if hi <= lo:
                continue
            walks[span] = list(range(lo, hi))  # upward, unrotated
            for i in walks[span]:
                own = index[b, span]
                rank, is_last, _ = dq_adds.descending_rank(own, first[b, i], last[b, i])
                ranks[span, i] = int(rank)
                # as `turn` orders a tile where no ring applies: decreasing span
                ring_free = dq_adds.turn(own, first[b, i], last[b, i], i, 1, 0, lo, hi)[0]
                assert ranks[span, i] == int(ring_free) and is_last == (
                    rank == last[b, i] - first[b, i]
                )
        if not walks:
            continue
        high_first = sorted(walks, reverse=True)
        for resident in (1, 2, len(walks)):
            assert _adds_complete(walks, ranks, high_first, resident), (b, resident)
        shared = any(last[b, m] > first[b, m] for m in range(tiles))
        assert _adds_complete(walks, ranks, sorted(walks), 1) == (not shared), b


def test_fused_config_validation():
    with pytest.raises(ValueError, match="split_dkv=False"):
        MosaicBwdConfig(fused=True, split_dkv=True)
    with pytest.raises(ValueError, match="rotated_adds .* needs fused=True"):
        MosaicBwdConfig(rotated_adds=True)
    with pytest.raises(ValueError, match="split_writer .* needs writer_warp=True"):
        MosaicBwdConfig(fused=True, split_writer=True)
    with pytest.raises(ValueError, match="split_writer .* not chained_share"):
        MosaicBwdConfig(fused=True, writer_warp=True, chained_share=True, split_writer=True)
    with pytest.raises(ValueError, match="block_q_dkv a multiple of 128, not 64 .or share_halves"):
        FUSED.dq_part(64)  # 32 columns each: not the 128-byte swizzle's 64
    assert FUSED.dq_part(128) == (64, 64)
    assert MosaicBwdConfig(fused=True, block_q_dkv=128).dq_part(64) == (64, 64)  # rows
    assert FUSED_ONE.dq_part(64) == (64, 64)
    # The fused rows mask as the default rows do (row bounds at head dims 64 and 128).
    rows = dict(row_bound_mask=True)
    assert fused_mosaic_bwd_config(128) == dataclasses.replace(FUSED, **rows)
    assert fused_mosaic_bwd_config(64) == dataclasses.replace(FUSED_ROWS, **rows)
    with pytest.raises(ValueError, match="above 128"):
        fused_mosaic_bwd_config(256)
    with pytest.raises(ValueError, match="registers"):  # dK, dV and a 64 x 128 share
        mosaic_backward.check_fits(MosaicBwdConfig(fused=True, consumers_dkv=1), 128)
    with pytest.raises(ValueError, match="shared memory"):  # plus the staging buffers
        mosaic_backward.check_fits(dataclasses.replace(FUSED, operands_in_registers=False), 128)
    for kwargs in ({}, {"fused": True, "operands_in_registers": False}):
        with pytest.raises(ValueError, match="fa3_order needs fused=True"):
            MosaicBwdConfig(fa3_order=True, **kwargs)
    with pytest.raises(ValueError, match="needs fused=True"):
        MosaicBwdConfig(query_rows=True)
    with pytest.raises(ValueError, match="pick one"):
        MosaicBwdConfig(fused=True, fa3_order=True, query_rows=True)
    for kwargs in ({}, {"fused": True, "query_rows": True}):
        with pytest.raises(ValueError, match="share_halves .* not query_rows"):
            MosaicBwdConfig(share_halves=True, **kwargs)
    with pytest.raises(ValueError, match="writer_warp .* needs fused=True"):
        MosaicBwdConfig(writer_warp=True)
    halves = dataclasses.replace(FUSED, share_halves=True)
    assert (FUSED.share_pieces(128), halves.share_pieces(128)) == (1, 2)
    # Head dim 64 with 64-row tiles: in the narrow swizzle, a 32-column slice, one piece.
    assert (halves.dq_part(64), halves.share_pieces(64)) == ((64, 32), 1)
    rows_halves = dataclasses.replace(FUSED_ROWS, share_halves=True)  # rows first
    assert (rows_halves.dq_part(64), rows_halves.share_pieces(64)) == ((64, 64), 2)
    for kwargs in ({}, {"fused": True, "consumers_dkv": 1}, {"fused": True, "query_rows": True},
                   {"fused": True, "share_halves": True}):  # fmt: skip
        with pytest.raises(ValueError, match="chained_share .* needs fused=True"):
            MosaicBwdConfig(chained_share=True, **kwargs)
    # One writer slot and consumer 0's parts in place of the second slot: the same bytes.
    chained = dataclasses.replace(FUSED, chained_share=True)
    assert chained.smem_bytes_dkv(128) - FUSED.smem_bytes_dkv(128) == 8 * 2 * 2  # barriers
    # No staging buffer: P and dS reach their wgmmas from the consumer's own tile.
    staged = dataclasses.replace(FUSED, operands_in_registers=False)
    rows = dataclasses.replace(staged, query_rows=True)
    assert staged.smem_bytes_dkv(128) - rows.smem_bytes_dkv(128) == 2 * 64 * 64 * 2


# The fused kernel, compiled: the shared case table at head dims up to 128 (above, the
# two consumers' accumulators do not fit beside a dQ share), and determinism: its dQ
# is the only result built across CTAs, in the semaphores' order.
FUSED_GPU_CASES = [c for c in GPU_CASES if padded_head_dim(c.head_dim) <= 128]


@pytest.mark.gpu
@pytest.mark.parametrize("case", FUSED_GPU_CASES, ids=lambda c: c.id)
def test_gpu_fused_matches_reference(case):
    _compare(case, fused_mosaic_bwd_config(case.head_dim), interpret=False, seed=_seed(case))


@pytest.mark.gpu
@pytest.mark.parametrize("case", FUSED_GPU_CASES, ids=lambda c: c.id)
def test_gpu_fused_fa3_order_matches_reference(case):
    """The fused step in FA3's order: the same products accumulated in the same order, so
    the same bits as the fused default (and the reference's tolerance)."""
    config = fused_mosaic_bwd_config(case.head_dim)
    fa3 = _compare(
        case, dataclasses.replace(config, fa3_order=True), interpret=False, seed=_seed(case)
    )
    chex.assert_trees_all_equal(fa3, _compare(case, config, False, seed=_seed(case)))


@pytest.mark.gpu
@pytest.mark.parametrize("case", FUSED_GPU_CASES, ids=lambda c: c.id)
def test_gpu_fused_query_rows_matches_reference(case):
    """The fused step with the queries on the rows (`query_rows`), compiled: P and dS
    through shared memory, dS computed beside dV's wgmma (its GPU-only path); the fused
    default's row (step descriptors, two writer warps) with it in place of FA3's order
    and the halves, as the benchmark times it (`$M/fused/fa3_order=false/...`)."""
    config = dataclasses.replace(
        fused_full_bwd_config(case.head_dim),
        fa3_order=False,
        share_halves=False,
        query_rows=True,
    )
    _compare(case, config, interpret=False, seed=_seed(case))


def _fused_fa3_steps(head_dim: int) -> MosaicBwdConfig:
    """The fused build the benchmark times: FA3's order with per-step descriptors."""
    return dataclasses.replace(
        fused_mosaic_bwd_config(head_dim), fa3_order=True, step_descriptors=True
    )


@pytest.mark.gpu
@pytest.mark.parametrize("case", FUSED_GPU_CASES, ids=lambda c: c.id)
def test_gpu_fused_share_halves_matches_reference(case):
    """The dQ share in two column halves with the writer in a warp, compiled, in FA3's
    order with per-step descriptors (the build timed): the reference's tolerance, and
    the same bits as the whole share (each dQ element the same sum of the same
    products, the tensor core's over 16 keys at a time either way)."""
    config = _fused_fa3_steps(case.head_dim)
    halves = dataclasses.replace(config, share_halves=True, writer_warp=True)
    got = _compare(case, halves, interpret=False, seed=_seed(case))
    chex.assert_trees_all_equal(got, _compare(case, config, False, seed=_seed(case)))


@pytest.mark.gpu
@pytest.mark.parametrize("case", FUSED_GPU_CASES, ids=lambda c: c.id)
def test_gpu_fused_chained_share_matches_reference(case):
    """Each consumer's share over its own keys, consumer 1 adding consumer 0's, compiled
    in FA3's order with per-step descriptors (the reference's tolerance; its bits are
    its own: the share's terms are added in another order). Two calls, the same bits."""
    config = _variant(_fused_fa3_steps(case.head_dim), {"chained_share": True})
    first = _compare(case, config, interpret=False, seed=_seed(case))
    chex.assert_trees_all_equal(first, _compare(case, config, False, seed=_seed(case)))


def test_rotated_adds_refuses_more_spans_than_sms(monkeypatch):
    """A span may wait on a later one, so all of a head's must be resident: more key
    spans than SMs is a ValueError naming the flag, raised before the kernel is built
    (here on CPU, with the SM count made 2 for three spans)."""
    monkeypatch.setattr(mosaic_backward, "sm_count", lambda: 2)
    case = Case(1, 64, 384, 1, 1, 128, BF16)
    with pytest.raises(ValueError, match="rotated_adds needs a head's 3 key spans"):
        _compare(case, dataclasses.replace(FUSED, rotated_adds=True), interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("case", FUSED_GPU_CASES, ids=lambda c: c.id)
def test_gpu_fused_rotated_adds_matches_reference(case):
    """The adds in the order the spans arrive (rotated_adds), compiled in the build
    timed (FA3's order, per-step descriptors, halves, the writer a warp): the
    reference's tolerance, and two calls the same bits (its own order, not the plain
    order's). A turn out of order would hang (the test's timeout) or overwrite."""
    config = dataclasses.replace(
        _fused_fa3_steps(case.head_dim), share_halves=True, writer_warp=True, rotated_adds=True
    )
    first = _compare(case, config, interpret=False, seed=_seed(case))
    chex.assert_trees_all_equal(first, _compare(case, config, False, seed=_seed(case)))


@pytest.mark.gpu
@pytest.mark.parametrize("case", FUSED_GPU_CASES, ids=lambda c: c.id)
def test_gpu_fused_high_spans_first_matches_reference(case):
    """The spans launched from the last down (high_spans_first), compiled on the default
    row (in bands of 4 heads where causal): the reference's tolerance, and two calls the
    same bits (its own order, decreasing span). A turn out of order would hang (the
    test's timeout) or overwrite."""
    default = default_mosaic_bwd_config(case.head_dim, case.causal)
    assert default.fused  # every head dim up to 128 (BWD_FUSED_ROWS)
    config = dataclasses.replace(default, rotated_adds=True, high_spans_first=True)
    first = _compare(case, config, interpret=False, seed=_seed(case))
    chex.assert_trees_all_equal(first, _compare(case, config, False, seed=_seed(case)))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", [c for c in FUSED_GPU_CASES if c.causal and c.kv_heads > 1], ids=lambda c: c.id
)
def test_gpu_high_first_bytes_narrowed_band_changes_no_bit(case):
    """high_spans_first in bands narrowed to one head by high_first_bytes (`launched`, as
    a call past the grid's 16k tokens gets them), compiled: the bits of bands of 4 (the
    turns go in decreasing span order in any band), and the reference's tolerance."""
    default = default_mosaic_bwd_config(case.head_dim, case.causal)
    config = dataclasses.replace(default, rotated_adds=True, high_spans_first=True)
    hp, group = padded_head_dim(case.head_dim), case.heads // case.kv_heads
    head_bytes = case.batch * case.seq_q * hp * group * QUERY_SIDE_BYTES
    one = dataclasses.replace(config, high_first_bytes=head_bytes)
    assert one.launched(case.kv_heads, case.batch, case.seq_q, hp, group).span_band == 1
    _flag_changes_no_bit(
        case, config, "high_first_bytes", interpret=False, values=(2**40, head_bytes)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("case", FUSED_GPU_CASES, ids=lambda c: c.id)
def test_gpu_fused_split_writer_changes_no_bit(case):
    """Two writer warps, a slot each (split_writer), compiled in the build timed, the
    fused default's (fused_full_bwd_config): the same adds in the same order as one
    writer, so the same bits (and the reference's tolerance)."""
    _flag_changes_no_bit(
        case, fused_full_bwd_config(case.head_dim), "split_writer", interpret=False
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", [c for c in GPU_CASES if padded_head_dim(c.head_dim) == 128], ids=lambda c: c.id
)
def test_gpu_fused_whole_share_changes_no_bit(case):
    """The fused default's build (fused_full_bwd_config) with its dQ share whole instead
    of in column halves, compiled, where it is timed (padded head dim 128): the same
    bits as the halves, and the reference's tolerance."""
    _flag_changes_no_bit(case, fused_full_bwd_config(case.head_dim), "share_halves", False)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", [c for c in GPU_CASES if padded_head_dim(c.head_dim) == 128], ids=lambda c: c.id
)
def test_gpu_fused_early_lse_changes_no_bit(case):
    """early_lse compiled on the default row for the case (the fused kernel in FA3's
    order at padded head dim 128, causal in bands): the lse read before the scores'
    wgmma, the same gradients bit for bit, and the reference's tolerance."""
    config = default_mosaic_bwd_config(case.head_dim, case.causal)
    _flag_changes_no_bit(case, config, "early_lse", False)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", [c for c in GPU_CASES if padded_head_dim(c.head_dim) == 64], ids=lambda c: c.id
)
def test_gpu_fused_narrow_share_matches_reference(case):
    """The head-dim-64 candidate with 64-row query tiles (NARROW_CANDIDATE), compiled as
    it is timed, within the reference's tolerance."""
    _compare(case, NARROW_CANDIDATE, interpret=False, seed=_seed(case))


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["fused-fa3", "pair"])
@pytest.mark.parametrize("case", FUSED_GPU_CASES, ids=lambda c: c.id)
def test_gpu_step_descriptors_change_no_bit(case, kernels):
    """step_descriptors compiled, in the fused kernel in FA3's order (where the spills
    were) and in the pair: the same bits as without."""
    if kernels == "pair":
        config = pair_mosaic_bwd_config(case.head_dim)
    else:
        config = dataclasses.replace(fused_mosaic_bwd_config(case.head_dim), fa3_order=True)
    _flag_changes_no_bit(case, config, "step_descriptors", False)


# More dK/dV CTAs than SMs and not a multiple of them (512 on 132: 116 in pieces), and
# fewer (64 and 112: all in pieces); the fused default non-causal, the pair causal.
SPLIT_TAIL_GPU_CASES = [
    Case(4, 2048, 2048, 8, 8, 64, F16),
    Case(2, 2048, 2000, 8, 2, 128, BF16, kv_lens=(2000, 1100)),
    Case(2, 1000, 1700, 8, 4, 64, BF16, causal=True, bottom_right=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("band", [1, BWD_CAUSAL_SPAN_BAND], ids=["plain", "bands"])
@pytest.mark.parametrize("case", SPLIT_TAIL_GPU_CASES, ids=lambda c: c.id)
def test_gpu_split_tail_backward_matches_reference(case, band):
    """The backward's split_tail compiled on the call's default row, its whole CTAs in
    the plain launch order or in bands of heads (not high_spans_first's, which needs
    rotated_adds): the reference's tolerance, dQ bit for bit the plain grid's without
    the split, dK and dV within float32 summing of it, the same bits twice."""
    config = dataclasses.replace(
        default_mosaic_bwd_config(case.head_dim, case.causal),
        span_band=1,
        rotated_adds=False,
        high_spans_first=False,
    )
    split = dataclasses.replace(config, split_tail=True, span_band=band)
    got = _compare(case, split, False, seed=_seed(case))
    dq0, dk0, dv0 = _compare(case, config, False, seed=_seed(case))
    chex.assert_trees_all_equal(got[0], dq0)
    for x, want in zip(got[1:], (dk0, dv0)):
        np.testing.assert_allclose(
            np.asarray(x, np.float32), np.asarray(want, np.float32), atol=1e-2
        )
    chex.assert_trees_all_equal(got, _compare(case, split, False, seed=_seed(case)))


@pytest.mark.gpu
@pytest.mark.parametrize("case", FUSED_GPU_CASES, ids=lambda c: c.id)
def test_gpu_span_band_changes_no_bit(case):
    """span_band compiled on the default row (the fused kernel or the pair), in bands
    of 4 heads (BWD_CAUSAL_SPAN_BAND; every head at once where there are 4 or fewer):
    the same bits as the plain launch order, and the reference's tolerance. (Bands of 2
    passed on these rows at 00676b3: results/mosaic-00676b3/mosaic-tests-call-4.log.)"""
    config = default_mosaic_bwd_config(case.head_dim, case.causal)
    _flag_changes_no_bit(case, config, "span_band", False, values=(BWD_CAUSAL_SPAN_BAND, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_fused_is_bitwise_deterministic(head_dim):
    """Ten calls, bitwise-equal gradients: a GQA group of 4, causal, ragged key lengths,
    16 key spans adding to most query tiles."""
    case = Case(2, 2048, 2000, 8, 2, head_dim, BF16, causal=True, kv_lens=(2000, 900))
    (q, k, v, do, dlse), ref, naive = _problem(case, 4, True)
    o, lse = ref[0].astype(BF16), ref[1]
    dlse = jnp.where(jnp.isfinite(lse), dlse, 0.0)
    config = fused_mosaic_bwd_config(head_dim)
    run = lambda: _backward(case, config, False, q, k, v, o, lse, do, dlse)  # noqa: E731
    first = run()
    for name, got, r, n in zip(("dq", "dk", "dv"), first, ref[2:], naive[2:]):
        tolerance_check(f"fused {case.id} {name}", got, r, n, case.dtype)
    for _ in range(9):
        chex.assert_trees_all_equal(first, run())

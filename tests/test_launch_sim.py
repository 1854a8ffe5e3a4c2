"""benchmarks.launch_sim: the launch model's fill on shapes whose answer is known by hand,
and its grid orders against the kernels' own."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks import launch_sim
from pallas_flash.mosaic import bwd_config
from pallas_flash.mosaic import config as fwd_config


def test_equal_ctas_fill_whole_waves_only():
    """2048 equal CTAs on 132 SMs: 15 full waves and one of 68, so 15.52 of 16 waves."""
    work, end = launch_sim.fill([1.0] * 2048)
    assert (work, end) == (2048.0, 16.0)
    assert launch_sim.fill([1.0] * 132 * 3) == (396.0, 3.0)
    assert launch_sim.fill([5.0, 1.0, 1.0], sms=2) == (7.0, 5.0)  # the long one is the end


def test_longest_first_fills_better_than_shortest_first():
    """A causal grid's costs longest first (as every Mosaic kernel launches them) end
    sooner than the same costs shortest first, whose last CTA is the longest."""
    costs = [float(c) for c in range(1, 257)] * 16
    longest_first = sorted(costs, reverse=True)
    assert launch_sim.fill(longest_first)[1] < launch_sim.fill(sorted(costs))[1]
    work, end = launch_sim.fill(longest_first)
    assert work / (132 * end) > 0.99


def test_span_order_is_the_grid_order():
    """Bands of 1 are head by head (grid (heads, spans, batch)); a band of every head is
    span-major (grid (spans, heads, batch)); every (head, span, batch element) once."""
    k, spans, b = 4, 3, 2
    plain = [(h, s, e) for h in range(k) for s in range(spans) for e in range(b)]
    major = [(h, s, e) for s in range(spans) for h in range(k) for e in range(b)]
    assert launch_sim.span_order(k, spans, b, 1) == plain
    assert launch_sim.span_order(k, spans, b, k) == major
    banded = launch_sim.span_order(k, spans, b, 2)
    assert sorted(banded) == sorted(plain) and banded[:4] == [
        (0, 0, 0),
        (0, 0, 1),
        (1, 0, 0),
        (1, 0, 1),
    ]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_full_grids_lose_the_last_wave(head_dim):
    """Without a mask every CTA (or persistent item) costs the same, so both passes of
    the fa grid fill 2048 (or 4096) / (132 x 16 or 32): 0.970 at every length."""
    for seq in (2048, 16384):
        line = launch_sim.report(head_dim, seq, False, [1], cta_steps=2.0)
        assert line.count("fill 0.970") == 2, line
        split = float(line.split("split fill ")[1].split()[0])  # the forward's, split_tail
        assert split >= 0.99, line
        split = float(line.split("bwd band 1 split: ")[1].split("fill ")[1].split()[0])  # bwd
        assert split >= 0.985, line


def test_split_tail_pieces_add_up_to_the_last_round():
    """With split_tail the CTAs' work is the whole rounds' plus the last round's key
    tiles, spread within a tile of each other (no fixed cost here)."""
    config = dataclasses.replace(
        fwd_config.default_mosaic_config(128, 8192, False), split_tail=True
    )
    per_cta = launch_sim.forward_costs(config, 8192, 2, 16, False, cta_steps=0)
    tiles = 8192 // config.block_kv
    assert sum(per_cta) == 2048 * tiles
    assert max(per_cta) - min(per_cta) <= 1


def test_backward_costs_follow_the_causal_ranges():
    """The fused kernel's span s walks the query tiles from its first key down, each
    head of its group; the pair's dQ kernel its key tiles up to its last row."""
    fused = bwd_config.fused_full_bwd_config(128)
    ((name, costs),) = launch_sim.backward_costs(fused, 1024, 1, 4, 2, True, cta_steps=0)
    keys, bq = fused.key_tiles_dkv * fused.block_kv_dkv, fused.block_q_dkv
    assert name == "fused" and len(costs) == 2 * (1024 // keys)
    assert costs[0] == (1024 // bq) * 2  # span 0 of head 0: every tile, 2 heads a group
    assert costs[-1] == (1024 - (1024 // keys - 1) * keys) // bq * 2
    pair = bwd_config.pair_mosaic_bwd_config(64)
    parts = dict(launch_sim.backward_costs(pair, 1024, 1, 1, 1, True, cta_steps=0))
    rows = pair.consumers_dq * pair.block_q_dq
    assert parts["dq"][0] == 1024 // pair.block_kv_dq  # the bottom rows first: every key tile
    assert parts["dq"][-1] == -(-rows // pair.block_kv_dq)
    with pytest.raises(ValueError, match="not modelled"):
        launch_sim.backward_costs(
            dataclasses.replace(fused, rotated_adds=True), 1024, 1, 1, 1, True, 0
        )


def test_persistent_forward_walks_every_item_once():
    """A persistent grid's CTAs sum the items pipeline.persistent_item gives them: all of
    them, each once (here 2048 equal items: 15 or 16 a CTA; the row unsplit)."""
    config = fwd_config.default_mosaic_config(128, 8192, False)
    assert config.persistent and config.split_tail
    config = dataclasses.replace(config, split_tail=False, tail_fixup=False)
    per_cta = launch_sim.forward_costs(config, 8192, 2, 16, False, cta_steps=0)
    tiles = 8192 // config.block_kv
    assert len(per_cta) == 132 and sum(per_cta) == 2048 * tiles
    assert {c / tiles for c in per_cta} == {15.0, 16.0}


def test_ordered_adds_cost_nothing_free_and_sort_the_bands_when_waited_on():
    """ordered_adds_fill: with free adds (0 steps) the fused kernel's fill is
    backward_costs' (0.970 without a mask); with adds of a step, the causal grid's
    spans of one head, resident together from the same top tile down, wait on each
    other's turns, and bands of heads (spans of several heads resident) fill more,
    while without a mask bands change little; a non-fused config is refused."""
    fused = bwd_config.default_mosaic_bwd_config(64, False)
    b, n = 16384 // 4096, 32
    free = launch_sim.ordered_adds_fill(fused, 4096, b, n, n, False, 2.0, 0.0)
    assert free == pytest.approx(0.970, abs=0.001)
    causal = dataclasses.replace(  # the plain launch order (not high_spans_first's)
        bwd_config.default_mosaic_bwd_config(64, True),
        span_band=1,
        band_pairs=1024,
        rotated_adds=False,
        high_spans_first=False,
    )
    fills = {
        band: launch_sim.ordered_adds_fill(
            dataclasses.replace(causal, span_band=band), 16384, 1, n, n, True, 2.0, 1.0
        )
        for band in (1, 4, 8)
    }
    assert fills[1] < fills[4] - 0.1 and fills[4] < fills[8] <= 1.0, fills
    full = [
        launch_sim.ordered_adds_fill(
            dataclasses.replace(fused, span_band=band), 16384, 1, n, n, False, 2.0, 1.0
        )
        for band in (1, 8)
    ]
    assert abs(full[0] - full[1]) < 0.01, full
    line = launch_sim.report(64, 16384, True, [1, 4], cta_steps=2.0, add_steps=1.0)
    assert line.count("with the adds' turns") == 4, line  # bands of 1 and 4, whole and split
    # without a mask at head dim 128 the split last wave and bands of 4 each shorten the
    # turns' queue, and together more than either (by the model: timed on an H100 at
    # e6ab66d, neither led steadily, docs/mosaic.md, "The backward's half")
    line = launch_sim.report(128, 16384, False, [1, 4], cta_steps=2.0, add_steps=1.0)
    turns = [float(part.split("turns ")[1]) for part in line.split(" | ")[1:]]
    assert turns[0] < min(turns[1], turns[2]) and max(turns[1], turns[2]) < turns[3], line
    with pytest.raises(ValueError, match="fused kernel's"):
        pair = bwd_config.pair_mosaic_bwd_config(64)
        launch_sim.ordered_adds_fill(pair, 4096, b, n, n, True, 2.0, 1.0)


def test_high_spans_first_launches_the_last_span_first_and_walks_up():
    """high_spans_first in the model: the launch order's spans from the last down (the
    longest causal walks last), each walking upward. Without add costs the causal grid
    ends less evenly than the plain order (its longest CTAs at the end); with adds of a
    step the turns no longer queue (each span reaches a tile after the one above it),
    so at head dim 64 causal 16k the fill passes the plain order's by far: the model's
    claim (1.14x), of which an H100 bore out a third (1.05x, results/mosaic-78baa53/),
    enough to make it that row's default."""
    high = bwd_config.default_mosaic_bwd_config(64, True)
    assert high.rotated_adds and high.high_spans_first
    base = dataclasses.replace(high, rotated_adds=False, high_spans_first=False)
    units = launch_sim.dkdv_units(high, 1024, 1, 1, True)
    spans = [span for _, span, *_ in units]
    assert spans == sorted(spans, reverse=True) and spans[-1] == 0

    def fill(config, adds):
        return launch_sim.ordered_adds_fill(config, 16384, 1, 32, 32, True, 2.0, adds)

    assert fill(high, 0.0) < fill(base, 0.0) - 0.01
    assert fill(high, 1.0) > fill(base, 1.0) + 0.05
    line = launch_sim.report(64, 16384, True, [4], 2.0, add_steps=1.0, high_first=True)
    assert "high spans first" in line, line


def test_l2_rereads_count_the_query_tiles_fetches():
    """l2_rereads: with an L2 that holds everything each query tile is fetched once, with
    one that holds nothing once a visit (a causal 4k head dim 128 grid: 128-key spans
    over 64-row tiles, 16.5 visits a tile on average; without a mask, 32); in between,
    the plain order (a head's spans passing a tile together) fetches each once, while
    high_spans_first (each span reaching a tile at its own time) fetches it about as
    often as it is visited, in any band while the heads' spans all fit on the SMs."""
    plain = bwd_config.default_mosaic_bwd_config(128, True)
    high = dataclasses.replace(plain, rotated_adds=True, high_spans_first=True)
    args = (4096, 1, 4, 4, True, 128)
    assert launch_sim.l2_rereads(high, *args, l2_bytes=2**40) == 1.0
    assert launch_sim.l2_rereads(plain, *args, l2_bytes=1) == 16.5
    assert launch_sim.l2_rereads(high, *args, l2_bytes=1) == 16.5
    full = bwd_config.default_mosaic_bwd_config(128, False)
    assert launch_sim.l2_rereads(full, 4096, 1, 4, 4, False, 128, l2_bytes=1) == 32.0
    assert launch_sim.l2_rereads(plain, *args, l2_bytes=8 * 2**20) == 1.0
    for band in (1, 4):
        got = launch_sim.l2_rereads(
            dataclasses.replace(high, span_band=band), *args, l2_bytes=8 * 2**20
        )
        assert got > 12, (band, got)
    line = launch_sim.report(64, 4096, True, [4], 2.0, add_steps=1.0, high_first=True, l2=True)
    assert "L2 fetches 1.00x (high spans first 1.00x)" in line, line


def test_tokens_set_the_batch():
    """--tokens: a batch of tokens // seq elements (the grid's 16k by default), so twice
    the tokens launch twice the CTAs; a length that does not divide them is refused."""
    grid = launch_sim.report(64, 8192, True, [1], 2.0)
    double = launch_sim.report(64, 8192, True, [1], 2.0, tokens=32768)
    assert "fwd 4096 CTAs" in grid and "fused 4096 CTAs" in grid, grid
    assert "fwd 8192 CTAs" in double and "fused 8192 CTAs" in double, double
    with pytest.raises(ValueError, match="tokens=10000"):
        launch_sim.report(64, 8192, True, [1], 2.0, tokens=10000)


def test_head_rounds_keep_the_persistent_causal_grid_even():
    """head_rounds (head order, each round's longest first) leaves the CTAs' causal work
    as even as the tile-major order at the short lengths the persistent grid is for: at
    head dim 64 causal 1k (512 pairs of 8 items on 132 CTAs) the busiest CTA has 2.2 %
    more work than the mean (tile-major 3.1 %); every item is walked once."""
    config = dataclasses.replace(
        fwd_config.default_mosaic_config(64, 1024, True), persistent=True, head_rounds=True
    )
    per_cta = launch_sim.forward_costs(config, 1024, 16, 32, True, cta_steps=0.5)
    plain = launch_sim.forward_costs(
        dataclasses.replace(config, head_rounds=False), 1024, 16, 32, True, cta_steps=0.5
    )
    assert sum(per_cta) == pytest.approx(sum(plain))
    mean = sum(per_cta) / len(per_cta)
    assert max(per_cta) / mean == pytest.approx(1.022, abs=0.001)
    assert max(plain) / mean == pytest.approx(1.031, abs=0.001)


def test_forward_kv_fetches_tile_major_against_head_order():
    """forward_kv_fetches (a 50 MiB least-recently-used L2 over the steps' K/V reads): at
    head dim 64 causal 1k the persistent grid's tile-major walk fetches its K and V tiles
    4.04x over (a head's next tile comes back after 512 heads' tiles), head order and the
    grid of one CTA per item once each; an L2 of one tile refetches every reread."""
    row = fwd_config.default_mosaic_config(64, 1024, True)
    assert row.persistent and row.head_rounds
    shape = (1024, 16, 32, True, 64)
    tile_major = dataclasses.replace(row, head_rounds=False)
    one_each = dataclasses.replace(row, persistent=False, early_q_load=False, head_rounds=False)
    assert launch_sim.forward_kv_fetches(row, *shape) == 1.0
    assert launch_sim.forward_kv_fetches(one_each, *shape) == 1.0
    assert launch_sim.forward_kv_fetches(tile_major, *shape) == pytest.approx(4.04, abs=0.01)
    tiny = 2 * row.block_kv * 64 * 2  # one tile's K and V
    assert launch_sim.forward_kv_fetches(row, *shape, l2_bytes=tiny) > 4.0
    with pytest.raises(ValueError, match="split_tail"):
        launch_sim.forward_kv_fetches(
            dataclasses.replace(row, head_rounds=False, early_q_load=False, split_tail=True),
            *shape,
        )


def test_greedy_items_fill_as_the_grid_of_one_cta_per_item():
    """greedy_items' list schedule, in the model, gives each CTA what the block scheduler
    would give the grid of one CTA per item (the same hand-out, decided before the
    kernel): at head dim 128 causal 4k / 8k (2048 items) it fills 0.99 or more of the
    SMs' time as that grid does, where head_rounds' sorted rounds fill 0.970, walks every
    item once and reads each K and V tile from HBM once (forward_kv_fetches)."""
    # one CTA per item: the 16k row without its clusters (KV_MULTICAST_CAUSAL_128)
    row = fwd_config.default_mosaic_config(128, 16384, True)
    row = dataclasses.replace(row, kv_multicast=False)
    heads = dataclasses.replace(row, persistent=True, head_rounds=True, early_q_load=True)
    greedy = dataclasses.replace(heads, greedy_items=True)
    assert fwd_config.default_mosaic_config(128, 4096, True) == greedy  # the 4k / 8k row
    for seq in (4096, 8192):
        shape = (seq, 16384 // seq, 16, True)
        grid_work, grid_end = launch_sim.fill(launch_sim.forward_costs(row, *shape, 0.5))
        costs = {c: launch_sim.forward_costs(c, *shape, 0.5) for c in (heads, greedy)}
        fills = {c: sum(x) / (132 * max(x)) for c, x in costs.items()}
        assert sum(costs[greedy]) == pytest.approx(grid_work) == pytest.approx(sum(costs[heads]))
        assert fills[greedy] == pytest.approx(grid_work / (132 * grid_end), abs=0.002)
        assert fills[greedy] >= 0.99 and fills[heads] == pytest.approx(0.970, abs=0.002)
        assert launch_sim.forward_kv_fetches(greedy, *shape, 128) == 1.0


def test_clusters_fill_sm_pairs_with_pairs_of_tiles():
    """kv_multicast in the model (the head-dim-128 causal row above 8192 keys): a cluster
    of two CTAs is a unit on an SM pair, its item a pair of adjacent query tiles walking
    the pair's key range, so beside one CTA per tile the pairs do that grid's work plus
    the lower tile's masked key tiles (one 128-key tile a pair under a causal mask: 0.8 %
    at 16k keys) and end about that much later; on the persistent grid (66 clusters, the
    list schedule's pairs at 8k) likewise. The report names it, where it once raised."""
    row = fwd_config.default_mosaic_config(128, 16384, True)
    assert row.kv_multicast and not row.persistent and launch_sim.forward_sms(row) == 66
    rows = row.consumers * row.block_q
    for config, seq in ((row, 16384), (fwd_config.default_mosaic_config(128, 8192, True), 8192)):
        shape = (seq, 16384 // seq, 16, True)
        clusters = dataclasses.replace(config, kv_multicast=True)
        single = dataclasses.replace(config, kv_multicast=False)
        pair_costs = launch_sim.forward_costs(clusters, *shape, 0)
        tile_costs = launch_sim.forward_costs(single, *shape, 0)
        pairs = 16 * (16384 // seq) * (seq // (2 * rows))
        assert 2 * sum(pair_costs) - sum(tile_costs) == pairs * rows // config.block_kv
        if config.persistent:
            assert len(pair_costs) == 66 and len(tile_costs) == 132
            end, one_end = max(pair_costs), max(tile_costs)
        else:
            assert len(pair_costs) == pairs and len(tile_costs) == 2 * pairs
            end = launch_sim.fill(pair_costs, 66)[1]
            one_end = launch_sim.fill(tile_costs)[1]
        assert one_end * 0.99 < end < one_end * 1.02, (seq, end, one_end)
    line = launch_sim.report(128, 16384, True, [1], 2.0)
    assert "1024 clusters fill" in line, line

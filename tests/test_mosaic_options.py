"""The Mosaic GPU forward's schedule and softmax options in interpret mode: the
persistent grid, the mask forms (row_bound_mask, column_blocks), kv_multicast, early Q
loads and O from registers, the polynomial exp2, the conditional rescale, the row sums on
the tensor cores, three consumer warpgroups and their named-barrier turns. Each against
the reference or, where it moves work and not arithmetic, against the default's bits.
The cases, helpers and compiled (`gpu`) tests are in tests/test_mosaic.py.
"""

from __future__ import annotations

import collections
import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flash.mosaic import pipeline, softmax, split_tail
from pallas_flash.mosaic.config import WARPGROUP_THREADS
from tests.cases import Case, packed
from tests.test_mosaic import (
    BF16,
    INTERPRET_CASES,
    SMALL,
    _changed_no_bit,
    _compare,
    _mosaic,
)

pytestmark = pytest.mark.mosaic


# Persistent CTAs (3 in interpret mode) over several work items each, the ring and the
# ping-pong running on from item to item: causal GQA with ragged lengths (8 items), empty
# batch elements (items with no key tile), unsorted segment ids (every tile masked, the
# ids prefetched with the next Q), and head dim 256, where O has no buffer of its own
# and leaves through Q's (4 items).
PERSISTENT_CASES = [INTERPRET_CASES[i] for i in (4, 3, 11)] + [
    Case(1, 130, 100, 2, 1, 256, BF16, causal=True)
]


@pytest.mark.extended
@pytest.mark.parametrize("case", PERSISTENT_CASES, ids=lambda c: c.id)
def test_interpret_persistent_equals_one_cta_per_item(case):
    """Each work item's arithmetic is the same in both grids, so the outputs are equal
    bit for bit (and the one-CTA-per-item kernel is checked against the reference)."""
    config = dataclasses.replace(SMALL, persistent=True)
    # Which path runs: O's own buffer, or (head dim 256) Q's, in interpret mode's form.
    interpreted = dataclasses.replace(config, p_in_registers=False)
    assert interpreted.o_buffer(case.head_dim) == (case.head_dim < 256)
    one = _mosaic(case, SMALL, interpret=True, seed=1)
    chex.assert_trees_all_equal(one, _mosaic(case, config, True, seed=1))


# Cases with masked tiles of every kind: bottom-right causal with a key length, rows
# that see no key, ragged lengths, a window, segment ids under causal masking.
MASK_CASES = [INTERPRET_CASES[i] for i in (1, 2, 4, 5, 10)]


@pytest.mark.extended
@pytest.mark.parametrize("field", ["row_bound_mask", "column_blocks"])
@pytest.mark.parametrize("case", MASK_CASES, ids=lambda c: c.id)
def test_interpret_mask_form_changes_no_bit(case, field):
    """Two forms of the element mask that keep the same elements, so the outputs are
    equal bit for bit either way: `row_bound_mask` (from per-row bounds) and
    `column_blocks` (row_bound_mask's compares eight key columns at a time)."""
    on, off = (dataclasses.replace(SMALL, **{field: b}) for b in (True, False))
    chex.assert_trees_all_equal(
        _mosaic(case, off, interpret=True, seed=2), _mosaic(case, on, True, seed=2)
    )


# Besides, packed documents over 300 rows: 3 tiles of 128 rows with ids, padded to 2
# pairs, whose last tile starts past T (the tiles' own ranges from padded ids).
MULTICAST_CASES = MASK_CASES + [
    Case(2, 300, 300, 2, 1, 64, BF16, causal=True, segments=(packed([(90, 210), (300,)], 300),) * 2)
]


@pytest.mark.extended
@pytest.mark.parametrize("own_keys", [False, True], ids=["", "own-keys"])
@pytest.mark.parametrize("case", MULTICAST_CASES, ids=lambda c: c.id)
def test_interpret_kv_multicast_changes_no_bit(case, own_keys):
    """`kv_multicast` (clusters of two CTAs sharing each K/V tile's load): each CTA walks
    the key range of both tiles' rows, so a tile may see key tiles its own rows mask out
    entirely (bottom-right causal with a key length, rows that see no key, ragged
    lengths, a window, segment ids under causal masking, an odd number of query tiles),
    which leave every bit as it was; or (`multicast_own_keys`) computes its own tile's
    and passes the others' slots on, before and after them; and against the reference."""
    multicast = dataclasses.replace(SMALL, kv_multicast=True, multicast_own_keys=own_keys)
    _changed_no_bit(case, SMALL, multicast, interpret=True, seed=3)


# The persistent grid of clusters: pairs of query tiles handed out to 3 clusters, rounds
# whole and partial, non-causal (several pairs per head) and causal in the snake order,
# with empty batch elements, unsorted segment ids, and head dim 256 (O through Q's buffer).
PERSISTENT_MULTICAST_CASES = [INTERPRET_CASES[0], Case(2, 260, 130, 2, 1, 128, BF16)]
PERSISTENT_MULTICAST_CASES += PERSISTENT_CASES


_EARLY_Q = dict(early_q_load=True, o_from_registers=True)
_ORDERS = {
    "": {},
    "early-q": _EARLY_Q,
    "heads": dict(_EARLY_Q, head_rounds=True),  # causal calls only, as in the defaults
    "list": dict(_EARLY_Q, head_rounds=True, greedy_items=True),
}
# The causal orders' clusters compute their own tiles' keys alone (multicast_own_keys).
_OWN_KEYS = ("heads", "list")


@pytest.mark.extended
@pytest.mark.parametrize("order", sorted(_ORDERS))
@pytest.mark.parametrize("case", PERSISTENT_MULTICAST_CASES, ids=lambda c: c.id)
def test_interpret_persistent_kv_multicast_changes_no_bit(case, order):
    """`kv_multicast` on the persistent grid: each cluster walks pairs of tiles in the
    persistent order (or head_rounds' head order, or greedy_items' lists, of pairs), a
    tile a CTA, the ring and the cluster's free barriers running on from pair to pair;
    the same arithmetic per tile, so the persistent grid's bits (with the next Q loaded
    early too, as the head-dim-128 non-causal and the head-order rows do), and the
    reference."""
    persistent = dataclasses.replace(SMALL, persistent=True, **_ORDERS[order])
    own_keys = order in _OWN_KEYS
    multicast = dataclasses.replace(persistent, kv_multicast=True, multicast_own_keys=own_keys)
    _changed_no_bit(case, persistent, multicast, interpret=True, seed=5)


@pytest.mark.extended
@pytest.mark.parametrize("flags", ["o_from_registers", "early_q_load", "both"])
@pytest.mark.parametrize("case", PERSISTENT_CASES, ids=lambda c: c.id)
def test_interpret_early_q_load_changes_no_bit(case, flags):
    """O stored from registers, and the next item's Q loaded after this item's last Q
    K^T (persistent: items with no key tile, where the epilogue loads it, among them),
    move stores and loads, not arithmetic: the persistent grid's bits, and the
    reference. At head dim 256 O has no buffer of its own, so early_q_load goes with
    o_from_registers there."""
    persistent = dataclasses.replace(SMALL, persistent=True)
    both = flags == "both" or (flags == "early_q_load" and case.head_dim > 128)
    changed = dataclasses.replace(
        persistent,
        o_from_registers=both or flags == "o_from_registers",
        early_q_load=both or flags == "early_q_load",
    )
    _changed_no_bit(case, persistent, changed, interpret=True, seed=4)


# The next Q K^T issued behind each P V (qk_behind_pv): a different walk over the same
# tiles (the first tile's scores before the loop, the last step alone, masked or not as
# its tile is), so the outputs are the default's bits: rows that see no key, empty batch
# elements (no tile: the walk is skipped), one key tile (the last step is the only one),
# a window, one query row, head dim 256, unsorted segment ids (every tile masked).
BEHIND_CASES = [INTERPRET_CASES[i] for i in (0, 2, 3, 5, 6, 7, 11)] + [
    Case(1, 70, 60, 2, 1, 64, BF16)
]


@pytest.mark.extended
@pytest.mark.parametrize("case", BEHIND_CASES, ids=lambda c: c.id)
def test_interpret_qk_behind_pv_changes_no_bit(case):
    config = dataclasses.replace(SMALL, early_k_wait=True)
    _changed_no_bit(case, config, dataclasses.replace(config, qk_behind_pv=True), True, seed=8)


# qk_behind_pv beside the options a default row carries with it, and the others of the
# plain schedule: the persistent grid (with its last round split, and with the next Q
# loaded in the last step), the row sums on the tensor cores and the conditional rescale,
# the rescale before the turn, three consumers, clusters sharing K/V loads.
@pytest.mark.extended
@pytest.mark.parametrize(
    "flags",
    [
        {"persistent": True},
        {"persistent": True, "split_tail": True},
        {"persistent": True, "early_q_load": True, "o_from_registers": True},
        {"row_sum_wgmma": True, "rescale_slack": 8.0},
        {"rescale_before_turn": True},
        {"consumers": 3, "named_turns": True},
        {"kv_multicast": True},
    ],
    ids=[
        "persistent",
        "split-tail",
        "early-q",
        "row-sums-slack",
        "rescale-early",
        "three-consumers",
        "multicast",
    ],
)
def test_interpret_qk_behind_pv_with_the_other_options(flags):
    case = INTERPRET_CASES[4]  # causal GQA, ragged lengths, rows that see no key
    config = dataclasses.replace(SMALL, early_k_wait=True, **flags)
    _changed_no_bit(case, config, dataclasses.replace(config, qk_behind_pv=True), True, seed=9)


def test_exp2_poly_matches_exp2():
    """softmax.exp2_poly (its jnp form) against float64 2^x: relative error below
    8e-5 for x from 0 down to -125 (a probability's exponent is at most 0; below 2^-126
    float32 has only denormals, which the CPU and ex2.approx.ftz flush), exactly 0 from
    -126.5 down (-inf, a masked score, included), and NaN kept."""
    x = np.concatenate([-np.geomspace(1e-6, 125, 200_001), np.arange(-125, 1.0)])
    got = np.asarray(jax.jit(softmax.exp2_poly)(jnp.asarray(x, jnp.float32)), np.float64)
    exact = 2.0 ** x.astype(np.float32).astype(np.float64)
    assert np.max(np.abs(got / exact - 1)) < 8e-5
    edge = jnp.array([-126.6, -127.0, -1e30, -jnp.inf, jnp.nan], jnp.float32)
    out = np.asarray(softmax.exp2_poly(edge))
    np.testing.assert_array_equal(out[:4], 0.0)
    assert np.isnan(out[4])


# For the softmax's own options in interpret mode: masked tiles, rows that see no key,
# ragged and empty lengths, GQA, a window, segment ids, head dims 128 (padded) and 256.
SOFTMAX_CASES = [INTERPRET_CASES[i] for i in (2, 3, 4, 5, 7, 8, 10)]


# Interpret mode's kernel (P through shared memory) with a quarter and all of each
# 64-key tile's exp2 through the polynomial.
@pytest.mark.extended
@pytest.mark.parametrize("cols", [16, 64])
@pytest.mark.parametrize("case", SOFTMAX_CASES, ids=lambda c: c.id)
def test_interpret_poly_exp2_matches_reference(case, cols):
    _compare(case, dataclasses.replace(SMALL, poly_exp2_cols=cols), interpret=True, seed=5)


# The running output rescaled only where a row's max grew by more than the slack: each
# row decides alone in interpret mode, with p up to 2^slack where its old max stays.
@pytest.mark.extended
@pytest.mark.parametrize("slack", [0.0, 8.0])
@pytest.mark.parametrize("case", SOFTMAX_CASES, ids=lambda c: c.id)
def test_interpret_rescale_slack_matches_reference(case, slack):
    _compare(case, dataclasses.replace(SMALL, rescale_slack=slack), interpret=True, seed=6)


# Row sums by the tensor cores (P times a tile of ones beside its P V): with and without
# the conditional rescale, whose skipped rescales must skip the sums' too; ragged lengths,
# rows that see no key, GQA and T != S among the cases.
@pytest.mark.parametrize("case", [INTERPRET_CASES[2]], ids=lambda c: c.id)
def test_interpret_row_sum_wgmma_matches_reference(case):
    _compare(case, dataclasses.replace(SMALL, row_sum_wgmma=True), interpret=True, seed=7)


@pytest.mark.extended
@pytest.mark.parametrize("slack", [None, 8.0])
@pytest.mark.parametrize("case", SOFTMAX_CASES, ids=lambda c: c.id)
def test_interpret_row_sum_wgmma_on_softmax_cases(case, slack):
    config = dataclasses.replace(SMALL, row_sum_wgmma=True, rescale_slack=slack)
    _compare(case, config, interpret=True, seed=7)


def test_rescale_slack_keeps_a_row_max_that_grew_less():
    """One step on a second tile whose scores top the first's by 3 (base 2) in row 0 and
    not at all in row 1: with slack 8 both rows keep their max (alpha 1, row 0's p up to
    2^3); with slack 2 row 0 takes the new max; a row with no key yet (-inf) always
    does. l and m give the same softmax either way."""
    m_i = jnp.array([1.0, 1.0, -jnp.inf])
    l_i = jnp.array([2.0, 2.0, 0.0])
    s = jnp.array([[4.0, 0.0], [1.0, 0.5], [0.25, -1.0]])
    got = {}
    for slack in (8.0, 2.0, None):
        p, m, total, alpha, rescaled = softmax.online_softmax(s, m_i, l_i, 1.0, None, slack=slack)
        got[slack] = (m, total)
        if slack == 8.0:
            np.testing.assert_array_equal(rescaled, [False, False, True])
            np.testing.assert_array_equal(m, [1.0, 1.0, 0.25])
            np.testing.assert_array_equal(alpha[:2], [1.0, 1.0])
            assert float(p[0, 0]) == 8.0
        if slack == 2.0:
            np.testing.assert_array_equal(rescaled, [True, False, True])
            np.testing.assert_array_equal(m, [4.0, 1.0, 0.25])
        if slack is None:
            assert rescaled is None
    for slack in (8.0, 2.0):  # the same logsumexp as always rescaling
        (m, total), (m0, total0) = got[slack], got[None]
        np.testing.assert_allclose(m + jnp.log2(total), m0 + jnp.log2(total0), rtol=1e-6)


# Three consumer warpgroups (MosaicConfig.consumers=3): in interpret mode without the
# ping-pong (its turns go round on named barriers only), each consumer on its own rows.
# Off (level with two from 8k, slower below): the extended tier.
@pytest.mark.extended
@pytest.mark.parametrize(
    "case,persistent",
    [
        (INTERPRET_CASES[4], False),
        pytest.param(INTERPRET_CASES[0], False, marks=pytest.mark.extended),
        pytest.param(INTERPRET_CASES[2], False, marks=pytest.mark.extended),
        pytest.param(INTERPRET_CASES[5], True, marks=pytest.mark.extended),
        pytest.param(INTERPRET_CASES[3], True, marks=pytest.mark.extended),
    ],
    ids=lambda x: x.id if isinstance(x, Case) else ("persistent" if x else "grid"),
)
def test_interpret_three_consumers_match_reference(case, persistent):
    config = dataclasses.replace(SMALL, consumers=3, named_turns=True, persistent=persistent)
    _compare(case, config, interpret=True, seed=7)


def _turn_order(consumers: int, steps: int, items: int, monkeypatch) -> list[tuple[int, int, int]]:
    """PingPong's named-barrier turns, driven by one thread a consumer through `items`
    work items of `steps` steps each, as the forward's body calls them (start; per step:
    issue Q K^T, meet, the softmax, my_turn, P V; end), against a model of the SM's
    named barriers: `bar.arrive` counts its warpgroup's 128 threads and goes on,
    `bar.sync` counts them and waits until the barrier's count is reached, which
    completes that instance and starts the next. Returns the (item, step, consumer) of
    each Q K^T issue in the order issued; a deadlock fails (a sync waits 10 s)."""
    import threading

    cv, count, done = threading.Condition(), collections.Counter(), collections.Counter()
    order, errors = [], []

    def named_barrier(op, barrier, threads):
        barrier = int(barrier)
        with cv:
            count[barrier] += WARPGROUP_THREADS
            instance = done[barrier]
            if count[barrier] == threads:
                count[barrier], done[barrier] = 0, instance + 1
                cv.notify_all()
            elif op == "sync" and not cv.wait_for(lambda: done[barrier] > instance, 10):
                raise TimeoutError(f"consumer waits forever on named barrier {barrier}")

    def consumer(w):
        pingpong = pipeline.PingPong(object(), w, named=True, consumers=consumers)
        try:
            for item in range(items):
                pingpong.start()
                for j in range(steps):
                    with cv:
                        order.append((item, j, w))  # Q K^T of step j is issued
                    pingpong.meet()
                    pingpong.my_turn()  # then P V of step j (and the next Q K^T)
                pingpong.end()
        except TimeoutError as e:
            errors.append(e)

    monkeypatch.setattr(pipeline, "named_barrier", named_barrier)
    threads = [threading.Thread(target=consumer, args=(w,)) for w in range(consumers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert not any(count.values()), f"arrivals left on the barriers: {dict(count)}"
    return order


@pytest.mark.parametrize("consumers", [2, 3])
def test_named_turns_go_round_the_consumers(consumers, monkeypatch):
    """The forward's ping-pong on named barriers, two or three consumers, a persistent
    CTA's several items: nobody waits forever, no arrival is left over, and within an
    item the Q K^T issues go round the consumers in order, step by step (a consumer's
    next turn needs the one before it to have issued)."""
    steps, items = 4, 3
    order = _turn_order(consumers, steps, items, monkeypatch)
    for item in range(items):
        got = [(j, w) for i, j, w in order if i == item]
        assert got == [(j, w) for j in range(steps) for w in range(consumers)]


# split_tail: the plan of the last round's pieces, the merge on its own, then the kernel.


@pytest.mark.parametrize(
    "items,ctas,tiles", [(8, 3, 5), (4, 3, 5), (2048, 132, 64), (4096, 132, 32)]
)
def test_split_tail_plan_covers_each_tail_key_tile_once(items, ctas, tiles):
    """The last round's r items' key tiles, each once, in runs that differ by at most one
    tile, at most two pieces a CTA; the whole rounds before them; an item's pieces listed
    for the merge in the order of their keys."""
    tail = split_tail.plan(items, ctas, tiles)
    rounds, r = divmod(items, ctas)
    assert tail.rounds == rounds and list(tail.items) == list(range(rounds * ctas, items))
    seen = collections.Counter()
    runs = []
    for cta in range(ctas):
        run = 0
        for item, lo, hi, valid in tail.pieces[cta, :, :4]:
            if valid:
                assert 0 <= lo < hi <= tiles
                seen.update((int(item), t) for t in range(lo, hi))
                run += hi - lo
        runs.append(run)
    assert seen == collections.Counter((i, t) for i in tail.items for t in range(tiles))
    assert max(runs) - min(runs) <= 1
    for n in range(len(tail.items)):
        firsts = [tail.pieces[c, s, 1] for (c, s), v in zip(tail.parts[n], tail.valid[n]) if v]
        assert firsts == sorted(firsts) and firsts[0] == 0


@pytest.mark.parametrize(
    "items,ctas,tiles", [(8, 3, 5), (4, 3, 5), (2048, 132, 16), (2048, 132, 64), (4096, 132, 32)]
)
def test_split_tail_plan_orders_the_fixup(items, ctas, tiles):
    """tail_fixup's columns: each split item's pieces numbered 0, 1, ... in key order
    with their count and the item's index; an item's first piece (key tile 0) is the
    last its CTA walks, and each later one the first its CTA walks, so a first piece
    awaits only pieces their CTAs walk before anything that waits: no CTA waits on one
    that waits."""
    tail = split_tail.plan(items, ctas, tiles)
    col = {name: c for c, name in enumerate(split_tail.PIECE_COLS)}
    for n in range(len(tail.items)):
        mine = [tuple(p) for p, v in zip(tail.parts[n], tail.valid[n]) if v]
        for k, (cta, slot) in enumerate(mine):
            row = tail.pieces[cta, slot]
            assert (row[col["item"]], row[col["exists"]]) == (tail.items[n], 1)
            assert (row[col["n"]], row[col["k"]], row[col["count"]]) == (n, k, len(mine))
            last = slot == 1 or not tail.pieces[cta, 1, col["exists"]]
            if k == 0:
                assert row[col["first"]] == 0 and last
            else:
                assert slot == 0 and row[col["first"]] > 0


def test_split_tail_plans_nothing_for_whole_rounds():
    assert split_tail.plan(264, 132, 64) is None and split_tail.plan(100, 132, 0) is None


def _softmax_piece(s, v, lo, hi):
    """A piece of keys lo..hi of the scores s [rows, keys] (numpy, float32): its O
    normalised by its own row sums and its logsumexp, 0 and -inf where a row sees none."""
    part = s[:, lo:hi]
    top = np.where(np.isfinite(part.max(1)), part.max(1), 0)[:, None]
    p = np.exp(part - top)
    total = p.sum(1)
    o = np.where(total[:, None] > 0, p @ v[lo:hi] / np.maximum(total, 1e-30)[:, None], 0)
    lse = np.where(total > 0, top[:, 0] + np.log(np.maximum(total, 1e-30)), -np.inf)
    return o, lse


def test_split_tail_merge_is_the_softmax_over_all_keys():
    """Pieces of a row's keys, each softmax-normalised with its logsumexp, merge into the
    softmax over all of them (float32, rtol 1e-6); a row no piece saw stays 0, -inf."""
    rng = np.random.default_rng(0)
    rows, h, keys = 4, 8, 12
    s = rng.normal(size=(rows, keys)).astype(np.float32)
    s[3] = -np.inf  # a row that sees no key
    v = rng.normal(size=(keys, h)).astype(np.float32)
    tail = split_tail.plan(4, 3, keys)  # one item in 3 pieces
    piece_o = np.zeros((3, 2, rows, h), np.float32)
    piece_lse = np.full((3, 2, rows), -np.inf, np.float32)
    for cta in range(3):
        _, lo, hi, valid = tail.pieces[cta, 0, :4]
        assert valid
        piece_o[cta, 0], piece_lse[cta, 0] = _softmax_piece(s, v, lo, hi)
    o = jnp.full((1, rows, 1, h), 7.0, jnp.float32)  # the split item's rows are overwritten
    lse = jnp.full((1, 1, rows), 7.0, jnp.float32)
    coords = (np.array([0]), np.array([0]), np.array([0]))
    o, lse = split_tail.combine(
        o, lse, jnp.asarray(piece_o), jnp.asarray(piece_lse), tail, coords, rows
    )
    want = jax.nn.softmax(jnp.asarray(s[:3]), axis=-1) @ v
    np.testing.assert_allclose(o[0, :3, 0], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse[0, 0, :3], jax.nn.logsumexp(s[:3], axis=-1), rtol=1e-6)
    assert float(lse[0, 0, 3]) == -np.inf and not np.any(np.asarray(o[0, 3]))


def test_split_tail_merge_pair_folds_pieces_into_the_softmax():
    """tail_fixup's merge (the kernel's first piece folds the later ones in, in key
    order, with split_tail.merge_pair): three pieces of a row's keys, each normalised
    with its logsumexp, fold into the softmax over all of them (float32); a row that
    only one piece sees takes that piece's values, and a row no piece sees stays 0 with
    -inf, never NaN. GPU interpret mode cannot run the kernel's fix-up (no global
    semaphores), so its arithmetic is checked here."""
    rng = np.random.default_rng(1)
    rows, h, bounds = 5, 8, (0, 3, 7, 12)
    s = rng.normal(size=(rows, bounds[-1])).astype(np.float32) * 4
    s[3] = -np.inf  # no key at all
    s[4, 3:] = -np.inf  # only the first piece's keys
    v = rng.normal(size=(bounds[-1], h)).astype(np.float32)

    def piece(lo, hi):
        return tuple(jnp.asarray(x, jnp.float32) for x in _softmax_piece(s, v, lo, hi))

    o, lse = piece(bounds[0], bounds[1])
    for lo, hi in zip(bounds[1:-1], bounds[2:]):
        o, lse = split_tail.merge_pair(o, lse, *piece(lo, hi))
    assert not np.any(np.isnan(np.asarray(o))) and not np.any(np.isnan(np.asarray(lse)))
    live = [0, 1, 2, 4]
    want = jax.nn.softmax(jnp.asarray(s[live]), axis=-1) @ v
    np.testing.assert_allclose(o[jnp.asarray(live)], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        lse[jnp.asarray(live)], jax.nn.logsumexp(s[live], axis=-1), rtol=1e-6
    )
    assert float(lse[3]) == -np.inf and not np.any(np.asarray(o[3]))


# Items the 3 interpret CTAs do not divide: 8 items (2 whole rounds, 2 items in pieces,
# one CTA's run across both), GQA with a ragged key length; causal with ragged lengths
# and rows that see no key; head dim 256, whose O leaves through Q's buffer (4 items);
# and the masks the head-dim-64 non-causal default (split since SPLIT_TAIL_64) takes
# besides: a window without the causal mask, and packed documents (8 items each).
SPLIT_TAIL_CASES = [
    Case(2, 130, 300, 2, 1, 64, BF16, kv_lens=(300, 170)),
    INTERPRET_CASES[4],
    Case(1, 130, 100, 2, 1, 256, BF16, causal=True),
    Case(2, 130, 300, 2, 1, 64, BF16, window=(40, 40)),
    INTERPRET_CASES[9],
]


@pytest.mark.extended
@pytest.mark.parametrize("multicast", [False, True], ids=["", "clusters"])
@pytest.mark.parametrize("case", SPLIT_TAIL_CASES, ids=lambda c: c.id)
def test_interpret_split_tail_matches_the_reference_and_the_whole_items(case, multicast):
    """The persistent grid with its last round in pieces: the reference's tolerance, and
    within float32 merging of the unsplit grid's result (O to a unit of the dtype's last
    place, the logsumexp to 1e-5). With kv_multicast, the grid of clusters: pairs of
    tiles in pieces over the clusters, each piece's rows a CTA's (split_tail.per_tile)."""
    config = dataclasses.replace(SMALL, persistent=True, split_tail=True, kv_multicast=multicast)
    o, lse = _compare(case, config, interpret=True, seed=3)
    o_whole, lse_whole = _mosaic(case, dataclasses.replace(config, split_tail=False), True, seed=3)
    np.testing.assert_allclose(lse, lse_whole, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(o, np.float32), np.asarray(o_whole, np.float32), rtol=1e-2, atol=1e-2
    )


@pytest.mark.extended
@pytest.mark.parametrize(
    "flags",
    [{"o_from_registers": True}, {"o_from_registers": True, "early_q_load": True}],
    ids=["o-from-registers", "early-q"],
)
def test_interpret_split_tail_with_the_persistent_options(flags):
    """split_tail beside the persistent grid's other options (O stored from registers;
    the next item's Q loaded during the last step, a piece's last step too): the
    reference, and the unsplit grid's result within float32 merging."""
    case = SPLIT_TAIL_CASES[0]
    config = dataclasses.replace(SMALL, persistent=True, **flags)
    split = dataclasses.replace(config, split_tail=True)
    o, lse = _compare(case, split, interpret=True, seed=4)
    o0, lse0 = _mosaic(case, config, True, seed=4)
    np.testing.assert_allclose(lse, lse0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o0, np.float32), atol=1e-2)


@pytest.mark.parametrize(
    "items,sms,tiles", [(12, 5, 2), (2048, 132, 128), (4096, 132, 64), (64, 132, 32)]
)
def test_split_tail_even_pieces_cover_the_last_wave(items, sms, tiles):
    """The backward's split: the whole waves first, then each CTA of the last wave in m
    pieces covering its tiles once, in launch order (a piece after every piece of a lower
    item), listed for the sums in the order of their tiles."""
    split = split_tail.even_pieces(items, sms, tiles)
    assert split.whole == items // sms * sms
    assert list(split.items) == list(range(split.whole, items))
    assert list(split.table[:, 0]) == sorted(split.table[:, 0])
    for item, rows in zip(split.items, split.rows):
        pieces = split.table[rows]
        assert set(pieces[:, 0]) == {item} and pieces[0, 1] == 0 and pieces[-1, 2] == tiles
        assert all(pieces[1:, 1] == pieces[:-1, 2])  # end to end, no gap, no overlap


@pytest.mark.parametrize("band", [1, 2, 4])
def test_split_tail_span_coords_decode_the_launch_order(band):
    """The split grid's one axis names its whole CTAs in the launch order of span_band's
    grid (plain, or bands of heads): the host's decode (numpy) and the kernel's
    (kernel_span_coords: lax, on int32 scalars) give each position the (head, span,
    batch element) the banded grid launches there (benchmarks.launch_sim.span_order)."""
    from benchmarks.launch_sim import span_order

    k, spans, b = 4, 3, 2
    order = span_order(k, spans, b, band)
    bb, hh, ss = split_tail.span_coords(np.arange(len(order)), spans, b, band)
    assert list(zip(hh.tolist(), ss.tolist(), bb.tolist())) == order
    for i in (0, 5, len(order) - 1):
        e, h, s = split_tail.kernel_span_coords(jnp.int32(i), spans, b, band)
        assert (int(h), int(s), int(e)) == order[i]


def test_split_tail_even_pieces_only_where_they_gain():
    assert split_tail.even_pieces(264, 132, 64) is None  # whole waves
    assert split_tail.even_pieces(133, 132, 1) is None  # a CTA of one tile: no pieces


@pytest.mark.extended
@pytest.mark.parametrize(
    "case",
    [
        Case(2, 300, 300, 2, 1, 64, BF16, causal=True, kv_lens=(300, 170)),
        INTERPRET_CASES[4],  # ragged query and key lengths
        INTERPRET_CASES[2],  # bottom-right alignment: rows that see no key
        INTERPRET_CASES[5],  # a window under the causal mask
        INTERPRET_CASES[10],  # segment ids, T != S
    ],
    ids=lambda c: c.id,
)
@pytest.mark.parametrize("table", ["entry", "order_ranges", "greedy_items"])
def test_interpret_head_rounds_changes_no_bit(case, table):
    """head_rounds hands the persistent causal grid's items out in head order (4-12 items
    on the 3 interpret CTAs, each round's longest first; ragged lengths, rows that see no
    key, a window, segment ids): another order of the same items, so the reference
    passes and the tile-major grid's bits come back; with
    order_ranges, each item's key range and lengths read from its row of the table; with
    greedy_items, each CTA's count and items from the list schedule's table."""
    config = dataclasses.replace(SMALL, persistent=True)
    options = {table: True} if table != "entry" else {}
    changed = dataclasses.replace(config, head_rounds=True, **options)
    _changed_no_bit(case, config, changed, interpret=True, seed=5)

"""The Mosaic GPU path's dispatch, input checks and config tables: which calls it serves
and refuses (before tracing, with the argument named), what `implementation=None` picks
on a Hopper GPU, each config's validation and the default rows' evidence-bound choices.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flash import masks
from pallas_flash.configs import TritonConfig
from pallas_flash.logits import Logits
from pallas_flash.mosaic import backward as mosaic_backward
from pallas_flash.mosaic import forward as mosaic_forward
from pallas_flash.mosaic import pipeline
from pallas_flash.mosaic.bwd_config import (
    MosaicBwdConfig,
    default_mosaic_bwd_config,
    pair_mosaic_bwd_config,
)
from pallas_flash.mosaic.config import (
    MosaicConfig,
    default_mosaic_config,
    padded_head_dim,
)
from tests.cases import Case, tolerance_check
from tests.test_mosaic import SMALL, _mosaic
from tests.test_mosaic_backward import _with_operands

pytestmark = pytest.mark.mosaic  # the GPU run takes these in a step of their own

BF16, F16 = jnp.bfloat16, jnp.float16


@pytest.mark.parametrize(
    "dtype,kwargs,match",
    [
        (jnp.float32, {}, "bfloat16 or float16"),
        (BF16, {"bias": jnp.zeros((1, 1, 8, 8), BF16)}, "bias"),
        (BF16, {"mask": jnp.ones((1, 1, 8, 8), jnp.int8)}, "mask"),
        (BF16, {"seeds": jnp.zeros((2,), jnp.int32), "dropout_rate": 0.1}, "dropout"),
        (BF16, {"logits": Logits(softcap=5.0)}, "logits_soft_cap"),
        (BF16, {"layout": jnp.ones((1, 1, 1), bool)}, "block_sparse"),
    ],
    ids=["float32", "bias", "mask", "dropout", "softcap", "block-sparse"],
)
@pytest.mark.parametrize("kernel", ["forward", "backward"])
def test_unsupported_features_raise(kernel, dtype, kwargs, match):
    """What the Mosaic kernels lack raises NotImplementedError naming it, from the
    forward and from the backward alike, before anything is traced."""
    q = jnp.ones((1, 8, 2, 64), dtype)
    lens = jnp.full((1,), 8, jnp.int32)
    common = dict(spec=masks.MaskSpec(), scale=1.0, interpret=True, **kwargs)
    with pytest.raises(NotImplementedError, match=match):
        if kernel == "forward":
            mosaic_forward.forward(q, q, q, lens, lens, config=SMALL, **common)
        else:
            lse = jnp.zeros((1, 2, 8), jnp.float32)
            mosaic_backward.backward(
                q, q, q, q, lse, q, None, lens, lens, config=MosaicBwdConfig(), **common
            )


def test_forward_config_validation():
    with pytest.raises(ValueError, match="block_q"):
        MosaicConfig(block_q=32)
    with pytest.raises(ValueError, match="block_kv"):
        MosaicConfig(block_kv=512)
    with pytest.raises(ValueError, match="num_stages"):
        MosaicConfig(num_stages=0)
    for flag in ("rescale_before_turn", "early_k_wait"):
        with pytest.raises(ValueError, match="intra_overlap .* neither"):
            MosaicConfig(intra_overlap=True, **{flag: True})
    with pytest.raises(ValueError, match="not with persistent"):
        MosaicConfig(intra_overlap=True, persistent=True)
    with pytest.raises(ValueError, match="q_register_cols"):
        MosaicConfig(q_register_cols=96)
    for flags in (dict(intra_overlap=True), dict(schedule_barrier=False)):
        with pytest.raises(ValueError, match="named_turns .* needs schedule_barrier"):
            MosaicConfig(named_turns=True, **flags)
    for flags in (dict(intra_overlap=True), dict(kv_multicast=True), dict(num_stages=4)):
        with pytest.raises(ValueError, match="named_releases .* at most 3 stages"):
            MosaicConfig(named_releases=True, **flags)
    # a persistent grid of clusters, its last round split or its items in head order
    MosaicConfig(kv_multicast=True, persistent=True, split_tail=True, tail_fixup=True)
    MosaicConfig(kv_multicast=True, persistent=True, head_rounds=True, greedy_items=True)
    with pytest.raises(ValueError, match="multicast_own_keys .* needs kv_multicast"):
        MosaicConfig(multicast_own_keys=True)
    with pytest.raises(ValueError, match="early_q_load .* needs persistent"):
        MosaicConfig(early_q_load=True)
    with pytest.raises(ValueError, match="qk_behind_pv .* needs early_k_wait"):
        MosaicConfig(qk_behind_pv=True)
    with pytest.raises(ValueError, match="split_tail .* needs persistent"):
        MosaicConfig(split_tail=True)
    with pytest.raises(ValueError, match="tail_fixup .* needs split_tail"):
        MosaicConfig(persistent=True, tail_fixup=True)
    for flags in (dict(), dict(persistent=True, split_tail=True)):
        with pytest.raises(ValueError, match="head_rounds .* needs persistent, and not split"):
            MosaicConfig(head_rounds=True, **flags)
    with pytest.raises(ValueError, match="order_ranges .* needs head_rounds"):
        MosaicConfig(persistent=True, order_ranges=True)
    heads = dict(persistent=True, head_rounds=True)
    for flags in (dict(persistent=True), dict(heads, order_ranges=True)):
        with pytest.raises(ValueError, match="greedy_items .* needs head_rounds, and not order"):
            MosaicConfig(greedy_items=True, **flags)
    for slack in (-1.0, 64, True, "8"):
        with pytest.raises(ValueError, match="rescale_slack=.* None or a number from 0 to 64"):
            MosaicConfig(rescale_slack=slack)
    MosaicConfig(rescale_slack=8.0, intra_overlap=True)  # the overlap skips it too
    with pytest.raises(ValueError, match="row_sum_wgmma .* not with intra_overlap"):
        MosaicConfig(row_sum_wgmma=True, intra_overlap=True)
    for cols in (12, -8, 136):
        with pytest.raises(ValueError, match="poly_exp2_cols=.* multiple of 8 from 0 to block_kv"):
            MosaicConfig(block_kv=128, poly_exp2_cols=cols)
    for n in (1, 4):
        with pytest.raises(ValueError, match="consumers=.* must be 2 or 3"):
            MosaicConfig(consumers=n)
    three = dict(consumers=3, named_turns=True)
    for flags in (
        dict(named_turns=False),  # the mbarrier rendezvous is for two
        dict(named_releases=True),
        dict(kv_multicast=True),
        dict(intra_overlap=True, named_turns=False, schedule_barrier=False),
    ):
        with pytest.raises(ValueError, match="consumers=3 .* needs named_turns"):
            MosaicConfig(**{**three, **flags})
    MosaicConfig(consumers=3, schedule_barrier=False)  # no ping-pong: no turns to hand over
    # a 64 x 256 score tile does not fit a third consumer's registers (ptxas: C7602)
    with pytest.raises(ValueError, match="consumers=3 .* take block_kv <= 192"):
        MosaicConfig(consumers=3, named_turns=True, block_kv=256)
    MosaicConfig(consumers=3, named_turns=True, block_kv=192)
    # a third consumer's Q, lse and barrier: the estimate grows by one warpgroup's share
    two, three_row = MosaicConfig(block_kv=128), MosaicConfig(block_kv=128, **three)
    assert three_row.smem_bytes(64) - two.smem_bytes(64) == 64 * 64 * 2 + 64 * 4 + 8
    q = jnp.ones((1, 8, 1, 256), BF16)
    lens = jnp.full((1,), 8, jnp.int32)
    too_big = MosaicConfig(block_kv=256, num_stages=2)
    with pytest.raises(ValueError, match="shared memory"):
        mosaic_forward.forward(
            q, q, q, lens, lens, spec=masks.MaskSpec(), scale=1.0, config=too_big
        )
    with pytest.raises(ValueError, match="q_register_cols=320 exceeds the head dim"):
        mosaic_forward.forward(
            q,
            q,
            q,
            lens,
            lens,
            spec=masks.MaskSpec(),
            scale=1.0,
            config=MosaicConfig(q_register_cols=320),
        )


def test_early_q_load_needs_o_out_of_q_buffer():
    """At head dim 256 O leaves through Q's buffer (it has none of its own): loading the
    next Q early would overwrite it, so the call says what to set."""
    case = Case(1, 130, 100, 2, 1, 256, BF16)
    config = MosaicConfig(block_q=64, block_kv=64, persistent=True, early_q_load=True)
    with pytest.raises(
        ValueError, match="early_q_load needs O out of Q's buffer.*o_from_registers"
    ):
        _mosaic(case, config, interpret=False, seed=0)


@pytest.mark.parametrize("snake", [False, True])
def test_persistent_items_cover_every_item_once(snake):
    """Whatever the rounds (whole or partial, even or odd last), the CTAs' items are each
    item exactly once, and the snake turns every other round around."""
    for num_items, num_ctas in [(8, 3), (9, 3), (10, 3), (11, 3), (2048, 132), (5, 5), (2, 3)]:
        walked = []
        for cta in range(num_ctas):
            n = int(pipeline.persistent_item_count(cta, num_items, num_ctas, snake=snake))
            walked += [
                int(pipeline.persistent_item(cta, i, num_ctas, snake=snake)) for i in range(n)
            ]
        assert sorted(walked) == list(range(num_items)), (num_items, num_ctas)
    assert int(pipeline.persistent_item(0, 1, 132, snake=snake)) == (263 if snake else 132)


def test_head_rounds_order_keeps_rounds_and_sorts_each():
    """head_rounds' table: every item once; each round (num_ctas entries) holds the head
    order's next num_ctas items, its items from the bottom tile up (longest first)."""
    for pairs, tiles, ctas in [(512, 8, 132), (4, 2, 3), (6, 2, 3), (7, 33, 132), (3, 5, 4)]:
        order = pipeline.head_rounds_order(pairs, tiles, ctas)
        assert order.dtype == np.int32 and sorted(order) == list(range(pairs * tiles))
        for start in range(0, pairs * tiles, ctas):
            chunk = order[start : start + ctas]
            assert sorted(chunk) == list(range(start, start + len(chunk)))
            from_bottom = chunk % tiles
            assert (np.diff(from_bottom) >= 0).all(), (pairs, tiles, ctas, start)
    assert list(pipeline.head_rounds_order(2, 3, 4)) == [0, 3, 1, 2, 4, 5]


def test_greedy_items_order_walks_each_item_once_as_the_block_scheduler_would():
    """greedy_items' table: per-CTA counts, then each CTA's items (head_rounds' encoding,
    0 past the count); every item once; each CTA's items in the grid's launch order
    (heads, tiles from the bottom, batch elements); the first num_ctas items one to each
    CTA, as a grid's first wave; and each item goes to the CTA whose modelled work ends
    first (checked by replaying the hand-out)."""
    for heads, batch, costs, ctas in [
        (32, 16, [1, 2, 3, 4, 5, 6, 7, 8], 132),
        (2, 3, [1, 2, 2, 3], 5),
        (3, 1, [4, 4, 4], 4),
    ]:
        tiles = len(costs)
        table = pipeline.greedy_items_order(costs, heads, batch, ctas)
        assert table.dtype == np.int32 and table.shape == (len(table),)
        counts, entries = table[:ctas], table[ctas:].reshape(-1, ctas)
        lists = [list(entries[: counts[c], c]) for c in range(ctas)]
        assert sorted(sum(lists, [])) == list(range(heads * batch * tiles))
        assert all((entries[counts[c] :, c] == 0).all() for c in range(ctas))

        def launch(w):  # the item's place in the grid's launch order
            pair, d = divmod(int(w), tiles)
            b, h = divmod(pair, heads)
            return (h * tiles + d) * batch + b

        assert all(list(map(launch, walk)) == sorted(map(launch, walk)) for walk in lists)
        owner = {launch(w): c for c, walk in enumerate(lists) for w in walk}
        assert [owner[x] for x in range(min(ctas, len(owner)))] == list(
            range(min(ctas, len(owner)))
        )
        ends = [0.0] * ctas
        for x in range(len(owner)):
            c = owner[x]
            assert ends[c] == min(ends), (heads, batch, costs, ctas, x)
            d = x // batch % tiles
            ends[c] += costs[tiles - 1 - d] + pipeline.GREEDY_ITEM_STEPS


def test_nominal_key_tiles_follow_the_mask():
    """The list schedule's costs: a query span's key tiles under the mask at the call's
    lengths (causal top-left, bottom-right, a window, no mask)."""
    causal = masks.MaskSpec(causal=True)
    assert list(pipeline.nominal_key_tiles(causal, 1000, 1000, 8, 128, 128)) == list(range(1, 9))
    right = masks.MaskSpec(causal=True, bottom_right=True)
    assert list(pipeline.nominal_key_tiles(right, 256, 512, 2, 128, 128)) == [3, 4]
    window = masks.MaskSpec(causal=True, local_window=(128, 0))
    assert list(pipeline.nominal_key_tiles(window, 512, 512, 4, 128, 128)) == [1, 2, 2, 2]
    assert list(pipeline.nominal_key_tiles(masks.MaskSpec(), 300, 500, 3, 128, 128)) == [4] * 3


def test_order_rows_hold_each_items_range_and_lengths():
    """order_ranges' table: row r is item order[r] (pair * tiles + its tile from the
    bottom), then that (batch element, query tile)'s four key-tile bounds from the range
    table, then the batch element's query and key lengths."""
    batch, heads, tiles = 2, 3, 4
    order = pipeline.head_rounds_order(batch * heads, tiles, 5)
    ranges = jnp.arange(batch * tiles * 4, dtype=jnp.int32).reshape(batch, tiles, 4)
    q_len, kv_len = jnp.array([7, 9], jnp.int32), jnp.array([11, 13], jnp.int32)
    rows = np.asarray(pipeline.order_rows(order, ranges, q_len, kv_len, heads, tiles))
    assert rows.shape == (len(order), len(pipeline.ORDER_COLS)) and rows.dtype == np.int32
    for row, item in zip(rows, order):
        b, tile = item // tiles // heads, tiles - 1 - item % tiles
        assert list(row) == [item, *ranges[b, tile].tolist(), q_len[b], kv_len[b], 0]


@pytest.mark.parametrize("causal", [None, False, True])
@pytest.mark.parametrize("seq_k", [None, 1024])
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
def test_forward_defaults_fit_in_shared_memory(head_dim, seq_k, causal):
    config = default_mosaic_config(head_dim, seq_k, causal)
    assert config.smem_bytes(head_dim) <= 227 * 1024
    assert dataclasses.replace(config, p_in_registers=False).smem_bytes(head_dim) <= 227 * 1024


def test_default_is_persistent_only_where_measured_faster():
    """Head dim 64 (33-64 padded) when not causal (1.05-1.13x up to 2048 keys,
    1.02-1.03x from 4k to 16k) and causal up to 4096 keys in head order (tile-major 0.81x
    at 4k; head order 1.02-1.05x there, 0.97x at 8k), head dim 128 when not causal
    (1.00-1.06x) or causal up to 2048 keys in head order (to 8192 with the list
    schedule's items, greedy_items; above, one CTA per item in clusters of two,
    kv_multicast), and head dim 256 when not
    causal up to 16384 keys (1.01-1.05x); slower at 128 and 256 causal, and not timed at
    256 beyond 16k (mosaic/config.py). Causal None (not known): only what wins both
    ways."""
    for head_dim, seq_k, causal, want in [
        (64, 1, None, True),
        (48, 2048, True, True),  # causal up to 2048 keys: in head order (head_rounds)
        (48, 4096, True, True),  # at head dim 64 up to 4096 (HEAD_ROUNDS_MAX_KEYS_64)
        (48, 4097, True, False),
        (48, 2048, False, True),
        (64, 2049, False, True),
        (64, None, False, True),
        (64, 8192, True, False),
        (64, 4096, None, False),
        (64, None, None, False),
        (32, 1024, False, True),  # padded to 64: the same kernel and tiles
        (128, 1024, None, False),
        (128, 1024, True, True),
        (128, 2048, True, True),
        (128, 2049, True, True),  # and from the list schedule up to 8192 (greedy_items)
        (128, 8192, True, True),
        (128, 8193, True, False),  # one CTA per item, in clusters of two
        (96, 16384, True, False),
        (128, 16384, None, False),
        (128, 1024, False, True),
        (128, 2048, False, True),
        (128, 2049, False, True),
        (128, 4096, False, True),  # early Q loads up to 4096 keys (EARLY_Q_LOAD_MAX_KEYS_128)
        (128, 4097, False, True),
        (96, None, False, True),  # padded to 128
        (128, None, True, False),
        (256, 1024, False, True),
        (192, 8192, False, True),  # padded to 256
        (256, 8193, False, True),
        (256, 16385, False, False),
        (256, 1024, True, False),
        (256, 1024, None, False),
        (256, None, False, False),
    ]:
        config = default_mosaic_config(head_dim, seq_k, causal)
        assert config.persistent == want, (head_dim, seq_k, causal)
        # Persistent where the call may be causal: in head order; causal, early Q loads.
        rounds = want and causal is not False and padded_head_dim(head_dim) <= 128
        assert config.head_rounds == rounds, (head_dim, seq_k, causal)
        # And at head dim 128 non-causal up to 4096 keys (EARLY_Q_LOAD_MAX_KEYS_128).
        short = seq_k is not None and seq_k <= 4096
        early_nc = padded_head_dim(head_dim) == 128 and causal is False and short
        want_early = (rounds and causal is True) or early_nc
        assert config.early_q_load == want_early, (head_dim, seq_k, causal)
        listed = padded_head_dim(head_dim) == 128 and causal is True and 2048 < (seq_k or 0)
        assert config.greedy_items == (want and listed), (head_dim, seq_k, causal)
        # O has its own buffer where persistent, except at 256 (no room: through Q's).
        hp = padded_head_dim(head_dim)
        assert config.o_buffer(hp) == (want and hp != 256), (head_dim, seq_k, causal)
        # Clusters of two only on the head-dim-128 causal row above the list schedule's
        # 8192 keys (KV_MULTICAST_CAUSAL_128): never with the persistent grid.
        clusters = hp == 128 and causal is True and (seq_k or 0) > 8192
        assert config.kv_multicast == clusters, (head_dim, seq_k, causal)


def test_default_block_kv_at_head_dim_64():
    """256-key tiles, except causal up to 2048 keys (1.11x / 1.04x with 128 at 1k / 2k;
    256 is 1.07x ahead at 8k): mosaic/config.py. In head order at 4096 keys too, with
    256-key tiles (the row HEAD_ROUNDS_MAX_KEYS_64 extends was timed with them)."""
    for seq_k, causal, want in [
        (1024, True, 128),
        (2048, True, 128),
        (2049, True, 256),
        (4096, True, 256),
        (None, True, 256),
        (1024, False, 256),
        (1024, None, 256),  # not known: what wins both ways
    ]:
        assert default_mosaic_config(64, seq_k, causal).block_kv == want, (seq_k, causal)


def test_api_default_follows_the_call(monkeypatch):
    """flash_attention(implementation="mosaic") without a config takes the table's row
    for the call's head dim, key length and causal flag (the plan reaches the kernel
    unchanged; here it is caught before any kernel runs)."""
    import pallas_flash
    from pallas_flash import vjp

    plans = []

    def caught(plan, q, *rest):
        plans.append(plan)
        return q, jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)

    monkeypatch.setattr(vjp, "attention", caught)
    for head_dim, seq_k, causal in [(128, 512, False), (128, 512, True), (64, 8192, True)]:
        q = jnp.zeros((1, 256, 2, head_dim), BF16)
        k = jnp.zeros((1, seq_k, 2, head_dim), BF16)
        pallas_flash.flash_attention(q, k, k, is_causal=causal, implementation="mosaic")
        want = default_mosaic_config(head_dim, seq_k, causal)
        assert plans[-1].fwd_config == want, (head_dim, seq_k, causal)
    assert [p.fwd_config.persistent for p in plans] == [True, True, False]


# --- compiled, on the H200 -------------------------------------------------------------


@pytest.mark.parametrize("with_segments", [False, True], ids=["plain", "segments"])
def test_public_api_runs_the_mosaic_kernels(with_segments):
    """flash_attention(implementation="mosaic"): the Mosaic forward and backward
    (interpreted on CPU), through the one custom_vjp, against the reference; with
    segment ids as a (query ids, key ids) pair too."""
    import pallas_flash

    ks = jax.random.split(jax.random.PRNGKey(3), 4)
    q = jax.random.normal(ks[0], (1, 80, 4, 64), BF16)
    k, v = (jax.random.normal(kk, (1, 72, 2, 64), BF16) for kk in ks[1:3])
    do = jax.random.normal(ks[3], q.shape, BF16)
    lens = dict(key_value_seq_lengths=jnp.array([60]))
    if with_segments:
        ids = lambda n, cut: (jnp.arange(n) >= cut).astype(jnp.int32)[None]  # noqa: E731
        lens["segment_ids"] = (ids(80, 30), ids(72, 40))

    def run(impl, *xs, **kw):
        f = lambda q, k, v: pallas_flash.flash_attention(  # noqa: E731
            q, k, v, is_causal=True, implementation=impl, **lens, **kw
        )
        out, vjp = jax.vjp(f, *xs)
        return (out, *vjp(do.astype(out.dtype)))

    got = run("mosaic", q, k, v, config=SMALL)  # eager: the public API as a user calls it
    reference_run = jax.jit(functools.partial(run, "xla"))  # one program, not op by op
    ref = reference_run(*(x.astype(jnp.float32) for x in (q, k, v)))
    naive = reference_run(q, k, v)
    for name, g, r, n in zip(("o", "dq", "dk", "dv"), got, ref, naive):
        tolerance_check(name, g, r, n, BF16)


def test_dispatch_to_mosaic():
    """A call "mosaic" cannot serve raises naming what it lacks."""
    import pallas_flash

    q = jnp.zeros((1, 64, 2, 64), jnp.float32)
    with pytest.raises(NotImplementedError, match="bfloat16 or float16, not float32"):
        pallas_flash.flash_attention(q, q, q, implementation="mosaic")
    qb = q.astype(BF16)
    with pytest.raises(NotImplementedError, match="bias not supported by the Mosaic"):
        pallas_flash.flash_attention(
            qb, qb, qb, implementation="mosaic", bias=jnp.zeros((1, 1, 64, 64), BF16)
        )
    with pytest.raises(TypeError, match="config for implementation 'mosaic' must be MosaicConfig"):
        pallas_flash.flash_attention(
            qb, qb, qb, implementation="mosaic", config=pallas_flash.TritonConfig()
        )


class _Chosen(Exception):
    pass


@pytest.mark.parametrize(
    "hopper,dtype,kwargs,want",
    [
        (True, BF16, {}, "mosaic"),
        (True, F16, {"is_causal": True, "segment_ids": jnp.zeros((1, 64), jnp.int32)}, "mosaic"),
        (True, jnp.float32, {}, "triton"),  # Mosaic takes 16-bit inputs only
        (True, BF16, {"dropout_rate": 0.1, "dropout_rng": jax.random.key(0)}, "triton"),
        (True, BF16, {"logits_soft_cap": 30.0}, "triton"),
        (True, BF16, {"config": TritonConfig()}, "triton"),  # the config names the family
        (True, BF16, {"backward_config": MosaicBwdConfig()}, "mosaic"),
        (False, BF16, {}, "triton"),  # not sm_90
    ],
    ids=[
        "bf16",
        "f16-causal-segments",
        "f32",
        "dropout",
        "softcap",
        "triton-config",
        "mosaic-bwd-config",
        "ampere",
    ],
)
def test_none_picks_mosaic_on_hopper_where_it_serves(monkeypatch, hopper, dtype, kwargs, want):
    """implementation=None on a GPU: "mosaic" first on Hopper, "triton" for what Mosaic
    lacks or off Hopper (the GPU is faked; the choice is intercepted before any kernel)."""
    import pallas_flash
    from pallas_flash import api

    chosen = []

    def spy(*args):
        chosen.append(real(*args))
        raise _Chosen

    real = api._choose_backend
    monkeypatch.setattr(api, "_platform", lambda: "gpu")
    monkeypatch.setattr(
        api.mosaic_support,
        "device_unsupported",
        lambda: None if hopper else "wgmma needs compute capability 9.0, not 8.0",
    )
    monkeypatch.setattr(api, "_choose_backend", spy)
    q = jnp.zeros((1, 64, 2, 64), dtype)
    with pytest.raises(_Chosen):
        pallas_flash.flash_attention(q, q, q, **kwargs)
    assert chosen == [want]


def test_backward_config_validation():
    for field, value in [
        ("block_q_dkv", 32),
        ("block_kv_dq", 512),
        ("num_stages_dq", 0),
        ("consumers_dkv", 3),
    ]:
        with pytest.raises(ValueError, match=field):
            MosaicBwdConfig(**{field: value})
    with pytest.raises(ValueError, match="split_dkv"):
        MosaicBwdConfig(split_dkv=True, consumers_dkv=1)
    with pytest.raises(ValueError, match="share_probs .* split_dkv=True"):
        MosaicBwdConfig(share_probs=True)
    with pytest.raises(ValueError, match="split_dq needs consumers_dq=2"):
        MosaicBwdConfig(split_dq=True, consumers_dq=1)
    with pytest.raises(ValueError, match="q_do_in_registers .* not with split_dq or fused"):
        MosaicBwdConfig(q_do_in_registers=True, split_dq=True)
    with pytest.raises(ValueError, match="k_v_in_registers .* not with split_dkv or fused"):
        MosaicBwdConfig(k_v_in_registers=True, fused=True)
    with pytest.raises(ValueError, match="dkdv_q_multicast .* not with fused"):
        MosaicBwdConfig(dkdv_q_multicast=True, fused=True)
    with pytest.raises(ValueError, match="dq_kv_multicast .* not with fused"):
        MosaicBwdConfig(dq_kv_multicast=True, fused=True)
    with pytest.raises(ValueError, match="solo_dq_registers .* consumers_dq=1 \\(not 2\\)"):
        MosaicBwdConfig(solo_dq_registers=True)
    for flags in (dict(consumers_dq=1), dict(split_dq=True), dict(fused=True)):
        with pytest.raises(ValueError, match="dq_pingpong .* needs consumers_dq=2"):
            MosaicBwdConfig(dq_pingpong=True, **flags)
    for flags in (dict(query_rows=True), dict(fa3_order=True)):
        with pytest.raises(ValueError, match="probs_before_dp .* not with query_rows or fa3"):
            MosaicBwdConfig(probs_before_dp=True, fused=True, **flags)
    q = jnp.ones((1, 8, 1, 256), BF16)
    lse = jnp.zeros((1, 1, 8), jnp.float32)
    lens = jnp.full((1,), 8, jnp.int32)
    for config, match in [
        (MosaicBwdConfig(split_dkv=True), "shared memory in its dQ kernel"),
        (MosaicBwdConfig(consumers_dq=1, num_stages_dkv=3), "shared memory in its dK/dV"),
        (MosaicBwdConfig(consumers_dkv=1, consumers_dq=1), "accumulators"),
        (
            MosaicBwdConfig(split_dkv=True, consumers_dq=1, q_do_in_registers=True),
            "q_do_in_registers at head dim 256",
        ),
    ]:
        with pytest.raises(ValueError, match=match):
            mosaic_backward.backward(
                q, q, q, q, lse, q, None, lens, lens, spec=masks.MaskSpec(), scale=1.0,
                config=config,
            )  # fmt: skip
    q = jnp.ones((1, 8, 1, 128), BF16)
    with pytest.raises(ValueError, match="k_v_in_registers at head dim 128"):
        mosaic_backward.backward(
            q, q, q, q, lse, q, None, lens, lens, spec=masks.MaskSpec(), scale=1.0,
            config=MosaicBwdConfig(k_v_in_registers=True),
        )  # fmt: skip


# --- the fused kernel: one kernel, dQ added in a fixed order (mosaic/dq_adds.py) ------


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
def test_backward_defaults_fit_in_shared_memory(head_dim):
    for in_registers in (True, False):
        config = _with_operands(pair_mosaic_bwd_config(head_dim), in_registers, head_dim)
        assert config.smem_bytes_dkv(head_dim) <= 227 * 1024
        assert config.smem_bytes_dq(head_dim) <= 227 * 1024
    for causal in (True, False):
        config = default_mosaic_bwd_config(head_dim, causal)
        # the fused kernel at head dims 64 and 128, the pair above
        assert config.fused == (head_dim <= 128)
        mosaic_backward.check_fits(config, head_dim)


# --- compiled, on the H200 -------------------------------------------------------------

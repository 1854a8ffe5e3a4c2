"""The Mosaic GPU (Hopper) forward kernel against the float32 reference.

On CPU the kernel runs in Mosaic GPU's interpret mode: the same warp-specialised
kernel, with its producer/consumer barriers, TMA copies and wgmma simulated, except
that P V takes P from shared memory (`MosaicConfig.p_in_registers=False`; the
interpreter's wgmma cannot read registers). Tests marked `gpu` run the compiled kernel
on the H200, P from registers and from shared memory, over more and larger shapes:
`pytest -m gpu tests/test_mosaic.py` there.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_flash import masks, reference
from pallas_flash.configs import TritonBwdConfig
from pallas_flash.logits import Logits
from pallas_flash.mosaic import forward as mosaic_forward
from pallas_flash.mosaic import support
from pallas_flash.mosaic.config import (
    HEAD_ROUNDS_MAX_KEYS_64,
    OVERLAP_REPLACES,
    WITHOUT_PERSISTENT,
    MosaicConfig,
    default_mosaic_config,
    padded_head_dim,
)
from pallas_flash.triton import backward as triton_backward
from tests.cases import CASES, Case, packed, seed_of, tolerance_check

pytestmark = pytest.mark.mosaic  # the GPU run takes these in a step of their own

BF16, F16 = jnp.bfloat16, jnp.float16
# Small tiles, so that small shapes still cross several CTAs and pipeline stages.
SMALL = MosaicConfig(block_q=64, block_kv=64, num_stages=2)


def _spec(case: Case) -> masks.MaskSpec:
    return masks.MaskSpec(
        causal=case.causal,
        bottom_right=case.bottom_right,
        local_window=case.window,
        segments=case.segments is not None,
    )


def _segments(case: Case):
    """(query ids [B, T], key ids [B, S]) int32, or None."""
    if case.segments is None:
        return None
    return tuple(jnp.asarray(x, jnp.int32) for x in case.segments)


def _lengths(case: Case):
    lens = lambda x: None if x is None else jnp.asarray(x, jnp.int32)  # noqa: E731
    return masks.lengths_or_full(
        lens(case.q_lens), lens(case.kv_lens), case.batch, case.seq_q, case.seq_kv
    )


def _mosaic(case: Case, config: MosaicConfig | None, interpret, seed: int = 0, qkv=None):
    q, k, v, _ = case.inputs(seed) if qkv is None else (*qkv, None)
    return _forward(case, config, interpret, q, k, v)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _forward(case: Case, config: MosaicConfig | None, interpret, q, k, v):
    """(o, lse) of the Mosaic forward, jitted (eager, each op around the kernel compiles
    on its own: slower on CPU than the program)."""
    q_len, kv_len = _lengths(case)
    return mosaic_forward.forward(
        q,
        k,
        v,
        q_len,
        kv_len,
        _segments(case),
        spec=_spec(case),
        scale=case.head_dim**-0.5,
        config=config or default_mosaic_config(case.head_dim),
        interpret=interpret,
    )


def _references(case: Case, seed: int = 0):
    """(float32 truth, naive in case.dtype): (o, lse) of reference.py each, in one jitted
    program (eager, op by op, compiles each op of each new shape: slower on CPU)."""
    q, k, v, _ = case.inputs(seed)
    q_len, kv_len = _lengths(case)
    segments = _segments(case)

    @jax.jit
    def both(q, k, v, q_len, kv_len, segments):
        return tuple(
            reference.attention(
                q,
                k,
                v,
                scale=case.head_dim**-0.5,
                mask_spec=_spec(case),
                query_seq_lengths=q_len,
                key_value_seq_lengths=kv_len,
                segment_ids=segments,
                upcast=upcast,
            )
            for upcast in (True, False)
        )

    return both(q, k, v, q_len, kv_len, segments)


def _overlapped(config: MosaicConfig) -> MosaicConfig:
    """config with intra_overlap, a schedule of its own: without the early K wait, the
    early rescale, the named-barrier turns, the conditional rescale and the rest the
    default may have that it refuses (OVERLAP_REPLACES)."""
    return dataclasses.replace(config, intra_overlap=True, **OVERLAP_REPLACES)


def _compare(case: Case, config, interpret, seed: int = 0):
    """The forward against the reference; returns its (O, logsumexp) for further checks."""
    o, lse = _mosaic(case, config, interpret, seed)
    ref, naive = _references(case, seed)
    for name, got, r, n in zip(("o", "lse"), (o, lse), ref, naive):
        tolerance_check(f"mosaic {case.id} {name}", got, r, n, case.dtype)
    return o, lse


def _changed_no_bit(case: Case, config, changed, interpret, seed: int):
    """`changed` (a config that reorganises the work, not the arithmetic) passes the
    reference and gives `config`'s bits."""
    got = _compare(case, changed, interpret, seed=seed)
    chex.assert_trees_all_equal(_mosaic(case, config, interpret, seed), got)


# Awkward shapes for interpret mode: lengths off the tiles, T != S both ways, GQA and
# MQA, both causal alignments, windows, ragged and empty lengths, padded head dims.
INTERPRET_CASES = [
    Case(1, 130, 200, 4, 2, 64, BF16),
    Case(1, 100, 257, 2, 1, 128, F16, causal=True, bottom_right=True, kv_lens=(150,)),
    Case(2, 97, 40, 2, 1, 64, BF16, causal=True, bottom_right=True),  # rows 0..56 see no key
    Case(2, 97, 97, 2, 1, 64, F16, q_lens=(0, 97), kv_lens=(97, 0)),  # empty batch elements
    Case(2, 150, 90, 2, 2, 64, BF16, causal=True, q_lens=(150, 61), kv_lens=(33, 90)),
    Case(1, 200, 200, 2, 2, 64, BF16, causal=True, window=(40, 3)),
    Case(1, 1, 77, 2, 1, 64, F16),  # one query row
    Case(1, 70, 70, 1, 1, 256, BF16),
    Case(1, 33, 65, 2, 1, 80, F16, causal=True),  # head dim padded to 128
    # Segment ids: packed documents (tiles between them skipped), T != S with their own
    # ids under causal masking, and unsorted ids (every tile masked element by element).
    Case(2, 200, 200, 2, 1, 64, BF16, segments=(packed([(60, 140), (200,)], 200),) * 2),
    Case(
        2,
        130,
        150,
        2,
        2,
        64,
        F16,
        causal=True,
        segments=(packed([(30, 100), (130,)], 130), packed([(40, 110), (150,)], 150)),
    ),
    Case(
        2,
        130,
        130,
        2,
        1,
        64,
        BF16,
        segments=(tuple(tuple((i * 7 // 3) % 3 for i in range(130)) for _ in range(2)),) * 2,
    ),
]


@pytest.mark.parametrize("case", INTERPRET_CASES, ids=lambda c: c.id)
def test_interpret_matches_reference(case):
    _compare(case, SMALL, interpret=True, seed=seed_of(case))


PIPELINES = [
    MosaicConfig(block_q=64, block_kv=64, num_stages=1),  # the producer waits every tile
    MosaicConfig(block_q=64, block_kv=64, num_stages=3),
    MosaicConfig(block_q=64, block_kv=64, num_stages=2, schedule_barrier=False),
    MosaicConfig(block_q=64, block_kv=128, num_stages=2),
    MosaicConfig(block_q=128, block_kv=64, num_stages=2),
    MosaicConfig(block_q=64, block_kv=64, num_stages=2, rescale_before_turn=True),
    MosaicConfig(block_q=64, block_kv=64, num_stages=2, early_k_wait=True),
    MosaicConfig(block_q=64, block_kv=64, num_stages=1, early_k_wait=True),
    MosaicConfig(block_q=64, block_kv=64, num_stages=1, early_k_wait=True, qk_behind_pv=True),
    MosaicConfig(block_q=128, block_kv=64, num_stages=3, early_k_wait=True, qk_behind_pv=True),
    MosaicConfig(block_q=64, block_kv=64, num_stages=2, intra_overlap=True),
    MosaicConfig(block_q=64, block_kv=64, num_stages=1, intra_overlap=True),
    MosaicConfig(block_q=64, block_kv=64, num_stages=2, schedule_barrier=False, intra_overlap=True),
]


def _config_id(c: MosaicConfig) -> str:
    extra = ("" if c.schedule_barrier else "-no-pingpong") + ("" if c.p_in_registers else "-p-smem")
    extra += "-rescale-early" if c.rescale_before_turn else ""
    extra += "-k-wait-early" if c.early_k_wait else ""
    extra += "-qk-behind-pv" if c.qk_behind_pv else ""
    extra += "-overlap" if c.intra_overlap else ""
    return f"q{c.block_q}-kv{c.block_kv}-stages{c.num_stages}{extra}"


@pytest.mark.extended
@pytest.mark.parametrize("config", PIPELINES, ids=_config_id)
def test_interpret_pipeline_configs(config):
    # One head: the config's pipeline runs per CTA (two row blocks, five K/V tiles, the
    # diagonal skipping some); more heads would only add CTAs like them.
    _compare(Case(1, 200, 260, 1, 1, 64, F16, causal=True), config, interpret=True)


# intra_overlap's own loop (prologue, overlapped steps, epilogue) over the awkward cases
# where it differs most: rows that see no key, empty batch elements (no tile at all: the
# prologue is skipped), a window, unsorted segment ids (every tile masked), GQA with T != S.
# (Head dim 256 is out: P staged in two shared-memory buffers, as interpret mode needs,
# does not fit there; the compiled kernel keeps P in registers.)
OVERLAP_CASES = [INTERPRET_CASES[i] for i in (0, 2, 3, 5, 11)]


@pytest.mark.extended
@pytest.mark.parametrize("case", OVERLAP_CASES, ids=lambda c: c.id)
def test_interpret_intra_overlap_matches_reference(case):
    config = dataclasses.replace(SMALL, intra_overlap=True)
    _compare(case, config, interpret=True, seed=seed_of(case))


@pytest.mark.extended
@pytest.mark.parametrize("case", OVERLAP_CASES, ids=lambda c: c.id)
def test_interpret_intra_overlap_with_rescale_slack_matches_reference(case):
    """intra_overlap with the conditional rescale (rescale_slack): rows whose max grew by
    at most the slack keep their old one, alpha 1, through the overlapped steps."""
    config = dataclasses.replace(SMALL, intra_overlap=True, rescale_slack=8.0)
    _compare(case, config, interpret=True, seed=seed_of(case))


def test_interpret_fully_masked_rows_are_zero_not_nan():
    # Batch 0: bottom-right causal with q_len 30 > kv_len 24, so the diagonal starts at
    # column -6 and rows 0..5 see no key; the last 10 rows are padding. Batch 1: no key.
    case = Case(2, 40, 24, 2, 1, 64, BF16, causal=True, bottom_right=True)
    case = dataclasses.replace(case, q_lens=(30, 40), kv_lens=(24, 0))
    o, lse = (np.asarray(x, np.float32) for x in _mosaic(case, SMALL, interpret=True))
    assert np.isfinite(o).all()
    for b, rows in [(0, slice(0, 6)), (0, slice(30, 40)), (1, slice(0, 40))]:
        assert (o[b, rows] == 0).all()
        assert np.isneginf(lse[b, :, rows]).all()
    assert np.isfinite(lse[0, :, 6:30]).all()


def test_interpret_never_reads_skipped_tiles():
    """Keys no query may see are never loaded: poisoning them changes nothing (a read
    would show, as 0 * NaN = NaN in P V)."""
    case = Case(1, 64, 256, 2, 2, 64, BF16, causal=True)
    q, k, v, _ = case.inputs()
    out = _mosaic(case, SMALL, interpret=True, qkv=(q, k, v))
    # The CTA's 128 rows (64 real, 64 padding) reach keys 0..127: tiles 2 and 3 are skipped.
    k_bad, v_bad = k.at[:, 128:].set(jnp.nan), v.at[:, 128:].set(jnp.nan)
    chex.assert_trees_all_equal(out, _mosaic(case, SMALL, interpret=True, qkv=(q, k_bad, v_bad)))


# intra_overlap and kv_multicast are off by default: their race checks are extended.
@pytest.mark.parametrize(
    "schedule",
    [
        "",
        pytest.param("overlap", marks=pytest.mark.extended),
        "persistent",
        "persistent-h256",
        "heads",  # the short causal rows' schedule (HEAD_ROUNDS): head order, early Q loads
        # Options that are off run in the extended tier; split_tail is in the head-dim-64
        # non-causal default (SPLIT_TAIL_64), so its race check runs in CI.
        pytest.param("early-q", marks=pytest.mark.extended),
        pytest.param("early-q-h256", marks=pytest.mark.extended),
        pytest.param("multicast", marks=pytest.mark.extended),
        "split",
        pytest.param("split-h256", marks=pytest.mark.extended),
        pytest.param("clusters", marks=pytest.mark.extended),
        pytest.param("behind", marks=pytest.mark.extended),
    ],
)
def test_interpret_finds_no_data_race(schedule):
    """The interpreter's happens-before race detector over the shared buffers (Q/O, P,
    the logsumexp and the K/V ring; its wgmma operand reads are not instrumented). With
    intra_overlap, tile j's P is written while tile j - 1's P V may still read its own;
    persistent, a CTA's next Q loads while its last O and logsumexp are stored (at head
    dim 256, into the buffer O has just left), and the ring runs on from one work item
    to the next (4 items on 3 CTAs); with kv_multicast, each CTA's producer writes its half
    of a tile into both CTAs' slots once all four consumers of the cluster release them;
    with early_q_load (persistent, O from registers), the next Q loads while this item's
    last softmax and P V run and its logsumexp is stored; with split_tail, the last of
    the 4 items in pieces over the 3 CTAs, each piece's logsumexp leaving through the
    same buffer as a whole item's (with kv_multicast too: 4 pairs of tiles on 3 clusters,
    the last pair in pieces); with qk_behind_pv (persistent), each K slot is read
    by the next Q K^T before the V slot of the tile before it is released; with
    head_rounds and early_q_load (the short causal default), the items in the table's
    order, each next Q loaded into its buffer while O leaves through its own."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # no public accessor

    params = plgpu.InterpretGPUParams(detect_races=True)
    head_dim = 256 if schedule.endswith("h256") else 64
    heads = 4 if schedule == "clusters" else 2  # 4 pairs of tiles on 3 clusters
    case = Case(1, 130, 300, heads, 1, head_dim, BF16, causal=True)
    flags = {
        "overlap": {"intra_overlap": True},
        "persistent": {"persistent": True},
        "heads": {"persistent": True, "head_rounds": True, "early_q_load": True},
        "multicast": {"kv_multicast": True},
        "early": {"persistent": True, "early_q_load": True, "o_from_registers": True},
        "split": {"persistent": True, "split_tail": True},
        "clusters": {"persistent": True, "split_tail": True, "kv_multicast": True},
        "behind": {"persistent": True, "early_k_wait": True, "qk_behind_pv": True},
    }
    config = MosaicConfig(
        block_q=64, block_kv=64, num_stages=2, **flags.get(schedule.split("-")[0], {})
    )
    _compare(case, config, interpret=params)
    assert not gpu_callbacks.get_races().races_found


@pytest.mark.parametrize(
    "head_dim,causal",
    [(64, True), (256, False), (64, False)],
    ids=["h64-causal", "h256-full", "h64-full"],
)
def test_interpret_default_for_the_call(head_dim, causal):
    """The rows chosen by the call's length and causal flag, on a short GQA call with
    ragged lengths: head dim 64 causal (128-key tiles, persistent in head order, each
    next Q loaded early: 16 items on the 3 interpret CTAs), 256 non-causal (persistent,
    O through Q's buffer) and 64 non-causal (persistent, 256-key tiles, the row sums on
    the tensor cores, the last round in pieces). P from shared memory (the
    interpreter's form; with it the head-dim-64 causal row of 2049-4096 keys, 256-key
    tiles with early Q loads, has no room for O's buffer, so that row is checked
    compiled: test_gpu_head_rounds_changes_no_bit)."""
    case = Case(2, 130, 300, 4, 2, head_dim, BF16, causal=causal, kv_lens=(300, 170))
    config = default_mosaic_config(head_dim, case.seq_kv, causal)
    assert config.persistent
    assert config.head_rounds == config.early_q_load == causal
    assert (
        config.block_kv == {(64, True): 128, (256, False): 64, (64, False): 256}[head_dim, causal]
    )
    assert config.row_sum_wgmma == config.split_tail == (head_dim == 64 and not causal)
    _compare(case, dataclasses.replace(config, p_in_registers=False), interpret=True)


def test_interpret_head_dim_128_row_of_4096_keys():
    """The head-dim-128 non-causal row at 4096 keys: persistent, the last round split
    and merged in the kernel, each next Q loaded early (EARLY_Q_LOAD_MAX_KEYS_128). 8
    items on the 3 interpret CTAs: two whole rounds, two items in pieces; ragged keys,
    GQA. P from shared memory and O from registers (the interpreter's form: with P's
    buffer O's has no room); the reference, and the bits of the same row without the
    early load."""
    case = Case(2, 130, 4096, 2, 1, 128, BF16, kv_lens=(4096, 3100))
    row = default_mosaic_config(128, case.seq_kv, False)
    assert row.persistent and row.early_q_load and row.split_tail and row.tail_fixup
    config = dataclasses.replace(row, p_in_registers=False, o_from_registers=True)
    _changed_no_bit(case, dataclasses.replace(config, early_q_load=False), config, True, seed=5)


def test_triton_backward_takes_its_residuals():
    """O and the logsumexp of the Mosaic forward feed the Triton backward as they are."""
    case = Case(1, 70, 90, 2, 1, 64, BF16, causal=True, kv_lens=(80,))
    q, k, v, do = case.inputs(1)
    q_len, kv_len = _lengths(case)
    spec, scale = _spec(case), case.head_dim**-0.5
    o, lse = _mosaic(case, SMALL, interpret=True, qkv=(q, k, v))
    grads = triton_backward.backward(
        q,
        k,
        v,
        o,
        lse,
        do,
        None,
        q_len,
        kv_len,
        spec=spec,
        scale=scale,
        config=TritonBwdConfig(),
        interpret=True,
        logits=Logits(),
    )[:3]

    def ref(upcast):
        def f(q, k, v):
            return reference.attention(
                q,
                k,
                v,
                scale=scale,
                mask_spec=spec,
                upcast=upcast,
                query_seq_lengths=q_len,
                key_value_seq_lengths=kv_len,
            )[0]

        @jax.jit  # one program, not op by op
        def grads(*args):
            out, vjp = jax.vjp(f, *args)
            return vjp(do.astype(out.dtype))

        args = (q, k, v) if not upcast else tuple(x.astype(jnp.float32) for x in (q, k, v))
        return grads(*args)

    for name, g, r, n in zip(("dq", "dk", "dv"), grads, ref(True), ref(False)):
        tolerance_check(f"mosaic+triton {name}", g, r, n, case.dtype)


# The shared table's cases this kernel serves (16-bit, no segments/dropout/bias/mask/cap),
# plus head dims 64/128/256 at sizes that fill the pipeline.
GPU_CASES = [
    c
    for c in CASES
    if support.unsupported(
        c.dtype,
        c.head_dim,
        _spec(c),
        segments=c.segments is not None,
        dropout=c.dropout > 0,
        bias=c.bias is not None,
        mask=c.mask,
        softcap=c.softcap is not None,
    )
    is None
] + [
    Case(2, 1024, 1024, 8, 8, 64, BF16),
    Case(2, 1024, 1024, 8, 2, 128, F16, causal=True),
    Case(2, 1000, 1500, 4, 1, 256, BF16, causal=True, bottom_right=True),
    Case(1, 2048, 2048, 4, 4, 128, BF16, causal=True, q_lens=(2000,), kv_lens=(1900,)),
    Case(3, 777, 513, 4, 2, 256, F16, q_lens=(777, 400, 0), kv_lens=(513, 1, 300)),
    Case(2, 4096, 4096, 2, 1, 64, F16, causal=True, window=(512, 0)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("p_in_registers", [True, False], ids=["p-regs", "p-smem"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_matches_reference(case, p_in_registers):
    config = dataclasses.replace(
        default_mosaic_config(case.head_dim), p_in_registers=p_in_registers
    )
    _compare(case, config, interpret=False, seed=seed_of(case))


# Rows of the default table that no case above reaches: head dim 128 non-causal of
# 1025-4096 keys (early Q loads, EARLY_Q_LOAD_MAX_KEYS_128; from 4096 with the split
# last round), ragged, GQA.
DEFAULT_ROW_CASES = [
    Case(2, 1536, 2048, 4, 2, 128, BF16, q_lens=(1536, 1000), kv_lens=(2048, 1300)),
    # 4096 keys: early Q loads with the last round split and merged in the kernel
    Case(2, 1200, 4096, 4, 2, 128, BF16, q_lens=(1200, 700), kv_lens=(4096, 3100)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES + DEFAULT_ROW_CASES, ids=lambda c: c.id)
def test_gpu_default_for_the_call_matches_reference(case):
    """The row the API picks for this call (head dim, key length, causal flag): the
    tests above take the head dim's row alone."""
    config = default_mosaic_config(case.head_dim, case.seq_kv, _spec(case).causal)
    _compare(case, config, interpret=False, seed=seed_of(case))


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_row_bound_mask_changes_no_bit(case):
    """row_bound_mask compiled (P in registers): the same element masks, so the same bits
    as the head dim's row with `masks.tile_mask` (the default row, with row bounds, is
    checked against the reference above)."""
    config = dataclasses.replace(default_mosaic_config(case.head_dim), row_bound_mask=False)
    rows = dataclasses.replace(config, row_bound_mask=True)
    seed = seed_of(case)
    chex.assert_trees_all_equal(
        _mosaic(case, config, False, seed), _mosaic(case, rows, False, seed)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_column_blocks_changes_no_bit(case):
    """column_blocks compiled: the same element masks, so the same bits as the head dim's
    row comparing each key column (the default, with blocks, is checked against the
    reference above)."""
    config = default_mosaic_config(case.head_dim)
    each = dataclasses.replace(config, column_blocks=False)
    seed = seed_of(case)
    chex.assert_trees_all_equal(
        _mosaic(case, each, False, seed), _mosaic(case, config, False, seed)
    )


# (case, columns of Q in registers): 64 and 128 where the padded head dim has them.
Q_REGISTER_CASES = [
    pytest.param(case, cols, id=f"{case.id}-q{cols}")
    for case in GPU_CASES
    for cols in (64, 128)
    if cols <= padded_head_dim(case.head_dim)
]


@pytest.mark.gpu
@pytest.mark.parametrize("case,cols", Q_REGISTER_CASES)
def test_gpu_q_register_cols_match_reference_and_change_no_bit(case, cols):
    """q_register_cols compiled: Q's first `cols` columns enter Q K^T from registers.
    Checked against the reference, and bitwise against the call's default row with all
    of Q in shared memory (the same products accumulated in the same order)."""
    default = default_mosaic_config(case.head_dim, case.seq_kv, _spec(case).causal)
    _changed_no_bit(
        case,
        dataclasses.replace(default, q_register_cols=0),
        dataclasses.replace(default, q_register_cols=cols),
        interpret=False,
        seed=seed_of(case),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_kv_multicast_changes_no_bit(case):
    """kv_multicast compiled (clusters of two CTAs, K/V loaded once for both by TMA
    multicast, cluster barriers): the call's default row without the persistent grid
    gives the same bits with it, and it passes the reference."""
    default = default_mosaic_config(case.head_dim, case.seq_kv, _spec(case).causal)
    config = dataclasses.replace(default, persistent=False, **WITHOUT_PERSISTENT)
    multicast = dataclasses.replace(config, kv_multicast=True)
    _changed_no_bit(case, config, multicast, interpret=False, seed=seed_of(case))


# The cases whose mask bounds the keys by row or document, where each tile of a pair
# sees its own key tiles (multicast_own_keys).
BOUNDED_GPU_CASES = [
    c for c in GPU_CASES if (s := _spec(c)).left is not None or s.right is not None or s.segments
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_persistent_kv_multicast_changes_no_bit(case):
    """kv_multicast on the persistent grid compiled (one cluster of two per SM pair,
    walking pairs of query tiles in the call's default order: plain, head order or the
    list schedule, the last round split or not; the next Q loaded early where the row
    does): the default row made persistent gives the same bits with the clusters (up to
    float32 merging where its last round splits, whose pieces the clusters cut per
    pair), and passes the reference. Own keys: test_gpu_multicast_own_keys_changes_no_bit."""
    default = default_mosaic_config(case.head_dim, case.seq_kv, _spec(case).causal)
    config = dataclasses.replace(default, persistent=True, kv_multicast=False)
    multicast = dataclasses.replace(config, kv_multicast=True)
    _changed_no_bit_or_merged(case, config, multicast)


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [False, True], ids=["", "persistent"])
@pytest.mark.parametrize("case", BOUNDED_GPU_CASES, ids=lambda c: c.id)
def test_gpu_multicast_own_keys_changes_no_bit(case, persistent):
    """multicast_own_keys compiled: each CTA of a cluster computes its own tile's key
    tiles and passes the pair's others on, in the grid of one cluster per pair and
    (`persistent`) on the persistent grid in the default's order: the same bits as the
    row without clusters (as above where the last round splits), and the reference."""
    default = default_mosaic_config(case.head_dim, case.seq_kv, _spec(case).causal)
    config = dataclasses.replace(default, kv_multicast=False, multicast_own_keys=False)
    if persistent:
        config = dataclasses.replace(config, persistent=True)
    else:
        config = dataclasses.replace(config, persistent=False, **WITHOUT_PERSISTENT)
    multicast = dataclasses.replace(config, kv_multicast=True, multicast_own_keys=True)
    _changed_no_bit_or_merged(case, config, multicast)


def _assert_within_merging(got, want, config):
    """A split grid's (O, logsumexp) `got` against another grid's `want`: O to 1e-2, the
    logsumexp to float32 merging (1e-5), or with the row sums on the tensor cores
    (`config.row_sum_wgmma`) 1e-3: their P is rounded to bfloat16 against each piece's
    own running max, so a cut within a row's keys moves the sum by about 2^-9 /
    sqrt(keys) (4e-4 at most at head dim 64 with a 300-key window in pairs of tiles, on
    an H100 in the 69th session)."""
    (o, lse), (o0, lse0) = got, want
    tol = 1e-3 if config.row_sum_wgmma else 1e-5
    np.testing.assert_allclose(lse, lse0, rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o0, np.float32), atol=1e-2)


def _changed_no_bit_or_merged(case: Case, config, multicast):
    """`multicast` passes the reference and gives `config`'s bits, or where the last round
    splits (split_tail, whose pieces differ between the grids) its result within float32
    merging (_assert_within_merging)."""
    if not config.split_tail:
        _changed_no_bit(case, config, multicast, interpret=False, seed=seed_of(case))
        return
    got = _compare(case, multicast, interpret=False, seed=seed_of(case))
    _assert_within_merging(got, _mosaic(case, config, False, seed_of(case)), config)


@pytest.mark.gpu
@pytest.mark.parametrize("flags", ["named_turns", "named_releases", "both"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_named_barriers_change_no_bit(case, flags):
    """named_turns and named_releases compiled: they order the work, not its numbers, so
    the call's default row gives the same bits with them, and passes the reference."""
    default = default_mosaic_config(case.head_dim, case.seq_kv, _spec(case).causal)
    both = flags == "both"
    named = dataclasses.replace(
        default,
        named_turns=both or flags == "named_turns",
        named_releases=both or flags == "named_releases",
    )
    _changed_no_bit(case, default, named, interpret=False, seed=seed_of(case))


@pytest.mark.gpu
@pytest.mark.parametrize("flags", ["o_from_registers", "early_q_load", "both"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_early_q_load_changes_no_bit(case, flags):
    """o_from_registers and early_q_load compiled, on the call's default row made
    persistent: they move O's stores and Q's loads, not arithmetic, so the bits are the
    persistent row's, and the reference passes. `early_q_load` alone keeps O in its own
    buffer where the row has one (head dims up to 128), else goes with O from registers."""
    row = default_mosaic_config(case.head_dim, case.seq_kv, _spec(case).causal)
    persistent = dataclasses.replace(row, persistent=True)
    o_buffer = persistent.o_buffer(padded_head_dim(case.head_dim))
    changed = dataclasses.replace(
        persistent,
        o_from_registers=flags != "early_q_load" or not o_buffer,
        early_q_load=flags != "o_from_registers",
    )
    _changed_no_bit(case, persistent, changed, interpret=False, seed=seed_of(case))


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in GPU_CASES if c.causal], ids=lambda c: c.id)
@pytest.mark.parametrize(
    "row_keys, greedy",
    [(None, False), (HEAD_ROUNDS_MAX_KEYS_64, False), (None, True)],
    ids=["call", "4k-row", "greedy"],
)
def test_gpu_head_rounds_changes_no_bit(case, row_keys, greedy):
    """head_rounds compiled on the call's default row made persistent (with early Q
    loads where O has a buffer of its own), and on the row of 4096 keys (at head dim 64
    the causal default there, with 256-key tiles; at 128 the one-CTA-per-item row with
    its conditional rescale): the causal items in head order, the same items' work, so
    the tile-major grid's bits, and the reference passes; `greedy`: the items from
    greedy_items' list schedule instead."""
    row = default_mosaic_config(case.head_dim, row_keys or case.seq_kv, True)
    hp = padded_head_dim(case.head_dim)
    tile_major = dataclasses.replace(
        row,
        persistent=True,
        split_tail=False,
        tail_fixup=False,
        head_rounds=False,
        early_q_load=dataclasses.replace(row, persistent=True).o_buffer(hp),
    )
    heads = dataclasses.replace(tile_major, head_rounds=True, greedy_items=greedy)
    _changed_no_bit(case, tile_major, heads, interpret=False, seed=seed_of(case))


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_qk_behind_pv_changes_no_bit(case):
    """qk_behind_pv compiled on the call's default row (at head dim 64, whose 256-key
    score tiles leave no registers for a second one beside P, with 128-key tiles):
    the next Q K^T issued behind each P V computes the same scores, so the bits are
    the row's, and the reference passes."""
    row = default_mosaic_config(case.head_dim, case.seq_kv, _spec(case).causal)
    row = dataclasses.replace(row, block_kv=min(row.block_kv, 128))
    behind = dataclasses.replace(row, qk_behind_pv=True)
    _changed_no_bit(case, row, behind, interpret=False, seed=seed_of(case))


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_row_sum_wgmma_matches_reference(case):
    """row_sum_wgmma compiled on the call's default row (with its conditional rescale at
    head dims 128-256, whose skipped rescales skip the sums' too): the reference's
    tolerance, the row sums of P as the P V takes it."""
    row = default_mosaic_config(case.head_dim, case.seq_kv, _spec(case).causal)
    config = dataclasses.replace(row, row_sum_wgmma=True)
    _compare(case, config, interpret=False, seed=seed_of(case))


@pytest.mark.gpu
@pytest.mark.parametrize("slack", [0.0, 8.0])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_rescale_slack_matches_reference(case, slack):
    """rescale_slack compiled on the call's default row: whole warps skip the rescale."""
    row = default_mosaic_config(case.head_dim, case.seq_kv, _spec(case).causal)
    config = dataclasses.replace(row, rescale_slack=slack)
    _compare(case, config, interpret=False, seed=seed_of(case))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", [c for c in GPU_CASES if padded_head_dim(c.head_dim) <= 128], ids=lambda c: c.id
)
def test_gpu_three_consumers_match_reference(case):
    """consumers=3 compiled on the call's default row with at most 128-key tiles (a
    wider score tile does not fit 160 registers beside head dim 64's accumulator):
    the turns go round three consumers on named barriers."""
    row = default_mosaic_config(case.head_dim, case.seq_kv, _spec(case).causal)
    config = dataclasses.replace(row, consumers=3, block_kv=min(row.block_kv, 128))
    _compare(case, config, interpret=False, seed=seed_of(case))


@pytest.mark.gpu
@pytest.mark.parametrize("cols", ["quarter", "all"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_poly_exp2_matches_reference(case, cols):
    """poly_exp2_cols compiled on the call's default row, a quarter and all of each
    tile's columns (the compiler must keep the rounding's add and subtract apart)."""
    row = default_mosaic_config(case.head_dim, case.seq_kv, _spec(case).causal)
    n = row.block_kv // 4 if cols == "quarter" else row.block_kv
    _compare(case, dataclasses.replace(row, poly_exp2_cols=n), interpret=False, seed=seed_of(case))


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_intra_overlap_matches_reference(case):
    """intra_overlap compiled (P in registers, as it would run) over the whole table, with
    at most 128-key tiles, as benchmarks/next_calls.sh times it (at head dim 64 the
    default's 256-key tiles do not fit two score tiles' registers)."""
    row = _overlapped(default_mosaic_config(case.head_dim))
    config = dataclasses.replace(row, block_kv=min(row.block_kv, 128))
    _compare(case, config, interpret=False, seed=seed_of(case))


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_persistent_matches_reference(case):
    """The persistent grid compiled (P in registers, as it would run) over the table (at
    head dim 256 O leaves through Q's buffer)."""
    config = dataclasses.replace(default_mosaic_config(case.head_dim), persistent=True)
    _compare(case, config, interpret=False, seed=seed_of(case))


# More items than a GPU has SMs, not a multiple of them, so that the last round splits:
# head dims 64 and 128 non-causal (their rows are persistent), GQA, a ragged key length;
# causal with rows that see no key (bottom-right), head dim 256 (O through Q's buffer);
# a window without the causal mask at head dim 64 (256 items), whose default row splits.
SPLIT_TAIL_GPU_CASES = [
    Case(2, 2048, 2000, 8, 2, 128, BF16, kv_lens=(2000, 1100)),
    Case(3, 1500, 1700, 8, 8, 64, F16),
    Case(2, 1000, 800, 16, 4, 256, BF16, causal=True, bottom_right=True),
    Case(2, 2048, 2048, 8, 4, 64, BF16, window=(300, 300)),
    # 176 items: a last round of 44 in runs of a third of an item, so an item's first
    # piece merges two or three later ones (tail_fixup's longest waits), one K/V head.
    Case(1, 2048, 4096, 11, 1, 128, BF16, kv_lens=(3000,)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("clusters", [False, True], ids=["", "clusters"])
@pytest.mark.parametrize("fixup", [False, True], ids=["xla-merge", "fixup"])
@pytest.mark.parametrize("case", SPLIT_TAIL_GPU_CASES, ids=lambda c: c.id)
def test_gpu_split_tail_matches_reference(case, fixup, clusters):
    """split_tail compiled on the call's row made persistent (`clusters`: a persistent
    grid of clusters of two, kv_multicast, pairs of tiles in pieces), its pieces merged
    after the kernel or in it (tail_fixup): the reference's tolerance, the unsplit grid's
    result within float32 merging (_assert_within_merging), the same bits twice."""
    row = default_mosaic_config(case.head_dim, case.seq_kv, _spec(case).causal)
    per_cta = dict(WITHOUT_PERSISTENT, early_q_load=row.early_q_load) if clusters else {}
    whole = dataclasses.replace(row, persistent=True, kv_multicast=clusters, **per_cta)
    split = dataclasses.replace(whole, split_tail=True, tail_fixup=fixup)
    _compare(case, split, interpret=False, seed=seed_of(case))
    got = _mosaic(case, split, False, seed_of(case))
    _assert_within_merging(got, _mosaic(case, whole, False, seed_of(case)), split)
    chex.assert_trees_all_equal(got, _mosaic(case, split, False, seed_of(case)))


@pytest.mark.gpu
@pytest.mark.parametrize("config", PIPELINES, ids=_config_id)
def test_gpu_pipeline_configs(config):
    _compare(Case(2, 1000, 1100, 4, 2, 128, BF16, causal=True), config, interpret=False)


@pytest.mark.gpu
def test_gpu_is_bitwise_deterministic():
    case = Case(2, 1024, 900, 4, 1, 128, BF16, causal=True, kv_lens=(900, 500))
    chex.assert_trees_all_equal(_mosaic(case, None, False, 3), _mosaic(case, None, False, 3))


@pytest.mark.gpu
def test_gpu_never_reads_skipped_tiles():
    case = Case(1, 128, 1024, 2, 2, 128, BF16, causal=True)
    q, k, v, _ = case.inputs()
    out = _mosaic(case, None, False, qkv=(q, k, v))
    k_bad, v_bad = k.at[:, 128:].set(jnp.nan), v.at[:, 128:].set(jnp.nan)
    chex.assert_trees_all_equal(out, _mosaic(case, None, False, qkv=(q, k_bad, v_bad)))

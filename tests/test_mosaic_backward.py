"""The Mosaic GPU (Hopper) backward kernels (dK/dV and dQ) against the float32 reference.

On CPU the kernels run in Mosaic GPU's interpret mode: the same warp-specialised
kernels, with their producer/consumer barriers, TMA copies and wgmma simulated, except
that P^T, dS^T and dS enter their wgmma from shared memory
(`MosaicBwdConfig.operands_in_registers=False`; the interpreter's wgmma cannot read
registers). Tests marked `gpu` run the compiled kernels on the H200, operands from
registers and from shared memory: `pytest -m gpu tests/test_mosaic_backward.py` there.
The fused kernel's tests are in tests/test_mosaic_fused.py, the lowerings for sm_90 in
tests/test_mosaic_lowering.py, the dispatch and config checks in tests/test_mosaic_api.py.
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

from pallas_flash import reference
from pallas_flash.mosaic import backward as mosaic_backward
from pallas_flash.mosaic.bwd_config import (
    MosaicBwdConfig,
    default_mosaic_bwd_config,
    pair_mosaic_bwd_config,
)
from pallas_flash.mosaic.config import SMEM_BYTES, MosaicConfig, padded_head_dim
from tests import test_mosaic
from tests.cases import Case, packed, seed_of, tolerance_check

pytestmark = pytest.mark.mosaic  # the GPU run takes these in a step of their own

BF16, F16 = jnp.bfloat16, jnp.float16


# A Case's mask spec, lengths and segment ids.
_spec, _lengths, _segments = test_mosaic._spec, test_mosaic._lengths, test_mosaic._segments


_seed = seed_of


def _reference_grads(case: Case, q, k, v, do, dlse, *, upcast: bool):
    """(o, lse, dq, dk, dv) of reference.py: float32 truth (upcast) or naive in dtype."""
    q_len, kv_len = _lengths(case)

    def f(q, k, v):
        return reference.attention(
            q,
            k,
            v,
            scale=case.head_dim**-0.5,
            mask_spec=_spec(case),
            query_seq_lengths=q_len,
            key_value_seq_lengths=kv_len,
            segment_ids=_segments(case),
            upcast=upcast,
        )

    if upcast:
        q, k, v, do = (x.astype(jnp.float32) for x in (q, k, v, do))
    (o, lse), vjp = jax.vjp(f, q, k, v)
    return (o, lse, *vjp((do.astype(o.dtype), jnp.where(jnp.isfinite(lse), dlse, 0.0))))


@functools.cache
def _problem(case: Case, seed: int, with_dlse: bool):
    """Inputs, the lse cotangent, and the reference's (o, lse, dq, dk, dv) in float32
    and naive in the case's dtype (jitted: several times faster than eager on CPU)."""
    q, k, v, do = case.inputs(seed)
    dlse = jax.random.normal(jax.random.PRNGKey(seed + 1000), (case.batch, case.heads, case.seq_q))
    dlse = dlse if with_dlse else jnp.zeros_like(dlse)

    @jax.jit
    def both(*args):
        return tuple(_reference_grads(case, *args, upcast=upcast) for upcast in (True, False))

    ref, naive = both(q, k, v, do, dlse)
    return (q, k, v, do, dlse), ref, naive


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _backward(case, config, interpret, q, k, v, o, lse, do, dlse):
    """dq, dk, dv of the Mosaic backward, jitted (eager, each op around the kernels
    compiles on its own: slower on CPU than the program)."""
    q_len, kv_len = _lengths(case)
    return mosaic_backward.backward(
        q,
        k,
        v,
        o,
        lse,
        do,
        dlse,
        q_len,
        kv_len,
        _segments(case),
        spec=_spec(case),
        scale=case.head_dim**-0.5,
        config=config or default_mosaic_bwd_config(case.head_dim, case.causal),
        interpret=interpret,
    )[:3]


def _mosaic_forward(case, interpret, q, k, v):
    config = MosaicConfig(block_q=64, block_kv=64) if interpret else None
    return test_mosaic._mosaic(case, config, interpret, qkv=(q, k, v))


def _compare(case, config, interpret, seed: int = 0, *, with_dlse=True, mosaic_forward_=False):
    """The kernels' dq, dk, dv within tolerance of the reference's, given O and the
    logsumexp of the reference (O cast to the kernel's dtype) or of the Mosaic forward.
    With `with_dlse`, the logsumexp has a random cotangent too (it enters through D)."""
    (q, k, v, do, dlse), ref, naive = _problem(case, seed, with_dlse)
    if mosaic_forward_:
        o, lse = _mosaic_forward(case, interpret, q, k, v)
    else:
        o, lse = ref[0].astype(case.dtype), ref[1]
    dlse = jnp.where(jnp.isfinite(lse), dlse, 0.0)
    grads = _backward(case, config, interpret, q, k, v, o, lse, do, dlse)
    for name, got, r, n in zip(("dq", "dk", "dv"), grads, ref[2:], naive[2:]):
        assert got.dtype == case.dtype, name
        tolerance_check(f"mosaic bwd {case.id} {name}", got, r, n, case.dtype)
    return grads


def _flag_changes_no_bit(case, config, flag: str, interpret: bool, values=(True, False)):
    """`config` with its field `flag` at each of two `values` (by default a boolean on
    and off): the same gradients, bit for bit (each also within the reference's
    tolerance, `_compare`)."""
    on, off = (dataclasses.replace(config, **{flag: b}) for b in values)
    seed = _seed(case)
    chex.assert_trees_all_equal(
        _compare(case, on, interpret, seed=seed), _compare(case, off, interpret, seed=seed)
    )


# Awkward shapes for interpret mode: lengths off the tiles, T != S both ways, GQA and
# MQA, both causal alignments, windows, ragged and empty lengths, padded head dims, and
# the dK/dV split of head dims above 128 (with one dQ warpgroup).
INTERPRET_CASES = [
    Case(1, 100, 150, 2, 1, 64, BF16),
    Case(1, 100, 257, 1, 1, 128, F16, causal=True, bottom_right=True, kv_lens=(150,)),
    Case(2, 100, 90, 1, 1, 64, BF16, causal=True, q_lens=(100, 61), kv_lens=(33, 90)),
    Case(1, 200, 150, 1, 1, 64, F16, causal=True, window=(40, 3)),
    Case(1, 1, 77, 1, 1, 80, F16),  # one query row; head dim padded to 128
    Case(1, 70, 90, 2, 1, 256, BF16, causal=True),
    # Segment ids: packed documents, and T != S with their own ids under causal masking
    # (the GQA group's heads share the key ids in the dK/dV kernel).
    Case(2, 200, 200, 2, 1, 64, BF16, segments=(packed([(60, 140), (200,)], 200),) * 2),
    Case(
        2,
        130,
        150,
        2,
        1,
        64,
        F16,
        causal=True,
        segments=(packed([(30, 100), (130,)], 130), packed([(40, 110), (150,)], 150)),
    ),
    # Padded head dim 128 (and 64 without a causal mask) takes the fused default: no
    # mask with a GQA group and a ragged last query tile (several spans adding to each
    # query tile), and packed documents with ragged key lengths at a padded head dim.
    Case(1, 300, 512, 2, 1, 128, BF16),
    Case(
        2,
        200,
        230,
        2,
        1,
        96,
        F16,
        kv_lens=(230, 150),
        segments=(packed([(60, 140), (200,)], 200), packed([(70, 170), (230,)], 230)),
    ),
]


@pytest.mark.parametrize("case", INTERPRET_CASES, ids=lambda c: c.id)
def test_interpret_matches_reference(case):
    _compare(case, None, interpret=True, seed=_seed(case))


CONFIGS = [
    # The producers wait for every tile; one dK/dV warpgroup.
    MosaicBwdConfig(num_stages_dkv=1, num_stages_dq=1, consumers_dkv=1),
    # dV / dK split between the warpgroups, 128-row query tiles, 128-key tiles.
    MosaicBwdConfig(split_dkv=True, block_q_dkv=128, block_kv_dq=128, num_stages_dkv=3),
    # 128-key dK/dV tiles, 128-row dQ tiles in one warpgroup.
    MosaicBwdConfig(block_kv_dkv=128, block_q_dq=128, consumers_dq=1, num_stages_dq=3),
]


def _config_id(c: MosaicBwdConfig) -> str:
    dkv = f"dkv{c.consumers_dkv}x{c.block_kv_dkv}-q{c.block_q_dkv}-s{c.num_stages_dkv}"
    dq = f"dq{c.consumers_dq}x{c.block_q_dq}-kv{c.block_kv_dq}-s{c.num_stages_dq}"
    return f"{dkv}{'-split' if c.split_dkv else ''}-{dq}"


@pytest.mark.extended
@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_interpret_configs(config):
    # A GQA group of 2 with ragged, causal tiles: every config crosses masked, full and
    # skipped tiles and several ring turns.
    case = Case(1, 150, 200, 2, 1, 64, BF16, causal=True, bottom_right=True, kv_lens=(180,))
    _compare(case, config, interpret=True, seed=1)


# Row bounds where the masks have them: bottom-right causal with a key length, ragged
# lengths with rows that see no key, a window, segment ids under causal masking.
ROW_BOUND_CASES = [INTERPRET_CASES[i] for i in (1, 2, 3, 7)]


@pytest.mark.extended
@pytest.mark.parametrize("case", ROW_BOUND_CASES, ids=lambda c: c.id)
def test_interpret_row_bound_mask_changes_no_bit(case):
    """`row_bound_mask` (each query's key bounds against the key iota, in both kernels)
    keeps the same elements as `masks.tile_mask`, so the gradients are the same bits."""
    _flag_changes_no_bit(case, pair_mosaic_bwd_config(case.head_dim), "row_bound_mask", True)


@pytest.mark.extended
@pytest.mark.parametrize("case", ROW_BOUND_CASES, ids=lambda c: c.id)
def test_interpret_column_blocks_changes_no_bit(case):
    """`column_blocks` (the dQ kernel's bounds compared eight key columns at a time): the
    same elements kept, so the same gradients."""
    config = dataclasses.replace(pair_mosaic_bwd_config(case.head_dim), row_bound_mask=True)
    _flag_changes_no_bit(case, config, "column_blocks", True)


# The dK/dV split with P^T handed over: a GQA group with causal and ragged tiles, the
# head-dim-256 case the split is for, and head dim 192 (the compiled case table has none).
SHARE_PROBS_CASES = [
    INTERPRET_CASES[2],
    INTERPRET_CASES[5],
    Case(1, 70, 90, 2, 1, 192, F16, causal=True, bottom_right=True),
]


@pytest.mark.extended
@pytest.mark.parametrize("case", SHARE_PROBS_CASES, ids=lambda c: c.id)
def test_interpret_share_probs_changes_no_bit(case):
    """`share_probs`: the dK warpgroup reads the dV warpgroup's P^T instead of
    recomputing it from the same tiles, so the gradients are the same bits."""
    config = dataclasses.replace(pair_mosaic_bwd_config(case.head_dim), split_dkv=True)
    _flag_changes_no_bit(case, config, "share_probs", True)


@pytest.mark.extended
@pytest.mark.parametrize("case", [INTERPRET_CASES[i] for i in (1, 2, 3, 7)], ids=lambda c: c.id)
def test_interpret_dq_kv_multicast_changes_no_bit(case):
    """`dq_kv_multicast`: the dQ kernel's clusters of two CTAs walk the key range of both
    tiles' rows (bottom-right causal with a key length, ragged lengths, a window, packed
    documents), so a tile may see key tiles its own rows mask out entirely: the same
    bits (and the reference's tolerance)."""
    _flag_changes_no_bit(case, pair_mosaic_bwd_config(case.head_dim), "dq_kv_multicast", True)


@pytest.mark.extended
@pytest.mark.parametrize("case", [INTERPRET_CASES[i] for i in (1, 2, 3, 5, 7)], ids=lambda c: c.id)
def test_interpret_dkdv_q_multicast_changes_no_bit(case):
    """`dkdv_q_multicast`: the dK/dV kernel's clusters of two CTAs walk the query range of
    both key spans (bottom-right causal with a key length, ragged lengths, a window, the
    head-dim-256 split, packed documents): query tiles one span's keys mask out entirely
    leave every bit as it was (and the reference's tolerance)."""
    config = pair_mosaic_bwd_config(case.head_dim)
    _flag_changes_no_bit(case, config, "dkdv_q_multicast", True)


# The plain dQ kernel at head dims up to 128 (two warpgroups by default): no key, one
# row, ragged and empty lengths, windows, segment ids.
DQ_PINGPONG_CASES = [c for c in INTERPRET_CASES if c.head_dim <= 128]


@pytest.mark.extended  # dq_pingpong is off (0.85-0.99x the default): not in CI's time
@pytest.mark.parametrize("case", DQ_PINGPONG_CASES, ids=lambda c: c.id)
def test_interpret_dq_pingpong_changes_no_bit(case):
    """`dq_pingpong` (the dQ kernel's warpgroups taking turns, in the mbarrier form GPU
    interpret mode runs) orders the products, not their arithmetic: the same bits, and
    the reference's tolerance. Both warpgroups walk the CTA's key tiles, none among them
    (rows past the lengths) included, so neither waits for a turn that never comes."""
    _flag_changes_no_bit(case, pair_mosaic_bwd_config(case.head_dim), "dq_pingpong", True)


@pytest.mark.extended  # probs_before_dp is off (not yet timed): not in CI's time
@pytest.mark.parametrize("case", INTERPRET_CASES, ids=lambda c: c.id)
def test_interpret_probs_before_dp_changes_no_bit(case):
    """`probs_before_dp` (S awaited alone and P made before dP is read, in both of the
    pair's kernels, the dK/dV split's dK warpgroup included) moves a wait, not the
    arithmetic: the same bits as the pair's row, and the reference's tolerance (the
    fused kernel's plain order: tests/test_mosaic_fused.py)."""
    _flag_changes_no_bit(case, pair_mosaic_bwd_config(case.head_dim), "probs_before_dp", True)


@pytest.mark.parametrize(
    "case",
    [
        # On in the default above head dim 128 (BWD_EARLY_LSE_DIMS), so those cases run in
        # CI; elsewhere it is off, and the rest of the table is not worth CI's time.
        pytest.param(c, marks=() if padded_head_dim(c.head_dim) > 128 else pytest.mark.extended)
        for c in INTERPRET_CASES
    ],
    ids=lambda c: c.id,
)
def test_interpret_early_lse_changes_no_bit(case):
    """`early_lse` (each step's lse read before the scores' wgmma is issued) in the
    pair's dK/dV kernel, the split's dV warpgroup (share_probs, head dim 256) included:
    the same values from the same slot, so the same bits as the pair's row (the fused
    kernel's orders: tests/test_mosaic_fused.py)."""
    _flag_changes_no_bit(case, pair_mosaic_bwd_config(case.head_dim), "early_lse", True)


# The dQ kernel's two warpgroups on one query tile (split_dq): head dims 128 and 256,
# causal with a key length, GQA, segment ids under causal masking, and seven key tiles
# (unmasked ones, then a ragged last one) through the two-slot ring.
SPLIT_DQ_CASES = [
    INTERPRET_CASES[1],
    INTERPRET_CASES[5],
    Case(1, 64, 400, 1, 1, 128, BF16),
    dataclasses.replace(INTERPRET_CASES[7], head_dim=128, dtype=BF16),  # segment ids
]


@pytest.mark.extended
@pytest.mark.parametrize("case", SPLIT_DQ_CASES, ids=lambda c: c.id)
def test_interpret_split_dq_matches_reference(case):
    config = pair_mosaic_bwd_config(case.head_dim)
    config = _with_two_dq_warpgroups(config, split_dq=True, num_stages_dq=2)
    _compare(case, config, interpret=True, seed=_seed(case))


def test_interpret_fully_masked_rows_have_zero_gradients():
    # Batch 0: bottom-right causal with q_len 30 > kv_len 24, so the diagonal starts at
    # column -6 and rows 0..5 see no key; rows 30..39 are padding. Batch 1: no key at
    # all. Batch 2: no query at all.
    case = Case(3, 40, 24, 1, 1, 64, BF16, causal=True, bottom_right=True)
    case = dataclasses.replace(case, q_lens=(30, 40, 0), kv_lens=(24, 0, 24))
    dq, dk, dv = (np.asarray(x, np.float32) for x in _compare(case, None, interpret=True))
    for x in (dq, dk, dv):
        assert np.isfinite(x).all()
    for b, rows in [(0, slice(0, 6)), (0, slice(30, 40)), (1, slice(0, 40)), (2, slice(0, 40))]:
        assert (dq[b, rows] == 0).all()
    for b in (1, 2):
        assert (dk[b] == 0).all() and (dv[b] == 0).all()
    assert np.abs(dq[0, 6:30]).min(axis=-1).max() > 0


def test_interpret_never_reads_skipped_tiles():
    """Rows and keys no tile pair needs are never loaded: poisoning them with NaN
    changes nothing (a read would show, as NaN spreads through every matmul).

    Bottom-right causal, T = 256 > S = 64: rows 0..191 see no key, so the dK/dV kernel
    streams only query tile 3 of 64 rows, and the dQ CTA of rows 0..127 loads no key."""
    case = Case(1, 256, 64, 1, 1, 64, BF16, causal=True, bottom_right=True)
    (q, k, v, do, _), ref, _ = _problem(case, 0, False)
    o, lse = ref[0].astype(BF16), ref[1]
    args = lambda q, do: (q, k, v, o, lse, do, None)  # noqa: E731
    clean = _backward(case, None, True, *args(q, do))
    q_bad, do_bad = q.at[:, :128].set(jnp.nan), do.at[:, :128].set(jnp.nan)
    poisoned = _backward(case, None, True, *args(q_bad, do_bad))
    chex.assert_trees_all_equal(clean, poisoned)
    assert (np.asarray(clean[0][:, :192]) == 0).all()


def test_interpret_takes_the_mosaic_forward_residuals():
    """O and the logsumexp of the Mosaic forward feed the Mosaic backward as they are."""
    case = Case(1, 70, 90, 2, 1, 64, F16, causal=True, kv_lens=(80,))
    _compare(case, None, interpret=True, seed=2, mosaic_forward_=True)


@pytest.mark.parametrize(
    "share_probs,split_dq,multicast,pingpong",
    [
        (False, False, False, False),
        (True, True, False, False),
        # multicast (both kernels; off by default): extended
        pytest.param(False, False, True, False, marks=pytest.mark.extended),
        # the dQ kernel's ping-pong (off by default): extended
        pytest.param(False, False, False, True, marks=pytest.mark.extended),
    ],
    ids=["split", "share-probs-split-dq", "split-dq-kv-multicast", "split-dq-pingpong"],
)
def test_interpret_finds_no_data_race(share_probs, split_dq, multicast, pingpong):
    """The interpreter's happens-before race detector over the shared buffers (the
    resident K/V, the Q/dO/lse/D ring, the K/V ring, the staging buffers, the P^T tile
    handed between the split's warpgroups, split_dq's P and dS tiles and the outputs
    staged through shared memory; its wgmma operand reads are not instrumented), and the
    dQ kernel's K/V ring and the dK/dV kernel's Q/dO ring, each written by both CTAs of a
    cluster (dq_kv_multicast, dkdv_q_multicast); with dq_pingpong, the dQ kernel's
    warpgroups taking turns."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # no public accessor

    params = plgpu.InterpretGPUParams(detect_races=True)
    case = Case(1, 130, 70, 1, 1, 128 if split_dq else 64, BF16)
    config = MosaicBwdConfig(
        split_dkv=True,
        share_probs=share_probs,
        split_dq=split_dq,
        dq_kv_multicast=multicast,
        dkdv_q_multicast=multicast,
        dq_pingpong=pingpong,
    )
    _compare(case, config, interpret=params, with_dlse=False)
    assert not gpu_callbacks.get_races().races_found


def _with_operands(config: MosaicBwdConfig, in_registers: bool, head_dim: int):
    """`config` with its register operands on or off. Staged (through shared memory) at
    head dim 256, the two staging tiles leave no room for share_probs' float32 P^T tile
    (233,552 bytes of 232,448), so there the staged form is the split without it (the
    hand-over is checked staged in interpret mode, where shared memory is not bounded,
    and compiled with the operands in registers). Staged, the dQ kernel's Q and dO are
    read from shared memory too (q_do_in_registers off): every wgmma operand there."""
    config = dataclasses.replace(config, operands_in_registers=in_registers)
    if not in_registers:
        config = dataclasses.replace(config, q_do_in_registers=False)
    if config.share_probs and config.smem_bytes_dkv(padded_head_dim(head_dim)) > SMEM_BYTES:
        assert not in_registers
        config = dataclasses.replace(config, share_probs=False)
    return config


def _with_two_dq_warpgroups(config: MosaicBwdConfig, split_dq: bool = False, **changes):
    """`config` with two dQ warpgroups, each on its own query tile or (split_dq) both on
    one: the default's grant of every register to a lone dQ warpgroup
    (solo_dq_registers, head dims 192-256) goes, and with split_dq so do Q and dO in
    registers (the plain dQ kernel's, head dims 64-128)."""
    changes = dict(consumers_dq=2, solo_dq_registers=False, split_dq=split_dq, **changes)
    if split_dq:
        changes["q_do_in_registers"] = False
    return dataclasses.replace(config, **changes)


# The forward's GPU cases: the shared table's cases these kernels serve (16-bit, no
# segments/dropout/bias/mask/cap), plus head dims 64/128/256 at sizes that fill the pipelines.
GPU_CASES = test_mosaic.GPU_CASES


# O and the logsumexp come from the reference (O cast to the case's dtype), so that a
# failure here is the backward's own; test_gpu_takes_the_mosaic_forward_residuals
# chains the compiled forward.
@pytest.mark.gpu
@pytest.mark.parametrize("in_registers", [True, False], ids=["regs", "staged"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_matches_reference(case, in_registers):
    config = default_mosaic_bwd_config(case.head_dim, case.causal)
    if config.fused and not in_registers:
        pytest.skip("the fused default (fa3_order) reads its operands from registers only")
    config = _with_operands(config, in_registers, case.head_dim)
    _compare(case, config, interpret=False, seed=_seed(case))


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES[-6:], ids=lambda c: c.id)
def test_gpu_takes_the_mosaic_forward_residuals(case):
    _compare(case, None, interpret=False, seed=_seed(case), mosaic_forward_=True)


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_gpu_configs(config):
    # Head dim 64: the 128-key dK/dV tiles of the last config exceed a warpgroup's
    # registers at 128.
    _compare(Case(2, 1000, 1100, 4, 2, 64, BF16, causal=True), config, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_is_bitwise_deterministic(head_dim, causal):
    """No atomics: two identical calls give bitwise-equal gradients (a GQA group of 4,
    whose dK/dV sum over the group happens inside one CTA; at head dim 128 non-causal
    the fused default, whose dQ adds go in a fixed order)."""
    case = Case(2, 1024, 900, 8, 2, head_dim, BF16, causal=causal, kv_lens=(900, 500))
    (q, k, v, do, dlse), ref, _ = _problem(case, 3, True)
    o, lse = ref[0].astype(BF16), ref[1]
    dlse = jnp.where(jnp.isfinite(lse), dlse, 0.0)
    run = lambda: _backward(case, None, False, q, k, v, o, lse, do, dlse)  # noqa: E731
    chex.assert_trees_all_equal(run(), run())


@pytest.mark.gpu
def test_gpu_never_reads_skipped_tiles():
    """As test_interpret_never_reads_skipped_tiles: rows 0..767 see no key, so the dK/dV
    kernel never streams them and no dQ CTA of theirs loads a key."""
    case = Case(1, 1024, 256, 2, 2, 128, BF16, causal=True, bottom_right=True)
    (q, k, v, do, _), ref, _ = _problem(case, 0, False)
    o, lse = ref[0].astype(BF16), ref[1]
    clean = _backward(case, None, False, q, k, v, o, lse, do, None)
    q_bad, do_bad = q.at[:, :768].set(jnp.nan), do.at[:, :768].set(jnp.nan)
    poisoned = _backward(case, None, False, q_bad, k, v, o, lse, do_bad, None)
    chex.assert_trees_all_equal(clean, poisoned)
    assert (np.asarray(clean[0][:, :768]) == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_row_bound_mask_changes_no_bit(case):
    """row_bound_mask compiled, both kernels: the same bits as the head dim's row with
    `masks.tile_mask` (and both within the reference's tolerance)."""
    _flag_changes_no_bit(case, pair_mosaic_bwd_config(case.head_dim), "row_bound_mask", False)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_column_blocks_changes_no_bit(case):
    """column_blocks compiled (the dQ kernel's masks eight key columns at a time): the
    same bits as comparing each column (and both within the reference's tolerance)."""
    _flag_changes_no_bit(case, pair_mosaic_bwd_config(case.head_dim), "column_blocks", False)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_held_zero_changes_no_bit(case):
    """held_zero compiled, in the default for the case (the pair, or the fused kernel at
    head dim 128 and at 64 non-causal): its fresh accumulators start from a zero held across the
    loops rather than from run_scoped's, the same zeros, so the same gradients (ptxas
    then folds them; tests/test_deviceless.py checks that)."""
    config = default_mosaic_bwd_config(case.head_dim, case.causal)
    _flag_changes_no_bit(case, config, "held_zero", False)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_probs_before_dp_changes_no_bit(case):
    """probs_before_dp compiled on the pair's row for the case: the exp2 issued between
    S's wait and dP's, the same gradients bit for bit."""
    _flag_changes_no_bit(case, pair_mosaic_bwd_config(case.head_dim), "probs_before_dp", False)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", [c for c in GPU_CASES if padded_head_dim(c.head_dim) > 128], ids=lambda c: c.id
)
def test_gpu_early_lse_changes_no_bit(case):
    """early_lse compiled on the pair's row above head dim 128 (the dK/dV split with P^T
    handed over, one dQ warpgroup): the lse read before the scores' wgmma, the same
    gradients bit for bit, and the reference's tolerance."""
    _flag_changes_no_bit(case, pair_mosaic_bwd_config(case.head_dim), "early_lse", False)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_share_probs_changes_no_bit(case):
    """share_probs compiled: the dK/dV split with P^T handed over gives the split's bits
    (and both are within the reference's tolerance)."""
    config = dataclasses.replace(pair_mosaic_bwd_config(case.head_dim), split_dkv=True)
    _flag_changes_no_bit(case, config, "share_probs", False)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", [c for c in GPU_CASES if padded_head_dim(c.head_dim) <= 128], ids=lambda c: c.id
)
def test_gpu_q_do_in_registers_changes_no_bit(case):
    """q_do_in_registers compiled (the dQ kernel's Q and dO as register A operands): the
    same products in the same order, so the head dim's row's bits (and the reference's
    tolerance), at the head dims whose registers hold them."""
    _flag_changes_no_bit(case, pair_mosaic_bwd_config(case.head_dim), "q_do_in_registers", False)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", [c for c in GPU_CASES if padded_head_dim(c.head_dim) == 64], ids=lambda c: c.id
)
def test_gpu_k_v_in_registers_changes_no_bit(case):
    """k_v_in_registers compiled (the dK/dV kernel's K and V as register A operands), at
    head dim 64, the one whose registers hold them beside dK and dV."""
    _flag_changes_no_bit(case, pair_mosaic_bwd_config(case.head_dim), "k_v_in_registers", False)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", [c for c in GPU_CASES if padded_head_dim(c.head_dim) == 64], ids=lambda c: c.id
)
def test_gpu_dq_key_tiles_change_no_bit(case):
    """The head-dim-64 default's 128-key dQ tiles (BWD_DQ_KEYS_64) against 64-key ones:
    each 128-key wgmma accumulates its K in place in the order of two 64-key ones, so the
    same bits (and the reference's tolerance). Compiled only: staged through shared
    memory (interpret mode's form) each tile's product is added on its own, and 128-key
    and 64-key tiles then round differently (checked on CPU at 9a4f9ab)."""
    config = pair_mosaic_bwd_config(case.head_dim)
    assert config.block_kv_dq == 128
    _flag_changes_no_bit(case, config, "block_kv_dq", False, values=(128, 64))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", [c for c in GPU_CASES if c.head_dim <= 128], ids=lambda c: c.id
)  # the rows whose default dQ kernel has two warpgroups
def test_gpu_dq_pingpong_changes_no_bit(case):
    """dq_pingpong compiled (the turns on hardware named barriers): the default's bits
    (and the reference's tolerance), no hang."""
    _flag_changes_no_bit(case, pair_mosaic_bwd_config(case.head_dim), "dq_pingpong", False)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_dq_kv_multicast_changes_no_bit(case):
    """dq_kv_multicast compiled (the dQ kernel in clusters of two, K/V by TMA multicast):
    the default's bits (and the reference's tolerance)."""
    _flag_changes_no_bit(case, pair_mosaic_bwd_config(case.head_dim), "dq_kv_multicast", False)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_dkdv_q_multicast_changes_no_bit(case):
    """dkdv_q_multicast compiled (the dK/dV kernel in clusters of two, Q and dO by TMA
    multicast): the default's bits (and the reference's tolerance)."""
    config = pair_mosaic_bwd_config(case.head_dim)
    _flag_changes_no_bit(case, config, "dkdv_q_multicast", False)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", [c for c in GPU_CASES if padded_head_dim(c.head_dim) > 128], ids=lambda c: c.id
)
def test_gpu_solo_dq_registers_change_no_bit(case):
    """solo_dq_registers compiled (the one dQ warpgroup of head dims above 128 with 256
    registers): the same code with more registers, so the default's bits."""
    _flag_changes_no_bit(case, pair_mosaic_bwd_config(case.head_dim), "solo_dq_registers", False)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", [c for c in GPU_CASES if padded_head_dim(c.head_dim) % 128 == 0], ids=lambda c: c.id
)
def test_gpu_split_dq_matches_reference(case):
    """split_dq compiled (the dQ kernel's two warpgroups on one query tile), at the head
    dims whose halves are whole 64-column tiles."""
    config = pair_mosaic_bwd_config(case.head_dim)
    config = _with_two_dq_warpgroups(config, split_dq=True, num_stages_dq=2)
    _compare(case, config, interpret=False, seed=_seed(case))

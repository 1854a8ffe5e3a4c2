"""The Mosaic GPU (Hopper) backward kernels (dK/dV and dQ) against the float32 reference.

On CPU the kernels run in Mosaic GPU's interpret mode: the same warp-specialised
kernels, with their producer/consumer barriers, TMA copies and wgmma simulated, except
that P^T, dS^T and dS enter their wgmma from shared memory
(`MosaicBwdConfig.operands_in_registers=False`; the interpreter's wgmma cannot read
registers). The CUDA lowering tests also run on CPU. Tests marked `gpu` run the
compiled kernels on the H200, operands from registers and from shared memory:
`pytest -m gpu tests/test_mosaic_backward.py` there.
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
from pallas_flash.logits import Logits
from pallas_flash.mosaic import backward as mosaic_backward
from pallas_flash.mosaic import pipeline
from pallas_flash.mosaic.bwd_config import (
    MosaicBwdConfig,
    default_mosaic_bwd_config,
    fused_full_bwd_config,
    fused_mosaic_bwd_config,
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
    # Head dims 65-128 without a causal mask take the fused default (BWD_FUSED_FULL): no
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


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=() if i == 2 else pytest.mark.extended)
        for i, c in enumerate(DQ_PINGPONG_CASES)
    ],
    ids=lambda c: c.id,
)
def test_interpret_dq_pingpong_changes_no_bit(case):
    """`dq_pingpong` (the dQ kernel's warpgroups taking turns, in the mbarrier form GPU
    interpret mode runs) orders the products, not their arithmetic: the same bits, and
    the reference's tolerance. Both warpgroups walk the CTA's key tiles, none among them
    (rows past the lengths) included, so neither waits for a turn that never comes."""
    _flag_changes_no_bit(case, pair_mosaic_bwd_config(case.head_dim), "dq_pingpong", True)


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
        (False, False, False, True),
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
def test_unsupported_features_raise(dtype, kwargs, match):
    q = jnp.ones((1, 8, 2, 64), dtype)
    lse = jnp.zeros((1, 2, 8), jnp.float32)
    lens = jnp.full((1,), 8, jnp.int32)
    with pytest.raises(NotImplementedError, match=match):
        mosaic_backward.backward(
            q,
            q,
            q,
            q,
            lse,
            q,
            None,
            lens,
            lens,
            spec=masks.MaskSpec(),
            scale=1.0,
            config=MosaicBwdConfig(),
            interpret=True,
            **kwargs,
        )


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


def test_config_validation():
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

# Head dim 128: each of two consumers computes half of the dQ share's columns. Head dim
# 64 (columns not splittable in 64s): one consumer computing the whole share.
FUSED = MosaicBwdConfig(fused=True)
FUSED_ONE = MosaicBwdConfig(fused=True, consumers_dkv=1)
# Head dim 64 with two consumers: 128-row query tiles, each consumer 64 rows of the share.
FUSED_ROWS = MosaicBwdConfig(fused=True, block_q_dkv=128)


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
# halves or the whole share.
FUSED_VARIANTS = {
    "keys-rows": {},
    "query-rows": {"query_rows": True},
    "share-halves-writer-warp": {"share_halves": True, "writer_warp": True},
    "chained-share": {"chained_share": True},
    "rotated-adds": {"rotated_adds": True},
    "split-writer": {"share_halves": True, "writer_warp": True, "split_writer": True},
    # Two writer warps with the whole share (head dim 64's rows: a share of N = 64).
    "writer-warps": {"writer_warp": True, "split_writer": True},
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
        # The protocol: each span's adds in its walk's order, head by head; an add goes
        # when its tile's count reads its rank, and adds 1.
        group, done = 2, dict.fromkeys(walks, 0)
        counts = np.zeros((group, tiles), np.int32)
        progress = True
        while progress:
            progress = False
            for span, walk in walks.items():
                while done[span] < group * len(walk):
                    g, i = divmod(done[span], len(walk))
                    if counts[g, walk[i]] != ranks[span, walk[i]]:
                        break
                    counts[g, walk[i]] += 1
                    done[span] += 1
                    progress = True
        assert all(done[s] == group * len(w) for s, w in walks.items()), (b, done)
    assert rotated_batches == (1 if spec == ORDER_SPECS["full"][0] else 0)


def test_fused_config_validation():
    with pytest.raises(ValueError, match="split_dkv=False"):
        MosaicBwdConfig(fused=True, split_dkv=True)
    with pytest.raises(ValueError, match="rotated_adds .* needs fused=True"):
        MosaicBwdConfig(rotated_adds=True)
    with pytest.raises(ValueError, match="split_writer .* needs writer_warp=True"):
        MosaicBwdConfig(fused=True, split_writer=True)
    with pytest.raises(ValueError, match="split_writer .* not chained_share"):
        MosaicBwdConfig(fused=True, writer_warp=True, chained_share=True, split_writer=True)
    with pytest.raises(ValueError, match="block_q_dkv a multiple of 128"):
        FUSED.dq_part(64)  # 32 columns each: not a swizzle's 64
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
    assert (FUSED.share_pieces, halves.share_pieces) == (1, 2)
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


LOWERINGS = {
    "h64-bf16-window": (64, BF16, masks.MaskSpec(local_window=(100, 20))),
    "h128-bf16-causal-br": (128, BF16, masks.MaskSpec(causal=True, bottom_right=True)),
    "h192-f16-causal": (192, F16, masks.MaskSpec(causal=True)),
    "h256-bf16-causal-br": (256, BF16, masks.MaskSpec(causal=True, bottom_right=True)),
}


@pytest.mark.parametrize(
    "in_registers",
    [True]
    # off by default on a GPU: extended (interpret mode runs the staged form in CI's tier)
    + [pytest.param(v, marks=pytest.mark.extended) for v in (False, "dq2", "steps", "split-dq")],
    ids=["regs", "staged", "dq2", "step-desc", "split-dq"],
)
@pytest.mark.parametrize("head_dim,dtype,spec", LOWERINGS.values(), ids=LOWERINGS.keys())
def test_compiled_kernels_lower_for_hopper(head_dim, dtype, spec, in_registers):
    """Lowering for CUDA runs on CPU: Pallas to the Mosaic GPU dialect, its layout
    inference for sm_90 (the register operands of wgmma included), the lowering of
    that dialect and the shared-memory check, for both kernels. What is left for the
    GPU: LLVM/PTX code generation, ptxas (register spills), and running it. (dq2:
    operands in registers with two dQ consumers at every head dim; step-desc: operands
    in registers, step_descriptors; split-dq: the dQ kernel's two warpgroups on one
    query tile, at the head dims with whole 64-column halves.)"""
    config = dataclasses.replace(
        _with_operands(pair_mosaic_bwd_config(head_dim), bool(in_registers), head_dim),
        step_descriptors=in_registers == "steps",
    )
    if in_registers == "dq2":
        config = _with_two_dq_warpgroups(config)
        if head_dim == 256:  # two dQ warpgroups' Q and dO beside the K/V ring: too big
            with pytest.raises(ValueError, match="shared memory in its dQ kernel at head dim 256"):
                mosaic_backward.check_fits(config, head_dim)
            return
    if in_registers == "split-dq":
        config = _with_two_dq_warpgroups(config, split_dq=True)
        if head_dim % 128:
            with pytest.raises(ValueError, match=f"split_dq .* head dim {head_dim} has no halves"):
                mosaic_backward.check_fits(config, head_dim)
            return

    def f(q, k, v, o, lse, do, q_len, kv_len):
        return mosaic_backward.backward(
            q, k, v, o, lse, do, None, q_len, kv_len, spec=spec, scale=0.1, config=config
        )[:3]

    q = jax.ShapeDtypeStruct((2, 300, 4, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((2, 257, 2, head_dim), dtype)
    lse = jax.ShapeDtypeStruct((2, 4, 300), jnp.float32)
    lens = jax.ShapeDtypeStruct((2,), jnp.int32)
    lowered = jax.jit(f).trace(q, kv, kv, q, lse, q, lens, lens).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    for name in ("pallas_flash_mosaic_bwd_dkdv", "pallas_flash_mosaic_bwd_dq"):
        assert name in text


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_compiled_kernels_with_segment_ids_lower_for_hopper(head_dim):
    """Segment ids in both backward kernels, operands in registers: the ids' TMA copies,
    barriers and row/column layouts lower for sm_90 (the dK/dV split at 256 included)."""
    spec = masks.MaskSpec(causal=True, segments=True)
    config = pair_mosaic_bwd_config(head_dim)

    def f(q, k, v, o, lse, do, q_len, kv_len, q_seg, kv_seg):
        return mosaic_backward.backward(
            q,
            k,
            v,
            o,
            lse,
            do,
            None,
            q_len,
            kv_len,
            (q_seg, kv_seg),
            spec=spec,
            scale=0.1,
            config=config,
        )[:3]

    q = jax.ShapeDtypeStruct((2, 300, 4, head_dim), BF16)
    kv = jax.ShapeDtypeStruct((2, 257, 2, head_dim), BF16)
    lse = jax.ShapeDtypeStruct((2, 4, 300), jnp.float32)
    lens = jax.ShapeDtypeStruct((2,), jnp.int32)
    ids_q, ids_kv = (jax.ShapeDtypeStruct((2, n), jnp.int32) for n in (300, 257))
    traced = jax.jit(f).trace(q, kv, kv, q, lse, q, lens, lens, ids_q, ids_kv)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    for name in ("pallas_flash_mosaic_bwd_dkdv", "pallas_flash_mosaic_bwd_dq"):
        assert name in text


@pytest.mark.parametrize("fused", [False, True], ids=["pair", "fused"])
@pytest.mark.parametrize("spec", [LOWERINGS["h64-bf16-window"][2], "causal-segments"])
def test_row_bound_mask_lowers_for_hopper(spec, fused):
    """row_bound_mask's per-query bounds lower for sm_90 in each kernel: along the
    columns of S^T in the dK/dV (and fused) kernel, the rows of S in the dQ kernel; with
    a window's two ends, or causal with segment ids."""
    segments = spec == "causal-segments"
    if segments:
        spec = masks.MaskSpec(causal=True, segments=True)
    config = FUSED_ROWS if fused else pair_mosaic_bwd_config(64)
    config = dataclasses.replace(config, row_bound_mask=True)

    def f(q, k, v, o, lse, do, q_len, kv_len, *ids):
        return mosaic_backward.backward(
            q, k, v, o, lse, do, None, q_len, kv_len, ids or None, spec=spec, scale=0.1,
            config=config,
        )[:3]  # fmt: skip

    q = jax.ShapeDtypeStruct((2, 300, 4, 64), BF16)
    kv = jax.ShapeDtypeStruct((2, 257, 2, 64), BF16)
    lse = jax.ShapeDtypeStruct((2, 4, 300), jnp.float32)
    lens = jax.ShapeDtypeStruct((2,), jnp.int32)
    ids = [jax.ShapeDtypeStruct((2, n), jnp.int32) for n in (300, 257)] if segments else []
    traced = jax.jit(f).trace(q, kv, kv, q, lse, q, lens, lens, *ids)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    names = (
        ["pallas_flash_mosaic_bwd_fused"]
        if fused
        else ["pallas_flash_mosaic_bwd_dkdv", "pallas_flash_mosaic_bwd_dq"]
    )
    for name in names:
        assert name in text


@pytest.mark.parametrize("head_dim", [64, pytest.param(128, marks=pytest.mark.extended)])
def test_dq_pingpong_lowers_for_hopper(head_dim):
    """dq_pingpong lowered for sm_90: the dQ kernel's turns are `bar.arrive` / `bar.sync`
    of its two warpgroups (256 threads) on hardware named barriers; the dK/dV kernel has
    none."""
    from benchmarks import lowered_ops

    config = dataclasses.replace(pair_mosaic_bwd_config(head_dim), dq_pingpong=True)
    dkdv, dq = lowered_ops.backward_modules(config, masks.MaskSpec(causal=True), head_dim, 1024)
    text = lowered_ops.module_text(dq)
    assert "bar.arrive $0, 256;" in text and "bar.sync $0, 256;" in text
    assert "bar.sync $0, 256;" not in lowered_ops.module_text(dkdv)


FUSED_FA3_SD = dataclasses.replace(FUSED, fa3_order=True, step_descriptors=True)
FUSED_LOWERINGS = {
    "h128-regs": (128, FUSED, False),
    "h128-regs-segments": (128, FUSED, True),
    "h64-rows-regs": (64, FUSED_ROWS, False),
    "h128-fa3-order": (128, dataclasses.replace(FUSED, fa3_order=True), False),
    "h64-rows-fa3-order-segments": (
        64,
        dataclasses.replace(FUSED_ROWS, fa3_order=True),
        True,
    ),
    "h64-one-consumer-staged-segments": (
        64,
        dataclasses.replace(FUSED_ONE, operands_in_registers=False),
        True,
    ),
    "h128-fa3-order-step-descriptors-segments": (
        128,
        dataclasses.replace(FUSED, fa3_order=True, step_descriptors=True),
        True,
    ),
    "h128-query-rows-step-descriptors": (
        128,
        dataclasses.replace(FUSED, query_rows=True, step_descriptors=True),
        False,
    ),
    "h64-rows-query-rows-segments": (64, dataclasses.replace(FUSED_ROWS, query_rows=True), True),
    # Without step_descriptors the tile's index is static: it must lower too.
    "h128-query-rows": (128, dataclasses.replace(FUSED, query_rows=True), False),
    # The share in 32-column halves (K, Q, dS^T in the 64-byte swizzle), the writer in a
    # warp (warp_map: no get_global or `not` there).
    "h128-fa3-order-step-descriptors-halves-writer-warp-segments": (
        128,
        dataclasses.replace(FUSED_FA3_SD, share_halves=True, writer_warp=True),
        True,
    ),
    "h128-halves": (128, dataclasses.replace(FUSED, share_halves=True), False),
    # Each consumer's share over its own keys, consumer 1 starting from consumer 0's
    # parts (in FA3's order a nested run_state per part after the first).
    "h128-fa3-order-step-descriptors-chained-segments": (
        128,
        dataclasses.replace(FUSED_FA3_SD, chained_share=True),
        True,
    ),
    "h128-chained": (128, dataclasses.replace(FUSED, chained_share=True), False),
    # The walks upward, rotated where no mask cuts the spans, with the turns of
    # dq_adds.turn, in the build timed (FA3's order, halves, the writer a warp).
    "h128-fa3-order-step-descriptors-halves-rotated": (
        128,
        dataclasses.replace(FUSED_FA3_SD, share_halves=True, writer_warp=True, rotated_adds=True),
        False,
    ),
    "h128-rotated-segments": (128, dataclasses.replace(FUSED, rotated_adds=True), True),
    # Two writer warps, a slot each, in the build timed.
    "h128-fa3-order-step-descriptors-halves-split-writer": (
        128,
        dataclasses.replace(FUSED_FA3_SD, share_halves=True, writer_warp=True, split_writer=True),
        False,
    ),
    # Both: two writer warps, each taking its steps' turns in arrival order.
    "h128-fa3-order-step-descriptors-halves-split-writer-rotated": (
        128,
        dataclasses.replace(
            FUSED_FA3_SD, share_halves=True, writer_warp=True, split_writer=True, rotated_adds=True
        ),
        False,
    ),
    # Head dim 64's rows with two writer warps and the whole share (N = 64), in the
    # build a head-dim-64 timing would take (two dK/dV stages beside the share).
    "h64-rows-fa3-order-step-descriptors-writer-warps": (
        64,
        dataclasses.replace(
            FUSED_ROWS,
            num_stages_dkv=2,
            fa3_order=True,
            step_descriptors=True,
            writer_warp=True,
            split_writer=True,
        ),
        False,
    ),
    # Head dim 64's rows split into parts, in FA3's order.
    **{
        f"h64-rows-fa3-order-{name}": (
            64,
            dataclasses.replace(FUSED_ROWS, fa3_order=True, **{flag: True}),
            False,
        )
        for name, flag in (("chained", "chained_share"), ("halves", "share_halves"))
    },
}


@pytest.mark.extended
@pytest.mark.parametrize(
    "head_dim,config,with_segments", FUSED_LOWERINGS.values(), ids=FUSED_LOWERINGS.keys()
)
def test_fused_kernel_lowers_for_hopper(head_dim, config, with_segments):
    """The fused kernel lowers for sm_90 as the pair does (see above), with what only it
    has: the fourth warpgroup, the global semaphores and their waits and signals, the
    TMA reduce-adds and the dS^T / dQ-share exchange; and no dQ kernel is left."""
    spec = masks.MaskSpec(causal=True, bottom_right=True, segments=with_segments)
    text = _lowered_backward(head_dim, config, spec)
    assert "pallas_flash_mosaic_bwd_fused" in text
    assert "pallas_flash_mosaic_bwd_dq" not in text and "pallas_flash_mosaic_bwd_dkdv" not in text


def _lowered_backward(head_dim: int, config: MosaicBwdConfig, spec: masks.MaskSpec) -> str:
    """The backward's module lowered for CUDA on CPU (sm_90's Mosaic GPU lowering): GQA
    with T != S off the tiles, ragged lengths, segment ids where `spec` has them."""

    def f(q, k, v, o, lse, do, q_len, kv_len, *ids):
        return mosaic_backward.backward(
            q, k, v, o, lse, do, None, q_len, kv_len, ids or None, spec=spec, scale=0.1,
            config=config,
        )[:3]  # fmt: skip

    q = jax.ShapeDtypeStruct((2, 300, 4, head_dim), BF16)
    kv = jax.ShapeDtypeStruct((2, 257, 2, head_dim), BF16)
    lse = jax.ShapeDtypeStruct((2, 4, 300), jnp.float32)
    lens = jax.ShapeDtypeStruct((2,), jnp.int32)
    ids = [jax.ShapeDtypeStruct((2, n), jnp.int32) for n in (300, 257)] if spec.segments else []
    traced = jax.jit(f).trace(q, kv, kv, q, lse, q, lens, lens, *ids)
    return traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("segments", [False, True], ids=["plain", "segments"])
@pytest.mark.parametrize("head_dim", [96, 128])
def test_default_fused_backward_lowers_for_hopper(head_dim, segments):
    """The default at head dims 65-128 without a causal mask (the fused kernel in FA3's
    order, its share in halves, two writer warps) lowers for sm_90 on CPU, register
    operands included, which interpret mode drops (fa3_order): one kernel, no dQ
    kernel."""
    config = default_mosaic_bwd_config(head_dim, False)
    assert config.fused and config.fa3_order and config.split_writer
    text = _lowered_backward(head_dim, config, masks.MaskSpec(segments=segments))
    assert "pallas_flash_mosaic_bwd_fused" in text
    assert "pallas_flash_mosaic_bwd_dq" not in text


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
def test_default_configs_fit_in_shared_memory(head_dim):
    for in_registers in (True, False):
        config = _with_operands(pair_mosaic_bwd_config(head_dim), in_registers, head_dim)
        assert config.smem_bytes_dkv(head_dim) <= 227 * 1024
        assert config.smem_bytes_dq(head_dim) <= 227 * 1024
    for causal in (True, False):
        config = default_mosaic_bwd_config(head_dim, causal)
        # the fused kernel at head dim 128 non-causal only, the pair elsewhere
        assert config.fused == (head_dim == 128 and not causal)
        mosaic_backward.check_fits(config, head_dim)


# --- compiled, on the H200 -------------------------------------------------------------

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
    through shared memory, dS computed beside dV's wgmma (its GPU-only path)."""
    config = dataclasses.replace(
        fused_mosaic_bwd_config(case.head_dim), query_rows=True, step_descriptors=True
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
def test_gpu_fused_split_writer_changes_no_bit(case):
    """Two writer warps, a slot each (split_writer), compiled in the build timed, the
    fused default's (fused_full_bwd_config): the same adds in the same order as one
    writer, so the same bits (and the reference's tolerance)."""
    _flag_changes_no_bit(
        case, fused_full_bwd_config(case.head_dim), "split_writer", interpret=False
    )


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

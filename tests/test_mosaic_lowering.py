"""The Mosaic GPU (Hopper) kernels lowered for sm_90 on CPU, forward and backward.

Lowering for CUDA runs without a GPU: Pallas to the Mosaic GPU dialect, its layout
inference for sm_90 (wgmma's register operands included, which interpret mode cannot
run) and the shared-memory check. What is left for the H200: LLVM/PTX code generation,
ptxas (registers, spills) and running the kernels (tests/test_mosaic.py,
tests/test_mosaic_backward.py, tests/test_mosaic_fused.py, `pytest -m gpu`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from pallas_flash import masks
from pallas_flash.mosaic import backward as mosaic_backward
from pallas_flash.mosaic.bwd_config import (
    MosaicBwdConfig,
    default_mosaic_bwd_config,
    pair_mosaic_bwd_config,
)
from pallas_flash.mosaic.config import WITHOUT_PERSISTENT, default_mosaic_config
from tests.test_mosaic import _overlapped
from tests.test_mosaic_backward import _with_operands, _with_two_dq_warpgroups
from tests.test_mosaic_fused import FUSED, FUSED_NARROW, FUSED_ONE, FUSED_ROWS, NARROW_CANDIDATE

pytestmark = pytest.mark.mosaic  # the GPU run takes these in a step of their own

BF16, F16 = jnp.bfloat16, jnp.float16


def _lowered(head_dim: int, config, spec: masks.MaskSpec, dtype=BF16) -> str:
    """The forward's (MosaicConfig) or backward's (MosaicBwdConfig) program lowered for
    CUDA on CPU (sm_90's Mosaic GPU lowering), as text: GQA with T != S off the tiles,
    ragged lengths, segment ids where `spec` has them."""
    from benchmarks import lowered_ops

    lower = (
        lowered_ops.lower_backward
        if isinstance(config, MosaicBwdConfig)
        else lowered_ops.lower_forward
    )
    q = jax.ShapeDtypeStruct((2, 300, 4, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((2, 257, 2, head_dim), dtype)
    return lower(config, spec, q, kv).as_text()


def test_rescale_slack_lowers_for_hopper():
    """rescale_slack lowered for sm_90 (head dim 128's default row): one warp vote per
    tile loop (three: masked, full, masked) and the rescale in a branch of its own
    (one more switch each), its multiplies in one arm only."""
    from benchmarks import lowered_ops

    row = default_mosaic_config(128, 8192, False)
    counts = []
    for slack in (None, 8.0):
        config = dataclasses.replace(row, rescale_slack=slack)
        (module,) = lowered_ops.forward_modules(config, masks.MaskSpec(), 128, 8192)
        text = lowered_ops.module_text(module)
        counts.append(
            tuple(text.count(op) for op in ("nvvm.vote.sync", "scf.index_switch", "arith.mulf"))
        )
    (votes, switches, muls), (votes8, switches8, muls8) = counts
    assert (votes, votes8) == (0, 3) and switches8 == switches + 3 and muls8 == muls


def test_qk_behind_pv_lowers_for_hopper():
    """qk_behind_pv lowered for sm_90 on head dim 128's persistent default row, alone and
    with split_tail: tile lo's Q K^T before the tile loops (8 wgmmas: 4 with Q from
    registers, 4 from shared memory), each loop's step both products (16, as the
    default's: 3 x 16 = 48) and the last step's P V alone, masked and not (8 each): 72;
    the turn handed over (bar.arrive) after tile lo's Q K^T and in each loop's step."""
    from benchmarks import lowered_ops

    row = default_mosaic_config(128, 8192, False)
    counts = []
    for flags in ({}, {"qk_behind_pv": True}, {"qk_behind_pv": True, "split_tail": True}):
        config = dataclasses.replace(row, **flags)
        (module,) = lowered_ops.forward_modules(config, masks.MaskSpec(), 128, 8192)
        text = lowered_ops.module_text(module)
        counts.append(tuple(text.count(op) for op in ("wgmma.mma_async", "bar.arrive")))
    assert counts == [(48, 3), (72, 4), (72, 4)]


def test_three_consumers_lower_for_hopper():
    """consumers=3 lowered for sm_90 (head dim 64's row with 128-key tiles): four
    warpgroups (512 threads), the producer down to 32 registers and the consumers up to
    160, and the turns' named barriers on the third consumer's too."""
    from benchmarks import lowered_ops

    texts = []
    for n in (2, 3):
        row = dataclasses.replace(default_mosaic_config(64, 4096, False), block_kv=128)
        config = dataclasses.replace(row, consumers=n)
        (module,) = lowered_ops.forward_modules(config, masks.MaskSpec(), 64, 4096)
        texts.append(lowered_ops.module_text(module))
    two, three = texts
    assert "threads(%arg5, %arg6, %arg7) in (%arg11 = %c384" in two
    assert "threads(%arg5, %arg6, %arg7) in (%arg11 = %c512" in three
    assert "setmaxnreg.inc.sync.aligned.u32 160;" in three
    assert "setmaxnreg.dec.sync.aligned.u32 32;" in three
    assert "setmaxnreg.inc.sync.aligned.u32 232;" in two


def test_poly_exp2_lowers_for_hopper():
    """poly_exp2_cols lowered for sm_90 (head dim 64's default row, 256-key tiles, three
    tile loops): each consumer thread's exp2 of a tile are 64 x 256 / 128 = 128, of which
    32 columns' 16 leave the MUFU for exp2_poly's PTX in each loop; the alpha rescales'
    six stay."""
    from benchmarks import lowered_ops

    spec = masks.MaskSpec(causal=True)
    row = default_mosaic_config(64, 8192, True)
    counts = []
    for cols in (0, 32, row.block_kv):
        config = dataclasses.replace(row, poly_exp2_cols=cols)
        (module,) = lowered_ops.forward_modules(config, spec, 64, 8192)
        text = lowered_ops.module_text(module)
        counts.append((text.count("ex2.approx"), text.count("shl.b32 e, t, 23")))
    assert counts == [(3 * 128 + 6, 0), (3 * 112 + 6, 3 * 16), (6, 3 * 128)]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_row_sum_wgmma_lowers_for_hopper(head_dim):
    """row_sum_wgmma lowered for sm_90 (the default rows, causal, 8k keys): in each of
    the three tile loops (masked, full, masked) P times the ones tile, a wgmma of N = 8
    over the tile's keys in steps of 16 beside the P V, and no such wgmma without it."""
    from benchmarks import lowered_ops

    spec = masks.MaskSpec(causal=True)
    row = default_mosaic_config(head_dim, 8192, True)
    counts = []
    for flag in (False, True):
        config = dataclasses.replace(row, row_sum_wgmma=flag)
        (module,) = lowered_ops.forward_modules(config, spec, head_dim, 8192)
        counts.append(
            lowered_ops.module_text(module).count("wgmma.mma_async.sync.aligned.m64n8k16")
        )
    assert counts == [0, 3 * row.block_kv // 16]


FORWARD_LOWERINGS = {
    "h64-bf16": (64, BF16, masks.MaskSpec()),
    "h64-f16-causal": (64, F16, masks.MaskSpec(causal=True)),
    "h128-bf16-causal-br": (128, BF16, masks.MaskSpec(causal=True, bottom_right=True)),
    "h128-f16-window": (128, F16, masks.MaskSpec(local_window=(100, 20))),
    "h192-bf16-causal": (192, BF16, masks.MaskSpec(causal=True)),
    "h256-f16-causal-br": (256, F16, masks.MaskSpec(causal=True, bottom_right=True)),
    "h256-bf16": (256, BF16, masks.MaskSpec()),
}


@pytest.mark.parametrize(
    "p_in_registers,rescale_early,overlap,persistent,q_cols",
    [
        # Q from shared memory (q_register_cols=0), P through shared memory, intra_overlap
        # and kv_multicast are no default row's: extended, but for the one persistent row
        pytest.param(True, False, False, False, 0, marks=pytest.mark.extended),
        pytest.param(False, False, False, False, 0, marks=pytest.mark.extended),
        pytest.param(True, True, False, False, 0, marks=pytest.mark.extended),
        pytest.param(True, False, True, False, 0, marks=pytest.mark.extended),
        (True, True, False, True, 0),
        (True, True, False, False, 64),
        pytest.param(True, False, True, False, 64, marks=pytest.mark.extended),
        pytest.param(True, True, False, False, -64, marks=pytest.mark.extended),
    ],
    ids=[
        "p-regs",
        "p-smem",
        "p-regs-early",
        "p-regs-overlap",
        "p-regs-early-persistent",
        "q-regs-early",
        "q-regs-overlap",
        "q-regs-early-multicast",
    ],
)
@pytest.mark.parametrize(
    "head_dim,dtype,spec", FORWARD_LOWERINGS.values(), ids=FORWARD_LOWERINGS.keys()
)
def test_compiled_kernel_lowers_for_hopper(
    head_dim, dtype, spec, p_in_registers, rescale_early, overlap, persistent, q_cols
):
    """Lowering for CUDA runs on CPU: Pallas to the Mosaic GPU dialect, its layout
    inference for sm_90, the lowering of that dialect and the shared-memory check. What
    is left for the GPU: LLVM/PTX code generation, ptxas, and running it. q_cols: Q's
    first columns from registers (q_register_cols; at head dim 64 all of them); negative:
    as many, with kv_multicast."""
    config = dataclasses.replace(
        default_mosaic_config(head_dim),
        p_in_registers=p_in_registers,
        rescale_before_turn=rescale_early,
        early_k_wait=rescale_early,
        intra_overlap=overlap,
        persistent=persistent,
        q_register_cols=abs(q_cols),
        kv_multicast=q_cols < 0,
        named_turns=not overlap,  # the default's, where the schedule has turns to hand over
        rescale_slack=None if overlap else default_mosaic_config(head_dim).rescale_slack,
    )
    assert "mosaic_gpu" in _lowered(head_dim, config, spec, dtype)


@pytest.mark.extended
@pytest.mark.parametrize("persistent", [False, True], ids=["one-cta-per-tile", "persistent"])
@pytest.mark.parametrize("head_dim,causal", [(64, True), (128, False), (256, False)])
def test_named_barriers_lower_for_hopper(head_dim, causal, persistent):
    """named_turns and named_releases lowered for sm_90: the turns are `bar.arrive` /
    `bar.sync` of the two consumers (256 threads) on hardware named barriers, and a step
    then waits on two mbarriers (K and V) where the default's waits on four; the slot
    releases are arrivals of 384 threads (both consumers and the producer's sync)."""
    from benchmarks import lowered_ops

    spec = masks.MaskSpec(causal=causal)
    # One CTA per tile: without what the 1024-key rows carry that needs the persistent grid.
    without = {} if persistent else WITHOUT_PERSISTENT
    default = dataclasses.replace(
        default_mosaic_config(head_dim, 1024, causal), persistent=persistent, **without
    )
    waits = {}
    for turns, releases in ((False, False), (True, False), (False, True), (True, True)):
        config = dataclasses.replace(default, named_turns=turns, named_releases=releases)
        (module,) = lowered_ops.forward_modules(config, spec, head_dim, 1024)
        steps = lowered_ops.step_ops(module)
        assert steps
        waits[turns, releases] = {step["nvvm.mbarrier.try_wait.parity"] for step in steps}
        text = lowered_ops.module_text(module)
        assert ("bar.arrive $0, 256;" in text and "bar.sync $0, 256;" in text) is turns
        assert ("bar.arrive $0, 384;" in text and "bar.sync $0, 384;" in text) is releases
    assert waits == {(False, False): {4}, (True, False): {2}, (False, True): {4}, (True, True): {2}}


@pytest.mark.parametrize(
    "head_dim", [pytest.param(128, marks=pytest.mark.extended), 256], ids=["h128", "h256"]
)
def test_early_q_load_lowers_for_hopper(head_dim):
    """o_from_registers and early_q_load lowered for sm_90 on the persistent default row:
    O leaves by global stores, no TMA store (only the logsumexp's bulk store is left to
    commit), and the next Q's TMA load is issued in each of the tile loops' steps (three
    loops: masked, full, masked) as well as at the start and, for items with no key
    tile, in the epilogue."""
    from benchmarks import lowered_ops

    spec = masks.MaskSpec()
    # The row without the early load (head dim 128's 1024-key row has it by default).
    row = dataclasses.replace(
        default_mosaic_config(head_dim, 1024, False), persistent=True, early_q_load=False
    )
    counts = {}
    for flags in ({}, {"o_from_registers": True}, {"o_from_registers": True, "early_q_load": True}):
        (module,) = lowered_ops.forward_modules(
            dataclasses.replace(row, **flags), spec, head_dim, 1024
        )
        text = lowered_ops.module_text(module)
        counts[tuple(flags)] = tuple(
            text.count(op)
            for op in (
                "nvvm.cp.async.bulk.tensor.global.shared.cta",  # TMA stores
                "nvvm.cp.async.bulk.commit.group",
                "nvvm.cp.async.bulk.tensor.shared.cluster.global",  # TMA loads
            )
        )
    plain, registers, early = counts.values()
    assert plain[:2] == (1, 2) and registers[:2] == (0, 1) and early[:2] == (0, 1)
    assert registers[2] == plain[2] and early[2] == plain[2] + 3


@pytest.mark.parametrize("schedule", ["", "overlap", "persistent", "row-mask-window"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_compiled_kernel_with_segment_ids_lowers_for_hopper(head_dim, schedule):
    """Segment ids on the compiled path (P in registers): their TMA copies, barriers and
    row/column layouts lower for sm_90; with row_bound_mask, its per-row bounds (both
    ends: a window) broadcast over the tile as well."""
    spec = masks.MaskSpec(causal=True, segments=True)
    config = default_mosaic_config(head_dim)
    if schedule == "overlap":
        config = _overlapped(config)
    elif schedule == "persistent":
        config = dataclasses.replace(config, persistent=True)
    elif schedule == "row-mask-window":
        spec = masks.MaskSpec(bottom_right=True, local_window=(100, 20), segments=True)
        config = dataclasses.replace(config, row_bound_mask=True)
    assert "mosaic_gpu" in _lowered(head_dim, config, spec)


BACKWARD_LOWERINGS = {
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
@pytest.mark.parametrize(
    "head_dim,dtype,spec", BACKWARD_LOWERINGS.values(), ids=BACKWARD_LOWERINGS.keys()
)
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

    text = _lowered(head_dim, config, spec, dtype)
    for name in ("pallas_flash_mosaic_bwd_dkdv", "pallas_flash_mosaic_bwd_dq"):
        assert name in text


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_compiled_kernels_with_segment_ids_lower_for_hopper(head_dim):
    """Segment ids in both backward kernels, operands in registers: the ids' TMA copies,
    barriers and row/column layouts lower for sm_90 (the dK/dV split at 256 included)."""
    spec = masks.MaskSpec(causal=True, segments=True)
    text = _lowered(head_dim, pair_mosaic_bwd_config(head_dim), spec)
    for name in ("pallas_flash_mosaic_bwd_dkdv", "pallas_flash_mosaic_bwd_dq"):
        assert name in text


@pytest.mark.parametrize("fused", [False, True], ids=["pair", "fused"])
@pytest.mark.parametrize("spec", [BACKWARD_LOWERINGS["h64-bf16-window"][2], "causal-segments"])
def test_row_bound_mask_lowers_for_hopper(spec, fused):
    """row_bound_mask's per-query bounds lower for sm_90 in each kernel: along the
    columns of S^T in the dK/dV (and fused) kernel, the rows of S in the dQ kernel; with
    a window's two ends, or causal with segment ids."""
    if spec == "causal-segments":
        spec = masks.MaskSpec(causal=True, segments=True)
    config = FUSED_ROWS if fused else pair_mosaic_bwd_config(64)
    config = dataclasses.replace(config, row_bound_mask=True)
    text = _lowered(64, config, spec)
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
    # The head-dim-64 causal default's bands of 4 heads in the plain launch order (the
    # default there until 78baa53, which launches from the last span down).
    "h64-default-causal-plain-order": (
        64,
        dataclasses.replace(
            default_mosaic_bwd_config(64, True), rotated_adds=False, high_spans_first=False
        ),
        False,
    ),
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
    # Head dim 64 with 64-row query tiles, the share's columns split (FUSED_NARROW), as
    # it is timed (NARROW_CANDIDATE).
    "h64-narrow-share-segments": (64, FUSED_NARROW, True),
    "h64-narrow-share-candidate": (64, NARROW_CANDIDATE, False),
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
    text = _lowered(head_dim, config, spec)
    assert "pallas_flash_mosaic_bwd_fused" in text
    assert "pallas_flash_mosaic_bwd_dq" not in text and "pallas_flash_mosaic_bwd_dkdv" not in text


@pytest.mark.parametrize(
    "head_dim,causal,segments",
    [
        (64, False, False),
        (64, True, True),
        (96, False, True),
        (128, False, False),
        (128, True, True),
    ],
    ids=["h64", "h64-causal-segments", "h96-segments", "h128", "h128-causal-segments"],
)
def test_default_fused_backward_lowers_for_hopper(head_dim, causal, segments):
    """The default at padded head dims 64 and 128 (the fused kernel in FA3's order, its
    share whole, two writer warps; causal in bands of heads, at 64 launched from the
    last span down) lowers for sm_90 on CPU, register operands included, which
    interpret mode drops (fa3_order): one kernel, no dQ kernel."""
    config = default_mosaic_bwd_config(head_dim, causal)
    assert config.fused and config.fa3_order and config.split_writer
    spec = masks.MaskSpec(causal=causal, segments=segments)
    text = _lowered(head_dim, config, spec)
    assert "pallas_flash_mosaic_bwd_fused" in text
    assert "pallas_flash_mosaic_bwd_dq" not in text

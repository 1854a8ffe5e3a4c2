"""Tile and pipeline configs of the Mosaic GPU (Hopper) backward kernels, with their
evidence (the forward's: mosaic/config.py).

Backward default table (`MosaicBwdConfig`; one CTA has `consumers` compute warpgroups
and a TMA producer; shared memory from `smem_bytes_*`, operands in registers):

| head dim | dK/dV: key tiles, rows per Q tile, stages | dQ: query tiles, K/V tile keys, stages    |
|----------|-------------------------------------------|-------------------------------------------|
| 64       | fused: 2 x 64, 128, 2: 201,848 (bound) (1) | none: the fused kernel adds dQ itself |
| 128      | fused: 2 x 64, 64, 2: 217,208 (bound) (1) | none: the fused kernel adds dQ itself |
| 192      | 1 x 64 (split, P^T handed over), 64, 2: 165,968 | 1 x 64, 64, 2: 149,576 bytes |
| 256      | 1 x 64 (split, P^T handed over), 64, 2: 215,120 | 1 x 64, 64, 2: 198,728 bytes |

(1) Causal calls launch its key spans in bands of 4 heads (BWD_CAUSAL_SPAN_BAND), at head
dim 64 from each head's last span down (high_spans_first, BWD_HIGH_SPANS_FIRST_DIMS). The
pair (pair_mosaic_bwd_config) at head dim 64: dK/dV 2 x 64, 128, 3: 137,304 (bound);
dQ 2 x 64, 128, 2: 102,480 (bound).
(Shared memory as Mosaic GPU's lowering reports it, operands in registers, with the
hand-over's 16,400 bytes at 192 and 256 added by `smem_bytes_dkv`'s count; staged
through shared memory, each kernel adds warpgroups x 64 x 64 x 2 bytes, and at 192 and
256 the staged dK/dV kernel keeps the split without the hand-over, whose 16 KiB float32
P^T tile would not fit beside the staging tiles at 256.)

Evidence: at head dim 64, the backward sweep of 12-01 (B=2, T=S=8k; its file was lost
with the device's output) found 128-row Q tiles through three slots in the dK/dV kernel
at 374 / 357 TFLOP/s (full / causal) against 349 / 342 for the old 64-row, two-slot
default; side by side in one process at 06da646
(`results/mosaic-e5ca198/fa-mosaic-bwd64-ab-06da646.jsonl`, impl
`pallas_flash:mosaic/block_q_dkv=64/num_stages_dkv=2` for the old one) it ran 1.05x /
1.08x non-causal at 2k / 16k and 1.02x / 1.06x causal. The same sweep at head dim 128
found nothing beyond noise (at most 1.02x). Otherwise the defaults only (H200, head dim
128, non-causal: backward 417-470 TFLOP/s from seq 2k, 0.87-0.94x cuDNN in the same run,
`fa-mosaic-fa74dc8.jsonl`); chosen by register and shared-memory arithmetic. A dK/dV
warpgroup holds two float32 accumulators of block_kv x head dim (2 * 64 * 128 / 128
threads = 128 registers at head dim 128) plus S^T and dP^T
(block_kv x block_q, 32 registers each at 64 x 64); at head dim 192 and 256 the two
accumulators would need 192 and 256 registers, so there the two warpgroups share one
key tile and split the work, one accumulating dV and the other dK (FA3 splits the head
dim between warpgroups instead and trades P and dS through shared memory). The dK
warpgroup of the split needed P^T as well and recomputed it (S^T = K Q^T and the exp2:
five matmuls a step where four are needed); since 79c9063 the dV warpgroup hands its
float32 P^T over through shared memory (`share_probs`; the same bits, since it was the
same wgmma on the same tiles). Beside the split in one process
(`results/mosaic-e928813/fa-mosaic-256-share-probs.jsonl`; bf16, B x T = 16k, head dim
256) its backward ran 368.7 / 384.7 TFLOP/s against 322.4 / 328.5 non-causal at 4k /
16k and 341.8 / 386.8 against 296.4 / 332.5 causal (1.14-1.17x; cuDNN 353.8 / 356.0
and 329.1 / 376.3). Head dim 192 takes it untimed, having the same split. dQ at head
dim 256 keeps Q and dO of two warpgroups (128 KiB) plus a two-stage K/V ring (128 KiB)
over the 227 KiB budget, hence one warpgroup there.

The fused backward (`fused=True`: one kernel, five matmuls, dQ added in a fixed order by
mosaic/dq_adds.py) is the default at padded head dims 64 and 128, in FA3's order with its
share whole and two writer warps, causal calls in bands of 4 heads (BWD_FUSED_ROWS below
has each row's evidence: at 128 non-causal 1.02-1.05x the pair from 2k, then 0.99-1.06x
the share in halves; at 128 causal 1.00-1.07x the pair; at 64 non-causal 1.14-1.16x
the pair; at 64 causal, in bands, 1.04-1.07x the pair, head-major 0.85x, and launched
from the last span down 1.03-1.05x the bands' plain order); the head dims
above 128 keep the pair. First compiled (77b90a9) it ran
0.64-0.69x the pair (head dim 128, non-causal, seq 512-4k,
`fa-mosaic-fused-77b90a9.jsonl`). It adds to the
dK/dV kernel one dS^T buffer (consumers x block_kv x block_q, 16 KiB at 2 x 64 x 64) and
two float32 dQ-share slots (2 x block_q x head dim x 4, 64 KiB at 64 x 128): at head
dim 128, 2 x 64-key tiles and 64-row query tiles with a two-stage ring, 217,208 bytes
by `smem_bytes_dkv` of the 232,448 (a second dS^T buffer would need 233,592). Each
consumer then holds dK, dV (128 registers at head dim 128) and a 64 x 64 share slice
(32) beside S^T and dP^T (32 each). At head dim 64 the share's 32-column halves would
cut the 128-byte swizzle, so there the consumers split its rows, which needs 128-row
query tiles (`block_q_dkv=128`). Above 128 the accumulators do not fit beside a share.
"""

from __future__ import annotations

import dataclasses

from pallas_flash.mosaic.config import (
    MOSAIC_OVERHEAD,
    padded_head_dim,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicBwdConfig:
    """Backward kernels (mosaic/backward.py): dK/dV over key tiles, then dQ over query tiles.

    dK/dV: one CTA per (key/value head, key span, batch); `consumers_dkv` warpgroups each
    own `block_kv_dkv` keys (K, V resident in shared memory), or with `split_dkv` share
    one key tile, warpgroup 0 accumulating dV and warpgroup 1 dK; a producer streams
    the group's query heads' Q, dO, lse and D tiles of `block_q_dkv` rows through
    `num_stages_dkv` slots.
    dQ: one CTA per (query head, rows, batch); `consumers_dq` warpgroups each own
    `block_q_dq` query rows; a producer streams K and V tiles of `block_kv_dq` keys
    through `num_stages_dq` slots.
    operands_in_registers: P^T, dS^T and dS enter their wgmma from registers, in place
      on the accumulators (FA3's choice); False stages them through shared memory into
      fresh accumulators, the only form GPU interpret mode can run.
    fused: one kernel, no dQ kernel (FA3's five matmuls where the pair does seven): the
      dK/dV kernel also computes each query tile's dQ share dS K and adds it to a
      float32 dQ in a fixed order (a semaphore per query tile); the dQ fields are then
      unused. Each consumer computes its slice of the share (head-dim columns, or rows
      when the columns would be narrower than 64) over the CTA's keys. Off by default:
      on the H200 it is exact and bitwise deterministic, but 0.64-0.69x the pair's speed.
    fa3_order: fused, operands in registers: each step in FlashAttention-3's order
      (dkdv_kernel.fa3_step): the exp2 runs beside dP^T's wgmma, dS^T is stored and
      exchanged while dV's runs, the dQ share and dK queue behind it and the share is
      handed over while dK's runs; otherwise every group of wgmmas is awaited before the
      next work starts (about half the pair's matmul throughput on the H200, docs/mosaic.md).
      Not yet measured, so off.
    row_bound_mask: boundary tiles mask from each query's key bounds against the key
      iota (pipeline.bound_mask), as `MosaicConfig.row_bound_mask` does in the forward,
      in both kernels (and the fused one). Beside the default in one process
      (`results/mosaic-5a15452/fa-mosaic-*-true-rowbound-bwd*.jsonl`; causal, bf16,
      B x T = 16k; fwd+bwd, since the bench's backward is a difference of two
      timings): head dim 64 1.04x and 1.02x at 2k in two runs (305.4 / 294.9, 304.9 /
      297.9 TFLOP/s), 1.00x / 1.00x at 4k; head dim 128 0.96x and 1.03x at 2k, 1.01x
      at 4k. Its dK/dV kernel spills 36 bytes where the default spills 80
      (`ptxas-row-bound.jsonl`). Compiled, 13 of the case table's 30 rows gave the
      default's bits before the call's time ran out (none differed; the other 17 are
      untested compiled: `mosaic-tests-*row-bound*.log`); at 67e6e1c 28 of the 30 (all
      but two head-dim-256 rows), and at 47a46be those two as well (30 of 30,
      `results/mosaic-47a46be/`). Off in the field, on in the default rows at head dims
      64 and 128 (`BWD_ROW_BOUND`). With step_descriptors, the fused kernel in FA3's
      order spills 280 bytes with it, 736 without (`results/mosaic-67e6e1c/`).
    column_blocks: with row_bound_mask, the dQ kernel's boundary tiles (the queries on
      their rows) compare eight key columns at a time, as `MosaicConfig.column_blocks`
      (pipeline._columns_within); the dK/dV and fused kernels have the keys on their
      rows and compare as before. Compiled for the H200 without a GPU, the head-dim-64
      dQ kernel spills nothing where it spilled 12 bytes causal (56 with a window) and
      its masked steps are 10-108 instructions shorter; at head dim 128, 4-8 longer.
      On; not yet timed.
    step_descriptors: the dK/dV (and fused) kernel addresses the buffers that stay in
      place across its loop (the resident K and V tiles, the fused kernel's dS^T tiles)
      through an index offset that is 0 but opaque to the compiler (backward.
      step_operands), so that each step rebuilds their wgmma descriptors (a 64-bit add
      each) rather than the compiler building them all before the loop and holding
      them: at 9f95796 the fused kernel spilled them, 10-18 stack reloads bound for
      R2UR in every step (docs/mosaic.md, "The fused kernel's own SASS"). Lowered on CPU with
      MLIR's loop-invariant code motion standing in for LLVM's (`python -m
      benchmarks.lowered_ops --kernel backward --head-dim 128 --live-ins --base
      fused=true fa3_order=true --set step_descriptors=true`), each fused step reads 32
      64-bit values made before the loop, none with this on (the pair's dK/dV steps: 16,
      none). Compiled at 7d3f60f (`results/mosaic-7d3f60f/`; head dim 128 causal):
      the fused kernel in FA3's order spills 736 bytes where it spilled 1,276, and its
      unmasked step (618 instructions) reads nothing from the stack where it read 36
      values; its masked steps still reload 32-50 (the mask's iotas and bounds, which
      the compiler also holds across the loop) and ptxas still serializes its wgmmas
      (C7512). Timed beside the default (bf16, B x T = 16k, backward TFLOP/s), fused in
      FA3's order: 351.3 -> 399.8 and 388.9 -> 433.1 at 2k / 8k non-causal (1.14x /
      1.11x), 198.4 -> 232.7 and 228.2 -> 270.5 causal (1.17x / 1.19x); still below
      the pair (410.2 / 457.0 non-causal), which it leaves where it was (1.00x / 1.01x
      non-causal, 0.97x / 1.00x causal, though its dK/dV kernel spills 16 bytes where
      it spilled 80). Compiled, the fused kernel's gradients are bitwise the same with
      and without it on all 25 of its case-table rows (at 67e6e1c and 47a46be,
      `results/mosaic-*/mosaic-tests-*step-desc*.log`). What the spills bought back
      ptxas takes elsewhere: with it, every one of the fused kernel's 192 wgmmas is its
      own group, awaited before the next is issued (C7512; `python -m benchmarks.ptxas
      --read FILE.sass`, wgmma_groups). Without it they are too, but for one build: causal
      with tile_mask, where they ran in 36 groups (9f95796, and again at b4a8ae2) and that
      build was the slowest (`results/mosaic-b4a8ae2/tile-mask/`).
    query_rows: fused: each step in FlashAttention-3's orientation, the queries on the
      rows (dkdv_kernel.rows_step): S = Q K^T and dP = dO V^T rather than their transposes,
      so that a thread holds 2 of the row statistics lse and D where a column's took 16
      (32 registers in all); P and then dS pass through the consumer's dS tile in shared
      memory into dV = P^T dO and dK = dS^T Q (no wgmma operand in registers, no staging
      buffer), dS computed beside dV's wgmma; the dQ share reads dS in place. Meant to
      take the consumers under the registers at which ptxas serializes every wgmma of
      the S^T step (C7512, docs/mosaic.md). Checked in GPU interpret mode (the reference, no
      data race); lowered for sm_90 on CPU; compiled on the H200 at c864512 it passes
      its 25 reference rows but still serializes every wgmma (C7512, 624 bytes of
      spills) and runs its backward at 0.59x / 0.58x the pair's (head dim 128 causal
      2k / 8k, `results/mosaic-c864512/`), so off. Since held_zero it compiles (for
      the H200, here, at 1debc37, with step_descriptors and the writer warps) to 36
      wgmma groups, no serialization, 188 / 208 bytes of spill stores non-causal /
      causal kept out of its unmasked steps, which issue 498 instructions against the
      fused default's 556 (docs/mosaic.md, "Queries on the rows, again"). Timed so
      (with the whole share's build, `$M/fused/fa3_order=false/share_halves=false/
      query_rows=true`) beside the defaults in one process: head dim 128, 8k, on the
      H200, causal 469.7 TFLOP/s against the pair's 447.8 (1.05x; cuDNN 461.4),
      non-causal 492.0 against the halves' 477.9 and the whole share's 505.3
      (results/mosaic-f6435c2/); causal at 2k / 4k / 16k, on an H100, 351.2 / 404.6 /
      480.0 against the pair's 356.7 / 421.6 / 487.4 (0.98x / 0.96x / 0.98x;
      results/mosaic-d044a97/fa-mosaic-128-true-rows-lengths.jsonl). Compiled, the
      reference's tolerance on the 7 of its padded-head-dim-128 rows that ran (of 11;
      results/mosaic-d044a97/mosaic-tests-call7.log). Off: ahead at one length only.
    share_probs: split_dkv: the dV warpgroup hands its float32 P^T to the dK warpgroup
      through shared memory (one tile, a barrier each way), so that the dK warpgroup
      computes dP^T alone where it recomputed S^T = K Q^T and the exp2 as well: four
      matmuls a step where the split did five. The dK warpgroup's P^T was the same
      wgmma on the same tiles, so the gradients keep their bits.
    split_dq: the dQ kernel's two warpgroups share one query tile of `block_q_dq` rows
      instead of owning one each: warpgroup 0 computes S and P (and masks), warpgroup 1
      dP and, from warpgroup 0's float32 P (through shared memory), dS, which it stores
      for both; each then accumulates half of dQ's head-dim columns, dS K. The steps are
      pipelined: each warpgroup issues the next tile's S (or dP) beside the last tile's
      dS K, so that the tensor cores have work while the exp2 and dS run. For head dims
      above 128, where two warpgroups' Q and dO tiles beside the K/V ring do not fit and
      the dQ kernel otherwise runs one warpgroup, which overlaps nothing with its own
      matmuls (head dims with whole 64-column halves: multiples of 128). Checked in GPU
      interpret mode (the reference, no data race) and lowered for sm_90 on CPU.
      Compiled at 19797c5 it passed the benchmark's check against the float32 reference
      and its backward ran 372.0 TFLOP/s against the default's 374.0 at head dim 256
      non-causal 8k (0.99x; `results/mosaic-19797c5/fa-mosaic-256-regs.jsonl`): the one
      dQ warpgroup is not what head dim 256's backward waits on. Off; its compiled
      tests have not run.
    q_do_in_registers: the dQ kernel loads its query tile's Q and dO into registers once
      and S = Q K^T and dP = dO V^T take them as the wgmma A operand from there: a wgmma
      at N = 64 with both operands in shared memory reads 4 KiB per 32 tensor-core
      cycles, all of an SM's 128 bytes a cycle; with A in registers half that. Costs
      block_q_dq x head dim / 128 registers a thread (both tiles, 16-bit), so up to head
      dim 128 with 64-row tiles. Not with split_dq or fused (no such dQ kernel). At
      19797c5, with q_register_cols=64 in the forward, backward TFLOP/s at non-causal
      8k (bf16, B x T = 16k) 373.8 / 462.6 against the default's 364.9 / 456.9 at head
      dims 64 / 128 (1.02x / 1.01x; cuDNN 429.4 / 514.7); no spills. On in the default
      rows of head dims 64-128 since 5173ae3 (BWD_Q_DO_IN_REGISTERS has the evidence).
    k_v_in_registers: the same in the dK/dV kernel for its resident K and V (the A
      operands of S^T = K Q^T and dP^T = V dO^T): block_kv_dkv x head dim / 128
      registers a thread beside dK and dV, so head dim 64. Not with split_dkv or fused.
      At 19797c5 ptxas spills 128 bytes and serializes the dK/dV kernel's wgmmas
      (C7512) with it at head dim 64, and its backward ran 342.9 TFLOP/s against the
      default's 364.9 (0.94x, non-causal 8k), so it stays off. This and
      q_do_in_registers are compiled only: GPU interpret mode's wgmma reads A from
      shared memory, and there both are off.
    solo_dq_registers: with one dQ warpgroup (consumers_dq=1, the default at head dims
      192-256), it takes SOLO_CONSUMER_REGISTERS (256) rather than the 232 two consumers
      share out: at 19797c5 ptxas spilled 608 bytes in that kernel at head dim 256
      (`results/mosaic-19797c5/ptxas-operands-in-registers.jsonl`). On in the default
      rows of head dims 192-256 since 5173ae3: backward 1.05-1.08x, the same bits
      (BWD_SOLO_DQ_REGISTERS has the evidence).
    dq_kv_multicast: the dQ kernel's CTAs run in clusters of two on adjacent query tiles
      that walk one key range and load each K/V tile once for both by TMA multicast (as
      `MosaicConfig.kv_multicast` in the forward). Checked in GPU interpret mode and
      lowered for sm_90 on CPU.
    dkdv_q_multicast: the same for the dK/dV kernel: clusters of two CTAs on adjacent key
      spans walk one query range (both spans'), and each Q and dO tile is loaded once
      for both (the row statistics and ids, small, by each CTA). Checked in GPU
      interpret mode and lowered for sm_90 on CPU. Both multicasts compiled at f309273
      (bf16, B x T = 16k; results/mosaic-f309273/fa-mosaic-*-mc.jsonl; one variant with
      both, beside the default row), backward TFLOP/s with against without: 8k
      non-causal 372.2 / 367.5, 463.5 / 458.9 and 385.3 / 379.8 at head dims 64 / 128 /
      256 (1.01x each); with q_do_in_registers too, 16k causal 369.1 / 373.8 (0.99x) and
      474.3 / 469.6 (1.01x) at 64 / 128, 2k causal 273.0 / 295.2 (0.92x) and 367.7 /
      365.4 (1.01x), 2k non-causal at 64 348.0 / 341.7 (1.02x); with solo_dq_registers
      at 256 causal 8k 391.7 / 384.3 (1.02x). Level or worse, so off. Their compiled
      bitwise tests ran on 2 of the 30 case-table rows each (the same bits).
    dq_pingpong: the dQ kernel's two warpgroups take turns at the tensor cores, as the
      forward's do (pipeline.PingPong, on hardware named barriers when compiled): one's
      S and dP are issued, and its P and dS computed, while the other's dS K and next
      S and dP run. Without it both wait on the same K and V tiles, so they tend to
      issue their products together and then both compute elementwise while the tensor
      cores idle. Needs consumers_dq=2 and the plain dQ kernel (not split_dq, not
      fused). Checked in GPU interpret mode (the mbarrier form; the same bits, no data
      race) and lowered for sm_90. Compiled at e17dedb, the default's bits on the 16 of
      its 25 case-table rows that ran before the calls' time ran out (none differed, no
      hang; results/mosaic-e17dedb/mosaic-tests-*dqpp*.log). Timed beside the default
      (bf16, B x T = 16k, non-causal, backward 2k / 8k; fa-mosaic-{64,128}-false-dqpp.
      jsonl): head dim 128 374.6 / 405.7 TFLOP/s against 441.1 / 463.9 (0.85x / 0.87x),
      head dim 64 323.1 / 354.2 against 359.2 / 382.0 (0.90x / 0.93x). Off.
    share_halves: fused (S^T step): each consumer computes its slice of the dQ share in
      two halves of its columns, the first handed to the writer's slot before the second
      is issued, so 16 accumulator registers a thread are in flight where the whole
      slice held 32. Those 32, beside dK, dV, S^T and dP^T, are what tips ptxas into
      serializing every wgmma (C7512): on the dumped PTX a share of half the width
      (`benchmarks.ptx_edit --share half`) leaves it unserialized at 232 registers
      non-causal and at 240 causal (docs/mosaic.md, "The dQ share is what the consumers lack").
      A half is 32 columns, and a wgmma's two operands share one swizzle, so K, Q and
      the dS^T tiles take the 64-byte swizzle (NARROW_SWIZZLE) rather than 128.
      Compiled at 2b60086 with writer_warp, in FA3's order with step_descriptors (head
      dim 128, `results/mosaic-2b60086/`): no C7512 (64 / 276 bytes of spill stores
      non-causal / causal; without writer_warp, at 232 registers, C7512 still), and
      backward 433.3 / 408.3 TFLOP/s at 8k against 442.1 / 397.5 without the two
      (0.98x / 1.03x; the pair 460.1 / 445.5, cuDNN 509.5 / 473.1); 6 of the 25
      compiled reference rows ran, and passed. Off: the serialization was not what
      held the fused kernel back (docs/mosaic.md, "Half shares"); the default at head dim 128
      non-causal took it with the two writer warps from c8bc107 until the whole share
      ran ahead with them (BWD_SHARE_HALVES below). At head
      dim 64 with 64-row query tiles (block_q_dkv=64) the narrow swizzle lets the
      consumers split the share's columns, 32 each (one piece; `dq_part`), where
      without it they need 128-row tiles and split the rows: half the score tiles'
      registers. Lowered for sm_90 and checked in GPU interpret mode (12-04), not yet
      compiled (docs/mosaic.md, "A narrow share at head dim 64").
    writer_warp: fused: the ordered dQ adds (dq_adds.writer) run in one warp of the
      producer's warpgroup, beside the loads in another, instead of in a fourth
      warpgroup: three warpgroups as in FA3's backward, so each consumer gets 240
      registers where it had 232 (WARP_WRITER_CONSUMER_REGISTERS). Built at b4a8ae2
      (compiled: the same bits on 25 of 25 rows, less spilled, still C7512, 0.95x /
      0.96x the fused backward without it at head dim 128 non-causal 2k / 8k) and
      removed at 8d64c73; back for share_halves, which needs 240 causal (timed with
      it at 2b60086, above).
    chained_share: fused, two consumers: neither waits for the other's dS^T. Each
      computes the dQ share over its own key tile only, for the whole query tile, one
      64 x 64 part at a time (32 accumulator registers, as a consumer's slice held);
      consumer 0 hands each part to consumer 1 through shared memory, and consumer 1
      starts its own part's wgmmas from it (its accumulator loaded with consumer 0's
      sum) and hands the total to the writer. So consumer 0 may run up to a step ahead
      of consumer 1 rather than meeting it at every step's dS^T exchange, where both
      then ran their exp2 at once with the tensor cores idle (docs/mosaic.md, "Half shares":
      under Nsight Compute the fused kernel's tensor cores were busy 46 % of the time,
      the pair's dK/dV kernel's, whose consumers never meet, 73 %). Deterministic (the
      same sums in the same order every call) but not the unchained kernel's bits (the
      share's terms are added in another order). Its shared memory: consumer 0's
      parts (one step) and one writer slot, where the unchained kernel has two writer
      slots; K keeps its 128-byte swizzle (a part is 64 columns). Checked in GPU
      interpret mode (the reference, no data race) and lowered for sm_90 on CPU.
      Compiled at c1517e4 it passed the reference on the 15 of its 25 table rows
      that ran (`results/mosaic-c1517e4/mosaic-tests-chained.log`), and ran the
      backward at 0.93x the unchained kernel with share_halves at head dim 128
      non-causal 8k (400.2 against 431.4 TFLOP/s, docs/mosaic.md, "What the fused kernel's
      dQ costs"): off.
    rotated_adds: fused: the ordered dQ adds go in the order the visitors arrive
      when every CTA runs at one pace, so no turn is waited for. Each CTA walks its
      query tiles upward, and a tile's adds go in decreasing key span: under a causal
      (or sliding) mask the span above reached the tile steps earlier. Where every
      span of a batch element has one query range (no mask), each walks its unmasked
      tiles rotated by its index among the spans, and a tile's turns go round from
      the span that reached it first (`dq_adds.turn`). The plain order waits at every
      tile for each span below (all of a head arrive together): at head dim 128 8k
      the backward without its turns (wrong sums) runs 1.07x non-causal and 1.13x
      causal (docs/mosaic.md, "What the fused kernel's dQ costs"). A span may wait on a span
      of higher index, so the grid is laid out with a head's spans launched
      together, and a head may have at most as many key spans as the GPU has SMs
      (ValueError above that).
      Deterministic: the same order every call, not the plain order's bits.
      Compiled at af0f5db (share_halves, writer_warp, FA3's order, step_descriptors)
      it passed the benchmark's reference check and the 10 of 25 compiled table rows
      that ran, and ran the backward at 0.96x / 0.94x the plain order at head dim 128 8k
      non-causal / causal (407.0 / 390.8 against 425.9 / 414.5 TFLOP/s, docs/mosaic.md, "Turns
      in arrival order"): off.
    high_spans_first: rotated_adds launched the other way round: each head's key spans
      from the last down (the grid's span axis reversed) and no rotated walk (no
      ring), so at every query tile the adds go in decreasing span order and each
      span waits only on CTAs launched before it. A head's spans then need not be
      resident together (any number of spans; span_band applies). Under a causal
      mask the spans' query ranges end together, so walking upward the span above
      reaches each tile steps before the one below and every turn is due on arrival,
      where the plain order's spans (walking down) reach a tile at one step and queue
      down the spans (dq_adds' module doc). The launch model with the adds' turns
      (`benchmarks.launch_sim --add-steps 1`, head dim 64 causal, bands of 4) puts the
      fill at 0.89 / 0.92 / 0.94 / 0.95 at 2k / 4k / 8k / 16k against the plain
      order's 0.84-0.85; at head dim 128 (A = 0.5) at 0.92-0.94 against 0.96-0.99,
      since the longest spans now launch last and the grid ends less evenly. Without
      a mask it is the plain order walked upward (every span reaches a tile at one
      step). Deterministic: the same order every call, not the plain order's bits.
      GPU interpret mode runs the CTAs in grid order, which is the adds' order here,
      so it checks the sums bit for bit. Compiled at 4c2c14e on an H100: 14 of 14
      causal case-table rows (the reference, two calls the same bits); timed there
      beside the plain order, 1.005x / 0.964x / 0.996x / 1.016x at head dim 64 causal
      2k / 4k / 8k / 16k and 0.75x / 0.79x / 0.83x at 128 causal 4k / 8k / 16k, where
      the model said 1.06-1.14x and 0.95x. That build's steps carried the rotated
      walk's index arithmetic (8-9 % more instructions); since c268693 it walks
      plainly upward, its step loops the plain order's to the instruction, and at
      78baa53 (an H100) it ran 1.03-1.05x the plain order at head dim 64 causal 2k-16k
      in three processes, 0.85-0.93x at 128 causal 8k / 16k. With the writer's turn
      waits taken out of both (wrong sums) the plain order gains 9-10 % at 64 causal
      and this order 1 %, so its turns are nearly free, while at 128 it stays
      0.79-0.86x: its walk is what loses there. In the head-dim-64 causal default since
      (BWD_HIGH_SPANS_FIRST_DIMS), where a band fits high_first_bytes; off at 128
      (docs/mosaic.md, "The spans launched from the last down").
    span_band: the dK/dV (or fused) kernel's launch order, in bands of this many
      key/value heads (the largest divisor of the kernel's head count not above it):
      a band's first key span of every (head, batch element), then every second
      one, then the next band. 1 (the default) is the plain order, a head's spans
      one after another, head by head; the head count (or more) launches every
      head's first span before any second one (the 44th session's `span_major`). The
      CTAs are the same, and the fused kernel's adds keep their order (a span still
      waits on lower spans of its own head, launched before it), so the same bits.
      Under a causal mask a head's first spans walk the most query tiles, so the
      plain order launches the last head's longest spans last; but the CTAs before
      them are still running too, and the launch model (benchmarks/launch_sim.py)
      puts the tail this leaves at 0.5 % at head dim 128 16k (fill 0.995; in bands
      of 2, 0.998), so a band's case rests on the fused kernel's chains of dQ turns
      (a few spans of each of a band's heads resident, not all of one head's).
      Against it: a head's Q, dO (and the fused kernel's float32 dQ) are shared in
      L2 by the resident CTAs of fewer spans, so a band wide enough to hold many
      (head, batch element) pairs streams them from HBM (every head at once at 4k:
      64 pairs, about 128 MB of them in flight against 50 MB of L2). Every head at
      once, on an H100 at c8a6ae2 (results/mosaic-c8a6ae2): 1.013x / 1.00x / 0.73x
      the plain order at head dim 128 causal 16k / 8k / 4k, and 0.995x / 0.92x /
      0.93x at 64 (docs/mosaic.md, "Launch order of the backward's key spans").
      Without a mask, at head dim 128 8k / 16k, bands of 4 ran 1.014x / 0.949x the
      plain order (an H100 at e6ab66d, fa-mosaic-128-false-bwd-split-2.jsonl there).
      Checked in GPU interpret mode (the same bits); not with rotated_adds (whose
      turns need a head's spans resident together) unless high_spans_first. 4 in the
      causal fused rows (BWD_CAUSAL_SPAN_BAND: 1.004-1.027x the plain order at head
      dim 128 4k-16k on an H100, at 64 1.04-1.07x the pair where the plain order ran
      0.85x), else 1.
    band_pairs: the most (key/value head, batch element) pairs one band of span_band may
      hold: the band narrows (to one head at least) where span_band heads of the call's
      batch would hold more. Every timing so far had 16k tokens a batch, so a band of g
      heads held g x 16k / T pairs: those of 64 or more ran slower than narrower ones
      (every head at once, head dim 128 causal 4k, 64 pairs: 0.73x the plain order;
      at 64, 8k and 4k, 64 and 128 pairs: 0.92x / 0.93x; bands of 8 at 64 causal 2k,
      64 pairs: 0.93x bands of 4, which hold 32), those of 32 or fewer not (bands of 8
      at 64 causal 4k, 32 pairs: 1.008x bands of 4). 32, so that the default's bands
      of 4 are whole at 16k tokens from 2k and narrow for a larger batch (at 2k with
      64k tokens, 32 elements: one head, the plain order's own 32 pairs). Timed there
      at 4c2c14e on an H100: whole bands of 4 (band_pairs=128) ran 0.64x / 0.67x the
      default at head dims 128 / 64 causal 2k (128 pairs) and 0.73x at 128 causal 4k
      (64 pairs) (docs/mosaic.md, "Launch order of the backward's key spans").
    high_first_bytes: high_spans_first applies where one band's query-side tiles, the Q
      and dO (2 bytes a value) and float32 dQ (4) of its heads' query heads and batch
      elements, take at most this many bytes; a call whose band takes more launches in
      narrower bands, of the most whole heads that fit (`launched`: span_band; the same
      bits), and one where a single head takes more, in the plain order (rotated_adds
      and high_spans_first off for it), since each of its spans walks up from its own
      diagonal, so a query tile is read by the spans of its head over the whole of the
      head's walk rather than at about one step, and a band that does not fit in the L2
      is fetched from HBM many times over: the launch model's least-recently-used 50 MiB
      L2 (`benchmarks.launch_sim --add-steps 1 --l2`, l2_rereads) puts head dim 64
      causal bands of 4 at 16k tokens (32 MiB) at one fetch a tile and at 32k or 64k
      tokens (64-128 MiB) at 12-55, and at head dim 128 causal 16k tokens (64 MiB) at
      7-21 where the plain order's stays at 1.74; there high_spans_first ran 0.85-0.93x
      the plain order (docs/mosaic.md, "The spans launched from the last down"). 32 MiB:
      the head-dim-64 causal default's bands of 4 at the grid's 16k tokens, where it was
      timed. At 64k tokens (8 x 8k, 4 x 16k) forced bands of 4 (128 MiB) ran 0.64x the
      plain order, bands of one head (32 MiB) 1.014x / 1.017x (at 2a56c3a on an H100,
      results/mosaic-2a56c3a/). The plain order's own spans read a tile at about one
      step, so it needs no such bound.
    split_tail: the dK/dV (or fused) kernel's last wave (when the GPU's SMs do not divide
      its CTAs) split by query tiles over every SM (mosaic/split_tail.py, even_pieces):
      the whole CTAs run in the plain launch order on a grid of one axis, then each CTA
      of the last wave as m pieces, each a CTA over about 1/m of its span's query tiles
      (the walk's ranges clamped to them; m chosen so that the pieces' waves end
      soonest), its dK and dV (float32) written apart and summed after the kernel in a
      fixed order. Each query
      tile still takes one dQ add from each span, from whichever piece holds it, in the
      same turns. At 16k tokens a batch every non-causal grid point has 2048 or 4096
      CTAs on 132 SMs, a fill of 0.970 (benchmarks/launch_sim.py). The same result up
      to float32 rounding of dK and dV (dQ's adds are unchanged), the same bits from
      call to call. By the launch model it fills 0.987-0.998 at head dim 128 and
      0.993-1.000 at 64 without a mask, against 0.970, but less than the plain grid
      under a causal mask (whose last CTAs are its shortest): for non-causal calls.
      With span_band the whole CTAs run in the bands' order, the pieces after them
      (the same turns: a tile's adds still go in increasing span). Not with
      rotated_adds or dkdv_q_multicast. Checked in GPU interpret
      mode (5 pretend SMs: the reference, dQ bit for bit, dK and dV within float32
      sums); compiles for sm_90 (the fused kernel spills 36 / 96 B at head dim 64, 152
      / 220 at 128; the default 20 / 68 and 132 / 220). Compiled on an H100 at
      e6ab66d, the reference and the plain grid on the default rows, plain and in
      bands (results/mosaic-e6ab66d/mosaic-tests.log, 6 of 6). Timed there at head
      dim 128 non-causal, four processes with 00676b3's (fa-mosaic-128-false-bwd-
      split*.jsonl): 0.992-1.039x the default at 4k, 0.997-1.029x at 8k and
      0.992-1.021x at 16k; in bands of 4 0.979x / 0.995x / 0.988x at 4k / 8k / 16k
      and 1.006x / 0.939x at 8k / 16k (launch_sim's 0.981 / 0.988 against 0.947 /
      0.951 did not show). No steady lead: off.
    split_writer: fused, writer_warp: the ordered adds in two warps of the
      producer's warpgroup (two of its warps idled), one a writer slot, so the adds
      of one step wait for their turn and land while the next step's go out. One
      writer takes a slot's share, waits its turn, sends the TMA reduce, waits for
      it to be read and then to land, and hands the turn on before it takes the next
      slot; left out by a diagnostic build, the adds cost 0.80 ms of the fused
      backward's 6.37 at head dim 128 8k and the consumers wait on the slots (docs/mosaic.md,
      "What the fused kernel's dQ costs"). The same adds in the same order: the same
      bits. Checked in GPU interpret mode (the reference, the race detector) and
      lowered for sm_90 on CPU; compiled at 9651b8e, one writer's bits on the 11 of 25
      table rows that ran, and 1.02-1.05x the pair at head dim 128 non-causal, where
      it is in the default since c8bc107 (BWD_FUSED_ROWS below; docs/mosaic.md, "Two writer
      warps").
    held_zero: the backward kernels' fresh wgmma accumulators (S^T and dP^T, S and
      dP, the fused kernel's dQ share) start from one zero computed before their loops
      (pipeline.held_zero), not from run_scoped's constant zeros, so that ptxas issues
      their first wgmmas without reading an accumulator in every step, rather than
      zeroing 32-64 registers with a move each in most steps. The same zeros: the same
      gradients. Compiled for the H200 without a GPU (docs/mosaic.md, "Zeros held across the
      loop"): the head-dim-64 pair's unmasked steps issue 470 / 378 instructions (dK/dV
      / dQ kernel) against 533 / 441, the fused default's at head dim 128 556 against
      594, and the 128-row fused candidate at head dim 64 without step descriptors is no
      longer serialized (36 wgmma groups against 192). GPU interpret mode runs it off
      (its accumulators cannot be stored into). On: timed at 1d6a8bd beside the same
      rows without it, 1.05x / 1.09x at head dim 64 non-causal 2k / 8k, 1.00x / 1.06x
      causal, 1.01x / 1.03x at head dim 128 non-causal (the fused default); the same
      bits on all 30 compiled table rows.
    probs_before_dp: the pair's kernels (and the fused kernel's plain order) await a
      step's S (S^T) alone and make P from it before they await dP (dP^T), where they
      awaited both together, so some of the exp2 runs while dP is on the tensor cores
      (pipeline.wgmma_products with `first`; FA3's order does so already). The same
      arithmetic: the same bits. Compiled for the H200 without a GPU (docs/mosaic.md,
      "Scores' exp2 beside dP"), the head-dim-64 dQ kernel's unmasked step issues its 64
      FFMAs and 16 of its 64 exp2 between the two waits, the dK/dV kernel's about 30 and
      9 (ptxas places the second wait; an optimisation barrier on P changed none of it),
      with the same instruction counts; at head dim 128 causal 31 / 41 in the unmasked steps. The
      dK/dV split's share_probs (head dims 192-256 by default) takes P^T from the other
      warpgroup and keeps its own order; there it moves the dQ kernel's wait only. Not
      with query_rows or fa3_order (steps of their own). Timed in the pair at 0e8a8d2
      (an H100): 1.00-1.07x at head dims 64 and 128, 2k and 8k; no default row at those
      head dims takes the pair, and at 256 (the pair's) it is not yet timed. Off.
    early_lse: the dK/dV (or fused) kernel reads each step's lse from shared memory
      before it issues the step's scores wgmma, where it read it after awaiting S^T
      (ptxas keeps such loads behind the wgmma wait, so the first exp2 argument waited
      on them: in the fused default's Nsight Compute source profile at head dim 128
      non-causal 8k, an H100, 11 % of a consumer's step samples sat on those FFMAs'
      short-scoreboard stalls, docs/mosaic.md, "Where the consumers wait"). The same
      values: the same bits. Costs 16 registers held across the issue: compiled for the
      H200 without a GPU, the head-dim-128 non-causal fused step issues the 8 loads
      among the S^T wgmmas, 517 instructions against 509, no stack access in its
      unmasked steps; at head dim 64 and at 128 causal it spills into them. Timed on
      the H200 at 74e1a14: 1.034-1.060x the row without it at head dim 256 (the pair's
      dV warpgroup), 4k and 16k, causal and not, where it is in the default since
      (BWD_EARLY_LSE_DIMS); at head dim 128 (the fused default) 0.995-1.025x, off.
    """

    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    num_stages_dkv: int = 2
    consumers_dkv: int = 2
    split_dkv: bool = False
    block_q_dq: int = 64
    block_kv_dq: int = 64
    num_stages_dq: int = 2
    consumers_dq: int = 2
    operands_in_registers: bool = True
    fused: bool = False
    fa3_order: bool = False
    row_bound_mask: bool = False
    column_blocks: bool = True
    step_descriptors: bool = False
    query_rows: bool = False
    share_probs: bool = False
    split_dq: bool = False
    q_do_in_registers: bool = False
    k_v_in_registers: bool = False
    solo_dq_registers: bool = False
    dq_kv_multicast: bool = False
    dkdv_q_multicast: bool = False
    dq_pingpong: bool = False
    share_halves: bool = False
    writer_warp: bool = False
    chained_share: bool = False
    rotated_adds: bool = False
    high_spans_first: bool = False
    split_writer: bool = False
    span_band: int = 1
    band_pairs: int = 32
    high_first_bytes: int = 32 * 2**20
    split_tail: bool = False
    held_zero: bool = True
    probs_before_dp: bool = False
    early_lse: bool = False

    def __post_init__(self):
        for name in ("block_q_dkv", "block_kv_dkv", "block_q_dq", "block_kv_dq"):
            value = getattr(self, name)
            if value % 64 or not 64 <= value <= 256:
                raise ValueError(f"{name}={value} must be 64, 128, 192 or 256")
        for name in ("num_stages_dkv", "num_stages_dq"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("consumers_dkv", "consumers_dq"):
            if getattr(self, name) not in (1, 2):
                raise ValueError(f"{name}={getattr(self, name)} must be 1 or 2")
        if self.split_dkv and self.consumers_dkv != 2:
            raise ValueError(f"split_dkv needs consumers_dkv=2, not {self.consumers_dkv}")
        if self.share_probs and not self.split_dkv:
            raise ValueError(
                "share_probs hands P^T from the dV warpgroup to the dK one: it needs split_dkv=True"
            )
        if self.split_dq and self.consumers_dq != 2:
            raise ValueError(f"split_dq needs consumers_dq=2, not {self.consumers_dq}")
        if self.q_do_in_registers and (self.split_dq or self.fused):
            raise ValueError(
                "q_do_in_registers is the plain dQ kernel's: not with split_dq or fused"
            )
        if self.k_v_in_registers and (self.split_dkv or self.fused):
            raise ValueError(
                "k_v_in_registers is the plain dK/dV kernel's: not with split_dkv or fused"
            )
        if self.solo_dq_registers and (self.consumers_dq != 1 or self.fused):
            raise ValueError(
                "solo_dq_registers gives one dQ warpgroup all its registers: it needs "
                f"consumers_dq=1 (not {self.consumers_dq}) and a dQ kernel (not fused)"
            )
        if self.dkdv_q_multicast and self.fused:
            raise ValueError(
                "dkdv_q_multicast is the pair's dK/dV kernel's: not with fused (whose dQ "
                "order follows each key span's own query tiles)"
            )
        if self.dq_kv_multicast and self.fused:
            raise ValueError("dq_kv_multicast is the dQ kernel's: not with fused (no dQ kernel)")
        if self.dq_pingpong and (self.consumers_dq != 2 or self.split_dq or self.fused):
            raise ValueError(
                "dq_pingpong takes turns between the plain dQ kernel's two warpgroups: it "
                f"needs consumers_dq=2 (not {self.consumers_dq}), not split_dq, not fused"
            )
        if self.fused and self.split_dkv:
            raise ValueError("fused needs split_dkv=False: each consumer owns a key tile")
        if self.query_rows and not self.fused:
            raise ValueError("query_rows orders the fused kernel's step: it needs fused=True")
        if self.probs_before_dp and (self.query_rows or self.fa3_order):
            raise ValueError(
                "probs_before_dp orders the plain S and dP steps: not with query_rows or "
                "fa3_order (whose steps are their own)"
            )
        if self.query_rows and self.fa3_order:
            raise ValueError("query_rows and fa3_order are two orders of the fused step: pick one")
        if self.share_halves and (not self.fused or self.query_rows):
            raise ValueError(
                "share_halves splits the fused kernel's dQ share of the S^T step: it needs "
                "fused=True and not query_rows"
            )
        if self.chained_share and not (
            self.fused and self.consumers_dkv == 2 and not self.query_rows and not self.share_halves
        ):
            raise ValueError(
                "chained_share chains the fused kernel's two consumers: it needs fused=True, "
                "consumers_dkv=2, and neither query_rows nor share_halves"
            )
        if self.rotated_adds and not self.fused:
            raise ValueError("rotated_adds orders the fused kernel's dQ adds: it needs fused=True")
        if self.split_tail and (self.rotated_adds or self.dkdv_q_multicast):
            raise ValueError(
                "split_tail lays the dK/dV grid out in its own order: not with rotated_adds "
                "or dkdv_q_multicast"
            )
        if self.span_band < 1:
            raise ValueError(f"span_band={self.span_band} must be >= 1 (heads per band)")
        if self.band_pairs < 1:
            raise ValueError(
                f"band_pairs={self.band_pairs} must be >= 1 ((head, batch element) pairs a band)"
            )
        if self.high_first_bytes < 1:
            raise ValueError(
                f"high_first_bytes={self.high_first_bytes} must be >= 1 (a band's query-side bytes)"
            )
        if self.high_spans_first and not self.rotated_adds:
            raise ValueError(
                "high_spans_first launches rotated_adds' spans from the last down: it "
                "needs rotated_adds=True"
            )
        if self.rotated_ring and self.span_band != 1:
            raise ValueError(
                "rotated_adds needs a head's key spans launched together: not with "
                f"span_band={self.span_band}, only 1 (or with high_spans_first=True)"
            )
        if self.split_writer and not (self.writer_warp and not self.chained_share):
            raise ValueError(
                "split_writer splits writer_warp's adds between two warps, a writer slot "
                "each: it needs writer_warp=True and not chained_share (one slot)"
            )
        if self.writer_warp and not self.fused:
            raise ValueError("writer_warp places the fused kernel's dQ writer: it needs fused=True")
        if self.fa3_order and not (self.fused and self.operands_in_registers):
            raise ValueError(
                "fa3_order needs fused=True and operands_in_registers=True (it orders the "
                "fused kernel's register-operand wgmmas)"
            )

    def dq_part(self, head_dim: int) -> tuple[int, int]:
        """(rows, columns) of the fused dQ share one consumer computes: the head-dim
        columns split between the consumers where each slice stays a multiple of 64
        (the 128-byte swizzle of K's tiles), else the query rows (wgmma's M is 64), else,
        with share_halves (K's tiles in the 64-byte swizzle), the columns in slices of
        32 (head dim 64 with 64-row query tiles)."""
        c, bq = self.consumers_dkv, self.block_q_dkv
        if head_dim % (64 * c) == 0:
            return bq, head_dim // c
        if bq % (64 * c) == 0:
            return bq // c, head_dim
        if self.share_halves and head_dim % (32 * c) == 0:
            return bq, head_dim // c
        raise ValueError(
            f"fused at head dim {head_dim} with {c} consumers needs block_q_dkv a multiple "
            f"of {64 * c}, not {bq} (or share_halves, whose 32-column slices need a head dim "
            f"a multiple of {32 * c})"
        )

    def share_pieces(self, head_dim: int) -> int:
        """Column pieces a consumer's dQ share is computed in, one after another: with
        share_halves, its slice's 32-column pieces (two of a 64-column slice)."""
        return self.dq_part(head_dim)[1] // 32 if self.share_halves else 1

    @property
    def key_tiles_dkv(self) -> int:
        """Key tiles resident per dK/dV CTA (each of block_kv_dkv keys)."""
        return 1 if self.split_dkv else self.consumers_dkv

    def smem_bytes_dkv(self, head_dim: int, itemsize: int = 2) -> int:
        """Shared memory of the dK/dV kernel at this (padded) head dim (an estimate,
        compared with Mosaic GPU's own check by the CUDA lowering tests)."""
        bq, bk, stages = self.block_q_dkv, self.block_kv_dkv, self.num_stages_dkv
        kv = 2 * self.key_tiles_dkv * bk * head_dim * itemsize
        ring = stages * (2 * bq * head_dim * itemsize + 2 * bq * 4)
        staged = self.consumers_dkv * bk * bq * itemsize
        if self.operands_in_registers or self.query_rows:  # no staging buffer
            staged = 0
        barriers = 8 * (3 * stages + 2)
        if self.share_probs:  # the float32 P^T tile the dV warpgroup hands over
            staged += bk * bq * 4
            barriers += 8 * 2
        if self.fused:  # the dS^T tiles, and two steps of float32 dQ shares
            c = self.consumers_dkv
            staged += c * bk * bq * itemsize + 2 * bq * head_dim * 4
            barriers += 8 * 7
            if self.chained_share:  # one writer slot and consumer 0's parts instead
                barriers += 8 * 2 * c
        return kv + ring + staged + barriers + MOSAIC_OVERHEAD

    def smem_bytes_dq(self, head_dim: int, itemsize: int = 2) -> int:
        """Shared memory of the dQ kernel at this (padded) head dim (an estimate)."""
        bq, bk, c = self.block_q_dq, self.block_kv_dq, self.consumers_dq
        tiles = 1 if self.split_dq else c  # query tiles a CTA holds
        q_do = tiles * (2 * bq * head_dim * itemsize + 2 * bq * 4)
        ring = self.num_stages_dq * 2 * bk * head_dim * itemsize
        staged = 0 if self.operands_in_registers else c * bq * bk * itemsize
        barriers = 8 * (4 * self.num_stages_dq + c)
        if self.split_dq:  # P (float32) and dS handed over; dS is the wgmma operand
            staged = bq * bk * (4 + itemsize)
            barriers += 8 * 4
        return q_do + ring + staged + barriers + MOSAIC_OVERHEAD

    @property
    def rotated_ring(self) -> bool:
        """rotated_adds launched a head's spans together (not high_spans_first): the
        ring table and its rotated walks, whose turns need the spans resident at once."""
        return self.rotated_adds and not self.high_spans_first

    def heads_per_band(self, kv_heads: int, batch: int) -> int:
        """The heads of one span_band band for a kernel of `kv_heads` key/value heads
        and `batch` batch elements: the largest divisor of `kv_heads` not above
        span_band nor band_pairs / batch (one at least), so that every band is whole."""
        widest = min(self.span_band, kv_heads, max(1, self.band_pairs // batch))
        return max(d for d in range(1, widest + 1) if kv_heads % d == 0)

    def launched(
        self, kv_heads: int, batch: int, seq_q: int, head_dim: int, group: int
    ) -> MosaicBwdConfig:
        """This config as a call of these shapes launches it (`head_dim` padded, `group`
        query heads a key/value head): where a band's query-side tiles take more than
        high_first_bytes, the band narrowed to the most whole heads that fit (span_band;
        the same bits, since high_spans_first's turns go in decreasing span order in any
        band), and where one head's do not fit, high_spans_first (with rotated_adds)
        dropped: the plain order. Else itself."""
        if not self.high_spans_first:
            return self
        head_bytes = batch * seq_q * head_dim * group * QUERY_SIDE_BYTES
        if self.heads_per_band(kv_heads, batch) * head_bytes <= self.high_first_bytes:
            return self
        fit = self.high_first_bytes // head_bytes  # the most heads a band may hold
        if fit == 0:
            return dataclasses.replace(self, rotated_adds=False, high_spans_first=False)
        # whole bands: heads_per_band's largest divisor of kv_heads, now not above `fit`
        narrow = dataclasses.replace(self, span_band=fit).heads_per_band(kv_heads, batch)
        return dataclasses.replace(self, span_band=narrow)

    def interpreted(self) -> MosaicBwdConfig:
        """This config as GPU interpret mode runs it: the interpreter's wgmma reads
        shared memory only, so every register operand is staged (and FA3's order, which
        orders register-operand wgmmas, gives way to the plain one), and its
        accumulators cannot be stored into (no held zeros). The same arithmetic."""
        return dataclasses.replace(
            self,
            operands_in_registers=False,
            fa3_order=False,
            q_do_in_registers=False,
            k_v_in_registers=False,
            held_zero=False,
        )


# The backward default rows (head dims 64 and 128; 192-256 since 1ae1789) mask boundary
# tiles from each query's key bounds (`MosaicBwdConfig.row_bound_mask`, where the mask
# has row bounds: causal and windows). Compiled, it gives the tile_mask form's bits on
# all 30 of the case table's rows (28 at 67e6e1c, the two head-dim-256 rows at 47a46be
# and the 5 head-dim-256 rows of the backward's own test at 1ae1789;
# results/mosaic-*/mosaic-tests-*.log); the dK/dV kernel's spill stores 36 bytes where
# they were 80 (head dim 128 causal). Speed: as a variant, fwd+bwd 1.04x / 1.02x at head
# dim 64 causal 2k in two runs, 1.00x at 4k, and at 128 0.96x / 1.03x at 2k, 1.01x at 4k
# (results/mosaic-5a15452/); as the default beside `row_bound_mask=false` at 0332c92
# (results/mosaic-0332c92/fa-{64,128}-true-rowbound-default.jsonl; bf16, B x T = 16k;
# the variant turns the forward's row-bound mask off too, the field being shared),
# 1.01x / 1.00x at head dim 64 causal 2k / 4k (301.6 / 348.7 TFLOP/s against 297.7 /
# 347.7) and 1.00x / 0.99x at 128 (410.9 / 439.5 against 410.7 / 442.8): level, within
# the runs' noise, and it stays for the smaller spills.
BWD_ROW_BOUND = True


# The dQ kernel's Q and dO as register wgmma A operands (MosaicBwdConfig.q_do_in_registers)
# in the default rows of head dims 64-128, since 5173ae3. Compiled, the same bits as
# without on all 25 of the case table's rows at those head dims (14 at 19797c5,
# results/mosaic-19797c5/mosaic-tests-q-do-in-registers.log, the other 11 at f309273,
# results/mosaic-f309273/mosaic-tests.log). Speed, head dim 128 non-causal 8k (bf16,
# B x T = 16k), timed default / with / default / with in one process at 26e6916 so that
# neither holds the process's first place alone (results/mosaic-26e6916/fa-mosaic-128-aba.jsonl):
# backward 461.5 / 468.5 / 465.6 / 471.3 TFLOP/s, 1.012-1.015x; at 19797c5, with Q's
# forward columns (results/mosaic-19797c5/fa-mosaic-{64,128}-regs.jsonl), 1.02x / 1.01x
# at head dims 64 / 128. No spills (ptxas-operands-in-registers.jsonl there).
BWD_Q_DO_IN_REGISTERS = True


# The one dQ warpgroup of head dims 192-256 with all 256 of its registers
# (MosaicBwdConfig.solo_dq_registers) in the default rows since 5173ae3: at 232 ptxas
# spilled 608 bytes in that kernel at head dim 256. Compiled, the same bits as without on
# all 5 of the case table's head-dim-256 rows (results/mosaic-26e6916/mosaic-tests-solo-dq.log).
# Speed (bf16, B x T = 16k), backward TFLOP/s: non-causal 8k 397.9 against 379.8 (1.05x,
# results/mosaic-f309273/fa-mosaic-256-mc.jsonl), causal 8k 384.3 against 365.5 (1.05x,
# fa-mosaic-256c-mc.jsonl there; cuDNN 346.9 / 364.7 in those runs), and causal 16k
# timed default / with / default / with at 26e6916 386.3 / 412.1 / 381.9 / 414.1
# (1.07-1.08x, results/mosaic-26e6916/fa-mosaic-256c-aba.jsonl).
BWD_SOLO_DQ_REGISTERS = True


# The lse read before the scores' wgmma (MosaicBwdConfig.early_lse) in the pair's row at
# padded head dim 256, since the 53rd session. There the dV warpgroup of the dK/dV split
# reads it, and ptxas keeps the read behind the S^T wait without it. Timed on the H200 at
# 74e1a14 beside the default and cuDNN in one process per causal setting
# (results/mosaic-74e1a14/fa-mosaic-256-bwd-options.jsonl; bf16, B x T = 16k), backward
# TFLOP/s: non-causal 4k / 16k 409.9 / 429.3 against 388.8 / 405.1 (1.054x / 1.060x),
# causal 385.0 / 422.6 against 372.5 / 407.4 (1.034x / 1.037x); cuDNN 351.9 / 350.6 and
# 325.7 / 369.5. Compiled, the same bits as without on the case table's 5 head-dim-256
# rows (results/mosaic-0217d7a/mosaic-tests-early-lse-256.log). Compiled for the H200
# without a GPU (benchmarks.ptxas --deviceless, 8k): the dK/dV kernel's steps issue 6-13
# more instructions, with no spill non-causal (as without) and 20 / 72 bytes causal,
# none of them in a step (none without). Head dim 192 takes the same kernels but was not
# timed with it, so it keeps the read after the wait.
# At head dim 128 (the fused default) it ran 1.025x / 0.995x / 1.011x at 2k / 8k / 16k
# non-causal and 0.995x causal 8k (fa-mosaic-128-*-early-lse.jsonl there): not a lead.
BWD_EARLY_LSE_DIMS = (256,)


# Keys per K/V tile of the dQ kernel at head dim 64 (block_kv_dq). The backward sweep at
# 536c0ce (results/mosaic-536c0ce/sweep-mosaic-64-bwd-440.jsonl; B=2, T=S=8k, bf16)
# ranked 128-key tiles first: 375.7 / 365.0 TFLOP/s non-causal / causal against the
# 64-key default's 369.7 / 354.7 (1.02x / 1.03x; three stages 376.6 / 364.1), the
# default's bits (check_err 0.0). Each 64-row query tile then issues half as many
# S / dP / dQ wgmma groups and waits half as many barriers per key; S and dP take
# 64 registers each (64 x 128 float32 over 128 threads), which fit beside dQ's 32 and
# Q and dO's 32. At 128 the same tiles would hold 64 more for dQ: not swept there.
# Timed at b1e8fd0 in one process in the order default (128) / 64 / 128 / 64, the
# interleaved harness (results/mosaic-b1e8fd0/fa-mosaic-64{,c}-dqkeys.jsonl; bf16,
# B x T = 16k), backward TFLOP/s: non-causal 2k 350.6 / 344.2 / 356.4 / 348.2 (1.02x),
# causal 2k 307.0 / 289.2 / 298.5 / 279.7 (1.06x), causal 8k 374.3 / 356.9 / 376.2 /
# 353.8 (1.05x; cuDNN 389.3, 282.8, 398.1). Compiled, the 64-key tiles' bits on all 14
# head-dim-32/64 rows of the case table (test_gpu_dq_key_tiles_change_no_bit,
# results/mosaic-b1e8fd0/mosaic-tests.log).
BWD_DQ_KEYS_64 = 128


def q_do_fit_registers(block_q_dq: int, head_dim: int) -> bool:
    """Whether the dQ kernel's Q and dO tiles (16-bit, block_q_dq rows) fit a
    warpgroup's registers beside its dQ accumulator, which they cost as much as:
    2 x block_q_dq x padded head dim <= 128 x 128, so head dim 128 at most with 64-row
    tiles (MosaicBwdConfig.q_do_in_registers)."""
    return 2 * block_q_dq * padded_head_dim(head_dim) <= 128 * 128


def fused_mosaic_bwd_config(head_dim: int) -> MosaicBwdConfig:
    """The fused backward at this head dim: two consumers splitting the dQ share's
    columns at 128, its rows (128-row query tiles) at 64. Above 128 the accumulators do
    not fit beside a share: ValueError. Its boundary tiles mask as the default rows' do
    (`BWD_ROW_BOUND`; the same `probs` code as the pair's dK/dV kernel): compiled for
    sm_90 at 67e6e1c (ptxas: 280 bytes of spill stores with step_descriptors, 736
    without the row-bound form) and checked in GPU interpret mode; compiled with it, in
    FA3's order, it passed the reference on all 25 of its case-table rows at 47a46be
    (test_gpu_step_descriptors_change_no_bit, fused-fa3), the fused default's own
    reference tests having run before it took the row-bound form."""
    hp = padded_head_dim(head_dim)
    if hp > 128:
        raise ValueError(
            f"the fused backward does not fit at head dim {hp} (above 128): use "
            "default_mosaic_bwd_config"
        )
    return MosaicBwdConfig(
        fused=True, block_q_dkv=128 if hp == 64 else 64, row_bound_mask=BWD_ROW_BOUND
    )


# The fused backward (one kernel, dQ added in a fixed order) in FA3's step order with
# per-step descriptors and its ordered adds in two writer warps, a slot each
# (`fused_full_bwd_config`): the default of padded head dim 128 when the call is not
# causal since 9651b8e's runs (results/mosaic-9651b8e/; bf16, B x T = 16k, backward
# TFLOP/s, against the pair in the same process), then with its dQ share in column
# halves: non-causal 2k / 4k / 8k / 16k 427.5 / 457.7 / 473.6 / 475.8 against 406.9 /
# 449.4 / 461.0 / 456.8 (1.05x / 1.02x / 1.03x / 1.04x; cuDNN 418.1 / 488.8 / 515.7 /
# 521.0). Causal it ran 1.01x / 1.02x / 1.00x / 0.98x the pair (351.2 / 408.7 / 447.1 /
# 455.8 against 348.2 / 400.9 / 445.2 / 465.0): level, so causal calls keep the pair.
# Compiled, the split writer gives the one writer's bits on the 11 fused case-table rows
# that ran (results/mosaic-9651b8e/mosaic-tests-split-writer.log).
# The share whole (share_halves=False) since d044a97's runs, beside the halves in one
# process: at 8k on the H200 505.3 TFLOP/s against 477.9 (1.06x; cuDNN 513.1, the pair
# 463.0; results/mosaic-f6435c2/fa-mosaic-128-false-whole.jsonl); at 2k / 4k / 16k, on
# an H100 (the call got one), 446.9 / 489.3 / 524.0 against 451.4 / 469.3 / 521.7
# (0.99x / 1.04x / 1.00x; cuDNN 414.8 / 476.4 / 527.5;
# results/mosaic-d044a97/fa-mosaic-128-false-whole-lengths.jsonl). Compiled, the halves'
# bits (and the reference's tolerance) on all 11 case-table rows of padded head dim 128
# (test_gpu_fused_whole_share_changes_no_bit, results/mosaic-d044a97/
# mosaic-tests-whole-share.log). For the H200, compiled here, it spills 132 / 220 bytes
# (stored / loaded) to the halves' 24 / 100, and ptxas serializes no wgmma.
# Causal, the same build (its share whole) since 7a9e602's runs, beside the pair in one
# process on an H100 (the tool lent no H200; results/mosaic-7a9e602/
# fa-mosaic-128-true-fused-whole.jsonl): 2k / 4k / 8k / 16k 358.4 / 406.6 / 471.6 / 477.9
# against 347.9 / 406.8 / 441.7 / 468.5 (1.03x / 1.00x / 1.07x / 1.02x; cuDNN 328.7 /
# 393.3 / 468.6 / 511.0; the rows' step, query_rows, 348.5 / 414.3 / 458.9 / 483.8). On
# the H200 at 8k the halves had run level with the pair (450.7 against 447.8,
# results/mosaic-f6435c2/fa-mosaic-128-true-fused.jsonl) and the whole share 1.06x the
# halves non-causal. Compiled, the causal rows passed with the rest of the 11
# (test_gpu_fused_whole_share_changes_no_bit).
# Head dim 64 non-causal (padded: head dims up to 64), the same build (128-row query tiles, the
# consumers splitting the share's rows, two slots) since 7a9e602's runs, its first
# timing, on the same H100 (results/mosaic-7a9e602/fa-mosaic-64-fused.jsonl, impl
# `$M/q_do_in_registers=false/fused=true/num_stages_dkv=2/fa3_order=true/
# step_descriptors=true/writer_warp=true/split_writer=true`, which is this build): 2k /
# 8k 414.0 / 457.9 against the pair's 362.2 / 396.4 (1.14x / 1.16x; cuDNN 353.6 /
# 411.5). Causal it ran 271.8 / 328.1 against 303.3 / 371.4 (0.90x / 0.88x), so causal
# calls at 64 keep the pair. Compiled, the reference's tolerance on the case table's 8
# head-dim-64 rows (test_gpu_fused_split_writer_changes_no_bit, the same bits as one
# writer; results/mosaic-7a9e602/mosaic-tests-fused64-full.log), then as the default
# the regs row and bitwise-equal gradients (mosaic-tests-fused64-default.log).
# Head dim 64 causal, the same build in bands of BWD_CAUSAL_SPAN_BAND heads since
# 1fc58b7's runs (results/mosaic-1fc58b7/; an H100, the tool lent no H200), beside the
# pair in one process: 2k / 4k / 8k / 16k 321.8 / 368.4 / 397.6 / 420.4 TFLOP/s against
# 306.3 / 353.7 / 383.6 / 400.4 (1.05x / 1.04x / 1.04x / 1.05x; cuDNN 279.5 / 336.1 /
# 377.8 / 412.9; fa-mosaic-64-true-fused-bands.jsonl), and in a second run 1.05x /
# 1.06x / 1.07x at 4k / 8k / 16k (fa-mosaic-64-true-span-band.jsonl); as the default at
# 9abcf47 (results/mosaic-9abcf47/fa-mosaic-64-true-default.jsonl) 0.95x / 1.08x / 1.06x /
# 1.09x the pair (cuDNN 1.00x / 1.09x / 1.06x / 1.04x): 2k noise or a loss, and at
# 4c2c14e 1.07x / 1.06x / 1.05x / 1.07x (cuDNN 1.20x / 1.11x / 1.10x / 1.03x;
# results/mosaic-4c2c14e/fa-mosaic-64-true-bwd-bands.jsonl): noise, the row needs no length.
# Head-major (one band) the fused build ran 0.85x the pair, in bands of 2 1.00x / 0.99x /
# 0.99x; bands of 8 0.98x / 1.05x / 1.09x / 1.08x (better from 4k, worse at 2k; the band
# is not a function of the length yet). Compiled, bands of 4 give the plain order's bits on the
# fused case-table rows, head dim 64 causal among them (test_gpu_span_band_changes_no_bit,
# mosaic-tests.log there); as the default, the case table's 8 causal rows up to 64 and
# the defaults' determinism at 64-256 both ways, 14 of 14 at 4c2c14e
# (results/mosaic-4c2c14e/mosaic-tests-call-10.log).
# (padded head dim, causal) of the rows whose default is this build:
BWD_FUSED_ROWS = frozenset({(64, False), (64, True), (128, False), (128, True)})
BWD_SHARE_HALVES = False


def fused_full_bwd_config(head_dim: int) -> MosaicBwdConfig:
    """The fused build of BWD_FUSED_ROWS at this head dim (128 at most, as
    fused_mosaic_bwd_config)."""
    return dataclasses.replace(
        fused_mosaic_bwd_config(head_dim),
        fa3_order=True,
        step_descriptors=True,
        share_halves=BWD_SHARE_HALVES,
        writer_warp=True,
        split_writer=True,
    )


# The causal fused row (padded head dim 128) launches its key spans in bands of 4
# key/value heads (span_band), since 00676b3's runs: beside the plain order in one process
# on an H100 (the tool lent no H200; results/mosaic-00676b3/
# fa-mosaic-128-true-span-band.jsonl; bf16, B x T = 16k, backward TFLOP/s) 433.7 / 494.2
# / 508.7 against 431.9 / 481.1 / 498.3 at 4k / 8k / 16k (1.004x / 1.027x / 1.021x;
# bands of 2 1.010x / 0.984x / 1.010x; cuDNN 408.5 / 466.0 / 508.3). Compiled, bands of
# 2 gave the plain order's bits on the 25 fused case-table rows (mosaic-tests-call-4.log,
# test_gpu_span_band_changes_no_bit), and at 1fc58b7 bands of 4 did
# (results/mosaic-1fc58b7/mosaic-tests.log, 43 of 43 with the defaults' determinism).
# Head dim 64 causal takes the same bands (BWD_FUSED_ROWS above); bands of 8 there ran
# 0.951x / 0.991x / 0.983x / 1.028x bands of 4 at 2k-16k at 4c2c14e (an H100,
# results/mosaic-4c2c14e/fa-mosaic-64-true-bwd-bands.jsonl), short of the 3 % from 8k that
# would have taken them.
BWD_CAUSAL_SPAN_BAND = 4


# The bytes a query-side value takes in the fused backward's working set: Q and dO (16-bit
# inputs) read each step, and the float32 dQ the ordered adds build in the L2
# (MosaicBwdConfig.high_first_bytes; benchmarks.launch_sim.l2_rereads).
QUERY_SIDE_BYTES = 2 + 2 + 4


# The causal fused row at padded head dim 64 launches each head's key spans from the
# last down and walks them upward (rotated_adds with high_spans_first), still in bands of
# 4, since 78baa53's runs (an H100, the tool lent no H200; results/mosaic-78baa53/; bf16,
# B x T = 16k, backward TFLOP/s): beside the bands' plain order in one process, 2k / 4k /
# 8k / 16k 319.1 / 387.7 / 430.7 / 444.4 against 310.0 / 374.2 / 411.2 / 424.1 (1.029x
# / 1.036x / 1.047x / 1.048x; cuDNN 273.6 / 338.3 / 382.7 / 415.0;
# fa-mosaic-64-true-high-spans-first-plain.jsonl), in a second process 1.032x / 1.034x
# at 2k / 4k (-plain-2.jsonl) and in a third 1.044x / 1.040x at 8k / 16k
# (fa-mosaic-bwd-turns.jsonl). With the writer's turn waits taken out (wrong sums, a
# diagnostic) the plain order ran 1.09-1.10x itself there and high_spans_first 1.01x
# (fa-mosaic-bwd-no-turns.jsonl): its turns cost little, the plain order's queue of
# turns about 9 %. At padded head dim 128 causal it ran 0.93x / 0.85x the plain order
# at 8k / 16k, 0.79x / 0.86x with the waits out of both: its walk loses there, so that
# row keeps the plain order; in bands of 2 and of 1 head (within the L2's bound) it still
# ran 0.964x / 0.968x and 0.973x / 0.960x (0e8a8d2, fa-mosaic-128-true-high-spans-first-
# bands.jsonl). Compiled at 78baa53, on the case table's 14 causal rows the
# reference and two calls the same bits (mosaic-tests.log). Deterministic in its own
# order (decreasing key span), not the plain order's bits. Where a call's band of 4 heads
# holds more query-side tiles than high_first_bytes (past the grid's 16k tokens of 32
# heads: a larger batch, or grouped heads) it launches in narrower bands that fit, and in
# the plain order where one head does not (`launched`): at 32k tokens, in bands of 2, it
# ran 1.009x / 1.033x the plain order at 8k / 16k (0e8a8d2,
# fa-mosaic-64-true-high-first-32k-{8192,16384}.jsonl).
# padded head dims whose causal fused row takes high_spans_first:
BWD_HIGH_SPANS_FIRST_DIMS = frozenset({64})


def default_mosaic_bwd_config(head_dim: int, causal: bool) -> MosaicBwdConfig:
    """The backward default table's row for this head dim and causality (16-bit inputs
    only): the fused kernel at padded head dims 64 and 128 (BWD_FUSED_ROWS; causal in
    bands of BWD_CAUSAL_SPAN_BAND heads, at 64 launched from the last span down,
    BWD_HIGH_SPANS_FIRST_DIMS), else the pair (pair_mosaic_bwd_config)."""
    hp = padded_head_dim(head_dim)
    if (hp, causal) in BWD_FUSED_ROWS:
        config = fused_full_bwd_config(head_dim)
        if not causal:
            return config
        config = dataclasses.replace(config, span_band=BWD_CAUSAL_SPAN_BAND)
        if hp in BWD_HIGH_SPANS_FIRST_DIMS:
            return dataclasses.replace(config, rotated_adds=True, high_spans_first=True)
        return config
    return pair_mosaic_bwd_config(head_dim)


def pair_mosaic_bwd_config(head_dim: int) -> MosaicBwdConfig:
    """The two-kernel backward's row for this head dim (a dK/dV kernel and a dQ kernel,
    no atomics; 16-bit inputs only): the default above head dim 128."""
    hp = padded_head_dim(head_dim)
    if hp == 64:
        # Sweep at 12-01 (B=2, T=S=8k, bf16): 128-row Q tiles through 3 slots in the
        # dK/dV kernel ran 374 / 357 TFLOP/s (full / causal) against 349 / 342 for 64-row
        # tiles through 2 (1.07x / 1.04x); the module docstring has the side-by-side run.
        # Row-bound masks (row_bound_mask): see BWD_ROW_BOUND above.
        # Q and dO in registers: BWD_Q_DO_IN_REGISTERS above.
        # 128-key K/V tiles in the dQ kernel: BWD_DQ_KEYS_64 below.
        return MosaicBwdConfig(
            block_q_dkv=128,
            num_stages_dkv=3,
            block_kv_dq=BWD_DQ_KEYS_64,
            row_bound_mask=BWD_ROW_BOUND,
            q_do_in_registers=BWD_Q_DO_IN_REGISTERS,
        )
    if hp <= 128:
        return MosaicBwdConfig(
            row_bound_mask=BWD_ROW_BOUND, q_do_in_registers=BWD_Q_DO_IN_REGISTERS
        )
    # Head dims 192 and 256 take the row-bound form too (since 1ae1789): compiled it gives
    # tile_mask's bits on the case table's 5 head-dim-256 rows (5 of 5 at 1ae1789,
    # results/mosaic-1ae1789/mosaic-tests-row-bound-h256.log), and beside tile_mask in one
    # process (fa-mosaic-256-true-rowbound-bwd.jsonl; bf16, B x T = 16k, causal) fwd+bwd ran
    # 1.01x / 1.01x / 1.02x at 4k / 8k / 16k (350.8 / 368.3 / 383.8 TFLOP/s against
    # 348.6 / 363.7 / 377.8); on CPU its lowered backward has 43,410 ops against 45,280
    # (benchmarks.lowered_ops --head-dim 256 --causal true). And the dV warpgroup hands
    # its P^T to the dK warpgroup (share_probs, since 79c9063): beside the plain split,
    # backward 1.14-1.17x at head dim 256, 4k and 16k, causal and not (module docstring);
    # compiled, the same bits as the split on the case table's head-dim-256 and -64 rows
    # (13 of 13, results/mosaic-e928813/mosaic-tests-share-probs.log).
    # And the one dQ warpgroup takes all its registers: BWD_SOLO_DQ_REGISTERS above; at
    # 256 the lse is read before the scores' wgmma: BWD_EARLY_LSE_DIMS above.
    return MosaicBwdConfig(
        split_dkv=True,
        share_probs=True,
        consumers_dq=1,
        row_bound_mask=BWD_ROW_BOUND,
        solo_dq_registers=BWD_SOLO_DQ_REGISTERS,
        early_lse=hp in BWD_EARLY_LSE_DIMS,
    )

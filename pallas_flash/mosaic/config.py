"""Tile and pipeline configs of the Mosaic GPU (Hopper) kernels, with their evidence.

Frozen (hashable), so it travels as a static argument, like configs.TritonConfig.

Default-config table (16-bit inputs; head dim padded up to a multiple of 64):

| head dim (padded) | rows per warpgroup x block_kv | stages | shared memory (bytes) |
|-------------------|-------------------------------|--------|-----------------------|
| 64                | 64 x 256, early K wait        | 2      | 151,128 (bound)       |
| 64, not causal    | the same, persistent, last round split (tail_fixup) | 2 | 175,704 (bound) |
| 64, keys <= 2048, causal | 64 x 128, early K wait, persistent, head order | 2 | 101,976 (bound) |
| 64, keys 2049-4096, causal | 64 x 256, the same        | 2      | 167,512 (bound)       |
| 128, causal       | 64 x 128, early K wait        | 2      | 167,000               |
| 128, keys <= 2048, causal | the same, persistent, head order | 2 | 200,280 (bound) |
| 128, keys 2049-8192, causal | the same, list schedule (greedy_items) | 2 | 200,280 (bound) |
| 128, keys > 8192, causal | the same, clusters of two (kv_multicast) | 2 | 167,512 (bound) |
| 128, not causal   | the same, persistent          | 2      | 200,280 (bound)       |
| 128, keys <= 4096, not causal | the same, early Q loads | 2 | 200,280 (bound) |
| 128, keys >= 4096, not causal | the same, last round split (tail_fixup) | 2 | 200,280 (bound) |
| 192, 256          | 64 x 64, early K wait         | 2      | 150,616, 199,768      |
| 192, 256, keys <= 16384, not causal | the same, persistent | 2 | 199,768 (O through Q's buffer) |

("Persistent, head order": `head_rounds` with early Q loads. Shared memory as Mosaic
GPU's lowering reports it, with P in registers; "bound":
`smem_bytes`' upper bound, for rows not yet read off a lowering.) Every row holds Q's
first 64 head-dim columns in registers (`q_register_cols=64`, since 19797c5's runs, see
`Q_REGISTER_COLS` below). The rows of head dims 128-256 skip the running output's rescale
where a warp's row maxima grew by less than 8 (`rescale_slack=8`, since ec465ad) but for
causal calls of at most 1024 keys (see `RESCALE_SLACK` below).

Evidence: the forward sweep on the H200 (`python -m benchmarks.sweep --family mosaic`,
gpu_run.sh step `sweep-mosaic:HD:fwd`; B=2, T=S=8k, bf16; TFLOP/s non-causal / causal;
`python -m benchmarks.render FILE` prints its table):
- Head dim 128 (`benchmarks/results/sweep-mosaic-128-fwd-e610df9.jsonl`: in 200 s, the
  72 candidates nearest the old default, each causal and not): the early K wait is the
  one change that wins, 555 / 553 -> 582 / 603 (1.05x / 1.09x). With rescale_before_turn
  as well 573 / 600; rescale_before_turn alone 576 / 559; intra_overlap 463 / 450 (539 /
  530 without ping-pong); no ping-pong 534 / 558; block_kv 64 at most 514; 128 rows per
  warpgroup at most 539. Three stages or block_kv 192 at 64 rows need more than the 227
  KiB of shared memory, so those were not compiled. Block_kv 192 fits once the forward
  reserves no reduction scratch; compiled that way at c9dd6ce (results/mosaic-c9dd6ce/,
  beside the default in one process, B x T = 16k) it ran 0.76x / 0.94x the default
  non-causal at 2k / 8k and 0.91x causal 8k, so neither is kept. At a33e535
  (results/mosaic-a33e535/) rescale_before_turn ran 1.00x / 1.01x at 2k / 8k, one CTA
  per tile 0.98x / 0.99x, both with Q from shared memory 0.94x / 0.97x.
- Head dim 64 (`sweep-mosaic-64-fwd-c6719a0.jsonl`, 13 candidates, the new default
  first): with the early K wait 437 / 419, without 417 / 400 (1.05x / 1.05x); block_kv
  64 369 / 358; three stages 433 / 419; block_kv 192 435 non-causal. Then
  (`sweep-mosaic-64-fwd-06da646.jsonl`, the 70 candidates nearest that default in
  170 s): 256-key tiles 466 / 453 against its 438 / 422 (1.06x / 1.07x), the default
  since e5ca198; block_kv 192 431 / 391, 128 rows per warpgroup at most 444 / 388,
  three or four stages 434-437 / 416-423, rescale_before_turn 440 / 418. In the fa
  suite beside the peers (`results/mosaic-e5ca198/fa-mosaic-64-*.jsonl`) it runs
  0.98-1.04x the best peer non-causal and 0.88-1.08x causal from 2k (0.87x and 0.75x
  at 1k), where 128-key tiles had 0.85-0.92x and 0.85-0.96x (`fa-a8d81d9/`).
- Head dim 256 (`results/mosaic-d2f5aa4/sweep-mosaic-256-fwd-110.jsonl`, the 18
  candidates that fit, each causal and not): the early K wait wins here too, 578 / 603
  -> 609 / 612 (1.05x / 1.01x); with rescale_before_turn as well 604 / 624; without
  ping-pong 578 / 623; intra_overlap 412 / 404; persistent 604 / 496 (0.82x causal).
  Head dim 192 follows 256 (same tiles), not swept.
- The persistent grid (`persistent=True`) beside the default and the peers in one run
  (`results/mosaic-d2f5aa4/fa-mosaic-64-persistent.jsonl`, `-64-true-persistent`,
  `-128-true.jsonl`): at head dim 64 it is 1.13x / 1.06x the default non-causal at 1k /
  2k (410.6 / 455.7 TFLOP/s, 1.02x / 1.05x the best peer) and 1.08x / 1.05x causal;
  at head dim 128 causal it is 0.96x, 0.89x, 0.82x and 0.87x at 1k, 2k, 8k and 16k,
  and at 256 causal 8k 0.82x. So it became the default at head dim 64 for key lengths
  up to 2048 (`default_mosaic_config(head_dim, seq_k)`), where a CTA's walk is at most
  eight 256-key tiles and its prologue and epilogue weigh most; at 4k and up at head
  dim 64 it has not been timed.
- Persistent at head dim 128 again, beside the default in one run at 41958b0 (after the
  snake order of causal rounds, pipeline.persistent_item; tokamax runs persistent exactly
  when not causal; `results/mosaic-41958b0/fa-mosaic-128-*-variants.jsonl`): non-causal
  1.06x, 1.06x, 1.00x and 1.01x the default at 1k, 2k, 8k and 16k (528.5, 597.1, 591.3,
  599.1 TFLOP/s); causal still 0.96x, 0.90x, 0.93x and 0.98x. So at head dim 128 it is
  the default when the call is not causal (`causal=False`; the API passes it), at
  every length. At 256 non-causal the sweep (8k) had it at 604 against the early K
  wait's 609 TFLOP/s (0.99x).
- At 336cd0b, one process per row (`results/mosaic-336cd0b/`; B x T = 16k, bf16):
  - Head dim 256 non-causal (`fa-mosaic-256-false-persistent.jsonl`): persistent ran
    1.02x, 1.01x and 1.05x the default at 1k, 2k and 4k (547.1, 614.4, 643.7 TFLOP/s),
    and at 81df3c6 1.03x at 8k (624.6 against 606.5;
    `results/mosaic-81df3c6/fa-mosaic-256-false-persistent-8k.jsonl`; the d2f5aa4
    sweep's 0.99x predates the snake order and O through Q's buffer), so it is the
    default there up to 8192 keys (PERSISTENT_MAX_KEYS_256); 16k is not timed.
  - Head dim 64 causal (`fa-mosaic-64-true-blockkv.jsonl`): 128-key tiles (beside the
    persistent default) ran 1.11x and 1.04x the 256-key default at 1k and 2k (267.9,
    340.5 TFLOP/s): there 40 % of the 256-key tiles straddle the diagonal (the masked
    work is 1.25x the needed, 1.12x with 128-key tiles) and a CTA walks few tiles. At
    8k the sweep had 256-key tiles 1.07x ahead causal, and at 81df3c6 128-key tiles ran
    0.98x the default at 4k (390.7 against 400.0;
    `results/mosaic-81df3c6/fa-mosaic-64-true-blockkv-4k.jsonl`), so 128 only up to
    2048 keys.
- At 37cc49c, under the pre-roll, beside the peers (`results/mosaic-37cc49c/
  fa-mosaic-{64-true,256-false}-variants.jsonl`; B x T = 16k, bf16, forward TFLOP/s):
  - Head dim 64 causal 2k: the 128-key row without the persistent grid ran 327.4 against
    its persistent 309.3 (1.06x; JAX's Mosaic FA3 330.2, cuDNN 327.1), 256-key tiles
    281.0; so at 2048 keys and below a causal call at head dim 64 took one CTA per item
    (tile-major; in head order the persistent grid won there since, HEAD_ROUNDS).
  - Head dim 256 non-causal 16k: persistent ran 639.1 against 615.7 (1.04x; cuDNN
    652.0), so PERSISTENT_MAX_KEYS_256 reaches 16384.
  Both as defaults at 61a3ad1 (`results/mosaic-61a3ad1/fa-mosaic-64-true-short.jsonl`,
  `-256-false-16k.jsonl`, `-64-true-1k-variants.jsonl`): head dim 64 causal 2k 336.3
  against the persistent grid's 321.8 (1.05x; FA3 325.0, cuDNN 326.0, tokamax 324.7), 1k
  258.5 against 258.3 (cuDNN 273.7; 64-key tiles 229.2 / 236.7 without / with the
  persistent grid, three stages 252.2 / 257.7: none ahead of the default); head dim 256
  non-causal 16k 639.7 against 627.9 one CTA per item (1.02x; cuDNN 655.7).
- Head dim 64 non-causal from 4k, the persistent grid beside the default and the peers at
  04f1496 (`results/mosaic-04f1496/fa-mosaic-64-false-persistent.jsonl`, one process):
  452.5 / 466.7 / 486.1 TFLOP/s against 443.5 / 459.6 / 472.5 at 4k / 8k / 16k (1.02x /
  1.02x / 1.03x; the best peer 421.6 / 441.2 / 447.9), so at head dim 64 it is the
  default whenever the call is not causal. Causal 4k (`fa-mosaic-64-true-4k-variants.jsonl`):
  persistent 300.1 against 368.6 (0.81x); 128-key tiles 377.1 (1.02x, where at 81df3c6
  they ran 0.98x: within a run's spread, so the 256-key row stays).
- The persistent causal grid in head order (`head_rounds`, 54th session; an H100, one
  process a head dim, `results/mosaic-6f8830f/`). Every causal timing of the persistent
  grid above walked its items tile-major: each round read the K and V of 132 heads,
  and a head's next query tile came back only after all the others had had theirs, so
  each item read its K and V from HBM (`launch_sim.forward_kv_fetches`, a model of a
  50 MiB LRU L2, not a profile: 4.0x / 7.3x the compulsory K/V fetches at head dim 64
  causal 1k / 2k, against 1.0x for the one-CTA-per-item grid and for head order). In
  head order, with early Q loads, it ran 1.13x / 1.15x the one-CTA-per-item row at
  head dim 64 causal 1k / 2k (289.9 / 361.2 TFLOP/s; tile-major 242.1 / 281.0) and
  1.10x / 1.05x at head dim 128 (358.6 / 472.1), 1.02x / 0.99x at 64 4k / 8k and 0.99x
  / 0.93x at 128 4k / 8k: the default for causal calls of at most 2048 keys at head
  dims 64 and 128 (HEAD_ROUNDS).
  As the default at 0ac7980 (`results/mosaic-0ac7980/fa-mosaic-causal-short-fwd.jsonl`,
  beside the three peers): 290.9 / 354.0 at head dim 64 1k / 2k against cuDNN's 262.7 /
  332.1 (1.11x / 1.07x), 377.5 / 471.8 at 128 against tokamax's 354.8 / 443.5 (1.06x /
  1.06x).
  At head dim 64 causal 4k (256-key tiles) again at 7e1026e, in two processes: 1.03x /
  1.05x the one-CTA-per-item row (`results/mosaic-7e1026e/`), so the head-dim-64 causal
  rows take it up to 4096 keys (HEAD_ROUNDS_MAX_KEYS_64); at 8k 0.97x.
Starting points came from JAX's own Mosaic FA3
(`jax/experimental/pallas/ops/gpu/attention_mgpu.py`), whose benchmark keeps 64 query
rows per warpgroup and two K/V stages and takes the first block_kv of 256, 128, 64 that
fits in Hopper's 227 KiB of shared memory (256 at head dim 64, 128 at 128, 64 at 256);
at head dim 64 block_kv 128 keeps the float32 score tile at 64 registers per thread.
Before the early K wait (`fa-a8d81d9/`), JAX's Mosaic FA3 ran at 1.06-1.12x this
forward at head dims 64 and 128, non-causal.

The backward's configs and table: mosaic/bwd_config.py.
"""

from __future__ import annotations

import dataclasses
import math

# Hopper's shared memory per block (sm_90: 227 KiB usable of 228 KiB).
SMEM_BYTES = 227 * 1024
# Consumer warpgroups per CTA: each owns block_q query rows; a third one loads K/V.
NUM_CONSUMERS = 2
# Registers per thread, forward and backward: the producer only issues copies; the
# consumers hold the accumulators and the score tile. 128 * 40 + 256 * 232 <= 65536,
# the register file of one SM.
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232
# The forward with three consumer warpgroups (MosaicConfig.consumers=3): 128 * 32 +
# 384 * 160 = 65536 (FlashAttention-3's budgets for three).
THREE_PRODUCER_REGISTERS = 32
THREE_CONSUMER_REGISTERS = 160
# A kernel with one consumer warpgroup (the dQ kernel at head dims 192-256) could give it
# the most setmaxnreg allows: 128 * 40 + 128 * 256 <= 65536 (MosaicBwdConfig.solo_dq_registers).
SOLO_CONSUMER_REGISTERS = 256
# The fused backward adds a fourth warpgroup (dq_adds.writer): the producer and it
# keep 24 each, 2 * 128 * 24 + 256 * 232 = 65536.
FUSED_SIDE_REGISTERS = 24
# With the writer a warp of the producer's warpgroup (MosaicBwdConfig.writer_warp) the
# fused kernel has three warpgroups, as FA3's backward: 128 * 24 + 256 * 240 = 64512.
WARP_WRITER_CONSUMER_REGISTERS = 240
WARPGROUP_THREADS = 128
# Hardware named barriers (bar.arrive / bar.sync), 16 a CTA, of the forward's
# named_turns and named_releases. Mosaic GPU takes barrier 0 (a CTA-wide sync) and 1 + w
# for warpgroup w's own syncs. NAMED_TURNS + w is consumer w's turn; from NAMED_FREE, K
# slot s is NAMED_FREE + s and V slot s NAMED_FREE + stages + s, so the barriers left
# hold MAX_NAMED_STAGES stages.
NAMED_BARRIERS = 16
NAMED_TURNS = 8
NAMED_FREE = NAMED_TURNS + NUM_CONSUMERS
MAX_NAMED_STAGES = (NAMED_BARRIERS - NAMED_FREE) // 2
SWIZZLE = 128  # bytes: the widest shared-memory swizzle, for conflict-free wgmma reads
# The fused backward's K, Q and dS^T tiles with share_halves: a 32-column (bf16) slice
# of a tile is a whole number of this swizzle's 32-element rows, not of SWIZZLE's 64.
NARROW_SWIZZLE = 64
# What Mosaic GPU adds: scratch for cross-warp reductions (CompilerParams'
# reduction_scratch_bytes) and alignment (the estimate below is then within 1 KiB
# above what Mosaic GPU's lowering reports, checked at head dims 64 to 256).
MOSAIC_OVERHEAD = 128 * 4 * 4 + 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicConfig:
    """Forward kernel: one CTA per (query head, NUM_CONSUMERS * block_q rows, batch).

    block_q: query rows per consumer warpgroup (wgmma's M is 64 per instruction).
    block_kv: keys per K/V tile, the wgmma N of Q K^T and the K of P V.
    num_stages: K/V tiles in flight in the shared-memory ring.
    schedule_barrier: FA3's ping-pong: the two consumer warpgroups take turns at the
      tensor cores, so one's softmax overlaps the other's matmuls.
    p_in_registers: P V takes P from registers (FA3's choice); False stages P through
      shared memory, the only form GPU interpret mode can run (see forward.py).
    rescale_before_turn: rescale the accumulator and cast P to 16 bits before handing
      the tensor cores to the other consumer (JAX's Mosaic FA3 and tokamax do, pinned
      with an optimization barrier), rather than after taking them back, where that
      work delays our P V. Off: measured slower than the early K wait at head dim 128
      (alone 576 / 559 TFLOP/s, with it 573 / 600; module docstring).
    early_k_wait: wait for the next K tile while this tile's P V runs (JAX's Mosaic FA3
      and tokamax do), instead of at the top of the next step, where the wait sits
      between our turn and the next Q K^T. On at every head dim: the sweeps measured
      1.05-1.09x at 64 and 128 and 1.05x / 1.01x at 256 (module docstring).
    qk_behind_pv: in each turn, the next tile's Q K^T is issued right behind this
      tile's P V and the two are awaited together (FA3's paper, Fig. 1: a warpgroup's
      GEMM1 then its next GEMM0), rather than P V awaited before the next step issues
      its Q K^T: between the two, the tensor cores had nothing of this consumer's while
      it saw P V complete, released the V slot, looped and built the next descriptors
      (about 20 instructions and a wait's latency in the SASS at head dim 128, a turn
      the other consumer cannot take). The turns are the same, in the same order; the
      registers held while both run (O, P, the next scores) are what the softmax holds
      already, which fits at head dims 128 and 256 and at 64 with 128-key tiles; with
      256-key tiles at 64, or three consumers' 160 registers, ptxas serializes every
      wgmma (C7511). The next K tile is awaited before the turn: needs early_k_wait.
      The scores of a tile are computed once and in the same way, so the outputs are
      the same bits (compiled: all 30 case-table rows at 00676b3). Off: beside the
      default on an H100 (results/mosaic-00676b3/fa-mosaic-{128,64}-qk-behind-pv.jsonl)
      0.945-0.998x at head dim 128 non-causal 2k-16k, 0.979-1.029x causal, and at 64
      (128-key tiles) 0.96x the 128-key row at 8k (docs/mosaic.md, "The next Q K^T
      behind P V").
    intra_overlap: FA3's intra-warpgroup pipelining: tile j's Q K^T and tile j - 1's
      P V are issued together and tile j's softmax runs while that P V does (neither
      JAX's Mosaic FA3 nor tokamax does; FA3's ablation credits it with about 13 % at
      head dim 128). It holds a second score tile's worth of registers. A schedule of
      its own: not with rescale_before_turn or early_k_wait. Off: measured slower at head
      dim 128 (463 / 450 TFLOP/s against the old default's 555 / 553; module docstring),
      but every wgmma of that build was serialized (ptxas C7513: tile j's P converted
      into the registers tile j - 1's P V was still reading), mended on 12-05 and not
      timed since (docs/mosaic.md, "The overlapped forward, unserialized").
    persistent: one CTA per SM (at most), each walking a strided share of the (head,
      query tile, batch) work items, so that the producer streams the next item's K/V
      tiles while the consumers finish this one, and a consumer's next Q tile loads
      while it writes this one's O (from an O buffer of its own): the per-CTA prologue
      and epilogue that a grid of one CTA per item exposes on each SM (the kernel fills
      the SM's registers, so no second CTA hides them) overlap the neighbouring items'
      work (FA3's persistent kernel). Causal items run longest first. Not with
      intra_overlap. Where O's buffer does not fit (head dim 256 with 64-key tiles), O
      leaves through Q's buffer and the next Q loads once it has been read out.
    row_bound_mask: a boundary tile's element mask from per-row key bounds
      (`masks.row_bounds`: the end of the row's window, clamped to kv_len, computed
      once per row; pipeline.bound_mask) against the tile's column iota, one compare
      per element (two with a window's start), instead of `masks.tile_mask`'s
      absolute column index and up to three compares and their ands. Only where a
      bound depends on the row (causal or a window); the key length alone is one
      compare of the tile's own iota with kv_len less its first key (edbdafe). On: in
      the SASS at head dim 128 causal a masked step has 606 instructions per warp
      against 746 with `tile_mask` (478 unmasked;
      `results/mosaic-9f95796/ptxas.jsonl`; the prediction from 81df3c6's SASS was
      about 640), and beside it in one run (`results/mosaic-9f95796/fa-mosaic-*-true-
      rowbound.jsonl`, B x T = 16k, bf16, causal) the forward ran 1.03x at head dim
      64 at 1k and 2k (271.9 / 348.4 TFLOP/s against 264.0 / 338.3) and 1.00x / 1.00x
      at head dim 128 (where each score carries twice the matmul work), with
      the same bits over the compiled case table's causal rows
      (test_gpu_row_bound_mask_changes_no_bit).
    column_blocks: with row_bound_mask, a boundary tile's compares eight key columns at
      a time (pipeline._columns_within): each row's bounds less the thread's first
      columns are worked out once, and each element is one compare with a constant;
      off, each element's key column is compared with the row's bound, and for a tile
      of more than 32 columns a thread ptxas rebuilt each column's iota from the thread
      index (an S2R and four integer instructions before a compare). The same mask
      (tests/test_masks.py). Compiled for the H200 without a GPU (docs/mosaic.md, "Compiled
      here, for the H200"), the head-dim-64 causal forward's masked step at 4k keys
      (256-key tiles) is 1,000 instructions against 1,184 and spills nothing (24 bytes
      off); with 128-key tiles 4 more (565 against 561) and its unmasked step 6 fewer
      at head dim 64 (430 against 436). On; not yet timed.
    q_register_cols: the first this many of Q's head-dim columns (a multiple of 64; 0:
      none) are loaded into registers once per query tile, and Q K^T takes them as its
      wgmma A operand from there, the rest from shared memory. A wgmma that reads both
      operands from shared memory at N = 64 (head dim 256's 64-key tiles) moves 4 KiB
      per 32 tensor-core cycles, the whole 128 bytes a cycle an SM's shared memory
      gives, beside the TMA writes of the next tiles; an A from registers halves that
      matmul's reads. It costs block_q x q_register_cols / 256 registers a thread (Q is
      16-bit: rows x cols / 128 threads / 2 a register), held across the key loop. Not
      in GPU interpret mode (whose wgmma reads A from shared memory only), where it is
      0. Compiled at 19797c5 (`results/mosaic-19797c5/`): it gives the default's bits and
      passes the reference on every row of the compiled case table with 64 and with 128
      columns (46 of 46, `mosaic-tests-operands-in-registers.log`); ptxas: no spills at
      head dims 64, 128, 256 (`ptxas-operands-in-registers.jsonl`). Beside the default
      in one process (bf16, B x T = 16k, non-causal 8k, forward TFLOP/s): 64 columns
      472.8 / 595.5 / 621.0 against 466.2 / 587.6 / 613.5 at head dims 64 / 128 / 256
      (1.01x each); 128 columns 594.2 at 128 and 614.8 at 256 (1.01x / 1.00x). So
      shared-memory bandwidth is not what holds the forward back: at most about 1 %.
    kv_multicast: the grid's CTAs run in clusters of two on adjacent query tiles, which walk
      the same key tiles (the key range of both tiles' rows, masked per element as ever),
      and each K/V tile is loaded once for both by TMA multicast, each CTA's producer
      loading half; a slot is refilled once all four consumers of the cluster have released
      it (cluster barriers). Every CTA reads a K/V tile's bytes per block_q x NUM_CONSUMERS
      rows: 128 flops a byte at 64-row warpgroups, whatever the head dim, so at 600 TFLOP/s
      the SMs pull about 4.7 TB/s from L2, near what an H100-class L2 gives; two CTAs per
      load halve that. With persistent, the grid is one cluster per SM pair, and each
      cluster walks items of two adjacent query tiles in the persistent order (or
      head_rounds' and greedy_items' orders of pairs), a CTA each; split_tail splits the
      last round's pairs over the clusters. GPU interpret mode runs the clusters: the same
      bits as without, the reference, no data race (tests/test_mosaic.py, and
      tests/test_mosaic_options.py on the persistent grid, split or not, in head order);
      compiled on the persistent grid on an H100 (results/mosaic-ffa6c1d/), the default
      rows' bits (or, split, within merging) on all 30 cases of the table.
      Compiled at f309273 (bf16, B x T = 16k, beside the default row and cuDNN;
      results/mosaic-f309273/fa-mosaic-*-mc.jsonl), forward TFLOP/s with against without: 8k
      non-causal 487.7 / 472.6 (1.03x), 598.6 / 593.9 (1.01x) and 615.5 / 615.0 (1.00x) at
      head dims 64 / 128 / 256; 16k causal 470.2 / 462.8 and 613.2 / 599.6 (1.02x) at 64 /
      128; but at 2k, where the default rows are persistent (or take 128-key tiles), 0.89x /
      0.95x at 64 causal / not and 0.91x at 128 causal. Those runs timed the default first
      in its process, with the warm-up that at f309273 read the first implementation 1-4 %
      slow (benchmarks.bench.time_fn), so the 1-3 % gains are not yet told from that; its
      compiled bitwise test ran on 2 of the 30 case-table rows (the same bits,
      results/mosaic-f309273/mosaic-tests.log). On since the 68th session in the
      head-dim-128 causal row above 8192 keys only, after all 30 passed and it led there in
      two more processes (KV_MULTICAST_CAUSAL_128); off elsewhere, where it lost what the
      persistent grid gives (0.95-0.99x) or led in one process only. On the persistent
      grid (an H100 at 38e59cb, results/mosaic-38e59cb/): 0.969-0.996x the default at
      head dim 128 causal 2k-8k; 1.033x / 1.013x at 64 causal 4k (head order), which
      call 14 (benchmarks/next_calls.sh) times on the H200.
    multicast_own_keys: with kv_multicast, each CTA computes only its own tile's key
      tiles among its pair's, where a mask bounds the keys by row or document (causal, a
      window, segment ids; fwd_kernel.walks_own_keys), and passes the others' slots on
      (awaits each barrier phase, releases the slot): without it the pair's upper tile
      computes the lower's last key tiles, all masked for its rows, one 128-key tile a
      pair under a causal mask at 64-row warpgroups (about 1 / (2n + 1) of a pair of n
      and n + 1 tiles' work: 5 % at 2k keys, 0.8 % at 16k). The same bits (GPU interpret
      mode, tests/test_mosaic_options.py). 69th session; ptxas for sm_90a: no spills at
      head dim 128, causal, 2k-16k; 48 / 60 bytes at head dim 64 causal 4k (head order,
      256-key tiles), none without it. Compiled on an H100 (results/mosaic-ffa6c1d/
      mosaic-tests-clusters.log, mosaic-fe15cef/mosaic-tests-refix.log, and all again at
      38e59cb): the same bits and the reference on all 18 masked cases of the table, in
      both grids. Timed on that H100 (results/mosaic-38e59cb/): at head dim 128 causal
      1.037x / 1.042x / 0.998x the default at 2k in three processes, 0.994x / 1.000x at
      4k / 8k, 0.964x at 16k, 0.977x at 1k; at 64 causal 4k 0.978x / 0.995x. Off; call
      14 (benchmarks/next_calls.sh) times it on the H200 at head dim 128 causal.
    named_turns: the ping-pong hands each turn over one way (one arrive after a
      consumer's Q K^T is issued, one sync before its P V), on the SM's hardware named
      barriers (`bar.arrive` / `bar.sync`, pipeline.PingPong) rather than a shared-memory
      mbarrier that both consumers meet at twice a step (each of whose arrivals is 128
      threads' atomics on shared memory). tokamax's forward hands its turns over so, and
      at head dim 256 runs 1.10-1.11x ours with our tiles (docs/mosaic.md, "Wider key tiles");
      lowered for sm_90, its step and ours otherwise hold the same arithmetic. Compiled
      only: GPU interpret mode runs no inline PTX, and there it is off. Not with
      intra_overlap. Off in the field, on in the default rows (NAMED_TURNS_DEFAULT,
      with its evidence).
    named_releases: the consumers release each K and V slot with `bar.arrive` on a
      hardware named barrier and the producer waits with `bar.sync` (pipeline.NamedSlots),
      rather than 128 threads of each consumer arriving on a shared-memory mbarrier that
      the producer polls: tokamax's other synchronisation (docs/mosaic.md, "Wider key tiles").
      Compiled only, as named_turns. Not with kv_multicast (cluster barriers) or
      intra_overlap; at most MAX_NAMED_STAGES stages (16 barriers a CTA: 2 for the turns,
      2 per stage here, and Mosaic GPU's own). Compiled, the default's bits on all 30 rows of
      the case table; timed beside the default (bf16, B x T = 16k, forward, 2k / 8k;
      results/mosaic-{dc687cf,5aa4c1c}/) 0.99x / 0.99x on top of named_turns at head dim
      128, 0.96x / 0.98x at 256 non-causal and 0.92x / 0.98x causal. Off.
    o_from_registers: each consumer stores its O tile from registers straight to HBM
      (global stores) rather than staging it in shared memory for a TMA store, so that O
      needs no shared memory: at head dims 192-256, where O has no buffer of its own
      (`o_buffer`) and leaves through Q's, the next item's Q then need not wait for O's
      read-out. O is written once per item, 64 x head dim values a warpgroup, so the
      global stores' scattered sectors cost little beside the item's matmuls. Compiled
      at e17dedb, alone and with early_q_load, the persistent grid's bits and the
      reference on all 30 rows of the case table (results/mosaic-e17dedb/
      mosaic-tests-early-dqpp.log). Timed beside the default (bf16, B x T = 16k, head
      dim 256 non-causal, forward 2k / 8k; fa-mosaic-256-false-early.jsonl): 548.0 /
      643.8 TFLOP/s against 591.0 / 649.6 (0.93x / 0.99x). Off.
    split_tail: persistent, the last round's items (when the CTAs do not divide the
      items) split by keys over every CTA in equal runs of key tiles (stream-K over the
      tail, mosaic/split_tail.py), each piece's O (float32, normalised by its own row
      sums) and logsumexp written apart and merged after the kernel in a fixed order:
      every SM ends with the others instead of P - r of them waiting one item's time.
      At 16k tokens a batch every non-causal grid point has 2048 or 4096 equal items on
      132 SMs, a fill of 0.970 (benchmarks/launch_sim.py); split, about 1.0 less the
      merge. The same result up to float32 rounding (the pieces' sums), the same bits
      from call to call. Checked in GPU interpret mode against the reference and
      against the unsplit kernel; compiles for sm_90 without new spills at head dims
      64 and 128 (docs/mosaic.md, "The forward's last round split by keys"). On in
      the head-dim-64 non-causal rows (SPLIT_TAIL_64: 1.006-1.037x at 1k-16k on an
      H100); at 128 0.963x at 2k with XLA's merge, so only from 4096 keys and with
      tail_fixup (SPLIT_TAIL_128_MIN_KEYS).
    tail_fixup: with split_tail, the kernel merges each split item's pieces itself
      (stream-K's fix-up, mosaic/split_tail.py) instead of XLA after it: the pieces
      other than an item's first (each the first a CTA walks in its run) store O and
      the logsumexp in float32 from registers and signal a global semaphore; the
      first piece (the last its CTA walks) awaits them, merges them into its own in
      key order and writes the item's O as a whole item does. No float32 pieces read
      back and no merge kernels after the kernel, whose fixed cost (about 30 us in the
      47th session's H100 runs at head dim 128: 0.963x at 2k, 1.021x at 16k) undid
      the fill's 3 %. Compiled only: GPU interpret mode has no global semaphores, so
      there the XLA merge stands in (the same values up to float32 rounding). On in
      every split row (TAIL_FIXUP: at head dim 64 non-causal 0.99-1.01x XLA's merge
      at 2k-8k and 1.07x at 16k, on an H100).
    head_rounds: persistent and causal, the items in head order (a (batch, head)'s
      query tiles together, its bottom tile first) rather than tile-major (every (batch,
      head)'s bottom tile, then every next one), each round's items sorted longest first
      so that the rounds' alternating hand-out (`pipeline.persistent_item`) still evens
      the CTAs' work out (pipeline.head_rounds_order). Tile-major, the SMs together walk
      the key tiles of 132 different heads, and a head's next query tile comes back to
      them only once every head has had its turn: at head dim 64 causal 1k (16 x 32
      heads of 256 KiB of K and V) that is 128 MiB between a head's reads against 50 MiB
      of L2, so each item reads its K and V from HBM: 4.0x the compulsory fetches by
      launch_sim.forward_kv_fetches (a model), 1.0x for the grid of one CTA per item,
      whose launch order (the grid's last axis, batch, fastest, then query tiles, then
      heads: Mosaic GPU maps it to blockIdx.x) keeps about one head's, 4 MiB there, in
      use. In head order a round's 132 items take about 16 (batch, head) pairs' K and
      V (1.0x by the model). The items' work is the same, in another order: the same
      bits. Without a causal mask
      the persistent order is head order already, and this changes nothing. Not with
      split_tail (whose pieces assume the plain orders). On in the causal rows of at
      most 2048 keys at head dims 64 and 128 (HEAD_ROUNDS: 1.05-1.15x the grid of one
      CTA per item there, on an H100) and of 2049-4096 keys at head dim 64
      (HEAD_ROUNDS_MAX_KEYS_64: 1.03-1.05x).
    greedy_items: with head_rounds, each CTA's items come from a list schedule rather
      than from the rounds' alternating hand-out (pipeline.greedy_items_order): the
      items in the grid of one CTA per item's launch order (heads, query tiles from the
      bottom, batch elements), each to the CTA whose modelled work ends first, as the
      block scheduler gives that grid's CTAs to the SMs as they free. The rounds end
      ragged: by launch_sim's model the head-order table fills 0.970 of the SMs' time at
      head dim 128 causal 2k-16k, where the grid of one CTA per item fills 0.983-0.999,
      and the list schedule the same as that grid, keeping the persistent grid's overlap
      of one item's end with the next one's start. Decided before the kernel from each
      query tile's key tiles at the call's full lengths, so ragged lengths and segment
      ids may leave it less even than the hardware's; the same items and bits in any
      order. The table gains a row of per-CTA counts (one load a CTA). Not with
      order_ranges (whose rows follow the head-order table).
    order_ranges: with head_rounds, each row of the items' table also holds the item's
      key tiles (lo, full_lo, full_hi, hi) and its batch element's lengths, gathered
      before the kernel (pipeline.order_rows), so that a consumer starting an item waits
      on one global round trip (its row) rather than two in series (the table's entry,
      then the range and lengths it indexes): compiled for the H200 the head-dim-64
      causal 1k default's item start has the entry's LDG, then the range's LDG.128 and
      the lengths' two LDGs behind it; the tile-major order computes its item and has
      only the second. The same items, bounds and bits. Off: on an H100 at 7e1026e
      (results/mosaic-7e1026e/, two processes) 0.99x / 1.00x / 1.01x / 0.98x head
      order without it at head dim 64 causal 1k / 2k / 4k (twice), 1.01x / 1.00x /
      1.03x / 1.02x at 128, at 8k 1.02x / 1.00x: within a run's spread of each other
      but at head dim 128 4k, where head order itself is not the default.
    early_q_load: persistent, each consumer loads its next item's Q as soon as this
      item's last Q K^T has been read (the tile loop's last step) rather than in the
      epilogue, so that the load's latency hides behind that step's softmax and P V
      rather than holding the next item's first Q K^T (tokamax's persistent forward,
      like our rows with an O buffer, loads it after the tile loop, before the
      epilogue; at head dims 192-256 ours loads it after the epilogue, once O has left
      Q's buffer). Needs O out of Q's buffer: a buffer of its own
      (`o_buffer`, head dims up to 128) or o_from_registers. GPU interpret mode runs
      it. Compiled, the same bits (above); with o_from_registers at head dim 256
      non-causal 518.9 / 607.1 TFLOP/s against the default's 591.0 / 649.6 at 2k / 8k
      (0.88x / 0.93x), slower than O from registers alone (where the early load costs
      the loop's last step is not measured). At head dim 64 (an O buffer) on an H100 at
      4c2c14e, one process: non-causal 408.7 / 437.5 TFLOP/s at 1k / 2k against the
      default's 384.0 / 425.8 and a second copy of it, 394.7 / 427.4 (1.035-1.064x,
      1.024-1.027x); causal, where the default is not persistent, 0.88x / 0.87x it, as
      the persistent grid alone. At 78baa53 (an H100, two processes;
      results/mosaic-78baa53/fa-mosaic-64-false-early-q-{1,2}.jsonl) against the
      head-dim-64 non-causal default: 1.068x / 1.016x at 1k, 0.987x / 1.030x at 2k,
      1.019x / 1.016x at 4k and 0.939x / 0.957x at 16k, short of the 2 % at 1k and 2k
      in both and the loss of 1 % at most from 4k that would have taken it: off.
      At head dim 128 non-causal (an O buffer) on an H100 at e6ab66d, two processes,
      the order of the implementations changed between them
      (results/mosaic-e6ab66d/fa-mosaic-128-false-early-q{,-2}.jsonl): 1.025x / 1.050x
      the default at 1k (510.1 / 515.2 TFLOP/s), 1.048x / 0.999x at 2k, 0.987x at 4k
      (one process; 1.012-1.015x in three more at 5d326d1). With its O buffer it keeps
      the bits (compiled at c0674ef, 25 of 25), and it is the row up to 4096 keys there
      (EARLY_Q_LOAD_MAX_KEYS_128).
    poly_exp2_cols: the first this many columns of each score tile (a multiple of 8, at
      most block_kv) take their exp2 from a cubic on the FMA and integer units
      (softmax.exp2_poly, relative error below 8e-5, below bfloat16's and float16's
      rounding of P), the rest from the SM's multi-function unit (MUFU.EX2), which
      issues 16 a clock per SM: at head dim 64 a score's two matmuls take 256 flops, 1/16
      of a clock at the tensor cores' 4,096 flops a clock per SM, the same as its exp2,
      so the MUFU may bound the softmax there (FlashAttention-4 offloads part of the
      exp2 so). Costs nine FMA-pipe operations per element moved. 0: none. Compiled at
      61a3ad1, it passes the reference on all 30 rows of the case table with a quarter
      and with all of each tile's columns (results/mosaic-61a3ad1/mosaic-tests-*.log);
      timed beside the default (bf16, B x T = 16k, forward TFLOP/s; results/
      mosaic-61a3ad1/fa-mosaic-*-poly.jsonl, -64-true-short.jsonl) it is slower at every
      share: head dim 64 non-causal 8k 429.6 / 430.2 / 394.7 with 32 / 64 / 128 of 256
      columns against 471.6 (0.91x / 0.91x / 0.84x), causal 2k 309.8 / 336.3 with 32 of
      128 (0.92x), head dim 128 8k 584.8 / 568.2 with 16 / 32 of 128 against 595.1
      (0.98x / 0.95x), the variants' SM clocks as high as the default's or higher. A
      ninth of the elements moved cost 9 %: the softmax is bound by the instructions it
      issues, not by the MUFU's rate. Off.
    rescale_slack: None, or the growth of a row's max (in base-2 units) that the running
      output may lag behind. The accumulator's rescale (acc * alpha: head dim / 2 float32
      multiplies per thread a step, 64 at head dim 128 beside the 64 scores' softmax)
      runs in a branch that a warp skips when no row of its 16 has grown by more than
      this since its scale was last set (vote.sync.any); the rows then keep their old
      max, so p may reach 2^slack (FlashAttention-4's conditional rescaling). 0 skips
      only where no row grew at all. The output is the same softmax; rounding differs
      (p carries up to `slack` more bits of exponent, none of mantissa). In GPU interpret
      mode each row decides alone (no warps there), with alpha 1 where it does not
      rescale. With intra_overlap the skip is taken on the rescale after each step's P V
      (the vote there is on alpha != 1, which the softmax leaves on exactly the rows it
      rescales; since the 43rd session, compiled here, not yet timed). None: always.
      Timed at 7c428a8 beside the default (bf16, B x T = 16k, non-causal 8k): slack 8
      ran 1.02x at head dim 128 and 0.94x at 64 (452.5 against 479.3 TFLOP/s), where a
      step's rescale is 32 multiplies a thread against the vote, the branch and the
      max's selects. Default 8 at head dims above 64 since 02c64a5, except causal calls
      of at most 1024 keys (RESCALE_SLACK and default_mosaic_config below, with the
      evidence).
    row_sum_wgmma: the running row sums l_i are summed by the tensor cores rather than
      by each thread: beside each step's P V, every 64 keys of P are multiplied by one
      [64, 8] tile of ones in shared memory, into a [block_q, 8] accumulator (every
      column a row sum) that is rescaled with O. At head dim 64 a thread's step spends
      about one FADD per score element on the sum; compiled for the H200 without a GPU
      (docs/mosaic.md, "Row sums on the tensor cores") the unmasked steps issue 627 / 628
      instructions against 740 / 741 at head dim 64 (256-key tiles, causal 4k / not)
      and 429 against 488 at 128, for wgmmas of N = 8 beside the P V's N = 64 (6 % more
      matmul work at head dim 64), and spill nothing. The sum is then of P as the P V
      takes it (rounded to the inputs' dtype) rather than of its float32 values: O's
      weights sum to exactly its divisor, and the logsumexp moves within the rounding.
      Not with intra_overlap. On in the head-dim-64 rows of non-causal calls (1.05-1.06x
      at 1k-8k; ROW_SUM_WGMMA_64's comment), off elsewhere (level causal, 0.97-0.99x at
      head dim 128).
    consumers: consumer warpgroups a CTA (2 or 3), each on its own block_q rows, beside
      the producer. Three is FlashAttention-3's choice at head dim 64 (192 x 128 or
      192 x 192 tiles): a third softmax in flight where the softmax, not the tensor
      cores, sets the pace (our head-dim-64 forward runs at 0.69 of the dense matmul
      rate, head dim 128's at 0.90). The ping-pong then goes round the three, each
      handing its turn to the next on a named barrier (named_turns, or no ping-pong),
      and each consumer gets 160 registers (THREE_CONSUMER_REGISTERS) where two get 232:
      a 64 x 128 score tile fits beside head dim 64's accumulator, a 256-key one does
      not. Not with intra_overlap, named_releases or kv_multicast (each built for two).
      Compiled at 29ce459 on each case's default row with at most 128-key tiles, it
      passes all 25 case-table rows up to head dim 128 (results/mosaic-29ce459/
      mosaic-tests.log); ptxas gives the head-dim-64 forward no spills. Timed beside the
      two-consumer row (bf16, B x T = 16k, forward; results/mosaic-29ce459/ and
      results/mosaic-99c36a7/, where it was the default for a call and the old row the
      variant), three / two consumers at head dim 64: not causal 0.90x / 0.96x at 2k /
      4k, 1.015x and 0.979x at 8k in two calls, 1.021x and 1.011x at 16k; causal 0.93x at
      4k, 1.02x / 0.96x / 0.99x at 8k in three calls, 1.026x and 1.004x at 16k. Level
      within the calls' noise from 8k and slower below, so it stays off. At head dim 128
      (160 registers against O's 64 and the score tile's): 128-key tiles serialize every
      wgmma (C7512, 260 bytes of spills) and run 0.69x / 0.67x the default non-causal /
      causal 8k; 64-key tiles spill nothing and run 0.96x / 0.92x.
    """

    block_q: int = 64
    block_kv: int = 128
    num_stages: int = 2
    schedule_barrier: bool = True
    p_in_registers: bool = True
    rescale_before_turn: bool = False
    early_k_wait: bool = False
    qk_behind_pv: bool = False
    intra_overlap: bool = False
    persistent: bool = False
    row_bound_mask: bool = True
    column_blocks: bool = True
    q_register_cols: int = 0
    kv_multicast: bool = False
    multicast_own_keys: bool = False
    named_turns: bool = False
    named_releases: bool = False
    o_from_registers: bool = False
    early_q_load: bool = False
    split_tail: bool = False
    tail_fixup: bool = False
    head_rounds: bool = False
    greedy_items: bool = False
    order_ranges: bool = False
    poly_exp2_cols: int = 0
    rescale_slack: float | None = None
    row_sum_wgmma: bool = False
    consumers: int = NUM_CONSUMERS

    def __post_init__(self):
        if self.consumers not in (2, 3):
            raise ValueError(f"{self.consumers=} must be 2 or 3 (consumer warpgroups a CTA)")
        if self.consumers == 3 and (
            self.intra_overlap
            or self.named_releases
            or self.kv_multicast
            or (self.schedule_barrier and not self.named_turns)
        ):
            raise ValueError(
                "consumers=3 hands the ping-pong's turns round on named barriers: it needs "
                "named_turns (or schedule_barrier=False), and not intra_overlap, "
                "named_releases or kv_multicast (each built for two consumers)"
            )
        if self.consumers == 3 and self.block_kv > 192:
            raise ValueError(
                f"consumers=3 gives each consumer {THREE_CONSUMER_REGISTERS} registers, and a "
                f"{self.block_q} x {self.block_kv} score tile takes "
                f"{self.block_q * self.block_kv // WARPGROUP_THREADS} of them: ptxas cannot "
                "compile the step (C7602, for the H200 at head dim 64); take block_kv <= 192 "
                "with three consumers"
            )
        slack = self.rescale_slack
        if slack is not None and (
            isinstance(slack, bool) or not isinstance(slack, (int, float)) or not 0 <= slack < 64
        ):
            raise ValueError(f"{self.rescale_slack=} must be None or a number from 0 to 64")
        if self.row_sum_wgmma and self.intra_overlap:
            raise ValueError(
                "row_sum_wgmma sums P beside the plain schedule's P V: not with intra_overlap"
            )
        if self.poly_exp2_cols % 8 or not 0 <= self.poly_exp2_cols <= self.block_kv:
            raise ValueError(
                f"{self.poly_exp2_cols=} must be a multiple of 8 from 0 to block_kv "
                f"({self.block_kv}): a score tile's columns come in eights a thread"
            )
        if self.named_releases and (
            self.kv_multicast or self.intra_overlap or self.num_stages > MAX_NAMED_STAGES
        ):
            raise ValueError(
                "named_releases takes the ring's releases to named barriers: not with "
                f"kv_multicast or intra_overlap, and at most {MAX_NAMED_STAGES} stages"
            )
        if self.named_turns and (self.intra_overlap or not self.schedule_barrier):
            raise ValueError(
                "named_turns hands the ping-pong's turns over: it needs schedule_barrier "
                "and not intra_overlap (the default rows set it: pass named_turns=False "
                "with those)"
            )
        if self.q_register_cols % 64 or self.q_register_cols < 0:
            raise ValueError(f"{self.q_register_cols=} must be a multiple of 64 (0: none)")
        if self.block_q % 64 or self.block_q < 64:
            raise ValueError(f"{self.block_q=} must be a positive multiple of 64")
        if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
            raise ValueError(f"{self.block_kv=} must be 64, 128, 192 or 256")
        if self.num_stages < 1:
            raise ValueError(f"{self.num_stages=} must be >= 1")
        if self.intra_overlap and (self.rescale_before_turn or self.early_k_wait):
            raise ValueError(
                "intra_overlap is a schedule of its own: it takes neither "
                "rescale_before_turn nor early_k_wait"
            )
        if self.qk_behind_pv and not self.early_k_wait:
            raise ValueError(
                "qk_behind_pv awaits the next K tile behind P V, as early_k_wait does: it "
                "needs early_k_wait (and so not intra_overlap)"
            )
        if self.intra_overlap and self.persistent:
            raise ValueError("intra_overlap is a schedule of its own: not with persistent")
        if self.multicast_own_keys and not self.kv_multicast:
            raise ValueError(
                "multicast_own_keys walks a cluster's pair of tiles: it needs kv_multicast"
            )
        if self.early_q_load and not self.persistent:
            raise ValueError(
                "early_q_load loads a persistent CTA's next Q early: it needs persistent"
            )
        if self.order_ranges and not self.head_rounds:
            raise ValueError(
                "order_ranges puts the key ranges in head_rounds' table: it needs head_rounds"
            )
        if self.greedy_items and (not self.head_rounds or self.order_ranges):
            raise ValueError(
                "greedy_items replaces head_rounds' table with a list schedule: it needs "
                "head_rounds, and not order_ranges (whose rows follow the head-order table)"
            )
        if self.head_rounds and (not self.persistent or self.split_tail):
            raise ValueError(
                "head_rounds orders a persistent grid's items: it needs persistent, and not "
                "split_tail (whose pieces are cut from the plain orders)"
            )
        if self.split_tail and not self.persistent:
            raise ValueError(
                "split_tail splits a persistent grid's last round: it needs persistent"
            )
        if self.tail_fixup and not self.split_tail:
            raise ValueError(
                "tail_fixup merges split_tail's pieces in the kernel: it needs split_tail"
            )

    def o_buffer(self, head_dim: int, itemsize: int = 2) -> bool:
        """Whether O has a shared-memory buffer of its own (persistent, where it fits), so
        that the next item's Q loads while O is stored; else O leaves through Q's (or,
        with o_from_registers, through no shared memory at all)."""
        if not self.persistent or self.o_from_registers:
            return False
        return self._smem_bytes(head_dim, itemsize, o_buffer=True) <= SMEM_BYTES

    def o_apart(self, head_dim: int, itemsize: int = 2) -> bool:
        """Whether O leaves apart from Q's buffer (by a buffer of its own, or from
        registers), so that the next item's Q may load before O is stored; else only
        once O has left Q's buffer (and early_q_load cannot be)."""
        return self.o_from_registers or self.o_buffer(head_dim, itemsize)

    @property
    def ones_tile(self) -> tuple[int, int]:
        """row_sum_wgmma's tile of ones, a consumer's: ROW_SUM_COLS rows and 256 columns,
        of which the wgmmas read the first 64 (fwd_kernel.ONES_KEYS); a warpgroup fills it
        in whole 128-byte swizzle tiles, four at a time (Mosaic GPU's register-to-shared
        copy layout takes no fewer)."""
        return ROW_SUM_COLS, 256

    def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
        """Shared memory the forward kernel allocates at this (padded) head dim (an upper
        bound: Mosaic GPU reports up to 1 KiB less)."""
        return self._smem_bytes(head_dim, itemsize, self.o_buffer(head_dim, itemsize))

    def _smem_bytes(self, head_dim: int, itemsize: int, o_buffer: bool) -> int:
        n = self.consumers
        q_o = n * self.block_q * head_dim * itemsize * (2 if o_buffer else 1)
        kv = 2 * self.num_stages * self.block_kv * head_dim * itemsize
        p_tile = n * self.block_q * self.block_kv * itemsize
        # P staged in shared memory: two buffers when the next softmax overlaps a P V.
        p = 0 if self.p_in_registers else p_tile * (2 if self.intra_overlap else 1)
        lse = n * self.block_q * 4
        ones = n * math.prod(self.ones_tile) * itemsize if self.row_sum_wgmma else 0
        barriers = 8 * (4 * self.num_stages + n + 1)
        return q_o + kv + p + lse + ones + barriers + MOSAIC_OVERHEAD


# MosaicConfig.row_sum_wgmma: the columns of the ones tile that P is multiplied by (the
# narrowest wgmma), each column of the product a row sum of P.
ROW_SUM_COLS = 8


def padded_head_dim(head_dim: int) -> int:
    """wgmma tiles and the 128-byte swizzle want head dims in multiples of 64."""
    return -(-head_dim // 64) * 64


# Q's head-dim columns each default row holds in registers (MosaicConfig.q_register_cols).
# Beside the rows without it, in one process each (results/mosaic-19797c5/; bf16, B x T
# = 16k, forward TFLOP/s): non-causal 8k 472.8 / 595.5 / 621.0 against 466.2 / 587.6 /
# 613.5 at head dims 64 / 128 / 256; 16k 485.3 / 604.6 / 627.8 against 481.8 / 599.4 /
# 621.6, and 595.4 against 582.7 at head dim 128 causal 16k: 1.01x-1.02x at each of the
# seven points. 128 columns ran 1.01x / 1.00x at 128 / 256 (8k). Compiled, it gives the
# rows' bits on all 23 rows of the case table, with 64 columns and with 128
# (test_gpu_q_register_cols_match_reference_and_change_no_bit, 46 of 46), so the
# default's earlier compiled tests stand for it.
Q_REGISTER_COLS = 64


# The default rows hand the ping-pong's turns over on hardware named barriers
# (MosaicConfig.named_turns). Beside the mbarrier hand-over in one process at dc687cf
# (results/mosaic-dc687cf/; bf16, B x T = 16k, forward TFLOP/s): head dim 128 non-causal
# 541.8 / 512.8 and 599.7 / 591.5 at 2k / 8k (1.06x / 1.01x), causal 445.1 / 446.8 and
# 557.9 / 554.7 (1.00x / 1.01x); head dim 64 non-causal 440.5 / 427.1 and 468.2 / 465.2
# (1.03x / 1.01x); head dim 256 at 5aa4c1c (results/mosaic-5aa4c1c/, this as the default
# beside named_turns=False) 582.4 / 565.1 and 641.0 / 636.1 non-causal (1.03x / 1.01x),
# 512.1 / 483.6 and 584.3 / 581.5 causal (1.06x / 1.00x). Compiled, it gives the mbarrier
# hand-over's bits on all 30 rows of the case table, alone and with named_releases
# (results/mosaic-dc687cf/mosaic-tests-named-turns.log, mosaic-tests.log), so the
# default's earlier compiled tests stand for it.
NAMED_TURNS_DEFAULT = True


# The running output's conditional rescale (MosaicConfig.rescale_slack) in the default rows
# of head dims 128-256, since 02c64a5. Compiled, slack 8 and 0 on each case's default row
# pass the reference on all 30 rows of the case table (60 of 60,
# results/mosaic-02c64a5/mosaic-tests.log). Timed beside the old default and the peers in
# one process each (bf16, B x T = 16k, forward TFLOP/s, slack 8 against the old row;
# results/mosaic-02c64a5/fa-mosaic-*.jsonl): head dim 256 non-causal 574.2 / 608.2 /
# 644.2 / 668.9 against 570.1 / 586.8 / 609.4 / 637.3 at 2k / 4k / 8k / 16k (1.01x /
# 1.04x / 1.06x / 1.05x), causal 482.1 / 571.4 / 618.1 / 647.5 against 460.9 / 537.5 /
# 563.3 / 605.4 (1.05x / 1.06x / 1.10x / 1.07x), at SM clocks 0-120 MHz lower than the
# old row's: a step's rescale there is 128 multiplies a thread beside 32 scores' exp2.
# Head dim 128 non-causal 1.007x / 1.016x / 1.020x / 1.017x / 1.019x at 1k / 2k / 4k /
# 8k / 16k, causal 1.028x / 1.043x / 1.026x at 2k / 8k / 16k but 0.969x at 1k (338.9
# against 349.7: few steps a row, most of them on the diagonal, where maxima grow), so
# causal calls of at most RESCALE_SLACK_OFF_KEYS keys (and calls whose causal flag is not
# known) keep the plain rescale. Head dim 64 causal 0.967x / 0.997x / 0.992x at 2k / 4k /
# 8k (and 0.94x non-causal 8k at 7c428a8): off there. Slack 4 and 16 at head dim 128
# (results/mosaic-7496147/): causal 2k 431.5 / 425.7 against 8's 430.2, non-causal 8k
# 587.7 / 579.5 against 593.9.
RESCALE_SLACK = 8.0


RESCALE_SLACK_OFF_KEYS = 1024


# The head-dim-64 rows of non-causal calls sum the softmax's rows on the tensor cores
# (MosaicConfig.row_sum_wgmma), since the session of 12-05. Timed beside the row without
# it, JAX's Mosaic FA3 and cuDNN in one process (results/mosaic-1d6a8bd/
# fa-mosaic-fwd-row-sum.jsonl; bf16, B x T = 16k, forward TFLOP/s): non-causal 391.4 /
# 417.2 / 453.2 against 367.7 / 396.5 / 430.8 at 1k / 2k / 8k (1.06x / 1.05x / 1.05x;
# the best peer 359.3 / 397.5 / 436.4); causal 257.8 / 331.9 / 429.9 against 257.0 /
# 325.8 / 434.6 (1.00x / 1.02x / 0.99x), so causal calls and those whose flag is not
# known keep the per-thread sums. At head dim 128 (fa-mosaic-fwd-row-sum-128.jsonl)
# 0.99x / 0.97x non-causal at 2k / 8k, 0.96x / 1.01x causal: off there. Compiled, it
# passes the reference on all 30 rows of the case table on each case's default row
# (mosaic-tests-row-sum.log).
ROW_SUM_WGMMA_64 = True


# The head-dim-64 rows of non-causal calls split the persistent grid's last round by keys
# (MosaicConfig.split_tail), since 00676b3's runs. Timed beside the row without it and
# the peers in one process, on an H100 (the tool lent no H200; results/mosaic-00676b3/;
# bf16, B x T = 16k, forward TFLOP/s): with it 410.8 / 444.9 / 466.5 / 481.2 / 491.2
# against 408.2 / 434.2 / 461.1 / 464.1 / 487.0 at 1k / 2k / 4k / 8k / 16k (1.006x /
# 1.025x / 1.012x / 1.037x / 1.009x; at 4k and 16k in a second run 1.011x / 1.014x;
# fa-mosaic-64-false-fwd-split-tail.jsonl, fa-mosaic-64-false-split-tail.jsonl,
# fa-mosaic-64-false-waves.jsonl). At head dim 128 0.963x / 0.999x / 1.007x / 1.021x at
# 2k / 4k / 8k / 16k (fa-mosaic-128-false-split-tail.jsonl): off there. Compiled, the
# reference, the unsplit grid within float32 merging and the same bits twice on its
# three split cases, one of them this row (results/mosaic-00676b3/mosaic-tests-call-4.log,
# test_gpu_split_tail_matches_reference).
SPLIT_TAIL_64 = True

# The split rows merge their pieces in the kernel (MosaicConfig.tail_fixup), and the
# head-dim-128 non-causal rows of at least SPLIT_TAIL_128_MIN_KEYS keys split too, since
# the 57th session's runs on an H100 (results/mosaic-ffd2f05/, mosaic-94230ba/; bf16,
# B x T = 16k, forward TFLOP/s, ratios to the unsplit row in the same process, three
# processes at head dim 128: fa-mosaic-128-false-fixup{,-2,-3}.jsonl). At head dim 128
# the fix-up ran 0.990x / 0.990x at 2k, 1.002x / 1.041x / 1.007x at 4k, 0.999x / 1.020x
# / 1.068x at 8k and 1.025x / 1.009x / 0.947x at 16k (the last beside the unsplit row's
# highest 16k reading, 627.1 against 576.5 and 586.0 in the other two); XLA's merge
# 0.932x / 0.978x at 2k and about level with the fix-up from 4k. In those three the
# fix-up drew 5-10 % more power at the same or lower clocks (the rows' power_w and
# sm_mhz): with the last wave's SMs busy, the 700 W limit may take back part of the 3 %.
# A fourth (mosaic-9394670/, the new default beside the unsplit row and the peers):
# 1.045x / 1.040x at 4k / 16k, 1.05x the best peer at both.
# At head dim 64 non-causal, against XLA's merge (fa-mosaic-64-false-fixup{,-2}.jsonl):
# 0.994x / 1.008x / 0.994x at 2k / 4k / 8k, 1.068x / 1.066x at 16k in two processes.
# Compiled, the reference, the unsplit grid within float32 merging and the same bits
# twice on all five split cases (results/mosaic-94230ba/mosaic-tests.log).
TAIL_FIXUP = True
SPLIT_TAIL_128_MIN_KEYS = 4096


# A persistent default row without its persistent grid (one CTA per work item): what it
# takes in place of the options it carries that need that grid (split_tail,
# SPLIT_TAIL_64; early_q_load, head_rounds, greedy_items and order_ranges, HEAD_ROUNDS), as
# the tests, benchmarks.lowered_ops and lowered_digest build it.
WITHOUT_PERSISTENT = dict(
    split_tail=False,
    tail_fixup=False,
    early_q_load=False,
    head_rounds=False,
    greedy_items=False,
    order_ranges=False,
)


# intra_overlap is a schedule of its own: what a default row takes in place of the options
# it carries that the overlap refuses (MosaicConfig.__post_init__ says why for each), as
# the tests and benchmarks.lowered_digest build it.
OVERLAP_REPLACES = dict(
    early_k_wait=False,
    named_turns=False,
    rescale_before_turn=False,
    persistent=False,
    **WITHOUT_PERSISTENT,
    row_sum_wgmma=False,
    named_releases=False,
)


# Key lengths up to which the head-dim-64 default takes its short-length rows: 128-key
# tiles when causal, persistent when the causal flag is not known (measured at 1k and 2k);
# and up to which the causal rows at head dims 64 and 128 are persistent (HEAD_ROUNDS).
PERSISTENT_MAX_KEYS = 2048

# The causal forward at head dims 64 and 128 up to PERSISTENT_MAX_KEYS keys: persistent,
# its items in head order (head_rounds) and each next Q loaded early (early_q_load), not
# one CTA per item. On an H100 at 6f8830f (bf16, B x T = 16k, forward TFLOP/s, one
# process a head dim; results/mosaic-6f8830f/fa-mosaic-{64,128}-true-head-rounds*.jsonl):
# head dim 64 1k / 2k 289.9 / 361.2 against the one-CTA-per-item row's 255.6 / 314.2
# (1.13x / 1.15x; cuDNN 260.6 / 323.5), tile-major 242.1 / 281.0, head order without
# early Q loads 286.7 / 353.6; head dim 128 1k / 2k 358.6 / 472.1 against 327.4 / 449.1
# (1.10x / 1.05x; cuDNN 326.2 / 410.5). Longer, it loses or ties: head dim 64 4k / 8k
# 1.02x / 0.99x, head dim 128 4k / 8k 0.99x / 0.93x (the rounds' sort evens the CTAs'
# work less well than the tile-major order's shrinking last rounds, and at those lengths
# a CTA's fixed costs weigh little).
HEAD_ROUNDS = True

# Key lengths up to which the head-dim-64 causal row takes HEAD_ROUNDS' schedule (with
# its 256-key tiles above PERSISTENT_MAX_KEYS). At 4096 keys, on an H100 at 7e1026e
# (results/mosaic-7e1026e/fa-mosaic-causal-4k-head-rounds.jsonl and -4k-8k-order-ranges,
# two processes, the order of the implementations reversed between them): 399.8 / 399.7
# TFLOP/s against the one-CTA-per-item row's 387.4 / 380.3 (1.03x / 1.05x; 1.02x at
# 6f8830f), cuDNN 370.8 / 366.4; at 8192 keys 425.3 against 440.0 (0.97x), and at head
# dim 128 4096 keys 1.01x / 0.98x: so 4096, at head dim 64 only.
HEAD_ROUNDS_MAX_KEYS_64 = 4096

# Key lengths above PERSISTENT_MAX_KEYS up to which the head-dim-128 causal row is
# persistent with its items from the list schedule (MosaicConfig.greedy_items: head
# order's items handed out, before the kernel, as the block scheduler hands out the grid
# of one CTA per item; early Q loads). On an H100 at 4db759e (bf16, B x T = 16k, forward
# TFLOP/s, one process; results/mosaic-4db759e/fa-mosaic-128-true-greedy.jsonl): 540.0 /
# 592.4 / 601.0 at 4k / 8k / 16k against the one-CTA-per-item row's 508.1 / 576.8 /
# 612.0 (1.063x / 1.027x / 0.982x), tokamax 498.4 / 545.5 / 611.5. So to 8192 keys; at
# 16k the grid keeps the lead. Compiled there, its bits equal the tile-major grid's on
# the 16 causal cases (mosaic-tests.log there). One process on an H100, not the H200.
# Again at 16k on an H100 at de9ebe2: 615.1 against 625.9, 0.983x
# (results/mosaic-de9ebe2/fa-mosaic-128-true-16k-options.jsonl).
GREEDY_ITEMS_MAX_KEYS_128 = 8192

# Above GREEDY_ITEMS_MAX_KEYS_128 the head-dim-128 causal row (one CTA per item) runs its
# CTAs in clusters of two on neighbouring query tiles that load each K/V tile once for
# both (MosaicConfig.kv_multicast: half the L2 reads). Beside the row without it, bf16,
# B x T = 16k, causal 16k, forward TFLOP/s: 611.8 against 602.5 (1.015x) and 631.8
# against 615.4 (1.027x) in two processes on an H100 (results/mosaic-512a5d0/
# fa-mosaic-128-true-multicast.jsonl, results/mosaic-eebe5ae/
# fa-mosaic-128-true-multicast-2.jsonl; tokamax 600.4 / 622.3); on the H200 at f309273,
# older kernels, 613.2 against 599.6 (1.023x, results/mosaic-f309273/
# fa-mosaic-128c-mc.jsonl). Where the default is persistent it lost: causal 8k 572.9
# against the list schedule's 602.3 (0.951x), non-causal 4k-16k 0.961-0.974x. Compiled,
# it gives the row without it its bits on all 30 cases of the table (the default row of
# each, without the persistent grid; results/mosaic-eebe5ae/mosaic-tests-multicast.log).
KV_MULTICAST_CAUSAL_128 = True

# Key lengths up to which the head-dim-128 non-causal row loads each next Q early
# (MosaicConfig.early_q_load, O in its own buffer). On an H100 at e6ab66d (bf16, B x T =
# 16k, forward TFLOP/s, two processes; results/mosaic-e6ab66d/fa-mosaic-128-false-early-q
# {,-2}.jsonl): 510.1 / 515.2 at 1k against the row without it, 497.5 / 490.5 (1.025x /
# 1.050x); at 2k 1.048x / 0.999x, at 4k 0.987x. As this row, on an H100 at c0674ef with
# it applied (results/mosaic-c0674ef-early1k/fa-mosaic-128-false-early-default-{1,2}.jsonl,
# two processes): 505.8 / 506.0 at 1k against 489.3 / 489.4 without it (1.034x / 1.034x),
# tokamax 475.2 / 488.3; at 2k 0.997x / 1.037x. Compiled with its O buffer, the same bits
# as without the early load on the 25 cases up to head dim 128
# (results/mosaic-c0674ef/mosaic-tests-early-q.log), and the row passes the default's
# reference test (mosaic-c0674ef-early1k/mosaic-tests-default-128.log). An H100, not the
# H200. At 2k it led in some processes only (1.048x / 0.999x / 0.997x / 1.037x in those
# four), so 2k kept the later load until three more processes on an H100 at cf5591f
# (results/mosaic-cf5591f/fa-mosaic-128-false-2k-early-{1,2,3}.jsonl, beside tokamax and
# cuDNN): 544.4 / 537.7 / 547.1 against 538.0 / 531.4 / 541.5 (1.012x / 1.012x /
# 1.010x; tokamax 516.7 / 522.3 / 525.4). Over the seven processes never below 0.997x,
# median 1.012x, mean 1.016x: the row up to 2048 keys since. Each 2k row passed the
# benchmark's check against the float32 reference; compiled at f43cbf5 (an H100), the
# default's reference test on all 31 cases, among them a 2048-key case of this row, and
# the split last round's on its 2000-key case, now with early Q loads
# (results/mosaic-f43cbf5/mosaic-tests.log). With the split last round as well
# (split_tail, tail_fixup) 0.998x / 0.947x / 0.988x the default at 2k; split alone 0.971x
# / 0.984x / 1.002x. At 4k, where the row splits, the early load ran 0.987x once at
# e6ab66d; then, in three processes on an H100 at 5d326d1 beside tokamax (call 10 of
# docs/mosaic.md's "Next device calls"; results/mosaic-5d326d1/fa-mosaic-128-false-early-
# 4k-8k-{1,2,3}.jsonl), 603.3 / 610.7 / 605.4 at 4k against the split row's 594.1 / 602.5
# / 598.0 (1.015x / 1.014x / 1.012x; tokamax 547.1 / 589.2 / 566.0), but at 8k 1.002x /
# 0.998x / 0.991x: so the row up to 4096 keys (early with the split last round from 4096;
# with e6ab66d's, whose 4k row split too, 0.987x in one process of four at 4k). Compiled
# at 8b95507 (an H100), the default's reference test on its nine head-dim-128 cases, a
# ragged GQA case of 4096 keys among them (results/mosaic-8b95507/mosaic-tests-h128.log).
EARLY_Q_LOAD_MAX_KEYS_128 = 4096


# Key lengths up to which the head-dim-192/256 default is persistent when not causal
# (measured at 1k, 2k, 4k, 8k and 16k).
PERSISTENT_MAX_KEYS_256 = 16384


def default_mosaic_config(
    head_dim: int, seq_k: int | None = None, causal: bool | None = None
) -> MosaicConfig:
    """The default table's row for this head dim (16-bit inputs only), key length (None:
    a long one) and whether the mask is causal (None: not known; then only what was
    measured faster both ways). The API passes all three."""
    hp = padded_head_dim(head_dim)
    if hp == 64:
        # 256-key tiles: the sweep at 06da646 (B=2, T=S=8k) ran 466 / 453 TFLOP/s (full /
        # causal) against 438 / 422 for 128-key tiles (1.06x / 1.07x): at head dim 64 a
        # tile's matmuls are short, and a longer tile halves the steps' fixed costs.
        # Persistent when not causal: 1.05-1.13x at 1k / 2k, 1.02-1.03x from 4k to 16k;
        # causal only where the flag is not known and the keys are few (1.05-1.08x at 1k /
        # 2k with 256-key tiles). Causal at short lengths: 128-key tiles, 1.11x / 1.04x at
        # 1k / 2k, one CTA per item (1.05x the persistent grid at 2k). Module docstring.
        # Row sums on the tensor cores when not causal (ROW_SUM_WGMMA_64's comment), and
        # the last round split by keys (SPLIT_TAIL_64's). Causal at short lengths since
        # the 54th session: persistent in head order with early Q loads (HEAD_ROUNDS'
        # comment), where it may be causal; causal, up to 4096 keys since the 55th
        # (HEAD_ROUNDS_MAX_KEYS_64's comment), with 256-key tiles above 2048.
        short = seq_k is not None and seq_k <= PERSISTENT_MAX_KEYS
        short_causal = short and causal is True
        head_order = (
            HEAD_ROUNDS
            and causal is True
            and seq_k is not None
            and seq_k <= HEAD_ROUNDS_MAX_KEYS_64
        )
        persistent = causal is False or head_order or (short and causal is None)
        return MosaicConfig(
            block_q=64,
            block_kv=128 if short_causal else 256,
            num_stages=2,
            early_k_wait=True,
            persistent=persistent,
            q_register_cols=Q_REGISTER_COLS,
            named_turns=NAMED_TURNS_DEFAULT,
            row_sum_wgmma=ROW_SUM_WGMMA_64 and causal is False,
            split_tail=SPLIT_TAIL_64 and causal is False,
            tail_fixup=SPLIT_TAIL_64 and TAIL_FIXUP and causal is False,
            early_q_load=head_order,
            head_rounds=persistent and causal is not False and HEAD_ROUNDS,
        )
    # The conditional rescale above head dim 64, but not for short causal calls (at
    # RESCALE_SLACK's comment).
    few_keys = seq_k is not None and seq_k <= RESCALE_SLACK_OFF_KEYS
    slack = None if few_keys and causal is not False else RESCALE_SLACK
    if hp <= 128:
        # Persistent when not causal: 1.06x / 1.06x / 1.00x / 1.01x at 1k / 2k / 8k /
        # 16k; causal 0.90-0.98x tile-major (module docstring), but in head order with
        # early Q loads at up to 2048 keys (HEAD_ROUNDS' comment), and up to 8192 with
        # the list schedule's items (GREEDY_ITEMS_MAX_KEYS_128's comment).
        head_order = (
            HEAD_ROUNDS
            and causal is True
            and seq_k is not None
            and seq_k <= GREEDY_ITEMS_MAX_KEYS_128
        )
        # Above PERSISTENT_MAX_KEYS, its items from the list schedule.
        listed = head_order and seq_k > PERSISTENT_MAX_KEYS
        # Non-causal up to 4096 keys, early Q loads (EARLY_Q_LOAD_MAX_KEYS_128's comment).
        early_nc = causal is False and seq_k is not None and seq_k <= EARLY_Q_LOAD_MAX_KEYS_128
        # Non-causal from 4096 keys, the last round split and merged in the kernel
        # (TAIL_FIXUP's comment).
        split = (
            TAIL_FIXUP and causal is False and (seq_k is None or seq_k >= SPLIT_TAIL_128_MIN_KEYS)
        )
        # Causal above it, one CTA per item in clusters of two (KV_MULTICAST_CAUSAL_128).
        multicast = (
            KV_MULTICAST_CAUSAL_128
            and causal is True
            and seq_k is not None
            and seq_k > GREEDY_ITEMS_MAX_KEYS_128
        )
        return MosaicConfig(
            block_q=64,
            block_kv=128,
            num_stages=2,
            early_k_wait=True,
            persistent=causal is False or head_order,
            kv_multicast=multicast,
            q_register_cols=Q_REGISTER_COLS,
            named_turns=NAMED_TURNS_DEFAULT,
            rescale_slack=slack,
            early_q_load=head_order or early_nc,
            split_tail=split,
            tail_fixup=split,
            head_rounds=head_order,
            greedy_items=listed,
        )
    # Persistent when not causal up to 16384 keys: 1.01-1.05x at 1k-16k (docstring).
    short = seq_k is not None and seq_k <= PERSISTENT_MAX_KEYS_256
    persistent = short and causal is False
    return MosaicConfig(
        block_q=64,
        block_kv=64,
        num_stages=2,
        early_k_wait=True,
        persistent=persistent,
        q_register_cols=Q_REGISTER_COLS,
        named_turns=NAMED_TURNS_DEFAULT,
        rescale_slack=slack,
    )

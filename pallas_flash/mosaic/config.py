"""Tile and pipeline configs of the Mosaic GPU (Hopper) kernels, with their evidence.

Frozen (hashable), so it travels as a static argument, like configs.TritonConfig.

Default-config table (16-bit inputs; head dim padded up to a multiple of 64):

| head dim (padded) | rows per warpgroup x block_kv | stages | shared memory (bytes) |
|-------------------|-------------------------------|--------|-----------------------|
| 64                | 64 x 256, early K wait        | 2      | 151,128 (bound)       |
| 64, not causal    | the same, persistent          | 2      | 167,512 (bound)       |
| 64, keys <= 2048, causal | 64 x 128, early K wait | 2      | 101,976 (bound)       |
| 128, causal       | 64 x 128, early K wait        | 2      | 167,000               |
| 128, not causal   | the same, persistent          | 2      | 200,280 (bound)       |
| 192, 256          | 64 x 64, early K wait         | 2      | 150,616, 199,768      |
| 192, 256, keys <= 16384, not causal | the same, persistent | 2 | 199,768 (O through Q's buffer) |

(Shared memory as Mosaic GPU's lowering reports it, with P in registers; "bound":
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
  snake order of causal rounds, forward.persistent_item; tokamax runs persistent exactly
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
    281.0; so at 2048 keys and below a causal call at head dim 64 takes one CTA per item.
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
Starting points came from JAX's own Mosaic FA3
(`jax/experimental/pallas/ops/gpu/attention_mgpu.py`), whose benchmark keeps 64 query
rows per warpgroup and two K/V stages and takes the first block_kv of 256, 128, 64 that
fits in Hopper's 227 KiB of shared memory (256 at head dim 64, 128 at 128, 64 at 256);
at head dim 64 block_kv 128 keeps the float32 score tile at 64 registers per thread.
Before the early K wait (`fa-a8d81d9/`), JAX's Mosaic FA3 ran at 1.06-1.12x this
forward at head dims 64 and 128, non-causal.

Backward default table (`MosaicBwdConfig`; one CTA has `consumers` compute warpgroups
and a TMA producer; shared memory from `smem_bytes_*`, operands in registers):

| head dim | dK/dV: key tiles, rows per Q tile, stages | dQ: query tiles, K/V tile keys, stages    |
|----------|-------------------------------------------|-------------------------------------------|
| 64       | 2 x 64, 128, 3: 137,304 (bound)           | 2 x 64, 128, 2: 102,480 (bound)           |
| 128      | 2 x 64, 64, 2: 133,176 bytes              | 2 x 64, 64, 2: 133,200 bytes              |
| 192      | 1 x 64 (split, P^T handed over), 64, 2: 165,968 | 1 x 64, 64, 2: 149,576 bytes |
| 256      | 1 x 64 (split, P^T handed over), 64, 2: 215,120 | 1 x 64, 64, 2: 198,728 bytes |

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

The fused backward (`fused=True`) is off by default: compiled on the H200 it passes the
reference and bitwise-determinism tests but runs at 0.64-0.69x the two-kernel backward
(head dim 128, non-causal, seq 512-4k, `fa-mosaic-fused-77b90a9.jsonl`). It adds to the
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
_MOSAIC_OVERHEAD = 128 * 4 * 4 + 1024


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
    intra_overlap: FA3's intra-warpgroup pipelining: tile j's Q K^T and tile j - 1's
      P V are issued together and tile j's softmax runs while that P V does (neither
      JAX's Mosaic FA3 nor tokamax does; FA3's ablation credits it with about 13 % at
      head dim 128). It holds a second score tile's worth of registers. A schedule of
      its own: not with rescale_before_turn or early_k_wait. Off: measured slower at head
      dim 128 (463 / 450 TFLOP/s against the old default's 555 / 553; module docstring).
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
      once per row; forward.bound_mask) against the tile's column iota, one compare
      per element (two with a window's start), instead of `masks.tile_mask`'s
      absolute column index and up to three compares and their ands. Only where a
      bound depends on the row (causal or a window); the key length alone keeps
      `tile_mask`'s one compare. On: in the SASS at head dim 128 causal a masked
      step has 606 instructions per warp against 746 with `tile_mask` (478 unmasked;
      `results/mosaic-9f95796/ptxas.jsonl`; the prediction from 81df3c6's SASS was
      about 640), and beside it in one run (`results/mosaic-9f95796/fa-mosaic-*-true-
      rowbound.jsonl`, B x T = 16k, bf16, causal) the forward ran 1.03x at head dim
      64 at 1k and 2k (271.9 / 348.4 TFLOP/s against 264.0 / 338.3) and 1.00x / 1.00x
      at head dim 128 (where each score carries twice the matmul work), with
      the same bits over the compiled case table's causal rows
      (test_gpu_row_bound_mask_changes_no_bit).
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
    kv_multicast: the grid's CTAs run in clusters of two on adjacent query tiles, which
      walk the same key tiles (the key range of both tiles' rows, masked per element as
      ever), and each K/V tile is loaded once for both by TMA multicast, each CTA's
      producer loading half; a slot is refilled once all four consumers of the cluster
      have released it (cluster barriers). Every CTA reads a K/V tile's bytes per
      block_q x NUM_CONSUMERS rows: 128 flops a byte at 64-row warpgroups, whatever the
      head dim, so at 600 TFLOP/s the SMs pull about 4.7 TB/s from L2, near what an
      H100-class L2 gives; two CTAs per load halve that. Not with persistent. GPU
      interpret mode runs the clusters: the same bits as without, the reference, no
      data race (tests/test_mosaic.py). Compiled at f309273 (bf16, B x T = 16k, beside
      the default row and cuDNN; results/mosaic-f309273/fa-mosaic-*-mc.jsonl), forward
      TFLOP/s with against without: 8k non-causal 487.7 / 472.6 (1.03x), 598.6 / 593.9
      (1.01x) and 615.5 / 615.0 (1.00x) at head dims 64 / 128 / 256; 16k causal 470.2 /
      462.8 and 613.2 / 599.6 (1.02x) at 64 / 128; but at 2k, where the default rows are
      persistent (or take 128-key tiles), 0.89x / 0.95x at 64 causal / not and 0.91x at
      128 causal. Those runs timed the default first in its process, with the warm-up
      that at f309273 read the first implementation 1-4 % slow (benchmarks.bench.time_fn),
      so the 1-3 % gains are not yet told from that; its compiled bitwise test ran on 2
      of the 30 case-table rows (the same bits, results/mosaic-f309273/mosaic-tests.log).
      Off.
    named_turns: the ping-pong hands each turn over one way (one arrive after a
      consumer's Q K^T is issued, one sync before its P V), on the SM's hardware named
      barriers (`bar.arrive` / `bar.sync`, forward.PingPong) rather than a shared-memory
      mbarrier that both consumers meet at twice a step (each of whose arrivals is 128
      threads' atomics on shared memory). tokamax's forward hands its turns over so, and
      at head dim 256 runs 1.10-1.11x ours with our tiles (README, "Wider key tiles");
      lowered for sm_90, its step and ours otherwise hold the same arithmetic. Compiled
      only: GPU interpret mode runs no inline PTX, and there it is off. Not with
      intra_overlap. Off in the field, on in the default rows (NAMED_TURNS_DEFAULT,
      with its evidence).
    named_releases: the consumers release each K and V slot with `bar.arrive` on a
      hardware named barrier and the producer waits with `bar.sync` (forward.NamedSlots),
      rather than 128 threads of each consumer arriving on a shared-memory mbarrier that
      the producer polls: tokamax's other synchronisation (README, "Wider key tiles").
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
      the loop's last step is not measured). Off.
    poly_exp2_cols: the first this many columns of each score tile (a multiple of 8, at
      most block_kv) take their exp2 from a cubic on the FMA and integer units
      (forward.exp2_poly, relative error below 8e-5, below bfloat16's and float16's
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
      rescale. Not with intra_overlap (whose rescale sits elsewhere). None: always.
      Timed at 7c428a8 beside the default (bf16, B x T = 16k, non-causal 8k): slack 8
      ran 1.02x at head dim 128 and 0.94x at 64 (452.5 against 479.3 TFLOP/s), where a
      step's rescale is 32 multiplies a thread against the vote, the branch and the
      max's selects. Default 8 at head dims above 64 since 02c64a5, except causal calls
      of at most 1024 keys (RESCALE_SLACK and default_mosaic_config below, with the
      evidence).
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
    intra_overlap: bool = False
    persistent: bool = False
    row_bound_mask: bool = True
    q_register_cols: int = 0
    kv_multicast: bool = False
    named_turns: bool = False
    named_releases: bool = False
    o_from_registers: bool = False
    early_q_load: bool = False
    poly_exp2_cols: int = 0
    rescale_slack: float | None = None
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
        slack = self.rescale_slack
        if slack is not None and (
            isinstance(slack, bool) or not isinstance(slack, (int, float)) or not 0 <= slack < 64
        ):
            raise ValueError(f"{self.rescale_slack=} must be None or a number from 0 to 64")
        if slack is not None and self.intra_overlap:
            raise ValueError(
                f"rescale_slack={self.rescale_slack} is the plain schedule's: not with "
                "intra_overlap (whose rescale sits elsewhere); pass rescale_slack=None "
                "with intra_overlap=True (the default rows of head dims 128-256 set 8)"
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
        if self.intra_overlap and self.persistent:
            raise ValueError("intra_overlap is a schedule of its own: not with persistent")
        if self.kv_multicast and self.persistent:
            raise ValueError("kv_multicast pairs the grid's CTAs in clusters: not with persistent")
        if self.early_q_load and not self.persistent:
            raise ValueError(
                "early_q_load loads a persistent CTA's next Q early: it needs persistent"
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
        barriers = 8 * (4 * self.num_stages + n + 1)
        return q_o + kv + p + lse + barriers + _MOSAIC_OVERHEAD


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
      (backward.fa3_step): the exp2 runs beside dP^T's wgmma, dS^T is stored and
      exchanged while dV's runs, the dQ share and dK queue behind it and the share is
      handed over while dK's runs; otherwise every group of wgmmas is awaited before the
      next work starts (about half the pair's matmul throughput on the H200, README).
      Not yet measured, so off.
    row_bound_mask: boundary tiles mask from each query's key bounds against the key
      iota (forward.bound_mask), as `MosaicConfig.row_bound_mask` does in the forward,
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
    step_descriptors: the dK/dV (and fused) kernel addresses the buffers that stay in
      place across its loop (the resident K and V tiles, the fused kernel's dS^T tiles)
      through an index offset that is 0 but opaque to the compiler (backward.
      step_operands), so that each step rebuilds their wgmma descriptors (a 64-bit add
      each) rather than the compiler building them all before the loop and holding
      them: at 9f95796 the fused kernel spilled them, 10-18 stack reloads bound for
      R2UR in every step (README, "The fused kernel's own SASS"). Lowered on CPU with
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
      rows (backward.rows_step): S = Q K^T and dP = dO V^T rather than their transposes,
      so that a thread holds 2 of the row statistics lse and D where a column's took 16
      (32 registers in all); P and then dS pass through the consumer's dS tile in shared
      memory into dV = P^T dO and dK = dS^T Q (no wgmma operand in registers, no staging
      buffer), dS computed beside dV's wgmma; the dQ share reads dS in place. Meant to
      take the consumers under the registers at which ptxas serializes every wgmma of
      the S^T step (C7512, README). Checked in GPU interpret mode (the reference, no
      data race); lowered for sm_90 on CPU; compiled on the H200 at c864512 it passes
      its 25 reference rows but still serializes every wgmma (C7512, 624 bytes of
      spills) and runs its backward at 0.59x / 0.58x the pair's (head dim 128 causal
      2k / 8k, `results/mosaic-c864512/`), so off.
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
      forward's do (forward.PingPong, on hardware named barriers when compiled): one's
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
      non-causal and at 240 causal (README, "The dQ share is what the consumers lack").
      A half is 32 columns, and a wgmma's two operands share one swizzle, so K, Q and
      the dS^T tiles take the 64-byte swizzle (NARROW_SWIZZLE) rather than 128.
      Compiled at 2b60086 with writer_warp, in FA3's order with step_descriptors (head
      dim 128, `results/mosaic-2b60086/`): no C7512 (64 / 276 bytes of spill stores
      non-causal / causal; without writer_warp, at 232 registers, C7512 still), and
      backward 433.3 / 408.3 TFLOP/s at 8k against 442.1 / 397.5 without the two
      (0.98x / 1.03x; the pair 460.1 / 445.5, cuDNN 509.5 / 473.1); 6 of the 25
      compiled reference rows ran, and passed. Off: the serialization was not what
      held the fused kernel back (README, "Half shares").
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
      then ran their exp2 at once with the tensor cores idle (README, "Half shares":
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
      non-causal 8k (400.2 against 431.4 TFLOP/s, README "What the fused kernel's
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
      causal (README, "What the fused kernel's dQ costs"). A span may wait on a span
      of higher index, so the grid is laid out with a head's spans launched
      together, and a head may have at most as many key spans as the GPU has SMs
      (ValueError above that).
      Deterministic: the same order every call, not the plain order's bits.
      Compiled at af0f5db (share_halves, writer_warp, FA3's order, step_descriptors)
      it passed the benchmark's reference check and the 10 of 25 compiled table rows
      that ran, and ran the backward at 0.96x / 0.94x the plain order at head dim 128 8k
      non-causal / causal (407.0 / 390.8 against 425.9 / 414.5 TFLOP/s, README "Turns
      in arrival order"): off.
    split_writer: fused, writer_warp: the ordered adds in two warps of the
      producer's warpgroup (two of its warps idled), one a writer slot, so the adds
      of one step wait for their turn and land while the next step's go out. One
      writer takes a slot's share, waits its turn, sends the TMA reduce, waits for
      it to be read and then to land, and hands the turn on before it takes the next
      slot; left out by a diagnostic build, the adds cost 0.80 ms of the fused
      backward's 6.37 at head dim 128 8k and the consumers wait on the slots (README,
      "What the fused kernel's dQ costs"). The same adds in the same order: the same
      bits. Checked in GPU interpret mode (the reference, the race detector) and
      lowered for sm_90 on CPU; compiled at 9651b8e, one writer's bits on the 11 of 25
      table rows that ran, and 1.02-1.05x the pair at head dim 128 non-causal, where
      it is in the default since c8bc107 (BWD_FUSED_FULL below; README, "Two writer
      warps").
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
    split_writer: bool = False

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
        (the 128-byte swizzle of K's tiles), else the query rows (wgmma's M is 64)."""
        c, bq = self.consumers_dkv, self.block_q_dkv
        if head_dim % (64 * c) == 0:
            return bq, head_dim // c
        if bq % (64 * c) == 0:
            return bq // c, head_dim
        raise ValueError(
            f"fused at head dim {head_dim} with {c} consumers needs block_q_dkv a multiple "
            f"of {64 * c}, not {bq}"
        )

    @property
    def share_pieces(self) -> int:
        """Column pieces a consumer's dQ share is computed in, one after another."""
        return 2 if self.share_halves else 1

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
        return kv + ring + staged + barriers + _MOSAIC_OVERHEAD

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
        return q_do + ring + staged + barriers + _MOSAIC_OVERHEAD


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

# Key lengths up to which the head-dim-64 default takes its short-length rows: 128-key
# tiles when causal, persistent when the causal flag is not known (measured at 1k and 2k).
PERSISTENT_MAX_KEYS = 2048
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
        short = seq_k is not None and seq_k <= PERSISTENT_MAX_KEYS
        short_causal = short and causal is True
        return MosaicConfig(
            block_q=64,
            block_kv=128 if short_causal else 256,
            num_stages=2,
            early_k_wait=True,
            persistent=causal is False or (short and causal is None),
            q_register_cols=Q_REGISTER_COLS,
            named_turns=NAMED_TURNS_DEFAULT,
        )
    # The conditional rescale above head dim 64, but not for short causal calls (at
    # RESCALE_SLACK's comment).
    few_keys = seq_k is not None and seq_k <= RESCALE_SLACK_OFF_KEYS
    slack = None if few_keys and causal is not False else RESCALE_SLACK
    if hp <= 128:
        # Persistent when not causal: 1.06x / 1.06x / 1.00x / 1.01x at 1k / 2k / 8k /
        # 16k; causal 0.90-0.98x (module docstring).
        return MosaicConfig(
            block_q=64,
            block_kv=128,
            num_stages=2,
            early_k_wait=True,
            persistent=causal is False,
            q_register_cols=Q_REGISTER_COLS,
            named_turns=NAMED_TURNS_DEFAULT,
            rescale_slack=slack,
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
# per-step descriptors, its dQ share in column halves and its ordered adds in two writer
# warps, a slot each (`fused_full_bwd_config`): the default of padded head dim 128 when
# the call is not causal, since 9651b8e's runs (results/mosaic-9651b8e/; bf16,
# B x T = 16k, backward TFLOP/s, against the pair in the same process): non-causal
# 2k / 4k / 8k / 16k 427.5 / 457.7 / 473.6 / 475.8 against 406.9 / 449.4 / 461.0 / 456.8
# (1.05x / 1.02x / 1.03x / 1.04x; cuDNN 418.1 / 488.8 / 515.7 / 521.0). Causal it ran
# 1.01x / 1.02x / 1.00x / 0.98x the pair (351.2 / 408.7 / 447.1 / 455.8 against 348.2 /
# 400.9 / 445.2 / 465.0): level, so causal calls keep the pair. Compiled, the split
# writer gives the one writer's bits on the 11 fused case-table rows that ran
# (results/mosaic-9651b8e/mosaic-tests-split-writer.log).
BWD_FUSED_FULL = True


def fused_full_bwd_config(head_dim: int) -> MosaicBwdConfig:
    """The fused build of BWD_FUSED_FULL at this head dim (128 at most, as
    fused_mosaic_bwd_config)."""
    return dataclasses.replace(
        fused_mosaic_bwd_config(head_dim),
        fa3_order=True,
        step_descriptors=True,
        share_halves=True,
        writer_warp=True,
        split_writer=True,
    )


def default_mosaic_bwd_config(head_dim: int, causal: bool) -> MosaicBwdConfig:
    """The backward default table's row for this head dim and causality (16-bit inputs
    only): the fused kernel at padded head dim 128 without a causal mask
    (BWD_FUSED_FULL), else the pair (pair_mosaic_bwd_config)."""
    if BWD_FUSED_FULL and padded_head_dim(head_dim) == 128 and not causal:
        return fused_full_bwd_config(head_dim)
    return pair_mosaic_bwd_config(head_dim)


def pair_mosaic_bwd_config(head_dim: int) -> MosaicBwdConfig:
    """The two-kernel backward's row for this head dim (a dK/dV kernel and a dQ kernel,
    no atomics; 16-bit inputs only): the default but at head dim 128 non-causal."""
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
    # And the one dQ warpgroup takes all its registers: BWD_SOLO_DQ_REGISTERS above.
    return MosaicBwdConfig(
        split_dkv=True,
        share_probs=True,
        consumers_dq=1,
        row_bound_mask=BWD_ROW_BOUND,
        solo_dq_registers=BWD_SOLO_DQ_REGISTERS,
    )

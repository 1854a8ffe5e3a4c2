#!/usr/bin/env bash
# The device calls that wait for issue 5 (docs/mosaic.md, "Next device calls", says what
# each measures and why), one call a run of this script, so that a session types
#   bash benchmarks/next_calls.sh COMMIT CALL
# and not the steps by hand: each call's implementations are checked on CPU by
# tests/test_gpu_run.py (every config variant builds at the head dims the call times).
# Each call stays under the 600 s a device command may run; its results are under $OUT,
# one JSONL per timing, named below. Carry .peers, as for gpu_run.sh.
set -u
C=${1:?usage: next_calls.sh COMMIT CALL}; call=${2:?usage: next_calls.sh COMMIT CALL}
M=pallas_flash:mosaic
G=benchmarks/gpu_run.sh
P=jax.nn:cudnn,tokamax:mosaic,jax:mosaic_fa3  # the three peers, for a call that renews cells
# keep NAME: the last mosaic-fa step's rows as $OUT/NAME.jsonl (a step that wrote none,
# for a timeout before its first row, is said, and the call goes on).
keep() {
  if [ -e "$OUT/fa-mosaic.jsonl" ]; then mv "$OUT/fa-mosaic.jsonl" "$OUT/$1.jsonl"
  else echo "next_calls: no rows for $1" >&2; fi
}
# the one-CTA-per-item row that greedy_items replaced at head dim 128 causal 2049-8192
# keys (e095dff), head order up to 2048, and clusters of two above 8192 (ae44b8a): timed
# only where it is not the default.
PER_ITEM=$M/persistent=false/head_rounds=false/early_q_load=false/greedy_items=false/kv_multicast=false
case $call in
  6) # (H) the head-dim-128 causal forward at 2k-16k on the H200, the default (head order
    # at 2k, the list schedule at 4k / 8k, clusters of two at 16k) beside the one-CTA-per-
    # item row, cuDNN and tokamax (on an H100 at c0674ef: 1.056x / 1.051x / 1.003x that
    # row at 2k-8k, at 512a5d0 / eebe5ae 1.015x / 1.027x at 16k; on the H200 at 899d096
    # the default ran 1.042-1.069x / 1.063x / 1.045x / 0.970x the best peer).
    FA_PASSES=fwd FA_SEQS=2048,4096,8192,16384 MOSAIC_FA_BUDGET=220 \
      MOSAIC_FA_IMPLS=$M,$PER_ITEM,jax.nn:cudnn,tokamax:mosaic timeout 270 bash $G "$C" mosaic-fa:128:true
    keep fa-mosaic-128-true-greedy ;;
  12) # (H) the persistent grid of clusters (kv_multicast on the persistent grid, 69th
    # session) at the non-causal forward's persistent rows, their last round split (in
    # pairs of tiles over the clusters) as the default's is, beside the default and the
    # three peers, so that it renews the cells: head dim 128 at 2k-16k, then 64 at 2k-8k
    # (on an H100 at fe15cef 1.051x / 1.032x the default at 128 8k, 0.955x / 1.044x at
    # 16k, 0.994x at 4k; unsplit 0.971-1.032x, so not timed; half the L2 reads, for a
    # board at its power limit).
    FA_PASSES=fwd FA_SEQS=2048,4096,8192,16384 MOSAIC_FA_BUDGET=170 \
      MOSAIC_FA_IMPLS=$M,$M/kv_multicast=true,$P timeout 210 bash $G "$C" mosaic-fa:128:false
    keep fa-mosaic-128-false-fwd-2k-16k
    FA_PASSES=fwd FA_SEQS=2048,4096,8192 MOSAIC_FA_BUDGET=120 \
      MOSAIC_FA_IMPLS=$M,$M/kv_multicast=true,$P timeout 160 bash $G "$C" mosaic-fa:64:false
    keep fa-mosaic-64-false-fwd-2k-8k ;;
  14) # (H) the causal forward's cells on the H200, with the two clusters that led on an
    # H100 at 38e59cb beside them: head dim 128 at 2k-16k, the default beside each tile
    # walking its own keys in persistent clusters (multicast_own_keys: 1.037x / 1.042x /
    # 0.998x the default at 2k in three processes there, 0.994x / 1.000x at 4k / 8k,
    # 0.964x at 16k) and the three peers (renews the four head-dim-128 causal cells,
    # 16k under the clusters of two for the first time); then head dim 64 at 4k, the
    # default beside the persistent clusters walking both tiles' keys (1.033x / 1.013x).
    FA_PASSES=fwd FA_SEQS=2048,4096,8192,16384 MOSAIC_FA_BUDGET=210 \
      MOSAIC_FA_IMPLS=$M,$M/kv_multicast=true/multicast_own_keys=true,$P timeout 250 bash $G "$C" mosaic-fa:128:true
    keep fa-mosaic-128-true-fwd-2k-16k
    FA_PASSES=fwd FA_SEQS=4096 MOSAIC_FA_BUDGET=70 \
      MOSAIC_FA_IMPLS=$M,$M/kv_multicast=true,$P timeout 100 bash $G "$C" mosaic-fa:64:true
    keep fa-mosaic-64-true-4k ;;
  15) # the head-dim-128 non-causal backward at 8k / 16k (0.984x / 0.985x cuDNN on the
    # H200, runs z / aa) with each key span walking its query tiles rotated by its index
    # (rotated_adds), so that the spans of a head reach a tile one step apart and add to
    # it in turn, where the plain order has all of them on one Q / dO / dQ tile at once;
    # timed only in af0f5db's build (0.96x then), never in today's (FA3's order, the whole
    # share, two writer warps). Two processes, the second with the rotation first.
    # Either card: a ratio of builds.
    R=$M/rotated_adds=true
    FA_PASSES=bwd FA_SEQS=8192,16384 MOSAIC_FA_BUDGET=75 \
      MOSAIC_FA_IMPLS=$M,$R,jax.nn:cudnn timeout 100 bash $G "$C" mosaic-fa:128:false
    keep fa-mosaic-128-false-bwd-rotated
    FA_PASSES=bwd FA_SEQS=8192,16384 MOSAIC_FA_BUDGET=75 \
      MOSAIC_FA_IMPLS=$R,$M,jax.nn:cudnn timeout 100 bash $G "$C" mosaic-fa:128:false
    keep fa-mosaic-128-false-bwd-rotated-2 ;;
  *) echo "next_calls: no call $call (6, 12, 14, 15; 4 and 7 ran at e6ab66d, 2 and 5 at c0674ef, 10 at 5d326d1, 1, 3, 8 and 9 at 899d096, 11 at 512a5d0, 13 at 38e59cb)" >&2; exit 2 ;;
esac

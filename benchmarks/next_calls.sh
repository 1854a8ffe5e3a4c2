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
# keep NAME: the last mosaic-fa step's rows as $OUT/NAME.jsonl (a step that wrote none,
# for a timeout before its first row, is said, and the call goes on).
keep() {
  if [ -e "$OUT/fa-mosaic.jsonl" ]; then mv "$OUT/fa-mosaic.jsonl" "$OUT/$1.jsonl"
  else echo "next_calls: no rows for $1" >&2; fi
}
PEERS=jax.nn:cudnn,tokamax:mosaic,jax:mosaic_fa3
# the one-CTA-per-item row that greedy_items replaced at head dim 128 causal 2049-8192
# keys (e095dff) and head order up to 2048: timed only where it is not the default.
PER_ITEM=$M/persistent=false/head_rounds=false/early_q_load=false/greedy_items=false
# the backward's last wave split by query tiles (head dim 128 non-causal from 4k, where the
# forward already splits its last round: only the backward differs from the default).
BWD_SPLIT=$M/split_tail=true
case $call in
  1) # (H) the forward beside the three peers on the H200 where the 54th and 55th sessions
    # moved the default (causal, head dims 64 up to 4096 keys and 128 up to 2048:
    # persistent in head order with early Q loads) or the table's cells predate the rows
    # (head dim 64 at 2k and 8k, before its row sums on the tensor cores and its column
    # blocks); 1k and 4k too at 64.
    FA_PASSES=fwd FA_SEQS=1024,2048,4096,8192 MOSAIC_FA_IMPLS=$M,$PEERS timeout 330 \
      bash $G "$C" mosaic-fa:64:false mosaic-fa:64:true
    keep fa-mosaic-64-fwd-1k-8k
    FA_PASSES=fwd FA_SEQS=1024,2048 MOSAIC_FA_IMPLS=$M,$PEERS timeout 150 \
      bash $G "$C" mosaic-fa:128:true
    keep fa-mosaic-128-true-fwd-short ;;
  3) # (H) the head-dim-128 forward beside the three peers from 2k: the H200's cells there
    # (runs p, q, u, of 12-04 and 12-05: 1.00-1.04x) time rows that have changed since
    # only in refactors, but for the non-causal row from 4096 keys, split and merged in
    # the kernel since 9394670 (tail_fixup; on an H100 1.05x the best peer at 4k and
    # 16k): not causal 2k-16k, causal 4k-16k (1k and 2k causal are call 1's).
    FA_PASSES=fwd FA_SEQS=2048,4096,8192,16384 MOSAIC_FA_IMPLS=$M,$PEERS timeout 290 \
      bash $G "$C" mosaic-fa:128:false
    keep fa-mosaic-128-false-fwd-2k-16k
    FA_PASSES=fwd FA_SEQS=4096,8192,16384 MOSAIC_FA_IMPLS=$M,$PEERS timeout 240 \
      bash $G "$C" mosaic-fa:128:true
    keep fa-mosaic-128-true-fwd-4k-16k ;;
  6) # (H) call 3's first half and the old call 5's timing in one, for a session that may
    # get the H200 once: the head-dim-128 forward not causal 2k-16k beside the three
    # peers, then causal 2k-8k, the default (head order, then greedy_items from 4k) beside
    # the one-CTA-per-item row, cuDNN and tokamax (on an H100 at c0674ef: 1.056x / 1.051x /
    # 1.003x that row, 1.054x / 1.087x / 1.045x the better peer).
    FA_PASSES=fwd FA_SEQS=2048,4096,8192,16384 MOSAIC_FA_IMPLS=$M,$PEERS timeout 275 \
      bash $G "$C" mosaic-fa:128:false
    keep fa-mosaic-128-false-fwd-2k-16k
    FA_PASSES=fwd FA_SEQS=2048,4096,8192 \
      MOSAIC_FA_IMPLS=$M,$PER_ITEM,jax.nn:cudnn,tokamax:mosaic timeout 250 bash $G "$C" mosaic-fa:128:true
    keep fa-mosaic-128-true-greedy ;;
  8) # (H) every cell issue 5 still misses on the H200, in one call, for a session that gets
    # the H200 once, the most cells first (a call cut short keeps them): the forward
    # beside the three peers at head dim 128 not causal and causal 2k-16k (call 9: the
    # split row from 4k, greedy_items causal from 4k), at head dim 64 causal 1k-8k (stale
    # cells, rows moved in the 54th and 55th sessions), then the backward at head dim 128
    # non-causal 8k / 16k: the default beside its split last wave and cuDNN (on an H100
    # at e6ab66d, three processes: 1.011x / 1.021x / 0.997x at 8k, 1.021x / 0.997x /
    # 0.992x at 16k; in bands of 4 heads 0.94-1.01x: not timed again).
    bash "$0" "$C" 9
    FA_PASSES=fwd FA_SEQS=1024,2048,4096,8192 MOSAIC_FA_IMPLS=$M,$PEERS MOSAIC_FA_BUDGET=110 \
      timeout 150 bash $G "$C" mosaic-fa:64:true
    keep fa-mosaic-64-true-fwd-1k-8k
    FA_PASSES=bwd FA_SEQS=8192,16384 MOSAIC_FA_BUDGET=90 \
      MOSAIC_FA_IMPLS=$M,$BWD_SPLIT,jax.nn:cudnn timeout 150 bash $G "$C" mosaic-fa:128:false
    keep fa-mosaic-128-false-bwd-split ;;
  9) # (H) call 8's first step alone, for a session with about 330 s of device time left:
    # the head-dim-128 forward beside the three peers, both ways, 2k-16k (eight cells of
    # the H200's table at 1.00-1.04x, runs p, q and u).
    FA_PASSES=fwd FA_SEQS=2048,4096,8192,16384 MOSAIC_FA_IMPLS=$M,$PEERS MOSAIC_FA_BUDGET=200 \
      timeout 250 bash $G "$C" mosaic-fa:128
    keep fa-mosaic-128-fwd-2k-16k ;;
  *) echo "next_calls: no call $call (1, 3, 6, 8, 9; 4 and 7 ran at e6ab66d, 2 and 5 at c0674ef, 10 at 5d326d1)" >&2; exit 2 ;;
esac

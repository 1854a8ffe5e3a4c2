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
# greedy_items on the persistent causal grid (the head-dim-128 causal default of 2049-8192
# keys since e095dff), and the one-CTA-per-item row it replaced there: beside the
# default, each is timed only at lengths where it is not the default's own config.
GREEDY=$M/persistent=true/head_rounds=true/early_q_load=true/greedy_items=true
PER_ITEM=$M/persistent=false/head_rounds=false/early_q_load=false/greedy_items=false
# the backward's last wave split by query tiles (head dim 128 non-causal from 4k, where the
# forward already splits its last round: only the backward differs from the default).
BWD_SPLIT=$M/split_tail=true
# and the backward's key spans launched in bands of 4 heads, the causal row's order.
BWD_BANDS=$M/span_band=4
BWD_SPLIT_BANDS=$M/split_tail=true/span_band=4
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
  2) # The compiled tests of the head-dim-64 causal row of 2049-4096 keys (256-key tiles,
    # persistent in head order, early Q loads; the 55th session's default): head order's
    # bits against the tile-major grid's on the row of 4096 keys, every causal case, and
    # the defaults for the call at head dim 64 (a 4096-key causal case among them).
    MOSAIC_TESTS_WORKERS=12 MOSAIC_TESTS_TIMEOUT=200 \
      MOSAIC_TESTS_K="(head_rounds_changes_no_bit and 4k-row) or (default_for_the_call_matches_reference and h64)" \
      bash $G "$C" mosaic-tests ;;
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
  4) # (any card) early Q loads at head dim 128 non-causal, never timed there: the row has
    # an O buffer, so each consumer's next Q can load during the item's last Q K^T
    # rather than after its O (at 2k an item is 16 key tiles, and the wait for Q sits
    # between every two); beside the default and two peers, 1k-4k (4k: with the split).
    FA_PASSES=fwd FA_SEQS=1024,2048,4096 \
      MOSAIC_FA_IMPLS=$M,$M/early_q_load=true,tokamax:mosaic,jax:mosaic_fa3 timeout 200 \
      bash $G "$C" mosaic-fa:128:false
    keep fa-mosaic-128-false-early-q ;;
  5) # (any card) greedy_items: the persistent causal grid's items from a list schedule in
    # the one-CTA-per-item grid's launch order (by launch_sim as even as that grid, where
    # head_rounds' sorted rounds fill 0.970), first compiled (the same bits as the tile-
    # major grid on the 16 causal cases), then at head dim 128 causal 2k-8k the default
    # (greedy_items from 4k since e095dff) beside the one-CTA-per-item row, cuDNN and
    # tokamax (on the H200 the default's cells count: JAX's Mosaic FA3 trailed tokamax
    # at every causal point of run q), and greedy_items beside the default at head dim
    # 64 causal 1k / 2k.
    MOSAIC_TESTS_WORKERS=12 MOSAIC_TESTS_TIMEOUT=130 \
      MOSAIC_TESTS_K="head_rounds_changes_no_bit and greedy" timeout 150 bash $G "$C" mosaic-tests
    FA_PASSES=fwd FA_SEQS=2048,4096,8192 \
      MOSAIC_FA_IMPLS=$M,$PER_ITEM,jax.nn:cudnn,tokamax:mosaic timeout 250 bash $G "$C" mosaic-fa:128:true
    keep fa-mosaic-128-true-greedy
    FA_PASSES=fwd FA_SEQS=1024,2048 MOSAIC_FA_IMPLS=$M,$GREEDY timeout 110 \
      bash $G "$C" mosaic-fa:64:true
    keep fa-mosaic-64-true-greedy ;;
  6) # (H) calls 3 and 5 in one, for a session that may get the H200 once: the head-dim-
    # 128 forward not causal 2k-16k beside the three peers (call 3's first half), then
    # call 5's head-dim-128 timing (causal 2k-8k, the default beside the one-CTA-per-item
    # row, cuDNN and tokamax) without its compiled tests.
    FA_PASSES=fwd FA_SEQS=2048,4096,8192,16384 MOSAIC_FA_IMPLS=$M,$PEERS timeout 275 \
      bash $G "$C" mosaic-fa:128:false
    keep fa-mosaic-128-false-fwd-2k-16k
    FA_PASSES=fwd FA_SEQS=2048,4096,8192 \
      MOSAIC_FA_IMPLS=$M,$PER_ITEM,jax.nn:cudnn,tokamax:mosaic timeout 250 bash $G "$C" mosaic-fa:128:true
    keep fa-mosaic-128-true-greedy ;;
  7) # (any card; on the H200 its cells count) the backward's turns and last wave at head
    # dim 128 non-causal, where it is level with cuDNN from 8k (0.98-0.99x on the H200):
    # the grid's 2048 equal CTAs fill 15.5 waves of 132 SMs, and a head's spans queue for
    # their dQ adds' turns (launch_sim --add-steps 1: 0.947 / 0.951 at 8k / 16k). By that
    # model the last wave split by query tiles fills 0.967 / 0.972 (one H100 run at
    # 00676b3: 1.007x / 1.029x / 0.997x at 4k / 8k / 16k), bands of 4 heads 0.959 / 0.962
    # (never timed without a mask), both 0.981 / 0.988. The split's compiled tests on the
    # default rows, plain and in bands (6 cases; bands alone passed theirs at 1fc58b7),
    # then the default beside the split, both, and cuDNN at 4k-16k, and a second process
    # at 8k / 16k in reverse order with bands alone.
    MOSAIC_TESTS_WORKERS=6 MOSAIC_TESTS_TIMEOUT=110 \
      MOSAIC_TESTS_K="split_tail_backward" timeout 130 bash $G "$C" mosaic-tests
    FA_PASSES=bwd FA_SEQS=4096,8192,16384 \
      MOSAIC_FA_IMPLS=$M,$BWD_SPLIT,$BWD_SPLIT_BANDS,jax.nn:cudnn timeout 270 bash $G "$C" mosaic-fa:128:false
    keep fa-mosaic-128-false-bwd-split
    FA_PASSES=bwd FA_SEQS=8192,16384 MOSAIC_FA_BUDGET=100 \
      MOSAIC_FA_IMPLS=jax.nn:cudnn,$BWD_BANDS,$BWD_SPLIT_BANDS,$M timeout 160 bash $G "$C" mosaic-fa:128:false
    keep fa-mosaic-128-false-bwd-split-2 ;;
  8) # (H) every cell issue 5 still misses on the H200, in one call, for a session that gets
    # the H200 once: the forward beside the three peers at head dim 64 causal 1k-8k (stale
    # cells, rows moved in the 54th and 55th sessions), head dim 128 not causal and causal
    # 2k-16k (the split row from 4k, greedy_items causal from 4k), then the backward at
    # head dim 128 non-causal 8k / 16k: the default beside the split in bands and cuDNN.
    FA_PASSES=fwd FA_SEQS=1024,2048,4096,8192 MOSAIC_FA_IMPLS=$M,$PEERS MOSAIC_FA_BUDGET=110 \
      timeout 150 bash $G "$C" mosaic-fa:64:true
    keep fa-mosaic-64-true-fwd-1k-8k
    FA_PASSES=fwd FA_SEQS=2048,4096,8192,16384 MOSAIC_FA_IMPLS=$M,$PEERS MOSAIC_FA_BUDGET=200 \
      timeout 250 bash $G "$C" mosaic-fa:128
    keep fa-mosaic-128-fwd-2k-16k
    FA_PASSES=bwd FA_SEQS=8192,16384 MOSAIC_FA_BUDGET=90 \
      MOSAIC_FA_IMPLS=$M,$BWD_SPLIT_BANDS,jax.nn:cudnn timeout 150 bash $G "$C" mosaic-fa:128:false
    keep fa-mosaic-128-false-bwd-split ;;
  *) echo "next_calls: no call $call (1 to 8)" >&2; exit 2 ;;
esac

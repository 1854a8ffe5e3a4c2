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
case $call in
  1) # (H) the forward beside the three peers on the H200 where the 54th session moved the
    # default (causal, at most 2048 keys, head dims 64 and 128: persistent in head order
    # with early Q loads) or the table's cells predate the rows (head dim 64 at 2k and 8k,
    # before its row sums on the tensor cores and its column blocks); 1k too at 64.
    FA_PASSES=fwd FA_SEQS=1024,2048,8192 MOSAIC_FA_IMPLS=$M,$PEERS timeout 300 \
      bash $G "$C" mosaic-fa:64:false mosaic-fa:64:true
    keep fa-mosaic-64-fwd-1k-2k-8k
    FA_PASSES=fwd FA_SEQS=1024,2048 MOSAIC_FA_IMPLS=$M,$PEERS timeout 150 \
      bash $G "$C" mosaic-fa:128:true
    keep fa-mosaic-128-true-fwd-short ;;
  2) # The persistent causal grid in head order at 4096 keys, beside the default (one CTA
    # per item there) and cuDNN, head dims 64 and 128 (on an H100: 1.02x / 0.99x), so
    # that PERSISTENT_MAX_KEYS may move; with order_ranges (each item's key range in its
    # row of the order table: one round trip at an item's start, not two), and the
    # ping-pong's turns on the mbarrier (named_turns=false: 1.07x the old row at head dim
    # 64 causal 2k, 0.97x at 1k, on an H100), at 1k-4k; then where the warps wait in the
    # new head-dim-64 causal 1k default (the 54th session's profile of the old row: 6 %
    # of the samples at the kernel's start, 6 % on the consumers' wait for Q, 4 % on O's
    # read-out).
    H=$M/persistent=true/early_q_load=true/head_rounds=true
    FA_PASSES=fwd FA_SEQS=1024,2048,4096 \
      MOSAIC_FA_IMPLS=$M,$H,$H/order_ranges=true,$M/named_turns=false,jax.nn:cudnn \
      timeout 300 bash $G "$C" mosaic-fa:64:true mosaic-fa:128:true
    keep fa-mosaic-causal-4k-head-rounds
    STALLS_PASS=fwd STALLS_KERNELS=pallas_flash_mosaic_fwd \
      STALLS_NAME=stalls-fwd-64-1024-true-head-rounds bash $G "$C" stalls-fa:64:1024:true ;;
  *) echo "next_calls: no call $call (1 or 2)" >&2; exit 2 ;;
esac

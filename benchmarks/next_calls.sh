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
  1) # (H) the head-dim-64 forward beside the three peers at 2k and 8k, causal and not, on
    # the H200: those four table cells predate the rows' row sums on the tensor cores
    # (non-causal) and column blocks (causal). Then the weakest cell, head dim 64 causal
    # 1k (0.90x cuDNN at 74e1a14), beside five variants of its row: 64-key tiles, the
    # persistent grid alone and with early Q loads (a CTA there walks 1-8 key tiles, so
    # its fixed costs weigh most), the row sums on the tensor cores and three stages.
    FA_PASSES=fwd FA_SEQS=2048,8192 MOSAIC_FA_IMPLS=$M,$PEERS timeout 200 \
      bash $G "$C" mosaic-fa:64:false mosaic-fa:64:true
    keep fa-mosaic-64-fwd-2k-8k
    FA_PASSES=fwd FA_SEQS=1024 \
      MOSAIC_FA_IMPLS=$M,$M/block_kv=64,$M/persistent=true,$M/persistent=true/early_q_load=true,$M/row_sum_wgmma=true,$M/num_stages=3,$PEERS \
      timeout 150 bash $G "$C" mosaic-fa:64:true
    keep fa-mosaic-64-true-1k-variants ;;
  2) # head dim 256's backward with the lse read early (its default since the 53rd
    # session) beside the row without it and cuDNN at 2k and 8k, causal and not (the
    # table's cells there predate it); its compiled reference tests and determinism (the
    # 5 case-table rows of head dim 256, both operand forms, and the defaults' two calls);
    # then where the warps wait at the two weakest cells: the forward at head dim 64
    # causal 1k and the backward at head dim 128 non-causal 16k (0.98x cuDNN).
    FA_PASSES=bwd FA_SEQS=2048,8192 MOSAIC_FA_IMPLS=$M,$M/early_lse=false,jax.nn:cudnn \
      timeout 250 bash $G "$C" mosaic-fa:256:false mosaic-fa:256:true
    keep fa-mosaic-256-bwd-early-lse
    MOSAIC_TESTS_WORKERS=8 MOSAIC_TESTS_TIMEOUT=150 \
      MOSAIC_TESTS_K="test_mosaic_backward and ((test_gpu_matches_reference and h256) or (test_gpu_is_bitwise_deterministic and 256))" \
      bash $G "$C" mosaic-tests
    STALLS_PASS=fwd STALLS_KERNELS=pallas_flash_mosaic_fwd STALLS_NAME=stalls-fwd-64-1024-true \
      bash $G "$C" stalls-fa:64:1024:true
    STALLS_NAME=stalls-bwd-128-16384-false bash $G "$C" stalls-fa:128:16384:false ;;
  *) echo "next_calls: no call $call (1 or 2)" >&2; exit 2 ;;
esac

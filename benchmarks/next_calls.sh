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
  1) # the backward defaults beside the pair and cuDNN at 2k-16k, on the H200: the fused
    # build at head dim 64 non-causal (the default since the 44th session) and at 128
    # causal (since the 44th, in bands of 4 heads since the 47th; timed so far on an H100).
    FA_PASSES=bwd FA_SEQS=2048,4096,8192,16384 MOSAIC_FA_IMPLS=$M,$M/pair,jax.nn:cudnn \
      timeout 270 bash $G "$C" mosaic-fa:64:false
    keep fa-mosaic-64-false-fused-default
    FA_PASSES=bwd FA_SEQS=2048,4096,8192,16384 MOSAIC_FA_IMPLS=$M,$M/pair,jax.nn:cudnn \
      timeout 270 bash $G "$C" mosaic-fa:128:true
    keep fa-mosaic-128-true-fused-default ;;
  2) # (G) the forward's head-dim-64 rows beside the three peers at 1k, 4k and 16k, so
    # that the forward's table cells count them; the head-dim-128 non-causal default
    # backward (the whole share since the 43rd session) and the head-dim-64 causal one
    # (the fused kernel in bands of 4 since the 48th, launched from the last span down
    # since 78baa53) at 2k-16k beside cuDNN.
    FA_PASSES=fwd FA_SEQS=1024,4096,16384 MOSAIC_FA_IMPLS=$M,$PEERS timeout 170 \
      bash $G "$C" mosaic-fa:64:false mosaic-fa:64:true
    keep fa-mosaic-64-fwd
    FA_PASSES=bwd FA_SEQS=2048,4096,8192,16384 MOSAIC_FA_IMPLS=$M,jax.nn:cudnn timeout 270 \
      bash $G "$C" mosaic-fa:128:false mosaic-fa:64:true
    keep fa-mosaic-bwd-defaults ;;
  3) # early_lse (each step's lse read before its scores' wgmma: docs/mosaic.md, "Where the
    # consumers wait") at head dim 128, where the fused default's source profile found 11 %
    # of a consumer's step samples on the lse's first FFMAs (0e8a8d2): beside the default
    # and cuDNN non-causal 2k / 8k / 16k and causal 8k (where it spills into the unmasked
    # steps); then its source profile at 128 non-causal 8k (those stalls gone?) and its
    # compiled tests (the 11 case-table rows of padded head dim 128).
    FA_PASSES=bwd FA_SEQS=2048,8192,16384 MOSAIC_FA_IMPLS=$M,$M/early_lse=true,jax.nn:cudnn \
      timeout 200 bash $G "$C" mosaic-fa:128:false
    keep fa-mosaic-128-false-early-lse
    FA_PASSES=bwd FA_SEQS=8192 MOSAIC_FA_IMPLS=$M,$M/early_lse=true,jax.nn:cudnn \
      timeout 90 bash $G "$C" mosaic-fa:128:true
    keep fa-mosaic-128-true-early-lse
    STALLS_IMPL=$M/early_lse=true STALLS_NAME=stalls-128-false-8k-early-lse \
      bash $G "$C" stalls-fa:128:8192:false
    MOSAIC_TESTS_WORKERS=12 MOSAIC_TESTS_TIMEOUT=150 MOSAIC_TESTS_K=test_gpu_fused_early_lse \
      bash $G "$C" mosaic-tests ;;
  4) # where the other defaults' warps wait (benchmarks.stall_sites, about 30 s each): the
    # backward at head dim 64 non-causal and causal 8k and at 128 causal 16k (0.98x cuDNN
    # there on an H100, 0e8a8d2), the forward at head dim 64 causal 2k (its weakest cell
    # against the best peer) and 64 non-causal 8k; then at head dim 256, the one row that
    # takes the pair, probs_before_dp (its dQ kernel's wait moves: 1.00-1.07x in the pair
    # at head dims 64 and 128, 0e8a8d2) and early_lse (the dV warpgroup's lse read early:
    # no spill non-causal, compiled here), beside the default and cuDNN at 4k and 16k.
    for spec in 64:8192:false 64:8192:true 128:16384:true; do
      STALLS_NAME=stalls-bwd-${spec//:/-} bash $G "$C" stalls-fa:$spec
    done
    for spec in 64:2048:true 64:8192:false; do
      STALLS_PASS=fwd STALLS_KERNELS=pallas_flash_mosaic_fwd STALLS_NAME=stalls-fwd-${spec//:/-} \
        bash $G "$C" stalls-fa:$spec
    done
    FA_PASSES=bwd FA_SEQS=4096,16384 \
      MOSAIC_FA_IMPLS=$M,$M/probs_before_dp=true,$M/early_lse=true,jax.nn:cudnn \
      timeout 260 bash $G "$C" mosaic-fa:256:false mosaic-fa:256:true
    keep fa-mosaic-256-bwd-options ;;
  *) echo "next_calls: no call $call (1 to 4)" >&2; exit 2 ;;
esac

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
  3) # the writer's hand-over patch on the default ("Two writer warps", item 5): applied
    # to this copy of the tree, timed, then its compiled tests; nothing runs without it.
    P=benchmarks/results/mosaic-3167827/hand-over.patch
    if patch -p1 --forward < $P && grep -q "not again" pallas_flash/mosaic/dq_adds.py; then
      FA_PASSES=bwd FA_SEQS=8192 MOSAIC_FA_IMPLS=$M,jax.nn:cudnn timeout 300 \
        bash $G "$C-hand-over" mosaic-fa:128:false
      keep fa-mosaic-128-false-hand-over
      K="(test_mosaic_backward and test_gpu_matches_reference and regs and not h256)"
      K="$K or (test_mosaic_backward and test_gpu_is_bitwise_deterministic)"
      MOSAIC_TESTS_WORKERS=12 MOSAIC_TESTS_TIMEOUT=300 MOSAIC_TESTS_K="$K" \
        bash $G "$C-hand-over" mosaic-tests
    else echo "next_calls: $P does not apply here" >&2; exit 1; fi ;;
  4) # the Mosaic kernels on the masks suite (head dim 128, 8k), each mask's overhead;
    # then (H) probs_before_dp in the pair (FA3's order, the fused default's, has it
    # already) beside the pair and cuDNN.
    OURS_IMPLS=$M,jax.nn:cudnn BENCH_BUDGET=200 bash $G "$C" masks-ours:none,segments:4,padding
    FA_PASSES=bwd FA_SEQS=2048,8192 MOSAIC_FA_IMPLS=$M/pair,$M/pair/probs_before_dp=true,jax.nn:cudnn \
      timeout 290 bash $G "$C" mosaic-fa:64:false mosaic-fa:64:true mosaic-fa:128:true
    keep fa-mosaic-bwd-probs-before-dp ;;
  5) # high_spans_first and the L2 (high_first_bytes, the launch model's l2_rereads): at
    # head dim 64 causal with 32k tokens a batch (2x the grid's; no README cell), where
    # bands of 4 would hold 64 MiB of query-side tiles, the default launches in bands of
    # 2 (launched; bands of one head at 64k tokens ran 1.014x / 1.017x the plain order,
    # 2a56c3a), beside the plain order (high_first_bytes=1: no head fits) and cuDNN. Then
    # at head dim 128 causal (16k tokens), where it ran 0.85-0.93x the plain order in
    # bands of 4 (64 MiB, forced here as timed then), in bands of 2 and 1.
    for seq in 8192 16384; do
      FA_PASSES=bwd FA_SEQS=$seq FA_BATCHES=$((32768 / seq)) \
        MOSAIC_FA_IMPLS=$M,$M/high_first_bytes=1,jax.nn:cudnn \
        timeout 120 bash $G "$C" mosaic-fa:64:true
      keep fa-mosaic-64-true-high-first-32k-$seq
    done
    H=$M/rotated_adds=true/high_spans_first=true
    FA_PASSES=bwd FA_SEQS=8192,16384 \
      MOSAIC_FA_IMPLS=$M,$H/high_first_bytes=1073741824,$H/span_band=2,$H/span_band=1,jax.nn:cudnn \
      timeout 250 bash $G "$C" mosaic-fa:128:true
    keep fa-mosaic-128-true-high-spans-first-bands
    # compiled: bands narrowed by high_first_bytes keep the bits of bands of 4 (10 causal
    # GQA rows); the split_tail backward test, which takes the default row in the plain
    # order since 78baa53 (not compiled since).
    K="test_gpu_high_first_bytes_narrowed_band or test_gpu_split_tail_backward"
    MOSAIC_TESTS_WORKERS=12 MOSAIC_TESTS_TIMEOUT=150 MOSAIC_TESTS_K="$K" \
      bash $G "$C" mosaic-tests ;;
  *) echo "next_calls: no call $call (1 to 5)" >&2; exit 2 ;;
esac

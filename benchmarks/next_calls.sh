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
  2) # early_q_load at head dim 64 non-causal (the persistent grid, its last round split:
    # the default there): the next item's Q loaded in the tile loop's last step. On an
    # H100 at 4c2c14e it ran 1.035x / 1.064x the default at 1k (against the default and
    # a persistent=true copy of it, 384.0 / 394.7 TFLOP/s) and 1.024x / 1.027x at 2k
    # (results/mosaic-4c2c14e/fa-mosaic-64-early-q.jsonl): here 1k-16k, in two processes.
    for round in 1 2; do
      FA_PASSES=fwd FA_SEQS=1024,2048,4096,16384 \
        MOSAIC_FA_IMPLS=$M,$M/early_q_load=true,jax.nn:cudnn,jax:mosaic_fa3 \
        timeout 200 bash $G "$C" mosaic-fa:64:false
      keep fa-mosaic-64-false-early-q-$round
    done ;;
  3) # (G) the forward's head-dim-64 rows beside the three peers at 1k, 4k and 16k, so
    # that the forward's table cells count them; the head-dim-128 non-causal default
    # backward (the whole share since the 43rd session) and the head-dim-64 causal one
    # (the fused kernel in bands of 4 since the 48th) at 2k-16k beside cuDNN.
    FA_PASSES=fwd FA_SEQS=1024,4096,16384 MOSAIC_FA_IMPLS=$M,$PEERS timeout 170 \
      bash $G "$C" mosaic-fa:64:false mosaic-fa:64:true
    keep fa-mosaic-64-fwd
    FA_PASSES=bwd FA_SEQS=2048,4096,8192,16384 MOSAIC_FA_IMPLS=$M,jax.nn:cudnn timeout 270 \
      bash $G "$C" mosaic-fa:128:false mosaic-fa:64:true
    keep fa-mosaic-bwd-defaults ;;
  4) # the writer's hand-over patch on the default ("Two writer warps", item 5): applied
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
  5) # the Mosaic kernels on the masks suite (head dim 128, 8k), each mask's overhead;
    # then (H) probs_before_dp in the pair (FA3's order, the fused default's, has it
    # already) beside the pair and cuDNN.
    OURS_IMPLS=$M,jax.nn:cudnn BENCH_BUDGET=200 bash $G "$C" masks-ours:none,segments:4,padding
    FA_PASSES=bwd FA_SEQS=2048,8192 MOSAIC_FA_IMPLS=$M/pair,$M/pair/probs_before_dp=true,jax.nn:cudnn \
      timeout 290 bash $G "$C" mosaic-fa:64:false mosaic-fa:64:true mosaic-fa:128:true
    keep fa-mosaic-bwd-probs-before-dp ;;
  6) # one bounded Nsight Compute profile of the default backward, head dim 128
    # non-causal 8k (the whole share since the 43rd session).
    PROFILE_KERNELS=pallas_flash_mosaic_bwd PROFILE_IMPLS=$M PROFILE_DETAILS=1 \
      PROFILE_SECTIONS=MemoryWorkloadAnalysis_Tables,WarpStateStats timeout 200 \
      bash $G "$C" profile-fa:128:8192:false ;;
  7) # what the fused backward's turns cost under the causal mask, measured rather than
    # modelled: the default (bands of 4) and high_spans_first at head dims 64 and 128, 8k
    # and 16k, then the same with the writer's turn waits taken out (no-turns.patch on
    # this copy of the tree: the adds in any order, wrong sums, the same traffic). The
    # launch model says the turns' queue is what is left at 64 causal; high_spans_first,
    # which should have taken it away, ran 0.96-1.02x there and 0.75-0.83x at 128.
    # Between the two, on the unpatched tree, high_spans_first's compiled tests (its walk
    # plain since c268693; the rotated one passed 14 of 14 at 4c2c14e).
    H=$M/rotated_adds=true/high_spans_first=true
    FA_PASSES=bwd FA_SEQS=8192,16384 MOSAIC_FA_IMPLS=$M,$H,jax.nn:cudnn timeout 170 \
      bash $G "$C" mosaic-fa:64:true mosaic-fa:128:true
    keep fa-mosaic-bwd-turns
    MOSAIC_TESTS_WORKERS=12 MOSAIC_TESTS_TIMEOUT=150 \
      MOSAIC_TESTS_K="test_gpu_fused_high_spans_first_matches_reference and causal" \
      bash $G "$C" mosaic-tests
    P=benchmarks/results/mosaic-5de773c/no-turns.patch
    if patch -p1 --forward < $P && grep -q "no-turns.patch" pallas_flash/mosaic/dq_adds.py; then
      FA_PASSES=bwd FA_SEQS=8192,16384 MOSAIC_FA_IMPLS=$M,$H,jax.nn:cudnn timeout 170 \
        bash $G "$C-no-turns" mosaic-fa:64:true mosaic-fa:128:true
      keep fa-mosaic-bwd-no-turns
    else echo "next_calls: $P does not apply here" >&2; exit 1; fi ;;
  *) echo "next_calls: no call $call (1 to 7)" >&2; exit 2 ;;
esac

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
  2) # the compiled tests of the 48th session's default, the fused backward in bands of 4
    # heads at head dim 64 causal (padded: head dims up to 64): the case table's causal
    # rows up to 64 as the API picks them (7 of them passed at 9abcf47 before the call's
    # 300 s ran out, results/mosaic-9abcf47/) and the defaults' bitwise determinism at
    # head dims 64-256 both ways (at 64 causal never compiled as the default).
    K="(test_mosaic_backward and test_gpu_matches_reference and regs and causal"
    K="$K and (h32 or h64)) or (test_mosaic_backward and test_gpu_is_bitwise_deterministic)"
    MOSAIC_TESTS_WORKERS=12 MOSAIC_TESTS_TIMEOUT=500 MOSAIC_TESTS_K="$K" \
      bash $G "$C" mosaic-tests ;;
  3) # the head-dim-64 causal backward default (the fused kernel in bands of 4 heads since
    # the 48th session) beside the fused kernel in bands of 8, the pair and cuDNN at
    # 2k-16k: on an H100 the default ran 1.04-1.09x the pair from 4k in three runs, but at
    # 2k 1.05x in one and 0.95x in the other; bands of 8 1.03-1.05x bands of 4 from 8k and
    # 0.93x at 2k (results/mosaic-1fc58b7/, mosaic-9abcf47/).
    FA_PASSES=bwd FA_SEQS=2048,4096,8192,16384 \
      MOSAIC_FA_IMPLS=$M,$M/fused/span_band=8,$M/pair,jax.nn:cudnn \
      timeout 300 bash $G "$C" mosaic-fa:64:true
    keep fa-mosaic-64-true-bwd-bands ;;
  4) # (G) the forward's head-dim-64 rows beside the three peers at 1k, 4k and 16k, so
    # that the forward's table cells count them; the head-dim-128 non-causal default
    # backward (the whole share since the 43rd session) at 2k-16k; the persistent forward
    # with early Q loads at head dim 64, 1k and 2k (the head-dim-64 causal backward: call 3).
    FA_PASSES=fwd FA_SEQS=1024,4096,16384 MOSAIC_FA_IMPLS=$M,$PEERS timeout 170 \
      bash $G "$C" mosaic-fa:64:false mosaic-fa:64:true
    keep fa-mosaic-64-fwd
    FA_PASSES=bwd FA_SEQS=2048,4096,8192,16384 MOSAIC_FA_IMPLS=$M,jax.nn:cudnn timeout 130 \
      bash $G "$C" mosaic-fa:128:false
    keep fa-mosaic-128-false-default
    FA_PASSES=fwd FA_SEQS=1024,2048 \
      MOSAIC_FA_IMPLS=$M,$M/persistent=true,$M/persistent=true/early_q_load=true,jax.nn:cudnn,jax:mosaic_fa3 \
      timeout 150 bash $G "$C" mosaic-fa:64:true mosaic-fa:64:false
    keep fa-mosaic-64-early-q ;;
  5) # the writer's hand-over patch on the default ("Two writer warps", item 5): applied
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
  6) # the Mosaic kernels on the masks suite (head dim 128, 8k), each mask's overhead;
    # then (H) probs_before_dp in the pair (FA3's order, the fused default's, has it
    # already) beside the pair and cuDNN.
    OURS_IMPLS=$M,jax.nn:cudnn BENCH_BUDGET=200 bash $G "$C" masks-ours:none,segments:4,padding
    FA_PASSES=bwd FA_SEQS=2048,8192 MOSAIC_FA_IMPLS=$M/pair,$M/pair/probs_before_dp=true,jax.nn:cudnn \
      timeout 290 bash $G "$C" mosaic-fa:64:false mosaic-fa:64:true mosaic-fa:128:true
    keep fa-mosaic-bwd-probs-before-dp ;;
  7) # one bounded Nsight Compute profile of the default backward, head dim 128
    # non-causal 8k (the whole share since the 43rd session).
    PROFILE_KERNELS=pallas_flash_mosaic_bwd PROFILE_IMPLS=$M PROFILE_DETAILS=1 \
      PROFILE_SECTIONS=MemoryWorkloadAnalysis_Tables,WarpStateStats timeout 200 \
      bash $G "$C" profile-fa:128:8192:false ;;
  8) # the backward's band_pairs at 64k tokens a batch (4x the grid's), causal: the
    # default (bands narrowed to 32 (head, batch element) pairs: one head at 2k, 32
    # elements, two at 4k, 16) beside whole bands of 4 (band_pairs=128: 128 and 64
    # pairs), the plain order and cuDNN; then head dim 64 at 2k. Rows off the grid's 16k
    # tokens: no README cell takes them (render.load).
    FA_PASSES=bwd FA_SEQS=2048 FA_BATCHES=32 \
      MOSAIC_FA_IMPLS=$M,$M/band_pairs=128,$M/span_band=1,jax.nn:cudnn \
      timeout 200 bash $G "$C" mosaic-fa:128:true mosaic-fa:64:true
    keep fa-mosaic-bwd-band-pairs-2k
    FA_PASSES=bwd FA_SEQS=4096 FA_BATCHES=16 \
      MOSAIC_FA_IMPLS=$M,$M/band_pairs=128,$M/span_band=1,jax.nn:cudnn \
      timeout 150 bash $G "$C" mosaic-fa:128:true
    keep fa-mosaic-bwd-band-pairs-4k ;;
  9) # high_spans_first (49th session): the fused backward's key spans launched from the
    # last down and walked upward, a tile's adds in decreasing span order, so that under
    # the causal mask each turn is due on arrival (the launch model with the adds' turns:
    # fill 0.89-0.95 at head dim 64 against the default's 0.84-0.85; at 128 0.92-0.94
    # against 0.96-0.99), beside the default (bands of 4 heads) and cuDNN. Its compiled
    # tests: call 10.
    H=$M/rotated_adds=true/high_spans_first=true
    FA_PASSES=bwd FA_SEQS=2048,4096,8192,16384 MOSAIC_FA_IMPLS=$M,$H,jax.nn:cudnn \
      timeout 270 bash $G "$C" mosaic-fa:64:true
    keep fa-mosaic-64-true-high-spans-first
    FA_PASSES=bwd FA_SEQS=4096,8192,16384 MOSAIC_FA_IMPLS=$M,$H,jax.nn:cudnn \
      timeout 200 bash $G "$C" mosaic-fa:128:true
    keep fa-mosaic-128-true-high-spans-first ;;
  10) # the compiled tests of high_spans_first on the case table's causal rows (a turn out
    # of order hangs or overwrites), with call 2's (the head-dim-64 causal default's).
    K="(test_mosaic_backward and test_gpu_matches_reference and regs and causal"
    K="$K and (h32 or h64)) or (test_mosaic_backward and test_gpu_is_bitwise_deterministic)"
    K="$K or (test_gpu_fused_high_spans_first_matches_reference and causal)"
    MOSAIC_TESTS_WORKERS=12 MOSAIC_TESTS_TIMEOUT=520 MOSAIC_TESTS_K="$K" \
      bash $G "$C" mosaic-tests ;;
  *) echo "next_calls: no call $call (1 to 10)" >&2; exit 2 ;;
esac

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
  1) # the backward defaults that changed in the 44th session (the fused build at head
    # dim 64 non-causal and at 128 causal; timed so far on an H100 only) beside the pair
    # and cuDNN at 2k-16k, on the H200.
    FA_PASSES=bwd FA_SEQS=2048,4096,8192,16384 MOSAIC_FA_IMPLS=$M,$M/pair,jax.nn:cudnn \
      timeout 270 bash $G "$C" mosaic-fa:64:false
    keep fa-mosaic-64-false-fused-default
    FA_PASSES=bwd FA_SEQS=2048,4096,8192,16384 MOSAIC_FA_IMPLS=$M,$M/pair,jax.nn:cudnn \
      timeout 270 bash $G "$C" mosaic-fa:128:true
    keep fa-mosaic-128-true-fused-default ;;
  2) # the launch's waves (benchmarks/launch_sim.py): every non-causal grid point has
    # 2048 or 4096 equal CTAs (or persistent items), 15.5 or 31.03 waves on 132 SMs, a
    # fill of 0.970 by the model; with 33 heads instead of 32 the items are 4224, 32
    # whole waves, 1.000. Both passes, 8k non-causal, head dims 128 and 64, ours and
    # cuDNN at 32 and 33 heads, and split_tail (both configs' field: the forward's last
    # round split by keys, the backward's last wave by query tiles). Prediction: ours
    # 1.02-1.03x the TFLOP/s at 33 heads; split_tail 1.01-1.03x both passes at 32 heads
    # and the same at 33 (nothing to split).
    FA_PASSES=fwd,bwd FA_SEQS=8192 FA_HEADS=32,33 \
      MOSAIC_FA_IMPLS=$M,$M/split_tail=true,jax.nn:cudnn \
      timeout 230 bash $G "$C" mosaic-fa:128:false
    keep fa-mosaic-128-false-waves
    FA_PASSES=fwd,bwd FA_SEQS=8192 FA_HEADS=32,33 \
      MOSAIC_FA_IMPLS=$M,$M/split_tail=true,jax.nn:cudnn \
      timeout 210 bash $G "$C" mosaic-fa:64:false
    keep fa-mosaic-64-false-waves ;;
  3) # the backward's launch order in bands of heads (span_band: a band's first key
    # spans first, then its second ones, then the next band) beside the plain order and
    # cuDNN at head dims 128 and 64 causal, 4k-16k: every head at once ran 1.013x at 128
    # 16k and lost at 4k-8k on an H100 at c8a6ae2 (its float32 dQ tiles no longer in L2);
    # bands of 2-4 heads keep the tail off with a few heads' tiles in L2. At 64 also the
    # fused kernel, head-major and banded (every head at once: 1.07x the pair at 16k,
    # 0.77x at 8k).
    FA_PASSES=bwd FA_SEQS=4096,8192,16384 \
      MOSAIC_FA_IMPLS=$M,$M/span_band=2,$M/span_band=4,jax.nn:cudnn \
      timeout 230 bash $G "$C" mosaic-fa:128:true
    keep fa-mosaic-128-true-span-band
    FA_PASSES=bwd FA_SEQS=4096,8192,16384 \
      MOSAIC_FA_IMPLS=$M,$M/span_band=4,$M/fused,$M/fused/span_band=2,$M/fused/span_band=4,jax.nn:cudnn \
      timeout 300 bash $G "$C" mosaic-fa:64:true
    keep fa-mosaic-64-true-span-band ;;
  4) # span_band's compiled bits (bands of 2) on every case-table row up to head dim 128
    # as the default rows run them; split_tail's compiled tests (more items than SMs: the
    # reference, the unsplit grid within float32 merging, the same bits twice); the
    # defaults' bitwise determinism at head dims 64-256 both ways and the fused kernel's ten-call determinism test (the defaults' reference
    # rows passed on an H100 at c8a6ae2: results/mosaic-c8a6ae2/mosaic-tests-defaults-*).
    K="test_gpu_span_band_changes_no_bit or test_gpu_fused_is_bitwise or test_gpu_split_tail"
    K="$K or (test_mosaic_backward and test_gpu_is_bitwise_deterministic)"
    MOSAIC_TESTS_WORKERS=12 MOSAIC_TESTS_TIMEOUT=500 MOSAIC_TESTS_K="$K" \
      bash $G "$C" mosaic-tests ;;
  5) # (G) the forward's head-dim-64 rows beside the three peers at 1k, 4k and 16k, so
    # that the forward's table cells count them; the head-dim-64 causal backward at 4k
    # and 16k; the head-dim-128 non-causal default backward (the whole share since the
    # 43rd session) at 2k-16k; the persistent forward with early Q loads at head dim 64,
    # 1k and 2k.
    FA_PASSES=fwd FA_SEQS=1024,4096,16384 MOSAIC_FA_IMPLS=$M,$PEERS timeout 170 \
      bash $G "$C" mosaic-fa:64:false mosaic-fa:64:true
    keep fa-mosaic-64-fwd
    FA_PASSES=bwd FA_SEQS=4096,16384 MOSAIC_FA_IMPLS=$M,jax.nn:cudnn timeout 80 \
      bash $G "$C" mosaic-fa:64:true
    keep fa-mosaic-64-true-bwd-4k-16k
    FA_PASSES=bwd FA_SEQS=2048,4096,8192,16384 MOSAIC_FA_IMPLS=$M,jax.nn:cudnn timeout 130 \
      bash $G "$C" mosaic-fa:128:false
    keep fa-mosaic-128-false-default
    FA_PASSES=fwd FA_SEQS=1024,2048 \
      MOSAIC_FA_IMPLS=$M,$M/persistent=true,$M/persistent=true/early_q_load=true,jax.nn:cudnn,jax:mosaic_fa3 \
      timeout 150 bash $G "$C" mosaic-fa:64:true mosaic-fa:64:false
    keep fa-mosaic-64-early-q ;;
  6) # the writer's hand-over patch on the default ("Two writer warps", item 5): applied
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
  7) # the Mosaic kernels on the masks suite (head dim 128, 8k), each mask's overhead;
    # then (H) probs_before_dp in the pair (FA3's order, the fused default's, has it
    # already) beside the pair and cuDNN.
    OURS_IMPLS=$M,jax.nn:cudnn BENCH_BUDGET=200 bash $G "$C" masks-ours:none,segments:4,padding
    FA_PASSES=bwd FA_SEQS=2048,8192 MOSAIC_FA_IMPLS=$M/pair,$M/pair/probs_before_dp=true,jax.nn:cudnn \
      timeout 290 bash $G "$C" mosaic-fa:64:false mosaic-fa:64:true mosaic-fa:128:true
    keep fa-mosaic-bwd-probs-before-dp ;;
  8) # one bounded Nsight Compute profile of the default backward, head dim 128
    # non-causal 8k (the whole share since the 43rd session).
    PROFILE_KERNELS=pallas_flash_mosaic_bwd PROFILE_IMPLS=$M PROFILE_DETAILS=1 \
      PROFILE_SECTIONS=MemoryWorkloadAnalysis_Tables,WarpStateStats timeout 200 \
      bash $G "$C" profile-fa:128:8192:false ;;
  9) # the forward's next Q K^T issued behind each P V (qk_behind_pv: a step's wgmmas in
    # one run, where the default awaits P V before the next step issues its Q K^T) beside
    # the default rows and the two fastest peer forwards: head dim 128 both ways at 2k,
    # 8k and 16k; head dim 64 with 128-key tiles (a second 256-key score tile does not
    # fit beside P) beside the default's 256-key row and its 128-key form, 2k and 8k.
    # Prediction: 1.01-1.04x at 128, where the tensor cores bound the step; then its
    # compiled bits on the case table, for the time left.
    FA_PASSES=fwd FA_SEQS=2048,8192,16384 \
      MOSAIC_FA_IMPLS=$M,$M/qk_behind_pv=true,jax.nn:cudnn,jax:mosaic_fa3 \
      timeout 200 bash $G "$C" mosaic-fa:128:false mosaic-fa:128:true
    keep fa-mosaic-128-qk-behind-pv
    FA_PASSES=fwd FA_SEQS=2048,8192 \
      MOSAIC_FA_IMPLS=$M,$M/block_kv=128,$M/qk_behind_pv=true/block_kv=128,jax.nn:cudnn,jax:mosaic_fa3 \
      timeout 170 bash $G "$C" mosaic-fa:64:false mosaic-fa:64:true
    keep fa-mosaic-64-qk-behind-pv
    MOSAIC_TESTS_WORKERS=12 MOSAIC_TESTS_TIMEOUT=150 MOSAIC_TESTS_K="test_gpu_qk_behind_pv" \
      bash $G "$C" mosaic-tests ;;
  *) echo "next_calls: no call $call (1 to 9)" >&2; exit 2 ;;
esac

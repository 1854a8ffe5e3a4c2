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
# The fused backward's head-dim-64 candidates (docs/mosaic.md, "A narrow share at head
# dim 64"): 128-row tiles with step descriptors, and 64-row tiles with the share's halves.
H64=$M/q_do_in_registers=false/fused=true/num_stages_dkv=2/fa3_order=true/step_descriptors=true/writer_warp=true/split_writer=true
N64=$M/q_do_in_registers=false/fused=true/block_q_dkv=64/share_halves=true/fa3_order=true/writer_warp=true/split_writer=true
# The forward's intra-warpgroup overlap, with what it takes in place of the default row's
# early K wait, named turns, (non-causal) persistent grid and (head dim 64 non-causal) row
# sums on the tensor cores; 128-key tiles (at head dim 64 the default's 256-key tiles do
# not fit two score tiles' registers: C7512, 644 B of spills). It keeps the row's
# conditional rescale (head dims 128-256) since the 43rd session; without it, at f6435c2,
# it ran 0.93-1.00x the default at head dim 128 (results/mosaic-f6435c2/).
OVERLAP=$M/intra_overlap=true/early_k_wait=false/named_turns=false/persistent=false/row_sum_wgmma=false/block_kv=128
# keep NAME: the last mosaic-fa step's rows as $OUT/NAME.jsonl (a step that wrote none,
# for a timeout before its first row, is said, and the call goes on).
keep() {
  if [ -e "$OUT/fa-mosaic.jsonl" ]; then mv "$OUT/fa-mosaic.jsonl" "$OUT/$1.jsonl"
  else echo "next_calls: no rows for $1" >&2; fi
}
PEERS=jax.nn:cudnn,tokamax:mosaic,jax:mosaic_fa3
# overlap_fwd HD: the overlapped forward beside the default and all three peers at 2k and
# 8k, both ways (call 1).
overlap_fwd() {
  FA_PASSES=fwd FA_SEQS=2048,8192 MOSAIC_FA_IMPLS=$M,$OVERLAP,$PEERS timeout 200 \
    bash $G "$C" mosaic-fa:$1:false mosaic-fa:$1:true
  keep fa-mosaic-$1-fwd-overlap
}
case $call in
  1) # the overlapped forward (unserialized since 12-05; at head dim 128 it trailed the
    # default without the conditional rescale, results/mosaic-f6435c2/, and takes it now)
    # beside the default and all three peers at 2k and 8k, head dims 128 and 64; then
    # (G) the head-dim-64 rows beside the peers at the other lengths, so that the
    # forward's table cells count them.
    overlap_fwd 128
    overlap_fwd 64
    FA_PASSES=fwd FA_SEQS=1024,4096,16384 MOSAIC_FA_IMPLS=$M,$PEERS timeout 170 \
      bash $G "$C" mosaic-fa:64:false mosaic-fa:64:true
    keep fa-mosaic-64-fwd ;;
  2) # the fused backward's head-dim-64 candidates beside the pair and cuDNN, then the
    # compiled tests of whichever candidate this call or call 1 put ahead
    # (CALL2_TESTS, pytest -k: narrow_share by default, or intra_overlap).
    FA_PASSES=bwd FA_SEQS=2048,8192 \
      MOSAIC_FA_IMPLS=$M,$H64,$N64,$N64/step_descriptors=true,jax.nn:cudnn timeout 320 \
      bash $G "$C" mosaic-fa:64:false mosaic-fa:64:true
    keep fa-mosaic-64-fused
    MOSAIC_TESTS_WORKERS=12 MOSAIC_TESTS_TIMEOUT=240 \
      MOSAIC_TESTS_K=${CALL2_TESTS:-narrow_share} bash $G "$C" mosaic-tests ;;
  3) # the backward at 4k and 16k (the cells 1d6a8bd's run left; head dim 128
    # non-causal is call 4's); the persistent forward with early Q loads at head dim 64,
    # 1k and 2k.
    FA_PASSES=bwd FA_SEQS=4096,16384 MOSAIC_FA_IMPLS=$M,jax.nn:cudnn timeout 360 \
      bash $G "$C" mosaic-fa:64:false mosaic-fa:64:true mosaic-fa:128:true
    keep fa-mosaic-bwd-4k-16k
    FA_PASSES=fwd FA_SEQS=1024,2048 \
      MOSAIC_FA_IMPLS=$M,$M/persistent=true,$M/persistent=true/early_q_load=true,jax.nn:cudnn,jax:mosaic_fa3 \
      timeout 150 bash $G "$C" mosaic-fa:64:true mosaic-fa:64:false
    keep fa-mosaic-64-early-q ;;
  4) # the default backward at head dim 128 non-causal (its dQ share whole since the
    # 43rd session; on the H200 timed only as a variant, at 8k) beside cuDNN at 2k-16k;
    # causal, the fused kernel with that share (`fused`: compiled, its 11 padded-head-
    # dim-128 rows passed at d044a97, causal ones included) and the rows' step (1.05x
    # the pair at 8k on the H200, 0.96-0.98x at 2k / 4k / 16k on an H100) beside the
    # pair (the default there) and cuDNN, on the H200.
    FA_PASSES=bwd FA_SEQS=2048,4096,8192,16384 MOSAIC_FA_IMPLS=$M,jax.nn:cudnn timeout 200 \
      bash $G "$C" mosaic-fa:128:false
    keep fa-mosaic-128-false-default
    FA_PASSES=bwd FA_SEQS=2048,4096,8192,16384 \
      MOSAIC_FA_IMPLS=$M,$M/fused,$M/fused/fa3_order=false/query_rows=true,jax.nn:cudnn \
      timeout 300 bash $G "$C" mosaic-fa:128:true
    keep fa-mosaic-128-true-fused-whole ;;
  5) # the writer's hand-over patch on the default ("Two writer warps", item 5): applied
    # to this copy of the tree, timed, then its compiled tests; nothing runs without it.
    P=benchmarks/results/mosaic-3167827/hand-over.patch
    if patch -p1 --forward < $P && grep -q "not again" pallas_flash/mosaic/dq_adds.py; then
      FA_PASSES=bwd FA_SEQS=8192 MOSAIC_FA_IMPLS=$M,jax.nn:cudnn timeout 300 \
        bash $G "$C-hand-over" mosaic-fa:128:false
      keep fa-mosaic-128-false-hand-over
      K="(test_mosaic_backward and test_gpu_matches_reference and regs and (h80 or h96 or h128) and not causal)"
      K="$K or (test_mosaic_backward and test_gpu_is_bitwise_deterministic)"
      MOSAIC_TESTS_WORKERS=12 MOSAIC_TESTS_TIMEOUT=300 MOSAIC_TESTS_K="$K" \
        bash $G "$C-hand-over" mosaic-tests
    else echo "next_calls: $P does not apply here" >&2; exit 1; fi ;;
  6) # the Mosaic kernels on the masks suite (head dim 128, 8k), each mask's overhead;
    # then (H) probs_before_dp beside the default pair and cuDNN.
    OURS_IMPLS=$M,jax.nn:cudnn BENCH_BUDGET=200 bash $G "$C" masks-ours:none,segments:4,padding
    FA_PASSES=bwd FA_SEQS=2048,8192 MOSAIC_FA_IMPLS=$M,$M/probs_before_dp=true,jax.nn:cudnn \
      timeout 290 bash $G "$C" mosaic-fa:64:false mosaic-fa:64:true mosaic-fa:128:true
    keep fa-mosaic-bwd-probs-before-dp ;;
  7) # one bounded Nsight Compute profile of the default backward, head dim 128
    # non-causal 8k (the whole share since the 43rd session).
    PROFILE_KERNELS=pallas_flash_mosaic_bwd PROFILE_IMPLS=$M PROFILE_DETAILS=1 \
      PROFILE_SECTIONS=MemoryWorkloadAnalysis_Tables,WarpStateStats timeout 200 \
      bash $G "$C" profile-fa:128:8192:false ;;
  *) echo "next_calls: no call $call (1 to 7)" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# One device call: peer wheels, then the steps named as arguments, logs and JSONL under $OUT.
#   bash benchmarks/gpu_run.sh COMMIT tests memory-ours memory-peers fa:<budget_s> ...
# Carry .peers (the peer wheels) and, for gpt-parity, data/shakespeare.
set -u
commit=$1; shift
# Once per machine: a step run on the second GPU (gpu1:STEP) calls this script again.
# (GPU_RUN_SITE: where the peer wheels go; tests/test_gpu_run.py points it elsewhere.)
site=${GPU_RUN_SITE:-/tmp/site}
if [ ! -e "$site/.installed" ]; then
  # tokamax imports xprof (its profiler) from .peers/stub: a plain `cp` of the wheels
  # leaves it out, and every tokamax row then fails (as at 41958b0's first timing).
  [ -d .peers/stub ] || echo "gpu_run: no .peers/stub (cp -r ../shared/peer-wheels/. .peers/): tokamax rows will fail" >&2
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .peers/*.whl \
    && mkdir -p "$site" && touch "$site/.installed" || exit 1
fi
export PYTHONPATH=$site:$PWD/.peers/stub:$PWD PYTHONUNBUFFERED=1
run_id="$(date +%Y%m%d-%H%M%S)-$commit"
# lra_train NAME MINUTES STEPS TASK [FLAGS...]: the task's LRA preset for MINUTES at most
# (STEPS, or the preset's when empty), tested at the end; log and metrics to $OUT/NAME.*.
lra_train() {
  local name=$1 minutes=$2 steps=$3 task=$4; shift 4
  timeout $((minutes * 60 + 120)) python3 -m models.train --task "$task" --preset lra \
    --max-minutes "$minutes" ${steps:+--steps "$steps"} "$@" --out "runs/$name" \
    2>&1 | tr '\r' '\n' | grep -v '^\[' > "$OUT/$name.log"
  tail -4 "$OUT/$name.log"; cp "runs/$name/metrics.jsonl" "$OUT/$name.jsonl"
}
# lra_flags TASK REST: REST's FLAG=VALUE pairs (comma-separated) as the trainer's flags in
# the array `flags`, and the run's name TASK-FLAGVALUE... in `name` (clip=1,lr=5e-4:
# --clip 1 --lr 5e-4, TASK-clip1-lr5e-4).
lra_flags() {
  flags=(); name=$1
  for kv in ${2//,/ }; do
    flags+=("--${kv%%=*}" "${kv#*=}"); name+="-${kv%%=*}${kv#*=}"
  done
}
# fa_shape SPEC: HEAD_DIMS:SEQS[:CAUSAL] (a profile step's shape) into hd, seqs and causal
# (empty where SPEC names none).
fa_shape() {
  hd=${1%%:*}; local rest=${1#*:}; seqs=${rest%%:*}
  causal=; [ "$rest" != "$seqs" ] && causal=${rest#*:}
  return 0
}

# prepare_once TASK LOG: the task's data, unless this machine has it already (a warm
# machine keeps data/ between calls; two background steps must not write it at once, so a
# `prepare:TASK` step before them makes it for both). GPU_RUN_DATA: where models.data
# writes (the repository's data/; tests/test_gpu_run.py points it elsewhere).
prepare_once() {
  [ -e "${GPU_RUN_DATA:-data}/$1/meta.json" ] || python3 -m models.data prepare "$1" > "$2" 2>&1
}
for step in "$@"; do
  # gpu1:A+B, bg:A+B: the child runs A then B
  [ "${step#gpu1:}" != "$step" ] || [ "${step#bg:}" != "$step" ] && step=${step//+/ }
  echo "== $step $(date +%T)"
  case $step in
    # gpu1:STEP[+STEP...] (two-GPU machines): the steps, in turn, on the second GPU in the
    # background (output in $OUT/gpu1.txt), while the steps after it run on the first;
    # `wait` (or the end) joins them. Not beside a timing that a compile-heavy step could
    # skew: compiles load the CPU, which slows the other GPU's dispatch (a timed baseline
    # run beside the Mosaic suite read 11 % slow).
    gpu1:*) GPU_RUN_CHILD=1 CUDA_VISIBLE_DEVICES=1 bash "$0" "$commit" ${step#gpu1:} >> "$OUT/gpu1.txt" 2>&1 &
            export CUDA_VISIBLE_DEVICES=0 ;;
    # bg:STEP[+STEP...]: the same on this GPU, beside the steps after it (output in
    # $OUT/bg.txt); for one-GPU machines, where a correctness suite and training (which
    # leaves the GPU mostly idle) can share it. Never beside a timing.
    bg:*) GPU_RUN_CHILD=1 bash "$0" "$commit" ${step#bg:} >> "$OUT/bg.txt" 2>&1 & ;;
    wait) wait; unset CUDA_VISIBLE_DEVICES; tail -4 "$OUT"/gpu1.txt "$OUT"/bg.txt 2>/dev/null ;;
    # Tests compile many small shapes: XLA's GEMM autotuner would dominate, so it is off
    # for them (it changes speed, not results), and 8 processes share the GPU. About 140 s
    # alone; beside gpu1:mosaic-tests it did not finish in 330 s (TESTS_TIMEOUT).
    tests) XLA_FLAGS=--xla_gpu_autotune_level=0 XLA_PYTHON_CLIENT_PREALLOCATE=false \
             timeout "${TESTS_TIMEOUT:-330}" python3 -m pytest -m "gpu and not mosaic" -q -p no:cacheprovider \
             -p no:benchmark -rA -n 8 > "$OUT/gpu-tests.log" 2>&1; echo "pytest rc=$?"
           tail -3 "$OUT/gpu-tests.log" ;;
    # The Mosaic kernels apart, under their own timeout: a barrier bug hangs, not fails.
    mosaic-smoke) timeout 240 python3 -m pytest -m gpu tests/test_mosaic.py \
             tests/test_mosaic_backward.py -x -q -p no:cacheprovider -p no:benchmark \
             -k "b2_t1024_s1024_n8k8_h64 and (regs or p-regs)" \
             > "$OUT/mosaic-smoke.log" 2>&1; echo "pytest rc=$?"; tail -3 "$OUT/mosaic-smoke.log" ;;
    # -v: each result is logged as it lands, so a timeout still leaves what had passed.
    # MOSAIC_TESTS_K: only the tests whose ids match (pytest -k), e.g. those a timeout cut.
    # MOSAIC_TESTS_WORKERS (8): the tests are compile-bound (96 tests took 530 s over 8
    # at 41958b0, about 44 s a test per worker) on a 16-core host: more workers may
    # finish sooner; --durations (when it finishes) says where the time goes.
    mosaic-tests) XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${MOSAIC_TESTS_TIMEOUT:-500}" \
             python3 -m pytest -m gpu tests/test_mosaic.py tests/test_mosaic_backward.py \
             tests/test_mosaic_fused.py -v \
             -p no:cacheprovider -p no:benchmark -rA -n "${MOSAIC_TESTS_WORKERS:-8}" \
             --durations=15 ${MOSAIC_TESTS_K:+-k "$MOSAIC_TESTS_K"} \
             > "$OUT/mosaic-tests.log" 2>&1; echo "pytest rc=$?"; tail -3 "$OUT/mosaic-tests.log" ;;
    memory-ours) timeout 200 python3 -m benchmarks.bench --suite memory --commit "$commit" \
             --run-id "$run_id" --impls pallas_flash:triton --out "$OUT/memory.jsonl" ;;
    # MEMORY_IMPLS: some of the peers only (a comma-separated list)
    memory-peers) timeout 300 python3 -m benchmarks.bench --suite memory --commit "$commit" \
             --run-id "$run_id" --isolate --max-run-seq 262144 --out "$OUT/memory.jsonl" \
             --impls "${MEMORY_IMPLS:-pallas_flash:xla_blockwise,jax.nn:xla,jax.nn:cudnn,tokamax:mosaic,tokamax:triton}" ;;
    # tests-K: the compiled tests whose ids match K (pytest -k), e.g. after a kernel change.
    tests-*) XLA_FLAGS=--xla_gpu_autotune_level=0 XLA_PYTHON_CLIENT_PREALLOCATE=false \
             timeout 300 python3 -m pytest -m "gpu and not mosaic" -q -p no:cacheprovider \
             -p no:benchmark -rA -n 8 -k "${step#tests-}" > "$OUT/gpu-$step.log" 2>&1
           echo "pytest rc=$?"; tail -2 "$OUT/gpu-$step.log" ;;
    # Ours alone, where the peers add nothing to what is measured (issue 4's overheads);
    # masks-ours:LABELS / paper-ours:LABELS keep those mask labels only (env BENCH_BUDGET:
    # seconds before no new shape starts, default 240; OURS_IMPLS: the implementations,
    # default our Triton path, e.g. pallas_flash:mosaic,jax.nn:cudnn).
    masks-ours*|paper-ours*) suite=${step%%-ours*}; labels=${step#*-ours}; labels=${labels#:}
             budget=${BENCH_BUDGET:-240}; timeout $((budget + 60)) python3 -m benchmarks.bench \
             --suite "$suite" --commit "$commit" --run-id "$run_id" \
             --impls "${OURS_IMPLS:-pallas_flash:triton}" \
             ${labels:+--masks "$labels"} --time-budget "$budget" --out "$OUT/$suite.jsonl" ;;
    # mosaic-fa:HEAD_DIMS[:CAUSAL]: the Hopper kernels against the fastest peers, fa grid
    # (BENCH_PREROLL_S: seconds of untimed calls before each timed round, bench.Timed).
    mosaic-fa:*) hd=${step#mosaic-fa:}; causal=${hd#*:}; [ "$causal" = "$hd" ] && causal=
             timeout 300 python3 -m benchmarks.bench --suite fa --commit "$commit" \
             --run-id "$run_id" --head-dims "${hd%%:*}" ${causal:+--causal "$causal"} \
             ${FA_SEQS:+--seqs "$FA_SEQS"} ${BENCH_PREROLL_S:+--preroll-s "$BENCH_PREROLL_S"} \
             ${FA_HEADS:+--heads "$FA_HEADS"} ${FA_BATCHES:+--batches "$FA_BATCHES"} \
             ${FA_PASSES:+--passes "$FA_PASSES"} --time-budget "${MOSAIC_FA_BUDGET:-240}" \
             --impls "${MOSAIC_FA_IMPLS:-pallas_flash:mosaic,jax.nn:cudnn,tokamax:mosaic,jax:mosaic_fa3,pallas_flash:triton}" \
             --out "$OUT/fa-mosaic.jsonl" ;;
    # fa-grid:HEAD_DIMS:CAUSAL:BUDGET: a slice of the fa grid with ours and every peer (issue
    # 3's point 1, split over calls and GPUs, since the whole grid outlasts a call);
    # CAUSAL false, true or both; no new shape starts after BUDGET seconds; FA_SEQS (here
    # and in mosaic-fa): only these query lengths, e.g. 16384 (a point a budget cut). Its own file
    # (fa-64-both.jsonl), so two GPUs' slices never share one. The timeout leaves the last
    # shape started FA_SHAPE_SECONDS (default 300) to finish: one shape with every peer
    # (compiles, checks, timings) outlasts 90 s at head dim 256, and at e610df9 a timeout of
    # budget + 90 killed JAX's Mosaic FA3, the last peer, with nothing said (rc now is).
    fa-grid:*) spec=${step#fa-grid:}; hd=${spec%%:*}; spec=${spec#*:}; causal=${spec%%:*}
             budget=${spec#*:}; out="$OUT/fa-${hd//,/-}-$causal.jsonl"
             slice_id="$run_id-fa-${hd//,/-}-$causal"  # one run id per process
             [ "$causal" = both ] && causal=
             timeout $((budget + ${FA_SHAPE_SECONDS:-300})) python3 -m benchmarks.bench \
               --suite fa --commit "$commit" \
               --run-id "$slice_id" --head-dims "$hd" ${causal:+--causal "$causal"} \
               ${FA_SEQS:+--seqs "$FA_SEQS"} \
               --time-budget "$budget" --out "$out" 2>&1 | tail -2
             echo "fa-grid rc=${PIPESTATUS[0]}" ;;
    # prepare:TASK: a dataset made once, before steps on both GPUs read it.
    prepare:*) python3 -m models.data prepare "${step#prepare:}" ;;
    # Issue 4: which in-kernel layout of a boolean mask costs least (benchmarks/mask_layouts.py).
    mask-layouts) timeout 400 python3 -m benchmarks.mask_layouts --commit "$commit" \
             --run-id "$run_id" --out "$OUT/mask-layouts.jsonl" ;;
    masks|sparse|paper|quick) timeout 590 python3 -m benchmarks.bench --suite "$step" \
             --commit "$commit" --run-id "$run_id" --out "$OUT/$step.jsonl" ;;
    hbm) timeout 590 python3 -m benchmarks.hbm --out "$OUT/hbm.jsonl" ;;
    # Registers and spills of each Mosaic kernel from ptxas's own report (compiles only
    # one small fwd + bwd per implementation, head dim and causal flag): PTXAS_IMPLS,
    # PTXAS_HEAD_DIMS, PTXAS_CAUSAL pick them; PTXAS_SASS=1 also brings back each one's
    # SASS (one file each under $OUT/sass: mind the 8 files a call returns), counts
    # each kernel's spills by register budget (which warpgroup's code they sit in) and
    # lists its loops' instruction mix (ptxas.sass_loops); PTXAS_PTX=1 brings back each one's
    # PTX (under $OUT/ptx, the same limit), which `python -m benchmarks.ptxas --assemble
    # FILE` reassembles on the CPU machine.
    ptxas) timeout 500 python3 -m benchmarks.ptxas \
             --impls "${PTXAS_IMPLS:-pallas_flash:mosaic,pallas_flash:mosaic-fused}" \
             --head-dims "${PTXAS_HEAD_DIMS:-64,128}" --causal "${PTXAS_CAUSAL:-false,true}" \
             ${PTXAS_SASS:+--sass "$OUT/sass"} ${PTXAS_PTX:+--ptx "$OUT/ptx"} --out "$OUT/ptxas.jsonl" ;;
    # Per-kernel time and registers where a mask costs time (segment ids, a boolean mask).
    profile-masks) timeout 590 python3 -m benchmarks.profile --suite masks \
             --masks none,segments:1,padding-full,mask-full --out "$OUT/profile-masks.jsonl" ;;
    # profile-fa:HEAD_DIMS:SEQS[:CAUSAL]: per-kernel times on the fa grid (PROFILE_IMPLS, by
    # default ours and cuDNN): which of the backward's kernels holds its time. PROFILE_PASS=fwd
    # profiles the forward alone; PROFILE_SECTIONS (ncu sections, comma-separated) keeps
    # their metrics too, e.g. SpeedOfLight,ComputeWorkloadAnalysis,WarpStateStats;
    # PROFILE_KERNELS (a regular expression) profiles only the kernels it matches;
    # PROFILE_DETAILS=1 keeps the sections' bodies too (stall reasons, pipe utilisation).
    profile-fa:*) fa_shape "${step#profile-fa:}"
             timeout 400 python3 -m benchmarks.profile --suite fa --head-dims "$hd" --seqs "$seqs" \
               ${causal:+--causal "$causal"} --impls "${PROFILE_IMPLS:-pallas_flash:mosaic,jax.nn:cudnn}" \
               --pass "${PROFILE_PASS:-fwd+bwd}" --sections "${PROFILE_SECTIONS:-}" \
               ${PROFILE_KERNELS:+--kernels "$PROFILE_KERNELS"} ${PROFILE_DETAILS:+--details} \
               --out "$OUT/profile-fa.jsonl" ;;
    # stalls-fa:HEAD_DIM:SEQ[:CAUSAL]: where one kernel's warps wait, per SASS instruction
    # (benchmarks.stall_sites: Nsight Compute's warp samples joined to the SASS, summed over
    # the kernel's steps) at that fa-grid shape, for STALLS_IMPL (default ours), STALLS_PASS
    # (fwd+bwd, or fwd) and STALLS_KERNELS (a regular expression; default the Mosaic
    # backward's kernels, pallas_flash_mosaic_fwd the forward's); STALLS_NAME names the
    # files: the exported source page (NAME-sass.csv.gz) and its summary (NAME-summary.json).
    stalls-fa:*) fa_shape "${step#stalls-fa:}"
             timeout 200 python3 -m benchmarks.stall_sites --head-dim "$hd" --seq "$seqs" \
               --causal "${causal:-false}" --impl "${STALLS_IMPL:-pallas_flash:mosaic}" \
               --pass "${STALLS_PASS:-fwd+bwd}" --kernels "${STALLS_KERNELS:-pallas_flash_mosaic_bwd}" \
               ${STALLS_NAME:+--name "$STALLS_NAME"} --out-dir "$OUT" ;;
    fa:*) timeout 590 python3 -m benchmarks.bench --suite fa --commit "$commit" \
             --run-id "$run_id" --time-budget "${step#fa:}" --out "$OUT/fa.jsonl" ;;
    # Launch configs of the Triton kernels (sweep) or the Mosaic GPU kernels
    # (sweep-mosaic), nearest the defaults first: configs.py's and mosaic/config.py's
    # evidence. sweep[-mosaic][:HEAD_DIMS[:PASSES[:SECONDS]]] narrows it, e.g. to split it
    # over two GPUs (gpu1:sweep-mosaic:64:fwd sweep-mosaic:128:fwd); SECONDS is the budget
    # (default 540). Candidates run in the sweep's one process, which checks its budget
    # before each; a Mosaic barrier bug hangs rather than fails, and this timeout is what
    # ends it (rows so far are written).
    sweep|sweep:*|sweep-mosaic|sweep-mosaic:*)
             family=triton; [ "${step%%:*}" = sweep-mosaic ] && family=mosaic
             spec=; [ "$step" != "${step%%:*}" ] && spec=${step#*:}
             hd=${spec%%:*}; spec=${spec#"$hd"}; spec=${spec#:}
             passes=${spec%%:*}; budget=${spec#"$passes"}; budget=${budget#:}
             budget=${budget:-540}; name=${step//[:,]/-}
             timeout $((budget + 50)) python3 -m benchmarks.sweep --family "$family" \
               --commit "$commit" --run-id "$run_id-$name" --time-budget "$budget" \
               ${hd:+--head-dims "$hd"} ${passes:+--passes "$passes"} --out "$OUT/$name.jsonl" ;;
    # Issue 6 on the H200. lra:TASK:MINUTES (listops, pathfinder32, ...): the task's data
    # is generated there (no network needed), then the LRA preset trains for MINUTES at
    # most (its step budget is the preset's, or LRA_STEPS) and is tested at the end.
    # lra:TASK:MINUTES[:auto][:FLAG=VALUE,...]. With :auto (for a recipe longer than the
    # call), the steps are those MINUTES hold at the steady rate of a 60-step probe of the
    # same run without evaluation (models.report --fit-steps), so the schedule decays to
    # its end rather than being cut. (At a924bb3 the fit came from lra-compare's probe,
    # without attention dropout: 35.6k examples/s against the run's 25.9k, so
    # Pathfinder-32 stopped at 83 % of its steps.)
    # FLAG=VALUE pairs are the trainer's flags (clip=1 is --clip 1) and name the run
    # (listops-clip1); preset=xiong picks another preset (the last --preset wins).
    # MINUTES: whole minutes (bash arithmetic).
    lra:*) spec=${step#lra:}; task=${spec%%:*}; spec=${spec#*:}; minutes=${spec%%:*}
             rest=; [ "$spec" != "$minutes" ] && rest=${spec#*:}
             auto=; [ "${rest%%:*}" = auto ] && { auto=1; rest=${rest#auto}; rest=${rest#:}; }
             lra_flags "$task" "$rest"
             steps=${LRA_STEPS:-}
             prepare_once "$task" "$OUT/$name-prepare.log"
             if [ -n "$auto" ]; then
               timeout 200 python3 -m models.train --task "$task" --preset lra --steps 60 \
                 --eval-every 0 "${flags[@]}" --out "runs/$name-probe" > /dev/null 2>&1
               steps=$(python3 -m models.report --fit-steps "$minutes" "runs/$name-probe")
               echo "lra $task: $steps steps fit $minutes minutes" | tee "$OUT/$name-steps.log"
             fi
             lra_train "$name" "$minutes" "$steps" "$task" "${flags[@]}" ;;
    # lra-seeds:TASK:MINUTES:N[:FLAG=VALUE,...]: N runs of the LRA preset at once on this
    # GPU, seeds 0..N-1 (initialisation, dropout and batch order), each with LRA_MEM/N of
    # its memory (LRA_MEM 0.9 by default): the spread between seeds for the price of one call (ListOps' batch-32 steps
    # leave an H200 mostly idle). Runs are named TASK[-FLAGVALUE...]-seedS.
    lra-seeds:*) spec=${step#lra-seeds:}; task=${spec%%:*}; spec=${spec#*:}
             minutes=${spec%%:*}; spec=${spec#*:}; n=${spec%%:*}
             rest=; [ "$spec" != "$n" ] && rest=${spec#*:}
             lra_flags "$task" "$rest"
             prepare_once "$task" "$OUT/$name-prepare.log"
             # LRA_MEM: the GPU memory fraction the N runs share (less beside other steps)
             fraction=$(awk "BEGIN { print ${LRA_MEM:-0.9} / $n }"); pids=()
             for s in $(seq 0 $((n - 1))); do
               XLA_PYTHON_CLIENT_MEM_FRACTION=$fraction lra_train "$name-seed$s" "$minutes" \
                 "${LRA_STEPS:-}" "$task" --seed "$s" "${flags[@]}" &
               pids+=($!)
             done
             wait "${pids[@]}" ;;  # these runs only, not a gpu1 child
    # lra-compare:TASK:STEPS[:RUNS]: the task's LRA preset for STEPS steps with each
    # attention (same seed, same batches), no evaluation, no attention dropout (jax.nn has
    # none), and ours once more with the lookup embedding (flash-gather: --embedding
    # gather, the default before one_hot): the steady examples/s of each (python -m
    # models.report). RUNS (comma-separated, default flash,xla,cudnn,flash-gather) picks
    # some; with all of them the `lra` bench suite (the presets' attention calls alone)
    # runs first.
    lra-compare:*) spec=${step#lra-compare:}; task=${spec%%:*}; spec=${spec#*:}
             steps=${spec%%:*}; runs=${spec#*:}; [ "$runs" = "$spec" ] && runs=
             python3 -m models.data prepare "$task" > "$OUT/$task-prepare.log" 2>&1
             [ -z "$runs" ] && timeout 200 python3 -m benchmarks.bench --suite lra \
               --commit "$commit" --run-id "$run_id" --out "$OUT/lra-bench.jsonl" 2>&1 | tail -3
             files=()
             for run in $(echo "${runs:-flash,xla,cudnn,flash-gather}" | tr , ' '); do
               att=${run%-gather}; extra=; [ "$run" != "$att" ] && extra="--embedding gather"
               timeout 200 python3 -m models.train --task "$task" --preset lra --steps "$steps" \
                 --eval-every 0 --attention-dropout 0 --attention "$att" $extra \
                 --out "runs/$task-$run" 2>&1 | tr '\r' '\n' | grep -v '^\[' | tail -2
               cp "runs/$task-$run/metrics.jsonl" "$OUT/$task-$run.jsonl"
               files+=("$OUT/$task-$run.jsonl")
             done
             python3 -m models.report "${files[@]}" ;;
    # gpt-parity:CTX: the small GPT (6 layers) from one seed with each attention, same
    # batches; needs data/shakespeare carried (the machine has no network).
    gpt-parity:*) ctx=${step#gpt-parity:}
             for att in flash xla cudnn; do
               timeout 170 python3 -m models.train --preset small --seq-len "$ctx" --batch \
                 $((16384 / ctx)) --steps 300 --attention "$att" --sample 0 \
                 --out "runs/parity-$ctx-$att" 2>&1 | tr '\r' '\n' | grep -v '^\[' \
                 > "$OUT/parity-$ctx-$att.log"; tail -2 "$OUT/parity-$ctx-$att.log"
               cp "runs/parity-$ctx-$att/metrics.jsonl" "$OUT/parity-$ctx-$att.jsonl"
             done ;;
    # Two GPUs (nvidia-h200-x2): ring attention against one GPU.
    ring) timeout 400 python3 -m benchmarks.ring --out "$OUT/ring.jsonl" ;;
    # Two GPUs: the sharded trainer against one GPU (same seed, same global batch).
    train-parallel) for mode in "one:" "seq2:--seq-parallel 2" "data2:--data-parallel 2"; do
               name=${mode%%:*}
               timeout 180 python3 -m models.train --preset small --steps 300 --batch 16 \
                 --sample 0 ${mode#*:} --out "runs/par-$name" 2>&1 | tr '\r' '\n' \
                 | grep -v '^\[' > "$OUT/par-$name.log"; tail -2 "$OUT/par-$name.log"
               cp "runs/par-$name/metrics.jsonl" "$OUT/par-$name.jsonl"
             done ;;
    # Issue 7: a GPT training step too long for one GPU, trained on two. XLA's own
    # rematerialisation squeezes one GPU's step below the device when it can (the small
    # preset fit at T = 1.3M in 124.8 GB, gpt2-small at 512k in 134.6), so the length is
    # found by asking the compiler, not by arithmetic.
    # long-one:T[:PRESET] (preset small by default): one GPU's compiled step memory at T
    # (--memory-report: compile only, nothing runs), $OUT/long-T-PRESET-one-memory.json.
    long-one:*) spec=${step#long-one:}; T=${spec%%:*}; preset=small
             [ "$spec" != "$T" ] && preset=${spec#*:}
             XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 200 python3 -m models.train --preset \
               "$preset" --seq-len "$T" --batch 1 --eval-every 0 --sample 0 --memory-report \
               --out "runs/long-$T-$preset-one" 2>&1 | grep -E "train step|rror" | tail -2
             cp "runs/long-$T-$preset-one/memory.json" "$OUT/long-$T-$preset-one-memory.json" ;;
    # train-long:T1/T2/...[:PRESET]: the sequence-parallel trainer over both GPUs at the
    # first T whose long-one report (run before) says one GPU does not fit; LONG_STEPS
    # steps (default 2), no evaluation (the validation split, 0.5 M bytes, is shorter).
    # The metrics' final row has each GPU's measured peak memory.
    train-long:*) spec=${step#train-long:}; Ts=${spec%%:*}; preset=small
             [ "$spec" != "$Ts" ] && preset=${spec#*:}
             chosen=
             for T in ${Ts//\// }; do
               if grep -qs '"fits": false' "$OUT/long-$T-$preset-one-memory.json"; then
                 chosen=$T; break
               fi
               echo "T=$T: one GPU fits (or no long-one report): skipped"
             done
             [ -z "$chosen" ] && continue
             T=$chosen; run="runs/long-$T-$preset-seq2"
             XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 500 python3 -m models.train \
               --preset "$preset" --seq-len "$T" --batch 1 --eval-every 0 --sample 0 \
               --steps "${LONG_STEPS:-2}" --seq-parallel 2 --out "$run" 2>&1 \
               | tr '\r' '\n' | grep -v '^\[' > "$OUT/long-$T-$preset-seq2.log"
             echo "seq2 rc=${PIPESTATUS[0]}"; tail -3 "$OUT/long-$T-$preset-seq2.log"
             cp "$run/metrics.jsonl" "$OUT/long-$T-$preset-seq2.jsonl" ;;
    *) echo "unknown step $step" ;;
  esac
done
wait
echo "== done $(date +%T)"
# At most 8 files come back from $OUT: more are bundled into one archive (the top-level
# call only: a gpu1 step's call shares $OUT). Unpack with tar xzf gpu_run-bundle.tgz. A
# name of its own, so that a command after this script that archives $OUT itself (as
# results.tgz, say) cannot overwrite it (one did at e610df9: six ListOps runs' logs lost).
if [ -z "${GPU_RUN_CHILD:-}" ] && [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  bundle=$(mktemp -d)/gpu_run-bundle.tgz
  tar czf "$bundle" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "$bundle" "$OUT/"
  echo "bundled into \$OUT/gpu_run-bundle.tgz"
fi

#!/usr/bin/env bash
# The one project command for a GPU machine (the H200 lent through the device tool):
#   bash scripts/gpu_check.sh MODE...   -> $OUT (<= 8 files)
#   MODE: smoke | tests | tests-a | tests-b | fuzz | sanitize | profile | bench [SUITE] | tune |
#         example | nccl | full
# Several modes run in order in one call (a device call costs a machine start): e.g.
#   bash scripts/gpu_check.sh tests fuzz
# Runs from the source tree (PYTHONPATH), installs nothing.
# Test results are written as they happen to $OUT/<log>.live (op_tests/conftest.py); a second call
# with AMDQB_RESUME_FROM=<that file, committed in the tree> runs only what did not pass.
# Budget notes (2026-11-29, nvidia-h200-x2, 24 workers over 2 GPUs): the suite without the CPU
# emulator needs ~330 s + ~200 s (two calls with the resume file); test_route_rows' hip E=2048/4096
# route tests are the long poles. Serially it takes far longer (Triton/NVRTC compilation for many
# shapes), hence pytest-xdist (present in the device image) with JOBS workers. `bench serving`
# needs ~60 s after the weights are drawn. Measured 2026-11-29 on nvidia-h200-x2 (plus ~60 s of
# machine start per call): fuzz (large) ~250 s; sanitize ~60 s per tool; smoke over the router tests
# ~90 s; smoke over router + route + align + QB tests of three files ~50 s since OMP_NUM_THREADS is
# set below (the route-rows smoke took ~310 s before); tune ~25 s; bench router ~20 s, route
# ~20 s, balance ~10 s, chunks ~5 s; example (both configs) ~50 s; profile ~100 s. A single-GPU
# nvidia-h200 call starts in ~30-60 s; a 10-s command costs about a minute of device time.
# Session 5 (nvidia-h200): `tune` with TUNE_PARTS=align,decode ~20-35 s; `bench` (all) ~130 s;
# `fuzz` with FUZZ_K ("route" also matches "router") 170 s were not enough for four op families;
# `sanitize` over 30 small tests ~25 s per tool. Keep `--report-api-errors no` for the sanitizer:
# cuda-bindings probes driver entry points with cuGetProcAddress, which the sanitizer otherwise
# counts as 34 API errors.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
OUT=${OUT:-/tmp/amdqb_out}
mkdir -p "$OUT"
# A resume log applies to the suite modes only (tests, tests-a, tests-b), not to fuzz / sanitize.
RESUME_FROM=${AMDQB_RESUME_FROM:-}
unset AMDQB_RESUME_FROM
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
JOBS=${JOBS:-$(( $(nproc) * 3 / 4 ))}
export AMDQB_SPREAD_GPUS=$NGPU  # xdist workers take the GPUs in turn (op_tests/conftest.py)
# The tests' CPU side (oracles, checks) runs in JOBS processes at once: one intra-op thread each
# instead of one per core in every worker (oversubscribed, the large route cases took minutes).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
status=0
XDIST=()
python -c "import xdist" 2>/dev/null && XDIST=(--numprocesses "$JOBS")

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
  python -m amdqb info; } > "$OUT/info.txt" 2>&1

# Fixed halves of the suite (tests-a / tests-b), an alternative to resuming from a live log.
PART_A="op_tests/test_router.py op_tests/test_router_qb.py op_tests/test_biased_topk.py
  op_tests/test_api.py op_tests/test_qb.py op_tests/test_training_loop.py op_tests/test_serving.py
  op_tests/test_hip_runtime.py"
PART_B="op_tests/test_route_rows.py op_tests/test_align.py op_tests/test_chunks.py
  op_tests/test_fuzz.py op_tests/test_large_shapes.py op_tests/test_demo.py
  op_tests/test_hip_compile.py op_tests/test_hip_emulator.py op_tests/test_amd_codegen.py"

run_tests() {  # the suite (or FILES) on the GPU, every available backend -> $OUT/LOG
  local sel=${1:-} log=${LOG:-tests.log} logdir=${LOGDIR:-$OUT}
  # every result as it happens (a run cut off by its time limit still reports what finished)
  export AMDQB_TEST_LOG="$OUT/${log%.log}.live"
  # the tests marked `emulator` run the HIP kernels on the CPU model of op_tests/hip_emu (CI runs
  # them); on a GPU the kernels themselves run, so the emulator's minutes of CPU are not spent here
  timeout "${TEST_TIMEOUT:-420}" python -m pytest ${FILES:-op_tests} -m "not emulator" \
    -p no:cacheprovider \
    $([ "${JOBS}" != 0 ] && printf "%s " "${XDIST[@]}") --maxfail=40 -rfEs --durations=15 ${sel:+-k "$sel"} 2>&1 | tail -n 600 \
    > "$logdir/$log"
  local rc=${PIPESTATUS[0]}
  tail -n 3 "$logdir/$log"
  return "$rc"
}

run_fuzz() {  # the large differential-fuzzing profile (>= 10,000 cases) -> $OUT/fuzz.log
  # FUZZ_K: a pytest -k selection (e.g. "align or route") to re-run part of it
  AMDQB_FUZZ_PROFILE=large FILES=op_tests/test_fuzz.py LOG=fuzz.log LOGDIR=/tmp \
    TEST_TIMEOUT=${FUZZ_TIMEOUT:-300} run_tests "${FUZZ_K:-}"
}

run_profile() {  # ncu over the hot kernels at the SPEC §5 shapes (AMDQB_PROFILE_K) -> $OUT/ncu.txt
  # NCU_CACHE=none keeps the caches warm between kernels (closer to graph replay than ncu's flush)
  timeout "${PROFILE_TIMEOUT:-240}" ncu --clock-control none --profile-from-start off \
    --cache-control "${NCU_CACHE:-all}" \
    --section SpeedOfLight --section LaunchStats --section Occupancy \
    --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
    python -m bench.profile_kernels > "$OUT/ncu.txt" 2>&1
  local rc=$?
  grep -E "^  [a-z_]+.*\(|Duration|Throughput|Achieved Occupancy|Registers Per|Stall" \
    "$OUT/ncu.txt" | head -n 80
  return "$rc"
}

run_nccl() {  # the 2-GPU NCCL pooling test (nvidia-h200-x2)
  LOG=nccl.log FILES=op_tests/test_training_loop.py JOBS=0 TEST_TIMEOUT=${NCCL_TIMEOUT:-120} \
    run_tests "nccl or gloo"
}

run_sanitize() {  # memcheck + racecheck over the kernel tests (small shapes)
  # one small case per kernel family (router, QB, biased_topk, route rows, align, chunks, recovery,
  # balancer step) of both backends; kernels run ~100x slower under the tools
  local sel=${SANITIZE_K:-"test_qb_adversarial_rows or test_biased_topk_shapes_and_ties or
    test_route_rows_empty or test_route_rows_many_blocks or test_align_vllm_example or
    test_sort_chunks_round_trip_and_grad or test_qb_recovery_vector or test_qb_step_random or
    test_route_rows_deterministic or test_qb_router_modes_agree_and_match_oracle and 896"}
  for tool in memcheck racecheck; do
    echo "== $tool" >> "$OUT/sanitizer.log"
    AMDQB_TEST_LOG=/tmp/sanitizer.live timeout "${SANITIZE_TIMEOUT:-150}" compute-sanitizer --tool "$tool" --error-exitcode 99 \
      --report-api-errors no --target-processes all python -m pytest -q -p no:cacheprovider -x \
      op_tests/test_router_qb.py op_tests/test_biased_topk.py op_tests/test_route_rows.py \
      op_tests/test_align.py op_tests/test_chunks.py op_tests/test_qb.py \
      -m "not emulator" -k "$(echo $sel)" 2>&1 \
      | grep -E "ERROR SUMMARY|passed|failed|error|Error" | tail -n 20 \
      >> "$OUT/sanitizer.log"
    echo "rc=${PIPESTATUS[0]}; tests finished under $tool:" >> "$OUT/sanitizer.log"
    cat /tmp/sanitizer.live >> "$OUT/sanitizer.log" 2>/dev/null; rm -f /tmp/sanitizer.live
  done
  cat "$OUT/sanitizer.log"
}

run_bench() {  # SUITE (default all) -> $OUT/h200.json, bench.md
  timeout "${BENCH_TIMEOUT:-300}" python -m amdqb bench "${1:-all}" --json "$OUT/h200.json" \
    >> "$OUT/bench.md" 2> /tmp/bench.err
  local rc=$?
  tail -n 5 /tmp/bench.err >> "$OUT/bench.md"
  tail -n 60 "$OUT/bench.md"
  return "$rc"
}

run_tune() {  # hip tuning sweeps (TUNE_PARTS: router,route,gate,align,decode,qbhist,stages) -> $OUT/tune.*
  timeout "${TUNE_TIMEOUT:-200}" python -m bench.tune_router_occupancy --json "$OUT/tune.json" \
    --parts "${TUNE_PARTS:-router,route,gate,align,decode,qbhist,stages}" > "$OUT/tune.md" 2>&1
  local rc=$?
  cat "$OUT/tune.md" | tail -n 60
  return "$rc"
}

run_example() {  # examples/serving_moe.py, small and Kimi configs -> $OUT/example.txt
  for cfg in small kimi; do
    echo "== examples/serving_moe.py --config $cfg" >> "$OUT/example.txt"
    timeout "${EXAMPLE_TIMEOUT:-200}" python examples/serving_moe.py --config "$cfg" \
      >> "$OUT/example.txt" 2>&1 || return 1
  done
  tail -n 40 "$OUT/example.txt"
}

[ $# -eq 0 ] && set -- full
while [ $# -gt 0 ]; do
  mode=$1; shift
  echo "== $mode ($(date +%T))"
  case "$mode" in
    smoke) run_tests "${SMOKE_K:-not slow}" || status=1 ;;
    tests) AMDQB_RESUME_FROM=$RESUME_FROM run_tests || status=1 ;;
    tests-a) AMDQB_RESUME_FROM=$RESUME_FROM FILES=$PART_A run_tests || status=1 ;;
    tests-b) AMDQB_RESUME_FROM=$RESUME_FROM FILES=$PART_B run_tests || status=1 ;;
    fuzz) run_fuzz || status=1 ;;
    sanitize) run_sanitize || status=1 ;;
    profile) run_profile || status=1 ;;
    nccl) run_nccl || status=1 ;;
    tune) run_tune || status=1 ;;
    example) run_example || status=1 ;;
    bench)  # an optional suite name follows
      suite=all
      case "${1:-}" in route|router|chunks|balance|serving) suite=$1; shift ;; esac
      run_bench "$suite" || status=1 ;;
    full)  # everything; needs more than one 10-minute call on a fresh machine
      AMDQB_RESUME_FROM=$RESUME_FROM run_tests || status=1
      run_fuzz || status=1; run_sanitize || status=1; run_bench || status=1 ;;
    *) echo "unknown mode $mode"; exit 2 ;;
  esac
done
exit $status

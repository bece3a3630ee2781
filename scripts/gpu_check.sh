#!/usr/bin/env bash
# The one project command for a GPU machine:
#   bash scripts/gpu_check.sh MODE...        results under $OUT (default /tmp/amdqb_out)
#   MODE: tests | smoke | sanitize | bench [SUITE] | tune | example | nccl | profile | full
# Several modes run in order in one invocation, e.g. `bash scripts/gpu_check.sh tests bench`.
# Runs from the source tree (PYTHONPATH), installs nothing. NVIDIA (nvidia-smi) and ROCm
# (torch.version.hip; rocm-smi / amd-smi) alike; docs/amd.md gives the order on a new AMD GPU.
#   tests     the whole suite on the GPU (every available backend; the CPU emulator's tests are
#             left to CI), spread over pytest-xdist workers and the visible GPUs;
#             FILES= / TESTS_K= select a part; AMDQB_RESUME_FROM=<log> finishes a suite from the
#             live log of an earlier run (op_tests/conftest.py).
#   smoke     the suite without the tests marked slow
#   sanitize  compute-sanitizer memcheck and racecheck over the memory-safety tests and one
#             small case per kernel family (SANITIZE_K overrides the selection); NVIDIA only
#   bench     `amdqb bench SUITE --json $OUT/<device>.json` (SUITE defaults to all), <device>
#             from the GPU's name (h200, mi300x, ...)
#   tune      amdqb/bench/tune.py sweeps (TUNE_PARTS), winners printed; TUNE_WRITE=1 writes them with
#             `measured:` provenance into amdqb/configs/<arch>.json
#   example   examples/serving_moe.py, small and Kimi configs
#   nccl      the 2-process NCCL pooling tests (two GPUs)
#   profile   the hot kernels at the seed shapes (amdqb/bench/profile_kernels.py) under ncu (NVIDIA:
#             $OUT/profile.ncu-rep, ncu.txt, ncu_source.csv and ncu_mix.txt, the executed
#             instruction mix of scripts/ncu_hotspots.py --mix; AMDQB_PROFILE_K= selects cases,
#             AMDQB_LINEINFO=1 adds source lines) or rocprofv3 (ROCm, where installed)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/amdqb_out}
mkdir -p "$OUT"
RESUME_FROM=${AMDQB_RESUME_FROM:-}
unset AMDQB_RESUME_FROM
# The platform and its GPUs: ROCm where torch is a HIP build, else NVIDIA.
if python -c "import sys, torch; sys.exit(0 if torch.version.hip else 1)" 2>/dev/null; then
  PLATFORM=rocm
  NGPU=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
else
  PLATFORM=cuda
  NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
fi
# bench/results/<device>.json: the GPU's model from its name (NVIDIA H200 -> h200, AMD Instinct
# MI300X -> mi300x), else its architecture
DEVICE=$(python - <<'PY' 2>/dev/null || echo gpu
import re, torch
props = torch.cuda.get_device_properties(0)
words = [w for w in re.split(r"[\s_]+", props.name.lower())
         if w not in ("nvidia", "amd", "instinct", "radeon", "rx", "geforce", "tesla", "")]
arch = getattr(props, "gcnArchName", "") or f"sm_{props.major}{props.minor}"
print(re.sub(r"[^a-z0-9]", "", words[0]) if words else re.sub(r"[^a-z0-9_]", "", arch.split(":")[0]))
PY
)
JOBS=${JOBS:-$(( $(nproc) * 3 / 4 ))}
export AMDQB_SPREAD_GPUS=$NGPU  # xdist workers take the GPUs in turn (op_tests/conftest.py)
# Each xdist worker runs the tests' CPU side (oracles, checks) with few intra-op threads: with one
# thread per core in every worker the large cases oversubscribe the CPU.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
status=0
XDIST=()
python -c "import xdist" 2>/dev/null && XDIST=(--numprocesses "$JOBS")

{ if [ "$PLATFORM" = rocm ]; then
    amd-smi static --asic --vram --driver 2>/dev/null ||
      rocm-smi --showproductname --showdriverversion --showmeminfo vram 2>/dev/null
  else
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
  fi
  python -m amdqb info; } > "$OUT/info.txt" 2>&1

run_tests() {  # FILES (default: the suite without the CPU emulator's tests), -k $1 -> $OUT/$LOG
  local sel=${1:-} log=${LOG:-tests.log}
  export AMDQB_TEST_LOG="$OUT/${log%.log}.live"  # every result as it happens
  timeout "${TEST_TIMEOUT:-540}" python -m pytest ${FILES:-op_tests} \
    -p no:cacheprovider $([ "${JOBS}" != 0 ] && printf "%s " "${XDIST[@]}" || printf -- "-n 0") \
    --maxfail=60 -rfEs \
    --durations=20 ${sel:+-k "$sel"} 2>&1 | tail -n 800 > "$OUT/$log"
  local rc=${PIPESTATUS[0]}
  tail -n 4 "$OUT/$log"
  return "$rc"
}

run_sanitize() {  # memcheck + racecheck -> $OUT/sanitizer.log
  if [ "$PLATFORM" = rocm ]; then
    echo "sanitize: compute-sanitizer is NVIDIA's; nothing to run on ROCm" | tee "$OUT/sanitizer.log"
    return 0
  fi
  local files=${SANITIZE_FILES:-op_tests/test_memory_safety.py}
  local sel=${SANITIZE_K:-}
  for tool in memcheck racecheck; do
    echo "== $tool" >> "$OUT/sanitizer.log"
    AMDQB_TEST_LOG=/tmp/sanitizer.live timeout "${SANITIZE_TIMEOUT:-200}" \
      compute-sanitizer --tool "$tool" --error-exitcode 99 --report-api-errors no \
      --target-processes all python -m pytest -q -n 0 -p no:cacheprovider $files ${sel:+-k "$sel"} \
      2>&1 | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed|Error" | tail -n 20 \
      >> "$OUT/sanitizer.log"
    echo "rc=${PIPESTATUS[0]} under $tool" >> "$OUT/sanitizer.log"
    echo "tests under $tool: $(grep -c '^passed' /tmp/sanitizer.live 2>/dev/null) passed," \
      "$(grep -c '^failed' /tmp/sanitizer.live 2>/dev/null) failed," \
      "$(grep -c '^skipped' /tmp/sanitizer.live 2>/dev/null) skipped" >> "$OUT/sanitizer.log"
    rm -f /tmp/sanitizer.live
  done
  cat "$OUT/sanitizer.log"
}

run_bench() {  # SUITE (default all) -> $OUT/<device>.json, $OUT/bench.md
  timeout "${BENCH_TIMEOUT:-420}" python -m amdqb bench "${1:-all}" --json "$OUT/$DEVICE.json" \
    >> "$OUT/bench.md" 2> /tmp/bench.err
  local rc=$?
  tail -n 5 /tmp/bench.err >> "$OUT/bench.md"
  tail -n 80 "$OUT/bench.md"
  return "$rc"
}

run_tune() {  # -> $OUT/tune.md, $OUT/tune.json
  timeout "${TUNE_TIMEOUT:-300}" python -m amdqb.bench.tune --json "$OUT/tune.json" \
    --parts "${TUNE_PARTS:-route,gate,align,decode,qbhist,router}" \
    $([ "${TUNE_WRITE:-0}" = 1 ] && echo --write) > "$OUT/tune.md" 2>&1
  local rc=$?
  tail -n 60 "$OUT/tune.md"
  return "$rc"
}

run_example() {  # -> $OUT/example.txt
  for cfg in small kimi; do
    echo "== examples/serving_moe.py --config $cfg" >> "$OUT/example.txt"
    timeout "${EXAMPLE_TIMEOUT:-200}" python examples/serving_moe.py --config "$cfg" \
      >> "$OUT/example.txt" 2>&1 || return 1
  done
  tail -n 40 "$OUT/example.txt"
}

run_profile() {  # -> $OUT/ncu.txt (NVIDIA), $OUT/rocprof/ (ROCm)
  if [ "$PLATFORM" = rocm ]; then
    if ! command -v rocprofv3 >/dev/null 2>&1; then
      echo "profile: rocprofv3 not installed (ncu is NVIDIA's)"
      return 0
    fi
    timeout "${PROFILE_TIMEOUT:-240}" rocprofv3 --kernel-trace --stats -d "$OUT/rocprof" \
      -o kernels -- python -m amdqb.bench.profile_kernels > "$OUT/rocprof.txt" 2>&1
    local rc=$?
    tail -n 40 "$OUT/rocprof.txt"
    return "$rc"
  fi
  timeout "${PROFILE_TIMEOUT:-240}" ncu --clock-control none --profile-from-start off \
    --cache-control "${NCU_CACHE:-all}" --section SpeedOfLight --section LaunchStats \
    --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
    --section SourceCounters -f -o "$OUT/profile" \
    python -m amdqb.bench.profile_kernels > "$OUT/ncu_run.txt" 2>&1
  local rc=$?
  # the sections as text, the per-SASS-line page as CSV, and what each kernel executed
  ncu -i "$OUT/profile.ncu-rep" --page details > "$OUT/ncu.txt" 2>&1
  ncu -i "$OUT/profile.ncu-rep" --page source --csv --print-source sass \
    > "$OUT/ncu_source.csv" 2>&1
  python scripts/ncu_hotspots.py "$OUT/ncu_source.csv" --mix --top 12 > "$OUT/ncu_mix.txt" 2>&1
  grep -E "^  [a-z_]+.*\(|Duration|Throughput|Achieved Occupancy|Registers Per" "$OUT/ncu.txt" \
    | head -n 80
  return "$rc"
}

[ $# -eq 0 ] && set -- full
while [ $# -gt 0 ]; do
  mode=$1; shift
  echo "== $mode ($(date +%T))"
  case "$mode" in
    tests) AMDQB_RESUME_FROM=$RESUME_FROM run_tests "${TESTS_K:-}" || status=1 ;;
    smoke) run_tests "not slow" || status=1 ;;
    sanitize) run_sanitize || status=1 ;;
    nccl) LOG=nccl.log FILES=${NCCL_FILES:-op_tests} JOBS=0 TEST_TIMEOUT=180 \
            run_tests "nccl or gloo" || status=1 ;;
    tune) run_tune || status=1 ;;
    example) run_example || status=1 ;;
    profile) run_profile || status=1 ;;
    bench)
      suite=all
      case "${1:-}" in route|router|chunks|balance|serving|compat) suite=$1; shift ;; esac
      run_bench "$suite" || status=1 ;;
    full) AMDQB_RESUME_FROM=$RESUME_FROM run_tests || status=1
          run_sanitize || status=1; run_bench || status=1 ;;
    *) echo "unknown mode $mode"; exit 2 ;;
  esac
done
exit $status

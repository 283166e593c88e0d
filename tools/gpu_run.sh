#!/usr/bin/env bash
# Build, test and benchmark this tree on a GPU machine that already has
# Python with torch, a CUDA toolkit (nvcc, compute-sanitizer), cmake and ninja,
# but no package index. Nothing is installed outside temporary directories.
#
# usage: tools/gpu_run.sh [options] [STAGE ...]
#
# Stages, run in this order whichever are named (default: build test bench;
# "all" names every one; "build+test" and "build,bench" work too):
#   build      nvidia-cutlass wheel unpacked into a temporary target, then
#              `make build` (vllm/_hpc_C.abi3.so in place)
#   test       pytest -m gpu on the selected test files
#   sanitizer  compute-sanitizer (memcheck, racecheck) on the runner script
#   bench      the benchmark scripts, their JSON written to $OUT
# With a vLLM bundle (make_bundle.sh), two set-up steps precede test,
# sanitizer and bench: "bundle" (its activate.sh is sourced, which puts
# vLLM 0.33.0 on PYTHONPATH) and "apply" (tools/apply_patchset.py links this
# tree, the built library included, into that vLLM, then --check).
#
# Options (each also read from the environment variable named):
#   --cutlass-wheel FILE     CUTLASS_WHEEL: the nvidia-cutlass wheel; not
#                            needed when CUTLASS_DIR names a CUTLASS tree or
#                            cutlass_library imports
#   --vllm-bundle DIR        VLLM_BUNDLE: the bundle directory
#   --tests "FILES"          GPU_TESTS: test files or directories
#                            (default: tests/kernels/hpc)
#   --pytest-args "ARGS"     PYTEST_ARGS
#   --sanitizer-script "FILES"  SANITIZER_SCRIPT: runner scripts
#                            (default: tests/kernels/hpc/sanitizer_prefill.py)
#   --sanitizer-cases "NAMES"  SANITIZER_CASES: case names passed to each
#                            script (default: none, i.e. all its cases)
#   --sanitizer-tools "LIST" SANITIZER_TOOLS (default: memcheck racecheck;
#                            synccheck and initcheck work too)
#   --bench "SCRIPTS"        BENCH_SCRIPTS
#                            (default: benchmarks/kernels/benchmark_hpc_prefill.py)
#   --bench-args "ARGS"      BENCH_ARGS, passed to every benchmark script
#   --stage-timeout SECONDS  STAGE_TIMEOUT: limit per command (default: none)
#   PYTHON                   the interpreter (default: python3)
#   OUT                      where logs, JSON and summary.txt go (default: a
#                            new temporary directory); flat names, one log
#                            per stage group: build.log, setup.log,
#                            test.log, sanitizer.log, bench.log
#   HPC_COMMIT               the commit measured, recorded in the JSON (a
#                            copied tree may have no git metadata)
#
# Every stage runs even when an earlier one failed (a stage whose inputs are
# missing is marked "skip" with the reason); the summary at the end shows each
# stage's status, exit code and time. Exit code: 0 when every stage that ran
# passed, else 1.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1

PY=${PYTHON:-python3}
CUTLASS_WHEEL=${CUTLASS_WHEEL:-}
VLLM_BUNDLE=${VLLM_BUNDLE:-}
GPU_TESTS=${GPU_TESTS:-tests/kernels/hpc}
PYTEST_ARGS=${PYTEST_ARGS:-}
SANITIZER_SCRIPT=${SANITIZER_SCRIPT:-tests/kernels/hpc/sanitizer_prefill.py}
SANITIZER_CASES=${SANITIZER_CASES:-}
SANITIZER_TOOLS=${SANITIZER_TOOLS:-memcheck racecheck}
BENCH_SCRIPTS=${BENCH_SCRIPTS:-benchmarks/kernels/benchmark_hpc_prefill.py}
BENCH_ARGS=${BENCH_ARGS:-}
STAGE_TIMEOUT=${STAGE_TIMEOUT:-0}

usage() {
  sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
}

stages=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cutlass-wheel) CUTLASS_WHEEL=$2; shift 2 ;;
    --vllm-bundle) VLLM_BUNDLE=$2; shift 2 ;;
    --tests) GPU_TESTS=$2; shift 2 ;;
    --pytest-args) PYTEST_ARGS=$2; shift 2 ;;
    --sanitizer-script) SANITIZER_SCRIPT=$2; shift 2 ;;
    --sanitizer-cases) SANITIZER_CASES=$2; shift 2 ;;
    --sanitizer-tools) SANITIZER_TOOLS=$2; shift 2 ;;
    --bench) BENCH_SCRIPTS=$2; shift 2 ;;
    --bench-args) BENCH_ARGS=$2; shift 2 ;;
    --stage-timeout) STAGE_TIMEOUT=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "gpu_run: unknown option $1 (see --help)"; exit 2 ;;
    *) stages="$stages ${1//[+,]/ }"; shift ;;
  esac
done
[ -n "${stages// /}" ] || stages="build test bench"
want_build=0 want_test=0 want_sanitizer=0 want_bench=0
for s in $stages; do
  case "$s" in
    all) want_build=1 want_test=1 want_sanitizer=1 want_bench=1 ;;
    build) want_build=1 ;;
    test) want_test=1 ;;
    sanitizer) want_sanitizer=1 ;;
    bench) want_bench=1 ;;
    *) echo "gpu_run: unknown stage $s (build, test, sanitizer, bench, all)"; exit 2 ;;
  esac
done

if [ -z "${OUT:-}" ]; then
  OUT=$(mktemp -d)
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

# Stage bookkeeping: name, status, exit code, seconds, log.
names=() statuses=() codes=() times=() logs=()
record() {  # record NAME STATUS CODE SECONDS LOG [NOTE]
  names+=("$1") statuses+=("$2") codes+=("$3") times+=("$4") logs+=("$5")
  local line
  line=$(printf '[%s] %s (rc %s, %s s)%s' "$1" "$2" "$3" "$4" "${6:+: $6}")
  echo "$line"
  if [ "$2" = "FAIL" ] && [ -f "$OUT/$5" ]; then
    tail -n 5 "$OUT/$5" | sed 's/^/    /'
  fi
}

# run_stage NAME LOG CMD...: runs CMD (appending to LOG), records its status.
run_stage() {
  local name=$1 log=$2 t0 rc
  shift 2
  t0=$(date +%s)
  {
    echo "=== $name: $*"
    date
  } >> "$OUT/$log"
  if [ "$STAGE_TIMEOUT" != "0" ] && ! declare -F "$1" > /dev/null; then
    timeout "$STAGE_TIMEOUT" "$@" >> "$OUT/$log" 2>&1
  else
    "$@" >> "$OUT/$log" 2>&1
  fi
  rc=$?
  if [ $rc -eq 0 ]; then
    record "$name" ok $rc $(( $(date +%s) - t0 )) "$log"
  else
    record "$name" FAIL $rc $(( $(date +%s) - t0 )) "$log"
  fi
  return $rc
}

skip() {  # skip NAME LOG REASON
  echo "=== $1: skipped: $3" >> "$OUT/$2"
  record "$1" skip - 0 "$2" "$3"
}

# `env` with the tree's root on PYTHONPATH (an installed vLLM, a regular
# package, still wins the name `vllm` over the tree's namespace directory),
# taken after the bundle has set PYTHONPATH.
tree_env() {
  with_tree=(env "PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$@")
}

echo "gpu_run: stages:$([ $want_build = 1 ] && echo " build")$([ $want_test = 1 ] && echo " test")$([ $want_sanitizer = 1 ] && echo " sanitizer")$([ $want_bench = 1 ] && echo " bench"); output in $OUT"
{
  echo "tree: $ROOT (commit ${HPC_COMMIT:-$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)})"
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)' 2>&1
  command -v nvcc && nvcc --version | tail -n 2
  command -v cmake ninja compute-sanitizer
} > "$OUT/setup.log" 2>&1

# --- build -----------------------------------------------------------------

# The CUTLASS headers: CUTLASS_DIR if it holds them, else the wheel unpacked
# once into a temporary target that later runs on this machine reuse.
cutlass_from_wheel() {
  local target
  target="${TMPDIR:-/tmp}/hpc-cutlass-$(basename "$CUTLASS_WHEEL" .whl)"
  if [ ! -f "$target/cutlass_library/source/include/cute/tensor.hpp" ]; then
    rm -rf "$target"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$target" \
      "$CUTLASS_WHEEL" ||
      "$PY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
        "$CUTLASS_WHEEL" "$target" || return 1
  fi
  export CUTLASS_DIR="$target/cutlass_library/source"
  [ -f "$CUTLASS_DIR/include/cute/tensor.hpp" ] || {
    echo "no include/cute/tensor.hpp under $CUTLASS_DIR"
    return 1
  }
  echo "CUTLASS_DIR=$CUTLASS_DIR"
}

build() {
  if [ -n "${CUTLASS_DIR:-}" ] && [ -f "$CUTLASS_DIR/include/cute/tensor.hpp" ]; then
    echo "CUTLASS_DIR=$CUTLASS_DIR (given)"
  elif [ -n "$CUTLASS_WHEEL" ]; then
    cutlass_from_wheel || return 1
  else
    echo "no CUTLASS wheel given: the build looks for an importable cutlass_library"
  fi
  if ! command -v nvcc > /dev/null; then
    for d in "${CUDA_HOME:-}" /usr/local/cuda; do
      if [ -n "$d" ] && [ -x "$d/bin/nvcc" ]; then
        export PATH="$d/bin:$PATH"
        break
      fi
    done
  fi
  make --no-print-directory build PYTHON="$PY" || return 1
  ls -l vllm/_hpc_C*.so
}

if [ $want_build = 1 ]; then
  run_stage build build.log build
fi

# --- vLLM bundle and patch set -----------------------------------------------

need_runtime=$(( want_test + want_sanitizer + want_bench ))
if [ -n "$VLLM_BUNDLE" ] && [ $need_runtime -gt 0 ]; then
  t0=$(date +%s)
  if [ -f "$VLLM_BUNDLE/activate.sh" ]; then
    echo "=== bundle: source $VLLM_BUNDLE/activate.sh" >> "$OUT/setup.log"
    # shellcheck disable=SC1091
    source "$VLLM_BUNDLE/activate.sh" >> "$OUT/setup.log" 2>&1
    if [ -n "${VLLM_BUNDLE_DIR:-}" ] && [ -f "$VLLM_BUNDLE_DIR/vllm/__init__.py" ]; then
      record bundle ok 0 $(( $(date +%s) - t0 )) setup.log
      run_stage apply setup.log "$PY" tools/apply_patchset.py \
        --target "$VLLM_BUNDLE_DIR/vllm" &&
        run_stage apply-check setup.log "$PY" tools/apply_patchset.py \
          --target "$VLLM_BUNDLE_DIR/vllm" --check
    else
      record bundle FAIL 1 $(( $(date +%s) - t0 )) setup.log "activate.sh did not unpack vLLM"
    fi
  else
    record bundle FAIL 1 0 setup.log "no activate.sh in $VLLM_BUNDLE"
  fi
fi

# --- tests -----------------------------------------------------------------

if [ $want_test = 1 ]; then
  tree_env
  # shellcheck disable=SC2086
  run_stage test test.log "${with_tree[@]}" "$PY" -m pytest -q -m gpu -rs \
    $GPU_TESTS $PYTEST_ARGS
fi

# --- compute-sanitizer -------------------------------------------------------

if [ $want_sanitizer = 1 ]; then
  sanitizer=$(command -v compute-sanitizer || true)
  if [ -z "$sanitizer" ]; then
    for d in "${CUDA_HOME:-}" /usr/local/cuda; do
      if [ -n "$d" ] && [ -x "$d/bin/compute-sanitizer" ]; then
        sanitizer="$d/bin/compute-sanitizer"
        break
      fi
    done
  fi
  for script in $SANITIZER_SCRIPT; do
    for tool in $SANITIZER_TOOLS; do
      name="$tool:$(basename "$script" .py)"
      if [ -z "$sanitizer" ]; then
        skip "$name" sanitizer.log "compute-sanitizer not found"
      elif [ ! -f "$script" ]; then
        skip "$name" sanitizer.log "$script does not exist"
      else
        # Without the caching allocator every tensor is its own allocation,
        # so memcheck sees accesses past a tensor's end.
        if [ "$tool" = memcheck ]; then
          tree_env PYTORCH_NO_CUDA_MEMORY_CACHING=1
        else
          tree_env
        fi
        # shellcheck disable=SC2086
        run_stage "$name" sanitizer.log "${with_tree[@]}" "$sanitizer" \
          --tool "$tool" --error-exitcode 1 "$PY" "$script" $SANITIZER_CASES
      fi
    done
  done
fi

# --- benchmarks --------------------------------------------------------------

if [ $want_bench = 1 ]; then
  for script in $BENCH_SCRIPTS; do
    name="bench:$(basename "$script" .py)"
    if [ ! -f "$script" ]; then
      skip "$name" bench.log "$script does not exist"
      continue
    fi
    tree_env
    # shellcheck disable=SC2086
    run_stage "$name" bench.log "${with_tree[@]}" "$PY" "$script" --out "$OUT" \
      $BENCH_ARGS
  done
fi

# --- summary -----------------------------------------------------------------

failed=0
{
  echo
  printf '%-34s %-6s %4s %7s  %s\n' stage status rc seconds log
  for i in "${!names[@]}"; do
    printf '%-34s %-6s %4s %7s  %s\n' "${names[$i]}" "${statuses[$i]}" \
      "${codes[$i]}" "${times[$i]}" "${logs[$i]}"
  done
  echo
  echo "files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
} | tee -a "$SUMMARY"
# The lines of the test and benchmark logs worth reading first.
for log in test.log bench.log; do
  if [ -f "$OUT/$log" ]; then
    echo "--- $log (last lines)"
    grep -E 'passed|failed|error|skipped|^tp[18]-|^prefill-|^W[0-9]|^PLAN|elapsed' \
      "$OUT/$log" | tail -n 40
  fi
done | tee -a "$SUMMARY"
for i in "${!names[@]}"; do
  [ "${statuses[$i]}" = FAIL ] && failed=1
done
exit $failed

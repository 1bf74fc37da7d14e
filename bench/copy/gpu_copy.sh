#!/usr/bin/env bash
# bench/copy/gpu_copy.sh: the GPU path in one call (issue 15). On a GPU machine: build the copy
# extension (CPU + CUDA modules, sm_90) against the torch there, then
#   1. tests: the CUDA copy against the CPU oracle (every layout, fp16/bf16/fp8, 1..4,096 blocks,
#      default and side stream, kernel and batched-DMA byte for byte), the store round trip on the
#      GPU (StepRunner + KVStore with pinned DRAM and NVMe: save, demote, load back, byte-identical;
#      a side-stream load ordered before a consumer kernel by its event), the DRAM slab pinned;
#   2. bandwidth: bench/copy/gpu_bench.py (gather/scatter vs cudaMemcpyAsync of the same bytes, at
#      16/32/128-token blocks, 1/16/256 blocks per call, idle and under a bf16 matmul; the slab's
#      RSS against its capacity and its copy speed);
#   3. kvstore beside vLLM native's path (bench/copy/gpu_native.py: cuMemcpyBatchAsync per block list and
#      cudaMemcpyAsync of the same bytes, 2 MiB and 64 KiB blocks, 16/64/256 a call; the forward-pass
#      clock against torch.cuda.Event) (issue 28);
#   4. compute-sanitizer memcheck and racecheck on a subset (bench/copy/gpu_sanitize.py);
# and write report.md + JSON into the folder given (default: out/gpu_copy).
#
#   bash bench/copy/gpu_copy.sh OUT_DIR                 # from anywhere
#
# Needs: python3 with torch (CUDA build), numpy, pytest, PyYAML, xxhash, prometheus-client; nvcc;
# cmake (>= 3.18); nanobind. zstandard (or any other missing wheel) can be carried in .whl/
# (git-ignored): wheels there are installed with --no-index into a temp folder first.
#
# Knobs: PYTHON (default python3), KVCOPY_CUDA_ARCHS (default "90", H100/H200),
# KVCOPY_BUILD_DIR (default: a fresh temp dir), BENCH_ARGS (extra flags for bench/copy/gpu_bench.py,
# e.g. "--per-call 16 --block-sizes 16 --modes kernel,dma"), NATIVE_ARGS (for bench/copy/gpu_native.py), NATIVE_TIMEOUT (default 300 s),
# SKIP_TESTS=1, SKIP_NATIVE=1, SKIP_BENCH=1, SKIP_SANITIZER=1,
# SANITIZER_TOOLS (default "memcheck racecheck"), SANITIZER_TIMEOUT (default 240 s per tool).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
OUT="${1:-${OUT:-$REPO/out/gpu_copy}}"
OUT="$(mkdir -p "$OUT" && cd "$OUT" && pwd)"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
LOG="$OUT/gpu_copy.log"
: >"$LOG"
log() { echo "[gpu_copy $(date +%H:%M:%S)] $*" | tee -a "$LOG"; }
fail() { log "FAILED: $*"; exit 1; }
status=0

# --------------------------------------------------------------- 0. machine
{
  echo "## nvidia-smi"; nvidia-smi 2>&1 || true
  echo "## nvcc"; (command -v nvcc && nvcc --version) 2>&1 || ls -d /usr/local/cuda*/bin/nvcc 2>&1 || true
  echo "## cmake"; cmake --version 2>&1 | head -1 || true
  echo "## ninja"; ninja --version 2>&1 || true
  echo "## python"; "$PY" - <<'EOF' 2>&1
import sys, sysconfig, os
print(sys.version)
inc = sysconfig.get_paths()["include"]
print("Python.h:", os.path.exists(os.path.join(inc, "Python.h")), inc)
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
except Exception as e:
    print("torch import failed:", e)
for m in ("numpy", "nanobind", "scikit_build_core", "pytest"):
    try:
        mod = __import__(m); print(m, getattr(mod, "__version__", "?"))
    except Exception as e:
        print(m, "MISSING", e)
EOF
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt" >>"$LOG"
log "environment written to $OUT/env.txt"

# ------------------------------------------------------- 1. build prerequisites
if compgen -G "$REPO/.whl/*.whl" >/dev/null; then
  SITE="$(mktemp -d /tmp/kvstore-site.XXXXXX)"
  log "installing carried wheels: $(ls "$REPO"/.whl/*.whl | xargs -n1 basename | tr '\n' ' ')"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$REPO"/.whl/*.whl \
    >>"$LOG" 2>&1 || fail "could not install the wheels in .whl/"
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c "import nanobind" 2>/dev/null || fail "nanobind is not installed (carry its wheel in .whl/)"
command -v cmake >/dev/null || "$PY" -m cmake --version >/dev/null 2>&1 || fail "cmake not found"
CMAKE=cmake; command -v cmake >/dev/null || CMAKE="$PY -m cmake"
if ! command -v nvcc >/dev/null; then
  for d in /usr/local/cuda/bin /usr/local/cuda-13.0/bin /usr/local/cuda-12.9/bin; do
    [ -x "$d/nvcc" ] && export PATH="$d:$PATH" && break
  done
fi
command -v nvcc >/dev/null || fail "nvcc not found (the CUDA module needs it)"

# --------------------------------------------------------------------- 2. build
BUILD="${KVCOPY_BUILD_DIR:-$(mktemp -d /tmp/kvcopy-gpu-build.XXXXXX)}"
GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
log "configuring in $BUILD (archs ${KVCOPY_CUDA_ARCHS:-90})"
t0=$(date +%s)
$CMAKE -S "$REPO" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$(command -v "$PY")" -DKVCOPY_CUDA=ON \
  -DKVCOPY_CUDA_ARCHS="${KVCOPY_CUDA_ARCHS:-90}" >>"$LOG" 2>&1 || fail "cmake configure (see $LOG)"
$CMAKE --build "$BUILD" -j "$(nproc)" >>"$LOG" 2>&1 || fail "build (see $LOG)"
# installs kvstore/_kvcopy_cpu*.so and kvstore/_kvcopy_cuda*.so into this checkout
$CMAKE --install "$BUILD" --prefix "$REPO" >>"$LOG" 2>&1 || fail "install (see $LOG)"
log "built in $(( $(date +%s) - t0 )) s: $(ls "$REPO"/kvstore/_kvcopy_*.so | xargs -n1 basename | tr '\n' ' ')"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
# installed, bench/ and connectors/ are kvstore.bench and kvstore.connectors (pyproject's wheel.packages);
# from this source tree, links make them so for this run, removed at exit
LINKS=()
for d in bench connectors; do
  [ -e "$REPO/kvstore/$d" ] || { ln -s "../$d" "$REPO/kvstore/$d" && LINKS+=("$REPO/kvstore/$d"); }
done
trap 'rm -f "${LINKS[@]}"' EXIT
"$PY" -c "
from kvstore import kvcopy
cu = kvcopy.cuda_module()
print('cpu module:', kvcopy.native_available('cpu'), 'cuda module:', cu is not None, kvcopy.native_error('cuda') or '')
print('cuda devices:', cu.device_count() if cu else 0, '|', cu.runtime_info() if cu else '')
" 2>&1 | tee -a "$LOG"

# --------------------------------------------------------------------- 3. tests
log "tests: CUDA path against the CPU oracle, the store round trip on the GPU, then the CPU suite"
[ "${SKIP_TESTS:-0}" = "1" ] && log "SKIP_TESTS=1: tests skipped" || "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_kvcopy_cuda.py tests/test_gpu_store.py \
  tests/test_kvcopy.py >"$OUT/pytest.txt" 2>&1
rc=$?
tail -n 25 "$OUT/pytest.txt" | tee -a "$LOG"
[ $rc -eq 0 ] || { log "tests failed (rc=$rc), see $OUT/pytest.txt"; status=1; }

# ------------------------------------------------- 4. beside vLLM native's copies
if [ "${SKIP_NATIVE:-0}" != "1" ]; then
  log "kvstore vs cudaMemcpyAsync vs vLLM native's cuMemcpyBatchAsync, and the forward-pass clock (bench/copy/gpu_native.py)"
  # shellcheck disable=SC2086
  timeout "${NATIVE_TIMEOUT:-300}" "$PY" -m kvstore.bench.copy.gpu_native --out "$OUT" ${NATIVE_ARGS:-} >>"$LOG" 2>&1
  rc=$?
  [ $rc -eq 0 ] || { log "gpu_native failed (rc=$rc)"; status=1; }
fi

# ------------------------------------------------- 5. memcheck and racecheck subset
if [ "${SKIP_SANITIZER:-0}" != "1" ]; then
  CS="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)"
  if [ -n "$CS" ]; then
    for tool in ${SANITIZER_TOOLS:-memcheck racecheck}; do
      log "compute-sanitizer $tool on bench/copy/gpu_sanitize.py"
      t0=$(date +%s)
      timeout "${SANITIZER_TIMEOUT:-240}" "$CS" --tool "$tool" --error-exitcode 9 --print-limit 20 \
        "$PY" -m kvstore.bench.copy.gpu_sanitize >"$OUT/sanitizer_$tool.txt" 2>&1
      rc=$?
      tail -n 6 "$OUT/sanitizer_$tool.txt" | tee -a "$LOG"
      log "$tool rc=$rc in $(( $(date +%s) - t0 )) s"
      [ $rc -eq 0 ] || status=1
    done
  else
    log "compute-sanitizer not found: memcheck skipped"; status=1
  fi
fi

# ----------------------------------------------------------------- 6. benchmark
if [ "${SKIP_BENCH:-0}" != "1" ]; then
  log "GPU benchmark (bench/copy/gpu_bench.py)"
  # shellcheck disable=SC2086
  "$PY" -m kvstore.bench.copy.gpu_bench --out "$OUT" ${BENCH_ARGS:-} >>"$LOG" 2>&1
  rc=$?
  [ $rc -eq 0 ] || { log "GPU benchmark failed (rc=$rc)"; status=1; }
fi

# -------------------------------------------------------------------- 7. report
{
  echo "# bench/copy/gpu_copy.sh report ($(date -u +%FT%TZ), status $status)"
  echo; echo '```'; grep -E "^NVIDIA|Driver Version|torch |nvcc|release" "$OUT/env.txt" | head -6; echo '```'
  echo; echo "## Tests"; echo '```'; tail -n 15 "$OUT/pytest.txt"; echo '```'
  for tool in memcheck racecheck; do
    echo; echo "## compute-sanitizer $tool"; echo '```'; tail -n 6 "$OUT/sanitizer_$tool.txt" 2>/dev/null; echo '```'
  done
  echo; cat "$OUT/gpu_native.md" 2>/dev/null
  echo; cat "$OUT/gpu_bench.md" 2>/dev/null
} >"$OUT/report.md"

log "done (status $status); results in $OUT"
exit $status

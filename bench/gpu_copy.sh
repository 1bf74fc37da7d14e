#!/usr/bin/env bash
# bench/gpu_copy.sh: on a GPU machine, build the copy extension (CPU + CUDA
# modules), run the CUDA tests against the CPU oracle, and run the GPU (and CPU)
# copy benchmark.  Results go to $OUT (default: out/gpu_copy).
#
#   bash bench/gpu_copy.sh                 # from the repository root
#   OUT=/somewhere bash bench/gpu_copy.sh
#
# Needs: python3 with torch (CUDA build), numpy, pytest; nvcc; cmake (>= 3.18);
# nanobind (Python package).  ninja is used when present.  No network: if
# nanobind (or scikit-build-core, for the pip route) is missing, carry the wheels
# in .whl/ (git-ignored; e.g. `pip download nanobind scikit-build-core -d .whl`
# on a connected machine, then pass ".whl" in the device run's carry list):
# they are installed from there with --no-index.
#
# Knobs: PYTHON (default python3), KVCOPY_CUDA_ARCHS (default "90", H100/H200),
# KVCOPY_BUILD_DIR (default: a fresh temp dir), BENCH_ARGS (extra flags for the
# GPU benchmark, e.g. "--block-sizes 16 --blocks 256"), SKIP_CPU_BENCH=1.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
OUT="${OUT:-$REPO/out/gpu_copy}"
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
if ! "$PY" -c "import nanobind" 2>/dev/null; then
  if compgen -G "$REPO/.whl/*.whl" >/dev/null; then
    log "installing nanobind / scikit-build-core from .whl/"
    "$PY" -m pip install --no-index --find-links "$REPO/.whl" nanobind scikit-build-core >>"$LOG" 2>&1 \
      || "$PY" -m pip install --no-index --find-links "$REPO/.whl" nanobind >>"$LOG" 2>&1 \
      || fail "could not install nanobind from .whl/"
  else
    fail "nanobind is not installed and no wheels were carried in .whl/ (pip download nanobind -d .whl)"
  fi
fi
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
"$PY" -c "
from kvstore import kvcopy
cu = kvcopy.cuda_module()
print('cpu module:', kvcopy.native_available('cpu'), 'cuda module:', cu is not None, kvcopy.native_error('cuda') or '')
print('cuda devices:', cu.device_count() if cu else 0, '|', cu.runtime_info() if cu else '')
" 2>&1 | tee -a "$LOG"

# --------------------------------------------------------------------- 3. tests
log "tests: CUDA path against the CPU oracle, then the CPU suite"
"$PY" -m pytest -q -p no:cacheprovider -rs tests/test_kvcopy_cuda.py tests/test_kvcopy.py \
  >"$OUT/pytest.txt" 2>&1
rc=$?
tail -n 25 "$OUT/pytest.txt" | tee -a "$LOG"
[ $rc -eq 0 ] || { log "tests failed (rc=$rc), see $OUT/pytest.txt"; status=1; }

# ----------------------------------------------------------------- 4. benchmark
log "GPU benchmark"
# shellcheck disable=SC2086
"$PY" -m bench.copy_bench --device cuda --json "$OUT/gpu_copy_bench.json" ${BENCH_ARGS:-} \
  >"$OUT/gpu_copy_bench.md" 2>>"$LOG"
rc=$?
cat "$OUT/gpu_copy_bench.md" | tee -a "$LOG"
[ $rc -eq 0 ] || { log "GPU benchmark failed (rc=$rc)"; status=1; }

if [ "${SKIP_CPU_BENCH:-0}" != "1" ]; then
  log "CPU benchmark (this machine's cores, default threads)"
  "$PY" -m bench.copy_bench --device cpu --total-mb 1024 --json "$OUT/cpu_copy_bench.json" \
    >"$OUT/cpu_copy_bench.md" 2>>"$LOG" || { log "CPU benchmark failed"; status=1; }
  cat "$OUT/cpu_copy_bench.md" | tee -a "$LOG"
fi

log "done (status $status); results in $OUT"
exit $status

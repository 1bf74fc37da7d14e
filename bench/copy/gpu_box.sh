#!/usr/bin/env bash
# bench/copy/gpu_box.sh: issue 34's checks on a lent GPU machine, in one call (~8 min on an H200 box):
#   0. the machine and its disk (lsblk, df, cores);
#   1. build and the GPU tests (bench/copy/gpu_copy.sh with its tests only: the CUDA copy against the
#      CPU oracle, the store round trip on the GPU), the NVMe engine with io_uring and xxh3;
#   2. the no-reuse tax on the GPU (bench/copy/gpu_tax.py: the engine alone vs with the connector's saves);
#   3. the NVMe tier against the same run's O_DIRECT limits on that disk, every core
#      (`kvstore bench tiers --tiers nvme`, the issue's block sizes, 1 and 4 callers);
#   4. the O_DIRECT read limit with a hashing thread beside it (nvme_profile --cpu-beside);
#   5. step 3 again on 2 cores (taskset), as on the 2-core CI VM, if time is left.
# SKIP_TESTS=1, SKIP_TAX=1, SKIP_TIERS=1 (steps 3-5), SKIP_PROFILE=1 leave steps out. TAX_ARGS
# (default --rounds 10 --designs sync,async,async0: the grid cap against the full grid) go to
# gpu_tax.py, which runs when TAX_MIN_S (200) seconds are left. Each step stops by a deadline
# (DEADLINE_S, default 540 s from the start); at most 8 files in OUT.
#
#   bash bench/copy/gpu_box.sh OUT_DIR
#
# Carry (git-ignored) .whl/ with zstandard and redis wheels for the machine's Python (the image has
# the rest) and .deps/ with Debian's liburing-dev, liburing2, libxxhash-dev and libxxhash0 .debs
# (`apt-get download ...`): they are unpacked into /tmp/deps, never into /.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
OUT="${1:-${OUT:-$REPO/out/gpu_box}}"
mkdir -p "$OUT"
T0=$(date +%s)
DEADLINE=$((T0 + ${DEADLINE_S:-540}))
LOG="$OUT/log.txt"
log() { echo "[gpu_box +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
left() { echo $((DEADLINE - $(date +%s))); }
PY="${PYTHON:-python3}"

# ------------------------------------------------------------------ 0. the machine
{
  echo "## cores"; nproc; grep -m1 "model name" /proc/cpuinfo
  echo "## memory"; free -g | head -2
  echo "## kernel"; uname -r
  echo "## disks"; lsblk -o NAME,SIZE,ROTA,TYPE,MOUNTPOINT,MODEL 2>&1
  for q in /sys/block/*/queue; do
    echo "$q: rotational=$(cat $q/rotational) scheduler=$(cat $q/scheduler 2>/dev/null) nr_requests=$(cat $q/nr_requests) max_hw_sectors_kb=$(cat $q/max_hw_sectors_kb)"
  done
  echo "## mounts"; df -hT 2>&1 | grep -v "^overlay.*docker"
} >"$OUT/facts.txt" 2>&1
# the bench folder: the roomiest local file system that is not memory
BENCH="$(df -x tmpfs -x devtmpfs -x squashfs --output=avail,target 2>/dev/null | tail -n +2 | sort -n | tail -1 | awk '{print $2}')"
[ -n "$BENCH" ] && [ -w "$BENCH" ] || BENCH="$REPO"
BENCH="${BENCH%/}/kvstore-bench.$$"
mkdir -p "$BENCH" && chmod 700 "$BENCH"
echo "## bench folder: $BENCH ($(df --output=fstype,source "$BENCH" | tail -1))" >>"$OUT/facts.txt"
log "bench folder $BENCH"

# ------------------------------------------------------------------ 1. build and GPU tests
DEPS=/tmp/deps
if compgen -G "$REPO/.deps/*.deb" >/dev/null; then
  mkdir -p "$DEPS" && for f in "$REPO"/.deps/*.deb; do dpkg -x "$f" "$DEPS"; done
  export CMAKE_INCLUDE_PATH="$DEPS/usr/include" CMAKE_LIBRARY_PATH="$DEPS/usr/lib/x86_64-linux-gnu"
  export LD_LIBRARY_PATH="$DEPS/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if compgen -G "$REPO/.whl/*.whl" >/dev/null; then
  SITE=/tmp/kvstore-site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$REPO"/.whl/*.whl >>"$LOG" 2>&1
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
GC=/tmp/gpu_copy_out
log "build + GPU tests (bench/copy/gpu_copy.sh, tests only)"
SKIP_TESTS="${SKIP_TESTS:-0}" SKIP_NATIVE=1 SKIP_SANITIZER=1 SKIP_BENCH=1 timeout "$(left)" bash bench/copy/gpu_copy.sh "$GC" >>"$LOG" 2>&1
log "gpu_copy.sh rc=$?"
cp "$GC/report.md" "$OUT/report.md" 2>/dev/null
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
LINKS=()
for d in bench connectors; do [ -e "kvstore/$d" ] || { ln -s "../$d" "kvstore/$d" && LINKS+=("kvstore/$d"); }; done
trap 'rm -f "${LINKS[@]}"; rm -rf "$BENCH"' EXIT
"$PY" -c "
from kvstore import _blockio as b
print('blockio: io_uring', b.HAVE_URING, 'xxh3', b.HAVE_XXHASH)" 2>&1 | tee -a "$LOG" "$OUT/facts.txt"
KV=("$PY" -m kvstore.bench.tiers)

# ------------------------------------------------------------------ 2. the no-reuse tax on the GPU
if [ "${SKIP_TAX:-0}" != 1 ] && [ "$(left)" -gt "${TAX_MIN_S:-200}" ]; then
  log "no-reuse tax (bench/copy/gpu_tax.py ${TAX_ARGS:---rounds 10 --designs sync,async,async0})"
  # shellcheck disable=SC2086
  timeout $(( $(left) - ${TAX_MIN_S:-200} + 50 )) "$PY" -m kvstore.bench.copy.gpu_tax --dir "$BENCH" --out "$OUT" ${TAX_ARGS:---rounds 10 --designs sync,async,async0} >>"$LOG" 2>&1
  log "gpu_tax rc=$?"
  rm -f "$OUT/gpu_tax.md"; rm -rf "$BENCH/gpu_tax"
fi

# ------------------------------------------------------------------ 3. NVMe tier vs O_DIRECT, all cores
[ "${SKIP_TIERS:-0}" = 1 ] && DEADLINE=$(date +%s)  # steps 3-5 left out
TIERS=(--config configs/bench_tiers.yaml --tiers nvme --kv-data synthetic --block-tokens 16,32,128,256)
if [ "$(left)" -gt 90 ]; then
  log "bench tiers, nvme, $(nproc) cores"
  timeout $(( $(left) - 60 )) "${KV[@]}" "${TIERS[@]}" --dir "$BENCH" --json "$OUT/tiers.json" >>"$LOG" 2>&1
  log "bench tiers rc=$?"
fi

# ------------------------------------------------------------------ 4. CPU beside the read limit
if [ "${SKIP_PROFILE:-0}" != 1 ] && [ "$(left)" -gt 60 ]; then
  log "nvme_profile --cpu-beside"
  timeout $(( $(left) - 30 )) "$PY" -m kvstore.bench.tiers.nvme_profile --cpu-beside 0,0.4,0.8 --block-mib 2,16 \
    --total-mb 512 --repeats 5 --dir "$BENCH" >"$OUT/profile.txt" 2>&1
  log "nvme_profile rc=$?"
fi

# ------------------------------------------------------------------ 5. step 3 on 2 cores
if [ "$(left)" -gt 100 ]; then
  log "bench tiers, nvme, on cores 0-1"
  timeout $(( $(left) - 10 )) taskset -c 0,1 "${KV[@]}" "${TIERS[@]}" --dir "$BENCH" --json "$OUT/tiers_2cores.json" >>"$LOG" 2>&1
  log "bench tiers (2 cores) rc=$?"
fi
rm -rf "$BENCH"
log "done"

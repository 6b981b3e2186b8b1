#!/usr/bin/env bash
# One device call for the sparse form's fp8-MMA kernels (lab/NOTES.md h117-h119), on the device's copy
# of the tree (it replaces submission.py there; carry `.peers .device`):
#   1. lab/device/fp8_mma_probe.py: the fp8 tensor core's accumulator against the 13-bit model that
#      reference.sparse_fp8_mma_slack assumes ($OUT/fp8_mma.json);
#   2. FlashMLA's sparse decode built in the background from .peers/flashmla_sparse_kit.tar.xz;
#   3. MAIN (default .device/sparse/h117.py) as submission.py, with the trace patch applied;
#      lab/device/sparse_smoke.py (one strict call per case) on it and on each of SMOKE ("FILE ...",
#      default h117d);
#   4. bench/sparse_peers.py: ours (MAIN) beside FlashMLA and each of SPARSE_VARIANTS (default h113,
#      h117c, h117d), without the strict check (fp8 P fails the out bound by design; the smoke judged);
#   5. lab/profile/sparse_trace.py of MAIN's four partitions at b 128 and 2, 64 heads.
#
#   bash lab/device/sparse_fp8_call.sh [SECONDS]      (the whole call's budget, default 480)
set -uo pipefail
MAIN=${MAIN:-.device/sparse/h117.py}
source "$(dirname "$0")/common.sh" "${1:-480}"  # BUDGET, START, left, OUT; device.txt
timeout 60 python3 lab/device/fp8_mma_probe.py --json "$OUT/fp8_mma.json" > "$OUT/fp8_mma.txt" 2>&1
echo "probe rc=$? at $(( $(date +%s) - START )) s"; grep -v "Warning\|aiter" "$OUT/fp8_mma.txt"
cp "$MAIN" submission.py && patch -p1 -s < lab/patches/h117_sparse_trace.patch || echo "MAIN or the trace patch failed"

( MAX_JOBS=${SPARSE_JOBS:-8} timeout 170 bash bench/flashmla_sparse_build.sh /tmp/flashmla_sparse > "$OUT/build_sparse.log" 2>&1
  echo "flashmla_sparse rc=$? at $(( $(date +%s) - START )) s" >> "$OUT/build_sparse.log" ) &

for f in submission.py ${SMOKE:-.device/sparse/h117d.py}; do
  id=$(basename "$f" .py)
  timeout 150 python3 lab/device/sparse_smoke.py "$f" > "$OUT/smoke_$id.txt" 2>&1
  echo "smoke $id rc=$? at $(( $(date +%s) - START )) s"; grep -v "Warning\|_warn_once" "$OUT/smoke_$id.txt" | cut -c1-260
done
wait
tail -n 2 "$OUT/build_sparse.log"

SPARSE_ARGS=${SPARSE_ARGS:---no-check} \
SPARSE_VARIANTS=${SPARSE_VARIANTS:-.device/sparse/h113.py .device/sparse/h117c.py .device/sparse/h117d.py} \
    sparse_timing $(( $(left) - 110 ))
timeout $(( $(left) - 10 )) python3 lab/profile/sparse_trace.py --cases 128x64,2x64 --repeats 3 > "$OUT/trace.txt" 2>&1
echo "trace rc=$? at $(( $(date +%s) - START )) s"; tail -n 40 "$OUT/trace.txt" | cut -c1-230

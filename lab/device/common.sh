# What the device scripts share: sourced as `source "$(dirname "$0")/common.sh" "$@"` by
# lab/device/patches_and_peers.sh and suite_and_sparse.sh, whose first argument is the call's budget.
# Sets BUDGET (default 560 s), START, left() (the budget's seconds left), OUT (default /tmp/out), and
# writes the card, torch and Triton into $OUT/device.txt.
set -uo pipefail
BUDGET=${1:-560}
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/device.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" \
    >> "$OUT/device.txt"

sparse_timing() {  # $1: seconds. bench/sparse_peers.py: ours, FlashMLA's sparse build where it exists,
                   # and each of SPARSE_VARIANTS="FILE ..." (patched submission.py files) by its name;
                   # SPARSE_ARGS: more of its arguments (--no-check for ablations that are wrong by design)
  local peer=""
  [ -d /tmp/flashmla_sparse/build ] && peer="--flashmla-sparse /tmp/flashmla_sparse/build"
  for v in ${SPARSE_VARIANTS:-}; do peer="$peer --variant $(basename "$v" .py)=$v"; done
  timeout "$1" python3 bench/sparse_peers.py $peer --repeats 5 --host-repeats 3 ${SPARSE_ARGS:-} \
      --json "$OUT/sparse.json" > "$OUT/sparse.txt" 2>&1
  echo "sparse rc=$? at $(( $(date +%s) - START )) s"
  grep -v "UserWarning\|_warn_once\|aiter routes off" "$OUT/sparse.txt" | cut -c1-230
}

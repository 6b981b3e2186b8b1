#!/usr/bin/env bash
# One device call: the prepared patches and every peer against HEAD, in one process per grid
# (bench/serving_peers.py), within one call's limit.
#   1. the peers built in the background, side by side (FlashMLA and vLLM's fp8 fork from .peers, FA3
#      from .fa3 and FlashMLA's sparse decode from .peers where their kits are carried: bench/fa3_kit.sh,
#      bench/flashmla_sparse_kit.sh), FlashInfer unpacked from .fi;
#   2. meanwhile HEAD and each patched submission.py (.device/variants, lab/device/make_variants.sh)
#      run once on every case in a process of their own, side by side, each checked against float64
#      attention: this compiles every kernel the timing needs, in parallel;
#   3. then every provider timed, grid C first, then A and B, until the budget's end; with
#      SPARSE_SECONDS=N, the last N seconds time the sparse form against FlashMLA's (bench/sparse_peers.py),
#      with SPARSE_VARIANTS="FILE ..." (patched submission.py files, e.g. make_variants.sh's) beside ours;
#      with AB_BASE=FILE and AB_SECONDS=N, first N seconds of custom_kernel's A/B on the leaderboard's
#      shapes (tools/ab_probe.py --whole, the runner's flush: AB_BASE, HEAD, AB_BASE interleaved);
#      SPARSE_FIRST=1 builds FlashMLA's sparse decode first and times the sparse form while the
#      other peers build;
#   with TESTS="pytest arguments", those tests run beside step 2 (4 workers, $OUT/tests.txt).
#
#   bash lab/device/patches_and_peers.sh [SECONDS]      (the whole call's budget, default 560)
source "$(dirname "$0")/common.sh" "$@"  # BUDGET, START, left, OUT; device.txt

# 1. peers
TIMING=${TIMING:-$(( BUDGET * 2 / 5 ))}  # the seconds kept for step 3
build() { local name=$1; shift; ( timeout $(( BUDGET - TIMING - 10 )) "$@" > "/tmp/build_$name.log" 2>&1 && echo "$name built at $(( $(date +%s) - START )) s" \
          || echo "$name FAILED at $(( $(date +%s) - START )) s" ) >> /tmp/builds.log; }
if [ -z "${NO_PEERS:-}" ]; then  # NO_PEERS=1: the versions alone (no builds, no FlashInfer)
  MAX_JOBS=5 build flashmla bash .peers/flashmla_build.sh /tmp/flashmla &
  MAX_JOBS=5 build vllm_fp8 bash .peers/vllm_fp8_build.sh /tmp/vllm_fp8 &
  [ -e .fa3/fa3_kit.tar.xz ] && MAX_JOBS=6 build fa3 bash bench/fa3_build.sh /tmp/fa3 &
fi
touch /tmp/builds.log
if [ -n "${TESTS:-}" ]; then
  ( timeout $(( BUDGET - TIMING - 10 )) python3 -m pytest -q -n 4 -p no:cacheprovider $TESTS > "$OUT/tests.txt" 2>&1
    echo "tests rc=$? at $(( $(date +%s) - START )) s" >> /tmp/warm.log ) &
fi
SPARSE_LAST=${SPARSE_SECONDS:-0}
if [ -z "${NO_PEERS:-}" ] && [ -e .peers/flashmla_sparse_kit.tar.xz ] && [ "$SPARSE_LAST" -gt 0 ]; then
  if [ -n "${SPARSE_FIRST:-}" ]; then  # built now, and the sparse form timed while the others build
    MAX_JOBS=6 build flashmla_sparse bash bench/flashmla_sparse_build.sh /tmp/flashmla_sparse
    sparse_timing "$SPARSE_LAST"; SPARSE_LAST=0
  else
    MAX_JOBS=4 build flashmla_sparse bash bench/flashmla_sparse_build.sh /tmp/flashmla_sparse &
  fi
fi
if [ -z "${NO_PEERS:-}" ] && [ -e .fi/flashinfer_kit.tar.xz ]; then
  mkdir -p /tmp/site && tar xJf .fi/flashinfer_kit.tar.xz -C /tmp/site &&
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .fi/apache_tvm_ffi-*.whl > /tmp/build_fi.log 2>&1
  export PYTHONPATH=/tmp/site FLASHINFER_DISABLE_JIT=1
fi

# 2. every kernel compiled and checked, a process per version
GRIDS=${GRIDS:-A,B,C}
VARIANTS=""
for v in .device/variants/*.py; do [ -e "$v" ] || continue; VARIANTS="$VARIANTS --variant $(basename "$v" .py)=$v"; done
warm() {  # $1: a providers regex
  timeout $(( $(left) - TIMING )) python3 bench/serving_peers.py --grids "$GRIDS" --skip-32k --repeats 1 \
      --host-repeats 1 --no-flashinfer $VARIANTS --providers "$1" > "/tmp/warm_$2.log" 2>&1
  echo "warm $2 rc=$? at $(( $(date +%s) - START )) s" >> /tmp/warm.log
}
warm "^ours " ours &
for v in .device/variants/*.py; do [ -e "$v" ] || continue; id=$(basename "$v" .py); warm "^$id " "$id" & done
wait $(jobs -p)  # the builds too
cat /tmp/builds.log /tmp/warm.log
for f in /tmp/warm_*.log; do echo "== $f"; grep -v "^NOTE\|UserWarning\|_warn_once" "$f"; done \
    > "$OUT/warm.log"
tail -n 5 /tmp/build_*.log > "$OUT/builds.log" 2>&1; cat /tmp/builds.log >> "$OUT/builds.log"
grep -h "rel " /tmp/warm_*.log | awk '{for (i = 1; i <= NF; i++) if ($i == "rel") print $(i + 1)}' | sort -g | tail -3

# 3. the timing
if [ -n "${AB_BASE:-}" ] && [ "${AB_SECONDS:-0}" -gt 0 ]; then
  timeout "$AB_SECONDS" python3 tools/ab_probe.py "$AB_BASE" submission.py "$AB_BASE" --whole --l2-flush runner \
      --repeats 30 > "$OUT/ab_whole.txt" 2>&1
  echo "A/B rc=$? at $(( $(date +%s) - START )) s"; tail -n 15 "$OUT/ab_whole.txt"
fi
PEERS=""
[ -e /tmp/flashmla/build ] && PEERS="$PEERS --flashmla /tmp/flashmla/build"
[ -e /tmp/vllm_fp8/build ] && cp .peers/peer_vllm_fp8.py /tmp/vllm_fp8/ && PEERS="$PEERS --vllm-fp8 /tmp/vllm_fp8"
[ -d /tmp/fa3/build ] && PEERS="$PEERS --fa3 /tmp/fa3/build"
echo "timing from $(( $(date +%s) - START )) s with$PEERS"
[ -n "${NO_PEERS:-}" ] && PEERS="--no-flashinfer"
python3 bench/serving_peers.py --grids "$GRIDS" --skip-32k --repeats 5 --host-repeats 3 $PEERS $VARIANTS \
    --max-seconds $(( $(left) - 45 - SPARSE_LAST )) --json "$OUT/peers.json" > "$OUT/peers.txt" 2>&1
grep "^grid\|NOTE" "$OUT/peers.txt"
[ "$SPARSE_LAST" -gt 0 ] && sparse_timing $(( $(left) - 15 ))
echo "done at $(( $(date +%s) - START )) s"

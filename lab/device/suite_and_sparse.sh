#!/usr/bin/env bash
# One device call: the whole suite as `make test` runs it (lint, preflight, every test, the GPU ones
# included), then the sparse form against FlashMLA's sparse decode (bench/sparse_peers.py).
#   1. FlashMLA's sparse decode built in the background from .peers/flashmla_sparse_kit.tar.xz;
#   2. lint and preflight with kernelguard and ruff from .device/whl (the GPU machine has neither),
#      then pytest over tests/ (or TESTS="pytest arguments"; SUITE_SECONDS at most);
#   3. bench/sparse_peers.py with SPARSE_VARIANTS="FILE ..." (patched submission.py files) beside ours.
#   VARIANT_TESTS="FILE ...": beside step 2, VARIANT_TEST_FILES (default: the sparse form's tests) run
#   against each FILE as submission.py in a copy of the tree ($OUT/variant_tests_NAME.txt); with
#   VARIANT_GATE=1 a variant whose tests failed or ran out of time is left out of step 3.
#
#   bash lab/device/suite_and_sparse.sh [SECONDS]      (the whole call's budget, default 560)
source "$(dirname "$0")/common.sh" "$@"  # BUDGET, START, left, OUT; device.txt
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/whl/*.whl > "$OUT/wheels.log" 2>&1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}

# 1. the sparse peer
( MAX_JOBS=${SPARSE_JOBS:-4} timeout 300 bash bench/flashmla_sparse_build.sh /tmp/flashmla_sparse > "$OUT/build_sparse.log" 2>&1
  echo "flashmla_sparse rc=$? at $(( $(date +%s) - START )) s" >> "$OUT/build_sparse.log" ) &

for v in ${VARIANT_TESTS:-}; do  # each patched file's tests in a copy of the tree, beside the suite
  id=$(basename "$v" .py); rm -rf "/tmp/tree_$id"; mkdir -p "/tmp/tree_$id"; cp -r . "/tmp/tree_$id/"
  cp "$v" "/tmp/tree_$id/submission.py"
  ( cd "/tmp/tree_$id" && timeout "${SUITE_SECONDS:-330}" python3 -m pytest -q -n 2 -p no:cacheprovider \
      ${VARIANT_TEST_FILES:-tests/gpu/test_sparse_gpu.py tests/cpu/test_sparse_decode.py tests/cpu/test_sparse_peers.py} \
      > "$OUT/variant_tests_$id.txt" 2>&1; echo "$id tests rc=$? at $(( $(date +%s) - START )) s" >> "$OUT/variant_tests_$id.txt" ) &
done

# 2. make test's steps
make lint preflight PY=python3 SETUP= > "$OUT/lint_preflight.txt" 2>&1
echo "lint+preflight rc=$? at $(( $(date +%s) - START )) s"
SUITE=${SUITE_SECONDS:-330}
timeout "$SUITE" python3 -m pytest -q -n ${WORKERS:-12} --dist loadfile -p no:cacheprovider ${TESTS:-tests} \
    > "$OUT/suite.txt" 2>&1
echo "suite rc=$? at $(( $(date +%s) - START )) s"; tail -n 25 "$OUT/suite.txt"
wait
tail -n 3 "$OUT/build_sparse.log"
for f in "$OUT"/variant_tests_*.txt; do [ -e "$f" ] && { echo "== $f"; tail -n 4 "$f"; }; done
if [ -n "${VARIANT_GATE:-}" ]; then  # VARIANT_GATE=1: a variant whose tests failed or hung is not timed
  kept=""
  for v in ${SPARSE_VARIANTS:-}; do
    id=$(basename "$v" .py); f="$OUT/variant_tests_$id.txt"
    if [ -e "$f" ] && ! grep -q "$id tests rc=0 " "$f"; then echo "$id not timed: its tests failed"; else kept="$kept $v"; fi
  done
  SPARSE_VARIANTS=$kept
fi

# 3. the sparse form's speed
sparse_timing $(( $(left) - 10 ))

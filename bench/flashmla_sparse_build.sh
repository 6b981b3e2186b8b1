#!/usr/bin/env bash
# Builds FlashMLA's sm90 sparse MLA decode on the GPU machine from the kit bench/flashmla_sparse_kit.sh makes
# (default .peers/flashmla_sparse_kit.tar.xz at the repository root; KIT=... for another).
#
#   bash bench/flashmla_sparse_build.sh [DEST]      # DEST default /tmp/flashmla_sparse
#
# Unpacks the kit into DEST and builds the extension flash_mla_sparse_ext with torch.utils.cpp_extension.load
# (ninja, MAX_JOBS parallel compiles, default 16), with the nvcc flags of FlashMLA's setup.py for sm_90a alone:
# the binding, the sm100 stand-ins, the scheduling-metadata and combine kernels and the four sm90 sparse decode
# instantiations (V3.2 and MODEL1 layouts x 64 and 128 heads: the dispatch references all four).
# Result in DEST/build: flash_mla_sparse_ext.so and flash_mla/ (FlashMLA's Python interface, unchanged);
# bench/sparse_peers.py --flashmla-sparse DEST/build loads it (sys.modules['flash_mla.cuda'] = the extension, then
# import flash_mla). Prints "FLASHMLA_SPARSE_BUILD=DEST/build" at the end.
# Env: PY (default python3), MAX_JOBS (16), NVCC_THREADS (32, as setup.py), KIT.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
KIT="${KIT:-$ROOT/.peers/flashmla_sparse_kit.tar.xz}"
DEST="${1:-/tmp/flashmla_sparse}"
export MAX_JOBS="${MAX_JOBS:-16}"
t0=$SECONDS
rm -rf "$DEST" && mkdir -p "$DEST"
tar -xJf "$KIT" -C "$DEST"
head -1 "$DEST/flashmla_sparse/KIT.txt"
PYTHONPATH="$ROOT/bench${PYTHONPATH:+:$PYTHONPATH}" "${PY:-python3}" - "$DEST/flashmla_sparse" "$DEST/build" <<'PY'
import os
import shutil
import sys
import time

import torch
from torch.utils.cpp_extension import load

import kit_build  # bench/, beside this script

CUDA_HOME = kit_build.use_cuda_home()
src, build = sys.argv[1:3]
csrc = os.path.join(src, "csrc")
os.makedirs(build, exist_ok=True)
cxx = ["-O3", "-std=c++20", "-DNDEBUG", "-Wno-deprecated-declarations"] + kit_build.host_include_flags()
nvcc = ["-O3", "-std=c++20", "-DNDEBUG", "-D_USE_MATH_DEFINES", "-Wno-deprecated-declarations",
        "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr", "--expt-extended-lambda",
        "--use_fast_math",
        "--ptxas-options=-v,--register-usage-level=10,--warn-on-spills,--warn-on-local-memory-usage,"
        "--warn-on-double-precision-use",
        "-lineinfo", "--source-in-ptx",
        "-gencode", "arch=compute_90a,code=sm_90a",  # setup.py with FLASH_MLA_DISABLE_SM100=1
        "--threads", os.environ.get("NVCC_THREADS", "32")]
sources = [os.path.join(csrc, f) for f in (
    "api/sparse_decode_binding.cpp",
    "sparse_kit_stubs.cpp",
    "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
    "smxx/decode/combine/combine.cu",
    "sm90/decode/sparse_fp8/instantiations/v32_persistent_h64.cu",
    "sm90/decode/sparse_fp8/instantiations/v32_persistent_h128.cu",
    "sm90/decode/sparse_fp8/instantiations/model1_persistent_h64.cu",
    "sm90/decode/sparse_fp8/instantiations/model1_persistent_h128.cu")]
includes = [csrc, os.path.join(csrc, "kerutils", "include"), os.path.join(csrc, "sm90"),
            os.path.join(csrc, "cutlass", "include")]
print(f"torch {torch.__version__}, CUDA_HOME {CUDA_HOME}, MAX_JOBS {os.environ['MAX_JOBS']}", flush=True)
t = time.time()
ext = load(name="flash_mla_sparse_ext", sources=sources, extra_cflags=cxx, extra_cuda_cflags=nvcc,
           extra_include_paths=includes, build_directory=build, verbose=True)
shutil.copytree(os.path.join(src, "flash_mla"), os.path.join(build, "flash_mla"), dirs_exist_ok=True)
shutil.copy2(os.path.join(src, "KIT.txt"), build)
print(f"built in {time.time() - t:.0f} s; functions: {[n for n in dir(ext) if not n.startswith('_')]}")
PY
echo "FLASHMLA_SPARSE_BUILD=$DEST/build"
echo "[flashmla_sparse_build] done in $((SECONDS - t0)) s"

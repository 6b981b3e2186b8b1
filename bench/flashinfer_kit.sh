#!/usr/bin/env bash
# FlashInfer's MLA wrapper for a GPU machine without network: bench/serving_peers.py's FlashInfer
# provider on sm_90 (H100, H200). Run it where pip reaches PyPI and nvcc (CUDA >= 12.3) compiles
# for sm_90a, with a Python that has torch; no GPU is needed.
#
#   bash bench/flashinfer_kit.sh DEST [PYTHON]
#
# DEST gets flashinfer_kit.tar.xz: flashinfer-python 0.7.4 with the two modules the wrapper loads
# on sm_90 (its fa3 MLA kernels, q bf16 over a bf16 and over an fp8 cache, 512 + 64 dims, int32
# indices) built ahead of time by FlashInfer's own JIT and put where it looks for prebuilt modules
# (data/aot), and without the sources and headers a JIT build would need (so it is about 15 MB,
# where the wheel alone is 101 MB); and the apache-tvm-ffi wheel for Python 3.12. On the GPU machine:
#
#   mkdir -p /tmp/site && tar xJf DEST/flashinfer_kit.tar.xz -C /tmp/site &&
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DEST/apache_tvm_ffi-*.whl &&
#   export PYTHONPATH=/tmp/site FLASHINFER_DISABLE_JIT=1
#
# FLASHINFER_DISABLE_JIT makes a module the kit lacks an error rather than a build. FlashInfer's
# other needs (requests, einops, ninja, cuda-bindings, ...) are on the H200's image.
set -euo pipefail
DEST=$(realpath -m "${1:?usage: flashinfer_kit.sh DEST [PYTHON]}")
PY=${2:-python3}
VERSION=0.7.4
TVM_FFI='apache-tvm-ffi>=0.1.11,<0.2'
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$DEST"

download() { "$PY" -m pip download -q --no-deps --only-binary=:all: "$@"; }
download -d "$WORK/wheels" "flashinfer-python==$VERSION" "$TVM_FFI"  # for this Python, to build here
download -d "$DEST" --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 "$TVM_FFI"  # for the GPU machine
"$PY" -m pip install -q --no-deps --no-index --target "$WORK/site" "$WORK"/wheels/*.whl
"$PY" -m pip install -q --target "$WORK/deps" requests einops tabulate click nvidia-ml-py packaging tqdm ninja \
    cuda-bindings jinja2

export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE="$WORK/ws"
export PATH="$WORK/deps/bin:$PATH"
if [ -e "$CUDA_HOME/lib64/stubs/libcuda.so" ]; then
    export LIBRARY_PATH="$CUDA_HOME/lib64/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
elif ! ldconfig -p | grep -q 'libcuda\.so '; then
    # the JIT links with -lcuda; with no driver here, an empty library of its soname stands in (the
    # GPU machine's driver provides the symbols when the module loads)
    mkdir -p "$WORK/stubs"
    echo > "$WORK/stubs/empty.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$WORK/stubs/libcuda.so" "$WORK/stubs/empty.c"
    export LIBRARY_PATH="$WORK/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
fi
PYTHONPATH="$WORK/site:$WORK/deps" "$PY" - "$WORK/site/flashinfer/data/aot" <<'EOF'
import pathlib
import shutil
import sys

import torch
from flashinfer.jit.attention.modules import gen_batch_mla_module

aot = pathlib.Path(sys.argv[1])
for kv in (torch.bfloat16, torch.float8_e4m3fn):
    spec = gen_batch_mla_module("fa3", torch.bfloat16, kv, torch.bfloat16, torch.int32, 512, 64, False)
    spec.build()
    (aot / spec.name).mkdir(parents=True, exist_ok=True)
    shutil.copy(spec.jit_library_path, aot / spec.name / f"{spec.name}.so")
    print("built", spec.name)
EOF

# what a run needs of data/: the prebuilt modules, and the MLA sources the module generator reads
cd "$WORK/site/flashinfer/data"
rm -rf cutlass cccl include spdlog
find csrc -mindepth 1 -maxdepth 1 ! -name 'batch_mla_*' -exec rm -rf {} +
cd "$WORK/site"
find flashinfer -name __pycache__ -type d -prune -exec rm -rf {} +
tar cJf "$DEST/flashinfer_kit.tar.xz" flashinfer
ls -l "$DEST"

#!/usr/bin/env bash
# Builds FA3's MLA decode path (flash-attention's Hopper forward kernels, bf16, head dim 64 with value dim 512, paged
# KV, with and without split-KV) on the GPU machine from the kit bench/fa3_kit.sh makes (default .fa3/fa3_kit.tar.xz
# at the repository root; KIT=... for another): flash-attention 0251105, CUTLASS 7127592 (its submodule pin).
#
#   bash bench/fa3_build.sh [DEST]      # DEST default /tmp/fa3
#
# Unpacks the kit into DEST and builds flash_attn_3._C with torch.utils.cpp_extension.load (ninja, MAX_JOBS parallel
# compiles, default 16) from hopper/setup.py's sources, flags and switches, for sm_90a only and torch >= 2.9's binding
# (flash_api_stable.cpp, the stable ABI, as setup.py picks it):
# - FLASH_ATTENTION_DISABLE_{BACKWARD,FP16,FP8,HDIM96,HDIM128,HDIM192,HDIM256,HDIMDIFF192,SM80,SOFTCAP,LOCAL,
#   APPENDKV,CLUSTER} as -D flags, as setup.py turns them into: left are bf16, head dim 64 (and with it the
#   "hdimdiff64" value dims 256 and 512), paged KV, split-KV, PackGQA, varlen (seqused_k needs it);
# - sources: flash_api_stable.cpp, flash_fwd_combine.cu and flash_prepare_scheduler.cu (split-KV's combine, the
#   varlen scheduler), the five 64/512 instantiations (flash_fwd_hdim64_512_bf16{,_packgqa,_paged,_split,_paged_split}_sm90.cu),
#   and the kit's fa3_kit_stubs.cu in place of the ten 64/64 and 64/256 ones the dispatch references (FA3_FULL=1:
#   the ten real files instead, five more heavy compiles).
# Ten compiles, nine of them nvcc; a 64/512 file is the long pole (eight kernels: causal x varlen x q_v; about 5 GB
# of memory, 190 s on a loaded core of the 2-core CPU machine); the five run in parallel: the whole build took
# 104-112 s on the H100 machine (16 cores, nvcc 13.0, torch 2.11); FA3_FULL=1 adds ten more such compiles.
# Result in DEST/build: flash_attn_interface.py (flash-attention's, unchanged), flash_attn_config.py (what setup.py
# would write for these switches), flash_attn_3/ (its package files and _C.so). bench/fa3_mla.py load(DEST/build)
# imports it; it prints "FA3_BUILD=DEST/build" at the end, and the build time.
# Env: PY (default python3), MAX_JOBS (16), KIT, FA3_FULL (0).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
KIT="${KIT:-$ROOT/.fa3/fa3_kit.tar.xz}"
DEST="${1:-/tmp/fa3}"
export MAX_JOBS="${MAX_JOBS:-16}" FA3_FULL="${FA3_FULL:-0}"
t0=$SECONDS
rm -rf "$DEST" && mkdir -p "$DEST"
tar -xJf "$KIT" -C "$DEST"
head -1 "$DEST/fa3/KIT.txt"
PYTHONPATH="$ROOT/bench${PYTHONPATH:+:$PYTHONPATH}" "${PY:-python3}" - "$DEST/fa3" "$DEST/obj" "$DEST/build" <<'PY'
import os
import shutil
import sys
import time

import torch
from torch.utils.cpp_extension import load

import kit_build  # bench/, beside this script

CUDA_HOME = kit_build.use_cuda_home()
kit, obj, build = sys.argv[1:4]
hopper = os.path.join(kit, "flash-attention", "hopper")
full = os.environ["FA3_FULL"] == "1"
os.makedirs(obj, exist_ok=True)
DISABLED = ["BACKWARD", "FP16", "FP8", "HDIM96", "HDIM128", "HDIM192", "HDIM256", "HDIMDIFF192", "SM80", "SOFTCAP",
            "LOCAL", "APPENDKV", "CLUSTER"]
# setup.py's feature_args: FLASH_ATTENTION_DISABLE_X=TRUE gives -DFLASHATTENTION_DISABLE_X, except SM80 (-D..._SM8x)
# and the two HDIMDIFF switches (-DFLASHATTENTION_DISABLE_HDIMDIFF64/192)
features = [f"-DFLASHATTENTION_DISABLE_{'SM8x' if name == 'SM80' else name}" for name in DISABLED]
cxx = ["-O3", "-std=c++17", "-DPy_LIMITED_API=0x03090000",
       "-DTORCH_TARGET_VERSION=0x0209000000000000"] + features  # setup.py's, with flash_api_stable.cpp
cxx += kit_build.host_include_flags()  # the toolkit's cccl, and cuSPARSE & co. from wheels where it lacks them
nvcc = ["-O3", "-std=c++17", "--ftemplate-backtrace-limit=0", "--use_fast_math", "--resource-usage", "-lineinfo",
        "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED", "-DCUTLASS_ENABLE_GDC_FOR_SM90", "-DCUTLASS_DEBUG_TRACE_LEVEL=0",
        "-DNDEBUG",  # setup.py's nvcc_flags
        "-gencode", "arch=compute_90a,code=sm_90a"] + features  # its cc_flag (an arch flag: torch adds none)
dims = ["64_512"] + (["64", "64_256"] if full else [])
sources = [os.path.join(hopper, f) for f in ("flash_api_stable.cpp", "flash_fwd_combine.cu",
                                             "flash_prepare_scheduler.cu")]
sources += [os.path.join(hopper, "instantiations", f"flash_fwd_hdim{d}_bf16{variant}_sm90.cu")
            for d in dims for variant in ("", "_packgqa", "_paged", "_split", "_paged_split")]
if not full:
    sources.append(os.path.join(kit, "fa3_kit_stubs.cu"))
includes = [hopper, os.path.join(kit, "cutlass", "include")]
print(f"torch {torch.__version__}, CUDA_HOME {CUDA_HOME}, MAX_JOBS {os.environ['MAX_JOBS']}, "
      f"{len(sources)} sources: {[os.path.basename(s) for s in sources]}", flush=True)
t = time.time()
# the module name setup.py gives it (flash_attn_3._C: PyInit__C); a plain library here (torch.ops.load_library
# loads it once, checking that every symbol resolves), imported as flash_attn_3._C from DEST/build later
so = load(name="_C", sources=sources, extra_cflags=cxx, extra_cuda_cflags=nvcc, extra_include_paths=includes,
          build_directory=obj, verbose=True, is_python_module=False)
elapsed = time.time() - t
ops = torch.ops.flash_attn_3
print(f"built in {elapsed:.0f} s; ops: {ops.fwd}, {ops.get_scheduler_metadata}, {ops.fwd_combine}", flush=True)

package = os.path.join(build, "flash_attn_3")
os.makedirs(package, exist_ok=True)
shutil.copy2(so, os.path.join(package, "_C.so"))
for name in ("__init__.py", "flash_attn_interface.py", "flash_attn_config.py"):
    shutil.copy2(os.path.join(hopper, "flash_attn_3", name), package)
shutil.copy2(os.path.join(hopper, "flash_attn_interface.py"), build)
shutil.copy2(os.path.join(kit, "KIT.txt"), build)
# what hopper/setup.py's create_build_config_file() writes for these switches (flash_attn_interface reads it)
names = ["BACKWARD", "SPLIT", "PAGEDKV", "APPENDKV", "LOCAL", "SOFTCAP", "PACKGQA", "FP16", "FP8", "VARLEN",
         "CLUSTER", "HDIM64", "HDIM96", "HDIM128", "HDIM192", "HDIM256", "SM8x"]
flags = {f"FLASHATTENTION_DISABLE_{n}": (n if n != "SM8x" else "SM80") in DISABLED for n in names}
flags["FLASHATTENTION_ENABLE_VCOLMAJOR"] = False
flags["FLASH_ATTENTION_DISABLE_HDIMDIFF64"] = False
flags["FLASH_ATTENTION_DISABLE_HDIMDIFF192"] = True
with open(os.path.join(build, "flash_attn_config.py"), "w") as f:
    f.write("# Auto-generated by flash attention 3 setup.py\n")
    f.write(f"CONFIG = {repr({'build_flags': flags})}\n\n")
    f.write("def show():\n    from pprint import pprint\n    pprint(CONFIG)\n")
print(f"FA3_BUILD={build}")
PY
echo "[fa3_build] done in $((SECONDS - t0)) s (FA3_FULL=$FA3_FULL); use: bench/fa3_mla.py load(\"$DEST/build\")"

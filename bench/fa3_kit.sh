#!/usr/bin/env bash
# FA3's MLA decode path (flash-attention's Hopper kernels, the flash_attn_3 package: what vLLM's FLASH_ATTN_MLA
# backend and SGLang's fa3 backend call for DeepSeek MLA decode) as a source kit for a GPU machine without
# network: bench/fa3_build.sh builds it there, bench/fa3_mla.py calls it.
#
#   bash bench/fa3_kit.sh DEST_TARBALL          # e.g. .fa3/fa3_kit.tar.xz (.fa3/ is git-ignored)
#
# Run where git snapshots of the two repositories are at hand (the search tool's fetch gives them: github:Dao-AILab/
# flash-attention and github:NVIDIA/cutlass); nothing is compiled here. FA_GIT and CUTLASS_GIT name their git
# directories (default: the fetch tool's mirrors). The kit (1.1 MB) holds, unchanged:
# - flash-attention at FA_COMMIT: LICENSE (BSD-3-Clause), hopper/'s headers, flash_api_stable.cpp (the binding
#   setup.py picks for torch >= 2.9), flash_fwd_combine.cu, flash_prepare_scheduler.cu, setup.py (the flags' source),
#   the Python interface (flash_attn_interface.py, flash_attn_3/), and of hopper/instantiations/ the 15 bf16 sm90
#   forward files that flash_api_stable.cpp's dispatch references once setup.py's switches are set as the build sets
#   them: head dim 64 with value dims 64, 256 and 512, each {plain, packgqa, paged, split, paged_split};
# - CUTLASS at flash-attention's submodule pin (csrc/cutlass at FA_COMMIT): include/ and LICENSE.txt (BSD-3-Clause);
# - KIT.txt: where each part comes from, and which instantiations fa3_build.sh compiles.
# Of the 15, fa3_build.sh compiles the five 64/512 ones (MLA decode: q_rope 64 dims, value and q_v 512); the
# dispatch's references to 64/64 and 64/256 are satisfied by fa3_kit_stubs.cu, written here (a stand-in that raises,
# not flash-attention's code), unless FA3_FULL=1 at build time, which compiles their real files too.
set -euo pipefail
DEST=$(realpath -m "${1:?usage: fa3_kit.sh DEST_TARBALL}")
FA_GIT=${FA_GIT:-/work/.mirror/Dao-AILab+flash-attention/repo}
CUTLASS_GIT=${CUTLASS_GIT:-/work/.mirror/NVIDIA+cutlass/repo}
FA_COMMIT=0251105a2fb19d2957484b7f023cd8c115286ced  # main, 2026-08-15: "[CuTe] Relax CUTLASS DSL requirement (#2798)"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

source "$(dirname "$0")/kit_extract.sh"  # pinned_cutlass, extract
CUTLASS_COMMIT=$(pinned_cutlass "$FA_GIT" "$FA_COMMIT" "$CUTLASS_GIT")  # the submodule's pinned commit

HOPPER=(hopper/setup.py hopper/flash_api_stable.cpp hopper/flash_fwd_combine.cu hopper/flash_prepare_scheduler.cu
        hopper/flash_attn_interface.py hopper/flash_attn_3/__init__.py hopper/flash_attn_3/flash_attn_interface.py
        hopper/flash_attn_3/flash_attn_config.py)
mapfile -t HEADERS < <(git -C "$FA_GIT" ls-tree --name-only "$FA_COMMIT" hopper/ | grep -E '\.(h|hpp)$')
INSTANTIATIONS=()
for dims in 64 64_256 64_512; do  # setup.py's names: hdim64 (value dim 64 too), hdim64_256, hdim64_512
    for variant in "" _packgqa _paged _split _paged_split; do
        INSTANTIATIONS+=("hopper/instantiations/flash_fwd_hdim${dims}_bf16${variant}_sm90.cu")
    done
done
extract "$FA_GIT" "$FA_COMMIT" "$WORK/fa3/flash-attention" LICENSE "${HOPPER[@]}" "${HEADERS[@]}" "${INSTANTIATIONS[@]}"
extract "$CUTLASS_GIT" "$CUTLASS_COMMIT" "$WORK/fa3/cutlass" include LICENSE.txt

cat > "$WORK/fa3/fa3_kit_stubs.cu" <<'EOF'
// Stand-ins for the forward kernels of head dim 64 with value dims 64 and 256, which flash_api_stable.cpp's dispatch
// (run_mha_fwd_constexpr, bf16, head dim 64) references but an MLA decode (value dim 512) never launches: the .so
// then links and loads without compiling their ten instantiation files. Each raises if it is ever reached.
// Written by bench/fa3_kit.sh (not part of flash-attention); fa3_build.sh leaves it out when FA3_FULL=1.
#include <stdexcept>

#include <cutlass/numeric_types.h>

#include "flash.h"

#define FA3_KIT_STUB(DV, SPLIT, PAGED, PACKGQA)                                                                     \
    template <>                                                                                                     \
    void run_mha_fwd_<90, cutlass::bfloat16_t, 64, DV, SPLIT, PAGED, false, PACKGQA>(Flash_fwd_params &,            \
                                                                                     cudaStream_t) {                \
        throw std::runtime_error("FA3 kit: head dim 64 with value dim " #DV " is not built (MLA decode kit: 64/512 " \
                                 "only; FA3_FULL=1 bash fa3_build.sh builds it)");                                 \
    }
#define FA3_KIT_STUBS(DV)                       \
    FA3_KIT_STUB(DV, false, false, false)       \
    FA3_KIT_STUB(DV, false, false, true)        \
    FA3_KIT_STUB(DV, false, true, true)         \
    FA3_KIT_STUB(DV, true, false, true)         \
    FA3_KIT_STUB(DV, true, true, true)
FA3_KIT_STUBS(64)
FA3_KIT_STUBS(256)
EOF

{
    echo "FA3 MLA decode kit: flash-attention $FA_COMMIT (hopper/), CUTLASS $CUTLASS_COMMIT (its csrc/cutlass pin)"
    echo "flash-attention/: Dao-AILab/flash-attention at $FA_COMMIT, files unchanged, BSD-3-Clause (LICENSE);"
    echo "  $(git -C "$FA_GIT" log -1 --format='%ci %s' "$FA_COMMIT")"
    echo "cutlass/: NVIDIA/cutlass at $CUTLASS_COMMIT, include/ and LICENSE.txt unchanged, BSD-3-Clause;"
    echo "  $(git -C "$CUTLASS_GIT" log -1 --format='%ci %s' "$CUTLASS_COMMIT")"
    echo "fa3_kit_stubs.cu: written by bench/fa3_kit.sh: raising stand-ins for the 64/64 and 64/256 kernels."
    echo "Instantiations in the kit (fa3_build.sh compiles the 64_512 ones; all with FA3_FULL=1):"
    printf '  %s\n' "${INSTANTIATIONS[@]}"
} > "$WORK/fa3/KIT.txt"

mkdir -p "$(dirname "$DEST")"
tar -C "$WORK" -cf - fa3 | xz -T0 -9 > "$DEST"
head -1 "$WORK/fa3/KIT.txt"
ls -l "$DEST"

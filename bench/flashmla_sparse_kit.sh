#!/usr/bin/env bash
# FlashMLA's sm90 sparse MLA decode (DeepSeek-V3.2: top-k indices over the 656-byte fp8 cache; what vLLM's
# FLASHMLA_SPARSE and SGLang's nsa backends call on Hopper) as a source kit for a GPU machine without network:
# bench/flashmla_sparse_build.sh builds it there, bench/sparse_peers.py calls it.
#
#   bash bench/flashmla_sparse_kit.sh DEST_TARBALL     # e.g. .peers/flashmla_sparse_kit.tar.xz (.peers/ is git-ignored)
#
# Run where git snapshots of the two repositories are at hand (the fetch tool's mirrors of github:deepseek-ai/FlashMLA
# and github:NVIDIA/cutlass); nothing is compiled here. FLASHMLA_GIT and CUTLASS_GIT name their git directories. The
# kit holds, unchanged:
# - FlashMLA at FLASHMLA_COMMIT (MIT, LICENSE): flash_mla/ (its Python interface), and of csrc/ what the sparse decode
#   path includes: api/common.h and api/sparse_decode.h (the interface function, unchanged), defines.h, params.h,
#   utils.h, kerutils/, sm90/helpers.h, sm90/decode/sparse_fp8/ (the kernel and its four instantiations: V3.2 and
#   MODEL1 layouts, 64 and 128 heads), smxx/ (the scheduling-metadata and combine kernels), and the two sm100
#   headers sparse_decode.h includes (declarations only);
# - CUTLASS at FlashMLA's submodule pin (csrc/cutlass at FLASHMLA_COMMIT): include/ and LICENSE.txt (BSD-3-Clause);
# and, written here (not FlashMLA's code):
# - csrc/api/sparse_decode_binding.cpp: binds sparse_decode_fwd alone, as FlashMLA's api.cpp binds it;
# - csrc/sparse_kit_stubs.cpp: raising stand-ins for the three sm100 kernels sparse_decode.h's dispatch names (an
#   sm_90a build never reaches them; the .so then links without compiling sm100 code);
# - KIT.txt: where each part comes from.
set -euo pipefail
DEST=$(realpath -m "${1:?usage: flashmla_sparse_kit.sh DEST_TARBALL}")
FLASHMLA_GIT=${FLASHMLA_GIT:-/work/.mirror/deepseek-ai+FlashMLA/repo}
CUTLASS_GIT=${CUTLASS_GIT:-/work/.mirror/NVIDIA+cutlass/repo}
FLASHMLA_COMMIT=9241ae3ef9bac614dd25e45e507e089f888280e0  # "Swap FlashMLA combine grid dimensions (#182)"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

source "$(dirname "$0")/kit_extract.sh"  # pinned_cutlass, extract
CUTLASS_COMMIT=$(pinned_cutlass "$FLASHMLA_GIT" "$FLASHMLA_COMMIT" "$CUTLASS_GIT")  # the submodule's pinned commit

KIT="$WORK/flashmla_sparse"
extract "$FLASHMLA_GIT" "$FLASHMLA_COMMIT" "$KIT" LICENSE flash_mla \
    csrc/api/common.h csrc/api/sparse_decode.h csrc/defines.h csrc/params.h csrc/utils.h csrc/kerutils \
    csrc/sm90/helpers.h csrc/sm90/decode/sparse_fp8 csrc/smxx \
    csrc/sm100/decode/head64/kernel.h csrc/sm100/prefill/sparse/fwd_for_small_topk/head128/phase1.h
extract "$CUTLASS_GIT" "$CUTLASS_COMMIT" "$KIT/csrc/cutlass" include LICENSE.txt

cat > "$KIT/csrc/api/sparse_decode_binding.cpp" <<'EOF'
// FlashMLA's sparse MLA decode alone, as the extension `flash_mla.cuda` that flash_mla/flash_mla_interface.py
// imports: flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=...) calls
//   sparse_decode_fwd(q, k_cache, indices, topk_length, attn_sink, tile_scheduler_metadata, num_splits,
//                     extra_k_cache, extra_indices, extra_topk_length, head_dim_v, softmax_scale)
//     -> (out, lse, tile_scheduler_metadata, num_splits)
// (csrc/api/sparse_decode.h, unchanged), bound under the name FlashMLA's csrc/api/api.cpp gives it. The interface
// names the dense and prefill functions only inside the bodies of the other paths, so they may be absent.
// Written by bench/flashmla_sparse_kit.sh (not part of FlashMLA).
#include <pybind11/pybind11.h>

#include "api/sparse_decode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "FlashMLA sm90 sparse decode (fp8 656-byte cache), sparse_decode_fwd as bound by csrc/api/api.cpp";
    m.def("sparse_decode_fwd", &sparse_attn_decode_interface);
}
EOF

cat > "$KIT/csrc/sparse_kit_stubs.cpp" <<'EOF'
// Stand-ins for the sm100 kernels that sparse_decode.h's dispatch names (Decode_Sm100_*_Impl): a build for sm_90a
// alone never reaches them, but the binding references them. Each raises if it is ever reached.
// Written by bench/flashmla_sparse_kit.sh (not part of FlashMLA).
#include <stdexcept>

#include "params.h"
#include "sm100/decode/head64/kernel.h"
#include "sm100/prefill/sparse/fwd_for_small_topk/head128/phase1.h"

namespace {
[[noreturn]] void not_built() {
    throw std::runtime_error("FlashMLA sparse kit: sm100 kernels are not built (sm_90a only)");
}
}  // namespace

namespace sm100::decode::head64 {
template <>
void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::V32>(const SparseAttnDecodeParams &) { not_built(); }
template <>
void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::MODEL1>(const SparseAttnDecodeParams &) { not_built(); }
}  // namespace sm100::decode::head64

namespace sm100::fwd_for_small_topk::head128 {
template <>
void run_fwd_for_small_topk_phase1_kernel<SparseAttnFwdMode::DecodeWithSplitKV, 512>(
    const SparseFwdArgT<SparseAttnFwdMode::DecodeWithSplitKV> &) { not_built(); }
}  // namespace sm100::fwd_for_small_topk::head128
EOF

{
    echo "FlashMLA sm90 sparse decode kit: FlashMLA $FLASHMLA_COMMIT, CUTLASS $CUTLASS_COMMIT (its csrc/cutlass pin)"
    echo "FlashMLA: deepseek-ai/FlashMLA at $FLASHMLA_COMMIT, files unchanged, MIT (LICENSE);"
    echo "  $(git -C "$FLASHMLA_GIT" log -1 --format='%ci %s' "$FLASHMLA_COMMIT")"
    echo "csrc/cutlass/: NVIDIA/cutlass at $CUTLASS_COMMIT, include/ and LICENSE.txt unchanged, BSD-3-Clause;"
    echo "  $(git -C "$CUTLASS_GIT" log -1 --format='%ci %s' "$CUTLASS_COMMIT")"
    echo "csrc/api/sparse_decode_binding.cpp, csrc/sparse_kit_stubs.cpp: written by bench/flashmla_sparse_kit.sh"
    echo "  (sparse_decode_fwd bound alone; raising stand-ins for the sm100 kernels)."
} > "$KIT/KIT.txt"

mkdir -p "$(dirname "$DEST")"
tar -C "$WORK" -cf - flashmla_sparse | xz -T0 -9 > "$DEST"
head -1 "$KIT/KIT.txt"
ls -l "$DEST"

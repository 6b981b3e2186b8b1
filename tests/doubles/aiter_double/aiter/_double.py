"""The machinery of the aiter test double: contract checks, work plans, the mathematics.

Everything runs with torch on the tensors' own device (the tests use the CPU), in float32 like the
GPU kernels. The double is strict in two ways:
- it CHECKS what the real library checks or silently relies on (argument kinds, dtypes, shapes,
  buffers allocated as get_mla_metadata_info_v1 described them, scales for fp8 tensors on Q's
  device, a contiguous Q, a plan reached through work_meta_data's pointers) and raises TypeError /
  ContractError where aiter would raise, crash or read out of bounds;
- it COMPUTES from what it is given, like the kernels: stage 1 follows the work plan written by
  get_mla_metadata_v1 (page ranges, partial rows), the reduce follows the reduce maps. A caller
  that passes a stale plan, the wrong page maths or the wrong buffers gets wrong numbers.

Sizes are those of the runner: NUM_CU is the MI355X's 256 compute units, which aiter's
get_mla_metadata_info_v1 sizes the plan buffers by and the plans split the KV over.

The plan format follows aiter's fields (aiter documents them; their packing is the double's own):
- work_metadata (2,) uint64: the addresses of work_indptr and work_info_set. The persistent
  kernel finds the plan through these pointers, not through its work_indptr / work_info_set
  arguments, so stage 1 refuses a work_meta_data that points elsewhere (the kernel would read
  another plan, or garbage);
- work_indptr (NUM_CU + 1,) int32: the work items of each CU;
- work_info_set (rows, 8) int32, one row per work item: [batch, partial row (-1: the item writes
  the final output itself), q_start, q_end, kv_start, kv_end (positions in kv_page_indices, in
  pages), kv_offset (pages after kv_end in the batch), 0];
- reduce_indptr (tiles + 1,), reduce_final_map (tiles, 2) = (q_start, q_end) per output tile,
  reduce_partial_map: partial rows. A tile whose range holds at most one entry is skipped by the
  reduce, as aiter's reduce does: stage 1 wrote that output itself.

Two ways of planning, as aiter at f3be04a12 (csrc/kernels/mla/metadata.cu) picks them:
- fast_mode=True ("v1_2"): the KV of all batches, in granules of kv_granularity pages, cut into
  min(NUM_CU, max_split_per_batch * batch) near-equal pieces, one per CU, split again at batch
  ends; at most batch + NUM_CU - 1 work items;
- fast_mode=False, intra_batch_mode=True ("v1_0", the runner's reference): each batch on its own
  into min(length // 196, ceil(NUM_CU / batch), max_split_per_batch) pieces (gfx950's rule). A
  batch shorter than 196 gets 0 pieces, and aiter divides by zero: the double refuses it.

Kernels: stage 1 (and mla_decode_fwd) first pick an assembly kernel as aiter f3be04a12 does on
gfx950 (csrc/py_itfs_cu/asm_mla.cu, hsa/gfx950/mla/mla_asm.csv): from Q's and the KV's dtypes,
the heads per KV head, persistent or not, and the q length after aiter's padding (bf16 q with fp8
KV, persistent: a q length <= 4 is padded to 4). A combination the table lacks is refused with
aiter's "cannot get heuristic kernel" (bf16 q over fp8 KV without a plan, fp8 q over bf16 KV,
bf16 q over a byte-packed cache); a packed fp4x2 cache fails aiter's head-size check first. Only
decode (q length 1) is computed: the persistent mode at 16 heads (fp8 q over fp8 KV: the head
counts of FEATURES["persistent_table"]), the non-persistent
mla_decode_fwd at every head count the generation's kernel table serves (FEATURES["kernel_table"]:
16 and 128 at f3be04a12 for fp8 q, 16 / 32 / 64 / 128 for bf16; from e4048607a's table also 8 for
both, and 64 bf16 through its q-length-1 kernel; lab/NOTES.md h37a).

Later generations (aiter/_api.py sets FEATURES at import, see configure) keep these kernels for
the rows the routes use (16 heads, q length 1; read at e4048607a, 2026-08-22) and differ below the
API in the ways the double models: how get_mla_metadata_info_v1 grows reduce_partial_map by
max_split_per_batch, what a non-None `lse` does to stage 1's kernel choice, which lse the
non-persistent mla_decode_fwd returns (FEATURES["decode_lse"]), and which head counts the
persistent fp8 path plans and runs for q length 1 (FEATURES["persistent_table"]: from ff61bb3997
also 64 and 128 heads, from c2f68ab382 32; the head remap onto other kernels is asm_mla.cu's, by
head count and q length; lab/NOTES.md h47). Every lse is a natural log.

The non-persistent mla_decode_fwd (decode_fwd) runs as aiter does at q length 1: aiter's own split
count where the caller passes none (meta_param: aiter/mla.py's get_meta_param over the CU count and
kv_indices' length), stage 1's partials, then the one-split shortcut or aiter's Triton stage 2,
whose copy-only branch (one split, 64 / 128 heads) writes o and no lse. Memory aiter allocates and
no kernel writes is NaN, so that a caller reading it fails.

Page mode (AITER_DOUBLE_PAGE_MODE, or set_page_mode): "exact" (default) reads every row of every
page. "first_token" behaves like the suspected fp8 persistent kernel for q length 1 (runner.md
section 5): with page_size > 1 it reads only the first row of each page.
"""
import collections
import itertools
import math
import os

import torch

CALLS = collections.Counter()  # calls per API function (tests read it to prove plan reuse)
LOG = []  # (function, dict of facts) per call: page sizes, split counts, generations
NUM_CU = 256  # the MI355X (gfx950)
WORK_FIELDS = 8
NUM_HEADS = 16
QK_HEAD_DIM = 576
V_HEAD_DIM = 512
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
INTRA_BATCH_ROWS_PER_SPLIT = 196  # gfx950's v1_0 plan: at most length // 196 splits per batch
PAGE_MODES = ("exact", "first_token")

# What the generation does below its API (configure() sets it; _api calls that at import):
# - "info_split_cap": how get_mla_metadata_info_v1 grows reduce_partial_map when given
#   max_split_per_batch > 0, cap = min(NUM_CU, max_split_per_batch * batch): "product" to
#   tile_cnt * cap (ff61bb3997, 2026-06-11), "sum" to tile_cnt + cap (b5fceae834, 2026-06-22 on);
# - "lse": what a non-None `lse` does to stage 1. "unwritten": aiter hands its address to the
#   kernel, and no 16-head q-length-1 kernel writes it (a235c4aa3a, 2026-03-16): refused, the
#   tensor would keep garbage; "variant": aiter looks the kernel up with lse = 1 (ce27de0132,
#   2026-03-26 on): the kernels of LSE_VARIANTS have such a build, any other is refused with
#   aiter's "cannot get heuristic kernel".
# - "decode_lse": what mla_decode_fwd's NON-persistent mode returns as its lse when its own
#   Triton stage 2 merges the splits (every call but fp8 q with one split). "unwritten": the
#   tensor is allocated and never written (f3be04a12's aiter/mla.py: final_lse = torch.empty,
#   returned as is); "written": with return_lse=True stage 2 writes the merged natural-log lse
#   (HAS_FINAL_LSE, c849fd5845, 2026-04-16 on), without it None; not in stage 2's copy-only
#   branch (one split at a head count other than 16, or 8 and 16 later: aiter/mla.py's FINAL_OUT),
#   which writes no lse on any generation. Either way, fp8 q with one split returns stage 1's own
#   lse tensor (total_q, 1, heads, 1) (aiter returns attn_lse there).
# - "kernel_table": the non-persistent decode kernels (mla_asm.csv and asm_mla.cu's branches) and
#   mla_decode_fwd's one-split shortcut. "f3be04a12": fp8 q at 16 / 128 heads (32: aiter's
#   "decode_qlen=4 in persistent mode" check; 8, 64: no kernel), bf16 at 16 / 32 / 64 / 128, and
#   bf16 at 32 / 64 heads with one split returns stage 1's float32 partial as the output and
#   attn_lse (o is not aiter's result there). "e4048607a" (the q-length-1 rows from c849fd5845,
#   2026-04-16, bf16 64 heads, and 78dad4ca34, 2026-05-06, fp8 8 heads): adds fp8 and bf16 8
#   heads and the bf16 64-head q-length-1 kernel; fp8 at 32 heads finds no non-persistent kernel,
#   at 64 heads aiter refuses ("only supports persistent mode"); the bf16 shortcut is 8 / 32
#   heads with one split, o written, and final_lse returned with return_lse (no non-persistent
#   kernel has an lse build: unwritten).
# - "persistent_table": the persistent fp8 q-length-1 decode beyond 16 heads, three places read at
#   the commit named: the kernel asm_mla.cu picks after its head remap (PERSISTENT_FP8_Q1), the
#   head counts get_mla_metadata_v1 plans without folding them into 16-head batches
#   (natively_supported in csrc/kernels/mla/metadata/v1_2_device.cuh: PLANNED_FP8_HEADS), and
#   get_mla_metadata_info_v1's tile count. "f3be04a12": 16 and 128 heads (mla_a8w8_qh128_m32x4_
#   n16x2_msk0_ps), its own sizes; "ff61bb3997" (2026-06-11): 16, 64 (mla_a8w8_qh64_qseqlen1_
#   gqaratio64_v3_ps), 128 (remapped onto the 32-head q-length-4 kernel), 32 refused by aiter;
#   "c2f68ab382" (2026-06-26; the 32-head q-length-1 kernel came 9d0d5e7c77, 2026-06-22): also 32;
#   "45ef304fe5" (2026-08-10 .. e4048607a): 64 remapped onto the 16-head q-length-4 kernel.
FEATURE_VALUES = {"info_split_cap": ("product", "sum"), "lse": ("unwritten", "variant"),
                  "decode_lse": ("unwritten", "written"),
                  "kernel_table": ("f3be04a12", "e4048607a"),
                  "persistent_table": ("f3be04a12", "ff61bb3997", "c2f68ab382", "45ef304fe5")}
FEATURES = {"info_split_cap": "product", "lse": "variant", "decode_lse": "unwritten",
            "kernel_table": "f3be04a12", "persistent_table": "f3be04a12"}


def configure(**features):
    """Set FEATURES (names and values of FEATURE_VALUES) for this import of the double."""
    for name, value in features.items():
        if value not in FEATURE_VALUES.get(name, ()):
            raise ValueError(f"aiter double: feature {name}={value!r} is not one of "
                             f"{FEATURE_VALUES.get(name)}")
    FEATURES.update(features)


class ContractError(RuntimeError):
    """A call the real aiter would reject (or crash on / read out of bounds with)."""


def _page_mode_from_environment():
    mode = os.environ.get("AITER_DOUBLE_PAGE_MODE") or "exact"
    if mode not in PAGE_MODES:
        raise ImportError(f"aiter double: AITER_DOUBLE_PAGE_MODE must be one of {PAGE_MODES}, "
                          f"got {mode!r}")
    return mode


_page_mode = _page_mode_from_environment()


def set_page_mode(mode):
    """"exact" or "first_token" (see the module docstring); returns the previous mode."""
    global _page_mode
    if mode not in PAGE_MODES:
        raise ValueError(f"page mode must be one of {PAGE_MODES}, got {mode!r}")
    previous, _page_mode = _page_mode, mode
    return previous


def page_mode():
    return _page_mode


def reset():
    CALLS.clear()
    LOG.clear()


def expect(condition, message):
    if not condition:
        raise ContractError(message)


# ---------------------------------------------------------------------------------------------
# Argument checks


def need_tensor(fn, name, x, dtype=None, shape=None, ndim=None, optional=False):
    """Check one tensor argument. Returns False for an allowed None."""
    if x is None and optional:
        return False
    if not isinstance(x, torch.Tensor):
        kind = "Optional[torch.Tensor]" if optional else "torch.Tensor"
        raise TypeError(f"{fn}: '{name}' expects {kind}, got {type(x).__name__}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        expect(x.dtype in allowed, f"{fn}: '{name}' has dtype {x.dtype}, expected one of {allowed}")
    if ndim is not None:
        expect(x.dim() == ndim,
               f"{fn}: '{name}' has {x.dim()} dims {tuple(x.shape)}, expected {ndim}")
    if shape is not None:
        expect(tuple(x.shape) == tuple(shape),
               f"{fn}: '{name}' has shape {tuple(x.shape)}, expected {tuple(shape)}")
    return True


def need_int(fn, name, value, minimum=None):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{fn}: '{name}' expects int, got {type(value).__name__}")
    if minimum is not None:
        expect(value >= minimum, f"{fn}: '{name}' = {value}, expected >= {minimum}")


def need_float(fn, name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{fn}: '{name}' expects float, got {type(value).__name__}")


def need_bool(fn, name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{fn}: '{name}' expects bool, got {type(value).__name__}")


def need_power_of_two(fn, name, value):
    need_int(fn, name, value, 1)
    expect(value & (value - 1) == 0, f"{fn}: {name} must be a power of 2, got {value}")


def need_scale(fn, name, scale, data_name, data, device):
    """fp8 data needs a float32 per-tensor scale of one element on the kernel's device (the
    kernel reads it through its address; without one aiter leaves that address unset, also for
    fp8 KV under bf16 Q); bf16 data takes none (a scale given is not read)."""
    if data.dtype in FP8_DTYPES:
        expect(scale is not None, f"{fn}: fp8 '{data_name}' needs '{name}' (float32, 1 element): "
                                  "the kernel reads it through an address aiter leaves unset")
        need_tensor(fn, name, scale, dtype=torch.float32)
        expect(scale.numel() == 1, f"{fn}: '{name}' must hold 1 element, has {scale.numel()}")
    elif not need_tensor(fn, name, scale, optional=True):
        return
    expect(scale.device == device,
           f"{fn}: '{name}' is on {scale.device} but Q is on {device}: the kernel would read a "
           "foreign address")


def dequantize(data, scale):
    x = data.float()
    return x * scale.float().reshape(()) if data.dtype in FP8_DTYPES else x


# aiter f3be04a12's gfx950 decode kernels (hsa/gfx950/mla/mla_asm.csv, rows with prefill 0 and
# causal 0): (q type, KV type, heads per KV head, persistent, padded q length; 0 = any) -> name.
GFX950_DECODE_KERNELS = {
    ("bf16", "bf16", 128, 0, 0): "mla_dec_stage1_bf16_a16w16_subQ128_mqa128",
    ("bf16", "bf16", 16, 1, 4): "mla_a16w16_qh16_m16x4_n16x1_coex0_mask1_ps",
    ("bf16", "bf16", 16, 0, 1): "mla_dec_stage1_bf16_a16w16_subQ16_mqa16",
    ("bf16", "bf16", 16, 0, 4): "mla_a16w16_qh16_m16x4_n16x1_coex0_mask1",
    ("bf16", "bf16", 16, 0, 8): "mla_a16w16_qh16_m32x4_n16x1_coex0_mask1",
    ("bf16", "fp8", 16, 1, 4): "mla_a16w8_qh16_m16x4_n16x1_coex0_mask1_ps",
    ("fp8", "fp8", 16, 1, 1): "mla_a8w8_qh16_qseqlen1_gqaratio16_ps",
    ("fp8", "fp8", 16, 1, 2): "mla_a8w8_qh16_qseqlen2_gqaratio16_ps",
    ("fp8", "fp8", 16, 1, 4): "mla_a8w8_qh64_qseqlen4_gqaratio16_ps",
    ("fp8", "fp8", 16, 0, 1): "mla_a8w8_qh16_qseqlen1_gqaratio16",
    ("fp8", "fp8", 16, 0, 2): "mla_a8w8_qh16_qseqlen2_gqaratio16",
    ("fp8", "fp8", 16, 0, 4): "mla_a8w8_qh64_qseqlen4_gqaratio16",
    ("fp8", "fp8", 32, 1, 4): "mla_a8w8_qh32_qseqlen4_gqaratio32_ps",
    ("fp8", "fp8", 128, 0, 0): "mla_a8w8_qh128_m32x4_n16x2_msk1",
    ("fp8", "fp8", 128, 1, 0): "mla_a8w8_qh128_m32x4_n16x2_msk0_ps",
    ("bf16", "bf16", 32, 0, 0): "mla_a16w16_qh16_m32x1_n16x1_coex0_mask1",
    ("bf16", "bf16", 64, 0, 0): "mla_a16w16_qh16_m64x1_n16x1_coex0_mask1",
}
# e4048607a's table, for the keys the double reads (q-length-1 decode; its causal column is 1
# there: asm_mla.cu looks q length 1 up as causal). The bf16 32-head non-persistent kernel was
# rebuilt under a new name (mla_a16w16_qh16_m16x4_n32x1_coex0_mask1).
LATER_DECODE_KERNELS = dict(GFX950_DECODE_KERNELS)
LATER_DECODE_KERNELS.update({
    ("bf16", "bf16", 32, 0, 0): "mla_a16w16_qh16_m16x4_n32x1_coex0_mask1",
    ("bf16", "bf16", 64, 0, 1): "mla_a16w16_qh64_qseqlen1_gqaratio64_v3",
    ("bf16", "bf16", 8, 0, 1): "mla_a16w16_qh8_qseqlen1_gqaratio8_v3",
    ("fp8", "fp8", 8, 0, 1): "mla_a8w8_qh8_qseqlen1_gqaratio8_v3",
})
A16W8_KERNEL = GFX950_DECODE_KERNELS[("bf16", "fp8", 16, 1, 4)]
A8W8_Q1_KERNEL = GFX950_DECODE_KERNELS[("fp8", "fp8", 16, 1, 1)]
KERNEL_KEYS = {name: key for key, name in GFX950_DECODE_KERNELS.items()}
# The 16-head persistent kernels with an lse build on gfx950 (mla_asm.csv's lse column: fp8 from
# ce27de0132, 2026-03-26; bf16 from b16ca5af25, 2026-05-29; still so at e4048607a). The a16w8
# kernel has none.
LSE_VARIANTS = {
    A8W8_Q1_KERNEL: "mla_a8w8_qh16_qseqlen1_gqaratio16_lse_ps",
    GFX950_DECODE_KERNELS[("bf16", "bf16", 16, 1, 4)]:
        "mla_a16w16_qh16_m16x4_n16x1_coex0_mask1_lse_ps",
}
# aiter's persistent fp8 decode for q length 1 beyond f3be04a12 (FEATURES["persistent_table"]):
# heads -> (kernel, the (gqa, q length) asm_mla.cu looks it up with after its remap, the kernel
# of its lse build), or aiter's refusal text. From csrc/py_itfs_cu/asm_mla.cu's gqa_ratio branches
# and its gfx950 remap (s_MQA = the real head count), and hsa/gfx950/mla/mla_asm.csv's rows with
# ps 1 and lse 0 / 1, at ff61bb3997, c2f68ab382 and 45ef304fe5 (= e4048607a there). Another head
# count finds no row: "cannot get heuristic kernel".
_G16_Q1 = ("mla_a8w8_qh16_qseqlen1_gqaratio16_ps", 16, 1, "mla_a8w8_qh16_qseqlen1_gqaratio16_lse_ps")
_G32_Q1 = ("mla_a8w8_qh32_qseqlen1_gqaratio32_ps", 32, 1, "mla_a8w8_qh32_qseqlen1_gqaratio32_lse_ps")
_G64_Q1 = ("mla_a8w8_qh64_qseqlen1_gqaratio64_v3_ps", 64, 1,
           "mla_a8w8_qh64_qseqlen1_gqaratio64_lse_v3_ps")
_G16_Q4 = ("mla_a8w8_qh16_qseqlen4_gqaratio16_v3_ps", 16, 4,
           "mla_a8w8_qh16_qseqlen4_gqaratio16_lse_v3_ps")
_G32_Q4 = ("mla_a8w8_qh32_qseqlen4_gqaratio32_ps", 32, 4, "mla_a8w8_qh32_qseqlen4_gqaratio32_lse_ps")
_NO_32_Q1 = "fp8/fp8 with gqa_ratio=32 only supports decode_qlen=2,4 in persistent mode"
PERSISTENT_FP8_Q1 = {
    "ff61bb3997": {16: _G16_Q1, 32: _NO_32_Q1, 64: _G64_Q1, 128: _G32_Q4},
    "c2f68ab382": {16: _G16_Q1, 32: _G32_Q1, 64: _G64_Q1, 128: _G32_Q4},
    "45ef304fe5": {16: _G16_Q1, 32: _G32_Q1, 64: _G16_Q4, 128: _G32_Q4},
}
for _table in PERSISTENT_FP8_Q1.values():
    for _row in _table.values():
        if isinstance(_row, tuple):
            LSE_VARIANTS[_row[0]] = _row[3]
            KERNEL_KEYS.setdefault(_row[0], ("fp8", "fp8", _row[1], 1, _row[2]))
# The head counts get_mla_metadata_v1 plans as they are for fp8 q over fp8 KV at q length 1
# (v1_2_device.cuh's natively_supported, gfx950); any pair plans 16. Other multiples of 16 aiter
# folds into 16-head batches (qk_batch_ratio): not modelled, refused.
PLANNED_FP8_HEADS = {"f3be04a12": (16, 128), "ff61bb3997": (16, 64, 128),
                     "c2f68ab382": (16, 32, 64, 128), "45ef304fe5": (16, 32, 64, 128)}
# mla_reduce_v1's head counts for 512-wide values that every generation read builds
# (csrc/kernels/mla/reduce.cu's MLA_REDUCE_ROUTER: these four at f3be04a12; more later)
REDUCE_HEADS = (16, 32, 64, 128)
BYTE_DTYPES = (torch.uint8, torch.int8)  # aiter's "byte" KV (a packed cache)
# aiter's dtype ids (csrc/include/aiter_enum.h's AiterDtype order), as the compiled metadata op
# behind the Python get_mla_metadata_v1 takes them (028756633e on). aiter maps only its own
# dtypes.fp8 to the fp8 id: float8_e4m3fn on gfx950.
AITER_DTYPE_IDS = {
    torch.float8_e4m3fn: 0, torch.float8_e8m0fnu: 1, torch.float16: 2, torch.bfloat16: 3,
    torch.float32: 4, torch.float4_e2m1fn_x2: 6, torch.uint32: 7, torch.int32: 8,
    torch.int16: 9, torch.int8: 10, torch.uint8: 11, torch.int64: 12, torch.uint64: 13,
}
DTYPES_BY_ID = {number: dtype for dtype, number in AITER_DTYPE_IDS.items()}


def aiter_dtype_id(dtype):
    """aiter's _aiter_dtype_id: a torch dtype's id, AssertionError for any other value."""
    try:
        return AITER_DTYPE_IDS[dtype]
    except (KeyError, TypeError):
        raise AssertionError(f"Unsupported dtype: {dtype}") from None


def _asm_type(fn, name, dtype, allowed):
    """aiter's name for a dtype ("bf16", "fp8", "byte"), or its "unsupport ... dtype" refusal."""
    kinds = {"bf16": (torch.bfloat16,), "fp8": FP8_DTYPES, "byte": BYTE_DTYPES}
    for kind in allowed:
        if dtype in kinds[kind]:
            return kind
    raise ContractError(f"{fn}: unsupport {name} dtype: {dtype}")


def _padded_q_length(fn, q_type, kv_type, gqa, persistent, max_seqlen_q):
    """The q length aiter looks the kernel up with (asm_mla.cu's padding rules)."""
    if gqa == 128:
        return 0
    if FEATURES["kernel_table"] == "e4048607a" and gqa in (32, 64) and q_type == kv_type == "fp8":
        expect(gqa == 32 or persistent,
               f"{fn}: fp8/fp8 with gqa_ratio=64 only supports persistent mode")
        if gqa == 32 and max_seqlen_q == 1:
            return 1  # no non-persistent 32-head row: "cannot get heuristic kernel"
    if FEATURES["kernel_table"] == "e4048607a" and gqa == 64 and q_type == kv_type == "bf16":
        if not persistent:
            return 1 if max_seqlen_q == 1 else 0
    if gqa == 16:
        if q_type == "fp8":
            expect(max_seqlen_q <= 4, f"{fn}: only support fp8 mla decoding for qo_len <= 4")
            return max_seqlen_q if max_seqlen_q <= 2 else 4
        if kv_type == "bf16" and not persistent:
            return 1 if max_seqlen_q == 1 else 4 if max_seqlen_q <= 4 else 8
        return 4 if persistent and max_seqlen_q <= 4 else max_seqlen_q
    if gqa == 32 and q_type == "fp8" and kv_type == "fp8":
        expect(persistent and max_seqlen_q == 4,
               f"{fn}: fp8/fp8 with gqa_ratio=32 only supports decode_qlen=4 in persistent mode")
        return 4
    if gqa in (32, 64) and q_type == kv_type == "bf16" and not persistent:
        return 0
    return max_seqlen_q


def persistent_fp8_q1_kernel(fn, gqa):
    """The persistent fp8 q-length-1 kernel FEATURES["persistent_table"] names for gqa heads per
    KV head (a table after f3be04a12), or aiter's refusal. causal in the message: asm_mla.cu looks
    q length 1 up as causal from 45ef304fe5 on, with 0 before."""
    table = FEATURES["persistent_table"]
    row = PERSISTENT_FP8_Q1[table].get(gqa)
    expect(not isinstance(row, str), f"{fn}: {row}")
    expect(row is not None,
           f"{fn}: get_heuristic_kernel_mla: cannot get heuristic kernel! q_type:fp8 kv_type:fp8 "
           f"gqa:{gqa} ps:1 prefill:0 causal:{int(table == '45ef304fe5')} qseqlen:1")
    return row[0]


def asm_decode_kernel(fn, q_dtype, kv_dtype, gqa, persistent, max_seqlen_q):
    """The kernel aiter f3be04a12 runs on gfx950 for this call, or its refusal (ContractError,
    a RuntimeError as aiter's TORCH_CHECK raises); the persistent fp8 decode of later generations
    from their table (persistent_fp8_q1_kernel)."""
    q_type = _asm_type(fn, "Q", q_dtype, ("bf16", "fp8"))
    kv_type = _asm_type(fn, "KV", kv_dtype, ("bf16", "fp8", "byte"))
    if (persistent and q_type == kv_type == "fp8" and max_seqlen_q == 1
            and FEATURES["persistent_table"] != "f3be04a12"):
        return persistent_fp8_q1_kernel(fn, gqa)
    ps = int(persistent)
    if gqa == 128 and q_type == kv_type == "bf16":
        ps = 0  # aiter runs its non-persistent kernel there
    q_len = _padded_q_length(fn, q_type, kv_type, gqa, persistent, max_seqlen_q)
    later = FEATURES["kernel_table"] == "e4048607a"
    name = (LATER_DECODE_KERNELS if later else GFX950_DECODE_KERNELS).get(
        (q_type, kv_type, gqa, ps, q_len))
    causal = int(later and max_seqlen_q == 1)
    expect(name is not None,
           f"{fn}: get_heuristic_kernel_mla: cannot get heuristic kernel! q_type:{q_type} "
           f"kv_type:{kv_type} gqa:{gqa} ps:{ps} prefill:0 causal:{causal} qseqlen:{q_len}")
    return name


def check_q_kv(fn, q, kv, page_size, nhead_kv, persistent, max_seqlen_q):
    """aiter's own checks, in its order (a contiguous Q, one KV head, the head size unless the
    KV is byte-packed, a kernel for the dtypes and q length); then what the double models: q
    (total_q, heads, 576) (persistent: any head count with a kernel for fp8 q over fp8 KV, else
    16), kv (num_pages, page_size, 1, 576). Returns the kernel's name."""
    need_tensor(fn, "Q", q, ndim=3)
    expect(q.is_contiguous(), f"{fn}: only support Q.is_contiguous() (aiter's own check)")
    need_tensor(fn, "KV", kv, ndim=4)
    need_int(fn, "nhead_kv", nhead_kv, 1)
    expect(nhead_kv == 1, f"{fn}: only support num_kv_heads==1 (aiter's own check)")
    need_int(fn, "max_seqlen_q", max_seqlen_q, 1)
    expect(kv.dtype in BYTE_DTYPES or kv.shape[3] == q.shape[2],
           f"{fn}: only support head_size == KV.size(3) (Q has {q.shape[2]}, KV {kv.shape[3]}; "
           "aiter's own check)")
    kernel = asm_decode_kernel(fn, q.dtype, kv.dtype, q.shape[1] // nhead_kv, persistent,
                               max_seqlen_q)
    fp8_pair = q.dtype in FP8_DTYPES and kv.dtype in FP8_DTYPES
    heads = NUM_HEADS if persistent and not fp8_pair else q.shape[1]
    expect(tuple(q.shape[1:]) == (heads, QK_HEAD_DIM),
           f"{fn}: 'Q' has shape {tuple(q.shape)}, expected (total_q, {heads}, {QK_HEAD_DIM})")
    expect(max_seqlen_q == 1, f"{fn}: the double models decode (max_seqlen_q 1) only")
    need_int(fn, "page_size", page_size, 1)
    expect(tuple(kv.shape[1:]) == (page_size, nhead_kv, QK_HEAD_DIM),
           f"{fn}: 'KV' has shape {tuple(kv.shape)}, expected (num_pages, page_size={page_size}, "
           f"{nhead_kv}, {QK_HEAD_DIM})")
    return kernel


def check_page_table(fn, batch, kv_indptr, kv_page_indices, kv_last_page_lens, num_pages,
                     page_size):
    """Returns (page indptr list, last-page lengths list or None). With page_size 1 every page
    is one row whatever kv_last_page_lens holds (the runner's reference passes the batch lengths
    there), so the lengths are read only for page_size > 1."""
    need_tensor(fn, "kv_indptr", kv_indptr, dtype=torch.int32, shape=(batch + 1,))
    need_tensor(fn, "kv_page_indices", kv_page_indices, dtype=torch.int32, ndim=1)
    need_tensor(fn, "kv_last_page_lens", kv_last_page_lens, dtype=torch.int32, shape=(batch,))
    pages = kv_indptr.tolist()
    expect(pages[0] == 0 and all(a <= b for a, b in itertools.pairwise(pages)),
           f"{fn}: kv_indptr is not a prefix sum starting at 0")
    expect(pages[-1] <= kv_page_indices.numel(),
           f"{fn}: kv_indptr[-1] = {pages[-1]} pages but kv_page_indices holds "
           f"{kv_page_indices.numel()}")
    if kv_page_indices.numel():
        expect(0 <= int(kv_page_indices.min()) and int(kv_page_indices.max()) < num_pages,
               f"{fn}: kv_page_indices outside [0, {num_pages}): reads outside the KV buffer")
    if page_size == 1:
        return pages, None
    last = kv_last_page_lens.tolist()
    expect(all(1 <= n <= page_size for n in last),
           f"{fn}: kv_last_page_lens must lie in [1, page_size={page_size}], "
           f"got {sorted(set(last))[:8]}")
    return pages, last


def token_rows(kv_page_indices, page_start, page_end, page_size, last_page_len, first_only=False):
    """KV rows (page * page_size + slot) of pages [page_start, page_end) of kv_page_indices; the
    last page keeps only last_page_len rows (None: all full). first_only: slot 0 of each page."""
    pages = kv_page_indices[page_start:page_end].long()
    if first_only:
        return pages * page_size
    rows = (pages[:, None] * page_size + torch.arange(page_size, device=pages.device)).reshape(-1)
    if last_page_len is not None and rows.numel():
        rows = rows[: rows.numel() - (page_size - last_page_len)]
    return rows


def attend(q_rows, k, sm_scale):
    """(heads, 576) x (n, 576) -> (heads, 512) output and (heads,) log-sum-exp, float32."""
    scores = (q_rows @ k.T) * sm_scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ k[:, :V_HEAD_DIM]
    return out, lse


def combine(outs, lses):
    """Flash-style merge of split partials: outs (n, heads, 512), lses (n, heads)."""
    top = lses.max(dim=0).values
    weights = torch.exp(lses - top)
    return (weights[..., None] * outs).sum(0) / weights.sum(0)[:, None]


# ---------------------------------------------------------------------------------------------
# Work plans


def planned_heads(fn, heads, q_dtype, kv_dtype):
    """Refuse a head count the double does not plan: 16 for any pair; for fp8 q over fp8 KV the
    generation's PLANNED_FP8_HEADS (aiter folds other multiples of 16 into 16-head batches)."""
    need_int(fn, "heads", heads, 1)
    fp8_pair = q_dtype in FP8_DTYPES and kv_dtype in FP8_DTYPES
    allowed = PLANNED_FP8_HEADS[FEATURES["persistent_table"]] if fp8_pair else (NUM_HEADS,)
    expect(heads in allowed, f"{fn}: {heads} query heads (q {q_dtype}, kv {kv_dtype}): the double "
                             f"plans {allowed} at this aiter (aiter's 16-head fold is not modelled)")


def info_tiles_per_batch(max_seqlen_qo, heads, q_dtype, kv_dtype):
    """get_mla_metadata_info_v1's max_qo_tiles_per_batch on gfx950 for the planned heads:
    ceil(q x heads / 128) for 16 heads and for fp8 q over fp8 KV at 128 (f3be04a12) or 64 / 128
    (later: aiter/ops/attention.py), else ceil(q x heads / 16) (32 heads: 2 tiles sized, 1 used)."""
    fp8_pair = q_dtype in FP8_DTYPES and kv_dtype in FP8_DTYPES
    wide = (128,) if FEATURES["persistent_table"] == "f3be04a12" else (64, 128)
    per_tile = 128 if heads == NUM_HEADS or (fp8_pair and heads in wide) else 16
    return math.ceil(max_seqlen_qo * heads / per_tile)


def metadata_info(batch_size, max_seqlen_qo, num_head_qo, q_dtype, kv_dtype, is_sparse,
                  fast_mode=True, num_kv_splits=32, intra_batch_mode=False,
                  max_split_per_batch=-1):
    """aiter's sizes, as aiter computes them: a tuple of six (shape, dtype) pairs whose shapes
    are python ints or tuples of them, in the order work_metadata, work_indptr, work_info_set,
    reduce_indptr, reduce_final_map, reduce_partial_map."""
    fn = "get_mla_metadata_info_v1"
    CALLS[fn] += 1
    need_int(fn, "batch_size", batch_size, 1)
    need_int(fn, "max_seqlen_qo", max_seqlen_qo, 1)
    need_int(fn, "num_head_qo", num_head_qo, 1)
    need_int(fn, "num_kv_splits", num_kv_splits)
    need_int(fn, "max_split_per_batch", max_split_per_batch)
    expect(max_seqlen_qo == 1, f"{fn}: the double models decode (max_seqlen_qo 1) only")
    for name, dtype in (("q_dtype", q_dtype), ("kv_dtype", kv_dtype)):
        expect(isinstance(dtype, torch.dtype),
               f"{fn}: '{name}' expects a torch.dtype, got {dtype!r}")
    planned_heads(fn, num_head_qo, q_dtype, kv_dtype)
    for name, value in (("is_sparse", is_sparse), ("fast_mode", fast_mode),
                        ("intra_batch_mode", intra_batch_mode)):
        need_bool(fn, name, value)
    expect(not is_sparse, f"{fn}: sparse attention is not modelled")
    tiles_per_batch = info_tiles_per_batch(max_seqlen_qo, num_head_qo, q_dtype, kv_dtype)
    tile_cnt = batch_size * tiles_per_batch
    if fast_mode:
        max_work = (batch_size + NUM_CU - 1) * tiles_per_batch
        max_split_tiles = min(batch_size + NUM_CU - 1, (NUM_CU - 1) * 2) * tiles_per_batch
    else:
        max_work = max_split_tiles = tile_cnt * NUM_CU
    if max_split_per_batch > 0:  # passed only by the generations that take it
        cap = min(NUM_CU, max_split_per_batch * batch_size)
        grown = tile_cnt * cap if FEATURES["info_split_cap"] == "product" else tile_cnt + cap
        max_split_tiles = max(max_split_tiles, grown)
    if intra_batch_mode:
        expect(num_kv_splits >= 1, f"{fn}: intra-batch mode needs num_kv_splits >= 1")
        max_work = max_split_tiles = tile_cnt * num_kv_splits
    return (
        (2, torch.uint64),
        (NUM_CU + 1, torch.int32),
        ((max_work, WORK_FIELDS), torch.int32),
        (tile_cnt + 1, torch.int32),
        ((tile_cnt, 2), torch.int32),
        (max_split_tiles, torch.int32),
    )


def _kv_lengths(fn, kv):
    lengths = [b - a for a, b in itertools.pairwise(kv)]
    expect(kv[0] == 0 and all(n >= 1 for n in lengths),
           f"{fn}: every batch needs KV (seqlens_kv_indptr {kv[:9]}...)")
    return lengths


def balanced_plan(fn, qo, kv, granularity, max_split):
    """fast_mode: (work items, work_indptr, reduce ranges). Pieces of ~payload granules per CU,
    cut again at batch ends; a batch cut into several pieces gets partial rows."""
    lengths = _kv_lengths(fn, kv)
    num_splits = NUM_CU if max_split < 0 else min(NUM_CU, max_split * len(lengths))
    expect(num_splits >= 1, f"{fn}: max_split_per_batch = {max_split}")
    granules = [-(-n // granularity) for n in lengths]
    payload = -(-sum(granules) // num_splits)
    pieces, cu, room = [], 0, payload  # (cu, batch, kv_start, kv_end)
    for b, count in enumerate(granules):
        done = 0
        while done < count:
            take = min(room, count - done)
            start = kv[b] + done * granularity
            pieces.append((cu, b, start, min(start + take * granularity, kv[b + 1])))
            done, room = done + take, room - take
            if room == 0:
                cu, room = cu + 1, payload
    per_batch = collections.Counter(b for _, b, _, _ in pieces)
    items, reduce_rows, next_row = [], [[] for _ in lengths], 0
    for _, b, start, end in pieces:
        row = -1
        if per_batch[b] > 1:
            row, next_row = next_row, next_row + (qo[b + 1] - qo[b])
            reduce_rows[b].append(row)
        items.append([b, row, qo[b], qo[b + 1], start, end, kv[b + 1] - end, 0])
    work_indptr = [sum(1 for c, _, _, _ in pieces if c < limit) for limit in range(NUM_CU + 1)]
    return items, work_indptr, reduce_rows


def intra_batch_plan(fn, kv, granularity, max_split, uni_seqlen_qo):
    """intra_batch_mode (fast_mode False): aiter's v1_0 rule, each batch on its own (see the
    module docstring). Returns (work items, work_indptr, reduce ranges); every item has a
    reduce_partial_map entry, -1 for a batch of one piece."""
    lengths = _kv_lengths(fn, kv)
    expect(uni_seqlen_qo >= 1, f"{fn}: intra-batch mode places q rows by uni_seqlen_qo, got "
                               f"{uni_seqlen_qo}")
    expect(max_split >= 1, f"{fn}: intra-batch mode needs max_split_per_batch >= 1, got "
                           f"{max_split}")
    per_cu = -(-NUM_CU // len(lengths))
    items, reduce_rows = [], []
    for b, n in enumerate(lengths):
        splits = min(n // INTRA_BATCH_ROWS_PER_SPLIT, per_cu, max_split)
        expect(splits >= 1, f"{fn}: batch {b} holds {n} KV entries: aiter's intra-batch plan "
                            f"(gfx950) gives it {n} // {INTRA_BATCH_ROWS_PER_SPLIT} = 0 splits "
                            "and divides by zero")
        blocks = -(-n // granularity)
        payload = -(-blocks // splits)
        pieces = -(-blocks // payload)
        tail = n % (payload * granularity)
        if 0 < tail <= 4 and pieces > 1:
            pieces -= 1  # aiter folds a tail of at most 4 entries into the last piece
        q_start = b * uni_seqlen_qo
        rows = []
        for piece in range(pieces):
            row = -1 if pieces == 1 else len(items) * uni_seqlen_qo
            start = kv[b] + piece * payload * granularity
            end = min(start + payload * granularity, kv[b + 1])
            if kv[b + 1] - end <= 4 and pieces > 1:
                end = kv[b + 1]
            items.append([b, row, q_start, q_start + uni_seqlen_qo, start, end, kv[b + 1] - end,
                          0])
            rows.append(row)
        reduce_rows.append(rows)
    per, extra = divmod(len(items), NUM_CU)
    work_indptr = [c * per + min(c, extra) for c in range(NUM_CU + 1)]
    return items, work_indptr, reduce_rows


def metadata_fill(seqlens_qo_indptr, seqlens_kv_indptr, kv_last_page_lens, num_heads_per_head_k,
                  num_heads_k, is_causal, work_metadata_ptrs, work_info_set, work_indptr,
                  reduce_indptr, reduce_final_map, reduce_partial_map, page_size=1,
                  kv_granularity=16, max_seqlen_qo=-1, uni_seqlen_qo=-1, fast_mode=True, topk=-1,
                  max_split_per_batch=-1, intra_batch_mode=False, dtype_q=None, dtype_kv=None):
    """get_mla_metadata_v1: fills the six buffers in place. seqlens_kv_indptr counts pages and
    kv_granularity is in pages, as in aiter."""
    fn = "get_mla_metadata_v1"
    CALLS[fn] += 1
    need_tensor(fn, "seqlens_qo_indptr", seqlens_qo_indptr, dtype=torch.int32, ndim=1)
    batch = seqlens_qo_indptr.shape[0] - 1
    expect(batch >= 1, f"{fn}: empty batch")
    need_power_of_two(fn, "page_size", page_size)
    need_power_of_two(fn, "kv_granularity", kv_granularity)
    need_int(fn, "num_heads_per_head_k", num_heads_per_head_k)
    need_int(fn, "num_heads_k", num_heads_k)
    expect(num_heads_k == 1, f"{fn}: {num_heads_k} kv heads, expected 1")
    for name, value in (("is_causal", is_causal), ("fast_mode", fast_mode),
                        ("intra_batch_mode", intra_batch_mode)):
        need_bool(fn, name, value)
    for name, value in (("max_seqlen_qo", max_seqlen_qo), ("uni_seqlen_qo", uni_seqlen_qo),
                        ("topk", topk), ("max_split_per_batch", max_split_per_batch)):
        need_int(fn, name, value)
    max_q = 1 if max_seqlen_qo == -1 else max_seqlen_qo
    expect(max_q == 1, f"{fn}: the double models decode (max_seqlen_qo 1) only")
    expect(topk == -1, f"{fn}: sparse attention (topk) is not modelled")
    for name, dtype in (("dtype_q", dtype_q), ("dtype_kv", dtype_kv)):
        expect(dtype is None or isinstance(dtype, torch.dtype), f"{fn}: '{name}' = {dtype!r}")
    # aiter plans for the dtypes it is told (bf16 where none is: metadata.cu)
    planned_heads(fn, num_heads_per_head_k, dtype_q or torch.bfloat16, dtype_kv or torch.bfloat16)
    tiles = batch * info_tiles_per_batch(max_q, num_heads_per_head_k, dtype_q or torch.bfloat16,
                                         dtype_kv or torch.bfloat16)

    # The six buffers must be what get_mla_metadata_info_v1 described for this batch.
    need_tensor(fn, "work_metadata_ptrs", work_metadata_ptrs, dtype=torch.uint64, shape=(2,))
    need_tensor(fn, "work_info_set", work_info_set, dtype=torch.int32, ndim=2)
    expect(work_info_set.shape[1] == WORK_FIELDS,
           f"{fn}: 'work_info_set' {tuple(work_info_set.shape)} is not the info_v1 buffer "
           "(argument order: work_info_set BEFORE work_indptr)")
    need_tensor(fn, "work_indptr", work_indptr, dtype=torch.int32, shape=(NUM_CU + 1,))
    need_tensor(fn, "reduce_indptr", reduce_indptr, dtype=torch.int32, shape=(tiles + 1,))
    need_tensor(fn, "reduce_final_map", reduce_final_map, dtype=torch.int32, shape=(tiles, 2))
    need_tensor(fn, "reduce_partial_map", reduce_partial_map, dtype=torch.int32, ndim=1)
    for name, x in (("seqlens_qo_indptr", seqlens_qo_indptr),
                    ("seqlens_kv_indptr", seqlens_kv_indptr),
                    ("kv_last_page_lens", kv_last_page_lens)):
        need_tensor(fn, name, x, dtype=torch.int32, ndim=1)
        expect(x.stride(0) == 1, f"{fn}: {name} should be continuous (aiter's own check)")
    need_tensor(fn, "seqlens_kv_indptr", seqlens_kv_indptr, shape=(batch + 1,))
    need_tensor(fn, "kv_last_page_lens", kv_last_page_lens, shape=(batch,))
    qo = seqlens_qo_indptr.tolist()
    kv = seqlens_kv_indptr.tolist()
    expect(qo[0] == 0, f"{fn}: seqlens_qo_indptr must start at 0")
    for b in range(batch):
        expect(qo[b + 1] - qo[b] == max_q, f"{fn}: batch {b} has {qo[b + 1] - qo[b]} query rows")

    if fast_mode:
        items, cu_indptr, reduce_rows = balanced_plan(fn, qo, kv, kv_granularity,
                                                      max_split_per_batch)
        partial_entries = [row for rows_b in reduce_rows for row in rows_b]
    elif intra_batch_mode:
        expect(num_heads_per_head_k == NUM_HEADS,
               f"{fn}: the intra-batch plan is modelled at {NUM_HEADS} heads only")
        items, cu_indptr, reduce_rows = intra_batch_plan(fn, kv, kv_granularity,
                                                         max_split_per_batch, uni_seqlen_qo)
        partial_entries = [item[1] for item in items]
    else:
        raise NotImplementedError(f"{fn}: fast_mode=False without intra_batch_mode (aiter's "
                                  "v1_1 plan) is not modelled")
    expect(len(items) <= work_info_set.shape[0],
           f"{fn}: {len(items)} work items overflow work_info_set ({work_info_set.shape[0]} rows)")
    expect(len(partial_entries) <= reduce_partial_map.shape[0],
           f"{fn}: {len(partial_entries)} partial entries overflow reduce_partial_map "
           f"({reduce_partial_map.shape[0]})")

    device = work_info_set.device
    work_info_set.fill_(-1)
    work_info_set[: len(items)] = torch.tensor(items, dtype=torch.int32, device=device)
    work_indptr.copy_(torch.tensor(cu_indptr, dtype=torch.int32))
    ends = [0]
    for rows_b in reduce_rows:
        ends.append(ends[-1] + len(rows_b))
    # one tile per batch is used; aiter fills the rest of reduce_indptr with its last value
    # (v1_2_device.cuh's reduce_indptr tail) and leaves their final-map rows unwritten (-1 here)
    ends += [ends[-1]] * (tiles - batch)
    reduce_indptr.copy_(torch.tensor(ends, dtype=torch.int32))
    reduce_final_map.fill_(-1)
    reduce_final_map[:batch] = torch.tensor([[qo[b], qo[b + 1]] for b in range(batch)],
                                            dtype=torch.int32)
    reduce_partial_map.fill_(-1)
    if partial_entries:
        reduce_partial_map[: len(partial_entries)] = torch.tensor(partial_entries,
                                                                  dtype=torch.int32)
    work_metadata_ptrs.copy_(torch.tensor([work_indptr.data_ptr(), work_info_set.data_ptr()],
                                          dtype=torch.uint64))
    LOG.append((fn, {"page_size": page_size, "batch": batch, "max_split": max_split_per_batch,
                     "items": len(items), "fast_mode": fast_mode,
                     "intra_batch_mode": intra_batch_mode, "is_causal": is_causal,
                     "dtype_q": dtype_q, "dtype_kv": dtype_kv}))


# ---------------------------------------------------------------------------------------------
# Persistent stage 1 and the reduce


def _plan_of(fn, work_meta_data, work_indptr, work_info_set):
    """The plan the kernel reads: through work_meta_data's two pointers."""
    need_tensor(fn, "work_meta_data", work_meta_data, dtype=torch.uint64, shape=(2,))
    need_tensor(fn, "work_indptr", work_indptr, dtype=torch.int32, shape=(NUM_CU + 1,))
    need_tensor(fn, "work_info_set", work_info_set, dtype=torch.int32, ndim=2)
    expect(work_info_set.shape[1] == WORK_FIELDS, f"{fn}: 'work_info_set' is not a plan buffer")
    expect(work_meta_data.tolist() == [work_indptr.data_ptr(), work_info_set.data_ptr()],
           f"{fn}: work_meta_data does not point at these work_indptr / work_info_set (never "
           "filled by get_mla_metadata_v1 for them): the kernel would read another plan")
    bounds = work_indptr.tolist()
    expect(bounds[0] == 0 and bounds == sorted(bounds) and bounds[-1] <= work_info_set.shape[0],
           f"{fn}: work_indptr is not a plan over work_info_set")
    return work_info_set.tolist()[: bounds[-1]]


def stage1(Q, KV, qo_indptr, kv_indptr, kv_page_indices, kv_last_page_lens, num_kv_splits_indptr,
           work_meta_data, work_indptr, work_info_set, max_seqlen_q, page_size, nhead_kv,
           softmax_scale, splitData, splitLse, output, lse=None, q_scale=None, kv_scale=None,
           causal=True):
    """mla_decode_stage1_asm_fwd in persistent mode (aiter's: no num_kv_splits_indptr).
    causal: at q length 1 (all the double models) aiter runs the causal kernel either way."""
    fn = "mla_decode_stage1_asm_fwd"
    CALLS[fn] += 1
    need_bool(fn, "causal", causal)
    need_tensor(fn, "num_kv_splits_indptr", num_kv_splits_indptr, dtype=torch.int32, optional=True)
    kernel = check_q_kv(fn, Q, KV, page_size, nhead_kv, num_kv_splits_indptr is None,
                        max_seqlen_q)
    need_scale(fn, "q_scale", q_scale, "Q", Q, Q.device)
    need_scale(fn, "kv_scale", kv_scale, "KV", KV, Q.device)
    need_float(fn, "softmax_scale", softmax_scale)
    need_tensor(fn, "qo_indptr", qo_indptr, dtype=torch.int32, ndim=1)
    batch = qo_indptr.shape[0] - 1
    pages, last = check_page_table(fn, batch, kv_indptr, kv_page_indices, kv_last_page_lens,
                                   KV.shape[0], page_size)
    if work_meta_data is None:
        raise NotImplementedError(f"{fn}: the double models the persistent mode (work plan) "
                                  "only; mla_decode_fwd models the non-persistent one")
    expect(num_kv_splits_indptr is None,
           f"{fn}: num_kv_splits_indptr together with a work plan: aiter then runs the "
           "NON-persistent kernel and ignores the plan")
    items = _plan_of(fn, work_meta_data, work_indptr, work_info_set)
    total_q, heads = Q.shape[:2]
    need_tensor(fn, "output", output, dtype=torch.bfloat16, shape=(total_q, heads, V_HEAD_DIM))
    need_tensor(fn, "splitData", splitData, dtype=torch.float32, ndim=4)
    partial_rows = splitData.shape[0]
    need_tensor(fn, "splitData", splitData, shape=(partial_rows, 1, heads, V_HEAD_DIM))
    need_tensor(fn, "splitLse", splitLse, dtype=torch.float32,
                shape=(partial_rows, 1, heads, 1))
    if need_tensor(fn, "lse", lse, dtype=torch.float32, shape=(total_q, heads),
                   optional=True):
        kernel = lse_kernel(fn, kernel, max_seqlen_q)
    # the suspected one-token-per-page reading is the fp8 q-length-1 kernel's (no paged build)
    first_only = (_page_mode == "first_token" and page_size > 1
                  and kernel in (A8W8_Q1_KERNEL, LSE_VARIANTS[A8W8_Q1_KERNEL]))
    LOG.append((fn, {"page_size": page_size, "batch": batch, "items": len(items),
                     "first_token": first_only, "kernel": kernel, "heads": heads,
                     "lse": lse is not None}))

    q = dequantize(Q, q_scale)
    kv_rows = dequantize(KV, kv_scale).reshape(-1, QK_HEAD_DIM)
    for b, row, q_start, q_end, page_start, page_end in (item[:6] for item in items):
        expect(0 <= b < batch and 0 <= q_start < q_end <= total_q,
               f"{fn}: a work item names batch {b}, q rows [{q_start}, {q_end}): a stale plan")
        expect(0 <= page_start <= page_end <= kv_page_indices.numel(),
               f"{fn}: a work item reads pages [{page_start}, {page_end}) of "
               f"{kv_page_indices.numel()}: a stale plan")
        # the batch's last page (as THIS call's page table says) holds last[b] rows
        tail = last[b] if last is not None and page_end == pages[b + 1] else None
        rows = token_rows(kv_page_indices, page_start, page_end, page_size, tail, first_only)
        out, row_lse = attend(q[q_start:q_end].reshape(-1, QK_HEAD_DIM), kv_rows[rows],
                              softmax_scale)
        count = q_end - q_start
        if row < 0:  # the item's output is final: stage 1 writes it (and, given one, its lse)
            output[q_start:q_end] = out.reshape(count, heads, V_HEAD_DIM).to(output.dtype)
            if lse is not None:
                lse[q_start:q_end] = row_lse.reshape(count, heads)
        else:
            expect(row + count <= partial_rows,
                   f"{fn}: partial row {row} outside splitData ({partial_rows} rows): size it "
                   "reduce_partial_map.size(0) * max_seqlen_q")
            splitData[row:row + count, 0] = out.reshape(count, heads, V_HEAD_DIM)
            splitLse[row:row + count, 0, :, 0] = row_lse.reshape(count, heads)


def lse_kernel(fn, kernel, max_seqlen_q):
    """The kernel a persistent stage 1 given an lse tensor runs, or aiter's refusal (FEATURES)."""
    expect(FEATURES["lse"] == "variant",
           f"{fn}: 'lse' given, but at this aiter no 16-head q-length-1 kernel writes it (the "
           "tensor would keep what it held)")
    variant = LSE_VARIANTS.get(kernel)
    q_type, kv_type, gqa, ps, q_len = KERNEL_KEYS[kernel]
    expect(variant is not None,
           f"{fn}: get_heuristic_kernel_mla: cannot get heuristic kernel! q_type:{q_type} "
           f"kv_type:{kv_type} gqa:{gqa} ps:{ps} prefill:0 causal:1 qseqlen:{q_len or max_seqlen_q} "
           "lse:1 cprr:0")
    return variant


def reduce(partial_output, partial_lse, reduce_indptr, reduce_final_map, reduce_partial_map,
           max_seqlen_q, final_output, final_lse=None, num_kv_splits=None):
    """mla_reduce_v1: merges each output tile's partial rows (tiles of one entry are skipped)."""
    fn = "mla_reduce_v1"
    CALLS[fn] += 1
    need_tensor(fn, "partial_output", partial_output, dtype=torch.float32, ndim=4)
    partial_rows, _, heads, _ = partial_output.shape
    expect(heads in REDUCE_HEADS, f"{fn}: {heads} heads: the reduce is built for {REDUCE_HEADS}")
    need_tensor(fn, "partial_output", partial_output,
                shape=(partial_rows, 1, heads, V_HEAD_DIM))
    need_tensor(fn, "partial_lse", partial_lse, dtype=torch.float32,
                shape=(partial_rows, 1, heads, 1))
    need_tensor(fn, "reduce_partial_map", reduce_partial_map, dtype=torch.int32, ndim=1)
    need_int(fn, "max_seqlen_q", max_seqlen_q, 1)
    need_tensor(fn, "reduce_indptr", reduce_indptr, dtype=torch.int32, ndim=1)
    tiles = reduce_indptr.shape[0] - 1
    has_final_map = need_tensor(fn, "reduce_final_map", reduce_final_map, dtype=torch.int32,
                                shape=(tiles, 2), optional=True)
    if num_kv_splits is not None:  # generations from 2026-06-11: 0 = aiter decides
        need_int(fn, "num_kv_splits", num_kv_splits, 0)
    need_tensor(fn, "final_output", final_output, dtype=torch.bfloat16, ndim=3)
    expect(tuple(final_output.shape[1:]) == (heads, V_HEAD_DIM),
           f"{fn}: 'final_output' has shape {tuple(final_output.shape)}")
    need_tensor(fn, "final_lse", final_lse, dtype=torch.float32,
                shape=(final_output.shape[0], heads), optional=True)
    LOG.append((fn, {"num_kv_splits": num_kv_splits, "final_lse": final_lse is not None}))

    ptr = reduce_indptr.tolist()
    expect(ptr[0] == 0 and ptr == sorted(ptr) and ptr[-1] <= reduce_partial_map.shape[0],
           f"{fn}: reduce_indptr is not a prefix sum over reduce_partial_map")
    partial_map = reduce_partial_map.tolist()
    final_rows = reduce_final_map.tolist() if has_final_map else [[t, t + 1] for t in range(tiles)]
    for t in range(tiles):
        if ptr[t + 1] - ptr[t] <= 1:
            continue  # one piece: stage 1 wrote the output itself
        rows = partial_map[ptr[t]:ptr[t + 1]]
        expect(all(0 <= r and r + max_seqlen_q <= partial_rows for r in rows),
               f"{fn}: partial rows {rows[:4]}... outside partial_output ({partial_rows} rows)")
        index = torch.tensor(rows, dtype=torch.long, device=partial_output.device)
        out = combine(partial_output[index, 0], partial_lse[index, 0, :, 0])
        q_start, q_end = final_rows[t]
        rows_out = out.reshape(q_end - q_start, heads, V_HEAD_DIM)
        final_output[q_start:q_end] = rows_out.to(final_output.dtype)
        if final_lse is not None:  # natural log, as reduce.cu's expf / logf
            final_lse[q_start:q_end] = torch.logsumexp(partial_lse[index, 0, :, 0], dim=0)


# ---------------------------------------------------------------------------------------------
# mla_decode_fwd's non-persistent mode (its persistent mode is in mla.py: it calls the two ops)


# aiter's fp8 decode block per query row count (get_meta_param's get_block_n_fp8), for the counts
# the double's fp8 kernels reach: 8 (later kernel table only), 16, 128 heads at q length 1
FP8_MIN_BLOCK_N = {8: 64, 16: 128, 128: 32}


def meta_param(num_kv_splits, bs, total_kv, nhead, max_seqlen_q, dtype):
    """aiter's get_meta_param on gfx950 (aiter/mla.py: 16e9b5a07 lines 101-141, e4048607a lines
    282-375): the split count mla_decode_fwd's non-persistent mode runs when the caller passes no
    num_kv_splits or no num_kv_splits_indptr. Without a count: the i in 1..16 that maximises
    bs * i / (bs * i rounded up to a multiple of the CU count) * avg / (avg + 84.1 * i), avg =
    total_kv / bs, the smallest i on a tie (sorted(..., reverse=True)[0] up to 2026-07, max() on
    e4048607a: both keep the first). total_kv is kv_indices' length (mla.py: 16e9b5a07 line 184,
    e4048607a line 572), not the tokens used. fp8 q: at most ceil(avg / min_block_n); from
    ea18155d27 (2026-03-23; the later kernel table's generations) also, above one split, at most
    |avg - max_seqlen_q| // min_block_n + 1. Returns the count (the indptr is arange(0, (bs + 1)
    * n, n), which the caller's must equal)."""
    later = FEATURES["kernel_table"] == "e4048607a"
    if num_kv_splits is None:
        avg = total_kv / bs
        scores = [(bs * i / (-(-(bs * i) // NUM_CU) * NUM_CU) * avg / (avg + 84.1 * i), i)
                  for i in range(1, 17)]
        num_kv_splits = max(scores, key=lambda score: score[0])[1]
    if dtype in FP8_DTYPES:
        block = FP8_MIN_BLOCK_N[nhead * max_seqlen_q]
        if later:
            num_kv_splits = min(num_kv_splits, -(-total_kv // (bs * block)))
            if num_kv_splits > 1:
                num_kv_splits = min(num_kv_splits,
                                    int(abs(total_kv / bs - max_seqlen_q) // block) + 1)
        else:
            num_kv_splits = min(num_kv_splits, int(total_kv / bs + block - 1) // block)
    return num_kv_splits


def stage2_granule(heads, q_dtype, kv_dtype):
    """mgc, the KV rows per granule aiter's stage 2 counts a request's splits in (it merges
    min(splits, ceil(length / mgc)) of them), at q length 1 (aiter/mla.py: 16e9b5a07 line 196,
    e4048607a lines 598-616): 64 at 16 heads (and 8 later), 32 later at 128 heads fp8 / fp8 and
    64 heads bf16 / bf16, else 16."""
    later = FEATURES["kernel_table"] == "e4048607a"
    if heads in ((8, 16) if later else (16,)):
        return 64
    fp8_pair = q_dtype in FP8_DTYPES and kv_dtype in FP8_DTYPES
    bf16_pair = q_dtype == kv_dtype == torch.bfloat16
    if later and ((heads == 128 and fp8_pair) or (heads == 64 and bf16_pair)):
        return 32
    return 16


def stage1_splits(rows, num_kv_splits, granule):
    """How the double's stage 1 cuts one request's KV rows: whole granules spread evenly over the
    first min(num_kv_splits, granules) splits, none of them empty; the other splits are not
    written. Where the kernel cuts is in its binary; this cut is one stage 2's count (above)
    reads completely."""
    granules = -(-rows.numel() // granule)
    used = min(num_kv_splits, granules)
    return [rows[(s * granules // used) * granule:((s + 1) * granules // used) * granule]
            for s in range(used)]


def decode_fwd_check(fn, q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
                     max_seqlen_q, page_size, nhead_kv, sm_scale, logit_cap, q_scale, kv_scale,
                     persistent):
    """The checks both modes of mla_decode_fwd share; returns (softmax scale, kernel name).
    persistent: whether stage 1 will run without a split indptr (aiter's kernel choice)."""
    kernel = check_q_kv(fn, q, kv_buffer, page_size, nhead_kv, persistent, max_seqlen_q)
    need_scale(fn, "q_scale", q_scale, "q", q, q.device)
    need_scale(fn, "kv_scale", kv_scale, "kv_buffer", kv_buffer, q.device)
    expect(logit_cap <= 0, f"{fn}: logit_cap={logit_cap} is not supported (aiter's assert)")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(QK_HEAD_DIM)
    need_float(fn, "sm_scale", sm_scale)
    need_tensor(fn, "o", o, dtype=torch.bfloat16, shape=(q.shape[0], q.shape[1], V_HEAD_DIM))
    need_tensor(fn, "qo_indptr", qo_indptr, dtype=torch.int32, ndim=1)
    return sm_scale, kernel


def decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
               page_size, nhead_kv, sm_scale, logit_cap, num_kv_splits, num_kv_splits_indptr,
               q_scale, kv_scale, return_lse):
    """Non-persistent mla_decode_fwd as aiter runs it at q length 1: the split count (the
    caller's, with its indptr, else meta_param's), stage 1 writing each split's partial and lse
    (stage1_splits; a request without KV: its split 0 holds 0 / 0, out NaN, lse -inf), then
    - the one-split shortcut (no stage 2): o is stage 1's output (fp8 q; bf16 at 32 / 64 heads on
      f3be04a12, whose o stays unwritten, 8 / 32 later);
    - else aiter's Triton stage 2 (_fwd_kernel_stage2_asm). Its copy-only branch (FINAL_OUT:
      MAYBE_FINAL_OUT, False only at 16 heads, 8 too later, and num_kv_splits_indptr[bs] == bs,
      i.e. one split) copies stage 1's output into o and writes no lse; otherwise it merges the
      first min(splits, ceil(length / mgc)) splits into o and, with return_lse where
      FEATURES["decode_lse"] is "written", the merged lse (aiter/mla.py at e4048607a: the kernel
      lines 176-278, FINAL_OUT 230, the copy 233-246, the lse 274-278; mla_decode_fwd 593-755;
      at 16e9b5a07: lines 18-98, no lse at all, 190-282).
    Memory aiter allocates with torch.empty and no kernel writes (partials of splits stage 1 left
    alone, the lse of the copy-only branch and of the shortcut with return_lse, f3be04a12's
    final_lse) is NaN here, so a caller that reads it fails."""
    fn = "mla_decode_fwd"
    CALLS[fn] += 1
    sm_scale, kernel = decode_fwd_check(fn, q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices,
                                        kv_last_page_lens, max_seqlen_q, page_size, nhead_kv,
                                        sm_scale, logit_cap, q_scale, kv_scale, False)
    total_q = q.shape[0]
    batch = qo_indptr.shape[0] - 1
    pages, last = check_page_table(fn, batch, kv_indptr, kv_indices, kv_last_page_lens,
                                   kv_buffer.shape[0], page_size)
    qo = qo_indptr.tolist()
    expect(qo[-1] == total_q, f"{fn}: qo_indptr[-1] = {qo[-1]} but q has {total_q} rows")
    heads = q.shape[1]

    if num_kv_splits is None or num_kv_splits_indptr is None:
        CALLS[fn + ":derived_splits"] += 1
        num_kv_splits = meta_param(num_kv_splits, batch, kv_indices.shape[0], heads,
                                   max_seqlen_q, q.dtype)
    else:
        need_int(fn, "num_kv_splits", num_kv_splits, 1)
        need_tensor(fn, "num_kv_splits_indptr", num_kv_splits_indptr, dtype=torch.int32,
                    shape=(batch + 1,))
        expect(num_kv_splits_indptr.tolist() == [b * num_kv_splits for b in range(batch + 1)],
               f"{fn}: num_kv_splits_indptr must be arange(0, (bs + 1) * n, n), "
               "n = num_kv_splits")
    bf16_pair = q.dtype == kv_buffer.dtype == torch.bfloat16
    later = FEATURES["kernel_table"] == "e4048607a"
    # aiter's one-split shortcut (no stage 2): fp8 q everywhere; bf16 at 32 / 64 heads
    # (f3be04a12: output in a float32 partial, o not written) or 8 / 32 (e4048607a: o written)
    shortcut = num_kv_splits == 1 and (
        q.dtype in FP8_DTYPES or (bf16_pair and heads in ((8, 32) if later else (32, 64))))
    # stage 2's copy-only branch: MAYBE_FINAL_OUT and num_kv_splits_indptr[bs] == bs (the
    # indptr is arange(0, (bs + 1) * n, n) here, so: one split)
    copy_only = (not shortcut and num_kv_splits == 1
                 and heads not in ((8, 16) if later else (16,)))
    granule = stage2_granule(heads, q.dtype, kv_buffer.dtype)
    LOG.append((fn, {"page_size": page_size, "batch": batch, "num_kv_splits": num_kv_splits,
                     "direct": shortcut, "copy_only": copy_only, "persistent": False,
                     "kernel": kernel, "heads": heads}))

    qf = dequantize(q, q_scale)
    kv_rows = dequantize(kv_buffer, kv_scale).reshape(-1, QK_HEAD_DIM)
    logits = torch.full((total_q, num_kv_splits, heads, V_HEAD_DIM), math.nan,
                        dtype=torch.float32, device=q.device)
    lses = torch.full((total_q, num_kv_splits, heads, 1), math.nan, dtype=torch.float32,
                      device=q.device)
    merged = []  # per batch: the splits stage 2 merges, min(splits, ceil(length / mgc))
    for b in range(batch):
        tail = None if last is None else last[b]
        rows = token_rows(kv_indices, pages[b], pages[b + 1], page_size, tail)
        parts = stage1_splits(rows, num_kv_splits, granule)
        merged.append(len(parts))
        for t in range(qo[b], qo[b + 1]):
            if not parts:  # no KV: the kernel's 0 / 0
                logits[t, 0], lses[t, 0] = math.nan, -math.inf
            for split, part in enumerate(parts):
                out, row_lse = attend(qf[t], kv_rows[part], sm_scale)
                logits[t, split] = out
                lses[t, split, :, 0] = row_lse
    if shortcut and bf16_pair and not later:  # f3be04a12 returns the float32 partial
        return logits.view(total_q, heads, V_HEAD_DIM).clone(), lses.clone()
    if shortcut or copy_only:  # stage 1's output (bf16: out_16_nosplit), as is or copied
        o.copy_(logits[:, 0].to(o.dtype))
    if shortcut:
        # aiter: `return logits.view(total_s, nhead, v_head_dim), attn_lse` (stage 1's own lse);
        # from 2026-04-16 on `final_lse if return_lse else attn_lse`, and no non-persistent fp8
        # kernel has an lse build (mla_asm.csv's lse column), so that final_lse is not written
        if return_lse and FEATURES["decode_lse"] == "written":
            return o, unwritten(total_q, heads, q.device)
        return o, lses.clone()
    CALLS[fn + ":reduce"] += 1
    # What comes back as the lse (FEATURES["decode_lse"]); every lse here is a natural log, as
    # aiter's stage 2 (tl.exp) and mla_reduce_v1 (expf / logf) combine them. A request without KV
    # merges no split: out 0 / 0 (NaN), lse -inf + log(0) (-inf).
    final_lse = unwritten(total_q, heads, q.device)
    for b in range(batch):
        for t in range(qo[b], qo[b + 1]):
            if copy_only:
                continue
            count = merged[b]
            if count == 0:
                o[t], final_lse[t] = math.nan, -math.inf
                continue
            o[t] = combine(logits[t, :count], lses[t, :count, :, 0]).to(o.dtype)
            final_lse[t] = torch.logsumexp(lses[t, :count, :, 0], dim=0)
    if FEATURES["decode_lse"] == "unwritten":
        return logits, unwritten(total_q, heads, q.device)  # f3be04a12: torch.empty, never written
    return logits, final_lse if return_lse else None


def unwritten(rows, heads, device):
    """A (rows, heads) float32 lse tensor aiter allocates and no kernel writes: NaN here, so a
    caller that reads it fails."""
    return torch.full((rows, heads), math.nan, dtype=torch.float32, device=device)

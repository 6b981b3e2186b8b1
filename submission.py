#!POPCORN leaderboard amd-mixed-mla
#!POPCORN gpu MI355X
"""DeepSeek-R1 MLA decode (forward-absorb, 576 = 512 latent + 64 rope dims, one KV head): the
amd-mixed-mla leaderboard's entry point and an interface for inference engines shaped like
FlashMLA's, over one core.

Sections, in order (each under a banner; none refers at import time to a later one):
  constants; entry points; input checks; custom_kernel's route (the route tables, data that
  tune.py rewrites, and the router); the serving API's route (SERVING_ROUTE_TABLE, serving_route);
  host machinery (launch, caches); Triton kernels and their routes (portable); the Hopper route
  (Gluon: shared helpers, the schedule, the tokens-as-M kernels, the seesaw kernel, the combine
  kernel, host side); aiter routes (MI355X); route registry; the serving API's plan and launches;
  candidate race (measures a racing row's candidates once per job).

Both entry points
  custom_kernel(data)            the leaderboard's call: contiguous KV rows (bf16, fp8, mxfp4), 16
                                 heads, one query token; routed by the active route table
  get_mla_decode_metadata(),     the serving API: a paged bf16 or fp8 cache, 1-128 heads, 1-8
  mla_decode_with_kvcache(...)   query tokens (causal), out and lse, CUDA-graph safe; or the sparse
                                 form (DeepSeek-V3.2: top-k indices over FlashMLA's 656-byte fp8
                                 cache); routed by SERVING_ROUTE_TABLE (serving_route)

Kernels, and the cases each serves
  _mla_decode_kernel                  portable Triton (any GPU; the CPU under TRITON_INTERPRET=1):
                                      custom_kernel's fp8 rows off Hopper, every serving case no
                                      other row takes (another GPU, a cache TMA cannot read)
  _mla_decode_mxfp4_kernel            portable Triton: custom_kernel's mxfp4 rows
  _mla_sparse_kernel                  portable Triton: the serving API's sparse form off Hopper
  _mla_decode_fp8_hopper_kernel       Hopper: custom_kernel's fp8 rows, tokens as the MMA's M, TMA
  _mla_decode_paged_hopper_kernel     Hopper: serving pages of 64 or 128 tokens below 64 query rows,
                                      tokens as M, TMA
  _mla_decode_gathered_hopper_kernel  Hopper: serving pages of 1-32 tokens, rows gathered by cp.async
  _mla_decode_seesaw_kernel           Hopper: serving pages of 64 or 128 tokens with 64+ query rows,
                                      query rows as M, two compute warpgroups and a loader warp
  _mla_sparse_hopper_kernel           Hopper: the serving API's sparse form, warp-specialised (a
                                      producer warpgroup gathering and dequantising, two on wgmma),
                                      persistent where the batch's waves would leave SMs idle
  _mla_sparse_combine_kernel          Hopper: the sparse kernel's cut query tokens merged
  _mla_combine_kernel                 Hopper: the serving kernels' split requests merged
  aiter's kernels                     MI355X: both entry points, where aiter serves the case
"""
import functools
import hashlib
import inspect
import itertools
import json
import math
import operator
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import NamedTuple
import torch
import triton
import triton.language as tl
from task import input_t, output_t

# =============================================================================================
# Constants
# =============================================================================================
NUM_HEADS = 16
NUM_KV_HEADS = 1  # MLA: every query head reads the same latent row
QK_HEAD_DIM = 576  # keys use all 576 dims: 512 latent + 64 rope
V_HEAD_DIM = 512  # values are the first 512 dims of the same latent row
ROPE_DIM = QK_HEAD_DIM - V_HEAD_DIM
LATENT = tl.constexpr(V_HEAD_DIM)  # the two, as the kernels read them
ROPE = tl.constexpr(ROPE_DIM)
SM_SCALE = 1.0 / math.sqrt(QK_HEAD_DIM)  # the problem's softmax scale; check_inputs holds config to it
LOG2E = 1.4426950408889634  # the kernels' softmax is in base 2: scores are scaled by sm_scale * log2(e)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)  # gfx950 / NVIDIA, gfx942
FP8_MAX = {dtype: torch.finfo(dtype).max for dtype in FP8_DTYPES}  # 448 e4m3fn, 240 e4m3fnuz
TRITON_FP8_DTYPES = {"fp8e4nv": torch.float8_e4m3fn, "fp8e4b8": torch.float8_e4m3fnuz}  # Triton's names
MXFP4_ROW_BYTES = QK_HEAD_DIM // 2  # two e2m1 values per byte
MXFP4_SCALES_PER_ROW = QK_HEAD_DIM // 32
CONFIG_KEYS = frozenset({"batch_size", "q_seq_len", "kv_seq_len", "sm_scale"})  # the config entries read here
KV_FORMATS = ("fp8", "bf16", "mxfp4")  # the keys of kv_data
# bytes a route reads per KV token in each format (mxfp4: 288 packed bytes + 18 scale bytes)
SPARSE_TOKEN_BYTES = 656  # the sparse form's cache: 512 fp8 latent values, 4 float32 scales, 64 bf16 rope values
SPARSE_CACHE_DTYPES = (torch.float8_e4m3fn, torch.uint8, torch.int8)  # FlashMLA takes its bytes as any of these
SPARSE_MAX_TOPK = 2**20  # far past FlashMLA's 16384; keeps entry positions well inside int32
KV_BYTES_PER_TOKEN = {"bf16": 2 * QK_HEAD_DIM, "fp8": QK_HEAD_DIM, "mxfp4": MXFP4_ROW_BYTES + MXFP4_SCALES_PER_ROW}


# =============================================================================================
# Entry points: custom_kernel (the leaderboard's) and the serving API (FlashMLA's shape)
# Each reads check -> plan -> launch. What they call is defined further down: the input checks,
# the route choice (the route tables, and serving_route for the serving API), then the kernels.
# =============================================================================================


def custom_kernel(data: input_t) -> output_t:
    """MLA decode attention for one batch of query rows.

    Args:
        data: (q, kv_data, qo_indptr, kv_indptr, config) as the leaderboard's generate_input makes it:
            q (batch, 16, 576) bf16; kv_data {"bf16": (total_kv, 1, 576) bf16, "fp8": (data, scale),
            "mxfp4": (data, block scales)}; qo_indptr, kv_indptr (batch + 1,) int32; config with
            batch_size, q_seq_len (1), kv_seq_len and sm_scale (1 / sqrt(576)). Every tensor on one
            device; q in any layout; each KV tensor with a contiguous last dimension.
    Returns:
        A fresh (batch, 16, 512) bf16 tensor: softmax(sm_scale * q k^T) v over each batch row's KV
        rows, as read by the route that the active table picks for (batch, kv_len).
    Raises:
        ValueError naming the field when a shape, dtype, device, layout or config entry is off
        (no GPU sync).
    """
    q, kv_data, qo_indptr, kv_indptr, config = data
    q, qo_indptr, kv_indptr, batch, total_kv = check_inputs(q, kv_data, qo_indptr, kv_indptr, config)
    data = (q, kv_data, qo_indptr, kv_indptr, config)
    key, selection = _selection(batch, total_kv // batch, declares_uniform_kv(batch, total_kv, config))
    if selection.racing:
        return race_call(key, selection, data, batch, total_kv)
    return _run(selection.candidate, data, total_kv, selection.label)


class PlanShape(NamedTuple):
    """What a serving plan is filled for: a call's batch, query tokens, heads, page size, cache
    format ("bf16", "fp8", or "fp8_sparse": the sparse form's 656-byte cache), causal flag, and
    the sparse form's entries per query (topk; 0 for the dense form)."""
    batch: int
    s_q: int
    h_q: int
    page_size: int
    kv: str
    causal: bool
    topk: int = 0


@dataclass(eq=False)
class MlaDecodePlan:
    """What get_mla_decode_metadata returns. Empty until the first mla_decode_with_kvcache call
    that uses it; that call fixes its shape, chooses the route (serving_route), the kernel and the
    split count, and allocates the split workspace. Reuse it for every call (and layer) of that
    shape: the split bounds are computed by the kernel from cache_seqlens on the GPU, so new
    lengths and block-table contents need no new plan, eagerly or in a replayed CUDA graph. Calls
    that share a plan must run in order on one GPU queue, as an engine's layers do.

    num_splits: None (the first call chooses); set it to a count before the first call to fix it.
    The portable route cuts every request into num_splits equal splits (by default enough programs
    to fill the GPU twice, no split shorter than SERVING_SPLIT_MIN_TOKENS of the block table's
    capacity); the Hopper route cuts the batch's tokens into about num_splits chunks (by default
    one per program slot of the GPU), each request into its share of them, or (rows with "spans")
    gives each program an equal span of the batch's tiles across requests, whichever is shorter
    for the call's lengths."""

    num_splits: int | None = None
    shape: PlanShape | None = None  # once filled
    route: dict | None = None  # the SERVING_ROUTE_TABLE row serving the plan
    kernel: object = None  # the kernel it launches (None: the row's aiter route)
    spans: bool = False  # the Hopper kernel with the span schedule
    workspace: tuple | None = None  # (partials, partial lse, the portable kernel's tickets or the Hopper split counts)
    launches: dict = field(default_factory=dict)  # call signature -> how such a call runs (_prepare_call)
    fallback: object = None  # an MlaDecodePlan: the portable route's plan, for calls whose cache TMA cannot read
    aiter: object = None  # an aiter route's AiterServingBuffers (MI355X only)

    def __repr__(self):
        if self.shape is None:
            return "MlaDecodePlan(empty)"
        fields = ", ".join(f"{name}={value}" for name, value in self.shape._asdict().items())
        return f"MlaDecodePlan({fields}, num_splits={self.num_splits}, route={self.route['route']})"


def get_mla_decode_metadata(*args, **kwargs) -> tuple[MlaDecodePlan, None]:
    """An empty plan for mla_decode_with_kvcache, as FlashMLA's get_mla_metadata returns one.

    Args:
        Anything: FlashMLA's callers pass (cache_seqlens, s_q * h_q, 1) or nothing; the plan
        fills itself on its first use, so the arguments are not needed and not read.
    Returns:
        (plan, None): an MlaDecodePlan, and None where FlashMLA returns its split counts.
    """
    del args, kwargs
    return MlaDecodePlan(), None


def mla_decode_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor | None,
                            cache_seqlens: torch.Tensor | None, head_dim_v: int, plan: MlaDecodePlan,
                            num_splits: int | None = None, softmax_scale: float | None = None, causal: bool = False,
                            is_fp8_kvcache: bool = False, indices: torch.Tensor | None = None, attn_sink: None = None,
                            extra_k_cache: None = None, extra_indices_in_kvcache: None = None,
                            topk_length: torch.Tensor | None = None, extra_topk_length: None = None, *,
                            k_scale: float | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode attention over a paged latent cache, as FlashMLA's flash_mla_with_kvcache: the
    dense form (block_table and cache_seqlens), or DeepSeek-V3.2's sparse form (indices).

    Args:
        q: (batch, s_q, h_q, 576) bfloat16, any layout; s_q 1..8 query tokens, h_q 1..128 heads.
        k_cache: (num_blocks, page_size, 1, 576) bfloat16, or fp8 (float8_e4m3fn; e4m3fnuz on
            gfx942) with k_scale; page_size a power of two 1..128; last dimension contiguous; its start
            on 16 bytes, its block and row strides multiples of 16 elements.
        block_table: (batch, max_blocks) int32: request b's token p is in block
            block_table[b, p // page_size], row p % page_size. Entries past a request's used
            blocks are never read.
        cache_seqlens: (batch,) int32 tokens per request (0: nothing attended).
        head_dim_v: 512.
        plan: from get_mla_decode_metadata(); reuse it for calls of the same shape.
        num_splits: None (the plan chooses).
        softmax_scale: default 1 / sqrt(576).
        causal: query token i attends the first cache_seqlens - s_q + i + 1 tokens (the cache
            already holds the s_q new tokens); otherwise all cache_seqlens tokens.
        is_fp8_kvcache: True for an fp8 cache (the dense form reads the cache's own dtype; the
            sparse form needs True).
        indices: the sparse form: (batch, s_q, topk) int32, last dimension contiguous, block id x
            page_size + offset of each token a query attends, -1 skipping an entry (topk 1 to
            2^20); k_cache is then FlashMLA's V3.2 layout (num_blocks, page_size, 1, 656) of
            float8_e4m3fn (or uint8 / int8, the same bytes): per token 512 fp8 latent values in 4
            tiles of 128, their 4 float32 scales (value = fp8 x scale), 64 bf16 rope values; its
            tokens 656 bytes apart, its start on 16 bytes, its blocks a multiple of 16 bytes
            apart; block_table and cache_seqlens are not read (pass None); causal False; no
            k_scale (the cache holds its scales).
        topk_length: the sparse form only, None or (batch,) int32: only the first topk_length[b]
            entries of request b's queries count (the rest are never read).
        attn_sink, extra_k_cache, extra_indices_in_kvcache, extra_topk_length: FlashMLA's, not
            served: None.
        k_scale: (keyword) a dense fp8 cache only, the dequantisation scale (value = fp8 x
            k_scale): a Python float, or a float32 tensor of one element on q's device (read by
            the kernel: no sync).
    Returns:
        out: fresh (batch, s_q, h_q, 512) bfloat16 attention output.
        lse: fresh (batch, h_q, s_q) float32 natural-log sum of exp(softmax_scale q.k) over the
            attended tokens. A row with nothing attended has out 0 and lse +inf. A request whose
            length is negative or beyond its block_table row, or whose used block ids are outside
            the cache, comes back NaN (never read outside the cache). The sparse form: a token
            listed twice counts twice; an entry below -1 or at or past num_blocks x page_size
            makes that query's out and lse NaN, a topk_length outside [0, topk] its request's;
            nothing outside the cache is read and the other queries are right.
    Raises:
        ValueError naming the argument for shapes, dtypes, devices, layouts and page sizes outside
        the above (no GPU sync), or for a plan filled by a call of another shape.
    """
    if not isinstance(plan, MlaDecodePlan):
        raise ValueError(f"plan is {_describe(plan)}: pass the plan get_mla_decode_metadata() returns")
    unserved = (attn_sink, extra_k_cache, extra_indices_in_kvcache, extra_topk_length)  # FlashMLA's: must be None
    if indices is not None:  # the sparse form: checked on every call (attribute reads), then plan -> launch
        shape = check_sparse_inputs(q, k_cache, indices, topk_length, head_dim_v, num_splits, softmax_scale, causal,
                                    is_fp8_kvcache, k_scale, unserved)
        return _prepare_call(plan, shape, q, k_cache, None, softmax_scale)(q, k_cache, indices, topk_length, None)
    # check: a call whose signature (shapes, strides, dtypes, devices, arguments) the plan has seen
    # was checked then, and pays attribute reads only
    dense_only = (topk_length is None and attn_sink is None and extra_k_cache is None
                  and extra_indices_in_kvcache is None and extra_topk_length is None)
    signature = _serving_signature(q, k_cache, block_table, cache_seqlens, head_dim_v, num_splits, softmax_scale,
                                   causal, k_scale, (is_fp8_kvcache, dense_only))
    try:
        run = None if signature is None else plan.launches.get(signature)
    except TypeError:  # an argument that cannot be hashed: check_serving_inputs names it
        run = signature = None
    if run is None:  # check, then the plan (filled by the first call) and how this signature runs
        shape = check_serving_inputs(q, k_cache, block_table, cache_seqlens, head_dim_v, num_splits, softmax_scale,
                                     causal, k_scale, (is_fp8_kvcache, topk_length, *unserved))
        run = _prepare_call(plan, shape, q, k_cache, block_table, softmax_scale)
        if signature is not None:
            plan.launches[signature] = run
    # launch
    return run(q, k_cache, block_table, cache_seqlens, k_scale)


# =============================================================================================
# Input checks: shapes, dtypes, devices, layouts and config (attribute reads, never a GPU->host sync)
# =============================================================================================


def _describe(x):
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    return type(x).__name__


def _same_device(field, tensor, device):
    if tensor.device != device:
        raise ValueError(f"{field} is on {tensor.device} but q is on {device}: every tensor of the input "
                         "must be on q's device")


def _unit_last_stride(field, tensor):
    """A tensor the kernels read with consecutive elements along its last dimension (KV rows,
    block-table rows, lengths): another layout is refused rather than copied (a copy of the cache
    would cost more than the call)."""
    if tensor.stride(-1) != 1:
        raise ValueError(f"{field} has strides {tuple(tensor.stride())}: its last dimension must be "
                         "contiguous (stride 1); pass .contiguous() of it")


def _aligned_cache(field, cache):
    """A cache _mla_decode_kernel may read: it starts on 16 bytes and its blocks and rows (every
    stride but the head's and the dims') are multiples of 16 elements. Where they are not, Triton 3.6
    compiles the kernel's reads of either format with shared memory past what it allots
    (compute-sanitizer on an H200): such a cache is refused."""
    if cache.data_ptr() % 16 or any(stride % 16 for stride in cache.stride()[:-2]):
        raise ValueError(f"{field} starts at address {cache.data_ptr():#x} with strides {tuple(cache.stride())}: "
                         "the cache must start on 16 bytes, its blocks and rows a multiple of 16 elements apart")


def check_inputs(q, kv_data, qo_indptr, kv_indptr, config):
    """Validate q, the indptrs and config; return (q, qo_indptr, kv_indptr, batch, total_kv), q and
    the indptrs as contiguous tensors (a copy only where the caller's are not: q is small, the
    indptrs tiny). Raises ValueError naming the field: q, qo_indptr, kv_indptr, kv_data[...],
    config[...]. The KV tensors themselves are checked by check_kv_format once the route (and so
    the format it reads) is known.

    - indptrs must be int32 (what aiter's kernels and the Triton routes read, and what the runner
      makes). int64 is refused, not converted: a conversion would cost a launch per call and hide
      a harness bug.
    - Decode only: config["q_seq_len"] must be 1 and q must hold one row per batch.
    - Every tensor on q's device.
    - Nothing reads tensor CONTENTS (that needs a GPU->host sync): that the indptrs agree with
      config["kv_seq_len"] and with the KV rows is assumed, see declares_uniform_kv. The Triton
      and Gluon kernels check each row's indptr entries themselves (a row outside the cache, or a
      qo_indptr other than one query row per batch row, comes back as NaN).
    - total_kv is the row count of the first KV format present ("fp8", "bf16", "mxfp4");
      check_kv_format holds the route's own format to it. Formats the route does not read are
      not looked at (each look costs host time on every call).
    """
    if not isinstance(config, dict) or not CONFIG_KEYS <= config.keys():
        missing = [key for key in CONFIG_KEYS if not isinstance(config, dict) or key not in config]
        raise ValueError(f'config["{missing[0]}"] is missing (config: {_describe(config)})')
    if (not isinstance(qo_indptr, torch.Tensor) or qo_indptr.dtype != torch.int32
            or qo_indptr.dim() != 1):
        raise ValueError(f"qo_indptr must be a 1-D int32 tensor of batch + 1 entries, "
                         f"got {_describe(qo_indptr)}")
    batch = qo_indptr.shape[0] - 1
    if batch < 1:
        raise ValueError(f"qo_indptr has {qo_indptr.shape[0]} entries: batch must be at least 1")
    if (not isinstance(kv_indptr, torch.Tensor) or kv_indptr.dtype != torch.int32
            or kv_indptr.shape != qo_indptr.shape):
        raise ValueError(f"kv_indptr must be a 1-D int32 tensor of {batch + 1} entries like "
                         f"qo_indptr, got {_describe(kv_indptr)}")
    if config["batch_size"] != batch:
        raise ValueError(f'config["batch_size"] is {config["batch_size"]} but qo_indptr holds '
                         f"{batch} batches")
    if not isinstance(config["sm_scale"], (int, float)) or not math.isclose(config["sm_scale"], SM_SCALE,
                                                                            rel_tol=1e-6):
        raise ValueError(f'config["sm_scale"] is {config["sm_scale"]!r}: every route uses the problem\'s '
                         f"1/sqrt({QK_HEAD_DIM}) = {SM_SCALE}")
    if config["q_seq_len"] != 1:
        raise ValueError(f'config["q_seq_len"] is {config["q_seq_len"]}: every route here is a '
                         "decode kernel (q_seq_len 1: one query row per batch)")
    q_shape = (batch, NUM_HEADS, QK_HEAD_DIM)
    if not isinstance(q, torch.Tensor) or q.dtype != torch.bfloat16 or q.shape != q_shape:
        raise ValueError(f"q must be a ({batch} = batch * q_seq_len, {NUM_HEADS}, {QK_HEAD_DIM}) "
                         f"bfloat16 tensor, got {_describe(q)}")
    _same_device("qo_indptr", qo_indptr, q.device)
    _same_device("kv_indptr", kv_indptr, q.device)
    if not isinstance(kv_data, dict):
        raise ValueError(f"kv_data must be a dict of KV formats, got {_describe(kv_data)}")
    for kv_format in KV_FORMATS:  # total_kv from the first format present
        if kv_format in kv_data:
            break
    else:
        raise ValueError(f'kv_data["fp8"] is missing (kv_data holds none of {KV_FORMATS})')
    kv = kv_data[kv_format]
    kv = kv if kv_format == "bf16" or not isinstance(kv, (tuple, list)) else kv[0]
    if not isinstance(kv, torch.Tensor) or kv.dim() != 3:
        raise ValueError(f'kv_data["{kv_format}"] holds {_describe(kv)}, not KV rows')
    total_kv = kv.shape[0]
    if total_kv == 0:
        raise ValueError(f'kv_data["{kv_format}"] has 0 rows: the KV cache must not be empty')
    q = q if q.is_contiguous() else q.contiguous()
    qo_indptr = qo_indptr if qo_indptr.stride(0) == 1 else qo_indptr.contiguous()
    kv_indptr = kv_indptr if kv_indptr.stride(0) == 1 else kv_indptr.contiguous()
    return q, qo_indptr, kv_indptr, batch, total_kv


def check_kv_format(kv_data, kv_format, total_kv, device):
    """Validate the one KV format a route reads: shape, dtype, device, and a contiguous last
    dimension (ValueError naming kv_data["<format>"])."""
    field = f'kv_data["{kv_format}"]'
    kv_shape = (total_kv, NUM_KV_HEADS, QK_HEAD_DIM)
    entry = kv_data.get(kv_format)
    if entry is None:
        raise ValueError(f"{field} is missing")
    if kv_format == "bf16":
        if (not isinstance(entry, torch.Tensor) or entry.dtype != torch.bfloat16
                or entry.shape != kv_shape):
            raise ValueError(f"{field} must be a ({total_kv}, 1, {QK_HEAD_DIM}) bfloat16 tensor, "
                             f"got {_describe(entry)}")
        _same_device(field, entry, device)
        _unit_last_stride(field, entry)
        return
    if not isinstance(entry, (tuple, list)) or len(entry) != 2:
        raise ValueError(f"{field} must be a (data, scale) pair, got {_describe(entry)}")
    data, scale = entry
    if kv_format == "fp8":
        if (not isinstance(data, torch.Tensor) or data.dtype not in FP8_DTYPES
                or data.shape != kv_shape):
            raise ValueError(f"{field} must be a ({total_kv}, 1, {QK_HEAD_DIM}) float8 tensor, "
                             f"got {_describe(data)}")
        if (not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32
                or scale.numel() != 1):
            raise ValueError(f"{field} scale must be a float32 tensor of one element, "
                             f"got {_describe(scale)}")
    elif kv_format == "mxfp4":
        if (not isinstance(data, torch.Tensor) or data.element_size() != 1
                or data.shape != (total_kv, NUM_KV_HEADS, MXFP4_ROW_BYTES)):
            raise ValueError(f"{field} must be a ({total_kv}, 1, {MXFP4_ROW_BYTES}) fp4x2 tensor, "
                             f"got {_describe(data)}")
        if (not isinstance(scale, torch.Tensor) or scale.element_size() != 1 or scale.dim() != 2
                or scale.shape[0] < total_kv or scale.shape[1] < MXFP4_SCALES_PER_ROW):
            raise ValueError(f"{field} scales must be a 2-D e8m0 tensor of at least {total_kv} "
                             f"rows and {MXFP4_SCALES_PER_ROW} columns, got {_describe(scale)}")
        _unit_last_stride(f"{field} scales", scale)
    _same_device(field, data, device)
    _same_device(f"{field} scale", scale, device)
    _unit_last_stride(field, data)


def declares_uniform_kv(batch, total_kv, config):
    """True when the shapes say every batch holds config["kv_seq_len"] KV rows.

    Residual assumption (not checked: it would need the indptr contents, a GPU->host sync): when
    total_kv == batch * kv_seq_len, kv_indptr is arange(batch + 1) * kv_seq_len. The runner's
    generator always makes that; a caller with ragged lengths must pass their maximum (or any
    value other than total_kv / batch) as kv_seq_len, as reference.generate_input does.
    What depends on it: the aiter routes' cached work plans, paged rows, and whether a row races."""
    return total_kv == batch * config["kv_seq_len"]


def _serving_signature(q, k_cache, block_table, cache_seqlens, head_dim_v, num_splits, softmax_scale, causal,
                       k_scale, form):
    """Everything check_serving_inputs looks at, as a tuple (attribute reads only; hashable unless
    an argument is not); None when an argument is not what it must be (check_serving_inputs then
    says which)."""
    try:
        # devices as get_device() ints (-1: the CPU): cheaper to make and to hash than torch.device
        scale = (("tensor", k_scale.dtype, tuple(k_scale.shape), k_scale.get_device())
                 if isinstance(k_scale, torch.Tensor) else type(k_scale))
        signature = (q.shape, q.stride(), q.dtype, q.get_device(), k_cache.shape, k_cache.stride(), k_cache.dtype,
                     k_cache.get_device(), block_table.shape, block_table.stride(), block_table.dtype,
                     block_table.get_device(), cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype,
                     cache_seqlens.get_device(), head_dim_v, num_splits, softmax_scale, causal, scale, form,
                     k_cache.data_ptr() % 16 == 0)
        if IS_HIP:  # HIP's JIT also specialises each tensor on its storage fitting 2 GiB (_specialisation)
            signature += tuple(t.untyped_storage().nbytes() <= HIP_RANGE32_BYTES
                               for t in (q, k_cache, block_table, cache_seqlens, k_scale)
                               if isinstance(t, torch.Tensor))
        return signature
    except (AttributeError, TypeError):
        return None


def _check_tensor(field, x, dtype_ok, dims, device=None):
    if not isinstance(x, torch.Tensor) or x.dim() != dims or not dtype_ok(x.dtype):
        raise ValueError(f"{field}: expected a {dims}-D tensor of the documented dtype, got {_describe(x)}")
    if device is not None:
        _same_device(field, x, device)


def _check_q(q):
    """The serving API's q: (batch, s_q, h_q, 576) bfloat16, s_q and h_q within what is served;
    returns (batch, s_q, h_q)."""
    _check_tensor("q", q, lambda d: d == torch.bfloat16, 4)
    batch, s_q, h_q, dims = q.shape
    if dims != QK_HEAD_DIM:
        raise ValueError(f"q must be (batch, s_q, h_q, {QK_HEAD_DIM}), got shape {tuple(q.shape)}")
    if batch < 1:
        raise ValueError(f"q has batch {batch}: at least one request is needed")
    if not 1 <= s_q <= SERVING_MAX_Q_LEN:
        raise ValueError(f"q has s_q {s_q} query tokens per request: 1 to {SERVING_MAX_Q_LEN} are served")
    if not 1 <= h_q <= SERVING_MAX_HEADS:
        raise ValueError(f"q has h_q {h_q} heads: 1 to {SERVING_MAX_HEADS} are served")
    return batch, s_q, h_q


def _check_softmax_scale(softmax_scale):
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
                                      or not 0 < softmax_scale < float("inf")):
        raise ValueError(f"softmax_scale is {softmax_scale!r}: a positive finite number, or None for 1/sqrt(576)")


UNSERVED = ("attn_sink", "extra_k_cache", "extra_indices_in_kvcache", "extra_topk_length")  # FlashMLA's, here None


def _check_form(is_fp8_kvcache, unserved):
    """FlashMLA's arguments this file does not serve are None, and is_fp8_kvcache a bool."""
    for name, value in zip(UNSERVED, unserved, strict=True):
        if value is not None:
            raise ValueError(f"{name} is given: FlashMLA's {name} is not served here, pass None")
    if not isinstance(is_fp8_kvcache, bool):
        raise ValueError(f"is_fp8_kvcache is {is_fp8_kvcache!r}: True or False")


def check_serving_inputs(q, k_cache, block_table, cache_seqlens, head_dim_v, num_splits, softmax_scale, causal,
                         k_scale, form):
    """Validate a dense serving call without reading tensor contents (no GPU sync); return its
    PlanShape. `form`: (is_fp8_kvcache, topk_length, then FlashMLA's unserved arguments). Raises
    ValueError naming the argument. Contents are the kernel's to check: lengths, block ids (their
    rows come back NaN)."""
    is_fp8_kvcache, topk_length, *unserved = form
    _check_form(is_fp8_kvcache, unserved)
    if topk_length is not None:
        raise ValueError("topk_length is given without indices: it counts the sparse form's entries")
    batch, s_q, h_q = _check_q(q)
    _check_tensor("k_cache", k_cache, lambda d: d == torch.bfloat16 or d in FP8_DTYPES, 4, q.device)
    num_blocks, page_size, kv_heads, kv_dims = k_cache.shape
    if kv_heads != NUM_KV_HEADS:
        raise ValueError(f"k_cache has {kv_heads} KV heads (dimension 2 of {tuple(k_cache.shape)}): MLA has one "
                         "latent KV head")
    if kv_dims != QK_HEAD_DIM:
        raise ValueError(f"k_cache must be (num_blocks, page_size, 1, {QK_HEAD_DIM}), got {tuple(k_cache.shape)}"
                         + (": FlashMLA's 656-byte V3.2 cache is read through indices (the sparse form)"
                            if kv_dims == SPARSE_TOKEN_BYTES else ""))
    if page_size not in SERVING_PAGE_SIZES:
        raise ValueError(f"k_cache has page_size {page_size}: the served page sizes are {SERVING_PAGE_SIZES}")
    if num_blocks < 1:
        raise ValueError("k_cache has 0 blocks")
    _unit_last_stride("k_cache", k_cache)
    _aligned_cache("k_cache", k_cache)
    if k_cache.dtype == torch.float8_e4m3fnuz and k_cache.is_cuda and not IS_HIP:
        raise ValueError("k_cache is float8_e4m3fnuz (AMD gfx942's fp8): NVIDIA GPUs read float8_e4m3fn")
    _check_tensor("block_table", block_table, lambda d: d == torch.int32, 2, q.device)
    if block_table.shape[0] != batch or block_table.shape[1] < 1:
        raise ValueError(f"block_table must be (batch = {batch}, max_blocks >= 1) int32, got "
                         f"{tuple(block_table.shape)}")
    _unit_last_stride("block_table", block_table)  # a request's row is read as consecutive entries
    _check_tensor("cache_seqlens", cache_seqlens, lambda d: d == torch.int32, 1, q.device)
    if cache_seqlens.shape[0] != batch:
        raise ValueError(f"cache_seqlens must be (batch = {batch},) int32, got {tuple(cache_seqlens.shape)}")
    _unit_last_stride("cache_seqlens", cache_seqlens)
    if head_dim_v != V_HEAD_DIM:
        raise ValueError(f"head_dim_v is {head_dim_v!r}: MLA's values are the first {V_HEAD_DIM} latent dims")
    if num_splits is not None:
        raise ValueError(f"num_splits is {num_splits!r}: pass None (the plan chooses the splits; set "
                         "plan.num_splits before its first call to fix them)")
    _check_softmax_scale(softmax_scale)
    if not isinstance(causal, bool):
        raise ValueError(f"causal is {causal!r}: True or False")
    fp8 = k_cache.dtype in FP8_DTYPES
    if is_fp8_kvcache and not fp8:
        raise ValueError(f"is_fp8_kvcache is True with a {k_cache.dtype} k_cache")
    if not fp8 and k_scale is not None:
        raise ValueError("k_scale is given for a bfloat16 k_cache: it dequantises an fp8 cache only")
    if fp8 and k_scale is None:
        raise ValueError(f"k_scale is missing: a {k_cache.dtype} k_cache needs its dequantisation scale "
                         "(value = fp8 x k_scale)")
    if isinstance(k_scale, torch.Tensor):
        if k_scale.dtype != torch.float32 or k_scale.numel() != 1 or k_scale.dim() > 1:
            raise ValueError(f"k_scale must be a Python float or a float32 tensor of one element, shape () or "
                             f"(1,), got {_describe(k_scale)}")
        _same_device("k_scale", k_scale, q.device)
    elif fp8 and (isinstance(k_scale, bool) or not isinstance(k_scale, (int, float))):
        raise ValueError(f"k_scale must be a Python float or a float32 tensor of one element, got {_describe(k_scale)}")
    return PlanShape(batch, s_q, h_q, page_size, "fp8" if fp8 else "bf16", causal)




def check_sparse_inputs(q, k_cache, indices, topk_length, head_dim_v, num_splits, softmax_scale, causal,
                        is_fp8_kvcache, k_scale, unserved):
    """Validate a sparse call (FlashMLA's sparse form) without reading tensor contents (no GPU
    sync); return its PlanShape (kv "fp8_sparse", topk). Raises ValueError naming the argument.
    Entry values and lengths are the kernel's to check (their queries come back NaN)."""
    _check_form(is_fp8_kvcache, unserved)
    if head_dim_v != V_HEAD_DIM:
        raise ValueError(f"head_dim_v is {head_dim_v!r}: MLA's values are the first {V_HEAD_DIM} latent dims")
    if num_splits is not None:
        raise ValueError(f"num_splits is {num_splits!r}: pass None (the plan chooses the splits)")
    if causal is not False:
        raise ValueError(f"causal is {causal!r} with indices: sparse attention has no causal mask (the indices "
                         "choose the tokens), pass causal=False")
    if is_fp8_kvcache is not True:
        raise ValueError(f"is_fp8_kvcache is {is_fp8_kvcache!r} with indices: sparse decode reads FlashMLA's fp8 "
                         f"cache of {SPARSE_TOKEN_BYTES} bytes a token, pass is_fp8_kvcache=True")
    if k_scale is not None:
        raise ValueError("k_scale is given with indices: the 656-byte cache holds its own scales")
    batch, s_q, h_q = _check_q(q)
    _check_tensor("k_cache", k_cache, lambda d: d in SPARSE_CACHE_DTYPES, 4, q.device)
    num_blocks, page_size, kv_heads, token_bytes = k_cache.shape
    if kv_heads != 1 or token_bytes != SPARSE_TOKEN_BYTES:
        raise ValueError(f"k_cache with indices must be FlashMLA's V3.2 fp8 layout (num_blocks, page_size, 1, "
                         f"{SPARSE_TOKEN_BYTES}) of float8_e4m3fn, uint8 or int8 bytes, got {_describe(k_cache)}")
    if num_blocks < 1 or page_size < 1:
        raise ValueError(f"k_cache has no tokens: shape {tuple(k_cache.shape)}")
    _unit_last_stride("k_cache", k_cache)
    if k_cache.stride(1) != SPARSE_TOKEN_BYTES or k_cache.stride(0) % 16 or k_cache.data_ptr() % 16:
        raise ValueError(f"k_cache starts at {k_cache.data_ptr():#x} with strides {tuple(k_cache.stride())}: a "
                         f"block's tokens must be {SPARSE_TOKEN_BYTES} bytes apart (as FlashMLA requires), the cache "
                         "must start on 16 bytes and its blocks be a multiple of 16 bytes apart")
    _check_tensor("indices", indices, lambda d: d == torch.int32, 3, q.device)
    if indices.shape[:2] != (batch, s_q) or not 1 <= indices.shape[2] <= SPARSE_MAX_TOPK:
        raise ValueError(f"indices must be (batch = {batch}, s_q = {s_q}, topk) int32 with topk 1 to "
                         f"{SPARSE_MAX_TOPK}, got {tuple(indices.shape)}")
    _unit_last_stride("indices", indices)
    if topk_length is not None:
        _check_tensor("topk_length", topk_length, lambda d: d == torch.int32, 1, q.device)
        if topk_length.shape[0] != batch:
            raise ValueError(f"topk_length must be (batch = {batch},) int32, got {tuple(topk_length.shape)}")
        _unit_last_stride("topk_length", topk_length)
    _check_softmax_scale(softmax_scale)
    return PlanShape(batch, s_q, h_q, page_size, "fp8_sparse", False, indices.shape[2])


# =============================================================================================
# custom_kernel's route: the route tables (data) and the router
# Lists of rows {"max_batch", "max_kv_len", "route", "params"[, "candidates"]}. A row matches a
# call when batch <= max_batch and kv_len <= max_kv_len (None: no bound), kv_len = total_kv //
# batch. The first matching row whose preconditions hold wins (row_preconditions_hold):
#   - a paged row (params["page_size"] > 1) needs lengths declared uniform and a multiple of it;
#   - a route absent here (ROUTE_INFO "portable": False, e.g. hopper_fp8 off sm_90) skips the
#     row: the next row for the same shapes, a portable one, serves them.
# The last row of each table matches everything and always holds (the catch-all).
# "candidates": further configurations the candidate race measures for the row (section
# "Candidate race"); the row's own route and params are its first candidate.
# AITER_ROUTE_TABLE: every row reads every token, so page size 1 everywhere (the runner's
# reference's own setting). A page > 1 row may come back only after a strict check on an MI355X
# shows it right (docs/runner.md, "Page size": aiter's q-length-1 fp8 persistent kernel has no
# paged build and most likely reads one token per page, which the runner's loose check passes).
# Nothing in it has run on an MI355X. Its catch-all is the reference's configuration (persistent,
# page 1, 32 splits, per-tensor q scale): right for any lengths.
# Parameters shared by routes: num_splits = KV splits per batch row (aiter's persistent plan: at
# most that many); q_scale (aiter routes) = how bf16 q becomes fp8: "tensor" max|q| / fp8 max like
# the reference, right for any q; "unit" q.to(fp8) with scale 1, right only while max|q| <= the
# fp8 max (448 e4m3fn, 240 e4m3fnuz; the runner's q is randn).
# tune.py --write and tools/freeze_race_log.py rewrite the literals between the markers: keep
# them plain literals.
# =============================================================================================
# BEGIN ROUTE TABLES
AITER_ROUTE_TABLE = [
    {"max_batch": 4, "max_kv_len": 1024, "route": "aiter_bf16", "params": {},
     "candidates": [
         {"route": "aiter_fp8", "params": {"q_scale": "unit"}},
         {"route": "aiter_a8w8_persistent",
          "params": {"page_size": 1, "num_splits": 16, "q_scale": "unit"}},
         {"route": "aiter_a8w8_persistent",
          "params": {"page_size": 1, "num_splits": 32, "q_scale": "unit"}},
         {"route": "aiter_a16w8_persistent", "params": {"page_size": 1, "num_splits": 16}},
         {"route": "triton_fp8",
          "params": {"num_splits": 8, "block_n": 64, "num_warps": 8, "num_stages": 3}},
         {"route": "triton_mxfp4",
          "params": {"num_splits": 8, "block_n": 64, "num_warps": 8, "num_stages": 2,
                     "qk_dot_scaled": "e4m3"}},
         {"route": "triton_mxfp4",
          "params": {"num_splits": 8, "block_n": 64, "num_warps": 8, "num_stages": 2,
                     "qk_dot_scaled": "none"}},
         {"route": "triton_fp8",
          "params": {"num_splits": 8, "block_n": 128, "num_warps": 8, "num_stages": 3}},
     ]},
    {"max_batch": 32, "max_kv_len": 1024, "route": "aiter_a8w8_persistent",
     "params": {"page_size": 1, "num_splits": 16, "q_scale": "unit"},
     "candidates": [
         {"route": "aiter_a8w8_persistent",
          "params": {"page_size": 1, "num_splits": 8, "q_scale": "unit"}},
         {"route": "aiter_a8w8_persistent",
          "params": {"page_size": 1, "num_splits": 32, "q_scale": "unit"}},
         {"route": "aiter_a16w8_persistent", "params": {"page_size": 1, "num_splits": 16}},
         {"route": "aiter_fp8", "params": {"q_scale": "unit"}},
         {"route": "aiter_bf16", "params": {}},
         {"route": "triton_fp8",
          "params": {"num_splits": 4, "block_n": 64, "num_warps": 8, "num_stages": 3}},
         {"route": "triton_mxfp4",
          "params": {"num_splits": 4, "block_n": 64, "num_warps": 8, "num_stages": 2,
                     "qk_dot_scaled": "e4m3"}},
         {"route": "triton_mxfp4",
          "params": {"num_splits": 4, "block_n": 64, "num_warps": 8, "num_stages": 2,
                     "qk_dot_scaled": "none"}},
         {"route": "triton_fp8",
          "params": {"num_splits": 4, "block_n": 128, "num_warps": 8, "num_stages": 3}},
         {"route": "triton_mxfp4",
          "params": {"num_splits": 4, "block_n": 128, "num_warps": 4, "num_stages": 3,
                     "qk_dot_scaled": "e4m3"}},
     ]},
    {"max_batch": 64, "max_kv_len": 1024, "route": "aiter_fp8", "params": {"q_scale": "unit"},
     "candidates": [
         {"route": "aiter_a8w8_persistent",
          "params": {"page_size": 1, "num_splits": 8, "q_scale": "unit"}},
         {"route": "aiter_a8w8_persistent",
          "params": {"page_size": 1, "num_splits": 16, "q_scale": "unit"}},
         {"route": "aiter_a16w8_persistent", "params": {"page_size": 1, "num_splits": 8}},
         {"route": "triton_fp8",
          "params": {"num_splits": 2, "block_n": 64, "num_warps": 8, "num_stages": 3}},
         {"route": "triton_mxfp4",
          "params": {"num_splits": 2, "block_n": 64, "num_warps": 8, "num_stages": 2,
                     "qk_dot_scaled": "e4m3"}},
         {"route": "triton_mxfp4",
          "params": {"num_splits": 2, "block_n": 64, "num_warps": 8, "num_stages": 2,
                     "qk_dot_scaled": "none"}},
         {"route": "triton_fp8",
          "params": {"num_splits": 2, "block_n": 128, "num_warps": 8, "num_stages": 3}},
         {"route": "triton_mxfp4",
          "params": {"num_splits": 2, "block_n": 128, "num_warps": 4, "num_stages": 3,
                     "qk_dot_scaled": "e4m3"}},
     ]},
    {"max_batch": 256, "max_kv_len": 1024, "route": "aiter_a8w8_persistent",
     "params": {"page_size": 1, "num_splits": 8, "q_scale": "unit"},
     "candidates": [
         {"route": "aiter_a8w8_persistent",
          "params": {"page_size": 1, "num_splits": 4, "q_scale": "unit"}},
         {"route": "aiter_a8w8_persistent",
          "params": {"page_size": 1, "num_splits": 16, "q_scale": "unit"}},
         {"route": "aiter_a16w8_persistent", "params": {"page_size": 1, "num_splits": 8}},
         {"route": "aiter_fp8", "params": {"q_scale": "unit"}},
         {"route": "triton_fp8",
          "params": {"num_splits": 1, "block_n": 64, "num_warps": 8, "num_stages": 3}},
         {"route": "triton_mxfp4",
          "params": {"num_splits": 1, "block_n": 64, "num_warps": 8, "num_stages": 2,
                     "qk_dot_scaled": "e4m3"}},
         {"route": "triton_mxfp4",
          "params": {"num_splits": 1, "block_n": 64, "num_warps": 8, "num_stages": 2,
                     "qk_dot_scaled": "none"}},
         {"route": "triton_fp8",
          "params": {"num_splits": 1, "block_n": 128, "num_warps": 8, "num_stages": 3}},
         {"route": "triton_mxfp4",
          "params": {"num_splits": 1, "block_n": 128, "num_warps": 4, "num_stages": 3,
                     "qk_dot_scaled": "e4m3"}},
     ]},
    {"max_batch": None, "max_kv_len": 1024, "route": "aiter_a8w8_persistent",
     "params": {"page_size": 1, "num_splits": 8, "q_scale": "unit"}},
    {"max_batch": 4, "max_kv_len": 8192, "route": "aiter_a8w8_persistent",
     "params": {"page_size": 1, "num_splits": 16, "q_scale": "unit"},
     "candidates": [
         {"route": "aiter_a8w8_persistent",
          "params": {"page_size": 1, "num_splits": 32, "q_scale": "unit"}},
         {"route": "aiter_a8w8_persistent",
          "params": {"page_size": 1, "num_splits": 8, "q_scale": "unit"}},
         {"route": "aiter_a16w8_persistent", "params": {"page_size": 1, "num_splits": 16}},
         {"route": "aiter_a16w8_persistent", "params": {"page_size": 1, "num_splits": 32}},
         {"route": "aiter_fp8", "params": {"q_scale": "unit"}},
         {"route": "triton_fp8",
          "params": {"num_splits": 32, "block_n": 64, "num_warps": 8, "num_stages": 3}},
         {"route": "triton_mxfp4",
          "params": {"num_splits": 32, "block_n": 64, "num_warps": 8, "num_stages": 2,
                     "qk_dot_scaled": "e4m3"}},
         {"route": "triton_mxfp4",
          "params": {"num_splits": 32, "block_n": 64, "num_warps": 8, "num_stages": 2,
                     "qk_dot_scaled": "none"}},
         {"route": "triton_fp8",
          "params": {"num_splits": 32, "block_n": 128, "num_warps": 8, "num_stages": 3}},
     ]},
    {"max_batch": 32, "max_kv_len": 8192, "route": "aiter_a8w8_persistent",
     "params": {"page_size": 1, "num_splits": 8, "q_scale": "unit"},
     "candidates": [
         {"route": "aiter_a8w8_persistent",
          "params": {"page_size": 1, "num_splits": 16, "q_scale": "unit"}},
         {"route": "aiter_a8w8_persistent",
          "params": {"page_size": 1, "num_splits": 4, "q_scale": "unit"}},
         {"route": "aiter_a16w8_persistent", "params": {"page_size": 1, "num_splits": 8}},
         {"route": "aiter_a16w8_persistent", "params": {"page_size": 1, "num_splits": 4}},
         {"route": "aiter_fp8", "params": {"q_scale": "unit"}},
         {"route": "triton_fp8",
          "params": {"num_splits": 4, "block_n": 64, "num_warps": 8, "num_stages": 3}},
         {"route": "triton_mxfp4",
          "params": {"num_splits": 4, "block_n": 64, "num_warps": 8, "num_stages": 2,
                     "qk_dot_scaled": "e4m3"}},
         {"route": "triton_mxfp4",
          "params": {"num_splits": 4, "block_n": 64, "num_warps": 8, "num_stages": 2,
                     "qk_dot_scaled": "none"}},
         {"route": "triton_fp8",
          "params": {"num_splits": 4, "block_n": 128, "num_warps": 8, "num_stages": 3}},
         {"route": "triton_mxfp4",
          "params": {"num_splits": 4, "block_n": 128, "num_warps": 4, "num_stages": 3,
                     "qk_dot_scaled": "e4m3"}},
     ]},
    {"max_batch": 64, "max_kv_len": 8192, "route": "aiter_a8w8_persistent",
     "params": {"page_size": 1, "num_splits": 8, "q_scale": "unit"},
     "candidates": [
         {"route": "aiter_a8w8_persistent",
          "params": {"page_size": 1, "num_splits": 16, "q_scale": "unit"}},
         {"route": "aiter_a8w8_persistent",
          "params": {"page_size": 1, "num_splits": 4, "q_scale": "unit"}},
         {"route": "aiter_a16w8_persistent", "params": {"page_size": 1, "num_splits": 8}},
         {"route": "aiter_fp8", "params": {"q_scale": "unit"}},
         {"route": "triton_fp8",
          "params": {"num_splits": 2, "block_n": 64, "num_warps": 8, "num_stages": 3}},
         {"route": "triton_mxfp4",
          "params": {"num_splits": 2, "block_n": 64, "num_warps": 8, "num_stages": 2,
                     "qk_dot_scaled": "e4m3"}},
         {"route": "triton_mxfp4",
          "params": {"num_splits": 2, "block_n": 64, "num_warps": 8, "num_stages": 2,
                     "qk_dot_scaled": "none"}},
         {"route": "triton_fp8",
          "params": {"num_splits": 2, "block_n": 128, "num_warps": 8, "num_stages": 3}},
         {"route": "triton_mxfp4",
          "params": {"num_splits": 2, "block_n": 128, "num_warps": 4, "num_stages": 3,
                     "qk_dot_scaled": "e4m3"}},
     ]},
    {"max_batch": 256, "max_kv_len": 8192, "route": "aiter_a8w8_persistent",
     "params": {"page_size": 1, "num_splits": 8, "q_scale": "unit"},
     "candidates": [
         {"route": "aiter_a8w8_persistent",
          "params": {"page_size": 1, "num_splits": 4, "q_scale": "unit"}},
         {"route": "aiter_a8w8_persistent",
          "params": {"page_size": 1, "num_splits": 16, "q_scale": "unit"}},
         {"route": "aiter_a16w8_persistent", "params": {"page_size": 1, "num_splits": 8}},
         {"route": "aiter_fp8", "params": {"q_scale": "unit"}},
         {"route": "triton_fp8",
          "params": {"num_splits": 2, "block_n": 64, "num_warps": 8, "num_stages": 3}},
         {"route": "triton_mxfp4",
          "params": {"num_splits": 2, "block_n": 64, "num_warps": 8, "num_stages": 2,
                     "qk_dot_scaled": "e4m3"}},
         {"route": "triton_mxfp4",
          "params": {"num_splits": 2, "block_n": 64, "num_warps": 8, "num_stages": 2,
                     "qk_dot_scaled": "none"}},
         {"route": "triton_fp8",
          "params": {"num_splits": 2, "block_n": 128, "num_warps": 8, "num_stages": 3}},
         {"route": "triton_mxfp4",
          "params": {"num_splits": 2, "block_n": 128, "num_warps": 4, "num_stages": 3,
                     "qk_dot_scaled": "e4m3"}},
     ]},
    {"max_batch": None, "max_kv_len": 8192, "route": "aiter_a8w8_persistent",
     "params": {"page_size": 1, "num_splits": 8, "q_scale": "unit"}},
    {"max_batch": None, "max_kv_len": None, "route": "aiter_a8w8_persistent",
     "params": {"page_size": 1, "num_splits": 32, "q_scale": "tensor"}},
]

TRITON_ROUTE_TABLE = [
    {"max_batch": 4, "max_kv_len": 1024, "route": "hopper_fp8",
     "params": {"num_splits": 16, "num_warps": 4, "num_stages": 2},
     "candidates": [
         {"route": "hopper_fp8",
          "params": {"num_splits": 8, "num_warps": 4, "num_stages": 2}},
         {"route": "hopper_fp8",
          "params": {"num_splits": 32, "num_warps": 4, "num_stages": 2}},
         {"route": "triton_fp8",
          "params": {"num_splits": 8, "block_n": 64, "num_warps": 8, "num_stages": 3}},
     ]},
    {"max_batch": 4, "max_kv_len": 1024, "route": "triton_fp8",
     "params": {"num_splits": 8, "block_n": 64, "num_warps": 8, "num_stages": 3,}},
    {"max_batch": 32, "max_kv_len": 1024, "route": "hopper_fp8",
     "params": {"num_splits": 4, "num_warps": 4, "num_stages": 2},
     "candidates": [
         {"route": "hopper_fp8",
          "params": {"num_splits": 2, "num_warps": 4, "num_stages": 2}},
         {"route": "hopper_fp8",
          "params": {"num_splits": 8, "num_warps": 4, "num_stages": 2}},
         {"route": "triton_fp8",
          "params": {"num_splits": 4, "block_n": 64, "num_warps": 8, "num_stages": 3}},
     ]},
    {"max_batch": 32, "max_kv_len": 1024, "route": "triton_fp8",
     "params": {"num_splits": 4, "block_n": 64, "num_warps": 8, "num_stages": 3,}},
    {"max_batch": 64, "max_kv_len": 1024, "route": "hopper_fp8",
     "params": {"num_splits": 2, "num_warps": 4, "num_stages": 3},
     "candidates": [
         {"route": "hopper_fp8",
          "params": {"num_splits": 1, "num_warps": 4, "num_stages": 3}},
         {"route": "hopper_fp8",
          "params": {"num_splits": 4, "num_warps": 4, "num_stages": 3}},
         {"route": "triton_fp8",
          "params": {"num_splits": 2, "block_n": 64, "num_warps": 8, "num_stages": 3}},
     ]},
    {"max_batch": 64, "max_kv_len": 1024, "route": "triton_fp8",
     "params": {"num_splits": 2, "block_n": 64, "num_warps": 8, "num_stages": 3,}},
    {"max_batch": 256, "max_kv_len": 1024, "route": "hopper_fp8",
     "params": {"num_splits": 1, "num_warps": 4, "num_stages": 2},
     "candidates": [
         {"route": "hopper_fp8",
          "params": {"num_splits": 2, "num_warps": 4, "num_stages": 2}},
         {"route": "triton_fp8",
          "params": {"num_splits": 1, "block_n": 64, "num_warps": 8, "num_stages": 3}},
     ]},
    {"max_batch": 256, "max_kv_len": 1024, "route": "triton_fp8",
     "params": {"num_splits": 1, "block_n": 64, "num_warps": 8, "num_stages": 3,}},
    {"max_batch": 4, "max_kv_len": 8192, "route": "hopper_fp8",
     "params": {"num_splits": 32, "num_warps": 4, "num_stages": 2},
     "candidates": [
         {"route": "hopper_fp8",
          "params": {"num_splits": 16, "num_warps": 4, "num_stages": 2}},
         {"route": "hopper_fp8",
          "params": {"num_splits": 64, "num_warps": 4, "num_stages": 2}},
         {"route": "triton_fp8",
          "params": {"num_splits": 32, "block_n": 64, "num_warps": 8, "num_stages": 3}},
     ]},
    {"max_batch": 4, "max_kv_len": 8192, "route": "triton_fp8",
     "params": {"num_splits": 32, "block_n": 64, "num_warps": 8, "num_stages": 3,}},
    {"max_batch": 32, "max_kv_len": 8192, "route": "hopper_fp8",
     "params": {"num_splits": 8, "num_warps": 4, "num_stages": 2},
     "candidates": [
         {"route": "hopper_fp8",
          "params": {"num_splits": 4, "num_warps": 4, "num_stages": 2}},
         {"route": "hopper_fp8",
          "params": {"num_splits": 16, "num_warps": 4, "num_stages": 2}},
         {"route": "triton_fp8",
          "params": {"num_splits": 4, "block_n": 64, "num_warps": 8, "num_stages": 3}},
     ]},
    {"max_batch": 32, "max_kv_len": 8192, "route": "triton_fp8",
     "params": {"num_splits": 4, "block_n": 64, "num_warps": 8, "num_stages": 3,}},
    {"max_batch": 64, "max_kv_len": 8192, "route": "hopper_fp8",
     "params": {"num_splits": 4, "num_warps": 4, "num_stages": 2},
     "candidates": [
         {"route": "hopper_fp8",
          "params": {"num_splits": 2, "num_warps": 4, "num_stages": 2}},
         {"route": "hopper_fp8",
          "params": {"num_splits": 8, "num_warps": 4, "num_stages": 2}},
         {"route": "triton_fp8",
          "params": {"num_splits": 2, "block_n": 64, "num_warps": 8, "num_stages": 3}},
     ]},
    {"max_batch": 64, "max_kv_len": 8192, "route": "triton_fp8",
     "params": {"num_splits": 2, "block_n": 64, "num_warps": 8, "num_stages": 3,}},
    {"max_batch": 256, "max_kv_len": 8192, "route": "hopper_fp8",
     "params": {"num_splits": 1, "num_warps": 4, "num_stages": 2},
     "candidates": [
         {"route": "hopper_fp8",
          "params": {"num_splits": 2, "num_warps": 4, "num_stages": 2}},
         {"route": "triton_fp8",
          "params": {"num_splits": 2, "block_n": 64, "num_warps": 8, "num_stages": 3}},
     ]},
    {"max_batch": 256, "max_kv_len": 8192, "route": "triton_fp8",
     "params": {"num_splits": 2, "block_n": 64, "num_warps": 8, "num_stages": 3,}},
    {"max_batch": None, "max_kv_len": None, "route": "triton_fp8",
     "params": {"num_splits": 2, "block_n": 64, "num_warps": 8, "num_stages": 3,}},
]
# END ROUTE TABLES

LAST_ROUTE = None  # route_label of the candidate the last call ran (eval.py shows it)
LAST_CANDIDATE = None  # that candidate, {"route", "params"} (read it, do not modify it)


def active_route_table():
    return AITER_ROUTE_TABLE if HAVE_AITER else TRITON_ROUTE_TABLE


def row_preconditions_hold(row, kv_len, uniform):
    """The row's route exists here (the Hopper route only on sm_90), and a paged row needs
    uniform KV lengths that are a multiple of its page size."""
    page_size = row["params"].get("page_size", 1)
    exists = ROUTE_INFO.get(row["route"], {}).get("portable", True) or row["route"] in ROUTES
    return exists and (page_size == 1 or (uniform and kv_len % page_size == 0))


def select_route(batch, kv_len, uniform=True, table=None):
    """The first row of `table` (default: the active one) with batch <= max_batch and
    kv_len <= max_kv_len whose preconditions hold. `uniform`: every batch holds kv_len rows
    (see declares_uniform_kv)."""
    for row in active_route_table() if table is None else table:
        if ((row["max_batch"] is None or batch <= row["max_batch"])
                and (row["max_kv_len"] is None or kv_len <= row["max_kv_len"])
                and row_preconditions_hold(row, kv_len, uniform)):
            return row
    raise ValueError(f"no route-table row fits batch {batch}, kv_len {kv_len}, uniform {uniform}: "
                     "a table must end with an always-valid catch-all row")


class Selection:
    """What a shape runs: its table row, the candidate it settled on (the row's own route until
    a race settles another), that candidate's route_label, the table, and whether the row's
    candidate race is still to run."""
    __slots__ = ("row", "candidate", "label", "table", "racing")

    def __init__(self, row, candidate, table, racing=False):
        self.row, self.candidate, self.table, self.racing = row, candidate, table, racing
        self.label = route_label(candidate)


# (batch, kv_len, uniform, id(table)) -> Selection. The table is kept so that its id stays its
# own. Tables are data read at call time: replace a table rather than edit it in place (or clear
# this dict).
_SELECTED = {}


def _selection(batch, kv_len, uniform):
    """(cache key, Selection) for a shape under the active table."""
    table = active_route_table()
    key = (batch, kv_len, uniform, id(table))
    selection = _SELECTED.get(key)
    if selection is None:
        row = select_route(batch, kv_len, uniform, table)
        selection = _SELECTED[key] = Selection(row, {"route": row["route"], "params": row["params"]}, table,
                                               races_here(row, batch, kv_len, uniform))
    return key, selection


def _note_ran(candidate, label=None):
    global LAST_ROUTE, LAST_CANDIDATE
    LAST_ROUTE, LAST_CANDIDATE = label or route_label(candidate), candidate


def _run(candidate, data, total_kv, label=None):
    """Run a candidate for the caller and say so in LAST_ROUTE / LAST_CANDIDATE."""
    _note_ran(candidate, label)
    return run_candidate(candidate, data, total_kv)


# =============================================================================================
# The serving API's route: which kernel serves a plan, as data (SERVING_ROUTE_TABLE) and the one
# function that reads it (serving_route)
# =============================================================================================
SERVING_MAX_HEADS = 128
SERVING_MAX_Q_LEN = 8
SERVING_PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
SERVING_ROWS = 16  # query rows (token, head pairs) per program (the MMA's N): portable route, Hopper default
SERVING_SPLIT_MIN_TOKENS = 256  # a split shorter than this costs more in its merge than it saves
SERVING_MAX_SPLITS = 16  # splits of one request at most on the Hopper route (its merge's widest layout)
SERVING_CPU_PROGRAMS = 8  # programs the plan aims for without a GPU (the interpreter)
TMA_TILE = 64  # tokens a Hopper tile reads; TMA reads a tile from one page, so shorter pages are gathered
SPARSE_SPLIT_MIN_ENTRIES = 256  # the portable sparse kernel: a shorter split costs more in its merge than it saves
SPARSE_COMBINE_DIMS = 64  # latent dims a program of the Hopper sparse merge takes
SPARSE_MIN_RUN_TILES = 4  # the Hopper sparse schedule: no program's run of tiles shorter, where it cuts units
SPARSE_MAX_PIECES = 32  # nor any unit cut into more pieces (its merge's widest layout)
# what cutting units costs, in entries' worth of a program's time (measured on an H100): a fixed part (the
# partials written and merged) and a part for each unit a program takes (its q staged, its out stored)
SPARSE_CUT_COST = (544, 160)
SPARSE_ROUTES = ("hopper_sparse", "triton_sparse")  # the sparse kernel's rows: sm_90's wide one, the portable one

# A row serves a plan where its "kv" is the cache's format and, where the row names them, the plan's
# head count is in "heads", its query tokens in "s_q", its page size in "pages", its batch at most
# "max_batch", its query rows (s_q x h_q) at least "min_rows", and the loaded aiter has every
# capability in "needs" (AITER_SERVING_CAPABILITIES). serving_route takes the first such row whose
# route exists here (SERVING_ROUTES: aiter's rows only where aiter loaded, the MI355X; hopper_paged
# and hopper_sparse only on sm_90 with Gluon), hopper_paged only for a cache TMA can read (its blocks
# back to back).
# Row params, Hopper: "rows" query rows a program (16 where absent), "num_warps", "num_stages" (ring
# slots), "waves" (programs per SM slot the split count aims for), "min_chunk" (the shortest split),
# "spans" (the span schedule where the batch can outgrow one wave of chunks), "seesaw" (the seesaw
# kernel: query rows as M), "block_n" (its tile), "pv_f16" (P.V in f16 over an fp8 cache),
# "shared_max" (the row max and rescale factors through shared memory); portable: "block_n",
# "num_warps", "num_stages"; sparse: "rows" (heads a program), "block_n", "num_warps", "num_stages";
# aiter: its route's keyword arguments. docs/design.md says why each row.
SERVING_ROUTE_TABLE = [
    # aiter: the persistent a8w8 kernels with an lse up to 32 requests (h47), 64 heads at any batch
    {"kv": "fp8", "heads": (16, 128), "s_q": (1,), "max_batch": 32, "needs": ("persistent_lse",),
     "route": "aiter_serving_a8w8_persistent", "params": {"num_splits": 16}},
    {"kv": "fp8", "heads": (64,), "s_q": (1,), "needs": ("persistent_lse",), "route": "aiter_serving_a8w8_persistent",
     "params": {"num_splits": 16}},
    # aiter: 32 heads have a persistent lse build from 2026-06-26 only (h47)
    {"kv": "fp8", "heads": (32,), "s_q": (1,), "needs": ("persistent_lse_32_heads",),
     "route": "aiter_serving_a8w8_persistent", "params": {"num_splits": 16}},
    # aiter: the non-persistent fp8 kernels, one split each above 32 requests (h37a)
    {"kv": "fp8", "heads": (16, 128), "s_q": (1,), "needs": (), "route": "aiter_serving_fp8", "params": {}},
    {"kv": "fp8", "heads": (8,), "s_q": (1,), "needs": ("fp8_8_heads",), "route": "aiter_serving_fp8",
     "params": {}},
    # aiter: bf16 with stage 2's merged lse, 2-16 splits so that stage 2 writes it (h37a)
    {"kv": "bf16", "heads": (16, 64, 128), "s_q": (1,), "needs": ("decode_lse",), "route": "aiter_serving_bf16",
     "params": {}},
    # Hopper fp8, 64+ rows on pages of whole tiles: the seesaw kernel (h51-h54, h63), spans cut by tiles
    # plus 8 a segment (h83)
    {"kv": "fp8", "pages": (64, 128), "max_batch": 1024, "min_rows": 64, "route": "hopper_paged",
     "params": {"rows": 64, "num_warps": 4, "num_stages": 4, "waves": 1, "min_chunk": 256, "spans": True,
                "seesaw": True, "segment_tiles": 8}},
    # Hopper fp8, 64+ rows on shorter pages: 64 rows at 8 warps, P.V in f16 (h43, h44c)
    {"kv": "fp8", "pages": SERVING_PAGE_SIZES, "max_batch": 1024, "min_rows": 64, "route": "hopper_paged",
     "params": {"rows": 64, "num_warps": 8, "num_stages": 2, "waves": 1, "min_chunk": 256, "spans": True,
                "pv_f16": True, "shared_max": True}},
    # Hopper fp8, 32-63 rows: 32 rows at 8 warps, P.V in f16 (h49c)
    {"kv": "fp8", "pages": SERVING_PAGE_SIZES, "max_batch": 1024, "min_rows": 32, "route": "hopper_paged",
     "params": {"rows": 32, "num_warps": 8, "num_stages": 2, "waves": 1, "min_chunk": 256, "spans": True,
                "pv_f16": True, "shared_max": True}},
    # Hopper fp8, fewer rows: 16 rows at 4 warps, P.V in f16 (h43)
    {"kv": "fp8", "pages": SERVING_PAGE_SIZES, "max_batch": 1024, "route": "hopper_paged",
     "params": {"num_warps": 4, "num_stages": 2, "waves": 1, "min_chunk": 256, "spans": True, "pv_f16": True}},
    # Hopper bf16, 64+ rows on pages of whole tiles: the seesaw kernel on 32-token tiles (h65), spans as
    # fp8's (h83)
    {"kv": "bf16", "pages": (64, 128), "max_batch": 1024, "min_rows": 64, "route": "hopper_paged",
     "params": {"rows": 64, "num_warps": 4, "num_stages": 4, "waves": 1, "min_chunk": 256, "spans": True,
                "seesaw": True, "block_n": 32, "segment_tiles": 8}},
    # Hopper bf16, 32+ rows: 32 rows at 8 warps (h40, h44c)
    {"kv": "bf16", "pages": SERVING_PAGE_SIZES, "max_batch": 1024, "min_rows": 32, "route": "hopper_paged",
     "params": {"rows": 32, "num_warps": 8, "num_stages": 2, "waves": 1, "min_chunk": 256, "spans": True,
                "shared_max": True}},
    # Hopper bf16, fewer rows: 16 rows with spans (h76)
    {"kv": "bf16", "pages": SERVING_PAGE_SIZES, "max_batch": 1024, "route": "hopper_paged",
     "params": {"num_warps": 4, "num_stages": 2, "waves": 1, "min_chunk": 256, "spans": True}},
    # the portable kernel: every other case, and every GPU and the CPU (h36, h38)
    {"kv": "fp8", "route": "triton_paged", "params": {"block_n": 64, "num_warps": 8, "num_stages": 3}},
    {"kv": "bf16", "route": "triton_paged", "params": {"block_n": 64, "num_warps": 8, "num_stages": 2}},
    # the sparse form (DeepSeek-V3.2's top-k indices over the 656-byte cache), Hopper: the warp-specialised
    # kernel, 64 heads a program (rows), so that each entry is gathered and dequantised once for them all;
    # 64 entries a tile (block_n), three warpgroups of num_warps, num_stages bf16 tiles beside q and P:
    # 225 KiB of shared memory
    {"kv": "fp8_sparse", "route": "hopper_sparse",
     "params": {"rows": 64, "block_n": 64, "num_warps": 4, "num_stages": 2}},
    # the sparse form elsewhere: 16 heads and 16 entries at 8 warps, which compiles without spills for sm_90
    # and gfx950
    {"kv": "fp8_sparse", "route": "triton_sparse",
     "params": {"rows": 16, "block_n": 16, "num_warps": 8, "num_stages": 2}},
]


def serving_row_serves(row, shape):
    """Whether a serving table row serves a plan of this PlanShape (see SERVING_ROUTE_TABLE)."""
    return (row["kv"] == shape.kv and shape.h_q in row.get("heads", (shape.h_q,))
            and shape.s_q in row.get("s_q", (shape.s_q,)) and shape.page_size in row.get("pages", (shape.page_size,))
            and shape.batch <= row.get("max_batch", shape.batch)
            and shape.s_q * shape.h_q >= row.get("min_rows", 0)
            and AITER_SERVING_CAPABILITIES.issuperset(row.get("needs", ())))


def route_rows(row):
    """Query rows per program of a serving table row: its params' "rows" on the Hopper route and the
    sparse one (16 where absent), SERVING_ROWS on the portable one."""
    own_rows = row["route"] in ("hopper_paged",) + SPARSE_ROUTES
    return row["params"].get("rows", SERVING_ROWS) if own_rows else SERVING_ROWS


def sparse_q_format(q, k_cache):
    """The q that the sparse form's route for these tensors computes Q.K^T with: "fp8" where its row
    says so (q's latent dims rounded to fp8 with a power-of-two scale per head, as
    reference.round_q_sparse_fp8 does), else "bf16" (q as given). Its accuracy is judged against
    references with q so rounded (reference.sparse_expected's q_format)."""
    shape = PlanShape(q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1], kv="fp8_sparse", causal=False, topk=1)
    return serving_route(shape, q.device, 0).row.get("q", "bf16")


def _programs_to_fill(device):
    """Programs that keep every multiprocessor busy twice over (SERVING_CPU_PROGRAMS without a GPU,
    and for device None: the compile plans)."""
    return SERVING_CPU_PROGRAMS if device is None or device.type == "cpu" else 2 * sm_count(device)


@functools.lru_cache(maxsize=64)
def sparse_pieces(units, tiles, programs):
    """The most pieces any unit is cut into when units x tiles tiles are cut into `programs` runs,
    the first total % programs a tile longer (_sparse_ws_run's schedule)."""
    total = units * tiles
    cuts = {}
    for p in range(1, programs):
        start = p * (total // programs) + min(p, total % programs)
        if start % tiles:
            cuts[start // tiles] = cuts.get(start // tiles, 0) + 1
    return 1 + max(cuts.values(), default=0)


def sparse_programs(units, tiles, sms, block_n, num_splits=None):
    """The Hopper sparse kernel's program count over `units` units (a query token's 64 heads) of
    `tiles` tiles of block_n entries: a program per unit (each whole: no partials, no merge) where
    its waves take no longer than cutting all the tiles evenly over the `sms` SMs with the cut's cost
    (SPARSE_CUT_COST); else one per SM, no run under SPARSE_MIN_RUN_TILES tiles and no unit in more
    than SPARSE_MAX_PIECES pieces. num_splits given: that many programs a unit (the tiles allowing)."""
    total = units * tiles
    if num_splits:
        programs = min(units * num_splits, total)
    else:
        fixed, per_unit = SPARSE_CUT_COST
        whole = -(-units // sms) * tiles * block_n
        cut = (total * block_n + per_unit * units) / sms + fixed
        if whole <= cut or total < SPARSE_MIN_RUN_TILES:
            return units
        programs = max(1, min(sms, total // SPARSE_MIN_RUN_TILES))
    while programs > 1 and sparse_pieces(units, tiles, programs) > SPARSE_MAX_PIECES:
        programs -= 1
    return programs


class ServingRoute(NamedTuple):
    """What serves a plan: its SERVING_ROUTE_TABLE row, the kernel (None: the row's aiter route),
    the split count, and whether the Hopper kernel runs the span schedule."""
    row: dict
    kernel: object
    num_splits: int
    spans: bool


def serving_route(shape, device, capacity, tma_readable=True, num_splits=None, table=None, here=True):
    """The ServingRoute of a plan of this PlanShape: the first row of `table` (SERVING_ROUTE_TABLE)
    that serves it and whose route exists here (SERVING_ROUTES; here=False: any route, for the
    compile plans), on `device` (None: as on the CPU) for a cache TMA can read or not
    (tma_readable), with:
    - the kernel: aiter's route where aiter loaded; on Hopper, pages of whole tiles through TMA (the
      seesaw kernel where the row says "seesaw", else the tokens-as-M kernel), shorter pages
      gathered a row per token; elsewhere, and for a cache TMA cannot read, the portable kernel;
      the sparse form (kv "fp8_sparse"), the warp-specialised sparse kernel on Hopper, else the
      portable one;
    - the split count: num_splits where given; Hopper, one chunk per program slot of the GPU
      ("waves" of the programs resident at once); portable, enough programs to fill the GPU twice,
      no split shorter than SERVING_SPLIT_MIN_TOKENS of the block table's capacity (tokens), or,
      sparse, than SPARSE_SPLIT_MIN_ENTRIES of the query's entries; the Hopper sparse kernel, its
      program count (sparse_programs: a program per unit, or one per SM over cut units);
    - spans: the row asks for them and the batch can outgrow one wave of chunks (batch x
      SERVING_MAX_SPLITS > the split count); otherwise every chunk schedule fits one wave, the span
      cost model would never take spans, and the kernel without them is the faster one to carry."""
    for row in SERVING_ROUTE_TABLE if table is None else table:
        route, params = row["route"], row["params"]
        if (not serving_row_serves(row, shape) or (here and route not in SERVING_ROUTES)
                or (route == "hopper_paged" and not tma_readable)):
            continue
        if route in AITER_SERVING_ROUTES:
            return ServingRoute(row, kernel=None, num_splits=0, spans=False)
        groups = triton.cdiv(shape.s_q * shape.h_q, route_rows(row))
        if route == "triton_paged":
            splits = num_splits or max(1, min(triton.cdiv(_programs_to_fill(device), shape.batch * groups),
                                              capacity // SERVING_SPLIT_MIN_TOKENS))
            return ServingRoute(row, _mla_decode_kernel, splits, False)
        if route == "hopper_sparse":  # the units' tiles laid end to end, cut into the programs' runs
            units = shape.batch * shape.s_q * triton.cdiv(shape.h_q, route_rows(row))
            tiles = triton.cdiv(shape.topk, params["block_n"])
            programs = sparse_programs(units, tiles, _programs_to_fill(device) // 2, params["block_n"], num_splits)
            return ServingRoute(row, _mla_sparse_hopper_kernel, programs, False)
        if route in SPARSE_ROUTES:  # a program per query token and head group: no query tokens share entries
            programs = shape.batch * shape.s_q * triton.cdiv(shape.h_q, route_rows(row))
            splits = num_splits or max(1, min(triton.cdiv(_programs_to_fill(device), programs),
                                              shape.topk // SPARSE_SPLIT_MIN_ENTRIES))
            kernel = _mla_sparse_hopper_kernel if route == "hopper_sparse" else _mla_sparse_kernel
            return ServingRoute(row, kernel, splits, False)
        if shape.page_size < TMA_TILE:
            kernel = _mla_decode_gathered_hopper_kernel
        else:
            kernel = _mla_decode_seesaw_kernel if params.get("seesaw") else _mla_decode_paged_hopper_kernel
        if num_splits is None:
            # the seesaw kernel's program is three warpgroups of num_warps: two compute, the loader's warp padded
            warps = params["num_warps"] * (3 if params.get("seesaw") else 1)
            sms = 1 if device is None else sm_count(device)
            resident = sms * hopper_programs_per_sm(warps, params["num_stages"], 2 if shape.kv == "bf16" else 1,
                                                    route_rows(row))
            num_splits = max(1, params["waves"] * resident // groups)
        spans = bool(params.get("spans", False)) and shape.batch * SERVING_MAX_SPLITS > num_splits
        return ServingRoute(row, kernel, num_splits, spans)
    raise ValueError(f"no serving route for {shape}: the table must end with a portable row for each format")


# =============================================================================================
# Host machinery: launch, compiled-kernel cache, split workspaces
# =============================================================================================
DIRECT_LAUNCH = triton.__version__.startswith("3.6.")  # see launch()


def _launch_hooks_installed():
    hook = getattr(getattr(triton, "knobs", None), "runtime", None)
    hook = getattr(hook, "launch_enter_hook", None)
    return bool(getattr(hook, "calls", hook))  # Triton 3.6: a HookChain, empty unless a tool adds one


_COMPILED = {}  # launch key -> (Triton's compiled kernel, the constexpr values it is called with)

IS_HIP = torch.version.hip is not None
HIP_RANGE32_BYTES = 2**31 - 1  # HIP: a tensor whose storage fits is compiled with 32-bit buffer offsets


def _specialisation(arg):
    """What Triton specialises a tensor argument on: dtype and 16-byte alignment, and on HIP
    whether its storage is within 2 GiB (Triton then emits buffer loads with 32-bit offsets); for
    a TMA descriptor (Hopper route) its block, layout and its base's, and row-count alignment."""
    base = getattr(arg, "base", None)
    if base is not None:
        return (type(arg), base.dtype, base.data_ptr() % 16 == 0, tuple(arg.block_shape), arg.layout,
                tuple(arg.strides), arg.shape[0] % 16 == 0)
    if IS_HIP:
        return (arg.dtype, arg.data_ptr() % 16 == 0, arg.untyped_storage().nbytes() <= HIP_RANGE32_BYTES)
    return (arg.dtype, arg.data_ptr() % 16 == 0)


def launch(kernel, grid, tensors, scalars, constexprs, num_warps, num_stages, floats=1):
    """kernel[grid](*tensors, *scalars, **constexprs, num_warps=, num_stages=), and from the
    second call with the same key straight through the compiled kernel's own launcher
    (compiled[grid]).

    Why: Triton's dispatcher re-derives every argument's specialisation and the cache key on each
    call; that host time is inside the runner's timing whenever the GPU waits for the launch, and
    in leaderboard mode (a new input per repeat) the cold host path costs far more than the kernel
    on small shapes. The key holds everything the JIT
    specialises on for these arguments: each tensor's dtype and 16-byte alignment (and on HIP its
    2 GiB range), each integer scalar's value (strides: divisibility and the value 1; the leading
    `floats` scalars, sm_scale and such, are floats: not specialised, not in the key), the grid,
    the constexprs, the launch options, and the device.
    Triton's own path is taken for every call under the interpreter, while a launch hook is
    installed (profilers), and on Triton versions other than the one this call convention was
    checked on (3.6: CompiledKernel.__getitem__, which launches on the device's current queue
    exactly as the dispatcher does).
    Returns the direct launcher (run_compiled, constexpr values) where there is one, else None: a
    caller that holds every specialised property of its arguments fixed may call it itself."""
    device = tensors[0].device
    key = (kernel, grid, device, tuple(map(_specialisation, tensors)), scalars[floats:],
           tuple(constexprs.items()), num_warps, num_stages)
    entry = _COMPILED.get(key)
    if entry is None or _launch_hooks_installed():
        compiled = kernel[grid](*tensors, *scalars, **constexprs, num_warps=num_warps, num_stages=num_stages)
        if DIRECT_LAUNCH and isinstance(compiled, triton.compiler.CompiledKernel):
            # every constexpr in signature order, defaults included, as Triton's own launch passes them
            values = dict(keyword_defaults(kernel), **constexprs)
            _keep_descriptor_encodings(compiled)
            entry = _COMPILED[key] = (compiled[(*grid, 1, 1)[:3]],
                                      tuple(values[name] for name in kernel.arg_names[len(tensors) + len(scalars):]))
        return entry
    run_compiled, constexpr_values = entry
    run_compiled(*tensors, *scalars, *constexpr_values)
    return entry


def _closure_cells(fn):
    """A Python function's closure variables by name ({} for a C function)."""
    code = getattr(fn, "__code__", None)
    return {} if code is None else dict(zip(code.co_freevars, fn.__closure__ or (), strict=True))


def _keep_descriptor_encodings(compiled):
    """Triton 3.6's launcher encodes every TMA descriptor argument into a fresh CUtensorMap
    (make_tensordesc_arg: cuTensorMapEncodeTiled and a Python object) on every launch, in the
    wrapper around its C launch function. Replace that wrapper on this compiled kernel by one that
    passes the same arguments but keeps each descriptor's encoding on the descriptor (per kernel:
    the encoding depends on the kernel's view of it), so a descriptor reused across calls is
    encoded once. Kernels without descriptors, launchers that are not the 3.6 one (the
    wrapper's variables) and launchers wrapped here already (this wrapper has none of them) are left
    as they are."""
    run = compiled.run
    cells = _closure_cells(run.launch)
    names = ("launcher", "tensordesc_indices", "tensordesc_meta")
    if not all(name in cells for name in names):  # no descriptors, another Triton, or wrapped already
        return
    try:
        from triton.backends.nvidia.driver import _BASE_ARGS_FORMAT_LEN as first  # launch arguments before the kernel's
        from triton.backends.nvidia.driver import make_tensordesc_arg as encode
    except ImportError:
        return
    c_launch, places, metas = (cells[name].cell_contents for name in names)
    places = sorted(places)
    if metas is None or len(metas) != len(places):
        return

    def launch(*args):
        args = list(args)
        for place, meta in zip(reversed(places), reversed(metas), strict=True):
            descriptor = args[first + place]
            known = descriptor.__dict__.setdefault("launch_arguments", {})  # lives as long as the descriptor
            if id(meta) not in known:
                known[id(meta)] = encode(descriptor, meta)
            args[first + place:first + place + 1] = known[id(meta)]
        return c_launch(*args)
    run.launch = launch


_SM_COUNTS = {}  # device -> multiprocessors (SMs)


def sm_count(device):
    """The GPU's multiprocessors (SMs, or CUs), looked up once per device."""
    if device not in _SM_COUNTS:
        _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNTS[device]


_SPLIT_WORKSPACES = {}  # (batch, num_splits, device) -> (partials, lse, tickets)


def split_workspace(batch, num_splits, device):
    """Float32 partials and lse for every (batch row, split), two tickets per batch row. Cached per
    shape: allocated once, the tickets zeroed once (the last split of a row resets its arrival
    ticket; the Hopper cooperative merge's counters only grow, by num_splits per call).
    Two calls sharing a shape must not run concurrently on the GPU (the runner's never do)."""
    key = (batch, num_splits, device)
    workspace = _SPLIT_WORKSPACES.get(key)
    if workspace is None:
        workspace = _SPLIT_WORKSPACES[key] = (
            torch.empty(batch * num_splits, V_HEAD_DIM, NUM_HEADS, dtype=torch.float32, device=device),
            torch.empty(batch * num_splits, NUM_HEADS, dtype=torch.float32, device=device),
            torch.zeros(2 * batch, dtype=torch.int32, device=device),  # arrivals; cooperative counters (Hopper)
        )
    return workspace


def keyword_defaults(fn):
    """The defaulted parameters of a route, or of a @triton.jit kernel (its constexprs: an
    ahead-of-time compile must name them all)."""
    return {name: param.default for name, param in inspect.signature(getattr(fn, "fn", fn)).parameters.items()
            if param.default is not inspect.Parameter.empty}


def fp8_tensor_scale(x, fp8_dtype):
    """The runner's per-tensor fp8 scale of bf16 x, in bf16 arithmetic: max|x| (clamped below at
    1e-12) / fp8 max; a 0-d bf16 tensor, no host sync. The one definition: the aiter routes'
    q_scale "tensor", the race's judge and its inputs use it."""
    return torch.linalg.vector_norm(x, float("inf")).clamp(min=1e-12) / FP8_MAX[fp8_dtype]
# =============================================================================================
# Triton kernels and their routes (portable)
# NVIDIA, ROCm without aiter, and the CPU under TRITON_INTERPRET=1. Both kernels: one program =
# one request x one KV split x a group of query rows (custom_kernel: the 16 heads of its one
# token); tokens as the MMA's M dimension; online softmax in float32, base 2; the split merge
# fused into the request's last split (one launch per call). _mla_decode_kernel (fp8 or bf16
# cache) serves both entry points; the mxfp4 kernel serves custom_kernel's mxfp4 route.
# =============================================================================================


@triton.jit
def _row_poison(QO_INDPTR, batch, kv_begin, kv_end, kv_rows):
    """0.0, or NaN when the indptrs do not describe decode over this cache: qo_indptr[batch] !=
    batch (one query row per batch row), or the row's KV segment [kv_begin, kv_end) reaches
    outside rows [0, kv_rows) or runs backwards. Added to the row's output scale: a poisoned row
    comes back NaN, never as plausible numbers."""
    q_row = tl.load(QO_INDPTR + batch)
    bad = (q_row != batch) | (kv_begin < 0) | (kv_end > kv_rows) | (kv_end < kv_begin)
    return tl.where(bad, float("nan"), 0.0)


@triton.jit
def _split_bounds(kv_begin, kv_end, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """[begin, end) of this split's KV rows: the row's rows cut into NUM_SPLITS whole-tile chunks
    (a short row leaves the last splits empty: begin >= end)."""
    split_len = tl.cdiv(tl.cdiv(kv_end - kv_begin, NUM_SPLITS), BLOCK_N) * BLOCK_N
    split_begin = kv_begin + split * split_len
    return split_begin, tl.minimum(split_begin + split_len, kv_end)


@triton.jit
def _row_range(QO_INDPTR, KV_INDPTR, batch, kv_rows, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """This split's [begin, end) and the row's poison (_row_poison) for kernels that load KV rows
    with plain loads: a poisoned row reads nothing (begin = end)."""
    kv_begin = tl.load(KV_INDPTR + batch)
    kv_end = tl.load(KV_INDPTR + batch + 1)
    poison = _row_poison(QO_INDPTR, batch, kv_begin, kv_end, kv_rows)
    split_begin, split_end = _split_bounds(kv_begin, tl.where(poison != poison, kv_begin, kv_end), split, NUM_SPLITS,
                                           BLOCK_N)
    return split_begin, split_end, poison


@triton.jit
def _poison_of(x):
    """0.0, or NaN when the tile holds a NaN or an infinity (x * 0 is NaN exactly then): added to
    the output's scale so that poison in q stays visible whatever a conversion does with it."""
    return tl.sum(tl.sum(x * 0.0, 1), 0)


@triton.jit
def _last_split_to_finish(SPLIT_TICKETS, batch, NUM_SPLITS: tl.constexpr):
    """Call after storing this split's partial: true in the one program of the batch row that draws
    the last ticket, which may then read every split's partial (and must reset the ticket to 0)."""
    # All threads' partial stores must precede the release of the ticket (acq_rel, GPU scope).
    tl.debug_barrier()
    return tl.atomic_add(SPLIT_TICKETS + batch, 1, sem="acq_rel") == NUM_SPLITS - 1


@triton.jit
def _split_lse(running_max, running_sum):
    """(lse, safe sum) of one split's online softmax. An empty split (a row shorter than the split
    grid) has sum 0: its partial is 0 and its lse -inf, so the merge gives it weight 0."""
    has_tokens = running_sum != 0  # (NaN, a poisoned row's, stays NaN)
    safe_sum = tl.where(has_tokens, running_sum, 1.0)
    return tl.where(has_tokens, running_max + tl.log2(safe_sum), float("-inf")), safe_sum


@triton.jit
def _merge_splits(PARTIAL_O, PARTIAL_LSE, first_slot, offsets, heads, NUM_SPLITS: tl.constexpr,
                  NUM_HEADS: tl.constexpr, SLOT_SIZE: tl.constexpr):
    """The row's attention at `offsets` (a (rows x heads) tile of element offsets into one split's
    partial of SLOT_SIZE floats): the splits' partials weighted by 2^(lse - max lse) per head, over
    the sum of the weights; and the merged base-2 lse per head. A row with no KV at all (every lse
    -inf) merges to 0 with lse -inf; a NaN lse (a poisoned row) merges to NaN. Other programs wrote
    the partials: they are read past L1 (.cg)."""
    lse_max = tl.full([NUM_HEADS], float("-inf"), tl.float32)
    for s in range(NUM_SPLITS):
        lse_max = tl.maximum(lse_max, tl.load(PARTIAL_LSE + (first_slot + s) * NUM_HEADS + heads, cache_modifier=".cg"))
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight_sum = tl.zeros([NUM_HEADS], tl.float32)
    merged = tl.zeros(offsets.shape, tl.float32)
    for s in range(NUM_SPLITS):
        weight = tl.exp2(tl.load(PARTIAL_LSE + (first_slot + s) * NUM_HEADS + heads, cache_modifier=".cg") - lse_max)
        weight_sum += weight
        merged += tl.load(PARTIAL_O + (first_slot + s) * SLOT_SIZE + offsets, cache_modifier=".cg") * weight[None, :]
    merged *= tl.where(weight_sum > 0, 1.0 / tl.where(weight_sum > 0, weight_sum, 1.0), weight_sum * 0.0)[None, :]
    return merged, lse_max + tl.log2(weight_sum)


# --- fp8 and bf16 caches: custom_kernel's contiguous rows and the serving API's pages --------
@triton.jit
def _request_span(QO_INDPTR, KV_INDPTR, CACHE_SEQLENS, batch, kv_rows, capacity, PAGE_SIZE: tl.constexpr):
    """(first cache row, length, poison) of one request. PAGE_SIZE 0: custom_kernel's contiguous
    rows, kv_indptr's segment, poisoned as _row_poison says; a page size: cache_seqlens[batch]
    tokens through the block table, poisoned when negative or longer than the `capacity` tokens
    the request's block-table row can hold. A poisoned request has length 0: it reads nothing."""
    if PAGE_SIZE == 0:
        kv_begin = tl.load(KV_INDPTR + batch)
        kv_end = tl.load(KV_INDPTR + batch + 1)
        poison = _row_poison(QO_INDPTR, batch, kv_begin, kv_end, kv_rows)
        seq_len = kv_end - kv_begin
    else:
        kv_begin = 0
        seq_len = tl.load(CACHE_SEQLENS + batch)
        poison = tl.where((seq_len < 0) | (seq_len > capacity), float("nan"), 0.0)
    return kv_begin, tl.where(poison != poison, 0, seq_len), poison


@triton.jit
def _pages_poison(BT_ROW, begin, end, num_blocks, PAGE_SIZE: tl.constexpr, IDS: tl.constexpr = 64):
    """0.0, or NaN when a block-table entry of the tokens [begin, end) is outside [0, num_blocks).
    Checked before the split reads anything: a poisoned split reads nothing."""
    last = tl.cdiv(end, PAGE_SIZE)
    bad = tl.zeros([IDS], tl.int32)
    for first in range(begin // PAGE_SIZE, last, IDS):
        pages = first + tl.arange(0, IDS)
        ids = tl.load(BT_ROW + pages, mask=pages < last, other=0)
        bad |= ((ids < 0) | (ids >= num_blocks)).to(tl.int32)
    return tl.where(tl.max(bad, 0) > 0, float("nan"), 0.0)


@triton.jit
def _page_rows(KV, BT_ROW, tile_begin, tokens, valid, stride_kv_block, stride_kv_token, PAGE_SIZE: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Pointers to a tile's BLOCK_N cache rows on pages, a (BLOCK_N x 1) column; tile_begin is a
    token position. The block's offset is 64-bit (caches past 2^31 bytes), offsets inside a page
    32-bit. Pages of at least one tile: one block id per tile (tiles start at multiples of
    BLOCK_N); smaller pages: a block id per token (none loaded past `valid`)."""
    if PAGE_SIZE >= BLOCK_N:
        block = tl.load(BT_ROW + tile_begin // PAGE_SIZE).to(tl.int64)
        rows = KV + block * stride_kv_block + (tile_begin % PAGE_SIZE + tokens)[:, None] * stride_kv_token
    else:
        positions = tile_begin + tokens
        block = tl.load(BT_ROW + positions // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        rows = KV + (block * stride_kv_block + (positions % PAGE_SIZE) * stride_kv_token)[:, None]
    return rows


@triton.jit
def _load_q_t(q_rows, row_ok, latent, rope, KV_FP8: tl.constexpr, FP8_DTYPE: tl.constexpr,
              FP8_MAX: tl.constexpr, LATENT: tl.constexpr):
    """Q^T of the program's query rows (latent 512 x ROWS, rope 64 x ROWS; rows past row_ok are 0),
    its scale and its poison. fp8 cache: quantised to the cache's fp8 type with the rows' own amax
    as scale; poison is _poison_of(q) (a NaN or an infinity would otherwise vanish into the
    scale). bf16 cache: q as it is, scale 1; a NaN or an infinity reaches its own row's scores."""
    q_latent_t = tl.load(q_rows[None, :] + latent[:, None], mask=row_ok[None, :], other=0.0)
    q_rope_t = tl.load(q_rows[None, :] + LATENT + rope[:, None], mask=row_ok[None, :], other=0.0)
    q_scale = 1.0
    poison = 0.0
    if KV_FP8:
        q_latent_t = q_latent_t.to(tl.float32)
        q_rope_t = q_rope_t.to(tl.float32)
        q_amax = tl.maximum(tl.max(tl.max(tl.abs(q_latent_t), 1), 0), tl.max(tl.max(tl.abs(q_rope_t), 1), 0))
        q_scale = tl.maximum(q_amax, 1e-12) / FP8_MAX
        poison = _poison_of(q_latent_t) + _poison_of(q_rope_t)
        q_latent_t = (q_latent_t / q_scale).to(FP8_DTYPE)
        q_rope_t = (q_rope_t / q_scale).to(FP8_DTYPE)
    return q_latent_t, q_rope_t, q_scale, poison


@triton.jit
def _query_rows(group, num_heads, q_len, ROWS: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """The program's query rows, the (query token, head) pairs group * ROWS ... of its request in
    token-major order: (valid, query token, head) per row, rows past the request's masked.
    custom_kernel's rows (PAGE_SIZE 0) are its one token's ROWS = 16 heads, known at compile time:
    the divisions and masks of the general case cost the fp8 route its last registers on sm_90
    (spills). Called before and after the tile loop, not kept through it."""
    if PAGE_SIZE == 0:  # grid (batch, splits, 1)
        head = tl.arange(0, ROWS)
        row_ok, q_token = head < ROWS, 0
    else:
        rows = group * ROWS + tl.arange(0, ROWS)
        row_ok, q_token, head = rows < q_len * num_heads, rows // num_heads, rows % num_heads
    return row_ok, q_token, head


@triton.jit
def _store_rows(OUT, LSE, out_rows, lse_rows, row_ok, out_t, lse2, latent, WRITE_LSE: tl.constexpr):
    """Store the program's rows: out (ROWS x 512) from out_t (512 x ROWS); lse from its base-2
    value in natural log, +inf for a row with nothing attended (lse2 -inf), NaN kept."""
    tl.store(out_rows[:, None] + latent[None, :], tl.trans(out_t).to(OUT.dtype.element_ty), mask=row_ok[:, None])
    if WRITE_LSE:
        tl.store(lse_rows, tl.where(lse2 == float("-inf"), float("inf"), lse2 * 0.6931471805599453), mask=row_ok)


@triton.jit
def _mla_decode_kernel(
    Q, KV, KV_SCALE, QO_INDPTR, KV_INDPTR, CACHE_SEQLENS, BLOCK_TABLE, OUT, LSE, PARTIAL_O, PARTIAL_LSE,
    SPLIT_TICKETS,
    sm_scale_log2, kv_scale_value, kv_rows, capacity, num_heads, q_len,
    stride_q_batch, stride_q_token, stride_q_head, stride_kv_block, stride_kv_token, stride_bt_batch,
    stride_o_batch, stride_o_token, stride_o_head, stride_lse_batch, stride_lse_head, stride_lse_token,
    FP8_MAX: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr = True,
    PAGE_SIZE: tl.constexpr = 0, CAUSAL: tl.constexpr = False, WRITE_LSE: tl.constexpr = False,
    KV_SCALE_IN_TENSOR: tl.constexpr = True, ROWS: tl.constexpr = 16,
):
    """Split-KV MLA decode over an fp8 or bf16 latent cache, the split merge fused into the last
    split. One core for both entry points: custom_kernel's contiguous rows (PAGE_SIZE 0, rows
    from kv_indptr, 16 heads, one query token) and the serving API's paged cache (PAGE_SIZE a
    power of two, cache_seqlens and a block table, any heads, q_len query tokens, CAUSAL masks).

    Grid (batch, NUM_SPLITS, row groups). A program takes ROWS query rows of one request, the
    (query token, head) pairs group * ROWS ... in token-major order, and one split of the
    request's tokens. Products are computed transposed, tokens as the M dimension: S^T = K.Q^T
    is (BLOCK_N x ROWS) and O^T += V^T.P^T is (512 x ROWS); M a multiple of 64 lets Hopper issue
    wgmma where M = 16 rows would only allow mma.sync; AMD's MFMA takes either shape.
    fp8 cache (KV_FP8): Q^T is quantised once to fp8 with the program's own amax; V feeds O^T
    after an exact fp8 -> f16 conversion and P is f16 (P in fp8 would cost 2% error); the
    dequantisation scale (KV_SCALE, or kv_scale_value) multiplies the scores and the output.
    bf16 cache: q stays bf16, P is bf16.
    Each loop step loads one (BLOCK_N x 576) tile; tokens past the split (or, CAUSAL, past every
    row's last token) are never loaded, so NaN in a page's unused tail never meets a 0 in P.V.
    NUM_SPLITS > 1: each program writes a float32 partial O^T (512 x ROWS) and its base-2
    log-sum-exp; the program that draws the last ticket of its (request, row group) merges all
    splits, writes out (and lse) and resets the ticket to 0 for the next call.
    Poison: a request whose indptr segment or length is impossible, a split whose block ids leave
    the cache, or (fp8) NaN or inf in q make the rows NaN; a row with nothing attended is 0 with
    lse +inf. Bytes: 576 (fp8) or 1152 (bf16) per KV token and row group; per split a
    32 KiB partial written and read once; q, out, lse.
    """
    batch = tl.program_id(0)
    split = tl.program_id(1)
    group = tl.program_id(2)
    kv_begin, seq_len, poison = _request_span(QO_INDPTR, KV_INDPTR, CACHE_SEQLENS, batch, kv_rows, capacity,
                                              PAGE_SIZE)
    split_begin, split_end = _split_bounds(0, seq_len, split, NUM_SPLITS, BLOCK_N)
    bt_row = BLOCK_TABLE + batch.to(tl.int64) * stride_bt_batch
    if PAGE_SIZE > 0:
        poison += _pages_poison(bt_row, split_begin, split_end, kv_rows, PAGE_SIZE)
    else:  # rows inside a split are addressed with 32-bit offsets from its first row (below)
        poison += tl.where(tl.cast(split_end - split_begin, tl.int64) * stride_kv_token >= 2**31, float("nan"), 0.0)
    split_end = tl.where(poison != poison, split_begin, split_end)

    row_ok, q_token, head = _query_rows(group, num_heads, q_len, ROWS, PAGE_SIZE)
    loop_end = split_end
    if CAUSAL:  # query token t attends the first seq_len - q_len + t + 1 tokens
        row_end = seq_len - q_len + 1 + q_token
        loop_end = tl.minimum(split_end, tl.max(tl.where(row_ok, row_end, 0), 0))

    latent = tl.arange(0, LATENT)
    rope = tl.arange(0, ROPE)
    tokens = tl.arange(0, BLOCK_N)
    q_rows = Q + batch.to(tl.int64) * stride_q_batch + q_token * stride_q_token + head * stride_q_head
    q_latent_t, q_rope_t, q_scale, q_poison = _load_q_t(q_rows, row_ok, latent, rope, KV_FP8,
                                                        KV.dtype.element_ty, FP8_MAX, LATENT)
    poison += q_poison
    if KV_SCALE_IN_TENSOR:
        kv_scale = tl.load(KV_SCALE)
    else:
        kv_scale = kv_scale_value
    score_scale = sm_scale_log2 * kv_scale * q_scale

    running_max = tl.full([ROWS], float("-inf"), tl.float32)
    running_sum = tl.zeros([ROWS], tl.float32)
    acc_t = tl.zeros([LATENT, ROWS], tl.float32)
    # Tiles: cache rows kv_begin + [split_begin, loop_end) (on pages kv_begin is 0: token positions).
    # Contiguous rows: a 64-bit pointer to the split's first row (caches past 2^31 bytes) and
    # 32-bit offsets from it (a 64-bit address per tile costs the sm_90 configs spills); a split of
    # 2^31 elements or more is poisoned above, never read.
    loop_end += kv_begin
    kv_split = KV + tl.cast(kv_begin + split_begin, tl.int64) * stride_kv_token
    for tile_begin in range(kv_begin + split_begin, loop_end, BLOCK_N):
        valid = tile_begin + tokens < loop_end
        if PAGE_SIZE == 0:
            kv_ptrs = kv_split + (tile_begin - kv_begin - split_begin + tokens)[:, None] * stride_kv_token
        else:
            kv_ptrs = _page_rows(KV, bt_row, tile_begin, tokens, valid, stride_kv_block, stride_kv_token, PAGE_SIZE,
                                 BLOCK_N)
        k_latent = tl.load(kv_ptrs + latent[None, :], mask=valid[:, None], other=0.0)
        k_rope = tl.load(kv_ptrs + LATENT + rope[None, :], mask=valid[:, None], other=0.0)
        scores_t = tl.dot(k_latent, q_latent_t)
        scores_t = tl.dot(k_rope, q_rope_t, scores_t)
        if CAUSAL:
            attended = valid[:, None] & (tile_begin + tokens[:, None] < row_end[None, :])
        else:
            attended = valid[:, None]
        scores_t = tl.where(attended, scores_t * score_scale, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores_t, 0))
        shift = new_max
        if CAUSAL:  # a row may have no token in this tile yet: shift it by 0, not by -inf
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        correction = tl.exp2(running_max - shift)
        probs_t = tl.exp2(scores_t - shift[None, :])
        running_sum = running_sum * correction + tl.sum(probs_t, 0)
        if KV_FP8:
            acc_t = tl.dot(tl.trans(k_latent.to(tl.float16)), probs_t.to(tl.float16), acc_t * correction[None, :])
        else:
            acc_t = tl.dot(tl.trans(k_latent), probs_t.to(tl.bfloat16), acc_t * correction[None, :])
        running_max = new_max

    row_ok, q_token, head = _query_rows(group, num_heads, q_len, ROWS, PAGE_SIZE)
    out_rows = OUT + batch.to(tl.int64) * stride_o_batch + q_token * stride_o_token + head * stride_o_head
    lse_rows = LSE + batch * stride_lse_batch + head * stride_lse_head + q_token * stride_lse_token
    lse2, safe_sum = _split_lse(running_max, running_sum)
    if NUM_SPLITS == 1:
        out_scale = tl.where(running_sum != 0, kv_scale / safe_sum, 0.0) + poison
        _store_rows(OUT, LSE, out_rows, lse_rows, row_ok, acc_t * out_scale[None, :], lse2 + poison, latent,
                    WRITE_LSE)
    else:
        pair = batch * tl.num_programs(2) + group
        slot = pair * NUM_SPLITS + split
        r = tl.arange(0, ROWS)
        offsets = latent[:, None] * ROWS + r[None, :]
        tl.store(PARTIAL_O + slot * LATENT * ROWS + offsets, acc_t / safe_sum[None, :])
        tl.store(PARTIAL_LSE + slot * ROWS + r, lse2 + poison)
        if _last_split_to_finish(SPLIT_TICKETS, pair, NUM_SPLITS):
            merged_t, merged_lse2 = _merge_splits(PARTIAL_O, PARTIAL_LSE, pair * NUM_SPLITS, offsets, r, NUM_SPLITS,
                                                  ROWS, LATENT * ROWS)
            _store_rows(OUT, LSE, out_rows, lse_rows, row_ok, merged_t * kv_scale, merged_lse2, latent, WRITE_LSE)
            tl.atomic_xchg(SPLIT_TICKETS + pair, 0)


DECODE_FLOATS = 2  # decode_launch_args's scalars open with sm_scale_log2 and kv_scale_value (launch)


def decode_tensors(q, kv, kv_scale, out, lse, workspace, indptrs, cache_seqlens, block_table):
    """The tensor arguments of _mla_decode_kernel, in its order. The workspace's tickets stand in
    for the pointers a mode does not read (the indptrs on pages, the paging tensors on contiguous
    rows, KV_SCALE for a float scale, LSE where none is written)."""
    partial_o, partial_lse, tickets = workspace
    qo_indptr, kv_indptr = indptrs if indptrs is not None else (tickets, tickets)
    return (q, kv, kv_scale if isinstance(kv_scale, torch.Tensor) else tickets, qo_indptr, kv_indptr,
            tickets if cache_seqlens is None else cache_seqlens, tickets if block_table is None else block_table,
            out, tickets if lse is None else lse, partial_o, partial_lse, tickets)


def decode_launch_args(q, q_strides, kv, kv_scale, out, out_strides, lse, lse_strides, workspace, indptrs,
                       paging, sm_scale):
    """(tensors, scalars) of _mla_decode_kernel for one call, as both entry points build them (the
    API's calls after its first reuse these scalars with decode_tensors). q_strides /
    out_strides (batch, token, head) and lse_strides (batch, head, token) of the caller's tensors
    (0 where a dimension is absent); kv_scale a float32 tensor or a Python float; indptrs
    (qo_indptr, kv_indptr) for contiguous rows, else None; paging (cache_seqlens, block_table,
    page_size) for a paged cache, else None."""
    cache_seqlens, block_table, page_size = paging if paging is not None else (None, None, 0)
    _aligned_cache("the cache", kv)
    scale_value = 1.0 if isinstance(kv_scale, torch.Tensor) else float(kv_scale)
    if paging is None:  # kv (rows, 1, 576), q (batch, heads, 576)
        capacity, stride_block, stride_token, stride_bt, q_len = 0, 0, kv.stride(0), 0, 1
    else:  # kv (blocks, page_size, 1, 576), q (batch, q_len, heads, 576)
        capacity, stride_block, stride_token, stride_bt, q_len = (block_table.shape[1] * page_size, kv.stride(0),
                                                                  kv.stride(1), block_table.stride(0), q.shape[1])
    tensors = decode_tensors(q, kv, kv_scale, out, lse, workspace, indptrs, cache_seqlens, block_table)
    scalars = (sm_scale * LOG2E, scale_value, kv.shape[0], capacity, q.shape[-2], q_len, *q_strides, stride_block,
               stride_token, stride_bt, *out_strides, *lse_strides)
    return tensors, scalars


def triton_fp8_route(q, kv_data, qo_indptr, kv_indptr, config, num_splits=1, block_n=64, num_warps=8, num_stages=3):
    """Split-KV decode over kv_data["fp8"] in one launch (see _mla_decode_kernel, contiguous rows)."""
    kv_fp8, kv_scale = kv_data["fp8"]
    batch = kv_indptr.shape[0] - 1
    out = torch.empty(q.shape[0], NUM_HEADS, V_HEAD_DIM, dtype=torch.bfloat16, device=q.device)
    tensors, scalars = decode_launch_args(
        q, (q.stride(0), 0, q.stride(1)), kv_fp8, kv_scale, out, (out.stride(0), 0, out.stride(1)), None, (0, 0, 0),
        split_workspace(batch, num_splits, q.device), (qo_indptr, kv_indptr), None, SM_SCALE)
    launch(_mla_decode_kernel, (batch, num_splits, 1), tensors, scalars,
           {"FP8_MAX": FP8_MAX[kv_fp8.dtype], "NUM_SPLITS": num_splits, "BLOCK_N": block_n}, num_warps, num_stages,
           floats=DECODE_FLOATS)
    return out


# --- mxfp4 cache -----------------------------------------------------------------------------
@triton.jit
def _dequant_mxfp4_f16(packed, scale_bytes, ref_byte, BLOCK_N: tl.constexpr, NBYTES: tl.constexpr,
                       NBLOCKS: tl.constexpr):
    """(BLOCK_N x NBYTES) packed e2m1 bytes + (BLOCK_N x NBLOCKS) e8m0 bytes -> (even dims, odd dims) f16
    tiles holding value * 2^(128 - ref_byte); ref_byte (BLOCK_N x 1): each token's largest scale byte.

    Byte j holds dims 2j (low nibble) and 2j+1 (high nibble), both in scale block j // 16. The two
    results are NOT interleaved: the kernel permutes Q the same way (dots over the latent dim do
    not care about its order) and un-permutes only the (16 x 512) output.
    Per nibble: sign -> f16 bit 15, the three magnitude bits -> f16 bits 11..9, i.e. exponent field
    e and the top mantissa bit m. As f16 that is exactly e2m1 * 2^-14 (e = 0 lands on the f16
    subnormal 2^-15 = 0.5 * 2^-14, as e2m1's own subnormal). One f16 multiply by the block factor
    2^(scale_byte - ref_byte + 15) (exponent field scale_byte - ref_byte + 30 <= 30, built from bits)
    gives value * 2^(128 - ref_byte), |.| <= 12. Exact for blocks within 2^14 of the token's largest
    block scale; smaller blocks of that token round into f16 subnormals (absolute error < 2^-24 of
    the token's largest values) and blocks 2^30 smaller flush to 0.
    Why f16 and not bf16: the nibble -> f16 bit placement (two shifts and masks per nibble) plus
    one multiply is about a third of the integer work of building exact bf16 values with the scale
    folded into the exponent (selects for the codes 0 and 1).
    """
    b = packed.to(tl.int32)
    lo = ((b << 9) & 0x0E00) | ((b << 12) & 0x8000)
    hi = ((b << 5) & 0x0E00) | ((b << 8) & 0x8000)
    field = scale_bytes.to(tl.int32) - ref_byte + 30
    factor = tl.where(field > 0, field << 10, 0).to(tl.uint16).to(tl.float16, bitcast=True)
    factor = tl.reshape(tl.broadcast_to(factor[:, :, None], (BLOCK_N, NBLOCKS, NBYTES // NBLOCKS)),
                        (BLOCK_N, NBYTES))
    even = lo.to(tl.uint16).to(tl.float16, bitcast=True) * factor
    odd = hi.to(tl.uint16).to(tl.float16, bitcast=True) * factor
    return even, odd


@triton.jit
def _quantize_mxfp8_t(x_t, K: tl.constexpr, N: tl.constexpr):
    """(K x N) bf16/f32 -> ((K x N) float8e4nv, (N x K/32) uint8 e8m0 scales): MXFP8 along K.

    Scale byte = biased exponent of the block's amax - 7, so |x| / 2^(byte - 127) < 256 <= 448."""
    x3 = tl.reshape(x_t.to(tl.float32), (K // 32, 32, N))
    amax = tl.max(tl.abs(x3), 1)
    scale_byte = tl.minimum(tl.maximum(((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 7, 1), 254)
    inv_scale = ((254 - scale_byte) << 23).to(tl.float32, bitcast=True)  # 2^(127 - byte)
    q = tl.reshape((x3 * inv_scale[:, None, :]).to(tl.float8e4nv), (K, N))
    return q, tl.trans(scale_byte.to(tl.uint8))


@triton.jit
def _mxfp4_q_f16(q_ptrs, pairs, rope_pairs, HALF: tl.constexpr):
    """Q^T for the "none" mode: permuted as the K tiles ([even dims | odd dims] of each half and of
    the rope part), times 2^-q_exp in f16 (exact; q_exp from the exponent bits of max|Q|, so
    |Q'| < 2^15). Returns the six tiles, q_exp and q's poison."""
    q_even_lo_t = tl.load(q_ptrs + 2 * pairs[:, None]).to(tl.float32)
    q_odd_lo_t = tl.load(q_ptrs + 2 * pairs[:, None] + 1).to(tl.float32)
    q_even_hi_t = tl.load(q_ptrs + HALF + 2 * pairs[:, None]).to(tl.float32)
    q_odd_hi_t = tl.load(q_ptrs + HALF + 2 * pairs[:, None] + 1).to(tl.float32)
    q_even_rope_t = tl.load(q_ptrs + 2 * HALF + 2 * rope_pairs[:, None]).to(tl.float32)
    q_odd_rope_t = tl.load(q_ptrs + 2 * HALF + 2 * rope_pairs[:, None] + 1).to(tl.float32)
    poison = (_poison_of(q_even_lo_t) + _poison_of(q_odd_lo_t) + _poison_of(q_even_hi_t) + _poison_of(q_odd_hi_t)
              + _poison_of(q_even_rope_t) + _poison_of(q_odd_rope_t))
    q_amax = tl.maximum(tl.maximum(tl.max(tl.max(tl.abs(q_even_lo_t), 1), 0),
                                   tl.max(tl.max(tl.abs(q_odd_lo_t), 1), 0)),
                        tl.maximum(tl.max(tl.max(tl.abs(q_even_hi_t), 1), 0),
                                   tl.max(tl.max(tl.abs(q_odd_hi_t), 1), 0)))
    q_amax = tl.maximum(q_amax, tl.maximum(tl.max(tl.max(tl.abs(q_even_rope_t), 1), 0),
                                           tl.max(tl.max(tl.abs(q_odd_rope_t), 1), 0)))
    q_exp = (((q_amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 141).to(tl.float32)
    q_unscale = tl.exp2(-q_exp)
    return ((q_even_lo_t * q_unscale).to(tl.float16), (q_odd_lo_t * q_unscale).to(tl.float16),
            (q_even_hi_t * q_unscale).to(tl.float16), (q_odd_hi_t * q_unscale).to(tl.float16),
            (q_even_rope_t * q_unscale).to(tl.float16), (q_odd_rope_t * q_unscale).to(tl.float16), q_exp, poison)


@triton.jit
def _mxfp4_q_mxfp8(q_ptrs, HALF: tl.constexpr, ROPE_BYTES: tl.constexpr, NUM_HEADS: tl.constexpr):
    """Q^T for the "e4m3" mode: natural dim order, MXFP8 (e4m3 values with an e8m0 scale per head
    and 32 dims) in the two 256-dim halves and the rope part. Returns (values, scales) of each
    part, q_exp 0 and q's poison."""
    q_lo = tl.load(q_ptrs + tl.arange(0, HALF)[:, None])
    q_hi = tl.load(q_ptrs + HALF + tl.arange(0, HALF)[:, None])
    q_rope = tl.load(q_ptrs + 2 * HALF + tl.arange(0, 2 * ROPE_BYTES)[:, None])
    poison = _poison_of(q_lo.to(tl.float32)) + _poison_of(q_hi.to(tl.float32)) + _poison_of(q_rope.to(tl.float32))
    q_lo_t, q_lo_scales = _quantize_mxfp8_t(q_lo, HALF, NUM_HEADS)
    q_hi_t, q_hi_scales = _quantize_mxfp8_t(q_hi, HALF, NUM_HEADS)
    q_rope_t, q_rope_scales = _quantize_mxfp8_t(q_rope, 2 * ROPE_BYTES, NUM_HEADS)
    return q_lo_t, q_lo_scales, q_hi_t, q_hi_scales, q_rope_t, q_rope_scales, 0.0, poison


@triton.jit
def _mxfp4_scores_f16(packed_lo, packed_hi, packed_rope, scales_lo, scales_hi, scales_rope, ref,
                      q_even_lo_t, q_odd_lo_t, q_even_hi_t, q_odd_hi_t, q_even_rope_t, q_odd_rope_t, q_exp,
                      sm_scale_log2, BLOCK_N: tl.constexpr, HALF_BYTES: tl.constexpr, LO_BLOCKS: tl.constexpr,
                      ROPE_BYTES: tl.constexpr, ROPE_BLOCKS: tl.constexpr):
    """S^T (BLOCK_N x 16) in base-2 units for the "none" mode: each part of the tile dequantised to
    f16 relative to its token's largest scale (dequantise a part, use it, drop it: one part's tiles
    live at a time), six dots with the permuted Q^T, then each token's unit 2^(ref - 128 + q_exp)."""
    k_even, k_odd = _dequant_mxfp4_f16(packed_lo, scales_lo, ref[:, None], BLOCK_N, HALF_BYTES, LO_BLOCKS)
    scores_t = tl.dot(k_even, q_even_lo_t)
    scores_t = tl.dot(k_odd, q_odd_lo_t, scores_t)
    k_even, k_odd = _dequant_mxfp4_f16(packed_hi, scales_hi, ref[:, None], BLOCK_N, HALF_BYTES, LO_BLOCKS)
    scores_t = tl.dot(k_even, q_even_hi_t, scores_t)
    scores_t = tl.dot(k_odd, q_odd_hi_t, scores_t)
    k_even, k_odd = _dequant_mxfp4_f16(packed_rope, scales_rope, ref[:, None], BLOCK_N, ROPE_BYTES, ROPE_BLOCKS)
    scores_t = tl.dot(k_even, q_even_rope_t, scores_t)
    scores_t = tl.dot(k_odd, q_odd_rope_t, scores_t)
    return scores_t * (sm_scale_log2 * tl.exp2((ref - 128).to(tl.float32) + q_exp)[:, None])


@triton.jit
def _mxfp4_scores_mxfp8(packed_lo, packed_hi, packed_rope, scales_lo, scales_hi, scales_rope,
                        q_lo_t, q_lo_scales, q_hi_t, q_hi_scales, q_rope_t, q_rope_scales, sm_scale_log2):
    """S^T (BLOCK_N x 16) in base-2 units for the "e4m3" mode: tl.dot_scaled of the packed e2m1
    tiles and their e8m0 scales with the MXFP8 Q^T (gfx950: the native scaled MFMA)."""
    scores_t = tl.dot_scaled(packed_lo, scales_lo, "e2m1", q_lo_t, q_lo_scales, "e4m3")
    scores_t = tl.dot_scaled(packed_hi, scales_hi, "e2m1", q_hi_t, q_hi_scales, "e4m3", acc=scores_t)
    scores_t = tl.dot_scaled(packed_rope, scales_rope, "e2m1", q_rope_t, q_rope_scales, "e4m3", acc=scores_t)
    return scores_t * sm_scale_log2


@triton.jit
def _mla_decode_mxfp4_kernel(
    Q, KV, KV_SCALES, QO_INDPTR, KV_INDPTR, OUT, PARTIAL_O, PARTIAL_LSE, SPLIT_TICKETS,
    sm_scale_log2, kv_rows,
    stride_q_token, stride_q_head, stride_kv_token, stride_scale_token, stride_o_token, stride_o_head,
    NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, QK_DOT_SCALED: tl.constexpr,
    NUM_HEADS: tl.constexpr = 16, HALF_BYTES: tl.constexpr = 128, ROPE_BYTES: tl.constexpr = 32,
):
    """Split-KV MLA decode over an MXFP4 latent cache, with the split combine fused into the last split.

    Same program structure as _mla_decode_kernel. Per tile: the packed e2m1 bytes (BLOCK_N x
    288, read as 128 + 128 + 32 bytes) and their e8m0 scales (BLOCK_N x 18 of the padded (rows, 24)
    array, row stride stride_scale_token); ref_t = each token's largest scale byte.
    S^T, by QK_DOT_SCALED (one branch per phase: the q preparation and the scores):
      "none": K dequantised in registers to f16 relative to ref_t (_dequant_mxfp4_f16: K'_t = K_t *
          2^(128 - ref_t), |K'| <= 12 whatever the scales), split into even and odd latent dims (no
          nibble interleave), Q' = Q * 2^-q_exp permuted the same way; six dots, row t times
          2^(ref_t - 128 + q_exp). Runs under the interpreter.
      "e4m3": tl.dot_scaled on the packed tiles with Q quantised in-kernel to MXFP8 (gfx950 issues
          the native v_mfma_scale_f32_16x16x128_f8f6f4; Q's rounding adds to the error). Triton 3.6's
          interpreter has no dot_scaled: compiled, not CPU-tested.
    O^T: four (128 x 16) float32 accumulators (even/odd x lower/upper half) holding sum_t w_t V'_t
    with w_t = 2^(s_t - m + ref_t - W) in f16 (<= 1; s_t the base-2 score, m its running max, W the
    running max of s_t - m + ref_t, shifted with m): each token's V unit is folded into its weight in
    the log domain, so an outlier token with huge scales cannot push other tokens' weights out of
    f16 range; ref is added to s - m (not to s) so that it survives huge scores. The softmax sum
    keeps its own max; O^T = acc * 2^(W - 128) / sum at the end (or in the partials). P . V keeps
    the register dequantisation in both modes: MXFP4 scales run along the latent dim, the M dim of
    V^T . P^T, and dot_scaled only takes scales along K (the tokens there).
    A scale byte 255 (e8m0's NaN) makes its token's weight NaN: poison stays visible.
    Bytes: 306 per KV token, read once; partials as in the fp8 kernel (float32, permuted dim order).
    Rows with no KV (empty indptr segment) produce zeros, as the reference does.
    """
    batch = tl.program_id(0)
    split = tl.program_id(1)
    split_begin, split_end, poison = _row_range(QO_INDPTR, KV_INDPTR, batch, kv_rows, split, NUM_SPLITS, BLOCK_N)

    HALF: tl.constexpr = 2 * HALF_BYTES
    LO_BLOCKS: tl.constexpr = HALF_BYTES // 16
    ROPE_BLOCKS: tl.constexpr = ROPE_BYTES // 16
    heads = tl.arange(0, NUM_HEADS)
    pairs = tl.arange(0, HALF_BYTES)
    rope_pairs = tl.arange(0, ROPE_BYTES)
    blocks = tl.arange(0, LO_BLOCKS)
    rope_blocks = tl.arange(0, ROPE_BLOCKS)
    tokens = tl.arange(0, BLOCK_N)
    q_ptrs = Q + batch * stride_q_token + heads[None, :] * stride_q_head
    # q's poison rides on a value the loop keeps anyway: q_exp (its unit, "none") or the row's poison
    if QK_DOT_SCALED == "e4m3":
        q_a, q_b, q_c, q_d, q_e, q_f, q_exp, q_poison = _mxfp4_q_mxfp8(q_ptrs, HALF, ROPE_BYTES, NUM_HEADS)
        poison += q_poison
    else:
        q_a, q_b, q_c, q_d, q_e, q_f, q_exp, q_poison = _mxfp4_q_f16(q_ptrs, pairs, rope_pairs, HALF)
        q_exp += q_poison

    running_max = tl.full([NUM_HEADS], float("-inf"), tl.float32)
    running_sum = tl.zeros([NUM_HEADS], tl.float32)
    weight_max = tl.full([NUM_HEADS], float("-inf"), tl.float32)
    acc_even_lo_t = tl.zeros([HALF_BYTES, NUM_HEADS], tl.float32)
    acc_odd_lo_t = tl.zeros([HALF_BYTES, NUM_HEADS], tl.float32)
    acc_even_hi_t = tl.zeros([HALF_BYTES, NUM_HEADS], tl.float32)
    acc_odd_hi_t = tl.zeros([HALF_BYTES, NUM_HEADS], tl.float32)
    for tile_begin in range(split_begin, split_end, BLOCK_N):
        valid = tile_begin + tokens < split_end
        # the tile's first row in 64 bits (a cache past 2^31 bytes), its rows' offsets in 32
        first_row = tl.cast(tile_begin, tl.int64)
        kv_ptrs = KV + first_row * stride_kv_token + tokens[:, None] * stride_kv_token
        sc_ptrs = KV_SCALES + first_row * stride_scale_token + tokens[:, None] * stride_scale_token
        packed_lo = tl.load(kv_ptrs + pairs[None, :], mask=valid[:, None], other=0)
        packed_hi = tl.load(kv_ptrs + HALF_BYTES + pairs[None, :], mask=valid[:, None], other=0)
        packed_rope = tl.load(kv_ptrs + 2 * HALF_BYTES + rope_pairs[None, :], mask=valid[:, None], other=0)
        scales_lo = tl.load(sc_ptrs + blocks[None, :], mask=valid[:, None], other=0)
        scales_hi = tl.load(sc_ptrs + LO_BLOCKS + blocks[None, :], mask=valid[:, None], other=0)
        scales_rope = tl.load(sc_ptrs + 2 * LO_BLOCKS + rope_blocks[None, :], mask=valid[:, None], other=0)
        ref = tl.maximum(tl.maximum(tl.max(scales_lo, 1), tl.max(scales_hi, 1)), tl.max(scales_rope, 1)).to(tl.int32)
        if QK_DOT_SCALED == "e4m3":
            scores_t = _mxfp4_scores_mxfp8(packed_lo, packed_hi, packed_rope, scales_lo, scales_hi, scales_rope,
                                           q_a, q_b, q_c, q_d, q_e, q_f, sm_scale_log2)
        else:
            scores_t = _mxfp4_scores_f16(packed_lo, packed_hi, packed_rope, scales_lo, scales_hi, scales_rope, ref,
                                         q_a, q_b, q_c, q_d, q_e, q_f, q_exp, sm_scale_log2, BLOCK_N, HALF_BYTES,
                                         LO_BLOCKS, ROPE_BYTES, ROPE_BLOCKS)
        scores_t = tl.where(valid[:, None], scores_t, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores_t, 0))
        shifted_t = scores_t - new_max[None, :]
        running_sum = running_sum * tl.exp2(running_max - new_max) + tl.sum(tl.exp2(shifted_t), 0)
        # P . V weights with each token's V unit folded in, in the log2 domain: w_t = 2^(s_t - m + ref_t - W) <= 1;
        # a scale byte 255 (e8m0's NaN) makes its token's weight NaN
        weight_logits_t = shifted_t + tl.where(ref == 255, float("nan"), ref.to(tl.float32))[:, None]
        weight_max = weight_max + (running_max - new_max)  # the old terms' logits shift with m
        new_weight_max = tl.maximum(weight_max, tl.max(weight_logits_t, 0))
        correction = tl.exp2(weight_max - new_weight_max)
        probs_t = tl.exp2(weight_logits_t - new_weight_max[None, :]).to(tl.float16)
        v_even, v_odd = _dequant_mxfp4_f16(packed_lo, scales_lo, ref[:, None], BLOCK_N, HALF_BYTES, LO_BLOCKS)
        acc_even_lo_t = tl.dot(tl.trans(v_even), probs_t, acc_even_lo_t * correction[None, :])
        acc_odd_lo_t = tl.dot(tl.trans(v_odd), probs_t, acc_odd_lo_t * correction[None, :])
        v_even, v_odd = _dequant_mxfp4_f16(packed_hi, scales_hi, ref[:, None], BLOCK_N, HALF_BYTES, LO_BLOCKS)
        acc_even_hi_t = tl.dot(tl.trans(v_even), probs_t, acc_even_hi_t * correction[None, :])
        acc_odd_hi_t = tl.dot(tl.trans(v_odd), probs_t, acc_odd_hi_t * correction[None, :])
        running_max = new_max
        weight_max = new_weight_max

    # Output (16 x 512) in natural dim order: interleave even/odd columns once, then contiguous stores.
    out_ptrs = OUT + batch * stride_o_token + heads[:, None] * stride_o_head + tl.arange(0, HALF)[None, :]
    # O^T = acc * 2^(weight_max - 128) / running_sum (0 for a split without tokens; NaN stays NaN)
    has_tokens = running_sum != 0
    unit_log2 = tl.where(has_tokens, weight_max, 0.0) - 128.0
    out_scale = (tl.where(has_tokens, tl.exp2(unit_log2) / tl.where(has_tokens, running_sum, 1.0), 0.0)
                 + poison)[None, :]
    # Partials (split > 1) keep the permuted order: (512 x 16) as four (128 x 16) blocks.
    PART: tl.constexpr = HALF_BYTES * NUM_HEADS
    if NUM_SPLITS == 1:
        out_lo = tl.reshape(tl.join(tl.trans(acc_even_lo_t * out_scale), tl.trans(acc_odd_lo_t * out_scale)),
                            (NUM_HEADS, HALF))
        out_hi = tl.reshape(tl.join(tl.trans(acc_even_hi_t * out_scale), tl.trans(acc_odd_hi_t * out_scale)),
                            (NUM_HEADS, HALF))
        tl.store(out_ptrs, out_lo.to(OUT.dtype.element_ty))
        tl.store(out_ptrs + HALF, out_hi.to(OUT.dtype.element_ty))
    else:
        lse, _ = _split_lse(running_max, running_sum)
        slot = batch * NUM_SPLITS + split
        offsets = pairs[:, None] * NUM_HEADS + heads[None, :]
        slot_ptrs = PARTIAL_O + slot * 4 * PART + offsets
        tl.store(slot_ptrs, acc_even_lo_t * out_scale)
        tl.store(slot_ptrs + PART, acc_odd_lo_t * out_scale)
        tl.store(slot_ptrs + 2 * PART, acc_even_hi_t * out_scale)
        tl.store(slot_ptrs + 3 * PART, acc_odd_hi_t * out_scale)
        tl.store(PARTIAL_LSE + slot * NUM_HEADS + heads, lse + poison)
        if _last_split_to_finish(SPLIT_TICKETS, batch, NUM_SPLITS):
            # a slot's four (128 x 16) blocks are one (512 x 16) tile: row r = block r // 128, pair
            # r % 128, which holds latent dim (block // 2) * 256 + 2 * pair + block % 2
            rows = tl.arange(0, 4 * HALF_BYTES)
            block = rows // HALF_BYTES
            dims = (block // 2) * HALF + 2 * (rows % HALF_BYTES) + block % 2
            merged_t, _ = _merge_splits(PARTIAL_O, PARTIAL_LSE, batch * NUM_SPLITS,
                                     rows[:, None] * NUM_HEADS + heads[None, :], heads, NUM_SPLITS, NUM_HEADS, 4 * PART)
            tl.store(OUT + batch * stride_o_token + heads[None, :] * stride_o_head + dims[:, None],
                     merged_t.to(OUT.dtype.element_ty))
            tl.atomic_xchg(SPLIT_TICKETS + batch, 0)


QK_DOT_SCALED_MODES = ("none", "e4m3")


def triton_mxfp4_route(q, kv_data, qo_indptr, kv_indptr, config, num_splits=1, block_n=64, num_warps=8,
                       num_stages=2, qk_dot_scaled="none"):
    """MLA decode reading kv_data["mxfp4"] only (306 bytes per KV token; see _mla_decode_mxfp4_kernel).
    qk_dot_scaled: "none" (S from f16 tiles dequantised in registers) or "e4m3" (S from
    tl.dot_scaled with an in-kernel MXFP8 Q; GPU only). num_stages 2: with 3 the kernel spills on
    gfx950 at block_n 64 (docs/kernel_report.md)."""
    if qk_dot_scaled not in QK_DOT_SCALED_MODES:
        raise ValueError(f"qk_dot_scaled must be one of {QK_DOT_SCALED_MODES}, not {qk_dot_scaled!r}")
    kv_fp4, kv_scales = kv_data["mxfp4"]
    packed = kv_fp4.view(torch.uint8)[:, 0]
    scales = kv_scales.view(torch.uint8)
    batch = kv_indptr.shape[0] - 1
    out = torch.empty(q.shape[0], NUM_HEADS, V_HEAD_DIM, dtype=torch.bfloat16, device=q.device)
    partial_o, partial_lse, tickets = split_workspace(batch, num_splits, q.device)
    launch(_mla_decode_mxfp4_kernel, (batch, num_splits),
           (q, packed, scales, qo_indptr, kv_indptr, out, partial_o, partial_lse, tickets),
           (SM_SCALE * LOG2E, packed.shape[0], q.stride(0), q.stride(1), packed.stride(0), scales.stride(0),
            out.stride(0), out.stride(1)),
           {"NUM_SPLITS": num_splits, "BLOCK_N": block_n, "QK_DOT_SCALED": qk_dot_scaled},
           num_warps, num_stages)
    return out


# Compile plans: what tools/kernel_report.py compiles ahead of time for a route-table row.
# "range32_args": the pointer arguments Triton's HIP JIT marks as within 2 GiB (every tensor at
# the leaderboard's sizes: the largest, the bs 256 / kv 8192 fp8 cache, is 1.2 GB), which it then
# compiles with 32-bit buffer loads; the tool adds that mark on HIP targets.
_FP8_KERNEL_SIGNATURE = {
    "Q": "*bf16", "KV": "*{fp8}", "KV_SCALE": "*fp32", "QO_INDPTR": "*i32", "KV_INDPTR": "*i32",
    "CACHE_SEQLENS": "*i32", "BLOCK_TABLE": "*i32", "OUT": "*bf16", "LSE": "*i32", "PARTIAL_O": "*fp32",
    "PARTIAL_LSE": "*fp32", "SPLIT_TICKETS": "*i32", "sm_scale_log2": "fp32", "kv_scale_value": "fp32",
    "kv_rows": "i32", "capacity": "i32", "num_heads": "i32", "q_len": "i32",
    "stride_q_batch": "i32", "stride_q_token": "i32", "stride_q_head": "i32", "stride_kv_block": "i32",
    "stride_kv_token": "i32", "stride_bt_batch": "i32", "stride_o_batch": "i32", "stride_o_token": "i32",
    "stride_o_head": "i32", "stride_lse_batch": "i32", "stride_lse_head": "i32", "stride_lse_token": "i32",
}
_FLOAT_ARGS = ("sm_scale_log2", "kv_scale_value")


def triton_fp8_compile_plan(params, fp8_dtype):
    p = dict(keyword_defaults(triton_fp8_route), **params)
    return [{
        "kernel": _mla_decode_kernel,
        "signature": {name: kind.format(fp8=fp8_dtype) for name, kind in _FP8_KERNEL_SIGNATURE.items()},
        "constexprs": {**keyword_defaults(_mla_decode_kernel), "FP8_MAX": FP8_MAX[TRITON_FP8_DTYPES[fp8_dtype]],
                       "NUM_SPLITS": p["num_splits"], "BLOCK_N": p["block_n"]},
        # torch's pointers, the leaderboard's row counts and the strides 576 / 512 / 16 are
        # multiples of 16, as the JIT sees them
        "aligned_args": [name for name in _FP8_KERNEL_SIGNATURE if name not in _FLOAT_ARGS],
        "range32_args": [name for name, kind in _FP8_KERNEL_SIGNATURE.items() if kind.startswith("*")],
        "num_warps": p["num_warps"], "num_stages": p["num_stages"],
    }]


_MXFP4_KERNEL_SIGNATURE = {
    "Q": "*bf16", "KV": "*u8", "KV_SCALES": "*u8", "QO_INDPTR": "*i32", "KV_INDPTR": "*i32",
    "OUT": "*bf16", "PARTIAL_O": "*fp32", "PARTIAL_LSE": "*fp32", "SPLIT_TICKETS": "*i32",
    "sm_scale_log2": "fp32", "kv_rows": "i32", "stride_q_token": "i32", "stride_q_head": "i32",
    "stride_kv_token": "i32", "stride_scale_token": "i32", "stride_o_token": "i32", "stride_o_head": "i32",
}


def triton_mxfp4_compile_plan(params, fp8_dtype):
    p = dict(keyword_defaults(triton_mxfp4_route), **params)
    if p["qk_dot_scaled"] not in QK_DOT_SCALED_MODES:
        raise ValueError(f"qk_dot_scaled must be one of {QK_DOT_SCALED_MODES}, not {p['qk_dot_scaled']!r}")
    return [{
        "kernel": _mla_decode_mxfp4_kernel, "signature": dict(_MXFP4_KERNEL_SIGNATURE),
        "constexprs": {"NUM_SPLITS": p["num_splits"], "BLOCK_N": p["block_n"], "QK_DOT_SCALED": p["qk_dot_scaled"],
                       **keyword_defaults(_mla_decode_mxfp4_kernel)},
        # the scale row stride is 24, not a multiple of 16 as the JIT sees the others
        "aligned_args": [name for name in _MXFP4_KERNEL_SIGNATURE
                         if name not in ("sm_scale_log2", "stride_scale_token")],
        "range32_args": [name for name, kind in _MXFP4_KERNEL_SIGNATURE.items() if kind.startswith("*")],
        "num_warps": p["num_warps"], "num_stages": p["num_stages"],
    }]


def triton_paged_compile_plan(params, fp8_dtype, page_sizes=(16, 64), causal=(False, True)):
    """The serving API's portable rows (SERVING_ROUTE_TABLE, "triton_paged"): _mla_decode_kernel on
    pages of 16 (a block id per token) and 64 (one per tile), causal masks on and off, lse
    written, 2 splits, for the cache format params["kv"] (tools/kernel_report.py adds a serving
    row's "kv" to its params). AMD targets only: there these rows serve every API case aiter
    does not; on sm_90 every page size takes hopper_paged, and these configs spill at 8
    warps (up to 336 B)."""
    kv = params.get("kv", "fp8")
    launch_params = {"num_splits": 2, **{name: value for name, value in params.items() if name != "kv"}}
    entries = []
    for page in page_sizes:
        for c in causal:
            (entry,) = triton_fp8_compile_plan(launch_params, fp8_dtype)
            entry["signature"].update(LSE="*fp32", **({"KV": "*bf16"} if kv == "bf16" else {}))
            entry["constexprs"].update(PAGE_SIZE=page, CAUSAL=c, WRITE_LSE=True, KV_FP8=kv == "fp8",
                                       KV_SCALE_IN_TENSOR=False)
            entries.append(dict(entry, targets=["gfx950", "gfx942"]))
    return entries


def triton_compile_plan(route, params, fp8_dtype="fp8e4nv"):
    """[{kernel, signature, constexprs, aligned_args, num_warps, num_stages[, range32_args]
    [, targets]}] for one route-table row, exactly what its route launches; "targets"
    (tools/kernel_report.py names) limits an entry to the machines its route runs on.
    fp8_dtype: Triton's name of the KV dtype, fp8e4nv (float8_e4m3fn: MI355X, NVIDIA) or fp8e4b8
    (float8_e4m3fnuz: MI300)."""
    plan = TRITON_COMPILE_PLANS.get(route)  # each plan returns its list of entries
    return [] if plan is None else plan(params, fp8_dtype)




# --- the sparse form: DeepSeek-V3.2's top-k indices over FlashMLA's 656-byte fp8 cache ----------
# The cache is FlashMLA's V3.2 layout: per token 512 float8_e4m3fn latent values in 4 tiles of
# 128, the tiles' 4 float32 scales (value = fp8 x scale; powers of two from FlashMLA's
# quantiser), 64 bf16 rope values: 656 bytes, tokens of a block back to back. indices (batch,
# s_q, topk) int32: block id x page_size + offset of each token a query attends, -1 skips the
# entry; topk_length (batch,) int32, optional, keeps the first topk_length[b] entries of request
# b's queries. Bad contents make rows NaN, never a read outside the cache: an entry below -1 or at
# or past num_blocks x page_size makes its query NaN (out and lse); a topk_length outside
# [0, topk] its request's. A query with nothing to attend has out 0 and lse +inf.


@triton.jit
def _sparse_entries(IDX_ROW, positions, in_split, capacity, page_size, stride_kv_block, TOKEN_BYTES: tl.constexpr):
    """A tile's entries at `positions` of one query's index row: (valid, the byte offset of each
    valid entry's token in the cache, poison). Valid: inside the split and a token of the cache
    (0 <= entry < capacity); -1 is skipped; an entry below -1 or at or past the capacity is
    poison (NaN, added to the query's scale), never an address. The block's offset is 64-bit
    (caches past 2^31 bytes)."""
    entry = tl.load(IDX_ROW + positions, mask=in_split, other=-1)
    valid = in_split & (entry >= 0) & (entry < capacity)
    bad = in_split & ((entry < -1) | (entry >= capacity))
    safe = tl.where(valid, entry, 0)
    rows = (safe // page_size).to(tl.int64) * stride_kv_block + (safe % page_size).to(tl.int64) * TOKEN_BYTES
    return valid, rows, tl.where(tl.max(bad.to(tl.int32), 0) > 0, float("nan"), 0.0)


@triton.jit
def _sparse_latent(KV8, KV32, rows, valid, TILE: tl.constexpr, CHUNK: tl.constexpr, LATENT: tl.constexpr):
    """Latent tile TILE (CHUNK values) of the tile's tokens, dequantised: fp8 x the tile's float32
    scale, as bf16 (BLOCK_N x CHUNK). Exact: an fp8 value times a power of two fits bf16. Entries
    not valid load 0 and read nothing (a NaN in a token no query selects never enters)."""
    dims = tl.arange(0, CHUNK)
    k = tl.load(KV8 + rows[:, None] + TILE * CHUNK + dims[None, :], mask=valid[:, None], other=0.0)
    scale = tl.load(KV32 + rows // 4 + LATENT // 4 + TILE, mask=valid, other=0.0)
    return (k.to(tl.float32) * scale[:, None]).to(tl.bfloat16)


@triton.jit
def _sparse_q(q_rows, row_ok, TILE: tl.constexpr, CHUNK: tl.constexpr):
    """Q of the program's rows over dims TILE * CHUNK ... (ROWS x CHUNK) bf16; rows past row_ok 0."""
    dims = tl.arange(0, CHUNK)
    return tl.load(q_rows[:, None] + TILE * CHUNK + dims[None, :], mask=row_ok[:, None], other=0.0)


@triton.jit
def _sparse_store(out_rows, row_ok, chunk, TILE: tl.constexpr, CHUNK: tl.constexpr):
    """Store out's dims TILE * CHUNK ... of the program's rows from chunk (ROWS x CHUNK)."""
    dims = tl.arange(0, CHUNK)
    tl.store(out_rows[:, None] + TILE * CHUNK + dims[None, :], chunk.to(tl.bfloat16), mask=row_ok[:, None])


@triton.jit
def _sparse_store_lse(lse_rows, row_ok, lse2):
    """lse in natural log from its base-2 value: +inf for a row with nothing attended (lse2 -inf),
    NaN kept."""
    tl.store(lse_rows, tl.where(lse2 == float("-inf"), float("inf"), lse2 * 0.6931471805599453), mask=row_ok)


@triton.jit
def _mla_sparse_kernel(
    Q, KV8, KV32, KV16, INDICES, TOPK_LENGTH, OUT, LSE, PARTIAL_O, PARTIAL_LSE, SPLIT_TICKETS,
    sm_scale_log2, capacity, page_size, num_heads, q_len, topk,
    stride_q_batch, stride_q_token, stride_q_head, stride_kv_block, stride_idx_batch, stride_idx_token,
    stride_o_batch, stride_o_token, stride_o_head, stride_lse_batch, stride_lse_head, stride_lse_token,
    NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_TOPK_LENGTH: tl.constexpr,
    LATENT: tl.constexpr = 512, CHUNK: tl.constexpr = 128, ROPE: tl.constexpr = 64,
):
    """Sparse MLA decode over FlashMLA's 656-byte fp8 cache, split over the entries, the split
    merge fused into the last split (as _mla_decode_kernel).

    Grid (batch x q_len, NUM_SPLITS, head groups). A program takes one query token, ROWS of its
    heads and one split of its entries (the first topk_length[b] of its index row, else all
    topk), BLOCK_N entries a tile. KV8 / KV32 / KV16 are the cache's bytes as fp8, float32 and
    bf16: a token's row at byte `rows` holds its latent at KV8 + rows, its 4 scales at KV32 +
    rows / 4 + 128, its rope at KV16 + rows / 2 + 264.
    Each tile: the entries' tokens gathered (a block id and offset per entry), each latent tile of
    128 dequantised to bf16 (fp8 x its power-of-two scale: exact), the rope as it is; q stays bf16.
    The heads are the MMA's M: S = Q.K^T is (ROWS x BLOCK_N), four latent tiles and the rope
    accumulated in float32; O += P.V in four (ROWS x 128) accumulators, P in bf16. At 64 rows on
    Hopper both are wgmma, q and the dequantised tiles their shared-memory operands.
    Online softmax in base 2; entries that are skipped, past the split or poisoned are -inf and
    never loaded.
    NUM_SPLITS > 1: each program writes its float32 partial O (dims-major, as _merge_splits reads
    it) and base-2 lse; the one that draws the last ticket of its (query token, head group) merges
    the splits (_merge_splits, a 128-dim tile at a time), writes out and lse and resets the ticket
    for the next call.
    Poison (NaN out and lse for the query): an entry below -1 or past the cache, or its request's
    topk_length outside [0, topk]. Nothing attended: out 0, lse +inf.
    """
    query = tl.program_id(0)
    split = tl.program_id(1)
    group = tl.program_id(2)
    batch = query // q_len
    q_token = query % q_len
    TOKEN_BYTES: tl.constexpr = LATENT + 4 * (LATENT // CHUNK) + 2 * ROPE  # 656

    # The query's entries: the first topk_length[batch] of its row (a bad length poisons them all).
    length = topk
    if HAS_TOPK_LENGTH:
        length = tl.load(TOPK_LENGTH + batch)
    poison = tl.where((length < 0) | (length > topk), float("nan"), 0.0)
    length = tl.where(poison != poison, 0, length)
    split_begin, split_end = _split_bounds(0, length, split, NUM_SPLITS, BLOCK_N)
    idx_row = INDICES + batch.to(tl.int64) * stride_idx_batch + q_token * stride_idx_token

    heads = group * ROWS + tl.arange(0, ROWS)
    row_ok = heads < num_heads
    q_rows = Q + batch.to(tl.int64) * stride_q_batch + q_token * stride_q_token + heads * stride_q_head
    q0 = _sparse_q(q_rows, row_ok, 0, CHUNK)
    q1 = _sparse_q(q_rows, row_ok, 1, CHUNK)
    q2 = _sparse_q(q_rows, row_ok, 2, CHUNK)
    q3 = _sparse_q(q_rows, row_ok, 3, CHUNK)
    rope = tl.arange(0, ROPE)
    q_rope = tl.load(q_rows[:, None] + LATENT + rope[None, :], mask=row_ok[:, None], other=0.0)

    running_max = tl.full([ROWS], float("-inf"), tl.float32)
    running_sum = tl.zeros([ROWS], tl.float32)
    acc0 = tl.zeros([ROWS, CHUNK], tl.float32)
    acc1 = tl.zeros([ROWS, CHUNK], tl.float32)
    acc2 = tl.zeros([ROWS, CHUNK], tl.float32)
    acc3 = tl.zeros([ROWS, CHUNK], tl.float32)
    tokens = tl.arange(0, BLOCK_N)
    for tile_begin in range(split_begin, split_end, BLOCK_N):
        positions = tile_begin + tokens
        valid, rows, tile_poison = _sparse_entries(idx_row, positions, positions < split_end, capacity, page_size,
                                                   stride_kv_block, TOKEN_BYTES)
        poison += tile_poison
        k0 = _sparse_latent(KV8, KV32, rows, valid, 0, CHUNK, LATENT)
        k1 = _sparse_latent(KV8, KV32, rows, valid, 1, CHUNK, LATENT)
        k2 = _sparse_latent(KV8, KV32, rows, valid, 2, CHUNK, LATENT)
        k3 = _sparse_latent(KV8, KV32, rows, valid, 3, CHUNK, LATENT)
        k_rope = tl.load(KV16 + rows[:, None] // 2 + (LATENT + 4 * (LATENT // CHUNK)) // 2 + rope[None, :],
                         mask=valid[:, None], other=0.0)
        scores = tl.dot(q_rope, tl.trans(k_rope))
        scores = tl.dot(q0, tl.trans(k0), scores)
        scores = tl.dot(q1, tl.trans(k1), scores)
        scores = tl.dot(q2, tl.trans(k2), scores)
        scores = tl.dot(q3, tl.trans(k3), scores)
        scores = tl.where(valid[None, :], scores * sm_scale_log2, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        # a tile of skipped entries leaves a row at -inf: shift it by 0, not by -inf
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        correction = tl.exp2(running_max - shift)
        probs = tl.exp2(scores - shift[:, None])
        running_sum = running_sum * correction + tl.sum(probs, 1)
        p = probs.to(tl.bfloat16)
        acc0 = tl.dot(p, k0, acc0 * correction[:, None])
        acc1 = tl.dot(p, k1, acc1 * correction[:, None])
        acc2 = tl.dot(p, k2, acc2 * correction[:, None])
        acc3 = tl.dot(p, k3, acc3 * correction[:, None])
        running_max = new_max

    out_rows = OUT + batch.to(tl.int64) * stride_o_batch + q_token * stride_o_token + heads * stride_o_head
    lse_rows = LSE + batch.to(tl.int64) * stride_lse_batch + heads * stride_lse_head + q_token * stride_lse_token
    lse2, safe_sum = _split_lse(running_max, running_sum)
    if NUM_SPLITS == 1:
        out_scale = (tl.where(running_sum != 0, 1.0 / safe_sum, 0.0) + poison)[:, None]
        _sparse_store(out_rows, row_ok, acc0 * out_scale, 0, CHUNK)
        _sparse_store(out_rows, row_ok, acc1 * out_scale, 1, CHUNK)
        _sparse_store(out_rows, row_ok, acc2 * out_scale, 2, CHUNK)
        _sparse_store(out_rows, row_ok, acc3 * out_scale, 3, CHUNK)
        _sparse_store_lse(lse_rows, row_ok, lse2 + poison)
    else:
        pair = query * tl.num_programs(2) + group
        slot = pair * NUM_SPLITS + split
        r = tl.arange(0, ROWS)
        dims = tl.arange(0, CHUNK)
        partial = PARTIAL_O + slot.to(tl.int64) * LATENT * ROWS
        tl.store(partial + (0 * CHUNK + dims)[None, :] * ROWS + r[:, None], acc0 / safe_sum[:, None])
        tl.store(partial + (1 * CHUNK + dims)[None, :] * ROWS + r[:, None], acc1 / safe_sum[:, None])
        tl.store(partial + (2 * CHUNK + dims)[None, :] * ROWS + r[:, None], acc2 / safe_sum[:, None])
        tl.store(partial + (3 * CHUNK + dims)[None, :] * ROWS + r[:, None], acc3 / safe_sum[:, None])
        tl.store(PARTIAL_LSE + slot * ROWS + r, lse2 + poison)  # a poisoned split's NaN lse makes the merge NaN
        if _last_split_to_finish(SPLIT_TICKETS, pair, NUM_SPLITS):
            first = pair * NUM_SPLITS
            for t in tl.static_range(4):
                offsets = (t * CHUNK + dims)[:, None] * ROWS + r[None, :]
                merged_t, merged_lse2 = _merge_splits(PARTIAL_O, PARTIAL_LSE, first, offsets, r, NUM_SPLITS, ROWS,
                                                      LATENT * ROWS)
                _sparse_store(out_rows, row_ok, tl.trans(merged_t), t, CHUNK)
            _sparse_store_lse(lse_rows, row_ok, merged_lse2)
            tl.atomic_xchg(SPLIT_TICKETS + pair, 0)


_SPARSE_KERNEL_SIGNATURE = {
    "Q": "*bf16", "KV8": "*fp8e4nv", "KV32": "*fp32", "KV16": "*bf16", "INDICES": "*i32", "TOPK_LENGTH": "*i32",
    "OUT": "*bf16", "LSE": "*fp32", "PARTIAL_O": "*fp32", "PARTIAL_LSE": "*fp32", "SPLIT_TICKETS": "*i32",
    "sm_scale_log2": "fp32", "capacity": "i32", "page_size": "i32", "num_heads": "i32", "q_len": "i32", "topk": "i32",
    "stride_q_batch": "i32", "stride_q_token": "i32", "stride_q_head": "i32", "stride_kv_block": "i32",
    "stride_idx_batch": "i32", "stride_idx_token": "i32", "stride_o_batch": "i32", "stride_o_token": "i32",
    "stride_o_head": "i32", "stride_lse_batch": "i32", "stride_lse_head": "i32", "stride_lse_token": "i32",
}

# FlashMLA's benchmark shapes align every argument but these (the float scale, the lse's token stride, s_q)
_SPARSE_ALIGNED_ARGS = tuple(name for name in _SPARSE_KERNEL_SIGNATURE
                             if name not in ("sm_scale_log2", "stride_lse_token", "q_len"))


def triton_sparse_compile_plan(params, fp8_dtype="fp8e4nv", num_splits=(1, 2), topk_length=(False, True)):
    """The portable sparse route's compiles for a serving table row's params: one split and two,
    with and without topk_length. Aligned as FlashMLA's benchmark shapes launch it: pages of 64,
    topk 2048, 64 or 128 heads, s_q 2 (every pointer, the capacity, topk and the strides but the
    lse's token stride and the float scale). The cache's bytes are float8_e4m3fn on every target
    (FlashMLA's layout), whatever fp8_dtype the target's dense cache takes."""
    del fp8_dtype
    p = params
    return [{"kernel": _mla_sparse_kernel, "signature": dict(_SPARSE_KERNEL_SIGNATURE),
             "constexprs": {"NUM_SPLITS": splits, "BLOCK_N": p["block_n"], "ROWS": p["rows"], "HAS_TOPK_LENGTH": has,
                            "LATENT": V_HEAD_DIM, "CHUNK": 128, "ROPE": ROPE_DIM},
             "aligned_args": list(_SPARSE_ALIGNED_ARGS),
             "range32_args": [name for name, kind in _SPARSE_KERNEL_SIGNATURE.items() if kind.startswith("*")],
             "num_warps": p["num_warps"], "num_stages": p["num_stages"]}
            for splits in num_splits for has in topk_length]


# the Hopper sparse kernel's: the portable one's tensors but the tickets, its scalars with the units'
# count and head groups for the page size (a constexpr there), the same strides
_SPARSE_HOPPER_SIGNATURE = {
    **{name: kind for name, kind in _SPARSE_KERNEL_SIGNATURE.items()
       if kind.startswith("*") and name != "SPLIT_TICKETS"},
    "sm_scale_log2": "fp32", "capacity": "i32", "num_units": "i32", "groups": "i32", "num_heads": "i32",
    "q_len": "i32", "topk": "i32",
    **{name: kind for name, kind in _SPARSE_KERNEL_SIGNATURE.items() if name.startswith("stride_")},
}


def hopper_sparse_compile_plan(params, fp8_dtype="fp8e4nv", num_splits=(1, 2), topk_length=(False, True)):
    """The warp-specialised sparse kernel at the Hopper row's params, sm_90 only: with and without
    topk_length, aligned as triton_sparse_compile_plan's; then its merge kernel at two head groups,
    as _sparse_launch launches it."""
    del fp8_dtype, num_splits  # the program count is a launch's grid
    p = params
    merge_signature = {"PARTIAL_O": "*fp32", "PARTIAL_LSE": "*fp32", "OUT": "*bf16", "LSE": "*fp32",
                       **{name: "i32" for name in ("num_units", "programs", "num_heads", "q_len", "topk",
                                                   "stride_o_batch", "stride_o_token", "stride_o_head",
                                                   "stride_lse_batch", "stride_lse_head", "stride_lse_token")}}
    merge = {"kernel": _mla_sparse_combine_kernel, "signature": merge_signature, "targets": ["sm90"],
             "constexprs": {"GROUPS": 2, "BLOCK_N": p["block_n"], "MAX_PIECES": SPARSE_MAX_PIECES,
                            "DIMS": SPARSE_COMBINE_DIMS, "WARPS": 4},
             "aligned_args": [name for name, kind in merge_signature.items() if kind[0] == "*"],
             "num_warps": 4, "num_stages": 1}
    return [{"kernel": _mla_sparse_hopper_kernel, "signature": dict(_SPARSE_HOPPER_SIGNATURE),
             "constexprs": {"BLOCK_N": p["block_n"], "HAS_TOPK_LENGTH": has,
                            "STAGES": p["num_stages"], "WARPS": p["num_warps"], "PAGE_SIZE": 64},
             "aligned_args": [name for name in _SPARSE_ALIGNED_ARGS if name in _SPARSE_HOPPER_SIGNATURE],
             "range32_args": [], "num_warps": p["num_warps"], "num_stages": 1, "targets": ["sm90"]}
            for has in topk_length] + [merge]


# =============================================================================================
# The Hopper route (Gluon, sm_90 only)
# NVIDIA Hopper only (H100, H200), written in Gluon, the explicit-layout dialect that ships with
# Triton 3.6. Why a second kernel: P.V needs V^T, and V is stored token-major. tl.dot can only get
# V^T into the MMA by converting the fp8 tile to f16 in registers through byte-wise transposed
# shared-memory reads, which holds the portable kernel far from the byte floor.
# Here the kernel reads each fp8 V chunk from its TMA tile straight into the register fragment of
# V^T that the fp8 wgmma takes as its A operand (4 tokens x 4 dims per thread, the bytes repacked
# in registers), so both products are fp8 wgmma fed by TMA and nothing is copied back to shared
# memory. Off Hopper, or where Gluon does not import, the route does not exist and its table
# rows are skipped (each is followed by a portable row).
# Kernels: the tokens-as-M kernels (tokens as the MMA's M, one tile loop, _split_tiles) for
# custom_kernel's contiguous rows and for the serving API's pages, read by TMA where a page holds
# whole tiles and gathered by cp.async where it does not; the seesaw kernel (query rows as M, two
# compute warpgroups and a loader warp) for the serving API's 64+ query rows on pages of whole
# tiles; the sparse form's warp-specialised kernel (DeepSeek-V3.2's top-k entries); the combine
# kernel, which merges the serving kernels' split requests.
# =============================================================================================
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAVE_GLUON = hasattr(triton, "constexpr_function")
except Exception:  # an older Triton, or one built without the NVIDIA Gluon dialect
    HAVE_GLUON = False


class _GluonAbsent:
    """Stands in for gluon, gl and triton.constexpr_function where Gluon does not import: the
    definitions below still run (decorators, annotations and constants), nothing of them is ever
    compiled."""

    class constexpr:  # noqa: N801  (gl.constexpr's name)
        def __init__(self, value=None):
            self.value = value

    @staticmethod
    def jit(fn):
        return fn

    constexpr_function = jit


if not HAVE_GLUON:
    gluon = gl = _GluonAbsent()
_constexpr_function = triton.constexpr_function if HAVE_GLUON else _GluonAbsent.jit


def _is_hopper():
    return (HAVE_GLUON and torch.version.hip is None and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] == 9)


HOPPER = _is_hopper()
HOPPER_CHUNK = 128  # latent dims per V transpose and P.V product (4 per token)
CHUNK = gl.constexpr(HOPPER_CHUNK)  # the same, for the Gluon kernels
TMA_BOX_BYTES = 128  # bytes of latent dims per row of a 3D TMA box: the 128-byte swizzle the MMAs read


# --- Hopper: shared helpers (P.V layouts, q, tiles, softmax, stores, pages) ------------------
# P.V = V^T . P^T needs V^T, and V is stored token-major; fp8 wgmma takes an MN-major operand
# from shared memory only for 16-bit types. So V^T is the A operand IN REGISTERS: the MMA's
# register fragment (DotOperandLayout(0, O_MMA, 4) on 128 rows x 64 k) holds per thread 4
# consecutive k of a row per 32-bit register. Rows are relabelled latent dims and k relabelled
# tokens (the sum over tokens does not care about their order, P^T gets the same one; the
# output rows are relabelled back before the store), chosen so that the row bits a thread
# holds in registers are the lowest dims (one 32-bit load per token, 16-bit at 8 warps) and
# the k bits the lanes hold are token bits 1-2 (rows of distinct 128-byte swizzle phase: no
# bank conflicts). The loaded bytes are then repacked (4 dims of a token -> 4 tokens of a dim)
# in registers; nothing goes back to shared memory.
# _DIM_BIT[warps][i]: the latent-dim bit that row bit i is; _TOKEN_BIT[k_width][i]: the token bit
# k bit i is. The f16 product (PV_F16, k_width 2: V converted exactly from fp8 in registers, P in
# f16) has 2 consecutive k per register: its lanes hold k bits 1-2, which are token bits 1-2 as
# they are, so its tokens keep their order.
_DIM_BIT = {4: (2, 3, 4, 0, 5, 6, 1), 8: (1, 2, 3, 0, 4, 5, 6)}
_TOKEN_BIT = {4: (0, 3, 1, 2, 4, 5), 2: (0, 1, 2, 3, 4, 5)}
_K_BITS = {4: ((0, 1, 4, 5), (2, 3)), 2: ((0, 3, 4, 5), (1, 2))}  # k bits in (registers, lanes)
# The fp8 fragment read by ldmatrix.trans (_v_ldsm, 4 warps): its lanes hold 16-bit words (dim pairs)
# 0-7 of an 8 x 8 matrix, so row bits 0-2 are dim bits 1-3 and dim bit 0 picks the byte (row bit 3)
_DIM_BIT_LDSM = (1, 2, 3, 0, 5, 6, 4)


@_constexpr_function
def _v_operand_load_layout(warps, k_width=4):
    """(64 tokens x 128 dims) layout of a V chunk read from its TMA tile such that relabelling
    (tokens, dims) -> (k, rows) gives the MMA's A fragment (see _DIM_BIT); k_width 4: fp8, 2: f16."""
    dim_bit, token_bit = _DIM_BIT[warps], _TOKEN_BIT[k_width]
    row = lambda i: [0, 1 << dim_bit[i]]  # noqa: E731  (a row bit as a (token, dim) basis)
    k = lambda i: [1 << token_bit[i], 0]  # noqa: E731
    k_regs, k_lanes = _K_BITS[k_width]
    row_regs = [3, 6] if warps == 4 else [3]
    regs = [row(i) for i in sorted(row_regs, key=lambda i: dim_bit[i])] + [k(i) for i in k_regs]
    lanes = [k(i) for i in k_lanes] + [row(0), row(1), row(2)]
    warp_bases = [row(4), row(5)] + ([row(6)] if warps == 8 else [])
    return gl.DistributedLinearLayout(regs, lanes, warp_bases, [], [64, HOPPER_CHUNK])


@_constexpr_function
def _v_operand_order(warps, k_width=4, v_ldsm=False):
    """gl.permute order taking (64 tokens x 128 dims) split into 13 bits (token bit j at
    axis 5 - j, dim bit j at 12 - j) to (rows x k), most significant bit first; v_ldsm: _v_ldsm's
    rows (_DIM_BIT_LDSM, 4 warps)."""
    dim_bit = _DIM_BIT_LDSM if v_ldsm else _DIM_BIT[warps]
    rows = [12 - dim_bit[i] for i in range(6, -1, -1)]
    return tuple(rows + [5 - _TOKEN_BIT[k_width][i] for i in range(5, -1, -1)])


@_constexpr_function
def _pv_token_order():
    """gl.permute order taking (64 tokens x N) split into 6 token bits + N to (k x N) (fp8)."""
    return tuple([5 - _TOKEN_BIT[4][i] for i in range(5, -1, -1)] + [6])


@_constexpr_function
def _rows_to_dims_order(warps, v_ldsm=False):
    """gl.permute order taking (128 rows x N) split into 7 row bits + N to (dims x N)."""
    rows_of_dim = {d: i for i, d in enumerate(_DIM_BIT_LDSM if v_ldsm else _DIM_BIT[warps])}
    return tuple([6 - rows_of_dim[j] for j in range(6, -1, -1)] + [7])


@_constexpr_function
def _v_word_dims(warps):
    """The consecutive latent dims a thread holds of each token in _v_operand_load_layout(warps, 2)
    (its first register bases are dim bits 0, 1, ...): the word _v_f16 reads (2 at 8 warps, 4 at 4)."""
    regs = _v_operand_load_layout(warps, 2).reg_bases
    bits = 0
    while bits < len(regs) and regs[bits] == [0, 1 << bits]:
        bits += 1
    return 1 << bits


@_constexpr_function
def _v_word_layout(warps):
    """_v_operand_load_layout(warps, 2) over (64 tokens x words) of _v_word_dims(warps) dims, token
    bit 0 the first register basis (_v_f16 splits the tokens' pairs off)."""
    full = _v_operand_load_layout(warps, 2)
    inner = _v_word_dims(warps) - 1  # the dim bits inside a word
    shift = inner.bit_length()
    word = lambda bases: [[t, d >> shift] for t, d in bases if d == 0 or d > inner]  # noqa: E731
    return gl.DistributedLinearLayout(word(full.reg_bases), word(full.lane_bases), word(full.warp_bases), [],
                                      [64, HOPPER_CHUNK >> shift])


# fp8 -> f16 of a V chunk's token pairs (_v_f16): the two tokens' words (dims d, d + 1 [, d + 2,
# d + 3] of token 2i and of 2i + 1) byte-interleaved by one prmt per 2 dims, then one cvt per dim:
# the f16 pair (token 2i, 2i + 1) of each dim, as the MMA's k_width 2 fragment holds it; by dims
# in a word (_v_word_dims): (asm, constraints)
_V_F16_ASM = {
    2: ("{ .reg .b32 w, p; .reg .b16 l, h; mov.b32 w, {$4, $5}; prmt.b32 p, w, 0, 0x3120; mov.b32 {l, h}, p; "
        "cvt.rn.f16x2.e4m3x2 w, l; mov.b32 {$0, $1}, w; cvt.rn.f16x2.e4m3x2 w, h; mov.b32 {$2, $3}, w; }",
        "=h,=h,=h,=h,h,h"),
    4: ("{ .reg .b32 w, p, q; .reg .b16 l, h; prmt.b32 p, $8, $9, 0x5140; prmt.b32 q, $8, $9, 0x7362; "
        "mov.b32 {l, h}, p; cvt.rn.f16x2.e4m3x2 w, l; mov.b32 {$0, $1}, w; cvt.rn.f16x2.e4m3x2 w, h; "
        "mov.b32 {$2, $3}, w; mov.b32 {l, h}, q; cvt.rn.f16x2.e4m3x2 w, l; mov.b32 {$4, $5}, w; "
        "cvt.rn.f16x2.e4m3x2 w, h; mov.b32 {$6, $7}, w; }",
        "=h,=h,=h,=h,=h,=h,=h,=h,r,r"),
}


@_constexpr_function
def _v_f16_asm(word_dims, part):
    """_V_F16_ASM's asm (part 0) or constraints (part 1) for words of `word_dims` dims."""
    return _V_F16_ASM[word_dims][part]


@gluon.jit
def _v_f16(kv_chunk, WARPS: gl.constexpr):
    """A V chunk (64 tokens x 128 fp8 dims) in _v_operand_load_layout(WARPS, 2), converted exactly
    to f16: read as words of the dims a thread holds (16-bit at 8 warps, 32-bit at 4), each pair
    of tokens repacked and converted by _V_F16_ASM: one prmt per two cvt, where the element-wise
    conversion compiled to one or more per cvt (and, at 8 warps, 16-bit loads where ldmatrix now
    reads 8 rows at a time)."""
    WORD_DIMS: gl.constexpr = _v_word_dims(WARPS)
    WORD: gl.constexpr = gl.int16 if WORD_DIMS == 2 else gl.int32
    CHUNK: gl.constexpr = kv_chunk.shape[1]
    W: gl.constexpr = CHUNK // WORD_DIMS
    words = kv_chunk._reinterpret(WORD, [64, W], gl.NVMMASharedLayout.get_default_for([64, W], WORD))
    even, odd = gl.split(gl.permute(gl.reshape(words.load(_v_word_layout(WARPS)), [32, 2, W]), (0, 2, 1)))
    f = gl.inline_asm_elementwise(_v_f16_asm(WORD_DIMS, 0), _v_f16_asm(WORD_DIMS, 1), [even, odd],
                                  (gl.float16,) * (2 * WORD_DIMS), True, 1)
    if WORD_DIMS == 2:  # (token pairs, words, token bit 0, dim bit 0)
        v = gl.join(gl.join(f[0], f[1]), gl.join(f[2], f[3]))
        v = gl.permute(v, (0, 2, 1, 3))
    else:  # (token pairs, words, token bit 0, dim bit 0, dim bit 1)
        v = gl.join(gl.join(gl.join(f[0], f[1]), gl.join(f[2], f[3])),
                    gl.join(gl.join(f[4], f[5]), gl.join(f[6], f[7])))
        v = gl.permute(v, (0, 2, 1, 4, 3))
    return gl.convert_layout(gl.reshape(v, [64, CHUNK]), _v_operand_load_layout(WARPS, 2))


@gluon.jit
def _v_ldsm(kv_chunk):
    """A V chunk (64 tokens x 128 fp8 dims) as the fp8 MMA's A fragment of V^T (128 rows x 64 k, rows
    by _DIM_BIT_LDSM, k by _TOKEN_BIT[4]) at 4 warps: read as 16-bit words (dim pairs) by ldmatrix.trans,
    which gives a thread tokens t and t + 1 of a word per register (token bit 8 in the next one), then
    one prmt per fragment register: the low bytes of the two registers are dim 2w's tokens t, t + 1,
    t + 8, t + 9, the high bytes dim 2w + 1's."""
    words = kv_chunk._reinterpret(gl.int16, [64, 64], gl.NVMMASharedLayout.get_default_for([64, 64], gl.int16))
    WORDS: gl.constexpr = gl.DistributedLinearLayout([[1, 0], [8, 0], [16, 0], [32, 0], [0, 8]],
                                                     [[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]],
                                                     [[0, 16], [0, 32]], [], [64, 64])
    low, high = gl.inline_asm_elementwise("prmt.b32 $0, $2, $3, 0x6420; prmt.b32 $1, $2, $3, 0x7531;",
                                          "=r,=r,r,r", [words.load(WORDS)], (gl.int8, gl.int8), True, 4)
    v = gl.reshape(gl.join(low, high), [64, 128]).to(gl.float8e4nv, bitcast=True)  # (token, 2 word + byte)
    return gl.reshape(gl.permute(gl.reshape(v, [2] * 13), _v_operand_order(4, k_width=4, v_ldsm=True).value), [128, 64])


@gluon.jit
def _pv_chunk(kv_chunk, pt_smem, acc, correction2, WARPS: gl.constexpr, O_MMA: gl.constexpr,
              CHUNK: gl.constexpr, K_WIDTH: gl.constexpr = 4, V_LDSM: gl.constexpr = False):
    """acc * correction + V_chunk^T . P^T with V^T in registers, issued asynchronously (correction2
    None: acc as it is, the caller rescaled it); K_WIDTH 2: V converted to f16 (exact, _v_f16) for an
    f16 product with P^T in f16; V_LDSM: V^T's fp8 fragment by ldmatrix (_v_ldsm: its rows by
    _DIM_BIT_LDSM)."""
    if V_LDSM:
        v_t = _v_ldsm(kv_chunk)
    else:
        if K_WIDTH == 2:
            v = _v_f16(kv_chunk, WARPS)
        else:
            v = kv_chunk.load(_v_operand_load_layout(WARPS, K_WIDTH))
        bits = gl.reshape(v, [2] * 13)
        v_t = gl.reshape(gl.permute(bits, _v_operand_order(WARPS, K_WIDTH).value), [CHUNK, 64])
    v_t = gl.convert_layout(v_t, gl.DotOperandLayout(0, O_MMA, K_WIDTH))
    if correction2 is not None:
        acc = acc * gl.expand_dims(gl.convert_layout(correction2, gl.SliceLayout(0, O_MMA)), 0)
    return warpgroup_mma(v_t, pt_smem.permute((1, 0)), acc, is_async=True)


@gluon.jit
def _rows_to_dims(acc, WARPS: gl.constexpr, V_LDSM: gl.constexpr = False):
    """Undo _pv_chunk's relabelling of the output rows."""
    N: gl.constexpr = acc.shape[1]
    return gl.reshape(gl.permute(gl.reshape(acc, [2] * 7 + [N]), _rows_to_dims_order(WARPS, V_LDSM).value),
                      [128, N])


@_constexpr_function
def _output_layout(warps, rows=16, pairs=True):
    """(128 dims x rows heads) layout of _hi_plus_lo(_rows_to_dims(acc)) with a thread's dims
    first in register order, so that its 4 (2 at 8 warps) consecutive dims store as one vector:
    the same bases as the accumulator's after that relabelling (the conversion moves no data),
    heads 1-2 in the lanes and heads 4 ... rows / 2 in registers (the MMA's N spread).
    pairs False (PV_F16: no hi and lo columns): of _rows_to_dims(acc), head 1 in registers, heads
    2 and 4 in the lanes, 8 ... rows / 2 in registers."""
    low = 0 if pairs else 1  # the head bit of the MMA's lowest lane bit
    heads = [[0, 1 << bit] for bit in range(2 + low, rows.bit_length() - 1)]
    lanes = [[0, 1 << low], [0, 2 << low]]
    regs = [] if pairs else [[0, 1]]
    if warps == 4:
        return gl.DistributedLinearLayout([[1, 0], [2, 0]] + regs + heads, lanes + [[4, 0], [8, 0], [16, 0]],
                                          [[32, 0], [64, 0]], [], [HOPPER_CHUNK, rows])
    return gl.DistributedLinearLayout([[1, 0]] + regs + heads, lanes + [[2, 0], [4, 0], [8, 0]],
                                      [[16, 0], [32, 0], [64, 0]], [], [HOPPER_CHUNK, rows])


@gluon.jit
def _hi_plus_lo(acc):
    """(dims x 2*heads) with the products of P_hi and P_lo interleaved -> (dims x heads) of P.V
    (a thread holds both columns of a head: no data moves)."""
    hi, lo = gl.split(gl.reshape(acc, [acc.shape[0], acc.shape[1] // 2, 2]))
    return (hi + lo * (1.0 / 16)) * (1.0 / 256)


@gluon.jit
def _store_chunk(acc, base, head_scale, LATENT: gl.constexpr, rows=None, row_ok=None):
    """base[h * LATENT + d] = acc[d, h] * head_scale[h] (cast to base's type), stored from acc's
    own layout: after _rows_to_dims a thread holds 4 consecutive dims of a head and 8 lanes
    hold 32 consecutive dims (16-byte stores, 128-byte rows for float32), so no layout change.
    The serving API's rows: base[rows[h] + d] where row_ok[h]."""
    LAYOUT: gl.constexpr = acc.type.layout
    dims = gl.expand_dims(gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, LAYOUT)), 1)
    scale = gl.expand_dims(gl.convert_layout(head_scale, gl.SliceLayout(0, LAYOUT)), 0)
    if rows is None:
        heads = gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, LAYOUT))
        gl.store(base + dims + gl.expand_dims(heads, 0) * LATENT, (acc * scale).to(base.dtype.element_ty))
    else:
        gl.store(base + dims + gl.expand_dims(gl.convert_layout(rows, gl.SliceLayout(0, LAYOUT)), 0),
                 (acc * scale).to(base.dtype.element_ty),
                 mask=gl.expand_dims(gl.convert_layout(row_ok, gl.SliceLayout(0, LAYOUT)), 0))


@_constexpr_function
def _merge_layout(splits, dims, heads, warps):
    """(splits x dims x heads) of partials, 64 floats per thread for 128 threads: all splits in
    each thread (the sums over splits stay in registers; spreading splits over warps was slower),
    64 / splits contiguous dims (at most 4: 16-byte loads; 2 at 32 splits, 1 at
    64), lanes and warps over dims first, then heads; no element held twice."""
    per_thread = min(4, max(1, 64 // splits))
    dim_lanes = min(dims // per_thread, 8)
    dim_warps = max(1, min(warps, dims // (per_thread * dim_lanes)))
    return gl.BlockedLayout([splits, per_thread, 1], [1, dim_lanes, 32 // dim_lanes],
                            [1, dim_warps, warps // dim_warps], [1, 2, 0])


@gluon.jit
def _merge_slice(PARTIAL_O, PARTIAL_LSE, out_row, first_slot, dim_begin, kv_scale, WARPS: gl.constexpr,
                 NUM_SPLITS: gl.constexpr, SLICE: gl.constexpr, NUM_HEADS: gl.constexpr, LATENT: gl.constexpr,
                 splits_here=None, rows=None, row_ok=None):
    """Latent dims [dim_begin, dim_begin + SLICE) of the output row: the splits' partials weighted
    by their lse. All splits' lse and partial slices are read at once (one memory latency, 64
    floats per thread at 4 warps when SLICE = 512 / next_power_of_2(NUM_SPLITS)); each thread
    holds every split of its elements, so the sums over splits stay in registers.
    The serving API's merge: `splits_here` (<= NUM_SPLITS) splits at run time, output rows at
    rows[h] where row_ok[h], and rows with nothing attended (every lse -inf) merge to 0."""
    LAYOUT: gl.constexpr = _merge_layout(triton.next_power_of_2(NUM_SPLITS), SLICE, NUM_HEADS, WARPS)
    splits = gl.arange(0, triton.next_power_of_2(NUM_SPLITS), layout=gl.SliceLayout(1, gl.SliceLayout(2, LAYOUT)))
    dims = gl.arange(0, SLICE, layout=gl.SliceLayout(0, gl.SliceLayout(2, LAYOUT)))
    heads = gl.arange(0, NUM_HEADS, layout=gl.SliceLayout(0, gl.SliceLayout(1, LAYOUT)))
    splits = gl.expand_dims(gl.expand_dims(splits, 1), 2)
    dims = gl.expand_dims(gl.expand_dims(dims, 0), 2)
    heads = gl.expand_dims(gl.expand_dims(heads, 0), 1)
    present = splits < (NUM_SPLITS if splits_here is None else splits_here)
    lse = gl.load(PARTIAL_LSE + (first_slot + splits) * NUM_HEADS + heads, mask=present, other=float("-inf"),
                  cache_modifier=".cg")
    partial = gl.load(PARTIAL_O + (first_slot + splits) * (LATENT * NUM_HEADS) + heads * LATENT + dim_begin + dims,
                      mask=present, other=0.0, cache_modifier=".cg")
    top = gl.max(lse, 0)
    out_dims = gl.expand_dims(gl.arange(0, SLICE, layout=gl.SliceLayout(1, gl.SliceLayout(0, LAYOUT))), 1)
    if rows is None:
        weight = gl.exp2(lse - gl.expand_dims(top, 0))
        merged = gl.sum(partial * weight, 0) * (kv_scale / gl.sum(weight, 0))  # (dims x heads)
        out_heads = gl.arange(0, NUM_HEADS, layout=gl.SliceLayout(0, gl.SliceLayout(0, LAYOUT)))
        gl.store(out_row + dim_begin + out_dims + gl.expand_dims(out_heads, 0) * LATENT,
                 merged.to(out_row.dtype.element_ty))
    else:
        weight = gl.exp2(lse - gl.expand_dims(gl.where(top == float("-inf"), 0.0, top), 0))
        weight_sum = gl.sum(weight, 0)
        merged = gl.sum(partial * weight, 0) * gl.where(weight_sum == 0.0, 0.0, kv_scale / weight_sum)
        OUT_ROWS: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, LAYOUT))
        gl.store(out_row + dim_begin + out_dims + gl.expand_dims(gl.convert_layout(rows, OUT_ROWS), 0),
                 merged.to(out_row.dtype.element_ty),
                 mask=gl.expand_dims(gl.convert_layout(row_ok, OUT_ROWS), 0))


@gluon.jit
def _load_q(Q, row, stride_q_token, ROWS: gl.constexpr, NUM_HEADS: gl.constexpr, CHUNK: gl.constexpr,
            LATENT: gl.constexpr, ROPE: gl.constexpr, rows=None, row_ok=None):
    """q[row] (NUM_HEADS x 576, bf16 -> float32) as four 128-dim chunks and the rope part; the
    serving API's rows: Q + rows[h] where row_ok[h] (0 elsewhere)."""
    if rows is None:
        heads = gl.arange(0, NUM_HEADS, layout=gl.SliceLayout(1, ROWS))
        q_base = Q + row * stride_q_token + gl.expand_dims(heads, 1) * (LATENT + ROPE)
        ok = None
    else:
        q_base = Q + gl.expand_dims(gl.convert_layout(rows, gl.SliceLayout(1, ROWS)), 1)
        ok = gl.expand_dims(gl.convert_layout(row_ok, gl.SliceLayout(1, ROWS)), 1)
    q_dims = gl.expand_dims(gl.arange(0, CHUNK, layout=gl.SliceLayout(0, ROWS)), 0)
    rope_dims = gl.expand_dims(gl.arange(0, ROPE, layout=gl.SliceLayout(0, ROWS)), 0)
    return (gl.load(q_base + q_dims, mask=ok).to(gl.float32),
            gl.load(q_base + CHUNK + q_dims, mask=ok).to(gl.float32),
            gl.load(q_base + 2 * CHUNK + q_dims, mask=ok).to(gl.float32),
            gl.load(q_base + 3 * CHUNK + q_dims, mask=ok).to(gl.float32),
            gl.load(q_base + LATENT + rope_dims, mask=ok).to(gl.float32))


@gluon.jit
def _issue_scores(kv_latent, kv_rope, q_latent, q_rope, slot, no_scores, NUM_CHUNKS: gl.constexpr):
    """S^T of the tile in ring slot `slot`: 5 fp8 wgmma (4 latent boxes + rope) with Q^T, issued
    asynchronously (the caller waits)."""
    first = slot * NUM_CHUNKS
    scores = warpgroup_mma(kv_latent.index(first), q_latent.index(0).permute((1, 0)), no_scores,
                           use_acc=False, is_async=True)
    for c in gl.static_range(1, NUM_CHUNKS):
        scores = warpgroup_mma(kv_latent.index(first + c), q_latent.index(c).permute((1, 0)), scores,
                               is_async=True)
    return warpgroup_mma(kv_rope.index(slot), q_rope.permute((1, 0)), scores, is_async=True)


@gluon.jit
def _load_tile(lat_desc, rope_desc, kv_latent, kv_rope, barrier, slot, token, pred, TILE_BYTES: gl.constexpr,
               NUM_CHUNKS: gl.constexpr, CHUNK: gl.constexpr, LATENT: gl.constexpr):
    """TMA: tokens [token, token + 64) of the cache into ring slot `slot`, completing on `barrier`
    (skipped when not pred): the latent dims, then the rope box. A 3D lat_desc (box, token, dim:
    the paged kernel's) is one copy that lands box after box, each the (64 x 128-byte) swizzled
    tile the MMAs read, so the slot's NUM_CHUNKS chunks seen as (boxes x 64 x box dims) are the
    same bytes; the compiler puts a CTA barrier before each copy into the ring, so one copy where
    NUM_CHUNKS were is 3 barriers fewer a tile. A 2D one (custom_kernel's) is a
    copy per chunk: there the one copy made the 4-request shapes (a tile or two a program)
    slower."""
    mbarrier.expect(barrier, TILE_BYTES, pred=pred)
    if len(lat_desc.block_type.shape) == 3:
        BOXES: gl.constexpr = lat_desc.block_type.shape[0]
        BOX_DIMS: gl.constexpr = lat_desc.block_type.shape[2]
        ring = kv_latent._reinterpret(kv_latent.dtype, [kv_latent.shape[0] // NUM_CHUNKS, BOXES, kv_latent.shape[1],
                                                        BOX_DIMS], lat_desc.layout)
        tma.async_copy_global_to_shared(lat_desc, [0, token, 0], barrier, ring.index(slot), pred=pred)
    else:
        for c in gl.static_range(NUM_CHUNKS):
            tma.async_copy_global_to_shared(lat_desc, [token, c * CHUNK], barrier,
                                            kv_latent.index(slot * NUM_CHUNKS + c), pred=pred)
    tma.async_copy_global_to_shared(rope_desc, [token, LATENT], barrier, kv_rope.index(slot), pred=pred)


@_constexpr_function
def _gather_layout(element_bytes, cols, warps):
    """Registers of a (64 tokens x cols) gather: 16 bytes of a row per thread (one cp.async), the
    lanes of a warp along the row, then along the tokens."""
    lanes = cols * element_bytes // 16
    return gl.BlockedLayout([1, 16 // element_bytes], [32 // lanes, lanes], [warps, 1], [1, 0])


@gluon.jit
def _gather_rows(BT_ROW, kv_begin, kv_end, t, num_tiles, num_blocks, PAGE_SIZE: gl.constexpr,
                 BLOCK_N: gl.constexpr, LAYOUT: gl.constexpr):
    """Per token of the split's tile t, in LAYOUT's rows: (its row of the cache's blocks x page
    rows, whether it is read, whether its block id is outside [0, num_blocks)). Tokens past the
    split, and past its last tile, are not read; nor is their block-table entry (past a request's
    used blocks it may hold anything)."""
    tokens = kv_begin + t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LAYOUT))
    used = (tokens < kv_end) & (t < num_tiles)
    block = gl.load(BT_ROW + tokens // PAGE_SIZE, mask=used, other=0)
    bad = used & ((block < 0) | (block >= num_blocks))
    return block * PAGE_SIZE + tokens % PAGE_SIZE, used & ~bad, bad.to(gl.int32)


@gluon.jit
def _gather_next(BT_ROW, kv_begin, kv_end, t, num_tiles, num_blocks, bad_rows, PAGE_SIZE: gl.constexpr,
                 BLOCK_N: gl.constexpr, LAT_LAYOUT: gl.constexpr, ROPE_LAYOUT: gl.constexpr):
    """_gather_rows of tile t for both of _gather_tile's layouts: (latent rows, read, rope rows,
    read, bad_rows with tile t's bad block ids added)."""
    lat_rows, lat_read, bad = _gather_rows(BT_ROW, kv_begin, kv_end, t, num_tiles, num_blocks, PAGE_SIZE, BLOCK_N,
                                           LAT_LAYOUT)
    rope_rows, rope_read, _ = _gather_rows(BT_ROW, kv_begin, kv_end, t, num_tiles, num_blocks, PAGE_SIZE, BLOCK_N,
                                           ROPE_LAYOUT)
    return lat_rows, lat_read, rope_rows, rope_read, bad_rows | bad


@gluon.jit
def _gather_tile(KV, stride_kv_row, lat_rows, lat_read, rope_rows, rope_read, kv_latent, kv_rope, slot,
                 NUM_CHUNKS: gl.constexpr, CHUNK: gl.constexpr, LATENT: gl.constexpr, ROPE: gl.constexpr,
                 LAT_LAYOUT: gl.constexpr, ROPE_LAYOUT: gl.constexpr):
    """cp.async of a tile's 64 cache rows (from _gather_rows) into ring slot `slot`, 16 bytes
    a thread and copy, into the same swizzled boxes TMA fills; a row not read lands as zeros (a
    page's tail may hold NaN, and 0 x NaN is NaN in P.V)."""
    lat_cols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, LAT_LAYOUT))
    lat = KV + gl.expand_dims(lat_rows.to(gl.int64) * stride_kv_row, 1) + gl.expand_dims(lat_cols, 0)
    for c in gl.static_range(NUM_CHUNKS):
        async_copy.async_copy_global_to_shared(kv_latent.index(slot * NUM_CHUNKS + c), lat + c * CHUNK,
                                               gl.expand_dims(lat_read, 1))
    rope_cols = gl.arange(0, ROPE, layout=gl.SliceLayout(0, ROPE_LAYOUT))
    async_copy.async_copy_global_to_shared(kv_rope.index(slot),
                                           KV + gl.expand_dims(rope_rows.to(gl.int64) * stride_kv_row, 1) + LATENT
                                           + gl.expand_dims(rope_cols, 0),
                                           gl.expand_dims(rope_read, 1))


@gluon.jit
def _gather_issue(KV, stride_kv_row, BT_ROW, lat_rows, lat_read, rope_rows, rope_read, bad_rows, kv_latent, kv_rope,
                  t, slot, kv_begin, kv_end, num_tiles, num_blocks, NUM_CHUNKS: gl.constexpr, CHUNK: gl.constexpr,
                  LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
                  LAT_LAYOUT: gl.constexpr, ROPE_LAYOUT: gl.constexpr):
    """Tile t's copies (its rows from _gather_next) into ring slot `slot`, one commit group, then
    tile t + 1's rows (_gather_next). No copy for a tile past the split (its slot is the next
    segment's first, whose copy it would race); the group is committed all the same, so that
    each tile's wait counts the same groups."""
    if t < num_tiles:
        _gather_tile(KV, stride_kv_row, lat_rows, lat_read, rope_rows, rope_read, kv_latent, kv_rope, slot,
                     NUM_CHUNKS, CHUNK, LATENT, ROPE, LAT_LAYOUT, ROPE_LAYOUT)
    async_copy.commit_group()
    return _gather_next(BT_ROW, kv_begin, kv_end, t + 1, num_tiles, num_blocks, bad_rows, PAGE_SIZE, BLOCK_N,
                        LAT_LAYOUT, ROPE_LAYOUT)


@gluon.jit
def _quantize_q(q0, q1, q2, q3, qr, q_latent, q_rope, FP8_MAX: gl.constexpr):
    """Q^T in fp8 into shared memory, scaled by the program's own amax; returns that scale.
    The chunks' elementwise max comes first so that one reduction crosses the warps (each
    cross-warp reduction costs barriers), and one reciprocal replaces 72 divisions per thread."""
    latent_amax = gl.max(gl.maximum(gl.maximum(gl.abs(q0), gl.abs(q1)), gl.maximum(gl.abs(q2), gl.abs(q3))), 1)
    amax = gl.maximum(gl.max(gl.maximum(latent_amax, gl.max(gl.abs(qr), 1)), 0), 1e-12)
    q_inverse = FP8_MAX / amax
    q_latent.index(0).store((q0 * q_inverse).to(gl.float8e4nv))
    q_latent.index(1).store((q1 * q_inverse).to(gl.float8e4nv))
    q_latent.index(2).store((q2 * q_inverse).to(gl.float8e4nv))
    q_latent.index(3).store((q3 * q_inverse).to(gl.float8e4nv))
    q_rope.store((qr * q_inverse).to(gl.float8e4nv))
    fence_async_shared()
    return amax / FP8_MAX


@_constexpr_function
def _exchange_layout(row_layout):
    """(rows x 4 token warps) layout of the shared row-max exchange read back: the 4 warps'
    partial maxima of a row in one thread's registers (one 16-byte load), the rows spread as in
    row_layout (a linear layout of the rows), so that the max over the 4 lands in row_layout with
    no data moved."""
    lift = lambda bases: [[b[0], 0] for b in bases]  # noqa: E731
    return gl.DistributedLinearLayout([[0, 1], [0, 2]] + lift(row_layout.reg_bases), lift(row_layout.lane_bases),
                                      lift(row_layout.warp_bases), [], [row_layout.shape[0], 4])


@gluon.jit
def _through_shared(values, buffer, LAYOUT: gl.constexpr):
    """values in LAYOUT by way of `buffer` (shared, values' shape) and one barrier: the row max's
    partials and the rescale factors, where gl.max across warps takes two barriers and the
    factors' gl.convert_layout from S^T's rows to P.V's three."""
    buffer.store(values)
    gl.thread_barrier()
    return buffer.load(LAYOUT)


@gluon.jit
def _exchanged_max(scores, exchange):
    """The (tokens x rows) tile's max per row, in the rows' layout of scores: each warp reduces its
    16 tokens in registers and lanes, writes its partial to `exchange` (rows x 4, float32), and
    after one barrier every thread reads the 4 partials of its rows (where gl.max over the warps
    takes two barriers)."""
    ROWS: gl.constexpr = scores.shape[1]
    gl.static_assert(scores.shape[0] == 64, "4 token warps of 16 tokens")
    S_ROWS: gl.constexpr = gl.SliceLayout(0, scores.type.layout)
    partials = _through_shared(gl.permute(gl.max(gl.reshape(scores, [4, 16, ROWS]), 1), (1, 0)), exchange,
                               _exchange_layout(gl.to_linear_layout(S_ROWS, [ROWS])))
    return gl.convert_layout(gl.max(partials, 1), S_ROWS)


@gluon.jit
def _online_softmax(scores, valid, score_scale, running_max, row_sums, CAUSAL: gl.constexpr = False,
                    exchange=None):
    """One tile's step of the online softmax (float32, base 2): the tile's probabilities, the
    factor that rescales the earlier terms, the new running max and the (tokens x heads) sums. The
    sums are reduced over tokens once after the loop: a per-tile reduction over tokens crosses the
    warps (shared memory and a barrier); the max still must, through `exchange` where given
    (_exchanged_max). `valid`: (tokens x 1), or (tokens x rows) where causal rows end at different
    tokens; such a row may have no token yet (max -inf): it is shifted by 0, not by -inf."""
    scores = gl.where(valid, scores * score_scale, float("-inf"))
    if exchange is None:
        tile_max = gl.max(scores, 0)
    else:
        tile_max = _exchanged_max(scores, exchange)
    new_max = gl.maximum(running_max, tile_max)
    shift = new_max
    if CAUSAL:
        shift = gl.where(new_max == float("-inf"), 0.0, new_max)
    correction = gl.exp2(running_max - shift)
    probs = gl.exp2(scores - gl.expand_dims(shift, 0))
    row_sums = row_sums * gl.expand_dims(correction, 0) + probs
    return probs, correction, new_max, row_sums


@gluon.jit
def _store_probs(probs, correction, pt_smem, BLOCK_N: gl.constexpr, NUM_HEADS: gl.constexpr):
    """P^T into shared memory as one (2 heads x tokens) fp8 tile, column 2h + (0: hi, 1: lo) with
    hi + lo / 16 = 256 P (256 keeps small probabilities normal; hi + lo keeps about 7 bits, like
    bf16), tokens in the order _pv_chunk relabels V's; returns the correction per column."""
    p_scaled = probs * 256.0
    p_hi = p_scaled.to(gl.float8e4nv)
    p_lo = ((p_scaled - p_hi.to(gl.float32)) * 16.0).to(gl.float8e4nv)
    p_both = gl.reshape(gl.join(p_hi, p_lo), [BLOCK_N, 2 * NUM_HEADS])
    p_bits = gl.reshape(p_both, [2] * 6 + [2 * NUM_HEADS])
    pt_smem.store(gl.permute(gl.reshape(gl.permute(p_bits, _pv_token_order().value), [BLOCK_N, 2 * NUM_HEADS]),
                             (1, 0)))
    fence_async_shared()
    gl.thread_barrier()
    return gl.reshape(gl.join(correction, correction), [2 * NUM_HEADS])


@gluon.jit
def _stage_q_bf16(q0, q1, q2, q3, qr, q_latent, q_rope):
    """Q^T as it is (bf16) into shared memory, for a bf16 cache's bf16 products."""
    q_latent.index(0).store(q0.to(gl.bfloat16))
    q_latent.index(1).store(q1.to(gl.bfloat16))
    q_latent.index(2).store(q2.to(gl.bfloat16))
    q_latent.index(3).store(q3.to(gl.bfloat16))
    q_rope.store(qr.to(gl.bfloat16))
    fence_async_shared()


@gluon.jit
def _store_probs_16(probs, pt_smem):
    """P^T (heads x tokens) in pt_smem's 16-bit type (bf16; f16 for PV_F16) into shared memory,
    tokens in their own order."""
    pt_smem.store(gl.permute(probs.to(pt_smem.dtype), (1, 0)))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _pv_tile_bf16(kv_latent, first, pt_smem, acc0, acc1, acc2, acc3, correction):
    """acc_c = acc_c * correction + V_c^T . P^T for a bf16 tile: V_c^T is the ring slot's box read
    transposed by the MMA itself (16-bit MMAs take an MN-major operand from shared memory), so
    nothing is repacked in registers; four products in flight."""
    scale = gl.expand_dims(gl.convert_layout(correction, gl.SliceLayout(0, acc0.type.layout)), 0)
    p_t = pt_smem.permute((1, 0))
    acc0 = warpgroup_mma(kv_latent.index(first).permute((1, 0)), p_t, acc0 * scale, is_async=True)
    acc1 = warpgroup_mma(kv_latent.index(first + 1).permute((1, 0)), p_t, acc1 * scale, is_async=True)
    acc2 = warpgroup_mma(kv_latent.index(first + 2).permute((1, 0)), p_t, acc2 * scale, is_async=True)
    acc3 = warpgroup_mma(kv_latent.index(first + 3).permute((1, 0)), p_t, acc3 * scale, is_async=True)
    return warpgroup_mma_wait(0, deps=(acc0, acc1, acc2, acc3))


@gluon.jit
def _pv_tile(kv_latent, first, pt_smem, acc0, acc1, acc2, acc3, correction2, WARPS: gl.constexpr,
             O_MMA: gl.constexpr, CHUNK: gl.constexpr, K_WIDTH: gl.constexpr = 4):
    """acc_c = acc_c * correction + V_c^T . P^T for the four latent chunks of the tile whose first
    box is kv_latent[first]; two products in flight: chunk c's MMA runs while chunk c + 1 is read
    and repacked. K_WIDTH: see _pv_chunk."""
    acc0 = _pv_chunk(kv_latent.index(first), pt_smem, acc0, correction2, WARPS, O_MMA, CHUNK, K_WIDTH)
    acc1 = _pv_chunk(kv_latent.index(first + 1), pt_smem, acc1, correction2, WARPS, O_MMA, CHUNK, K_WIDTH)
    acc0 = warpgroup_mma_wait(1, deps=(acc0,))
    acc2 = _pv_chunk(kv_latent.index(first + 2), pt_smem, acc2, correction2, WARPS, O_MMA, CHUNK, K_WIDTH)
    acc1 = warpgroup_mma_wait(1, deps=(acc1,))
    acc3 = _pv_chunk(kv_latent.index(first + 3), pt_smem, acc3, correction2, WARPS, O_MMA, CHUNK, K_WIDTH)
    acc2, acc3 = warpgroup_mma_wait(0, deps=(acc2, acc3))
    return acc0, acc1, acc2, acc3


@gluon.jit
def _chunks_out(acc0, acc1, acc2, acc3, WARPS: gl.constexpr, KV_FP8: gl.constexpr = True,
                PV_F16: gl.constexpr = False):
    """The four accumulators as (128 dims x heads) P.V chunks in the store layout (fp8: rows
    relabelled back to dims, the P_hi and P_lo columns summed; PV_F16: rows relabelled only)."""
    if PV_F16:
        acc0 = _rows_to_dims(acc0, WARPS)
        acc1 = _rows_to_dims(acc1, WARPS)
        acc2 = _rows_to_dims(acc2, WARPS)
        acc3 = _rows_to_dims(acc3, WARPS)
    elif KV_FP8:
        acc0 = _hi_plus_lo(_rows_to_dims(acc0, WARPS))
        acc1 = _hi_plus_lo(_rows_to_dims(acc1, WARPS))
        acc2 = _hi_plus_lo(_rows_to_dims(acc2, WARPS))
        acc3 = _hi_plus_lo(_rows_to_dims(acc3, WARPS))
    # fp8: the accumulator's own bases after the relabelling, so the compile checks that no data moves
    LAYOUT: gl.constexpr = _output_layout(WARPS, acc0.shape[1], not PV_F16)
    return (gl.convert_layout(acc0, LAYOUT, assert_trivial=KV_FP8),
            gl.convert_layout(acc1, LAYOUT, assert_trivial=KV_FP8),
            gl.convert_layout(acc2, LAYOUT, assert_trivial=KV_FP8),
            gl.convert_layout(acc3, LAYOUT, assert_trivial=KV_FP8))


@gluon.jit
def _store_chunks(out0, out1, out2, out3, dest, head_scale, LATENT: gl.constexpr, CHUNK: gl.constexpr, rows=None,
                  row_ok=None):
    """The four 128-dim chunks of _chunks_out at dest (see _store_chunk)."""
    _store_chunk(out0, dest, head_scale, LATENT, rows, row_ok)
    _store_chunk(out1, dest + CHUNK, head_scale, LATENT, rows, row_ok)
    _store_chunk(out2, dest + 2 * CHUNK, head_scale, LATENT, rows, row_ok)
    _store_chunk(out3, dest + 3 * CHUNK, head_scale, LATENT, rows, row_ok)


@gluon.jit
def _tile_block(BT_ROW, kv_begin, t, num_tiles, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr):
    """The block id of the split's tile t (0 past its last tile: nothing read)."""
    return gl.load(BT_ROW + (kv_begin + t * BLOCK_N) // PAGE_SIZE, mask=t < num_tiles, other=0)


@gluon.jit
def _paged_row(block, token, pred, num_blocks, kv_rows, PAGE_SIZE: gl.constexpr):
    """(flattened cache row of the tile at request position `token`, whether its block id is
    outside [0, num_blocks)). A bad id's tile is read at kv_rows, past the cache: TMA reads zeros
    there; the request is poisoned."""
    bad = pred & ((block < 0) | (block >= num_blocks))
    return gl.where(bad, kv_rows, block * PAGE_SIZE + token % PAGE_SIZE), bad.to(gl.int32)


@gluon.jit
def _zero_tail(kv_latent, first, keep_tokens, NUM_CHUNKS: gl.constexpr, BLOCK_N: gl.constexpr,
               CHUNK: gl.constexpr, WARPS: gl.constexpr):
    """Zero the tokens from keep_tokens on in the tile's latent boxes, the values of P.V: a page's
    tail past the request may hold anything, NaN included, and 0 x NaN is NaN (the scores are
    masked already). Runs in a split's last tile only, after its scores."""
    LAYOUT: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [WARPS, 1], [1, 0])
    keep = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LAYOUT)) < keep_tokens, 1)
    gl.thread_barrier()  # every warp's score MMA has read the boxes
    for c in gl.static_range(NUM_CHUNKS):
        box = kv_latent.index(first + c)
        values = box.load(LAYOUT)
        box.store(gl.where(keep, values, gl.zeros_like(values)))


@gluon.jit
def _serving_rows(group, num_heads, q_len, NUM_HEADS: gl.constexpr, LAYOUT: gl.constexpr):
    """The program's query rows, (query token, head) pairs group * NUM_HEADS ... in token-major
    order: (valid, query token, head) per row."""
    rows = group * NUM_HEADS + gl.arange(0, NUM_HEADS, layout=LAYOUT)
    return rows < q_len * num_heads, rows // num_heads, rows % num_heads


@gluon.jit
def _natural_lse(lse2):
    """A base-2 lse as the API returns it: natural log, +inf for a row with nothing attended (the
    portable kernel's _store_rows writes the same; its source is kept as the gfx950 sweep hashed it)."""
    return gl.where(lse2 == float("-inf"), float("inf"), lse2 * 0.6931471805599453)


@gluon.jit
def _store_split_count(SPLIT_COUNTS, request, split, group, num_splits, first_work):
    """The request's first partial slot and split count, for _mla_combine_kernel, written by its
    first split of row group 0 (every request has one, so no count is left from an earlier call)."""
    if (split == 0) & (group == 0):
        gl.store(SPLIT_COUNTS + 2 * request, first_work)
        gl.store(SPLIT_COUNTS + 2 * request + 1, num_splits)


# --- Hopper: the schedule, computed by every program from cache_seqlens ----------------------
@_constexpr_function
def _batch_layout(block, warps):
    """(block,) int32 over the 32 lanes of each warp, every warp holding all of it (the CTA tile
    is `warps` times the tensor): the schedule's sums and scan stay inside a warp, no barrier."""
    return gl.BlockedLayout([block // 32], [32], [warps], [0])


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _used_length(raw, capacity):
    """A request's length as the schedules use it: 0 where it is < 0 or > capacity (what its
    block-table row holds; such a request is poisoned, nothing read)."""
    return gl.where((raw < 0) | (raw > capacity), 0, raw)


@gluon.jit
def _batch_lengths(CACHE_SEQLENS, batch_size, capacity, BATCH_BLOCK: gl.constexpr, WARPS: gl.constexpr):
    """(index, length as read, length as used) of every request, in one warp (_batch_layout)."""
    i = gl.arange(0, BATCH_BLOCK, layout=_batch_layout(BATCH_BLOCK, WARPS))
    raw = gl.load(CACHE_SEQLENS + i, mask=i < batch_size, other=0)
    return i, raw, _used_length(raw, capacity)


@gluon.jit
def _chunk_tokens(lengths, programs, min_chunk, MAX_SPLITS: gl.constexpr, BLOCK_N: gl.constexpr):
    """The chunk schedule's chunk: about total / programs tokens, at least min_chunk and at least
    the longest request / MAX_SPLITS, in whole tiles."""
    chunk = gl.maximum(gl.maximum(gl.cdiv(gl.sum(lengths, 0), programs), gl.cdiv(gl.max(lengths, 0), MAX_SPLITS)),
                       min_chunk)
    return gl.cdiv(chunk, BLOCK_N) * BLOCK_N


@gluon.jit
def _request_tiles(length, BLOCK_N: gl.constexpr):
    """The tiles a request counts for in the span schedule: cdiv(length, BLOCK_N), at least one
    (an empty or poisoned request still writes its rows)."""
    return gl.maximum(gl.cdiv(length, BLOCK_N), 1)


@gluon.jit
def _serving_work(CACHE_SEQLENS, work, batch_size, capacity, target_splits, min_chunk, MAX_SPLITS: gl.constexpr,
                  BATCH_BLOCK: gl.constexpr, BLOCK_N: gl.constexpr, WARPS: gl.constexpr):
    """The token-balanced schedule, computed by every program from cache_seqlens (no host sync:
    a replayed graph follows new lengths). The batch's tokens are cut into chunks of whole tiles,
    about total / target_splits tokens each (at least min_chunk, and at most MAX_SPLITS chunks to
    the longest request), each request into cdiv(length, chunk) splits (at least one: an empty
    or poisoned request still writes its rows), and the splits numbered request by request: work
    item `work` is split `split` of `request`. Returns (request, split, the request's split count,
    its first work item, split begin, split end, request length, poison); request >= batch_size
    for a work item past the last. A length < 0 or > capacity (what the request's block-table row
    holds) is poisoned: NaN rows, nothing read."""
    i, raw, lengths = _batch_lengths(CACHE_SEQLENS, batch_size, capacity, BATCH_BLOCK, WARPS)
    chunk = _chunk_tokens(lengths, target_splits, min_chunk, MAX_SPLITS, BLOCK_N)
    splits = gl.where(i < batch_size, gl.maximum(gl.cdiv(lengths, chunk), 1), 0)
    ends = gl.associative_scan(splits, 0, _add)
    request = gl.sum((ends <= work).to(gl.int32), 0)  # requests whose work items all come before
    mine = i == request
    num_splits = gl.sum(gl.where(mine, splits, 0), 0)
    first_work = gl.sum(gl.where(mine, ends, 0), 0) - num_splits
    seq_len = gl.sum(gl.where(mine, lengths, 0), 0)
    poison = gl.where(gl.sum(gl.where(mine & (raw != lengths), 1, 0), 0) > 0, float("nan"), 0.0)
    split = work - first_work
    split_begin = split * chunk
    return (request, split, num_splits, first_work, split_begin, gl.minimum(split_begin + chunk, seq_len), seq_len,
            poison)


@gluon.jit
def _span_start(CACHE_SEQLENS, program, batch_size, capacity, programs, min_chunk, MAX_SPLITS: gl.constexpr,
                BATCH_BLOCK: gl.constexpr, BLOCK_N: gl.constexpr, WARPS: gl.constexpr, SEGMENT_TILES: gl.constexpr = 0):
    """The span schedule, computed by every program from cache_seqlens (no host sync: a replayed
    graph follows new lengths). The batch's tiles, request after request (each request counts
    cdiv(length, BLOCK_N) tiles, at least one: an empty or poisoned request still writes its
    rows), are cut into `used` spans of equal length, one per program: a program's time is its
    share of the batch's tokens, whatever the lengths. `used`: at most `programs`,
    each span at least min_chunk tokens' worth of tiles, and so many that no request meets more
    than MAX_SPLITS spans (its merge's widest layout). A span's part of each request it touches
    is one segment; a request's splits are the spans it meets, numbered from its first. Where a
    segment costs a kernel more than its tiles (SEGMENT_TILES: its q, epilogue and partial store in
    tiles' time), each request counts that many units before its tiles, so that a program meeting
    more requests takes fewer tiles (FlashMLA's scheduler does as much per segment).
    Returns (whether this call takes spans rather than _serving_work's chunks, the program's
    segments, its first request, that request's first unit, the batch's units, used); _span_segment
    steps from there request by request, in scalars."""
    i, _, lengths = _batch_lengths(CACHE_SEQLENS, batch_size, capacity, BATCH_BLOCK, WARPS)
    tiles = gl.where(i < batch_size, _request_tiles(lengths, BLOCK_N), 0)
    units = gl.where(i < batch_size, tiles + SEGMENT_TILES, 0)
    ends = gl.associative_scan(units, 0, _add)
    starts = ends - units
    total = gl.sum(units, 0)
    widest = gl.max(units, 0)
    used = gl.minimum(gl.minimum(programs, total // gl.maximum(min_chunk // BLOCK_N, 1)),
                      (MAX_SPLITS - 1) * total // widest)
    used = gl.maximum(used, 1)
    span_begin, span_end = _span_bounds(program, total, used)
    before = ends <= span_begin  # requests whose tiles are wholly before the span
    request = gl.sum(before.to(gl.int32), 0)
    segments = gl.maximum(gl.sum(((starts + SEGMENT_TILES < span_end) & (i < batch_size)).to(gl.int32), 0) - request,
                          0)
    tile_begin = gl.sum(gl.where(before, units, 0), 0)
    # Which schedule this call takes: each one's time in tiles of its busiest program (a split
    # request costs 3/8 of a tile per pass of its merge's split-count class, a term from when the
    # last split merged in this kernel; without it, now that _mla_combine_kernel merges, the
    # grids time the same; the spans' widest request meets at most cdiv(its tiles x used,
    # total) + 1 spans), the spans only when strictly shorter. Chunks (_serving_work) keep a
    # uniform batch's requests whole or evenly cut, spans cut across requests and merge more.
    chunk_tiles = _chunk_tokens(lengths, programs, min_chunk, MAX_SPLITS, BLOCK_N) // BLOCK_N
    chunk_splits = gl.where(i < batch_size, gl.maximum(gl.cdiv(tiles, chunk_tiles), 1), 0)
    items = gl.sum(chunk_splits, 0)
    biggest = gl.minimum(chunk_tiles, gl.max(tiles, 0)) + SEGMENT_TILES  # a chunk is one segment
    chunk_time = gl.where(items <= programs, biggest,
                          gl.cdiv(gl.sum(tiles, 0) + items * SEGMENT_TILES, programs) + biggest) * 8 \
        + 3 * _merge_passes(gl.max(chunk_splits, 0))
    span_splits = gl.minimum(((widest.to(gl.int64) * used + total - 1) // total).to(gl.int32) + 1, MAX_SPLITS)
    span_time = (gl.cdiv(total, used) + SEGMENT_TILES) * 8 + 3 * _merge_passes(span_splits)  # a cut segment's cost
    spans = span_time < chunk_time
    return spans, segments, request, tile_begin, total, used


@gluon.jit
def _merge_passes(splits):
    """The passes a merge of a request of this many splits makes in its layout's class: 0 for one
    split, else the class's split count (4, 8 or 16)."""
    return gl.where(splits <= 1, 0, gl.where(splits <= 4, 4, gl.where(splits <= 8, 8, 16)))


@gluon.jit
def _span_bounds(program, total, used):
    """The tiles of the batch's sequence in program `program`'s span: [p x total / used, (p + 1) x
    total / used)."""
    return (((program.to(gl.int64) * total) // used).to(gl.int32),
            (((program + 1).to(gl.int64) * total) // used).to(gl.int32))


@gluon.jit
def _span_segment(CACHE_SEQLENS, program, request, unit_begin, total, used, capacity, BLOCK_N: gl.constexpr,
                  SEGMENT_TILES: gl.constexpr = 0):
    """A segment of _span_start's schedule: this program's part of `request`, whose units start at
    unit_begin (its SEGMENT_TILES units, then its tiles). Returns (split, the request's split count,
    its first partial slot, split begin and end in tokens, request length, poison, the request's end
    unit). A length < 0 or > capacity (what the request's block-table row holds) is poisoned: NaN
    rows, nothing read."""
    raw = gl.load(CACHE_SEQLENS + request)
    seq_len = _used_length(raw, capacity)
    tile_begin = unit_begin + SEGMENT_TILES
    tile_end = tile_begin + _request_tiles(seq_len, BLOCK_N)
    span_begin, span_end = _span_bounds(program, total, used)
    first_span = (((tile_begin + 1).to(gl.int64) * used - 1) // total).to(gl.int32)
    last_span = ((tile_end.to(gl.int64) * used - 1) // total).to(gl.int32)
    split_begin = (gl.maximum(span_begin, tile_begin) - tile_begin) * BLOCK_N
    split_end = gl.minimum((gl.minimum(span_end, tile_end) - tile_begin) * BLOCK_N, seq_len)
    poison = gl.where(raw != seq_len, float("nan"), 0.0)
    # partial slots first_span + request ...: one run per request, after the previous request's
    # (its last span <= this one's first), below used + batch
    return (program - first_span, last_span - first_span + 1, first_span + request, split_begin, split_end, seq_len,
            poison, tile_end)


# --- Hopper: the tokens-as-M kernels ---------------------------------------------------------
@gluon.jit
def _store_split(acc0, acc1, acc2, acc3, running_max, row_sums, kv_scale, poison, out_row, PARTIAL_O, PARTIAL_LSE,
                 slot_id, WARPS: gl.constexpr, NUM_SPLITS: gl.constexpr, NUM_HEADS: gl.constexpr,
                 LATENT: gl.constexpr, CHUNK: gl.constexpr):
    """The program's result: with one split the bf16 output row; otherwise this split's float32
    partial (heads x dims, like the output) and its lse. An empty split (a row shorter than the
    split grid) has sum 0: partial 0, lse -inf (weight 0 in the merge). `poison` (0 or NaN, see
    _row_poison) is added to the output's scale and to the lse."""
    running_sum = gl.sum(row_sums, 0)
    out0, out1, out2, out3 = _chunks_out(acc0, acc1, acc2, acc3, WARPS)
    if NUM_SPLITS == 1:
        _store_chunks(out0, out1, out2, out3, out_row, kv_scale / running_sum + poison, LATENT, CHUNK)
    else:
        lse, safe_sum = _split_lse(running_max, running_sum)
        _store_chunks(out0, out1, out2, out3, PARTIAL_O + slot_id * LATENT * NUM_HEADS, 1.0 / safe_sum, LATENT,
                      CHUNK)
        gl.store(PARTIAL_LSE + slot_id * NUM_HEADS + gl.arange(0, NUM_HEADS, layout=running_max.type.layout),
                 lse + poison)


@gluon.jit
def _merge_row(PARTIAL_O, PARTIAL_LSE, SPLIT_TICKETS, out_row, batch, split, kv_scale, WARPS: gl.constexpr,
               NUM_SPLITS: gl.constexpr, COOPERATIVE_MERGE: gl.constexpr, NUM_HEADS: gl.constexpr,
               LATENT: gl.constexpr):
    """Call after this split's partial is stored: merges the row's splits into its output.
    COOPERATIVE_MERGE (only when the host checked that the whole grid is resident at once): every
    split waits for the row's last and then merges 1 / NUM_SPLITS of the dims, so the merge's reads
    spread over NUM_SPLITS SMs instead of one. The row's counter (second half of the tickets)
    is never reset: each call adds NUM_SPLITS, so this call's last ticket is the next multiple of
    NUM_SPLITS above the one drawn (a power of two: the mask and the signed difference stay right
    when the counter wraps). Otherwise the last split of the row merges it all and resets the
    row's ticket."""
    gl.thread_barrier()  # every thread's partial stores precede the ticket's release
    SLICE: gl.constexpr = LATENT // triton.next_power_of_2(NUM_SPLITS)
    if COOPERATIVE_MERGE:
        counter = SPLIT_TICKETS + gl.num_programs(0) + batch
        drawn = gl.atomic_add(counter, 1, sem="acq_rel")
        last_ticket = (drawn & (-NUM_SPLITS)) + NUM_SPLITS
        seen = drawn + 1
        while seen - last_ticket < 0:
            seen = gl.atomic_add(counter, 0, sem="acquire")
        _merge_slice(PARTIAL_O, PARTIAL_LSE, out_row, batch * NUM_SPLITS, split * SLICE, kv_scale, WARPS,
                     NUM_SPLITS, SLICE, NUM_HEADS, LATENT)
    elif gl.atomic_add(SPLIT_TICKETS + batch, 1, sem="acq_rel") == NUM_SPLITS - 1:
        for dim_begin in range(0, LATENT, SLICE):
            _merge_slice(PARTIAL_O, PARTIAL_LSE, out_row, batch * NUM_SPLITS, dim_begin, kv_scale, WARPS,
                         NUM_SPLITS, SLICE, NUM_HEADS, LATENT)
        gl.atomic_xchg(SPLIT_TICKETS + batch, 0)


@gluon.jit
def _store_serving(acc, running_max, row_sums, kv_scale, poison, outs, work, rows, slots, out_strides,
                   WARPS: gl.constexpr, NUM_HEADS: gl.constexpr, KV_FP8: gl.constexpr, PV_F16: gl.constexpr):
    """The serving API's epilogue of one split (`work`: request, split, the request's split count,
    its first partial slot). A request of one split writes its rows of out and lse; otherwise each
    split writes a float32 partial and its base-2 lse in slot group x slots + first_work + split
    (slots: partial slots per row group), which _mla_combine_kernel merges after the kernel; the
    first split writes the request's split count for it. Rows with nothing attended: out 0, lse
    +inf; `poison` (0 or NaN) reaches out and lse."""
    OUT, LSE, PARTIAL_O, PARTIAL_LSE, SPLIT_COUNTS = outs
    request, split, num_splits, first_work = work
    group, num_heads, q_len = rows
    stride_o_batch, stride_o_token, stride_o_head, stride_lse_batch, stride_lse_head, stride_lse_token = out_strides
    acc0, acc1, acc2, acc3 = acc
    running_sum = gl.sum(row_sums, 0)
    out0, out1, out2, out3 = _chunks_out(acc0, acc1, acc2, acc3, WARPS, KV_FP8, PV_F16)
    ROW_LAYOUT: gl.constexpr = running_max.type.layout
    row_ok, q_token, head = _serving_rows(group, num_heads, q_len, NUM_HEADS, ROW_LAYOUT)
    out_base = OUT + request.to(gl.int64) * stride_o_batch
    out_rows = q_token * stride_o_token + head * stride_o_head
    lse_rows = LSE + request.to(gl.int64) * stride_lse_batch + head * stride_lse_head + q_token * stride_lse_token
    lse2, safe_sum = _split_lse(running_max, running_sum)
    lse2 += poison
    if num_splits == 1:
        head_scale = gl.where(running_sum != 0, kv_scale / safe_sum, 0.0) + poison
        _store_chunks(out0, out1, out2, out3, out_base, head_scale, LATENT, CHUNK, out_rows, row_ok)
        gl.store(lse_rows, _natural_lse(lse2), mask=row_ok)
    else:
        slot_id = group * slots + first_work + split
        _store_chunks(out0, out1, out2, out3, PARTIAL_O + slot_id * (LATENT * NUM_HEADS), 1.0 / safe_sum, LATENT,
                      CHUNK)
        gl.store(PARTIAL_LSE + slot_id * NUM_HEADS + gl.arange(0, NUM_HEADS, layout=ROW_LAYOUT), lse2)
    _store_split_count(SPLIT_COUNTS, request, split, group, num_splits, first_work)


@gluon.jit
def _split_tiles(
    cache, ring, staging, q, kv_scale, sm_scale_log2, split, pages, rows, FP8_MAX: gl.constexpr,
    STAGES: gl.constexpr, WARPS: gl.constexpr, PAGE_SIZE: gl.constexpr, CAUSAL: gl.constexpr,
    NUM_HEADS: gl.constexpr, BLOCK_N: gl.constexpr, KV_FP8: gl.constexpr, LAYOUTS: gl.constexpr,
    PV_F16: gl.constexpr = False, GATHER: gl.constexpr = False,
):
    """One split's tiles: tokens [kv_begin, kv_end) of one request (custom_kernel: of one row) for
    the program's query rows, q (four 128-dim chunks and the rope part) in registers, the ring's
    tiles numbered on from `consumed` (the tiles the program's earlier splits read). Loads the
    tiles, runs the online softmax and P.V; returns (the four P.V accumulators, running max, row
    sums, whether a used block id was outside the cache). The caller writes the epilogue.
    cache: the two TMA descriptors, or (GATHER: pages shorter than a tile) the cache and its row
    stride, each tile's 64 rows gathered by cp.async a row per token (_gather_rows, _gather_tile),
    one commit group a tile, where TMA reads a tile of one page. split: (kv_begin, kv_end,
    num_tiles, consumed); pages: (the request's block-table row, kv_rows, num_blocks), on pages
    only; rows: (seq_len, group, num_heads, q_len), CAUSAL only. staging's `exchange` and `factors`
    (shared scratch, where given; P^T in 16 bits, a column a row): each tile's row max crosses the
    warps through `exchange` (_exchanged_max) and the rescale factors reach P.V's layout through
    `factors` (_through_shared), two barriers where the layouts' conversions take five."""
    kv_latent, kv_rope, loaded = ring
    q_latent, q_rope, pt_smem, exchange, factors = staging
    q0, q1, q2, q3, qr = q
    kv_begin, kv_end, num_tiles, consumed = split
    bt_row, kv_rows, num_blocks = pages
    S_MMA: gl.constexpr = LAYOUTS[0]
    O_MMA: gl.constexpr = LAYOUTS[1]
    NUM_CHUNKS: gl.constexpr = LATENT // CHUNK
    TILE_BYTES: gl.constexpr = BLOCK_N * (LATENT + ROPE) * (1 if KV_FP8 else 2)
    SERVING: gl.constexpr = PAGE_SIZE > 0
    bad_blocks = 0
    if GATHER:  # each tile's rows a step ahead of its copies, which then never wait for the block table
        KV, stride_kv_row = cache
        LAT_LAYOUT: gl.constexpr = _gather_layout(1 if KV_FP8 else 2, CHUNK, WARPS)
        ROPE_LAYOUT: gl.constexpr = _gather_layout(1 if KV_FP8 else 2, ROPE, WARPS)
        bad_rows = gl.zeros([BLOCK_N], gl.int32, layout=gl.SliceLayout(1, LAT_LAYOUT))  # a used block id bad
        lat_rows, lat_read, rope_rows, rope_read, bad_rows = _gather_next(
            bt_row, kv_begin, kv_end, 0, num_tiles, num_blocks, bad_rows, PAGE_SIZE, BLOCK_N, LAT_LAYOUT, ROPE_LAYOUT)
    else:
        lat_desc, rope_desc = cache

    # The first STAGES - 1 tile loads fly while q is quantised. An empty split (a row shorter than
    # the split grid) needs no q; the branch also keeps the quantisation after the issue, ahead of
    # which ptxas would otherwise schedule q's amax, making the issue wait for q. The empty path's
    # barrier orders the ring barriers' init before their invalidation; without it Triton puts
    # that barrier at the tile loop's exit, on every path.
    for t in gl.static_range(STAGES - 1):
        if GATHER:
            lat_rows, lat_read, rope_rows, rope_read, bad_rows = _gather_issue(
                KV, stride_kv_row, bt_row, lat_rows, lat_read, rope_rows, rope_read, bad_rows, kv_latent, kv_rope,
                t, (consumed + t) % STAGES, kv_begin, kv_end, num_tiles, num_blocks, NUM_CHUNKS, CHUNK, LATENT, ROPE,
                PAGE_SIZE, BLOCK_N, LAT_LAYOUT, ROPE_LAYOUT)
        else:
            if SERVING:
                block = _tile_block(bt_row, kv_begin, t, num_tiles, BLOCK_N, PAGE_SIZE)
                row, bad = _paged_row(block, kv_begin + t * BLOCK_N, t < num_tiles, num_blocks, kv_rows, PAGE_SIZE)
                bad_blocks |= bad
            else:
                row = kv_begin + t * BLOCK_N
            _load_tile(lat_desc, rope_desc, kv_latent, kv_rope, loaded.index((consumed + t) % STAGES),
                       (consumed + t) % STAGES, row, t < num_tiles, TILE_BYTES, NUM_CHUNKS, CHUNK, LATENT)
    if SERVING and not GATHER:
        next_block = _tile_block(bt_row, kv_begin, STAGES - 1, num_tiles, BLOCK_N, PAGE_SIZE)
    score_scale = 0.0
    if num_tiles > 0:
        if KV_FP8:
            score_scale = sm_scale_log2 * kv_scale * _quantize_q(q0, q1, q2, q3, qr, q_latent, q_rope, FP8_MAX)
        else:
            _stage_q_bf16(q0, q1, q2, q3, qr, q_latent, q_rope)
            score_scale = sm_scale_log2 * kv_scale
    else:
        gl.thread_barrier()

    # Tiles.
    running_max = gl.full([NUM_HEADS], float("-inf"), gl.float32, layout=gl.SliceLayout(0, S_MMA))
    row_sums = gl.zeros([BLOCK_N, NUM_HEADS], gl.float32, layout=S_MMA)
    P_COLS: gl.constexpr = pt_smem.shape[0]  # P^T's columns (fp8 P: P_hi and P_lo per row)
    acc0 = gl.zeros([CHUNK, P_COLS], gl.float32, layout=O_MMA)
    acc1 = gl.zeros([CHUNK, P_COLS], gl.float32, layout=O_MMA)
    acc2 = gl.zeros([CHUNK, P_COLS], gl.float32, layout=O_MMA)
    acc3 = gl.zeros([CHUNK, P_COLS], gl.float32, layout=O_MMA)
    tokens = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, S_MMA))
    no_scores = gl.zeros([BLOCK_N, NUM_HEADS], gl.float32, layout=S_MMA)
    if CAUSAL:  # query token t attends the first seq_len - q_len + t + 1 tokens
        seq_len, group, num_heads, q_len = rows
        _, row_token, _ = _serving_rows(group, num_heads, q_len, NUM_HEADS, gl.SliceLayout(0, S_MMA))
        row_limits = gl.expand_dims(gl.minimum(kv_end, seq_len - q_len + 1 + row_token), 0)
    for i in range(num_tiles):
        ahead = i + STAGES - 1
        if GATHER:
            async_copy.wait_group(STAGES - 2)  # this thread's copies of tile i have landed
            fence_async_shared()  # ... and are visible to the MMAs, which read through the async proxy
            gl.thread_barrier()  # every thread's have; every warp is done with the slot the next copies fill
            lat_rows, lat_read, rope_rows, rope_read, bad_rows = _gather_issue(
                KV, stride_kv_row, bt_row, lat_rows, lat_read, rope_rows, rope_read, bad_rows, kv_latent, kv_rope,
                ahead, (consumed + ahead) % STAGES, kv_begin, kv_end, num_tiles, num_blocks, NUM_CHUNKS, CHUNK, LATENT,
                ROPE, PAGE_SIZE, BLOCK_N, LAT_LAYOUT, ROPE_LAYOUT)
            slot = (consumed + i) % STAGES
        else:
            gl.thread_barrier()  # every warp is done with the slot the next load overwrites
            if SERVING:
                row, bad = _paged_row(next_block, kv_begin + ahead * BLOCK_N, ahead < num_tiles, num_blocks, kv_rows,
                                      PAGE_SIZE)
                bad_blocks |= bad
                next_block = _tile_block(bt_row, kv_begin, ahead + 1, num_tiles, BLOCK_N, PAGE_SIZE)
            else:
                row = kv_begin + ahead * BLOCK_N
            _load_tile(lat_desc, rope_desc, kv_latent, kv_rope, loaded.index((consumed + ahead) % STAGES),
                       (consumed + ahead) % STAGES, row, ahead < num_tiles, TILE_BYTES, NUM_CHUNKS, CHUNK, LATENT)
            slot = (consumed + i) % STAGES
            mbarrier.wait(loaded.index(slot), ((consumed + i) // STAGES) & 1)
        scores = warpgroup_mma_wait(0, deps=(_issue_scores(kv_latent, kv_rope, q_latent, q_rope, slot, no_scores,
                                                           NUM_CHUNKS),))
        positions = kv_begin + i * BLOCK_N + tokens
        if CAUSAL:
            valid = gl.expand_dims(positions, 1) < row_limits
        else:
            valid = gl.expand_dims(positions < kv_end, 1)
        if SERVING and not GATHER:  # gathered rows past the split landed as zeros
            if kv_begin + (i + 1) * BLOCK_N > kv_end:
                _zero_tail(kv_latent, slot * NUM_CHUNKS, kv_end - kv_begin - i * BLOCK_N, NUM_CHUNKS, BLOCK_N, CHUNK,
                           WARPS)
        probs, correction, running_max, row_sums = _online_softmax(scores, valid, score_scale, running_max, row_sums,
                                                                   CAUSAL, exchange)
        if factors is not None:
            correction = _through_shared(correction, factors, gl.SliceLayout(0, O_MMA))
        if PV_F16:
            _store_probs_16(probs, pt_smem)
            acc0, acc1, acc2, acc3 = _pv_tile(kv_latent, slot * NUM_CHUNKS, pt_smem, acc0, acc1, acc2, acc3,
                                              correction, WARPS, O_MMA, CHUNK, 2)
        elif KV_FP8:
            correction2 = _store_probs(probs, correction, pt_smem, BLOCK_N, NUM_HEADS)
            acc0, acc1, acc2, acc3 = _pv_tile(kv_latent, slot * NUM_CHUNKS, pt_smem, acc0, acc1, acc2, acc3,
                                              correction2, WARPS, O_MMA, CHUNK)
        else:
            _store_probs_16(probs, pt_smem)
            acc0, acc1, acc2, acc3 = _pv_tile_bf16(kv_latent, slot * NUM_CHUNKS, pt_smem, acc0, acc1, acc2, acc3,
                                                   correction)

    if GATHER:
        bad_blocks = gl.max(bad_rows, axis=0)
    return (acc0, acc1, acc2, acc3), running_max, row_sums, bad_blocks


@_constexpr_function
def _tokens_as_m_layouts(rows, warps, kv_fp8, pv_f16):
    """(S's MMA layout, P.V's MMA layout, q's register layout) of a tokens-as-M program of `rows`
    query rows and `warps` warps: S^T (tokens x rows) over warpgroups of 4 token warps (8 warps:
    the two warpgroups split the rows), P.V (dims x P^T's columns) over the warps' dims."""
    mma_k = 32 if kv_fp8 else 16  # the MMA's k per instruction: 32 bytes
    p_cols = 2 * rows if kv_fp8 and not pv_f16 else rows  # fp8 P: two fp8 terms a row
    s_mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, warps // 4],
                                      instr_shape=[16, rows // (warps // 4), mma_k])
    o_mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                      instr_shape=[16, p_cols, 16 if pv_f16 else mma_k])
    return s_mma, o_mma, gl.BlockedLayout([1, 8], [2, 16], [warps, 1], [1, 0])


@gluon.jit
def _tokens_as_m_smem(STAGES: gl.constexpr, NUM_HEADS: gl.constexpr, BLOCK_N: gl.constexpr, KV_FP8: gl.constexpr,
                      PV_F16: gl.constexpr = False):
    """The shared memory of a tokens-as-M program: the ring (STAGES slots of a tile's four latent
    boxes and its rope box, and their TMA barriers, initialised) and q in the MMA's type and P^T."""
    NUM_CHUNKS: gl.constexpr = LATENT // CHUNK
    KV_DTYPE: gl.constexpr = gl.float8e4nv if KV_FP8 else gl.bfloat16
    P_COLS: gl.constexpr = 2 * NUM_HEADS if KV_FP8 and not PV_F16 else NUM_HEADS  # fp8 P: two fp8 terms a row
    P_DTYPE: gl.constexpr = gl.float16 if PV_F16 else KV_DTYPE
    kv_latent = gl.allocate_shared_memory(KV_DTYPE, [STAGES * NUM_CHUNKS, BLOCK_N, CHUNK],
                                          gl.NVMMASharedLayout.get_default_for([BLOCK_N, CHUNK], KV_DTYPE))
    kv_rope = gl.allocate_shared_memory(KV_DTYPE, [STAGES, BLOCK_N, ROPE],  # the rope box's (hopper_boxes)
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], KV_DTYPE))
    loaded = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for ring_slot in gl.static_range(STAGES):
        mbarrier.init(loaded.index(ring_slot), count=1)
    q_latent = gl.allocate_shared_memory(KV_DTYPE, [NUM_CHUNKS, NUM_HEADS, CHUNK],
                                         gl.NVMMASharedLayout.get_default_for([NUM_HEADS, CHUNK], KV_DTYPE))
    q_rope = gl.allocate_shared_memory(KV_DTYPE, [NUM_HEADS, ROPE],
                                       gl.NVMMASharedLayout.get_default_for([NUM_HEADS, ROPE], KV_DTYPE))
    pt_smem = gl.allocate_shared_memory(P_DTYPE, [P_COLS, BLOCK_N],
                                        gl.NVMMASharedLayout.get_default_for([P_COLS, BLOCK_N], P_DTYPE))
    return (kv_latent, kv_rope, loaded), (q_latent, q_rope, pt_smem)


@gluon.jit
def _release_ring(ring, STAGES: gl.constexpr):
    """The ring's barriers invalidated, at the program's end."""
    loaded = ring[2]
    for ring_slot in gl.static_range(STAGES):
        mbarrier.invalidate(loaded.index(ring_slot))


@gluon.jit
def _mla_decode_fp8_hopper_kernel(
    Q, lat_desc, rope_desc, KV_SCALE, QO_INDPTR, KV_INDPTR, OUT, PARTIAL_O, PARTIAL_LSE, SPLIT_TICKETS,
    sm_scale_log2, kv_rows, stride_q_token, stride_o_token,
    FP8_MAX: gl.constexpr, NUM_SPLITS: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr,
    COOPERATIVE_MERGE: gl.constexpr = False, NUM_HEADS: gl.constexpr = 16, BLOCK_N: gl.constexpr = 64,
):
    """custom_kernel's fp8 rows (contiguous, from kv_indptr) on Hopper. Grid (batch, NUM_SPLITS):
    the 16 heads of row `batch`'s one query token x one equal split of its KV rows, the split merge
    fused as in _mla_decode_kernel (same partials, lse and tickets; same results within rounding).
    Decode has one query row per batch row: q is read at row `batch`, and a qo_indptr that says
    otherwise poisons the row (_row_poison, used only in the epilogue), as does a KV range outside
    the cache. TMA reads zeros outside the cache; the range is also cut to the cache's rows, so a
    row far outside it loops over no tiles. Every global read the prologue needs is issued before
    any of them is used: the scale, q and the indptrs; the first TMA issue waits for the indptrs
    only (one memory latency)."""
    LAYOUTS: gl.constexpr = _tokens_as_m_layouts(NUM_HEADS, WARPS, kv_fp8=True, pv_f16=False)
    ROWS: gl.constexpr = LAYOUTS[2]
    batch = gl.program_id(0)
    split = gl.program_id(1)
    kv_scale = gl.load(KV_SCALE)
    q = _load_q(Q, batch, stride_q_token, ROWS, NUM_HEADS, CHUNK, LATENT, ROPE)
    row_begin = gl.load(KV_INDPTR + batch)
    row_end = gl.load(KV_INDPTR + batch + 1)
    poison = _row_poison(QO_INDPTR, batch, row_begin, row_end, kv_rows)
    kv_begin, kv_end = _split_bounds(row_begin, row_end, split, NUM_SPLITS, BLOCK_N)
    kv_begin = gl.maximum(kv_begin, 0)
    kv_end = gl.minimum(kv_end, kv_rows)
    num_tiles = gl.cdiv(gl.maximum(kv_end - kv_begin, 0), BLOCK_N)

    ring, q_and_p = _tokens_as_m_smem(STAGES, NUM_HEADS, BLOCK_N, True)
    q_latent, q_rope, pt_smem = q_and_p
    acc, running_max, row_sums, _ = _split_tiles(
        (lat_desc, rope_desc), ring, (q_latent, q_rope, pt_smem, None, None), q, kv_scale, sm_scale_log2,
        split=(kv_begin, kv_end, num_tiles, 0), pages=(0, kv_rows, 0), rows=None, FP8_MAX=FP8_MAX, STAGES=STAGES,
        WARPS=WARPS, PAGE_SIZE=0, CAUSAL=False, NUM_HEADS=NUM_HEADS, BLOCK_N=BLOCK_N, KV_FP8=True, LAYOUTS=LAYOUTS)
    _release_ring(ring, STAGES)

    # Epilogue: the output row, or this split's partial and then the row's merge.
    acc0, acc1, acc2, acc3 = acc
    out_row = OUT + batch * stride_o_token
    slot_id = batch * NUM_SPLITS + split
    _store_split(acc0, acc1, acc2, acc3, running_max, row_sums, kv_scale, poison, out_row, PARTIAL_O,
                 PARTIAL_LSE, slot_id, WARPS, NUM_SPLITS, NUM_HEADS, LATENT, CHUNK)
    if NUM_SPLITS > 1:
        _merge_row(PARTIAL_O, PARTIAL_LSE, SPLIT_TICKETS, out_row, batch, split, kv_scale, WARPS, NUM_SPLITS,
                   COOPERATIVE_MERGE, NUM_HEADS, LATENT)


@gluon.jit
def _serve_segment(cache, ring, staging, io, work, rows, sizes, strides, kv_scale, sm_scale_log2,
                   FP8_MAX: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr, PAGE_SIZE: gl.constexpr,
                   CAUSAL: gl.constexpr, NUM_HEADS: gl.constexpr, BLOCK_N: gl.constexpr, KV_FP8: gl.constexpr,
                   LAYOUTS: gl.constexpr, PV_F16: gl.constexpr, GATHER: gl.constexpr):
    """One split of a request on the serving API's pages (`work`: the request, whether it is one
    (a work item past the last request reads and writes nothing), split `split` of num_splits,
    tokens [kv_begin, kv_end), partial slots from first_work, the request's length and poison, and
    `consumed`, the ring's tiles the program read before): q's rows, the tiles (_split_tiles), then
    the request's rows or this split's partial (_store_serving). Returns consumed plus the tiles
    read."""
    Q, BLOCK_TABLE, OUT, LSE, PARTIAL_O, PARTIAL_LSE, SPLIT_COUNTS = io
    request, live, split, num_splits, first_work, kv_begin, kv_end, seq_len, poison, consumed = work
    group, num_heads, q_len = rows
    kv_rows, num_blocks, slots = sizes
    q_strides, stride_bt, out_strides = strides
    stride_q_batch, stride_q_token, stride_q_head = q_strides
    ROWS: gl.constexpr = LAYOUTS[2]
    row_ok, q_token, head = _serving_rows(group, num_heads, q_len, NUM_HEADS, gl.SliceLayout(1, ROWS))
    q_request = Q + request.to(gl.int64) * stride_q_batch
    q_rows = q_token * stride_q_token + head * stride_q_head
    q_ok = row_ok & live
    q = _load_q(q_request, row=0, stride_q_token=0, ROWS=ROWS, NUM_HEADS=NUM_HEADS, CHUNK=CHUNK, LATENT=LATENT,
                ROPE=ROPE, rows=q_rows, row_ok=q_ok)
    num_tiles = gl.where(live, gl.cdiv(gl.maximum(kv_end - kv_begin, 0), BLOCK_N), 0)
    acc, running_max, row_sums, bad_blocks = _split_tiles(
        cache, ring, staging, q, kv_scale, sm_scale_log2, (kv_begin, kv_end, num_tiles, consumed),
        (BLOCK_TABLE + request.to(gl.int64) * stride_bt, kv_rows, num_blocks), (seq_len, group, num_heads, q_len),
        FP8_MAX, STAGES, WARPS, PAGE_SIZE, CAUSAL, NUM_HEADS, BLOCK_N, KV_FP8, LAYOUTS, PV_F16, GATHER)
    if live:
        _store_serving(acc, running_max, row_sums, kv_scale, poison + gl.where(bad_blocks != 0, float("nan"), 0.0),
                       (OUT, LSE, PARTIAL_O, PARTIAL_LSE, SPLIT_COUNTS), (request, split, num_splits, first_work),
                       rows, slots, out_strides, WARPS, NUM_HEADS, KV_FP8, PV_F16)
    return consumed + num_tiles


@gluon.jit
def _serve_pages(
    cache, KV_SCALE, io, schedule, sizes, strides, sm_scale_log2, kv_scale_value,
    FP8_MAX: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr, PAGE_SIZE: gl.constexpr,
    CAUSAL: gl.constexpr, KV_SCALE_IN_TENSOR: gl.constexpr, BATCH_BLOCK: gl.constexpr, MAX_SPLITS: gl.constexpr,
    NUM_HEADS: gl.constexpr, BLOCK_N: gl.constexpr, KV_FP8: gl.constexpr, SPANS: gl.constexpr,
    PV_F16: gl.constexpr, SHARED_MAX: gl.constexpr, GATHER: gl.constexpr,
):
    """The serving API's pages, tokens as M: grid (row groups, work items); program (group, item)
    takes the query rows (query token, head) group x NUM_HEADS ... of the requests its work item
    names. The work items come from a schedule every program computes from cache_seqlens (no host
    sync: a replayed graph follows new lengths): a chunk of one request each (_serving_work), or,
    with SPANS and where _span_start's cost model takes them, one span of the batch's tiles each,
    the program looping over the requests it meets (_span_segment; the ring's barriers count on
    across them). Each segment's schedule comes first (it names the request), then q and the first
    tiles' block ids. io: (Q, BLOCK_TABLE, OUT, LSE, PARTIAL_O, PARTIAL_LSE, SPLIT_COUNTS);
    schedule: (CACHE_SEQLENS, batch size, block-table capacity in tokens, target splits, shortest
    chunk); sizes: (kv_rows, num_blocks, num_heads, q_len); strides: (q's, the block table's, out's
    and lse's)."""
    gl.static_assert(KV_FP8 or not PV_F16, "PV_F16 is P.V over an fp8 cache")
    gl.static_assert(BLOCK_N == 64, "the V operand layout and P.V token order assume 64-token tiles")
    gl.static_assert(PAGE_SIZE % BLOCK_N == 0 or GATHER, "TMA reads a tile from one page")
    CACHE_SEQLENS, batch_size, capacity, target_splits, min_chunk = schedule
    kv_rows, num_blocks, num_heads, q_len = sizes
    LAYOUTS: gl.constexpr = _tokens_as_m_layouts(NUM_HEADS, WARPS, KV_FP8, PV_F16)
    group = gl.program_id(0)
    item = gl.program_id(1)
    if KV_SCALE_IN_TENSOR:
        kv_scale = gl.load(KV_SCALE)
    else:
        kv_scale = kv_scale_value
    if SPANS:
        spans, segments, request, tile_begin, total, used = _span_start(
            CACHE_SEQLENS, item, batch_size, capacity, target_splits, min_chunk, MAX_SPLITS, BATCH_BLOCK, BLOCK_N,
            WARPS)
    ring, q_and_p = _tokens_as_m_smem(STAGES, NUM_HEADS, BLOCK_N, KV_FP8, PV_F16)
    q_latent, q_rope, pt_smem = q_and_p
    if SHARED_MAX:  # a tile's partial row maxima (rows x 4 token warps) and its rescale factors (_split_tiles);
        # one buffer each: the factors' barrier orders a tile's reads of `exchange` before the next tile's writes
        gl.static_assert(PV_F16 or not KV_FP8, "P^T in 16 bits: one column a row")
        exchange = gl.allocate_shared_memory(gl.float32, [NUM_HEADS, 4], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        factors = gl.allocate_shared_memory(gl.float32, [NUM_HEADS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        staging = (q_latent, q_rope, pt_smem, exchange, factors)
    else:
        staging = (q_latent, q_rope, pt_smem, None, None)
    rows = (group, num_heads, q_len)
    # Spans: one segment per request the program's span of the batch's tiles meets, the ring's
    # barriers counting on across them (`consumed`: the tiles the earlier ones waited for).
    # Chunks: one split of one request, in code of its own, so that nothing is held over a loop.
    if SPANS and spans:
        consumed = 0
        for segment in range(segments):
            split, num_splits, first_work, kv_begin, kv_end, seq_len, poison, tile_end = _span_segment(
                CACHE_SEQLENS, item, request, tile_begin, total, used, capacity, BLOCK_N)
            if segment > 0:
                gl.thread_barrier()  # every warp is done with the ring and q of the segment before
            consumed = _serve_segment(
                cache, ring, staging, io,
                (request, True, split, num_splits, first_work, kv_begin, kv_end, seq_len, poison, consumed), rows,
                (kv_rows, num_blocks, target_splits + batch_size), strides, kv_scale, sm_scale_log2, FP8_MAX, STAGES,
                WARPS, PAGE_SIZE, CAUSAL, NUM_HEADS, BLOCK_N, KV_FP8, LAYOUTS, PV_F16, GATHER)
            request += 1
            tile_begin = tile_end
    else:
        request, split, num_splits, first_work, kv_begin, kv_end, seq_len, poison = _serving_work(
            CACHE_SEQLENS, item, batch_size, capacity, target_splits, min_chunk, MAX_SPLITS, BATCH_BLOCK, BLOCK_N,
            WARPS)
        _serve_segment(
            cache, ring, staging, io,
            (request, request < batch_size, split, num_splits, first_work, kv_begin, kv_end, seq_len, poison, 0),
            rows, (kv_rows, num_blocks, target_splits + batch_size), strides, kv_scale, sm_scale_log2, FP8_MAX,
            STAGES, WARPS, PAGE_SIZE, CAUSAL, NUM_HEADS, BLOCK_N, KV_FP8, LAYOUTS, PV_F16, GATHER)
    _release_ring(ring, STAGES)


@gluon.jit
def _mla_decode_paged_hopper_kernel(
    Q, lat_desc, rope_desc, KV_SCALE, CACHE_SEQLENS, BLOCK_TABLE, OUT, LSE, PARTIAL_O, PARTIAL_LSE, SPLIT_COUNTS,
    sm_scale_log2, kv_scale_value, kv_rows, num_blocks, capacity, batch_size, target_splits, min_chunk, num_heads,
    q_len, q_strides, stride_bt, out_strides,
    FP8_MAX: gl.constexpr, PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr,
    CAUSAL: gl.constexpr = False, KV_SCALE_IN_TENSOR: gl.constexpr = True, BATCH_BLOCK: gl.constexpr = 32,
    MAX_SPLITS: gl.constexpr = 16, KV_FP8: gl.constexpr = True, NUM_HEADS: gl.constexpr = 16,
    BLOCK_N: gl.constexpr = 64, SPANS: gl.constexpr = False, PV_F16: gl.constexpr = False,
    SHARED_MAX: gl.constexpr = False,
):
    """The serving API's pages of whole tiles (PAGE_SIZE 64 or 128), read by TMA (_serve_pages):
    grid (row groups, chunks plus one per request); with SPANS, where a call takes spans, the first
    `used` programs of each group take a span each and the rest exit."""
    _serve_pages((lat_desc, rope_desc), KV_SCALE,
                 (Q, BLOCK_TABLE, OUT, LSE, PARTIAL_O, PARTIAL_LSE, SPLIT_COUNTS),
                 (CACHE_SEQLENS, batch_size, capacity, target_splits, min_chunk),
                 (kv_rows, num_blocks, num_heads, q_len), (q_strides, stride_bt, out_strides), sm_scale_log2,
                 kv_scale_value, FP8_MAX, STAGES, WARPS, PAGE_SIZE, CAUSAL, KV_SCALE_IN_TENSOR, BATCH_BLOCK,
                 MAX_SPLITS, NUM_HEADS, BLOCK_N, KV_FP8, SPANS, PV_F16, SHARED_MAX, False)


@gluon.jit
def _mla_decode_gathered_hopper_kernel(
    Q, KV, KV_SCALE, CACHE_SEQLENS, BLOCK_TABLE, OUT, LSE, PARTIAL_O, PARTIAL_LSE, SPLIT_COUNTS,
    sm_scale_log2, kv_scale_value, kv_rows, num_blocks, capacity, batch_size, target_splits, min_chunk, num_heads,
    q_len, q_strides, stride_bt, out_strides, stride_kv_row,
    FP8_MAX: gl.constexpr, PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr,
    CAUSAL: gl.constexpr = False, KV_SCALE_IN_TENSOR: gl.constexpr = True, BATCH_BLOCK: gl.constexpr = 32,
    MAX_SPLITS: gl.constexpr = 16, KV_FP8: gl.constexpr = True, NUM_HEADS: gl.constexpr = 16,
    BLOCK_N: gl.constexpr = 64, SPANS: gl.constexpr = False, PV_F16: gl.constexpr = False,
    SHARED_MAX: gl.constexpr = False,
):
    """_mla_decode_paged_hopper_kernel for pages shorter than a tile (PAGE_SIZE 1 ... 32): the cache
    KV (blocks, PAGE_SIZE, 1, 576) read a row per token by cp.async, as blocks x PAGE_SIZE rows
    stride_kv_row apart (a 16-byte multiple; blocks back to back: tma_can_read)."""
    gl.static_assert(PAGE_SIZE < BLOCK_N, "pages of whole tiles take the TMA kernel")
    _serve_pages((KV, stride_kv_row), KV_SCALE,
                 (Q, BLOCK_TABLE, OUT, LSE, PARTIAL_O, PARTIAL_LSE, SPLIT_COUNTS),
                 (CACHE_SEQLENS, batch_size, capacity, target_splits, min_chunk),
                 (kv_rows, num_blocks, num_heads, q_len), (q_strides, stride_bt, out_strides), sm_scale_log2,
                 kv_scale_value, FP8_MAX, STAGES, WARPS, PAGE_SIZE, CAUSAL, KV_SCALE_IN_TENSOR, BATCH_BLOCK,
                 MAX_SPLITS, NUM_HEADS, BLOCK_N, KV_FP8, SPANS, PV_F16, SHARED_MAX, True)


# --- Hopper: the seesaw kernel (query rows as M) ---------------------------------------------
# After FlashMLA's "seesaw" schedule (its deep-dive document describes it; none of its code is used)
# in Gluon over the fp8 cache, with P.V in fp8, and over the bf16 cache on
# 32-token tiles: 64 query rows a program, two compute warpgroups, a tile each of every pair
# of tiles (in step: the pair's running max from both tiles' maxima), and a one-warp TMA
# loader; the schedule, pages and partials of the tokens-as-M serving kernels.


# A row's running max moves only where a tile passes it by more than this (log2 units): P <= 2^0.8,
# stored as 256 P <= 446 within e4m3's 448
SW_TAU = gl.constexpr(0.8)


@gluon.jit
def _sw_work(CACHE_SEQLENS, program, spans, request, tile_begin, total, used, capacity, batch_size, chunk,
             BLOCK_N: gl.constexpr, SEGMENT_TILES: gl.constexpr):
    """A segment of the seesaw kernel's work: with spans, the program's part of `request` (whose
    tiles start at tile_begin; _span_segment), else its chunk (_serving_work's values after the
    request, in `chunk`). Returns (split, the request's split count, its first partial slot,
    split begin and end, request length, poison, the request's end tile, live, tiles)."""
    if spans:
        split, num_splits, first_work, kv_begin, kv_end, seq_len, poison, tile_end = _span_segment(
            CACHE_SEQLENS, program, request, tile_begin, total, used, capacity, BLOCK_N, SEGMENT_TILES)
    else:
        split, num_splits, first_work, kv_begin, kv_end, seq_len, poison = chunk
        tile_end = tile_begin
    live = request < batch_size
    num_tiles = gl.where(live, gl.cdiv(gl.maximum(kv_end - kv_begin, 0), BLOCK_N), 0)
    return split, num_splits, first_work, kv_begin, kv_end, seq_len, poison, tile_end, live, num_tiles


@gluon.jit
def _sw_loader(cache, ring, tables, sched, sizes, stride_bt, STAGES: gl.constexpr, PAGE_SIZE: gl.constexpr,
               BLOCK_N: gl.constexpr, SEGMENT_TILES: gl.constexpr):
    """The loader warp: every tile of the program's segments, in order, into ring slot g % STAGES
    (g: the tile's number across segments) once both compute warpgroups released tile g - STAGES.
    A block id outside the cache is read at kv_rows (TMA reads zeros there); the compute
    warpgroups poison its request (_sw_compute)."""
    lat_desc, rope_desc = cache
    kv_latent, kv_rope, loaded, free = ring
    CACHE_SEQLENS, BLOCK_TABLE = tables
    program, spans, segments, request, tile_begin, total, used, chunk = sched
    capacity, batch_size, kv_rows, num_blocks = sizes
    TILE_BYTES: gl.constexpr = BLOCK_N * (LATENT + kv_rope.shape[2]) * (kv_latent.dtype.primitive_bitwidth // 8)
    consumed = 0
    for _segment in range(segments):
        work = _sw_work(CACHE_SEQLENS, program, spans, request, tile_begin, total, used, capacity, batch_size, chunk,
                        BLOCK_N, SEGMENT_TILES)
        kv_begin, tile_end, num_tiles = work[3], work[7], work[9]
        bt_row = BLOCK_TABLE + request.to(gl.int64) * stride_bt
        for t in range(num_tiles):
            g = consumed + t
            slot = g % STAGES
            block = _tile_block(bt_row, kv_begin, t, num_tiles, BLOCK_N, PAGE_SIZE)
            row, _ = _paged_row(block, kv_begin + t * BLOCK_N, True, num_blocks, kv_rows, PAGE_SIZE)
            mbarrier.wait(free.index(slot), ((g // STAGES) - 1) & 1, pred=g >= STAGES)
            _load_tile(lat_desc, rope_desc, kv_latent, kv_rope, loaded.index(slot), slot, row, True, TILE_BYTES,
                       LATENT // CHUNK, CHUNK, LATENT)
        consumed += num_tiles
        request += 1
        tile_begin = tile_end


@gluon.jit
def _sw_stage_q(Q, q_latent, q_rope, q_scale, kv_scale, request, group, live, num_heads, q_len, stride_q_batch,
                stride_q_token, stride_q_head, WG: gl.constexpr, FP8_MAX: gl.constexpr):
    """Warpgroup WG's 32 of the program's 64 query rows into shared memory in fp8, each row scaled
    by its own amax (one pass for the amax, one to store: the second reads hit the cache), and the
    rows' scales (amax / FP8_MAX) into q_scale; for a bf16 cache (a bf16 q_latent) in bf16 as they
    are, no scales. q takes kv_scale's sign, so that S's scale per row (_sw_compute's) is positive. Rows
    past s_q x h_q, or of a work item past the batch, are zeros."""
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    KV_FP8: gl.constexpr = q_latent.dtype == gl.float8e4nv
    row_ok, q_token, head = _serving_rows(2 * group + WG, num_heads, q_len, 32, gl.SliceLayout(1, QL))
    ok = gl.expand_dims(row_ok & live, 1)
    base = Q + request.to(gl.int64) * stride_q_batch + gl.expand_dims(q_token * stride_q_token
                                                                      + head * stride_q_head, 1)
    d128 = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, QL)), 0)
    d64 = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, QL)), 0)
    if KV_FP8:
        amax = gl.max(gl.abs(gl.load(base + 512 + d64, mask=ok, other=0.0).to(gl.float32)), 1)
        for c in gl.static_range(4):
            chunk = gl.load(base + c * 128 + d128, mask=ok, other=0.0).to(gl.float32)
            amax = gl.maximum(amax, gl.max(gl.abs(chunk), 1))
        amax = gl.maximum(amax, 1e-12)
        inverse = gl.expand_dims(gl.where(kv_scale < 0, -FP8_MAX, FP8_MAX) / amax, 1)
    else:
        inverse = gl.where(kv_scale < 0, -1.0, 1.0)
    for c in gl.static_range(4):
        q = gl.load(base + c * 128 + d128, mask=ok, other=0.0).to(gl.float32)
        q_latent.index(c).slice(32 * WG, 32).store((q * inverse).to(q_latent.dtype))
    q = gl.load(base + 512 + d64, mask=ok, other=0.0).to(gl.float32)
    q_rope.slice(32 * WG, 32).store((q * inverse).to(q_rope.dtype))
    if KV_FP8:
        q_scale.slice(32 * WG, 32).store(amax / FP8_MAX)
    fence_async_shared()


@gluon.jit
def _sw_issue_scores(kv_latent, kv_rope, q_latent, q_rope, slot, S_L: gl.constexpr):
    """S = Q K^T (64 rows x the slot's tokens) of ring slot `slot`: 4 latent boxes + rope, wgmma in
    the cache's type, issued (the caller waits)."""
    BLOCK_N: gl.constexpr = kv_latent.shape[1]
    first = slot * 4
    s = warpgroup_mma(q_latent.index(0), kv_latent.index(first).permute((1, 0)),
                      gl.zeros([64, BLOCK_N], gl.float32, layout=S_L), use_acc=False, is_async=True)
    for c in gl.static_range(1, 4):
        s = warpgroup_mma(q_latent.index(c), kv_latent.index(first + c).permute((1, 0)), s, is_async=True)
    return warpgroup_mma(q_rope, kv_rope.index(slot).permute((1, 0)), s, is_async=True)


@gluon.jit
def _sw_scores(kv_latent, kv_rope, q_latent, q_rope, slot, S_L: gl.constexpr):
    """_sw_issue_scores, waited for."""
    return warpgroup_mma_wait(0, deps=(_sw_issue_scores(kv_latent, kv_rope, q_latent, q_rope, slot, S_L),))


@gluon.jit
def _sw_store_p(p, p_buf):
    """P (64 rows x 64 tokens) into p_buf in fp8 (the callers' P is 256 P, <= 256 x 2^SW_TAU: 256 keeps
    small probabilities normal), its tokens in the order _pv_chunk's fp8 fragment of V^T gives them (_store_probs');
    a bf16 p_buf (a bf16 cache: V^T read by the MMA from the ring slot) takes P in its own token order."""
    if p_buf.dtype == gl.bfloat16:
        p_buf.store(p.to(gl.bfloat16))
    else:
        p_t = gl.reshape(gl.permute(gl.reshape(gl.permute(p, (1, 0)), [2] * 6 + [64]), _pv_token_order().value),
                         [64, 64])
        p_buf.store(gl.permute(p_t, (1, 0)).to(gl.float8e4nv))


@gluon.jit
def _sw_arrive(bar):
    """`bar` arrives once every thread of the warpgroup has stored what it guards, visible to the
    async proxy too (the other warpgroup's MMAs read P)."""
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _sw_pv(kv_latent, slot, tile, kv_begin, kv_end, real, p_buf, acc0, acc1, WG: gl.constexpr,
           O_MMA: gl.constexpr):
    """acc_c += V_c^T P^T for warpgroup WG's two 128-dim chunks of ring slot `slot` (tile `tile` of
    the segment) with p_buf's P, fp8 wgmma with V^T's fragment by ldmatrix (_v_ldsm), waited for
    (one tile's fragments in registers at a time); a bf16 cache's V^T is the slot's box read
    transposed by the MMA (_pv_tile_bf16's). A real tile that is the segment's last first has this
    warpgroup's chunks zeroed past kv_end (_zero_tail: a page's tail may hold NaN, and 0 x NaN is
    NaN)."""
    BLOCK_N: gl.constexpr = kv_latent.shape[1]
    if real & (kv_begin + (tile + 1) * BLOCK_N > kv_end):
        _zero_tail(kv_latent, slot * 4 + 2 * WG, kv_end - kv_begin - tile * BLOCK_N, NUM_CHUNKS=2, BLOCK_N=BLOCK_N,
                   CHUNK=128, WARPS=4)
        fence_async_shared()
        gl.thread_barrier()
    first = slot * 4 + 2 * WG
    if kv_latent.dtype == gl.bfloat16:
        p_t = p_buf.permute((1, 0))
        acc0 = warpgroup_mma(kv_latent.index(first).permute((1, 0)), p_t, acc0, is_async=True)
        acc1 = warpgroup_mma(kv_latent.index(first + 1).permute((1, 0)), p_t, acc1, is_async=True)
    else:
        acc0 = _pv_chunk(kv_latent.index(first), p_buf, acc0, correction2=None, WARPS=4, O_MMA=O_MMA, CHUNK=128,
                         K_WIDTH=4, V_LDSM=True)
        acc1 = _pv_chunk(kv_latent.index(first + 1), p_buf, acc1, correction2=None, WARPS=4, O_MMA=O_MMA, CHUNK=128,
                         K_WIDTH=4, V_LDSM=True)
    return warpgroup_mma_wait(0, deps=(acc0, acc1))


@gluon.jit
def _sw_store(acc, m_run, l_s, l_o, kv_scale, poison, outs, work, rows, slots, out_strides, WG: gl.constexpr,
              KV_FP8: gl.constexpr = True):
    """_store_serving for warpgroup WG's 256 latent dims of the 64 rows: out and lse for a request
    of one split; otherwise its half of the split's float32 partial, and warpgroup 0 the split's lse
    (both warpgroups hold the same) and the request's split count, for _mla_combine_kernel. A bf16
    cache's accumulators (dims in order: V^T from shared memory) are stored from the MMA's
    layout."""
    acc0, acc1 = acc
    OUT, LSE, PARTIAL_O, PARTIAL_LSE, SPLIT_COUNTS = outs
    request, split, num_splits, first_work = work
    group, num_heads, q_len = rows
    stride_o_batch, stride_o_token, stride_o_head, stride_lse_batch, stride_lse_head, stride_lse_token = out_strides
    if KV_FP8:
        OUT_L: gl.constexpr = _output_layout(4, rows=64, pairs=False)
        o0 = gl.convert_layout(_rows_to_dims(acc0, WARPS=4, V_LDSM=True), OUT_L)
        o1 = gl.convert_layout(_rows_to_dims(acc1, WARPS=4, V_LDSM=True), OUT_L)
    else:
        o0 = acc0
        o1 = acc1
    ROW_LAYOUT: gl.constexpr = m_run.type.layout
    row_ok, q_token, head = _serving_rows(group, num_heads, q_len, 64, ROW_LAYOUT)
    out_base = OUT + request.to(gl.int64) * stride_o_batch
    out_rows = q_token * stride_o_token + head * stride_o_head
    lse_rows = LSE + request.to(gl.int64) * stride_lse_batch + head * stride_lse_head + q_token * stride_lse_token
    lse2, _ = _split_lse(m_run - 8.0, l_s)  # the row sums are of 256 P
    lse2 += poison
    safe_o = gl.where(l_o != 0, l_o, 1.0)
    if num_splits == 1:
        head_scale = gl.where(l_o != 0, kv_scale / safe_o, 0.0) + poison
        _store_chunk(o0, out_base + 256 * WG, head_scale, 512, out_rows, row_ok)
        _store_chunk(o1, out_base + 256 * WG + 128, head_scale, 512, out_rows, row_ok)
        if WG == 0:
            gl.store(lse_rows, _natural_lse(lse2), mask=row_ok)
    else:
        slot_id = group * slots + first_work + split
        dest = PARTIAL_O + slot_id * (512 * 64) + 256 * WG
        _store_chunk(o0, dest, 1.0 / safe_o, 512)
        _store_chunk(o1, dest + 128, 1.0 / safe_o, 512)
        if WG == 0:
            gl.store(PARTIAL_LSE + slot_id * 64 + gl.arange(0, 64, layout=ROW_LAYOUT), lse2)
    if WG == 0:
        _store_split_count(SPLIT_COUNTS, request, split, group, num_splits, first_work)


@gluon.jit
def _sw_running_max(m_smem, m_run):
    """The running max after a pair of tiles whose maxima are in m_smem's halves: it moves only
    where the pair passes it by more than SW_TAU. Returns (the new max, the shift P's exponent
    takes: the max, or 0 for a row with nothing attended yet, the rescale factor)."""
    LAYOUT: gl.constexpr = m_run.type.layout
    m_pair = gl.maximum(m_smem.slice(0, 64).load(LAYOUT), m_smem.slice(64, 64).load(LAYOUT))
    m_new = gl.where(m_pair > m_run + SW_TAU, m_pair, m_run)
    shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, shift, gl.exp2(m_run - shift)


@gluon.jit
def _sw_compute(smem, bars, io, sched, scales, sizes, strides, FP8_MAX: gl.constexpr, STAGES: gl.constexpr,
                PAGE_SIZE: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, KV_FP8: gl.constexpr,
                WG: gl.constexpr, SEGMENT_TILES: gl.constexpr):
    """Compute warpgroup WG (4 warps) over the program's segments. Per segment: its 32 rows of q
    (_sw_stage_q; both warpgroups' on `staged`), then per pair of tiles (2j, 2j + 1), both
    warpgroups in step: S of tile 2j + WG, its row maxima exchanged through m_smem
    on tile_max (both take the pair's running max, SW_TAU's lazy one, and its one rescale factor),
    P (in the cache's type) published on pub[WG] into p_smem[WG] (released on done[WG] by the other
    warpgroup), then P.V of both tiles for latent dims [256 WG, 256 WG + 256); ring slots are released on free
    (both warpgroups arrive). An odd tile count ends on a phantom tile 2j + 1: its S (of slot 2j,
    masked) gives P = 0 and its P.V reads slot 2j again, after 2j's, so no barrier is skipped and
    nothing reads an unloaded slot. Row sums are kept per warpgroup and added through l_smem on
    `fin`, with a bad block id's NaN (each warpgroup checks its own tiles' ids). Barrier phases
    count pairs and segments across the program. A bf16 cache: tiles of BLOCK_N (32) tokens, q and P
    in bf16, bf16 wgmma."""
    MMA_K: gl.constexpr = 32 if KV_FP8 else 16  # the MMA's k per instruction: 32 bytes
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, MMA_K])
    O_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, MMA_K])
    S_ROW: gl.constexpr = gl.SliceLayout(1, S_L)
    O_COL: gl.constexpr = gl.SliceLayout(0, O_MMA)
    kv_latent, kv_rope, q_latent, q_rope, q_scale, p_smem, c_smem, m_smem, l_smem = smem
    loaded, free, tile_max, pub, done, fin, staged = bars
    Q, OUT, LSE, PARTIAL_O, PARTIAL_LSE, SPLIT_COUNTS, CACHE_SEQLENS, BLOCK_TABLE = io
    group, program, spans, segments, request, tile_begin, total, used, chunk = sched
    kv_scale, sm_scale_log2 = scales
    capacity, batch_size, num_blocks, num_heads, q_len, slots = sizes
    q_strides, stride_bt, out_strides = strides
    stride_q_batch, stride_q_token, stride_q_head = q_strides
    tokens = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
    consumed = 0
    pairs = 0
    for segment in range(segments):
        split, num_splits, first_work, kv_begin, kv_end, seq_len, poison, tile_end, live, num_tiles = _sw_work(
            CACHE_SEQLENS, program, spans, request, tile_begin, total, used, capacity, batch_size, chunk, BLOCK_N,
            SEGMENT_TILES)
        # q: the epilogue's `fin` of the segment before ordered both warpgroups' last S before this
        _sw_stage_q(Q, q_latent, q_rope, q_scale, kv_scale, request, group, live, num_heads, q_len, stride_q_batch,
                    stride_q_token, stride_q_head, WG, FP8_MAX)
        gl.thread_barrier()
        mbarrier.arrive(staged, count=1)
        mbarrier.wait(staged, segment & 1)
        # S's scale per row, positive (q took kv_scale's sign; a NaN stays): max commutes with it
        kv_abs = gl.abs(kv_scale)
        s_scale = sm_scale_log2 * gl.where(kv_abs < 1e-30, 1e-30, kv_abs)
        if KV_FP8:
            row_scale = q_scale.load(S_ROW) * s_scale
        else:  # bf16 q as it is: no scale per row
            row_scale = gl.full([64], s_scale, gl.float32, layout=S_ROW)
        tokens_end = kv_end  # every token before it is attended by every row
        if CAUSAL:  # query token t attends the first seq_len - q_len + t + 1 tokens
            _, row_token, _ = _serving_rows(group, num_heads, q_len, 64, S_ROW)
            row_limits = gl.expand_dims(gl.minimum(kv_end, seq_len - q_len + 1 + row_token), 1)
            tokens_end = gl.minimum(kv_end, seq_len - q_len + 1)
        bt_row = BLOCK_TABLE + request.to(gl.int64) * stride_bt
        acc0 = gl.zeros([128, 64], gl.float32, layout=O_MMA)
        acc1 = gl.zeros([128, 64], gl.float32, layout=O_MMA)
        m_run = gl.full([64], float("-inf"), gl.float32, layout=S_ROW)
        l_run = gl.zeros([64], gl.float32, layout=S_ROW)
        bad = 0
        num_pairs = gl.cdiv(num_tiles, 2)
        for j in range(num_pairs):
            phase = (pairs + j) & 1
            second = 2 * j + 1 < num_tiles  # tile 2j + 1 is real
            g_first = consumed + 2 * j
            slot_first = g_first % STAGES
            phase_first = (g_first // STAGES) & 1
            slot_second = gl.where(second, (g_first + 1) % STAGES, slot_first)
            phase_second = gl.where(second, ((g_first + 1) // STAGES) & 1, phase_first)
            t_own = 2 * j + WG
            own_real = t_own < num_tiles
            block = gl.load(bt_row + (kv_begin + t_own * BLOCK_N) // PAGE_SIZE, mask=own_real, other=0)
            slot_own = slot_first if WG == 0 else slot_second
            mbarrier.wait(loaded.index(slot_own), phase_first if WG == 0 else phase_second)
            s = _sw_scores(kv_latent, kv_rope, q_latent, q_rope, slot_own, S_L)
            bad |= (own_real & ((block < 0) | (block >= num_blocks))).to(gl.int32)
            if kv_begin + (t_own + 1) * BLOCK_N > tokens_end:  # a tile some row attends only in part
                positions = gl.expand_dims(kv_begin + t_own * BLOCK_N + tokens, 0)
                if CAUSAL:
                    s = gl.where(positions < row_limits, s, float("-inf"))
                else:
                    s = gl.where(positions < kv_end, s, float("-inf"))
            # the pair's max: each warpgroup's tile max to m_smem, both read both (the same values in
            # the same order: both keep the same running max)
            m_smem.slice(WG * 64, 64).store(gl.max(s, 1) * row_scale)
            gl.thread_barrier()
            mbarrier.arrive(tile_max.index(WG), count=1)
            mbarrier.wait(tile_max.index(1 - WG), phase)
            # a row's max moves only where the pair passes it by more than SW_TAU (so P <= 2^SW_TAU):
            # most pairs leave every row's factor 1 and skip the rescale (FlashAttention 4's)
            m_run, shift, c = _sw_running_max(m_smem, m_run)
            p = gl.exp2(s * gl.expand_dims(row_scale, 1) + gl.expand_dims(8.0 - shift, 1))  # 256 P
            # publish P (the buffer is free once the other warpgroup's P.V of the pair before read it)
            mbarrier.wait(done.index(WG), phase ^ 1, pred=pairs + j > 0)
            _sw_store_p(p, p_smem.index(WG))
            c_smem.slice(WG * 64, 64).store(c)  # read back below in the accumulator's columns
            _sw_arrive(pub.index(WG))
            l_run = l_run * c + gl.sum(p, 1)
            c_o = c_smem.slice(WG * 64, 64).load(O_COL)
            if gl.min(c_o, 0) < 1.0:  # some row's max moved: rescale
                c_b = gl.expand_dims(c_o, 0)
                acc0 = acc0 * c_b
                acc1 = acc1 * c_b
            # P.V of tile 2j, then of tile 2j + 1 (a phantom's P is 0, its slot 2j's: released once)
            mbarrier.wait(pub.index(0), phase)
            mbarrier.wait(loaded.index(slot_first), phase_first)  # this warpgroup sees the copy land
            acc0, acc1 = _sw_pv(kv_latent, slot_first, 2 * j, kv_begin, kv_end, True, p_smem.index(0), acc0, acc1,
                                WG, O_MMA)
            mbarrier.wait(pub.index(1), phase)
            mbarrier.wait(loaded.index(slot_second), phase_second)
            acc0, acc1 = _sw_pv(kv_latent, slot_second, 2 * j + 1, kv_begin, kv_end, second, p_smem.index(1), acc0,
                                acc1, WG, O_MMA)
            gl.thread_barrier()  # every warp's MMAs have read the slots and the other warpgroup's P
            mbarrier.arrive(free.index(slot_first), count=1)
            mbarrier.arrive(free.index(slot_second), count=1, pred=second)
            mbarrier.arrive(done.index(1 - WG), count=1)
        pairs += num_pairs
        consumed += num_tiles

        # Epilogue: the warpgroups' row sums added (with a bad block id's NaN), then each its 256 dims.
        l_smem.slice(WG * 64, 64).store(l_run + gl.where(bad != 0, float("nan"), 0.0))
        gl.thread_barrier()
        mbarrier.arrive(fin, count=1)
        mbarrier.wait(fin, segment & 1)
        l_s = l_smem.slice(0, 64).load(S_ROW) + l_smem.slice(64, 64).load(S_ROW)
        l_o = l_smem.slice(0, 64).load(O_COL) + l_smem.slice(64, 64).load(O_COL)
        if live:
            _sw_store((acc0, acc1), m_run, l_s, l_o, kv_scale, poison, (OUT, LSE, PARTIAL_O, PARTIAL_LSE, SPLIT_COUNTS),
                      (request, split, num_splits, first_work), (group, num_heads, q_len), slots, out_strides, WG,
                      KV_FP8)
        request += 1
        tile_begin = tile_end


@gluon.jit
def _sw_barriers(STAGES: gl.constexpr):
    """The seesaw's mbarriers, initialised: per ring slot `loaded` (the TMA copy) and `free` (both
    compute warpgroups released it), per compute warpgroup `tile_max` (its tile's maxima stored), per
    P buffer `pub` (published) and `done` (the other warpgroup read it), and `fin` (both warpgroups'
    row sums written)."""
    BAR: gl.constexpr = mbarrier.MBarrierLayout()
    loaded = gl.allocate_shared_memory(gl.int64, [STAGES, 1], BAR)
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], BAR)
    tile_max = gl.allocate_shared_memory(gl.int64, [2, 1], BAR)
    pub = gl.allocate_shared_memory(gl.int64, [2, 1], BAR)
    done = gl.allocate_shared_memory(gl.int64, [2, 1], BAR)
    fin = gl.allocate_shared_memory(gl.int64, [1], BAR)
    for i in gl.static_range(STAGES):
        mbarrier.init(loaded.index(i), count=1)
        mbarrier.init(free.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(tile_max.index(i), count=1)
        mbarrier.init(pub.index(i), count=1)
        mbarrier.init(done.index(i), count=1)
    mbarrier.init(fin, count=2)
    return loaded, free, tile_max, pub, done, fin


@gluon.jit
def _mla_decode_seesaw_kernel(
    Q, lat_desc, rope_desc, KV_SCALE, CACHE_SEQLENS, BLOCK_TABLE, OUT, LSE, PARTIAL_O, PARTIAL_LSE, SPLIT_COUNTS,
    sm_scale_log2, kv_scale_value, kv_rows, num_blocks, capacity, batch_size, target_splits, min_chunk, num_heads,
    q_len, q_strides, stride_bt, out_strides,
    FP8_MAX: gl.constexpr, PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr,
    CAUSAL: gl.constexpr = False, KV_SCALE_IN_TENSOR: gl.constexpr = True, BATCH_BLOCK: gl.constexpr = 32,
    MAX_SPLITS: gl.constexpr = 16, KV_FP8: gl.constexpr = True, NUM_HEADS: gl.constexpr = 64,
    BLOCK_N: gl.constexpr = 64, SPANS: gl.constexpr = False, PV_F16: gl.constexpr = False,
    SHARED_MAX: gl.constexpr = False, SEGMENT_TILES: gl.constexpr = 0,
):
    """The serving API's caches on pages of whole tiles with query rows as the MMA's M: grid and
    schedule as _mla_decode_paged_hopper_kernel's (row groups of 64 query rows x chunks, or spans),
    the same partials and split counts for _mla_combine_kernel (each warpgroup stores its half of
    the dims). The parent region computes the schedule and forks: compute warpgroups 0 and 1
    (_sw_compute: a tile each of every pair, in step; for an fp8 cache S and P.V in fp8 wgmma, P as
    256 P in fp8) and a loader warp (_sw_loader). Shared memory: STAGES x 36 KiB of ring, 36 KiB of
    q, 8 KiB of P. A bf16 cache (KV_FP8 off): 32-token tiles, so that STAGES (4) slots of 36 KiB fit
    beside 72 KiB of bf16 q and 8 KiB of bf16 P; S and P.V in bf16 wgmma, V^T read from the slot by
    the MMA."""
    gl.static_assert(not PV_F16 and NUM_HEADS == 64 and WARPS == 4, "64 rows, 4 warps")
    gl.static_assert(BLOCK_N == (64 if KV_FP8 else 32) and PAGE_SIZE % BLOCK_N == 0,
                     "tiles of 64 (fp8) or 32 (bf16) tokens of one page")
    group = gl.program_id(0)
    program = gl.program_id(1)
    if KV_SCALE_IN_TENSOR:
        kv_scale = gl.load(KV_SCALE)
    else:
        kv_scale = kv_scale_value
    request, split, num_splits, first_work, kv_begin, kv_end, seq_len, poison = _serving_work(
        CACHE_SEQLENS, program, batch_size, capacity, target_splits, min_chunk, MAX_SPLITS, BATCH_BLOCK, BLOCK_N, 4)
    chunk = (split, num_splits, first_work, kv_begin, kv_end, seq_len, poison)
    zero = program * 0  # the span state's values where the kernel takes chunks only
    spans = zero != 0
    segments = zero + 1
    tile_begin = zero
    total = zero + 1
    used = zero + 1
    if SPANS:
        spans, span_segments, span_request, tile_begin, total, used = _span_start(
            CACHE_SEQLENS, program, batch_size, capacity, target_splits, min_chunk, MAX_SPLITS, BATCH_BLOCK, BLOCK_N, 4,
            SEGMENT_TILES)
        segments = gl.where(spans, span_segments, 1)
        request = gl.where(spans, span_request, request)
    KV_DTYPE: gl.constexpr = gl.float8e4nv if KV_FP8 else gl.bfloat16
    KV_L: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 128], KV_DTYPE)
    ROPE_L: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], KV_DTYPE)
    Q_L: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], KV_DTYPE)
    Q_ROPE_L: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], KV_DTYPE)
    P_L: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BLOCK_N], KV_DTYPE)
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    BAR: gl.constexpr = mbarrier.MBarrierLayout()
    kv_latent = gl.allocate_shared_memory(KV_DTYPE, [STAGES * 4, BLOCK_N, 128], KV_L)
    kv_rope = gl.allocate_shared_memory(KV_DTYPE, [STAGES, BLOCK_N, 64], ROPE_L)
    q_latent = gl.allocate_shared_memory(KV_DTYPE, [4, 64, 128], Q_L)
    q_rope = gl.allocate_shared_memory(KV_DTYPE, [64, 64], Q_ROPE_L)
    q_scale = gl.allocate_shared_memory(gl.float32, [64 if KV_FP8 else 1], FLAT)  # bf16 q has no scales
    p_smem = gl.allocate_shared_memory(KV_DTYPE, [2, 64, BLOCK_N], P_L)
    c_smem = gl.allocate_shared_memory(gl.float32, [128], FLAT)
    m_smem = gl.allocate_shared_memory(gl.float32, [128], FLAT)
    l_smem = gl.allocate_shared_memory(gl.float32, [128], FLAT)
    loaded, free, tile_max, pub, done, fin = _sw_barriers(STAGES)
    staged = gl.allocate_shared_memory(gl.int64, [1], BAR)
    mbarrier.init(staged, count=2)
    # Triton 3.6 reads the descriptors' metadata from the parent region and crashes where they
    # have no use there: one copy that never runs
    _load_tile(lat_desc, rope_desc, kv_latent, kv_rope, loaded.index(0), slot=0, token=0, pred=False,
               TILE_BYTES=BLOCK_N * 576 * (KV_DTYPE.primitive_bitwidth // 8), NUM_CHUNKS=4, CHUNK=128, LATENT=512)
    gl.thread_barrier()
    smem = (kv_latent, kv_rope, q_latent, q_rope, q_scale, p_smem, c_smem, m_smem, l_smem)
    bars = (loaded, free, tile_max, pub, done, fin, staged)
    io = (Q, OUT, LSE, PARTIAL_O, PARTIAL_LSE, SPLIT_COUNTS, CACHE_SEQLENS, BLOCK_TABLE)
    sched = (group, program, spans, segments, request, tile_begin, total, used, chunk)
    sizes = (capacity, batch_size, num_blocks, num_heads, q_len, target_splits + batch_size)
    strides = (q_strides, stride_bt, out_strides)
    gl.warp_specialize([
        (_sw_compute, (smem, bars, io, sched, (kv_scale, sm_scale_log2), sizes, strides, FP8_MAX, STAGES, PAGE_SIZE,
                       CAUSAL, BLOCK_N, KV_FP8, 0, SEGMENT_TILES)),
        (_sw_compute, (smem, bars, io, sched, (kv_scale, sm_scale_log2), sizes, strides, FP8_MAX, STAGES, PAGE_SIZE,
                       CAUSAL, BLOCK_N, KV_FP8, 1, SEGMENT_TILES)),
        (_sw_loader, ((lat_desc, rope_desc), (kv_latent, kv_rope, loaded, free), (CACHE_SEQLENS, BLOCK_TABLE),
                      (program, spans, segments, request, tile_begin, total, used, chunk),
                      (capacity, batch_size, kv_rows, num_blocks), stride_bt, STAGES, PAGE_SIZE, BLOCK_N,
                      SEGMENT_TILES))],
        [4, 1], [240, 32])


# --- Hopper: the sparse form, warp-specialised -----------------------------------------------
# The work is units: a query token's 64 heads (a head group) over its entries, cdiv(topk, BLOCK_N)
# tiles. A program takes a run of the units' tiles laid end to end: one whole unit each where the
# batch fills the GPU's waves well, else an even cut over one program per SM, whose cut units are
# written as partials and merged by _mla_sparse_combine_kernel. A program works in three warpgroups
# (the division of FlashMLA's sparse decode; none of its code is used):
# - the producer reads a tile's rows (fp8 latent values, float32 scales, bf16 rope values) 32 at a
#   time straight into registers, then dequantises them into one of STAGES bf16 tiles (fp8 x a power
#   of two: exact) once both compute warpgroups have released it;
# - warpgroup 0 stages each unit's q, then per tile S = Q.K^T over 576 dims (bf16 wgmma), the online
#   softmax, O += P.V for latent dims 0-255 from P in registers, and P published in shared memory;
# - warpgroup 1 O += P.V for dims 256-511 with warpgroup 0's P and rescale factors.
# So the gathers' latency, the dequantisation and the products of neighbouring tiles overlap.
@_constexpr_function
def _sparse_ws_layouts(block_n):
    """(S's MMA layout, P.V's, the rope's (entries x 64), the scales' (entries x 4), a latent
    chunk's (entries x 128), q's (heads x 128)) for a warpgroup, 16 bytes a thread. The producer's
    loads and its dequantisation hold an entry's row in the same threads (lanes 8 r .. 8 r + 7 of a
    warp hold row r's bytes, 2 rows a thread), so that one set of row offsets serves them all with
    no layout conversion."""
    return (gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_n, 16]),
            gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16]),
            gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]),
            gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0]),
            gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0]),
            gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))


@gluon.jit
def _sparse_ws_entries(IDX_ROW, t, split_begin, split_end, capacity, stride_kv_block, LAYOUT: gl.constexpr,
                       BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr):
    """Tile t's entries in LAYOUT: (each valid entry's byte offset in the cache, valid, bad), as
    _sparse_entries: -1 and positions past the split are not valid; below -1 or past the cache bad.
    The page size is a constant: a block id and an offset without a division."""
    positions = split_begin + t * BLOCK_N + gl.arange(0, BLOCK_N, layout=LAYOUT)
    in_split = positions < split_end
    entry = gl.load(IDX_ROW + positions, mask=in_split, other=-1)
    valid = in_split & (entry >= 0) & (entry < capacity)
    bad = in_split & ((entry < -1) | (entry >= capacity))
    safe = gl.where(valid, entry, 0)
    rows = (safe // PAGE_SIZE).to(gl.int64) * stride_kv_block + (safe % PAGE_SIZE).to(gl.int64) * 656
    return rows, valid, bad


@gluon.jit
def _sparse_ws_load(KV8, KV16, KV32, rows, valid, BLOCK_N: gl.constexpr):
    """A tile's rows (byte offsets `rows`, in the latent chunks' row layout) read into registers:
    the 4 latent chunks of 128 fp8 values, the 64 rope values and the 4 scales of each valid row
    (zeros for the others, which read nothing)."""
    LAYOUTS: gl.constexpr = _sparse_ws_layouts(BLOCK_N)
    ROPE_L: gl.constexpr = LAYOUTS[2]
    SCALE_L: gl.constexpr = LAYOUTS[3]
    CHUNK_L: gl.constexpr = LAYOUTS[4]
    cols = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, CHUNK_L)), 0)
    lat = gl.expand_dims(rows, 1) + cols
    keep = gl.expand_dims(valid, 1)
    k0 = gl.load(KV8 + lat, mask=keep, other=0.0)
    k1 = gl.load(KV8 + lat + 128, mask=keep, other=0.0)
    k2 = gl.load(KV8 + lat + 256, mask=keep, other=0.0)
    k3 = gl.load(KV8 + lat + 384, mask=keep, other=0.0)
    rope_rows = gl.convert_layout(rows // 2, gl.SliceLayout(1, ROPE_L))
    rope_keep = gl.expand_dims(gl.convert_layout(valid, gl.SliceLayout(1, ROPE_L)), 1)
    rope_cols = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, ROPE_L)), 0)
    rope = gl.load(KV16 + gl.expand_dims(rope_rows, 1) + 264 + rope_cols, mask=rope_keep, other=0.0)
    scale_rows = gl.convert_layout(rows // 4, gl.SliceLayout(1, SCALE_L))
    scale_keep = gl.expand_dims(gl.convert_layout(valid, gl.SliceLayout(1, SCALE_L)), 1)
    scale_cols = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, SCALE_L)), 0)
    scales = gl.load(KV32 + gl.expand_dims(scale_rows, 1) + 128 + scale_cols, mask=scale_keep, other=0.0)
    return k0, k1, k2, k3, rope, scales


@gluon.jit
def _sparse_ws_chunk(k, scales, c: gl.constexpr, dest, CHUNK_L: gl.constexpr):
    """Latent chunk c of a tile times its rows' scale c (exact: an fp8 value times a power of two)
    into dest as bf16."""
    SCALES_L: gl.constexpr = scales.type.layout
    tiles = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, SCALES_L)), 0)
    scale = gl.convert_layout(gl.sum(gl.where(tiles == c, scales, 0.0), 1), gl.SliceLayout(1, CHUNK_L))
    dest.store((k.to(gl.float32) * gl.expand_dims(scale, 1)).to(gl.bfloat16))


@gluon.jit
def _sparse_ws_dequantise(raw, kbuf, krope, buf, half: gl.constexpr, BLOCK_N: gl.constexpr):
    """32 rows read by _sparse_ws_load into rows 32 half .. 32 half + 31 of bf16 tile `buf`."""
    k0, k1, k2, k3, rope, scales = raw
    CHUNK_L: gl.constexpr = _sparse_ws_layouts(BLOCK_N)[4]
    _sparse_ws_chunk(k0, scales, 0, kbuf.index(4 * buf).slice(32 * half, 32), CHUNK_L)
    _sparse_ws_chunk(k1, scales, 1, kbuf.index(4 * buf + 1).slice(32 * half, 32), CHUNK_L)
    _sparse_ws_chunk(k2, scales, 2, kbuf.index(4 * buf + 2).slice(32 * half, 32), CHUNK_L)
    _sparse_ws_chunk(k3, scales, 3, kbuf.index(4 * buf + 3).slice(32 * half, 32), CHUNK_L)
    krope.index(buf).slice(32 * half, 32).store(rope)


@gluon.jit
def _sparse_ws_run(units, BLOCK_N: gl.constexpr):
    """This program's run of the schedule: the units (num_units, groups, topk) laid end to end,
    cdiv(topk, BLOCK_N) tiles each, cut into one run a program, the first total % programs runs a
    tile longer (as sparse_pieces counts): ((first tile, end tile, tiles a unit, groups, program),
    the first unit it meets, the unit after its last). Each partition computes it from the
    program's id."""
    num_units, groups, topk = units
    program = gl.program_id(0)
    tiles_per_unit = gl.cdiv(topk, BLOCK_N)
    total = num_units * tiles_per_unit
    base = total // gl.num_programs(0)
    longer = total % gl.num_programs(0)
    begin = program * base + gl.minimum(program, longer)
    end = begin + base + (program < longer).to(gl.int32)
    return (begin, end, tiles_per_unit, groups, program), begin // tiles_per_unit, gl.cdiv(end, tiles_per_unit)


@gluon.jit
def _sparse_ws_piece(u, schedule, query_ins, TOPK_LENGTH, HAS_TOPK_LENGTH: gl.constexpr, BLOCK_N: gl.constexpr):
    """Unit u's piece of this program: (whole, its partial slot, the entries: (index row, first and
    end position, tiles, capacity, cache block stride), the query's pointers and head group). A unit
    is one query token's head group; its tiles are cut at the program's ends of the schedule.
    whole: the program takes every tile of the unit, so it writes out and lse itself."""
    begin, end, tiles_per_unit, groups, program = schedule
    INDICES, Q, OUT, LSE, capacity, q_len, topk, stride_kv_block, strides = query_ins
    stride_q_batch, stride_q_token, stride_idx_batch, stride_idx_token, stride_o_batch, stride_o_token, \
        stride_lse_batch, stride_lse_token = strides
    unit_begin = u * tiles_per_unit
    lo = gl.maximum(begin, unit_begin) - unit_begin
    hi = gl.minimum(end, unit_begin + tiles_per_unit) - unit_begin
    whole = (lo == 0) & (hi == tiles_per_unit)
    query = u // groups
    group = u % groups
    batch = query // q_len
    q_token = query % q_len
    # the query's entries: the first topk_length[batch] of its row (a bad length poisons them all)
    length = topk
    if HAS_TOPK_LENGTH:
        length = gl.load(TOPK_LENGTH + batch)
    poison = gl.where((length < 0) | (length > topk), float("nan"), 0.0)
    length = gl.where(poison != poison, 0, length)
    split_begin = gl.minimum(lo * BLOCK_N, length)
    split_end = gl.minimum(hi * BLOCK_N, length)
    num_tiles = gl.cdiv(split_end - split_begin, BLOCK_N)
    idx_row = INDICES + batch.to(gl.int64) * stride_idx_batch + q_token * stride_idx_token
    entries = (idx_row, split_begin, split_end, num_tiles, capacity, stride_kv_block)
    rows = (Q + batch.to(gl.int64) * stride_q_batch + q_token * stride_q_token,
            OUT + batch.to(gl.int64) * stride_o_batch + q_token * stride_o_token,
            LSE + batch.to(gl.int64) * stride_lse_batch + q_token * stride_lse_token)
    return whole, program + u, entries, rows, group, poison


@gluon.jit
def _sparse_ws_producer(cache, tiles, bars, schedule, query_ins, TOPK_LENGTH, HAS_TOPK_LENGTH: gl.constexpr,
                        STAGES: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr):
    """The producer warpgroup: per tile t of each piece, its rows' loads issued (their entries read
    a tile earlier), then, once both compute warpgroups released bf16 tile g % STAGES (g counts the
    program's tiles), the rows dequantised into it and its `ready` arrived on: the loads' latency
    overlaps the wait."""
    KV8, KV16, KV32 = cache
    kbuf, krope = tiles
    ready, free = bars
    ROWS: gl.constexpr = gl.SliceLayout(1, _sparse_ws_layouts(BLOCK_N)[4])
    HALVES: gl.constexpr = BLOCK_N // 32
    schedule, first_unit, end_unit = _sparse_ws_run(schedule, BLOCK_N)
    g = 0
    for u in range(first_unit, end_unit):
        _, _, entries, _, _, _ = _sparse_ws_piece(u, schedule, query_ins, TOPK_LENGTH, HAS_TOPK_LENGTH, BLOCK_N)
        idx_row, split_begin, split_end, num_tiles, capacity, stride_kv_block = entries
        rows, valid, _ = _sparse_ws_entries(idx_row, 0, split_begin, split_end, capacity, stride_kv_block, ROWS,
                                            32, PAGE_SIZE)
        for t in range(num_tiles):
            buf = g % STAGES
            for h in gl.static_range(HALVES):
                raw = _sparse_ws_load(KV8, KV16, KV32, rows, valid, BLOCK_N)
                rows, valid, _ = _sparse_ws_entries(idx_row, t * HALVES + h + 1, split_begin, split_end, capacity,
                                                    stride_kv_block, ROWS, 32, PAGE_SIZE)
                if h == 0:
                    mbarrier.wait(free.index(buf), ((g // STAGES) & 1) ^ 1, pred=g >= STAGES)
                _sparse_ws_dequantise(raw, kbuf, krope, buf, h, BLOCK_N)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(ready.index(buf), count=1)
            g += 1


@gluon.jit
def _sparse_ws_store(values, base, heads, row_ok, c: gl.constexpr, LAYOUT: gl.constexpr):
    """base[heads[h] + c * 128 + d] = values[h, d] for the rows in row_ok (values in LAYOUT)."""
    dims = gl.arange(0, 128, layout=gl.SliceLayout(0, LAYOUT))
    gl.store(base + gl.expand_dims(heads, 1) + c * 128 + gl.expand_dims(dims, 0), values.to(base.dtype.element_ty),
             mask=gl.expand_dims(row_ok, 1))


@gluon.jit
def _sparse_ws_out(acc_a, acc_b, scale, first: gl.constexpr, whole, out_row, slot, group, num_heads,
                   stride_o_head, PARTIAL_O, O_MMA: gl.constexpr):
    """A warpgroup's two 128-dim chunks (first, first + 1) times its rows' scale: to out where the
    program took the whole unit, else to the unit's partial in `slot`."""
    factor = gl.expand_dims(scale, 1)
    local = gl.arange(0, 64, layout=gl.SliceLayout(1, O_MMA))
    if whole:
        heads = group * 64 + local
        _sparse_ws_store(acc_a * factor, out_row, heads * stride_o_head, heads < num_heads, first, O_MMA)
        _sparse_ws_store(acc_b * factor, out_row, heads * stride_o_head, heads < num_heads, first + 1, O_MMA)
    else:
        dest = PARTIAL_O + slot.to(gl.int64) * (512 * 64)
        _sparse_ws_store(acc_a * factor, dest, local * 512, local >= 0, first, O_MMA)
        _sparse_ws_store(acc_b * factor, dest, local * 512, local >= 0, first + 1, O_MMA)


@gluon.jit
def _sparse_ws_stage_q(q_lat, q_rope, q_row, group, num_heads, stride_q_head, BLOCK_N: gl.constexpr):
    """The program's 64 heads of q (bf16, as they are) into shared memory; heads past num_heads 0."""
    LAYOUTS: gl.constexpr = _sparse_ws_layouts(BLOCK_N)
    ROPE_L: gl.constexpr = LAYOUTS[2]
    Q_L: gl.constexpr = LAYOUTS[5]
    heads = group * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, Q_L))
    rows = gl.expand_dims(q_row + heads * stride_q_head, 1)
    dims = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, Q_L)), 0)
    for c in gl.static_range(4):
        q_lat.index(c).store(gl.load(rows + c * 128 + dims, mask=gl.expand_dims(heads < num_heads, 1), other=0.0))
    heads_r = group * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, ROPE_L))
    rope_dims = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, ROPE_L)), 0)
    q_rope.store(gl.load(gl.expand_dims(q_row + heads_r * stride_q_head, 1) + 512 + rope_dims,
                         mask=gl.expand_dims(heads_r < num_heads, 1), other=0.0))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _sparse_ws_scores(q_lat, q_rope, kbuf, krope, buf, S_MMA: gl.constexpr):
    """S = Q.K^T of bf16 tile `buf` (64 heads x the tile's entries): rope and 4 latent chunks, issued."""
    BLOCK_N: gl.constexpr = krope.shape[1]
    s = warpgroup_mma(q_rope, krope.index(buf).permute((1, 0)), gl.zeros([64, BLOCK_N], gl.float32, S_MMA),
                      is_async=True)
    for c in gl.static_range(4):
        s = warpgroup_mma(q_lat.index(c), kbuf.index(4 * buf + c).permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _sparse_ws_pv(p_buf, kbuf, buf, first: gl.constexpr, acc_a, acc_b, factor):
    """acc_a, acc_b (latent chunks first, first + 1) rescaled by `factor`, plus P.V of bf16 tile
    `buf`, waited for."""
    acc_a = acc_a * factor
    acc_b = acc_b * factor  # both before the MMAs: registers an MMA in flight writes are not touched
    acc_a = warpgroup_mma(p_buf, kbuf.index(4 * buf + first), acc_a, is_async=True)
    acc_b = warpgroup_mma(p_buf, kbuf.index(4 * buf + first + 1), acc_b, is_async=True)
    return warpgroup_mma_wait(0, deps=(acc_a, acc_b))


@gluon.jit
def _sparse_ws_main(smem, bars, io, schedule, query_ins, sm_scale_log2, num_heads, stride_q_head, stride_o_head,
                    stride_lse_head, HAS_TOPK_LENGTH: gl.constexpr, BLOCK_N: gl.constexpr,
                    PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr):
    """Warpgroup 0, per piece: q staged, then per tile S, the online softmax (base 2; skipped,
    out-of-piece and bad entries -inf), O += P.V for dims 0-255 from P in registers, issued before P
    and its rescale factors are published (p_ready) in the buffer warpgroup 1 released P_BUFS tiles
    before (p_free), the bf16 tile released (free). Then the rows' output scale published on `fin`
    (once warpgroup 1 has read the last piece's: fin_free), and out and lse, or the piece's partial
    and lse (merged by _mla_sparse_combine_kernel)."""
    LAYOUTS: gl.constexpr = _sparse_ws_layouts(BLOCK_N)
    S_MMA: gl.constexpr = LAYOUTS[0]
    O_MMA: gl.constexpr = LAYOUTS[1]
    S_ROW: gl.constexpr = gl.SliceLayout(1, S_MMA)
    O_ROW: gl.constexpr = gl.SliceLayout(1, O_MMA)
    P_BUFS: gl.constexpr = 64 // BLOCK_N
    q_lat, q_rope, kbuf, krope, p_smem, c_smem, o_scale = smem
    ready, free, p_ready, p_free, fin, fin_free = bars
    TOPK_LENGTH, PARTIAL_O, PARTIAL_LSE = io
    schedule, first_unit, end_unit = _sparse_ws_run(schedule, BLOCK_N)
    g = 0
    k = 0
    for u in range(first_unit, end_unit):
        whole, slot, entries, rows, group, poison = _sparse_ws_piece(u, schedule, query_ins, TOPK_LENGTH,
                                                                     HAS_TOPK_LENGTH, BLOCK_N)
        idx_row, split_begin, split_end, num_tiles, capacity, stride_kv_block = entries
        q_row, out_row, lse_row = rows
        _sparse_ws_stage_q(q_lat, q_rope, q_row, group, num_heads, stride_q_head, BLOCK_N)
        running_max = gl.full([64], float("-inf"), gl.float32, layout=S_ROW)
        running_sum = gl.zeros([64], gl.float32, layout=S_ROW)
        bad_any = gl.zeros([BLOCK_N], gl.int32, layout=gl.SliceLayout(0, S_MMA))
        acc0 = gl.zeros([64, 128], gl.float32, O_MMA)
        acc1 = gl.zeros([64, 128], gl.float32, O_MMA)
        _, valid, bad = _sparse_ws_entries(idx_row, 0, split_begin, split_end, capacity, stride_kv_block,
                                           gl.SliceLayout(0, S_MMA), BLOCK_N, PAGE_SIZE)
        for t in range(num_tiles):
            buf = g % STAGES
            mbarrier.wait(ready.index(buf), (g // STAGES) & 1)
            scores = _sparse_ws_scores(q_lat, q_rope, kbuf, krope, buf, S_MMA)
            # the next tile's entries while the MMAs run
            _, next_valid, next_bad = _sparse_ws_entries(idx_row, t + 1, split_begin, split_end, capacity,
                                                         stride_kv_block, gl.SliceLayout(0, S_MMA), BLOCK_N,
                                                         PAGE_SIZE)
            scores = warpgroup_mma_wait(0, deps=(scores,))
            bad_any = bad_any | bad.to(gl.int32)
            # online softmax in base 2; a tile of skipped entries leaves a row at -inf: shift it by 0
            scores = gl.where(gl.expand_dims(valid, 0), scores * sm_scale_log2, float("-inf"))
            valid = next_valid
            bad = next_bad
            new_max = gl.maximum(running_max, gl.max(scores, 1))
            shift = gl.where(new_max == float("-inf"), 0.0, new_max)
            correction = gl.exp2(running_max - shift)
            probs = gl.exp2(scores - gl.expand_dims(shift, 1))
            running_sum = running_sum * correction + gl.sum(probs, 1)
            running_max = new_max
            # O += P.V for dims 0-255 from P in registers, issued before P is published
            p16 = probs.to(gl.bfloat16)
            p_op = gl.convert_layout(p16, gl.DotOperandLayout(0, O_MMA, 2))
            factor = gl.expand_dims(gl.convert_layout(correction, O_ROW), 1)
            acc0 = acc0 * factor
            acc1 = acc1 * factor
            acc0 = warpgroup_mma(p_op, kbuf.index(4 * buf), acc0, is_async=True)
            acc1 = warpgroup_mma(p_op, kbuf.index(4 * buf + 1), acc1, is_async=True)
            # publish P and the factors in the buffer warpgroup 1 released (tile g - P_BUFS's)
            pb = g % P_BUFS
            mbarrier.wait(p_free.index(pb), ((g // P_BUFS) & 1) ^ 1, pred=g >= P_BUFS)
            p_smem.index(pb).store(p16)
            c_smem.index(pb).store(correction)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(p_ready.index(pb), count=1)
            acc0, acc1, p_op = warpgroup_mma_wait(0, deps=(acc0, acc1, p_op))
            gl.thread_barrier()  # every warp's MMAs have read the tile
            mbarrier.arrive(free.index(buf), count=1)
            g += 1

        # The piece's epilogue: out and lse where it is the whole unit, else its partial and lse.
        poison = poison + gl.where(gl.max(bad_any, 0) > 0, float("nan"), 0.0)
        has_tokens = running_sum != 0
        safe_sum = gl.where(has_tokens, running_sum, 1.0)
        lse2 = gl.where(has_tokens, running_max + gl.log2(safe_sum), float("-inf")) + poison
        scale = gl.where(whole, gl.where(has_tokens, 1.0 / safe_sum, 0.0) + poison, 1.0 / safe_sum)
        mbarrier.wait(fin_free, (k & 1) ^ 1, pred=k >= 1)  # warpgroup 1 has read the last piece's scale
        o_scale.store(scale)
        gl.thread_barrier()
        mbarrier.arrive(fin, count=1)
        _sparse_ws_out(acc0, acc1, gl.convert_layout(scale, O_ROW), 0, whole, out_row, slot, group, num_heads,
                       stride_o_head, PARTIAL_O, O_MMA)
        lse_heads = group * 64 + gl.arange(0, 64, layout=S_ROW)
        if whole:
            gl.store(lse_row + lse_heads * stride_lse_head, _natural_lse(lse2), mask=lse_heads < num_heads)
        else:
            gl.store(PARTIAL_LSE + slot * 64 + gl.arange(0, 64, layout=S_ROW), lse2)
        k += 1


@gluon.jit
def _sparse_ws_second(smem, bars, io, schedule, query_ins, num_heads, stride_o_head,
                      HAS_TOPK_LENGTH: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Warpgroup 1, per piece: per tile, once P is published (p_ready) and the tile is in (ready),
    its accumulators rescaled and O += P.V for dims 256-511; P's buffer (p_free) and the tile
    (free) released. Then, on `fin`, its dims of out or of the piece's partial; fin_free."""
    O_MMA: gl.constexpr = _sparse_ws_layouts(BLOCK_N)[1]
    O_ROW: gl.constexpr = gl.SliceLayout(1, O_MMA)
    P_BUFS: gl.constexpr = 64 // BLOCK_N
    q_lat, q_rope, kbuf, krope, p_smem, c_smem, o_scale = smem
    ready, free, p_ready, p_free, fin, fin_free = bars
    TOPK_LENGTH, PARTIAL_O, PARTIAL_LSE = io
    schedule, first_unit, end_unit = _sparse_ws_run(schedule, BLOCK_N)
    g = 0
    k = 0
    for u in range(first_unit, end_unit):
        whole, slot, entries, rows, group, _ = _sparse_ws_piece(u, schedule, query_ins, TOPK_LENGTH,
                                                                HAS_TOPK_LENGTH, BLOCK_N)
        num_tiles = entries[3]
        acc2 = gl.zeros([64, 128], gl.float32, O_MMA)
        acc3 = gl.zeros([64, 128], gl.float32, O_MMA)
        for _ in range(num_tiles):
            buf = g % STAGES
            pb = g % P_BUFS
            mbarrier.wait(p_ready.index(pb), (g // P_BUFS) & 1)
            mbarrier.wait(ready.index(buf), (g // STAGES) & 1)
            factor = gl.expand_dims(c_smem.index(pb).load(O_ROW), 1)
            acc2, acc3 = _sparse_ws_pv(p_smem.index(pb), kbuf, buf, 2, acc2, acc3, factor)
            gl.thread_barrier()  # every warp's MMAs have read P and the tile
            mbarrier.arrive(p_free.index(pb), count=1)
            mbarrier.arrive(free.index(buf), count=1)
            g += 1
        mbarrier.wait(fin, k & 1)
        scale = o_scale.load(O_ROW)
        gl.thread_barrier()  # every warp has read the scale
        mbarrier.arrive(fin_free, count=1)
        _sparse_ws_out(acc2, acc3, scale, 2, whole, rows[1], slot, group, num_heads, stride_o_head, PARTIAL_O, O_MMA)
        k += 1


@gluon.jit
def _mla_sparse_hopper_kernel(
    Q, KV8, KV32, KV16, INDICES, TOPK_LENGTH, OUT, LSE, PARTIAL_O, PARTIAL_LSE,
    sm_scale_log2, capacity, num_units, groups, num_heads, q_len, topk,
    stride_q_batch, stride_q_token, stride_q_head, stride_kv_block, stride_idx_batch, stride_idx_token,
    stride_o_batch, stride_o_token, stride_o_head, stride_lse_batch, stride_lse_head, stride_lse_token,
    BLOCK_N: gl.constexpr, HAS_TOPK_LENGTH: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
):
    """The sparse form on Hopper, warp-specialised (see the section's comment), as a persistent
    schedule: the num_units units (a query token's `groups` head groups of 64, each cdiv(topk,
    BLOCK_N) tiles) are laid end to end and cut into one even run of tiles per program. A unit that
    one program takes whole is written as out and lse; the pieces of a cut unit go to partial slots
    (program + unit) that _mla_sparse_combine_kernel merges. PAGE_SIZE is the cache's page size."""
    gl.static_assert(WARPS == 4, "three warpgroups of 4 warps: the launch's 4 are warpgroup 0")
    schedule = (num_units, groups, topk)
    query_ins = (INDICES, Q, OUT, LSE, capacity, q_len, topk, stride_kv_block,
                 (stride_q_batch, stride_q_token, stride_idx_batch, stride_idx_token, stride_o_batch, stride_o_token,
                  stride_lse_batch, stride_lse_token))

    BAR: gl.constexpr = mbarrier.MBarrierLayout()
    FLAT1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    kbuf = gl.allocate_shared_memory(gl.bfloat16, [4 * STAGES, BLOCK_N, 128],
                                     gl.NVMMASharedLayout.get_default_for([BLOCK_N, 128], gl.bfloat16))
    krope = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64],
                                      gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], gl.bfloat16))
    q_lat = gl.allocate_shared_memory(gl.bfloat16, [4, 64, 128],
                                      gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16))
    q_rope = gl.allocate_shared_memory(gl.bfloat16, [64, 64], gl.NVMMASharedLayout.get_default_for([64, 64],
                                                                                                   gl.bfloat16))
    P_BUFS: gl.constexpr = 64 // BLOCK_N
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [P_BUFS, 64, BLOCK_N],
                                       gl.NVMMASharedLayout.get_default_for([64, BLOCK_N], gl.bfloat16))
    c_smem = gl.allocate_shared_memory(gl.float32, [P_BUFS, 64], FLAT1)
    o_scale = gl.allocate_shared_memory(gl.float32, [64], FLAT1)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], BAR)
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], BAR)
    p_ready = gl.allocate_shared_memory(gl.int64, [P_BUFS, 1], BAR)
    p_free = gl.allocate_shared_memory(gl.int64, [P_BUFS, 1], BAR)
    fin = gl.allocate_shared_memory(gl.int64, [1], BAR)
    fin_free = gl.allocate_shared_memory(gl.int64, [1], BAR)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=2)
    for i in gl.static_range(P_BUFS):
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(p_free.index(i), count=1)
    mbarrier.init(fin, count=1)
    mbarrier.init(fin_free, count=1)
    gl.thread_barrier()
    smem = (q_lat, q_rope, kbuf, krope, p_smem, c_smem, o_scale)
    bars = (ready, free, p_ready, p_free, fin, fin_free)
    io = (TOPK_LENGTH, PARTIAL_O, PARTIAL_LSE)
    gl.warp_specialize([
        (_sparse_ws_main, (smem, bars, io, schedule, query_ins, sm_scale_log2, num_heads, stride_q_head,
                           stride_o_head, stride_lse_head, HAS_TOPK_LENGTH, BLOCK_N, PAGE_SIZE, STAGES)),
        (_sparse_ws_second, (smem, bars, io, schedule, query_ins, num_heads, stride_o_head, HAS_TOPK_LENGTH,
                             BLOCK_N, STAGES)),
        (_sparse_ws_producer, ((KV8, KV16, KV32), (kbuf, krope), (ready, free), schedule, query_ins, TOPK_LENGTH,
                               HAS_TOPK_LENGTH, STAGES, BLOCK_N, PAGE_SIZE))],
        [4, 4], [168, 96])


@gluon.jit
def _sparse_run_of(tile, total, programs):
    """The program whose run (_sparse_ws_run) holds `tile`."""
    base = total // programs
    longer = total % programs
    return gl.where(tile < longer * (base + 1), tile // (base + 1), longer + (tile - longer * (base + 1)) // base)


@gluon.jit
def _mla_sparse_combine_kernel(PARTIAL_O, PARTIAL_LSE, OUT, LSE, num_units, programs, num_heads, q_len, topk,
                               stride_o_batch, stride_o_token, stride_o_head, stride_lse_batch, stride_lse_head,
                               stride_lse_token, GROUPS: gl.constexpr, BLOCK_N: gl.constexpr,
                               MAX_PIECES: gl.constexpr, DIMS: gl.constexpr, WARPS: gl.constexpr):
    """_mla_sparse_hopper_kernel's cut units merged: program (unit, part) merges dims [part x DIMS,
    part x DIMS + DIMS) of the unit's 64 rows from its pieces' partials (slots program + unit of
    the programs whose runs of tiles meet the unit), where there are several."""
    u = gl.program_id(0)
    tiles_per_unit = gl.cdiv(topk, BLOCK_N)
    first_program = _sparse_run_of(u * tiles_per_unit, num_units * tiles_per_unit, programs)
    pieces = _sparse_run_of(u * tiles_per_unit + tiles_per_unit - 1, num_units * tiles_per_unit, programs) \
        - first_program + 1
    if pieces > 1:
        query = u // GROUPS
        group = u % GROUPS
        batch = query // q_len
        q_token = query % q_len
        ROW_LAYOUT: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        heads = group * 64 + gl.arange(0, 64, layout=ROW_LAYOUT)
        out_base = OUT + batch.to(gl.int64) * stride_o_batch + q_token * stride_o_token
        lse_rows = LSE + batch.to(gl.int64) * stride_lse_batch + heads * stride_lse_head + q_token * stride_lse_token
        _merge_request(PARTIAL_O, PARTIAL_LSE, out_base, heads * stride_o_head, lse_rows, heads < num_heads,
                       first_program + u, pieces, 1.0, gl.program_id(1) * DIMS, WARPS=WARPS, MAX_SPLITS=MAX_PIECES,
                       NUM_HEADS=64, LATENT=512, DIMS=DIMS)


# --- Hopper: the combine kernel (the serving kernels' split requests merged) -----------------
@_constexpr_function
def _split_lse_layout(rows, warps):
    """(splits x rows) of partial lse: rows over the lanes (past 32, also in registers), splits over
    the remaining lanes and the warps."""
    lanes = min(rows, 32)
    return gl.BlockedLayout([1, rows // lanes], [32 // lanes, lanes], [warps, 1], [1, 0])


@gluon.jit
def _merged_lse(PARTIAL_LSE, first_slot, num_splits, MAX_SPLITS: gl.constexpr, NUM_HEADS: gl.constexpr,
                WARPS: gl.constexpr):
    """The base-2 lse of the merged rows from their splits' (-inf for a row with nothing attended)."""
    LAYOUT: gl.constexpr = _split_lse_layout(NUM_HEADS, WARPS)
    splits = gl.expand_dims(gl.arange(0, MAX_SPLITS, layout=gl.SliceLayout(1, LAYOUT)), 1)
    heads = gl.expand_dims(gl.arange(0, NUM_HEADS, layout=gl.SliceLayout(0, LAYOUT)), 0)
    lse = gl.load(PARTIAL_LSE + (first_slot + splits) * NUM_HEADS + heads, mask=splits < num_splits,
                  other=float("-inf"), cache_modifier=".cg")
    top = gl.max(lse, 0)
    top = gl.where(top == float("-inf"), 0.0, top)
    return top + gl.log2(gl.sum(gl.exp2(lse - gl.expand_dims(top, 0)), 0))


@_constexpr_function
def _serving_merge_slice(latent, splits, rows, warps, dims):
    """Latent dims _merge_serving merges at once: 64 floats of partials per thread (16 rows at 4
    warps, 32 at 8: latent / splits dims; twice the rows per thread: half as many dims), at most
    the `dims` it merges."""
    return min(dims, latent // splits // max(1, rows // (4 * warps)))


@gluon.jit
def _merge_serving(PARTIAL_O, PARTIAL_LSE, out_base, rows, row_ok, first_slot, num_splits, kv_scale, dim0,
                   WARPS: gl.constexpr, SPLITS: gl.constexpr, NUM_HEADS: gl.constexpr, LATENT: gl.constexpr,
                   DIMS: gl.constexpr):
    """Latent dims [dim0, dim0 + DIMS) of the request's rows merged from its num_splits (<= SPLITS)
    splits."""
    SLICE: gl.constexpr = _serving_merge_slice(LATENT, SPLITS, NUM_HEADS, WARPS, DIMS)
    for dim_begin in range(dim0, dim0 + DIMS, SLICE):
        _merge_slice(PARTIAL_O, PARTIAL_LSE, out_base, first_slot, dim_begin, kv_scale, WARPS, SPLITS, SLICE,
                     NUM_HEADS, LATENT, num_splits, rows, row_ok)


@gluon.jit
def _merge_request(PARTIAL_O, PARTIAL_LSE, out_base, out_rows, lse_rows, row_ok, first_slot, num_splits, kv_scale,
                   dim0, WARPS: gl.constexpr, MAX_SPLITS: gl.constexpr, NUM_HEADS: gl.constexpr,
                   LATENT: gl.constexpr, DIMS: gl.constexpr):
    """A request's rows of out, dims [dim0, dim0 + DIMS), from its num_splits partials in slots
    first_slot ...: _merge_serving in the layout of the smallest split-count class that holds them
    (4, 8 or MAX_SPLITS), then, by the part that holds dim 0, the merged lse."""
    if num_splits <= 4:
        _merge_serving(PARTIAL_O, PARTIAL_LSE, out_base, out_rows, row_ok, first_slot, num_splits, kv_scale, dim0,
                       WARPS, 4, NUM_HEADS, LATENT, DIMS)
    elif num_splits <= 8:
        _merge_serving(PARTIAL_O, PARTIAL_LSE, out_base, out_rows, row_ok, first_slot, num_splits, kv_scale, dim0,
                       WARPS, 8, NUM_HEADS, LATENT, DIMS)
    else:
        _merge_serving(PARTIAL_O, PARTIAL_LSE, out_base, out_rows, row_ok, first_slot, num_splits, kv_scale, dim0,
                       WARPS, MAX_SPLITS, NUM_HEADS, LATENT, DIMS)
    if dim0 == 0:
        merged = _merged_lse(PARTIAL_LSE, first_slot, num_splits, MAX_SPLITS, NUM_HEADS, WARPS)
        gl.store(lse_rows, _natural_lse(gl.convert_layout(merged, row_ok.type.layout)), mask=row_ok)


@gluon.jit
def _mla_combine_kernel(PARTIAL_O, PARTIAL_LSE, SPLIT_COUNTS, KV_SCALE, OUT, LSE, kv_scale_value, slots, num_heads,
                        q_len, stride_o_batch, stride_o_token, stride_o_head, stride_lse_batch, stride_lse_head,
                        stride_lse_token, NUM_HEADS: gl.constexpr, MAX_SPLITS: gl.constexpr, DIMS: gl.constexpr,
                        WARPS: gl.constexpr, KV_SCALE_IN_TENSOR: gl.constexpr, LATENT: gl.constexpr = 512):
    """The serving API's merge of split requests, after the Hopper kernel (FlashMLA's combine step
    too): program (request, row group, part) merges dims [part x DIMS, part x DIMS + DIMS) of the
    group's NUM_HEADS rows from the request's partials, where its split count (SPLIT_COUNTS, written
    by the kernel before) is above one; a request of one split was written whole by the kernel.
    Spread over the grid, a request's merge costs one memory latency per part, where the split that
    finished last took them one after the other."""
    request = gl.program_id(0)
    group = gl.program_id(1)
    num_splits = gl.load(SPLIT_COUNTS + 2 * request + 1)
    if num_splits > 1:
        first_slot = group * slots + gl.load(SPLIT_COUNTS + 2 * request)
        kv_scale = gl.load(KV_SCALE) if KV_SCALE_IN_TENSOR else kv_scale_value
        ROW_LAYOUT: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        row_ok, q_token, head = _serving_rows(group, num_heads, q_len, NUM_HEADS, ROW_LAYOUT)
        out_base = OUT + request.to(gl.int64) * stride_o_batch
        lse_rows = LSE + request.to(gl.int64) * stride_lse_batch + head * stride_lse_head + q_token * stride_lse_token
        _merge_request(PARTIAL_O, PARTIAL_LSE, out_base, q_token * stride_o_token + head * stride_o_head, lse_rows,
                       row_ok, first_slot, num_splits, kv_scale, gl.program_id(2) * DIMS, WARPS, MAX_SPLITS,
                       NUM_HEADS, LATENT, DIMS)


# --- Hopper: host side (descriptors, residency, custom_kernel's route, compile plans) --------
def hopper_boxes(dtype="fp8e4nv", latent_3d=False, tokens=64):
    """The TMA boxes of an fp8 ("fp8e4nv") or a bf16 ("bf16") cache: (latent box, its shared
    layout, the rope box's layout). The latent box is (64 tokens, 128 dims), one copy per chunk
    (custom_kernel's rows), or with latent_3d (boxes, 64 tokens, 128 bytes of dims: 128 fp8 or 64
    bf16), one copy a tile, each box 128-byte swizzled (the paged kernel). The rope
    box is (64 tokens, 64 rope dims). `tokens`: the tile's tokens where not 64 (the bf16 seesaw's 32)."""
    element = gl.float8e4nv if dtype == "fp8e4nv" else gl.bfloat16
    if latent_3d:
        dims = TMA_BOX_BYTES * 8 // element.primitive_bitwidth
        latent = ([V_HEAD_DIM // dims, tokens, dims],
                  gl.NVMMASharedLayout(TMA_BOX_BYTES, element.primitive_bitwidth, rank=3))
    else:
        latent = ([tokens, HOPPER_CHUNK], gl.NVMMASharedLayout.get_default_for([tokens, HOPPER_CHUNK], element))
    return *latent, gl.NVMMASharedLayout.get_default_for([tokens, ROPE_DIM], element)


# (data_ptr, rows, row stride, device) -> the two TMA descriptors of that cache. A descriptor holds
# its cache tensor alive, so at most two are kept (and a new tensor never reuses a cached address
# while its entry lives).
_KV_DESCRIPTORS = {}


def tma_can_read(kv):
    """TMA needs unit stride along the row and 16-byte aligned rows and base; a paged cache
    (blocks, page, 1, 576) is read as blocks x page rows, so its blocks must follow each other."""
    return (kv.stride(-1) == 1 and kv.stride(-3) % 16 == 0 and kv.data_ptr() % 16 == 0
            and (kv.dim() == 3 or kv.stride(0) == kv.shape[1] * kv.stride(1)))


def kv_descriptors(kv, latent_3d=False, tokens=64):
    """TMA descriptors over the (rows, 576) cache, rows (rows, 1, 576) or the pages of (blocks,
    page, 1, 576), the latent one of hopper_boxes(latent_3d, tokens); cached per cache tensor (the
    last two)."""
    key = (kv.data_ptr(), kv.shape[0], kv.shape[1], kv.stride(0), kv.device, latent_3d, tokens)
    descriptors = _KV_DESCRIPTORS.get(key)
    if descriptors is None:
        if len(_KV_DESCRIPTORS) >= 2:
            _KV_DESCRIPTORS.clear()
        rows = (kv.flatten(0, 1) if kv.dim() == 4 else kv)[:, 0, :]
        block, latent_layout, rope_layout = hopper_boxes("bf16" if kv.dtype == torch.bfloat16 else "fp8e4nv",
                                                         latent_3d, tokens)
        if latent_3d:  # the latent dims seen as (box, row, dim): strides (box dims, row stride, 1)
            shape, strides = [block[0], rows.shape[0], block[2]], [block[2], rows.stride(0), 1]
        else:
            shape, strides = list(rows.shape), list(rows.stride())
        descriptors = _KV_DESCRIPTORS[key] = (
            TensorDescriptor(rows, shape, strides, block, latent_layout),
            TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [tokens, ROPE_DIM], rope_layout))
    return descriptors


COOPERATIVE_SPLITS = (2, 4, 8, 16, 32, 64)  # split counts whose splits can each merge 512 / splits dims
SM90_REGISTERS_PER_SM = 65536
SM90_SHARED_PER_SM = 228 * 1024  # bytes; the system reserves 1 KiB of it per resident program


def hopper_shared_bytes_bound(num_stages, element_bytes=1, rows=NUM_HEADS):
    """An upper bound on the Hopper kernel's shared memory: the ring (64 tokens x 576 elements per
    slot), q (rows x 576), P^T (64 tokens x 2 bytes per row: fp8 hi and lo, f16 or bf16), the
    barriers and 24 KiB for the compiler's scratch (the span schedule's epilogue cannot reuse the
    ring's space, which lives across its segment loop; tests/cpu/test_kernel_report.py
    checks the sm_90 compile stays under it); element_bytes 2 for a bf16 cache; rows: query rows
    per program."""
    return (element_bytes * (num_stages * 64 * QK_HEAD_DIM + rows * QK_HEAD_DIM) + 2 * rows * 64
            + 8 * num_stages + 24576)


def hopper_programs_per_sm(num_warps, num_stages, element_bytes=1, rows=NUM_HEADS):
    """Programs of the Hopper kernel an SM holds at once whatever ptxas allocates: registers (at
    most 256 per thread: 2 programs of 4 warps, 1 of 8) and shared memory (the bound above)."""
    by_registers = SM90_REGISTERS_PER_SM // (num_warps * 32 * 256)
    by_shared = SM90_SHARED_PER_SM // (hopper_shared_bytes_bound(num_stages, element_bytes, rows) + 1024)
    return max(1, min(by_registers, by_shared))


def cooperative_merge_fits(batch, num_splits, device, num_warps=4, num_stages=2):
    """Whether the splits of a row may merge together (each waits for all of its row's splits): only
    when every program of the grid is resident at once on an otherwise idle GPU (SMs x
    hopper_programs_per_sm: two per SM at 4 warps and 2 ring slots), with a power-of-two split count
    of 2-64 (each merges 512 / num_splits dims)."""
    capacity = sm_count(device) * hopper_programs_per_sm(num_warps, num_stages)
    return num_splits in COOPERATIVE_SPLITS and batch * num_splits <= capacity


def hopper_fp8_route(q, kv_data, qo_indptr, kv_indptr, config, num_splits=1, num_warps=4, num_stages=2):
    """Split-KV decode over kv_data["fp8"] on Hopper in one launch (see _mla_decode_fp8_hopper_kernel).
    num_stages: TMA ring slots (2-4); num_warps 4 or 8. The splits of a row merge together when
    the grid fits the GPU at once (cooperative_merge_fits); otherwise the row's last split merges it."""
    kv_fp8, kv_scale = kv_data["fp8"]
    if kv_fp8.dtype != torch.float8_e4m3fn:
        raise ValueError(f'kv_data["fp8"] must be float8_e4m3fn for the Hopper route, got {kv_fp8.dtype}')
    if not tma_can_read(kv_fp8):  # a view the runner never makes: the portable kernel reads it (or refuses it)
        return triton_fp8_route(q, kv_data, qo_indptr, kv_indptr, config, num_splits=num_splits)
    batch = kv_indptr.shape[0] - 1
    if q.shape[0] != batch or q.stride(1) != QK_HEAD_DIM or q.stride(2) != 1:  # the kernel reads q[batch] densely
        raise ValueError(f"q must be a contiguous ({batch}, {NUM_HEADS}, {QK_HEAD_DIM}) tensor for the Hopper "
                         f"route, got shape {tuple(q.shape)} strides {tuple(q.stride())}")
    out = torch.empty(q.shape[0], NUM_HEADS, V_HEAD_DIM, dtype=torch.bfloat16, device=q.device)
    partial_o, partial_lse, tickets = split_workspace(batch, num_splits, q.device)
    latent_desc, rope_desc = kv_descriptors(kv_fp8)
    cooperative = cooperative_merge_fits(batch, num_splits, q.device, num_warps, num_stages)
    launch(_mla_decode_fp8_hopper_kernel, (batch, num_splits),
           (q, latent_desc, rope_desc, kv_scale, qo_indptr, kv_indptr, out, partial_o, partial_lse, tickets),
           (SM_SCALE * LOG2E, kv_fp8.shape[0], q.stride(0), out.stride(0)),
           {"FP8_MAX": FP8_MAX[torch.float8_e4m3fn], "NUM_SPLITS": num_splits, "STAGES": num_stages,
            "WARPS": num_warps, "COOPERATIVE_MERGE": cooperative},
           num_warps, 1)
    return out


def hopper_fp8_compile_plan(params, fp8_dtype):
    """sm_90 only ("targets"); no plan without Gluon. A row whose split count allows the cooperative
    merge compiles both merges (which one runs depends on the batch: cooperative_merge_fits)."""
    if not HAVE_GLUON:
        return []
    p = dict(keyword_defaults(hopper_fp8_route), **params)
    signature = {
        **_hopper_leading_signature(),
        "QO_INDPTR": "*i32", "KV_INDPTR": "*i32", "OUT": "*bf16", "PARTIAL_O": "*fp32", "PARTIAL_LSE": "*fp32",
        "SPLIT_TICKETS": "*i32", "sm_scale_log2": "fp32", "kv_rows": "i32", "stride_q_token": "i32",
        "stride_o_token": "i32",
    }
    merges = [False, True] if p["num_splits"] in COOPERATIVE_SPLITS else [False]
    return [{
        "kernel": _mla_decode_fp8_hopper_kernel, "targets": ["sm90"], "signature": signature,
        "constexprs": {**keyword_defaults(_mla_decode_fp8_hopper_kernel),
                       "FP8_MAX": FP8_MAX[torch.float8_e4m3fn], "NUM_SPLITS": p["num_splits"],
                       "STAGES": p["num_stages"], "WARPS": p["num_warps"], "COOPERATIVE_MERGE": cooperative},
        "aligned_args": [name for name, kind in signature.items()
                         if kind[0] == "*" or name in ("kv_rows", "stride_q_token", "stride_o_token")],
        "num_warps": p["num_warps"], "num_stages": 1,
    } for cooperative in merges]


def _hopper_leading_signature(dtype="fp8e4nv", latent_3d=False, tokens=64):
    """The arguments both Hopper kernels open with: q, the cache's two TMA descriptors, the scale."""
    block, latent_layout, rope_layout = hopper_boxes(dtype, latent_3d, tokens)
    return {"Q": "*bf16", "lat_desc": f"tensordesc<{dtype}[{', '.join(map(str, block))}],{latent_layout!r}>",
            "rope_desc": f"tensordesc<{dtype}[{tokens}, {ROPE_DIM}],{rope_layout!r}>", "KV_SCALE": "*fp32"}


def hopper_paged_compile_plan(params, fp8_dtype, page_sizes=(16, 64), causal=(False, True), batch=128,
                              caches=("fp8e4nv", "bf16")):
    """The serving API's Hopper kernels (sm_90 only), for page sizes (16: the gathered kernel, 64:
    TMA; serving_route's choice), causal masks on and off, an
    fp8 cache with a tensor k_scale and a bf16 one (only params["kv"]'s where given, as
    tools/kernel_report.py gives a serving row's), params' rows (16 where absent), warps and ring
    slots; a plan like the route tables'."""
    if not HAVE_GLUON:
        return []
    if "kv" in params:
        caches = ("fp8e4nv" if params["kv"] == "fp8" else "bf16",)
    if params.get("seesaw"):  # pages of whole tiles; an fp8 cache where the row names none
        caches = caches if "kv" in params else ("fp8e4nv",)
        page_sizes = [page for page in page_sizes if page >= 64]
    return [entry for cache in caches for entry in _hopper_paged_plan(params, cache, page_sizes, causal, batch)] + [
        _combine_plan(params.get("rows", SERVING_ROWS))]


def _combine_plan(rows):
    """The compile plan entry of _mla_combine_kernel after a Hopper kernel of `rows` query rows
    (a tensor k_scale), as _combine_launch launches it."""
    constexprs = _combine_constexprs(rows, True)
    signature = {"PARTIAL_O": "*fp32", "PARTIAL_LSE": "*fp32", "SPLIT_COUNTS": "*i32", "KV_SCALE": "*fp32",
                 "OUT": "*bf16", "LSE": "*fp32", "kv_scale_value": "fp32",
                 **{name: "i32" for name in ("slots", "num_heads", "q_len", "stride_o_batch", "stride_o_token",
                                             "stride_o_head", "stride_lse_batch", "stride_lse_head",
                                             "stride_lse_token")}}
    return {"kernel": _mla_combine_kernel, "targets": ["sm90"], "signature": signature,
            "constexprs": {**keyword_defaults(_mla_combine_kernel), **constexprs},
            "aligned_args": [name for name, kind in signature.items() if kind[0] == "*"],
            "num_warps": constexprs["WARPS"], "num_stages": 1}


def _hopper_paged_signature(kernel, cache, tokens=64):
    """The signature of a Hopper serving kernel: TMA descriptors (of `tokens`-token tiles), or, for the
    gathered kernel, the cache and its row stride."""
    if kernel is _mla_decode_gathered_hopper_kernel:
        leading = {"Q": "*bf16", "KV": f"*{cache}", "KV_SCALE": "*fp32"}
        gathered = ("stride_kv_row",)
    else:
        leading, gathered = _hopper_leading_signature(cache, latent_3d=True, tokens=tokens), ()
    return {
        **leading,
        "CACHE_SEQLENS": "*i32", "BLOCK_TABLE": "*i32", "OUT": "*bf16", "LSE": "*fp32", "PARTIAL_O": "*fp32",
        "PARTIAL_LSE": "*fp32", "SPLIT_COUNTS": "*i32", "sm_scale_log2": "fp32", "kv_scale_value": "fp32",
        **{name: "i32" for name in (
            "kv_rows", "num_blocks", "capacity", "batch_size", "target_splits", "min_chunk", "num_heads", "q_len")},
        "q_strides": ("i32",) * 3, "stride_bt": "i32", "out_strides": ("i32",) * 6,
        **{name: "i32" for name in gathered},
    }


def hopper_row_constexprs(params):
    """The Hopper paged kernels' constexprs that a hopper_paged route row's params fix, for the
    compile plan and the launch alike (BLOCK_N only where the row names its tile: the bf16 seesaw's;
    SEGMENT_TILES where it names a segment's cost: the seesaw's)."""
    return {"STAGES": params["num_stages"], "WARPS": params["num_warps"], "NUM_HEADS": params.get("rows", SERVING_ROWS),
            "PV_F16": params.get("pv_f16", False), "SHARED_MAX": params.get("shared_max", False),
            **({"BLOCK_N": params["block_n"]} if "block_n" in params else {}),
            **({"SEGMENT_TILES": params["segment_tiles"]} if "segment_tiles" in params else {})}


def _hopper_paged_plan(params, cache, page_sizes, causal, batch):
    plan = []
    tokens = params.get("block_n", 64)
    kv = "fp8" if cache == "fp8e4nv" else "bf16"
    row = {"kv": kv, "route": "hopper_paged", "params": params}
    for page in page_sizes:
        shape = PlanShape(batch, 1, params.get("rows", SERVING_ROWS), page, kv, False)
        kernel = serving_route(shape, None, page, table=[row], here=False).kernel  # the launch's choice
        signature = _hopper_paged_signature(kernel, cache, tokens)
        plan += [{
            "kernel": kernel, "targets": ["sm90"], "signature": signature,
            "constexprs": {**keyword_defaults(kernel), "FP8_MAX": FP8_MAX[torch.float8_e4m3fn],
                           "PAGE_SIZE": page, **hopper_row_constexprs(params),
                           "CAUSAL": c, "BATCH_BLOCK": max(32, triton.next_power_of_2(batch)),
                           "MAX_SPLITS": SERVING_MAX_SPLITS, "KV_FP8": cache == "fp8e4nv",
                           "KV_SCALE_IN_TENSOR": cache == "fp8e4nv", "SPANS": params.get("spans", False)},
            "aligned_args": [name for name, kind in signature.items()
                             if kind[0] == "*" or name == "stride_kv_row"],  # Triton marks 16-multiples
            "num_warps": params["num_warps"], "num_stages": 1,
        } for c in causal]
    return plan


# =============================================================================================
# aiter routes (MI355X)
# aiter's MLA decode on the MI355X runner. Four routes:
#   aiter_bf16              mla_decode_fwd, bf16 q over the bf16 cache, page 1 (aiter picks splits)
#   aiter_fp8               mla_decode_fwd, fp8 q over the fp8 cache, page 1, one split per batch
#   aiter_a8w8_persistent   mla_decode_stage1_asm_fwd + mla_reduce_v1 called directly over a work
#                           plan from get_mla_metadata_v1, the fp8 KV seen as pages, fp8 q
#   aiter_a16w8_persistent  the same calls with bf16 q over the fp8 KV (aiter's a16w8 kernel)
# and, for the serving API (SERVING_ROUTE_TABLE's aiter rows), aiter_serving_fp8 /
# aiter_serving_bf16 / aiter_serving_a8w8_persistent over aiter's CSR form of a block table
# (aiter_serving_csr).
# aiter's API drifts (docs/runner.md, "Which aiter versions the file was checked against": the
# runner's f3be04a12 and v0.1.20 of 2026-08-22, read, and every generation between them in the test
# double). The rule: the compiled ops' parameter lists (stage 1, the reduce) and the metadata
# functions' are read ONCE at import; the two kernels get their values positionally in the order
# read, up to the last one this file fills (q_scale, kv_scale; `lse` stays None on custom_kernel's
# routes: aiter has no lse build of the a16w8 kernel; aiter_serving_a8w8_persistent fills it where
# aiter's API says a kernel writes it), the metadata calls get theirs by the names read. Anything this file
# cannot call correctly turns the aiter routes off (one warning line, Triton routes).
# =============================================================================================


# Values this file fills, by parameter name, in the newest known order. OPTIONAL names may be
# absent from an older aiter; every other name must be there.
STAGE1_PARAMETERS = (
    "Q", "KV", "qo_indptr", "kv_indptr", "kv_page_indices", "kv_last_page_lens",
    "num_kv_splits_indptr", "work_meta_data", "work_indptr", "work_info_set", "max_seqlen_q",
    "page_size", "nhead_kv", "softmax_scale", "splitData", "splitLse", "output", "lse",
    "q_scale", "kv_scale",
)
STAGE1_OPTIONAL = frozenset({"lse"})
REDUCE_PARAMETERS = (
    "partial_output", "partial_lse", "reduce_indptr", "reduce_final_map", "reduce_partial_map",
    "max_seqlen_q", "num_kv_splits", "final_output", "final_lse",
)
REDUCE_OPTIONAL = frozenset({"num_kv_splits", "final_lse"})
# mla_decode_fwd is a plain Python function: called with these as keywords.
DECODE_FWD_KEYWORDS = ("page_size", "nhead_kv", "sm_scale", "num_kv_splits",
                       "num_kv_splits_indptr", "q_scale", "kv_scale")
# get_mla_metadata_v1: these first, positionally (work_info_set BEFORE work_indptr), then the
# settings by keyword, then the two dtypes under whichever pair of names this aiter takes.
METADATA_POSITIONAL = (
    "seqlens_qo_indptr", "seqlens_kv_indptr", "kv_last_page_lens", "num_heads_per_head_k",
    "num_heads_k", "is_causal", "work_metadata_ptrs", "work_info_set", "work_indptr",
    "reduce_indptr", "reduce_final_map", "reduce_partial_map",
)
METADATA_KEYWORDS = ("page_size", "kv_granularity", "max_seqlen_qo", "uni_seqlen_qo", "fast_mode",
                     "max_split_per_batch", "intra_batch_mode")
METADATA_DTYPE_KEYWORDS = (("dtype_q", "dtype_kv"), ("dtype_q_nope", "dtype_kv_nope"))
# get_mla_metadata_info_v1 (a plain Python function): these positionally, then the keywords;
# max_split_per_batch too where it takes it (it then sizes reduce_partial_map by it).
INFO_POSITIONAL = ("batch_size", "max_seqlen_qo", "num_head_qo", "q_dtype", "kv_dtype",
                   "is_sparse")
INFO_KEYWORDS = ("fast_mode", "num_kv_splits", "intra_batch_mode")
INFO_OPTIONAL_KEYWORDS = ("max_split_per_batch",)


def aiter_parameters(fn, op_name):
    """[(name, has_default), ...] of an aiter op in order, or None when it cannot be read.

    aiter's torch_compile_guard hides an op's Python stub behind wrapper_custom(*args, **kwargs);
    the stub's names then survive only in the schema registered as torch.ops.aiter.<op_name>."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        parameters = ()
    positional = [(p.name, p.default is not p.empty) for p in parameters
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if positional:
        return positional
    try:
        arguments = getattr(torch.ops.aiter, op_name).default._schema.arguments
    except Exception:  # no such op, or torch keeps schemas elsewhere
        return None
    names = [(a.name, a.has_default_value()) for a in arguments]
    # torch_compile_guard prepends a dummy tensor to ops whose first argument is not a tensor
    return names[1:] if names and names[0][0] == "dummy" else names


def positional_order(op_name, parameters, known, optional):
    """An itemgetter that picks, from values ordered like `known`, the op's positional arguments:
    every parameter up to the last one this file fills. RuntimeError when the op cannot be called
    that way: unreadable, a required known name missing, an unknown parameter before the last
    filled one, or an unknown parameter without a default after it."""
    if parameters is None:
        raise RuntimeError(f"{op_name}: signature unreadable")
    names = [name for name, _ in parameters]
    missing = [name for name in known if name not in names and name not in optional]
    if missing:
        raise RuntimeError(f"{op_name} has no parameter {missing[0]!r}")
    last = max(names.index(name) for name in known if name in names)
    for position, (name, has_default) in enumerate(parameters):
        if position <= last and name not in known:
            raise RuntimeError(f"{op_name}: unknown parameter {name!r} at position {position}")
        if position > last and not has_default:
            raise RuntimeError(f"{op_name}: unknown required parameter {name!r}")
    return operator.itemgetter(*(known.index(name) for name in names[: last + 1]))


def keyword_names(op_name, parameters, positional, keywords, alternatives=(), optional=()):
    """The keyword names a call of op_name passes: `keywords`, the first pair of `alternatives`
    the op takes, and those of `optional` it takes. RuntimeError when the call would not fit:
    unreadable, other leading positional names, a keyword missing, no pair of alternatives, or
    an unknown parameter without a default."""
    if parameters is None:
        raise RuntimeError(f"{op_name}: signature unreadable")
    names = [name for name, _ in parameters]
    if tuple(names[:len(positional)]) != positional:
        raise RuntimeError(f"{op_name}: parameters begin {names[:len(positional)]}, "
                           f"expected {list(positional)}")
    missing = [name for name in keywords if name not in names]
    if missing:
        raise RuntimeError(f"{op_name} has no parameter {missing[0]!r}")
    chosen = next((pair for pair in alternatives if all(name in names for name in pair)), ())
    if alternatives and not chosen:
        raise RuntimeError(f"{op_name} takes none of {[pair[0] for pair in alternatives]}")
    passed = tuple(keywords) + chosen + tuple(name for name in optional if name in names)
    for name, has_default in parameters[len(positional):]:
        if not has_default and name not in passed:
            raise RuntimeError(f"{op_name}: unknown required parameter {name!r}")
    return passed


def _load_aiter():
    """Import aiter and read its signatures; raise on anything this file cannot call.
    Returns (aiter, mla_decode_fwd, {op: (fn, positional order or None, names passed)})."""
    import aiter
    from aiter.mla import mla_decode_fwd

    decode_parameters = aiter_parameters(mla_decode_fwd, "mla_decode_fwd") or ()
    decode_names = {name for name, _ in decode_parameters}
    for name in DECODE_FWD_KEYWORDS:
        if name not in decode_names:
            raise RuntimeError(f"mla_decode_fwd has no parameter {name!r}")
    calls = {}
    for op_name, known, optional in (
            ("mla_decode_stage1_asm_fwd", STAGE1_PARAMETERS, STAGE1_OPTIONAL),
            ("mla_reduce_v1", REDUCE_PARAMETERS, REDUCE_OPTIONAL)):
        fn = getattr(aiter, op_name, None)
        if fn is None:
            raise RuntimeError(f"aiter has no {op_name}")
        order = positional_order(op_name, aiter_parameters(fn, op_name), known, optional)
        calls[op_name] = (fn, order, order(known))
    for op_name, positional, keywords, alternatives, optional in (
            ("get_mla_metadata_v1", METADATA_POSITIONAL, METADATA_KEYWORDS,
             METADATA_DTYPE_KEYWORDS, ()),
            ("get_mla_metadata_info_v1", INFO_POSITIONAL, INFO_KEYWORDS, (),
             INFO_OPTIONAL_KEYWORDS)):
        fn = getattr(aiter, op_name, None)
        if not callable(fn):
            raise RuntimeError(f"aiter has no {op_name}")
        passed = keyword_names(op_name, aiter_parameters(fn, op_name), positional, keywords,
                               alternatives, optional)
        calls[op_name] = (fn, None, positional + passed)
    return aiter, mla_decode_fwd, calls


try:
    aiter, mla_decode_fwd, _AITER_CALLS = _load_aiter()
    _stage1, _STAGE1_ORDER, _ = _AITER_CALLS["mla_decode_stage1_asm_fwd"]
    _reduce, _REDUCE_ORDER, _ = _AITER_CALLS["mla_reduce_v1"]
    # the parameter names each call passes, in order: how this aiter was understood
    AITER_API = {op_name: names for op_name, (_, _, names) in _AITER_CALLS.items()}
    # get_mla_metadata_v1's dtype keywords; whether the info takes max_split_per_batch
    _METADATA_DTYPES = next(pair for pair in METADATA_DTYPE_KEYWORDS
                            if set(pair) <= set(AITER_API["get_mla_metadata_v1"]))
    _INFO_SPLIT_CAP = "max_split_per_batch" in AITER_API["get_mla_metadata_info_v1"]
    # every parameter stage 1 takes, also those left at their defaults (read for capabilities)
    _STAGE1_NAMES = frozenset(name for name, _ in
                              aiter_parameters(_stage1, "mla_decode_stage1_asm_fwd"))
    HAVE_AITER = True
except Exception as exc:  # not installed, a broken install, or an API this file does not know
    aiter = mla_decode_fwd = _stage1 = _reduce = _STAGE1_ORDER = _REDUCE_ORDER = AITER_API = None
    _METADATA_DTYPES = _INFO_SPLIT_CAP = None
    _STAGE1_NAMES = frozenset()
    HAVE_AITER = False
    _reason = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line
    print(f"submission.py: aiter routes off ({_reason}); using the portable Triton routes",
          file=sys.stderr)
# Module caches. Each key holds everything its object depends on. The runner keeps the module for
# all cases of a mode; the keys are per shape, so they stay small. No output is ever cached: each
# call returns a fresh tensor (a caller may keep earlier results).
_PAGE_TABLES = {}  # (batch, total_kv, kv_seq_len or None, page_size, device) -> PageTables
_PLANS = {}  # see persistent_plan for the key
_Q_FP8 = {}  # (total_q, fp8 dtype, device) -> (fp8 q buffer, unit scale)


class PageTables:
    """The KV cache seen as pages of page_size rows (int32 index tensors).

    page_size 1: every row is a page: page ids arange(total_kv), last-page lengths 1; the page
    indptr is the call's own kv_indptr (right for any lengths), so none is stored here.
    page_size > 1: only for uniform lengths kv_seq_len, a multiple of page_size (callers check):
    batch b owns pages [b * n, (b + 1) * n), n = kv_seq_len // page_size, all of them full."""
    __slots__ = ("kv_page_indptr", "kv_page_ids", "kv_last_page_lens", "one_split_indptr")

    def __init__(self, batch, total_kv, kv_seq_len, page_size, device):
        def int32_arange(n):
            return torch.arange(n, dtype=torch.int32, device=device)

        self.kv_page_ids = int32_arange(total_kv // page_size)
        self.kv_last_page_lens = torch.full((batch,), page_size, dtype=torch.int32, device=device)
        self.kv_page_indptr = (None if page_size == 1
                               else int32_arange(batch + 1) * (kv_seq_len // page_size))
        # mla_decode_fwd's num_kv_splits_indptr for one split per batch: arange(0, bs + 1) * 1
        self.one_split_indptr = int32_arange(batch + 1)


def page_tables(batch, total_kv, kv_seq_len, page_size, device):
    key = (batch, total_kv, kv_seq_len if page_size > 1 else None, page_size, device)
    tables = _PAGE_TABLES.get(key)
    if tables is None:
        tables = _PAGE_TABLES[key] = PageTables(batch, total_kv, kv_seq_len, page_size, device)
    return tables


def _contiguous_kv(route, field, kv):
    """aiter's kernels read the cache as contiguous pages: another layout is refused (a copy of
    the cache would cost more than the call)."""
    if not kv.is_contiguous():
        raise ValueError(f"{field} has strides {tuple(kv.stride())}: {route} reads it as contiguous rows; "
                         "pass .contiguous() of it")
    return kv


def quantize_q_fp8(q, fp8_dtype, q_scale):
    """bf16 q -> (fp8 q, float32 scale of shape (1,)) with no host sync; q_scale ("tensor" or
    "unit") is described above the route tables. The fp8 buffer is cached per (q's shape, dtype, device: the
    serving routes call it at several head counts) and rewritten by each call: the previous call's kernels,
    queued before this one on the device, read it first."""
    key = (tuple(q.shape), fp8_dtype, q.device)
    buffers = _Q_FP8.get(key)
    if buffers is None:
        buffers = _Q_FP8[key] = (torch.empty(q.shape, dtype=fp8_dtype, device=q.device),
                                 torch.ones(1, dtype=torch.float32, device=q.device))
    q_fp8, unit_scale = buffers
    if q_scale == "unit":
        q_fp8.copy_(q)
        return q_fp8, unit_scale
    if q_scale == "tensor":
        # The runner's quantiser step for step, in q's own bf16 (bit for bit its bytes and scale):
        # the scale in bf16, q / scale rounded to bf16, then the cast. The bf16 scale may
        # undershoot amax / fp8 max by half a bf16 step, so |q / scale| can pass the fp8 max by
        # less than half an fp8 step, which the cast rounds to the max: no clamp.
        scale = fp8_tensor_scale(q, fp8_dtype).reshape(1)
        q_fp8.copy_(torch.div(q, scale))
        return q_fp8, scale.float()
    raise ValueError(f"q_scale must be 'tensor' or 'unit' for the aiter routes, got {q_scale!r}")


# How get_mla_metadata_v1 cuts the KV into work. REFERENCE_PLAN is the runner's reference's own
# setting (intra-batch: every batch split on its own), which runs on every check the runner makes,
# at its shapes: uniform lengths of 1024 and 8192, page size 1. On gfx950 (aiter f3be04a12) it
# gives a batch min(length // 196, ...) splits, so a batch shorter than INTRA_BATCH_MIN_KV gets 0
# and aiter divides by zero; it ignores the page size and the last-page lengths. BALANCED_PLAN
# (aiter's fast mode: the KV of all batches cut evenly over the CUs, page aware) serves the rest:
# ragged or short lengths, and pages.
REFERENCE_PLAN = {"is_causal": True, "fast_mode": False, "intra_batch_mode": True}
BALANCED_PLAN = {"is_causal": False, "fast_mode": True, "intra_batch_mode": False}
INTRA_BATCH_MIN_KV = 196


def plan_setting(page_size, uniform, kv_seq_len):
    """REFERENCE_PLAN where the shapes vouch that every batch is long enough, else BALANCED_PLAN."""
    if page_size == 1 and uniform and kv_seq_len >= INTRA_BATCH_MIN_KV:
        return REFERENCE_PLAN
    return BALANCED_PLAN


class PersistentPlan:
    """One shape's work plan: the six buffers get_mla_metadata_info_v1 describes (filled by
    get_mla_metadata_v1 with `setting`, one of the *_PLAN dicts), plus the float32 partials stage 1
    writes and the reduce reads, sized reduce_partial_map.size(0) * max_seqlen_q rows as aiter's
    own wrapper sizes them. heads: query heads (custom_kernel's 16; the serving API's per plan)."""
    __slots__ = ("setting", "heads", "work_meta_data", "work_indptr", "work_info_set",
                 "reduce_indptr", "reduce_final_map", "reduce_partial_map", "partial_output",
                 "partial_lse")

    def __init__(self, batch, max_seqlen_q, num_kv_splits, q_dtype, kv_dtype, device, setting,
                 heads=NUM_HEADS):
        self.setting, self.heads = setting, heads
        split_cap = {"max_split_per_batch": num_kv_splits} if _INFO_SPLIT_CAP else {}
        info = aiter.get_mla_metadata_info_v1(
            batch, max_seqlen_q, heads, q_dtype, kv_dtype, False,
            fast_mode=setting["fast_mode"], num_kv_splits=num_kv_splits,
            intra_batch_mode=setting["intra_batch_mode"], **split_cap)
        (self.work_meta_data, self.work_indptr, self.work_info_set, self.reduce_indptr,
         self.reduce_final_map, self.reduce_partial_map) = [
            torch.empty(shape, dtype=dtype, device=device) for shape, dtype in info]
        partials = self.reduce_partial_map.size(0) * max_seqlen_q
        self.partial_output = torch.empty(partials, 1, heads, V_HEAD_DIM,
                                          dtype=torch.float32, device=device)
        self.partial_lse = torch.empty(partials, 1, heads, 1, dtype=torch.float32,
                                       device=device)

    def fill(self, qo_indptr, kv_page_indptr, kv_last_page_lens, max_seqlen_q, page_size,
             num_kv_splits, q_dtype, kv_dtype):
        """Write the plan for the lengths these indptrs hold (a GPU op, no sync)."""
        dtype_q, dtype_kv = _METADATA_DTYPES
        aiter.get_mla_metadata_v1(
            qo_indptr, kv_page_indptr, kv_last_page_lens, self.heads // NUM_KV_HEADS,
            NUM_KV_HEADS, self.setting["is_causal"], self.work_meta_data, self.work_info_set,
            self.work_indptr, self.reduce_indptr, self.reduce_final_map, self.reduce_partial_map,
            page_size=page_size, kv_granularity=max(page_size, 16), max_seqlen_qo=max_seqlen_q,
            uni_seqlen_qo=max_seqlen_q, fast_mode=self.setting["fast_mode"],
            max_split_per_batch=num_kv_splits, intra_batch_mode=self.setting["intra_batch_mode"],
            **{dtype_q: q_dtype, dtype_kv: kv_dtype})


def persistent_plan(qo_indptr, kv_page_indptr, kv_last_page_lens, batch, total_kv, kv_seq_len,
                    uniform, max_seqlen_q, page_size, num_kv_splits, q_dtype, kv_dtype, device):
    """The plan for this call. A plan is only right for the KV lengths it was built from, and only
    the shapes can vouch for those without a sync: with uniform lengths the key holds kv_seq_len
    and the plan is filled once; otherwise (page size 1 only) the cached buffers are refilled on
    every call from this call's indptrs. The key decides plan_setting too."""
    key = (batch, total_kv, kv_seq_len if uniform else None, max_seqlen_q, page_size,
           num_kv_splits, q_dtype, kv_dtype, device)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = PersistentPlan(batch, max_seqlen_q, num_kv_splits, q_dtype,
                                            kv_dtype, device,
                                            plan_setting(page_size, uniform, kv_seq_len))
    elif uniform:
        return plan
    plan.fill(qo_indptr, kv_page_indptr, kv_last_page_lens, max_seqlen_q, page_size,
              num_kv_splits, q_dtype, kv_dtype)
    return plan


def aiter_bf16_route(q, kv_data, qo_indptr, kv_indptr, config):
    """bf16 q over the bf16 cache through mla_decode_fwd, page size 1; aiter picks the splits."""
    kv = _contiguous_kv("aiter_bf16", 'kv_data["bf16"]', kv_data["bf16"])
    batch, total_kv = qo_indptr.shape[0] - 1, kv.shape[0]
    tables = page_tables(batch, total_kv, kv_seq_len=None, page_size=1, device=q.device)
    out = torch.empty(q.shape[0], NUM_HEADS, V_HEAD_DIM, dtype=torch.bfloat16, device=q.device)
    mla_decode_fwd(q, kv.view(total_kv, 1, NUM_KV_HEADS, QK_HEAD_DIM), out, qo_indptr, kv_indptr,
                   tables.kv_page_ids, tables.kv_last_page_lens, config["q_seq_len"],
                   page_size=1, nhead_kv=NUM_KV_HEADS, sm_scale=SM_SCALE)
    return out


def aiter_fp8_route(q, kv_data, qo_indptr, kv_indptr, config, q_scale="tensor"):
    """fp8 q over the fp8 cache through mla_decode_fwd, page size 1, ONE split per batch: with
    fp8 q and one split, stage 1 writes the output itself (no reduce launch)."""
    kv, kv_scale = kv_data["fp8"]
    kv = _contiguous_kv("aiter_fp8", 'kv_data["fp8"]', kv)
    batch, total_kv = qo_indptr.shape[0] - 1, kv.shape[0]
    tables = page_tables(batch, total_kv, kv_seq_len=None, page_size=1, device=q.device)
    q_fp8, q_scale_tensor = quantize_q_fp8(q, kv.dtype, q_scale)
    out = torch.empty(q.shape[0], NUM_HEADS, V_HEAD_DIM, dtype=torch.bfloat16, device=q.device)
    mla_decode_fwd(q_fp8, kv.view(total_kv, 1, NUM_KV_HEADS, QK_HEAD_DIM), out, qo_indptr,
                   kv_indptr, tables.kv_page_ids, tables.kv_last_page_lens, config["q_seq_len"],
                   page_size=1, nhead_kv=NUM_KV_HEADS, sm_scale=SM_SCALE, num_kv_splits=1,
                   num_kv_splits_indptr=tables.one_split_indptr, q_scale=q_scale_tensor,
                   kv_scale=kv_scale)
    return out


def persistent_decode(route, q, q_scale, kv_data, qo_indptr, kv_indptr, config, page_size,
                      num_splits):
    """q (fp8 with its float32 scale, or bf16 with None) over the fp8 KV seen as (pages,
    page_size, 1, 576): aiter's persistent stage 1 over the cached work plan (at most num_splits
    splits per batch), then mla_reduce_v1 merging the splits into a fresh bf16 output. aiter
    picks the kernel from q's and the KV's dtypes (csrc/py_itfs_cu/asm_mla.cu); the plan is
    filled for the same pair. page_size > 1 needs uniform KV lengths that are a multiple of it
    (ValueError naming the route otherwise: select_route never picks such a row)."""
    kv, kv_scale = kv_data["fp8"]
    kv = _contiguous_kv(route, 'kv_data["fp8"]', kv)
    batch, total_kv = qo_indptr.shape[0] - 1, kv.shape[0]
    kv_seq_len, max_seqlen_q = config["kv_seq_len"], config["q_seq_len"]
    uniform = declares_uniform_kv(batch, total_kv, config)
    if page_size != 1 and not (page_size > 1 and uniform and kv_seq_len % page_size == 0):
        raise ValueError(f"{route}: page_size {page_size} needs uniform KV lengths "
                         f"that are a multiple of it (batch {batch}, total_kv {total_kv}, "
                         f'config["kv_seq_len"] {kv_seq_len})')
    tables = page_tables(batch, total_kv, kv_seq_len, page_size, q.device)
    kv_page_indptr = kv_indptr if page_size == 1 else tables.kv_page_indptr
    plan = persistent_plan(qo_indptr, kv_page_indptr, tables.kv_last_page_lens, batch, total_kv,
                           kv_seq_len, uniform, max_seqlen_q, page_size, num_splits,
                           q.dtype, kv.dtype, q.device)
    out = torch.empty(q.shape[0], NUM_HEADS, V_HEAD_DIM, dtype=torch.bfloat16, device=q.device)
    # values in STAGE1_PARAMETERS / REDUCE_PARAMETERS order; *_ORDER keeps what this aiter takes
    _stage1(*_STAGE1_ORDER((
        q, kv.view(total_kv // page_size, page_size, NUM_KV_HEADS, QK_HEAD_DIM), qo_indptr,
        kv_page_indptr, tables.kv_page_ids, tables.kv_last_page_lens, None, plan.work_meta_data,
        plan.work_indptr, plan.work_info_set, max_seqlen_q, page_size, NUM_KV_HEADS, SM_SCALE,
        plan.partial_output, plan.partial_lse, out, None, q_scale, kv_scale)))
    _reduce(*_REDUCE_ORDER((
        plan.partial_output, plan.partial_lse, plan.reduce_indptr, plan.reduce_final_map,
        plan.reduce_partial_map, max_seqlen_q, num_splits, out, None)))
    return out


def aiter_a8w8_persistent_route(q, kv_data, qo_indptr, kv_indptr, config, page_size=1,
                                num_splits=16, q_scale="tensor"):
    """fp8 q (by q_scale) over the fp8 KV: persistent_decode with aiter's a8w8 kernel."""
    q_fp8, q_scale_tensor = quantize_q_fp8(q, kv_data["fp8"][0].dtype, q_scale)
    return persistent_decode("aiter_a8w8_persistent", q_fp8, q_scale_tensor, kv_data, qo_indptr,
                             kv_indptr, config, page_size, num_splits)


def aiter_a16w8_persistent_route(q, kv_data, qo_indptr, kv_indptr, config, page_size=1,
                                 num_splits=16):
    """bf16 q as given over the fp8 KV: persistent_decode with aiter's a16w8 kernel
    (mla_a16w8_qh16_m16x4_n16x1_coex0_mask1_ps, aiter f3be04a12, gfx950). No q quantisation
    launch and no q rounding; the KV's scale goes in as kv_scale (the kernel reads it through
    its address, so it must be passed), q_scale stays None (aiter reads it for fp8 q only).
    aiter pads the q length (1 here) to the kernel's 4 itself; plan and partials are sized for
    the real q length, as aiter's mla_decode_fwd sizes them."""
    return persistent_decode("aiter_a16w8_persistent", q, None, kv_data, qo_indptr, kv_indptr,
                             config, page_size, num_splits)


# ---------------------------------------------------------------------------------------------
# The serving API on aiter. SERVING_ROUTE_TABLE's aiter rows say which
# plan shapes these serve; every other shape stays on the portable Triton kernel. What they rely
# on in aiter's source (ROCm/aiter f3be04a12 and e4048607a; docs/api.md, "What serves a call"):
# - the 16-head q-length-1 decode kernels of gfx950 have no paged build (hsa/gfx950/mla/
#   mla_asm.csv), so the cache goes to aiter as pages of ONE token: kv_indices lists the cache
#   rows block * page_size + slot of every attended token (any page size served exactly);
# - lse is a natural log everywhere in aiter (its stage 2 combines split lse with tl.exp,
#   mla_reduce_v1 with expf / logf): no conversion. The non-persistent mla_decode_fwd returns
#   stage 1's own lse when fp8 q runs one split (every aiter); its Triton stage 2 writes the
#   merged lse only from c849fd5845 (2026-04-16) on, with return_lse=True (f3be04a12 returns an
#   unwritten torch.empty): "decode_lse" in AITER_SERVING_CAPABILITIES; and only where it merges:
#   with one split for the whole batch (num_kv_splits_indptr[bs] == bs) at any head count but 8 and
#   16 its copy-only branch copies stage 1's output and writes no lse (aiter/mla.py at e4048607a,
#   lines 618-621, 230-246, 274-278), and non-persistent stage 1 runs no lse build (asm_mla.cu 998),
#   so aiter_serving_bf16 passes a split count of at least 2;
# - a request without tokens has no defined result in aiter's kernels (0 / 0), and aiter checks
#   no block ids: both are settled here on the GPU after the call (aiter_serving_fix), no sync.
# The persistent a8w8 path (metadata, stage 1 over the work plan, mla_reduce_v1) is served where
# stage 1 takes an `lse` that its lse builds write for the requests whose work is one partial
# (the reduce writes the split ones': final_lse): not at f3be04a12 (no such parameter; the reduce
# skips groups of one partial), from ff61bb3997 on. Not a16w8: no lse build at any
# version.
# ---------------------------------------------------------------------------------------------


def aiter_capabilities(stage1_names, reduce_names):
    """What an aiter whose stage 1 and mla_reduce_v1 take these parameter names can do beyond
    calling its functions, as far as its API tells (a frozenset of names SERVING_ROUTE_TABLE's
    "needs" use). All need mla_reduce_v1's num_kv_splits (ff61bb3997, 2026-06-11), the first API
    change after the kernels they rely on that this file can read; an aiter between is treated as
    without (Triton serves):
    - "decode_lse": the non-persistent mla_decode_fwd's stage 2 writes the merged lse
      (c849fd5845, 2026-04-16); "fp8_8_heads": its fp8 8-head q-length-1 kernel
      (mla_a8w8_qh8_qseqlen1_gqaratio8_v3, 78dad4ca34, 2026-05-06; absent at f3be04a12);
    - "persistent_lse": stage 1 takes `lse` too, and its persistent fp8 q-length-1 kernels at 16,
      64 and 128 heads have lse builds (ce27de0132 2026-03-26 for 16; all three at ff61bb3997);
    - "persistent_lse_32_heads": stage 1 also takes valid_split_count (c2f68ab382, 2026-06-26):
      the 32-head one's lse build is there (9d0d5e7c77, 2026-06-22).
    Which head counts each route serves: SERVING_ROUTE_TABLE's "heads"."""
    if "num_kv_splits" not in reduce_names:
        return frozenset()
    names = {"decode_lse", "fp8_8_heads"}
    if "lse" in stage1_names:
        names.add("persistent_lse")
        if "valid_split_count" in stage1_names:
            names.add("persistent_lse_32_heads")
    return frozenset(names)


AITER_SERVING_CAPABILITIES = (aiter_capabilities(_STAGE1_NAMES, AITER_API["mla_reduce_v1"])
                              if HAVE_AITER else frozenset())


class AiterServingBuffers:
    """A plan's fixed buffers for aiter's CSR form of its block table (int32 on the plan's
    device), allocated by its first call and rewritten by every call, so that a captured graph
    keeps pointing at them: qo_indptr = arange(batch + 1) (one query row per request, and
    mla_decode_fwd's split indptr for one split per request: the same values), kv_indptr (batch
    + 1), kv_indices (batch x capacity entries, capacity = max_blocks x page_size; entries past
    kv_indptr[-1] hold 0, a row that exists), kv_last_page_lens (ones: pages of one token),
    positions = arange(batch x capacity), and a float32 (1,) k_scale for a Python-float scale.
    The persistent route adds its work plan (PersistentPlan) and its (batch, heads) float32 lse
    at its first call (`persistent`, `final_lse`; None before), the bf16 route its split indptr
    (`split_indptr`; None before)."""
    __slots__ = ("capacity", "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_lens",
                 "positions", "k_scale", "persistent", "final_lse", "split_indptr")

    def __init__(self, batch, capacity, device):
        int32 = {"dtype": torch.int32, "device": device}
        self.capacity = capacity
        self.qo_indptr = torch.arange(batch + 1, **int32)
        self.kv_indptr = torch.zeros(batch + 1, **int32)
        self.kv_indices = torch.zeros(batch * capacity, **int32)
        self.kv_last_page_lens = torch.ones(batch, **int32)
        self.positions = torch.arange(batch * capacity, **int32)
        self.k_scale = torch.ones(1, dtype=torch.float32, device=device)
        self.persistent = self.final_lse = self.split_indptr = None


def aiter_serving_csr(buffers, block_table, cache_seqlens, num_blocks, page_size, min_length=0):
    """Write this call's CSR into `buffers` on the GPU (fixed shapes, no host sync) and return
    (kv_indices view of batch x capacity entries, bad, empty): bad (batch,) bool marks a request
    whose length is negative or past its block table's capacity, or whose USED block ids leave
    [0, num_blocks); empty marks a request of length 0. Lengths are clamped to [0, capacity] and
    a bad block id's tokens point at row 0, so aiter reads nothing outside the cache; block-table
    entries past a request's used blocks are never read. min_length 1: a request shorter than
    that still gets one entry (row 0) for routes whose plan needs KV in every request; its
    result is aiter_serving_fix's."""
    batch, max_blocks = block_table.shape
    capacity = max_blocks * page_size
    lengths = cache_seqlens.clamp(0, capacity)
    ends = buffers.kv_indptr[1:]
    torch.cumsum(lengths.clamp(min=min_length), 0, dtype=torch.int32, out=ends)
    # entry j of kv_indices: token j - kv_indptr[owner] of request owner
    positions = buffers.positions[:batch * capacity]
    owner = torch.searchsorted(ends, positions, right=True, out_int32=True).clamp_(max=batch - 1)
    token = positions - buffers.kv_indptr[owner]
    column = torch.div(token, page_size, rounding_mode="floor").clamp_(0, max_blocks - 1)
    block = block_table[owner, column]
    valid = (token < lengths[owner]) & (block >= 0) & (block < num_blocks)
    kv_indices = buffers.kv_indices[:batch * capacity]
    kv_indices.copy_(torch.where(valid, block * page_size + token % page_size, 0))
    used_blocks = torch.div(lengths + (page_size - 1), page_size, rounding_mode="floor")
    in_use = buffers.positions[:max_blocks].unsqueeze(0) < used_blocks.unsqueeze(1)
    bad_block = (in_use & ((block_table < 0) | (block_table >= num_blocks))).any(dim=1)
    bad = bad_block | (cache_seqlens < 0) | (cache_seqlens > capacity)
    return kv_indices, bad, cache_seqlens == 0


def aiter_serving_fix(out, lse, bad, empty):
    """The API's semantics where aiter has none, in place on the fresh out (batch, 1, heads, 512)
    and lse (batch, heads, 1): a request of length 0 gets out 0 and lse +inf, a bad one NaN."""
    out.masked_fill_(empty.view(-1, 1, 1, 1), 0.0)
    lse.masked_fill_(empty.view(-1, 1, 1), math.inf)
    out.masked_fill_(bad.view(-1, 1, 1, 1), math.nan)
    lse.masked_fill_(bad.view(-1, 1, 1), math.nan)


def aiter_serving_fp8(q_rows, kv_rows, out_rows, csr, kv_indices, softmax_scale, kv_scale):
    """fp8 cache: mla_decode_fwd with fp8 q (the runner's per-tensor quantiser) and ONE split per
    request, so that stage 1 writes the output and its own lse (what aiter returns there on every
    version); the non-persistent fp8 kernel of the head count (mla_a8w8_qh16_qseqlen1_gqaratio16,
    mla_a8w8_qh128_m32x4_n16x2_msk1, mla_a8w8_qh8_qseqlen1_gqaratio8_v3), no reduce launch.
    Returns the (total_q, heads) lse."""
    q_fp8, q_scale = quantize_q_fp8(q_rows, kv_rows.dtype, "tensor")
    _, lse = mla_decode_fwd(q_fp8, kv_rows, out_rows, csr.qo_indptr, csr.kv_indptr, kv_indices,
                            csr.kv_last_page_lens, 1, page_size=1, nhead_kv=NUM_KV_HEADS,
                            sm_scale=softmax_scale, num_kv_splits=1,
                            num_kv_splits_indptr=csr.qo_indptr, q_scale=q_scale,
                            kv_scale=kv_scale)
    return lse.view(q_rows.shape[0], q_rows.shape[1])


def aiter_serving_bf16(q_rows, kv_rows, out_rows, csr, kv_indices, softmax_scale, kv_scale):
    """bf16 cache: mla_decode_fwd with bf16 q as given (aiter's non-persistent a16w16 kernel of
    the head count: mla_dec_stage1_bf16_a16w16_subQ16_mqa16, mla_a16w16_qh64_qseqlen1_gqaratio64_v3,
    mla_dec_stage1_bf16_a16w16_subQ128_mqa128; not 8 / 32 heads, whose one-split shortcut returns
    an lse no kernel writes), return_lse=True for stage 2's merged lse ("decode_lse"). The split
    count is this file's, passed with its indptr (aiter then runs it as given: aiter/mla.py lines
    594-597 at e4048607a): one (request, split) per CU, within the 1..16 aiter's own choice takes
    (lines 305-343), and at least 2, so that stage 2 merges and writes the lse at every head count
    (with one split it writes none at 64 and 128 heads, and aiter's own choice is one split for
    large batches)."""
    del kv_scale
    rows = q_rows.shape[0]
    cus = SERVING_CPU_PROGRAMS if q_rows.device.type == "cpu" else sm_count(q_rows.device)
    splits = max(2, min(16, triton.cdiv(cus, rows)))
    if csr.split_indptr is None:  # arange(0, (rows + 1) * splits, splits): aiter's own form
        csr.split_indptr = csr.qo_indptr * splits
    _, lse = mla_decode_fwd(q_rows, kv_rows, out_rows, csr.qo_indptr, csr.kv_indptr, kv_indices,
                            csr.kv_last_page_lens, 1, page_size=1, nhead_kv=NUM_KV_HEADS,
                            sm_scale=softmax_scale, num_kv_splits=splits,
                            num_kv_splits_indptr=csr.split_indptr, return_lse=True)
    return lse


def aiter_serving_a8w8_persistent(q_rows, kv_rows, out_rows, csr, kv_indices, softmax_scale,
                                  kv_scale, num_splits=16):
    """fp8 cache: aiter's persistent a8w8 path, the calls persistent_decode makes, with an lse for
    every request. fp8 q (the runner's per-tensor quantiser); get_mla_metadata_v1's balanced plan
    (fast mode, at most num_splits splits per request) of this call's CSR, computed on the GPU
    into the plan's fixed buffers (sized once by batch and heads, rewritten every call); stage 1
    over that plan, given the plan's lse buffer as `lse`: its lse build writes the output and lse
    of each request whose work is one partial; mla_reduce_v1 merges the split ones into out and
    final_lse, num_kv_splits in its place. Kernels (asm_mla.cu's remap at e4048607a): 16 heads
    mla_a8w8_qh16_qseqlen1_gqaratio16_lse_ps, 32 ..._qh32_qseqlen1_gqaratio32_lse_ps, 64 the
    16-head q-length-4 lse kernel (the 64-head q-length-1 one before 2026-08-10), 128 the 32-head
    q-length-4 one. Returns the (rows, heads) lse: the plan's buffer (the caller copies it)."""
    rows, heads = q_rows.shape[:2]
    q_fp8, q_scale = quantize_q_fp8(q_rows, kv_rows.dtype, "tensor")
    if csr.persistent is None:
        csr.persistent = PersistentPlan(rows, 1, num_splits, q_fp8.dtype, kv_rows.dtype,
                                        q_rows.device, BALANCED_PLAN, heads)
        csr.final_lse = torch.empty(rows, heads, dtype=torch.float32, device=q_rows.device)
    plan = csr.persistent
    plan.fill(csr.qo_indptr, csr.kv_indptr, csr.kv_last_page_lens, 1, 1, num_splits, q_fp8.dtype,
              kv_rows.dtype)
    # values in STAGE1_PARAMETERS / REDUCE_PARAMETERS order; *_ORDER keeps what this aiter takes
    _stage1(*_STAGE1_ORDER((
        q_fp8, kv_rows, csr.qo_indptr, csr.kv_indptr, kv_indices, csr.kv_last_page_lens, None,
        plan.work_meta_data, plan.work_indptr, plan.work_info_set, 1, 1, NUM_KV_HEADS,
        softmax_scale, plan.partial_output, plan.partial_lse, out_rows, csr.final_lse, q_scale,
        kv_scale)))
    _reduce(*_REDUCE_ORDER((
        plan.partial_output, plan.partial_lse, plan.reduce_indptr, plan.reduce_final_map,
        plan.reduce_partial_map, 1, num_splits, out_rows, csr.final_lse)))
    return csr.final_lse


AITER_SERVING_ROUTES = {"aiter_serving_fp8": aiter_serving_fp8,
                        "aiter_serving_bf16": aiter_serving_bf16,
                        "aiter_serving_a8w8_persistent": aiter_serving_a8w8_persistent}
# Routes whose work plan needs KV in every request: aiter's metadata and stage 1 give a request
# without tokens no defined result, so the CSR gives it one entry (row 0); aiter_serving_fix then
# writes its out 0 / lse +inf.
AITER_SERVING_MIN_LENGTH = {"aiter_serving_a8w8_persistent": 1}


def aiter_serving_call(plan, q, k_cache, block_table, cache_seqlens, softmax_scale, k_scale):
    """One mla_decode_with_kvcache call on the plan's aiter route (inputs already checked):
    the CSR into the plan's buffers, the route (with its row's params), then aiter_serving_fix.
    Fresh out and lse."""
    batch, s_q, heads, _ = q.shape
    num_blocks, page_size = k_cache.shape[:2]
    capacity = block_table.shape[1] * page_size
    if plan.aiter is None or plan.aiter.capacity < capacity:  # a wider block table: new buffers
        plan.aiter = AiterServingBuffers(batch, capacity, q.device)
    csr = plan.aiter
    if not k_cache.is_contiguous():
        raise ValueError(f"k_cache has strides {tuple(k_cache.stride())}: the aiter route "
                         f"({plan.route['route']}) reads it as contiguous rows; pass .contiguous()")
    route = plan.route["route"]
    kv_indices, bad, empty = aiter_serving_csr(csr, block_table, cache_seqlens, num_blocks,
                                               page_size, AITER_SERVING_MIN_LENGTH.get(route, 0))
    if isinstance(k_scale, torch.Tensor):
        kv_scale = k_scale.view(1)
    elif k_scale is not None:  # a Python float: into the plan's tensor (a GPU fill, no sync)
        kv_scale = csr.k_scale.fill_(k_scale)
    else:
        kv_scale = None
    out = torch.empty(batch, s_q, heads, V_HEAD_DIM, dtype=torch.bfloat16, device=q.device)
    rows = batch * s_q
    lse = AITER_SERVING_ROUTES[route](
        q.reshape(rows, heads, QK_HEAD_DIM).contiguous(),
        k_cache.view(num_blocks * page_size, 1, NUM_KV_HEADS, QK_HEAD_DIM),
        out.view(rows, heads, V_HEAD_DIM), csr, kv_indices,
        SM_SCALE if softmax_scale is None else float(softmax_scale), kv_scale,
        **plan.route["params"])
    lse = lse.reshape(batch, s_q, heads).transpose(1, 2).clone()  # the API's (batch, heads, s_q)
    aiter_serving_fix(out, lse, bad, empty)
    return out, lse


# =============================================================================================
# Route registry: the routes that exist here, what each reads, how a configuration is named
# =============================================================================================
ROUTES = {
    "triton_fp8": triton_fp8_route,
    "triton_mxfp4": triton_mxfp4_route,
}
if HOPPER:  # the Hopper route exists only on sm_90 with Gluon; elsewhere its table rows are skipped
    ROUTES["hopper_fp8"] = hopper_fp8_route
if HAVE_AITER:  # the aiter routes exist only where aiter imported with an API this file knows
    ROUTES.update({
        "aiter_bf16": aiter_bf16_route,
        "aiter_fp8": aiter_fp8_route,
        "aiter_a8w8_persistent": aiter_a8w8_persistent_route,
        "aiter_a16w8_persistent": aiter_a16w8_persistent_route,
    })
TRITON_COMPILE_PLANS = {"triton_fp8": triton_fp8_compile_plan, "triton_mxfp4": triton_mxfp4_compile_plan,
                        "hopper_fp8": hopper_fp8_compile_plan, "hopper_paged": hopper_paged_compile_plan,
                        "triton_paged": triton_paged_compile_plan, "triton_sparse": triton_sparse_compile_plan,
                        "hopper_sparse": hopper_sparse_compile_plan}


SERVING_ROUTES = ({"triton_paged", "triton_sparse"} | ({"hopper_paged", "hopper_sparse"} if HOPPER else set())  # here
                  | (set(AITER_SERVING_ROUTES) if HAVE_AITER else set()))
# What each route reads and how it is judged, for every route name a table may hold:
#   kv_format: the kv_data entry it reads; q_format: how it rounds q before Q.K ("fp8": to fp8,
#       "bf16": kept), or q_format_param (parameter, {value: format}) where a parameter decides;
#   rel_l2_bound: the strict bound on its relative L2 error against float64 attention over the bf16
#       cache on the runner's randn data (eval.py --strict, the GPU tests). fp8 q with the fp8
#       cache is the reference's own arithmetic: 0.06 sits above its error at every shape; bf16 q
#       with the fp8 cache errs less (0.05); the mxfp4 format alone costs 6-15% (0.2);
#   kernel_params: the parameters that pick the compiled kernel (the race does not start a
#       candidate again in a later row when a candidate with the same route and these values
#       died, hung or raised; aiter's kernels are chosen by dtypes, so only the page size counts);
#   portable False: absent off its hardware, so a table row with it is followed by a portable row
#       for the same shapes (tune.py writes one).
ROUTE_INFO = {
    "triton_fp8": {"kv_format": "fp8", "q_format": "fp8", "rel_l2_bound": 0.06,
                   "kernel_params": ("num_splits", "block_n", "num_warps", "num_stages")},
    "hopper_fp8": {"kv_format": "fp8", "q_format": "fp8", "rel_l2_bound": 0.06, "portable": False,
                   "kernel_params": ("num_splits", "num_warps", "num_stages")},
    "triton_mxfp4": {"kv_format": "mxfp4", "q_format": "bf16", "q_format_param": ("qk_dot_scaled", {"e4m3": "fp8"}),
                     "rel_l2_bound": 0.2,
                     "kernel_params": ("num_splits", "block_n", "num_warps", "num_stages", "qk_dot_scaled")},
    "aiter_bf16": {"kv_format": "bf16", "q_format": "bf16", "rel_l2_bound": 0.01, "kernel_params": ()},
    "aiter_fp8": {"kv_format": "fp8", "q_format": "fp8", "rel_l2_bound": 0.06, "kernel_params": ()},
    "aiter_a8w8_persistent": {"kv_format": "fp8", "q_format": "fp8", "rel_l2_bound": 0.06,
                              "kernel_params": ("page_size",)},
    "aiter_a16w8_persistent": {"kv_format": "fp8", "q_format": "bf16", "rel_l2_bound": 0.05,
                               "kernel_params": ("page_size",)},
}


def route_label(candidate, short=False):
    """How a configuration ({"route", "params"}) is named everywhere (LAST_ROUTE, race lines,
    tune.py, the tools): '<route> <params as compact JSON>'; short: '<route> s<num_splits>'."""
    params = candidate["params"]
    if short:
        return candidate["route"] + (f" s{params['num_splits']}" if "num_splits" in params else "")
    return f'{candidate["route"]} {json.dumps(params, separators=(",", ":"))}'


def parse_route_label(text):
    """The candidate a full route_label names."""
    route, _, params = text.strip().partition(" ")
    return {"route": route, "params": json.loads(params) if params else {}}


def candidate_kernel(candidate):
    """What identifies the compiled kernel a candidate runs: its route and the values (defaults
    filled in) of the route's kernel_params."""
    route = candidate["route"]
    names = ROUTE_INFO.get(route, {}).get("kernel_params")
    params = candidate["params"]
    if names is None or route not in ROUTES:
        return route, json.dumps(params, sort_keys=True)
    values = dict(keyword_defaults(ROUTES[route]), **params)
    return route, json.dumps({name: values.get(name) for name in names}, sort_keys=True)


def run_candidate(candidate, data, total_kv):
    """The candidate's route on data (as check_inputs returns it), its KV format checked first."""
    check_kv_format(data[1], ROUTE_INFO[candidate["route"]]["kv_format"], total_kv, data[0].device)
    return ROUTES[candidate["route"]](*data, **candidate["params"])


# =============================================================================================
# The serving API's plan and launches (mla_decode_with_kvcache's plan -> launch)
# =============================================================================================


def _prepare_call(plan, shape, q, k_cache, block_table, softmax_scale):
    """How the calls of one checked signature run: the plan filled by its first call (or held to
    that call's shape), then a function of a call's (q, k_cache, block_table, cache_seqlens,
    k_scale), or of the sparse form's (q, k_cache, indices, topk_length, None), that launches the
    plan's route and returns fresh (out, lse). A cache TMA cannot read
    (its blocks apart, a property of the signature) goes to the portable route's plan."""
    capacity = 0 if block_table is None else block_table.shape[1] * shape.page_size  # the sparse form has none
    if plan.shape is None:
        _fill_plan(plan, shape, q.device, capacity)
    elif plan.shape != shape:
        raise ValueError(f"plan was filled for (batch, s_q, h_q, page_size, kv, causal) = {tuple(plan.shape)}, "
                         f"this call is {tuple(shape)}: use one plan per shape")
    if shape.kv == "fp8_sparse":
        return _sparse_call(plan, SM_SCALE if softmax_scale is None else softmax_scale)
    if plan.kernel is None:  # aiter's route (MI355X)
        def run_aiter(q, k_cache, block_table, cache_seqlens, k_scale):
            return aiter_serving_call(plan, q, k_cache, block_table, cache_seqlens, softmax_scale, k_scale)
        return run_aiter
    target = plan
    if plan.route["route"] == "hopper_paged" and not tma_can_read(k_cache):
        if plan.fallback is None:
            plan.fallback = MlaDecodePlan()
            _fill_plan(plan.fallback, shape, q.device, capacity, tma_readable=False)
        target = plan.fallback
    return _kernel_call(target, SM_SCALE if softmax_scale is None else softmax_scale)


def _fill_plan(plan, shape, device, capacity, tma_readable=True):
    """Fix the plan's shape, route (serving_route), kernel, split count and workspace on its first
    call: float32 partials and lse per (row group, partial slot), and counters (the portable
    kernel's tickets, zero between its calls; or each request's first partial slot and split count,
    written by the Hopper kernel for _mla_combine_kernel). The Hopper sparse kernel's slots: a
    program's and a unit's at most (program + unit); one word stands in for an absent topk_length."""
    if plan.num_splits is not None and (isinstance(plan.num_splits, bool) or not isinstance(plan.num_splits, int)
                                        or not 1 <= plan.num_splits <= 65535):
        raise ValueError(f"plan.num_splits is {plan.num_splits!r}: None or a count from 1 to 65535")
    route = serving_route(shape, device, capacity, tma_readable, plan.num_splits)
    plan.shape, plan.route, plan.kernel, plan.spans = shape, route.row, route.kernel, route.spans
    if route.kernel is None:  # aiter's: its buffers come with its first call
        return
    plan.num_splits = route.num_splits
    rows = route_rows(route.row)
    groups = triton.cdiv(shape.s_q * shape.h_q, rows)
    if route.row["route"] in SPARSE_ROUTES:  # each query token's head groups apart
        groups = shape.s_q * triton.cdiv(shape.h_q, rows)
    if route.row["route"] == "hopper_paged":
        slots = groups * (plan.num_splits + shape.batch)  # work items: at most a chunk count plus one per request
        counters = 2 * shape.batch
    elif route.row["route"] == "hopper_sparse":  # a partial slot per program and unit at most, where units are cut
        units, tiles = shape.batch * groups, triton.cdiv(shape.topk, route.row["params"]["block_n"])
        slots = plan.num_splits + units if sparse_pieces(units, tiles, plan.num_splits) > 1 else 1
        counters = 1
    else:
        slots = shape.batch * groups * plan.num_splits if plan.num_splits > 1 else 1
        counters = shape.batch * groups
    plan.workspace = (torch.empty(slots, V_HEAD_DIM, rows, dtype=torch.float32, device=device),
                      torch.empty(slots, rows, dtype=torch.float32, device=device),
                      torch.zeros(counters, dtype=torch.int32, device=device))


def _kernel_call(plan, sm_scale):
    """A checked signature's calls on a kernel route: fresh out and lse, then the route's launch
    (SERVING_LAUNCHES); from the second call on, Triton's launcher directly (the scalars recorded
    for the signature, k_scale's value where it is a float), wherever every pointer is 16-byte
    aligned as when it was recorded and no launch hook is installed."""
    direct = None

    def run(q, k_cache, block_table, cache_seqlens, k_scale):
        nonlocal direct
        if q.stride(3) != 1:
            q = q.contiguous()
        batch, s_q, h_q, _ = q.shape
        out = torch.empty(batch, s_q, h_q, V_HEAD_DIM, dtype=torch.bfloat16, device=q.device)
        lse = torch.empty(batch, h_q, s_q, dtype=torch.float32, device=q.device)
        scale_ptr = k_scale.data_ptr() if isinstance(k_scale, torch.Tensor) else 0
        misaligned = (q.data_ptr() | k_cache.data_ptr() | block_table.data_ptr() | cache_seqlens.data_ptr()
                      | scale_ptr) & 15
        if direct is not None and not misaligned and not _launch_hooks_installed():
            direct(q, k_cache, block_table, cache_seqlens, k_scale, out, lse)
        else:
            launched = SERVING_LAUNCHES[plan.route["route"]](plan, q, k_cache, block_table, cache_seqlens, k_scale,
                                                             out, lse, sm_scale)
            direct = None if misaligned else launched
        return out, lse
    return run


def _with_k_scale(scalars, k_scale):
    """A signature's recorded launch scalars with this call's k_scale where it is a Python float
    (the second scalar: kv_scale_value); a tensor k_scale is read by the kernel."""
    if k_scale is None or isinstance(k_scale, torch.Tensor):
        return scalars
    return (scalars[0], float(k_scale), *scalars[2:])


def _portable_launch(plan, q, k_cache, block_table, cache_seqlens, k_scale, out, lse, sm_scale):
    """_mla_decode_kernel over the pages: launch it for this call; return how the calls of this
    signature launch it (_kernel_call), or None."""
    shape, params = plan.shape, plan.route["params"]
    constexprs = {"FP8_MAX": FP8_MAX.get(k_cache.dtype, 0.0), "NUM_SPLITS": plan.num_splits,
                  "BLOCK_N": params["block_n"], "KV_FP8": shape.kv == "fp8", "PAGE_SIZE": shape.page_size,
                  "CAUSAL": shape.causal and shape.s_q > 1, "WRITE_LSE": True, "ROWS": SERVING_ROWS,
                  "KV_SCALE_IN_TENSOR": isinstance(k_scale, torch.Tensor)}
    tensors, scalars = decode_launch_args(
        q, (q.stride(0), q.stride(1), q.stride(2)), k_cache, 1.0 if k_scale is None else k_scale, out,
        (out.stride(0), out.stride(1), out.stride(2)), lse, (lse.stride(0), lse.stride(1), lse.stride(2)),
        plan.workspace, None, (cache_seqlens, block_table, shape.page_size), sm_scale)
    entry = launch(_mla_decode_kernel, (shape.batch, plan.num_splits, triton.cdiv(shape.s_q * shape.h_q, SERVING_ROWS)),
                   tensors,
                   scalars, constexprs, params["num_warps"], params["num_stages"], floats=DECODE_FLOATS)
    if entry is None or not all(t.data_ptr() % 16 == 0 for t in tensors):
        return None
    run_compiled, constexpr_values = entry
    workspace = plan.workspace

    def run(q, k_cache, block_table, cache_seqlens, k_scale, out, lse):
        run_compiled(*decode_tensors(q, k_cache, k_scale, out, lse, workspace, None, cache_seqlens, block_table),
                     *_with_k_scale(scalars, k_scale), *constexpr_values)
    return run


def _hopper_paged_tensors(q, descriptors, k_scale, cache_seqlens, block_table, out, lse, workspace):
    """The tensor arguments of the Hopper serving kernels, in their order:
    `descriptors` the cache's two TMA descriptors, or the cache itself for the gathered kernel (the
    workspace's tickets stand in for KV_SCALE where k_scale is a float or absent)."""
    partial_o, partial_lse, tickets = workspace
    return (q, *descriptors, k_scale if isinstance(k_scale, torch.Tensor) else tickets, cache_seqlens, block_table,
            out, lse, partial_o, partial_lse, tickets)


def _hopper_launch(plan, q, k_cache, block_table, cache_seqlens, k_scale, out, lse, sm_scale):
    """The plan's Hopper kernel over the pages (serving_route's choice: TMA descriptors of the cache
    as blocks x page rows, or the cache itself and its row stride for the gathered kernel), then
    _mla_combine_kernel: launch them for this call; return how the calls of this signature launch
    them, or None."""
    shape, params = plan.shape, plan.route["params"]
    batch, page_size = shape.batch, shape.page_size
    rows = route_rows(plan.route)
    groups = triton.cdiv(shape.s_q * shape.h_q, rows)
    workspace = plan.workspace
    kernel = plan.kernel
    gather = kernel is _mla_decode_gathered_hopper_kernel
    constexprs = {"FP8_MAX": FP8_MAX[torch.float8_e4m3fn], "PAGE_SIZE": page_size, **hopper_row_constexprs(params),
                  "CAUSAL": shape.causal and shape.s_q > 1, "KV_SCALE_IN_TENSOR": isinstance(k_scale, torch.Tensor),
                  "BATCH_BLOCK": max(32, triton.next_power_of_2(batch)), "MAX_SPLITS": SERVING_MAX_SPLITS,
                  "KV_FP8": shape.kv == "fp8", "SPANS": plan.spans}
    scalars = _with_k_scale((
        sm_scale * LOG2E, 1.0, k_cache.shape[0] * page_size, k_cache.shape[0], block_table.shape[1] * page_size,
        batch, plan.num_splits, params["min_chunk"], shape.h_q, shape.s_q, (q.stride(0), q.stride(1), q.stride(2)),
        block_table.stride(0), (out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
                                lse.stride(2)), *((k_cache.stride(1),) if gather else ())), k_scale)

    def cache_args(k_cache):  # the gathered kernel reads the cache; the TMA one its two descriptors
        return (k_cache,) if gather else kv_descriptors(k_cache, True, params.get("block_n", 64))
    descriptors = [k_cache.data_ptr(), *cache_args(k_cache)]  # the last cache's, rebuilt when it moves
    entry = launch(kernel, (groups, plan.num_splits + batch),
                   _hopper_paged_tensors(q, descriptors[1:], k_scale, cache_seqlens, block_table, out, lse, workspace),
                   scalars, constexprs, params["num_warps"], 1, floats=DECODE_FLOATS)
    combine = _combine_launch(plan, rows, groups, k_scale, out, lse)
    if entry is None or combine is None:
        return None
    run_compiled, constexpr_values = entry

    def run(q, k_cache, block_table, cache_seqlens, k_scale, out, lse):
        if k_cache.data_ptr() != descriptors[0]:
            descriptors[:] = [k_cache.data_ptr(), *cache_args(k_cache)]
        run_compiled(*_hopper_paged_tensors(q, descriptors[1:], k_scale, cache_seqlens, block_table, out, lse,
                                            workspace), *_with_k_scale(scalars, k_scale), *constexpr_values)
        combine(k_scale, out, lse)
    return run


COMBINE_DIMS = 32  # latent dims per program of _mla_combine_kernel: one pass of its merge at 16 rows


def _combine_constexprs(rows, kv_scale_in_tensor):
    """_mla_combine_kernel's constexprs after a Hopper kernel of `rows` query rows (8 warps past 16
    rows, so that a pass holds 16 dims of 64 rows)."""
    return {"NUM_HEADS": rows, "MAX_SPLITS": SERVING_MAX_SPLITS, "DIMS": COMBINE_DIMS,
            "WARPS": 4 if rows <= 16 else 8, "KV_SCALE_IN_TENSOR": kv_scale_in_tensor}


def _combine_launch(plan, rows, groups, k_scale, out, lse):
    """_mla_combine_kernel after the Hopper kernel of `rows` query rows a program in `groups` row
    groups, on the plan's workspace: launch it for this call; return how the calls of this
    signature launch it (a function of k_scale, out and lse), or None."""
    shape = plan.shape
    partial_o, partial_lse, counts = plan.workspace
    constexprs = _combine_constexprs(rows, isinstance(k_scale, torch.Tensor))
    scalars = (plan.num_splits + shape.batch, shape.h_q, shape.s_q, out.stride(0), out.stride(1), out.stride(2),
               lse.stride(0), lse.stride(1), lse.stride(2))

    def tensors(k_scale, out, lse):  # the split counts stand in for KV_SCALE where k_scale is a float or absent
        return partial_o, partial_lse, counts, k_scale if isinstance(k_scale, torch.Tensor) else counts, out, lse

    def scale(k_scale):
        return 1.0 if k_scale is None or isinstance(k_scale, torch.Tensor) else float(k_scale)
    entry = launch(_mla_combine_kernel, (shape.batch, groups, V_HEAD_DIM // COMBINE_DIMS), tensors(k_scale, out, lse),
                   (scale(k_scale), *scalars), constexprs, constexprs["WARPS"], 1)
    if entry is None:
        return None
    run_compiled, constexpr_values = entry

    def run(k_scale, out, lse):
        run_compiled(*tensors(k_scale, out, lse), scale(k_scale), *scalars, *constexpr_values)
    return run


SERVING_LAUNCHES = {"triton_paged": _portable_launch, "hopper_paged": _hopper_launch}


def _sparse_call(plan, sm_scale):
    """The sparse form's calls on a plan: fresh out and lse, then the plan's sparse kernel
    (launch()'s own direct path from the second call of a shape on)."""
    def run(q, k_cache, indices, topk_length, _):
        if q.stride(3) != 1:
            q = q.contiguous()
        batch, s_q, h_q, _ = q.shape
        out = torch.empty(batch, s_q, h_q, V_HEAD_DIM, dtype=torch.bfloat16, device=q.device)
        lse = torch.empty(batch, h_q, s_q, dtype=torch.float32, device=q.device)
        _sparse_launch(plan, q, k_cache, indices, topk_length, out, lse, sm_scale)
        return out, lse
    return run


def _sparse_launch(plan, q, k_cache, indices, topk_length, out, lse, sm_scale):
    """The plan's sparse kernel for one call on the plan's workspace, the cache's bytes seen as fp8,
    float32 and bf16 (its tokens' latent values, scales and rope values): _mla_sparse_kernel on
    grid (query tokens of the batch, splits, head groups); or _mla_sparse_hopper_kernel on the
    plan's program count, then _mla_sparse_combine_kernel where that cuts a unit."""
    shape, params = plan.shape, plan.route["params"]
    partial_o, partial_lse, tickets = plan.workspace
    cache = k_cache.select(2, 0)  # (num_blocks, page, 656): the head dimension's stride plays no part
    tensors = (q, cache.view(torch.float8_e4m3fn), cache.view(torch.float32), cache.view(torch.bfloat16), indices,
               tickets if topk_length is None else topk_length, out, lse, partial_o, partial_lse)
    strides = (q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), indices.stride(0), indices.stride(1),
               out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), lse.stride(2))
    capacity = k_cache.shape[0] * shape.page_size
    groups = triton.cdiv(shape.h_q, params["rows"])
    if plan.kernel is _mla_sparse_hopper_kernel:  # its stages are its bf16 tiles, not the pipeliner's
        units = shape.batch * shape.s_q * groups
        constexprs = {"BLOCK_N": params["block_n"], "HAS_TOPK_LENGTH": topk_length is not None,
                      "STAGES": params["num_stages"], "WARPS": params["num_warps"], "PAGE_SIZE": shape.page_size}
        launch(_mla_sparse_hopper_kernel, (plan.num_splits,), tensors,
               (sm_scale * LOG2E, capacity, units, groups, shape.h_q, shape.s_q, shape.topk, *strides), constexprs,
               params["num_warps"], 1)
        if sparse_pieces(units, triton.cdiv(shape.topk, params["block_n"]), plan.num_splits) > 1:
            merge = {"GROUPS": groups, "BLOCK_N": params["block_n"], "MAX_PIECES": SPARSE_MAX_PIECES,
                     "DIMS": SPARSE_COMBINE_DIMS, "WARPS": 4}
            launch(_mla_sparse_combine_kernel, (units, V_HEAD_DIM // SPARSE_COMBINE_DIMS),
                   (partial_o, partial_lse, out, lse),
                   (units, plan.num_splits, shape.h_q, shape.s_q, shape.topk, *strides[6:]), merge, merge["WARPS"], 1)
    else:
        constexprs = {"NUM_SPLITS": plan.num_splits, "BLOCK_N": params["block_n"], "ROWS": params["rows"],
                      "HAS_TOPK_LENGTH": topk_length is not None}
        launch(_mla_sparse_kernel, (shape.batch * shape.s_q, plan.num_splits, groups), (*tensors, tickets),
               (sm_scale * LOG2E, capacity, shape.page_size, shape.h_q, shape.s_q, shape.topk, *strides), constexprs,
               params["num_warps"], params["num_stages"])


# =============================================================================================
# Candidate race (the first racing call of a job): an optional layer over the router
# A route-table row may list "candidates" ({"route", "params"} each) besides its own route and
# params, which are its first candidate. A row races when its bounds are a shape (batch ==
# max_batch, kv_len == max_kv_len, uniform lengths: the leaderboard's shapes) and select_route
# picks it for that shape. tune.py chooses by this same policy (run_measuring, rank_row).
#
# Measuring. On the first call in a job of any racing shape, every racing row of the active
# table is measured at once, each candidate in a SEPARATE process (this file under
# sys.executable, which reads the job on its standard input): no candidate that has not yet run
# cleanly on this machine runs in the caller's process, so a GPU fault or a hang costs that
# candidate, not the run. That process makes inputs of each shape like the runner's generator
# (randn q and bf16 cache, the fp8 and mxfp4 caches quantised from it), and per candidate: runs
# it once and judges it (race_judge, below), warms it with RACE_WARMUP_CALLS more untimed calls,
# times RACE_REPEATS calls the way the runner does (a flush larger than L2 plus the last-level
# cache before each, events around one call) and ranks it by the median (one slow repeat cannot
# move it; a wide spread is timed once more). It reports each candidate as it starts and ends;
# when the process dies or a candidate outlives RACE_CANDIDATE_LIMIT_S, the caller names that
# candidate, drops it and goes on with the rest in a new process. A candidate whose kernel
# (candidate_kernel) died, hung or raised is not started again in a later row. The fastest
# survivor is kept unless it beats the row's first candidate by less than RACE_MARGIN.
#
# Once per job. The choices (never outputs) go to a file under the temporary directory, keyed by
# this file's bytes, the racing rows, the device and the torch / Triton / aiter versions: the
# runner's later steps of the same job (each a new process) read it and race nothing. A damaged
# or foreign file is ignored. RACE_JOB_BUDGET_S bounds the measuring, process starts and compiles
# included; a row none of whose candidates was reached keeps its first candidate.
#
# Judging (race_judge): float32 attention over the bf16 cache of RACE_TRUTH_ROWS batch rows is
# the truth; the same attention with q and the cache in the candidate's own formats (ROUTE_INFO
# q_format, kv_format) measures what those formats alone cost on this very data (its reach). A
# candidate passes when its error is within RACE_BOUND_FACTOR x reach + RACE_BOUND_FLOOR and
# below RACE_ERROR_CEILING: sharper data widens the bound only as far as the format's own error,
# and zeros, every 2nd token or one token per page stay far outside it.
#
# Using the choices. custom_kernel runs a racing shape's measured candidates in their rank order
# on the call's own data and returns the first output that passes race_judge; that candidate is
# then the shape's route for the process. A candidate that started and did not end cleanly in a
# measuring process is never ranked, so never runs here. When none passes, the table's catch-all
# serves that call only and the shape is judged again on its next calls, RACE_CALL_CHECKS calls in
# all (then the catch-all stays). Without a GPU nothing is measured: every row runs its first
# candidate.
# Output (stderr): one line per raced row first, compact, always printed; then one line per
# failing candidate with its whole reason, while the process's RACE_OUTPUT_BYTES last.
# tools/freeze_race_log.py freezes those lines into fixed rows. RACE = False switches all of this off.
# =============================================================================================
RACE = True  # False: no race, no measuring process, no file; every row runs its own route
RACE_REPEATS = 15  # timed calls per candidate
RACE_WARMUP_CALLS = 2  # untimed calls after the judged one (compiles, workspaces, plans)
RACE_SPREAD = 0.25  # (75th - 25th percentile) / median above which a candidate is timed again, once
RACE_MARGIN = 0.03  # a candidate displaces the row's first one only when at least 3% faster
RACE_JOB_BUDGET_S = 90.0  # all racing rows, process starts and compiles included
RACE_CANDIDATE_LIMIT_S = 20.0  # one candidate in the measuring process, its compile included
RACE_START_LIMIT_S = 60.0  # the measuring process's imports, or one row's inputs and truth
RACE_FLUSH_BYTES = 512 * 1024 * 1024  # > L2 + last-level cache (MI355X: 32 + 256 MiB; H200: 50 MiB)
RACE_FLUSH_PASSES = 4  # GPU work queued ahead of each timed call, so that its host time hides, as the runner's does
RUNNER_FLUSH_SHAPE = (16000, 1024, 1024)  # flush "runner": the runner's float32 randn before each timed call
RACE_TRUTH_ROWS = 4  # batch rows judged against the truth, spread over the batch
RACE_BOUND_FACTOR = 1.25  # x the error the candidate's formats alone make on the same rows ...
RACE_BOUND_FLOOR = 0.02  # ... plus this (the kernel's own rounding: bf16 P and output)
RACE_ERROR_CEILING = 0.5  # never within bound above this (zeros are at 1.0), whatever the data
RACE_CALL_CHECKS = 3  # calls a shape's measured candidates may all fail before the catch-all stays
RACE_OUTPUT_BYTES = 3584  # stderr bytes of race lines per process (the service keeps the first 16 KB)
RACE_SEED = 2026  # the measuring process's inputs
RACE_CHILD_ENV = "MLA_RACE_CHILD"  # set in the measuring process's environment
RACE_LINE = "submission.py race"  # how the stderr lines start (tools/freeze_race_log.py reads them)
RACE_FAILURES = ("died", "hung", "raised")  # what ends a kernel's race for the rest of the job
race_clock = time.perf_counter  # seconds: the clock of the job budget
race_timer = None  # (candidate, fn, repeats, flush) -> [us per call]; None: events on the GPU. Tests inject their own.
race_command = None  # argv of the measuring process; None: this file under sys.executable
race_cache_dir = None  # where a job's choices are kept; None: tempfile.gettempdir()
_RACE_FLUSH = {}  # device -> the flush buffer, allocated once
_RACE_JOB = {}  # id(table) -> (table, {shape: RowOutcome}): the choices this process uses
_RACE_PRINTED = [0, False]  # bytes of race lines this process has printed; whether the cut was said


def race_candidates(row):
    """The row's candidates in order: its own route and params first."""
    return [{"route": row["route"], "params": row["params"]}, *row.get("candidates", ())]


def race_row_hash(row):
    """Six hex digits naming a row's candidates: a race line names the row it raced by them."""
    return hashlib.sha256(json.dumps(race_candidates(row), sort_keys=True).encode()).hexdigest()[:6]


def failure_mark(result, shape):
    """The mark "died@BxK" (hung@, raised@) when `result` is a failure of its own at `shape` that
    ends its kernel's race for the rest of the job (RACE_FAILURES), else None (timed, judged
    wrong, or a mark carried over from another row)."""
    why = result.get("why", "")
    kind = why.split(" ")[0]
    return f"{kind}@{shape[0]}x{shape[1]}" if kind in RACE_FAILURES and "@" not in why else None


def race_measurable():
    """Whether candidates can be measured here: a measuring command given (tests), or a GPU and
    this file on disk to run as the measuring process."""
    this_file = globals().get("__file__")
    return race_command is not None or (torch.cuda.is_available() and bool(this_file) and os.path.isfile(this_file))


def races_here(row, batch, kv_len, uniform):
    return (RACE and bool(row.get("candidates")) and uniform
            and (batch, kv_len) == (row["max_batch"], row["max_kv_len"]) and race_measurable())


def racing_rows(table):
    """{(batch, kv_len): row} of the rows of `table` that race, in table order."""
    rows = {}
    for row in table:
        shape = (row["max_batch"], row["max_kv_len"])
        if None not in shape and races_here(row, *shape, True) and select_route(*shape, True, table) is row:
            rows[shape] = row
    return rows


def _race_print(text, essential=False):
    """One race line on stderr. Essential lines (a row's outcome, a check) always print; the
    others while this process's share of the output lasts."""
    size = len(text.encode()) + 1
    if essential or _RACE_PRINTED[0] + size <= RACE_OUTPUT_BYTES:
        print(text, file=sys.stderr, flush=True)
        _RACE_PRINTED[0] += size
    elif not _RACE_PRINTED[1]:
        _RACE_PRINTED[1] = True
        print(f"{RACE_LINE}: further lines cut ({RACE_OUTPUT_BYTES} bytes a process)", file=sys.stderr, flush=True)


def race_q_format(candidate):
    """How the candidate rounds q before Q.K: ROUTE_INFO's q_format, or what q_format_param maps
    the candidate's parameter (or the route's default for it) to."""
    info = ROUTE_INFO[candidate["route"]]
    param, formats = info.get("q_format_param", (None, {}))
    value = candidate["params"].get(param, keyword_defaults(ROUTES[candidate["route"]]).get(param)) if param else None
    return formats.get(value, info["q_format"])


# --- judging ---------------------------------------------------------------------------------
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 magnitude codes 0..7; bit 3 is the sign


def dequantize_mxfp4(packed, scales):
    """(n, 288) packed e2m1 bytes (even dims in the low nibble) and (n, 18) e8m0 bytes -> float32 (n, 576)."""
    packed = packed.to(torch.int32)
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], QK_HEAD_DIM)
    values = torch.tensor(E2M1_VALUES, device=packed.device)[codes & 7]
    values = torch.where(codes >= 8, -values, values)
    block_scale = torch.exp2(scales.to(torch.float32) - 127.0)
    return (values.reshape(-1, MXFP4_SCALES_PER_ROW, 32) * block_scale[:, :, None]).reshape(-1, QK_HEAD_DIM)


def quantize_mxfp4(kv):
    """(n, 1, 576) bf16 -> ((n, 1, 288) uint8 packed e2m1, (ceil(n / 256) * 256, 24) uint8 e8m0 scales),
    the leaderboard's layout: per block of 32 dims the smallest power-of-two scale that brings the
    block's largest magnitude to 6 or less, values rounded to the nearest e2m1 value. For the
    measuring process's inputs only (the race judges against whatever cache it is given)."""
    n = kv.shape[0]
    packed = torch.empty(n, 1, MXFP4_ROW_BYTES, dtype=torch.uint8, device=kv.device)
    scales = torch.zeros(-(-n // 256) * 256, 24, dtype=torch.uint8, device=kv.device)  # padding 0, as the runner
    midpoints = torch.tensor([(a + b) / 2 for a, b in itertools.pairwise(E2M1_VALUES)], device=kv.device)
    for begin in range(0, n, 1 << 16):  # chunks of rows: float32 temporaries stay small
        x = kv[begin:begin + (1 << 16), 0].float().reshape(-1, MXFP4_SCALES_PER_ROW, 32)
        amax = x.abs().amax(dim=-1, keepdim=True).clamp(min=2.0 ** -120)
        exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
        scaled = x * torch.exp2(-exponent)
        codes = torch.bucketize(scaled.abs(), midpoints) + 8 * (scaled < 0)
        codes = codes.reshape(x.shape[0], QK_HEAD_DIM).to(torch.uint8)
        packed[begin:begin + x.shape[0], 0] = codes[:, 0::2] | (codes[:, 1::2] << 4)
        scales[begin:begin + x.shape[0], :MXFP4_SCALES_PER_ROW] = (exponent[..., 0] + 127).to(torch.uint8)
    return packed, scales


def fp8_dtype_of(kv_data):
    """The fp8 dtype of the call's fp8 cache (float8_e4m3fn when it has none)."""
    entry = kv_data.get("fp8")
    dtype = getattr(entry[0], "dtype", None) if isinstance(entry, (tuple, list)) and entry else None
    return dtype if dtype in FP8_DTYPES else torch.float8_e4m3fn


class RaceTruth:
    """Float32 attention of RACE_TRUTH_ROWS batch rows over every token of theirs, from bf16 q and
    the bf16 cache (the truth), and per (q format, KV format) the same attention from q and the
    cache rounded to those formats: what the formats alone cost on this data (the reach).
    Reads the indptrs (a GPU->host sync: the first calls of a racing shape only)."""

    def __init__(self, data):
        q, self.kv_data, qo_indptr, kv_indptr, _ = data
        batch = kv_indptr.shape[0] - 1
        batch_rows = sorted({(batch - 1) * i // max(RACE_TRUTH_ROWS - 1, 1) for i in range(RACE_TRUTH_ROWS)})
        q_starts, kv_bounds = qo_indptr.tolist(), kv_indptr.tolist()
        self.rows = [q_starts[b] for b in batch_rows]
        self.segments = [(kv_bounds[b], kv_bounds[b + 1]) for b in batch_rows]
        self.q = q
        self.exact = self._attend("bf16", "bf16")
        self._reach = {}

    def _q_rows(self, q_format):
        q = self.q
        if q_format == "bf16":
            return q[self.rows].float()
        # fp8 per tensor, the runner's quantiser: amax, scale and quotient in bf16
        fp8 = fp8_dtype_of(self.kv_data)
        scale = fp8_tensor_scale(q, fp8)
        return (q[self.rows] / scale).to(fp8).float() * scale.float()

    def _kv_rows(self, kv_format, begin, end):
        if kv_format == "bf16":
            return self.kv_data["bf16"][begin:end, 0].float()
        if kv_format == "fp8":
            data, scale = self.kv_data["fp8"]
            return data[begin:end, 0].float() * scale.float()
        packed, scales = self.kv_data["mxfp4"]
        return dequantize_mxfp4(packed.view(torch.uint8)[begin:end, 0],
                                scales.view(torch.uint8)[begin:end, :MXFP4_SCALES_PER_ROW])

    def _attend(self, q_format, kv_format):
        out = []
        for q_row, (begin, end) in zip(self._q_rows(q_format), self.segments, strict=True):
            k = self._kv_rows(kv_format, begin, end)
            out.append(torch.softmax(q_row @ k.T * SM_SCALE, dim=-1) @ k[:, :V_HEAD_DIM])
        return torch.stack(out)

    def _distance(self, rows_out):
        return float((rows_out - self.exact).norm() / self.exact.norm())

    def error(self, out):
        """Relative L2 distance of out's truth rows from the truth (NaN for non-finite output)."""
        return self._distance(out[self.rows].float())

    def bound(self, q_format, kv_format):
        """RACE_BOUND_FACTOR x the reach of these formats + RACE_BOUND_FLOOR, at most RACE_ERROR_CEILING."""
        key = (q_format, kv_format)
        if key not in self._reach:
            self._reach[key] = self._distance(self._attend(q_format, kv_format))
        return min(RACE_BOUND_FACTOR * self._reach[key] + RACE_BOUND_FLOOR, RACE_ERROR_CEILING)


def race_judge(truth, candidate, out):
    """None when out is within the candidate's bound on truth's rows, else why not (short)."""
    error = truth.error(out)
    bound = truth.bound(race_q_format(candidate), ROUTE_INFO[candidate["route"]]["kv_format"])
    return None if error <= bound else f"rel {error:.2g}>{bound:.2g}"  # NaN fails too


def _failure(why, detail=None):
    """A candidate's result when it did not pass: a compact code and the whole reason."""
    return {"why": why, "detail": " ".join(str(detail or why).split())[:300]}


def _raised(exc):
    return _failure(f"raised {type(exc).__name__}", f"{type(exc).__name__}: {exc}")


def race_run(candidate, data, total_kv, truth):
    """(output, None) when the candidate runs here and passes race_judge, else (None, _failure)."""
    route = candidate["route"]
    batch = data[3].shape[0] - 1
    if route not in ROUTES or not row_preconditions_hold(candidate, total_kv // batch, True):
        return None, _failure("n/a", f"{route} does not exist here or its preconditions fail")
    try:
        out = run_candidate(candidate, data, total_kv)
        why = race_judge(truth, candidate, out)
    except Exception as exc:  # a candidate that cannot run here is reported, not fatal
        return None, _raised(exc)
    return (None, _failure(why)) if why else (out, None)


# --- the measuring process -------------------------------------------------------------------
def _events_timer(candidate, fn, repeats, flush):
    """us of each of `repeats` calls, each after a flush ("race": RACE_FLUSH_PASSES x
    RACE_FLUSH_BYTES zeroed; "runner": the runner's own randn), events around the call."""
    device = torch.cuda.current_device()
    if flush != "runner" and device not in _RACE_FLUSH:
        _RACE_FLUSH[device] = torch.empty(RACE_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        if flush == "runner":
            torch.randn(RUNNER_FLUSH_SHAPE, device="cuda")
        else:
            for _ in range(RACE_FLUSH_PASSES):
                _RACE_FLUSH[device].zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return times


def _quartiles(times):
    ordered = sorted(times)
    return [ordered[(len(ordered) - 1) * k // 4] for k in (1, 2, 3)]


def race_measure(candidate, inputs, total_kv, options):
    """{"median", "mean", "times"} in us for a candidate that passes race_judge on every
    (data, truth) of `inputs`, else its _failure. Timed on each input in turn, pooled."""
    for data, truth in inputs:
        _, failure = race_run(candidate, data, total_kv, truth)
        if failure:
            return failure
    timer = race_timer or _events_timer
    repeats, flush = options.get("repeats", RACE_REPEATS), options.get("flush", "race")
    calls = [functools.partial(ROUTES[candidate["route"]], *data, **candidate["params"]) for data, _ in inputs]
    try:
        times = []
        for call in calls:
            for _ in range(RACE_WARMUP_CALLS):
                call()
            times += timer(candidate, call, repeats, flush)
        low, median, high = _quartiles(times)
        if high - low > RACE_SPREAD * median:
            for call in calls:
                times += timer(candidate, call, repeats, flush)
    except Exception as exc:
        return _raised(exc)
    return {"median": _quartiles(times)[1], "mean": sum(times) / len(times), "times": times}


def race_inputs(batch, kv_len, kv_formats, fp8_dtype, device, seed=RACE_SEED):
    """Inputs of one shape like the runner's generator: randn q and bf16 cache, the fp8 cache
    quantised per tensor from it (the runner's bf16 arithmetic), the mxfp4 cache when asked."""
    generator = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn((batch, NUM_HEADS, QK_HEAD_DIM), generator=generator, device=device, dtype=torch.bfloat16)
    kv = torch.randn((batch * kv_len, NUM_KV_HEADS, QK_HEAD_DIM), generator=generator, device=device,
                     dtype=torch.bfloat16)
    kv_data = {"bf16": kv}
    if "fp8" in kv_formats:
        scale = fp8_tensor_scale(kv, fp8_dtype)
        kv_data["fp8"] = ((kv / scale).to(fp8_dtype), scale.float().reshape(1))
    if "mxfp4" in kv_formats:
        kv_data["mxfp4"] = quantize_mxfp4(kv)
    indptr = torch.arange(batch + 1, dtype=torch.int32, device=device)
    config = {"batch_size": batch, "num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS,
              "qk_head_dim": QK_HEAD_DIM, "kv_lora_rank": V_HEAD_DIM, "qk_rope_head_dim": ROPE_DIM,
              "v_head_dim": V_HEAD_DIM, "q_seq_len": 1, "kv_seq_len": kv_len, "sm_scale": SM_SCALE}
    return q, kv_data, indptr, indptr * kv_len, config


def _emit(**fields):
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def race_child_main():
    """The measuring process: reads {"rows": [{"shape", "candidates": [[index, candidate], ...]}],
    "fp8_dtype", "options"} on standard input (options: see run_measuring) and reports one JSON
    line per event on standard output: ready; row (inputs being made); start and end of each
    candidate (end: its race_measure result). A candidate whose kernel raised earlier in this
    process is reported without being started. A failure that leaves the GPU unusable is
    reported as fatal and ends the process (exit 3)."""
    job = json.loads(sys.stdin.read())
    fp8_dtype = getattr(torch, job["fp8_dtype"])
    options = job.get("options") or {}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    raised = {}  # candidate_kernel -> (shape, "raised@BxK") of kernels that raised here
    _emit(ready=True)
    for row in job["rows"]:
        batch, kv_len = row["shape"]
        _emit(row=row["shape"])
        kv_formats = {ROUTE_INFO[c["route"]]["kv_format"] for _, c in row["candidates"] if c["route"] in ROUTE_INFO}
        inputs = []
        for seed in options.get("seeds", [RACE_SEED]):
            data = race_inputs(batch, kv_len, kv_formats, fp8_dtype, device, seed)
            inputs.append((data, RaceTruth(data)))
        for index, candidate in row["candidates"]:
            kernel = candidate_kernel(candidate)
            if kernel in raised and raised[kernel][0] != row["shape"]:
                _emit(end=[row["shape"], index], **_failure(raised[kernel][1], "its kernel raised in an earlier row"))
                continue
            _emit(start=[row["shape"], index])
            result = race_measure(candidate, inputs, batch * kv_len, options)
            mark = failure_mark(result, row["shape"])  # here only "raised@": deaths and hangs end the process
            if mark is not None:
                raised.setdefault(kernel, (row["shape"], mark))
            if "why" in result and device == "cuda":
                try:  # a fault that poisons the GPU context fails every later candidate: end here
                    torch.cuda.synchronize()
                except Exception as exc:
                    _emit(fatal="GPU unusable: " + " ".join(str(exc).split())[:200])
                    sys.exit(3)
            _emit(end=[row["shape"], index], **result)
        del inputs


# --- the caller: running measuring processes, keeping the choices ----------------------------
class RowOutcome:
    """One racing row's outcome: ranking (candidate indices to try, best first), results
    ({index: race_measure result}), note (why it was not, or not fully, measured) and the calls
    whose data rejected every ranked candidate so far."""

    def __init__(self, ranking, results=None, note=""):
        self.ranking, self.results, self.note, self.rejections = ranking, results or {}, note, 0


def rank_row(results):
    """Candidate indices by median time, fastest first; the first candidate stays first unless
    beaten by RACE_MARGIN. Only candidates that were timed (ended cleanly) are ranked."""
    timed = sorted((r["median"], i) for i, r in results.items() if "median" in r)
    ranking = [i for _, i in timed]
    if ranking and 0 in results and "median" in results[0] and ranking[0] != 0:
        if results[ranking[0]]["median"] > results[0]["median"] * (1.0 - RACE_MARGIN):
            ranking.remove(0)
            ranking.insert(0, 0)
    return ranking


def race_row_line(table_name, shape, row, outcome):
    """The compact line of a raced row (see the section's banner; tools/freeze_race_log.py reads it)."""
    cells = []
    for index in range(len(race_candidates(row))):
        result = outcome.results.get(index)
        if result is None:
            cells.append(f"[{index + 1}] x not reached")
        elif "median" in result:
            cells.append(f"[{index + 1}] {result['median']:.1f}/{result['mean']:.1f}")
        else:
            cells.append(f"[{index + 1}] x {result['why']}")
    choice = f"[{outcome.ranking[0] + 1}]" if outcome.ranking else "catch-all"
    return (f"{RACE_LINE} {table_name} bs={shape[0]} kv={shape[1]} #{race_row_hash(row)}: " + " | ".join(cells)
            + f" -> {choice}" + (f"; {outcome.note}" if outcome.note else ""))


def race_detail_lines(shape, row, outcome, catch_all):
    """The chosen configuration and each failing candidate's whole reason, one line each."""
    candidates = race_candidates(row)
    chosen = candidates[outcome.ranking[0]] if outcome.ranking else catch_all
    lines = [f"{RACE_LINE} chose bs={shape[0]} kv={shape[1]}: {route_label(chosen)}"]
    for index, result in sorted(outcome.results.items()):
        if "detail" in result and result["detail"] != result["why"]:
            lines.append(f"{RACE_LINE} why bs={shape[0]} kv={shape[1]} [{index + 1}]: {result['detail']}")
    return lines


def _race_key(table_name, rows):
    """What the job's choices depend on: this file, the racing rows, the device, the versions."""
    try:
        with open(__file__, "rb") as source:
            digest = hashlib.sha256(source.read()).hexdigest()
    except OSError:
        digest = None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    rows_text = json.dumps([[list(shape), race_candidates(row)] for shape, row in rows.items()], sort_keys=True)
    return {"file": digest, "table": table_name, "rows": hashlib.sha256(rows_text.encode()).hexdigest(),
            "device": device, "torch": torch.__version__, "triton": triton.__version__,
            "aiter": str(getattr(aiter, "__version__", None)) if HAVE_AITER else None}


def _race_path(key):
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return os.path.join(race_cache_dir or tempfile.gettempdir(), f"mla-race-{name}.json")


def load_choices(key, rows):
    """{shape: RowOutcome} from this job's file, or None when there is none, or it is damaged or
    another job's."""
    try:
        with open(_race_path(key)) as saved:
            record = json.load(saved)
        if record["key"] != key:
            return None
        choices = {}
        for shape, row in rows.items():
            ranking = record["rankings"][f"{shape[0]}x{shape[1]}"]
            count = len(race_candidates(row))
            if not all(isinstance(i, int) and 0 <= i < count for i in ranking):
                return None
            choices[shape] = RowOutcome(ranking)
        return choices
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_choices(key, choices):
    path = _race_path(key)
    record = {"key": key, "rankings": {f"{b}x{k}": row.ranking for (b, k), row in choices.items()}}
    try:
        with open(path + ".tmp", "w") as out:
            json.dump(record, out)
        os.replace(path + ".tmp", path)
    except OSError as exc:
        _race_print(f"{RACE_LINE}: choices not kept for later steps ({type(exc).__name__}: {exc})")


def _reports(proc, deadline, candidate_limit):
    """The measuring process's reports (dicts), as they come, then one last {"gone": how}: "exit"
    (it ended), "hung" (silent for longer than candidate_limit while a candidate runs, or
    RACE_START_LIMIT_S otherwise; "limit" says which) or "budget" (the job's budget ended)."""
    fd, pending, running, since = proc.stdout.fileno(), b"", False, race_clock()
    while True:
        limit = candidate_limit if running else RACE_START_LIMIT_S
        wait = max(min(since + limit, deadline) - race_clock(), 0.01)
        chunk = os.read(fd, 1 << 16) if select.select([fd], [], [], wait)[0] else None
        if race_clock() >= deadline:
            yield {"gone": "budget"}
            return
        if chunk == b"":
            yield {"gone": "exit"}
            return
        if chunk is None:
            if race_clock() >= since + limit:
                yield {"gone": "hung", "limit": limit}
                return
            continue
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue  # not a report (a library printing on standard output)
            if isinstance(event, dict):
                since, running = race_clock(), "start" in event
                yield event


def _death(proc, fatal):
    """How the measuring process ended: ("died SIGSEGV" or "died exit N", the whole reason with the
    process's own explanation when it gave one)."""
    rc = proc.wait()
    if rc < 0:
        try:
            how = signal.Signals(-rc).name
        except ValueError:
            how = f"signal {-rc}"
    else:
        how = f"exit {rc}"
    return f"died {how}", f"died ({how}{': ' + fatal if fatal else ''})"


class _Measuring:
    """The results of one run_measuring: results by (shape, index), and the kernels that failed
    (candidate_kernel -> (shape, "died@BxK" etc.): not started again in a later row)."""

    def __init__(self, job_rows, on_result):
        self.candidates = {(shape, i): c for shape, cands in job_rows for i, c in cands}
        self.results, self.failed, self.on_result = {}, {}, on_result

    def record(self, key, result):
        self.results[key] = result
        mark = failure_mark(result, key[0])
        if mark is not None:
            self.failed.setdefault(candidate_kernel(self.candidates[key]), (key[0], mark))
        if self.on_result is not None:
            self.on_result(key[0], key[1], result)

    def known_failure(self, key):
        """Record the candidate at key as failed, without starting it, when its kernel failed in
        another row."""
        shape, failed = self.failed.get(candidate_kernel(self.candidates[key]), (key[0], None))
        if shape != key[0]:
            self.record(key, _failure(failed, f"its kernel {failed.split('@')[0]} in bs={shape[0]} kv={shape[1]}; "
                                              "not started again"))
        return shape != key[0]

    def rest(self, job_rows):
        """The rows and candidates still to measure (known failures recorded on the way)."""
        rest = []
        for shape, cands in job_rows:
            todo = [(i, c) for i, c in cands if (shape, i) not in self.results and not self.known_failure((shape, i))]
            if todo:
                rest.append((shape, todo))
        return rest


def run_measuring(job_rows, fp8_dtype, deadline, options=None, on_result=None):
    """Measures job_rows ([(shape, [(index, candidate), ...]), ...]) in as many measuring processes
    as it takes: each death or hang ends its candidate's (or row's) measuring, and a new process
    goes on with the rest; a candidate whose kernel failed is not started again.
    options: {"repeats": timed calls per input (RACE_REPEATS), "seeds": inputs to judge and time
    on ([RACE_SEED]), "flush": "race" or "runner", "candidate_limit_s": RACE_CANDIDATE_LIMIT_S}.
    on_result(shape, index, result) is called as each candidate's result is known.
    Returns ({(shape, index): result}, note): note says why measuring stopped before the end
    ("" when it did not)."""
    options = dict(options or {})
    measuring = _Measuring(job_rows, on_result)
    while True:
        rest = measuring.rest(job_rows)
        if not rest:
            return measuring.results, ""
        before = len(measuring.results)
        note = _measuring_process(rest, fp8_dtype, options, measuring, deadline)
        if note:
            measuring.rest(job_rows)  # what is known to fail is said, not left "not reached"
            return measuring.results, note
        if len(measuring.results) == before:  # ended cleanly yet measured nothing more: do not loop
            return measuring.results, "the measuring process ended early"


def _measuring_process(rows, fp8_dtype, options, measuring, deadline):
    """One measuring process over `rows`, its results recorded as candidates end. Returns a note
    when measuring must stop (budget, or no process could start), "" when another may go on."""
    job = json.dumps({"rows": [{"shape": list(shape), "candidates": cands} for shape, cands in rows],
                      "fp8_dtype": str(fp8_dtype).removeprefix("torch."), "options": options}).encode()
    log = tempfile.TemporaryFile()  # its stderr: kept off the caller's output
    try:
        proc = subprocess.Popen(_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                cwd=os.path.dirname(os.path.abspath(__file__)),
                                env=dict(os.environ, **{RACE_CHILD_ENV: "1"}))
    except OSError as exc:
        log.close()
        return f"no process ({type(exc).__name__})"
    try:
        proc.stdin.write(job)
        proc.stdin.close()
    except OSError:
        pass  # it died already: its exit is read below
    try:
        return _apply_reports(proc, rows, options, measuring, deadline)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        log.close()


def _apply_reports(proc, rows, options, measuring, deadline):
    """Applies the measuring process's reports, then what ended it (see _measuring_process)."""
    ready, shape, current, fatal = False, None, None, None
    for event in _reports(proc, deadline, options.get("candidate_limit_s", RACE_CANDIDATE_LIMIT_S)):
        if event.get("ready"):
            ready = True
        elif "row" in event:
            shape, current = tuple(event["row"]), None
        elif "start" in event:
            current = (tuple(event["start"][0]), event["start"][1])
        elif "end" in event:
            measuring.record((tuple(event["end"][0]), event["end"][1]),
                             {k: v for k, v in event.items() if k != "end"})
            current = None
        elif "fatal" in event:
            fatal = event["fatal"]
        elif "gone" in event:
            break
    if proc.poll() is None:
        proc.kill()
    if event["gone"] == "budget":
        if current is not None:
            measuring.record(current, _failure("cut", "the job's budget ended while it ran"))
        return "budget"
    if event["gone"] == "hung":
        why, detail = "hung", f"hung (silent for more than {event['limit']:.0f} s)"
    else:
        why, detail = _death(proc, fatal)
    if not ready:
        return f"no process ({detail})"
    if current is not None:
        measuring.record(current, _failure(why, detail))
    elif shape is not None:  # the row's inputs or truth: no candidate of it can be measured here
        for index, _ in next(cands for s, cands in rows if s == shape):
            if (shape, index) not in measuring.results:
                measuring.record((shape, index), _failure(f"setup {why}", f"making the row's inputs: {detail}"))
    return ""


def _command():
    return race_command or [sys.executable, os.path.abspath(__file__)]


def _table_name(table):
    return "AITER_ROUTE_TABLE" if table is AITER_ROUTE_TABLE else "TRITON_ROUTE_TABLE"


def race_job(table, first_shape, fp8_dtype):
    """{shape: RowOutcome} for every racing row of `table`, once per process: this job's file when
    an earlier process left one, else measured now (first_shape's row first) and kept in the file."""
    entry = _RACE_JOB.get(id(table))
    if entry is not None and entry[0] is table:
        return entry[1]
    rows = racing_rows(table)
    name = _table_name(table)
    key = _race_key(name, rows)
    choices = load_choices(key, rows)
    if choices is not None:
        _race_print(f"{RACE_LINE} {name}: choices of {len(rows)} rows read from {_race_path(key)} "
                    "(measured by an earlier process of this job)", essential=True)
    else:
        shapes = sorted(rows, key=lambda shape: shape != first_shape)
        job_rows = [(shape, list(enumerate(race_candidates(rows[shape])))) for shape in shapes]
        results, note = run_measuring(job_rows, fp8_dtype, race_clock() + RACE_JOB_BUDGET_S)
        choices = {}
        catch_all = {"route": table[-1]["route"], "params": table[-1]["params"]}
        for shape in shapes:
            measured = {i: r for (s, i), r in results.items() if s == shape}
            ranking, row_note = rank_row(measured), note if len(measured) < len(race_candidates(rows[shape])) else ""
            if not ranking and 0 not in measured:  # none of its candidates reached: the first one runs
                ranking, row_note = [0], f"{note or 'not measured'}: not reached, the first candidate runs"
            choices[shape] = RowOutcome(ranking, measured, row_note)
            _race_print(race_row_line(name, shape, rows[shape], choices[shape]), essential=True)
        for shape in shapes:
            for line in race_detail_lines(shape, rows[shape], choices[shape], catch_all):
                _race_print(line)
        if results:
            save_choices(key, choices)
    _RACE_JOB[id(table)] = (table, choices)
    return choices


def _settle(key, selection, candidate):
    """Keep `candidate` as the route of the shape at `key` for the process."""
    _SELECTED[key] = Selection(selection.row, candidate, selection.table)
    return _SELECTED[key]


def race_call(key, selection, data, batch, total_kv):
    """A call of a racing shape before its route is settled: the job's measured candidates
    (race_job) are run in rank order on this call's data and the first that race_judge passes is
    returned and kept; when none passes, the catch-all serves this call (see the banner)."""
    row, table = selection.row, selection.table
    shape, candidates = (batch, total_kv // batch), race_candidates(row)
    try:
        check_kv_format(data[1], "bf16", total_kv, data[0].device)  # the truth is computed from it
    except ValueError as exc:
        _race_print(f"{RACE_LINE} skipped bs={batch} kv={shape[1]}: {exc}; the first candidate runs", essential=True)
        return _run(_settle(key, selection, candidates[0]).candidate, data, total_kv)

    def check_line(then):
        _race_print(f"{RACE_LINE} check {_table_name(table)} bs={batch} kv={shape[1]}: "
                    f"{' | '.join(rejected)} on this call's data -> {then}", essential=True)

    outcome = race_job(table, shape, fp8_dtype_of(data[1]))[shape]
    truth, rejected = RaceTruth(data), []
    for index in outcome.ranking:
        out, failure = race_run(candidates[index], data, total_kv, truth)
        if out is not None:
            settled = _settle(key, selection, candidates[index])
            _note_ran(settled.candidate, settled.label)
            if rejected:
                check_line(f"[{index + 1}] runs")
            return out
        rejected.append(f"[{index + 1}] x {failure['why']}")
    catch_all = {"route": table[-1]["route"], "params": table[-1]["params"]}
    outcome.rejections += 1
    if not outcome.ranking or outcome.rejections >= RACE_CALL_CHECKS:
        _settle(key, selection, catch_all)
        then = "the catch-all stays"
    else:
        then = (f"the catch-all runs for this call; judged again on the next "
                f"({outcome.rejections} of {RACE_CALL_CHECKS})")
    if rejected:
        check_line(then)
    return _run(catch_all, data, total_kv)


if __name__ == "__main__" and os.environ.get(RACE_CHILD_ENV):  # the race's measuring process
    race_child_main()

"""The machinery of the aiter test double: contract checks, the work-plan format, the mathematics.

Everything runs with torch on the CPU, in float32 like the GPU kernels. The double is strict in two
ways:
- it CHECKS what the real library checks or silently relies on (argument kinds and count, dtypes,
  shapes, buffers allocated as get_mla_metadata_info_v1 described them, scales for fp8 tensors)
  and raises TypeError / ContractError;
- it COMPUTES from what it is given, like the kernels: stage 1 follows the work plan written by
  get_mla_metadata_v1 (page ranges, partial slots), the reduce follows the reduce maps. A caller
  that passes a stale plan, the wrong page maths or the wrong buffers gets wrong numbers.

The plan format is the double's own (the real one is opaque to callers, too):
- work_metadata (4,) int64: [PLAN_MAGIC, number of work items, page_size, kv_granularity];
- work_indptr (NUM_CU + 1,) int32: the work items of each "CU";
- work_info_set (max_works, 8) int32, one row per work item: [batch, partial slot (-1: writes the
  final output directly), q_start, q_end, kv_page_start, kv_page_end (global positions in
  kv_page_indices), split index, 0];
- reduce_indptr (rows + 1,), reduce_final_map (rows, 2) = (q_start, q_end), reduce_partial_map
  (max_works,) = partial slots, -1 where unused. Batches with one split have an empty reduce range.
"""
import collections
import math

import torch

CALLS = collections.Counter()  # calls per API function (tests read it to prove plan reuse)
LOG = []  # (function, dict of facts) per call: page sizes, split counts, generations
NUM_CU = 8
PLAN_MAGIC = 0x6D6C6131
WORK_FIELDS = 8
NUM_HEADS = 16
QK_HEAD_DIM = 576
V_HEAD_DIM = 512
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


class ContractError(RuntimeError):
    """A call the real aiter would reject (or crash on / read out of bounds with)."""


def reset():
    CALLS.clear()
    LOG.clear()


def expect(condition, message):
    if not condition:
        raise ContractError(message)


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


def need_scale(fn, name, scale, data_name, data):
    """fp8 data needs a float32 per-tensor scale of one element; bf16 data takes none."""
    if data.dtype in FP8_DTYPES:
        expect(scale is not None, f"{fn}: fp8 '{data_name}' needs '{name}' (float32, 1 element)")
        need_tensor(fn, name, scale, dtype=torch.float32)
        expect(scale.numel() == 1, f"{fn}: '{name}' must hold 1 element, has {scale.numel()}")
    else:
        need_tensor(fn, name, scale, optional=True)


def dequantize(data, scale):
    x = data.float()
    return x * scale.float().reshape(()) if data.dtype in FP8_DTYPES else x


def check_q_kv(fn, q, kv, page_size, nhead_kv):
    """q (total_q, 16, 576) fp8|bf16; kv (num_pages, page_size, nhead_kv, 576) of the same dtype."""
    need_tensor(fn, "Q", q, dtype=FP8_DTYPES + (torch.bfloat16,), ndim=3)
    expect(tuple(q.shape[1:]) == (NUM_HEADS, QK_HEAD_DIM),
           f"{fn}: 'Q' has shape {tuple(q.shape)}, expected (total_q, {NUM_HEADS}, {QK_HEAD_DIM})")
    need_tensor(fn, "KV", kv, ndim=4)
    expect(kv.dtype == q.dtype,
           f"{fn}: Q is {q.dtype} but KV is {kv.dtype} (the double models a8w8 and a16w16 only)")
    need_int(fn, "page_size", page_size, 1)
    need_int(fn, "nhead_kv", nhead_kv, 1)
    expect(nhead_kv == 1, f"{fn}: nhead_kv = {nhead_kv}, MLA has 1")
    expect(tuple(kv.shape[1:]) == (page_size, nhead_kv, QK_HEAD_DIM),
           f"{fn}: 'KV' has shape {tuple(kv.shape)}, expected (num_pages, page_size={page_size}, "
           f"{nhead_kv}, {QK_HEAD_DIM})")


def check_page_table(fn, batch, kv_indptr, kv_page_indices, kv_last_page_lens, num_pages,
                     page_size):
    need_tensor(fn, "kv_indptr", kv_indptr, dtype=torch.int32, shape=(batch + 1,))
    need_tensor(fn, "kv_page_indices", kv_page_indices, dtype=torch.int32, ndim=1)
    need_tensor(fn, "kv_last_page_lens", kv_last_page_lens, dtype=torch.int32, shape=(batch,))
    pages = kv_indptr.tolist()
    expect(pages[0] == 0 and all(a <= b for a, b in zip(pages, pages[1:])),
           f"{fn}: kv_indptr is not a prefix sum starting at 0")
    expect(pages[-1] <= kv_page_indices.numel(),
           f"{fn}: kv_indptr[-1] = {pages[-1]} pages but kv_page_indices holds "
           f"{kv_page_indices.numel()}")
    if kv_page_indices.numel():
        expect(0 <= int(kv_page_indices.min()) and int(kv_page_indices.max()) < num_pages,
               f"{fn}: kv_page_indices outside [0, {num_pages}): reads outside the KV buffer")
    last = kv_last_page_lens.tolist()
    expect(all(1 <= n <= page_size for n in last),
           f"{fn}: kv_last_page_lens must lie in [1, page_size={page_size}], "
           f"got {sorted(set(last))[:8]}")
    return pages, last


def token_rows(kv_page_indices, page_start, page_end, page_size, last_page_len):
    """KV rows (page * page_size + slot) of pages [page_start, page_end) of kv_page_indices; the
    last page keeps only last_page_len rows (None: all full)."""
    pages = kv_page_indices[page_start:page_end].long()
    rows = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)
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
# Work plan


def metadata_info(batch_size, max_seqlen_qo, num_head_qo, q_dtype, kv_dtype, is_sparse,
                  fast_mode=True, num_kv_splits=32, intra_batch_mode=False):
    fn = "get_mla_metadata_info_v1"
    CALLS[fn] += 1
    need_int(fn, "batch_size", batch_size, 1)
    need_int(fn, "max_seqlen_qo", max_seqlen_qo, 1)
    need_int(fn, "num_head_qo", num_head_qo, 1)
    need_int(fn, "num_kv_splits", num_kv_splits, 1)
    expect(max_seqlen_qo == 1, f"{fn}: the double models decode (max_seqlen_qo 1) only")
    expect(num_head_qo == NUM_HEADS, f"{fn}: num_head_qo = {num_head_qo}, expected {NUM_HEADS}")
    for name, dtype in (("q_dtype", q_dtype), ("kv_dtype", kv_dtype)):
        expect(isinstance(dtype, torch.dtype),
               f"{fn}: '{name}' expects a torch.dtype, got {dtype!r}")
    need_bool(fn, "is_sparse", is_sparse)
    expect(not is_sparse and not intra_batch_mode, f"{fn}: sparse / intra-batch not modelled")
    rows = batch_size * max_seqlen_qo
    max_works = rows * num_kv_splits
    return [
        ((4,), torch.int64),  # work_metadata
        ((NUM_CU + 1,), torch.int32),  # work_indptr
        ((max_works, WORK_FIELDS), torch.int32),  # work_info_set
        ((rows + 1,), torch.int32),  # reduce_indptr
        ((rows, 2), torch.int32),  # reduce_final_map
        ((max_works,), torch.int32),  # reduce_partial_map
    ]


def metadata_fill(seqlens_qo_indptr, seqlens_kv_indptr, kv_last_page_lens, num_heads_per_head_k,
                  num_heads_k, is_causal, work_metadata_ptrs, work_info_set, work_indptr,
                  reduce_indptr, reduce_final_map, reduce_partial_map, page_size=1,
                  kv_granularity=16, max_seqlen_qo=-1, uni_seqlen_qo=-1, fast_mode=True, topk=-1,
                  max_split_per_batch=-1, intra_batch_mode=False, dtype_q=None, dtype_kv=None):
    fn = "get_mla_metadata_v1"
    CALLS[fn] += 1
    need_tensor(fn, "seqlens_qo_indptr", seqlens_qo_indptr, dtype=torch.int32, ndim=1)
    batch = seqlens_qo_indptr.shape[0] - 1
    expect(batch >= 1, f"{fn}: empty batch")
    need_int(fn, "page_size", page_size, 1)
    need_int(fn, "kv_granularity", kv_granularity, 1)
    expect(kv_granularity % page_size == 0,
           f"{fn}: kv_granularity {kv_granularity} is not a multiple of page_size {page_size}")
    need_int(fn, "num_heads_per_head_k", num_heads_per_head_k)
    need_int(fn, "num_heads_k", num_heads_k)
    expect(num_heads_per_head_k == NUM_HEADS and num_heads_k == 1,
           f"{fn}: {num_heads_per_head_k} heads per kv head x {num_heads_k} kv heads, "
           "expected 16 x 1")
    need_bool(fn, "is_causal", is_causal)
    need_int(fn, "max_seqlen_qo", max_seqlen_qo)
    need_int(fn, "uni_seqlen_qo", uni_seqlen_qo)
    max_q = 1 if max_seqlen_qo == -1 else max_seqlen_qo
    expect(max_q == 1, f"{fn}: the double models decode (max_seqlen_qo 1) only")
    expect(topk == -1 and not intra_batch_mode, f"{fn}: sparse / intra-batch not modelled")
    for name, dtype in (("dtype_q", dtype_q), ("dtype_kv", dtype_kv)):
        expect(dtype is None or isinstance(dtype, torch.dtype), f"{fn}: '{name}' = {dtype!r}")

    # The six buffers must be exactly what get_mla_metadata_info_v1 described for this batch.
    rows = batch * max_q
    need_tensor(fn, "work_info_set", work_info_set, dtype=torch.int32, ndim=2)
    max_works = work_info_set.shape[0]
    expect(work_info_set.shape[1] == WORK_FIELDS and max_works % rows == 0 and max_works >= rows,
           f"{fn}: 'work_info_set' {tuple(work_info_set.shape)} is not the info_v1 buffer for "
           f"batch {batch} (argument order: work_info_set BEFORE work_indptr)")
    capacity = max_works // rows  # the num_kv_splits get_mla_metadata_info_v1 was given
    need_tensor(fn, "work_metadata_ptrs", work_metadata_ptrs, dtype=torch.int64, shape=(4,))
    need_tensor(fn, "work_indptr", work_indptr, dtype=torch.int32, shape=(NUM_CU + 1,))
    need_tensor(fn, "reduce_indptr", reduce_indptr, dtype=torch.int32, shape=(rows + 1,))
    need_tensor(fn, "reduce_final_map", reduce_final_map, dtype=torch.int32, shape=(rows, 2))
    need_tensor(fn, "reduce_partial_map", reduce_partial_map, dtype=torch.int32, shape=(max_works,))
    need_int(fn, "max_split_per_batch", max_split_per_batch)
    max_split = capacity if max_split_per_batch == -1 else max_split_per_batch
    expect(1 <= max_split <= capacity,
           f"{fn}: max_split_per_batch {max_split_per_batch} but the buffers hold "
           f"{capacity} splits")

    need_tensor(fn, "seqlens_kv_indptr", seqlens_kv_indptr, dtype=torch.int32, shape=(batch + 1,))
    need_tensor(fn, "kv_last_page_lens", kv_last_page_lens, dtype=torch.int32, shape=(batch,))
    qo = seqlens_qo_indptr.tolist()
    kv = seqlens_kv_indptr.tolist()
    last = kv_last_page_lens.tolist()
    expect(qo[0] == 0 and kv[0] == 0, f"{fn}: indptrs must start at 0")
    gran_pages = kv_granularity // page_size

    items, partial_slots, reduce_ptr, final_rows = [], [], [0], []
    for b in range(batch):
        q_start, q_end = qo[b], qo[b + 1]
        expect(q_end - q_start == max_q, f"{fn}: batch {b} has {q_end - q_start} query rows")
        page_start, page_end = kv[b], kv[b + 1]
        num_pages = page_end - page_start
        expect(num_pages >= 1, f"{fn}: batch {b} has no KV pages")
        expect(1 <= last[b] <= page_size, f"{fn}: kv_last_page_lens[{b}] = {last[b]}")
        granules = -(-num_pages // gran_pages)
        splits = min(max_split, granules)
        bounds = [page_start + min(num_pages, (i * granules // splits) * gran_pages)
                  for i in range(splits)] + [page_end]
        for i in range(splits):
            slot = -1
            if splits > 1:
                slot = len(partial_slots)
                partial_slots.append(slot)
            items.append([b, slot, q_start, q_end, bounds[i], bounds[i + 1], i, 0])
        reduce_ptr.append(len(partial_slots))
        final_rows.append([q_start, q_end])
    expect(len(items) <= max_works, f"{fn}: {len(items)} work items overflow {max_works}")

    work_info_set.fill_(-1)
    work_info_set[: len(items)] = torch.tensor(items, dtype=torch.int32)
    work_indptr.copy_(torch.tensor([c * len(items) // NUM_CU for c in range(NUM_CU + 1)],
                                   dtype=torch.int32))
    reduce_indptr.copy_(torch.tensor(reduce_ptr, dtype=torch.int32))
    reduce_final_map.copy_(torch.tensor(final_rows, dtype=torch.int32))
    reduce_partial_map.fill_(-1)
    if partial_slots:
        reduce_partial_map[: len(partial_slots)] = torch.tensor(partial_slots, dtype=torch.int32)
    work_metadata_ptrs.copy_(torch.tensor([PLAN_MAGIC, len(items), page_size, kv_granularity]))
    LOG.append((fn, {"page_size": page_size, "batch": batch, "max_split": max_split,
                     "items": len(items)}))


# ---------------------------------------------------------------------------------------------
# Persistent stage 1 and the reduce


def stage1(Q, KV, qo_indptr, kv_indptr, kv_page_indices, kv_last_page_lens, num_kv_splits_indptr,
           work_meta_data, work_indptr, work_info_set, max_seqlen_q, page_size, nhead_kv,
           softmax_scale, splitData, splitLse, output, lse, q_scale, kv_scale, generation):
    fn = "mla_decode_stage1_asm_fwd"
    CALLS[fn] += 1
    check_q_kv(fn, Q, KV, page_size, nhead_kv)
    need_scale(fn, "q_scale", q_scale, "Q", Q)
    need_scale(fn, "kv_scale", kv_scale, "KV", KV)
    need_int(fn, "max_seqlen_q", max_seqlen_q, 1)
    expect(max_seqlen_q == 1, f"{fn}: the double models decode (max_seqlen_q 1) only")
    need_float(fn, "softmax_scale", softmax_scale)
    need_tensor(fn, "qo_indptr", qo_indptr, dtype=torch.int32, ndim=1)
    batch = qo_indptr.shape[0] - 1
    pages, last = check_page_table(fn, batch, kv_indptr, kv_page_indices, kv_last_page_lens,
                                   KV.shape[0], page_size)
    need_tensor(fn, "num_kv_splits_indptr", num_kv_splits_indptr, dtype=torch.int32, optional=True)
    if work_meta_data is None:
        raise NotImplementedError(f"{fn}: the double models the persistent mode (work plan) only")
    need_tensor(fn, "work_meta_data", work_meta_data, dtype=torch.int64, shape=(4,))
    need_tensor(fn, "work_indptr", work_indptr, dtype=torch.int32, shape=(NUM_CU + 1,))
    need_tensor(fn, "work_info_set", work_info_set, dtype=torch.int32, ndim=2)
    expect(work_info_set.shape[1] == WORK_FIELDS, f"{fn}: 'work_info_set' is not a plan buffer")
    meta = work_meta_data.tolist()
    expect(meta[0] == PLAN_MAGIC, f"{fn}: work_meta_data was never filled by get_mla_metadata_v1")
    partials = work_info_set.shape[0] * max_seqlen_q  # = reduce_partial_map.size(0) * max_seqlen_q
    need_tensor(fn, "splitData", splitData, dtype=torch.float32,
                shape=(partials, 1, NUM_HEADS, V_HEAD_DIM))
    need_tensor(fn, "splitLse", splitLse, dtype=torch.float32, shape=(partials, 1, NUM_HEADS, 1))
    total_q = Q.shape[0]
    need_tensor(fn, "output", output, dtype=torch.bfloat16, shape=(total_q, NUM_HEADS, V_HEAD_DIM))
    if generation == "2026-03":
        expect(lse is None, "internal: the 2026-03 stage 1 has no lse")
    else:
        need_tensor(fn, "lse", lse, dtype=torch.float32, shape=(total_q, NUM_HEADS), optional=True)
    LOG.append((fn, {"page_size": page_size, "batch": batch, "generation": generation}))

    q = dequantize(Q, q_scale)
    kv_rows = dequantize(KV, kv_scale).reshape(-1, QK_HEAD_DIM)
    info = work_info_set.tolist()
    bounds = work_indptr.tolist()
    for cu in range(NUM_CU):
        for w in range(bounds[cu], bounds[cu + 1]):
            b, slot, q_start, q_end, page_start, page_end = info[w][:6]
            # the batch's last page (as THIS call's page table says) holds last[b] rows
            tail = last[b] if page_end == pages[b + 1] else None
            rows = token_rows(kv_page_indices, page_start, page_end, page_size, tail)
            out, row_lse = attend(q[q_start:q_end].reshape(-1, QK_HEAD_DIM), kv_rows[rows],
                                  softmax_scale)
            if slot < 0:
                rows_out = out.reshape(q_end - q_start, NUM_HEADS, V_HEAD_DIM)
                output[q_start:q_end] = rows_out.to(output.dtype)
                if lse is not None:
                    lse[q_start:q_end] = row_lse.reshape(q_end - q_start, NUM_HEADS)
            else:
                splitData[slot * max_seqlen_q, 0] = out
                splitLse[slot * max_seqlen_q, 0, :, 0] = row_lse


def reduce(partial_output, partial_lse, reduce_indptr, reduce_final_map, reduce_partial_map,
           max_seqlen_q, num_kv_splits, final_output, final_lse, generation):
    fn = "mla_reduce_v1"
    CALLS[fn] += 1
    need_tensor(fn, "partial_output", partial_output, dtype=torch.float32, ndim=4)
    need_tensor(fn, "reduce_partial_map", reduce_partial_map, dtype=torch.int32, ndim=1)
    need_int(fn, "max_seqlen_q", max_seqlen_q, 1)
    partials = reduce_partial_map.shape[0] * max_seqlen_q
    need_tensor(fn, "partial_output", partial_output,
                shape=(partials, 1, NUM_HEADS, V_HEAD_DIM))
    need_tensor(fn, "partial_lse", partial_lse, dtype=torch.float32,
                shape=(partials, 1, NUM_HEADS, 1))
    need_tensor(fn, "reduce_indptr", reduce_indptr, dtype=torch.int32, ndim=1)
    tiles = reduce_indptr.shape[0] - 1
    has_final_map = need_tensor(fn, "reduce_final_map", reduce_final_map, dtype=torch.int32,
                                shape=(tiles, 2), optional=True)
    if generation == "2026-03":
        expect(num_kv_splits is None, "internal: the 2026-03 reduce has no num_kv_splits")
    else:
        need_int(fn, "num_kv_splits", num_kv_splits, 0)
    need_tensor(fn, "final_output", final_output, dtype=torch.bfloat16, ndim=3)
    expect(tuple(final_output.shape[1:]) == (NUM_HEADS, V_HEAD_DIM),
           f"{fn}: 'final_output' has shape {tuple(final_output.shape)}")
    need_tensor(fn, "final_lse", final_lse, dtype=torch.float32,
                shape=(final_output.shape[0], NUM_HEADS), optional=True)
    LOG.append((fn, {"generation": generation, "num_kv_splits": num_kv_splits}))

    ptr = reduce_indptr.tolist()
    final_rows = reduce_final_map.tolist() if has_final_map else [[t, t + 1] for t in range(tiles)]
    for t in range(tiles):
        if ptr[t] == ptr[t + 1]:
            continue  # one split: stage 1 wrote the output itself
        slots = reduce_partial_map[ptr[t]:ptr[t + 1]].long() * max_seqlen_q
        out = combine(partial_output[slots, 0], partial_lse[slots, 0, :, 0])
        q_start, q_end = final_rows[t]
        rows_out = out.reshape(q_end - q_start, NUM_HEADS, V_HEAD_DIM)
        final_output[q_start:q_end] = rows_out.to(final_output.dtype)
        if final_lse is not None:
            final_lse[q_start:q_end] = torch.logsumexp(partial_lse[slots, 0, :, 0], dim=0)


# ---------------------------------------------------------------------------------------------
# Non-persistent mla_decode_fwd


def default_num_kv_splits(batch, total_kv):
    """The double's stand-in for aiter's heuristic (it fills the CUs, capped at 16)."""
    avg = max(1, total_kv // max(1, batch))
    return max(1, min(16, -(-NUM_CU // batch), -(-avg // 64)))


def decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
               page_size, nhead_kv, sm_scale, logit_cap, num_kv_splits, num_kv_splits_indptr,
               work_meta_data, work_indptr, work_info_set, reduce_indptr, reduce_final_map,
               reduce_partial_map, q_scale, kv_scale, intra_batch_mode, return_logits, return_lse):
    fn = "mla_decode_fwd"
    CALLS[fn] += 1
    persistent = (work_meta_data, work_indptr, work_info_set, reduce_indptr, reduce_final_map,
                  reduce_partial_map)
    if any(x is not None for x in persistent):
        raise NotImplementedError(f"{fn}: the double models the non-persistent mode only "
                                  "(the product calls stage 1 and the reduce directly)")
    check_q_kv(fn, q, kv_buffer, page_size, nhead_kv)
    need_scale(fn, "q_scale", q_scale, "q", q)
    need_scale(fn, "kv_scale", kv_scale, "kv_buffer", kv_buffer)
    need_int(fn, "max_seqlen_q", max_seqlen_q, 1)
    expect(max_seqlen_q == 1, f"{fn}: the double models decode (max_seqlen_q 1) only")
    expect(logit_cap == 0.0 and not intra_batch_mode, f"{fn}: logit_cap / intra_batch not modelled")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(QK_HEAD_DIM)
    need_float(fn, "sm_scale", sm_scale)
    total_q = q.shape[0]
    need_tensor(fn, "o", o, dtype=torch.bfloat16, shape=(total_q, NUM_HEADS, V_HEAD_DIM))
    need_tensor(fn, "qo_indptr", qo_indptr, dtype=torch.int32, ndim=1)
    batch = qo_indptr.shape[0] - 1
    pages, last = check_page_table(fn, batch, kv_indptr, kv_indices, kv_last_page_lens,
                                   kv_buffer.shape[0], page_size)
    qo = qo_indptr.tolist()
    expect(qo[-1] == total_q, f"{fn}: qo_indptr[-1] = {qo[-1]} but q has {total_q} rows")

    if num_kv_splits is None or num_kv_splits_indptr is None:
        CALLS[fn + ":derived_splits"] += 1
        num_kv_splits = default_num_kv_splits(batch, kv_buffer.shape[0] * page_size)
    else:
        need_int(fn, "num_kv_splits", num_kv_splits, 1)
        need_tensor(fn, "num_kv_splits_indptr", num_kv_splits_indptr, dtype=torch.int32,
                    shape=(batch + 1,))
        expect(num_kv_splits_indptr.tolist() == [b * num_kv_splits for b in range(batch + 1)],
               f"{fn}: num_kv_splits_indptr must be arange(0, (bs + 1) * n, n), "
               "n = num_kv_splits")
    direct = q.dtype in FP8_DTYPES and num_kv_splits == 1  # stage 1 writes o, no reduce launch
    LOG.append((fn, {"page_size": page_size, "batch": batch, "num_kv_splits": num_kv_splits,
                     "direct": direct}))

    qf = dequantize(q, q_scale)
    kv_rows = dequantize(kv_buffer, kv_scale).reshape(-1, QK_HEAD_DIM)
    logits = torch.zeros(total_q, num_kv_splits, NUM_HEADS, V_HEAD_DIM, dtype=torch.float32)
    lses = torch.full((total_q, num_kv_splits, NUM_HEADS, 1), -math.inf, dtype=torch.float32)
    for b in range(batch):
        rows = token_rows(kv_indices, pages[b], pages[b + 1], page_size, last[b])
        step = -(-rows.numel() // num_kv_splits)
        for split in range(num_kv_splits):
            part = rows[split * step:(split + 1) * step]
            if part.numel() == 0:
                continue
            for t in range(qo[b], qo[b + 1]):
                out, row_lse = attend(qf[t], kv_rows[part], sm_scale)
                logits[t, split] = out
                lses[t, split, :, 0] = row_lse
    if not direct:
        CALLS[fn + ":reduce"] += 1
    for t in range(total_q):
        o[t] = combine(logits[t], lses[t, :, :, 0]).to(o.dtype)
    final_lse = torch.logsumexp(lses[:, :, :, 0], dim=1) if return_lse else None
    return logits, final_lse

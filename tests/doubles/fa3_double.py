"""A strict test double of flash-attention 3's forward ops (torch.ops.flash_attn_3.fwd and
get_scheduler_metadata: hopper/flash_api_stable.cpp of Dao-AILab/flash-attention 0251105), as
an FA3 kit's build makes them, for bench/fa3_mla.py on a machine without a GPU.

`flash_attn_3_gpu` stands where the real interface module (hopper/flash_attn_interface.py) has
torch.ops.flash_attn_3: two functions with the ops' schema (the same parameter names, order and
defaults). What the real op checks is checked here and raises ValueError naming the argument:
dtypes, the last dim contiguous (q, k, v, q_v, page_table), int32 and contiguous index tensors, the
shapes of mha_fwd's CHECK_SHAPEs, num_splits <= 256, a scheduler_metadata of the size mha_fwd
computes. So is what this build lacks or this double does not model: bf16 only (the build has no
fp16, fp8), head dim 64 with value dim 512 only (the MLA decode instantiations), no local window,
softcap, appended KV, rotary, kv_batch_idx, leftpad_k, seqused_q or descales, a paged cache only
(page_table and seqused_k given, cu_seqlens_k not). A scheduler_metadata must come from this
double's get_scheduler_metadata for the same call (batch, lengths, heads, dims, page size, causal,
num_splits): the real op only checks its size, and one made for another call schedules wrong work.

The attention is computed in float64 from what was passed, as the kernel does it: request b's query
rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] (or row b of a 4-D q) over its first seqused_k[b] tokens,
token t at page page_table[b, t // page_size], slot t % page_size; scores (q . k + q_v . v) *
softmax_scale, where softmax_scale None is the op's own default 1/sqrt(q's last dim), not
1/sqrt(576); causal: bottom-right aligned (query row i of a request of n rows attends its first
seqused_k - n + i + 1 tokens), and off when max_seqlen_q is 1 (as mha_fwd turns it off). Returns
(out in q's dtype, (total_q, h, 512) or (b, s_q, h, 512); softmax_lse float32, natural log, (h,
total_q) with cu_seqlens_q or (b, h, s_q) without; None; None): the real op's last two, the split
partials, are not modelled. Rows that attend nothing: out 0, lse -inf (the kernel's, where the
reference says +inf).

One behaviour of the real kernel is modelled on purpose (flash-attention issue 2374): where the
cache is read with TMA (page_size a multiple of 64, the kernel's kBlockN for 64/512, and max_seqlen_q
x h / h_k > 64, its kBlockM), the last 64-token block of a request is read whole, and its V rows
past seqused_k enter P @ V with P = 0: 0 x NaN is NaN, so a NaN in a slot nobody attends makes the
output NaN in that value column for the whole request. The non-TMA path (cp.async, other page sizes
or few rows) zero-fills those rows."""
import math
import types

import torch

K_BLOCK_N = 64  # tile_size_fwd_sm90(64, 512, ...) = {kBlockM 64, kBlockN 64}
K_BLOCK_M = 64
HEAD_DIM, HEAD_DIM_V = 64, 512
MAX_SPLITS = 256
INDEX = torch.int32

_SCHEDULES = {}  # data_ptr of a get_scheduler_metadata result -> what it was made for


def _fail(name, what):
    raise ValueError(f"{name}: {what}")


def _index(name, value, length=None):
    """A 1-D int32 contiguous tensor (of `length` entries where given), as a Python list."""
    if (not isinstance(value, torch.Tensor) or value.dtype != INDEX or value.dim() != 1
            or not value.is_contiguous()):
        _fail(name, f"a contiguous 1-D int32 tensor, got {_describe(value)}")
    if length is not None and len(value) != length:
        _fail(name, f"{length} entries, got {len(value)}")
    return [int(x) for x in value.tolist()]


def _describe(value):
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)} strides {value.stride()}"
    return type(value).__name__


def _unsupported(**kwargs):
    for name, value in kwargs.items():
        if value is not None:
            _fail(name, "not used by the MLA decode path (this double and this build take None)")


def _metadata_size(batch, causal, num_splits):
    """mha_fwd's scheduler metadata size for a varlen call (seqused_k given): one semaphore and
    round_up(batch, 4) entries for each of num_splits_dynamic, num_m_blocks, the batch sort and,
    causal, the head swizzle. num_splits does not change the size."""
    del num_splits
    return 1 + (batch + 3) // 4 * 4 * (3 + int(causal))


def _effective_causal(causal, max_seqlen_q, window_left, window_right, attention_chunk):
    # mha_fwd: "causal=true is the same as causal=false in this case" (head dim <= 64)
    if max_seqlen_q == 1 and window_left == -1 and window_right == -1 and attention_chunk == 0:
        return False
    return bool(causal)


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads, num_heads_k, headdim, headdim_v,
                           qkv_dtype, seqused_k, cu_seqlens_q=None, cu_seqlens_k=None, cu_seqlens_k_new=None,
                           seqused_q=None, leftpad_k=None, page_size=None, max_seqlen_k_new=0, is_causal=False,
                           window_size_left=-1, window_size_right=-1, attention_chunk=0, has_softcap=False,
                           num_splits=0, pack_gqa=None, sm_margin=0):
    _unsupported(cu_seqlens_k=cu_seqlens_k, cu_seqlens_k_new=cu_seqlens_k_new, seqused_q=seqused_q,
                 leftpad_k=leftpad_k)
    if qkv_dtype != torch.bfloat16:
        _fail("qkv_dtype", f"bf16 (the build has no fp16 or fp8), got {qkv_dtype}")
    if num_heads % num_heads_k:
        _fail("num_heads", "a multiple of num_heads_k")
    if (headdim, headdim_v) != (HEAD_DIM, HEAD_DIM_V):
        _fail("headdim", f"64 with headdim_v 512 (the built instantiations), got {headdim}, {headdim_v}")
    if (window_size_left, window_size_right, attention_chunk, has_softcap, max_seqlen_k_new) != (-1, -1, 0, False, 0):
        _fail("window_size_left", "no local window, attention chunk, softcap or appended KV in this build")
    if page_size is None or page_size < 1:
        _fail("page_size", "the cache's page size (a paged cache)")
    if not 0 <= num_splits <= MAX_SPLITS:
        _fail("num_splits", f"0 (heuristic) to {MAX_SPLITS}, got {num_splits}")
    lens = _index("seqused_k", seqused_k, batch_size)
    starts = None if cu_seqlens_q is None else _index("cu_seqlens_q", cu_seqlens_q, batch_size + 1)
    causal = _effective_causal(is_causal, max_seqlen_q, window_size_left, window_size_right, attention_chunk)
    metadata = torch.zeros(_metadata_size(batch_size, causal, num_splits), dtype=INDEX, device=seqused_k.device)
    _SCHEDULES[metadata.data_ptr()] = dict(batch=batch_size, max_seqlen_q=max_seqlen_q, heads=num_heads,
                                           heads_k=num_heads_k, page_size=page_size, causal=causal,
                                           num_splits=num_splits, pack_gqa=pack_gqa, sm_margin=sm_margin,
                                           lens=lens, starts=starts, max_seqlen_k=max_seqlen_k)
    return metadata


def fwd(q, k, v, k_new=None, v_new=None, q_v=None, out=None, cu_seqlens_q=None, cu_seqlens_k=None,
        cu_seqlens_k_new=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, page_table=None,
        kv_batch_idx=None, leftpad_k=None, rotary_cos=None, rotary_sin=None, seqlens_rotary=None, q_descale=None,
        k_descale=None, v_descale=None, softmax_scale=None, is_causal=False, window_size_left=-1,
        window_size_right=-1, attention_chunk=0, softcap=0.0, is_rotary_interleaved=False, scheduler_metadata=None,
        num_splits=0, pack_gqa=None, sm_margin=0):
    _unsupported(k_new=k_new, v_new=v_new, cu_seqlens_k=cu_seqlens_k, cu_seqlens_k_new=cu_seqlens_k_new,
                 seqused_q=seqused_q, kv_batch_idx=kv_batch_idx, leftpad_k=leftpad_k, rotary_cos=rotary_cos,
                 rotary_sin=rotary_sin, seqlens_rotary=seqlens_rotary, q_descale=q_descale, k_descale=k_descale,
                 v_descale=v_descale)
    for name, value in (("q", q), ("k", k), ("v", v)):
        if not isinstance(value, torch.Tensor) or value.dtype != torch.bfloat16 or value.stride(-1) != 1:
            _fail(name, f"a bf16 tensor with its last dim contiguous (the build has no fp16 or fp8), "
                        f"got {_describe(value)}")
    if page_table is None or seqused_k is None:
        _fail("page_table", "a paged cache: page_table and seqused_k (this double models no other layout)")
    if (page_table.dtype != INDEX or page_table.dim() != 2 or page_table.stride(-1) != 1):
        _fail("page_table", f"a 2-D int32 tensor with its last dim contiguous, got {_describe(page_table)}")
    varlen_q = cu_seqlens_q is not None
    if varlen_q:
        if max_seqlen_q is None:
            _fail("max_seqlen_q", "must be provided if cu_seqlens_q is provided")
        batch = len(cu_seqlens_q) - 1
        starts = _index("cu_seqlens_q", cu_seqlens_q)
        if q.dim() != 3:
            _fail("q", f"(total_q, h, d) with cu_seqlens_q, got {tuple(q.shape)}")
        total_q, heads, head_dim = q.shape
        seqlen_q = int(max_seqlen_q)
        if starts[0] != 0 or starts[-1] != total_q or any(b < a for a, b in zip(starts, starts[1:], strict=False)):
            _fail("cu_seqlens_q", f"from 0, rising, to total_q {total_q}: {starts}")
        if any(b - a > seqlen_q for a, b in zip(starts, starts[1:], strict=False)):
            _fail("max_seqlen_q", f"at least every request's query length ({seqlen_q} is less)")
    else:
        if q.dim() != 4:
            _fail("q", f"(b, s_q, h, d) without cu_seqlens_q, got {tuple(q.shape)}")
        batch, seqlen_q, heads, head_dim = q.shape
        total_q = batch * seqlen_q
        starts = [b * seqlen_q for b in range(batch + 1)]
    if k.dim() != 4 or v.dim() != 4:
        _fail("k", f"(num_pages, page_size, h_k, d) and v (num_pages, page_size, h_k, dv) with a page_table, "
                   f"got {tuple(k.shape)}, {tuple(v.shape)}")
    num_pages, page_size, heads_k, _ = k.shape
    head_dim_v = v.shape[-1]
    if (head_dim, head_dim_v) != (HEAD_DIM, HEAD_DIM_V):
        _fail("q", f"head dim 64 with v's 512 (the only instantiations built), got {head_dim}, {head_dim_v}")
    if tuple(k.shape) != (num_pages, page_size, heads_k, head_dim):
        _fail("k", f"shape {(num_pages, page_size, heads_k, head_dim)}, got {tuple(k.shape)}")
    if tuple(v.shape) != (num_pages, page_size, heads_k, head_dim_v):
        _fail("v", f"shape {(num_pages, page_size, heads_k, head_dim_v)}, got {tuple(v.shape)}")
    if heads % heads_k:
        _fail("k", "its heads must divide q's")
    if page_table.shape[0] != batch:
        _fail("page_table", f"(batch {batch}, max pages), got {tuple(page_table.shape)}")
    lens = _index("seqused_k", seqused_k, batch)
    width = page_table.shape[1]
    if any(not 0 <= n <= width * page_size for n in lens):
        _fail("seqused_k", f"0 to page_table's width x page_size ({width * page_size}): {lens}")
    if q_v is not None:
        shape = (total_q, heads, head_dim_v) if varlen_q else (batch, seqlen_q, heads, head_dim_v)
        if (not isinstance(q_v, torch.Tensor) or q_v.dtype != q.dtype or q_v.stride(-1) != 1
                or tuple(q_v.shape) != shape):
            _fail("q_v", f"{shape} in q's dtype with its last dim contiguous, got {_describe(q_v)}")
    if softmax_scale is not None and not isinstance(softmax_scale, float):
        _fail("softmax_scale", f"a float or None, got {type(softmax_scale).__name__}")
    if (window_size_left, window_size_right, attention_chunk) != (-1, -1, 0):
        _fail("window_size_left", "no local window or attention chunk in this build (FLASHATTENTION_DISABLE_LOCAL)")
    if softcap != 0.0:
        _fail("softcap", "0.0: the build has no softcap (FLASHATTENTION_DISABLE_SOFTCAP)")
    if not isinstance(num_splits, int) or not 0 <= num_splits <= MAX_SPLITS:
        _fail("num_splits", f"an int, 0 (heuristic) to {MAX_SPLITS}, got {num_splits!r}")
    if not isinstance(is_causal, bool) or not isinstance(is_rotary_interleaved, bool):
        _fail("is_causal", "a bool (and is_rotary_interleaved a bool)")
    causal = _effective_causal(is_causal, seqlen_q, window_size_left, window_size_right, attention_chunk)
    if scheduler_metadata is not None:
        size = _metadata_size(batch, causal, num_splits)
        if (scheduler_metadata.dtype != INDEX or tuple(scheduler_metadata.shape) != (size,)
                or not scheduler_metadata.is_contiguous()):
            _fail("scheduler_metadata",
                  f"a contiguous int32 tensor of {size} entries, got {_describe(scheduler_metadata)}")
        made = _SCHEDULES.get(scheduler_metadata.data_ptr())
        want = dict(batch=batch, max_seqlen_q=seqlen_q, heads=heads, heads_k=heads_k, page_size=page_size,
                    causal=causal, num_splits=num_splits, pack_gqa=pack_gqa, sm_margin=sm_margin, lens=lens,
                    starts=starts if varlen_q else None)
        if made is None or any(made[key] != value for key, value in want.items()):
            _fail("scheduler_metadata", "made by get_scheduler_metadata for another call: "
                                        f"{made and {k_: made[k_] for k_ in want if made[k_] != want[k_]}}")
    if out is not None:
        shape = (total_q, heads, head_dim_v) if varlen_q else (batch, seqlen_q, heads, head_dim_v)
        if out.dtype != q.dtype or out.stride(-1) != 1 or tuple(out.shape) != shape:
            _fail("out", f"{shape} in q's dtype with its last dim contiguous, got {_describe(out)}")

    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    tma = page_size % K_BLOCK_N == 0 and seqlen_q * (heads // heads_k) > K_BLOCK_M  # get_pagedkv_tma
    rows_q = q.reshape(total_q, heads, head_dim).double()
    rows_qv = None if q_v is None else q_v.reshape(total_q, heads, head_dim_v).double()
    result = torch.zeros(total_q, heads, head_dim_v, dtype=torch.float64, device=q.device)
    lse = torch.full((heads, total_q), -math.inf, dtype=torch.float64, device=q.device)
    group = heads // heads_k
    table = page_table.tolist()
    for b in range(batch):
        n, first, last = lens[b], starts[b], starts[b + 1]
        rows = last - first
        if rows == 0 or n == 0:
            continue
        read = -(-n // K_BLOCK_N) * K_BLOCK_N if tma else n  # the tokens a TMA read brings in
        pages = -(-read // page_size)
        if any(not 0 <= table[b][p] < num_pages for p in range(-(-n // page_size))):
            _fail("page_table", f"request {b}: an entry out of [0, {num_pages}) among its first "
                                f"{-(-n // page_size)} pages")
        idx = torch.tensor(table[b][:pages], dtype=torch.long, device=k.device)
        keys = k[idx].reshape(-1, heads_k, head_dim)[:read].double()  # (read, h_k, 64)
        values = v[idx].reshape(-1, heads_k, head_dim_v)[:read].double()
        keys_h = keys[:n].repeat_interleave(group, dim=1)  # (n, h, 64)
        values_h = values[:n].repeat_interleave(group, dim=1)
        scores = torch.einsum("ihd,thd->hit", rows_q[first:last], keys_h)
        if rows_qv is not None:
            scores = scores + torch.einsum("ihd,thd->hit", rows_qv[first:last], values_h)
        scores = scores * scale
        if causal:
            limit = n - rows + 1 + torch.arange(rows, device=q.device)
            masked = torch.arange(n, device=q.device)[None, :] >= limit[:, None]
            scores = scores.masked_fill(masked[None], -math.inf)
        row_lse = torch.logsumexp(scores, dim=-1)  # (h, rows)
        live = torch.isfinite(row_lse)
        probs = torch.exp(scores - torch.where(live, row_lse, 0.0)[..., None])
        result[first:last] = torch.einsum("hit,thd->ihd", probs, values_h)
        lse[:, first:last] = row_lse
        tail = values[n:read]  # enters P @ V with P = 0 on the TMA path
        if len(tail):
            poisoned = (~torch.isfinite(tail)).any(dim=0).repeat_interleave(group, dim=0)  # (h, 512)
            result[first:last] = result[first:last].masked_fill(poisoned[None], math.nan)
    out_rows = result.to(q.dtype)
    if out is not None:
        out.copy_(out_rows.reshape(out.shape))
        out_rows = out
    if varlen_q:
        return out_rows.reshape(total_q, heads, head_dim_v), lse.float(), None, None
    return (out_rows.reshape(batch, seqlen_q, heads, head_dim_v),
            lse.reshape(heads, batch, seqlen_q).permute(1, 0, 2).contiguous().float(), None, None)


# where the real interface module has torch.ops.flash_attn_3
flash_attn_3_gpu = types.SimpleNamespace(fwd=fwd, get_scheduler_metadata=get_scheduler_metadata)

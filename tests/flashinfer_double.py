"""A strict test double of FlashInfer's MLA wrapper (flashinfer.mla.BatchMLAPagedAttentionWrapper),
for bench/serving_peers.py's FlashInfer provider on a machine without FlashInfer.

It follows the wrapper's documented call convention (FlashInfer's flashinfer/mla.py docstrings):
plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe,
page_size, causal, sm_scale, q_data_type, kv_data_type), then run(q_nope, q_pe, ckv_cache,
kpe_cache) -> out (total query rows, heads, head_dim_ckv) in q's dtype. It checks every argument
against what plan() was told and raises ValueError naming the first that disagrees, then computes
the attention in float64 from the pages it was given, reading only each request's first kv_len
tokens: request b's query rows qo_indptr[b]:qo_indptr[b + 1] over its pages
kv_indices[kv_indptr[b]:kv_indptr[b + 1]]; causal: the request's query row i attends the first
kv_len - qo_len + i + 1 tokens."""
import types

import torch

INDEX_DTYPE = torch.int32


def _rising(values):
    return all(a <= b for a, b in zip(values, values[1:], strict=False))


class BatchMLAPagedAttentionWrapper:
    def __init__(self, float_workspace_buffer, use_cuda_graph=False, backend="auto"):
        if not isinstance(float_workspace_buffer, torch.Tensor) or float_workspace_buffer.dim() != 1:
            raise ValueError("float_workspace_buffer: a 1-D tensor")
        self.device = float_workspace_buffer.device
        self.planned = None

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe,
             page_size, causal, sm_scale, q_data_type, kv_data_type):
        for name, value in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                            ("kv_len_arr", kv_len_arr)):
            if value.dtype != INDEX_DTYPE or value.dim() != 1:
                raise ValueError(f"{name}: a 1-D int32 tensor, got {value.dtype} of shape {tuple(value.shape)}")
        batch = len(kv_len_arr)
        if len(qo_indptr) != batch + 1 or len(kv_indptr) != batch + 1:
            raise ValueError("qo_indptr, kv_indptr: batch + 1 entries each")
        qo, kv, lens = qo_indptr.tolist(), kv_indptr.tolist(), kv_len_arr.tolist()
        if qo[0] != 0 or kv[0] != 0 or not (_rising(qo) and _rising(kv)):
            raise ValueError("qo_indptr, kv_indptr: from 0, not decreasing")
        if any(kv[b + 1] - kv[b] != -(-lens[b] // page_size) for b in range(batch)):
            raise ValueError("kv_indptr: request b holds cdiv(kv_len_arr[b], page_size) pages")
        if len(kv_indices) < kv[-1]:
            raise ValueError("kv_indices: at least kv_indptr[-1] entries")
        if (head_dim_ckv, head_dim_kpe) != (512, 64) or not isinstance(sm_scale, float):
            raise ValueError("head_dim_ckv 512, head_dim_kpe 64, sm_scale a float")
        self.planned = types.SimpleNamespace(qo=qo, kv=kv, lens=lens, indices=kv_indices.tolist(), heads=num_heads,
                                             page=page_size, causal=bool(causal), sm_scale=sm_scale,
                                             q_dtype=q_data_type, kv_dtype=kv_data_type)

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False):
        p = self.planned
        if p is None:
            raise ValueError("run before plan")
        if return_lse or out is not None or lse is not None:
            raise ValueError("this double models run(q_nope, q_pe, ckv_cache, kpe_cache) only")
        rows = p.qo[-1]
        for name, value, shape, dtype in (("q_nope", q_nope, (rows, p.heads, 512), p.q_dtype),
                                          ("q_pe", q_pe, (rows, p.heads, 64), p.q_dtype),
                                          ("ckv_cache", ckv_cache, (ckv_cache.shape[0], p.page, 512), p.kv_dtype),
                                          ("kpe_cache", kpe_cache, (ckv_cache.shape[0], p.page, 64), p.kv_dtype)):
            if tuple(value.shape) != shape or value.dtype != dtype or value.stride(-1) != 1:
                raise ValueError(f"{name}: {shape} {dtype} with its last dim contiguous, got "
                                 f"{tuple(value.shape)} {value.dtype} strides {value.stride()}")
        q = torch.cat([q_nope, q_pe], -1).double()
        cache = torch.cat([ckv_cache, kpe_cache], -1)
        result = torch.zeros(rows, p.heads, 512, dtype=torch.float64, device=q_nope.device)
        for b, length in enumerate(p.lens):
            pages = p.indices[p.kv[b]:p.kv[b + 1]]
            keys = cache[pages].reshape(-1, 576)[:length].double()  # its first kv_len tokens only
            qo_len = p.qo[b + 1] - p.qo[b]
            scores = torch.einsum("ihd,td->iht", q[p.qo[b]:p.qo[b + 1]], keys) * p.sm_scale
            if p.causal:
                limit = length - qo_len + 1 + torch.arange(qo_len, device=q.device)
                masked = torch.arange(length, device=q.device)[None, :] >= limit[:, None]
                scores = scores.masked_fill(masked[:, None, :], float("-inf"))
            result[p.qo[b]:p.qo[b + 1]] = torch.einsum("iht,td->ihd", scores.softmax(-1), keys[:, :512])
        return result.to(p.q_dtype)


mla = types.SimpleNamespace(BatchMLAPagedAttentionWrapper=BatchMLAPagedAttentionWrapper)

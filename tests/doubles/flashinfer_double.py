"""A strict test double of FlashInfer's MLA wrapper (flashinfer.mla.BatchMLAPagedAttentionWrapper,
flashinfer-python 0.7.4), for bench/serving_peers.py's FlashInfer provider on a machine without
FlashInfer.

It follows the wrapper's keyword form, as 0.7.4's docstrings and plan checks give it (the flat and
positional forms are deprecated there, and refused here): plan(metadata=MLAPlanMetadata.csr(
qo_indptr, kv_indptr, kv_indices, kv_len_arr), num_heads=, head_dim_ckv=, head_dim_kpe=, page_size=,
causal=, sm_scale=, q_data_type=, kv_data_type=, scale_mode=), then run(query=, kv_cache=) with
packed tensors (the last dim 512 latent + 64 rope: query (total query rows, heads, 576), kv_cache
(pages, page_size, 576)) -> out (total query rows, heads, 512) in q's dtype. An fp8 cache needs a
bf16 q and scale_mode "kv-per-tensor" at plan, then run(ckv_scale=, kpe_scale=): positive finite
scales, each value read as stored x scale; any other cache must have q's dtype, scale_mode
"default" and no scales. Every argument is checked against what plan() was told, and the first
that disagrees raises ValueError naming it. The attention is computed in float64 from the pages it
was given, reading only each request's first kv_len tokens: request b's query rows
qo_indptr[b]:qo_indptr[b + 1] over its pages kv_indices[kv_indptr[b]:kv_indptr[b + 1]]; causal:
the request's query row i attends the first kv_len - qo_len + i + 1 tokens."""
import math
import types

import torch

INDEX_DTYPE = torch.int32
FP8 = torch.float8_e4m3fn


def _rising(values):
    return all(a <= b for a, b in zip(values, values[1:], strict=False))


class MLAPlanMetadata:
    def __init__(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr):
        self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_len_arr = qo_indptr, kv_indptr, kv_indices, kv_len_arr

    @classmethod
    def csr(cls, qo_indptr, kv_indptr, kv_indices, kv_len_arr):
        return cls(qo_indptr, kv_indptr, kv_indices, kv_len_arr)


class BatchMLAPagedAttentionWrapper:
    def __init__(self, float_workspace_buffer, use_cuda_graph=False, backend="auto"):
        if not isinstance(float_workspace_buffer, torch.Tensor) or float_workspace_buffer.dim() != 1:
            raise ValueError("float_workspace_buffer: a 1-D tensor")
        self.device = float_workspace_buffer.device
        self.planned = None

    def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type,
             kv_data_type, scale_mode="default"):
        if not isinstance(metadata, MLAPlanMetadata):
            raise ValueError("metadata: an MLAPlanMetadata (MLAPlanMetadata.csr(...))")
        m = metadata
        for name, value in (("qo_indptr", m.qo_indptr), ("kv_indptr", m.kv_indptr), ("kv_indices", m.kv_indices),
                            ("kv_len_arr", m.kv_len_arr)):
            if value.dtype != INDEX_DTYPE or value.dim() != 1:
                raise ValueError(f"{name}: a 1-D int32 tensor, got {value.dtype} of shape {tuple(value.shape)}")
        batch = len(m.kv_len_arr)
        if len(m.qo_indptr) != batch + 1 or len(m.kv_indptr) != batch + 1:
            raise ValueError("qo_indptr, kv_indptr: batch + 1 entries each")
        qo, kv, lens = m.qo_indptr.tolist(), m.kv_indptr.tolist(), m.kv_len_arr.tolist()
        if qo[0] != 0 or kv[0] != 0 or not (_rising(qo) and _rising(kv)):
            raise ValueError("qo_indptr, kv_indptr: from 0, not decreasing")
        if any(kv[b + 1] - kv[b] != -(-lens[b] // page_size) for b in range(batch)):
            raise ValueError("kv_indptr: request b holds cdiv(kv_len_arr[b], page_size) pages")
        if len(m.kv_indices) < kv[-1]:
            raise ValueError("kv_indices: at least kv_indptr[-1] entries")
        if (head_dim_ckv, head_dim_kpe) != (512, 64) or not isinstance(sm_scale, float):
            raise ValueError("head_dim_ckv 512, head_dim_kpe 64, sm_scale a float")
        if kv_data_type == FP8:
            if q_data_type != torch.bfloat16 or scale_mode != "kv-per-tensor":
                raise ValueError("scale_mode: an fp8 cache needs a bf16 q and scale_mode 'kv-per-tensor'")
        elif kv_data_type != q_data_type or scale_mode != "default":
            raise ValueError("kv_data_type: q's dtype, with scale_mode 'default', unless the cache is fp8")
        self.planned = types.SimpleNamespace(qo=qo, kv=kv, lens=lens, indices=m.kv_indices.tolist(), heads=num_heads,
                                             page=page_size, causal=bool(causal), sm_scale=sm_scale,
                                             q_dtype=q_data_type, kv_dtype=kv_data_type)

    def run(self, *, query, kv_cache, ckv_scale=None, kpe_scale=None, out=None, lse=None, return_lse=False):
        p = self.planned
        if p is None:
            raise ValueError("run before plan")
        if return_lse or out is not None or lse is not None:
            raise ValueError("this double models run(query=, kv_cache=[, ckv_scale=, kpe_scale=]) only")
        scales = (ckv_scale, kpe_scale)
        if p.kv_dtype == FP8:
            if not all(isinstance(s, float) and math.isfinite(s) and s > 0 for s in scales):
                raise ValueError(f"ckv_scale, kpe_scale: positive finite floats for an fp8 cache, got {scales}")
        elif scales != (None, None):
            raise ValueError("ckv_scale, kpe_scale: for an fp8 cache only")
        rows = p.qo[-1]
        num_pages = kv_cache.shape[0] if isinstance(kv_cache, torch.Tensor) else -1
        for name, value, shape, dtype in (("query", query, (rows, p.heads, 576), p.q_dtype),
                                          ("kv_cache", kv_cache, (num_pages, p.page, 576), p.kv_dtype)):
            if (not isinstance(value, torch.Tensor) or tuple(value.shape) != shape or value.dtype != dtype
                    or value.stride(-1) != 1):
                got = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"{name}: a packed tensor {shape} {dtype} with its last dim contiguous, got {got}")
        q = query.double()
        cache = kv_cache.double()
        if p.kv_dtype == FP8:
            cache = torch.cat([cache[..., :512] * ckv_scale, cache[..., 512:] * kpe_scale], -1)
        result = torch.zeros(rows, p.heads, 512, dtype=torch.float64, device=query.device)
        for b, length in enumerate(p.lens):
            pages = p.indices[p.kv[b]:p.kv[b + 1]]
            keys = cache[pages].reshape(-1, 576)[:length]  # its first kv_len tokens only
            qo_len = p.qo[b + 1] - p.qo[b]
            scores = torch.einsum("ihd,td->iht", q[p.qo[b]:p.qo[b + 1]], keys) * p.sm_scale
            if p.causal:
                limit = length - qo_len + 1 + torch.arange(qo_len, device=q.device)
                masked = torch.arange(length, device=q.device)[None, :] >= limit[:, None]
                scores = scores.masked_fill(masked[:, None, :], float("-inf"))
            result[p.qo[b]:p.qo[b + 1]] = torch.einsum("iht,td->ihd", scores.softmax(-1), keys[:, :512])
        return result.to(p.q_dtype)


mla = types.SimpleNamespace(BatchMLAPagedAttentionWrapper=BatchMLAPagedAttentionWrapper,
                            MLAPlanMetadata=MLAPlanMetadata)

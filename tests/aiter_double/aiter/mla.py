"""aiter.mla: the Python wrapper mla_decode_fwd, both of its modes, as aiter f3be04a12 has it."""
import torch

from . import _api, _double


def mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
                   max_seqlen_q, page_size=1, nhead_kv=1, sm_scale=None, logit_cap=0.0,
                   num_kv_splits=None, num_kv_splits_indptr=None, work_meta_data=None,
                   work_indptr=None, work_info_set=None, reduce_indptr=None,
                   reduce_final_map=None, reduce_partial_map=None, q_scale=None, kv_scale=None,
                   intra_batch_mode=False, return_logits=False, return_lse=False):
    """Writes o in place; returns (logits, final_lse).

    Non-persistent (no work_meta_data): without num_kv_splits AND num_kv_splits_indptr it picks
    the split count itself; with fp8 q and one split stage 1 writes o directly (no reduce).
    Persistent (work_meta_data given): allocates the partials as aiter does,
    reduce_partial_map.size(0) * max_seqlen_q rows, then calls the stage-1 op and the reduce op
    (intra_batch_mode and num_kv_splits are not read in this mode, as in aiter)."""
    if work_meta_data is None:
        return _double.decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices,
                                  kv_last_page_lens, max_seqlen_q, page_size, nhead_kv, sm_scale,
                                  logit_cap, num_kv_splits, num_kv_splits_indptr, q_scale,
                                  kv_scale, return_lse)
    fn = "mla_decode_fwd"
    _double.CALLS[fn] += 1
    _double.LOG.append((fn, {"page_size": page_size, "persistent": True}))
    sm_scale, _ = _double.decode_fwd_check(fn, q, kv_buffer, o, qo_indptr, kv_indptr,
                                           kv_indices, kv_last_page_lens, max_seqlen_q,
                                           page_size, nhead_kv, sm_scale, logit_cap, q_scale,
                                           kv_scale, num_kv_splits_indptr is None)
    _double.need_tensor(fn, "reduce_partial_map", reduce_partial_map, ndim=1)
    rows = reduce_partial_map.size(0) * max_seqlen_q
    logits = torch.empty(rows, 1, _double.NUM_HEADS, _double.V_HEAD_DIM, dtype=torch.float32,
                         device=q.device)
    attn_lse = torch.empty(rows, 1, _double.NUM_HEADS, 1, dtype=torch.float32, device=q.device)
    final_lse = (torch.empty(q.shape[0], _double.NUM_HEADS, dtype=torch.float32,
                             device=q.device) if return_lse else None)
    _api.mla_decode_stage1_asm_fwd(
        q, kv_buffer, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, num_kv_splits_indptr,
        work_meta_data, work_indptr, work_info_set, max_seqlen_q, page_size, nhead_kv,
        float(sm_scale), logits, attn_lse, o, q_scale=q_scale, kv_scale=kv_scale)
    reduce_splits = {"num_kv_splits": 0} if any(
        row[0] == "num_kv_splits" for row in _api.API["mla_reduce_v1"]) else {}
    _api.mla_reduce_v1(logits, attn_lse, reduce_indptr, reduce_final_map, reduce_partial_map,
                       max_seqlen_q, final_output=o, final_lse=final_lse, **reduce_splits)
    return logits, final_lse

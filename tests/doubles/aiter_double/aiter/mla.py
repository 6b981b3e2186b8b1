"""aiter.mla: the Python wrapper mla_decode_fwd, both of its modes.

Its parameter list is the generation's (_api.GENERATIONS["..."]["mla_decode_fwd"]): f3be04a12's
25, then g_kv_indptr / cp_world_size / cp_rank (63c44c9a0d, 2026-06-19; their defaults only are
modelled) and causal (45ef304fe5, 2026-08-10). inspect reads it, as it reads aiter's."""
import torch

from . import _api, _double


def _decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
                max_seqlen_q, page_size=1, nhead_kv=1, sm_scale=None, logit_cap=0.0,
                num_kv_splits=None, num_kv_splits_indptr=None, work_meta_data=None,
                work_indptr=None, work_info_set=None, reduce_indptr=None,
                reduce_final_map=None, reduce_partial_map=None, q_scale=None, kv_scale=None,
                intra_batch_mode=False, return_logits=False, return_lse=False, causal=True):
    """Writes o in place; returns (logits, final_lse).

    Non-persistent (no work_meta_data): without num_kv_splits AND num_kv_splits_indptr it picks
    the split count itself; with fp8 q and one split stage 1 writes o directly (no reduce).
    Persistent (work_meta_data given): allocates the partials as aiter does,
    reduce_partial_map.size(0) * max_seqlen_q rows, then calls the stage-1 op and the reduce op
    by the names this generation gives them (intra_batch_mode is not read in this mode, as in
    aiter). causal: at q length 1 (all the double models) aiter runs the causal kernel either
    way."""
    _double.need_bool("mla_decode_fwd", "causal", causal)
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
    rows, heads = reduce_partial_map.size(0) * max_seqlen_q, q.shape[1]
    logits = torch.empty(rows, 1, heads, _double.V_HEAD_DIM, dtype=torch.float32,
                         device=q.device)
    attn_lse = torch.empty(rows, 1, heads, 1, dtype=torch.float32, device=q.device)
    final_lse = (torch.empty(q.shape[0], heads, dtype=torch.float32,
                             device=q.device) if return_lse else None)
    stage1_names = {row[0] for row in _api.API["mla_decode_stage1_asm_fwd"]}
    extra = {name: value for name, value in (("lse", final_lse), ("causal", causal))
             if name in stage1_names}
    _api.mla_decode_stage1_asm_fwd(
        q, kv_buffer, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, num_kv_splits_indptr,
        work_meta_data, work_indptr, work_info_set, max_seqlen_q, page_size, nhead_kv,
        float(sm_scale), logits, attn_lse, o, q_scale=q_scale, kv_scale=kv_scale, **extra)
    # aiter passes the split count given, else its CU count (get_mla_decode_fwd_max_splits)
    reduce_splits = ({"num_kv_splits": _double.NUM_CU if num_kv_splits is None else num_kv_splits}
                     if any(row[0] == "num_kv_splits" for row in _api.API["mla_reduce_v1"])
                     else {})
    _api.mla_reduce_v1(logits, attn_lse, reduce_indptr, reduce_final_map, reduce_partial_map,
                       max_seqlen_q, final_output=o, final_lse=final_lse, **reduce_splits)
    return logits, final_lse


mla_decode_fwd = _api.python_function("mla_decode_fwd", _decode_fwd)

"""aiter.mla: the Python wrapper mla_decode_fwd (non-persistent mode modelled)."""
from . import _double


def mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
                   max_seqlen_q, page_size=1, nhead_kv=1, sm_scale=None, logit_cap=0.0,
                   num_kv_splits=None, num_kv_splits_indptr=None, work_meta_data=None,
                   work_indptr=None, work_info_set=None, reduce_indptr=None,
                   reduce_final_map=None, reduce_partial_map=None, q_scale=None, kv_scale=None,
                   intra_batch_mode=False, return_logits=False, return_lse=False):
    """Writes o in place; returns (logits, final_lse). Without num_kv_splits AND
    num_kv_splits_indptr it picks the split count itself; with fp8 q and one split, stage 1 writes
    o directly (no reduce)."""
    return _double.decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
                              max_seqlen_q, page_size, nhead_kv, sm_scale, logit_cap,
                              num_kv_splits, num_kv_splits_indptr, work_meta_data, work_indptr,
                              work_info_set, reduce_indptr, reduce_final_map, reduce_partial_map,
                              q_scale, kv_scale, intra_batch_mode, return_logits, return_lse)

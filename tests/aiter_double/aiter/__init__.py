"""A strict CPU test double of aiter's MLA decode API (tests only; never imported by the product).

The tests put tests/aiter_double first on sys.path, choose a generation with environment variables,
import submission.py as a fresh module, then take the double out of sys.modules again.

AITER_DOUBLE_GENERATION (read at import):
- "2026-03" (default): mla_decode_stage1_asm_fwd(..., output, q_scale=None, kv_scale=None);
  mla_reduce_v1(..., max_seqlen_q, final_output, final_lse=None). The runner's version.
- "2026-04": stage 1 takes an optional `lse` right after `output` (before q_scale); mla_reduce_v1
  takes `num_kv_splits: int` between max_seqlen_q and final_output.
- "2099-01": an API this submission cannot know (stage 1 grows a required argument before
  `output`): the product must fall back to its portable routes.
AITER_DOUBLE_OPAQUE=1: the two ops hide their signatures behind (*args, **kwargs) wrappers, as
aiter's torch_compile_guard does, and their schemas are registered as torch.ops.aiter.<name>
(the only place the real names can then be read). Only with generation "2026-04".

Counters: CALLS (collections.Counter of calls per function) and LOG (facts per call); reset().
"""
import os
from typing import Optional

import torch

from . import dtypes
from ._double import (CALLS, LOG, NUM_CU, PLAN_MAGIC, ContractError, decode_fwd as _decode_fwd,
                      metadata_fill, metadata_info, reduce as _reduce, reset, stage1 as _stage1)

GENERATION = os.environ.get("AITER_DOUBLE_GENERATION", "2026-03")
OPAQUE = os.environ.get("AITER_DOUBLE_OPAQUE", "") == "1"
if GENERATION not in ("2026-03", "2026-04", "2099-01"):
    raise ImportError(f"aiter double: unknown AITER_DOUBLE_GENERATION {GENERATION!r}")


def get_mla_metadata_info_v1(batch_size: int, max_seqlen_qo: int, num_head_qo: int,
                             q_dtype: torch.dtype, kv_dtype: torch.dtype, is_sparse: bool,
                             fast_mode: bool = True, num_kv_splits: int = 32,
                             intra_batch_mode: bool = False):
    return metadata_info(batch_size, max_seqlen_qo, num_head_qo, q_dtype, kv_dtype, is_sparse,
                         fast_mode, num_kv_splits, intra_batch_mode)


def get_mla_metadata_v1(seqlens_qo_indptr: torch.Tensor, seqlens_kv_indptr: torch.Tensor,
                        kv_last_page_lens: torch.Tensor, num_heads_per_head_k: int,
                        num_heads_k: int, is_causal: bool, work_metadata_ptrs: torch.Tensor,
                        work_info_set: torch.Tensor, work_indptr: torch.Tensor,
                        reduce_indptr: torch.Tensor, reduce_final_map: torch.Tensor,
                        reduce_partial_map: torch.Tensor, page_size: int = 1,
                        kv_granularity: int = 16, max_seqlen_qo: int = -1,
                        uni_seqlen_qo: int = -1, fast_mode: bool = True, topk: int = -1,
                        max_split_per_batch: int = -1, intra_batch_mode: bool = False,
                        dtype_q: Optional[torch.dtype] = None,
                        dtype_kv: Optional[torch.dtype] = None) -> None:
    metadata_fill(seqlens_qo_indptr, seqlens_kv_indptr, kv_last_page_lens, num_heads_per_head_k,
                  num_heads_k, is_causal, work_metadata_ptrs, work_info_set, work_indptr,
                  reduce_indptr, reduce_final_map, reduce_partial_map, page_size, kv_granularity,
                  max_seqlen_qo, uni_seqlen_qo, fast_mode, topk, max_split_per_batch,
                  intra_batch_mode, dtype_q, dtype_kv)


if GENERATION == "2026-03":

    def mla_decode_stage1_asm_fwd(
            Q: torch.Tensor, KV: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
            kv_page_indices: torch.Tensor, kv_last_page_lens: torch.Tensor,
            num_kv_splits_indptr: Optional[torch.Tensor], work_meta_data: Optional[torch.Tensor],
            work_indptr: Optional[torch.Tensor], work_info_set: Optional[torch.Tensor],
            max_seqlen_q: int, page_size: int, nhead_kv: int, softmax_scale: float,
            splitData: torch.Tensor, splitLse: torch.Tensor, output: torch.Tensor,
            q_scale: Optional[torch.Tensor] = None,
            kv_scale: Optional[torch.Tensor] = None) -> None:
        _stage1(Q, KV, qo_indptr, kv_indptr, kv_page_indices, kv_last_page_lens,
                num_kv_splits_indptr, work_meta_data, work_indptr, work_info_set, max_seqlen_q,
                page_size, nhead_kv, softmax_scale, splitData, splitLse, output, None, q_scale,
                kv_scale, GENERATION)

    def mla_reduce_v1(partial_output: torch.Tensor, partial_lse: torch.Tensor,
                      reduce_indptr: torch.Tensor, reduce_final_map: Optional[torch.Tensor],
                      reduce_partial_map: torch.Tensor, max_seqlen_q: int,
                      final_output: torch.Tensor,
                      final_lse: Optional[torch.Tensor] = None) -> None:
        _reduce(partial_output, partial_lse, reduce_indptr, reduce_final_map, reduce_partial_map,
                max_seqlen_q, None, final_output, final_lse, GENERATION)

elif GENERATION == "2026-04":

    def mla_decode_stage1_asm_fwd(
            Q: torch.Tensor, KV: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
            kv_page_indices: torch.Tensor, kv_last_page_lens: torch.Tensor,
            num_kv_splits_indptr: Optional[torch.Tensor], work_meta_data: Optional[torch.Tensor],
            work_indptr: Optional[torch.Tensor], work_info_set: Optional[torch.Tensor],
            max_seqlen_q: int, page_size: int, nhead_kv: int, softmax_scale: float,
            splitData: torch.Tensor, splitLse: torch.Tensor, output: torch.Tensor,
            lse: Optional[torch.Tensor] = None, q_scale: Optional[torch.Tensor] = None,
            kv_scale: Optional[torch.Tensor] = None) -> None:
        _stage1(Q, KV, qo_indptr, kv_indptr, kv_page_indices, kv_last_page_lens,
                num_kv_splits_indptr, work_meta_data, work_indptr, work_info_set, max_seqlen_q,
                page_size, nhead_kv, softmax_scale, splitData, splitLse, output, lse, q_scale,
                kv_scale, GENERATION)

    def mla_reduce_v1(partial_output: torch.Tensor, partial_lse: torch.Tensor,
                      reduce_indptr: torch.Tensor, reduce_final_map: Optional[torch.Tensor],
                      reduce_partial_map: torch.Tensor, max_seqlen_q: int, num_kv_splits: int,
                      final_output: torch.Tensor,
                      final_lse: Optional[torch.Tensor] = None) -> None:
        _reduce(partial_output, partial_lse, reduce_indptr, reduce_final_map, reduce_partial_map,
                max_seqlen_q, num_kv_splits, final_output, final_lse, GENERATION)

else:  # "2099-01": a required argument nobody has heard of yet

    def mla_decode_stage1_asm_fwd(
            Q: torch.Tensor, KV: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
            kv_page_indices: torch.Tensor, kv_last_page_lens: torch.Tensor,
            num_kv_splits_indptr: Optional[torch.Tensor], work_meta_data: Optional[torch.Tensor],
            work_indptr: Optional[torch.Tensor], work_info_set: Optional[torch.Tensor],
            max_seqlen_q: int, page_size: int, nhead_kv: int, softmax_scale: float,
            splitData: torch.Tensor, splitLse: torch.Tensor, cu_mask: torch.Tensor,
            output: torch.Tensor, lse: Optional[torch.Tensor] = None,
            q_scale: Optional[torch.Tensor] = None,
            kv_scale: Optional[torch.Tensor] = None) -> None:
        raise ContractError("aiter double 2099-01: stage 1 is not callable (the product must "
                            "not recognise this API)")

    def mla_reduce_v1(partial_output: torch.Tensor, partial_lse: torch.Tensor,
                      reduce_indptr: torch.Tensor, reduce_final_map: Optional[torch.Tensor],
                      reduce_partial_map: torch.Tensor, max_seqlen_q: int, num_kv_splits: int,
                      final_output: torch.Tensor,
                      final_lse: Optional[torch.Tensor] = None) -> None:
        raise ContractError("aiter double 2099-01: not callable")


def _opaque(impl):
    def wrapper_custom(*args, **kwargs):
        return impl(*args, **kwargs)

    return wrapper_custom


def _hide_signatures():
    """Do what aiter's torch_compile_guard does to its ops: the public name becomes a
    (*args, **kwargs) wrapper, and the real parameter names live only in the op schema."""
    global mla_decode_stage1_asm_fwd, mla_reduce_v1, _OPAQUE_LIBRARY
    if GENERATION != "2026-04":
        raise ImportError("aiter double: AITER_DOUBLE_OPAQUE needs generation 2026-04")
    _OPAQUE_LIBRARY = torch.library.Library("aiter", "FRAGMENT")
    wrapped = {}
    for fn in (mla_decode_stage1_asm_fwd, mla_reduce_v1):
        name = fn.__name__
        if not hasattr(torch.ops.aiter, name):  # schemas live for the whole process
            _OPAQUE_LIBRARY.define(name + torch.library.infer_schema(fn, mutates_args=()))

        wrapped[name] = _opaque(fn)
    mla_decode_stage1_asm_fwd = wrapped["mla_decode_stage1_asm_fwd"]
    mla_reduce_v1 = wrapped["mla_reduce_v1"]


if OPAQUE:
    _hide_signatures()

"""A strict test double of aiter's MLA decode API (tests only; never imported by the product).

The tests put tests/doubles/aiter_double first on sys.path, choose a generation and a page mode with
environment variables, import submission.py as a fresh module, then take the double out of
sys.modules again (tests/doubles/aiter_double/loader.py).

AITER_DOUBLE_GENERATION (read at import; _api.GENERATIONS has the parameter lists, _api.FEATURES
what differs below them; aliases: the commits and release tags, e.g. "f3be04a12", "v0.1.17",
"e4048607a"). Each generation is named by the date of the ROCm/aiter commit that brought it:
- "2026-03-04" (default; f3be04a12, 16e9b5a07 on today's main): the runner's aiter. Stage 1 takes
  19 parameters (no `lse`), mla_reduce_v1 8 (no `num_kv_splits`), get_mla_metadata_info_v1 no
  max_split_per_batch.
- "2026-03-16" (a235c4aa3a): stage 1 takes an optional `lse` right after `output` (before
  q_scale); no 16-head q-length-1 kernel writes it, so a non-None lse is refused.
- "2026-06-11" (ff61bb3997, v0.1.16): mla_reduce_v1 takes `num_kv_splits: int` (no default)
  between max_seqlen_q and final_output; get_mla_metadata_info_v1 takes max_split_per_batch.
  From here on a non-None lse picks an lse kernel: the a8w8 one has it, the a16w8 one not.
- "2026-06-26" (c2f68ab382, v0.1.17's API): stage 1 gains trailing g_kv_indptr, cp_world_size,
  cp_rank, valid_split_count, use_valid_split_count_reduce; mla_decode_fwd g_kv_indptr,
  cp_world_size, cp_rank; the compiled get_mla_metadata_v1 is_cp_round_robin after dtype_kv;
  the info sizes reduce_partial_map by tile_cnt + the split cap (not times it).
- "2026-07-13" (fede90f463, one day): get_mla_metadata_v1 takes is_cp_round_robin, mla_version
  and dtype_q_nope / dtype_q_rope / dtype_kv_nope / dtype_kv_rope, no dtype_q / dtype_kv.
- "2026-07-14" (028756633e, v0.1.18, v0.1.19): get_mla_metadata_v1 is a Python function taking
  both the nope / rope dtypes and the legacy dtype_q / dtype_kv (each fills its nope and rope),
  over the compiled op _get_mla_metadata_v1_impl (dtypes as aiter's ids).
- "2026-08-10" (45ef304fe5 .. e4048607a, v0.1.20.post1: aiter as users install it today): stage 1
  and mla_decode_fwd take `causal` last.
- "2099-01": an API no submission can know (stage 1 needs a new argument before `output`): the
  product must refuse it and fall back to its portable routes.
Below the API (_double.FEATURES): the info's split-cap sizing, stage 1's lse kernels, the lse
the non-persistent mla_decode_fwd returns (unwritten, NaN, up to 2026-03-16; merged from
2026-06-11 on, except from stage 2's copy-only branch, taken at one split at 64 / 128 heads,
which writes none; stage 1's own for fp8 q with one split on every generation; the split count
from aiter's get_meta_param when the caller passes none; memory no kernel writes is NaN), and the
head counts of the persistent fp8 decode for one query token (16 / 128 up to 2026-03-16; 16 / 64 /
128 at 2026-06-11; also 32 from 2026-06-26; 64 on another kernel from 2026-08-10).
A parameter the double does not model (the context-parallel ones, is_cp_round_robin,
mla_version, valid_split_count) must hold its default; values reach the double's checks by
parameter name, so a value on the wrong parameter fails.
Every generation presents the compiled ops as real aiter does: (*args, **kwargs) shims whose
names live only in the schemas under torch.ops.aiter, called through torch.ops (see _api).

AITER_DOUBLE_PAGE_MODE (or set_page_mode): "exact" (default) or "first_token", which makes the
persistent fp8 stage 1 for q length 1 read only the first row of each page when page_size > 1,
as the real kernel is suspected to (runner.md section 5).

Counters: CALLS (collections.Counter of calls per function) and LOG (facts per call); reset().
"""
from . import dtypes  # noqa: F401  (aiter.dtypes, as real aiter exposes it)
from ._api import (GENERATION, PUBLIC_OPS, get_mla_metadata_info_v1,  # noqa: F401
                   get_mla_metadata_v1, mla_decode_stage1_asm_fwd, mla_reduce_v1)
from ._double import (CALLS, LOG, NUM_CU, ContractError, page_mode, reset,  # noqa: F401
                      set_page_mode)

"""A strict test double of aiter's MLA decode API (tests only; never imported by the product).

The tests put tests/aiter_double first on sys.path, choose a generation and a page mode with
environment variables, import submission.py as a fresh module, then take the double out of
sys.modules again (tests/aiter_double/loader.py).

AITER_DOUBLE_GENERATION (read at import; _api.GENERATIONS has the parameter lists):
- "2026-03-04" (default; alias "f3be04a12"): the runner's aiter. Stage 1 takes 19 parameters
  (no `lse`), mla_reduce_v1 8 (no `num_kv_splits`), get_mla_metadata_info_v1 no
  max_split_per_batch.
- "2026-03-16": stage 1 takes an optional `lse` right after `output` (before q_scale).
- "2026-06-11": mla_reduce_v1 takes `num_kv_splits: int` between max_seqlen_q and final_output;
  get_mla_metadata_info_v1 takes max_split_per_batch.
- "2026-07-13": get_mla_metadata_v1 takes dtype_q_nope / dtype_kv_nope instead of dtype_q /
  dtype_kv; stage 1 gains trailing context-parallel arguments with defaults.
- "2099-01": an API no submission can know (stage 1 needs a new argument before `output`): the
  product must refuse it and fall back to its portable routes.
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

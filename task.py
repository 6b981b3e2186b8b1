"""The leaderboard's types for amd-mixed-mla (same names and meaning as the runner's task.py).

- ``input_t``: the 5-tuple ``(q, kv_data, qo_indptr, kv_indptr, config)`` made by
  ``reference.generate_input``:
    q          (total_q, 16, 576) bfloat16
    kv_data    {"bf16": Tensor (total_kv, 1, 576) bf16,
                "fp8": (Tensor (total_kv, 1, 576) fp8, Tensor (1,) float32 scale),
                "mxfp4": (Tensor (total_kv, 1, 288) float4_e2m1fn_x2,
                          Tensor (ceil(total_kv/256)*256, 24) float8_e8m0fnu block scales)}
    qo_indptr  (batch + 1,) int32 prefix sums of query rows
    kv_indptr  (batch + 1,) int32 prefix sums of KV rows
    config     dict: batch_size, num_heads, num_kv_heads, qk_head_dim, kv_lora_rank,
               qk_rope_head_dim, v_head_dim, q_seq_len, kv_seq_len, sm_scale
- ``output_t``: Tensor (total_q, 16, 512) bfloat16.
- ``TestSpec``: the keys of one line of a spec file.
"""
from typing import Dict, Tuple, TypedDict, TypeVar

import torch

input_t = TypeVar(
    "input_t", bound=Tuple[torch.Tensor, Dict, torch.Tensor, torch.Tensor, Dict]
)
output_t = TypeVar("output_t", bound=torch.Tensor)


class TestSpec(TypedDict):
    batchsize: int
    qseqlen: int
    kvseqlen: int
    seed: int

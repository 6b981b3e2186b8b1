import sys, os, torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ablate_fp8 import ablate
_mla_decode_fp8_kernel = ablate

def triton_fp8_route(q, kv_data, qo_indptr, kv_indptr, config, num_splits=1, block_n=64, num_warps=8, num_stages=3, qk_fp8=True):
    kv = kv_data["fp8"][0]
    batch = q.shape[0]
    out = torch.empty(batch, 16, 512, dtype=torch.bfloat16, device=q.device)
    ablate[(batch,)](q, kv, out, kv.shape[0] // batch, 576, BLOCK_N=block_n, MODE=3 if qk_fp8 else 4, num_warps=num_warps, num_stages=num_stages)
    return out

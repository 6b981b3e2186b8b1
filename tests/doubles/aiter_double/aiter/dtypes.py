"""aiter.dtypes as the MI355X (gfx950) runner has them."""
import torch

fp8 = torch.float8_e4m3fn  # gfx950; gfx942 would be float8_e4m3fnuz
fp4x2 = torch.float4_e2m1fn_x2
fp8_e8m0 = torch.float8_e8m0fnu
fp32 = torch.float32
fp16 = torch.float16
bf16 = torch.bfloat16
i32 = torch.int32

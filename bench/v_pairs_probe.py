"""Probe (one device call): P.V from a second load of the V tile as uint16 pairs (even/odd dims
turned into f16 with integer ops in the load's row layout), against the kernel's loop, where Triton
reads the fp8 V tile from shared memory one byte at a time to transpose it. Q.K^T stays fp8 wgmma."""
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import utils  # noqa: E402
from ablate_fp8 import ablate  # noqa: E402


@triton.jit
def v_pairs(Q, KV, OUT, n_tokens, stride_kv, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    heads = tl.arange(0, 16); latent = tl.arange(0, 512); rope = tl.arange(0, 64); tokens = tl.arange(0, BLOCK_N)
    pair = tl.arange(0, 256)
    q_lat_t = tl.trans(tl.load(Q + b * 16 * 576 + heads[:, None] * 576 + latent[None, :])).to(tl.float32).to(KV.dtype.element_ty)
    q_rope_t = tl.trans(tl.load(Q + b * 16 * 576 + heads[:, None] * 576 + 512 + rope[None, :])).to(tl.float32).to(KV.dtype.element_ty)
    KV = KV + b * n_tokens * stride_kv
    KV_PAIRS = KV.to(tl.pointer_type(tl.uint16), bitcast=True)
    m = tl.full([16], float("-inf"), tl.float32); l = tl.zeros([16], tl.float32)
    acc_even = tl.zeros([256, 16], tl.float32)
    acc_odd = tl.zeros([256, 16], tl.float32)
    for start in range(0, n_tokens, BLOCK_N):
        ids = start + tokens
        kv_ptrs = KV + ids[:, None] * stride_kv
        s_t = tl.dot(tl.load(kv_ptrs + latent[None, :]), q_lat_t)
        s_t = tl.dot(tl.load(kv_ptrs + 512 + rope[None, :]), q_rope_t, s_t)
        nm = tl.maximum(m, tl.max(s_t, 0)); c = tl.exp2(m - nm); p_t = tl.exp2(s_t - nm[None, :])
        l = l * c + tl.sum(p_t, 0)
        pairs = tl.load(KV_PAIRS + ids[:, None] * (stride_kv // 2) + pair[None, :])
        even = (((pairs & 0x80) << 8) | ((pairs & 0x7F) << 7)).to(tl.float16, bitcast=True)
        odd = ((pairs & 0x8000) | ((pairs >> 1) & 0x3F80)).to(tl.float16, bitcast=True)
        p16 = p_t.to(tl.float16)
        acc_even = tl.dot(tl.trans(even), p16, acc_even * c[None, :])
        acc_odd = tl.dot(tl.trans(odd), p16, acc_odd * c[None, :])
        m = nm
    out_ptrs = OUT + b * 16 * 512 + heads[None, :] * 512 + 2 * pair[:, None]
    tl.store(out_ptrs, (acc_even * 256.0 / l[None, :]).to(tl.bfloat16))
    tl.store(out_ptrs + 1, (acc_odd * 256.0 / l[None, :]).to(tl.bfloat16))


def main():
    flush = utils.L2Flusher("default")
    for batch, kv_len in [(256, 8192), (64, 1024)]:
        q = torch.randn(batch, 16, 576, device="cuda").bfloat16()
        kv = (torch.randn(batch * kv_len, 576, device="cuda") * 20).to(torch.float8_e4m3fn)
        out = torch.empty(batch, 16, 512, device="cuda", dtype=torch.bfloat16)
        ref = torch.empty_like(out)
        floor = batch * kv_len * 576 / 4.2e12 * 1e6
        for nw, ns in [(4, 3), (8, 3)]:
            ablate[(batch,)](q, kv, ref, kv_len, 576, BLOCK_N=64, MODE=3, num_warps=nw, num_stages=ns)
            t = utils.median_time_us(lambda: ablate[(batch,)](q, kv, ref, kv_len, 576, BLOCK_N=64, MODE=3, num_warps=nw, num_stages=ns), 15, flush)
            print(f"bs {batch} kv {kv_len} floor {floor:.0f}: kernel loop nw{nw} ns{ns} {t:.1f} us", flush=True)
            for bn in (64, 32):
                try:
                    v_pairs[(batch,)](q, kv, out, kv_len, 576, BLOCK_N=bn, num_warps=nw, num_stages=ns)
                    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                    t = utils.median_time_us(lambda: v_pairs[(batch,)](q, kv, out, kv_len, 576, BLOCK_N=bn, num_warps=nw, num_stages=ns), 15, flush)
                    k = v_pairs.warmup(q, kv, out, kv_len, 576, BLOCK_N=bn, num_warps=nw, num_stages=ns, grid=(1,))
                    print(f"   v pairs nw{nw} ns{ns} bn{bn}: {t:.1f} us x{t / floor:.2f} diff {err:.4f} regs {k.n_regs} spills {k.n_spills}", flush=True)
                except Exception as exc:
                    print(f"   v pairs nw{nw} ns{ns} bn{bn}: FAIL {repr(exc)[:160]}", flush=True)


if __name__ == "__main__":
    main()

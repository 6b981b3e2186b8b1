"""Where does the fp8 kernel's time go? Main-loop ablations timed on the device (one call).

Each MODE keeps part of the loop: 0 loads only, 1 QK^T + softmax, 2 P.V only, 3 full (transposed,
wgmma), 4 full (heads as M, mma.sync), 5 QK wgmma + P.V mma.sync from a second load, 6 full transposed
with V re-loaded. Grid = (batch,), kv_len tokens per program, like the kernel at num_splits=1.
"""
import itertools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import utils  # noqa: E402


@triton.jit
def ablate(Q, KV, OUT, n_tokens, stride_kv, BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    b = tl.program_id(0)
    heads = tl.arange(0, 16); latent = tl.arange(0, 512); rope = tl.arange(0, 64); tokens = tl.arange(0, BLOCK_N)
    KV = KV + b * n_tokens * stride_kv
    q_lat = tl.load(Q + b * 16 * 576 + heads[:, None] * 576 + latent[None, :]).to(tl.float16)
    q_rope = tl.load(Q + b * 16 * 576 + heads[:, None] * 576 + 512 + rope[None, :]).to(tl.float16)
    q_lat_t = tl.trans(q_lat).to(tl.float32).to(KV.dtype.element_ty)
    q_rope_t = tl.trans(q_rope).to(tl.float32).to(KV.dtype.element_ty)
    m = tl.full([16], float("-inf"), tl.float32); l = tl.zeros([16], tl.float32)
    acc_t = tl.zeros([512, 16], tl.float32)
    acc = tl.zeros([16, 512], tl.float32)
    for start in range(0, n_tokens, BLOCK_N):
        ids = start + tokens
        kv_ptrs = KV + ids[:, None] * stride_kv
        k_lat = tl.load(kv_ptrs + latent[None, :])
        k_rope = tl.load(kv_ptrs + 512 + rope[None, :])
        if MODE == 0:
            acc_t += tl.sum(k_lat.to(tl.float32), 0)[:, None] + tl.sum(k_rope.to(tl.float32))
        elif MODE == 4:
            s = tl.dot(q_lat, tl.trans(k_lat.to(tl.float16)))
            s = tl.dot(q_rope, tl.trans(k_rope.to(tl.float16)), s)
            nm = tl.maximum(m, tl.max(s, 1)); c = tl.exp2(m - nm); p = tl.exp2(s - nm[:, None])
            l = l * c + tl.sum(p, 1)
            acc = tl.dot(p.to(tl.float16), k_lat.to(tl.float16), acc * c[:, None])
            m = nm
        elif MODE == 2:
            p_t = tl.full([BLOCK_N, 16], 0.01, tl.float16)
            acc_t = tl.dot(tl.trans(k_lat.to(tl.float16)), p_t, acc_t)
            l += tl.sum(k_rope.to(tl.float32))
        else:
            s_t = tl.dot(k_lat, q_lat_t)
            s_t = tl.dot(k_rope, q_rope_t, s_t)
            nm = tl.maximum(m, tl.max(s_t, 0)); c = tl.exp2(m - nm); p_t = tl.exp2(s_t - nm[None, :])
            l = l * c + tl.sum(p_t, 0)
            if MODE == 1:
                acc_t += tl.sum(p_t, 0)[None, :]
            elif MODE == 3:
                acc_t = tl.dot(tl.trans(k_lat.to(tl.float16)), p_t.to(tl.float16), acc_t * c[None, :])
            elif MODE == 5:
                v = tl.load(kv_ptrs + latent[None, :])
                acc = tl.dot(tl.trans(p_t).to(tl.float16), v.to(tl.float16), acc * c[:, None])
            else:
                v = tl.load(kv_ptrs + latent[None, :])
                acc_t = tl.dot(tl.trans(v.to(tl.float16)), p_t.to(tl.float16), acc_t * c[None, :])
            m = nm
    res = tl.trans(acc_t) + acc
    tl.store(OUT + b * 16 * 512 + heads[:, None] * 512 + latent[None, :], (res / l[:, None]).to(tl.bfloat16))


def main():
    batch, kv_len = 256, 8192
    q = torch.randn(batch, 16, 576, device="cuda").bfloat16()
    kv = (torch.randn(batch * kv_len, 576, device="cuda") * 20).to(torch.float8_e4m3fn)
    out = torch.empty(batch, 16, 512, device="cuda", dtype=torch.bfloat16)
    flush = utils.L2Flusher("default")
    floor = batch * kv_len * 576 / 4.2e12 * 1e6
    print(f"floor {floor:.0f} us")
    for mode, bn, nw, ns in itertools.product(range(7), [64, 128], [4, 8], [2, 3]):
        if bn == 128 and ns == 3:
            continue
        if mode == 4 and bn == 128:
            continue
        try:
            ablate[(batch,)](q, kv, out, kv_len, 576, BLOCK_N=bn, MODE=mode, num_warps=nw, num_stages=ns)
            median = utils.median_time_us(
                lambda: ablate[(batch,)](q, kv, out, kv_len, 576, BLOCK_N=bn, MODE=mode, num_warps=nw, num_stages=ns),
                10, flush)
            k = ablate.warmup(q, kv, out, kv_len, 576, BLOCK_N=bn, MODE=mode, num_warps=nw, num_stages=ns, grid=(1,))
            print(f"mode {mode} bn {bn} nw {nw} ns {ns}: {median:8.1f} us  x{median / floor:.2f} floor  regs {k.n_regs} spills {k.n_spills} smem {k.metadata.shared}", flush=True)
        except Exception as exc:
            print(f"mode {mode} bn {bn} nw {nw} ns {ns}: FAIL {repr(exc)[:200]}", flush=True)


if __name__ == "__main__":
    main()

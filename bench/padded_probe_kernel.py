import triton, triton.language as tl

@triton.jit
def padded(Q, KV, OUT, n_tokens, stride_kv, BLOCK_N: tl.constexpr, HP: tl.constexpr):
    b = tl.program_id(0)
    rows = tl.arange(0, HP); latent = tl.arange(0, 512); rope = tl.arange(0, 64); tokens = tl.arange(0, BLOCK_N)
    real = rows < 16
    q_ptrs = Q + b * 16 * 576 + rows[:, None] * 576
    q_lat = tl.load(q_ptrs + latent[None, :], mask=real[:, None], other=0.0).to(tl.float32).to(KV.dtype.element_ty)
    q_rope = tl.load(q_ptrs + 512 + rope[None, :], mask=real[:, None], other=0.0).to(tl.float32).to(KV.dtype.element_ty)
    KV = KV + b * n_tokens * stride_kv
    m = tl.full([HP], float("-inf"), tl.float32); l = tl.zeros([HP], tl.float32)
    acc = tl.zeros([HP, 512], tl.float32)
    for start in range(0, n_tokens, BLOCK_N):
        ids = start + tokens
        kv_ptrs = KV + ids[:, None] * stride_kv
        k_lat = tl.load(kv_ptrs + latent[None, :])
        k_rope = tl.load(kv_ptrs + 512 + rope[None, :])
        s = tl.dot(q_lat, tl.trans(k_lat))
        s = tl.dot(q_rope, tl.trans(k_rope), s)
        nm = tl.maximum(m, tl.max(s, 1)); c = tl.exp2(m - nm); p = tl.exp2(s - nm[:, None])
        l = l * c + tl.sum(p, 1)
        acc = tl.dot(p.to(tl.float16), k_lat.to(tl.float16), acc * c[:, None])
        m = nm
    out = acc / l[:, None]
    tl.store(OUT + b * 16 * 512 + rows[:, None] * 512 + latent[None, :], out.to(tl.bfloat16), mask=real[:, None])

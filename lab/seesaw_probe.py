"""A probe of FlashMLA's "seesaw" schedule in Gluon on the fp8 cache (lab/NOTES.md h50): query rows as
S's MMA M, two compute warpgroups in different phases, against the Hopper serving kernel of
submission.py (tokens as M, both warpgroups meeting at CTA barriers every tile: lab/NOTES.md h49).

    python lab/seesaw_probe.py --compile-only [--p fp8]   # sm_90 compile on the CPU: registers, spills, PTX facts
    python lab/seesaw_probe.py [--p f16|fp8|both] [--no-loader] [--early-s] [--stages 4] [--flashmla BUILD]  # H200

What runs: a probe, not a route. One program = 64 query rows of one request (h_q a multiple of 64,
s_q 1) over its whole cache (uniform lengths, a multiple of 128 tokens, contiguous rows; one split,
no merge, no pages, no causal mask), fp8 cache at scale 1, q quantised per program as the route does.
Per pair of 64-token tiles (2j, 2j + 1) warpgroup w owns tile 2j + w (FlashMLA's deep dive,
docs/20250422-new-kernel-deep-dive.md, describes the schedule; nothing of its code is used):
  S = Q K^T (64 rows x 64 tokens, five fp8 wgmma, q and the tile from shared memory);
  the running max continues from the other warpgroup's tile before (published with its factor
  in shared memory), P = exp2(S - m) in f16 and the factor go to shared memory (mbarrier `pub`);
  both warpgroups then run P.V of both tiles in order for their own 256 latent dims, V^T converted
  from fp8 in registers exactly as submission._pv_chunk does (acc^T: 256 dims x 64 rows a warpgroup).
  With --p fp8 (lab/NOTES.md h51a) P is stored as 256 P in fp8 and P.V is an fp8 product, V^T read as it
  is: the form submission.py's seesaw kernel (_mla_decode_seesaw_kernel, h51) serves with.
The rows' max never crosses warps (a row's 64 scores sit in one quad), and the only waits between
the warpgroups are the mbarriers of P and of the ring slots, so one's softmax runs under the
other's products. Output: float32 out and natural-log lse; checked against float64 attention over
the same fp8 values, and timed against mla_decode_with_kvcache (page 64, identity block table) and,
with --flashmla, FlashMLA's bf16 dense decode on the same values (bench/serving_peers.load_flashmla).
"""
import argparse
import json
import math
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
import torch  # noqa: E402
import triton  # noqa: E402

import submission as S  # noqa: E402
import utils  # noqa: E402
from serving_peers import kernel_times, load_flashmla  # noqa: E402
from submission import gl, gluon  # noqa: E402

if S.HAVE_GLUON:
    from submission import fence_async_shared, mbarrier, warpgroup_mma_wait

    TILE_BYTES = gl.constexpr(64 * 576)  # a ring slot's bytes: 64 tokens of the fp8 cache (submission._load_tile)


@gluon.jit
def _sw_publish(c_own, m_new, c_smem, m_smem, published, WG: gl.constexpr):
    """Warpgroup WG's tile to the other warpgroup, once its P is stored: the rescale factors and running
    maxima into WG's half of c_smem and m_smem, then `published` arrives (submission._sw_arrive: every
    thread's stores visible to the async proxy, where the other warpgroup's MMAs read P)."""
    c_smem.slice(WG * 64, 64).store(c_own)
    m_smem.slice(WG * 64, 64).store(m_new)
    S._sw_arrive(published)


@gluon.jit
def _sw_pv_issue(kv_latent, slot, p_buf, acc0, acc1, c_buf, WG: gl.constexpr, O_MMA: gl.constexpr):
    """acc_c = acc_c * c + V_c^T P^T for this warpgroup's two 128-dim chunks of tile `slot` (issued, 2 groups);
    c read from c_buf here, where it is used. P in f16: V converted to f16 (k_width 2); P in fp8: V^T
    read as it is (k_width 4, fp8 wgmma)."""
    K_WIDTH: gl.constexpr = 2 if p_buf.dtype == gl.float16 else 4
    c_o = c_buf.load(gl.SliceLayout(0, O_MMA))
    first = slot * 4 + 2 * WG
    acc0 = S._pv_chunk(kv_latent.index(first), p_buf, acc0, c_o, 4, O_MMA, 128, K_WIDTH)
    acc1 = S._pv_chunk(kv_latent.index(first + 1), p_buf, acc1, c_o, 4, O_MMA, 128, K_WIDTH)
    return acc0, acc1


@gluon.jit
def _sw_pv(kv_latent, slot, p_buf, acc0, acc1, c_buf, WG: gl.constexpr, O_MMA: gl.constexpr):
    """_sw_pv_issue, waited for."""
    acc0, acc1 = _sw_pv_issue(kv_latent, slot, p_buf, acc0, acc1, c_buf, WG, O_MMA)
    return warpgroup_mma_wait(0, deps=(acc0, acc1))


@gluon.jit
def _sw_pv_first(kv_latent, kv_rope, q_latent, q_rope, loaded, slot, p_buf, c_buf, acc0, acc1, t_next, num_tiles,
                 s_next, WG: gl.constexpr, S_L: gl.constexpr, O_MMA: gl.constexpr, STAGES: gl.constexpr,
                 EARLY_S: gl.constexpr):
    """The pair's first P.V, waited for; with EARLY_S this warpgroup's next S (tile t_next) is issued
    behind it and left in flight. Returns (acc0, acc1, the next S or s_next as it came)."""
    acc0, acc1 = _sw_pv_issue(kv_latent, slot, p_buf, acc0, acc1, c_buf, WG, O_MMA)
    if EARLY_S:
        mbarrier.wait(loaded.index(t_next % STAGES), (t_next // STAGES) & 1, pred=t_next < num_tiles)
        s_next = S._sw_issue_scores(kv_latent, kv_rope, q_latent, q_rope, t_next % STAGES, S_L)
        acc0, acc1 = warpgroup_mma_wait(5, deps=(acc0, acc1))
    else:
        acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
    return acc0, acc1, s_next


@gluon.jit
def _sw_compute(kv_latent, kv_rope, q_latent, q_rope, p_smem, c_smem, m_smem, l_smem, loaded, free, pub, done, fin,
                OUT, LSE, row0, score_scale, seq_len, num_pairs, lat_desc, rope_desc, kv_row0,
                STAGES: gl.constexpr, WG: gl.constexpr, EARLY_S: gl.constexpr, LOADER: gl.constexpr):
    """Compute warpgroup WG (4 warps): per pair of tiles, S and the softmax of tile 2j + WG, then P.V
    of tiles 2j and 2j + 1 for latent dims [256 WG, 256 WG + 256). Shared with the other warpgroup:
    P (p_smem[b], rows x tokens, f16), the rescale factors (c_smem) and maxima (m_smem) of tile
    2j + b, published on pub[b] and released on done[b] (by the warpgroup that did not write them);
    ring slots are released on free[slot] (both warpgroups arrive). Row sums are kept per
    warpgroup (each rescales by every tile's factor, adds its own tiles' sums) and added at the end."""
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32])
    P_FP8: gl.constexpr = p_smem.dtype == gl.float8e4nv
    P_SCALE: gl.constexpr = 256.0 if P_FP8 else 1.0  # fp8 P: 256 P keeps small probabilities normal
    O_MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, 64, 32 if P_FP8 else 16])
    S_ROW: gl.constexpr = gl.SliceLayout(1, S_L)
    O_COL: gl.constexpr = gl.SliceLayout(0, O_MMA)
    acc0 = gl.zeros([128, 64], gl.float32, layout=O_MMA)
    acc1 = gl.zeros([128, 64], gl.float32, layout=O_MMA)
    m_run = gl.full([64], float("-inf"), gl.float32, layout=S_ROW)
    l_run = gl.zeros([64], gl.float32, layout=S_ROW)
    tokens = gl.arange(0, 64, layout=gl.SliceLayout(0, S_L))
    num_tiles = 2 * num_pairs
    s_next = 0  # with EARLY_S, this warpgroup's next S in flight
    if EARLY_S:
        mbarrier.wait(loaded.index(WG % STAGES), (WG // STAGES) & 1, pred=WG < num_tiles)
        s_next = S._sw_issue_scores(kv_latent, kv_rope, q_latent, q_rope, WG % STAGES, S_L)
    for j in range(num_pairs):
        t_own = 2 * j + WG
        slot_own = t_own % STAGES
        t_next = t_own + 2
        if EARLY_S:
            s = warpgroup_mma_wait(0, deps=(s_next,))
        else:
            mbarrier.wait(loaded.index(slot_own), (t_own // STAGES) & 1)
            s = S._sw_scores(kv_latent, kv_rope, q_latent, q_rope, slot_own, S_L)
        if WG == 1:  # tile 2j's max, factor: the chain's latest
            mbarrier.wait(pub.index(0), j & 1)
            m_run = m_smem.slice(0 * 64, 64).load(S_ROW)
        s = gl.where(gl.expand_dims(t_own * 64 + tokens < seq_len, 0), s * score_scale, float("-inf"))
        m_new = gl.maximum(m_run, gl.max(s, 1))
        c_own = gl.exp2(m_run - m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 1))
        m_run = m_new
        # publish P, the factor and the max (the buffer free once the other warpgroup read tile t_own - 2)
        mbarrier.wait(done.index(WG), (j - 1) & 1, pred=j > 0)
        if P_FP8:  # as 256 P, tokens in the order of _pv_chunk's fp8 fragment of V^T
            S._sw_store_p(p * P_SCALE, p_smem.index(WG))
        else:
            p_smem.index(WG).store(p.to(gl.float16))
        _sw_publish(c_own, m_new, c_smem, m_smem, pub.index(WG), WG)
        p_sum = gl.sum(p, 1)
        if WG == 0:
            l_run = l_run * c_own + p_sum
            acc0, acc1, s_next = _sw_pv_first(kv_latent, kv_rope, q_latent, q_rope, loaded, slot_own, p_smem.index(0),
                                              c_smem.slice(0, 64), acc0, acc1, t_next, num_tiles, s_next, WG, S_L,
                                              O_MMA, STAGES, EARLY_S)
            gl.thread_barrier()
            mbarrier.arrive(free.index(slot_own), count=1)
            mbarrier.wait(pub.index(1), j & 1)
            m_run = m_smem.slice(1 * 64, 64).load(S_ROW)
            slot_other = (2 * j + 1) % STAGES
            mbarrier.wait(loaded.index(slot_other), ((2 * j + 1) // STAGES) & 1)
            l_run = l_run * c_smem.slice(64, 64).load(S_ROW)
            acc0, acc1 = _sw_pv(kv_latent, slot_other, p_smem.index(1), acc0, acc1, c_smem.slice(64, 64), WG, O_MMA)
            gl.thread_barrier()
            mbarrier.arrive(free.index(slot_other), count=1)
            mbarrier.arrive(done.index(1), count=1)
            if not LOADER:
                _sw_refill(lat_desc, rope_desc, kv_latent, kv_rope, loaded, free, kv_row0, t_own, num_tiles, STAGES)
        else:
            slot_other = (2 * j) % STAGES
            l_run = l_run * c_smem.slice(0, 64).load(S_ROW)
            acc0, acc1, s_next = _sw_pv_first(kv_latent, kv_rope, q_latent, q_rope, loaded, slot_other,
                                              p_smem.index(0), c_smem.slice(0, 64), acc0, acc1, t_next, num_tiles,
                                              s_next, WG, S_L, O_MMA, STAGES, EARLY_S)
            gl.thread_barrier()
            mbarrier.arrive(free.index(slot_other), count=1)
            mbarrier.arrive(done.index(0), count=1)
            l_run = l_run * c_own + p_sum
            acc0, acc1 = _sw_pv(kv_latent, slot_own, p_smem.index(1), acc0, acc1, c_smem.slice(64, 64), WG, O_MMA)
            gl.thread_barrier()
            mbarrier.arrive(free.index(slot_own), count=1)
            if not LOADER:
                _sw_refill(lat_desc, rope_desc, kv_latent, kv_rope, loaded, free, kv_row0, t_own, num_tiles, STAGES)

    # Epilogue: the two warpgroups' row sums added, each warpgroup's 256 dims stored, lse by warpgroup 0.
    l_smem.slice(WG * 64, 64).store(l_run)
    gl.thread_barrier()
    mbarrier.arrive(fin, count=1)
    mbarrier.wait(fin, 0)
    l_o = (l_smem.slice(0 * 64, 64).load(O_COL) + l_smem.slice(1 * 64, 64).load(O_COL)) * P_SCALE
    STORE: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])  # dims fastest
    rows = gl.arange(0, 64, layout=gl.SliceLayout(0, STORE))
    dims = gl.arange(0, 128, layout=gl.SliceLayout(1, STORE))
    base = OUT + (row0 + gl.expand_dims(rows, 0)).to(gl.int64) * 512 + gl.expand_dims(dims, 1)
    o0 = gl.convert_layout(S._rows_to_dims(acc0 / gl.expand_dims(l_o, 0), 4), STORE)
    gl.store(base + (2 * WG) * 128, o0)
    o1 = gl.convert_layout(S._rows_to_dims(acc1 / gl.expand_dims(l_o, 0), 4), STORE)
    gl.store(base + (2 * WG + 1) * 128, o1)
    if WG == 0:
        l_s = l_smem.slice(0 * 64, 64).load(S_ROW) + l_smem.slice(1 * 64, 64).load(S_ROW)
        gl.store(LSE + row0 + gl.arange(0, 64, layout=S_ROW), (m_run + gl.log2(l_s)) * 0.6931471805599453)


@gluon.jit
def _sw_loader(lat_desc, rope_desc, kv_latent, kv_rope, loaded, free, kv_row0, num_tiles, STAGES: gl.constexpr):
    """The loader warp: tile t into slot t % STAGES once both warpgroups released tile t - STAGES."""
    for t in range(STAGES, num_tiles):  # the first STAGES tiles: the parent's
        slot = t % STAGES
        mbarrier.wait(free.index(slot), ((t // STAGES) - 1) & 1)
        S._load_tile(lat_desc, rope_desc, kv_latent, kv_rope, loaded.index(slot), slot, kv_row0 + t * 64, True,
                     TILE_BYTES, 4, 128, 512)


@gluon.jit
def _sw_refill(lat_desc, rope_desc, kv_latent, kv_rope, loaded, free, kv_row0, t, num_tiles, STAGES: gl.constexpr):
    """Tile t + STAGES into tile t's slot once both warpgroups are done with tile t."""
    slot = t % STAGES
    more = t + STAGES < num_tiles
    mbarrier.wait(free.index(slot), (t // STAGES) & 1, pred=more)
    S._load_tile(lat_desc, rope_desc, kv_latent, kv_rope, loaded.index(slot), slot, kv_row0 + (t + STAGES) * 64,
                 more, TILE_BYTES, 4, 128, 512)


@gluon.jit
def seesaw_kernel(Q, lat_desc, rope_desc, OUT, LSE, seq_len, sm_scale_log2, GROUPS: gl.constexpr,
                  STAGES: gl.constexpr, FP8_MAX: gl.constexpr, LOADER: gl.constexpr, EARLY_S: gl.constexpr,
                  P_FP8: gl.constexpr = False):
    """One program: 64 query rows (group pid % GROUPS of request pid // GROUPS) over the request's
    seq_len tokens (a multiple of 128: whole pairs of tiles), one split. The parent region (the
    first warpgroup) starts the first STAGES tile loads and quantises q, then forks: two compute
    warpgroups (_sw_compute) and, with LOADER, a one-warp TMA loader (_sw_loader); without it the
    compute warpgroups refill the ring themselves (_sw_refill)."""
    pid = gl.program_id(0)
    request = pid // GROUPS
    row0 = pid * 64  # q / out rows (request, head) flattened, GROUPS programs of 64 per request
    kv_row0 = request * seq_len
    num_tiles = gl.cdiv(seq_len, 64)
    KV_L: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], gl.float8e4nv)
    kv_latent = gl.allocate_shared_memory(gl.float8e4nv, [STAGES * 4, 64, 128], KV_L)
    kv_rope = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 64, 64],
                                        gl.NVMMASharedLayout.get_default_for([64, 64], gl.float8e4nv))
    q_latent = gl.allocate_shared_memory(gl.float8e4nv, [4, 64, 128], KV_L)
    q_rope = gl.allocate_shared_memory(gl.float8e4nv, [64, 64],
                                       gl.NVMMASharedLayout.get_default_for([64, 64], gl.float8e4nv))
    P_DTYPE: gl.constexpr = gl.float8e4nv if P_FP8 else gl.float16
    p_smem = gl.allocate_shared_memory(P_DTYPE, [2, 64, 64], gl.NVMMASharedLayout.get_default_for([64, 64], P_DTYPE))
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    c_smem = gl.allocate_shared_memory(gl.float32, [128], FLAT)
    m_smem = gl.allocate_shared_memory(gl.float32, [128], FLAT)
    l_smem = gl.allocate_shared_memory(gl.float32, [128], FLAT)
    loaded, free, _, pub, done, fin = S._sw_barriers(STAGES)  # the product's tile_max unused here
    # the first tiles fly while q is quantised (and the descriptors need a use outside the partitions:
    # Triton 3.6 reads their metadata from the parent region, and crashes where there is none)
    for t in gl.static_range(STAGES):
        S._load_tile(lat_desc, rope_desc, kv_latent, kv_rope, loaded.index(t), t, kv_row0 + t * 64, t < num_tiles,
                     TILE_BYTES, 4, 128, 512)

    # q in fp8 with the program's amax scale: a pass for the amax, a pass to store (submission's
    # _load_q / _quantize_q hold all 576 dims at once: 288 floats a thread for 64 rows at 4 warps)
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    q_rows = Q + (row0 + gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, QL)), 1)).to(gl.int64) * 576
    d128 = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, QL)), 0)
    d64 = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, QL)), 0)
    amax = gl.max(gl.abs(gl.load(q_rows + 512 + d64).to(gl.float32)), 1)
    for c in gl.static_range(4):
        amax = gl.maximum(amax, gl.max(gl.abs(gl.load(q_rows + c * 128 + d128).to(gl.float32)), 1))
    amax = gl.maximum(gl.max(amax, 0), 1e-12)
    inv = FP8_MAX / amax
    for c in gl.static_range(4):
        q_latent.index(c).store((gl.load(q_rows + c * 128 + d128).to(gl.float32) * inv).to(gl.float8e4nv))
    q_rope.store((gl.load(q_rows + 512 + d64).to(gl.float32) * inv).to(gl.float8e4nv))
    fence_async_shared()
    gl.thread_barrier()
    score_scale = sm_scale_log2 * amax / FP8_MAX
    num_pairs = num_tiles // 2
    if LOADER:
        gl.warp_specialize([
            (_sw_compute, (kv_latent, kv_rope, q_latent, q_rope, p_smem, c_smem, m_smem, l_smem, loaded, free, pub,
                           done, fin, OUT, LSE, row0, score_scale, seq_len, num_pairs, lat_desc, rope_desc, kv_row0,
                           STAGES, 0, EARLY_S, LOADER)),
            (_sw_compute, (kv_latent, kv_rope, q_latent, q_rope, p_smem, c_smem, m_smem, l_smem, loaded, free, pub,
                           done, fin, OUT, LSE, row0, score_scale, seq_len, num_pairs, lat_desc, rope_desc, kv_row0,
                           STAGES, 1, EARLY_S, LOADER)),
            (_sw_loader, (lat_desc, rope_desc, kv_latent, kv_rope, loaded, free, kv_row0, num_tiles, STAGES))],
            [4, 1], [240, 24])  # 384 threads (the loader's warp a warpgroup of its own): 168 at launch
    else:
        gl.warp_specialize([
            (_sw_compute, (kv_latent, kv_rope, q_latent, q_rope, p_smem, c_smem, m_smem, l_smem, loaded, free, pub,
                           done, fin, OUT, LSE, row0, score_scale, seq_len, num_pairs, lat_desc, rope_desc, kv_row0,
                           STAGES, 0, EARLY_S, LOADER)),
            (_sw_compute, (kv_latent, kv_rope, q_latent, q_rope, p_smem, c_smem, m_smem, l_smem, loaded, free, pub,
                           done, fin, OUT, LSE, row0, score_scale, seq_len, num_pairs, lat_desc, rope_desc, kv_row0,
                           STAGES, 1, EARLY_S, LOADER))],
            [4], [256])




def seesaw(q, kv, seq_len, sm_scale, stages=4, loader=True, early_s=False, p_fp8=False):
    """q (batch, heads, 576) bf16, heads a multiple of 64; kv (batch * seq_len, 1, 576) fp8, request
    b's tokens at rows b * seq_len ...: (out (batch, heads, 512) float32, lse (batch, heads))."""
    batch, heads, _ = q.shape
    if heads % 64 or seq_len % 128:
        raise ValueError(f"heads {heads} must be a multiple of 64 and seq_len {seq_len} of 128")
    out = torch.empty(batch * heads, 512, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch * heads, dtype=torch.float32, device=q.device)
    lat_desc, rope_desc = S.kv_descriptors(kv)
    seesaw_kernel[(batch * heads // 64,)](q, lat_desc, rope_desc, out, lse, seq_len, sm_scale * math.log2(math.e),
                                          GROUPS=heads // 64, STAGES=stages, FP8_MAX=448.0, LOADER=loader,
                                          EARLY_S=early_s, P_FP8=p_fp8, num_warps=4)
    return out.view(batch, heads, 512), lse.view(batch, heads)


def compile_facts(stages=4, loader=True, early_s=False, p_fp8=False):
    """The sm_90 compile (no GPU; Gluon needs TRITON_INTERPRET unset): what the PTX and ptxas say."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from tools import kernel_asm
    lead = S._hopper_leading_signature()
    signature = {"Q": "*bf16", "lat_desc": lead["lat_desc"], "rope_desc": lead["rope_desc"], "OUT": "*fp32",
                 "LSE": "*fp32", "seq_len": "i32", "sm_scale_log2": "fp32"}
    constexprs = {"GROUPS": 2, "STAGES": stages, "FP8_MAX": 448.0, "LOADER": loader, "EARLY_S": early_s,
                  "P_FP8": p_fp8}
    signature.update({name: "constexpr" for name in constexprs})
    src = GluonASTSource(fn=seesaw_kernel, signature=signature, constexprs=constexprs, attrs={})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    facts, _ = kernel_asm.kernel_facts(compiled, False, 4, S.SM90_SHARED_PER_SM - 1024, S.SM90_SHARED_PER_SM)
    ptx = compiled.asm["ptx"]
    return {"registers": facts["registers"]["per_thread"], "spill_store_bytes": facts["spills"]["spill_store_bytes"],
            "shared_bytes": facts["lds_bytes"], "threads": int(re.search(r"\.reqntid (\d+)", ptx).group(1)),
            "setmaxnreg": "setmaxnreg" in ptx,
            "fp8_scores": bool(re.search(r"wgmma\.mma_async\S*\.e4m3\.e4m3", ptx)),
            "f16_products": bool(re.search(r"wgmma\.mma_async\S*\.f16\.f16", ptx)),
            "f16_conversions": ptx.count("cvt.rn.f16x2.e4m3x2"),
            "wgmma_serialised": "C7512" in kernel_asm.run_ptxas(ptx)}


def reference(q, kv, seq_len, sm_scale):
    """float64 attention over the same fp8 values: (out, natural-log lse)."""
    batch = q.shape[0]
    k = kv.view(batch, seq_len, 576).double()
    s = torch.einsum("bhd,bnd->bhn", q.double(), k) * sm_scale
    return torch.einsum("bhn,bnd->bhd", torch.softmax(s, -1), k[..., :512]), torch.logsumexp(s, -1)


def back_to_back(fn, calls=10):
    """us per call of `calls` calls in a row (kernel time without the host's: these shapes take
    longer on the GPU than a call takes on the host)."""
    fn()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) * 1000 / calls


def run(args):
    torch.manual_seed(0)
    sm_scale = 576 ** -0.5
    forms = {f"seesaw {p} P": dict(stages=args.stages, loader=not args.no_loader, early_s=args.early_s,
                                   p_fp8=p == "fp8") for p in (("f16", "fp8") if args.p == "both" else (args.p,))}
    for batch, heads, seq_len in ((2, 64, 256), (3, 128, 1024), (1, 64, 4096)):
        q = torch.randn(batch, heads, 576, device="cuda").to(torch.bfloat16)
        kv = (torch.randn(batch * seq_len, 1, 576, device="cuda") * 2).to(torch.float8_e4m3fn)
        exact, exact_lse = reference(q, kv, seq_len, sm_scale)
        for name, options in forms.items():
            out, lse = seesaw(q, kv, seq_len, sm_scale, **options)
            print(f"right b{batch} h{heads} L{seq_len} {name}: out rel L2 "
                  f"{((out.double() - exact).norm() / exact.norm()):.3e} (zeros: 1), lse max abs "
                  f"{(lse.double() - exact_lse).abs().max():.3e}, finite {bool(torch.isfinite(out).all())}",
                  flush=True)
    flashmla = load_flashmla(args.flashmla) if args.flashmla else None
    flush = utils.L2Flusher("default")
    for batch, heads, seq_len in ((128, 128, 4096), (128, 128, 8192), (64, 128, 16384), (128, 64, 8192)):
        time_shape(batch, heads, seq_len, sm_scale, forms, flashmla, flush)


def time_shape(batch, heads, seq_len, sm_scale, forms, flashmla, flush):
    """The seesaw's forms against mla_decode_with_kvcache (and FlashMLA) on one uniform shape, fresh inputs."""
    q = torch.randn(batch, heads, 576, device="cuda").to(torch.bfloat16)
    kv = torch.randn(batch * seq_len, 1, 576, device="cuda").to(torch.float8_e4m3fn)
    pages = kv.view(batch * seq_len // 64, 64, 1, 576)
    table = torch.arange(batch * seq_len // 64, device="cuda", dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), seq_len, device="cuda", dtype=torch.int32)
    plan, _ = S.get_mla_decode_metadata()
    q4 = q.view(batch, 1, heads, 576)
    calls = {"product": lambda: S.mla_decode_with_kvcache(q4, pages, table, lens, 512, plan, k_scale=1.0)}
    for name, options in forms.items():
        calls[name] = lambda options=options: seesaw(q, kv, seq_len, sm_scale, **options)
    if flashmla:
        pages16 = pages.float().to(torch.bfloat16)
        meta = flashmla.get_mla_metadata()[0]
        calls["FlashMLA bf16"] = lambda: flashmla.flash_mla_with_kvcache(q4, pages16, table, lens, 512, meta)
    outs = {name: fn()[0].float().reshape(batch, heads, 512) for name, fn in calls.items()}
    flops = 2 * batch * heads * seq_len * (576 + 512)
    times = {name: (kernel_times(fn, 20, flush)[0], back_to_back(fn)) for name, fn in calls.items()}
    print(f"b{batch} h{heads} L{seq_len}: out vs product rel L2 " + ", ".join(
        f"{name} {((outs[name] - outs['product']).norm() / outs['product'].norm()):.2e}" for name in forms),
        flush=True)
    for name, (flushed, streamed) in times.items():
        print(f"    {name}: {flushed:.1f} us after a flush, {streamed:.1f} back to back "
              f"({flops / streamed / 1e6:.0f} TFLOPS of bf16-equivalent work); product / it "
              f"{times['product'][0] / flushed:.2f}x / {times['product'][1] / streamed:.2f}x", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compile-only", action="store_true", help="the sm_90 compile's facts, no GPU")
    parser.add_argument("--stages", type=int, default=4, help="ring slots (4 fit: 144 KiB + q + P)")
    parser.add_argument("--no-loader", action="store_true",
                        help="no loader warp: the compute warpgroups refill the ring (256 threads, 255 registers)")
    parser.add_argument("--early-s", action="store_true", help="each warpgroup issues its next S under its P.V")
    parser.add_argument("--p", choices=("f16", "fp8", "both"), default="both",
                        help="P.V in f16 (V^T converted from fp8) or in fp8 (P as 256 P in fp8, V^T as read)")
    parser.add_argument("--flashmla", help="FlashMLA's build folder (.peers/flashmla_build.sh): timed beside")
    args = parser.parse_args(argv)
    if args.compile_only:
        print(json.dumps(compile_facts(args.stages, not args.no_loader, args.early_s, args.p == "fp8")))
        return 0
    if not (S.HAVE_GLUON and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        print("seesaw_probe: needs a Hopper GPU (and Triton's Gluon); --compile-only runs anywhere")
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""WORK IN PROGRESS: the portable Triton MLA decode route, developed here and spliced into submission.py."""
import math

import torch
import triton
import triton.language as tl

NUM_HEADS = 16
QK_HEAD_DIM = 576
V_HEAD_DIM = 512
ROPE_DIM = QK_HEAD_DIM - V_HEAD_DIM
SM_SCALE = 1.0 / math.sqrt(QK_HEAD_DIM)
LOG2E = 1.4426950408889634


@triton.jit
def _mla_decode_fp8_kernel(
    Q, Q_AMAX, KV, KV_SCALE, QO_INDPTR, KV_INDPTR, OUT, PARTIAL_O, PARTIAL_LSE, SPLIT_TICKETS,
    sm_scale_log2,
    stride_q_token, stride_q_head, stride_kv_token, stride_o_token, stride_o_head,
    FP8_MAX: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, QK_FP8: tl.constexpr,
    NUM_HEADS: tl.constexpr = 16, LATENT: tl.constexpr = 512, ROPE: tl.constexpr = 64,
):
    """Split-KV MLA decode over an fp8 latent cache, with the split combine fused into the last split.

    Tile plan: one program = one batch row x one KV split, all 16 heads (they share every KV row).
    Products are computed transposed, tokens as the M dimension: S^T = K . Q^T is (BLOCK_N x 16) and
    O^T += V^T . P^T is (512 x 16), so M is a multiple of 64 and Hopper issues wgmma (fp8 x fp8 for
    S^T) where M = 16 heads would only allow mma.sync; AMD's MFMA takes either. The 512 latent dims
    are handled as two halves of 256 (separate loads, accumulators and fp8->f16 conversions) so that
    only half a V tile is converted and live in registers at a time.
    Q^T stays in registers, quantised to fp8 (QK_FP8) or scaled f16, with a per-program scale. Each
    loop step loads a (BLOCK_N x 576) fp8 KV tile once: all 576 dims feed S^T, the first 512 feed
    O^T. Online softmax in float32, base 2.
    With NUM_SPLITS > 1 each program writes a float32 partial (512 x 16) and its log-sum-exp; the
    program that takes the last ticket of its batch row merges all splits and writes the bf16 output,
    then resets the ticket so the next call starts from 0.
    Bytes: 576 per KV token, read once; per split a 32 KiB partial written and read once; Q, O small.
    """
    batch = tl.program_id(0)
    split = tl.program_id(1)
    q_row = tl.load(QO_INDPTR + batch)
    kv_begin = tl.load(KV_INDPTR + batch)
    kv_end = tl.load(KV_INDPTR + batch + 1)
    split_len = tl.cdiv(tl.cdiv(kv_end - kv_begin, NUM_SPLITS), BLOCK_N) * BLOCK_N
    split_begin = kv_begin + split * split_len
    split_end = tl.minimum(split_begin + split_len, kv_end)

    heads = tl.arange(0, NUM_HEADS)
    latent = tl.arange(0, LATENT)
    rope = tl.arange(0, ROPE)
    tokens = tl.arange(0, BLOCK_N)
    q_ptrs = Q + q_row * stride_q_token + heads[None, :] * stride_q_head
    q_latent_t = tl.load(q_ptrs + latent[:, None]).to(tl.float32)
    q_rope_t = tl.load(q_ptrs + LATENT + rope[:, None]).to(tl.float32)
    # Per-program Q scale: at least as accurate as the reference's per-tensor scale, no extra launch.
    q_scale = tl.maximum(tl.load(Q_AMAX), 1e-12) / FP8_MAX
    q_dtype = KV.dtype.element_ty if QK_FP8 else tl.float16
    q_latent_t = (q_latent_t / q_scale).to(q_dtype)
    q_rope_t = (q_rope_t / q_scale).to(q_dtype)
    kv_scale = tl.load(KV_SCALE)
    score_scale = sm_scale_log2 * kv_scale * q_scale

    running_max = tl.full([NUM_HEADS], float("-inf"), tl.float32)
    running_sum = tl.zeros([NUM_HEADS], tl.float32)
    acc_t = tl.zeros([LATENT, NUM_HEADS], tl.float32)
    for tile_begin in range(split_begin, split_end, BLOCK_N):
        token_ids = tile_begin + tokens
        valid = token_ids < split_end
        kv_ptrs = KV + token_ids[:, None] * stride_kv_token
        k_latent = tl.load(kv_ptrs + latent[None, :], mask=valid[:, None], other=0.0)
        k_rope = tl.load(kv_ptrs + LATENT + rope[None, :], mask=valid[:, None], other=0.0)
        if QK_FP8:
            scores_t = tl.dot(k_latent, q_latent_t)
            scores_t = tl.dot(k_rope, q_rope_t, scores_t)
        else:
            scores_t = tl.dot(k_latent.to(tl.float16), q_latent_t)
            scores_t = tl.dot(k_rope.to(tl.float16), q_rope_t, scores_t)
        scores_t = tl.where(valid[:, None], scores_t * score_scale, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores_t, 0))
        correction = tl.exp2(running_max - new_max)
        probs_t = tl.exp2(scores_t - new_max[None, :])
        running_sum = running_sum * correction + tl.sum(probs_t, 0)
        probs_t = probs_t.to(tl.float16)
        acc_t = tl.dot(tl.trans(k_latent.to(tl.float16)), probs_t, acc_t * correction[None, :])
        running_max = new_max

    out_ptrs = OUT + q_row * stride_o_token + heads[:, None] * stride_o_head + latent[None, :]
    if NUM_SPLITS == 1:
        out_scale = (kv_scale / running_sum)[None, :]
        tl.store(out_ptrs, tl.trans(acc_t * out_scale).to(OUT.dtype.element_ty))
    else:
        # An empty split (row shorter than the split grid) has sum 0: partial 0, lse -inf (weight 0).
        has_tokens = running_sum > 0
        safe_sum = tl.where(has_tokens, running_sum, 1.0)
        lse = tl.where(has_tokens, running_max + tl.log2(safe_sum), float("-inf"))
        slot = batch * NUM_SPLITS + split
        partial_ptrs = PARTIAL_O + latent[:, None] * NUM_HEADS + heads[None, :]
        tl.store(partial_ptrs + slot * LATENT * NUM_HEADS, acc_t / safe_sum[None, :])
        tl.store(PARTIAL_LSE + slot * NUM_HEADS + heads, lse)
        # All threads' partial stores must precede the release of the ticket (acq_rel, GPU scope).
        tl.debug_barrier()
        ticket = tl.atomic_add(SPLIT_TICKETS + batch, 1, sem="acq_rel")
        if ticket == NUM_SPLITS - 1:
            first_slot = batch * NUM_SPLITS
            splits = tl.arange(0, NUM_SPLITS)
            all_lse = tl.load(PARTIAL_LSE + (first_slot + splits[:, None]) * NUM_HEADS + heads[None, :],
                              cache_modifier=".cg")
            lse_max = tl.max(all_lse, 0)
            out_scale = (kv_scale / tl.sum(tl.exp2(all_lse - lse_max[None, :]), 0))[None, :]
            merged_t = tl.zeros([LATENT, NUM_HEADS], tl.float32)
            for s in range(NUM_SPLITS):
                weight = tl.exp2(tl.load(PARTIAL_LSE + (first_slot + s) * NUM_HEADS + heads) - lse_max)[None, :]
                merged_t += tl.load(partial_ptrs + (first_slot + s) * LATENT * NUM_HEADS, cache_modifier=".cg") * weight
            tl.store(out_ptrs, tl.trans(merged_t * out_scale).to(OUT.dtype.element_ty))
            tl.atomic_xchg(SPLIT_TICKETS + batch, 0)


_split_buffers = {}


def _split_workspace(batch, num_splits, device):
    """Float32 partials, their lse and one ticket counter per batch row, cached per shape."""
    key = (batch, num_splits, device)
    ws = _split_buffers.get(key)
    if ws is None:
        ws = (
            torch.empty(batch * num_splits, V_HEAD_DIM, NUM_HEADS, dtype=torch.float32, device=device),
            torch.empty(batch * num_splits, NUM_HEADS, dtype=torch.float32, device=device),
            torch.zeros(batch, dtype=torch.int32, device=device),
        )
        _split_buffers[key] = ws
    return ws


_FP8_DEFAULTS = {"num_splits": 1, "block_n": 64, "num_warps": 8, "num_stages": 3, "qk_fp8": True}


def triton_fp8_route(q, kv_data, qo_indptr, kv_indptr, config, num_splits=1, block_n=64, num_warps=8,
                     num_stages=3, qk_fp8=True):
    kv_fp8, kv_scale = kv_data["fp8"]
    batch = kv_indptr.shape[0] - 1
    out = torch.empty(q.shape[0], NUM_HEADS, V_HEAD_DIM, dtype=torch.bfloat16, device=q.device)
    partial_o, partial_lse, tickets = _split_workspace(batch, num_splits, q.device)
    fp8_max = torch.finfo(kv_fp8.dtype).max
    q_amax = torch.linalg.vector_norm(q, float("inf"), dtype=torch.float32)
    _mla_decode_fp8_kernel[(batch, num_splits)](
        q, q_amax, kv_fp8, kv_scale, qo_indptr, kv_indptr, out, partial_o, partial_lse, tickets,
        config["sm_scale"] * LOG2E,
        q.stride(0), q.stride(1), kv_fp8.stride(0), out.stride(0), out.stride(1),
        FP8_MAX=fp8_max, NUM_SPLITS=num_splits, BLOCK_N=block_n, QK_FP8=qk_fp8,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


# Compile plan: what tools/kernel_report.py compiles ahead of time for a route-table row, without a GPU.
_FP8_KERNEL_SIGNATURE = {
    "Q": "*bf16", "KV": "*{fp8}", "KV_SCALE": "*fp32", "QO_INDPTR": "*i32", "KV_INDPTR": "*i32",
    "OUT": "*bf16", "PARTIAL_O": "*fp32", "PARTIAL_LSE": "*fp32", "SPLIT_TICKETS": "*i32",
    "sm_scale_log2": "fp32", "stride_q_token": "i32", "stride_q_head": "i32", "stride_kv_token": "i32",
    "stride_o_token": "i32", "stride_o_head": "i32",
}
# Arguments the runtime JIT sees as multiples of 16 (pointers from torch, strides 576/512/16).
_FP8_KERNEL_ALIGNED = [name for name in _FP8_KERNEL_SIGNATURE if name != "sm_scale_log2"]


def _constexpr_defaults(kernel):
    """The kernel's defaulted constexpr arguments: an ahead-of-time compile must name them all."""
    import inspect

    return {name: param.default for name, param in inspect.signature(kernel.fn).parameters.items()
            if param.default is not inspect.Parameter.empty}


def triton_compile_plan(route, params, fp8_dtype="fp8e4nv"):
    """[{kernel, signature, constexprs, aligned_args, num_warps, num_stages}] for one route-table row.

    fp8_dtype is Triton's name of the KV dtype: fp8e4nv (float8_e4m3fn: MI355X, NVIDIA) or fp8e4b8
    (float8_e4m3fnuz: MI300). Mirrors exactly what triton_fp8_route launches.
    """
    if route != "triton_fp8":
        return []
    p = dict(_FP8_DEFAULTS, **params)
    fp8_max = 448.0 if fp8_dtype == "fp8e4nv" else 240.0
    signature = {k: v.format(fp8=fp8_dtype) for k, v in _FP8_KERNEL_SIGNATURE.items()}
    constexprs = {"FP8_MAX": fp8_max, "NUM_SPLITS": p["num_splits"], "BLOCK_N": p["block_n"],
                  "QK_FP8": p["qk_fp8"], **_constexpr_defaults(_mla_decode_fp8_kernel)}
    return [{"kernel": _mla_decode_fp8_kernel, "signature": signature, "constexprs": constexprs,
             "aligned_args": _FP8_KERNEL_ALIGNED, "num_warps": p["num_warps"], "num_stages": p["num_stages"]}]

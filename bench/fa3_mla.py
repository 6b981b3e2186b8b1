"""FA3's MLA decode as a benchmark peer: flash-attention's Hopper forward kernel (the flash_attn_3 package,
Dao-AILab/flash-attention 0251105, built from a kit kept outside this repository: docs/benchmarking.md), called
the way vLLM's FLASH_ATTN_MLA backend calls it (SGLang's fa3 backend calls the same kernel with the same split
of q and the cache).

    python bench/fa3_mla.py BUILD [--page N]     # on the GPU: a smoke test against float64 attention

How vLLM calls it (vllm 0.33.0, vllm/v1/attention/backends/mla/flashattn_mla.py): q is split into q_nope (512
latent dims) and q_pe (64 rope dims), the (blocks, page, 576) cache into kv_c = cache[..., :512] and k_pe =
cache[..., 512:] (views, each unsqueezed to one KV head); then flash_attn_varlen_func(q=q_pe, k=k_pe, v=kv_c,
q_v=q_nope, cu_seqlens_q, max_seqlen_q, seqused_k=seq_lens, max_seqlen_k, block_table, softmax_scale, causal=True,
scheduler_metadata, num_splits, return_softmax_lse), which calls the fwd op directly with these positional
arguments (vllm_flash_attn/flash_attn_interface.py). The scheduler metadata is made once per step by the metadata
builder (get_scheduler_metadata with the same num_splits), not per layer: here once per case, outside the timing.
num_splits: 0 (FA3's heuristic) in eager mode; under full CUDA graphs, the default for decode batches,
flash_attn_max_num_splits_for_cuda_graph = 32 (vllm/config/attention.py), an upper bound that the scheduler
metadata's dynamic split (per request) stays under. VLLM_NUM_SPLITS is that 32.

Page size: FA3 takes any page size (its docstring: "page_block_size can be arbitrary"); vLLM's FLASH_ATTN_MLA
takes multiples of 16 and runs at vLLM's default block size, 16 (CacheConfig.DEFAULT_BLOCK_SIZE); SGLang's default
page size is 1. The kernel has two paged paths: TMA loads when the page size is a multiple of 64 (its kBlockN for
head dim 64 / value dim 512) and max_seqlen_q x h_q > 64 (kBlockM), else cp.async loads through the page table.
fa3_calls(page=16) re-pages the case's cache as a view (a 64-token page is four 16-token pages: no copy, the
block table expanded), so FA3 runs at vLLM's page size on the same bytes as the other providers.

NaN: the TMA path reads a request's last 64-token block whole and multiplies its V rows past the request's length
by P = 0; 0 x NaN is NaN (flash-attention issue 2374, open), so the benchmark's NaN in unattended slots gives NaN
outputs there (h_q 128 with 64-token pages); engines' caches hold finite stale values. nan_to_zero=True runs FA3
on a copy of the cache with NaN made 0 (made once per case, outside the timing); page=16 avoids the TMA path.

lse: FA3 returns softmax_lse float32, natural log (max x scale + log sum), of shape (h_q, b x s_q) for a varlen q;
fa3_calls returns it as (b, h_q, s_q) (a view), the serving API's layout. A row that attends nothing: out 0, lse
-inf (the reference says +inf).
"""
import argparse
import importlib
import math
import os
import sys

import torch

LATENT, ROPE = 512, 64
SCALE = 1.0 / math.sqrt(LATENT + ROPE)  # the serving API's; vLLM passes its layer's scale (the model's), and the
# op's own default, 1/sqrt(q's last dim) = 1/8, is not it: the scale is always passed
VLLM_NUM_SPLITS = 32  # vllm/config/attention.py: flash_attn_max_num_splits_for_cuda_graph


def load(build_dir):
    """flash-attention's Python interface (hopper/flash_attn_interface.py) over a build (its kit's build script) in
    `build_dir` (DEST/build); its flash_attn_3_gpu is torch.ops.flash_attn_3 (fwd, get_scheduler_metadata)."""
    build_dir = os.path.abspath(build_dir)
    if build_dir not in sys.path:
        sys.path.insert(0, build_dir)
    return importlib.import_module("flash_attn_interface")


def repage(k_cache, block_table, page):
    """The cache (blocks, P, 1, 576) as (blocks x P / page, page, 1, 576), a view, and its block table: block j's
    token t is small block j x P / page + t // page. Entries past a row's used blocks (garbage) stay as they are."""
    blocks, big = k_cache.shape[:2]
    if big % page:
        raise ValueError(f"page {page} must divide the cache's page {big}")
    ratio = big // page
    cache = k_cache.view(blocks * ratio, page, *k_cache.shape[2:])
    table = block_table.long()
    valid = (table >= 0) & (table < blocks)
    expanded = table[:, :, None] * ratio + torch.arange(ratio, device=table.device)
    expanded = torch.where(valid[:, :, None], expanded, table[:, :, None]).flatten(1)
    return cache, expanded.clamp(-2**31, 2**31 - 1).int()


def fa3_calls(fa3, case, *, page=None, num_splits=VLLM_NUM_SPLITS, nan_to_zero=False):
    """{"FA3 bf16": call}: call() runs FA3's forward once on the case (q (b, s_q, h_q, 576) bf16, k_cache (blocks,
    page, 1, 576) bf16, block_table (b, pages) int32, cache_seqlens (b,) int32, causal) and returns (out (b, s_q,
    h_q, 512) bf16, lse (b, h_q, s_q) float32, natural log).

    As vLLM's FLASH_ATTN_MLA decode calls it: q as b x s_q rows (cu_seqlens_q = 0, s_q, 2 s_q, ...), q_rope =
    q[..., 512:] as q, q_nope = q[..., :512] as q_v, k = cache[..., 512:], v = cache[..., :512] (views), the block
    table as page_table, cache_seqlens as seqused_k, softmax_scale 1/sqrt(576), causal as the case says (vLLM
    passes True; FA3 turns causal off when max_seqlen_q is 1, so it differs only for s_q > 1), num_splits (vLLM's
    32 under CUDA graphs; 0: its eager mode and SGLang's), and scheduler metadata from get_scheduler_metadata with
    the same arguments, made here once, outside the timing, as vLLM's metadata builder does once per step. The op
    is called directly (torch.ops.flash_attn_3.fwd, positional), as vLLM's flash_attn_varlen_func calls its own
    build's: not through flash_attn_with_kvcache, whose torch.library.custom_op wrapper adds host time no engine
    pays. page: run at another page size dividing the case's (repage(): a view); nan_to_zero: see the module doc."""
    ops = fa3.flash_attn_3_gpu
    q, cache, table, lens, causal = case.q, case.k_cache, case.block_table, case.cache_seqlens, bool(case.causal)
    batch, s_q, heads, dim = q.shape
    if dim != LATENT + ROPE or cache.shape[-2:] != (1, LATENT + ROPE):
        raise ValueError(f"q (..., 576) and a cache (blocks, page, 1, 576), got {tuple(q.shape)}, {tuple(cache.shape)}")
    if nan_to_zero:
        cache = torch.nan_to_num(cache, nan=0.0)
    if page is not None and page != cache.shape[1]:
        cache, table = repage(cache, table, page)
    page_size = cache.shape[1]
    rows = q.reshape(batch * s_q, heads, dim)  # a view: one row per query token, request-major
    q_rope, q_nope = rows[..., LATENT:], rows[..., :LATENT]
    k_rope, kv_c = cache[..., LATENT:], cache[..., :LATENT]  # (blocks, page, 1, 64) and (blocks, page, 1, 512)
    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * s_q
    max_seqlen_k = int(lens.max())
    metadata = ops.get_scheduler_metadata(
        batch, s_q, max_seqlen_k, heads, 1, ROPE, LATENT, q.dtype,
        lens,            # seqused_k
        cu_seqlens_q,
        None, None,      # cu_seqlens_k, cu_seqlens_k_new
        None, None,      # seqused_q, leftpad_k
        page_size,
        0,               # max_seqlen_k_new
        causal,
        -1, -1, 0,       # window_size_left, window_size_right, attention_chunk
        False,           # has_softcap
        num_splits,
        None,            # pack_gqa
        0)               # sm_margin

    def call():
        out, lse, _, _ = ops.fwd(
            q_rope, k_rope, kv_c,
            None, None,        # k_new, v_new
            q_nope,            # q_v
            None,              # out
            cu_seqlens_q,
            None, None,        # cu_seqlens_k, cu_seqlens_k_new
            None, lens,        # seqused_q, seqused_k
            s_q, max_seqlen_k,
            table,             # page_table
            None, None,        # kv_batch_idx, leftpad_k
            None, None, None,  # rotary_cos, rotary_sin, seqlens_rotary
            None, None, None,  # q_descale, k_descale, v_descale
            SCALE,
            causal,
            -1, -1, 0,         # window_size_left, window_size_right, attention_chunk
            0.0,               # softcap
            True,              # is_rotary_interleaved (as vLLM passes it; no rotary here)
            metadata,
            num_splits,
            None,              # pack_gqa
            0)                 # sm_margin
        return out.view(batch, s_q, heads, LATENT), lse.view(heads, batch, s_q).permute(1, 0, 2)
    return {"FA3 bf16": call}


def main():
    """Smoke test on the GPU: FA3 against float64 attention on a few serving cases (the benchmark's inputs:
    NaN in unattended slots, garbage past each row's blocks), at the case's page size and re-paged."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    import reference  # noqa: E402

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("build", help="the FA3 build folder (its kit's DEST/build)")
    args = parser.parse_args()
    fa3 = load(args.build)
    print("FA3 interface:", fa3.__file__, "ops:", fa3.flash_attn_3_gpu)
    worst = 0.0
    for batch, s_q, heads, s_k, causal in ((4, 1, 16, 700, False), (4, 2, 128, 1000, True), (8, 1, 128, 4096, False),
                                           (3, 1, 128, 65, False), (2, 2, 16, 3000, True)):
        case = reference.generate_serving_input(batch, s_q, heads, 64, s_k, 1, varlen=True, causal=causal,
                                                device="cuda")
        exact_out, exact_lse = reference.mla_decode_paged_float64(case.q, case.k_cache, case.block_table,
                                                                  case.cache_seqlens, causal=causal)
        for page, splits, nan_to_zero in ((None, VLLM_NUM_SPLITS, False), (None, VLLM_NUM_SPLITS, True),
                                          (16, VLLM_NUM_SPLITS, False), (16, 0, False), (None, 1, True)):
            out, lse = fa3_calls(fa3, case, page=page, num_splits=splits, nan_to_zero=nan_to_zero)["FA3 bf16"]()
            torch.cuda.synchronize()
            got = out.double()
            rel = ((got - exact_out).norm() / exact_out.norm()).item()
            fin = torch.isfinite(exact_lse)
            lse_err = (lse.double()[fin] - exact_lse[fin]).abs().max().item()
            print(f"b{batch} s_q{s_q} h{heads} s_k{s_k} causal={causal} page={page or 64} num_splits={splits} "
                  f"nan_to_zero={nan_to_zero}: rel err {rel:.2e}, lse max err {lse_err:.2e}, "
                  f"NaN in out: {bool(torch.isnan(out).any())}", flush=True)
            if nan_to_zero or page == 16:
                worst = max(worst, rel if math.isfinite(rel) else math.inf, lse_err)
    print(f"worst (finite-cache runs): {worst:.2e}", "OK" if worst < 2e-2 else "FAIL")
    sys.exit(0 if worst < 2e-2 else 1)


if __name__ == "__main__":
    main()

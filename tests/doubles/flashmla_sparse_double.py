"""A strict test double of FlashMLA 9241ae3's sparse decode as bench/sparse_peers.py loads it
(flash_mla's get_mla_metadata and flash_mla_with_kvcache over the extension that
bench/flashmla_sparse_build.sh builds), for a machine without a GPU.

What FlashMLA checks is checked here and raises ValueError naming the argument (where FlashMLA
asserts or TORCH_CHECKs; read from flash_mla/flash_mla_interface.py and csrc/api/sparse_decode.h):
num_splits None; a FlashMLASchedMeta from get_mla_metadata, reused only for the configuration it
first ran (b, s_q, h_q, page size, causal, is_fp8_kvcache, topk); causal False and is_fp8_kvcache
True with indices; head_dim_v 512; q bf16 (b, s_q, h_q, 576), h_q 64 or 128 (the kernels' head
counts), its last dim contiguous; k_cache float8_e4m3fn, int8 or uint8 (num_blocks, page, 1, 656)
with a contiguous block (stride(1) == 656); indices int32 (b, s_q, topk), last dim contiguous;
topk_length int32 (b,) contiguous. Not modelled (the bench never passes them): attn_sink and the
extra cache (refused), indices past the cache (refused: what the kernel reads there is not known
here; entries past topk_length are not read).

The attention is FlashMLA's reference (tests/ref.py ref_sparse_attn_decode) in float64 over the
dequantised cache (reference.mla_decode_sparse_float64): entries -1 or past topk_length skipped,
a query with nothing to attend out 0 and lse +inf. Returns (out bf16 (b, s_q, h_q, 512), lse
float32 (b, h_q, s_q)), a fresh pair each call."""
import dataclasses

import torch

import reference

TOKEN_BYTES = 656
CACHE_DTYPES = (torch.float8_e4m3fn, torch.int8, torch.uint8)
HEADS = (64, 128)


@dataclasses.dataclass
class FlashMLASchedMeta:
    config: tuple | None = None


def _fail(name, what):
    raise ValueError(f"{name}: {what}")


def get_mla_metadata(*args, **kwargs):
    """(an empty FlashMLASchedMeta, None): FlashMLA plans at the first call."""
    return FlashMLASchedMeta(), None


def _check_index(name, value, shape, last_dim_only):
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int32:
        _fail(name, f"an int32 tensor, got {value!r:.80}")
    if tuple(value.shape) != shape:
        _fail(name, f"shape {shape}, got {tuple(value.shape)}")
    if (value.stride(-1) != 1) if last_dim_only else not value.is_contiguous():
        _fail(name, "contiguous" + (" in its last dim" if last_dim_only else ""))


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                           num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None,
                           attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                           extra_topk_length=None):
    if not isinstance(tile_scheduler_metadata, FlashMLASchedMeta):
        _fail("tile_scheduler_metadata", "a FlashMLASchedMeta from get_mla_metadata")
    if num_splits is not None:
        _fail("num_splits", "must be None")
    if indices is None:
        _fail("indices", "this double models the sparse form only")
    if causal or not is_fp8_kvcache:
        _fail("causal" if causal else "is_fp8_kvcache", "sparse attention takes causal False, is_fp8_kvcache True")
    if attn_sink is not None or extra_k_cache is not None or extra_indices_in_kvcache is not None \
            or extra_topk_length is not None:
        _fail("attn_sink", "attn_sink and the extra cache are not modelled")
    if head_dim_v != 512:
        _fail("head_dim_v", f"must be 512, got {head_dim_v}")
    if not isinstance(q, torch.Tensor) or q.dtype != torch.bfloat16 or q.dim() != 4 or q.shape[-1] != 576:
        _fail("q", f"bf16 (b, s_q, h_q, 576), got {q!r:.80}")
    b, s_q, h_q, _ = q.shape
    if h_q not in HEADS:
        _fail("q", f"h_q 64 or 128 (the sm90 kernels'), got {h_q}")
    if q.stride(-1) != 1:
        _fail("q", "contiguous in its last dim")
    if (not isinstance(k_cache, torch.Tensor) or k_cache.dtype not in CACHE_DTYPES or k_cache.dim() != 4
            or k_cache.shape[2:] != (1, TOKEN_BYTES)):
        _fail("k_cache", f"fp8_e4m3fn / int8 / uint8 (num_blocks, page, 1, 656), got {k_cache!r:.80}")
    if k_cache.stride(1) != TOKEN_BYTES or k_cache.stride(-1) != 1:
        _fail("k_cache", "the whole block contiguous")
    topk = indices.shape[-1] if isinstance(indices, torch.Tensor) else None
    _check_index("indices", indices, (b, s_q, topk), last_dim_only=True)
    if topk_length is not None:
        _check_index("topk_length", topk_length, (b,), last_dim_only=False)
    config = (b, s_q, h_q, k_cache.shape[1], causal, is_fp8_kvcache, topk)
    meta = tile_scheduler_metadata
    if meta.config is None:
        meta.config = config
    elif meta.config != config:
        _fail("tile_scheduler_metadata", f"made for {meta.config}, called with {config}")
    capacity = k_cache.shape[0] * k_cache.shape[1]
    counted = torch.ones_like(indices, dtype=torch.bool)
    if topk_length is not None:  # entries past a request's topk_length are never read
        positions = torch.arange(topk, device=indices.device)
        counted = (positions[None, None, :] < topk_length.to(torch.int64)[:, None, None]).expand(b, s_q, topk)
    if bool(((indices < -1) | (indices >= capacity))[counted].any()):
        _fail("indices", "entries past the cache are not modelled")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out, lse = reference.mla_decode_sparse_float64(q, k_cache, indices, topk_length=topk_length,
                                                   softmax_scale=scale)
    return out.to(torch.bfloat16), lse.to(torch.float32)

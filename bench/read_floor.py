"""The read-once floor of a shape: a Triton kernel that streams a tensor's bytes once and keeps
only their max (one launch, no compute to speak of), timed like any call. Under the runner's
flush it pays what every kernel pays there: the launch, the first DRAM round trip after the
flush, and the write-back of the dirty lines the flush leaves in the L2 (docs/performance-h200.md)."""
import torch
import triton
import triton.language as tl


@triton.jit
def _read_once_kernel(WORDS, OUT, n, BLOCK: tl.constexpr, EVICTION_POLICY: tl.constexpr):
    """Tile plan: one program per BLOCK int32 words (32 KiB at BLOCK 8192, 16-byte loads across
    8 warps), its max folded into OUT by one atomic. Bytes: the tensor once; 4 per program out."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    words = tl.load(WORDS + offsets, mask=offsets < n, other=-2147483648,  # lanes past the end: int32 min
                    eviction_policy=EVICTION_POLICY)
    tl.atomic_max(OUT, tl.max(words, 0))


def read_once(words, out, block=8192, eviction_policy=""):
    """Read every int32 of `words` once; the max lands in out[0] (a one-element int32 tensor).
    eviction_policy: the loads' L2 policy ("" default, "evict_first", "evict_last")."""
    _read_once_kernel[(triton.cdiv(words.numel(), block),)](words, out, words.numel(), BLOCK=block,
                                                             EVICTION_POLICY=eviction_policy, num_warps=8)
    return out


def cache_words(kv_fp8):
    """The fp8 cache's bytes as int32 words (576 bytes = 144 words per token)."""
    return kv_fp8.view(torch.uint8).view(torch.int32)

"""The leaderboard's reference for amd-mixed-mla, runnable anywhere.

- ``generate_input``: the runner's inputs (q randn, kv randn bf16, fp8 per-tensor, mxfp4 block-32),
  on the GPU when there is one, else on the CPU.
- ``quantize_fp8`` / ``quantize_mxfp4`` / ``dequantize_mxfp4``: portable torch quantisers. The fp8
  one is the runner's own arithmetic (bf16 steps, bit for bit); the MXFP4 one is bit-exact with
  aiter's ``dynamic_mxfp4_quant`` (golden-tested). Where aiter imports, aiter's own MXFP4 quantiser
  is used so that local inputs equal the runner's.
- ``ref_kernel``: where aiter imports, exactly the runner's calls of aiter's persistent a8w8 MLA
  decode; otherwise portable torch computing the same mathematics (fp8 q and fp8 KV dequantised,
  float32 softmax).
- ``check_implementation``: the runner's check (rtol = atol = 0.1 plus the 5% MLA rule).
- ``attention_float64``, ``rel_l2_error``, ``mismatch_ratio``: the strict accuracy tools.
- Serving (the FlashMLA-shaped ``mla_decode_with_kvcache``, not the leaderboard's):
  ``generate_serving_input`` (a paged cache with NaN in every slot no request attends, garbage
  block ids past each row's blocks), ``mla_decode_paged_float64`` (its exact attention and lse),
  ``serving_out_bound`` / ``serving_lse_bound`` and ``check_serving`` (the strict bounds).
- Sparse (DeepSeek-V3.2's top-k indices over FlashMLA's 656-byte fp8 cache): ``generate_sparse_input``,
  ``mla_decode_sparse_float64``, ``round_q_sparse_fp8`` (q as a kernel that multiplies fp8 q rounds
  it), ``sparse_expected(inputs, q_format)`` (both references with the q of the kernel judged, bf16
  or fp8), ``judge_sparse`` / ``check_sparse`` (the strict bounds).
"""
import dataclasses
import math
import operator
import random
import sys
from typing import List, Optional, Sequence, Tuple, Union

import torch

from task import input_t, output_t
from utils import get_device

NUM_HEADS = 16
NUM_KV_HEADS = 1
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
QK_HEAD_DIM = KV_LORA_RANK + QK_ROPE_HEAD_DIM  # 576
V_HEAD_DIM = KV_LORA_RANK  # 512
SM_SCALE = 1.0 / math.sqrt(QK_HEAD_DIM)

RTOL = 0.1
ATOL = 0.1
MAX_MISMATCH_RATIO = 0.05  # the MLA rule: pass while <= 5% of elements are outside tolerance

MXFP4_BLOCK = 32
MXFP4_ROW_PAD = 256
MXFP4_COL_PAD = 8
FP4_DTYPE = torch.float4_e2m1fn_x2
E8M0_DTYPE = torch.float8_e8m0fnu

# peak extra memory of the chunked torch paths (bytes of dequantised KV per chunk)
_CHUNK_BYTES = 1 << 30

# ---------------------------------------------------------------------------------------------
# aiter (MI355X runner) detection: everything aiter-specific is guarded


def _try_import_aiter():
    try:
        import aiter  # noqa: F401

        return aiter
    except Exception:  # ImportError, or a broken install raising anything else
        return None


_AITER = _try_import_aiter()
HAVE_AITER = _AITER is not None
_warned = set()


def _warn_once(key: str, text: str) -> None:
    if key not in _warned:
        _warned.add(key)
        print(f"[reference] {text}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# FP8 per-tensor


def fp8_dtype(device: Union[None, str, torch.device] = None) -> torch.dtype:
    """float8_e4m3fn everywhere except MI300 (gfx942), which uses float8_e4m3fnuz."""
    device = get_device(device)
    if device.type == "cuda" and torch.version.hip:
        try:
            arch = torch.cuda.get_device_properties(device).gcnArchName
        except Exception:
            arch = ""
        if "gfx942" in arch:
            return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def quantize_fp8(x: torch.Tensor, dtype: Optional[torch.dtype] = None):
    """Per-tensor dynamic fp8, bit for bit the runner's quantiser: amax = max|x| clamped below at
    1e-12, scale = amax / fp8_max, data = clamp(x / scale, fp8 range) cast to fp8. Returns (data,
    float32 scale of shape (1,)).

    Every step runs in x's own dtype, as the runner's: for its bf16 inputs the scale is rounded
    to bf16 and so is each quotient x / scale before the cast to fp8 (a double rounding). Doing
    either step in float32 changes the scale and some bytes: tests/test_reference.py checks this
    against a transcription in exact rational arithmetic."""
    dtype = fp8_dtype(x.device) if dtype is None else dtype
    finfo = torch.finfo(dtype)
    amax = x.abs().amax().clamp(min=1e-12)
    scale = amax / finfo.max
    data = (x / scale).clamp(min=finfo.min, max=finfo.max).to(dtype)
    return data, scale.to(torch.float32).reshape(1)


def dequantize_fp8(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return data.float() * scale.float()


# ---------------------------------------------------------------------------------------------
# MXFP4 (e2m1 values, e8m0 scale per block of 32)

# magnitudes of the e2m1 codes 0..7
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# midpoints between neighbouring codes: a magnitude AT a midpoint rounds up (away from zero)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def mxfp4_scale_shape(rows: int, cols: int = QK_HEAD_DIM) -> Tuple[int, int]:
    """The runner's padded scale layout: (ceil(rows/256)*256, ceil(cols/32 / 8)*8) -> (.., 24)."""
    nblocks = cols // MXFP4_BLOCK
    return (-(-rows // MXFP4_ROW_PAD) * MXFP4_ROW_PAD, -(-nblocks // MXFP4_COL_PAD) * MXFP4_COL_PAD)


def _mxfp4_block_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Unbiased e8m0 exponent of each block from its float32 amax (int64).

    amax is rounded up at mantissa bit 21 (add 0x200000 to its bits, clear the 23 mantissa bits),
    e = floor(log2(rounded)) - 2, clamped to [-127, 127]. floor(log2) of the rounded value is its
    biased exponent field minus 127; a zero field means the rounded value is 0 (log2 = -inf) and
    an all-ones field means inf (log2 = +inf): both saturate at the clamp."""
    bits = amax.contiguous().view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    field = ((bits + 0x200000) >> 23) & 0xFF
    e = field - 127 - 2
    e = torch.where(field == 0xFF, torch.full_like(e, 127), e)
    return e.clamp(-127, 127)


def _pow2_float32(k: torch.Tensor) -> torch.Tensor:
    """2**k as float32 exactly, for integer k in [-127, 127] (2**-127 is subnormal)."""
    normal = ((k + 127).clamp(min=1) << 23).to(torch.int32).view(torch.float32)
    subnormal = torch.full_like(normal, 2.0**-127)
    return torch.where(k >= -126, normal, subnormal)


def _quantize_mxfp4_torch(x2d: torch.Tensor):
    """(rows, cols) -> (packed uint8 (rows, cols/2), scale bytes uint8 (rows, cols/32))."""
    rows, cols = x2d.shape
    nb = cols // MXFP4_BLOCK
    xb = x2d.float().reshape(rows, nb, MXFP4_BLOCK)
    e = _mxfp4_block_exponent(xb.abs().amax(dim=-1))
    scale_bytes = (e + 127).to(torch.uint8)
    m = xb.abs() * _pow2_float32(-e).unsqueeze(-1)  # exact: a power-of-two scaling
    code = torch.zeros(m.shape, dtype=torch.uint8, device=m.device)
    for t in _E2M1_MIDPOINTS:
        code += (m >= t).to(torch.uint8)
    code |= torch.signbit(xb).to(torch.uint8) << 3
    code = code.reshape(rows, cols)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)  # even index in the low nibble
    return packed, scale_bytes


def _quantize_mxfp4_aiter(x2d: torch.Tensor):
    """aiter's own quantiser (MI355X runner). Returns (packed uint8 (rows, cols/2), scale bytes of
    any 2-D layout whose first rows x cols/32 entries are meaningful) or None when unavailable."""
    if not HAVE_AITER or x2d.device.type != "cuda":
        return None
    try:
        from aiter.ops.triton.quant import dynamic_mxfp4_quant
    except Exception:
        return None
    try:
        data, scales = dynamic_mxfp4_quant(x2d)
        data = data.view(torch.uint8).reshape(x2d.shape[0], x2d.shape[1] // 2)
        scales = scales.view(torch.uint8)
        if scales.dim() != 2 or scales.shape[0] < x2d.shape[0]:
            return None
        return data, scales
    except Exception as exc:  # API drift: fall back to the portable quantiser
        _warn_once("aiter-mxfp4", f"aiter dynamic_mxfp4_quant failed ({exc!r}); using torch")
        return None


def quantize_mxfp4(x: torch.Tensor, use_aiter: bool = True):
    """MXFP4 quantisation along the last dim, bit-exact with aiter's dynamic_mxfp4_quant.

    Returns (data, scales): data of shape x.shape[:-1] + (cols/2,) and dtype float4_e2m1fn_x2 (two
    e2m1 codes per byte, the even index in the low nibble); scales of dtype float8_e8m0fnu in the
    padded layout (ceil(rows/256)*256, ceil(cols/32/8)*8): only the first rows x cols/32 entries
    are meaningful, the padding is zero."""
    cols = x.shape[-1]
    if cols % MXFP4_BLOCK:
        raise ValueError(f"last dim {cols} is not a multiple of {MXFP4_BLOCK}")
    x2d = x.reshape(-1, cols)
    rows = x2d.shape[0]
    nb = cols // MXFP4_BLOCK
    scales = torch.zeros(mxfp4_scale_shape(rows, cols), dtype=torch.uint8, device=x.device)
    result = _quantize_mxfp4_aiter(x2d) if use_aiter else None
    if result is not None:
        packed, aiter_scales = result
        if tuple(aiter_scales.shape) == tuple(scales.shape):
            scales = aiter_scales.contiguous()
        else:
            scales[:rows, :nb] = aiter_scales[:rows, :nb]
    else:
        packed = torch.empty(rows, cols // 2, dtype=torch.uint8, device=x.device)
        # chunk the rows: the float32 intermediates are ~20 bytes per element
        step = max(1, (256 << 20) // (cols * 20))
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            p, s = _quantize_mxfp4_torch(x2d[r0:r1])
            packed[r0:r1] = p
            scales[r0:r1, :nb] = s
    data = packed.reshape(*x.shape[:-1], cols // 2).view(FP4_DTYPE)
    return data, scales.view(E8M0_DTYPE)


def dequantize_mxfp4(data: torch.Tensor, scales: torch.Tensor, rows: Optional[int] = None):
    """float32 values of MXFP4 ``data`` (leading dims kept, last dim doubled). ``rows`` is the
    number of meaningful rows of the padded ``scales`` (default: the rows of ``data``)."""
    packed = data.view(torch.uint8)
    lead = packed.shape[:-1]
    p2d = packed.reshape(-1, packed.shape[-1])
    nrows = p2d.shape[0] if rows is None else int(rows)
    if nrows != p2d.shape[0]:
        raise ValueError(f"rows={nrows} but data holds {p2d.shape[0]} rows")
    cols = 2 * p2d.shape[1]
    nb = cols // MXFP4_BLOCK
    codes = torch.stack([p2d & 0xF, p2d >> 4], dim=-1).reshape(nrows, cols).long()
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    vals = table[codes & 7]
    vals = torch.where((codes & 8) != 0, -vals, vals)
    e = scales.view(torch.uint8)[:nrows, :nb].to(torch.int64) - 127
    vals = vals.reshape(nrows, nb, MXFP4_BLOCK) * _pow2_float32(e).unsqueeze(-1)
    return vals.reshape(*lead, cols)


# ---------------------------------------------------------------------------------------------
# Inputs


def _make_config(batchsize: int, qseqlen: int, kv_seq_len: int) -> dict:
    return {
        "batch_size": batchsize,
        "num_heads": NUM_HEADS,
        "num_kv_heads": NUM_KV_HEADS,
        "qk_head_dim": QK_HEAD_DIM,
        "kv_lora_rank": KV_LORA_RANK,
        "qk_rope_head_dim": QK_ROPE_HEAD_DIM,
        "v_head_dim": V_HEAD_DIM,
        "q_seq_len": qseqlen,
        "kv_seq_len": kv_seq_len,
        "sm_scale": SM_SCALE,
    }


def _whole(field: str, value, least: Optional[int]) -> int:
    """``value`` as an int (anything with ``__index__``: int, a NumPy or 1-element torch integer),
    or a ValueError naming ``field``: not an integer, or below ``least``."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except (TypeError, RuntimeError):
        raise ValueError(f"{field} must be an integer, got {value!r}") from None
    if least is not None and number < least:
        raise ValueError(f"{field} must be >= {least}, got {number}")
    return number


def generate_input(batchsize: int, qseqlen: int, kvseqlen: int, seed: int, *,
                   kv_lens: Optional[Sequence[int]] = None,
                   device: Union[None, str, torch.device] = None) -> input_t:
    """The runner's input: one generator on the device seeded with ``seed``; q = randn (total_q,
    16, 576) bf16, then kv = randn (total_kv, 1, 576) bf16, then fp8 and mxfp4 from that kv.

    ``kv_lens`` (optional): per-batch KV lengths for variable-length tests; then kv_indptr is their
    prefix sum, config["kv_seq_len"] is the longest and ``kvseqlen`` is not used. Sizes must be
    integers >= 1 (batchsize, qseqlen, kvseqlen; kv_lens: one entry >= 0 per batch, not all 0) and
    the seed an integer: anything else is a ValueError naming the field, before any tensor is made.
    ``device``: default the GPU when there is one, else the CPU (CPU and GPU random streams
    differ)."""
    batchsize, qseqlen, seed = (_whole("batchsize", batchsize, 1), _whole("qseqlen", qseqlen, 1),
                                _whole("seed", seed, None))
    if kv_lens is None:
        lens = [_whole("kvseqlen", kvseqlen, 1)] * batchsize
    else:
        if isinstance(kv_lens, (str, bytes)) or not hasattr(kv_lens, "__len__"):
            raise ValueError(f"kv_lens must be a sequence of lengths, got {kv_lens!r}")
        lens = [_whole("kv_lens", n, 0) for n in kv_lens]  # an empty row is decode too
        if len(lens) != batchsize:
            raise ValueError(f"kv_lens needs one length per batch (batchsize {batchsize}), got "
                             f"{len(lens)}: {list(kv_lens)}")
        if sum(lens) < 1:
            raise ValueError(f"kv_lens {list(kv_lens)} holds no KV row: the cache must not be empty")
    device = get_device(device)
    total_q = batchsize * qseqlen
    total_kv = sum(lens)

    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    q = torch.randn((total_q, NUM_HEADS, QK_HEAD_DIM), dtype=torch.bfloat16, device=device,
                    generator=gen)
    kv = torch.randn((total_kv, NUM_KV_HEADS, QK_HEAD_DIM), dtype=torch.bfloat16, device=device,
                     generator=gen)
    kv_fp8 = quantize_fp8(kv)
    kv_mxfp4 = quantize_mxfp4(kv)
    kv_data = {"bf16": kv, "fp8": kv_fp8, "mxfp4": kv_mxfp4}

    qo_indptr = (torch.arange(batchsize + 1, dtype=torch.int32) * qseqlen).to(device)
    kv_indptr = torch.zeros(batchsize + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0).to(torch.int32)
    kv_indptr = kv_indptr.to(device)
    config = _make_config(batchsize, qseqlen, max(lens))
    return q, kv_data, qo_indptr, kv_indptr, config


def clone_data(data):
    """A deep copy of an input (tensors cloned, containers rebuilt), as the runner does before
    handing the input to the submission."""
    if isinstance(data, tuple):
        return tuple(clone_data(x) for x in data)
    if isinstance(data, list):
        return [clone_data(x) for x in data]
    if isinstance(data, dict):
        return {k: clone_data(v) for k, v in data.items()}
    if isinstance(data, torch.Tensor):
        return data.clone()
    return data


# ---------------------------------------------------------------------------------------------
# Attention in torch (chunked; batched bmm for uniform lengths)


def _segments(indptr: torch.Tensor) -> List[int]:
    return [int(v) for v in indptr.tolist()]


def _attention(q: torch.Tensor, k_rows, qo: List[int], kv: List[int], sm_scale: float,
               dtype: torch.dtype) -> torch.Tensor:
    """softmax(sm_scale * q k^T) k[:, :512] per batch, in ``dtype``.

    q: (total_q, H, 576) already in ``dtype``; ``k_rows(a, b)`` returns KV rows a..b as
    (b - a, 576) in ``dtype``. Uniform lengths go through batched bmm in chunks of batches; other
    layouts loop over the batch. Returns (total_q, H, 512) in ``dtype``."""
    batch = len(qo) - 1
    total_q, heads, _ = q.shape
    out = torch.zeros(total_q, heads, V_HEAD_DIM, dtype=dtype, device=q.device)
    if batch <= 0:
        return out
    qlens = [qo[i + 1] - qo[i] for i in range(batch)]
    klens = [kv[i + 1] - kv[i] for i in range(batch)]
    elem = torch.finfo(dtype).bits // 8
    uniform = (len(set(qlens)) == 1 and len(set(klens)) == 1 and qo[0] == 0 and kv[0] == 0)
    if uniform and klens[0] > 0 and qlens[0] > 0:
        ql, kl = qlens[0], klens[0]
        per_batch = kl * QK_HEAD_DIM * elem + ql * heads * kl * elem * 3
        chunk = max(1, _CHUNK_BYTES // per_batch)
        for b0 in range(0, batch, chunk):
            b1 = min(batch, b0 + chunk)
            k = k_rows(b0 * kl, b1 * kl).reshape(b1 - b0, kl, QK_HEAD_DIM)
            qb = q[b0 * ql:b1 * ql].reshape(b1 - b0, ql * heads, QK_HEAD_DIM)
            scores = torch.bmm(qb, k.transpose(1, 2)) * sm_scale
            p = torch.softmax(scores, dim=-1)
            o = torch.bmm(p, k[:, :, :V_HEAD_DIM])
            out[b0 * ql:b1 * ql] = o.reshape((b1 - b0) * ql, heads, V_HEAD_DIM)
        return out
    for b in range(batch):
        if qlens[b] <= 0 or klens[b] <= 0:
            continue  # no KV: the output rows stay zero
        k = k_rows(kv[b], kv[b + 1])
        qb = q[qo[b]:qo[b + 1]].reshape(-1, QK_HEAD_DIM)
        p = torch.softmax((qb @ k.T) * sm_scale, dim=-1)
        out[qo[b]:qo[b + 1]] = (p @ k[:, :V_HEAD_DIM]).reshape(qlens[b], heads, V_HEAD_DIM)
    return out


def _sm_scale(config: dict) -> float:
    return float(config.get("sm_scale", SM_SCALE))


def ref_kernel_torch(data: input_t) -> output_t:
    """Portable reference: q quantised per-tensor to fp8 (its own amax), fp8 KV dequantised,
    float32 softmax attention. Works for any indptr; bf16 output."""
    q, kv_data, qo_indptr, kv_indptr, config = data
    kv_fp8, kv_scale = kv_data["fp8"]
    q_fp8, q_scale = quantize_fp8(q, dtype=kv_fp8.dtype)
    q_deq = q_fp8.float() * q_scale
    kv2d = kv_fp8.reshape(kv_fp8.shape[0], -1)
    scale = kv_scale.float()

    def k_rows(a, b):
        return kv2d[a:b].float() * scale

    out = _attention(q_deq, k_rows, _segments(qo_indptr), _segments(kv_indptr),
                     _sm_scale(config), torch.float32)
    return out.to(torch.bfloat16)


# the runner's reference decode: page size 1, 32 KV splits, tiles of 16 KV rows in the work plan
AITER_PAGE_SIZE = 1
AITER_NUM_KV_SPLITS = 32
AITER_KV_GRANULARITY = 16


def ref_kernel_aiter(data: input_t) -> output_t:
    """The runner's reference on MI355X, call for call (docs/runner.md, "The reference and the
    check"): q quantised with quantize_fp8, aiter's persistent a8w8 MLA decode over the fp8 cache
    with page size 1, 32 KV splits, intra-batch mode, and the work plan from get_mla_metadata_v1."""
    import aiter
    from aiter.mla import mla_decode_fwd

    q, kv_data, qo_indptr, kv_indptr, config = data
    kv_fp8, kv_scale = kv_data["fp8"]
    device = q.device
    batch = int(config["batch_size"])
    max_q_len = int(config["q_seq_len"])
    total_kv = kv_fp8.shape[0]

    q_fp8, q_scale = quantize_fp8(q, dtype=kv_fp8.dtype)
    kv_indices = torch.arange(total_kv, dtype=torch.int32, device=device)
    # with page size 1 the "last page length" the runner passes is each batch's KV length
    kv_last_page_len = kv_indptr[1:] - kv_indptr[:-1]

    info = aiter.get_mla_metadata_info_v1(
        batch, max_q_len, NUM_HEADS, q_fp8.dtype, kv_fp8.dtype, is_sparse=False,
        fast_mode=False, num_kv_splits=AITER_NUM_KV_SPLITS, intra_batch_mode=True)
    (work_metadata, work_indptr, work_info_set, reduce_indptr, reduce_final_map,
     reduce_partial_map) = [torch.empty(shape, dtype=dt, device=device) for shape, dt in info]
    aiter.get_mla_metadata_v1(
        qo_indptr, kv_indptr, kv_last_page_len, NUM_HEADS // NUM_KV_HEADS, NUM_KV_HEADS, True,
        work_metadata, work_info_set, work_indptr, reduce_indptr, reduce_final_map,
        reduce_partial_map, page_size=AITER_PAGE_SIZE, kv_granularity=AITER_KV_GRANULARITY,
        max_seqlen_qo=max_q_len, uni_seqlen_qo=max_q_len, fast_mode=False,
        max_split_per_batch=AITER_NUM_KV_SPLITS, intra_batch_mode=True,
        dtype_q=q_fp8.dtype, dtype_kv=kv_fp8.dtype)

    out = torch.empty((q.shape[0], NUM_HEADS, V_HEAD_DIM), dtype=torch.bfloat16, device=device)
    mla_decode_fwd(
        q_fp8, kv_fp8.view(total_kv, AITER_PAGE_SIZE, NUM_KV_HEADS, QK_HEAD_DIM), out, qo_indptr,
        kv_indptr, kv_indices, kv_last_page_len, max_q_len, page_size=AITER_PAGE_SIZE,
        nhead_kv=NUM_KV_HEADS, sm_scale=SM_SCALE, logit_cap=0.0,
        num_kv_splits=AITER_NUM_KV_SPLITS, q_scale=q_scale, kv_scale=kv_scale,
        intra_batch_mode=True, work_meta_data=work_metadata, work_indptr=work_indptr,
        work_info_set=work_info_set, reduce_indptr=reduce_indptr,
        reduce_final_map=reduce_final_map, reduce_partial_map=reduce_partial_map)
    return out


def ref_kernel(data: input_t) -> output_t:
    """The reference output: aiter's a8w8 persistent decode where aiter imports and the data is on
    the GPU (as the runner), else the portable torch version of the same mathematics."""
    if HAVE_AITER and data[0].device.type == "cuda":
        try:
            return ref_kernel_aiter(data)
        except Exception as exc:
            _warn_once("aiter-ref", f"aiter reference failed ({exc!r}); using the torch reference")
    return ref_kernel_torch(data)


def attention_float64(data: input_t) -> torch.Tensor:
    """Exact-ish attention: softmax attention over the BF16 cache with bf16 q, in float64, on the
    data's device (chunked for memory). Returns (total_q, 16, 512) float64."""
    q, kv_data, qo_indptr, kv_indptr, config = data
    kv = kv_data["bf16"]
    kv2d = kv.reshape(kv.shape[0], -1)

    def k_rows(a, b):
        return kv2d[a:b].double()

    return _attention(q.double(), k_rows, _segments(qo_indptr), _segments(kv_indptr),
                      _sm_scale(config), torch.float64)


# ---------------------------------------------------------------------------------------------
# Checks


def rel_l2_error(output: torch.Tensor, data_or_expected) -> float:
    """||output - expected|| / ||expected|| in float64. ``data_or_expected`` is either an input
    tuple (expected = attention_float64(data)) or the expected tensor itself."""
    if isinstance(data_or_expected, torch.Tensor):
        expected = data_or_expected
    else:
        expected = attention_float64(data_or_expected)
    out = output.to(expected.device).double()
    exp = expected.double()
    denom = torch.linalg.vector_norm(exp).item()
    num = torch.linalg.vector_norm(out - exp).item()
    if denom == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / denom


def _mismatch_mask(output: torch.Tensor, expected: torch.Tensor):
    """(tolerance mismatches, non-finite mismatches) as boolean tensors."""
    out = output.float()
    exp = expected.float().to(out.device)
    close = torch.isclose(out, exp, rtol=RTOL, atol=ATOL)
    nonfinite = (torch.isnan(out) ^ torch.isnan(exp)) | (torch.isposinf(out) ^ torch.isposinf(exp)) \
        | (torch.isneginf(out) ^ torch.isneginf(exp))
    return ~close | nonfinite, nonfinite


def mismatch_ratio(output: torch.Tensor, expected: torch.Tensor) -> float:
    """Share of elements outside rtol = atol = 0.1 (NaN/inf mismatches count as outside)."""
    if output.numel() == 0:
        return 0.0
    mism, _ = _mismatch_mask(output, expected)
    return mism.sum().item() / output.numel()


def compare_outputs(output, expected) -> Tuple[bool, str]:
    """The runner's comparison: rtol = atol = 0.1; the MLA rule passes while <= 5% of the elements
    are outside tolerance. Any NaN/inf mismatch fails. The message always states the mismatch
    ratio and the max abs error."""
    if not isinstance(output, torch.Tensor):
        return False, f"output is {type(output).__name__}, not a torch.Tensor"
    if tuple(output.shape) != tuple(expected.shape):
        return False, f"output shape {tuple(output.shape)} != expected {tuple(expected.shape)}"
    out = output.detach().float().to(expected.device)
    exp = expected.float()
    mism, nonfinite = _mismatch_mask(out, exp)
    n = out.numel()
    n_bad = int(mism.sum().item())
    n_nonfinite = int(nonfinite.sum().item())
    ratio = n_bad / n if n else 0.0
    both_finite = torch.isfinite(out) & torch.isfinite(exp)
    diff = (out - exp).abs()[both_finite]
    max_abs = diff.max().item() if diff.numel() else 0.0
    text = (f"mismatch ratio {100 * ratio:.3f}% ({n_bad} of {n} elements outside rtol={RTOL} "
            f"atol={ATOL}; limit {100 * MAX_MISMATCH_RATIO:g}%), max abs error {max_abs:.4g}")
    if n_nonfinite:
        return False, f"{n_nonfinite} NaN/inf mismatches (they always fail); {text}"
    if n_bad == 0:
        return True, text
    if ratio <= MAX_MISMATCH_RATIO:
        return True, f"WARNING: passes by the MLA rule; {text}"
    return False, text


def check_implementation(data: input_t, output: output_t) -> Tuple[bool, str]:
    """Compare ``output`` with ``ref_kernel(data)``: rtol = atol = 0.1 plus the 5% MLA rule.
    Returns (ok, message); the message states the mismatch ratio and max abs error."""
    expected = ref_kernel(data)
    return compare_outputs(output, expected)


# ---------------------------------------------------------------------------------------------
# Serving: the FlashMLA-shaped API (paged cache, any head count, causal multi-token decode)
#
# ``generate_serving_input`` makes the inputs an engine hands ``mla_decode_with_kvcache``,
# ``mla_decode_paged_float64`` is their exact attention and ``check_serving`` applies the strict
# bounds below. Nothing here is the leaderboard's: its runner knows only ``generate_input``.

SERVING_MAX_QSEQLEN = 8
SERVING_MAX_HEADS = 128
SERVING_MAX_PAGE = 128
SERVING_KV_FORMATS = ("bf16", "fp8")
SERVING_KV_BYTES_PER_TOKEN = {"bf16": QK_HEAD_DIM * 2, "fp8": QK_HEAD_DIM}  # 1152 and 576
# block-table entries past a row's used blocks: garbage a kernel must never follow
SERVING_GARBAGE_BLOCKS = (-1, 2147480000)

# The strict bounds. bf16 cache: the kernel's own rounding only (bf16 P and output).
SERVING_OUT_BOUND_BF16 = 0.01  # rel L2 of out over the attended rows
SERVING_LSE_ATOL_BF16 = 1e-3  # |lse error| <= atol + rtol * |lse| on every attended row
SERVING_LSE_RTOL_BF16 = 1e-4
# fp8 cache: the kernel rounds q to fp8 (a scale per program of up to 16 (token, head) rows) and
# keeps P at f16. The bound is the race's rule in submission.py (RACE_BOUND_FACTOR,
# RACE_BOUND_FLOOR, RACE_ERROR_CEILING, held equal by a test): FACTOR x what rounding q to fp8
# with one scale per request alone costs on the same data, plus a floor; out's bound is capped
# at the ceiling so that zeros (rel L2 1.0) fail whatever the data.
SERVING_FP8_FACTOR = 1.25
SERVING_FP8_OUT_FLOOR = 0.02
SERVING_FP8_OUT_CEILING = 0.5
SERVING_FP8_LSE_FLOOR = 1e-2


@dataclasses.dataclass
class ServingInput:
    """One serving case: the API's arguments (q, k_cache, k_scale, block_table, cache_seqlens,
    head_dim_v, softmax_scale, causal) and what made them (the generator's arguments, and
    ``lengths``, the KV length of each request as Python ints)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    k_scale: Optional[torch.Tensor]
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    causal: bool
    softmax_scale: float
    head_dim_v: int
    kv: str
    lengths: List[int]
    batchsize: int
    qseqlen: int
    heads: int
    page: int
    kvseqlen: int
    seed: int
    varlen: bool
    zeros: int
    long: int = 0

    @property
    def attended_tokens(self) -> int:
        """Tokens a kernel must read: every token of every request (the last query token of a
        causal request attends all of them)."""
        return sum(self.lengths)

    @property
    def cache_bytes(self) -> int:
        """Bytes of cache a kernel must read: ``attended_tokens`` x 1152 (bf16) or 576 (fp8)."""
        return self.attended_tokens * SERVING_KV_BYTES_PER_TOKEN[self.kv]


def _flag(field: str, value) -> bool:
    """A 0/1 (or bool) field as a bool, or a ValueError naming ``field``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{field} must be 0 or 1, got {value!r}")


def _at_most(field: str, number: int, most: int) -> int:
    if number > most:
        raise ValueError(f"{field} must be <= {most}, got {number}")
    return number


def check_serving_args(batchsize, qseqlen, heads, page, kvseqlen, seed, *, varlen=False,
                       causal=False, kv="bf16", zeros=0, long=0) -> dict:
    """The arguments of ``generate_serving_input`` checked and normalised (ints, bools), without
    making any tensor: a ValueError names the first bad field. batchsize >= 1; qseqlen 1..8;
    heads 1..128; page a power of two 1..128; kvseqlen >= 1; seed an integer; varlen and causal
    0/1; kv "bf16" or "fp8"; zeros 0..batchsize; long >= 0."""
    batchsize = _whole("batchsize", batchsize, 1)
    qseqlen = _at_most("qseqlen", _whole("qseqlen", qseqlen, 1), SERVING_MAX_QSEQLEN)
    heads = _at_most("heads", _whole("heads", heads, 1), SERVING_MAX_HEADS)
    page = _at_most("page", _whole("page", page, 1), SERVING_MAX_PAGE)
    if page & (page - 1):
        raise ValueError(f"page must be a power of two, got {page}")
    kvseqlen = _whole("kvseqlen", kvseqlen, 1)
    seed = _whole("seed", seed, None)
    if kv not in SERVING_KV_FORMATS:
        raise ValueError(f"kv must be one of {', '.join(SERVING_KV_FORMATS)}, got {kv!r}")
    zeros = _at_most("zeros", _whole("zeros", zeros, 0), batchsize)
    return {"batchsize": batchsize, "qseqlen": qseqlen, "heads": heads, "page": page,
            "kvseqlen": kvseqlen, "seed": seed, "varlen": _flag("varlen", varlen),
            "causal": _flag("causal", causal), "kv": kv, "zeros": zeros, "long": _whole("long", long, 0)}


def zero_rows(batchsize: int, zeros: int) -> List[int]:
    """The ``zeros`` requests of a batch that get length 0 (padded graph rows), spread evenly over
    the batch starting at request 0: 8 requests, 2 zeros -> [0, 4]."""
    return [i * batchsize // zeros for i in range(zeros)]


def serving_lengths(batchsize: int, qseqlen: int, kvseqlen: int, seed: int, *, varlen: bool,
                    zeros: int, long: int = 0) -> List[int]:
    """Each request's KV length, as FlashMLA's own benchmark makes them: ``kvseqlen`` each, or
    with ``varlen`` int(max(normal(kvseqlen, kvseqlen / 2), qseqlen)) from Python's generator
    seeded with ``seed`` (the same on every machine); ``long`` (if not 0) the last request's
    instead (one long request among short ones: 127 of 1k and one of 64k); then the ``zero_rows``
    get 0. Every request draws its length, so a case with zeros has the lengths of the same case
    without them elsewhere."""
    if varlen:
        rng = random.Random(seed)
        lengths = [int(max(rng.normalvariate(kvseqlen, kvseqlen / 2), qseqlen))
                   for _ in range(batchsize)]
    else:
        lengths = [kvseqlen] * batchsize
    if long:
        lengths[-1] = long
    for row in zero_rows(batchsize, zeros):
        lengths[row] = 0
    return lengths


def _block_layout(lengths: List[int], page: int, seed: int):
    """(block table as a CPU int32 tensor, tokens filled in each block, number of blocks).

    Request b gets ceil(len/page) blocks, taken in turn from a random permutation (a CPU torch
    generator seeded with ``seed``) of all the blocks; there are used // 8 + 1 spare blocks no
    request uses. The table is one column wider than the most blocks a request uses, and every
    entry past a row's used blocks is garbage, -1 and 2147480000 alternating."""
    used = [-(-n // page) for n in lengths]
    total_used = sum(used)
    num_blocks = total_used + total_used // 8 + 1
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int64)
    width = max(used) + 1
    parity = (torch.arange(len(lengths))[:, None] + torch.arange(width)[None, :]) % 2
    table = torch.where(parity == 0, SERVING_GARBAGE_BLOCKS[0], SERVING_GARBAGE_BLOCKS[1])
    fill = torch.zeros(num_blocks, dtype=torch.int64)
    start = 0
    for b, (n, nb) in enumerate(zip(lengths, used, strict=True)):
        blocks = perm[start:start + nb]
        start += nb
        table[b, :nb] = blocks
        if nb:
            fill[blocks] = page
            fill[blocks[-1]] = n - (nb - 1) * page
    return table.to(torch.int32), fill, num_blocks


def _unused_slots(fill: torch.Tensor, page: int, device) -> torch.Tensor:
    """Boolean (num_blocks, page): the slots past each block's ``fill`` count, which no request
    attends."""
    slot = torch.arange(page, device=device)
    return slot[None, :] >= fill.to(device)[:, None]


def _nan_fill(k_cache: torch.Tensor, unused: torch.Tensor) -> None:
    """Write NaN into the ``unused`` slots of ``k_cache`` (num_blocks, page, 1, 576); fp8
    caches get their format's NaN byte (0x7f for e4m3fn, 0x80 for e4m3fnuz)."""
    if k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        nan_byte = torch.tensor(float("nan")).to(k_cache.dtype).view(torch.uint8).item()
        k_cache.view(torch.uint8)[unused] = nan_byte
    else:
        k_cache[unused] = float("nan")


def generate_serving_input(batchsize: int, qseqlen: int, heads: int, page: int, kvseqlen: int,
                           seed: int, *, varlen: bool = False, causal: bool = False,
                           kv: str = "bf16", zeros: int = 0, long: int = 0,
                           device: Union[None, str, torch.device] = None) -> ServingInput:
    """A serving case for ``mla_decode_with_kvcache``: ``batchsize`` requests of ``qseqlen``
    query tokens and ``heads`` query heads over a paged cache of ``page`` tokens per block.

    - Lengths: ``serving_lengths`` (FlashMLA's benchmark: fixed, or normal around kvseqlen with
      std kvseqlen / 2, at least qseqlen; the last one ``long`` where given; ``zeros`` requests
      get 0).
    - Values: a generator on the device seeded with ``seed`` draws q = randn (batch, qseqlen,
      heads, 576) bf16, then the cache randn (num_blocks, page, 1, 576) bf16. q is randn, not
      FlashMLA's randn / 10: the leaderboard's q and FlashMLA's dense decode test are randn, and
      scores of std 1 make a peaked softmax that shows a wrong token or a wrong max; randn / 10
      against a randn cache gives scores of std 0.1, an almost flat softmax. kv "fp8": the cache
      quantised with ``quantize_fp8`` (per tensor, over the attended slots' values: the others
      are zeroed first; ``k_scale`` its float32 scale of shape (1,)).
    - Layout: ``_block_layout`` (blocks from a random permutation, spare blocks, garbage entries
      past each row's used blocks). Every slot no request attends (spare blocks and the tail of
      each request's last block) holds NaN, so that a kernel reading one shows it.

    Lengths and layout come from CPU generators (the same on every device); values from the
    device's (CPU and GPU streams differ). Arguments are checked first (``check_serving_args``).
    """
    args = check_serving_args(batchsize, qseqlen, heads, page, kvseqlen, seed, varlen=varlen,
                              causal=causal, kv=kv, zeros=zeros, long=long)
    device = get_device(device)
    lengths = serving_lengths(args["batchsize"], args["qseqlen"], args["kvseqlen"], args["seed"],
                              varlen=args["varlen"], zeros=args["zeros"], long=args["long"])
    table, fill, num_blocks = _block_layout(lengths, args["page"], args["seed"])
    gen = torch.Generator(device=device)
    gen.manual_seed(args["seed"])
    q = torch.randn((args["batchsize"], args["qseqlen"], args["heads"], QK_HEAD_DIM),
                    dtype=torch.bfloat16, device=device, generator=gen)
    k_cache = torch.randn((num_blocks, args["page"], NUM_KV_HEADS, QK_HEAD_DIM),
                          dtype=torch.bfloat16, device=device, generator=gen)
    unused = _unused_slots(fill, args["page"], device)
    k_scale = None
    if args["kv"] == "fp8":
        k_cache[unused] = 0.0  # the scale is the attended values' own
        k_cache, k_scale = quantize_fp8(k_cache, dtype=fp8_dtype(device))
    _nan_fill(k_cache, unused)
    return ServingInput(
        q=q, k_cache=k_cache, k_scale=k_scale, block_table=table.to(device),
        cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=device),
        causal=args["causal"], softmax_scale=SM_SCALE, head_dim_v=V_HEAD_DIM, kv=args["kv"],
        lengths=lengths, batchsize=args["batchsize"], qseqlen=args["qseqlen"],
        heads=args["heads"], page=args["page"], kvseqlen=args["kvseqlen"], seed=args["seed"],
        varlen=args["varlen"], zeros=args["zeros"], long=args["long"])


def _scale_float64(k_scale, device) -> Optional[torch.Tensor]:
    """``k_scale`` (None, a Python float or a one-element tensor) as a float64 scalar tensor."""
    if k_scale is None:
        return None
    if isinstance(k_scale, torch.Tensor):
        if k_scale.numel() != 1:
            raise ValueError(f"k_scale must hold one element, got shape {tuple(k_scale.shape)}")
        return k_scale.detach().reshape(()).to(device=device, dtype=torch.float64)
    return torch.tensor(float(k_scale), dtype=torch.float64, device=device)


def _request_keys(k_cache: torch.Tensor, block_table: torch.Tensor, b: int, length: int,
                  scale: Optional[torch.Tensor]) -> torch.Tensor:
    """Request b's ``length`` tokens as float64 (length, 576), dequantised with ``scale`` when
    given. Only the slots of its tokens are read: the table's first ceil(length / page) entries
    of row b, and in the last block only the slots below length (never a spare or tail slot,
    never a garbage entry)."""
    page = k_cache.shape[1]
    fp8 = k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
    flat = (k_cache.view(torch.uint8) if fp8 else k_cache).reshape(-1, k_cache.shape[-1])
    blocks = block_table[b, :-(-length // page)].to(torch.int64)
    pos = torch.arange(length, device=k_cache.device)
    rows = flat[blocks.to(k_cache.device)[pos // page] * page + pos % page]
    keys = (rows.view(k_cache.dtype) if fp8 else rows).to(torch.float64)
    return keys * scale if scale is not None else keys


def mla_decode_paged_float64(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                             cache_seqlens: torch.Tensor, *, k_scale=None,
                             softmax_scale: Optional[float] = None, causal: bool = False):
    """Exact attention of the serving API in float64, on the inputs' device.

    q (batch, s_q, h_q, 576) in any float dtype; k_cache (num_blocks, page, 1, 576) bf16, or fp8
    with ``k_scale`` (value = fp8 * k_scale); token p of request b at k_cache[block_table[b, p //
    page], p % page]. softmax_scale defaults to 1/sqrt(576). Causal: query token i attends the
    first cache_seqlens[b] - s_q + i + 1 tokens; else all cache_seqlens[b].

    Returns (out float64 (batch, s_q, h_q, 512), lse float64 (batch, h_q, s_q)): lse the natural
    log of the sum of exp(softmax_scale * q.k) over the attended tokens. Rows that attend nothing
    (length 0, or a causal query with no token): out 0, lse +inf. One request at a time (its keys
    in float64, its scores), so memory stays at one request's size; only the slots of attended
    tokens are read (``_request_keys``)."""
    batch, s_q, heads, dim = q.shape
    device = q.device
    scale = SM_SCALE if softmax_scale is None else float(softmax_scale)
    kscale = _scale_float64(k_scale, device)
    out = torch.zeros(batch, s_q, heads, V_HEAD_DIM, dtype=torch.float64, device=device)
    lse = torch.full((batch, heads, s_q), float("inf"), dtype=torch.float64, device=device)
    lengths = [int(n) for n in cache_seqlens.tolist()]
    for b, length in enumerate(lengths):
        if length <= 0:
            continue
        keys = _request_keys(k_cache, block_table, b, length, kscale).to(device)
        scores = (q[b].double().reshape(s_q * heads, dim) @ keys.T) * scale
        if causal:
            limit = (length - s_q + 1 + torch.arange(s_q, device=device)).clamp(0, length)
            limit = limit.repeat_interleave(heads)
            pos = torch.arange(length, device=device)
            scores = scores.masked_fill(pos[None, :] >= limit[:, None], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)
        attended = torch.isfinite(row_lse)
        probs = torch.exp(scores - torch.where(attended, row_lse, 0.0)[:, None])
        out[b] = (probs @ keys[:, :V_HEAD_DIM]).reshape(s_q, heads, V_HEAD_DIM)
        row_lse = torch.where(attended, row_lse, float("inf"))
        lse[b] = row_lse.reshape(s_q, heads).T
    return out, lse


def attended_rows(lengths: Sequence[int], s_q: int, heads: int, causal: bool,
                  device: Union[None, str, torch.device] = None) -> torch.Tensor:
    """Boolean (batch, s_q, h_q): whether each (request, query token, head) row attends any token
    (length > 0, and for a causal query token i, length - s_q + i + 1 > 0)."""
    lens = torch.tensor(list(lengths), dtype=torch.int64, device=device)[:, None]
    if causal:
        limit = lens - s_q + 1 + torch.arange(s_q, device=device)[None, :]
    else:
        limit = lens.expand(-1, s_q)
    return (limit > 0)[:, :, None].expand(-1, -1, heads)


def round_q_fp8_per_request(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q rounded to fp8 ``dtype`` with one scale per request (amax of its (s_q, h_q, 576) values
    / fp8 max, clamped below at 1e-12), in float32, returned dequantised as float32: what the fp8
    rounding of q alone costs, the yardstick of the fp8 bounds."""
    finfo = torch.finfo(dtype)
    x = q.float()
    amax = x.abs().amax(dim=(1, 2, 3), keepdim=True).clamp(min=1e-12)
    scale = amax / finfo.max
    return (x / scale).clamp(finfo.min, finfo.max).to(dtype).float() * scale


def serving_out_bound(kv: str, fp8_reach: Optional[float] = None) -> float:
    """The bound on out's rel L2 over the attended rows: 0.01 for a bf16 cache; for an fp8 cache
    1.25 x ``fp8_reach`` (the rel L2 of the per-request fp8-rounded-q reference) + 0.02, at most
    0.5."""
    if kv == "bf16":
        return SERVING_OUT_BOUND_BF16
    return min(SERVING_FP8_FACTOR * float(fp8_reach) + SERVING_FP8_OUT_FLOOR,
               SERVING_FP8_OUT_CEILING)


def serving_lse_bound(kv: str, lse_ref: torch.Tensor,
                      fp8_reach: Optional[float] = None) -> torch.Tensor:
    """The bound on each attended row's |lse error|, shaped like ``lse_ref``: 1e-3 + 1e-4 x |lse|
    for a bf16 cache; for an fp8 cache 1.25 x ``fp8_reach`` (the max |lse error| of the
    per-request fp8-rounded-q reference) + 1e-2 on every row."""
    if kv == "bf16":
        return SERVING_LSE_ATOL_BF16 + SERVING_LSE_RTOL_BF16 * lse_ref.abs()
    bound = SERVING_FP8_FACTOR * float(fp8_reach) + SERVING_FP8_LSE_FLOOR
    return torch.full_like(lse_ref, bound)


@dataclasses.dataclass
class ServingExpected:
    """What a serving case's outputs are judged against, computed once per input: the float64
    reference (out, lse), the attended rows (batch, s_q, h_q), the fp8 reaches (None for bf16)
    and the bounds (out: one number; lse: one per (batch, h_q, s_q) row)."""

    out: torch.Tensor
    lse: torch.Tensor
    attended: torch.Tensor
    kv: str
    out_bound: float
    lse_bound: torch.Tensor
    fp8_out_reach: Optional[float] = None
    fp8_lse_reach: Optional[float] = None


def _max_abs(x: torch.Tensor) -> float:
    return float(x.abs().max()) if x.numel() else 0.0


def serving_expected(inputs: ServingInput) -> ServingExpected:
    """The float64 reference of ``inputs`` and its bounds; for an fp8 cache also the reference
    with q rounded by ``round_q_fp8_per_request`` (the reaches the fp8 bounds scale)."""
    args = dict(k_scale=inputs.k_scale, softmax_scale=inputs.softmax_scale, causal=inputs.causal)
    out, lse = mla_decode_paged_float64(inputs.q, inputs.k_cache, inputs.block_table,
                                        inputs.cache_seqlens, **args)
    attended = attended_rows(inputs.lengths, inputs.qseqlen, inputs.heads, inputs.causal,
                             inputs.q.device)
    lse_attended = attended.permute(0, 2, 1)
    out_reach = lse_reach = None
    if inputs.kv == "fp8":
        q8 = round_q_fp8_per_request(inputs.q, inputs.k_cache.dtype)
        out8, lse8 = mla_decode_paged_float64(q8, inputs.k_cache, inputs.block_table,
                                              inputs.cache_seqlens, **args)
        out_reach = rel_l2_error(out8[attended], out[attended])
        lse_reach = _max_abs((lse8 - lse)[lse_attended])
    return ServingExpected(out=out, lse=lse, attended=attended, kv=inputs.kv,
                           out_bound=serving_out_bound(inputs.kv, out_reach),
                           lse_bound=serving_lse_bound(inputs.kv, lse, lse_reach),
                           fp8_out_reach=out_reach, fp8_lse_reach=lse_reach)


def _output_problems(out, lse, expected: ServingExpected) -> List[str]:
    """Type, shape, dtype and device problems of (out, lse): out (batch, s_q, h_q, 512) bf16, lse
    (batch, h_q, s_q) float32, both on the inputs' device."""
    problems = []
    for name, value, shape, dtype in (("out", out, expected.out.shape, torch.bfloat16),
                                      ("lse", lse, expected.lse.shape, torch.float32)):
        if not isinstance(value, torch.Tensor):
            problems.append(f"{name} is {type(value).__name__}, not a Tensor")
            continue
        if tuple(value.shape) != tuple(shape):
            problems.append(f"{name} shape {tuple(value.shape)} != {tuple(shape)}")
        if value.dtype != dtype:
            problems.append(f"{name} dtype {value.dtype} != {dtype}")
        if value.device != expected.out.device:
            problems.append(f"{name} device {value.device} != {expected.out.device}")
    return problems


def judge_serving(expected: ServingExpected, out, lse) -> dict:
    """Apply every serving check to (out, lse); a dict of the measured numbers and the verdict.

    Keys: ok, problems (list of text), out_rel_l2 / out_bound (attended rows), lse_err (max
    |lse error| over attended rows) / lse_bound (the bound at that row) / lse_fraction (max
    error / bound over the rows: 1.0 = at the bound), nonfinite (non-finite values of out or lse
    on attended rows), zero_rows (rows that attend nothing; their out must be exactly 0 and their
    lse +inf), fp8_out_reach / fp8_lse_reach. A NaN where the reference is finite always fails;
    so does any output of the wrong type, shape, dtype or device (then nothing else is
    measured)."""
    verdict = {"ok": False, "problems": _output_problems(out, lse, expected), "out_rel_l2": None,
               "out_bound": expected.out_bound, "lse_err": None, "lse_bound": None,
               "lse_fraction": None, "nonfinite": None,
               "zero_rows": int((~expected.attended).sum()),
               "fp8_out_reach": expected.fp8_out_reach, "fp8_lse_reach": expected.fp8_lse_reach}
    if verdict["problems"]:
        return verdict
    problems = verdict["problems"]
    att = expected.attended
    att_lse = att.permute(0, 2, 1)
    out64, lse64 = out.detach().double(), lse.detach().double()
    nonfinite = int((~torch.isfinite(out64[att])).sum() + (~torch.isfinite(lse64[att_lse])).sum())
    verdict["nonfinite"] = nonfinite
    if nonfinite:
        problems.append(f"{nonfinite} NaN/inf values in out or lse on rows that attend tokens")
    if bool(att.any()):
        rel = rel_l2_error(out64[att], expected.out[att])
        verdict["out_rel_l2"] = rel
        if not rel <= expected.out_bound:
            problems.append(f"out rel L2 {rel:.4g} > bound {expected.out_bound:.4g}")
        err = (lse64 - expected.lse)[att_lse].abs()
        bound = expected.lse_bound[att_lse]
        ratio = err / bound
        worst = int(torch.argmax(torch.nan_to_num(ratio, nan=float("inf"))))
        verdict["lse_err"] = float(err.max())
        verdict["lse_bound"] = float(bound[worst])
        verdict["lse_fraction"] = float(ratio[worst])
        if not verdict["lse_fraction"] <= 1.0:
            problems.append(f"lse error {float(err[worst]):.3g} > bound {float(bound[worst]):.3g}"
                            f" (max |lse error| {verdict['lse_err']:.3g})")
    if verdict["zero_rows"]:
        bad_out = int((out64[~att] != 0).any(dim=-1).sum())
        bad_lse = int((lse64[~att_lse] != float("inf")).sum())
        if bad_out or bad_lse:
            problems.append(f"rows that attend nothing: {bad_out} of {verdict['zero_rows']} have "
                            f"out != 0, {bad_lse} have lse != +inf")
    verdict["ok"] = not problems
    return verdict


def serving_message(verdict: dict) -> str:
    """One line: the problems (if any) first, then the measured errors against their bounds."""
    parts = []
    if verdict.get("out_rel_l2") is not None:
        parts.append(f"out rel L2 {verdict['out_rel_l2']:.4g} (bound {verdict['out_bound']:.4g})")
    if verdict.get("lse_err") is not None:
        parts.append(f"lse max abs error {verdict['lse_err']:.3g} (bound {verdict['lse_bound']:.3g}"
                     f" at the row closest to its bound, {100 * verdict['lse_fraction']:.0f}%)")
    if verdict.get("fp8_out_reach") is not None:
        parts.append(f"fp8-rounded q alone: out rel L2 {verdict['fp8_out_reach']:.4g}, lse error "
                     f"{verdict['fp8_lse_reach']:.3g}")
    if verdict.get("zero_rows"):
        parts.append(f"{verdict['zero_rows']} rows attend nothing")
    measured = "; ".join(parts) if parts else "no row attends anything"
    if verdict["problems"]:
        return "; ".join(verdict["problems"]) + " | " + measured
    return measured


def check_serving(inputs: ServingInput, out, lse,
                  expected: Optional[ServingExpected] = None) -> Tuple[bool, str]:
    """The strict serving check of (out, lse) from ``mla_decode_with_kvcache(inputs...)``:
    ``judge_serving`` against ``serving_expected(inputs)`` (pass ``expected`` to reuse one).
    Returns (ok, message); the message states the errors and their bounds."""
    if expected is None:
        expected = serving_expected(inputs)
    verdict = judge_serving(expected, out, lse)
    return verdict["ok"], serving_message(verdict)


# ---------------------------------------------------------------------------------------------
# Sparse decode: DeepSeek-V3.2's top-k indices over FlashMLA's 656-byte fp8 cache
#
# The layout and its quantiser are FlashMLA's (commit 9241ae3): flash_mla/flash_mla_interface.py
# documents each token's 656 bytes (512 float8_e4m3fn latent values in 4 tiles of 128, the tiles'
# 4 float32 scales, the 64 rope values in bf16); tests/quant.py's quantize_k_cache makes them,
# each tile's scale amax / 448 rounded UP to a power of two (_cast_scale_inv_to_ue8m0: 2 **
# ceil(log2(max(amax / 448, 1e-4)))), value = fp8 x scale. `indices` (batch, s_q, topk) int32
# hold block id x page_size + offset of each attended token, -1 skipping an entry; topk_length
# (batch,) int32, optional, keeps the first topk_length[b] entries (tests/ref.py's
# ref_sparse_attn_decode). What FlashMLA leaves undefined is defined here as the serving API does
# for bad inputs: an entry below -1 or at or past num_blocks x page_size, or a topk_length outside
# [0, topk], makes that query NaN (out and lse); a query with nothing to attend has out 0 and lse
# +inf.
#
# q in the references: a kernel is judged against float64 attention computed with the q it
# multiplies, bf16 as given (FlashMLA's sparse decode) or fp8 (``round_q_sparse_fp8``: the cache's
# tile rule applied to each head's 512 latent dims, rope kept bf16), ``sparse_expected(inputs, q_format)``;
# the format's own error and the bounds are then measured with that same q.

SPARSE_TOKEN_BYTES = 656  # 512 fp8 latent + 4 float32 scales + 64 bf16 rope
SPARSE_TILE = 128  # latent values per scale
SPARSE_TILES = KV_LORA_RANK // SPARSE_TILE  # 4
SPARSE_SCALES_AT = KV_LORA_RANK  # byte 512: the 4 float32 scales
SPARSE_ROPE_AT = SPARSE_SCALES_AT + 4 * SPARSE_TILES  # byte 528: the 64 bf16 rope values
SPARSE_FP8_MAX = 448.0  # float8_e4m3fn's largest value
SPARSE_SCALE_FLOOR = 1e-4  # FlashMLA's clamp of amax / 448 before rounding up to a power of two
SPARSE_MAX_TOPK = 16384  # the largest topk FlashMLA's benchmark runs
SPARSE_HOLES = 8  # one entry in this many (of those that select a token) becomes -1
# each token's latent tiles scaled by 2 ** U(-1.5, 1.5): a token's four scales differ (randn alone
# gives them one power of two), so that a scale read for the wrong tile shows
SPARSE_TILE_SPREAD = 1.5
# entries past a request's topk_length: garbage that must never be read nor poison the query
SPARSE_GARBAGE_ENTRIES = (2147480000, -7)
# out against the reference over the dequantised cache (the kernel's own rounding): the serving
# API's bf16 bounds; against the reference over the bf16 values: FACTOR x the format's own error
SPARSE_FORMAT_FACTOR = 1.25
SPARSE_LSE_FLOOR = 1e-3  # added to the lse bound against the bf16 values (per-row spread)
SPARSE_OUT_CEILING = 0.5  # zeros (rel L2 1.0) fail whatever the format's error
# the q a sparse kernel multiplies: bf16 as given, or its latent dims rounded to fp8 (round_q_sparse_fp8)
SPARSE_Q_FORMATS = ("bf16", "fp8")
# a kernel with q in fp8 multiplies it by fp8 MMA, whose accumulator keeps 13 mantissa bits after each
# k-step of 32 dims: the lse bound against the dequantised cache grows by that (sparse_fp8_mma_slack)
SPARSE_FP8_MMA_BITS = 13
SPARSE_FP8_MMA_K = 32


def _sparse_bytes(cache: torch.Tensor) -> torch.Tensor:
    """The 656-byte cache as uint8 (float8_e4m3fn, int8 and uint8 caches all hold the bytes)."""
    return cache if cache.dtype == torch.uint8 else cache.view(torch.uint8)


def quantize_sparse_cache(values: torch.Tensor) -> torch.Tensor:
    """FlashMLA's V3.2 fp8 cache of ``values`` (num_blocks, page, 1, 576), any float dtype:
    (num_blocks, page, 1, 656) float8_e4m3fn, each token's bytes as flash_mla_interface.py lays
    them out. Per 128-value tile: scale = 2 ** ceil(log2(max(amax / 448, 1e-4))) in float32, the
    fp8 values (tile / scale) rounded to nearest (|tile / scale| <= 448 by the scale's choice);
    the rope values copied as bf16. The arithmetic is tests/quant.py's quantize_k_cache
    (float32 division by the power-of-two scale, torch's rounding cast)."""
    if values.dim() != 4 or values.shape[2] != NUM_KV_HEADS or values.shape[3] != QK_HEAD_DIM:
        raise ValueError(f"values must be (num_blocks, page, 1, {QK_HEAD_DIM}), got {tuple(values.shape)}")
    num_blocks, page = values.shape[:2]
    flat = values.reshape(num_blocks, page, QK_HEAD_DIM)
    out = torch.empty(num_blocks, page, SPARSE_TOKEN_BYTES, dtype=torch.uint8, device=values.device)
    tiles = flat[..., :KV_LORA_RANK].float().reshape(num_blocks, page, SPARSE_TILES, SPARSE_TILE)
    amax = tiles.abs().amax(dim=-1) / SPARSE_FP8_MAX
    scales = torch.pow(2.0, amax.clamp_min(SPARSE_SCALE_FLOOR).log2().ceil()).to(torch.float32)
    latent = (tiles / scales[..., None]).to(torch.float8_e4m3fn)
    out[..., :SPARSE_SCALES_AT] = latent.reshape(num_blocks, page, KV_LORA_RANK).view(torch.uint8)
    out[..., SPARSE_SCALES_AT:SPARSE_ROPE_AT] = scales.view(torch.uint8).reshape(num_blocks, page, -1)
    rope = flat[..., KV_LORA_RANK:].to(torch.bfloat16).contiguous()
    out[..., SPARSE_ROPE_AT:] = rope.view(torch.uint8).reshape(num_blocks, page, -1)
    return out.view(torch.float8_e4m3fn).reshape(num_blocks, page, NUM_KV_HEADS, SPARSE_TOKEN_BYTES)


def _power_of_two_at_least(x: torch.Tensor) -> torch.Tensor:
    """The least power of two >= each (positive, finite) float32 of ``x``, exactly: frexp gives x =
    m x 2 ** e with m in [0.5, 1); m == 0.5 is a power of two already (2 ** (e - 1)), any other m
    rounds up to 2 ** e. (log2 then ceil in float32 can round a value just above a power of two
    down onto it.)"""
    mantissa, exponent = torch.frexp(x)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.ldexp(torch.ones_like(x), exponent)


def round_q_sparse_fp8(q: torch.Tensor) -> torch.Tensor:
    """q (..., 576), any float dtype, as float32 with its 512 latent dims rounded as an fp8 sparse
    kernel rounds them before Q.K^T; the 64 rope dims as they are (bf16 q: exactly its values).

    The rule, per (batch, query token, head), over its 512 latent dims with the cache's tile rule
    (``quantize_sparse_cache``; SPARSE_FP8_MAX, SPARSE_SCALE_FLOOR) applied to the whole row: amax
    = max |q| over the 512 dims in float32; scale = 2 ** ceil(log2(max(amax / 448, 1e-4))), amax /
    448 a float32 division and the rounding up to a power of two exact (a power of two stays
    itself); q8 = (q / scale).to(float8_e4m3fn), round to nearest even (|q / scale| <= 448 by the
    scale's choice); the value q8 x scale. One scale a head (not a tile: the cache's per-entry
    tile scales already make four partial products of Q.K^T; a q scale per head leaves one
    product per tile and one row scaling): e4m3's mantissa is the same at any scale, so only
    values below 2^-6 x scale (fp8's subnormals) round more coarsely than with a scale a tile. A
    head of zeros stays zeros (scale 2 ** -13)."""
    if q.shape[-1] != QK_HEAD_DIM:
        raise ValueError(f"q must be (..., {QK_HEAD_DIM}), got {tuple(q.shape)}")
    q32 = q.float()
    latent = q32[..., :KV_LORA_RANK]
    amax = latent.abs().amax(dim=-1, keepdim=True) / SPARSE_FP8_MAX
    scale = _power_of_two_at_least(amax.clamp_min(SPARSE_SCALE_FLOOR))
    latent = (latent / scale).to(torch.float8_e4m3fn).float() * scale
    return torch.cat([latent, q32[..., KV_LORA_RANK:]], dim=-1)


def dequantize_sparse_rows(rows: torch.Tensor) -> torch.Tensor:
    """Tokens of the 656-byte layout, (..., 656) of any byte dtype, as float64 (..., 576): each
    latent value fp8 x its tile's scale, then the rope values."""
    raw = _sparse_bytes(rows).contiguous()
    lead = raw.shape[:-1]
    raw = raw.reshape(-1, SPARSE_TOKEN_BYTES)
    latent = raw[:, :SPARSE_SCALES_AT].view(torch.float8_e4m3fn).double()
    scales = raw[:, SPARSE_SCALES_AT:SPARSE_ROPE_AT].contiguous().view(torch.float32).double()
    rope = raw[:, SPARSE_ROPE_AT:].contiguous().view(torch.bfloat16).double()
    latent = (latent.reshape(-1, SPARSE_TILES, SPARSE_TILE) * scales[..., None]).reshape(-1, KV_LORA_RANK)
    return torch.cat([latent, rope], dim=-1).reshape(*lead, QK_HEAD_DIM)


def dequantize_sparse_cache(cache: torch.Tensor) -> torch.Tensor:
    """The whole 656-byte cache (num_blocks, page, 1, 656) as float64 (num_blocks, page, 1, 576)."""
    return dequantize_sparse_rows(cache)


def is_sparse_layout(k_cache: torch.Tensor) -> bool:
    """Whether ``k_cache`` holds FlashMLA's 656-byte tokens (else it holds 576 values per token)."""
    return k_cache.shape[-1] == SPARSE_TOKEN_BYTES and k_cache.element_size() == 1


def sparse_rows(k_cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Tokens ``index`` (int64, each in [0, num_blocks x page)) of a cache as float64 (n, 576): a
    656-byte cache dequantised, a (num_blocks, page, 1, 576) float cache as it is. Only those
    tokens are read (any block stride: block index // page, row index % page)."""
    page = k_cache.shape[1]
    index = index.to(k_cache.device)
    rows = k_cache[index // page, index % page, 0]
    return dequantize_sparse_rows(rows) if is_sparse_layout(k_cache) else rows.double()


def _sparse_queries(k_cache: torch.Tensor, indices: torch.Tensor, topk_length: Optional[torch.Tensor]):
    """Each query token of a sparse call as (batch, token, keys, poisoned): keys the float64
    (tokens, 576) rows its entries select (``sparse_rows``, -1 skipped), None where it attends
    nothing or is poisoned (an entry below -1 or at or past num_blocks x page, or a topk_length
    outside [0, topk]). Only the listed tokens are read, one query at a time."""
    batch, s_q, topk = indices.shape
    capacity = k_cache.shape[0] * k_cache.shape[1]
    lengths = [topk] * batch if topk_length is None else [int(n) for n in topk_length.tolist()]
    entries = indices.to(dtype=torch.int64)
    for b in range(batch):
        for t in range(s_q):
            if not 0 <= lengths[b] <= topk:
                yield b, t, None, True
                continue
            row = entries[b, t, :lengths[b]]
            if bool(((row < -1) | (row >= capacity)).any()):
                yield b, t, None, True
                continue
            row = row[row >= 0]
            yield b, t, (sparse_rows(k_cache, row) if row.numel() else None), False


def mla_decode_sparse_float64(q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor,
                              topk_length: Optional[torch.Tensor] = None,
                              softmax_scale: Optional[float] = None):
    """Exact sparse attention in float64, on the inputs' device.

    q (batch, s_q, h_q, 576) any float dtype; k_cache either FlashMLA's 656-byte cache (num_blocks,
    page, 1, 656), dequantised, or a (num_blocks, page, 1, 576) float cache (the values before
    quantisation: the format's own error); indices (batch, s_q, topk) int32, entry = block x page
    + offset, -1 skips; topk_length (batch,) or None: only the first topk_length[b] entries of
    request b count. softmax_scale defaults to 1/sqrt(576).

    Returns (out float64 (batch, s_q, h_q, 512), lse float64 (batch, h_q, s_q)), lse the natural log
    of the sum of exp(softmax_scale * q.k) over the query's entries (a token listed twice counts
    twice, as in FlashMLA's reference). A query with nothing to attend: out 0, lse +inf. A query
    with an entry below -1 or at or past num_blocks x page, or whose request's topk_length is
    outside [0, topk]: out and lse NaN (``_sparse_queries``)."""
    return _sparse_float64(q, k_cache, indices, topk_length, softmax_scale)[:2]


def _sparse_float64(q, k_cache, indices, topk_length, softmax_scale, with_slack=False):
    """(out, lse, slack): ``mla_decode_sparse_float64``'s out and lse and, with ``with_slack``,
    ``sparse_fp8_mma_slack``'s slack (else None), from one pass over the queries' rows."""
    batch, s_q, heads, dim = q.shape
    device = q.device
    scale = SM_SCALE if softmax_scale is None else float(softmax_scale)
    out = torch.zeros(batch, s_q, heads, V_HEAD_DIM, dtype=torch.float64, device=device)
    lse = torch.full((batch, heads, s_q), float("inf"), dtype=torch.float64, device=device)
    slack = torch.zeros(batch, heads, s_q, dtype=torch.float64, device=device) if with_slack else None
    for b, t, keys, poisoned in _sparse_queries(k_cache, indices, topk_length):
        if poisoned:
            out[b, t], lse[b, :, t] = float("nan"), float("nan")
        if keys is None:
            continue
        keys = keys.to(device)
        q_row = q[b, t].double()
        scores = (q_row @ keys.T) * scale  # (heads, tokens)
        row_lse = torch.logsumexp(scores, dim=-1)
        out[b, t] = torch.exp(scores - row_lse[:, None]) @ keys[:, :V_HEAD_DIM]
        lse[b, :, t] = row_lse
        if with_slack:
            slack[b, :, t] = _fp8_mma_slack_of(q_row, keys) * scale
    return out, lse, slack


def _fp8_mma_slack_of(q_row, keys):
    """Per head, the largest over ``keys`` (tokens, 576) of 2^-SPARSE_FP8_MMA_BITS x the sum, over
    the 4 latent tiles and their SPARSE_FP8_MMA_K-dim steps, of |the tile's partial q.k after the
    step| (q_row: (heads, 576) float64); ``sparse_fp8_mma_slack`` says why."""
    heads, step = q_row.shape[0], SPARSE_FP8_MMA_K
    qs = q_row[:, :KV_LORA_RANK].reshape(heads, -1, step)  # (heads, steps, k)
    ks = keys[:, :KV_LORA_RANK].reshape(keys.shape[0], -1, step)  # (tokens, steps, k)
    products = torch.einsum("hsk,nsk->hns", qs, ks)  # each step's q.k
    partial = products.reshape(heads, keys.shape[0], SPARSE_TILES, -1).cumsum(-1)  # within each tile
    return partial.abs().sum((-2, -1)).max(dim=-1).values * 2.0 ** -SPARSE_FP8_MMA_BITS


def sparse_fp8_mma_slack(q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor,
                         topk_length: Optional[torch.Tensor] = None,
                         softmax_scale: Optional[float] = None) -> torch.Tensor:
    """What fp8 MMA's accumulation may add to each row's lse (batch, h_q, s_q) float64, 0 on rows
    that attend nothing or are poisoned; q and the cache as ``mla_decode_sparse_float64`` takes
    them (q: the fp8-rounded q the kernel multiplies).

    The model: an fp8 tensor core keeps its accumulator to SPARSE_FP8_MMA_BITS mantissa bits,
    truncated, after each k-step of SPARSE_FP8_MMA_K dims (as reported publicly: SageAttention2's
    "FP22" accumulator, arXiv 2411.10958; about 14 bits in DeepSeek-V3's report on the H800), so a
    step loses less than 2^-BITS x |the accumulator after it|. A 128-dim tile's product
    is scaled by powers of two (exact), so for entry i the error of S_i is at most softmax_scale x
    2^-BITS x the sum, over the 4 tiles and each tile's steps, of |the tile's partial q.k after the
    step| (the rope's bf16 product is left to the bf16 bounds). lse moves by at most the largest
    error of an S_i: the slack is the row's largest such sum over its entries."""
    return _sparse_float64(q, k_cache, indices, topk_length, softmax_scale, with_slack=True)[2]


@dataclasses.dataclass
class SparseInput:
    """One sparse case: the API's arguments (q, k_cache in the 656-byte layout, indices,
    topk_length or None, softmax_scale, head_dim_v), the values the cache was quantised from
    (``values``, bf16 (num_blocks, page, 1, 576), NaN where the cache is NaN), and what made them:
    each request's context ``lengths`` and block table (an engine's; the sparse call does not take
    them), the generator's arguments."""

    q: torch.Tensor
    k_cache: torch.Tensor
    values: torch.Tensor
    indices: torch.Tensor
    topk_length: Optional[torch.Tensor]
    softmax_scale: float
    head_dim_v: int
    lengths: List[int]
    block_table: torch.Tensor
    batchsize: int
    qseqlen: int
    heads: int
    page: int
    kvseqlen: int
    topk: int
    seed: int
    varlen: bool
    zeros: int
    use_topk_length: bool

    @property
    def selected_tokens(self) -> int:
        """Distinct cache tokens the queries attend (FlashMLA's benchmark counts these bytes)."""
        rows = self.indices.to(torch.int64)
        if self.topk_length is not None:
            keep = torch.arange(self.topk, device=rows.device) < self.topk_length.to(rows.device)[:, None, None]
            rows = torch.where(keep, rows, -1)
        return int(torch.unique(rows[rows >= 0]).numel())

    @property
    def cache_bytes(self) -> int:
        """Bytes of cache a kernel must read at least: ``selected_tokens`` x 656."""
        return self.selected_tokens * SPARSE_TOKEN_BYTES


def check_sparse_args(batchsize, qseqlen, heads, page, kvseqlen, topk, seed, *, varlen=False,
                      topk_length=False, zeros=0) -> dict:
    """The arguments of ``generate_sparse_input`` checked and normalised, without making any
    tensor: a ValueError names the first bad field. batchsize >= 1; qseqlen 1..8; heads 1..128;
    page >= 1 (any size: FlashMLA's tests run 2, 61, 64, 69, 576); kvseqlen >= 1; topk
    1..16384; seed an integer; varlen and topk_length 0/1; zeros 0..batchsize."""
    batchsize = _whole("batchsize", batchsize, 1)
    return {"batchsize": batchsize,
            "qseqlen": _at_most("qseqlen", _whole("qseqlen", qseqlen, 1), SERVING_MAX_QSEQLEN),
            "heads": _at_most("heads", _whole("heads", heads, 1), SERVING_MAX_HEADS),
            "page": _whole("page", page, 1), "kvseqlen": _whole("kvseqlen", kvseqlen, 1),
            "topk": _at_most("topk", _whole("topk", topk, 1), SPARSE_MAX_TOPK),
            "seed": _whole("seed", seed, None), "varlen": _flag("varlen", varlen),
            "topk_length": _flag("topk_length", topk_length),
            "zeros": _at_most("zeros", _whole("zeros", zeros, 0), batchsize)}


def _sparse_entries(lengths: List[int], qseqlen: int, topk: int, seed: int) -> torch.Tensor:
    """Token positions (batch, qseqlen, topk) int64 within each request's context: every query
    token draws min(topk, length) distinct positions in random order (a CPU generator seeded
    with ``seed``); the rest of its entries, and one in SPARSE_HOLES of the drawn ones, are -1,
    the -1 entries scattered through the row."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed + 1)
    rows = torch.full((len(lengths), qseqlen, topk), -1, dtype=torch.int64)
    for b, length in enumerate(lengths):
        for t in range(qseqlen):
            take = min(topk, length)
            drawn = torch.randperm(length, generator=gen)[:take] if take else torch.empty(0, dtype=torch.int64)
            holes = torch.randint(0, SPARSE_HOLES, (take,), generator=gen) == 0
            row = torch.full((topk,), -1, dtype=torch.int64)
            row[:take] = torch.where(holes, -1, drawn)
            rows[b, t] = row[torch.randperm(topk, generator=gen)]
    return rows


def generate_sparse_input(batchsize: int, qseqlen: int, heads: int, page: int, kvseqlen: int,
                          topk: int, seed: int, *, varlen: bool = False, topk_length: bool = False,
                          zeros: int = 0, device: Union[None, str, torch.device] = None) -> SparseInput:
    """A sparse case for ``mla_decode_with_kvcache(..., is_fp8_kvcache=True, indices=...)``, as
    FlashMLA's decode test makes them (tests/lib.py generate_testcase_for_decode) with the serving
    cases' values.

    - Contexts: each request's length as ``serving_lengths`` (kvseqlen each, or with ``varlen``
      FlashMLA's normal around kvseqlen; ``zeros`` requests get 0: all their entries are -1), its
      tokens on blocks of ``page`` from ``_block_layout`` (a random permutation, spare blocks).
    - Indices: ``_sparse_entries`` positions converted through the block table to block x page +
      offset, int32; -1 where an entry selects nothing. With ``topk_length``: a length per request
      drawn in [0, topk], every entry past it garbage (SPARSE_GARBAGE_ENTRIES alternating), which a
      kernel must neither read nor take for poison.
    - Values: a generator on the device seeded with ``seed`` draws q = randn (batch, qseqlen, heads,
      576) bf16, then the values randn (num_blocks, page, 1, 576) bf16, each token's latent tiles
      scaled by 2 ** U(-1.5, 1.5) (SPARSE_TILE_SPREAD: a token's four scales differ);
      ``quantize_sparse_cache`` makes the 656-byte cache of them. Every token no query selects
      (within topk_length) is NaN in both: fp8 NaN bytes, NaN scales and NaN rope in the cache.
    Arguments are checked first (``check_sparse_args``)."""
    args = check_sparse_args(batchsize, qseqlen, heads, page, kvseqlen, topk, seed, varlen=varlen,
                             topk_length=topk_length, zeros=zeros)
    device = get_device(device)
    b, s_q, page, topk = args["batchsize"], args["qseqlen"], args["page"], args["topk"]
    lengths = serving_lengths(b, s_q, args["kvseqlen"], args["seed"], varlen=args["varlen"],
                              zeros=args["zeros"])
    table, _, num_blocks = _block_layout(lengths, page, args["seed"])
    positions = _sparse_entries(lengths, s_q, topk, args["seed"])
    safe = positions.clamp(min=0)
    blocks = torch.gather(table.to(torch.int64)[:, None, :].expand(-1, s_q, -1), 2, safe // page)
    indices = torch.where(positions >= 0, blocks * page + safe % page, -1)
    lengths_tensor = None
    selecting = indices >= 0
    if args["topk_length"]:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(args["seed"] + 2)
        lengths_tensor = torch.randint(0, topk + 1, (b,), generator=gen, dtype=torch.int32)
        past = torch.arange(topk)[None, None, :] >= lengths_tensor.to(torch.int64)[:, None, None]
        selecting &= ~past
        garbage = torch.tensor(SPARSE_GARBAGE_ENTRIES, dtype=torch.int64)[torch.arange(topk) % 2]
        indices = torch.where(past, garbage[None, None, :], indices)
    selected = torch.zeros(num_blocks * page, dtype=torch.bool)
    selected[indices[selecting]] = True
    unselected = (~selected).reshape(num_blocks, page).to(device)

    gen = torch.Generator(device=device)
    gen.manual_seed(args["seed"])
    q = torch.randn((b, s_q, args["heads"], QK_HEAD_DIM), dtype=torch.bfloat16, device=device,
                    generator=gen)
    values = torch.randn((num_blocks, page, NUM_KV_HEADS, QK_HEAD_DIM), dtype=torch.bfloat16,
                         device=device, generator=gen)
    spread = torch.rand((num_blocks, page, NUM_KV_HEADS, SPARSE_TILES, 1), device=device, generator=gen)
    spread = torch.exp2(SPARSE_TILE_SPREAD * (2 * spread - 1))
    latent = values[..., :KV_LORA_RANK].reshape(num_blocks, page, NUM_KV_HEADS, SPARSE_TILES, SPARSE_TILE)
    values[..., :KV_LORA_RANK] = (latent.float() * spread).reshape(num_blocks, page, NUM_KV_HEADS, -1)
    k_cache = quantize_sparse_cache(values)
    values[unselected] = float("nan")
    nan_token = quantize_sparse_cache(torch.full((1, 1, 1, QK_HEAD_DIM), float("nan"), device=device))
    _sparse_bytes(k_cache)[unselected] = _sparse_bytes(nan_token).reshape(-1)
    return SparseInput(
        q=q, k_cache=k_cache, values=values, indices=indices.to(torch.int32).to(device),
        topk_length=None if lengths_tensor is None else lengths_tensor.to(device),
        softmax_scale=SM_SCALE, head_dim_v=V_HEAD_DIM, lengths=lengths, block_table=table.to(device),
        batchsize=b, qseqlen=s_q, heads=args["heads"], page=page, kvseqlen=args["kvseqlen"], topk=topk,
        seed=args["seed"], varlen=args["varlen"], zeros=args["zeros"], use_topk_length=args["topk_length"])


@dataclasses.dataclass
class SparseExpected:
    """What a sparse case's outputs are judged against: the float64 reference over the dequantised
    cache (``out``, ``lse``: the kernel's own rounding is measured against it) and over the bf16
    values (``out_values``, ``lse_values``: the format's error), the (batch, s_q, h_q) rows that
    attend tokens, those that are poisoned (NaN expected), the format's own error (out rel L2 and
    max |lse error| of the dequantised reference against the values' over the attended rows) and
    the bounds. ``q_format``: the q both references multiply ("bf16": q as given; "fp8":
    ``round_q_sparse_fp8(q)``); ``lse_slack``: with q in fp8, what fp8 MMA's accumulation may add
    to each row's lse error against the dequantised cache (``sparse_fp8_mma_slack``; None with bf16
    q)."""

    out: torch.Tensor
    lse: torch.Tensor
    out_values: torch.Tensor
    lse_values: torch.Tensor
    attended: torch.Tensor
    poisoned: torch.Tensor
    format_out: float
    format_lse: float
    out_bound: float
    lse_bound: float
    q_format: str = "bf16"
    lse_slack: Optional[torch.Tensor] = None


def sparse_out_bound(format_out: float) -> float:
    """The bound on out's rel L2 against the reference over the bf16 values: 1.25 x the format's
    own error, at most SPARSE_OUT_CEILING."""
    return min(SPARSE_FORMAT_FACTOR * format_out, SPARSE_OUT_CEILING)


def sparse_lse_bound(format_lse: float) -> float:
    """The bound on each attended row's |lse error| against the bf16 values' reference: 1.25 x the
    format's own largest error + SPARSE_LSE_FLOOR."""
    return SPARSE_FORMAT_FACTOR * format_lse + SPARSE_LSE_FLOOR


def sparse_q(q: torch.Tensor, q_format: str) -> torch.Tensor:
    """q as a kernel of ``q_format`` multiplies it: "bf16" q itself, "fp8" ``round_q_sparse_fp8(q)``;
    any other q_format a ValueError."""
    if q_format not in SPARSE_Q_FORMATS:
        raise ValueError(f"q_format must be one of {', '.join(SPARSE_Q_FORMATS)}, got {q_format!r}")
    return q if q_format == "bf16" else round_q_sparse_fp8(q)


def sparse_expected(inputs: SparseInput, q_format: str = "bf16") -> SparseExpected:
    """Both float64 references of ``inputs`` (over the 656-byte cache and over the bf16 values),
    the rows, the format's own error and the bounds. ``q_format`` is the q the judged kernel
    multiplies, and both references use it: "bf16" inputs.q as it is, "fp8" its latent dims
    rounded to fp8 (``round_q_sparse_fp8``), and with it the lse slack of fp8 MMA's accumulation;
    any other value a ValueError naming q_format."""
    q = sparse_q(inputs.q, q_format)
    args = dict(topk_length=inputs.topk_length, softmax_scale=inputs.softmax_scale)
    out, lse, slack = _sparse_float64(q, inputs.k_cache, inputs.indices, **args, with_slack=q_format == "fp8")
    out_v, lse_v = mla_decode_sparse_float64(q, inputs.values, inputs.indices, **args)
    poisoned = torch.isnan(lse).permute(0, 2, 1)
    attended = torch.isfinite(lse).permute(0, 2, 1)
    att_lse = attended.permute(0, 2, 1)
    format_out = rel_l2_error(out[attended], out_v[attended]) if bool(attended.any()) else 0.0
    format_lse = _max_abs((lse - lse_v)[att_lse])
    return SparseExpected(out=out, lse=lse, out_values=out_v, lse_values=lse_v, attended=attended,
                          poisoned=poisoned, format_out=format_out, format_lse=format_lse,
                          out_bound=sparse_out_bound(format_out), lse_bound=sparse_lse_bound(format_lse),
                          q_format=q_format, lse_slack=slack)


def judge_sparse(expected: SparseExpected, out, lse) -> dict:
    """Apply every sparse check to (out, lse); a dict of the measured numbers and the verdict.

    Checks: type, shape, dtype, device (as the serving API's); on attended rows finite values,
    out's rel L2 and each |lse error| against the dequantised cache's reference within the serving
    API's bf16 bounds (the kernel's own rounding; with q in fp8 each row's lse bound plus its
    ``expected.lse_slack``, fp8 MMA's accumulation) and against the bf16 values' reference within
    1.25 x the format's own error (``sparse_out_bound``, ``sparse_lse_bound``); rows with nothing
    to attend exactly 0 with lse +inf; poisoned rows NaN in every out value and in lse.
    Keys: ok, problems, out_rel_l2 / out_bound (against the values), out_rel_l2_exact /
    out_bound_exact (against the dequantised cache), lse_err / lse_bound, lse_err_exact,
    lse_fraction (the larger share of either lse bound), format_out, format_lse, zero_rows,
    poisoned_rows, nonfinite, q_format (the q the references multiply: ``expected.q_format``),
    lse_slack (the largest of ``expected.lse_slack`` over the attended rows, or None)."""
    verdict = {"ok": False, "problems": _output_problems(out, lse, expected), "out_rel_l2": None,
               "out_bound": expected.out_bound, "out_rel_l2_exact": None,
               "out_bound_exact": SERVING_OUT_BOUND_BF16, "lse_err": None,
               "lse_bound": expected.lse_bound, "lse_err_exact": None, "lse_fraction": None,
               "format_out": expected.format_out, "format_lse": expected.format_lse,
               "zero_rows": int((~expected.attended & ~expected.poisoned).sum()),
               "poisoned_rows": int(expected.poisoned.sum()), "nonfinite": None,
               "q_format": expected.q_format, "lse_slack": None}
    if verdict["problems"]:
        return verdict
    problems = verdict["problems"]
    att, poisoned = expected.attended, expected.poisoned
    empty = ~att & ~poisoned
    att_lse, empty_lse, poisoned_lse = (x.permute(0, 2, 1) for x in (att, empty, poisoned))
    out64, lse64 = out.detach().double(), lse.detach().double()
    nonfinite = int((~torch.isfinite(out64[att])).sum() + (~torch.isfinite(lse64[att_lse])).sum())
    verdict["nonfinite"] = nonfinite
    if nonfinite:
        problems.append(f"{nonfinite} NaN/inf values in out or lse on rows that attend tokens")
    if bool(att.any()):
        rel = rel_l2_error(out64[att], expected.out_values[att])
        rel_exact = rel_l2_error(out64[att], expected.out[att])
        verdict.update(out_rel_l2=rel, out_rel_l2_exact=rel_exact)
        if not rel <= expected.out_bound:
            problems.append(f"out rel L2 {rel:.4g} > bound {expected.out_bound:.4g} (1.25 x the format's "
                            f"own {expected.format_out:.4g})")
        if not rel_exact <= SERVING_OUT_BOUND_BF16:
            problems.append(f"out rel L2 {rel_exact:.4g} against the dequantised cache > bound "
                            f"{SERVING_OUT_BOUND_BF16:.4g}")
        err = (lse64 - expected.lse_values)[att_lse].abs()
        ref = expected.lse[att_lse]
        err_exact = (lse64[att_lse] - ref).abs()
        bound_exact = SERVING_LSE_ATOL_BF16 + SERVING_LSE_RTOL_BF16 * ref.abs()
        if expected.lse_slack is not None:
            bound_exact = bound_exact + expected.lse_slack[att_lse]
            verdict["lse_slack"] = float(expected.lse_slack[att_lse].max())
        verdict.update(lse_err=float(err.max()), lse_err_exact=float(err_exact.max()))
        fractions = torch.cat([err / expected.lse_bound, err_exact / bound_exact])
        verdict["lse_fraction"] = float(torch.nan_to_num(fractions, nan=float("inf")).max())
        if not float(torch.nan_to_num(err, nan=float("inf")).max()) <= expected.lse_bound:
            problems.append(f"lse error {verdict['lse_err']:.3g} > bound {expected.lse_bound:.3g}")
        if not bool((err_exact <= bound_exact).all()):
            slack = "" if expected.lse_slack is None else " + fp8 MMA's accumulation"
            problems.append(f"lse error {verdict['lse_err_exact']:.3g} against the dequantised cache > "
                            f"1e-3 + 1e-4 |lse|{slack}")
    if bool(empty.any()):
        bad_out = int((out64[empty] != 0).any(dim=-1).sum())
        bad_lse = int((lse64[empty_lse] != float("inf")).sum())
        if bad_out or bad_lse:
            problems.append(f"rows that attend nothing: {bad_out} of {int(empty.sum())} have out != 0, "
                            f"{bad_lse} have lse != +inf")
    if bool(poisoned.any()):
        bad_out = int((~torch.isnan(out64[poisoned])).any(dim=-1).sum())
        bad_lse = int((~torch.isnan(lse64[poisoned_lse])).sum())
        if bad_out or bad_lse:
            problems.append(f"poisoned rows: {bad_out} of {int(poisoned.sum())} have out not all NaN, "
                            f"{bad_lse} have lse not NaN")
    verdict["ok"] = not problems
    return verdict


def sparse_message(verdict: dict) -> str:
    """One line: the problems (if any) first, then the q the references multiply and the measured
    errors against their bounds."""
    parts = []
    if verdict.get("out_rel_l2") is not None:
        parts.append(f"out rel L2 {verdict['out_rel_l2']:.4g} (bound {verdict['out_bound']:.4g} = 1.25 x the "
                     f"format's {verdict['format_out']:.4g}; {verdict['out_rel_l2_exact']:.3g} against the "
                     "dequantised cache)")
    if verdict.get("lse_err") is not None:
        slack = f", fp8 MMA's slack up to {verdict['lse_slack']:.3g}" if verdict.get("lse_slack") else ""
        parts.append(f"lse max abs error {verdict['lse_err']:.3g} (bound {verdict['lse_bound']:.3g}; "
                     f"{verdict['lse_err_exact']:.3g} against the dequantised cache{slack})")
    if verdict.get("zero_rows"):
        parts.append(f"{verdict['zero_rows']} rows attend nothing")
    if verdict.get("poisoned_rows"):
        parts.append(f"{verdict['poisoned_rows']} rows poisoned")
    measured = "; ".join(parts) if parts else "no row attends anything"
    if verdict.get("q_format"):
        measured = f"q {verdict['q_format']}: {measured}"
    if verdict["problems"]:
        return "; ".join(verdict["problems"]) + " | " + measured
    return measured


def check_sparse(inputs: SparseInput, out, lse, expected: Optional[SparseExpected] = None,
                 q_format: str = "bf16") -> Tuple[bool, str]:
    """The strict sparse check of (out, lse): ``judge_sparse`` against ``sparse_expected(inputs,
    q_format)`` (pass ``expected`` to reuse one; one made with another q_format is a ValueError).
    Returns (ok, message)."""
    if expected is None:
        expected = sparse_expected(inputs, q_format)
    elif expected.q_format != q_format:
        raise ValueError(f"q_format is {q_format!r} but expected was computed with q {expected.q_format}")
    verdict = judge_sparse(expected, out, lse)
    return verdict["ok"], sparse_message(verdict)

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
"""
import math
import operator
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

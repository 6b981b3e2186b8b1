"""reference.py's sparse half: the 656-byte cache (quantize_sparse_cache against FlashMLA's rule and
a round trip against the bf16 values, decoded by hand), mla_decode_sparse_float64 against a
direct computation (every byte decoded by hand, one (request, query token, head) at a time), its
semantics (-1, topk_length, duplicates, poison, empty queries), generate_sparse_input (layout,
NaN in every token no query selects, garbage past topk_length, determinism, argument errors),
round_q_sparse_fp8 (q as an fp8 kernel rounds it) against the rule computed by hand, and the strict
check with either q (the reference passes; zeros, NaN, a perturbed row fail).

Tiny inputs on the default device (the GPU when there is one), as eval.py runs the reference."""
import bisect
import math
import struct

import pytest
import torch

import reference as R
import utils

DEVICE = utils.get_device()


def decode_fp8(byte):
    """float8_e4m3fn by hand: sign, 4 exponent bits (bias 7), 3 mantissa bits; 0x7f / 0xff NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0 ** -6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def decode_token(raw):
    """One token's 656 bytes (a list of ints) as 576 floats: 512 fp8 x their tile's scale, 64 bf16."""
    scales = struct.unpack("<4f", bytes(raw[512:528]))
    latent = [decode_fp8(raw[d]) * scales[d // 128] for d in range(512)]
    rope = [struct.unpack("<f", struct.pack("<I", (raw[528 + 2 * i] | raw[529 + 2 * i] << 8) << 16))[0]
            for i in range(64)]
    return latent + rope


def direct(q, cache, indices, topk_length, scale):
    """The sparse decode by its definition, by hand: (out, lse) float64 on the CPU."""
    q, raw, indices = q.double().cpu(), R._sparse_bytes(cache).cpu(), indices.cpu()
    batch, s_q, heads, _ = q.shape
    page, capacity = cache.shape[1], cache.shape[0] * cache.shape[1]
    out = torch.zeros(batch, s_q, heads, 512, dtype=torch.float64)
    lse = torch.full((batch, heads, s_q), math.inf, dtype=torch.float64)
    for b in range(batch):
        n = indices.shape[2] if topk_length is None else int(topk_length[b])
        for t in range(s_q):
            row = [int(e) for e in indices[b, t]]
            if not 0 <= n <= len(row) or any(e < -1 or e >= capacity for e in row[:n]):
                out[b, t], lse[b, :, t] = math.nan, math.nan
                continue
            keys = [decode_token(raw[e // page, e % page, 0].tolist()) for e in row[:n] if e >= 0]
            if not keys:
                continue
            keys = torch.tensor(keys, dtype=torch.float64)
            for h in range(heads):
                scores = [scale * sum(a * b for a, b in zip(q[b, t, h].tolist(), key.tolist(), strict=True))
                          for key in keys]
                top = max(scores)
                lse[b, h, t] = top + math.log(sum(math.exp(s - top) for s in scores))
                weights = torch.tensor([math.exp(s - lse[b, h, t].item()) for s in scores], dtype=torch.float64)
                out[b, t, h] = weights @ keys[:, :512]
    return out, lse


def values(num_blocks=3, page=4, seed=0, spread=1.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_blocks, page, 1, 576, generator=gen) * spread
    return x.to(torch.bfloat16).to(DEVICE)


# ---------------------------------------------------------------------------------------------
# The 656-byte cache


def test_the_quantiser_lays_out_flashmlas_656_bytes():
    x = values(2, 3, seed=1)
    x[0, 0, 0, 128:256] = 0.0  # a tile of zeros: FlashMLA's floor, 2 ** ceil(log2(1e-4))
    x[0, 1, 0, :128] *= 1000  # a tile past fp8's range: a scale above 1
    cache = R.quantize_sparse_cache(x)
    assert cache.shape == (2, 3, 1, 656) and cache.dtype == torch.float8_e4m3fn
    raw = R._sparse_bytes(cache).cpu()
    xf = x.float().cpu().reshape(2, 3, 576)
    for b in range(2):
        for p in range(3):
            token = raw[b, p, 0].tolist()
            scales = struct.unpack("<4f", bytes(token[512:528]))
            for tile in range(4):
                amax = xf[b, p, tile * 128:(tile + 1) * 128].abs().max().item()
                want = 2.0 ** math.ceil(math.log2(max(amax / 448.0, 1e-4)))
                assert scales[tile] == want, (b, p, tile)
                assert math.frexp(scales[tile])[0] == 0.5  # a power of two
            assert bytes(token[528:]) == bytes(x[b, p, 0, 512:].cpu().contiguous().view(torch.uint8).tolist())
    assert struct.unpack("<4f", bytes(raw[0, 0, 0, 512:528].tolist()))[1] == 2.0 ** math.ceil(math.log2(1e-4))
    assert struct.unpack("<4f", bytes(raw[0, 1, 0, 512:528].tolist()))[0] > 1


def test_round_trip_within_fp8s_rounding_of_the_bf16_values():
    x = values(4, 8, seed=2)
    x[1, 2, 0, :128] *= 300  # tiles of very different size in one token
    x[2, 3, 0, 256:384] /= 1000
    cache = R.quantize_sparse_cache(x)
    back = R.dequantize_sparse_cache(cache).cpu()
    xd = x.double().cpu()
    assert back.shape == xd.shape and back.dtype == torch.float64
    assert torch.equal(back[..., 512:], xd[..., 512:])  # rope kept exactly
    scales = R._sparse_bytes(cache)[..., 512:528].cpu().contiguous().view(torch.float32).double()
    scale_per_dim = scales.repeat_interleave(128, dim=-1)
    # nearest-even rounding to 3 mantissa bits: half an ulp, 2^-4 relative; subnormals 2^-10 x scale
    err = (back[..., :512] - xd[..., :512]).abs()
    assert bool((err <= torch.maximum(xd[..., :512].abs() * 2 ** -4, scale_per_dim * 2 ** -10)).all())
    rel = R.rel_l2_error(back[..., :512], xd[..., :512])
    assert 0.005 < rel < 0.05  # fp8's own error: not zero, not more than its rounding
    # the bytes decoded by hand agree with the dequantiser
    raw = R._sparse_bytes(cache).cpu()
    assert decode_token(raw[1, 2, 0].tolist()) == back[1, 2, 0].tolist()


def test_nan_tokens_and_any_block_stride():
    x = values(3, 5, seed=3)
    x[1, 4] = float("nan")
    cache = R.quantize_sparse_cache(x)
    back = R.dequantize_sparse_cache(cache)
    assert bool(torch.isnan(back[1, 4]).all()) and bool(torch.isfinite(back[:, :4]).all())
    # FlashMLA's own test pads every block by a token: rows of a block 656 bytes apart, blocks not
    padded = torch.zeros(3, 6, 1, 656, dtype=torch.float8_e4m3fn, device=DEVICE)
    padded[:, :5] = cache
    view = padded[:, :5]
    index = torch.tensor([0, 7, 13, 9], dtype=torch.int64)
    want = R.sparse_rows(cache, index)
    assert bool(torch.isnan(want[3]).all())  # token 9: block 1, row 4
    same = dict(rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(R.sparse_rows(view, index), want, **same)
    torch.testing.assert_close(R.sparse_rows(view.view(torch.uint8), index), want, **same)  # vLLM's uint8 bytes
    torch.testing.assert_close(R.sparse_rows(x, index), x.double()[index // 5, index % 5, 0], **same)


# ---------------------------------------------------------------------------------------------
# The float64 reference


def small_case(topk_length=None, seed=4):
    gen = torch.Generator().manual_seed(seed)
    x = values(3, 4, seed=seed)
    cache = R.quantize_sparse_cache(x)
    q = torch.randn(2, 2, 3, 576, generator=gen).to(torch.bfloat16).to(DEVICE)
    indices = torch.tensor([[[0, 5, -1, 11, 3, 3, -1, 7], [-1] * 8],
                            [[2, 9, 10, -1, 1, 6, 4, 8], [11, -1, 0, 8, -1, -1, 5, 2]]], dtype=torch.int32)
    return q, cache, x, indices.to(DEVICE), topk_length


@pytest.mark.parametrize("lengths", [None, (5, 8)])
def test_the_reference_against_a_direct_computation(lengths):
    q, cache, _, indices, _ = small_case()
    topk_length = None if lengths is None else torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out, lse = R.mla_decode_sparse_float64(q, cache, indices, topk_length, softmax_scale=0.07)
    want_out, want_lse = direct(q, cache, indices, topk_length, 0.07)
    assert out.dtype == lse.dtype == torch.float64
    assert out.shape == (2, 2, 3, 512) and lse.shape == (2, 3, 2)
    torch.testing.assert_close(out.cpu(), want_out, rtol=1e-10, atol=1e-12, equal_nan=True)
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=1e-12, atol=1e-12, equal_nan=True)
    assert bool((out[0, 1] == 0).all()) and bool((lse[0, :, 1] == math.inf).all())  # all -1: nothing attended


def test_semantics_skip_cut_duplicate_poison():
    q, cache, _, indices, _ = small_case()
    out, lse = R.mla_decode_sparse_float64(q, cache, indices)
    # -1 entries and entries past topk_length are the same as absent entries
    cut = torch.tensor([3, 8], dtype=torch.int32, device=DEVICE)
    garbage = indices.clone()
    garbage[0, :, 3:] = torch.tensor([2147480000, -7, 99, -2147483648, 12], dtype=torch.int32)
    out_cut, lse_cut = R.mla_decode_sparse_float64(q, cache, garbage, cut)
    holes = indices.clone()
    holes[0, :, 3:] = -1
    out_holes, lse_holes = R.mla_decode_sparse_float64(q, cache, holes)
    assert torch.equal(out_cut, out_holes) and torch.equal(lse_cut, lse_holes)
    assert torch.equal(out_cut[1], out[1])
    # a token listed twice counts twice: entries 3, 3 against 3 once
    once = indices.clone()
    once[0, 0, 5] = -1
    _, lse_once = R.mla_decode_sparse_float64(q, cache, once)
    assert not torch.equal(lse_once[0, :, 0], lse[0, :, 0])
    # an entry below -1 or past the cache poisons its query only
    for bad in (-2, 12, 2147480000):
        poisoned = indices.clone()
        poisoned[1, 0, 6] = bad
        out_p, lse_p = R.mla_decode_sparse_float64(q, cache, poisoned)
        assert bool(torch.isnan(out_p[1, 0]).all()) and bool(torch.isnan(lse_p[1, :, 0]).all())
        assert torch.equal(out_p[1, 1], out[1, 1]) and torch.equal(out_p[0], out[0])
    # a topk_length outside [0, topk] poisons its request
    for bad in (-1, 9):
        out_p, lse_p = R.mla_decode_sparse_float64(q, cache, indices, torch.tensor([8, bad], dtype=torch.int32,
                                                                                 device=DEVICE))
        assert bool(torch.isnan(out_p[1]).all()) and bool(torch.isnan(lse_p[1]).all())
        assert torch.equal(out_p[0], out[0])
    # topk_length 0: nothing attended
    out_z, lse_z = R.mla_decode_sparse_float64(q, cache, indices, torch.tensor([0, 8], dtype=torch.int32,
                                                                             device=DEVICE))
    assert bool((out_z[0] == 0).all()) and bool((lse_z[0] == math.inf).all())


def test_the_values_reference_gives_the_formats_own_error():
    q, cache, x, indices, _ = small_case()
    out_q, lse_q = R.mla_decode_sparse_float64(q, cache, indices)
    out_v, lse_v = R.mla_decode_sparse_float64(q, x, indices)
    attended = torch.isfinite(lse_q).permute(0, 2, 1)
    rel = R.rel_l2_error(out_q[attended], out_v[attended])
    assert 0.003 < rel < 0.1
    assert bool(torch.equal(torch.isinf(lse_q), torch.isinf(lse_v)))


# ---------------------------------------------------------------------------------------------
# The generator


def make(**kw):
    args = dict(batchsize=3, qseqlen=2, heads=4, page=16, kvseqlen=40, topk=32, seed=5)
    args.update(kw)
    return R.generate_sparse_input(**args, device=DEVICE)


def test_the_generator_makes_flashmlas_inputs():
    inputs = make(varlen=True, topk_length=True, zeros=1)
    b, s_q, topk = 3, 2, 32
    assert inputs.q.shape == (b, s_q, 4, 576) and inputs.q.dtype == torch.bfloat16
    assert inputs.k_cache.shape[1:] == (16, 1, 656) and inputs.k_cache.dtype == torch.float8_e4m3fn
    assert inputs.values.shape == inputs.k_cache.shape[:3] + (576,) and inputs.values.dtype == torch.bfloat16
    assert inputs.indices.shape == (b, s_q, topk) and inputs.indices.dtype == torch.int32
    assert inputs.topk_length.shape == (b,) and inputs.topk_length.dtype == torch.int32
    capacity = inputs.k_cache.shape[0] * 16
    keep = (torch.arange(topk, device=DEVICE) < inputs.topk_length[:, None, None]).expand(-1, s_q, -1)
    assert inputs.lengths[0] == 0 and bool((inputs.indices[0][keep[0]] == -1).all())  # an empty context
    entries = inputs.indices[keep]
    assert bool(((entries == -1) | ((entries >= 0) & (entries < capacity))).all())
    past = inputs.indices[~keep]
    assert bool(((past == 2147480000) | (past == -7)).all())  # garbage past topk_length
    # NaN in exactly the tokens no query selects, in both caches
    selected = torch.zeros(capacity, dtype=torch.bool, device=DEVICE)
    selected[entries[entries >= 0].long()] = True
    nan_tokens = torch.isnan(R.dequantize_sparse_cache(inputs.k_cache)).reshape(capacity, 576).all(-1)
    assert torch.equal(nan_tokens, ~selected)
    assert torch.equal(torch.isnan(inputs.values).reshape(capacity, 576).all(-1), ~selected)
    # each token the entries select lies in its request's context: its block is one of the request's
    for r in range(b):
        blocks = set(inputs.block_table[r, :-(-inputs.lengths[r] // 16)].tolist()) if inputs.lengths[r] else set()
        used = inputs.indices[r][keep[r]]
        assert {int(e) // 16 for e in used[used >= 0]} <= blocks
    assert inputs.selected_tokens == int(selected.sum()) and inputs.cache_bytes == 656 * inputs.selected_tokens


def test_the_generator_has_holes_and_is_deterministic():
    one, two = make(kvseqlen=200, topk=64, seed=9), make(kvseqlen=200, topk=64, seed=9)
    assert torch.equal(one.indices, two.indices) and torch.equal(R._sparse_bytes(one.k_cache),
                                                                 R._sparse_bytes(two.k_cache))
    holes = (one.indices == -1).float().mean().item()
    assert 0.03 < holes < 0.3  # one drawn entry in SPARSE_HOLES is -1, scattered through the row
    first = (one.indices[..., :32] == -1).float().mean().item()
    assert first > 0.0
    other = make(kvseqlen=200, topk=64, seed=10)
    assert not torch.equal(one.indices, other.indices)
    short = make(kvseqlen=10, topk=64)  # contexts shorter than topk: the rest of each row is -1
    assert bool(((short.indices >= 0).sum(-1) <= 10).all())


@pytest.mark.parametrize("field,value", [("batchsize", 0), ("qseqlen", 9), ("heads", 129), ("page", 0),
                                         ("kvseqlen", 0), ("topk", 0), ("topk", 16385), ("seed", 1.5),
                                         ("varlen", 2), ("topk_length", "yes"), ("zeros", 4)])
def test_bad_generator_arguments_name_the_field(field, value):
    args = dict(batchsize=3, qseqlen=2, heads=4, page=16, kvseqlen=40, topk=32, seed=5)
    args[field] = value
    with pytest.raises(ValueError, match=field):
        R.check_sparse_args(**args)


# ---------------------------------------------------------------------------------------------
# q rounded to fp8


FP8_POSITIVE = sorted((decode_fp8(byte), byte) for byte in range(0x7F))  # every finite value >= 0


def round_fp8_by_hand(x):
    """x (|x| <= 448) to the nearest float8_e4m3fn value, a tie to the even byte (mantissa)."""
    values = [v for v, _ in FP8_POSITIVE]
    at = bisect.bisect_left(values, abs(x))
    near = FP8_POSITIVE[max(at - 1, 0):at + 1]
    value, _ = min(near, key=lambda vb: (abs(vb[0] - abs(x)), vb[1] & 1))
    return math.copysign(value, x)


def power_of_two_at_least(x):
    """The least 2 ** k >= x, k found by search (no frexp)."""
    k = math.ceil(math.log2(x))
    while 2.0 ** k < x:
        k += 1
    while 2.0 ** (k - 1) >= x:
        k -= 1
    return 2.0 ** k


def round_q_by_hand(q):
    """The rule in float64, one (b, t, h) row at a time over its 512 latent dims: amax / 448 rounded
    to float32 (the float64 quotient rounded to float32 is the float32 quotient: 53 >= 2 x 24 + 2
    bits), floored at 1e-4, rounded up to a power of two; each value / scale to fp8 and back."""
    rows = q.double().cpu().reshape(-1, 576).tolist()
    out = []
    for row in rows:
        values = row[:512]
        ratio = struct.unpack("<f", struct.pack("<f", max(abs(v) for v in values) / 448.0))[0]
        scale = power_of_two_at_least(max(ratio, 1e-4))
        out.append([round_fp8_by_hand(v / scale) * scale for v in values] + row[512:])
    return torch.tensor(out, dtype=torch.float64).reshape(q.shape)


def test_round_q_sparse_fp8_is_the_rule_computed_by_hand():
    gen = torch.Generator().manual_seed(40)
    q = (torch.randn(2, 3, 4, 576, generator=gen) * 3).to(torch.bfloat16)
    q[0, 0, 0, :512] = 0.0  # a head of zeros: the floor's scale 2 ** -13, zeros back
    q[0, 0, 1, :512] = q[0, 0, 1, :512].clamp(-50, 50)
    q[0, 0, 1, 7] = -56.0  # amax / 448 = 2 ** -3 exactly: the scale stays 2 ** -3, -56 -> fp8 -448
    q[0, 1, 0, :512] = q[0, 1, 0, :512].clamp(-400, 400)
    q[0, 1, 0, 400] = 448.0  # amax / 448 = 1: scale 1
    q[0, 1, 2, :512] = q[0, 1, 2, :512].clamp(-440, 440)
    q[0, 1, 2, 300] = 452.0  # amax / 448 just above 1: scale 2
    q[1, 2, 3, :512] *= 2.0 ** 60  # huge
    q[1, 1, 2, :512] *= 2.0 ** -20  # small: below the floor, fp8 subnormals and zeros
    q[1, 1, 1, :512] *= 2.0 ** -40  # tiny: all zeros at the floor's scale
    q[1, 0, 0, :512] *= 2.0 ** -12  # around the floor
    q[1, 0, 1, 512:] *= 2.0 ** 30  # rope, huge: untouched
    q[1, 2, 0, :128] *= 2.0 ** 8  # one tile far above the head's others: they round with its scale
    q = q.to(DEVICE)
    rounded = R.round_q_sparse_fp8(q)
    assert rounded.dtype == torch.float32 and rounded.shape == q.shape and rounded.device == q.device
    want = round_q_by_hand(q)
    assert torch.equal(rounded.double().cpu(), want)
    assert torch.equal(rounded[..., 512:], q[..., 512:].float())  # rope untouched
    assert bool((rounded[0, 0, 0, :512] == 0).all())
    assert rounded[0, 0, 1, 7].item() == -56.0 and rounded[0, 1, 0, 400].item() == 448.0
    assert rounded[0, 1, 2, 300].item() == 448.0  # 452 / 2 = 226 -> 224 (fp8's step 16 there) x 2
    assert not torch.equal(rounded[..., :512], q[..., :512].float())  # latent dims rounded
    small = rounded[1, 1, 2, :512]
    subnormal = (small != 0) & (small.abs() < 2.0 ** -6 * 2.0 ** -13)  # below fp8's least normal x scale
    assert bool((small == 0).any()) and bool(subnormal.any()) and bool((rounded[1, 1, 1, :512] == 0).all())
    # the cache's tile rule over the whole row: a head whose four tiles share their amax quantises as
    # cache tokens do
    even = q[0, 1, 0].clone()
    for tile in range(4):
        even[tile * 128] = 448.0
    cache_values = R.dequantize_sparse_cache(R.quantize_sparse_cache(even.reshape(1, 1, 1, 576))).reshape(576)
    assert torch.equal(R.round_q_sparse_fp8(even)[:512].double(), cache_values[:512])
    # any float dtype of q; q of another width is refused
    assert torch.equal(R.round_q_sparse_fp8(q.float()), rounded)
    with pytest.raises(ValueError, match="q"):
        R.round_q_sparse_fp8(q[..., :512])


def test_round_q_sparse_fp8_on_random_magnitudes():
    """Every head its own magnitude, 2 ** U(-30, 30), and its tiles 2 ** U(-3, 3) apart: the hand
    rule agrees bit for bit."""
    gen = torch.Generator().manual_seed(41)
    q = torch.randn(3, 2, 5, 576, generator=gen)
    q[..., :512] *= torch.exp2(torch.randint(-30, 31, (3, 2, 5, 1), generator=gen).float())
    q[..., :512] *= torch.exp2(torch.randint(-3, 4, (3, 2, 5, 4), generator=gen).float()).repeat_interleave(128, -1)
    q = q.to(torch.bfloat16).to(DEVICE)
    assert torch.equal(R.round_q_sparse_fp8(q).double().cpu(), round_q_by_hand(q))


# ---------------------------------------------------------------------------------------------
# The strict check


def test_the_check_passes_the_reference_and_fails_zeros_nan_and_perturbations():
    inputs = make(varlen=True, topk_length=True, zeros=1, heads=3)
    expected = R.sparse_expected(inputs)
    out, lse = expected.out.to(torch.bfloat16), expected.lse.float()
    ok, message = R.check_sparse(inputs, out, lse, expected)
    assert ok, message
    assert 0 < expected.format_out < 0.1 and expected.out_bound == pytest.approx(1.25 * expected.format_out)
    # the values' reference itself is at the format's error, inside 1.25x
    verdict = R.judge_sparse(expected, expected.out_values.to(torch.bfloat16), expected.lse_values.float())
    assert any("dequantised" in p for p in verdict["problems"])  # but not the kernel's own bound
    att = expected.attended
    zeros = torch.zeros_like(out)
    assert not R.check_sparse(inputs, zeros, lse, expected)[0]
    assert not R.check_sparse(inputs, out, torch.zeros_like(lse), expected)[0]
    nan_out = out.clone()
    nan_out[att.nonzero()[0].tolist()] = float("nan")
    assert not R.check_sparse(inputs, nan_out, lse, expected)[0]
    shifted = out.clone()
    row = att.nonzero()[-1].tolist()
    shifted[row] = shifted[row] * 1.5
    verdict = R.judge_sparse(expected, shifted, lse)
    assert not verdict["ok"] and verdict["out_rel_l2_exact"] > 0.01
    empty = ~att
    if bool(empty.any()):
        wrong = out.clone()
        wrong[empty] = 1.0
        assert not R.check_sparse(inputs, wrong, lse, expected)[0]
    assert not R.check_sparse(inputs, out.float(), lse, expected)[0]  # dtype
    assert not R.check_sparse(inputs, out[:, :1], lse, expected)[0]  # shape


def test_the_check_wants_nan_where_a_query_is_poisoned():
    inputs = make(heads=2)
    inputs.indices[1, 0, 3] = 2147480000
    expected = R.sparse_expected(inputs)
    assert int(expected.poisoned.sum()) == 2  # query (1, 0), both heads
    out, lse = expected.out.to(torch.bfloat16), expected.lse.float()
    assert R.check_sparse(inputs, out, lse, expected)[0]
    healed = out.clone()
    healed[1, 0] = 0.0
    verdict = R.judge_sparse(expected, healed, lse)
    assert not verdict["ok"] and "poisoned" in verdict["problems"][0]


def test_the_check_takes_the_kernels_q_format():
    """sparse_expected(inputs, "fp8"): both references with round_q_sparse_fp8(q); the rows and the
    format's own error measured with that q. Each passes its own reference's outputs and fails
    zeros; an fp8-q kernel judged against the bf16 q's references fails (the lse against the
    dequantised cache shows it); another q_format is a ValueError naming it."""
    inputs = make(varlen=True, topk_length=True, zeros=1, heads=3)
    bf16, fp8 = R.sparse_expected(inputs), R.sparse_expected(inputs, "fp8")
    assert (bf16.q_format, fp8.q_format) == ("bf16", "fp8")
    assert torch.equal(bf16.attended, fp8.attended) and torch.equal(bf16.poisoned, fp8.poisoned)
    att, att_lse = fp8.attended, fp8.attended.permute(0, 2, 1)
    assert not torch.equal(bf16.out[att], fp8.out[att]) and not torch.equal(bf16.lse[att_lse], fp8.lse[att_lse])
    args = (inputs.indices, inputs.topk_length, inputs.softmax_scale)
    q8 = R.round_q_sparse_fp8(inputs.q)
    for got, want in [((fp8.out, fp8.lse), R.mla_decode_sparse_float64(q8, inputs.k_cache, *args)),
                      ((fp8.out_values, fp8.lse_values), R.mla_decode_sparse_float64(q8, inputs.values, *args))]:
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    for expected in (bf16, fp8):
        q_format = expected.q_format
        out, lse = expected.out.to(torch.bfloat16), expected.lse.float()
        ok, message = R.check_sparse(inputs, out, lse, expected, q_format)
        assert ok, message
        assert message.startswith(f"q {q_format}: ")
        assert R.judge_sparse(expected, out, lse)["q_format"] == q_format
        assert 0 < expected.format_out < 0.1 and expected.out_bound == pytest.approx(1.25 * expected.format_out)
        assert R.check_sparse(inputs, out, lse, q_format=q_format)[0]  # its own references made
        assert not R.check_sparse(inputs, torch.zeros_like(out), lse, expected, q_format)[0]
        assert not R.check_sparse(inputs, out, torch.zeros_like(lse), expected, q_format)[0]
    verdict = R.judge_sparse(bf16, fp8.out.to(torch.bfloat16), fp8.lse.float())
    assert not verdict["ok"] and any("dequantised cache" in p for p in verdict["problems"])
    with pytest.raises(ValueError, match="q_format"):
        R.check_sparse(inputs, out, lse, fp8)  # an fp8 reference where bf16 is asked
    for bad in ("fp16", "FP8", "", None):
        with pytest.raises(ValueError, match="q_format"):
            R.sparse_expected(inputs, bad)
        with pytest.raises(ValueError, match="q_format"):
            R.check_sparse(inputs, out, lse, q_format=bad)


def test_the_fp8_mma_slack_is_the_bound_computed_by_hand():
    """sparse_fp8_mma_slack: per (request, head, query token) softmax_scale x 2^-13 x the largest,
    over the query's entries, of the sum over the 4 latent tiles and their 4 k-steps of 32 dims of
    |the tile's q.k after the step| (every byte decoded by hand); 0 where a query attends nothing or
    is poisoned."""
    q, cache, _, indices, _ = small_case()
    indices = indices.clone()
    indices[1, 1, 2] = -5  # poisons query (1, 1)
    topk_length = torch.tensor([5, 8], dtype=torch.int32, device=DEVICE)
    slack = R.sparse_fp8_mma_slack(q, cache, indices, topk_length, softmax_scale=0.07)
    raw, qd = R._sparse_bytes(cache).cpu(), q.double().cpu()
    want = torch.zeros(2, 3, 2, dtype=torch.float64)
    for b, n in enumerate((5, 8)):
        for t in range(2):
            row = [int(e) for e in indices[b, t, :n]]
            if any(e < -1 for e in row) or all(e == -1 for e in row):
                continue
            keys = torch.tensor([decode_token(raw[e // 4, e % 4, 0].tolist()) for e in row if e >= 0],
                                dtype=torch.float64)
            for h in range(3):
                sums = []
                for key in keys:
                    products = [float(qd[b, t, h, d]) * float(key[d]) for d in range(512)]
                    sums.append(sum(abs(sum(products[c * 128:c * 128 + 32 * (j + 1)]))
                                    for c in range(4) for j in range(4)))
                want[b, h, t] = 0.07 * 2.0 ** -13 * max(sums)
    assert slack.dtype == torch.float64 and slack.shape == (2, 3, 2)
    torch.testing.assert_close(slack.cpu(), want, rtol=1e-12, atol=0)
    assert bool((want[0, :, 1] == 0).all()) and bool((want[1, :, 1] == 0).all())  # nothing / poisoned
    assert bool((want[0, :, 0] > 0).all())


def test_an_fp8_q_check_allows_fp8_mmas_slack_and_no_more():
    """With q in fp8 each row's lse bound against the dequantised cache is the bf16 one plus the
    row's slack (sparse_fp8_mma_slack): an lse off by the bf16 bound + 0.9 x the slack passes, by
    the bf16 bound + 1.1 x it fails, naming the accumulation; with bf16 q there is no slack."""
    inputs = make(varlen=True, topk_length=True, zeros=1, heads=3)
    bf16, fp8 = R.sparse_expected(inputs), R.sparse_expected(inputs, "fp8")
    assert bf16.lse_slack is None
    att_lse = fp8.attended.permute(0, 2, 1)
    slack = fp8.lse_slack
    assert slack.shape == fp8.lse.shape and bool((slack[att_lse] > 0).all()) and bool((slack[~att_lse] == 0).all())
    want = R.sparse_fp8_mma_slack(R.round_q_sparse_fp8(inputs.q), inputs.k_cache, inputs.indices,
                                  inputs.topk_length, inputs.softmax_scale)
    torch.testing.assert_close(slack, want, rtol=0, atol=0)
    out = fp8.out.to(torch.bfloat16)
    row = att_lse.nonzero()[0].tolist()
    base = R.SERVING_LSE_ATOL_BF16 + R.SERVING_LSE_RTOL_BF16 * abs(float(fp8.lse[tuple(row)]))
    for share, ok in ((0.9, True), (1.1, False)):
        lse = fp8.lse.clone()
        lse[tuple(row)] += base + share * float(slack[tuple(row)])
        verdict = R.judge_sparse(fp8, out, lse.float())
        assert verdict["ok"] == ok, R.sparse_message(verdict)
        assert verdict["lse_slack"] == float(slack[att_lse].max())
        assert "fp8 MMA's slack up to" in R.sparse_message(verdict)
        if not ok:
            assert any("fp8 MMA's accumulation" in p for p in verdict["problems"])
    lse = bf16.lse.clone()
    lse[tuple(row)] += base + 0.9 * float(slack[tuple(row)])
    verdict = R.judge_sparse(bf16, bf16.out.to(torch.bfloat16), lse.float())
    assert not verdict["ok"] and verdict["lse_slack"] is None

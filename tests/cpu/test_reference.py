"""reference.py: quantisers (golden MXFP4 bytes, the runner's fp8 arithmetic transcribed in exact
rationals), inputs, the portable reference, the runner's aiter calls, the check."""
import bisect
import math
import sys
import types
from fractions import Fraction

import pytest
import torch

import reference as R

# ---------------------------------------------------------------------------------------------
# MXFP4


@pytest.fixture(scope="module")
def golden(golden_mxfp4_path):
    return torch.load(golden_mxfp4_path)


def test_mxfp4_is_bit_exact_with_aiter_golden(golden):
    x = golden["x_bf16"]
    data, scales = R.quantize_mxfp4(x, use_aiter=False)
    rows = x.shape[0]
    packed = data.view(torch.uint8)
    want_packed = golden["fp4_packed_uint8"]
    want_scales = golden["scale_e8m0_uint8"]
    assert packed.shape == want_packed.shape == (rows, 288)
    bad = (packed != want_packed).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} packed bytes differ, first at {bad[:5].tolist()}"
    got_scales = scales.view(torch.uint8)[:rows, :18]
    bad = (got_scales != want_scales).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} scale bytes differ, first at {bad[:5].tolist()}"
    # the edge rows one by one, for a readable failure
    for r in range(6):
        assert torch.equal(packed[r], want_packed[r]), f"edge row {r}"
        assert torch.equal(got_scales[r], want_scales[r]), f"edge row {r} scales"


def test_mxfp4_dtypes_and_padded_layout(golden):
    x = golden["x_bf16"]
    data, scales = R.quantize_mxfp4(x, use_aiter=False)
    assert data.dtype == torch.float4_e2m1fn_x2
    assert scales.dtype == torch.float8_e8m0fnu
    assert scales.shape == (512, 24)  # ceil(300/256)*256 rows, 18 scales padded to 24
    pad = scales.view(torch.uint8)
    assert int(pad[300:].sum()) == 0 and int(pad[:, 18:].sum()) == 0
    assert R.mxfp4_scale_shape(1) == (256, 24)
    assert R.mxfp4_scale_shape(256) == (256, 24)
    assert R.mxfp4_scale_shape(257) == (512, 24)
    # leading dims are kept: (rows, 1, 576) -> (rows, 1, 288)
    d3, s3 = R.quantize_mxfp4(x[:10].reshape(10, 1, 576), use_aiter=False)
    assert d3.shape == (10, 1, 288) and s3.shape == (256, 24)
    assert torch.equal(d3.view(torch.uint8).reshape(10, 288), data.view(torch.uint8)[:10])


def test_mxfp4_round_trip(golden):
    x = golden["x_bf16"]
    data, scales = R.quantize_mxfp4(x, use_aiter=False)
    deq = R.dequantize_mxfp4(data, scales, rows=300)
    assert deq.dtype == torch.float32 and deq.shape == (300, 576)
    assert torch.count_nonzero(deq[0]) == 0  # all-zero row stays zero
    xf = x.float()
    rel = (deq[6:] - xf[6:]).norm(dim=1) / xf[6:].norm(dim=1)
    assert 0.05 < rel.mean().item() < 0.15  # about 11% on randn rows
    # dequantised values are on the grid: quantising them again gives the same bytes
    d2, s2 = R.quantize_mxfp4(deq.to(torch.bfloat16), use_aiter=False)
    assert torch.equal(d2.view(torch.uint8)[6:], data.view(torch.uint8)[6:])
    assert torch.equal(s2.view(torch.uint8)[6:300], scales.view(torch.uint8)[6:300])


def test_mxfp4_rounding_rules():
    # amax 7 rounds up to 8 at mantissa bit 21 -> e = floor(log2 8) - 2 = 1 -> scale byte 128
    x = torch.tensor([7.0] + [0.0] * 31).reshape(1, 32)
    assert R.quantize_mxfp4(x, use_aiter=False)[1].view(torch.uint8)[0, 0].item() == 128
    # amax 6 -> e = 0; midpoints round away from zero; 0.2 rounds to 0
    vals = [6.0, 5.0, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25, 0.2]
    x = torch.tensor(vals + [-v for v in vals] + [0.0] * 14, dtype=torch.float32).reshape(1, 32)
    data, scales = R.quantize_mxfp4(x, use_aiter=False)
    assert scales.view(torch.uint8)[0, 0].item() == 127
    deq = R.dequantize_mxfp4(data, scales)[0, :18].tolist()
    want = [6.0, 6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0]
    assert deq == want + [-v for v in want]
    packed = data.view(torch.uint8)[0]
    assert packed[4].item() == 0xF0  # even index 8 (0.2 -> +0) low, index 9 (-6 -> 0xF) high
    # the sign bit is kept when the magnitude rounds to zero: -0.2 -> code 8 (-0), as aiter
    assert packed[8].item() == 0x89  # index 16 (-0.25 -> -0.5, 0x9) low, index 17 (-0.2) high
    with pytest.raises(ValueError):
        R.quantize_mxfp4(torch.zeros(2, 33))


# ---------------------------------------------------------------------------------------------
# FP8


def test_fp8_scale_round_trip_and_clamp():
    torch.manual_seed(0)
    x = torch.randn(64, 576).to(torch.bfloat16)
    data, scale = R.quantize_fp8(x)
    assert data.dtype == torch.float8_e4m3fn and data.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (1,)
    amax = x.float().abs().max()
    # a bf16 input gets a bf16 scale (the runner's arithmetic): amax / 448 to within bf16 rounding
    assert scale.item() == pytest.approx(amax.item() / 448.0, rel=2.0**-8)
    assert scale.bfloat16().float().item() == scale.item()
    deq = R.dequantize_fp8(data, scale)
    # the largest element maps to the top of the fp8 range
    assert data.float().abs().max().item() == 448.0
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals, plus the subnormal step, plus
    # the bf16 rounding of x / scale before the cast (half a bf16 step, 2^-8 relative at most)
    err = (deq - x.float()).abs()
    bound = x.float().abs() * (2.0**-4 + 2.0**-8) + scale.item() * 2.0**-9
    assert bool((err <= bound * (1 + 1e-6)).all())
    rel = (deq - x.float()).norm() / x.float().norm()
    assert rel.item() < 0.03
    # clamping: amax / (amax / 448) can land just above 448 in float32; the data must still
    # top out at exactly +-448 (never NaN)
    amax = torch.rand(20000, generator=torch.Generator().manual_seed(1)) * 100 + 1e-3
    over = amax[(amax / (amax / 448.0)) > 448.0]
    assert over.numel() > 0
    for a in over[:20].tolist():
        d, s = R.quantize_fp8(torch.tensor([a, -a, a / 3]))
        assert d.float().tolist()[:2] == [448.0, -448.0]


def test_fp8_zero_tensor_and_fnuz():
    data, scale = R.quantize_fp8(torch.zeros(4, 8))
    assert scale.item() == pytest.approx(1e-12 / 448.0)
    assert torch.count_nonzero(data.float()) == 0
    x = torch.linspace(-3, 3, 100)
    d, s = R.quantize_fp8(x, dtype=torch.float8_e4m3fnuz)
    assert d.dtype == torch.float8_e4m3fnuz
    assert s.item() == pytest.approx(3.0 / 240.0)
    assert R.fp8_dtype("cpu") == torch.float8_e4m3fn


# The runner's quantize_fp8, transcribed independently: every value an exact Fraction, every
# rounding done by hand (to nearest, ties to the even code) on a grid built from the bit layouts.
# The runner: amax = max|t| clamped at 1e-12 (bf16), scale = amax / 448 (bf16), q = t / scale
# (bf16), clamp to +-448, cast to e4m3fn; the scale is returned as float32.


def _float_grid(exp_bits, man_bits, bias, last_code):
    """The non-negative finite values of a sign-magnitude float format, indexed by their code."""
    values = []
    for code in range(last_code + 1):
        exponent, mantissa = code >> man_bits, code & ((1 << man_bits) - 1)
        fraction = Fraction(mantissa, 1 << man_bits)
        if exponent == 0:  # subnormal
            values.append(fraction * Fraction(2) ** (1 - bias))
        else:
            values.append((1 + fraction) * Fraction(2) ** (exponent - bias))
    return values


BF16_GRID = _float_grid(8, 7, 127, 0x7F7F)  # 0x7F80 is inf
E4M3_GRID = _float_grid(4, 3, 7, 0x7E)  # 0x7F is NaN; 0x7E is 448
E4M3_MAX = Fraction(448)


def _nearest_code(magnitude, grid):
    """Code of the grid value nearest to ``magnitude`` (>= 0, at most the grid's maximum); a tie
    goes to the even code (round to nearest even)."""
    i = bisect.bisect_right(grid, magnitude) - 1
    if grid[i] == magnitude:
        return i
    below, above = magnitude - grid[i], grid[i + 1] - magnitude
    if below != above:
        return i if below < above else i + 1
    return i if i % 2 == 0 else i + 1


def _bf16(value):
    return BF16_GRID[_nearest_code(value, BF16_GRID)]


def runner_fp8_by_hand(t):
    """(e4m3fn bytes, scale) of the runner's quantiser on a bf16 tensor, element by element."""
    values = t.float().flatten().tolist()  # bf16 -> float32 is exact
    amax = max(max(abs(Fraction(v)) for v in values), _bf16(Fraction(1e-12)))
    scale = _bf16(amax / 448)
    codes = []
    for v in values:
        quotient = min(_bf16(abs(Fraction(v)) / scale), E4M3_MAX)
        sign = 0x80 if math.copysign(1.0, v) < 0 else 0  # -0.0 and tiny negatives keep the sign
        codes.append(sign | _nearest_code(quotient, E4M3_GRID))
    return codes, scale


def fp8_differences(quantiser, t):
    """What ``quantiser`` gets wrong on ``t`` against the transcription ([] when nothing)."""
    data, scale = quantiser(t)
    codes, want_scale = runner_fp8_by_hand(t)
    problems = []
    if scale.dtype != torch.float32 or tuple(scale.shape) != (1,):
        problems.append(f"scale is {scale.dtype} {tuple(scale.shape)}, not float32 (1,)")
    if Fraction(scale.item()) != want_scale:
        problems.append(f"scale {scale.item()!r} != {float(want_scale)!r}")
    got = data.view(torch.uint8).flatten().tolist()
    bad = [i for i, (a, b) in enumerate(zip(got, codes, strict=True)) if a != b]
    if bad:
        i = bad[0]
        problems.append(f"{len(bad)} of {len(got)} bytes differ, first at {i}: {t.flatten()[i].item()!r}"
                        f" -> {got[i]:#04x}, want {codes[i]:#04x}")
    return problems


def _quotient_edge_values(amax):
    """Positive bf16 values t <= amax whose quotient t / scale (scale = bf16(amax / 448)) is hard
    to round: (1) bf16 rounding puts it EXACTLY on an fp8 tie although the exact quotient is not
    one, so the double rounding (bf16, then fp8 to even) and a single rounding disagree; (2) the
    20 whose exact quotient lies nearest to a bf16 tie. (An exact bf16 tie is impossible: a
    quotient of two 8-bit significands cannot need exactly 9 bits.)"""
    scale = _bf16(amax / 448)
    fp8_ties, near_ties = [], []
    for value in BF16_GRID[1:_nearest_code(amax, BF16_GRID) + 1]:
        exact = value / scale
        once = _bf16(exact)
        if once != exact and (_nearest_code(min(once, E4M3_MAX), E4M3_GRID)
                              != _nearest_code(min(exact, E4M3_MAX), E4M3_GRID)):
            fp8_ties.append(value)
        i = bisect.bisect_right(BF16_GRID, exact) - 1
        if BF16_GRID[i] != exact:
            tie = (BF16_GRID[i] + BF16_GRID[i + 1]) / 2
            near_ties.append((abs(exact - tie) / exact, value))
    near_ties = [value for _, value in sorted(near_ties)[:20]]
    return fp8_ties, near_ties


def _bf16_tensor(values):
    return torch.tensor([float(v) for v in values], dtype=torch.float32).to(torch.bfloat16)


@pytest.fixture(scope="module")
def fp8_cases():
    """Named bf16 tensors for the quantiser: random ones, exact fp8 ties, quotients at the edges
    of both roundings, and amax below the 1e-12 clamp."""
    gen = torch.Generator().manual_seed(3)
    randn = torch.randn(3000, generator=gen).to(torch.bfloat16)
    amax = _bf16(Fraction(33, 10))
    fp8_ties, near_ties = _quotient_edge_values(amax)
    assert len(fp8_ties) > 10 and len(near_ties) == 20
    edges = [amax] + fp8_ties + near_ties
    # amax 448 -> scale exactly 1: each value is its own quotient. Exact e4m3 ties (subnormal,
    # normal, at the top of the range) and values on the grid; -0.0 keeps its sign
    ties = [448.0, 1.0625, 1.1875, 17.0, 19.0, 232.0, 440.0, 2.0**-10, 3 * 2.0**-10, 0.0029296875,
            1.0, 240.0, 0.0]
    return {
        "randn": randn,
        "randn x 1000": (randn.float() * 1000).to(torch.bfloat16),
        "randn x 1e-3 (2-D)": (randn.float() * 1e-3).to(torch.bfloat16).reshape(30, 100),
        "exact fp8 ties": _bf16_tensor(ties + [-v for v in ties]),
        "quotient edges": _bf16_tensor(edges + [-v for v in edges]),
        "amax under the clamp": _bf16_tensor([1e-13, -3e-13, 7e-14, 5e-13, -1e-15, 0.0]),
        "amax far under the clamp": _bf16_tensor([1e-20, -2e-20, 0.0]),
        "zeros": torch.zeros(7, dtype=torch.bfloat16),
    }


def test_quantize_fp8_is_the_runners_arithmetic_bit_for_bit(fp8_cases):
    for name, t in fp8_cases.items():
        assert fp8_differences(R.quantize_fp8, t) == [], name


def _scale_in_float32(t):
    """The quantiser with amax, scale and the division in float32 (what it must NOT be)."""
    x = t.float()
    scale = x.abs().amax().clamp(min=1e-12) / 448.0
    return (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale.reshape(1)


def _single_rounding(t):
    """The right bf16 scale, but t / scale in float32 straight to fp8 (no bf16 quotient)."""
    scale = t.abs().amax().clamp(min=1e-12) / 448.0
    x = (t.float() / scale.float()).clamp(-448.0, 448.0)
    return x.to(torch.float8_e4m3fn), scale.float().reshape(1)


def test_the_fp8_transcription_catches_float32_steps(fp8_cases):
    """The comparison has teeth: a float32 scale changes the scale of every case with a non-
    power-of-two amax, and a float32 quotient changes bytes of the random and edge cases."""
    for name in ("randn", "randn x 1000", "quotient edges", "amax under the clamp"):
        assert any("scale" in p for p in fp8_differences(_scale_in_float32, fp8_cases[name])), name
    for name in ("randn", "quotient edges"):
        problems = fp8_differences(_single_rounding, fp8_cases[name])
        assert problems and all("bytes differ" in p for p in problems), name


def test_generate_input_fp8_is_the_runners_quantiser_of_its_bf16_cache():
    data = R.generate_input(2, 1, 40, 17, device="cpu")
    kv = data[1]["bf16"]
    codes, scale = runner_fp8_by_hand(kv)
    fp8, got_scale = data[1]["fp8"]
    assert fp8.view(torch.uint8).flatten().tolist() == codes
    assert Fraction(got_scale.item()) == scale


# ---------------------------------------------------------------------------------------------
# Inputs


def test_generate_input_structure():
    q, kv, qo, kvp, config = R.generate_input(3, 1, 45, 7, device="cpu")
    assert q.shape == (3, 16, 576) and q.dtype == torch.bfloat16
    assert kv["bf16"].shape == (135, 1, 576) and kv["bf16"].dtype == torch.bfloat16
    fp8, scale = kv["fp8"]
    assert fp8.shape == (135, 1, 576) and fp8.dtype == torch.float8_e4m3fn
    assert scale.shape == (1,) and scale.dtype == torch.float32
    fp4, sc = kv["mxfp4"]
    assert fp4.shape == (135, 1, 288) and fp4.dtype == torch.float4_e2m1fn_x2
    assert sc.shape == (256, 24) and sc.dtype == torch.float8_e8m0fnu
    assert qo.dtype == kvp.dtype == torch.int32
    assert qo.tolist() == [0, 1, 2, 3] and kvp.tolist() == [0, 45, 90, 135]
    assert config == {
        "batch_size": 3, "num_heads": 16, "num_kv_heads": 1, "qk_head_dim": 576,
        "kv_lora_rank": 512, "qk_rope_head_dim": 64, "v_head_dim": 512, "q_seq_len": 1,
        "kv_seq_len": 45, "sm_scale": 1.0 / math.sqrt(576)}
    # fp8 and mxfp4 are made from the bf16 cache
    f2, s2 = R.quantize_fp8(kv["bf16"])
    assert torch.equal(f2.view(torch.uint8), fp8.view(torch.uint8)) and torch.equal(s2, scale)
    m2, ms2 = R.quantize_mxfp4(kv["bf16"], use_aiter=False)
    assert torch.equal(m2.view(torch.uint8), fp4.view(torch.uint8))
    assert torch.equal(ms2.view(torch.uint8), sc.view(torch.uint8))


def _flat(data):
    q, kv, qo, kvp, _ = data
    return [q, kv["bf16"], kv["fp8"][0].view(torch.uint8), kv["fp8"][1],
            kv["mxfp4"][0].view(torch.uint8), kv["mxfp4"][1].view(torch.uint8), qo, kvp]


def test_generate_input_is_deterministic():
    a = R.generate_input(2, 1, 20, 1234, device="cpu")
    b = R.generate_input(2, 1, 20, 1234, device="cpu")
    c = R.generate_input(2, 1, 20, 1235, device="cpu")
    assert all(torch.equal(x, y) for x, y in zip(_flat(a), _flat(b), strict=True))
    assert a[4] == b[4]
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[1]["bf16"], c[1]["bf16"])
    # generation order: q first, then kv, from one generator seeded with the seed
    gen = torch.Generator().manual_seed(1234)
    q = torch.randn((2, 16, 576), dtype=torch.bfloat16, generator=gen)
    kv = torch.randn((40, 1, 576), dtype=torch.bfloat16, generator=gen)
    assert torch.equal(q, a[0]) and torch.equal(kv, a[1]["bf16"])


def test_generate_input_variable_lengths():
    q, kv, qo, kvp, config = R.generate_input(3, 1, 999, 5, kv_lens=[10, 100, 37], device="cpu")
    assert kvp.tolist() == [0, 10, 110, 147]
    assert kv["bf16"].shape[0] == 147 and config["kv_seq_len"] == 100
    with pytest.raises(ValueError):
        R.generate_input(2, 1, 10, 5, kv_lens=[1, 2, 3], device="cpu")


def test_clone_data_is_deep():
    data = R.generate_input(1, 1, 16, 3, device="cpu")
    c = R.clone_data(data)
    c[0].zero_()
    c[1]["fp8"][0].view(torch.uint8).zero_()
    assert data[0].abs().sum() > 0 and data[1]["fp8"][0].view(torch.uint8).sum() > 0


# ---------------------------------------------------------------------------------------------
# The portable reference


@pytest.mark.parametrize("bs,kv,seed", [(1, 16, 11), (2, 45, 12), (4, 300, 13), (2, 1024, 14)])
def test_ref_kernel_is_at_the_fp8_level_uniform(bs, kv, seed):
    data = R.generate_input(bs, 1, kv, seed, device="cpu")
    out = R.ref_kernel(data)
    assert out.shape == (bs, 16, 512) and out.dtype == torch.bfloat16
    rel = R.rel_l2_error(out, data)
    assert 0.001 < rel < 0.05, rel  # fp8 q and KV, not the bf16 path


def test_ref_kernel_is_at_the_fp8_level_variable():
    data = R.generate_input(4, 1, 0, 21, kv_lens=[1, 64, 300, 17], device="cpu")
    out = R.ref_kernel(data)
    rel = R.rel_l2_error(out, data)
    assert 0.001 < rel < 0.05, rel
    # each batch's rows only see their own KV: compare batch 2 with a hand-computed result
    q, kv, qo, kvp, cfg = data
    qd = R.dequantize_fp8(*R.quantize_fp8(q))
    k = R.dequantize_fp8(*kv["fp8"])[:, 0]
    k2 = k[65:365]
    p = torch.softmax(qd[2] @ k2.T * cfg["sm_scale"], dim=-1)
    want = (p @ k2[:, :512]).to(torch.bfloat16)
    assert (out[2].float() - want.float()).abs().max().item() < 1e-2


def _same_up_to_one_bf16_rounding(got, want):
    """A bf16 output equal to ``want`` but for elements one bf16 step away: CPU BLAS may order a
    float32 sum differently for another batch count (how it splits the work depends on the
    threads), and a float32 difference in the last bit can flip a bf16 rounding. A wrong chunk or
    row index would be off by far more."""
    torch.testing.assert_close(got.float(), want.float(), rtol=2.0**-7, atol=1e-6)


def test_batched_chunked_and_looped_paths_agree(monkeypatch):
    data = R.generate_input(5, 1, 40, 31, device="cpu")
    whole = R.ref_kernel(data)
    monkeypatch.setattr(R, "_CHUNK_BYTES", 1)  # one batch per chunk
    _same_up_to_one_bf16_rounding(R.ref_kernel(data), whole)
    monkeypatch.setattr(R, "_CHUNK_BYTES", 2 * 40 * 576 * 4 + 2 * 16 * 40 * 4 * 3)  # 2 per chunk
    _same_up_to_one_bf16_rounding(R.ref_kernel(data), whole)
    # the same rows through the per-batch loop (a variable-length layout with equal lengths
    # except for an empty trailing batch) give the same numbers
    q, kv, qo, kvp, cfg = data
    looped = R._attention(
        R.dequantize_fp8(*R.quantize_fp8(q)), lambda a, b: R.dequantize_fp8(
            kv["fp8"][0][a:b, 0], kv["fp8"][1]), qo.tolist() + [5], kvp.tolist() + [200],
        cfg["sm_scale"], torch.float32)
    assert (looped[:5] - whole.float()).abs().max().item() < 1e-2


def test_attention_float64_matches_naive():
    data = R.generate_input(2, 1, 33, 41, device="cpu")
    out = R.attention_float64(data)
    assert out.dtype == torch.float64 and out.shape == (2, 16, 512)
    q, kv, _, _, cfg = data
    k = kv["bf16"][:, 0].double()
    for b in range(2):
        kb = k[33 * b:33 * (b + 1)]
        p = torch.softmax(q[b].double() @ kb.T * cfg["sm_scale"], dim=-1)
        assert torch.allclose(out[b], p @ kb[:, :512], rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# The check


@pytest.fixture(scope="module")
def five_batches():
    # bs=5: 5*16*512 = 40960 elements, so 5% is exactly 2048 elements
    data = R.generate_input(5, 1, 64, 51, device="cpu")
    return data, R.ref_kernel(data)


def _perturbed(expected, count):
    out = expected.clone()
    flat = out.view(-1)
    idx = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))[:count]
    flat[idx] += 5.0
    return out


def test_check_passes_exact_reference(five_batches):
    data, expected = five_batches
    ok, msg = R.check_implementation(data, expected.clone())
    assert ok and "mismatch ratio 0.000%" in msg and "max abs error" in msg


@pytest.mark.parametrize("share,ok", [(0.049, True), (0.05, True), (0.051, False)])
def test_check_at_the_five_percent_boundary(five_batches, share, ok):
    data, expected = five_batches
    n = expected.numel()
    count = int(share * n)
    out = _perturbed(expected, count)
    assert R.mismatch_ratio(out, expected) == pytest.approx(count / n)
    got, msg = R.check_implementation(data, out)
    assert got is ok, msg
    assert "mismatch ratio" in msg and "max abs error" in msg
    assert f"{count} of {n}" in msg


def test_check_nan_and_inf_fail(five_batches):
    data, expected = five_batches
    one_nan = expected.clone()
    one_nan.view(-1)[123] = float("nan")
    ok, msg = R.check_implementation(data, one_nan)
    assert not ok and "NaN/inf" in msg
    ok, msg = R.check_implementation(data, torch.full_like(expected, float("nan")))
    assert not ok and "mismatch ratio 100.000%" in msg
    one_inf = expected.clone()
    one_inf.view(-1)[7] = float("inf")
    assert not R.check_implementation(data, one_inf)[0]
    assert R.mismatch_ratio(one_nan, expected) == pytest.approx(1 / expected.numel())


def test_check_wrong_shape_or_type(five_batches):
    data, expected = five_batches
    assert not R.check_implementation(data, expected[:, :, :256])[0]
    assert not R.check_implementation(data, None)[0]


def test_zeros_fail_short_kv_but_can_pass_the_loose_check_at_long_kv():
    short = R.generate_input(2, 1, 45, 61, device="cpu")
    assert not R.check_implementation(short, torch.zeros(2, 16, 512, dtype=torch.bfloat16))[0]
    # attention over 2000 randn rows averages to |out| ~ 0.03: zeros are within atol = 0.1 for
    # more than 95% of the elements. The loose check passes; rel L2 error (1.0) does not.
    long = R.generate_input(2, 1, 2000, 62, device="cpu")
    zeros = torch.zeros(2, 16, 512, dtype=torch.bfloat16)
    ok, msg = R.check_implementation(long, zeros)
    assert ok and "WARNING" in msg
    assert R.rel_l2_error(zeros, long) == pytest.approx(1.0)


def test_rel_l2_error_forms(five_batches):
    data, expected = five_batches
    exact = R.attention_float64(data)
    assert R.rel_l2_error(exact, exact) == 0.0
    assert R.rel_l2_error(expected, data) == pytest.approx(R.rel_l2_error(expected, exact))
    assert R.rel_l2_error(2 * exact, exact) == pytest.approx(1.0)


def test_ref_kernel_uses_torch_without_aiter():
    assert R.HAVE_AITER is False or torch.cuda.is_available()
    data = R.generate_input(1, 1, 16, 71, device="cpu")
    assert torch.equal(R.ref_kernel(data), R.ref_kernel_torch(data))


class _RecordingAiter:
    """A stand-in for aiter that records every call of the three functions the reference uses;
    the metadata buffers get distinct sizes (1..6 elements) so that each can be followed by name."""

    BUFFER_SIZES = {"work_metadata": 1, "work_indptr": 2, "work_info_set": 3, "reduce_indptr": 4,
                    "reduce_final_map": 5, "reduce_partial_map": 6}

    def __init__(self):
        self.calls = {}
        self.module = types.ModuleType("aiter")
        self.module.get_mla_metadata_info_v1 = self._record("info", self._info)
        self.module.get_mla_metadata_v1 = self._record("metadata", lambda *a, **k: None)
        self.mla = types.ModuleType("aiter.mla")
        self.mla.mla_decode_fwd = self._record("decode", lambda *a, **k: None)
        self.module.mla = self.mla

    def _record(self, name, result):
        def call(*args, **kwargs):
            self.calls[name] = (args, kwargs)
            return result(*args, **kwargs)

        return call

    def _info(self, *args, **kwargs):
        # aiter's order: work_metadata, work_indptr, work_info_set, reduce_indptr,
        # reduce_final_map, reduce_partial_map
        return [((size,), torch.int32) for size in self.BUFFER_SIZES.values()]


def test_aiter_reference_makes_exactly_the_runners_calls(monkeypatch):
    """ref_kernel_aiter against a recording aiter (the real one exists only on the MI355X): every
    argument of the three calls as docs/runner.md ("The reference and the check") states them,
    variable KV lengths included."""
    fake = _RecordingAiter()
    monkeypatch.setitem(sys.modules, "aiter", fake.module)
    monkeypatch.setitem(sys.modules, "aiter.mla", fake.mla)
    data = R.generate_input(3, 1, 40, 81, kv_lens=[3, 40, 17], device="cpu")
    q, kv_data, qo_indptr, kv_indptr, config = data
    kv_fp8, kv_scale = kv_data["fp8"]
    fp8 = torch.float8_e4m3fn
    out = R.ref_kernel_aiter(data)

    args, kwargs = fake.calls["info"]
    assert args == (3, 1, 16, fp8, fp8)
    assert kwargs == {"is_sparse": False, "fast_mode": False, "num_kv_splits": 32,
                      "intra_batch_mode": True}

    args, kwargs = fake.calls["metadata"]
    assert args[0] is qo_indptr and args[1] is kv_indptr
    lengths = args[2]
    assert lengths.dtype == torch.int32 and lengths.tolist() == [3, 40, 17]
    assert args[3:6] == (16, 1, True)
    sizes = [buffer.numel() for buffer in args[6:]]
    assert sizes == [1, 3, 2, 4, 5, 6]  # work_metadata, work_info_set, work_indptr, reduce_*
    assert kwargs == {"page_size": 1, "kv_granularity": 16, "max_seqlen_qo": 1,
                      "uni_seqlen_qo": 1, "fast_mode": False, "max_split_per_batch": 32,
                      "intra_batch_mode": True, "dtype_q": fp8, "dtype_kv": fp8}

    args, kwargs = fake.calls["decode"]
    q_fp8, q_scale = R.quantize_fp8(q)
    assert len(args) == 8
    assert torch.equal(args[0].view(torch.uint8), q_fp8.view(torch.uint8))
    assert args[1].shape == (60, 1, 1, 576) and args[1].data_ptr() == kv_fp8.data_ptr()
    assert args[2] is out and out.shape == (3, 16, 512) and out.dtype == torch.bfloat16
    assert args[3] is qo_indptr and args[4] is kv_indptr
    assert args[5].dtype == torch.int32 and args[5].tolist() == list(range(60))
    assert args[6] is lengths and args[7] == 1
    buffers = {name: kwargs.pop(name) for name in (
        "work_meta_data", "work_indptr", "work_info_set", "reduce_indptr", "reduce_final_map",
        "reduce_partial_map")}
    assert {name: b.numel() for name, b in buffers.items()} == {
        "work_meta_data": 1, "work_indptr": 2, "work_info_set": 3, "reduce_indptr": 4,
        "reduce_final_map": 5, "reduce_partial_map": 6}
    assert torch.equal(kwargs.pop("q_scale"), q_scale)
    assert kwargs.pop("kv_scale") is kv_scale
    assert kwargs == {"page_size": 1, "nhead_kv": 1, "sm_scale": 1 / math.sqrt(576),
                      "logit_cap": 0.0, "num_kv_splits": 32, "intra_batch_mode": True}


def test_aiter_reference_on_the_aiter_double_matches_the_torch_reference():
    """ref_kernel_aiter through the project's aiter double, which checks the calls against aiter's
    contract and models the reference's intra-batch work plan (batches of at least 196 rows, as
    gfx950's plan needs): the output is the torch reference's to within rounding."""
    from aiter_double import loader

    data = R.generate_input(3, 1, 400, 81, kv_lens=[200, 400, 333], device="cpu")
    with loader.aiter_environment("2026-03"):
        import aiter

        aiter.reset()
        out = R.ref_kernel_aiter(data)
        assert aiter.CALLS["get_mla_metadata_info_v1"] == aiter.CALLS["get_mla_metadata_v1"] == 1
        assert aiter.CALLS["mla_decode_fwd"] == 1
    assert out.shape == (3, 16, 512) and out.dtype == torch.bfloat16
    assert R.rel_l2_error(out, R.ref_kernel_torch(data).double()) < 1e-3


@pytest.mark.parametrize("args,kwargs,message", [
    ((0, 1, 16, 1), {}, "batchsize must be >= 1, got 0"),
    ((-2, 1, 16, 1), {}, "batchsize must be >= 1, got -2"),
    ((2, 0, 16, 1), {}, "qseqlen must be >= 1"),
    ((2, 1, 0, 1), {}, "kvseqlen must be >= 1, got 0"),
    ((2, 1, -7, 1), {}, "kvseqlen must be >= 1, got -7"),
    ((2, 1, 0, 1), {"kv_lens": [0, 0]}, r"kv_lens \[0, 0\] holds no KV row"),
    ((2, 1, 0, 1), {"kv_lens": [5, -1]}, "kv_lens must be >= 0, got -1"),
    ((2, 1, 0, 1), {"kv_lens": [1, 2, 3]}, r"kv_lens needs one length per batch \(batchsize 2\), got 3"),
    ((2, 1, 0, 1), {"kv_lens": "12"}, "kv_lens must be a sequence"),
    ((2.5, 1, 16, 1), {}, "batchsize must be an integer"),
    ((2, 1, 16, 0.5), {}, "seed must be an integer"),
    ((True, 1, 16, 1), {}, "batchsize must be an integer"),
])
def test_generate_input_refuses_what_it_cannot_make_naming_the_field(monkeypatch, args, kwargs,
                                                                     message):
    def no_tensor_work(*a, **k):
        raise AssertionError("tensor work before the arguments were checked")

    monkeypatch.setattr(R.torch, "Generator", no_tensor_work)  # the first tensor step
    with pytest.raises(ValueError, match=message):
        R.generate_input(*args, device="cpu", **kwargs)


def test_generate_input_takes_integer_likes_and_ignores_kvseqlen_given_kv_lens():
    import numpy as np

    q, kv, _, kv_indptr, config = R.generate_input(np.int64(2), torch.tensor(1), 9, 3,
                                                   device="cpu")
    assert q.shape[0] == 2 and kv_indptr.tolist() == [0, 9, 18]
    *_, kv_indptr, config = R.generate_input(3, 1, 0, 3, kv_lens=(1, 7, 20), device="cpu")
    assert kv_indptr.tolist() == [0, 1, 8, 28] and config["kv_seq_len"] == 20

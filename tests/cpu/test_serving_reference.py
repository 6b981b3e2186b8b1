"""reference.py's serving half: generate_serving_input (lengths, block layout, NaN in unattended
slots, garbage block ids, fp8 like quantize_fp8, determinism, argument errors),
mla_decode_paged_float64 against a naive loop over (request, query token, head), and
check_serving's bounds (the reference itself passes; zeros, NaN and perturbations fail).

Tiny inputs on the default device (the GPU when there is one), so that the reference is tested
where eval.py runs it."""
import math
import random

import pytest
import torch

import reference as R
import utils

DEVICE = utils.get_device()


def make(batch=3, s_q=2, heads=3, page=16, kvseqlen=40, seed=1, **kw):
    return R.generate_serving_input(batch, s_q, heads, page, kvseqlen, seed, device=DEVICE, **kw)


def reference_of(inputs, q=None):
    return R.mla_decode_paged_float64(
        inputs.q if q is None else q, inputs.k_cache, inputs.block_table, inputs.cache_seqlens,
        k_scale=inputs.k_scale, softmax_scale=inputs.softmax_scale, causal=inputs.causal)


def naive(inputs):
    """The API's definition, one (request, query token, head) at a time, every token looked up
    through the block table by hand: (out, lse) float64 on the CPU."""
    q, cache = inputs.q.cpu(), inputs.k_cache.cpu()
    table = inputs.block_table.cpu()
    scale = 1.0 if inputs.k_scale is None else float(inputs.k_scale)
    batch, s_q, heads, _ = q.shape
    out = torch.zeros(batch, s_q, heads, 512, dtype=torch.float64)
    lse = torch.full((batch, heads, s_q), math.inf, dtype=torch.float64)
    for b, length in enumerate(inputs.lengths):
        for i in range(s_q):
            n = max(0, length - s_q + i + 1) if inputs.causal else length
            if n == 0:
                continue
            keys = torch.stack([cache[int(table[b, p // inputs.page]), p % inputs.page, 0]
                                .to(torch.float64) * scale for p in range(n)])
            for h in range(heads):
                scores = [inputs.softmax_scale * float(q[b, i, h].double() @ keys[p])
                          for p in range(n)]
                top = max(scores)
                total = sum(math.exp(s - top) for s in scores)
                lse[b, h, i] = top + math.log(total)
                weights = torch.tensor([math.exp(s - lse[b, h, i].item()) for s in scores],
                                       dtype=torch.float64)
                out[b, i, h] = weights @ keys[:, :512]
    return out, lse


def raw_bytes(t):
    """A tensor's bytes (NaN-safe equality)."""
    return t.contiguous().view(torch.uint8).cpu()


# ---------------------------------------------------------------------------------------------
# The float64 reference


@pytest.mark.parametrize("kw", [
    dict(kv="bf16"),
    dict(kv="fp8", causal=True, page=1),
    dict(kv="bf16", causal=True, varlen=True, zeros=1, s_q=3, kvseqlen=12),
    dict(kv="fp8", varlen=True, zeros=2, batch=4, heads=2, page=4, kvseqlen=20),
    dict(kv="bf16", causal=True, s_q=4, kvseqlen=2, heads=1, page=2),  # queries with no token
], ids=["bf16", "fp8-causal-page1", "varlen-causal-zeros", "fp8-varlen-zeros", "causal-empty"])
def test_reference_matches_a_naive_loop(kw):
    inputs = make(**kw)
    out, lse = reference_of(inputs)
    want_out, want_lse = naive(inputs)
    assert out.dtype == lse.dtype == torch.float64 and out.device == inputs.q.device
    assert out.shape == (inputs.batchsize, inputs.qseqlen, inputs.heads, 512)
    assert lse.shape == (inputs.batchsize, inputs.heads, inputs.qseqlen)
    torch.testing.assert_close(out.cpu(), want_out, rtol=1e-12, atol=1e-12)
    assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(want_lse))
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=1e-12, atol=1e-12)


def test_rows_with_nothing_to_attend_are_zero_with_lse_plus_inf():
    # request 0 is empty (zeros); with 2 tokens and 4 causal query tokens, queries 0 and 1 of
    # every other request attend nothing
    inputs = make(batch=3, s_q=4, kvseqlen=2, causal=True, zeros=1, page=1)
    assert inputs.lengths == [0, 2, 2]
    out, lse = reference_of(inputs)
    attended = R.attended_rows(inputs.lengths, 4, inputs.heads, True, DEVICE)
    assert attended.shape == (3, 4, inputs.heads)
    assert attended[:, :, 0].tolist() == [[False] * 4, [False, False, True, True],
                                          [False, False, True, True]]
    assert bool((out[~attended] == 0).all())
    assert bool(torch.isposinf(lse.permute(0, 2, 1)[~attended]).all())
    assert bool(torch.isfinite(lse.permute(0, 2, 1)[attended]).all())
    # query 2 attends exactly token 0: its output is that token's first 512 values
    token0 = inputs.k_cache[int(inputs.block_table[1, 0]), 0, 0, :512].double()
    torch.testing.assert_close(out[1, 2, 0], token0, rtol=0, atol=0)


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_unattended_slots_hold_nan_that_never_leaks(kv):
    inputs = make(batch=4, s_q=2, page=16, kvseqlen=21, varlen=True, zeros=1, kv=kv)
    cache = inputs.k_cache
    num_blocks, page = cache.shape[:2]
    if kv == "fp8":
        nan_slot = (raw_bytes(cache) == 0x7F).all(dim=-1).reshape(num_blocks, page)
        assert cache.dtype == R.fp8_dtype(DEVICE)
    else:
        nan_slot = torch.isnan(cache.float()).all(dim=-1).reshape(num_blocks, page).cpu()
    assert int(nan_slot.sum()) == num_blocks * page - sum(inputs.lengths)
    used = -(-torch.tensor(inputs.lengths) // page)
    assert num_blocks > int(used.sum())  # spare blocks exist
    out, lse = reference_of(inputs)
    assert bool(torch.isfinite(out).all()) and not bool(torch.isnan(lse).any())


def test_garbage_block_ids_past_the_used_ones_are_never_read():
    inputs = make(batch=4, page=4, kvseqlen=10, varlen=True, zeros=1)
    table = inputs.block_table.cpu()
    width = table.shape[1]
    used = [-(-n // inputs.page) for n in inputs.lengths]
    assert width == max(used) + 1
    for b, nb in enumerate(used):
        garbage = table[b, nb:].tolist()
        assert garbage and set(garbage) <= {-1, 2147480000}
        assert all(garbage[j] != garbage[j + 1] for j in range(len(garbage) - 1))  # alternating
    out, lse = reference_of(inputs)
    # point the garbage at an all-NaN spare block, then far out of range: nothing changes
    spare = sorted(set(range(inputs.k_cache.shape[0])) - set(table[table >= 0].tolist()))[0]
    for value in (spare, 2**31 - 1):
        other = table.clone()
        for b, nb in enumerate(used):
            other[b, nb:] = value
        out2, lse2 = R.mla_decode_paged_float64(inputs.q, inputs.k_cache, other.to(DEVICE),
                                                inputs.cache_seqlens)
        assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_fp8_dequantisation_and_the_scale_like_quantize_fp8():
    inputs = make(kv="fp8", page=8, kvseqlen=30, seed=4)
    bf16 = make(kv="bf16", page=8, kvseqlen=30, seed=4)  # the same draws before quantising
    data, scale = R.quantize_fp8(bf16.k_cache.nan_to_num(0.0), dtype=inputs.k_cache.dtype)
    assert inputs.k_scale.dtype == torch.float32 and inputs.k_scale.shape == (1,)
    # the fp8 cache is quantize_fp8 of the bf16 cache with its unattended slots zeroed
    assert torch.equal(inputs.k_scale, scale)
    finite = ~torch.isnan(bf16.k_cache)
    assert torch.equal(raw_bytes(inputs.k_cache)[finite.cpu()], raw_bytes(data)[finite.cpu()])
    out, lse = reference_of(inputs)
    # the same attention over a float64 cache holding the dequantised values, without a scale
    deq = inputs.k_cache.to(torch.float64) * inputs.k_scale.double()
    out64, lse64 = R.mla_decode_paged_float64(inputs.q, deq, inputs.block_table,
                                              inputs.cache_seqlens)
    torch.testing.assert_close(out, out64, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(lse, lse64, rtol=1e-13, atol=1e-13)
    # k_scale as a Python float
    out_f, _ = R.mla_decode_paged_float64(inputs.q, inputs.k_cache, inputs.block_table,
                                          inputs.cache_seqlens, k_scale=float(inputs.k_scale))
    assert torch.equal(out, out_f)


# ---------------------------------------------------------------------------------------------
# The generator


def test_generator_is_deterministic_and_lays_out_what_it_says():
    a = make(batch=5, s_q=2, heads=4, page=16, kvseqlen=30, seed=9, varlen=True, zeros=2,
             kv="fp8", causal=True)
    b = make(batch=5, s_q=2, heads=4, page=16, kvseqlen=30, seed=9, varlen=True, zeros=2,
             kv="fp8", causal=True)
    for name in ("q", "k_cache", "k_scale", "block_table", "cache_seqlens"):
        assert torch.equal(raw_bytes(getattr(a, name)), raw_bytes(getattr(b, name))), name
    c = make(batch=5, s_q=2, heads=4, page=16, kvseqlen=30, seed=10, varlen=True, zeros=2)
    assert not torch.equal(a.q, c.q) and a.lengths != c.lengths
    assert a.q.shape == (5, 2, 4, 576) and a.q.dtype == torch.bfloat16
    assert a.block_table.dtype == a.cache_seqlens.dtype == torch.int32
    assert a.cache_seqlens.tolist() == a.lengths and a.causal and a.softmax_scale == R.SM_SCALE
    assert a.head_dim_v == 512 and a.k_cache.shape[1:] == (16, 1, 576)
    # FlashMLA's lengths: int(max(normal(mean, mean / 2), s_q)) from Python's seeded generator;
    # the zero rows, spread over the batch, keep everyone else's draw
    rng = random.Random(9)
    draws = [int(max(rng.normalvariate(30, 15), 2)) for _ in range(5)]
    assert R.zero_rows(5, 2) == [0, 2]
    assert a.lengths == [0, draws[1], 0, draws[3], draws[4]]
    assert a.attended_tokens == sum(draws[i] for i in (1, 3, 4))
    assert a.cache_bytes == 576 * a.attended_tokens
    fixed = make(batch=3, kvseqlen=17, zeros=1)
    assert fixed.lengths == [0, 17, 17] and fixed.cache_bytes == 1152 * 34
    # every block a request uses is its own (a permutation), and spare blocks remain
    used = [x for row, n in zip(a.block_table.tolist(), a.lengths, strict=True)
            for x in row[:-(-n // 16)]]
    assert len(used) == len(set(used)) and all(0 <= x < a.k_cache.shape[0] for x in used)


@pytest.mark.parametrize("kw,field", [
    (dict(batchsize=0), "batchsize"), (dict(qseqlen=9), "qseqlen"), (dict(qseqlen=0), "qseqlen"),
    (dict(heads=129), "heads"), (dict(heads=0), "heads"), (dict(page=3), "page"),
    (dict(page=256), "page"), (dict(kvseqlen=0), "kvseqlen"), (dict(seed="x"), "seed"),
    (dict(varlen=2), "varlen"), (dict(causal="yes"), "causal"), (dict(kv="mxfp4"), "kv"),
    (dict(zeros=4), "zeros"), (dict(zeros=-1), "zeros"), (dict(heads=2.0), "heads"),
])
def test_bad_arguments_are_value_errors_naming_the_field(kw, field):
    args = dict(batchsize=3, qseqlen=1, heads=2, page=4, kvseqlen=10, seed=1)
    args.update(kw)
    with pytest.raises(ValueError, match=rf"^{field} "):
        R.generate_serving_input(**args, device="cpu")


# ---------------------------------------------------------------------------------------------
# The check and its bounds


def as_kernel_output(out, lse):
    return out.to(torch.bfloat16), lse.to(torch.float32)


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_the_reference_cast_to_the_api_dtypes_passes(kv):
    inputs = make(kv=kv, causal=True, varlen=True, zeros=1, batch=4, s_q=2, kvseqlen=25)
    expected = R.serving_expected(inputs)
    ok, message = R.check_serving(inputs, *as_kernel_output(expected.out, expected.lse))
    assert ok, message
    assert "out rel L2" in message and "bound" in message and "rows attend nothing" in message
    if kv == "fp8":
        # what rounding q alone costs is within the fp8 bound, by its construction
        q8 = R.round_q_fp8_per_request(inputs.q, inputs.k_cache.dtype)
        ok, message = R.check_serving(inputs, *as_kernel_output(*reference_of(inputs, q8)),
                                      expected)
        assert ok, message
        assert "fp8-rounded q alone" in message


def test_bounds():
    assert R.serving_out_bound("bf16") == 0.01
    assert R.serving_out_bound("fp8", 0.03) == pytest.approx(1.25 * 0.03 + 0.02)
    assert R.serving_out_bound("fp8", 2.0) == 0.5  # the ceiling: zeros never pass
    lse = torch.tensor([[0.0, 10.0, -20.0]], dtype=torch.float64)
    assert R.serving_lse_bound("bf16", lse)[0].tolist() == pytest.approx([1e-3, 2e-3, 3e-3])
    assert R.serving_lse_bound("fp8", lse, 0.04)[0].tolist() == pytest.approx([0.06] * 3)


def test_the_fp8_bound_is_the_race_rule_of_submission_py():
    import submission

    assert R.SERVING_FP8_FACTOR == submission.RACE_BOUND_FACTOR
    assert R.SERVING_FP8_OUT_FLOOR == submission.RACE_BOUND_FLOOR
    assert R.SERVING_FP8_OUT_CEILING == submission.RACE_ERROR_CEILING


def test_q_rounding_uses_one_scale_per_request():
    q = torch.randn(2, 2, 3, 576, dtype=torch.bfloat16)
    q[1] *= 1000  # a request of large values must not change the other's rounding
    r = R.round_q_fp8_per_request(q, torch.float8_e4m3fn)
    alone = R.round_q_fp8_per_request(q[:1], torch.float8_e4m3fn)
    assert torch.equal(r[:1], alone)
    rel = (r.double() - q.double()).norm() / q.double().norm()
    assert 0.005 < rel < 0.05  # e4m3: 3 mantissa bits


@pytest.fixture(scope="module")
def judged():
    inputs = make(kv="bf16", causal=True, s_q=2, kvseqlen=1, batch=3, zeros=1, page=1,
                  heads=3, seed=3)
    return inputs, R.serving_expected(inputs)


def _bad(inputs, expected, out, lse):
    ok, message = R.check_serving(inputs, out, lse, expected)
    assert not ok
    return message


def test_check_serving_failures(judged):
    inputs, expected = judged  # lengths [0, 1, 1]: query 0 of each request attends nothing
    out, lse = as_kernel_output(expected.out, expected.lse)
    assert R.check_serving(inputs, out, lse, expected)[0]
    # all zeros
    assert "out rel L2 1 > bound" in _bad(inputs, expected, torch.zeros_like(out), lse)
    # one NaN where the reference is finite
    nan = out.clone()
    nan[1, 1, 0, 7] = float("nan")
    assert "NaN/inf" in _bad(inputs, expected, nan, lse)
    # 3% noise
    noisy = (expected.out * (1 + 0.03 * torch.randn_like(expected.out))).to(torch.bfloat16)
    assert "out rel L2" in _bad(inputs, expected, noisy, lse)
    # lse off by 0.01 on one row
    off = lse.clone()
    off[2, 1, 1] += 0.01
    assert "lse error" in _bad(inputs, expected, out, off)
    # a row that attends nothing must be exactly 0 with lse +inf
    leak = out.clone()
    leak[1, 0, 1, 0] = 1e-3
    assert "1 of" in _bad(inputs, expected, leak, lse)
    finite = lse.clone()
    finite[1, 0, 0] = 0.0
    assert "lse != +inf" in _bad(inputs, expected, out, finite)
    # types, shapes, dtypes
    assert "out dtype" in _bad(inputs, expected, out.float(), lse)
    assert "lse shape" in _bad(inputs, expected, out, lse.transpose(1, 2))
    assert "lse is NoneType" in _bad(inputs, expected, out, None)


def test_all_rows_empty_passes_only_zeros():
    inputs = make(batch=2, zeros=2, kv="fp8")
    expected = R.serving_expected(inputs)
    out, lse = as_kernel_output(expected.out, expected.lse)
    ok, message = R.check_serving(inputs, out, lse, expected)
    assert ok and bool((out == 0).all()) and "rows attend nothing" in message
    assert not R.check_serving(inputs, torch.ones_like(out), lse, expected)[0]

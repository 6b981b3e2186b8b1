"""bench/fa3_mla.py's FA3 provider through a strict double of flash-attention 3's ops (tests/doubles/fa3_double.py): the
wiring (the q / q_v and k / v split of q and the cache as views, the rows and cu_seqlens_q, the page table and
seqused_k, the scale, causal, num_splits with its scheduler metadata, the lse layout, re-paging) against float64
attention. FA3's kernels are not here: bench/fa3_mla.py's main() checks them on the GPU."""
import math

import pytest
import torch

import fa3_double
import reference
from bench.fa3_mla import VLLM_NUM_SPLITS, fa3_calls, repage

TOL = 5e-3  # bf16 rounding of the output only


def case_of(s_q, causal, page, heads=4, batch=3, s_k=70, seed=3):
    return reference.generate_serving_input(batch, s_q, heads, page, s_k, seed, varlen=True, causal=causal,
                                            device="cpu")


def exact(case):
    return reference.mla_decode_paged_float64(case.q, case.k_cache, case.block_table, case.cache_seqlens,
                                              causal=case.causal)


def rel_err(out, want_out, want_lse):
    """bench/serving_peers.py's error: rel. L2 over every attended row."""
    attended = torch.isfinite(want_lse).permute(0, 2, 1)
    got, want = out.double()[attended], want_out[attended]
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("s_q, causal, page, heads, splits", [
    (1, False, 16, 4, VLLM_NUM_SPLITS), (2, True, 64, 4, VLLM_NUM_SPLITS), (2, False, 1, 4, 0),
    (1, False, 64, 16, 1), (2, True, 32, 8, 0)])
def test_fa3_calls_give_float64_attention_through_the_double(s_q, causal, page, heads, splits):
    case = case_of(s_q, causal, page, heads)
    want_out, want_lse = exact(case)
    out, lse = fa3_calls(fa3_double, case, num_splits=splits)["FA3 bf16"]()
    assert out.dtype == torch.bfloat16 and out.shape == want_out.shape
    assert lse.dtype == torch.float32 and lse.shape == want_lse.shape  # (b, h, s_q), as the serving API's
    assert rel_err(out, want_out, want_lse) < TOL
    finite = torch.isfinite(want_lse)
    assert (lse.double()[finite] - want_lse[finite]).abs().max().item() < 1e-4  # natural log, same layout


def test_a_double_of_zeros_fails_the_check(monkeypatch):
    case = case_of(2, True, 16)
    want_out, want_lse = exact(case)
    real_fwd = fa3_double.fwd

    def zeros(*args, **kwargs):
        out, lse, a, b = real_fwd(*args, **kwargs)
        return torch.zeros_like(out), lse, a, b
    monkeypatch.setattr(fa3_double.flash_attn_3_gpu, "fwd", zeros)
    out, _ = fa3_calls(fa3_double, case)["FA3 bf16"]()
    assert rel_err(out, want_out, want_lse) == 1.0 > TOL


def test_the_scale_and_the_value_half_of_q_matter():
    """A call without softmax_scale (the op's default 1/sqrt(64)) or without q_v would be caught."""
    case = case_of(1, False, 16)
    want_out, want_lse = exact(case)
    ops = fa3_double.flash_attn_3_gpu
    batch, s_q, heads, _ = case.q.shape
    rows = case.q.reshape(batch * s_q, heads, 576)
    cu = torch.arange(batch + 1, dtype=torch.int32) * s_q
    common = dict(cu_seqlens_q=cu, seqused_k=case.cache_seqlens, max_seqlen_q=s_q, page_table=case.block_table)
    k, v = case.k_cache[..., 512:], case.k_cache[..., :512]
    no_scale = ops.fwd(rows[..., 512:], k, v, q_v=rows[..., :512], **common)[0]
    no_qv = ops.fwd(rows[..., 512:], k, v, softmax_scale=reference.SM_SCALE, **common)[0]
    both = ops.fwd(rows[..., 512:], k, v, q_v=rows[..., :512], softmax_scale=reference.SM_SCALE, **common)[0]
    view = (batch, s_q, heads, 512)
    assert rel_err(both.view(view), want_out, want_lse) < TOL
    assert rel_err(no_scale.view(view), want_out, want_lse) > 0.1
    assert rel_err(no_qv.view(view), want_out, want_lse) > 0.1


def test_tma_pages_turn_nan_in_unattended_slots_into_nan_and_nan_to_zero_or_small_pages_avoid_it():
    """h_q 16 x s_q 8 rows > 64 on 64-token pages: the double reads each request's last 64-token block whole, as
    the TMA path does (flash-attention issue 2374); the case's unattended slots hold NaN."""
    case = case_of(8, True, 64, heads=16, s_k=100)
    assert any(n % 64 for n in case.lengths)
    want_out, want_lse = exact(case)
    out, _ = fa3_calls(fa3_double, case)["FA3 bf16"]()
    assert torch.isnan(out).any()
    for kwargs in ({"nan_to_zero": True}, {"page": 16}):
        out, lse = fa3_calls(fa3_double, case, **kwargs)["FA3 bf16"]()
        assert not torch.isnan(out).any(), kwargs
        assert rel_err(out, want_out, want_lse) < TOL, kwargs
    few_rows = case_of(1, False, 64, heads=16, s_k=100)  # 16 rows: the cp.async path, which zero-fills
    out, _ = fa3_calls(fa3_double, few_rows)["FA3 bf16"]()
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("page", [1, 16, 32])
def test_repage_is_a_view_of_the_same_tokens(page):
    case = case_of(2, True, 64)
    cache, table = repage(case.k_cache, case.block_table, page)
    assert cache.data_ptr() == case.k_cache.data_ptr() and cache.shape[1] == page and table.dtype == torch.int32
    for b, n in enumerate(case.lengths):
        big = case.k_cache[case.block_table[b, :math.ceil(n / 64)].long()].reshape(-1, 576)[:n]
        small = cache[table[b, :math.ceil(n / page)].long()].reshape(-1, 576)[:n]
        assert torch.equal(big, small)
    used = (case.block_table >= 0) & (case.block_table < case.k_cache.shape[0])
    garbage = table.view(*case.block_table.shape, 64 // page)[~used]
    assert torch.equal(garbage, case.block_table[~used][:, None].expand_as(garbage))


def test_the_double_checks_what_the_op_checks():
    case = case_of(1, False, 16)
    ops = fa3_double.flash_attn_3_gpu
    batch, s_q, heads, _ = case.q.shape
    rows = case.q.reshape(batch * s_q, heads, 576)
    cu = torch.arange(batch + 1, dtype=torch.int32)
    k, v = case.k_cache[..., 512:], case.k_cache[..., :512]
    common = dict(cu_seqlens_q=cu, seqused_k=case.cache_seqlens, max_seqlen_q=1, page_table=case.block_table,
                  softmax_scale=reference.SM_SCALE)
    ops.fwd(rows[..., 512:], k, v, q_v=rows[..., :512], **common)
    with pytest.raises(ValueError, match="^q:"):
        ops.fwd(rows[..., 512:].half(), k, v, **common)
    with pytest.raises(ValueError, match="^k:"):
        ops.fwd(rows[..., 512:], k.transpose(-1, -2), v, **common)
    with pytest.raises(ValueError, match="^q_v:"):
        ops.fwd(rows[..., 512:], k, v, q_v=rows[..., :256], **common)
    with pytest.raises(ValueError, match="^seqused_k:"):
        ops.fwd(rows[..., 512:], k, v, **{**common, "seqused_k": case.cache_seqlens.long()})
    with pytest.raises(ValueError, match="^page_table:"):
        ops.fwd(rows[..., 512:], k, v, **{**common, "page_table": case.block_table.long()})
    with pytest.raises(ValueError, match="^softcap:"):
        ops.fwd(rows[..., 512:], k, v, softcap=30.0, **common)
    with pytest.raises(ValueError, match="^num_splits:"):
        ops.fwd(rows[..., 512:], k, v, num_splits=300, **common)
    with pytest.raises(ValueError, match="^max_seqlen_q:"):
        ops.fwd(rows[..., 512:].repeat(2, 1, 1), k, v, **{**common, "cu_seqlens_q": cu * 2})
    meta = ops.get_scheduler_metadata(batch, 1, 70, heads, 1, 64, 512, torch.bfloat16, case.cache_seqlens, cu,
                                      page_size=16, num_splits=32)
    ops.fwd(rows[..., 512:], k, v, scheduler_metadata=meta, num_splits=32, **common)
    with pytest.raises(ValueError, match="^scheduler_metadata:"):  # made for another num_splits
        ops.fwd(rows[..., 512:], k, v, scheduler_metadata=meta, num_splits=0, **common)

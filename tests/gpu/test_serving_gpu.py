"""The serving API and custom_kernel on a GPU: a CUDA graph captured once and replayed while lengths,
block tables and q change (rows going to 0 included), and caches past 2^31 elements read right
through both entry points (64-bit cache offsets). Needs a CUDA GPU with about 20 GB free; the
big-cache tests take about 20 s on an H200."""
import pytest
import torch

import reference
import submission
from span_model import takes_spans
from test_serving_api import assert_right, make_case, run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU test: needs a CUDA GPU")

BIG = 2**31 + 2**26  # elements: past what a 32-bit offset reaches


@pytest.mark.parametrize("lens,page,target", [  # the splits with chunks (some of these take spans: h42)
    ([5000, 300, 0, 2000], 64, 4),  # 3, 1, 1 and 2 splits: merges of a few splits
    ([20000, 100, 7000], 64, 64),  # 16 splits (the cap) and 6: the widest merges
    ([700, 129, 0, 64], 128, 2),  # pages of two tiles
    ([1024] * 127 + [65536], 64, None),  # one long request among short ones, the plan's own chunking
])
def test_token_balanced_schedule(lens, page, target):
    """The Hopper route's schedule (on a Hopper GPU; the portable route elsewhere): requests cut
    into as many splits as their share of the batch's tokens, merged right, causal rows."""
    case = make_case(len(lens), 2, 16, page, lens, kv="fp8", seed=len(lens))
    plan = submission.get_mla_decode_metadata()[0]
    plan.num_splits = target
    out, lse = run(case, causal=True, plan=plan)
    assert plan.route["route"] == ("hopper_paged" if submission.HOPPER else "triton_paged")
    assert_right(case, out, lse, causal=True, kv="fp8")


@pytest.mark.skipif(not submission.HOPPER, reason="the span schedule is the Hopper route's (an H100/H200)")
@pytest.mark.parametrize("kv,s_q,h_q,page,causal", [("fp8", 1, 16, 64, False), ("bf16", 2, 16, 128, True),
                                                     ("fp8", 1, 128, 64, False), ("fp8", 2, 16, 64, True)])
def test_span_schedule_cuts_across_requests(kv, s_q, h_q, page, causal):
    """The span schedule (lab/NOTES.md h42) on cases it takes: many short requests (programs whose
    span meets several of them), zero lengths, a long request split over many spans; with a
    negative length, one past the block table and a bad used block id, whose requests come back
    NaN while every other request stays right (request 7's bad block, in a middle split, added after
    the session's H200 run: lab/NOTES.md h42b)."""
    gen = torch.Generator().manual_seed(s_q * h_q + page)
    lens = [int(n) for n in torch.randint(0, 200, (300,), generator=gen)]
    lens[3] = lens[4] = 0
    lens[7] = 9000
    case = make_case(len(lens), s_q, h_q, page, lens, kv=kv, seed=page + h_q)
    capacity = case["block_table"].shape[1] * page
    bad = {11: -3, 12: capacity + 1}
    poisoned = case["cache_seqlens"].clone()
    for row, value in bad.items():
        poisoned[row] = value
    block_table = case["block_table"].clone()
    block_table[13, 0] = case["k_cache"].shape[0]  # request 13's first block, one past the cache
    block_table[7, 9000 // page // 2] = -1  # a middle block of request 7 (several splits): merged poisoned
    plan = submission.get_mla_decode_metadata()[0]
    out, lse = run(case, causal=causal, plan=plan, cache_seqlens=poisoned, block_table=block_table)
    assert plan.route["route"] == "hopper_paged" and plan.route["params"].get("spans")
    assert plan.spans
    assert takes_spans(poisoned.tolist(), capacity, plan.num_splits, plan.route["params"]["min_chunk"],
                       segment_tiles=plan.route["params"].get("segment_tiles", 0))  # the seesaw's at h_q 128
    for row in (7, 11, 12, 13):
        assert torch.isnan(out[row]).all() and torch.isnan(lse[row]).all(), row
    right = dict(case, cache_seqlens=case["cache_seqlens"].clone())
    right["cache_seqlens"][[7, 11, 12, 13]] = 0  # the poisoned rows compared as empty ones
    out[[7, 11, 12, 13]], lse[[7, 11, 12, 13]] = 0, float("inf")
    assert_right(right, out.cuda(), lse.cuda(), causal=causal, kv=kv)


@pytest.mark.parametrize("kv,causal", [("fp8", True), ("bf16", False)])
def test_graph_replay_follows_changing_lengths_and_tables(kv, causal):
    batch, s_q, h_q, page = 8, 2, 16, 64
    case = make_case(batch, s_q, h_q, page, [300] * batch, kv=kv, seed=21)
    if kv == "fp8":  # a device scalar, read by the kernel at replay time
        case["k_scale"] = torch.tensor([case["k_scale"]], dtype=torch.float32, device="cuda")
    plan = submission.get_mla_decode_metadata()[0]
    static = {name: case[name] for name in ("q", "block_table", "cache_seqlens")}
    submission.mla_decode_with_kvcache(static["q"], case["k_cache"], static["block_table"], static["cache_seqlens"],
                                       512, plan, causal=causal, k_scale=case["k_scale"])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out, graph_lse = submission.mla_decode_with_kvcache(
            static["q"], case["k_cache"], static["block_table"], static["cache_seqlens"], 512, plan, causal=causal,
            k_scale=case["k_scale"])
    gen = torch.Generator().manual_seed(5)
    for step, lens in enumerate([[300] * batch, [0, 1, 2, 63, 64, 65, 299, 0], [0] * batch,
                                 [5, 250, 0, 128, 77, 1, 300, 13]]):
        static["cache_seqlens"].copy_(torch.tensor(lens, dtype=torch.int32))
        static["block_table"].copy_(case["block_table"][torch.randperm(batch, generator=gen)])
        static["q"].copy_((torch.randn(static["q"].shape, generator=gen) / 4).to(torch.bfloat16))
        graph.replay()
        eager_out, eager_lse = submission.mla_decode_with_kvcache(
            static["q"], case["k_cache"], static["block_table"], static["cache_seqlens"], 512, plan, causal=causal,
            k_scale=case["k_scale"])
        torch.cuda.synchronize()
        assert torch.equal(graph_out, eager_out) and torch.equal(graph_lse, eager_lse), step
        scale = None if kv == "bf16" else case["k_scale"].item()
        assert_right(dict(case, **static, k_scale=scale), graph_out, graph_lse, causal, kv)


def _sampled_rows_right(out, q, kv_fp8, kv_scale, kv_bf16, kv_indptr, rows):
    """custom_kernel's rows against float64 attention over the fp8 values it read (q's fp8
    rounding apart) and over the bf16 truth (the route's bound)."""
    bounds = kv_indptr.tolist()
    for b in rows:
        k8 = kv_fp8[bounds[b]:bounds[b + 1], 0].double() * kv_scale.double()
        kb = kv_bf16[bounds[b]:bounds[b + 1], 0].double()
        for k, bound in ((k8, 0.04), (kb, submission.ROUTE_INFO["triton_fp8"]["rel_l2_bound"])):
            want = torch.softmax(q[b].double() @ k.T * submission.SM_SCALE, -1) @ k[:, :512]
            rel = ((out[b].double() - want).norm() / want.norm()).item()
            assert rel < bound, (b, rel, bound)


def test_custom_kernel_reads_a_cache_past_2_31_elements():
    """The leaderboard's format at 128 requests of 32768 tokens: a 2.4 GB fp8 cache (4.2M rows);
    the table's catch-all row (the portable route) reads it."""
    batch, kv_len = 128, 32768
    data = reference.generate_input(batch, 1, kv_len, 77, device="cuda")
    q, kv_data, _, kv_indptr, _ = data
    assert kv_data["fp8"][0].numel() > 2**31
    out = submission.custom_kernel(data)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    _sampled_rows_right(out, q, *kv_data["fp8"], kv_data["bf16"], kv_indptr, rows=(0, 63, batch - 1))


@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_api_reads_blocks_past_2_31_elements(kv):
    """A paged cache of more than 2^31 elements; the requests' blocks at its far end (offsets past
    2^31) and at its start; right against float64."""
    page = 64
    num_blocks = BIG // (page * 576) + 1
    dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
    cache = torch.empty(num_blocks, page, 1, 576, dtype=dtype, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    for first in range(0, num_blocks, 4096):  # random values, a chunk at a time
        chunk = cache[first:first + 4096]
        chunk.copy_(torch.randn(chunk.shape, device="cuda", generator=gen).to(dtype))
    lens = torch.tensor([4096, 1000, 4096, 77], dtype=torch.int32, device="cuda")
    table = torch.zeros(4, 64, dtype=torch.int32, device="cuda")
    table[0] = torch.arange(num_blocks - 64, num_blocks)
    table[1] = torch.arange(0, 64)
    table[2] = torch.arange(num_blocks - 1, num_blocks - 129, -2)
    table[3] = num_blocks - 100
    q = (torch.randn(4, 2, 16, 576, device="cuda", generator=gen) / 4).to(torch.bfloat16)
    case = {"q": q, "k_cache": cache, "block_table": table, "cache_seqlens": lens,
            "k_scale": 1.0 if kv == "fp8" else None}
    assert cache.numel() > 2**31 and int(table.max()) * page * 576 > 2**31
    plan = submission.get_mla_decode_metadata()[0]
    out, lse = submission.mla_decode_with_kvcache(q, cache, table, lens, 512, plan, causal=True,
                                                  k_scale=case["k_scale"])
    torch.cuda.synchronize()
    assert_right(case, out, lse, causal=True, kv=kv)


@pytest.mark.skipif(not submission.HOPPER, reason="the Hopper route's rows per program: an H100/H200")
@pytest.mark.parametrize("kv", ["fp8", "bf16"])
@pytest.mark.parametrize("s_q,h_q,lens", [
    (2, 16, [5000, 300, 0, 2000]),  # 32 rows: one group, merges of 1-3 splits, an empty request
    (1, 40, [700, 4100, 64]),  # 40 rows: a second group of 8 rows
    (3, 16, [129, 2500, 1]),  # 48 rows, causal
    (1, 128, [3000, 200]),  # 4 groups
])
def test_wide_rows_and_16_rows_are_right_on_the_same_inputs(monkeypatch, kv, s_q, h_q, lens):
    """32 rows per program at 8 warps (SERVING_ROUTE_TABLE's row for bf16 plans of 32 or more
    query rows; for fp8 a configuration the sweep can force) and the 16-row row, each forced ahead
    of the table, are right on the same inputs and agree."""
    case = make_case(len(lens), s_q, h_q, 64, lens, kv=kv, seed=h_q + s_q)
    causal = s_q > 1
    table = submission.SERVING_ROUTE_TABLE
    wide_row = {"kv": kv, "pages": (64, 128), "route": "hopper_paged",
                "params": {"rows": 32, "num_warps": 8, "num_stages": 2, "waves": 1, "min_chunk": 256}}
    narrow_row = next(row for row in table if row["route"] == "hopper_paged" and row["kv"] == kv
                      and submission.route_rows(row) == 16)
    monkeypatch.setattr(submission, "SERVING_ROUTE_TABLE", [wide_row] + table)
    plan = submission.get_mla_decode_metadata()[0]
    wide = run(case, causal=causal, plan=plan)
    assert plan.route["route"] == "hopper_paged" and submission.route_rows(plan.route) == 32
    monkeypatch.setattr(submission, "SERVING_ROUTE_TABLE", [narrow_row] + table)
    plan16 = submission.get_mla_decode_metadata()[0]
    narrow = run(case, causal=causal, plan=plan16)
    assert submission.route_rows(plan16.route) == 16
    torch.cuda.synchronize()
    for out, lse in (wide, narrow):
        assert_right(case, out, lse, causal=causal, kv=kv)
    attended = torch.isfinite(narrow[1]).permute(0, 2, 1)
    rel = ((wide[0][attended].double() - narrow[0][attended].double()).norm()
           / narrow[0][attended].double().norm()).item()
    assert rel < (0.05 if kv == "fp8" else 0.01), rel  # fp8: q is quantised over other rows


@pytest.mark.skipif(not submission.HOPPER, reason="the seesaw kernel is the Hopper route's (an H100/H200)")
@pytest.mark.parametrize("s_q,h_q,page,lens,causal,target", [
    (1, 128, 64, [3000, 200, 0, 65], False, None),  # 2 groups; odd tile counts, an empty request, a 1-token tail
    (2, 64, 128, [129, 2500, 1], True, 4),  # pages of two tiles, causal, merges of a few splits
    (3, 48, 64, [700, 4100, 64], True, None),  # 144 rows: a third group of 16 rows
    (1, 64, 64, [20000, 100, 7000], False, 64),  # 16 splits (the cap) and 6: the widest merges
])
@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_seesaw_rows_are_right_and_agree_with_the_tokens_as_m_kernel(monkeypatch, s_q, h_q, page, lens, causal,
                                                                      target, kv):
    """SERVING_ROUTE_TABLE's seesaw rows (query rows as M: fp8 P.V, lab/NOTES.md h51; bf16 on 32-token
    tiles, h65) and the tokens-as-M kernel's row for the same cache (fp8: 64 rows, bf16: 32), each
    forced ahead of the table, are right on the same inputs and agree; a tensor k_scale (fp8); a NaN
    in one request's q stays in that request's rows."""
    case = make_case(len(lens), s_q, h_q, page, lens, kv=kv, seed=h_q + s_q + page)
    if kv == "fp8":
        case["k_scale"] = torch.tensor([case["k_scale"]], dtype=torch.float32, device="cuda")
    table = submission.SERVING_ROUTE_TABLE
    seesaw_row = next(row for row in table if row["kv"] == kv and row["params"].get("seesaw"))
    tokens_row = next(row for row in table if row["kv"] == kv and row.get("min_rows") == (64 if kv == "fp8" else 32)
                      and not row["params"].get("seesaw"))
    results = []
    for row in (seesaw_row, tokens_row):
        monkeypatch.setattr(submission, "SERVING_ROUTE_TABLE", [row] + table)
        plan = submission.get_mla_decode_metadata()[0]
        plan.num_splits = target
        results.append(run(case, causal=causal, plan=plan))
        assert plan.route is row
    torch.cuda.synchronize()
    right = dict(case, k_scale=case["k_scale"].item()) if kv == "fp8" else case
    for out, lse in results:
        assert_right(right, out, lse, causal=causal, kv=kv)
    (out, lse), (tokens_out, tokens_lse) = results
    attended = torch.isfinite(tokens_lse).permute(0, 2, 1)
    rel = ((out[attended].double() - tokens_out[attended].double()).norm()
           / tokens_out[attended].double().norm()).item()
    assert rel < (0.05 if kv == "fp8" else 0.01), rel  # fp8: P and per-row q scales against f16 P and per-program ones
    poisoned = case["q"].clone()
    poisoned[1, 0, 0, 5] = float("nan")
    monkeypatch.setattr(submission, "SERVING_ROUTE_TABLE", [seesaw_row] + table)
    out, lse = run(case, causal=causal, q=poisoned)
    torch.cuda.synchronize()
    assert torch.isnan(out[1, 0, 0]).all() and torch.isfinite(out[0]).all()
    if lens[1] > 0:  # the NaN's row attends something
        assert torch.isnan(lse[1, 0, 0])


@pytest.mark.skipif(not submission.HOPPER, reason="the seesaw kernel is the Hopper route's (an H100/H200)")
@pytest.mark.parametrize("profile", ["late jump", "ramp", "one tile far above", "one tile a little above"])
def test_seesaw_running_max_moving_late_and_by_small_steps(profile):
    """The seesaw's lazy running max (lab/NOTES.md h52: a row's max moves only where a tile passes it by
    more than SW_TAU, and the P.V skips the rescale where no row's max moved): keys scaled so that
    every row's max jumps in the last third of a long request after many tiles without a move, or
    climbs a little on every tile (P above 1 between moves), or one tile in the middle of a request
    stands far above the rest or a little, the tile next to it not (which tile of a pair it is
    varies with the request: lab/NOTES.md h60). For those two, q is 64x larger (scores of std 16: a
    row's max over the lone tile about 38, 55 in log2 units) and the other tiles' keys are 1/64 or
    0.55: with 1/64 the lone tile moves every row's max of the two long requests by 29-86 log2
    units, with 0.55 by a median of 9, some rows not at all (a CPU computation of these inputs in
    float64). Right against float64 each way; the fp8 bound follows what rounding q costs on these
    peaked scores (assert_right)."""
    lens = [4000, 2500, 130]
    case = make_case(len(lens), 1, 128, 64, lens, kv="fp8", seed=52)
    table = case["block_table"].cpu()
    scales = torch.ones(case["k_cache"].shape[:2])
    if profile.startswith("one tile"):
        case["q"] = (case["q"].float() * 64).to(torch.bfloat16)
    low = 1 / 64 if profile == "one tile far above" else 0.55  # the other tiles' keys; the lone tile's stay
    for b, n in enumerate(lens):
        lone = min((n // 64) // 2 + b, (n - 1) // 64)  # the tile that stands above the rest
        for t in range(n):
            if profile == "late jump":
                scale = 1.0 if t >= 2 * n // 3 else 1 / 3
            elif profile == "ramp":
                scale = 0.25 + 0.75 * t / n
            else:
                scale = 1.0 if t // 64 == lone else low
            scales[table[b, t // 64], t % 64] = scale
    cache = case["k_cache"].float() * scales[:, :, None, None].cuda()
    case["k_cache"] = cache.to(case["k_cache"].dtype)  # NaN slots stay NaN
    plan = submission.get_mla_decode_metadata()[0]
    out, lse = run(case, plan=plan)
    assert plan.route["params"].get("seesaw"), plan.route
    assert_right(case, out, lse, kv="fp8")

"""The serving API of submission.py (get_mla_decode_metadata, mla_decode_with_kvcache) against
float64 paged attention (reference.mla_decode_paged_float64): heads, query tokens, page sizes,
fixed and varied lengths, causal masks, zero rows, NaN in every slot nobody attends, garbage
block ids past the used ones, permuted block tables, poison, input errors, plan reuse, fresh
outputs. Runs under the interpreter on the CPU (a subset of the grid, small lengths) and as is on
a GPU (the whole grid)."""
import itertools
import math

import pytest
import torch

import reference
import submission

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
FP8 = torch.float8_e4m3fn
GARBAGE_IDS = (-1, 2147480000)  # what engines leave in block-table entries past a request's blocks
# The strict bounds are the reference's (reference.serving_out_bound / serving_lse_bound): bf16 1%
# rel. L2 and 1e-3 + 1e-4 |lse|; fp8 1.25 x what rounding q to fp8 alone costs, plus a floor.


def make_case(batch, s_q, h_q, page, lens, kv="bf16", seed=0, max_blocks=None, spare_blocks=3):
    """Inputs as an engine holds them: a randomly permuted block table, garbage ids past each
    request's used blocks, NaN in every cache slot no request attends (unused blocks and the tail
    of each last page). fp8: the cache is the bf16 values over a per-tensor scale."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lens, dtype=torch.int32)
    used = [max(0, math.ceil(int(n) / page)) for n in lens]
    max_blocks = max_blocks or max(1, max(used))
    num_blocks = sum(used) + spare_blocks
    values = torch.randn(num_blocks, page, 1, 576, generator=gen).to(torch.bfloat16)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.empty(batch, max_blocks, dtype=torch.int32)
    attended = torch.zeros(num_blocks, page, dtype=torch.bool)
    taken = 0
    for b in range(batch):
        ids = perm[taken:taken + used[b]]
        taken += used[b]
        table[b, :used[b]] = ids
        for j in range(used[b], max_blocks):
            table[b, j] = GARBAGE_IDS[j % 2]
        for p in range(int(lens[b])):
            attended[ids[p // page], p % page] = True
    if kv == "fp8":
        k_scale = (values.float().abs().amax() / torch.finfo(FP8).max).item()
        cache = (values.float() / k_scale).to(FP8)
        cache.view(torch.uint8)[~attended] = 0x7F  # e4m3fn's NaN
    else:
        k_scale = None
        cache = values.clone()
        cache[~attended] = float("nan")
    q = (torch.randn(batch, s_q, h_q, 576, generator=gen) / 4).to(torch.bfloat16)
    return {"q": q.to(DEVICE), "k_cache": cache.to(DEVICE), "block_table": table.to(DEVICE),
            "cache_seqlens": lens.to(DEVICE), "k_scale": k_scale}


def run(case, causal=False, plan=None, **overrides):
    plan = plan or submission.get_mla_decode_metadata()[0]
    args = dict(case, **overrides)
    return submission.mla_decode_with_kvcache(args["q"], args["k_cache"], args["block_table"], args["cache_seqlens"],
                                              512, plan, causal=causal, k_scale=args["k_scale"])


def truth(case, causal=False):
    return reference.mla_decode_paged_float64(case["q"], case["k_cache"], case["block_table"],
                                              case["cache_seqlens"], k_scale=case["k_scale"], causal=causal)


def assert_right(case, out, lse, causal=False, kv="bf16"):
    """Out and lse within the reference's bounds over the rows that attend something; rows with
    nothing attended exactly 0 and +inf."""
    exact_out, exact_lse = truth(case, causal)
    b, s_q, h_q, _ = case["q"].shape
    assert out.shape == (b, s_q, h_q, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (b, h_q, s_q) and lse.dtype == torch.float32
    out_reach = lse_reach = None
    empty = torch.isinf(exact_lse).cpu()  # (b, h_q, s_q)
    empty_rows = empty.permute(0, 2, 1)  # (b, s_q, h_q)
    if kv == "fp8":  # what rounding q to fp8 alone costs on these inputs
        q8 = reference.round_q_fp8_per_request(case["q"], case["k_cache"].dtype)
        out8, lse8 = truth(dict(case, q=q8), causal)
        out_reach = reference.rel_l2_error(out8.cpu()[~empty_rows], exact_out.cpu()[~empty_rows])
        lse_reach = (lse8 - exact_lse).cpu()[~empty].abs().max().item() if (~empty).any() else 0.0
    out, lse = out.cpu().double(), lse.cpu().double()
    exact_out, exact_lse = exact_out.cpu(), exact_lse.cpu()
    assert (out[empty_rows] == 0).all(), "a row with nothing attended must be exactly 0"
    assert (lse[empty] == float("inf")).all(), "a row with nothing attended must have lse +inf"
    if (~empty).any():
        got, want = out[~empty_rows], exact_out[~empty_rows]
        assert torch.isfinite(got).all(), "NaN from a slot nobody attends reached the output"
        rel = ((got - want).norm() / want.norm()).item()
        assert rel <= reference.serving_out_bound(kv, out_reach), (rel, out_reach)
        lse_err = (lse - exact_lse)[~empty].abs()
        lse_bound = reference.serving_lse_bound(kv, exact_lse, lse_reach)[~empty]
        assert (lse_err <= lse_bound).all(), (lse_err.max().item(), lse_reach)


def lengths(batch, mean, varlen, zeros, seed):
    """Fixed or varied lengths (normal around mean, spread mean / 2, at least 1), `zeros` of them 0."""
    gen = torch.Generator().manual_seed(seed)
    if varlen:
        lens = [max(1, int(mean + mean / 2 * torch.randn(1, generator=gen).item())) for _ in range(batch)]
    else:
        lens = [mean] * batch
    for i in range(zeros):
        lens[(i * 2 + 1) % batch] = 0
    return lens


# The grid: every h_q, s_q and page size, fixed and varied lengths, causal on and off, both caches.
# On a GPU all of it; on the CPU (interpreter) a covering subset of small cases.
FULL_GRID = list(itertools.product((1, 3, 16, 63, 64, 128), (1, 2, 4), (1, 16, 64), (False, True), (False, True),
                                   ("bf16", "fp8")))
CPU_GRID = [
    # (h_q, s_q, page, varlen, causal, kv)
    (1, 1, 16, False, False, "bf16"),
    (1, 4, 1, True, True, "fp8"),
    (3, 2, 16, True, True, "bf16"),
    (3, 1, 64, False, False, "fp8"),
    (16, 1, 64, True, False, "bf16"),
    (16, 2, 1, False, True, "fp8"),
    (16, 4, 16, False, True, "bf16"),
    (63, 1, 16, True, False, "fp8"),
    (64, 2, 64, True, True, "bf16"),
    (128, 1, 1, False, False, "bf16"),
    (128, 1, 16, True, False, "fp8"),
]
GRID = FULL_GRID if ON_GPU else CPU_GRID


def _grid_id(params):
    h_q, s_q, page, varlen, causal, kv = params
    return f"h{h_q}-sq{s_q}-page{page}-{'varlen' if varlen else 'fixed'}-{'causal' if causal else 'full'}-{kv}"


@pytest.mark.parametrize("params", GRID, ids=_grid_id)
def test_grid_matches_float64_paged_attention(params):
    h_q, s_q, page, varlen, causal, kv = params
    batch = 3
    mean = 700 if ON_GPU else 40
    lens = lengths(batch, mean, varlen, zeros=1 if varlen else 0, seed=h_q + s_q + page)
    case = make_case(batch, s_q, h_q, page, lens, kv=kv, seed=h_q * 7 + s_q)
    out, lse = run(case, causal)
    assert_right(case, out, lse, causal, kv)


@pytest.mark.parametrize("splits", [1, 3])
def test_splits_and_causal_rows_without_tokens(splits):
    """Short requests under a split grid (empty splits), a request shorter than s_q under a causal
    mask (its first query tokens attend nothing: 0 and +inf), a request of length 0."""
    case = make_case(3, 4, 5, 16, [2, 0, 75], kv="bf16", seed=3)
    plan = submission.get_mla_decode_metadata()[0]
    plan.num_splits = splits
    out, lse = run(case, causal=True, plan=plan)
    assert_right(case, out, lse, causal=True)
    assert (lse[0, :, :2] == float("inf")).all() and (out[0, :2] == 0).all()
    assert torch.isfinite(lse[0, :, 2:]).all()


def test_plan_reuse_with_new_lengths_and_tables():
    """One plan, three calls: other lengths (rows going to 0 and back), another permutation of the
    blocks; every answer right."""
    plan = submission.get_mla_decode_metadata(torch.zeros(2, dtype=torch.int32), 16, 1)[0]
    for seed, lens in enumerate([[50, 20], [0, 64], [33, 0]]):
        case = make_case(2, 2, 16, 16, lens, kv="fp8", seed=seed, max_blocks=4, spare_blocks=8 - sum(
            math.ceil(n / 16) for n in lens))
        out, lse = run(case, causal=True, plan=plan)
        assert_right(case, out, lse, causal=True, kv="fp8")


@pytest.mark.parametrize("page", [16, 64])
def test_repeated_calls_of_one_signature_take_each_calls_values(page):
    """Calls of one signature after the first (on a GPU, Triton's launcher straight from the plan)
    read each call's q, lengths, block table and float k_scale, not the first call's."""
    plan = submission.get_mla_decode_metadata()[0]
    full = 3 * page  # every row's 3 blocks hold values
    case = make_case(3, 2, 16, page, [full] * 3, kv="fp8", seed=30)
    for step, lens in enumerate([[full - 8, full // 2 + 9, 0], [0, full, 17], [5, 0, full]]):
        gen = torch.Generator().manual_seed(step)
        case["cache_seqlens"] = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        case["block_table"] = case["block_table"][torch.randperm(3, generator=gen).to(case["block_table"].device)]
        case["q"] = (torch.randn(case["q"].shape, generator=gen) / 4).to(torch.bfloat16).to(DEVICE)
        case["k_scale"] = case["k_scale"] * 2.0 ** step  # the same fp8 bytes, another dequantisation scale
        assert_right(case, *run(case, causal=True, plan=plan), causal=True, kv="fp8")
    assert len(plan.launches) == 1, "one signature: one check, one recorded launch"


def test_plan_of_another_shape_is_refused():
    plan = submission.get_mla_decode_metadata()[0]
    run(make_case(2, 1, 16, 16, [20, 30]), plan=plan)
    for other in (make_case(3, 1, 16, 16, [20, 30, 5]), make_case(2, 2, 16, 16, [20, 30]),
                  make_case(2, 1, 8, 16, [20, 30]), make_case(2, 1, 16, 64, [20, 30]),
                  make_case(2, 1, 16, 16, [20, 30], kv="fp8")):
        with pytest.raises(ValueError, match="plan was filled"):
            run(other, plan=plan)


def test_outputs_are_fresh_and_survive_later_calls():
    case = make_case(2, 1, 16, 16, [20, 30], seed=5)
    plan = submission.get_mla_decode_metadata()[0]
    out1, lse1 = run(case, plan=plan)
    kept = out1.clone(), lse1.clone()
    out2, lse2 = run(make_case(2, 1, 16, 16, [7, 12], seed=6), plan=plan)
    assert out1.data_ptr() != out2.data_ptr() and lse1.data_ptr() != lse2.data_ptr()
    assert torch.equal(out1, kept[0]) and torch.equal(lse1, kept[1])


# Page 64 takes the Hopper route on an H100/H200 (SERVING_ROUTE_TABLE), page 16 the portable one
# everywhere.
@pytest.mark.parametrize("kv,page", [("bf16", 16), ("fp8", 16), ("bf16", 64), ("fp8", 64)])
def test_poison_bad_block_ids_and_lengths(kv, page):
    """A used block id outside the cache, a negative length, a length past the block table: that
    request's out is NaN; the others stay right."""
    n = page + 14
    case = make_case(4, 1, 16, page, [n, n, n, n], kv=kv, seed=9, max_blocks=2)
    num_blocks = case["k_cache"].shape[0]
    case["block_table"][0, 1] = num_blocks  # used (tokens page ... n - 1), one past the cache
    case["block_table"][1, 0] = -5
    lens = case["cache_seqlens"].clone()
    lens[2] = -1
    lens[3] = 2 * page + 1  # two blocks hold 2 * page tokens
    out, lse = run(case, cache_seqlens=lens)
    for b in range(4):
        assert torch.isnan(out[b]).all() and torch.isnan(lse[b]).all(), b
    good = make_case(2, 1, 16, page, [n, 12], kv=kv, seed=10)
    good["block_table"][1, 1] = num_blocks + 7  # past request 1's used blocks: never read
    out, lse = run(good)
    assert_right(good, out, lse, kv=kv)


@pytest.mark.parametrize("kv,page", [("bf16", 16), ("fp8", 16), ("bf16", 64), ("fp8", 64)])
def test_nan_in_q_or_in_an_attended_token_stays_visible(kv, page):
    case = make_case(2, 2, 4, page, [20, 20], kv=kv, seed=11)
    case["q"][0, 1, 2, 7] = float("nan")
    out, lse = run(case)
    assert not torch.isfinite(out[0, 1, 2]).all()
    assert torch.isfinite(out[1]).all()
    case = make_case(2, 1, 4, page, [20, 20], kv=kv, seed=12)
    block = case["block_table"][1, 0]
    if kv == "fp8":
        case["k_cache"].view(torch.uint8)[block, 3, 0, 5] = 0x7F
    else:
        case["k_cache"][block, 3, 0, 5] = float("nan")
    out, lse = run(case)
    assert not torch.isfinite(out[1]).all() and torch.isfinite(out[0]).all()


@pytest.mark.parametrize("h_q", [16, 128])
@pytest.mark.parametrize("sign", [-1.0, 0.0])
def test_a_negative_or_zero_k_scale_is_the_dequantisation_it_says(h_q, sign):
    """k_scale is the dequantisation's factor, whatever its sign: a negative one negates every key and
    value (the seesaw kernel at 128 heads stages q with its sign: lab/NOTES.md h52), 0 makes every key
    and value 0 (a uniform softmax, out 0, lse log n); as a float and as a tensor."""
    case = make_case(2, 1, h_q, 64, [150, 33], kv="fp8", seed=53)
    case["k_scale"] *= sign
    for scale in (case["k_scale"], torch.tensor([case["k_scale"]], dtype=torch.float32, device=DEVICE)):
        out, lse = run(case, k_scale=scale)
        if sign:
            assert_right(case, out, lse, kv="fp8")
        else:  # out is exactly 0 (a relative error has no meaning there), lse the log of the length
            assert (out == 0).all()
            n = case["cache_seqlens"].cpu().double().log()[:, None, None].expand(lse.shape)
            assert (lse.cpu().double() - n).abs().max().item() < 1e-3


@pytest.mark.parametrize("page", [16, 64])
def test_k_scale_as_tensor_or_float(page):
    case = make_case(2, 1, 16, page, [20, 30], kv="fp8", seed=13)
    ref_out, ref_lse = run(case)
    for scale in (torch.tensor(case["k_scale"], dtype=torch.float32, device=DEVICE),
                  torch.tensor([case["k_scale"]], dtype=torch.float32, device=DEVICE)):
        out, lse = run(case, k_scale=scale)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_softmax_scale_and_strided_q():
    case = make_case(2, 2, 3, 16, [20, 30], seed=14)
    q_strided = case["q"].transpose(1, 2).contiguous().transpose(1, 2)  # (b, s_q, h_q) with h_q outer
    assert not q_strided.is_contiguous()
    plan = submission.get_mla_decode_metadata()[0]
    out, lse = submission.mla_decode_with_kvcache(q_strided, case["k_cache"], case["block_table"],
                                                  case["cache_seqlens"], 512, plan, softmax_scale=0.05)
    exact_out, exact_lse = reference.mla_decode_paged_float64(case["q"], case["k_cache"], case["block_table"],
                                                              case["cache_seqlens"], softmax_scale=0.05)
    assert ((out.cpu().double() - exact_out.cpu()).norm() / exact_out.norm()).item() < 0.01
    assert (lse.cpu().double() - exact_lse.cpu()).abs().max().item() < 1e-3


def _bad_inputs():
    """(name, field the message must name, overrides of a good bf16 case's arguments)."""
    case = make_case(2, 1, 16, 16, [20, 30], seed=15)
    q, cache, table, lens = case["q"], case["k_cache"], case["block_table"], case["cache_seqlens"]
    fp8_cache = cache.float().nan_to_num().to(FP8)
    return [
        ("q float32", "q", {"q": q.float()}),
        ("q 3-D", "q", {"q": q[:, 0]}),
        ("q dims", "q", {"q": q[..., :512]}),
        ("s_q 9", "s_q", {"q": q.expand(2, 9, 16, 576)}),  # a broadcast view: any layout
        ("h_q 129", "h_q", {"q": torch.zeros(2, 1, 129, 576, dtype=torch.bfloat16, device=DEVICE)}),
        ("two kv heads", "k_cache", {"k_cache": cache.expand(-1, -1, 2, -1)}),
        ("page 3", "page_size", {"k_cache": cache[:, :3]}),
        ("page 256", "page_size", {"k_cache": torch.zeros(2, 256, 1, 576, dtype=torch.bfloat16, device=DEVICE)}),
        ("cache dims", "k_cache", {"k_cache": cache[..., :512]}),
        ("cache float16", "k_cache", {"k_cache": cache.half()}),
        ("cache strided", "k_cache", {"k_cache": cache.transpose(0, 3).contiguous().transpose(0, 3)}),
        ("block table int64", "block_table", {"block_table": table.long()}),
        ("block table batch", "block_table", {"block_table": table[:1]}),
        ("block table strided", "block_table", {"block_table": table.t().contiguous().t()}),
        ("seqlens int64", "cache_seqlens", {"cache_seqlens": lens.long()}),
        ("seqlens strided", "cache_seqlens", {"cache_seqlens": torch.stack([lens, lens], 1)[:, 0]}),
        ("seqlens batch", "cache_seqlens", {"cache_seqlens": lens[:1]}),
        ("fp8 without k_scale", "k_scale", {"k_cache": fp8_cache}),
        ("bf16 with k_scale", "k_scale", {"k_scale": 0.5}),
        ("k_scale float64", "k_scale", {"k_cache": fp8_cache,
                                        "k_scale": torch.ones(1, dtype=torch.float64, device=DEVICE)}),
        ("k_scale two", "k_scale", {"k_cache": fp8_cache, "k_scale": torch.ones(2, device=DEVICE)}),
        ("k_scale string", "k_scale", {"k_cache": fp8_cache, "k_scale": "1"}),
        ("head_dim_v", "head_dim_v", {"head_dim_v": 576}),
        ("head_dim_v unhashable", "head_dim_v", {"head_dim_v": [512]}),
        ("num_splits", "num_splits", {"num_splits": 4}),
        ("softmax_scale", "softmax_scale", {"softmax_scale": -1.0}),
        ("causal", "causal", {"causal": 1}),
        ("q not a tensor", "q", {"q": q.tolist()[:1]}),
    ] + ([("block table on cpu", "block_table", {"block_table": table.cpu()}),
          ("k_scale on cpu", "k_scale", {"k_cache": fp8_cache, "k_scale": torch.ones(1)})] if ON_GPU else [])


@pytest.mark.parametrize("name,field,overrides", _bad_inputs(), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_input_is_a_value_error_naming_the_field(name, field, overrides):
    case = make_case(2, 1, 16, 16, [20, 30], seed=15)
    args = {"q": case["q"], "k_cache": case["k_cache"], "block_table": case["block_table"],
            "cache_seqlens": case["cache_seqlens"], "head_dim_v": 512, "num_splits": None, "softmax_scale": None,
            "causal": False, "k_scale": None}
    args.update(overrides)
    plan = submission.get_mla_decode_metadata()[0]
    with pytest.raises(ValueError, match=field):
        submission.mla_decode_with_kvcache(args.pop("q"), args.pop("k_cache"), args.pop("block_table"),
                                           args.pop("cache_seqlens"), args.pop("head_dim_v"), plan, **args)
    assert plan.shape is None, "a refused call must leave the plan empty"


ROUTE_PARAMS = {"triton_paged": {"block_n", "num_warps", "num_stages"},
                "triton_sparse": {"rows", "block_n", "num_warps", "num_stages"},
                "hopper_sparse": {"rows", "block_n", "num_warps", "num_stages"},
                "hopper_paged": {"num_warps", "num_stages", "waves", "min_chunk"}}
# where absent: rows 16, spans, pv_f16, shared_max and seesaw off, segment_tiles 0
OPTIONAL_PARAMS = {"triton_paged": set(), "triton_sparse": set(), "hopper_sparse": set(),
                   "hopper_paged": {"rows", "spans", "pv_f16", "shared_max", "seesaw", "block_n", "segment_tiles"}}


def test_serving_route_table_is_data_and_covers_both_caches():
    """One table: aiter's rows first (they exist only where aiter loaded), then the Hopper rows, then
    a portable catch-all per cache format."""
    formats = {row["kv"] for row in submission.SERVING_ROUTE_TABLE}
    assert formats == {"bf16", "fp8", "fp8_sparse"}
    routes = [row["route"] for row in submission.SERVING_ROUTE_TABLE]
    aiter = [route in submission.AITER_SERVING_ROUTES for route in routes]
    assert aiter == sorted(aiter, reverse=True) and any(aiter), "aiter's rows first"
    assert routes.index("triton_paged") > max(i for i, route in enumerate(routes) if route == "hopper_paged")
    for row in submission.SERVING_ROUTE_TABLE:
        if row["route"] in submission.AITER_SERVING_ROUTES:
            assert set(row) <= {"kv", "heads", "s_q", "max_batch", "needs", "route", "params"}, row
            continue
        assert set(row["params"]) - OPTIONAL_PARAMS[row["route"]] == ROUTE_PARAMS[row["route"]], row
        assert set(row) <= {"kv", "pages", "max_batch", "min_rows", "route", "params"}, row
    last = {row["kv"]: row for row in submission.SERVING_ROUTE_TABLE}
    assert all(row["route"] == ("triton_sparse" if kv == "fp8_sparse" else "triton_paged")
               and set(row) == {"kv", "route", "params"} for kv, row in last.items()), \
        "each cache format ends in a catch-all row of the portable route"


@pytest.mark.parametrize("shape,hopper,route", [
    ((128, 1, 16, 64, "fp8", False), True, "hopper_paged"),
    ((128, 2, 128, 128, "fp8", True), True, "hopper_paged"),
    ((128, 1, 16, 16, "fp8", False), True, "hopper_paged"),  # pages smaller than a tile: gathered
    ((128, 1, 16, 1, "fp8", False), True, "hopper_paged"),
    ((2048, 1, 16, 64, "fp8", False), True, "triton_paged"),  # more requests than the schedule holds
    ((128, 1, 16, 64, "bf16", False), True, "hopper_paged"),
    ((128, 4, 3, 16, "bf16", True), True, "hopper_paged"),
    ((128, 1, 16, 64, "fp8", False), False, "triton_paged"),  # no Hopper GPU
    ((64, 2, 128, 64, "fp8_sparse", False, 2048), True, "hopper_sparse"),
    ((2, 1, 16, 1, "fp8_sparse", False, 128), True, "hopper_sparse"),
    ((64, 2, 128, 64, "fp8_sparse", False, 2048), False, "triton_sparse"),
])
def test_serving_route_follows_the_table(monkeypatch, shape, hopper, route):
    routes = {"triton_paged", "triton_sparse"} | ({"hopper_paged", "hopper_sparse"} if hopper else set())
    monkeypatch.setattr(submission, "SERVING_ROUTES", routes)
    assert submission.serving_route(submission.PlanShape(*shape), None, 1 << 16).row["route"] == route


def test_a_cache_tma_cannot_read_takes_the_portable_route(monkeypatch):
    monkeypatch.setattr(submission, "SERVING_ROUTES", {"triton_paged", "hopper_paged"})
    shape = submission.PlanShape(128, 1, 16, 64, "fp8", False)
    assert submission.serving_route(shape, None, 1 << 16).row["route"] == "hopper_paged"
    route = submission.serving_route(shape, None, 1 << 16, tma_readable=False)
    assert route.row["route"] == "triton_paged" and route.kernel is submission._mla_decode_kernel


def _padded_rows(cache, offset, extra=16):
    """A copy of the cache with its rows `offset` bytes into rows `extra` elements longer (the
    strides of either offset alike)."""
    padded = torch.zeros(*cache.shape[:-1], 576 + extra, dtype=cache.dtype, device=DEVICE)
    rows = padded[..., offset // cache.element_size():][..., :576]
    rows.copy_(cache)
    return rows


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("page", [16, 64])
def test_a_cache_off_16_bytes_is_a_value_error(page, kv):
    """A cache whose rows start 8 bytes off a 16-byte boundary (neither TMA nor cp.async reads
    them; Triton 3.6 compiles the portable kernel's reads there past its shared memory: lab/NOTES.md
    h55) is refused before any launch, naming k_cache, on a fresh plan and on a plan that served
    a cache of the same strides at 16 bytes (and served it right)."""
    case = make_case(2, 1, 16, page, [70, 33], kv=kv, seed=43)
    aligned = dict(case, k_cache=_padded_rows(case["k_cache"], 0))
    shifted = dict(case, k_cache=_padded_rows(case["k_cache"], 8))
    assert aligned["k_cache"].stride() == shifted["k_cache"].stride()
    assert submission.tma_can_read(aligned["k_cache"]) and not submission.tma_can_read(shifted["k_cache"])
    with pytest.raises(ValueError, match="k_cache starts at address"):
        run(shifted)
    plan = submission.get_mla_decode_metadata()[0]
    out, lse = run(aligned, plan=plan)
    assert_right(case, out, lse, kv=kv)
    with pytest.raises(ValueError, match="k_cache starts at address"):
        run(shifted, plan=plan)


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_a_cache_whose_rows_are_not_16_elements_apart_is_a_value_error(kv):
    """Rows 584 elements apart (1,168 bytes of bf16: a 16-byte multiple, but not of 16 elements,
    which is what Triton specialises a stride on) compile as a cache off 16 bytes does (lab/NOTES.md
    h55): refused, naming k_cache."""
    case = make_case(2, 1, 16, 16, [70, 33], kv=kv, seed=44)
    with pytest.raises(ValueError, match="k_cache starts at address .* with strides"):
        run(dict(case, k_cache=_padded_rows(case["k_cache"], 0, extra=8)))


@pytest.mark.parametrize("route,page", [("triton_paged", 64), ("hopper_paged", 64), ("hopper_paged", 16)])
def test_a_signatures_direct_launch_repeats_its_first_launch(monkeypatch, route, page):
    """The launch a plan records per signature (Triton's launcher straight from the plan, as on a
    GPU) passes a later call's own tensors and float k_scale in the order of the first launch's
    arguments, for either route and both Hopper kernels (TMA descriptors at pages of 64, the cache
    itself below; a stand-in for launch() records both; no kernel runs)."""
    launches, direct = [], []

    def recording_launch(kernel, grid, tensors, scalars, constexprs, num_warps, num_stages, floats=1):
        launches.append((kernel, grid, tensors, scalars))
        return (lambda *args: direct.append(args)), ("constexprs",)

    monkeypatch.setattr(submission, "launch", recording_launch)
    monkeypatch.setattr(submission, "SERVING_ROUTES", {route})
    plan = submission.get_mla_decode_metadata()[0]
    plan.num_splits = 3  # no GPU to count the SMs of
    first = make_case(2, 2, 16, page, [100, 70], kv="fp8", seed=41)
    second = dict(first, q=make_case(2, 2, 16, page, [100, 70], kv="fp8", seed=42)["q"],
                  cache_seqlens=torch.tensor([60, 128], dtype=torch.int32, device=DEVICE),
                  block_table=first["block_table"].flip(0).contiguous())  # the same signature, other values
    out1, lse1 = run(first, causal=True, plan=plan)
    kernels = 2 if route == "hopper_paged" else 1  # the Hopper kernel and the combine after it (lab/NOTES.md h72)
    assert plan.route["route"] == route and len(launches) == kernels and not direct
    out2, lse2 = run(second, causal=True, plan=plan, k_scale=second["k_scale"] * 2)
    kernel, grid, tensors, scalars = launches[0]
    if route == "hopper_paged":
        assert kernel is (submission._mla_decode_gathered_hopper_kernel if page < 64
                          else submission._mla_decode_paged_hopper_kernel) is plan.kernel
        assert (tensors[1] is first["k_cache"]) == (page < 64), "the gathered kernel reads the cache itself"
        combine, _, combine_tensors, combine_scalars = launches[1]
        assert combine is submission._mla_combine_kernel
        # its own arguments: the workspace, out and lse of this call, k_scale first of its scalars
        wanted = (*plan.workspace, plan.workspace[2], out2, lse2)
        assert all(got is want for got, want in zip(direct[1][:6], wanted, strict=True))
        assert combine_tensors[4] is out1 and combine_tensors[5] is lse1
        assert direct[1][6] == second["k_scale"] * 2 and combine_scalars[0] == first["k_scale"]
        assert direct[1][7:-1] == combine_scalars[1:] and len(direct[1]) == 6 + len(combine_scalars) + 1
    assert len(launches) == kernels and len(direct) == kernels, "the second call goes straight to Triton"
    args = direct[0]
    assert args[-1] == "constexprs" and len(args) == len(tensors) + len(scalars) + 1
    got_tensors, got_scalars = args[:len(tensors)], args[len(tensors):-1]
    assert got_scalars[1] == second["k_scale"] * 2 and scalars[1] == first["k_scale"]
    assert got_scalars[0] == scalars[0] and got_scalars[2:] == scalars[2:]
    # each argument in the first launch's place: this call's tensor where the first call passed its own
    now = {id(first[name]): second[name] for name in ("q", "cache_seqlens", "block_table")}
    now.update({id(out1): out2, id(lse1): lse2})
    assert len(now) == 5 and all(any(t is then for t in tensors) for then in (first["q"], out1, lse1))
    for i, (then, got) in enumerate(zip(tensors, got_tensors, strict=True)):
        assert got is now.get(id(then), then), f"argument {i} of {kernel}"

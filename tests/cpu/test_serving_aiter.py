"""The serving API (mla_decode_with_kvcache) on aiter, proven against the strict aiter test double.

submission.py is loaded as a fresh module with the double as its aiter (tests/doubles/aiter_double/
loader.py), as on the MI355X. SERVING_ROUTE_TABLE's aiter rows then send one query token over an fp8 cache to
aiter_serving_a8w8_persistent where aiter's persistent a8w8 stage 1 writes an lse (16 / 64 / 128
heads from 2026-06-11, 32 from 2026-06-26; 16 and 128 heads up to 32 requests), else to
aiter_serving_fp8 (16 / 128 heads on every generation, 8 from 2026-06-11), bf16 caches to
aiter_serving_bf16 where aiter's non-persistent decode writes its lse, and every other case to
the portable Triton route (lab/NOTES.md h37, h37a, h47). Each aiter route is held to
reference.check_serving (float64 truth, the API's strict bounds) on engine-like inputs: permuted
block tables with garbage past each request's blocks, NaN in every slot no request attends,
requests of length 0. Nothing here ran on an MI355X; the double computes on the CPU.
"""
import importlib
import inspect
import itertools
import math
import sys

import pytest
import torch

from aiter_double import loader  # tests/ is on sys.path: pytest's rootdir import

RUNNER_GENERATION = "2026-03-04"  # aiter f3be04a12, the runner's
TODAY_GENERATION = "2026-08-10"  # aiter e4048607a, v0.1.20.post1
# Every generation the double models and the product must understand, and whether its
# non-persistent mla_decode_fwd writes a merged lse (aiter c849fd5845, 2026-04-16 on; the file
# reads it from mla_reduce_v1's num_kv_splits, 2026-06-11). Stated here, not read from the double.
DECODE_LSE = {"2026-03-04": False, "2026-03-16": False, "2026-06-11": True, "2026-06-26": True,
              "2026-07-13": True, "2026-07-14": True, TODAY_GENERATION: True}
GENERATIONS = tuple(DECODE_LSE)
# The head counts aiter serves for one query token (non-persistent mla_decode_fwd with an lse;
# lab/NOTES.md h37a): fp8 16 / 128 on every generation, 8 from the kernel table the decode-lse
# generations have; bf16 16 / 64 / 128 where the lse is written. Stated here, not read from code.
FP8_HEADS = {True: (8, 16, 128), False: (16, 128)}
BF16_HEADS = {True: (16, 64, 128), False: ()}
# The persistent a8w8 route's head counts per generation (its kernels have an lse build: lab/NOTES.md
# h47), stated here, not read from the double: none before 2026-06-11 (stage 1 takes no lse, or no
# kernel writes it), no 32 at 2026-06-11 (aiter refuses 32 heads at q length 1 in persistent mode).
PERSISTENT_HEADS = {"2026-03-04": (), "2026-03-16": (), "2026-06-11": (16, 64, 128),
                    "2026-06-26": (16, 32, 64, 128), "2026-07-13": (16, 32, 64, 128),
                    "2026-07-14": (16, 32, 64, 128), TODAY_GENERATION: (16, 32, 64, 128)}
PERSISTENT_MAX_BATCH = 32  # 16 and 128 heads: the persistent row up to here, then aiter_serving_fp8
# The lse build stage 1 runs per head count (asm_mla.cu's remap): the 64-head q-length-1 kernel up
# to 2026-07-14, the 16-head q-length-4 one from 2026-08-10.
PERSISTENT_KERNELS = {16: "mla_a8w8_qh16_qseqlen1_gqaratio16_lse_ps",
                      32: "mla_a8w8_qh32_qseqlen1_gqaratio32_lse_ps",
                      64: "mla_a8w8_qh64_qseqlen1_gqaratio64_lse_v3_ps",
                      128: "mla_a8w8_qh32_qseqlen4_gqaratio32_lse_ps"}
PERSISTENT_64_FROM_08_10 = "mla_a8w8_qh16_qseqlen4_gqaratio16_lse_v3_ps"
KERNELS = {("fp8", 8): "mla_a8w8_qh8_qseqlen1_gqaratio8_v3",
           ("fp8", 16): "mla_a8w8_qh16_qseqlen1_gqaratio16",
           ("fp8", 128): "mla_a8w8_qh128_m32x4_n16x2_msk1",
           ("bf16", 16): "mla_dec_stage1_bf16_a16w16_subQ16_mqa16",
           ("bf16", 64): "mla_a16w16_qh64_qseqlen1_gqaratio64_v3",
           ("bf16", 128): "mla_dec_stage1_bf16_a16w16_subQ128_mqa128"}
_LOADED = {}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _load(generation):
    if generation not in _LOADED:
        result = loader.load_submission(generation)
        assert result.module.HAVE_AITER == (generation in DECODE_LSE), result.stderr
        _LOADED[generation] = result
    return _LOADED[generation]


@pytest.fixture(scope="module")
def reference():
    return importlib.import_module("reference")


_INPUTS = {}


def _input(reference, kv, page, seed=3, batch=3, kv_len=100, varlen=True, zeros=1, heads=16, s_q=1):
    key = (kv, page, seed, batch, kv_len, varlen, zeros, heads, s_q)
    if key not in _INPUTS:
        inputs = reference.generate_serving_input(batch, s_q, heads, page, kv_len, seed, varlen=varlen,
                                                  kv=kv, zeros=zeros, device="cpu")
        _INPUTS[key] = (inputs, reference.serving_expected(inputs))
    return _INPUTS[key]


def _call(mod, inputs, plan=None, **changes):
    args = dict(q=inputs.q, k_cache=inputs.k_cache, block_table=inputs.block_table,
                cache_seqlens=inputs.cache_seqlens, k_scale=inputs.k_scale)
    args.update(changes)
    if plan is None:
        plan, _ = mod.get_mla_decode_metadata()
    out, lse = mod.mla_decode_with_kvcache(args["q"], args["k_cache"], args["block_table"],
                                           args["cache_seqlens"], 512, plan, causal=inputs.causal,
                                           softmax_scale=inputs.softmax_scale, k_scale=args["k_scale"])
    return out, lse, plan


def _route_of(mod, kv, heads, s_q, page=16, table=None, batch=2):
    """The route a plan of this shape gets (chosen without running anything; from `table` where given)."""
    return mod.serving_route(mod.PlanShape(batch, s_q, heads, page, kv, True), None, 1 << 16, table=table).row["route"]


def _without_aiter(mod):
    """SERVING_ROUTE_TABLE's rows but aiter's: what a machine without aiter chooses from."""
    return [row for row in mod.SERVING_ROUTE_TABLE if row["route"] not in mod.AITER_SERVING_ROUTES]


def _aiter_route(generation, kv, heads, batch):
    """The aiter route the expectations above give one query token, or None (Triton)."""
    persistent = PERSISTENT_HEADS[generation]
    if kv == "fp8" and heads in persistent and (heads in (32, 64) or batch <= PERSISTENT_MAX_BATCH):
        return "aiter_serving_a8w8_persistent"
    lse = DECODE_LSE[generation]
    if heads in {"fp8": FP8_HEADS[lse], "bf16": BF16_HEADS[lse]}[kv]:
        return f"aiter_serving_{kv}"
    return None


def _persistent_kernel(generation, heads):
    if heads == 64 and generation == TODAY_GENERATION:
        return PERSISTENT_64_FROM_08_10
    return PERSISTENT_KERNELS[heads]


def test_the_expectations_cover_every_generation_the_double_models():
    api = _load(TODAY_GENERATION).aiter._api
    assert set(DECODE_LSE) == set(api.GENERATIONS) - set(api.UNKNOWN_GENERATIONS)


@pytest.mark.parametrize("generation", GENERATIONS)
def test_the_table_sends_each_case_where_it_is_served(generation):
    """aiter for the single-token head counts it serves with an lse (the persistent row first up
    to 32 requests where both serve); for the rest the route the machine's own table gives (the
    portable kernel; on Hopper, the Hopper kernel on its pages)."""
    mod = _load(generation).module
    lse = DECODE_LSE[generation]
    capabilities = {"decode_lse", "fp8_8_heads"} if lse else set()
    if PERSISTENT_HEADS[generation]:
        capabilities.add("persistent_lse")
    if 32 in PERSISTENT_HEADS[generation]:
        capabilities.add("persistent_lse_32_heads")
    assert mod.AITER_SERVING_CAPABILITIES == capabilities
    for kv in ("fp8", "bf16"):
        for heads in (1, 3, 8, 16, 24, 32, 48, 64, 96, 128, 256):
            for page, batch in ((1, 2), (64, 2), (16, 32), (16, 33), (1, 500)):
                own = _route_of(mod, kv, heads, 1, page, _without_aiter(mod), batch)
                assert own in ("triton_paged", "hopper_paged"), (kv, heads, page, own)
                want = _aiter_route(generation, kv, heads, batch) or own
                assert _route_of(mod, kv, heads, 1, page, batch=batch) == want, (kv, heads, page, batch)
            for s_q in (2, 4, 8):  # more than one query token: never aiter
                assert _route_of(mod, kv, heads, s_q) == _route_of(mod, kv, heads, s_q, 16, _without_aiter(mod))


def test_capabilities_are_read_from_stage_1_and_the_reduce():
    """What each API signal adds (the names, not a generation, decide)."""
    capabilities = _load(TODAY_GENERATION).module.aiter_capabilities
    reduce_new, reduce_old = ("final_output", "num_kv_splits"), ("final_output",)
    assert capabilities({"lse", "valid_split_count"}, reduce_old) == frozenset()
    assert capabilities({"output"}, reduce_new) == {"decode_lse", "fp8_8_heads"}
    assert capabilities({"lse"}, reduce_new) == {"decode_lse", "fp8_8_heads", "persistent_lse"}
    assert capabilities({"valid_split_count"}, reduce_new) == {"decode_lse", "fp8_8_heads"}
    assert capabilities({"lse", "valid_split_count"}, reduce_new) == {
        "decode_lse", "fp8_8_heads", "persistent_lse", "persistent_lse_32_heads"}


@pytest.mark.parametrize("generation", [None, "2099-01"])
def test_without_a_known_aiter_every_case_takes_the_machines_own_table(generation):
    """No aiter route: the portable kernel, or on a Hopper GPU its kernel (any page size)."""
    mod = _load(generation).module
    assert not mod.HAVE_AITER and mod.AITER_SERVING_CAPABILITIES == frozenset()
    for kv in ("fp8", "bf16"):
        for page in (1, 16, 64):
            route = _route_of(mod, kv, 16, 1, page)
            assert route == ("hopper_paged" if mod.HOPPER else "triton_paged"), (kv, page)


def _aiter_cases():
    for generation in GENERATIONS:
        for kv in ("fp8", "bf16"):
            if kv == "bf16" and not DECODE_LSE[generation]:
                continue
            for page in (1, 16, 64):
                yield generation, kv, page


def _non_persistent_batch(generation, kv, heads):
    """3 requests, or 33 where the persistent row would take 3 (the non-persistent one's batches)."""
    return 3 if _aiter_route(generation, kv, heads, 3) == f"aiter_serving_{kv}" else 33


def _strict_aiter_call(reference, generation, route, inputs, expected, plan=None):
    """One call through the double of `generation` on `route`, check_serving's strict bounds
    against float64 passed; (the calls it made as (function, facts), the plan)."""
    loaded = _load(generation)
    loaded.aiter.reset()
    out, lse, plan = _call(loaded.module, inputs, plan)
    assert plan.route["route"] == route
    ok, message = reference.check_serving(inputs, out, lse, expected)
    assert ok, message
    return list(loaded.aiter.LOG), plan


def _decode_fwd_calls(log):
    return [facts for fn, facts in log if fn == "mla_decode_fwd"]


@pytest.mark.parametrize("generation,kv,page", list(_aiter_cases()))
def test_every_non_persistent_route_is_strict_on_every_generation(generation, kv, page, reference):
    """Ragged lengths, a request of length 0, NaN in every slot nobody attends, garbage past the
    used block-table entries: check_serving's strict bounds against float64."""
    batch = _non_persistent_batch(generation, kv, 16)
    log, _ = _strict_aiter_call(reference, generation, f"aiter_serving_{kv}",
                                *_input(reference, kv, page, batch=batch))
    calls = _decode_fwd_calls(log)
    assert len(calls) == 1 and calls[0]["page_size"] == 1 and not calls[0]["persistent"]
    assert calls[0]["kernel"] == ("mla_a8w8_qh16_qseqlen1_gqaratio16" if kv == "fp8"
                                  else "mla_dec_stage1_bf16_a16w16_subQ16_mqa16")
    assert calls[0]["direct"] == (kv == "fp8")  # fp8: one split, stage 1 writes out and lse


def _head_cases():
    for generation in (RUNNER_GENERATION, TODAY_GENERATION):
        lse = DECODE_LSE[generation]
        for kv, heads in [("fp8", h) for h in FP8_HEADS[lse]] + [("bf16", h) for h in BF16_HEADS[lse]]:
            if heads != 16:
                yield generation, kv, heads


@pytest.mark.parametrize("generation,kv,heads", list(_head_cases()))
def test_every_served_head_count_is_strict(generation, kv, heads, reference):
    """The head counts past 16 on the non-persistent routes: aiter's kernel for that count (the
    double's table of the generation), check_serving's strict bounds against float64, a request
    of length 0 included."""
    batch = _non_persistent_batch(generation, kv, heads)
    log, _ = _strict_aiter_call(reference, generation, f"aiter_serving_{kv}",
                                *_input(reference, kv, 16, batch=batch, kv_len=48, heads=heads))
    calls = _decode_fwd_calls(log)
    assert len(calls) == 1 and calls[0]["heads"] == heads
    assert calls[0]["kernel"] == KERNELS[kv, heads]
    assert calls[0]["direct"] == (kv == "fp8")


# ---------------------------------------------------------------------------------------------
# The persistent a8w8 route (aiter_serving_a8w8_persistent)

PERSISTENT_GENERATIONS = tuple(g for g in GENERATIONS if PERSISTENT_HEADS[g])
# 6 requests of lengths [0, 35, 15, 51, 41, 27] (seed 4): at 16 splits a request of one
# 16-token granule is one work item (stage 1 writes its out and lse), the others are split (the
# reduce writes theirs); the request of length 0 gets one padding token.
SPLIT_CASE = {"batch": 6, "kv_len": 40, "seed": 4}


def _work_kinds(plan, lengths):
    """(requests finished by stage 1 alone, requests merged by the reduce) among those with
    tokens, read from the plan's reduce_indptr (a request without a reduce group has one work item)."""
    ptr = plan.aiter.persistent.reduce_indptr[:len(lengths) + 1].tolist()
    groups = [b - a for a, b in itertools.pairwise(ptr)]
    single = sum(1 for n, g in zip(lengths, groups, strict=True) if n > 0 and g == 0)
    merged = sum(1 for n, g in zip(lengths, groups, strict=True) if n > 0 and g >= 2)
    return single, merged


def _persistent_facts(log):
    stage1 = [facts for fn, facts in log if fn == "mla_decode_stage1_asm_fwd"]
    reduce = [facts for fn, facts in log if fn == "mla_reduce_v1"]
    metadata = [facts for fn, facts in log if fn == "get_mla_metadata_v1"]
    assert len(stage1) == len(reduce) == len(metadata) == 1 and not _decode_fwd_calls(log)
    return stage1[0], reduce[0], metadata[0]


@pytest.mark.parametrize("generation,page", [(g, p) for g in PERSISTENT_GENERATIONS for p in (1, 16, 64)])
def test_the_persistent_route_is_strict_on_every_generation_that_takes_it(generation, page, reference):
    """16 heads, one query token: requests stage 1 finishes alone and requests the reduce merges,
    a request of length 0, NaN in every slot nobody attends, garbage past the used block-table
    entries: check_serving's strict bounds against float64. Stage 1 ran its lse build with the
    final lse, the reduce got final_lse and num_kv_splits, the plan was made for fp8 q and KV."""
    inputs, expected = _input(reference, "fp8", page, **SPLIT_CASE)
    log, plan = _strict_aiter_call(reference, generation, "aiter_serving_a8w8_persistent", inputs,
                                   expected)
    stage1, reduce, metadata = _persistent_facts(log)
    assert stage1["kernel"] == PERSISTENT_KERNELS[16] and stage1["lse"] and stage1["page_size"] == 1
    assert reduce["final_lse"] and reduce["num_kv_splits"] == 16
    assert metadata["dtype_q"] == metadata["dtype_kv"] == inputs.k_cache.dtype and metadata["fast_mode"]
    single, merged = _work_kinds(plan, inputs.lengths)
    assert single >= 1 and merged >= 1, (single, merged)


def _persistent_head_cases():
    for generation in PERSISTENT_GENERATIONS:
        for heads in PERSISTENT_HEADS[generation]:
            if heads != 16:
                yield generation, heads


@pytest.mark.parametrize("generation,heads", list(_persistent_head_cases()))
def test_every_persistent_head_count_is_strict(generation, heads, reference):
    """32 / 64 / 128 heads on the persistent route: the lse build of the kernel asm_mla.cu remaps
    the head count onto (the generation's), strict against float64, both kinds of work."""
    inputs, expected = _input(reference, "fp8", 16, heads=heads, **SPLIT_CASE)
    log, plan = _strict_aiter_call(reference, generation, "aiter_serving_a8w8_persistent", inputs,
                                   expected)
    stage1, _, _ = _persistent_facts(log)
    assert stage1["heads"] == heads and stage1["kernel"] == _persistent_kernel(generation, heads)
    single, merged = _work_kinds(plan, inputs.lengths)
    assert single >= 1 and merged >= 1, (single, merged)


def test_the_persistent_route_takes_batches_up_to_32_at_16_and_128_heads(reference):
    """33 requests at 16 heads: the non-persistent row (its one split per request); 32: the
    persistent one. Both strict."""
    for batch, route in ((32, "aiter_serving_a8w8_persistent"), (33, "aiter_serving_fp8")):
        _strict_aiter_call(reference, TODAY_GENERATION, route,
                           *_input(reference, "fp8", 16, batch=batch, kv_len=24))


@pytest.mark.parametrize("generation", [RUNNER_GENERATION, TODAY_GENERATION])
def test_the_double_refuses_the_head_counts_aiter_refuses(generation):
    """fp8 q without a plan: 8 heads has no kernel at f3be04a12, 32 none at either (aiter's own
    persistent-only check at f3be04a12, no table row at e4048607a), 64 aiter's persistent-only
    check at e4048607a (no row at f3be04a12)."""
    loaded = _load(generation)
    today = generation == TODAY_GENERATION
    refusals = {8: None if today else "cannot get heuristic kernel",
                32: "cannot get heuristic kernel" if today else "decode_qlen=4 in persistent mode",
                64: "only supports persistent mode" if today else "cannot get heuristic kernel"}
    for heads, message in refusals.items():
        q = torch.randn(2, heads, 576).to(torch.float8_e4m3fn)
        rows = torch.randn(8, 1, 1, 576).to(torch.float8_e4m3fn)
        out = torch.empty(2, heads, 512, dtype=torch.bfloat16)
        qo = torch.arange(3, dtype=torch.int32)
        args = (q, rows, out, qo, torch.tensor([0, 3, 8], dtype=torch.int32),
                torch.arange(8, dtype=torch.int32), torch.ones(2, dtype=torch.int32), 1)
        kwargs = dict(page_size=1, nhead_kv=1, num_kv_splits=1, num_kv_splits_indptr=qo,
                      q_scale=torch.ones(1), kv_scale=torch.ones(1))
        if message is None:
            loaded.module.mla_decode_fwd(*args, **kwargs)
        else:
            with pytest.raises(loaded.aiter.ContractError, match=message):
                loaded.module.mla_decode_fwd(*args, **kwargs)


def _stage1_args(mod, heads, batch=2, length=20):
    """Stage 1's arguments by name for a persistent fp8 call at `heads` (one query token each, a
    16-head plan: the kernel choice comes first, so a refused head count never reads it)."""
    fp8 = torch.float8_e4m3fn
    q = torch.randn(batch, heads, 576).to(fp8)
    kv = torch.randn(batch * length, 1, 1, 576).to(fp8)
    qo = torch.arange(batch + 1, dtype=torch.int32)
    kv_indptr = qo * length
    plan = mod.PersistentPlan(batch, 1, 16, fp8, fp8, torch.device("cpu"), mod.BALANCED_PLAN)
    plan.fill(qo, kv_indptr, torch.ones(batch, dtype=torch.int32), 1, 1, 16, fp8, fp8)
    return dict(Q=q, KV=kv, qo_indptr=qo, kv_indptr=kv_indptr,
                kv_page_indices=torch.arange(batch * length, dtype=torch.int32),
                kv_last_page_lens=torch.ones(batch, dtype=torch.int32), num_kv_splits_indptr=None,
                work_meta_data=plan.work_meta_data, work_indptr=plan.work_indptr,
                work_info_set=plan.work_info_set, max_seqlen_q=1, page_size=1, nhead_kv=1,
                softmax_scale=576 ** -0.5, splitData=plan.partial_output, splitLse=plan.partial_lse,
                output=torch.empty(batch, heads, 512, dtype=torch.bfloat16),
                lse=torch.empty(batch, heads), q_scale=torch.ones(1), kv_scale=torch.ones(1))


@pytest.mark.parametrize("generation,heads,message", [
    ("2026-06-11", 32, "gqa_ratio=32 only supports decode_qlen=2,4 in persistent mode"),
    (TODAY_GENERATION, 8, "cannot get heuristic kernel.*gqa:8 ps:1.*qseqlen:1"),
    (TODAY_GENERATION, 48, "cannot get heuristic kernel.*gqa:48 ps:1"),
    ("2026-06-26", 96, "cannot get heuristic kernel.*gqa:96 ps:1"),
])
def test_the_double_refuses_the_persistent_head_counts_aiter_refuses(generation, heads, message):
    """Stage 1 in persistent mode with fp8 q for one query token: aiter's refusal where
    asm_mla.cu finds no kernel for the head count (lab/NOTES.md h47)."""
    loaded = _load(generation)
    args = _stage1_args(loaded.module, heads)
    with pytest.raises(loaded.aiter.ContractError, match=message):
        loaded.aiter.mla_decode_stage1_asm_fwd(**args)


@pytest.mark.parametrize("generation,heads", [("2026-06-11", 32), (TODAY_GENERATION, 48),
                                              (RUNNER_GENERATION, 64)])
def test_the_double_refuses_to_plan_heads_aiter_folds(generation, heads):
    """get_mla_metadata_v1 folds a head count it does not plan natively into 16-head batches
    (v1_2_device.cuh); the double does not model the fold, so the info refuses it."""
    loaded = _load(generation)
    with pytest.raises(loaded.aiter.ContractError, match="16-head fold is not modelled"):
        loaded.module.PersistentPlan(2, 1, 16, torch.float8_e4m3fn, torch.float8_e4m3fn,
                                     torch.device("cpu"), loaded.module.BALANCED_PLAN, heads)


def test_the_double_plans_64_heads_only_for_the_dtypes_it_is_told():
    """aiter plans for bf16 where get_mla_metadata_v1 is given no dtypes (metadata.cu): a 64-head
    fp8 plan needs dtype_q / dtype_kv."""
    loaded = _load(TODAY_GENERATION)
    fp8 = torch.float8_e4m3fn
    plan = loaded.module.PersistentPlan(2, 1, 16, fp8, fp8, torch.device("cpu"),
                                        loaded.module.BALANCED_PLAN, 64)
    qo = torch.arange(3, dtype=torch.int32)
    with pytest.raises(loaded.aiter.ContractError, match="64 query heads"):
        loaded.aiter.get_mla_metadata_v1(
            qo, qo * 20, torch.ones(2, dtype=torch.int32), 64, 1, False, plan.work_meta_data,
            plan.work_info_set, plan.work_indptr, plan.reduce_indptr, plan.reduce_final_map,
            plan.reduce_partial_map, max_seqlen_qo=1, uni_seqlen_qo=1, max_split_per_batch=16)
    plan.fill(qo, qo * 20, torch.ones(2, dtype=torch.int32), 1, 1, 16, fp8, fp8)  # with them


# (generation, cache format, the route 3-6 requests of 16 heads get there)
ROUTE_CASES = [(RUNNER_GENERATION, "fp8", "aiter_serving_fp8"),
               (TODAY_GENERATION, "fp8", "aiter_serving_a8w8_persistent"),
               (TODAY_GENERATION, "bf16", "aiter_serving_bf16")]


@pytest.mark.parametrize("generation,kv,route", ROUTE_CASES)
def test_rows_of_length_zero_are_exactly_zero_with_lse_inf(generation, kv, route, reference):
    """The double leaves a request without tokens NaN (aiter's 0 / 0; the persistent route gives
    it one padding token, row 0, which holds NaN here): the route's fix-up decides."""
    mod = _load(generation).module
    inputs, _ = _input(reference, kv, 16, zeros=2, batch=4)
    out, lse, plan = _call(mod, inputs)
    assert plan.route["route"] == route
    empty = inputs.cache_seqlens == 0
    assert int(empty.sum()) == 2
    assert (out[empty] == 0).all() and torch.isinf(lse[empty]).all() and (lse[empty] > 0).all()
    assert torch.isfinite(out[~empty].float()).all() and torch.isfinite(lse[~empty]).all()


@pytest.mark.parametrize("generation,kv,route", ROUTE_CASES)
def test_bad_block_ids_and_lengths_poison_only_their_request(generation, kv, route, reference):
    mod = _load(generation).module
    inputs, expected = _input(reference, kv, 16, zeros=0, varlen=False, batch=4, kv_len=40)
    plan = None
    num_blocks, page = inputs.k_cache.shape[:2]
    capacity = inputs.block_table.shape[1] * page
    for bad_request, change in ((1, "block -1"), (2, "block past the cache"), (0, "negative length"),
                                (3, "length past the capacity"), (1, "length 2**30")):
        table, lengths = inputs.block_table.clone(), inputs.cache_seqlens.clone()
        if change == "block -1":
            table[bad_request, 1] = -1
        elif change == "block past the cache":
            table[bad_request, 0] = num_blocks + 7
        elif change == "length 2**30":  # unclamped, aiter would read past kv_indices
            lengths[bad_request] = 2**30
        elif change == "negative length":
            lengths[bad_request] = -5
        else:
            lengths[bad_request] = capacity + 1
        out, lse, plan = _call(mod, inputs, plan, block_table=table, cache_seqlens=lengths)
        assert plan.route["route"] == route
        assert torch.isnan(out[bad_request].float()).all() and torch.isnan(lse[bad_request]).all(), change
        good = [b for b in range(4) if b != bad_request]
        assert torch.isfinite(out[good].float()).all() and torch.isfinite(lse[good]).all(), change
        truth = expected.out[good].double()
        assert reference.rel_l2_error(out[good], truth) < 0.06, change
        assert (lse[good].double() - expected.lse[good]).abs().max() < 0.05, change


def test_the_padding_token_of_an_empty_request_reads_row_0():
    """For the persistent route a request of length 0 (or a negative length) gets one CSR entry:
    row 0, never a block its table row names (entries past its used blocks are never read), and
    the requests after it keep their own tokens."""
    mod = _load(TODAY_GENERATION).module
    page = 4
    table = torch.tensor([[5, 6], [7, 1], [2, 3]], dtype=torch.int32)  # row 0: garbage, in range
    lengths = torch.tensor([0, 6, -3], dtype=torch.int32)
    buffers = mod.AiterServingBuffers(3, 2 * page, torch.device("cpu"))
    kv_indices, bad, empty = mod.aiter_serving_csr(buffers, table, lengths, 8, page, 1)
    assert buffers.kv_indptr.tolist() == [0, 1, 7, 8]
    assert kv_indices[:8].tolist() == [0, 28, 29, 30, 31, 4, 5, 0]
    assert bad.tolist() == [False, False, True] and empty.tolist() == [True, False, False]
    kv_indices, _, _ = mod.aiter_serving_csr(buffers, table, lengths, 8, page)  # other routes
    assert buffers.kv_indptr.tolist() == [0, 0, 6, 6] and kv_indices[:6].tolist() == [28, 29, 30, 31, 4, 5]


def _fixed_buffers(plan):
    """The pointers of every buffer a plan's aiter route hands aiter: the CSR, and the persistent
    route's work plan, partials and lse."""
    csr = plan.aiter
    tensors = [csr.qo_indptr, csr.kv_indptr, csr.kv_indices, csr.kv_last_page_lens]
    if csr.persistent is not None:
        work = csr.persistent
        tensors += [work.work_meta_data, work.work_indptr, work.work_info_set, work.reduce_indptr,
                    work.reduce_final_map, work.reduce_partial_map, work.partial_output,
                    work.partial_lse, csr.final_lse]
    return tuple(t.data_ptr() for t in tensors)


@pytest.mark.parametrize("generation,route", [(RUNNER_GENERATION, "aiter_serving_fp8"),
                                              (TODAY_GENERATION, "aiter_serving_a8w8_persistent")])
def test_plan_reuse_with_new_lengths_and_tables_keeps_its_buffers(generation, route, reference):
    """One plan, new lengths and block tables (what a graph replay sees): right each time, and
    aiter is handed the same buffers every call; the persistent route plans each call anew (on
    the GPU, into those buffers)."""
    loaded = _load(generation)
    plan = None
    pointers = set()
    lengths = set()
    for seed in (3, 4, 5):
        inputs, expected = _input(reference, "fp8", 16, seed=seed, kv_len=120)
        lengths.add(tuple(inputs.lengths))
        loaded.aiter.reset()
        out, lse, plan = _call(loaded.module, inputs, plan)
        assert plan.route["route"] == route
        ok, message = reference.check_serving(inputs, out, lse, expected)
        assert ok, (seed, message)
        pointers.add(_fixed_buffers(plan))
        persistent = route == "aiter_serving_a8w8_persistent"
        assert loaded.aiter.CALLS["get_mla_metadata_v1"] == int(persistent)
        assert loaded.aiter.CALLS["get_mla_metadata_info_v1"] == int(persistent and seed == 3)
    assert len(lengths) == 3 and len(pointers) == 1
    assert len(next(iter(pointers))) == (13 if route == "aiter_serving_a8w8_persistent" else 4)
    assert plan.aiter.kv_indices.numel() >= inputs.block_table.numel() * inputs.k_cache.shape[1]


@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_outputs_are_fresh(kv, reference):
    """Two calls on one plan: the first call's out and lse are not overwritten (the persistent
    route's lse lives in the plan: the caller gets a copy)."""
    mod = _load(TODAY_GENERATION).module
    first, _ = _input(reference, kv, 1, seed=3)
    second, _ = _input(reference, kv, 1, seed=4)
    out1, lse1, plan = _call(mod, first)
    assert plan.route["route"] == ("aiter_serving_a8w8_persistent" if kv == "fp8" else "aiter_serving_bf16")
    kept = out1.clone(), lse1.clone()
    out2, lse2, _ = _call(mod, second, plan)
    assert out1.data_ptr() != out2.data_ptr() and lse1.data_ptr() != lse2.data_ptr()
    assert torch.equal(out1, kept[0]) and torch.equal(lse1, kept[1])
    assert not torch.equal(lse1, lse2)


@pytest.mark.parametrize("generation", [RUNNER_GENERATION, TODAY_GENERATION])
def test_k_scale_as_a_float_or_a_0_d_tensor(generation, reference):
    mod = _load(generation).module
    inputs, expected = _input(reference, "fp8", 16)
    for k_scale in (float(inputs.k_scale), inputs.k_scale.reshape(())):
        out, lse, _ = _call(mod, inputs, k_scale=k_scale)
        ok, message = reference.check_serving(inputs, out, lse, expected)
        assert ok, message


def test_a_cache_that_is_not_contiguous_rows_is_a_value_error(reference):
    mod = _load(TODAY_GENERATION).module
    inputs, _ = _input(reference, "bf16", 16)
    strided = torch.empty(inputs.k_cache.shape[0], 2 * inputs.k_cache.shape[1], 1, 576,
                          dtype=torch.bfloat16)[:, ::2]
    strided.copy_(inputs.k_cache)
    with pytest.raises(ValueError, match="k_cache"):
        _call(mod, inputs, k_cache=strided)


_SYNCS = ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero", "cpu", "numpy")


def test_the_aiter_route_never_syncs_with_the_host(reference, monkeypatch):
    """Every host-reading Tensor method raises when the submission module calls it (the double,
    which computes on the host, may); the source of the route says the same for what a patch
    cannot see (boolean indexing, masked_select)."""
    loaded = _load(TODAY_GENERATION)
    name = loaded.module.__name__

    def guarded(method):
        original = getattr(torch.Tensor, method)

        def call(self, *args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__") == name:
                raise AssertionError(f"submission called Tensor.{method}: a host sync")
            return original(self, *args, **kwargs)

        return call

    for kv, batch in (("fp8", 3), ("fp8", 33), ("bf16", 3)):  # the persistent route, then the others
        inputs, _ = _input(reference, kv, 16, batch=batch)
        plan = None
        with monkeypatch.context() as patch:
            for method in _SYNCS:
                patch.setattr(torch.Tensor, method, guarded(method))
            for _ in range(2):  # the checked first call and a recorded signature's call
                _, _, plan = _call(loaded.module, inputs, plan, k_scale=float(inputs.k_scale)
                                   if kv == "fp8" else None)
        assert plan.route["route"] == _aiter_route(TODAY_GENERATION, kv, 16, batch)
    module = loaded.module
    source = "".join(inspect.getsource(fn) for fn in (
        module.aiter_serving_call, module.aiter_serving_csr, module.aiter_serving_fix,
        module.aiter_serving_fp8, module.aiter_serving_bf16, module.aiter_serving_a8w8_persistent,
        module.PersistentPlan.__init__, module.PersistentPlan.fill))
    for word in (".item(", ".tolist(", "nonzero", ".cpu(", "masked_select", "bool("):
        assert word not in source, word


# ---------------------------------------------------------------------------------------------
# What the double models of mla_decode_fwd for these routes


def _decode_fwd(mla_decode_fwd, q, kv_rows, qo, kv_indptr, kv_indices, last, page, **kwargs):
    out = torch.empty(q.shape[0], 16, 512, dtype=torch.bfloat16)
    _, lse = mla_decode_fwd(q, kv_rows, out, qo, kv_indptr, kv_indices, last, 1,
                                          page_size=page, nhead_kv=1, **kwargs)
    return out, lse


def _small_case(batch=3, page=4, lengths=(5, 9, 4)):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(batch, 16, 576, generator=gen).to(torch.bfloat16)
    pages = [-(-n // page) for n in lengths]
    cache = torch.randn(sum(pages) + 2, page, 1, 576, generator=gen).to(torch.bfloat16)
    page_ids = torch.randperm(sum(pages) + 2, generator=gen)[:sum(pages)].to(torch.int32)
    page_indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page for n, p in zip(lengths, pages, strict=True)], dtype=torch.int32)
    qo = torch.arange(batch + 1, dtype=torch.int32)
    return q, cache, qo, page_indptr, page_ids, last, lengths


@pytest.mark.parametrize("generation", [RUNNER_GENERATION, TODAY_GENERATION])
def test_the_double_reads_pages_and_last_page_lengths_as_aiter_does(generation):
    """Page CSR (kv_indptr in pages, page ids, last-page lengths) and the same tokens as one-token
    pages give the same attention; a last-page length outside [1, page_size] is refused."""
    loaded = _load(generation)
    mla_decode_fwd = loaded.module.mla_decode_fwd
    q, cache, qo, page_indptr, page_ids, last, lengths = _small_case()
    page = cache.shape[1]
    paged, _ = _decode_fwd(mla_decode_fwd, q, cache, qo,
                           page_indptr, page_ids, last, page)
    rows = torch.cat([(page_ids[page_indptr[b]:page_indptr[b + 1]].long()[:, None] * page
                       + torch.arange(page)).reshape(-1)[:n] for b, n in enumerate(lengths)])
    token_indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    tokens, _ = _decode_fwd(mla_decode_fwd, q,
                            cache.view(-1, 1, 1, 576), qo, token_indptr, rows.to(torch.int32),
                            torch.ones(3, dtype=torch.int32), 1)
    assert torch.equal(paged, tokens)
    with pytest.raises(loaded.aiter.ContractError, match="kv_last_page_lens"):
        _decode_fwd(mla_decode_fwd, q, cache, qo,
                    page_indptr, page_ids, last + page, page)


@pytest.mark.parametrize("generation", GENERATIONS)
def test_the_double_returns_the_lse_each_aiter_returns(generation):
    """bf16 q: the merged natural-log lse with return_lse where aiter's stage 2 writes it, an
    unwritten (NaN) tensor where it does not; fp8 q with one split: stage 1's own lse, every
    generation. A request without tokens: out NaN, lse -inf (nothing defined)."""
    loaded = _load(generation)
    holder = loaded.module.mla_decode_fwd
    q, cache, qo, page_indptr, page_ids, last, lengths = _small_case(lengths=(5, 9, 4))
    rows = cache.view(-1, 1, 1, 576)
    ids = torch.cat([(page_ids[page_indptr[b]:page_indptr[b + 1]].long()[:, None] * 4
                      + torch.arange(4)).reshape(-1)[:n] for b, n in enumerate(lengths)]).to(torch.int32)
    indptr = torch.tensor([0, 5, 14, 18], dtype=torch.int32)
    ones = torch.ones(3, dtype=torch.int32)
    scores = [(q[b].double() @ rows[ids[indptr[b]:indptr[b + 1]].long(), 0, 0].double().T) / math.sqrt(576)
              for b in range(3)]
    truth = torch.stack([torch.logsumexp(s, dim=-1) for s in scores])
    _, lse = _decode_fwd(holder, q, rows, qo, indptr, ids, ones, 1, return_lse=True)
    if DECODE_LSE[generation]:
        assert (lse.double() - truth).abs().max() < 1e-4
    else:
        assert torch.isnan(lse).all()
    fp8_rows = rows.to(torch.float8_e4m3fn)
    unit = torch.ones(1)
    _, lse = _decode_fwd(holder, q.to(torch.float8_e4m3fn), fp8_rows, qo, indptr, ids, ones, 1,
                         num_kv_splits=1, num_kv_splits_indptr=qo, q_scale=unit, kv_scale=unit)
    assert lse.shape == (3, 1, 16, 1)
    scores = [(q[b].to(torch.float8_e4m3fn).double() @ fp8_rows[ids[indptr[b]:indptr[b + 1]].long(), 0, 0]
               .double().T) / math.sqrt(576) for b in range(3)]
    truth = torch.stack([torch.logsumexp(s, dim=-1) for s in scores])
    assert (lse[:, 0, :, 0].double() - truth).abs().max() < 1e-4
    empty = torch.tensor([0, 5, 5, 9], dtype=torch.int32)
    out, lse = _decode_fwd(holder, q.to(torch.float8_e4m3fn), fp8_rows, qo, empty, ids, ones, 1,
                           num_kv_splits=1, num_kv_splits_indptr=qo, q_scale=unit, kv_scale=unit)
    assert torch.isnan(out[1].float()).all() and torch.isneginf(lse[1]).all()

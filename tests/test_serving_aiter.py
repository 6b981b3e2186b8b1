"""The serving API (mla_decode_with_kvcache) on aiter, proven against the strict aiter test double.

submission.py is loaded as a fresh module with the double as its aiter (tests/aiter_double/
loader.py), as on the MI355X. AITER_SERVING_TABLE then sends fp8 caches at 16 heads and one
query token to aiter_serving_fp8 on every aiter generation, bf16 ones to aiter_serving_bf16 where
aiter's non-persistent decode writes its lse, and every other case to the portable Triton route
(NOTES.md h37). Each aiter route is held to reference.check_serving (float64 truth, the API's
strict bounds) on engine-like inputs: permuted block tables with garbage past each request's
blocks, NaN in every slot no request attends, requests of length 0. Nothing here ran on an
MI355X; the double computes on the CPU.
"""
import importlib
import inspect
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
# NOTES.md h37a): fp8 16 / 128 on every generation, 8 from the kernel table the decode-lse
# generations have; bf16 16 / 64 / 128 where the lse is written. Stated here, not read from code.
FP8_HEADS = {True: (8, 16, 128), False: (16, 128)}
BF16_HEADS = {True: (16, 64, 128), False: ()}
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


def _route_of(mod, kv, heads, s_q, page=16, table=None):
    """The route a plan of this shape gets (chosen without running anything; from `table` where given)."""
    return mod.serving_route_row((2, s_q, heads, page, kv, True), table)["route"]


def test_the_expectations_cover_every_generation_the_double_models():
    api = _load(TODAY_GENERATION).aiter._api
    assert set(DECODE_LSE) == set(api.GENERATIONS) - set(api.UNKNOWN_GENERATIONS)


@pytest.mark.parametrize("generation", GENERATIONS)
def test_the_table_sends_each_case_where_it_is_served(generation):
    """aiter for the single-token head counts it serves with an lse; for the rest the route the
    machine's own table gives (the portable kernel; on Hopper, the Hopper kernel on its pages)."""
    mod = _load(generation).module
    lse = DECODE_LSE[generation]
    assert mod.AITER_SERVING_CAPABILITIES == ({"decode_lse", "fp8_8_heads"} if lse else set())
    served = {"fp8": FP8_HEADS[lse], "bf16": BF16_HEADS[lse]}
    for kv in ("fp8", "bf16"):
        for heads in (1, 3, 8, 16, 24, 32, 48, 64, 96, 128, 256):
            for page in (1, 64):
                own = _route_of(mod, kv, heads, 1, page, mod.SERVING_ROUTE_TABLE)
                assert own in ("triton_paged", "hopper_paged"), (kv, heads, page, own)
                want = f"aiter_serving_{kv}" if heads in served[kv] else own
                assert _route_of(mod, kv, heads, 1, page) == want, (kv, heads, page)
            for s_q in (2, 4, 8):  # more than one query token: never aiter
                assert _route_of(mod, kv, heads, s_q) == _route_of(mod, kv, heads, s_q, 16, mod.SERVING_ROUTE_TABLE)


@pytest.mark.parametrize("generation", [None, "2099-01"])
def test_without_a_known_aiter_every_case_is_triton(generation):
    mod = _load(generation).module
    assert not mod.HAVE_AITER and mod.AITER_SERVING_CAPABILITIES == frozenset()
    for kv in ("fp8", "bf16"):
        assert _route_of(mod, kv, 16, 1) == "triton_paged"


def _aiter_cases():
    for generation in GENERATIONS:
        for kv in ("fp8", "bf16"):
            if kv == "bf16" and not DECODE_LSE[generation]:
                continue
            for page in (1, 16, 64):
                yield generation, kv, page


def _strict_aiter_call(reference, generation, kv, inputs, expected):
    """One call through the double of `generation` on the aiter route of the cache format,
    check_serving's strict bounds against float64 passed; the mla_decode_fwd calls it made."""
    loaded = _load(generation)
    loaded.aiter.reset()
    out, lse, plan = _call(loaded.module, inputs)
    assert plan.route["route"] == f"aiter_serving_{kv}"
    ok, message = reference.check_serving(inputs, out, lse, expected)
    assert ok, message
    return [facts for fn, facts in loaded.aiter.LOG if fn == "mla_decode_fwd"]


@pytest.mark.parametrize("generation,kv,page", list(_aiter_cases()))
def test_every_aiter_route_is_strict_on_every_generation(generation, kv, page, reference):
    """Ragged lengths, a request of length 0, NaN in every slot nobody attends, garbage past the
    used block-table entries: check_serving's strict bounds against float64."""
    calls = _strict_aiter_call(reference, generation, kv, *_input(reference, kv, page))
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
    """The head counts past 16: aiter's kernel for that count (the double's table of the
    generation), check_serving's strict bounds against float64, a request of length 0 included."""
    calls = _strict_aiter_call(reference, generation, kv,
                               *_input(reference, kv, 16, batch=3, kv_len=48, heads=heads))
    assert len(calls) == 1 and calls[0]["heads"] == heads
    assert calls[0]["kernel"] == KERNELS[kv, heads]
    assert calls[0]["direct"] == (kv == "fp8")


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


@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_rows_of_length_zero_are_exactly_zero_with_lse_inf(kv, reference):
    """The double leaves a request without tokens NaN (aiter's 0 / 0): the route's fix-up decides."""
    mod = _load(TODAY_GENERATION).module
    inputs, _ = _input(reference, kv, 16, zeros=2, batch=4)
    out, lse, _ = _call(mod, inputs)
    empty = inputs.cache_seqlens == 0
    assert int(empty.sum()) == 2
    assert (out[empty] == 0).all() and torch.isinf(lse[empty]).all() and (lse[empty] > 0).all()
    assert torch.isfinite(out[~empty].float()).all() and torch.isfinite(lse[~empty]).all()


@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_bad_block_ids_and_lengths_poison_only_their_request(kv, reference):
    mod = _load(TODAY_GENERATION).module
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
        assert torch.isnan(out[bad_request].float()).all() and torch.isnan(lse[bad_request]).all(), change
        good = [b for b in range(4) if b != bad_request]
        assert torch.isfinite(out[good].float()).all() and torch.isfinite(lse[good]).all(), change
        truth = expected.out[good].double()
        assert reference.rel_l2_error(out[good], truth) < 0.06, change


def test_plan_reuse_with_new_lengths_and_tables_keeps_its_buffers(reference):
    """One plan, new lengths and block tables (what a graph replay sees): right each time, and
    aiter is handed the same CSR buffers every call."""
    mod = _load(TODAY_GENERATION).module
    plan = None
    pointers = set()
    for seed in (3, 4, 5):
        inputs, expected = _input(reference, "fp8", 16, seed=seed, kv_len=120)
        out, lse, plan = _call(mod, inputs, plan)
        ok, message = reference.check_serving(inputs, out, lse, expected)
        assert ok, (seed, message)
        csr = plan.aiter
        pointers.add(tuple(t.data_ptr() for t in (csr.qo_indptr, csr.kv_indptr, csr.kv_indices,
                                                  csr.kv_last_page_lens)))
    assert len(pointers) == 1
    assert plan.aiter.kv_indices.numel() >= inputs.block_table.numel() * inputs.k_cache.shape[1]


def test_outputs_are_fresh(reference):
    mod = _load(TODAY_GENERATION).module
    first, _ = _input(reference, "bf16", 1, seed=3)
    second, _ = _input(reference, "bf16", 1, seed=4)
    out1, lse1, plan = _call(mod, first)
    kept = out1.clone(), lse1.clone()
    out2, lse2, _ = _call(mod, second, plan)
    assert out1.data_ptr() != out2.data_ptr() and lse1.data_ptr() != lse2.data_ptr()
    assert torch.equal(out1, kept[0]) and torch.equal(lse1, kept[1])


def test_k_scale_as_a_float_or_a_0_d_tensor(reference):
    mod = _load(RUNNER_GENERATION).module
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

    for kv in ("fp8", "bf16"):
        inputs, _ = _input(reference, kv, 16)
        plan = None
        with monkeypatch.context() as patch:
            for method in _SYNCS:
                patch.setattr(torch.Tensor, method, guarded(method))
            for _ in range(2):  # the checked first call and a recorded signature's call
                _, _, plan = _call(loaded.module, inputs, plan, k_scale=float(inputs.k_scale)
                                   if kv == "fp8" else None)
    source = "".join(inspect.getsource(getattr(loaded.module, fn)) for fn in (
        "aiter_serving_call", "aiter_serving_csr", "aiter_serving_fix", "aiter_serving_fp8",
        "aiter_serving_bf16"))
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

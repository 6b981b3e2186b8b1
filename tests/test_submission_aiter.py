"""submission.py's aiter routes, proven against the strict aiter test double (tests/aiter_double).

Each configuration loads submission.py as a fresh module with the double first on sys.path (both
API generations, and the double's opaque-signature mode); sys.modules is restored afterwards. The
double computes from the buffers it is given, so wrong page maths, stale plans or wrong buffers
give wrong numbers, which these tests measure against float64 attention.
"""
import importlib
import inspect

import pytest
import torch

GENERATIONS = ("2026-03", "2026-04")


from aiter_double import loader  # noqa: E402  (tests/ is on sys.path: pytest's rootdir import)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def reference():
    return importlib.import_module("reference")


_INPUTS = {}


@pytest.fixture(scope="module")
def make_input(reference):
    """Inputs on the CPU, memoised with their float64 attention (routes never write inputs)."""

    def make(batch, kv_len, seed=7, kv_lens=None):
        key = (batch, kv_len, seed, None if kv_lens is None else tuple(kv_lens))
        if key not in _INPUTS:
            data = reference.generate_input(batch, 1, kv_len, seed, kv_lens=kv_lens, device="cpu")
            _INPUTS[key] = (data, reference.attention_float64(data))
        return _INPUTS[key]

    return make


@pytest.fixture(scope="module", params=GENERATIONS)
def loaded(request):
    result = loader.load_submission(request.param)
    assert result.module.HAVE_AITER, result.stderr
    return result


def _route_error(reference, out, expected):
    assert out.dtype == torch.bfloat16 and out.shape == expected.shape
    assert torch.isfinite(out.float()).all()
    return reference.rel_l2_error(out, expected)


def _label(row):
    return f"{row['route']} {row['params']}"


# ---------------------------------------------------------------------------------------------
# Import and API drift


@pytest.mark.parametrize("generation", GENERATIONS)
def test_import_reads_each_generation_once(generation):
    result = loader.load_submission(generation)
    mod = result.module
    assert mod.HAVE_AITER is True and result.stderr == ""
    stage1 = mod.AITER_API["mla_decode_stage1_asm_fwd"]
    reduce = mod.AITER_API["mla_reduce_v1"]
    assert stage1[-2:] == ("q_scale", "kv_scale")
    if generation == "2026-03":
        assert stage1[-3] == "output" and "num_kv_splits" not in reduce
    else:
        assert stage1[-4:-2] == ("output", "lse") and reduce[6] == "num_kv_splits"
    assert set(mod.ROUTES) >= {"aiter_bf16", "aiter_fp8", "aiter_a8w8_persistent"}
    assert mod.active_route_table() is mod.AITER_ROUTE_TABLE


def test_opaque_signatures_are_read_from_the_op_schema(make_input, reference):
    """Real aiter wraps its ops in (*args, **kwargs): the names come from torch.ops.aiter."""
    result = loader.load_submission("2026-04", opaque=True)
    mod = result.module
    assert mod.HAVE_AITER, result.stderr
    assert str(inspect.signature(result.aiter.mla_decode_stage1_asm_fwd)) == "(*args, **kwargs)"
    assert "lse" in mod.AITER_API["mla_decode_stage1_asm_fwd"]
    assert "num_kv_splits" in mod.AITER_API["mla_reduce_v1"]
    data, expected = make_input(8, 128)
    out = mod.aiter_a8w8_persistent_route(*data, page_size=2, num_kv_splits=4,
                                          q_scale_mode="per_tensor")
    bound = mod.ROUTE_INFO["aiter_a8w8_persistent"]["rel_l2_bound"]
    assert _route_error(reference, out, expected) <= bound


def test_the_double_rejects_the_other_generations_argument_order(make_input):
    """What the drift detection protects against: an op called with the other generation's
    positional layout fails on the double (on the real library it would misbehave)."""
    old, new = loader.load_submission("2026-03"), loader.load_submission("2026-04")
    data, _ = make_input(4, 64)
    for caller, callee in ((old, new), (new, old)):
        mod = caller.module
        for op in ("_stage1", "_reduce"):  # one op of the other generation at a time
            own = getattr(mod, op)
            setattr(mod, op, getattr(callee.aiter, own.__name__))
            try:
                with pytest.raises((TypeError, RuntimeError)):
                    mod.aiter_a8w8_persistent_route(*data, page_size=2, num_kv_splits=2)
            finally:
                setattr(mod, op, own)
        mod.aiter_a8w8_persistent_route(*data, page_size=2, num_kv_splits=2)  # its own: fine


@pytest.mark.parametrize("generation", [None, "2099-01"])
def test_without_a_known_aiter_the_portable_route_runs_after_one_warning(generation, make_input,
                                                                         reference):
    result = loader.load_submission(generation)
    mod = result.module
    assert mod.HAVE_AITER is False and mod.AITER_API is None
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "aiter routes off" in lines[0], result.stderr
    if generation is not None:
        assert "cu_mask" in lines[0]  # names what it did not understand
    assert not any(name.startswith("aiter_") for name in mod.ROUTES)
    assert mod.active_route_table() is mod.TRITON_ROUTE_TABLE
    data, expected = make_input(2, 48)
    out = mod.custom_kernel(data)
    row = mod.select_route(2, 48, True)
    assert row in mod.TRITON_ROUTE_TABLE and mod.LAST_ROUTE == _label(row)
    assert _route_error(reference, out, expected) <= mod.ROUTE_INFO[row["route"]]["rel_l2_bound"]


# ---------------------------------------------------------------------------------------------
# Numerics: every row's route with the row's parameters, and custom_kernel on small shapes


def _reduced_shape(row):
    """A small shape for running the row's route directly: at most 32 batches, a KV length that
    is a multiple of its page size (routes do not check the table's bounds)."""
    batch = min(row["max_batch"] or 32, 32)
    return batch, 256


@pytest.mark.parametrize("row_index", range(7))
def test_every_row_route_is_accurate(loaded, row_index, make_input, reference):
    table = loaded.module.AITER_ROUTE_TABLE
    if row_index >= len(table):
        pytest.skip("table has fewer rows")
    row = table[row_index]
    batch, kv_len = _reduced_shape(row)
    data, expected = make_input(batch, kv_len)
    out = loaded.module.ROUTES[row["route"]](*data, **row["params"])
    bound = loaded.module.ROUTE_INFO[row["route"]]["rel_l2_bound"]
    assert _route_error(reference, out, expected) <= bound, _label(row)
    if "q_scale_mode" in row["params"]:
        # With the reference's own q quantisation an a8w8 route computes the reference's
        # mathematics: a dropped row, a wrong page or a wrong split weight shows up far above
        # float32 / bf16 rounding.
        params = dict(row["params"], q_scale_mode="per_tensor")
        out = loaded.module.ROUTES[row["route"]](*data, **params)
        assert reference.rel_l2_error(out, reference.ref_kernel_torch(data).double()) < 2e-3


SMALL_SHAPES = [  # (batch, kv_len, kv_lens): one per row of the default (v86) table
    (4, 256, None),  # aiter_bf16
    (32, 256, None),  # persistent page 2, 16 splits
    (64, 64, None),  # aiter_fp8, plain cast
    (72, 128, None),  # persistent page 2, 8 splits
    (4, 1032, None),  # persistent page 8, 16 splits
    (5, 1032, None),  # persistent page 8, 8 splits
    (3, 0, (1500, 1100, 1301)),  # ragged: the catch-all (page 1, per-tensor)
]


@pytest.mark.parametrize("batch,kv_len,kv_lens", SMALL_SHAPES)
def test_custom_kernel_runs_the_selected_row_accurately(loaded, batch, kv_len, kv_lens,
                                                        make_input, reference):
    mod = loaded.module
    data, expected = make_input(batch, kv_len, kv_lens=kv_lens)
    total_kv = data[1]["fp8"][0].shape[0]
    uniform = mod.declares_uniform_kv(batch, total_kv, data[4])
    row = mod.select_route(batch, total_kv // batch, uniform)
    out = mod.custom_kernel(data)
    assert mod.LAST_ROUTE == _label(row)
    assert _route_error(reference, out, expected) <= mod.ROUTE_INFO[row["route"]]["rel_l2_bound"]


def test_the_default_table_rows_are_all_reached_by_the_small_shapes(loaded, make_input):
    mod = loaded.module
    reached = []
    for batch, kv_len, kv_lens in SMALL_SHAPES:
        data, _ = make_input(batch, kv_len, kv_lens=kv_lens)
        total_kv = data[1]["fp8"][0].shape[0]
        uniform = mod.declares_uniform_kv(batch, total_kv, data[4])
        row = mod.select_route(batch, total_kv // batch, uniform)
        reached.append(mod.AITER_ROUTE_TABLE.index(row))
    assert reached == list(range(len(mod.AITER_ROUTE_TABLE)))


# ---------------------------------------------------------------------------------------------
# Caches: plans reused per shape, rebuilt for other lengths, never stale


def test_plans_are_reused_per_shape_and_built_per_shape(loaded, make_input):
    mod, double = loaded.module, loaded.aiter

    def run(batch, kv_len, seed):
        data, _ = make_input(batch, kv_len, seed=seed)
        return mod.aiter_a8w8_persistent_route(*data, page_size=2, num_kv_splits=4)

    mod._PLANS.clear()
    double.reset()
    run(8, 128, 1)
    run(8, 128, 2)
    assert double.CALLS["get_mla_metadata_v1"] == 1
    assert double.CALLS["get_mla_metadata_info_v1"] == 1
    assert double.CALLS["mla_decode_stage1_asm_fwd"] == 2 and double.CALLS["mla_reduce_v1"] == 2
    run(8, 256, 1)  # other lengths: a plan of its own
    assert double.CALLS["get_mla_metadata_v1"] == 2
    run(8, 128, 3)  # back to the first shape: still cached
    assert double.CALLS["get_mla_metadata_v1"] == 2
    assert len(mod._PLANS) == 2


def test_ragged_lengths_never_use_a_paged_plan_and_are_right(loaded, make_input, reference):
    """Same batch, same total and same config for two different ragged layouts: the plan must be
    rebuilt from each call's indptr, and no page size above 1 may be used."""
    mod, double = loaded.module, loaded.aiter
    layouts = [(1500, 1100, 1301), (1301, 1500, 1100), (100, 37, 64, 255, 3, 90, 17, 200)]
    for lens in layouts:
        data, expected = make_input(len(lens), 0, kv_lens=lens)
        double.reset()
        before = double.CALLS["get_mla_metadata_v1"]
        out = mod.custom_kernel(data)
        pages = [facts["page_size"] for _, facts in double.LOG if "page_size" in facts]
        assert pages and set(pages) == {1}, (mod.LAST_ROUTE, double.LOG)
        assert "'page_size': 2" not in mod.LAST_ROUTE and "'page_size': 8" not in mod.LAST_ROUTE
        if mod.LAST_ROUTE.startswith("aiter_a8w8_persistent"):
            assert double.CALLS["get_mla_metadata_v1"] == before + 1  # rebuilt every call
        row = mod.select_route(len(lens), sum(lens) // len(lens), False)
        bound = mod.ROUTE_INFO[row["route"]]["rel_l2_bound"]
        assert _route_error(reference, out, expected) <= bound, lens


def test_a_ragged_plan_is_never_reused_for_uniform_lengths_of_the_same_total(loaded, make_input,
                                                                           reference):
    mod = loaded.module
    for lens in ((1100, 1300), (1200, 1200), (1300, 1100), (1200, 1200)):
        data, expected = make_input(2, 0, kv_lens=lens)
        out = mod.aiter_a8w8_persistent_route(*data, page_size=1, num_kv_splits=8)
        assert reference.rel_l2_error(out, reference.ref_kernel_torch(data).double()) < 2e-3, lens


def test_paged_route_refuses_ragged_lengths(loaded, make_input):
    data, _ = make_input(4, 0, kv_lens=(64, 192, 128, 128))
    with pytest.raises(ValueError, match="page_size 2"):
        loaded.module.aiter_a8w8_persistent_route(*data, page_size=2, num_kv_splits=4)


def test_a_lying_config_gives_wrong_numbers_not_silence(loaded, make_input, reference):
    """The residual assumption made visible: ragged lengths whose total equals batch *
    config["kv_seq_len"] look uniform, the paged plan covers the wrong rows, and the double
    (like the kernel) returns wrong numbers. Honest configs (max length) never get here."""
    data, expected = make_input(4, 0, kv_lens=(64, 192, 128, 128))
    config = dict(data[4], kv_seq_len=128)  # 4 * 128 == total: declared uniform, wrongly
    lying = data[:4] + (config,)
    out = loaded.module.aiter_a8w8_persistent_route(*lying, page_size=2, num_kv_splits=4)
    assert reference.rel_l2_error(out, expected) > 0.2


# ---------------------------------------------------------------------------------------------
# Q to fp8: per-tensor scale vs the plain cast


def test_plain_cast_is_wrong_past_the_fp8_range_and_per_tensor_is_right(loaded, make_input,
                                                                       reference):
    """q scaled by 1000 (max|q| ~ 4000 > 448) with the KV scaled by 1/1000 (same scores): the
    plain cast saturates q and the output is far off; the per-tensor scale stays within bound."""
    mod = loaded.module
    data, _ = make_input(4, 128, seed=77)
    q = (data[0].float() * 1000).bfloat16()
    kv = (data[1]["bf16"].float() / 1000).bfloat16()
    scaled = (q, {"bf16": kv, "fp8": reference.quantize_fp8(kv)}) + data[2:]
    expected = reference.attention_float64(scaled)
    assert q.abs().max().item() > 448
    for route, params in (("aiter_fp8", {}),
                          ("aiter_a8w8_persistent", {"page_size": 2, "num_kv_splits": 4})):
        bound = mod.ROUTE_INFO[route]["rel_l2_bound"]
        right = mod.ROUTES[route](*scaled, q_scale_mode="per_tensor", **params)
        wrong = mod.ROUTES[route](*scaled, q_scale_mode="plain_cast", **params)
        assert reference.rel_l2_error(right, expected) <= bound
        assert reference.rel_l2_error(wrong, expected) > 0.3
    with pytest.raises(ValueError, match="q_scale_mode"):
        mod.aiter_fp8_route(*scaled, q_scale_mode="rounded")


def test_per_tensor_q_matches_the_reference_quantiser(loaded, make_input, reference):
    data, _ = make_input(4, 64)
    q_fp8, q_scale = loaded.module.quantize_q_fp8(data[0], torch.float8_e4m3fn, "per_tensor")
    ref_fp8, ref_scale = reference.quantize_fp8(data[0], dtype=torch.float8_e4m3fn)
    assert torch.equal(q_scale, ref_scale)
    assert torch.equal(q_fp8.view(torch.uint8), ref_fp8.view(torch.uint8))


# ---------------------------------------------------------------------------------------------
# Outputs are fresh tensors


@pytest.mark.parametrize("route,params", [
    ("aiter_bf16", {}),
    ("aiter_fp8", {"q_scale_mode": "plain_cast"}),
    ("aiter_a8w8_persistent", {"page_size": 2, "num_kv_splits": 4, "q_scale_mode": "plain_cast"}),
])
def test_each_call_returns_a_fresh_output(loaded, route, params, make_input):
    mod = loaded.module
    first_data, _ = make_input(4, 128, seed=1)
    second_data, _ = make_input(4, 128, seed=2)
    first = mod.ROUTES[route](*first_data, **params)
    kept = first.clone()
    second = mod.ROUTES[route](*second_data, **params)
    assert second is not first and second.data_ptr() != first.data_ptr()
    assert torch.equal(first, kept)  # the second call did not overwrite the first result
    assert not torch.equal(first, second)


def test_custom_kernel_outputs_are_fresh(loaded, make_input):
    mod = loaded.module
    first = mod.custom_kernel(make_input(32, 256, seed=1)[0])
    kept = first.clone()
    second = mod.custom_kernel(make_input(32, 256, seed=2)[0])
    assert second.data_ptr() != first.data_ptr() and torch.equal(first, kept)

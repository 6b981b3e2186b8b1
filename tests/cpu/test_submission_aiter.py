"""submission.py's aiter routes, proven against the strict aiter test double (tests/doubles/aiter_double).

Each configuration loads submission.py as a fresh module with the double first on sys.path;
sys.modules is restored afterwards. The double presents every aiter generation as aiter does:
compiled ops behind (*args, **kwargs) shims, their parameter names only in the schemas under
torch.ops.aiter, every call through torch.ops. It computes from the buffers it is given, so wrong
page maths, stale plans or wrong buffers give wrong numbers, which these tests measure against
float64 attention. Every aiter route runs strictly on every generation the double models, and so
does every row of the aiter table; the rest of the numerics run on the runner's generation
(f3be04a12), the one-day nope-names one and today's (aiter e4048607a, v0.1.20.post1).

The inputs live on the CPU, where the double computes; tests of the portable routes use the
default device (a GPU where there is one: the Triton routes need one unless interpreted).
"""
import importlib
import inspect
import random

import pytest
import torch

from aiter_double import loader  # tests/ is on sys.path: pytest's rootdir import

RUNNER_GENERATION = "2026-03-04"  # aiter f3be04a12 (16e9b5a07 on today's main)
TODAY_GENERATION = "2026-08-10"  # aiter 45ef304fe5 .. e4048607a (v0.1.20.post1)
# What submission.py must make of each generation the double models: whether stage 1 gets `lse`
# (positionally, before q_scale), whether the reduce gets `num_kv_splits`, which dtype names the
# metadata call uses, whether the info gets max_split_per_batch. Stated here, not read from the
# double: test_the_expectations_cover_every_generation_of_the_double keeps the two in step.
UNDERSTOOD = {
    "2026-03-04": {"lse": False, "reduce_splits": False, "dtypes": ("dtype_q", "dtype_kv"),
                   "info_cap": False},
    "2026-03-16": {"lse": True, "reduce_splits": False, "dtypes": ("dtype_q", "dtype_kv"),
                   "info_cap": False},
    "2026-06-11": {"lse": True, "reduce_splits": True, "dtypes": ("dtype_q", "dtype_kv"),
                   "info_cap": True},
    "2026-06-26": {"lse": True, "reduce_splits": True, "dtypes": ("dtype_q", "dtype_kv"),
                   "info_cap": True},
    "2026-07-13": {"lse": True, "reduce_splits": True, "dtypes": ("dtype_q_nope", "dtype_kv_nope"),
                   "info_cap": True},
    "2026-07-14": {"lse": True, "reduce_splits": True, "dtypes": ("dtype_q", "dtype_kv"),
                   "info_cap": True},
    TODAY_GENERATION: {"lse": True, "reduce_splits": True, "dtypes": ("dtype_q", "dtype_kv"),
                       "info_cap": True},
}
KNOWN_GENERATIONS = tuple(UNDERSTOOD)
NUMERICS_GENERATIONS = (RUNNER_GENERATION, "2026-07-13", TODAY_GENERATION)
AITER_ROUTES = ("aiter_bf16", "aiter_fp8", "aiter_a8w8_persistent", "aiter_a16w8_persistent")
FP8_MAX_E4M3FN = 448.0
_LOADED = {}


def _load(generation):
    """submission.py against the double of `generation`, one load per generation (tests that
    change a module's state clear what they change)."""
    if generation not in _LOADED:
        result = loader.load_submission(generation)
        assert result.module.HAVE_AITER, result.stderr
        _LOADED[generation] = result
    return _LOADED[generation]


# the aiter table as the runner's generation selects it, read once at collection
AITER_TABLE = _load(RUNNER_GENERATION).module.AITER_ROUTE_TABLE

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


@pytest.fixture(scope="module", params=NUMERICS_GENERATIONS)
def loaded(request):
    result = loader.load_submission(request.param)
    assert result.module.HAVE_AITER, result.stderr
    return result


@pytest.fixture(scope="module")
def runner_aiter():
    result = loader.load_submission(RUNNER_GENERATION)
    assert result.module.HAVE_AITER, result.stderr
    return result


def _route_error(reference, out, expected):
    assert out.dtype == torch.bfloat16 and out.shape == expected.shape
    assert torch.isfinite(out.float()).all()
    return reference.rel_l2_error(out, expected)


def _reference_error(reference, out, data):
    """Distance to the reference's own mathematics (fp8 q as the runner quantises it, fp8 KV,
    float32 softmax): an a8w8 route with per-tensor q computes exactly that, so a dropped row, a
    wrong page or a wrong split weight shows far above float32 / bf16 rounding."""
    return reference.rel_l2_error(out, reference.ref_kernel_torch(data).double())


def _a16w8_maths_error(reference, out, data):
    """Distance to the a16w8 kernel's own mathematics (bf16 q as given, the fp8 KV dequantised,
    the softmax exact): a dropped row, a wrong page or a wrong split weight shows far above
    bf16 rounding; so does a q rounded to fp8 (about 0.025)."""
    q, kv_data, qo_indptr, kv_indptr, config = data
    kv, kv_scale = kv_data["fp8"]
    dequantised = kv.double() * kv_scale.double().reshape(())
    exact = reference.attention_float64((q, {"bf16": dequantised}, qo_indptr, kv_indptr, config))
    return reference.rel_l2_error(out, exact)


def _label(row):
    return f"{row['route']} {row['params']}"


def _schema_names(double, op_name):
    return tuple(row[0] for row in double._api.API[op_name])


# ---------------------------------------------------------------------------------------------
# Import and API drift


def test_the_expectations_cover_every_generation_of_the_double():
    api = _load(RUNNER_GENERATION).aiter._api
    assert set(KNOWN_GENERATIONS) == set(api.GENERATIONS) - set(api.UNKNOWN_GENERATIONS)
    assert api.GENERATION_ALIASES["f3be04a12"] == api.GENERATION_ALIASES["16e9b5a07"] == (
        RUNNER_GENERATION)
    assert api.GENERATION_ALIASES["e4048607a"] == TODAY_GENERATION


@pytest.mark.parametrize("generation", KNOWN_GENERATIONS)
def test_import_reads_each_generation_from_the_op_schemas(generation):
    """The compiled ops hide their signatures, as aiter's do: the names the submission uses can
    only have come from the schemas under torch.ops.aiter (or, for the Python functions, from
    their signatures). Each name passed is a parameter of the op, at the op's own position
    where it is passed positionally."""
    result = loader.load_submission(generation)
    mod, double = result.module, result.aiter
    expected = UNDERSTOOD[generation]
    assert mod.HAVE_AITER is True and result.stderr == ""
    api = double._api
    wrapper = "_get_mla_metadata_v1_impl" in api.API
    for op_name in ("mla_decode_stage1_asm_fwd", "mla_reduce_v1", "get_mla_metadata_v1"):
        shown = str(inspect.signature(getattr(double, op_name)))
        if op_name == "get_mla_metadata_v1" and wrapper:  # a plain Python function there
            assert shown.startswith("(seqlens_qo_indptr: torch.Tensor"), shown
        else:
            assert shown == "(*args, **kwargs)"
    stage1 = mod.AITER_API["mla_decode_stage1_asm_fwd"]
    reduce = mod.AITER_API["mla_reduce_v1"]
    assert stage1 == _schema_names(double, "mla_decode_stage1_asm_fwd")[:len(stage1)]
    assert reduce == _schema_names(double, "mla_reduce_v1")[:len(reduce)]
    assert stage1[-2:] == ("q_scale", "kv_scale") and reduce[-2:] == ("final_output", "final_lse")
    assert ("lse" in stage1) == expected["lse"]
    assert len(stage1) == (20 if expected["lse"] else 19)
    assert ("num_kv_splits" in reduce) == expected["reduce_splits"]
    assert len(reduce) == (9 if expected["reduce_splits"] else 8)
    for op_name in ("get_mla_metadata_v1", "get_mla_metadata_info_v1"):
        names = mod.AITER_API[op_name]
        own = _schema_names(double, op_name)
        assert set(names) <= set(own), (op_name, set(names) - set(own))
        leading = len(mod.METADATA_POSITIONAL if op_name == "get_mla_metadata_v1"
                      else mod.INFO_POSITIONAL)
        assert names[:leading] == own[:leading]
    metadata = mod.AITER_API["get_mla_metadata_v1"]
    assert metadata[-2:] == expected["dtypes"]
    info = mod.AITER_API["get_mla_metadata_info_v1"]
    assert ("max_split_per_batch" in info) == expected["info_cap"]
    assert set(mod.ROUTES) >= set(AITER_ROUTES)
    assert mod.active_route_table() is mod.AITER_ROUTE_TABLE


def test_todays_aiter_presents_the_python_metadata_wrapper_over_a_compiled_op():
    """aiter from 028756633e: get_mla_metadata_v1 is a Python function (its full signature
    readable), the compiled op behind it is _get_mla_metadata_v1_impl with dtype ids; stage 1
    and mla_decode_fwd end with `causal`."""
    result = loader.load_submission(TODAY_GENERATION)
    mod, double = result.module, result.aiter
    wrapper = list(inspect.signature(double.get_mla_metadata_v1).parameters)
    assert wrapper[-8:] == ["is_cp_round_robin", "mla_version", "dtype_q_nope", "dtype_q_rope",
                            "dtype_kv_nope", "dtype_kv_rope", "dtype_q", "dtype_kv"]
    impl = _schema_names(double, "_get_mla_metadata_v1_impl")
    assert impl == tuple(wrapper[:-2])
    assert "get_mla_metadata_v1" not in double.PUBLIC_OPS
    assert "_get_mla_metadata_v1_impl" in double.PUBLIC_OPS
    assert _schema_names(double, "mla_decode_stage1_asm_fwd")[17:] == (
        "lse", "q_scale", "kv_scale", "g_kv_indptr", "cp_world_size", "cp_rank",
        "valid_split_count", "use_valid_split_count_reduce", "causal")
    assert list(inspect.signature(mod.mla_decode_fwd).parameters)[-4:] == [
        "g_kv_indptr", "cp_world_size", "cp_rank", "causal"]


@pytest.mark.parametrize("generation", KNOWN_GENERATIONS)
def test_mla_decode_fwd_has_the_generations_parameters(generation, make_input):
    """The aiter_bf16 / aiter_fp8 routes call it by keyword; what the double does not model
    (context parallelism) must stay at its default."""
    mod, double = _load(generation).module, _load(generation).aiter
    names = tuple(inspect.signature(mod.mla_decode_fwd).parameters)
    assert names == _schema_names(double, "mla_decode_fwd")
    assert names[:25] == _schema_names(_load(RUNNER_GENERATION).aiter, "mla_decode_fwd")
    if "cp_world_size" in names:
        data, _ = make_input(4, 64)
        q, kv_data, qo_indptr, kv_indptr, _ = data
        out = torch.empty(4, 16, 512, dtype=torch.bfloat16)
        with pytest.raises(double.ContractError, match="cp_world_size.*not modelled"):
            mod.mla_decode_fwd(q, kv_data["bf16"].view(-1, 1, 1, 576), out, qo_indptr,
                               kv_indptr, torch.arange(kv_indptr[-1].item(), dtype=torch.int32),
                               torch.ones(4, dtype=torch.int32), 1, cp_world_size=2)


ROUTE_SHAPES = [(4, 256, None), (3, 0, (300, 17, 200))]  # uniform (the reference's intra-batch
# plan for the persistent routes) and ragged (the balanced plan, refilled per call)
ROUTE_PARAMS = {"aiter_bf16": {}, "aiter_fp8": {"q_scale": "tensor"},
                "aiter_a8w8_persistent": {"page_size": 1, "num_splits": 8, "q_scale": "tensor"},
                "aiter_a16w8_persistent": {"page_size": 1, "num_splits": 8}}


def _own_maths_error(reference, route, out, data, expected):
    """Distance to what the route's kernels compute (see the helpers): far below any bound, so a
    dropped row, a wrong page, a wrong split weight or a value on the wrong parameter shows."""
    if route == "aiter_bf16":
        return reference.rel_l2_error(out, expected)  # bf16 q and KV: float64 attention itself
    if route == "aiter_a16w8_persistent":
        return _a16w8_maths_error(reference, out, data)
    return _reference_error(reference, out, data)


@pytest.mark.parametrize("route", AITER_ROUTES)
@pytest.mark.parametrize("generation", KNOWN_GENERATIONS)
def test_every_route_is_strict_on_every_generation(generation, route, make_input, reference):
    """Each aiter route through this generation's functions and ops (counted by the double),
    on uniform and ragged lengths, within its bound and next to its own mathematics."""
    mod, double = _load(generation).module, _load(generation).aiter
    bound = mod.ROUTE_INFO[route]["rel_l2_bound"]
    for batch, kv_len, kv_lens in ROUTE_SHAPES:
        data, expected = make_input(batch, kv_len, kv_lens=kv_lens)
        mod._PLANS.clear()
        double.reset()
        out = mod.ROUTES[route](*data, **ROUTE_PARAMS[route])
        assert _route_error(reference, out, expected) <= bound, (generation, route, kv_lens)
        own = _own_maths_error(reference, route, out, data, expected)
        assert own < (5e-3 if route == "aiter_bf16" else 2e-3), (generation, route, kv_lens, own)
        if route.endswith("_persistent"):
            assert double.CALLS["get_mla_metadata_info_v1"] == 1
            assert double.CALLS["get_mla_metadata_v1"] == 1
            assert double.CALLS["mla_decode_stage1_asm_fwd"] == double.CALLS["mla_reduce_v1"] == 1
            assert double.CALLS["mla_decode_fwd"] == 0
        else:
            assert double.CALLS["mla_decode_fwd"] == 1
            assert double.CALLS["mla_decode_stage1_asm_fwd"] == 0
        assert not _route_error(reference, torch.zeros_like(out), expected) <= bound


def test_the_ops_check_their_arguments_as_torch_ops_does(runner_aiter, make_input):
    """A call through the schema: a float where an int belongs, a missing argument and an
    unknown keyword are refused by the dispatcher before the double sees them."""
    double = runner_aiter.aiter
    data, _ = make_input(4, 64)
    q, kv_data, qo_indptr, kv_indptr, _ = data
    reduce_args = [torch.zeros(2, 1, 16, 512), torch.zeros(2, 1, 16, 1),
                   torch.zeros(5, dtype=torch.int32), None, torch.zeros(2, dtype=torch.int32)]
    out = torch.empty(4, 16, 512, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="max_seqlen_q"):
        double.mla_reduce_v1(*reduce_args, 1.0, out)
    with pytest.raises(RuntimeError):
        double.mla_reduce_v1(*reduce_args, 1)
    with pytest.raises(RuntimeError, match="num_kv_splits"):
        double.mla_reduce_v1(*reduce_args, 1, out, num_kv_splits=2)


@pytest.mark.parametrize("old_generation,new_generation", [
    ("2026-03-04", "2026-06-11"), ("2026-03-04", TODAY_GENERATION),
    ("2026-03-16", TODAY_GENERATION)])
def test_the_double_rejects_the_other_generations_argument_order(make_input, old_generation,
                                                                 new_generation):
    """What the drift detection protects against: an op called with the other generation's
    positional layout fails on the double (on the real library it would misbehave)."""
    old = loader.load_submission(old_generation)
    new = loader.load_submission(new_generation)
    data, _ = make_input(4, 64)
    swapped = 0
    for caller, callee in ((old, new), (new, old)):
        mod = caller.module
        for attribute, op_name in (("_stage1", "mla_decode_stage1_asm_fwd"),
                                   ("_reduce", "mla_reduce_v1")):
            if mod.AITER_API[op_name] == callee.module.AITER_API[op_name]:
                continue  # the same values in the same places: nothing to tell apart
            own = getattr(mod, attribute)
            setattr(mod, attribute, getattr(callee.aiter, op_name))
            swapped += 1
            try:
                with pytest.raises(RuntimeError):  # the dispatcher's or the double's
                    mod.aiter_a8w8_persistent_route(*data, page_size=2, num_splits=2)
            finally:
                setattr(mod, attribute, own)
        mod.aiter_a8w8_persistent_route(*data, page_size=2, num_splits=2)  # its own: fine
    assert swapped >= 2


@pytest.mark.parametrize("generation", [None, "2099-01"])
def test_without_a_known_aiter_the_portable_route_runs_after_one_warning(generation, reference):
    result = loader.load_submission(generation)
    mod = result.module
    assert mod.HAVE_AITER is False and mod.AITER_API is None
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "aiter routes off" in lines[0], result.stderr
    if generation is not None:
        assert "cu_mask" in lines[0]  # names what it did not understand
    assert not any(name.startswith("aiter_") for name in mod.ROUTES)
    assert mod.active_route_table() is mod.TRITON_ROUTE_TABLE
    data = reference.generate_input(2, 1, 48, 7)  # the default device: the routes' own
    out = mod.custom_kernel(data)
    row = mod.select_route(2, 48, True)
    assert row in mod.TRITON_ROUTE_TABLE and mod.LAST_ROUTE == mod.route_label(row)
    expected = reference.attention_float64(data)
    assert _route_error(reference, out, expected) <= mod.ROUTE_INFO[row["route"]]["rel_l2_bound"]


def _parameters(names, required=()):
    return [(name, name not in required) for name in names]


def test_a_metadata_api_this_file_cannot_call_is_refused(runner_aiter):
    """keyword_names decides what get_mla_metadata_v1 / _info_v1 get; what does not fit raises
    (and so turns the aiter routes off at import)."""
    mod = runner_aiter.module
    head, keywords = mod.METADATA_POSITIONAL, mod.METADATA_KEYWORDS
    pairs = mod.METADATA_DTYPE_KEYWORDS

    def names(params):
        return mod.keyword_names("get_mla_metadata_v1", params, head, keywords, pairs)

    base = list(head) + list(keywords)
    required = set(head)
    assert names(_parameters(base + ["dtype_q", "dtype_kv"], required))[-2:] == pairs[0]
    nope = names(_parameters(base + ["is_cp_round_robin", "dtype_q_nope", "dtype_kv_nope"],
                             required))
    assert nope[-2:] == pairs[1]
    both = _parameters(base + ["dtype_q_nope", "dtype_kv_nope", "dtype_q", "dtype_kv"], required)
    assert names(both)[-2:] == pairs[0]
    swapped = list(head)
    swapped[7], swapped[8] = swapped[8], swapped[7]  # work_indptr before work_info_set
    for bad, message in (
            (None, "unreadable"),
            (_parameters(swapped + list(keywords) + ["dtype_q", "dtype_kv"], required), "begin"),
            (_parameters(base + ["dtype_x"], required), "none of"),
            (_parameters(base[:-1] + ["dtype_q", "dtype_kv"], required), "intra_batch_mode"),
            (_parameters(base + ["dtype_q", "dtype_kv", "new"], required | {"new"}), "'new'")):
        with pytest.raises(RuntimeError, match=message):
            names(bad)
    info = mod.keyword_names("get_mla_metadata_info_v1",
                             _parameters(list(mod.INFO_POSITIONAL) + list(mod.INFO_KEYWORDS)
                                         + ["max_split_per_batch"], set(mod.INFO_POSITIONAL)),
                             mod.INFO_POSITIONAL, mod.INFO_KEYWORDS, (),
                             mod.INFO_OPTIONAL_KEYWORDS)
    assert info[-1] == "max_split_per_batch"


# ---------------------------------------------------------------------------------------------
# The double refuses what aiter refuses


def _persistent_call(mod, data, page_size=1, num_splits=4, q_format="fp8"):
    """(stage-1 arguments by name, plan) exactly as the persistent routes pass them: fp8 q with
    its per-tensor scale (aiter_a8w8_persistent) or bf16 q without one (aiter_a16w8_persistent)."""
    q, kv_data, qo_indptr, kv_indptr, config = data
    kv, kv_scale = kv_data["fp8"]
    batch, total_kv = qo_indptr.shape[0] - 1, kv.shape[0]
    uniform = mod.declares_uniform_kv(batch, total_kv, config)
    tables = mod.page_tables(batch, total_kv, config["kv_seq_len"], page_size, q.device)
    kv_page_indptr = kv_indptr if page_size == 1 else tables.kv_page_indptr
    if q_format == "fp8":
        q_in, q_scale = mod.quantize_q_fp8(q, kv.dtype, "tensor")
        q_in, q_scale = q_in.clone(), q_scale.clone()
    else:
        q_in, q_scale = q.clone(), None
    plan = mod.persistent_plan(qo_indptr, kv_page_indptr, tables.kv_last_page_lens, batch,
                               total_kv, config["kv_seq_len"], uniform, 1, page_size,
                               num_splits, q_in.dtype, kv.dtype, q.device)
    args = dict(
        Q=q_in, KV=kv.view(total_kv // page_size, page_size, 1, 576),
        qo_indptr=qo_indptr, kv_indptr=kv_page_indptr, kv_page_indices=tables.kv_page_ids,
        kv_last_page_lens=tables.kv_last_page_lens, num_kv_splits_indptr=None,
        work_meta_data=plan.work_meta_data, work_indptr=plan.work_indptr,
        work_info_set=plan.work_info_set, max_seqlen_q=1, page_size=page_size, nhead_kv=1,
        softmax_scale=mod.SM_SCALE, splitData=plan.partial_output, splitLse=plan.partial_lse,
        output=torch.empty(q.shape[0], 16, 512, dtype=torch.bfloat16), q_scale=q_scale,
        kv_scale=kv_scale)
    return args, plan


def test_the_persistent_call_as_the_route_makes_it_is_accepted(runner_aiter, make_input,
                                                               reference):
    mod, double = runner_aiter.module, runner_aiter.aiter
    data, _ = make_input(4, 256)
    args, plan = _persistent_call(mod, data)
    double.mla_decode_stage1_asm_fwd(**args)
    double.mla_reduce_v1(plan.partial_output, plan.partial_lse, plan.reduce_indptr,
                         plan.reduce_final_map, plan.reduce_partial_map, 1, args["output"])
    assert _reference_error(reference, args["output"], data) < 2e-3


@pytest.mark.parametrize("change,message", [
    ("split indptr with a plan", "NON-persistent"),
    ("non-contiguous Q", "contiguous"),
    ("no kv_scale", "kv_scale"),
    ("another plan's work_meta_data", "work_meta_data"),
    ("too few partial rows", "splitData"),
])
def test_the_double_refuses_what_aiter_refuses(runner_aiter, make_input, change, message):
    mod, double = runner_aiter.module, runner_aiter.aiter
    data, _ = make_input(4, 1024)  # long enough for several splits: partial rows in use
    args, plan = _persistent_call(mod, data)
    if change == "split indptr with a plan":
        args["num_kv_splits_indptr"] = torch.arange(5, dtype=torch.int32)
    elif change == "non-contiguous Q":
        args["Q"] = torch.empty(16, 4, 576, dtype=args["Q"].dtype).transpose(0, 1)
    elif change == "no kv_scale":
        args["kv_scale"] = None
    elif change == "another plan's work_meta_data":
        other, _ = _persistent_call(mod, make_input(4, 128)[0])
        args["work_meta_data"] = other["work_meta_data"]
    elif change == "too few partial rows":
        args["splitData"] = plan.partial_output[:1]
        args["splitLse"] = plan.partial_lse[:1]
    with pytest.raises(double.ContractError, match=message):
        double.mla_decode_stage1_asm_fwd(**args)


def test_the_double_refuses_a_scale_on_another_device(runner_aiter, make_input):
    """The kernel reads the scale through its address: it must be on Q's device. (Called below
    the dispatcher, which would refuse a meta tensor among CPU ones before the double sees it.)"""
    mod, double = runner_aiter.module, runner_aiter.aiter
    args, _ = _persistent_call(mod, make_input(4, 256)[0])
    args["q_scale"] = args["q_scale"].to("meta")
    with pytest.raises(double.ContractError, match="device|foreign"):
        double._double.stage1(**args)


def test_the_double_refuses_a_reduce_reading_outside_the_partials(runner_aiter, make_input):
    mod, double = runner_aiter.module, runner_aiter.aiter
    args, plan = _persistent_call(mod, make_input(4, 1024)[0], num_splits=4)
    double.mla_decode_stage1_asm_fwd(**args)
    assert plan.reduce_indptr[-1].item() > 0  # the plan splits: the reduce has work
    with pytest.raises(double.ContractError, match="outside partial_output"):
        double.mla_reduce_v1(plan.partial_output[:1], plan.partial_lse[:1], plan.reduce_indptr,
                             plan.reduce_final_map, plan.reduce_partial_map, 1, args["output"])


# reduce_partial_map's size at 8 batches with max_split_per_batch 64: not taken before ff61bb3997;
# tile_cnt * cap there, tile_cnt + cap from b5fceae834 (2026-06-22) on; cap = min(CUs, 64 * 8)
SPLIT_CAP_SIZES = {"2026-03-04": None, "2026-06-11": 8 * 256, "2026-06-26": 8 + 256,
                   TODAY_GENERATION: 8 + 256}


@pytest.mark.parametrize("generation", SPLIT_CAP_SIZES)
def test_the_info_returns_plain_ints_and_aiters_dtypes(generation):
    double = loader.load_submission(generation).aiter
    num_cu = double.NUM_CU
    fast = double.get_mla_metadata_info_v1(8, 1, 16, torch.float8_e4m3fn, torch.float8_e4m3fn,
                                           False, fast_mode=True, num_kv_splits=16,
                                           intra_batch_mode=False)
    intra = double.get_mla_metadata_info_v1(8, 1, 16, torch.float8_e4m3fn, torch.float8_e4m3fn,
                                            False, fast_mode=False, num_kv_splits=16,
                                            intra_batch_mode=True)
    for info in (fast, intra):
        assert isinstance(info, tuple) and len(info) == 6
        for shape, dtype in info:
            dims = shape if isinstance(shape, tuple) else (shape,)
            assert all(type(d) is int for d in dims), info
            assert dtype in (torch.uint64, torch.int32)
        assert info[0] == (2, torch.uint64) and info[1] == (num_cu + 1, torch.int32)
    assert fast[2][0] == (8 + num_cu - 1, 8) and fast[5][0] == 8 + num_cu - 1
    assert intra[2][0] == (8 * 16, 8) and intra[5][0] == 8 * 16
    assert num_cu == 256
    if SPLIT_CAP_SIZES[generation] is not None:  # the split cap enlarges the partial map
        capped = double.get_mla_metadata_info_v1(
            8, 1, 16, torch.float8_e4m3fn, torch.float8_e4m3fn, False, max_split_per_batch=64)
        assert capped[5][0] == SPLIT_CAP_SIZES[generation]
    else:
        with pytest.raises(TypeError):
            double.get_mla_metadata_info_v1(8, 1, 16, torch.float8_e4m3fn,
                                            torch.float8_e4m3fn, False, max_split_per_batch=64)


@pytest.mark.parametrize("generation", KNOWN_GENERATIONS)
def test_the_runners_reference_calls_run_on_the_double(make_input, reference, generation):
    """The runner's reference, call for call (reference.ref_kernel_aiter: intra-batch plan,
    is_causal, the batch lengths as last-page lengths), gives the reference's mathematics; a
    batch shorter than 196 makes aiter's intra-batch plan divide by zero, which the double
    refuses. On fede90f463 (2026-07-13) its dtype_q / dtype_kv keywords are refused, as that
    aiter refused them."""
    data, _ = make_input(4, 1024)
    short, _ = make_input(4, 100)
    with loader.aiter_environment(generation):
        import aiter

        if UNDERSTOOD[generation]["dtypes"] != ("dtype_q", "dtype_kv"):
            with pytest.raises(RuntimeError, match="dtype_q"):
                reference.ref_kernel_aiter(data)
            return
        out = reference.ref_kernel_aiter(data)
        facts = [f for name, f in aiter.LOG if name == "get_mla_metadata_v1"]
        with pytest.raises(aiter.ContractError, match="divides by zero"):
            reference.ref_kernel_aiter(short)
    assert facts[0]["intra_batch_mode"] and not facts[0]["fast_mode"] and facts[0]["is_causal"]
    assert _reference_error(reference, out, data) < 2e-3


# ---------------------------------------------------------------------------------------------
# The double's kernels: the (q, KV, heads, persistent, q length) combinations aiter f3be04a12 has
# on gfx950 (hsa/gfx950/mla/mla_asm.csv, chosen as csrc/py_itfs_cu/asm_mla.cu chooses)


@pytest.mark.parametrize("q_dtype,kv_dtype,persistent,q_len,kernel", [
    (torch.bfloat16, torch.float8_e4m3fn, True, 1, "mla_a16w8_qh16_m16x4_n16x1_coex0_mask1_ps"),
    (torch.bfloat16, torch.float8_e4m3fn, True, 4, "mla_a16w8_qh16_m16x4_n16x1_coex0_mask1_ps"),
    (torch.float8_e4m3fn, torch.float8_e4m3fn, True, 1, "mla_a8w8_qh16_qseqlen1_gqaratio16_ps"),
    (torch.float8_e4m3fn, torch.float8_e4m3fn, False, 1, "mla_a8w8_qh16_qseqlen1_gqaratio16"),
    (torch.float8_e4m3fn, torch.float8_e4m3fn, True, 3, "mla_a8w8_qh64_qseqlen4_gqaratio16_ps"),
    (torch.bfloat16, torch.bfloat16, False, 1, "mla_dec_stage1_bf16_a16w16_subQ16_mqa16"),
    (torch.bfloat16, torch.bfloat16, True, 1, "mla_a16w16_qh16_m16x4_n16x1_coex0_mask1_ps"),
])
def test_the_double_picks_aiters_kernel(runner_aiter, q_dtype, kv_dtype, persistent, q_len,
                                        kernel):
    double = runner_aiter.aiter._double
    assert double.asm_decode_kernel("fn", q_dtype, kv_dtype, 16, persistent, q_len) == kernel


@pytest.mark.parametrize("q_dtype,kv_dtype,persistent,q_len,message", [
    # bf16 q over fp8 KV: persistent only, q length at most 4 (padded to the kernel's 4)
    (torch.bfloat16, torch.float8_e4m3fn, False, 1, "cannot get heuristic kernel.*ps:0"),
    (torch.bfloat16, torch.float8_e4m3fn, True, 5, "cannot get heuristic kernel.*qseqlen:5"),
    (torch.float8_e4m3fn, torch.bfloat16, True, 1, "cannot get heuristic kernel.*kv_type:bf16"),
    (torch.bfloat16, torch.uint8, True, 1, "cannot get heuristic kernel.*kv_type:byte"),
    (torch.float8_e4m3fn, torch.float8_e4m3fn, True, 5, "qo_len <= 4"),
    (torch.float16, torch.float8_e4m3fn, True, 1, "unsupport Q dtype"),
    (torch.bfloat16, torch.float32, True, 1, "unsupport KV dtype"),
])
def test_the_double_refuses_combinations_without_a_gfx950_kernel(runner_aiter, q_dtype, kv_dtype,
                                                                  persistent, q_len, message):
    double = runner_aiter.aiter
    with pytest.raises(RuntimeError, match=message) as raised:  # aiter's TORCH_CHECK kind
        double._double.asm_decode_kernel("fn", q_dtype, kv_dtype, 16, persistent, q_len)
    assert isinstance(raised.value, double.ContractError)


def _byte_packed(kv_data):
    """The mxfp4 cache's bytes as a stage-1 KV buffer: (rows, 1, 1, 288) uint8."""
    data = kv_data["mxfp4"][0]
    return data.view(torch.uint8).view(data.shape[0], 1, 1, data.shape[-1])


@pytest.mark.parametrize("change,message", [
    ("without a plan (split indptr)", "cannot get heuristic kernel.*ps:0"),
    ("fp8 q over the bf16 KV", "cannot get heuristic kernel"),
    ("bf16 q over the packed mxfp4 bytes", "cannot get heuristic kernel.*kv_type:byte"),
    ("bf16 q over the fp4x2 cache", "head_size == KV.size"),
    ("q length 8", "cannot get heuristic kernel.*qseqlen:8"),
    ("no kv_scale", "kv_scale"),
])
def test_the_double_refuses_a16w8_calls_aiter_refuses(runner_aiter, make_input, change, message):
    """Stage 1 as the a16w8 route calls it, one thing changed: each fails as aiter fails (the
    call unchanged is accepted, below)."""
    mod, double = runner_aiter.module, runner_aiter.aiter
    data, _ = make_input(4, 256)
    args, _ = _persistent_call(mod, data, q_format="bf16")
    if change == "without a plan (split indptr)":
        args["num_kv_splits_indptr"] = torch.arange(5, dtype=torch.int32)
    elif change == "fp8 q over the bf16 KV":
        args["Q"], args["q_scale"] = mod.quantize_q_fp8(data[0], torch.float8_e4m3fn, "tensor")
        args["KV"] = data[1]["bf16"].view(-1, 1, 1, 576)
    elif change == "bf16 q over the packed mxfp4 bytes":
        args["KV"] = _byte_packed(data[1])
    elif change == "bf16 q over the fp4x2 cache":
        args["KV"] = data[1]["mxfp4"][0].view(-1, 1, 1, data[1]["mxfp4"][0].shape[-1])
    elif change == "q length 8":
        args["max_seqlen_q"] = 8
    elif change == "no kv_scale":
        args["kv_scale"] = None
    with pytest.raises(RuntimeError, match=message):
        double.mla_decode_stage1_asm_fwd(**args)


def test_mla_decode_fwd_refuses_bf16_q_over_fp8_kv_without_a_plan(runner_aiter, make_input):
    """aiter has no non-persistent a16w8 kernel: mla_decode_fwd without a work plan fails (the
    module's mla_decode_fwd is the double's, imported with it)."""
    data, _ = make_input(4, 64)
    q, kv_data, qo_indptr, kv_indptr, _ = data
    kv, kv_scale = kv_data["fp8"]
    out = torch.empty(4, 16, 512, dtype=torch.bfloat16)
    pages = torch.arange(kv.shape[0], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="cannot get heuristic kernel.*ps:0"):
        runner_aiter.module.mla_decode_fwd(q, kv.view(-1, 1, 1, 576), out, qo_indptr, kv_indptr,
                                           pages, torch.ones(4, dtype=torch.int32), 1,
                                           kv_scale=kv_scale)


def test_the_a16w8_call_as_the_route_makes_it_is_accepted(runner_aiter, make_input, reference):
    mod, double = runner_aiter.module, runner_aiter.aiter
    data, _ = make_input(4, 1024)
    args, plan = _persistent_call(mod, data, q_format="bf16")
    assert args["Q"].dtype == torch.bfloat16 and args["q_scale"] is None
    double.reset()
    double.mla_decode_stage1_asm_fwd(**args)
    double.mla_reduce_v1(plan.partial_output, plan.partial_lse, plan.reduce_indptr,
                         plan.reduce_final_map, plan.reduce_partial_map, 1, args["output"])
    (facts,) = [f for name, f in double.LOG if name == "mla_decode_stage1_asm_fwd"]
    assert facts["kernel"] == double._double.A16W8_KERNEL
    assert _a16w8_maths_error(reference, args["output"], data) < 2e-3


# ---------------------------------------------------------------------------------------------
# aiter as users install it today (e4048607a) and the generations on the way there


@pytest.fixture(scope="module")
def today_aiter():
    return _load(TODAY_GENERATION)


def test_todays_stage1_takes_lse_only_where_a_kernel_writes_it(today_aiter, make_input):
    """A non-None lse picks the kernel's lse build: the a8w8 kernel has one (and writes it),
    the a16w8 kernel has none, so aiter refuses the call. submission.py passes lse=None."""
    mod, double = today_aiter.module, today_aiter.aiter
    data, _ = make_input(4, 256)  # one split per batch: stage 1 writes output and lse itself
    args, _ = _persistent_call(mod, data)
    lse = torch.full((4, 16), float("nan"))
    double.reset()
    double.mla_decode_stage1_asm_fwd(**args, lse=lse)
    (facts,) = [f for name, f in double.LOG if name == "mla_decode_stage1_asm_fwd"]
    assert facts["kernel"] == "mla_a8w8_qh16_qseqlen1_gqaratio16_lse_ps"
    assert torch.isfinite(lse).all()
    bf16_args, _ = _persistent_call(mod, data, q_format="bf16")
    with pytest.raises(double.ContractError,
                       match="cannot get heuristic kernel.*q_type:bf16 kv_type:fp8.*lse:1"):
        double.mla_decode_stage1_asm_fwd(**bf16_args, lse=lse.clone())
    double.mla_decode_stage1_asm_fwd(**bf16_args)  # without lse: the a16w8 kernel runs


def test_lse_before_any_16_head_kernel_wrote_it_is_refused(make_input):
    result = _load("2026-03-16")
    args, _ = _persistent_call(result.module, make_input(4, 256)[0])
    with pytest.raises(result.aiter.ContractError, match="no 16-head q-length-1 kernel"):
        result.aiter.mla_decode_stage1_asm_fwd(**args, lse=torch.empty(4, 16))
    runner = _load(RUNNER_GENERATION)
    args, _ = _persistent_call(runner.module, make_input(4, 256)[0])
    with pytest.raises(RuntimeError, match="at most 19 argument"):  # the dispatcher's refusal
        runner.aiter.mla_decode_stage1_asm_fwd(**args, lse=torch.empty(4, 16))


@pytest.mark.parametrize("change,message", [
    ("the 2026-03-04 layout: q_scale, kv_scale right after output", "kv_scale"),
    ("kv_scale on lse", "'lse' has"),
    ("q_scale on g_kv_indptr", "'g_kv_indptr'.*not modelled"),
    ("cp_world_size 2", "'cp_world_size' = 2 is not modelled"),
    ("cp_rank 1", "'cp_rank' = 1 is not modelled"),
    ("valid_split_count given", "'valid_split_count'.*not modelled"),
    ("use_valid_split_count_reduce 1", "'use_valid_split_count_reduce' = 1 is not modelled"),
])
def test_todays_stage1_checks_each_value_by_its_parameter_name(today_aiter, make_input, change,
                                                               message):
    """Each value meets the checks of the parameter it lands on: one on the wrong parameter,
    or a context-parallel setting the double does not model, fails."""
    mod, double = today_aiter.module, today_aiter.aiter
    args, _ = _persistent_call(mod, make_input(4, 256)[0])
    q_scale, kv_scale = args["q_scale"], args["kv_scale"]
    if change.startswith("the 2026-03-04 layout"):
        args.update(lse=q_scale, q_scale=kv_scale, kv_scale=None)
    elif change == "kv_scale on lse":
        args.update(lse=kv_scale, kv_scale=q_scale.clone())
    elif change == "q_scale on g_kv_indptr":
        args.update(g_kv_indptr=q_scale, q_scale=torch.ones(1))
    elif change == "cp_world_size 2":
        args["cp_world_size"] = 2
    elif change == "cp_rank 1":
        args["cp_rank"] = 1
    elif change == "valid_split_count given":
        args["valid_split_count"] = torch.full((4,), 4, dtype=torch.int32)
    elif change == "use_valid_split_count_reduce 1":
        args["use_valid_split_count_reduce"] = 1
    with pytest.raises(RuntimeError, match=message):
        double.mla_decode_stage1_asm_fwd(**args)


def test_todays_stage1_runs_the_causal_kernel_either_way_at_q_length_1(today_aiter, make_input,
                                                                       reference):
    """aiter forces the causal kernel when max_seqlen_q is 1: causal=False gives the same."""
    mod, double = today_aiter.module, today_aiter.aiter
    data, _ = make_input(4, 256)
    outputs = []
    for causal in (True, False):
        args, _ = _persistent_call(mod, data)
        double.mla_decode_stage1_asm_fwd(**args, causal=causal)
        outputs.append(args["output"])
    assert torch.equal(outputs[0], outputs[1])
    assert _reference_error(reference, outputs[0], data) < 2e-3


def test_todays_reduce_needs_num_kv_splits_before_final_output(today_aiter, make_input):
    mod, double = today_aiter.module, today_aiter.aiter
    args, plan = _persistent_call(mod, make_input(4, 1024)[0])
    double.mla_decode_stage1_asm_fwd(**args)
    head = (plan.partial_output, plan.partial_lse, plan.reduce_indptr, plan.reduce_final_map,
            plan.reduce_partial_map, 1)
    with pytest.raises(RuntimeError, match="num_kv_splits"):  # no default: missing
        double.mla_reduce_v1(*head, final_output=args["output"])
    with pytest.raises(RuntimeError, match="num_kv_splits"):  # the 8-parameter layout
        double.mla_reduce_v1(*head, args["output"])
    double.mla_reduce_v1(*head, 4, args["output"])


def _metadata_call(plan, data, **extra):
    """get_mla_metadata_v1's arguments as submission.py passes them, with `extra` keywords."""
    q, kv_data, qo_indptr, kv_indptr, config = data
    last = torch.ones(qo_indptr.shape[0] - 1, dtype=torch.int32)
    head = (qo_indptr, kv_indptr, last, 16, 1, plan.setting["is_causal"], plan.work_meta_data,
            plan.work_info_set, plan.work_indptr, plan.reduce_indptr, plan.reduce_final_map,
            plan.reduce_partial_map)
    keywords = dict(page_size=1, kv_granularity=16, max_seqlen_qo=1, uni_seqlen_qo=1,
                    fast_mode=plan.setting["fast_mode"], max_split_per_batch=8,
                    intra_batch_mode=plan.setting["intra_batch_mode"])
    return head, dict(keywords, **extra)


@pytest.mark.parametrize("generation", ["2026-07-14", TODAY_GENERATION])
def test_the_python_metadata_wrapper_fills_nope_and_rope_from_the_legacy_names(generation,
                                                                              make_input):
    """aiter from 028756633e: dtype_q / dtype_kv fill the nope and rope dtypes; an explicit one
    wins; the four reach the compiled op as aiter's dtype ids. The double models one dtype for
    q and one for kv, so a rope unlike its nope, or a context-parallel plan, is refused."""
    result = _load(generation)
    mod, double = result.module, result.aiter
    data, _ = make_input(8, 256)
    fp8 = data[1]["fp8"][0].dtype
    mod._PLANS.clear()
    double.reset()
    mod.aiter_a16w8_persistent_route(*data, page_size=1, num_splits=8)
    (plan,) = mod._PLANS.values()

    def logged(**extra):
        double.reset()
        head, keywords = _metadata_call(plan, data, **extra)
        double.get_mla_metadata_v1(*head, **keywords)
        (facts,) = [f for name, f in double.LOG if name == "get_mla_metadata_v1"]
        return facts["dtype_q"], facts["dtype_kv"]

    assert logged(dtype_q=torch.bfloat16, dtype_kv=fp8) == (torch.bfloat16, fp8)
    assert logged(dtype_q_nope=fp8, dtype_kv_nope=fp8) == (fp8, fp8)  # rope: as nope
    assert logged(dtype_q=fp8, dtype_q_nope=fp8, dtype_kv=fp8) == (fp8, fp8)
    assert logged() == (torch.bfloat16, torch.bfloat16)  # aiter's default
    for extra, error, message in (
            ({"dtype_q": torch.bfloat16, "dtype_q_rope": fp8}, RuntimeError, "unlike"),
            ({"dtype_q": torch.float8_e4m3fnuz}, AssertionError, "Unsupported dtype"),
            ({"is_cp_round_robin": True}, RuntimeError, "is_cp_round_robin.*not modelled"),
            ({"mla_version": 1}, RuntimeError, "mla_version.*not modelled")):
        head, keywords = _metadata_call(plan, data, **extra)
        with pytest.raises(error, match=message):
            double.get_mla_metadata_v1(*head, **keywords)


@pytest.mark.parametrize("generation", ["2026-06-26", "2026-07-13"])
def test_the_compiled_metadata_ops_with_context_parallel_names(generation, make_input):
    """v0.1.17's compiled op: is_cp_round_robin after dtype_kv, no nope names; fede90f463's:
    the nope / rope names and no dtype_q. Both only at is_cp_round_robin's default."""
    result = _load(generation)
    mod, double = result.module, result.aiter
    data, _ = make_input(8, 256)
    mod._PLANS.clear()
    mod.aiter_a8w8_persistent_route(*data, page_size=1, num_splits=8)
    (plan,) = mod._PLANS.values()
    names = _schema_names(double, "get_mla_metadata_v1")
    fp8 = data[1]["fp8"][0].dtype
    own, other = ((("dtype_q", "dtype_kv"), ("dtype_q_nope", "dtype_kv_nope"))
                  if generation == "2026-06-26" else
                  (("dtype_q_nope", "dtype_kv_nope"), ("dtype_q", "dtype_kv")))
    assert set(own) <= set(names) and not set(other) & set(names)
    head, keywords = _metadata_call(plan, data, **dict.fromkeys(own, fp8))
    double.get_mla_metadata_v1(*head, **keywords)
    with pytest.raises(RuntimeError, match="is_cp_round_robin.*not modelled"):
        double.get_mla_metadata_v1(*head, **keywords, is_cp_round_robin=True)
    head, keywords = _metadata_call(plan, data, **dict.fromkeys(other, fp8))
    with pytest.raises(RuntimeError, match=other[0]):  # the dispatcher: no such argument
        double.get_mla_metadata_v1(*head, **keywords)


# ---------------------------------------------------------------------------------------------
# Plans: the reference's setting where the shapes allow it, the balanced one elsewhere


def _plan_facts(double):
    return [facts for name, facts in double.LOG if name == "get_mla_metadata_v1"]


@pytest.mark.parametrize("batch,kv_len,kv_lens,page_size,intra_batch", [
    (4, 256, None, 1, True),  # uniform, long enough: the runner's reference setting
    (4, 128, None, 1, False),  # too short for aiter's intra-batch plan
    (4, 256, None, 2, False),  # pages: the intra-batch plan ignores the page size
    (3, 0, (300, 17, 200), 1, False),  # ragged: one batch may be short
])
def test_the_plan_setting_follows_the_shapes(runner_aiter, make_input, reference, batch, kv_len,
                                             kv_lens, page_size, intra_batch):
    mod, double = runner_aiter.module, runner_aiter.aiter
    data, _ = make_input(batch, kv_len, kv_lens=kv_lens)
    double.reset()
    out = mod.aiter_a8w8_persistent_route(*data, page_size=page_size, num_splits=8,
                                          q_scale="tensor")
    (facts,) = _plan_facts(double)
    expected = mod.REFERENCE_PLAN if intra_batch else mod.BALANCED_PLAN
    assert {key: facts[key] for key in expected} == expected
    assert _reference_error(reference, out, data) < 2e-3


def test_the_info_gets_the_split_cap_where_it_takes_it(make_input):
    """aiter from 2026-06-11 sizes reduce_partial_map by max_split_per_batch: the plan's buffer
    shows whether it was passed."""
    sizes = {}
    for generation in SPLIT_CAP_SIZES:
        result = loader.load_submission(generation)
        data, _ = make_input(8, 128)
        result.module.aiter_a8w8_persistent_route(*data, page_size=1, num_splits=64)
        (plan,) = result.module._PLANS.values()
        sizes[generation] = plan.reduce_partial_map.shape[0]
        assert plan.partial_output.shape[0] == sizes[generation]  # sized as aiter's wrapper
    num_cu = loader.load_submission(RUNNER_GENERATION).aiter.NUM_CU
    # without the cap: the fast plan's own bound, batch + CUs - 1; with it, the larger of the two
    assert sizes == {generation: max(8 + num_cu - 1, size or 0)
                     for generation, size in SPLIT_CAP_SIZES.items()}


# ---------------------------------------------------------------------------------------------
# Numerics: every row's route with the row's parameters, and custom_kernel on small shapes


def _reduced_shape(row):
    """A small shape for running the row's route directly: at most 32 batches, a KV length that
    is a multiple of its page size (routes do not check the table's bounds)."""
    batch = min(row["max_batch"] or 32, 32)
    return batch, 256


def _row_id(index):
    row = AITER_TABLE[index]
    bounds = f"bs<={row['max_batch'] or 'any'},kv<={row['max_kv_len'] or 'any'}"
    return f"{index}:{bounds}:{row['route']}"


@pytest.mark.parametrize("row_index", range(len(AITER_TABLE)), ids=_row_id)
@pytest.mark.parametrize("generation", KNOWN_GENERATIONS)
def test_every_row_route_is_accurate(generation, row_index, make_input, reference):
    """Every row of the aiter table (its route with its own parameters) on every generation;
    a row with q_scale again with the per-tensor scale, next to the reference's mathematics."""
    mod = _load(generation).module
    assert mod.AITER_ROUTE_TABLE == AITER_TABLE  # the rows collected are this module's rows
    row = mod.AITER_ROUTE_TABLE[row_index]
    batch, kv_len = _reduced_shape(row)
    data, expected = make_input(batch, kv_len)
    out = mod.ROUTES[row["route"]](*data, **row["params"])
    bound = mod.ROUTE_INFO[row["route"]]["rel_l2_bound"]
    assert _route_error(reference, out, expected) <= bound, _label(row)
    if "q_scale" in row["params"]:
        params = dict(row["params"], q_scale="tensor")
        out = mod.ROUTES[row["route"]](*data, **params)
        assert _reference_error(reference, out, data) < 2e-3, _label(row)


SMALL_SHAPES = [  # (batch, kv_len, kv_lens): one or more per row of the default table
    (4, 256, None),  # aiter_bf16
    (32, 256, None),  # persistent, 16 splits (kv <= 1024)
    (64, 64, None),  # aiter_fp8, plain cast
    (72, 128, None),  # persistent, 8 splits (kv <= 1024)
    (4, 1032, None),  # persistent, 16 splits (bs <= 4)
    (3, 0, (1500, 1100, 1301)),  # ragged, bs <= 4: the same row
    (5, 1032, None),  # persistent, 8 splits (bs <= 32, kv <= 8192)
    (5, 8200, None),  # the catch-all (kv > 8192): per-tensor q, 32 splits
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
    assert mod.LAST_ROUTE == mod.route_label(row)
    assert _route_error(reference, out, expected) <= mod.ROUTE_INFO[row["route"]]["rel_l2_bound"]


LARGE_SHAPES = [  # the rows the small shapes cannot reach (selection only: no inputs are made)
    (256, 1024, None),  # the racing row of bs 256 / kv 1024
    (300, 16, None),  # persistent, 8 splits (kv <= 1024, bs > 256)
    (40, 1032, None),  # the racing row of bs 64 / kv 8192
    (200, 2048, None),  # the racing row of bs 256 / kv 8192
    (300, 2048, None),  # persistent, 8 splits (kv <= 8192, bs > 256)
]


def test_the_default_table_rows_are_all_reached(runner_aiter):
    mod = runner_aiter.module
    reached = set()
    for batch, kv_len, kv_lens in SMALL_SHAPES + LARGE_SHAPES:
        total_kv = sum(kv_lens) if kv_lens else batch * kv_len
        reached.add(mod.AITER_ROUTE_TABLE.index(mod.select_route(batch, total_kv // batch, kv_lens is None)))
    assert reached == set(range(len(mod.AITER_ROUTE_TABLE)))


# ---------------------------------------------------------------------------------------------
# aiter_a16w8_persistent: bf16 q over the fp8 KV, held to its own (tighter) bound

A16W8 = "aiter_a16w8_persistent"
A16W8_CASES = [  # (batch, kv_len, kv_lens, num_splits)
    (4, 64, None, 4),
    (8, 256, None, 16),
    (4, 1024, None, 16),  # several splits per batch: the reduce merges them
    (3, 0, (300, 17, 200), 8),  # ragged: the balanced plan, refilled per call
]


def _fresh_input(reference, batch, kv_len, kv_lens):
    """(seed, inputs, float64 attention) for a seed no other test uses (in failure messages)."""
    seed = random.SystemRandom().randrange(1, 2**31)
    data = reference.generate_input(batch, 1, kv_len, seed, kv_lens=kv_lens, device="cpu")
    return seed, data, reference.attention_float64(data)


def _poison_new_buffers(monkeypatch, mod):
    """Every float tensor the route allocates from here on starts as NaN (output, partials,
    lse): a row the kernels never write, or a partial the reduce reads unwritten, shows."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        tensor = empty(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    mod._PLANS.clear()
    monkeypatch.setattr(torch, "empty", nan_empty)


@pytest.mark.parametrize("batch,kv_len,kv_lens,num_splits", A16W8_CASES)
def test_a16w8_is_strictly_accurate_on_fresh_inputs(loaded, reference, monkeypatch, batch, kv_len,
                                                    kv_lens, num_splits):
    mod = loaded.module
    seed, data, expected = _fresh_input(reference, batch, kv_len, kv_lens)
    _poison_new_buffers(monkeypatch, mod)
    out = mod.aiter_a16w8_persistent_route(*data, page_size=1, num_splits=num_splits)
    monkeypatch.undo()
    bound = mod.ROUTE_INFO[A16W8]["rel_l2_bound"]
    assert _route_error(reference, out, expected) <= bound, seed
    assert _a16w8_maths_error(reference, out, data) < 2e-3, seed
    assert not _route_error(reference, torch.zeros_like(out), expected) <= bound  # zeros fail


@pytest.mark.parametrize("batch,kv_len", [(4, 64), (8, 256), (4, 1024)])
def test_a16w8_error_is_below_the_a8w8_routes_on_the_same_inputs(loaded, reference, batch,
                                                                 kv_len):
    """q is not rounded: only the fp8 KV costs accuracy (about 0.8x the a8w8 route's error on
    randn data); a route that rounded q to fp8 after all would not show this margin."""
    mod = loaded.module
    seed, data, expected = _fresh_input(reference, batch, kv_len, None)
    a16w8 = _route_error(reference, mod.aiter_a16w8_persistent_route(*data, num_splits=8),
                         expected)
    a8w8 = _route_error(reference, mod.aiter_a8w8_persistent_route(*data, num_splits=8,
                                                                   q_scale="tensor"), expected)
    assert a16w8 < 0.9 * a8w8, (seed, a16w8, a8w8)
    assert a8w8 <= mod.ROUTE_INFO["aiter_a8w8_persistent"]["rel_l2_bound"]


def test_a16w8_calls_the_a16w8_kernel_with_bf16_q_and_no_quantisation(runner_aiter, make_input,
                                                                      reference):
    mod, double = runner_aiter.module, runner_aiter.aiter
    data, _ = make_input(8, 256)
    mod._PLANS.clear()
    mod._Q_FP8.clear()
    double.reset()
    out = mod.aiter_a16w8_persistent_route(*data, page_size=1, num_splits=8)
    assert not mod._Q_FP8  # no q buffer: no quantisation launch
    (stage1,) = [f for name, f in double.LOG if name == "mla_decode_stage1_asm_fwd"]
    (plan,) = [f for name, f in double.LOG if name == "get_mla_metadata_v1"]
    assert stage1["kernel"] == double._double.A16W8_KERNEL
    assert (plan["dtype_q"], plan["dtype_kv"]) == (torch.bfloat16, data[1]["fp8"][0].dtype)
    assert double.CALLS["mla_decode_stage1_asm_fwd"] == double.CALLS["mla_reduce_v1"] == 1
    assert _a16w8_maths_error(reference, out, data) < 2e-3
    mod.aiter_a16w8_persistent_route(*data, page_size=1, num_splits=8)  # same shape: plan reused
    assert double.CALLS["get_mla_metadata_v1"] == 1 and len(mod._PLANS) == 1
    mod.aiter_a8w8_persistent_route(*data, page_size=1, num_splits=8)  # fp8 q: a plan of its own
    assert double.CALLS["get_mla_metadata_v1"] == 2 and len(mod._PLANS) == 2


@pytest.mark.parametrize("generation", KNOWN_GENERATIONS)
def test_every_generation_runs_the_a16w8_route(generation, make_input, reference):
    mod = loader.load_submission(generation).module
    assert A16W8 in mod.ROUTES
    for batch, kv_len, kv_lens in ((4, 256, None), (3, 0, (300, 17, 200))):
        data, expected = make_input(batch, kv_len, kv_lens=kv_lens)
        out = mod.ROUTES[A16W8](*data, page_size=1, num_splits=8)
        assert _a16w8_maths_error(reference, out, data) < 2e-3, (generation, kv_lens)
        assert _route_error(reference, out, expected) <= mod.ROUTE_INFO[A16W8]["rel_l2_bound"]


def test_a16w8_route_info_and_paged_refusal(runner_aiter, make_input):
    mod = runner_aiter.module
    info = mod.ROUTE_INFO[A16W8]
    assert {key: info[key] for key in ("kv_format", "q_format", "rel_l2_bound")} == {
        "kv_format": "fp8", "q_format": "bf16", "rel_l2_bound": 0.05}
    data, _ = make_input(4, 0, kv_lens=(64, 192, 128, 128))
    with pytest.raises(ValueError, match="aiter_a16w8_persistent: page_size 2"):
        mod.aiter_a16w8_persistent_route(*data, page_size=2, num_splits=4)


# ---------------------------------------------------------------------------------------------
# Caches: plans reused per shape, rebuilt for other lengths, never stale


@pytest.mark.parametrize("page_size,kv_lens", [(2, (128, 256)), (1, (256, 512))])
def test_plans_are_reused_per_shape_and_built_per_shape(runner_aiter, make_input, page_size,
                                                        kv_lens):
    mod, double = runner_aiter.module, runner_aiter.aiter

    def run(kv_len, seed):
        data, _ = make_input(8, kv_len, seed=seed)
        return mod.aiter_a8w8_persistent_route(*data, page_size=page_size, num_splits=4)

    first, second = kv_lens
    mod._PLANS.clear()
    double.reset()
    run(first, 1)
    run(first, 2)
    assert double.CALLS["get_mla_metadata_v1"] == 1
    assert double.CALLS["get_mla_metadata_info_v1"] == 1
    assert double.CALLS["mla_decode_stage1_asm_fwd"] == 2 and double.CALLS["mla_reduce_v1"] == 2
    run(second, 1)  # other lengths: a plan of its own
    assert double.CALLS["get_mla_metadata_v1"] == 2
    run(first, 3)  # back to the first shape: still cached
    assert double.CALLS["get_mla_metadata_v1"] == 2
    assert len(mod._PLANS) == 2


def test_ragged_lengths_never_use_a_paged_plan_and_are_right(runner_aiter, make_input,
                                                             reference):
    """Same batch, same total and same config for two different ragged layouts: the plan must be
    rebuilt from each call's indptr, and no page size above 1 may be used."""
    mod, double = runner_aiter.module, runner_aiter.aiter
    layouts = [(1500, 1100, 1301), (1301, 1500, 1100), (100, 37, 64, 255, 3, 90, 17, 200)]
    for lens in layouts:
        data, expected = make_input(len(lens), 0, kv_lens=lens)
        double.reset()
        out = mod.custom_kernel(data)
        pages = [facts["page_size"] for _, facts in double.LOG if "page_size" in facts]
        assert pages and set(pages) == {1}, (mod.LAST_ROUTE, double.LOG)
        assert mod.parse_route_label(mod.LAST_ROUTE)["params"].get("page_size", 1) == 1
        if mod.LAST_ROUTE.startswith("aiter_a8w8_persistent"):
            assert double.CALLS["get_mla_metadata_v1"] == 1  # rebuilt every call
        row = mod.select_route(len(lens), sum(lens) // len(lens), False)
        bound = mod.ROUTE_INFO[row["route"]]["rel_l2_bound"]
        assert _route_error(reference, out, expected) <= bound, lens


def test_a_ragged_plan_is_never_reused_for_uniform_lengths_of_the_same_total(runner_aiter,
                                                                           make_input,
                                                                           reference):
    mod = runner_aiter.module
    for lens in ((1100, 1300), (1200, 1200), (1300, 1100), (1200, 1200)):
        data, _ = make_input(2, 0, kv_lens=lens)
        out = mod.aiter_a8w8_persistent_route(*data, page_size=1, num_splits=8,
                                              q_scale="tensor")
        assert _reference_error(reference, out, data) < 2e-3, lens


def test_a_stale_plan_gives_wrong_numbers(runner_aiter, make_input, reference):
    """The double computes from the plan it is given: a plan built for other lengths of the same
    total reads the wrong rows for some batches."""
    mod, double = runner_aiter.module, runner_aiter.aiter
    data, _ = make_input(2, 0, kv_lens=(1100, 1300))
    stale, _ = make_input(2, 0, kv_lens=(1300, 1100))
    fresh_args, _ = _persistent_call(mod, stale)
    args, plan = _persistent_call(mod, data)  # ragged: the cached plan is refilled for `data`
    args.update(qo_indptr=fresh_args["qo_indptr"], kv_indptr=fresh_args["kv_indptr"],
                Q=fresh_args["Q"], q_scale=fresh_args["q_scale"], KV=fresh_args["KV"],
                kv_scale=fresh_args["kv_scale"])
    double.mla_decode_stage1_asm_fwd(**args)
    double.mla_reduce_v1(plan.partial_output, plan.partial_lse, plan.reduce_indptr,
                         plan.reduce_final_map, plan.reduce_partial_map, 1, args["output"])
    assert _reference_error(reference, args["output"], stale) > 0.2


def test_paged_route_refuses_ragged_lengths(runner_aiter, make_input):
    data, _ = make_input(4, 0, kv_lens=(64, 192, 128, 128))
    with pytest.raises(ValueError, match="page_size 2"):
        runner_aiter.module.aiter_a8w8_persistent_route(*data, page_size=2, num_splits=4)


def test_a_lying_config_gives_wrong_numbers_not_silence(runner_aiter, make_input, reference):
    """The residual assumption made visible: ragged lengths whose total equals batch *
    config["kv_seq_len"] look uniform, the paged plan covers the wrong rows, and the double
    (like the kernel) returns wrong numbers. Honest configs (max length) never get here."""
    data, expected = make_input(4, 0, kv_lens=(64, 192, 128, 128))
    config = dict(data[4], kv_seq_len=128)  # 4 * 128 == total: declared uniform, wrongly
    lying = data[:4] + (config,)
    out = runner_aiter.module.aiter_a8w8_persistent_route(*lying, page_size=2, num_splits=4)
    assert reference.rel_l2_error(out, expected) > 0.2


# ---------------------------------------------------------------------------------------------
# Q to fp8: per-tensor scale vs the plain cast


def test_unit_q_scale_is_wrong_past_the_fp8_range_and_tensor_scale_is_right(loaded, make_input,
                                                                       reference):
    """q scaled by 1000 (max|q| ~ 4000 > 448) with the KV scaled by 1/1000 (same scores): the
    plain cast saturates q or makes it NaN (torch builds differ) and the output is far off or
    not finite; the per-tensor scale stays within bound."""
    mod = loaded.module
    data, _ = make_input(4, 128, seed=77)
    q = (data[0].float() * 1000).bfloat16()
    kv = (data[1]["bf16"].float() / 1000).bfloat16()
    scaled = (q, {"bf16": kv, "fp8": reference.quantize_fp8(kv)}) + data[2:]
    expected = reference.attention_float64(scaled)
    assert q.abs().max().item() > FP8_MAX_E4M3FN
    for route, params in (("aiter_fp8", {}),
                          ("aiter_a8w8_persistent", {"page_size": 2, "num_splits": 4})):
        bound = mod.ROUTE_INFO[route]["rel_l2_bound"]
        right = mod.ROUTES[route](*scaled, q_scale="tensor", **params)
        wrong = mod.ROUTES[route](*scaled, q_scale="unit", **params)
        assert reference.rel_l2_error(right, expected) <= bound
        assert not reference.rel_l2_error(wrong, expected) <= 0.3  # NaN fails this too
    with pytest.raises(ValueError, match="q_scale"):
        mod.aiter_fp8_route(*scaled, q_scale="rounded")


@pytest.mark.parametrize("scale", [1.0, 1e-3, 300.0])
def test_per_tensor_q_matches_the_reference_quantiser(runner_aiter, make_input, reference,
                                                      scale):
    data, _ = make_input(4, 64)
    q = (data[0].float() * scale).bfloat16()
    for dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        q_fp8, q_scale = runner_aiter.module.quantize_q_fp8(q, dtype, "tensor")
        ref_fp8, ref_scale = reference.quantize_fp8(q, dtype=dtype)
        assert torch.equal(q_scale, ref_scale)
        assert torch.equal(q_fp8.view(torch.uint8), ref_fp8.view(torch.uint8))


# ---------------------------------------------------------------------------------------------
# Outputs are fresh tensors


@pytest.mark.parametrize("route,params", [
    ("aiter_bf16", {}),
    ("aiter_fp8", {"q_scale": "unit"}),
    ("aiter_a8w8_persistent", {"page_size": 1, "num_splits": 4, "q_scale": "unit"}),
    ("aiter_a8w8_persistent", {"page_size": 2, "num_splits": 4, "q_scale": "unit"}),
    ("aiter_a16w8_persistent", {"page_size": 1, "num_splits": 4}),
])
def test_each_call_returns_a_fresh_output(runner_aiter, route, params, make_input):
    mod = runner_aiter.module
    first_data, _ = make_input(4, 256, seed=1)
    second_data, _ = make_input(4, 256, seed=2)
    first = mod.ROUTES[route](*first_data, **params)
    kept = first.clone()
    second = mod.ROUTES[route](*second_data, **params)
    assert second is not first and second.data_ptr() != first.data_ptr()
    assert torch.equal(first, kept)  # the second call did not overwrite the first result
    assert not torch.equal(first, second)


def test_custom_kernel_outputs_are_fresh(runner_aiter, make_input):
    mod = runner_aiter.module
    first = mod.custom_kernel(make_input(32, 256, seed=1)[0])
    kept = first.clone()
    second = mod.custom_kernel(make_input(32, 256, seed=2)[0])
    assert second.data_ptr() != first.data_ptr() and torch.equal(first, kept)

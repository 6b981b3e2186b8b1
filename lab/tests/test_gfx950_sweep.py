"""lab/gfx950_sweep.py: the AMD knobs it adds to the compile plans, the grid, its pruning, the
eligibility rule and the ranking (pure parts, on synthetic records); the committed sweep results
match the kernels they were compiled from."""
import ast
import json

import pytest

import submission
from lab import gfx950_sweep as sw


def test_knobs_are_checked_and_added_to_a_plan_entry_as_compile_options():
    assert sw.knob_options(waves_per_eu=2, matrix_instr_nonkdim=None, kpack=1) == {"waves_per_eu": 2, "kpack": 1}
    for bad in ({"waves_per_eu": 9}, {"waves_per_eu": True}, {"matrix_instr_nonkdim": 8}, {"kpack": 0},
                {"num_warps": 4}):
        with pytest.raises(ValueError):
            sw.knob_options(**bad)
    (entry,) = submission.triton_compile_plan("triton_fp8", {"num_splits": 2})
    assert "options" not in entry and "targets" not in entry  # the product's plans carry no knob
    assert sw.with_knobs(entry, {}) == entry
    knobbed = sw.with_knobs(entry, {"waves_per_eu": 2, "matrix_instr_nonkdim": 16})
    assert knobbed["options"] == {"waves_per_eu": 2, "matrix_instr_nonkdim": 16}
    assert knobbed["targets"] == ["gfx950", "gfx942"] and "options" not in entry
    with pytest.raises(ValueError):
        sw.with_knobs(entry, {"waves_per_eu": 3.5})


def test_grid_prunes_only_what_cannot_be_honoured():
    points = sw.grid()
    assert len(points) == 3 * 3 * 2 * (3 + 2)  # block_n x stages x nonkdim x (4 warps: 3 wpe, 8 warps: 2)
    assert not [p for p in points if p["num_warps"] == 8 and p["waves_per_eu"] == 1]
    assert {p["block_n"] for p in points} == {32, 64, 128} and {p["num_stages"] for p in points} == {1, 2, 3}
    assert {p["matrix_instr_nonkdim"] for p in points} == {16, 32}


def test_racing_rows_and_params_round_trip():
    rows = sw.racing_rows(submission)
    assert [shape for _, shape, _, _ in rows] == [(4, 1024), (32, 1024), (64, 1024), (256, 1024),
                                                  (4, 8192), (32, 8192), (64, 8192), (256, 8192)]
    for index, _, num_splits, existing in rows:
        assert set(existing) == set(sw.KERNELS)
        row = submission.AITER_ROUTE_TABLE[index]
        assert existing["fp8"] in [c["params"] for c in row["candidates"]]
        assert all(p["num_splits"] == num_splits for p in existing.values())
    knobs = {"block_n": 32, "num_warps": 4, "num_stages": 1, "waves_per_eu": 2, "matrix_instr_nonkdim": 16}
    route, params, options = sw.sweep_point("mxfp4_e4m3", 4, knobs)
    assert route == "triton_mxfp4"
    assert params == {"num_splits": 4, "block_n": 32, "num_warps": 4, "num_stages": 1, "qk_dot_scaled": "e4m3"}
    assert options == {"waves_per_eu": 2}  # nonkdim 16 is the backend's own choice: left unset
    assert sw.knobs_of(params, options) == knobs
    label = submission.route_label({"route": route, "params": params})
    assert sw.point_key(route, params, options) == label + ' {"waves_per_eu":2}'
    assert sw.point_key(route, params, {}) == label


def record(route="triton_fp8", **over):
    params = {"num_splits": 2, "block_n": 64, "num_warps": 8, "num_stages": 3}
    params.update(over.pop("params", {}))
    base = {"route": route, "params": params, "options": {}, "compiled": True, "vgpr": 160, "agpr": 0, "vgpr_spills": 0,
            "scratch_bytes": 0, "spill_free": True, "lds_bytes": 75776, "lds_fits": True, "waves_per_simd": 2.0,
            "workgroups_per_cu": 1, "mma_loop": {"v_mfma_f32_16x16x128_f8f6f4 fp8.fp8": 8},
            "loads_loop": {"buffer_load_dwordx4": 4}, "load_widest_bits": 128, "asm_sha1": "a"}
    base.update(over)
    return base


def test_eligibility():
    existing = record()
    other = {"block_n": 32}
    assert sw.why_not("fp8", record(params=other, asm_sha1="b"), existing) is None
    assert sw.why_not("fp8", record(params=other, compiled=False), existing) == "does not compile"
    assert sw.why_not("fp8", record(params=other, spill_free=False, vgpr_spills=3), existing) == "spills"
    assert sw.why_not("fp8", record(params=other, lds_fits=False), existing) == "LDS > 160 KiB"
    assert sw.why_not("fp8", record(params=other, workgroups_per_cu=0), existing) == "no workgroup fits a CU"
    f16 = {"v_mfma_f32_16x16x32_f16 f16.f16": 8}
    assert sw.why_not("fp8", record(params=other, mma_loop=f16), existing) == "hot loop without its intended MFMA"
    assert sw.why_not("mxfp4_e4m3", record(params=other, mma_loop=f16), existing) == (
        "hot loop without its intended MFMA")
    assert sw.why_not("mxfp4_none", record(params=other, mma_loop=f16, asm_sha1="b"), existing) is None
    assert sw.why_not("fp8", record(params=other, load_widest_bits=64), existing).startswith("hot loop's loads")
    assert sw.why_not("fp8", record(options={"waves_per_eu": 2}, asm_sha1="c"), existing) == (
        "the existing candidate's tile")  # a scheduling hint alone is not a new configuration
    assert sw.why_not("fp8", record(options={"matrix_instr_nonkdim": 32}, asm_sha1="c"), existing) is None
    assert sw.why_not("fp8", record(params=other), existing) == "the existing candidate's code"


def test_ranking_follows_the_rows_grid():
    wide = record(params={"block_n": 128, "num_stages": 3}, workgroups_per_cu=1)
    two_small = record(params={"block_n": 64, "num_warps": 4, "num_stages": 3}, workgroups_per_cu=2)
    # one program per CU (a small grid): the program with more bytes ahead wins
    assert sw.in_flight_bytes(wide, 128) == 128 * 576 * 2 and sw.in_flight_bytes(two_small, 128) == 64 * 576 * 2
    assert sw.rank_key(wide, 1, 128) < sw.rank_key(two_small, 0, 128)
    # 512 programs: two resident per CU for the 4-warp tile, the same bytes ahead, more stages equal:
    # then more waves per SIMD decide (2 x 4 / 4 = 2 vs 1 x 8 / 4 = 2: a tie), then fewer registers
    assert sw.in_flight_bytes(two_small, 512) == sw.in_flight_bytes(wide, 512)
    lean = dict(two_small, vgpr=120)
    assert sw.rank_key(lean, 5, 512) < sw.rank_key(wide, 1, 512)
    assert sw.programs_per_cu(two_small, 100) == 1 and sw.programs_per_cu(two_small, 1000) == 2


def test_pick_takes_one_per_kernel_at_most_three_per_row():
    class Module:
        AITER_ROUTE_TABLE = [{"max_batch": 32, "max_kv_len": 1024, "route": "aiter_fp8", "params": {},
                              "candidates": [{"route": "triton_fp8", "params": record()["params"]}]}]

    def cache_with(vgpr_of):
        cache = {"records": {}}
        for i, knobs in enumerate(sw.grid()):
            route, params, options = sw.sweep_point("fp8", 2, knobs)
            cache["records"][sw.point_key(route, params, options)] = record(
                params=params, options=options, asm_sha1=str(i), spill_free=knobs["matrix_instr_nonkdim"] == 16,
                workgroups_per_cu=2 if knobs["num_warps"] == 4 else 1, vgpr=vgpr_of(knobs))
        return cache

    (row,) = sw.pick(Module, cache_with(lambda knobs: 160))
    assert row["programs"] == 64 and len(row["picks"]) == 1
    (chosen,) = row["picks"]
    assert chosen["params"] == {"num_splits": 2, "block_n": 128, "num_warps": 8, "num_stages": 3}
    assert chosen["record"]["options"] == {}
    # 45 points spill (nonkdim 32); the existing tile with and without waves_per_eu 2; the 26 other
    # spill-free points with waves_per_eu set are eligible but no route can take them
    assert row["rejected"]["fp8"] == {"spills": 45, "the existing candidate's tile": 2, "sets an AMD knob": 26}
    assert row["rejected"]["mxfp4_e4m3"] == {"not swept": 90}
    assert row["knob_ahead"] == {}  # the knob twins of the pick have the same figures
    # a knob point with fewer registers than the pick ranks ahead of it: reported, not picked
    (row,) = sw.pick(Module, cache_with(lambda knobs: 100 if knobs["waves_per_eu"] == 2 else 160))
    assert row["picks"][0]["params"] == chosen["params"]
    assert sw.record_knobs(row["knob_ahead"]["fp8"]) == {"block_n": 128, "num_warps": 8, "num_stages": 3,
                                                         "waves_per_eu": 2, "matrix_instr_nonkdim": 16}
    assert "ranks ahead of the pick but sets an AMD knob: bn128 w8 s3 wpe2 nk16" in sw.format_picks([row])


def test_committed_sweep_results_are_from_these_kernels():
    """lab/gfx950_sweep.json was compiled from the kernels in submission.py (rerun the sweep when a
    kernel changes: `python lab/gfx950_sweep.py --full-splits 1,2`)."""
    if not sw.DEFAULT_CACHE.exists():
        pytest.fail(f"{sw.DEFAULT_CACHE} missing: run lab/gfx950_sweep.py")
    cache = json.loads(sw.DEFAULT_CACHE.read_text())
    module = submission  # the interpreter's kernels hold the same source
    assert cache["kernels_source"] == sw.kernels_source_hash(module)
    assert cache["target"] == "gfx950"
    # the whole grid at split count 1, the matrix_instr_nonkdim 16 half at 2 (the default run's --full-splits 1,2)
    for num_splits, nonkdims in ((1, (16, 32)), (2, (16,))):
        for kernel_name in sw.KERNELS:
            for knobs in sw.grid():
                if knobs["matrix_instr_nonkdim"] in nonkdims:
                    assert sw.cached(cache, kernel_name, num_splits, knobs) is not None, (kernel_name, knobs)
    for key, r in cache["records"].items():
        assert key == sw.point_key(r["route"], r["params"], r["options"]) and "waves_per_eu" not in r["params"]
    # what the module docstring says of the 32 x 32 MFMA tiles: every one spills
    wide = [r for r in cache["records"].values() if r["options"].get("matrix_instr_nonkdim") == 32]
    assert wide and not [r for r in wide if r["compiled"] and r["spill_free"]]
    # waves_per_eu reached the compile: some points compiled to other code than their twin without it
    hinted = [r for r in cache["records"].values() if r["options"].get("waves_per_eu") and r["compiled"]]
    twins = [cache["records"].get(sw.point_key(r["route"], r["params"], sw.knob_options(
        **{k: v for k, v in r["options"].items() if k != "waves_per_eu"}))) for r in hinted]
    assert any(t is not None and t.get("asm_sha1") != r["asm_sha1"] for r, t in zip(hinted, twins, strict=True))


def test_the_picks_come_from_the_committed_results():
    """Every racing row gets at most three picks, each eligible, none the existing candidate's tile."""
    cache = json.loads(sw.DEFAULT_CACHE.read_text())
    picks = sw.pick(submission, cache)
    assert len(picks) == len(sw.racing_rows(submission))
    for row in picks:
        assert len(row["picks"]) <= sw.MAX_PICKS_PER_ROW
        for p in row["picks"]:
            assert sw.why_not(p["kernel"], p["record"], p["existing"]) is None and not p["record"]["options"]
            assert p["record"]["spill_free"] and p["params"]["num_splits"] == row["num_splits"]


def test_the_kernels_hash_follows_their_code_not_their_docstrings():
    def documented(x):
        """A docstring."""
        return x + 1  # a comment

    def bare(x):
        return x + 1

    def changed(x):
        return x + 2

    code = sw._code_of(documented)
    assert code == sw._code_of(bare).replace("'bare'", "'documented'")
    assert code != sw._code_of(changed).replace("'changed'", "'documented'")


def test_the_kernels_hash_is_the_same_on_every_python():
    """The canonical form leaves out empty and None fields, which is where Python versions' ASTs
    differ (3.12's FunctionDef.type_params, 3.13's dump): this text is what 3.10, 3.11, 3.12 and
    3.13 all give, so the committed hash holds on the runner's 3.12 and on a CPU's 3.11."""
    tree = ast.parse("def f(x, *, y=None) -> int:\n    return x[1:2] if y else -x")
    assert sw.canonical_ast(tree) == (
        "Module(body=[FunctionDef(name='f', args=arguments(args=[arg(arg='x')], kwonlyargs=[arg(arg='y')], "
        "kw_defaults=[Constant()]), body=[Return(value=IfExp(test=Name(id='y', ctx=Load()), "
        "body=Subscript(value=Name(id='x', ctx=Load()), slice=Slice(lower=Constant(value=1), "
        "upper=Constant(value=2)), ctx=Load()), orelse=UnaryOp(op=USub(), operand=Name(id='x', "
        "ctx=Load()))))], returns=Name(id='int', ctx=Load()))])")

"""tune.py: the sweep (interpreter, tiny shapes), eligibility, the cache, and the table rewrite.

The rewrite is only ever done on a COPY of submission.py in tmp_path; the real file's bytes are
compared before and after every test that writes. Device-independent: on a GPU the command-line
sweep runs on the GPU and its output is checked for the GPU's wording instead of the CPU's.
"""
import importlib.util
import json
import time
import types

import pytest
import torch

import tune
import utils

TINY_SPEC = "batchsize: 2; qseqlen: 1; kvseqlen: 64; seed: 11\nbatchsize: 2; qseqlen: 1; kvseqlen: 128; seed: 12\n"
TINY_SHAPES = [(2, 64, 11), (2, 128, 12)]


@pytest.fixture(scope="module", autouse=True)
def environment():
    utils.prepare_environment()


# ---------------------------------------------------------------------------------------------
# A fake submission: routes with known accuracy and speed


def _reference_out(q, kv_data, qo_indptr, kv_indptr, config):
    import reference

    return reference.ref_kernel((q, kv_data, qo_indptr, kv_indptr, config))


def slow_right(q, kv_data, qo_indptr, kv_indptr, config, delay=0.03):
    time.sleep(delay)
    return _reference_out(q, kv_data, qo_indptr, kv_indptr, config)


def fast_mismatched(q, kv_data, qo_indptr, kv_indptr, config):
    """3% of the elements off by 1: passes the runner's 5% rule, fails the tuner's 1%."""
    out = _reference_out(q, kv_data, qo_indptr, kv_indptr, config)
    flat = out.view(-1)
    flat[::33] += 1.0
    return out


def fast_blurred(q, kv_data, qo_indptr, kv_indptr, config):
    """Every element 15% too large: almost nothing outside rtol=atol=0.1, rel L2 far over bound."""
    return (_reference_out(q, kv_data, qo_indptr, kv_indptr, config).float() * 1.15).bfloat16()


def broken(q, kv_data, qo_indptr, kv_indptr, config):
    raise RuntimeError("this configuration does not compile")


def fake_submission(**routes):
    sub = types.ModuleType("fake_submission")
    sub.HAVE_AITER = False
    sub.ROUTES = dict(routes)
    sub.ROUTE_INFO = {name: {"kv_format": "fp8", "rel_l2_bound": 0.06} for name in routes}
    return sub


def _tune_fake(sub, cache=None, **kw):
    kw.setdefault("space", {"slow_right": {"delay": [0.03]}})
    return tune.tune(sub, [(2, 64, 11)], secret_bs=[3, 4], device="cpu", max_repeats=3,
                     cache=cache, time_all=True, **kw)


# ---------------------------------------------------------------------------------------------
# Candidates


def test_grid_expansion_drops_keys_a_route_does_not_take():
    def route(q, kv_data, qo_indptr, kv_indptr, config, a=1, b=2):
        return None

    sub = fake_submission(r=route)
    warnings = []
    configs = tune.route_configs(sub, "r", {"r": {"a": [1, 2], "b": [3], "zzz": [7, 8]}},
                                 warn=warnings.append)
    assert configs == [{"a": 1, "b": 3}, {"a": 2, "b": 3}]
    assert warnings and "zzz" in warnings[0]
    assert tune.expand_grid({}) == [{}]


def test_aiter_routes_only_where_have_aiter():
    sub = fake_submission(aiter_x=slow_right, triton_y=slow_right)
    assert tune.available_routes(sub, {"aiter_x": {}, "triton_y": {}}) == ["triton_y"]
    sub.HAVE_AITER = True
    assert tune.available_routes(sub, {"aiter_x": {}, "triton_y": {}}) == ["aiter_x", "triton_y"]
    with pytest.raises(tune.TuneError):
        tune.available_routes(sub, {}, only=["nope"])


def test_search_spaces_are_plain_data_and_quick_is_smaller():
    for space in (tune.SEARCH_SPACE, tune.QUICK_SEARCH_SPACE):
        json.dumps(space)  # data only
    full = sum(len(tune.expand_grid(g)) for g in tune.SEARCH_SPACE.values())
    quick = sum(len(tune.expand_grid(g)) for g in tune.QUICK_SEARCH_SPACE.values())
    assert quick * 10 < full
    assert set(tune.QUICK_SEARCH_SPACE) == set(tune.SEARCH_SPACE)


def test_preconditions_skip_pages_that_do_not_divide_and_empty_splits():
    sub = fake_submission(r=slow_right)
    assert tune.config_skip_reason(sub, "r", {"page_size": 8}, 4, 100) is not None
    assert tune.config_skip_reason(sub, "r", {"page_size": 4}, 4, 100) is None
    assert tune.config_skip_reason(sub, "r", {"num_splits": 8, "block_n": 64}, 4, 128) is not None
    assert tune.config_skip_reason(sub, "r", {"num_splits": 2, "block_n": 64}, 4, 128) is None


def test_seeds_are_the_runners_combination(repo_root):
    import utils

    bs = tune.draw_secret_seeds(3, 0)
    assert bs == tune.draw_secret_seeds(3, 0) and len(set(bs)) == 3
    assert tune.case_seeds(4217, bs) == [utils.combine_seed(4217, b) for b in bs]
    assert tune.case_seeds(5, [7]) == [5 + 12 * 13 // 2]
    assert tune.read_shapes(str(repo_root / "specs" / "tests.txt"))[0] == (4, 1024, 4220)


# ---------------------------------------------------------------------------------------------
# Eligibility


def test_a_wrong_configuration_is_never_chosen_even_when_fastest(tmp_path):
    sub = fake_submission(fast_mismatched=fast_mismatched, fast_blurred=fast_blurred,
                          slow_right=slow_right, broken=broken)
    result = _tune_fake(sub, space={"slow_right": {"delay": [0.03]}})
    (case,) = result["cases"]
    by_route = {r["route"]: r for r in case["records"]}
    slow = by_route["slow_right"]["timing"]["mean_ns"]
    assert by_route["fast_mismatched"]["timing"]["mean_ns"] < slow
    assert by_route["fast_blurred"]["timing"]["mean_ns"] < slow
    assert 0.01 < by_route["fast_mismatched"]["max_mismatch"] <= 0.05  # the runner would pass it
    assert "mismatch" in by_route["fast_mismatched"]["reason"]
    assert by_route["fast_blurred"]["max_mismatch"] <= 0.01  # only the strict bound catches it
    assert "rel L2" in by_route["fast_blurred"]["reason"]
    assert by_route["broken"]["error"] and not by_route["broken"]["eligible"]
    assert case["winner"]["route"] == "slow_right"
    rows = tune.build_table(sub, result)
    assert [r["route"] for r in rows] == ["slow_right", "slow_right"]
    text = tune.format_case(case)
    assert text.count("\n* slow_right") == 1 and "accuracy margin" in text


def test_no_eligible_configuration_means_no_table():
    sub = fake_submission(fast_mismatched=fast_mismatched)
    result = _tune_fake(sub, space={})
    assert result["cases"][0]["winner"] is None
    with pytest.raises(tune.TuneError, match="no eligible"):
        tune.build_table(sub, result)


# ---------------------------------------------------------------------------------------------
# Cache and stopping


def test_second_run_reads_the_cache_and_measures_nothing(tmp_path, monkeypatch):
    path = tmp_path / "cache.jsonl"
    sub = fake_submission(slow_right=slow_right, fast_mismatched=fast_mismatched)
    first = _tune_fake(sub, cache=tune.ResultCache(str(path)))
    assert first["measured"] == 2 and first["cached"] == 0
    assert len(path.read_text().splitlines()) == 2

    def must_not_measure(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(tune, "measure_config", must_not_measure)
    second = _tune_fake(sub, cache=tune.ResultCache(str(path)))
    assert second["measured"] == 0 and second["cached"] == 2
    assert second["cases"][0]["winner"]["params"] == first["cases"][0]["winner"]["params"]
    # another seed set is another key
    with pytest.raises(AssertionError, match="measured again"):
        tune.tune(sub, [(2, 64, 11)], space={}, secret_bs=[99], device="cpu",
                  cache=tune.ResultCache(str(path)))


def test_a_cut_line_in_the_cache_is_skipped(tmp_path):
    path = tmp_path / "cache.jsonl"
    path.write_text('{"key": "a", "x": 1}\n{"key": "b", "x"')
    assert set(tune.ResultCache(str(path)).records) == {"a"}


def test_deadline_stops_cleanly_before_measuring():
    sub = fake_submission(slow_right=slow_right)
    result = _tune_fake(sub, deadline=time.time() - 1)
    assert not result["complete"] and result["measured"] == 0
    assert "max-minutes" in result["stopped"]


# ---------------------------------------------------------------------------------------------
# The table and its rewrite


def _record(route, params, mean, eligible=True):
    return {"route": route, "params": params, "eligible": eligible, "timing": {"mean_ns": mean}}


def test_rows_sorted_by_kv_then_batch_and_catch_all_from_the_largest_shape():
    sub = fake_submission(a=slow_right, b=slow_right)
    cases = []
    for batch, kv_len, winner in ((64, 8192, ("a", {"page_size": 8})), (4, 1024, ("b", {})),
                                  (64, 1024, ("a", {"page_size": 2})), (4, 8192, ("b", {"x": 1}))):
        records = [_record(*winner, 1.0), _record("b", {"x": 2}, 2.0), _record("b", {"x": 0}, 0.5, False)]
        cases.append({"batch": batch, "kv_len": kv_len, "records": records, "winner": records[0]})
    rows = tune.build_table(sub, {"cases": cases})
    assert [(r["max_batch"], r["max_kv_len"]) for r in rows] == [
        (4, 1024), (64, 1024), (4, 8192), (64, 8192), (None, None)]
    assert rows[3]["params"] == {"page_size": 8}
    # the largest shape's winner is paged (not valid for every length): the fastest always-valid
    # eligible configuration of that shape is the catch-all
    assert rows[-1] == tune.table_row("b", {"x": 2})


def test_a_non_portable_winner_is_followed_by_the_fastest_portable_row_and_never_catches_all():
    sub = fake_submission(hw=slow_right, a=slow_right, b=slow_right)
    sub.ROUTE_INFO["hw"]["portable"] = False
    cases = []
    for batch, kv_len in ((4, 1024), (256, 8192)):
        records = [_record("hw", {"s": 1}, 0.5), _record("b", {"x": 1}, 1.0), _record("a", {}, 2.0),
                   _record("b", {"x": 0}, 0.1, False)]
        cases.append({"batch": batch, "kv_len": kv_len, "records": records, "winner": records[0]})
    rows = tune.build_table(sub, {"cases": cases})
    assert rows == [tune.table_row("hw", {"s": 1}, 4, 1024), tune.table_row("b", {"x": 1}, 4, 1024),
                    tune.table_row("hw", {"s": 1}, 256, 8192), tune.table_row("b", {"x": 1}, 256, 8192),
                    tune.table_row("b", {"x": 1})]
    only_hw = [{"batch": 4, "kv_len": 1024, "records": [_record("hw", {}, 0.5)], "winner": _record("hw", {}, 0.5)}]
    with pytest.raises(tune.TuneError, match="portable"):
        tune.build_table(sub, {"cases": only_hw})


def test_rewrite_accepts_a_hopper_row_followed_by_its_portable_row(sub_copy):
    """Off sm_90 the shape's own row is the portable one after the (absent) Hopper row."""
    rows = [tune.table_row("hopper_fp8", {"num_splits": 8}, 4, 1024), tune.table_row("triton_fp8", {}, 4, 1024),
            tune.table_row("triton_fp8", {})]
    new = tune.write_table(str(sub_copy), "TRITON_ROUTE_TABLE", rows, [(4, 1024)])
    assert tune.read_tables(new)["TRITON_ROUTE_TABLE"] == rows
    swapped = [rows[1], rows[0], rows[2]]  # a portable row first is fine too: it is selected
    tune.write_table(str(sub_copy), "TRITON_ROUTE_TABLE", swapped, [(4, 1024)])


def _outside(text, name):
    start, end = tune._block_span(text)
    block = text[start:end]
    a, b = tune._assignment_spans(block)[name]
    return text[:start + a], text[start + b:]


def test_rewrite_changes_only_the_chosen_literal(sub_copy):
    old = sub_copy.read_text()
    rows = [tune.table_row("triton_fp8", {}, 4, 1024), tune.table_row("triton_fp8", {}, 32, 8192),
            tune.table_row("triton_fp8", {})]
    new = tune.write_table(str(sub_copy), "TRITON_ROUTE_TABLE", rows, [(4, 1024), (32, 8192)])
    assert sub_copy.read_text() == new != old
    assert _outside(new, "TRITON_ROUTE_TABLE") == _outside(old, "TRITON_ROUTE_TABLE")
    compile(new, "submission.py", "exec")
    tables = tune.read_tables(new)
    assert tables["TRITON_ROUTE_TABLE"] == rows
    assert tables["AITER_ROUTE_TABLE"] == tune.read_tables(old)["AITER_ROUTE_TABLE"]
    # the aiter literal is byte-identical too
    assert _outside(new, "AITER_ROUTE_TABLE")[0].count("AITER_ROUTE_TABLE = [") == 0
    start, end = tune._block_span(old)
    a, b = tune._assignment_spans(old[start:end])["AITER_ROUTE_TABLE"]
    assert old[start + a:start + b] in new
    # long rows wrap onto a params line and still read back
    long_rows = [tune.table_row("triton_fp8", {"num_splits": 16, "block_n": 64, "num_warps": 8,
                                               "num_stages": 3, "qk_fp8": True})]
    again = tune.write_table(str(sub_copy), "TRITON_ROUTE_TABLE", long_rows)
    assert tune.read_tables(again)["TRITON_ROUTE_TABLE"] == long_rows
    assert max(len(line) for line in tune.format_table("T", long_rows).splitlines()) <= 100
    assert not list(sub_copy.parent.glob(".tune-*"))  # no temp file left


@pytest.mark.parametrize("rows, match", [
    ([tune.table_row("triton_fp8", {}, 4, 1024)], "catch-all"),
    ([tune.table_row("triton_fp8", {"page_size": 8})], "no route-table row"),
    ([tune.table_row("triton_fp8", {"x": float("nan")})], "cannot write"),
])
def test_rewrite_refuses_a_bad_table_and_leaves_the_file(sub_copy, rows, match):
    old = sub_copy.read_bytes()
    with pytest.raises(tune.TuneError, match=match):
        tune.write_table(str(sub_copy), "TRITON_ROUTE_TABLE", rows)
    assert sub_copy.read_bytes() == old
    assert not list(sub_copy.parent.glob(".tune-*"))


def test_target_table_follows_the_routes_tuned():
    assert tune.target_table(["triton_fp8"]) == "TRITON_ROUTE_TABLE"
    assert tune.target_table(["aiter_fp8", "triton_fp8"]) == "AITER_ROUTE_TABLE"
    assert tune.target_table(["aiter_fp8"], "TRITON_ROUTE_TABLE") == "TRITON_ROUTE_TABLE"


# ---------------------------------------------------------------------------------------------
# The command line on the real submission (a copy), Triton interpreter, tiny shapes


def test_cli_sweep_writes_json_chart_table_and_resumes(sub_copy, tmp_path, capsys):
    spec = tmp_path / "tiny.txt"
    spec.write_text(TINY_SPEC)
    grid = json.dumps({"triton_fp8": {"num_splits": [1, 2], "block_n": [32], "num_warps": [4],
                                      "num_stages": [1], "qk_fp8": [False]}})
    # --routes: only the grid's route (otherwise every other route of the machine is tuned with
    # its defaults, and on sm_90 a Hopper winner adds a portable row per shape to the table)
    argv = [str(spec), "--submission", str(sub_copy), "--grid", grid, "--routes", "triton_fp8",
            "--seeds", "2",
            "--repeats", "2", "--cache", str(tmp_path / "cache.jsonl"), "--json",
            str(tmp_path / "out.json"), "--chart", str(tmp_path / "chart.png"), "--write",
            "--no-progress"]
    old = sub_copy.read_text()
    assert tune.main(argv) == 0
    out = capsys.readouterr().out
    assert "accuracy margin" in out and f"device: {utils.device_name()}" in out
    if torch.cuda.is_available():  # --write without the runner's flush: the GPU's warning
        assert "CPU times mean nothing" not in out and "62.5 GiB flush" in out
    else:
        assert "CPU times mean nothing" in out
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["written"] and report["table_name"] == "TRITON_ROUTE_TABLE"
    assert report["measured"] == sum(len(c["records"]) for c in report["cases"]) > 0
    for case in report["cases"]:
        for rec in case["records"]:
            assert rec["call"] == "custom_kernel"  # timed exactly as the runner calls it
            assert len(rec["mismatch"]) == 2 and len(rec["rel_l2"]) == 2
    new = sub_copy.read_text()
    assert _outside(new, "TRITON_ROUTE_TABLE") == _outside(old, "TRITON_ROUTE_TABLE")
    rows = tune.read_tables(new)["TRITON_ROUTE_TABLE"]
    assert rows == report["table"]
    assert [(r["max_batch"], r["max_kv_len"]) for r in rows] == [(2, 64), (2, 128), (None, None)]
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:  # not installed everywhere (the lent H200): said, not drawn
        assert "no chart" in out and not (tmp_path / "chart.png").exists()

    assert tune.main(argv) == 0  # resumes: everything from the cache, same table
    report2 = json.loads((tmp_path / "out.json").read_text())
    assert report2["measured"] == 0 and report2["cached"] == report["measured"]
    assert tune.read_tables(sub_copy.read_text())["TRITON_ROUTE_TABLE"] == rows


def test_cli_max_minutes_zero_stops_with_exit_3_and_writes_nothing(sub_copy, tmp_path):
    spec = tmp_path / "tiny.txt"
    spec.write_text(TINY_SPEC)
    old = sub_copy.read_bytes()
    argv = [str(spec), "--submission", str(sub_copy), "--quick", "--no-cache", "--write",
            "--max-minutes", "0", "--no-progress"]
    assert tune.main(argv) == 3
    assert sub_copy.read_bytes() == old


def test_cli_bad_arguments_exit_2(tmp_path):
    assert tune.main([str(tmp_path / "missing.txt")]) == 2
    assert tune.main(["--rank-by", "nonsense"]) == 2


# ---------------------------------------------------------------------------------------------
# aiter routes, against the project's aiter test double (tests/aiter_double)


def _aiter_double_submission():
    from aiter_double import loader

    return loader.load_submission("2026-04").module


def test_aiter_routes_are_tuned_where_aiter_imports_and_fill_the_aiter_table(sub_copy):
    sub = _aiter_double_submission()
    assert sub.HAVE_AITER
    space = {"aiter_bf16": {}, "aiter_fp8": {"q_scale": ["tensor"]},
             "aiter_a8w8_persistent": {"page_size": [1, 8, 3], "num_splits": [2],
                                       "q_scale": ["tensor"]},
             "triton_fp8": {}}
    result = tune.tune(sub, [(2, 64, 11)], space=space, secret_bs=[3], device="cpu",
                       max_repeats=1, routes=["aiter_bf16", "aiter_fp8", "aiter_a8w8_persistent"])
    (case,) = result["cases"]
    tried = {(r["route"], r["params"].get("page_size")) for r in case["records"]}
    assert tried == {("aiter_bf16", None), ("aiter_fp8", None), ("aiter_a8w8_persistent", 1),
                     ("aiter_a8w8_persistent", 8)}  # page 3 does not divide kv 64: skipped
    assert all(r["eligible"] and r["call"] == "custom_kernel" for r in case["records"]), \
        [(r["route"], r["reason"]) for r in case["records"]]
    assert tune.target_table(result["routes"]) == "AITER_ROUTE_TABLE"
    rows = tune.build_table(sub, result)
    assert rows[-1]["params"].get("page_size", 1) == 1  # the catch-all holds for any lengths
    old = sub_copy.read_text()
    new = tune.write_table(str(sub_copy), "AITER_ROUTE_TABLE", rows, [(2, 64)])
    assert _outside(new, "AITER_ROUTE_TABLE") == _outside(old, "AITER_ROUTE_TABLE")
    assert tune.read_tables(new)["AITER_ROUTE_TABLE"] == rows

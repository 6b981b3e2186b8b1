"""tune.py --from-log: parsing submission.py's race lines, freezing them into fixed rows, the
command line, and the table writer's handling of rows with "candidates".

CPU only, no kernel runs: the command line is run on a COPY of submission.py in tmp_path (the real
file is guarded as in test_tune.py).
"""
import io

import pytest

import tune

LINE_RACED = ('submission.py race AITER_ROUTE_TABLE bs=32 kv=1024: [1] aiter_fp8 {"q_scale":"unit"} 18.2 us'
              ' | [2] aiter_a8w8_persistent {"page_size":1,"num_splits":8,"q_scale":"unit"} dropped (rel L2 0.81'
              ' > 0.06) | [3] triton_fp8 {"num_splits":4,"block_n":64} 15.1 us -> chosen [3] triton_fp8'
              ' {"num_splits":4,"block_n":64}')
LINE_BUDGET = ('submission.py race TRITON_ROUTE_TABLE bs=4 kv=8192: [1] hopper_fp8 {"num_splits":32} 16.5 us'
               ' -> chosen [1] hopper_fp8 {"num_splits":32}; budget: stopped after 1 of 3 candidates')
LINE_CATCH_ALL = ('submission.py race AITER_ROUTE_TABLE bs=4 kv=1024: [1] aiter_bf16 {} dropped (raised'
                  ' RuntimeError: x) -> chosen [catch-all] aiter_a8w8_persistent {"page_size":1,"num_splits":32,'
                  '"q_scale":"tensor"}; no candidate survived: the table\'s catch-all row runs')
A8W8_32 = {"page_size": 1, "num_splits": 32, "q_scale": "tensor"}


def _row(batch, kv_len, route, params=None, **extra):
    return dict(tune.table_row(route, params or {}, batch, kv_len), **extra)


# ---------------------------------------------------------------------------------------------
# Parsing


def test_parse_a_race_with_a_drop_and_a_faster_third():
    p = tune.parse_race_line(LINE_RACED)
    assert p == {
        "table": "AITER_ROUTE_TABLE", "batch": 32, "kv_len": 1024,
        "candidates": [
            {"index": 1, "route": "aiter_fp8", "params": {"q_scale": "unit"}, "time_us": 18.2, "dropped": None},
            {"index": 2, "route": "aiter_a8w8_persistent",
             "params": {"page_size": 1, "num_splits": 8, "q_scale": "unit"}, "time_us": None,
             "dropped": "rel L2 0.81 > 0.06"},
            {"index": 3, "route": "triton_fp8", "params": {"num_splits": 4, "block_n": 64}, "time_us": 15.1,
             "dropped": None},
        ],
        "chosen": 3, "route": "triton_fp8", "params": {"num_splits": 4, "block_n": 64},
        "budget": None, "no_survivor": False, "line": LINE_RACED,
    }
    assert list(p["candidates"][1]["params"]) == ["page_size", "num_splits", "q_scale"]  # the line's order


def test_parse_a_race_stopped_by_the_budget():
    p = tune.parse_race_line(LINE_BUDGET)
    assert p == {
        "table": "TRITON_ROUTE_TABLE", "batch": 4, "kv_len": 8192,
        "candidates": [{"index": 1, "route": "hopper_fp8", "params": {"num_splits": 32}, "time_us": 16.5,
                        "dropped": None}],
        "chosen": 1, "route": "hopper_fp8", "params": {"num_splits": 32},
        "budget": "stopped after 1 of 3 candidates", "no_survivor": False, "line": LINE_BUDGET,
    }


def test_parse_a_race_without_survivor_chooses_the_catch_all():
    p = tune.parse_race_line(LINE_CATCH_ALL)
    assert p == {
        "table": "AITER_ROUTE_TABLE", "batch": 4, "kv_len": 1024,
        "candidates": [{"index": 1, "route": "aiter_bf16", "params": {}, "time_us": None,
                        "dropped": "raised RuntimeError: x"}],
        "chosen": "catch-all", "route": "aiter_a8w8_persistent", "params": A8W8_32,
        "budget": None, "no_survivor": True, "line": LINE_CATCH_ALL,
    }
    both = LINE_CATCH_ALL.replace("; no candidate", "; budget: stopped after 1 of 2 candidates; no candidate")
    p = tune.parse_race_line(both)
    assert (p["budget"], p["no_survivor"], p["chosen"]) == ("stopped after 1 of 2 candidates", True, "catch-all")


def test_parse_finds_the_line_inside_junk_and_ignores_other_lines():
    pasted = f"  2025-01-02T03:04:05.678Z [stderr] {LINE_RACED}   \r"
    assert tune.parse_race_line(pasted) == tune.parse_race_line(LINE_RACED)
    assert tune.parse_race_line(f"{LINE_BUDGET} (benchmark 3 of 6)")["budget"] == "stopped after 1 of 3 candidates"
    for other in ("", "submission.py: aiter routes off", 'RACE_LINE = "submission.py race"',
                  "bs=32 kv=1024: [1] aiter_fp8 {} 1.0 us -> chosen [1] aiter_fp8 {}"):
        assert tune.parse_race_line(other) is None


@pytest.mark.parametrize("line, match", [
    (LINE_RACED.split(" -> chosen")[0], "chosen"),  # cut
    (LINE_RACED.replace("-> chosen [3]", "-> chosen [2]"), "dropped"),
    (LINE_RACED.replace("-> chosen [3]", "-> chosen [4]"), "not among"),
    (LINE_RACED.replace('chosen [3] triton_fp8 {"num_splits":4', 'chosen [3] triton_fp8 {"num_splits":8'), "names"),
    (LINE_RACED.replace('{"q_scale":"unit"} 18.2', '{"q_scale":"unit" 18.2'), "JSON"),
    (LINE_CATCH_ALL.replace("dropped (raised RuntimeError: x)", "3.0 us"), "catch-all"),
])
def test_a_race_line_that_disagrees_with_itself_raises(line, match):
    with pytest.raises(ValueError, match=match):
        tune.parse_race_line(line)


def test_read_race_lines_numbers_lines_and_skips_broken_ones():
    warnings = []
    text = f"header\n{LINE_RACED}\n{LINE_RACED[:80]}\nnoise\n{LINE_BUDGET}\n"
    found = tune.read_race_lines(text, warn=warnings.append)
    assert [(n, p["batch"]) for n, p in found] == [(2, 32), (5, 4)]
    assert len(warnings) == 1 and "line 3" in warnings[0]


# ---------------------------------------------------------------------------------------------
# Freezing


TABLES = {
    "AITER_ROUTE_TABLE": [
        _row(4, 1024, "aiter_bf16", candidates=[{"route": "aiter_fp8", "params": {"q_scale": "unit"}}]),
        _row(32, 1024, "aiter_fp8", {"q_scale": "unit"},
             candidates=[{"route": "aiter_a8w8_persistent", "params": {"page_size": 1, "num_splits": 8,
                                                                       "q_scale": "unit"}},
                         {"route": "triton_fp8", "params": {"num_splits": 4, "block_n": 64}}]),
        _row(None, None, "aiter_a8w8_persistent", A8W8_32),
    ],
    "TRITON_ROUTE_TABLE": [
        _row(4, 1024, "triton_fp8", {"num_splits": 8}),
        _row(None, None, "triton_fp8", {"num_splits": 2}),
    ],
}


def test_freezing_replaces_the_row_of_the_shape_and_drops_its_candidates():
    before = {k: [dict(r) for r in v] for k, v in TABLES.items()}
    new = tune.freeze_rows(TABLES, [tune.parse_race_line(LINE_RACED), tune.parse_race_line(LINE_CATCH_ALL)])
    assert TABLES == before  # not modified in place
    assert new["TRITON_ROUTE_TABLE"] == TABLES["TRITON_ROUTE_TABLE"]
    assert new["AITER_ROUTE_TABLE"] == [
        _row(4, 1024, "aiter_a8w8_persistent", A8W8_32),  # [catch-all] still freezes that route
        _row(32, 1024, "triton_fp8", {"num_splits": 4, "block_n": 64}),
        TABLES["AITER_ROUTE_TABLE"][2],
    ]


def test_freezing_inserts_before_the_first_matching_row_where_no_row_has_the_shape():
    import submission

    new = tune.freeze_rows(TABLES, [tune.parse_race_line(LINE_BUDGET.replace("hopper_fp8", "triton_fp8"))])
    rows = new["TRITON_ROUTE_TABLE"]
    fixed = _row(4, 8192, "triton_fp8", {"num_splits": 32})
    assert rows == [TABLES["TRITON_ROUTE_TABLE"][0], fixed, TABLES["TRITON_ROUTE_TABLE"][1]]
    assert submission.select_route(4, 8192, True, table=rows) is rows[1]
    assert submission.select_route(4, 1024, True, table=rows) is rows[0]  # others route as before
    # a shape inside an earlier row's bounds goes before that row
    small = tune.parse_race_line(LINE_RACED.replace("bs=32 kv=1024", "bs=2 kv=512"))
    rows = tune.freeze_rows(TABLES, [small])["AITER_ROUTE_TABLE"]
    assert rows[0] == _row(2, 512, "triton_fp8", {"num_splits": 4, "block_n": 64})
    assert submission.select_route(2, 512, True, table=rows) is rows[0]
    assert rows[1:] == TABLES["AITER_ROUTE_TABLE"]


def test_the_last_line_of_a_shape_wins():
    first = tune.parse_race_line(LINE_RACED)
    last = tune.parse_race_line(LINE_RACED.replace("-> chosen [3] triton_fp8 {\"num_splits\":4,\"block_n\":64}",
                                                   "-> chosen [1] aiter_fp8 {\"q_scale\":\"unit\"}"))
    kept, superseded = tune.last_per_shape([first, last])
    assert kept == [last] and superseded == [(0, 1)]
    rows = tune.freeze_rows(TABLES, [first, last])["AITER_ROUTE_TABLE"]
    assert rows[1] == _row(32, 1024, "aiter_fp8", {"q_scale": "unit"})
    assert len(rows) == len(TABLES["AITER_ROUTE_TABLE"])


def test_the_raced_row_is_the_one_whose_route_is_candidate_one():
    """A Hopper row and its portable follower share bounds; off sm_90 the follower raced."""
    rows = [_row(4, 8192, "hopper_fp8", {"num_splits": 32}), _row(4, 8192, "triton_fp8", {"num_splits": 8}),
            _row(None, None, "triton_fp8")]
    line = ('submission.py race TRITON_ROUTE_TABLE bs=4 kv=8192: [1] triton_fp8 {"num_splits":8} 20.0 us'
            ' | [2] triton_fp8 {"num_splits":16} 17.0 us -> chosen [2] triton_fp8 {"num_splits":16}')
    new = tune.freeze_rows({"TRITON_ROUTE_TABLE": rows}, [tune.parse_race_line(line)])["TRITON_ROUTE_TABLE"]
    assert new == [rows[0], _row(4, 8192, "triton_fp8", {"num_splits": 16}), rows[2]]


def test_a_frozen_non_portable_route_gets_a_portable_follower():
    rows = [_row(4, 8192, "triton_fp8", {"num_splits": 8}), _row(None, None, "triton_fp8")]
    line = ('submission.py race TRITON_ROUTE_TABLE bs=4 kv=8192: [1] triton_fp8 {"num_splits":8} 20.0 us'
            ' | [2] hopper_fp8 {"num_splits":16} 12.0 us | [3] triton_fp8 {"num_splits":16} 17.0 us'
            ' -> chosen [2] hopper_fp8 {"num_splits":16}')
    portable = {"hopper_fp8": False}
    new = tune.freeze_rows({"T_TABLE": rows}, [tune.parse_race_line(line.replace("TRITON_ROUTE_TABLE", "T_TABLE"))],
                           portable=lambda r: portable.get(r, True))["T_TABLE"]
    assert new == [_row(4, 8192, "hopper_fp8", {"num_splits": 16}),
                   _row(4, 8192, "triton_fp8", {"num_splits": 16}), rows[1]]  # the fastest portable one


def test_freezing_into_an_unknown_table_is_refused():
    line = LINE_RACED.replace("AITER_ROUTE_TABLE", "OTHER_TABLE")
    with pytest.raises(tune.TuneError, match="OTHER_TABLE"):
        tune.freeze_rows(TABLES, [tune.parse_race_line(line)])


# ---------------------------------------------------------------------------------------------
# The table writer and candidates


def test_rows_with_candidates_round_trip_within_120_characters(sub_copy):
    long_params = {"num_splits": 16, "block_n": 64, "num_warps": 8, "num_stages": 3, "qk_fp8": True,
                   "q_scale": "program"}
    rows = [
        _row(4, 1024, "triton_fp8", {"num_splits": 8},
             candidates=[{"route": "triton_fp8", "params": long_params},
                         {"route": "triton_mxfp4", "params": {}},
                         {"route": "aiter_a8w8_persistent", "params": {"page_size": 1, "num_splits": 8,
                                                                       "q_scale": "unit"}}]),
        _row(32, 8192, "triton_fp8", long_params, candidates=[{"route": "triton_fp8", "params": {"num_splits": 2}}]),
        _row(64, 8192, "triton_fp8", {}, candidates=[]),
        _row(None, None, "triton_fp8"),
    ]
    text = sub_copy.read_text()
    new = tune.replace_table_text(text, "TRITON_ROUTE_TABLE", rows)
    assert tune.read_tables(new)["TRITON_ROUTE_TABLE"] == rows
    literal = tune.format_table("TRITON_ROUTE_TABLE", rows)
    assert max(len(line) for line in literal.splitlines()) <= 120
    assert '         {"route": "triton_mxfp4", "params": {}},' in literal.splitlines()  # one per line
    # written for real: compiles, imports, and each shape selects its own row, candidates and all
    tune.write_table(str(sub_copy), "TRITON_ROUTE_TABLE", rows, [(4, 1024), (32, 8192), (64, 8192)])
    assert tune.read_tables(sub_copy.read_text())["TRITON_ROUTE_TABLE"] == rows


def test_rows_without_candidates_format_as_before():
    rows = [_row(4, 1024, "aiter_bf16"), _row(None, None, "aiter_a8w8_persistent", A8W8_32)]
    assert tune.format_table("T", rows) == (
        'T = [\n'
        '    {"max_batch": 4, "max_kv_len": 1024, "route": "aiter_bf16", "params": {}},\n'
        '    {"max_batch": None, "max_kv_len": None, "route": "aiter_a8w8_persistent",\n'
        '     "params": {"page_size": 1, "num_splits": 32, "q_scale": "tensor"}},\n'
        ']')


@pytest.mark.parametrize("row", [
    _row(None, None, "triton_fp8", note="x"),
    _row(None, None, "triton_fp8", candidates=[{"route": "triton_fp8", "params": {}, "why": 1}]),
])
def test_unknown_keys_are_refused_not_lost(row):
    with pytest.raises(tune.TuneError, match="cannot write the"):
        tune.format_table("T", [row])


def test_a_candidate_row_that_another_row_shadows_fails_the_routing_check(sub_copy):
    rows = [_row(64, 8192, "triton_fp8"), _row(4, 1024, "triton_fp8", {"num_splits": 8},
                                             candidates=[{"route": "triton_fp8", "params": {"num_splits": 2}}]),
            _row(None, None, "triton_fp8")]
    old = sub_copy.read_bytes()
    with pytest.raises(tune.TuneError, match="not its own row"):
        tune.write_table(str(sub_copy), "TRITON_ROUTE_TABLE", rows, [(4, 1024)])
    assert sub_copy.read_bytes() == old


def test_a_lone_non_portable_row_only_has_to_route_somewhere(sub_copy):
    """A frozen Hopper row with no portable follower known: off sm_90 its shape falls through to
    the next matching row, which the routing check accepts."""
    rows = [_row(4, 1024, "hopper_fp8", {"num_splits": 8}), _row(None, None, "triton_fp8")]
    tune.write_table(str(sub_copy), "TRITON_ROUTE_TABLE", rows, [(4, 1024)])
    assert tune.read_tables(sub_copy.read_text())["TRITON_ROUTE_TABLE"] == rows


# ---------------------------------------------------------------------------------------------
# The command line


def test_cli_writes_only_the_named_table_and_the_file_imports(sub_copy, tmp_path, capsys):
    import importlib.util

    before = tune.read_tables(sub_copy.read_text())
    bs, kv = next((r["max_batch"], r["max_kv_len"]) for r in before["TRITON_ROUTE_TABLE"]
                  if r["max_batch"] is not None and r["max_kv_len"] is not None)
    old_line = (f'submission.py race TRITON_ROUTE_TABLE bs={bs} kv={kv}: [1] triton_fp8 {{"num_splits":1}} 9.0 us'
                f' -> chosen [1] triton_fp8 {{"num_splits":1}}')
    new_line = old_line.replace('"num_splits":1', '"num_splits":2')
    log = tmp_path / "report.txt"
    log.write_text(f"Running benchmarks...\n12:00:01 {old_line}\n\n  {new_line}\nall done\n")
    assert tune.main(["--from-log", str(log), "--write", "--submission", str(sub_copy)]) == tune.EXIT_OK
    out = capsys.readouterr().out
    assert "superseded by line 4" in out and "line 4: TRITON_ROUTE_TABLE" in out and "written into" in out
    after = tune.read_tables(sub_copy.read_text())
    assert after["AITER_ROUTE_TABLE"] == before["AITER_ROUTE_TABLE"]
    assert after["TRITON_ROUTE_TABLE"] != before["TRITON_ROUTE_TABLE"]
    own = next(r for r in after["TRITON_ROUTE_TABLE"] if (r["max_batch"], r["max_kv_len"]) == (bs, kv)
               and r["route"] == "triton_fp8")
    assert own == _row(bs, kv, "triton_fp8", {"num_splits": 2})
    spec = importlib.util.spec_from_file_location("_from_log_check", sub_copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.TRITON_ROUTE_TABLE == after["TRITON_ROUTE_TABLE"]


def test_cli_without_write_prints_and_leaves_the_file(sub_copy, monkeypatch, capsys):
    old = sub_copy.read_bytes()
    monkeypatch.setattr("sys.stdin", io.StringIO(LINE_CATCH_ALL + "\n"))
    assert tune.main(["--from-log", "-", "--submission", str(sub_copy)]) == tune.EXIT_OK
    out = capsys.readouterr().out
    assert "[catch-all]" in out and "no candidate survived" in out
    assert "AITER_ROUTE_TABLE = [" in out and "TRITON_ROUTE_TABLE = [" not in out
    assert "not written" in out
    assert sub_copy.read_bytes() == old


def test_cli_exits_2_on_a_log_without_race_lines(sub_copy, tmp_path, capsys):
    log = tmp_path / "empty.txt"
    log.write_text("nothing raced here\nsubmission.py: aiter routes off\n")
    old = sub_copy.read_bytes()
    assert tune.main(["--from-log", str(log), "--write", "--submission", str(sub_copy)]) == tune.EXIT_BAD_ARGS
    assert "no race line" in capsys.readouterr().err
    assert tune.main(["--from-log", str(tmp_path / "missing.txt"), "--submission", str(sub_copy)]) == 2
    assert sub_copy.read_bytes() == old


def test_a_skipped_race_is_not_a_race_line():
    """A race the submission skipped (no bf16 cache to check against) froze nothing to read."""
    assert tune.parse_race_line('submission.py race skipped bs=4 kv=64: kv_data["bf16"] is missing; '
                                "the first candidate runs") is None

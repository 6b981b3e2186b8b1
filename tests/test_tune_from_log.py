"""tune.py --from-log: parsing submission.py's race lines, freezing them into fixed rows, the
command line, and the table writer's handling of rows with "candidates".

A race line carries times only (`[N] median/mean` or `[N] x why`) and the chosen candidate's route
and params; the other cells are named from the raced row of the submission's table.

CPU only, no kernel runs: the command line is run on a COPY of submission.py in tmp_path (the real
file is guarded as in test_tune.py).
"""
import io
import json

import pytest

import tune

HEAD = "submission.py race {table} bs={bs} kv={kv} (us median/mean): "
TRITON_S4 = {"num_splits": 4, "block_n": 64}
A8W8_8 = {"page_size": 1, "num_splits": 8, "q_scale": "unit"}
A8W8_32 = {"page_size": 1, "num_splits": 32, "q_scale": "tensor"}
LINE_RACED = (HEAD.format(table="AITER_ROUTE_TABLE", bs=32, kv=1024)
              + '[1] 18.2/18.9 | [2] x rel 0.81>0.06 | [3] 15.1/342.7 -> chosen [3] triton_fp8'
              ' {"num_splits":4,"block_n":64}')
BUDGET_NOTE = "budget: measuring stopped at the job's limit; rows not reached keep their first candidate"
LINE_BUDGET = (HEAD.format(table="TRITON_ROUTE_TABLE", bs=4, kv=8192)
               + '[1] 16.5/16.6 | [2] x not measured | [3] x not measured -> chosen [1] hopper_fp8'
               ' {"num_splits":32}; ' + BUDGET_NOTE)
NO_SURVIVOR_NOTE = "no candidate survived: the table's catch-all row runs"
LINE_CATCH_ALL = (HEAD.format(table="AITER_ROUTE_TABLE", bs=4, kv=1024)
                  + "[1] x raised RuntimeError: no kernel for this shape | [2] x died (signal 6: Memory"
                  " access fault by GPU node-2 (A -> chosen [catch-all] aiter_a8w8_persistent"
                  ' {"page_size":1,"num_splits":32,"q_scale":"tensor"}; ' + NO_SURVIVOR_NOTE)
NOT_MEASURED_NOTE = "not measured: the measuring process could not start (OSError: no python); the first candidate runs"
LINE_NOT_MEASURED = (HEAD.format(table="AITER_ROUTE_TABLE", bs=32, kv=1024)
                     + "[1] x not measured | [2] x not measured | [3] x not measured -> chosen [1] aiter_fp8"
                     ' {"q_scale":"unit"}; ' + NOT_MEASURED_NOTE)
NOT_RACE_LINES = [
    "submission.py race check AITER_ROUTE_TABLE bs=32 kv=1024: [3] triton_fp8 failed on this call's data"
    " -> [1] runs",
    "submission.py race AITER_ROUTE_TABLE: choices of 4 rows read from /tmp/mla-race-ab12.json (measured by"
    " an earlier process of this job)",
    'submission.py race skipped bs=4 kv=64: kv_data["bf16"] is missing; the first candidate runs',
    "submission.py race: further lines cut (3584 bytes a process)",
]


def _row(batch, kv_len, route, params=None, **extra):
    return dict(tune.table_row(route, params or {}, batch, kv_len), **extra)


def _cell(index, time_us=None, mean_us=None, dropped=None, route=None, params=None):
    return {"index": index, "time_us": time_us, "mean_us": mean_us, "dropped": dropped, "route": route,
            "params": params}


def _label(entrant):
    return f"{entrant['route']} {json.dumps(entrant['params'], separators=(',', ':'))}"


def _line_for(table, row, cells, chosen, note=None):
    """A race line for `row` of `table` as the submission prints it: `cells` are the cell texts
    after "[N] ", `chosen` a 1-based index into the row's entrants or a catch-all row."""
    entrants = [{"route": row["route"], "params": row["params"]}, *row["candidates"]]
    tag = f"[{chosen}] {_label(entrants[chosen - 1])}" if isinstance(chosen, int) else f"[catch-all] {_label(chosen)}"
    text = (HEAD.format(table=table, bs=row["max_batch"], kv=row["max_kv_len"])
            + " | ".join(f"[{i}] {c}" for i, c in enumerate(cells, 1)) + f" -> chosen {tag}")
    return text + (f"; {note}" if note else "")


# ---------------------------------------------------------------------------------------------
# Parsing


def test_parse_a_race_with_an_untimed_candidate_and_a_faster_third():
    p = tune.parse_race_line(LINE_RACED)
    assert p == {
        "table": "AITER_ROUTE_TABLE", "batch": 32, "kv_len": 1024,
        "candidates": [_cell(1, 18.2, 18.9), _cell(2, dropped="rel 0.81>0.06"), _cell(3, 15.1, 342.7)],
        "chosen": 3, "route": "triton_fp8", "params": TRITON_S4,
        "note": None, "budget": False, "no_survivor": False, "line": LINE_RACED,
    }
    assert list(p["params"]) == ["num_splits", "block_n"]  # the line's order


def test_parse_a_race_stopped_by_the_budget():
    p = tune.parse_race_line(LINE_BUDGET)
    assert p == {
        "table": "TRITON_ROUTE_TABLE", "batch": 4, "kv_len": 8192,
        "candidates": [_cell(1, 16.5, 16.6), _cell(2, dropped="not measured"), _cell(3, dropped="not measured")],
        "chosen": 1, "route": "hopper_fp8", "params": {"num_splits": 32},
        "note": BUDGET_NOTE, "budget": True, "no_survivor": False, "line": LINE_BUDGET,
    }


def test_parse_a_race_without_survivor_chooses_the_catch_all():
    p = tune.parse_race_line(LINE_CATCH_ALL)
    assert p == {
        "table": "AITER_ROUTE_TABLE", "batch": 4, "kv_len": 1024,
        "candidates": [_cell(1, dropped="raised RuntimeError: no kernel for this shape"),
                       _cell(2, dropped="died (signal 6: Memory access fault by GPU node-2 (A")],
        "chosen": "catch-all", "route": "aiter_a8w8_persistent", "params": A8W8_32,
        "note": NO_SURVIVOR_NOTE, "budget": False, "no_survivor": True, "line": LINE_CATCH_ALL,
    }
    both = tune.parse_race_line(f"{LINE_CATCH_ALL}; {BUDGET_NOTE}")
    assert (both["budget"], both["no_survivor"], both["chosen"]) == (True, True, "catch-all")
    early = tune.parse_race_line(f"{LINE_CATCH_ALL}; not measured: the measuring process ended early")
    assert (early["budget"], early["no_survivor"]) == (False, True)
    assert early["note"].endswith("ended early")


def test_parse_finds_the_line_inside_junk_and_ignores_other_lines():
    pasted = f"  2025-01-02T03:04:05.678Z [stderr] | {LINE_RACED}   \r"
    assert tune.parse_race_line(pasted) == tune.parse_race_line(LINE_RACED)
    assert tune.parse_race_line(f"12:00:01 stderr | {LINE_BUDGET}  ")["line"] == LINE_BUDGET
    trailing = tune.parse_race_line(f"{LINE_RACED} (benchmark 3 of 6)")
    assert (trailing["chosen"], trailing["params"], trailing["note"]) == (3, TRITON_S4, None)
    for other in ("", "submission.py: aiter routes off", 'RACE_LINE = "submission.py race"',
                  "bs=32 kv=1024 (us median/mean): [1] 1.0/1.0 -> chosen [1] aiter_fp8 {}"):
        assert tune.parse_race_line(other) is None


def test_the_submissions_other_race_lines_are_not_race_lines():
    """Checks on a call's data, choices read from an earlier process, a skipped race (no bf16
    cache to judge against) and the cut notice carry nothing to freeze."""
    for line in NOT_RACE_LINES:
        assert tune.parse_race_line(line) is None
        assert tune.parse_race_line(f"12:00:01 stderr | {line}") is None
    warnings = []
    assert tune.read_race_lines("\n".join(NOT_RACE_LINES), warn=warnings.append) == []
    assert warnings == []


@pytest.mark.parametrize("line, match", [
    (LINE_RACED.split(" -> chosen")[0], "chosen"),  # cut before the choice
    (LINE_RACED[:-5], "JSON"),  # cut inside the chosen params
    (LINE_RACED.replace("-> chosen [3]", "-> chosen [2]"), "not timed"),
    (LINE_RACED.replace("-> chosen [3]", "-> chosen [4]"), "not among"),
    (LINE_RACED.replace("-> chosen [3]", "-> chosen [0]"), "not among"),
    (LINE_RACED.replace('chosen [3] triton_fp8 {"num_splits"', 'chosen [3] triton_fp8 {num_splits'), "JSON"),
    (LINE_RACED.replace('{"num_splits":4,"block_n":64}', "[4, 64]"), "JSON object"),
    (LINE_RACED.replace("-> chosen [3] triton_fp8", "-> chosen [3]"), "chosen"),
    (LINE_CATCH_ALL.replace("x raised RuntimeError: no kernel for this shape", "3.0/3.1"), "catch-all"),
    (LINE_RACED.replace("[2] x rel", "[5] x rel"), "numbered"),
    (LINE_RACED.replace("[1] 18.2/18.9", "[1] 18.2 us"), "neither"),
    (LINE_RACED.replace("[1] 18.2/18.9", "[1] 18.2/nan"), "not a time"),
    (LINE_RACED.replace("[1] 18.2/18.9", "[1] abc/18.9"), "not a time"),
    (LINE_RACED.replace(" | [2] ", " |  [2] "), "neither"),
    (f"{LINE_RACED}; {NO_SURVIVOR_NOTE}", "survived"),
    ('submission.py race AITER_ROUTE_TABLE bs=32 kv=1024: [1] aiter_fp8 {"q_scale":"unit"} 18.2 us'
     ' -> chosen [1] aiter_fp8 {"q_scale":"unit"}', "older"),
])
def test_a_race_line_that_disagrees_with_itself_raises(line, match):
    with pytest.raises(ValueError, match=match):
        tune.parse_race_line(line)


def test_a_chosen_candidate_that_was_not_measured_is_refused():
    """The measuring process could not start, or the job's budget ran out before the row: the
    first candidate runs, but nothing was measured, so there is nothing to freeze."""
    for line in (LINE_NOT_MEASURED, LINE_BUDGET.replace("[1] 16.5/16.6", "[1] x not measured")):
        with pytest.raises(ValueError, match=r"chosen \[1\] was not timed \(not measured\).*not a measurement"):
            tune.parse_race_line(line)
    warnings = []
    found = tune.read_race_lines(f"{LINE_NOT_MEASURED}\n{LINE_RACED}\n", warn=warnings.append)
    assert [n for n, _ in found] == [2]
    assert len(warnings) == 1 and "line 1" in warnings[0] and "not a measurement" in warnings[0]


def test_read_race_lines_numbers_lines_and_skips_broken_ones():
    warnings = []
    cut = LINE_RACED[:LINE_RACED.index("[2]")]
    text = f"header\n{LINE_RACED}\n{cut}\nnoise\n{NOT_RACE_LINES[0]}\n{LINE_BUDGET}\n"
    found = tune.read_race_lines(text, warn=warnings.append)
    assert [(n, p["batch"]) for n, p in found] == [(2, 32), (6, 4)]
    assert len(warnings) == 1 and "line 3" in warnings[0]


# ---------------------------------------------------------------------------------------------
# Freezing


TABLES = {
    "AITER_ROUTE_TABLE": [
        _row(4, 1024, "aiter_bf16", candidates=[{"route": "aiter_fp8", "params": {"q_scale": "unit"}}]),
        _row(32, 1024, "aiter_fp8", {"q_scale": "unit"},
             candidates=[{"route": "aiter_a8w8_persistent", "params": A8W8_8},
                         {"route": "triton_fp8", "params": TRITON_S4}]),
        _row(None, None, "aiter_a8w8_persistent", A8W8_32),
    ],
    "TRITON_ROUTE_TABLE": [
        _row(4, 1024, "triton_fp8", {"num_splits": 8}),
        _row(None, None, "triton_fp8", {"num_splits": 2}),
    ],
}


def test_freezing_replaces_the_raced_row_and_drops_its_candidates():
    before = {k: [dict(r) for r in v] for k, v in TABLES.items()}
    new = tune.freeze_rows(TABLES, [tune.parse_race_line(LINE_RACED), tune.parse_race_line(LINE_CATCH_ALL)])
    assert TABLES == before  # not modified in place
    assert new["TRITON_ROUTE_TABLE"] == TABLES["TRITON_ROUTE_TABLE"]
    assert new["AITER_ROUTE_TABLE"] == [
        _row(4, 1024, "aiter_a8w8_persistent", A8W8_32),  # [catch-all] still freezes that route
        _row(32, 1024, "triton_fp8", TRITON_S4),
        TABLES["AITER_ROUTE_TABLE"][2],
    ]


def test_the_raced_rows_entrants_name_the_cells():
    parsed = tune.parse_race_line(LINE_RACED)
    index, labelled = tune.label_race_cells(TABLES["AITER_ROUTE_TABLE"], parsed)
    assert index == 1
    assert labelled["candidates"] == [
        _cell(1, 18.2, 18.9, route="aiter_fp8", params={"q_scale": "unit"}),
        _cell(2, dropped="rel 0.81>0.06", route="aiter_a8w8_persistent", params=A8W8_8),
        _cell(3, 15.1, 342.7, route="triton_fp8", params=TRITON_S4),
    ]
    assert parsed == tune.parse_race_line(LINE_RACED)  # a copy is labelled
    _, action = tune.freeze_row(TABLES["AITER_ROUTE_TABLE"], parsed)
    assert action["parsed"]["candidates"] == labelled["candidates"]
    assert (action["index"], action["replaced"]) == (1, TABLES["AITER_ROUTE_TABLE"][1])


def test_freezing_inserts_before_the_first_matching_row_where_no_row_has_the_shape():
    import submission

    parsed = tune.parse_race_line(LINE_BUDGET.replace("hopper_fp8", "triton_fp8"))
    new = tune.freeze_rows(TABLES, [parsed])
    rows = new["TRITON_ROUTE_TABLE"]
    fixed = _row(4, 8192, "triton_fp8", {"num_splits": 32})
    assert rows == [TABLES["TRITON_ROUTE_TABLE"][0], fixed, TABLES["TRITON_ROUTE_TABLE"][1]]
    assert submission.select_route(4, 8192, True, table=rows) is rows[1]
    assert submission.select_route(4, 1024, True, table=rows) is rows[0]  # others route as before
    _, action = tune.freeze_row(TABLES["TRITON_ROUTE_TABLE"], parsed)
    assert action["replaced"] is None and all(c["route"] is None for c in action["parsed"]["candidates"])
    # a shape inside an earlier row's bounds goes before that row
    small = tune.parse_race_line(LINE_RACED.replace("bs=32 kv=1024", "bs=2 kv=512"))
    rows = tune.freeze_rows(TABLES, [small])["AITER_ROUTE_TABLE"]
    assert rows[0] == _row(2, 512, "triton_fp8", TRITON_S4)
    assert submission.select_route(2, 512, True, table=rows) is rows[0]
    assert rows[1:] == TABLES["AITER_ROUTE_TABLE"]


def test_the_last_line_of_a_shape_wins():
    first = tune.parse_race_line(LINE_RACED)
    last = tune.parse_race_line(LINE_RACED.replace('-> chosen [3] triton_fp8 {"num_splits":4,"block_n":64}',
                                                   '-> chosen [1] aiter_fp8 {"q_scale":"unit"}'))
    kept, superseded = tune.last_per_shape([first, last])
    assert kept == [last] and superseded == [(0, 1)]
    rows = tune.freeze_rows(TABLES, [first, last])["AITER_ROUTE_TABLE"]
    assert rows[1] == _row(32, 1024, "aiter_fp8", {"q_scale": "unit"})
    assert len(rows) == len(TABLES["AITER_ROUTE_TABLE"])


def test_the_raced_row_is_the_one_whose_entrants_fit_the_line():
    """A Hopper row and its portable follower share bounds; off sm_90 the follower raced: the
    number of cells and the chosen entry tell which row the line belongs to."""
    s16 = {"route": "triton_fp8", "params": {"num_splits": 16}}
    s32 = {"route": "triton_fp8", "params": {"num_splits": 32}}
    rows = [_row(4, 8192, "hopper_fp8", {"num_splits": 32}, candidates=[s16, s32]),
            _row(4, 8192, "triton_fp8", {"num_splits": 8}, candidates=[s16]),
            _row(None, None, "triton_fp8")]
    follower_line = _line_for("TRITON_ROUTE_TABLE", rows[1], ["20.0/20.1", "17.0/17.4"], 2)
    new = tune.freeze_rows({"TRITON_ROUTE_TABLE": rows}, [tune.parse_race_line(follower_line)])["TRITON_ROUTE_TABLE"]
    assert new == [rows[0], _row(4, 8192, "triton_fp8", {"num_splits": 16}), rows[2]]
    hopper_line = _line_for("TRITON_ROUTE_TABLE", rows[0], ["20.0/20.1", "17.0/17.4", "x n/a here"], 2)
    new = tune.freeze_rows({"TRITON_ROUTE_TABLE": rows}, [tune.parse_race_line(hopper_line)])["TRITON_ROUTE_TABLE"]
    assert new == [_row(4, 8192, "triton_fp8", {"num_splits": 16}), rows[1], rows[2]]
    # two cells, chosen [1] triton_fp8 {"num_splits":8}: entry 1 of the follower, not of the Hopper row
    own_line = _line_for("TRITON_ROUTE_TABLE", rows[1], ["20.0/20.1", "x hung (> 20 s)"], 1)
    index, _ = tune.label_race_cells(rows, tune.parse_race_line(own_line))
    assert index == 1


PORTABLE = {"hopper_fp8": False}


def _portable(route):
    return PORTABLE.get(route, True)


def test_a_frozen_non_portable_route_gets_the_fastest_portable_follower():
    """Fastest by median, as the race ranks: [4]'s mean is lower than [3]'s, its median is not."""
    s16, s32 = {"num_splits": 16}, {"num_splits": 32}
    rows = [_row(4, 8192, "triton_fp8", {"num_splits": 8},
                 candidates=[{"route": "hopper_fp8", "params": s16}, {"route": "triton_fp8", "params": s16},
                             {"route": "triton_fp8", "params": s32}]),
            _row(None, None, "triton_fp8")]
    line = _line_for("T_TABLE", rows[0], ["20.0/20.0", "12.0/12.5", "17.0/17.9", "18.0/16.0"], 2)
    new = tune.freeze_rows({"T_TABLE": rows}, [tune.parse_race_line(line)], portable=_portable)["T_TABLE"]
    assert new == [_row(4, 8192, "hopper_fp8", s16), _row(4, 8192, "triton_fp8", s16), rows[1]]


def test_a_portable_follower_falls_back_to_the_replaced_row_or_to_the_one_that_follows():
    s16 = {"num_splits": 16}
    rows = [_row(4, 8192, "triton_fp8", {"num_splits": 8},
                 candidates=[{"route": "hopper_fp8", "params": s16}, {"route": "triton_fp8", "params": s16}]),
            _row(None, None, "triton_fp8")]
    line = _line_for("T_TABLE", rows[0], ["x rel 1>0.075", "12.0/12.5", "x hung (> 20 s)"], 2)
    new = tune.freeze_rows({"T_TABLE": rows}, [tune.parse_race_line(line)], portable=_portable)["T_TABLE"]
    # no portable candidate was timed: the raced row's own (portable) route follows
    assert new == [_row(4, 8192, "hopper_fp8", s16), _row(4, 8192, "triton_fp8", {"num_splits": 8}), rows[1]]
    # the submission's layout: a Hopper row that races, its portable row after it: nothing added
    hopper_rows = [_row(4, 8192, "hopper_fp8", {"num_splits": 8}, candidates=[{"route": "hopper_fp8", "params": s16}]),
                   _row(4, 8192, "triton_fp8", s16), _row(None, None, "triton_fp8")]
    line = _line_for("T_TABLE", hopper_rows[0], ["14.0/14.0", "12.0/12.1"], 2)
    new = tune.freeze_rows({"T_TABLE": hopper_rows}, [tune.parse_race_line(line)], portable=_portable)["T_TABLE"]
    assert new == [_row(4, 8192, "hopper_fp8", s16), *hopper_rows[1:]]


def test_freezing_into_an_unknown_table_is_refused():
    line = LINE_RACED.replace("AITER_ROUTE_TABLE", "OTHER_TABLE")
    with pytest.raises(tune.TuneError, match="OTHER_TABLE"):
        tune.freeze_rows(TABLES, [tune.parse_race_line(line)])


def _with_row_32(row):
    return {**TABLES, "AITER_ROUTE_TABLE": [TABLES["AITER_ROUTE_TABLE"][0], row, TABLES["AITER_ROUTE_TABLE"][2]]}


@pytest.mark.parametrize("changed", [
    # one more candidate than the line has cells
    _row(32, 1024, "aiter_fp8", {"q_scale": "unit"},
         candidates=[{"route": "aiter_a8w8_persistent", "params": A8W8_8}, {"route": "triton_fp8", "params": TRITON_S4},
                     {"route": "aiter_bf16", "params": {}}]),
    # as many, but entry [3] is no longer the chosen route and params
    _row(32, 1024, "aiter_fp8", {"q_scale": "unit"},
         candidates=[{"route": "aiter_a8w8_persistent", "params": A8W8_8},
                     {"route": "triton_fp8", "params": {"num_splits": 8, "block_n": 64}}]),
    # the row no longer races
    _row(32, 1024, "aiter_fp8", {"q_scale": "unit"}),
])
def test_a_line_whose_raced_row_changed_is_not_frozen(changed, capsys):
    tables = _with_row_32(changed)
    parsed = tune.parse_race_line(LINE_RACED)
    with pytest.raises(tune.TuneError, match=r"AITER_ROUTE_TABLE bs=32 kv=1024: .*changed since the race"):
        tune.freeze_row(tables["AITER_ROUTE_TABLE"], parsed)
    with pytest.raises(tune.StaleRaceLine):
        tune.label_race_cells(tables["AITER_ROUTE_TABLE"], parsed)
    # freeze_rows reports it and skips it; the other line is still frozen
    new = tune.freeze_rows(tables, [parsed, tune.parse_race_line(LINE_CATCH_ALL)])
    assert new["AITER_ROUTE_TABLE"] == [_row(4, 1024, "aiter_a8w8_persistent", A8W8_32), changed,
                                        TABLES["AITER_ROUTE_TABLE"][2]]
    err = capsys.readouterr().err
    assert "AITER_ROUTE_TABLE bs=32 kv=1024" in err and "not frozen" in err and "bs=4" not in err


def test_freezing_a_frozen_table_again_changes_nothing(capsys):
    lines = [tune.parse_race_line(LINE_RACED), tune.parse_race_line(LINE_CATCH_ALL)]
    once = tune.freeze_rows(TABLES, lines)
    assert once != TABLES
    assert tune.freeze_rows(once, lines) == once
    assert capsys.readouterr().err == ""


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


def _racing_rows(sub_copy, table):
    """[(index, row)] of the copy's rows of `table` that race (bounded, with candidates)."""
    rows = tune.read_tables(sub_copy.read_text())[table]
    racing = [(i, r) for i, r in enumerate(rows)
              if r.get("candidates") and r["max_batch"] is not None and r["max_kv_len"] is not None]
    assert racing, f"submission.py's {table} has no racing row to test --from-log with"
    return racing


def _stale_line(table, row):
    """A line for `row`'s shape with one cell more than the row has entrants."""
    cells = ["9.0/9.0"] + ["x n/a here"] * (len(row["candidates"]) + 1)
    return _line_for(table, dict(row, candidates=[*row["candidates"], {"route": "gone", "params": {}}]), cells, 1)


def test_cli_writes_only_the_named_table_and_the_file_imports(sub_copy, tmp_path, capsys):
    import importlib.util

    before = tune.read_tables(sub_copy.read_text())
    index, row = _racing_rows(sub_copy, "TRITON_ROUTE_TABLE")[0]
    n = 1 + len(row["candidates"])
    old_line = _line_for("TRITON_ROUTE_TABLE", row, ["9.0/9.1"] + ["x n/a here"] * (n - 1), 1)
    new_line = _line_for("TRITON_ROUTE_TABLE", row, ["20.0/20.5", "10.0/10.2"] + ["x hung (> 20 s)"] * (n - 2), 2)
    stale = _stale_line("AITER_ROUTE_TABLE", _racing_rows(sub_copy, "AITER_ROUTE_TABLE")[0][1])
    log = tmp_path / "report.txt"
    log.write_text(f"Running benchmarks...\n12:00:01 {old_line}\n\n  {new_line}\n{NOT_RACE_LINES[1]}\n"
                   f"{stale}\nall done\n")
    assert tune.main(["--from-log", str(log), "--write", "--submission", str(sub_copy)]) == tune.EXIT_OK
    out = capsys.readouterr().out
    assert "superseded by line 4" in out and "line 4: TRITON_ROUTE_TABLE" in out and "written into" in out
    assert "chosen [2]" in out and "10.0/10.2 us (median/mean) vs [1] 20.0/20.5 us" in out
    assert "line 6: AITER_ROUTE_TABLE" in out and "NOT FROZEN" in out and "changed since the race" in out
    after = tune.read_tables(sub_copy.read_text())
    assert after["AITER_ROUTE_TABLE"] == before["AITER_ROUTE_TABLE"]
    entrant = row["candidates"][0]
    assert after["TRITON_ROUTE_TABLE"][:index] == before["TRITON_ROUTE_TABLE"][:index]
    assert after["TRITON_ROUTE_TABLE"][index] == _row(row["max_batch"], row["max_kv_len"], entrant["route"],
                                                      entrant["params"])
    spec = importlib.util.spec_from_file_location("_from_log_check", sub_copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.TRITON_ROUTE_TABLE == after["TRITON_ROUTE_TABLE"]


def test_cli_without_write_prints_and_leaves_the_file(sub_copy, monkeypatch, capsys):
    old = sub_copy.read_bytes()
    _, row = _racing_rows(sub_copy, "AITER_ROUTE_TABLE")[0]
    catch_all = tune.read_tables(old.decode())["AITER_ROUTE_TABLE"][-1]
    line = _line_for("AITER_ROUTE_TABLE", row, ["x rel 1>0.075"] * (1 + len(row["candidates"])), catch_all,
                     NO_SURVIVOR_NOTE)
    monkeypatch.setattr("sys.stdin", io.StringIO(line + "\n"))
    assert tune.main(["--from-log", "-", "--submission", str(sub_copy)]) == tune.EXIT_OK
    out = capsys.readouterr().out
    assert "[catch-all]" in out and "no candidate survived" in out and "replaces row" in out
    assert "AITER_ROUTE_TABLE = [" in out and "TRITON_ROUTE_TABLE = [" not in out
    assert "not written" in out
    assert sub_copy.read_bytes() == old


def test_cli_exits_2_on_a_log_without_race_lines(sub_copy, tmp_path, capsys):
    log = tmp_path / "empty.txt"
    log.write_text("nothing raced here\nsubmission.py: aiter routes off\n" + "\n".join(NOT_RACE_LINES) + "\n"
                   + LINE_NOT_MEASURED + "\n")
    old = sub_copy.read_bytes()
    assert tune.main(["--from-log", str(log), "--write", "--submission", str(sub_copy)]) == tune.EXIT_BAD_ARGS
    err = capsys.readouterr().err
    assert "no race line" in err and "(us median/mean)" in err and "not a measurement" in err
    assert tune.main(["--from-log", str(tmp_path / "missing.txt"), "--submission", str(sub_copy)]) == 2
    assert sub_copy.read_bytes() == old


def test_cli_exits_2_when_no_line_fits_the_tables(sub_copy, tmp_path, capsys):
    """Every line's raced row changed since the race: nothing is frozen, nothing written."""
    _, row = _racing_rows(sub_copy, "TRITON_ROUTE_TABLE")[0]
    log = tmp_path / "stale.txt"
    log.write_text(_stale_line("TRITON_ROUTE_TABLE", row) + "\n")
    old = sub_copy.read_bytes()
    assert tune.main(["--from-log", str(log), "--write", "--submission", str(sub_copy)]) == tune.EXIT_BAD_ARGS
    captured = capsys.readouterr()
    assert "NOT FROZEN" in captured.out and "nothing frozen" in captured.err and "written" not in captured.out
    assert sub_copy.read_bytes() == old

"""tools/freeze_race_log.py (and tune.py --from-log, which runs it): reading the race's row lines,
finding the raced row by its hash, freezing the choice into a fixed row, refusing what was not
measured or no longer matches; every race log shipped in the repository reads in today's format.

CPU only. The command line runs on a COPY of submission.py (`sub_copy`: a write aimed at the real
file fails the test). One test runs a real race (the measuring process over the aiter double,
tests/doubles/race_child.py) and freezes what it printed.
"""
import hashlib
import io
import json
import subprocess
import sys

import pytest

import tune
from tools import freeze_race_log as frl
from tools import route_tables as rt

A8W8 = "aiter_a8w8_persistent"


def persistent(splits, q_scale="unit"):
    return {"route": A8W8, "params": {"page_size": 1, "num_splits": splits, "q_scale": q_scale}}


def hopper(splits):
    return {"route": "hopper_fp8", "params": {"num_splits": splits, "num_warps": 4, "num_stages": 2}}


def triton(splits):
    return {"route": "triton_fp8", "params": {"num_splits": splits, "block_n": 64, "num_warps": 8, "num_stages": 3}}


def row(batch, kv_len, first, *candidates):
    return rt.table_row(first["route"], first["params"], batch, kv_len,
                        candidates=list(candidates) if candidates else None)


CATCH_ALL = row(None, None, persistent(32, "tensor"))
AITER = [row(4, 1024, persistent(16), persistent(8), {"route": "aiter_fp8", "params": {"q_scale": "unit"}}),
         row(32, 1024, persistent(16), persistent(8)), CATCH_ALL]
TRITON = [row(4, 1024, hopper(16), hopper(8), triton(8)), row(4, 1024, triton(8)), row(None, None, triton(2))]


def contract_hash(r):
    """The contract's row hash: the first 6 hex of sha256 of json.dumps(race_candidates(row), sort_keys=True)."""
    return hashlib.sha256(json.dumps(rt.row_candidates(r), sort_keys=True).encode()).hexdigest()[:6]


def portable(route):
    return route != "hopper_fp8"


def line(table, r, cells, choice, note=None, row_hash=contract_hash):
    """A row line of the race for row `r`: cells are the texts after "[i] "."""
    text = (f"submission.py race {table} bs={r['max_batch']} kv={r['max_kv_len']} #{row_hash(r)}: "
            + " | ".join(f"[{i}] {c}" for i, c in enumerate(cells, 1))
            + f" -> {choice if choice == 'catch-all' else f'[{choice}]'}")
    return text + (f"; {note}" if note else "")


def freeze(lines, tables=None):
    tables = tables or {"AITER_ROUTE_TABLE": AITER, "TRITON_ROUTE_TABLE": TRITON}
    warnings = []
    found = frl.read_lines("\n".join(lines), warnings.append)
    new, reports = frl.freeze(tables, found, contract_hash, portable)
    return new, reports, warnings


# ---------------------------------------------------------------------------------------------
# Parsing


def test_a_row_line_parses_into_cells_choice_and_note():
    text = line("AITER_ROUTE_TABLE", AITER[0], ["18.2/18.9", "x rel 0.81>0.06", "15.1/342.7"], 3, "budget")
    p = frl.parse_line(f"12:00:01 stderr | {text}  ")
    assert (p["table"], p["batch"], p["kv_len"], p["hash"], p["choice"], p["note"]) == (
        "AITER_ROUTE_TABLE", 4, 1024, contract_hash(AITER[0]), 3, "budget")
    assert p["cells"] == [{"index": 1, "median": 18.2, "mean": 18.9, "why": None},
                          {"index": 2, "median": None, "mean": None, "why": "rel 0.81>0.06"},
                          {"index": 3, "median": 15.1, "mean": 342.7, "why": None}]
    assert p["line"] == text


@pytest.mark.parametrize("other", [
    "submission.py race why bs=4 kv=1024 [2]: RuntimeError: no kernel for this shape -> more text",
    "submission.py race check AITER_ROUTE_TABLE bs=32 kv=1024: [3] x rel 0.9>0.07 on this call's data -> [1] runs",
    "submission.py race AITER_ROUTE_TABLE: choices of 4 rows read from /tmp/mla-race-ab12.json",
    "submission.py race: further lines cut (3584 bytes a process)",
    "bs4 kv1024: sub_c_fixed.py: host 43.4 gpu median 10.2 mean 10.2",
])
def test_other_lines_are_not_row_lines(other):
    assert frl.parse_line(other) is None


@pytest.mark.parametrize("text, match", [
    ("submission.py race AITER_ROUTE_TABLE bs=4 kv=1024 (us median/mean): [1] 9.0/9.1 -> chosen [1] aiter_bf16 {}",
     "older format"),
    ("submission.py race TRITON_ROUTE_TABLE bs=4 kv=1024: [1] hopper_fp8 {} 10.6 us -> chosen [1] hopper_fp8 {}",
     "older format"),
    ("submission.py race AITER_ROUTE_TABLE bs=4 kv=1024 #abcdef: [1] 9.0/9.1 | [2] 8.0/8", "choice"),
    ("submission.py race AITER_ROUTE_TABLE bs=4 kv=1024 #abcdef: [1] 9.0/9.1 | [3] 8.0/8.0 -> [1]", "numbered"),
    ("submission.py race AITER_ROUTE_TABLE bs=4 kv=1024 #abcdef: [1] 9.0/9.1 | [2] x hung -> [3]", "not among"),
    ("submission.py race AITER_ROUTE_TABLE bs=4 kv=1024 #abcdef: [1] 9.0/9.1 | [2] x hung -> catch-all",
     "although"),
    ("submission.py race AITER_ROUTE_TABLE bs=4 kv=1024 #abcdef: [1] fast | [2] x hung -> [1]", "neither"),
])
def test_a_line_that_does_not_parse_raises(text, match):
    with pytest.raises(ValueError, match=match):
        frl.parse_line(text)


# ---------------------------------------------------------------------------------------------
# Freezing


def test_the_choice_replaces_the_raced_row_as_a_fixed_row():
    new, reports, warnings = freeze([line("AITER_ROUTE_TABLE", AITER[1], ["20.0/20.1", "10.0/10.2"], 2)])
    assert warnings == []
    assert new["AITER_ROUTE_TABLE"] == [AITER[0], rt.table_row(A8W8, persistent(8)["params"], 32, 1024), CATCH_ALL]
    assert new["TRITON_ROUTE_TABLE"] == TRITON
    (text,) = reports
    assert "frozen [2]" in text and "10.0/10.2 us (median/mean) vs [1] 20.0/20.1" in text and "into row 2" in text


def test_a_line_whose_row_changed_or_was_frozen_already_is_not_frozen():
    stale = dict(AITER[1], candidates=[persistent(4)])  # the row raced then, not the table's now
    new, reports, _ = freeze([line("AITER_ROUTE_TABLE", stale, ["20.0/20.1", "10.0/10.2"], 2)])
    assert new["AITER_ROUTE_TABLE"] == AITER
    assert "NOT FROZEN" in reports[0] and "changed since the race" in reports[0]
    once, _, _ = freeze([line("AITER_ROUTE_TABLE", AITER[1], ["20.0/20.1", "10.0/10.2"], 2)])
    again, reports, _ = freeze([line("AITER_ROUTE_TABLE", AITER[1], ["20.0/20.1", "10.0/10.2"], 2)],
                               {"AITER_ROUTE_TABLE": once["AITER_ROUTE_TABLE"]})
    assert again["AITER_ROUTE_TABLE"] == once["AITER_ROUTE_TABLE"] and "frozen already" in reports[0]


@pytest.mark.parametrize("cells, choice, note, why", [
    (["x not reached", "x not reached"], 1, "no process: OSError", "was not timed (not reached)"),
    (["20.0/20.1", "x cut"], "catch-all", None, None),  # self-contradicting: raises (not read)
    (["x died SIGSEGV", "x not reached"], "catch-all", "budget", "not every candidate was measured"),
])
def test_a_line_that_was_not_measured_is_not_frozen(cells, choice, note, why):
    new, reports, warnings = freeze([line("AITER_ROUTE_TABLE", AITER[1], cells, choice, note)])
    assert new["AITER_ROUTE_TABLE"] == AITER
    if why is None:
        assert reports == [] and "although [1] was timed" in warnings[0]
    else:
        assert "NOT FROZEN" in reports[0] and why in reports[0]


def test_the_last_line_of_a_row_wins():
    first = line("AITER_ROUTE_TABLE", AITER[1], ["20.0/20.1", "10.0/10.2"], 2)
    last = line("AITER_ROUTE_TABLE", AITER[1], ["9.0/9.1", "10.0/10.2"], 1)
    new, reports, _ = freeze([first, "noise", last])
    assert new["AITER_ROUTE_TABLE"][1] == rt.table_row(A8W8, persistent(16)["params"], 32, 1024)
    assert reports[0] == "line 1: superseded by line 3 (the last line of a row wins)"


def test_a_frozen_hopper_row_keeps_a_portable_row_after_it_and_a_portable_choice_drops_it():
    cells = ["10.6/10.6", "11.2/11.3", "19.7/19.8"]
    new, reports, _ = freeze([line("TRITON_ROUTE_TABLE", TRITON[0], cells, 2)])
    assert new["TRITON_ROUTE_TABLE"] == [rt.table_row("hopper_fp8", hopper(8)["params"], 4, 1024),
                                         rt.table_row("triton_fp8", triton(8)["params"], 4, 1024), TRITON[-1]]
    assert "portable row after it: triton_fp8" in reports[0]
    new, reports, _ = freeze([line("TRITON_ROUTE_TABLE", TRITON[0], ["30.0/30.0", "31.0/31.0", "19.7/19.8"], 3)])
    assert new["TRITON_ROUTE_TABLE"] == [rt.table_row("triton_fp8", triton(8)["params"], 4, 1024), TRITON[-1]]
    assert "1 shadowed row(s) with the same bounds removed" in reports[0]


def test_a_mean_only_cell_of_a_converted_line_reads_and_freezes():
    text = line("TRITON_ROUTE_TABLE", TRITON[0], ["-/10.6", "-/11.2", "-/19.7"], 1, "converted")
    new, reports, warnings = freeze([text])
    assert warnings == [] and "frozen [1]" in reports[0] and "-/10.6 us" in reports[0]
    assert new["TRITON_ROUTE_TABLE"][0] == rt.table_row("hopper_fp8", hopper(16)["params"], 4, 1024)


FAILURES = ["x " + why for why in ("died SIGSEGV", "died exit 3", "hung", "raised RuntimeError", "rel 0.78>0.07",
                                   "n/a", "died@4x1024", "hung@4x1024", "raised@4x1024", "rel 1>0.07",
                                   "died SIGABRT", "n/a")]


def test_twelve_failing_candidates_per_row_freeze_the_catch_all_and_one_not_reached_freezes_nothing():
    """Rows of 12 candidates (the row's own and 11 more), every one failing: what the race ran is
    the catch-all, frozen as the shape's row; when one candidate was not reached, nothing is."""
    twelve = [persistent(s) for s in (1, 2, 4, 8, 12, 16, 24, 32)] + [
        persistent(s, "tensor") for s in (1, 2, 4, 8)]
    rows = [row(4, 1024, *twelve), row(32, 8192, *reversed(twelve)), CATCH_ALL]
    lines = [line("AITER_ROUTE_TABLE", r, FAILURES, "catch-all", "no candidate survived") for r in rows[:2]]
    new, reports, warnings = freeze(lines, {"AITER_ROUTE_TABLE": rows})
    assert warnings == [] and len(reports) == 2
    assert new["AITER_ROUTE_TABLE"] == [rt.table_row(A8W8, CATCH_ALL["params"], 4, 1024),
                                        rt.table_row(A8W8, CATCH_ALL["params"], 32, 8192), CATCH_ALL]
    assert all("the catch-all's route (every candidate failed)" in r and "(0 of 12 timed)" in r for r in reports)
    open_cell = [*FAILURES[:11], "x not reached"]
    new, reports, _ = freeze([line("AITER_ROUTE_TABLE", rows[0], open_cell, "catch-all")], {"AITER_ROUTE_TABLE": rows})
    assert new["AITER_ROUTE_TABLE"] == rows and "NOT FROZEN" in reports[0] and "[12] was not reached" in reports[0]
    last = [*FAILURES[:11], "30.5/31.0"]
    new, reports, _ = freeze([line("AITER_ROUTE_TABLE", rows[1], last, 12)], {"AITER_ROUTE_TABLE": rows})
    assert new["AITER_ROUTE_TABLE"][1] == rt.table_row(A8W8, twelve[0]["params"], 32, 8192)


def test_the_row_hash_is_the_contracts():
    """submission.race_row_hash names rows as the freezing tests here do."""
    import submission

    tables = rt.read_tables_file(submission.__file__)
    racing = [r for rows in tables.values() for r in rows if r.get("candidates")]
    assert racing and all(submission.race_row_hash(r) == contract_hash(r) for r in racing)


# ---------------------------------------------------------------------------------------------
# The logs the repository ships, and the command line


def shipped_logs(repo_root):
    """The repository's text logs holding race row lines (`submission.py race <TABLE> bs=`)."""
    files = subprocess.run(["git", "ls-files", "*.txt", "*.log"], cwd=repo_root, capture_output=True, text=True,
                           check=True).stdout.split()
    return [repo_root / f for f in files if frl.LINE_RE.search((repo_root / f).read_text(errors="replace"))]


def test_every_shipped_race_log_reads_in_todays_format_and_freezes(repo_root):
    import submission

    logs = shipped_logs(repo_root)
    assert repo_root / "lab/results/h200/race_2026-12-01.txt" in logs
    tables = rt.read_tables_file(submission.__file__)
    for log in logs:
        warnings = []
        found = frl.read_lines(log.read_text(errors="replace"), warnings.append)
        assert warnings == [], (log, warnings[:2])
        _, reports = frl.freeze(tables, found, submission.race_row_hash,
                                lambda r: submission.ROUTE_INFO[r].get("portable", True))
        assert any(": frozen " in r for r in reports), (log, reports[:2])


def test_the_h200_race_of_2026_12_01_freezes_into_todays_rows(repo_root):
    """Its lines (converted: docs/tuning.md) name today's Hopper rows; each kept its first candidate."""
    import submission

    table = rt.read_tables_file(submission.__file__)["TRITON_ROUTE_TABLE"]
    found = frl.read_lines((repo_root / "lab/results/h200/race_2026-12-01.txt").read_text(), pytest.fail)
    new, reports = frl.freeze({"TRITON_ROUTE_TABLE": table}, found, submission.race_row_hash,
                              lambda r: submission.ROUTE_INFO[r].get("portable", True))
    assert len(found) == 8 and all(": frozen [1]" in r for r in reports), reports
    assert new["TRITON_ROUTE_TABLE"] == [{k: v for k, v in r.items() if k != "candidates"} for r in table]


def _racing(sub_copy, name):
    return [(i, r) for i, r in enumerate(rt.read_tables(sub_copy.read_text())[name])
            if r.get("candidates") and r["max_batch"] is not None]


def test_cli_writes_the_frozen_rows_and_the_file_imports(sub_copy, tmp_path, capsys):
    import importlib.util
    import submission

    before = rt.read_tables(sub_copy.read_text())
    index, raced = _racing(sub_copy, "TRITON_ROUTE_TABLE")[0]
    n = len(rt.row_candidates(raced))
    text = line("TRITON_ROUTE_TABLE", raced, ["20.0/20.5", "10.0/10.2"] + ["x hung"] * (n - 2), 2,
                row_hash=submission.race_row_hash)
    log = tmp_path / "report.txt"
    log.write_text(f"Running benchmarks...\n12:00:01 {text}\nsubmission.py race why bs=1 kv=1 [3]: hung\n")
    assert frl.main([str(log), "--write", "--submission", str(sub_copy)]) == frl.EXIT_OK
    out = capsys.readouterr().out
    assert "line 2: TRITON_ROUTE_TABLE" in out and "frozen [2]" in out and "written into" in out
    after = rt.read_tables(sub_copy.read_text())
    assert after["AITER_ROUTE_TABLE"] == before["AITER_ROUTE_TABLE"]
    entrant = raced["candidates"][0]
    assert after["TRITON_ROUTE_TABLE"][index] == rt.table_row(entrant["route"], entrant["params"],
                                                              raced["max_batch"], raced["max_kv_len"])
    spec = importlib.util.spec_from_file_location("_freeze_check", sub_copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.TRITON_ROUTE_TABLE == after["TRITON_ROUTE_TABLE"]


def test_tune_from_log_runs_the_freeze_tool_and_leaves_the_file_without_write(sub_copy, monkeypatch, capsys):
    import submission

    old = sub_copy.read_bytes()
    _, raced = _racing(sub_copy, "AITER_ROUTE_TABLE")[0]
    cells = ["x rel 1>0.07"] * len(rt.row_candidates(raced))
    monkeypatch.setattr("sys.stdin", io.StringIO(line("AITER_ROUTE_TABLE", raced, cells, "catch-all",
                                                      row_hash=submission.race_row_hash) + "\n"))
    assert tune.main(["--from-log", "-", "--submission", str(sub_copy)]) == 0
    out = capsys.readouterr().out
    assert "the catch-all's route" in out and "AITER_ROUTE_TABLE = [" in out and "not written" in out
    assert sub_copy.read_bytes() == old


def test_cli_exits_2_when_nothing_can_be_frozen(sub_copy, tmp_path, capsys):
    old = sub_copy.read_bytes()
    empty = tmp_path / "empty.txt"
    empty.write_text("nothing raced here\nsubmission.py race: further lines cut (3584 bytes a process)\n")
    assert frl.main([str(empty), "--write", "--submission", str(sub_copy)]) == frl.EXIT_BAD
    assert "no race row line" in capsys.readouterr().err
    stale = tmp_path / "stale.txt"
    stale.write_text(line("TRITON_ROUTE_TABLE", dict(TRITON[0], candidates=[hopper(3)]), ["1.0/1.0"] * 2, 1) + "\n")
    assert frl.main([str(stale), "--write", "--submission", str(sub_copy)]) == frl.EXIT_BAD
    captured = capsys.readouterr()
    assert "NOT FROZEN" in captured.out and "nothing written" in captured.err
    assert frl.main([str(tmp_path / "missing.txt"), "--submission", str(sub_copy)]) == frl.EXIT_BAD
    assert sub_copy.read_bytes() == old


def test_what_a_race_prints_is_what_the_freeze_tool_freezes(monkeypatch, tmp_path, capsys):
    """A real race (measuring process over the aiter double, fake times): its row line freezes into
    the candidate it chose."""
    import race_child
    import reference
    from aiter_double import loader

    generation = "2026-03-04"
    first, fast, fp8 = persistent(16), persistent(8), {"route": "aiter_fp8", "params": {"q_scale": "unit"}}
    table = [row(4, 64, first, fast, fp8), CATCH_ALL]
    mod = loader.load_submission(generation).module
    mod.race_command = [sys.executable, str(race_child.TESTS / "race_child.py")]
    mod.race_cache_dir = str(tmp_path)
    mod.AITER_ROUTE_TABLE = table
    times = {race_child.key(c): [t] * 15 for c, t in ((first, 20.0), (fast, 12.0), (fp8, 30.0))}
    monkeypatch.setenv("RACE_TEST_CHILD", json.dumps({"generation": generation, "stand_ins": [], "times": times}))
    mod.custom_kernel(reference.generate_input(4, 1, 64, 1, device="cpu"))
    err = capsys.readouterr().err
    found = frl.read_lines(err, pytest.fail)
    assert len(found) == 1 and found[0][1]["choice"] == 2
    new, reports = frl.freeze({"AITER_ROUTE_TABLE": table}, found, mod.race_row_hash, lambda r: True)
    assert new["AITER_ROUTE_TABLE"] == [rt.table_row(A8W8, fast["params"], 4, 64), CATCH_ALL], reports

"""The candidate race (submission.py, "Candidate race"): measured once per job in separate
processes, judged against what each candidate's own formats can reach on the same data, ranked by
a median, the choices kept in a file for the job's later processes.

On the CPU with the aiter double: the measuring process is tests/race_child.py (the submission over
the double, stand-in candidates, a fake timer), so processes, deaths and hangs are real; the
candidates' outputs are real too (the double computes with torch), so the judging is real.
"""
import json
import sys
from pathlib import Path

import pytest
import torch

import race_child
import reference
from aiter_double import loader  # tests/ is on sys.path: pytest's rootdir import

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHILD = Path(__file__).resolve().parent / "race_child.py"
GENERATION = "2026-03-04"
BATCH, KV_LEN = 4, 64
ROUTE = "aiter_a8w8_persistent"
key = race_child.key


def persistent(splits, page_size=1, q_scale="unit"):
    return {"route": ROUTE, "params": {"page_size": page_size, "num_splits": splits, "q_scale": q_scale}}


def stand_in(name):
    return {"route": name, "params": {}}


FP8 = {"route": "aiter_fp8", "params": {"q_scale": "unit"}}
CATCH_ALL = {"max_batch": None, "max_kv_len": None, **persistent(32, q_scale="tensor")}


def racing_table(first, *others):
    return [{"max_batch": BATCH, "max_kv_len": KV_LEN, **first, "candidates": list(others)}, CATCH_ALL]


def label(candidate):
    return f"{candidate['route']} {json.dumps(candidate['params'], separators=(',', ':'))}"


def route_of(candidate):
    return f"{candidate['route']} {candidate['params']}"


@pytest.fixture
def sub(monkeypatch, tmp_path):
    """A fresh submission module over the runner's aiter (the double) whose measuring process is
    tests/race_child.py with the same stand-ins and `times` (see timed);
    its choices file goes under tmp_path."""
    def load(table, times=None, stand_ins=(), page_mode=None, command=None):
        module = loader.load_submission(GENERATION, page_mode=page_mode).module
        module.race_command = command or [sys.executable, str(CHILD)]
        module.race_cache_dir = str(tmp_path)
        module.AITER_ROUTE_TABLE = table
        race_child.register(module, stand_ins)
        per_call = {key(c): t if isinstance(t, list) else [t] * 15 for c, t in times or ()}
        monkeypatch.setenv("RACE_TEST_CHILD", json.dumps(
            {"generation": GENERATION, "page_mode": page_mode, "stand_ins": list(stand_ins), "times": per_call}))
        return module
    return load


def timed(*pairs):
    """(candidate, us per call or a list of them) pairs, as the fake timer of the measuring process gets them."""
    return list(pairs)


def data(seed=1, q_gain=1.0):
    inputs = reference.generate_input(BATCH, 1, KV_LEN, seed, device="cpu")
    return ((inputs[0] * q_gain).to(torch.bfloat16), *inputs[1:])


def race_lines(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("submission.py race")]


def test_the_fastest_right_candidate_wins_by_its_median_and_is_kept(sub, capsys):
    """One repeat of 5 ms among 10 us ones moves the mean of the fastest to 342 us, not its median."""
    first, fast = persistent(16), persistent(8)
    mod = sub(racing_table(first, fast, FP8), timed((first, 20.0), (fast, [10.0] * 14 + [5000.0]), (FP8, 17.0)))
    inputs = data()
    out = mod.custom_kernel(inputs)
    assert reference.rel_l2_error(out, inputs) <= 0.06
    assert mod.LAST_ROUTE == route_of(fast)
    (line,) = race_lines(capsys)
    assert line == (f"submission.py race AITER_ROUTE_TABLE bs={BATCH} kv={KV_LEN} (us median/mean): "
                    f"[1] 20.0/20.0 | [2] 10.0/342.7 | [3] 17.0/17.0 -> chosen [2] {label(fast)}")
    again = mod.custom_kernel(data(seed=2))  # kept: no second race, no line
    assert race_lines(capsys) == [] and mod.LAST_ROUTE == route_of(fast)
    assert again.data_ptr() != out.data_ptr()


def test_the_first_candidate_stays_unless_beaten_by_three_percent(sub, capsys):
    first, close = persistent(16), persistent(8)
    mod = sub(racing_table(first, close), timed((first, 20.0), (close, 19.5)))
    mod.custom_kernel(data())
    assert mod.LAST_ROUTE == route_of(first)
    assert race_lines(capsys)[0].endswith(f"-> chosen [1] {label(first)}")


def test_fast_but_wrong_candidates_are_never_chosen(sub, capsys):
    """Zeros, attention over every 2nd token, a page-8 row over the double reading one token per page
    (as aiter's q-length-1 kernel is suspected to) and a candidate that raises, the wrong ones timed
    fastest: all dropped with their reason."""
    first, paged = persistent(16), persistent(8, page_size=8)
    zeros, half, raises = stand_in("zeros"), stand_in("every_2nd_token"), stand_in("raises")
    mod = sub(racing_table(first, zeros, half, paged, raises),
              timed((first, 20.0), (zeros, 1.0), (half, 2.0), (paged, 3.0), (raises, 1.0)),
              stand_ins=("zeros", "every_2nd_token", "raises"), page_mode="first_token")
    inputs = data()
    out = mod.custom_kernel(inputs)
    assert mod.LAST_ROUTE == route_of(first) and reference.rel_l2_error(out, inputs) <= 0.06
    line = race_lines(capsys)[0]
    assert "[2] x rel 1>0.07" in line
    assert "[3] x rel 0.9" in line or "[3] x rel 1" in line  # every 2nd token
    assert "[4] x rel " in line and "[5] x raised RuntimeError: no kernel for this shape" in line
    assert line.endswith(f"-> chosen [1] {label(first)}")


def test_the_a16w8_candidate_is_judged_by_its_own_formats_and_can_win(sub, capsys):
    """bf16 q over the fp8 cache: its reach has no q rounding, so its bound is tighter than a8w8's."""
    first = persistent(16)
    a16w8 = {"route": "aiter_a16w8_persistent", "params": {"page_size": 1, "num_splits": 16}}
    mod = sub(racing_table(first, a16w8), timed((first, 20.0), (a16w8, 12.0)))
    inputs = data()
    out = mod.custom_kernel(inputs)
    assert mod.LAST_ROUTE == route_of(a16w8)
    assert reference.rel_l2_error(out, inputs) <= mod.ROUTE_INFO["aiter_a16w8_persistent"]["rel_l2_bound"] == 0.05
    truth = mod.RaceTruth(inputs)
    assert mod.race_q_format(a16w8) == "bf16" and truth.bound("bf16", "fp8") < truth.bound("fp8", "fp8")
    assert race_lines(capsys)[0].endswith(f"-> chosen [2] {label(a16w8)}")


@pytest.mark.parametrize("fault", ["aborts", "segfaults", "hangs"])
def test_a_candidate_that_kills_or_hangs_the_measuring_process_is_named_and_dropped(sub, capsys, fault):
    """The caller survives (it never runs an unmeasured candidate), a new process measures the rest."""
    first, fast, bad = persistent(16), persistent(8), stand_in(fault)
    mod = sub(racing_table(first, bad, fast), timed((first, 20.0), (bad, 1.0), (fast, 10.0)), stand_ins=(fault,))
    mod.RACE_CANDIDATE_LIMIT_S = 10.0  # a loaded CI machine must not make an honest candidate look hung
    inputs = data()
    out = mod.custom_kernel(inputs)
    assert mod.LAST_ROUTE == route_of(fast) and reference.rel_l2_error(out, inputs) <= 0.06
    line = race_lines(capsys)[0]
    expected = {"aborts": "[2] x died (signal 6", "segfaults": "[2] x died (signal 11",
                "hangs": "[2] x hung (> 10 s)"}[fault]
    assert expected in line and "[1] 20.0/20.0" in line and "[3] 10.0/10.0" in line


def test_the_judge_is_relative_to_the_data_and_still_refuses_wrong_answers(sub):
    """On randn data and on data whose q is 8x sharper, the honest routes pass and zeros, every
    2nd token and one token per page fail; on the sharp data the honest fp8 routes' error is far
    above the old fixed bound of 0.06 (their own formats make it), so a fixed bound would drop them."""
    mod = loader.load_submission(GENERATION, page_mode="first_token").module
    race_child.register(mod, ("zeros", "every_2nd_token"))
    honest = [persistent(16), FP8, {"route": "aiter_bf16", "params": {}}]
    wrong = [stand_in("zeros"), stand_in("every_2nd_token"), persistent(8, page_size=8)]
    for gain in (1.0, 8.0):
        inputs = data(seed=5, q_gain=gain)
        truth = mod.RaceTruth(inputs)
        for candidate in honest:
            out = mod.ROUTES[candidate["route"]](*inputs, **candidate["params"])
            assert mod.race_judge(truth, candidate, out) is None, (gain, candidate)
            if gain > 1 and candidate is not honest[-1]:
                assert truth.error(out) > 0.06, candidate  # the old fixed bound
        for candidate in wrong:
            out = mod.ROUTES[candidate["route"]](*inputs, **candidate["params"])
            assert mod.race_judge(truth, candidate, out) is not None, (gain, candidate)
        assert truth.bound("fp8", "fp8") < mod.RACE_ERROR_CEILING


def test_a_sharper_first_call_is_judged_by_its_own_data(sub, capsys):
    """The first call carries 8x sharper q: the fastest honest candidate passes on that call's own
    data (its format's error there is about 0.2, past any fixed randn bound) and stays for the
    randn calls after it."""
    first, fast = persistent(16), persistent(8)
    mod = sub(racing_table(first, fast), timed((first, 20.0), (fast, 10.0)))
    sharp = data(q_gain=8.0)
    out = mod.custom_kernel(sharp)
    assert mod.LAST_ROUTE == route_of(fast)
    assert reference.rel_l2_error(out, sharp) > 0.06  # what the fixed bound refused
    mod.custom_kernel(data(seed=2))
    assert mod.LAST_ROUTE == route_of(fast)
    assert [line for line in race_lines(capsys) if " check " in line] == []


def test_a_call_that_rejects_every_measured_candidate_runs_the_catch_all_for_that_call_only(sub, capsys):
    """q far past the fp8 range: every "unit" candidate (q cast to fp8 with scale 1) turns it into
    NaN. That call runs the catch-all (per-tensor q scale); the next, ordinary call runs the
    fastest candidate and keeps it."""
    first, fast = persistent(16), persistent(8)
    mod = sub(racing_table(first, fast), timed((first, 20.0), (fast, 10.0)))
    huge = data(q_gain=200.0)
    out = mod.custom_kernel(huge)
    assert torch.isfinite(out.float()).all()
    assert mod.LAST_ROUTE == route_of(CATCH_ALL)
    (check,) = [line for line in race_lines(capsys) if " check " in line]
    assert check.startswith(f"submission.py race check AITER_ROUTE_TABLE bs={BATCH} kv={KV_LEN}: [2] x rel ")
    assert check.endswith("on this call's data -> the catch-all runs for this call; judged again on the next "
                          f"(1 of {mod.RACE_CALL_CHECKS})")
    assert " | [1] x rel " in check
    mod.custom_kernel(data(seed=2))
    assert mod.LAST_ROUTE == route_of(fast)
    mod.custom_kernel(huge)  # settled: no judging on later calls
    assert mod.LAST_ROUTE == route_of(fast) and race_lines(capsys) == []


def test_after_race_call_checks_rejections_the_catch_all_stays(sub, capsys):
    first = persistent(16)
    mod = sub(racing_table(first, persistent(8)), timed((first, 20.0), (persistent(8), 30.0)))
    for _ in range(mod.RACE_CALL_CHECKS):
        mod.custom_kernel(data(q_gain=200.0))
    assert race_lines(capsys)[-1].endswith("-> the catch-all stays")
    mod.custom_kernel(data(seed=2))
    assert mod.LAST_ROUTE == route_of(CATCH_ALL)


def test_no_survivor_settles_on_the_catch_all(sub, capsys):
    zeros, half = stand_in("zeros"), stand_in("every_2nd_token")
    mod = sub(racing_table(zeros, half), timed((zeros, 1.0), (half, 1.0)), stand_ins=("zeros", "every_2nd_token"))
    inputs = data()
    out = mod.custom_kernel(inputs)
    assert reference.rel_l2_error(out, inputs) <= 0.06 and mod.LAST_ROUTE == route_of(CATCH_ALL)
    (line,) = race_lines(capsys)
    assert line.endswith(f"-> chosen [catch-all] {label(CATCH_ALL)}; no candidate survived: the table's "
                         "catch-all row runs")


def test_one_racing_call_measures_every_racing_row_of_the_table(sub, capsys):
    """The first racing call measures both racing rows (its own first); the other shape's first
    call measures nothing more."""
    first, fast = persistent(16), persistent(8)
    table = [{"max_batch": 2, "max_kv_len": KV_LEN, **first, "candidates": [fast]}, *racing_table(first, fast)]
    mod = sub(table, timed((first, 20.0), (fast, 10.0)))
    mod.custom_kernel(data())
    lines = race_lines(capsys)
    assert [line.split(" (us")[0] for line in lines] == [
        f"submission.py race AITER_ROUTE_TABLE bs={BATCH} kv={KV_LEN}",
        f"submission.py race AITER_ROUTE_TABLE bs=2 kv={KV_LEN}"]
    mod.RACE_JOB_BUDGET_S = 0.0  # any further measuring would show as a budget note
    mod.custom_kernel(reference.generate_input(2, 1, KV_LEN, 3, device="cpu"))
    assert mod.LAST_ROUTE == route_of(fast) and race_lines(capsys) == []


def test_a_later_process_of_the_job_reads_the_choices_and_measures_nothing(sub, capsys, tmp_path):
    first, fast = persistent(16), persistent(8)
    table = racing_table(first, fast)
    sub(table, timed((first, 20.0), (fast, 10.0))).custom_kernel(data())
    (saved,) = tmp_path.glob("mla-race-*.json")
    capsys.readouterr()
    later = sub(table, command=[sys.executable, "-c", "raise SystemExit(7)"])  # would say "could not start"
    later.custom_kernel(data(seed=2))
    assert later.LAST_ROUTE == route_of(fast)
    assert race_lines(capsys) == [f"submission.py race AITER_ROUTE_TABLE: choices of 1 rows read from {saved} "
                                  "(measured by an earlier process of this job)"]


@pytest.mark.parametrize("change", ["file", "damaged", "foreign"])
def test_the_choices_file_is_ignored_when_the_file_changed_or_it_is_damaged_or_foreign(sub, capsys, tmp_path,
                                                                                          repo_root, change):
    first, fast = persistent(16), persistent(8)
    table = racing_table(first, fast)
    sub(table, timed((first, 20.0), (fast, 10.0))).custom_kernel(data())
    (saved,) = tmp_path.glob("mla-race-*.json")
    capsys.readouterr()
    later = sub(table, timed((first, 20.0), (fast, 30.0)))
    if change == "file":
        copy = tmp_path / "edited" / "submission.py"
        copy.parent.mkdir()
        copy.write_text((repo_root / "submission.py").read_text() + "# edited\n")
        later.__file__ = str(copy)
    elif change == "damaged":
        saved.write_text(saved.read_text()[:-5])
    else:
        record = json.loads(saved.read_text())
        record["key"]["device"] = "another GPU"
        saved.write_text(json.dumps(record))
    later.custom_kernel(data(seed=2))
    assert later.LAST_ROUTE == route_of(first)  # measured again: the first is now the faster
    assert race_lines(capsys)[0].endswith(f"-> chosen [1] {label(first)}")


def test_the_job_budget_stops_measuring_and_unreached_rows_keep_their_first_candidate(sub, capsys):
    first, fast = persistent(16), persistent(8)
    table = [{"max_batch": 2, "max_kv_len": KV_LEN, **first, "candidates": [fast]}, *racing_table(first, fast)]
    mod = sub(table, timed((first, 20.0), (fast, 10.0)))
    mod.RACE_JOB_BUDGET_S = 0.0
    inputs = data()
    out = mod.custom_kernel(inputs)
    assert mod.LAST_ROUTE == route_of(first) and reference.rel_l2_error(out, inputs) <= 0.06
    lines = race_lines(capsys)
    assert len(lines) == 2
    for line in lines:
        assert "[1] x not measured | [2] x not measured" in line
        assert line.endswith(f"-> chosen [1] {label(first)}; budget: measuring stopped at the job's limit; rows "
                             "not reached keep their first candidate")


def test_when_no_measuring_process_starts_the_first_candidate_runs_and_the_line_says_why(sub, capsys):
    first, fast = persistent(16), persistent(8)
    mod = sub(racing_table(first, fast), command=["/nonexistent/python"])
    inputs = data()
    out = mod.custom_kernel(inputs)
    assert mod.LAST_ROUTE == route_of(first) and reference.rel_l2_error(out, inputs) <= 0.06
    line = race_lines(capsys)[0]
    assert (f"-> chosen [1] {label(first)}; not measured: the measuring process could not start "
            "(FileNotFoundError") in line
    assert line.endswith("; the first candidate runs")


def test_a_measuring_process_that_dies_before_reporting_counts_as_not_started(sub, capsys):
    first = persistent(16)
    mod = sub(racing_table(first, persistent(8)), command=[sys.executable, "-c", "raise SystemExit('no GPU here')"])
    mod.custom_kernel(data())
    assert mod.LAST_ROUTE == route_of(first)
    assert "not measured: the measuring process could not start (died (exit 1: no GPU here))" in race_lines(capsys)[0]


def test_the_switch_turns_the_race_off(sub, capsys, tmp_path):
    first, fast = persistent(16), persistent(8)
    mod = sub(racing_table(first, fast), timed((first, 20.0), (fast, 10.0)))
    mod.RACE = False
    mod.custom_kernel(data())
    assert mod.LAST_ROUTE == route_of(first) and race_lines(capsys) == [] and not list(tmp_path.glob("mla-race-*"))


def test_other_shapes_and_ragged_lengths_take_the_first_candidate(sub, capsys):
    first, fast = persistent(16), persistent(8)
    mod = sub(racing_table(first, fast), timed((first, 20.0), (fast, 1.0)))
    mod.custom_kernel(reference.generate_input(2, 1, KV_LEN, 3, device="cpu"))  # batch 2 < the row's 4
    mod.custom_kernel(reference.generate_input(BATCH, 1, KV_LEN, 4, kv_lens=[64, 10, 33, 50], device="cpu"))
    assert race_lines(capsys) == [] and mod.LAST_ROUTE == route_of(first)


def test_without_a_gpu_or_a_measuring_command_nothing_is_measured(sub, capsys, monkeypatch):
    first, fast = persistent(16), persistent(8)
    mod = sub(racing_table(first, fast))
    mod.race_command = None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    inputs = data()
    out = mod.custom_kernel(inputs)
    assert mod.LAST_ROUTE == route_of(first) and race_lines(capsys) == []
    assert reference.rel_l2_error(out, inputs) <= 0.06


def test_without_the_bf16_cache_there_is_no_truth_and_no_race(sub, capsys):
    first, fast = persistent(16), persistent(8)
    mod = sub(racing_table(first, fast), timed((first, 20.0), (fast, 1.0)))
    q, kv_data, qo_indptr, kv_indptr, config = data()
    out = mod.custom_kernel((q, {"fp8": kv_data["fp8"]}, qo_indptr, kv_indptr, config))
    assert mod.LAST_ROUTE == route_of(first) and out.shape == (BATCH, 16, 512)
    assert 'submission.py race skipped bs=4 kv=64: kv_data["bf16"] is missing' in capsys.readouterr().err


def test_a_jobs_race_output_stays_under_4_kb(repo_root, capsys):
    """Every candidate of every racing row of both default tables timed, then every candidate failing
    with a long reason: what the lines print stays inside RACE_OUTPUT_BYTES (cut with one line)."""
    import submission

    for table in (submission.AITER_ROUTE_TABLE, submission.TRITON_ROUTE_TABLE):
        rows = {(r["max_batch"], r["max_kv_len"]): r for r in table if r.get("candidates")}
        long_why = "died (signal 6: Memory access fault by GPU node-2 (A"
        for results in ({"median": 123.4, "mean": 125.6}, {"why": long_why}):
            submission._RACE_PRINTED[0] = 0
            for shape, row in rows.items():
                count = len(submission.race_candidates(row))
                outcome = submission.RaceRow([0], dict.fromkeys(range(count), results))
                submission._race_print(submission.race_line("AITER_ROUTE_TABLE", shape, submission.race_candidates(row),
                                                            outcome, table[-1]))
            printed = capsys.readouterr().err
            assert len(printed.encode()) <= 4096
            if "median" in results:
                assert "further lines cut" not in printed and printed.count("-> chosen") == len(rows)
    submission._RACE_PRINTED[0] = 0


def test_the_default_tables_race_every_leaderboard_shape_honestly(repo_root):
    """Each leaderboard shape has a racing row at its exact bounds; every candidate is a known route
    with parameters it accepts; the aiter rows race the honest aiter routes (page size 1, two or
    more split counts for the persistent route, and the a16w8 persistent route at split counts of its
    a8w8 sibling) and the Triton routes compiled for gfx950."""
    import inspect

    import submission
    import utils

    routes = {**submission.ROUTES, "hopper_fp8": submission.hopper_fp8_route}
    for name in ("aiter_bf16", "aiter_fp8", "aiter_a8w8_persistent", "aiter_a16w8_persistent"):
        routes.setdefault(name, getattr(submission, f"{name}_route"))
    for table_name in ("AITER_ROUTE_TABLE", "TRITON_ROUTE_TABLE"):
        table = getattr(submission, table_name)
        for batch, kv_len in utils.benchmark_shapes():
            rows = [r for r in table if (r["max_batch"], r["max_kv_len"]) == (batch, kv_len) and "candidates" in r]
            assert rows, (table_name, batch, kv_len)
            candidates = submission.race_candidates(rows[0])
            assert len(candidates) >= 3
            for candidate in candidates:
                assert candidate["route"] in submission.ROUTE_INFO
                accepted = inspect.signature(routes[candidate["route"]]).parameters
                assert set(candidate["params"]) <= set(accepted), candidate
                assert candidate["params"].get("page_size", 1) == 1
            if table_name == "AITER_ROUTE_TABLE":
                names = [c["route"] for c in candidates]
                splits = {c["params"]["num_splits"] for c in candidates if c["route"] == ROUTE}
                assert "aiter_fp8" in names and "triton_fp8" in names and len(splits) >= 2
                a16w8 = [c["params"]["num_splits"] for c in candidates if c["route"] == "aiter_a16w8_persistent"]
                assert a16w8 and set(a16w8) <= splits, (batch, kv_len, a16w8)
                # "bf16" (dot_scaled with a bf16 q) spills on gfx950 and issues no scaled MFMA there
                assert {c["params"]["qk_dot_scaled"] for c in candidates if c["route"] == "triton_mxfp4"} == {
                    "none", "e4m3"}


def test_race_lines_round_trip_through_tune_from_log(sub, capsys, tmp_path, repo_root):
    """What a race prints is what tune.py --from-log freezes: the chosen candidate as a fixed row."""
    import tune

    first, fast = persistent(16), persistent(8)
    table = racing_table(first, fast, FP8)
    sub(table, timed((first, 20.0), (fast, 12.0), (FP8, 30.0))).custom_kernel(data())
    (line,) = race_lines(capsys)
    parsed = tune.parse_race_line(f"12:00:01 stderr | {line}  ")
    assert (parsed["table"], parsed["batch"], parsed["kv_len"], parsed["chosen"]) == ("AITER_ROUTE_TABLE", BATCH,
                                                                                         KV_LEN, 2)
    assert [c.get("time_us") for c in parsed["candidates"]] == [20.0, 12.0, 30.0]
    frozen = tune.freeze_rows({"AITER_ROUTE_TABLE": table}, [parsed])["AITER_ROUTE_TABLE"]
    assert frozen[0] == {"max_batch": BATCH, "max_kv_len": KV_LEN, **fast}
    assert frozen[1:] == table[1:]
    log, copy = tmp_path / "race.txt", tmp_path / "submission.py"
    log.write_text("benchmark report\n" + line + "\n")
    copy.write_text((repo_root / "submission.py").read_text())
    capsys.readouterr()
    assert tune.main(["--from-log", str(log), "--submission", str(copy)]) == 0
    printed = capsys.readouterr().out
    assert f'{{"max_batch": {BATCH}, "max_kv_len": {KV_LEN}, "route": "{ROUTE}",' in printed
    assert '"num_splits": 8' in printed


def test_the_judge_reads_mxfp4_as_the_reference_does(golden_mxfp4_path):
    """aiter's own MXFP4 bytes (tests/data): the judge's decode equals reference.py's, bit for bit."""
    import submission

    golden = torch.load(golden_mxfp4_path)
    packed, scales = golden["fp4_packed_uint8"], golden["scale_e8m0_uint8"]
    ours = submission.dequantize_mxfp4(packed, scales)
    assert torch.equal(ours, reference.dequantize_mxfp4(packed, scales))


def test_the_measuring_processes_mxfp4_cache_is_a_faithful_encoding():
    """Its own quantiser (not aiter's bit-exact one): every value within half an e2m1 step of its
    block scale, and about the error of the leaderboard's quantiser."""
    import submission

    kv = (torch.randn(300, 1, 576) * torch.logspace(-3, 3, 300)[:, None, None]).to(torch.bfloat16)
    packed, scales = submission.quantize_mxfp4(kv)
    assert packed.shape == (300, 1, 288) and scales.shape == (512, 24) and not scales[300:].any()
    ours = submission.dequantize_mxfp4(packed[:, 0], scales[:300, :18])
    x = kv[:, 0].float()
    block_scale = torch.exp2(scales[:300, :18].float() - 127).repeat_interleave(32, dim=1)
    assert ((ours - x).abs() <= block_scale + 1e-30).all()  # the widest e2m1 step is 2: half of it
    data, their_scales = reference.quantize_mxfp4(kv, use_aiter=False)
    theirs = reference.dequantize_mxfp4(data, their_scales, rows=300)[:, 0]
    ours_error, their_error = ((ours - x).norm() / x.norm()).item(), ((theirs - x).norm() / x.norm()).item()
    assert ours_error <= 1.1 * their_error


def test_the_triton_routes_pass_the_judge_on_the_measuring_processes_inputs():
    """The inputs race_inputs makes, the judge of each Triton format (interpreter on the CPU): the
    honest routes pass, zeros do not."""
    import submission

    device = "cuda" if torch.cuda.is_available() else "cpu"
    data = submission.race_inputs(2, 64, {"fp8", "mxfp4"}, torch.float8_e4m3fn, device)
    truth = submission.RaceTruth(data)
    for candidate in ({"route": "triton_fp8", "params": {"num_splits": 2, "block_n": 32}},
                      {"route": "triton_mxfp4", "params": {"num_splits": 2, "block_n": 32}}):
        out = submission.ROUTES[candidate["route"]](*data, **candidate["params"])
        assert submission.race_judge(truth, candidate, out) is None, candidate
        assert submission.race_judge(truth, candidate, torch.zeros_like(out)).startswith("rel 1>")

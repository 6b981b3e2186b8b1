"""The candidate race: on the first call of a leaderboard shape, custom_kernel checks and times a row's
candidates and keeps the fastest right one (submission.py, "Candidate race").

On the CPU with the aiter double: an injected clock and timer make every choice deterministic; the
candidates' outputs are real (the double computes with torch), so the strict check is real too.
"""
import json

import pytest
import torch

import reference
from aiter_double import loader  # tests/ is on sys.path: pytest's rootdir import

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BATCH, KV_LEN = 4, 64
ROUTE = "aiter_a8w8_persistent"


def persistent(splits, page_size=1):
    return {"route": ROUTE, "params": {"page_size": page_size, "num_splits": splits, "q_scale": "unit"}}


FP8 = {"route": "aiter_fp8", "params": {"q_scale": "unit"}}
CATCH_ALL = {"max_batch": None, "max_kv_len": None, "route": ROUTE,
             "params": {"page_size": 1, "num_splits": 32, "q_scale": "tensor"}}


def racing_table(first, *others):
    return [{"max_batch": BATCH, "max_kv_len": KV_LEN, **first, "candidates": list(others)}, CATCH_ALL]


class FakeTimer:
    """Mean time per candidate label; each timing advances the fake clock by `step` seconds."""

    def __init__(self, times_us, step=1.0):
        self.times_us, self.step, self.now, self.timed = times_us, step, 0.0, []

    def clock(self):
        return self.now

    def __call__(self, candidate, fn):
        label = json.dumps(candidate, sort_keys=True)
        self.timed.append(label)
        fn()  # the candidate really runs, as it would between the events
        self.now += self.step
        return self.times_us[label]


def key(candidate):
    return json.dumps(candidate, sort_keys=True)


@pytest.fixture
def sub(monkeypatch):
    """A fresh submission module over the runner's aiter (the double), its race state reset."""
    def load(page_mode=None, table=None, times=None, step=1.0):
        module = loader.load_submission("2026-03-04", page_mode=page_mode).module
        timer = FakeTimer(times or {}, step)
        monkeypatch.setattr(module, "race_timer", timer)
        monkeypatch.setattr(module, "race_clock", timer.clock)
        monkeypatch.setattr(module, "_RACE_SPENT_S", [0.0])
        if table is not None:
            monkeypatch.setattr(module, "AITER_ROUTE_TABLE", table)
        return module, timer
    return load


def data(seed=1):
    return reference.generate_input(BATCH, 1, KV_LEN, seed, device="cpu")


def race_lines(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("submission.py race")]


def strict_error(out, inputs):
    return reference.rel_l2_error(out, inputs)


def test_the_fastest_right_candidate_wins_and_is_kept(sub, capsys):
    first, fast = persistent(16), persistent(8)
    mod, timer = sub(table=racing_table(first, fast, FP8),
                     times={key(first): 20.0, key(fast): 15.0, key(FP8): 17.0})
    inputs = data()
    out = mod.custom_kernel(inputs)
    assert strict_error(out, inputs) <= 0.06
    assert mod.LAST_ROUTE == f"{ROUTE} {fast['params']}"
    (line,) = race_lines(capsys)
    assert line.startswith(f"submission.py race AITER_ROUTE_TABLE bs={BATCH} kv={KV_LEN}: [1] {ROUTE} ")
    assert "20.0 us" in line and "15.0 us" in line and "17.0 us" in line
    assert line.endswith(f'-> chosen [2] {ROUTE} {{"page_size":1,"num_splits":8,"q_scale":"unit"}}')
    timed = len(timer.timed)
    again = mod.custom_kernel(data(seed=2))  # the choice is kept: no second race, no line
    assert len(timer.timed) == timed and race_lines(capsys) == []
    assert again.data_ptr() != out.data_ptr() and mod.LAST_ROUTE == f"{ROUTE} {fast['params']}"


def test_the_first_candidate_stays_unless_beaten_by_three_percent(sub, capsys):
    first, close = persistent(16), persistent(8)
    mod, _ = sub(table=racing_table(first, close), times={key(first): 20.0, key(close): 19.5})
    mod.custom_kernel(data())
    assert mod.LAST_ROUTE == f"{ROUTE} {first['params']}"
    assert race_lines(capsys)[0].endswith(f'-> chosen [1] {ROUTE} {{"page_size":1,"num_splits":16,"q_scale":"unit"}}')


def test_fast_but_wrong_candidates_are_never_chosen(sub, monkeypatch, capsys):
    """A route that returns zeros, and a page-8 row over the double reading one token per page
    (as aiter's q-length-1 kernel is suspected to), both timed fastest: both dropped."""
    first, paged = persistent(16), persistent(8, page_size=8)
    zeros = {"route": "zeros", "params": {}}
    mod, _ = sub(page_mode="first_token", table=racing_table(first, zeros, paged),
                 times={key(first): 20.0, key(zeros): 1.0, key(paged): 2.0})
    monkeypatch.setitem(mod.ROUTES, "zeros", lambda q, *args: torch.zeros(q.shape[0], 16, 512, dtype=torch.bfloat16))
    monkeypatch.setitem(mod.ROUTE_INFO, "zeros", {"kv_format": "fp8", "rel_l2_bound": 0.06})
    inputs = data()
    out = mod.custom_kernel(inputs)
    assert mod.LAST_ROUTE == f"{ROUTE} {first['params']}"
    assert strict_error(out, inputs) <= 0.06
    line = race_lines(capsys)[0]
    assert '[2] zeros {} dropped (rel L2 1 > 0.06)' in line
    assert '[3] aiter_a8w8_persistent {"page_size":8,"num_splits":8,"q_scale":"unit"} dropped (rel L2 ' in line


def test_the_a16w8_candidate_is_checked_against_its_own_bound_and_can_win(sub, capsys):
    first = persistent(16)
    a16w8 = {"route": "aiter_a16w8_persistent", "params": {"page_size": 1, "num_splits": 16}}
    mod, timer = sub(table=racing_table(first, a16w8), times={key(first): 20.0, key(a16w8): 12.0})
    inputs = data()
    out = mod.custom_kernel(inputs)
    assert timer.timed == [key(first), key(a16w8)]
    assert mod.LAST_ROUTE == f"aiter_a16w8_persistent {a16w8['params']}"
    assert strict_error(out, inputs) <= mod.ROUTE_INFO["aiter_a16w8_persistent"]["rel_l2_bound"] == 0.05
    assert race_lines(capsys)[0].endswith('-> chosen [2] aiter_a16w8_persistent {"page_size":1,"num_splits":16}')


def test_a_candidate_that_raises_is_reported_and_skipped(sub, monkeypatch, capsys):
    boom, first = {"route": "boom", "params": {}}, persistent(16)
    mod, timer = sub(table=racing_table(boom, first), times={key(first): 20.0})

    def raises(*args, **kwargs):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setitem(mod.ROUTES, "boom", raises)
    monkeypatch.setitem(mod.ROUTE_INFO, "boom", {"kv_format": "fp8", "rel_l2_bound": 0.06})
    mod.custom_kernel(data())
    line = race_lines(capsys)[0]
    assert "[1] boom {} dropped (raised RuntimeError: no kernel for this shape)" in line
    assert line.endswith(f'-> chosen [2] {ROUTE} {{"page_size":1,"num_splits":16,"q_scale":"unit"}}')
    assert timer.timed == [key(first)]  # the one that raised was never timed


def test_the_shape_budget_keeps_the_best_so_far(sub, capsys):
    """Each timing takes 20 s of the fake clock: after two candidates the 30 s budget is spent."""
    cands = [persistent(16), persistent(8), persistent(4), FP8]
    times = {key(cands[0]): 20.0, key(cands[1]): 10.0, key(cands[2]): 1.0, key(FP8): 1.0}
    mod, timer = sub(table=racing_table(*cands), times=times, step=20.0)
    mod.custom_kernel(data())
    assert len(timer.timed) == 2
    line = race_lines(capsys)[0]
    assert line.endswith('-> chosen [2] aiter_a8w8_persistent {"page_size":1,"num_splits":8,"q_scale":"unit"}'
                         "; budget: stopped after 2 of 4 candidates")


def test_the_process_budget_is_shared_across_shapes(sub, monkeypatch, capsys):
    cands = [persistent(16), persistent(8)]
    mod, timer = sub(table=racing_table(*cands), times={key(c): 5.0 for c in cands}, step=2.0)
    monkeypatch.setattr(mod, "_RACE_SPENT_S", [mod.RACE_PROCESS_BUDGET_S - 1.0])
    mod.custom_kernel(data())
    assert len(timer.timed) == 1 and "budget: stopped after 1 of 2" in race_lines(capsys)[0]
    assert mod._RACE_SPENT_S[0] >= mod.RACE_PROCESS_BUDGET_S


def test_no_survivor_falls_back_to_the_catch_all(sub, monkeypatch, capsys):
    zeros, nans = {"route": "zeros", "params": {}}, {"route": "nans", "params": {}}
    mod, _ = sub(table=racing_table(zeros, nans), times={})
    monkeypatch.setitem(mod.ROUTES, "zeros", lambda q, *args: torch.zeros(q.shape[0], 16, 512, dtype=torch.bfloat16))
    monkeypatch.setitem(mod.ROUTES, "nans", lambda q, *args: torch.full((q.shape[0], 16, 512), float("nan")))
    for name in ("zeros", "nans"):
        monkeypatch.setitem(mod.ROUTE_INFO, name, {"kv_format": "fp8", "rel_l2_bound": 0.06})
    inputs = data()
    out = mod.custom_kernel(inputs)
    assert strict_error(out, inputs) <= 0.06
    assert mod.LAST_ROUTE == f"{ROUTE} {CATCH_ALL['params']}"
    line = race_lines(capsys)[0]
    assert "[2] nans {} dropped (rel L2 nan > 0.06)" in line
    assert line.endswith(f'-> chosen [catch-all] {ROUTE} {{"page_size":1,"num_splits":32,"q_scale":"tensor"}}'
                         "; no candidate survived: the table's catch-all row runs")


def test_other_shapes_and_ragged_lengths_take_the_first_candidate(sub, capsys):
    first, fast = persistent(16), persistent(8)
    mod, timer = sub(table=racing_table(first, fast), times={key(first): 20.0, key(fast): 1.0})
    mod.custom_kernel(reference.generate_input(2, 1, KV_LEN, 3, device="cpu"))  # batch 2 < the row's 4
    ragged = reference.generate_input(BATCH, 1, KV_LEN, 4, kv_lens=[64, 10, 33, 50], device="cpu")
    mod.custom_kernel(ragged)
    assert timer.timed == [] and race_lines(capsys) == []
    assert mod.LAST_ROUTE == f"{ROUTE} {first['params']}"


def test_without_a_gpu_and_without_a_timer_nothing_is_measured(sub, monkeypatch, capsys):
    first, fast = persistent(16), persistent(8)
    mod, _ = sub(table=racing_table(first, fast))
    monkeypatch.setattr(mod, "race_timer", None)
    inputs = data()
    out = mod.custom_kernel(inputs)
    assert mod.LAST_ROUTE == f"{ROUTE} {first['params']}" and race_lines(capsys) == []
    assert strict_error(out, inputs) <= 0.06


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
    mod, _ = sub(table=table, times={key(first): 20.0, key(fast): 12.0, key(FP8): 30.0})
    mod.custom_kernel(data())
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


def test_without_the_bf16_cache_there_is_no_truth_and_no_race(sub, capsys):
    first, fast = persistent(16), persistent(8)
    mod, timer = sub(table=racing_table(first, fast), times={key(first): 20.0, key(fast): 1.0})
    q, kv_data, qo_indptr, kv_indptr, config = data()
    out = mod.custom_kernel((q, {"fp8": kv_data["fp8"]}, qo_indptr, kv_indptr, config))
    assert timer.timed == [] and mod.LAST_ROUTE == f"{ROUTE} {first['params']}"
    assert 'submission.py race skipped bs=4 kv=64: kv_data["bf16"] is missing' in capsys.readouterr().err
    assert out.shape == (BATCH, 16, 512)

"""tune.py: one selection policy with the race (submission.run_measuring measures and judges,
submission.rank_row ranks), the search space, what tune.py adds (seeds, timing options, cache,
report, JSON, chart) and writing the table.

On the CPU with the aiter double: the measuring process is tests/doubles/race_child.py (the submission
over the double, stand-in candidates, a fake timer), so processes, deaths and judging are real
and only the times are injected. Rewrites go to a COPY of submission.py (`sub_copy`).
"""
import json
import sys
from pathlib import Path

import pytest
import torch

import race_child
import reference
import tune
import utils
from aiter_double import loader
from tools import route_tables as rt

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHILD = Path(race_child.__file__).resolve()
GENERATION = "2026-03-04"
A8W8 = "aiter_a8w8_persistent"
FP8 = {"route": "aiter_fp8", "params": {"q_scale": "unit"}}
CATCH_ALL = {"max_batch": None, "max_kv_len": None, "route": A8W8,
             "params": {"page_size": 1, "num_splits": 32, "q_scale": "tensor"}}
REMOVED = {"waves_per_eu", "matrix_instr_nonkdim", "kpack", "amd_knobs", "cooperative_merge"}
TINY = ["--space", "table", "--seeds", "2", "--repeats", "3", "--chart", "", "--no-cache", "--no-progress"]


@pytest.fixture(scope="module", autouse=True)
def environment():
    utils.prepare_environment()


def persistent(splits, q_scale="unit"):
    return {"route": A8W8, "params": {"page_size": 1, "num_splits": splits, "q_scale": q_scale}}


def stand_in(name):
    return {"route": name, "params": {}}


def racing(batch, kv_len, first, *others):
    return {"max_batch": batch, "max_kv_len": kv_len, **first, "candidates": list(others)}


@pytest.fixture
def sub(monkeypatch, tmp_path):
    """A fresh submission over the aiter double whose measuring process is tests/doubles/race_child.py
    with `times` ({candidate: us per call or a list}) and the stand-ins registered."""
    def load(table, times, stand_ins=()):
        module = loader.load_submission(GENERATION).module
        module.race_command = [sys.executable, str(CHILD)]
        module.race_cache_dir = str(tmp_path)
        module.AITER_ROUTE_TABLE = table
        race_child.register(module, stand_ins)
        per_call = {race_child.key(c): t if isinstance(t, list) else [t] * 15 for c, t in times}
        monkeypatch.setenv("RACE_TEST_CHILD", json.dumps(
            {"generation": GENERATION, "stand_ins": list(stand_ins), "times": per_call}))
        return module
    return load


def spec(tmp_path, *shapes):
    path = tmp_path / "spec.txt"
    path.write_text("".join(f"batchsize: {b}; qseqlen: 1; kvseqlen: {k}; seed: {11 + i}\n"
                            for i, (b, k) in enumerate(shapes)))
    return str(path)


def tuned(tmp_path, module, shapes, *extra, capsys=None):
    """Runs tune.py's command line on `module`; returns (exit code, JSON record, printed text)."""
    out = tmp_path / "tune.json"
    code = tune.main([spec(tmp_path, *shapes), *TINY, "--json", str(out), *extra], sub=module)
    printed = capsys.readouterr().out if capsys else ""
    return code, json.loads(out.read_text()), printed


def winners(record):
    return {(s["batch"], s["kv_len"]): s["candidates"][s["winner"] - 1]["candidate"] for s in record["shapes"]}


# ---------------------------------------------------------------------------------------------
# One policy: the race and tune.py choose alike


def test_the_race_and_tune_choose_the_same_winners(sub, tmp_path, capsys):
    """Three rows: the fastest by its median (one slow repeat moves its mean, not its median); one
    2.5% faster than the first, which the margin keeps; a wrong candidate timed fastest (zeros),
    which the judge drops, and an honest one that wins."""
    first, fast, close, zeros = persistent(16), persistent(8), persistent(4), stand_in("zeros")
    table = [racing(2, 64, first, close), racing(4, 32, first, zeros, FP8), racing(4, 64, first, fast, FP8),
             CATCH_ALL]
    times = [(first, 20.0), (fast, [10.0] * 14 + [5000.0]), (FP8, 17.0), (close, 19.5), (zeros, 1.0)]
    raced = sub(table, times, stand_ins=("zeros",))
    chosen = {}
    for batch, kv_len in ((4, 64), (2, 64), (4, 32)):
        raced.custom_kernel(reference.generate_input(batch, 1, kv_len, 3, device="cpu"))
        chosen[(batch, kv_len)] = dict(raced.LAST_CANDIDATE)
    assert chosen == {(4, 64): fast, (2, 64): first, (4, 32): FP8}
    capsys.readouterr()
    code, record, printed = tuned(tmp_path, sub(table, times, stand_ins=("zeros",)), [(4, 64), (2, 64), (4, 32)],
                                  capsys=capsys)
    assert code == tune.EXIT_OK and winners(record) == chosen
    assert "kept ([2] is faster, but not by the race's margin)" in printed
    assert "failed    [2] zeros {}: x rel" in printed
    assert "runner-up [3] aiter_fp8" in printed and "+70.0% over the winner" in printed
    assert record["options"] == {"repeats": 3, "flush": "runner", "candidate_limit_s": tune.DEFAULT_CANDIDATE_LIMIT_S}


def test_a_faulting_candidate_is_contained_named_and_not_started_again(sub, tmp_path, capsys):
    """It kills the measuring process at the first shape (a new process measures the rest) and is
    not started at the second: `died@4x64`, as the race marks it."""
    first, fast, bad = persistent(16), persistent(8), stand_in("segfaults")
    table = [racing(2, 64, first, bad, fast), racing(4, 64, first, bad, fast), CATCH_ALL]
    module = sub(table, [(first, 20.0), (bad, 1.0), (fast, 10.0)], stand_ins=("segfaults",))
    code, record, printed = tuned(tmp_path, module, [(4, 64), (2, 64)], capsys=capsys)
    assert code == tune.EXIT_OK and winners(record) == {(4, 64): fast, (2, 64): fast}
    whys = [s["candidates"][1]["result"]["why"] for s in record["shapes"]]
    assert whys[0].startswith("died") and whys[1] == "died@4x64", whys
    assert f"failed    [2] segfaults {{}}: x {whys[0]}" in printed and "x died@4x64" in printed


def test_write_is_refused_without_a_gpu_and_the_file_left(sub_copy, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: --write is allowed")
    old = sub_copy.read_bytes()
    code = tune.main([spec(tmp_path, (4, 64)), "--write", "--submission", str(sub_copy)])
    assert code == tune.EXIT_BAD_ARGS
    err = capsys.readouterr().err
    assert "--write refused" in err and "no GPU" in err and "interpreter" in err and "--force" in err
    assert sub_copy.read_bytes() == old


def test_write_forced_keeps_the_rows_structure_and_writes_json_and_chart(sub, sub_copy, tmp_path, capsys):
    """The winner leads its row, the replaced route joins its candidates; the catch-all stays."""
    first, fast = persistent(16), persistent(8)
    table = [racing(4, 64, first, fast, FP8), CATCH_ALL]
    module = sub(table, [(first, 20.0), (fast, 10.0), (FP8, 30.0)])
    chart = tmp_path / "tune.png"
    code, record, printed = tuned(tmp_path, module, [(4, 64)], "--write", "--force", "--submission", str(sub_copy),
                                  "--chart", str(chart), capsys=capsys)
    assert code == tune.EXIT_OK and record["written"]
    expected = [racing(4, 64, fast, first, FP8), CATCH_ALL]
    assert rt.read_tables(sub_copy.read_text())["AITER_ROUTE_TABLE"] == record["rows"] == expected
    assert "written into" in printed and chart.stat().st_size > 0
    (shape,) = record["shapes"]
    assert shape["winner"] == 2 and shape["runner_up"] == 1 and shape["ranking"] == [2, 1, 3]
    assert [c["label"] for c in shape["candidates"]] == [rt.label(c) for c in (first, fast, FP8)]


# ---------------------------------------------------------------------------------------------
# What tune.py adds, with run_measuring replaced by a recorder


class Recorder:
    """Stands in for submission.run_measuring: records each call, answers `medians`."""

    def __init__(self, medians):
        self.medians, self.calls = medians, []

    def __call__(self, job_rows, fp8_dtype, deadline, options=None, on_result=None):
        self.calls.append((job_rows, options))
        results = {}
        for shape, candidates in job_rows:
            for index, candidate in candidates:
                median = self.medians.get(rt.label(candidate))
                result = {"median": median, "mean": median, "times": [median]} if median else {"why": "rel 1>0.07"}
                results[(shape, index)] = result
                on_result(shape, index, result)
        return results, ""


def test_seeds_timing_and_flush_are_what_an_offline_tune_adds(sub, tmp_path, monkeypatch):
    first, fast = persistent(16), persistent(8)
    module = sub([racing(4, 64, first, fast), racing(2, 64, first, fast), CATCH_ALL], [])
    recorder = Recorder({rt.label(first): 20.0, rt.label(fast): 10.0})
    monkeypatch.setattr(module, "run_measuring", recorder)
    code = tune.main([spec(tmp_path, (4, 64), (2, 64)), "--space", "table", "--seeds", "3", "--repeats", "7",
                      "--json", str(tmp_path / "t.json"), "--chart", "", "--no-cache", "--no-progress"], sub=module)
    assert code == tune.EXIT_OK and len(recorder.calls) == 2  # one call per shape: its own seeds
    secret = tune.draw_secret_seeds(3)
    for (job_rows, options), case_seed in zip(recorder.calls, (11, 12), strict=True):
        assert options == {"repeats": 7, "flush": "runner", "candidate_limit_s": tune.DEFAULT_CANDIDATE_LIMIT_S,
                           "seeds": [utils.combine_seed(case_seed, b) for b in secret]}
        assert [c for _, c in job_rows[0][1]] == [first, fast]
    assert utils.combine_seed(11, secret[0]) == 11 + (11 + secret[0]) * (12 + secret[0]) // 2


def test_a_second_run_reads_the_cache_and_measures_nothing(sub, tmp_path, monkeypatch, capsys):
    first, fast = persistent(16), persistent(8)
    module = sub([racing(4, 64, first, fast), CATCH_ALL], [])
    monkeypatch.setattr(module, "run_measuring", Recorder({rt.label(first): 20.0, rt.label(fast): 10.0}))
    args = [spec(tmp_path, (4, 64)), "--space", "table", "--cache", str(tmp_path / "cache.jsonl"),
            "--json", str(tmp_path / "t.json"), "--chart", "", "--no-progress"]
    assert tune.main(args, sub=module) == tune.EXIT_OK
    empty = Recorder({})
    monkeypatch.setattr(module, "run_measuring", empty)
    assert tune.main(args, sub=module) == tune.EXIT_OK
    assert empty.calls == []
    record = json.loads((tmp_path / "t.json").read_text())
    assert record["shapes"][0]["winner"] == 2 and record["shapes"][0]["candidates"][1]["result"]["cached"]


def test_a_stopped_tune_writes_nothing_and_exits_3(sub, sub_copy, tmp_path, monkeypatch):
    first, fast = persistent(16), persistent(8)
    module = sub([racing(4, 64, first, fast), CATCH_ALL], [])

    def stopped(job_rows, fp8_dtype, deadline, options=None, on_result=None):
        return {}, "budget"

    monkeypatch.setattr(module, "run_measuring", stopped)
    old = sub_copy.read_bytes()
    code = tune.main([spec(tmp_path, (4, 64)), "--space", "table", "--write", "--force", "--no-cache",
                      "--submission", str(sub_copy), "--json", "", "--chart", "", "--no-progress"], sub=module)
    assert code == tune.EXIT_STOPPED and sub_copy.read_bytes() == old


# ---------------------------------------------------------------------------------------------
# The search space and the table


def test_the_search_space_covers_every_candidate_of_both_tables(repo_root):
    tables = rt.read_tables_file(repo_root / "submission.py")
    for name, rows in tables.items():
        for row in rows:
            for candidate in rt.row_candidates(row):
                grid = tune.SEARCH_SPACE.get(candidate["route"])
                assert grid is not None, (name, candidate)
                for key, value in candidate["params"].items():
                    assert key in grid and value in grid[key], (name, candidate, key)


def test_the_search_space_holds_every_mode_and_no_removed_one():
    module = loader.load_submission(GENERATION).module  # aiter and Triton routes
    functions = {**module.ROUTES, "hopper_fp8": module.hopper_fp8_route}
    assert set(tune.SEARCH_SPACE) == set(functions)
    for route, grid in tune.SEARCH_SPACE.items():
        assert set(grid) == tune.route_keywords(functions[route]), route  # every parameter, no other
        assert not set(grid) & REMOVED, route
    assert set(tune.SEARCH_SPACE["triton_mxfp4"]["qk_dot_scaled"]) == {"none", "e4m3"}
    assert "q_scale" not in tune.SEARCH_SPACE["triton_fp8"] and "qk_fp8" not in tune.SEARCH_SPACE["triton_fp8"]
    assert len(tune.SEARCH_SPACE["aiter_a16w8_persistent"]["num_splits"]) > 1


def test_the_wide_space_follows_the_rows_candidates_and_skips_what_cannot_hold():
    module = loader.load_submission(GENERATION).module
    table = module.AITER_ROUTE_TABLE
    (job,) = tune.plan(module, table, [(4, 1024, 4217)], [1], tune.SEARCH_SPACE)
    row = table[job.row_index]
    assert job.own and job.candidates[:job.from_row] == module.race_candidates(row)
    keys = [json.dumps(c, sort_keys=True) for c in job.candidates]
    assert len(keys) == len(set(keys))
    wide = job.candidates[job.from_row:]
    assert {c["route"] for c in job.candidates} == set(module.ROUTES)  # every route here, none other
    tiled = [c["params"] for c in wide if "block_n" in c["params"]]
    assert tiled and all(1024 // p["num_splits"] >= p["block_n"] for p in tiled)  # no split shorter than a tile
    assert {p["num_splits"] for p in tiled if p["block_n"] == 64} == {1, 2, 4, 8, 16}
    assert any(c["route"] == "aiter_a16w8_persistent" and c["params"]["num_splits"] == 2 for c in wide)


def _job(module, table, index, candidates):
    batch, kv_len = table[index]["max_batch"], table[index]["max_kv_len"]
    return tune.ShapeJob(batch, kv_len, 1, [1], index, True, candidates, len(candidates))


def test_a_hopper_winner_keeps_a_portable_row_after_it_and_a_portable_one_replaces_both(repo_root):
    import submission

    table = rt.read_tables_file(repo_root / "submission.py")["TRITON_ROUTE_TABLE"]
    index = next(i for i, r in enumerate(table) if r["route"] == "hopper_fp8")
    candidates = submission.race_candidates(table[index])
    triton = next(i for i, c in enumerate(candidates) if c["route"] == "triton_fp8")
    job = _job(submission, table, index, candidates)
    timed = {i: {"median": 30.0 + i, "mean": 30.0 + i} for i in range(len(candidates))}
    timed[1] = {"median": 10.0, "mean": 10.0}
    out = {job.shape: tune.outcome(submission, job, timed)}
    rows, _ = tune.new_table(submission, table, [job], {job.shape: timed}, out)
    assert rows[index] == dict(table[index], **candidates[1], candidates=[c for c in candidates if c != candidates[1]])
    assert rows[index + 1] == rt.table_row(candidates[triton]["route"], candidates[triton]["params"], *job.shape)
    assert rows[:index] == table[:index] and rows[index + 2:] == table[index + 2:]
    timed[triton] = {"median": 5.0, "mean": 5.0}
    out = {job.shape: tune.outcome(submission, job, timed)}
    rows, _ = tune.new_table(submission, table, [job], {job.shape: timed}, out)
    assert rows[index]["route"] == "triton_fp8" and len(rows) == len(table) - 1  # the follower is shadowed: gone


def test_the_runner_flush_timer_times_through_utils_and_gives_the_flush_back(monkeypatch):
    """On a GPU, --flush runner is timed by utils.time_call after utils.L2Flusher("runner") (whose
    flush fits an 80 GB card), in us, the flush released after each timing; another flush goes to
    submission.py's own events timer."""
    log = []

    class Flusher:
        def release(self):
            log.append("release")

    flusher = Flusher()

    def time_call(fn, device=None, flush=None):
        assert flush is flusher
        log.append("call")
        return fn(), 2500.0  # ns

    sub = type("Sub", (), {"_events_timer": staticmethod(lambda c, fn, repeats, flush: [f"race {flush}"] * repeats)})
    monkeypatch.setattr(utils, "time_call", time_call)
    timer = tune.runner_flush_timer(sub, flusher)
    assert timer({}, lambda: None, 3, "runner") == [2.5, 2.5, 2.5]
    assert log == ["call"] * 3 + ["release"]
    assert timer({}, lambda: None, 2, "race") == ["race race"] * 2 and log == ["call"] * 3 + ["release"]

    def broken():
        raise RuntimeError("candidate raised")

    with pytest.raises(RuntimeError):
        timer({}, broken, 3, "runner")
    assert log[-1] == "release"

"""tools/compile_times.py: what it compiles for each target, its totals and its budget check
(the compiles themselves run on the GPU machine: `python tools/compile_times.py`)."""
import submission
from tools import compile_times as ct


def test_race_order_and_targets():
    work = ct.racing_work(submission)
    aiter = [w for w in work if w[0] == "AITER_ROUTE_TABLE"]
    triton = [w for w in work if w[0] == "TRITON_ROUTE_TABLE"]
    assert len(aiter) == 8 and len(triton) == 8  # every leaderboard shape races in both tables
    for table, index, shape, candidates in work:
        row = getattr(submission, table)[index]
        assert shape == (row["max_batch"], row["max_kv_len"]) and row.get("candidates")
        assert candidates and all(c["route"] in submission.TRITON_COMPILE_PLANS for c in candidates)
        # in the race's own order
        order = [c for c in submission.race_candidates(row) if c["route"] in submission.TRITON_COMPILE_PLANS]
        assert candidates == order
    assert not any(c["route"].startswith("aiter") for _, _, _, cs in aiter for c in cs)
    assert ct.target_work(work, "gfx950") == aiter
    assert ct.target_work(work, "sm90-launch") == triton
    assert ct.target_work(work, "sm90") == work


def test_totals_and_budget():
    results = {
        "gfx950": [("AITER_ROUTE_TABLE", 0, (4, 1024), "triton_fp8 {}", 2.0, ""),
                   ("AITER_ROUTE_TABLE", 0, (4, 1024), "triton_mxfp4 {}", 3.5, ""),
                   ("AITER_ROUTE_TABLE", 1, (32, 1024), "triton_fp8 {}", 0.0, "(compiled above)"),
                   ("AITER_ROUTE_TABLE", 1, (32, 1024), "triton_mxfp4 {x}", None, "FAILED")],
        "sm90": [("TRITON_ROUTE_TABLE", 0, (4, 1024), "hopper_fp8 {}", 4.0, "")],
    }
    summary, overall = ct.summarise(results)
    assert summary["gfx950"]["rows"] == {("AITER_ROUTE_TABLE", 0): 5.5, ("AITER_ROUTE_TABLE", 1): 0.0}
    assert summary["gfx950"]["total"] == 5.5 and overall == 9.5
    text = "\n".join(ct.format_results(results, summary, overall))
    assert "row total     5.50 s" in text and "failed  triton_mxfp4 {x} FAILED" in text
    budget = "\n".join(ct.budget_lines(results, summary))
    assert "5.5 s for 4 Triton candidates of 2 racing rows" in budget and "verdict: compiles fits" in budget
    results["gfx950"][0] = ("AITER_ROUTE_TABLE", 0, (4, 1024), "triton_fp8 {}", 25.0, "")
    summary, _ = ct.summarise(results)
    assert "DOES NOT FIT" in "\n".join(ct.budget_lines(results, summary))  # one candidate past 20 s
    assert ct.budget_lines({}, {}) == ["budget: no gfx950 figures"]

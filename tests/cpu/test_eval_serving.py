"""eval.py's serving cases (spec lines with heads, page, kv, varlen, causal or zeros): the strict
check, one plan per case, the timed loop, the report and JSON, runner mode, the spec files.

Driven by stand-in submissions written here (pure torch over reference.mla_decode_paged_float64,
and broken ones), not by submission.py, whose serving API may not exist yet; one test runs the
real file on the first two cases of specs/serving_cpu.txt when it has the API."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

import eval as ev
import reference as R
import utils

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPECS = os.path.join(REPO, "specs")

# A correct stand-in: the float64 reference cast to the API's dtypes. Every get_mla_decode_metadata
# call makes a new plan (numbered); every decode call records the number of the plan it was given.
STANDIN = '''
import torch
import reference

PLANS = []
CALLS = []


def get_mla_decode_metadata(*args, **kwargs):
    plan = {"id": len(PLANS)}
    PLANS.append(plan)
    return plan, None


def mla_decode_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, plan,
                            num_splits=None, softmax_scale=None, causal=False, k_scale=None):
    CALLS.append(plan["id"])
    out, lse = reference.mla_decode_paged_float64(q, k_cache, block_table, cache_seqlens,
                                                  k_scale=k_scale, softmax_scale=softmax_scale,
                                                  causal=causal)
    return out[..., :head_dim_v].to(torch.bfloat16), lse.float()


def custom_kernel(data):
    return reference.ref_kernel(data)
'''

# Broken: zeros (and lse zeros) for every case, or only for three heads (runner mode's mix).
ZEROS = '''
import torch


def get_mla_decode_metadata(*args, **kwargs):
    return None, None


def mla_decode_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, plan, **kwargs):
    b, s_q, h, _ = q.shape
    return (torch.zeros(b, s_q, h, head_dim_v, dtype=torch.bfloat16, device=q.device),
            torch.zeros(b, h, s_q, dtype=torch.float32, device=q.device))
'''

PICKY = STANDIN + '''

_right = mla_decode_with_kvcache


def mla_decode_with_kvcache(q, *args, **kwargs):
    out, lse = _right(q, *args, **kwargs)
    return (out * 0, lse) if q.shape[2] == 3 else (out, lse)
'''

CASE_A = ("batchsize: 3; qseqlen: 2; heads: 3; page: 4; kvseqlen: 14; varlen: 1; causal: 1; "
          "kv: fp8; zeros: 1; seed: 11")
CASE_B = "batchsize: 2; qseqlen: 1; heads: 5; page: 1; kvseqlen: 9; kv: bf16; seed: 12"


@pytest.fixture(scope="module")
def subs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving_subs")
    paths = {}
    for name, text in [("standin", STANDIN), ("zeros", ZEROS), ("picky", PICKY)]:
        (root / name).mkdir()
        path = root / name / "submission.py"
        path.write_text(textwrap.dedent(text))
        paths[name] = str(path)
    return paths


@pytest.fixture
def no_popcorn(monkeypatch):
    monkeypatch.delenv("POPCORN_FD", raising=False)
    monkeypatch.delenv("POPCORN_SEED", raising=False)


def write_spec(tmp_path, *lines, name="s.txt"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def human(args, tmp_path):
    out = tmp_path / "r.json"
    rc = ev.main([*args, "--json", str(out)])
    return rc, (json.loads(out.read_text()) if out.exists() else None)


def loaded(path):
    """The module eval.py's human mode imported for ``path`` (to read its records)."""
    return ev.load_submission(path, "_eval_submission")


# ---------------------------------------------------------------------------------------------
# Human mode


def test_serving_cases_pass_with_one_plan_each(subs, tmp_path, no_popcorn, capsys):
    mod = loaded(subs["standin"])
    plans_before = len(mod.PLANS)
    rc, js = human(["test", write_spec(tmp_path, CASE_A, CASE_B), "--submission",
                    subs["standin"]], tmp_path)
    assert rc == 0 and js["passed"]
    a, b = js["cases"]
    assert a["kind"] == b["kind"] == "serving"
    assert a["fields"] == {"batchsize": 3, "qseqlen": 2, "heads": 3, "page": 4, "kvseqlen": 14,
                           "seed": 11, "varlen": True, "causal": True, "kv": "fp8", "zeros": 1, "long": 0}
    assert b["fields"]["page"] == 1 and b["fields"]["varlen"] is False
    assert a["lengths"][0] == 0 and a["zero_rows"] == 2 * 3
    assert 0 < a["rel_l2"] < a["rel_l2_bound"] < 0.5 and a["fp8_out_reach"] > 0.005
    assert 0 <= a["lse_err"] < a["lse_bound"] and a["lse_fraction"] < 1
    assert b["rel_l2_bound"] == 0.01 and b["fp8_out_reach"] is None
    assert "out rel L2" in a["message"] and "bound" in a["message"]
    # one get_mla_decode_metadata call per case, its plan used by the case's one call
    assert len(mod.PLANS) - plans_before == 2
    assert mod.CALLS[-2:] == [plans_before, plans_before + 1]
    text = capsys.readouterr().out
    assert "serving cases (mla_decode_with_kvcache)" in text and "lse err %bound" in text
    assert "serving cases: always strict" in text
    assert "mismatch" not in text  # no leaderboard table


def test_zeros_fail_every_serving_case(subs, tmp_path, no_popcorn, capsys):
    rc, js = human(["test", write_spec(tmp_path, CASE_A, CASE_B), "--submission", subs["zeros"]],
                   tmp_path)
    assert rc == 112 and not js["passed"]
    for row in js["cases"]:
        assert not row["ok"] and row["rel_l2"] == pytest.approx(1.0)
        assert any("out rel L2 1 > bound" in p for p in row["problems"])
    text = capsys.readouterr().out
    assert text.count("FAIL b=") == 2 and "check: fail: 0 of 2" in text


def test_benchmark_times_each_case_with_its_plan(subs, tmp_path, no_popcorn, capsys):
    mod = loaded(subs["standin"])
    plans_before, calls_before = len(mod.PLANS), len(mod.CALLS)
    rc, js = human(["benchmark", write_spec(tmp_path, CASE_A, CASE_B), "--submission",
                    subs["standin"], "--cpu-timing", "--repeats", "3"], tmp_path)
    assert rc == 0 and js["timed"]
    for row in js["cases"]:
        st = row["stats"]
        assert st["runs"] == 3 and st["mean"] > 0 and st["best"] <= st["median"] <= st["worst"]
        per_token = {"bf16": 1152, "fp8": 576}[row["fields"]["kv"]]
        assert row["tokens"] == sum(row["lengths"]) and row["bytes"] == per_token * row["tokens"]
        assert row["gbs"] == pytest.approx(row["bytes"] / st["mean"])
    # the warm-up (first case) and the two cases: three plans, each used by its check call and
    # its three timed calls
    plans = list(range(plans_before, len(mod.PLANS)))
    calls = mod.CALLS[calls_before:]
    assert len(plans) == 3 and [calls.count(p) for p in plans] == [4, 4, 4]
    assert calls == sorted(calls)  # a case's calls all come before the next case's plan
    assert js["geomean_ns"] > 0 and "ref_geomean_ns" not in js
    text = capsys.readouterr().out
    for column in ("mean+-err us", "GB/s %copy", "out relL2 %bound", "lse err %bound"):
        assert column in text


def test_a_file_may_mix_leaderboard_and_serving_cases(subs, tmp_path, no_popcorn, capsys):
    spec = write_spec(tmp_path, "batchsize: 1; qseqlen: 1; kvseqlen: 16; seed: 1", CASE_B)
    rc, js = human(["test", spec, "--submission", subs["standin"], "--strict"], tmp_path)
    assert rc == 0
    assert [r.get("kind") for r in js["cases"]] == [None, "serving"]
    text = capsys.readouterr().out
    assert "mismatch" in text and "serving cases (mla_decode_with_kvcache)" in text


@pytest.mark.parametrize("line,field", [
    ("batchsize: 2; heads: 3; page: 4; kvseqlen: 9; seed: 1; pages: 2", "pages"),
    ("batchsize: 2; heads: 3; page: 3; kvseqlen: 9; seed: 1", "page"),
    ("batchsize: 2; heads: 3; kv: fp4; kvseqlen: 9; seed: 1", "kv"),
    ("batchsize: 2; heads: 3; kvseqlen: 9", "seed"),
    ("batchsize: 2; qseqlen: 9; causal: 1; kvseqlen: 9; seed: 1", "qseqlen"),
    ("batchsize: 2; zeros: 3; kvseqlen: 9; seed: 1", "zeros"),
    ("batchsize: 2; varlen: 2; kvseqlen: 9; seed: 1", "varlen"),
    ("batchsize: 2; heads: 3; kv_lens: 4 5; seed: 1", "kv_lens"),
])
def test_bad_serving_lines_exit_2_naming_the_field(subs, tmp_path, no_popcorn, capsys, line,
                                                   field):
    rc = ev.main(["test", write_spec(tmp_path, line), "--submission", subs["standin"]])
    assert rc == 2
    err = capsys.readouterr().err
    assert field in err and "cannot read spec file" in err


def test_labels_and_shape_keys_of_serving_cases():
    args = utils.parse_spec_line(CASE_A)
    assert ev.is_serving_case(args) and not ev.is_serving_case(
        utils.parse_spec_line("batchsize: 1; qseqlen: 1; kvseqlen: 16; seed: 1"))
    assert ev._label(args) == "b=3 s_q=2 h_q=3 page=4 s_k=14 varlen causal fp8 zeros=1 seed=11"
    assert ev._short_label(args) == "b3 q2 h3 p4 k14 var causal fp8 z1"
    assert ev._label(utils.parse_spec_line(CASE_B)) == "b=2 s_q=1 h_q=5 page=1 s_k=9 bf16 seed=12"
    other_seed = dict(args, seed=99)
    assert ev._shape_key(args) == ev._shape_key(other_seed)
    assert ev._shape_key(args) != ev._shape_key(dict(args, kv="bf16"))
    assert ev.serving_input_args({"batchsize": 2, "kvseqlen": 5, "seed": 1, "kv": "fp8"}) == {
        "batchsize": 2, "qseqlen": 1, "heads": 16, "page": 64, "kvseqlen": 5, "seed": 1,
        "varlen": False, "causal": False, "kv": "fp8", "zeros": 0, "long": 0}


def test_the_widest_serving_row_fits_120_columns():
    args = utils.parse_spec_line("batchsize: 128; qseqlen: 8; heads: 128; page: 128; "
                                 "kvseqlen: 32768; varlen: 1; causal: 1; kv: fp8; zeros: 2; "
                                 "seed: 9")
    row = {"kind": "serving", "case": ev._label(args), "args": args,
           "fields": ev.serving_input_args(args), "ok": False, "problems": [],
           "stats": {"mean": 98765.4e3, "err": 1234.5e3, "median": 1e8}, "bytes": 4.7e10,
           "rel_l2": 0.12345, "rel_l2_bound": 0.05, "lse_err": 0.1234, "lse_bound": 0.05,
           "lse_fraction": 2.468}
    for wide, limit in ((False, 120), (True, 160)):
        table = ev.format_serving_table([row], "benchmark", 4800.0, wide=wide)
        assert max(len(line) for line in table.splitlines()) <= limit, table


# ---------------------------------------------------------------------------------------------
# Runner mode (POPCORN_FD)


def test_runner_mode_checks_and_times_serving_cases(subs, tmp_path):
    spec = write_spec(tmp_path, CASE_B, CASE_A)  # picky fails the three-head case
    out_path = tmp_path / "popcorn.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("POPCORN_FD", "POPCORN_SEED")}
    with open(out_path, "w") as f:
        env["POPCORN_FD"] = str(f.fileno())
        proc = subprocess.run([sys.executable, os.path.join(REPO, "eval.py"), "test", spec,
                               "--submission", subs["picky"]], env=env, pass_fds=(f.fileno(),),
                              capture_output=True, text=True, timeout=300)
    kv = dict(line.partition(": ")[::2] for line in out_path.read_text().splitlines())
    assert proc.returncode == 112, proc.stderr
    assert kv["test-count"] == "2" and kv["test.0.spec"] == CASE_B
    assert kv["test.0.status"] == "pass" and "out rel L2" in kv["test.0.message"]
    assert kv["test.1.status"] == "fail" and "out rel L2 1 > bound" in kv["test.1.error"]
    assert kv["check"] == "fail"


def test_runner_benchmark_job_of_a_serving_case_returns_stats(subs):
    sub = loaded(subs["standin"])
    stats = ev.run_benchmark_case(sub, utils.parse_spec_line(CASE_B), recheck=True,
                                  max_repeats=2, max_time_ns=1e9, flush_mode="none")
    assert stats.runs == 2 and stats.mean > 0
    failure = ev.run_benchmark_case(loaded(subs["zeros"]), utils.parse_spec_line(CASE_B),
                                    recheck=False, max_repeats=2, max_time_ns=1e9)
    assert isinstance(failure, str) and "out rel L2 1 > bound" in failure


# ---------------------------------------------------------------------------------------------
# The spec files


def _serving_cases(name):
    cases = utils.read_spec_file(os.path.join(SPECS, name))
    assert cases and all(ev.is_serving_case(c.args) for c in cases)
    ev.check_serving_cases(cases)
    return [ev.serving_input_args(c.args) for c in cases]


def test_serving_spec_grid_and_engine_shapes():
    cases = _serving_cases("serving.txt")
    grid = {(c["heads"], c["qseqlen"], c["page"], c["varlen"], c["causal"], c["kv"])
            for c in cases if 300 <= c["kvseqlen"] <= 700 and 3 <= c["batchsize"] <= 8}
    want = {(h, s, p, v, c, kv) for h in (1, 3, 16, 63, 64, 128) for s in (1, 2, 4)
            for p in (1, 16, 64) for v in (False, True) for c in (False, True)
            for kv in ("bf16", "fp8")}
    assert want <= grid
    assert sum(1 for c in cases if c["zeros"]) > 100
    engines = {(c["qseqlen"], c["causal"], c["heads"], c["kvseqlen"], c["kv"]) for c in cases
               if c["batchsize"] == 128 and c["page"] == 64 and c["varlen"]}
    assert engines == {(s, s == 2, h, k, kv) for s in (1, 2) for h in (16, 128)
                       for k in (4096, 8192, 16384, 32768) for kv in ("bf16", "fp8")}
    skewed = {(c["heads"], c["kv"]) for c in cases if c["long"]}
    assert skewed == {(h, kv) for h in (16, 128) for kv in ("bf16", "fp8")}
    assert all(c["batchsize"] == 128 and c["kvseqlen"] == 1024 and c["long"] == 65536 for c in cases if c["long"])
    assert len({c["seed"] for c in cases}) == len(cases)


def test_a_long_request_among_short_ones():
    """`long`: the last request's length (the issue's batch of 127 x 1k and one of 64k), named in
    the case's labels; 0 leaves the lengths as they were; a negative one is refused by name."""
    args = utils.parse_spec_line("batchsize: 4; kvseqlen: 9; long: 70; seed: 3")
    assert ev.is_serving_case(args)
    fields = ev.serving_input_args(args)
    assert R.serving_lengths(4, 1, 9, 3, varlen=False, zeros=0, long=fields["long"]) == [9, 9, 9, 70]
    assert R.serving_lengths(4, 1, 9, 3, varlen=False, zeros=0) == [9] * 4
    assert R.generate_serving_input(4, 1, 2, 16, 9, 3, long=70).lengths == [9, 9, 9, 70]
    assert "long=70" in ev._label(args) and ev._short_label(args).endswith("L70")
    with pytest.raises(ValueError, match="long"):
        ev.serving_input_args(dict(args, long=-1))


def test_serving_cpu_spec_is_tiny_and_covers_the_formats():
    cases = _serving_cases("serving_cpu.txt")
    assert 4 <= len(cases) <= 8
    assert all(2 <= c["batchsize"] <= 3 and c["kvseqlen"] <= 80 and c["page"] in (1, 16)
               and c["qseqlen"] in (1, 2) for c in cases)
    assert {c["heads"] for c in cases} == {1, 3, 16, 20}
    assert {c["kv"] for c in cases} == {"bf16", "fp8"}
    assert any(c["zeros"] for c in cases) and any(c["causal"] for c in cases)
    assert all(max(R.serving_lengths(c["batchsize"], c["qseqlen"], c["kvseqlen"], c["seed"],
                                     varlen=c["varlen"], zeros=c["zeros"])) <= 160 for c in cases)


# ---------------------------------------------------------------------------------------------
# The real submission.py, once it has the serving API


def test_real_submission_passes_the_first_cpu_serving_cases(tmp_path, no_popcorn):
    import submission

    if not hasattr(submission, "mla_decode_with_kvcache"):
        pytest.skip("submission.py has no mla_decode_with_kvcache yet")
    with open(os.path.join(SPECS, "serving_cpu.txt")) as f:
        lines = [line.strip() for line in f if line.strip() and not line.startswith("#")][:2]
    rc, js = human(["test", write_spec(tmp_path, *lines), "--submission",
                    os.path.join(REPO, "submission.py")], tmp_path)
    assert rc == 0, [(r["case"], r["problems"], r.get("message")) for r in js["cases"]]

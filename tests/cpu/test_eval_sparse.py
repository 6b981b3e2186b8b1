"""eval.py's sparse cases (spec lines with `sparse: 1` or `topk`): routing before the serving
fields, the strict check through the submission's sparse form, one plan per case, the table and
JSON, runner mode, bad lines, the spec files.

Driven by stand-in submissions written here (the float64 reference in FlashMLA's form, and
zeros), and by the repository's submission.py on the first case of specs/sparse_cpu.txt."""
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

# A correct stand-in in FlashMLA's sparse form: the float64 reference over the dequantised cache.
STANDIN = '''
import torch
import reference

PLANS = []
CALLS = []


def get_mla_decode_metadata(*args, **kwargs):
    plan = {"id": len(PLANS)}
    PLANS.append(plan)
    return plan, None


def mla_decode_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, plan, num_splits=None,
                            softmax_scale=None, causal=False, k_scale=None, is_fp8_kvcache=False,
                            indices=None, topk_length=None):
    assert indices is not None and is_fp8_kvcache and block_table is None and not causal
    CALLS.append(plan["id"])
    out, lse = reference.mla_decode_sparse_float64(q, k_cache, indices, topk_length, softmax_scale)
    return out.to(torch.bfloat16), lse.float()
'''

ZEROS = STANDIN.replace("return out.to(torch.bfloat16), lse.float()",
                        "return (0 * out).to(torch.bfloat16), lse.float()")

# A stand-in whose kernel multiplies fp8 q, and says so (sparse_q_format): the references take that q.
FP8_Q = STANDIN.replace("reference.mla_decode_sparse_float64(q,", "reference.mla_decode_sparse_float64("
                        "reference.round_q_sparse_fp8(q),") + """

def sparse_q_format(q, k_cache):
    return "fp8"
"""

CASE_A = ("sparse: 1; batchsize: 3; qseqlen: 2; heads: 4; page: 16; kvseqlen: 40; varlen: 1; topk: 32; "
          "topk_length: 1; zeros: 1; seed: 31")
CASE_B = "batchsize: 2; heads: 3; page: 1; kvseqlen: 20; topk: 16; seed: 32"


@pytest.fixture(scope="module")
def subs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sparse_subs")
    paths = {}
    for name, text in [("standin", STANDIN), ("zeros", ZEROS), ("fp8_q", FP8_Q)]:
        (root / name).mkdir()
        path = root / name / "submission.py"
        path.write_text(textwrap.dedent(text))
        paths[name] = str(path)
    return paths


@pytest.fixture
def no_popcorn(monkeypatch):
    monkeypatch.delenv("POPCORN_FD", raising=False)
    monkeypatch.delenv("POPCORN_SEED", raising=False)


def write_spec(tmp_path, *lines):
    path = tmp_path / "s.txt"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def human(args, tmp_path):
    out = tmp_path / "r.json"
    rc = ev.main([*args, "--json", str(out)])
    return rc, (json.loads(out.read_text()) if out.exists() else None)


def test_sparse_lines_are_sparse_cases_before_serving_ones():
    a, b = utils.parse_spec_line(CASE_A), utils.parse_spec_line(CASE_B)
    assert ev.is_sparse_case(a) and ev.is_sparse_case(b)  # `sparse` or `topk`
    assert not ev.is_serving_case(a) and not ev.is_serving_case(b)
    assert ev.sparse_input_args(b) == {"batchsize": 2, "qseqlen": 1, "heads": 3, "page": 1, "kvseqlen": 20,
                                       "topk": 16, "seed": 32, "varlen": False, "topk_length": False, "zeros": 0}
    assert ev._short_label(a) == "b3 q2 h4 p16 k40 var t32 len z1"
    assert ev._label(a).startswith("sparse b=3 s_q=2 h_q=4 page=16 s_k=40 varlen topk=32 topk_length")
    assert ev._shape_key(a)[0] == "sparse" and ev._shape_key(a) != ev._shape_key(b)


@pytest.mark.parametrize("line,field", [
    ("sparse: 1; batchsize: 2; kvseqlen: 9; seed: 1", "topk"),
    ("sparse: 2; batchsize: 2; kvseqlen: 9; topk: 4; seed: 1", "sparse"),
    ("topk: 4; batchsize: 2; kvseqlen: 9; seed: 1; causal: 1", "causal"),
    ("topk: 4; batchsize: 2; kvseqlen: 9; seed: 1; kv: fp8", "kv"),
    ("topk: 0; batchsize: 2; kvseqlen: 9; seed: 1", "topk"),
    ("topk: 4; batchsize: 2; heads: 129; kvseqlen: 9; seed: 1", "heads"),
    ("topk: 4; batchsize: 2; topk_length: 3; kvseqlen: 9; seed: 1", "topk_length"),
])
def test_bad_sparse_lines_exit_2_naming_the_field(subs, tmp_path, no_popcorn, capsys, line, field):
    rc = ev.main(["test", write_spec(tmp_path, line), "--submission", subs["standin"]])
    assert rc == 2
    assert field in capsys.readouterr().err


def test_sparse_cases_pass_with_one_plan_each(subs, tmp_path, no_popcorn, capsys):
    mod = ev.load_submission(subs["standin"], "_eval_submission")
    plans_before = len(mod.PLANS)
    rc, js = human(["test", write_spec(tmp_path, CASE_A, CASE_B), "--submission", subs["standin"]], tmp_path)
    assert rc == 0 and js["passed"]
    a, b = js["cases"]
    assert a["kind"] == b["kind"] == "sparse"
    assert a["route"] == "mla_decode_with_kvcache"  # the submission's own sparse form
    assert a["lengths"][0] == 0 and a["zero_rows"] >= 2 * 4
    assert 0 < a["rel_l2"] < a["rel_l2_bound"] == pytest.approx(1.25 * a["format_out"])
    assert a["rel_l2_exact"] < 0.005 and a["lse_fraction"] < 1
    assert a["tokens"] > 0 and a["bytes"] == 656 * a["tokens"]
    assert a["q_format"] == b["q_format"] == "bf16" and a["message"].startswith("q bf16: ")  # no sparse_q_format
    assert len(mod.PLANS) - plans_before == 2 and mod.CALLS[-2:] == [plans_before, plans_before + 1]
    text = capsys.readouterr().out
    assert "sparse cases (mla_decode_with_kvcache):" in text and "vs fp8 cache" in text
    assert "always strict" in text


def test_the_references_take_the_q_the_submission_names(subs, tmp_path, no_popcorn, capsys):
    """A kernel of fp8 q whose sparse_q_format says so passes, judged with round_q_sparse_fp8(q) in
    both references (against bf16 q its lse would miss the dequantised cache's bound); the table's q
    column and the rows say fp8."""
    assert "reference.mla_decode_sparse_float64(reference.round_q_sparse_fp8(q)," in FP8_Q
    rc, js = human(["test", write_spec(tmp_path, CASE_A, CASE_B), "--submission", subs["fp8_q"]], tmp_path)
    assert rc == 0 and js["passed"], [row["problems"] for row in js["cases"]]
    for row in js["cases"]:
        assert row["q_format"] == "fp8" and row["message"].startswith("q fp8: ")
        assert row["rel_l2_exact"] < 0.005
    text = capsys.readouterr().out
    head = next(line for line in text.splitlines() if line.lstrip().startswith("b "))
    assert head.split()[10] == "q" and "q: the q both float64 references multiply" in text
    assert sum(line.split()[10:11] == ["fp8"] for line in text.splitlines()) == 2


def test_zeros_fail_every_sparse_case(subs, tmp_path, no_popcorn, capsys):
    rc, js = human(["test", write_spec(tmp_path, CASE_A, CASE_B), "--submission", subs["zeros"]], tmp_path)
    assert rc == 112 and not js["passed"]
    for row in js["cases"]:
        assert not row["ok"] and row["rel_l2"] == pytest.approx(1.0)
    assert capsys.readouterr().out.count("FAIL sparse b=") == 2


def test_benchmark_and_runner_mode(subs, tmp_path, no_popcorn, capsys):
    rc, js = human(["benchmark", write_spec(tmp_path, CASE_B), "--submission", subs["standin"], "--cpu-timing",
                    "--repeats", "2"], tmp_path)
    assert rc == 0 and js["cases"][0]["stats"]["runs"] == 2 and js["cases"][0]["gbs"] > 0
    assert "mean+-err us" in capsys.readouterr().out
    out_path = tmp_path / "popcorn.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("POPCORN_FD", "POPCORN_SEED")}
    with open(out_path, "w") as f:
        env["POPCORN_FD"] = str(f.fileno())
        proc = subprocess.run([sys.executable, os.path.join(REPO, "eval.py"), "test", write_spec(tmp_path, CASE_B),
                               "--submission", subs["zeros"]], env=env, pass_fds=(f.fileno(),),
                              capture_output=True, text=True, timeout=300)
    kv = dict(line.partition(": ")[::2] for line in out_path.read_text().splitlines())
    assert proc.returncode == 112, proc.stderr
    assert kv["test.0.status"] == "fail" and "out rel L2 1 > bound" in kv["test.0.error"]


def test_the_submission_runs_the_first_cpu_case(tmp_path, no_popcorn):
    """The repository's submission.py, through its own sparse form."""
    with open(os.path.join(SPECS, "sparse_cpu.txt")) as f:
        line = next(line.strip() for line in f if line.strip() and not line.startswith("#"))
    rc, js = human(["test", write_spec(tmp_path, line), "--submission", os.path.join(REPO, "submission.py")],
                   tmp_path)
    assert rc == 0, js["cases"][0]["problems"]
    assert js["cases"][0]["route"] == "mla_decode_with_kvcache"


# ---------------------------------------------------------------------------------------------
# The spec files


def _sparse_cases(name):
    cases = utils.read_spec_file(os.path.join(SPECS, name))
    assert cases and all(ev.is_sparse_case(c.args) for c in cases)
    ev.check_serving_cases(cases)
    return [ev.sparse_input_args(c.args) for c in cases]


def test_the_sparse_spec_grid_and_flashmlas_shapes():
    cases = _sparse_cases("sparse.txt")
    grid = {(c["heads"], c["qseqlen"], c["page"], c["topk"], c["topk_length"]) for c in cases}
    assert {(h, s, p, t, n) for h in (1, 16, 64, 128) for s in (1, 2) for p in (1, 64) for t in (128, 2048)
            for n in (False, True)} <= grid
    bench = {(c["batchsize"], c["heads"]) for c in cases
             if (c["qseqlen"], c["kvseqlen"], c["varlen"], c["topk"], c["page"]) == (2, 32768, True, 2048, 64)}
    assert bench == {(b, h) for b in (2, 64, 74, 128) for h in (64, 128)}
    assert {c["heads"] for c in cases if c["topk"] == 16384 and c["batchsize"] == 148} == {64, 128}
    assert any(c["zeros"] for c in cases) and any(c["qseqlen"] == 8 for c in cases)
    assert {2, 61, 576} <= {c["page"] for c in cases}
    assert len({c["seed"] for c in cases}) == len(cases)


def test_the_cpu_sparse_spec_is_tiny():
    cases = _sparse_cases("sparse_cpu.txt")
    assert 4 <= len(cases) <= 8
    assert all(c["batchsize"] <= 3 and c["kvseqlen"] <= 300 and c["topk"] <= 256 for c in cases)
    assert {c["heads"] for c in cases} >= {16, 64} and {c["page"] for c in cases} >= {1, 64}
    assert any(c["topk_length"] for c in cases) and any(c["zeros"] for c in cases)
    assert all(max(R.serving_lengths(c["batchsize"], c["qseqlen"], c["kvseqlen"], c["seed"], varlen=c["varlen"],
                                     zeros=c["zeros"])) <= 600 for c in cases)

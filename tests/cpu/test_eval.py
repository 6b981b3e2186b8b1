"""eval.py: the runner drop-in (POPCORN_FD, one spawned worker per mode, exit codes, secret seed)
and the human mode (tables, JSON, strict accuracy), driven with tiny fake submissions.

Device-independent: inputs are generated where eval.py generates them (the GPU when there is one,
whose random stream differs from the CPU's), and CPU-only wording is asserted only on the CPU."""
import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import eval as ev
import reference as R
import utils

ON_GPU = torch.cuda.is_available()

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A submission that returns the reference for short KV and zeros for longer KV (zeros fail the
# check there), and records a hash of every q it is called with.
PICKY = '''
import hashlib, os
import torch
from task import input_t, output_t
import reference

LAST_ROUTE = None
ROUTE_INFO = {"ref": {"kv_format": "fp8", "rel_l2_bound": 0.05},
              "zeros": {"kv_format": "bf16", "rel_l2_bound": 0.05}}


def custom_kernel(data: input_t) -> output_t:
    global LAST_ROUTE
    q, kv_data, qo_indptr, kv_indptr, config = data
    record = os.environ.get("EVAL_TEST_RECORD")
    if record:
        with open(record, "a") as f:
            f.write(hashlib.sha1(q.view(torch.int16).cpu().numpy().tobytes()).hexdigest() + "\\n")
    if config["kv_seq_len"] < 40:
        LAST_ROUTE = "ref {}"
        return reference.ref_kernel(data)
    LAST_ROUTE = "zeros {}"
    return torch.zeros(q.shape[0], 16, 512, dtype=torch.bfloat16, device=q.device)
'''

ZEROS = '''
import torch
LAST_ROUTE = "zeros"
ROUTE_INFO = {"zeros": {"kv_format": "bf16", "rel_l2_bound": 0.05}}
def custom_kernel(data):
    q = data[0]
    return torch.zeros(q.shape[0], 16, 512, dtype=torch.bfloat16, device=q.device)
'''

BARE = '''
import reference
def custom_kernel(data):
    return reference.ref_kernel(data)
'''

CACHED = '''
import reference
_OUT = {}
LAST_ROUTE = "cached"
ROUTE_INFO = {"cached": {"kv_format": "fp8", "rel_l2_bound": 0.05}}
def custom_kernel(data):
    out = reference.ref_kernel(data)
    key = tuple(out.shape)
    if key not in _OUT:
        _OUT[key] = out
    _OUT[key].copy_(out)
    return _OUT[key]
'''

ONE_NAN = '''
import reference
LAST_ROUTE = "nan"
def custom_kernel(data):
    out = reference.ref_kernel(data)
    out.view(-1)[3] = float("nan")
    return out
'''

# Counts its calls in a module global and records "<pid> <count>" per call and "import <pid>" per
# import: the record shows whether module state lived across the cases of a mode. A repeat on the
# same input object (the timed loop of benchmark mode) returns a copy of the last output, so that
# up to 1000 repeats per case stay cheap on the CPU.
COUNTING = '''
import os
import reference

CALLS = 0
LAST = (None, None)
with open(os.environ["EVAL_TEST_RECORD"], "a") as f:
    f.write(f"import {os.getpid()}\\n")


def custom_kernel(data):
    global CALLS, LAST
    CALLS += 1
    with open(os.environ["EVAL_TEST_RECORD"], "a") as f:
        f.write(f"{os.getpid()} {CALLS}\\n")
    if LAST[0] is not data:
        LAST = (data, reference.ref_kernel(data))
    return LAST[1].clone()
'''

# Kills its own process on the case with KV length 20 (a crash in the submission).
DIES = '''
import os
import reference


def custom_kernel(data):
    if data[4]["kv_seq_len"] == 20:
        os._exit(3)
    return reference.ref_kernel(data)
'''

# Declares route_label and LAST_CANDIDATE as submission.py does, with a long parameter set: the
# report must show the short label by default and the full one with --wide.
LABELLED = '''
import json
import reference

ROUTE_INFO = {"aiter_a16w8_persistent": {"kv_format": "fp8", "rel_l2_bound": 0.05}}
PARAMS = {"num_splits": 16, "num_warps": 4, "num_stages": 2, "block_n": 64, "page_size": 1,
          "q_scale": "program", "padding": "x" * 60}
LAST_CANDIDATE = None
LAST_ROUTE = None


def route_label(candidate, short=False):
    params = candidate["params"]
    if short:
        return candidate["route"] + (f" s{params['num_splits']}" if "num_splits" in params else "")
    return candidate["route"] + " " + json.dumps(params, separators=(",", ":"))


def custom_kernel(data):
    global LAST_CANDIDATE, LAST_ROUTE
    LAST_CANDIDATE = {"route": "aiter_a16w8_persistent", "params": dict(PARAMS)}
    LAST_ROUTE = route_label(LAST_CANDIDATE)
    return reference.ref_kernel(data)
'''

SPEC3 = ("batchsize: 1; qseqlen: 1; kvseqlen: 16; seed: 5\n"
         "batchsize: 2; qseqlen: 1; kvseqlen: 45; seed: 6\n"
         "batchsize: 1; qseqlen: 1; kvseqlen: 20; seed: 7\n")


def q_hash(seed, bs=1, kv=16):
    """Hash of the q that eval.py makes for this case: on eval.py's default device, since the
    GPU's random stream differs from the CPU's."""
    q = R.generate_input(bs, 1, kv, seed, device=utils.get_device())[0]
    return hashlib.sha1(q.view(torch.int16).cpu().numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def subs(tmp_path_factory):
    root = tmp_path_factory.mktemp("subs")
    paths = {}
    for name, text in [("picky", PICKY), ("zeros", ZEROS), ("bare", BARE), ("cached", CACHED),
                       ("nan", ONE_NAN), ("counting", COUNTING), ("dies", DIES),
                       ("labelled", LABELLED)]:
        d = root / name
        d.mkdir()
        (d / "submission.py").write_text(textwrap.dedent(text))
        paths[name] = str(d / "submission.py")
    spec3 = root / "spec3.txt"
    spec3.write_text(SPEC3)
    paths["spec3"] = str(spec3)
    return paths


def run_popcorn(args, tmp_path, *, sub_dir=None, env_extra=None, fd=True):
    """Run eval.py as the runner does; returns (exit code, {key: value}, ordered keys, stderr)."""
    out_path = tmp_path / "popcorn.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("POPCORN_FD", "POPCORN_SEED")}
    env.update(env_extra or {})
    with open(out_path, "w") as f:
        pass_fds = ()
        if fd:
            env["POPCORN_FD"] = str(f.fileno())
            pass_fds = (f.fileno(),)
        proc = subprocess.run([sys.executable, os.path.join(REPO, "eval.py"), *args],
                              cwd=sub_dir or REPO, env=env, pass_fds=pass_fds,
                              capture_output=True, text=True, timeout=300)
    keys, values = [], {}
    for line in out_path.read_text().splitlines():
        key, _, value = line.partition(": ")
        keys.append(key)
        values[key] = value
    return proc.returncode, values, keys, proc.stderr


# ---------------------------------------------------------------------------------------------
# Runner mode


def test_popcorn_test_mode_statuses_exit_code_and_secret_seed(subs, tmp_path):
    record = tmp_path / "record.txt"
    # run from the submission's directory, as the runner does (./submission.py)
    rc, kv, keys, err = run_popcorn(
        ["test", subs["spec3"]], tmp_path, sub_dir=os.path.dirname(subs["picky"]),
        env_extra={"POPCORN_SEED": "123", "EVAL_TEST_RECORD": str(record)})
    assert rc == 112, err
    assert kv["test-count"] == "3"
    assert kv["test.0.spec"] == "batchsize: 1; qseqlen: 1; kvseqlen: 16; seed: 5"
    assert kv["test.0.status"] == "pass" and "mismatch ratio" in kv["test.0.message"]
    assert kv["test.1.status"] == "fail" and "mismatch ratio" in kv["test.1.error"]
    assert kv["test.2.status"] == "pass"
    assert keys[-1] == "check" and kv["check"] == "fail"
    # every case's seed a became a + (a + b)(a + b + 1) / 2 with b = POPCORN_SEED
    def cantor(a, b=123):
        return a + (a + b) * (a + b + 1) // 2

    calls = record.read_text().split()
    assert calls == [q_hash(cantor(5)), q_hash(cantor(6), bs=2, kv=45), q_hash(cantor(7), kv=20)]


def test_popcorn_test_mode_all_pass(subs, tmp_path):
    spec = tmp_path / "one.txt"
    spec.write_text("batchsize: 2; qseqlen: 1; kvseqlen: 30; seed: 9\n")
    rc, kv, keys, err = run_popcorn(["test", str(spec), "--submission", subs["picky"]], tmp_path)
    assert rc == 0, err
    assert keys == ["test-count", "test.0.spec", "test.0.status", "test.0.message", "check"]
    assert kv["check"] == "pass"


def test_popcorn_benchmark_mode_continues_after_a_failure(subs, tmp_path):
    spec = tmp_path / "two.txt"
    spec.write_text("batchsize: 2; qseqlen: 1; kvseqlen: 45; seed: 6\n"
                    "batchsize: 1; qseqlen: 1; kvseqlen: 16; seed: 5\n")
    rc, kv, keys, err = run_popcorn(["benchmark", str(spec), "--submission", subs["picky"]],
                                    tmp_path)
    assert rc == 112, err
    assert kv["benchmark-count"] == "2"
    assert kv["benchmark.0.status"] == "fail" and "mismatch ratio" in kv["benchmark.0.error"]
    runs = int(kv["benchmark.1.runs"])
    assert 3 <= runs <= 1000
    mean, std, e = (float(kv[f"benchmark.1.{k}"]) for k in ("mean", "std", "err"))
    best, worst = float(kv["benchmark.1.best"]), float(kv["benchmark.1.worst"])
    assert 0 < best <= mean <= worst
    assert e == pytest.approx(std / runs**0.5, rel=1e-6)
    assert kv["check"] == "fail"


def test_popcorn_leaderboard_rechecks_new_seeds_and_stops_at_first_failure(subs, tmp_path):
    record = tmp_path / "record.txt"
    rc, kv, keys, err = run_popcorn(
        ["leaderboard", subs["spec3"], "--submission", subs["picky"]], tmp_path,
        env_extra={"EVAL_TEST_RECORD": str(record)})
    assert rc == 112, err
    assert 3 <= int(kv["benchmark.0.runs"]) <= 100
    assert kv["benchmark.1.status"] == "fail"
    assert "benchmark.2.spec" not in kv  # the first failing case stops the run
    assert kv["check"] == "fail"
    calls = record.read_text().split()
    # case 0 after the warm-up: the check on seed 5, then every repeat a new input, seed += 13
    want = [q_hash(5)] + [q_hash(5 + 13 * k) for k in (1, 2, 3)]
    starts = [i for i in range(len(calls) - 3) if calls[i:i + 4] == want]
    assert starts, "no check + recheck sequence seed 5, 18, 31, 44 recorded"


def test_popcorn_profile_mode(subs, tmp_path):
    spec = tmp_path / "one.txt"
    spec.write_text("batchsize: 1; qseqlen: 1; kvseqlen: 16; seed: 5\n")
    rc, kv, keys, err = run_popcorn(["profile", str(spec), "--submission", subs["picky"]],
                                    tmp_path)
    assert rc == 0, err
    import base64

    report = base64.b64decode(kv["benchmark.0.report"]).decode()
    assert "Name" in report and "CPU" in report
    assert kv["check"] == "pass"


def test_popcorn_bad_arguments_exit_2(tmp_path):
    rc, kv, _, _ = run_popcorn(["bogus", os.path.join(REPO, "specs", "cpu.txt")], tmp_path)
    assert rc == 2 and kv == {}
    rc, _, _, _ = run_popcorn(["test"], tmp_path)
    assert rc == 2
    rc, _, _, _ = run_popcorn(["test", str(tmp_path / "missing.txt")], tmp_path)
    assert rc == 2
    bad = tmp_path / "bad.txt"
    bad.write_text("batchsize 4\n")
    rc, kv, _, _ = run_popcorn(["test", str(bad)], tmp_path)
    assert rc == 2 and kv == {}


def test_popcorn_flag_without_fd_exits_111(tmp_path):
    rc, _, _, err = run_popcorn(["--popcorn", "test", "specs/cpu.txt"], tmp_path, fd=False)
    assert rc == 111 and "POPCORN_FD" in err
    rc, _, _, _ = run_popcorn(["test", "specs/cpu.txt"], tmp_path, fd=False,
                              env_extra={"POPCORN_FD": "97"})
    assert rc == 111


class FakeWorker:
    """Stands in for SpawnedWorker: records each worker made and every job sent to it."""

    made = []

    def __init__(self):
        self.jobs = []
        FakeWorker.made.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def run(self, job):
        self.jobs.append(job)
        if job["kind"] == "profile":
            return {"ok": True, "report": "table"}
        if job["kind"] == "test":
            return {"ok": True, "message": ""}
        return {"ok": True, "stats": {"runs": 3, "mean": 1.0, "std": 0.0, "err": 0.0, "best": 1.0,
                                      "worst": 1.0}}


@pytest.fixture
def fake_worker(monkeypatch):
    FakeWorker.made = []
    monkeypatch.setattr(ev, "SpawnedWorker", FakeWorker)
    return FakeWorker


def popcorn_in_process(args, tmp_path, monkeypatch):
    """ev.main in runner mode in this process; returns its exit code."""
    spec = tmp_path / "two.txt"
    spec.write_text("batchsize: 2; qseqlen: 1; kvseqlen: 30; seed: 9\n"
                    "batchsize: 1; qseqlen: 1; kvseqlen: 16; seed: 3\n")
    with open(tmp_path / "out.txt", "w") as out:
        monkeypatch.setenv("POPCORN_FD", str(out.fileno()))
        return ev.main([args[0], str(spec), *args[1:]])


@pytest.mark.parametrize("flag,expected", [([], "default"), (["--l2-flush", "runner"], "runner")])
def test_popcorn_benchmark_jobs_carry_the_l2_flush_mode(tmp_path, monkeypatch, fake_worker, flag,
                                                        expected):
    """--l2-flush reaches every benchmark job of runner mode ("runner": the runner's own flush)."""
    assert popcorn_in_process(["leaderboard", *flag], tmp_path, monkeypatch) == 0
    (worker,) = fake_worker.made
    assert len(worker.jobs) == 3  # warm-up + the two cases
    assert all(job["flush_mode"] == expected for job in worker.jobs)


@pytest.mark.parametrize("mode", ["test", "benchmark", "leaderboard", "profile"])
def test_popcorn_sends_every_case_of_a_mode_to_one_worker(tmp_path, monkeypatch, fake_worker,
                                                          mode):
    assert popcorn_in_process([mode], tmp_path, monkeypatch) == 0
    (worker,) = fake_worker.made
    warmup = mode in ("benchmark", "leaderboard")
    assert len(worker.jobs) == 2 + warmup
    assert [job["args"]["seed"] for job in worker.jobs] == [9] * warmup + [9, 3]


def _record_lines(path):
    """(pids that imported the submission, [(pid, count)] of its calls) from a COUNTING record."""
    imports, calls = [], []
    for line in path.read_text().split("\n"):
        if line.startswith("import "):
            imports.append(int(line.split()[1]))
        elif line:
            pid, count = line.split()
            calls.append((int(pid), int(count)))
    return imports, calls


@pytest.mark.parametrize("mode,jobs", [("test", 2), ("benchmark", 3), ("leaderboard", 3)])
def test_popcorn_mode_runs_in_one_worker_whose_module_state_persists(subs, tmp_path, mode, jobs):
    """As the runner: one spawned worker per mode imports the submission once; its module global
    counts every call of the mode (the benchmark warm-up included) without restarting."""
    record = tmp_path / "record.txt"
    spec = tmp_path / "two.txt"
    spec.write_text("batchsize: 1; qseqlen: 1; kvseqlen: 16; seed: 5\n"
                    "batchsize: 1; qseqlen: 1; kvseqlen: 20; seed: 7\n")
    rc, kv, _, err = run_popcorn([mode, str(spec), "--submission", subs["counting"]], tmp_path,
                                 env_extra={"EVAL_TEST_RECORD": str(record)})
    assert rc == 0 and kv["check"] == "pass", err
    imports, calls = _record_lines(record)
    assert len(imports) == 1, imports  # imported once, in one process
    assert {pid for pid, _ in calls} == set(imports) != {os.getpid()}
    assert [count for _, count in calls] == list(range(1, len(calls) + 1))  # never reset
    # jobs: the cases, plus the warm-up in the benchmark modes. A test job calls once; a
    # benchmark job at least 4 times (its check, then at least 3 timed repeats)
    assert len(calls) == jobs if mode == "test" else len(calls) >= 4 * jobs


def test_popcorn_worker_that_dies_fails_its_case_and_the_rest(subs, tmp_path):
    spec = tmp_path / "three.txt"
    spec.write_text("batchsize: 1; qseqlen: 1; kvseqlen: 16; seed: 5\n"
                    "batchsize: 1; qseqlen: 1; kvseqlen: 20; seed: 7\n"
                    "batchsize: 1; qseqlen: 1; kvseqlen: 16; seed: 8\n")
    rc, kv, _, err = run_popcorn(["test", str(spec), "--submission", subs["dies"]], tmp_path)
    assert rc == 112, err
    assert kv["test.0.status"] == "pass"
    assert kv["test.1.status"] == "fail" and "died" in kv["test.1.error"]
    assert kv["test.2.status"] == "fail" and "no later case ran" in kv["test.2.error"]
    assert kv["check"] == "fail"


# ---------------------------------------------------------------------------------------------
# Human mode (in-process)


@pytest.fixture
def no_popcorn(monkeypatch):
    monkeypatch.delenv("POPCORN_FD", raising=False)
    monkeypatch.delenv("POPCORN_SEED", raising=False)


def human(args, tmp_path):
    out = tmp_path / "r.json"
    rc = ev.main([*args, "--json", str(out)])
    return rc, (json.loads(out.read_text()) if out.exists() else None)


def write_spec(tmp_path, text, name="s.txt"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_human_test_mode_strict_pass(subs, tmp_path, no_popcorn, capsys):
    spec = write_spec(tmp_path, "batchsize: 2; qseqlen: 1; kvseqlen: 16; seed: 1\n"
                                "batchsize: 3; qseqlen: 1; kvseqlen: 33; seed: 2\n")
    rc, js = human(["test", spec, "--submission", subs["picky"], "--strict"], tmp_path)
    assert rc == 0
    assert js["passed"] and js["strict"] and len(js["cases"]) == 2
    row = js["cases"][0]
    assert row["route"] == "ref {}" and row["kv_format"] == "fp8"
    assert row["mismatch"] == 0.0 and 0.001 < row["rel_l2"] < row["rel_l2_bound"] == 0.05
    text = capsys.readouterr().out
    assert "check: pass" in text and f"device: {utils.device_name()}" in text
    assert ("CPU times mean nothing" in text) is not ON_GPU  # the CPU's note, only there


def test_zeros_pass_the_loose_check_but_fail_strict(subs, tmp_path, no_popcorn):
    # long KV: zeros are within atol for > 95% of the elements (see test_reference)
    spec = write_spec(tmp_path, "batchsize: 2; qseqlen: 1; kvseqlen: 2000; seed: 62\n")
    rc, js = human(["test", spec, "--submission", subs["zeros"]], tmp_path)
    assert rc == 0 and js["cases"][0]["loose_ok"]
    rc, js = human(["test", spec, "--submission", subs["zeros"], "--strict"], tmp_path)
    row = js["cases"][0]
    assert rc == 112 and row["loose_ok"] and not row["ok"]
    assert any("rel L2" in p for p in row["problems"])
    assert row["rel_l2"] == pytest.approx(1.0)


def test_zeros_fail_everything_on_cpu_specs(subs, tmp_path, no_popcorn):
    rc, js = human(["test", os.path.join(REPO, "specs", "cpu.txt"), "--submission",
                    subs["zeros"], "--strict"], tmp_path)
    assert rc == 112 and not any(r["ok"] for r in js["cases"])


def test_submission_without_route_info(subs, tmp_path, no_popcorn, capsys):
    spec = write_spec(tmp_path, "batchsize: 1; qseqlen: 1; kvseqlen: 16; seed: 1\n")
    rc, js = human(["test", spec, "--submission", subs["bare"], "--strict"], tmp_path)
    assert rc == 0
    row = js["cases"][0]
    assert row["route"] is None and row["rel_l2_bound"] == ev.DEFAULT_REL_L2_BOUND
    assert not row["rel_l2_bound_declared"]
    assert "declares no rel_l2_bound" in capsys.readouterr().out


def test_strict_catches_stale_outputs_and_nan(subs, tmp_path, no_popcorn):
    spec = write_spec(tmp_path, "batchsize: 1; qseqlen: 1; kvseqlen: 16; seed: 1\n")
    rc, js = human(["test", spec, "--submission", subs["cached"]], tmp_path)
    assert rc == 0  # the runner's check cannot see it
    rc, js = human(["test", spec, "--submission", subs["cached"], "--strict"], tmp_path)
    assert rc == 112 and any("same storage" in p for p in js["cases"][0]["problems"])
    rc, js = human(["test", spec, "--submission", subs["nan"], "--strict"], tmp_path)
    assert rc == 112 and any("NaN" in p for p in js["cases"][0]["problems"])


def test_human_benchmark_table_and_json(subs, tmp_path, no_popcorn, capsys):
    spec = write_spec(tmp_path, "batchsize: 1; qseqlen: 1; kvseqlen: 16; seed: 1\n"
                                "batchsize: 2; qseqlen: 1; kvseqlen: 20; seed: 2\n")
    rc, js = human(["benchmark", spec, "--submission", subs["picky"], "--strict",
                    "--repeats", "3", "--cpu-timing"], tmp_path)
    assert rc == 0 and js["timed"]
    assert js["copy_bandwidth_gbs"] > 0 and js["cpu_times_meaningless"] is not ON_GPU
    assert js["device"] == str(utils.get_device())
    for row in js["cases"]:
        assert row["stats"]["runs"] == 3 and row["ref_stats"]["runs"] == 3
    row = js["cases"][1]
    assert row["bytes"] == 40 * 576 + 2 * (16 * 576 * 2 + 16 * 512 * 2)
    assert row["gbs"] == pytest.approx(row["bytes"] / row["stats"]["mean"])
    assert row["speedup"] == pytest.approx(row["ref_stats"]["mean"] / row["stats"]["mean"])
    assert row["fraction_of_copy_bw"] == pytest.approx(row["gbs"] / js["copy_bandwidth_gbs"])
    assert js["geomean_ns"] > 0 and js["ref_geomean_ns"] > 0
    text = capsys.readouterr().out
    for column in ("route", "mean+-err us", "ref us", "speedup", "GB/s %copy",
                   "mismatch", "relL2 %bound", "geometric mean of the means"):
        assert column in text


def test_human_leaderboard_stops_at_first_failure(subs, tmp_path, no_popcorn):
    rc, js = human(["leaderboard", subs["spec3"], "--submission", subs["picky"],
                    "--repeats", "3", "--cpu-timing"], tmp_path)
    assert rc == 112
    assert [r["ok"] for r in js["cases"]] == [True, False]


def test_human_spawn_mode(subs, tmp_path, no_popcorn):
    spec = write_spec(tmp_path, "batchsize: 1; qseqlen: 1; kvseqlen: 16; seed: 1\n")
    rc, js = human(["test", spec, "--submission", subs["picky"], "--strict", "--spawn"],
                   tmp_path)
    assert rc == 0 and js["cases"][0]["route"] == "ref {}"


def test_human_bad_arguments(tmp_path, no_popcorn):
    assert ev.main(["bogus"]) == 2
    assert ev.main(["test", "--l2-flush", "sometimes"]) == 2
    assert ev.main(["test", "--repeats", "0"]) == 2
    assert ev.main(["test", str(tmp_path / "missing.txt")]) == 2
    assert ev.main(["test", write_spec(tmp_path, "batchsize 4\n")]) == 2
    assert ev.main(["--popcorn", "test"]) == 111


def test_case_bytes_per_format():
    data = R.generate_input(2, 1, 10, 1, device="cpu")
    extra = 2 * (16 * 576 * 2 + 16 * 512 * 2)
    assert ev.case_bytes(data, "bf16") == 20 * 1152 + extra
    assert ev.case_bytes(data, "fp8") == 20 * 576 + extra
    assert ev.case_bytes(data, "mxfp4") == 20 * 306 + extra
    assert ev.case_bytes(data, None) is None


# ---------------------------------------------------------------------------------------------
# The human report: width, labels, summary, next step, compare, chart, exit codes

TWO_CASES = ("batchsize: 1; qseqlen: 1; kvseqlen: 16; seed: 1\n"
             "batchsize: 3; qseqlen: 1; kv_lens: 1 7 20; seed: 2\n")


def report_lines(text, tmp_path):
    """The lines of a human report that must fit the width: all but those naming the caller's
    paths (the header's spec and submission, the JSON file in the next step)."""
    return [line for line in text.splitlines()
            if not line.startswith(("eval.py ", "submission: ")) and str(tmp_path) not in line]


def test_report_fits_120_columns_with_short_route_labels_and_wide_shows_them(
        subs, tmp_path, no_popcorn, capsys):
    spec = write_spec(tmp_path, TWO_CASES)
    rc, js = human(["benchmark", spec, "--submission", subs["labelled"], "--strict",
                    "--repeats", "2", "--cpu-timing"], tmp_path)
    text = capsys.readouterr().out
    assert rc == 0, text
    row = js["cases"][0]
    assert row["route_short"] == "aiter_a16w8_persistent s16"
    assert row["route"].startswith('aiter_a16w8_persistent {"num_splits":16')  # JSON: the full label
    lines = report_lines(text, tmp_path)
    assert max(len(line) for line in lines) <= 120, max(lines, key=len)
    assert "aiter_a16w8_persistent s16" in text and '"num_warps"' not in text
    assert "bs=3 kv=1,7,20" in text  # a ragged case, read from "kv_lens: 1 7 20"
    human(["test", spec, "--submission", subs["labelled"], "--wide"], tmp_path)
    assert 'aiter_a16w8_persistent {"num_splits":16,"num_warps":4' in capsys.readouterr().out


def test_table_of_the_widest_leaderboard_row_fits_120_columns():
    row = {"case": "bs=256 kv=8192 seed=9826", "label": "bs=256 kv=8192", "ok": True,
           "problems": [], "route": "x" * 200, "route_short": "aiter_a16w8_persistent s16",
           "stats": {"mean": 1459312.0, "err": 12345.0, "best": 1401234.0, "std": 1.0},
           "ref_stats": {"mean": 14593120.0, "err": 1.0}, "bytes": 10 ** 12,
           "mismatch": 0.0123, "rel_l2": 0.04421, "rel_l2_bound": 0.06,
           "rel_l2_bound_declared": True}
    for mode, timed in (("benchmark", True), ("test", False)):
        table = ev.format_table([row], mode, 4173.0, timed=timed)
        assert max(len(line) for line in table.splitlines()) <= 120, table
        assert "aiter_a16w8_persistent s16" in table and "x" * 50 not in table
    assert "x" * 200 in ev.format_table([row], "test", wide=True)


def test_short_case_labels():
    assert ev._short_label({"batchsize": 256, "kvseqlen": 8192, "seed": 3}) == "bs=256 kv=8192"
    lens = list(range(100, 140))
    text = ev._short_label({"batchsize": 40, "kvseqlen": 139, "kv_lens": lens})
    assert len(text) <= ev.SHORT_LABEL_CHARS and text.startswith("bs=40 kv=100,") and "(40)" in text
    assert ev._label({"batchsize": 3, "kvseqlen": 20, "kv_lens": [1, 7, 20], "seed": 2}) == \
        "bs=3 kv=1,7,20 seed=2"


def test_summary_counts_passes_and_names_the_case_closest_to_its_bound(
        subs, tmp_path, no_popcorn, capsys):
    spec = write_spec(tmp_path, "batchsize: 2; qseqlen: 1; kvseqlen: 16; seed: 1\n"
                                "batchsize: 1; qseqlen: 1; kvseqlen: 60; seed: 3\n")
    rc, js = human(["test", spec, "--submission", subs["picky"], "--strict"], tmp_path)
    text = capsys.readouterr().out
    assert rc == 112
    summary = js["summary"]
    assert (summary["passed"], summary["cases"]) == (1, 2) and summary["elapsed_s"] > 0
    # the zeros case (kv 60) has rel. L2 1.0 against a bound of 0.05: 20x its bound
    assert summary["worst_case"] == "bs=1 kv=60 seed=3"
    assert summary["worst_fraction_of_bound"] == pytest.approx(20.0, rel=1e-3)
    assert "check: fail: 1 of 2 cases passed in " in text
    assert "closest to its bound: bs=1 kv=60 seed=3: rel. L2 1.0000 = 2000% of 0.05" in text
    assert "over the bound by 1900%" in text
    assert text.rstrip().splitlines()[-1].startswith("next: fix the FAIL lines above")


def test_summary_headroom_and_next_step_of_a_passing_run(subs, tmp_path, no_popcorn, capsys):
    spec = write_spec(tmp_path, "batchsize: 2; qseqlen: 1; kvseqlen: 16; seed: 1\n")
    rc, js = human(["test", spec, "--submission", subs["picky"], "--strict"], tmp_path)
    text = capsys.readouterr().out
    row = js["cases"][0]
    assert rc == 0 and row["fraction_of_bound"] == pytest.approx(row["rel_l2"] / 0.05)
    assert f"headroom {100 * (1 - row['rel_l2'] / 0.05):.0f}%" in text
    assert "check: pass: 1 of 1 cases passed in " in text
    last = text.rstrip().splitlines()[-1]
    assert last.startswith("next: ") and ("benchmark" in last)


@pytest.mark.skipif(ON_GPU, reason="the CPU's behaviour")
def test_cpu_benchmark_checks_but_skips_timing_without_cpu_timing(subs, tmp_path, no_popcorn,
                                                                  capsys):
    spec = write_spec(tmp_path, "batchsize: 1; qseqlen: 1; kvseqlen: 16; seed: 1\n")
    rc, js = human(["benchmark", spec, "--submission", subs["picky"], "--strict"], tmp_path)
    text = capsys.readouterr().out
    assert rc == 0 and not js["timed"] and js["copy_bandwidth_gbs"] is None
    assert js["cases"][0]["stats"] is None and js["cases"][0]["rel_l2"] is not None
    assert "timing skipped: no GPU here" in text and "mean+-err" not in text
    assert "--cpu-timing" in text.rstrip().splitlines()[-1]
    # a failing case still fails without timing
    spec = write_spec(tmp_path, "batchsize: 1; qseqlen: 1; kvseqlen: 60; seed: 1\n", "f.txt")
    rc, _ = human(["benchmark", spec, "--submission", subs["picky"], "--strict"], tmp_path)
    assert rc == 112


def _timed_row(label, mean, std, **args):
    return {"case": label, "label": label, "args": args, "ok": True, "problems": [],
            "stats": {"runs": 10, "mean": mean, "std": std, "err": std / 3, "best": mean - std,
                      "worst": mean + std}}


def test_compare_rows_ratio_and_spread():
    shape = {"batchsize": 4, "qseqlen": 1, "kvseqlen": 1024}
    other = {"batchsize": 4, "qseqlen": 1, "kvseqlen": 8192}
    ragged = {"batchsize": 2, "qseqlen": 1, "kvseqlen": 7, "kv_lens": [1, 7]}
    earlier = {"cases": [_timed_row("a", 10000.0, 100.0, seed=1, **shape),
                         _timed_row("b", 20000.0, 3000.0, seed=2, **other),
                         _timed_row("c", 5000.0, 10.0, seed=3, **ragged)]}
    rows = [_timed_row("a", 9000.0, 100.0, seed=77, **shape),  # seeds differ: matched by shape
            _timed_row("b", 18000.0, 100.0, seed=2, **other),  # inside the earlier run's spread
            _timed_row("c", 5500.0, 10.0, seed=3, **ragged),
            _timed_row("d", 100.0, 1.0, seed=4, batchsize=1, qseqlen=1, kvseqlen=16)]
    a, b, c, d = ev.compare_rows(rows, earlier)
    assert a["ratio"] == pytest.approx(0.9) and a["outside_spread"] and a["verdict"] == "faster"
    assert b["ratio"] == pytest.approx(0.9) and not b["outside_spread"]
    assert b["verdict"] == "within the spread"
    assert c["ratio"] == pytest.approx(1.1) and c["verdict"] == "slower"
    assert d["ratio"] is None and d["verdict"] == "no earlier case"
    text = ev.format_compare([a, b, c, d], earlier, "before.json")
    assert "yes: faster" in text and "yes: SLOWER" in text and "within the spread" in text
    assert "geometric mean of now/before over 3 cases" in text


def test_compare_and_chart_end_to_end(subs, tmp_path, no_popcorn, capsys):
    spec = write_spec(tmp_path, TWO_CASES)
    first = tmp_path / "before.json"
    assert ev.main(["benchmark", spec, "--submission", subs["picky"], "--repeats", "2",
                    "--cpu-timing", "--json", str(first)]) == 0
    capsys.readouterr()
    chart = tmp_path / "chart.png"
    rc, js = human(["benchmark", spec, "--submission", subs["picky"], "--repeats", "2",
                    "--cpu-timing", "--compare", str(first), "--chart", str(chart)], tmp_path)
    text = capsys.readouterr().out
    assert rc == 0
    entries = js["compare"]["cases"]
    assert [e["case"] for e in entries] == [r["case"] for r in js["cases"]]
    assert all(e["ratio"] > 0 and isinstance(e["outside_spread"], bool) for e in entries)
    assert f"compared with {first}" in text and "now/before" in text
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and chart.stat().st_size > 5000
    assert f"chart: {chart}" in text


def test_progress_bar_on_a_terminal(subs, monkeypatch):
    pytest.importorskip("tqdm")
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(ev, "_progress_bar", lambda total, desc: __import__("tqdm").tqdm(
        total=total, desc=desc, unit="case", file=sys.stderr, disable=None, mininterval=0))
    rows = ev.human_rows(_Executor(), utils.read_spec_file(_spec_file(subs)), "x",
                         {"mode": "test"})
    assert len(rows) == 3
    assert "test" in err.getvalue() and "3/3" in err.getvalue()


def _spec_file(subs):
    return subs["spec3"]


class _Executor:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def run(self, job):
        return {"case": ev._label(job["args"]), "ok": True, "problems": []}


def test_human_exit_codes_for_bad_arguments(subs, tmp_path, no_popcorn, capsys):
    spec = write_spec(tmp_path, "batchsize: 1; qseqlen: 1; kvseqlen: 16; seed: 1\n")
    sub = ["--submission", subs["picky"]]
    assert ev.main(["test", spec, *sub, "--compare", spec]) == 2  # not a timed mode
    assert ev.main(["test", spec, *sub, "--chart", str(tmp_path / "c.png")]) == 2
    assert ev.main(["benchmark", spec, *sub, "--cpu-timing", "--compare",
                    str(tmp_path / "missing.json")]) == 2
    assert ev.main(["benchmark", spec, *sub, "--cpu-timing", "--compare", spec]) == 2  # not JSON
    untimed = tmp_path / "untimed.json"
    untimed.write_text(json.dumps({"cases": [{"args": {"batchsize": 1}, "stats": None}]}))
    assert ev.main(["benchmark", spec, *sub, "--cpu-timing", "--compare", str(untimed)]) == 2
    assert ev.main(["benchmark", spec, *sub, "--cpu-timing", "--chart",
                    str(tmp_path / "no" / "dir" / "c.png")]) == 2
    assert ev.main(["test", spec, *sub, "--device", "tpu-ish"]) == 2
    for text in ("batchsize: 0; qseqlen: 1; kvseqlen: 16; seed: 1\n",
                 "batchsize: 2; qseqlen: 1; kvseqlen: -4; seed: 1\n",
                 "batchsize: 2; qseqlen: 1; kv_lens: 1 0; seed: 1\n",
                 "batchsize: 2; qseqlen: 1; kv_lens: 1 2 3; seed: 1\n"):
        assert ev.main(["test", write_spec(tmp_path, text, "bad.txt"), *sub]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "batchsize must be >= 1" in err and "kv_lens" in err and "kvseqlen must be >= 1" in err
    if not ON_GPU:
        assert ev.main(["test", spec, *sub, "--device", "cuda"]) == 2
        assert "sees no CUDA or ROCm GPU" in capsys.readouterr().err


def test_device_cuda_without_a_gpu_exits_2_in_a_fresh_process(tmp_path):
    if ON_GPU:
        pytest.skip("a GPU is here")
    env = {k: v for k, v in os.environ.items() if k != "POPCORN_FD"}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "eval.py"), "test", "--device",
                           "cuda"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--device cuda" in proc.stderr

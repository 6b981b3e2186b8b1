"""The candidate race on a GPU (submission.py, "Candidate race"): containment, learning across rows,
the budget's end, and a job of runner-like steps.

    python3 tools/race_safety.py OUT_DIR [--only every-row,budget-hang,containment,job]

1. containment: one racing row whose candidates include a real GPU fault (a Triton kernel storing
   far out of bounds), a GPU hang (a kernel spinning on a flag), an abort, a segfault, zeros,
   every 2nd token and a raise (tests/doubles/race_child.py's stand-ins) besides real routes: the caller
   survives each, names it, and returns right outputs; then a first call whose q is 8x sharper.
2. every-row: the same faults injected into EVERY racing row of the Triton table, one process,
   each racing shape called once: every row's honest candidates measured inside the job budget
   (a faulty kernel is started once, in the first row), the first call's time, stderr bytes.
3. budget-hang: a row whose first candidate hangs past a short job budget: it is cut, never run
   by the caller (the caller's copy of it would hang for good), and the call returns.
4. job: three processes in a row over one temporary directory, as the runner's steps are (the 4
   test shapes, then the 8 benchmark shapes, then the 8 again), the real submission.py and its
   active table: first-call time per shape, the route kept, rel. L2 against float64 attention,
   the race's stderr bytes per process.
Later-call times against another version: tools/ab_probe.py OLD.py submission.py --whole.
"""
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "doubles")]
TEST_SHAPES = [(4, 1024), (32, 1024), (64, 8192), (256, 8192)]
BAD = ["gpu_fault", "gpu_hang", "aborts", "segfaults", "zeros", "every_2nd_token", "raises"]


def _timed_call(mod, data):
    """One call of mod.custom_kernel, the GPU idle before it and synchronised after: its wall time
    (a first call's includes the race), the route it then keeps, its rel. L2 against float64
    attention."""
    import torch

    import reference

    torch.cuda.synchronize()
    start = time.perf_counter()
    out = mod.custom_kernel(data)
    torch.cuda.synchronize()
    return {"call_s": round(time.perf_counter() - start, 2), "route": mod.LAST_ROUTE,
            "rel_l2": round(reference.rel_l2_error(out, data), 4)}


def _race_lines(text):
    """The race's lines of a stderr text, and their bytes."""
    lines = [line for line in text.splitlines() if line.startswith("submission.py race")]
    return lines, sum(len(line) + 1 for line in lines)


def containment(out_dir):
    import torch

    import reference
    from aiter_double import loader

    mod, bad = _module_with_stand_ins(BAD), BAD
    first = {"route": "triton_fp8", "params": {"num_splits": 8, "block_n": 64, "num_warps": 8, "num_stages": 3}}
    hopper = {"route": "hopper_fp8", "params": {"num_splits": 16, "num_warps": 4, "num_stages": 2}}
    table = [{"max_batch": 4, "max_kv_len": 1024, **first,
              "candidates": [{"route": name, "params": {}} for name in bad] + [hopper]},
             {"max_batch": None, "max_kv_len": None, **first}]
    mod.TRITON_ROUTE_TABLE = table
    report = []
    for seed, gain in ((4217, 1.0), (4218, 1.0), (4219, 8.0)):
        data = reference.generate_input(4, 1, 1024, seed)
        if gain != 1.0:
            data = ((data[0] * gain).to(torch.bfloat16), *data[1:])
        report.append({"seed": seed, "q_gain": gain, **_timed_call(mod, data)})
    # a fresh module whose FIRST call is sharp: honest candidates only
    sharp = loader.load_submission(None).module
    sharp.TRITON_ROUTE_TABLE = [{**table[0], "candidates": [hopper]}, table[1]]
    sharp.race_command, sharp.race_cache_dir = mod.race_command, tempfile.mkdtemp()
    for seed, gain in ((4220, 8.0), (4221, 1.0)):
        data = reference.generate_input(4, 1, 1024, seed)
        data = ((data[0] * gain).to(torch.bfloat16), *data[1:])
        report.append({"module": "sharp-first", "seed": seed, "q_gain": gain, **_timed_call(sharp, data)})
    return report


def _module_with_stand_ins(names):
    """submission.py without aiter (the Triton table) whose measuring process registers `names`;
    the caller's own copies of them are the real faulty functions: running one here would end
    this script, which is the test."""
    import race_child
    from aiter_double import loader

    mod = loader.load_submission(None).module
    mod.race_command = [sys.executable, os.path.join(ROOT, "tests", "doubles", "race_child.py")]
    mod.race_cache_dir = tempfile.mkdtemp()
    race_child.register(mod, names)
    os.environ["RACE_TEST_CHILD"] = json.dumps({"generation": None, "stand_ins": list(names)})
    return mod


def _race_stderr(run):
    """run() with stderr captured through a file (the race prints there); (result, race lines, bytes)."""
    with tempfile.TemporaryFile(mode="w+") as err:
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            result = run()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        text = err.read()
    return (result, *_race_lines(text))


def every_row(out_dir):
    """The faults in every racing row of the Triton table; each racing shape called once."""

    import reference

    mod = _module_with_stand_ins(BAD)
    faults = [{"route": name, "params": {}} for name in BAD]
    mod.TRITON_ROUTE_TABLE = [dict(row, candidates=faults + list(row["candidates"])) if row.get("candidates") else row
                              for row in mod.TRITON_ROUTE_TABLE]
    shapes = list(mod.racing_rows(mod.TRITON_ROUTE_TABLE))

    def calls():
        return [{"shape": [batch, kv_len],
                 **_timed_call(mod, reference.generate_input(batch, 1, kv_len, 7000 + batch + kv_len))}
                for batch, kv_len in shapes]

    report, lines, size = _race_stderr(calls)
    rows = [line for line in lines if " TRITON_ROUTE_TABLE bs=" in line]
    return {"calls": report, "race_lines": lines, "race_bytes": size,
            "rows_with_an_honest_candidate_timed": sum(1 for line in rows if "/" in line.split(": ", 1)[1]),
            "racing_rows": len(shapes)}


def budget_hang(out_dir):
    """A row whose first candidate hangs on the GPU past a 12 s job budget."""

    import reference

    mod = _module_with_stand_ins(["gpu_hang"])
    honest = {"route": "hopper_fp8", "params": {"num_splits": 16, "num_warps": 4, "num_stages": 2}}
    mod.TRITON_ROUTE_TABLE = [{"max_batch": 4, "max_kv_len": 1024, "route": "gpu_hang", "params": {},
                               "candidates": [honest]},
                              {"max_batch": None, "max_kv_len": None, "route": "triton_fp8",
                               "params": {"num_splits": 8, "block_n": 64, "num_warps": 8, "num_stages": 3}}]
    mod.RACE_JOB_BUDGET_S, mod.RACE_CANDIDATE_LIMIT_S = 12.0, 60.0

    result, lines, size = _race_stderr(lambda: _timed_call(mod, reference.generate_input(4, 1, 1024, 4217)))
    return dict(result, race_lines=lines, race_bytes=size)


def one_step(shapes):
    """One runner step: the real submission.py, each shape's first call timed and checked."""

    import reference
    import submission

    rows = [{"shape": [batch, kv_len],
             **_timed_call(submission, reference.generate_input(batch, 1, kv_len, 1000 + batch + kv_len))}
            for batch, kv_len in shapes]
    print(json.dumps(rows))


def job(out_dir):
    import utils

    env = dict(os.environ, TMPDIR=tempfile.mkdtemp())
    steps = []
    for name, shapes in (("test", TEST_SHAPES), ("benchmark", utils.benchmark_shapes()),
                         ("benchmark again", utils.benchmark_shapes())):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, "--step", json.dumps(shapes)], env=env, cwd=ROOT,
                              capture_output=True, text=True)
        race, size = _race_lines(done.stderr)
        calls = json.loads(done.stdout.splitlines()[-1]) if done.returncode == 0 else done.stderr[-2000:]
        steps.append({"step": name, "rc": done.returncode, "process_s": round(time.perf_counter() - start, 1),
                      "calls": calls, "race_bytes": size, "race_lines": race})
    return steps


def main():
    if sys.argv[1] == "--step":
        return one_step([tuple(s) for s in json.loads(sys.argv[2])])
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    parts = {"containment": containment, "every-row": every_row, "budget-hang": budget_hang, "job": job}
    only = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else list(parts)
    results = {}
    for name in only:
        start = time.perf_counter()
        results[name] = parts[name](out_dir)
        print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    with open(os.path.join(out_dir, "race_safety.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""The candidate race on a GPU, as issue 21 asks it to be shown (submission.py, "Candidate race").

    python3 bench/race_safety.py OUT_DIR

1. containment: a racing row whose candidates include a real GPU fault (a Triton kernel storing
   far out of bounds), a GPU hang (a kernel spinning on a flag), an abort, a segfault, zeros,
   every 2nd token and a raise (tests/race_child.py's stand-ins) besides real routes: the caller
   survives each, names it, and returns right outputs; then a first call whose q is 8x sharper.
2. a job: three processes in a row over one temporary directory, as the runner's steps are
   (the 4 test shapes, then the 8 benchmark shapes, then the 8 again), the real submission.py and
   its active table: first-call time per shape, the route kept, rel. L2 against float64
   attention, the race's stderr bytes per process.
Later-call times against another version: bench/ab_probe.py OLD.py submission.py --whole.
"""
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
TEST_SHAPES = [(4, 1024), (32, 1024), (64, 8192), (256, 8192)]


def containment(out_dir):
    import torch

    import race_child
    import reference
    from aiter_double import loader

    mod = loader.load_submission(None).module  # no aiter: the Triton table, as on this GPU
    first = {"route": "triton_fp8", "params": {"num_splits": 8, "block_n": 64, "num_warps": 8, "num_stages": 3,
                                               "qk_fp8": True, "q_scale": "program"}}
    hopper = {"route": "hopper_fp8", "params": {"num_splits": 16, "num_warps": 4, "num_stages": 2,
                                                "cooperative_merge": True}}
    bad = ["gpu_fault", "gpu_hang", "aborts", "segfaults", "zeros", "every_2nd_token", "raises"]
    table = [{"max_batch": 4, "max_kv_len": 1024, **first,
              "candidates": [{"route": name, "params": {}} for name in bad] + [hopper]},
             {"max_batch": None, "max_kv_len": None, **first}]
    mod.TRITON_ROUTE_TABLE = table
    mod.race_command = [sys.executable, os.path.join(ROOT, "tests", "race_child.py")]
    mod.race_cache_dir = tempfile.mkdtemp()
    race_child.register(mod, bad)
    os.environ["RACE_TEST_CHILD"] = json.dumps({"generation": None, "stand_ins": bad})
    report = []
    for seed, gain in ((4217, 1.0), (4218, 1.0), (4219, 8.0)):
        data = reference.generate_input(4, 1, 1024, seed)
        if gain != 1.0:
            data = ((data[0] * gain).to(torch.bfloat16), *data[1:])
        start = time.perf_counter()
        out = mod.custom_kernel(data)
        torch.cuda.synchronize()
        report.append({"seed": seed, "q_gain": gain, "call_s": round(time.perf_counter() - start, 2),
                       "route": mod.LAST_ROUTE, "rel_l2": reference.rel_l2_error(out, data)})
    # a fresh module whose FIRST call is sharp: honest candidates only
    sharp = loader.load_submission(None).module
    sharp.TRITON_ROUTE_TABLE = [{**table[0], "candidates": [hopper]}, table[1]]
    sharp.race_command, sharp.race_cache_dir = mod.race_command, tempfile.mkdtemp()
    for seed, gain in ((4220, 8.0), (4221, 1.0)):
        data = reference.generate_input(4, 1, 1024, seed)
        data = ((data[0] * gain).to(torch.bfloat16), *data[1:])
        out = sharp.custom_kernel(data)
        report.append({"module": "sharp-first", "seed": seed, "q_gain": gain, "route": sharp.LAST_ROUTE,
                       "rel_l2": reference.rel_l2_error(out, data)})
    return report


def one_step(shapes):
    """One runner step: the real submission.py, each shape's first call timed and checked."""
    import torch

    import reference
    import submission

    rows = []
    for batch, kv_len in shapes:
        data = reference.generate_input(batch, 1, kv_len, 1000 + batch + kv_len)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = submission.custom_kernel(data)
        torch.cuda.synchronize()
        rows.append({"shape": [batch, kv_len], "first_call_s": round(time.perf_counter() - start, 2),
                     "route": submission.LAST_ROUTE, "rel_l2": round(reference.rel_l2_error(out, data), 4)})
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
        race = [line for line in done.stderr.splitlines() if line.startswith("submission.py race")]
        calls = json.loads(done.stdout.splitlines()[-1]) if done.returncode == 0 else done.stderr[-2000:]
        steps.append({"step": name, "rc": done.returncode, "process_s": round(time.perf_counter() - start, 1),
                      "calls": calls,
                      "race_bytes": sum(len(line) + 1 for line in race), "race_lines": race})
    return steps


def main():
    if sys.argv[1] == "--step":
        return one_step([tuple(s) for s in json.loads(sys.argv[2])])
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    results = {"containment": containment(out_dir), "job": job(out_dir)}
    with open(os.path.join(out_dir, "race_safety.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

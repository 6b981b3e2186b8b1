"""How long the race's compiles take, from an EMPTY Triton cache (the runner starts every
submission with an empty one): every Triton candidate of the racing rows, per configuration, per
row and overall, against the race's budget.

    python tools/compile_times.py [--targets gfx950,sm90,sm90-launch] [--json PATH] [--timeout 280]

What is compiled, in race order (the tables' row order, each row's candidates in order):
- AITER_ROUTE_TABLE's racing rows (the rows with "candidates"), their Triton candidates, for
  gfx950 (MI355X, what the runner compiles) and for sm90 (H200: a second machine's figure);
- TRITON_ROUTE_TABLE's racing rows, every candidate (Gluon hopper_fp8 and triton_fp8), for sm90.
Targets, each in its own process with its own fresh TRITON_CACHE_DIR (set before Triton is
imported), run side by side (one process each, so each one's times are a single core's, as the
race's compiles are):
- gfx950, sm90: ahead-of-time triton.compile of exactly the compile plans the routes launch
  (tools/kernel_report.py: same plans, same HIP 2 GiB marks); no GPU needed;
- sm90-launch (a CUDA GPU only): a real first launch of each TRITON_ROUTE_TABLE candidate on a
  small input (batch 2, kv 256) through the route itself, minus the time of a second launch:
  the JIT's own overhead and the module load included.
A configuration that compiles to what an earlier one compiled (same plan entry) costs nothing
the second time in the same process (Triton's in-memory and on-disk caches): it is listed as
"(compiled above)" and counted once.

Output: one line per configuration (seconds), a total per row, per target and overall, then the
budget check: the race's first call of a shape has about 20 s per candidate and about 90 s per
job for all 8 racing rows (compiles, checks and timing included).
"""
import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import submission  # noqa: E402  (route_label)

TARGETS = ("gfx950", "sm90", "sm90-launch")
JOB_BUDGET_S = 90.0  # all racing rows of one job, compiles included
CANDIDATE_BUDGET_S = 20.0


# ---------------------------------------------------------------------------------------------
# What is compiled (pure: tested on CPU)


def racing_work(module):
    """[(table name, row index, (batch, kv), [candidate, ...]), ...] in race order; a candidate is
    {"route", "params"}; only routes with a Triton compile plan."""
    plans = getattr(module, "TRITON_COMPILE_PLANS", {})
    work = []
    for table_name in ("AITER_ROUTE_TABLE", "TRITON_ROUTE_TABLE"):
        for i, row in enumerate(getattr(module, table_name, [])):
            if not row.get("candidates"):
                continue
            candidates = [c for c in module.race_candidates(row) if c["route"] in plans]
            if candidates:
                work.append((table_name, i, (row["max_batch"], row["max_kv_len"]), candidates))
    return work


def target_work(work, target):
    """The rows a target compiles: the AITER rows for gfx950, both tables for sm90, the Triton
    table only for a real launch on the H200 (the AITER table's candidates run only on AMD)."""
    if target == "gfx950":
        return [w for w in work if w[0] == "AITER_ROUTE_TABLE"]
    if target == "sm90-launch":
        return [w for w in work if w[0] == "TRITON_ROUTE_TABLE"]
    return list(work)


def summarise(results):
    """results: {target: [(table, row, shape, label, seconds or None, note), ...]} -> per row and
    per target totals: {target: {"rows": {(table, row): seconds}, "total": seconds}} and the
    overall total. None (failed / skipped) counts 0."""
    out, overall = {}, 0.0
    for target, lines in results.items():
        rows = {}
        for table, row, _shape, _label, seconds, _note in lines:
            rows[(table, row)] = rows.get((table, row), 0.0) + (seconds or 0.0)
        total = sum(rows.values())
        out[target] = {"rows": rows, "total": total}
        overall += total
    return out, overall


def budget_lines(results, summary):
    """The budget check for the runner's case (gfx950: the AITER table's racing rows)."""
    lines = []
    gfx = results.get("gfx950")
    if not gfx:
        return ["budget: no gfx950 figures"]
    total = summary["gfx950"]["total"]
    counts = {}
    for table, row, _shape, _label, _seconds, _note in gfx:
        counts[(table, row)] = counts.get((table, row), 0) + 1
    worst = max(((s or 0.0), label) for _t, _r, _shape, label, s, _n in gfx)
    lines.append(f"budget (gfx950 compiles on this CPU): {total:.1f} s for {sum(counts.values())} Triton "
                 f"candidates of {len(counts)} racing rows, {100 * total / JOB_BUDGET_S:.0f}% of the "
                 f"{JOB_BUDGET_S:.0f} s per job; slowest candidate {worst[0]:.1f} s of {CANDIDATE_BUDGET_S:.0f} s "
                 f"({worst[1]})")
    for (table, row), seconds in summary["gfx950"]["rows"].items():
        lines.append(f"  {table}[{row}]: {counts[(table, row)]} Triton candidates, {seconds:.1f} s of compiles")
    verdict = "fits" if total <= 0.5 * JOB_BUDGET_S and worst[0] <= CANDIDATE_BUDGET_S else "DOES NOT FIT"
    lines.append(f"verdict: compiles {verdict} (rule: at most half the job's budget, the rest is the aiter "
                 "candidates, the checks and 10 timed calls each)")
    return lines


def format_results(results, summary, overall):
    lines = []
    for target, entries in results.items():
        lines.append(f"target {target}")
        current = None
        for table, row, shape, label, seconds, note in entries:
            if (table, row) != current:
                if current is not None:
                    lines.append(f"    row total {summary[target]['rows'][current]:8.2f} s")
                current = (table, row)
                lines.append(f"  {table}[{row}] bs={shape[0]} kv={shape[1]}")
            shown = "  failed" if seconds is None else f"{seconds:8.2f} s"
            lines.append(f"    {shown}  {label} {note}".rstrip())
        if current is not None:
            lines.append(f"    row total {summary[target]['rows'][current]:8.2f} s")
        lines.append(f"  target total {summary[target]['total']:.1f} s")
    lines.append(f"overall {overall:.1f} s (targets compiled side by side, one process each)")
    return lines


# ---------------------------------------------------------------------------------------------
# Workers (one process per target)


def offline_worker(target):
    """Ahead-of-time compiles for one target, in race order; [(table, row, shape, label, s, note)]."""
    from tools import kernel_report as kr

    module = kr.load_module(os.path.join(ROOT, "submission.py"))
    spec = kr.TARGETS[target]
    seen, out = set(), []
    for table, row, shape, candidates in target_work(racing_work(module), target):
        for candidate in candidates:
            seconds, note = 0.0, ""
            try:
                for entry in module.triton_compile_plan(candidate["route"], copy.deepcopy(candidate["params"]),
                                                        spec.fp8_dtype):
                    if entry.get("targets") is not None and target not in entry["targets"]:
                        continue
                    unit = kr.complete_plan_entry(entry, spec)
                    key = json.dumps([candidate["route"], unit[1], unit[2], sorted(map(str, unit[3].items())),
                                      unit[4]], sort_keys=True, default=str)
                    if key in seen:
                        note = (note + " (compiled above)").strip()
                        continue
                    seen.add(key)
                    t0 = time.perf_counter()
                    kr.compile_unit(*unit, spec)
                    seconds += time.perf_counter() - t0
            except Exception as exc:  # reported, the others still measured
                seconds, note = None, f"FAILED {type(exc).__name__}: {str(exc)[:200]}"
            out.append((table, row, shape, submission.route_label(candidate), seconds, note))
    return out


def launch_worker():
    """Real first launches on this CUDA GPU of TRITON_ROUTE_TABLE's candidates: first call minus
    second call, each synchronised."""
    import torch

    import reference

    data = reference.generate_input(2, 1, 256, seed=1, device="cuda")
    out = []
    for table, row, shape, candidates in target_work(racing_work(submission), "sm90-launch"):
        for candidate in candidates:
            label = submission.route_label(candidate)
            route = submission.ROUTES.get(candidate["route"])
            if route is None:
                out.append((table, row, shape, label, None, "route absent here"))
                continue
            times = []
            try:
                for _ in range(2):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    route(*data, **candidate["params"])
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                out.append((table, row, shape, label, max(times[0] - times[1], 0.0), ""))
            except Exception as exc:
                out.append((table, row, shape, label, None, f"FAILED {type(exc).__name__}: {exc}"[:200]))
    return out


def run_targets(targets, timeout_s):
    """Each target in its own process with a fresh Triton cache; {target: lines}, {target: error}."""
    procs, results, errors = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="compile_times_") as tmp:
        for target in targets:
            env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(tmp, f"cache_{target}"))
            env["TRITON_INTERPRET"] = "0"
            out_path = os.path.join(tmp, f"{target}.json")
            log = open(os.path.join(tmp, f"{target}.log"), "w")
            procs[target] = (subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", target,
                                               "--worker-out", out_path], env=env, cwd=ROOT, stdout=log,
                                              stderr=subprocess.STDOUT), log, out_path)
        deadline = time.time() + timeout_s
        for target, (proc, log, out_path) in procs.items():
            try:
                proc.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
            if proc.returncode == 0 and os.path.exists(out_path):
                results[target] = [tuple(x) for x in json.load(open(out_path))]
            else:
                tail = open(os.path.join(tmp, f"{target}.log")).read()[-1500:]
                errors[target] = f"exit {proc.returncode}: {tail}"
    return results, errors


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default=None,
                        help="comma-separated of gfx950, sm90, sm90-launch (default: all; sm90-launch only "
                             "with a CUDA GPU)")
    parser.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    parser.add_argument("--timeout", type=float, default=280.0, help="seconds for all targets together")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        lines = launch_worker() if args.worker == "sm90-launch" else offline_worker(args.worker)
        with open(args.worker_out, "w") as f:
            json.dump(lines, f)
        return 0

    import torch
    import triton

    targets = args.targets.split(",") if args.targets else [
        t for t in TARGETS if t != "sm90-launch" or (torch.cuda.is_available() and torch.version.hip is None)]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        parser.error(f"unknown targets {unknown}: choose from {TARGETS}")
    print(f"compile_times: Triton {triton.__version__}, torch {torch.__version__}, {os.cpu_count()} cores, "
          f"an empty Triton cache per target", flush=True)
    started = time.time()
    results, errors = run_targets(targets, args.timeout)
    summary, overall = summarise(results)
    for line in format_results(results, summary, overall) + budget_lines(results, summary):
        print(line)
    for target, error in errors.items():
        print(f"ERROR target {target}: {error}")
    print(f"wall {time.time() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "errors": errors, "overall_s": overall}, f, indent=1)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

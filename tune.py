#!/usr/bin/env python3
"""Tune the active route table's rows on this machine with the race's own measuring, judging and
ranking, over a wider search space and longer than the race, and (with --write) write the winners.

    python tune.py [SPEC] [--write [--force]] [--space wide|table] [--seeds K] [--repeats N]
                   [--flush runner|race] [--max-minutes M] [--json PATH] [--chart PATH] [...]
    python tune.py --from-log LOG [--submission PATH] [--write]   (tools/freeze_race_log.py)

One selection policy. Candidates are measured by submission.run_measuring: each in a measuring
process (a death or hang is contained and named, a new process goes on, a kernel that failed
is not started again for a later shape), judged by race_judge against what its own q and KV
formats reach on the same data, warmed up, timed, re-timed when the spread is wide; a shape's
candidates are ranked by submission.rank_row (fastest median first; the row's current route,
candidate [1], stays unless beaten by RACE_MARGIN). tune.py adds only what an offline tune needs:
- shapes: each (batch, kv_len) of SPEC (default specs/benchmarks.txt: the leaderboard's shapes,
  the active table's racing rows); the row tuned is the one select_route picks for the shape;
- candidates: the row's own route first, then its race candidates, then (--space wide, the
  default) every configuration of SEARCH_SPACE for the routes this machine has;
- seeds: K (--seeds) per shape, the spec's case seed a combined with secret-like b's as the runner
  combines them (utils.combine_seed: a + (a+b)(a+b+1)/2); judged on every seed, timed on all;
- timing: --repeats calls per seed (the race: RACE_REPEATS on one seed), each after the runner's
  flush (--flush runner: the runner's 62.5 GiB randn, as the leaderboard times, through
  utils.L2Flusher so that it fits an 80 GB card; race: the race's own);
- a progress bar, one report per shape (winner, its margin over the runner-up, the current
  route), a JSON file and a chart (results/ by default), a result cache for resuming.

--write writes the winners into the table in submission.py (tools/route_tables.py: the file is
compiled, imported and routed before it is replaced; the table keeps its structure: a racing
row keeps its candidates, with the replaced route among them; a fixed row stays fixed; a route
that is not portable, the Hopper route, is followed by the shape's best portable candidate; the
catch-all is untouched). Refused on a machine without a GPU (the times there are the
interpreter's, not a GPU's) unless --force.

Exit codes: 0 done; 1 no shape has a winner (nothing written); 2 bad arguments or refused;
3 stopped by --max-minutes (measured results are in the cache: run again to resume; nothing
written).
"""
import argparse
import hashlib
import itertools
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from tools import freeze_race_log, route_tables  # noqa: E402

# ---------------------------------------------------------------------------------------------
# The search space (data): every route and mode a route table can choose. Keys a route function
# does not take are dropped with a warning at run time.
#   aiter (MI355X with aiter): both persistent kernels at page sizes 1-16 (> 1 only where it
#     divides the KV length; the race's judge rejects a page size that reads too little) and split
#     counts 1-32; the fp8 q scale "unit" or "tensor" where the route quantises q.
#   Triton (portable): splits 1-64 (a split shorter than block_n is skipped), tiles of 64 or 128
#     KV rows, 4 or 8 warps, 2 or 3 pipeline stages; triton_mxfp4's S from dequantised bf16 tiles
#     ("none") or tl.dot_scaled with q in e4m3 ("e4m3").
#   hopper_fp8 (sm_90 only): splits 1-64, 4 or 8 warps, 2-4 TMA ring slots.
SPLITS = [1, 2, 4, 8, 16, 32, 64]
SEARCH_SPACE = {
    "aiter_bf16": {},
    "aiter_fp8": {"q_scale": ["unit", "tensor"]},
    "aiter_a8w8_persistent": {"page_size": [1, 2, 4, 8, 16], "num_splits": [1, 2, 4, 8, 16, 32],
                              "q_scale": ["unit", "tensor"]},
    "aiter_a16w8_persistent": {"page_size": [1, 2, 4, 8, 16], "num_splits": [1, 2, 4, 8, 16, 32]},
    "triton_fp8": {"num_splits": SPLITS, "block_n": [64, 128], "num_warps": [4, 8], "num_stages": [2, 3]},
    "triton_mxfp4": {"num_splits": SPLITS, "block_n": [64, 128], "num_warps": [4, 8], "num_stages": [2, 3],
                     "qk_dot_scaled": ["none", "e4m3"]},
    "hopper_fp8": {"num_splits": SPLITS, "num_warps": [4, 8], "num_stages": [2, 3, 4]},
}
DEFAULT_SPEC = os.path.join(HERE, "specs", "benchmarks.txt")
DEFAULT_SEEDS = 3
DEFAULT_REPEATS = 20  # per seed: 60 timed calls a candidate at the default seeds, 4x the race's
DEFAULT_CANDIDATE_LIMIT_S = 120.0  # one candidate, compile and every seed included
DEFAULT_SEED_RNG = 0  # draws the secret b's: fixed by default, so that a rerun finds the cache
SECRET_SEED_RANGE = (1, 2**31)
DEFAULT_JSON = os.path.join("results", "tune.json")
DEFAULT_CHART = os.path.join("results", "tune.png")
DEFAULT_CACHE = os.path.join("results", "tune_cache.jsonl")
NO_DEADLINE_S = 1e9
DEFINITE = ("died", "raised", "rel", "n/a")  # outcomes a rerun would repeat: cached (a hang may be a load's)
UNFINISHED = ("cut", "not reached")  # the budget ended first: measured again by a rerun

EXIT_OK, EXIT_NO_WINNER, EXIT_BAD_ARGS, EXIT_STOPPED = 0, 1, 2, 3


class TuneError(Exception):
    """A problem the user must fix (bad arguments, a refused write, a table that cannot be written)."""


def _log(text):
    print(text, file=sys.stderr, flush=True)


def _key(candidate):
    return json.dumps(candidate, sort_keys=True)


# ---------------------------------------------------------------------------------------------
# Shapes, seeds and candidates


def read_shapes(spec_path):
    """[(batch, kv_len, case seed)] of a spec file, one per distinct (batch, kv_len), the first
    seed kept; decode only (qseqlen 1)."""
    import utils

    shapes, seen = [], set()
    for case in utils.read_spec_file(spec_path):
        args = case.args
        if int(args.get("qseqlen", 1)) != 1:
            _log(f"tune.py: skipping '{case.spec}': decode only (qseqlen 1)")
            continue
        shape = (int(args["batchsize"]), int(args["kvseqlen"]))
        if shape not in seen:
            seen.add(shape)
            shapes.append((*shape, int(args.get("seed", 0))))
    return shapes


def draw_secret_seeds(k, rng_seed=DEFAULT_SEED_RNG):
    rng = random.Random(rng_seed)
    return [rng.randrange(*SECRET_SEED_RANGE) for _ in range(k)]


def case_seeds(seed, secret_bs):
    import utils

    return [utils.combine_seed(seed, b) for b in secret_bs]


def expand_grid(grid):
    """{"a": [1, 2], "b": [3]} -> [{"a": 1, "b": 3}, {"a": 2, "b": 3}] ({} -> [{}])."""
    keys = list(grid)
    values = [grid[k] if isinstance(grid[k], (list, tuple)) else [grid[k]] for k in keys]
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*values)]


def route_keywords(fn):
    """The keyword parameters a route takes after its five inputs (None: any)."""
    import inspect

    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params[5:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def space_routes(sub, space, only=None):
    """The space's routes this submission has here (sub.ROUTES: aiter routes only where aiter
    imported, the Hopper route only on sm_90), in the space's order; `only` narrows them."""
    if only:
        unknown = [r for r in only if r not in space]
        if unknown:
            raise TuneError(f"--routes: {', '.join(unknown)} not in the search space ({', '.join(space)})")
    return [r for r in space if r in sub.ROUTES and (not only or r in only)]


def route_configs(sub, route, space, warn=_log):
    """The distinct parameter dicts of a route's grid, keys the route does not take dropped."""
    grid = dict(space.get(route, {}))
    accepted = route_keywords(sub.ROUTES[route])
    if accepted is not None:
        dropped = [k for k in grid if k not in accepted]
        if dropped:
            warn(f"tune.py: {route} takes no {', '.join(dropped)}: dropped from its grid")
        grid = {k: v for k, v in grid.items() if k in accepted}
    configs, seen = [], set()
    for params in expand_grid(grid):
        key = json.dumps(params, sort_keys=True)
        if key not in seen:
            seen.add(key)
            configs.append(params)
    return configs


def skip_reason(sub, candidate, batch, kv_len):
    """Why a configuration of the space is not tried at a shape (None: try it)."""
    params = candidate["params"]
    if not sub.row_preconditions_hold(route_tables.table_row(candidate["route"], params), kv_len, True):
        return f"page_size {params.get('page_size')} does not divide kv {kv_len}"
    splits, block_n = params.get("num_splits", 1), params.get("block_n")
    if block_n and splits > 1 and -(-kv_len // splits) < block_n:
        return f"{splits} splits of kv {kv_len} are shorter than block_n {block_n}"
    return None


class ShapeJob:
    """One shape to tune: the row select_route picks (row_index; own: its bounds are the shape)
    and the candidates, the row's own route first (index 0, what rank_row's margin keeps)."""

    def __init__(self, batch, kv_len, seed, seeds, row_index, own, candidates, from_row):
        self.batch, self.kv_len, self.seed, self.seeds = batch, kv_len, seed, seeds
        self.row_index, self.own, self.candidates, self.from_row = row_index, own, candidates, from_row

    @property
    def shape(self):
        return (self.batch, self.kv_len)

    @property
    def name(self):
        return f"bs={self.batch} kv={self.kv_len}"


def plan(sub, table, shapes, secret_bs, space=None, routes=None, warn=_log):
    """[ShapeJob] for shapes [(batch, kv_len, seed)]: the row's race candidates, then (space not
    None) the space's configurations of the routes here that hold for the shape."""
    configs = {}
    if space is not None:
        configs = {r: route_configs(sub, r, space, warn) for r in space_routes(sub, space, routes)}
    jobs = []
    for batch, kv_len, seed in shapes:
        row = sub.select_route(batch, kv_len, True, table)
        index = next(i for i, r in enumerate(table) if r is row)
        candidates = [dict(c) for c in sub.race_candidates(row)]
        from_row = len(candidates)
        seen = {_key(c) for c in candidates}
        for route, params_list in configs.items():
            for params in params_list:
                candidate = {"route": route, "params": params}
                if _key(candidate) not in seen and skip_reason(sub, candidate, batch, kv_len) is None:
                    seen.add(_key(candidate))
                    candidates.append(candidate)
        own = (row["max_batch"], row["max_kv_len"]) == (batch, kv_len)
        jobs.append(ShapeJob(batch, kv_len, seed, case_seeds(seed, secret_bs), index, own, candidates, from_row))
    return jobs


# ---------------------------------------------------------------------------------------------
# The result cache (JSONL, append-only; the last record of a key wins)


def code_hash(path):
    """sha256 (16 hex) of the submission's text outside the route tables: what its measurements
    depend on (a table rewrite keeps them)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, TypeError):
        return "none"
    try:
        start, end = route_tables.block_span(text)
        text = text[:start] + text[end:]
    except route_tables.RouteTableError:
        pass
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class ResultCache:
    def __init__(self, path=None):
        self.path, self.records = path, {}
        if path and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        record = json.loads(line)
                        self.records[record["key"]] = record["result"]
                    except (ValueError, KeyError, TypeError):
                        continue  # a line cut short by a killed run

    @staticmethod
    def key(context, job, candidate):
        return json.dumps({**context, "shape": list(job.shape), "seeds": job.seeds, "candidate": candidate},
                          sort_keys=True)

    def get(self, key):
        return self.records.get(key)

    def put(self, key, result):
        self.records[key] = result
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"key": key, "result": result}) + "\n")


def cacheable(result):
    """Timed, or failed in a way a rerun would repeat (not cut, not reached, not carried over)."""
    if "median" in result:
        return True
    why = result.get("why", "")
    return why.split(" ")[0] in DEFINITE and "@" not in why.split(" ")[0]


# ---------------------------------------------------------------------------------------------
# Measuring (submission.run_measuring) and ranking (submission.rank_row)


def _progress(total, enabled):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    tty = sys.stderr.isatty()  # a log file (a device call) gets a line every 30 s, not a bar
    return tqdm(total=total, desc="tune", unit="candidate", file=sys.stderr, dynamic_ncols=tty,
                mininterval=0.5 if tty else 30.0)


def measure(sub, jobs, options, fp8_dtype, deadline, cache=None, context=None, progress=False):
    """{shape: {index: result}} for every job, and the notes of the measuring ({shape: note}).
    One run_measuring call per shape (each shape has its own seeds); a candidate whose kernel
    died, hung or raised at an earlier shape is not started again (`died@BxK`, as the race)."""
    cache = cache or ResultCache(None)
    context = context or {}
    results, notes, failed = {}, {}, {}
    bar = _progress(sum(len(job.candidates) for job in jobs), progress)
    try:
        for job in jobs:
            mine = results[job.shape] = {}
            todo = []
            for index, candidate in enumerate(job.candidates):
                kernel = sub.candidate_kernel(candidate)
                cached = cache.get(ResultCache.key(context, job, candidate))
                if cached is not None:
                    mine[index] = dict(cached, cached=True)
                elif kernel in failed:
                    mine[index] = {"why": failed[kernel]}
                else:
                    todo.append((index, candidate))
            if bar is not None:
                bar.update(len(job.candidates) - len(todo))
            if todo:
                def on_result(shape, index, result, job=job):
                    if cacheable(result):
                        cache.put(ResultCache.key(context, job, job.candidates[index]), result)
                    if bar is not None:
                        shown = f"{job.name} [{index + 1}] {route_tables.label(job.candidates[index])}"
                        bar.set_postfix_str(shown[:70], refresh=False)
                        bar.update(1)

                measured, note = sub.run_measuring([(job.shape, todo)], fp8_dtype, deadline,
                                                   options=dict(options, seeds=job.seeds), on_result=on_result)
                for (_, index), result in measured.items():
                    mine[index] = result
                if note:
                    notes[job.shape] = note
            for index, result in mine.items():  # the race's rule: that kernel is not started again
                mark = sub.failure_mark(result, job.shape)
                if mark is not None:
                    failed.setdefault(sub.candidate_kernel(job.candidates[index]), mark)
            if sub.race_clock() >= deadline:
                break
    finally:
        if bar is not None:
            bar.close()
    return results, notes


def outcome(sub, job, results):
    """The shape's ranking (submission.rank_row), winner and runner-up indices, and the margins:
    runner-up and current route over the winner's median (fractions)."""
    ranking = sub.rank_row(results)
    winner = ranking[0] if ranking else None
    runner_up = ranking[1] if len(ranking) > 1 else None

    def over(index):
        if winner is None or index is None or "median" not in results.get(index, {}):
            return None
        return results[index]["median"] / results[winner]["median"] - 1.0

    return {"ranking": ranking, "winner": winner, "runner_up": runner_up, "margin": over(runner_up),
            "current_over": over(0),
            "complete": len(results) == len(job.candidates)
            and not any(r.get("why", "").startswith(UNFINISHED) for r in results.values())}


def _best_portable(sub, job, results, ranking, current):
    """The best portable candidate by rank_row among the portable timed ones, `current` (the
    portable row there now, when it was measured) first so that the margin keeps it."""
    portable = [i for i in ranking if _portable(sub, job.candidates[i]["route"])]
    if not portable:
        return None
    order = sorted(portable, key=lambda i: job.candidates[i] != current)
    ranked = sub.rank_row({k: results[i] for k, i in enumerate(order)})
    return job.candidates[order[ranked[0]]] if ranked else None


def _portable(sub, route):
    return sub.ROUTE_INFO.get(route, {}).get("portable", True)


def new_table(sub, table, jobs, results, outcomes):
    """The table with each tuned shape's winner (rows changed from the last index up, so that
    rows inserted after one row leave the indices above as they were). Returns (rows, changes)."""
    rows = [dict(r) for r in table]
    changes = []

    def portable(route):
        return _portable(sub, route)

    for job in sorted(jobs, key=lambda j: -j.row_index):
        out = outcomes[job.shape]
        if out["winner"] is None or out["winner"] == 0:
            continue
        winner = job.candidates[out["winner"]]
        bounds = job.shape
        if job.own:
            old = rows[job.row_index]
            index = job.row_index
            candidates = None
            if "candidates" in old:
                candidates = [c for c in route_tables.row_candidates(old) if _key(c) != _key(winner)]
            new_row = route_tables.table_row(winner["route"], winner["params"], *bounds, candidates=candidates)
        else:  # the shape has no row of its own: a fixed row for it, before the row it took
            index = next(i for i, r in enumerate(rows) if route_tables.matches(r, *bounds))
            rows.insert(index, dict(rows[index]))  # place_row replaces this copy
            new_row = route_tables.table_row(winner["route"], winner["params"], *bounds)
        follower = None
        if not portable(winner["route"]):
            nxt = rows[index + 1] if index + 1 < len(rows) else None
            current = (route_tables.row_candidates(nxt)[0] if nxt is not None and job.own
                       and (nxt["max_batch"], nxt["max_kv_len"]) == bounds else None)
            follower = _best_portable(sub, job, results[job.shape], out["ranking"], current)
        rows, after = route_tables.place_row(rows, index, new_row, portable, follower)
        changes.append((job, after))
    return rows, changes


# ---------------------------------------------------------------------------------------------
# tune.py's own measuring process: the environment as eval.py prepares it, a timer, then the
# submission's race_child_main. On a CPU (submission.py measures only on a GPU: CUDA events, and on
# the CPU its Triton kernels need the interpreter fixes the file cannot carry) the timer is
# perf_counter around each call: its times mean nothing, its judging is real. On a GPU with
# --flush runner (runner_flush_timer) the runner's flush is utils.L2Flusher's, which fits an 80 GB
# card; submission.py's own runner branch drops its randn into the allocator's cache, where the
# next inputs split the block, and the next flush finds no 62.5 GiB (out of memory on an H100).
MEASURING_FLAG = "--measuring-process"


def cpu_timer(candidate, fn, repeats, flush):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return times


def runner_flush_timer(sub, flusher):
    """The race's timer on a GPU (submission._events_timer) with --flush runner's calls timed by
    utils.time_call after ``flusher`` (utils.L2Flusher("runner")): the same steps (synchronize, the
    runner's randn, events around one call, synchronize; us per call). The flush is given back
    after each timing (untimed), so that the next inputs and candidates have the whole card."""
    import utils

    def timer(candidate, fn, repeats, flush):
        if flush != "runner":
            return sub._events_timer(candidate, fn, repeats, flush)
        try:
            return [utils.time_call(fn, flush=flusher)[1] / 1e3 for _ in range(repeats)]
        finally:
            flusher.release()
    return timer


def measuring_process(path):
    import utils

    utils.prepare_environment()
    import eval as runner
    import torch

    sub = runner.load_submission(path, "_tune_measuring")
    on_gpu = torch.cuda.is_available()
    sub.race_timer = runner_flush_timer(sub, utils.L2Flusher("runner")) if on_gpu else cpu_timer
    sub.race_child_main()


# ---------------------------------------------------------------------------------------------
# Reports


def _cell(result):
    if result is None:
        return "not measured"
    if "median" in result:
        return f"{result['median']:.1f} us median (mean {result['mean']:.1f})"
    return f"x {result.get('why', '?')}"


def report(job, results, out, note=None):
    """Lines for one shape: winner, runner-up with its margin, the current route, failures."""
    timed = sum("median" in r for r in results.values())
    failed = [(i, r) for i, r in sorted(results.items()) if "why" in r]
    row = f"row {job.row_index + 1}" if job.own else f"no row of its own (row {job.row_index + 1} serves it)"
    lines = [f"== {job.name} ({row}; {len(job.candidates)} candidates: {job.from_row} of the row, "
             f"{len(job.candidates) - job.from_row} of the search space; {timed} timed, {len(failed)} failed, "
             f"{len(job.candidates) - len(results)} not measured) =="]

    def entry(index):
        return f"[{index + 1}] {route_tables.label(job.candidates[index])}"

    if out["winner"] is None:
        lines.append("  no candidate was timed and judged right: the row is kept")
    else:
        lines.append(f"  winner    {entry(out['winner'])}: {_cell(results[out['winner']])}")
        if out["runner_up"] is not None:
            lines.append(f"  runner-up {entry(out['runner_up'])}: {_cell(results[out['runner_up']])}, "
                         f"+{100 * out['margin']:.1f}% over the winner")
        current = results.get(0)
        if out["winner"] != 0:
            margin = "" if out["current_over"] is None else f", +{100 * out['current_over']:.1f}% over the winner"
            verdict = f"{margin}: replaced"
        else:
            fastest = min(out["ranking"], key=lambda i: results[i]["median"])
            verdict = (": kept (the fastest)" if fastest == 0 else
                       f": kept ([{fastest + 1}] is faster, but not by the race's margin)")
        lines.append(f"  current   {entry(0)}: {_cell(current)}{verdict}")
    for index, result in failed[:12]:
        lines.append(f"  failed    {entry(index)}: x {result['why']}")
    if len(failed) > 12:
        lines.append(f"  ... {len(failed) - 12} more failed (see the JSON)")
    if note:
        lines.append(f"  note: {note}")
    return lines


def draw_chart(path, jobs, results, outcomes, title):
    """Per shape, each route's best median (log scale), the winner circled, the current route x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def timed(job, route):
        return [results[job.shape][i]["median"] for i, c in enumerate(job.candidates)
                if c["route"] == route and "median" in results[job.shape].get(i, {})]

    routes = [r for r in dict.fromkeys(c["route"] for job in jobs for c in job.candidates)
              if any(timed(job, r) for job in jobs)]
    width = 0.7 / max(1, len(routes))

    def x_of(x, route):
        return x - 0.35 + width * (routes.index(route) + 0.5)

    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(jobs) + 2), 4.8))
    for route in routes:
        points = [(x_of(x, route), min(timed(job, route))) for x, job in enumerate(jobs) if timed(job, route)]
        ax.plot(*zip(*points, strict=True), marker="o", linestyle="none", label=f"{route} (best)")
    marked = set()
    for x, job in enumerate(jobs):
        out, mine = outcomes[job.shape], results[job.shape]
        for index, style in ((out["winner"], "winner"), (0, "current route")):
            if index is None or "median" not in mine.get(index, {}):
                continue
            kwargs = ({"s": 260, "facecolors": "none", "edgecolors": "red", "zorder": 5} if style == "winner"
                      else {"marker": "x", "color": "black", "zorder": 6})
            ax.scatter([x_of(x, job.candidates[index]["route"])], [mine[index]["median"]],
                       label=None if style in marked else style, **kwargs)
            marked.add(style)
    ax.set_yscale("log")
    ax.set_xticks(range(len(jobs)))
    ax.set_xticklabels([f"bs={j.batch}\nkv={j.kv_len}" for j in jobs])
    ax.set_ylabel("median time per call (us)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    if routes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Command line


def _parser():
    p = argparse.ArgumentParser(prog="tune.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", nargs="?", default=DEFAULT_SPEC, help="spec file (default specs/benchmarks.txt)")
    p.add_argument("--write", action="store_true", help="write the winners into the active table of the submission")
    p.add_argument("--force", action="store_true", help="--write even without a GPU (interpreter timings)")
    p.add_argument("--space", choices=("wide", "table"), default="wide",
                   help="wide: the row's candidates and SEARCH_SPACE (default); table: the row's candidates only")
    p.add_argument("--grid", default=None, help="search space as JSON {route: {param: [values]}} (or @file.json)")
    p.add_argument("--routes", default=None, help="comma-separated routes of the search space to sweep")
    p.add_argument("--seeds", type=int, default=DEFAULT_SEEDS, help=f"seeds per shape (default {DEFAULT_SEEDS})")
    p.add_argument("--seed-rng", type=int, default=DEFAULT_SEED_RNG, help="seed of the draw of the secret b's")
    p.add_argument("--secret-seeds", default=None, help="comma-separated secret b's (instead of the draw)")
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                   help=f"timed calls per seed (default {DEFAULT_REPEATS})")
    p.add_argument("--flush", choices=("runner", "race"), default="runner",
                   help="before each timed call: the runner's 62.5 GiB randn (default) or the race's flush")
    p.add_argument("--candidate-limit", type=float, default=DEFAULT_CANDIDATE_LIMIT_S,
                   help="seconds one candidate may take, compile and all seeds included (then: hung)")
    p.add_argument("--max-minutes", type=float, default=None, help="stop measuring after this many minutes")
    p.add_argument("--json", default=DEFAULT_JSON, help=f"results as JSON (default {DEFAULT_JSON})")
    p.add_argument("--chart", default=DEFAULT_CHART, help=f"chart PNG (default {DEFAULT_CHART}; '' for none)")
    p.add_argument("--cache", default=DEFAULT_CACHE, help=f"JSONL result cache (default {DEFAULT_CACHE})")
    p.add_argument("--no-cache", action="store_true", help="measure everything, keep no cache")
    p.add_argument("--submission", default=os.path.join(HERE, "submission.py"))
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--from-log", default=None, metavar="LOG",
                   help="no measuring: freeze a race log into fixed rows (tools/freeze_race_log.py)")
    return p


def _grid(text):
    if text.startswith("@"):
        with open(text[1:], encoding="utf-8") as f:
            text = f.read()
    grid = json.loads(text)
    if not isinstance(grid, dict) or not all(isinstance(v, dict) for v in grid.values()):
        raise TuneError("--grid must be a JSON object {route: {param: [values]}}")
    return grid


def _table_name(sub, table):
    return next(name for name in route_tables.TABLE_NAMES if getattr(sub, name, None) is table)


def main(argv=None, sub=None):
    """The command line. `sub`: a submission module already loaded (tests inject one whose
    measuring process is a test double); by default the file at --submission."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return EXIT_OK if exc.code == 0 else EXIT_BAD_ARGS
    if args.from_log is not None:
        return freeze_race_log.run(args.from_log, args.submission, write=args.write)
    try:
        return _main(args, sub)
    except (TuneError, route_tables.RouteTableError) as exc:
        _log(f"tune.py: {exc}")
        return EXIT_BAD_ARGS


def _main(args, sub):
    import utils

    utils.prepare_environment()
    import torch

    started = time.time()
    on_gpu = torch.cuda.is_available()
    if args.write and not on_gpu and not args.force:
        raise TuneError("--write refused: there is no GPU here, so every time would be the Triton interpreter's on "
                        "the CPU, not a GPU's, and the table would trade its measured rows for noise. Tune on the "
                        "GPU the table is for (an MI355X for AITER_ROUTE_TABLE), or add --force")
    for name, value in (("--seeds", args.seeds), ("--repeats", args.repeats)):
        if value < 1:
            raise TuneError(f"{name} must be at least 1")
    if not os.path.exists(args.spec):
        raise TuneError(f"spec file {args.spec} not found")
    if sub is None:
        if not os.path.exists(args.submission):
            raise TuneError(f"submission {args.submission} not found")
        import eval as runner

        sub = runner.load_submission(args.submission, "_tune_submission")
        if not on_gpu or args.flush == "runner":  # this file's measuring process (see measuring_process)
            sub.race_command = [sys.executable, os.path.abspath(__file__), MEASURING_FLAG, sub.__file__]
    import reference

    table = sub.active_route_table()
    table_name = _table_name(sub, table)
    secret_bs = ([int(b) for b in args.secret_seeds.split(",") if b.strip()] if args.secret_seeds
                 else draw_secret_seeds(args.seeds, args.seed_rng))
    space = None if args.space == "table" else (_grid(args.grid) if args.grid else SEARCH_SPACE)
    routes = [r.strip() for r in args.routes.split(",") if r.strip()] if args.routes else None
    jobs = plan(sub, table, read_shapes(args.spec), secret_bs, space, routes)
    device = torch.cuda.get_device_name() if on_gpu else "cpu"
    options = {"repeats": args.repeats, "flush": args.flush, "candidate_limit_s": args.candidate_limit}
    print(f"tune.py {os.path.relpath(args.spec)} | {device} | torch {torch.__version__} | {table_name} | "
          f"{len(jobs)} shapes, {sum(len(j.candidates) for j in jobs)} candidates | {len(secret_bs)} seeds x "
          f"{args.repeats} timed calls, {args.flush} flush | ranked by submission.rank_row (median; the current "
          f"route stays unless beaten by {100 * sub.RACE_MARGIN:g}%)", flush=True)
    if not on_gpu:
        print("NOTE: no GPU here: kernels run in the Triton interpreter; the times mean nothing, only the judging "
              "counts", flush=True)
    cache = ResultCache(None if args.no_cache else args.cache)
    context = {"device": device, "code": code_hash(getattr(sub, "__file__", None)), "torch": torch.__version__,
               "fp8": str(reference.fp8_dtype()), "options": options}
    budget = NO_DEADLINE_S if args.max_minutes is None else 60.0 * args.max_minutes
    results, notes = measure(sub, jobs, options, reference.fp8_dtype(), sub.race_clock() + budget, cache, context,
                             progress=not args.no_progress)
    outcomes = {}
    for job in jobs:
        mine = results.get(job.shape, {})
        outcomes[job.shape] = outcome(sub, job, mine)
        print()
        print("\n".join(report(job, mine, outcomes[job.shape], notes.get(job.shape))))
    complete = all(outcomes[job.shape]["complete"] for job in jobs)
    rows, changes = new_table(sub, table, jobs, results, outcomes)
    written, status = False, EXIT_OK
    if not complete:
        status = EXIT_STOPPED
        print("\nstopped before every candidate was measured (--max-minutes or the measuring process): nothing "
              "written; run the same command again to go on from the cache")
    elif not any(outcomes[job.shape]["winner"] is not None for job in jobs):
        status = EXIT_NO_WINNER
        print("\nno shape has a winner: nothing written")
    elif rows == table:
        print(f"\n{table_name}: every tuned row keeps its route: nothing to write")
    else:
        for job, after in sorted(changes, key=lambda change: change[0].row_index):
            print(f"{table_name} {job.name}: {route_tables.label(job.candidates[outcomes[job.shape]['winner']])}"
                  + (f" ({after})" if after else ""))
        print(f"\n{route_tables.format_table(table_name, rows)}")
        if args.write:
            own = [job.shape for job in jobs if outcomes[job.shape]["winner"] not in (None, 0) or job.own]
            route_tables.write_tables(args.submission, {table_name: rows}, {table_name: own})
            written = True
            print(f"written into {args.submission} (only {table_name} between the markers changed)")
        else:
            print("(not written: add --write)")
    record = {
        "device": device, "on_gpu": on_gpu, "submission": os.path.abspath(args.submission), "table": table_name,
        "spec": args.spec, "secret_seeds": secret_bs, "options": options, "space": args.space,
        "complete": complete, "written": written, "elapsed_s": time.time() - started,
        "rows": rows, "shapes": [{
            "batch": job.batch, "kv_len": job.kv_len, "case_seed": job.seed, "seeds": job.seeds,
            "row": job.row_index + 1, "own_row": job.own, "note": notes.get(job.shape),
            **{k: (v + 1 if isinstance(v, int) and k in ("winner", "runner_up") else v)
               for k, v in outcomes[job.shape].items() if k != "ranking"},
            "ranking": [i + 1 for i in outcomes[job.shape]["ranking"]],
            "candidates": [{"index": i + 1, "label": route_tables.label(c), "candidate": c,
                            "result": results.get(job.shape, {}).get(i)} for i, c in enumerate(job.candidates)],
        } for job in jobs]}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1, default=str)
        print(f"JSON: {args.json}")
    if args.chart:
        title = f"tune.py on {device}: {table_name}, best median per route"
        if not on_gpu:
            title += "\n(CPU, Triton interpreter: times mean nothing)"
        try:
            draw_chart(args.chart, jobs, {job.shape: results.get(job.shape, {}) for job in jobs}, outcomes, title)
            print(f"chart: {args.chart}")
        except ImportError as exc:
            print(f"no chart: {exc}")
    return status


if __name__ == "__main__":
    if sys.argv[1:2] == [MEASURING_FLAG]:
        measuring_process(sys.argv[2])
    else:
        sys.exit(main())

#!/usr/bin/env python3
"""Sweep every route of submission.py x its parameters per shape, keep only configurations with a
proven accuracy margin, pick the fastest, and (with --write) rewrite the route-table literal.

    python tune.py [SPEC] [--quick] [--write] [--json PATH] [--chart PATH] [--cache PATH]
                   [--max-minutes M] [--seeds K] [--routes R1,R2] [--grid JSON] [...]
    python tune.py --from-log FILE [--write] [--submission PATH]

For each case (shape) of SPEC (default specs/benchmarks.txt on a GPU, specs/cpu.txt without one):
- candidates: every route in submission.ROUTES (aiter routes only where submission.HAVE_AITER) x
  its grid in SEARCH_SPACE (QUICK_SEARCH_SPACE with --quick); grid keys the route function does
  not accept are dropped; configurations whose preconditions fail for the shape are skipped.
- checks on K fresh secret-like seeds: case seed a combined with random secret b's exactly as the
  runner combines POPCORN_SEED (a + (a+b)(a+b+1)/2). A configuration is ELIGIBLE only if its worst
  mismatch ratio against ref_kernel (rtol = atol = 0.1) is <= --max-mismatch (default 1%, five
  times under the runner's 5%), its worst relative L2 error against float64 attention over the
  bf16 cache is <= ROUTE_INFO[route]["rel_l2_bound"], and its output is a fresh, finite bf16
  tensor of the right shape. Ineligible configurations are never chosen, however fast.
- timing like the runner: synchronize, L2 flush, CUDA events around ONE call, repeated; median and
  mean reported, the winner is the fastest MEAN (the leaderboard ranks by means). The call is
  submission.custom_kernel with a one-row route table holding the configuration (so the host time
  the runner sees counts), or the route function itself when the module cannot be routed that way.
  On the CPU perf_counter is used and the times mean nothing.

Results are appended to a JSONL cache (--cache, default results/tune_cache.jsonl) keyed by device,
shape, route, params, seed set and a hash of submission.py outside the route tables: a rerun skips
what was measured, and --max-minutes stops cleanly between configurations.

Route table written by --write (only the table of the machine: AITER_ROUTE_TABLE when aiter routes
were tuned, TRITON_ROUTE_TABLE otherwise; the other literal and everything outside the markers stay
byte-identical): one row per tuned shape, sorted by kv then batch so that first-match picks each
shape's own row (when the winner's route is not portable, ROUTE_INFO "portable": False like the
Hopper route, the shape's fastest portable configuration follows it: rows whose route is absent
are skipped), then a catch-all row (max_batch None, max_kv_len None) with the fastest eligible
always-valid portable configuration (page size 1) of the largest shape. The new text is compiled and
imported as a module before it replaces the file (atomically).

Rows may carry "candidates" (raced by the submission on the first call of the row's shape): the
writer keeps them, one per line under the row. --from-log FILE runs no sweep: it reads the
"submission.py race TABLE bs=B kv=K (us median/mean): ..." lines the submission printed (FILE "-"
= stdin; other text around them is ignored; a line whose chosen candidate was not timed is no
measurement and is skipped) and freezes each line's chosen route and params into a fixed row (no
candidates) of its table: the racing row with the shape's bounds whose candidates fit the line is
replaced (a line that fits no such row is reported and not frozen: the table changed since the
race), or, when no row has those bounds, the row is inserted before the first row that matches
the shape; for several lines of one shape the last wins. It prints a line per race and the changed
tables, and with --write writes them (checked as above).

Exit codes: 0 done; 1 a shape has no eligible configuration (nothing written); 2 bad arguments (or
no race line in --from-log's FILE, or none that fits the tables); 3 stopped by --max-minutes
(partial results are cached; rerun to resume; nothing written).
"""
import argparse
import ast
import hashlib
import importlib.util
import inspect
import itertools
import json
import math
import os
import random
import re
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))

# ---------------------------------------------------------------------------------------------
# The search space (data). Keys a route function does not take are dropped at run time, so a
# grid may name parameters of a route still being written.
#
# aiter (MI355X with aiter): page size 1/2/4/8/16 (> 1 needs uniform KV lengths that are a
# multiple of it), KV splits 1..32 (powers of two plus 12 and 24), the Q scale mode.
# Triton: split count; block_n 32/64/128 (all valid tl.dot tiles; >= 64 lets Hopper issue wgmma,
# 32 falls back to mma.sync; 128 x 576 fp8 = 72 KiB per pipeline stage, so 128 with many stages
# may not fit the H200's 227 KiB of shared memory: a configuration that fails to compile or run is
# recorded with its error and never chosen);
# num_warps, num_stages; for the fp8 route whether Q.K^T runs in fp8 (qk_fp8) or f16, for the
# mxfp4 route whether S comes from tl.dot_scaled (qk_dot_scaled) or dequantised bf16 tiles.
SEARCH_SPACE = {
    "aiter_bf16": {},
    "aiter_fp8": {"q_scale": ["unit", "tensor"]},
    "aiter_a8w8_persistent": {
        "page_size": [1, 2, 4, 8, 16],
        "num_splits": [1, 2, 4, 8, 12, 16, 24, 32],
        "q_scale": ["unit", "tensor"],
    },
    "triton_fp8": {
        "num_splits": [1, 2, 4, 8, 16, 32],
        "block_n": [32, 64, 128],
        "num_warps": [4, 8],
        "num_stages": [2, 3, 4],
        "qk_fp8": [True, False],
        "q_scale": ["program", "tensor"],
    },
    "hopper_fp8": {  # sm_90 only (absent elsewhere, so never tuned there)
        "num_splits": [1, 2, 4, 8, 16, 32],
        "num_warps": [4, 8],
        "num_stages": [2, 3],
        "cooperative_merge": [True, False],
    },
    "triton_mxfp4": {
        "num_splits": [1, 2, 4, 8, 16, 32],
        "block_n": [32, 64, 128],
        "num_warps": [4, 8],
        "num_stages": [2, 3],
        "qk_dot_scaled": ["none", "bf16"],  # "bf16": tl.dot_scaled, GPU only (not in the interpreter)
    },
}
QUICK_SEARCH_SPACE = {
    "aiter_bf16": {},
    "aiter_fp8": {"q_scale": ["unit"]},
    "aiter_a8w8_persistent": {"page_size": [1, 8], "num_splits": [8, 16],
                              "q_scale": ["unit"]},
    "triton_fp8": {"num_splits": [1, 8], "block_n": [64], "num_warps": [8], "num_stages": [2],
                   "qk_fp8": [True, False]},
    "triton_mxfp4": {"num_splits": [1, 8], "block_n": [64], "num_warps": [8], "num_stages": [2],
                     "qk_dot_scaled": ["none"]},
    "hopper_fp8": {"num_splits": [1, 8], "num_warps": [4], "num_stages": [2]},
}

MAX_MISMATCH = 0.01  # eligibility: worst mismatch ratio over the seeds (the runner allows 0.05)
DEFAULT_SEEDS = 5
DEFAULT_SEED_RNG = 0  # draws the secret b's: fixed by default so that reruns hit the cache
SECRET_SEED_RANGE = (1, 2**31)
DEFAULT_CACHE = os.path.join("results", "tune_cache.jsonl")
GPU_MAX_REPEATS, CPU_MAX_REPEATS = 100, 3
GPU_MAX_TIME_S, CPU_MAX_TIME_S = 1.0, 2.0  # measured time per configuration
GPU_MIN_RUNS = 10
TABLE_NAMES = ("AITER_ROUTE_TABLE", "TRITON_ROUTE_TABLE")
BEGIN_MARKER, END_MARKER = "# BEGIN ROUTE TABLES", "# END ROUTE TABLES"
ROUTE_ARGS = 5  # fn(q, kv_data, qo_indptr, kv_indptr, config, **params)

EXIT_OK, EXIT_NO_WINNER, EXIT_BAD_ARGS, EXIT_STOPPED = 0, 1, 2, 3


class TuneError(Exception):
    """A problem the user must fix (bad arguments, a table that cannot be written)."""


class SweepAborted(Exception):
    """The device is unusable (e.g. a CUDA error poisoned the context): stop, keep the cache."""


def _log(*parts):
    print(*parts, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# The submission (the process is prepared by utils.prepare_environment, as eval.py's)


def load_submission(path):
    import eval as runner  # the project's runner: one loader for everyone

    return runner.load_submission(path, "_tune_submission")


def code_hash(sub):
    """sha256 (16 hex) of the submission's source outside the route-table block: the kernels'
    version, unchanged by a table rewrite. 'none' for a module without a source file."""
    path = getattr(sub, "__file__", None)
    if not path or not os.path.exists(path):
        return "none"
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        start, end = _block_span(text)
        text = text[:start] + text[end:]
    except TuneError:
        pass
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Candidates


def is_aiter_route(route):
    return route.startswith("aiter")


def available_routes(sub, space, only=None):
    """Routes to tune: the space's routes present in sub.ROUTES (in the space's order), then any
    other route of sub.ROUTES (tuned with its defaults); aiter routes only where HAVE_AITER."""
    routes = [r for r in space if r in sub.ROUTES] + [r for r in sub.ROUTES if r not in space]
    routes = [r for r in routes if not is_aiter_route(r) or getattr(sub, "HAVE_AITER", False)]
    if only:
        unknown = [r for r in only if r not in sub.ROUTES]
        if unknown:
            raise TuneError(f"--routes: {', '.join(unknown)} not in submission.ROUTES "
                            f"({', '.join(sub.ROUTES)})")
        routes = [r for r in routes if r in only]
    return routes


def route_keywords(fn):
    """Names of the keyword parameters a route takes after its five inputs; None = any (**kw)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params[ROUTE_ARGS:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def expand_grid(grid):
    """{"a": [1, 2], "b": [3]} -> [{"a": 1, "b": 3}, {"a": 2, "b": 3}] ({} -> [{}])."""
    keys = list(grid)
    values = [grid[k] if isinstance(grid[k], (list, tuple)) else [grid[k]] for k in keys]
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*values)]


def route_configs(sub, route, space, warn=_log):
    """The distinct parameter dicts to try for a route (grid keys it does not take dropped)."""
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


def table_row(route, params, max_batch=None, max_kv_len=None):
    return {"max_batch": max_batch, "max_kv_len": max_kv_len, "route": route, "params": dict(params)}


def preconditions_hold(sub, route, params, kv_len, uniform=True):
    """The submission's own row preconditions (paged rows: uniform lengths, kv a multiple)."""
    check = getattr(sub, "row_preconditions_hold", None)
    row = table_row(route, params)
    if callable(check):
        return bool(check(row, kv_len, uniform))
    page = params.get("page_size", 1)
    return page == 1 or (uniform and kv_len % page == 0)


def config_skip_reason(sub, route, params, batch, kv_len):
    """Why a configuration is not tried at a shape (None: try it)."""
    if not preconditions_hold(sub, route, params, kv_len):
        return f"page_size {params.get('page_size')} does not divide kv {kv_len}"
    splits, block_n = params.get("num_splits", 1), params.get("block_n")
    if block_n and splits > 1 and -(-kv_len // splits) < block_n:
        # every split is shorter than one tile: the same work as fewer splits, plus empty programs
        return f"{splits} splits of kv {kv_len} are shorter than block_n {block_n}"
    return None


def is_portable(sub, route):
    """False for a route that exists only on some hardware (ROUTE_INFO[route]["portable"])."""
    return getattr(sub, "ROUTE_INFO", {}).get(route, {}).get("portable", True)


def always_valid(sub, route, params):
    """True when the row holds for any lengths (what a catch-all row needs)."""
    return all(preconditions_hold(sub, route, params, kv, uniform=False) for kv in (1, 7, 1000, 1031))


# ---------------------------------------------------------------------------------------------
# Seeds and cases


def draw_secret_seeds(k, rng_seed=DEFAULT_SEED_RNG):
    rng = random.Random(rng_seed)
    return [rng.randrange(*SECRET_SEED_RANGE) for _ in range(k)]


def case_seeds(seed, secret_bs):
    import utils

    return [utils.combine_seed(seed, b) for b in secret_bs]


def read_shapes(spec_path):
    """[(batch, kv_len, seed)] of a spec file, one per distinct (batch, kv_len), first seed kept;
    decode only (qseqlen 1)."""
    import utils

    shapes, seen = [], set()
    for case in utils.read_spec_file(spec_path):
        args = case.args
        if int(args.get("qseqlen", 1)) != 1:
            _log(f"tune.py: skipping '{case.spec}': decode only (qseqlen 1)")
            continue
        key = (int(args["batchsize"]), int(args["kvseqlen"]))
        if key not in seen:
            seen.add(key)
            shapes.append((key[0], key[1], int(args.get("seed", 0))))
    return shapes


class Case:
    """One shape's inputs on K seeds with their expected outputs: ref_kernel (the runner's check)
    and float64 attention over the bf16 cache (the strict bound). Built on first use."""

    def __init__(self, batch, kv_len, seed, seeds, device):
        self.batch, self.kv_len, self.seed, self.seeds, self.device = batch, kv_len, seed, seeds, device
        self.inputs = self.refs = self.exact = None

    @property
    def label(self):
        return f"bs={self.batch} kv={self.kv_len}"

    def build(self):
        if self.inputs is None:
            import reference

            self.inputs, self.refs, self.exact = [], [], []
            for seed in self.seeds:
                data = reference.generate_input(self.batch, 1, self.kv_len, seed, device=self.device)
                self.inputs.append(data)
                self.refs.append(reference.ref_kernel(data))
                self.exact.append(reference.attention_float64(data))
        return self

    def release(self):
        self.inputs = self.refs = self.exact = None


# ---------------------------------------------------------------------------------------------
# Calling one configuration like the runner calls custom_kernel


def _active_table_name(sub):
    """The name of the module global that custom_kernel routes by, or None."""
    if not callable(getattr(sub, "custom_kernel", None)):
        return None
    active = getattr(sub, "active_route_table", None)
    if not callable(active):
        return None
    table = active()
    for name in TABLE_NAMES:
        if getattr(sub, name, None) is table:
            return name
    return None


_WARNED = set()


class ConfigCaller:
    """Calls one (route, params). Inside `with`, the module's active route table is a one-row
    table holding this configuration, so that `caller(data)` is exactly the runner's
    custom_kernel(data) call (input checks and host time included). When the module cannot be
    routed that way (no custom_kernel / table, or the call shows another route ran), the route
    function is called directly."""

    def __init__(self, sub, route, params):
        self.sub, self.route, self.params = sub, route, dict(params)
        self.fn = sub.ROUTES[route]
        self.table_name = _active_table_name(sub)
        self.via = "custom_kernel" if self.table_name else "route"
        self._saved = None

    def __enter__(self):
        if self.table_name:
            self._saved = getattr(self.sub, self.table_name)
            setattr(self.sub, self.table_name, [table_row(self.route, self.params)])
        return self

    def __exit__(self, *exc):
        if self.table_name:
            setattr(self.sub, self.table_name, self._saved)
        return False

    def _direct(self, data):
        q, kv_data, qo_indptr, kv_indptr, config = data
        return self.fn(q, kv_data, qo_indptr, kv_indptr, config, **self.params)

    def __call__(self, data):
        if self.via == "custom_kernel":
            return self.sub.custom_kernel(data)
        return self._direct(data)

    def first_call(self, data):
        """The first call: confirms that custom_kernel ran this very configuration, else falls
        back to calling the route directly (an exception there is the configuration's own)."""
        if self.via == "custom_kernel":
            try:
                out = self.sub.custom_kernel(data)
                label = str(getattr(self.sub, "LAST_ROUTE", ""))
                if label.split()[:1] == [self.route] and str(self.params) in label:
                    return out
                problem = f"LAST_ROUTE is {label!r}"
            except Exception as exc:  # the router may refuse; the route itself decides below
                problem = f"{type(exc).__name__}: {exc}"
            self.via = "route"
            out = self._direct(data)  # raises when the configuration itself is broken
            if "via" not in _WARNED:
                _WARNED.add("via")
                _log(f"tune.py: custom_kernel did not run a one-row table ({_one_line(problem)}); "
                     "calling route functions directly (host time of custom_kernel not counted)")
            return out
        return self._direct(data)


def _one_line(text, limit=300):
    text = " | ".join(line.strip() for line in str(text).strip().splitlines() if line.strip())
    return text[:limit]


# ---------------------------------------------------------------------------------------------
# Measuring one configuration


def _strict_problems(output, data, second):
    import eval as runner

    return runner.strict_problems(output, data, second)


def _device_alive(device):
    import utils

    try:
        utils.synchronize(device)
        return True
    except Exception:
        return False


def time_config(caller, data, device, flusher, max_repeats, max_time_s, min_runs):
    """Timed repeats of ONE call each after a warm-up call, timed as eval.py times custom_kernel
    (utils.time_repeats: synchronize, L2 flush, CUDA events / perf_counter). The runner's stop
    rule, after at least ``min_runs`` repeats, within ``max_time_s`` of measured time and ten
    times that (at least 10 s) of wall time."""
    import utils

    durations, _ = utils.time_repeats(
        lambda: caller(data), device, flusher, max_repeats=max_repeats,
        max_time_ns=max_time_s * 1e9, max_wall_ns=max(10 * max_time_s, 10.0) * 1e9,
        min_runs=max(min_runs, utils.RUNNER_MIN_RUNS), warm_up=True)
    stats = utils.calculate_stats(durations)
    return {"runs": stats.runs, "mean_ns": stats.mean, "median_ns": float(statistics.median(durations)),
            "std_ns": stats.std, "err_ns": stats.err, "best_ns": stats.best, "worst_ns": stats.worst}


def measure_config(sub, case, route, params, opts, flusher):
    """Check one configuration on every seed of the case, then time it when eligible (or always
    with opts["time_all"]). Returns the record's measured part."""
    import reference
    import torch
    import utils

    case.build()
    record = {"call": None, "error": None, "mismatch": [], "rel_l2": [], "problems": [],
              "timing": None}
    caller = ConfigCaller(sub, route, params)
    try:
        with caller:
            for i, (data, ref, exact) in enumerate(zip(case.inputs, case.refs, case.exact, strict=True)):
                work = reference.clone_data(data)
                out = caller.first_call(work) if i == 0 else caller(work)
                utils.synchronize(case.device)
                record["mismatch"].append(float(reference.mismatch_ratio(out, ref)))
                record["rel_l2"].append(float(reference.rel_l2_error(out, exact)))
                if i == 0:
                    second = caller(reference.clone_data(data))
                    utils.synchronize(case.device)
                    record["problems"] = _strict_problems(out, work, second)
                    del second
                del out, work
            record["call"] = caller.via
            eligible, _ = judge(record, route_bound(sub, route), opts["max_mismatch"])
            if eligible or opts.get("time_all"):
                record["timing"] = time_config(caller, case.inputs[0], case.device, flusher,
                                               opts["max_repeats"], opts["max_time_s"],
                                               opts["min_runs"])
    except Exception as exc:
        record["call"] = caller.via
        record["error"] = _one_line(f"{type(exc).__name__}: {exc}")
        record["traceback_tail"] = _one_line(traceback.format_exc()[-1500:], 1500)
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
        elif not _device_alive(case.device):
            raise SweepAborted(f"{route} {params} at {case.label} left the device unusable: "
                               f"{record['error']}") from exc
    return record


def route_bound(sub, route):
    info = getattr(sub, "ROUTE_INFO", {}).get(route, {})
    bound = info.get("rel_l2_bound")
    if bound is None:
        import eval as runner

        bound = runner.DEFAULT_REL_L2_BOUND
    return float(bound)


def judge(record, bound, max_mismatch):
    """(eligible, reason) from a record's measured numbers under the current limits."""
    if record.get("error"):
        return False, f"error: {record['error']}"
    if record.get("problems"):
        return False, "; ".join(record["problems"])
    if not record.get("mismatch"):
        return False, "not checked"
    worst_mm = max(record["mismatch"])
    worst_l2 = max(record["rel_l2"])
    if not worst_mm <= max_mismatch:
        return False, f"mismatch {100 * worst_mm:.3f}% > {100 * max_mismatch:g}%"
    if not worst_l2 <= bound:  # also catches NaN
        return False, f"rel L2 {worst_l2:.4f} > bound {bound:g}"
    return True, "ok"


# ---------------------------------------------------------------------------------------------
# The result cache (JSONL, append-only; the last record of a key wins)


class ResultCache:
    def __init__(self, path=None):
        self.path = path
        self.records = {}
        if path and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                        self.records[rec["key"]] = rec
                    except (ValueError, KeyError, TypeError):
                        continue  # a line cut short by a killed run

    @staticmethod
    def key(device_name, batch, kv_len, route, params, seeds, code):
        return json.dumps({"device": device_name, "batch": batch, "kv_len": kv_len, "route": route,
                           "params": params, "seeds": list(seeds), "code": code}, sort_keys=True)

    def get(self, key):
        return self.records.get(key)

    def put(self, key, record):
        record = dict(record, key=key)
        self.records[key] = record
        if self.path:
            directory = os.path.dirname(os.path.abspath(self.path))
            os.makedirs(directory, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record, default=str) + "\n")  # params keep their order
                f.flush()
                os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------------
# The sweep


def _progress(total, enabled):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    tty = sys.stderr.isatty()  # a log file (a device call) gets a line every 30 s, not a bar
    return tqdm(total=total, desc="tune", unit="config", file=sys.stderr, dynamic_ncols=tty,
                mininterval=0.5 if tty else 30.0)


def tune(sub, shapes, *, space=None, secret_bs=None, device=None, max_mismatch=MAX_MISMATCH,
         max_repeats=None, max_time_s=None, min_runs=None, cache=None, time_all=False,
         deadline=None, routes=None, flush_mode="default", progress=False, rank_by="mean",
         warn=_log):
    """Sweep routes x params over shapes [(batch, kv_len, seed)]. Returns a result dict:
    device, cases (each with every configuration's record, winner, runner-up), measured /
    cached counts, complete (False when the deadline, a time.time() value, stopped it)."""
    import utils

    space = SEARCH_SPACE if space is None else space
    secret_bs = draw_secret_seeds(DEFAULT_SEEDS) if secret_bs is None else list(secret_bs)
    device = utils.get_device(device)
    on_gpu = device.type == "cuda"
    opts = {"max_mismatch": max_mismatch, "time_all": time_all,
            "max_repeats": max_repeats or (GPU_MAX_REPEATS if on_gpu else CPU_MAX_REPEATS),
            "max_time_s": max_time_s or (GPU_MAX_TIME_S if on_gpu else CPU_MAX_TIME_S),
            "min_runs": min_runs or (GPU_MIN_RUNS if on_gpu else 1)}
    cache = cache if cache is not None else ResultCache(None)
    dev_name = utils.device_name(device)
    code = code_hash(sub)
    route_names = available_routes(sub, space, routes)
    configs = {r: route_configs(sub, r, space, warn) for r in route_names}

    cases, plan = [], []
    for batch, kv_len, seed in shapes:
        case = Case(batch, kv_len, seed, case_seeds(seed, secret_bs), device)
        cases.append(case)
        todo = []
        for route in route_names:
            for params in configs[route]:
                if config_skip_reason(sub, route, params, batch, kv_len) is None:
                    todo.append((route, params))
        plan.append(todo)

    result = {"device": str(device), "device_name": dev_name, "code": code, "on_gpu": on_gpu,
              "secret_seeds": secret_bs, "max_mismatch": max_mismatch, "rank_by": rank_by,
              "routes": route_names, "configs_per_route": {r: len(c) for r, c in configs.items()},
              "measured": 0, "cached": 0, "complete": True, "stopped": None, "cases": []}
    flusher = utils.L2Flusher(flush_mode, device) if on_gpu else None
    bar = _progress(sum(len(t) for t in plan), progress)
    try:
        for case, todo in zip(cases, plan, strict=True):
            records = []
            for route, params in todo:
                key = ResultCache.key(dev_name, case.batch, case.kv_len, route, params, case.seeds, code)
                rec = cache.get(key)
                bound = route_bound(sub, route)
                if rec is not None and (rec.get("timing") or not (time_all or judge(rec, bound, max_mismatch)[0])):
                    result["cached"] += 1
                    rec = dict(rec, cached=True)
                else:
                    if deadline is not None and time.time() >= deadline:
                        result["complete"] = False
                        result["stopped"] = "--max-minutes reached"
                        break
                    if bar is not None:
                        bar.set_postfix_str(f"{case.label} {route} {_params_text(params)}", refresh=False)
                    measured = measure_config(sub, case, route, params, opts, flusher)
                    rec = {"device_name": dev_name, "batch": case.batch, "kv_len": case.kv_len,
                           "seed": case.seed, "seeds": case.seeds, "route": route, "params": params,
                           "code": code, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                           **measured}
                    cache.put(key, rec)
                    result["measured"] += 1
                    rec = dict(rec, cached=False)
                records.append(rec)
                if bar is not None:
                    bar.update(1)
            summary = summarise_case(sub, case, records, max_mismatch, rank_by)
            summary["partial"] = len(records) < len(todo)
            result["cases"].append(summary)
            case.release()
            if on_gpu:
                import torch

                torch.cuda.empty_cache()  # the next shape's inputs may be much larger
            if not result["complete"]:
                break
    except SweepAborted as exc:
        result["complete"] = False
        result["stopped"] = str(exc)
        warn(f"tune.py: sweep stopped: {exc}")
    finally:
        if bar is not None:
            bar.close()
    result["cases_planned"] = len(cases)
    return result


def _rank_value(rec, rank_by):
    timing = rec.get("timing") or {}
    return timing.get(f"{rank_by}_ns", math.inf)


def summarise_case(sub, case, records, max_mismatch, rank_by="mean"):
    """Annotate records (eligible, reason, bound) and pick the winner and runner-up."""
    for rec in records:
        bound = route_bound(sub, rec["route"])
        rec["rel_l2_bound"] = bound
        rec["eligible"], rec["reason"] = judge(rec, bound, max_mismatch)
        rec["max_mismatch"] = max(rec["mismatch"]) if rec.get("mismatch") else None
        rec["max_rel_l2"] = max(rec["rel_l2"]) if rec.get("rel_l2") else None
    ranked = sorted((r for r in records if r["eligible"] and r.get("timing")),
                    key=lambda r: _rank_value(r, rank_by))
    best_per_route = {}
    for rec in ranked:
        best_per_route.setdefault(rec["route"], rec)
    return {"batch": case.batch, "kv_len": case.kv_len, "seed": case.seed, "seeds": case.seeds,
            "records": records, "winner": ranked[0] if ranked else None,
            "runner_up": ranked[1] if len(ranked) > 1 else None,
            "best_per_route": best_per_route, "eligible_count": len(ranked),
            "max_mismatch_limit": max_mismatch}


# ---------------------------------------------------------------------------------------------
# The route table


def build_table(sub, result):
    """Rows for the tuned shapes (sorted by kv then batch) plus the catch-all. TuneError when a
    shape has no eligible configuration or no always-valid configuration exists for the
    catch-all."""
    cases = result["cases"]
    missing = [f"bs={c['batch']} kv={c['kv_len']}" for c in cases if c["winner"] is None]
    if missing:
        raise TuneError(f"no eligible configuration for {', '.join(missing)}")
    if not cases:
        raise TuneError("no shapes were tuned")
    rank_by = result.get("rank_by", "mean")

    def ranked(case):
        return sorted((r for r in case["records"] if r["eligible"] and r.get("timing")),
                      key=lambda r: _rank_value(r, rank_by))

    rows = []
    for c in sorted(cases, key=lambda c: (c["kv_len"], c["batch"])):
        rows.append(table_row(c["winner"]["route"], c["winner"]["params"], c["batch"], c["kv_len"]))
        if not is_portable(sub, c["winner"]["route"]):
            # the winner's route is absent off its hardware: the best portable one follows it
            fallback = next((r for r in ranked(c) if is_portable(sub, r["route"])), None)
            if fallback is None:
                raise TuneError(f"bs={c['batch']} kv={c['kv_len']}: no eligible portable configuration "
                                f"to follow {c['winner']['route']}")
            rows.append(table_row(fallback["route"], fallback["params"], c["batch"], c["kv_len"]))
    for case in sorted(cases, key=lambda c: (c["batch"] * c["kv_len"], c["kv_len"]), reverse=True):
        for rec in ranked(case):
            if always_valid(sub, rec["route"], rec["params"]) and is_portable(sub, rec["route"]):
                rows.append(table_row(rec["route"], rec["params"]))
                return rows
    raise TuneError("no eligible configuration valid for every KV length (page size 1) to serve "
                    "as the catch-all row")


def target_table(routes, override=None):
    if override:
        if override not in TABLE_NAMES:
            raise TuneError(f"--table must be one of {', '.join(TABLE_NAMES)}")
        return override
    return "AITER_ROUTE_TABLE" if any(is_aiter_route(r) for r in routes) else "TRITON_ROUTE_TABLE"


def _py_literal(value):
    if isinstance(value, str):
        return json.dumps(value)
    if value is None or isinstance(value, (bool, int)):
        return repr(value)
    if isinstance(value, float) and math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_py_literal(k)}: {_py_literal(v)}" for k, v in value.items()) + "}"
    raise TuneError(f"cannot write {value!r} into a route table")


ROW_KEYS = ("max_batch", "max_kv_len", "route", "params", "candidates")
CANDIDATE_KEYS = ("route", "params")


def _check_keys(item, allowed, what):
    """A row or candidate key the writer does not know would be silently lost: refuse it."""
    unknown = [k for k in item if k not in allowed]
    if unknown:
        raise TuneError(f"cannot write the {what} key(s) {', '.join(map(repr, unknown))} into a route table")


def format_table(name, rows, width=100):
    """`NAME = [` + one row per line (params on a continuation line when long; a row's "candidates"
    one per line below it) + `]`. Every line is at most `width` characters unless one parameter
    alone is longer."""
    lines = [f"{name} = ["]
    for row in rows:
        lines += _row_lines(row, width)
    lines.append("]")
    return "\n".join(lines)


def _row_lines(row, width):
    """The lines of one row: its head and params, then its candidates (if any), each on its own
    line(s) indented under the row, so that a race's entrants read as a list."""
    _check_keys(row, ROW_KEYS, "row")
    head = (f'    {{"max_batch": {_py_literal(row["max_batch"])}, "max_kv_len": '
            f'{_py_literal(row["max_kv_len"])}, "route": {_py_literal(row["route"])},')
    candidates = row.get("candidates")
    if candidates is None:
        return _with_params(head, row["params"], 5, "},", width)
    if not isinstance(candidates, list):
        raise TuneError(f"a row's candidates must be a list, not {candidates!r}")
    if not candidates:
        return _with_params(head, row["params"], 5, ",", width) + ['     "candidates": []},']
    lines = _with_params(head, row["params"], 5, ",", width) + ['     "candidates": [']
    for candidate in candidates:
        if not isinstance(candidate, dict):
            raise TuneError(f"a candidate must be a dict {{'route', 'params'}}, not {candidate!r}")
        _check_keys(candidate, CANDIDATE_KEYS, "candidate")
        lines += _with_params(f'         {{"route": {_py_literal(candidate["route"])},', candidate["params"],
                              10, "},", width)
    return lines + ["     ]},"]


def _with_params(head, params, indent, close, width):
    """`head "params": {...}close` on one line when it fits in `width`, else `head` alone and the
    params wrapped below it at `indent` spaces."""
    line = f'{head} "params": {_py_literal(params)}{close}'
    if len(line) <= width:
        return [line]
    return [head] + _wrapped_params(params, width, indent, close)


def _wrapped_params(params, width, indent=5, close="},"):
    """`"params": {...}` + close as continuation lines of at most `width` characters (items wrap,
    aligned under the first item). Only called for params too long for one line: never empty."""
    lines, line = [], " " * indent + '"params": {'
    items = [f"{_py_literal(k)}: {_py_literal(v)}" for k, v in params.items()]
    for i, item in enumerate(items):
        item += "," if i < len(items) - 1 else "}" + close
        if line.endswith("{") or len(f"{line} {item}") <= width:
            line = line + item if line.endswith("{") else f"{line} {item}"
        else:
            lines.append(line)
            line = " " * (indent + len('"params": {')) + item
    return lines + [line]


def _block_span(text):
    """(start, end) character offsets of the text strictly between the marker lines."""
    begin = re.search(rf"^{re.escape(BEGIN_MARKER)}[ \t]*\n", text, re.M)
    end = re.search(rf"^{re.escape(END_MARKER)}[ \t]*$", text, re.M)
    if not begin or not end or end.start() < begin.end():
        raise TuneError(f"route-table markers '{BEGIN_MARKER}' / '{END_MARKER}' not found")
    return begin.end(), end.start()


def _assignment_spans(block):
    """{name: (start, end)} offsets in `block` of each top-level `NAME = literal` statement."""
    try:
        tree = ast.parse(block)
    except SyntaxError as exc:
        raise TuneError(f"the route-table block does not parse: {exc}") from exc
    line_starts = [0]
    for line in block.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))

    def offset(lineno, col):  # ast columns are UTF-8 byte offsets
        line_start = line_starts[lineno - 1]
        line = block[line_start:line_starts[lineno]]
        return line_start + len(line.encode()[:col].decode())

    spans = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            spans[node.targets[0].id] = (offset(node.lineno, node.col_offset),
                                         offset(node.end_lineno, node.end_col_offset))
    return spans


def read_tables(text):
    """{name: rows} of the literals between the markers."""
    start, end = _block_span(text)
    block = text[start:end]
    return {name: ast.literal_eval(block[a:b].split("=", 1)[1])
            for name, (a, b) in _assignment_spans(block).items()}


def replace_table_text(text, name, rows):
    """The file text with the literal of `name` (between the markers) replaced by `rows`;
    every other character is unchanged."""
    start, end = _block_span(text)
    block = text[start:end]
    spans = _assignment_spans(block)
    if name not in spans:
        raise TuneError(f"{name} is not assigned between the route-table markers")
    a, b = spans[name]
    literal = format_table(name, rows)
    new_text = text[:start + a] + literal + text[start + b:]
    if ast.literal_eval(literal.split("=", 1)[1]) != rows:
        raise TuneError("the formatted table does not read back as the rows")
    return new_text


_verify_serial = itertools.count()


def _check_routing(module, name, rows, shapes):
    """Every tuned shape must select its own row (the first row with its bounds that runs here; a
    row's own route and params, its candidates included, are what select_route returns) and
    anything else must find the catch-all. A shape none of whose rows runs here (a Hopper row
    alone, off sm_90) only has to route somewhere."""
    table = getattr(module, name)
    if table != rows:
        raise TuneError(f"the new module's {name} differs from the rows written")
    select = getattr(module, "select_route", None)
    if not callable(select) or "table" not in inspect.signature(select).parameters:
        return
    runs_here = getattr(module, "row_preconditions_hold", lambda row, kv_len, uniform: True)
    for batch, kv_len in shapes:
        # its own row: the first row written for the shape whose route exists here (a Hopper row is
        # followed by a portable row for the same shape)
        own = next((r for r in rows if (r["max_batch"], r["max_kv_len"]) == (batch, kv_len)
                    and runs_here(r, kv_len, True)), None)
        got = select(batch, kv_len, True, table=table)
        if own is not None and got != own:  # None: no row of the shape runs here (a Hopper row alone)
            raise TuneError(f"bs={batch} kv={kv_len} selects {got}, not its own row {own}")
    for batch, kv_len in ((1, 1), (3, 1031), (10**6, 10**7)):
        select(batch, kv_len, False, table=table)  # raises without an always-valid catch-all


def write_table(path, name, rows, shapes=()):
    """Rewrite the literal `name` in the submission at `path` IN PLACE (nothing else touched),
    after checking that the new text compiles, imports as a module holding exactly these rows,
    and routes each tuned shape (batch, kv_len) to its own row. Atomic (temp file + rename).
    Returns the new text. TuneError (file untouched) on any problem."""
    rows = [dict(r) for r in rows]
    if not rows or rows[-1]["max_batch"] is not None or rows[-1]["max_kv_len"] is not None:
        raise TuneError("a route table must end with a catch-all row (max_batch and max_kv_len None)")
    with open(path, encoding="utf-8", newline="") as f:
        old_text = f.read()
    new_text = replace_table_text(old_text, name, rows)
    try:
        compile(new_text, path, "exec")
    except SyntaxError as exc:
        raise TuneError(f"the rewritten file does not compile: {exc}") from exc
    old_tables, new_tables = read_tables(old_text), read_tables(new_text)
    for other, literal in old_tables.items():
        if other != name and new_tables.get(other) != literal:
            raise TuneError(f"rewriting {name} would change {other}")
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".tune-{os.getpid()}-{next(_verify_serial)}.py")
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(new_text)
        os.chmod(tmp, os.stat(path).st_mode & 0o7777)
        module_name = f"_tune_verify_{os.getpid()}_{next(_verify_serial)}"
        spec = importlib.util.spec_from_file_location(module_name, tmp)
        module = importlib.util.module_from_spec(spec)
        added = directory not in sys.path
        if added:
            sys.path.append(directory)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise TuneError(f"the rewritten file does not import: {_one_line(exc)}") from exc
        finally:
            if added:
                sys.path.remove(directory)
        try:
            _check_routing(module, name, rows, shapes)
        except TuneError:
            raise
        except Exception as exc:
            raise TuneError(f"the rewritten table does not route: {_one_line(exc)}") from exc
        with open(path, encoding="utf-8", newline="") as f:
            if f.read() != old_text:
                raise TuneError(f"{path} changed while tuning; not overwritten (rerun --write)")
        os.replace(tmp, path)
        tmp = None
    finally:
        if tmp and os.path.exists(tmp):
            os.remove(tmp)
    return new_text


# ---------------------------------------------------------------------------------------------
# Freezing the submission's candidate races (--from-log): no GPU, no inputs, only text
#
# On the first call of a shape at a racing row's bounds, submission.py prints one line on stderr
# (a job's race output must fit in 4 KB, so cells carry times only, not routes):
#   submission.py race TABLE bs=B kv=K (us median/mean): [1] 20.0/20.3 | [2] x rel 1>0.075
#     | [3] 12.0/342.7 -> chosen [N|catch-all] ROUTE {PARAMS}[; NOTE]
# (one line; PARAMS compact JSON). A cell is `[N] MEDIAN/MEAN` for a timed candidate or `[N] x WHY`
# for one that was not (WHY is free text: "rel 1>0.075", "raised ...", "died (...", "hung (> 20 s)",
# "n/a here", "not measured"). NOTE: "no candidate survived: the table's catch-all row runs",
# "budget: measuring stopped at the job's limit; ...", "not measured: ...". Candidate N is entry N
# of the raced row's list [the row's own {route, params}, *row["candidates"]]: --from-log finds
# that row in the submission's table (see label_race_cells) and turns each line into a fixed row
# of TABLE, so that the next submission runs the measured winner without racing. Other stderr
# lines that begin with "submission.py race" (race check ..., TABLE: choices ... read from ...,
# race skipped ..., race: further lines cut ...) are not race lines.

RACE_HEAD_RE = re.compile(  # a table name, as submission.py's route tables are named
    r"submission\.py race (?P<table>[A-Z][A-Z0-9_]*_TABLE) bs=(?P<batch>\d+) kv=(?P<kv_len>\d+)"
    r"(?P<units> \(us median/mean\))?: ")
RACE_TIMED_RE = re.compile(r"\[(?P<index>\d+)\] (?P<median>[^\s/]+)/(?P<mean>\S+)")
RACE_UNTIMED_RE = re.compile(r"\[(?P<index>\d+)\] x (?P<why>.*)")
RACE_CHOSEN_RE = re.compile(r"\[(?P<tag>\d+|catch-all)\] (?P<route>\S+) ")
RACE_NO_SURVIVOR = "no candidate survived"
RACE_BUDGET = "budget: "
RACE_CELL_SEP, RACE_CHOSEN_SEP, RACE_NOTE_SEP = " | ", " -> chosen ", "; "


class StaleRaceLine(TuneError):
    """A race line whose raced row is no longer in the submission's table (the table changed
    since the race): its cells cannot be named, so it is not frozen. `why`: the reason alone."""

    def __init__(self, parsed, why):
        super().__init__(f"{parsed['table']} bs={parsed['batch']} kv={parsed['kv_len']}: {why}")
        self.why = why


def _json_params_at(text, pos):
    """(params dict, end offset) of the compact JSON object starting at text[pos]: raw_decode
    finds where it ends, so a value holding spaces or brackets cannot confuse the split."""
    try:
        params, end = json.JSONDecoder().raw_decode(text, pos)
    except json.JSONDecodeError as exc:
        raise ValueError(f"params are not JSON at {text[pos:pos + 40]!r}: {exc.msg}") from exc
    if not isinstance(params, dict):
        raise ValueError(f"params must be a JSON object, not {params!r}")
    return params, end


def _race_time(text, position, what):
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"candidate {position}: {what} {text!r} is not a time in us")
    return value


def _parse_race_cell(text, position):
    """One `[N] MEDIAN/MEAN` (timed) or `[N] x WHY` (not timed) cell as a dict {index, time_us
    (the median; None when not timed), mean_us (None when not timed), dropped (WHY, or None),
    route, params (both None: the line does not name them; see label_race_cells)}."""
    cell = {"index": position, "time_us": None, "mean_us": None, "dropped": None, "route": None, "params": None}
    untimed = RACE_UNTIMED_RE.fullmatch(text)
    timed = None if untimed else RACE_TIMED_RE.fullmatch(text)
    m = untimed or timed
    if m is None:
        raise ValueError(f"candidate {position} is neither '[N] median/mean' nor '[N] x why': {text[:60]!r}")
    if int(m["index"]) != position:
        raise ValueError(f"candidate {position} is numbered [{m['index']}]")
    if untimed:
        cell["dropped"] = untimed["why"]
    else:
        cell["time_us"] = _race_time(timed["median"], position, "median")
        cell["mean_us"] = _race_time(timed["mean"], position, "mean")
    return cell


def _check_race_choice(parsed):
    """The chosen tag must agree with the cells: a numbered choice is a timed candidate (a line
    whose chosen cell was not timed, e.g. "x not measured" when the measuring process could not
    start, is not a measurement); [catch-all] only when no candidate was timed. A line that
    disagrees with itself was cut or edited, and freezing it would freeze a guess."""
    timed = [c for c in parsed["candidates"] if c["time_us"] is not None]
    if parsed["chosen"] == "catch-all":
        if timed:
            raise ValueError(f"[catch-all] chosen although [{timed[0]['index']}] was timed")
        return
    index = parsed["chosen"]
    if not 1 <= index <= len(parsed["candidates"]):
        raise ValueError(f"chosen [{index}] is not among the {len(parsed['candidates'])} candidates")
    cell = parsed["candidates"][index - 1]
    if cell["time_us"] is None:
        raise ValueError(f"chosen [{index}] was not timed ({cell['dropped']}): the line is not a measurement")
    if parsed["no_survivor"]:
        raise ValueError(f"chosen [{index}] although the line says {RACE_NO_SURVIVOR}")


def parse_race_line(text):
    """The race line found anywhere in `text` (one line of a log: a prefix such as a timestamp,
    trailing text and surrounding spaces are ignored) as a dict: table, batch, kv_len, candidates
    (see _parse_race_cell: times only, route and params None), chosen (1-based index or
    "catch-all"), route and params (the chosen ones, which the line names), note (the text after
    the chosen params' "; ", or None), budget (the note says the job's budget stopped measuring),
    no_survivor (the note says no candidate survived) and line (the race text itself).
    None for a line without `submission.py race TABLE bs=B kv=K (us median/mean): ` (the
    submission's other "submission.py race ..." lines: check, choices read, skipped, cut);
    ValueError for such a line that does not parse (cut, edited, an older format without
    "(us median/mean)") or that is not a measurement (the chosen cell was not timed): freezing it
    would be a guess."""
    head = RACE_HEAD_RE.search(text)
    if head is None:
        return None
    if not head["units"]:
        raise ValueError("a race line of an older submission.py (no '(us median/mean)'): not read")
    body = text[head.end():].rstrip()
    cells_text, sep, chosen_text = body.partition(RACE_CHOSEN_SEP)
    if not sep:
        raise ValueError(f"no '{RACE_CHOSEN_SEP.strip()}' in the race line (cut?)")
    candidates = [_parse_race_cell(cell, i) for i, cell in enumerate(cells_text.split(RACE_CELL_SEP), 1)]
    chosen = RACE_CHOSEN_RE.match(chosen_text)
    if chosen is None:
        raise ValueError(f"'-> chosen' is not followed by '[N] route {{params}}': {chosen_text[:60]!r}")
    params, end = _json_params_at(chosen_text, chosen.end())
    tail = chosen_text[end:]
    note = (tail[len(RACE_NOTE_SEP):].strip() or None) if tail.startswith(RACE_NOTE_SEP) else None
    parsed = {"table": head["table"], "batch": int(head["batch"]), "kv_len": int(head["kv_len"]),
              "candidates": candidates,
              "chosen": "catch-all" if chosen["tag"] == "catch-all" else int(chosen["tag"]),
              "route": chosen["route"], "params": params, "note": note,
              "budget": bool(note) and RACE_BUDGET in note, "no_survivor": bool(note) and RACE_NO_SURVIVOR in note,
              "line": text[head.start():].strip()}
    _check_race_choice(parsed)
    return parsed


def read_race_lines(text, warn=_log):
    """[(line number, parsed)] of every race line in a log's text; a line that names a race but
    does not parse or is not a measurement is reported through `warn` and skipped."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            parsed = parse_race_line(line)
        except ValueError as exc:
            warn(f"tune.py: line {number}: a race line that does not parse, skipped: {exc}")
            continue
        if parsed is not None:
            found.append((number, parsed))
    return found


def _shape_key(parsed):
    return parsed["table"], parsed["batch"], parsed["kv_len"]


def last_per_shape(parsed_lines):
    """(kept, superseded): the last line of each (table, batch, kv_len), in the order of the
    lines, and [(position, position of the line that supersedes it)] for the others (positions
    are indexes into parsed_lines). The last line wins: it is the latest measurement."""
    last = {_shape_key(p): i for i, p in enumerate(parsed_lines)}
    kept = [p for i, p in enumerate(parsed_lines) if last[_shape_key(p)] == i]
    superseded = [(i, last[_shape_key(p)]) for i, p in enumerate(parsed_lines) if last[_shape_key(p)] != i]
    return kept, superseded


def _matches(row, batch, kv_len):
    """The row's bounds hold for the shape (None = unbounded), as select_route reads them."""
    return ((row["max_batch"] is None or batch <= row["max_batch"])
            and (row["max_kv_len"] is None or kv_len <= row["max_kv_len"]))


def _row_candidates(row):
    """The row's race entrants in order, as submission.race_candidates lists them."""
    return [{"route": row["route"], "params": row["params"]}, *row.get("candidates", ())]


def _raced_row_index(rows, parsed):
    """Index of the row the line's race ran for: among the rows whose bounds are the shape and
    that have "candidates", the first whose entrants (see _row_candidates) are as many as the
    line's cells and whose entry N is the chosen route and params (for [catch-all], the first
    with as many entrants; a Hopper row and its portable follower share bounds and differ in
    entry 1). None when no row has the shape's bounds (the line's choice is then inserted);
    StaleRaceLine when rows have them but none can have run this race (the table changed)."""
    bounds = (parsed["batch"], parsed["kv_len"])
    same = [i for i, r in enumerate(rows) if (r["max_batch"], r["max_kv_len"]) == bounds]
    if not same:
        return None
    chosen = {"route": parsed["route"], "params": parsed["params"]}
    count = len(parsed["candidates"])
    racing = [i for i in same if rows[i].get("candidates")]
    for i in racing:
        entrants = _row_candidates(rows[i])
        if len(entrants) == count and (parsed["chosen"] == "catch-all" or entrants[parsed["chosen"] - 1] == chosen):
            return i
    if not racing:
        why = f"no row with these bounds races (row(s) {', '.join(str(i + 1) for i in same)}: no candidates)"
    else:
        why = (f"no racing row with these bounds (row(s) {', '.join(str(i + 1) for i in racing)}) has {count} "
               "candidates" + ("" if parsed["chosen"] == "catch-all" else
                               f" of which [{parsed['chosen']}] is {_label(**chosen)}"))
    raise StaleRaceLine(parsed, f"{why}; the table changed since the race: not frozen")


def label_race_cells(rows, parsed):
    """(index of the raced row or None, a copy of `parsed` whose cells carry their route and
    params): the line names only the chosen candidate, the raced row's entrants name the rest
    (see _raced_row_index; with no row of the shape's bounds the cells stay unnamed).
    StaleRaceLine when the table no longer holds the raced row."""
    index = _raced_row_index(rows, parsed)
    labelled = dict(parsed, candidates=[dict(c) for c in parsed["candidates"]])
    if index is not None:
        for cell, entrant in zip(labelled["candidates"], _row_candidates(rows[index]), strict=True):
            cell["route"], cell["params"] = entrant["route"], dict(entrant["params"])
    return index, labelled


def _portable_follower(rows, index, parsed, replaced, portable):
    """A portable row to put after a frozen non-portable one (ROUTE_INFO "portable": False, the
    Hopper route), which the submission requires for the same bounds: None when a portable row
    with those bounds already follows, else the line's fastest (median) timed portable candidate
    (cells named by label_race_cells), else the replaced row's own route and params when
    portable, else None (nothing known to be safe)."""
    bounds = (parsed["batch"], parsed["kv_len"])
    if any((r["max_batch"], r["max_kv_len"]) == bounds and portable(r["route"]) for r in rows[index + 1:]):
        return None
    timed = sorted((c for c in parsed["candidates"]
                    if c["time_us"] is not None and c["route"] is not None and portable(c["route"])),
                   key=lambda c: c["time_us"])
    if timed:
        return table_row(timed[0]["route"], timed[0]["params"], *bounds)
    if replaced is not None and portable(replaced["route"]):
        return table_row(replaced["route"], replaced["params"], *bounds)
    return None


def freeze_row(rows, parsed, portable=None):
    """(new rows, action) for one parsed race line: the fixed row {max_batch: bs, max_kv_len: kv,
    route, params} of the chosen candidate (no "candidates": the measured choice is frozen)
    replaces the row that raced (see _raced_row_index), or, when no row has the shape's bounds, is
    inserted before the first row that matches the shape (the one select_route picks now).
    A row with the bounds that already is the fixed row counts as the raced row (a log frozen
    twice changes nothing). Raises StaleRaceLine (a TuneError naming the table, the shape and why)
    when rows have the bounds but none ran this race: the table changed since, and the line is
    not frozen. `portable(route)` (optional): when False for the chosen route, a portable follower
    is added after it where none follows. action: {"index", "replaced" (the old row or None),
    "follower", "parsed" (the line with its cells named)}."""
    fixed = table_row(parsed["route"], parsed["params"], parsed["batch"], parsed["kv_len"])
    rows = [dict(r) for r in rows]
    try:
        index, parsed = label_race_cells(rows, parsed)
    except StaleRaceLine:
        index = next((i for i, r in enumerate(rows) if r == fixed), None)
        if index is None:
            raise
    replaced = None
    if index is not None:
        replaced = rows[index]
        rows[index] = fixed
    else:
        index = next((i for i, r in enumerate(rows) if _matches(r, parsed["batch"], parsed["kv_len"])), len(rows))
        rows.insert(index, fixed)
    follower = None
    if portable is not None and not portable(fixed["route"]):
        follower = _portable_follower(rows, index, parsed, replaced, portable)
        if follower is not None:
            rows.insert(index + 1, follower)
    return rows, {"index": index, "replaced": replaced, "follower": follower, "parsed": parsed}


def _freeze(tables, parsed_lines, portable=None):
    """(new tables, [action per kept line]) of freeze_rows: actions as freeze_row's, or, for a
    line that is not frozen because its raced row is gone (StaleRaceLine), {"parsed", "stale":
    the reason (StaleRaceLine.why)}. A line of a table the submission does not have raises TuneError."""
    new_tables = {name: [dict(r) for r in rows] for name, rows in tables.items()}
    kept, _ = last_per_shape(parsed_lines)
    actions = []
    for parsed in kept:
        if parsed["table"] not in new_tables:
            raise TuneError(f"{parsed['table']} (bs={parsed['batch']} kv={parsed['kv_len']}) is not a route "
                            f"table of the submission ({', '.join(new_tables) or 'none'})")
        try:
            new_tables[parsed["table"]], action = freeze_row(new_tables[parsed["table"]], parsed, portable)
        except StaleRaceLine as exc:
            action = {"parsed": parsed, "stale": exc.why}
        actions.append(action)
    return new_tables, actions


def freeze_rows(tables, parsed_lines, portable=None):
    """{name: rows} with every parsed race line frozen into a fixed row of its table (the last
    line of a shape wins; see freeze_row). `tables` is not modified; every table is returned.
    A line whose raced row the table no longer holds is reported on stderr and skipped (its
    shape keeps its rows); a line of a table that is not in `tables` raises TuneError."""
    new_tables, actions = _freeze(tables, parsed_lines, portable)
    for action in actions:
        if "stale" in action:
            p = action["parsed"]
            _log(f"tune.py: {p['table']} bs={p['batch']} kv={p['kv_len']}: {action['stale']}")
    return new_tables


def route_info_of(text):
    """The submission's ROUTE_INFO read from its source text as a literal ({} when it is not
    one): enough to know which routes are portable without importing torch or the kernels."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "ROUTE_INFO"):
            try:
                info = ast.literal_eval(node.value)
            except ValueError:
                return {}
            return info if isinstance(info, dict) else {}
    return {}


def _label(route, params):
    return f"{route} {json.dumps(params, separators=(',', ':'))}"


def _row_text(row):
    extra = f" + {len(row['candidates'])} candidates" if row.get("candidates") else ""
    return f"{_label(row['route'], row['params'])}{extra}"


def _median_mean(cell):
    return f"{cell['time_us']:.1f}/{cell['mean_us']:.1f} us"


def race_summary(number, action):
    """One human line per kept race line: shape, what was chosen (and its median/mean, and [1]'s
    when another won), what it replaced or where it went, and the line's note; or why it was not
    frozen (action["stale"])."""
    p = action["parsed"]
    shape = f"line {number}: {p['table']} bs={p['batch']} kv={p['kv_len']}"
    if "stale" in action:
        return f"{shape}: NOT FROZEN: {action['stale']}"
    tag = "[catch-all]" if p["chosen"] == "catch-all" else f"[{p['chosen']}]"
    timed = {c["index"]: c for c in p["candidates"] if c["time_us"] is not None}
    measured = f" {_median_mean(timed[p['chosen']])} (median/mean)" if p["chosen"] in timed else ""
    if p["chosen"] not in (1, "catch-all") and 1 in timed:
        measured += f" vs [1] {_median_mean(timed[1])}"
    text = (f"{shape}: chosen {tag} {_label(p['route'], p['params'])}{measured} ({len(timed)} timed, "
            f"{len(p['candidates']) - len(timed)} not); ")
    if action["replaced"] is not None:
        text += f"replaces row {action['index'] + 1} ({_row_text(action['replaced'])})"
    else:
        text += f"no row with these bounds: inserted as row {action['index'] + 1}"
    if action["follower"] is not None:
        text += f"; portable follower added: {_row_text(action['follower'])}"
    if p["chosen"] == "catch-all":
        text += "; NOTE: no candidate survived, the catch-all row's route is frozen for this shape"
    if p["budget"]:
        text += "; NOTE: the job's budget stopped measuring: not every candidate was measured"
    if p["note"] and not p["budget"] and not p["no_survivor"]:
        text += f"; NOTE: {p['note']}"
    return text


def from_log(log_path, submission_path, write=False, out=print):
    """--from-log: freeze the race lines of the log at `log_path` ("-": stdin) into the route
    tables of the submission at `submission_path`; print a summary per line and the changed
    tables; with `write`, rewrite them through write_table (compile, import, routing checked).
    A line whose raced row the submission's table no longer holds (see freeze_row) is reported
    ("NOT FROZEN") and skipped; the other lines are frozen. Returns the exit code (EXIT_BAD_ARGS
    when the log holds no race line, or when no line's raced row is in the tables)."""
    try:
        if log_path == "-":
            log_text = sys.stdin.read()
        else:
            with open(log_path, encoding="utf-8", errors="replace") as f:
                log_text = f.read()
        with open(submission_path, encoding="utf-8") as f:
            sub_text = f.read()
    except OSError as exc:
        raise TuneError(f"--from-log: {exc}") from exc
    found = read_race_lines(log_text)
    if not found:
        print(f"tune.py: no race line ('submission.py race TABLE bs=B kv=K (us median/mean): [1] MEDIAN/MEAN"
              f" | ... -> chosen [N] ROUTE {{PARAMS}}') in {log_path}: nothing to freeze", file=sys.stderr)
        return EXIT_BAD_ARGS
    numbers, parsed_lines = [n for n, _ in found], [p for _, p in found]
    info = route_info_of(sub_text)
    tables = read_tables(sub_text)
    new_tables, actions = _freeze(tables, parsed_lines, lambda r: info.get(r, {}).get("portable", True))
    superseded = dict(last_per_shape(parsed_lines)[1])
    for i, later in superseded.items():
        p = parsed_lines[i]
        out(f"line {numbers[i]}: {p['table']} bs={p['batch']} kv={p['kv_len']}: superseded by line "
            f"{numbers[later]} (several lines for one shape: the last one wins)")
    kept_numbers = [n for i, n in enumerate(numbers) if i not in superseded]  # the order of _freeze's actions
    for number, action in zip(kept_numbers, actions, strict=True):
        out(race_summary(number, action))
    frozen = [a for a in actions if "stale" not in a]
    if not frozen:
        print(f"tune.py: no race line of {log_path} matches a racing row of {submission_path}'s tables "
              "(changed since the race?): nothing frozen", file=sys.stderr)
        return EXIT_BAD_ARGS
    changed = [name for name in new_tables if new_tables[name] != tables[name]]
    for name in changed:
        out(f"\n{format_table(name, new_tables[name])}")
    if not changed:
        out("\nthe tables already hold these rows: nothing to change")
    if write:
        import utils  # importing the submission needs the project's environment (task, reference)

        utils.prepare_environment()
        for name in changed:
            shapes = [(a["parsed"]["batch"], a["parsed"]["kv_len"]) for a in frozen if a["parsed"]["table"] == name]
            write_table(submission_path, name, new_tables[name], shapes)
            out(f"written into {submission_path} (only {name} between the markers changed)")
    elif changed:
        out("(not written: add --write)")
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# Reports


def _params_text(params):
    return " ".join(f"{k}={v}" for k, v in params.items()) or "-"


def _us(ns):
    return "-" if ns is None or not math.isfinite(ns) else f"{ns / 1e3:.2f}"


def kv_bytes_per_token():
    import eval as runner

    return dict(runner.KV_BYTES_PER_TOKEN)


def floors_ns(batch, kv_len, formats, copy_gbs):
    """KV bytes / measured copy bandwidth per KV format, in ns (GB/s = bytes per ns)."""
    per_token = kv_bytes_per_token()
    if not copy_gbs:
        return {}
    return {f: batch * kv_len * per_token[f] / copy_gbs for f in formats if f in per_token}


def route_format(sub, route):
    return getattr(sub, "ROUTE_INFO", {}).get(route, {}).get("kv_format")


def format_case(case, top=None, floors=None):
    """One case's table: every configuration (eligible first, fastest first), winner marked, then
    the margin lines."""
    records = sorted(case["records"], key=lambda r: (not r["eligible"], _rank_value(r, "mean"),
                                                     r["route"], json.dumps(r["params"])))
    shown = records if top is None else records[:top]
    floor_text = ", ".join(f"{f} floor {_us(v)} us" for f, v in (floors or {}).items())
    lines = [f"== bs={case['batch']} kv={case['kv_len']} | case seed {case['seed']}, "
             f"{len(case['seeds'])} secret-like seeds | {len(records)} configurations, "
             f"{case['eligible_count']} eligible" + (f" | {floor_text}" if floor_text else "")
             + (" | PARTIAL: the sweep stopped inside this shape" if case.get("partial") else "") + " =="]
    header = (f"  {'route':<24} {'params':<60} {'mean us':>9} {'median us':>9} "
              f"{'mism %':>7} {'rel L2':>7} {'bound':>6}  status")
    lines.append(header)
    winner = case["winner"]
    for rec in shown:
        timing = rec.get("timing") or {}
        mark = "*" if rec is winner else " "
        mm = "-" if rec["max_mismatch"] is None else f"{100 * rec['max_mismatch']:.3f}"
        l2 = "-" if rec["max_rel_l2"] is None else f"{rec['max_rel_l2']:.4f}"
        status = "ok" if rec["eligible"] else rec["reason"]
        cached = " (cached)" if rec.get("cached") else ""
        lines.append(f"{mark} {rec['route']:<24} {_params_text(rec['params']):<60} "
                     f"{_us(timing.get('mean_ns')):>9} {_us(timing.get('median_ns')):>9} "
                     f"{mm:>7} {l2:>7} {rec['rel_l2_bound']:>6g}  {_one_line(status, 90)}{cached}")
    if top is not None and len(records) > top:
        lines.append(f"  ... {len(records) - top} more (see --json)")
    lines.extend(margin_lines(case))
    return "\n".join(lines)


def margin_lines(case):
    winner = case["winner"]
    if winner is None:
        return ["  no eligible configuration: this shape cannot be written"]
    w = winner["timing"]
    text = [f"  winner: {winner['route']} {_params_text(winner['params'])}: mean {_us(w['mean_ns'])} us "
            f"(median {_us(w['median_ns'])}, +-{_us(w['err_ns'])} us, {w['runs']} runs)"]
    up = case["runner_up"]
    if up is not None:
        u = up["timing"]
        gap = u["mean_ns"] / w["mean_ns"] - 1
        noise = math.hypot(w["err_ns"], u["err_ns"])
        within = " (within 2 standard errors: a tie)" if u["mean_ns"] - w["mean_ns"] < 2 * noise else ""
        text.append(f"  runner-up: {up['route']} {_params_text(up['params'])}: mean {_us(u['mean_ns'])} "
                    f"us (+{100 * gap:.1f}%){within}")
    others = [r for name, r in case["best_per_route"].items() if name != winner["route"]]
    for other in others:
        gap = other["timing"]["mean_ns"] / w["mean_ns"] - 1
        text.append(f"  best {other['route']}: {_params_text(other['params'])}: mean "
                    f"{_us(other['timing']['mean_ns'])} us (+{100 * gap:.1f}%)")
    limit = case.get("max_mismatch_limit", MAX_MISMATCH)
    mm = winner["max_mismatch"]
    factor = "inf" if mm == 0 else f"{limit / mm:.0f}x"
    text.append(f"  accuracy margin: worst mismatch {100 * mm:.3f}% vs the {100 * limit:g}% limit "
                f"({factor} under it; the runner allows 5%); worst rel L2 {winner['max_rel_l2']:.4f} "
                f"vs bound {winner['rel_l2_bound']:g}")
    return text


def draw_chart(path, result, sub, copy_gbs):
    """Per shape: the best eligible config's mean of each route, the byte floors; log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = result["cases"]
    labels = [f"bs={c['batch']}\nkv={c['kv_len']}" for c in cases]
    x = list(range(len(cases)))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(cases) + 2), 4.8))
    markers = itertools.cycle("os^Dvp*hX")
    plotted = [r for r in result["routes"] if any(r in c["best_per_route"] for c in cases)]
    width = 0.6 / max(1, len(plotted))
    for i, route in enumerate(plotted):  # side by side within each shape
        xs = [xi - 0.3 + width * (i + 0.5) for xi in x]
        ys = [c["best_per_route"][route]["timing"]["mean_ns"] / 1e3 if route in c["best_per_route"]
              else math.nan for c in cases]
        ax.plot(xs, ys, marker=next(markers), linestyle="none", markersize=8,
                label=f"{route} (best eligible config)")
    formats = sorted({route_format(sub, r) for r in result["routes"]} - {None})
    for style, fmt in zip(itertools.cycle(["--", ":", "-."]), formats):
        floors = [floors_ns(c["batch"], c["kv_len"], [fmt], copy_gbs).get(fmt, math.nan) / 1e3
                  for c in cases]
        label = f"{fmt} KV bytes / copy bandwidth ({copy_gbs:.0f} GB/s)" if copy_gbs else fmt
        ax.hlines(floors, [xi - 0.4 for xi in x], [xi + 0.4 for xi in x], colors="black",
                  linestyles=style, linewidth=1.2, label=label)
    label = "winner"
    for i, case in enumerate(cases):
        if case["winner"] is not None:
            j = plotted.index(case["winner"]["route"])
            ax.scatter([x[i] - 0.3 + width * (j + 0.5)], [case["winner"]["timing"]["mean_ns"] / 1e3],
                       s=220, facecolors="none", edgecolors="red", zorder=5, label=label)
            label = None
    ax.set_yscale("log")
    ax.set_xticks(x)
    ax.set_xticklabels(labels)
    ax.set_ylabel("mean time per call (us)")
    title = f"tune.py on {result['device_name']}: best eligible configuration per route"
    if not result["on_gpu"]:
        title += "\n(CPU, Triton interpreter: times mean nothing)"
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _jsonable(result, extra):
    out = dict(result, **extra)
    out["cases"] = []
    for case in result["cases"]:
        c = dict(case)
        c["winner"] = _config_ref(case["winner"])
        c["runner_up"] = _config_ref(case["runner_up"])
        c["best_per_route"] = {k: _config_ref(v) for k, v in case["best_per_route"].items()}
        out["cases"].append(c)
    return out


def _config_ref(rec):
    if rec is None:
        return None
    return {"route": rec["route"], "params": rec["params"], "timing": rec.get("timing"),
            "max_mismatch": rec.get("max_mismatch"), "max_rel_l2": rec.get("max_rel_l2")}


# ---------------------------------------------------------------------------------------------
# Command line


def _parser():
    p = argparse.ArgumentParser(prog="tune.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", nargs="?", default=None,
                   help="spec file (default specs/benchmarks.txt on a GPU, specs/cpu.txt without)")
    p.add_argument("--quick", action="store_true", help="the much smaller QUICK_SEARCH_SPACE")
    p.add_argument("--grid", default=None,
                   help="search space as JSON {route: {param: [values]}} (or @file.json); "
                        "replaces SEARCH_SPACE / QUICK_SEARCH_SPACE")
    p.add_argument("--routes", default=None, help="comma-separated routes to tune (default: all here)")
    p.add_argument("--seeds", type=int, default=DEFAULT_SEEDS,
                   help=f"K secret-like seeds per case (default {DEFAULT_SEEDS})")
    p.add_argument("--seed-rng", type=int, default=DEFAULT_SEED_RNG,
                   help="seed of the draw of the secret b's (default fixed: reruns reuse the cache)")
    p.add_argument("--secret-seeds", default=None, help="comma-separated secret b's (overrides the draw)")
    p.add_argument("--max-mismatch", type=float, default=MAX_MISMATCH,
                   help="eligibility limit on the worst mismatch ratio (default 0.01)")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"timed repeats per configuration (default {GPU_MAX_REPEATS} GPU, {CPU_MAX_REPEATS} CPU)")
    p.add_argument("--max-time-per-config", type=float, default=None,
                   help=f"seconds of measured time per configuration (default {GPU_MAX_TIME_S} GPU)")
    p.add_argument("--time-all", action="store_true", help="also time ineligible configurations")
    p.add_argument("--rank-by", choices=("mean", "median"), default="mean")
    p.add_argument("--cache", default=DEFAULT_CACHE, help=f"JSONL result cache (default {DEFAULT_CACHE})")
    p.add_argument("--no-cache", action="store_true", help="measure everything, write no cache")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop cleanly (between configurations) after this many minutes")
    p.add_argument("--json", default=None, help="write every record, winners and the table here")
    p.add_argument("--chart", default=None, help="write a PNG chart here")
    p.add_argument("--write", action="store_true",
                   help="rewrite the route-table literal of this machine in the submission, in place")
    p.add_argument("--table", default=None, choices=TABLE_NAMES,
                   help="table to write (default: AITER_ROUTE_TABLE when aiter routes were tuned)")
    p.add_argument("--submission", default=os.path.join(HERE, "submission.py"))
    p.add_argument("--device", default=None, help="cpu or cuda (default: the GPU if any)")
    p.add_argument("--l2-flush", default="default", choices=("default", "runner", "none"),
                   help="default: zero 512 MiB (fast; does not hide host time); runner: the runner's "
                        "62.5 GiB randn (15 ms per call; times as the leaderboard sees them)")
    p.add_argument("--top", type=int, default=None, help="print only the N best configurations per case")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--from-log", default=None, metavar="FILE",
                   help="no sweep: freeze the 'submission.py race' lines of FILE ('-': stdin) into fixed "
                        "rows of their tables (printed; written with --write); no GPU needed")
    return p


def _parse_grid(text):
    if text.startswith("@"):
        with open(text[1:], encoding="utf-8") as f:
            text = f.read()
    grid = json.loads(text)
    if not isinstance(grid, dict) or not all(isinstance(v, dict) for v in grid.values()):
        raise TuneError("--grid must be a JSON object {route: {param: [values]}}")
    return grid


def main(argv=None):
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_OK if exc.code == 0 else EXIT_BAD_ARGS
    started = time.time()
    try:
        if args.from_log is not None:
            return from_log(args.from_log, args.submission, write=args.write)
        return _main(args, started)
    except TuneError as exc:
        print(f"tune.py: {exc}", file=sys.stderr)
        return EXIT_BAD_ARGS


def _main(args, started):
    import utils

    utils.prepare_environment()
    import torch

    device = utils.get_device(args.device)
    on_gpu = device.type == "cuda"
    spec = args.spec or os.path.join(HERE, "specs", "benchmarks.txt" if on_gpu else "cpu.txt")
    if not os.path.exists(spec):
        raise TuneError(f"spec file {spec} not found")
    if not os.path.exists(args.submission):
        raise TuneError(f"submission {args.submission} not found")
    if args.seeds < 1:
        raise TuneError("--seeds must be at least 1")
    space = _parse_grid(args.grid) if args.grid else (QUICK_SEARCH_SPACE if args.quick else SEARCH_SPACE)
    secret_bs = ([int(b) for b in args.secret_seeds.split(",") if b.strip()] if args.secret_seeds
                 else draw_secret_seeds(args.seeds, args.seed_rng))
    routes = [r.strip() for r in args.routes.split(",") if r.strip()] if args.routes else None
    shapes = read_shapes(spec)
    sub = load_submission(args.submission)
    cache = ResultCache(None if args.no_cache else args.cache)
    deadline = None if args.max_minutes is None else started + 60 * args.max_minutes

    import triton

    print(f"tune.py {os.path.relpath(spec)} | device: {utils.device_name(device)} | torch "
          f"{torch.__version__} | triton {triton.__version__} | aiter: "
          f"{'yes' if getattr(sub, 'HAVE_AITER', False) else 'no'}")
    print(f"submission: {args.submission} | {len(shapes)} shapes | secret b's {secret_bs} | "
          f"eligible: worst mismatch <= {100 * args.max_mismatch:g}% and rel L2 <= the route's bound")
    if not on_gpu:
        print("NOTE: no GPU here: Triton kernels run in the interpreter and times come from "
              "perf_counter. CPU times mean nothing; only the checks count.")
    elif args.l2_flush != "runner" and args.write:
        print("NOTE: the runner's 62.5 GiB flush hides the host time of a call, this flush does not: "
              "a slow host moment shows in these times (one H200 tune under it picked a route 1.6x "
              "slower under the runner's flush: NOTES.md). For a table to submit, --l2-flush runner.")
    copy_gbs = utils.copy_bandwidth(device)
    print(f"copy bandwidth: {copy_gbs:.0f} GB/s (read + write){' (CPU)' if not on_gpu else ''}")

    result = tune(sub, shapes, space=space, secret_bs=secret_bs, device=device,
                  max_mismatch=args.max_mismatch, max_repeats=args.repeats,
                  max_time_s=args.max_time_per_config, cache=cache, time_all=args.time_all,
                  deadline=deadline, routes=routes, flush_mode=args.l2_flush,
                  progress=not args.no_progress, rank_by=args.rank_by)
    print(f"routes tuned: {', '.join(f'{r} ({n} configs)' for r, n in result['configs_per_route'].items())}")
    formats = sorted({route_format(sub, r) for r in result["routes"]} - {None})
    for case in result["cases"]:
        print()
        print(format_case(case, args.top, floors_ns(case["batch"], case["kv_len"], formats, copy_gbs)))
    print(f"\n{result['measured']} configurations measured, {result['cached']} from the cache"
          f"{'' if args.no_cache else f' ({args.cache})'}")

    table_name = target_table(result["routes"], args.table)
    rows, table_error = None, None
    if not result["complete"]:
        table_error = (f"stopped early ({result['stopped']}): {len(result['cases'])} of "
                       f"{result['cases_planned']} shapes done; rerun the same command to resume")
    else:
        try:
            rows = build_table(sub, result)
        except TuneError as exc:
            table_error = str(exc)
    written = False
    if rows is not None:
        print(f"\n{table_name} from this sweep:")
        print(format_table(table_name, rows))
        if args.write:
            shapes_in_order = [(r["max_batch"], r["max_kv_len"]) for r in rows[:-1]]
            write_table(args.submission, table_name, rows, shapes_in_order)
            written = True
            print(f"written into {args.submission} (only {table_name} between the markers changed)")
        else:
            print("(not written: add --write)")
    else:
        print(f"\nno route table: {table_error}")
        if args.write:
            print("nothing written")

    extra = {"spec": spec, "submission": os.path.abspath(args.submission), "copy_bandwidth_gbs": copy_gbs,
             "cpu_times_meaningless": not on_gpu, "table_name": table_name, "table": rows,
             "table_error": table_error, "written": written,
             "search_space": space, "elapsed_s": time.time() - started}
    if args.json:
        directory = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(directory, exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(_jsonable(result, extra), f, indent=1, default=str)
    if args.chart:
        if not result["cases"]:
            print("no chart: no shape finished")
        else:
            try:
                draw_chart(args.chart, result, sub, copy_gbs)
            except ImportError as exc:  # matplotlib is not everywhere (e.g. the lent H200)
                print(f"no chart: {exc}")
    if not result["complete"]:
        return EXIT_STOPPED
    return EXIT_OK if rows is not None else EXIT_NO_WINNER


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Check and time submission.py exactly as the amd-mixed-mla runner does, on any machine.

Two ways to run it:

1. Runner mode (a drop-in for the leaderboard runner's eval.py), chosen when POPCORN_FD is set:

       POPCORN_FD=3 python eval.py test|benchmark|leaderboard|profile SPECFILE [--submission PATH]
                                   [--l2-flush default|runner|none]

   Results go to file descriptor POPCORN_FD as `key: value` lines. As in the runner, all the cases
   of the mode run in ONE spawned worker process (a 'spawn' Pool(1) created once, every case sent
   with apply): submission.py is imported once there, so its module state and caches live across
   the cases, the benchmark warm-up included. POPCORN_SEED, when set, is combined into each case
   seed. Exit codes: 0 pass, 112 failed check, 2 bad mode/arguments, 111 when runner mode was
   asked for with --popcorn but POPCORN_FD is missing or unusable.

2. Human mode, when POPCORN_FD is unset (and --popcorn not given):

       python eval.py test|benchmark|leaderboard|profile [SPEC] [--submission PATH] [--json PATH]
                      [--strict] [--l2-flush default|runner|none] [--repeats N] [--spawn]
                      [--device cpu|cuda] [--wide] [--cpu-timing] [--compare EARLIER.json]
                      [--chart PATH]

   Prints one table per run, about 110 columns wide (short route labels; --wide shows each
   route's parameters and the best time): route, mean +- err, reference time, speedup, GB/s and
   % of the measured copy bandwidth, mismatch ratio vs the 5% limit, rel. L2 error vs float64
   attention and its share of the route's bound. Then a summary (cases passed, the case closest to its
   bound, elapsed time) and a last line naming the next useful command; a progress bar on stderr
   while the cases run. Without a GPU it uses specs/cpu.txt, says that CPU times mean nothing,
   and benchmark/leaderboard modes only check (timing only with --cpu-timing). --compare reads
   an earlier --json run: per case the ratio of the means and whether the difference lies
   outside both runs' spread. --chart draws the times (matplotlib). Cases run in this process,
   or with --spawn in one spawned worker as in runner mode. Exit codes: 0 all pass, 112 a case
   failed, 2 bad arguments (also --device cuda where torch sees no GPU).

Serving cases. A spec line with any of the fields heads, page, kv, varlen, causal, zeros (e.g.
`batchsize: 128; qseqlen: 2; heads: 128; page: 64; kvseqlen: 4096; varlen: 1; causal: 1; kv: fp8;
seed: 5`) is a serving case of the FlashMLA-shaped API: reference.generate_serving_input makes
its input, the submission's get_mla_decode_metadata() is called once per case and its plan
reused by every mla_decode_with_kvcache call of the case, and the output (out, lse) is always
checked strictly (reference.check_serving's bounds, with or without --strict). Benchmark and
leaderboard modes time it like a leaderboard case (synchronize, flush, events around one call)
on one input (no per-repeat recheck). Human mode prints serving cases in their own table (fields,
times, GB/s of cache bytes read, errors against bounds); JSON rows carry "kind": "serving".
Runner mode takes them too. specs/serving.txt (GPU) and specs/serving_cpu.txt hold such cases.

Sparse cases. A spec line with `sparse: 1` or a `topk` field (e.g. `sparse: 1; batchsize: 64;
qseqlen: 2; heads: 128; page: 64; kvseqlen: 32768; varlen: 1; topk: 2048; seed: 5`) is a case of
the API's sparse form (DeepSeek-V3.2: top-k indices over FlashMLA's 656-byte fp8 cache):
reference.generate_sparse_input makes it, mla_decode_with_kvcache(..., is_fp8_kvcache=True,
indices=..., topk_length=...) runs it (a submission without the sparse form fails the case), and
reference.check_sparse judges it strictly (1.25 x the format's own error against the bf16 values,
bf16 bounds against the dequantised cache), both references computed with the q the submission's
kernel multiplies (its sparse_q_format(q, k_cache): "bf16" or "fp8"; bf16 without one; the table's
q column, the rows' q_format). specs/sparse.txt (GPU) and specs/sparse_cpu.txt.
"""
import argparse
import base64
import dataclasses
import json
import math
import multiprocessing
import os
import statistics
import sys
import textwrap
import time
import traceback

# Project modules (utils, reference) are imported inside the functions: the argument and
# POPCORN_FD errors are answered without importing torch. They resolve because eval.py sits next
# to them (its directory is on sys.path when it runs; spawned workers inherit sys.path).
HERE = os.path.dirname(os.path.abspath(__file__))

MODES = ("test", "benchmark", "leaderboard", "profile")
EXIT_OK = 0
EXIT_BAD_ARGS = 2
EXIT_NO_FD = 111
EXIT_FAIL = 112

# the runner's timing parameters (its stop rule and wall limit are utils.should_stop's)
BENCH_MAX_REPEATS = 1000
BENCH_MAX_TIME_NS = 50e9
LEADERBOARD_MAX_REPEATS = 100
LEADERBOARD_MAX_TIME_NS = 30e9
WARMUP_MAX_REPEATS = 100
WARMUP_MAX_TIME_NS = 1e8
RECHECK_SEED_STEP = 13

# human mode extras
KV_BYTES_PER_TOKEN = {"bf16": 1152, "fp8": 576, "mxfp4": 306}
Q_BYTES_PER_ROW = 16 * 576 * 2  # bf16 q
OUT_BYTES_PER_ROW = 16 * 512 * 2  # bf16 output
DEFAULT_REL_L2_BOUND = 0.05  # strict bound for a route that declares none (fp8 level)
REF_MAX_REPEATS = 100  # timing of ref_kernel in human mode
REF_MAX_TIME_NS = 5e9
CPU_MAX_REPEATS = 10  # human mode on the CPU: times mean nothing, keep it short
CPU_MAX_TIME_NS = 5e9
REPORT_COLUMNS = 110  # the human report's width with short route labels (--wide: no limit)
CPU_NOTE = ("NOTE: no GPU here: cases run on the CPU (Triton interpreter). CPU times mean "
            "nothing; only the checks count.")


# ---------------------------------------------------------------------------------------------
# Loading the submission


def default_submission_path() -> str:
    """submission.py in the working directory when there is one, else next to eval.py."""
    cwd_sub = os.path.abspath("submission.py")
    return cwd_sub if os.path.exists(cwd_sub) else os.path.join(HERE, "submission.py")


_LOADED = {}


def load_submission(path: str, module_name: str = "submission"):
    """Import the submission file at ``path`` as a module named ``module_name``.

    Spawned workers use the name "submission" (as the runner's `from submission import ...`);
    human mode in-process uses a private name so that an already imported `submission` module
    (e.g. in a test session) is left alone."""
    import importlib.util

    import utils

    path = os.path.abspath(path)
    key = (path, module_name)
    if key in _LOADED:
        return _LOADED[key]
    utils.prepare_environment()
    sub_dir = os.path.dirname(path)
    if sub_dir not in sys.path:
        sys.path.append(sub_dir)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load a submission from {path}")
    module = importlib.util.module_from_spec(spec)
    previous = sys.modules.get(module_name)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        if previous is not None:
            sys.modules[module_name] = previous
        else:
            sys.modules.pop(module_name, None)
        raise
    if not (callable(getattr(module, "custom_kernel", None))
            or callable(getattr(module, "mla_decode_with_kvcache", None))):
        raise ImportError(f"{path} defines no custom_kernel(data) (nor the serving API's "
                          "mla_decode_with_kvcache)")
    _LOADED[key] = module
    return module


def route_of(sub):
    """(full route label or None, route name or None, ROUTE_INFO entry or {}) of the route the
    last custom_kernel call ran (``LAST_ROUTE``; the name from ``LAST_CANDIDATE`` when set)."""
    full, _, name, entry = route_labels(sub)
    return full, name, entry


def route_labels(sub):
    """(full label, short label, route name, ROUTE_INFO entry) of the last call's route.

    Full: ``LAST_ROUTE`` as the submission wrote it. Short (the report's default):
    ``route_label(LAST_CANDIDATE, short=True)`` where the submission defines both (e.g.
    ``hopper_fp8 s16``), else the route name, the first word of ``LAST_ROUTE``. All None when the
    submission records no route."""
    last = getattr(sub, "LAST_ROUTE", None)
    candidate = getattr(sub, "LAST_CANDIDATE", None)
    labeller = getattr(sub, "route_label", None)
    name = short = None
    if isinstance(candidate, dict) and candidate.get("route"):
        name = str(candidate["route"])
        if callable(labeller):
            try:
                short = str(labeller(candidate, short=True))
            except Exception:  # a label is a nicety; the report goes on without it
                short = None
    if last is None and name is None:
        return None, None, None, {}
    full = str(last) if last is not None else name
    if name is None:
        words = full.split()
        name = words[0] if words else full
    info = getattr(sub, "ROUTE_INFO", None)
    entry = info.get(name, {}) if isinstance(info, dict) else {}
    return full, short or name, name, entry if isinstance(entry, dict) else {}


def _one_line(text) -> str:
    return " | ".join(line.rstrip() for line in str(text).strip().splitlines()) or "error"


# ---------------------------------------------------------------------------------------------
# The runner's per-case procedures (used by the spawned workers and by human mode)


def _input_args(args: dict, device=None) -> dict:
    args = dict(args)
    if device is not None:
        args["device"] = device
    return args


def run_test_case(sub, args: dict, device=None):
    """generate_input, clone, custom_kernel(clone), synchronize, check against the original.
    Returns (ok, message). A serving case goes to run_serving_test_case."""
    import reference
    import utils

    if is_sparse_case(args):
        return run_sparse_test_case(sub, args, device)
    if is_serving_case(args):
        return run_serving_test_case(sub, args, device)
    data = reference.generate_input(**_input_args(args, device))
    work = reference.clone_data(data)
    output = sub.custom_kernel(work)
    utils.synchronize(data[0].device)
    return reference.check_implementation(data, output)


def run_benchmark_case(sub, args: dict, *, recheck: bool, max_repeats: int, max_time_ns: float,
                       flush_mode: str = "default", device=None, initial_check: bool = True,
                       flusher=None):
    """One correctness check, then timed repeats of ONE custom_kernel(data) call each
    (synchronize + L2 flush before each, utils.time_repeats). With ``recheck`` every repeat uses
    a new input (seed += 13) and is checked. Returns utils.Stats, or an error string. A serving
    case goes to run_serving_benchmark_case (``recheck`` and ``initial_check`` do not apply)."""
    import reference
    import utils

    if is_sparse_case(args):
        return run_sparse_benchmark_case(sub, args, max_repeats=max_repeats, max_time_ns=max_time_ns,
                                         flush_mode=flush_mode, device=device, flusher=flusher)
    if is_serving_case(args):
        return run_serving_benchmark_case(sub, args, max_repeats=max_repeats,
                                          max_time_ns=max_time_ns, flush_mode=flush_mode,
                                          device=device, flusher=flusher)
    args = _input_args(args, device)
    state = {"data": reference.generate_input(**args)}
    dev = state["data"][0].device
    if initial_check:
        check_copy = reference.clone_data(state["data"])
        output = sub.custom_kernel(state["data"])
        utils.synchronize(dev)
        ok, message = reference.check_implementation(check_copy, output)
        if not ok:
            return message
        del output, check_copy
    own_flusher = flusher is None
    if own_flusher:
        flusher = utils.L2Flusher(flush_mode, dev)

    def new_input():
        args["seed"] = int(args["seed"]) + RECHECK_SEED_STEP
        state["data"] = reference.generate_input(**args)
        state["check"] = reference.clone_data(state["data"])

    def check(output):
        # leaderboard mode: the runner flush's 62.5 GiB back to the device (untimed, the GPU idle)
        # before the check and the next input, which then have the whole card; the next flush
        # allocates anew (utils.L2Flusher)
        flusher.release()
        ok, message = reference.check_implementation(state["check"], output)
        return None if ok else message

    try:
        durations, failure = utils.time_repeats(
            lambda: sub.custom_kernel(state["data"]), dev, flusher, max_repeats=max_repeats,
            max_time_ns=max_time_ns, before=new_input if recheck else None,
            after=check if recheck else None)
    finally:
        if own_flusher:
            flusher.release()  # the runner flush's 62.5 GiB back to the device for the next case
    return failure if failure is not None else utils.calculate_stats(durations)


def run_profile_case(sub, args: dict, device=None) -> str:
    """torch.profiler table of one custom_kernel call (after one warm-up call); of one
    mla_decode_with_kvcache call for a serving case."""
    import reference

    if is_sparse_case(args):
        inputs, _, plan, decode = sparse_prepare(sub, args, device, reference_too=False)
        return profile_table(lambda: sparse_call(decode, inputs, plan), inputs.q.device)
    if is_serving_case(args):
        inputs, _, plan = serving_prepare(sub, args, device, reference_too=False)
        return profile_table(lambda: serving_call(sub, inputs, plan), inputs.q.device)
    data = reference.generate_input(**_input_args(args, device))
    return profile_table(lambda: sub.custom_kernel(data), data[0].device)


def profile_table(fn, dev) -> str:
    """torch.profiler table (top 20 by self time) of one ``fn()`` after one warm-up call."""
    import torch
    import utils

    fn()
    utils.synchronize(dev)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        utils.synchronize(dev)
    sort_by = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort_by, row_limit=20)


# ---------------------------------------------------------------------------------------------
# Serving cases: the FlashMLA-shaped API (get_mla_decode_metadata, mla_decode_with_kvcache)

SERVING_FIELDS = ("heads", "page", "kv", "varlen", "causal", "zeros", "long")  # any of them: serving
SERVING_REQUIRED = ("batchsize", "kvseqlen", "seed")
SERVING_DEFAULTS = {"qseqlen": 1, "heads": 16, "page": 64, "varlen": 0, "causal": 0,
                    "kv": "bf16", "zeros": 0, "long": 0}
SERVING_API = ("get_mla_decode_metadata", "mla_decode_with_kvcache")


def is_serving_case(args: dict) -> bool:
    """A spec line with any serving field (heads, page, kv, varlen, causal, zeros, long) is a serving
    case, unless it is a sparse case (is_sparse_case); any other is a leaderboard case."""
    return not is_sparse_case(args) and any(field in args for field in SERVING_FIELDS)


def serving_input_args(args: dict) -> dict:
    """generate_serving_input's arguments of a serving case: batchsize, kvseqlen and seed given;
    qseqlen 1, heads 16, page 64, varlen 0, causal 0, kv bf16, zeros 0, long 0 unless given. A
    ValueError names an unknown, missing or bad field (reference.check_serving_args); no tensor is
    made."""
    import reference

    known = set(SERVING_FIELDS) | set(SERVING_REQUIRED) | set(SERVING_DEFAULTS)
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown field {', '.join(unknown)} in a serving case (its fields: "
                         f"{', '.join(sorted(known))})")
    missing = [field for field in SERVING_REQUIRED if field not in args]
    if missing:
        raise ValueError(f"a serving case needs {', '.join(missing)}")
    return reference.check_serving_args(**{**SERVING_DEFAULTS, **args})


def check_serving_cases(cases) -> None:
    """Refuse a spec file whose serving or sparse lines generate_serving_input /
    generate_sparse_input cannot make (ValueError naming the line and the field), before anything
    runs."""
    for case in cases:
        if is_serving_case(case.args) or is_sparse_case(case.args):
            try:
                (sparse_input_args if is_sparse_case(case.args) else serving_input_args)(case.args)
            except ValueError as exc:
                raise ValueError(f"line {case.spec!r}: {exc}") from None


def serving_api(sub):
    """The submission's (get_mla_decode_metadata, mla_decode_with_kvcache), or an AttributeError
    naming what it lacks."""
    missing = [name for name in SERVING_API if not callable(getattr(sub, name, None))]
    if missing:
        raise AttributeError(f"the submission defines no {' / '.join(missing)} (the serving API)")
    return tuple(getattr(sub, name) for name in SERVING_API)


def serving_call(sub, inputs, plan):
    """One mla_decode_with_kvcache call on ``inputs`` with ``plan``, as an engine makes it (the
    scale, causality and k_scale by keyword); returns what the submission returns."""
    return sub.mla_decode_with_kvcache(
        inputs.q, inputs.k_cache, inputs.block_table, inputs.cache_seqlens, inputs.head_dim_v,
        plan, softmax_scale=inputs.softmax_scale, causal=inputs.causal, k_scale=inputs.k_scale)


def serving_prepare(sub, args: dict, device=None, *, reference_too: bool = True):
    """(inputs, expected, plan) of a serving case: the input made, its float64 reference and
    bounds computed before the submission runs (a kernel that writes into its inputs cannot move
    the truth; None without ``reference_too``), then get_mla_decode_metadata() called once: its
    plan serves every call of the case."""
    import reference

    inputs = reference.generate_serving_input(**serving_input_args(args), device=device)
    expected = reference.serving_expected(inputs) if reference_too else None
    get_metadata, _ = serving_api(sub)
    plan, _ = get_metadata()
    return inputs, expected, plan


def serving_verdict(sub, inputs, expected, plan) -> dict:
    """One call, synchronized, judged by reference.judge_serving (a return value that is not an
    (out, lse) pair fails there: out is judged as the whole value, lse as missing)."""
    import reference
    import utils

    result = serving_call(sub, inputs, plan)
    utils.synchronize(inputs.q.device)
    if isinstance(result, (tuple, list)) and len(result) == 2:
        out, lse = result
    else:
        out, lse = result, None
    return reference.judge_serving(expected, out, lse)


def run_serving_test_case(sub, args: dict, device=None):
    """A serving case checked strictly: (ok, message with the errors and their bounds)."""
    import reference

    inputs, expected, plan = serving_prepare(sub, args, device)
    verdict = serving_verdict(sub, inputs, expected, plan)
    return verdict["ok"], reference.serving_message(verdict)


def time_serving(sub, inputs, plan, flusher, *, max_repeats: int, max_time_ns: float,
                 warm_up: bool = False):
    """Durations (ns) of the runner's timed loop (utils.time_repeats: synchronize, flush, events
    around ONE call each, its stop rule) around mla_decode_with_kvcache with the case's plan."""
    import utils

    durations, _ = utils.time_repeats(lambda: serving_call(sub, inputs, plan), inputs.q.device,
                                      flusher, max_repeats=max_repeats, max_time_ns=max_time_ns,
                                      warm_up=warm_up)
    return durations


def run_serving_benchmark_case(sub, args: dict, *, max_repeats: int, max_time_ns: float,
                               flush_mode: str = "default", device=None, flusher=None):
    """A serving case checked strictly once, then timed on the same input and plan. Returns
    utils.Stats, or the check's message when it fails."""
    import reference
    import utils

    inputs, expected, plan = serving_prepare(sub, args, device)
    verdict = serving_verdict(sub, inputs, expected, plan)
    if not verdict["ok"]:
        return reference.serving_message(verdict)
    del expected
    own_flusher = flusher is None
    if own_flusher:
        flusher = utils.L2Flusher(flush_mode, inputs.q.device)
    try:
        return utils.calculate_stats(time_serving(sub, inputs, plan, flusher, max_repeats=max_repeats,
                                                  max_time_ns=max_time_ns))
    finally:
        if own_flusher:
            flusher.release()


def serving_human_case(sub, args: dict, opts: dict) -> dict:
    """One serving case in human mode: the strict check (always), then in benchmark and
    leaderboard modes the timings (mean, median...) and the bytes of cache the case reads."""
    import reference
    import utils

    row = {"kind": "serving", "case": _label(args), "label": _short_label(args),
           "spec": opts.get("spec", ""), "args": dict(args), "fields": None, "ok": False,
           "loose_ok": None, "problems": [], "message": "", "route": None, "route_short": None,
           "kv_format": None, "rel_l2": None, "rel_l2_bound": None,
           "rel_l2_bound_declared": True, "lse_err": None, "lse_bound": None,
           "lse_fraction": None, "mismatch": None, "stats": None, "ref_stats": None,
           "bytes": None, "tokens": None, "lengths": None}
    try:
        row["fields"] = serving_input_args(args)
        row["kv_format"] = row["fields"]["kv"]
        inputs, expected, plan = serving_prepare(sub, args, opts.get("device"))
        dev = inputs.q.device
        row.update(tokens=inputs.attended_tokens, bytes=inputs.cache_bytes,
                   lengths=list(inputs.lengths))
        verdict = serving_verdict(sub, inputs, expected, plan)
        del expected
        row.update(rel_l2=verdict["out_rel_l2"], rel_l2_bound=verdict["out_bound"],
                   lse_err=verdict["lse_err"], lse_bound=verdict["lse_bound"],
                   lse_fraction=verdict["lse_fraction"], zero_rows=verdict["zero_rows"],
                   fp8_out_reach=verdict["fp8_out_reach"], fp8_lse_reach=verdict["fp8_lse_reach"],
                   message=reference.serving_message(verdict), ok=verdict["ok"])
        row["problems"] += verdict["problems"]
        if opts["mode"] in ("benchmark", "leaderboard") and row["ok"] and opts.get("timed", True):
            flusher = utils.L2Flusher(opts.get("l2_flush", "default"), dev)
            try:
                durations = time_serving(sub, inputs, plan, flusher, max_repeats=opts["max_repeats"],
                                         max_time_ns=opts["max_time_ns"])
            finally:
                flusher.release()  # the runner flush's 62.5 GiB back to the device for the next case
            row["stats"] = dict(dataclasses.asdict(utils.calculate_stats(durations)),
                                median=statistics.median(durations))
            del flusher
        if opts["mode"] == "profile":
            row["report"] = profile_table(lambda: serving_call(sub, inputs, plan), dev)
    except Exception:
        row["ok"] = False
        row["problems"].append("exception: " + traceback.format_exc().strip().splitlines()[-1])
        row["traceback"] = traceback.format_exc()
    return row


# ---------------------------------------------------------------------------------------------
# Sparse cases: the API's sparse form (top-k indices over FlashMLA's 656-byte fp8 cache)

SPARSE_FIELDS = ("sparse", "topk")  # either of them: a sparse case
SPARSE_REQUIRED = ("batchsize", "kvseqlen", "topk", "seed")
SPARSE_DEFAULTS = {"sparse": 1, "qseqlen": 1, "heads": 128, "page": 64, "varlen": 0, "topk_length": 0,
                   "zeros": 0}


def is_sparse_case(args: dict) -> bool:
    """A spec line with `sparse` or `topk` is a sparse case (before any serving field counts)."""
    return any(field in args for field in SPARSE_FIELDS)


def _always_strict(case) -> bool:
    """Serving and sparse cases are checked strictly with or without --strict."""
    return is_serving_case(case.args) or is_sparse_case(case.args)


def sparse_input_args(args: dict) -> dict:
    """generate_sparse_input's arguments of a sparse case: batchsize, kvseqlen, topk and seed
    given; qseqlen 1, heads 128, page 64, varlen 0, topk_length 0, zeros 0 unless given; sparse
    must be 1. A ValueError names an unknown, missing or bad field (reference.check_sparse_args);
    no tensor is made."""
    import reference

    known = set(SPARSE_FIELDS) | set(SPARSE_REQUIRED) | set(SPARSE_DEFAULTS)
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown field {', '.join(unknown)} in a sparse case (its fields: "
                         f"{', '.join(sorted(known))})")
    missing = [field for field in SPARSE_REQUIRED if field not in args]
    if missing:
        raise ValueError(f"a sparse case needs {', '.join(missing)}")
    fields = {**SPARSE_DEFAULTS, **args}
    if fields.pop("sparse") != 1:
        raise ValueError(f"sparse must be 1, got {args['sparse']!r}")
    return reference.check_sparse_args(**fields)


def _takes_indices(fn) -> bool:
    import inspect

    try:
        return "indices" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def sparse_api(sub):
    """(get_mla_decode_metadata, the sparse call in FlashMLA's form, its name): the submission's
    mla_decode_with_kvcache, where it takes ``indices``. An AttributeError names what the
    submission lacks."""
    get_metadata, decode = serving_api(sub)
    if not _takes_indices(decode):
        raise AttributeError("the submission's mla_decode_with_kvcache takes no indices: it has no sparse form")
    return get_metadata, decode, "mla_decode_with_kvcache"


def sparse_call(decode, inputs, plan):
    """One sparse call on ``inputs`` as FlashMLA's callers make it: no block table nor lengths,
    is_fp8_kvcache=True, the indices and topk_length by keyword."""
    return decode(inputs.q, inputs.k_cache, None, None, inputs.head_dim_v, plan,
                  softmax_scale=inputs.softmax_scale, causal=False, is_fp8_kvcache=True,
                  indices=inputs.indices, topk_length=inputs.topk_length)


def sparse_q_format(sub, inputs) -> str:
    """The q the submission's sparse kernel multiplies on ``inputs``: the answer of its
    ``sparse_q_format(q, k_cache)`` ("bf16" or "fp8": the q of the route that would serve those
    tensors), "bf16" where the submission has no such function."""
    ask = getattr(sub, "sparse_q_format", None)
    return "bf16" if ask is None else ask(inputs.q, inputs.k_cache)


def sparse_prepare(sub, args: dict, device=None, *, reference_too: bool = True):
    """(inputs, expected, plan, decode) of a sparse case: the input made, its float64 references
    and bounds (None without ``reference_too``) before anything runs, computed with the q the
    submission's kernel multiplies (``sparse_q_format``), one plan for the case."""
    import reference

    inputs = reference.generate_sparse_input(**sparse_input_args(args), device=device)
    expected = reference.sparse_expected(inputs, sparse_q_format(sub, inputs)) if reference_too else None
    get_metadata, decode, _ = sparse_api(sub)
    plan, _ = get_metadata()
    return inputs, expected, plan, decode


def sparse_verdict(decode, inputs, expected, plan) -> dict:
    """One call, synchronized, judged by reference.judge_sparse."""
    import reference
    import utils

    result = sparse_call(decode, inputs, plan)
    utils.synchronize(inputs.q.device)
    out, lse = result if isinstance(result, (tuple, list)) and len(result) == 2 else (result, None)
    return reference.judge_sparse(expected, out, lse)


def run_sparse_test_case(sub, args: dict, device=None):
    """A sparse case checked strictly: (ok, message with the errors and their bounds)."""
    import reference

    inputs, expected, plan, decode = sparse_prepare(sub, args, device)
    verdict = sparse_verdict(decode, inputs, expected, plan)
    return verdict["ok"], reference.sparse_message(verdict)


def time_sparse(decode, inputs, plan, flusher, *, max_repeats: int, max_time_ns: float):
    """Durations (ns) of the runner's timed loop around one sparse call each."""
    import utils

    durations, _ = utils.time_repeats(lambda: sparse_call(decode, inputs, plan), inputs.q.device, flusher,
                                      max_repeats=max_repeats, max_time_ns=max_time_ns)
    return durations


def run_sparse_benchmark_case(sub, args: dict, *, max_repeats: int, max_time_ns: float,
                              flush_mode: str = "default", device=None, flusher=None):
    """A sparse case checked strictly once, then timed on the same input and plan. Returns
    utils.Stats, or the check's message when it fails."""
    import reference
    import utils

    inputs, expected, plan, decode = sparse_prepare(sub, args, device)
    verdict = sparse_verdict(decode, inputs, expected, plan)
    if not verdict["ok"]:
        return reference.sparse_message(verdict)
    del expected
    if flusher is None:
        flusher = utils.L2Flusher(flush_mode, inputs.q.device)
    return utils.calculate_stats(time_sparse(decode, inputs, plan, flusher, max_repeats=max_repeats,
                                             max_time_ns=max_time_ns))


def sparse_human_case(sub, args: dict, opts: dict) -> dict:
    """One sparse case in human mode: the strict check (always), then in benchmark and
    leaderboard modes the timings and the bytes of cache the case reads (its distinct tokens)."""
    import reference
    import utils

    row = {"kind": "sparse", "case": _label(args), "label": _short_label(args),
           "spec": opts.get("spec", ""), "args": dict(args), "fields": None, "ok": False,
           "loose_ok": None, "problems": [], "message": "", "route": None, "route_short": None,
           "kv_format": "fp8_656", "rel_l2": None, "rel_l2_bound": None,
           "rel_l2_bound_declared": True, "lse_err": None, "lse_bound": None,
           "lse_fraction": None, "mismatch": None, "stats": None, "ref_stats": None,
           "bytes": None, "tokens": None, "lengths": None, "q_format": None}
    try:
        row["fields"] = sparse_input_args(args)
        inputs, expected, plan, decode = sparse_prepare(sub, args, opts.get("device"))
        row["route"] = row["route_short"] = sparse_api(sub)[2]
        dev = inputs.q.device
        row.update(tokens=inputs.selected_tokens, bytes=inputs.cache_bytes, lengths=list(inputs.lengths))
        verdict = sparse_verdict(decode, inputs, expected, plan)
        del expected
        row.update(rel_l2=verdict["out_rel_l2"], rel_l2_bound=verdict["out_bound"],
                   rel_l2_exact=verdict["out_rel_l2_exact"], format_out=verdict["format_out"],
                   lse_err=verdict["lse_err"], lse_bound=verdict["lse_bound"],
                   lse_fraction=verdict["lse_fraction"], zero_rows=verdict["zero_rows"],
                   poisoned_rows=verdict["poisoned_rows"], message=reference.sparse_message(verdict),
                   q_format=verdict["q_format"], ok=verdict["ok"])
        row["problems"] += verdict["problems"]
        if opts["mode"] in ("benchmark", "leaderboard") and row["ok"] and opts.get("timed", True):
            flusher = utils.L2Flusher(opts.get("l2_flush", "default"), dev)
            try:
                durations = time_sparse(decode, inputs, plan, flusher, max_repeats=opts["max_repeats"],
                                        max_time_ns=opts["max_time_ns"])
            finally:
                flusher.release()  # the runner flush's 62.5 GiB back to the device for the next case
            row["stats"] = dict(dataclasses.asdict(utils.calculate_stats(durations)),
                                median=statistics.median(durations))
            del flusher
        if opts["mode"] == "profile":
            row["report"] = profile_table(lambda: sparse_call(decode, inputs, plan), dev)
    except Exception:
        row["ok"] = False
        row["problems"].append("exception: " + traceback.format_exc().strip().splitlines()[-1])
        row["traceback"] = traceback.format_exc()
    return row


# ---------------------------------------------------------------------------------------------
# Where the cases run: one spawned worker per mode (as the runner), or this process


def run_job(sub, job: dict) -> dict:
    """Run one job (one case of a mode, or the benchmark warm-up) with the loaded submission.
    Returns a dict with "ok" and the job's result ("message", "stats", "report" or a human row);
    an exception becomes {"ok": False, "message": its traceback}."""
    try:
        kind = job["kind"]
        if kind == "test":
            ok, message = run_test_case(sub, job["args"])
            return {"ok": ok, "message": message}
        if kind == "benchmark":
            result = run_benchmark_case(
                sub, job["args"], recheck=job["recheck"], max_repeats=job["max_repeats"],
                max_time_ns=job["max_time_ns"], flush_mode=job.get("flush_mode", "default"),
                device=job.get("device"))
            if isinstance(result, str):
                return {"ok": False, "message": result}
            return {"ok": True, "stats": dataclasses.asdict(result)}
        if kind == "profile":
            return {"ok": True, "report": run_profile_case(sub, job["args"])}
        if kind == "human":
            return human_case(sub, job["args"], job["options"])
        return {"ok": False, "message": f"unknown job kind {kind!r}"}
    except Exception:
        return {"ok": False, "message": traceback.format_exc()}


def _worker_entry(job: dict) -> dict:
    """Runs in the spawned worker: the submission is imported as `submission` on the first job
    (load_submission caches it), so every later job of the mode calls the same module."""
    try:
        sub = load_submission(job["submission"], "submission")
    except Exception:
        return {"ok": False, "message": traceback.format_exc()}
    return run_job(sub, job)


class SpawnedWorker:
    """One spawned worker process for all the jobs of a mode, as the runner: a 'spawn' Pool(1)
    created once, every job sent to it in turn. Use as a context manager.

    ``run(job)`` is the runner's pool.apply, with one difference: when the worker process dies
    (a crash in the submission), the runner's pool would start a fresh worker and wait forever
    for the lost job; here the job fails and so does every later one (the mode is over)."""

    POLL_S = 1.0  # how often a waiting run() checks that the worker is alive

    def __init__(self):
        self.pool = multiprocessing.get_context("spawn").Pool(1)
        self.pid = self.pool.apply(os.getpid)  # the one worker, to notice when it dies
        self.died = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        self.close(terminate=exc_type is not None)
        return False

    def _alive(self) -> bool:
        return any(p.pid == self.pid for p in multiprocessing.active_children())

    def run(self, job: dict) -> dict:
        if self.died:
            return {"ok": False, "message": self.died}
        pending = self.pool.apply_async(_worker_entry, (job,))
        while True:
            try:
                return pending.get(timeout=self.POLL_S)
            except multiprocessing.TimeoutError:
                if not self._alive():
                    self.died = (f"the worker process (pid {self.pid}) died during a case (e.g. a "
                                 "crash in the submission); no later case ran")
                    return {"ok": False, "message": self.died}
            except Exception as exc:  # e.g. a result that cannot be sent back
                return {"ok": False, "message": f"worker failed: {exc!r}"}

    def close(self, terminate: bool = False) -> None:
        """Let the worker exit (terminate it when it died: the pool still waits for the lost
        job, and close() would wait forever)."""
        if terminate or self.died:
            self.pool.terminate()
        else:
            self.pool.close()
        self.pool.join()


class InProcess:
    """The same interface as SpawnedWorker for a submission loaded in this process."""

    def __init__(self, sub):
        self.sub = sub

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def run(self, job: dict) -> dict:
        return run_job(self.sub, job)


def warmup_job(submission: str, args: dict, *, max_repeats: int = WARMUP_MAX_REPEATS,
               flush_mode: str = "default", device=None) -> dict:
    """The runner's benchmark warm-up: timed repeats of the first case, not reported."""
    return {"kind": "benchmark", "submission": submission, "args": args, "recheck": False,
            "max_repeats": max_repeats, "max_time_ns": WARMUP_MAX_TIME_NS,
            "flush_mode": flush_mode, "device": device}


# ---------------------------------------------------------------------------------------------
# Runner mode (POPCORN_FD)


class PopcornLog:
    """`key: value` lines on the runner's file descriptor."""

    def __init__(self, fd: int):
        self.file = os.fdopen(fd, "w", closefd=False)

    def log(self, key: str, value) -> None:
        print(f"{key}: {_one_line(value) if isinstance(value, str) else value}", file=self.file,
              flush=True)

    def close(self) -> None:
        self.file.flush()


def _log_failure(log, prefix: str, res: dict) -> None:
    log.log(f"{prefix}.status", "fail")
    log.log(f"{prefix}.error", res.get("message", "failed"))


def popcorn_test(worker, cases, submission: str, log) -> bool:
    """mode test: every case checked; returns whether all passed."""
    passed = True
    log.log("test-count", len(cases))
    for i, case in enumerate(cases):
        log.log(f"test.{i}.spec", case.spec)
        res = worker.run({"kind": "test", "submission": submission, "args": case.args})
        if res.get("ok"):
            log.log(f"test.{i}.status", "pass")
            if res.get("message"):
                log.log(f"test.{i}.message", res["message"])
        else:
            passed = False
            _log_failure(log, f"test.{i}", res)
    return passed


def popcorn_benchmark(worker, cases, submission: str, log, *, recheck: bool,
                      flush_mode: str) -> bool:
    """modes benchmark and leaderboard (``recheck``): a warm-up on the first case, then every
    case checked and timed; leaderboard stops at the first failing case."""
    if cases:  # warm-up, not reported
        worker.run(warmup_job(submission, cases[0].args, flush_mode=flush_mode))
    passed = True
    log.log("benchmark-count", len(cases))
    for i, case in enumerate(cases):
        log.log(f"benchmark.{i}.spec", case.spec)
        res = worker.run({
            "kind": "benchmark", "submission": submission, "args": case.args, "recheck": recheck,
            "max_repeats": LEADERBOARD_MAX_REPEATS if recheck else BENCH_MAX_REPEATS,
            "max_time_ns": LEADERBOARD_MAX_TIME_NS if recheck else BENCH_MAX_TIME_NS,
            "flush_mode": flush_mode})
        if res.get("ok"):
            for field in ("runs", "mean", "std", "err", "best", "worst"):
                log.log(f"benchmark.{i}.{field}", res["stats"][field])
        else:
            passed = False
            _log_failure(log, f"benchmark.{i}", res)
            if recheck:
                break  # leaderboard: the first failing case stops the run
    return passed


def popcorn_profile(worker, cases, submission: str, log) -> bool:
    """mode profile: a base64 torch.profiler table per case."""
    passed = True
    log.log("benchmark-count", len(cases))
    for i, case in enumerate(cases):
        log.log(f"benchmark.{i}.spec", case.spec)
        res = worker.run({"kind": "profile", "submission": submission, "args": case.args})
        if res.get("ok"):
            report = base64.b64encode(res["report"].encode("utf-8")).decode("ascii")
            log.log(f"benchmark.{i}.report", report)
        else:
            passed = False
            _log_failure(log, f"benchmark.{i}", res)
    return passed


def popcorn_main(mode: str, spec_path: str, submission: str, fd: int, flush_mode: str = "default") -> int:
    """The runner's modes on its file descriptor, all cases of the mode in one SpawnedWorker.
    flush_mode (--l2-flush): "runner" is the runner's own 62.5 GiB randn, which hides any host
    path under ~15 ms; "default" (512 MiB zeroed, about 0.1 ms) is faster and stricter: a host
    path slower than the flush shows in the times."""
    import utils

    try:
        cases = utils.read_spec_file(spec_path, utils.secret_seed_from_env())
        check_serving_cases(cases)
    except (OSError, ValueError) as exc:
        print(f"eval.py: cannot read spec file {spec_path}: {exc}", file=sys.stderr)
        return EXIT_BAD_ARGS
    log = PopcornLog(fd)
    with SpawnedWorker() as worker:
        if mode == "test":
            passed = popcorn_test(worker, cases, submission, log)
        elif mode in ("benchmark", "leaderboard"):
            passed = popcorn_benchmark(worker, cases, submission, log,
                                       recheck=mode == "leaderboard", flush_mode=flush_mode)
        else:
            passed = popcorn_profile(worker, cases, submission, log)
    log.log("check", "pass" if passed else "fail")
    log.close()
    return EXIT_OK if passed else EXIT_FAIL


# ---------------------------------------------------------------------------------------------
# Human mode


def _kv_text(args: dict) -> str:
    if args.get("kv_lens") is not None:
        return ",".join(str(n) for n in args["kv_lens"])
    return str(args.get("kvseqlen"))


def _serving_fields(args: dict) -> dict:
    """A serving case's fields with the defaults filled in, unchecked (for names only)."""
    return {**SERVING_DEFAULTS, **args}


def _label(args: dict) -> str:
    """The case's name in the JSON and in FAIL lines: shape and seed (a serving case: all its
    fields)."""
    if is_sparse_case(args):
        f = {**SPARSE_DEFAULTS, **args}
        return (f"sparse b={f.get('batchsize')} s_q={f['qseqlen']} h_q={f['heads']} page={f['page']} "
                f"s_k={f.get('kvseqlen')}" + (" varlen" if f["varlen"] else "") + f" topk={f.get('topk')}"
                + (" topk_length" if f["topk_length"] else "") + (f" zeros={f['zeros']}" if f["zeros"] else "")
                + f" seed={f.get('seed')}")
    if is_serving_case(args):
        f = _serving_fields(args)
        return (f"b={f.get('batchsize')} s_q={f['qseqlen']} h_q={f['heads']} page={f['page']} "
                f"s_k={f.get('kvseqlen')}" + (" varlen" if f["varlen"] else "")
                + (" causal" if f["causal"] else "") + f" {f['kv']}"
                + (f" zeros={f['zeros']}" if f["zeros"] else "") + (f" long={f['long']}" if f["long"] else "")
                + f" seed={f.get('seed')}")
    parts = [f"bs={args.get('batchsize')} kv={_kv_text(args)}"]
    if args.get("qseqlen", 1) != 1:
        parts.append(f"q={args.get('qseqlen')}")
    if "seed" in args:
        parts.append(f"seed={args['seed']}")
    return " ".join(parts)


SHORT_LABEL_CHARS = 22


def _short_label(args: dict) -> str:
    """The case's name in the table: its shape, at most SHORT_LABEL_CHARS characters (a long list
    of ragged lengths is cut, with its count). A serving case: its fields, compact (b128 q2 h128
    p64 k4096 var causal fp8 z2; a sparse case: b128 q2 h128 p64 k32768 var t2048 len z2), for the
    progress bar, the compare table and the chart."""
    if is_sparse_case(args):
        f = {**SPARSE_DEFAULTS, **args}
        return (f"b{f.get('batchsize')} q{f['qseqlen']} h{f['heads']} p{f['page']} k{f.get('kvseqlen')}"
                + (" var" if f["varlen"] else "") + f" t{f.get('topk')}" + (" len" if f["topk_length"] else "")
                + (f" z{f['zeros']}" if f["zeros"] else ""))
    if is_serving_case(args):
        f = _serving_fields(args)
        return (f"b{f.get('batchsize')} q{f['qseqlen']} h{f['heads']} p{f['page']} "
                f"k{f.get('kvseqlen')}" + (" var" if f["varlen"] else "")
                + (" causal" if f["causal"] else "") + f" {f['kv']}"
                + (f" z{f['zeros']}" if f["zeros"] else "") + (f" L{f['long']}" if f["long"] else ""))
    kv = _kv_text(args)
    text = f"bs={args.get('batchsize')} kv={kv}"
    if args.get("qseqlen", 1) != 1:
        text += f" q={args.get('qseqlen')}"
    if len(text) > SHORT_LABEL_CHARS and args.get("kv_lens") is not None:
        tail = f"..({len(args['kv_lens'])})"
        keep = SHORT_LABEL_CHARS - len(text) + len(kv) - len(tail)
        text = text.replace(kv, kv[:max(keep, 1)].rstrip(",") + tail)
    return text


def _shape_key(args: dict) -> tuple:
    """What identifies a case across runs: its shape, not its seed (a secret seed changes it); a
    serving or sparse case's shape is all its fields but the seed."""
    if is_sparse_case(args):
        return ("sparse",) + tuple(sorted((k, str(v)) for k, v in {**SPARSE_DEFAULTS, **args}.items()
                                          if k != "seed"))
    if is_serving_case(args):
        return ("serving",) + tuple(sorted((k, str(v)) for k, v in _serving_fields(args).items()
                                           if k != "seed"))
    lens = args.get("kv_lens")
    return (args.get("batchsize"), args.get("qseqlen", 1),
            tuple(lens) if lens is not None else args.get("kvseqlen"))


def case_bytes(data, kv_format):
    """Bytes a route reads and writes: KV in its format, bf16 q, bf16 output (None if unknown)."""
    per_token = KV_BYTES_PER_TOKEN.get(kv_format)
    if per_token is None:
        return None
    q, kv_data = data[0], data[1]
    total_kv = kv_data["bf16"].shape[0]
    return total_kv * per_token + q.shape[0] * (Q_BYTES_PER_ROW + OUT_BYTES_PER_ROW)


def _storages(obj, acc=None):
    import torch

    acc = [] if acc is None else acc
    if isinstance(obj, torch.Tensor):
        acc.append(obj.untyped_storage().data_ptr())
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _storages(x, acc)
    elif isinstance(obj, dict):
        for x in obj.values():
            _storages(x, acc)
    return acc


def strict_problems(output, data, second_output=None):
    """What a strict run objects to in an output besides accuracy: type, shape, dtype, device,
    non-finite values, aliasing an input, or the same storage returned by two calls."""
    import torch

    q = data[0]
    want = (q.shape[0], 16, 512)
    if not isinstance(output, torch.Tensor):
        return [f"output is {type(output).__name__}, not a Tensor"]
    problems = []
    if tuple(output.shape) != want:
        problems.append(f"shape {tuple(output.shape)} != {want}")
    if output.dtype != torch.bfloat16:
        problems.append(f"dtype {output.dtype} != torch.bfloat16")
    if output.device != q.device:
        problems.append(f"device {output.device} != {q.device}")
    if output.numel() and not bool(torch.isfinite(output.float()).all()):
        problems.append("output has NaN/inf")
    if output.numel() and output.untyped_storage().data_ptr() in set(_storages(data)):
        problems.append("output aliases an input tensor")
    if (isinstance(second_output, torch.Tensor) and output.numel()
            and second_output.untyped_storage().data_ptr() == output.untyped_storage().data_ptr()):
        problems.append("two calls returned the same storage (output is not a fresh tensor)")
    return problems


def _time_fn(fn, dev, flusher, max_repeats, max_time_ns):
    """Stats of ``fn`` timed as the runner times custom_kernel, after one warm-up call."""
    import utils

    durations, _ = utils.time_repeats(fn, dev, flusher, max_repeats=max_repeats,
                                      max_time_ns=max_time_ns, warm_up=True)
    return utils.calculate_stats(durations)


def human_case(sub, args: dict, opts: dict) -> dict:
    """One case in human mode: the runner's verdict plus strict checks, timings, bandwidth. A
    serving case goes to serving_human_case, a sparse case to sparse_human_case."""
    import reference
    import utils

    if is_sparse_case(args):
        return sparse_human_case(sub, args, opts)
    if is_serving_case(args):
        return serving_human_case(sub, args, opts)
    mode = opts["mode"]
    row = {"case": _label(args), "label": _short_label(args), "spec": opts.get("spec", ""),
           "args": dict(args), "ok": True, "loose_ok": None, "problems": [], "message": "",
           "route": None, "route_short": None, "kv_format": None,
           "rel_l2": None, "rel_l2_bound": None, "mismatch": None, "stats": None,
           "ref_stats": None, "bytes": None}
    try:
        data = reference.generate_input(**_input_args(args, opts.get("device")))
        dev = data[0].device
        check_copy = reference.clone_data(data)
        work = reference.clone_data(data)
        output = sub.custom_kernel(work)
        utils.synchronize(dev)
        row["route"], row["route_short"], _, info = route_labels(sub)
        row["kv_format"] = info.get("kv_format")
        expected = reference.ref_kernel(check_copy)
        ok, message = reference.compare_outputs(output, expected)
        row["loose_ok"], row["message"] = ok, message
        if not ok:
            row["problems"].append("check failed")
        valid = (hasattr(output, "shape") and tuple(output.shape) == tuple(expected.shape))
        if valid:
            row["mismatch"] = reference.mismatch_ratio(output, expected)
            row["rel_l2"] = reference.rel_l2_error(output, reference.attention_float64(check_copy))
        bound = info.get("rel_l2_bound")
        row["rel_l2_bound"] = float(bound) if bound is not None else DEFAULT_REL_L2_BOUND
        row["rel_l2_bound_declared"] = bound is not None
        if opts.get("strict"):
            second = sub.custom_kernel(reference.clone_data(data))
            utils.synchronize(dev)
            row["problems"] += strict_problems(output, check_copy, second)
            del second
            rel = row["rel_l2"]
            if rel is not None and not (rel <= row["rel_l2_bound"]):
                row["problems"].append(
                    f"strict: rel L2 {rel:.4f} > bound {row['rel_l2_bound']:.4f}"
                    + ("" if row["rel_l2_bound_declared"] else " (default; route declares none)"))
        row["ok"] = not row["problems"]
        del output, work, expected
        if mode in ("benchmark", "leaderboard") and row["ok"] and opts.get("timed", True):
            flusher = utils.L2Flusher(opts.get("l2_flush", "default"), dev)
            try:
                result = run_benchmark_case(
                    sub, args, recheck=(mode == "leaderboard"), max_repeats=opts["max_repeats"],
                    max_time_ns=opts["max_time_ns"], flush_mode=opts.get("l2_flush", "default"),
                    device=opts.get("device"), initial_check=False, flusher=flusher)
                if isinstance(result, str):
                    row["ok"] = False
                    row["problems"].append("recheck failed: " + result)
                else:
                    row["stats"] = dataclasses.asdict(result)
                row["ref_stats"] = dataclasses.asdict(_time_fn(
                    lambda: reference.ref_kernel(data), dev, flusher, opts["ref_max_repeats"],
                    opts["ref_max_time_ns"]))
            finally:
                flusher.release()  # the runner flush's 62.5 GiB back to the device for the next case
            row["bytes"] = case_bytes(data, row["kv_format"])
            del flusher
        if mode == "profile":
            row["report"] = run_profile_case(sub, args, opts.get("device"))
    except Exception:
        row["ok"] = False
        row["problems"].append("exception: " + traceback.format_exc().strip().splitlines()[-1])
        row["traceback"] = traceback.format_exc()
    return row


def _fmt_us(ns):
    return "-" if ns is None else f"{ns / 1e3:.1f}"


def fraction_of_bound(row):
    """A case's rel. L2 error as a fraction of its bound (1.0 = at the bound), or None."""
    rel, bound = row.get("rel_l2"), row.get("rel_l2_bound")
    if rel is None or not bound:
        return None
    return float(rel) / float(bound)


def _rel_text(r) -> str:
    if r.get("rel_l2") is None:
        return "-"
    text = f"{r['rel_l2']:.4f}"
    frac = fraction_of_bound(r)
    if frac is not None:
        text += f" {100 * frac:.0f}%" + ("" if r.get("rel_l2_bound_declared") else "*")
    return text


def _mismatch_text(r) -> str:
    return "-" if r.get("mismatch") is None else f"{100 * r['mismatch']:.2f}%"



def _aligned(head, lines):
    """A text table: the header, a rule, then the lines, each column as wide as its widest cell."""
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines, strict=True)]
    return (["  ".join(str(x).ljust(w) for x, w in zip(head, widths, strict=True)).rstrip(),
             "  ".join("-" * w for w in widths)]
            + ["  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)).rstrip() for line in lines])


def _gbs_text(r, st, copy_bw):
    """GB/s of a timed row's bytes at its mean time ("-" without either), and the share of the
    device's copy bandwidth when known."""
    if not (st and r.get("bytes") and st["mean"] > 0):
        return "-"
    g = r["bytes"] / st["mean"]
    text = f"{g:.0f}" if g >= 10 else f"{g:.2f}"
    return text + (f" {100 * g / copy_bw:.0f}%" if copy_bw else "")


def format_table(rows, mode: str, copy_bw=None, *, wide: bool = False, timed: bool = True) -> str:
    """The human-mode table as text: at most about 115 columns with short route labels; ``wide``
    adds the routes' full labels (parameters) and the best times. ``timed``: benchmark columns (benchmark and
    leaderboard modes that timed their cases)."""
    timed = timed and mode in ("benchmark", "leaderboard")
    if timed:
        head = ["case", "route", "ok", "mean+-err us", "best", "ref us", "speedup",
                "GB/s %copy", "mismatch", "relL2 %bound"]
        if not wide:  # the best time stays in the JSON
            head.remove("best")
    else:
        head = ["case", "route", "ok", "mismatch", "relL2 %bound"]
    lines = []
    for r in rows:
        status = "pass" if r["ok"] else "FAIL"
        route = (r.get("route") if wide else r.get("route_short") or r.get("route")) or "-"
        label = r.get("label") or r["case"]
        if timed:
            st, ref = r.get("stats"), r.get("ref_stats")
            mean = f"{st['mean'] / 1e3:.1f}+-{st['err'] / 1e3:.1f}" if st else "-"
            best = _fmt_us(st["best"]) if st else "-"
            ref_us = _fmt_us(ref["mean"]) if ref else "-"
            speed = f"{ref['mean'] / st['mean']:.2f}x" if st and ref and st["mean"] > 0 else "-"
            lines.append([label, route, status, mean] + ([best] if wide else [])
                         + [ref_us, speed, _gbs_text(r, st, copy_bw), _mismatch_text(r), _rel_text(r)])
        else:
            lines.append([label, route, status, _mismatch_text(r), _rel_text(r)])
    out = _aligned(head, lines)
    _legend_and_failures(
        out, rows, "mismatch: share of elements outside the runner's tolerance (it fails above 5%); "
        "relL2: error against float64 attention, %bound: as a share of the route's bound",
        timed and "times in us: mean +- standard error of the timed calls (--wide: and the best); ref: "
        "reference.ref_kernel timed the same way; GB/s: the bytes the route reads and writes "
        "over the mean, %copy: as a share of the measured copy bandwidth",
        lambda r: r.get("message") if "check failed" in r["problems"] else None)
    if any(r.get("rel_l2_bound") is not None and not r.get("rel_l2_bound_declared")
           for r in rows):
        out.append(f"* route declares no rel_l2_bound in ROUTE_INFO: default "
                   f"{DEFAULT_REL_L2_BOUND} used")
    return "\n".join(out)


def _serving_error_text(value, bound, fraction, spec: str) -> str:
    """An error and its share of its bound ("0.0017 17%"), or "-" when not measured."""
    if value is None:
        return "-"
    text = format(value, spec)
    if fraction is not None and math.isfinite(fraction):
        text += f" {100 * fraction:.0f}%"
    return text


def format_serving_table(rows, mode: str, copy_bw=None, *, wide: bool = False,
                         timed: bool = True) -> str:
    """The serving cases' table: each case's fields (b, s_q, h_q, page, s_k, varlen, causal, kv,
    zeros), pass/FAIL, in timed modes the mean +- standard error (``wide``: and the median) and
    the GB/s of cache bytes read, then out's rel. L2 and lse's max error with their share of
    the bound (``wide``: the bounds themselves); the FAIL lines after it."""
    timed = timed and mode in ("benchmark", "leaderboard")
    head = ["b", "s_q", "h_q", "page", "s_k", "var", "causal", "kv", "zeros", "ok"]
    if timed:
        head += ["mean+-err us"] + (["median"] if wide else []) + ["GB/s %copy"]
    head += ["out relL2 %bound"] + (["out bound"] if wide else [])
    head += ["lse err %bound"] + (["lse bound"] if wide else [])
    lines = []
    for r in rows:
        f = r.get("fields") or _serving_fields(r.get("args") or {})
        line = [f.get("batchsize"), f.get("qseqlen"), f.get("heads"), f.get("page"),
                f.get("kvseqlen"), int(bool(f.get("varlen"))), int(bool(f.get("causal"))),
                f.get("kv"), f.get("zeros"), "pass" if r["ok"] else "FAIL"]
        if timed:
            st = r.get("stats")
            line.append(f"{st['mean'] / 1e3:.1f}+-{st['err'] / 1e3:.1f}" if st else "-")
            if wide:
                line.append(f"{st['median'] / 1e3:.1f}" if st and "median" in st else "-")
            line.append(_gbs_text(r, st, copy_bw))
        line.append(_serving_error_text(r.get("rel_l2"), r.get("rel_l2_bound"),
                                        fraction_of_bound(r), ".4f"))
        if wide:
            line.append("-" if r.get("rel_l2_bound") is None else f"{r['rel_l2_bound']:.4f}")
        line.append(_serving_error_text(r.get("lse_err"), r.get("lse_bound"),
                                        r.get("lse_fraction"), ".1e"))
        if wide:
            line.append("-" if r.get("lse_bound") is None else f"{r['lse_bound']:.1e}")
        lines.append([str(x) for x in line])
    out = ["serving cases (mla_decode_with_kvcache):"] + _aligned(head, lines)
    _legend_and_failures(
        out, rows, "out relL2: out's error against float64 attention over the rows that attend tokens; "
        "lse err: the largest |lse error| there; %bound: as a share of the bound "
        "(reference.check_serving: bf16 cache 1% and 1e-3 + 1e-4 |lse|, fp8 cache 1.25 x "
        "what fp8 rounding of q alone costs + 0.02 and + 0.01); rows that attend nothing "
        "must be exactly 0 with lse +inf",
        timed and "times in us: mean +- standard error of the timed calls (--wide: and the median), "
        "one plan per case; GB/s: cache bytes read (1152 per token bf16, 576 fp8, over every "
        "request's tokens) over the mean, %copy: as a share of the measured copy bandwidth")
    return "\n".join(out)


def format_sparse_table(rows, mode: str, copy_bw=None, *, wide: bool = False, timed: bool = True) -> str:
    """The sparse cases' table: each case's fields (b, s_q, h_q, page, s_k, varlen, topk,
    topk_length, zeros), pass/FAIL, the q the references multiply (bf16 or fp8), in timed modes
    the mean +- standard error and the GB/s of the distinct tokens' bytes, then out's rel. L2
    against the bf16 values with its share of the bound (1.25 x the format's own error, ``wide``:
    both), against the dequantised cache, and lse's max error; the FAIL lines after it."""
    timed = timed and mode in ("benchmark", "leaderboard")
    head = ["b", "s_q", "h_q", "page", "s_k", "var", "topk", "len", "zeros", "ok", "q"]
    if timed:
        head += ["mean+-err us"] + (["median"] if wide else []) + ["GB/s %copy"]
    head += ["out relL2 %bound"] + (["format", "bound"] if wide else []) + ["vs fp8 cache", "lse err %bound"]
    lines = []
    for r in rows:
        f = r.get("fields") or {**SPARSE_DEFAULTS, **(r.get("args") or {})}
        line = [f.get("batchsize"), f.get("qseqlen"), f.get("heads"), f.get("page"), f.get("kvseqlen"),
                int(bool(f.get("varlen"))), f.get("topk"), int(bool(f.get("topk_length"))), f.get("zeros"),
                "pass" if r["ok"] else "FAIL", r.get("q_format") or "-"]
        if timed:
            st = r.get("stats")
            line.append(f"{st['mean'] / 1e3:.1f}+-{st['err'] / 1e3:.1f}" if st else "-")
            if wide:
                line.append(f"{st['median'] / 1e3:.1f}" if st and "median" in st else "-")
            line.append(_gbs_text(r, st, copy_bw))
        line.append(_serving_error_text(r.get("rel_l2"), r.get("rel_l2_bound"), fraction_of_bound(r), ".4f"))
        if wide:
            line += ["-" if r.get("format_out") is None else f"{r['format_out']:.4f}",
                     "-" if r.get("rel_l2_bound") is None else f"{r['rel_l2_bound']:.4f}"]
        line.append("-" if r.get("rel_l2_exact") is None else f"{r['rel_l2_exact']:.4f}")
        line.append(_serving_error_text(r.get("lse_err"), r.get("lse_bound"), r.get("lse_fraction"), ".1e"))
        lines.append([str(x) for x in line])
    route = next((r["route"] for r in rows if r.get("route")), None)
    out = [f"sparse cases ({route or 'mla_decode_with_kvcache with indices'}):"] + _aligned(head, lines)
    _legend_and_failures(
        out, rows, "q: the q both float64 references multiply, as the kernel does (the submission's "
        "sparse_q_format: bf16 as given, or fp8 with one power-of-two scale a head); "
        "out relL2: out's error against float64 attention over the bf16 values the cache was "
        "quantised from, on the rows that attend tokens, %bound its share of 1.25 x the 656-byte format's "
        "own error there; vs fp8 cache: against float64 attention over the dequantised cache (bound 1%); "
        "lse err: the largest |lse error| against the bf16 values, %bound the larger share of its bound and "
        "of 1e-3 + 1e-4 |lse| against the dequantised cache; rows that attend nothing must be exactly 0 "
        "with lse +inf, poisoned queries NaN",
        timed and "times in us: mean +- standard error of the timed calls, one plan per case; GB/s: "
        "656 bytes per distinct token the queries select (FlashMLA's count) over the mean, %copy: as a "
        "share of the measured copy bandwidth")
    return "\n".join(out)


def _legend_and_failures(out, rows, legend: str, times, detail=None) -> None:
    """Append to a table's lines its legend, the legend of its times (``times``: text, or a
    falsy value where the table has none) and a FAIL line per failing row (with
    ``detail(row)``'s text under it where that gives one)."""
    out.extend(textwrap.wrap(legend, REPORT_COLUMNS))
    if times:
        out.extend(textwrap.wrap(times, REPORT_COLUMNS))
    for r in rows:
        if r["problems"]:
            out.append(f"FAIL {r['case']}: " + "; ".join(r["problems"]))
            text = detail(r) if detail else None
            if text:
                out.append(f"     {text}")


def summarise(rows, total: int, elapsed_s: float) -> dict:
    """Cases passed out of ``total``, the case closest to its accuracy bound, elapsed time."""
    passed = sum(1 for r in rows if r["ok"])
    worst = None
    for r in rows:
        frac = fraction_of_bound(r)
        if frac is not None and (worst is None or frac > fraction_of_bound(worst)):
            worst = r
    out = {"cases": total, "passed": passed, "ran": len(rows), "elapsed_s": elapsed_s,
           "worst_case": None, "worst_fraction_of_bound": None}
    if worst is not None:
        out["worst_case"] = worst["case"]
        out["worst_fraction_of_bound"] = fraction_of_bound(worst)
        out["worst_rel_l2"] = worst["rel_l2"]
        out["worst_rel_l2_bound"] = worst["rel_l2_bound"]
    return out


def format_summary(summary: dict, verdict: str) -> str:
    """The closing lines: ``check: pass|fail``, cases passed out of all, the elapsed time; then
    the case closest to its accuracy bound and the headroom left to that bound."""
    text = f"check: {verdict}: {summary['passed']} of {summary['cases']} cases passed"
    if summary["ran"] < summary["cases"]:
        text += f" ({summary['cases'] - summary['ran']} not run)"
    lines = [text + f" in {summary['elapsed_s']:.1f} s"]
    frac = summary.get("worst_fraction_of_bound")
    if frac is not None:
        left = (f"headroom {100 * (1 - frac):.0f}%" if frac <= 1
                else f"over the bound by {100 * (frac - 1):.0f}%")
        lines.append(f"closest to its bound: {summary['worst_case']}: rel. L2 "
                     f"{summary['worst_rel_l2']:.4f} = {100 * frac:.0f}% of "
                     f"{summary['worst_rel_l2_bound']:.3g} ({left})")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Comparing with an earlier run, and the chart


def read_earlier(path: str) -> dict:
    """An earlier ``--json`` file of a timed run; ValueError with a readable reason otherwise."""
    try:
        with open(path) as f:
            earlier = json.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(earlier, dict) or not isinstance(earlier.get("cases"), list):
        raise ValueError(f"{path} is not an eval.py --json file (no 'cases' list)")
    if not any(isinstance(r, dict) and r.get("stats") for r in earlier["cases"]):
        raise ValueError(f"{path} holds no timings (a test-mode run, or an untimed CPU run)")
    return earlier


def compare_rows(rows, earlier: dict) -> list:
    """Per case of this run: its mean over the earlier run's mean of the same shape, and whether
    the two means lie outside both runs' own spread: the difference exceeds each run's standard
    deviation of single calls (a difference inside either run's spread is not told apart from
    noise)."""
    before = {}
    for r in earlier["cases"]:
        if isinstance(r, dict) and r.get("stats") and isinstance(r.get("args"), dict):
            before.setdefault(_shape_key(r["args"]), r)
    out = []
    for r in rows:
        st = r.get("stats")
        old = before.get(_shape_key(r.get("args") or {}))
        entry = {"case": r["case"], "label": r.get("label") or r["case"], "now": st,
                 "before": old["stats"] if old else None, "ratio": None, "verdict": "no earlier case"}
        if st and old:
            ost = old["stats"]
            entry["ratio"] = st["mean"] / ost["mean"] if ost["mean"] > 0 else None
            diff = abs(st["mean"] - ost["mean"])
            outside = diff > st["std"] and diff > ost["std"]
            entry["outside_spread"] = outside
            if not outside:
                entry["verdict"] = "within the spread"
            else:
                entry["verdict"] = "faster" if st["mean"] < ost["mean"] else "slower"
        elif not st:
            entry["verdict"] = "not timed now"
        out.append(entry)
    return out


def format_compare(entries, earlier: dict, path: str) -> str:
    head = ["case", "now us", "before us", "now/before", "outside both spreads?"]
    lines = []
    for e in entries:
        now, old = e["now"], e["before"]
        lines.append([e["label"],
                      f"{now['mean'] / 1e3:.1f}+-{now['std'] / 1e3:.1f}" if now else "-",
                      f"{old['mean'] / 1e3:.1f}+-{old['std'] / 1e3:.1f}" if old else "-",
                      f"{e['ratio']:.3f}x" if e.get("ratio") else "-",
                      {"faster": "yes: faster", "slower": "yes: SLOWER"}.get(e["verdict"],
                                                                          e["verdict"])])
    out = [f"compared with {path} ({earlier.get('device_name', '?')}, "
           f"flush {earlier.get('l2_flush', '?')}): mean +- standard deviation of single calls"]
    out += _aligned(head, lines)
    ratios = [e["ratio"] for e in entries if e.get("ratio")]
    if ratios:
        import utils

        out.append(f"geometric mean of now/before over {len(ratios)} cases: "
                   f"{utils.geomean(ratios):.3f}x")
    return "\n".join(out)


def write_chart(path: str, rows, title: str, entries=None) -> None:
    """A bar chart of each case's mean (with its standard error), the reference's, and the earlier
    run's when comparing: a PNG (or any format matplotlib's Agg backend writes) at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r.get("stats")]
    labels = [r.get("label") or r["case"] for r in timed]
    series = [("this run" if entries else "submission", [r["stats"]["mean"] / 1e3 for r in timed],
               [r["stats"]["err"] / 1e3 for r in timed])]
    if entries:
        by_case = {e["case"]: e for e in entries}
        olds = [by_case.get(r["case"], {}).get("before") for r in timed]
        series.append(("earlier run", [o["mean"] / 1e3 if o else float("nan") for o in olds],
                       [o["err"] / 1e3 if o else 0.0 for o in olds]))
    if all(r.get("ref_stats") for r in timed):
        series.append(("reference", [r["ref_stats"]["mean"] / 1e3 for r in timed],
                       [r["ref_stats"]["err"] / 1e3 for r in timed]))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(timed) + 2), 4.5))
    width = 0.8 / len(series)
    for i, (name, values, errs) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(timed))]
        ax.bar(xs, values, width, yerr=errs, label=name, capsize=2)
    ax.set_xticks(range(len(timed)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("mean time per call (us, log scale)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _default_spec(mode: str, on_gpu: bool) -> str:
    if not on_gpu:
        return os.path.join(HERE, "specs", "cpu.txt")
    name = "tests.txt" if mode == "test" else "benchmarks.txt"
    return os.path.join(HERE, "specs", name)


def _progress_bar(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional
        return None
    # disable=None: no bar when stderr is not a terminal (logs, pipes); leave=False: the bar goes
    # once the table is printed
    return tqdm(total=total, desc=desc, unit="case", delay=0.5, file=sys.stderr,
                leave=False, dynamic_ncols=True, disable=None)


def human_rows(executor, cases, submission: str, case_opts: dict) -> list:
    """Each case's human_case row, run by ``executor`` (InProcess or SpawnedWorker), with a
    progress bar on stderr; leaderboard mode stops at the first failing case, as the runner."""
    rows = []
    bar = _progress_bar(len(cases), case_opts["mode"])
    for case in cases:
        if bar is not None:
            bar.set_postfix_str(_short_label(case.args), refresh=True)
        res = executor.run({"kind": "human", "submission": submission, "args": case.args,
                            "options": dict(case_opts, spec=case.spec)})
        if "case" not in res:  # the job itself failed (e.g. the submission does not import)
            res = {"case": _label(case.args), "label": _short_label(case.args),
                   "spec": case.spec, "args": dict(case.args), "ok": False,
                   "problems": [_one_line(res.get("message", "worker failed"))]}
            if is_serving_case(case.args) or is_sparse_case(case.args):
                res["kind"] = "sparse" if is_sparse_case(case.args) else "serving"
        rows.append(res)
        if bar is not None:
            bar.update(1)
        if case_opts["mode"] == "leaderboard" and not res["ok"]:
            break
    if bar is not None:
        bar.close()
    return rows


def next_command(opts, *, passed: bool, on_gpu: bool, timed: bool) -> str:
    """The last line of the report: the next useful command."""
    mode = opts.mode
    if not passed:
        return (f"next: fix the FAIL lines above and run python eval.py {mode} --strict again "
                "(--json PATH keeps every detail)")
    if mode == "test":
        if on_gpu:
            return "next: time it: python eval.py benchmark --strict --json before.json"
        return ("next: make test (the whole suite here), or eval.py on a GPU to time it "
                "(python eval.py benchmark)")
    if mode in ("benchmark", "leaderboard") and not timed:
        return ("next: time it on a GPU (python eval.py benchmark), or add --cpu-timing here "
                "(CPU times mean nothing)")
    if mode in ("benchmark", "leaderboard"):
        if opts.compare and not opts.chart:
            return f"next: draw it: python eval.py {mode} --compare {opts.compare} --chart chart.png"
        if opts.compare:
            return ("next: make tune tunes the route tables on this GPU; compare again with "
                    f"--compare {opts.compare}")
        if opts.json:
            return f"next: after a change, python eval.py {mode} --compare {_shown_path(opts.json)}"
        return (f"next: keep a run (python eval.py {mode} --json before.json); after a change, "
                "--compare before.json shows what moved")
    return "next: python eval.py test --strict"


def _shown_path(path: str) -> str:
    """``path`` relative to the working directory when it lies below it, else absolute."""
    rel = os.path.relpath(os.path.abspath(path))
    return os.path.abspath(path) if rel.startswith("..") else rel


def human_main(opts) -> int:
    import utils

    started = time.perf_counter()
    utils.prepare_environment()
    import reference
    import torch
    import triton

    try:
        device = utils.get_device(opts.device)
    except RuntimeError:
        print(f"eval.py: --device {opts.device}: expected cpu, cuda or cuda:N", file=sys.stderr)
        return EXIT_BAD_ARGS
    if device.type not in ("cpu", "cuda"):
        print(f"eval.py: --device {opts.device}: expected cpu or cuda", file=sys.stderr)
        return EXIT_BAD_ARGS
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"eval.py: --device {opts.device}: torch sees no CUDA or ROCm GPU here "
              f"(torch {torch.__version__}); leave --device out to run on the CPU",
              file=sys.stderr)
        return EXIT_BAD_ARGS
    on_gpu = device.type == "cuda"
    benchmarking = opts.mode in ("benchmark", "leaderboard")
    timed = benchmarking and (on_gpu or opts.cpu_timing)
    if (opts.compare or opts.chart) and not timed:
        flag = "--compare" if opts.compare else "--chart"
        print(f"eval.py: {flag} needs timings: "
              + ("benchmark or leaderboard mode" if not benchmarking
                 else "on a machine without a GPU add --cpu-timing"), file=sys.stderr)
        return EXIT_BAD_ARGS
    earlier = None
    if opts.compare:
        try:
            earlier = read_earlier(opts.compare)
        except ValueError as exc:
            print(f"eval.py: --compare: {exc}", file=sys.stderr)
            return EXIT_BAD_ARGS
    if opts.chart:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("eval.py: --chart needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return EXIT_BAD_ARGS
        chart_dir = os.path.dirname(os.path.abspath(opts.chart))
        if not os.path.isdir(chart_dir):
            print(f"eval.py: --chart: no directory {chart_dir}", file=sys.stderr)
            return EXIT_BAD_ARGS
    spec_path = opts.spec or _default_spec(opts.mode, on_gpu)
    if not os.path.exists(spec_path):
        print(f"eval.py: spec file {spec_path} not found", file=sys.stderr)
        return EXIT_BAD_ARGS
    submission = os.path.abspath(opts.submission or default_submission_path())
    if not os.path.exists(submission):
        print(f"eval.py: submission {submission} not found", file=sys.stderr)
        return EXIT_BAD_ARGS
    try:
        cases = utils.read_spec_file(spec_path, utils.secret_seed_from_env())
        check_serving_cases(cases)
    except (OSError, ValueError) as exc:
        print(f"eval.py: cannot read spec file {spec_path}: {exc}", file=sys.stderr)
        return EXIT_BAD_ARGS

    max_repeats = BENCH_MAX_REPEATS if on_gpu else CPU_MAX_REPEATS
    max_time_ns = BENCH_MAX_TIME_NS if on_gpu else CPU_MAX_TIME_NS
    if opts.mode == "leaderboard":
        max_repeats = LEADERBOARD_MAX_REPEATS if on_gpu else CPU_MAX_REPEATS
        max_time_ns = LEADERBOARD_MAX_TIME_NS if on_gpu else CPU_MAX_TIME_NS
    ref_max_repeats = REF_MAX_REPEATS if on_gpu else CPU_MAX_REPEATS
    if opts.repeats is not None:
        max_repeats = ref_max_repeats = opts.repeats
    case_opts = {"mode": opts.mode, "strict": opts.strict, "l2_flush": opts.l2_flush,
                 "device": str(device), "max_repeats": max_repeats, "max_time_ns": max_time_ns,
                 "ref_max_repeats": ref_max_repeats, "timed": timed,
                 "ref_max_time_ns": REF_MAX_TIME_NS if on_gpu else CPU_MAX_TIME_NS}

    print(f"eval.py {opts.mode} {_shown_path(spec_path)} | device: {utils.device_name(device)}"
          f" | torch {torch.__version__} | triton {triton.__version__}"
          f" | aiter: {'yes' if reference.HAVE_AITER else 'no'}"
          f" | {'strict' if opts.strict else 'loose (runner) check only'}"
          f"{' (serving cases: always strict)' if any(map(_always_strict, cases)) else ''}"
          f"{' | cases in one spawned worker' if opts.spawn else ''}")
    print(f"submission: {submission}")
    if not on_gpu:
        print(CPU_NOTE)
    if benchmarking and not timed:
        print("timing skipped: no GPU here, so the cases are only checked (--cpu-timing times "
              "them anyway)")
    copy_bw = None
    if timed:
        copy_bw = utils.copy_bandwidth(device)
        flush_text = {"default": f"{utils.default_flush_bytes(device) >> 20} MiB buffer zeroed",
                      "runner": "runner's 16000x1024x1024 float32 randn (62.5 GiB)",
                      "none": "none"}[opts.l2_flush if on_gpu else "none"]
        print(f"copy bandwidth: {copy_bw:.0f} GB/s (device-to-device copy, read + write); "
              f"L2 flush before each timed call: {flush_text}")
        note = utils.runner_flush_note(device) if on_gpu and opts.l2_flush == "runner" else None
        if note:
            print(f"NOTE: {note} The timed cases will stop with this message.")
    sys.stdout.flush()

    if opts.spawn:
        executor = SpawnedWorker()
    else:
        try:
            executor = InProcess(load_submission(submission, "_eval_submission"))
        except Exception:
            print(f"eval.py: cannot import {submission}:\n{traceback.format_exc()}",
                  file=sys.stderr)
            return EXIT_FAIL
    with executor:
        if timed and cases:  # warm-up, not reported
            executor.run(warmup_job(submission, cases[0].args, flush_mode="none",
                                    max_repeats=min(WARMUP_MAX_REPEATS, max_repeats),
                                    device=str(device)))
        rows = human_rows(executor, cases, submission, case_opts)

    for r in rows:  # derived numbers, for the JSON
        st, ref = r.get("stats"), r.get("ref_stats")
        if st and st["mean"] > 0:
            if ref:
                r["speedup"] = ref["mean"] / st["mean"]
            if r.get("bytes"):
                r["gbs"] = r["bytes"] / st["mean"]
                if copy_bw:
                    r["fraction_of_copy_bw"] = r["gbs"] / copy_bw
        r["fraction_of_bound"] = fraction_of_bound(r)
    serving_rows = [r for r in rows if r.get("kind") == "serving"]
    sparse_rows = [r for r in rows if r.get("kind") == "sparse"]
    board_rows = [r for r in rows if r.get("kind") not in ("serving", "sparse")]
    if board_rows or not (serving_rows or sparse_rows):
        print(format_table(board_rows, opts.mode, copy_bw, wide=opts.wide, timed=timed))
    if serving_rows:
        print(format_serving_table(serving_rows, opts.mode, copy_bw, wide=opts.wide, timed=timed))
    if sparse_rows:
        print(format_sparse_table(sparse_rows, opts.mode, copy_bw, wide=opts.wide, timed=timed))
    passed = all(r["ok"] for r in rows) and len(rows) == len(cases)
    summary = {}
    if timed:
        means = [r["stats"]["mean"] for r in rows if r.get("stats")]
        refs = [r["ref_stats"]["mean"] for r in rows if r.get("ref_stats")]
        if means and len(means) == len(rows):
            summary["geomean_ns"] = utils.geomean(means)
            line = f"geometric mean of the means: {summary['geomean_ns'] / 1e3:.2f} us"
            if len(refs) == len(rows):
                summary["ref_geomean_ns"] = utils.geomean(refs)
                line += (f" (reference {summary['ref_geomean_ns'] / 1e3:.2f} us, speedup "
                         f"{summary['ref_geomean_ns'] / summary['geomean_ns']:.2f}x)")
            print(line)
        else:
            print("geometric mean of the means: n/a (some case has no timing)")
        if not on_gpu:
            print("(CPU times: meaningless for the leaderboard)")
    if opts.mode == "profile":
        for r in rows:
            if r.get("report"):
                print(f"\n=== profile {r['case']} ===\n{r['report']}")
    entries = None
    if earlier is not None:
        entries = compare_rows(rows, earlier)
        print(format_compare(entries, earlier, opts.compare))
    if opts.chart:
        title = (f"eval.py {opts.mode} {os.path.basename(spec_path)} on {utils.device_name(device)}"
                 f", flush {opts.l2_flush if on_gpu else 'none'}")
        write_chart(opts.chart, rows, title, entries)
        print(f"chart: {opts.chart}")
    elapsed = time.perf_counter() - started
    totals = summarise(rows, len(cases), elapsed)
    print(format_summary(totals, "pass" if passed else "fail"))
    if opts.json:
        payload = {
            "mode": opts.mode, "spec_file": spec_path, "submission": submission,
            "device": str(device), "device_name": utils.device_name(device),
            "torch": torch.__version__, "triton": triton.__version__,
            "have_aiter": reference.HAVE_AITER, "strict": bool(opts.strict),
            "l2_flush": opts.l2_flush if on_gpu else "none", "copy_bandwidth_gbs": copy_bw,
            "timed": timed, "cpu_times_meaningless": not on_gpu, "cases": rows,
            "passed": passed, "summary": totals, **summary}
        if entries is not None:
            payload["compare"] = {"earlier": opts.compare, "cases": entries}
        with open(opts.json, "w") as f:
            json.dump(payload, f, indent=2, default=str)
    print(next_command(opts, passed=passed, on_gpu=on_gpu, timed=timed))
    return EXIT_OK if passed else EXIT_FAIL


# ---------------------------------------------------------------------------------------------
# Entry


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="eval.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", help="|".join(MODES))
    p.add_argument("spec", nargs="?", default=None,
                   help="spec file (default: specs/tests.txt or specs/benchmarks.txt on a GPU, "
                        "specs/cpu.txt without one)")
    p.add_argument("--submission", default=None,
                   help="submission file (default: ./submission.py, else the repo's)")
    p.add_argument("--json", default=None, help="write all results to this JSON file")
    p.add_argument("--strict", action="store_true",
                   help="also fail on rel. L2 error above the route's bound, non-finite, "
                        "wrong shape/dtype, or non-fresh outputs")
    p.add_argument("--l2-flush", default="default", choices=("default", "runner", "none"),
                   help="default: zero a buffer of 4x L2 (>= 512 MiB); runner: the runner's "
                        "62.5 GiB randn allocation; none")
    p.add_argument("--repeats", type=int, default=None, help="at most N timed repeats per case")
    p.add_argument("--spawn", action="store_true",
                   help="run the cases in one spawned worker process, as the runner")
    p.add_argument("--device", default=None, help="cpu or cuda (default: the GPU if any)")
    p.add_argument("--wide", action="store_true",
                   help="show each route's full label (its parameters) in the table")
    p.add_argument("--cpu-timing", action="store_true",
                   help="time the cases on a machine without a GPU too (the times mean nothing)")
    p.add_argument("--compare", default=None, metavar="EARLIER.json",
                   help="benchmark/leaderboard: per case, the ratio to an earlier --json run and "
                        "whether it lies outside both runs' spread")
    p.add_argument("--chart", default=None, metavar="PATH",
                   help="benchmark/leaderboard: draw the times as a bar chart (PNG) at PATH")
    p.add_argument("--popcorn", action="store_true",
                   help="runner mode: requires POPCORN_FD (exit 111 without it)")
    return p


class _ArgError(Exception):
    pass


def _parse(argv):
    parser = _parser()

    def error(message):
        raise _ArgError(message)

    parser.error = error
    return parser.parse_intermixed_args(argv)  # options may come before or after SPEC


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        _parser().print_help()
        return EXIT_OK
    try:
        opts = _parse(argv)
    except _ArgError as exc:
        print(f"eval.py: {exc}", file=sys.stderr)
        return EXIT_BAD_ARGS
    fd_text = os.environ.get("POPCORN_FD")
    if fd_text is not None or opts.popcorn:
        if fd_text is None or not fd_text.strip().isdigit():
            print("eval.py: runner mode needs POPCORN_FD set to an open file descriptor",
                  file=sys.stderr)
            return EXIT_NO_FD
        fd = int(fd_text)
        try:
            os.fstat(fd)
        except OSError:
            print(f"eval.py: POPCORN_FD={fd} is not an open file descriptor", file=sys.stderr)
            return EXIT_NO_FD
        if opts.mode not in MODES or opts.spec is None or not os.path.exists(opts.spec):
            print(f"eval.py: usage: POPCORN_FD=N python eval.py {'|'.join(MODES)} SPECFILE",
                  file=sys.stderr)
            return EXIT_BAD_ARGS
        submission = os.path.abspath(opts.submission or default_submission_path())
        return popcorn_main(opts.mode, opts.spec, submission, fd, opts.l2_flush)
    if opts.mode not in MODES:
        print(f"eval.py: unknown mode {opts.mode!r}; expected one of {', '.join(MODES)}",
              file=sys.stderr)
        return EXIT_BAD_ARGS
    if opts.repeats is not None and opts.repeats < 1:
        print("eval.py: --repeats must be >= 1", file=sys.stderr)
        return EXIT_BAD_ARGS
    return human_main(opts)


if __name__ == "__main__":
    sys.exit(main())

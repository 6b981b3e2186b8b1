"""A/B of two versions of a route on one device, in one run: for each leaderboard shape, each
module's route with each given parameter set, timed interleaved like the runner (L2 flushed,
CUDA events around one call); medians, then the geomean per (module, params) column.

    python tools/ab_probe.py A.py B.py [C.py ...] [--route hopper_fp8] [--params JSON-list] [--repeats 40]
    python tools/ab_probe.py A.py B.py --whole [--l2-flush runner] [--repeats 30]
    python tools/ab_probe.py A.py B.py A.py --whole --shapes 64x1024 --repeats 300

A module given twice is loaded and timed twice (A.py B.py A.py brackets B between two copies of A:
the difference between A's two columns is the run's own spread). --shapes: a comma-separated subset
of the leaderboard shapes (BATCHxKV).

--whole: each module's custom_kernel as a whole (its own table, its checks and launch path): the
wall time of its first call on each shape (where a candidate race runs) and the route it then
keeps; checked against float64 attention (rel. L2 within 0.06); then its host time per call
(perf_counter, the GPU idle before) and its GPU time (median and mean), interleaved across modules.

Parameter sets per shape: each module's own table row for the route (rows of other routes are
skipped), plus --extra '[{"bs": 4, "kv": 8192, "params": {...}}, ...]'. Each output is checked
against the reference first (--no-check: ablations that skip work on purpose).
"""
import argparse
import functools
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch  # noqa: E402

import eval as runner  # noqa: E402  (the project's one submission loader)
import reference  # noqa: E402
import utils  # noqa: E402

SHAPES = utils.benchmark_shapes()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("modules", nargs="+")
    parser.add_argument("--route", default="hopper_fp8")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--extra", default="[]", help="JSON list of {bs, kv, params} to time as well")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the accuracy assert (ablations that drop work on purpose)")
    parser.add_argument("--whole", action="store_true", help="time each module's custom_kernel and its host time")
    parser.add_argument("--l2-flush", default="default", choices=utils.L2Flusher.MODES)
    parser.add_argument("--shapes", default=None, help="BATCHxKV,... (default: every leaderboard shape)")
    args = parser.parse_args()
    args.shapes = parse_shapes(args.shapes) if args.shapes else SHAPES
    modules = [runner.load_submission(path, f"ab_{i}") for i, path in enumerate(args.modules)]
    flush = utils.L2Flusher(args.l2_flush)
    if args.whole:
        return compare_whole(modules, args, flush)
    columns = {}  # module index -> best median per shape
    for batch, kv in args.shapes:
        data = reference.generate_input(batch, 1, kv, 7)
        expected = reference.ref_kernel(data)
        param_sets = []
        for module in modules:
            row = module.select_route(batch, kv, True, module.TRITON_ROUTE_TABLE)
            if row["route"] == args.route and row["params"] not in param_sets:
                param_sets.append(row["params"])
        param_sets += [e["params"] for e in json.loads(args.extra)
                       if (e["bs"], e["kv"]) == (batch, kv) and e["params"] not in param_sets]
        calls = {}
        for (i, module), params in [(m, p) for m in enumerate(modules) for p in param_sets]:
            def fn(module=module, params=params, data=data):
                return module.ROUTES[args.route](*data, **params)
            out = fn()
            assert args.no_check or reference.mismatch_ratio(out, expected) <= 0.005, (args.modules[i], params)
            calls[(i, json.dumps(params, sort_keys=True))] = (fn, flush)
        times = utils.interleaved_median_us(calls, args.repeats)
        flush.release()  # a runner flush's 62.5 GiB back to the device before the next shape's inputs
        line = []
        for i in range(len(modules)):
            medians = {params: median for (j, params), median in times.items() if j == i}
            if medians:
                columns.setdefault(i, []).append(min(medians.values()))
            line += [f"{os.path.basename(args.modules[i])} {params}: {m:.1f}" for params, m in medians.items()]
        print(f"bs{batch} kv{kv}: " + " | ".join(line), flush=True)
    print("\nbest params per shape, shapes where the route is chosen:")
    for i, path in enumerate(args.modules):
        print(f"  {os.path.basename(path)}: geomean {utils.geomean(columns[i]):.1f} us over {len(columns[i])} shapes")


def parse_shapes(text):
    """'64x1024,4x8192' -> [(64, 1024), (4, 8192)]."""
    shapes = []
    for item in text.split(","):
        batch, _, kv = item.strip().partition("x")
        if not (batch.isdigit() and kv.isdigit()):
            raise SystemExit(f"--shapes: {item!r} is not BATCHxKV")
        shapes.append((int(batch), int(kv)))
    return shapes


def column_names(paths):
    """Each module's file name; a file given again gets its position: a.py, b.py, a.py#3."""
    names = []
    for i, path in enumerate(paths):
        name = os.path.basename(path)
        names.append(name if name not in names else f"{name}#{i + 1}")
    return names


def host_us(fn):
    """Host time of one call, the GPU idle before it (perf_counter, no sync inside)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    end = time.perf_counter()
    torch.cuda.synchronize()
    return (end - start) * 1e6


def compare_whole(modules, args, flush):
    names = column_names(args.modules)
    columns = {name: {"host": [], "median": [], "mean": []} for name in names}
    for batch, kv in args.shapes:
        data = reference.generate_input(batch, 1, kv, 7)
        truth = reference.attention_float64(data)
        calls, firsts = {}, []
        for name, module in zip(names, modules, strict=True):
            first_ms = host_us(functools.partial(module.custom_kernel, data)) / 1e3  # a race runs here
            firsts.append(f"{name}: first call {first_ms:.0f} ms, then {getattr(module, 'LAST_ROUTE', '?')}")
            out = module.custom_kernel(data).double()
            error = float((out - truth).norm() / truth.norm())
            assert error < 0.06, (name, error)
            calls[name] = (lambda module=module, data=data: module.custom_kernel(data))
        host = {name: [] for name in names}
        gpu = {name: [] for name in names}
        for _ in range(args.repeats):
            for name, fn in calls.items():
                host[name].append(host_us(fn))
        for _ in range(args.repeats):
            for name, fn in calls.items():
                gpu[name].append(utils.time_call(fn, flush=flush)[1] / 1e3)
        flush.release()  # a runner flush's 62.5 GiB back to the device before the next shape's inputs
        cells = []
        for name in names:
            row = {"host": statistics.median(host[name]), "median": statistics.median(gpu[name]),
                   "mean": statistics.fmean(gpu[name])}
            for key, value in row.items():
                columns[name][key].append(value)
            cells.append(f"{name}: host {row['host']:.1f} gpu median {row['median']:.1f} mean {row['mean']:.1f}")
        print(f"bs{batch} kv{kv}: " + " | ".join(firsts), flush=True)
        print(f"bs{batch} kv{kv}: " + " | ".join(cells), flush=True)
    for name in names:
        c = columns[name]
        print(f"geomean {name}: host {utils.geomean(c['host']):.1f} us, gpu median {utils.geomean(c['median']):.1f} "
              f"us, mean {utils.geomean(c['mean']):.1f} us")


if __name__ == "__main__":
    main()

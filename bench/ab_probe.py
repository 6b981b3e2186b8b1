"""A/B of two versions of a route on one device, in one run: for each leaderboard shape, each
module's route with each given parameter set, timed interleaved like the runner (L2 flushed,
CUDA events around one call); medians, then the geomean per (module, params) column.

    python bench/ab_probe.py A.py B.py [C.py ...] [--route hopper_fp8] [--params JSON-list] [--repeats 40]

Parameter sets per shape: each module's own table row for the route (rows of other routes are
skipped), plus --extra '[{"bs": 4, "kv": 8192, "params": {...}}, ...]'. Each output is checked
against the reference first (--no-check: ablations that skip work on purpose).
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
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
    args = parser.parse_args()
    modules = [runner.load_submission(path, f"ab_{i}") for i, path in enumerate(args.modules)]
    flush = utils.L2Flusher("default")
    columns = {}  # module index -> best median per shape
    for batch, kv in SHAPES:
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


if __name__ == "__main__":
    main()

"""Accuracy of every Triton route on the leaderboard shapes under K secret-like seeds, and a race
check of the fused split merge (one device call; prints a table last).

    python bench/accuracy_seeds.py [--spec specs/benchmarks.txt] [--seeds 5] [--repeats 10]

Per shape and route (the route table's row for the shape; other Triton routes at that row's split
count): worst mismatch ratio against ref_kernel (the runner's check), worst rel. L2 error against
float64 attention over the bf16 cache and its ratio to the reference's own error, and whether
`--repeats` calls on one input give bit-identical outputs (a merge that read a partial before it
was written would not).
"""
import argparse
import os
import random
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import reference  # noqa: E402
import submission  # noqa: E402
import utils  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", default=os.path.join(ROOT, "specs", "benchmarks.txt"))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    secrets = random.Random(1).sample(range(1, 2**31), args.seeds)
    rows = []
    for case in utils.read_spec_file(args.spec):
        batch, kv_len = case.args["batchsize"], case.args["kvseqlen"]
        row = submission.select_route(batch, kv_len)
        splits = row["params"].get("num_splits", 1)
        routes = {name: (dict(row["params"]) if name == row["route"] else {"num_splits": splits})
                  for name in submission.ROUTES if name.startswith("triton_")}
        worst = {name: [0.0, 0.0, 0.0] for name in routes}
        for secret in secrets:
            data = reference.generate_input(**dict(case.args, seed=utils.combine_seed(case.args["seed"], secret)))
            expected, truth = reference.ref_kernel(data), reference.attention_float64(data)
            ref_l2 = reference.rel_l2_error(expected, truth)
            for name, params in routes.items():
                out = submission.ROUTES[name](*data, **params)
                l2 = reference.rel_l2_error(out, truth)
                w = worst[name]
                w[0] = max(w[0], reference.mismatch_ratio(out, expected))
                w[1] = max(w[1], l2)
                w[2] = max(w[2], l2 / ref_l2)
            del expected, truth
        for name, params in routes.items():  # race check on the last seed's input
            first = submission.ROUTES[name](*data, **params)
            same = all(torch.equal(first, submission.ROUTES[name](*data, **params)) for _ in range(args.repeats))
            rows.append((batch, kv_len, name, params.get("num_splits", 1), *worst[name], same))
            print(rows[-1], flush=True)
        del data
        torch.cuda.empty_cache()
    print(f"\n{utils.device_name()}: {args.seeds} secret-like seeds per shape, {args.repeats} repeats for the race check")
    print(f"{'bs':>4} {'kv':>5} {'route':<13} {'splits':>6} {'mism%':>6} {'relL2':>6} {'/ref':>5} {'bound':>5} {'identical':>9}")
    for batch, kv_len, name, splits, mism, l2, ratio, same in rows:
        bound = submission.ROUTE_INFO[name]["rel_l2_bound"]
        print(f"{batch:>4} {kv_len:>5} {name:<13} {splits:>6} {100 * mism:6.2f} {l2:6.3f} {ratio:5.2f} {bound:5.2f} {str(same):>9}")


if __name__ == "__main__":
    main()

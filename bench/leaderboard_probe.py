"""Why is custom_kernel slower in leaderboard mode (a new input every repeat, checked) than in
benchmark mode (one input)? Times the same call under each ingredient of leaderboard mode apart.

    python bench/leaderboard_probe.py [--batch 4] [--kv 1024] [--repeats 30]
"""
import argparse
import gc
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import reference  # noqa: E402
import submission  # noqa: E402
import utils  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--kv", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    flush = utils.L2Flusher("default")
    base = dict(batchsize=args.batch, qseqlen=1, kvseqlen=args.kv, seed=1)
    fixed = reference.generate_input(**base)
    submission.custom_kernel(fixed)

    def timed(make_data, between=None):
        times = []
        for i in range(args.repeats):
            data = make_data(i)
            if between is not None:
                between(data)
            times.append(utils.time_call(lambda: submission.custom_kernel(data), flush=flush)[1] / 1e3)
        return statistics.median(times), statistics.fmean(times)

    new_input = lambda i: reference.generate_input(**dict(base, seed=100 + i))  # noqa: E731
    cases = {
        "same input": (lambda i: fixed, None),
        "same input + ref_kernel between": (lambda i: fixed, reference.ref_kernel),
        "new input": (new_input, None),
        "new input + clone": (lambda i: reference.clone_data(new_input(i)), None),
        "new input + ref_kernel between": (new_input, reference.ref_kernel),
        "same input + generate_input between": (lambda i: fixed, lambda d: new_input(0)),
        "... + gc.collect() after it": (lambda i: fixed, lambda d: (new_input(0), gc.collect())),
        "... + synchronize, 1 ms sleep after it": (lambda i: fixed, lambda d: (new_input(0), torch.cuda.synchronize(), time.sleep(1e-3))),
        "same input + 256 MiB alloc/free between": (lambda i: fixed, lambda d: torch.empty(2**28, dtype=torch.uint8, device="cuda").fill_(1)),
    }
    print(f"{utils.device_name()} bs={args.batch} kv={args.kv}: median / mean us of custom_kernel")
    for name, (make, between) in cases.items():
        med, mean = timed(make, between)
        print(f"  {name:40s} {med:9.1f} {mean:9.1f}", flush=True)


if __name__ == "__main__":
    main()

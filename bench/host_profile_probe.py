"""Host time of one route call, and where it goes (one device call): perf_counter around N calls
(no sync inside, so GPU time is not counted) of custom_kernel, the Hopper route and the portable
route at bs=4/kv=1024, then a cProfile of the Hopper route's calls (top functions by own time).

    python bench/host_profile_probe.py [--calls 300]
"""
import argparse
import cProfile
import os
import pstats
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import reference  # noqa: E402
import submission  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_time_probe import host_us  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    data = reference.generate_input(4, 1, 1024, 11)
    row = submission.select_route(4, 1024)
    calls = {
        "custom_kernel": lambda: submission.custom_kernel(data),
        f"{row['route']} direct": lambda: submission.ROUTES[row["route"]](*data, **row["params"]),
        "triton_fp8 direct": lambda: submission.triton_fp8_route(*data, num_splits=16),
        "torch.empty only": lambda: torch.empty(4, 16, 512, dtype=torch.bfloat16, device="cuda"),
        "current_stream only": lambda: torch.cuda.current_stream(data[0].device).cuda_stream,
    }
    for fn in calls.values():
        fn()
        fn()
    for name, fn in calls.items():
        median = statistics.median(host_us(fn) for _ in range(args.calls))
        print(f"{name:24s} host median {median:7.1f} us", flush=True)
    profile = cProfile.Profile()
    fn = calls[f"{row['route']} direct"]
    profile.enable()
    for _ in range(args.calls):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()

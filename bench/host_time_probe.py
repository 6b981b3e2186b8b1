"""Host time of one custom_kernel call (perf_counter, no sync) after different preceding work, and a
cProfile of the slow case: is leaderboard mode's extra time spent on the host?"""
import cProfile
import gc
import os
import pstats
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import reference  # noqa: E402
import submission  # noqa: E402


def host_us(call):
    """Host time of one call (perf_counter around it; the GPU idle before, drained after)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    call()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e6


def main():
    base = dict(batchsize=4, qseqlen=1, kvseqlen=1024, seed=1)
    fixed = reference.generate_input(**base)
    submission.custom_kernel(fixed)
    fresh = lambda: reference.generate_input(**dict(base, seed=7))  # noqa: E731
    for name, before in [("nothing", lambda: None), ("generate_input", fresh),
                         ("generate_input + gc.collect", lambda: (fresh(), gc.collect()))]:
        times = []
        for _ in range(10):
            before()
            times.append(host_us(lambda: submission.custom_kernel(fixed)))
        print(f"host us after {name:30s} median {statistics.median(times):8.1f}  max {max(times):8.1f}", flush=True)
    fresh(); gc.collect()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    submission.custom_kernel(fixed)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(14)


if __name__ == "__main__":
    main()

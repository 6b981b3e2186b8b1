"""Why a call's MEAN can sit far above its median (one device call): times N single calls like the
runner (synchronize, L2 flush, CUDA events around one call) of custom_kernel and of its route
called directly, with Python's garbage collector on and off, and the host time of each call
(perf_counter around the call, no sync). Prints percentiles, the mean, and which calls were slow.

    python bench/outlier_probe.py [--shapes 4x1024,256x1024] [--calls 300]
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


def timed_calls(fn, calls, flush):
    """(event us, host us) per call."""
    events, hosts = [], []
    for _ in range(calls):
        torch.cuda.synchronize()
        flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        events.append(start.elapsed_time(end) * 1e3)
        hosts.append((t1 - t0) * 1e6)
    return events, hosts


def summary(name, events, hosts):
    q = statistics.quantiles(events, n=100)
    median = statistics.median(events)
    slow = [i for i, t in enumerate(events) if t > 2 * median]
    print(f"  {name:28s} median {median:7.1f}  p90 {q[89]:7.1f}  p99 {q[98]:7.1f}  max {max(events):8.1f}  "
          f"mean {statistics.mean(events):7.1f} | host median {statistics.median(hosts):6.1f} "
          f"max {max(hosts):7.1f} | slow calls ({len(slow)}): {slow[:12]}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4x1024,256x1024")
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    flush = utils.L2Flusher("default")
    for shape in args.shapes.split(","):
        batch, kv = map(int, shape.split("x"))
        data = reference.generate_input(batch, 1, kv, 11)
        row = submission.select_route(batch, kv)
        direct = lambda: submission.ROUTES[row["route"]](*data, **row["params"])  # noqa: E731
        kernel = lambda: submission.custom_kernel(data)  # noqa: E731
        for fn in (kernel, direct):
            fn()
            fn()
        print(f"bs{batch} kv{kv}: {row['route']} {row['params']}")
        for gc_on in (True, False):
            (gc.enable if gc_on else gc.disable)()
            for name, fn in (("custom_kernel", kernel), ("route direct", direct)):
                events, hosts = timed_calls(fn, args.calls, flush)
                summary(f"{name} gc {'on' if gc_on else 'off'}", events, hosts)
        gc.enable()


if __name__ == "__main__":
    main()

"""What the runner's L2 flush costs the call it times (one device call, an NVIDIA GPU).

The runner flushes by writing a 62.5 GiB randn tensor: the L2 is left full of DIRTY lines, which
the timed call must write back to DRAM as its own reads evict them. Per leaderboard shape, this
times (CUDA events around one call, like the runner; medians of --repeats, interleaved):
  calls   - "ours": the submission (its route table);
          - "read": a kernel that only reads the fp8 cache's bytes once (bench/read_floor.py),
            and "read/<policy>" the same with a load eviction policy (--policies evict_first);
  flushes - "runner": the runner's;
          - "clean": a buffer written, then another as large read (the L2 holds clean lines
            when the call starts), then a GPU spin of about 1 ms so that the call's host path
            stays hidden as behind the runner's 20 ms flush;
          - "clean-nospin" (--host-exposure): the clean flush without the spin: the call's host
            path (50-75 us on the H200's host) outlasts it and shows in the time;
          - "none" (--host-exposure): nothing before the call, the GPU idle.
Short table last: a column per (call, flush), geomeans.

    python3 bench/flush_probe.py [--repeats 30] [--policies evict_first] [--host-exposure]
"""
import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import reference  # noqa: E402
import submission  # noqa: E402
import utils  # noqa: E402
from read_floor import cache_words, read_once  # noqa: E402

SHAPES = utils.benchmark_shapes()


class CleanFlush:
    """The same eviction without dirty lines left behind: write a buffer of the default flush
    size, then read another as large (the writes are written back during that read), then (spin)
    keep the GPU busy for about 1 ms, as the runner's long flush does, so that the timed call's
    host path is not inside its timing."""

    def __init__(self, spin=True):
        nbytes = utils.default_flush_bytes()
        self.dirty = torch.empty(nbytes // 4, dtype=torch.int32, device="cuda")
        self.clean = torch.zeros(nbytes // 4, dtype=torch.int32, device="cuda")
        self.out = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.spin = spin

    def __call__(self):
        self.dirty.zero_()
        read_once(self.clean, self.out)
        if self.spin:
            torch.cuda._sleep(2_000_000)  # clock cycles


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--policies", default="", help="comma list of load eviction policies for extra read columns")
    parser.add_argument("--host-exposure", action="store_true", help="also the clean-nospin and none flushes")
    args = parser.parse_args()
    flushes = {"runner": utils.L2Flusher("runner"), "clean": CleanFlush()}
    if args.host_exposure:
        flushes.update({"clean-nospin": CleanFlush(spin=False), "none": None})
    policies = [p for p in args.policies.split(",") if p]
    rows = []
    for batch, kv in SHAPES:
        data = reference.generate_input(batch, 1, kv, 7)
        words = cache_words(data[1]["fp8"][0])
        out = torch.zeros(1, dtype=torch.int32, device="cuda")
        calls = {"ours": lambda: submission.custom_kernel(data), "read": lambda: read_once(words, out)}
        calls.update({f"read/{p}": (lambda p=p: read_once(words, out, eviction_policy=p)) for p in policies})
        for fn in calls.values():
            fn()
        timed = {(c, f): (calls[c], flushes[f]) for c in calls for f in flushes}
        rows.append((batch, kv, words.numel() * 4, utils.interleaved_median_us(timed, args.repeats)))
        del data, words
    columns = list(rows[0][3])
    print(f"\nmedian us; read GB/s = the cache's bytes / read's time after the clean flush")
    print(f"{'bs':>4} {'kv':>5} {'MB':>7} " + " ".join(f"{c + ' ' + f:>18}" for c, f in columns) + f" {'read GB/s':>9}")
    for batch, kv, nbytes, med in rows:
        print(f"{batch:>4} {kv:>5} {nbytes / 1e6:>7.1f} " + " ".join(f"{med[key]:>18.1f}" for key in columns)
              + f" {nbytes / med[('read', 'clean')] / 1e3:>9.0f}")
    print(f"{'geomean':>18} " + " ".join(f"{utils.geomean([r[3][key] for r in rows]):>18.1f}" for key in columns))


if __name__ == "__main__":
    main()

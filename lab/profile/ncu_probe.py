"""Runs the submission on one leaderboard shape a few times, for a profiler to attach to: the
first call compiles, the later ones are the ones to profile (ncu --launch-skip). One shape per
process, so each profile's kernel launches are counted from zero.

    ncu --clock-control none -k regex:hopper --launch-skip 2 --launch-count 1 \\
        --set full python3 lab/profile/ncu_probe.py 256 1024

(lab/profile/ncu_run.sh runs it for a list of shapes and writes the reports.)
"""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path.insert(0, ROOT)
import reference  # noqa: E402
import submission  # noqa: E402


def main():
    batch, kv = int(sys.argv[1]), int(sys.argv[2])
    calls = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    data = reference.generate_input(batch, 1, kv, 7)
    for _ in range(calls):
        submission.custom_kernel(data)
    torch.cuda.synchronize()
    print(f"bs{batch} kv{kv}: {submission.LAST_ROUTE}")


if __name__ == "__main__":
    main()

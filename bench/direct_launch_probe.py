"""Does launching the compiled kernel directly (submission.launch) cut custom_kernel's host time,
and give bit-identical results? Compared with Triton's own dispatch, in benchmark-like and
leaderboard-like conditions (generate_input of another seed before each timed call)."""
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import reference  # noqa: E402
import submission  # noqa: E402
import utils  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_time_probe import host_us  # noqa: E402

direct_launch = submission.launch


def triton_dispatch(kernel, grid, tensors, scalars, constexprs, num_warps, num_stages):
    kernel[grid](*tensors, *scalars, **constexprs, num_warps=num_warps, num_stages=num_stages)


def main():
    flush = utils.L2Flusher("default")
    for batch, kv_len in [(4, 1024), (64, 8192)]:
        base = dict(batchsize=batch, qseqlen=1, kvseqlen=kv_len, seed=1)
        data = reference.generate_input(**base)
        outputs = {}
        for name, fn in [("triton dispatch", triton_dispatch), ("direct launch", direct_launch)]:
            submission.launch = fn
            submission.custom_kernel(data)
            outputs[name] = submission.custom_kernel(data)
            kernel = lambda: submission.custom_kernel(data)  # noqa: E731
            warm = statistics.median(host_us(kernel) for _ in range(20))
            cold = []
            events = []
            for i in range(15):
                reference.generate_input(**dict(base, seed=50 + i))
                cold.append(host_us(kernel))
                reference.generate_input(**dict(base, seed=80 + i))
                events.append(utils.time_call(kernel, flush=flush)[1] / 1e3)
            bench = utils.median_time_us(kernel, 20, flush)
            print(f"bs {batch} kv {kv_len} {name:16s} host us warm {warm:6.1f} after generate_input "
                  f"{statistics.median(cold):6.1f} | events us: benchmark {bench:7.1f} after generate_input "
                  f"{statistics.median(events):7.1f} (mean {statistics.fmean(events):7.1f})", flush=True)
        same = torch.equal(outputs["triton dispatch"], outputs["direct launch"])
        ok, message = reference.check_implementation(data, outputs["direct launch"])
        print(f"   bit-identical: {same}; check: {ok} ({message})", flush=True)
    submission.launch = direct_launch


if __name__ == "__main__":
    main()

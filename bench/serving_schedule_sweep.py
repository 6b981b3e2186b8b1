"""The Hopper serving route's schedule knobs on FlashMLA's benchmark inputs (NOTES.md h38b).

For each case (grid C: the leaderboard's 8 shapes as a paged fp8 cache; grid B: 128 requests,
16 heads, s_q 1 and 2, varied lengths around 4k and 16k; one grid-A case) and each setting of the
hopper_paged row's (waves, min_chunk) and SERVING_MAX_SPLITS, the kernel time of
mla_decode_with_kvcache (L2 flushed before each call, CUDA events, median of --repeats), all in
one process so the settings compare like for like. Needs a Hopper GPU (the route exists only
there).

    python bench/serving_schedule_sweep.py [--configs 1,256,16:2,256,16] [--repeats 10] [--json PATH]
"""
import argparse
import functools
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
import torch  # noqa: E402

import reference  # noqa: E402
import submission  # noqa: E402
import utils  # noqa: E402
from serving_peers import fp8_copy, kernel_times  # noqa: E402


def cases():
    out = [("C", batch, 1, 16, kv, False) for batch, kv in utils.benchmark_shapes()]
    out += [("B", 128, s_q, 16, s_k, True) for s_q in (1, 2) for s_k in (4096, 16384)]
    return out + [("A", 128, 1, 128, 4096, True)]


def time_settings(case, cache8, scale8, s_q, configs, row, flush, repeats):
    """Median kernel time of the case under each setting (a fresh plan each)."""
    times = []
    for waves, min_chunk, max_splits in configs:
        row["params"].update(waves=waves, min_chunk=min_chunk)
        submission.SERVING_MAX_SPLITS = max_splits
        plan = submission.get_mla_decode_metadata()[0]
        call = functools.partial(submission.mla_decode_with_kvcache, case.q, cache8, case.block_table,
                                 case.cache_seqlens, 512, plan, causal=s_q > 1, k_scale=scale8)
        call()
        torch.cuda.synchronize()
        if plan.route["route"] != "hopper_paged":
            raise SystemExit("the Hopper route does not serve this machine: nothing to sweep")
        times.append(kernel_times(call, repeats, flush)[0])
    return times


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="1,256,16:2,256,16:1,512,16:2,512,16",
                        help="waves,min_chunk,max_splits settings, colon-separated")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(":")]
    row = next(r for r in submission.SERVING_ROUTE_TABLE if r["route"] == "hopper_paged" and r["kv"] == "fp8")
    flush = utils.L2Flusher("default")
    results = []
    for grid, batch, s_q, h_q, s_k, varlen in cases():
        case = reference.generate_serving_input(batch, s_q, h_q, 64, s_k, 1, varlen=varlen, causal=s_q > 1,
                                                kv="bf16", device="cuda")
        cache8, scale8 = fp8_copy(case.k_cache)
        case.k_cache = None
        times = time_settings(case, cache8, scale8, s_q, configs, row, flush, args.repeats)
        results += [{"grid": grid, "batch": batch, "s_q": s_q, "h_q": h_q, "s_k": s_k, "waves": c[0],
                     "min_chunk": c[1], "max_splits": c[2], "median_us": t}
                    for c, t in zip(configs, times, strict=True)]
        print(f"{grid} b{batch:3d} sq{s_q} h{h_q:3d} sk{s_k:5d}: " + "  ".join(f"{t:7.1f}" for t in times), flush=True)
        torch.cuda.empty_cache()
    print("configs (waves, min_chunk, max_splits):", configs)
    for config in configs:
        mine = [r for r in results if (r["waves"], r["min_chunk"], r["max_splits"]) == config]
        geo = {g: statistics.geometric_mean([r["median_us"] for r in mine if r["grid"] in g])
               for g in ("ABC", "C", "B")}
        print(config, f"all {geo['ABC']:.1f}  C {geo['C']:.1f}  B {geo['B']:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

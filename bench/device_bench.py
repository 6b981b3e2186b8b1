"""The benchmark entry point (one device call): every provider on the 8 leaderboard shapes, checked
and timed like the runner; JSON and a PNG chart written, a short table printed last.

    python bench/device_bench.py [--spec specs/benchmarks.txt] [--out DIR] [--seeds 5] [--repeats 50]
                                 [--l2-flush default|runner]

Providers, measured in this run (the table `providers` builds per shape), each timed like the runner (synchronize, L2
flush, CUDA events around ONE call), median and mean:
- submission: custom_kernel, i.e. the row its route table picks for the shape; its accuracy on K
  secret-like seeds too: mismatch ratio against ref_kernel (the runner's check, rtol = atol = 0.1)
  and rel. L2 error against float64 attention over the bf16 cache, next to the reference's own;
- each of our routes available here (the Triton routes; the Gluon Hopper routes on sm_90) at that
  row's split count, defaults otherwise (the aiter routes only through custom_kernel);
- torch_peer: plain torch (bf16 bmm, softmax, bmm over the bf16 cache);
- read_once: a kernel that only reads the fp8 cache's bytes once (bench/read_floor.py): what
  reading the bytes costs under this flush (the runner's flush leaves dirty lines in the L2 that
  the timed call writes back).
Also per shape: floor = max(one launch, fp8 KV bytes / copy bandwidth measured in this run) and
achieved GB/s for the bytes each provider reads.

NOT measured in this run: FlashMLA and SGLang's Triton decode (EARLIER_PEERS), from an earlier
run on the lent H200. They are shown only when this device is an H200, marked with '*'.
"""
import argparse
import json
import math
import os
import random
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import reference  # noqa: E402
import submission  # noqa: E402
import utils  # noqa: E402
from bench.read_floor import cache_words, read_once  # noqa: E402

KV_BYTES_PER_TOKEN = {"bf16": 1152, "fp8": 576, "mxfp4": 306}
# One tiny kernel, event to event: 3.4 us on the lent H200 (torch 2.11, Triton 3.6, CUDA 13.0),
# measured 2026-11-29. Used only as the lower bound of the floor.
LAUNCH_FLOOR_US = 3.4

# Earlier run, NOT repeated by this script: the lent NVIDIA H200 on 2026-11-29 (torch 2.11.0+cu130,
# Triton 3.6.0, CUDA 13.0), CUDA events around one call, a 512 MiB buffer zeroed before each call,
# median of 50 calls, inputs as the leaderboard generates them. FlashMLA: DeepSeek's dense decode
# (CUDA, sm90a) over the bf16 cache in 64-token pages. SGLang: its grouped split-KV Triton decode
# for MLA over the fp8 cache (best split count of 4/8/16/32). Times in us.
EARLIER_PEERS = {
    "source": "not measured in this run: lent NVIDIA H200, 2026-11-29",
    "providers": ("flashmla_bf16", "sglang_triton_fp8"),
    "us": {(4, 1024): (16.0, 21.5), (4, 8192): (29.8, 51.6), (32, 1024): (24.9, 35.1),
           (32, 8192): (93.8, 166.8), (64, 1024): (37.1, 56.0), (64, 8192): (169.2, 312.7),
           (256, 1024): (93.1, 184.6), (256, 8192): (596.5, 1190.7)},
}


def torch_peer(data):
    q, kv_data, _, kv_indptr, config = data
    batch = q.shape[0]
    k = kv_data["bf16"].view(batch, -1, kv_data["bf16"].shape[-1])
    scores = torch.bmm(q, k.transpose(1, 2)).float() * config["sm_scale"]
    return torch.bmm(torch.softmax(scores, -1).bfloat16(), k[..., :512])


def providers(data, row):
    """The providers measured in this run for one shape, in table order:
    name -> (zero-argument call, KV format it reads, repeats divisor)."""
    split_params = {} if row["route"].startswith("aiter") else {"num_splits": row["params"].get("num_splits", 1)}
    table = {"submission": (lambda: submission.custom_kernel(data),
                            submission.ROUTE_INFO[row["route"]]["kv_format"], 1)}
    for name in submission.ROUTES:
        if not name.startswith("aiter"):
            table[name] = (lambda name=name: submission.ROUTES[name](*data, **split_params),
                           submission.ROUTE_INFO[name]["kv_format"], 1)
    words, word_max = cache_words(data[1]["fp8"][0]), torch.zeros(1, dtype=torch.int32, device=data[0].device)
    table["read_once"] = (lambda: read_once(words, word_max), "fp8", 1)
    table["torch_peer"] = (lambda: torch_peer(data), "bf16", 5)  # slow: a fifth of the repeats (at least 10)
    return table, split_params


def time_us(fn, flush, repeats):
    times = [utils.time_call(fn, flush=flush)[1] / 1e3 for _ in range(repeats)]
    return {"median_us": statistics.median(times), "mean_us": statistics.fmean(times),
            "err_us": statistics.stdev(times) / math.sqrt(len(times)), "runs": len(times)}


def accuracy(case, seeds):
    """Worst mismatch ratio and rel. L2 error of custom_kernel over `seeds` secret-like seeds."""
    rows = []
    for secret in seeds:
        data = reference.generate_input(**dict(case.args, seed=utils.combine_seed(case.args["seed"], secret)))
        out = submission.custom_kernel(data)
        expected = reference.ref_kernel(data)
        truth = reference.attention_float64(data)
        rows.append({"secret": secret, "mismatch": reference.mismatch_ratio(out, expected),
                     "rel_l2": reference.rel_l2_error(out, truth),
                     "ref_rel_l2": reference.rel_l2_error(expected, truth)})
        del data, out, expected, truth
    return {"worst_mismatch": max(r["mismatch"] for r in rows), "worst_rel_l2": max(r["rel_l2"] for r in rows),
            "worst_l2_ratio_to_ref": max(r["rel_l2"] / r["ref_rel_l2"] for r in rows), "seeds": rows}


def chart(rows, copy_gbps, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"bs{r['batch']}\nkv{r['kv_len']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.bar([i - 0.2 for i in x], [r["submission"]["GBps"] for r in rows], 0.4, label="submission (route's bytes)")
    ax.bar([i + 0.2 for i in x], [r["torch_peer"]["GBps"] for r in rows], 0.4, label="torch peer (bf16 bytes)")
    ax.axhline(copy_gbps, color="k", linestyle="--", label=f"copy ceiling {copy_gbps:.0f} GB/s")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("achieved GB/s")
    ax.set_title(f"MLA decode on {utils.device_name()}: bytes read per second")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def measure_shape(case, flush, copy_gbps, repeats):
    data = reference.generate_input(**case.args)
    batch, kv_len = case.args["batchsize"], case.args["kvseqlen"]
    submission.custom_kernel(data)  # warm-up: compile, caches
    row = submission.select_route(batch, kv_len)
    floor = max(LAUNCH_FLOOR_US, batch * kv_len * KV_BYTES_PER_TOKEN["fp8"] / copy_gbps / 1e3)
    result = {"batch": batch, "kv_len": kv_len, "route": submission.LAST_ROUTE, "floor_fp8_us": floor}
    table, split_params = providers(data, row)
    for name, (call, kv_format, divisor) in table.items():
        call()  # compile / warm before timing
        timing = time_us(call, flush, max(10, repeats // divisor) if divisor > 1 else repeats)
        timing["GBps"] = batch * kv_len * KV_BYTES_PER_TOKEN[kv_format] / timing["median_us"] / 1e3
        if name in submission.ROUTES:
            timing["params"] = split_params
        result[name] = timing
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", default=os.path.join(ROOT, "specs", "benchmarks.txt"))
    parser.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "results")))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--l2-flush", default="default", choices=("default", "runner"),
                        help="default: zero 512 MiB (fast; a slow host path shows in the means); "
                             "runner: the runner's 62.5 GiB randn (hides host time as the runner does)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    flush = utils.L2Flusher(args.l2_flush)
    copy_gbps = utils.copy_bandwidth()
    show_earlier = "H200" in utils.device_name()
    secrets = random.Random(0).sample(range(1, 2**31), args.seeds)
    rows = []
    for case in utils.read_spec_file(args.spec):
        result = measure_shape(case, flush, copy_gbps, args.repeats)
        flush.release()  # a runner flush's 62.5 GiB back to the device
        torch.cuda.empty_cache()  # the shape's inputs are gone; the accuracy seeds allocate their own
        result["accuracy"] = accuracy(case, secrets)
        earlier = EARLIER_PEERS["us"].get((result["batch"], result["kv_len"]))
        peers = dict(zip(EARLIER_PEERS["providers"], earlier or (None, None), strict=True))
        result["not_measured_in_this_run"] = {"source": EARLIER_PEERS["source"], **peers}
        rows.append(result)
        print(json.dumps(result), flush=True)
    summary = {"device": utils.device_name(), "copy_GBps": copy_gbps, "l2_flush": args.l2_flush, "rows": rows,
               "geomean_mean_us": utils.geomean([r["submission"]["mean_us"] for r in rows]),
               "geomean_floor_us": utils.geomean([r["floor_fp8_us"] for r in rows]),
               "geomean_read_once_us": utils.geomean([r["read_once"]["median_us"] for r in rows])}
    with open(os.path.join(args.out, "device_bench.json"), "w") as f:
        json.dump(summary, f, indent=1)
    chart(rows, copy_gbps, os.path.join(args.out, "device_bench.png"))

    print(f"\n{summary['device']}  copy {copy_gbps:.0f} GB/s  (times: median us, runner timing, "
          f"--l2-flush {args.l2_flush})")
    earlier_head = f" {'FlashMLA*':>9}" if show_earlier else ""
    print(f"{'bs':>4} {'kv':>5} {'ours':>8} {'mean':>8} {'floor':>6} {'x floor':>7} {'%copy':>6} {'read1':>6} "
          f"{'x read1':>7}{earlier_head} {'torch':>7} {'mism%':>6} {'L2':>6} {'L2/ref':>6}  route")
    for r in rows:
        s, a = r["submission"], r["accuracy"]
        flashmla = r["not_measured_in_this_run"]["flashmla_bf16"]
        earlier_cell = f" {flashmla or float('nan'):9.1f}" if show_earlier else ""
        print(f"{r['batch']:>4} {r['kv_len']:>5} {s['median_us']:8.1f} {s['mean_us']:8.1f} {r['floor_fp8_us']:6.1f} "
              f"{s['median_us'] / r['floor_fp8_us']:7.2f} {100 * s['GBps'] / copy_gbps:6.1f} "
              f"{r['read_once']['median_us']:6.1f} {s['median_us'] / r['read_once']['median_us']:7.2f}"
              f"{earlier_cell} {r['torch_peer']['median_us']:7.1f} "
              f"{100 * a['worst_mismatch']:6.2f} {a['worst_rel_l2']:6.3f} {a['worst_l2_ratio_to_ref']:6.2f}"
              f"  {r['route']}")
    line = (f"geomean of means: {summary['geomean_mean_us']:.1f} us (fp8 floor {summary['geomean_floor_us']:.1f}, "
            f"read once {summary['geomean_read_once_us']:.1f})")
    print(line)
    if show_earlier:
        flash = [r["not_measured_in_this_run"]["flashmla_bf16"] for r in rows]
        flash = [t for t in flash if t]
        if flash:
            print(f"* FlashMLA (bf16 KV): {EARLIER_PEERS['source']}; geomean {utils.geomean(flash):.1f} us")


if __name__ == "__main__":
    main()

"""One device call: check and time the submission and every route available here on the 8 leaderboard
shapes, beside the plain-torch peer; write JSON and a PNG chart; print a short table last.

    python bench/device_bench.py [--spec specs/benchmarks.txt] [--out DIR] [--seeds 5] [--repeats 50]
                                 [--l2-flush default|runner]

Per shape:
- custom_kernel (the row its route table picks) and each of our own routes available here (Triton;
  the Gluon Hopper route on sm_90) at that row's split count, with its defaults otherwise,
  timed like the runner (synchronize, L2 flush, CUDA events around ONE call), median and mean;
- accuracy of custom_kernel on K secret-like seeds: mismatch ratio against ref_kernel (the runner's
  check, rtol = atol = 0.1) and rel. L2 error against float64 attention over the bf16 cache, next to
  the reference's own rel. L2 error on the same inputs;
- the torch peer (bf16 bmm, softmax, bmm over the bf16 cache) timed the same way;
- floor = max(one launch, KV bytes / measured copy bandwidth); achieved GB/s for the bytes the
  route reads; FlashMLA's and SGLang's H200 times from ../shared/facts/h200-anchors.md as peers;
- read once: a kernel that only reads the fp8 cache's bytes once (bench/read_floor.py), timed the
  same way: what reading the bytes costs under this flush (the runner's leaves dirty lines in the
  L2 that the timed call writes back: bench/flush_probe.py).
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
sys.path.insert(0, os.path.join(ROOT, "bench"))
import reference  # noqa: E402
import submission  # noqa: E402
import utils  # noqa: E402
from read_floor import cache_words, read_once  # noqa: E402

KV_BYTES_PER_TOKEN = {"bf16": 1152, "fp8": 576, "mxfp4": 306}
LAUNCH_FLOOR_US = 3.4  # one tiny kernel, event to event, on the lent H200 (h200-anchors.md)
# h200-anchors.md, measured 2026-11-29 on the lent H200: (batch, kv) -> (FlashMLA bf16, SGLang fp8) us
H200_PEERS = {(4, 1024): (16.0, 21.5), (4, 8192): (29.8, 51.6), (32, 1024): (24.9, 35.1),
              (32, 8192): (93.8, 166.8), (64, 1024): (37.1, 56.0), (64, 8192): (169.2, 312.7),
              (256, 1024): (93.1, 184.6), (256, 8192): (596.5, 1190.7)}


def torch_peer(data):
    q, kv_data, _, kv_indptr, config = data
    batch = q.shape[0]
    k = kv_data["bf16"].view(batch, -1, kv_data["bf16"].shape[-1])
    scores = torch.bmm(q, k.transpose(1, 2)).float() * config["sm_scale"]
    return torch.bmm(torch.softmax(scores, -1).bfloat16(), k[..., :512])


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
    secrets = random.Random(0).sample(range(1, 2**31), args.seeds)
    rows = []
    for case in utils.read_spec_file(args.spec):
        data = reference.generate_input(**case.args)
        batch, kv_len = case.args["batchsize"], case.args["kvseqlen"]
        submission.custom_kernel(data)  # warm-up: compile, caches
        route_label = submission.LAST_ROUTE
        row = submission.select_route(batch, kv_len)
        fmt = submission.ROUTE_INFO[row["route"]]["kv_format"]
        kv_bytes = batch * kv_len * KV_BYTES_PER_TOKEN[fmt]
        floor = max(LAUNCH_FLOOR_US, batch * kv_len * KV_BYTES_PER_TOKEN["fp8"] / copy_gbps / 1e3)
        result = {"batch": batch, "kv_len": kv_len, "route": route_label, "floor_fp8_us": floor}
        result["submission"] = time_us(lambda: submission.custom_kernel(data), flush, args.repeats)
        result["submission"]["GBps"] = kv_bytes / result["submission"]["median_us"] / 1e3
        for name in [r for r in submission.ROUTES if not r.startswith("aiter")]:
            params = {} if row["route"].startswith("aiter") else {"num_splits": row["params"].get("num_splits", 1)}
            submission.ROUTES[name](*data, **params)
            result[name] = time_us(lambda: submission.ROUTES[name](*data, **params), flush, args.repeats)
            result[name]["params"] = params
        words, word_max = cache_words(data[1]["fp8"][0]), torch.zeros(1, dtype=torch.int32, device=data[0].device)
        read_once(words, word_max)
        result["read_once"] = time_us(lambda: read_once(words, word_max), flush, args.repeats)
        torch_peer(data)
        result["torch_peer"] = time_us(lambda: torch_peer(data), flush, max(10, args.repeats // 5))
        result["torch_peer"]["GBps"] = batch * kv_len * 1152 / result["torch_peer"]["median_us"] / 1e3
        data = None  # free the inputs before the accuracy seeds allocate theirs
        torch.cuda.empty_cache()
        result["accuracy"] = accuracy(case, secrets)
        result["flashmla_us"], result["sglang_fp8_us"] = H200_PEERS.get((batch, kv_len), (None, None))
        rows.append(result)
        print(json.dumps(result), flush=True)
    summary = {"device": utils.device_name(), "copy_GBps": copy_gbps, "rows": rows,
               "geomean_mean_us": utils.geomean([r["submission"]["mean_us"] for r in rows]),
               "geomean_floor_us": utils.geomean([r["floor_fp8_us"] for r in rows]),
               "geomean_read_once_us": utils.geomean([r["read_once"]["median_us"] for r in rows])}
    json.dump(summary, open(os.path.join(args.out, "device_bench.json"), "w"), indent=1)
    chart(rows, copy_gbps, os.path.join(args.out, "device_bench.png"))

    print(f"\n{summary['device']}  copy {copy_gbps:.0f} GB/s  (times: median us, runner timing)")
    print(f"{'bs':>4} {'kv':>5} {'ours':>8} {'mean':>8} {'floor':>6} {'x floor':>7} {'%copy':>6} {'read1':>6} "
          f"{'x read1':>7} {'FlashMLA':>8} {'torch':>7} {'mism%':>6} {'L2':>6} {'L2/ref':>6}  route")
    for r in rows:
        s, a = r["submission"], r["accuracy"]
        print(f"{r['batch']:>4} {r['kv_len']:>5} {s['median_us']:8.1f} {s['mean_us']:8.1f} {r['floor_fp8_us']:6.1f} "
              f"{s['median_us'] / r['floor_fp8_us']:7.2f} {100 * s['GBps'] / copy_gbps:6.1f} "
              f"{r['read_once']['median_us']:6.1f} {s['median_us'] / r['read_once']['median_us']:7.2f} "
              f"{r['flashmla_us'] or float('nan'):8.1f} {r['torch_peer']['median_us']:7.1f} "
              f"{100 * a['worst_mismatch']:6.2f} {a['worst_rel_l2']:6.3f} {a['worst_l2_ratio_to_ref']:6.2f}  {r['route']}")
    flash = [r["flashmla_us"] for r in rows if r["flashmla_us"]]
    print(f"geomean of means: {summary['geomean_mean_us']:.1f} us (fp8 floor {summary['geomean_floor_us']:.1f}, "
          f"read once {summary['geomean_read_once_us']:.1f}, FlashMLA {utils.geomean(flash):.1f})")


if __name__ == "__main__":
    main()

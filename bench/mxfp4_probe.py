"""One device call (an sm_90 GPU): checks and times submission.hopper_mxfp4_route, the Hopper kernel
reading the MXFP4 cache (306 B per token) and decoding each tile to fp8 in shared memory.

Checks (each output against three references):
  - the decode is exact: rel. L2 against float64 attention over the DEQUANTISED mxfp4 cache (the
    format's own truth) within 1.25x the fp8 route's error against the fp8 cache's truth (the
    kernel then does the fp8 route's arithmetic on exact values: a wrong nibble, sign or block
    exponent shows here at once);
  - the leaderboard check: mismatch ratio against the reference <= 1% (issue #5);
  - against float64 attention over the bf16 cache: within the route's declared bound (0.2);
  - two calls bit-identical, not zero; variable lengths; caches scaled by 2^10 and 2^-10 (the
    kernel's exponent shift from the fp8 scale) and by 1000.
Then times, like the runner (its 62.5 GiB flush before each call, CUDA events around one call),
per leaderboard shape: the table's hopper_fp8 row and hopper_mxfp4 at a grid of split counts and
ring depths; short table last.

    python bench/mxfp4_probe.py [--repeats 25] [--l2-flush runner] [--no-time]
"""
import argparse
import itertools
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import reference  # noqa: E402
import submission  # noqa: E402
import utils  # noqa: E402

SHAPES = utils.benchmark_shapes()
CONFIGS = [dict(num_stages=2, num_warps=4), dict(num_stages=3, num_warps=4), dict(num_stages=2, num_warps=8)]


def with_cache(data, kv):
    """data with its KV cache replaced by kv (bf16), the fp8 and mxfp4 forms quantised from it."""
    q, _, qo_indptr, kv_indptr, config = data
    kv_data = {"bf16": kv, "fp8": reference.quantize_fp8(kv), "mxfp4": reference.quantize_mxfp4(kv)}
    return q, kv_data, qo_indptr, kv_indptr, config


def truth_over(data, values):
    """float64 attention over the cache's values replaced by `values` (float32, exact;
    attention_float64 reads whatever the "bf16" entry holds in float64)."""
    q, kv_data, qo_indptr, kv_indptr, config = data
    return reference.attention_float64((q, dict(kv_data, bf16=values), qo_indptr, kv_indptr, config))


def references(data, fp8_error_floor=0.0):
    """What every configuration run on one input is compared with, computed once: float64 attention
    over the dequantised mxfp4 cache (the format's truth) and over the bf16 cache, the reference's
    output, and the fp8 Hopper route's rel. L2 against float64 attention over the dequantised fp8
    cache (at least fp8_error_floor)."""
    packed, scales = data[1]["mxfp4"]
    fp8, scale = data[1]["fp8"]
    fp8_error = reference.rel_l2_error(submission.hopper_fp8_route(*data, num_splits=4),
                                       truth_over(data, fp8.float() * scale))
    return {"mxfp4_truth": truth_over(data, reference.dequantize_mxfp4(packed, scales, packed.shape[0])),
            "bf16_truth": reference.attention_float64(data), "expected": reference.ref_kernel(data),
            "fp8_error": max(fp8_error, fp8_error_floor)}


def check(data, refs, label, splits, cfg, leaderboard_like=True):
    """One configuration against references(data): returns (ok, line). The mismatch bound (1%,
    against the fp8 reference) holds for leaderboard-like inputs only: at a few KV tokens the output
    is a few cache rows, and the mxfp4 format's own error (~11% per row) is what the loose check
    then sees."""
    out = submission.hopper_mxfp4_route(*data, num_splits=splits, **cfg)
    again = submission.hopper_mxfp4_route(*data, num_splits=splits, **cfg)
    exact_l2 = reference.rel_l2_error(out, refs["mxfp4_truth"])
    l2 = reference.rel_l2_error(out, refs["bf16_truth"])
    mm = reference.mismatch_ratio(out, refs["expected"])
    same = torch.equal(out, again)
    fp8_error = refs["fp8_error"]
    ok = (exact_l2 <= 1.25 * fp8_error and (mm <= 0.01 or not leaderboard_like) and same
          and (l2 <= submission.ROUTE_INFO["hopper_mxfp4"]["rel_l2_bound"] or not leaderboard_like)
          and out.float().abs().sum() > 0)
    return ok, (f"{label} splits{splits} {cfg}: rel_l2 vs mxfp4 truth {exact_l2:.4f} (fp8 route vs fp8 truth "
                f"{fp8_error:.4f}), vs bf16 truth {l2:.4f}, mismatch {mm:.4f}, repeat-equal {same} "
                f"{'ok' if ok else 'FAIL'}")


def run_checks():
    bad = 0
    for (batch, kv), seed in itertools.product([(4, 1024), (32, 1024), (64, 8192), (256, 1024)], (12,)):
        data = reference.generate_input(batch, 1, kv, seed)
        refs = references(data)
        for splits, cfg in itertools.product((1, 4, 8, 32), CONFIGS):
            ok, line = check(data, refs, f"bs{batch} kv{kv}", splits, cfg)
            bad += not ok
            if not ok or splits == 4:
                print(line, flush=True)
        del data, refs
    for lens in ([1, 63, 64, 65, 300, 1000, 2049], [7], [4096, 1, 130]):
        data = reference.generate_input(len(lens), 1, max(lens), 5, kv_lens=lens)
        refs = references(data, fp8_error_floor=0.03)
        for splits, cfg in itertools.product((1, 3, 8), CONFIGS[:2]):
            ok, line = check(data, refs, f"lens {lens}", splits, cfg, leaderboard_like=False)
            bad += not ok
            if not ok or splits == 3:
                print(line, flush=True)
    base = reference.generate_input(8, 1, 1024, 21)
    for factor in (2.0 ** 10, 2.0 ** -10, 1000.0, 1e-3):
        # q / factor keeps the scores (and the softmax's sharpness) as they were; the output scales
        data = with_cache(base, (base[1]["bf16"].float() * factor).to(torch.bfloat16))
        data = ((base[0].float() / factor).to(torch.bfloat16),) + data[1:]
        # not leaderboard-like: x1000 outputs meet rtol 0.1 with the format's ~11% error, atol no help
        ok, line = check(data, references(data, fp8_error_floor=0.03), f"cache x {factor:g}", 4, CONFIGS[0],
                         leaderboard_like=False)
        bad += not ok
        print(line, flush=True)
    return bad


def run_timing(repeats, flush, eight_warps=((64, 8192), (256, 8192))):
    rows = []
    for batch, kv in SHAPES:
        data = reference.generate_input(batch, 1, kv, 7)
        row = submission.select_route(batch, kv, True, submission.TRITON_ROUTE_TABLE)
        times = {}
        if row["route"] in ("hopper_fp8", "hopper_mxfp4"):
            times[f"table: {row['route']} {row['params']}"] = utils.median_time_us(
                lambda: submission.ROUTES[row["route"]](*data, **row["params"]), repeats, flush)
        base_splits = row["params"].get("num_splits", 1)
        grid = list(itertools.product(sorted({max(1, base_splits // 2), base_splits, base_splits * 2}), (2, 3), (4,)))
        if (batch, kv) in eight_warps:  # two warpgroups share each tile's decode (one program per SM)
            grid += [(base_splits, 2, 8), (base_splits * 2, 2, 8)]
        for splits, stages, warps in grid:
            params = dict(num_splits=splits, num_stages=stages, num_warps=warps)
            times[f"hopper_mxfp4 {params}"] = utils.median_time_us(
                lambda: submission.hopper_mxfp4_route(*data, **params), repeats, flush)  # noqa: B023
        best = min((v, k) for k, v in times.items() if k.startswith("hopper_mxfp4"))
        table = next((v for k, v in times.items() if k.startswith("table")), float("nan"))
        rows.append((batch, kv, table, best[0], best[1]))
        print(f"bs{batch} kv{kv}: " + "; ".join(f"{k} {v:.1f}" for k, v in times.items()), flush=True)
    print("\n| bs | kv | table route us | best hopper_mxfp4 us | ratio | best config |")
    print("|---|---|---|---|---|---|")
    for batch, kv, table, best, name in rows:
        print(f"| {batch} | {kv} | {table:.1f} | {best:.1f} | {best / table:.2f} | {name} |")
    print(f"geomean: table {utils.geomean([r[2] for r in rows]):.1f} us, best mxfp4 "
          f"{utils.geomean([r[3] for r in rows]):.1f} us, best of both "
          f"{utils.geomean([min(r[2], r[3]) for r in rows]):.1f} us")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--l2-flush", default="runner", choices=utils.L2Flusher.MODES)
    parser.add_argument("--no-time", action="store_true")
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args()
    t0 = time.time()
    bad = 0 if args.no_check else run_checks()
    print(f"checks: {bad} failing, {time.time() - t0:.0f} s", flush=True)
    if not args.no_time:
        run_timing(args.repeats, utils.L2Flusher(args.l2_flush))


if __name__ == "__main__":
    main()

"""Each provider's time on a grid cut into a fixed part and a part per token, from serving_peers.py's
output: a least-squares line through its times over the batch's tokens, per grid row (grid, batch,
s_q, h_q, long request) and provider.

    python lab/profile/length_fit.py RESULTS.txt|RESULTS.json [...] [--time gpu|event] [--kernel LABEL]

The slope is the steady state: the cache's bytes over it (576 a token for an fp8 cache, 1152 for
bf16) against the copy ceiling, its FLOPs (2 x s_q x h_q x (576 + 512) a token) against the MMA's
rate. The line at zero tokens is what a call costs whatever its lengths: launches, q, epilogues,
merges, the last wave's tail. Each request's length is recomputed as serving_peers.py drew it
(reference.serving_lengths, seed 1), or read from a JSON's rows. Beside each provider, where
FlashMLA ran the same row: FlashMLA's fixed part and slope over this one's (> 1: this one's is
smaller). A row with fewer than two lengths is left out. --kernel fits one kernel's part of the GPU
time (serving_peers.py's per-kernel medians; 0 where a call did not launch it), for instance ours
without the combine.
"""
import argparse
import json
import math
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path.insert(0, ROOT)
import reference  # noqa: E402

PEER = "FlashMLA bf16"
FLOPS_PER_ROW_TOKEN = 2 * (576 + 512)  # S over 576 dims, P.V over 512
LINE = re.compile(r"^(?P<grid>[A-Z]) b(?P<batch>\d+) s_q(?P<s_q>\d+) h(?P<h_q>\d+) s_k(?P<s_k>\d+)"
                  r"(?: long(?P<long>\d+))? (?P<provider>.+?)\s+(?P<event>[\d.]+) us \(mean\s+[\d.]+\) "
                  r"gpu\s+(?P<gpu>\S+).*?(?:\[(?P<kernels>[^]]*)\])?$")


def case_tokens(grid, batch, s_q, s_k, long):
    """The batch's tokens in serving_peers.py's case: FlashMLA's varied lengths on grids A and B,
    uniform elsewhere, seed 1."""
    return sum(reference.serving_lengths(batch, s_q, s_k, 1, varlen=grid in "AB", zeros=0, long=long))


def read_rows(path):
    """serving_peers.py's rows from its printed output or its --json file: dicts with grid, batch,
    s_q, h_q, s_k, long, provider, tokens, event and gpu time (us)."""
    with open(path) as f:
        if path.endswith(".json"):
            return [{**{k: r[k] for k in ("grid", "batch", "s_q", "h_q", "s_k", "long", "provider", "tokens")},
                     "event": r["median_us"], "gpu": r["gpu_us"], "kernels": r.get("kernels_us", {})}
                    for r in json.load(f)["rows"]]
        rows = []
        for line in f:
            match = LINE.match(line)
            if match:
                row = {k: int(match[k] or 0) for k in ("batch", "s_q", "h_q", "s_k", "long")}
                parts = (part.rsplit(" ", 1) for part in (match["kernels"] or "").split(" + ") if part)
                row.update(grid=match["grid"], provider=match["provider"], event=float(match["event"]),
                           gpu=float(match["gpu"]), kernels={name: float(us) for name, us in parts})
                row["tokens"] = case_tokens(row["grid"], row["batch"], row["s_q"], row["s_k"], row["long"])
                rows.append(row)
        return rows


def fit_line(xs, ys):
    """(intercept, slope, largest residual) of the least-squares line y = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    fixed = my - slope * mx
    return fixed, slope, max(abs(y - fixed - slope * x) for x, y in zip(xs, ys, strict=True))


def _share(part, whole):
    return part / whole if whole > 0 else math.nan


def fits(rows, key="gpu", kernel=None):
    """{(grid, batch, s_q, h_q, long): {provider: fit}}, a fit a dict of fixed (us), slope (us a
    token), rates of the slope (TB/s of cache bytes, TFLOPS), the fixed part's share of the
    shortest and the longest case, the largest residual's share of its time, and the points.
    kernel: that kernel's part of the time instead (rows that name their kernels only)."""
    groups = {}
    for row in rows:
        value = row[key] if kernel is None else row["kernels"].get(kernel, 0.0) if row.get("kernels") else math.nan
        if value == value:  # NaN: a time the run could not take
            group = groups.setdefault((row["grid"], row["batch"], row["s_q"], row["h_q"], row["long"]), {})
            group.setdefault(row["provider"], {})[row["tokens"]] = value  # a repeated case: the last
    result = {}
    for (grid, batch, s_q, h_q, long), providers in groups.items():
        for provider, points in providers.items():
            if len(points) < 2 or not any(points.values()):  # one length, or a kernel it never launched
                continue
            xs = sorted(points)
            ys = [points[x] for x in xs]
            fixed, slope, worst = fit_line(xs, ys)
            token_bytes = 576 if "fp8" in provider.split() else 1152
            rate = 1 / slope / 1e6 if slope > 0 else math.nan  # tokens a us, in millions
            result.setdefault((grid, batch, s_q, h_q, long), {})[provider] = {
                "fixed_us": fixed, "us_per_mtok": slope * 1e6,
                "tb_s": token_bytes * rate, "tflops": FLOPS_PER_ROW_TOKEN * s_q * h_q * rate,
                "fixed_share": (_share(fixed, ys[0]), _share(fixed, ys[-1])), "worst_residual": _share(worst, min(ys)),
                "points": len(xs)}
    return result


def report(result):
    """The fits as text, a block per grid row."""
    lines = []
    for (grid, batch, s_q, h_q, long), providers in sorted(result.items()):
        lines.append(f"grid {grid} b{batch} s_q{s_q} h{h_q}" + (f" long{long}" if long else ""))
        lines.append(f"  {'provider':14s} {'fixed us':>9s} {'us/Mtok':>9s} {'TB/s':>6s} {'TFLOPS':>7s} "
                     f"{'fixed share':>12s} {'resid':>6s}  FlashMLA / this: fixed, slope")
        peer = providers.get(PEER)
        for provider, fit in sorted(providers.items()):
            versus = ""
            if peer and provider != PEER:
                fixed = f"{peer['fixed_us'] / fit['fixed_us']:.2f}x" if fit["fixed_us"] > 0 else "-"
                versus = f"  {fixed}, {peer['us_per_mtok'] / fit['us_per_mtok']:.2f}x"
            lines.append(f"  {provider:14s} {fit['fixed_us']:9.1f} {fit['us_per_mtok']:9.1f} {fit['tb_s']:6.2f} "
                         f"{fit['tflops']:7.0f} {fit['fixed_share'][0]:5.0%} -{fit['fixed_share'][1]:4.0%} "
                         f"{fit['worst_residual']:6.1%}{versus}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("results", nargs="+", help="serving_peers.py's printed output or --json files")
    parser.add_argument("--time", choices=("gpu", "event"), default="gpu",
                        help="profiler kernel time (default) or event time")
    parser.add_argument("--kernel", default=None, help="fit this kernel's part of the GPU time (its label)")
    args = parser.parse_args()
    rows = [row for path in args.results for row in read_rows(path)]
    print(report(fits(rows, args.time, args.kernel)))


if __name__ == "__main__":
    main()

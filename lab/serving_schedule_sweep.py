"""The Hopper serving route's row configurations and schedule knobs on FlashMLA's benchmark inputs
(lab/NOTES.md h38b).

For each case and each setting, the kernel time of mla_decode_with_kvcache (L2 flushed before each
call, CUDA events, median of --repeats), all in one process so the settings compare like for like.
A setting is a row configuration (--rows: query rows per program, num_warps, num_stages; "table":
what SERVING_ROUTE_TABLE picks for the case's shape) crossed with a schedule (--configs: the
hopper_paged row's waves and min_chunk, and SERVING_MAX_SPLITS); each is forced as a hopper_paged
row ahead of the table, with a fresh plan. Every setting's out and lse are compared with the first
setting's on the same inputs (rel. L2 of out over the attended rows, max |lse| difference; "!" past
0.1: a configuration computing something else; with an fp8 cache another row count quantises q
over other rows, which alone differs by about the fp8 rounding of q). Needs a Hopper GPU (the route
exists only there).

Cases (128 requests, lengths normal around s_k with spread s_k / 2, pages of --page tokens: 64, or
below 64 the gathered kernel, lab/NOTES.md h48; causal for s_q 2): grid A: 128 heads, s_q 1 and 2,
each --s-k; grid B: 16 heads, the same; grid C: the leaderboard's 8 uniform shapes (16 heads,
s_q 1) as a paged cache.

    python lab/serving_schedule_sweep.py [--rows table:16,4,2:32,8,3] [--configs 1,256,16,0:1,256,16,1]
                                           [--grids A,B,C] [--s-k 4096,16384] [--kv fp8|bf16]
                                           [--page 64] [--repeats 10] [--json PATH]
e.g. the 32-row row against the 16-row one on grids A and B:
    python lab/serving_schedule_sweep.py --rows 16,4,2:32,8,2:32,8,3 --configs 1,256,16 --grids A,B
"""
import argparse
import functools
import itertools
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

TABLE = submission.SERVING_ROUTE_TABLE  # as the module defines it (each setting puts a row ahead of it)


def cases(grids, s_ks):
    """(grid, batch, s_q, h_q, mean s_k, varlen) of each requested grid."""
    out = []
    for grid, h_q in (("A", 128), ("B", 16)):
        if grid in grids:
            out += [(grid, 128, s_q, h_q, s_k, True) for s_q in (1, 2) for s_k in s_ks]
    if "C" in grids:
        out += [("C", batch, 1, 16, kv, False) for batch, kv in utils.benchmark_shapes()]
    return out


def parse_rows(text):
    """'table:16,4,2:32,4,2,1' -> [None, (16, 4, 2), (32, 4, 2, 1)] (None: the table's own row; a
    fourth field: 1 P.V in f16 (the row's pv_f16), 0 fp8 hi and lo; a fifth: 1 the row max and
    rescale factors through shared memory (the row's shared_max), 0 not)."""
    return [None if spec == "table" else tuple(int(v) for v in spec.split(",")) for spec in text.split(":")]


def row_label(row_config):
    if row_config is None:
        return "table"
    label = "r{}w{}s{}".format(*row_config)
    if len(row_config) > 3:  # P.V in f16, or fp8 hi and lo
        label += "f" if row_config[3] else "h"
    if len(row_config) > 4 and row_config[4]:  # shared max
        label += "x"
    return label


def forced_row(shape, row_config, schedule):
    """The hopper_paged row a setting puts ahead of the table for a plan of this shape."""
    kv = shape[4]
    base = submission.serving_route_row(shape, TABLE)
    if base["route"] != "hopper_paged":
        raise SystemExit("the Hopper route does not serve this machine or shape: nothing to sweep")
    params = dict(base["params"])
    if row_config is not None:
        params.update(rows=row_config[0], num_warps=row_config[1], num_stages=row_config[2])
        if len(row_config) > 3:
            params.update(pv_f16=bool(row_config[3]))
        if len(row_config) > 4:
            params.update(shared_max=bool(row_config[4]))
    params.update(waves=schedule[0], min_chunk=schedule[1])
    if len(schedule) > 3:  # 1: the span schedule (one span of the batch's tiles per program), 0: chunks
        params.update(spans=bool(schedule[3]))
    return {"kv": kv, "pages": submission.SERVING_PAGE_SIZES, "route": "hopper_paged", "params": params}


def differences(out, lse, first_out, first_lse):
    """(rel. L2 of out over the rows that attend something, max |lse| difference there)."""
    attended = torch.isfinite(first_lse)
    rows = attended.permute(0, 2, 1)
    got, want = out[rows].double(), first_out[rows].double()
    rel = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    return rel, (lse[attended].double() - first_lse[attended].double()).abs().max().item()


def time_settings(case, cache, scale, s_q, settings, flush, repeats):
    """Per setting: (median kernel time, rel. L2 and lse differences against the first setting)."""
    results, first = [], None
    shape = (case.q.shape[0], s_q, case.q.shape[2], cache.shape[1], "fp8" if scale is not None else "bf16", s_q > 1)
    for row_config, schedule in settings:
        submission.SERVING_ROUTE_TABLE = [forced_row(shape, row_config, schedule)] + TABLE
        submission.SERVING_MAX_SPLITS = schedule[2]
        plan = submission.get_mla_decode_metadata()[0]
        call = functools.partial(submission.mla_decode_with_kvcache, case.q, cache, case.block_table,
                                 case.cache_seqlens, 512, plan, causal=s_q > 1, k_scale=scale)
        out, lse = call()
        torch.cuda.synchronize()
        first = first or (out, lse)
        results.append((kernel_times(call, repeats, flush)[0], *differences(out, lse, *first)))
    submission.SERVING_ROUTE_TABLE = TABLE
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="table",
                        help="row configurations rows,num_warps,num_stages[,pv_f16[,shared_max]] or 'table', "
                             "colon-separated")
    parser.add_argument("--configs", default="1,256,16:2,256,16:1,512,16:2,512,16",
                        help="waves,min_chunk,max_splits[,spans] settings, colon-separated (spans 1: the "
                             "row's 'spans' on: the kernel that chooses chunks or spans per call, where "
                             "takes_span_kernel launches it; 0: chunks only; absent: the table's)")
    parser.add_argument("--grids", default="A,B,C")
    parser.add_argument("--s-k", default="4096,16384", help="mean lengths of grids A and B, comma-separated")
    parser.add_argument("--kv", default="fp8", choices=("fp8", "bf16"),
                        help="the cache: FlashMLA's bf16 inputs, or their fp8 copy (per-tensor scale)")
    parser.add_argument("--page", type=int, default=64, help="page size (below 64: the gathered kernel)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    schedules = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(":")]
    settings = list(itertools.product(parse_rows(args.rows), schedules))
    labels = [f"{row_label(r)} {','.join(map(str, s))}" for r, s in settings]
    print("settings (rows, schedule waves,min_chunk,max_splits):", "  |  ".join(labels), flush=True)
    flush = utils.L2Flusher("default")
    results = []
    for grid, batch, s_q, h_q, s_k, varlen in cases(args.grids.split(","), [int(v) for v in args.s_k.split(",")]):
        case = reference.generate_serving_input(batch, s_q, h_q, args.page, s_k, 1, varlen=varlen, causal=s_q > 1,
                                                kv="bf16", device="cuda")
        cache, scale = (fp8_copy(case.k_cache) if args.kv == "fp8" else (case.k_cache, None))
        case.k_cache = None
        timed = time_settings(case, cache, scale, s_q, settings, flush, args.repeats)
        for (row_config, schedule), label, (median, rel, lse_diff) in zip(settings, labels, timed, strict=True):
            results.append({"grid": grid, "batch": batch, "s_q": s_q, "h_q": h_q, "s_k": s_k, "kv": args.kv,
                            "page": args.page,
                            "setting": label, "rows": row_config and row_config[0],
                            "num_warps": row_config and row_config[1], "num_stages": row_config and row_config[2],
                            "waves": schedule[0], "min_chunk": schedule[1], "max_splits": schedule[2],
                            "spans": schedule[3] if len(schedule) > 3 else None,
                            "median_us": median, "out_rel_l2_vs_first": rel, "lse_diff_vs_first": lse_diff})
        print(f"{grid} b{batch:3d} sq{s_q} h{h_q:3d} sk{s_k:5d}: "
              + "  ".join(f"{t:8.1f}{'!' if rel > 0.1 or lse > 0.1 else ''}" for t, rel, lse in timed), flush=True)
        del cache, case
        torch.cuda.empty_cache()
    for label in labels:
        mine = [r for r in results if r["setting"] == label]
        geo = {g: statistics.geometric_mean([r["median_us"] for r in mine if r["grid"] == g])
               for g in sorted({r["grid"] for r in mine})}
        worst = max(r["out_rel_l2_vs_first"] for r in mine)
        print(f"{label:24s} " + "  ".join(f"{g} {t:8.1f}" for g, t in geo.items())
              + f"  (geomean us; worst out rel. L2 vs the first setting {worst:.1e})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

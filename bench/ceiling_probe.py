"""How fast the Hopper kernel runs when HBM costs nothing: its compute ceiling per shape (sm_90).

For each shape's table row, times the route like the runner (L2 flushed, CUDA events around one
call): as it is; with TMA descriptors whose rows overlap (row stride 16 B instead of 576, so a call
touches total_kv x 16 B, which the L2 holds after the first tile: "L2-resident"); with row stride 0
(every token reads row 0); and with descriptors over only the first 64 rows (every later tile past
the tensor, TMA fills it with zeros: "out of bounds"). The kernel is otherwise unchanged (same grid,
same instructions). The L2-resident time approximates what the kernel's own work costs: a route that
reads fewer bytes with the same program structure (mxfp4: 306 B per token instead of 576) cannot
beat it by much.

    python bench/ceiling_probe.py [--shapes 4x1024,256x8192] [--repeats 30] [--l2-flush runner]
"""
import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import reference  # noqa: E402
import submission  # noqa: E402
import utils  # noqa: E402

# views of the (total_kv, 1, 576) fp8 cache that the descriptors are built over instead
VIEWS = {
    "L2-resident": lambda kv: kv.as_strided(kv.shape, (16, 576, 1)),
    "stride 0": lambda kv: kv.as_strided(kv.shape, (0, 576, 1)),
    "out of bounds": lambda kv: kv[:64],
}
SHAPES = ",".join(f"{batch}x{kv}" for batch, kv in utils.benchmark_shapes())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--l2-flush", default="runner", choices=utils.L2Flusher.MODES)
    args = parser.parse_args()
    flush = utils.L2Flusher(args.l2_flush)
    real_descriptors = submission.kv_descriptors
    copy_gbps = utils.copy_bandwidth()
    print(f"copy bandwidth {copy_gbps:.0f} GB/s; L2 flush {args.l2_flush}")
    rows = []
    for shape in args.shapes.split(","):
        batch, kv = map(int, shape.split("x"))
        data = reference.generate_input(batch, 1, kv, 11)
        row = submission.select_route(batch, kv, True, submission.TRITON_ROUTE_TABLE)
        assert row["route"] == "hopper_fp8", row
        call = lambda: submission.hopper_fp8_route(*data, **row["params"])  # noqa: E731
        assert reference.mismatch_ratio(call(), reference.ref_kernel(data)) <= 0.005, shape
        real = utils.median_time_us(call, args.repeats, flush)
        times = {}
        for name, view in VIEWS.items():
            submission._KV_DESCRIPTORS.clear()
            submission.kv_descriptors = lambda kv_fp8: real_descriptors(view(kv_fp8))  # noqa: B023
            try:
                times[name] = utils.median_time_us(call, args.repeats, flush)
            except Exception as error:  # a descriptor the driver refuses
                print(f"{name}: {type(error).__name__}: {str(error)[:200]}")
                times[name] = float("nan")
            finally:
                submission.kv_descriptors = real_descriptors
                submission._KV_DESCRIPTORS.clear()
        l2_resident = times["L2-resident"]
        fp8_floor = batch * kv * 576 / (copy_gbps * 1e3)
        mxfp4_floor = batch * kv * 306 / (copy_gbps * 1e3)
        rows.append((f"{batch}/{kv}", row["params"], real, l2_resident, fp8_floor, mxfp4_floor))
        print(f"{batch}/{kv}: as is {real:.1f}; " + "; ".join(f"{k} {v:.1f}" for k, v in times.items()), flush=True)
    print("\n| bs/kv | params | as is us | L2-resident us | fp8 copy floor | mxfp4 copy floor | "
          "mxfp4 bound: max(L2-resident, mxfp4 floor) |")
    print("|---|---|---|---|---|---|---|")
    for name, params, real, l2_resident, fp8_floor, mxfp4_floor in rows:
        print(f"| {name} | {params} | {real:.1f} | {l2_resident:.1f} | {fp8_floor:.1f} | {mxfp4_floor:.1f} | "
              f"{max(l2_resident, mxfp4_floor):.1f} |")
    print(f"geomean as is {utils.geomean([r[2] for r in rows]):.1f} us, "
          f"L2-resident {utils.geomean([r[3] for r in rows]):.1f} us, "
          f"mxfp4 bound {utils.geomean([max(r[3], r[5]) for r in rows]):.1f} us")


if __name__ == "__main__":
    main()

"""Where the seesaw kernel's time goes, per program and warpgroup (sm_90, one device call).

Builds an instrumented copy of submission.py (exact-text insertions, each asserted to match once,
so a kernel edit that moves a marker fails loudly here; lab/tests/test_seesaw_trace.py
compiles the result for sm_90 on the CPU). Each compute warpgroup of _mla_decode_seesaw_kernel
records %globaltimer at its start and end and %clock64 cycles spent per phase:
  q         a segment's q staged (_sw_stage_q and the wait for the other warpgroup's half)
  wait      the own tile's copy awaited (`loaded`)
  S         the own tile's scores (_sw_scores: issue and wait)
  max       the tile's maxima exchanged (masking, m_smem, the wait for the other warpgroup's)
  P         the running max, P, waiting for the P buffer, P stored and published
  P.V       the rest of the pair: the rescale, waiting for both P, both tiles' P.V, the slots and
            P's buffer released (the pair loop's whole time less the phases above, so that the
            markers do not depend on how the P.V and the releases are written)
  epilogue  a segment's row sums exchanged and its output, lse or partial stored
and the loader warp the cycles it waits for a free ring slot. The phases cover the warpgroup's
whole run but for the schedule at each segment's start (`other` in the table).

    python lab/profile/seesaw_trace.py [--cases 128x128x1x4096,...] [--kv fp8,bf16] [--uniform] [--repeats 10]

A case is BATCHxHEADSxS_QxMEAN_S_K (FlashMLA's benchmark lengths: normal around the mean, spread
half of it; --uniform: every request the mean), 64-token pages, causal for s_q > 1. Per case and
cache: event time (CUDA events around one call after an L2 flush) beside the uninstrumented
kernel's (the clocks cost registers: on sm_90 the pair loop's spill reloads rise from 7 to 14 for
fp8 and from 18 to 32 for bf16, so read the phases as shares), the kernel's span (first
warpgroup start to last end) and how late the last program starts; per warpgroup (medians over
programs that had work and over repeats) the time in each phase, per segment for q and the
epilogue, per pair of tiles for the loop's phases; segments and pairs per program; and the
loader's share of its time spent waiting for a free slot (high: the ring is full, the compute is
what limits); and when programs end against the live segments they ran (the median end per
count, and a line through them: the time a segment costs beyond its tiles, and the rest; lab/NOTES.md
h80's model of the fixed part). Checked first against float64 attention (rel. L2 of out).
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path.insert(0, ROOT)
import torch  # noqa: E402

import reference  # noqa: E402
import submission  # noqa: E402
import utils  # noqa: E402
from lab.profile.length_fit import fit_line  # noqa: E402
from lab.profile.trace_probe import insert, load_instrumented, median  # noqa: E402

SLOTS = 16  # int64 per (program, compute warpgroup) record
RECORDS = 1 << 16  # records in the buffer: enough for any grid the serving plans launch
PHASES = ["q", "wait", "S", "max", "P", "P.V", "epilogue"]  # in the table; P.V derived from "loop"
RECORDED = ["q", "wait", "S", "max", "P", "loop", "epilogue"]  # cycle slots 2-8: "loop" the pair loops' whole time
# slots: 0 start ns, 1 end ns, 2-8 RECORDED (cycles), 10 all cycles, 11 segments, 12 pairs,
# 13 live segments; in warpgroup 0's record 14 the loader's cycles waiting for a free slot, 15 its cycles

RECORD = "TRACE + ((gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)) * 2 + {WG}) * 16"

# (marker text in submission.py, text in its place); {S} a %globaltimer stamp, {C} a %clock64 read
INSERTIONS = [
    # the kernel takes the buffer after SPLIT_COUNTS; the launch passes TRACE_BUFFER there
    ("def _mla_decode_seesaw_kernel(\n    Q, lat_desc, rope_desc, KV_SCALE, CACHE_SEQLENS, BLOCK_TABLE, OUT, LSE, "
     "PARTIAL_O, PARTIAL_LSE, SPLIT_COUNTS,\n",
     "def _mla_decode_seesaw_kernel(\n    Q, lat_desc, rope_desc, KV_SCALE, CACHE_SEQLENS, BLOCK_TABLE, OUT, LSE, "
     "PARTIAL_O, PARTIAL_LSE, SPLIT_COUNTS, TRACE,\n"),
    ("            out, lse, partial_o, partial_lse, tickets)\n",
     "            out, lse, partial_o, partial_lse, tickets, TRACE_BUFFER)\n"),
    ('"PARTIAL_LSE": "*fp32", "SPLIT_COUNTS": "*i32", "sm_scale_log2": "fp32",',
     '"PARTIAL_LSE": "*fp32", "SPLIT_COUNTS": "*i32", "TRACE": "*i64", "sm_scale_log2": "fp32",'),
    ("KV_FP8, 0, SEGMENT_TILES)),\n", "KV_FP8, 0, SEGMENT_TILES, TRACE)),\n"),
    ("KV_FP8, 1, SEGMENT_TILES)),\n", "KV_FP8, 1, SEGMENT_TILES, TRACE)),\n"),
    ("                      SEGMENT_TILES))],\n", "                      SEGMENT_TILES, TRACE))],\n"),
    # the loader: cycles waiting for a free slot
    ("               BLOCK_N: gl.constexpr, SEGMENT_TILES: gl.constexpr):\n",
     "               BLOCK_N: gl.constexpr, SEGMENT_TILES: gl.constexpr, TRACE):\n"),
    ("    consumed = 0\n    for _segment in range(segments):\n",
     "    consumed = 0\n    l_start = {C}\n    l_free = l_start * 0\n    for _segment in range(segments):\n"),
    ("            mbarrier.wait(free.index(slot), ((g // STAGES) - 1) & 1, pred=g >= STAGES)\n",
     "            l0 = {C}\n            mbarrier.wait(free.index(slot), ((g // STAGES) - 1) & 1, pred=g >= STAGES)\n"
     "            l_free += {C} - l0\n"),
    ("        consumed += num_tiles\n        request += 1\n        tile_begin = tile_end\n\n\n@gluon.jit\n"
     "def _sw_stage_q(",
     "        consumed += num_tiles\n        request += 1\n        tile_begin = tile_end\n"
     "    gl.store(" + RECORD.format(WG=0) + " + 14, l_free)\n"
     "    gl.store(" + RECORD.format(WG=0) + " + 15, {C} - l_start)\n\n\n@gluon.jit\ndef _sw_stage_q("),
    # the compute warpgroups
    ("                WG: gl.constexpr, SEGMENT_TILES: gl.constexpr):\n",
     "                WG: gl.constexpr, SEGMENT_TILES: gl.constexpr, TRACE):\n"),
    ("    consumed = 0\n    pairs = 0\n    for segment in range(segments):\n",
     "    consumed = 0\n    pairs = 0\n    t_start = {S}\n    c_start = {C}\n"
     "    c_q = c_start * 0\n    c_wait = c_q\n    c_s = c_q\n    c_max = c_q\n    c_p = c_q\n    c_loop = c_q\n"
     "    c_epi = c_q\n    n_live = c_q\n"
     "    for segment in range(segments):\n"),
    ("        # q: the epilogue's `fin` of the segment before ordered both warpgroups' last S before this\n",
     "        c0 = {C}\n        n_live += live.to(gl.int64)\n"
     "        # q: the epilogue's `fin` of the segment before ordered both warpgroups' last S before this\n"),
    ("        mbarrier.wait(staged, segment & 1)\n",
     "        mbarrier.wait(staged, segment & 1)\n        c_q += {C} - c0\n"),
    ("            mbarrier.wait(loaded.index(slot_own), phase_first if WG == 0 else phase_second)\n"
     "            s = _sw_scores(kv_latent, kv_rope, q_latent, q_rope, slot_own, S_L)\n",
     "            c1 = {C}\n"
     "            mbarrier.wait(loaded.index(slot_own), phase_first if WG == 0 else phase_second)\n"
     "            c2 = {C}\n            c_wait += c2 - c1\n"
     "            s = _sw_scores(kv_latent, kv_rope, q_latent, q_rope, slot_own, S_L)\n"
     "            c3 = {C}\n            c_s += c3 - c2\n"),
    ("            mbarrier.wait(tile_max.index(1 - WG), phase)\n",
     "            mbarrier.wait(tile_max.index(1 - WG), phase)\n"
     "            c4 = {C}\n            c_max += c4 - c3\n"),
    ("            _sw_arrive(pub.index(WG))\n",
     "            _sw_arrive(pub.index(WG))\n            c5 = {C}\n            c_p += c5 - c4\n"),
    ("        for j in range(num_pairs):\n", "        c6 = {C}\n        for j in range(num_pairs):\n"),
    ("        pairs += num_pairs\n        consumed += num_tiles\n",
     "        c7 = {C}\n        c_loop += c7 - c6\n        pairs += num_pairs\n        consumed += num_tiles\n"),
    ("                      KV_FP8)\n        request += 1\n        tile_begin = tile_end\n",
     "                      KV_FP8)\n        request += 1\n        tile_begin = tile_end\n"
     "        c_epi += {C} - c7\n"
     "    c_end = {C}\n    record = " + RECORD.format(WG="WG") + "\n"
     "    gl.store(record, t_start)\n    gl.store(record + 1, {S})\n"
     "    gl.store(record + 2, c_q)\n    gl.store(record + 3, c_wait)\n    gl.store(record + 4, c_s)\n"
     "    gl.store(record + 5, c_max)\n    gl.store(record + 6, c_p)\n    gl.store(record + 7, c_loop)\n"
     "    gl.store(record + 8, c_epi)\n    gl.store(record + 10, c_end - c_start)\n"
     "    gl.store(record + 11, segments.to(gl.int64))\n    gl.store(record + 12, pairs.to(gl.int64))\n"
     "    gl.store(record + 13, n_live)\n"),
]


def instrumented_source(path):
    return insert(path, INSERTIONS, "lab/profile/seesaw_trace.py")


def summarise(trace):
    """Per (program, warpgroup) record that ran (its end stamp set) and had a live segment: its
    times in us (total, each phase, per segment for q and the epilogue, per pair for the loop's
    phases), and the loader's free-slot share from warpgroup 0's records. `trace` (records, SLOTS)
    float64 on the CPU."""
    ran = trace[:, 1] > 0
    live = ran & (trace[:, 13] > 0)
    rows = trace[live]
    ns_per_cycle = (rows[:, 1] - rows[:, 0]) / rows[:, 10].clamp(min=1)
    segments, pairs = rows[:, 13].clamp(min=1), rows[:, 12].clamp(min=1)
    us = {name: rows[:, 2 + k] * ns_per_cycle / 1e3 for k, name in enumerate(RECORDED)}
    total = (rows[:, 1] - rows[:, 0]) / 1e3
    out = {"total": total, "other": total - us["q"] - us["loop"] - us["epilogue"], "segments": rows[:, 13],
           "pairs": rows[:, 12]}
    us["P.V"] = us.pop("loop") - us["wait"] - us["S"] - us["max"] - us["P"]
    for name, value in us.items():
        if name in ("q", "epilogue"):
            out[name] = value / segments  # us a segment
        else:
            out[name] = value / pairs * 1e3  # ns a pair
        out[name + " (us)"] = value
    wg0 = trace[ran & (torch.arange(len(trace)) % 2 == 0) & (trace[:, 15] > 0)]
    out["loader free wait"] = wg0[:, 14] / wg0[:, 15]
    return out, float(trace[ran, 0].min()), float(trace[ran, 1].max()), float(trace[ran, 0].max())


def ends_by_segments(trace):
    """When programs end against how many live segments they ran (lab/NOTES.md h80's model: a time
    once, and a time a segment on top of the tiles, the same for every program of a span
    schedule): {segments: median end, us after the first program's start} over the records that
    ran a live segment, and the least-squares slope of end over segments (us a segment) with its
    value at 0 segments (us)."""
    ran = trace[:, 1] > 0
    rows = trace[ran & (trace[:, 13] > 0)]
    end = (rows[:, 1] - trace[ran, 0].min()) / 1e3
    segments = rows[:, 13]
    by_count = {int(n): float(end[segments == n].median()) for n in segments.unique().tolist()}
    if len(by_count) < 2:  # one count: no line
        return by_count, float("nan"), float("nan")
    at_zero, slope, _ = fit_line(segments.tolist(), end.tolist())
    return by_count, slope, at_zero


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="128x128x1x4096,128x128x1x16384,128x128x2x4096,128x128x1x256")
    parser.add_argument("--kv", default="fp8,bf16")
    parser.add_argument("--uniform", action="store_true", help="every request the mean length")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    module = load_instrumented(instrumented_source(os.path.join(ROOT, "submission.py")))
    module.TRACE_BUFFER = torch.zeros(RECORDS * SLOTS, dtype=torch.int64, device="cuda")
    flush = utils.L2Flusher("default")
    print("case kv | event us (the kernel without the probe's clocks) | span us | last start us | per warpgroup, "
          "median over programs: total us, other us, q / epilogue us a segment, the loop's phases ns a pair | "
          "segments, pairs | loader free wait")
    for case_text in args.cases.split(","):
        batch, heads, s_q, s_k = map(int, case_text.split("x"))
        for kv in args.kv.split(","):
            case = reference.generate_serving_input(batch, s_q, heads, 64, s_k, 1, varlen=not args.uniform,
                                                    causal=s_q > 1, kv=kv, device="cuda")
            plan, plain_plan = module.get_mla_decode_metadata()[0], submission.get_mla_decode_metadata()[0]

            def call(case=case, plan=plan, module=module):
                return module.mla_decode_with_kvcache(case.q, case.k_cache, case.block_table, case.cache_seqlens,
                                                      512, plan, causal=case.causal, k_scale=case.k_scale)
            out, _ = call()
            call(plan=plain_plan, module=submission)  # the uninstrumented kernel, compiled before it is timed
            assert plan.route["params"].get("seesaw"), f"{case_text} {kv}: not the seesaw's case: {plan.route}"
            exact, _ = reference.mla_decode_paged_float64(case.q, case.k_cache, case.block_table,
                                                          case.cache_seqlens, k_scale=case.k_scale,
                                                          causal=case.causal)
            rel = float((out.double() - exact).norm() / exact.norm())

            def plain_call(plan=plain_plan, call=call):
                return call(plan=plan, module=submission)
            events, plain, spans, late, stats, fits, by_count = [], [], [], [], {}, [], {}
            for _ in range(args.repeats):
                plain.append(utils.time_call(plain_call, flush=flush)[1] / 1e3)
                module.TRACE_BUFFER.zero_()
                events.append(utils.time_call(call, flush=flush)[1] / 1e3)
                trace = module.TRACE_BUFFER.view(RECORDS, SLOTS).cpu().double()
                per, begin, end, last = summarise(trace)
                counts, slope, at_zero = ends_by_segments(trace)
                fits.append((slope, at_zero))
                for n, value in counts.items():
                    by_count.setdefault(n, []).append(value)
                spans.append((end - begin) / 1e3)
                late.append((last - begin) / 1e3)
                for name, values in per.items():
                    stats.setdefault(name, []).extend(values.tolist())
            loop = ", ".join(f"{name} {median(stats[name]):.0f}" for name in PHASES[1:-1])
            print(f"{case_text} {kv} (rel {rel:.1e}) | {median(events):.1f} (plain {median(plain):.1f}) | "
                  f"{median(spans):.1f} | "
                  f"{median(late):.1f} | total {median(stats['total']):.1f}, other {median(stats['other']):.1f}, "
                  f"q {median(stats['q']):.2f}, epilogue {median(stats['epilogue']):.2f}; {loop} | "
                  f"{median(stats['segments']):.0f}, {median(stats['pairs']):.0f} | "
                  f"{median(stats['loader free wait']):.2f}", flush=True)
            print("    us a warpgroup, median: " + ", ".join(
                f"{name} {median(stats[name + ' (us)']):.1f}" for name in PHASES), flush=True)
            print("    end by live segments (us after the first start): " + ", ".join(
                f"{n}: {median(v):.1f}" for n, v in sorted(by_count.items())) + f"; a segment "
                f"{median([f[0] for f in fits]):.1f} us, at 0 segments {median([f[1] for f in fits]):.1f} us",
                flush=True)
            del case, out, exact
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Where the warp-specialised sparse kernel's time goes, per program and partition (sm_90, one device call).

Builds an instrumented copy of submission.py (exact-text insertions, each asserted to match once,
so a kernel edit that moves a marker fails loudly here; lab/tests/test_sparse_trace.py compiles
the result for sm_90 on the CPU). _mla_sparse_hopper_kernel runs a 1-D grid of persistent programs,
each a run of tiles: an outer loop over its pieces of units, an inner loop over a piece's tiles,
then the piece's epilogue. Each of its three partitions records %globaltimer once before and once
after its outer loop, %clock64 cycles spent per phase of a tile summed over all its pieces' tiles,
the outer loop's cycles and its tile count (g, the program's tile counter, at the end):
  warpgroup 0  ready    the bf16 tile awaited
               S        S's MMAs issued and awaited (and the next tile's entries read meanwhile)
               softmax  the online softmax, up to the running max and sum
               p_free   P's buffer awaited (warpgroup 1 done with the tile P_BUFS before)
               publish  P and its factors stored, fenced, published (p_ready)
               P.V      two spans: P made an operand, the accumulators rescaled and its P.V (dims
                        0-255) issued, before p_free; after publishing, the MMAs awaited, the tile
                        released
  warpgroup 1  p_ready  P awaited;  ready  the tile awaited;  P.V  its P.V (dims 256-511), releases
  producer     per half tile (32 rows):
               load     the half's loads issued and the next half's entries read
               free     the bf16 tile's release awaited (the first half only; about 0 for the others)
               dequant  the half's dequantisation (waiting for the loads' data), and per tile the
                        fence and `ready`
"other" (the loop's time less its phases) is the pieces' set-up, q staged, the epilogues (fin,
out / partials) and loop overhead.
Per case: event time (CUDA events around one call after an L2 flush) beside the uninstrumented
call's, the kernel's span (first loop start to last loop end) and, per partition, the median over
programs and repeats of each phase in ns a tile and of the loop's whole time a tile. Checked first
against float64 attention (the sparse check of bench/sparse_peers.py).

    python lab/profile/sparse_trace.py [--cases 128x64,128x128,64x64,2x64] [--repeats 10]

A case is BATCHxHEADS of FlashMLA's sparse benchmark (s_q 2, topk 2048, pages of 64, s_k 32768).
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import torch  # noqa: E402

import eval as harness  # noqa: E402
import reference  # noqa: E402
import submission  # noqa: E402
import utils  # noqa: E402
from lab.profile.trace_probe import insert, load_instrumented, median  # noqa: E402

SLOTS = 16  # int64 per (program, partition) record
RECORDS = 1 << 16  # records in the buffer: 3 a program
PHASES = {0: ["ready", "S", "softmax", "p_free", "publish", "P.V"], 1: ["p_ready", "ready", "P.V"],
          2: ["load", "free", "dequant"]}
NAMES = {0: "warpgroup 0", 1: "warpgroup 1", 2: "producer"}
# slots: 0 outer loop start ns, 1 its end ns, 2-7 the partition's phases (cycles over all its
# tiles, PHASES' order), 8 the outer loop's cycles, 10 tiles

# the record of program_id(0) (the grid is 1-D: num_programs(1) and (2) are 1), 3 partitions a program
RECORD = ("TRACE + ((gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)) * gl.num_programs(2)"
          " + gl.program_id(2)) * 48")


def _record(part):
    return RECORD + f" + {part * SLOTS}"


def _start(names):
    """Before the outer loop: its stamps, each phase's cycles zero (int32: a program's loop runs far
    fewer than 2^31 cycles, and half the registers of int64 spill less)."""
    return "    t_start = {S}\n    c_start = {C}\n" + "".join(f"    {name} = c_start.to(gl.int32) * 0\n"
                                                             for name in names)


def _store(part, cycles):
    """After the outer loop: its stamps, each phase's cycles, its cycles and the program's tiles (g)."""
    text = f"    record = {_record(part)}\n    gl.store(record, t_start)\n    gl.store(record + 1, {{S}})\n"
    for k, name in enumerate(cycles):
        text += f"    gl.store(record + {2 + k}, {name}.to(gl.int64))\n"
    return text + "    gl.store(record + 8, {C} - c_start)\n    gl.store(record + 10, g.to(gl.int64))\n"


W0 = ["w_ready", "w_s", "w_soft", "w_pfree", "w_pub", "w_pv"]
W1 = ["v_pready", "v_ready", "v_pv"]
PR = ["r_load", "r_free", "r_deq"]
UNITS = "    for u in range(first_unit, end_unit):\n"
I12, I16 = " " * 12, " " * 16  # the tile loop's body, the producer's half loop's


def _read(name, indent=I12):
    """A clock read into `name`."""
    return f"{indent}{name} = {{C}}\n"


def _add(phase, end, begin, indent=I12):
    """The cycles from clock read `begin` to `end` added to `phase`'s."""
    return f"{indent}{phase} += ({end} - {begin}).to(gl.int32)\n"


# (marker text in submission.py, text in its place); {S} a %globaltimer stamp, {C} a %clock64 read
INSERTIONS = [
    # the Hopper kernel takes the buffer after PARTIAL_LSE (its signature dict too); its launch
    # passes TRACE_BUFFER there; the portable kernel is untouched
    ("def _mla_sparse_hopper_kernel(\n"
     "    Q, KV8, KV32, KV16, INDICES, TOPK_LENGTH, OUT, LSE, PARTIAL_O, PARTIAL_LSE,\n",
     "def _mla_sparse_hopper_kernel(\n"
     "    Q, KV8, KV32, KV16, INDICES, TOPK_LENGTH, OUT, LSE, PARTIAL_O, PARTIAL_LSE, TRACE,\n"),
    ('       if kind.startswith("*") and name != "SPLIT_TICKETS"},\n    "sm_scale_log2": "fp32",',
     '       if kind.startswith("*") and name != "SPLIT_TICKETS"},\n    "TRACE": "*i64",\n'
     '    "sm_scale_log2": "fp32",'),
    ("        launch(_mla_sparse_hopper_kernel, (plan.num_splits,), tensors,\n",
     "        launch(_mla_sparse_hopper_kernel, (plan.num_splits,), (*tensors, TRACE_BUFFER),\n"),
    # each partition takes TRACE last
    ("stride_o_head, stride_lse_head, HAS_TOPK_LENGTH, BLOCK_N, PAGE_SIZE, STAGES)),\n"
     "        (_sparse_ws_second, (smem, bars, io, schedule, query_ins, num_heads, stride_o_head, HAS_TOPK_LENGTH,\n"
     "                             BLOCK_N, STAGES)),\n",
     "stride_o_head, stride_lse_head, HAS_TOPK_LENGTH, BLOCK_N, PAGE_SIZE, STAGES, TRACE)),\n"
     "        (_sparse_ws_second, (smem, bars, io, schedule, query_ins, num_heads, stride_o_head, HAS_TOPK_LENGTH,\n"
     "                             BLOCK_N, STAGES, TRACE)),\n"),
    ("                               HAS_TOPK_LENGTH, STAGES, BLOCK_N, PAGE_SIZE))],\n        [4, 4], [168, 96])\n",
     "                               HAS_TOPK_LENGTH, STAGES, BLOCK_N, PAGE_SIZE, TRACE))],\n"
     "        [4, 4], [168, 96])\n"),
    # warpgroup 0: c0 ready c1 S c2 softmax c3 P.V issued c4 p_free c5 publish c6 P.V awaited, released
    ("                    stride_lse_head, HAS_TOPK_LENGTH: gl.constexpr, BLOCK_N: gl.constexpr,\n"
     "                    PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr):\n",
     "                    stride_lse_head, HAS_TOPK_LENGTH: gl.constexpr, BLOCK_N: gl.constexpr,\n"
     "                    PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr, TRACE):\n"),
    ("    g = 0\n    k = 0\n" + UNITS + "        whole, slot, entries, rows, group, poison = ",
     "    g = 0\n    k = 0\n" + _start(W0) + UNITS + "        whole, slot, entries, rows, group, poison = "),
    ("            buf = g % STAGES\n            mbarrier.wait(ready.index(buf), (g // STAGES) & 1)\n"
     "            scores = _sparse_ws_scores(",
     "            buf = g % STAGES\n" + _read("c0") + "            mbarrier.wait(ready.index(buf), (g // STAGES) & 1)\n"
     + _read("c1") + _add("w_ready", "c1", "c0") + "            scores = _sparse_ws_scores("),
    ("            scores = warpgroup_mma_wait(0, deps=(scores,))\n            bad_any",
     "            scores = warpgroup_mma_wait(0, deps=(scores,))\n" + _read("c2") + _add("w_s", "c2", "c1")
     + "            bad_any"),
    ("            running_max = new_max\n            # O += P.V for dims 0-255",
     "            running_max = new_max\n" + _read("c3") + _add("w_soft", "c3", "c2")
     + "            # O += P.V for dims 0-255"),
    ("            acc1 = warpgroup_mma(p_op, kbuf.index(4 * buf + 1), acc1, is_async=True)\n"
     "            # publish P and the factors",
     "            acc1 = warpgroup_mma(p_op, kbuf.index(4 * buf + 1), acc1, is_async=True)\n"
     + _read("c4") + _add("w_pv", "c4", "c3") + "            # publish P and the factors"),
    ("            mbarrier.wait(p_free.index(pb), ((g // P_BUFS) & 1) ^ 1, pred=g >= P_BUFS)\n",
     "            mbarrier.wait(p_free.index(pb), ((g // P_BUFS) & 1) ^ 1, pred=g >= P_BUFS)\n"
     + _read("c5") + _add("w_pfree", "c5", "c4")),
    ("            mbarrier.arrive(p_ready.index(pb), count=1)\n            acc0, acc1, p_op = warpgroup_mma_wait(",
     "            mbarrier.arrive(p_ready.index(pb), count=1)\n" + _read("c6") + _add("w_pub", "c6", "c5")
     + "            acc0, acc1, p_op = warpgroup_mma_wait("),
    ("            mbarrier.arrive(free.index(buf), count=1)\n            g += 1\n\n        # The piece's epilogue",
     "            mbarrier.arrive(free.index(buf), count=1)\n" + _add("w_pv", "{C}", "c6")
     + "            g += 1\n\n        # The piece's epilogue"),
    ("        k += 1\n\n\n@gluon.jit\ndef _sparse_ws_second(",
     "        k += 1\n" + _store(0, W0) + "\n\n@gluon.jit\ndef _sparse_ws_second("),
    # warpgroup 1: c0 p_ready c1 ready c2 P.V and the releases
    ("                      HAS_TOPK_LENGTH: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):\n",
     "                      HAS_TOPK_LENGTH: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, TRACE):\n"),
    ("    g = 0\n    k = 0\n" + UNITS + "        whole, slot, entries, rows, group, _ = ",
     "    g = 0\n    k = 0\n" + _start(W1) + UNITS + "        whole, slot, entries, rows, group, _ = "),
    ("            pb = g % P_BUFS\n            mbarrier.wait(p_ready.index(pb), (g // P_BUFS) & 1)\n"
     "            mbarrier.wait(ready.index(buf), (g // STAGES) & 1)\n",
     "            pb = g % P_BUFS\n" + _read("c0") + "            mbarrier.wait(p_ready.index(pb), (g // P_BUFS) & 1)\n"
     + _read("c1") + _add("v_pready", "c1", "c0") + "            mbarrier.wait(ready.index(buf), (g // STAGES) & 1)\n"
     + _read("c2") + _add("v_ready", "c2", "c1")),
    ("            mbarrier.arrive(p_free.index(pb), count=1)\n            mbarrier.arrive(free.index(buf), count=1)\n"
     "            g += 1\n",
     "            mbarrier.arrive(p_free.index(pb), count=1)\n            mbarrier.arrive(free.index(buf), count=1)\n"
     + _add("v_pv", "{C}", "c2") + "            g += 1\n"),
    ("        k += 1\n\n\n@gluon.jit\ndef _mla_sparse_hopper_kernel(",
     "        k += 1\n" + _store(1, W1) + "\n\n@gluon.jit\ndef _mla_sparse_hopper_kernel("),
    # the producer, per half: c0 load c1 free (the first half's wait) c2 dequant c0; per tile the
    # fence and `ready` added to dequant
    ("                        STAGES: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr):\n",
     "                        STAGES: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr, TRACE):\n"),
    ("    g = 0\n" + UNITS + "        _, _, entries, _, _, _ = _sparse_ws_piece(",
     "    g = 0\n" + _start(PR) + UNITS + "        _, _, entries, _, _, _ = _sparse_ws_piece("),
    ("            buf = g % STAGES\n            for h in gl.static_range(HALVES):\n",
     "            buf = g % STAGES\n" + _read("c0") + "            for h in gl.static_range(HALVES):\n"),
    ("                if h == 0:\n"
     "                    mbarrier.wait(free.index(buf), ((g // STAGES) & 1) ^ 1, pred=g >= STAGES)\n"
     "                _sparse_ws_dequantise(raw, kbuf, krope, buf, h, BLOCK_N)\n",
     _read("c1", I16) + _add("r_load", "c1", "c0", I16) + "                if h == 0:\n"
     "                    mbarrier.wait(free.index(buf), ((g // STAGES) & 1) ^ 1, pred=g >= STAGES)\n"
     + _read("c2", I16) + _add("r_free", "c2", "c1", I16)
     + "                _sparse_ws_dequantise(raw, kbuf, krope, buf, h, BLOCK_N)\n"
     + _read("c0", I16) + _add("r_deq", "c0", "c2", I16)),
    ("            mbarrier.arrive(ready.index(buf), count=1)\n            g += 1\n\n\n"
     "@gluon.jit\ndef _sparse_ws_store(",
     "            mbarrier.arrive(ready.index(buf), count=1)\n" + _add("r_deq", "{C}", "c0") + "            g += 1\n"
     + _store(2, PR) + "\n\n@gluon.jit\ndef _sparse_ws_store("),
]


def instrumented_source(path):
    return insert(path, INSERTIONS, "lab/profile/sparse_trace.py")


def summarise(trace):
    """Per partition, over the records whose outer loop ran tiles: {phase: ns a tile}, with "loop" the
    outer loop's whole time a tile and "other" what the phases leave of it; and the kernel's span (ns,
    first loop start to last loop end). `trace` (records, SLOTS) float64 on the CPU, 3 records a program."""
    out = {}
    ran = (trace[:, 1] > 0) & (trace[:, 10] > 0)
    for part, phases in PHASES.items():
        rows = trace[(torch.arange(len(trace)) % 3 == part) & ran]
        ns_per_cycle = (rows[:, 1] - rows[:, 0]) / rows[:, 8].clamp(min=1)
        tiles = rows[:, 10]
        per = {name: rows[:, 2 + k] * ns_per_cycle / tiles for k, name in enumerate(phases)}
        per["loop"] = (rows[:, 1] - rows[:, 0]) / tiles
        per["other"] = per["loop"] - sum(per[name] for name in phases)
        out[part] = per
    stamped = trace[trace[:, 1] > 0]
    span = float(stamped[:, 1].max() - stamped[:, 0].min()) if len(stamped) else float("nan")
    return out, span


def bench_spec(batch, heads):
    import sparse_peers  # bench/: FlashMLA's benchmark cases
    for spec in sparse_peers.bench_cases():
        if spec["batchsize"] == batch and spec["heads"] == heads:
            return spec
    raise SystemExit(f"no case of batch {batch} and {heads} heads in FlashMLA's sparse benchmark")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="128x64,128x128,64x64,2x64")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    module = load_instrumented(instrumented_source(os.path.join(ROOT, "submission.py")))
    module.TRACE_BUFFER = torch.zeros(RECORDS * SLOTS, dtype=torch.int64, device="cuda")
    flush = utils.L2Flusher("default")
    print("case | event us (plain) | span us | per partition, median ns a tile: loop, phases, other")
    for case_text in args.cases.split(","):
        batch, heads = map(int, case_text.split("x"))
        spec = bench_spec(batch, heads)
        inputs = reference.generate_sparse_input(**harness.sparse_input_args(spec), device="cuda")
        plan, plain_plan = module.get_mla_decode_metadata()[0], submission.get_mla_decode_metadata()[0]

        def call(plan=plan, module=module, inputs=inputs):
            return harness.sparse_call(module.mla_decode_with_kvcache, inputs, plan)

        def plain_call(plan=plain_plan, inputs=inputs):
            return harness.sparse_call(submission.mla_decode_with_kvcache, inputs, plan)
        out, lse = call()
        plain_call()
        assert plan.route["route"] == "hopper_sparse", plan.route
        expected = reference.sparse_expected(inputs, harness.sparse_q_format(module, inputs))
        verdict = reference.judge_sparse(expected, out, lse)
        events, plain, spans, stats = [], [], [], {}
        for _ in range(args.repeats):
            plain.append(utils.time_call(plain_call, flush=flush)[1] / 1e3)
            module.TRACE_BUFFER.zero_()
            events.append(utils.time_call(call, flush=flush)[1] / 1e3)
            per, span = summarise(module.TRACE_BUFFER.view(RECORDS, SLOTS).cpu().double())
            spans.append(span / 1e3)
            for part, values in per.items():
                for name, v in values.items():
                    stats.setdefault((part, name), []).extend(v.tolist())
        print(f"{case_text} splits {plan.num_splits} ({'ok' if verdict['ok'] else 'FAILED'} "
              f"{reference.sparse_message(verdict)[:60]}) | {median(events):.1f} ({median(plain):.1f}) | "
              f"{median(spans):.1f}", flush=True)
        for part, phases in PHASES.items():
            print(f"    {NAMES[part]:12s} loop {median(stats[(part, 'loop')]):6.0f} | " + ", ".join(
                f"{name} {median(stats[(part, name)]):.0f}" for name in phases + ["other"]), flush=True)
        del inputs, out, lse
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

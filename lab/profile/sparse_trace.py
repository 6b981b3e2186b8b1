"""Where the warp-specialised sparse kernel's time goes, per program and partition (sm_90, one device call).

Builds an instrumented copy of submission.py (exact-text insertions, each asserted to match once,
so a kernel edit that moves a marker fails loudly here; lab/tests/test_sparse_trace.py compiles
the result for sm_90 on the CPU). Each of _mla_sparse_hopper_kernel's three partitions records
%globaltimer at the start and end of its tile loop and %clock64 cycles spent per phase of a tile:
  warpgroup 0  ready    the bf16 tile awaited
               S        S's MMAs issued and awaited (and the next tile's entries read meanwhile)
               softmax  the online softmax
               p_free   P's buffer awaited (warpgroup 1 done with the tile two before)
               publish  P and its factors stored, fenced, published
               P.V      its P.V (dims 0-255) issued and awaited, the tile released
  warpgroup 1  p_ready  P awaited;  ready  the tile awaited;  P.V  its P.V (dims 256-511), releases
  producer     load     the tile's loads issued (and the next tile's entries read)
               free     the bf16 tile's release awaited
               dequant  the dequantisation (waiting for the loads' data), fence, `ready`
Per case: event time (CUDA events around one call after an L2 flush) beside the uninstrumented
kernel's, the kernel's span (first loop start to last loop end) and, per partition, the median over
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
# slots: 0 loop start ns, 1 loop end ns, 2-7 the partition's phases (cycles, PHASES' order), 8 the
# loop's cycles, 10 tiles

RECORD = ("TRACE + ((gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)) * gl.num_programs(2)"
          " + gl.program_id(2)) * 48")


def _record(part):
    return RECORD + f" + {part * SLOTS}"


def _store(part, cycles):
    """The loop's end: its stamps, each phase's cycles, the loop's cycles and the tile count stored."""
    text = f"    record = {_record(part)}\n    gl.store(record, t_start)\n    gl.store(record + 1, {{S}})\n"
    for k, name in enumerate(cycles):
        text += f"    gl.store(record + {2 + k}, {name})\n"
    return text + "    gl.store(record + 8, {C} - c_start)\n    gl.store(record + 10, num_tiles.to(gl.int64))\n"


def _zeros(names):
    return "".join(f"    {name} = c_start * 0\n" for name in names)


W0 = ["w_ready", "w_s", "w_soft", "w_pfree", "w_pub", "w_pv"]
W1 = ["v_pready", "v_ready", "v_pv"]
PR = ["r_load", "r_free", "r_deq"]

# (marker text in submission.py, text in its place); {S} a %globaltimer stamp, {C} a %clock64 read
INSERTIONS = [
    # the kernel takes the buffer after SPLIT_TICKETS; the launch passes TRACE_BUFFER there
    ("def _mla_sparse_hopper_kernel(\n"
     "    Q, KV8, KV32, KV16, INDICES, TOPK_LENGTH, OUT, LSE, PARTIAL_O, PARTIAL_LSE, SPLIT_TICKETS,\n",
     "def _mla_sparse_hopper_kernel(\n"
     "    Q, KV8, KV32, KV16, INDICES, TOPK_LENGTH, OUT, LSE, PARTIAL_O, PARTIAL_LSE, SPLIT_TICKETS, TRACE,\n"),
    ('"LSE": "*fp32", "PARTIAL_O": "*fp32", "PARTIAL_LSE": "*fp32", "SPLIT_TICKETS": "*i32",\n',
     '"LSE": "*fp32", "PARTIAL_O": "*fp32", "PARTIAL_LSE": "*fp32", "SPLIT_TICKETS": "*i32", "TRACE": "*i64",\n'),
    ("               tickets if topk_length is None else topk_length, out, lse, partial_o, partial_lse, tickets)\n",
     "               tickets if topk_length is None else topk_length, out, lse, partial_o, partial_lse, tickets,\n"
     "               TRACE_BUFFER)\n"),
    ("        launch(_mla_sparse_kernel, grid, tensors, scalars, constexprs,",
     "        tensors = tensors[:-1]  # the portable kernel takes no trace\n"
     "        launch(_mla_sparse_kernel, grid, tensors, scalars, constexprs,"),
    ("                            PAGE_SIZE, STAGES)),\n"
     "        (_sparse_ws_second, (smem, bars, io, entries, query_args, NUM_SPLITS, BLOCK_N, STAGES)),\n",
     "                            PAGE_SIZE, STAGES, TRACE)),\n"
     "        (_sparse_ws_second, (smem, bars, io, entries, query_args, NUM_SPLITS, BLOCK_N, STAGES, TRACE)),\n"),
    ("                               PAGE_SIZE))],\n        [4, 4], [168, 96])\n",
     "                               PAGE_SIZE, TRACE))],\n        [4, 4], [168, 96])\n"),
    # warpgroup 0
    ("                    BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr):\n",
     "                    BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr, TRACE):\n"),
    ("    for t in range(num_tiles):\n        buf = t % STAGES\n"
     "        mbarrier.wait(ready.index(buf), (t // STAGES) & 1)\n        scores = _sparse_ws_scores(",
     "    t_start = {S}\n    c_start = {C}\n" + _zeros(W0)
     + "    for t in range(num_tiles):\n        buf = t % STAGES\n        c0 = {C}\n"
     "        mbarrier.wait(ready.index(buf), (t // STAGES) & 1)\n        c1 = {C}\n        w_ready += c1 - c0\n"
     "        scores = _sparse_ws_scores("),
    ("        scores = warpgroup_mma_wait(0, deps=(scores,))\n        bad_any",
     "        scores = warpgroup_mma_wait(0, deps=(scores,))\n        c2 = {C}\n        w_s += c2 - c1\n"
     "        bad_any"),
    ("        pb = t % 2\n        mbarrier.wait(p_free.index(pb), ((t // 2) & 1) ^ 1, pred=t >= 2)\n",
     "        pb = t % 2\n        c3 = {C}\n        w_soft += c3 - c2\n"
     "        mbarrier.wait(p_free.index(pb), ((t // 2) & 1) ^ 1, pred=t >= 2)\n        c4 = {C}\n"
     "        w_pfree += c4 - c3\n"),
    ("        mbarrier.arrive(p_ready.index(pb), count=1)\n        factor = gl.expand_dims(gl.convert_layout(",
     "        mbarrier.arrive(p_ready.index(pb), count=1)\n        c5 = {C}\n        w_pub += c5 - c4\n"
     "        factor = gl.expand_dims(gl.convert_layout("),
    ("        gl.thread_barrier()  # every warp's MMAs have read the tile\n"
     "        mbarrier.arrive(free.index(buf), count=1)\n\n    # The epilogue",
     "        gl.thread_barrier()  # every warp's MMAs have read the tile\n"
     "        mbarrier.arrive(free.index(buf), count=1)\n"
     "        w_pv += {C} - c5\n" + _store(0, W0) + "\n    # The epilogue"),
    # warpgroup 1
    ("def _sparse_ws_second(smem, bars, io, entries, query_args, NUM_SPLITS: gl.constexpr, BLOCK_N: gl.constexpr,\n"
     "                      STAGES: gl.constexpr):\n",
     "def _sparse_ws_second(smem, bars, io, entries, query_args, NUM_SPLITS: gl.constexpr, BLOCK_N: gl.constexpr,\n"
     "                      STAGES: gl.constexpr, TRACE):\n"),
    ("    for t in range(num_tiles):\n        buf = t % STAGES\n        pb = t % 2\n"
     "        mbarrier.wait(p_ready.index(pb), (t // 2) & 1)\n"
     "        mbarrier.wait(ready.index(buf), (t // STAGES) & 1)\n",
     "    t_start = {S}\n    c_start = {C}\n" + _zeros(W1)
     + "    for t in range(num_tiles):\n        buf = t % STAGES\n        pb = t % 2\n        c0 = {C}\n"
     "        mbarrier.wait(p_ready.index(pb), (t // 2) & 1)\n        c1 = {C}\n        v_pready += c1 - c0\n"
     "        mbarrier.wait(ready.index(buf), (t // STAGES) & 1)\n        c2 = {C}\n        v_ready += c2 - c1\n"),
    ("        mbarrier.arrive(free.index(buf), count=1)\n    mbarrier.wait(fin, 0)\n",
     "        mbarrier.arrive(free.index(buf), count=1)\n        v_pv += {C} - c2\n" + _store(1, W1)
     + "    mbarrier.wait(fin, 0)\n"),
    # the producer
    ("def _sparse_ws_producer(cache, tiles, bars, entries, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,\n"
     "                        PAGE_SIZE: gl.constexpr):\n",
     "def _sparse_ws_producer(cache, tiles, bars, entries, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,\n"
     "                        PAGE_SIZE: gl.constexpr, TRACE):\n"),
    ("    for t in range(num_tiles):\n        raw = _sparse_ws_load(",
     "    t_start = {S}\n    c_start = {C}\n" + _zeros(PR)
     + "    for t in range(num_tiles):\n        c0 = {C}\n        raw = _sparse_ws_load("),
    ("        mbarrier.wait(free.index(buf), ((t // STAGES) & 1) ^ 1, pred=t >= STAGES)\n"
     "        _sparse_ws_dequantise(",
     "        c1 = {C}\n        r_load += c1 - c0\n"
     "        mbarrier.wait(free.index(buf), ((t // STAGES) & 1) ^ 1, pred=t >= STAGES)\n        c2 = {C}\n"
     "        r_free += c2 - c1\n        _sparse_ws_dequantise("),
    ("        mbarrier.arrive(ready.index(buf), count=1)\n\n\n@gluon.jit\ndef _sparse_ws_store(",
     "        mbarrier.arrive(ready.index(buf), count=1)\n        r_deq += {C} - c2\n" + _store(2, PR)
     + "\n\n@gluon.jit\ndef _sparse_ws_store("),
]


def instrumented_source(path):
    return insert(path, INSERTIONS, "lab/profile/sparse_trace.py")


def summarise(trace):
    """Per partition, over the records whose loop ran tiles: {phase: ns a tile}, with "loop" the
    loop's whole time a tile and "other" what the phases leave of it; and the kernel's span (ns, first
    loop start to last loop end). `trace` (records, SLOTS) float64 on the CPU, 3 records a program."""
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
        verdict = reference.judge_sparse(reference.sparse_expected(inputs), out, lse)
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

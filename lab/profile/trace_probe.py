"""Where one call of the Hopper kernel spends its time, per program (sm_90, one device call).

Builds an instrumented copy of submission.py (exact-text insertions, each asserted to match once,
so a kernel edit that moves a marker fails loudly here; lab/tests/test_trace_probe.py compiles the
result for sm_90 on the CPU): every program records %globaltimer at
its start, after the prologue (indptr, q loaded and quantised, first TMA issued), after the tile
loop, after its output/partial stores and at its end, plus %clock64 cycles spent per phase of the
tile loop (waiting for the TMA, S^T, softmax + P, P.V). Then times each shape's table row like the
runner (L2 flushed, CUDA events around one call) and prints, per shape: the event time; the
kernel's span (first program start -> last program end); how late the last program starts; and
per-program medians of each phase.

    python lab/profile/trace_probe.py [--shapes 4x1024,256x8192] [--repeats 20]
"""
import argparse
import os
import statistics
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path.insert(0, ROOT)
import eval as runner  # noqa: E402
import reference  # noqa: E402
import utils  # noqa: E402

SLOTS = 16  # int64 per program in the trace buffer
NAMES = ["start", "prologue", "loop", "stores", "end"]  # globaltimer slots 0-4

STAMP = 'gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)'
CLOCK = 'gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)'

# (marker text in submission.py, text to put in its place); {S} = STAMP, {C} = CLOCK
INSERTIONS = [
    ("PARTIAL_LSE, SPLIT_TICKETS,\n    sm_scale_log2, kv_rows, stride_q_token, stride_o_token,",
     "PARTIAL_LSE, SPLIT_TICKETS,\n    TRACE, sm_scale_log2, kv_rows, stride_q_token, stride_o_token,"),
    ("    split = gl.program_id(1)\n    kv_scale = gl.load(KV_SCALE)\n    q = _load_q(Q, batch,",
     "    split = gl.program_id(1)\n    t_start = {S}\n    c_start = {C}\n"
     "    trace = TRACE + (batch * gl.num_programs(1) + split) * 16\n"
     "    kv_scale = gl.load(KV_SCALE)\n    q = _load_q(Q, batch,"),
    # _split_tiles (the tile loop, both entry points) records its phases where given a trace slot
    ("    PV_F16: gl.constexpr = False, GATHER: gl.constexpr = False,\n):",
     "    PV_F16: gl.constexpr = False, GATHER: gl.constexpr = False, trace=None,\n):"),
    ("            score_scale = sm_scale_log2 * kv_scale\n    else:\n        gl.thread_barrier()\n",
     "            score_scale = sm_scale_log2 * kv_scale\n    else:\n        gl.thread_barrier()\n"
     "    t_prologue = {S}\n"
     "    wait_cycles = t_prologue * 0\n    s_cycles = t_prologue * 0\n    softmax_cycles = t_prologue * 0\n"
     "    pv_cycles = t_prologue * 0\n"),
    ("            mbarrier.wait(loaded.index(slot), ((consumed + i) // STAGES) & 1)\n",
     "            c0 = {C}\n            mbarrier.wait(loaded.index(slot), ((consumed + i) // STAGES) & 1)\n"
     "            c1 = {C}\n            wait_cycles += c1 - c0\n"),
    ("        positions = kv_begin + i * BLOCK_N + tokens\n",
     "        c2 = {C}\n        s_cycles += c2 - c1\n"
     "        positions = kv_begin + i * BLOCK_N + tokens\n"),
    ("            correction2 = _store_probs(probs, correction, pt_smem, BLOCK_N, NUM_HEADS)\n",
     "            correction2 = _store_probs(probs, correction, pt_smem, BLOCK_N, NUM_HEADS)\n"
     "            c3 = {C}\n            softmax_cycles += c3 - c2\n"),
    ("                                              correction2, WARPS, O_MMA, CHUNK)\n",
     "                                              correction2, WARPS, O_MMA, CHUNK)\n"
     "            pv_cycles += {C} - c3\n"),
    ("    return (acc0, acc1, acc2, acc3), running_max, row_sums, bad_blocks\n",
     "    if trace is not None:\n"
     "        gl.store(trace + 1, t_prologue)\n"
     "        gl.store(trace + 5, wait_cycles)\n        gl.store(trace + 6, s_cycles)\n"
     "        gl.store(trace + 7, softmax_cycles)\n        gl.store(trace + 8, pv_cycles)\n"
     "    return (acc0, acc1, acc2, acc3), running_max, row_sums, bad_blocks\n"),
    ("BLOCK_N=BLOCK_N, KV_FP8=True, LAYOUTS=LAYOUTS)\n    _release_ring(ring, STAGES)\n",
     "BLOCK_N=BLOCK_N, KV_FP8=True, LAYOUTS=LAYOUTS,\n        trace=trace)\n"
     "    _release_ring(ring, STAGES)\n    t_loop = {S}\n"),
    ("\n                 PARTIAL_LSE, slot_id, WARPS, NUM_SPLITS, NUM_HEADS, LATENT, CHUNK)\n",
     "\n                 PARTIAL_LSE, slot_id, WARPS, NUM_SPLITS, NUM_HEADS, LATENT, CHUNK)\n"
     "    t_stores = {S}\n"),
    ("NUM_SPLITS,\n                   COOPERATIVE_MERGE, NUM_HEADS, LATENT)\n",
     "NUM_SPLITS,\n                   COOPERATIVE_MERGE, NUM_HEADS, LATENT)\n"
     "    t_end = {S}\n    c_end = {C}\n"
     "    gl.store(trace, t_start)\n"
     "    gl.store(trace + 2, t_loop)\n    gl.store(trace + 3, t_stores)\n    gl.store(trace + 4, t_end)\n"
     "    gl.store(trace + 9, c_end - c_start)\n    gl.store(trace + 10, num_tiles.to(gl.int64))\n"),
    ('"SPLIT_TICKETS": "*i32", "sm_scale_log2": "fp32", "kv_rows": "i32",',
     '"SPLIT_TICKETS": "*i32", "TRACE": "*i64", "sm_scale_log2": "fp32", "kv_rows": "i32",'),
    ("(q, latent_desc, rope_desc, kv_scale, qo_indptr, kv_indptr, out, partial_o, partial_lse, tickets),",
     "(q, latent_desc, rope_desc, kv_scale, qo_indptr, kv_indptr, out, partial_o, partial_lse, tickets, "
     "TRACE_BUFFER),"),
]


def load_instrumented(source, name="traced_submission"):
    """An instrumented copy of submission.py as a module, from a file of its own (kept: Triton reads
    the jit functions' source from it)."""
    path = os.path.join(tempfile.mkdtemp(), f"{name}.py")
    with open(path, "w") as f:
        f.write(source)
    return runner.load_submission(path, name)


def insert(path, insertions, probe):
    """submission.py at `path` with each (marker, text) of `insertions` in place of its marker, which
    must occur exactly once ({S}: a %globaltimer stamp, {C}: a %clock64 read), and a TRACE_BUFFER
    for `probe` to set."""
    src = open(path).read()
    for marker, text in insertions:
        count = src.count(marker)
        assert count == 1, f"marker found {count} times, not once: {marker[:70]!r}"
        src = src.replace(marker, text.replace("{S}", STAMP).replace("{C}", CLOCK))
    return src + f"\nTRACE_BUFFER = None  # set by {probe}\n"


def instrumented_source(path):
    return insert(path, INSERTIONS, "lab/profile/trace_probe.py")


def median(values):
    return statistics.median(values) if values else float("nan")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4x1024,4x8192,32x1024,64x1024,64x8192,256x1024,256x8192",
                        help="BSxKV[:SPLITS], comma-separated (SPLITS overrides the table row's split count)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    module = load_instrumented(instrumented_source(os.path.join(ROOT, "submission.py")))
    flush = utils.L2Flusher("default")
    print("bs/kv: row | event us | span us | last start us | per program (median): prologue, loop, "
          "stores, merge+end us | per tile ns: wait, S^T, softmax+P, P.V | tiles")
    for shape in args.shapes.split(","):
        shape, _, splits = shape.partition(":")
        batch, kv = map(int, shape.split("x"))
        data = reference.generate_input(batch, 1, kv, 7)
        row = module.select_route(batch, kv, True, module.TRITON_ROUTE_TABLE)
        assert row["route"] == "hopper_fp8", row
        if splits:
            row = dict(row, params=dict(row["params"], num_splits=int(splits)))
        programs = batch * row["params"].get("num_splits", 1)
        module.TRACE_BUFFER = torch.zeros(programs * SLOTS, dtype=torch.int64, device="cuda")

        def call(data=data, row=row):
            return module.hopper_fp8_route(*data, **row["params"])

        expected = reference.ref_kernel(data)
        assert reference.mismatch_ratio(call(), expected) <= 0.005, shape
        events, spans, late, phases, tile_ns, tiles = [], [], [], [[] for _ in range(4)], [[] for _ in range(4)], []
        for _ in range(args.repeats):
            events.append(utils.time_call(call, flush=flush)[1] / 1e3)
            trace = module.TRACE_BUFFER.view(programs, SLOTS).cpu().double()
            stamps = trace[:, :5]
            begin = stamps[:, 0].min()
            spans.append(float(stamps[:, 4].max() - begin) / 1e3)
            late.append(float(stamps[:, 0].max() - begin) / 1e3)
            for k in range(4):
                phases[k] += ((stamps[:, k + 1] - stamps[:, k]) / 1e3).tolist()
            ns_per_cycle = (stamps[:, 4] - stamps[:, 0]) / trace[:, 9].clamp(min=1)
            n_tiles = trace[:, 10].clamp(min=1)
            for k in range(4):
                tile_ns[k] += (trace[:, 5 + k] * ns_per_cycle / n_tiles).tolist()
            tiles += trace[:, 10].tolist()
        params = ",".join(f"{k}={v}" for k, v in row["params"].items())
        print(f"{batch}/{kv}: {params} | {median(events):.1f} | {median(spans):.1f} | {median(late):.1f} | "
              + ", ".join(f"{median(p):.2f}" for p in phases) + " | "
              + ", ".join(f"{median(t):.0f}" for t in tile_ns) + f" | {median(tiles):.0f}", flush=True)


if __name__ == "__main__":
    main()

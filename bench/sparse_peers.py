"""The serving API's sparse form (DeepSeek-V3.2: top-k indices over FlashMLA's 656-byte fp8 cache)
against FlashMLA's sparse decode, in one process, on the same inputs, with the same timings.

    python bench/sparse_peers.py [--flashmla-sparse BUILD] [--variant NAME=FILE ...] [--peak]
                                 [--repeats 20] [--no-check] [--json OUT] [--providers REGEX]

Cases: the lines of specs/sparse.txt's part (b), FlashMLA's sparse benchmark (V3.2: s_q 2, contexts
normal around 32768, topk 2048, pages of 64, h_q 64 and 128 x batch 2, 64, 74, 128); --peak adds
its peak cases (batch 148, topk 16384). reference.generate_sparse_input makes each (every token no
query selects is NaN in the cache: a kernel that reads one shows it).
Providers: ours (submission.mla_decode_with_kvcache's sparse form); FlashMLA 9241ae3's sparse decode
(flash_mla_with_kvcache with indices) when --flashmla-sparse names its build
(bench/flashmla_sparse_kit.sh, then bench/flashmla_sparse_build.sh; skipped with a note otherwise);
--variant NAME=FILE (repeatable) another copy of submission.py, as NAME. Each is called as eval.py
calls a sparse case (eval.sparse_call: FlashMLA's form, plan once per case and provider).
Per case and provider: the strict check (reference.judge_sparse: out within 1.25x the format's own
error of float64 attention over the bf16 values, lse likewise, poison and empty rows) before any
timing, both references computed with the q the provider multiplies (q_format: FlashMLA bf16, ours
and each variant its module's sparse_q_format; printed with the check, and in the JSON rows); event
time (median and mean), profiler kernel time after an L2 flush, CUDA-graph replay time, host time
of one eager call (bench/serving_peers.py's timings); TFLOPS as FlashMLA's benchmark counts them
(2 x b x s_q x h_q x topk x (576 + 512) / time) and the selected tokens' bytes per second.
Summary: geomean per h_q of FlashMLA's kernel time / the provider's.
"""
import argparse
import importlib
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import eval as harness  # noqa: E402
import reference  # noqa: E402
import serving_peers  # noqa: E402  (bench/, beside this file: the timings)
import submission  # noqa: E402
import utils  # noqa: E402

SPEC = os.path.join(ROOT, "specs", "sparse.txt")
PEER = "FlashMLA sparse"
BENCH_KV = 32768  # part (b)'s lines: FlashMLA's benchmark contexts
PEAK_TOPK = 16384


def bench_cases(peak=False, spec=SPEC):
    """The sparse spec lines of FlashMLA's benchmark (kvseqlen 32768) as dicts, topk 2048 first;
    with ``peak`` its topk 16384 lines too."""
    cases = [case.args for case in utils.read_spec_file(spec)
             if harness.is_sparse_case(case.args) and case.args.get("kvseqlen") == BENCH_KV]
    return [args for args in cases if peak or args["topk"] != PEAK_TOPK]


def load_flashmla_sparse(build):
    """FlashMLA's Python interface over the sparse-decode extension in ``build``
    (bench/flashmla_sparse_build.sh's DEST/build): (get_mla_metadata, flash_mla_with_kvcache)."""
    sys.path.insert(0, build)
    sys.modules["flash_mla.cuda"] = importlib.import_module("flash_mla_sparse_ext")
    flash_mla = importlib.import_module("flash_mla")
    return flash_mla.get_mla_metadata, flash_mla.flash_mla_with_kvcache


def providers(args):
    """name -> (get_metadata, decode) in FlashMLA's form, for every provider available; notes."""
    found = {"ours": (submission.get_mla_decode_metadata, submission.mla_decode_with_kvcache)}
    notes = []
    for name, module in args.variants:
        found[name] = (module.get_mla_decode_metadata, module.mla_decode_with_kvcache)
    if args.flashmla_sparse:
        found[PEER] = load_flashmla_sparse(args.flashmla_sparse)
    else:
        notes.append("FlashMLA sparse: skipped (no --flashmla-sparse build; bench/flashmla_sparse_kit.sh and "
                     "bench/flashmla_sparse_build.sh make it)")
    return found, notes


def q_format(name, variants, inputs):
    """The q provider ``name`` multiplies on ``inputs`` ("bf16" or "fp8"), which the float64
    references of its check use: FlashMLA's sparse decode bf16 q as given; ours and each of
    ``variants`` ((NAME, module) pairs) its module's answer (eval.sparse_q_format: the module's
    sparse_q_format(q, k_cache), bf16 without one)."""
    if name == PEER:
        return "bf16"
    return harness.sparse_q_format(dict(variants).get(name, submission), inputs)


def case_calls(found, inputs):
    """name -> zero-argument call returning (out, lse): each provider planned once for the case."""
    calls = {}
    for name, (get_metadata, decode) in found.items():
        plan = get_metadata()[0]
        calls[name] = lambda decode=decode, plan=plan: harness.sparse_call(decode, inputs, plan)
    return calls


def flops(inputs):
    """FlashMLA's benchmark's count: every entry of every query token and head, QK (576) and PV (512)."""
    return 2 * inputs.batchsize * inputs.qseqlen * inputs.heads * inputs.topk * (576 + 512)


def label(args):
    return f"b{args['batchsize']} s_q{args['qseqlen']} h{args['heads']} topk{args['topk']}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--flashmla-sparse", default=None, help="FlashMLA's sparse build (flashmla_sparse_build.sh's)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FILE",
                        help="another submission.py, timed as the provider NAME; repeatable")
    parser.add_argument("--peak", action="store_true", help="also FlashMLA's peak cases (batch 148, topk 16384)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--host-repeats", type=int, default=50)
    parser.add_argument("--no-check", action="store_true", help="no float64 reference (times only)")
    parser.add_argument("--providers", default=None, metavar="REGEX",
                        help="time only the providers whose name this regular expression finds")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.variants = [serving_peers.load_variant(spec) for spec in args.variant]
    found, notes = providers(args)
    for note in notes:
        print("NOTE:", note, flush=True)
    flush = utils.L2Flusher("default")
    rows = []
    for spec in bench_cases(args.peak):
        inputs = reference.generate_sparse_input(**harness.sparse_input_args(spec), device="cuda")
        expected = {}  # q format -> the case's references with that q, made once for every provider using it
        for name, fn in case_calls(found, inputs).items():
            if args.providers and not re.search(args.providers, name):
                continue
            try:
                q = q_format(name, args.variants, inputs)
                if not args.no_check and q not in expected:
                    expected[q] = reference.sparse_expected(inputs, q)
                out, lse = fn()
                torch.cuda.synchronize()
                verdict = None if args.no_check else reference.judge_sparse(expected[q], out, lse)
                times = serving_peers.provider_times(fn, args.repeats, args.host_repeats, flush,
                                                     f"{label(spec)}: {name}", busy=False)
            except Exception as exc:  # a provider that cannot take the case: say so, go on
                print(f"{label(spec)}: {name} failed: {exc!r}", flush=True)
                continue
            gpu = times["gpu_us"]
            row = {**{k: spec[k] for k in ("batchsize", "qseqlen", "heads", "topk", "seed")}, "provider": name,
                   **times, "tflops": flops(inputs) / gpu / 1e6, "tb_s": inputs.cache_bytes / gpu / 1e6,
                   "q_format": q, "ok": None if verdict is None else verdict["ok"],
                   "check": None if verdict is None else reference.sparse_message(verdict)}
            rows.append(row)
            print(f"{label(spec)} {name:16s} gpu {gpu:8.1f} us  graph {times['graph_us']:8.1f}  "
                  f"event {times['median_us']:8.1f} (mean {times['mean_us']:8.1f})  host {times['host_us']:5.1f} us  "
                  f"{row['tflops']:6.1f} TFLOPS  {row['tb_s']:5.2f} TB/s  "
                  + ("" if verdict is None else ("ok " if verdict["ok"] else "FAILED ") + row["check"])
                  + "  [" + " + ".join(f"{k} {v:.1f}" for k, v in times["kernels_us"].items()) + "]", flush=True)
        del inputs, expected
        torch.cuda.empty_cache()
    print_summary(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"notes": notes, "rows": rows, "device": torch.cuda.get_device_name()}, f, indent=1)


def summary(rows, peer=PEER):
    """(h_q, provider, geomean kernel time us, geomean of the peer's time / the provider's or None,
    every case checked ok) per head count and provider; the ratio over the cases both ran."""
    by = {}
    for row in rows:
        by.setdefault((row["heads"], row["provider"]), []).append(row)
    lines = []
    for (heads, name), group in sorted(by.items()):
        theirs = {(r["batchsize"], r["topk"]): r["gpu_us"] for r in by.get((heads, peer), [])}
        pairs = [(theirs[(r["batchsize"], r["topk"])], r["gpu_us"]) for r in group
                 if (r["batchsize"], r["topk"]) in theirs]
        ratio = serving_peers.geomean(t / o for t, o in pairs) if pairs else None
        lines.append((heads, name, serving_peers.geomean(r["gpu_us"] for r in group), ratio,
                      all(r["ok"] is not False for r in group)))
    return lines


def print_summary(rows):
    for heads, name, gpu, ratio, ok in summary(rows):
        print(f"h{heads} {name:16s} kernel geomean {gpu:8.1f} us" + ("" if ratio is None else
              f"  FlashMLA sparse / this: {ratio:.2f}x") + ("" if ok else "  (a case FAILED its check)"))


if __name__ == "__main__":
    main()

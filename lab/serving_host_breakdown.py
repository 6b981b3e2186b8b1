"""What one eager call of the serving API (submission.mla_decode_with_kvcache) spends on the host,
part by part, on a warm host with a spin kernel queued ahead (so every part only enqueues work:
serving_peers.host_time's busy measure).

    python lab/serving_host_breakdown.py [--flashmla BUILD] [--repeats 300]

Parts, each timed alone (median of --repeats, perf_counter):
  call       the whole call, as an engine makes it (the plan's signature seen before)
  signature  _serving_signature: the call's shapes, strides, dtypes and devices as one tuple
  lookup     plan.launches.get(signature)
  outputs    the two torch.empty of out and lse
  launch     the recorded launch alone (the compiled kernel's launcher with this call's arguments)
and FlashMLA's flash_mla_with_kvcache on the same bf16 inputs where --flashmla names its build.
The rest of `call` is the code between the parts (the alignment check, the route test).
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
import torch  # noqa: E402

import reference  # noqa: E402
import submission  # noqa: E402
from serving_peers import fp8_copy, host_time, load_flashmla  # noqa: E402

CASES = [(128, 1, 16, 4096, "fp8"), (128, 2, 128, 4096, "fp8"), (4, 1, 16, 1024, "fp8"), (128, 1, 16, 4096, "bf16")]


def breakdown(batch, s_q, h_q, s_k, kv, flash_mla, repeats):
    """{part: median us} for one case (see the module's docstring), and the route that served it."""
    case = reference.generate_serving_input(batch, s_q, h_q, 64, s_k, 1, varlen=True, causal=s_q > 1, kv="bf16",
                                            device="cuda")
    q, table, lens, causal = case.q, case.block_table, case.cache_seqlens, case.causal
    cache, k_scale = fp8_copy(case.k_cache) if kv == "fp8" else (case.k_cache, None)
    plan = submission.get_mla_decode_metadata()[0]

    def call():
        return submission.mla_decode_with_kvcache(q, cache, table, lens, 512, plan, causal=causal, k_scale=k_scale)
    for _ in range(3):
        call()
    signature = submission._serving_signature(q, cache, table, lens, 512, None, None, causal, k_scale)
    run = plan.launches[signature]
    out = torch.empty(batch, s_q, h_q, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(batch, h_q, s_q, dtype=torch.float32, device="cuda")
    parts = {
        "call": call,
        "signature": lambda: submission._serving_signature(q, cache, table, lens, 512, None, None, causal, k_scale),
        "lookup": lambda: plan.launches.get(signature),
        "outputs": lambda: (torch.empty(batch, s_q, h_q, 512, dtype=torch.bfloat16, device=q.device),
                            torch.empty(batch, h_q, s_q, dtype=torch.float32, device=q.device)),
        "launch": lambda: run(q, cache, table, lens, k_scale, out, lse),
    }
    if flash_mla is not None and kv == "bf16":
        meta = flash_mla.get_mla_metadata()[0]
        parts["FlashMLA"] = lambda: flash_mla.flash_mla_with_kvcache(q, cache, table, lens, 512, meta, causal=causal)
        parts["FlashMLA"]()
    return {name: host_time(fn, repeats, busy=True) for name, fn in parts.items()}, plan.route["route"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--flashmla", default=None)
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    flash_mla = load_flashmla(args.flashmla) if args.flashmla else None
    for batch, s_q, h_q, s_k, kv in CASES:
        times, route = breakdown(batch, s_q, h_q, s_k, kv, flash_mla, args.repeats)
        print(f"b{batch} s_q{s_q} h{h_q} s_k{s_k} {kv} ({route}): "
              + "; ".join(f"{name} {t:.1f}" for name, t in times.items()) + " us", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

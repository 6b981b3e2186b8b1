"""Where the seesaw kernel's time goes (lab/NOTES.md h56): submission's _mla_decode_seesaw_kernel timed with
one stage left out, on the serving API's fp8 path or (--kv bf16) its bf16 one (H200.md's method: time
variants that leave a stage out and take differences). A variant replaces one of the kernel's jitted
helpers in submission before anything compiles (Gluon takes a helper from its module when it compiles,
and the cache key follows it), so each variant runs in a process of its own. Times only: a variant's
output is wrong by design and not checked.

    python lab/seesaw_ablate.py [--variants full,no_pv,...] [--batch 128] [--heads 128] [--length 4096]
                                  [--repeats 20] [--kv fp8|bf16] [--compile-only]

Variants (what the pair loop no longer does):
  full        nothing left out
  no_pv       the P.V (_sw_pv returns the accumulators: no V^T fragments, no MMAs, no tail zeroing)
  no_scores   S (_sw_scores returns zeros: no score MMAs; the softmax runs on zeros)
  no_store_p  P's store to shared memory (_sw_store_p does nothing; the P.V reads what is there)
  no_q_loads  q's global loads (_sw_stage_q stores zeros and scale 1: the segment's staging without reads;
              S's MMAs then run on zeros, so it is not a clean cut: lab/NOTES.md h57, h59)
  softmax     S and the P.V both left out: the softmax, the barriers and the loader
  no_merge    the merge of split requests (the combine kernel after the seesaw launches, but its
              _merge_request does nothing)
  no_store    the epilogue's stores (_sw_store does nothing: no out, lse, partials or split counts; the
              combine kernel reads what the counts hold)
Each line: the time of one call (CUDA events around it after an L2 flush; median and mean of --repeats)
and full's time less the variant's. --compile-only: each variant's sm_90 compile on any machine (registers,
spills, the hot loop's MMAs), no GPU.
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import torch  # noqa: E402

import submission as S  # noqa: E402
from submission import gl, gluon  # noqa: E402

if S.HAVE_GLUON:
    from submission import fence_async_shared


@gluon.jit
def _pv_left_out(kv_latent, slot, tile, kv_begin, kv_end, real, p_buf, acc0, acc1, WG: gl.constexpr,
                 O_MMA: gl.constexpr):
    return acc0, acc1


@gluon.jit
def _scores_left_out(kv_latent, kv_rope, q_latent, q_rope, slot, S_L: gl.constexpr):
    BLOCK_N: gl.constexpr = kv_latent.shape[1]
    return gl.zeros([64, BLOCK_N], gl.float32, layout=S_L)


@gluon.jit
def _store_p_left_out(p, p_buf):
    pass


@gluon.jit
def _stage_q_without_loads(Q, q_latent, q_rope, q_scale, kv_scale, request, group, live, num_heads, q_len,
                           stride_q_batch, stride_q_token, stride_q_head, WG: gl.constexpr, FP8_MAX: gl.constexpr):
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    for c in gl.static_range(4):
        q_latent.index(c).slice(32 * WG, 32).store(gl.zeros([32, 128], gl.float32, layout=QL).to(q_latent.dtype))
    q_rope.slice(32 * WG, 32).store(gl.zeros([32, 64], gl.float32, layout=QL).to(q_rope.dtype))
    if q_latent.dtype == gl.float8e4nv:  # a bf16 q has no scales
        q_scale.slice(32 * WG, 32).store(gl.full([32], 1.0, gl.float32, layout=gl.SliceLayout(1, QL)))
    fence_async_shared()


@gluon.jit
def _merge_left_out(PARTIAL_O, PARTIAL_LSE, out_base, out_rows, lse_rows, row_ok, first_slot, num_splits, kv_scale,
                    dim0, WARPS: gl.constexpr, MAX_SPLITS: gl.constexpr, NUM_HEADS: gl.constexpr,
                    LATENT: gl.constexpr, DIMS: gl.constexpr):
    pass


@gluon.jit
def _store_left_out(acc0, acc1, m_run, l_s, l_o, kv_scale, poison, OUT, LSE, PARTIAL_O, PARTIAL_LSE, SPLIT_COUNTS,
                    request, group, split, slots, num_splits, first_work, num_heads, q_len, stride_o_batch,
                    stride_o_token, stride_o_head, stride_lse_batch, stride_lse_head, stride_lse_token,
                    WG: gl.constexpr, KV_FP8: gl.constexpr = True):
    pass


VARIANTS = {
    "full": {},
    "no_pv": {"_sw_pv": _pv_left_out},
    "no_scores": {"_sw_scores": _scores_left_out},
    "no_store_p": {"_sw_store_p": _store_p_left_out},
    "no_q_loads": {"_sw_stage_q": _stage_q_without_loads},
    "softmax": {"_sw_pv": _pv_left_out, "_sw_scores": _scores_left_out},
    "no_merge": {"_merge_request": _merge_left_out},
    "no_store": {"_sw_store": _store_left_out},
}


def apply(variant):
    """Replace the variant's helpers in submission (before anything compiles)."""
    for name, helper in VARIANTS[variant].items():
        assert hasattr(S, name), name
        setattr(S, name, helper)


def compile_facts(variant, kv):
    """The sm_90 compile of the seesaw kernel's plain row for the cache `kv` (page 64, causal off) with the
    variant applied."""
    from tools import kernel_report as kr
    apply(variant)
    spec = kr.TARGETS["sm90"]
    row = next(row for row in S.SERVING_ROUTE_TABLE if row["kv"] == kv and row["params"].get("seesaw"))
    plan = S.triton_compile_plan(row["route"], dict(row["params"], kv=row["kv"]), spec.fp8_dtype)
    entry = next(e for e in plan if e["kernel"] is S._mla_decode_seesaw_kernel
                 and e["constexprs"].get("PAGE_SIZE") == 64 and not e["constexprs"].get("CAUSAL"))
    kernel, signature, constexprs, attrs, options = kr.complete_plan_entry(entry, spec)
    facts, _ = kr.compile_and_analyse(kernel, signature, constexprs, attrs, options, spec)
    return {"variant": variant, "registers": facts["registers"], "spills": facts["spills"],
            "hot_loop_locals": facts["hot_loop_locals"], "mma": facts["mma"]["total"]}


def time_variant(variant, batch, heads, length, repeats, kv):
    """Kernel time (us, median and mean) of the API on a uniform batch over a `kv` cache (fp8 or bf16)
    with the variant applied."""
    import utils
    from serving_peers import kernel_times
    apply(variant)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, 1, heads, 576, device="cuda", generator=gen).to(torch.bfloat16)
    blocks = batch * length // 64
    dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
    cache = torch.randn(blocks, 64, 1, 576, device="cuda", generator=gen).to(dtype)
    table = torch.randperm(blocks, device="cuda", generator=gen).to(torch.int32).view(batch, -1)
    lens = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    plan = S.get_mla_decode_metadata()[0]

    def call():
        return S.mla_decode_with_kvcache(q, cache, table, lens, 512, plan, k_scale=1.0 if kv == "fp8" else None)

    call()
    assert plan.route["params"].get("seesaw"), plan.route
    return kernel_times(call, repeats, utils.L2Flusher("default"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--heads", type=int, default=128, help="64 or more: the seesaw's plans")
    parser.add_argument("--length", type=int, default=4096, help="tokens per request (a multiple of 64)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--kv", default="fp8", choices=("fp8", "bf16"), help="the cache's type")
    parser.add_argument("--compile-only", action="store_true", help="sm_90 compile facts, no GPU")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process's variant
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or args.heads < 64 or args.length % 64:
        parser.error(f"unknown variants {unknown}" if unknown else "--heads >= 64, --length a multiple of 64")
    if args.one:  # one variant in this process: the replacement precedes every compile
        if args.compile_only:
            result = compile_facts(args.one, args.kv)
        else:
            median, mean = time_variant(args.one, args.batch, args.heads, args.length, args.repeats,
                                        args.kv)
            result = {"variant": args.one, "median_us": median, "mean_us": mean}
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if not args.compile_only and not (S.HAVE_GLUON and torch.cuda.is_available()
                                      and torch.cuda.get_device_capability()[0] == 9):
        print("seesaw_ablate: needs a Hopper GPU (and Triton's Gluon); --compile-only runs anywhere")
        return 0
    results = {}
    for variant in variants:
        argv_child = [sys.executable, os.path.abspath(__file__), "--one", variant, "--batch", str(args.batch),
                      "--heads", str(args.heads), "--length", str(args.length), "--repeats", str(args.repeats),
                      "--kv", args.kv]
        proc = subprocess.run(argv_child + (["--compile-only"] if args.compile_only else []), capture_output=True,
                              text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"{variant}: failed (rc {proc.returncode})\n{proc.stderr[-2000:]}", flush=True)
            continue
        results[variant] = json.loads(lines[-1][len("RESULT "):])
        if args.compile_only:
            print(json.dumps(results[variant]), flush=True)
        else:
            full = results.get("full", {}).get("median_us")
            median = results[variant]["median_us"]
            extra = f", full - it {full - median:+.1f} us" if full is not None else ""
            print(f"{args.kv} b{args.batch} h{args.heads} L{args.length} {variant:11s} {median:8.1f} us "
                  f"(mean {results[variant]['mean_us']:.1f}){extra}", flush=True)
    return 0 if len(results) == len(variants) else 1


if __name__ == "__main__":
    sys.exit(main())

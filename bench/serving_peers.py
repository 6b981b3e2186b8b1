"""The serving API (submission.mla_decode_with_kvcache, bf16 and fp8 caches) against MLA decode peers
on FlashMLA's own benchmark inputs, in one process, with the same inputs and timings.

    python bench/serving_peers.py [--grids A,B,C,S] [--flashmla BUILD] [--vllm-fp8 KIT] [--no-flashinfer] [--repeats 20]
                                  [--fa3 BUILD] [--json OUT] [--skip-32k] [--page 64]
                                  [--baseline FILE] [--variant NAME=FILE ...] [--no-check]

Grids (FlashMLA's benchmark: 128 requests, lengths normal around the mean s_k with spread s_k / 2,
64-token pages (--page: another size, for ours alone), a permuted block table, NaN in every slot
nobody attends; causal for s_q 2):
  A: h_q 128, s_q 1 and 2, s_k 4096 .. 32768 (compute-bound);  B: h_q 16, same;
  C: the leaderboard's 8 uniform shapes (h_q 16, s_q 1) as a paged cache;
  S: one long request among short ones (127 of 1024 tokens and one of 65536; h_q 16 and 128,
     s_q 1): a schedule by tokens takes about the time of the batch's tokens, not the long one's.
Providers: ours over the bf16 cache and over its fp8 copy (per-tensor scale); FlashMLA's dense
decode (bf16) when --flashmla names its build (the peers kit's flashmla_build.sh; skipped with a
note otherwise); FA3's MLA path (flash-attention's Hopper kernel with qv, as vLLM's FLASH_ATTN_MLA and
SGLang's fa3 backends call it: bench/fa3_mla.py) when --fa3 names its build, at vLLM's 16-token pages
("FA3 bf16", a view of the same cache) and on 64-token pages over a NaN-free copy ("FA3 bf16 p64");
vLLM's fp8 fork when --vllm-fp8 names a folder holding peer_vllm_fp8.py and its
build/ (vllm_fp8_build.sh); FlashInfer's MLA wrapper (bf16 and fp8 caches) when `flashinfer` imports,
unless --no-flashinfer (flashinfer_calls says how it is called), on the case's pages and on pages of one
token ("FlashInfer bf16 p1" / "fp8 p1": SGLang's layout, views of the same caches). --baseline FILE
adds another copy of submission.py (an earlier version, say `git show HEAD~1:submission.py`) as
the providers "base bf16" / "base fp8": an A/B of two versions in one process; --variant NAME=FILE
(repeatable) adds more copies the same way, as "NAME bf16" / "NAME fp8".
Per case and provider: event time (CUDA events around one call after an L2 flush; median and
mean of --repeats: host time inside the call counts where the GPU waits for it), profiler kernel
time (the GPU's own time per call, its kernels' durations summed, each call after an L2 flush:
no host time, no launch gaps; median of --repeats), CUDA-graph replay time (the call captured once
in a graph, as engines run decode, each replay timed by events after an L2 flush: graph_times), host
time of one eager call (perf_counter;
median; with the GPU idle before, and on a warm host with a spin kernel queued before: see
host_time), and the error against float64 attention over the bf16 values (rel. L2 of out over
every attended row; ours also lse's max abs error). Ratios: FlashMLA time / provider time (> 1: faster than FlashMLA),
per grid for the event, kernel and graph times.
"""
import argparse
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import re
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import fa3_mla  # noqa: E402  (bench/, beside this file: FA3's calls and the re-paged views)
import reference  # noqa: E402
import submission  # noqa: E402
import utils  # noqa: E402

FP8 = torch.float8_e4m3fn
SK = (4096, 8192, 16384, 32768)


def grid_cases(grids, skip_32k):
    """(grid, batch, s_q, h_q, mean s_k, varlen, causal, the last request's length or 0) of each
    requested grid."""
    cases = []
    for grid, h_q in (("A", 128), ("B", 16)):
        if grid in grids:
            cases += [(grid, 128, s_q, h_q, s_k, True, s_q > 1, 0) for s_q in (1, 2) for s_k in SK
                      if not (skip_32k and s_k == 32768)]
    if "C" in grids:
        cases += [("C", batch, 1, 16, kv, False, False, 0) for batch, kv in utils.benchmark_shapes()]
    if "S" in grids:
        cases += [("S", 128, 1, h_q, 1024, False, False, 65536) for h_q in (16, 128)]
    return cases


def within(cases, seconds, clock=time.monotonic):
    """The cases, until `seconds` have passed since the first was started (None: all of them); then
    a note of how many were left, so that a run under a time limit still ends with its summary."""
    start = clock()
    for done, case in enumerate(cases):
        if seconds is not None and clock() - start > seconds:
            print(f"NOTE: --max-seconds {seconds:g} reached: {len(cases) - done} of {len(cases)} cases not run",
                  flush=True)
            return
        yield case


def fp8_copy(cache):
    """The bf16 cache as fp8 with a per-tensor scale (amax over finite slots / 448), a chunk at a time."""
    flat = cache.view(-1, cache.shape[-1])
    amax = torch.zeros((), device=cache.device)
    for i in range(0, flat.shape[0], 1 << 20):
        amax = torch.maximum(amax, flat[i:i + (1 << 20)].float().nan_to_num(0.0).abs().max())
    scale = (amax / torch.finfo(FP8).max).clamp_min(1e-12)
    out = torch.empty(cache.shape, dtype=FP8, device=cache.device)
    out_flat = out.view(-1, cache.shape[-1])
    for i in range(0, flat.shape[0], 1 << 20):
        out_flat[i:i + (1 << 20)] = (flat[i:i + (1 << 20)].float() / scale).to(FP8)
    return out, scale.reshape(1).float()


def api_calls(module, name, case, cache8, scale8):
    """{name bf16, name fp8}: the module's serving API over the case's bf16 cache and its fp8 copy."""
    q, cache, table, lens, causal = case.q, case.k_cache, case.block_table, case.cache_seqlens, case.causal
    plan = module.get_mla_decode_metadata()[0]
    plan8 = module.get_mla_decode_metadata()[0]
    return {f"{name} bf16": lambda: module.mla_decode_with_kvcache(q, cache, table, lens, 512, plan, causal=causal),
            f"{name} fp8": lambda: module.mla_decode_with_kvcache(q, cache8, table, lens, 512, plan8, causal=causal,
                                                                  k_scale=scale8)}


def providers(case, args):
    """name -> zero-argument call returning (out, lse or None), for every provider available."""
    q, cache, table, lens, causal = case.q, case.k_cache, case.block_table, case.cache_seqlens, case.causal
    cache8, scale8 = fp8_copy(cache)
    calls = api_calls(submission, "ours", case, cache8, scale8)
    for name, module in args.variants:
        calls.update(api_calls(module, name, case, cache8, scale8))
    if args.flashmla:
        flash_mla = args.flashmla
        meta = flash_mla.get_mla_metadata()[0]
        calls["FlashMLA bf16"] = lambda: flash_mla.flash_mla_with_kvcache(q, cache, table, lens, 512, meta,
                                                                          causal=causal)
    if args.vllm_fp8:
        fn = args.vllm_fp8(q, cache, table, lens, causal)
        calls["vLLM fp8 fork"] = lambda: (fn(), None)
    if args.fa3:
        fa3_mla, fa3 = args.fa3
        calls.update(fa3_mla.fa3_calls(fa3, case, page=16))  # vLLM's default block size, a view of the same bytes
        if cache.shape[1] % 64 == 0:  # FA3's TMA path on 64-token pages, over a copy of the cache with NaN as 0
            calls["FA3 bf16 p64"] = fa3_mla.fa3_calls(fa3, case, page=64, nan_to_zero=True)["FA3 bf16"]
    if args.flashinfer:
        try:
            calls.update(flashinfer_calls(args.flashinfer, case, cache8, scale8))
            if cache.shape[1] > 1:  # SGLang's layout too: pages of one token
                calls.update(flashinfer_token_calls(args.flashinfer, case, cache8, scale8))
        except Exception as exc:  # a wrapper that cannot plan the case: say so, time the others
            print(f"FlashInfer: cannot plan b{q.shape[0]} s_q{q.shape[1]} h{q.shape[2]}: {exc!r}", flush=True)
    return calls


FLASHINFER_WORKSPACE_BYTES = 128 << 20  # the wrapper's split-k scratch: the size its docs recommend


def flashinfer_pages(block_table, cache_seqlens, page):
    """FlashInfer's page lists of the serving API's block table: (kv_indptr, kv_indices), int32,
    request b's pages at kv_indices[kv_indptr[b]:kv_indptr[b + 1]], the first cdiv(length, page)
    entries of its block-table row."""
    pages = (cache_seqlens.long() + page - 1) // page
    used = torch.arange(block_table.shape[1], device=block_table.device) < pages[:, None]
    kv_indptr = torch.zeros(len(pages) + 1, dtype=torch.int32, device=block_table.device)
    kv_indptr[1:] = pages.cumsum(0)
    return kv_indptr, block_table[used].int()  # row-major: request by request, pages in order


def flashinfer_calls(flashinfer, case, cache8, scale8):
    """{FlashInfer bf16, FlashInfer fp8}: FlashInfer's BatchMLAPagedAttentionWrapper (0.7.4's keyword
    form; its default backend: fa3 on sm_90) over the case's cache and its fp8 copy, q bf16 in both.

    As an engine calls it: plan() once per case, outside the timing (it copies the index arrays to
    the host, a sync, once per step in an engine), then run() timed. q and the cache go in packed
    (their last dim the 512 latent and 64 rope dims), no copy; query token i of request b is row
    b * s_q + i (qo_indptr), and its causal mask ends s_q - 1 - i tokens before the request's end,
    as ours. The fp8 copy is planned with scale_mode "kv-per-tensor" and run with its scale as
    ckv_scale and kpe_scale (each value read as stored x scale). No lse is asked for (None)."""
    q, cache, table, lens, causal = case.q, case.k_cache, case.block_table, case.cache_seqlens, case.causal
    batch, s_q, h_q, _ = q.shape
    page = cache.shape[1]
    kv_indptr, kv_indices = flashinfer_pages(table, lens, page)
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * s_q
    rows = q.reshape(batch * s_q, h_q, q.shape[-1])
    workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)

    def wrapper(kv_cache, scale):
        mla = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace)
        mla.plan(metadata=flashinfer.mla.MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, lens.int()),
                 num_heads=h_q, head_dim_ckv=reference.V_HEAD_DIM,
                 head_dim_kpe=reference.QK_HEAD_DIM - reference.V_HEAD_DIM, page_size=page, causal=causal,
                 sm_scale=reference.SM_SCALE, q_data_type=q.dtype, kv_data_type=kv_cache.dtype,
                 scale_mode="default" if scale is None else "kv-per-tensor")
        scales = {} if scale is None else {"ckv_scale": scale, "kpe_scale": scale}
        packed = kv_cache.view(kv_cache.shape[0], page, kv_cache.shape[-1])  # one latent row a token
        return lambda: mla.run(query=rows, kv_cache=packed, **scales).view(batch, s_q, h_q, reference.V_HEAD_DIM)
    run16 = wrapper(cache, None)
    run8 = wrapper(cache8, float(scale8))  # once per case, outside the timing
    return {"FlashInfer bf16": lambda: (run16(), None), "FlashInfer fp8": lambda: (run8(), None)}


def flashinfer_token_calls(flashinfer, case, cache8, scale8):
    """{FlashInfer bf16 p1, FlashInfer fp8 p1}: flashinfer_calls on pages of one token, as SGLang
    lays out its MLA cache for FlashInfer: views of the same caches and a block table of token ids
    (fa3_mla.repage), so the page lists hold every token's row."""
    cache1, table1 = fa3_mla.repage(case.k_cache, case.block_table, 1)
    cache8_1, _ = fa3_mla.repage(cache8, case.block_table, 1)
    one = dataclasses.replace(case, k_cache=cache1, block_table=table1)
    return {f"{name} p1": call for name, call in flashinfer_calls(flashinfer, one, cache8_1, scale8).items()}


def kernel_times(fn, repeats, flush):
    """(median, mean) in us of `repeats` calls, each timed by utils.time_call (events around one
    call after the flush)."""
    times = [utils.time_call(fn, "cuda", flush)[1] / 1e3 for _ in range(repeats)]
    return statistics.median(times), statistics.mean(times)


def graph_times(fn, repeats, flush, warmup=2):
    """(median, mean) in us of replays of fn() captured once in a CUDA graph, as an engine runs
    decode: `warmup` eager calls, the capture, then `repeats` replays, each timed by
    utils.time_call (events around one replay after the flush), which the GPU runs without the
    host's launch time or the gaps between the call's kernels that waiting on the host leaves.
    A provider that cannot be captured raises; the caller says so. The graph, and its memory pool
    with it, goes with the return."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = [utils.time_call(graph.replay, "cuda", flush)[1] / 1e3 for _ in range(repeats)]
    return statistics.median(times), statistics.mean(times)


def split_kernels(kernels, repeats, flush_kernels):
    """Each call's own GPU activities, as lists of (name, duration_us), from a profile of `repeats` x
    (flush, call): `kernels` the profile's GPU activities as (name, start_us, duration_us),
    `flush_kernels` the names one flush alone launches, in order. A call's activities are what runs
    between one flush's activities and the next's; a profile that does not hold `repeats` such
    flushes is an error, not a guess."""
    kernels = sorted(kernels, key=lambda k: k[1])
    width = len(flush_kernels)
    starts = [i for i in range(len(kernels) - width + 1)
              if [k[0] for k in kernels[i:i + width]] == list(flush_kernels)]
    if width == 0 or len(starts) != repeats or starts[0] != 0:
        raise RuntimeError(f"expected {repeats} flushes {list(flush_kernels)} opening the profile, "
                           f"found {len(starts)} in {[k[0] for k in kernels][:12]}")
    bounds = starts + [len(kernels)]
    return [[(k[0], k[2]) for k in kernels[bounds[i] + width:bounds[i + 1]]] for i in range(repeats)]


def call_times(calls):
    """Each call's GPU time (us): the sum of its own activities' durations."""
    return [sum(duration for _, duration in call) for call in calls]


def split_calls(kernels, repeats, flush_kernels):
    """Per-call GPU time (us) from a profile (split_kernels, call_times)."""
    return call_times(split_kernels(kernels, repeats, flush_kernels))


def kernel_label(name):
    """A kernel's name without its return type, namespaces, template and parameters: `void
    flash::fwd_kernel<...>(...)` -> `fwd_kernel`."""
    return name.split("<")[0].split("(")[0].split()[-1].split("::")[-1]


def kernel_parts(calls):
    """{kernel label: median over the calls of its time in a call (us)}, in the order the kernels
    first ran: how a provider's GPU time divides between its kernels."""
    per_call = [{} for _ in calls]
    for parts, call in zip(per_call, calls, strict=True):
        for name, duration in call:
            label = kernel_label(name)
            parts[label] = parts.get(label, 0.0) + duration
    labels = list(dict.fromkeys(label for parts in per_call for label in parts))
    return {label: statistics.median(parts.get(label, 0.0) for parts in per_call) for label in labels}


def _gpu_activities(fn):
    """(name, start_us, duration_us) of the GPU kernels, copies and sets fn() launched (profiler)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def profiler_times(fn, repeats, flush):
    """(median, mean) in us of the GPU's own time per call (split_kernels, call_times), each call
    after a flush, and its kernel_parts. The flush ends in a spin kernel of one cycle, so that a provider's own
    fill kernel (the flush's kind) cannot pass for a flush."""
    def marked_flush():
        flush()
        torch.cuda._sleep(1)
    flush_kernels = [k[0] for k in sorted(_gpu_activities(marked_flush), key=lambda k: k[1])]

    def calls():
        for _ in range(repeats):
            torch.cuda.synchronize()
            marked_flush()
            fn()
    per_call = split_kernels(_gpu_activities(calls), repeats, flush_kernels)
    times = call_times(per_call)
    return statistics.median(times), statistics.mean(times), kernel_parts(per_call)


def host_time(fn, repeats, busy=False):
    """Median host time of one eager call. busy=False: the GPU idle before, right after a sync (a
    host thread that waited through a long kernel runs the call on a cold core: the longer the
    provider's own kernel, the slower its host time looks); busy=True: after the sync the host
    spins 0.3 ms, then queues a ~0.5 ms spin kernel, so every provider's call runs on a warm core
    and only enqueues work (the Python and launch cost alone)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        if busy:
            warm_until = time.perf_counter() + 3e-4
            while time.perf_counter() < warm_until:
                pass
            torch.cuda._sleep(1_000_000)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def provider_times(fn, repeats, host_repeats, flush, where, busy=True):
    """Every timing of one provider on one case, as a row's fields: event time (median_us, mean_us:
    kernel_times), profiler kernel time (gpu_us, gpu_mean_us, kernels_us: profiler_times; NaN where
    the profile does not split into the calls), host time (host_us, and with `busy` host_busy_us:
    host_time), CUDA-graph replay time (graph_us, graph_mean_us: graph_times; NaN where the call
    cannot be captured). What cannot be measured is said after `where`."""
    median, mean = kernel_times(fn, repeats, flush)
    try:
        gpu, gpu_mean, parts = profiler_times(fn, repeats, flush)
    except RuntimeError as exc:  # a profile that does not split into the calls: no GPU time
        print(f"{where} profiler: {exc}", flush=True)
        gpu = gpu_mean = float("nan")
        parts = {}
    times = {"median_us": median, "mean_us": mean, "gpu_us": gpu, "gpu_mean_us": gpu_mean, "kernels_us": parts,
             "host_us": host_time(fn, host_repeats)}
    if busy:
        times["host_busy_us"] = host_time(fn, host_repeats, busy=True)
    try:
        times["graph_us"], times["graph_mean_us"] = graph_times(fn, repeats, flush)
    except Exception as exc:  # a provider that cannot be captured: no graph time
        print(f"{where} graph: {exc!r}", flush=True)
        times["graph_us"] = times["graph_mean_us"] = float("nan")
    return times


def errors(out, lse, exact_out, exact_lse):
    attended = torch.isfinite(exact_lse).permute(0, 2, 1)
    got, want = out.double()[attended], exact_out[attended]
    rel = ((got - want).norm() / want.norm()).item()
    lse_err = None
    if lse is not None:
        fin = torch.isfinite(exact_lse)
        lse_err = (lse.double()[fin] - exact_lse[fin]).abs().max().item()
    return rel, lse_err


def load_flashmla(build):
    """FlashMLA's Python interface over the dense-decode extension in `build` (flashmla_build.sh's)."""
    sys.path.insert(0, build)
    sys.modules["flash_mla.cuda"] = importlib.import_module("flash_mla_dense_ext")
    return importlib.import_module("flash_mla")


def load_variant(spec):
    """(name, module) of a --variant NAME=FILE: FILE loaded as a module of its own."""
    name, _, path = spec.partition("=")
    if not name or not path:
        raise SystemExit(f"--variant takes NAME=FILE, not {spec!r}")
    loader = importlib.util.spec_from_file_location(f"variant_{name}", path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return name, module


def load_peers(args):
    notes = []
    if args.flashmla:
        args.flashmla = load_flashmla(args.flashmla)
    else:
        notes.append("FlashMLA: skipped (no --flashmla build; docs/benchmarking.md says how to build it)")
    if args.vllm_fp8:
        sys.path.insert(0, args.vllm_fp8)
        args.vllm_fp8 = importlib.import_module("peer_vllm_fp8").load(os.path.join(args.vllm_fp8, "build"))
    else:
        notes.append("vLLM fp8 fork: skipped (no --vllm-fp8 folder)")
    if args.fa3:
        args.fa3 = (fa3_mla, fa3_mla.load(args.fa3))
    else:
        notes.append("FA3: skipped (no --fa3 build; docs/benchmarking.md says where its kit comes from)")
    args.flashinfer = None
    if args.no_flashinfer:
        notes.append("FlashInfer: skipped (--no-flashinfer)")
        return notes
    try:
        args.flashinfer = importlib.import_module("flashinfer")
        notes.append(f"FlashInfer {getattr(args.flashinfer, '__version__', '(version unknown)')}: "
                     "BatchMLAPagedAttentionWrapper, default backend")
    except ImportError as exc:
        notes.append(f"FlashInfer: skipped (not importable: {exc})")
    return notes


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--grids", default="A,B,C,S")
    parser.add_argument("--flashmla", default=None, help="FlashMLA's build folder (flashmla_build.sh DEST/build)")
    parser.add_argument("--vllm-fp8", default=None, help="folder with peer_vllm_fp8.py and build/")
    parser.add_argument("--fa3", default=None, help="FA3's build folder (its kit's build script's DEST/build)")
    parser.add_argument("--no-flashinfer", action="store_true", help="leave FlashInfer out where it imports")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--host-repeats", type=int, default=50)
    parser.add_argument("--skip-32k", action="store_true")
    parser.add_argument("--page", type=int, default=64, help="page size (FlashMLA and vLLM's fork read 64 only)")
    parser.add_argument("--no-check", action="store_true", help="no float64 reference (times only)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--baseline", default=None, help="another submission.py, timed as the providers base *")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FILE",
                        help="another submission.py, timed as the providers NAME *; repeatable")
    parser.add_argument("--providers", default=None, metavar="REGEX",
                        help="time only the providers whose name this regular expression finds")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="start no case after this many seconds; the summary covers the cases run")
    args = parser.parse_args()
    args.variants = [load_variant(spec) for spec in ([f"base={args.baseline}"] if args.baseline else []) + args.variant]
    notes = load_peers(args)
    for note in notes:
        print("NOTE:", note, flush=True)
    flush = utils.L2Flusher("default")
    rows = []
    for grid, batch, s_q, h_q, s_k, varlen, causal, long in within(
            grid_cases(args.grids.split(","), args.skip_32k), args.max_seconds):
        case = reference.generate_serving_input(batch, s_q, h_q, args.page, s_k, 1, varlen=varlen, causal=causal,
                                                kv="bf16", long=long, device="cuda")
        exact_out = exact_lse = None
        if not args.no_check:
            exact_out, exact_lse = reference.mla_decode_paged_float64(case.q, case.k_cache, case.block_table,
                                                                      case.cache_seqlens, causal=causal)
        tokens = sum(case.lengths)
        label = f"{grid} b{batch} s_q{s_q} h{h_q} s_k{s_k}" + (f" long{long}" if long else "")
        for name, fn in providers(case, args).items():
            if args.providers and not re.search(args.providers, name):
                continue
            try:
                out, lse = fn()
                torch.cuda.synchronize()
                rel, lse_err = (float("nan"), None) if exact_out is None else errors(out, lse, exact_out, exact_lse)
                times = provider_times(fn, args.repeats, args.host_repeats, flush, f"{label}: {name}")
            except Exception as exc:  # a peer that cannot take the case: say so, go on
                print(f"{label}: {name} failed: {exc!r}", flush=True)
                continue
            median = times["median_us"]
            row = {"grid": grid, "batch": batch, "s_q": s_q, "h_q": h_q, "s_k": s_k, "long": long, "causal": causal,
                   "provider": name, **times, "rel_l2": rel, "lse_err": lse_err, "tokens": tokens,
                   "tflops": 2 * tokens * s_q * h_q * (576 + 512) / median / 1e6,
                   "bf16_tb_s": tokens * 1152 / median / 1e6}
            rows.append(row)
            print(f"{label} {name:14s} {median:9.1f} us (mean {times['mean_us']:9.1f}) "
                  f"gpu {times['gpu_us']:9.1f}  graph {times['graph_us']:9.1f}  host {times['host_us']:6.1f} / "
                  f"busy {times['host_busy_us']:5.1f} us  {row['tflops']:6.1f} TFLOPS  "
                  f"{row['bf16_tb_s']:5.2f} TB/s(bf16)  "
                  f"rel {rel:.2e}" + (f"  lse {lse_err:.1e}" if lse_err is not None else "")
                  + "  [" + " + ".join(f"{k} {v:.1f}" for k, v in times["kernels_us"].items()) + "]", flush=True)
        del case, exact_out, exact_lse
        torch.cuda.empty_cache()
    print_summary(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"notes": notes, "rows": rows, "device": torch.cuda.get_device_name()}, f, indent=1)


def geomean(values):
    return math.exp(statistics.mean(math.log(v) for v in values))


def print_summary(rows):
    """Geomean per grid and provider of event time, profiler GPU time and host time; FlashMLA's time
    over the provider's (event, GPU) where FlashMLA ran the same cases."""
    by = {}
    for row in rows:
        by.setdefault((row["grid"], row["provider"]), []).append(row)
    for (grid, name), group in sorted(by.items()):
        peer = by.get((grid, "FlashMLA bf16"))
        ratio = ""
        if peer and len(peer) == len(group):
            ratio = "  FlashMLA / this: %.2fx (gpu %.2fx, graph %.2fx)" % tuple(
                geomean(p[key] / r[key] for p, r in zip(peer, group, strict=True))
                for key in ("median_us", "gpu_us", "graph_us"))
        print(f"grid {grid} {name:14s} event geomean {geomean(r['median_us'] for r in group):9.1f} us  "
              f"gpu {geomean(r['gpu_us'] for r in group):9.1f} us  graph {geomean(r['graph_us'] for r in group):9.1f} "
              f"us  host {geomean(r['host_us'] for r in group):6.1f} "
              f"us (busy GPU {geomean(r['host_busy_us'] for r in group):5.1f} us){ratio}")
    for line in fastest_peer_lines(rows):
        print(line)


BF16_PEERS = ("FlashMLA bf16", "FA3 bf16", "FA3 bf16 p64", "FlashInfer bf16", "FlashInfer bf16 p1")
FP8_PEERS = ("vLLM fp8 fork", "FlashInfer fp8", "FlashInfer fp8 p1")


def fastest_peer_lines(rows, ours="ours", key="gpu_us"):
    """Per grid and cache, the fastest peer (the lowest geomean of `key` over the cases ours ran,
    among the peers that ran every one of them) and its time over ours: the issue's "the fastest
    bf16 peer" (FlashMLA, FA3 at each page size, FlashInfer at each) and the fastest fp8 one."""
    times = {(row["grid"], row["provider"], row["batch"], row["s_q"], row["h_q"], row["s_k"], row["long"]): row[key]
             for row in rows}
    lines = []
    for grid in sorted({row["grid"] for row in rows}):
        for cache, peers in (("bf16", BF16_PEERS), ("fp8", FP8_PEERS)):
            mine = [k[2:] for k in times if k[:2] == (grid, f"{ours} {cache}")]
            if not mine:
                continue
            ran = {p: [times[(grid, p, *case)] for case in mine if (grid, p, *case) in times] for p in peers}
            ran = {p: t for p, t in ran.items() if len(t) == len(mine)}
            if not ran:
                continue
            best = min(ran, key=lambda p: geomean(ran[p]))
            ratio = geomean(ran[best][i] / times[(grid, f"{ours} {cache}", *case)] for i, case in enumerate(mine))
            lines.append(f"grid {grid} {cache}: fastest peer {best} ({geomean(ran[best]):.1f} us); "
                         f"its time / {ours} {cache}'s: {ratio:.2f}x")
    return lines


if __name__ == "__main__":
    main()

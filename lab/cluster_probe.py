"""The split merge's synchronisation and partial traffic, alone: today's global ticket against a
hardware cluster barrier, and the partials through L2 against distributed shared memory (DSMEM).

    python lab/cluster_probe.py [--repeats 40] [--l2-flush runner] [--configs 4x16,32x4,...]
    python lab/cluster_probe.py --compile-only      # sm_90 compile of every variant, no GPU
    python lab/cluster_probe.py --ab A.py B.py [...] [--repeats 80] [--calls-in-a-row 100]

--ab: submission copies compared as tools/ab_probe.py --whole does (its compare_whole: first call,
float64 check, host time, GPU time interleaved), with each module's candidate race off (every
table row runs its own route, the same in every copy: the A/B is of the kernels, not of a race's
picks) and, first, per shape: every module's output bitwise equal to the first module's, the
same over --calls-in-a-row calls (repeatable; a missing release/acquire in a merge shows as a
difference), finite, and in a fresh tensor (no input or earlier output aliased).

One Gluon kernel, the epilogue of the Hopper kernel's split merge and nothing before it: program
pid = row * S + split (a 1-D grid of rows x S splits) stores a 16 x 512 float32 partial and 16 lse
values, synchronises with the other splits of its row, then merges 512 / S dims of the row from all
S partials (the same layout and arithmetic as submission.py's _merge_slice) and stores them.
Variants (SYNC, EXCHANGE):
  SYNC     0 none (wrong results: the floor of the rest), 1 ticket (submission.py's cooperative
           merge: atomic acq_rel add, acquire spin until the row's last split), 2 cluster barrier
           (barrier.cluster.arrive.release + wait.acquire; the kernel launched with clusters of S)
  EXCHANGE 0 nothing stored or merged (the synchronisation alone), 1 partials through global
           memory (.cg loads, as today), 2 partials in each program's shared memory, read by the
           row's other programs through DSMEM (mapa + ld.shared::cluster; a second cluster
           barrier keeps every program's shared memory alive until its peers have read it).

Cluster launches: the kernel is compiled with num_ctas = 1 (program_id(0) is %ctaid.x, no cluster
directive in the PTX) and launched through Triton's own launcher with a cluster size in the packed
metadata (the launcher sets CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION to it and multiplies grid x by
it; at 16 it also allows the non-portable size). Compiling with num_ctas > 1 instead makes
program_id the cluster's index (%clusterid.x) and needs a CTA basis (cga_layout) on every layout.

Timing: each (config, variant) one launch between CUDA events after the flush, interleaved, medians;
inside the kernel %globaltimer at entry, after the stores, after the synchronisation and after the
merge (ns), medians over programs and repeats. Every merged output is checked against float64.
"""
import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import triton  # noqa: E402

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    HAVE_GLUON = hasattr(triton, "constexpr_function")
except Exception:  # a Triton without the NVIDIA Gluon dialect
    HAVE_GLUON = False

HEADS, LATENT, WARPS = 16, 512, 4
DEFAULT_CONFIGS = "4x16,32x4,64x2,4x32,32x8,64x4"  # rows x splits of the leaderboard's cooperative rows
VARIANTS = {  # name -> (SYNC, EXCHANGE)
    "none/none": (0, 0), "ticket/none": (1, 0), "cluster/none": (2, 0),
    "none/global": (0, 1), "ticket/global": (1, 1), "cluster/global": (2, 1), "cluster/dsmem": (2, 2),
}
CLUSTER_MAX = 16


def parse_configs(text):
    """'4x16,32x4' -> [(4, 16), (32, 4)]; splits a power of two in 2..64."""
    configs = []
    for item in text.split(","):
        rows, splits = (int(v) for v in item.lower().split("x"))
        if rows < 1 or splits not in (2, 4, 8, 16, 32, 64):
            raise ValueError(f"bad config {item!r}: rows >= 1, splits a power of two in 2..64")
        configs.append((rows, splits))
    return configs


def variant_runs(variant, splits):
    """Whether a variant can run at this split count (a cluster holds at most 16 programs)."""
    return VARIANTS[variant][0] != 2 or splits <= CLUSTER_MAX


if HAVE_GLUON:
    @triton.constexpr_function
    def _partial_layout(warps):
        """(heads x dims): 4 consecutive dims per thread (16-byte stores), 64 floats per thread."""
        return gl.BlockedLayout([1, 4], [1, 32], [warps, 1], [1, 0])

    from submission import _merge_layout  # the merge's own layout: all splits in-thread

    @triton.constexpr_function
    def _flat_shared(order):
        return gl.SwizzledSharedLayout(1, 1, 1, order)

    @gluon.jit
    def _now(dep):
        """%globaltimer (ns), after `dep` is computed (a data dependence orders it)."""
        return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep], dtype=gl.int64,
                                         is_pure=False, pack=1)

    @gluon.jit
    def _cluster_sync(dep):
        """Every program of the cluster past this point has seen every program's earlier writes
        (release on arrive, acquire on wait, cluster scope)."""
        return gl.inline_asm_elementwise(
            "barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n\tmov.u32 $0, 0;",
            "=r,r", [dep], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _dsmem_load4(local_addr, rank):
        """4 consecutive float32 at shared address local_addr of cluster program `rank` (pack of 4
        consecutive register elements: the merge layout's 4 consecutive dims)."""
        return gl.inline_asm_elementwise(
            "{\n\t.reg .b32 a;\n\tmapa.shared::cluster.u32 a, $4, $8;\n\t"
            "ld.shared::cluster.v4.f32 {$0, $1, $2, $3}, [a];\n\t}",
            "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [local_addr, rank], dtype=gl.float32, is_pure=False, pack=4)

    @gluon.jit
    def _dsmem_load1(local_addr, rank):
        return gl.inline_asm_elementwise(
            "{\n\t.reg .b32 a;\n\tmapa.shared::cluster.u32 a, $1, $2;\n\tld.shared::cluster.f32 $0, [a];\n\t}",
            "=r,r,r", [local_addr, rank], dtype=gl.float32, is_pure=False, pack=1)

    @gluon.jit
    def _shared_base(dep):
        return gl.inline_asm_elementwise("mov.u32 $0, global_smem;", "=r,r", [dep], dtype=gl.int32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _epilogue_probe(PARTIAL_O, PARTIAL_LSE, TICKETS, OUT, TIMES, num_rows,
                        SYNC: gl.constexpr, EXCHANGE: gl.constexpr, NUM_SPLITS: gl.constexpr,
                        WARPS: gl.constexpr, NUM_HEADS: gl.constexpr = 16, LATENT: gl.constexpr = 512):
        pid = gl.program_id(0)
        t_entry = _now(pid)
        row = pid // NUM_SPLITS
        split = pid % NUM_SPLITS
        P: gl.constexpr = _partial_layout(WARPS)
        heads = gl.expand_dims(gl.arange(0, NUM_HEADS, layout=gl.SliceLayout(1, P)), 1)
        dims = gl.expand_dims(gl.arange(0, LATENT, layout=gl.SliceLayout(0, P)), 0)
        # a partial that differs per program, head and dim; lse per head (base 2)
        partial = ((pid * 7 + heads * 3 + dims) % 13).to(gl.float32) * 0.125 - 0.75
        LSE_L: gl.constexpr = gl.SliceLayout(1, P)
        head_ids = gl.arange(0, NUM_HEADS, layout=LSE_L)
        lse = (pid % 5).to(gl.float32) * 0.5 + head_ids.to(gl.float32) * 0.0625
        if EXCHANGE == 2:
            buf = gl.allocate_shared_memory(gl.float32, [NUM_HEADS, LATENT], _flat_shared([1, 0]))
            lse_buf = gl.allocate_shared_memory(gl.float32, [NUM_HEADS], _flat_shared([0]))
            buf.store(partial)
            lse_buf.store(lse)
            gl.thread_barrier()
        elif EXCHANGE == 1:
            gl.store(PARTIAL_O + pid * (NUM_HEADS * LATENT) + heads * LATENT + dims, partial)
            gl.store(PARTIAL_LSE + pid * NUM_HEADS + head_ids, lse)
            gl.thread_barrier()
        t_stored = _now(pid)
        synced = pid * 0
        if SYNC == 1:
            counter = TICKETS + row
            drawn = gl.atomic_add(counter, 1, sem="acq_rel")
            last_ticket = (drawn & (-NUM_SPLITS)) + NUM_SPLITS
            seen = drawn + 1
            while seen - last_ticket < 0:
                seen = gl.atomic_add(counter, 0, sem="acquire")
            synced = seen * 0
        elif SYNC == 2:
            synced = _cluster_sync(pid)
        t_synced = _now(synced)
        checksum = synced.to(gl.float32)
        if EXCHANGE != 0:
            SLICE: gl.constexpr = LATENT // NUM_SPLITS
            M: gl.constexpr = _merge_layout(NUM_SPLITS, SLICE, NUM_HEADS, WARPS)
            s = gl.arange(0, NUM_SPLITS, layout=gl.SliceLayout(1, gl.SliceLayout(2, M)))
            d = gl.arange(0, SLICE, layout=gl.SliceLayout(0, gl.SliceLayout(2, M)))
            h = gl.arange(0, NUM_HEADS, layout=gl.SliceLayout(0, gl.SliceLayout(1, M)))
            s = gl.expand_dims(gl.expand_dims(s, 1), 2)
            d = gl.expand_dims(gl.expand_dims(d, 0), 2)
            h = gl.expand_dims(gl.expand_dims(h, 0), 1)
            dim_begin = split * SLICE
            first = row * NUM_SPLITS
            if EXCHANGE == 1:
                lse_all = gl.load(PARTIAL_LSE + (first + s) * NUM_HEADS + h, cache_modifier=".cg")
                parts = gl.load(PARTIAL_O + (first + s) * (NUM_HEADS * LATENT) + h * LATENT + dim_begin + d,
                                cache_modifier=".cg")
            else:
                base = _shared_base(pid)
                rank = s + h * 0
                lse_addr = base + NUM_HEADS * LATENT * 4 + h * 4 + s * 0
                lse_all = _dsmem_load1(lse_addr, rank)
                addr = base + (h * LATENT + dim_begin + d) * 4 + s * 0
                if NUM_SPLITS <= 16:
                    parts = _dsmem_load4(addr, rank + d * 0)
                else:
                    parts = _dsmem_load1(addr, rank + d * 0)
            weight = gl.exp2(lse_all - gl.expand_dims(gl.max(lse_all, 0), 0))
            merged = gl.sum(parts * weight, 0) / gl.sum(weight, 0)
            od = gl.arange(0, SLICE, layout=gl.SliceLayout(1, gl.SliceLayout(0, M)))
            oh = gl.arange(0, NUM_HEADS, layout=gl.SliceLayout(0, gl.SliceLayout(0, M)))
            gl.store(OUT + row * (NUM_HEADS * LATENT) + gl.expand_dims(oh, 0) * LATENT + dim_begin
                     + gl.expand_dims(od, 1), merged)
            checksum = gl.sum(gl.sum(merged, 0), 0) * 0.0
            if EXCHANGE == 2:  # peers may still read this program's shared memory
                checksum = checksum + _cluster_sync(pid).to(gl.float32)
                buf._keep_alive()  # the compiler does not see the DSMEM reads: no reuse before here
                lse_buf._keep_alive()
        t_merged = _now(checksum.to(gl.int32))
        gl.store(TIMES + pid * 4, t_entry)
        gl.store(TIMES + pid * 4 + 1, t_stored)
        gl.store(TIMES + pid * 4 + 2, t_synced)
        gl.store(TIMES + pid * 4 + 3, t_merged)


def compile_variant(sync, exchange, splits, target=None):
    """triton.compile of one variant (sm_90 unless target is given): the compiled kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = {"PARTIAL_O": "*fp32", "PARTIAL_LSE": "*fp32", "TICKETS": "*i32", "OUT": "*fp32",
                 "TIMES": "*i64", "num_rows": "i32", "SYNC": "constexpr", "EXCHANGE": "constexpr",
                 "NUM_SPLITS": "constexpr", "WARPS": "constexpr", "NUM_HEADS": "constexpr", "LATENT": "constexpr"}
    constexprs = {"SYNC": sync, "EXCHANGE": exchange, "NUM_SPLITS": splits, "WARPS": WARPS,
                  "NUM_HEADS": HEADS, "LATENT": LATENT}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(5)}
    src = GluonASTSource(fn=_epilogue_probe, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=target or GPUTarget("cuda", 90, 32), options={"num_warps": WARPS})


def launch_arguments(args, sync, exchange, splits):
    """Every kernel argument in signature order, the constexprs too (Triton's launcher takes them
    all, as CompiledKernel's own runner passes them)."""
    return (*args, sync, exchange, splits, WARPS, HEADS, LATENT)


def cluster_runner(compiled, grid_x, cluster):
    """Launch `compiled` (num_ctas = 1) with grid_x * cluster programs in clusters of `cluster`
    through Triton's launcher: its packed metadata is (num_warps, num_ctas, shared), and num_ctas
    is what it passes as the cluster size. Called with launch_arguments(...)."""
    compiled._init_handles()
    num_warps, _, shared = compiled.packed_metadata
    packed = (num_warps, cluster, shared)

    def run(*args):
        device = triton.runtime.driver.active.get_current_device()
        stream = triton.runtime.driver.active.get_current_stream(device)
        compiled.run(grid_x, 1, 1, stream, compiled.function, packed, None, None, None, *args)
    return run


def max_active_clusters(compiled, cluster):
    """cuOccupancyMaxActiveClusters for this kernel at this cluster size (None where unavailable)."""
    utils_ = triton.runtime.driver.active.utils
    query = getattr(utils_, "cuOccupancyMaxActiveClusters", None)
    if query is None:
        return None
    compiled._init_handles()
    return query(compiled.function, compiled.metadata.shared, cluster)


def expected_merge(rows, splits):
    """float64 merge of the partials the kernel makes, (rows, heads, latent)."""
    pid = torch.arange(rows * splits, dtype=torch.float64).view(rows, splits, 1, 1)
    heads = torch.arange(HEADS, dtype=torch.float64).view(1, 1, HEADS, 1)
    dims = torch.arange(LATENT, dtype=torch.float64).view(1, 1, 1, LATENT)
    partial = torch.remainder(pid * 7 + heads * 3 + dims, 13) * 0.125 - 0.75
    lse = torch.remainder(pid, 5) * 0.5 + heads * 0.0625  # (rows, splits, heads, 1)
    weight = torch.exp2(lse - lse.amax(1, keepdim=True))
    return (partial * weight).sum(1) / weight.sum(1)


def compile_only(configs):
    import re
    failures = 0
    for splits in sorted({s for _, s in configs}):
        for name, (sync, exchange) in VARIANTS.items():
            if not variant_runs(name, splits):
                continue
            try:
                compiled = compile_variant(sync, exchange, splits)
            except Exception as exc:  # report every variant, then fail
                failures += 1
                print(f"S={splits} {name}: FAILED {type(exc).__name__}: {str(exc)[-800:]}")
                continue
            ptx = compiled.asm["ptx"]
            counts = {key: len(re.findall(pattern, ptx)) for key, pattern in {
                "barrier.cluster": r"barrier\.cluster\.(?:arrive|wait)", "mapa": r"\bmapa\.",
                "ld.shared::cluster": r"ld\.shared::cluster", "atom": r"\batom\.", "cluster directive":
                r"\.(?:explicitcluster|reqnctapercluster)"}.items()}
            print(f"S={splits} {name}: shared {compiled.metadata.shared} B, " +
                  ", ".join(f"{k} {v}" for k, v in counts.items()))
    return 1 if failures else 0


def check_modules(modules, names, calls_in_a_row, broken):
    """The bitwise checks of --ab (see the module docstring); returns the number of failures and
    adds the names of modules that raised to `broken`."""
    import reference
    import utils
    failures = 0
    for batch, kv in utils.benchmark_shapes():
        data = reference.generate_input(batch, 1, kv, 7)
        truth = reference.attention_float64(data)
        tensors = [t for t in data if isinstance(t, torch.Tensor)]
        tensors += [t for part in data if isinstance(part, dict) for value in part.values()
                    for t in (value if isinstance(value, tuple) else (value,)) if isinstance(t, torch.Tensor)]
        inputs = [t.data_ptr() for t in tensors]
        first = None
        for name, module in zip(names, modules, strict=True):
            if name in broken:
                continue
            try:
                outs = [module.custom_kernel(data) for _ in range(calls_in_a_row)]
                torch.cuda.synchronize()
            except Exception as exc:  # a variant that fails is reported and left out of the timing
                print(f"check bs{batch} kv{kv} {name}: raised {type(exc).__name__}: {str(exc)[-600:]}", flush=True)
                broken.add(name)
                failures += 1
                continue
            problems = []
            if len({o.data_ptr() for o in outs[-2:]}) < 2 or outs[-1].data_ptr() in inputs:
                problems.append("aliased output")
            if not torch.isfinite(outs[0]).all():
                problems.append("not finite")
            differing = sum(not torch.equal(o, outs[0]) for o in outs[1:])
            if differing:
                problems.append(f"{differing} of {calls_in_a_row - 1} repeats differ")
            if first is None:
                first = outs[0]
            elif not torch.equal(outs[0], first):
                diff = (outs[0].float() - first.float()).abs().max().item()
                problems.append(f"differs from {names[0]} (max abs {diff:.3g})")
            error = float((outs[0].double() - truth).norm() / truth.norm())
            route = getattr(module, "LAST_ROUTE", "?")
            print(f"check bs{batch} kv{kv} {name}: rel L2 {error:.5f}, {route}: "
                  f"{'; '.join(problems) or 'ok'}", flush=True)
            failures += bool(problems)
    return failures


def ab(paths, repeats, flush_mode, calls_in_a_row):
    import eval as runner
    import utils
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import ab_probe
    modules = [runner.load_submission(path, f"ab_{i}") for i, path in enumerate(paths)]
    for module in modules:
        module.RACE = False
    names = [os.path.basename(path) for path in paths]
    broken = set()
    failures = check_modules(modules, names, calls_in_a_row, broken)
    print(f"checks: {failures} failing", flush=True)
    for name, module in zip(names, modules, strict=True):
        for key, (compiled, packed, _) in getattr(module, "_CLUSTER_LAUNCHES", {}).items():
            rows, cluster = key[1], key[2]
            print(f"{name}: {rows} clusters of {cluster}, {packed[2]} B shared: max active clusters "
                  f"{max_active_clusters(compiled, cluster)}", flush=True)
    kept = [(path, module) for path, name, module in zip(paths, names, modules, strict=True) if name not in broken]
    ab_probe.compare_whole([m for _, m in kept], argparse.Namespace(modules=[p for p, _ in kept], repeats=repeats),
                           utils.L2Flusher(flush_mode))
    return 1 if failures else 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, type=parse_configs)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--l2-flush", default="runner", choices=("default", "runner", "none"))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--ab", nargs="+", metavar="SUBMISSION", help="submission copies to check and time")
    parser.add_argument("--calls-in-a-row", type=int, default=100)
    args = parser.parse_args(argv)
    if args.ab:
        return ab(args.ab, args.repeats, args.l2_flush, args.calls_in_a_row)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    if not HAVE_GLUON:
        print("cluster_probe: no Gluon in this Triton")
        return 2
    if args.compile_only:
        return compile_only(args.configs)
    import utils
    flush = utils.L2Flusher(args.l2_flush)
    device = torch.device("cuda")
    print(f"device {torch.cuda.get_device_name()}, flush {args.l2_flush}, repeats {args.repeats}")
    results = {}
    for rows, splits in args.configs:
        programs = rows * splits
        partial_o = torch.empty(programs, HEADS, LATENT, dtype=torch.float32, device=device)
        partial_lse = torch.empty(programs, HEADS, dtype=torch.float32, device=device)
        tickets = torch.zeros(rows, dtype=torch.int32, device=device)
        truth = expected_merge(rows, splits)
        calls = {}
        for name in variants:
            if not variant_runs(name, splits):
                continue
            sync, exchange = VARIANTS[name]
            compiled = compile_variant(sync, exchange, splits)
            out = torch.full((rows, HEADS, LATENT), float("nan"), dtype=torch.float32, device=device)
            times = torch.zeros(programs, 4, dtype=torch.int64, device=device)
            launch = cluster_runner(compiled, rows if sync == 2 else programs, splits if sync == 2 else 1)
            args_ = launch_arguments((partial_o, partial_lse, tickets, out, times, rows), sync, exchange, splits)
            try:
                launch(*args_)
                torch.cuda.synchronize()
            except Exception as exc:  # reported; the other variants go on
                print(f"{rows}x{splits} {name}: launch failed: {type(exc).__name__}: {str(exc)[-400:]}", flush=True)
                continue
            if exchange != 0 and sync != 0:
                error = float((out.double().cpu() - truth).norm() / truth.norm())
                if error > 1e-6:
                    print(f"{rows}x{splits} {name}: WRONG merge, rel. error {error:.3g}", flush=True)
            if sync == 2:
                print(f"{rows}x{splits} {name}: {compiled.metadata.shared} B shared, max active clusters of "
                      f"{splits}: {max_active_clusters(compiled, splits)} (the grid has {rows})", flush=True)
            calls[name] = (launch, args_, times)
        samples = {name: [] for name in calls}
        phases = {name: [] for name in calls}
        for _ in range(args.repeats):
            for name, (launch, args_, _times) in calls.items():
                _, ns = utils.time_call(lambda launch=launch, args_=args_: launch(*args_), flush=flush)
                samples[name].append(ns / 1e3)
                t = args_[4].cpu().double()
                phases[name].append(((t[:, 1] - t[:, 0]), (t[:, 2] - t[:, 1]), (t[:, 3] - t[:, 2]),
                                     (t[:, 3].max() - t[:, 0].min())))
        for name in calls:
            store = torch.cat([p[0] for p in phases[name]]).median().item() / 1e3
            sync_t = torch.cat([p[1] for p in phases[name]])
            merge_t = torch.cat([p[2] for p in phases[name]]).median().item() / 1e3
            span = statistics.median(float(p[3]) for p in phases[name]) / 1e3
            results[(rows, splits, name)] = {
                "event": statistics.median(samples[name]), "store": store,
                "sync": sync_t.median().item() / 1e3, "sync_max": sync_t.max().item() / 1e3,
                "merge": merge_t, "span": span}
        print(f"\n{rows}x{splits} ({programs} programs): event median us | in-kernel medians us: store, sync "
              f"(max), merge+store, programs' span")
        for name in calls:
            r = results[(rows, splits, name)]
            print(f"  {name:15s} {r['event']:6.2f} | {r['store']:5.2f} {r['sync']:5.2f} ({r['sync_max']:5.2f}) "
                  f"{r['merge']:5.2f} {r['span']:6.2f}", flush=True)
    print("\nsummary, event medians us (ticket/global = today):")
    print("config     " + " ".join(f"{v:>14s}" for v in variants))
    for rows, splits in args.configs:
        cells = [results.get((rows, splits, v)) for v in variants]
        print(f"{rows:>3}x{splits:<6} " + " ".join(f"{c['event']:14.2f}" if c else f"{'-':>14s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())

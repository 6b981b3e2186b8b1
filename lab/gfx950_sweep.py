#!/usr/bin/env python3
"""Compile sweep of the portable Triton routes for gfx950 (MI355X), without a GPU, and the picks.

For each racing row of AITER_ROUTE_TABLE (a row with "candidates"; its split count is that of
the Triton candidates it already races), three kernels

    triton_fp8, triton_mxfp4 qk_dot_scaled "e4m3", triton_mxfp4 "none"

are compiled ahead of time for gfx950 over the route parameters

    block_n 32 / 64 / 128, num_warps 4 / 8, num_stages 1 / 2 / 3

and the AMD compile knobs, which no route takes: this tool adds them as compile "options" to the
entries of the module's own compile plans (KNOB_VALUES below)

    waves_per_eu 0 / 1 / 2, matrix_instr_nonkdim 16 / 32

through tools/kernel_report.py (the same plan, the same tt.pointer_range marks as the HIP JIT,
the same parsers). Pruned before compiling, because the combination cannot be honoured:
waves_per_eu below num_warps / 4 (a workgroup of num_warps waves puts num_warps / 4 on each SIMD;
LLVM then allocates registers as for num_warps / 4, and the code is the default's). kpack is not
swept: gfx950 replaces anything but 1.

Recorded per configuration: VGPRs, AGPRs, SGPRs, spills and scratch, LDS bytes, waves per SIMD
(tools/kernel_asm.py amd_occupancy), LLVM's own occupancy, the matrix instructions of the hot
loop, the global / buffer loads of the hot loop and their widest per-lane width, a hash of the
amdgcn (equal hashes: the same code), and the compile time. Results are cached in a JSON file
(default lab/gfx950_sweep.json) keyed by configuration, Triton version and a hash of the
kernels' code (docstrings and comments left out): a rerun compiles only what is missing or stale.

The pick (at most three new configurations per racing row, one per kernel), from the configs
that are eligible:
  - compiled, 0 spills, 0 scratch, LDS within 160 KiB, at least one workgroup resident per CU;
  - the hot loop holds its kernel's intended matrix instructions: fp8 MFMA (triton_fp8),
    v_mfma_scale (mxfp4 "e4m3"), any MFMA (mxfp4 "none");
  - the hot loop's widest load is 128 bits per lane (dwordx4: full-width KV reads);
  - a different tile from the row's existing candidate of that kernel: block_n, num_warps,
    num_stages or matrix_instr_nonkdim differ (waves_per_eu alone is a scheduling hint), and
    different code (amdgcn hash);
  - no AMD knob set: a route table can only take route parameters. The best-ranked eligible
    point that sets a knob is reported beside the pick when it ranks ahead of it;
ranked for the row's own grid (batch x splits programs over the MI355X's 256 CUs: at most one
program per CU on every racing row but bs 256 / kv 8192, so waves per SIMD from occupancy alone
say little) by, in order:
  1. KV bytes in flight per CU (more: the decode is bound by reading the cache): programs per CU
     (the fewer of ceil(programs / 256) and the workgroups that fit a CU) x block_n x bytes per
     token (submission.KV_BYTES_PER_TOKEN) x max(num_stages - 1, 1) tiles requested ahead;
  2. more num_stages (the next tile's load overlaps this tile's MFMAs);
  3. more waves per SIMD resident for that grid (programs per CU x num_warps / 4);
  4. fewer VGPR+AGPR; the backend's own knob choices first (waves_per_eu 0, matrix_instr_nonkdim
     16: left unset); the order of the grid.

Runtime: 270 compiles per split count (1-9 s each; matrix_instr_nonkdim 32 takes the longest).
matrix_instr_nonkdim 32 is compiled at the first split count only, and at the others only where
one of those compiled eligible (every dot here has N = 16, the heads: a 32 x 32 tile pads it). By
default the grid is compiled at every racing row's split count. With ``--full-splits 1,2`` the
whole grid is compiled at those split counts only; at the others (NUM_SPLITS changes only the
code after the KV loop: partial stores and the merge) the ``--shortlist`` best-ranked eligible
points of the largest full split count are compiled, with the row's existing candidate, and the
picks come from those exact compiles.

Usage
    python lab/gfx950_sweep.py [--jobs 2] [--cache lab/gfx950_sweep.json] [--full-splits 1,2]
                                 [--shortlist 12] [--no-compile] [--markdown] [--picks-json PATH]
Seconds from the cache.
"""
from __future__ import annotations

import argparse
import ast
import concurrent.futures
import copy
import hashlib
import inspect
import itertools
import json
import multiprocessing
import os
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import submission  # noqa: E402  (route_label, KV_BYTES_PER_TOKEN, ROUTE_INFO)
from tools import kernel_asm as ka  # noqa: E402
from tools import kernel_report as kr  # noqa: E402

TARGET = "gfx950"
DEFAULT_CACHE = REPO_ROOT / "lab" / "gfx950_sweep.json"
KERNELS = {  # name -> (route, fixed params)
    "fp8": ("triton_fp8", {}),
    "mxfp4_e4m3": ("triton_mxfp4", {"qk_dot_scaled": "e4m3"}),
    "mxfp4_none": ("triton_mxfp4", {"qk_dot_scaled": "none"}),
}

# The AMD compile knobs: options of Triton's HIP backend, which the CUDA backend does not have.
#   waves_per_eu: LLVM's "amdgpu-waves-per-eu" = "N, N": registers are allocated for exactly N
#       waves per SIMD (0: no hint). A workgroup of num_warps waves puts num_warps / 4 on each SIMD,
#       so N below that cannot be honoured (LLVM then allocates as for num_warps / 4).
#   matrix_instr_nonkdim: the M = N size of the MFMA tiles, 16 or 32 (0: Triton picks; 16 here).
#   kpack: gfx942 only (1 or 2); on gfx950 Triton replaces anything but 1 by 1, with a warning.
KNOB_VALUES = {"waves_per_eu": tuple(range(9)), "matrix_instr_nonkdim": (0, 16, 32), "kpack": (1, 2)}
HIP_TARGETS = ("gfx950", "gfx942")  # tools/kernel_report.py's names of the targets with these options
KNOB_DEFAULTS = {"waves_per_eu": 0, "matrix_instr_nonkdim": 16}  # the backend's choice for these kernels
GRID = {"block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (1, 2, 3), "waves_per_eu": (0, 1, 2),
        "matrix_instr_nonkdim": (16, 32)}
TILE_KEYS = ("block_n", "num_warps", "num_stages", "matrix_instr_nonkdim")
MAX_PICKS_PER_ROW = 3


def knob_options(**knobs):
    """{name: value} of the knobs that are set (not None), each checked against KNOB_VALUES."""
    options = {}
    for name, value in knobs.items():
        if name not in KNOB_VALUES:
            raise ValueError(f"{name} is no AMD compile knob: choose from {', '.join(KNOB_VALUES)}")
        if value is None:
            continue
        if isinstance(value, bool) or value not in KNOB_VALUES[name]:
            raise ValueError(f"{name} must be None or one of {KNOB_VALUES[name]}, not {value!r}")
        options[name] = value
    return options


def with_knobs(entry, options):
    """A compile-plan entry with the AMD knobs `options` (checked) added to its compile "options";
    an entry with any is compiled for the HIP targets only."""
    options = knob_options(**options)
    if not options:
        return dict(entry)
    return dict(entry, options={**(entry.get("options") or {}), **options}, targets=list(HIP_TARGETS))


def feasible(knobs):
    """False for a combination that cannot be honoured (see the module docstring)."""
    return not (knobs["waves_per_eu"] and knobs["waves_per_eu"] < knobs["num_warps"] // 4)


def grid():
    """Every feasible sweep point (route parameters and knobs), in grid order."""
    keys = list(GRID)
    combos = (dict(zip(keys, values, strict=True)) for values in itertools.product(*(GRID[k] for k in keys)))
    return [c for c in combos if feasible(c)]


def racing_rows(module):
    """[(row index, (max_batch, max_kv_len), split count, {kernel name: existing params})] of the
    AITER_ROUTE_TABLE rows that race; the split count is that of the row's Triton candidates."""
    out = []
    for i, row in enumerate(getattr(module, "AITER_ROUTE_TABLE", [])):
        candidates = row.get("candidates") or []
        existing = {}
        for c in candidates:
            for name, (route, fixed) in KERNELS.items():
                if c["route"] == route and all(c["params"].get(k, v) == v for k, v in fixed.items()):
                    existing.setdefault(name, dict(c["params"]))
        splits = {p["num_splits"] for p in existing.values()}
        if not candidates or not existing:
            continue
        if len(splits) != 1:
            raise ValueError(f"AITER_ROUTE_TABLE[{i}]: its Triton candidates use several split counts {splits}")
        out.append((i, (row["max_batch"], row["max_kv_len"]), splits.pop(), existing))
    return out


def route_params(kernel_name, num_splits, knobs):
    """The route parameters of one sweep point (what a route-table row takes)."""
    _, fixed = KERNELS[kernel_name]
    return {"num_splits": num_splits, "block_n": knobs["block_n"], "num_warps": knobs["num_warps"],
            "num_stages": knobs["num_stages"], **fixed}


def point_options(knobs):
    """The AMD knobs of one sweep point that differ from the backend's choice (the others unset)."""
    return {k: knobs[k] for k, default in KNOB_DEFAULTS.items() if knobs[k] != default}


def knobs_of(params, options=None):
    """The sweep point of route parameters and knob options (unset ones at their default)."""
    options = options or {}
    return {"block_n": params.get("block_n", 64), "num_warps": params.get("num_warps", 8),
            "num_stages": params["num_stages"], **{k: options.get(k, v) for k, v in KNOB_DEFAULTS.items()}}


def point_key(route, params, options=None):
    """The cache key of a configuration: its route label, then its knob options when it has any."""
    label = submission.route_label({"route": route, "params": params})
    return f"{label} {json.dumps(options, separators=(',', ':'))}" if options else label


def sweep_point(kernel_name, num_splits, knobs):
    """(route, params, options) of one sweep point."""
    return KERNELS[kernel_name][0], route_params(kernel_name, num_splits, knobs), point_options(knobs)


def cached(cache, kernel_name, num_splits, knobs):
    """The cached record of one sweep point, or None."""
    return cache["records"].get(point_key(*sweep_point(kernel_name, num_splits, knobs)))


def canonical_ast(node):
    """ast.dump's form without the fields that are None or empty: the same text on every Python
    from 3.10 on (3.12 added FunctionDef.type_params, 3.13's dump omits empty fields), so the
    hash below does not depend on which Python computed it."""
    if isinstance(node, ast.AST):
        fields = [f"{name}={canonical_ast(value)}" for name, value in ast.iter_fields(node)
                  if value is not None and value != []]
        return f"{type(node).__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return f"[{', '.join(map(canonical_ast, node))}]"
    return repr(node)


def _code_of(fn):
    """A function's code without its docstring and comments (they do not change what compiles)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        tree.body[0].body = body[1:]
    return canonical_ast(tree)


def kernels_source_hash(module):
    """A hash of the code of the swept kernels and of every @triton.jit helper they call."""
    kernels = {e["kernel"].fn.__name__: e["kernel"] for route, fixed in KERNELS.values()
               for e in module.triton_compile_plan(route, dict(fixed))}
    h = hashlib.sha1()
    for kernel in (kernels[name] for name in sorted(kernels)):
        for name in sorted({kernel.fn.__name__} | kr.jit_functions_reached(kernel)):
            helper = getattr(module, name, None)  # Triton's own helpers (tl.cdiv) are not the module's
            if helper is not None:
                h.update(_code_of(helper.fn).encode())
    return h.hexdigest()[:12]


# ---------------------------------------------------------------------------------------------
# Compiling (worker processes)

_MODULE = None


def _init_worker(module_path, cache_dir):
    global _MODULE
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    _MODULE = kr.load_module(module_path)


def compile_one(route, params, options):
    """The sweep record of one configuration, its knob options added to its plan entry (compiled
    here, in a worker)."""
    spec = kr.TARGETS[TARGET]
    record = {"route": route, "params": params, "options": options, "compiled": False, "error": None}
    try:
        (entry,) = _MODULE.triton_compile_plan(route, copy.deepcopy(params), spec.fp8_dtype)
        kernel, signature, constexprs, attrs, compile_options = kr.complete_plan_entry(with_knobs(entry, options), spec)
        result, _ = kr.compile_and_analyse(kernel, signature, constexprs, attrs, compile_options, spec)
    except Exception as exc:  # a configuration that does not compile is a finding
        record["error"] = kr._short_error(exc, 600)
        return record
    occ = result["occupancy"]
    record.update(
        compiled=True, compile_s=result["compile_s"], vgpr=result["registers"]["vgpr"],
        agpr=result["registers"]["agpr"], sgpr=result["registers"]["sgpr"],
        vgpr_spills=result["spills"]["vgpr_spill_count"], sgpr_spills=result["spills"]["sgpr_spill_count"],
        scratch_bytes=result["spills"]["scratch_bytes"], spill_free=result["spill_free"] and result["spill_parsed"],
        lds_bytes=result["lds_bytes"], lds_fits=result["lds_fits"], waves_per_simd=occ["resident"],
        llvm_occupancy=occ["compiler"], workgroups_per_cu=min(
            occ["workgroups_from_registers"],
            occ["workgroups_from_lds"] if occ["workgroups_from_lds"] is not None else 10**9),
        mma_loop=result["mma"]["loop"], loads_loop=result["loads"]["loop"],
        load_widest_bits=result["loads"]["loop_widest_bits"], uses_dot_scaled=result["uses_dot_scaled"],
        asm_sha1=result["asm_sha1"])
    return record


def full_points(splits_list, cache=None):
    """(route, params, options) of the whole grid at each of these split counts; matrix_instr_nonkdim
    32 only at the first one (the probe), and at the others only for a kernel whose probe had an
    eligible 32 point: every dot here has N = 16 (the heads), which a 32 x 32 MFMA tile pads to 32."""
    points = []
    for n, num_splits in enumerate(splits_list):
        for kernel_name in KERNELS:
            probe = [cached(cache, kernel_name, splits_list[0], k)
                     for k in grid() if k["matrix_instr_nonkdim"] == 32] if cache and n else []
            wide_ok = n == 0 or any(r is not None and why_not(kernel_name, r, None) is None for r in probe)
            points += [sweep_point(kernel_name, num_splits, knobs) for knobs in grid()
                       if wide_ok or knobs["matrix_instr_nonkdim"] != 32]
    return points


def shortlist_points(module, cache, full_splits, other_splits, size):
    """(route, params, options) at each split count of other_splits: per kernel, the `size`
    best-ranked eligible points of the grid at the reference split count (the largest of
    full_splits; the split count changes only the code after the KV loop: the partial stores and
    the merge), and the row's existing candidate."""
    reference = max(full_splits)
    points = []
    for _, shape, num_splits, existing in racing_rows(module):
        if num_splits not in other_splits:
            continue
        programs = shape[0] * num_splits
        for kernel_name in KERNELS:
            ranked = []
            for g, knobs in enumerate(grid()):
                record = cached(cache, kernel_name, reference, knobs)
                if record is not None and why_not(kernel_name, record, None) is None:
                    ranked.append((rank_key(record, g, programs), knobs))
            chosen = [knobs for _, knobs in sorted(ranked, key=lambda e: e[0])[:size]]
            if kernel_name in existing:
                chosen.append(knobs_of(existing[kernel_name]))
            points += [sweep_point(kernel_name, num_splits, knobs) for knobs in chosen]
    return points


def sweep(module_path, points, cache, jobs, cache_path=None, log=print):
    """Compile every point not in the cache; returns the cache (updated in place, and saved to
    cache_path every 50 compiles). The workers are spawned, not forked: on a GPU machine this
    process has initialised CUDA (importing submission does), which a forked child cannot use."""
    todo, seen = [], set(cache["records"])
    for route, params, options in points:
        key = point_key(route, params, options)
        if key not in seen:
            seen.add(key)
            todo.append((route, params, options))
    log(f"gfx950 sweep: {len(todo)} to compile, {len(cache['records'])} cached")
    if not todo:
        return cache
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="gfx950_sweep_") as tmp, \
            concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                                   initializer=_init_worker,
                                                   initargs=(str(module_path), tmp)) as pool:
        futures = [pool.submit(compile_one, *point) for point in todo]
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            record = future.result()
            cache["records"][point_key(record["route"], record["params"], record["options"])] = record
            if done % 50 == 0 or done == len(todo):
                log(f"  {done}/{len(todo)} compiled, {time.time() - started:.0f} s")
                if cache_path:
                    save_cache(cache_path, cache)
    return cache


def load_cache(path, triton_version, source_hash):
    """The cached records, or an empty cache when the Triton version or the kernels changed."""
    empty = {"triton_version": triton_version, "kernels_source": source_hash, "target": TARGET, "records": {}}
    try:
        cache = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return empty
    if cache.get("triton_version") != triton_version or cache.get("kernels_source") != source_hash:
        return empty
    return cache


def save_cache(path, cache):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    cache = dict(cache, records=dict(sorted(cache["records"].items())))
    Path(path).write_text(json.dumps(cache, indent=1, sort_keys=False) + "\n")


# ---------------------------------------------------------------------------------------------
# The pick


def intended_mma(kernel_name, record):
    kinds = record.get("mma_loop") or {}
    if kernel_name == "fp8":
        return any(ka.is_fp8_mma(k) for k in kinds)
    if kernel_name == "mxfp4_e4m3":
        return any(ka.is_scaled_mma(k) for k in kinds)
    return bool(kinds)


def record_knobs(record):
    return knobs_of(record["params"], record.get("options"))


def why_not(kernel_name, record, existing_record):
    """None when the record's code is eligible (module docstring), else the first reason it is not;
    pick() then keeps the points that set an AMD knob apart."""
    if not record.get("compiled"):
        return "does not compile"
    if not record["spill_free"]:
        return "spills"
    if not record["lds_fits"]:
        return "LDS > 160 KiB"
    if record["workgroups_per_cu"] < 1:
        return "no workgroup fits a CU"
    if not intended_mma(kernel_name, record):
        return "hot loop without its intended MFMA"
    if (record["load_widest_bits"] or 0) < 128:
        return "hot loop's loads narrower than 128 bit"
    if existing_record is not None:
        if all(record_knobs(record)[k] == record_knobs(existing_record)[k] for k in TILE_KEYS):
            return "the existing candidate's tile"
        if record["asm_sha1"] == existing_record.get("asm_sha1"):
            return "the existing candidate's code"
    return None


MI355X_CUS = 256
SETS_A_KNOB = "sets an AMD knob"


def programs_per_cu(record, programs):
    """Programs of a grid of `programs` resident on one CU at once."""
    return min(record["workgroups_per_cu"], -(-programs // MI355X_CUS))


def in_flight_bytes(record, programs):
    """KV bytes requested ahead per CU for a grid of `programs` programs (module docstring)."""
    knobs = record_knobs(record)
    per_token = submission.KV_BYTES_PER_TOKEN[submission.ROUTE_INFO[record["route"]]["kv_format"]]
    return programs_per_cu(record, programs) * knobs["block_n"] * per_token * max(knobs["num_stages"] - 1, 1)


def waves_for_grid(record, programs):
    return programs_per_cu(record, programs) * record_knobs(record)["num_warps"] / 4


def rank_key(record, grid_index, programs):
    """Smaller ranks first: the figures (bytes ahead, stages, waves, registers), then the backend's
    own knob choices, then the grid's order."""
    return (-in_flight_bytes(record, programs), -record_knobs(record)["num_stages"],
            -waves_for_grid(record, programs), record["vgpr"] + (record["agpr"] or 0),
            bool(record.get("options")), grid_index)


def pick(module, cache):
    """[{row, shape, num_splits, programs, picks: [{kernel, route, params, record, existing,
    eligible}], knob_ahead: {kernel: record}, rejected: {kernel: {reason: count}}}]: knob_ahead
    holds, per kernel, the best eligible point that sets an AMD knob where its figures rank ahead
    of the pick's (or where it alone is eligible)."""
    out = []
    points = grid()
    for index, shape, num_splits, existing in racing_rows(module):
        picks, reasons, knob_ahead = [], {}, {}
        programs = shape[0] * num_splits
        for kernel_name, (route, _) in KERNELS.items():
            old = existing.get(kernel_name)
            old_record = None
            if old is not None:  # the row's own candidate, else the sweep point of its tile
                old_record = (cache["records"].get(point_key(route, old))
                              or cached(cache, kernel_name, num_splits, knobs_of(old)))
            eligible, with_knob, counted = [], [], {}
            for g, knobs in enumerate(points):
                record = cached(cache, kernel_name, num_splits, knobs)
                reason = "not swept" if record is None else why_not(kernel_name, record, old_record)
                if reason is None:
                    (with_knob if record.get("options") else eligible).append((rank_key(record, g, programs), record))
                    reason = SETS_A_KNOB if record.get("options") else None
                if reason is not None:
                    counted[reason] = counted.get(reason, 0) + 1
            reasons[kernel_name] = counted
            best = min(eligible, key=lambda e: e[0]) if eligible else None
            best_knob = min(with_knob, key=lambda e: e[0]) if with_knob else None
            if best_knob is not None and (best is None or best_knob[0][:4] < best[0][:4]):
                knob_ahead[kernel_name] = best_knob[1]
            if best is not None:
                picks.append({"kernel": kernel_name, "route": route, "params": best[1]["params"], "record": best[1],
                              "existing": old_record, "eligible": len(eligible)})
        out.append({"row": index, "shape": shape, "num_splits": num_splits, "programs": programs,
                    "picks": picks[:MAX_PICKS_PER_ROW], "knob_ahead": knob_ahead, "rejected": reasons})
    return out


# ---------------------------------------------------------------------------------------------
# Output


def describe(record):
    if record is None:
        return "(not swept)"
    if not record.get("compiled"):
        return f"COMPILE FAILED: {record.get('error')}"
    loads = ", ".join(f"{n}x {k.replace('buffer_load_', 'buf_').replace('global_load_', 'glb_')}"
                      for k, n in sorted(record["loads_loop"].items(), key=lambda kv: -(ka.load_bits(kv[0]) or 0)))
    mma = ", ".join(f"{n}x {k}" for k, n in record["mma_loop"].items())
    return (f"v{record['vgpr']} a{record['agpr']} | LDS {record['lds_bytes'] / 1024:.1f} KiB | "
            f"{record['waves_per_simd']:g} waves/SIMD ({record['workgroups_per_cu']} WG/CU) | "
            f"spills {record['vgpr_spills']} | {mma} | {loads}")


def knob_label(record):
    k = record_knobs(record)
    return (f"bn{k['block_n']} w{k['num_warps']} s{k['num_stages']} wpe{k['waves_per_eu']} "
            f"nk{k['matrix_instr_nonkdim']}")


def format_picks(picks, markdown=False):
    lines = []
    if markdown:
        lines.append("| row (bs, kv) | splits | kernel | config | VGPR / AGPR | LDS | waves/SIMD (WG/CU) | "
                     "KV bytes in flight / CU | MFMA in hot loop | loads in hot loop | existing candidate |")
        lines.append("|" + "---|" * 11)
    for row in picks:
        for p in row["picks"]:
            r = p["record"]
            mma = ", ".join(f"{n}x {k}" for k, n in r["mma_loop"].items())
            loads = ", ".join(f"{n}x {k}" for k, n in sorted(r["loads_loop"].items(),
                                                             key=lambda kv: -(ka.load_bits(kv[0]) or 0)))
            old = p["existing"]
            old_text = (f"{knob_label(old)}: v{old['vgpr']} a{old['agpr']}, "
                        f"{old['waves_per_simd']:g} waves" if old and old.get("compiled") else "-")
            if markdown:
                lines.append(f"| [{row['row']}] {row['shape']} | {row['num_splits']} | {p['kernel']} | "
                             f"{knob_label(r)} | {r['vgpr']} / {r['agpr']} | "
                             f"{r['lds_bytes'] / 1024:.1f} KiB | "
                             f"{r['waves_per_simd']:g} ({r['workgroups_per_cu']}) | "
                             f"{in_flight_bytes(r, row['programs']) / 1024:.0f} KiB | {mma} | {loads} | {old_text} |")
            else:
                lines.append(f"row {row['row']} {row['shape']} splits {row['num_splits']} {p['kernel']}: "
                             f"{knob_label(r)} ({p['eligible']} eligible) -> {describe(r)}")
                lines.append(f"    params {json.dumps(p['params'], sort_keys=True)}")
                lines.append(f"    existing {old_text}")
        if not markdown:
            for kernel_name, record in row["knob_ahead"].items():
                lines.append(f"    {kernel_name}: ranks ahead of the pick but sets an AMD knob: "
                             f"{knob_label(record)} -> {describe(record)}")
            lines.append(f"    rejected: {json.dumps(row['rejected'], sort_keys=True)}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--module", default="submission.py")
    parser.add_argument("--cache", default=str(DEFAULT_CACHE), help="the JSON of compiled results (read and updated)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--full-splits", default=None,
                        help="split counts swept over the whole grid (default: every racing row's)")
    parser.add_argument("--shortlist", type=int, default=12,
                        help="at the other racing rows' split counts, compile this many best-ranked points "
                             "per kernel of the largest full split count (and the existing candidate)")
    parser.add_argument("--no-compile", action="store_true", help="pick from the cache only")
    parser.add_argument("--markdown", action="store_true", help="the picks as a markdown table")
    parser.add_argument("--picks-json", metavar="PATH", help="write the picks as JSON")
    args = parser.parse_args(argv)

    import triton

    module_path = kr.resolve_module_path(args.module)
    module = kr.load_module(module_path)
    cache = load_cache(args.cache, triton.__version__, kernels_source_hash(module))
    rows = racing_rows(module)
    row_splits = sorted({s for _, _, s, _ in rows})
    full = [int(s) for s in args.full_splits.split(",")] if args.full_splits else row_splits
    others = [s for s in row_splits if s not in full]
    if not args.no_compile:
        log = lambda m: print(m, file=sys.stderr)  # noqa: E731
        try:
            sweep(module_path, full_points(full[:1]), cache, max(1, args.jobs), args.cache, log)
            sweep(module_path, full_points(full, cache), cache, max(1, args.jobs), args.cache, log)
            if others:
                points = shortlist_points(module, cache, full, others, args.shortlist)
                sweep(module_path, points, cache, max(1, args.jobs), args.cache, log)
        finally:
            save_cache(args.cache, cache)
    picks = pick(module, cache)
    print(format_picks(picks, markdown=args.markdown))
    if args.picks_json:
        Path(args.picks_json).write_text(json.dumps(
            [{"row": r["row"], "shape": r["shape"], "num_splits": r["num_splits"],
              "picks": [{"route": p["route"], "params": p["params"]} for p in r["picks"]]} for r in picks],
            indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

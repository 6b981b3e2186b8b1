#!/usr/bin/env python3
"""Compile every Triton kernel of submission.py for MI355X, MI300X and H100/H200, without a GPU, and
report what the compiler made of each: registers, spills, LDS, occupancy, matrix instructions, loads.

    python tools/kernel_report.py [--targets gfx950,gfx942,sm90] [--markdown] [--json PATH] [--dump DIR]
                                  [--module FILE] [--tables FILE] [--jobs N] [--cache-dir DIR]

What is compiled: every configuration the route tables can select (each row of TRITON_ROUTE_TABLE
and AITER_ROUTE_TABLE and each candidate it races, when its route has a Triton compile plan; the
aiter table's on the AMD targets only), through the module's ``triton_compile_plan(route, params,
fp8_dtype)``, as the route launches it: on AMD with the HIP JIT's 2 GiB pointer marks (buffer
loads). A plan entry may carry further compile ``"options"`` (lab/gfx950_sweep.py adds the AMD
knobs that way) and ``"targets"`` (the Gluon Hopper kernel: sm90 only). ``--module`` compiles the
kernels of another file; ``--tables`` reads the route tables from another file (default: the
module when it has them, else submission.py). Each target compiles in a process of its own with a
fresh Triton cache: with Triton 3.6 one process compiling gfx950 then gfx942 gives the second the
first one's code. Compiling is not running: the proof is ``popcorn-cli submit --leaderboard
amd-mixed-mla --gpu MI355X --mode test submission.py``.

Columns (one row per kernel x target x distinct compile; "config" lists every row selecting it):
    config            the configurations, as submission.route_label names them
    compiled as       constexprs other than the kernel's defaults, w<num_warps> s<num_stages>, options
    registers         AMD v<VGPRs> a<AGPRs> s<SGPRs>; NVIDIA registers per thread (ptxas -v)
    spills / scratch  AMD VGPR and SGPR spill counts, scratch bytes; NVIDIA spill stores / loads, stack
    LDS / smem        shared memory per block; "> N KiB!" past the target's limit (gfx950 160 KiB,
                      gfx942 64 KiB, sm90 227 KiB)
    occupancy         AMD waves per SIMD (the tool's figure; LLVM's own; the registers' waves; the
                      LDS's workgroups per CU); NVIDIA warps per SM (registers' and shared memory's
                      blocks per SM); the formulas are in tools/kernel_asm.py
    MMA in hot loop   matrix instructions per kind with operand types (A.B), in the loop holding the
                      most of them; "MMA in kernel": in the whole kernel
    global loads      loads from global memory in the hot loop per kind, and the widest per lane
Notes follow the table: rows whose plan is empty, @triton.jit kernels no row selects (not compiled),
inline_asm_elementwise outside a per-target ``if``. Exit status 0 when everything compiled for
every target asked for, 1 otherwise, 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import ast
import concurrent.futures
import copy
import datetime
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import submission  # noqa: E402  (route_label)
from tools import kernel_asm  # noqa: E402
from tools.kernel_asm import KIB, load_bits  # noqa: E402

TOOL_PATH = Path(__file__).resolve()


@dataclass(frozen=True)
class TargetSpec:
    name: str
    gpu: str
    backend: str  # "hip" | "cuda"
    arch: object  # "gfx950" | 90
    warp_size: int
    fp8_dtype: str  # Triton's name of the KV fp8 dtype on this target
    lds_per_block: int  # bytes a workgroup / block may use
    lds_per_unit: int  # bytes per CU (AMD) / SM (NVIDIA)

    @property
    def is_amd(self):
        return self.backend == "hip"


TARGETS = {
    "gfx950": TargetSpec("gfx950", "MI355X", "hip", "gfx950", 64, "fp8e4nv", 160 * KIB, 160 * KIB),
    "gfx942": TargetSpec("gfx942", "MI300X", "hip", "gfx942", 64, "fp8e4b8", 64 * KIB, 64 * KIB),
    "sm90": TargetSpec("sm90", "H100/H200", "cuda", 90, 32, "fp8e4nv", 227 * KIB, 228 * KIB),
}
TARGET_ALIASES = {"sm_90": "sm90", "sm_90a": "sm90", "sm90a": "sm90", "mi355x": "gfx950",
                  "mi300x": "gfx942", "h100": "sm90", "h200": "sm90"}
DEFAULT_TARGETS = ("gfx950", "gfx942", "sm90")
AITER_TARGETS = {name for name, spec in TARGETS.items() if spec.is_amd}  # where the aiter table is active
TABLE_NAMES = ("TRITON_ROUTE_TABLE", "AITER_ROUTE_TABLE", "SERVING_ROUTE_TABLE")


def resolve_targets(spec):
    """'gfx950,sm90' -> ['gfx950', 'sm90'] (aliases accepted, order kept, duplicates dropped)."""
    names = []
    for raw in (spec.split(",") if isinstance(spec, str) else spec):
        name = raw.strip().lower()
        if not name:
            continue
        name = TARGET_ALIASES.get(name, name)
        if name not in TARGETS:
            raise ValueError(f"unknown target {raw!r}: choose from {', '.join(TARGETS)}")
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError("no target given")
    return names


def resolve_module_path(path):
    """A path as given (relative to the working directory), else relative to the repository."""
    p = Path(path)
    if not p.is_absolute() and not p.exists() and (REPO_ROOT / p).exists():
        p = REPO_ROOT / p
    if not p.exists():
        raise FileNotFoundError(f"module not found: {path}")
    return p.resolve()


def tables_path_for(module_path, tables_path=None):
    """Where the route tables are read from: `tables_path` when given; else the module itself when
    it assigns a route table (parsed, not imported); else the repository's submission.py (a
    work-in-progress kernel file holds no tables)."""
    if tables_path:
        return resolve_module_path(tables_path)
    module_path = Path(module_path).resolve()
    tree = ast.parse(module_path.read_text())
    names = {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
             for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
    return module_path if names & set(TABLE_NAMES) else (REPO_ROOT / "submission.py").resolve()


# ---------------------------------------------------------------------------------------------
# Kernel source: inline assembly and the helpers a kernel calls

_GUARD_WORDS = re.compile(r"(?i)cuda|hip|amd|nvidia|rocm|gfx|\bsm_?\d|arch|target|backend|\bis_\w+")


def _is_jit_function(obj):
    return hasattr(obj, "fn") and hasattr(obj, "arg_names") and callable(getattr(obj, "fn", None))


def _resolve_global(expr, globals_):
    """ast Name / Attribute chain -> the object it names in globals_, or None."""
    if isinstance(expr, ast.Name):
        return globals_.get(expr.id)
    if isinstance(expr, ast.Attribute):
        base = _resolve_global(expr.value, globals_)
        return getattr(base, expr.attr, None) if base is not None else None
    return None


def scan_inline_asm(kernels):
    """Inline-asm calls in the kernels and the @triton.jit helpers they call (recursively):
    [{kernel, function, line, guarded, guard}]."""
    findings = []
    for kernel in kernels:
        one_target = getattr(kernel, "is_gluon", lambda: False)()
        seen = set()
        stack = [kernel]
        while stack:
            jf = stack.pop()
            fn = jf.fn
            if id(fn) in seen:
                continue
            seen.add(id(fn))
            try:
                src = textwrap.dedent(inspect.getsource(fn))
                first_line = inspect.getsourcelines(fn)[1]
            except (OSError, TypeError):
                continue
            tree = ast.parse(src)
            parents = {}
            for node in ast.walk(tree):
                for child in ast.iter_child_nodes(node):
                    parents[child] = node
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name == "inline_asm_elementwise":
                    guard = None
                    child, parent = node, parents.get(node)
                    while parent is not None and guard is None:
                        if isinstance(parent, (ast.If, ast.IfExp)) and child is not parent.test:
                            test = ast.unparse(parent.test)
                            if _GUARD_WORDS.search(test):
                                guard = test
                        child, parent = parent, parents.get(parent)
                    if guard is None and one_target:
                        guard = "a Gluon kernel (one target)"
                    findings.append({"kernel": kernel.fn.__name__, "function": fn.__name__,
                                     "line": first_line + node.lineno - 1, "guarded": guard is not None,
                                     "guard": guard})
                    continue
                target = _resolve_global(node.func, fn.__globals__)
                if target is not None and _is_jit_function(target) and target is not jf:
                    stack.append(target)
    return findings


def _passed(arg):
    """The expressions a call argument passes: itself, or a list's / tuple's items at any depth
    (gl.warp_specialize's partitions: a list of (function, arguments) pairs)."""
    if isinstance(arg, (ast.List, ast.Tuple)):
        return [item for element in arg.elts for item in _passed(element)]
    return [arg]


def jit_functions_reached(kernel):
    """Names of the @triton.jit functions a kernel calls, or passes to a call (a scan's combine
    function, a warp-specialised kernel's partitions), recursively (not the kernel itself)."""
    names = set()
    seen = set()
    stack = [kernel]
    while stack:
        jf = stack.pop()
        if id(jf.fn) in seen:
            continue
        seen.add(id(jf.fn))
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(jf.fn)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            for used in [node.func, *(passed for arg in node.args for passed in _passed(arg))]:
                target = _resolve_global(used, jf.fn.__globals__)
                if target is not None and _is_jit_function(target) and target.fn is not jf.fn:
                    names.add(target.fn.__name__)
                    stack.append(target)
    return names


# ---------------------------------------------------------------------------------------------
# What is compiled


def load_module(path):
    """Import a Python file by path, under a private name, with the Triton interpreter off."""
    path = Path(path).resolve()
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        name = f"_kernel_report_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
    return module


def _params_key(params):
    return json.dumps(params, sort_keys=True, default=str)


def discover_rows(tables, compiled_routes):
    """The configurations to compile: each row of the route tables of `tables` and each candidate
    it races whose route is in `compiled_routes`, de-duplicated on (route, params):
    [{route, params, label, sources, targets}]; the aiter table's run on the AMD targets only."""
    rows = {}
    for table_name in TABLE_NAMES:
        for i, row in enumerate(getattr(tables, table_name, None) or []):
            for j, candidate in enumerate([row, *(row.get("candidates") or [])]):
                if candidate["route"] not in compiled_routes:
                    continue
                params = dict(candidate.get("params") or {})
                if table_name == "SERVING_ROUTE_TABLE":  # a serving row serves one cache format: compile that
                    params["kv"] = row["kv"]
                entry = rows.setdefault((candidate["route"], _params_key(params)), {
                    "route": candidate["route"], "params": params,
                    "label": submission.route_label({"route": candidate["route"], "params": params}),
                    "sources": [], "targets": set()})
                entry["sources"].append(f"{table_name}[{i}]" + (f".candidates[{j - 1}]" if j else ""))
                entry["targets"] |= AITER_TARGETS if table_name == "AITER_ROUTE_TABLE" else set(TARGETS)
    return [dict(row, targets=sorted(row["targets"])) for row in rows.values()]


def complete_plan_entry(entry, spec=None):
    """A plan entry -> (kernel, signature, constexprs, attrs, options) ready for ASTSource.

    Constexprs the entry leaves out take the kernel's defaults (as the JIT does); ``aligned_args``
    get ``tt.divisibility=16``; on an AMD target (spec) ``range32_args`` get ``tt.pointer_range=32``
    as Triton's HIP JIT marks every tensor within 2 GiB (unless AMDGCN_USE_BUFFER_OPS turns that
    off); the entry's ``options`` join num_warps and num_stages."""
    import triton

    kernel = entry["kernel"]
    if not (_is_jit_function(kernel) and hasattr(kernel, "params")):
        raise TypeError(f"{kernel!r} is not a triton JITFunction (was the module imported with "
                        "TRITON_INTERPRET=1?)")
    given_sig = dict(entry.get("signature") or {})
    constexprs = dict(entry.get("constexprs") or {})
    unknown = (set(given_sig) | set(constexprs)) - set(kernel.arg_names)
    if unknown:
        raise ValueError(f"plan names arguments the kernel lacks: {sorted(unknown)}")
    signature = {}
    for p in kernel.params:
        if p.is_constexpr and p.name not in constexprs:
            if not p.has_default:
                raise ValueError(f"plan gives no value for constexpr {p.name}")
            constexprs[p.name] = p.default
        if p.name in constexprs:
            signature[p.name] = "constexpr"
        elif p.name in given_sig:
            signature[p.name] = given_sig[p.name]
        else:
            raise ValueError(f"plan gives no type for argument {p.name}")
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in entry.get("aligned_args") or []}
    if spec is not None and spec.is_amd and triton.knobs.amd.use_buffer_ops:
        for a in entry.get("range32_args") or []:
            attrs.setdefault((kernel.arg_names.index(a),), []).append(["tt.pointer_range", 32])
    options = {"num_warps": entry.get("num_warps", 4), "num_stages": entry.get("num_stages", 3)}
    options.update(entry.get("options") or {})
    return kernel, signature, constexprs, attrs, options


def _short_error(exc, limit=1500):
    text = f"{type(exc).__name__}: {exc}"
    if len(text) > limit:
        text = text[: limit - 400] + "\n...\n" + text[-400:]
    return text


def _jsonable(value):
    return json.loads(json.dumps(value, default=str))


def compile_unit(kernel, signature, constexprs, attrs, options, spec):
    """triton.compile of one completed plan entry for one target (Gluon kernels through Gluon's
    own AST source): the compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if getattr(kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource  # noqa: F811
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget(spec.backend, spec.arch, spec.warp_size), options=dict(options))


def compile_and_analyse(kernel, signature, constexprs, attrs, options, spec):
    """(facts, assembly text) of one completed plan entry compiled for one target (kernel_asm.kernel_facts
    and the compile's seconds)."""
    t0 = time.time()
    compiled = compile_unit(kernel, signature, constexprs, attrs, options, spec)
    seconds = round(time.time() - t0, 2)
    facts, asm = kernel_asm.kernel_facts(compiled, spec.is_amd, options["num_warps"], spec.lds_per_block,
                                         spec.lds_per_unit)
    return dict(facts, compile_s=seconds), asm


def route_kv_format(route, *modules):
    """ROUTE_INFO[route]["kv_format"] of the first module that knows the route, else None."""
    for module in modules:
        info = (getattr(module, "ROUTE_INFO", None) or {}).get(route)
        if info:
            return info.get("kv_format")
    return None


def _non_default_constexprs(kernel, constexprs):
    """The constexprs that do not merely repeat the kernel's defaults (what a config chooses)."""
    defaults = {p.name: p.default for p in kernel.params if p.has_default}
    return {k: v for k, v in constexprs.items() if k not in defaults or defaults[k] != v}


def _slug(text):
    return re.sub(r"[^0-9A-Za-z]+", "_", text).strip("_")[:80]


def plan_units(module, rows, spec, errors):
    """The distinct compiles of every row's plan for one target, each listing the rows that select
    it; the kernels planned for other targets only; the labels of the rows whose plan is empty. A
    plan that raises is an error, not a crash."""
    units, elsewhere, empty = {}, [], []
    for row in rows:
        try:
            plan = module.triton_compile_plan(row["route"], copy.deepcopy(row["params"]), spec.fp8_dtype)
        except Exception as exc:
            errors.append(f"triton_compile_plan of {row['label']}: {_short_error(exc)}")
            continue
        if not plan:
            empty.append(row["label"])
        for entry in plan:
            if spec.name not in set(row["targets"]) & set(entry.get("targets") or TARGETS):
                elsewhere.append(entry["kernel"])
                continue
            try:
                kernel, signature, constexprs, attrs, options = complete_plan_entry(entry, spec)
            except Exception as exc:
                errors.append(f"{row['label']}: {_short_error(exc)}")
                continue
            key = (id(kernel.fn), _params_key(signature), _params_key(constexprs), repr(sorted(attrs)),
                   _params_key(options))
            unit = units.setdefault(key, {"kernel": kernel, "signature": signature, "constexprs": constexprs,
                                          "attrs": attrs, "options": options, "rows": []})
            unit["rows"].append({"route": row["route"], "params": row["params"], "label": row["label"]})
    return list(units.values()), elsewhere, empty


def worker(target, module_path, dump_dir=None, tables_path=None):
    """Everything for one target, in this process: the JSON-able partial report."""
    spec = TARGETS[target]
    out = {"records": [], "rows": [], "rows_without_kernels": [], "module_kernels": [], "uncovered_kernels": [],
           "inline_asm": [], "errors": []}
    module = load_module(module_path)
    tables_path = tables_path_for(module_path, tables_path)
    tables = module if tables_path == Path(module_path).resolve() else load_module(tables_path)
    if not hasattr(module, "triton_compile_plan"):
        out["errors"].append(f"{module_path} defines no triton_compile_plan(route, params, fp8_dtype)")
        return out
    rows = discover_rows(tables, getattr(module, "TRITON_COMPILE_PLANS", {}))
    units, elsewhere, out["rows_without_kernels"] = plan_units(module, rows, spec, out["errors"])
    out["rows"] = _jsonable(rows)
    for unit in units:
        kernel, first = unit["kernel"], unit["rows"][0]
        record = {
            "kernel": kernel.fn.__name__, "target": target, "gpu": spec.gpu,
            "route": first["route"], "params": first["params"],
            "config": " | ".join(r["label"] for r in unit["rows"]), "rows": unit["rows"],
            "constexprs": _non_default_constexprs(kernel, unit["constexprs"]), "all_constexprs": unit["constexprs"],
            "num_warps": unit["options"]["num_warps"], "num_stages": unit["options"]["num_stages"],
            "options": unit["options"], "fp8_dtype": spec.fp8_dtype,
            "kv_format": route_kv_format(first["route"], module, tables), "compiled": False, "error": None,
        }
        try:
            facts, asm = compile_and_analyse(kernel, unit["signature"], unit["constexprs"], unit["attrs"],
                                             unit["options"], spec)
            record.update(facts, compiled=True)
            if dump_dir:
                os.makedirs(dump_dir, exist_ok=True)
                name = f"{record['kernel']}-{_slug(record['config'])}-{target}.{facts['asm_kind']}"
                Path(dump_dir, name).write_text(asm)
        except Exception as exc:
            record["error"] = _short_error(exc)
        out["records"].append(_jsonable(record))
    # every @triton.jit kernel of the module should be reachable from some plan
    module_kernels = {name: obj for name, obj in vars(module).items()
                      if _is_jit_function(obj) and getattr(obj.fn, "__module__", None) == module.__name__}
    planned = list({id(k.fn): k for k in [u["kernel"] for u in units] + elsewhere}.values())
    reached = {k.fn.__name__ for k in planned}.union(*(jit_functions_reached(k) for k in planned))
    out["module_kernels"] = sorted(module_kernels)
    out["uncovered_kernels"] = sorted(n for n, obj in module_kernels.items() if obj.fn.__name__ not in reached)
    out["inline_asm"] = scan_inline_asm(
        list(module_kernels.values()) + [k for k in planned if k not in module_kernels.values()])
    return out


# ---------------------------------------------------------------------------------------------
# Driver: one process per target


def _display_path(path):
    path = Path(path)
    return os.path.relpath(path, REPO_ROOT) if path.is_relative_to(REPO_ROOT) else str(path)


def run_worker(target, module_path, tables_path, dump_dir, cache_dir, tmp, timeout_s):
    """One target's worker process: (partial report or None, error text or None)."""
    env = dict(os.environ, TRITON_INTERPRET="0",
               TRITON_CACHE_DIR=os.path.join(cache_dir or tmp, target if cache_dir else f"cache_{target}"))
    out_path = os.path.join(tmp, f"{target}.json")
    cmd = [sys.executable, str(TOOL_PATH), "--worker", target, "--module", str(module_path),
           "--tables", str(tables_path), "--worker-out", out_path] + (["--dump", str(dump_dir)] if dump_dir else [])
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              cwd=str(REPO_ROOT), timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        return None, f"worker for {target} ran past {timeout_s} s: {(exc.output or '')[-3000:]}"
    if proc.returncode == 0 and os.path.exists(out_path):
        return json.loads(Path(out_path).read_text()), None
    return None, f"worker for {target} exited with {proc.returncode}: {proc.stdout[-3000:]}"


def build_report(module_path="submission.py", targets=DEFAULT_TARGETS, jobs=None, cache_dir=None,
                 dump_dir=None, tables_path=None, timeout_s=600):
    """Compile everything for each target (a process each, `jobs` at a time) and merge."""
    import triton

    module_path = resolve_module_path(module_path)
    tables_path = tables_path_for(module_path, tables_path)
    targets = resolve_targets(targets)
    report = {
        "tool": "tools/kernel_report.py", "module": _display_path(module_path),
        "tables_from": _display_path(tables_path), "triton_version": triton.__version__,
        "date": datetime.date.today().isoformat(), "targets": targets,
        "target_specs": {t: {"gpu": TARGETS[t].gpu, "fp8_dtype": TARGETS[t].fp8_dtype,
                             "lds_per_block": TARGETS[t].lds_per_block,
                             "lds_per_unit": TARGETS[t].lds_per_unit} for t in targets},
        "rows": [], "rows_without_kernels": [], "records": [], "module_kernels": [],
        "uncovered_kernels": [], "inline_asm": [], "errors": [], "worker_errors": {},
    }
    jobs = max(1, min(jobs or (os.cpu_count() or 1), len(targets)))
    with tempfile.TemporaryDirectory(prefix="kernel_report_") as tmp, \
            concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        parts = dict(zip(targets, pool.map(
            lambda t: run_worker(t, module_path, tables_path, dump_dir, cache_dir, tmp, timeout_s), targets),
            strict=True))
    for t in targets:
        part, error = parts[t]
        if error:
            report["worker_errors"][t] = error
            continue
        report["rows"] = report["rows"] or part["rows"]
        report["module_kernels"] = report["module_kernels"] or part["module_kernels"]
        report["records"].extend(part["records"])
        for key in ("rows_without_kernels", "uncovered_kernels"):
            report[key] += [x for x in part[key] if x not in report[key]]
        for finding in part["inline_asm"]:
            if (finding["function"], finding["line"]) not in {(f["function"], f["line"]) for f in report["inline_asm"]}:
                report["inline_asm"].append(finding)
        report["errors"] += [f"[{t}] {err}" for err in part["errors"]]
    return report



# ---------------------------------------------------------------------------------------------
# Formatting


def _compiled_as(rec):
    bits = [f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in rec["constexprs"].items()
            if isinstance(v, (bool, int, str))]
    bits.append(f"w{rec['num_warps']} s{rec['num_stages']}")
    bits += [f"{k}={v}" for k, v in (rec.get("options") or {}).items() if k not in ("num_warps", "num_stages")]
    return " ".join(bits)


def _regs(rec):
    r = rec.get("registers") or {}
    if "per_thread" in r:
        return f"{r['per_thread']}/thread"
    return f"v{r.get('vgpr')} a{r.get('agpr')} s{r.get('sgpr')}"


def _spills(rec):
    s = rec.get("spills") or {}
    if "scratch_bytes" in s:
        return (f"spill v{s.get('vgpr_spill_count')} s{s.get('sgpr_spill_count')}, "
                f"scratch {s.get('scratch_bytes')} B")
    text = (f"spill st {s.get('spill_store_bytes')} B ld {s.get('spill_load_bytes')} B, "
            f"stack {s.get('stack_frame_bytes')} B")
    if rec.get("hot_loop_locals") is not None and not rec.get("spill_free", True):
        text += f" ({rec['hot_loop_locals']} in the tile loops)"
    return text


def _lds(rec):
    kib = rec["lds_bytes"] / KIB
    mark = "" if rec["lds_fits"] else f" > {rec['lds_limit_bytes'] // KIB} KiB!"
    return f"{kib:.1f} KiB{mark}"


def _occupancy(rec):
    o = rec.get("occupancy") or {}
    resident = o.get("resident")
    resident = f"{resident:g}" if isinstance(resident, (int, float)) else "?"
    if o.get("unit") == "waves/SIMD":
        wg_lds = o.get("workgroups_from_lds")
        return (f"{resident} waves/SIMD (LLVM {o.get('compiler')}, regs {o.get('waves_from_registers')}, "
                f"LDS {'-' if wg_lds is None else wg_lds} WG/CU)")
    return (f"{resident} warps/SM (regs {o.get('blocks_from_registers')}, smem "
            f"{o.get('blocks_from_shared')} blocks/SM)")


def _mma(rec, which="loop"):
    m = rec.get("mma") or {}
    kinds = m.get(which) or {}
    if not kinds:
        return "none"
    return ", ".join(f"{n}x {k}" for k, n in kinds.items())


def _loads(rec, which="loop"):
    """'14x buffer_load_dwordx4, 3x buffer_load_dwordx2 (widest 128 bit)' for the hot loop."""
    loads = rec.get("loads") or {}
    kinds = loads.get(which) or {}
    if not kinds:
        return "none"
    widest = loads.get(f"{which}_widest_bits")
    listed = ", ".join(f"{n}x {k}" for k, n in sorted(kinds.items(), key=lambda kv: (-(load_bits(kv[0]) or 0), kv[0])))
    return f"{listed} (widest {widest} bit)" if widest else listed


def describe_record(rec):
    """One line naming a config and its numbers (for failure messages)."""
    head = f"{rec['kernel']} [{rec['target']}] {rec['config']} -> {_compiled_as(rec)}"
    if not rec["compiled"]:
        return f"{head}: COMPILE FAILED: {rec['error']}"
    return (f"{head}: registers {_regs(rec)}; {_spills(rec)}; LDS {_lds(rec)}; {_occupancy(rec)}; "
            f"MMA in hot loop: {_mma(rec, 'loop')}; loads in hot loop: {_loads(rec)}")


COLUMNS = ["kernel", "config (route params)", "compiled as", "target", "registers", "spills / scratch",
           "LDS / smem", "occupancy", "MMA in hot loop", "MMA in kernel", "global loads in hot loop"]


def table_rows(report, targets=None):
    rows = []
    for rec in report["records"]:
        if targets and rec["target"] not in targets:
            continue
        if not rec["compiled"]:
            first_line = (rec["error"] or "").splitlines()[0][:120] if rec["error"] else ""
            rows.append([rec["kernel"], rec["config"], _compiled_as(rec), rec["target"],
                         "COMPILE FAILED", first_line, "", "", "", "", ""])
            continue
        rows.append([rec["kernel"], rec["config"], _compiled_as(rec), rec["target"], _regs(rec), _spills(rec),
                     _lds(rec), _occupancy(rec), _mma(rec, "loop"), _mma(rec, "total"), _loads(rec)])
    return rows


def format_text(report):
    lines = [f"Kernel report: kernels of {report['module']}, route tables of {report['tables_from']}, "
             f"Triton {report['triton_version']}, {report['date']} (compiled, not run)"]
    for rec_row in table_rows(report):
        lines.append("")
        lines.append(f"{rec_row[0]}  [{rec_row[3]}]  {rec_row[1]}  ->  {rec_row[2]}")
        for name, value in zip(COLUMNS[4:], rec_row[4:], strict=True):
            lines.append(f"    {name:<24} {value}")
    lines.extend(_notes(report))
    return "\n".join(lines)


def _notes(report):
    notes = []
    for label in report["rows_without_kernels"]:
        notes.append(f"note: route-table row {label} has no Triton kernel (empty compile plan)")
    for name in report["uncovered_kernels"]:
        notes.append(f"WARNING: @triton.jit kernel {name} is selected by no route-table row or candidate: "
                     "it was not compiled")
    for f in report["inline_asm"]:
        state = f"guarded by `{f['guard']}`" if f["guarded"] else "NOT guarded per target"
        notes.append(f"{'note' if f['guarded'] else 'WARNING'}: inline_asm_elementwise in {f['function']} "
                     f"(line {f['line']}, kernel {f['kernel']}): {state}")
    for err in report["errors"]:
        notes.append(f"ERROR: {err}")
    for t, err in report["worker_errors"].items():
        notes.append(f"ERROR: target {t}: {err}")
    return [""] + notes if notes else []


def format_markdown(report, targets=None):
    targets = targets or report["targets"]
    gpus = ", ".join(f"{t} ({report['target_specs'][t]['gpu']})" for t in targets if t in report["target_specs"])
    lines = [f"Generated by `python tools/kernel_report.py --markdown` on {report['date']} with Triton "
             f"{report['triton_version']}: kernels of `{report['module']}`, route tables of `{report['tables_from']}`; "
             f"targets: {gpus}. Compiled, not run.", ""]
    lines.append("| " + " | ".join(COLUMNS) + " |")
    lines.append("|" + "---|" * len(COLUMNS))
    for row in table_rows(report, targets):
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |")
    lines.extend(_notes(report))
    return "\n".join(lines)



def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--module", default="submission.py",
                        help="the Python file holding the kernels and triton_compile_plan (default submission.py)")
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                        help="comma-separated: gfx950 (MI355X), gfx942 (MI300X), sm90 (H100/H200)")
    parser.add_argument("--tables", metavar="PATH", default=None,
                        help="read the route tables from this file (default: the module when it has them, "
                             "else submission.py)")
    parser.add_argument("--json", metavar="PATH", help="write the full report as JSON")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table (for the README)")
    parser.add_argument("--dump", metavar="DIR", help="write each compiled kernel's amdgcn / ptx here")
    parser.add_argument("--jobs", type=int, default=None, help="targets compiled in parallel (default: cores)")
    parser.add_argument("--cache-dir", default=None,
                        help="Triton cache to reuse (default: a fresh one per run and target)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        os.environ["TRITON_INTERPRET"] = "0"
        part = worker(args.worker, args.module, args.dump, args.tables)
        Path(args.worker_out).write_text(json.dumps(part, indent=1, default=str))
        return 0

    try:
        targets = resolve_targets(args.targets)
        report = build_report(args.module, targets, jobs=args.jobs, cache_dir=args.cache_dir, dump_dir=args.dump,
                              tables_path=args.tables)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kernel_report: {exc}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    print(format_markdown(report) if args.markdown else format_text(report))
    failed = (report["errors"] or report["worker_errors"]
              or any(not r["compiled"] for r in report["records"]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

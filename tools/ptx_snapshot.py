#!/usr/bin/env python3
"""The PTX of every sm_90 configuration of submission.py, compiled on the CPU, to show that a change
of the source (a restructure, a rename) leaves every kernel as it was.

    python tools/ptx_snapshot.py snapshot DIR [--module FILE] [--jobs N] [--only REGEX] [--target sm90|gfx950|...]
    python tools/ptx_snapshot.py compare BEFORE AFTER

snapshot: every row of the route tables and every candidate it races (custom_kernel's and the
serving API's), through the module's own compile plans (``triton_compile_plan``, as
tools/kernel_report.py compiles them), and for each serving row of the Hopper kernels also the
forms its launches take that the plan leaves out: SPANS off (a batch whose chunks fit one wave)
and a Python-float k_scale (KV_SCALE_IN_TENSOR off). Each compile's PTX is normalised and written
to DIR under a key of the row's label and the entry's place in its plan (``manifest.json`` maps the
keys). Normalised: the debug sections (from the first ``.file`` line on), ``.loc`` lines, the
``$L__tmp`` labels that open and close inlined functions' scopes for the debugger (nothing else
refers to them) and comment lines are dropped (they name source files, lines and functions, which a
restructure moves), and the kernel's own name is replaced by ``KERNEL`` (a rename keeps the code).
Nothing else is touched: registers, branch labels, instructions and their order must be the same.

compare: every key of BEFORE must be in AFTER with the same PTX; prints each difference (the first
lines that differ) and exits 1 if any, 0 if none.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import copy
import difflib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tools import kernel_report  # noqa: E402

TARGET = "sm90"  # the default; --target gfx950 (or gfx942) compares the AMD assembly the same way


def normalise(ptx, kernel_name="KERNEL"):
    """PTX (or AMD assembly) without its debug sections, .loc lines, the labels that mark inlined
    functions' scopes for the debugger ($L__tmp, .Ltmp) and comment lines; the kernel's name as
    KERNEL."""
    lines = []
    for line in ptx.splitlines():
        stripped = line.strip()
        if stripped.startswith((".file", ".section\t.debug", ".section .debug")):
            break
        if (stripped.startswith((".loc", "//", ";", ".Lfunc_end", ".Ltmp")) or re.fullmatch(r"\$L__tmp\d+:", stripped)
                or re.fullmatch(r"\.Ltmp\d+:", stripped)):
            continue
        lines.append(line)
    return re.sub(rf"\b{re.escape(kernel_name)}\b", "KERNEL", "\n".join(lines)) + "\n"


def launch_forms(entry):
    """The plan entry and the forms of it that the serving launches also take: SPANS off and a
    float k_scale, for the Hopper paged kernels (entries whose constexprs name both)."""
    constexprs = entry.get("constexprs", {})
    forms = [("plan", entry)]
    if "SPANS" in constexprs and "KV_SCALE_IN_TENSOR" in constexprs:
        if constexprs["SPANS"]:
            forms.append(("spans off", dict(entry, constexprs=dict(constexprs, SPANS=False))))
        if constexprs["KV_SCALE_IN_TENSOR"]:
            forms.append(("float scale", dict(entry, constexprs=dict(constexprs, KV_SCALE_IN_TENSOR=False))))
    return forms


def units(module, target=TARGET):
    """[(key, label, description, plan entry)] of every configuration to compile for the target."""
    rows = kernel_report.discover_rows(module, getattr(module, "TRITON_COMPILE_PLANS", {}))
    found = []
    for row in rows:
        if target not in row["targets"]:
            continue
        plan = module.triton_compile_plan(row["route"], copy.deepcopy(row["params"]),
                                          kernel_report.TARGETS[target].fp8_dtype)
        for index, entry in enumerate(plan):
            if target not in (entry.get("targets") or [target]):
                continue
            for form, compiled in launch_forms(entry):
                description = f"{row['label']} #{index} {form}"
                key = hashlib.sha1(description.encode()).hexdigest()[:16]
                found.append((key, row["label"], description, compiled))
    return found


def identity(entry):
    """What makes two plan entries one compile: the kernel, its signature, constexprs and options."""
    return json.dumps([entry["kernel"].fn.__name__, entry.get("signature"), entry.get("constexprs"),
                       entry.get("aligned_args"), entry.get("num_warps"), entry.get("num_stages"),
                       entry.get("options")], sort_keys=True, default=str)


def compile_one(module_path, key, target=TARGET):
    """Worker: compile the unit `key` of the module and return (kernel name, normalised assembly)."""
    module = kernel_report.load_module(module_path)
    spec = kernel_report.TARGETS[target]
    for unit_key, _, _, entry in units(module, target):
        if unit_key == key:
            kernel, signature, constexprs, attrs, options = kernel_report.complete_plan_entry(entry, spec)
            compiled = kernel_report.compile_unit(kernel, signature, constexprs, attrs, options, spec)
            asm = compiled.asm["amdgcn" if spec.is_amd else "ptx"]
            return kernel.fn.__name__, normalise(asm, compiled.metadata.name)
    raise KeyError(key)


def snapshot(out_dir, module_path, jobs, only=None, target=TARGET):
    module = kernel_report.load_module(module_path)
    found = [unit for unit in units(module, target) if only is None or re.search(only, unit[2])]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = {}
    first = {}  # identity -> the first unit's key: each distinct compile runs once
    for key, _, _, entry in found:
        first.setdefault(identity(entry), key)
    distinct = [unit for unit in found if first[identity(unit[3])] == unit[0]]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        def run(unit):
            key = unit[0]
            result = Path(tmp, key + ".json")
            env = dict(os.environ, TRITON_CACHE_DIR=str(Path(tmp, "cache", key)))
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "worker", str(module_path), key,
                                   str(result), "--target", target], env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                return unit, None, proc.stderr[-2000:]
            return unit, json.loads(result.read_text()), None
        # a process per compile (a fresh Triton state each), a batch of keys per process would save little
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            for unit, result, error in pool.map(run, distinct):
                results[unit[0]] = result, error
    for key, label, description, entry in found:
        result, error = results[first[identity(entry)]]
        if error:
            print(f"FAILED {description}:\n{error}", file=sys.stderr)
            manifest[key] = {"label": label, "unit": description, "error": error}
            continue
        name, ptx = result
        Path(out_dir, key + ".ptx").write_text(ptx)
        manifest[key] = {"label": label, "unit": description, "kernel": name,
                         "sha1": hashlib.sha1(ptx.encode()).hexdigest()}
        print(f"{manifest[key]['sha1'][:12]}  {name:36s} {description}", flush=True)
    Path(out_dir, "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return 1 if any("error" in unit for unit in manifest.values()) else 0


def compare(before_dir, after_dir, partial=False):
    before = json.loads(Path(before_dir, "manifest.json").read_text())
    after = json.loads(Path(after_dir, "manifest.json").read_text())
    differ = 0
    for key, unit in sorted(before.items(), key=lambda item: item[1]["unit"]):
        other = after.get(key)
        if other is None and partial:
            continue
        if other is None or "sha1" not in unit or "sha1" not in other:
            print(f"MISSING or FAILED: {unit['unit']}")
            differ += 1
        else:
            old = normalise(Path(before_dir, key + ".ptx").read_text()).splitlines()
            new = normalise(Path(after_dir, key + ".ptx").read_text()).splitlines()
            if old == new:
                continue
            differ += 1
            diff = list(difflib.unified_diff(old, new, lineterm="", n=1))
            print(f"DIFFERS: {unit['unit']} ({unit['kernel']} -> {other['kernel']}), "
                  f"{sum(1 for d in diff if d[:1] in '+-')} lines:")
            print("\n".join(diff[:40]))
    extra = sorted(set(after) - set(before))
    for key in extra:
        print(f"NEW (not in {before_dir}): {after[key]['unit']}")
    compared = len(before) if not partial else len(set(before) & set(after))
    print(f"{compared - differ} of {compared} compiles identical; {differ} differ or are missing; "
          f"{len(extra)} new")
    return 1 if differ else 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    snap = sub.add_parser("snapshot")
    snap.add_argument("dir")
    snap.add_argument("--module", default=str(REPO_ROOT / "submission.py"))
    snap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    snap.add_argument("--only", metavar="REGEX", help="only the compiles whose description this finds")
    snap.add_argument("--target", default=TARGET, choices=sorted(kernel_report.TARGETS))
    cmp_ = sub.add_parser("compare")
    cmp_.add_argument("before")
    cmp_.add_argument("after")
    cmp_.add_argument("--partial", action="store_true", help="compare only the compiles AFTER holds (--only)")
    work = sub.add_parser("worker")
    work.add_argument("module")
    work.add_argument("key")
    work.add_argument("out")
    work.add_argument("--target", default=TARGET)
    args = parser.parse_args(argv)
    if args.command == "snapshot":
        return snapshot(args.dir, Path(args.module).resolve(), args.jobs, args.only, args.target)
    if args.command == "compare":
        return compare(args.before, args.after, args.partial)
    Path(args.out).write_text(json.dumps(compile_one(args.module, args.key, args.target)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

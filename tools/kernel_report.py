#!/usr/bin/env python3
"""Compile every Triton kernel of submission.py for MI355X, MI300X and H100/H200, without a GPU.

For every configuration the module's route tables can select, each Triton kernel is compiled ahead
of time (``triton.compile`` on an ``ASTSource``) for

    gfx950 (MI355X, the leaderboard's GPU), gfx942 (MI300X), sm90 (H100/H200, Hopper),

and the compiler's own report is read back: registers, spills and scratch, LDS / shared memory, the
occupancy that implies, and the matrix instructions of the hot loop. Compiling is not running: the
proof remains ``popcorn-cli submit --leaderboard amd-mixed-mla --gpu MI355X --mode test
submission.py`` on the real runner. tests/test_kernel_report.py holds the report to a bar in CI.

What is compiled (read from the module, never pasted here)
    Rows: every row of ``TRITON_ROUTE_TABLE`` (when the module has one) and the candidates it races,
    the Triton candidates of ``AITER_ROUTE_TABLE``, plus the optional
    module-level list ``TRITON_EXTRA_CONFIGS`` (rows ``{"route": ..., "params": {...}}``),
    de-duplicated on (route, params). For each row and target the tool calls
    ``triton_compile_plan(route, params, fp8_dtype)`` (fp8_dtype "fp8e4nv" for gfx950 and sm90,
    "fp8e4b8" for gfx942), which returns ``[{kernel, signature, constexprs, aligned_args,
    num_warps, num_stages[, range32_args][, options][, targets]}]``. Constexpr parameters the plan
    leaves out take the kernel's defaults (as the runtime JIT does); ``aligned_args`` get
    ``tt.divisibility=16``; on AMD targets ``range32_args`` get ``tt.pointer_range=32`` (below);
    ``options`` are further compile options (the AMD knobs waves_per_eu, matrix_instr_nonkdim, kpack);
    an entry with ``targets`` (e.g. ["sm90"] for a Gluon Hopper kernel) is compiled for those only.
    Gluon kernels compile through Gluon's own AST source.
    Plan entries that compile to the same thing are compiled once and list every row selecting them.

Isolation
    Each target is compiled in its own Python process, with ``TRITON_INTERPRET=0`` (so that the
    module's ``@triton.jit`` gives compilable kernels even when the caller runs the interpreter) and
    a fresh Triton cache directory. Reason: with Triton 3.6, compiling for gfx950 and then gfx942
    (or the reverse) in ONE process gives the second target the first one's code (gfx942 code with
    gfx950-only ``v_cvt_scalef32_pk_*`` conversions, which then fails to assemble; gfx950 code
    without them): some per-process state of the AMD backend is kept across architectures.

What is reported, per kernel x configuration x target
    AMD (from the amdgcn text): ``; NumVgprs``, ``; NumAgprs``, ``; TotalNumSgprs``,
    ``; ScratchSize``, ``; Occupancy`` comments and the ``.vgpr_spill_count`` /
    ``.sgpr_spill_count`` metadata. NVIDIA: triton's bundled ``ptxas -v --gpu-name sm_90a``:
    "Used N registers", "N bytes stack frame", "N bytes spill stores / loads".
    LDS / shared memory: ``compiled.metadata.shared`` (Triton allocates it dynamically; the AMD
    ``LDSByteSize`` comment is 0 because LLVM never sees it). Limits per block: gfx950 160 KiB,
    gfx942 64 KiB, sm90 227 KiB.

    Matrix instructions: every ``v_mfma*`` / ``v_mfma_scale*`` / ``v_smfmac*`` (AMD) and every
    ``wgmma.mma_async`` / ``mma.sync`` (PTX), counted per distinct kind with operand types, e.g.
    "v_mfma_f32_16x16x128_f8f6f4 fp8.fp8" (the f8f6f4 formats come from the cbsz/blgp modifiers:
    0 fp8 e4m3, 1 bf8 e5m2, 2 fp6 e2m3, 3 bf6 e3m2, 4 fp4 e2m1; absent = 0) or
    "wgmma m64n8k32 e4m3.e4m3" (A.B types). The hot loop is the loop, as LLVM annotates it in
    the assembly ("Loop Header: Depth=N" / "in Loop: Header=BBx_y"), holding the most matrix
    instructions (instructions of an inner loop count for the inner loop). Both the hot loop's
    and the whole kernel's counts are reported (pipelining puts some of them outside the loop).
    Global loads: the load instructions of that same hot loop, per kind, with the widest per-lane
    width: ``global_load_*`` / ``buffer_load_*`` (AMD: ubyte 8, ushort 16, dword 32 ... dwordx4 128
    bits) and ``ld.global[.vN].bM``, ``cp.async N B``, TMA copies (PTX). On AMD the plans'
    ``range32_args`` are compiled as Triton's HIP JIT sees a tensor within 2 GiB
    (``tt.pointer_range=32``), which turns global loads into buffer loads and changes the registers.
    ``uses_dot_scaled``: the config's TTIR holds ``tt.dot_scaled`` (a constexpr branch may remove
    a ``tl.dot_scaled`` call that the source has; ``source_mentions_dot_scaled`` tells that).

Occupancy formulas (the assumptions are stated; check them against the hardware guides)
    AMD gfx942 / gfx950 (CDNA3 / CDNA4, wave64): each SIMD has a unified file of 512 VGPRs per
    lane (128 KiB per SIMD, 512 KiB per CU of 4 SIMDs) shared by architectural VGPRs and AGPRs; a
    wave allocates ``total = align(NumVgprs, 4) + NumAgprs`` (just NumVgprs when NumAgprs is 0;
    AGPRs start at AccumOffset = align(NumVgprs, 4)) in granules of 8, and a SIMD holds at most 8
    waves (LLVM: 8 for every gfx90a-class target), so

        waves_regs = min(8, floor(512 / align(total, 8)), waves_sgpr)
        waves_sgpr = 10 if sgpr <= 80, 9 if <= 88, 8 if <= 100, else 7   (GFX9 rule; rarely binds)

    This is what LLVM prints as ``; Occupancy`` when nothing else limits it; the tool reports the
    compiler's number and its own (tests check that they agree). A workgroup of ``num_warps``
    waves is spread over the CU's 4 SIMDs and lives on one CU, so whole workgroups must fit:

        wg_regs = floor(4 * waves_regs / num_warps)      (0 means it cannot launch)
        wg_lds  = floor(LDS_per_CU / lds_bytes)           (LDS per CU: gfx950 160 KiB, gfx942 64 KiB)
        resident waves / SIMD = min(wg_regs, wg_lds) * num_warps / 4

    Hence 8 warps can only launch with at most 256 VGPR+AGPR per wave (2 waves per SIMD): LLVM
    caps the allocation there, and a kernel needing more spills to scratch.

    NVIDIA sm_90 (CUDA occupancy calculator rules for compute capability 9.0): 65536 32-bit
    registers per SM, allocated per warp in units of 256 (``regs_warp = align(regs * 32, 256)``),
    at most 255 registers per thread, 64 warps and 32 blocks per SM, 228 KiB shared memory per SM
    (227 KiB at most per block), 1 KiB reserved by the system per block, shared memory allocated
    in units of 128 bytes:

        blocks_regs = floor(floor(65536 / regs_warp) / num_warps)
        blocks_smem = floor(228 KiB / (align(shared, 128) + 1 KiB))
        blocks_warps = floor(64 / num_warps), and at most 32
        warps / SM = min(blocks_regs, blocks_smem, blocks_warps, 32) * num_warps

Inline assembly
    The source of every kernel (and of every ``@triton.jit`` helper it calls, recursively) is
    scanned for ``inline_asm_elementwise``; a call counts as guarded when it sits inside an ``if``
    (or conditional expression) whose condition names a target (cuda/hip/amd/nvidia/rocm/gfx/sm/
    arch/target/backend/IS_*), or in a Gluon kernel (Gluon is written for one target's layouts and
    instructions, and its compile plans name that target). Unguarded inline assembly is flagged:
    it ties a kernel to one ISA.

Usage
    python tools/kernel_report.py [--module submission.py] [--tables PATH] [--targets gfx950,gfx942,sm90]
                                  [--json PATH] [--markdown] [--dump DIR] [--jobs N] [--cache-dir DIR]
    --tables: where TRITON_ROUTE_TABLE / TRITON_EXTRA_CONFIGS are read (default: the module when it
    defines them, else the repository's submission.py, e.g. for a work-in-progress kernel file).
Exit status 0 when every configuration compiled for every target asked for, 1 otherwise.
"""
from __future__ import annotations

import argparse
import ast
import copy
import datetime
import hashlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
TOOL_PATH = Path(__file__).resolve()
KIB = 1024


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

# AMD CDNA3/CDNA4 register file and wave limits (see the module docstring).
AMD_VGPRS_PER_LANE = 512
AMD_VGPR_GRANULE = 8
AMD_MAX_WAVES_PER_SIMD = 8
AMD_SIMDS_PER_CU = 4
# NVIDIA sm_90 (CUDA occupancy calculator, compute capability 9.0).
NV_REGS_PER_SM = 65536
NV_REG_ALLOC_UNIT = 256
NV_MAX_REGS_PER_THREAD = 255
NV_MAX_WARPS_PER_SM = 64
NV_MAX_BLOCKS_PER_SM = 32
NV_SMEM_RESERVED_PER_BLOCK = 1 * KIB
NV_SMEM_ALLOC_UNIT = 128


def _align(x, unit):
    return -(-x // unit) * unit


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


def defines_compile_plan(path):
    """True when the file defines a top-level function triton_compile_plan (parsed, not imported)."""
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError):
        return False
    return any(isinstance(n, ast.FunctionDef) and n.name == "triton_compile_plan" for n in tree.body)


# ---------------------------------------------------------------------------------------------
# Occupancy


def amd_waves_from_sgprs(sgpr):
    """GFX9 SGPR occupancy rule (LLVM getOccupancyWithNumSGPRs for VI..GFX9)."""
    if sgpr is None:
        return AMD_MAX_WAVES_PER_SIMD
    if sgpr <= 80:
        return 10
    if sgpr <= 88:
        return 9
    if sgpr <= 100:
        return 8
    return 7


def amd_occupancy(vgpr, agpr, sgpr, lds_bytes, num_warps, lds_per_cu):
    """Waves per SIMD on gfx942/gfx950 (formulas in the module docstring)."""
    agpr = agpr or 0
    total = _align(max(vgpr, 1), 4) + agpr if agpr else max(vgpr, 1)
    alloc = _align(total, AMD_VGPR_GRANULE)
    waves_vgpr = AMD_VGPRS_PER_LANE // alloc
    waves_regs = min(AMD_MAX_WAVES_PER_SIMD, waves_vgpr, amd_waves_from_sgprs(sgpr))
    wg_regs = (AMD_SIMDS_PER_CU * waves_regs) // num_warps
    wg_lds = lds_per_cu // lds_bytes if lds_bytes else None
    wg = wg_regs if wg_lds is None else min(wg_regs, wg_lds)
    limiter = "registers" if wg_lds is None or wg_regs <= wg_lds else "LDS"
    return {
        "unit": "waves/SIMD",
        "vgpr_alloc": alloc,
        "waves_from_registers": waves_regs,
        "workgroups_from_registers": wg_regs,
        "workgroups_from_lds": wg_lds,
        "resident": wg * num_warps / AMD_SIMDS_PER_CU,
        "limiter": limiter,
    }


def nvidia_occupancy(regs, shared_bytes, num_warps, smem_per_sm=228 * KIB):
    """Warps per SM on sm_90 (formulas in the module docstring)."""
    regs_warp = _align(max(regs, 1) * 32, NV_REG_ALLOC_UNIT)
    blocks_regs = (NV_REGS_PER_SM // regs_warp) // num_warps
    smem_block = _align(shared_bytes, NV_SMEM_ALLOC_UNIT) + NV_SMEM_RESERVED_PER_BLOCK
    blocks_smem = smem_per_sm // smem_block
    blocks_warps = NV_MAX_WARPS_PER_SM // num_warps
    limits = {"registers": blocks_regs, "shared memory": blocks_smem, "warps": blocks_warps,
              "blocks": NV_MAX_BLOCKS_PER_SM}
    limiter = min(limits, key=lambda k: limits[k])
    blocks = limits[limiter]
    return {
        "unit": "warps/SM",
        "regs_per_warp": regs_warp,
        "blocks_from_registers": blocks_regs,
        "blocks_from_shared": blocks_smem,
        "blocks_from_warps": blocks_warps,
        "resident": blocks * num_warps,
        "limiter": limiter,
    }


# ---------------------------------------------------------------------------------------------
# Assembly parsing

_BLOCK_START = re.compile(r"^(?:(?P<label>\.LBB\d+_\d+|\$L__BB\d+_\d+):|\s*(?:;|//)\s*%bb\.(?P<bb>\d+):)")
_LOOP_HEADER = re.compile(r"Loop Header: Depth=\d+")
_IN_LOOP = re.compile(r"in Loop: Header=(BB\d+_\d+) Depth=\d+")


def loop_headers(lines):
    """The innermost loop (its header, e.g. 'BB0_65') of each line, or None: read from LLVM's
    loop comments ('=>This Inner Loop Header: Depth=1', ';   in Loop: Header=BB0_65 Depth=1')."""
    out = []
    current = None
    label = None
    annotating = False  # on a block's first line or the comment-only lines right after it
    for line in lines:
        m = _BLOCK_START.match(line)
        if m:
            current = None
            if m.group("label"):
                label = re.search(r"BB\d+_\d+", m.group("label")).group(0)
            else:
                label = f"bb.{m.group('bb')}"
            annotating = True
        elif annotating and not line.strip().startswith((";", "//")):
            annotating = False
        if annotating:
            if _LOOP_HEADER.search(line):
                current = label
            else:
                h = _IN_LOOP.search(line)
                if h:
                    current = h.group(1)
        out.append(current)
    return out


_F8F6F4_FORMATS = {0: "fp8", 1: "bf8", 2: "fp6", 3: "bf6", 4: "fp4"}
_AMD_MMA = re.compile(r"^\s+(v_(?:mfma|smfmac)\w*)\b(.*)$")
_AMD_MMA_NAME = re.compile(r"^v_(?:mfma|smfmac)(?:_scale)?_([a-z]+\d+)_(\d+x\d+x\d+)_?([a-z0-9_]*)$")


def amd_mma_kind(mnemonic, operands=""):
    """('v_mfma_f32_16x16x128_f8f6f4', ' v[0:3], ... cbsz:1') -> ('v_mfma_... ', 'fp8', 'bf8')."""
    m = _AMD_MMA_NAME.match(mnemonic)
    if not m:
        return mnemonic, "?", "?"
    types = m.group(3)
    if types.endswith("f8f6f4"):
        cbsz = re.search(r"\bcbsz:(\d+)", operands)
        blgp = re.search(r"\bblgp:(\d+)", operands)
        a = _F8F6F4_FORMATS.get(int(cbsz.group(1)) if cbsz else 0, "?")
        b = _F8F6F4_FORMATS.get(int(blgp.group(1)) if blgp else 0, "?")
        return mnemonic, a, b
    parts = [t for t in types.split("_") if t and t != "1k"]
    if not parts:
        return mnemonic, "?", "?"
    return mnemonic, parts[0], parts[-1]


def amd_mma_in_line(line):
    m = _AMD_MMA.match(line)
    if not m:
        return None
    name, a, b = amd_mma_kind(m.group(1), m.group(2))
    return f"{name} {a}.{b}"


_PTX_MMA = re.compile(
    r"^\s*(?:@!?%\w+\s+)?(wgmma\.mma_async(?:\.sp)?|mma(?:\.sp(?:::ordered_metadata)?)?)\.sync\.aligned"
    r"\.(m\d+n\d+k\d+)\.([\w.:]+)")
_PTX_LAYOUTS = {"row", "col", "satfinite"}


def ptx_mma_in_line(line):
    """'wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 ...' -> 'wgmma m64n8k32 e4m3.e4m3'."""
    m = _PTX_MMA.match(line)
    if not m:
        return None
    op = "wgmma" if m.group(1).startswith("wgmma") else "mma"
    if ".sp" in m.group(1):
        op += ".sp"
    types = [t for t in m.group(3).split(".") if t and t not in _PTX_LAYOUTS and "::" not in t]
    a, b = (types[1], types[2]) if len(types) >= 3 else ("?", "?")
    return f"{op} {m.group(2)} {a}.{b}"


def matrix_instructions(text, parse_line):
    """Counts of matrix-instruction kinds in the hot loop and in the whole kernel."""
    lines = text.splitlines()
    total = Counter()
    per_loop = defaultdict(Counter)
    for line, header in zip(lines, loop_headers(lines), strict=True):
        kind = parse_line(line)
        if kind is None:
            continue
        total[kind] += 1
        if header is not None:
            per_loop[header][kind] += 1
    hot = max(per_loop, key=lambda h: sum(per_loop[h].values()), default=None)
    loop = dict(sorted(per_loop[hot].items())) if hot else {}
    return {
        "loop_header": hot,
        "loop": loop,
        "loop_count": sum(loop.values()),
        "total": dict(sorted(total.items())),
        "total_count": sum(total.values()),
        "loops_with_mma": len(per_loop),
    }


_AMD_LOAD = re.compile(r"^\s+((?:global|buffer)_load_(?:lds_)?(\w+?))(?:\s|$)")
_AMD_LOAD_BITS = {"ubyte": 8, "sbyte": 8, "ubyte_d16": 8, "sbyte_d16": 8, "ubyte_d16_hi": 8, "sbyte_d16_hi": 8,
                  "ushort": 16, "sshort": 16, "short_d16": 16, "short_d16_hi": 16,
                  "dword": 32, "dwordx2": 64, "dwordx3": 96, "dwordx4": 128}
_PTX_LOAD = re.compile(r"^\s*(?:@!?%\w+\s+)?(ld\.global[\w.]*|cp\.async\.bulk\.tensor[\w.:]*|cp\.async\.c[ag]"
                       r"[\w.]*)\s+([^;]*)")


def amd_load_in_line(line):
    """'\tbuffer_load_dwordx4 v[0:3], ...' -> 'buffer_load_dwordx4' (global and buffer loads, those
    straight to LDS too); None for anything else."""
    m = _AMD_LOAD.match(line)
    return m.group(1) if m else None


def ptx_load_in_line(line):
    """'ld.global.nc.v4.b32 {..}, [..];' -> 'ld.global.v4.b32'; cp.async of N bytes -> 'cp.async NB';
    a TMA copy -> 'cp.async.bulk.tensor'; None for anything else."""
    m = _PTX_LOAD.match(line)
    if not m:
        return None
    op = m.group(1)
    if op.startswith("cp.async.bulk.tensor"):
        return "cp.async.bulk.tensor"
    if op.startswith("cp.async"):
        size = re.search(r",\s*(0x[0-9a-fA-F]+|\d+)\s*(?:,|$)", m.group(2))
        return f"cp.async {int(size.group(1), 0) if size else '?'}B"
    parts = [t for t in op.split(".") if t in ("ld", "global") or re.fullmatch(r"v\d|[bfsu]\d+", t)]
    return ".".join(parts)


def load_bits(name):
    """The width of one lane's load in bits ('buffer_load_dwordx4' -> 128, 'ld.global.v2.b32' -> 64,
    'cp.async 16B' -> 128), None when unknown (a TMA copy has no per-lane width)."""
    m = re.match(r"(?:global|buffer)_load_(?:lds_)?(\w+)$", name)
    if m:
        return _AMD_LOAD_BITS.get(m.group(1))
    m = re.match(r"cp\.async (\d+)B$", name)
    if m:
        return 8 * int(m.group(1))
    m = re.match(r"ld\.global(?:\.v(\d))?\.[bfsu](\d+)$", name)
    if m:
        return int(m.group(1) or 1) * int(m.group(2))
    return None


def loop_instructions(text, parse_line, header):
    """Counts of the kinds parse_line finds inside the loop `header` (None: the whole text)."""
    lines = text.splitlines()
    counts = Counter()
    for line, where in zip(lines, loop_headers(lines), strict=True):
        kind = parse_line(line)
        if kind is not None and (header is None or where == header):
            counts[kind] += 1
    return dict(sorted(counts.items()))


def global_loads(text, parse_line, header):
    """Loads from global memory in the hot loop and in the whole kernel, with the widest
    per-lane width (bits) of each."""
    loop = loop_instructions(text, parse_line, header) if header else {}
    total = loop_instructions(text, parse_line, None)

    def widest(counts):
        return max((load_bits(k) or 0 for k in counts), default=0) or None
    return {"loop": loop, "total": total, "loop_widest_bits": widest(loop), "total_widest_bits": widest(total)}


def mma_operand_types(kind):
    """'v_mfma_f32_16x16x32_fp8_fp8 fp8.fp8' / 'wgmma m64n8k32 e4m3.e4m3' -> ('fp8', 'fp8')."""
    a, _, b = kind.rsplit(" ", 1)[-1].partition(".")
    return a, b


FP8_OPERAND_TYPES = {"fp8", "bf8", "e4m3", "e5m2"}


def is_fp8_mma(kind):
    a, b = mma_operand_types(kind)
    return a in FP8_OPERAND_TYPES and b in FP8_OPERAND_TYPES


def is_scaled_mma(kind):
    return kind.startswith("v_mfma_scale")


def _comment_int(text, key):
    m = re.search(rf"^\s*;\s*{key}:\s*(\d+)\s*$", text, re.M)
    return int(m.group(1)) if m else None


def _meta_int(text, key):
    m = re.search(rf"^\s*\.{key}:\s*(\d+)\s*$", text, re.M)
    return int(m.group(1)) if m else None


def parse_amdgcn(text):
    """Register, scratch and occupancy facts of the (first) kernel in an amdgcn listing."""
    kernel_info = text.find("; Kernel info:")
    body = text[kernel_info:] if kernel_info >= 0 else text
    sgpr = _comment_int(body, "TotalNumSgprs")
    return {
        "vgpr": _comment_int(body, "NumVgprs"),
        "agpr": _comment_int(body, "NumAgprs"),
        "sgpr": sgpr if sgpr is not None else _comment_int(body, "NumSgprs"),
        "total_vgpr": _comment_int(body, "TotalNumVgprs"),
        "accum_offset": _comment_int(body, "AccumOffset"),
        "sgpr_for_waves": _comment_int(body, "NumSGPRsForWavesPerEU"),
        "scratch_bytes": _comment_int(body, "ScratchSize"),
        "occupancy": _comment_int(body, "Occupancy"),
        "vgpr_spill_count": _meta_int(text, "vgpr_spill_count"),
        "sgpr_spill_count": _meta_int(text, "sgpr_spill_count"),
        "private_segment_bytes": _meta_int(text, "private_segment_fixed_size"),
    }


def parse_ptxas(output):
    """'ptxas -v' output -> registers, stack frame, spill stores / loads (bytes)."""
    def grab(pattern):
        m = re.search(pattern, output)
        return int(m.group(1)) if m else None
    return {
        "registers": grab(r"Used (\d+) registers"),
        "stack_frame_bytes": grab(r"(\d+) bytes stack frame"),
        "spill_store_bytes": grab(r"(\d+) bytes spill stores"),
        "spill_load_bytes": grab(r"(\d+) bytes spill loads"),
    }


def ptxas_path():
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if os.path.exists(bundled):
        return bundled
    found = shutil.which("ptxas")
    if found:
        return found
    raise FileNotFoundError(f"no ptxas: neither {bundled} nor one on PATH")


def run_ptxas(ptx):
    arch = re.search(r"^\s*\.target\s+(sm_\w+)", ptx, re.M)
    gpu_name = arch.group(1) if arch else "sm_90a"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run([ptxas_path(), "-v", "--gpu-name", gpu_name, src, "-o", os.devnull],
                              capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed ({proc.returncode}): {output[-2000:]}")
    return output


# ---------------------------------------------------------------------------------------------
# Inline assembly scan

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


def jit_functions_reached(kernel):
    """Names of the @triton.jit functions a kernel calls, recursively (not the kernel itself)."""
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
            if isinstance(node, ast.Call):
                target = _resolve_global(node.func, jf.fn.__globals__)
                if target is not None and _is_jit_function(target) and target.fn is not jf.fn:
                    names.add(target.fn.__name__)
                    stack.append(target)
    return names


# ---------------------------------------------------------------------------------------------
# Module loading and compile plans


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


def config_label(route, params):
    return f"{route} {_params_key(params)}"


def discover_rows(module, tables_module=None):
    """TRITON_ROUTE_TABLE rows + TRITON_EXTRA_CONFIGS, de-duplicated on (route, params).

    Both lists are read from `tables_module` (default: `module`); TRITON_EXTRA_CONFIGS of `module`
    itself are read as well when the tables come from elsewhere."""
    rows = {}
    tables = tables_module if tables_module is not None else module
    sources = [("TRITON_ROUTE_TABLE", getattr(tables, "TRITON_ROUTE_TABLE", None) or []),
               ("TRITON_EXTRA_CONFIGS", getattr(tables, "TRITON_EXTRA_CONFIGS", None) or []),
               ("AITER_ROUTE_TABLE", getattr(tables, "AITER_ROUTE_TABLE", None) or [])]
    if tables is not module:
        sources.append(("TRITON_EXTRA_CONFIGS", getattr(module, "TRITON_EXTRA_CONFIGS", None) or []))
    compiled_routes = getattr(module, "TRITON_COMPILE_PLANS", None)
    for table_name, table in sources:
        for i, row in enumerate(table):
            # a row's own route, then the candidates it races on a first call (Triton ones only: the
            # aiter table's aiter routes have nothing to compile)
            for j, candidate in enumerate([row, *(row.get("candidates") or [])]):
                if table_name == "AITER_ROUTE_TABLE" and (compiled_routes is None
                                                          or candidate["route"] not in compiled_routes):
                    continue
                params = dict(candidate.get("params") or {})
                key = (candidate["route"], _params_key(params))
                entry = rows.setdefault(key, {"route": candidate["route"], "params": params, "sources": [],
                                              "targets": set()})
                entry["sources"].append(f"{table_name}[{i}]" + (f".candidates[{j - 1}]" if j else ""))
                # the aiter table runs only where aiter does (AMD); a row any other list names runs anywhere
                entry["targets"] |= AITER_TARGETS if table_name == "AITER_ROUTE_TABLE" else set(TARGETS)
    return [dict(row, targets=sorted(row["targets"])) for row in rows.values()]


def amd_buffer_ops_enabled():
    """Whether Triton's HIP JIT marks tensors within 2 GiB (AMDGCN_USE_BUFFER_OPS, on by default)."""
    import triton

    return bool(triton.knobs.amd.use_buffer_ops)


def complete_plan_entry(entry, spec=None):
    """A plan entry -> (kernel, signature, constexprs, attrs, options) ready for ASTSource.

    On an AMD target (spec) the entry's ``range32_args`` get ``tt.pointer_range=32`` as well, as
    Triton's HIP JIT gives every tensor argument within 2 GiB (its "S" specialisation; the code then
    uses buffer loads with 32-bit offsets), unless AMDGCN_USE_BUFFER_OPS turns that off."""
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
    if spec is not None and spec.is_amd and amd_buffer_ops_enabled():
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
    t0 = time.time()
    compiled = compile_unit(kernel, signature, constexprs, attrs, options, spec)
    result = {"compile_s": round(time.time() - t0, 2),
              # whether THIS config's code uses tl.dot_scaled (a constexpr branch may remove it)
              "uses_dot_scaled": "tt.dot_scaled" in compiled.asm.get("ttir", "")}
    shared = int(getattr(compiled.metadata, "shared", 0) or 0)
    num_warps = options["num_warps"]
    result["lds_bytes"] = shared
    result["lds_limit_bytes"] = spec.lds_per_block
    result["lds_fits"] = shared <= spec.lds_per_block
    if spec.is_amd:
        asm = compiled.asm["amdgcn"]
        facts = parse_amdgcn(asm)
        result["registers"] = {"vgpr": facts["vgpr"], "agpr": facts["agpr"], "sgpr": facts["sgpr"]}
        result["spills"] = {"vgpr_spill_count": facts["vgpr_spill_count"],
                            "sgpr_spill_count": facts["sgpr_spill_count"],
                            "scratch_bytes": facts["scratch_bytes"]}
        occ = amd_occupancy(facts["vgpr"] or 0, facts["agpr"], facts["sgpr_for_waves"] or facts["sgpr"],
                            shared, num_warps, spec.lds_per_unit)
        occ["compiler"] = facts["occupancy"]
        result["occupancy"] = occ
        result["mma"] = matrix_instructions(asm, amd_mma_in_line)
        result["loads"] = global_loads(asm, amd_load_in_line, result["mma"]["loop_header"])
        result["asm_kind"] = "amdgcn"
    else:
        asm = compiled.asm["ptx"]
        facts = parse_ptxas(run_ptxas(asm))
        result["registers"] = {"per_thread": facts["registers"]}
        result["spills"] = {"spill_store_bytes": facts["spill_store_bytes"],
                            "spill_load_bytes": facts["spill_load_bytes"],
                            "stack_frame_bytes": facts["stack_frame_bytes"]}
        occ = nvidia_occupancy(facts["registers"] or 0, shared, num_warps, spec.lds_per_unit)
        occ["compiler"] = None
        result["occupancy"] = occ
        result["mma"] = matrix_instructions(asm, ptx_mma_in_line)
        result["loads"] = global_loads(asm, ptx_load_in_line, result["mma"]["loop_header"])
        result["asm_kind"] = "ptx"
    result["asm_sha1"] = hashlib.sha1(asm.encode()).hexdigest()[:12]  # equal code, equal hash
    values = list(result["spills"].values())
    result["spill_free"] = all(v == 0 for v in values)
    result["spill_parsed"] = all(v is not None for v in values)
    return result, asm


def route_kv_format(route, *modules):
    """ROUTE_INFO[route]["kv_format"] from the first module that knows the route, else a guess
    from the route's name ("mxfp4" / "fp8" / "bf16" in it), else None."""
    for module in modules:
        info = (getattr(module, "ROUTE_INFO", None) or {}).get(route)
        if info and info.get("kv_format"):
            return info["kv_format"]
    for fmt in ("mxfp4", "fp8", "bf16"):
        if fmt in route:
            return fmt
    return None


def _non_default_constexprs(kernel, constexprs):
    """The constexprs that do not merely repeat the kernel's defaults (what a config chooses)."""
    defaults = {p.name: p.default for p in kernel.params if p.has_default}
    return {k: v for k, v in constexprs.items() if k not in defaults or defaults[k] != v}


def _slug(text):
    return re.sub(r"[^0-9A-Za-z]+", "_", text).strip("_")[:80]


def tables_path_for(module_path, tables_path=None):
    """Where the route tables are read from: `tables_path` when given; else the module itself when
    it defines TRITON_ROUTE_TABLE or TRITON_EXTRA_CONFIGS (parsed, not imported); else the
    repository's submission.py (a work-in-progress kernel file holds no tables)."""
    if tables_path:
        return resolve_module_path(tables_path)
    module_path = Path(module_path).resolve()
    try:
        tree = ast.parse(module_path.read_text())
    except (OSError, SyntaxError):
        return module_path
    names = {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
             for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
    if names & {"TRITON_ROUTE_TABLE", "TRITON_EXTRA_CONFIGS"}:
        return module_path
    fallback = REPO_ROOT / "submission.py"
    return fallback.resolve() if fallback.exists() else module_path


def worker(target, module_path, dump_dir=None, tables_path=None):
    """Everything for one target, in this process: returns the JSON-able partial report."""
    spec = TARGETS[target]
    out = {"target": target, "records": [], "rows": [], "rows_without_kernels": [],
           "module_kernels": [], "uncovered_kernels": [], "inline_asm": [], "errors": []}
    module = load_module(module_path)
    plan_fn = getattr(module, "triton_compile_plan", None)
    tables_path = tables_path_for(module_path, tables_path)
    tables_module = module if tables_path == Path(module_path).resolve() else load_module(tables_path)
    rows = discover_rows(module, tables_module)
    out["rows"] = _jsonable(rows)
    if plan_fn is None:
        out["errors"].append(f"{module_path} defines no triton_compile_plan(route, params, fp8_dtype)")
        return out
    units = {}
    other_targets = []  # kernels planned only for other targets: covered, not compiled here
    for row in rows:
        try:
            plan = plan_fn(row["route"], copy.deepcopy(row["params"]), spec.fp8_dtype)
        except Exception as exc:  # a broken plan is a finding, not a crash of the tool
            out["errors"].append(f"triton_compile_plan({row['route']!r}, {row['params']!r}): {_short_error(exc)}")
            continue
        if not plan:
            out["rows_without_kernels"].append(config_label(row["route"], row["params"]))
        for entry in plan:
            if (entry.get("targets") is not None and target not in entry["targets"]) or target not in row.get(
                    "targets", TARGETS):
                other_targets.append(entry["kernel"])
                continue
            try:
                kernel, signature, constexprs, attrs, options = complete_plan_entry(entry, spec)
            except Exception as exc:
                out["errors"].append(f"{config_label(row['route'], row['params'])}: {_short_error(exc)}")
                continue
            key = (id(kernel.fn), _params_key(signature), _params_key(constexprs), repr(sorted(attrs)),
                   _params_key(options))
            unit = units.setdefault(key, {"kernel": kernel, "signature": signature, "constexprs": constexprs,
                                          "shown_constexprs": _non_default_constexprs(kernel, constexprs),
                                          "attrs": attrs, "options": options, "rows": []})
            unit["rows"].append({"route": row["route"], "params": row["params"],
                                 "label": config_label(row["route"], row["params"])})
    planned = []
    for unit in units.values():
        kernel = unit["kernel"]
        if kernel not in planned:
            planned.append(kernel)
        first = unit["rows"][0]
        record = {
            "kernel": kernel.fn.__name__, "target": target, "gpu": spec.gpu,
            "route": first["route"], "params": first["params"],
            "config": " | ".join(r["label"] for r in unit["rows"]),
            "rows": unit["rows"],
            "constexprs": unit["shown_constexprs"], "all_constexprs": unit["constexprs"],
            "num_warps": unit["options"]["num_warps"], "num_stages": unit["options"]["num_stages"],
            "options": unit["options"], "fp8_dtype": spec.fp8_dtype,
            "kv_format": route_kv_format(first["route"], module, tables_module),
            "source_mentions_dot_scaled": "dot_scaled" in inspect.getsource(kernel.fn),
            "compiled": False, "error": None,
        }
        try:
            result, asm = compile_and_analyse(kernel, unit["signature"], unit["constexprs"], unit["attrs"],
                                              unit["options"], spec)
            record.update(result)
            record["compiled"] = True
            if dump_dir:
                os.makedirs(dump_dir, exist_ok=True)
                name = f"{record['kernel']}-{_slug(record['config'])}-{target}.{result['asm_kind']}"
                Path(dump_dir, name).write_text(asm)
        except Exception as exc:
            record["error"] = _short_error(exc)
        out["records"].append(_jsonable(record))
    # Every @triton.jit kernel of the module should be reachable from some plan.
    module_kernels = {name: obj for name, obj in vars(module).items()
                      if _is_jit_function(obj) and getattr(obj.fn, "__module__", None) == module.__name__}
    out["module_kernels"] = sorted(module_kernels)
    reached = {k.fn.__name__ for k in planned + other_targets}
    for k in planned + other_targets:
        reached |= jit_functions_reached(k)
    out["uncovered_kernels"] = sorted(n for n, obj in module_kernels.items() if obj.fn.__name__ not in reached)
    out["inline_asm"] = scan_inline_asm(
        list(module_kernels.values()) + [k for k in planned if k not in module_kernels.values()])
    return out


# ---------------------------------------------------------------------------------------------
# Driver: one process per target

_COST_ORDER = {"gfx942": 0, "gfx950": 1, "sm90": 2}  # slowest first when running in parallel


def _display_path(path):
    path = Path(path)
    return os.path.relpath(path, REPO_ROOT) if path.is_relative_to(REPO_ROOT) else str(path)


def build_report(module_path="submission.py", targets=DEFAULT_TARGETS, jobs=None, cache_dir=None,
                 dump_dir=None, tables_path=None, timeout_s=600):
    """Compile everything for each target (a process each, `jobs` at a time) and merge."""
    import triton

    module_path = resolve_module_path(module_path)
    tables_path = tables_path_for(module_path, tables_path)
    targets = resolve_targets(targets)
    jobs = max(1, min(jobs or (os.cpu_count() or 1), len(targets)))
    report = {
        "tool": "tools/kernel_report.py",
        "module": _display_path(module_path),
        "tables_from": _display_path(tables_path),
        "triton_version": triton.__version__,
        "date": datetime.date.today().isoformat(),
        "targets": targets,
        "target_specs": {t: {"gpu": TARGETS[t].gpu, "fp8_dtype": TARGETS[t].fp8_dtype,
                             "lds_per_block": TARGETS[t].lds_per_block,
                             "lds_per_unit": TARGETS[t].lds_per_unit} for t in targets},
        "rows": [], "rows_without_kernels": [], "records": [], "module_kernels": [],
        "uncovered_kernels": [], "inline_asm": [], "errors": [], "worker_errors": {},
    }
    with tempfile.TemporaryDirectory(prefix="kernel_report_") as tmp:
        pending = sorted(targets, key=lambda t: _COST_ORDER.get(t, 9))
        running = {}
        results = {}
        while pending or running:
            while pending and len(running) < jobs:
                t = pending.pop(0)
                env = dict(os.environ)
                env["TRITON_INTERPRET"] = "0"
                env["TRITON_CACHE_DIR"] = os.path.join(cache_dir, t) if cache_dir else os.path.join(tmp, f"cache_{t}")
                out_path = os.path.join(tmp, f"{t}.json")
                cmd = [sys.executable, str(TOOL_PATH), "--worker", t, "--module", str(module_path),
                       "--tables", str(tables_path), "--worker-out", out_path]
                if dump_dir:
                    cmd += ["--dump", str(dump_dir)]
                log = open(os.path.join(tmp, f"{t}.log"), "w")
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO_ROOT))
                running[t] = (proc, log, out_path, time.time())
            time.sleep(0.05)
            for t, (proc, log, out_path, started) in list(running.items()):
                if proc.poll() is None and time.time() - started < timeout_s:
                    continue
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                log.close()
                del running[t]
                log_text = Path(tmp, f"{t}.log").read_text(errors="replace")
                if proc.returncode == 0 and os.path.exists(out_path):
                    results[t] = json.loads(Path(out_path).read_text())
                else:
                    report["worker_errors"][t] = (f"worker for {t} exited with {proc.returncode}: "
                                                  + log_text[-3000:])
    seen_asm = set()
    for t in targets:
        part = results.get(t)
        if part is None:
            continue
        if not report["rows"]:
            report["rows"] = part["rows"]
            report["module_kernels"] = part["module_kernels"]
        report["records"].extend(part["records"])
        for label in part["rows_without_kernels"]:
            if label not in report["rows_without_kernels"]:
                report["rows_without_kernels"].append(label)
        for name in part["uncovered_kernels"]:
            if name not in report["uncovered_kernels"]:
                report["uncovered_kernels"].append(name)
        for finding in part["inline_asm"]:
            key = (finding["function"], finding["line"])
            if key not in seen_asm:
                seen_asm.add(key)
                report["inline_asm"].append(finding)
        for err in part["errors"]:
            msg = f"[{t}] {err}"
            if msg not in report["errors"]:
                report["errors"].append(msg)
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
    return (f"spill st {s.get('spill_store_bytes')} B ld {s.get('spill_load_bytes')} B, "
            f"stack {s.get('stack_frame_bytes')} B")


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
        notes.append(f"WARNING: @triton.jit kernel {name} is selected by no route-table row or "
                     "TRITON_EXTRA_CONFIGS entry: it was not compiled")
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
                        help="read TRITON_ROUTE_TABLE / TRITON_EXTRA_CONFIGS from this file (default: the "
                             "module when it has them, else submission.py)")
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

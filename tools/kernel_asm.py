"""Reading a compiled Triton kernel: registers, spills, LDS / shared memory, the occupancy they
imply, and the matrix and global-load instructions of its hot loop (tools/kernel_report.py's facts).

AMD facts come from the amdgcn text (LLVM's ``; NumVgprs`` ... comments and the ``.vgpr_spill_count``
metadata), NVIDIA facts from Triton's bundled ``ptxas -v`` on the PTX, from the PTX itself, and from
the cubin's SASS (``cuobjdump -sass``: where the first TMA issue and the first float max fall). The
hot loop is the loop, as LLVM annotates it in the assembly ("Loop Header: Depth=N" / "in Loop:
Header=BBx_y"), holding the most matrix instructions.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter, defaultdict

KIB = 1024
# AMD CDNA3/CDNA4 register file and wave limits (amd_occupancy).
AMD_VGPRS_PER_LANE = 512
AMD_VGPR_GRANULE = 8
AMD_MAX_WAVES_PER_SIMD = 8
AMD_SIMDS_PER_CU = 4
# NVIDIA sm_90 (nvidia_occupancy).
NV_REGS_PER_SM = 65536
NV_REG_ALLOC_UNIT = 256
NV_MAX_WARPS_PER_SM = 64
NV_MAX_BLOCKS_PER_SM = 32
NV_SMEM_RESERVED_PER_BLOCK = 1 * KIB
NV_SMEM_ALLOC_UNIT = 128


def _align(x, unit):
    return -(-x // unit) * unit


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
    """Waves per SIMD on gfx942 / gfx950 (CDNA3 / CDNA4, wave64).

    Each SIMD has a unified file of 512 VGPRs per lane shared by architectural VGPRs and AGPRs; a
    wave allocates ``total = align(NumVgprs, 4) + NumAgprs`` (just NumVgprs when NumAgprs is 0) in
    granules of 8, and a SIMD holds at most 8 waves, so

        waves_regs = min(8, floor(512 / align(total, 8)), waves from SGPRs)

    which is LLVM's ``; Occupancy`` when nothing else limits it. A workgroup of ``num_warps`` waves
    lives on one CU (4 SIMDs) and whole workgroups must fit:

        wg_regs = floor(4 * waves_regs / num_warps)      (0: it cannot launch)
        wg_lds  = floor(lds_per_cu / lds_bytes)
        resident waves / SIMD = min(wg_regs, wg_lds) * num_warps / 4
    """
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
    """Warps per SM on sm_90 (CUDA occupancy calculator rules, compute capability 9.0).

    65536 registers per SM allocated per warp in units of 256 (``align(regs * 32, 256)``), at most
    64 warps and 32 blocks per SM, shared memory in units of 128 bytes plus 1 KiB per block:

        blocks = min(floor(floor(65536 / regs_warp) / num_warps),
                     floor(smem_per_sm / (align(shared, 128) + 1 KiB)), floor(64 / num_warps), 32)
        warps / SM = blocks * num_warps
    """
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


def counts_by_loop(text, parse_line):
    """(counts of the kinds parse_line finds in the whole text, {loop header: their counts inside
    that loop}), in one pass over the lines."""
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
    return total, per_loop


def matrix_instructions(text, parse_line):
    """Counts of matrix-instruction kinds in the hot loop and in the whole kernel."""
    total, per_loop = counts_by_loop(text, parse_line)
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


def global_loads(text, parse_line, header):
    """Loads from global memory in the hot loop `header` and in the whole kernel, with the widest
    per-lane width (bits) of each."""
    counts, per_loop = counts_by_loop(text, parse_line)
    loop = dict(sorted(per_loop[header].items())) if header else {}
    total = dict(sorted(counts.items()))

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


def cuda_tool_path(name):
    """Triton's bundled CUDA tool (ptxas, cuobjdump), else one on PATH."""
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if os.path.exists(bundled):
        return bundled
    found = shutil.which(name)
    if found:
        return found
    raise FileNotFoundError(f"no {name}: neither {bundled} nor one on PATH")


# SASS opcodes whose first address kernel_facts records: the first TMA issue, and the first float
# max (the Hopper kernel's q amax), whose order says whether the issue waits for q (NOTES h33).
SASS_FIRST_OPCODES = ("UTMALDG", "FMNMX")


def sass_first(sass, opcodes=SASS_FIRST_OPCODES):
    """{opcode: address of its first instruction in cuobjdump -sass text (predicated or not), or None}."""
    firsts = {}
    for opcode in opcodes:
        found = re.search(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?" + re.escape(opcode) + r"\b", sass)
        firsts[opcode] = int(found.group(1), 16) if found else None
    return firsts


SASS_MATRIX = re.compile(r"\b[HQI]?GMMA\b|\bHMMA\b|\bIMMA\b")
SASS_LOCAL = re.compile(r"\b(LDL|STL)\b")


def sass_hot_loop_locals(sass):
    """Local-memory instructions (LDL / STL: spill code) inside the innermost loops (a backward
    branch's range holding no other) that hold a matrix instruction, in cuobjdump -sass text:
    the tile loops. Spills outside them are paid once per pass of an outer loop, not per tile.
    None where no such loop is found (then nothing is shown)."""
    ins = [(int(a, 16), text) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for address, text in ins:
        target = re.search(r"\bBRA(?:\.\w+)*\s+(?:\w+,\s*)?`?\(?(0x[0-9a-f]+)", text)
        if target and int(target.group(1), 16) <= address:
            loops.append((int(target.group(1), 16), address))
    count = found = 0
    for first, last in loops:
        if any((first, last) != other and first <= other[0] and other[1] <= last for other in loops):
            continue  # not innermost
        body = [t for a, t in ins if first <= a <= last]
        if any(SASS_MATRIX.search(t) for t in body):
            found += 1
            count += sum(1 for t in body if SASS_LOCAL.search(t))
    return count if found else None  # None: no such loop found, nothing checked


def cubin_sass(cubin):
    """The SASS text of a cubin (cuobjdump -sass)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([cuda_tool_path("cuobjdump"), "-sass", path], capture_output=True, text=True,
                              check=True).stdout


def run_ptxas(ptx):
    """The output of ``ptxas -v`` on a PTX text (for its .target, sm_90a when it names none)."""
    arch = re.search(r"^\s*\.target\s+(sm_\w+)", ptx, re.M)
    gpu_name = arch.group(1) if arch else "sm_90a"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run([cuda_tool_path("ptxas"), "-v", "--gpu-name", gpu_name, src, "-o", os.devnull],
                              capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed ({proc.returncode}): {output[-2000:]}")
    return output


# ---------------------------------------------------------------------------------------------
# One compiled kernel


def kernel_facts(compiled, is_amd, num_warps, lds_per_block, lds_per_unit):
    """(facts, assembly text) of a kernel triton.compile returned: LDS bytes against the per-block
    limit, registers, spills, occupancy, the matrix instructions and global loads of the hot loop
    (and of the whole kernel), whether its TTIR holds tt.dot_scaled, and a hash of the assembly
    (equal code, equal hash)."""
    shared = int(getattr(compiled.metadata, "shared", 0) or 0)
    facts = {"uses_dot_scaled": "tt.dot_scaled" in compiled.asm.get("ttir", ""),
             "lds_bytes": shared, "lds_limit_bytes": lds_per_block, "lds_fits": shared <= lds_per_block}
    if is_amd:
        asm = compiled.asm["amdgcn"]
        amd = parse_amdgcn(asm)
        facts["registers"] = {"vgpr": amd["vgpr"], "agpr": amd["agpr"], "sgpr": amd["sgpr"]}
        facts["spills"] = {"vgpr_spill_count": amd["vgpr_spill_count"], "sgpr_spill_count": amd["sgpr_spill_count"],
                           "scratch_bytes": amd["scratch_bytes"]}
        occupancy = amd_occupancy(amd["vgpr"] or 0, amd["agpr"], amd["sgpr_for_waves"] or amd["sgpr"], shared,
                                  num_warps, lds_per_unit)
        occupancy["compiler"] = amd["occupancy"]
        mma_in_line, load_in_line, facts["asm_kind"] = amd_mma_in_line, amd_load_in_line, "amdgcn"
    else:
        asm = compiled.asm["ptx"]
        nv = parse_ptxas(run_ptxas(asm))
        facts["registers"] = {"per_thread": nv["registers"]}
        facts["spills"] = {"spill_store_bytes": nv["spill_store_bytes"], "spill_load_bytes": nv["spill_load_bytes"],
                           "stack_frame_bytes": nv["stack_frame_bytes"]}
        # a warp-specialised kernel launches more warps than num_warps (its partitions'): the PTX's
        # required thread count says how many
        launched = re.search(r"\.reqntid (\d+)", asm)
        warps = max(num_warps, int(launched.group(1)) // 32) if launched else num_warps
        occupancy = nvidia_occupancy(nv["registers"] or 0, shared, warps, lds_per_unit)
        occupancy["compiler"] = None
        mma_in_line, load_in_line, facts["asm_kind"] = ptx_mma_in_line, ptx_load_in_line, "ptx"
        sass = cubin_sass(compiled.asm["cubin"]) if "cubin" in compiled.asm else None
        facts["sass_first"] = sass_first(sass) if sass else None
        facts["hot_loop_locals"] = sass_hot_loop_locals(sass) if sass else None
    facts["occupancy"] = occupancy
    facts["mma"] = matrix_instructions(asm, mma_in_line)
    facts["loads"] = global_loads(asm, load_in_line, facts["mma"]["loop_header"])
    facts["asm_sha1"] = hashlib.sha1(asm.encode()).hexdigest()[:12]
    spills = list(facts["spills"].values())
    facts["spill_free"] = all(v == 0 for v in spills)
    facts["spill_parsed"] = all(v is not None for v in spills)
    return facts, asm

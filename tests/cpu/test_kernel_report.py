"""tools/kernel_report.py: every Triton kernel config compiles for gfx950 (MI355X) and sm_90 (H100/H200)
with no spills, no scratch, LDS within bounds and the matrix instructions it is meant to use.

Runs on CPU: nothing is launched, the kernels of submission.py are compiled ahead of time (one
process per target) and the compiler's report is read back, once per session (module-scoped
fixture) for gfx950 and sm90; the parsers (tools/kernel_asm.py) are tested on snippets.

The bar (a failure names the config and its numbers: choose another config in the route table):
- gfx950 and sm90: every config compiles, 0 spills, 0 scratch / stack frame, LDS / shared memory
  within the per-block limit (gfx950 160 KiB, sm90 227 KiB), matrix instructions in the hot loop;
  the fp8 route's hot loop uses fp8 MMA (gfx950: v_mfma with fp8 / f8f6f4 operands that decode to
  fp8; sm90: wgmma / mma with e4m3 or e5m2 operands).
- gfx942 (MI300X) is REPORT ONLY (the leaderboard runs on MI355X): `tools/kernel_report.py` compiles
  it, docs/kernel_report.md shows it; no test here, since a report-only check could never fail.
- mxfp4 route: a config with qk_dot_scaled "e4m3" compiles to tt.dot_scaled and has v_mfma_scale in
  its gfx950 hot loop; one with "none" uses neither.
- No unguarded inline assembly (inline_asm_elementwise outside a per-target `if`).
- sm90: the Hopper kernel's first TMA issue precedes q's amax in the SASS (NOTES h33); the paged
  Hopper kernel's tile loop issues two TMA copies a tile (latent dims, rope dims: NOTES h44e).
"""
import json
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import submission  # noqa: E402
from tools import kernel_asm as ka  # noqa: E402
from tools import kernel_report as kr  # noqa: E402

BAR_TARGETS = ("gfx950", "sm90")
REPORT_TARGETS = BAR_TARGETS  # the fixture's compiles: gfx942 is in the tool's report only


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernel_report") / "report.json"
    kr.main(["--module", "submission.py", "--targets", ",".join(REPORT_TARGETS), "--json", str(out)])
    return json.loads(out.read_text())


def label(row):
    return submission.route_label({"route": row["route"], "params": row["params"]})


def records(report, target):
    recs = [r for r in report["records"] if r["target"] == target]
    assert recs, f"no kernel config compiled for {target}: {report['errors']} {report['worker_errors']}"
    return recs


def compiled(report, target):
    return [r for r in records(report, target) if r["compiled"]]


# ---------------------------------------------------------------------------------------------
# Coverage


def table_configurations():
    """{label: targets} of every row and candidate of both route tables with a compile plan (the
    aiter table's run on the AMD targets only)."""
    out = {}
    for table in ("TRITON_ROUTE_TABLE", "AITER_ROUTE_TABLE", "SERVING_ROUTE_TABLE"):
        for row in getattr(submission, table):
            for c in [row, *(row.get("candidates") or [])]:
                if table == "SERVING_ROUTE_TABLE":  # compiled for its cache format (kernel_report.discover_rows)
                    c = {"route": c["route"], "params": dict(c["params"], kv=row["kv"])}
                if c["route"] in submission.TRITON_COMPILE_PLANS:
                    targets = kr.AITER_TARGETS if table == "AITER_ROUTE_TABLE" else set(kr.TARGETS)
                    out.setdefault(label(c), set()).update(targets)
    return out


def test_every_route_row_and_kernel_is_covered(report):
    assert not report["worker_errors"], report["worker_errors"]
    assert not report["errors"], "\n".join(report["errors"])
    expected = table_configurations()
    assert {row["label"]: set(row["targets"]) for row in report["rows"]} == expected
    assert all(row["label"] == label(row) for row in report["rows"])
    assert not report["rows_without_kernels"], (
        f"route-table rows whose compile plan is empty (nothing was compiled): {report['rows_without_kernels']}")
    assert not report["uncovered_kernels"], (
        f"@triton.jit kernels of {report['module']} that no route-table row or candidate selects, so they were "
        f"never compiled: {report['uncovered_kernels']}")
    for target in REPORT_TARGETS:
        labels = {row["label"] for r in records(report, target) for row in r["rows"]}
        missing = []
        for row in report["rows"]:
            plan = submission.triton_compile_plan(row["route"], row["params"], kr.TARGETS[target].fp8_dtype)
            planned_here = any(target in (entry.get("targets") or kr.TARGETS) for entry in plan)
            if target in row["targets"] and planned_here and row["label"] not in labels:
                missing.append(row["label"])
        assert not missing, f"{target}: rows with no compiled kernel: {missing}"
    compiled_somewhere = {row["label"] for r in report["records"] for row in r["rows"]}
    assert set(expected) <= compiled_somewhere, f"rows compiled for no target: {set(expected) - compiled_somewhere}"


# ---------------------------------------------------------------------------------------------
# The bar: gfx950 (MI355X) and sm90 (H100/H200)


@pytest.mark.parametrize("target", BAR_TARGETS)
def test_every_config_compiles(report, target):
    failed = [kr.describe_record(r) for r in records(report, target) if not r["compiled"]]
    assert not failed, f"{target}: configs that do not compile:\n" + "\n".join(failed)


# local loads and stores the seesaw kernel's pair loops may hold (lab/NOTES.md h51; h54: 11, 16 with the causal mask;
# the bf16 cache's, on 32-token tiles: 39, 49 in h65; with the merge out of the kernel, h72: 7 / 8 and 18 / 21)
SEESAW_TILE_LOOP_SPILLS = 8
SEESAW_BF16_TILE_LOOP_SPILLS = 21
# the tokens-as-M span kernels' tile loops: the bf16 16-row one with a causal mask reloads one word a tile
# (lab/NOTES.md h76: one LDL in about 1,200 instructions), the others none
SPAN_TILE_LOOP_SPILLS = 1
# the warp-specialised sparse kernel's tile loops: its worker partitions reload the shared-memory base, which the
# partitions' dispatch keeps in local memory (lab/NOTES.md h113: 2 loads a tile in warpgroup 1's loop, the loop
# counted here, with and without topk_length; 4 in the producer's)
SPARSE_TILE_LOOP_SPILLS = 2


def spans_spill_outside_tile_loops(record):
    """The serving API's Hopper kernel with its span schedule (a loop over a span's segments,
    submission.py lab/NOTES.md h42): ptxas spills there, outside the tile loops (LLVM hoists the
    segment body's addresses out of the segment loop); allowed where the tile loops (the innermost
    loops holding the MMAs, read in the SASS) hold no spill code. The seesaw kernel (a warpgroup's
    240-256 registers, its segment loop's scalars live across the pair loops) reloads a few of them
    there: at most SEESAW_TILE_LOOP_SPILLS local loads and stores in its two warpgroups' pair loops
    of about 1,800 instructions each (lab/NOTES.md h51, h52); the tokens-as-M kernels SPAN_TILE_LOOP_SPILLS."""
    bf16 = (record.get("constexprs") or {}).get("KV_FP8") is False
    allowed = tile_loop_spills(record.get("kernel"), bf16)
    return (record["target"] == "sm90" and (record.get("constexprs") or {}).get("SPANS") is True
            and record.get("hot_loop_locals") is not None and record["hot_loop_locals"] <= allowed)


def sparse_spills_within_allowance(record):
    """The warp-specialised sparse kernel: its tile loops reload the shared-memory base
    (SPARSE_TILE_LOOP_SPILLS), nothing else."""
    return (record["target"] == "sm90" and record.get("kernel") == "_mla_sparse_hopper_kernel"
            and record.get("hot_loop_locals") is not None
            and record["hot_loop_locals"] <= SPARSE_TILE_LOOP_SPILLS)


def tile_loop_spills(kernel, bf16):
    """The local loads and stores a span kernel's tile loops may hold (also test_hopper_route's): the
    seesaw kernel's pair-loop allowance for a bf16 or an fp8 cache, the tokens-as-M kernels' one."""
    if kernel == "_mla_decode_seesaw_kernel":
        return SEESAW_BF16_TILE_LOOP_SPILLS if bf16 else SEESAW_TILE_LOOP_SPILLS
    return SPAN_TILE_LOOP_SPILLS


@pytest.mark.parametrize("target", BAR_TARGETS)
def test_no_spills_no_scratch(report, target):
    bad = [kr.describe_record(r) for r in compiled(report, target)
           if not (r["spill_parsed"] and (r["spill_free"] or spans_spill_outside_tile_loops(r)
                                          or sparse_spills_within_allowance(r)))]
    assert not bad, (f"{target}: configs that spill or use scratch (choose another num_warps / BLOCK_N / "
                     "num_stages in the route table):\n" + "\n".join(bad))


@pytest.mark.parametrize("target", BAR_TARGETS)
def test_lds_within_limit(report, target):
    limit = kr.TARGETS[target].lds_per_block
    bad = [kr.describe_record(r) for r in compiled(report, target) if r["lds_bytes"] > limit]
    assert not bad, f"{target}: LDS / shared memory above {limit // 1024} KiB per block:\n" + "\n".join(bad)


# kernels with no matrix work by design: the serving API's merges of split requests (lab/NOTES.md h72) and of
# the sparse kernel's cut units (h113)
MERGE_KERNELS = {"_mla_combine_kernel", "_mla_sparse_combine_kernel"}


@pytest.mark.parametrize("target", BAR_TARGETS)
def test_matrix_instructions_in_every_hot_loop(report, target):
    bad = [kr.describe_record(r) for r in compiled(report, target)
           if r["mma"]["loop_count"] == 0 and r.get("kernel") not in MERGE_KERNELS]
    assert not bad, (f"{target}: no matrix instruction in the hot loop (scalar FMA fallback?):\n"
                     + "\n".join(bad))


@pytest.mark.parametrize("target", BAR_TARGETS)
def test_fp8_route_uses_fp8_mma(report, target):
    fp8 = [r for r in compiled(report, target) if r["kv_format"] == "fp8"]
    assert fp8, f"{target}: no fp8 route compiled"
    bad = [kr.describe_record(r) for r in fp8 if not any(ka.is_fp8_mma(kind) for kind in r["mma"]["loop"])]
    assert not bad, (f"{target}: fp8 route whose hot loop has no fp8 matrix instruction (it fell back to "
                     "f16/bf16 MMA or scalar FMA):\n" + "\n".join(bad))


def test_hopper_kernel_compiles_for_sm90_only_with_both_products_in_fp8(report):
    hopper = [r for r in report["records"] if r["kernel"] == "_mla_decode_fp8_hopper_kernel"]
    assert {r["target"] for r in hopper} == {"sm90"}
    for r in hopper:
        assert r["compiled"] and r["mma"]["loop"], kr.describe_record(r)
        assert all(ka.is_fp8_mma(kind) for kind in r["mma"]["loop"]), kr.describe_record(r)
        # the cooperative merge's residency rule holds for the compiled kernel: shared memory
        # within the route's bound, and as many resident programs per SM as the rule assumes
        stages, warps = r["all_constexprs"]["STAGES"], r["all_constexprs"]["WARPS"]
        assert r["lds_bytes"] <= submission.hopper_shared_bytes_bound(stages), kr.describe_record(r)
        resident = r["occupancy"]["resident"] // r["num_warps"]
        assert resident >= submission.hopper_programs_per_sm(warps, stages), kr.describe_record(r)


def test_hopper_first_tile_loads_are_issued_before_q_is_quantised(report):
    """ptxas keeps the prologue's order (NOTES h33): in every Hopper config the first TMA issue
    (UTMALDG) precedes q's amax (FMNMX), so the issue waits for the indptrs only. Scheduled the
    other way round the issue also waits for q: +0.3-0.5 us on the small leaderboard shapes."""
    hopper = [r for r in compiled(report, "sm90") if r["kernel"] == "_mla_decode_fp8_hopper_kernel"]
    assert hopper
    for r in hopper:
        first = r["sass_first"]
        assert first["UTMALDG"] is not None and first["FMNMX"] is not None, kr.describe_record(r)
        assert first["UTMALDG"] < first["FMNMX"], (f"{kr.describe_record(r)}: first UTMALDG at "
                                                   f"{first['UTMALDG']:#x}, after q's first FMNMX at "
                                                   f"{first['FMNMX']:#x}")


def test_the_paged_hopper_kernel_loads_a_tile_in_two_tma_copies(report):
    """The serving API's Hopper kernel issues one 3D copy for a tile's 512 latent dims and one for
    its rope dims (each copy into the ring costs a CTA barrier: lab/NOTES.md h44e); custom_kernel's
    keeps a copy per 128-dim chunk, 5 a tile."""
    for kernel, copies in (("_mla_decode_paged_hopper_kernel", 2), ("_mla_decode_fp8_hopper_kernel", 5)):
        records = [r for r in compiled(report, "sm90") if r["kernel"] == kernel]
        assert records, kernel
        for r in records:
            assert r["loads"]["loop"].get("cp.async.bulk.tensor") == copies, kr.describe_record(r)


def test_the_gathered_hopper_kernel_copies_16_bytes_a_thread_and_no_tma(report):
    """Pages shorter than a tile: every cache byte the gathered kernel reads comes by cp.async of 16
    bytes (a narrower copy would multiply its instructions), none by TMA (lab/NOTES.md h48)."""
    records = [r for r in compiled(report, "sm90") if r["kernel"] == "_mla_decode_gathered_hopper_kernel"]
    assert records
    for r in records:
        assert r["loads"]["loop"].get("cp.async 16B", 0) > 0, kr.describe_record(r)
        assert not [k for k in r["loads"]["total"] if k.startswith("cp.async") and k != "cp.async 16B"], \
            kr.describe_record(r)


def test_mxfp4_route_uses_scaled_mfma_on_gfx950_where_it_asks_for_it(report):
    """qk_dot_scaled "e4m3": tl.dot_scaled in the code and v_mfma_scale in the hot loop; "none": neither."""
    mx = [r for r in compiled(report, "gfx950") if r["kv_format"] == "mxfp4"]
    modes = {r["params"].get("qk_dot_scaled", "none") for r in mx}
    assert modes == {"none", "e4m3"}, f"the tables race both mxfp4 modes on gfx950: {modes}"
    for r in mx:
        scaled = r["params"].get("qk_dot_scaled", "none") == "e4m3"
        assert r["uses_dot_scaled"] == scaled, kr.describe_record(r)
        assert any(ka.is_scaled_mma(k) for k in r["mma"]["loop"]) == scaled, kr.describe_record(r)


def test_amd_occupancy_formula_matches_llvm(report):
    """The tool's waves/SIMD from VGPR+AGPR+SGPR equals LLVM's '; Occupancy' comment."""
    for r in compiled(report, "gfx950"):
        occ = r["occupancy"]
        assert occ["waves_from_registers"] == occ["compiler"], kr.describe_record(r)


def test_no_unguarded_inline_asm(report):
    bad = [f for f in report["inline_asm"] if not f["guarded"]]
    assert not bad, ("inline_asm_elementwise outside a per-target `if` (it ties the kernel to one ISA):\n"
                     + "\n".join(f"{f['function']} line {f['line']} (kernel {f['kernel']})" for f in bad))


@pytest.mark.parametrize("target", BAR_TARGETS)
def test_kv_loads_in_the_hot_loop_are_128_bits_wide(report, target):
    """Each lane reads the KV tile 16 bytes at a time (dwordx4 / v4.b32 / 16-byte cp.async or TMA)."""
    bad = [kr.describe_record(r) for r in compiled(report, target)
           if r["kv_format"] in ("fp8", "mxfp4") and (r["loads"]["loop_widest_bits"] or 0) < 128
           and not any(k.startswith("cp.async.bulk") for k in r["loads"]["loop"])]
    assert not bad, f"{target}: hot loop without a 128-bit load:\n" + "\n".join(bad)


def test_gfx950_compiles_as_the_hip_jit_does_with_buffer_loads(report):
    """At the leaderboard's sizes every tensor is within 2 GiB: the HIP JIT marks it, and the KV
    tile is read with buffer loads; a report without the mark would show other registers. The
    dense kernels read 16 bytes a lane (dwordx4). The sparse form's kernel gathers a latent chunk
    of 128 bytes for each of block_n entries over num_warps x 64 lanes: its loads are as wide as
    that share (4 bytes a lane at 16 entries and 8 warps)."""
    widths = {4: "buffer_load_dword", 8: "buffer_load_dwordx2", 16: "buffer_load_dwordx4"}
    for r in compiled(report, "gfx950"):
        if r["route"] == "triton_sparse":
            widest = widths[r["params"]["block_n"] * 128 // (r["params"]["num_warps"] * 64)]
        else:
            widest = widths[16]
        assert any(k.startswith(widest) for k in r["loads"]["loop"]), kr.describe_record(r)


def test_the_products_configurations_compile_with_no_further_options(report):
    for r in report["records"]:
        assert set(r["options"]) == {"num_warps", "num_stages"}, kr.describe_record(r)


# ---------------------------------------------------------------------------------------------
# Output formats


def test_markdown_and_text_tables(report):
    md = kr.format_markdown(report, ["gfx950"])
    assert report["triton_version"] in md and report["date"] in md
    body = [line for line in md.splitlines() if line.startswith("| ") and "gfx950" in line]
    assert len(body) == len(records(report, "gfx950"))
    header = next(line for line in md.splitlines() if line.startswith("| kernel"))
    for column in ("registers", "LDS / smem", "occupancy", "MMA in hot loop", "global loads in hot loop"):
        assert column in header
    for line in body:  # VGPR and AGPR, waves per SIMD, load widths in every row
        assert " a" in line and "waves/SIMD" in line and "bit)" in line, line
    text = kr.format_text(report)
    for target in REPORT_TARGETS:
        assert f"[{target}]" in text


# ---------------------------------------------------------------------------------------------
# Parsers and formulas (no compilation)


def test_amd_mma_kinds():
    assert ka.amd_mma_in_line("\tv_mfma_f32_16x16x128_f8f6f4 v[0:3], v[4:11], v[12:19], 0") == \
        "v_mfma_f32_16x16x128_f8f6f4 fp8.fp8"
    assert ka.amd_mma_in_line("\tv_mfma_scale_f32_16x16x128_f8f6f4 v[0:3], v[4:7], v[8:11], 0, v1, v2 "
                              "op_sel_hi:[0,0,0] cbsz:4 blgp:4") == "v_mfma_scale_f32_16x16x128_f8f6f4 fp4.fp4"
    assert ka.amd_mma_in_line("\tv_mfma_f32_16x16x32_fp8_fp8 v[0:3], v[4:5], v[6:7], v[0:3]") == \
        "v_mfma_f32_16x16x32_fp8_fp8 fp8.fp8"
    assert ka.amd_mma_in_line("\tv_mfma_f32_32x32x16_bf8_fp8 a[0:15], v[4:5], v[6:7], 0") == \
        "v_mfma_f32_32x32x16_bf8_fp8 bf8.fp8"
    assert ka.amd_mma_in_line("\tv_mfma_f32_16x16x32_f16 v[0:3], v[4:7], v[8:11], v[0:3]") == \
        "v_mfma_f32_16x16x32_f16 f16.f16"
    assert ka.amd_mma_in_line("\tv_mfma_f32_32x32x8f16 a[0:15], v[0:1], v[2:3], a[0:15]") == \
        "v_mfma_f32_32x32x8f16 f16.f16"
    assert ka.amd_mma_in_line("\tv_mfma_f32_32x32x4bf16_1k a[0:15], v[0:1], v[2:3], 0") == \
        "v_mfma_f32_32x32x4bf16_1k bf16.bf16"
    assert ka.amd_mma_in_line("\tv_fma_f32 v0, v1, v2, v3") is None
    assert ka.amd_mma_in_line("; v_mfma_f32_16x16x32_f16 in a comment") is None
    assert ka.is_fp8_mma("v_mfma_f32_16x16x128_f8f6f4 fp8.fp8")
    assert not ka.is_fp8_mma("v_mfma_f32_16x16x32_f16 f16.f16")
    assert not ka.is_fp8_mma("v_mfma_scale_f32_16x16x128_f8f6f4 fp4.fp4")
    assert ka.is_scaled_mma("v_mfma_scale_f32_16x16x128_f8f6f4 fp4.fp4")


def test_load_kinds_and_widths():
    assert ka.amd_load_in_line("\tbuffer_load_dwordx4 v[0:3], v4, s[8:11], 0 offen") == "buffer_load_dwordx4"
    assert ka.amd_load_in_line("\tglobal_load_dwordx2 v[0:1], v[2:3], off") == "global_load_dwordx2"
    assert ka.amd_load_in_line("\tglobal_load_ubyte v0, v[2:3], off") == "global_load_ubyte"
    assert ka.amd_load_in_line("\tglobal_load_lds_dwordx4 v[2:3], off") == "global_load_lds_dwordx4"
    assert ka.amd_load_in_line("\tglobal_store_dwordx4 v[0:1], v[2:5], off") is None
    assert ka.amd_load_in_line("\tds_read_b128 v[0:3], v4") is None
    assert ka.amd_load_in_line("; global_load_dword in a comment") is None
    assert ka.ptx_load_in_line("\tld.global.nc.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];") == "ld.global.v4.b32"
    assert ka.ptx_load_in_line("\t@%p1 ld.global.b16 { %rs1 }, [ %rd2 + 0 ];") == "ld.global.b16"
    assert ka.ptx_load_in_line("\tcp.async.cg.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 0x10, %r2;") == "cp.async 16B"
    assert ka.ptx_load_in_line("\t@%p3 cp.async.ca.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 0x4, %r2;") == "cp.async 4B"
    assert ka.ptx_load_in_line("\tcp.async.cg.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 16, %r2;") == "cp.async 16B"
    assert ka.ptx_load_in_line("\tcp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
                               "[%r1], [%rd1, {%r2, %r3}], [%r4];") == "cp.async.bulk.tensor"
    assert ka.ptx_load_in_line("\tst.global.v4.b32 [ %rd1 + 0 ], { %r1, %r2, %r3, %r4 };") is None
    widths = {"buffer_load_dwordx4": 128, "global_load_dwordx2": 64, "buffer_load_dword": 32,
              "buffer_load_ushort": 16, "global_load_ubyte": 8, "global_load_lds_dwordx4": 128,
              "ld.global.v4.b32": 128, "ld.global.v2.b32": 64, "ld.global.b16": 16, "cp.async 16B": 128,
              "cp.async.bulk.tensor": None}
    for name, bits in widths.items():
        assert ka.load_bits(name) == bits, name
    asm = textwrap.dedent("""\
        \tglobal_load_dwordx4 v[0:3], v[4:5], off
        .LBB0_2:                                ; =>This Inner Loop Header: Depth=1
        \tbuffer_load_dwordx4 v[0:3], v4, s[8:11], 0 offen
        \tbuffer_load_ubyte v5, v4, s[8:11], 0 offen
        \tv_mfma_f32_16x16x32_f16 v[0:3], v[4:7], v[8:11], v[0:3]
        \ts_cbranch_scc1 .LBB0_2
        ; %bb.3:
        \tglobal_load_dword v1, v[4:5], off
        """)
    header = ka.matrix_instructions(asm, ka.amd_mma_in_line)["loop_header"]
    loads = ka.global_loads(asm, ka.amd_load_in_line, header)
    assert loads["loop"] == {"buffer_load_dwordx4": 1, "buffer_load_ubyte": 1}
    assert loads["loop_widest_bits"] == 128 and loads["total_widest_bits"] == 128
    assert loads["total"]["global_load_dword"] == 1


def test_plan_entries_get_the_hip_2gib_mark_on_amd_targets_only():
    (entry,) = submission.triton_compile_plan("triton_fp8", {"num_splits": 2})
    entry["kernel"] = kr.load_module(REPO_ROOT / "submission.py")._mla_decode_kernel  # a compilable kernel
    kv = (entry["kernel"].arg_names.index("KV"),)
    _, _, _, amd_attrs, _ = kr.complete_plan_entry(entry, kr.TARGETS["gfx950"])
    _, _, _, nv_attrs, _ = kr.complete_plan_entry(entry, kr.TARGETS["sm90"])
    assert amd_attrs[kv] == [["tt.divisibility", 16], ["tt.pointer_range", 32]]
    assert nv_attrs[kv] == [["tt.divisibility", 16]]
    stride = (entry["kernel"].arg_names.index("stride_kv_token"),)
    assert amd_attrs[stride] == [["tt.divisibility", 16]]  # integers are not pointers


def test_plan_entry_options_join_the_compile_options_and_the_columns():
    (entry,) = submission.triton_compile_plan("triton_fp8", {"num_splits": 2, "num_warps": 4, "num_stages": 2})
    entry["kernel"] = kr.load_module(REPO_ROOT / "submission.py")._mla_decode_kernel
    *_, options = kr.complete_plan_entry(entry, kr.TARGETS["gfx950"])
    assert options == {"num_warps": 4, "num_stages": 2}
    entry["options"] = {"waves_per_eu": 2, "matrix_instr_nonkdim": 16}  # as lab/gfx950_sweep.py adds them
    *_, options = kr.complete_plan_entry(entry, kr.TARGETS["gfx950"])
    assert options == {"num_warps": 4, "num_stages": 2, "waves_per_eu": 2, "matrix_instr_nonkdim": 16}
    shown = kr._compiled_as({"constexprs": {"BLOCK_N": 64}, "num_warps": 4, "num_stages": 2, "options": options})
    assert shown == "BLOCK_N=64 w4 s2 waves_per_eu=2 matrix_instr_nonkdim=16"


def test_ptx_mma_kinds():
    assert ka.ptx_mma_in_line("\twgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%f1}, %rd1, %rd2, "
                              "p, 1, 1;") == "wgmma m64n8k32 e4m3.e4m3"
    assert ka.ptx_mma_in_line("\twgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%f1}, %rd1, %rd2;") == \
        "wgmma m64n16k16 f16.f16"
    assert ka.ptx_mma_in_line("\tmma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%f1}, {%r1}, {%r2}, "
                              "{%f2};") == "mma m16n8k32 e4m3.e4m3"
    assert ka.ptx_mma_in_line("\t@%p1 mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1};") == \
        "mma m16n8k16 bf16.bf16"
    assert ka.ptx_mma_in_line("\twgmma.fence.sync.aligned;") is None
    assert ka.ptx_mma_in_line("\tfma.rn.f32 %f1, %f2, %f3, %f4;") is None
    assert ka.is_fp8_mma("wgmma m64n8k32 e4m3.e4m3") and not ka.is_fp8_mma("mma m16n8k16 f16.f16")


def test_hot_loop_is_the_loop_with_most_matrix_instructions():
    asm = textwrap.dedent("""\
        \tv_mfma_f32_16x16x32_f16 v[0:3], v[4:7], v[8:11], 0
        .LBB0_2:                                ; =>This Inner Loop Header: Depth=1
        \tv_mfma_f32_16x16x32_fp8_fp8 v[0:3], v[4:5], v[6:7], v[0:3]
        ; %bb.3:                                ;   in Loop: Header=BB0_2 Depth=1
        \tv_mfma_f32_16x16x32_fp8_fp8 v[0:3], v[4:5], v[6:7], v[0:3]
        .LBB0_4:                                ; %bb.name
                                                ;   in Loop: Header=BB0_2 Depth=1
        \tv_mfma_f32_16x16x32_f16 v[0:3], v[4:7], v[8:11], v[0:3]
        \ts_cbranch_scc1 .LBB0_2
        ; %bb.5:
        \tv_mfma_f32_16x16x32_f16 v[0:3], v[4:7], v[8:11], v[0:3]
        .LBB0_6:                                ; =>This Inner Loop Header: Depth=1
        \tv_mfma_f32_16x16x32_f16 v[0:3], v[4:7], v[8:11], v[0:3]
        \ts_cbranch_scc1 .LBB0_6
        \ts_endpgm
        """)
    m = ka.matrix_instructions(asm, ka.amd_mma_in_line)
    assert m["loop_header"] == "BB0_2"
    assert m["loop"] == {"v_mfma_f32_16x16x32_f16 f16.f16": 1, "v_mfma_f32_16x16x32_fp8_fp8 fp8.fp8": 2}
    assert m["total_count"] == 6 and m["loops_with_mma"] == 2
    ptx = textwrap.dedent("""\
        $L__BB0_2:                              // %loop
                                                // =>This Inner Loop Header: Depth=1
        \twgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%f1}, %rd1, %rd2, p, 1, 1;
        \t@%p36 bra \t$L__BB0_2;
        $L__BB0_3:                              // %._crit_edge
        \twgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%f1}, %rd1, %rd2;
        """)
    m = ka.matrix_instructions(ptx, ka.ptx_mma_in_line)
    assert m["loop"] == {"wgmma m64n8k32 e4m3.e4m3": 1} and m["total_count"] == 2


def test_parse_amdgcn_and_ptxas():
    asm = textwrap.dedent("""\
        ; Kernel info:
        ; TotalNumSgprs: 50
        ; NumVgprs: 256
        ; NumAgprs: 12
        ; TotalNumVgprs: 268
        ; ScratchSize: 92
        ; NumSGPRsForWavesPerEU: 50
        ; Occupancy: 1
        amdhsa.kernels:
          - .agpr_count:     12
            .sgpr_spill_count: 0
            .vgpr_spill_count: 23
        """)
    facts = ka.parse_amdgcn(asm)
    assert (facts["vgpr"], facts["agpr"], facts["sgpr"], facts["scratch_bytes"], facts["occupancy"]) == \
        (256, 12, 50, 92, 1)
    assert (facts["vgpr_spill_count"], facts["sgpr_spill_count"]) == (23, 0)
    out = ("ptxas info    : Function properties for k\n"
           "    584 bytes stack frame, 612 bytes spill stores, 608 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers, 584 bytes cumulative stack size\n")
    assert ka.parse_ptxas(out) == {"registers": 255, "stack_frame_bytes": 584, "spill_store_bytes": 612,
                                   "spill_load_bytes": 608}


def test_sass_first_reads_predicated_and_plain_instructions():
    sass = textwrap.dedent("""\
            /*0430*/                   FMNMX R20, |R48|, |R33|, !PT ;          /* 0x4000002130147209 */
            /*0890*/              @UP4 UTMALDG.2D [UR40], [UR8] ;              /* 0x00000028080045b4 */
            /*08c0*/             @!UP2 UTMALDG.2D [UR12], [UR18] ;             /* 0x0000000c120025b4 */
            /*1210*/               @P1 FMNMX R61, |R45|, |R36|, !PT ;          /* 0x4000002d3d3d1209 */
        """)
    assert ka.sass_first(sass) == {"UTMALDG": 0x890, "FMNMX": 0x430}
    assert ka.sass_first(sass, ("UTMALDG", "HMMA")) == {"UTMALDG": 0x890, "HMMA": None}
    assert ka.sass_first(sass.replace("FMNMX R20", "FMNMXX R20"))["FMNMX"] == 0x1210  # whole opcodes only


def test_occupancy_formulas():
    # gfx950 values seen with LLVM's own '; Occupancy' (Triton 3.6): (vgpr, agpr, warps) -> waves/SIMD.
    for vgpr, agpr, warps, llvm in [(208, 0, 8, 2), (238, 32, 4, 1), (204, 32, 4, 2), (250, 96, 2, 1),
                                    (256, 0, 8, 2), (64, 0, 4, 8)]:
        occ = ka.amd_occupancy(vgpr, agpr, 40, 0, warps, 160 * 1024)
        assert occ["waves_from_registers"] == llvm, (vgpr, agpr, warps)
    occ = ka.amd_occupancy(208, 0, 38, 75776, 8, 160 * 1024)
    assert (occ["workgroups_from_registers"], occ["workgroups_from_lds"], occ["resident"]) == (1, 2, 2.0)
    assert ka.amd_occupancy(300, 0, 40, 0, 8, 160 * 1024)["resident"] == 0  # 8 warps need <= 256 regs
    assert ka.amd_occupancy(208, 0, 38, 75776, 8, 64 * 1024)["limiter"] == "LDS"
    nv = ka.nvidia_occupancy(208, 89088, 8)
    assert (nv["regs_per_warp"], nv["blocks_from_registers"], nv["blocks_from_shared"], nv["resident"]) == \
        (6656, 1, 2, 8)
    assert ka.nvidia_occupancy(255, 0, 4)["resident"] == 8  # 8192 regs / warp -> 8 warps
    assert ka.nvidia_occupancy(32, 0, 4)["resident"] == 64  # capped by 64 warps / SM
    assert ka.nvidia_occupancy(32, 100 * 1024, 4)["limiter"] == "shared memory"


def test_inline_asm_scan_and_module_loading(tmp_path):
    src = textwrap.dedent('''\
        import triton
        import triton.language as tl
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl


        @triton.jit
        def _helper(x):
            return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                             is_pure=True, pack=1)


        @triton.jit
        def unguarded(X):
            x = tl.load(X)
            tl.store(X, _helper(x))


        @triton.jit
        def guarded(X, IS_CUDA: tl.constexpr):
            x = tl.load(X)
            if IS_CUDA:
                x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                              is_pure=True, pack=1)
            tl.store(X, x)


        @gluon.jit
        def one_target(X):
            x = gl.load(X + gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0])))
            x = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=True, pack=1)
        ''')
    path = tmp_path / "asm_kernels.py"
    path.write_text(src)
    module = kr.load_module(path)  # with the interpreter off: real JITFunctions
    assert hasattr(module.guarded, "params")
    found = {(f["kernel"], f["function"]): f
             for f in kr.scan_inline_asm([module.unguarded, module.guarded, module.one_target])}
    assert found[("one_target", "one_target")]["guarded"]  # a Gluon kernel is written for one target
    assert not found[("unguarded", "_helper")]["guarded"]
    assert found[("guarded", "guarded")]["guarded"] and found[("guarded", "guarded")]["guard"] == "IS_CUDA"
    assert kr.jit_functions_reached(module.unguarded) == {"_helper"}


def test_targets_and_tables_resolution(tmp_path):
    assert kr.resolve_targets("gfx950,sm_90,GFX950") == ["gfx950", "sm90"]
    with pytest.raises(ValueError):
        kr.resolve_targets("gfx1100")
    no_tables = tmp_path / "kernels_only.py"
    no_tables.write_text("def triton_compile_plan(route, params, fp8_dtype):\n    return []\n")
    assert kr.tables_path_for(no_tables) == (REPO_ROOT / "submission.py").resolve()
    with_tables = tmp_path / "with_tables.py"
    with_tables.write_text("AITER_ROUTE_TABLE = [{'route': 'triton_fp8', 'params': {}}]\n")
    assert kr.tables_path_for(with_tables) == with_tables.resolve()
    assert kr.tables_path_for(no_tables, with_tables) == with_tables.resolve()


def test_rows_are_every_row_and_candidate_with_a_compile_plan():
    class Tables:
        TRITON_ROUTE_TABLE = [{"route": "triton_fp8", "params": {"num_splits": 2},
                               "candidates": [{"route": "hopper_fp8", "params": {"num_splits": 4}}]}]
        AITER_ROUTE_TABLE = [{"route": "aiter_fp8", "params": {},
                              "candidates": [{"route": "triton_fp8", "params": {"num_splits": 2}},
                                             {"route": "triton_mxfp4", "params": {"block_n": 32}}]}]

    rows = kr.discover_rows(Tables, {"triton_fp8", "triton_mxfp4", "hopper_fp8"})
    assert [(r["label"], r["targets"], r["sources"]) for r in rows] == [
        (label(Tables.TRITON_ROUTE_TABLE[0]), ["gfx942", "gfx950", "sm90"],
         ["TRITON_ROUTE_TABLE[0]", "AITER_ROUTE_TABLE[0].candidates[0]"]),
        (label(Tables.TRITON_ROUTE_TABLE[0]["candidates"][0]), ["gfx942", "gfx950", "sm90"],
         ["TRITON_ROUTE_TABLE[0].candidates[0]"]),
        (label(Tables.AITER_ROUTE_TABLE[0]["candidates"][1]), ["gfx942", "gfx950"],  # the aiter table: AMD only
         ["AITER_ROUTE_TABLE[0].candidates[1]"])]

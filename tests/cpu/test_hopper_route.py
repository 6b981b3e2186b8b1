"""The Hopper route (submission.py, HOPPER ROUTE section) on any machine: present exactly on sm_90
with Gluon, its table rows taken there and skipped elsewhere in favour of the portable row that
follows each, its inputs refused before any GPU work, and its launch key must tell TMA descriptors
apart. Its kernel is compiled for sm_90 by tests/cpu/test_kernel_report.py and checked numerically on
an sm_90 GPU by tests/gpu/ (Gluon kernels have no CPU interpreter)."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import reference
import submission
from test_kernel_report import tile_loop_spills

LEADERBOARD = [(4, 1024), (4, 8192), (32, 1024), (32, 8192), (64, 1024), (64, 8192), (256, 1024),
               (256, 8192)]


def test_present_exactly_on_sm90_with_gluon():
    on_sm90 = (torch.cuda.is_available() and torch.version.hip is None
               and torch.cuda.get_device_capability()[0] == 9)
    assert submission.HOPPER == (on_sm90 and submission.HAVE_GLUON)
    assert ("hopper_fp8" in submission.ROUTES) == submission.HOPPER
    assert submission.ROUTE_INFO["hopper_fp8"]["portable"] is False


def test_every_hopper_row_is_followed_by_a_portable_row_for_the_same_shapes():
    table = submission.TRITON_ROUTE_TABLE
    for i, row in enumerate(table):
        if row["route"] == "hopper_fp8":
            after = table[i + 1]
            assert (after["max_batch"], after["max_kv_len"]) == (row["max_batch"], row["max_kv_len"])
            assert submission.ROUTE_INFO[after["route"]].get("portable", True), after
    assert submission.ROUTE_INFO[table[-1]["route"]].get("portable", True)


@pytest.mark.parametrize("batch,kv_len", LEADERBOARD)
def test_off_hopper_each_shape_takes_its_portable_row(monkeypatch, batch, kv_len):
    monkeypatch.delitem(submission.ROUTES, "hopper_fp8", raising=False)  # as on any machine but sm_90
    row = submission.select_route(batch, kv_len, True, submission.TRITON_ROUTE_TABLE)
    assert row["route"] == "triton_fp8"
    assert (row["max_batch"], row["max_kv_len"]) == (batch, kv_len)


def test_this_machine_takes_the_hopper_rows_exactly_when_it_has_the_route():
    """Nothing patched: on sm_90 (HOPPER) the Hopper rows, elsewhere the portable rows."""
    hopper_shapes = {(r["max_batch"], r["max_kv_len"]) for r in submission.TRITON_ROUTE_TABLE
                     if r["route"] == "hopper_fp8"}
    for shape in LEADERBOARD:
        route = submission.select_route(*shape, True, submission.TRITON_ROUTE_TABLE)["route"]
        assert route == ("hopper_fp8" if submission.HOPPER and shape in hopper_shapes else "triton_fp8"), shape


def test_on_hopper_the_hopper_rows_are_taken(monkeypatch):
    monkeypatch.setitem(submission.ROUTES, "hopper_fp8", submission.hopper_fp8_route)
    chosen = {shape: submission.select_route(*shape, True, submission.TRITON_ROUTE_TABLE)["route"]
              for shape in LEADERBOARD}
    expected = {(r["max_batch"], r["max_kv_len"]): r["route"] for r in reversed(submission.TRITON_ROUTE_TABLE)}
    assert chosen == {shape: expected[shape] for shape in LEADERBOARD}
    assert "hopper_fp8" in chosen.values()
    # off the leaderboard the portable catch-all still answers
    assert submission.select_route(3, 100000, False, submission.TRITON_ROUTE_TABLE)["route"] == "triton_fp8"


def test_refuses_an_fp8_format_the_kernel_cannot_read():
    data = reference.generate_input(1, 1, 64, 1, device="cpu")
    q, kv_data, qo_indptr, kv_indptr, config = data
    kv, scale = kv_data["fp8"]
    bad = dict(kv_data, fp8=(kv.view(torch.uint8).view(torch.float8_e4m3fnuz), scale))
    with pytest.raises(ValueError, match='kv_data\\["fp8"\\]'):
        submission.hopper_fp8_route(q, bad, qo_indptr, kv_indptr, config)


def test_refuses_q_it_cannot_read_densely():
    """The kernel reads q[batch] as 16 x 576 dense bf16 values: another row count or layout is refused."""
    q, kv_data, qo_indptr, kv_indptr, config = reference.generate_input(3, 1, 64, 1, device="cpu")
    with pytest.raises(ValueError, match=r"got shape \(2, 16, 576\)"):
        submission.hopper_fp8_route(q[:2], kv_data, qo_indptr, kv_indptr, config)
    transposed = q.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match="strides"):
        submission.hopper_fp8_route(transposed, kv_data, qo_indptr, kv_indptr, config)


class _Descriptor:
    """Has what Triton specialises a TMA descriptor on (like gluon's TensorDescriptor)."""

    def __init__(self, base, block_shape, layout="L"):
        self.base, self.block_shape, self.layout = base, block_shape, layout
        self.shape, self.strides = list(base.shape), list(base.stride())


def test_launch_key_tells_descriptors_apart():
    rows = torch.zeros(128, 576, dtype=torch.uint8)
    key = submission._specialisation
    assert key(_Descriptor(rows, [64, 128])) == key(_Descriptor(rows.clone(), [64, 128]))
    assert key(_Descriptor(rows, [64, 128])) != key(_Descriptor(rows, [64, 64]))
    assert key(_Descriptor(rows, [64, 128])) != key(_Descriptor(rows[:100], [64, 128]))  # row count % 16
    assert key(_Descriptor(rows, [64, 128])) != key(_Descriptor(rows, [64, 128], "other layout"))
    assert key(rows) == (torch.uint8, rows.data_ptr() % 16 == 0)


@pytest.mark.skipif(not submission.HAVE_GLUON, reason="this Triton has no Gluon: no Hopper plan")
def test_compile_plans_are_for_sm90_only_and_cover_both_merges():
    plans = submission.triton_compile_plan("hopper_fp8", {"num_splits": 4})
    assert [p["constexprs"]["COOPERATIVE_MERGE"] for p in plans] == [False, True]
    for plan in plans:
        assert plan["targets"] == ["sm90"] and plan["kernel"] is submission._mla_decode_fp8_hopper_kernel
        assert plan["constexprs"]["NUM_SPLITS"] == 4 and plan["num_warps"] == 4
    for params in ({"num_splits": 3}, {"num_splits": 1}, {"num_splits": 128}):
        [plan] = submission.triton_compile_plan("hopper_fp8", params)
        assert plan["constexprs"]["COOPERATIVE_MERGE"] is False


def test_cooperative_merge_only_when_every_program_fits_at_once(monkeypatch):
    monkeypatch.setitem(submission._SM_COUNTS, "gpu", 132)
    fits = submission.cooperative_merge_fits
    # 4 warps, 2 ring slots: two programs per SM (registers <= 256 per thread, shared <= 114 KiB)
    assert submission.hopper_programs_per_sm(4, 2) == 2
    assert fits(4, 32, "gpu") and fits(32, 4, "gpu") and fits(66, 2, "gpu")
    assert fits(64, 4, "gpu") and fits(32, 8, "gpu") and fits(8, 32, "gpu")  # 256 programs <= 264
    # one program more and some program could wait for a spinning one
    assert fits(33, 8, "gpu") and not fits(34, 8, "gpu") and not fits(256, 2, "gpu")
    # one program per SM: 8 warps (registers) or 3 ring slots (shared memory)
    assert submission.hopper_programs_per_sm(8, 2) == 1 and submission.hopper_programs_per_sm(4, 3) == 1
    assert fits(32, 4, "gpu", 4, 3) and not fits(64, 4, "gpu", 4, 3) and not fits(64, 4, "gpu", 8, 2)
    assert not fits(4, 1, "gpu") and not fits(4, 3, "gpu") and not fits(1, 128, "gpu") and fits(4, 64, "gpu")


def _capture_launches(monkeypatch):
    """Every Hopper launch as (grid, tensors, scalars, constexprs), on a CPU posing as 132 SMs; the
    TMA descriptors replaced by their format's name."""
    launched = []
    monkeypatch.setitem(submission._SM_COUNTS, torch.device("cpu"), 132)
    monkeypatch.setattr(submission, "launch", lambda kernel, grid, tensors, scalars, constexprs, *a, **k:
                        launched.append((grid, tensors, scalars, constexprs)))
    monkeypatch.setattr(submission, "kv_descriptors", lambda kv, kv_format="fp8", tokens=64: (kv_format, kv_format))
    return launched


@pytest.mark.skipif(not submission.HAVE_GLUON, reason="this Triton has no Gluon: no Hopper kernel")
def test_cooperative_merge_grid_rule_is_the_routes(monkeypatch):
    """The route passes its own warps and ring slots to the rule: a 256-program grid merges
    cooperatively at 4 warps x 2 slots and not at 3 slots."""
    launched = _capture_launches(monkeypatch)
    data = reference.generate_input(64, 1, 64, 3, device="cpu")
    for stages in (2, 3):
        submission.hopper_fp8_route(*data, num_splits=4, num_stages=stages)
    assert [(grid, constexprs["COOPERATIVE_MERGE"]) for grid, _, _, constexprs in launched] == [
        ((64, 4), True), ((64, 4), False)]


def test_a_cache_tma_cannot_read_goes_to_the_portable_kernel(monkeypatch):
    q, kv_data, qo_indptr, kv_indptr, config = reference.generate_input(2, 1, 70, 3, device="cpu")
    kv, scale = kv_data["fp8"]
    assert submission.tma_can_read(kv)
    row = kv.shape[-1]  # bytes: rows 16 B longer, starting 8 B in (misaligned)
    wide = torch.zeros(kv.shape[0], 1, row + 16, dtype=torch.uint8).view(kv.dtype)[:, :, 8:8 + row]
    wide.copy_(kv)
    assert not submission.tma_can_read(wide)
    with pytest.raises(ValueError, match="the cache starts at address"):  # the portable kernel refuses it (h55)
        submission.hopper_fp8_route(q, dict(kv_data, fp8=(wide, scale)), qo_indptr, kv_indptr, config, num_splits=4)
    calls = []
    monkeypatch.setattr(submission, "triton_fp8_route", lambda *a, **k: calls.append(k) or "portable")
    out = submission.hopper_fp8_route(q, dict(kv_data, fp8=(wide, scale)), qo_indptr, kv_indptr, config, num_splits=4)
    assert out == "portable" and calls == [{"num_splits": 4}]


# The wgmma A-operand register fragment that P.V's V^T must arrive in: Triton 3.6's
# DotOperandLayout(0, NVMMADistributedLayout([3, 0], [warps, 1], [16, 32, 32]), k_width=4) on
# (128 rows x 64 k), as (row, k) bases: the PTX fragment of wgmma .m64nNk32 .e4m3 (4 consecutive k
# of a row per 32-bit register; lanes: k bits 2-3, then row bits 0-2; warps: 16-row groups).
# k_width 2 (PV_F16: wgmma .m64nNk16 .f16, [16, 32, 16]): 2 consecutive k per register, lanes k
# bits 1-2. Both read off Gluon's to_linear_layout for these layouts.
A_FRAGMENT = {
    (4, 4): {"reg": [[0, 1], [0, 2], [8, 0], [0, 16], [0, 32], [64, 0]],
             "lane": [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]], "warp": [[16, 0], [32, 0]]},
    (8, 4): {"reg": [[0, 1], [0, 2], [8, 0], [0, 16], [0, 32]],
             "lane": [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]], "warp": [[16, 0], [32, 0], [64, 0]]},
    (4, 2): {"reg": [[0, 1], [8, 0], [0, 8], [0, 16], [0, 32], [64, 0]],
             "lane": [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], "warp": [[16, 0], [32, 0]]},
    (8, 2): {"reg": [[0, 1], [8, 0], [0, 8], [0, 16], [0, 32]],
             "lane": [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], "warp": [[16, 0], [32, 0], [64, 0]]},
}


def _v_relabelled(warps, k_width=4):
    """(128 rows x 64 k) of flat (token * 128 + dim) labels after _pv_chunk's reshape/permute."""
    labels = np.arange(64 * 128).reshape(64, 128)
    return labels.reshape([2] * 13).transpose(submission._v_operand_order(warps, k_width)).reshape(128, 64)


@pytest.mark.skipif(not submission.HAVE_GLUON, reason="no Gluon in this Triton")
@pytest.mark.parametrize("warps,k_width", sorted(A_FRAGMENT))
def test_v_chunk_load_relabelled_is_the_wgmma_a_fragment(warps, k_width):
    """Each basis of the V-chunk load layout, (token, dim), lands after the relabelling at the
    (row, k) of the same basis of the A fragment: lanes and warps in order, registers as a set
    (their order is free). A wrong bit table would make the compiler shuffle V through shared
    memory, or, with a consistent P order, still be right but slow: this pins the fast layout."""
    relabelled = _v_relabelled(warps, k_width)

    def where(basis):  # (token, dim) basis -> its (row, k) after the relabel
        row, k = np.argwhere(relabelled == basis[0] * 128 + basis[1])[0]
        return [int(row), int(k)]

    load = submission._v_operand_load_layout(warps, k_width)
    fragment = A_FRAGMENT[warps, k_width]
    assert [where(b) for b in load.lane_bases] == fragment["lane"]
    assert [where(b) for b in load.warp_bases] == fragment["warp"]
    assert sorted(where(b) for b in load.reg_bases) == sorted(fragment["reg"])
    # the first register bases are consecutive dims: the load is one 32-bit (16-bit) word per token
    assert load.reg_bases[:2 if warps == 4 else 1] == [[0, 1], [0, 2]][:2 if warps == 4 else 1]


@pytest.mark.skipif(not submission.HAVE_GLUON, reason="no Gluon in this Triton")
@pytest.mark.parametrize("warps", (4, 8))
def test_v_words_are_the_f16_load_layout_without_the_dims_inside_a_word(warps):
    """_v_f16 reads V as words of the dims a thread holds (2 at 8 warps, 4 at 4) in _v_word_layout,
    which must be the k_width 2 load layout with those dims folded into the word: the same lanes
    and warps, the same registers but those dims, and token bit 0 the first register basis (the
    split of each token pair stays in the thread). Then joining the converted halves back gives
    the load layout, and the conversion to the MMA's fragment moves no data (lab/NOTES.md h49a)."""
    full = submission._v_operand_load_layout(warps, 2)
    words = submission._v_word_layout(warps)
    inner = [[0, 1]] if warps == 8 else [[0, 1], [0, 2]]  # (token, dim) bases inside a word
    shift = len(inner)
    assert all(b in full.reg_bases for b in inner)
    assert words.reg_bases[0] == [1, 0]
    unfold = lambda bases: [[t, d << shift] for t, d in bases]  # noqa: E731
    assert unfold(words.lane_bases) == full.lane_bases and unfold(words.warp_bases) == full.warp_bases
    assert sorted(unfold(words.reg_bases)) == sorted(b for b in full.reg_bases if b not in inner)
    assert list(words.shape) == [64, 128 >> shift]


@pytest.mark.skipif(not submission.HAVE_GLUON, reason="no Gluon in this Triton")
@pytest.mark.parametrize("warps", (4, 8))
def test_p_order_and_output_rows_match_the_v_relabelling(warps):
    """P^T's k order is V's token order (the product sums matching tokens), and _rows_to_dims
    puts output row r back at latent dim d(r); the output layout stores 4 (2) consecutive dims."""
    relabelled = _v_relabelled(warps)
    token_of_k = relabelled[0, :] // 128  # row 0 is dim-bit pattern 0 for every k
    dim_of_row = relabelled[:, 0] % 128
    tokens = np.arange(64).reshape([2] * 6 + [1]).transpose(submission._pv_token_order()).reshape(64)
    assert (tokens == token_of_k).all()
    rows = np.arange(128).reshape([2] * 7 + [1]).transpose(submission._rows_to_dims_order(warps)).reshape(128)
    assert (dim_of_row[rows] == np.arange(128)).all()
    out = submission._output_layout(warps)
    assert out.reg_bases[:2 if warps == 4 else 1] == ([[1, 0], [2, 0]] if warps == 4 else [[1, 0]])


@pytest.mark.skipif(not submission.HAVE_GLUON, reason="no Gluon in this Triton")
@pytest.mark.parametrize("warps", (4, 8))
@pytest.mark.parametrize("rows", (16, 32))
def test_f16_product_keeps_token_order_and_stores_from_the_accumulator(warps, rows):
    """PV_F16: P^T is stored in its tokens' own order, so V's relabelled k must be the token itself;
    the output layout (pairs False) holds the accumulator's elements (wgmma .m64nNk16's C fragment,
    N = rows, after _rows_to_dims) thread by thread, so its conversion moves no data (the kernel
    asserts it), 4 (2) consecutive dims first."""
    relabelled = _v_relabelled(warps, 2)
    assert (relabelled[0, :] // 128 == np.arange(64)).all()
    dim_of_row = [int(d) for d in relabelled[:, 0] % 128]  # row -> latent dim

    def dims(bases):  # accumulator (row, head) bases -> (dim, head)
        return [[dim_of_row[r], h] for r, h in bases]
    heads = [[0, 1 << bit] for bit in range(3, rows.bit_length() - 1)]
    acc = {"reg": [[0, 1], [8, 0]] + heads[:1] + ([[64, 0]] if warps == 4 else []) + heads[1:],
           "lane": [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
           "warp": [[16, 0], [32, 0]] + ([[64, 0]] if warps == 8 else [])}
    out = submission._output_layout(warps, rows, pairs=False)
    assert out.lane_bases == dims(acc["lane"]) and out.warp_bases == dims(acc["warp"])
    assert sorted(out.reg_bases) == sorted(dims(acc["reg"]))
    assert out.reg_bases[:2 if warps == 4 else 1] == ([[1, 0], [2, 0]] if warps == 4 else [[1, 0]])


@pytest.mark.skipif(not submission.HAVE_GLUON, reason="no Gluon in this Triton")
@pytest.mark.parametrize("num_splits", (2, 3, 4, 8, 16, 32, 64))
def test_merge_layout_keeps_splits_in_thread_64_floats_none_twice(num_splits):
    """_merge_slice loads (splits x 512/next_pow2(splits) dims x 16 heads) at once: every split of an
    element in one thread (sums over splits without shared memory), 64 floats per thread at 4 warps,
    and the 128 threads tile the slice exactly (no element loaded twice)."""
    splits = 1 << math.ceil(math.log2(num_splits))
    dims = 512 // splits
    layout = submission._merge_layout(splits, dims, 16, 4)
    assert layout.size_per_thread[0] == splits and layout.threads_per_warp[0] == 1
    assert layout.warps_per_cta[0] == 1
    dims_per_pass = layout.size_per_thread[1] * layout.threads_per_warp[1] * layout.warps_per_cta[1]
    heads_per_pass = layout.threads_per_warp[2] * layout.warps_per_cta[2]
    assert dims % dims_per_pass == 0 and 16 % heads_per_pass == 0, (num_splits, layout)  # no replication
    per_thread = splits * layout.size_per_thread[1] * (dims // dims_per_pass) * (16 // heads_per_pass)
    assert per_thread == 64, (num_splits, layout, per_thread)
    assert math.prod(layout.warps_per_cta) == 4 and math.prod(layout.threads_per_warp) == 32


def _xor_span(bases, index):
    """The (token, dim) that a linear layout gives index (bit i of index selects bases[i])."""
    token = dim = 0
    for bit, (t, d) in enumerate(bases):
        if index >> bit & 1:
            token, dim = token ^ t, dim ^ d
    return token, dim


@pytest.mark.skipif(not submission.HAVE_GLUON, reason="no Gluon in this Triton")
@pytest.mark.parametrize("k_width", (4, 2))
def test_v_chunk_loads_are_free_of_bank_conflicts(k_width):
    """At 4 warps every 32-bit load of a warp reads 32 different banks of the TMA tile (64 tokens x
    128 bytes, 128-byte swizzle: 16-byte chunk c of row t sits at chunk c ^ (t % 8))."""
    load = submission._v_operand_load_layout(4, k_width)
    vector_bits = 2  # the first two register bases are the 4 bytes of one 32-bit word
    for reg in range(1 << (len(load.reg_bases) - vector_bits)):
        base = _xor_span(load.reg_bases[vector_bits:], reg)
        banks = set()
        for lane in range(32):
            token, dim = _xor_span(load.lane_bases, lane)
            token, dim = token ^ base[0], dim ^ base[1]
            byte = token * 128 + ((dim // 16) ^ (token % 8)) * 16 + dim % 16
            banks.add(byte // 4 % 32)
        assert len(banks) == 32, (reg, sorted(banks))


def test_the_route_launches_one_kernel_with_the_fp8_descriptors(monkeypatch):
    """hopper_fp8 passes the fp8 cache's TMA descriptors and its per-tensor scale, one launch of
    (batch, splits) programs."""
    launched = _capture_launches(monkeypatch)
    data = reference.generate_input(4, 1, 300, 3, device="cpu")
    kv_data = data[1]
    submission.hopper_fp8_route(*data, num_splits=2)
    [(grid, tensors, _, constexprs)] = launched
    assert grid == (4, 2) and constexprs["NUM_SPLITS"] == 2
    assert tensors[1:3] == ("fp8", "fp8") and tensors[3] is kv_data["fp8"][1]


@pytest.mark.skipif(not submission.HAVE_GLUON, reason="this Triton has no Gluon: no TMA descriptors")
@pytest.mark.parametrize("kv_dtype,box", [(torch.float8_e4m3fn, 128), (torch.bfloat16, 64)])
def test_descriptors_box_the_cache_rows_in_64_tokens(kv_dtype, box):
    """Over the cache's own memory, rope boxes of 64 tokens x 64 dims and latent boxes of 64 tokens
    x 128 dims (custom_kernel's, a copy per chunk), or for the paged kernel one 3D box of 512 / box
    boxes x 64 tokens x 128 bytes of dims (128 fp8 or 64 bf16 dims; box b of row r at element
    r x row stride + b x box), 128-byte swizzled (lab/NOTES.md h44e)."""
    kv = torch.randn(300, 1, 576).to(kv_dtype)
    submission._KV_DESCRIPTORS.clear()
    latent, rope = submission.kv_descriptors(kv)
    assert latent.base.dtype == kv_dtype and latent.base.data_ptr() == kv.data_ptr()
    assert list(latent.shape) == [300, 576] and list(latent.strides) == [576, 1]
    assert list(latent.block_shape) == [64, 128] and list(rope.block_shape) == [64, 64]
    boxed, rope_again = submission.kv_descriptors(kv, latent_3d=True)
    assert boxed.base.data_ptr() == kv.data_ptr() and list(rope_again.block_shape) == [64, 64]
    assert list(boxed.shape) == [512 // box, 300, box] and list(boxed.strides) == [box, 576, 1]
    assert list(boxed.block_shape) == [512 // box, 64, box]
    assert boxed.layout.swizzle_byte_width == 128 and boxed.layout.rank == 3
    assert list(rope.shape) == [300, 576] and list(rope.strides) == [576, 1]
    submission._KV_DESCRIPTORS.clear()


_SM90_COMPILE = """
import json
from tools import kernel_report as kr
import submission
out, combines = [], []
for row in submission.SERVING_ROUTE_TABLE:
    if row["route"] != "hopper_paged":
        continue
    for plan in submission.hopper_paged_compile_plan(dict(row["params"], kv=row["kv"]), "fp8e4nv",
                                                     page_sizes=(16, 64)):
        facts, _ = kr.compile_and_analyse(*kr.complete_plan_entry(plan, kr.TARGETS["sm90"]), kr.TARGETS["sm90"])
        c = plan["constexprs"]
        if plan["kernel"] is submission._mla_combine_kernel:
            combines.append([row["kv"], c["NUM_HEADS"], facts["spill_parsed"], facts["spill_free"]])
            continue
        out.append([row["kv"], c["NUM_HEADS"], c["WARPS"], c["STAGES"], c["PAGE_SIZE"], c["CAUSAL"],
                    facts["spill_parsed"], facts["spill_free"], facts["lds_fits"], facts["spills"],
                    facts["registers"], facts["lds_bytes"], c["SPANS"], facts["hot_loop_locals"]])
print(json.dumps([out, combines]))
"""


@pytest.mark.skipif(not submission.HAVE_GLUON, reason="needs Triton's Gluon (3.6)")
def test_paged_kernel_compiles_for_sm90_without_spills():
    """The serving API's Hopper kernel, as every hopper_paged row of SERVING_ROUTE_TABLE configures
    it (its cache format, rows, warps and ring slots), for pages of 16 (the gathered kernel) and 64
    (TMA) and causal masks on and off, and the combine kernel after it, compile for sm_90 here, no
    GPU needed, with no spills and
    within shared memory, under
    the route's own bound on it (lab/NOTES.md h38); with the span schedule (a loop over a span's
    segments), spills only outside the tile loops, none in them (read in the SASS; lab/NOTES.md h42).
    In a process of its own: under the interpreter triton.language's own jit helpers are
    interpreted functions, which a compile cannot take."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", _SM90_COMPILE], cwd=root, capture_output=True, text=True,
                          timeout=900, env=dict(os.environ, TRITON_INTERPRET="0"))
    assert done.returncode == 0, done.stderr[-3000:]
    results, combines = json.loads(done.stdout.strip().splitlines()[-1])
    rows = [row for row in submission.SERVING_ROUTE_TABLE if row["route"] == "hopper_paged"]
    assert {row["kv"] for row in rows} == {"fp8", "bf16"}
    # each row's combine kernel (the merge of split requests after it, lab/NOTES.md h72): no spills
    assert combines == [[row["kv"], submission.route_rows(row), True, True] for row in rows]
    assert [(r[0], r[1], r[4], r[5]) for r in results] == [
        (row["kv"], submission.route_rows(row), page, causal)
        for row in rows for page in ((64,) if row["params"].get("seesaw") else (16, 64)) for causal in (False, True)]
    for (kv, rows_, warps, stages, page, causal, parsed, spill_free, lds_fits, spills, registers, lds, spans,
         tile_loop_locals) in results:
        config = (kv, rows_, warps, stages, page, causal, registers, spills, spans, tile_loop_locals)
        # the seesaw kernel (4 warps at 64 rows) reloads a few of its segment loop's scalars in its
        # pair loops, a span kernel one word a tile at most: test_kernel_report's allowance (lab/NOTES.md h51, h76)
        kernel = "_mla_decode_seesaw_kernel" if (rows_, warps) == (64, 4) else "tokens as M"
        allowance = tile_loop_spills(kernel, kv == "bf16") if spans else 0
        assert parsed and lds_fits and tile_loop_locals <= allowance, config
        assert spill_free or spans, config
        assert lds <= submission.hopper_shared_bytes_bound(stages, 2 if kv == "bf16" else 1, rows_), (config, lds)


def _spans(params, batch, num_splits):
    """Whether serving_route launches a hopper_paged row of these params with the span schedule."""
    row = {"kv": "fp8", "route": "hopper_paged", "params": {"num_warps": 4, "num_stages": 2, "waves": 1, **params}}
    shape = submission.PlanShape(batch, 1, 16, 64, "fp8", False)
    return submission.serving_route(shape, None, 1 << 20, num_splits=num_splits, table=[row], here=False).spans


def test_span_kernel_only_where_chunks_can_outgrow_one_wave():
    """A row's "spans" launch the kernel that may take spans only where batch x SERVING_MAX_SPLITS
    chunks exceed the plan's programs; rows without it never do."""
    most = submission.SERVING_MAX_SPLITS
    assert not _spans({"spans": True}, 264 // most, 264)
    assert _spans({"spans": True}, 264 // most + 1, 264)
    assert not _spans({"spans": True}, 2, 33)
    assert _spans({"spans": True}, 3, 33)
    assert not _spans({}, 1024, 264)
    assert not _spans({"spans": False}, 1024, 264)


def _serving_route(shape, monkeypatch):
    """The serving_route a plan of this shape takes on an H100/H200."""
    monkeypatch.setattr(submission, "SERVING_ROUTES", {"triton_paged", "hopper_paged"})
    return submission.serving_route(submission.PlanShape(*shape), None, 1 << 20)


@pytest.mark.parametrize("kv", ("fp8", "bf16"))
@pytest.mark.parametrize("s_q,h_q,wide", [(1, 16, False), (1, 8, False), (2, 8, False), (2, 16, True),
                                          (1, 32, True), (1, 128, True), (2, 128, True), (3, 16, True)])
def test_serving_rows_per_program_follow_min_rows(monkeypatch, kv, s_q, h_q, wide):
    """A bf16 plan with fewer than 32 query rows (s_q x h_q) takes the 16-row Hopper row; 32 or
    more the row of 32 rows per program at 8 warps (one pass over the cache serves twice the rows),
    and from 64 on pages of whole tiles the seesaw kernel on 32-token tiles (lab/NOTES.md h65).
    fp8 plans take 16 rows below 32, 32 rows at 8 warps from 32 (B at two query tokens: lab/NOTES.md
    h49c) and from 64 on 64 rows: on pages of whole tiles (64, 128) the seesaw kernel (query rows
    as M, two compute warpgroups and a loader warp at 4 warps a warpgroup, P.V in fp8: lab/NOTES.md
    h51), on shorter pages the tokens-as-M kernel at 8 warps (gathered); that kernel's fp8 P.V is
    f16 on the serving API."""
    rows = 64 if s_q * h_q >= 64 else 32 if wide else 16
    seesaw = rows == 64
    route = _serving_route((128, s_q, h_q, 64, kv, s_q > 1), monkeypatch)
    row = route.row
    assert row["route"] == "hopper_paged" and row["kv"] == kv
    assert submission.route_rows(row) == rows and s_q * h_q >= row.get("min_rows", 0)
    assert row["params"]["num_warps"] == (4 if rows == 16 or seesaw else 8)
    assert row["params"].get("pv_f16", False) == (kv == "fp8" and not seesaw)
    assert row["params"].get("seesaw", False) == seesaw
    assert _serving_route((128, s_q, h_q, 128, kv, s_q > 1), monkeypatch).row is row
    assert route.kernel is (submission._mla_decode_seesaw_kernel if seesaw
                            else submission._mla_decode_paged_hopper_kernel)
    # pages smaller than a tile: the gathered kernel (lab/NOTES.md h48), the seesaw row's rows at 8 warps
    for page in (1, 16, 32):
        short = _serving_route((128, s_q, h_q, page, kv, s_q > 1), monkeypatch)
        # (the fp8 seesaw's rows at 8 warps; the bf16 one's at the 32-row row)
        assert short.row is row or (seesaw and submission.route_rows(short.row) == (64 if kv == "fp8" else 32)
                                    and short.row["params"].get("pv_f16", False) == (kv == "fp8"))
        assert short.kernel is submission._mla_decode_gathered_hopper_kernel


def test_route_rows_default_to_16():
    assert submission.route_rows({"route": "hopper_paged", "params": {"num_warps": 4}}) == 16
    assert submission.route_rows({"route": "hopper_paged", "params": {"rows": 32}}) == 32
    assert submission.route_rows({"route": "triton_paged", "params": {"rows": 32}}) == submission.SERVING_ROWS


def test_residency_and_shared_bound_take_the_rows():
    """q (rows x 576) and P^T (64 tokens x 2 bytes per row) grow with the rows; 8 warps hold one
    program per SM whatever the rows (registers)."""
    bound = submission.hopper_shared_bytes_bound
    assert bound(2) == bound(2, 1, 16) and bound(3, 1, 32) - bound(3, 1, 16) == 16 * 576 + 2 * 16 * 64
    assert bound(2, 2, 32) - bound(2, 2, 16) == 2 * 16 * 576 + 2 * 16 * 64
    assert submission.hopper_programs_per_sm(8, 3, 1, 32) == 1 and submission.hopper_programs_per_sm(8, 2, 2, 32) == 1
    assert bound(3, 1, 32) < submission.SM90_SHARED_PER_SM and bound(2, 2, 32) < submission.SM90_SHARED_PER_SM
    assert submission.hopper_programs_per_sm(8, 2, 1, 64) == 1 and bound(2, 1, 64) < submission.SM90_SHARED_PER_SM


@pytest.mark.parametrize("kv,s_q,h_q,rows,warps", [("fp8", 1, 16, 16, 4), ("fp8", 2, 128, 64, 4),
                                                   ("fp8", 2, 24, 32, 8), ("fp8", 3, 8, 16, 4),
                                                   ("bf16", 1, 128, 64, 4), ("bf16", 1, 32, 32, 8),
                                                   ("bf16", 2, 8, 16, 4)])
def test_hopper_plan_and_launch_take_the_rows_row_count(monkeypatch, kv, s_q, h_q, rows, warps):
    """A plan cuts s_q x h_q into cdiv(s_q x h_q, rows) groups, aims for one chunk per program
    slot (132 SMs x programs per SM), and sizes the partials (slots, 512, rows) and their lse
    (slots, rows) by the route row's rows; the launch passes NUM_HEADS = rows, WARPS and the grid
    (groups, chunks + batch), and the combine kernel after it the same rows and workspace. No
    kernel runs (a stand-in for launch() records them)."""
    batch, page = 3, 64
    launched = _capture_launches(monkeypatch)
    monkeypatch.setattr(submission, "SERVING_ROUTES", {"triton_paged", "hopper_paged"})
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(batch, s_q, h_q, 576, generator=gen) / 4).to(torch.bfloat16)
    cache = torch.randn(8, page, 1, 576, generator=gen).to(torch.bfloat16)
    if kv == "fp8":
        cache = cache.to(torch.float8_e4m3fn)
    table = torch.arange(6, dtype=torch.int32).reshape(batch, 2)
    lens = torch.tensor([100, 7, 128], dtype=torch.int32)
    plan = submission.get_mla_decode_metadata()[0]
    submission.mla_decode_with_kvcache(q, cache, table, lens, 512, plan, causal=s_q > 1,
                                       k_scale=0.5 if kv == "fp8" else None)
    assert plan.route["route"] == "hopper_paged" and submission.route_rows(plan.route) == rows
    groups = math.ceil(s_q * h_q / rows)
    params = plan.route["params"]
    program_warps = warps * (3 if params.get("seesaw") else 1)  # the seesaw: two compute warpgroups and the loader's
    resident = 132 * submission.hopper_programs_per_sm(program_warps, params["num_stages"], 2 if kv == "bf16" else 1,
                                                       rows)
    assert resident == 132 or not params.get("seesaw")  # one seesaw program per SM (384 threads, 196 KiB)
    assert plan.num_splits == max(1, params["waves"] * resident // groups)
    slots = groups * (plan.num_splits + batch)
    partial_o, partial_lse, counts = plan.workspace
    assert partial_o.shape == (slots, 512, rows) and partial_lse.shape == (slots, rows)
    assert counts.shape == (2 * batch,)  # each request's first slot and split count (lab/NOTES.md h72)
    [(grid, _, _, constexprs), (combine_grid, combine_tensors, combine_scalars, combine_constexprs)] = launched
    assert grid == (groups, plan.num_splits + batch)
    # the combine after it: a program per request, row group and 32 dims, over the same workspace
    assert combine_grid == (batch, groups, 512 // 32) and combine_tensors[:3] == plan.workspace
    assert combine_scalars[1] == plan.num_splits + batch and combine_constexprs["NUM_HEADS"] == rows
    assert combine_constexprs["MAX_SPLITS"] == constexprs["MAX_SPLITS"]
    assert (constexprs["NUM_HEADS"], constexprs["WARPS"], constexprs["KV_FP8"]) == (rows, warps, kv == "fp8")
    assert constexprs["PV_F16"] == (kv == "fp8" and not params.get("seesaw"))
    assert bool(params.get("seesaw")) == (rows == 64)  # page 64: the seesaw kernel (h51; bf16: h65)
    assert constexprs.get("BLOCK_N", 64) == (32 if params.get("seesaw") and kv == "bf16" else 64)

"""The sparse decode (submission.py's sparse form of mla_decode_with_kvcache): the portable Triton
kernel over FlashMLA's 656-byte fp8 cache against float64 sparse attention
(reference.mla_decode_sparse_float64) over the dequantised cache and over the bf16 values, both with
the q the kernel multiplies (submission.sparse_q_format's bf16 or fp8; bf16 without one): heads,
query tokens, pages of 1 and 64 (and an odd size), -1 entries, topk_length with garbage past it,
NaN in every token no query selects, empty queries, poisoned entries and lengths, split merges,
plan reuse, FlashMLA's padded blocks and uint8 bytes, and the argument errors.

Outputs and workspaces are allocated NaN-filled here (``nan_outputs``), so that an element the
kernel does not write fails the check. Runs under the interpreter on the CPU at small sizes, and
as is on a GPU."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import eval as harness
import reference as R
import submission as S
import submission
from test_kernel_report import SPARSE_TILE_LOOP_SPILLS

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.fixture(autouse=True)
def nan_outputs(monkeypatch):
    """torch.empty in the section gives NaN-filled float tensors: out, lse and the split partials
    the kernel must write before anything reads them."""
    empty = torch.empty

    def poisoned(*shape, dtype=None, device=None, **kwargs):
        x = empty(*shape, dtype=dtype, device=device, **kwargs)
        return x.fill_(float("nan")) if x.is_floating_point() else x
    monkeypatch.setattr(S.torch, "empty", poisoned)


def make(batch=2, s_q=2, heads=16, page=64, kvseqlen=100, topk=64, seed=1, **kw):
    return R.generate_sparse_input(batch, s_q, heads, page, kvseqlen, topk, seed, device=DEVICE, **kw)


def plan_of(num_splits=None):
    plan, _ = submission.get_mla_decode_metadata()
    plan.num_splits = num_splits
    return plan


def run(inputs, plan=None, **overrides):
    args = dict(q=inputs.q, k_cache=inputs.k_cache, indices=inputs.indices, topk_length=inputs.topk_length,
                softmax_scale=inputs.softmax_scale)
    args.update(overrides)
    return S.mla_decode_with_kvcache(args["q"], args["k_cache"], None, None, 512, plan or plan_of(),
                                     is_fp8_kvcache=True, indices=args["indices"], topk_length=args["topk_length"],
                                     softmax_scale=args["softmax_scale"])


def expected_of(inputs):
    """The float64 references of ``inputs`` with the q the kernel multiplies (eval.sparse_q_format)."""
    return R.sparse_expected(inputs, harness.sparse_q_format(S, inputs))


def assert_right(inputs, out, lse, expected=None):
    """The strict sparse check: out within 1.25 x the format's own error of the bf16 values'
    reference and within the serving API's bf16 bounds of the dequantised cache's (both with the
    kernel's q: ``expected_of``); empty rows 0 and +inf, poisoned rows NaN. Returns the verdict."""
    expected = expected or expected_of(inputs)
    verdict = R.judge_sparse(expected, out, lse)
    assert verdict["ok"], R.sparse_message(verdict)
    return verdict


# (h_q, s_q, page, topk, kvseqlen, varlen, topk_length, zeros, splits): the CPU's covering subset
GRID = [
    (16, 2, 64, 64, 100, True, False, 0, None),
    (16, 1, 1, 32, 40, False, True, 1, None),
    (64, 2, 64, 32, 50, True, True, 0, None),
    (64, 1, 1, 64, 120, True, False, 1, 2),
    (16, 2, 1, 64, 200, False, True, 0, 3),
    (64, 2, 64, 64, 300, True, True, 1, 2),
]


@pytest.mark.parametrize("heads,s_q,page,topk,kvseqlen,varlen,topk_length,zeros,splits", GRID)
def test_the_grid(heads, s_q, page, topk, kvseqlen, varlen, topk_length, zeros, splits):
    inputs = make(2 + zeros, s_q, heads, page, kvseqlen, topk, seed=heads + topk + page, varlen=varlen,
                  topk_length=topk_length, zeros=zeros)
    plan = plan_of(splits)
    out, lse = run(inputs, plan)
    assert out.shape == (2 + zeros, s_q, heads, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (2 + zeros, heads, s_q) and lse.dtype == torch.float32
    verdict = assert_right(inputs, out, lse)
    assert verdict["out_rel_l2"] <= 1.25 * verdict["format_out"]
    if splits:
        assert plan.num_splits == splits


def test_the_hopper_row_plans_the_warp_specialised_kernel(monkeypatch):
    """sm_90's sparse row, where it is the route, plans _mla_sparse_hopper_kernel at 64 heads a program
    (Gluon: the interpreter cannot run it, tests/gpu/test_sparse_gpu.py does) on sparse_programs'
    count: here (4 SMs stand in on the CPU) a program per unit, 8 units filling two waves; num_splits
    asks for that many programs a unit; without the row the portable kernel serves."""
    monkeypatch.setattr(S, "SERVING_ROUTES", S.SERVING_ROUTES | {"hopper_sparse"})
    shape = S.PlanShape(2, 2, 128, 64, "fp8_sparse", False, 2048)
    route = S.serving_route(shape, None, 0)
    assert route.row["route"] == "hopper_sparse" and route.kernel is S._mla_sparse_hopper_kernel
    assert S.route_rows(route.row) == 64
    assert route.num_splits == 2 * 2 * 2  # batch x s_q x head groups
    assert S.serving_route(shape, None, 0, num_splits=3).num_splits == 8 * 3
    portable = S.serving_route(shape, None, 0, table=[row for row in S.SERVING_ROUTE_TABLE
                                                      if row["route"] != "hopper_sparse"])
    assert portable.kernel is S._mla_sparse_kernel and portable.row["route"] == "triton_sparse"


def run_of(tile, total, programs):
    """_sparse_run_of in Python: the program whose run holds `tile`."""
    base, longer = divmod(total, programs)
    return tile // (base + 1) if tile < longer * (base + 1) else longer + (tile - longer * (base + 1)) // base


@pytest.mark.parametrize("units,tiles,sms,splits", [(4, 32, 132, None), (8, 32, 132, None), (148, 32, 132, None),
                                                    (296, 32, 132, None), (4, 512, 132, None), (10, 2, 132, None),
                                                    (3, 1, 8, None), (1, 32, 132, None), (7, 3, 5, None),
                                                    (16, 32, 132, 4), (5, 2, 132, 3)])
def test_the_hopper_sparse_schedule(units, tiles, sms, splits):
    """The schedule's arithmetic, as the kernel and its merge compute it: every tile in exactly one
    program's run (runs differ by one tile at most), no unit in more than SPARSE_MAX_PIECES runs
    (sparse_pieces counts them exactly), and a cut unit's partial slots (program + unit)
    consecutive from its first run's, below the workspace's programs + units, shared with no other
    unit. Cut: at most one program per SM, runs of SPARSE_MIN_RUN_TILES tiles at least."""
    programs = S.sparse_programs(units, tiles, sms, 64, splits)
    total = units * tiles
    base, longer = divmod(total, programs)
    starts = [p * base + min(p, longer) for p in range(programs + 1)]
    assert starts[-1] == total and {b - a for a, b in zip(starts, starts[1:], strict=False)} <= {base, base + 1}
    if splits:
        assert programs == min(units * splits, total)
    elif programs != units:
        assert programs <= sms and (base >= S.SPARSE_MIN_RUN_TILES or programs == 1)
    owner = [p for p in range(programs) for _ in range(starts[p], starts[p + 1])]
    assert owner == [run_of(x, total, programs) for x in range(total)]
    pieces = [len({owner[x] for x in range(u * tiles, (u + 1) * tiles)}) for u in range(units)]
    assert max(pieces) == S.sparse_pieces(units, tiles, programs) <= S.SPARSE_MAX_PIECES
    slots = {}
    for u in range(units):
        if pieces[u] > 1:
            first = run_of(u * tiles, total, programs)
            mine = sorted(p + u for p in {owner[x] for x in range(u * tiles, (u + 1) * tiles)})
            assert mine == list(range(first + u, first + u + pieces[u]))
            assert not set(mine) & set(slots) and max(mine) < programs + units
            slots.update(dict.fromkeys(mine, u))


def test_the_hopper_sparse_schedule_chooses_whole_units_or_a_cut():
    """FlashMLA's benchmark (s_q 2, topk 2048: 32 tiles of 64 a unit, 132 SMs): a program per unit
    where the units fill their waves (b 64, 128 at 64 and 128 heads), the cut over 132 programs
    where a wave would stand mostly idle (b 74) or the units are few (b 2); a long topk over two
    units: programs dropped until no unit is in more than SPARSE_MAX_PIECES pieces."""
    for batch, heads, programs in [(64, 64, 128), (128, 64, 256), (64, 128, 256), (128, 128, 512), (74, 64, 132),
                                   (74, 128, 132), (2, 64, 32), (2, 128, 64)]:
        units = batch * 2 * heads // 64
        assert S.sparse_programs(units, 32, 132, 64) == programs, (batch, heads)
    programs = S.sparse_programs(2, 4096, 132, 64)
    assert S.sparse_pieces(2, 4096, programs) <= S.SPARSE_MAX_PIECES < S.sparse_pieces(2, 4096, 132)


def test_odd_heads_eight_query_tokens_an_odd_page_and_a_scale():
    inputs = make(2, 8, 3, 5, 30, 16, seed=7)
    out, lse = run(inputs, softmax_scale=0.11)
    inputs.softmax_scale = 0.11
    assert_right(inputs, out, lse)


def test_a_query_with_nothing_to_attend_is_zero_with_lse_inf():
    inputs = make(3, 2, 16, 64, 80, 32, seed=3, topk_length=True)
    inputs.indices[0, 1] = -1  # every entry skipped
    inputs.topk_length[1] = 0  # no entry counts
    out, lse = run(inputs)
    assert bool((out[0, 1] == 0).all()) and bool((lse[0, :, 1] == math.inf).all())
    assert bool((out[1] == 0).all()) and bool((lse[1] == math.inf).all())
    assert_right(inputs, out, lse)


@pytest.mark.parametrize("splits", [None, 2])
def test_poisoned_entries_make_their_query_nan_and_nothing_else(splits):
    """An entry below -1 or at or past the cache's tokens makes its query NaN; the other queries
    (of the same request too) stay right. 2147480000 x 656 bytes lies far outside any mapping:
    a read there would fault."""
    inputs = make(3, 2, 16, 64, 120, 64, seed=11)
    capacity = inputs.k_cache.shape[0] * inputs.k_cache.shape[1]
    inputs.indices[0, 0, 5] = -2
    inputs.indices[1, 1, 40] = capacity
    inputs.indices[2, 0, 63] = 2147480000
    out, lse = run(inputs, plan_of(splits))
    for b, t in ((0, 0), (1, 1), (2, 0)):
        assert bool(torch.isnan(out[b, t].float()).all()) and bool(torch.isnan(lse[b, :, t]).all())
    verdict = assert_right(inputs, out, lse)
    assert verdict["poisoned_rows"] == 3 * 16


def test_a_bad_topk_length_makes_its_request_nan():
    inputs = make(3, 2, 16, 64, 120, 64, seed=12, topk_length=True)
    inputs.topk_length[0] = -1
    inputs.topk_length[2] = 65
    out, lse = run(inputs)
    for b in (0, 2):
        assert bool(torch.isnan(out[b].float()).all()) and bool(torch.isnan(lse[b]).all())
    assert_right(inputs, out, lse)


def test_entries_past_topk_length_are_never_read():
    """Garbage past topk_length (2147480000, -7: the generator's) neither poisons nor reads; and
    NaN in every token no query selects never reaches out."""
    inputs = make(2, 2, 16, 1, 60, 64, seed=13, topk_length=True)
    n0, n1 = min(17, int(inputs.topk_length[0])), min(40, int(inputs.topk_length[1]))
    inputs.topk_length[:] = torch.tensor([n0, n1], dtype=torch.int32)
    inputs.indices[0, :, n0:] = 2147480000
    inputs.indices[1, :, n1:] = -123456
    expected = expected_of(inputs)
    assert int(expected.poisoned.sum()) == 0
    out, lse = run(inputs)
    assert bool(torch.isfinite(out.float()).all())
    assert_right(inputs, out, lse, expected)


def test_a_token_listed_twice_counts_twice():
    inputs = make(2, 1, 16, 64, 100, 32, seed=14)
    row = inputs.indices[1, 0]
    row[:] = row[row >= 0][0]  # one token, 32 times but once
    row[0] = -1
    out, lse = run(inputs)
    assert_right(inputs, out, lse)


def test_flashmlas_padded_blocks_and_uint8_bytes():
    """FlashMLA's test allocates page + 1 tokens a block and passes [:, :page]; vLLM passes the
    cache as uint8 bytes (int8 is accepted too)."""
    inputs = make(2, 2, 16, 64, 100, 64, seed=15)
    blocks = inputs.k_cache.shape[0]
    padded = torch.zeros(blocks, 65, 1, 656, dtype=torch.uint8, device=DEVICE)
    padded[:, :64] = inputs.k_cache.view(torch.uint8)
    expected = expected_of(inputs)
    for cache in (padded[:, :64], inputs.k_cache.view(torch.uint8), inputs.k_cache.view(torch.int8)):
        out, lse = run(inputs, k_cache=cache)
        assert_right(inputs, out, lse, expected)


def test_any_strides_of_q_and_indices():
    inputs = make(2, 2, 16, 64, 100, 32, seed=16)
    q = inputs.q.transpose(1, 2).contiguous().transpose(1, 2)  # heads outermost
    wide = torch.full((2, 2, 48), 7, dtype=torch.int32, device=DEVICE)
    wide[:, :, :32] = inputs.indices
    out, lse = run(inputs, q=q, indices=wide[:, :, :32])
    assert_right(inputs, out, lse)
    out2, _ = run(inputs, q=inputs.q.transpose(2, 3).contiguous().transpose(2, 3))  # last dim not contiguous
    assert torch.equal(out2, out)


def test_one_plan_serves_new_indices_and_lengths_and_outputs_are_fresh():
    plan = plan_of(2)
    first = make(2, 2, 16, 64, 150, 64, seed=17)
    out1, lse1 = run(first, plan)
    again, lse_again = run(first, plan)  # the tickets were reset: the merge runs again
    assert torch.equal(again, out1) and torch.equal(lse_again, lse1)
    assert again.data_ptr() != out1.data_ptr() and lse_again.data_ptr() != lse1.data_ptr()
    second = make(2, 2, 16, 64, 150, 64, seed=18, topk_length=True)
    second.k_cache = first.k_cache  # the same cache, other entries and lengths
    second.values = first.values
    second.indices = first.indices.flip(-1).contiguous()
    second.topk_length = torch.tensor([64, 9], dtype=torch.int32, device=DEVICE)  # and now lengths
    out2, lse2 = run(second, plan)
    assert_right(first, out1, lse1)
    assert_right(second, out2, lse2)
    assert plan.shape == S.PlanShape(2, 2, 16, 64, "fp8_sparse", False, 64)


def test_the_split_count_the_plan_chooses():
    plan = plan_of()
    run(make(2, 1, 16, 64, 100, 64, seed=19), plan)
    assert plan.num_splits == 1  # 64 entries: no split of 256
    plan = plan_of()
    inputs = make(1, 1, 16, 64, 600, 512, seed=20)
    out, lse = run(inputs, plan)
    assert plan.num_splits == 2  # 512 entries, 8 programs wanted on the CPU
    assert_right(inputs, out, lse)


# ---------------------------------------------------------------------------------------------
# Argument errors: a ValueError naming the argument, before anything runs


def bad_calls(inputs):
    q, cache, idx, lengths = inputs.q, inputs.k_cache, inputs.indices, inputs.topk_length
    dense = torch.zeros(cache.shape[0], 64, 1, 576, dtype=torch.float8_e4m3fn, device=DEVICE)
    unaligned = torch.zeros(cache.numel() + 8, dtype=torch.uint8, device=DEVICE)[8:].view(cache.shape)
    rows_apart = torch.zeros(cache.shape[0], 64, 1, 672, dtype=torch.uint8, device=DEVICE)[..., :656]
    return [
        ("q", dict(q=q.float())),
        ("q", dict(q=q[..., :512])),
        ("q", dict(q=q.repeat(1, 5, 1, 1)[:, :9])),
        ("q", dict(q=torch.zeros(2, 2, 129, 576, dtype=torch.bfloat16, device=DEVICE))),
        ("k_cache", dict(k_cache=dense)),
        ("k_cache", dict(k_cache=cache.view(torch.uint8).view(torch.bfloat16))),
        ("k_cache", dict(k_cache=cache.to(torch.float32))),
        ("k_cache", dict(k_cache=unaligned)),
        ("k_cache", dict(k_cache=rows_apart)),
        ("k_cache", dict(k_cache=cache[:, :, 0])),
        ("indices", dict(indices=idx.long())),
        ("indices", dict(indices=idx[:1])),
        ("indices", dict(indices=idx[..., :0])),
        ("indices", dict(indices=idx.transpose(1, 2).contiguous().transpose(1, 2))),
        ("topk_length", dict(topk_length=lengths.long())),
        ("topk_length", dict(topk_length=lengths[:1])),
        ("topk_length", dict(topk_length=lengths[:, None])),
        ("softmax_scale", dict(softmax_scale=0.0)),
        ("softmax_scale", dict(softmax_scale=float("nan"))),
        ("softmax_scale", dict(softmax_scale=True)),
    ]


@pytest.mark.parametrize("case", range(20))
def test_bad_arguments_name_the_argument(case):
    inputs = make(2, 2, 16, 64, 60, 32, seed=21, topk_length=True)
    name, override = bad_calls(inputs)[case]
    with pytest.raises(ValueError, match=name):
        run(inputs, **override)


def test_the_sparse_forms_other_arguments():
    inputs = make(2, 2, 16, 64, 60, 32, seed=22)
    plan = plan_of()
    args = (inputs.q, inputs.k_cache, None, None)
    sparse = dict(is_fp8_kvcache=True, indices=inputs.indices)
    for name, call in [
        ("causal", lambda: S.mla_decode_with_kvcache(*args, 512, plan, causal=True, **sparse)),
        ("is_fp8_kvcache", lambda: S.mla_decode_with_kvcache(*args, 512, plan, indices=inputs.indices)),
        ("num_splits", lambda: S.mla_decode_with_kvcache(*args, 512, plan, num_splits=2, **sparse)),
        ("head_dim_v", lambda: S.mla_decode_with_kvcache(*args, 576, plan, **sparse)),
        ("k_scale", lambda: S.mla_decode_with_kvcache(*args, 512, plan, k_scale=1.0, **sparse)),
        ("indices", lambda: S.mla_decode_with_kvcache(*args, 512, plan, is_fp8_kvcache=True)),
        ("plan", lambda: S.mla_decode_with_kvcache(*args, 512, {"not": "a plan"}, **sparse)),
        ("plan.num_splits", lambda: S.mla_decode_with_kvcache(*args, 512, plan_of(0), **sparse)),
    ]:
        with pytest.raises(ValueError, match=name):
            call()
    # engines pass placeholders for block_table and cache_seqlens (vLLM): not read
    out, lse = S.mla_decode_with_kvcache(inputs.q, inputs.k_cache, torch.empty(2, 1, dtype=torch.int32),
                                         torch.ones(2, dtype=torch.int32), 512, plan, **sparse)
    assert_right(inputs, out, lse)
    other = make(2, 2, 16, 64, 60, 64, seed=23)  # another topk: another shape
    with pytest.raises(ValueError, match="plan was filled"):
        run(other, plan)
    dense_plan = plan_of()
    dense_plan.shape = (2, 2, 16, 64, "fp8", False)  # filled by a dense call
    with pytest.raises(ValueError, match="plan was filled"):
        run(inputs, dense_plan)


# ---------------------------------------------------------------------------------------------
# The GPUs' compilers, without a GPU

COMPILE = """
import json, sys
from tools import kernel_report as K
import submission as S
spec = K.TARGETS[sys.argv[1]]
params = next(row["params"] for row in S.SERVING_ROUTE_TABLE if row["route"] == sys.argv[2])
entry = S.TRITON_COMPILE_PLANS[sys.argv[2]](params, num_splits=(2,), topk_length=(True,))[0]  # the decode kernel
facts, _ = K.compile_and_analyse(*K.complete_plan_entry(entry, spec), spec)
print(json.dumps({"spills": facts["spills"], "mma": facts["mma"]["loop_count"],
                  "loop_locals": facts.get("hot_loop_locals")}))
"""


@pytest.mark.parametrize("target,route", [("sm90", "triton_sparse"), ("gfx950", "triton_sparse"),
                                          ("gfx942", "triton_sparse"), ("sm90", "hopper_sparse")])
def test_the_kernel_compiles_for_the_gpus(tmp_path, target, route):
    """Each sparse row's configuration (the portable kernel everywhere, the warp-specialised one on
    sm_90), with splits and topk_length, compiled as tools/kernel_report.py compiles (a process per
    target, no interpreter, a fresh cache): bf16 MMAs in the tile loop; on sm_90 the portable kernel
    spills nothing and the warp-specialised one nothing in its tile loops (its merge of the splits,
    after them, may)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", COMPILE, target, route], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["mma"] > 0
    if route == "hopper_sparse":  # the shared-memory base reloaded in the tile loops, nothing else
        assert result["loop_locals"] <= SPARSE_TILE_LOOP_SPILLS, result
    elif target == "sm90":
        assert result["spills"]["spill_store_bytes"] == 0, result


def test_sparse_q_format_is_the_serving_rows(monkeypatch):
    """sparse_q_format names the q of the row that serves the tensors: bf16 where the row says
    nothing (the portable kernel here), the row's "q" where it says one."""
    inputs = R.generate_sparse_input(2, 2, 16, 64, 256, 32, seed=3)
    assert S.sparse_q_format(inputs.q, inputs.k_cache) == "bf16"
    table = [dict(row, q="fp8") if row["route"] == "triton_sparse" else row for row in S.SERVING_ROUTE_TABLE]
    monkeypatch.setattr(S, "SERVING_ROUTE_TABLE", table)
    assert S.sparse_q_format(inputs.q, inputs.k_cache) == "fp8"

"""The Hopper route (submission.py, HOPPER ROUTE section) on a machine without sm_90: it must be
absent, its table rows skipped in favour of the portable row that follows each, its inputs
refused before any GPU work, and its launch key must tell TMA descriptors apart. Its kernel is
compiled for sm_90 by tests/test_kernel_report.py and checked numerically on an H200 by
bench/hopper_probe.py (bench/h200/hopper_checks.txt): Gluon kernels have no CPU interpreter."""
import pytest
import torch

import reference
import submission

LEADERBOARD = [(4, 1024), (4, 8192), (32, 1024), (32, 8192), (64, 1024), (64, 8192), (256, 1024),
               (256, 8192)]


def test_absent_off_hopper():
    assert not submission.HOPPER  # CPU (or any non-sm_90 machine) runs these tests
    assert "hopper_fp8" not in submission.ROUTES
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
def test_off_hopper_each_shape_takes_its_portable_row(batch, kv_len):
    row = submission.select_route(batch, kv_len, True, submission.TRITON_ROUTE_TABLE)
    assert row["route"] == "triton_fp8"
    assert (row["max_batch"], row["max_kv_len"]) == (batch, kv_len)


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
    for params in ({"num_splits": 3}, {"num_splits": 1}, {"num_splits": 64},
                   {"num_splits": 4, "cooperative_merge": False}):
        [plan] = submission.triton_compile_plan("hopper_fp8", params)
        assert plan["constexprs"]["COOPERATIVE_MERGE"] is False


def test_cooperative_merge_only_when_every_program_fits_at_once(monkeypatch):
    monkeypatch.setitem(submission._SM_COUNTS, "gpu", 132)
    fits = submission.cooperative_merge_fits
    assert fits(4, 32, "gpu") and fits(32, 4, "gpu") and fits(66, 2, "gpu")
    assert not fits(64, 4, "gpu")  # 256 programs > 132 SMs: some could wait for a spinning one
    assert not fits(4, 1, "gpu") and not fits(4, 3, "gpu") and not fits(1, 64, "gpu")


def test_a_cache_tma_cannot_read_goes_to_the_portable_kernel(monkeypatch):
    data = reference.generate_input(2, 1, 70, 3, device="cpu")
    q, kv_data, qo_indptr, kv_indptr, config = data
    kv, scale = kv_data["fp8"]
    assert submission.tma_can_read(kv)
    wide = torch.zeros(kv.shape[0], 1, 592, dtype=torch.uint8).view(kv.dtype)[:, :, 8:584]  # misaligned
    wide.copy_(kv)
    assert not submission.tma_can_read(wide)
    calls = []
    monkeypatch.setattr(submission, "triton_fp8_route", lambda *a, **k: calls.append(k) or "portable")
    out = submission.hopper_fp8_route(q, dict(kv_data, fp8=(wide, scale)), qo_indptr, kv_indptr, config,
                                      num_splits=4)
    assert out == "portable" and calls == [{"num_splits": 4}]

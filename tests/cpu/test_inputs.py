"""Inputs laid out or placed differently, and poison: every route this machine runs gives the right
answer for any layout of the right values or a ValueError naming the tensor; every tensor must be on
q's device; a NaN or inf in q or the cache, or indptr entries outside the cache, come back as
non-finite rows, never as plausible numbers (and no kernel reads outside its tensors)."""
import re

import pytest
import torch

import reference
import submission

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROUTES = [("triton_fp8", {"num_splits": 1, "block_n": 32}), ("triton_fp8", {"num_splits": 3, "block_n": 32}),
          ("triton_mxfp4", {"num_splits": 1, "block_n": 32}), ("triton_mxfp4", {"num_splits": 2, "block_n": 32})]
if submission.HOPPER:
    ROUTES += [("hopper_fp8", {"num_splits": 1}), ("hopper_fp8", {"num_splits": 4})]
KV_LENS = [40, 70, 33]


def make(seed=1):
    return reference.generate_input(len(KV_LENS), 1, max(KV_LENS), seed, kv_lens=KV_LENS, device=DEVICE)


def run(route, params, data):
    """The route as custom_kernel runs it: through check_inputs and the route's format check."""
    q, kv_data, qo_indptr, kv_indptr, config = data
    q, qo_indptr, kv_indptr, _, total_kv = submission.check_inputs(q, kv_data, qo_indptr, kv_indptr, config)
    return submission.run_candidate({"route": route, "params": params}, (q, kv_data, qo_indptr, kv_indptr, config),
                                    total_kv)


def with_q(data, q):
    return (q, *data[1:])


def with_kv(data, fmt, entry):
    return (data[0], dict(data[1], **{fmt: entry}), *data[2:])


def strided_copy(x, dim_stride=2):
    """The same values with the last dimension at stride dim_stride (a view into a wider buffer)."""
    wide = torch.zeros(*x.shape[:-1], x.shape[-1] * dim_stride, dtype=x.dtype, device=x.device)
    view = wide[..., ::dim_stride]
    view.copy_(x)
    return view


@pytest.mark.parametrize("route,params", ROUTES, ids=str)
def test_q_in_any_layout_gives_the_same_answer(route, params):
    data = make()
    plain = run(route, params, data)
    q = data[0]
    transposed = q.transpose(1, 2).contiguous().transpose(1, 2)  # a (B, 576, 16) buffer seen as (B, 16, 576)
    for other in (transposed, strided_copy(q), q.permute(1, 0, 2).contiguous().permute(1, 0, 2)):
        assert not other.is_contiguous() and torch.equal(other, q)
        assert torch.equal(run(route, params, with_q(data, other)), plain)


@pytest.mark.parametrize("route,params", ROUTES, ids=str)
def test_indptrs_in_any_layout_give_the_same_answer(route, params):
    data = make()
    plain = run(route, params, data)
    q, kv_data, qo_indptr, kv_indptr, config = data
    qo_wide = torch.zeros(2 * qo_indptr.numel(), dtype=torch.int32, device=DEVICE)[::2]
    qo_wide.copy_(qo_indptr)
    kv_wide = torch.zeros(2 * kv_indptr.numel(), dtype=torch.int32, device=DEVICE)[::2]
    kv_wide.copy_(kv_indptr)
    assert qo_wide.stride(0) == kv_wide.stride(0) == 2
    assert torch.equal(run(route, params, (q, kv_data, qo_wide, kv_wide, config)), plain)


@pytest.mark.parametrize("route,params", ROUTES, ids=str)
def test_a_cache_with_wider_rows_gives_the_same_answer(route, params):
    """Rows at a larger stride (a view of a wider cache): read in place."""
    data = make()
    plain = run(route, params, data)
    fmt = submission.ROUTE_INFO[route]["kv_format"]
    value, scale = data[1][fmt]
    storage = torch.uint8 if value.element_size() == 1 else value.dtype  # fp4 / fp8 tensors cannot be filled
    wide = torch.zeros(value.shape[0], 1, value.shape[-1] + 64, dtype=storage, device=DEVICE)
    wide[..., :value.shape[-1]] = value.view(storage)
    wide = wide.view(value.dtype)
    assert torch.equal(run(route, params, with_kv(data, fmt, (wide[..., :value.shape[-1]], scale))), plain)


@pytest.mark.parametrize("fmt", ["fp8", "bf16", "mxfp4"])
def test_a_cache_whose_last_dimension_is_not_contiguous_is_refused_naming_it(fmt):
    data = make()
    entry = data[1][fmt]
    value = entry if fmt == "bf16" else entry[0]
    strided = strided_copy(value.view(torch.uint8) if value.element_size() == 1 else value)
    strided = strided.view(value.dtype) if strided.dtype != value.dtype else strided
    bad = strided if fmt == "bf16" else (strided, entry[1])
    field = f'kv_data["{fmt}"]'
    with pytest.raises(ValueError, match=re.escape(field) + r" has strides \(\d+, \d+, 2\)"):
        submission.check_kv_format(with_kv(data, fmt, bad)[1], fmt, value.shape[0], data[0].device)


@pytest.mark.parametrize("field", ["qo_indptr", "kv_indptr", 'kv_data["fp8"]', 'kv_data["fp8"] scale'])
def test_a_tensor_on_another_device_is_refused_naming_it_and_both_devices(field):
    data = make()
    q, kv_data, qo_indptr, kv_indptr, config = data
    meta = torch.device("meta")
    if field == "qo_indptr":
        data = (q, kv_data, qo_indptr.to(meta), kv_indptr, config)
    elif field == "kv_indptr":
        data = (q, kv_data, qo_indptr, kv_indptr.to(meta), config)
    elif field == 'kv_data["fp8"]':
        data = with_kv(data, "fp8", (kv_data["fp8"][0].to(meta), kv_data["fp8"][1]))
    else:
        data = with_kv(data, "fp8", (kv_data["fp8"][0], kv_data["fp8"][1].to(meta)))
    message = re.escape(f"{field} is on meta but q is on {q.device}")
    with pytest.raises(ValueError, match=message):
        run("triton_fp8", {}, data)
    with pytest.raises(ValueError, match=message):
        submission.custom_kernel(data)


def finite_rows(out):
    return torch.isfinite(out.float()).flatten(1).all(1).tolist()


@pytest.mark.parametrize("route,params", ROUTES, ids=str)
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_poison_in_q_makes_its_row_non_finite(route, params, poison):
    data = make()
    plain = run(route, params, data)
    q = data[0].clone()
    q[1, 5, 100] = poison
    out = run(route, params, with_q(data, q))
    assert finite_rows(out) == [True, False, True]
    assert torch.equal(out[0], plain[0]) and torch.equal(out[2], plain[2])


@pytest.mark.parametrize("route,params", ROUTES, ids=str)
def test_poison_in_the_cache_makes_its_row_non_finite(route, params):
    """A NaN byte in the fp8 cache (0x7f) or an e8m0 NaN scale (255) in the mxfp4 cache, in row 1's rows."""
    data = make()
    fmt = submission.ROUTE_INFO[route]["kv_format"]
    value, scale = data[1][fmt]
    token = KV_LENS[0] + 17
    if fmt == "fp8":
        poisoned = value.clone()
        poisoned.view(torch.uint8)[token, 0, 7] = 0x7F
        entry = (poisoned, scale)
    else:
        scales = scale.clone()
        scales.view(torch.uint8)[token, 3] = 255
        entry = (value, scales)
    finite = finite_rows(run(route, params, with_kv(data, fmt, entry)))
    # The Hopper kernel reads whole 64-token tiles and masks the tokens past a row by p = 0: a NaN
    # byte in a token that row 0's last tile also covers poisons row 0 too (0 x NaN), never less.
    assert finite[1:] == [False, True] and (finite[0] or route == "hopper_fp8"), finite


@pytest.mark.parametrize("route,params", ROUTES, ids=str)
@pytest.mark.parametrize("case", ["past the end", "before the start", "backwards", "qo_indptr"])
def test_indptrs_outside_the_cache_give_nan_rows_not_numbers(route, params, case):
    """The kernels bound every row by the cache's rows: a row whose segment leaves it (or a q row
    other than its own) reads nothing and comes back NaN; the other rows are untouched."""
    data = make()
    plain = run(route, params, data)
    q, kv_data, qo_indptr, kv_indptr, config = data
    qo, kv = qo_indptr.clone(), kv_indptr.clone()
    total = sum(KV_LENS)
    if case == "past the end":
        kv[-1] = total + 1000  # row 2 would read 1000 rows past the cache
        expected = [True, True, False]
    elif case == "before the start":
        kv[0] = -500
        expected = [False, True, True]
    elif case == "backwards":
        kv[1] = kv[2] + 5  # row 0 grows (still inside the cache), row 1 runs backwards
        expected = [True, False, True]
    else:
        qo[1] = 2
        expected = [True, False, True]
    out = run(route, params, (q, kv_data, qo, kv, config))
    assert finite_rows(out) == expected
    assert torch.isnan(out[[i for i, ok in enumerate(expected) if not ok]].float()).all()
    for i, ok in enumerate(expected):
        if ok and not (case == "backwards" and i == 0):
            assert torch.equal(out[i], plain[i])


def test_custom_kernel_reads_q_in_any_layout_on_the_active_table():
    data = reference.generate_input(2, 1, 96, 4, device=DEVICE)
    plain = submission.custom_kernel(data)
    q = data[0]
    transposed = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(submission.custom_kernel(with_q(data, transposed)), plain)


@pytest.mark.parametrize("route,params", ROUTES, ids=str)
def test_a_nan_cache_scale_makes_every_row_non_finite(route, params):
    """What the runner's quantiser makes of a NaN in the bf16 cache: a NaN per-tensor scale."""
    data = make()
    fmt = submission.ROUTE_INFO[route]["kv_format"]
    if fmt != "fp8":
        pytest.skip("the mxfp4 cache has no per-tensor scale")
    value, scale = data[1]["fp8"]
    assert finite_rows(run(route, params, with_kv(data, "fp8", (value, torch.full_like(scale, float("nan")))))) == [
        False, False, False]

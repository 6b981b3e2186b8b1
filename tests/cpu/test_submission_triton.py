"""The portable Triton route of submission.py (triton_fp8), under the interpreter on CPU (and as is
on a GPU): strict accuracy against float64 attention, any indptr, splits, caching, fresh outputs."""


import functools
import types

import pytest
import torch

import reference
import submission

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def data_with_lengths(kv_lens, seed):
    return reference.generate_input(len(kv_lens), 1, max(kv_lens), seed, kv_lens=kv_lens, device=DEVICE)


def dequantised_attention_float64(data):
    """float64 attention over the dequantised fp8 cache: what the route computes, minus rounding."""
    q, kv_data, _, kv_indptr, config = data
    kv8, scale = kv_data["fp8"]
    kv = kv8.double()[:, 0] * scale.double()
    bounds = kv_indptr.tolist()
    rows = []
    for b in range(len(bounds) - 1):
        k = kv[bounds[b]:bounds[b + 1]]
        rows.append(torch.softmax(q[b].double() @ k.T * config["sm_scale"], -1) @ k[:, :512])
    return torch.stack(rows)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


ROUTE_CASES = [
    # (kv lengths, params): lengths off every tile size, a length-1 row, empty splits
    ([37, 100, 5], {"num_splits": 1, "block_n": 32}),
    ([37, 100, 5], {"num_splits": 4, "block_n": 32}),
    ([200, 1, 64], {"num_splits": 8, "block_n": 64}),
    ([130], {"num_splits": 2, "block_n": 64}),
    ([70, 129], {"num_splits": 3, "block_n": 16}),
]


@pytest.mark.parametrize("kv_lens,params", ROUTE_CASES)
def test_route_matches_float64_attention_over_its_own_inputs(kv_lens, params):
    data = data_with_lengths(kv_lens, seed=sum(kv_lens))
    out = submission.triton_fp8_route(*data, **params)
    assert out.shape == (len(kv_lens), 16, 512) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    exact = dequantised_attention_float64(data)
    # Only q's fp8 rounding (about 2.5%) separates the route from attention over the fp8 cache.
    assert rel(out, exact) < 0.04
    # Against the truth (float64 over the bf16 cache): within the route's declared bound, and no
    # worse than 1.25x the reference's own error on the same inputs.
    truth = reference.attention_float64(data)
    own, ref_err = rel(out, truth), rel(reference.ref_kernel(data), truth)
    assert own <= submission.ROUTE_INFO["triton_fp8"]["rel_l2_bound"]
    assert own <= 1.25 * ref_err, (own, ref_err)


def test_split_counts_agree_and_stale_workspace_does_not_leak():
    data = data_with_lengths([150, 3, 97], seed=11)
    one = submission.triton_fp8_route(*data, num_splits=1, block_n=32)
    for splits in (2, 4, 8):
        partials, lse, tickets = submission.split_workspace(3, splits, data[0].device)
        partials.fill_(float("nan"))  # poison: every slot the merge reads must be rewritten
        lse.fill_(float("nan"))
        many = submission.triton_fp8_route(*data, num_splits=splits, block_n=32)
        assert torch.isfinite(many).all()
        assert rel(many, one) < 5e-3
        # the merging program resets its row's arrival ticket (the first half; the second half holds the
        # Hopper route's cooperative counters, which only grow, and other tests may have run it)
        assert tickets[:3].eq(0).all()


def test_two_calls_return_distinct_tensors_and_the_first_survives():
    data = data_with_lengths([64, 64], seed=3)
    first = submission.triton_fp8_route(*data, num_splits=2)
    kept = first.clone()
    second = submission.triton_fp8_route(*data, num_splits=2)
    assert first.data_ptr() != second.data_ptr()
    assert torch.equal(first, kept)


def test_large_q_stays_right():
    """The per-program q scale follows q's range: q x 1000 (far past the fp8 max) over a cache whose
    scale is divided by 1000 gives the same scores, and an output 1000 times smaller."""
    q, kv_data, qo, kvi, config = data_with_lengths([80], seed=9)
    big = (q.float() * 1000).bfloat16()
    kv_fp8, kv_scale = kv_data["fp8"]
    small_kv = dict(kv_data, fp8=(kv_fp8, kv_scale / 1000))
    out = submission.triton_fp8_route(big, small_kv, qo, kvi, config)
    unscaled = submission.triton_fp8_route(q, kv_data, qo, kvi, config)
    assert rel(out.float() * 1000, unscaled) < 0.02


def test_a_zero_output_fails_the_strict_bound():
    data = data_with_lengths([128, 64], seed=21)
    zeros = torch.zeros(2, 16, 512, dtype=torch.bfloat16, device=DEVICE)
    assert reference.rel_l2_error(zeros, data) > submission.ROUTE_INFO["triton_fp8"]["rel_l2_bound"]


def _run_custom_kernel_checked(expected_route):
    """custom_kernel on a small input: the row select_route names, within its route's strict bound,
    passing the runner's check."""
    data = reference.generate_input(2, 1, 96, seed=4, device=DEVICE)
    row = submission.select_route(2, 96, True, submission.TRITON_ROUTE_TABLE)
    assert row["route"] == expected_route
    out = submission.custom_kernel(data)
    assert submission.LAST_ROUTE == submission.route_label(row)
    assert reference.rel_l2_error(out, data) <= submission.ROUTE_INFO[row["route"]]["rel_l2_bound"]
    ok, message = reference.check_implementation(data, out)
    assert ok, message


def test_custom_kernel_runs_the_triton_table_without_aiter(monkeypatch):
    """The machine's own routes: on sm_90 the table's Hopper row comes first, elsewhere its portable row."""
    if submission.HAVE_AITER:
        pytest.skip("aiter present: the aiter table is active")
    monkeypatch.setattr(submission, "_SELECTED", {})  # select afresh
    _run_custom_kernel_checked("hopper_fp8" if submission.HOPPER else "triton_fp8")


@pytest.mark.skipif(not submission.HOPPER, reason="no Hopper route here: the test above runs the portable row")
def test_custom_kernel_takes_the_portable_row_without_the_hopper_route(monkeypatch):
    if submission.HAVE_AITER:
        pytest.skip("aiter present: the aiter table is active")
    monkeypatch.delitem(submission.ROUTES, "hopper_fp8")
    monkeypatch.setattr(submission, "_SELECTED", {})  # rows chosen with the Hopper route present
    _run_custom_kernel_checked("triton_fp8")


def test_every_triton_table_row_has_a_compile_plan_and_valid_params():
    import inspect

    for row in submission.TRITON_ROUTE_TABLE:
        route = getattr(submission, row["route"] + "_route")  # hopper_fp8 is absent from ROUTES off sm_90
        accepted = inspect.signature(route).parameters
        assert set(row["params"]) <= set(accepted), row
        plans = submission.triton_compile_plan(row["route"], row["params"])
        assert plans and all(p["kernel"] is not None for p in plans)
    assert submission.TRITON_ROUTE_TABLE[-1]["max_batch"] is None
    assert submission.TRITON_ROUTE_TABLE[-1]["max_kv_len"] is None


class _FakeCompiled:
    """Stands in for Triton's CompiledKernel: records the direct launches."""
    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        """Triton's own launcher for the compiled kernel: launch(grid, args) on the current queue."""
        return lambda *args: self.launches.append((grid, args))


class _FakeKernel:
    """Stands in for a @triton.jit kernel: counts Triton-dispatched launches."""
    arg_names = ["A", "B", "scale", "stride", "N", "M"]

    def __init__(self, compiled):
        self.compiled, self.dispatched = compiled, 0

    def __getitem__(self, grid):
        def dispatch(*args, **kwargs):
            self.dispatched += 1
            return self.compiled
        return dispatch


@pytest.fixture
def fake_direct_launch(monkeypatch):
    """launch() with its direct path on, an empty key cache, _FakeCompiled as Triton's compiled
    kernel (launched through its own runner), and one defaulted constexpr M = 7."""
    monkeypatch.setattr(submission, "DIRECT_LAUNCH", True)
    monkeypatch.setattr(submission, "keyword_defaults", lambda k: {"M": 7})
    monkeypatch.setattr(submission.triton.compiler, "CompiledKernel", _FakeCompiled)
    monkeypatch.setattr(submission, "_keep_descriptor_encodings", lambda compiled: None)
    monkeypatch.setattr(submission, "_COMPILED", {})


@pytest.mark.usefixtures("fake_direct_launch")
def test_launch_goes_direct_only_for_a_launch_already_seen(monkeypatch):
    """Triton's dispatch for a new key (alignment, strides, constexprs), the compiled kernel's
    launcher afterwards, with every constexpr (defaults included) in signature order; never
    direct while a launch hook is installed."""
    compiled = _FakeCompiled()
    kernel = _FakeKernel(compiled)
    storage = torch.zeros(64)
    a, b = storage[:16], storage[16:32]

    def call(tensors, stride=16, n=3):
        submission.launch(kernel, (2, 3), tensors, (0.5, stride), {"N": n}, 4, 2)

    call((a, b))
    assert kernel.dispatched == 1 and not compiled.launches
    call((a, b))
    assert kernel.dispatched == 1
    assert compiled.launches[-1] == ((2, 3, 1), (a, b, 0.5, 16, 3, 7))
    call((a, storage[1:17]))  # a tensor no longer 16-byte aligned: Triton specialises anew
    call((a, b), stride=17)  # a stride's divisibility changed
    call((a, b), n=4)  # another constexpr
    assert kernel.dispatched == 4 and len(compiled.launches) == 1
    monkeypatch.setattr(submission, "_launch_hooks_installed", lambda: True)
    call((a, b))
    assert kernel.dispatched == 5 and len(compiled.launches) == 1


def test_kept_descriptor_encodings_launch_what_triton_launches(monkeypatch):
    """_keep_descriptor_encodings: the compiled kernel's launcher (Triton 3.6's CudaLauncher with
    its real descriptor wrapper, over a recording C launch function) passes the C function exactly
    the arguments the unwrapped launcher passes, and encodes a descriptor once however often it is
    launched; a second call does not wrap twice."""
    from triton.backends.nvidia import driver as nv
    from triton.compiler.compiler import CompiledKernel

    def compiled_kernel(calls):
        signature = {"Q": "*bf16", "DESC": "tensordesc<fp8e4nv[64, 128]>", "n": "i32", "RING": "constexpr"}
        launcher = nv.CudaLauncher.__new__(nv.CudaLauncher)
        launcher.launch = nv.wrap_handle_tensordesc(functools.partial(lambda *args: calls.append(args)), signature,
                                                    None)
        launcher.num_ctas, launcher.global_scratch_size, launcher.profile_scratch_size = 1, 0, 0
        launcher.global_scratch_align = launcher.profile_scratch_align = 1
        launcher.launch_cooperative_grid, launcher.launch_pdl = False, False
        compiled = CompiledKernel.__new__(CompiledKernel)
        compiled._run, compiled.module, compiled.function, compiled.packed_metadata = launcher, 1, 1234, (4, 1, 0)
        return compiled

    encodings = []
    encode = nv.make_tensordesc_arg
    monkeypatch.setattr(nv, "make_tensordesc_arg", lambda arg, meta: encodings.append(arg) or encode(arg, meta))
    kept_calls, triton_calls = [], []
    kept, plain = compiled_kernel(kept_calls), compiled_kernel(triton_calls)
    submission._keep_descriptor_encodings(kept)
    wrapper = kept.run.launch
    submission._keep_descriptor_encodings(kept)
    assert kept.run.launch is wrapper
    q = torch.zeros(4)
    descriptor = types.SimpleNamespace(base=torch.zeros(8, 16), shape=[8, 16], strides=[16, 1], padding="zero")
    for n in (5, 6, 5):
        for compiled in (kept, plain):
            nv.CudaLauncher.__call__(compiled.run, 3, 2, 1, 77, compiled.function, compiled.packed_metadata, None,
                                     None, None, q, descriptor, n, 2)
    assert kept_calls == triton_calls and len(kept_calls) == 3
    assert len(encodings) == 1 + 3, "once for the kept launcher's three launches, three times for Triton's own"
    assert kept_calls[0][13] is q and kept_calls[0][14] is descriptor.base and kept_calls[1][-2:] == (6, 2)


# ---------------------------------------------------------------------------------------------
# gfx950-shaped tiles (the picks of lab/gfx950_sweep.py): the same attention as the H200 shape

GFX950_SHAPES = [
    {"block_n": 32, "num_warps": 4, "num_stages": 1},
    {"block_n": 128, "num_warps": 8, "num_stages": 2},
    {"block_n": 64, "num_warps": 4, "num_stages": 3},
]


@pytest.mark.parametrize("params", GFX950_SHAPES)
def test_gfx950_shaped_configs_match_the_current_one_and_the_truth(params):
    data = data_with_lengths([150, 1, 97], seed=31)
    current = submission.triton_fp8_route(*data, num_splits=4, block_n=64, num_warps=8, num_stages=3)
    out = submission.triton_fp8_route(*data, num_splits=4, **params)
    exact = dequantised_attention_float64(data)
    assert rel(out, exact) < 0.04
    assert rel(out, current) < 5e-3  # tile size changes only the summation order
    truth = reference.attention_float64(data)
    assert rel(out, truth) <= submission.ROUTE_INFO["triton_fp8"]["rel_l2_bound"]


def test_hip_keys_hold_the_2gib_range_of_each_tensor(monkeypatch):
    """Triton's HIP JIT compiles a tensor within 2 GiB with 32-bit buffer offsets: a key must tell
    it from a larger one, or a kernel compiled for the first would be launched on the second."""
    t = torch.zeros(8)
    monkeypatch.setattr(submission, "IS_HIP", False)
    assert submission._specialisation(t) == (torch.float32, t.data_ptr() % 16 == 0)
    monkeypatch.setattr(submission, "IS_HIP", True)
    assert submission._specialisation(t)[-1] is True
    monkeypatch.setattr(submission, "HIP_RANGE32_BYTES", 16)  # as if 32 bytes were past 2 GiB
    assert submission._specialisation(t)[-1] is False


def _aiter_triton_candidates(route, **fixed):
    """The distinct params of `route` among AITER_ROUTE_TABLE's racing candidates (fixed: only those
    with these values)."""
    seen, out = set(), []
    for row in submission.AITER_ROUTE_TABLE:
        for c in submission.race_candidates(row) if row.get("candidates") else ():
            key = repr(sorted(c["params"].items()))
            if c["route"] == route and all(c["params"].get(k) == v for k, v in fixed.items()) and key not in seen:
                seen.add(key)
                out.append(c["params"])
    return out


@pytest.mark.parametrize("params", _aiter_triton_candidates("triton_fp8"), ids=repr)
def test_every_aiter_table_fp8_candidate_agrees_with_the_h200_shape(params):
    """What the MI355X race would run: the same attention as the H200-shaped
    configuration at the same split count, within the route's bounds."""
    data = data_with_lengths([200, 1, 131], seed=41)
    out = submission.triton_fp8_route(*data, **params)
    h200 = submission.triton_fp8_route(*data, num_splits=params["num_splits"], block_n=64, num_warps=8,
                                       num_stages=3)
    assert rel(out, dequantised_attention_float64(data)) < 0.04
    assert rel(out, h200) < 5e-3
    assert rel(out, reference.attention_float64(data)) <= submission.ROUTE_INFO["triton_fp8"]["rel_l2_bound"]

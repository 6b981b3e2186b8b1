"""Helpers of the GPU tests (tests/gpu): one input with its truths, the strict check every GPU test
applies, and the poisoning that keeps a kernel's unwritten elements and stale partials from passing.

The strict check (strict_failures) lists what is wrong with an output, empty when nothing is:
  - shape (total_q, 16, 512), bf16, every element finite;
  - rel. L2 error against float64 attention over the bf16 cache within the route's bound
    (ROUTE_INFO's rel_l2_bound) and, where asked, within a factor of the reference's own error;
  - the runner's check: reference.check_implementation's comparison (compare_outputs against
    ref_kernel's output, computed once per input here).

Every module in tests/gpu skips without a CUDA GPU (and the Hopper ones without submission.HOPPER).
Time budget: the whole tests/gpu run under 2 minutes on an H200 with a cold Triton cache (most of
it compiling some 45 kernel variants), about half that with a warm one; each module says its share.
"""
from contextlib import contextmanager
from dataclasses import dataclass

import torch

import reference
import submission

NAN = float("nan")


@dataclass
class Case:
    """One input and what its output is judged against."""
    data: tuple
    expected: torch.Tensor  # ref_kernel(data): what the runner compares with
    truth: torch.Tensor  # float64 attention over the bf16 cache
    ref_l2: float  # the reference's own rel. L2 error against truth


def case_of(data):
    expected = reference.ref_kernel(data)
    truth = reference.attention_float64(data)
    return Case(data, expected, truth, reference.rel_l2_error(expected, truth))


def make_case(batch, kv_len, seed, kv_lens=None):
    """A decode input (one query per batch row) on the default device (the GPU where there is one)."""
    return case_of(reference.generate_input(batch, 1, kv_len, seed, kv_lens=kv_lens))


def strict_failures(out, case, bound, ref_factor=None, max_mismatch=None):
    """What is wrong with `out` for `case` (empty list: nothing). bound: the route's rel_l2_bound;
    ref_factor: also at most this many times the reference's own error; max_mismatch: also at most
    this share of elements outside the runner's tolerance (the runner allows 5%)."""
    shape = tuple(case.expected.shape)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != torch.bfloat16:
        return [f"output {getattr(out, 'dtype', type(out))} {tuple(getattr(out, 'shape', ()))}, "
                f"expected bfloat16 {shape}"]
    failures = []
    if not torch.isfinite(out).all():
        failures.append(f"{int((~torch.isfinite(out)).sum())} non-finite elements")
    l2 = reference.rel_l2_error(out, case.truth)
    if not l2 <= bound:
        failures.append(f"rel. L2 {l2:.4f} > bound {bound}")
    if ref_factor is not None and not l2 <= ref_factor * case.ref_l2:
        failures.append(f"rel. L2 {l2:.4f} > {ref_factor} x the reference's {case.ref_l2:.4f}")
    ok, message = reference.compare_outputs(out, case.expected)
    if not ok:
        failures.append(f"runner's check: {message}")
    if max_mismatch is not None:
        mismatch = reference.mismatch_ratio(out, case.expected)
        if not mismatch <= max_mismatch:
            failures.append(f"mismatch ratio {mismatch:.4f} > {max_mismatch}")
    return failures


def bound(route):
    return submission.ROUTE_INFO[route]["rel_l2_bound"]


_POISONED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@contextmanager
def nan_filled_empty():
    """While active, torch.empty hands out NaN-filled tensors (float32, bf16, f16): a route's fresh
    output starts poisoned, so an element its kernel does not write stays NaN and fails the check."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        tensor = real_empty(*args, **kwargs)
        if tensor.dtype in _POISONED_DTYPES:
            tensor.fill_(NAN)
        return tensor

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real_empty


def run_poisoned(route, data, **params):
    """route(*data, **params) with NaN wherever stale values could pass: in the split workspace's
    partials (cached across calls: the merge must read only what this call wrote) and in every
    tensor the route allocates with torch.empty (its output above all)."""
    q, kv_indptr = data[0], data[3]
    partial_o, partial_lse, _ = submission.split_workspace(kv_indptr.shape[0] - 1, params.get("num_splits", 1),
                                                           q.device)
    partial_o.fill_(NAN)
    partial_lse.fill_(NAN)
    with nan_filled_empty():
        return route(*data, **params)


def portable_row(batch, kv_len):
    """The table row a machine without the Hopper route takes for the shape."""
    table = [row for row in submission.TRITON_ROUTE_TABLE
             if submission.ROUTE_INFO[row["route"]].get("portable", True)]
    return submission.select_route(batch, kv_len, True, table)


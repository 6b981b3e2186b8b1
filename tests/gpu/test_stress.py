"""1000 calls in a row on each cooperative row of the route table (hopper_fp8 rows with the
cooperative merge and >= 2 splits), each output bit-identical to the first: the merge reads other
programs' partials after a ticket, so a missing acquire/release would show as an occasional
difference. Formerly the stress part of bench/hopper_probe.py (--stress 1000; git show
a5ed244:bench/hopper_probe.py).

The calls are queued back to back (the comparison is counted on the device, read once at the
end), as the runner's timed calls are. Time on an H200: about 5 s for the 6 rows (6000 calls of
10-100 us, one input and one compile per row).
"""
import pytest
import torch

import submission
from gpu_checks import bound, make_case, run_poisoned, strict_failures

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU test: needs a CUDA GPU"),
    pytest.mark.skipif(not submission.HOPPER, reason="needs the Hopper route (sm_90 with Gluon)"),
]

CALLS = 1000
COOPERATIVE_ROWS = [row for row in submission.TRITON_ROUTE_TABLE
                    if row["route"] == "hopper_fp8"
                    and row["params"].get("num_splits", 1) >= 2
                    and row["max_batch"] is not None and row["max_kv_len"] is not None]


def _row_id(row):
    return f"bs{row['max_batch']}-kv{row['max_kv_len']}-splits{row['params']['num_splits']}"


def test_the_table_has_cooperative_rows():
    assert COOPERATIVE_ROWS, "no hopper_fp8 row with the cooperative merge: nothing to stress"


@pytest.mark.parametrize("row", COOPERATIVE_ROWS, ids=_row_id)
def test_calls_in_a_row_are_bit_identical(row):
    batch, kv_len, params = row["max_batch"], row["max_kv_len"], row["params"]
    case = make_case(batch, kv_len, 11)
    first = run_poisoned(submission.hopper_fp8_route, case.data, **params)
    failures = strict_failures(first, case, bound("hopper_fp8"), 1.25, 0.005)
    assert not failures, failures
    differing = torch.zeros((), dtype=torch.int32, device=first.device)
    for _ in range(CALLS):
        differing += submission.hopper_fp8_route(*case.data, **params).ne(first).any()
    assert differing.item() == 0, f"{differing.item()} of {CALLS} calls differ from the first"

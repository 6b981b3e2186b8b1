"""lab/sparse_fp8_error.py: its emulation of the kernel's arithmetic. The bf16 way (the portable
kernel's) adds nothing to the format's own error; rounding q to fp8 adds error; rounding P to
fp8 with the per-token scales folded into it adds a little, within the bound."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "lab"))

import reference  # noqa: E402
import sparse_fp8_error  # noqa: E402


def small_case():
    return reference.generate_sparse_input(1, 2, 16, 64, 256, 128, 7, device="cpu")


def test_each_way_against_the_format():
    found = sparse_fp8_error.errors(small_case())
    fmt = found["format"][0]
    assert 0 < fmt < 0.1
    assert abs(found["bf16"][0] / fmt - 1) < 0.01
    assert found["q8"][0] > 1.05 * fmt
    assert found["bf16"][0] < found["p8"][0] < 1.25 * fmt  # rounded, and within the bound


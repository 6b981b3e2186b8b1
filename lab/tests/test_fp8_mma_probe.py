"""lab/device/fp8_mma_probe.py: its kernel compiles for sm_90a with an fp8 wgmma, and its report tells
the 13-bit model from float64: results computed by the model equal it everywhere, exact results differ
from it where a sum needs more than 13 bits (every group)."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "lab", "device"))

import fp8_mma_probe as probe  # noqa: E402
import submission  # noqa: E402


def test_the_report_tells_the_model_from_float64():
    a, b, c = probe.experiments()
    as_model = probe.report(a, b, c, probe.model(a, b, c).float())
    as_exact = probe.report(a, b, c, (c.double() + a.double() @ b.double().T).float())
    for name, _, _ in probe.GROUPS:
        assert as_model[name]["equal_model"] == as_model[name]["results"] == 1024
        assert as_exact[name]["equal_model"] < 1024
        assert as_exact[name]["largest_error_units"] < 1e-3
    assert as_exact["accumulator"]["equal_exact"] == 1024  # 1 + 2^-23 is a float32
    assert as_model["accumulator"]["equal_exact"] == 6 * 64  # 1 + 2^-8 .. 2^-13 kept


@pytest.mark.skipif(not submission.HAVE_GLUON, reason="no Gluon in this Triton")
def test_the_probe_compiles_for_sm90_with_an_fp8_wgmma():
    compiled = probe.compile_only()
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "e4m3.e4m3" in ptx

"""lab/seesaw_probe.py (lab/NOTES.md h50): what the CPU can check. Its shape refusal, and the sm_90
compile of its forms (Triton's ptxas, no GPU, in a process of its own: Gluon cannot compile
under TRITON_INTERPRET): warp-specialised (setmaxnreg), S in fp8 wgmma and P.V in f16 wgmma (V
converted), shared memory within the H200's; the loader form runs 384 threads (launched at 168
registers), the form without the loader warp 256 at 255, with no wgmma serialised for want of
registers; with P in fp8 (h51a) no f16 product and no conversion. Compiles are
skipped where Triton has no Gluon."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "lab"))

import seesaw_probe  # noqa: E402
import submission  # noqa: E402


def test_shapes_outside_the_probe_are_refused_before_any_launch():
    kv = torch.zeros(256, 1, 576)
    with pytest.raises(ValueError, match="heads 48"):
        seesaw_probe.seesaw(torch.zeros(1, 48, 576), kv, 256, 0.04)
    with pytest.raises(ValueError, match="seq_len 192"):
        seesaw_probe.seesaw(torch.zeros(1, 64, 576), kv, 192, 0.04)


@pytest.mark.skipif(not submission.HAVE_GLUON, reason="Triton without Gluon")
@pytest.mark.parametrize("loader", [True, False])
def test_the_sm90_compile_is_warp_specialised_with_fp8_scores_and_f16_products(loader):
    argv = [sys.executable, os.path.join(ROOT, "lab", "seesaw_probe.py"), "--compile-only"]
    proc = subprocess.run(argv + ([] if loader else ["--no-loader"]), capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, TRITON_INTERPRET="0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert facts["setmaxnreg"] and facts["fp8_scores"] and facts["f16_products"], facts
    assert facts["f16_conversions"] > 0 and facts["threads"] == (384 if loader else 256), facts
    assert facts["shared_bytes"] <= submission.SM90_SHARED_PER_SM - 1024, facts
    if not loader:
        assert facts["registers"] == 255 and not facts["wgmma_serialised"], facts


@pytest.mark.skipif(not submission.HAVE_GLUON, reason="Triton without Gluon")
def test_the_fp8_p_form_multiplies_p_and_v_in_fp8_with_no_conversion():
    """--p fp8 (lab/NOTES.md h51a): no f16 product and no fp8 -> f16 conversion of V, and no wgmma
    serialised for want of registers, where the f16 form has both."""
    argv = [sys.executable, os.path.join(ROOT, "lab", "seesaw_probe.py"), "--compile-only", "--p", "fp8"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=dict(os.environ, TRITON_INTERPRET="0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert facts["fp8_scores"] and not facts["f16_products"] and facts["f16_conversions"] == 0, facts
    assert not facts["wgmma_serialised"] and facts["threads"] == 384, facts

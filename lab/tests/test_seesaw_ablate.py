"""lab/seesaw_ablate.py (lab/NOTES.md h56): what the CPU can check. Its refusals, and that a variant's
replacement reaches the compiled kernel (the sm_90 compile, in processes of their own: the variant
without the P.V keeps S's 36 wgmma of the full kernel's 68, the one without S the P.V's 32, and so
for the bf16 cache's (--kv bf16); Gluon does not compile under TRITON_INTERPRET, which the children
are given off)."""
import json
import os
import subprocess
import sys

import pytest

import submission

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "lab", "seesaw_ablate.py")


@pytest.mark.parametrize("args", [["--variants", "no_such"], ["--heads", "16"], ["--length", "100"]])
def test_what_the_seesaw_does_not_serve_is_refused(args):
    proc = subprocess.run([sys.executable, SCRIPT, "--compile-only", *args], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "error:" in proc.stderr


@pytest.mark.skipif(not submission.HAVE_GLUON, reason="Triton without Gluon")
@pytest.mark.parametrize("kv,expected", [
    ("fp8", {"full": 68, "no_pv": 36, "no_scores": 32}),  # a pair's S: 2 x 18 m64n64k32; its P.V: 2 x 16
    ("bf16", {"full": 104, "no_pv": 72, "no_scores": 32}),  # 32-token tiles (h65): S 2 x 36 m64n32k16
])
def test_a_variant_compiles_without_the_stage_it_leaves_out(kv, expected):
    proc = subprocess.run([sys.executable, SCRIPT, "--compile-only", "--kv", kv, "--variants", "full,no_pv,no_scores"],
                          capture_output=True, text=True, timeout=900, env=dict(os.environ, TRITON_INTERPRET="0"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    facts = {f["variant"]: f for f in map(json.loads, proc.stdout.strip().splitlines()[-3:])}
    counts = {name: sum(f["mma"].values()) for name, f in facts.items()}
    assert counts == expected, counts

"""lab/cluster_probe.py: what the CPU can check. Its argument parsing and float64 merge, and the
sm_90 compile of its variants (Triton's ptxas, no GPU): the ticket variants keep the atomic, the
cluster variants have the cluster barrier and no cluster directive (so that one compile launches
with any cluster size), the DSMEM variant reads through mapa + ld.shared::cluster.
Compiles are skipped where Triton has no Gluon."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "lab"))

import cluster_probe  # noqa: E402


def test_parse_configs():
    assert cluster_probe.parse_configs("4x16,32X4") == [(4, 16), (32, 4)]
    for bad in ("4x3", "0x4", "4x128", "4-16"):
        with pytest.raises(ValueError):
            cluster_probe.parse_configs(bad)


def test_cluster_variants_stop_at_sixteen():
    assert cluster_probe.variant_runs("cluster/dsmem", 16)
    assert not cluster_probe.variant_runs("cluster/global", 32)
    assert cluster_probe.variant_runs("ticket/global", 32)


def test_expected_merge_is_a_weighted_mean():
    truth = cluster_probe.expected_merge(2, 4)
    assert truth.shape == (2, cluster_probe.HEADS, cluster_probe.LATENT)
    # every partial lies in [-0.75, 0.75]: so does any convex combination of them
    assert truth.abs().max() <= 0.75 + 1e-12
    # one split: the merge is that split's partial
    one = cluster_probe.expected_merge(1, 1)[0]
    heads = torch.arange(cluster_probe.HEADS, dtype=torch.float64).view(-1, 1)
    dims = torch.arange(cluster_probe.LATENT, dtype=torch.float64).view(1, -1)
    assert torch.equal(one, torch.remainder(heads * 3 + dims, 13) * 0.125 - 0.75)


def test_unknown_variant_is_an_error():
    with pytest.raises(SystemExit):
        cluster_probe.main(["--variants", "ticket/global,bogus", "--compile-only"])


needs_gluon = pytest.mark.skipif(not cluster_probe.HAVE_GLUON, reason="Triton without Gluon")

# The compile runs in its own process with the interpreter off (the test session may have set
# TRITON_INTERPRET=1, under which Gluon helpers cannot be compiled).
COMPILE = """
import json, sys
sys.path.insert(0, {bench!r})
import cluster_probe
sync, exchange = cluster_probe.VARIANTS[{variant!r}]
print(json.dumps(cluster_probe.compile_variant(sync, exchange, {splits}).asm["ptx"]))
"""


@needs_gluon
@pytest.mark.parametrize("variant,splits", [("ticket/global", 4), ("cluster/global", 16), ("cluster/dsmem", 4)])
def test_variant_compiles_for_sm90(variant, splits):
    import json
    import subprocess
    code = COMPILE.format(bench=os.path.join(ROOT, "lab"), variant=variant, splits=splits)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, TRITON_INTERPRET="0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ptx = json.loads(proc.stdout.strip().splitlines()[-1])
    sync, exchange = cluster_probe.VARIANTS[variant]
    assert ".explicitcluster" not in ptx and ".reqnctapercluster" not in ptx
    assert "%ctaid.x" in ptx  # program_id(0) is the program, not the cluster
    assert ("atom." in ptx) == (sync == 1)
    assert ("barrier.cluster.arrive.release" in ptx) == (sync == 2)
    assert ("ld.shared::cluster" in ptx) == (exchange == 2)


def test_launch_arguments_cover_the_signature():
    args = cluster_probe.launch_arguments(tuple(range(6)), 1, 1, 4)
    if cluster_probe.HAVE_GLUON:
        assert len(args) == len(cluster_probe._epilogue_probe.arg_names)
    assert args[6:9] == (1, 1, 4)

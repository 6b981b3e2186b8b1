"""lab/profile/trace_probe.py instruments a copy of submission.py by exact-text insertions: every marker
must still be found once in today's kernel, and the instrumented Hopper kernel must compile for
sm_90 (ahead of time, on the CPU) with no spills, so the probe works when a device run needs it."""
import json
import os
from pathlib import Path

import pytest

import submission
from lab.profile import trace_probe
from tools import kernel_report as kr

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_every_marker_applies_to_submission():
    source = trace_probe.instrumented_source(str(REPO_ROOT / "submission.py"))
    compile(source, "traced_submission.py", "exec")
    assert source.count("%globaltimer") == 5 and "TRACE_BUFFER" in source


@pytest.mark.skipif(not submission.HAVE_GLUON, reason="no Gluon in this Triton")
def test_instrumented_kernel_compiles_for_sm90(tmp_path, monkeypatch):
    # the compile workers import the traced copy from tmp_path; its `from task import ...` needs the repo
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    path = tmp_path / "traced_submission.py"
    path.write_text(trace_probe.instrumented_source(str(REPO_ROOT / "submission.py")))
    tables = tmp_path / "tables.py"  # one Hopper row: compile only the traced kernel
    tables.write_text('TRITON_ROUTE_TABLE = [{"max_batch": None, "max_kv_len": None, "route": "hopper_fp8", '
                      '"params": {"num_splits": 4}}]\n')
    out = tmp_path / "report.json"
    kr.main(["--module", str(path), "--tables", str(tables), "--targets", "sm90", "--json", str(out)])
    records = [r for r in json.loads(out.read_text())["records"] if r["kernel"] == "_mla_decode_fp8_hopper_kernel"]
    assert len(records) >= 2  # both merges of the 4-split row (and the route defaults)
    for record in records:
        assert record["compiled"] and record["spills"]["spill_store_bytes"] == 0, kr.describe_record(record)

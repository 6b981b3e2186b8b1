"""lab/profile/sparse_trace.py instruments a copy of submission.py by exact-text insertions: every
marker must still be found once in today's sparse kernel, and the instrumented kernel must compile
for sm_90 (ahead of time, on the CPU) with every clock in its PTX, so the probe works when a device
run needs it."""
import json
import os
from pathlib import Path

import pytest
import torch

import submission
from lab.profile import sparse_trace
from tools import kernel_report as kr

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_every_marker_applies_to_submission():
    source = sparse_trace.instrumented_source(str(REPO_ROOT / "submission.py"))
    compile(source, "traced_submission.py", "exec")
    # per partition a stamp before and after its outer loop, a clock there too, and its phases' clocks in a
    # tile (warpgroup 0: 7 bounds and the P.V span's end; warpgroup 1: 4; the producer: 1 a tile, 3 a half, 1)
    assert source.count("%globaltimer") == 6 and source.count("%clock64") == 3 * 2 + 8 + 4 + 5
    assert "TRACE_BUFFER = None" in source
    # TRACE reaches the Hopper kernel (signature dict and launch) and its three partitions, not the portable one
    assert '"TRACE": "*i64",' in source and "(*tensors, TRACE_BUFFER)" in source
    assert source.count(", TRACE):\n") == 3 and source.count("TRACE))") == 3
    assert source.count("g.to(gl.int64)") == 3  # each record's tiles: the program's tile count


def test_a_marker_that_moved_fails_loudly(monkeypatch):
    marker, text = sparse_trace.INSERTIONS[-1]
    monkeypatch.setattr(sparse_trace, "INSERTIONS", [(marker + "# moved", text)])
    with pytest.raises(AssertionError, match="marker found 0 times"):
        sparse_trace.instrumented_source(str(REPO_ROOT / "submission.py"))


@pytest.mark.skipif(not submission.HAVE_GLUON, reason="no Gluon in this Triton")
def test_instrumented_sparse_kernel_compiles_for_sm90_with_its_clocks(tmp_path, monkeypatch):
    # the compile workers import the traced copy from tmp_path; its `from task import ...` needs the repo
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    path = tmp_path / "traced_submission.py"
    path.write_text(sparse_trace.instrumented_source(str(REPO_ROOT / "submission.py")))
    row = next(r for r in submission.SERVING_ROUTE_TABLE if r["route"] == "hopper_sparse")
    tables = tmp_path / "tables.py"  # the Hopper sparse row alone
    tables.write_text(f"SERVING_ROUTE_TABLE = [{row!r}]\n")
    out, dump = tmp_path / "report.json", tmp_path / "asm"
    kr.main(["--module", str(path), "--tables", str(tables), "--targets", "sm90", "--json", str(out),
             "--dump", str(dump)])
    records = [r for r in json.loads(out.read_text())["records"] if r["kernel"] == "_mla_sparse_hopper_kernel"]
    assert records
    for record in records:
        assert record["compiled"], kr.describe_record(record)
    dumped = list(dump.glob("_mla_sparse_hopper_kernel-*"))
    assert dumped
    for asm in dumped:
        # three partitions' stamps and clocks, the producer's per-half ones once a half (static_range)
        text, halves = asm.read_text(), row["params"]["block_n"] // 32
        assert text.count("globaltimer") >= 6 and text.count("clock64") >= 3 * 2 + 8 + 4 + 2 + 3 * halves, asm.name


def test_the_summary_gives_each_phase_a_tile():
    trace = torch.zeros(9, sparse_trace.SLOTS, dtype=torch.float64)
    # program 0: its loops 8 us at 2 cycles a ns (16,000 cycles), 4 tiles
    trace[0, :11] = torch.tensor([1000, 9000, 800, 4000, 1600, 0, 800, 4000, 16000, 0, 4], dtype=torch.float64)
    trace[1, :11] = torch.tensor([1000, 9000, 8000, 800, 4000, 0, 0, 0, 16000, 0, 4], dtype=torch.float64)
    trace[2, :11] = torch.tensor([900, 9500, 400, 8000, 6000, 0, 0, 0, 17200, 0, 4], dtype=torch.float64)
    trace[3, :2] = torch.tensor([2000, 2100], dtype=torch.float64)  # program 1 ran no tiles: left out
    per, span = sparse_trace.summarise(trace)
    assert span == 9500 - 900
    assert per[0]["loop"].tolist() == [2000.0]  # 8 us over 4 tiles
    assert per[0]["ready"].tolist() == [100.0] and per[0]["S"].tolist() == [500.0]  # 800, 4000 cycles over 4 tiles
    assert per[0]["other"].tolist() == [2000.0 - (800 + 4000 + 1600 + 800 + 4000) / 8]
    assert per[1]["p_ready"].tolist() == [1000.0] and per[1]["P.V"].tolist() == [500.0]
    assert per[2]["free"].tolist() == [1000.0] and per[2]["loop"].tolist() == [2150.0]

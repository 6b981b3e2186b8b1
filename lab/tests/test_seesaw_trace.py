"""lab/profile/seesaw_trace.py instruments a copy of submission.py by exact-text insertions: every
marker must still be found once in today's seesaw kernel, and the instrumented kernel
must compile for sm_90 (ahead of time, on the CPU) for both caches with every clock in its PTX, so the
probe works when a device run needs it."""
import json
import os
from pathlib import Path

import pytest
import torch

import submission
from lab.profile import seesaw_trace
from tools import kernel_report as kr

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_every_marker_applies_to_submission():
    source = seesaw_trace.instrumented_source(str(REPO_ROOT / "submission.py"))
    compile(source, "traced_submission.py", "exec")
    assert source.count("%globaltimer") == 2 and source.count("%clock64") == 16
    assert "TRACE_BUFFER = None" in source


def test_a_marker_that_moved_fails_loudly(monkeypatch):
    marker, text = seesaw_trace.INSERTIONS[-1]
    monkeypatch.setattr(seesaw_trace, "INSERTIONS", [(marker + "# moved", text)])
    with pytest.raises(AssertionError, match="marker found 0 times"):
        seesaw_trace.instrumented_source(str(REPO_ROOT / "submission.py"))


@pytest.mark.skipif(not submission.HAVE_GLUON, reason="no Gluon in this Triton")
@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_instrumented_seesaw_compiles_for_sm90_with_its_clocks(tmp_path, monkeypatch, kv):
    # the compile workers import the traced copy from tmp_path; its `from task import ...` needs the repo
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    path = tmp_path / "traced_submission.py"
    path.write_text(seesaw_trace.instrumented_source(str(REPO_ROOT / "submission.py")))
    row = next(r for r in submission.SERVING_ROUTE_TABLE if r["kv"] == kv and r["params"].get("seesaw"))
    tables = tmp_path / "tables.py"  # the seesaw row on pages of 64 only: compile the traced kernel alone
    tables.write_text(f"SERVING_ROUTE_TABLE = [{dict(row, pages=(64,))!r}]\n")
    out, dump = tmp_path / "report.json", tmp_path / "asm"
    kr.main(["--module", str(path), "--tables", str(tables), "--targets", "sm90", "--json", str(out),
             "--dump", str(dump)])
    records = [r for r in json.loads(out.read_text())["records"] if r["kernel"] == "_mla_decode_seesaw_kernel"]
    assert len(records) == 2  # causal off and on
    for record in records:
        assert record["compiled"], kr.describe_record(record)
    dumped = list(dump.glob("_mla_decode_seesaw_kernel-*"))  # one file: the causal variant's name is the same
    assert dumped
    for asm in dumped:
        text = asm.read_text()  # two compute warpgroups' clocks and stamps, and the loader's
        assert text.count("globaltimer") >= 4 and text.count("clock64") >= 28, asm.name


def test_the_summary_converts_cycles_to_time_per_segment_and_per_pair():
    trace = torch.zeros(6, seesaw_trace.SLOTS, dtype=torch.float64)
    # program 0, warpgroup 0: 10 us at 2 cycles a ns (20,000 cycles), 2 live segments, 8 pairs; the pair
    # loops 12,800 cycles, of which wait, S, max and P 5,200: P.V 7,600
    trace[0, :14] = torch.tensor([1000, 11000, 4000, 800, 1600, 400, 2400, 12800, 2000, 0, 20000, 2, 8, 2],
                                 dtype=torch.float64)
    trace[0, 14:] = torch.tensor([5000, 10000], dtype=torch.float64)  # the loader: half its time waiting
    trace[1, :14] = trace[0, :14]  # warpgroup 1, the same
    trace[2, :14] = torch.tensor([1500, 2500] + [0] * 8 + [2000, 1, 0, 0], dtype=torch.float64)  # ran, no work
    per, begin, end, last = seesaw_trace.summarise(trace)  # records 3-5 never ran
    assert (begin, end, last) == (1000, 11000, 1500)
    assert per["total"].tolist() == [10.0, 10.0]
    assert per["q"].tolist() == [1.0, 1.0]  # 4000 cycles = 2 us over 2 segments
    assert per["epilogue"].tolist() == [0.5, 0.5]
    assert per["S"].tolist() == [100.0, 100.0]  # 1600 cycles = 0.8 us over 8 pairs: 100 ns a pair
    assert per["P.V"].tolist() == [475.0, 475.0]  # 7,600 cycles = 3.8 us over 8 pairs
    assert per["other"].tolist() == [pytest.approx(10 - 9.4)] * 2  # q, loops, epilogue: 18,800 of 20,000 cycles
    assert per["loader free wait"].tolist() == [0.5]


def test_program_ends_are_fitted_over_their_segments():
    trace = torch.zeros(8, seesaw_trace.SLOTS, dtype=torch.float64)
    # records: start ns, end ns, live segments (slot 13); the first start at 1,000 ns; ends at
    # 30 us + 11 us a segment after it, one record 2 us late; one record that ran with no live segment
    for row, (segments, late) in enumerate([(1, 0), (2, 0), (3, 0), (3, 2), (5, 0)]):
        trace[row, 0], trace[row, 13] = 1000 + 100 * row, segments
        trace[row, 1] = 1000 + (30 + 11 * segments + late) * 1000
    trace[5, :2], trace[5, 13] = torch.tensor([900.0, 5000.0]), 0  # ran first, no live segment: not fitted
    by_count, slope, at_zero = seesaw_trace.ends_by_segments(trace)
    assert by_count == {1: pytest.approx(41.1), 2: pytest.approx(52.1), 3: pytest.approx(63.1), 5: pytest.approx(85.1)}
    assert slope == pytest.approx(11.0, abs=0.3) and at_zero == pytest.approx(30.5, abs=1.0)

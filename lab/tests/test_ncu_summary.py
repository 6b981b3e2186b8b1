"""lab/profile/ncu_summary.py on a small hand-made SASS page: it finds the main loop (not the later
spin loop or the out-of-line retry that jumps back into it), splits the samples by region and
counts the loop's instructions per pass."""
import csv

from lab.profile import ncu_summary

REASONS = ["stall_long_sb", "stall_barrier", "stall_selected"]
HEADER = ["Address", "Source", ncu_summary.SAMPLES, ncu_summary.EXECUTED] + REASONS + \
    [r + " (Not Issued)" for r in REASONS]


def _page(tmp_path, code):
    """code: (source, samples, executed, long_sb, barrier, selected) per instruction, 16 bytes apart."""
    path = tmp_path / "sass.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, quoting=csv.QUOTE_ALL)
        writer.writerow(["Kernel Name", "k"])
        writer.writerow(HEADER)
        for i, (source, samples, executed, *stalls) in enumerate(code):
            writer.writerow([hex(0x1000 + 16 * i), source, samples, executed] + stalls + [0, 0, 0])
    return path


def test_regions_loop_mix_and_stalls(tmp_path):
    prologue = [("LDG R1, [R2]", 10, 4, 10, 0, 0)] + [("IMAD R3, R3, R3, RZ", 0, 4, 0, 0, 0)] * 2
    loop = [("FMUL R4, R4, R4", 1, 12, 0, 0, 1)] * 300 + [("@P0 BRA 0x1030", 2, 12, 0, 0, 2)]  # back to row 3
    tail = [("BAR.SYNC 0x0", 5, 4, 0, 5, 0), ("@P1 BRA 0x2300", 0, 8, 0, 0, 0)]  # spin on itself
    retry = [("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4]", 0, 1, 0, 0, 0), ("BRA 0x1040", 0, 1, 0, 0, 0)]
    header, rows = ncu_summary.read_sass(_page(tmp_path, prologue + loop + tail + retry))
    assert len(rows) == 3 + 301 + 2 + 2
    assert rows[305][1] == "@P1 BRA 0x2300" and int(rows[305][0], 16) == 0x1000 + 16 * 305
    assert ncu_summary.backward_branches(rows) == [(3, 303), (304, 305), (4, 307)]
    assert ncu_summary.main_loop(rows) == (3, 303)
    assert ncu_summary.stall_counts(header, rows) == {"long_sb": 10, "barrier": 5, "selected": 302}
    text = ncu_summary.summarise(header, rows, top=3)
    total = 10 + 300 + 2 + 5
    assert f"{total} stall samples" in text
    assert f"    0-    3: {100 * 10 / total:5.1f}% of samples, 12 warp instructions" in text
    assert f"    3-  304: {100 * 302 / total:5.1f}% of samples, 3612 warp instructions" in text
    assert "main loop: 301 instructions per warp per pass; FMUL 300, BRA 1" in text

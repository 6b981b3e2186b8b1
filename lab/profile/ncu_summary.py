"""Summarises Nsight Compute's per-instruction SASS page (`ncu -i REPORT --page source --csv
--print-source sass`, as lab/profile/ncu_run.sh writes it): where the warps' stall samples fall.

    python3 lab/profile/ncu_summary.py ncu_4x1024_sass.csv [--top 25] [--split LINE,LINE,...]

Prints the samples by stall reason over the whole kernel; by region (before the main loop, the
main loop, after it: the main loop is the first-starting backward branch over 200 or more rows; or the
SASS line numbers given with --split); the loop's instruction mix per executed pass; and the
instructions with the most samples. Line numbers count SASS rows from 0.
"""
import argparse
import collections
import csv
import re

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_sass(path):
    """(header, rows): the csv's column names and one list per SASS instruction."""
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    start = next(i for i, row in enumerate(lines) if row and row[0] == "Address")
    return lines[start], [row for row in lines[start + 1:] if len(row) == len(lines[start])]


def backward_branches(rows):
    """(target row, branch row) of every branch to an earlier instruction."""
    address = {int(row[0], 16): i for i, row in enumerate(rows)}
    edges = []
    for i, row in enumerate(rows):
        match = re.search(r"\bBRA\s+(0x[0-9a-fA-F]+)", row[1])
        target = address.get(int(match.group(1), 16)) if match else None
        if target is not None and target < i:
            edges.append((target, i))
    return edges


def main_loop(rows, min_span=200):
    """(first, last) SASS row of the main loop: of the backward branches spanning at least
    min_span rows, the one whose target comes first (spin loops, and the out-of-line retry of an
    mbarrier wait that jumps back into the loop, come later in the code), or None."""
    edges = [e for e in backward_branches(rows) if e[1] - e[0] >= min_span]
    return min(edges) if edges else None


def stall_counts(header, rows):
    column = {name: i for i, name in enumerate(header)}
    reasons = [n for n in header if n.startswith("stall_") and "Not Issued" not in n]
    counts = collections.Counter()
    for row in rows:
        for name in reasons:
            counts[name[len("stall_"):]] += int(row[column[name]] or 0)
    return counts


def summarise(header, rows, top=25, splits=None):
    column = {name: i for i, name in enumerate(header)}
    samples = lambda row: int(row[column[SAMPLES]] or 0)  # noqa: E731
    executed = lambda row: int(row[column[EXECUTED]] or 0)  # noqa: E731
    total = sum(map(samples, rows)) or 1
    out = [f"{total} stall samples"]
    out += [f"  {name:20s} {n:7d} {100 * n / total:5.1f}%" for name, n in stall_counts(header, rows).most_common(10)]
    loop = main_loop(rows)
    edges = [0] + (splits if splits else ([loop[0], loop[1] + 1] if loop else [])) + [len(rows)]
    out.append(f"backward branches (target, branch): {backward_branches(rows)}")
    out.append("regions (SASS rows):" + ("" if splits else f" main loop {loop}"))
    for first, end in zip(edges, edges[1:], strict=False):
        part = rows[first:end]
        reasons = ", ".join(f"{k} {v}" for k, v in stall_counts(header, part).most_common(4))
        out.append(f"  {first:5d}-{end:5d}: {100 * sum(map(samples, part)) / total:5.1f}% of samples, "
                   f"{sum(map(executed, part))} warp instructions; {reasons}")
    if loop:
        body = rows[loop[0]:loop[1] + 1]
        passes = max(executed(rows[loop[1]]), 1)  # the back edge runs once per pass
        mix = collections.Counter()
        for row in body:
            opcode = re.sub(r"^@!?U?P\w+\s+", "", row[1].strip()).split()[0].split(".")[0]
            mix[opcode] += executed(row)
        out.append(f"main loop: {sum(mix.values()) / passes:.0f} instructions per warp per pass; "
                   + ", ".join(f"{op} {n / passes:.0f}" for op, n in mix.most_common(12)))
    out.append("most sampled instructions:")
    for i in sorted(range(len(rows)), key=lambda i: -samples(rows[i]))[:top]:
        reasons = stall_counts(header, [rows[i]]).most_common(2)
        out.append(f"  {i:5d} {100 * samples(rows[i]) / total:5.1f}% {rows[i][1].strip()[:64]:64s} {reasons}")
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--split", default="", help="comma list of SASS rows to cut regions at")
    args = parser.parse_args()
    header, rows = read_sass(args.csv)
    print(summarise(header, rows, args.top, [int(x) for x in args.split.split(",") if x] or None))


if __name__ == "__main__":
    main()

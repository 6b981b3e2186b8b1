#!/usr/bin/env python3
"""Freeze a race log into fixed route-table rows: no GPU, no inputs, only text.

    python tools/freeze_race_log.py LOG [--submission PATH] [--write]
    (tune.py --from-log LOG [--submission PATH] [--write] runs the same)

The race (submission.py, section "Candidate race") prints one row line per raced row on stderr:
    submission.py race <TABLE> bs=<B> kv=<K> #<h6>: <cell> | <cell> | ... -> <choice>[; <note>]
    cell:   [i] <median>/<mean>   (us)      or   [i] x <why>
    choice: [i]   or   catch-all
i is 1-based in race_candidates(row) of the raced row; #<h6> is submission.race_row_hash(row), so
the line names its row without naming its candidates. Other lines (detail lines
`submission.py race why ...`, check lines, any text around them) are skipped. LOG "-" is stdin.

Each line is frozen into a fixed row {max_batch: B, max_kv_len: K, route, params} (no
candidates: the next job races nothing for that shape) that replaces the raced row, found in
<TABLE> as the row with those bounds and candidates whose hash is <h6>. Not frozen, with a
message:
- a line whose row is no longer in the table (the hash matches no row of those bounds: the
  table changed since the race, or the log was frozen already);
- a line that was not measured: its chosen candidate was not timed (no process, budget), or it
  chose the catch-all while some candidate was not reached;
- a line that disagrees with itself (cut or edited).
A catch-all choice after every candidate failed freezes the catch-all row's route for the shape
(that is what the race ran) and says so. Several lines for one row: the last one wins. A frozen
route that is not portable (ROUTE_INFO "portable": False, the Hopper route) gets a portable row
after it for the same bounds: the line's fastest timed portable candidate, else the portable row
already there, else the raced row's own route when portable.

A cell whose median is `-` holds a mean only (a line converted from the format before medians:
docs/tuning.md).

Exit codes: 0 at least one line frozen (or already in the table); 2 no race line, none that
could be frozen, or a bad argument.
"""
import argparse
import math
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # run as a script: the repository's modules (eval, utils, tools)
    sys.path.insert(0, ROOT)

from tools import route_tables  # noqa: E402

EXIT_OK, EXIT_BAD = 0, 2
LINE_RE = re.compile(r"submission\.py race (?P<table>[A-Z][A-Z0-9_]*_TABLE) bs=(?P<batch>\d+) kv=(?P<kv_len>\d+)"
                     r"(?: #(?P<hash>[0-9a-f]{6}))?(?P<old> \(us median/mean\))?: ")
TIMED_RE = re.compile(r"\[(?P<index>\d+)\] (?P<median>-|\d+(?:\.\d+)?)/(?P<mean>\d+(?:\.\d+)?)")
FAILED_RE = re.compile(r"\[(?P<index>\d+)\] x (?P<why>.+)")
CHOICE_RE = re.compile(r"(?:\[(?P<index>\d+)\]|(?P<catch_all>catch-all))(?:; (?P<note>.*))?")
NOT_MEASURED_WHYS = ("not reached", "not measured", "cut")  # a candidate the race did not try to the end


# ---------------------------------------------------------------------------------------------
# Parsing


def parse_line(text):
    """The row line found anywhere in `text` (one line of a log; a prefix such as a timestamp and
    surrounding spaces are ignored) as a dict: table, batch, kv_len, hash, cells [{index, median
    (None when not recorded), mean, why}] (median and mean None for a failed cell, why None for a
    timed one), choice (1-based index or "catch-all"), note (or None), line (the row line
    itself). None for a text without a row line head; ValueError for one that does not parse."""
    head = LINE_RE.search(text)
    if head is None:
        return None
    if head["hash"] is None:
        raise ValueError("a race line of an older format (no '#<row hash>'): convert it (docs/tuning.md) "
                         "or race again")
    body = text[head.end():].strip()
    cells_text, choice = None, None
    start = 0
    while True:  # the first " -> " followed by a well-formed choice ends the cells
        at = body.find(" -> ", start)
        if at < 0:
            raise ValueError("no ' -> <choice>' at the end of the line (cut?)")
        choice = CHOICE_RE.fullmatch(body[at + 4:])
        if choice is not None:
            cells_text = body[:at]
            break
        start = at + 1
    cells = [_parse_cell(cell, i) for i, cell in enumerate(cells_text.split(" | "), 1)]
    parsed = {"table": head["table"], "batch": int(head["batch"]), "kv_len": int(head["kv_len"]),
              "hash": head["hash"], "cells": cells,
              "choice": "catch-all" if choice["catch_all"] else int(choice["index"]),
              "note": choice["note"], "line": text[head.start():].strip()}
    _check_choice(parsed)
    return parsed


def _parse_cell(text, position):
    timed = TIMED_RE.fullmatch(text)
    failed = None if timed else FAILED_RE.fullmatch(text)
    match = timed or failed
    if match is None:
        raise ValueError(f"cell {position} is neither '[i] median/mean' nor '[i] x why': {text[:60]!r}")
    if int(match["index"]) != position:
        raise ValueError(f"cell {position} is numbered [{match['index']}]")
    if failed:
        return {"index": position, "median": None, "mean": None, "why": failed["why"].strip()}
    median = None if timed["median"] == "-" else float(timed["median"])
    mean = float(timed["mean"])
    if not all(v is None or (math.isfinite(v) and v >= 0) for v in (median, mean)):
        raise ValueError(f"cell {position}: {text!r} is not a time in us")
    return {"index": position, "median": median, "mean": mean, "why": None}


def _check_choice(parsed):
    """A numbered choice names a cell; catch-all only when no cell was timed (a line that disagrees
    with itself was cut or edited)."""
    choice, cells = parsed["choice"], parsed["cells"]
    if choice == "catch-all":
        timed = [c["index"] for c in cells if c["why"] is None]
        if timed:
            raise ValueError(f"catch-all chosen although [{timed[0]}] was timed")
    elif not 1 <= choice <= len(cells):
        raise ValueError(f"choice [{choice}] is not among the {len(cells)} cells")


def unmeasured(parsed):
    """Why the line is no measurement to freeze, or None: the chosen cell was not timed, or the
    catch-all was chosen while some candidate was not tried to the end."""
    if parsed["choice"] == "catch-all":
        open_cells = [c for c in parsed["cells"] if c["why"].startswith(NOT_MEASURED_WHYS)]
        if open_cells:
            return (f"catch-all chosen while [{open_cells[0]['index']}] was {open_cells[0]['why']}: "
                    "not every candidate was measured")
        return None
    cell = parsed["cells"][parsed["choice"] - 1]
    if cell["why"] is not None:
        return f"the chosen [{cell['index']}] was not timed ({cell['why']})"
    return None


def read_lines(text, warn):
    """[(line number, parsed)] of every row line of a log; a line with a row line head that does
    not parse is reported through `warn` and skipped."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            parsed = parse_line(line)
        except ValueError as exc:
            warn(f"line {number}: not read: {exc}")
            continue
        if parsed is not None:
            found.append((number, parsed))
    return found


# ---------------------------------------------------------------------------------------------
# Freezing


def raced_row(rows, parsed, row_hash):
    """Index of the row the line raced: the first row of `rows` with the line's bounds and
    candidates whose row_hash is the line's; None when there is none."""
    for i, row in enumerate(rows):
        if ((row["max_batch"], row["max_kv_len"]) == (parsed["batch"], parsed["kv_len"]) and row.get("candidates")
                and row_hash(row) == parsed["hash"]):
            return i
    return None


def fastest_portable(candidates, cells, portable):
    """The timed portable candidate of least median (mean where no median was recorded), or None."""
    timed = [(c["median"] if c["median"] is not None else c["mean"], i) for i, c in enumerate(cells)
             if c["why"] is None and portable(candidates[i]["route"])]
    return candidates[min(timed)[1]] if timed else None


def freeze(tables, found, row_hash, portable):
    """(new tables, report lines) for the parsed row lines `found` ([(line number, parsed)]):
    every line checked against `tables` as given (the row it raced must be there), the last
    line of each raced row frozen. `tables` is not modified."""
    new_tables = {name: [dict(r) for r in rows] for name, rows in tables.items()}
    reports, last = [], {}
    for number, parsed in found:
        where = f"line {number}: {parsed['table']} bs={parsed['batch']} kv={parsed['kv_len']} #{parsed['hash']}"
        rows = tables.get(parsed["table"])
        if rows is None:
            reports.append(f"{where}: NOT FROZEN: the submission has no {parsed['table']}")
            continue
        index = raced_row(rows, parsed, row_hash)
        if index is None:
            reports.append(f"{where}: NOT FROZEN: no row of {parsed['table']} with these bounds is #{parsed['hash']} "
                           "(the table changed since the race, or the log was frozen already)")
            continue
        candidates = route_tables.row_candidates(rows[index])
        if len(candidates) != len(parsed["cells"]):
            reports.append(f"{where}: NOT FROZEN: {len(parsed['cells'])} cells for the row's {len(candidates)} "
                           "candidates (the line was cut or edited)")
            continue
        why = unmeasured(parsed)
        if why:
            reports.append(f"{where}: NOT FROZEN: {why}")
            continue
        key = (parsed["table"], index)
        if key in last:
            reports.append(f"line {last[key][0]}: superseded by line {number} (the last line of a row wins)")
        last[key] = (number, parsed, where)
    # rows are placed from the last index up, so that a row inserted or removed after one row
    # leaves the indices of the rows above it as they were; reported in table order
    frozen = {}
    for (name, index), (_number, parsed, where) in sorted(last.items(), key=lambda item: (item[0][0], -item[0][1])):
        rows = tables[name]
        candidates = route_tables.row_candidates(rows[index])
        if parsed["choice"] == "catch-all":
            chosen, how = route_tables.row_candidates(rows[-1])[0], "the catch-all's route (every candidate failed)"
        else:
            chosen, how = candidates[parsed["choice"] - 1], f"[{parsed['choice']}]"
        fixed = route_tables.table_row(chosen["route"], chosen["params"], parsed["batch"], parsed["kv_len"])
        follower = None if portable(chosen["route"]) else fastest_portable(candidates, parsed["cells"], portable)
        new_tables[name], after = route_tables.place_row(new_tables[name], index, fixed, portable, follower)
        cell = None if parsed["choice"] == "catch-all" else parsed["cells"][parsed["choice"] - 1]
        timing = "" if cell is None else f" {_time(cell)}"
        if cell is not None and parsed["choice"] != 1 and parsed["cells"][0]["why"] is None:
            timing += f" vs [1] {_time(parsed['cells'][0])}"
        timed = sum(c["why"] is None for c in parsed["cells"])
        text = (f"{where}: frozen {how} {route_tables.label(chosen)}{timing} ({timed} of {len(candidates)} timed) "
                f"into row {index + 1}")
        if after == "none":
            text += "; NOTE: no portable row follows it (nothing portable was timed)"
        elif after:
            text += f"; {after}"
        if parsed["note"]:
            text += f"; race note: {parsed['note']}"
        frozen[(name, index)] = text
    return new_tables, reports + [frozen[key] for key in sorted(frozen)]


def _time(cell):
    median = "-" if cell["median"] is None else f"{cell['median']:.1f}"
    return f"{median}/{cell['mean']:.1f} us (median/mean)"


# ---------------------------------------------------------------------------------------------
# Command line


def load_submission(path):
    """The submission at `path` as a module (its race_row_hash names rows as its race did)."""
    import eval as runner  # the project's loader (prepares the environment as eval.py does)

    return runner.load_submission(path, "_freeze_submission")


def run(log_path, submission_path, write=False, out=print, err=None):
    """Freeze the log at `log_path` ("-": stdin) into the tables of the submission at
    `submission_path`; print a report line per row line and the changed tables; with `write`,
    write them (route_tables.write_tables: compiled, imported and routed before the file is
    replaced). Returns the exit code."""
    err = err or (lambda text: print(text, file=sys.stderr, flush=True))
    try:
        if log_path == "-":
            log_text = sys.stdin.read()
        else:
            with open(log_path, encoding="utf-8", errors="replace") as f:
                log_text = f.read()
        with open(submission_path, encoding="utf-8") as f:
            sub_text = f.read()
    except OSError as exc:
        err(f"freeze_race_log: {exc}")
        return EXIT_BAD
    found = read_lines(log_text, lambda text: err(f"freeze_race_log: {text}"))
    if not found:
        err(f"freeze_race_log: no race row line ('submission.py race TABLE bs=B kv=K #hash: [1] median/mean | ..."
            f" -> [i]') in {log_path}: nothing to freeze")
        return EXIT_BAD
    try:
        tables = route_tables.read_tables(sub_text)
        sub = load_submission(submission_path)
    except route_tables.RouteTableError as exc:
        err(f"freeze_race_log: {exc}")
        return EXIT_BAD
    info = getattr(sub, "ROUTE_INFO", {})
    new_tables, reports = freeze(tables, found, sub.race_row_hash,
                                 lambda route: info.get(route, {}).get("portable", True))
    for line in reports:
        out(line)
    changed = {name: rows for name, rows in new_tables.items() if rows != tables[name]}
    if not any(": frozen " in line for line in reports):
        err(f"freeze_race_log: no line of {log_path} could be frozen into {submission_path}: nothing written")
        return EXIT_BAD
    for name, rows in changed.items():
        out(f"\n{route_tables.format_table(name, rows)}")
    if not changed:
        out("\nthe tables already hold these rows: nothing to change")
    elif write:
        shapes = {name: [(r["max_batch"], r["max_kv_len"]) for r in rows if not route_tables.is_catch_all(r)]
                  for name, rows in changed.items()}
        try:
            route_tables.write_tables(submission_path, changed, shapes)
        except route_tables.RouteTableError as exc:
            err(f"freeze_race_log: not written: {exc}")
            return EXIT_BAD
        out(f"written into {submission_path} (only {', '.join(changed)} between the markers changed)")
    else:
        out("(not written: add --write)")
    return EXIT_OK


def main(argv=None):
    parser = argparse.ArgumentParser(prog="freeze_race_log.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", help="the race log (stderr of a run of submission.py; '-': stdin)")
    parser.add_argument("--submission", default=os.path.join(ROOT, "submission.py"))
    parser.add_argument("--write", action="store_true", help="write the frozen rows into the submission")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_OK if exc.code == 0 else EXIT_BAD
    return run(args.log, args.submission, write=args.write)


if __name__ == "__main__":
    sys.exit(main())

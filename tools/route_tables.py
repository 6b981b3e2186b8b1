"""Reading and rewriting the route-table literals of submission.py.

The tables are plain Python literals between the lines `# BEGIN ROUTE TABLES` and
`# END ROUTE TABLES` (submission.py, section "Route tables"): read here with ast.literal_eval
(no import, no torch), and rewritten one literal at a time, every other character of the file
unchanged. Used by tune.py (writing a tuned table) and tools/freeze_race_log.py (freezing a race
log into fixed rows).

A row is {"max_batch", "max_kv_len", "route", "params"[, "candidates"]}; a candidate is
{"route", "params"}. Other keys are refused (they would be lost by the writer).

write_tables checks the new text before it replaces the file (atomically, temp file + rename):
it compiles, imports as a module holding exactly the rows written, the other literals are
unchanged, each shape named routes to its own row, and a catch-all ends each table.
"""
import ast
import importlib.util
import inspect
import itertools
import json
import math
import os
import re
import sys

BEGIN_MARKER, END_MARKER = "# BEGIN ROUTE TABLES", "# END ROUTE TABLES"
TABLE_NAMES = ("AITER_ROUTE_TABLE", "TRITON_ROUTE_TABLE")
ROW_KEYS = ("max_batch", "max_kv_len", "route", "params", "candidates")
CANDIDATE_KEYS = ("route", "params")
WIDTH = 100  # the writer's line width (one long parameter alone may exceed it)


class RouteTableError(Exception):
    """A table that cannot be read or written (the file is left untouched)."""


def table_row(route, params, max_batch=None, max_kv_len=None, candidates=None):
    row = {"max_batch": max_batch, "max_kv_len": max_kv_len, "route": route, "params": dict(params)}
    if candidates is not None:
        row["candidates"] = [{"route": c["route"], "params": dict(c["params"])} for c in candidates]
    return row


def label(candidate):
    """A configuration ({"route", "params"}) as submission.route_label names it: '<route> <params
    as compact JSON>' (the tools read the file as text, without importing it; a test holds the two
    equal)."""
    return f'{candidate["route"]} {json.dumps(candidate["params"], separators=(",", ":"))}'


def row_candidates(row):
    """The row's race entrants in order, its own route and params first (as
    submission.race_candidates lists them)."""
    return [{"route": row["route"], "params": row["params"]}, *row.get("candidates", ())]


def matches(row, batch, kv_len):
    """The row's bounds hold for the shape (None: no bound), as select_route reads them."""
    return ((row["max_batch"] is None or batch <= row["max_batch"])
            and (row["max_kv_len"] is None or kv_len <= row["max_kv_len"]))


def is_catch_all(row):
    return row["max_batch"] is None and row["max_kv_len"] is None


def place_row(rows, index, row, portable, follower=None):
    """(rows with rows[index] replaced by `row`, what happened to the row after it). A route that
    is not portable needs a portable row with the same bounds right after it: `follower` ({route,
    params}) replaces the portable row there or is inserted; without one, a portable row already
    there stays ("kept"), else nothing follows ("none"). A portable `row` of page size 1 always
    holds: portable rows with its bounds right after it could never be selected, and go."""
    rows = [dict(r) for r in rows]
    rows[index] = row
    bounds = (row["max_batch"], row["max_kv_len"])
    after = index + 1

    def same_bounds(i):
        return i < len(rows) and (rows[i]["max_batch"], rows[i]["max_kv_len"]) == bounds

    if not portable(row["route"]):
        follows = same_bounds(after) and portable(rows[after]["route"])
        if follower is not None:
            new = table_row(follower["route"], follower["params"], *bounds)
            if follows:
                rows[after] = new
            else:
                rows.insert(after, new)
            return rows, f"portable row after it: {label(follower)}"
        return rows, "portable row after it kept" if follows else "none"
    removed = 0
    if row["params"].get("page_size", 1) == 1:
        while same_bounds(after) and portable(rows[after]["route"]):
            del rows[after]
            removed += 1
    return rows, f"{removed} shadowed row(s) with the same bounds removed" if removed else ""


# ---------------------------------------------------------------------------------------------
# Reading


def block_span(text):
    """(start, end) character offsets of the text strictly between the marker lines."""
    begin = re.search(rf"^{re.escape(BEGIN_MARKER)}[ \t]*\n", text, re.M)
    end = re.search(rf"^{re.escape(END_MARKER)}[ \t]*$", text, re.M)
    if not begin or not end or end.start() < begin.end():
        raise RouteTableError(f"route-table markers '{BEGIN_MARKER}' / '{END_MARKER}' not found")
    return begin.end(), end.start()


def _assignment_spans(block):
    """{name: (start, end)} offsets in `block` of each top-level `NAME = literal` statement."""
    try:
        tree = ast.parse(block)
    except SyntaxError as exc:
        raise RouteTableError(f"the route-table block does not parse: {exc}") from exc
    line_starts = [0]
    for line in block.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))

    def offset(lineno, col):  # ast columns are UTF-8 byte offsets
        line_start = line_starts[lineno - 1]
        line = block[line_start:line_starts[lineno]]
        return line_start + len(line.encode()[:col].decode())

    spans = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            spans[node.targets[0].id] = (offset(node.lineno, node.col_offset),
                                         offset(node.end_lineno, node.end_col_offset))
    return spans


def read_tables(text):
    """{name: rows} of the literals between the markers."""
    start, end = block_span(text)
    block = text[start:end]
    tables = {}
    for name, (a, b) in _assignment_spans(block).items():
        try:
            tables[name] = ast.literal_eval(block[a:b].split("=", 1)[1].strip())
        except ValueError as exc:
            raise RouteTableError(f"{name} is not a plain literal: {exc}") from exc
    return tables


def read_tables_file(path):
    try:
        with open(path, encoding="utf-8") as f:
            return read_tables(f.read())
    except OSError as exc:
        raise RouteTableError(f"cannot read {path}: {exc}") from exc


# ---------------------------------------------------------------------------------------------
# Formatting


def _py_literal(value):
    if isinstance(value, str):
        return json.dumps(value)
    if value is None or isinstance(value, (bool, int)):
        return repr(value)
    if isinstance(value, float) and math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_py_literal(k)}: {_py_literal(v)}" for k, v in value.items()) + "}"
    raise RouteTableError(f"cannot write {value!r} into a route table")


def _check_keys(item, allowed, what):
    """A row or candidate key the writer does not know would be silently lost: refuse it."""
    unknown = [k for k in item if k not in allowed]
    if unknown:
        raise RouteTableError(f"cannot write the {what} key(s) {', '.join(map(repr, unknown))} into a route table")


def format_table(name, rows, width=WIDTH):
    """`NAME = [` + one row per line (params on a continuation line when long; a row's "candidates"
    one per line below it) + `]`. Every line is at most `width` characters unless one parameter
    alone is longer."""
    lines = [f"{name} = ["]
    for row in rows:
        lines += _row_lines(row, width)
    lines.append("]")
    return "\n".join(lines)


def _row_lines(row, width):
    """The lines of one row: its head and params, then its candidates (if any), each on its own
    line(s) indented under the row, so that a race's entrants read as a list."""
    if not isinstance(row, dict):
        raise RouteTableError(f"a row must be a dict, not {row!r}")
    _check_keys(row, ROW_KEYS, "row")
    head = (f'    {{"max_batch": {_py_literal(row["max_batch"])}, "max_kv_len": '
            f'{_py_literal(row["max_kv_len"])}, "route": {_py_literal(row["route"])},')
    candidates = row.get("candidates")
    if candidates is None:
        return _with_params(head, row["params"], 5, "},", width)
    if not isinstance(candidates, list):
        raise RouteTableError(f"a row's candidates must be a list, not {candidates!r}")
    if not candidates:
        return _with_params(head, row["params"], 5, ",", width) + ['     "candidates": []},']
    lines = _with_params(head, row["params"], 5, ",", width) + ['     "candidates": [']
    for candidate in candidates:
        if not isinstance(candidate, dict):
            raise RouteTableError(f"a candidate must be a dict {{'route', 'params'}}, not {candidate!r}")
        _check_keys(candidate, CANDIDATE_KEYS, "candidate")
        lines += _with_params(f'         {{"route": {_py_literal(candidate["route"])},', candidate["params"],
                              10, "},", width)
    return lines + ["     ]},"]


def _with_params(head, params, indent, close, width):
    """`head "params": {...}close` on one line when it fits in `width`, else `head` alone and the
    params wrapped below it at `indent` spaces."""
    line = f'{head} "params": {_py_literal(params)}{close}'
    if len(line) <= width:
        return [line]
    return [head] + _wrapped_params(params, width, indent, close)


def _wrapped_params(params, width, indent, close):
    """`"params": {...}` + close as continuation lines of at most `width` characters (items wrap,
    aligned under the first item). Only called for params too long for one line: never empty."""
    lines, line = [], " " * indent + '"params": {'
    items = [f"{_py_literal(k)}: {_py_literal(v)}" for k, v in params.items()]
    for i, item in enumerate(items):
        item += "," if i < len(items) - 1 else "}" + close
        if line.endswith("{") or len(f"{line} {item}") <= width:
            line = line + item if line.endswith("{") else f"{line} {item}"
        else:
            lines.append(line)
            line = " " * (indent + len('"params": {')) + item
    return lines + [line]


def replace_table_text(text, name, rows):
    """The file text with the literal of `name` (between the markers) replaced by `rows`; every
    other character is unchanged."""
    start, end = block_span(text)
    block = text[start:end]
    spans = _assignment_spans(block)
    if name not in spans:
        raise RouteTableError(f"{name} is not assigned between the route-table markers")
    a, b = spans[name]
    literal = format_table(name, rows)
    if ast.literal_eval(literal.split("=", 1)[1].strip()) != rows:
        raise RouteTableError("the formatted table does not read back as the rows")
    return text[:start + a] + literal + text[start + b:]


# ---------------------------------------------------------------------------------------------
# Writing (checked)

_serial = itertools.count()


def _one_line(text, limit=300):
    return " | ".join(line.strip() for line in str(text).strip().splitlines() if line.strip())[:limit]


def check_routing(module, name, rows, shapes):
    """Every shape in `shapes` must select its own row (the first row with its bounds that runs
    here) and anything else must find the catch-all. A shape none of whose rows runs here (a
    Hopper row alone, off sm_90) only has to route somewhere."""
    table = getattr(module, name)
    if table != rows:
        raise RouteTableError(f"the new module's {name} differs from the rows written")
    select = getattr(module, "select_route", None)
    if not callable(select) or "table" not in inspect.signature(select).parameters:
        return
    runs_here = getattr(module, "row_preconditions_hold", lambda row, kv_len, uniform: True)
    for batch, kv_len in shapes:
        own = next((r for r in rows if (r["max_batch"], r["max_kv_len"]) == (batch, kv_len)
                    and runs_here(r, kv_len, True)), None)
        got = select(batch, kv_len, True, table=table)
        if own is not None and got != own:
            raise RouteTableError(f"{name}: bs={batch} kv={kv_len} selects {got}, not its own row {own}")
    for batch, kv_len in ((1, 1), (3, 1031), (10**6, 10**7)):
        select(batch, kv_len, False, table=table)  # raises without an always-valid catch-all


def new_text(old_text, tables):
    """The file text with every literal of `tables` ({name: rows}) replaced; RouteTableError when
    a table does not end with a catch-all, does not compile, or another literal would change."""
    text = old_text
    for name, rows in tables.items():
        if not rows or not is_catch_all(rows[-1]):
            raise RouteTableError(f"{name} must end with a catch-all row (max_batch and max_kv_len None)")
        text = replace_table_text(text, name, [dict(r) for r in rows])
    try:
        compile(text, "submission.py", "exec")
    except SyntaxError as exc:
        raise RouteTableError(f"the rewritten file does not compile: {exc}") from exc
    old_tables, new_tables = read_tables(old_text), read_tables(text)
    for other, literal in old_tables.items():
        if other not in tables and new_tables.get(other) != literal:
            raise RouteTableError(f"rewriting {', '.join(tables)} would change {other}")
    return text


def write_tables(path, tables, shapes=None):
    """Rewrite the literals of `tables` ({name: rows}) in the submission at `path` IN PLACE
    (nothing else touched), after checking that the new text compiles, imports as a module
    holding exactly these rows, and routes each shape of shapes[name] ([(batch, kv_len)]) to its
    own row. Atomic (temp file + rename). Returns the new text; RouteTableError (file untouched)
    on any problem."""
    shapes = shapes or {}
    with open(path, encoding="utf-8", newline="") as f:
        old_text = f.read()
    text = new_text(old_text, tables)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".route-tables-{os.getpid()}-{next(_serial)}.py")
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.chmod(tmp, os.stat(path).st_mode & 0o7777)
        spec = importlib.util.spec_from_file_location(f"_route_tables_check_{os.getpid()}_{next(_serial)}", tmp)
        module = importlib.util.module_from_spec(spec)
        added = directory not in sys.path
        if added:
            sys.path.append(directory)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise RouteTableError(f"the rewritten file does not import: {_one_line(exc)}") from exc
        finally:
            if added:
                sys.path.remove(directory)
        for name, rows in tables.items():
            try:
                check_routing(module, name, rows, shapes.get(name, ()))
            except RouteTableError:
                raise
            except Exception as exc:
                raise RouteTableError(f"the rewritten {name} does not route: {_one_line(exc)}") from exc
        with open(path, encoding="utf-8", newline="") as f:
            if f.read() != old_text:
                raise RouteTableError(f"{path} changed meanwhile; not overwritten (run again)")
        os.replace(tmp, path)
        tmp = None
    finally:
        if tmp and os.path.exists(tmp):
            os.remove(tmp)
    return text

"""tools/route_tables.py: reading the route-table literals of submission.py as data, formatting
and rewriting them (only the named literal changes; the new file is compiled, imported and routed
before it replaces the old, atomically), and placing a row with its portable follower.

Rewrites are only ever done on a COPY of submission.py in tmp_path (the `sub_copy` fixture: a
write aimed at the real file fails the test).
"""
import importlib.util

import pytest

from tools import route_tables as rt

A8W8_32 = {"page_size": 1, "num_splits": 32, "q_scale": "tensor"}
LONG = {"num_splits": 16, "block_n": 64, "num_warps": 8, "num_stages": 3}


def _row(batch, kv_len, route, params=None, **extra):
    return dict(rt.table_row(route, params or {}, batch, kv_len), **extra)


def _portable(route):
    return route != "hopper_fp8"


def _outside(text, name):
    start, end = rt.block_span(text)
    a, b = rt._assignment_spans(text[start:end])[name]
    return text[:start + a], text[start + b:]


def test_the_real_tables_read_as_data_and_keep_their_structure(repo_root):
    """Both tables: a catch-all last; after each non-portable row a portable row for its bounds."""
    import submission

    tables = rt.read_tables((repo_root / "submission.py").read_text())
    assert set(tables) == set(rt.TABLE_NAMES)
    info = submission.ROUTE_INFO
    assert info["hopper_fp8"]["portable"] is False
    for name, rows in tables.items():
        assert rt.is_catch_all(rows[-1]) and not rows[-1].get("candidates"), name
        for i, row in enumerate(rows):
            assert set(row) <= set(rt.ROW_KEYS), row
            if not info[row["route"]].get("portable", True):
                after = rows[i + 1]
                assert (after["max_batch"], after["max_kv_len"]) == (row["max_batch"], row["max_kv_len"])
                assert info[after["route"]].get("portable", True)


def test_the_tools_name_a_configuration_as_submission_does(repo_root):
    import submission

    for rows in rt.read_tables((repo_root / "submission.py").read_text()).values():
        for row in rows:
            for candidate in rt.row_candidates(row):
                assert rt.label(candidate) == submission.route_label(candidate)
    assert rt.label({"route": "r", "params": {"b": 1, "a": "x"}}) == 'r {"b":1,"a":"x"}'


def test_rows_with_candidates_round_trip_within_120_characters(sub_copy):
    rows = [
        _row(4, 1024, "triton_fp8", {"num_splits": 8},
             candidates=[{"route": "triton_fp8", "params": LONG}, {"route": "triton_mxfp4", "params": {}},
                         {"route": "aiter_a8w8_persistent", "params": {"page_size": 1, "num_splits": 8,
                                                                       "q_scale": "unit"}}]),
        _row(32, 8192, "triton_fp8", LONG, candidates=[{"route": "triton_fp8", "params": {"num_splits": 2}}]),
        _row(64, 8192, "triton_fp8", {}, candidates=[]),
        _row(None, None, "triton_fp8"),
    ]
    new = rt.replace_table_text(sub_copy.read_text(), "TRITON_ROUTE_TABLE", rows)
    assert rt.read_tables(new)["TRITON_ROUTE_TABLE"] == rows
    literal = rt.format_table("TRITON_ROUTE_TABLE", rows)
    assert max(len(line) for line in literal.splitlines()) <= 120
    assert '         {"route": "triton_mxfp4", "params": {}},' in literal.splitlines()  # one per line
    rt.write_tables(str(sub_copy), {"TRITON_ROUTE_TABLE": rows}, {"TRITON_ROUTE_TABLE": [(4, 1024), (32, 8192)]})
    assert rt.read_tables(sub_copy.read_text())["TRITON_ROUTE_TABLE"] == rows


def test_rows_without_candidates_format_on_one_line_or_two():
    rows = [_row(4, 1024, "aiter_bf16"), _row(None, None, "aiter_a8w8_persistent", A8W8_32)]
    assert rt.format_table("T", rows) == (
        'T = [\n'
        '    {"max_batch": 4, "max_kv_len": 1024, "route": "aiter_bf16", "params": {}},\n'
        '    {"max_batch": None, "max_kv_len": None, "route": "aiter_a8w8_persistent",\n'
        '     "params": {"page_size": 1, "num_splits": 32, "q_scale": "tensor"}},\n'
        ']')


@pytest.mark.parametrize("row", [
    _row(None, None, "triton_fp8", note="x"),
    _row(None, None, "triton_fp8", candidates=[{"route": "triton_fp8", "params": {}, "why": 1}]),
])
def test_unknown_keys_are_refused_not_lost(row):
    with pytest.raises(rt.RouteTableError, match="cannot write the"):
        rt.format_table("T", [row])


def test_a_rewrite_changes_only_the_named_literal(sub_copy):
    old = sub_copy.read_text()
    rows = [_row(4, 1024, "triton_fp8"), _row(32, 8192, "triton_fp8"), _row(None, None, "triton_fp8")]
    new = rt.write_tables(str(sub_copy), {"TRITON_ROUTE_TABLE": rows}, {"TRITON_ROUTE_TABLE": [(4, 1024)]})
    assert sub_copy.read_text() == new != old
    assert _outside(new, "TRITON_ROUTE_TABLE") == _outside(old, "TRITON_ROUTE_TABLE")
    assert rt.read_tables(new)["AITER_ROUTE_TABLE"] == rt.read_tables(old)["AITER_ROUTE_TABLE"]
    start, end = rt.block_span(old)
    a, b = rt._assignment_spans(old[start:end])["AITER_ROUTE_TABLE"]
    assert old[start + a:start + b] in new  # byte-identical
    spec = importlib.util.spec_from_file_location("_route_tables_written", sub_copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.TRITON_ROUTE_TABLE == rows
    assert not list(sub_copy.parent.glob(".route-tables-*"))  # no temp file left


@pytest.mark.parametrize("rows, match", [
    ([_row(4, 1024, "triton_fp8")], "catch-all"),
    ([_row(None, None, "triton_fp8", {"page_size": 8})], "no route-table row"),
    ([_row(None, None, "triton_fp8", {"x": float("nan")})], "cannot write"),
    ([_row(64, 8192, "triton_fp8"), _row(4, 1024, "triton_fp8", {"num_splits": 8}),
      _row(None, None, "triton_fp8")], "not its own row"),
])
def test_a_bad_table_is_refused_and_the_file_left(sub_copy, rows, match):
    old = sub_copy.read_bytes()
    with pytest.raises(rt.RouteTableError, match=match):
        rt.write_tables(str(sub_copy), {"TRITON_ROUTE_TABLE": rows}, {"TRITON_ROUTE_TABLE": [(4, 1024)]})
    assert sub_copy.read_bytes() == old
    assert not list(sub_copy.parent.glob(".route-tables-*"))


def test_a_lone_non_portable_row_only_has_to_route_somewhere(sub_copy):
    """Off sm_90 a Hopper row's shape falls through to the next matching row."""
    rows = [_row(4, 1024, "hopper_fp8", {"num_splits": 8}), _row(None, None, "triton_fp8")]
    rt.write_tables(str(sub_copy), {"TRITON_ROUTE_TABLE": rows}, {"TRITON_ROUTE_TABLE": [(4, 1024)]})
    assert rt.read_tables(sub_copy.read_text())["TRITON_ROUTE_TABLE"] == rows


HOPPER = _row(4, 1024, "hopper_fp8", {"num_splits": 16}, candidates=[{"route": "triton_fp8", "params": {}}])
FOLLOWER = _row(4, 1024, "triton_fp8", {"num_splits": 8})
CATCH_ALL = _row(None, None, "triton_fp8")


def test_a_non_portable_row_gets_its_follower_replaced_kept_or_inserted():
    fixed = _row(4, 1024, "hopper_fp8", {"num_splits": 32})
    better = {"route": "triton_fp8", "params": {"num_splits": 4}}
    rows, what = rt.place_row([HOPPER, FOLLOWER, CATCH_ALL], 0, fixed, _portable, better)
    assert rows == [fixed, _row(4, 1024, "triton_fp8", {"num_splits": 4}), CATCH_ALL] and "portable row" in what
    rows, what = rt.place_row([HOPPER, FOLLOWER, CATCH_ALL], 0, fixed, _portable)
    assert rows == [fixed, FOLLOWER, CATCH_ALL] and what == "portable row after it kept"
    rows, what = rt.place_row([HOPPER, CATCH_ALL], 0, fixed, _portable, better)
    assert rows == [fixed, _row(4, 1024, "triton_fp8", {"num_splits": 4}), CATCH_ALL]
    rows, what = rt.place_row([HOPPER, CATCH_ALL], 0, fixed, _portable)
    assert rows == [fixed, CATCH_ALL] and what == "none"


def test_a_portable_row_of_page_1_drops_the_rows_it_shadows():
    fixed = _row(4, 1024, "triton_fp8", {"num_splits": 2})
    rows, what = rt.place_row([HOPPER, FOLLOWER, CATCH_ALL], 0, fixed, _portable)
    assert rows == [fixed, CATCH_ALL] and "1 shadowed row" in what
    paged = _row(4, 1024, "aiter_a8w8_persistent", {"page_size": 8})  # skipped for ragged lengths: keep
    rows, what = rt.place_row([HOPPER, FOLLOWER, CATCH_ALL], 0, paged, _portable)
    assert rows == [paged, FOLLOWER, CATCH_ALL] and what == ""

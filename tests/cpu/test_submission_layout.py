"""submission.py reads top to bottom and a newcomer can find the product in it: banner sections in
a fixed order, none of which refers at import time to a name that a later section defines; the
module docstring is a map (the sections in order, both entry points, every kernel); the entry
points come first, typed; the serving route is chosen in one place; the Hopper kernels under their
own banners with no function over 24 parameters but a kernel entry (none over 40), no positional
runs of constants in a call and no probe-only parameters; no history ids or speed figures in the
comments (the serving route table's rows keep one short why each); sm_scale is handled one way (the
constant, checked)."""
import ast
import io
import re
import tokenize
from pathlib import Path

import pytest
import torch

import submission

SOURCE = Path(submission.__file__).read_text()
SECTIONS = (  # titles (their first words) in reading order: each part after what it depends on
    "Constants",
    "Entry points",
    "Input checks",
    "custom_kernel's route",
    "The serving API's route",
    "Host machinery",
    "Triton kernels and their routes",
    "The Hopper route",
    "aiter routes",
    "Route registry",
    "The serving API's plan and launches",
    "Candidate race",
)
HOPPER_PARTS = ("Hopper: shared helpers", "Hopper: the schedule", "Hopper: the tokens-as-M kernels",
                "Hopper: the seesaw kernel", "Hopper: the sparse form", "Hopper: the combine kernel",
                "Hopper: host side")
MAX_PARAMETERS = 24  # any function but a kernel entry
MAX_KERNEL_PARAMETERS = 40  # a kernel entry (a @jit function named *_kernel)
HISTORY = re.compile(r"NOTES\.md|\bh\d{1,3}[a-z]?\b|\bv\d-v\d\b")
SPEED = re.compile(r"\b\d+(?:\.\d+)?x (?:the|faster|slower|FlashMLA)|\b\d\.\d+x\b|\b\d+(?:\.\d+)? us\b")
RULE = "# " + "=" * 20


def banners(source):
    """[(line number, title)] of every banner: a rule line, a '# title' line, ... a rule line."""
    lines = source.splitlines()
    found, i = [], 0
    while i < len(lines) - 1:
        if lines[i].startswith(RULE) and lines[i + 1].startswith("# ") and not lines[i + 1].startswith(RULE):
            found.append((i + 1, lines[i + 1][2:].strip()))
            i += 2
            while i < len(lines) and not lines[i].startswith(RULE):
                i += 1
        i += 1
    return found


class _ImportTimeNames(ast.NodeVisitor):
    """Names a top-level statement loads while the module is imported: everything but the bodies of
    functions and lambdas (their decorators, defaults and annotations do count)."""

    def __init__(self):
        self.names = set()

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load):
            self.names.add(node.id)

    def visit_FunctionDef(self, node):
        for expr in [*node.decorator_list, *node.args.defaults, *node.args.kw_defaults, node.returns]:
            if expr is not None:
                self.visit(expr)
        for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, node.args.vararg, node.args.kwarg]:
            if arg is not None and arg.annotation is not None:
                self.visit(arg.annotation)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node):
        for expr in [*node.args.defaults, *node.args.kw_defaults]:
            if expr is not None:
                self.visit(expr)


def defined_names(stmt):
    """Names a top-level statement binds (assignments, defs, classes, imports, try/if branches)."""
    names = set()
    for node in ast.walk(stmt):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {stmt.name}  # not the names bound inside its body
    return names


def forward_references(source):
    """[(section, name, defining section)] for every import-time use of a name first defined in a
    later section."""
    starts = banners(source)
    section_of = lambda line: sum(1 for start, _ in starts if start <= line) - 1  # noqa: E731
    first_definition, uses = {}, []
    for stmt in ast.parse(source).body:
        section = section_of(stmt.lineno)
        for name in defined_names(stmt):
            first_definition.setdefault(name, section)
        visitor = _ImportTimeNames()
        visitor.visit(stmt)
        uses += [(section, name) for name in visitor.names]
    return [(starts[s][1], name, starts[first_definition[name]][1]) for s, name in uses
            if s >= 0 and first_definition.get(name, -1) > s]


def test_sections_come_in_reading_order():
    titles = [title for _, title in banners(SOURCE)]
    assert len(titles) == len(SECTIONS), titles
    for title, expected in zip(titles, SECTIONS, strict=True):
        assert title.startswith(expected), (title, expected)


def test_the_hopper_section_has_its_parts_in_order():
    parts = [line[len("# --- "):] for line in SOURCE.splitlines() if line.startswith("# --- Hopper:")]
    assert len(parts) == len(HOPPER_PARTS), parts
    for part, expected in zip(parts, HOPPER_PARTS, strict=True):
        assert part.startswith(expected), (part, expected)


def test_the_docstring_lists_the_sections_in_order():
    listed = " ".join(submission.__doc__.split())
    positions = [listed.lower().find(title.split(" and ")[0].lower()) for title in SECTIONS]
    assert -1 not in positions, list(zip(SECTIONS, positions, strict=True))
    assert positions == sorted(positions), list(zip(SECTIONS, positions, strict=True))


def _functions(source=SOURCE):
    return [node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)]


def _is_jit(node):
    return any(ast.unparse(d) in ("triton.jit", "gluon.jit") for d in node.decorator_list)


def _kernels(source=SOURCE):
    return [node.name for node in _functions(source) if _is_jit(node) and node.name.endswith("_kernel")]


def test_the_map_names_both_entry_points_and_every_kernel():
    kernels = _kernels()
    assert len(kernels) >= 7, kernels
    for name in ["custom_kernel", "get_mla_decode_metadata", "mla_decode_with_kvcache", *kernels]:
        assert name in submission.__doc__, name
    assert len(submission.__doc__.splitlines()) <= 45, "the map fits one screen"


def test_the_entry_points_come_first_and_are_typed():
    functions = [node.name for node in _functions()]
    entry = [functions.index(name) for name in ("custom_kernel", "get_mla_decode_metadata",
                                                 "mla_decode_with_kvcache")]
    assert max(entry) < functions.index("check_inputs"), "the entry points before everything they call"
    for node in _functions():
        if node.name in ("custom_kernel", "get_mla_decode_metadata", "mla_decode_with_kvcache"):
            assert node.returns is not None, node.name
            assert all(arg.annotation is not None for arg in node.args.args), node.name
    plan = submission.MlaDecodePlan()
    assert {"num_splits", "shape", "route", "kernel", "spans", "workspace", "launches"} <= set(vars(plan))
    assert submission.PlanShape._fields == ("batch", "s_q", "h_q", "page_size", "kv", "causal", "topk")


def test_the_serving_route_is_chosen_in_one_place():
    """SERVING_ROUTE_TABLE is read by serving_route alone, which names the kernel (aiter's route, the
    Hopper kernel by page size, the portable kernel for a cache TMA cannot read) and the span
    schedule; nothing else picks a serving kernel."""
    readers = {node.name for node in _functions()
               if any(isinstance(n, ast.Name) and n.id == "SERVING_ROUTE_TABLE" for n in ast.walk(node))}
    assert readers == {"serving_route"}, readers
    for name in ("AITER_SERVING_TABLE", "serving_route_row", "hopper_paged_kernel", "takes_span_kernel"):
        assert not hasattr(submission, name), name
    pickers = {node.name for node in _functions() if not _is_jit(node) and any(
               isinstance(n, ast.Name) and n.id == "_mla_decode_seesaw_kernel" for n in ast.walk(node))}
    assert pickers == {"serving_route"}, pickers


def test_no_function_has_too_many_parameters():
    for node in _functions():
        count = len(node.args.posonlyargs) + len(node.args.args) + len(node.args.kwonlyargs)
        limit = MAX_KERNEL_PARAMETERS if _is_jit(node) and node.name.endswith("_kernel") else MAX_PARAMETERS
        assert count <= limit, (node.name, count, limit)


def _positional_constant_runs(source):
    """[(line, callee)] of calls to the module's own functions with two or more constants (numbers,
    booleans, None) in a row among their positional arguments."""
    defined = {node.name for node in ast.parse(source).body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in defined:
            run = 0
            for arg in node.args:
                run = run + 1 if isinstance(arg, ast.Constant) and not isinstance(arg.value, str) else 0
                if run >= 2:
                    found.append((node.lineno, node.func.id))
                    break
    return found


def test_no_positional_runs_of_constants():
    assert _positional_constant_runs(SOURCE) == []
    assert _positional_constant_runs("def f(*a):\n    pass\nf(1, 0, 0)\n") == [(3, "f")]
    assert _positional_constant_runs("def f(*a, **k):\n    pass\nf(1, x=0, y=0)\n") == []


def test_no_probe_only_parameters():
    for node in _functions():
        assert "TRACE" not in [arg.arg for arg in node.args.args + node.args.kwonlyargs], node.name


def _comments(source):
    """[(line, text)] of every comment and docstring, without the serving route table's row comments
    (one short why per row may cite the notes' ids)."""
    table = next(node for node in ast.parse(source).body if isinstance(node, ast.Assign)
                 and getattr(node.targets[0], "id", None) == "SERVING_ROUTE_TABLE")
    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT and not table.lineno <= tok.start[0] <= table.end_lineno]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)) and ast.get_docstring(node):
            found.append((getattr(node, "lineno", 1), ast.get_docstring(node)))
    return found


def test_no_history_ids_or_speed_figures_in_the_comments():
    assert [(line, text) for line, text in _comments(SOURCE) if HISTORY.search(text)] == []
    assert [(line, text) for line, text in _comments(SOURCE) if SPEED.search(text)] == []
    planted = "SERVING_ROUTE_TABLE = [\n    # why (h42)\n]\n# faster (lab/NOTES.md h43)\nX = 1  # 1.24x the old\n"
    assert [text for _, text in _comments(planted) if HISTORY.search(text)] == ["# faster (lab/NOTES.md h43)"]
    assert [text for _, text in _comments(planted) if SPEED.search(text)] == ["# 1.24x the old"]


def test_no_section_uses_a_later_one_at_import_time():
    assert forward_references(SOURCE) == []


def test_the_layout_checks_can_fail():
    rule = RULE + "=" * 10
    wrong = f"{rule}\n# First\n{rule}\nA = B + 1\n\n{rule}\n# Second\n{rule}\nB = 2\ndef f():\n    return A\n"
    assert forward_references(wrong) == [("First", "B", "Second")]
    right = wrong.replace("A = B + 1", "def g():\n    return B")
    assert forward_references(right) == []
    assert [title for _, title in banners(wrong)] == ["First", "Second"]


@pytest.mark.parametrize("value, ok", [(submission.SM_SCALE, True), (1 / 24.0, True), (0.125, False),
                                       ("0.0417", False), (None, False)])
def test_sm_scale_is_the_constant_and_checked(value, ok):
    """Every route uses SM_SCALE; check_inputs refuses a config whose sm_scale differs (or is missing)
    with a ValueError naming it, instead of computing with another scale than the caller asked for."""
    batch = 2
    q = torch.zeros(batch, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(batch * 4, 1, 576, dtype=torch.bfloat16)
    indptr = torch.arange(batch + 1, dtype=torch.int32)
    config = {"batch_size": batch, "q_seq_len": 1, "kv_seq_len": 4, "sm_scale": value}
    args = (q, {"bf16": kv}, indptr, indptr * 4, config)
    if ok:
        assert submission.check_inputs(*args)[3:] == (batch, batch * 4)
    else:
        with pytest.raises(ValueError, match=r'config\["sm_scale"\]'):
            submission.check_inputs(*args)
    del config["sm_scale"]
    with pytest.raises(ValueError, match=r'config\["sm_scale"\] is missing'):
        submission.check_inputs(*args)

"""submission.py reads top to bottom: banner sections in a fixed order, none of which refers at import
time to a name that a later section defines; the module docstring lists them; sm_scale is handled one
way (the constant, checked)."""
import ast
from pathlib import Path

import pytest
import torch

import submission

SOURCE = Path(submission.__file__).read_text()
SECTIONS = (  # titles (their first words) in reading order: each part after what it depends on
    "Constants",
    "Input checks",
    "Host machinery",
    "Triton kernels and their routes",
    "The Hopper route",
    "aiter routes",
    "Route registry",
    "Route tables",
    "Router and custom_kernel",
    "Serving API",
    "Candidate race",
)
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


def test_the_docstring_lists_the_sections_in_order():
    listed = " ".join(submission.__doc__.split())
    positions = [listed.lower().find(title.split(" and ")[0].lower()) for title in SECTIONS[1:]]
    assert -1 not in positions, list(zip(SECTIONS[1:], positions, strict=True))
    assert positions == sorted(positions), list(zip(SECTIONS[1:], positions, strict=True))


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

#!/usr/bin/env python3
"""Check a submission file against every gate the leaderboard service applies before it runs it.

    python tools/preflight.py [FILE]      # FILE defaults to submission.py at the repository root

Prints one line per blocking finding (``FILE:LINE: [rule] reason``), then ``PASS`` or ``FAIL`` as
the last line; exit code 0 or 1. From Python: ``preflight.check_file(path)`` (or ``check_bytes``)
returns the list of ``Finding``s, empty when the file passes.

The gates, in the order checked here (about the service's own order; sources: the service's code,
gpu-mode/kernelbot, as summarised in docs/runner.md ("The upload gates")):

    file-name      the name must end in .py, .cu, .cuh or .cpp
    empty          an empty file is refused
    size           more than 1,000,000 bytes is refused (HTTP 413)
    utf-8          the bytes must decode as UTF-8 (the service decodes strictly), without a BOM
    stream-word    the lower-cased text must not contain the substring "stream" anywhere:
                   identifiers, comments, strings, docstrings (HTTP 500 "work on another stream")
    popcorn        the first comment block must hold ``#!POPCORN leaderboard amd-mixed-mla`` and
                   ``#!POPCORN gpu MI355X``, parsed as the service parses it
    syntax         Python 3.10's grammar (the runner has 3.12; the project's minimum is 3.10)
    custom-kernel  a top-level ``def custom_kernel`` (the runner does
                   ``from submission import custom_kernel``)
    kernelguard-P  KernelGuard 0.3.1 (the version the service pins) under each profile P of
                   KERNELGUARD_PROFILES: a finding when its classification is not "valid" or
                   should_filter is true. The service refuses only should_filter; a non-"valid"
                   class is held as blocking here too, to keep a margin.
    kernelguard    KernelGuard missing or not version 0.3.1: the verdict cannot be trusted.

KernelGuard runs in this process: ``configure_runtime(profile=P)`` then ``analyze_code(code,
compute_structural_hash=False)`` is exactly what ``kernelguard --api-mode --profile P`` does with
the code it reads from stdin (kernelguard.py ``main``); the module's runtime configuration is
restored afterwards. tests/cpu/test_preflight.py checks the two agree.
"""
from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import importlib
import importlib.metadata
import re
import sys
import warnings
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FILE = REPO_ROOT / "submission.py"

# --- the service's limits, as data -------------------------------------------------------------
ALLOWED_SUFFIXES = (".py", ".cu", ".cuh", ".cpp")
MAX_BYTES = 1_000_000
FORBIDDEN_WORD = "stream"
LEADERBOARD = "amd-mixed-mla"
GPUS = ("MI355X",)
DIRECTIVE_TAGS = ("#!POPCORN", "//!POPCORN")
PYTHON_GRAMMAR = (3, 10)
ENTRYPOINT = "custom_kernel"
KERNELGUARD_VERSION = "0.3.1"
KERNELGUARD_PROFILES = ("default", "strict")
KERNELGUARD_INSTALL_HINT = (
    f".venv/bin/python -m pip install kernelguard=={KERNELGUARD_VERSION} "
    "(requirements.txt pins it, as the service does)"
)
MAX_SHOWN_CHARS = 120  # longest excerpt of a source line printed in a finding

# Matches Python's own line numbering (the tokenizer's newlines), not str.splitlines(), which also
# splits on form feeds and other separators Python treats as ordinary characters.
_LINE_BREAK = re.compile(r"\r\n|\r|\n")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One blocking problem: the gate (rule) it breaks, the 1-based line (None: the whole file)."""

    rule: str
    line: int | None
    message: str

    def format(self, name: str) -> str:
        """``name:line: [rule] message`` (``name: [rule] message`` without a line)."""
        where = f"{name}:{self.line}" if self.line is not None else name
        return f"{where}: [{self.rule}] {self.message}"


@dataclasses.dataclass
class Submission:
    """What the gates look at: the upload's name and bytes, then its text and tree once known."""

    name: str
    data: bytes
    text: str | None = None
    tree: ast.Module | None = None


def _excerpt(line: str) -> str:
    """A source line, trimmed to MAX_SHOWN_CHARS, for a finding's message."""
    line = line.strip()
    return line if len(line) <= MAX_SHOWN_CHARS else line[: MAX_SHOWN_CHARS - 3] + "..."


# --- gates on the bytes ------------------------------------------------------------------------

def check_file_name(sub: Submission) -> list[Finding]:
    """The service accepts only these suffixes (kernelbot prepare_submission)."""
    if sub.name.endswith(ALLOWED_SUFFIXES):
        return []
    return [Finding("file-name", None,
                    f"file name {sub.name!r} must end in {', '.join(ALLOWED_SUFFIXES)}")]


def check_empty(sub: Submission) -> list[Finding]:
    """The upload API refuses an empty file (HTTP 400)."""
    return [] if sub.data else [Finding("empty", None, "the file is empty")]


def check_size(sub: Submission) -> list[Finding]:
    """The upload API refuses more than MAX_BYTES bytes (HTTP 413)."""
    if len(sub.data) <= MAX_BYTES:
        return []
    return [Finding("size", None, f"{len(sub.data):,} bytes; the service refuses more than "
                                  f"{MAX_BYTES:,}")]


def check_utf8(sub: Submission) -> list[Finding]:
    """The service decodes the bytes as UTF-8, strictly; on success sub.text is set.

    The later text gates are skipped for undecodable bytes: the service never gets that far."""
    try:
        sub.text = sub.data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = sub.data.count(b"\n", 0, exc.start) + 1
        return [Finding("utf-8", line, f"not UTF-8: byte offset {exc.start} "
                                       f"({sub.data[exc.start:exc.start + 1]!r}): {exc.reason}")]
    if sub.text.startswith("\ufeff"):
        return [Finding("utf-8", 1, "starts with a byte-order mark: the service keeps it in the "
                                    "text, so line 1 is no directive; save without the BOM")]
    return []


# --- gates on the text -------------------------------------------------------------------------

def check_forbidden_word(sub: Submission) -> list[Finding]:
    """Every line whose lower-cased text contains FORBIDDEN_WORD.

    The upload API does ``"stream" in code.lower()`` on the whole text and refuses any hit, so
    comments, strings and parts of identifiers count. str.lower() works per character, so testing
    line by line finds exactly the hits of the whole-text test."""
    return [Finding("stream-word", number, f"contains {FORBIDDEN_WORD!r} (any case; the upload "
                                           f"API refuses it anywhere): {_excerpt(line)}")
            for number, line in enumerate(_LINE_BREAK.split(sub.text), start=1)
            if FORBIDDEN_WORD in line.lower()]


def _read_directives(text: str) -> tuple[dict[str, tuple[int, list[str]]], list[Finding]]:
    """The POPCORN directives as the service reads them (kernelbot _get_popcorn_directives).

    Only the first comment block counts: lines from the top that start with '#' or '//'. Returns
    {"leaderboard"|"gpus": (line, values)} and the findings the service would raise an error for.
    """
    found: dict[str, tuple[int, list[str]]] = {}
    findings: list[Finding] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.startswith(("//", "#")):
            break
        args = line.split()
        if not args or args[0] not in DIRECTIVE_TAGS:
            continue
        if len(args) < 3:
            findings.append(Finding("popcorn", number, f"directive without a value: {line!r}"))
            continue
        key = {"gpu": "gpus"}.get(args[1].strip().lower(), args[1].strip().lower())
        if key not in ("leaderboard", "gpus"):
            findings.append(Finding("popcorn", number, f"unknown directive {args[1]!r}"))
        elif key in found:
            findings.append(Finding("popcorn", number, f"second {key!r} directive (first on "
                                                       f"line {found[key][0]})"))
        else:
            found[key] = (number, args[2:] if key == "gpus" else args[2:3])
    return found, findings


def check_popcorn_directives(sub: Submission) -> list[Finding]:
    """The leaderboard and GPU directives, present in the first comment block and right.

    The service takes the leaderboard from the directive (the CLI may also name one; they must
    match), so a missing or different name sends the file elsewhere or nowhere."""
    found, findings = _read_directives(sub.text)
    expected = {"leaderboard": ("leaderboard", [LEADERBOARD]), "gpus": ("gpu", list(GPUS))}
    for key, (word, values) in expected.items():
        wanted = f"#!POPCORN {word} {' '.join(values)}"
        if key not in found:
            findings.append(Finding("popcorn", 1, f"missing {wanted!r} in the first comment block "
                                                  "(lines from the top starting with '#')"))
        elif found[key][1] != values:
            line, got = found[key]
            findings.append(Finding("popcorn", line, f"{word} is {' '.join(got)!r}; expected "
                                                     f"{wanted!r}"))
    return findings


# ast node types newer than PYTHON_GRAMMAR (3.10): except* (3.11), the PEP 695 type statement
# (3.12); any node with non-empty type_params (PEP 695 generics, 3.12) is newer as well.
_NEWER_NODE_TYPES = frozenset({"TryStar", "TypeAlias"})


def _newer_construct_line(text: str) -> int | None:
    """The first line of a construct newer than PYTHON_GRAMMAR, found with this Python's grammar.

    Why: for its feature_version checks CPython reports the line of the token after the construct
    (e.g. the statement after a whole try/except* block), not the construct's own line."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except SyntaxError:
        return None
    lines = []
    for node in ast.walk(tree):
        if type(node).__name__ == "TryStar":  # the except* line, not the try line
            lines.append(node.handlers[0].lineno)
        elif type(node).__name__ in _NEWER_NODE_TYPES or getattr(node, "type_params", None):
            lines.append(node.lineno)
    return min(lines, default=None)


def check_syntax(sub: Submission) -> list[Finding]:
    """Parses under PYTHON_GRAMMAR (feature_version); on success sub.tree is set.

    SyntaxWarnings (e.g. invalid escapes) are not the service's business and are silenced."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sub.tree = ast.parse(sub.text, filename=sub.name, feature_version=PYTHON_GRAMMAR)
    except SyntaxError as exc:
        version = ".".join(map(str, PYTHON_GRAMMAR))
        line = exc.lineno
        if "only supported in Python" in (exc.msg or ""):
            line = _newer_construct_line(sub.text) or line
        return [Finding("syntax", line, f"not valid Python {version}: {exc.msg}")]
    return []


def check_entrypoint(sub: Submission) -> list[Finding]:
    """A module-level ``def custom_kernel`` (plain, not async: the runner calls it and times it)."""
    if sub.tree is None:
        return []  # the syntax gate already reported why there is no tree
    for node in sub.tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == ENTRYPOINT:
            return []
        if isinstance(node, ast.AsyncFunctionDef) and node.name == ENTRYPOINT:
            return [Finding("custom-kernel", node.lineno,
                            f"{ENTRYPOINT} is async; the runner calls it as a plain function")]
    return [Finding("custom-kernel", None, f"no top-level 'def {ENTRYPOINT}(data)'")]


# --- KernelGuard -------------------------------------------------------------------------------

def load_kernelguard() -> ModuleType:
    """The kernelguard module (raises ImportError when it is not installed)."""
    return importlib.import_module("kernelguard")


def kernelguard_version() -> str | None:
    """The installed kernelguard distribution's version, None when unknown."""
    try:
        return importlib.metadata.version("kernelguard")
    except importlib.metadata.PackageNotFoundError:
        return None


def kernelguard_verdict(code: str, profile: str, kg: ModuleType | None = None) -> dict:
    """What ``kernelguard --api-mode --profile PROFILE`` prints for ``code`` on stdin, as a dict.

    Same two calls as its main(); the module-wide configuration they set is put back after."""
    kg = kg or load_kernelguard()
    saved = copy.deepcopy(kg.ACTIVE_RUNTIME_CONFIG)
    try:
        kg.configure_runtime(profile=profile)
        return kg.analyze_code(code, compute_structural_hash=False)
    finally:
        kg.apply_runtime_config(saved)


def _describe_patterns(verdict: dict) -> str:
    """``PATTERN (severity): evidence; ...`` for a verdict's matched patterns."""
    parts = [f"{p.get('pattern')} ({p.get('severity')}): {p.get('evidence')}"
             for p in verdict.get("matched_patterns", [])]
    return "; ".join(parts) if parts else "no patterns"


def check_kernelguard(sub: Submission) -> list[Finding]:
    """KernelGuard's verdict under each of KERNELGUARD_PROFILES; a missing or other version fails.

    KernelGuard gives no line numbers, so these findings are about the whole file."""
    try:
        kg = load_kernelguard()
    except ImportError as exc:
        return [Finding("kernelguard", None, f"kernelguard is not installed ({exc}); install it: "
                                             f"{KERNELGUARD_INSTALL_HINT}")]
    version = kernelguard_version()
    if version != KERNELGUARD_VERSION:
        return [Finding("kernelguard", None, f"kernelguard {version} installed; the service pins "
                                             f"{KERNELGUARD_VERSION}: {KERNELGUARD_INSTALL_HINT}")]
    findings = []
    for profile in KERNELGUARD_PROFILES:
        verdict = kernelguard_verdict(sub.text, profile, kg)
        if verdict["classification"] != "valid" or verdict["should_filter"]:
            refused = ("the service refuses it" if verdict["should_filter"]
                       else "not refused by the service, blocking here")
            findings.append(Finding(
                f"kernelguard-{profile}", None,
                f"classification {verdict['classification']!r}, should_filter "
                f"{verdict['should_filter']} ({refused}); matched: {_describe_patterns(verdict)}"))
    return findings


# --- the gates, in order -----------------------------------------------------------------------

# (gate, needs): "bytes" gates always run; "text" gates need the UTF-8 text of a non-empty file;
# "upload" gates also need a file within MAX_BYTES: the service refuses a larger one before
# KernelGuard sees it, and KernelGuard's regular expressions can take minutes on a megabyte.
GATES = (
    (check_file_name, "bytes"),
    (check_empty, "bytes"),
    (check_size, "bytes"),
    (check_utf8, "bytes"),
    (check_forbidden_word, "text"),
    (check_popcorn_directives, "text"),
    (check_syntax, "text"),
    (check_entrypoint, "text"),
    (check_kernelguard, "upload"),
)


def check_bytes(data: bytes, name: str = "submission.py") -> list[Finding]:
    """All findings for a file of these bytes uploaded under this name; empty means PASS.

    Text gates are skipped for an empty or undecodable file, KernelGuard also for an oversized
    one (see GATES)."""
    sub = Submission(name=name, data=data)
    findings: list[Finding] = []
    for gate, needs in GATES:
        has_text = sub.text is not None and bool(sub.data)
        if needs == "text" and not has_text:
            continue
        if needs == "upload" and not (has_text and len(sub.data) <= MAX_BYTES):
            continue
        findings.extend(gate(sub))
    return findings


def check_file(path: str | Path = DEFAULT_FILE) -> list[Finding]:
    """All findings for the file at ``path`` (uploaded under its base name); empty means PASS."""
    path = Path(path)
    return check_bytes(path.read_bytes(), name=path.name)


def main(argv: list[str] | None = None) -> int:
    """CLI: print each finding, then PASS or FAIL; return the exit code (0 pass, 1 fail)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", nargs="?", default=str(DEFAULT_FILE),
                        help="the submission file (default: submission.py at the repository root)")
    args = parser.parse_args(argv)
    path = Path(args.file)
    if not path.is_file():
        print(f"{path}: [file] no such file")
        print("FAIL")
        return 1
    findings = check_file(path)
    for finding in findings:
        print(finding.format(str(path)))
    print("FAIL" if findings else "PASS")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
